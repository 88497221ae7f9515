"""``tensord serve``: run the server until SIGTERM/SIGINT, then stop gracefully.

Prints ``tensord listening on <address>`` (the real port, so ``--address
127.0.0.1:0`` works for tests and scripts) once it accepts calls.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from types import FrameType

from tensord.errors import FailedPreconditionError

from tensord_server.devices import resolve_specs
from tensord_server.server import DEFAULT_ADDRESS, DEFAULT_MAX_WORKERS, Daemon, create_server
from tensord_server.sessions import DEFAULT_GRACE_S, DEFAULT_LEASE_S

# In-flight calls get this long to finish after SIGTERM/SIGINT before they are cancelled.
SHUTDOWN_GRACE_S = 5.0

log = logging.getLogger("tensord.serve")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address",
        default=DEFAULT_ADDRESS,
        help=f"HOST:PORT or unix:PATH to listen on (default: {DEFAULT_ADDRESS}; port 0: any)",
    )
    parser.add_argument(
        "--device",
        action="append",
        dest="devices",
        metavar="DEVICE[=LIMIT]",
        help="a device to own, with an optional pool limit: cpu, cpu=8GiB, cuda:0=40GiB "
        "(repeatable; default: cpu and every GPU CuPy sees)",
    )
    parser.add_argument(
        "--no-pinned-host",
        action="store_true",
        help="keep the cpu pool in pageable memory even when the server owns a GPU",
    )
    parser.add_argument(
        "--session-grace",
        type=float,
        default=DEFAULT_GRACE_S,
        metavar="SECONDS",
        help="how long a lost client's handles survive, for it to reconnect "
        f"(default: {DEFAULT_GRACE_S:g})",
    )
    parser.add_argument(
        "--lease",
        type=float,
        default=DEFAULT_LEASE_S,
        metavar="SECONDS",
        help="a client is lost this long after its last call or heartbeat (the SDK beats "
        "every lease/3) "
        f"(default: {DEFAULT_LEASE_S:g})",
    )
    parser.add_argument(
        "--max-workers",
        type=int,
        default=DEFAULT_MAX_WORKERS,
        help="gRPC worker threads: one per call in flight (an optional KeepAlive stream "
        "holds one while open) "
        f"(default: {DEFAULT_MAX_WORKERS})",
    )


def shown_address(requested: str, port: int) -> str:
    """The address clients should use: the requested host with the real port."""
    if requested.startswith("unix:"):
        return requested
    host = requested.rpartition(":")[0] or "127.0.0.1"
    return f"{host}:{port}"


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        specs = resolve_specs(args.devices, pinned_host=not args.no_pinned_host)
        daemon = Daemon(specs, session_grace=args.session_grace, lease=args.lease)
    except (ValueError, FailedPreconditionError) as exc:
        print(f"tensord serve: {exc}", file=sys.stderr)
        return 2
    try:
        server, port = create_server(args.address, daemon=daemon, max_workers=args.max_workers)
    except (OSError, RuntimeError) as exc:
        print(f"tensord serve: cannot listen on {args.address}: {exc}", file=sys.stderr)
        daemon.close()
        return 2

    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"tensord listening on {shown_address(args.address, port)}", flush=True)
    while not stop.wait(1.0):  # a timed wait keeps signal delivery prompt
        pass
    log.info("stopping: in-flight calls get %.3gs", SHUTDOWN_GRACE_S)
    server.stop(SHUTDOWN_GRACE_S).wait()
    daemon.close()
    return 0
