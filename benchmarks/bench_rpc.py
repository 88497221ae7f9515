"""What a tensord RPC costs: a view against an empty RPC, transfers against bare gRPC and NumPy.

    python benchmarks/bench_rpc.py            # 1 MiB and 64 MiB transfers
    python benchmarks/bench_rpc.py --big      # and 1 GiB (needs ~6 GiB of free memory)

Starts two servers in their own processes, so neither shares this process's GIL:
``tensord serve`` and a bare gRPC server that streams raw byte chunks with
identity serializers and nothing else (the ceiling for any gRPC transfer here).
Prints one table of latencies (p50/p99) and one of throughputs, with ratios.
Targets: a view <= 1.5x an empty RPC; 64 MiB transfers >= 0.7x bare gRPC.
Pipelining: a view as the caller sees it (p50 of x[3], in turns of 100 calls
with the unpipelined client's), views/s of one client (views dropped
at once, which dead-view elision never sends, and views kept alive in a window of 1,024,
which the server applies), and 1,000 ``x[i].fill_(i)`` plus one read with pipelining on
and off (targets: p50 <= 25 us, >= 20,000 views/s, >= 10x).  Many clients:
aggregate views/s of 1, 2, 4 and 8 client *processes* (pipelined, the SDK's default; views
kept in a window, so the server applies each one and its release) against the bare
server's empty unary calls/s from as many processes, side by side (targets: the
aggregate never falls as clients are added; >= 1.0x bare gRPC).

    python benchmarks/bench_rpc.py --clients-only   # just the many-clients table
    python benchmarks/bench_rpc.py --clients-only --rounds 5 --seconds 4
        # each count measured in 5 interleaved rounds of 4 s windows: medians and ranges
    python benchmarks/bench_rpc.py --clients-only --rounds 5 --seconds 4 --pin
        # the same with both servers on the first CPU and the clients on the others
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc
import numpy as np
import tensord
from tensord import schema as pb

CHUNK = 1 << 20  # the chunk size tensord streams in
MiB = 1 << 20
OPTIONS = (
    ("grpc.max_send_message_length", 256 * MiB),
    ("grpc.max_receive_message_length", 256 * MiB),
)
LATENCY_CALLS = 3000
WARMUP_CALLS = 300


# ---- the bare server: raw bytes in and out, nothing else ------------------------------------


def _bare_upload(chunks: Iterator[bytes], context: object) -> bytes:
    total = 0
    for chunk in chunks:
        total += len(chunk)
    return total.to_bytes(8, "little")


def _bare_download(request: bytes, context: object) -> Iterator[bytes]:
    # Slice a NumPy buffer into bytes per chunk, as a server holding the tensor must.
    nbytes = int.from_bytes(request, "little")
    data = _PAYLOAD.setdefault(nbytes, np.ones(nbytes, np.uint8))
    view = memoryview(data)
    for start in range(0, nbytes, CHUNK):
        yield bytes(view[start : start + CHUNK])


_PAYLOAD: dict[int, np.ndarray] = {}


def serve_bare() -> None:
    handler = grpc.method_handlers_generic_handler(
        "bench.Raw",
        {
            "Upload": grpc.stream_unary_rpc_method_handler(_bare_upload),
            "Download": grpc.unary_stream_rpc_method_handler(_bare_download),
            "Empty": grpc.unary_unary_rpc_method_handler(lambda request, context: b""),
        },
    )
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4), handlers=(handler,), options=OPTIONS
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"bare listening on 127.0.0.1:{port}", flush=True)
    server.wait_for_termination()


def pinned(command: list[str], cpus: set[int] | None) -> list[str]:
    """``command`` run on ``cpus`` (every thread it will start): through this script, which
    pins itself and execs it (a ``preexec_fn`` is not safe in this process, which has
    threads once a client is connected).  None: unchanged."""
    if cpus is None:
        return command
    listed = ",".join(str(cpu) for cpu in sorted(cpus))
    return [sys.executable, __file__, "--exec-on-cpus", listed, *command]


def split_cpus() -> tuple[set[int], set[int]]:
    """``--pin``: the first CPU this process may use for the servers, the others for the
    clients (a server with a core of its own, as a deployed one has: on a small machine,
    client processes otherwise take the server's CPU as they are added)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("--pin needs at least 2 CPUs")
    return {cpus[0]}, set(cpus[1:])


# where the servers and the client processes run (None: anywhere); set by --pin
SERVER_CPUS: set[int] | None = None
CLIENT_CPUS: set[int] | None = None


def start(command: list[str], pattern: str) -> tuple[subprocess.Popen[str], str]:
    process = subprocess.Popen(pinned(command, SERVER_CPUS), stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    line = process.stdout.readline()
    match = re.search(pattern, line)
    if not match:
        process.kill()
        raise SystemExit(f"server did not start: {line!r}")
    return process, match.group(1)


# ---- measuring --------------------------------------------------------------------------------


def interleaved_latencies(
    fns: list[Callable[[], object]], calls: int, block: int = 1
) -> list[list[float]]:
    """Seconds per call of each function, taking turns so that drift in the machine's load
    (two servers and this client share two cores here) hits every row alike: ``block``
    calls of one, then of the next (a block > 1 measures a call among its own kind, not
    in the wake of another row's RPC)."""
    for _ in range(WARMUP_CALLS):
        for fn in fns:
            fn()
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(calls // block):
        for fn, out in zip(fns, samples, strict=True):
            for _ in range(block):
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
    return samples


def pct(samples: list[float], q: float) -> float:
    return float(np.percentile(samples, q))


def interleaved_rates(fns: list[Callable[[], object]], nbytes: int, repeats: int) -> list[float]:
    """GB/s of each function's median run, the functions taking turns (as for latencies)."""
    for fn in fns:
        fn()  # warm-up
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times, strict=True):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return [nbytes / statistics.median(t) / 1e9 for t in times]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--big", action="store_true", help="also transfer 1 GiB")
    parser.add_argument(
        "--clients-only", action="store_true", help="only the many-client-processes table"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="many-clients table: rounds over every client count, median reported (default 1)",
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=MANY_CLIENTS_SECONDS,
        help=f"many-clients table: each window's length (default {MANY_CLIENTS_SECONDS:g})",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="run both servers on the first CPU and every client on the others",
    )
    parser.add_argument("--bare-server", action="store_true", help=argparse.SUPPRESS)
    # CPUS COMMAND...: run COMMAND pinned to CPUS (comma-separated), see pinned()
    parser.add_argument("--exec-on-cpus", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    # one client process of the many-clients table: KIND ADDRESS START_AT SECONDS
    parser.add_argument("--client-process", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.exec_on_cpus:
        cpus, *command = args.exec_on_cpus
        os.sched_setaffinity(0, {int(cpu) for cpu in cpus.split(",")})
        os.execv(command[0], command)
    if args.bare_server:
        serve_bare()
        return 0
    if args.client_process:
        kind, target, start_at, seconds = args.client_process
        print(client_process(kind, target, float(start_at), float(seconds)), flush=True)
        return 0

    if args.pin:
        global SERVER_CPUS, CLIENT_CPUS
        SERVER_CPUS, CLIENT_CPUS = split_cpus()
        os.sched_setaffinity(0, CLIENT_CPUS)  # this process's own client too
        print(f"pinned: servers on CPU {sorted(SERVER_CPUS)}, clients on {sorted(CLIENT_CPUS)}")
    sizes = [1 * MiB, 64 * MiB] + ([1024 * MiB] if args.big else [])
    pool = "cpu=8GiB" if args.big else "cpu=2GiB"
    tensord_proc, address = start(
        [
            sys.executable,
            "-m",
            "tensord_server",
            "serve",
            "--address",
            "127.0.0.1:0",
            "--device",
            pool,
        ],
        r"tensord listening on (\S+)",
    )
    bare_proc, bare_address = start(
        [sys.executable, __file__, "--bare-server"], r"bare listening on (\S+)"
    )
    channel = grpc.insecure_channel(bare_address, options=OPTIONS)
    try:
        with tensord.connect(address) as client:
            print(
                f"tensord {tensord.__version__}, grpcio {grpc.__version__}, numpy {np.__version__}"
            )
            print(f"servers: tensord {address}, bare gRPC {bare_address}\n")
            if not args.clients_only:
                run_latency(client, channel)
                print()
                run_pipelining(client, address)
                print()
            run_many_clients(address, bare_address, max(args.rounds, 1), args.seconds)
            if not args.clients_only:
                print()
                run_transfers(client, channel, sizes)
    finally:
        channel.close()
        for process in (tensord_proc, bare_proc):
            process.terminate()
            process.wait(10)
            if process.stdout is not None:
                process.stdout.close()
    return 0


def run_latency(client: tensord.Client, channel: grpc.Channel) -> None:
    x = client.arange(12)
    conn = client._conn
    bare_empty = channel.unary_unary("/bench.Raw/Empty")
    rows = [
        (
            "empty RPC: Release([]) in the session",
            lambda: conn.call("Release", pb.ReleaseRequest()),
        ),
        ("empty RPC: ServerInfo", lambda: conn.call("ServerInfo", pb.ServerInfoRequest())),
        ("bare gRPC empty unary (other server)", lambda: bare_empty(b"")),
        ("view: x.view(3, 4) (new handle)", lambda: x.view(3, 4)),
        ("view: x[1:5] (new handle)", lambda: x[1:5]),
        ("metadata: x.shape, x.stride() (no RPC)", lambda: (x.shape, x.stride())),
    ]
    samples = interleaved_latencies([fn for _, fn in rows], LATENCY_CALLS)
    results = {name: got for (name, _), got in zip(rows, samples, strict=True)}
    base = statistics.median(results[rows[0][0]])
    print(
        f"{'latency, ' + str(LATENCY_CALLS) + ' calls each':<44}{'p50 us':>9}{'p99 us':>9}{'p50 / empty':>13}"
    )
    for name, samples in results.items():
        p50, p99 = pct(samples, 50), pct(samples, 99)
        print(f"{name:<44}{p50 * 1e6:>9.1f}{p99 * 1e6:>9.1f}{p50 / base:>12.2f}x")
    client.flush()


FILL_LOOP = 1000
VIEW_RATE_CALLS = 20000
# Views kept alive in a window this long: each is dropped 1,024 views after it was made,
# long after its Batch went (a queue flushes at 256 ops), so the server applies every view
# and its release: none is elided (dead-view elision only takes views still queued).
VIEW_WINDOW = 1024


def views_per_second(client: tensord.Client, keep: bool = False) -> float:
    """Views of one client, its queue flushed and applied at the end (synchronize).
    ``keep``: each view is kept in a window of VIEW_WINDOW, so the server applies all of
    them; else each is dropped at once (queued, then elided: nothing is sent)."""
    x = client.arange(12)
    window: list[object] = [None] * VIEW_WINDOW
    client.synchronize()
    start = time.perf_counter()
    if keep:
        for i in range(VIEW_RATE_CALLS):
            window[i % VIEW_WINDOW] = x[i % 12]
    else:
        for i in range(VIEW_RATE_CALLS):
            x[i % 12]
    client.synchronize()
    return VIEW_RATE_CALLS / (time.perf_counter() - start)


def fill_loop_seconds(client: tensord.Client) -> float:
    """1,000 ``x[i].fill_(i)`` and one read of x (which waits for all of them)."""
    x = client.zeros(FILL_LOOP)
    client.synchronize()
    start = time.perf_counter()
    for i in range(FILL_LOOP):
        x[i].fill_(i)
    values = x.numpy()
    elapsed = time.perf_counter() - start
    assert values[-1] == FILL_LOOP - 1
    return elapsed


def run_pipelining(client: tensord.Client, address: str) -> None:
    with tensord.connect(address, pipelining=False) as plain:
        x, y = client.arange(12), plain.arange(12)
        sync = client._conn
        # in turns of 100 calls: a pipelined view right after the other client's blocking
        # RPC waits for that client's gRPC threads to let go of the GIL (about 20 us here)
        samples = interleaved_latencies([lambda: x[3], lambda: y[3]], LATENCY_CALLS, 100)
        sync.synchronize()
        on_rate, off_rate = views_per_second(client), views_per_second(plain)
        on_kept, off_kept = views_per_second(client, True), views_per_second(plain, True)
        on = statistics.median(fill_loop_seconds(client) for _ in range(3))
        off = statistics.median(fill_loop_seconds(plain) for _ in range(3))
    print(f"{'pipelining':<52}{'on':>12}{'off':>12}{'on / off':>11}")
    p50_on, p50_off = pct(samples[0], 50) * 1e6, pct(samples[1], 50) * 1e6
    print(
        f"{'view x[3] as the caller sees it, p50 us':<52}{p50_on:>12.1f}{p50_off:>12.1f}"
        f"{p50_off / p50_on:>10.1f}x"
    )
    print(
        f"{'views/s, one client, dropped (elided; then sync)':<52}{on_rate:>12,.0f}"
        f"{off_rate:>12,.0f}{on_rate / off_rate:>10.1f}x"
    )
    print(
        f"{f'views/s, one client, {VIEW_WINDOW} kept alive (sent)':<52}{on_kept:>12,.0f}"
        f"{off_kept:>12,.0f}{on_kept / off_kept:>10.1f}x"
    )
    print(
        f"{f'{FILL_LOOP} x[i].fill_(i) + one read, ms (median of 3)':<52}{on * 1e3:>12.1f}"
        f"{off * 1e3:>12.1f}{off / on:>10.1f}x"
    )
    client.flush()


CLIENT_COUNTS = (1, 2, 4, 8)
MANY_CLIENTS_SECONDS = 2.0
# every process connects and warms up before a common start time this far ahead
MANY_CLIENTS_LEAD_S = 2.5


def client_process(kind: str, target: str, start_at: float, seconds: float) -> str:
    """One process of the many-clients table: "ops elapsed" once its window is over.

    ``tensord``: views ``x[i % 12]`` kept in a window of VIEW_WINDOW (queued, as the SDK
    does by default; the server applies every view and, once the window drops it, its
    release: none is elided), then one synchronize, inside the window's elapsed time.
    ``bare``: empty unary calls to the bare server.
    """
    if kind == "tensord":
        with tensord.connect(target) as client:
            x = client.arange(12)
            window: list[object] = [None] * VIEW_WINDOW

            def view(i: int) -> None:
                window[i % VIEW_WINDOW] = x[i % 12]

            for i in range(WARMUP_CALLS):
                view(i)
            client.synchronize()
            return _count_until(view, start_at, seconds, client.synchronize)
    channel = grpc.insecure_channel(target, options=OPTIONS)
    try:
        empty = channel.unary_unary("/bench.Raw/Empty")
        for _ in range(WARMUP_CALLS):
            empty(b"")
        return _count_until(lambda i: empty(b""), start_at, seconds, lambda: None)
    finally:
        channel.close()


def _count_until(
    op: Callable[[int], object], start_at: float, seconds: float, finish: Callable[[], None]
) -> str:
    time.sleep(max(start_at - time.time(), 0.0))
    t0 = time.perf_counter()
    end = t0 + seconds
    done = 0
    while time.perf_counter() < end:
        for _ in range(64):  # check the clock every 64 ops: a clock read is not free
            op(done)
            done += 1
    finish()
    return f"{done} {time.perf_counter() - t0}"


def aggregate_rate(kind: str, target: str, processes: int, seconds: float) -> float:
    """Ops/s of ``processes`` client processes started together: all ops over the longest
    process's elapsed time (a process's time includes waiting for its last batch)."""
    start_at = time.time() + MANY_CLIENTS_LEAD_S
    command = [sys.executable, __file__, "--client-process", kind, target, f"{start_at}"]
    command.append(f"{seconds}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    children = [
        subprocess.Popen(pinned(command, CLIENT_CPUS), stdout=subprocess.PIPE, text=True, env=env)
        for _ in range(processes)
    ]
    results = []
    for child in children:
        out, _ = child.communicate(timeout=60 + seconds)
        ops, elapsed = out.split()[-2:]
        results.append((int(ops), float(elapsed)))
    return sum(ops for ops, _ in results) / max(elapsed for _, elapsed in results)


def many_clients_order(round_index: int) -> tuple[int, ...]:
    """The client counts in the order round ``round_index`` measures them: reversed every
    other round, so that a drift of the machine's load over a run falls on each count alike."""
    return CLIENT_COUNTS if round_index % 2 == 0 else tuple(reversed(CLIENT_COUNTS))


def spread(rates: list[float]) -> str:
    """``median (min-max)`` of a count's rates over the rounds."""
    if len(rates) == 1:
        return f"{rates[0]:,.0f}"
    return f"{statistics.median(rates):,.0f} ({min(rates):,.0f}-{max(rates):,.0f})"


def run_many_clients(address: str, bare_address: str, rounds: int, seconds: float) -> None:
    """The many-clients table: ``rounds`` rounds over every client count (tensord's and the
    bare server's rate of a count measured back to back), then per count the median over
    the rounds with its range.  One 2 s window per count moved by more than the effect
    looked for (8 against 4 clients) on this shared machine: medians of rounds do not."""
    ours: dict[int, list[float]] = {n: [] for n in CLIENT_COUNTS}
    bare: dict[int, list[float]] = {n: [] for n in CLIENT_COUNTS}
    for round_index in range(rounds):
        for processes in many_clients_order(round_index):
            ours[processes].append(aggregate_rate("tensord", address, processes, seconds))
            bare[processes].append(aggregate_rate("bare", bare_address, processes, seconds))
        if rounds > 1:
            rates = " / ".join(f"{ours[n][-1]:,.0f}" for n in CLIENT_COUNTS)
            bares = " / ".join(f"{bare[n][-1]:,.0f}" for n in CLIENT_COUNTS)
            load = os.getloadavg()[0]
            print(f"round {round_index + 1}: views/s {rates}; bare {bares} (load {load:.1f})")
    title = f"many clients, {seconds:g} s each"
    if rounds > 1:
        title += f", median of {rounds} rounds (range)"
    print(f"{title:<34}{'tensord views/s':>28}{'bare empty/s':>24}{'vs bare':>9}")
    for processes in CLIENT_COUNTS:
        label = f"{processes} client process{'es' if processes > 1 else ''}"
        ratio = statistics.median(ours[processes]) / statistics.median(bare[processes])
        line = f"{label:<34}{spread(ours[processes]):>28}{spread(bare[processes]):>24}"
        print(f"{line}{ratio:>8.2f}x")
    medians = [statistics.median(ours[n]) for n in CLIENT_COUNTS]
    falls = [
        f"{a} -> {b}"
        for (a, x), (b, y) in zip(
            zip(CLIENT_COUNTS, medians, strict=True),
            zip(CLIENT_COUNTS[1:], medians[1:], strict=True),
            strict=False,
        )
        if y < x
    ]
    print(f"medians fall from {', '.join(falls)} clients" if falls else "medians never fall")


def run_transfers(client: tensord.Client, channel: grpc.Channel, sizes: list[int]) -> None:
    header = (
        f"{'size':>8}  {'direction':<9}{'tensord GB/s':>13}{'bare gRPC':>11}{'NumPy copy':>12}"
        f"{'vs bare':>9}{'vs NumPy':>10}"
    )
    print(header)
    for nbytes in sizes:
        numpy_rate, rows = transfer_rates(client, channel, nbytes)
        label = f"{nbytes // MiB} MiB"
        for direction, ours, bare in rows:
            print(
                f"{label:>8}  {direction:<9}{ours:>13.2f}{bare:>11.2f}{numpy_rate:>12.2f}"
                f"{ours / bare:>8.2f}x{ours / numpy_rate:>9.2f}x"
            )


def transfer_rates(
    client: tensord.Client, channel: grpc.Channel, nbytes: int
) -> tuple[float, list[tuple[str, float, float]]]:
    """GB/s of an in-process NumPy copy, and of (tensord, bare gRPC) uploads and downloads."""
    bare_upload = channel.stream_unary("/bench.Raw/Upload")
    bare_download = channel.unary_stream("/bench.Raw/Download")
    repeats = 20 if nbytes <= MiB else 7 if nbytes <= 64 * MiB else 3
    array = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    scratch = np.empty_like(array)
    view = memoryview(array)

    def numpy_copy() -> None:
        np.copyto(scratch, array)

    def bare_up() -> None:
        # the same work the SDK does: slice the array into bytes chunks and stream them
        bare_upload(bytes(view[i : i + CHUNK]) for i in range(0, nbytes, CHUNK))

    def bare_down() -> None:
        out = memoryview(scratch)
        pos = 0
        for chunk in bare_download(nbytes.to_bytes(8, "little")):
            out[pos : pos + len(chunk)] = chunk
            pos += len(chunk)

    def ours_up() -> None:
        client.from_numpy(array)  # dropped at once: its release goes out in the next batch

    x = client.from_numpy(array)
    numpy_rate, up, bare_up_rate, down, bare_down_rate = interleaved_rates(
        [numpy_copy, ours_up, bare_up, x.numpy, bare_down], nbytes, repeats
    )
    rows = [("upload", up, bare_up_rate), ("download", down, bare_down_rate)]
    del x
    client.flush()
    return numpy_rate, rows


if __name__ == "__main__":
    sys.exit(main())
