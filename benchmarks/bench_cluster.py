"""A two-node cluster on one machine: cross-node copies and name lookups, side by side.

    python benchmarks/bench_cluster.py                 # 1, 16, 64 MiB; 7 rounds each
    python benchmarks/bench_cluster.py --rounds 15

Starts its own etcd (Debian's ``etcd-server``) on loopback ports and two ``tensord serve``
nodes, a and b, joined to it with a cluster secret.  Prints, per size, the median and best
GB/s of (in turns, so a neighbour's load falls on each):

- ``x.to("b/cpu")``: a streams the bytes to b (node call, CRC-32 on both sides);
- ``x.to("cpu", copy=True)``: a copy on a itself (one memcpy on the server);
- a raw loopback TCP transfer of the same bytes from this process to a child process
  (``sendall`` into ``recv_into``; no gRPC, no checksum): the link's ceiling here;
- this client's own upload of the bytes to a (``a.tensor(data)``) and download of ``x``
  (``x.numpy()``, not same-host): the server's transfer path a copy's stream runs on.

Then the p50 and p99 latency of ``get(name)`` of a name a holds, from a client of a
(local) and from a client of b (redirected: b asks etcd, answers OwnedElsewhereError, the
SDK gets it from a on its session there).  Targets: a 64 MiB cross-node copy at >= 0.8x
of the raw TCP transfer; a redirected lookup p50 under 5 ms.
"""

from __future__ import annotations

import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import tensord

sys.path.insert(0, str(Path(__file__).resolve().parent))
from servers import start_server

MiB = 1 << 20
SIZES_MIB = (1, 16, 64)
LOOKUPS = 300
TOKENS = "bench-token bench\n"
SECRET = "bench-cluster-secret-0123456789"
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


def arg(flag: str, default: int) -> int:
    argv = sys.argv[1:]
    return int(argv[argv.index(flag) + 1]) if flag in argv[:-1] else default


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


def in_turns(cases: dict[str, Callable[[], None]], rounds: int) -> dict[str, list[float]]:
    """Each case once per round (every other round in reverse order): its seconds."""
    seconds: dict[str, list[float]] = {name: [] for name in cases}
    for round_ in range(rounds):
        order = list(cases) if round_ % 2 == 0 else list(reversed(cases))
        for name in order:
            started = time.perf_counter()
            cases[name]()
            seconds[name].append(time.perf_counter() - started)
    return seconds


def main() -> None:
    rounds = arg("--rounds", 7)
    folder = tempfile.mkdtemp(prefix="tensord-bench-cluster-")
    tokens, secret = Path(folder) / "tokens", Path(folder) / "secret"
    tokens.write_text(TOKENS)
    secret.write_text(SECRET + "\n")
    etcd, endpoint = start_etcd(folder)
    servers = []
    try:
        for node in "ab":
            servers.append(
                start_server(
                    "--device",
                    "cpu=1GiB",
                    "--auth-tokens",
                    str(tokens),
                    "--node-id",
                    node,
                    "--cluster",
                    f"etcd://{endpoint}",
                    "--cluster-token-file",
                    str(secret),
                )
            )
        (_, address_a), (_, address_b) = servers
        options = {"token": "bench-token", "local": False, "call_timeout": 120}
        with tensord.connect(address_a, **options) as a, tensord.connect(address_b, **options) as b:
            print(f"two nodes on one machine ({address_a}, {address_b}), etcd {endpoint}")
            print(f"{'size':>7}  {'case':<26} {'median GB/s':>11} {'best GB/s':>10}")
            for mib in SIZES_MIB:
                nbytes = mib * MiB
                data = np.random.default_rng(mib).integers(0, 256, nbytes, dtype=np.uint8)
                x = a.tensor(data)
                x.to("b/cpu")  # the session on b opened, the channels warm
                receiver = subprocess.Popen(
                    [sys.executable, "-c", RECEIVER, str(nbytes), str(rounds + 1)],
                    stdout=subprocess.PIPE,
                    text=True,
                )
                assert receiver.stdout is not None
                port = int(receiver.stdout.readline())
                conn = socket.create_connection(("127.0.0.1", port))
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                payload = data.tobytes()

                def tcp(conn: socket.socket = conn, payload: bytes = payload) -> None:
                    conn.sendall(payload)
                    assert conn.recv(1) == b"k"

                tcp()  # warm
                cases = {
                    'x.to("b/cpu")': lambda x=x: x.to("b/cpu").handle,
                    'x.to("cpu", copy=True)': lambda x=x: x.to("cpu", copy=True).handle,
                    "raw loopback TCP": tcp,
                    "client upload to a": lambda data=data: a.tensor(data).handle,
                    "client download from a": lambda x=x: x.numpy().nbytes,
                }
                seconds = in_turns(cases, rounds)
                conn.close()
                receiver.wait(timeout=30)
                for name, taken in seconds.items():
                    median = nbytes / statistics.median(taken) / 1e9
                    best = nbytes / min(taken) / 1e9
                    print(f"{mib:>4} MiB  {name:<26} {median:>11.2f} {best:>10.2f}")
                moved = x.to("b/cpu")
                assert moved.numpy().tobytes() == payload  # what was timed was right
                del x, moved
            a.put("looked-up", a.arange(4))
            for label, client in (("local (client of a)", a), ("redirected (client of b)", b)):
                client.get("looked-up")  # warm: b's session on a opened
                times = []
                for _ in range(LOOKUPS):
                    started = time.perf_counter()
                    client.get("looked-up")
                    times.append(time.perf_counter() - started)
                times.sort()
                p50, p99 = times[len(times) // 2], times[int(len(times) * 0.99)]
                print(f"get(name) {label:<26} p50 {p50 * 1e3:6.2f} ms  p99 {p99 * 1e3:6.2f} ms")
    finally:
        for process, _ in servers:
            process.terminate()
            process.wait(timeout=15)
        etcd.kill()
        etcd.wait(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
