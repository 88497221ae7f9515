"""The commit ledger: which pages of the pool's segments are given back to the device.

Under a policy that decommits (``PoolPolicy.decommit``), on a backend that can
(:func:`~.backend.decommitter`), the pool gives the whole pages of free ranges inside split
segments back to the device while keeping the segments, as PyTorch's expandable segments
unmap pages.  :class:`CommitLedger` records, for each segment, the ranges given back;
the pool's ``reserved_bytes`` counts the rest (committed bytes), and the device's capacity
then bounds committed bytes rather than segment bytes.

The ledger also keeps the free blocks that may still hold committed pages (its
candidates), so that giving pages back looks only at blocks that have some.

:class:`CommitCap`, the pool's collaborator, owns the ledger and the steps over it: whether
the capacity bounds committed bytes, admitting a block only where its pages fit (free
pages elsewhere given back first), giving back the pages of free blocks and the excess
beyond the policy's decommit_threshold.  It reaches the pool only through the narrow
:class:`CommitSite` (the policy and bounds, the committed and allocated bytes, giving a
whole free segment back, and counting what went back or came back: the statistics are
the pool's).  Neither counts statistics itself nor takes a lock: the owning
:class:`~.allocator.CachingPool` calls them with the pool's lock held.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Mapping
from typing import NamedTuple, Protocol

from tensord_server.pool.backend import Decommit, DeviceMemory
from tensord_server.pool.blocks import SMALL_POOL, Block, BlockPool, Segment, should_split
from tensord_server.pool.idle import IdleKeeping
from tensord_server.pool.pages import (
    Span,
    add_spans,
    page_interior,
    remove_range,
    span_bytes,
    spans_within,
    uncovered,
)
from tensord_server.pool.policy import PoolPolicy

log = logging.getLogger(__name__)

# A free block that may hold committed whole pages: (-size, address, pool kind), so that
# the heap pops the largest first.
Candidate = tuple[int, int, int]

# Candidates beyond twice the free blocks, plus this, prompt a prune of the stale ones.
CANDIDATE_SLACK = 64
# policy decommit_threshold: the most candidates a free looks at, the largest first (the
# walk runs under the pool's lock, on every free above the threshold)
DECOMMIT_SCAN_LIMIT = 64


class Decommitted(NamedTuple):
    """What one decommit of a free block gave back."""

    nbytes: int  # bytes whose pages went back
    ranges: int  # backend calls that gave them (``num_decommits``)


class CommitLedger:
    """The decommitted page ranges of each segment, and the free blocks worth decommitting.

    Guarded by the owning pool's lock: every method is called with it held.

    Invariants (:meth:`assert_invariants`):

    - ``spans`` maps a live segment's address to its decommitted ranges: never empty,
      sorted, disjoint, whole pages of the backend's page size, each inside one free
      block of the segment (a block allocated over a range takes its pages back first);
      a segment without decommitted pages has no entry;
    - while the policy decommits, every free block of a split segment that holds a
      committed whole page has its entry in ``candidates`` (else nothing would ever give
      those pages back).  An entry whose block merged, split, was allocated or went is
      stale: it is skipped when popped, and pruned once the heap outgrows the free blocks.
    """

    __slots__ = ("_decommit", "candidates", "page", "pools", "spans")

    def __init__(
        self, capability: tuple[Decommit, int] | None, pools: tuple[BlockPool, BlockPool]
    ) -> None:
        # the backend's decommit and page size; None: the backend cannot give pages back
        self._decommit: Decommit | None = None if capability is None else capability[0]
        self.page: int = 0 if capability is None else capability[1]
        self.pools = pools  # the pool's small and large BlockPools, where candidates live
        self.spans: dict[int, list[Span]] = {}  # segment address -> decommitted ranges
        self.candidates: list[Candidate] = []  # a heap; entries may be stale

    @property
    def can_decommit(self) -> bool:
        return self._decommit is not None

    # -- what the ledger says of a segment or a block --------------------------------

    def decommitted_in(self, segment: Segment) -> int:
        return span_bytes(self.spans.get(segment.address, []))

    def committed_in(self, segment: Segment) -> int:
        return segment.size - self.decommitted_in(segment)

    def edge_pages(self, memory: DeviceMemory) -> int:
        """The bytes of a new segment's partial first and last pages (committed at once)."""
        interior = page_interior(memory.address, memory.address + memory.nbytes, self.page)
        return memory.nbytes - (0 if interior is None else interior[1] - interior[0])

    def pages_of(self, start: int, end: int) -> Span:
        """[start, end) rounded out to whole pages: what a block allocated there commits."""
        page = self.page
        return start // page * page, -(-end // page) * page

    def commit_cost(self, block: Block, size: int, max_split_size: int) -> int:
        """The decommitted bytes that allocating ``size`` at the front of the free ``block``
        commits again: the pages of the part allocated (split or not), rounded out."""
        assert block.pool is not None
        split = should_split(block.size, size, block.pool.is_small, max_split_size)
        start, end = self.pages_of(block.address, block.address + (size if split else block.size))
        return spans_within(self.spans.get(block.segment.address, []), start, end)

    def committed_pages_of(self, block: Block) -> list[Span]:
        """The whole pages inside a free block not given back."""
        interior = page_interior(block.address, block.address + block.size, self.page)
        if interior is None:
            return []
        return uncovered(self.spans.get(block.segment.address, []), *interior)

    @staticmethod
    def excess(policy: PoolPolicy, committed: int, allocated: int, threshold: float) -> int:
        """The bytes of pages to give back so that ``committed`` comes down to ``threshold``
        x ``allocated``; 0 (hysteresis: the holes stay warm) until ``committed`` exceeds the
        policy's decommit_wake_threshold x ``allocated`` by decommit_min_bytes, and
        ``allocated`` by more than decommit_min_slack."""
        wake = policy.decommit_wake_threshold
        if committed - allocated <= policy.decommit_min_slack:
            return 0
        if (
            committed - int(max(threshold, wake or threshold) * allocated)
            < policy.decommit_min_bytes
        ):
            return 0
        return committed - int(threshold * allocated)

    # -- changes: the pool counts what each returns ------------------------------------

    def untouched(self, segment: Segment) -> int:
        """Record a new segment's whole pages as decommitted, and return their bytes: a fresh
        memfd (or mapping) has no page until touched, and the pool touches only allocated
        blocks, so a segment commits only what its blocks use (as expandable segments map)."""
        interior = page_interior(segment.address, segment.address + segment.size, self.page)
        if interior is None:
            return 0
        self.spans[segment.address] = [interior]
        return interior[1] - interior[0]

    def recommit(self, block: Block) -> int:
        """A block allocated over decommitted pages: they count as committed again (the pages
        themselves fault back in, as zeros, when touched).  The bytes recommitted."""
        segment = block.segment
        spans = self.spans.get(segment.address)
        if not spans:
            return 0
        # whole pages: the page a block's first or last bytes share with a free neighbour
        # faults in when touched, so it leaves the neighbour's decommitted range too
        start, end = self.pages_of(block.address, block.address + block.size)
        kept, recommitted = remove_range(spans, start, end)
        if kept:
            self.spans[segment.address] = kept
        else:
            del self.spans[segment.address]
        return recommitted

    def decommit(self, block: Block, minimum: int) -> Decommitted:
        """Give back the whole pages of the free ``block`` not given back yet, when it has at
        least ``minimum`` bytes."""
        assert self._decommit is not None and block.pool is not None and not block.allocated
        interior = page_interior(block.address, block.address + block.size, self.page)
        if interior is None or block.size < minimum:
            return Decommitted(0, 0)
        segment = block.segment
        spans = self.spans.get(segment.address, [])
        done: list[Span] = []
        for start, end in uncovered(spans, *interior):
            try:
                self._decommit(segment.memory, start - segment.address, end - start)
            except OSError:
                break  # the pages stay committed, and counted so: nothing relies on them going
            except (ValueError, IndexError):
                # a range the backend refuses is this server's bug: said loudly, but not
                # raised, which would leave a malloc's block out of its free pool
                log.exception("decommit of a free block refused: its pages stay committed")
                break
            done.append((start, end))
        if not done:
            return Decommitted(0, 0)
        self.spans[segment.address] = add_spans(spans, done)
        return Decommitted(span_bytes(done), len(done))

    def release(self, segment: Segment) -> int:
        """Forget a segment going back to the device; the bytes it had decommitted."""
        return span_bytes(self.spans.pop(segment.address, []))

    # -- the candidates -------------------------------------------------------------

    def note_candidate(self, block: Block) -> None:
        """A free block of a split segment that may hold committed whole pages (a freed one,
        or the rest of a split): giving pages back may take them later."""
        assert block.pool is not None
        if block.size < self.page:
            return  # not one whole page
        heapq.heappush(self.candidates, (-block.size, block.address, block.pool.kind))
        free_blocks = sum(len(pool.keys) for pool in self.pools)
        if len(self.candidates) > 2 * free_blocks + CANDIDATE_SLACK:
            self.prune()

    def prune(self) -> None:
        """Drop the stale entries (and repeats): the heap stays within twice the free
        blocks, so each free pays O(1) for it on average."""
        live = {entry for entry in self.candidates if self.candidate_block(entry)}
        self.candidates = list(live)
        heapq.heapify(self.candidates)

    def candidate_block(self, entry: Candidate) -> Block | None:
        """The free block of a split segment ``entry`` names, or None when the entry is
        stale (that block merged, split, went or was allocated)."""
        negative_size, address, kind = entry
        small, large = self.pools
        block = (small if kind == SMALL_POOL else large).free_blocks.get(address)
        if block is None or block.size != -negative_size or not block.is_split():
            return None
        return block

    def give_back(
        self,
        target: int,
        decommit: Callable[[Block, int], int],
        minimum: int = 0,
        limit: int | None = None,
    ) -> int:
        """Give back the committed pages of candidates, the largest first, through
        ``decommit`` (the pool's, which counts them), until ``target`` bytes went back; the
        bytes given back.  No block smaller than ``minimum`` bytes, and at most ``limit``
        candidates looked at (None: no limit)."""
        candidates = self.candidates
        kept: list[Block] = []  # pages a decommit could not give back: tried again later
        done = looked = 0
        while done < target and candidates and (limit is None or looked < limit):
            if -candidates[0][0] < minimum:
                break  # the rest are smaller than worth a decommit
            looked += 1
            block = self.candidate_block(heapq.heappop(candidates))
            if block is None:
                continue  # stale, or out of its pool being allocated (it is noted again then)
            done += decommit(block, minimum)
            if self.committed_pages_of(block):
                kept.append(block)
        for block in kept:
            self.note_candidate(block)
        return done

    # -- invariants -----------------------------------------------------------------

    def assert_invariants(self, segments: Mapping[int, Segment], decommits: bool) -> None:
        """The invariants above, for the pool's ``segments``; ``decommits``: whether the
        policy decommits now (the candidates are complete only then)."""
        assert set(self.spans) <= set(segments), "decommitted pages of no segment"
        for segment in segments.values():
            self._check_spans(segment)
        if decommits:
            self._check_candidates()

    def _check_spans(self, segment: Segment) -> None:
        spans = self.spans.get(segment.address)
        if spans is None:
            return
        assert spans, f"an empty entry for {segment}"
        assert self.can_decommit, f"decommitted pages on a backend without: {segment}"
        page = self.page
        free = [b for b in segment.blocks() if not b.allocated]
        previous_end = segment.address
        for start, end in spans:
            assert previous_end <= start < end, f"decommitted {spans} of {segment} overlap"
            assert start % page == 0 and end % page == 0, f"decommitted {spans} not whole pages"
            assert any(b.address <= start and end <= b.address + b.size for b in free), (
                f"decommitted [{start:#x}, {end:#x}) of {segment} is not inside a free block"
            )
            previous_end = end
        end = segment.address + segment.size
        assert spans_within(spans, segment.address, end) == span_bytes(spans), (
            f"decommitted {spans} outside {segment}"
        )

    def _check_candidates(self) -> None:
        entries = set(self.candidates)
        for pool in self.pools:
            for block in pool.free_blocks.values():
                if block.is_split() and self.committed_pages_of(block):
                    assert (-block.size, block.address, pool.kind) in entries, (
                        f"free {block} holds committed pages and is no decommit candidate"
                    )


class CommitSite(Protocol):
    """What :class:`CommitCap` needs of a pool: its policy and bounds, its committed and
    allocated bytes, giving a whole free segment back, and counting the pages that went
    back or came back.  The caller holds the pool's lock."""

    policy: PoolPolicy
    capacity: int
    max_split_size: int

    @property
    def allocated_bytes(self) -> int: ...
    def committed_bytes(self) -> int: ...
    def releasable_segment(self, segment: Segment) -> bool: ...
    def release_free_segment(self, address: int) -> None: ...
    def count_decommitted(self, block: Block, nbytes: int, ranges: int) -> None: ...
    def count_recommitted(self, block: Block, nbytes: int) -> None: ...


class CommitCap:
    """The commit cap (policy ``decommit``): the pool's :class:`CommitLedger`, and the steps
    that keep committed bytes within the capacity and give free pages back.

    Guarded by the owning pool's lock: every method is called with it held.  Its
    invariants are its ledger's (:meth:`CommitLedger.assert_invariants`).
    """

    __slots__ = ("idle", "ledger", "site")

    def __init__(
        self,
        site: CommitSite,
        idle: IdleKeeping,
        capability: tuple[Decommit, int] | None,
        pools: tuple[BlockPool, BlockPool],
    ) -> None:
        self.site = site
        self.idle = idle  # the pool's idle segments: given back, or their pages, for room
        self.ledger = CommitLedger(capability, pools)

    def decommits(self) -> bool:
        return self.ledger.can_decommit and self.site.policy.decommit

    def caps_commit(self) -> bool:
        """Whether the capacity bounds committed bytes (a pool that decommits), not segment
        bytes: fragmentation of the address space then costs no device memory."""
        return self.decommits()

    def admit(self, block: Block | None, size: int) -> Block | None:
        """``block`` (taken out of its pool, or a new segment's) if the device has room to
        commit the pages ``size`` bytes at its front would take (free pages elsewhere given
        back first, whole free segments released); else None, the block back in its pool
        (a new segment's released)."""
        if block is None or not self.caps_commit():
            return block
        if self.site.committed_bytes() + block.size + 2 * self.ledger.page <= self.site.capacity:
            return block  # whatever it commits fits: its pages rounded out, < 2 pages more
        cost = self.ledger.commit_cost(block, size, self.site.max_split_size)
        if self.commit_room(cost, release_segments=True):
            return block
        assert block.pool is not None
        block.pool.insert(block)
        self.note_candidate(block)  # making room may have popped its entry
        if not block.is_split() and self.site.releasable_segment(
            block.segment
        ):  # as commit_room did to others
            self.site.release_free_segment(block.segment.address)
        return None

    def admit_move(self, block: Block, size: int) -> bool:
        """Whether a compaction move may take ``size`` bytes at the front of the free
        ``block`` (out of its pool): room to commit its pages, made by decommitting free
        pages elsewhere (no segment goes back: the plan may still use every free block)."""
        return self.commit_room(self.ledger.commit_cost(block, size, self.site.max_split_size))

    def commit_room(self, nbytes: int, *, release_segments: bool = False) -> bool:
        """Whether ``nbytes`` more committed bytes fit the capacity, giving back free pages
        (the largest free blocks first: those of split segments, then wholly free segments,
        released when ``release_segments``, else decommitted) until they do.  A free block
        out of its pool (being allocated) is never touched."""
        shortfall = self.site.committed_bytes() + nbytes - self.site.capacity
        if shortfall <= 0:
            return True
        shortfall -= self.ledger.give_back(shortfall, self.decommit_free_block)
        if shortfall <= 0:
            return True
        for block in self.idle.cached_heads():
            if (
                not block.is_split()
                and release_segments
                and self.site.releasable_segment(block.segment)
            ):
                shortfall -= self.ledger.committed_in(block.segment)
                self.site.release_free_segment(block.segment.address)
            else:
                shortfall -= self.decommit_free_block(block, minimum=0)
            if shortfall <= 0:
                break
        return shortfall <= 0

    def recommit(self, block: Block) -> None:
        """A block allocated over decommitted pages: they count as reserved again."""
        recommitted = self.ledger.recommit(block)
        if recommitted:
            self.site.count_recommitted(block, recommitted)

    def decommit_free_block(self, block: Block, minimum: int | None = None) -> int:
        """Give back the whole pages of a free block not given back yet, when the block has
        at least ``minimum`` bytes (default: the policy's decommit_min_bytes), and count
        them; the bytes decommitted now."""
        if minimum is None:
            minimum = self.site.policy.decommit_min_bytes
        decommitted, ranges = self.ledger.decommit(block, minimum)
        if decommitted:
            self.site.count_decommitted(block, decommitted, ranges)
            self.idle.decommitted(block.segment, decommitted)
        return decommitted

    def decommit_excess(self, threshold: float) -> None:
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
        committed = self.site.committed_bytes() - self.idle.committed
        policy = self.site.policy
        target = self.ledger.excess(policy, committed, self.site.allocated_bytes, threshold)
        if target:
            minimum = policy.decommit_min_bytes
            self.ledger.give_back(target, self.decommit_free_block, minimum, DECOMMIT_SCAN_LIMIT)

    def note_candidate(self, block: Block) -> None:
        """A free block that may hold committed whole pages (a freed or split-off one):
        decommit_excess may give them back once its segment is split."""
        if not self.decommits() or not block.is_split():
            return
        self.ledger.note_candidate(block)
