"""The pool as compaction's MoveTarget: :class:`PoolMoves`, over a narrow :class:`MoveSite`.

:mod:`.compaction` plans moves over numbers and executes them through a
:class:`~.compaction.MoveTarget`; :class:`PoolMoves` is the pool's, built for one plan.
It sees the pool only through :class:`MoveSite`: the segments by address, a free block
taken for a moved Storage, segments given back, sized and reserved, and a copy with the
pool's lock let go.  The caller holds the pool's lock throughout.
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Collection, Iterator, Mapping
from dataclasses import replace
from typing import Protocol

from tensord_server.pool.backend import (
    Backend,
)
from tensord_server.pool.blocks import (
    Block,
    Segment,
    oversize_rules_allow,
    should_split,
)
from tensord_server.pool.compaction import (
    MoveTarget,
    SegmentShape,
    SegmentUsage,
    blocks_may_move,
)


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
    def allocate_for_move(
        self, target: Block, size: int, requested: int, exact: bool = False
    ) -> Block | None: ...
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

    def allocate_in_place(
        self, source: Block, destination: int, size: int, exact: bool = False
    ) -> Block | None:
        block_pool = source.pool
        assert block_pool is not None and source.allocated, source
        target = block_pool.free_blocks[destination]
        return self.pool.allocate_for_move(target, size, source.requested_size, exact)

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
