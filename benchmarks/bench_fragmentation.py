"""Fragmentation per pool policy, side by side, every workload in one run.

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

Generated traces (``--synthetic SEEDS``): each family of ``tools.trace_gen`` (workloads
the policies were not tuned on) over seeds 0..SEEDS-1, under PyTorch's rules and the
default policy, every allocation movable: per family and policy the smallest factor of
``FACTORS`` with 0 OOMs on every seed, each seed's smallest factor (min, median, max) and
how many seeds have 0 OOMs at 1.01x (factors of each trace's peak allocated under
PyTorch's rules):

    python benchmarks/bench_fragmentation.py --synthetic 12

Paired load tests (the policies' load-test targets): ``--loadtest-pairs N`` runs
``tensord loadtest -u USERS -t TIME --policy P`` for each policy of ``--policies``
(default ``pytorch,adaptive``), alternating them N times so that the machine's load
falls on both alike (every other pair in reverse order, so that running second does too;
a pause of SETTLE_S between runs), and prints one row per run, then per policy the mean and spread
(min-max) of each figure and each pair's requests/s relative to the first policy.  The
runs of a pair are seeded alike (``tensord loadtest --seed``, ``--seed`` + the pair's
number): their users make the same choices, so the pair compares the policies on the same
work (unseeded, the share of cheap client-side ops alone moved requests/s by several percent):

    python benchmarks/bench_fragmentation.py --loadtest-pairs 3 -u 50 -t 60s

With ``--concurrent`` the runs of a pair run at the same time (each its own server and
Locust, the same seed; which starts first alternates as above): the machine's speed, which
drifts by tens of percent within minutes on a shared VM, is then the same for both.  The
scheduler shares the CPU between them about evenly, and a policy cheaper per request turns
its share into more requests; the Locust clients share that CPU too, so the ratio
understates the servers' difference rather than overstating it.  Two pools on one machine
reach their device's edge more often than one alone (many more OOMs under both policies),
so the memory figures of concurrent runs are not comparable with those of runs alone:

    python benchmarks/bench_fragmentation.py --loadtest-pairs 6 --concurrent -u 50 -t 60s

Paired same-work runs: ``--same-work-pairs N`` starts ``tensord serve --policy P``
(a 1 GiB cpu pool) for each policy, alternating as above, and drives the load test's
workloads (its default mix, one user per weight in turn) from ``-u`` threads of this
process with fixed seeds, ``--steps`` steps each, no waits: every run serves the same
requests (each step drawing from its own seeded generator, so a call that fails under
one policy changes only that step), so a difference is the policy's cost, not a
different mix of work, as a closed-loop Locust run may have.  Each user's queued ops and
releases reach the server before the measured window opens and before it closes.  Per
run: wall time, requests/s, the server's CPU seconds (user + system, from /proc) per
request, its minor page faults; then each pair's ratios against the first policy.
"Requests" are the ops the workloads record, as the load test counts them (client-side
view ops and data checks included, expected errors apart):

    python benchmarks/bench_fragmentation.py --same-work-pairs 5 -u 26 --steps 60

The allocator's own CPU per malloc or free under each policy (``--allocator-cost``): a
``CachingPool`` over the server's shared host backend (1 GiB, a doorbell set as
``tensord serve`` sets one, no bytes touched) takes a seeded random walk of mallocs
(1 KiB-24 MiB) and frees up to each of ``ALLOCATOR_COST_TARGETS`` MiB allocated and
around it, on a clock of its own (a millisecond per operation, so every run is the same
walk); process CPU time per operation, best of 3, and each run's decommits and OOMs:

    python benchmarks/bench_fragmentation.py --allocator-cost
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import tensord
from tensord.errors import OutOfMemoryError
from tensord_server.data import bundled_trace, bundled_traces
from tensord_server.pool import DEFAULT_POLICY, POLICIES
from tensord_server.tools.loadtest.workloads import (
    WORKLOADS,
    OpFailed,
    parse_weights,
    seeded_step,
    workload_rng,
)
from tensord_server.tools.replay import (
    TraceEvent,
    load_pytorch_stats,
    load_trace,
    ratio,
    replay,
)
from tensord_server.tools.trace_gen import FAMILIES, generate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_compaction import bimodal_steps, launch_serve

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


# the policies the generated families are run under: PyTorch's rules and the default
SYNTHETIC_POLICIES = ("pytorch", DEFAULT_POLICY)


@dataclass
class FamilyRow:
    family: str
    policy: str
    seeds: int
    worst_factor: float | None  # smallest factor with 0 OOMs on every seed (None: none)
    factors: list[float | None]  # each seed's smallest factor with 0 OOMs
    at_1_01: int  # seeds with 0 OOMs at 1.01x


def smallest_factor(events: list[TraceEvent], peak: int, policy: str) -> float | None:
    """The smallest of FACTORS at which ``events`` replays with 0 OOMs under ``policy``."""
    for factor in FACTORS:
        result = replay(
            events,
            capacity=int(factor * peak),
            policy=policy,
            compaction=True,
            recorded_addresses=False,
        )
        if result.failed_allocs == 0:
            return factor
    return None


def measure_families(seeds: int) -> list[FamilyRow]:
    """Each generated family over seeds 0..seeds-1 (``tools.trace_gen``), under each of
    SYNTHETIC_POLICIES, the factors of each trace's peak allocated under PyTorch's rules."""
    rows = []
    for family in FAMILIES:
        traces = [generate(family, seed) for seed in range(seeds)]
        peaks = [replay(t, recorded_addresses=False).peak_allocated_bytes for t in traces]
        for policy in SYNTHETIC_POLICIES:
            factors = [smallest_factor(t, p, policy) for t, p in zip(traces, peaks, strict=True)]
            worst = None if None in factors else max(f for f in factors if f is not None)
            at_1_01 = sum(1 for f in factors if f is not None and f <= 1.01)
            rows.append(FamilyRow(family, policy, seeds, worst, factors, at_1_01))
    return rows


def families_markdown(rows: list[FamilyRow]) -> str:
    def show(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    lines = [
        "| family | policy | smallest factor, 0 OOMs on every seed | per seed: min-median-max "
        "| seeds with 0 OOMs at 1.01x |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        known = sorted(f for f in row.factors if f is not None)
        spread = (
            f"{show(known[0])}-{show(known[len(known) // 2])}-{show(known[-1])}" if known else "-"
        )
        if len(known) < len(row.factors):
            spread += f" ({len(row.factors) - len(known)} above {FACTORS[-1]:.2f})"
        lines.append(
            f"| {row.family} | {row.policy} | {show(row.worst_factor)} | {spread} "
            f"| {row.at_1_01} of {row.seeds} |"
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


def loadtest_once(
    policy: str, users: int, run_time: str, out: Path, seed: int | None = None
) -> dict[str, Any]:
    """One ``tensord loadtest`` against a fresh server under ``policy`` (its users seeded
    with ``seed``: ``tensord loadtest --seed``): its summary.json, with the machine's load
    average when it started."""
    load = os.getloadavg()[0]
    command = [sys.executable, "-m", "tensord_server", "loadtest", "-u", str(users)]
    command += ["-t", run_time, "--policy", policy, "--out", str(out), "--no-plot"]
    if seed is not None:
        command += ["--seed", str(seed)]
    subprocess.run(command, check=False, stdout=subprocess.DEVNULL)
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    summary["policy"] = policy
    summary["allocated_mib_per_s"] = summary.get("allocated_bytes_per_s", math.nan) / MiB
    summary["load_average"] = load
    summary["seed"] = seed
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
    policies: list[str], pairs: int, users: int, run_time: str, out: Path, seed: int = 0
) -> list[dict[str, Any]]:
    """Each pair's runs seeded alike (``seed`` + the pair's number): the policies of a pair
    serve users making the same choices; the pairs differ."""
    runs = []
    for pair in range(pairs):
        for index, policy in enumerate(run_order(policies, pair)):
            if pair or index:
                time.sleep(SETTLE_S)
            folder = out / f"{pair}-{policy}"
            summary = loadtest_once(policy, users, run_time, folder, seed + pair)
            summary["pair"] = pair
            runs.append(summary)
            print(f"pair {pair} {policy}: {summary['requests_per_s']:.1f}/s", file=sys.stderr)
    return runs


def concurrent_loadtests(
    policies: list[str], pairs: int, users: int, run_time: str, out: Path, seed: int = 0
) -> list[dict[str, Any]]:
    """As :func:`paired_loadtests`, each pair's runs at the same time (``--concurrent``)."""
    runs = []
    for pair in range(pairs):
        if pair:
            time.sleep(SETTLE_S)
        with ThreadPoolExecutor(len(policies)) as executor:
            started = [
                executor.submit(
                    loadtest_once, policy, users, run_time, out / f"{pair}-{policy}", seed + pair
                )
                for policy in run_order(policies, pair)
            ]
            summaries = [future.result() for future in started]
        for summary in summaries:
            summary["pair"] = pair
            runs.append(summary)
            print(
                f"pair {pair} {summary['policy']}: {summary['requests_per_s']:.1f}/s (concurrent)",
                file=sys.stderr,
            )
    return runs


ALLOCATOR_COST_TARGETS = (700, 960)  # MiB allocated the walk hovers at (of 1,024)
ALLOCATOR_COST_STEPS = 30_000


def walk_size(rng: random.Random) -> int:
    """A request of the walk: half small (1-256 KiB), a third 0.25-4 MiB, the rest 4-24 MiB."""
    r = rng.random()
    if r < 0.5:
        return rng.randint(1, 256) * 1024
    if r < 0.85:
        return rng.randint(256, 4096) * 1024
    return rng.randint(4, 24) * MiB


class NothingMoves:
    """A relocator under which every block is held (compaction plans, moves nothing)."""

    @contextlib.contextmanager
    def relocation(self, pool: Any) -> Iterator[dict[Any, Any]]:
        yield {}

    def claim(self, block: Any) -> object:
        return None


def allocator_cost(
    policy: str, target_mib: int, steps: int, seed: int = 1
) -> tuple[float, int, int]:
    """CPU seconds per malloc or free of the walk, the decommits it made, its OOMs."""
    from tensord_server.devices.shm import SharedHostBackend
    from tensord_server.pool import CachingPool, policy_named

    clock = [0.0]  # the walk's own clock, a millisecond per operation: the same walk
    # (which idle segments have decayed, release_idle_s) however fast this machine runs it
    pool = CachingPool(
        SharedHostBackend(total_bytes=1 << 30),
        capacity=1 << 30,
        policy=policy_named(policy),
        relocator=NothingMoves(),
        clock=lambda: clock[0],
    )
    pool.compaction_wanted = lambda: None  # as under tensord serve: a free only rings it
    rng = random.Random(seed)
    live: list[Any] = []
    allocated = ooms = 0
    start = time.process_time()
    for _ in range(steps):
        clock[0] += 0.001
        if live and (allocated > target_mib * MiB or rng.random() < 0.45):
            block = live.pop(rng.randrange(len(live)))
            allocated -= block.size
            pool.free(block)
        else:
            try:
                block = pool.malloc(walk_size(rng))
            except OutOfMemoryError:
                ooms += 1
                continue
            live.append(block)
            allocated += block.size
    seconds = time.process_time() - start
    decommits = int(pool.memory_stats().get("num_decommits", 0))
    for block in live:
        pool.free(block)
    pool.empty_cache()  # its memfds go now, not when the pool is collected
    return seconds / steps, decommits, ooms


def allocator_cost_markdown(policies: list[str]) -> str:
    lines = [
        "| MiB allocated (of 1,024) | policy | us per malloc or free, best of 3 | decommits | OOMs |"
    ]
    lines.append("|---|---|---|---|---|")
    for target in ALLOCATOR_COST_TARGETS:
        for policy in policies:
            runs = [allocator_cost(policy, target, ALLOCATOR_COST_STEPS) for _ in range(3)]
            best = min(run[0] for run in runs)
            decommits = "/".join(f"{run[1]:,}" for run in runs)
            ooms = "/".join(f"{run[2]:,}" for run in runs)
            lines.append(f"| {target} | {policy} | {best * 1e6:.1f} | {decommits} | {ooms} |")
    return "\n".join(lines)


@dataclass(frozen=True)
class SameWorkRun:
    pair: int
    policy: str
    wall_s: float
    requests: int
    expected_errors: int
    server_cpu_s: float
    server_faults: int

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.wall_s

    @property
    def cpu_ms_per_request(self) -> float:
        return self.server_cpu_s / self.requests * 1e3


def server_cpu(pid: int) -> tuple[float, int]:
    """A process's CPU seconds (user + system) and minor page faults, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks, int(fields[7])


SERVE = [sys.executable, "-m", "tensord_server", "serve", "--address", "127.0.0.1:0"]
SERVE += ["--device", "cpu=1GiB"]
BARRIER_TIMEOUT_S = 600.0  # a same-work run's users wait this long for each other at most


def same_work_once(policy: str, pair: int, users: int, steps: int) -> SameWorkRun:
    """One server with ``policy``; ``users`` threads, user i running the load test's i-th
    workload of the default mix (seeded: workload_rng, seeded_step), ``steps`` steps each;
    the server's CPU measured between a barrier after every user's start() and one after
    its last step."""
    kinds = [name for name, weight in parse_weights(None).items() for _ in range(weight)]
    kinds = [kinds[i % len(kinds)] for i in range(users)]
    server, address = launch_serve([*SERVE, "--policy", policy])
    try:
        counts = {"ok": 0, "expected": 0, "failed": 0}
        lock = threading.Lock()

        def record(op: str, seconds: float, nbytes: int, exc: object, expected: bool) -> None:
            with lock:
                counts["expected" if expected else "failed" if exc else "ok"] += 1

        marks: dict[str, Any] = {}

        def at_start() -> None:  # every user started; run by the last to arrive, alone
            marks["cpu"], marks["faults"] = server_cpu(server.pid)
            marks["begin"] = time.perf_counter()
            counts.update(ok=0, expected=0, failed=0)  # start()'s requests are not counted

        def at_finish() -> None:  # every user took its last step
            marks["wall"] = time.perf_counter() - marks["begin"]
            cpu, faults = server_cpu(server.pid)
            marks["cpu"], marks["faults"] = cpu - marks["cpu"], faults - marks["faults"]
            marks["done"] = dict(counts)

        started = threading.Barrier(users, at_start)
        finished = threading.Barrier(users, at_finish)

        def user(index: int) -> None:
            try:
                with tensord.connect(address) as client:
                    name = kinds[index]
                    seed = f"same-work-{pair}"
                    workload = WORKLOADS[name](
                        client,
                        record,
                        rng=workload_rng(seed, name, index),
                        run_id=f"same-work-{pair}",
                    )
                    with contextlib.suppress(OpFailed):  # recorded; it carries on
                        workload.start()
                    # start()'s queued ops and releases reach the server before the window
                    client.synchronize()
                    client.flush()
                    started.wait(BARRIER_TIMEOUT_S)
                    for step in range(steps):
                        with contextlib.suppress(OpFailed):
                            seeded_step(workload, seed, index, 0, step)
                    client.synchronize()  # ... and the last steps' inside it
                    client.flush()
                    finished.wait(BARRIER_TIMEOUT_S)
                    with contextlib.suppress(OpFailed):
                        workload.stop()
            except BaseException:
                started.abort()  # the other users stop waiting for this one
                finished.abort()
                raise

        threads = [threading.Thread(target=user, args=(i,)) for i in range(users)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        server.terminate()
        server.wait(timeout=30)
    if "done" not in marks:
        raise SystemExit(f"{policy}: a user failed before its last step (see above)")
    done = marks["done"]
    if done["failed"]:
        print(f"{policy}: {done['failed']} unexpected failures", file=sys.stderr)
    return SameWorkRun(
        pair, policy, marks["wall"], done["ok"], done["expected"], marks["cpu"], marks["faults"]
    )


def paired_same_work(policies: list[str], pairs: int, users: int, steps: int) -> list[SameWorkRun]:
    runs = []
    for pair in range(pairs):
        for policy in run_order(policies, pair):
            run = same_work_once(policy, pair, users, steps)
            runs.append(run)
            print(
                f"pair {pair} {policy}: {run.requests_per_s:.0f}/s, "
                f"{run.cpu_ms_per_request:.3f} ms CPU/request",
                file=sys.stderr,
            )
    return runs


def same_work_markdown(runs: list[SameWorkRun], policies: list[str]) -> str:
    lines = [
        "| pair | policy | wall s | requests | expected errors | requests/s "
        "| server CPU s | CPU ms/request | minor faults |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| {r.pair} | {r.policy} | {r.wall_s:.2f} | {r.requests} | {r.expected_errors} "
            f"| {r.requests_per_s:.0f} | {r.server_cpu_s:.2f} | {r.cpu_ms_per_request:.3f} "
            f"| {r.server_faults} |"
        )
    first = {r.pair: r for r in runs if r.policy == policies[0]}
    lines += [
        "",
        f"| policy | requests/s vs {policies[0]}, per pair | mean | "
        f"CPU per request vs {policies[0]}, per pair | mean |",
        "|---|---|---|---|---|",
    ]
    for policy in policies[1:]:
        mine = [r for r in runs if r.policy == policy]
        speed = [r.requests_per_s / first[r.pair].requests_per_s for r in mine]
        cost = [r.cpu_ms_per_request / first[r.pair].cpu_ms_per_request for r in mine]
        lines.append(
            f"| {policy} | {', '.join(f'{v:.2f}' for v in speed)} | {sum(speed) / len(speed):.2f} "
            f"| {', '.join(f'{v:.2f}' for v in cost)} | {sum(cost) / len(cost):.2f} |"
        )
    return "\n".join(lines)


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
    parser.add_argument(
        "--concurrent",
        action="store_true",
        help="run each load-test pair's policies at the same time (--loadtest-pairs)",
    )
    parser.add_argument(
        "--same-work-pairs", type=int, default=0, help="paired same-work runs instead of replays"
    )
    parser.add_argument("--steps", type=int, default=60, help="steps per user (--same-work-pairs)")
    parser.add_argument(
        "--allocator-cost", action="store_true", help="CPU per malloc/free under each policy"
    )
    parser.add_argument(
        "--synthetic",
        type=int,
        default=0,
        metavar="SEEDS",
        help="the generated trace families over SEEDS seeds each, instead of the bundled traces",
    )
    parser.add_argument("--policies", default="pytorch,adaptive")
    parser.add_argument("-u", "--users", type=int, default=50)
    parser.add_argument("-t", "--run-time", default="60s")
    parser.add_argument("--out", type=Path, default=None, help="the load tests' folders")
    args = parser.parse_args()
    policies = args.policies.split(",")
    if len(set(policies)) != len(policies):
        parser.error(f"--policies names a policy twice: {args.policies}")
    if args.concurrent and args.loadtest_pairs <= 0:
        parser.error("--concurrent runs load-test pairs: give --loadtest-pairs N")
    if args.allocator_cost:
        print(allocator_cost_markdown(policies))
        return 0
    if args.synthetic > 0:
        families = measure_families(args.synthetic)
        print(
            json.dumps([asdict(r) for r in families]) if args.json else families_markdown(families)
        )
        return 0
    if args.same_work_pairs > 0:
        same = paired_same_work(policies, args.same_work_pairs, args.users, args.steps)
        print(
            json.dumps([asdict(r) for r in same])
            if args.json
            else same_work_markdown(same, policies)
        )
        return 0
    if args.loadtest_pairs > 0:
        out = args.out or Path(tempfile.mkdtemp(prefix="bench-fragmentation-"))
        pairing = concurrent_loadtests if args.concurrent else paired_loadtests
        runs = pairing(policies, args.loadtest_pairs, args.users, args.run_time, out, args.seed)
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
