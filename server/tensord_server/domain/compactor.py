"""The background compactor: compaction after a free, off the freeing call.

Under a policy with a ``compact_threshold`` (``adaptive``), a free that leaves a pool's
reserved / allocated above it rings the pool's doorbell (``CachingPool.compaction_wanted``)
and returns; one daemon thread per server then compacts that pool in steps
(``CachingPool.compact_step``): each step takes the pool's lock and the registry's,
plans, moves one Storage, then the plan's next ones for as long as no request waits
(checked before each move), and gives back the segments left wholly free: one plan
serves many moves while the server is quiet; each move lets both locks go while it copies.  Every guarantee
of compaction holds because each step is an ordinary compaction move: held Storages
(ops in flight, downloads, exports) never move, one held during its copy stays put, handles, names, share tokens, quotas and
``data_ptr()`` do not change, and blocks stay on their tenant's pool stream.

What a request can wait for: a step starts only when no thread waits for a pool's lock,
the registry's or the session table's (``CountingLock.waiting``), and each move copies
its Storage with neither lock held (``compaction.execute_move_outside_locks``: the
locks are taken to allocate the destination and note the Storage's ``uses``, then to
repoint it if it was not held meanwhile), so a request waits for no copy, only for a
step's planning or a move's bookkeeping; under contention the compactor waits (looking again after 0.5 ms, then less
and less often, up to every ``YIELD_POLL_MAX_S``; after ``YIELD_LIMIT_S`` it gives the
wake-up up).  What it costs: at most the policy's ``max_moved_bytes`` per wake-up, at
most ``background_bytes_per_s`` on average (it sleeps after each move for as long as
the move's bytes take at that rate), at most ``MAX_PLANS_PER_WAKE`` plans per wake-up and one wake-up per
``MIN_WAKE_INTERVAL_S``, backing off up to ``MAX_WAKE_INTERVAL_S`` while wake-ups move
nothing (each step plans under the locks, so a storm of frees does not become a storm of
plans).  Far above target (reserved / allocated > ``URGENT_RATIO``, as when many users
free at once) a wake-up lifts those caps (bytes, pace, plans, the wait for the next
wake-up) while it makes progress: a step is still one plan under one acquisition of the
locks, and still waits for requests, so the guarantee above holds.  Background plans
empty the least-used *fraction* first (``background_evacuation_order``: the most bytes
released per byte moved).

Time hysteresis (policy ``release_idle_s``): a segment left wholly free is kept that long
(compaction neither empties nor fills it, nor counts it as excess), so the next request
of its size reuses warm pages; besides the doorbell, the thread wakes when the first kept
segment of a pool may go back (``until_idle_release``), and that wake-up's steps give it
back like any idle segment (a plan empties it first, with no move).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from tensord_server.pool import CachingPool

log = logging.getLogger(__name__)

MIN_WAKE_INTERVAL_S = 0.1  # at most 10 wake-ups a second
# after a wake-up that moved nothing (no plan helped: the pool's holes fit none of the
# least-used segments' Storages) the next waits twice as long, up to this: each plan
# walks every Storage and segment holding the GIL and the registry's lock, and planning
# again 50 times a second for nothing took a third of a loaded server's GIL
MAX_WAKE_INTERVAL_S = 0.8
MAX_PLANS_PER_WAKE = 8  # steps (one plan each) per pool per wake-up
YIELD_POLL_S = 0.0005  # a compactor stepping aside looks again after this, first
YIELD_POLL_MAX_S = 0.008  # ... then twice as long each time, up to this (a waiting
# compactor polling every 0.5 ms took the GIL from the requests it stepped aside for)
YIELD_LIMIT_S = 1.0  # stepping aside longer than this ends the wake-up (the next free wakes it)
# far above target (reserved / allocated beyond this, e.g. when half of the users free
# at once), a wake-up lifts its caps: no per-wake-up byte budget beyond the pool's reserved
# bytes, no pacing, up to URGENT_PLANS_PER_WAKE plans, and the next wake-up follows at
# once; still one move per lock acquisition and still stepping aside for requests
URGENT_RATIO = 1.20
URGENT_PLANS_PER_WAKE = 64
# a wake-up for a kept idle segment comes this long after the segment may go back, so
# that the pool's clock has surely passed that time when the step looks
IDLE_RELEASE_MARGIN_S = 0.005
JOIN_TIMEOUT_S = 10.0  # close() waits this long for a move in progress


class BackgroundCompactor:
    """One daemon thread compacting ``pools`` after frees; ``contended()`` says whether a
    request waits for a lock a step takes.  start() installs the doorbells, close() removes
    them (frees then compact on their own call again) and joins the thread."""

    def __init__(self, pools: Sequence[CachingPool], contended: Callable[[], bool]) -> None:
        self.pools = list(pools)
        self.contended = contended
        self.moves = 0  # steps that moved Storages (one plan each)
        self.moved_bytes = 0
        self.wakeups = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="tensord-compactor", daemon=True)
        self._thread.start()
        for pool in self.pools:
            pool.compaction_wanted = self.wake

    def wake(self) -> None:
        """The doorbell (called with a pool's lock held: it only sets an event)."""
        self._wake.set()

    def close(self) -> None:
        for pool in self.pools:
            if pool.compaction_wanted == self.wake:
                pool.compaction_wanted = None
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(JOIN_TIMEOUT_S)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        interval = MIN_WAKE_INTERVAL_S
        while not self._stop.is_set():
            # a doorbell, or the time a kept idle segment may go back (release_idle_s)
            self._wake.wait(self.until_idle_release())
            self._wake.clear()
            if self._stop.is_set():
                return
            self.wakeups += 1
            moves = self.moves
            for pool in self.pools:
                try:
                    self.drain(pool)
                except Exception:  # a failed copy (a device error) left its Storage in place;
                    # the thread must live on: dead, every later free only rang its doorbell
                    log.exception("background compaction of a pool failed; it goes on")
            futile = self.moves == moves
            interval = min(2 * interval, MAX_WAKE_INTERVAL_S) if futile else MIN_WAKE_INTERVAL_S
            if not futile and any(self._urgent(pool) for pool in self.pools):
                self._wake.set()  # progress, and still far above target: go on at once
                continue
            self._stop.wait(interval)

    def until_idle_release(self) -> float | None:
        """Seconds until the first kept idle segment of any pool may go back (the pools'
        policy ``release_idle_s``), a little after it; None when no segment is kept."""
        delays = [d for d in (pool.idle_release_delay() for pool in self.pools) if d is not None]
        return min(delays) + IDLE_RELEASE_MARGIN_S if delays else None

    @staticmethod
    def _urgent(pool: CachingPool) -> bool:
        return pool.reserved_ratio() > URGENT_RATIO

    def drain(self, pool: CachingPool) -> int:
        """Steps on ``pool`` until reserved / allocated is under its threshold, no plan
        helps, the wake-up's budget is spent, requests keep waiting, or close(); the bytes moved."""
        policy = pool.policy
        urgent = self._urgent(pool)
        budget = (
            max(pool.reserved_bytes, policy.max_moved_bytes) if urgent else policy.max_moved_bytes
        )
        moved = 0
        for _ in range(URGENT_PLANS_PER_WAKE if urgent else MAX_PLANS_PER_WAKE):
            if moved >= budget or not self._step_aside():
                break
            step = pool.compact_step(budget - moved, self._quiet)
            if step is None:
                break
            moved += step
            if step:
                self.moves += 1
                self.moved_bytes += step
                if not urgent:  # pace: on average no more than background_bytes_per_s
                    self._stop.wait(step / policy.background_bytes_per_s)
        return moved

    def _quiet(self) -> bool:
        """Whether a step may start its plan's next move: nobody waits, and no close()."""
        return not self.contended() and not self._stop.is_set()

    def _step_aside(self) -> bool:
        """Wait while a request waits for a lock a step takes; False on close() or when
        requests kept waiting for YIELD_LIMIT_S."""
        waited = 0.0
        poll = YIELD_POLL_S
        while self.contended():
            if waited >= YIELD_LIMIT_S or self._stop.wait(poll):
                return False
            waited += poll
            poll = min(2 * poll, YIELD_POLL_MAX_S)
        return not self._stop.is_set()
