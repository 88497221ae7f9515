"""What tensord's CUDA paths cost against bare CuPy, measured in one run (needs CuPy and a GPU).

    python benchmarks/bench_cuda.py               # 1 GiB tensors
    python benchmarks/bench_cuda.py --mib 256     # smaller

Starts ``tensord serve --device cpu=... --device cuda:0=...`` in its own process
(the cpu pool pinned, as by default with a GPU) and prints, side by side with
ratios (best of ``--repeats``):

- ``x.to("cuda:0")`` / ``x.to("cpu")`` of a contiguous tensor through the server
  against a bare pinned CuPy copy (cudaMemcpyAsync from/to page-locked memory);
- ``x.t().contiguous()`` of a transposed float32 tensor on cuda:0 through the
  server against ``cupy.ascontiguousarray`` in this process;
- an upload over loopback gRPC straight into cuda:0, in GB/s.

Targets: ``to(device)`` >= 0.7x the bare copy; ``contiguous()`` >= 0.8x.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np
import tensord


def best(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` runs, in seconds (after one warm-up run)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def start_server(mib: int) -> tuple[subprocess.Popen[str], str]:
    # room for what the timed calls make before their releases land (best of N + a warm-up
    # per op, each result dropped at once; releases ride the next call): 6 GiB ran out of
    # memory on an H200 at 1 GiB, --repeats 3
    pool_gib = max(16, 12 * mib // 1024 + 4)
    command = [sys.executable, "-m", "tensord_server", "serve", "--address", "127.0.0.1:0"]
    command += ["--device", f"cpu={pool_gib}GiB", "--device", f"cuda:0={pool_gib}GiB"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    line = process.stdout.readline()
    match = re.search(r"listening on (\S+)", line)
    if match is None:
        process.kill()
        raise SystemExit(f"tensord serve did not start: {line!r}")
    return process, match.group(1)


def bare_copies(nbytes: int, repeats: int) -> dict[str, float]:
    import cupy

    runtime = cupy.cuda.runtime
    stream = cupy.cuda.Stream(non_blocking=True)
    pinned = cupy.cuda.alloc_pinned_memory(nbytes)
    device = cupy.empty(nbytes, dtype=cupy.uint8)

    def h2d() -> None:
        runtime.memcpyAsync(
            device.data.ptr, pinned.ptr, nbytes, runtime.memcpyHostToDevice, stream.ptr
        )
        stream.synchronize()

    def d2h() -> None:
        runtime.memcpyAsync(
            pinned.ptr, device.data.ptr, nbytes, runtime.memcpyDeviceToHost, stream.ptr
        )
        stream.synchronize()

    side = int((nbytes // 4) ** 0.5)
    square = cupy.ones((side, side), dtype=cupy.float32)

    def contiguous() -> None:
        cupy.ascontiguousarray(square.T)
        cupy.cuda.Device().synchronize()

    return {
        "to(cuda:0)": best(h2d, repeats),
        "to(cpu)": best(d2h, repeats),
        "contiguous()": best(contiguous, repeats),
    }


def server_copies(address: str, nbytes: int, repeats: int) -> dict[str, float]:
    side = int((nbytes // 4) ** 0.5)
    with tensord.connect(address) as c:
        host = c.zeros(nbytes, dtype=tensord.uint8)
        on_gpu = host.to("cuda:0")
        square = c.ones(side, side, device="cuda:0")
        data = np.ones(nbytes, dtype=np.uint8)

        def contiguous() -> None:
            # the server queues the copy on its stream and answers: reading one element back
            # (ordered after the copy on that stream) waits for it, as the bare side's sync
            square.t().contiguous()[-1, -1].item()

        def upload() -> None:
            c.tensor(data, device="cuda:0")
            c.flush()

        result = {
            "to(cuda:0)": best(lambda: host.to("cuda:0"), repeats),
            "to(cpu)": best(lambda: on_gpu.to("cpu"), repeats),
            "contiguous()": best(contiguous, repeats),
            "upload": best(upload, repeats),
        }
        c.flush()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=1024, help="tensor size in MiB (default 1024)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    nbytes = args.mib << 20
    process, address = start_server(args.mib)
    try:
        bare = bare_copies(nbytes, args.repeats)
        import cupy  # only now: this module must import without CuPy for --help

        cupy.get_default_memory_pool().free_all_blocks()  # give the server the memory back
        served = server_copies(address, nbytes, args.repeats)
    finally:
        process.terminate()
        process.wait(timeout=30)
    gb = nbytes / 1e9
    print(f"{args.mib} MiB, best of {args.repeats}")
    print(f"{'operation':<14} {'tensord GB/s':>13} {'bare CuPy GB/s':>15} {'ratio':>7} target")
    for name, target in (("to(cuda:0)", 0.7), ("to(cpu)", 0.7), ("contiguous()", 0.8)):
        ours, theirs = gb / served[name], gb / bare[name]
        print(f"{name:<14} {ours:13.1f} {theirs:15.1f} {ours / theirs:7.2f} >= {target}")
    print(f"{'upload':<14} {gb / served['upload']:13.2f} {'(loopback gRPC)':>15}")


if __name__ == "__main__":
    main()
