"""PyTorch's caching allocator, twinned: knows nothing of tensors, sessions or gRPC.

- :mod:`.backend`: the memory interface the pool allocates from (implemented in ``devices``)
- :mod:`.blocks`: size rules, Segment, Block, BlockPool
- :mod:`.stats`: Stat, DeviceStats, the summary table and the snapshot
- :mod:`.compaction`: compaction planning (pure), executed by the allocator via a Relocator
- :mod:`.allocator`: :class:`CachingPool`, the policy (malloc, free, release, empty_cache)

The names other layers use are re-exported here.
"""

from tensord_server.pool.allocator import (
    TRACE_MAX_ENTRIES,
    CachingPool,
    Relocator,
    check_pool_invariants,
)
from tensord_server.pool.backend import (
    NULL_MEMORY,
    SEGMENT_ALIGNMENT,
    Backend,
    BackendOutOfMemory,
    DeviceMemory,
)
from tensord_server.pool.blocks import (
    LARGE_BUFFER,
    MIN_BLOCK_SIZE,
    SMALL_BUFFER,
    SMALL_SIZE,
    Block,
    BlockPool,
    Segment,
    get_allocation_size,
    round_size,
    should_split,
)
from tensord_server.pool.compaction import (
    CompactionPlan,
    Move,
    SegmentUsage,
    evacuation_order,
    place,
    plan_compaction,
)
from tensord_server.pool.stats import DeviceStats, Stat, external_fragmentation, format_summary

__all__ = [
    "LARGE_BUFFER",
    "MIN_BLOCK_SIZE",
    "NULL_MEMORY",
    "SEGMENT_ALIGNMENT",
    "SMALL_BUFFER",
    "SMALL_SIZE",
    "TRACE_MAX_ENTRIES",
    "Backend",
    "BackendOutOfMemory",
    "Block",
    "BlockPool",
    "CachingPool",
    "CompactionPlan",
    "DeviceMemory",
    "DeviceStats",
    "Move",
    "Relocator",
    "Segment",
    "SegmentUsage",
    "Stat",
    "check_pool_invariants",
    "evacuation_order",
    "external_fragmentation",
    "format_summary",
    "get_allocation_size",
    "place",
    "plan_compaction",
    "round_size",
    "should_split",
]
