"""A lock that knows how many threads wait for it, so background work can step aside.

The background compactor (``tensord_server.domain.compactor``) moves one Storage per
acquisition of a pool's lock and the registry's, and starts its next move only when
no thread waits for those locks: a request that found one taken waits for at most the
one move in progress.  For that the locks count their waiters; the count costs nothing
on the uncontended path (a non-blocking acquire that succeeds).
"""

from __future__ import annotations

import threading
from types import TracebackType


class CountingLock:
    """A non-reentrant lock (``threading.Lock``'s interface) counting its blocked waiters."""

    __slots__ = ("_count_lock", "_lock", "waiting")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count_lock = threading.Lock()  # a leaf: guards ``waiting`` only
        self.waiting = 0  # threads blocked in acquire() now (read without a lock: one int)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._lock.acquire(False):
            return True
        if not blocking:
            return False
        with self._count_lock:
            self.waiting += 1
        try:
            return self._lock.acquire(True, timeout)
        finally:
            with self._count_lock:
                self.waiting -= 1

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._lock.release()
