"""Tiered memory: spill and restore rates against the raw file, and an oversubscribed loop.

1. Spill and restore, in this process, through the server's own StorageRegistry over a cpu
   pool: Storages of 2, 16 and 64 MiB, ``--bytes`` of them per size, spilled all at once
   (``StorageRegistry.spill``: copy to the tier with its checksum, repoint, free the
   block), then held and restored (``ensure_resident``: allocate, copy back, verify), over
   one tier that lives for every round, as a server's does.  Two tiers, each beside its
   raw rate on the same bytes:

   - disk (in ``--dir``, default the system's temporary directory): the raw side writes
     the same bytes sequentially (``os.pwrite``, one call per buffer) to one preallocated
     file on the same filesystem, then reads them back (``os.preadv``) into warm buffers.
     Both files are written once before the timed rounds, so both sides' pages are in the
     page cache alike.
   - host: the raw side copies each buffer into a new host buffer, then copies it back
     into a warm buffer and frees it (as a restore frees the tier's buffer).

   The ratio is tensord's rate over the raw one (target >= 0.8).  Rounds interleave the two
   sides after one untimed round of each, and the table shows the median with tensord's
   range.

2. An oversubscribed loop through a real server and the SDK (``local=False``: every byte
   over gRPC, no same-host mapping): live data twice the device in Storages of 4 MiB, a
   hot set half the device; each round copies every hot tensor into the next
   (``copy_``, one read and one write each) and waits.  The same loop on a server whose pool
   holds everything (no tiers) is the baseline: the ratio of their steady rounds' times
   (target <= 1.5); the first round, which faults the hot set in, is shown apart, and the
   steady rounds start once the background spiller brought the pool under its high
   watermark again.

    python benchmarks/bench_tiers.py [--dir DIR] [--bytes 256MiB] [--rounds 5]
    python benchmarks/bench_tiers.py --quick
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import tensord
from tensord_server.devices.table import DeviceTable, parse_bytes
from tensord_server.domain.storage import HIGH_WATERMARK, StorageRegistry
from tensord_server.domain.store import TensorStore
from tensord_server.domain.tiers import DiskTier, HostTier, Tier, TierChain
from tensord_server.rpc.grpc_server import create_server

MiB = 1 << 20
SIZES = (2 * MiB, 16 * MiB, 64 * MiB)
SPILL_TARGET = 0.8  # tensord's spill / restore rate over the raw file's, at least
LOOP_TARGET = 1.5  # the oversubscribed loop's time over the resident one's, at most
SETTLE_S = 10.0  # the longest wait for the spiller after the loop's first round


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


class RawFile:
    """The baseline: ``buffers`` written to and read from one preallocated file, in order."""

    def __init__(self, directory: Path, buffers: list[np.ndarray]) -> None:
        self.buffers = buffers
        self.path = directory / f"bench-raw-{os.getpid()}.bin"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.posix_fallocate(self.fd, 0, sum(b.nbytes for b in buffers))
        self.outs = [np.zeros_like(b) for b in buffers]  # warm, as a restore's pool blocks

    def round(self) -> tuple[float, float]:
        """(write s, read s)."""
        started = time.perf_counter()
        offset = 0
        for buffer in self.buffers:
            os.pwrite(self.fd, memoryview(buffer), offset)
            offset += buffer.nbytes
        wrote = time.perf_counter() - started
        started = time.perf_counter()
        offset = 0
        for out in self.outs:
            os.preadv(self.fd, [memoryview(out)], offset)
            offset += out.nbytes
        read = time.perf_counter() - started
        pairs = zip(self.outs, self.buffers, strict=True)
        assert all(np.array_equal(a[:: 1 << 16], b[:: 1 << 16]) for a, b in pairs)
        return wrote, read

    def close(self) -> None:
        os.close(self.fd)
        self.path.unlink()


class RawCopy:
    """The host tier's baseline: each of ``buffers`` copied into a new host buffer, then
    copied back into a warm buffer and let go (as a restore frees the tier's buffer)."""

    def __init__(self, buffers: list[np.ndarray]) -> None:
        self.buffers = buffers
        self.copies: list[np.ndarray] = []
        self.outs = [np.zeros_like(b) for b in buffers]  # warm, as a restore's pool blocks

    def round(self) -> tuple[float, float]:
        """(copy-out s, copy-back s)."""
        started = time.perf_counter()
        self.copies = [buffer.copy() for buffer in self.buffers]
        copied = time.perf_counter() - started
        started = time.perf_counter()
        for index, out in enumerate(self.outs):
            np.copyto(out, self.copies[index])
            self.copies[index] = out  # the copy goes, as a restored Storage's host buffer
        back = time.perf_counter() - started
        pairs = zip(self.outs, self.buffers, strict=True)
        assert all(np.array_equal(a[:: 1 << 16], b[:: 1 << 16]) for a, b in pairs)
        return copied, back

    def close(self) -> None:
        self.copies = []


class TierBench:
    """Storages of ``size``, ``total`` bytes of them, over one registry and one tier (made
    by ``make_tier`` for the device's name and the bytes it must hold) that live for every
    round (as a server's do)."""

    def __init__(self, make_tier: Callable[[str, int], Tier], size: int, total: int) -> None:
        self.count = max(1, total // size)
        self.nbytes = self.count * size
        (self.device,) = DeviceTable([f"cpu={2 * self.nbytes + 64 * MiB}"])
        self.registry = StorageRegistry()
        self.tier = make_tier(self.device.name, self.nbytes + MiB)
        self.registry.tiers[self.device.name] = TierChain([self.tier])
        rng = np.random.default_rng(size)
        self.storages = []
        for _ in range(self.count):
            storage = self.registry.allocate(self.device, size)
            storage.raw()[:] = rng.integers(0, 256, size, dtype=np.uint8)
            self.registry.incref(storage)  # a handle's reference
            self.registry.release_hold(storage)
            self.storages.append(storage)

    def round(self) -> tuple[float, float]:
        """(spill s, restore s) of every Storage."""
        registry = self.registry
        started = time.perf_counter()
        moved = registry.spill(self.device, self.nbytes)
        spilled = time.perf_counter() - started
        assert moved == self.nbytes, (moved, self.nbytes)
        registry.hold_all(self.storages)
        started = time.perf_counter()
        registry.ensure_resident(self.storages)
        restored = time.perf_counter() - started
        registry.release_holds(self.storages)
        return spilled, restored

    def close(self) -> None:
        for storage in self.storages:
            self.registry.decref(storage)
        self.tier.close()
        self.device.pool.empty_cache()  # the segments go back now, not when collected


def bench_spill(
    kind: str, directory: Path, total: int, rounds: int
) -> list[tuple[str, float, float]]:
    """One tier's table (``kind``: disk or host) against its raw rate; its rows' ratios."""
    rows = []
    raw_name = "raw write" if kind == "disk" else "raw copy"
    back_name = "raw read" if kind == "disk" else "raw back"
    where = f", in {directory}" if kind == "disk" else ""
    print(f"\n{kind} tier: spill / restore of {total // MiB} MiB per size, {rounds} rounds{where}")
    header = (
        f"{'size':>8} {'spill GB/s':>12} {raw_name:>12} {'ratio':>7}   "
        f"{'restore GB/s':>12} {back_name:>12} {'ratio':>7}"
    )
    print(header)
    for size in SIZES:
        count = max(1, total // size)
        nbytes = count * size
        buffers = [
            np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8) for i in range(count)
        ]
        spill, restore, write, read = [], [], [], []
        if kind == "disk":
            tiers = TierBench(lambda device, cap: DiskTier(directory, cap, device), size, nbytes)
            raw: RawFile | RawCopy = RawFile(directory, buffers)
        else:
            tiers = TierBench(lambda device, cap: HostTier(cap), size, nbytes)
            raw = RawCopy(buffers)
        try:
            tiers.round()  # untimed: the page cache, the file and the pool warm up
            raw.round()
            for _ in range(rounds):
                s, r = tiers.round()
                spill.append(gbps(nbytes, s))
                restore.append(gbps(nbytes, r))
                w, rd = raw.round()
                write.append(gbps(nbytes, w))
                read.append(gbps(nbytes, rd))
        finally:
            tiers.close()
            raw.close()
        sp, rs = statistics.median(spill), statistics.median(restore)
        wr, rd = statistics.median(write), statistics.median(read)
        print(
            f"{size // MiB:>5}MiB {sp:>12.2f} {wr:>12.2f} {sp / wr:>7.2f}   "
            f"{rs:>12.2f} {rd:>12.2f} {rs / rd:>7.2f}"
            f"   (spill {min(spill):.2f}-{max(spill):.2f}, restore "
            f"{min(restore):.2f}-{max(restore):.2f})"
        )
        rows.append((f"{kind} {size // MiB}MiB", sp / wr, rs / rd))
    return rows


def loop_round(hot: list[Any], client: Any) -> float:
    started = time.perf_counter()
    for source, destination in zip(hot, hot[1:] + hot[:1], strict=True):
        destination.copy_(source)
    client.synchronize()
    return time.perf_counter() - started


def run_loop(device_bytes: int, tiers: bool, directory: Path, rounds: int) -> tuple[float, float]:
    """(first round s, median of the later rounds s) of the loop on one server."""
    tensor_bytes = 4 * MiB
    live = 2 * device_bytes // tensor_bytes
    hot_count = device_bytes // 2 // tensor_bytes
    pool = device_bytes if tiers else 3 * device_bytes
    store = TensorStore(
        [f"cpu={pool}"],
        disk_tier=(str(directory), 3 * device_bytes) if tiers else None,
    )
    server, port = create_server("127.0.0.1:0", store=store)
    client = tensord.connect(f"127.0.0.1:{port}", local=False)
    try:
        elements = tensor_bytes // 4
        tensors = [client.full((elements,), float(i)) for i in range(live)]
        hot = tensors[-hot_count:]  # the last made: warm, as a working set would be
        for cold in tensors[: live - hot_count]:  # the cold ones were read once, long ago
            cold.fill_(1.0)
        client.synchronize()
        first = loop_round(hot, client)
        # the first round's restores spilled just enough for themselves; the background
        # spiller then takes the pool below its low watermark: steady rounds start after
        pool = next(iter(store.devices)).pool
        deadline = time.monotonic() + SETTLE_S
        while pool.allocated_bytes > HIGH_WATERMARK * pool.capacity:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        later = [loop_round(hot, client) for _ in range(rounds)]
        return first, statistics.median(later)
    finally:
        client.close()
        server.stop(None)
        store.close()


def bench_loop(directory: Path, device_bytes: int, rounds: int) -> float:
    print(
        f"\noversubscribed loop: device {device_bytes // MiB} MiB, live "
        f"{2 * device_bytes // MiB} MiB, hot set {device_bytes // 2 // MiB} MiB, "
        f"4 MiB tensors, {rounds} rounds after the first"
    )
    t_first, t_steady = run_loop(device_bytes, True, directory, rounds)
    r_first, r_steady = run_loop(device_bytes, False, directory, rounds)
    print(f"{'':>12} {'first round':>12} {'steady round':>13}")
    print(f"{'tiered':>12} {t_first * 1e3:>10.1f}ms {t_steady * 1e3:>11.1f}ms")
    print(f"{'resident':>12} {r_first * 1e3:>10.1f}ms {r_steady * 1e3:>11.1f}ms")
    ratio = t_steady / r_steady
    print(f"{'ratio':>12} {t_first / r_first:>12.2f} {ratio:>13.2f}  (target <= {LOOP_TARGET})")
    return ratio


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the files go")
    parser.add_argument("--bytes", default="256MiB", help="bytes spilled per Storage size")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="256MiB", help="the loop's device pool")
    parser.add_argument("--quick", action="store_true", help="small and fast: a smoke run")
    args = parser.parse_args(argv)
    directory = Path(args.dir)
    total, device, rounds = parse_bytes(args.bytes), parse_bytes(args.device), args.rounds
    if args.quick:
        total, device, rounds = 128 * MiB, 64 * MiB, 1
    print(f"uptime: {os.popen('uptime').read().strip()}")
    rows = bench_spill("disk", directory, total, rounds)
    rows += bench_spill("host", directory, total, rounds)
    ratio = bench_loop(directory, device, max(rounds, 2))
    short = [name for name, sp, rs in rows if min(sp, rs) < SPILL_TARGET]
    print(
        f"\nspill/restore target >= {SPILL_TARGET}x raw: "
        + ("met" if not short else f"missed at {', '.join(short)}")
        + f"; loop target <= {LOOP_TARGET}x: "
        + ("met" if ratio <= LOOP_TARGET else "missed")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
