"""Same-host zero copy: SDK transfers through the mapping against np.copyto and gRPC.

    python benchmarks/bench_local.py          # 64 MiB and 1 GiB (needs ~8 GiB of free memory)
    python benchmarks/bench_local.py --dlpack-only   # only the torch.from_dlpack part

Starts ``tensord serve`` in its own process; one client maps its memory (the default
on the same host), another is told ``local=False`` (the gRPC path).  Prints, for each
size, the best of a few runs (gRPC: one run) of three in-process np.copyto baselines:

  (a) anonymous (THP) warm source -> warm destination;
  (b) anonymous -> a fresh np.empty destination (what x.numpy() must do);
  (c) to / from a memfd MAP_SHARED mapping, the kind of memory the pool's segments are
      (upload: anonymous -> mapping; download: mapping -> fresh destination), the
      physical limit for pooled bytes on this host (download: the faster of one
      np.copyto and the SDK's slices), and beside it what else was tried for a download:
      the slices on two threads, MADV_HUGEPAGE or MADV_POPULATE_WRITE on the fresh
      destination, MADV_SEQUENTIAL on the source;

and (c) out of a memfd mapping into a warm destination; then same-host upload
(``client.tensor``) and download (``x.numpy()``), each also with every copy on the calling
thread (``copies.COPY_WORKERS = 1``, the path before the copy pool, for a before/after in
the same run), a download into an existing warm array
(``np.copyto(out, np.asarray(x, copy=False))``: one copy out of the mapping, compared
with (c) into a warm destination), the gRPC path, and each SDK path's ratio to each
baseline.  Then ``torch.from_dlpack`` of a 1 GiB tensor,
first (maps the segment), warm (a capsule alive: the export is reused) and again once no
capsule lives (a new Export, the segment still mapped), with the Export RPC's share,
the bytes the pool allocated and the growth of this process's RSS; then a fresh-Export
from_dlpack (its Export over the session's call channel), one Export on the channel alone,
a bare gRPC empty unary (bench_rpc.py's server) and tensord's empty RPC on the channel and
over gRPC, taking turns, median and best.  After the table, for each size, (a) and the SDK's
upload and download taking turns ``--rounds N`` times (default 9): the median and range
of each round's ratio.  Targets: same-host transfers >= 0.7x
np.copyto; from_dlpack of 1 GiB <= 1 ms with 0 bytes copied.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import tensord
import torch
from tensord import schema as pb
from tensord.local import copies, host_cache
from tensord.local.transfers import READ_SLICE_BYTES

sys.path.insert(0, str(Path(__file__).resolve().parent))
from servers import start_server

MiB = 1 << 20
SIZES = (64 * MiB, 1024 * MiB)
ROUNDS = 9  # side-by-side rounds per size (--rounds N)
FRESH_EXPORT_CALLS = 200
THP = "/sys/kernel/mm/transparent_hugepage"
# madvise(2) advice, by number: Python's mmap module lacks MADV_POPULATE_WRITE (Linux 5.14)
MADV_SEQUENTIAL = 2
MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_helper = ThreadPoolExecutor(1)


def advise(array: np.ndarray, advice: int) -> None:
    """madvise the pages under ``array`` (errors ignored: advice only)."""
    address = int(array.ctypes.data)
    start = address & ~4095
    _libc.madvise(start, array.nbytes + address - start, advice)


def download_variants(shared: np.ndarray, repeats: int) -> dict[str, float]:
    """Ways to copy a mapping into a fresh array beyond the SDK's 8 MiB slices, each a
    candidate for the SDK's download: two threads, hints on the destination, a hint on the
    source."""
    slice_bytes = READ_SLICE_BYTES

    def fresh(*advice: int) -> np.ndarray:
        out = np.empty_like(shared)
        for one in advice:
            advise(out, one)
        return out

    def two_threads(out: np.ndarray) -> np.ndarray:
        half = out.size // 2 // 4096 * 4096  # NumPy's copyto releases the GIL
        other = _helper.submit(copies.copy_in_slices, out[half:], shared[half:], slice_bytes)
        copies.copy_in_slices(out[:half], shared[:half], slice_bytes)
        other.result()
        return out

    def sliced(out: np.ndarray) -> np.ndarray:
        copies.copy_in_slices(out, shared, slice_bytes)
        return out

    def sequential_source() -> np.ndarray:
        advise(shared, MADV_SEQUENTIAL)
        return sliced(fresh())

    return {
        "2 threads": best(lambda: two_threads(fresh()), repeats),
        "dst hugepage": best(lambda: sliced(fresh(MADV_HUGEPAGE)), repeats),
        "dst populate": best(lambda: sliced(fresh(MADV_HUGEPAGE, MADV_POPULATE_WRITE)), repeats),
        "dst populate 2 threads": best(
            lambda: two_threads(fresh(MADV_HUGEPAGE, MADV_POPULATE_WRITE)), repeats
        ),
        "src sequential": best(sequential_source, repeats),
    }


def best(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
        del result
    return min(times)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def sysfs(name: str) -> str:
    try:
        with open(f"{THP}/{name}") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def shmem_huge_pages_available(setting: str) -> bool:
    """Whether a memfd mapping can get huge pages (shmem_enabled's selected word)."""
    selected = re.search(r"\[(\w[\w-]*)\]", setting)
    return selected is not None and selected.group(1) in {
        "always",
        "within_size",
        "advise",
        "force",
    }


def memfd_array(nbytes: int) -> np.ndarray:
    """A uint8 array over a memfd MAP_SHARED mapping, hinted MADV_HUGEPAGE as the pool's
    (unmapped when the array is collected)."""
    fd = os.memfd_create("bench-local")
    try:
        os.ftruncate(fd, nbytes)
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
    with contextlib.suppress(OSError, AttributeError, ValueError):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(mapping, dtype=np.uint8)


def anonymous_baselines(src: np.ndarray, repeats: int) -> dict[str, float]:
    warm = np.empty_like(src)
    warm[:] = 1
    return {
        "a": best(lambda: np.copyto(warm, src), repeats),
        "b": best(lambda: np.copyto(np.empty_like(src), src), repeats),
    }


def baselines(src: np.ndarray, repeats: int) -> dict[str, float]:
    times = anonymous_baselines(src, repeats)  # its warm destination is freed on return
    shared = memfd_array(src.nbytes)
    times["c up"] = best(lambda: np.copyto(shared, src), repeats)
    times["c down"] = best(lambda: np.copyto(np.empty_like(src), shared), repeats)
    times["c down sliced"] = best(
        lambda: copies.copy_in_slices(np.empty_like(src), shared, READ_SLICE_BYTES),
        repeats,
    )
    times |= download_variants(shared, repeats)
    warm = np.empty_like(src)
    warm[:] = 1
    times["c down warm"] = best(lambda: np.copyto(warm, shared), repeats)
    return times


def download_into(out: np.ndarray, x: Any) -> None:
    """A download into an existing array: one np.copyto out of the mapping, no fresh pages."""
    np.copyto(out, np.asarray(x, copy=False))


def one_thread(transfer: Callable[[], Any]) -> Callable[[], Any]:
    """``transfer`` as it was before the copy pool: every copy on the calling thread."""

    def run() -> Any:
        saved = copies.COPY_WORKERS
        copies.COPY_WORKERS = 1
        try:
            return transfer()
        finally:
            copies.COPY_WORKERS = saved

    return run


def no_numpy_cache(transfer: Callable[[], Any]) -> Callable[[], Any]:
    """``transfer`` as it was before x.numpy() reused its destinations: a fresh array each."""

    def run() -> Any:
        saved = host_cache.numpy_cache
        host_cache.numpy_cache = host_cache.HostBufferCache(0, 0)
        try:
            return transfer()
        finally:
            host_cache.numpy_cache = saved

    return run


def print_size(nbytes: int, base: dict[str, float], sdk: list[tuple[str, str, float]]) -> None:
    size = f"{nbytes // MiB} MiB"
    rows = [
        ("(a) np.copyto anon warm -> warm", "", base["a"]),
        ("(b) np.copyto anon -> fresh np.empty", "", base["b"]),
        ("(c) np.copyto anon -> memfd mapping", "", base["c up"]),
        ("(c) np.copyto memfd mapping -> fresh", "", base["c down"]),
        (f"    same, {READ_SLICE_BYTES // MiB} MiB slices", "", base["c down sliced"]),
        ("    same, slices on 2 threads", "", base["2 threads"]),
        ("    same, destination MADV_HUGEPAGE", "", base["dst hugepage"]),
        ("    same, destination MADV_POPULATE_WRITE", "", base["dst populate"]),
        ("    same, MADV_POPULATE_WRITE, 2 threads", "", base["dst populate 2 threads"]),
        ("    same, source MADV_SEQUENTIAL", "", base["src sequential"]),
        ("(c) np.copyto memfd mapping -> warm", "", base["c down warm"]),
        *sdk,
    ]
    for name, direction, seconds in rows:
        ratios = "- | - | -"
        if direction:
            # (c) for a download: the faster of the two in-process ways out of a mapping
            c = {
                "up": base["c up"],
                "down": min(base["c down"], base["c down sliced"]),
                "down warm": base["c down warm"],
            }[direction]
            ratios = " | ".join(f"{ref / seconds:.2f}" for ref in (base["a"], base["b"], c))
        print(f"| {size} | {name} | {seconds:.4f} | {nbytes / seconds / 1e9:.2f} | {ratios} |")


def transfers(local: Any, remote: Any, nbytes: int) -> list[str]:
    """The table's rows for ``nbytes`` (printed); the side-by-side rounds' lines (returned)."""
    repeats = 5 if nbytes <= 64 * MiB else 3
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    base = baselines(src, repeats)
    x = local.tensor(src)
    assert local._local.enabled, local._local.reason
    out = np.empty_like(src)
    out[:] = 1  # warm, as (a)'s destination
    sdk = [
        ("same-host upload `client.tensor(a)`", "up", best(lambda: local.tensor(src), repeats)),
        (
            "same-host upload, one thread",
            "up",
            best(one_thread(lambda: local.tensor(src)), repeats),
        ),
        ("same-host download `x.numpy()`", "down", best(x.numpy, repeats)),
        (
            "same-host download, one thread",
            "down",
            best(one_thread(x.numpy), repeats),
        ),
        (
            "same-host download, fresh array (before)",
            "down",
            best(no_numpy_cache(x.numpy), repeats),
        ),
        (
            "same-host download into an existing array",
            "down warm",
            best(functools.partial(download_into, out, x), repeats),
        ),
        ("gRPC upload `client.tensor(a)`", "up", best(lambda: remote.tensor(src), 1)),
    ]
    y = remote.tensor(src)
    sdk.append(("gRPC download `x.numpy()`", "down", best(y.numpy, 1)))
    np.testing.assert_array_equal(x.numpy(), src)
    print_size(nbytes, base, sdk)
    del y
    lines = side_by_side_rounds(local, x, src)
    del x
    local.flush()
    remote.flush()
    return lines


def side_by_side_rounds(local: Any, x: Any, src: np.ndarray, rounds: int = 0) -> list[str]:
    """(a) and the SDK's same-host upload and download taking turns, ``rounds`` times
    (``--rounds``; default ROUNDS), every other round in reverse order: each round's
    ratios compare runs seconds apart, so a neighbour's load on this shared machine falls
    on both sides of a ratio, which the table's best-of-few, minutes apart, does not
    promise.  Each ratio's median and range over the rounds, a line each."""
    rounds = rounds or arg_int("--rounds", ROUNDS)
    warm = np.empty_like(src)
    warm[:] = 1
    paths: dict[str, Callable[[], object]] = {
        "a": lambda: np.copyto(warm, src),
        "upload": lambda: local.tensor(src),
        "download": x.numpy,
    }
    x.numpy()  # the destination cache holds a dropped array of this size from here on
    ratios: dict[str, list[float]] = {"upload": [], "download": []}
    for round_index in range(rounds):
        order = list(paths) if round_index % 2 == 0 else list(reversed(paths))
        seconds = {name: best(paths[name], 1) for name in order}  # one run each
        for name in ratios:
            ratios[name].append(seconds["a"] / seconds[name])
    size = f"{src.nbytes // MiB} MiB"
    return [
        f"  {size} same-host {name}, {rounds} rounds taking turns with (a): x (a) median "
        f"{statistics.median(values):.2f}, range {min(values):.2f}-{max(values):.2f}, "
        f">= 0.7 in {sum(v >= 0.7 for v in values)} of {rounds}"
        for name, values in ratios.items()
    ]


def arg_int(flag: str, default: int) -> int:
    """``flag N`` from the command line, else ``default``."""
    argv = sys.argv[1:]
    if flag in argv[:-1]:
        return int(argv[argv.index(flag) + 1])
    return default


def start_bare_server() -> tuple[subprocess.Popen[str], str]:
    """bench_rpc.py's bare gRPC server (no tensord): the floor of one unary call."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_rpc.py")
    process = subprocess.Popen(
        [sys.executable, script, "--bare-server"], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    match = re.search(r"bare listening on (\S+)", process.stdout.readline())
    if not match:
        process.kill()
        raise SystemExit("bare server did not start")
    return process, match.group(1)


def fresh_export_against_empty_unaries(
    consumer: Any, big: Any, bare_address: str
) -> dict[str, list[float]]:
    """Seconds of a fresh-Export torch.from_dlpack (no capsule alive, segment mapped), a bare
    gRPC empty unary and tensord's empty RPC in the session, taking turns."""
    bare = grpc.insecure_channel(bare_address)
    bare_empty = bare.unary_unary("/bench.Raw/Empty")
    bare_empty(b"")
    conn = consumer._conn
    mapper = consumer._local
    channel = conn.call_channel  # the session's call channel, bound by now
    instance, mapped = mapper._mapped_hint
    request = pb.ExportRequest(handle=big.handle, server_instance=instance, mapped_segments=mapped)

    def channel_round_trip() -> object:
        """One Export's frame and answer on the call channel alone (no array, no call
        scaffolding); the export is released by the next flush."""
        answer = channel.unary("Export", request, 5.0) if channel is not None else None
        if answer is None:
            raise SystemExit(f"the call channel did not answer ({channel and channel.last_reason})")
        conn.queue_export_release(answer.export_id)
        return answer

    def grpc_release() -> object:
        return conn._stub.Release(pb.ReleaseRequest(), metadata=conn.metadata(), timeout=5.0)

    rows: dict[str, Callable[[], object]] = {
        "torch.from_dlpack, fresh Export": lambda: torch.from_dlpack(big),
        "Export on the call channel alone (CallChannel.unary)": channel_round_trip,
        "bare gRPC empty unary (bench_rpc's server)": lambda: bare_empty(b""),
        "tensord empty RPC Release([]) in the session (the call channel)": lambda: conn.call(
            "Release", pb.ReleaseRequest()
        ),
        "tensord empty RPC Release([]) in the session over gRPC": grpc_release,
    }
    seconds: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(FRESH_EXPORT_CALLS):
        for name, fn in rows.items():
            consumer.flush()  # the last capsule's export released: the next one is fresh
            start = time.perf_counter()
            result = fn()
            seconds[name].append(time.perf_counter() - start)
            del result
    bare.close()
    return seconds


def from_dlpack(address: str, local: Any, bare_address: str) -> None:
    local.put("bench-1g", local.zeros(256 * MiB, dtype=tensord.float32))
    with tensord.connect(address) as consumer:  # a fresh client: nothing mapped yet
        big = consumer.get("bench-1g")
        exports: list[float] = []
        call = consumer._conn.call

        def timed_call(method: str, request: Any, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return call(method, request, *args, **kwargs)
            finally:
                if method == "Export":
                    exports.append(time.perf_counter() - start)

        consumer._conn.call = timed_call  # the Export RPC's share of each from_dlpack
        allocated = consumer.memory_allocated()
        rss = rss_bytes()
        start = time.perf_counter()
        first_alias = torch.from_dlpack(big)
        first = time.perf_counter() - start
        first_exports = list(exports)
        warm: list[tuple[float, list[float]]] = []
        aliases = []
        for _ in range(5):
            exports.clear()
            start = time.perf_counter()
            aliases.append(torch.from_dlpack(big))
            warm.append((time.perf_counter() - start, list(exports)))
        grown = rss_bytes() - rss
        copied = consumer.memory_allocated() - allocated
        warm_s, warm_exports = min(warm)
        same = all(a.data_ptr() == first_alias.data_ptr() for a in aliases)
        del first_alias, aliases
        again: list[tuple[float, list[float]]] = []
        for _ in range(5):  # no capsule alive: each exports anew (the segment stays mapped)
            consumer.flush()
            exports.clear()
            start = time.perf_counter()
            alias = torch.from_dlpack(big)
            again.append((time.perf_counter() - start, list(exports)))
            del alias
        again_s, again_exports = min(again)
        side_by_side = fresh_export_against_empty_unaries(consumer, big, bare_address)
        print(
            f"\ntorch.from_dlpack of a 1 GiB tensor: first (maps the segment) {first * 1e3:.3f} ms, "
            f"of which {len(first_exports)} Export RPC {sum(first_exports) * 1e3:.3f} ms; warm "
            f"(a capsule alive, best of 5) {warm_s * 1e3:.3f} ms, of which {len(warm_exports)} "
            f"Export RPC {sum(warm_exports) * 1e3:.3f} ms; again with no capsule alive (segment "
            f"mapped, best of 5) {again_s * 1e3:.3f} ms, of which {len(again_exports)} Export RPC "
            f"{sum(again_exports) * 1e3:.3f} ms; pool allocated {copied} bytes; client RSS grew "
            f"{grown / MiB:.1f} MiB; shape (256 * 2**20,); all alias the same pooled bytes: {same}"
        )
        print(f"side by side, {FRESH_EXPORT_CALLS} calls each, taking turns (median / best ms):")
        for name, seconds in side_by_side.items():
            print(f"  {name}: {statistics.median(seconds) * 1e3:.3f} / {min(seconds) * 1e3:.3f}")
        answered = consumer._conn.call_channel.calls if consumer._conn.call_channel else 0
        print(f"  (calls the call channel answered: {answered}; the rest took gRPC)")
    local.delete("bench-1g")


def main() -> int:
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    shmem = sysfs("shmem_enabled")
    print(
        f"tensord {tensord.__version__}, numpy {np.__version__}, torch {torch.__version__}; "
        f"{os.cpu_count()} cpus, load average {load}"
    )
    print(
        f"THP enabled: {sysfs('enabled')}; shmem_enabled: {shmem} -> shared-memory huge pages "
        f"{'available' if shmem_huge_pages_available(shmem) else 'NOT available (4 KiB pages)'}"
    )
    dlpack_only = "--dlpack-only" in sys.argv[1:]  # skip the transfers
    server, address = start_server("--device", "cpu=6GiB")
    bare, bare_address = start_bare_server()
    try:
        with tensord.connect(address) as local, tensord.connect(address, local=False) as remote:
            if not dlpack_only:
                print(
                    "\n| size | path | seconds | GB/s | x (a) | x (b) | x (c) |\n"
                    "| --- | --- | --- | --- | --- | --- | --- |"
                )
                rounds = [line for nbytes in SIZES for line in transfers(local, remote, nbytes)]
                print("\nside by side (the ratio of each round's runs, seconds apart):")
                print("\n".join(rounds))
            from_dlpack(address, local, bare_address)
    finally:
        server.terminate()
        server.wait(timeout=30)
        bare.terminate()
        bare.wait(timeout=30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
