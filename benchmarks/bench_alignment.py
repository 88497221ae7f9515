"""Copy speed by the source's and destination's offsets within their pages (4K aliasing).

    python benchmarks/bench_alignment.py              # 256 MiB, 9 rounds
    python benchmarks/bench_alignment.py --mib 64 --rounds 15

A pooled host block starts on a page boundary; NumPy's large arrays (glibc's mmap'd
chunks) start 16 B into one.  On some CPUs and C libraries a copy whose destination runs
a few bytes ahead of its source modulo 4096 stalls every load behind a store to the
same low address bits (4K aliasing): ``np.copyto(out, np.from_dlpack(x))`` would then
run slower than the same copy between two NumPy arrays, whose offsets match.  This
prints, in GB/s (the median and best of ``--rounds`` rounds taking turns, so that a
neighbour's load falls on every pairing):

- ``np.copyto`` between two anonymous mappings at page offsets source/destination
  0/0, 16/16, 0/16 (the pool's block into NumPy's array), 16/0 (NumPy's array into the
  pool's block), 0/64 (into a torch CPU tensor's offset), 64/16;
- on a same-host server with its defaults: ``np.copyto(out, np.from_dlpack(x))`` with
  ``out = np.empty(...)`` against the same copy out of a NumPy array.

Where 0/16 runs as fast as 16/16 here, moving the pool's blocks to NumPy's offset would
gain nothing on this machine.
"""

from __future__ import annotations

import mmap
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import tensord

sys.path.insert(0, str(Path(__file__).resolve().parent))
from servers import start_server

MiB = 1 << 20
PAGE = 4096
PAIRS = ((0, 0), (16, 16), (0, 16), (16, 0), (0, 64), (64, 16))  # source, destination


def arg(flag: str, default: int) -> int:
    argv = sys.argv[1:]
    return int(argv[argv.index(flag) + 1]) if flag in argv[:-1] else default


def page_aligned(nbytes: int) -> np.ndarray:
    """A warm uint8 array over an anonymous mapping, a page to spare, from a page boundary."""
    array = np.frombuffer(mmap.mmap(-1, nbytes + 2 * PAGE), dtype=np.uint8)
    array[:] = 1
    return array[(-array.ctypes.data) % PAGE :]


def taking_turns(cases: dict[str, tuple[np.ndarray, np.ndarray]], rounds: int) -> None:
    """Each case's np.copyto(destination, source) once per round, every other round in
    reverse order; the median and best GB/s of each."""
    seconds: dict[str, list[float]] = {name: [] for name in cases}
    for index in range(rounds):
        for name in list(cases) if index % 2 == 0 else list(reversed(cases)):
            source, destination = cases[name]
            start = time.perf_counter()
            np.copyto(destination, source)
            seconds[name].append(time.perf_counter() - start)
    for name, times in seconds.items():
        nbytes = cases[name][0].nbytes
        median, best = nbytes / statistics.median(times) / 1e9, nbytes / min(times) / 1e9
        print(f"  {name}: median {median:.2f} GB/s, best {best:.2f}")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return re.findall(r"model name\s*:\s*(.*)", f.read())[0]
    except (OSError, IndexError):
        return platform.processor() or "unknown"


def main() -> int:
    nbytes = arg("--mib", 256) * MiB
    rounds = arg("--rounds", 9)
    libc = " ".join(platform.libc_ver())
    print(f"{cpu_model()}; {libc}; numpy {np.__version__}; {nbytes // MiB} MiB copies")
    source, destination = page_aligned(nbytes), page_aligned(nbytes)
    print("np.copyto between anonymous mappings, by page offset source/destination:")
    taking_turns(
        {f"{s:>2}/{d:<2}": (source[s : s + nbytes], destination[d : d + nbytes]) for s, d in PAIRS},
        rounds,
    )
    del source, destination
    server, address = start_server()
    try:
        with tensord.connect(address) as client:
            array = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
            x = client.tensor(array)
            pooled = np.from_dlpack(x)
            out = np.empty_like(array)
            out[:] = 1
            print(
                f"same host: the pooled block at {pooled.ctypes.data % PAGE} into its page, "
                f"NumPy's arrays at {array.ctypes.data % PAGE} and {out.ctypes.data % PAGE}:"
            )
            taking_turns(
                {
                    "np.copyto(out, np.from_dlpack(x))": (pooled, out),
                    "np.copyto(out, numpy_array)": (array, out),
                },
                rounds,
            )
            del pooled, x
    finally:
        server.terminate()
        server.wait(timeout=30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
