"""Same-host unary calls: the session's call channel against gRPC, side by side.

    python benchmarks/bench_channel.py                 # 5 rounds of 300 calls per row
    python benchmarks/bench_channel.py --rounds 9 --calls 500

Starts ``tensord serve`` in its own process (so it shares no GIL with the clients) and
connects two unpipelined clients to it on this host: one as the SDK connects by default
(its unary calls take the session's call channel, the server's unix fd socket) and one
whose call channel is turned off (every unary call over gRPC, as a client on another host
or ``local=False`` makes them; its same-host mapping stays on, so only the call's transport
differs).  Each row is one small operation: ``client.get(name)`` of a 16-element tensor,
``x.view(4, 4)``, ``client.put(name, x, overwrite=True)``, an empty ``Release`` (the call
alone), and a pipelined client's ``x.view(4, 4)`` then ``synchronize()`` (one Batch round
trip).  The two clients take turns, a round of ``--calls`` calls each per row; printed:
the median per call over all rounds for each transport, the range of the rounds' medians,
and gRPC's median over the channel's.  Target: every row faster on the channel.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import tensord
from tensord import schema as pb

sys.path.insert(0, str(Path(__file__).resolve().parent))
from servers import start_server


def rows(client: Any, pipelined: Any) -> dict[str, Callable[[], object]]:
    """The operations measured, each bound to ``client`` (and a pipelined twin)."""
    x = client.tensor(np.arange(16, dtype=np.float32))
    client.put("bench-small", x, overwrite=True)
    y = pipelined.tensor(np.arange(16, dtype=np.float32))
    conn = client._conn

    def pipelined_view() -> object:
        view = y.view(4, 4)
        pipelined.synchronize()
        return view

    return {
        "client.get(name), 16 floats": lambda: client.get("bench-small"),
        "x.view(4, 4), unpipelined": lambda: x.view(4, 4),
        "client.put(name, x, overwrite=True)": lambda: client.put("bench-small", x, overwrite=True),
        "empty Release (the call alone)": lambda: conn.call("Release", pb.ReleaseRequest()),
        "pipelined x.view(4, 4) + synchronize()": pipelined_view,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    process, address = start_server("--device", "cpu=1GiB")
    try:
        clients = {
            "channel": tensord.connect(address, pipelining=False),
            "gRPC": tensord.connect(address, pipelining=False),
        }
        pipelined = {"channel": tensord.connect(address), "gRPC": tensord.connect(address)}
        for client in (clients["gRPC"], pipelined["gRPC"]):
            off, client._conn.call_channel = client._conn.call_channel, None
            if off is not None:  # its call channel off: every unary call over gRPC
                off.close()
        assert clients["channel"]._conn.call_channel is not None, "the server offered no channel"
        ops = {way: rows(clients[way], pipelined[way]) for way in clients}
        names = list(ops["channel"])
        medians: dict[tuple[str, str], list[float]] = {}
        every: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.rounds):
            for name in names:
                for way in clients:
                    fn = ops[way][name]
                    for _ in range(20):  # warm: a fresh channel binds on its first call
                        fn()
                    seconds = []
                    for _ in range(args.calls):
                        start = time.perf_counter()
                        result = fn()
                        seconds.append(time.perf_counter() - start)
                        del result
                    medians.setdefault((name, way), []).append(statistics.median(seconds))
                    every.setdefault((name, way), []).extend(seconds)
        answered = clients["channel"]._conn.call_channel
        print(f"{args.rounds} rounds x {args.calls} calls per row and transport (ms per call)")
        print(f"{'operation':<42} {'channel':>16} {'gRPC':>16} {'gRPC/channel':>13}")
        for name in names:
            cells = []
            for way in clients:
                rounds = medians[(name, way)]
                median = statistics.median(every[(name, way)]) * 1e3
                cells.append(f"{median:.3f} ({min(rounds) * 1e3:.2f}-{max(rounds) * 1e3:.2f})")
            ratio = statistics.median(every[(name, "gRPC")]) / statistics.median(
                every[(name, "channel")]
            )
            print(f"{name:<42} {cells[0]:>16} {cells[1]:>16} {ratio:>12.2f}x")
        print(f"(calls the channel answered: {answered.calls if answered else 0})")
        for client in (*clients.values(), *pipelined.values()):
            client.close()
    finally:
        process.terminate()
        process.wait(10)


if __name__ == "__main__":
    main()
