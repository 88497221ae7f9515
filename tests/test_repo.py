"""Repository promises: generated code is fresh, CI runs the README's test command."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    return re.findall(r"```bash\n(.+?)\n```", text)


def test_generated_proto_code_is_fresh() -> None:
    pytest.importorskip("grpc_tools")
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gen_proto.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, f"run scripts/gen_proto.py: {result.stdout}{result.stderr}"


def test_ci_runs_the_readme_test_command() -> None:
    commands = readme_commands()
    test_commands = [c for c in commands if "pytest" in c]
    assert len(test_commands) == 1, commands
    ci_lines = (REPO / ".ci" / "run").read_text().splitlines()
    assert test_commands[0] in ci_lines


def test_readme_server_command_uses_the_console_script() -> None:
    commands = readme_commands()
    assert any(c.endswith("tensord serve") for c in commands), commands


# The Python trees the linters hold to the project's style (README's code blocks are prose).
PYTHON_TREES = ("client", "server", "tests", "benchmarks", "scripts", "loadtest")


@pytest.mark.parametrize(
    "command",
    [
        ("ruff", "check", "."),
        ("ruff", "format", "--check", *PYTHON_TREES),
        ("mypy",),  # its files and strictness are configured in pyproject.toml
    ],
    ids=["ruff-check", "ruff-format", "mypy"],
)
def test_the_code_passes_the_linters(command: tuple[str, ...]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", *command],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert result.returncode == 0, f"{' '.join(command)}:\n{result.stdout}{result.stderr}"
