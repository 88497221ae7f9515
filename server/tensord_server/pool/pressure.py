"""What the pool does beyond PyTorch under pressure, and how it says it is out of memory.

Where torch would raise OutOfMemoryError, :class:`PressureSteps` first runs what the
pool's :class:`~.policy.PoolPolicy` asks for: a tight segment, then compaction, repacking
and merging of segments (planned and executed by :mod:`.compaction` through a
:class:`~.compaction.MoveTarget`), each followed by a retry of the reservation.  Before a
segment is reserved near the device's edge it consolidates; after a free it gives idle
segments back, or keeps them for a while (:class:`~.idle.IdleKeeping`), and compacts or
rings the background compactor; :class:`~.consolidation.Consolidation` holds the
thresholds.  It words the out-of-memory (and out-of-descriptors) errors, the pool's
figures as their details.

Every step runs under the pool's lock, over the state and the steps of
:class:`~.cache.BlockCache`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NoReturn

from tensord.errors import OutOfMemoryError, ResourceExhaustedError

from tensord_server.pool.blocks import (
    ALL,
    ROUND_LARGE,
    SMALL_BUFFER,
    Block,
    BlockPool,
    format_size,
    get_allocation_size,
    is_small_size,
    round_size,
)
from tensord_server.pool.cache import BlockCache
from tensord_server.pool.compaction import (
    CompactionResult,
    MoveTarget,
    compact,
    merge,
    repack,
)


class PressureSteps(BlockCache):
    """The pool's steps beyond torch's, under pressure (the caller holds the pool's lock)."""

    def _moves(self, max_moved: int | None = None) -> MoveTarget:
        """The target a compaction executes its plan through, at most ``max_moved`` bytes
        copied by one plan (None: no bound): the pool's (:class:`~.moves.PoolMoves`)."""
        raise NotImplementedError

    # -- out of memory ------------------------------------------------------------------------

    def _out_of_memory(
        self, message: str, figures: dict[str, Any], size: int, stream: int, count: bool
    ) -> NoReturn:
        """Count and record an out-of-memory (where ``count``), and raise it with the pool's
        ``figures`` as its details (the caller holds the lock)."""
        if count:
            self._count_oom(size, stream)
        raise OutOfMemoryError(message, **figures)

    def _count_oom(self, size: int, stream: int) -> None:
        self._stats.num_ooms += 1
        self._history.record("oom", self.capacity - self._capacity_used(), size, stream)

    def _out_of_descriptors(self, nbytes: int, refusal: str) -> NoReturn:
        """Raise the failure of a malloc whose new segment found no descriptor: the pool
        may have all the memory asked for, and an out-of-memory would send the operator
        after the wrong limit (the caller holds the lock)."""
        free = max(self.capacity - self._capacity_used(), 0)
        raise ResourceExhaustedError(
            f"{self.device} cannot allocate {format_size(nbytes)}: {refusal}. A new segment "
            f"needs file descriptors; the pool is not out of memory ({format_size(free)} of "
            f"{format_size(self.capacity)} free), and allocations succeed again once the "
            "server's descriptors are freed."
        )

    def _beyond_any_room(self, size: int) -> bool:
        """Under a commit cap, whether no path can serve ``size`` bytes, so none is tried:
        committed bytes are never fewer than allocated ones (decommitted pages lie inside
        free blocks) and a block adds at least ``size`` to those, so with allocated +
        ``size`` beyond capacity neither a free block, a new segment, pages given back nor
        compaction can make the room, and walking them all under the lock would hold up
        every other request for a request that cannot be served.  Under PyTorch's rules
        (capacity on segment bytes) the paths run as PyTorch's do, and
        ``num_alloc_retries`` counts as theirs."""
        if not self._caps_commit():
            return False
        return self._allocated() + size > self.capacity

    def _oom_figures(self, nbytes: int) -> dict[str, Any]:
        """The pool's figures an out-of-memory of ``nbytes`` names: its message's numbers,
        and the details of its OutOfMemoryError (tensord.errors)."""
        allocated = self._stats.allocated_bytes[ALL].current
        reserved = self._capacity_used()  # committed bytes where those are what capacity bounds
        return {
            "device": str(self.device),
            "requested_bytes": nbytes,
            "capacity_bytes": self.capacity,
            "free_bytes": max(self.capacity - reserved, 0),
            "allocated_bytes": allocated,
            "reserved_bytes": reserved,
        }

    def _oom_message(self, figures: dict[str, Any]) -> str:
        """PyTorch's out-of-memory message, with tensord's names.

        PyTorch names the segment size it tried to reserve; the bytes the caller
        asked for are what an operator can act on, so those are named here.
        """
        nbytes, allocated = figures["requested_bytes"], figures["allocated_bytes"]
        reserved = figures["reserved_bytes"]
        message = (
            f"{self.device} out of memory. Tried to allocate {format_size(nbytes)}. "
            f"Device {self.device} has a total capacity of {format_size(self.capacity)} "
            f"of which {format_size(figures['free_bytes'])} is free. "
            f"Of the allocated memory {format_size(allocated)} is allocated by tensord, "
            f"and {format_size(reserved - allocated)} is reserved by tensord but unallocated."
        )
        if not self._caps_commit():
            return message  # PyTorch's, word for word: capacity bounds segment bytes
        # under a commit cap "free" counts pages given back inside segments; a request
        # that needs a new segment may still fail on the segments' own bound: say so
        size = round_size(nbytes)
        smallest = get_allocation_size(size)
        if self.policy.tight_segments:
            smallest = min(smallest, tight_allocation_size(size, is_small_size(size)))
        spanned, bound = self._reserved(), self._segment_capacity()
        if spanned + smallest <= bound:
            return message
        return message + (
            f" The free bytes are pages given back inside tensord's segments, which span "
            f"{format_size(spanned)} of the {format_size(bound)} they may reach "
            f"(virtual_capacity_factor {self.policy.virtual_capacity_factor:g} x the total "
            f"capacity): a new {format_size(smallest)} segment would pass that bound."
        )

    # -- beyond torch: compaction and releases under pressure (Consolidation) -----------------

    def _beyond_torch_on_oom(
        self, pool: BlockPool, size: int, alloc_size: int, stream: int
    ) -> tuple[Block | None, str]:
        """Where torch raises OutOfMemoryError: what the policy tries first (a block, or
        None and a note for the out-of-memory message)."""
        policy = self.policy
        if policy.tight_segments:
            tight = tight_allocation_size(size, pool.is_small)
            if tight < alloc_size:
                block = self._alloc_block(pool, tight, stream, is_retry=False)
                if block is not None:
                    return block, ""
                alloc_size = tight
        if self.relocator is None or not policy.compact_on_oom:
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
        assert self.relocator is not None
        room = self._segment_capacity() - self._reserved()
        needed = alloc_size - room
        if needed <= 0 or self._small.free_bytes() + self._large.free_bytes() < needed:
            return None, note
        # the request waits: a merged segment may end in a free rest under 1 MiB
        result = merge(self._moves(), self.relocator, self, needed, room, exact=True)
        return self._reserve_after(result, pool, alloc_size, stream, note, "Merging segments")

    def _repack_and_retry(
        self, pool: BlockPool, alloc_size: int, stream: int, note: str
    ) -> tuple[Block | None, str]:
        """Compaction could not empty a segment: repack segments into tight new ones
        (:func:`~.compaction.repack`) and reserve ``alloc_size`` again."""
        assert self.relocator is not None
        needed = self._reserved() + alloc_size - self._segment_capacity()
        if needed <= 0 or self._small.free_bytes() + self._large.free_bytes() < needed:
            return None, note
        result = repack(self._moves(), self.relocator, self, needed)
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
        self._count_result(result)
        block = self._alloc_block(pool, alloc_size, stream, is_retry=False)
        if block is not None:
            return block, ""
        return None, note + f" {what} released {format_size(result.plan.released)}."

    def _compact_and_retry(
        self, pool: BlockPool, alloc_size: int, stream: int
    ) -> tuple[Block | None, str]:
        """Empty the least-used segments into free blocks elsewhere, release them, and
        reserve ``alloc_size`` again: the new segment's block, or None and a note for the
        out-of-memory message when compaction cannot release enough."""
        assert self.relocator is not None
        shortfall = self._reserved() + alloc_size - self._segment_capacity()
        # within capacity the device itself refused: give back at least a segment's worth
        needed = shortfall if shortfall > 0 else alloc_size
        # a released segment was all free space before (its own, or where its blocks went):
        # with less free space than needed no plan can help, so do not stop the world to look
        # (an OOM storm of hopeless requests would otherwise stall every client each time)
        free_space = self._small.free_bytes() + self._large.free_bytes()
        if free_space < needed:
            return None, (
                f" Compaction could release at most {format_size(free_space)} "
                f"of the {format_size(needed)} needed."
            )
        result = compact(self._moves(), self.relocator, self, needed)
        self._count_result(result)
        if result.plan.empty:
            return None, (
                f" Compaction could release {format_size(result.plan.released)} "
                f"of the {format_size(needed)} needed."
            )
        block = self._alloc_block(pool, alloc_size, stream, is_retry=False)
        note = f" Compaction released {format_size(result.plan.released)} and it was not enough."
        return block, "" if block is not None else note

    def _slack(self) -> int:
        """Reserved bytes no allocation uses: the free blocks of every segment."""
        return self._reserved() - self._allocated()

    def _should_consolidate(self, alloc_size: int) -> bool:
        """Whether reserving ``alloc_size`` more would leave the device less headroom than
        the pool holds in free blocks (policy ``consolidate``; no relocator: never)."""
        if not self.policy.consolidate or self.relocator is None:
            return False
        # under a commit cap this guards the segment bound (free pages cost no room there)
        headroom = self._segment_capacity() - self._reserved() - alloc_size
        return self._consolidation.should_consolidate(self.policy, self._slack(), headroom)

    def _consolidate(self, alloc_size: int) -> None:
        """Give the pool's free blocks back to the device before it runs out: empty the
        least-used segments into holes elsewhere, then repack partly used ones into holes
        and tight new segments, at most ``max_moved_bytes`` moved by each; and where the
        room left after reserving ``alloc_size`` would not take another such segment
        (policy ``consolidate_merges``), merge large-pool segments whose tails together
        are whole 2 MiB units, while the device still has room for the merged segment."""
        assert self.relocator is not None
        budget = self.policy.max_moved_bytes
        result = compact(self._moves(max_moved=budget), self.relocator, self, self._slack())
        self._count_result(result)
        result = repack(self._moves(max_moved=budget), self.relocator, self, self._slack())
        self._count_result(result)
        room = self._segment_capacity() - self._reserved()
        if self.policy.consolidate_merges and room - alloc_size < alloc_size:
            moves = self._moves(max_moved=budget)
            result = merge(moves, self.relocator, self, self._slack(), room, large_only=True)
            self._count_result(result)

    def _count_result(self, result: CompactionResult) -> None:
        """A compaction counts once, when it gives segments back; bytes it moved count even
        when it gave none back (a move that found no room to commit ended its plan)."""
        if result.plan.evacuated:
            self._count_compaction(result.moved, result.plan.released)
        else:
            self._stats.compaction_moved_bytes += result.moved

    def _count_compaction(self, moved: int, released: int) -> None:
        stats = self._stats
        stats.num_compactions += 1
        stats.compaction_moved_bytes += moved
        stats.compaction_released_bytes += released

    def _excess(self, threshold: float, slack: int | None = None, kept: int = 0) -> int:
        """Committed bytes, less ``kept``, beyond ``threshold`` x allocated, when beyond
        ``slack`` (default: the policy's min_slack)."""
        return self._consolidation.excess(
            self.policy, self._committed(), self._allocated(), threshold, slack, kept
        )

    def _compaction_excess(self, kept: Mapping[int, float] | None = None) -> int:
        """What the background compactor should give back (its own threshold and slack);
        ``kept``: the kept idle segments when the caller has them (else looked up)."""
        policy = self.policy
        if policy.compact_threshold is None or self.relocator is None:
            return 0
        if kept is None:
            kept = self._idle.kept()
        committed_in = self._ledger.committed_in
        kept_bytes = sum(committed_in(self._segments[address]) for address in kept)
        threshold = self._consolidation.background_threshold(policy)
        return self._excess(threshold, policy.background_min_slack, kept_bytes)

    def _wake_excess(self) -> int:
        """Reserved bytes beyond the compactor's wake-up threshold (0: a free leaves it be),
        kept idle segments included (the compactor gives them back once they decay)."""
        policy = self.policy
        if policy.compact_threshold is None or self.relocator is None:
            return 0
        threshold = self._consolidation.background_threshold(policy, waking=True)
        return self._excess(threshold, policy.background_min_slack)

    def _after_free(self) -> None:
        """The policy's work after a free (the caller holds the lock): give idle segments
        back, then compact, while reserved / allocated is above the thresholds.  With a
        background compactor the free only rings its doorbell; without one (a replay, a
        pool on its own) it compacts here, within max_moved_bytes, once per compact_every."""
        policy = self.policy
        wanted = self.compaction_wanted
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
                if not self._idle.keeps() or (self.near_the_edge() and not self._idle.costly_churn):
                    # none kept, or near the edge: idle segments go back now, not when the
                    # compactor comes; but where giving one back waits for the whole device
                    # (costly churn) the compactor does it, off the request
                    released = self._idle.release_largest(excess)
                elif self._idle.keeps_within_a_fraction():
                    released = self._idle.release_unkept()
                if not released or self._wake_excess():
                    wanted()
            return
        if policy.release_threshold is not None:
            excess = self._excess(policy.release_threshold)
            if excess:
                self._idle.release_largest(excess)
        if policy.compact_threshold is None or self.relocator is None:
            return
        excess = self._consolidation.compaction_due(policy, self._committed(), self._allocated())
        if not excess:
            return
        result = compact(
            self._moves(max_moved=policy.max_moved_bytes), self.relocator, self, excess
        )
        self._count_result(result)


def tight_allocation_size(size: int, small: bool) -> int:
    """Beyond torch: the smallest segment that serves ``size`` (the request rounded to
    2 MiB in the large pool; the small pool's 2 MiB segments are already that)."""
    if small:
        return SMALL_BUFFER
    return ROUND_LARGE * ((size + ROUND_LARGE - 1) // ROUND_LARGE)
