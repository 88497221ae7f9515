"""Trace replay: loading, the bundled ResNet-50 trace against PyTorch's figures, and the CLI."""

from __future__ import annotations

import gzip
import json
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from tensord_server.data import bundled_trace, bundled_traces
from tensord_server.devices.memory import BookkeepingBackend
from tensord_server.pool import CachingPool
from tensord_server.tools.replay import (
    RecordedAddressBackend,
    load_pytorch_stats,
    load_trace,
    replay,
    trace_stem,
)

# Ships with the package (server/tensord_server/data/traces/), so every checkout has it.
RESNET_TRACE = bundled_trace("resnet50_train")

MiB = 1 << 20

# A small trace in the bundled traces' format: two allocations share a 2 MiB segment, a
# large one gets a 20 MiB segment; segment_* and free_requested are ignored.
SMALL_TRACE = [
    ["segment_alloc", 1 << 30, 2 * MiB, 0],
    ["alloc", 1 << 30, 1000, 0],
    ["alloc", (1 << 30) + 1024, 3000, 0],
    ["alloc", 2 << 30, 5 * MiB, 0],
    ["free_requested", 1 << 30, 1000, 0],
    ["free_completed", 1 << 30, 1000, 0],
    ["free_completed", 999, 512, 0],  # allocated before the trace began
]


def write_trace(path: Path, events: list[list[object]]) -> Path:
    with gzip.open(path, "wt") as handle:
        json.dump(events, handle)
    return path


def test_small_trace_replay(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "tiny.events.json.gz", SMALL_TRACE)
    events = load_trace(trace)
    assert events[1] == ("alloc", 1 << 30, 1000, 0)
    result = replay(events)
    assert result.events == len(SMALL_TRACE) and result.unmatched_frees == 1
    assert result.peak_allocated_bytes == 1024 + 3072 + 5 * MiB  # split off its 20 MiB segment
    assert result.peak_reserved_bytes == 22 * MiB
    assert result.reserved_over_allocated == pytest.approx(22 * MiB / result.peak_allocated_bytes)


def test_replay_under_a_capacity_counts_ooms() -> None:
    events = load_trace_list(SMALL_TRACE)
    result = replay(events, capacity=4 * MiB)
    assert result.failed_allocs == 1 and result.stats["num_ooms"] == 1
    assert result.stats["num_alloc_retries"] == 1


def load_trace_list(events: list[list[object]]) -> list[tuple[str, int, int, int]]:
    return [(str(a), int(b), int(c), int(d)) for a, b, c, d in events]  # type: ignore[call-overload]


def test_snapshot_pickle_is_a_trace(tmp_path: Path) -> None:
    recorder = CachingPool(BookkeepingBackend(), record_history=True)
    blocks = [recorder.malloc(n) for n in (100, 4 * MiB, 12 * MiB, 2000)]
    recorder.free(blocks[1])
    recorder.free(blocks[0])
    path = tmp_path / "run.pickle"
    path.write_bytes(pickle.dumps(recorder.memory_snapshot()))
    events = load_trace(path)
    assert [e[0] for e in events][:2] == ["segment_alloc", "alloc"]
    result = replay(events)
    expected = recorder.memory_stats()
    assert result.peak_allocated_bytes == expected["allocated_bytes.all.peak"]
    assert result.peak_reserved_bytes == expected["reserved_bytes.all.peak"]


def test_recorded_address_backend_reuses_trace_addresses() -> None:
    backend = RecordedAddressBackend([(5 << 30, 2 * MiB), (3 << 30, 2 * MiB)])
    first, second = backend.reserve(2 * MiB), backend.reserve(2 * MiB)
    assert (first.address, second.address) == (5 << 30, 3 << 30)
    fresh = backend.reserve(2 * MiB)
    assert fresh.address > (5 << 30) + 2 * MiB  # never overlaps a recorded segment
    backend.release(second)
    assert backend.reserve(2 * MiB).address == 3 << 30


def test_trace_names() -> None:
    assert trace_stem("a/resnet50_train.events.json.gz") == "resnet50_train"
    assert trace_stem("snap.pickle") == "snap"
    assert load_pytorch_stats("/nonexistent/x.events.json.gz") is None


def test_resnet50_replay_matches_pytorch() -> None:
    events = load_trace(RESNET_TRACE)
    assert len(events) == 13_735
    pytorch = load_pytorch_stats(RESNET_TRACE)
    assert pytorch is not None
    for recorded in (True, False):
        result = replay(events, recorded_addresses=recorded)
        stats = result.stats
        assert result.unmatched_frees == 0 and stats["num_ooms"] == 0
        allocated, reserved = (
            pytorch["allocated_bytes.all.peak"],
            pytorch["reserved_bytes.all.peak"],
        )
        assert abs(stats["allocated_bytes.all.peak"] - allocated) <= 0.001 * allocated
        assert abs(stats["reserved_bytes.all.peak"] - reserved) <= 0.01 * reserved
        assert stats["segment.all.peak"] == pytorch["segment.all.peak"]
    # With the recorded addresses, best-fit tie-breaks follow PyTorch's: the figures are exact.
    exact = replay(events).stats
    for key in (
        "allocated_bytes.all.peak",
        "reserved_bytes.all.peak",
        "inactive_split_bytes.all.peak",
        "num_device_alloc",
    ):
        assert exact[key] == pytorch[key], key


def run_cli(*args: str) -> dict[str, object]:
    completed = subprocess.run(
        [sys.executable, "-m", "tensord_server", "replay", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    result: dict[str, object] = json.loads(completed.stdout)
    return result


def test_cli_replay_json(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "tiny.events.json.gz", SMALL_TRACE)
    (tmp_path / "tiny.pytorch_stats.json").write_text(
        json.dumps({"allocated_bytes.all.peak": 100, "reserved_bytes.all.peak": 150})
    )
    report = run_cli(str(trace), "--capacity", str(1 << 30))
    assert report["peak_allocated_bytes"] == 1024 + 3072 + 5 * MiB
    assert report["peak_reserved_bytes"] == 22 * MiB
    assert report["reserved_over_allocated"] == pytest.approx(22 * MiB / (1024 + 3072 + 5 * MiB))
    assert report["pytorch"] == {
        "allocated_bytes.all.peak": 100,
        "reserved_bytes.all.peak": 150,
        "reserved_over_allocated": 1.5,
    }


def test_cli_replay_reports_unreadable_trace(tmp_path: Path) -> None:
    empty = tmp_path / "empty.pickle"
    empty.write_bytes(pickle.dumps({"segments": [], "device_traces": [[]]}))
    for path in (empty, tmp_path / "missing.events.json.gz"):
        completed = subprocess.run(
            [sys.executable, "-m", "tensord_server", "replay", str(path)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert completed.returncode == 2 and "cannot read" in completed.stderr


def run_tool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tensord_server", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.slow
def test_cli_replays_what_tensord_snapshot_wrote(tmp_path: Path) -> None:
    # a snapshot of a server held no trace (the server recorded none), and a file not named
    # .pickle was read as JSON: replay refused tensord's own snapshots
    import numpy as np
    import tensord
    from conftest import start_serve_process

    process, address = start_serve_process(
        "--address=127.0.0.1:0", "--device=cpu=64MiB", "--policy=pytorch", "--record-history"
    )
    try:
        with tensord.connect(address, local=False) as client:
            kept = [client.from_numpy(np.ones(n, np.float32)) for n in (1000, 300_000, 3 * MiB)]
            dropped = [client.from_numpy(np.ones(n, np.float32)) for n in (2000, MiB)]
            del dropped
            client.flush()
            expected = client.memory_stats()
            snapshot = tmp_path / "server-snapshot"  # no .pickle: the content says what it is
            wrote = run_tool("snapshot", "--address", address, "-o", str(snapshot))
            assert wrote.returncode == 0 and wrote.stderr == "", wrote.stderr
            assert "trace events" in wrote.stdout
            del kept
    finally:
        process.terminate()
        process.communicate(timeout=30)
    replayed = run_tool("replay", str(snapshot), "--json")
    assert replayed.returncode == 0, replayed.stderr
    report = json.loads(replayed.stdout)
    assert report["unmatched_frees"] == 0 and report["num_ooms"] == 0
    assert report["peak_allocated_bytes"] == expected["allocated_bytes.all.peak"]
    assert report["peak_reserved_bytes"] == expected["reserved_bytes.all.peak"]
    assert report["memory_stats"]["allocated_bytes.all.current"] == sum(
        4 * n
        for n in (1024, 300_032, 3 * MiB)  # the kept tensors, rounded to 512 B
    )


@pytest.mark.slow
def test_a_snapshot_without_history_says_how_to_record_one(server: Any, tmp_path: Path) -> None:
    snapshot = tmp_path / "snap.pickle"
    wrote = run_tool("snapshot", "--address", server.address, "-o", str(snapshot))
    assert wrote.returncode == 0
    assert "holds no allocator trace" in wrote.stderr and "--record-history" in wrote.stderr
    replayed = run_tool("replay", str(snapshot))
    assert replayed.returncode == 2 and "tensord serve --record-history" in replayed.stderr


@pytest.mark.slow
def test_a_long_replay_shows_progress_on_stderr(tmp_path: Path) -> None:
    # a replay of millions of events said nothing until its end
    from tensord_server.tools.replay import PROGRESS_CHUNK

    pairs = 2 * PROGRESS_CHUNK  # 4 chunks of events
    events = [
        ["alloc" if k == 0 else "free_completed", (1 << 30) + 1024 * (i % 64), 1000, 0]
        for i in range(pairs)
        for k in (0, 1)
    ]
    trace = write_trace(tmp_path / "long.events.json.gz", events)
    # every look at the clock is "long" here: a line after each chunk
    shown = run_tool("replay", str(trace), "--json", "--progress-interval", "1e-9")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["events"] == 2 * pairs  # stdout holds the result alone
    lines = shown.stderr.splitlines()
    assert len(lines) == 4, lines
    assert lines[0].startswith(f"tensord replay: {PROGRESS_CHUNK:,} of {2 * pairs:,} events (25 %)")
    assert lines[-1].startswith(f"tensord replay: {2 * pairs:,} of {2 * pairs:,} events (100 %)")
    assert all(" events/s, about " in line and line.endswith(" s left") for line in lines)
    # shorter than the default interval: nothing; and 0 turns progress off
    for flags in ((), ("--progress-interval", "0")):
        quiet = run_tool("replay", str(trace), "--json", *flags)
        assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr


def test_cli_replay_resnet50() -> None:
    report = run_cli(str(RESNET_TRACE))
    assert report["peak_allocated_bytes"] == 7_051_840_000
    assert report["peak_reserved_bytes"] == 10_125_049_856
    assert report["num_ooms"] == 0 and report["peak_segments"] == 148


def test_the_resnet50_trace_and_its_pytorch_figures_are_bundled() -> None:
    assert "resnet50_train" in bundled_traces()
    for variant in ("", "expandable"):
        stats = load_pytorch_stats(RESNET_TRACE, variant)
        assert stats is not None and stats["workload"] == "resnet50_train", variant


@pytest.mark.slow
def test_cli_replays_a_bundled_trace_by_name_from_any_folder(tmp_path: Path) -> None:
    named = subprocess.run(
        [sys.executable, "-m", "tensord_server", "replay", "resnet50_train", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=tmp_path,  # nothing of the repository beside it
    )
    report = json.loads(named.stdout)
    assert report["peak_allocated_bytes"] == 7_051_840_000
    assert report["pytorch"]["reserved_bytes.all.peak"] == 10_125_049_856  # figures found too
    # no argument: the bundled ResNet-50 trace
    default = run_cli()
    assert default["peak_reserved_bytes"] == 10_125_049_856


def test_cli_lists_the_bundled_traces_and_prefers_a_file_to_a_name(tmp_path: Path) -> None:
    listed = subprocess.run(
        [sys.executable, "-m", "tensord_server", "replay", "--list"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert listed.stdout.split() == bundled_traces()
    # a plain-JSON trace file named like the bundled trace
    (tmp_path / "resnet50_train").write_text(json.dumps(SMALL_TRACE))
    shadowed = subprocess.run(
        [sys.executable, "-m", "tensord_server", "replay", "resnet50_train", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=tmp_path,
    )
    assert json.loads(shadowed.stdout)["events"] == len(SMALL_TRACE)


def test_cli_names_the_bundled_traces_when_neither_file_nor_name_matches(tmp_path: Path) -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "tensord_server", "replay", "resnet51"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert completed.returncode == 2
    bundled = "gpt_train, lstm_train, resnet50_train, unet_train"
    assert f"no bundled trace of that name (bundled: {bundled})" in completed.stderr


def test_cli_replay_table(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "tiny.events.json.gz", SMALL_TRACE)
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "tensord_server",
            "replay",
            str(trace),
            "--max-split-size",
            str(40 * MiB),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "reserved_bytes.all.peak" in completed.stdout and "events/s" in completed.stdout


CPU_TRACES = ("gpt_train", "lstm_train", "unet_train")


def load_record_script() -> object:
    """scripts/record_trace.py as a module (scripts/ is not a package)."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "scripts" / "record_trace.py"
    spec = importlib.util.spec_from_file_location("record_trace", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", CPU_TRACES)
def test_the_cpu_recorded_traces_are_bundled_small_and_replay_whole(name: str) -> None:
    assert name in bundled_traces()
    path = bundled_trace(name)
    assert path.stat().st_size < 200_000  # the repository ships them
    events = load_trace(path)
    assert {action for action, *_ in events} == {"alloc", "free_completed"}
    result = replay(events)
    # every free matches an allocation of the trace, and a training step's tensors come
    # in both pools' sizes (the small pool's <= 1 MiB, the large pool's > 10 MiB)
    assert result.unmatched_frees == 0 and result.failed_allocs == 0
    sizes = [size for action, _, size, _ in events if action == "alloc"]
    assert min(sizes) <= MiB and max(sizes) > 10 * MiB
    assert result.peak_allocated_bytes > 256 * MiB


def test_record_trace_turns_allocator_events_into_trace_events() -> None:
    record_trace = load_record_script()
    # (time, pointer, size): 0x10 is freed and its address reused; 0x99 was allocated
    # before recording began; 0x30 stays live
    allocations = [(1, 0x10, 100), (2, 0x20, 200), (3, 0x10, -100), (4, 0x10, 300)]
    allocations += [(5, 0x99, -50), (6, 0x20, -200), (7, 0x30, 400)]
    assert record_trace.trace_events(allocations) == [  # type: ignore[attr-defined]
        ("alloc", 1, 100, 0),
        ("alloc", 2, 200, 0),
        ("free_completed", 1, 100, 0),
        ("alloc", 3, 300, 0),
        ("free_completed", 2, 200, 0),
        ("alloc", 4, 400, 0),
    ]


@pytest.mark.slow
def test_record_trace_records_a_real_training_step(tmp_path: Path) -> None:
    import torch

    record_trace = load_record_script()

    def tiny() -> object:
        model = torch.nn.Linear(64, 1024)
        yield
        loss = model(torch.randn(32, 64)).square().sum()
        loss.backward()
        yield

    events = record_trace.record(tiny)  # type: ignore[attr-defined]
    path = tmp_path / "tiny.events.json.gz"
    record_trace.write_trace(events, path)  # type: ignore[attr-defined]
    assert load_trace(path) == events
    sizes = {size for action, _, size, _ in events if action == "alloc"}
    # the weight, the output and its gradient, each 32 x 1024 or 64 x 1024 floats
    assert 64 * 1024 * 4 in sizes and 32 * 1024 * 4 in sizes
    result = replay(events)
    # the model was built and dropped inside the recording: every allocation is freed
    assert result.unmatched_frees == 0 and result.peak_allocated_bytes >= 64 * 1024 * 4
    assert result.stats["allocated_bytes.all.current"] == 0
