"""Availability under attack: well-behaved tenants beside a hostile mix, side by side with
the same run unattacked.

One ``tensord serve`` with tenants (``--auth-tokens``) and a short lease, so a starved
liveness path would show as lost sessions within seconds.  Four well-behaved tenants, each
its own process, run a mixed workload (uploads, views, copies, cat, downloads checked
byte for byte, named tensors) and time every operation.  The run has two phases of equal
length: unattacked, then with the attackers (all loopback, all bounded in time):

* ``stall``: calls with no token whose request message never comes (many connections);
* ``oversize``: unauthenticated requests of nearly gRPC's message limit, in a loop;
* ``idle``: idle TCP connections, reopened as the server closes them;
* ``unread``: a tenant's Download streams and ListNames answers it never reads;
* ``flood``: a tenant's threads sending the heaviest calls the limits accept (Cat of the
  most inputs, the longest Batch) as fast as they are answered.

Printed: each phase's p50/p99 operation latency of the good tenants, the ratio, sessions
lost, bytes found wrong, and the server's peak RSS.  ``--json FILE`` writes the figures.

    python benchmarks/soak_availability.py --seconds 60
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

GOOD_TENANTS = 4
LEASE_S = 3.0
GRACE_S = 1.0


def start_server(
    tokens_file: Path, log: Any, extra: list[str]
) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    address = f"127.0.0.1:{port}"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tensord_server",
            "serve",
            "--address",
            address,
            "--device",
            "cpu=4GiB",
            "--auth-tokens",
            str(tokens_file),
            "--lease",
            str(LEASE_S),
            "--session-grace",
            str(GRACE_S),
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=log,
    )
    assert process.stdout is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = process.stdout.readline().decode()
        if "listening on" in line:
            threading.Thread(target=process.stdout.read, daemon=True).start()  # drained
            return process, address
        if not line and process.poll() is not None:
            break
    process.kill()
    log.flush()
    raise RuntimeError(f"tensord serve did not start: {Path(log.name).read_text()[-2000:]}")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


# -- the well-behaved tenants -------------------------------------------------------------


def good_tenant(address: str, token: str, phases: list[float], out: Any, seed: int) -> None:
    """Run the workload until the last phase ends; put each phase's latencies on ``out``."""
    import tensord

    rng = np.random.default_rng(seed)
    latencies: list[list[float]] = [[] for _ in phases]
    lost = wrong = errors = 0
    with tensord.connect(address, token=token, call_timeout=60.0) as client:
        session = client.session_id
        kept = rng.integers(0, 1 << 30, 1 << 16, dtype=np.int64)
        client.put("kept", client.from_numpy(kept))
        while (now := time.monotonic()) < phases[-1]:
            phase = next(i for i, end in enumerate(phases) if now < end)
            started = time.perf_counter()
            try:
                data = rng.standard_normal(int(rng.integers(1, 1 << 14))).astype(np.float32)
                x = client.from_numpy(data)
                view = x.narrow(0, 0, max(1, data.size // 2))
                copied = tensord.cat([view, view.clone()])
                back = copied.numpy()
                half = data[: max(1, data.size // 2)]
                if not (
                    np.array_equal(back[: half.size], half)
                    and np.array_equal(back[half.size :], half)
                ):
                    wrong += 1
                del x, view, copied
            except tensord.SessionLostError:
                lost += 1
            except tensord.TensordError:
                errors += 1
            latencies[phase].append(time.perf_counter() - started)
        if not np.array_equal(client.get("kept").numpy(), kept):
            wrong += 1
        client.delete("kept")
        if client.session_id != session:
            lost += 1
    out.put({"latencies": latencies, "lost": lost, "wrong": wrong, "errors": errors})


# -- the attackers --------------------------------------------------------------------------


def attack_stall(address: str, until: float, connections: int = 20, per: int = 50) -> None:
    """Calls with no token whose request message never comes."""
    import grpc

    hold = threading.Event()

    def never() -> Any:
        hold.wait(max(until - time.monotonic(), 0))
        yield from ()

    channels = [
        grpc.insecure_channel(address, options=(("grpc.use_local_subchannel_pool", 1),))
        for _ in range(connections)
    ]
    calls = []
    for channel in channels:
        for method in ("Heartbeat", "OpenSession", "View"):
            call = channel.stream_unary(f"/tensord.v1.Tensord/{method}")
            calls += [call.future(never()) for _ in range(per // 3)]
    time.sleep(max(until - time.monotonic(), 0))
    hold.set()
    for channel in channels:
        channel.close()


def attack_oversize(address: str, until: float) -> None:
    """Unauthenticated requests of nearly gRPC's message limit, sent in a loop."""
    import grpc

    payload = b"\x0a" + b"\xff\xff\xff\x07" + os.urandom(15 << 20)
    with grpc.insecure_channel(
        address, options=(("grpc.max_send_message_length", 64 << 20),)
    ) as channel:
        empty = channel.unary_unary("/tensord.v1.Tensord/Empty")
        while time.monotonic() < until:
            with contextlib.suppress(grpc.RpcError):
                empty(payload, timeout=5)


def attack_idle(address: str, until: float, count: int = 400) -> None:
    """Idle TCP connections, reopened as the server closes them."""
    host, port = address.rsplit(":", 1)
    held: list[socket.socket] = []
    while time.monotonic() < until:
        while len(held) < count:
            try:
                held.append(socket.create_connection((host, int(port)), timeout=2))
            except OSError:
                break
        time.sleep(1.0)
        alive = []
        for sock in held:
            sock.setblocking(False)
            try:
                closed = sock.recv(1 << 16) == b""
            except BlockingIOError:
                closed = False
            except OSError:
                closed = True
            if closed:
                sock.close()
            else:
                alive.append(sock)
        held = alive
    for sock in held:
        sock.close()


def attack_unread(address: str, token: str, until: float) -> None:
    """Download streams and ListNames answers a tenant never reads."""
    import grpc
    import tensord
    from tensord import schema as pb

    with tensord.connect(address, token=token) as client:
        big = client.zeros(8 << 20)  # 32 MiB
        for i in range(200):
            client.put(f"n{i:04d}-" + "x" * 3000, big.narrow(0, 0, 1))
        md = (("authorization", f"Bearer {token}"), ("tensord-session", client.session_id))
        channel = grpc.insecure_channel(
            address, options=(("grpc.max_receive_message_length", 1 << 30),)
        )
        download = channel.unary_stream(
            "/tensord.v1.Tensord/Download", request_serializer=pb.DownloadRequest.SerializeToString
        )
        names = channel.unary_unary(
            "/tensord.v1.Tensord/ListNames",
            request_serializer=pb.ListNamesRequest.SerializeToString,
        )
        held = []
        while time.monotonic() < until:
            with contextlib.suppress(grpc.RpcError):
                held.append(download(pb.DownloadRequest(handle=big.handle), metadata=md))
                held.append(names.future(pb.ListNamesRequest(), metadata=md))
            time.sleep(0.05)
            held = held[-256:]
        channel.close()
        for i in range(200):
            with contextlib.suppress(tensord.TensordError):
                client.delete(f"n{i:04d}-" + "x" * 3000)


def attack_flood(address: str, token: str, until: float, threads: int = 8) -> None:
    """The heaviest calls the limits accept, from several threads, as fast as answered."""
    import tensord
    from tensord.protocol import MAX_CAT_INPUTS  # the most one Cat takes

    with tensord.connect(address, token=token, call_timeout=120.0) as client:
        parts = [client.zeros(1) for _ in range(64)]
        inputs = (parts * (MAX_CAT_INPUTS // len(parts) + 1))[:MAX_CAT_INPUTS]

        def loop() -> None:
            while time.monotonic() < until:
                with contextlib.suppress(tensord.TensordError):
                    tensord.cat(inputs)

        workers = [threading.Thread(target=loop) for _ in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()


ATTACKS = {
    "stall": attack_stall,
    "oversize": attack_oversize,
    "idle": attack_idle,
    "unread": attack_unread,
    "flood": attack_flood,
}
UNAUTHENTICATED = frozenset({"stall", "oversize", "idle"})


def attacker(name: str, start: float, args: tuple[Any, ...]) -> None:
    """Start the attack ``name`` at ``start``, its imports done beforehand: a process's own
    start-up takes this machine's CPU from everyone, and is not the attack measured."""
    import grpc  # noqa: F401
    import tensord  # noqa: F401

    time.sleep(max(start - time.monotonic(), 0))
    ATTACKS[name](*args)


# -- the run ----------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="length of each phase")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        help="an argument for tensord serve (repeatable: --serve-arg=--gil-switch-interval "
        "--serve-arg=0.005)",
    )
    parser.add_argument(
        "--attacks",
        default=",".join(ATTACKS),
        help=f"which attackers run in the second phase (default: all of {','.join(ATTACKS)})",
    )
    args = parser.parse_args(argv)

    tokens = {f"good{i}": secrets.token_urlsafe(16) for i in range(GOOD_TENANTS)}
    tokens["evil"] = secrets.token_urlsafe(16)
    with tempfile.TemporaryDirectory() as folder:
        tokens_file = Path(folder) / "tokens"
        tokens_file.write_text("".join(f"{t} {name}\n" for name, t in tokens.items()))
        tokens_file.chmod(0o600)
        log = open(Path(folder) / "server.log", "wb")  # noqa: SIM115
        server, address = start_server(tokens_file, log, args.serve_arg)
        try:
            return run(args, server, address, tokens)
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(15)
            except subprocess.TimeoutExpired:
                server.kill()
            log.close()


def run(
    args: argparse.Namespace, server: subprocess.Popen[bytes], address: str, tokens: dict[str, str]
) -> int:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    start = time.monotonic() + 8.0  # the tenants connect and the attackers start first
    phases = [start + args.seconds, start + 2 * args.seconds]
    goods = [
        ctx.Process(target=good_tenant, args=(address, tokens[f"good{i}"], phases, out, i))
        for i in range(GOOD_TENANTS)
    ]
    chosen = args.attacks.split(",") if args.attacks else []
    unknown = set(chosen) - set(ATTACKS)
    if unknown:
        raise SystemExit(f"unknown attacks {sorted(unknown)}; choose from {list(ATTACKS)}")
    evil = tokens["evil"]
    until = phases[1]
    attackers = [
        ctx.Process(
            target=attacker,
            args=(
                name,
                phases[0],
                (address, until) if name in UNAUTHENTICATED else (address, evil, until),
            ),
        )
        for name in chosen
    ]
    for process in goods + attackers:
        process.start()
    idle_rss = rss_bytes(server.pid)
    peaks = [0, 0]

    def sample_rss() -> None:
        while time.monotonic() < phases[-1]:
            now = time.monotonic()
            phase = 0 if now < phases[0] else 1
            peaks[phase] = max(peaks[phase], rss_bytes(server.pid))
            time.sleep(0.25)

    sampler = threading.Thread(target=sample_rss, daemon=True)
    sampler.start()
    results = [out.get(timeout=args.seconds * 2 + 120) for _ in goods]
    for process in goods + attackers:
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
    sampler.join()
    calm = [v for r in results for v in r["latencies"][0]]
    attacked = [v for r in results for v in r["latencies"][1]]
    figures = {
        "seconds_per_phase": args.seconds,
        "ops_unattacked": len(calm),
        "ops_attacked": len(attacked),
        "p50_ms": [percentile(calm, 50) * 1e3, percentile(attacked, 50) * 1e3],
        "p99_ms": [percentile(calm, 99) * 1e3, percentile(attacked, 99) * 1e3],
        "sessions_lost": sum(r["lost"] for r in results),
        "bytes_wrong": sum(r["wrong"] for r in results),
        "errors": sum(r["errors"] for r in results),
        "rss_idle_mb": idle_rss / 1e6,
        "rss_peak_mb": [peaks[0] / 1e6, peaks[1] / 1e6],
        "server_alive": server.poll() is None,
    }
    ratio = figures["p99_ms"][1] / figures["p99_ms"][0]
    figures["p99_ratio"] = ratio
    print(f"{'':>22} {'unattacked':>12} {'attacked':>12}")
    print(f"{'operations':>22} {len(calm):>12} {len(attacked):>12}")
    print(f"{'p50 ms':>22} {figures['p50_ms'][0]:>12.2f} {figures['p50_ms'][1]:>12.2f}")
    print(f"{'p99 ms':>22} {figures['p99_ms'][0]:>12.2f} {figures['p99_ms'][1]:>12.2f}")
    print(
        f"{'server peak RSS MB':>22} {figures['rss_peak_mb'][0]:>12.0f} {figures['rss_peak_mb'][1]:>12.0f}"
    )
    print(
        f"p99 ratio {ratio:.2f}x; sessions lost {figures['sessions_lost']}, "
        f"ops with wrong bytes {figures['bytes_wrong']}, errors {figures['errors']}, "
        f"server alive {figures['server_alive']}"
    )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
