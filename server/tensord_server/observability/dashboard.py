"""The HTTP endpoints of ``tensord serve``: ``/metrics`` (Prometheus) and the live dashboard.

Routes (each server serves those it was asked for):

- ``/metrics``: the Prometheus text format of the TensorStore's registry.
- ``/`` and ``/static/NAME``: the dashboard page, its script and style, shipped
  in this package (no asset is fetched from anywhere else).
- ``/api/state``: JSON the page polls: each device's segments and blocks (from
  the pool's snapshot, each allocated block with its tenant), time series of
  allocated, reserved and fragmentation (a bounded ring buffer sampled once a
  second), sessions and tenants.

With ``--auth-tokens`` the data routes (``/metrics``, ``/api/*``) need
``Authorization: Bearer TOKEN`` with the token of an operator tenant
(``--operator-tenant``): they show every tenant's figures, which no ordinary
tenant may see.  The page and its assets hold no data and need no token.
"""

from __future__ import annotations

import collections
import hmac
import json
import ssl
import threading
import time
from collections.abc import Iterable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tensord_server.observability.metrics import observer_for, session_figures, tenants_of

if TYPE_CHECKING:
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
    device = store.device(device_name)
    snapshot = device.pool.memory_snapshot()
    tenant_at = {s.block.address: s.tenant for s in store.storages.live() if s.device is device}
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

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        if ssl_context is not None:
            self._server.socket = ssl_context.wrap_socket(self._server.socket, server_side=True)
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


# A connection that sends no complete request line or header within this many seconds is
# closed: each connection holds a thread, so an idle one must not hold it for ever.
IDLE_TIMEOUT_S = 10.0


class _Handler(BaseHTTPRequestHandler):
    owner: HttpEndpoints
    server_version = "tensord"
    timeout = IDLE_TIMEOUT_S  # socketserver sets it on the connection before reading

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
