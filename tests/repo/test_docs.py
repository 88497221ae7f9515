"""The documentation: the site builds with warnings as errors and fetches nothing from the
internet, the generated pages are fresh, the examples run, and the README stays a README."""

from __future__ import annotations

import html.parser
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"


# -- the site ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        pytest.importorskip(module)
    out = tmp_path_factory.mktemp("site")
    # mkdocs.yml names client/ and server/ for the API pages and reads SECURITY.md
    # relative to the repository root, so the build runs from there
    env = os.environ | {"NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert result.returncode == 0, f"mkdocs build --strict:\n{result.stdout}{result.stderr}"
    return out


@pytest.mark.slow
def test_the_site_builds_with_warnings_as_errors(site: Path) -> None:
    for page in (
        "index.html",
        "getting-started.html",
        "concepts.html",
        "troubleshooting.html",
        "benchmarks.html",
        "reference/cli.html",
        "reference/limits.html",
    ):
        assert (site / page).is_file(), page


@pytest.mark.slow
def test_the_api_reference_is_built_from_the_docstrings(site: Path) -> None:
    tensor = (site / "reference" / "api" / "tensor.html").read_text()
    client = (site / "reference" / "api" / "client.html").read_text()
    for anchor in ('id="tensord.Tensor"', 'id="tensord.Tensor.view"', 'id="tensord.Tensor.share"'):
        assert anchor in tensor, anchor
    for anchor in ('id="tensord.connect"', 'id="tensord.Client"', 'id="tensord.Client.attach"'):
        assert anchor in client, anchor
    assert ":::" not in tensor + client  # no directive left unrendered


@pytest.mark.slow
def test_the_limits_page_is_security_md_s_table(site: Path) -> None:
    page = (site / "reference" / "limits.html").read_text()
    assert "--8&lt;--" not in page and "--8<--" not in page
    # rows of SECURITY.md's table, included from there
    security = (REPO / "SECURITY.md").read_text()
    table = security.split("[start:limits]", 1)[1].split("[end:limits]", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ")][2:]
    assert len(rows) > 20
    for constant in re.findall(r"`(limits\.MAX_\w+|protocol\.MAX_\w+)`", table):
        assert constant in page, constant
    # and the page keeps no copy of its own: one source
    source = (DOCS / "reference" / "limits.md").read_text()
    assert '--8<-- "SECURITY.md:limits"' in source
    assert not [line for line in source.splitlines() if line.startswith("|")]


class _Fetches(html.parser.HTMLParser):
    """What a page makes the browser fetch by itself: scripts, styles, fonts, icons, images."""

    FETCHING_RELS = frozenset(
        {"stylesheet", "preconnect", "preload", "modulepreload", "dns-prefetch", "icon"}
    )

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = {name: value or "" for name, value in attrs}
        if tag in ("script", "img", "iframe", "source", "audio", "video", "embed"):
            self.urls.append(values.get("src", ""))
        elif tag == "link" and self.FETCHING_RELS & set(values.get("rel", "").split()):
            self.urls.append(values.get("href", ""))
        self.urls.extend(re.findall(r"url\(\s*['\"]?([^'\")]+)", values.get("style", "")))

    def handle_data(self, data: str) -> None:
        # inline <style>: @import and url() inside it
        self.urls.extend(re.findall(r"@import\s+['\"]([^'\"]+)", data))
        self.urls.extend(re.findall(r"url\(\s*['\"]?([^'\")]+)", data))


def external_fetches(text: str, is_css: bool = False) -> list[str]:
    """The URLs a page or style sheet would fetch from another host."""
    if is_css:
        urls = re.findall(r"url\(\s*['\"]?([^'\")]+)", text)
        urls += re.findall(r"@import\s+(?:url\()?['\"]?([^'\");]+)", text)
    else:
        parser = _Fetches()
        parser.feed(text)
        urls = parser.urls
    return [url for url in urls if re.match(r"(?:https?:)?//", url.strip())]


def test_the_external_fetch_check_finds_each_kind() -> None:
    fetching = [
        '<script src="https://cdn.example.org/x.js"></script>',
        '<link rel="stylesheet" href="https://fonts.googleapis.com/css?family=Roboto">',
        '<link rel="preconnect" href="https://fonts.gstatic.com" crossorigin>',
        '<img src="//example.org/logo.png">',
        "<style>@import 'https://example.org/a.css';</style>",
    ]
    for text in fetching:
        assert external_fetches(text), text
    assert external_fetches("@font-face{src:url(https://example.org/f.woff2)}", is_css=True)
    quiet = '<a href="https://pytorch.org/memory_viz">memory_viz</a><script src="assets/x.js">'
    assert external_fetches(quiet) == []


@pytest.mark.slow
def test_the_site_fetches_nothing_from_the_internet(site: Path) -> None:
    found = {}
    for path in site.rglob("*"):
        if path.suffix in (".html", ".css"):
            urls = external_fetches(path.read_text(errors="replace"), is_css=path.suffix == ".css")
            if urls:
                found[str(path.relative_to(site))] = urls
    assert found == {}


# -- generated pages -----------------------------------------------------------------


@pytest.mark.slow
def test_the_cli_reference_is_fresh() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gen_cli_reference.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0, f"{result.stdout}{result.stderr}"


def test_the_cli_reference_names_every_option() -> None:
    from tensord_server import cli

    page = (DOCS / "reference" / "cli.md").read_text()
    for name in cli.SUBCOMMANDS:
        parser = cli.build_subcommand_parser(name)
        assert f"## `tensord {name}`" in page
        for action in parser._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}" in page or f", {flag}" in page, (name, flag)


# -- the examples run ----------------------------------------------------------------

# Pages whose every ```python block, run in order, is a working program.
RUNNABLE_PAGES = (
    "getting-started.md",
    "guides/sharing.md",
    "guides/pipelining.md",
    "guides/same-host.md",
)


def python_blocks(page: str) -> list[str]:
    return re.findall(r"```python\n(.+?)```", (DOCS / page).read_text(), flags=re.DOTALL)


@pytest.mark.slow
@pytest.mark.parametrize("page", RUNNABLE_PAGES)
def test_the_examples_of_the_page_run(
    page: str, server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocks = python_blocks(page)
    assert blocks, page
    if any(re.search(r"^import torch\b", block, flags=re.MULTILINE) for block in blocks):
        pytest.importorskip("torch")
    monkeypatch.setenv("TENSORD_ADDRESS", server.address)
    namespace: dict[str, Any] = {"__name__": "docs_example"}  # `if __name__ == "__main__"` stays
    for block in blocks:
        exec(compile(block, page, "exec"), namespace)


# -- the README stays a README -------------------------------------------------------

README_MAX_LINES = 220

# How a lab notebook reads: issue numbers, work sessions counted, measurement diaries.
NOTEBOOK_WORDS = re.compile(
    r"\bissues? #?\d+|\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth"
    r"|previous|earlier|later|next) session\b|\bsession \d+\b|measurement history"
    r"|\bturn \d+\b",
    re.IGNORECASE,
)


def notebook_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if NOTEBOOK_WORDS.search(line)]


def test_the_notebook_check_finds_each_kind() -> None:
    # the tracker's words are put together from pieces, so that this file names no issue
    # number itself (tests/repo/test_repo.py holds every tracked file to that)
    issue = "iss" + "ue"
    for line in (
        f"Load-test targets of {issue} 18 (`tensord loadtest`)",
        f"see {issue} #4",
        "the previous session's six sequential pairs",
        "256 MiB before the seventh session",
        "earlier runs: [measurement history](docs/benchmarks.md)",
        "tensord main (turn 2): a view 620 us",
    ):
        assert notebook_lines(line), line
    for line in ("a session belongs to the process", "closing the session releases them"):
        assert notebook_lines(line) == [], line


def test_the_readme_is_a_readme_not_a_specification() -> None:
    text = (REPO / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines: behaviour belongs in docs/, the README links to it"
    )
    assert notebook_lines(text) == []
    # it links into the documentation, and every link it has resolves
    links = re.findall(r"\]\(((?:docs/|SECURITY)[^)#]*)", text)
    assert any(link.startswith("docs/") for link in links)
    missing = [link for link in links if not (REPO / link).exists()]
    assert missing == []


def markdown_pages() -> Iterator[Path]:
    yield REPO / "README.md"
    yield from sorted(DOCS.rglob("*.md"))


def test_no_page_reads_as_a_lab_notebook() -> None:
    found = {
        str(path.relative_to(REPO)): lines
        for path in markdown_pages()
        if (lines := notebook_lines(path.read_text()))
    }
    assert found == {}


# -- the compose command -------------------------------------------------------------


def compose_up_commands(text: str) -> list[str]:
    return [
        line.strip() for line in text.splitlines() if re.search(r"docker[ -]compose\b.* up\b", line)
    ]


def test_the_documented_compose_commands_match_the_compose_file() -> None:
    compose = (REPO / "docker-compose.yml").read_text()
    # one variable sets both the worker replicas and the workers the master waits for
    replicas = re.search(r"replicas: \$\{(LOCUST_WORKERS):-(\d+)\}", compose)
    expected = re.search(r"--expect-workers=\$\{(LOCUST_WORKERS):-(\d+)\}", compose)
    assert replicas and expected and replicas.groups() == expected.groups()
    readme = (REPO / "README.md").read_text()
    commands = compose_up_commands(readme) + compose_up_commands(
        (DOCS / "guides" / "compose.md").read_text()
    )
    commands += [line.lstrip("# ") for line in compose_up_commands(compose)]
    assert any("docker compose up" in c for c in compose_up_commands(readme))
    for command in commands:
        if "--profile monitoring" in command:
            continue  # the dashboards stay up after the run
        if "--profile cluster" in command:
            assert "--abort-on-container-exit" not in command, command
            assert not re.search(r"\blocust", command), command  # the nodes only, no load test
            continue  # a cluster serves until it is stopped
        assert "--abort-on-container-exit" in command, command
        scaled = re.search(r"--scale locust-worker=(\d+)", command)
        if scaled:  # the master would wait for another number of workers
            assert f"LOCUST_WORKERS={scaled.group(1)}" in command, command
