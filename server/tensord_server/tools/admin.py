"""``tensord stats | summary | snapshot -o FILE.pickle | empty-cache``: the pool, through the SDK.

One module for the four subcommands; ``run`` dispatches on ``args.command``.
They talk to a running server like any client, so they also work remotely.
"""

from __future__ import annotations

import argparse
import pickle
import sys

import tensord


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address",
        default=None,
        help="server address (default: $TENSORD_ADDRESS, else 127.0.0.1:50051)",
    )
    parser.add_argument(
        "--device", default="cpu", help="device whose pool to inspect (default: cpu)"
    )
    parser.add_argument(
        "--timeout", type=float, default=5.0, help="seconds to wait for the server (default: 5)"
    )
    if parser.prog.split()[-1] == "snapshot":
        parser.add_argument(
            "-o",
            "--output",
            required=True,
            help="the pickle file to write: torch.cuda.memory._snapshot()'s format, for "
            "PyTorch's memory_viz and, when the server records history (tensord serve "
            "--record-history), for tensord replay",
        )


def _stats(client: tensord.Client, args: argparse.Namespace) -> None:
    stats = client.memory_stats(args.device)
    width = max((len(k) for k in stats), default=0)
    for key, value in stats.items():
        print(f"{key:<{width}}  {value}")


def _summary(client: tensord.Client, args: argparse.Namespace) -> None:
    print(client.memory_summary(args.device))


def _snapshot(client: tensord.Client, args: argparse.Namespace) -> None:
    snapshot = client.memory_snapshot(args.device)
    with open(args.output, "wb") as f:
        pickle.dump(snapshot, f)
    segments = len(snapshot.get("segments", ()))
    events = len((snapshot.get("device_traces") or [[]])[0])
    print(
        f"wrote {args.output} ({segments} segments, {events} trace events); "
        "view it at https://pytorch.org/memory_viz"
    )
    if not events:
        print(
            f"tensord snapshot: {args.output} holds no allocator trace, so tensord replay "
            "cannot run it: the server records one with tensord serve --record-history",
            file=sys.stderr,
        )


def _empty_cache(client: tensord.Client, args: argparse.Namespace) -> None:
    released = client.empty_cache(args.device)
    print(f"released {released} bytes of cached segments on {args.device}")


_ACTIONS = {
    "stats": _stats,
    "summary": _summary,
    "snapshot": _snapshot,
    "empty-cache": _empty_cache,
}


def run(args: argparse.Namespace) -> int:
    try:
        # --timeout bounds every call, not only the connect: a hung MemoryStats fails in time
        with tensord.connect(
            args.address, timeout=args.timeout, call_timeout=args.timeout
        ) as client:
            _ACTIONS[args.command](client, args)
    except tensord.TensordError as e:
        print(f"tensord {args.command}: {e}", file=sys.stderr)
        return 1
    return 0
