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
  :class:`~.idle.IdleKeeping`), a bounded warm reserve of them for longer (policy
  ``warm_reserve_s``, the pool's ``warm_reserve`` bytes);
- free page ranges of split segments given back to the device, the segment kept
  (policy ``decommit``, on backends that can: :class:`~.commit.CommitCap`): then
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
from collections.abc import Callable, Collection, Iterator
from typing import Any, NamedTuple, NoReturn

from tensord.errors import InvalidArgumentError, OutOfMemoryError, ResourceExhaustedError

from tensord_server.pool.backend import Backend
from tensord_server.pool.blocks import (
    ALL,
    NULL_SEGMENT,
    STAT_TYPE_NAMES,
    UNLIMITED_SPLIT_SIZE,
    Block,
    BlockPool,
    Segment,
    device_index,
    format_size,
    get_allocation_size,
    is_small_size,
    round_size,
    should_split,
)
from tensord_server.pool.cache import BlockCache
from tensord_server.pool.compaction import (
    CompactionResult,
    MoveTarget,
    Relocator,
    SegmentShape,
    compact_step,
)
from tensord_server.pool.history import TRACE_MAX_ENTRIES
from tensord_server.pool.invariants import PoolParts, check_pool_invariants
from tensord_server.pool.moves import PoolMoves
from tensord_server.pool.policy import OOM_COMPACTION, PoolPolicy
from tensord_server.pool.pressure import PressureSteps, tight_allocation_size
from tensord_server.pool.stats import (
    external_fragmentation,
    format_summary,
    segment_info,
    segment_part_info,
    stat_items,
)


class SegmentsPart(NamedTuple):
    """A run of a snapshot's segments, by address (CachingPool.snapshot_segments)."""

    segments: list[dict[str, Any]]  # segment_info dicts; the first and last may be partial
    last_complete: bool  # the last holds all its blocks after the place asked for
    more: bool  # segments (or blocks of the last) follow


# ---------------------------------------------------------------------------
# The pool


class CachingPool(BlockCache):
    """One device's caching allocator (torch's DeviceCachingAllocator); thread-safe.

    Its base, :class:`~.cache.BlockCache`, holds the blocks and segments and torch's steps
    over them; what it does beyond torch is its collaborators', each reached through the
    narrow site it is given: the idle segments (:class:`~.idle.IdleKeeping`), the commit
    cap (:class:`~.commit.CommitCap`), the steps under pressure
    (:class:`~.pressure.PressureSteps`), compaction's moves (:class:`~.moves.PoolMoves`).
    """

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
        super().__init__(
            backend,
            capacity=capacity,
            max_split_size=max_split_size,
            record_history=record_history,
            relocator=relocator,
            policy=policy,
            clock=clock,
        )
        # beyond torch: the out-of-memory steps, consolidation, the thresholds after a
        # free (over this pool as its PressureSite)
        self._pressure = PressureSteps(self, self._idle)

    # -- public API ---------------------------------------------------------

    def malloc(self, nbytes: int, stream: int = 0, *, count_oom: bool = True) -> Block:
        """Mirrors DeviceCachingAllocator::malloc.  Raises OutOfMemoryError (or, beyond torch,
        ResourceExhaustedError where a new segment found no file descriptor).  With
        ``count_oom`` False a refusal is neither counted in ``num_ooms`` nor recorded: the
        caller may still serve the request (a spill makes room) and counts it with
        :meth:`count_oom` only where it fails in the end."""
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
                self._out_of_memory(self._oom_message(figures), figures, size, stream, count_oom)
            # each block found must have room to commit its pages (admit: always, unless
            # the capacity bounds committed bytes), else it goes back and the next path runs
            block = self._commits.admit(self._get_free_block(pool, size, stream), size)
            if block is None and self._pressure.should_consolidate(alloc_size):
                self._pressure.consolidate(alloc_size)
            if block is None:
                block = self._commits.admit(
                    self._alloc_block(pool, alloc_size, stream, is_retry=False), size
                )
            if block is None and self._release_available_cached_blocks(pool, size, stream):
                block = self._commits.admit(
                    self._alloc_block(pool, alloc_size, stream, is_retry=False), size
                )
            if block is None:
                self._release_cached_blocks()
                block = self._commits.admit(
                    self._alloc_block(pool, alloc_size, stream, is_retry=True), size
                )
            if block is None:
                figures = self._oom_figures(nbytes)  # as they stand before the extra paths
                message = self._oom_message(figures)
                block, note = self._pressure.beyond_torch_on_oom(pool, size, alloc_size, stream)
                block = self._commits.admit(block, size)
                message += note
            if block is None and self._descriptor_refusal is not None:
                self._out_of_descriptors(nbytes, self._descriptor_refusal)
            if block is None:
                self._out_of_memory(message, figures, size, stream, count_oom)
            split = should_split(block.size, size, pool.is_small, self.max_split_size)
            return self._alloc_found_block(block, size, nbytes, split)

    def count_oom(self, nbytes: int, stream: int = 0) -> None:
        """Count and record an out-of-memory that the caller raises for ``nbytes``, after
        refusals it asked for with ``malloc(count_oom=False)`` (one request, one count)."""
        with self._lock:
            self._count_oom(round_size(nbytes), stream)

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
            if self._commits.decommits() and self.policy.decommit_threshold is not None:
                self._commits.decommit_excess(self.policy.decommit_threshold)
            if self.policy.acts_after_free:
                self._pressure.after_free()

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
            return self._pressure.compaction_excess()

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
            kept = self._idle.kept()
            excess = self._pressure.compaction_excess(kept)
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
            if not self._idle.keeps():
                return None
            kept = self._idle.kept()
            if self._idle.decayed_beyond(kept) and self._pressure.compaction_excess(kept):
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
            self._history.restart(max_entries if enabled else None)

    def memory_snapshot(self) -> dict[str, Any]:
        """torch.cuda.memory._snapshot()'s structure: picklable, readable by memory_viz."""
        with self._lock:
            index = device_index(self.device)
            segments = [
                segment_info(segment, index) for _, segment in sorted(self._segments.items())
            ]
            total_active = sum(info["active_size"] for info in segments)
            self._history.record("snapshot", 0, total_active, 0)
            return {
                "segments": segments,
                "device_traces": [self._history.entries()],
                "allocator_settings": self._allocator_settings(),
            }

    def snapshot_begin(self) -> tuple[dict[str, Any], int]:
        """Start a paged snapshot: record its trace entry (as memory_snapshot does); the
        allocator settings, and the sequence number that ends this snapshot's trace."""
        with self._lock:
            self._history.record("snapshot", 0, self._stats.allocated_bytes[ALL].current, 0)
            return self._allocator_settings(), self._history.recorded

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
            return self._history.between(start, end, limit)

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
        return PoolParts(
            segments=self._segments,
            small=self._small,
            large=self._large,
            stats=self._stats,
            ledger=self._commits.ledger,
            decommits=self._commits.decommits(),
            idle=self._idle,
            consolidation=self._pressure.consolidation,
            shapes=self._shapes,
            max_split_size=self.max_split_size,
            capacity=self.capacity,
            segment_capacity=self._segment_capacity(),
        )

    # -- the pool's side of a compaction (PoolMoves's MoveSite; the caller holds the lock) --

    def moves(self, max_moved: int | None = None) -> MoveTarget:
        """The target a compaction executes one plan through, at most ``max_moved`` bytes
        copied by it (None: no bound)."""
        return PoolMoves(self, max_moved=max_moved)

    def count_compaction(self, result: CompactionResult) -> None:
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

    def segments_by_address(self) -> list[Segment]:
        """Every segment, by address."""
        return [segment for _, segment in sorted(self._segments.items())]

    def segment_shape(self, segment: Segment) -> SegmentShape:
        """Planning's view of ``segment``'s blocks (kept between plans)."""
        return self._segment_shape(segment)

    def kept_idle_addresses(self) -> Collection[int]:
        """The addresses of the wholly free segments kept now (policy ``release_idle_s``)."""
        return self._idle.kept().keys()

    def allocate_for_move(
        self, target: Block, size: int, requested: int, exact: bool = False
    ) -> Block | None:
        """Allocate ``size`` bytes (``requested`` asked for) at the front of the free block
        ``target`` for a moved Storage, split off if worth it (``exact``: whenever ``target``
        is larger); None, ``target`` left free and cached, when the device has no room to
        commit its pages."""
        block_pool = target.pool
        assert block_pool is not None and not target.allocated, target
        block_pool.remove(target)
        if self._commits.caps_commit() and not self._commits.admit_move(target, size):
            block_pool.insert(target)
            self._commits.note_candidate(target)  # making room may have popped its entry
            return None
        split = should_split(target.size, size, block_pool.is_small, self.max_split_size)
        split = split or (exact and target.size > size)
        return self._alloc_found_block(target, size, requested, split)

    def free_moved(self, block: Block) -> None:
        """Free the allocated ``block`` a Storage moved out of."""
        self._free_allocated(block)

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
        if not self._commits.caps_commit():
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
        if not self._commits.caps_commit():
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

    # -- helpers ----------------------------------------------------------------

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
