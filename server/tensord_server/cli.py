"""The ``tensord`` command line: one subcommand per module, imported lazily.

Each subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``.
The top-level parser knows only the subcommands' names and one-line help, so
``tensord --help`` and ``tensord serve`` import nothing of ``replay`` or
``loadtest`` (nor Locust, matplotlib or the SDK): a subcommand's module is
imported only once that subcommand is chosen, and builds its own parser then.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

# subcommand -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("tensord_server.tools.serve", "run the tensord server"),
    "replay": ("tensord_server.tools.replay", "replay an allocator trace through the pool"),
    "stats": ("tensord_server.tools.admin", "print a server's memory_stats() for one device"),
    "summary": ("tensord_server.tools.admin", "print a server's memory_summary() for one device"),
    "snapshot": ("tensord_server.tools.admin", "save a server's memory snapshot for memory_viz"),
    "empty-cache": ("tensord_server.tools.admin", "return a server's cached, unused segments"),
    "loadtest": (
        "tensord_server.tools.loadtest.runner",
        "load-test a server's fragmentation with Locust",
    ),
}

# What a shell reports for a process killed by SIGPIPE (128 + 13), as `yes | head` does.
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE


class _PrintVersion(argparse.Action):
    """``--version``: the version is read only when asked (importing the SDK costs gRPC)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        from tensord.protocol import VERSION

        print(f"tensord {VERSION}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    """The top level: a subcommand's name, then everything after it for that subcommand."""
    width = max(len(name) for name in SUBCOMMANDS)
    commands = "\n".join(
        f"  {name:<{width}}  {help_text}" for name, (_, help_text) in SUBCOMMANDS.items()
    )
    parser = argparse.ArgumentParser(
        prog="tensord",
        description="tensord: a networked tensor memory service",
        epilog=f"commands:\n{commands}\n\n'tensord COMMAND --help' shows a command's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action=_PrintVersion, help="print tensord's version and exit")
    parser.add_argument("command", choices=SUBCOMMANDS, metavar="COMMAND")
    # REMAINDER after a positional takes options too: `tensord replay --json x` keeps `--json`.
    rest = parser.add_argument("arguments", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    rest.required = False  # it may be empty; Python 3.11 marks every REMAINDER required
    return parser


def build_subcommand_parser(name: str) -> argparse.ArgumentParser:
    """The parser of one subcommand; imports that subcommand's module (and only it)."""
    module_name, help_text = SUBCOMMANDS[name]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"tensord {name}", description=help_text)
    module.add_arguments(parser)
    parser.set_defaults(command=name, handler=module.run)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    top = build_parser().parse_args(argv)
    return build_subcommand_parser(top.command).parse_args(top.arguments)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        status = int(args.handler(args))
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit flush
    except BrokenPipeError:
        # The reader left (`tensord stats | head`): say nothing more, as cat does.  Python
        # flushes stdout again at exit, so point it at devnull or that flush fails too.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_BROKEN_PIPE
    return status


if __name__ == "__main__":
    sys.exit(main())
