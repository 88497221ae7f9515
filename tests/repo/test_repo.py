"""Repository promises: generated code is fresh, CI runs the README's test command, nothing
reaches outside the checkout, and no file names an issue number."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


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


def test_every_test_folder_is_on_the_pytest_pythonpath() -> None:
    """The tests live in folders by layer and import the shared helpers and each other's
    modules by bare name: a folder missing from pytest's ``pythonpath`` would import only
    when pytest happened to collect one of its files first."""
    import tomllib

    pytest_options = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]
    on_path = set(pytest_options["ini_options"]["pythonpath"])
    folders = {p.parent.relative_to(REPO).as_posix() for p in (REPO / "tests").rglob("test_*.py")}
    assert folders - on_path == set(), "add these to pythonpath in pyproject.toml"


# The Python trees the linters hold to the project's style (README's code blocks are prose).
PYTHON_TREES = ("client", "server", "tests", "benchmarks", "scripts", "loadtest")


@pytest.mark.parametrize(
    "command",
    [
        ("ruff", "check", "."),
        ("ruff", "format", "--check", *PYTHON_TREES),
        # its files and strictness are configured in pyproject.toml; half a minute
        pytest.param(("mypy",), marks=pytest.mark.slow),
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


# -- everything the repository uses lives in it ------------------------------------
# A checkout must work alone: a fresh clone has no folder beside it and no path of the
# machine it was written on.  Each pattern names one way a file has reached outside.
# (This file spells its own samples in pieces, so it passes its own check unexcused.)
OUTSIDE_PATTERNS: dict[str, re.Pattern[str]] = {
    # a path of one machine: the build machine's work folder, someone's home
    "an absolute path of one machine": re.compile(r"(?<![\w.:/-])/(?:work|home|root|Users)/\w"),
    # the folder of the project's common files, beside a checkout on the build machine only
    "the project's common folder beside the checkout": re.compile(
        r"\bshared/(?:traces|DESIGN|STYLE|hooks)\b|[\"']shared[\"']|\bshared (?:folder|directory)\b"
    ),
    # the parent of a REPO or ROOT path: the folder that holds the checkout
    "a parent of the repository root": re.compile(r"\b\w*(?:REPO|ROOT)\w*\.parents?\b"),
}

# `../x` (climbed from the file's own folder) and `Path(__file__)...parent` chains
RELATIVE_PATH = re.compile(r"(?<![\w.])(?:\.\./)+[\w.-]*")
FILE_PARENTS = re.compile(r"Path\(__file__\)(?:\.resolve\(\))?((?:\.parent\b|\.parents\[\d+\])+)")


def tracked_text_files() -> list[tuple[str, str]]:
    """(path, text) of every tracked file that is text (binary files hold no paths we write)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=False, timeout=60
    )
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    files = []
    for name in listed.stdout.decode().split("\0"):
        path = REPO / name
        if not name or not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue
        files.append((name, data.decode("utf-8", errors="replace")))
    return files


def climbs_out(name: str, text: str) -> list[str]:
    """How ``text`` (the file ``name``, relative to the repository) reaches outside it."""
    found = [
        f"{what}: {match.group(0)!r}"
        for what, pattern in OUTSIDE_PATTERNS.items()
        for match in pattern.finditer(text)
    ]
    folder = (REPO / name).parent
    for match in RELATIVE_PATH.finditer(text):
        target = (folder / match.group(0)).resolve()
        if not target.is_relative_to(REPO):
            found.append(f"a relative path out of the repository: {match.group(0)!r}")
    depth = len(Path(name).parts)  # this many parents of the file is the repository root
    for match in FILE_PARENTS.finditer(text):
        steps = match.group(1)
        climbed = steps.count(".parent") - steps.count(".parents[")
        climbed += sum(int(k) + 1 for k in re.findall(r"\.parents\[(\d+)\]", steps))
        if climbed > depth:
            found.append(f"a parent of the repository root: {match.group(0)!r}")
    return found


def test_no_tracked_file_refers_to_a_path_outside_the_repository() -> None:
    escapes = {
        name: found for name, text in tracked_text_files() if (found := climbs_out(name, text))
    }
    assert escapes == {}, "\n".join(f"{name}: {found}" for name, found in escapes.items())


def test_the_outside_path_check_finds_each_kind_of_escape() -> None:
    # Put together from pieces, so that this file itself names no outside path.
    up, common, parents = "../", "SHARED".lower(), "Path(__file__).resolve()" + ".parent" * 3
    escapes = {
        "README.md": f"tensord replay {up}{common}/traces/x.events.json.gz",
        "docker-compose.yml": f"      - {up}{up}data:/traces:ro",
        "tests/test_x.py": "TRACE = Path(__file__).resolve().parents[1]" + '.parent / "t.gz"',
        "tests/test_y.py": "SHARED = REPO_ROOT" + f'.parent / "{common}" / "traces"',
        "tests/test_w.py": f"TRACES = {parents}",
        "docs/x.md": f"The design is in `DESIGN.md` of the project's {common} folder.",
        "benchmarks/b.py": f'open("/work/{common}/STYLE.md")',
        "scripts/s.sh": "cp out /" + "home/alice/",
    }
    for name, text in escapes.items():
        assert climbs_out(name, text), (name, text)
    fine = {
        "docs/design.md": f"see [the README]({up}README.md) and `server/tensord_server/data/`",
        "server/tensord_server/loadtest.py": parents,
        "tests/test_z.py": "REPO = Path(__file__).resolve().parent.parent",
        "README.md": "a shared pool; named tensors are shared: see /tmp/x and https://h/work/1",
    }
    for name, text in fine.items():
        assert climbs_out(name, text) == [], (name, text)


def _requirement_name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_every_test_requirement_is_pinned_by_the_constraints() -> None:
    """What the tests compare against cannot drift: the constraints the README's test command
    installs with pin every runtime and test requirement to one version."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = {_requirement_name(r) for r in project["dependencies"]}
    wanted |= {_requirement_name(r) for r in project["optional-dependencies"]["test"]}
    pinned = {}
    for line in (REPO / "tests" / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep and version.strip(), f"not pinned to one version: {line!r}"
            pinned[_requirement_name(name)] = version.strip()
    assert wanted - pinned.keys() == set(), "pin these in tests/constraints.txt"
    assert "-c tests/constraints.txt" in next(c for c in readme_commands() if "pytest" in c)


# -- behaviours named, not issue numbers ---------------------------------------------
# A reader of the code, the docs or a test's name has no issue tracker: a comment says what
# the code guards and why, a test is named after the behaviour it holds.  (This file spells
# its own samples in pieces, so it passes its own check.)
ISSUE_NUMBER = re.compile(r"\bissues?\s*#?\d+", re.IGNORECASE)
# What the rule covers: these trees and files of the checkout.
ISSUE_NUMBER_TREES = ("client/", "server/", "proto/", "docs/", "benchmarks/", "tests/", "scripts/")
ISSUE_NUMBER_FILES = ("README.md", "SECURITY.md")
# Trees the rule skips (none: every tree is clean).
ISSUE_NUMBERS_NOT_YET_CHECKED_UNDER: tuple[str, ...] = ()


def issue_number_lines(text: str) -> list[str]:
    """The lines of ``text`` that name an issue by its number."""
    return [line.strip() for line in text.splitlines() if ISSUE_NUMBER.search(line)]


def held_to_the_issue_number_rule(name: str) -> bool:
    covered = name.startswith(ISSUE_NUMBER_TREES) or name in ISSUE_NUMBER_FILES
    return covered and not name.startswith(ISSUE_NUMBERS_NOT_YET_CHECKED_UNDER)


def test_no_tracked_file_names_an_issue_number() -> None:
    found = {
        name: lines
        for name, text in tracked_text_files()
        if held_to_the_issue_number_rule(name) and (lines := issue_number_lines(text))
    }
    assert found == {}, "name the behaviour instead:\n" + "\n".join(
        f"{name}: {line}" for name, lines in found.items() for line in lines
    )


def test_the_issue_number_check_finds_each_kind() -> None:
    issue = "iss" + "ue"  # in pieces: this file names no issue number itself
    for line in (
        f"Targets ({issue} 5): to(device) >= 0.7x the bare copy",
        f'title = f"many clients ({issue} 15), {{seconds:g}} s each"',
        f"# see {issue} #4",
        f"The GPU checks ({issue}s 5, 13, 17) in one go",
        f'"""{issue.title()} 14: complex views against torch."""',
        f"{issue.upper()}#18",
    ):
        assert issue_number_lines(line), line
    for line in (
        "the SDK issues a release after the next call",
        "a token this session issued",
        "what the applied ops issued, in op order",
    ):
        assert issue_number_lines(line) == [], line
    assert held_to_the_issue_number_rule("benchmarks/bench_rpc.py")
    assert held_to_the_issue_number_rule("server/tensord_server/observability/metrics.py")
    assert held_to_the_issue_number_rule("SECURITY.md")
    assert not held_to_the_issue_number_rule("deploy/grafana/dashboards/tensord.json")
