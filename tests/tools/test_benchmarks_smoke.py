"""Smoke runs of the benchmarks that have one (``--quick``): they start, finish and fill
every row of their table.

bench_peers.py runs with Ray hidden (a ``ray`` package that fails to import, ahead of any
installed one), so its Ray column must read "ray not installed" here whether or not Ray is
installed, as it does wherever the ``bench`` extra is not.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import tensord

REPO = Path(__file__).resolve().parents[2]
BENCH_PEERS = REPO / "benchmarks" / "bench_peers.py"
HAS_TORCH = importlib.util.find_spec("torch") is not None

# the rows of a --quick run (4 KiB and 1 MiB), by key
QUICK_ROWS = [
    f"{op}/{size}/{state}"
    for op in ("put", "get")
    for state in ("warm", "paused")
    for size in ("4KiB", "1MiB")
] + [
    *(f"small/{op}/{how}" for op in ("put", "get", "delete") for how in ("single", "batched")),
    "memory/idle_rss",
    "cpu/idle",
    "memory/service_per_object",
    "memory/producer_per_object",
]
# each batched row and the Client method it needs
BATCH_APIS = {
    "small/put/batched": "put_many",
    "small/get/batched": "get_many",
    "small/delete/batched": "delete_many",
}
# a value as the table prints one: a number and its unit, then the range of the rounds
NUMBER = re.compile(r"^-?\d+(\.\d+)? (µs|ms|s|B|KiB|MiB|%)( \(.*\))?$")


def load_script(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def peers_report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    hidden = tmp_path_factory.mktemp("without-ray")
    (hidden / "ray").mkdir()
    (hidden / "ray" / "__init__.py").write_text('raise ImportError("hidden by the smoke test")\n')
    path = [str(hidden), str(REPO / "client"), str(REPO / "server")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*path, os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, str(BENCH_PEERS), "--quick", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report: dict[str, Any] = json.loads(result.stdout)
    return report


def expected_tensord(key: str) -> str:
    """ "number", or the status tensord's cell must show."""
    api = BATCH_APIS.get(key)
    return "number" if api is None or hasattr(tensord.Client, api) else "not available"


def expected_torch(key: str) -> str:
    if not HAS_TORCH:
        return "torch not installed"
    return "number" if key.startswith(("put/", "get/")) else "n/a"


@pytest.mark.slow
def test_bench_peers_measures_every_row_without_ray(peers_report: dict[str, Any]) -> None:
    rows = {row["key"]: row for row in peers_report["rows"]}
    assert list(rows) == QUICK_ROWS
    assert peers_report["meta"]["peers"]["ray"] == "ray not installed"
    for key, row in rows.items():
        cells = row["cells"]
        assert cells["ray"] == {"status": "ray not installed"}, key
        assert row["vs_ray"] is None, key
        for peer, wanted in (("tensord", expected_tensord(key)), ("torch", expected_torch(key))):
            if wanted == "number":
                assert len(cells[peer]["values"]) == 1, (key, peer, cells[peer])
                assert isinstance(cells[peer]["median"], float), (key, peer)
            else:
                assert cells[peer] == {"status": wanted}, (key, peer)
    # the consumer read the bytes out of the server's mapping, not a copy
    assert peers_report["meta"]["info"]["tensord"]["consumer"]["array"] == "np.from_dlpack"


@pytest.mark.slow
def test_bench_peers_table_has_every_row_with_numbers(peers_report: dict[str, Any]) -> None:
    table = load_script(BENCH_PEERS).markdown(peers_report)
    lines = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    header, peer_line, *body = lines
    assert header.split(" | ")[1:4] == ["tensord", "Ray", "torch.multiprocessing"]
    assert "| ray not installed |" in peer_line
    labels = {row["label"]: row["key"] for row in peers_report["rows"]}
    assert [line.split(" | ")[0].removeprefix("| ") for line in body] == list(labels)
    for line in body:
        label, tensord_cell, ray_cell, torch_cell, *_ = line.removeprefix("| ").split(" | ")
        key = labels[label]
        assert ray_cell == "ray not installed", line
        for cell, wanted in (
            (tensord_cell, expected_tensord(key)),
            (torch_cell, expected_torch(key)),
        ):
            assert NUMBER.match(cell) if wanted == "number" else cell == wanted, line
