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

Paired load tests (issue 18's load-test targets): ``--loadtest-pairs N`` runs
``tensord loadtest -u USERS -t TIME --policy P`` for each policy of ``--policies``
(default ``pytorch,adaptive``), alternating them N times so that the machine's load
falls on both alike (every other pair in reverse order, so that running second does too;
a pause of SETTLE_S between runs), and prints one row per run, then per policy the mean and spread
(min-max) of each figure and each pair's requests/s relative to the first policy:

    python benchmarks/bench_fragmentation.py --loadtest-pairs 3 -u 50 -t 60s
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
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
MiB = 1 << 20


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


# the load-test figures compared, from each run's summary.json: (key, heading, format)
LOADTEST_FIGURES = (
    ("requests_per_s", "requests/s (all)", ",.1f"),
    ("successful_requests_per_s", "successful requests/s", ",.1f"),
    ("allocated_mib_per_s", "MiB allocated/s", ",.1f"),
    ("mean_reserved_over_allocated", "mean reserved / allocated under load", ".3f"),
    ("max_reserved_over_allocated", "max reserved / allocated under load", ".3f"),
    ("peak_reserved_over_peak_allocated", "peak reserved / peak allocated", ".3f"),
    ("unexpected_failures", "unexpected failures", "d"),
    ("num_ooms", "OOMs", "d"),
    ("leaked_bytes", "leaked bytes", ",d"),
    ("compaction_moved_per_allocated", "bytes moved / byte allocated", ".4f"),
)


# the throughput figures each run is compared on with its pair's first policy
RATIOS = (
    ("requests_per_s", "requests/s (all)"),
    ("successful_requests_per_s", "successful requests/s"),
)


def loadtest_once(policy: str, users: int, run_time: str, out: Path) -> dict[str, Any]:
    """One ``tensord loadtest`` against a fresh server under ``policy``: its summary.json,
    with the machine's load average when it started."""
    load = os.getloadavg()[0]
    command = [sys.executable, "-m", "tensord_server", "loadtest", "-u", str(users)]
    command += ["-t", run_time, "--policy", policy, "--out", str(out), "--no-plot"]
    subprocess.run(command, check=False, stdout=subprocess.DEVNULL)
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    summary["policy"] = policy
    summary["allocated_mib_per_s"] = summary.get("allocated_bytes_per_s", math.nan) / MiB
    summary["load_average"] = load
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return summary


# between two load tests: the last run's server and Locust processes give back their
# memory (a 1 GiB pool) while the next one starts otherwise
SETTLE_S = 5.0


def run_order(policies: list[str], pair: int) -> list[str]:
    """The policies in the order pair ``pair`` runs them: reversed every other pair, so
    that running second (a slower start, seen here whatever the policy) falls on each alike."""
    return list(policies) if pair % 2 == 0 else list(reversed(policies))


def paired_loadtests(
    policies: list[str], pairs: int, users: int, run_time: str, out: Path
) -> list[dict[str, Any]]:
    runs = []
    for pair in range(pairs):
        for index, policy in enumerate(run_order(policies, pair)):
            if pair or index:
                time.sleep(SETTLE_S)
            summary = loadtest_once(policy, users, run_time, out / f"{pair}-{policy}")
            summary["pair"] = pair
            runs.append(summary)
            print(f"pair {pair} {policy}: {summary['requests_per_s']:.1f}/s", file=sys.stderr)
    return runs


def loadtest_markdown(runs: list[dict[str, Any]], policies: list[str]) -> str:
    headings = " | ".join(heading for _, heading, _ in LOADTEST_FIGURES)
    lines = [
        f"| pair | policy | load average | {headings} |",
        "|---|---|---" + "|---" * len(LOADTEST_FIGURES) + "|",
    ]
    for run in runs:
        cells = " | ".join(format(run[key], form) for key, _, form in LOADTEST_FIGURES)
        lines.append(f"| {run['pair']} | {run['policy']} | {run['load_average']:.1f} | {cells} |")
    ratio_heads = " | ".join(f"{heading} vs {policies[0]}, per pair" for _, heading in RATIOS)
    lines += ["", f"| policy | {headings} | {ratio_heads} |"]
    lines.append("|---" + "|---" * (len(LOADTEST_FIGURES) + len(RATIOS)) + "|")
    for policy in policies:
        mine = [run for run in runs if run["policy"] == policy]
        cells = []
        for key, _, form in LOADTEST_FIGURES:
            values = [run[key] for run in mine]
            mean = sum(values) / len(values)
            shown = format(mean, ".1f" if form.endswith("d") else form)
            cells.append(f"{shown} ({format(min(values), form)}-{format(max(values), form)})")
        for key, _ in RATIOS:
            first = {run["pair"]: run[key] for run in runs if run["policy"] == policies[0]}
            cells.append(", ".join(f"{run[key] / first[run['pair']]:.2f}" for run in mine))
        lines.append(f"| {policy} | {' | '.join(cells)} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--loadtest-pairs", type=int, default=0, help="paired load tests instead of replays"
    )
    parser.add_argument("--policies", default="pytorch,adaptive")
    parser.add_argument("-u", "--users", type=int, default=50)
    parser.add_argument("-t", "--run-time", default="60s")
    parser.add_argument("--out", type=Path, default=None, help="the load tests' folders")
    args = parser.parse_args()
    if args.loadtest_pairs > 0:
        policies = args.policies.split(",")
        out = args.out or Path(tempfile.mkdtemp(prefix="bench-fragmentation-"))
        runs = paired_loadtests(policies, args.loadtest_pairs, args.users, args.run_time, out)
        print(json.dumps(runs, default=str) if args.json else loadtest_markdown(runs, policies))
        return 0
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
