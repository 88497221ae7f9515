"""Fragmentation per pool policy, side by side: the figures of issue 18 in one run.

Workloads: every bundled trace (``tensord replay --list``: the ResNet-50 run recorded
on a GPU, the GPT, LSTM and U-Net runs recorded on CPU) and a load-test-like
bimodal mix (``bench_compaction.bimodal_steps``: 8-48 MiB tensors living 1-4
steps among 64 KiB-3 MiB ones living 20-200 steps).  Each runs through
``tensord replay``'s ``replay()`` on a bookkeeping backend (no bytes: the
policy alone is measured), every allocation movable between events, under
each pool policy (``pytorch``, ``oom-compaction``, ``adaptive``), plus
PyTorch's own expandable-segments figures for a trace from its stats file.

Per workload and policy:

- smallest capacity factor with 0 OOMs: the smallest of ``FACTORS`` (x the
  workload's peak allocated) whose replay has no OOM;
- peak reserved / peak allocated on an unlimited device (what a pool hoards);
- bytes moved per byte allocated, at that smallest factor;
- replay speed (events/s) on the unlimited device.

    python benchmarks/bench_fragmentation.py [--seed N] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tensord_server.data import bundled_trace, bundled_traces
from tensord_server.pool import POLICIES
from tensord_server.tools.replay import (
    TraceEvent,
    load_pytorch_stats,
    load_trace,
    ratio,
    replay,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_compaction import bimodal_steps

# capacity factors tried, as multiples of the workload's peak allocated
FACTORS = (1.00, 1.01, 1.02, 1.03, 1.05, 1.10, 1.25, 1.50, 2.00)
BIMODAL_USERS = 8


@dataclass
class Row:
    workload: str
    policy: str
    min_factor: float | None  # smallest factor of FACTORS with 0 OOMs (None: none)
    reserved_over_allocated: float  # peaks, unlimited device
    moved_per_allocated: float | None  # at min_factor
    events_per_second: float | None


def bimodal_events(users: int, seed: int) -> list[TraceEvent]:
    """The bimodal mix as a trace: keys as addresses, every tensor on stream 0."""
    events: list[TraceEvent] = []
    for action, key, nbytes in bimodal_steps(users, seed):
        events.append(
            ("alloc", key, nbytes, 0) if action == "alloc" else ("free_completed", key, 0, 0)
        )
    return events


def measure(name: str, events: list[TraceEvent], recorded: bool) -> list[Row]:
    unlimited = {
        policy: replay(events, policy=policy, compaction=True, recorded_addresses=recorded)
        for policy in POLICIES
    }
    peak = unlimited["pytorch"].peak_allocated_bytes
    rows = []
    for policy, result in unlimited.items():
        min_factor = moved = None
        for factor in FACTORS:
            tight = replay(
                events,
                capacity=int(factor * peak),
                policy=policy,
                compaction=True,
                recorded_addresses=recorded,
            )
            if tight.failed_allocs == 0:
                min_factor = factor
                moved = ratio(
                    int(tight.stats["compaction_moved_bytes"]),
                    int(tight.stats["allocated_bytes.all.allocated"]),
                )
                break
        rows.append(
            Row(
                name,
                policy,
                min_factor,
                result.reserved_over_allocated,
                moved,
                result.events_per_second,
            )
        )
    return rows


def expandable_row(name: str, path: Path) -> Row | None:
    stats = load_pytorch_stats(path, "expandable")
    if stats is None:
        return None
    return Row(
        name,
        "torch expandable_segments",
        None,
        ratio(stats["reserved_bytes.all.peak"], stats["allocated_bytes.all.peak"]),
        None,
        ratio(stats["events"], stats["seconds"]) if stats.get("seconds") else None,
    )


def markdown(rows: list[Row]) -> str:
    def show(value: Any, form: str) -> str:
        return "-" if value is None else format(value, form)

    lines = [
        "| workload | policy | smallest capacity factor, 0 OOMs | peak reserved / peak allocated "
        "| bytes moved / byte allocated | replay events/s |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row.workload} | {row.policy} | {show(row.min_factor, '.2f')} "
            f"| {row.reserved_over_allocated:.3f} | {show(row.moved_per_allocated, '.4f')} "
            f"| {show(row.events_per_second, ',.0f')} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows: list[Row] = []
    for name in bundled_traces():
        path = bundled_trace(name)
        rows += measure(name, load_trace(path), recorded=True)
        expandable = expandable_row(name, path)
        if expandable is not None:
            rows.append(expandable)
    rows += measure(
        f"bimodal, {BIMODAL_USERS} users", bimodal_events(BIMODAL_USERS, args.seed), False
    )
    print(json.dumps([asdict(r) for r in rows]) if args.json else markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
