"""Same-host put after a pause: the host pool's warm reserve against no reserve.

    python benchmarks/bench_warm_pool.py             # 64 MiB and 256 MiB, 3 rounds each
    python benchmarks/bench_warm_pool.py --rounds 5 --pause 4

Starts ``tensord serve`` with its defaults twice, once with ``--warm-reserve 0`` (idle
segments go back after the policy's ``release_idle_s``, the pool without a reserve) and
once as it comes (the default reserve), and times ``x = client.tensor(a)`` in a loop, as a
client uploading one array after another does: back to back (warm), then with a pause
between puts (``--pause`` seconds, longer than ``release_idle_s`` and shorter than the
reserve's decay).  Prints the median and range of the rounds for each, in milliseconds;
the machine is shared, so the medians are the figures.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np
import tensord

sys.path.insert(0, str(Path(__file__).resolve().parent))
from servers import start_server

MiB = 1 << 20
SIZES = (64 * MiB, 256 * MiB)
ROUNDS = 3  # timed puts per size and case (--rounds N)
PAUSE_S = 4.0  # between the paused puts (--pause S)


def arg(flag: str, default: float) -> float:
    """``flag X`` from the command line, else ``default``."""
    argv = sys.argv[1:]
    return float(argv[argv.index(flag) + 1]) if flag in argv[:-1] else default


def timed_puts(client: tensord.Client, src: np.ndarray, rounds: int, pause: float) -> list[float]:
    """Seconds of each of ``rounds`` puts, ``pause`` seconds after the previous one (the
    previous tensor dropped by the assignment, as a loop over arrays drops it)."""
    # the first two puts of a size pay for their segments (a put is allocated before the
    # tensor it replaces is dropped: two segments alternate), untimed
    x = client.tensor(src)
    x = client.tensor(src)
    seconds = []
    for _ in range(rounds):
        time.sleep(pause)
        start = time.perf_counter()
        x = client.tensor(src)
        seconds.append(time.perf_counter() - start)
    del x
    client.flush()
    return seconds


def row(label: str, seconds: list[float]) -> str:
    ms = [s * 1e3 for s in seconds]
    return f"{label}: median {statistics.median(ms):.1f} ms, range {min(ms):.1f}-{max(ms):.1f}"


def main() -> int:
    rounds = int(arg("--rounds", ROUNDS))
    pause = arg("--pause", PAUSE_S)
    cases = {"no reserve (--warm-reserve 0)": ("--warm-reserve", "0"), "default reserve": ()}
    for case, extra in cases.items():
        server, address = start_server(*extra)
        try:
            with tensord.connect(address) as client:
                for nbytes in SIZES:
                    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
                    size = f"{nbytes // MiB} MiB"
                    print(row(f"{case}, {size} put, warm", timed_puts(client, src, rounds, 0.0)))
                    after = f"{case}, {size} put after {pause:g} s"
                    print(row(after, timed_puts(client, src, rounds, pause)), flush=True)
        finally:
            server.terminate()
            server.wait(timeout=30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
