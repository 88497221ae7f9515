"""A budget of log lines per key (a token bucket): refused requests do not set the log's volume.

Every refused request is worth a line to an operator, but a client that sends refused
requests as fast as it can (an OOM's line is about 500 bytes; thousands a second on one
connection) would otherwise make the server write megabytes of log a minute.  Each key
(a tenant) gets ``burst`` lines at once and ``per_s`` a second after that; the lines
beyond are counted (``tensord_refusal_log_lines_left_out_total``), and the key's next
line that goes out says how many were left out.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

# a tenant's refusal lines: a burst, then a steady rate (per key)
REFUSAL_LINES_BURST = 50
REFUSAL_LINES_PER_S = 10.0


@dataclass
class _Bucket:
    tokens: float
    updated: float
    left_out: int = 0


class LogBudget:
    """Up to ``burst`` lines at once and ``per_s`` a second per key; thread-safe.

    The keys are the callers' (here tenants: bounded by the tokens file, or one without
    authentication), so the table stays as small as they are."""

    def __init__(
        self,
        burst: int = REFUSAL_LINES_BURST,
        per_s: float = REFUSAL_LINES_PER_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if burst < 1 or per_s <= 0:
            raise ValueError(f"a log budget needs burst >= 1 and per_s > 0: {burst}, {per_s}")
        self.burst = burst
        self.per_s = per_s
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: dict[Hashable, _Bucket] = {}

    def take(self, key: Hashable) -> int | None:
        """None: leave this line out (counted); else the line goes out, and the number
        of ``key``'s lines left out since its last line is returned (0 most often)."""
        with self._lock:  # the clock read inside: no interval is credited twice
            now = self._clock()
            bucket = self._buckets.get(key)
            if bucket is None:
                bucket = self._buckets[key] = _Bucket(tokens=float(self.burst), updated=now)
            elapsed = max(0.0, now - bucket.updated)  # a clock that steps back credits nothing
            bucket.tokens = min(float(self.burst), bucket.tokens + elapsed * self.per_s)
            bucket.updated = max(bucket.updated, now)
            if bucket.tokens < 1.0:
                bucket.left_out += 1
                return None
            bucket.tokens -= 1.0
            left_out, bucket.left_out = bucket.left_out, 0
            return left_out
