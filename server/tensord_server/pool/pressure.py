"""What the pool does beyond PyTorch under pressure: :class:`PressureSteps`, over a narrow :class:`PressureSite`.

Where torch would raise OutOfMemoryError, :class:`PressureSteps` first runs what the
pool's :class:`~.policy.PoolPolicy` asks for: a tight segment, then compaction, repacking
and merging of segments (planned and executed by :mod:`.compaction` through a
:class:`~.compaction.MoveTarget`), each followed by a retry of the reservation.  Before a
segment is reserved near the device's edge it consolidates; after a free it gives idle
segments back, or leaves them to the :class:`~.idle.IdleKeeping` it is given to keep for a
while, and compacts or rings the background compactor; its
:class:`~.consolidation.Consolidation` holds the thresholds and the count of frees.

It sees the pool only through :class:`PressureSite` (the policy, the relocator, the
pool's byte figures, a new segment's block, a MoveTarget, and the pool's count of what a
compaction did: the statistics are the pool's).  Every step runs under the pool's lock.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from tensord_server.pool.blocks import (
    ROUND_LARGE,
    SMALL_BUFFER,
    Block,
    BlockPool,
    Segment,
    format_size,
)
from tensord_server.pool.compaction import (
    CompactionResult,
    MoveTarget,
    Relocator,
    compact,
    merge,
    repack,
)
from tensord_server.pool.consolidation import Consolidation
from tensord_server.pool.idle import IdleKeeping
from tensord_server.pool.policy import PoolPolicy


class PressureSite(Protocol):
    """What :class:`PressureSteps` needs of a pool: its policy and relocator, its byte
    figures, a new segment's block, a MoveTarget for one plan, and counting what a
    compaction did.  The caller holds the pool's lock throughout."""

    policy: PoolPolicy
    relocator: Relocator | None
    compaction_wanted: Callable[[], None] | None

    @property
    def allocated_bytes(self) -> int: ...
    def committed_bytes(self) -> int: ...
    def segment_bytes(self) -> int: ...
    def segment_capacity(self) -> int: ...
    def free_bytes(self) -> int: ...
    def near_the_edge(self) -> bool: ...
    def segment_at(self, address: int) -> Segment: ...
    def committed_in(self, segment: Segment) -> int: ...
    def new_segment_block(self, pool: BlockPool, size: int, stream: int) -> Block | None: ...
    def moves(self, max_moved: int | None = None) -> MoveTarget: ...
    def count_compaction(self, result: CompactionResult) -> None: ...


class PressureSteps:
    """The pool's steps beyond torch's, under pressure (the caller holds the pool's lock).

    Invariant (:meth:`assert_invariants`): its :class:`~.consolidation.Consolidation`'s.
    """

    __slots__ = ("consolidation", "idle", "site")

    def __init__(self, site: PressureSite, idle: IdleKeeping) -> None:
        self.site = site
        self.idle = idle  # the pool's idle segments: which are kept, giving them back
        # when free bytes go back: the thresholds, the frees since the last compaction
        self.consolidation = Consolidation()

    def assert_invariants(self) -> None:
        self.consolidation.assert_invariants()

    # -- out of memory: compaction and releases before torch would raise --------------------

    def beyond_torch_on_oom(
        self, pool: BlockPool, size: int, alloc_size: int, stream: int
    ) -> tuple[Block | None, str]:
        """Where torch raises OutOfMemoryError: what the policy tries first (a block, or
        None and a note for the out-of-memory message)."""
        policy = self.site.policy
        if policy.tight_segments:
            tight = tight_allocation_size(size, pool.is_small)
            if tight < alloc_size:
                block = self.site.new_segment_block(pool, tight, stream)
                if block is not None:
                    return block, ""
                alloc_size = tight
        if self.site.relocator is None or not policy.compact_on_oom:
            return None, ""
        block, note = self._compact_and_retry(pool, alloc_size, stream)
        if block is None and policy.tight_segments:
            block, note = self._repack_and_retry(pool, alloc_size, stream, note)
        if block is None and policy.merge_segments:
            return self._merge_and_retry(pool, alloc_size, stream, note)
        return block, note

    def _merge_and_retry(
        self, pool: BlockPool, alloc_size: int, stream: int, note: str
    ) -> tuple[Block | None, str]:
        """No single segment could be emptied or repacked: move the blocks of several
        segments into one new segment (:func:`~.compaction.merge`: their tails together
        are whole 2 MiB units; its last block may leave a rest under 1 MiB free rather
        than grow into it) and reserve ``alloc_size`` again."""
        assert self.site.relocator is not None
        room = self.site.segment_capacity() - self.site.segment_bytes()
        needed = alloc_size - room
        if needed <= 0 or self.site.free_bytes() < needed:
            return None, note
        # the request waits: a merged segment may end in a free rest under 1 MiB
        result = merge(self.site.moves(), self.site.relocator, self.site, needed, room, exact=True)
        return self._reserve_after(result, pool, alloc_size, stream, note, "Merging segments")

    def _repack_and_retry(
        self, pool: BlockPool, alloc_size: int, stream: int, note: str
    ) -> tuple[Block | None, str]:
        """Compaction could not empty a segment: repack segments into tight new ones
        (:func:`~.compaction.repack`) and reserve ``alloc_size`` again."""
        assert self.site.relocator is not None
        needed = self.site.segment_bytes() + alloc_size - self.site.segment_capacity()
        if needed <= 0 or self.site.free_bytes() < needed:
            return None, note
        result = repack(self.site.moves(), self.site.relocator, self.site, needed)
        return self._reserve_after(result, pool, alloc_size, stream, note, "Repacking")

    def _reserve_after(
        self,
        result: CompactionResult,
        pool: BlockPool,
        alloc_size: int,
        stream: int,
        note: str,
        what: str,
    ) -> tuple[Block | None, str]:
        """Count ``result`` (``what`` made it) and reserve ``alloc_size`` again: the block,
        or None and ``note`` with what ``what`` released, for the out-of-memory message."""
        self.site.count_compaction(result)
        block = self.site.new_segment_block(pool, alloc_size, stream)
        if block is not None:
            return block, ""
        return None, note + f" {what} released {format_size(result.plan.released)}."

    def _compact_and_retry(
        self, pool: BlockPool, alloc_size: int, stream: int
    ) -> tuple[Block | None, str]:
        """Empty the least-used segments into free blocks elsewhere, release them, and
        reserve ``alloc_size`` again: the new segment's block, or None and a note for the
        out-of-memory message when compaction cannot release enough."""
        assert self.site.relocator is not None
        shortfall = self.site.segment_bytes() + alloc_size - self.site.segment_capacity()
        # within capacity the device itself refused: give back at least a segment's worth
        needed = shortfall if shortfall > 0 else alloc_size
        # a released segment was all free space before (its own, or where its blocks went):
        # with less free space than needed no plan can help, so do not stop the world to look
        # (an OOM storm of hopeless requests would otherwise stall every client each time)
        free_space = self.site.free_bytes()
        if free_space < needed:
            return None, (
                f" Compaction could release at most {format_size(free_space)} "
                f"of the {format_size(needed)} needed."
            )
        result = compact(self.site.moves(), self.site.relocator, self.site, needed)
        self.site.count_compaction(result)
        if result.plan.empty:
            return None, (
                f" Compaction could release {format_size(result.plan.released)} "
                f"of the {format_size(needed)} needed."
            )
        block = self.site.new_segment_block(pool, alloc_size, stream)
        note = f" Compaction released {format_size(result.plan.released)} and it was not enough."
        return block, "" if block is not None else note

    def _slack(self) -> int:
        """Reserved bytes no allocation uses: the free blocks of every segment."""
        return self.site.segment_bytes() - self.site.allocated_bytes

    def should_consolidate(self, alloc_size: int) -> bool:
        """Whether reserving ``alloc_size`` more would leave the device less headroom than
        the pool holds in free blocks (policy ``consolidate``; no relocator: never)."""
        if not self.site.policy.consolidate or self.site.relocator is None:
            return False
        # under a commit cap this guards the segment bound (free pages cost no room there)
        headroom = self.site.segment_capacity() - self.site.segment_bytes() - alloc_size
        return self.consolidation.should_consolidate(self.site.policy, self._slack(), headroom)

    def consolidate(self, alloc_size: int) -> None:
        """Give the pool's free blocks back to the device before it runs out: empty the
        least-used segments into holes elsewhere, then repack partly used ones into holes
        and tight new segments, at most ``max_moved_bytes`` moved by each; and where the
        room left after reserving ``alloc_size`` would not take another such segment
        (policy ``consolidate_merges``), merge large-pool segments whose tails together
        are whole 2 MiB units, while the device still has room for the merged segment."""
        assert self.site.relocator is not None
        budget = self.site.policy.max_moved_bytes
        result = compact(
            self.site.moves(max_moved=budget), self.site.relocator, self.site, self._slack()
        )
        self.site.count_compaction(result)
        result = repack(
            self.site.moves(max_moved=budget), self.site.relocator, self.site, self._slack()
        )
        self.site.count_compaction(result)
        room = self.site.segment_capacity() - self.site.segment_bytes()
        if self.site.policy.consolidate_merges and room - alloc_size < alloc_size:
            moves = self.site.moves(max_moved=budget)
            result = merge(
                moves, self.site.relocator, self.site, self._slack(), room, large_only=True
            )
            self.site.count_compaction(result)

    def _excess(self, threshold: float, slack: int | None = None, kept: int = 0) -> int:
        """Committed bytes, less ``kept``, beyond ``threshold`` x allocated, when beyond
        ``slack`` (default: the policy's min_slack)."""
        return self.consolidation.excess(
            self.site.policy,
            self.site.committed_bytes(),
            self.site.allocated_bytes,
            threshold,
            slack,
            kept,
        )

    def compaction_excess(self, kept: Mapping[int, float] | None = None) -> int:
        """What the background compactor should give back (its own threshold and slack);
        ``kept``: the kept idle segments when the caller has them (else looked up)."""
        policy = self.site.policy
        if policy.compact_threshold is None or self.site.relocator is None:
            return 0
        if kept is None:
            kept = self.idle.kept()
        committed_in = self.site.committed_in
        kept_bytes = sum(committed_in(self.site.segment_at(address)) for address in kept)
        threshold = self.consolidation.background_threshold(policy)
        return self._excess(threshold, policy.background_min_slack, kept_bytes)

    def _wake_excess(self) -> int:
        """Reserved bytes beyond the compactor's wake-up threshold (0: a free leaves it be),
        kept idle segments included (the compactor gives them back once they decay)."""
        policy = self.site.policy
        if policy.compact_threshold is None or self.site.relocator is None:
            return 0
        threshold = self.consolidation.background_threshold(policy, waking=True)
        return self._excess(threshold, policy.background_min_slack)

    def after_free(self) -> None:
        """The policy's work after a free (the caller holds the lock): give idle segments
        back, then compact, while reserved / allocated is above the thresholds.  With a
        background compactor the free only rings its doorbell; without one (a replay, a
        pool on its own) it compacts here, within max_moved_bytes, once per compact_every."""
        policy = self.site.policy
        wanted = self.site.compaction_wanted
        if wanted is not None:
            # a server, with hysteresis: below the wake-up threshold nothing happens (the
            # idle segments stay cached: reserving a segment again costs a new upstream
            # allocation and its page faults); above it idle segments go back down to it
            # (no copy, so cheap on this call) and the compactor, woken, brings reserved
            # down to its aim off this call (kept segments count here: the compactor must
            # wake to give them back later)
            excess = self._wake_excess()
            if excess:
                released = False
                if not self.idle.keeps() or (
                    self.site.near_the_edge() and not self.idle.costly_churn
                ):
                    # none kept, or near the edge: idle segments go back now, not when the
                    # compactor comes; but where giving one back waits for the whole device
                    # (costly churn) the compactor does it, off the request
                    released = self.idle.release_largest(excess)
                elif self.idle.keeps_within_a_fraction():
                    released = self.idle.release_unkept()
                if not released or self._wake_excess():
                    wanted()
            return
        if policy.release_threshold is not None:
            excess = self._excess(policy.release_threshold)
            if excess:
                self.idle.release_largest(excess)
        if policy.compact_threshold is None or self.site.relocator is None:
            return
        excess = self.consolidation.compaction_due(
            policy, self.site.committed_bytes(), self.site.allocated_bytes
        )
        if not excess:
            return
        result = compact(
            self.site.moves(max_moved=policy.max_moved_bytes),
            self.site.relocator,
            self.site,
            excess,
        )
        self.site.count_compaction(result)


def tight_allocation_size(size: int, small: bool) -> int:
    """Beyond torch: the smallest segment that serves ``size`` (the request rounded to
    2 MiB in the large pool; the small pool's 2 MiB segments are already that)."""
    if small:
        return SMALL_BUFFER
    return ROUND_LARGE * ((size + ROUND_LARGE - 1) // ROUND_LARGE)
