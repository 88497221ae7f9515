"""A pool's invariants, checked over what it holds: :func:`check_pool_invariants`.

Every invariant written beside the fields of Segment, Block, BlockPool, the statistics and
the pool's collaborators (the commit ledger, the idle segments, consolidation), checked
over a :class:`PoolParts` the pool gives under its lock; the tests call it (through
``CachingPool.assert_invariants``) after every mutation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from tensord_server.pool.blocks import (
    ALL,
    LARGE_POOL,
    MIN_BLOCK_SIZE,
    SMALL_POOL,
    Block,
    BlockPool,
    Segment,
)
from tensord_server.pool.commit import CommitLedger
from tensord_server.pool.compaction import (
    SegmentShape,
    segment_shape,
)
from tensord_server.pool.consolidation import Consolidation
from tensord_server.pool.idle import IdleKeeping
from tensord_server.pool.stats import (
    STAT_ARRAY_NAMES,
    DeviceStats,
)


class PoolParts(NamedTuple):
    """What a pool's invariants are checked over: its state, and the bounds it is held to."""

    segments: Mapping[int, Segment]  # segment address -> segment
    small: BlockPool
    large: BlockPool
    stats: DeviceStats
    ledger: CommitLedger
    decommits: bool  # whether the policy decommits, on a backend that can
    idle: IdleKeeping
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
