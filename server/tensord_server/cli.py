"""The ``tensord`` command line: one subcommand per module, imported lazily.

Each subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``,
so the CLI stays a table and importing it costs nothing.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# subcommand -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("tensord_server.serve", "run the tensord server"),
    "replay": ("tensord_server.replay", "replay an allocator trace through the pool"),
    "stats": ("tensord_server.admin", "print a server's memory_stats() for one device"),
    "summary": ("tensord_server.admin", "print a server's memory_summary() for one device"),
    "snapshot": ("tensord_server.admin", "save a server's memory snapshot for memory_viz"),
    "empty-cache": ("tensord_server.admin", "return a server's cached, unused segments"),
    "loadtest": ("tensord_server.loadtest", "load-test a server's fragmentation with Locust"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tensord", description="tensord: a networked tensor memory service"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(sub_parser)
        sub_parser.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._run(args))


if __name__ == "__main__":
    sys.exit(main())
