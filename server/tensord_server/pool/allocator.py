"""The caching pool: PyTorch's native CUDA caching allocator, its statistics and snapshots.

Every Storage the server holds lives in a Block of this pool.  The policy
mirrors ``c10/cuda/CUDACachingAllocator.cpp`` (DeviceCachingAllocator) rule for
rule, so its figures can be compared with PyTorch's on the same trace:

- ``malloc``: round the size (``round_size``) -> pick the small or large pool
  -> best fit by (stream, size, address) (``get_free_block``, with the
  ``max_split_size`` oversize rules) || a new segment (``alloc_block``) ||
  release oversize cached segments and retry || release every whole cached
  segment and retry (counted in ``num_alloc_retries``) || out of memory ->
  split the block if the remainder is worth keeping (``should_split``).
- ``free``: merge with the free previous neighbour, then the next one (never
  across segments: neighbours are links inside one segment) -> back into its pool.
- Segments go back to the backend only in ``empty_cache`` and on the
  out-of-memory path.

Beyond torch, only as the pool's :class:`~.policy.PoolPolicy` says (``pytorch``: never;
the default ``oom-compaction``: compaction on the OOM path only), each extension kept by a
collaborator that owns its fields and invariants:

- compaction (only with a ``relocator``): the owner of the blocks stops the world,
  movable blocks of the least-used segments move into free blocks of other segments,
  the emptied segments go back to the backend.  Planning and execution live in
  :mod:`.compaction`; the pool lends it a narrow :class:`~.compaction.MoveTarget`
  (:class:`PoolMoves`).  It runs where torch would be out of memory (then the
  reservation is retried), before reserving a segment near the device's edge, and after
  frees, in the freeing call or in a background compactor's steps;
  :class:`~.consolidation.Consolidation` holds the thresholds that say when and how
  much.  Clients hold handles, not pointers, so nothing outside the server notices;
- tight segments on the out-of-memory path, idle segments given back after a free
  (policy ``tight_segments``, ``release_threshold``);
- idle segments kept for a while before they go back (policy ``release_idle_s``:
  :class:`~.idle.IdleSegments`), a bounded warm reserve of them for longer (policy
  ``warm_reserve_s``, the pool's ``warm_reserve`` bytes);
- free page ranges of split segments given back to the device, the segment kept
  (policy ``decommit``, on backends that can: :class:`~.commit.CommitLedger`): then
  ``reserved_bytes`` counts committed bytes, capacity bounds committed bytes (free pages
  elsewhere are given back to make room before anything else) and segment bytes have
  their own bound, ``virtual_capacity_factor`` x capacity.

Without a relocator and under ``pytorch`` nothing differs from torch.

Statistics keep torch's ``memory_stats()`` names and move exactly as torch's
do (``inactive_split`` counts free pieces of split segments; a block that is
not split counts whole in ``allocated_bytes``); only the pool counts them, from what
its collaborators return.  One lock guards everything, the collaborators' fields
included (they are called with it held): many gRPC threads call the pool at once.
"""

from __future__ import annotations

import bisect
import contextlib
import time
from collections import deque
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import replace
from typing import Any, NamedTuple, NoReturn, Protocol

from tensord.errors import InvalidArgumentError, OutOfMemoryError, ResourceExhaustedError

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
    LARGE_POOL,
    MIN_BLOCK_SIZE,
    NULL_SEGMENT,
    ROUND_LARGE,
    SMALL_BUFFER,
    SMALL_POOL,
    STAT_TYPE_NAMES,
    UNLIMITED_SPLIT_SIZE,
    Block,
    BlockPool,
    Segment,
    device_index,
    format_size,
    get_allocation_size,
    is_small_size,
    oversize_rules_allow,
    round_size,
    should_split,
)
from tensord_server.pool.commit import DECOMMIT_SCAN_LIMIT, Candidate, CommitLedger
from tensord_server.pool.compaction import (
    CompactionResult,
    MoveTarget,
    Relocator,
    SegmentShape,
    SegmentUsage,
    blocks_may_move,
    compact,
    compact_step,
    merge,
    repack,
    segment_shape,
)
from tensord_server.pool.consolidation import Consolidation
from tensord_server.pool.idle import IdleSegments
from tensord_server.pool.locks import CountingLock
from tensord_server.pool.pages import Span
from tensord_server.pool.policy import OOM_COMPACTION, PoolPolicy
from tensord_server.pool.stats import (
    STAT_ARRAY_NAMES,
    DeviceStats,
    decrease,
    external_fragmentation,
    format_summary,
    increase,
    segment_info,
    segment_part_info,
    stat_items,
)

TRACE_MAX_ENTRIES = 100_000  # _record_memory_history's default max_entries (a ring buffer)


class SegmentsPart(NamedTuple):
    """A run of a snapshot's segments, by address (CachingPool.snapshot_segments)."""

    segments: list[dict[str, Any]]  # segment_info dicts; the first and last may be partial
    last_complete: bool  # the last holds all its blocks after the place asked for
    more: bool  # segments (or blocks of the last) follow


# ---------------------------------------------------------------------------
# The pool


class CachingPool:
    """One device's caching allocator (torch's DeviceCachingAllocator); thread-safe."""

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
        # beyond torch (policy decommit): each segment's decommitted pages, and the free
        # blocks worth decommitting
        self._ledger = CommitLedger(decommitter(backend), (self._small, self._large))
        # beyond torch (policy release_idle_s): the wholly free segments, and which are kept
        self._idle = IdleSegments(costly_segment_churn(backend))
        # beyond torch: when free bytes go back (consolidation, thresholds after a free)
        self._consolidation = Consolidation()
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
        self._trace: deque[dict[str, Any]] | None = (
            deque(maxlen=TRACE_MAX_ENTRIES) if record_history else None
        )
        self._trace_recorded = 0  # entries ever appended: the next entry's sequence number

    # -- public API ---------------------------------------------------------

    def malloc(self, nbytes: int, stream: int = 0) -> Block:
        """Mirrors DeviceCachingAllocator::malloc.  Raises OutOfMemoryError (or, beyond torch,
        ResourceExhaustedError where a new segment found no file descriptor)."""
        if nbytes < 0:
            raise InvalidArgumentError(f"cannot allocate a negative number of bytes: {nbytes}")
        if nbytes == 0:
            return Block(0, 0, stream, None, NULL_SEGMENT)
        with self._lock:
            self._descriptor_refusal = None
            size = round_size(nbytes)
            pool = self._small if is_small_size(size) else self._large
            alloc_size = get_allocation_size(size)
            if self._beyond_any_room(size):
                figures = self._oom_figures(nbytes)
                self._out_of_memory(self._oom_message(figures), figures, size, stream)
            # each block found must have room to commit its pages (_admit: always, unless
            # the capacity bounds committed bytes), else it goes back and the next path runs
            block = self._admit(self._get_free_block(pool, size, stream), size)
            if block is None and self._should_consolidate(alloc_size):
                self._consolidate()
            if block is None:
                block = self._admit(
                    self._alloc_block(pool, alloc_size, stream, is_retry=False), size
                )
            if block is None and self._release_available_cached_blocks(pool, size, stream):
                block = self._admit(
                    self._alloc_block(pool, alloc_size, stream, is_retry=False), size
                )
            if block is None:
                self._release_cached_blocks()
                block = self._admit(
                    self._alloc_block(pool, alloc_size, stream, is_retry=True), size
                )
            if block is None:
                figures = self._oom_figures(nbytes)  # as they stand before the extra paths
                message = self._oom_message(figures)
                block, note = self._beyond_torch_on_oom(pool, size, alloc_size, stream)
                block = self._admit(block, size)
                message += note
            if block is None and self._descriptor_refusal is not None:
                self._out_of_descriptors(nbytes, self._descriptor_refusal)
            if block is None:
                self._out_of_memory(message, figures, size, stream)
            split = should_split(block.size, size, pool.is_small, self.max_split_size)
            return self._alloc_found_block(block, size, nbytes, split)

    def _out_of_memory(
        self, message: str, figures: dict[str, Any], size: int, stream: int
    ) -> NoReturn:
        """Count and record an out-of-memory, and raise it with the pool's ``figures`` as its
        details (the caller holds the lock)."""
        self._stats.num_ooms += 1
        self._record("oom", self.capacity - self._capacity_used(), size, stream)
        raise OutOfMemoryError(message, **figures)

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

    def free(self, block: Block) -> None:
        """Mirrors DeviceCachingAllocator::free (no cross-stream uses: free completes at once)."""
        if block.segment is NULL_SEGMENT:
            return  # a zero-byte block holds no pool memory
        with self._lock:
            if (
                not block.allocated
                or self._segments.get(block.segment.address) is not block.segment
            ):
                raise InvalidArgumentError(f"invalid device pointer: {block.address:#x}")
            self._free_allocated(block)
            if self._decommits() and self.policy.decommit_threshold is not None:
                self._decommit_excess(self.policy.decommit_threshold)
            if self.policy.acts_after_free:
                self._after_free()

    def empty_cache(self) -> None:
        """Return every whole free segment to the backend (torch.cuda.empty_cache)."""
        with self._lock:
            self._release_cached_blocks()

    def memory_stats(self) -> dict[str, int | float]:
        """torch.cuda.memory_stats(): flat, sorted, same key names, plus free-block figures."""
        with self._lock:
            result: dict[str, int | float] = {}
            for name, array in self._stats.arrays().items():
                for kind, kind_name in enumerate(STAT_TYPE_NAMES):
                    result.update(stat_items(f"{name}.{kind_name}", array[kind]))
            result.update(stat_items("oversize_allocations", self._stats.oversize_allocations))
            result.update(stat_items("oversize_segments", self._stats.oversize_segments))
            for counter in (
                "num_alloc_retries",
                "num_ooms",
                "num_sync_all_streams",
                "num_device_alloc",
                "num_device_free",
                "num_compactions",
                "compaction_moved_bytes",
                "compaction_released_bytes",
                "num_decommits",
            ):
                result[counter] = getattr(self._stats, counter)
            for kind, kind_name in enumerate(STAT_TYPE_NAMES):
                decommitted = self._stats.decommitted_bytes[kind]
                result.update(stat_items(f"decommitted_bytes.{kind_name}", decommitted))
            # torch reports SIZE_MAX as int64, i.e. -1, when max_split_size is unset.
            unlimited = self.max_split_size == UNLIMITED_SPLIT_SIZE
            result["max_split_size"] = -1 if unlimited else self.max_split_size
            result.update(self._free_block_figures())
            return dict(sorted(result.items()))

    @property
    def lock_waiters(self) -> int:
        """Threads blocked on this pool's lock now (the background compactor steps aside)."""
        return self._lock.waiting

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the blocks allocated now (no lock): what the tiers' watermarks measure."""
        return self._allocated()

    @property
    def reserved_bytes(self) -> int:
        """Bytes of the segments reserved now, decommitted pages included (no lock): under a
        commit cap up to the policy's virtual_capacity_factor x capacity."""
        return self._reserved()

    def reserved_ratio(self) -> float:
        """reserved / allocated now, without the lock (a few int reads: a moment's estimate,
        enough for the compactor to choose how hard to work); 0.0 with nothing allocated.
        Reserved is committed bytes (``reserved_bytes.all.current``)."""
        allocated = self._allocated()
        return self._committed() / allocated if allocated else 0.0

    def compaction_excess(self) -> int:
        """Reserved bytes beyond the policy's compact_threshold x allocated (0: nothing to do,
        no threshold, or no relocator)."""
        with self._lock:
            return self._compaction_excess()

    def compact_step(
        self, max_moved: int, proceed: Callable[[], bool] = lambda: False
    ) -> int | None:
        """One background compaction step (:func:`~.compaction.compact_step`): one plan of
        at most ``max_moved`` bytes, its first Storage moved and the next ones while
        ``proceed()``, and segments left wholly free go back; this pool's lock (and the
        relocator's) is let go while each move copies (:meth:`PoolMoves.copying`).
        Returns the bytes copied (a move that gave up, its copy wasted, included: the
        background compactor paces and budgets copies), or None when there is nothing
        (more) to do."""
        with self._lock:
            kept = self._kept_idle_segments()
            excess = self._compaction_excess(kept)
            if not excess or max_moved <= 0:
                return None
            assert self.relocator is not None
            moves = PoolMoves(self, max_moved=max_moved, hidden=set(kept))
            result = compact_step(moves, self.relocator, self, excess, proceed)
            plan = result.plan
            if not plan.moves and not plan.evacuated:
                return None
            stats = self._stats
            stats.compaction_moved_bytes += result.moved
            if plan.evacuated:  # a compaction counts once, when it gives segments back
                self._count_compaction(0, plan.released)
            # the bytes copied, a move that gave up included: what the caller paces
            return result.moved + result.wasted

    def idle_release_delay(self) -> float | None:
        """Seconds (of the pool's clock) until the background compactor should look again
        for idle segments to give back (policy ``release_idle_s``): 0 when some may go back
        now and are in excess (they decayed while it was not looking: waiting only for the
        kept ones, it would have slept on, with them reserved, until the next doorbell),
        else until the first kept one may go back; None when there is nothing to wait for."""
        with self._lock:
            if not self._keeps_idle_segments():
                return None
            kept = self._kept_idle_segments()
            decayed = (
                address
                for address in self._idle
                if address not in kept and self._releasable_segment(self._segments[address])
            )
            if any(decayed) and self._compaction_excess(kept):
                return 0.0
            return max(0.0, min(kept.values()) - self.clock()) if kept else None

    @property
    def num_compactions(self) -> int:
        """memory_stats()["num_compactions"] without building the whole dict: cheap enough to
        read after every call (one int read is atomic, so no lock is taken)."""
        return self._stats.num_compactions

    def reset_peak_memory_stats(self) -> None:
        with self._lock:
            for stat in self._stats.all_stats():
                stat.peak = stat.current

    def reset_accumulated_memory_stats(self) -> None:
        with self._lock:
            for stat in self._stats.all_stats():
                stat.allocated = 0
                stat.freed = 0
            stats = self._stats
            stats.num_alloc_retries = stats.num_ooms = stats.num_sync_all_streams = 0
            stats.num_device_alloc = stats.num_device_free = 0
            stats.num_compactions = stats.compaction_moved_bytes = 0
            stats.compaction_released_bytes = stats.num_decommits = 0

    def memory_summary(self, abbreviated: bool = False) -> str:
        """torch.cuda.memory_summary()'s table, for this pool."""
        return format_summary(self.memory_stats(), self.device, abbreviated)

    def record_memory_history(self, enabled: bool, max_entries: int = TRACE_MAX_ENTRIES) -> None:
        """torch.cuda.memory._record_memory_history: while enabled, alloc, free and segment
        events go into the snapshot's device trace (a ring buffer of the last
        ``max_entries``), which ``tensord replay`` runs.  Enabling again starts afresh."""
        with self._lock:
            self._trace = deque(maxlen=max_entries) if enabled else None

    def memory_snapshot(self) -> dict[str, Any]:
        """torch.cuda.memory._snapshot()'s structure: picklable, readable by memory_viz."""
        with self._lock:
            index = device_index(self.device)
            segments = [
                segment_info(segment, index) for _, segment in sorted(self._segments.items())
            ]
            total_active = sum(info["active_size"] for info in segments)
            self._record("snapshot", 0, total_active, 0)
            return {
                "segments": segments,
                "device_traces": [list(self._trace) if self._trace is not None else []],
                "allocator_settings": self._allocator_settings(),
            }

    # memory_snapshot a piece at a time, for answers of bounded size: begin, then segments
    # after a place, then trace entries up to the end begin gave

    def snapshot_begin(self) -> tuple[dict[str, Any], int]:
        """Start a paged snapshot: record its trace entry (as memory_snapshot does); the
        allocator settings, and the sequence number that ends this snapshot's trace."""
        with self._lock:
            self._record("snapshot", 0, self._stats.allocated_bytes[ALL].current, 0)
            return self._allocator_settings(), self._trace_recorded

    def snapshot_segments(
        self, after: int, after_block: int | None, max_segments: int, max_blocks: int
    ) -> SegmentsPart:
        """segment_info of the segments after the place (``after``, ``after_block``), by
        address: with ``after_block`` None the segments above ``after``; else first the blocks
        of the segment at ``after`` above ``after_block`` (if it still exists).  At most
        ``max_segments`` segments and ``max_blocks`` blocks together (at least one block)."""
        with self._lock:
            index = device_index(self.device)
            addresses = sorted(self._segments)
            start = bisect.bisect_left(addresses, after)
            if after_block is None or start == len(addresses) or addresses[start] != after:
                start = bisect.bisect_right(addresses, after)
                after_block = None
            segments: list[dict[str, Any]] = []
            complete = True
            left = max(max_blocks, 1)
            for address in addresses[start : start + max_segments]:
                first = after_block if not segments and after_block is not None else -1
                info, complete = segment_part_info(self._segments[address], index, first, left)
                segments.append(info)
                left -= len(info["blocks"])
                if not complete or left <= 0:
                    break
            more = not complete or start + len(segments) < len(addresses)
            return SegmentsPart(segments, complete, more)

    def trace_entries(self, start: int, end: int, limit: int) -> tuple[int, list[dict[str, Any]]]:
        """The trace entries of sequence numbers ``start`` up to ``end`` (from the oldest still
        held, when the ring buffer dropped some), at most ``limit``: the first one's number
        and the entries."""
        with self._lock:
            trace = self._trace
            if trace is None:
                return end, []
            oldest = self._trace_recorded - len(trace)
            first = max(start, oldest)
            count = max(min(end - first, limit), 0)
            offset = first - oldest
            return first, [trace[offset + i] for i in range(count)]

    def _allocator_settings(self) -> dict[str, Any]:
        unlimited = self.max_split_size == UNLIMITED_SPLIT_SIZE
        return {
            "PYTORCH_CUDA_ALLOC_CONF": "",
            "max_split_size": -1 if unlimited else self.max_split_size,
            "garbage_collection_threshold": 0.0,
            "expandable_segments": False,
            "pinned_num_register_threads": 1,
            "release_lock_on_cudamalloc": False,
            "pinned_use_cuda_host_register": False,
            "roundup_power2_divisions": {},
        }

    def assert_invariants(self) -> None:
        """Check every invariant written beside the fields; raise AssertionError naming the first broken."""
        with self._lock:
            check_pool_invariants(self._parts())

    def _parts(self) -> PoolParts:
        """What the invariants are checked over (the caller holds the lock)."""
        warm = self._idle.warm(self.policy, self.clock(), self.warm_reserve)
        return PoolParts(
            segments=self._segments,
            small=self._small,
            large=self._large,
            stats=self._stats,
            ledger=self._ledger,
            decommits=self._decommits(),
            idle=self._idle,
            warm=warm.keys(),
            warm_reserve=self.warm_reserve,
            consolidation=self._consolidation,
            shapes=self._shapes,
            max_split_size=self.max_split_size,
            capacity=self.capacity,
            segment_capacity=self._segment_capacity(),
        )

    # -- the malloc story -----------------------------------------------------

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
        if self._caps_commit() and not self._commit_room(self._ledger.edge_pages(memory)):
            self.backend.release(memory)  # its partial edge pages would not fit
            return None
        segment = Segment(memory, stream, pool.is_small)
        block = Block(memory.address, alloc_size, stream, pool, segment)
        segment.head = block
        self._segments[memory.address] = segment
        self._shapes.pop(memory.address, None)
        increase(self._stats.segment, pool.kind, 1)
        untouched = self._ledger.untouched(segment) if self._decommits() else 0
        increase(self._stats.reserved_bytes, pool.kind, alloc_size - untouched)
        if untouched:
            increase(self._stats.decommitted_bytes, pool.kind, untouched)
        if alloc_size >= self.max_split_size:
            self._stats.oversize_segments.increase(1)
        self._stats.num_device_alloc += 1
        self._record("segment_alloc", memory.address, alloc_size, stream)
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
            self._note_decommit_candidate(remaining)
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
        self._recommit(block)
        increase(stats.allocation, kind, 1)
        increase(stats.allocated_bytes, kind, block.size)
        increase(stats.active, kind, 1)
        increase(stats.active_bytes, kind, block.size)
        increase(stats.requested_bytes, kind, requested)
        if block.size >= self.max_split_size:
            stats.oversize_allocations.increase(1)
        self._record("alloc", block.address, requested, block.stream)
        return block

    # -- the free story ---------------------------------------------------------

    def _free_allocated(self, block: Block) -> None:
        """free() of a block known to be allocated here (the caller holds the lock)."""
        assert block.pool is not None and block.allocated, block
        kind = block.pool.kind
        block.allocated = False
        decrease(self._stats.allocation, kind, 1)
        decrease(self._stats.allocated_bytes, kind, block.size)
        self._record("free_requested", block.address, block.requested_size, block.stream)
        if block.size >= self.max_split_size:
            self._stats.oversize_allocations.decrease(1)
        self._free_block(block)

    def _free_block(self, block: Block) -> None:
        """Mirrors free_block: merge with free neighbours, cache, move the inactive_split stats."""
        pool = block.pool
        assert pool is not None
        self._record("free_completed", block.address, block.requested_size, block.stream)
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
            segment = block.segment
            self._idle.became_idle(segment, self.clock(), self._ledger.committed_in(segment))
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
        if block.is_split() and self._decommits() and self.policy.decommit_threshold is None:
            self._decommit_free_block(block)
        self._note_decommit_candidate(block)

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

    # -- giving segments back -------------------------------------------------

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
        decommitted = self._ledger.release(segment)
        if decommitted:
            decrease(self._stats.decommitted_bytes, pool.kind, decommitted)
        decrease(self._stats.reserved_bytes, pool.kind, block.size - decommitted)
        if block.size >= self.max_split_size:
            self._stats.oversize_segments.decrease(1)
        self._record("segment_free", segment.address, block.size, block.stream)

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
        if segment in self._copying_from:
            return False
        veto = self.segment_releasable
        return veto is None or veto(segment.memory)

    def _releasable(self, block: Block) -> bool:
        """Whether the segment of a whole free block may go back to the device now."""
        return self._releasable_segment(block.segment)

    # -- beyond torch: compaction and releases under pressure (Consolidation) ----------

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
        are whole 2 MiB units) and reserve ``alloc_size`` again."""
        assert self.relocator is not None
        room = self._segment_capacity() - self._reserved()
        needed = alloc_size - room
        if needed <= 0 or self._small.free_bytes() + self._large.free_bytes() < needed:
            return None, note
        result = merge(PoolMoves(self), self.relocator, self, needed, room)
        self._count_result(result)
        block = self._alloc_block(pool, alloc_size, stream, is_retry=False)
        if block is not None:
            return block, ""
        return None, note + f" Merging segments released {format_size(result.plan.released)}."

    def _repack_and_retry(
        self, pool: BlockPool, alloc_size: int, stream: int, note: str
    ) -> tuple[Block | None, str]:
        """Compaction could not empty a segment: repack segments into tight new ones
        (:func:`~.compaction.repack`) and reserve ``alloc_size`` again."""
        assert self.relocator is not None
        needed = self._reserved() + alloc_size - self._segment_capacity()
        if needed <= 0 or self._small.free_bytes() + self._large.free_bytes() < needed:
            return None, note
        result = repack(PoolMoves(self), self.relocator, self, needed)
        self._count_result(result)
        block = self._alloc_block(pool, alloc_size, stream, is_retry=False)
        if block is not None:
            return block, ""
        return None, note + f" Repacking released {format_size(result.plan.released)}."

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
        result = compact(PoolMoves(self), self.relocator, self, needed)
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

    def _consolidate(self) -> None:
        """Give the pool's free blocks back to the device before it runs out: empty the
        least-used segments into holes elsewhere, then repack partly used ones into holes
        and tight new segments, at most ``max_moved_bytes`` moved by each."""
        assert self.relocator is not None
        budget = self.policy.max_moved_bytes
        result = compact(PoolMoves(self, max_moved=budget), self.relocator, self, self._slack())
        self._count_result(result)
        result = repack(PoolMoves(self, max_moved=budget), self.relocator, self, self._slack())
        self._count_result(result)

    def _segment_shape(self, segment: Segment) -> SegmentShape:
        """Planning's view of ``segment``'s blocks: the kept one, or a fresh walk kept."""
        shape = self._shapes.get(segment.address)
        if shape is None:
            shape = self._shapes[segment.address] = segment_shape(segment)
        return shape

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
            kept = self._kept_idle_segments()
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
                if not self._keeps_idle_segments() or (
                    self._near_the_edge() and not self._idle.costly_churn
                ):
                    # none kept, or near the edge: idle segments go back now, not when the
                    # compactor comes; but where giving one back waits for the whole device
                    # (costly churn) the compactor does it, off the request
                    released = self._release_idle_segments(excess)
                elif self._idle.keep_fraction(policy) is not None:
                    released = self._release_unkept_idle_segments()
                if not released or self._wake_excess():
                    wanted()
            return
        if policy.release_threshold is not None:
            excess = self._excess(policy.release_threshold)
            if excess:
                self._release_idle_segments(excess)
        if policy.compact_threshold is None or self.relocator is None:
            return
        excess = self._consolidation.compaction_due(policy, self._committed(), self._allocated())
        if not excess:
            return
        result = compact(
            PoolMoves(self, max_moved=policy.max_moved_bytes), self.relocator, self, excess
        )
        self._count_result(result)

    def _release_idle_segments(self, target: int) -> bool:
        """Give back whole free segments, the largest first, until ``target`` bytes went
        back; whether any went back."""
        if not self._has_idle_segment():
            return False  # most calls: looking costs a walk of every free block
        idle = [
            block
            for pool in (self._large, self._small)
            for block in (pool.free_blocks[key[2]] for key in pool.keys)
            if not block.is_split() and self._releasable(block)
        ]
        released = 0
        for block in sorted(idle, key=lambda b: (-b.size, b.address)):
            if released >= target:
                break
            released += self._ledger.committed_in(block.segment)
            self._release_block(block)
        return bool(idle)

    def _has_idle_segment(self) -> bool:
        """Whether some free block spans its whole segment: the free blocks of a pool less
        those of split segments (stat ``inactive_split``), in O(1)."""
        split = self._stats.inactive_split
        return any(len(pool.keys) > split[pool.kind].current for pool in (self._large, self._small))

    def _near_the_edge(self) -> bool:
        """Whether the device is used beyond the policy's keep_idle_below (no idle segment
        is kept there)."""
        return self._consolidation.near_the_edge(self.policy, self._capacity_used(), self.capacity)

    # -- beyond torch: idle segments kept for a while (IdleSegments) ----------------

    def _keeps_idle_segments(self) -> bool:
        """Whether the policy's release_idle_s applies: only where a background compactor
        gives kept segments back later (compaction_wanted set, and compaction possible)."""
        policy = self.policy
        return (
            policy.release_idle_s is not None
            and self.compaction_wanted is not None
            and policy.compact_threshold is not None
            and self.relocator is not None
        )

    def _kept_idle_segments(self) -> dict[int, float]:
        """The wholly free segments kept now (policy ``release_idle_s``, and the warm
        reserve's, ``warm_reserve_s``): address -> the clock() time from which they may go
        back.  Background compaction neither empties nor fills them, nor counts them as
        excess; the out-of-memory paths ignore this."""
        if not self._idle or not self._keeps_idle_segments() or self._near_the_edge():
            return {}
        return self._idle.kept(
            self.policy, self.clock(), self._allocated(), reserve=self.warm_reserve
        )

    def _release_unkept_idle_segments(self) -> bool:
        """Give back the wholly free segments beyond the kept ones' budget (policy
        keep_idle_fraction), the warm reserve's excepted: no copy, so cheap on a freeing
        call, and the room is back before the compactor, woken, would come.  Whether any
        went back."""
        if len(self._idle) <= 1:
            return False  # the most recently freed one is kept whatever its size
        if self._idle.all_within_budget(self.policy, self._allocated()):
            return False  # every idle segment together fits the budget (most frees)
        policy, now, allocated = self.policy, self.clock(), self._allocated()
        unbudgeted = self._idle.kept(policy, now, allocated, budgeted=False)
        if len(unbudgeted) <= 1:
            return False  # within any budget
        warm = self._idle.warm(policy, now, self.warm_reserve)
        released = False
        for address in self._idle.beyond_budget(policy, unbudgeted, allocated):
            if address in warm:
                continue  # the warm reserve keeps it
            head = self._segments[address].head
            assert head is not None
            if self._releasable(head):
                self._release_block(head)
                released = True
        return released

    # -- beyond torch: decommitted page ranges (CommitLedger) -------------------------

    def _decommits(self) -> bool:
        return self._ledger.can_decommit and self.policy.decommit

    def _caps_commit(self) -> bool:
        """Whether the capacity bounds committed bytes (a pool that decommits), not segment
        bytes: fragmentation of the address space then costs no device memory."""
        return self._decommits()

    def _segment_capacity(self) -> int:
        """What segment bytes may reach: the capacity, or under a commit cap the policy's
        virtual_capacity_factor x capacity (address space, memfds)."""
        if not self._caps_commit():
            return self.capacity
        return int(self.capacity * self.policy.virtual_capacity_factor)

    def _capacity_used(self) -> int:
        """The bytes the capacity bounds: committed ones under a commit cap, else segments'."""
        return self._committed() if self._caps_commit() else self._reserved()

    def _admit(self, block: Block | None, size: int) -> Block | None:
        """``block`` (taken out of its pool, or a new segment's) if the device has room to
        commit the pages ``size`` bytes at its front would take (free pages elsewhere given
        back first, whole free segments released); else None, the block back in its pool
        (a new segment's released)."""
        if block is None or not self._caps_commit():
            return block
        if self._committed() + block.size + 2 * self._ledger.page <= self.capacity:
            return block  # whatever it commits fits: its pages rounded out, < 2 pages more
        cost = self._ledger.commit_cost(block, size, self.max_split_size)
        if self._commit_room(cost, release_segments=True):
            return block
        assert block.pool is not None
        block.pool.insert(block)
        self._note_decommit_candidate(block)  # making room may have popped its entry
        if not block.is_split() and self._releasable(block):  # as _commit_room did to others
            self._release_block(block)
        return None

    def _admit_move(self, block: Block, size: int) -> bool:
        """Whether a compaction move may take ``size`` bytes at the front of the free
        ``block`` (out of its pool): room to commit its pages, made by decommitting free
        pages elsewhere (no segment goes back: the plan may still use every free block)."""
        return self._commit_room(self._ledger.commit_cost(block, size, self.max_split_size))

    def _commit_room(self, nbytes: int, *, release_segments: bool = False) -> bool:
        """Whether ``nbytes`` more committed bytes fit the capacity, giving back free pages
        (the largest free blocks first: those of split segments, then wholly free segments,
        released when ``release_segments``, else decommitted) until they do.  A free block
        out of its pool (being allocated) is never touched."""
        shortfall = self._committed() + nbytes - self.capacity
        if shortfall <= 0:
            return True
        shortfall -= self._ledger.give_back(shortfall, self._decommit_free_block)
        if shortfall <= 0:
            return True
        for block in self._idle.cached_heads(self._segments):
            if not block.is_split() and release_segments and self._releasable(block):
                shortfall -= self._ledger.committed_in(block.segment)
                self._release_block(block)
            else:
                shortfall -= self._decommit_free_block(block, minimum=0)
            if shortfall <= 0:
                break
        return shortfall <= 0

    def _recommit(self, block: Block) -> None:
        """A block allocated over decommitted pages: they count as reserved again."""
        recommitted = self._ledger.recommit(block)
        if recommitted:
            assert block.pool is not None
            decrease(self._stats.decommitted_bytes, block.pool.kind, recommitted)
            increase(self._stats.reserved_bytes, block.pool.kind, recommitted)

    def _decommit_free_block(self, block: Block, minimum: int | None = None) -> int:
        """Give back the whole pages of a free block not given back yet, when the block has
        at least ``minimum`` bytes (default: the policy's decommit_min_bytes), and count
        them; the bytes decommitted now."""
        if minimum is None:
            minimum = self.policy.decommit_min_bytes
        decommitted, ranges = self._ledger.decommit(block, minimum)
        if decommitted:
            assert block.pool is not None
            decrease(self._stats.reserved_bytes, block.pool.kind, decommitted)
            increase(self._stats.decommitted_bytes, block.pool.kind, decommitted)
            self._stats.num_decommits += ranges
            self._idle.decommitted(block.segment, decommitted)
        return decommitted

    def _decommit_excess(self, threshold: float) -> None:
        """While committed bytes exceed ``threshold`` x allocated, give back the pages of
        free blocks of split segments, the largest first (no copy: cheaper than compaction,
        and the only way to shrink a hole between blocks that may not move), at most
        DECOMMIT_SCAN_LIMIT candidates looked at, and only once committed bytes exceed the
        policy's decommit_wake_threshold x allocated (hysteresis: below it freed holes stay
        warm).  Wholly free segments keep theirs (the next request like the last one
        reuses warm pages)."""
        # wholly free segments keep their pages: counted, they would keep committed above
        # the threshold (a server keeps them warm for release_idle_s) and every hole freed
        # meanwhile would go back at once, hysteresis or not
        committed = self._committed() - self._idle.committed
        policy = self.policy
        target = self._ledger.excess(policy, committed, self._allocated(), threshold)
        if target:
            minimum = policy.decommit_min_bytes
            self._ledger.give_back(target, self._decommit_free_block, minimum, DECOMMIT_SCAN_LIMIT)

    def _note_decommit_candidate(self, block: Block) -> None:
        """A free block that may hold committed whole pages (a freed or split-off one):
        _decommit_excess may give them back once its segment is split."""
        if not self._decommits() or not block.is_split():
            return
        self._ledger.note_candidate(block)

    # -- the pool's side of a compaction (PoolMoves's MoveSite; the caller holds the lock) --

    def segments_by_address(self) -> list[Segment]:
        """Every segment, by address."""
        return [segment for _, segment in sorted(self._segments.items())]

    def segment_shape(self, segment: Segment) -> SegmentShape:
        """Planning's view of ``segment``'s blocks (kept between plans)."""
        return self._segment_shape(segment)

    def releasable_segment(self, segment: Segment) -> bool:
        """Whether ``segment``, once wholly free, may go back to the device now."""
        return self._releasable_segment(segment)

    def kept_idle_addresses(self) -> Collection[int]:
        """The addresses of the wholly free segments kept now (policy ``release_idle_s``)."""
        return self._kept_idle_segments().keys()

    def allocate_for_move(self, target: Block, size: int, requested: int) -> Block | None:
        """Allocate ``size`` bytes (``requested`` asked for) at the front of the free block
        ``target`` for a moved Storage, split off if worth it; None, ``target`` left free
        and cached, when the device has no room to commit its pages."""
        block_pool = target.pool
        assert block_pool is not None and not target.allocated, target
        block_pool.remove(target)
        if self._caps_commit() and not self._admit_move(target, size):
            block_pool.insert(target)
            self._note_decommit_candidate(target)  # making room may have popped its entry
            return None
        split = should_split(target.size, size, block_pool.is_small, self.max_split_size)
        return self._alloc_found_block(target, size, requested, split)

    def free_moved(self, block: Block) -> None:
        """Free the allocated ``block`` a Storage moved out of."""
        self._free_allocated(block)

    def release_free_segment(self, address: int) -> None:
        """Give the wholly free segment at ``address`` back to the device."""
        head = self._segments[address].head
        assert head is not None and not head.allocated and not head.is_split(), head
        self._release_block(head)

    def free_segment_size(self, address: int) -> int | None:
        """The size of the segment at ``address`` if it is wholly free and may go back now,
        else None."""
        segment = self._segments.get(address)
        head = None if segment is None else segment.head
        if head is None or head.allocated or head.is_split():
            return None
        return head.size if self._releasable(head) else None

    def reserve_free_segment(self, is_small: bool, stream: int, size: int) -> int | None:
        """Reserve a new segment of ``size`` bytes, its one block free and cached; its
        address, or None when the device refuses."""
        block_pool = self._small if is_small else self._large
        block = self._alloc_block(block_pool, size, stream, is_retry=False)
        if block is None:
            return None
        block_pool.insert(block)  # a new segment's block is free and cached until used
        return block.address

    @contextlib.contextmanager
    def copying_from(self, segment: Segment) -> Iterator[None]:
        """Let go of the lock while a move copies from ``segment``: meanwhile it neither
        goes back to the device (its bytes are being read) nor is emptied by another
        compaction.  The device's copy is complete when this ends."""
        self._copying_from[segment] = self._copying_from.get(segment, 0) + 1
        self._lock.release()
        try:
            yield
            # a device's copy may be queued (CUDA: on the server stream): complete before
            # the owner is repointed, so nothing reads the new block ahead of its bytes
            wait = getattr(self.backend, "synchronize", None)
            if wait is not None:
                wait()
        finally:
            self._lock.acquire()
            left = self._copying_from.pop(segment) - 1
            if left:
                self._copying_from[segment] = left

    # -- what tests inspect of the commit ledger --------------------------------------

    @property
    def _decommitted(self) -> dict[int, list[Span]]:
        """The ledger's decommitted ranges, by segment address."""
        return self._ledger.spans

    @property
    def _decommit_candidates(self) -> list[Candidate]:
        """The ledger's decommit candidates (a heap)."""
        return self._ledger.candidates

    # -- helpers ----------------------------------------------------------------

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

    def _record(self, action: str, addr: int, size: int, stream: int) -> None:
        """record_trace: one TraceEntry in _snapshot()'s form, when history is on."""
        if self._trace is None:
            return
        address_key = "device_free" if action == "oom" else "addr"
        self._trace_recorded += 1
        self._trace.append(
            {
                "action": action,
                address_key: addr,
                "size": size,
                "stream": stream,
                "time_us": time.time_ns() // 1000,
                "frames": [],
            }
        )

    def _free_block_figures(self) -> dict[str, int | float]:
        """Beyond torch: the largest free block, the releasable bytes and external
        fragmentation (see :func:`~.stats.external_fragmentation`), per pool."""
        result: dict[str, int | float] = {}
        releasable = {
            pool.kind: self._releasable_bytes(pool) for pool in (self._small, self._large)
        }
        pools = {
            "all": (self._small, self._large),
            "small_pool": (self._small,),
            "large_pool": (self._large,),
        }
        for name, members in pools.items():
            largest = max(pool.largest_free() for pool in members)
            free = sum(pool.free_bytes() for pool in members)
            whole = sum(releasable[pool.kind] for pool in members)
            result[f"largest_free_block_bytes.{name}"] = largest
            result[f"releasable_bytes.{name}"] = whole
            result[f"external_fragmentation.{name}"] = external_fragmentation(largest, free, whole)
        return result

    def _releasable_bytes(self, pool: BlockPool) -> int:
        """The bytes of ``pool``'s whole free segments that empty_cache would give back now."""
        return sum(
            block.size
            for block in pool.free_blocks.values()
            if not block.is_split() and self._releasable(block)
        )


# ---------------------------------------------------------------------------
# The pool as compaction's MoveTarget


class MoveSite(Protocol):
    """What :class:`PoolMoves` needs of a pool: its segments, a free block taken for a moved
    Storage, segments given back and reserved, a copy with the lock let go.  The caller
    holds the pool's lock throughout (``copying_from`` lets go of it while it lasts)."""

    backend: Backend
    max_split_size: int

    def segments_by_address(self) -> list[Segment]: ...
    def segment_shape(self, segment: Segment) -> SegmentShape: ...
    def releasable_segment(self, segment: Segment) -> bool: ...
    def kept_idle_addresses(self) -> Collection[int]: ...
    def allocate_for_move(self, target: Block, size: int, requested: int) -> Block | None: ...
    def free_moved(self, block: Block) -> None: ...
    def release_free_segment(self, address: int) -> None: ...
    def free_segment_size(self, address: int) -> int | None: ...
    def reserve_free_segment(self, is_small: bool, stream: int, size: int) -> int | None: ...
    def copying_from(self, segment: Segment) -> contextlib.AbstractContextManager[None]: ...


class PoolMoves(MoveTarget):
    """The narrow interface compaction executes a plan through, over one pool whose lock the
    caller holds.  ``max_moved`` bounds the bytes one plan may copy (None: no bound)."""

    def __init__(
        self,
        pool: MoveSite,
        *,
        max_moved: int | None = None,
        hidden: Collection[int] = (),
    ) -> None:
        self.pool = pool
        self.max_split_size = pool.max_split_size
        self.max_moved = max_moved
        # segments planning does not see (neither emptied nor filled): the kept idle ones
        self.hidden = hidden
        self._segments: list[Segment] = []  # by address, as candidate_segments saw them
        self._shapes: dict[int, SegmentShape] = {}  # ... and their shapes, by address
        self._movable: Mapping[Block, object] = {}  # ... and who could move then

    def candidate_segments(self, movable: Mapping[Block, object]) -> list[SegmentUsage]:
        pool = self.pool
        self._segments = segments = pool.segments_by_address()
        self._movable = movable
        visible = [s for s in segments if s.address not in self.hidden]
        self._shapes = shapes = {s.address: pool.segment_shape(s) for s in visible}
        return [
            shapes[s.address].usage
            if pool.releasable_segment(s)
            else replace(shapes[s.address].usage, movable=False)
            for s in visible
        ]

    def may_move(self, segment: SegmentUsage) -> bool:
        return blocks_may_move(self._shapes[segment.address], self._movable)

    def allocated_block(self, address: int) -> Block:
        # found by a walk when asked: a plan moves a few blocks, fewer than an index of
        # every block would have to follow
        index = bisect.bisect_right(self._segments, address, key=lambda s: s.address) - 1
        block = self._segments[index].head if index >= 0 else None
        while block is not None and block.address < address:
            block = block.next
        if block is None or block.address != address or not block.allocated:
            raise KeyError(f"no allocated block at {address:#x}")
        return block

    def allocate_in_place(self, source: Block, destination: int, size: int) -> Block | None:
        block_pool = source.pool
        assert block_pool is not None and source.allocated, source
        target = block_pool.free_blocks[destination]
        return self.pool.allocate_for_move(target, size, source.requested_size)

    def move_bytes(self, source: Block, destination: Block) -> int:
        nbytes = source.requested_size
        self.pool.backend.copy(
            source.segment.memory,
            source.offset,
            destination.segment.memory,
            destination.offset,
            nbytes,
        )
        return nbytes

    def allocated_block_now(self, address: int) -> Block | None:
        self._segments = self.pool.segments_by_address()
        try:
            return self.allocated_block(address)
        except KeyError:
            return None

    def allocate_if_placed(self, source: Block, destination: int, size: int) -> Block | None:
        pool = self.pool
        block_pool = source.pool
        assert block_pool is not None and source.allocated, source
        target = block_pool.free_blocks.get(destination)
        if (
            target is None
            # the plan names its source by address, and the lock was let go since: a larger
            # block allocated there meanwhile would overrun the planned destination
            or size < source.requested_size
            or target.segment is source.segment
            or target.stream != source.stream
            or target.segment.address in pool.kept_idle_addresses()
            or not oversize_rules_allow(target.size, size, pool.max_split_size)
        ):
            return None
        split = should_split(target.size, size, block_pool.is_small, pool.max_split_size)
        if (size if split else target.size) > source.size:
            return None  # a moved Storage is never charged more (no block grows)
        return self.allocate_in_place(source, destination, size)

    @contextlib.contextmanager
    def copying(self, source: Block) -> Iterator[None]:
        with self.pool.copying_from(source.segment):
            yield

    def free_block(self, block: Block) -> None:
        self.pool.free_moved(block)

    def release_segment(self, address: int) -> None:
        self.pool.release_free_segment(address)

    def free_segment_size(self, address: int) -> int | None:
        return self.pool.free_segment_size(address)

    def reserve_segment(self, like: SegmentUsage, size: int) -> int | None:
        return self.pool.reserve_free_segment(like.is_small, like.stream, size)


def tight_allocation_size(size: int, small: bool) -> int:
    """Beyond torch: the smallest segment that serves ``size`` (the request rounded to
    2 MiB in the large pool; the small pool's 2 MiB segments are already that)."""
    if small:
        return SMALL_BUFFER
    return ROUND_LARGE * ((size + ROUND_LARGE - 1) // ROUND_LARGE)


# ---------------------------------------------------------------------------
# Invariants


class PoolParts(NamedTuple):
    """What a pool's invariants are checked over: its state, and the bounds it is held to."""

    segments: Mapping[int, Segment]  # segment address -> segment
    small: BlockPool
    large: BlockPool
    stats: DeviceStats
    ledger: CommitLedger
    decommits: bool  # whether the policy decommits, on a backend that can
    idle: IdleSegments
    warm: Collection[int]  # the addresses of the segments the warm reserve keeps now
    warm_reserve: int  # the bytes the warm reserve may hold
    consolidation: Consolidation
    shapes: Mapping[int, SegmentShape]  # segment address -> planning's kept shape
    max_split_size: int
    capacity: int  # what committed bytes may reach
    segment_capacity: int  # what segment bytes may reach


def check_pool_invariants(pool: PoolParts) -> None:
    """Every invariant of Segment, Block, BlockPool, the stats and the pool's collaborators
    (the commit ledger, the idle segments, consolidation); the caller holds the lock."""
    stats = pool.stats
    ledger = pool.ledger
    # the collaborators first: the statistics below are checked against what they hold
    ledger.assert_invariants(pool.segments, pool.decommits)
    pool.idle.assert_invariants(pool.segments, ledger.committed_in)
    held = sum(ledger.committed_in(pool.segments[address]) for address in pool.warm)
    assert held <= pool.warm_reserve, (
        f"the warm reserve holds {held} committed bytes, beyond its {pool.warm_reserve}"
    )
    pool.consolidation.assert_invariants()
    expected = {name: [0, 0, 0] for name in STAT_ARRAY_NAMES}
    oversize_allocations = oversize_segments = 0
    free_seen = {SMALL_POOL: 0, LARGE_POOL: 0}
    decommitted = {SMALL_POOL: 0, LARGE_POOL: 0}
    previous_end = -1
    for address, segment in sorted(pool.segments.items()):
        assert address == segment.address, (address, segment)
        assert segment.address >= previous_end, f"{segment} overlaps the segment before it"
        previous_end = segment.address + segment.size
        block_pool = pool.small if segment.is_small else pool.large
        kind = block_pool.kind
        expected["segment"][kind] += 1
        expected["reserved_bytes"][kind] += ledger.committed_in(segment)
        decommitted[kind] += ledger.decommitted_in(segment)
        oversize_segments += segment.size >= pool.max_split_size
        head = segment.head
        assert head is not None and head.prev is None, f"{segment} head {head} has a prev"
        cursor = segment.address
        block: Block | None = head
        prev: Block | None = None
        while block is not None:
            assert block.segment is segment, (
                f"{block} points to {block.segment}, walked from {segment}"
            )
            assert block.prev is prev, f"{block}.prev is {block.prev}, expected {prev}"
            assert block.address == cursor, (
                f"{block} starts at {block.address:#x}, expected {cursor:#x}"
            )
            assert block.size > 0 and block.size % MIN_BLOCK_SIZE == 0, block
            assert block.pool is block_pool and block.stream == segment.stream, block
            if block.allocated:
                assert 0 < block.requested_size <= block.size, block
                assert block.address not in block_pool.free_blocks, f"allocated {block} cached"
                expected["allocation"][kind] += 1
                expected["active"][kind] += 1
                expected["allocated_bytes"][kind] += block.size
                expected["active_bytes"][kind] += block.size
                expected["requested_bytes"][kind] += block.requested_size
                oversize_allocations += block.size >= pool.max_split_size
            else:
                assert block_pool.free_blocks.get(block.address) is block, (
                    f"free {block} not cached"
                )
                assert prev is None or prev.allocated, (
                    f"free neighbours {prev} and {block} not merged"
                )
                assert block.requested_size == 0, block
                free_seen[kind] += 1
                if block.is_split():
                    expected["inactive_split"][kind] += 1
                    expected["inactive_split_bytes"][kind] += block.size
            cursor += block.size
            prev, block = block, block.next
        assert cursor == segment.address + segment.size, f"blocks of {segment} end at {cursor:#x}"
    for block_pool in (pool.small, pool.large):
        keys = block_pool.keys
        assert all(keys[i] < keys[i + 1] for i in range(len(keys) - 1)), "pool keys not sorted"
        assert len(keys) == len(block_pool.free_blocks) == free_seen[block_pool.kind], (
            "free blocks in the pool differ from free blocks in the segments"
        )
        for key in keys:
            assert block_pool.free_blocks[key[2]].key() == key, key
    for name, sums in expected.items():
        array = getattr(stats, name)
        for kind in (SMALL_POOL, LARGE_POOL):
            assert array[kind].current == sums[kind], (name, kind, array[kind].current, sums[kind])
        assert array[ALL].current == sums[SMALL_POOL] + sums[LARGE_POOL], (name, array[ALL].current)
    assert stats.oversize_allocations.current == oversize_allocations
    assert stats.oversize_segments.current == oversize_segments
    for stat in stats.all_stats():
        assert 0 <= stat.current <= stat.peak, (stat.current, stat.peak)
    for kind in (SMALL_POOL, LARGE_POOL):
        assert stats.decommitted_bytes[kind].current == decommitted[kind], (kind, decommitted)
    assert stats.decommitted_bytes[ALL].current == sum(decommitted.values()), "decommitted"
    committed = stats.reserved_bytes[ALL].current
    reserved = committed + stats.decommitted_bytes[ALL].current
    assert reserved <= pool.segment_capacity, "segments beyond their bound"
    assert committed <= pool.capacity, "committed bytes beyond capacity"
    for address, shape in pool.shapes.items():
        assert address in pool.segments, f"a kept shape for no segment at {address:#x}"
        fresh = segment_shape(pool.segments[address])
        assert shape.usage == fresh.usage and shape.blocks == fresh.blocks, (
            f"the kept shape of the segment at {address:#x} is stale"
        )
