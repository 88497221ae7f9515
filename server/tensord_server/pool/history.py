"""The pool's memory history: the device trace of ``torch.cuda.memory._record_memory_history``.

:class:`MemoryHistory` keeps, while recording, the last ``max_entries`` alloc, free, segment
and snapshot events in ``_snapshot()``'s TraceEntry form (a ring buffer), each numbered in
the order recorded, so that a snapshot read a page at a time can end its trace where it
began.  It takes no lock: the owning :class:`~.allocator.CachingPool` calls it with the
pool's lock held.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

TRACE_MAX_ENTRIES = 100_000  # _record_memory_history's default max_entries (a ring buffer)


class MemoryHistory:
    """The trace entries recorded (None while not recording) and how many ever were."""

    __slots__ = ("_entries", "recorded")

    def __init__(self, max_entries: int | None = None) -> None:
        self._entries: deque[dict[str, Any]] | None = None
        # entries ever appended: the next entry's sequence number (kept across restarts)
        self.recorded = 0
        self.restart(max_entries)

    def restart(self, max_entries: int | None) -> None:
        """Record afresh into a ring buffer of ``max_entries`` (None: stop recording)."""
        self._entries = deque(maxlen=max_entries) if max_entries is not None else None

    def record(self, action: str, addr: int, size: int, stream: int) -> None:
        """record_trace: one TraceEntry in _snapshot()'s form, when recording."""
        if self._entries is None:
            return
        address_key = "device_free" if action == "oom" else "addr"
        self.recorded += 1
        self._entries.append(
            {
                "action": action,
                address_key: addr,
                "size": size,
                "stream": stream,
                "time_us": time.time_ns() // 1000,
                "frames": [],
            }
        )

    def entries(self) -> list[dict[str, Any]]:
        """Every entry held, the oldest first (none while not recording)."""
        return list(self._entries) if self._entries is not None else []

    def between(self, start: int, end: int, limit: int) -> tuple[int, list[dict[str, Any]]]:
        """The entries of sequence numbers ``start`` up to ``end`` (from the oldest still
        held, when the ring buffer dropped some), at most ``limit``: the first one's number
        and the entries."""
        trace = self._entries
        if trace is None:
            return end, []
        oldest = self.recorded - len(trace)
        first = max(start, oldest)
        count = max(min(end - first, limit), 0)
        offset = first - oldest
        return first, [trace[offset + i] for i in range(count)]
