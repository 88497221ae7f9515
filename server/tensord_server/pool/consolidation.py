"""Consolidation and edge release: when the pool gives free-but-reserved bytes back, and how many.

PyTorch gives segments back only on the out-of-memory path and in ``empty_cache``.  Beyond
it, a pool's policy gives back the bytes it holds in free blocks before they cost a
request its room (:mod:`.policy` names the switches):

- *consolidation* (``consolidate``): before reserving a segment that would leave the
  device less headroom than the pool holds in free blocks, compact and repack, so those
  bytes go back while there is still room to gather them (once the device is full a
  repack has no room for its new segment, and the request that finds the holes
  scattered fails);
- *release after a free* (``release_threshold``, ``compact_threshold``): while committed
  bytes exceed a threshold x allocated, and by more than the policy's slack, idle
  segments go back, then compaction runs, once every ``compact_every`` frees; with a
  background compactor the free only rings its doorbell, above the wake-up threshold
  (hysteresis: below it the cached segments serve the next requests);
- *edge release*: near the device's edge (``keep_idle_below``) no idle segment is kept,
  and a free gives them back itself rather than leaving them to the compactor.

:class:`Consolidation` holds the arithmetic of those thresholds and the count of frees
since the last compaction; its owner, :class:`~.pressure.PressureSteps`, runs what it
decides (compaction, repacking, releases) and the pool counts it.  It takes no lock: it
is called with the pool's lock held.
"""

from __future__ import annotations

from tensord_server.pool.policy import PoolPolicy


class Consolidation:
    """The thresholds at which the pool gives free bytes back beyond PyTorch.

    Guarded by the owning pool's lock: every method is called with it held.

    Invariant (:meth:`assert_invariants`): ``frees_since_compaction`` counts the frees
    since a free last compacted (or since the pool began), never negative; it is reset
    only when a compaction is due and there is excess to give back.
    """

    __slots__ = ("frees_since_compaction",)

    def __init__(self) -> None:
        self.frees_since_compaction = 0

    @staticmethod
    def excess(
        policy: PoolPolicy,
        committed: int,
        allocated: int,
        threshold: float,
        slack: int | None = None,
        kept: int = 0,
    ) -> int:
        """Committed bytes, less ``kept``, beyond ``threshold`` x allocated, when their
        unallocated part is beyond ``slack`` (default: the policy's min_slack); else 0."""
        reserved = committed - kept
        if reserved - allocated <= (policy.min_slack if slack is None else slack):
            return 0
        return max(0, reserved - int(threshold * allocated))

    @staticmethod
    def background_threshold(policy: PoolPolicy, waking: bool = False) -> float:
        """The background compactor's committed / allocated aim (``waking``: the threshold
        above which a free wakes it), each falling back to the next: wake-up, background,
        compact_threshold."""
        if waking and policy.background_wake_threshold is not None:
            return policy.background_wake_threshold
        if policy.background_threshold is not None:
            return policy.background_threshold
        assert policy.compact_threshold is not None, (
            "a background compactor without compact_threshold"
        )
        return policy.compact_threshold

    @staticmethod
    def should_consolidate(policy: PoolPolicy, slack: int, headroom: int) -> bool:
        """Whether a reservation that leaves the device ``headroom`` bytes should first give
        back the ``slack`` bytes the pool holds in free blocks (policy ``consolidate``)."""
        return policy.consolidate and slack >= policy.min_slack and headroom < slack

    @staticmethod
    def near_the_edge(policy: PoolPolicy, used: int, capacity: int) -> bool:
        """Whether the device is used beyond the policy's keep_idle_below: there no idle
        segment is kept (the room is worth more than warm pages)."""
        return used > policy.keep_idle_below * capacity

    def compaction_due(self, policy: PoolPolicy, committed: int, allocated: int) -> int:
        """Count a free (the pool compacts on its frees, with a compact_threshold); the
        bytes to give back when this one should compact (every compact_every frees, with
        excess beyond compact_threshold), else 0."""
        assert policy.compact_threshold is not None
        self.frees_since_compaction += 1
        if self.frees_since_compaction < policy.compact_every:
            return 0
        excess = self.excess(policy, committed, allocated, policy.compact_threshold)
        if excess:
            self.frees_since_compaction = 0
        return excess

    def assert_invariants(self) -> None:
        assert self.frees_since_compaction >= 0, self.frees_since_compaction
