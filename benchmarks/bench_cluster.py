"""A two-node cluster on one machine: cross-node copies and name lookups, side by side.

    python benchmarks/bench_cluster.py                      # 1, 16, 64 MiB; 7 rounds each
    python benchmarks/bench_cluster.py --rounds 15
    python benchmarks/bench_cluster.py --baseline ../main   # and another tree's, in turns

Starts its own etcd (Debian's ``etcd-server``) on loopback ports and two ``tensord serve``
nodes, a and b, joined to it with a cluster secret; with ``--baseline TREE`` two more nodes
run the server and SDK of that source tree (``TREE/server``, ``TREE/client``: a ``git
worktree`` of another commit), so the figures before and after a change come from one run
under one load.  Each tree's cases run in a driver process of its own (its own SDK).
Prints, per size, the median and best GB/s of (in turns, so a neighbour's load falls on
each):

- ``x.to("b/cpu")``: a streams the bytes to b (node call, CRC-32 on both sides);
- ``x.to("cpu", copy=True)``: a copy on a itself (one memcpy on the server);
- a bare gRPC stream of the same bytes, in chunks of a node copy's size, from this process
  to a child process's ``grpc.aio`` server (raw ``bytes`` messages, no protobuf, no
  checksum, nothing stored): the reference a node copy's stream is measured against;
- a raw loopback TCP transfer of the same bytes to a child process (``sendall`` into
  ``recv_into``; no gRPC): the link's ceiling here;
- the client's own upload of the bytes to a (``a.tensor(data)``) and download of ``x``
  (``x.numpy()``, not same-host): the server's transfer path a copy's stream runs on;

and the median over rounds of each round's ``x.to("b/cpu")`` rate over that round's bare
gRPC stream.  Then the p50 and p99 latency of ``get(name)`` of a name a holds, from a client
of a (local) and from a client of b (redirected: b names the holder, the SDK gets the name
from a on its session there).  Targets: a 64 MiB cross-node copy at >= 0.8x the bare gRPC
stream; a redirected lookup p50 under 5 ms.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from servers import start_server

MiB = 1 << 20
SIZES_MIB = (1, 16, 64)
LOOKUPS = 300
LOOKUP_BATCH = 50  # lookups per turn: the trees' batches alternate
TOKENS = "bench-token bench\n"
SECRET = "bench-cluster-secret-0123456789"
STREAM_METHOD = "/bench.Sink/Take"
RECEIVER = """
import socket, sys
n = int(sys.argv[1]); rounds = int(sys.argv[2])
server = socket.create_server(("127.0.0.1", 0))
print(server.getsockname()[1], flush=True)
conn, _ = server.accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
buffer = bytearray(n)
view = memoryview(buffer)
for _ in range(rounds):
    got = 0
    while got < n:
        got += conn.recv_into(view[got:], n - got)
    conn.sendall(b"k")
"""


def arg(flag: str, default: str) -> str:
    argv = sys.argv[1:]
    return argv[argv.index(flag) + 1] if flag in argv[:-1] else default


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_etcd(folder: str) -> tuple[subprocess.Popen[bytes], str]:
    etcd = shutil.which("etcd")
    if etcd is None:
        raise SystemExit("no etcd on PATH (apt-get install etcd-server)")
    client, peer = free_port(), free_port()
    process = subprocess.Popen(
        [
            etcd,
            "--name=bench",
            f"--data-dir={folder}/etcd",
            f"--listen-client-urls=http://127.0.0.1:{client}",
            f"--advertise-client-urls=http://127.0.0.1:{client}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=bench=http://127.0.0.1:{peer}",
            "--log-level=error",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 20
    while True:
        try:
            with socket.create_connection(("127.0.0.1", client), timeout=0.5):
                return process, f"127.0.0.1:{client}"
        except OSError:
            if time.monotonic() > deadline:
                process.kill()
                raise SystemExit("etcd did not start") from None
            time.sleep(0.1)


def in_turns(cases: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Each case once per round (every other round in reverse order): the seconds each
    reported."""
    seconds: dict[str, list[float]] = {name: [] for name in cases}
    for round_ in range(rounds):
        order = list(cases) if round_ % 2 == 0 else list(reversed(cases))
        for name in order:
            seconds[name].append(cases[name]())
    return seconds


def timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


# ---- a tree's cases, in a driver process running that tree's SDK ----------------------------


def drive(address_a: str, address_b: str, node_b: str) -> None:
    """Answer the parent's commands on stdin, one JSON line each on stdout."""
    import tensord

    options = {"token": "bench-token", "local": False, "call_timeout": 120}
    with tensord.connect(address_a, **options) as a, tensord.connect(address_b, **options) as b:
        x: Any = None
        data: Any = None
        target = f"{node_b}/cpu"
        name = f"looked-up-{node_b}"  # names are the cluster's: one per tree
        cases: dict[str, Callable[[], object]] = {
            "to_node": lambda: x.to(target).handle,
            "to_self": lambda: x.to("cpu", copy=True).handle,
            "upload": lambda: a.tensor(data).handle,
            "download": lambda: x.numpy().nbytes,
        }
        for line in sys.stdin:
            command, _, rest = line.strip().partition(" ")
            answer: Any = "ok"
            if command == "size":
                nbytes = int(rest)
                data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
                x = a.tensor(data)
                moved = x.to(target)  # the session on b opened, the channels warm
                assert moved.numpy().tobytes() == data.tobytes()  # what is timed is right
                del moved
            elif command == "run":
                answer = timed(cases[rest])
            elif command == "lookups":
                if rest == "setup":
                    a.put(name, a.arange(4), overwrite=True)
                    a.get(name), b.get(name)  # warm: b's client's session on a opened
                else:
                    client = a if rest.startswith("local") else b
                    count = int(rest.split()[1])
                    answer = [timed(functools.partial(client.get, name)) for _ in range(count)]
            print(json.dumps(answer), flush=True)


class Driver:
    """A driver process for one tree's nodes."""

    def __init__(self, env: dict[str, str], address_a: str, address_b: str, node_b: str) -> None:
        command = [sys.executable, __file__, "--driver", address_a, address_b, node_b]
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )

    def ask(self, command: str) -> Any:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise SystemExit(f"a driver ended at {command!r}")
        return json.loads(line)

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait(timeout=60)


# ---- the references: a bare gRPC stream and raw TCP ------------------------------------------


def stream_receiver() -> None:
    """A grpc.aio server taking a stream of raw ``bytes`` messages, each read and dropped."""
    from tensord.protocol import MAX_MESSAGE_BYTES

    async def take(requests: Any, context: grpc.aio.ServicerContext) -> bytes:
        got = 0
        while (chunk := await context.read()) is not grpc.aio.EOF:
            got += len(chunk)
        return got.to_bytes(8, "little")

    async def serve() -> None:
        options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
        server = grpc.aio.server(options=options)
        handler = grpc.stream_unary_rpc_method_handler(take)
        service, method = STREAM_METHOD.strip("/").split("/")
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, {method: handler}),)
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(port, flush=True)
        await server.wait_for_termination()

    asyncio.run(serve())


class BareStream:
    """A child's bare gRPC receiver and a channel to it."""

    def __init__(self, env: dict[str, str]) -> None:
        from tensord.protocol import MAX_MESSAGE_BYTES

        command = [sys.executable, __file__, "--stream-receiver"]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
        assert self.process.stdout is not None
        port = int(self.process.stdout.readline())
        options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=options)
        self.take = self.channel.stream_unary(
            STREAM_METHOD, request_serializer=bytes, response_deserializer=bytes
        )

    def send(self, chunks: list[bytes]) -> float:
        started = time.perf_counter()
        got = self.take(iter(chunks), timeout=120)
        taken = time.perf_counter() - started
        assert int.from_bytes(got, "little") == sum(map(len, chunks))
        return taken

    def close(self) -> None:
        self.channel.close()
        self.process.kill()
        self.process.wait(timeout=10)


def raw_tcp(nbytes: int, rounds: int) -> tuple[Callable[[], float], Callable[[], None]]:
    """A case sending ``nbytes`` over loopback TCP to a child, and its cleanup."""
    receiver = subprocess.Popen(
        [sys.executable, "-c", RECEIVER, str(nbytes), str(rounds + 1)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert receiver.stdout is not None
    port = int(receiver.stdout.readline())
    conn = socket.create_connection(("127.0.0.1", port))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8).tobytes()

    def send() -> float:
        started = time.perf_counter()
        conn.sendall(payload)
        assert conn.recv(1) == b"k"
        return time.perf_counter() - started

    def close() -> None:
        conn.close()
        receiver.wait(timeout=30)

    send()  # warm
    return send, close


# ---- the run ------------------------------------------------------------------------------------


def tree_env(tree: Path | None) -> dict[str, str]:
    """The environment of a process running ``tree``'s code (None: this one's)."""
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(tree / "client"), str(tree / "server")])
    return env


def report_lookups(label: str, times: list[float]) -> None:
    times = sorted(times)
    p50, p99 = times[len(times) // 2], times[int(len(times) * 0.99)]
    print(f"get(name) {label:<40} p50 {p50 * 1e3:6.2f} ms  p99 {p99 * 1e3:6.2f} ms")


def main() -> None:
    rounds = int(arg("--rounds", "7"))
    lookups = int(arg("--lookups", str(LOOKUPS)))
    baseline = arg("--baseline", "")
    trees: dict[str, Path | None] = {"": None}
    if baseline:
        base = Path(baseline).resolve()
        if not (base / "server" / "tensord_server").is_dir():
            raise SystemExit(f"--baseline {baseline}: no server/tensord_server in it")
        trees["baseline "] = base
    from tensord_server.rpc.handlers import MAX_NODE_CHUNK_BYTES

    folder = tempfile.mkdtemp(prefix="tensord-bench-cluster-")
    tokens, secret = Path(folder) / "tokens", Path(folder) / "secret"
    tokens.write_text(TOKENS)
    secret.write_text(SECRET + "\n")
    etcd, endpoint = start_etcd(folder)
    servers: list[subprocess.Popen[str]] = []
    drivers: dict[str, Driver] = {}
    stream: BareStream | None = None
    try:
        for label, tree in trees.items():
            env = tree_env(tree)
            addresses = []
            nodes = ("a", "b") if tree is None else ("base-a", "base-b")
            for node in nodes:
                process, address = start_server(
                    *("--device", "cpu=1GiB", "--auth-tokens", str(tokens)),
                    *("--node-id", node, "--cluster", f"etcd://{endpoint}"),
                    *("--cluster-token-file", str(secret)),
                    env=env,
                )
                servers.append(process)
                addresses.append(address)
            drivers[label] = Driver(env, addresses[0], addresses[1], nodes[1])
            print(f"{label or 'this tree'}: nodes at {', '.join(addresses)}")
        stream = BareStream(tree_env(None))
        print(f"etcd {endpoint}; a node copy's chunk {MAX_NODE_CHUNK_BYTES // MiB} MiB")
        print(f"{'size':>7}  {'case':<40} {'median GB/s':>11} {'best GB/s':>10}")
        for mib in SIZES_MIB:
            nbytes = mib * MiB
            for driver in drivers.values():
                driver.ask(f"size {nbytes}")
            payload = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
            chunks = [
                payload[i : i + MAX_NODE_CHUNK_BYTES].tobytes()
                for i in range(0, nbytes, MAX_NODE_CHUNK_BYTES)
            ]
            stream.send(chunks)  # warm
            tcp, close_tcp = raw_tcp(nbytes, rounds)
            cases: dict[str, Callable[[], float]] = {}
            for label, driver in drivers.items():
                for case, name in (
                    ("to_node", 'x.to("b/cpu")'),
                    ("to_self", 'x.to("cpu", copy=True)'),
                    ("upload", "client upload to a"),
                    ("download", "client download from a"),
                ):
                    cases[label + name] = lambda d=driver, c=case: float(d.ask(f"run {c}"))
            cases["bare gRPC stream"] = lambda chunks=chunks: stream.send(chunks)
            cases["raw loopback TCP"] = tcp
            seconds = in_turns(cases, rounds)
            close_tcp()
            for name, taken in seconds.items():
                median = nbytes / statistics.median(taken) / 1e9
                best = nbytes / min(taken) / 1e9
                print(f"{mib:>4} MiB  {name:<40} {median:>11.2f} {best:>10.2f}")
            for label in drivers:
                ratios = [
                    bare / copy
                    for bare, copy in zip(
                        seconds["bare gRPC stream"], seconds[label + 'x.to("b/cpu")'], strict=True
                    )
                ]
                name = f'{label}x.to("b/cpu") / bare gRPC'
                print(f"{mib:>4} MiB  {name:<40} {statistics.median(ratios):>10.2f}x")
        for driver in drivers.values():
            driver.ask("lookups setup")
        for where in ("local (client of a)", "redirected (client of b)"):
            times: dict[str, list[float]] = {label: [] for label in drivers}
            for done in range(0, lookups, LOOKUP_BATCH):
                count = min(LOOKUP_BATCH, lookups - done)
                for label, driver in drivers.items():
                    times[label] += driver.ask(f"lookups {where.split()[0]} {count}")
            for label, taken in times.items():
                report_lookups(label + where, taken)
    finally:
        if stream is not None:
            stream.close()
        for driver in drivers.values():
            driver.close()
        for process in servers:
            process.terminate()
            process.wait(timeout=15)
        etcd.kill()
        etcd.wait(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--driver"]:
        drive(*sys.argv[2:5])
    elif sys.argv[1:2] == ["--stream-receiver"]:
        stream_receiver()
    else:
        main()
