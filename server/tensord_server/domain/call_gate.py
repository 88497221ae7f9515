"""Stream admission and the saturation clock: pure counting, no gRPC.

Two rules kept here keep one client's streams from crowding out another's:

* Admission: long-lived calls (Upload, Download, health Watch, reflection) may be open
  ``max_streams`` at once in all and ``max_streams_per_tenant`` per tenant; beyond that a
  new stream is refused at once (RESOURCE_EXHAUSTED).  A waiting stream holds no thread on
  the asyncio server, but each holds what it transfers (an upload's Storage, a held handle).
* Idle timeout: a stream may wait on its client (an Upload's next chunk, a Download's
  reader) at most ``idle_timeout`` seconds; the rpc layer ends it with DEADLINE_EXCEEDED
  (:func:`tensord_server.rpc.calls.within`).

``call()`` counts calls on workers for the saturation clock (seconds every worker was busy).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from tensord.errors import ResourceExhaustedError

from tensord_server.domain.auth import describe_tenant

# Workers kept for unary calls whatever the streams do: a quarter of them, at least one.
UNARY_RESERVE_FRACTION = 0.25
# A stream may wait on its client this long (s) before it is cancelled.
DEFAULT_STREAM_IDLE_TIMEOUT_S = 30.0
# Worker threads: one per call in flight (clients heartbeat with unary calls; only the
# optional KeepAlive stream holds a thread for as long as it is open).
DEFAULT_MAX_WORKERS = 64


def default_max_streams(max_workers: int) -> int:
    """Streams allowed in all: every worker but the unary reserve (at least one stream)."""
    reserve = max(1, int(max_workers * UNARY_RESERVE_FRACTION))
    return max(1, max_workers - reserve)


def default_max_streams_per_tenant(max_streams: int) -> int:
    """A tenant's fair share with --auth-tokens: half of the streams (at least one), so no
    tenant can hold them all (without tenants every caller is one tenant: all of them)."""
    return max(1, max_streams // 2)


@dataclass(eq=False, slots=True)
class _Stream:
    method: str
    tenant: str


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
    ) -> None:
        if idle_timeout <= 0:
            raise ValueError(f"the stream idle timeout must be > 0, got {idle_timeout}")
        self.idle_timeout = idle_timeout
        self._explicit = (max_streams, max_streams_per_tenant)
        self._multi_tenant = multi_tenant  # False: one tenant, whose fair share is every stream
        self._clock = clock
        self._lock = threading.Lock()
        self._in_flight = 0
        self._saturated_total = 0.0  # seconds every worker was busy, closed periods
        self._saturated_since: float | None = None  # start of the current saturated period
        self._streams: dict[int, _Stream] = {}
        self._ids = itertools.count()
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

    def open_stream(self, method: str, tenant: str) -> int:
        """Admit a stream or refuse it now (ResourceExhaustedError naming the limit)."""
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
                    f"health Watch, reflection), the limit (--max-streams-per-tenant "
                    f"{self.max_streams_per_tenant}); finish or close some first"
                )
            stream_id = next(self._ids)
            self._streams[stream_id] = _Stream(method, tenant)
        return stream_id

    def close_stream(self, stream_id: int) -> None:
        """Idempotent: the handler's end and the RPC's termination callback both call it."""
        with self._lock:
            self._streams.pop(stream_id, None)

    def open_streams(self, tenant: str | None = None) -> int:
        with self._lock:
            return sum(1 for s in self._streams.values() if tenant is None or s.tenant == tenant)
