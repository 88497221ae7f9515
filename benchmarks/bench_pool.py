"""Benchmark the caching pool on the bundled ResNet-50 training trace.

Prints one table: replay speed (events/s, best and median of several runs) and
the peak reserved / peak allocated ratio of tensord's pool next to PyTorch's
own figures for the same run, with its default allocator and with
``expandable_segments:True`` (the ``*.pytorch_stats.json`` and
``*.pytorch_expandable_stats.json`` files beside the trace).

    python benchmarks/bench_pool.py [TRACE] [--repeats N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

from tensord_server.data import DEFAULT_TRACE_NAME, bundled_trace
from tensord_server.tools.replay import ReplayResult, load_pytorch_stats, load_trace, replay

# the ResNet-50 training trace that ships with the package (tensord_server/data/traces)
DEFAULT_TRACE = bundled_trace(DEFAULT_TRACE_NAME)
DEFAULT_REPEATS = 7  # replays per variant; the first warms caches, the median is reported


def measure(
    events: list[tuple[str, int, int, int]], repeats: int, recorded: bool
) -> tuple[ReplayResult, list[float]]:
    results = [replay(events, recorded_addresses=recorded) for _ in range(repeats)]
    return results[-1], [r.events_per_second for r in results]


def row(name: str, allocated: int, reserved: int, segments: Any, speed: str) -> str:
    ratio = reserved / allocated if allocated else 0.0
    return f"{name:<40} {allocated:>15,} {reserved:>15,} {ratio:>8.4f} {segments!s:>10} {speed:>22}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", nargs="?", default=str(DEFAULT_TRACE))
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS)
    args = parser.parse_args(argv)
    trace = Path(args.trace)
    if not trace.exists():
        print(f"trace not found: {trace}", file=sys.stderr)
        return 1
    events = load_trace(trace)
    print(f"trace: {trace.name}, {len(events):,} events, {args.repeats} replays per variant\n")
    header = f"{'allocator':<40} {'peak allocated':>15} {'peak reserved':>15} {'res/alloc':>8} {'dev allocs':>10} {'events/s (best, median)':>22}"
    lines = [header, "-" * len(header)]
    for name, recorded in (
        ("tensord (recorded addresses)", True),
        ("tensord (fresh addresses)", False),
    ):
        result, speeds = measure(events, args.repeats, recorded)
        speed = f"{max(speeds):,.0f}, {statistics.median(speeds):,.0f}"
        lines.append(
            row(
                name,
                result.peak_allocated_bytes,
                result.peak_reserved_bytes,
                int(result.stats["num_device_alloc"]),
                speed,
            )
        )
    for name, variant in (("pytorch default", ""), ("pytorch expandable", "expandable")):
        stats = load_pytorch_stats(trace, variant)
        if stats is None:
            continue
        lines.append(
            row(
                f"{name} (torch {stats.get('torch', '?')})",
                stats["allocated_bytes.all.peak"],
                stats["reserved_bytes.all.peak"],
                stats.get("num_device_alloc", "-"),
                "(measured on a GPU)",
            )
        )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
