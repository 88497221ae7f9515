"""The pool's block cache and segment bookkeeping: PyTorch's own steps over its blocks.

:class:`BlockCache` holds one device's state (the small and large
:class:`~.blocks.BlockPool`, the segments by address, the statistics, the collaborators
beyond torch) and the steps of ``c10/cuda/CUDACachingAllocator.cpp`` that move blocks
between them, each named after torch's: ``get_free_block``, ``alloc_block``,
``alloc_found_block``, ``free_block``, ``try_merge_blocks``, ``release_block``,
``release_available_cached_blocks``, ``release_cached_blocks``.  Beside them the bounds
under a commit cap (policy ``decommit``: the capacity bounds committed bytes, not segment
bytes; the :class:`~.commit.CommitCap` admits blocks and gives pages back, its
:class:`~.commit.CommitLedger` says which went back); each step records its event in the
pool's :class:`~.history.MemoryHistory`.

It takes no lock and decides nothing beyond torch's rules: its
:class:`~.allocator.CachingPool` adds the lock and the public API, and lends its
collaborators beyond torch (:class:`~.idle.IdleKeeping`, :class:`~.pressure.PressureSteps`)
the narrow sites they act through, whose methods are written here.  One lock, the pool's,
guards every field below, the collaborators' included.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable

from tensord_server.pool.backend import (
    Backend,
    BackendOutOfDescriptors,
    BackendOutOfMemory,
    DeviceMemory,
    costly_segment_churn,
    decommitter,
)
from tensord_server.pool.blocks import (
    ALL,
    LARGE_BUFFER,
    UNLIMITED_SPLIT_SIZE,
    Block,
    BlockPool,
    Segment,
    oversize_rules_allow,
)
from tensord_server.pool.commit import Candidate, CommitCap
from tensord_server.pool.compaction import (
    Relocator,
    SegmentShape,
    segment_shape,
)
from tensord_server.pool.consolidation import Consolidation
from tensord_server.pool.history import TRACE_MAX_ENTRIES, MemoryHistory
from tensord_server.pool.idle import IdleKeeping
from tensord_server.pool.locks import CountingLock
from tensord_server.pool.pages import Span
from tensord_server.pool.policy import OOM_COMPACTION, PoolPolicy
from tensord_server.pool.stats import (
    DeviceStats,
    decrease,
    increase,
)


class BlockCache:
    """One device's blocks and segments, and torch's steps over them (the caller holds the
    pool's lock)."""

    def __init__(
        self,
        backend: Backend,
        *,
        capacity: int | None = None,
        max_split_size: int | None = None,
        record_history: bool = False,
        relocator: Relocator | None = None,
        policy: PoolPolicy = OOM_COMPACTION,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_split_size is not None and max_split_size <= LARGE_BUFFER:
            # As PYTORCH_CUDA_ALLOC_CONF's max_split_size_mb: it must exceed kLargeBuffer.
            raise ValueError(f"max_split_size too small, must be > {LARGE_BUFFER} bytes")
        if capacity is not None and capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.backend = backend
        self.device: str = backend.device
        self.capacity: int = backend.total_bytes if capacity is None else int(capacity)
        self.max_split_size: int = (
            UNLIMITED_SPLIT_SIZE if max_split_size is None else int(max_split_size)
        )
        # who may let blocks move when torch would be out of memory (None: never compact)
        self.relocator: Relocator | None = relocator
        # what the pool does beyond torch (read under the lock; may be replaced at any time)
        self.policy: PoolPolicy = policy
        # beyond torch: may veto returning a segment to the device (a GPU segment other
        # processes imported through CUDA IPC must outlive their imports); None: never vetoes
        self.segment_releasable: Callable[[DeviceMemory], bool] | None = None
        # beyond torch: the background compactor's doorbell (a leaf: it only sets an event),
        # rung after a free leaves reserved / allocated above the policy's compact_threshold;
        # None: no compactor runs, so that compaction happens on the freeing call instead
        self.compaction_wanted: Callable[[], None] | None = None
        # beyond torch: seconds, for the policy's release_idle_s (injectable: tests)
        self.clock: Callable[[], float] = clock
        # beyond torch: the bytes of wholly free segments kept warm for the policy's
        # warm_reserve_s (tensord serve --warm-reserve); 0: no reserve (a replay's pool)
        self.warm_reserve: int = 0
        # counts its waiters: the background compactor moves only while nobody waits
        self._lock = CountingLock()  # guards every field below, the collaborators' too
        self._small = BlockPool(is_small=True)
        self._large = BlockPool(is_small=False)
        self._segments: dict[int, Segment] = {}  # segment address -> segment
        self._stats = DeviceStats()
        # beyond torch (policy release_idle_s): the wholly free segments, which are kept, and
        # giving them back (over this cache as its IdleSite)
        self._idle = IdleKeeping(self, costly_segment_churn(backend))
        # beyond torch (policy decommit): the commit ledger, each segment's decommitted
        # pages and the free blocks worth decommitting, and the commit cap's steps over it
        # (over this cache as its CommitSite)
        self._commits = CommitCap(
            self, self._idle, decommitter(backend), (self._small, self._large)
        )
        # beyond torch: compaction planning's view of each segment's blocks, kept between
        # plans; a segment's entry is dropped whenever one of its blocks changes, so each
        # plan walks only the segments touched since the last
        self._shapes: dict[int, SegmentShape] = {}  # segment address -> shape
        # beyond torch: segments a background move copies from with this lock let go, each
        # with its copies in progress: none goes back to the device (its bytes are being
        # read) and none is emptied by another compaction meanwhile (not movable)
        self._copying_from: dict[Segment, int] = {}
        # beyond torch: why the backend last refused a segment for want of descriptors
        # (BackendOutOfDescriptors' message) during the malloc under way, None if it did
        # not: a malloc that fails then says descriptors ran out, not memory
        self._descriptor_refusal: str | None = None
        # alloc/free/segment events in _snapshot()'s TraceEntry form, when recording
        self._history = MemoryHistory(TRACE_MAX_ENTRIES if record_history else None)

    # -- the malloc story ---------------------------------------------------------------------

    def _get_free_block(self, pool: BlockPool, size: int, stream: int) -> Block | None:
        """Mirrors get_free_block: best fit, unless the oversize rules forbid it."""
        block = pool.best_fit(stream, size)
        if block is None or not oversize_rules_allow(block.size, size, self.max_split_size):
            return None
        pool.remove(block)
        return block

    def _alloc_block(
        self, pool: BlockPool, alloc_size: int, stream: int, *, is_retry: bool
    ) -> Block | None:
        """Mirrors alloc_block: reserve a new segment, one free block spanning it (not in the pool)."""
        if is_retry:
            self._stats.num_alloc_retries += 1
        if self._reserved() + alloc_size > self._segment_capacity():
            return None
        try:
            memory = self.backend.reserve(alloc_size)
        except BackendOutOfDescriptors as exc:
            self._descriptor_refusal = str(exc)
            return None
        except BackendOutOfMemory:
            return None
        if self._commits.caps_commit() and not self._commits.commit_room(
            self._commits.ledger.edge_pages(memory)
        ):
            self.backend.release(memory)  # its partial edge pages would not fit
            return None
        segment = Segment(memory, stream, pool.is_small)
        block = Block(memory.address, alloc_size, stream, pool, segment)
        segment.head = block
        self._segments[memory.address] = segment
        self._shapes.pop(memory.address, None)
        increase(self._stats.segment, pool.kind, 1)
        untouched = self._commits.ledger.untouched(segment) if self._commits.decommits() else 0
        increase(self._stats.reserved_bytes, pool.kind, alloc_size - untouched)
        if untouched:
            increase(self._stats.decommitted_bytes, pool.kind, untouched)
        if alloc_size >= self.max_split_size:
            self._stats.oversize_segments.increase(1)
        self._stats.num_device_alloc += 1
        self._history.record("segment_alloc", memory.address, alloc_size, stream)
        return block

    def _alloc_found_block(self, block: Block, size: int, requested: int, split: bool) -> Block:
        """Mirrors alloc_found_block: split off the front ``size`` bytes if asked, mark allocated."""
        pool = block.pool
        assert pool is not None
        kind = pool.kind
        stats = self._stats
        self._shapes.pop(block.segment.address, None)
        self._idle.left(block.segment)
        already_split = block.is_split()
        if split:
            remaining = block
            block = Block(remaining.address, size, remaining.stream, pool, remaining.segment)
            block.prev = remaining.prev
            if block.prev is not None:
                block.prev.next = block
            else:
                block.segment.head = block
            block.next = remaining
            remaining.prev = block
            remaining.address += size
            remaining.size -= size
            pool.insert(remaining)
            self._commits.note_candidate(remaining)
            if already_split:
                # An already-split free block shrinks by the bytes handed out.
                decrease(stats.inactive_split_bytes, kind, size)
            else:
                # A whole segment becomes split: its free rest is non-releasable.
                increase(stats.inactive_split_bytes, kind, remaining.size)
                increase(stats.inactive_split, kind, 1)
        elif already_split:
            # A free piece of a split segment becomes active as a whole.
            decrease(stats.inactive_split_bytes, kind, block.size)
            decrease(stats.inactive_split, kind, 1)
        block.allocated = True
        block.requested_size = requested
        self._commits.recommit(block)
        increase(stats.allocation, kind, 1)
        increase(stats.allocated_bytes, kind, block.size)
        increase(stats.active, kind, 1)
        increase(stats.active_bytes, kind, block.size)
        increase(stats.requested_bytes, kind, requested)
        if block.size >= self.max_split_size:
            stats.oversize_allocations.increase(1)
        self._history.record("alloc", block.address, requested, block.stream)
        return block

    # -- the free story -----------------------------------------------------------------------

    def _free_allocated(self, block: Block) -> None:
        """free() of a block known to be allocated here (the caller holds the lock)."""
        assert block.pool is not None and block.allocated, block
        kind = block.pool.kind
        block.allocated = False
        decrease(self._stats.allocation, kind, 1)
        decrease(self._stats.allocated_bytes, kind, block.size)
        self._history.record("free_requested", block.address, block.requested_size, block.stream)
        if block.size >= self.max_split_size:
            self._stats.oversize_allocations.decrease(1)
        self._free_block(block)

    def _free_block(self, block: Block) -> None:
        """Mirrors free_block: merge with free neighbours, cache, move the inactive_split stats."""
        pool = block.pool
        assert pool is not None
        self._history.record("free_completed", block.address, block.requested_size, block.stream)
        self._shapes.pop(block.segment.address, None)
        original_size = block.size
        requested = block.requested_size
        block.requested_size = 0
        net_blocks = 0
        net_bytes = 0
        for candidate in (block.prev, block.next):
            subsumed = self._try_merge_blocks(block, candidate, pool)
            if subsumed:
                net_blocks -= 1
                net_bytes -= subsumed
        pool.insert(block)
        if block.is_split():
            net_blocks += 1
            net_bytes += block.size
        else:
            self._idle.became_idle(block.segment)
        stats = self._stats
        kind = pool.kind
        if net_blocks > 0:
            increase(stats.inactive_split, kind, net_blocks)
        elif net_blocks < 0:
            decrease(stats.inactive_split, kind, -net_blocks)
        if net_bytes > 0:
            increase(stats.inactive_split_bytes, kind, net_bytes)
        elif net_bytes < 0:
            decrease(stats.inactive_split_bytes, kind, -net_bytes)
        decrease(stats.active, kind, 1)
        decrease(stats.active_bytes, kind, original_size)
        decrease(stats.requested_bytes, kind, requested)
        if (
            block.is_split()
            and self._commits.decommits()
            and self.policy.decommit_threshold is None
        ):
            self._commits.decommit_free_block(block)
        self._commits.note_candidate(block)

    def _try_merge_blocks(self, dst: Block, src: Block | None, pool: BlockPool) -> int:
        """Mirrors try_merge_blocks: ``dst`` absorbs its free neighbour ``src``; returns its size."""
        if src is None or src.allocated:
            return 0
        pool.remove(src)
        if dst.prev is src:  # [src dst]
            dst.address = src.address
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
            else:
                dst.segment.head = dst
        else:  # [dst src]
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        return src.size

    # -- giving segments back -----------------------------------------------------------------

    def _release_block(self, block: Block) -> None:
        """Mirrors release_block: a free block spanning its whole segment goes back to the backend."""
        pool = block.pool
        assert pool is not None and not block.is_split() and not block.allocated, block
        pool.remove(block)
        segment = block.segment
        del self._segments[segment.address]
        self._shapes.pop(segment.address, None)
        self._idle.left(segment)
        self.backend.release(segment.memory)
        # the segment and its head block point at each other: a cycle that only the cyclic
        # GC collects.  Host memory is freed with its last reference, so drop the payload
        # now, or a released segment stays resident, outside the pool's figures, until a
        # collection
        segment.memory = DeviceMemory(segment.address, segment.size)
        self._stats.num_device_free += 1
        decrease(self._stats.segment, pool.kind, 1)
        decommitted = self._commits.ledger.release(segment)
        if decommitted:
            decrease(self._stats.decommitted_bytes, pool.kind, decommitted)
        decrease(self._stats.reserved_bytes, pool.kind, block.size - decommitted)
        if block.size >= self.max_split_size:
            self._stats.oversize_segments.decrease(1)
        self._history.record("segment_free", segment.address, block.size, block.stream)

    def _release_available_cached_blocks(self, pool: BlockPool, size: int, stream: int) -> bool:
        """Mirrors release_available_cached_blocks: free just enough oversize cached segments."""
        if self.max_split_size == UNLIMITED_SPLIT_SIZE:
            return False
        target = max(size, self.max_split_size)
        keys = pool.keys
        index = bisect.bisect_left(keys, (stream, target, -1))
        for above in range(index, len(keys)):  # the smallest large enough (torch: the first)
            if keys[above][0] != stream:
                break
            if self._releasable(pool.free_blocks[keys[above][2]]):
                self._release_block(pool.free_blocks[keys[above][2]])
                return True
        # No single block is large enough: free oversize ones, the largest first.
        released = 0
        index -= 1
        while (
            released < target
            and index >= 0
            and keys[index][0] == stream
            and keys[index][1] >= self.max_split_size
        ):
            block = pool.free_blocks[keys[index][2]]
            if self._releasable(block):
                released += block.size
                self._release_block(block)  # deletes keys[index]; those below keep their places
            index -= 1
        return released >= target

    def _release_cached_blocks(self) -> bool:
        """Mirrors release_cached_blocks: every free block that spans its whole segment goes back."""
        self._stats.num_sync_all_streams += 1
        for pool in (self._large, self._small):
            for block in [pool.free_blocks[key[2]] for key in pool.keys]:
                if not block.is_split() and self._releasable(block):
                    self._release_block(block)
        return True

    def _releasable_segment(self, segment: Segment) -> bool:
        """Whether ``segment``, once wholly free, may go back to the device now."""
        if segment in self._copying_from:
            return False
        veto = self.segment_releasable
        return veto is None or veto(segment.memory)

    def _releasable(self, block: Block) -> bool:
        """Whether the segment of a whole free block may go back to the device now."""
        return self._releasable_segment(block.segment)

    # -- the cache's side of its collaborators (IdleSite, CommitSite, PressureSite) -----------

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the blocks allocated now (no lock): what the tiers' watermarks measure."""
        return self._allocated()

    def compacts_in_background(self) -> bool:
        """Whether a background compactor may give back what a free leaves (a doorbell is
        set, the policy has a compact_threshold, and blocks may move)."""
        return (
            self.compaction_wanted is not None
            and self.policy.compact_threshold is not None
            and self.relocator is not None
        )

    def near_the_edge(self) -> bool:
        """Whether the device is used beyond the policy's keep_idle_below (no idle segment
        is kept there)."""
        return Consolidation.near_the_edge(self.policy, self._capacity_used(), self.capacity)

    def segment_at(self, address: int) -> Segment:
        """The live segment at ``address``."""
        return self._segments[address]

    def has_whole_free_block(self) -> bool:
        """Whether some free block spans its whole segment: the free blocks of a pool less
        those of split segments (stat ``inactive_split``), in O(1)."""
        split = self._stats.inactive_split
        return any(len(pool.keys) > split[pool.kind].current for pool in (self._large, self._small))

    def whole_free_blocks(self) -> list[Block]:
        """The free blocks that span their whole segment: the large pool's, then the small
        pool's, each by (stream, size, address)."""
        return [
            block
            for pool in (self._large, self._small)
            for block in (pool.free_blocks[key[2]] for key in pool.keys)
            if not block.is_split()
        ]

    def releasable_segment(self, segment: Segment) -> bool:
        """Whether ``segment``, once wholly free, may go back to the device now."""
        return self._releasable_segment(segment)

    def release_free_segment(self, address: int) -> None:
        """Give the wholly free segment at ``address`` back to the device."""
        head = self._segments[address].head
        assert head is not None and not head.allocated and not head.is_split(), head
        self._release_block(head)

    def committed_bytes(self) -> int:
        """Reserved bytes less decommitted ones (``reserved_bytes``)."""
        return self._committed()

    def segment_bytes(self) -> int:
        """Bytes of every segment, decommitted pages included."""
        return self._reserved()

    def segment_capacity(self) -> int:
        """What segment bytes may reach."""
        return self._segment_capacity()

    def free_bytes(self) -> int:
        """The bytes of every free block, of both pools."""
        return self._small.free_bytes() + self._large.free_bytes()

    def new_segment_block(self, pool: BlockPool, size: int, stream: int) -> Block | None:
        """Reserve a new segment of ``size`` bytes for ``pool``: its one free block (not in
        the pool), or None when the device refuses (alloc_block, not a retry)."""
        return self._alloc_block(pool, size, stream, is_retry=False)

    def count_decommitted(self, block: Block, nbytes: int, ranges: int) -> None:
        """``nbytes`` of the free ``block``'s pages went back, in ``ranges`` backend calls."""
        assert block.pool is not None
        decrease(self._stats.reserved_bytes, block.pool.kind, nbytes)
        increase(self._stats.decommitted_bytes, block.pool.kind, nbytes)
        self._stats.num_decommits += ranges

    def count_recommitted(self, block: Block, nbytes: int) -> None:
        """``nbytes`` of decommitted pages under the allocated ``block`` count as reserved
        again."""
        assert block.pool is not None
        decrease(self._stats.decommitted_bytes, block.pool.kind, nbytes)
        increase(self._stats.reserved_bytes, block.pool.kind, nbytes)

    def committed_in(self, segment: Segment) -> int:
        """``segment``'s committed bytes (its size less its decommitted pages)."""
        return self._commits.ledger.committed_in(segment)

    # -- beyond torch: the bounds under a commit cap (CommitCap) --------------------------------

    def _segment_capacity(self) -> int:
        """What segment bytes may reach: the capacity, or under a commit cap the policy's
        virtual_capacity_factor x capacity (address space, memfds)."""
        if not self._commits.caps_commit():
            return self.capacity
        return int(self.capacity * self.policy.virtual_capacity_factor)

    def _capacity_used(self) -> int:
        """The bytes the capacity bounds: committed ones under a commit cap, else segments'."""
        return self._committed() if self._commits.caps_commit() else self._reserved()

    # -- what tests inspect of the commit ledger ----------------------------------------------

    @property
    def _decommitted(self) -> dict[int, list[Span]]:
        """The ledger's decommitted ranges, by segment address."""
        return self._commits.ledger.spans

    @property
    def _decommit_candidates(self) -> list[Candidate]:
        """The ledger's decommit candidates (a heap)."""
        return self._commits.ledger.candidates

    # -- helpers ------------------------------------------------------------------------------

    def _allocated(self) -> int:
        return self._stats.allocated_bytes[ALL].current

    def _reserved(self) -> int:
        """Bytes of every segment, decommitted pages included: what capacity bounds."""
        stats = self._stats
        return stats.reserved_bytes[ALL].current + stats.decommitted_bytes[ALL].current

    def _committed(self) -> int:
        """Reserved bytes less decommitted ones (``reserved_bytes``): what the device
        gave the pool and other programs cannot have, what the thresholds measure."""
        return self._stats.reserved_bytes[ALL].current

    def _segment_shape(self, segment: Segment) -> SegmentShape:
        """Planning's view of ``segment``'s blocks: the kept one, or a fresh walk kept."""
        shape = self._shapes.get(segment.address)
        if shape is None:
            shape = self._shapes[segment.address] = segment_shape(segment)
        return shape
