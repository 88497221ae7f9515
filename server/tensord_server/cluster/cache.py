"""What a node last read of etcd's keys, kept from going stale by the node's watch.

A lookup of a name another node holds (a redirect) or of the members (a copy's target)
would otherwise cost an etcd round trip each time.  The node watches every key already
(:meth:`tensord_server.cluster.node.ClusterNode._watch_forever`); this cache keeps each
value read and drops it when the watch tells of a newer change to its key, so a value
is answered from memory until it changes, and at most the watch's delay after.

Why it is never older than that: a value read at revision ``r`` enters only when the watch
has told nothing newer than ``r`` yet (``r >= heard``), so every change after ``r`` is
still to come through the watch and will drop it; a change the watch tells late, older
than the value held, leaves it.  Without a watch (before it starts, after it failed)
nothing enters and nothing is answered.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from typing import Generic, NamedTuple, TypeVar

V = TypeVar("V")


class Cached(NamedTuple, Generic[V]):
    """A value and the revision it was last changed at (etcd's ``mod_revision``)."""

    value: V
    revision: int


class WatchedCache(Generic[V]):
    """Values of etcd keys, at most ``limit`` (the least recently used go first).
    Thread-safe.

    Invariants (under ``_lock``): ``len(_entries) <= limit``; no entry while ``_heard``
    is None (no watch); each entry's revision is its key's ``mod_revision`` when read."""

    def __init__(self, limit: int) -> None:
        assert limit >= 1, f"a cache holds at least one key, got {limit}"
        self.limit = limit
        self._lock = threading.Lock()
        self._entries: OrderedDict[bytes, Cached[V]] = OrderedDict()
        self._heard: int | None = None  # the newest revision the watch told of

    def get(self, key: bytes) -> V | None:
        """``key``'s value, if held (None: read it from etcd)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry.value

    def store(self, key: bytes, value: V, revision: int, read_at: int) -> None:
        """Keep ``value``, last changed at ``revision``, read at revision ``read_at`` —
        unless the watch already told of a revision after ``read_at`` (the change may be
        one to this key) or there is no watch."""
        assert revision <= read_at, f"a value changed at {revision} read at {read_at}"
        with self._lock:
            if self._heard is None or read_at < self._heard:
                return
            self._entries[key] = Cached(value, revision)
            self._entries.move_to_end(key)
            while len(self._entries) > self.limit:
                self._entries.popitem(last=False)

    def changed(self, key: bytes, revision: int) -> None:
        """The watch told of a change to ``key`` at ``revision``: drop an older value."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.revision < revision:
                del self._entries[key]

    def drop(self, key: bytes) -> None:
        """Forget ``key`` (this node changed it itself)."""
        with self._lock:
            self._entries.pop(key, None)

    def heard(self, revision: int) -> None:
        """The watch has told of every change up to ``revision`` (or more: the watch's
        header may run ahead of its events, which only keeps more reads out)."""
        with self._lock:
            if self._heard is not None:
                self._heard = max(self._heard, revision)

    def watching(self, revision: int) -> None:
        """A watch started: every change after ``revision`` is to come through it."""
        with self._lock:
            self._entries.clear()
            self._heard = revision

    def unwatched(self) -> None:
        """The watch ended: nothing is answered or kept until the next one starts."""
        with self._lock:
            self._entries.clear()
            self._heard = None

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)


class RereadBudget:
    """How often a lookup that missed in memory may read etcd again: a token bucket of
    ``burst`` reads refilled at ``per_second``.  A node that joined a moment ago is not in
    the members the watch has told of yet, so a miss is read once more; a client naming
    ids that never exist must not turn each of its calls into an etcd read.  Thread-safe.

    Invariants (under ``_lock``): ``0 <= _tokens <= burst``."""

    def __init__(
        self, per_second: float, burst: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        assert per_second > 0 and burst >= 1, f"a budget of {per_second}/s, burst {burst}"
        self.per_second = per_second
        self.burst = burst
        self._clock = clock
        self._lock = threading.Lock()
        self._tokens = float(burst)
        self._at = clock()

    def take(self) -> bool:
        """Whether a read may be made now (it is then counted)."""
        with self._lock:
            now = self._clock()
            elapsed = max(0.0, now - self._at)
            self._tokens = min(float(self.burst), self._tokens + elapsed * self.per_second)
            self._at = now
            if self._tokens < 1.0:
                return False
            self._tokens -= 1.0
            return True


class SharedRead(Generic[V]):
    """One read at a time, shared: a caller that comes while a read is under way waits
    for it and gets its answer (or its exception) rather than starting another.  Many
    tenants' lookups that miss at once then cost etcd one read, and one of the re-read
    budget.  Thread-safe.

    Invariants (under ``_lock``): ``_running`` is the read under way (None: none);
    ``waiting`` counts the callers waiting for it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: Future[V] | None = None
        self.waiting = 0

    def read(self, read: Callable[[], V]) -> V:
        """``read()``'s answer: this caller's own, or that of the read under way."""
        with self._lock:
            running = self._running
            if running is None:
                mine: Future[V] = Future()
                self._running = mine
            else:
                self.waiting += 1
        if running is not None:
            try:
                return running.result()
            finally:
                with self._lock:
                    self.waiting -= 1
        try:
            answer = read()
        except BaseException as exc:
            self._done()
            mine.set_exception(exc)
            raise
        self._done()
        mine.set_result(answer)
        return answer

    def _done(self) -> None:
        with self._lock:
            self._running = None
