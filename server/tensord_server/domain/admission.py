"""Worker accounting: who may hold a server thread, for how long, and how busy the server is.

The gRPC sync server runs every call on one of ``--max-workers`` threads; a
streaming call holds its thread for as long as the stream is open.  Two rules
kept here (pure counting, no gRPC) keep one client's streams from costing
another client its session:

* Admission: long-lived calls (Upload, Download, KeepAlive) may hold at most
  ``max_streams`` workers in all (the rest stay free for unary calls such as
  Heartbeat) and at most ``max_streams_per_tenant`` per tenant; beyond that a
  new stream is refused at once (RESOURCE_EXHAUSTED).
* Idle timeout: a stream waiting on its client (an Upload's next chunk, a
  Download's consumer) for longer than ``idle_timeout`` is cancelled through
  the gate's ``cancel_stream`` (the rpc layer installs one that ends the call
  with DEADLINE_EXCEEDED); its handler unwinds and frees what it held.

The gRPC side of these rules (cancelling a call, the liveness thread pool, the
interceptor that gates other services' calls) is in
:mod:`tensord_server.rpc.admission`.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from tensord.errors import ResourceExhaustedError

from tensord_server.domain.auth import describe_tenant

log = logging.getLogger(__name__)

# Workers kept for unary calls whatever the streams do: a quarter of them, at least one.
UNARY_RESERVE_FRACTION = 0.25
# A stream may wait on its client this long (s) before it is cancelled.
DEFAULT_STREAM_IDLE_TIMEOUT_S = 30.0
# Worker threads: one per call in flight (clients heartbeat with unary calls; only the
# optional KeepAlive stream holds a thread for as long as it is open).
DEFAULT_MAX_WORKERS = 64
# The watchdog looks this often relative to the idle timeout (never lazier than 1 s).
WATCHDOG_INTERVAL_FRACTION = 0.25
WATCHDOG_MAX_INTERVAL_S = 1.0


def default_max_streams(max_workers: int) -> int:
    """Streams allowed in all: every worker but the unary reserve (at least one stream)."""
    reserve = max(1, int(max_workers * UNARY_RESERVE_FRACTION))
    return max(1, max_workers - reserve)


def default_max_streams_per_tenant(max_streams: int) -> int:
    """A tenant's fair share with --auth-tokens: half of the streams (at least one), so no
    tenant can hold them all (without tenants every caller is one tenant: all of them)."""
    return max(1, max_streams // 2)


# How to end an open stream's call, from the watchdog's thread: (the call's context, why).
StreamCanceller = Callable[[Any, str], None]


def cancel_nothing(context: Any, details: str) -> None:
    """The canceller of a gate no server installed one on: the stream is only marked."""
    log.warning("no stream canceller installed: %s (marked timed out only)", details)


@dataclass(eq=False)
class _Stream:
    context: Any
    method: str
    tenant: str
    idle_timeout: float
    waiting_since: float | None = None  # when it started waiting on its client (None: working)
    timed_out: bool = False


class CallGate:
    """In-flight calls, stream admission, idle streams and the saturation clock.  Thread-safe."""

    def __init__(
        self,
        max_workers: int,
        *,
        max_streams: int | None = None,
        max_streams_per_tenant: int | None = None,
        idle_timeout: float = DEFAULT_STREAM_IDLE_TIMEOUT_S,
        multi_tenant: bool = True,
        clock: Callable[[], float] = time.monotonic,
        cancel_stream: StreamCanceller = cancel_nothing,
    ) -> None:
        if idle_timeout <= 0:
            raise ValueError(f"the stream idle timeout must be > 0, got {idle_timeout}")
        self.idle_timeout = idle_timeout
        # how the watchdog ends an idle stream's call (the server installs the gRPC one)
        self.cancel_stream = cancel_stream
        self._explicit = (max_streams, max_streams_per_tenant)
        self._multi_tenant = multi_tenant  # False: one tenant, whose fair share is every stream
        self._clock = clock
        self._lock = threading.Lock()
        self._in_flight = 0
        self._saturated_total = 0.0  # seconds every worker was busy, closed periods
        self._saturated_since: float | None = None  # start of the current saturated period
        self._streams: dict[int, _Stream] = {}
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._watchdog: threading.Thread | None = None
        self.resize(max_workers)

    def resize(self, max_workers: int) -> None:
        """Follow the server's real worker count (create_server knows it)."""
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        streams, per_tenant = self._explicit
        self.max_workers = max_workers
        self.max_streams = streams if streams is not None else default_max_streams(max_workers)
        if per_tenant is None:
            per_tenant = (
                default_max_streams_per_tenant(self.max_streams)
                if self._multi_tenant
                else self.max_streams
            )
        self.max_streams_per_tenant = per_tenant

    # -- every call: the saturation clock ------------------------------------------------

    @contextmanager
    def call(self) -> Iterator[None]:
        """Count one call on a worker while the block runs."""
        with self._lock:
            self._in_flight += 1
            if self._in_flight >= self.max_workers and self._saturated_since is None:
                self._saturated_since = self._clock()
        try:
            yield
        finally:
            with self._lock:
                self._in_flight -= 1
                if self._in_flight < self.max_workers and self._saturated_since is not None:
                    self._saturated_total += self._clock() - self._saturated_since
                    self._saturated_since = None

    def saturated_seconds(self) -> float:
        """Seconds so far during which every worker was busy."""
        with self._lock:
            total = self._saturated_total
            if self._saturated_since is not None:
                total += self._clock() - self._saturated_since
            return total

    # -- long-lived calls: admission and idle timeout --------------------------------------

    def open_stream(
        self, context: Any, method: str, tenant: str, idle_timeout: float | None = None
    ) -> int:
        """Admit a stream or refuse it now (ResourceExhaustedError naming the limit);
        ``idle_timeout`` raises the gate's own for this stream (KeepAlive beats every lease/3)."""
        with self._lock:
            if len(self._streams) >= self.max_streams:
                raise ResourceExhaustedError(
                    f"the server has {len(self._streams)} streams open, the limit "
                    f"(--max-streams {self.max_streams}, of --max-workers {self.max_workers}); "
                    "retry later"
                )
            held = sum(1 for s in self._streams.values() if s.tenant == tenant)
            if held >= self.max_streams_per_tenant:
                raise ResourceExhaustedError(
                    f"{describe_tenant(tenant)} has {held} streams open (Upload, Download, "
                    f"KeepAlive), the limit (--max-streams-per-tenant "
                    f"{self.max_streams_per_tenant}); finish or close some first"
                )
            stream_id = next(self._ids)
            timeout = max(self.idle_timeout, idle_timeout or 0.0)
            self._streams[stream_id] = _Stream(context, method, tenant, timeout)
        self._start_watchdog()
        return stream_id

    def close_stream(self, stream_id: int) -> None:
        """Idempotent: the handler's end and the RPC's termination callback both call it."""
        with self._lock:
            self._streams.pop(stream_id, None)

    def waiting(self, stream_id: int, waiting: bool) -> None:
        """The stream starts (True) or stops (False) waiting on its client."""
        with self._lock:
            stream = self._streams.get(stream_id)
            if stream is not None:
                stream.waiting_since = self._clock() if waiting else None

    def timed_out(self, stream_id: int) -> bool:
        with self._lock:
            stream = self._streams.get(stream_id)
            return stream is not None and stream.timed_out

    def open_streams(self, tenant: str | None = None) -> int:
        with self._lock:
            return sum(1 for s in self._streams.values() if tenant is None or s.tenant == tenant)

    def cancel_idle(self) -> int:
        """Cancel every stream waiting on its client for longer than the idle timeout."""
        now = self._clock()
        with self._lock:
            idle = [
                s
                for s in self._streams.values()
                if not s.timed_out
                and s.waiting_since is not None
                and now - s.waiting_since >= s.idle_timeout
            ]
            for stream in idle:
                stream.timed_out = True
        for stream in idle:
            log.info("%s stream idle for %.3gs: cancelled", stream.method, stream.idle_timeout)
            self.cancel_stream(
                stream.context,
                f"{stream.method} idle for {stream.idle_timeout:g}s (the client neither sent nor "
                f"read anything; --stream-idle-timeout {self.idle_timeout:g})",
            )
        return len(idle)

    def _start_watchdog(self) -> None:
        with self._lock:
            if self._watchdog is not None or self._stop.is_set():
                return
            interval = min(self.idle_timeout * WATCHDOG_INTERVAL_FRACTION, WATCHDOG_MAX_INTERVAL_S)

            def loop() -> None:
                while not self._stop.wait(interval):
                    try:
                        self.cancel_idle()
                    except Exception:  # keep watching whatever one round hit
                        log.exception("stream watchdog")

            self._watchdog = threading.Thread(target=loop, name="tensord-watchdog", daemon=True)
            self._watchdog.start()

    def shutdown(self) -> None:
        self._stop.set()
        if self._watchdog is not None:
            self._watchdog.join(timeout=5.0)


def watched(gate: CallGate, stream_id: int, source: Iterator[Any]) -> Iterator[Any]:
    """``source`` (a request iterator) with the time spent waiting on it watched."""
    while True:
        gate.waiting(stream_id, True)
        try:
            item = next(source)
        except StopIteration:
            return
        finally:
            gate.waiting(stream_id, False)
        yield item
