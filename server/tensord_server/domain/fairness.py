"""Fair shares of the server's workers: which waiting call runs next, and who may queue more.

Calls wait in one first-in, first-out queue per *key* (the caller's tenant; without
``--auth-tokens``, its connection) and keys take turns: a free worker goes to the waiting
key that holds the fewest workers (round-robin among equals), so a key with a thousand
calls queued delays another key's next call by at most the calls already running, never
by its whole queue.

A key holds at most ``max_running_per_key`` workers (one by default) while another key is
*active*: has calls waiting or running, or had one arrive or end within the last
``active_window_s``.  The window matters because a well-behaved tenant sends its calls one
after another: between two of them it has nothing queued, and a flood would take every
worker in that gap and hold the GIL with all of them.  A key alone may use every worker
(after the window, once the others have gone quiet).

A key with a *backlog* (calls still waiting when one ends) is also *paced* while others
are active: after a call that took ``t`` seconds of CPU its next call waits ``t`` times the
number of other active keys (at most ``MAX_PACE_S``), so it holds the GIL at most its
share of the time and leaves the rest free for the others' calls, which then find the GIL
free at each handoff instead of waiting a switch interval behind it.  A caller that sends
one call at a time has no backlog and is never paced; pacing idles a worker only while
another key is active.  A key queues at most
``max_queued_per_key`` calls; beyond that a call is refused at once (RESOURCE_EXHAUSTED),
so what a flood holds in memory is bounded by the queue, not by how fast it sends.

Pure bookkeeping, no threads or event loop: the rpc layer calls it from one thread
(its event loop) and runs what :meth:`FairQueue.next` hands out.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from tensord.errors import ResourceExhaustedError

Job = TypeVar("Job")

# Workers one key holds at most while another key is active.  Calls are Python: a second
# thread of one key adds no throughput under the GIL, it only takes the GIL from the other
# keys' threads (every switch interval, at each of their calls' handoffs).
MAX_SHARE = 1
# How long a key counts as active after its last call arrived or ended: a tenant whose
# calls come one at a time is absent from the queue between them, and would otherwise
# never count while a flood refills every worker the moment one frees.
ACTIVE_WINDOW_S = 1.0
# The longest pause pacing puts between two of a key's calls.
MAX_PACE_S = 0.25
# Calls one key may have waiting for a worker (each holds its request's bytes meanwhile).
DEFAULT_MAX_QUEUED_PER_KEY = 256
# Calls waiting for a worker in all.
DEFAULT_MAX_QUEUED = 4096


@dataclass(slots=True)
class _KeyState(Generic[Job]):
    waiting: collections.deque[Job] = field(default_factory=collections.deque)
    running: int = 0  # workers this key holds now
    last_turn: int = -1  # when its last call started (FairQueue's turn counter); -1: never
    ready_at: float = 0.0  # a paced key's next call starts no sooner (the queue's clock)


class FairQueue(Generic[Job]):
    """Round-robin over keys with waiting calls; ``workers`` run at once.

    Invariants (checked by :meth:`assert_invariants`): ``running`` is the sum of the keys'
    running counts and never exceeds ``workers``; a key is in ``_turns`` exactly when it
    has calls waiting; a key with nothing waiting or running is forgotten, into ``_recent``
    (oldest first) until its window ends.
    """

    def __init__(
        self,
        workers: int,
        *,
        max_running_per_key: int | None = None,
        max_queued_per_key: int = DEFAULT_MAX_QUEUED_PER_KEY,
        max_queued: int = DEFAULT_MAX_QUEUED,
        active_window_s: float = ACTIVE_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.workers = workers
        # a fair share while another key is active
        self.max_running_per_key = max_running_per_key or max(1, min(workers // 2, MAX_SHARE))
        self.max_queued_per_key = max_queued_per_key
        self.max_queued = max_queued
        self.running = 0
        self.queued = 0
        self._keys: dict[Hashable, _KeyState[Job]] = {}
        self._turns: dict[Hashable, None] = {}  # the keys with calls waiting
        self._turn = 0  # counts the calls started: a key's last_turn orders equals
        self.active_window_s = active_window_s
        self._clock = clock
        # keys with nothing waiting or running, by when they were last seen (oldest first)
        self._recent: dict[Hashable, float] = {}
        self._paced_until: float | None = None  # see wake_at

    def submit(self, key: Hashable, job: Job, describe: str = "this caller") -> None:
        """Queue ``job`` for ``key``, or refuse it now (ResourceExhaustedError)."""
        state = self._keys.get(key)
        waiting = len(state.waiting) if state is not None else 0
        if waiting >= self.max_queued_per_key:
            raise ResourceExhaustedError(
                f"{describe} has {waiting} calls waiting for a worker, the limit "
                f"({self.max_queued_per_key}); wait for answers before sending more"
            )
        if self.queued >= self.max_queued:
            raise ResourceExhaustedError(
                f"the server has {self.queued} calls waiting for a worker, the limit "
                f"({self.max_queued}); retry later"
            )
        if state is None:
            state = self._keys[key] = _KeyState()
            self._recent.pop(key, None)
        state.waiting.append(job)
        self.queued += 1
        self._turns[key] = None

    def next(self) -> tuple[Hashable, Job] | None:
        """The call a free worker runs now (its key's running count taken), or None.

        The waiting key holding the fewest workers goes first (ties: the one whose last
        call started longest ago), so a key that just arrived never waits behind a busy key's
        queue; a key at its share waits while any other key is active, and a paced key
        until its pause ends (:meth:`wake_at`)."""
        self._paced_until = None
        if self.running >= self.workers or not self._turns:
            return None
        self._forget_inactive()
        # every waiting key is in _keys: another key is active when _keys or _recent holds it
        others_active = len(self._keys) + len(self._recent) > 1
        now = self._clock()
        chosen, best = None, (0, 0)
        for key in self._turns:
            state = self._keys[key]
            if others_active and state.running >= self.max_running_per_key:
                continue
            if others_active and state.ready_at > now:
                if self._paced_until is None or state.ready_at < self._paced_until:
                    self._paced_until = state.ready_at
                continue
            rank = (state.running, state.last_turn)
            if chosen is None or rank < best:
                chosen, best = key, rank
        if chosen is None:
            return None  # every waiting key is over its share: the running calls finish first
        state = self._keys[chosen]
        job = state.waiting.popleft()
        self.queued -= 1
        state.running += 1
        self.running += 1
        state.last_turn = self._turn
        self._turn += 1
        if not state.waiting:
            del self._turns[chosen]
        return chosen, job

    def finished(self, key: Hashable, busy_s: float = 0.0) -> None:
        """A call of ``key`` handed out by :meth:`next` is done: its worker is free.
        ``busy_s``: the CPU time the call took, which paces a key with a backlog."""
        state = self._keys[key]
        assert state.running > 0, f"finished() for {key!r}, which runs nothing"
        state.running -= 1
        self.running -= 1
        if not state.running and not state.waiting:
            self._forget(key)
            return
        others = len(self._keys) + len(self._recent) - 1
        if state.waiting and others:
            state.ready_at = self._clock() + min(busy_s * others, MAX_PACE_S)

    def wake_at(self) -> float | None:
        """When the last :meth:`next` passed over a paced key, when its pause ends (the
        queue's clock): call :meth:`next` again then.  None: no key was passed over for
        its pause."""
        return self._paced_until

    def drop_waiting(self, key: Hashable, job: Job) -> bool:
        """Take back a call that has not started (its caller went away); False if it had."""
        state = self._keys.get(key)
        if state is None or job not in state.waiting:
            return False
        state.waiting.remove(job)
        self.queued -= 1
        if not state.waiting:
            self._turns.pop(key, None)
            if not state.running:
                self._forget(key)
        return True

    def _forget(self, key: Hashable) -> None:
        """``key`` has nothing waiting or running: it stays active for the window."""
        del self._keys[key]
        self._recent[key] = self._clock()

    def _forget_inactive(self) -> None:
        horizon = self._clock() - self.active_window_s
        while self._recent:
            key, seen = next(iter(self._recent.items()))
            if seen > horizon:
                break
            del self._recent[key]

    def running_of(self, key: Hashable) -> int:
        state = self._keys.get(key)
        return state.running if state is not None else 0

    def assert_invariants(self) -> None:
        running = sum(s.running for s in self._keys.values())
        queued = sum(len(s.waiting) for s in self._keys.values())
        assert running == self.running <= self.workers, (running, self.running, self.workers)
        assert queued == self.queued, (queued, self.queued)
        assert set(self._turns) == {k for k, s in self._keys.items() if s.waiting}, self._turns
        assert all(s.running or s.waiting for s in self._keys.values()), self._keys
        assert not set(self._recent) & set(self._keys), self._recent
        seen = list(self._recent.values())
        assert seen == sorted(seen), self._recent  # oldest first, as _forget_inactive reads
