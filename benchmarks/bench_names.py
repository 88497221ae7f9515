"""Named tensors on the server's host: one-call puts and gets, and batched name calls.

    python benchmarks/bench_names.py                  # 7 rounds, about 30 s
    python benchmarks/bench_names.py --rounds 11 --calls 300 --items 200

Starts ``tensord serve`` in its own process (no GIL shared with the client) and connects
one client as the SDK does by default on this host (its unary calls on the session's call
channel, the server's memory mapped).  Each row sets the way the SDK works now against the
way it takes more calls, on the same client:

- ``put 4 KiB`` / ``put 1 MiB``: ``client.put(name, array)`` (staged through the mapping
  and named in one call) against ``client.put(name, client.tensor(array))`` (a tensor
  made, then named: two calls);
- ``get alone``: ``client.get(name)`` (GetNameExport: the handle and its export) against a
  GetName (the handle alone): what bringing the export costs a get that never reads;
- ``get + first byte``: ``np.from_dlpack(client.get(name))[0]`` (GetNameExport: one call)
  against a GetName then an Export (``__dlpack__`` of a tensor got by GetName alone);
- ``put_many`` / ``get_many`` / ``delete_many`` of ``--items`` names: one call against a
  call per name, as names per second.

The ways take turns, a round of ``--calls`` calls (or batches) each per row; printed: the
median over the rounds' medians, their range, and the ratio of the slower way to the
faster.  Targets (2-core VM): a put of 4 KiB under 1.15 ms, a get + first byte under
1.07 ms, get_many above 18,830 names/s.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from servers import start_server

KiB = 1 << 10
MiB = 1 << 20


def latency_rows(client: Any) -> dict[str, dict[str, Callable[[], object]]]:
    """Per-call rows: each a dict of way -> one call."""
    small = np.ones(4 * KiB // 4, dtype=np.float32)
    large = np.ones(MiB // 4, dtype=np.float32)
    # one tensor per way: an export a get brought (held for the reads after it) would
    # serve the other way's __dlpack__ of the same Storage
    client.put("bench-got", np.arange(1024, dtype=np.float32), overwrite=True)
    client.put("bench-got-by-name", np.arange(1024, dtype=np.float32), overwrite=True)
    by_name = tensord.schema.GetNameRequest(name="bench-got-by-name")

    def got_by_get_name() -> object:
        # the path before GetNameExport: GetName, then an Export at the first __dlpack__
        return np.from_dlpack(client._wrap(client._call("GetName", by_name)))[0]

    return {
        "put 4 KiB": {
            "one call": lambda: client.put("bench-put", small, overwrite=True),
            "tensor() + put": lambda: client.put("bench-put", client.tensor(small), overwrite=True),
        },
        "put 1 MiB": {
            "one call": lambda: client.put("bench-put", large, overwrite=True),
            "tensor() + put": lambda: client.put("bench-put", client.tensor(large), overwrite=True),
        },
        "get alone": {
            "one call": lambda: client.get("bench-got"),
            "GetName": lambda: client._wrap(client._call("GetName", by_name)),
        },
        "get + first byte": {
            "one call": lambda: np.from_dlpack(client.get("bench-got"))[0],
            "GetName + Export": got_by_get_name,
        },
    }


def rate_rows(client: Any, items: int) -> dict[str, dict[str, Callable[[], object]]]:
    """Batch rows: each way does ``items`` names per call of the returned function (a
    delete's names are put back before it, untimed: see :func:`measure`)."""
    names = [f"bench-many-{i}" for i in range(items)]
    x = client.arange(16)
    client.put_many(dict.fromkeys(names, x), overwrite=True)

    def put_each() -> None:
        for name in names:
            client.put(name, x, overwrite=True)

    def get_each() -> None:
        for name in names:
            client.get(name)

    def delete_each() -> None:
        for name in names:
            client.delete(name)

    def put_back() -> None:
        client.put_many(dict.fromkeys(names, x), overwrite=True)

    delete_batch = Untimed(put_back, lambda: client.delete_many(names))
    return {
        "put_many (names/s)": {
            "one call": lambda: client.put_many(dict.fromkeys(names, x), overwrite=True),
            "a call per name": put_each,
        },
        "get_many (names/s)": {
            "one call": lambda: client.get_many(names),
            "a call per name": get_each,
        },
        "delete_many (names/s)": {
            "one call": delete_batch,
            "a call per name": Untimed(put_back, delete_each),
        },
    }


class Untimed:
    """A timed call with untimed work before it (``before``, then ``fn``)."""

    def __init__(self, before: Callable[[], object], fn: Callable[[], object]) -> None:
        self.before = before
        self.fn = fn

    def __call__(self) -> object:
        self.before()
        return self.fn()


def measure(fn: Callable[[], object], calls: int) -> float:
    """The median seconds of ``calls`` calls of ``fn`` (of an Untimed, its ``fn`` alone)."""
    times = []
    for _ in range(calls):
        timed = fn
        if isinstance(fn, Untimed):
            fn.before()
            timed = fn.fn
        started = time.perf_counter()
        timed()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def run(
    rows: dict[str, dict[str, Callable[[], object]]], rounds: int, calls: int
) -> dict[tuple[str, str], list[float]]:
    """Interleaved rounds: every way of every row, one round of ``calls`` each in turn."""
    medians: dict[tuple[str, str], list[float]] = {}
    for row, ways in rows.items():
        for fn in ways.values():
            fn()  # warm: staging tensors made, segments mapped
        for _ in range(rounds):
            for way, fn in ways.items():
                medians.setdefault((row, way), []).append(measure(fn, calls))
    return medians


def report(
    rows: dict[str, dict[str, Callable[[], object]]],
    medians: dict[tuple[str, str], list[float]],
    scale: float,
    unit: str,
    per_second: bool,
) -> None:
    for row, ways in rows.items():
        figures = {}
        for way in ways:
            values = medians[(row, way)]
            middle = statistics.median(values)
            shown = [
                scale / v if per_second else v * scale for v in (middle, min(values), max(values))
            ]
            figures[way] = middle
            low, high = sorted(shown[1:])
            print(f"  {row:34} {way:18} {shown[0]:10.2f} {unit}  (rounds {low:.2f}..{high:.2f})")
        fast, slow = list(ways)
        ratio = figures[slow] / figures[fast]
        print(f"  {row:34} {'ratio':18} {ratio:10.2f}x  (time: {slow} / {fast})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--items", type=int, default=100, help="names per batch")
    args = parser.parse_args()
    process, address = start_server("--device", "cpu=1GiB")
    try:
        client = tensord.connect(address, pipelining=False)
        assert client._conn.call_channel is not None, "the server offered no call channel"
        latency = latency_rows(client)
        print(f"per call, ms (median of {args.rounds} rounds of {args.calls}):")
        report(latency, run(latency, args.rounds, args.calls), 1e3, "ms", per_second=False)
        batches = rate_rows(client, args.items)
        batch_calls = max(1, args.calls // 10)
        print(f"batches of {args.items} names (median of {args.rounds} rounds of {batch_calls}):")
        report(batches, run(batches, args.rounds, batch_calls), args.items, "/s", per_second=True)
        client.close()
    finally:
        process.terminate()
        process.wait(10)


if __name__ == "__main__":
    main()
