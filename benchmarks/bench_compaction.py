"""Compaction against PyTorch's allocator rules on fragmenting workloads, side by side.

Each workload runs twice, in this one process, through the server's own
StorageRegistry over a pool on the bookkeeping backend (no bytes, so only the
policy is measured): once as PyTorch's allocator (no relocator: OOM once
release-and-retry fails), once with compaction.  Between steps no Storage is
held (no op is in flight), so every block may move.  Workloads:

- the bundled ResNet-50 training trace, replayed on devices smaller than
  PyTorch's peak reserved (a multiple of its peak allocated);
- a bimodal mix like the load test's ``bimodal`` users (8-48 MiB requests
  living 1-4 steps among 64 KiB-3 MiB ones living 20-200 steps) on 1 GiB.

Printed per workload and allocator: OOMs, peak allocated and reserved, the
lowest allocated share of the device when an OOM happened, compactions, bytes
moved and released, and seconds.

``--loadtest`` then also runs ``tensord loadtest`` (real server, real bytes)
against ``tensord serve`` with and without ``--no-compaction``, one after the
other, and prints both summaries' figures.

    python benchmarks/bench_compaction.py [--trace TRACE] [--seed N]
    python benchmarks/bench_compaction.py --loadtest -u 50 -t 60s
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tensord.errors import OutOfMemoryError
from tensord_server.data import DEFAULT_TRACE_NAME, bundled_trace
from tensord_server.devices.memory import BookkeepingBackend
from tensord_server.devices.table import Device
from tensord_server.domain.storage import Storage, StorageRegistry
from tensord_server.pool import CachingPool
from tensord_server.tools.replay import RecordedAddressBackend, load_pytorch_stats, load_trace

# the ResNet-50 training trace that ships with the package (tensord_server/data/traces)
DEFAULT_TRACE = bundled_trace(DEFAULT_TRACE_NAME)
MiB = 1 << 20
GiB = 1 << 30
# Devices for the trace, as multiples of PyTorch's peak allocated (its peak reserved is
# 1.44x; from about 1.05x torch's own release-and-retry is enough, so no OOM either way).
TRACE_CAPACITY_FACTORS = (1.00, 1.01, 1.02, 1.03, 1.05)
# The bimodal mix: users (one run each), steps each, and the device.
BIMODAL_USERS = (4, 6, 8)
BIMODAL_STEPS = 3000
BIMODAL_CAPACITY = GiB

# One workload step: ("alloc", key, nbytes) or ("free", key, 0).
Step = tuple[str, Any, int]


@dataclass
class Outcome:
    ooms: int
    peak_allocated: int
    peak_reserved: int
    min_allocated_share_at_oom: float | None  # allocated / capacity when an OOM happened
    compactions: int
    moved: int
    released: int
    seconds: float


def run(steps: list[Step], backend: Any, capacity: int, compaction: bool) -> Outcome:
    """The steps through a registry over a fresh pool; every Storage unheld between steps."""
    registry = StorageRegistry()
    pool = CachingPool(backend, capacity=capacity, relocator=registry if compaction else None)
    device = Device("sim", pool, "bookkeeping")
    live: dict[Any, Storage] = {}
    ooms = 0
    shares: list[float] = []
    start = time.perf_counter()
    for action, key, nbytes in steps:
        if action == "alloc":
            try:
                storage = registry.allocate(device, nbytes)
            except OutOfMemoryError:
                ooms += 1
                allocated = pool.memory_stats()["allocated_bytes.all.current"]
                shares.append(allocated / capacity)
                continue
            registry.incref(storage)  # as a handle would
            registry.release_hold(storage)
            live[key] = storage
        else:
            storage = live.pop(key, None)
            if storage is not None:
                registry.decref(storage)
    seconds = time.perf_counter() - start
    stats = pool.memory_stats()
    return Outcome(
        ooms,
        int(stats["allocated_bytes.all.peak"]),
        int(stats["reserved_bytes.all.peak"]),
        min(shares) if shares else None,
        int(stats["num_compactions"]),
        int(stats["compaction_moved_bytes"]),
        int(stats["compaction_released_bytes"]),
        seconds,
    )


def trace_steps(events: list[tuple[str, int, int, int]]) -> list[Step]:
    steps: list[Step] = []
    for action, addr, size, _ in events:
        if action == "alloc":
            steps.append(("alloc", addr, size))
        elif action == "free_completed":
            steps.append(("free", addr, 0))
    return steps


def bimodal_steps(users: int, seed: int) -> list[Step]:
    """The load test's bimodal users, round-robin: each step allocates one tensor and frees
    what has expired (large ones after 1-4 steps, small ones after 20-200; at most 2 large
    and 48 small held per user, the oldest dropped first)."""
    rng = random.Random(seed)
    steps: list[Step] = []
    held: list[dict[str, list[tuple[int, int]]]] = [
        {"small": [], "large": []} for _ in range(users)
    ]
    key = 0
    for clock in range(1, BIMODAL_STEPS + 1):
        for user in held:
            key += 1
            if rng.random() < 0.25:
                kind, nbytes, due = (
                    "large",
                    int(rng.uniform(8, 48) * MiB),
                    clock + rng.randint(1, 4),
                )
            else:
                kind, nbytes = "small", int(rng.uniform(64 << 10, 3 * MiB))
                due = clock + rng.randint(20, 200)
            steps.append(("alloc", key, nbytes))
            user[kind].append((due, key))
            for name, cap in (("large", 2), ("small", 48)):
                keep = [(d, k) for d, k in user[name] if d > clock][-cap:]
                kept = {k for _, k in keep}
                steps.extend(("free", k, 0) for _, k in user[name] if k not in kept)
                user[name] = keep
    return steps


def mib(nbytes: float) -> str:
    return f"{nbytes / MiB:,.1f} MiB"


def table(rows: Iterator[tuple[str, str, Outcome]]) -> str:
    header = (
        f"{'workload':<34} {'allocator':<13} {'OOMs':>6} {'peak alloc':>13} {'peak reserved':>13} "
        f"{'min alloc@OOM':>13} {'compactions':>11} {'moved':>13} {'released':>13} {'seconds':>8}"
    )
    lines = [header, "-" * len(header)]
    for workload, allocator, o in rows:
        share = (
            "-" if o.min_allocated_share_at_oom is None else f"{o.min_allocated_share_at_oom:.0%}"
        )
        lines.append(
            f"{workload:<34} {allocator:<13} {o.ooms:>6,} {mib(o.peak_allocated):>13} "
            f"{mib(o.peak_reserved):>13} {share:>13} {o.compactions:>11,} {mib(o.moved):>13} "
            f"{mib(o.released):>13} {o.seconds:>8.2f}"
        )
    return "\n".join(lines)


def simulations(trace: Path, seed: int) -> Iterator[tuple[str, str, Outcome]]:
    if trace.exists():
        events = load_trace(trace)
        pytorch = load_pytorch_stats(trace) or {}
        peak = int(pytorch.get("allocated_bytes.all.peak", 0))
        segments = [(addr, size) for action, addr, size, _ in events if action == "segment_alloc"]
        steps = trace_steps(events)
        for factor in TRACE_CAPACITY_FACTORS if peak else ():
            capacity = int(peak * factor)
            name = f"{trace.name.split('.')[0]} @ {factor:.2f}x peak alloc"
            for label, on in (("pytorch rules", False), ("compaction", True)):
                backend = RecordedAddressBackend(segments, total_bytes=capacity)
                yield name, label, run(steps, backend, capacity, on)
    else:
        print(f"(trace not found: {trace}; skipping it)", file=sys.stderr)
    for users in BIMODAL_USERS:
        steps = bimodal_steps(users, seed)
        name = f"bimodal {users} users x {BIMODAL_STEPS} on 1 GiB"
        for label, on in (("pytorch rules", False), ("compaction", True)):
            backend = BookkeepingBackend(total_bytes=BIMODAL_CAPACITY)
            yield name, label, run(steps, backend, BIMODAL_CAPACITY, on)


# ---------------------------------------------------------------------------
# the real load test, against a server with and without compaction


def start_serve(device: str, users: int, compaction: bool) -> tuple[subprocess.Popen[str], str]:
    command = [sys.executable, "-m", "tensord_server", "serve", "--address", "127.0.0.1:0"]
    command += ["--device", device, "--session-grace", "2", "--max-workers", str(2 * users + 16)]
    if not compaction:
        command.append("--no-compaction")
    return launch_serve(command)


def launch_serve(command: list[str]) -> tuple[subprocess.Popen[str], str]:
    """``command`` (a ``tensord serve``) started, and the address it listens on."""
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    assert process.stdout is not None
    line = process.stdout.readline()  # bounded: the server prints it or exits
    if not line.startswith("tensord listening on "):
        process.kill()
        raise RuntimeError(f"tensord serve did not start: {line!r}")
    return process, line.removeprefix("tensord listening on ").strip()


def loadtests(users: int, run_time: str, device: str) -> None:
    import tensord

    print(
        f"\ntensord loadtest -u {users} -t {run_time} --device {device}, each against its own server"
    )
    rows = []
    for label, on in (("pytorch rules (--no-compaction)", False), ("compaction", True)):
        process, address = start_serve(device, users, on)
        try:
            out = Path(tempfile.mkdtemp(prefix="bench-compaction-"))
            command = [sys.executable, "-m", "tensord_server", "loadtest", "--address", address]
            command += ["-u", str(users), "-t", run_time, "--out", str(out), "--no-plot"]
            subprocess.run(command, check=False, timeout=3600)
            summary = json.loads((out / "summary.json").read_text())
            with tensord.connect(address) as client:
                stats = client.memory_stats(device.split("=")[0])
        finally:
            process.terminate()
            process.wait(timeout=30)
        ooms = {op: n for op, n in summary["expected_by_op"].items() if "OutOfMemory" in op}
        share = summary["min_allocated_at_oom_bytes"]
        capacity = summary["capacity_bytes"] or 0
        rows.append(
            f"{label:<32} requests {summary['requests']:>7,}  OOMs {summary['num_ooms']:>4} "
            f"(by op: {ooms or '-'})  peak alloc/reserved {mib(summary['peak_allocated_bytes'])}"
            f"/{mib(summary['peak_reserved_bytes'])}  lowest allocated at an OOM "
            f"{'-' if share is None else f'{share / capacity:.0%}' if capacity else mib(share)}  "
            f"compactions {stats.get('num_compactions', 0)}, moved "
            f"{mib(stats.get('compaction_moved_bytes', 0))}, released "
            f"{mib(stats.get('compaction_released_bytes', 0))}  unexpected failures "
            f"{summary['unexpected_failures']}  ({out})"
        )
    print("\n".join(rows))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--seed", type=int, default=0, help="the bimodal mix's seed")
    parser.add_argument("--loadtest", action="store_true", help="also run two real load tests")
    parser.add_argument("-u", "--users", type=int, default=50)
    parser.add_argument("-t", "--run-time", default="60s")
    parser.add_argument("--device", default="cpu=1GiB")
    args = parser.parse_args(argv)
    print(table(simulations(args.trace, args.seed)))
    if args.loadtest:
        loadtests(args.users, args.run_time, args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
