"""The ``tensord`` command line itself: lazy subcommand imports, output into a closed pipe."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import RunningServer
from tensord_server import cli

# The modules of the heavy subcommands and what they pull in.
HEAVY = (
    "tensord_server.tools.loadtest.runner",
    "tensord_server.tools.replay",
    "tensord_server.tools.serve",
    "tensord_server.tools.admin",
    "tensord_server.rpc.grpc_server",
    "tensord",  # the SDK, and with it gRPC
    "grpc",
    "numpy",
    "locust",
    "matplotlib",
)


def imported_after(code: str) -> set[str]:
    """The top modules and ``tensord_server.*`` modules a fresh interpreter holds after ``code``."""
    script = (
        "import json, sys\n"
        "from tensord_server import cli\n"
        f"{code}\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    completed = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    modules: list[str] = json.loads(completed.stdout.splitlines()[-1])
    return {m for m in modules if m.startswith("tensord_server.") or "." not in m}


def test_help_imports_no_subcommand() -> None:
    loaded = imported_after(
        "try:\n    cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
        "cli.build_parser().parse_args(['loadtest', '-u', '20', '-t', '20s'])"
    )
    assert loaded.isdisjoint(HEAVY), sorted(loaded & set(HEAVY))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("argv", "imports"),
    [
        (["stats", "--address", "127.0.0.1:1"], "tensord_server.tools.admin"),
        (["serve", "--address", "127.0.0.1:0"], "tensord_server.tools.serve"),
        (["replay", "--list"], "tensord_server.tools.replay"),
    ],
)
def test_a_subcommand_imports_its_own_module_only(argv: list[str], imports: str) -> None:
    loaded = imported_after(f"cli.parse_args({argv!r})")
    assert imports in loaded
    others = {module for module, _ in cli.SUBCOMMANDS.values()} - {imports}
    assert loaded.isdisjoint(others | {"locust", "matplotlib"}), sorted(loaded & others)


def test_subcommand_options_still_parse() -> None:
    args = cli.parse_args(["snapshot", "--address", "a:1", "-o", "x.pickle"])
    assert (args.command, args.address, args.output) == ("snapshot", "a:1", "x.pickle")
    args = cli.parse_args(["replay", "--json", "t.events.json.gz", "--capacity", "5"])
    assert (args.trace, args.json, args.capacity) == ("t.events.json.gz", True, 5)
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args(["nope"])
    assert exit_info.value.code == 2


@pytest.mark.slow
def test_stats_into_a_closed_pipe_exits_quietly(server: RunningServer) -> None:
    # `tensord stats | head`: the reader is gone before the command writes.
    with subprocess.Popen(
        [sys.executable, "-m", "tensord_server", "stats", "--address", server.address],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()
        stderr = proc.stderr.read()
        status = proc.wait(timeout=60)
    assert status == 141, stderr  # 128 + SIGPIPE, what a shell reports for `cat` there
    assert stderr == ""  # no BrokenPipeError traceback, no "Exception ignored" at exit


@pytest.mark.slow
def test_summary_of_a_host_pool_speaks_of_no_gpu(server: RunningServer) -> None:
    # the cpu pool's table said "CUDA OOMs", "cudaMalloc retries", "GPU reserved memory"
    result = subprocess.run(
        [sys.executable, "-m", "tensord_server", "summary", "--address", server.address],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "tensord memory summary, device cpu" in result.stdout
    assert "Reserved memory" in result.stdout and "OOMs: 0" in result.stdout
    for word in ("GPU", "CUDA", "cuda"):
        assert word not in result.stdout, result.stdout
