"""The HTTP endpoints of ``tensord serve``: ``/metrics`` (Prometheus) and the live dashboard.

Routes (each server serves those it was asked for):

- ``/metrics``: the Prometheus text format of the TensorStore's registry.
- ``/`` and ``/static/NAME``: the dashboard page, its script and style, shipped
  in this package (no asset is fetched from anywhere else).
- ``/api/state``: JSON the page polls: each device's segments and blocks (from
  the pool's snapshot, each allocated block with its tenant), time series of
  allocated, reserved and fragmentation (a bounded ring buffer sampled once a
  second), sessions and tenants.  Fragmentation is the pool's
  ``external_fragmentation.all`` (:func:`tensord_server.pool.stats.external_fragmentation`):
  the share of the cache's free bytes one allocation could not use, 0 for an idle cache.

With ``--auth-tokens`` the data routes (``/metrics``, ``/api/*``) need
``Authorization: Bearer TOKEN`` with the token of an operator tenant
(``--operator-tenant``): they show every tenant's figures, which no ordinary
tenant may see.  The page and its assets hold no data and need no token.

Each connection has a thread of its own and one request (HTTP/1.0: no keep-alive), and
what a caller can hold with it is bounded:

- Connections served at once: ``MAX_CONNECTIONS`` (64) in all and
  ``MAX_CONNECTIONS_PER_PEER`` (16) per peer address.  The accept loop closes one beyond
  either at once, unanswered, before any thread or TLS work is spent on it.
- The request (the TLS handshake, the request line and headers; only GET is served, so no
  body is read) must be in within ``REQUEST_DEADLINE_S`` (10 s) of the accept, in all: each
  wait for bytes gets only the time left, so a caller trickling a byte at a time gains
  nothing.  The TLS handshake runs on the connection's thread, never the accept loop's,
  within ``TLS_HANDSHAKE_TIMEOUT_S`` (5 s) of that.  A request longer than
  ``MAX_REQUEST_BYTES`` (64 KiB) is closed unanswered.
- The answer must be taken within ``ANSWER_TIMEOUT_S`` (10 s) of its first byte, in all.

So one connection holds a thread for at most 20 s plus the time its answer takes to make,
and a silent or slow caller delays no other connection's scrape.
"""

from __future__ import annotations

import collections
import hmac
import io
import json
import socket
import ssl
import threading
import time
from collections.abc import Iterable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, HTTPServer
from importlib import resources
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tensord_server.observability.metrics import observer_for, session_figures, tenants_of

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer, WriteableBuffer

    from tensord_server.domain.store import TensorStore

# The dashboard's time series: one sample a second, the last ten minutes.
SAMPLE_INTERVAL_S = 1.0
HISTORY_SAMPLES = 600
# What one /api/state shows of a device at most (the rest is counted, not listed).
MAX_SEGMENTS_SHOWN = 512
MAX_BLOCKS_SHOWN = 16384
# The page's files: name -> content type.
STATIC_FILES = {
    "index.html": "text/html; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}


def static_file(name: str) -> bytes:
    return resources.files("tensord_server.observability").joinpath("static", name).read_bytes()


def device_view(store: TensorStore, device_name: str) -> dict[str, Any]:
    """One device's segments and blocks, each allocated block with its tenant."""
    device = store.devices.get(device_name)
    snapshot = device.pool.memory_snapshot()
    tenant_at = {
        block.address: s.tenant
        for s in store.storages.live()
        if s.device is device and (block := s.resident_block()) is not None
    }
    stats = device.pool.memory_stats()
    segments = []
    blocks_shown = 0
    for segment in snapshot["segments"][:MAX_SEGMENTS_SHOWN]:
        if blocks_shown + len(segment["blocks"]) > MAX_BLOCKS_SHOWN:
            break
        blocks_shown += len(segment["blocks"])
        segments.append(
            {
                "address": segment["address"],
                "total_size": segment["total_size"],
                "allocated_size": segment["allocated_size"],
                "segment_type": segment["segment_type"],
                "stream": segment["stream"],
                "blocks": [
                    {
                        "address": b["address"],
                        "size": b["size"],
                        "requested_size": b["requested_size"],
                        "state": b["state"],
                        "tenant": tenant_at.get(b["address"])
                        if b["state"] == "active_allocated"
                        else None,
                    }
                    for b in segment["blocks"]
                ],
            }
        )
    return {
        "name": device.name,
        "capacity": device.pool.capacity,
        "allocated_bytes": stats["allocated_bytes.all.current"],
        "reserved_bytes": stats["reserved_bytes.all.current"],
        "active_bytes": stats["active_bytes.all.current"],
        "largest_free_block_bytes": stats["largest_free_block_bytes.all"],
        "releasable_bytes": stats["releasable_bytes.all"],
        "external_fragmentation": stats["external_fragmentation.all"],
        "segment_count": len(snapshot["segments"]),
        "num_ooms": stats["num_ooms"],
        "num_compactions": stats["num_compactions"],
        "segments": segments,
    }


def tenant_rows(store: TensorStore) -> list[dict[str, Any]]:
    _, _, per_tenant = session_figures(store)
    rows = []
    for tenant in tenants_of(store):
        sessions, handles = per_tenant.get(tenant, (0, 0))
        devices = {}
        for device in store.devices:
            usage = store.storages.ledger.usage(tenant, device.name)
            devices[device.name] = {
                "allocated_bytes": usage.current,
                "peak_bytes": usage.peak,
                "storages": usage.storages,
                "quota_bytes": usage.limit,
            }
        rows.append(
            {"tenant": tenant, "sessions": sessions, "handles": handles, "devices": devices}
        )
    return rows


class History:
    """The time series the page plots: a ring buffer of per-device samples."""

    def __init__(self, store: TensorStore, maxlen: int = HISTORY_SAMPLES) -> None:
        self.store = store
        self._lock = threading.Lock()
        self._samples: collections.deque[dict[str, Any]] = collections.deque(maxlen=maxlen)

    def sample(self) -> None:
        devices = {}
        for device in self.store.devices:
            stats = device.pool.memory_stats()
            devices[device.name] = [
                stats["allocated_bytes.all.current"],
                stats["reserved_bytes.all.current"],
                round(float(stats["external_fragmentation.all"]), 4),
            ]
        with self._lock:
            self._samples.append({"t": round(time.time(), 3), "devices": devices})

    def samples(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._samples)


def dashboard_state(store: TensorStore, history: History) -> dict[str, Any]:
    """Everything /api/state answers."""
    live, lost, _ = session_figures(store)
    return {
        "time": time.time(),
        "devices": [device_view(store, d.name) for d in store.devices],
        "series": history.samples(),
        "sessions": {"live": live, "lost": lost},
        "tenants": tenant_rows(store),
        "authenticated": store.auth_tokens is not None,
    }


def operator_tokens(store: TensorStore, operator_tenants: Iterable[str]) -> list[bytes] | None:
    """The tokens that open the data routes (None: no authentication on this server)."""
    if store.auth_tokens is None:
        return None
    wanted = set(operator_tenants)
    return [token.encode() for token, tenant in store.auth_tokens.items() if tenant in wanted]


def bearer_allowed(tokens: list[bytes] | None, authorization: str | None) -> bool:
    if tokens is None:
        return True
    if not authorization or not authorization.startswith("Bearer "):
        return False
    presented = authorization[len("Bearer ") :].strip().encode()
    allowed = False
    for token in tokens:  # compare with every token, in constant time each
        allowed |= hmac.compare_digest(token, presented)
    return allowed


class HttpEndpoints:
    """A threaded HTTP(S) server for /metrics and/or the dashboard of one TensorStore."""

    def __init__(
        self,
        store: TensorStore,
        host: str,
        port: int,
        *,
        metrics: bool = True,
        dashboard: bool = True,
        operator_tenants: Iterable[str] = (),
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.store = store
        self.host = host
        self.observer = observer_for(store)
        self.metrics = metrics
        self.dashboard = dashboard
        self.tokens = operator_tokens(store, operator_tenants)
        self.history = History(store)
        self._stop = threading.Event()
        endpoints = self

        class Handler(_Handler):
            owner = endpoints

        self._server = _BoundedHTTPServer((host, port), Handler, ssl_context)
        self.port = int(self._server.server_address[1])
        self._threads: list[threading.Thread] = []

    def start(self) -> HttpEndpoints:
        serving = threading.Thread(
            target=self._server.serve_forever, name="tensord-http", daemon=True
        )
        self._threads.append(serving)
        if self.dashboard:
            self._threads.append(
                threading.Thread(target=self._sample_loop, name="tensord-history", daemon=True)
            )
        for thread in self._threads:
            thread.start()
        return self

    def _sample_loop(self) -> None:
        while True:
            self.history.sample()
            if self._stop.wait(SAMPLE_INTERVAL_S):
                return

    def close(self) -> None:
        self._stop.set()
        self._server.shutdown()
        self._server.server_close()
        for thread in self._threads:
            thread.join(timeout=5)


# Connections served at once (a thread each), in all and per peer address: the accept loop
# closes one beyond either at once, so callers that hold connections open cannot take every
# thread, and one address cannot take them all from the others.
MAX_CONNECTIONS = 64
MAX_CONNECTIONS_PER_PEER = 16
# A request (TLS handshake, request line, headers) must be in this soon after its accept, in
# all: a per-recv timeout would let a caller that trickles a byte now and then keep it for ever.
REQUEST_DEADLINE_S = 10.0
# The TLS handshake's share of that deadline at most (it runs on the connection's thread).
TLS_HANDSHAKE_TIMEOUT_S = 5.0
# Bytes read of one request at most: http.server alone allows 100 header lines of 64 KiB.
MAX_REQUEST_BYTES = 64 * 1024
# The answer must be taken this soon after its first byte, in all (a reader that takes a byte
# now and then would otherwise hold the thread for as long as the answer is long).
ANSWER_TIMEOUT_S = 10.0


def _time_left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the connection's deadline passed")
    return left


class _RequestTooLarge(OSError):
    """A request past MAX_REQUEST_BYTES: its connection is closed unanswered."""


class _RequestReader(io.RawIOBase):
    """A connection's request bytes: every wait gets only the time left before the request's
    deadline, and no more than MAX_REQUEST_BYTES are read in all."""

    def __init__(self, connection: socket.socket, deadline: float) -> None:
        super().__init__()
        self._connection = connection
        self._deadline = deadline
        self._bytes_left = MAX_REQUEST_BYTES

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: WriteableBuffer) -> int:
        if self._bytes_left <= 0:
            raise _RequestTooLarge(f"a request of more than {MAX_REQUEST_BYTES} bytes")
        with memoryview(buffer) as view:
            self._connection.settimeout(_time_left(self._deadline))
            got = self._connection.recv_into(view, min(view.nbytes, self._bytes_left))
        self._bytes_left -= got
        return got


class _AnswerWriter(io.RawIOBase):
    """A connection's answer: written within ANSWER_TIMEOUT_S of its first byte, in all."""

    def __init__(self, connection: socket.socket) -> None:
        super().__init__()
        self._connection = connection
        self._deadline: float | None = None

    def writable(self) -> bool:
        return True

    def write(self, data: ReadableBuffer) -> int:
        if self._deadline is None:
            self._deadline = time.monotonic() + ANSWER_TIMEOUT_S
        with memoryview(data) as view, view.cast("B") as octets:
            sent = 0
            while sent < len(octets):
                self._connection.settimeout(_time_left(self._deadline))
                sent += self._connection.send(octets[sent:])
        return sent


class _BoundedHTTPServer(HTTPServer):
    """An HTTP server with a thread per connection, at most MAX_CONNECTIONS of them (and
    MAX_CONNECTIONS_PER_PEER per peer address), each connection's TLS handshake on its thread."""

    # connections the kernel queues for the accept loop (socketserver's 5 dropped a burst's
    # SYNs, a scrape among them waiting a second for its retry)
    request_queue_size = MAX_CONNECTIONS

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[_Handler],
        ssl_context: ssl.SSLContext | None,
    ) -> None:
        super().__init__(address, handler)
        self.handler = handler
        self.ssl_context = ssl_context
        self._lock = threading.Lock()
        self._open = 0  # connections being served; guarded by _lock, as _open_of
        self._open_of: dict[str, int] = {}  # peer address -> its connections being served

    def process_request(self, request: Any, client_address: Any) -> None:
        """The accept loop's part: count the connection in, or close it at once."""
        peer = str(client_address[0])
        with self._lock:
            refused = (
                self._open >= MAX_CONNECTIONS
                or self._open_of.get(peer, 0) >= MAX_CONNECTIONS_PER_PEER
            )
            if not refused:
                self._open += 1
                self._open_of[peer] = self._open_of.get(peer, 0) + 1
        if refused:
            self.shutdown_request(request)
            return
        deadline = time.monotonic() + REQUEST_DEADLINE_S
        try:
            threading.Thread(
                target=self._serve_connection,
                args=(request, client_address, peer, deadline),
                name=f"tensord-http-connection:{self.server_address[1]}",
                daemon=True,
            ).start()
        except BaseException:
            self._count_out(peer)  # the accept loop closes the connection
            raise

    def _serve_connection(
        self, connection: Any, client_address: Any, peer: str, deadline: float
    ) -> None:
        try:
            if self.ssl_context is not None:
                connection.settimeout(min(TLS_HANDSHAKE_TIMEOUT_S, _time_left(deadline)))
                connection = self.ssl_context.wrap_socket(connection, server_side=True)
            self.handler(connection, client_address, self, deadline)
        except OSError:
            pass  # gone, silent past its deadline, too long, or no TLS: nothing to answer
        except Exception:
            self.handle_error(connection, client_address)
        finally:
            self.shutdown_request(connection)
            self._count_out(peer)

    def _count_out(self, peer: str) -> None:
        with self._lock:
            self._open -= 1
            self._open_of[peer] -= 1
            if not self._open_of[peer]:
                del self._open_of[peer]


class _Handler(BaseHTTPRequestHandler):
    owner: HttpEndpoints
    server_version = "tensord"

    def __init__(
        self, request: Any, client_address: Any, server: _BoundedHTTPServer, deadline: float
    ) -> None:
        self.deadline = deadline
        super().__init__(request, client_address, server)

    def setup(self) -> None:
        # in place of StreamRequestHandler's, whose timeout would apply to each recv afresh
        self.connection = self.request
        self.rfile = io.BufferedReader(_RequestReader(self.connection, self.deadline))
        self.wfile = io.BufferedWriter(_AnswerWriter(self.connection))

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the gRPC access log is the server's; scrapes every few seconds are noise

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        owner = self.owner
        if path == "/metrics" and owner.metrics:
            if self._authorized():
                self._send(
                    HTTPStatus.OK, CONTENT_TYPE_LATEST, generate_latest(owner.observer.registry)
                )
        elif path == "/api/state" and owner.dashboard:
            if self._authorized():
                state = dashboard_state(owner.store, owner.history)
                self._send(HTTPStatus.OK, "application/json", json.dumps(state).encode())
        elif owner.dashboard and path in ("/", "/index.html"):
            self._send(HTTPStatus.OK, STATIC_FILES["index.html"], static_file("index.html"))
        elif owner.dashboard and path.startswith("/static/") and path[8:] in STATIC_FILES:
            name = path[8:]
            self._send(HTTPStatus.OK, STATIC_FILES[name], static_file(name))
        else:
            self._send(HTTPStatus.NOT_FOUND, "text/plain", b"not found\n")

    def _authorized(self) -> bool:
        if bearer_allowed(self.owner.tokens, self.headers.get("Authorization")):
            return True
        self._send(
            HTTPStatus.UNAUTHORIZED,
            "text/plain",
            b"an operator's bearer token is required\n",
            {"WWW-Authenticate": 'Bearer realm="tensord"'},
        )
        return False

    def _send(
        self,
        status: HTTPStatus,
        content_type: str,
        body: bytes,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        # the page runs only its own files: no inline script, nothing from elsewhere
        self.send_header(
            "Content-Security-Policy",
            "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'",
        )
        self.send_header("X-Content-Type-Options", "nosniff")
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)
