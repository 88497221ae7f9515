"""Same-host zero copy (issue 13): SDK transfers through the mapping against np.copyto and gRPC.

    python benchmarks/bench_local.py          # 64 MiB and 1 GiB (needs ~6 GiB of free memory)

Starts ``tensord serve`` in its own process; one client maps its memory (the default
on the same host), another is told ``local=False`` (today's gRPC path).  Prints, for
each size, the best of a few runs of: np.copyto of the same bytes in this process
(into a warm destination, and into a fresh one as x.numpy() must), same-host upload
(``client.tensor``) and download (``x.numpy()``), and the gRPC path; then
``torch.from_dlpack`` of a 1 GiB tensor: its time, the bytes the pool allocated and the
growth of this process's RSS.  Targets: same-host transfers >= 0.7x np.copyto;
from_dlpack of 1 GiB <= 1 ms with 0 bytes copied.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np
import tensord
import torch

MiB = 1 << 20
SIZES = (64 * MiB, 1024 * MiB)


def start_server() -> tuple[subprocess.Popen[str], str]:
    command = [sys.executable, "-m", "tensord_server", "serve", "--address", "127.0.0.1:0"]
    process = subprocess.Popen(
        [*command, "--device", "cpu=6GiB"], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    match = re.search(r"tensord listening on (\S+)", process.stdout.readline())
    if not match:
        process.kill()
        raise SystemExit("server did not start")
    return process, match.group(1)


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


def main() -> int:
    server, address = start_server()
    try:
        with tensord.connect(address) as local, tensord.connect(address, local=False) as remote:
            print(
                f"tensord {tensord.__version__}, numpy {np.__version__}, torch {torch.__version__}"
            )
            header = f"{'size':>8} {'path':<44} {'seconds':>9} {'GB/s':>7} {'x copyto':>9}"
            print(header)
            print("-" * len(header))
            for nbytes in SIZES:
                repeats = 5 if nbytes <= 64 * MiB else 3
                src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
                warm = np.empty_like(src)
                warm[:] = 1
                copyto = best(lambda: np.copyto(warm, src), repeats)  # noqa: B023
                fresh = best(lambda: np.copyto(np.empty_like(src), src), repeats)  # noqa: B023
                x = local.tensor(src)
                assert local._local.enabled, local._local.reason
                rows = [
                    ("np.copyto, warm destination (one process)", copyto),
                    ("np.copyto, fresh destination (one process)", fresh),
                    (
                        "same-host upload  client.tensor(a)",
                        best(lambda: local.tensor(src), repeats),  # noqa: B023
                    ),
                    ("same-host download  x.numpy()", best(x.numpy, repeats)),
                    ("gRPC upload  client.tensor(a)", best(lambda: remote.tensor(src), 1)),  # noqa: B023
                ]
                y = remote.tensor(src)
                rows.append(("gRPC download  x.numpy()", best(y.numpy, 1)))
                np.testing.assert_array_equal(x.numpy(), src)
                for name, seconds in rows:
                    print(
                        f"{nbytes // MiB:>5} MiB {name:<44} {seconds:>9.4f} "
                        f"{nbytes / seconds / 1e9:>7.2f} {copyto / seconds:>9.2f}"
                    )
                del x, y
                local.flush()
                remote.flush()
            local.put("bench-1g", local.zeros(256 * MiB, dtype=tensord.float32))
            with tensord.connect(address) as consumer:  # a fresh process-like client
                big = consumer.get("bench-1g")
                consumer.tensor(np.zeros(1, np.float32))  # detection and the fd socket, once
                allocated = consumer.memory_allocated()
                rss = rss_bytes()
                start = time.perf_counter()
                alias = torch.from_dlpack(big)
                first = time.perf_counter() - start
                start = time.perf_counter()
                again = torch.from_dlpack(big)
                warm_s = time.perf_counter() - start
                grown = rss_bytes() - rss
                copied = consumer.memory_allocated() - allocated
                print(
                    f"\ntorch.from_dlpack of a 1 GiB tensor: {first * 1e3:.3f} ms (first, maps the "
                    f"segment), {warm_s * 1e3:.3f} ms (segment mapped); pool allocated "
                    f"{copied} bytes; client RSS grew {grown / MiB:.1f} MiB; shape "
                    f"{tuple(alias.shape)}, aliases pool: {alias.data_ptr() == again.data_ptr()}"
                )
                del alias, again
            local.delete("bench-1g")
    finally:
        server.terminate()
        server.wait(timeout=30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
