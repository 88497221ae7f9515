"""PyTorch's caching allocator, twinned: knows nothing of tensors, sessions or gRPC.

- :mod:`.backend`: the memory interface the pool allocates from (implemented in ``devices``)
- :mod:`.blocks`: size rules, Segment, Block, BlockPool
- :mod:`.stats`: Stat, DeviceStats, the summary table and the snapshot
- :mod:`.compaction`: compaction planning (pure) and its execution through two narrow
  interfaces (the pool's MoveTarget, the owner's Relocator)
- :mod:`.policy`: what a pool does beyond PyTorch (``pytorch``, ``oom-compaction``, ``adaptive``)
- :mod:`.commit`: the commit ledger, each segment's decommitted pages, and the commit cap's
  steps over it (policy ``decommit``), over the narrow ``CommitSite`` the pool gives
- :mod:`.idle`: the wholly free segments, which are kept and giving them back (policy
  ``release_idle_s``), over the narrow ``IdleSite`` the pool gives
- :mod:`.consolidation`: when free bytes go back beyond PyTorch (the thresholds, the edge)
- :mod:`.cache`: :class:`~.cache.BlockCache`, one device's blocks and segments and
  PyTorch's steps over them (alloc_block, free_block, release_block, ...), the bounds
  under a commit cap, and the sites its collaborators act through
- :mod:`.pressure`: :class:`~.pressure.PressureSteps`, what a pool does under pressure
  beyond PyTorch (the out-of-memory steps, consolidation, the thresholds after a free),
  over the narrow :class:`~.pressure.PressureSite` the pool gives it
- :mod:`.moves`: :class:`PoolMoves`, the pool as compaction's MoveTarget, over the narrow
  :class:`MoveSite` the pool gives it
- :mod:`.invariants`: :func:`check_pool_invariants` over the :class:`PoolParts` a pool gives
- :mod:`.history`: :class:`MemoryHistory`, the device trace of _record_memory_history
- :mod:`.allocator`: :class:`CachingPool`, PyTorch's policy (malloc, free, release,
  empty_cache), the statistics and its out-of-memory errors, over the modules above under
  its one lock

The names other layers use are re-exported here.
"""

from tensord_server.pool.allocator import CachingPool
from tensord_server.pool.backend import (
    NULL_MEMORY,
    SEGMENT_ALIGNMENT,
    Backend,
    BackendOutOfDescriptors,
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
from tensord_server.pool.cache import BlockCache
from tensord_server.pool.compaction import (
    CompactionPlan,
    CompactionResult,
    Move,
    MoveTarget,
    Relocator,
    SegmentUsage,
    background_evacuation_order,
    compact,
    compact_step,
    evacuation_order,
    place,
    plan_compaction,
)
from tensord_server.pool.history import TRACE_MAX_ENTRIES, MemoryHistory
from tensord_server.pool.invariants import PoolParts, check_pool_invariants
from tensord_server.pool.locks import CountingLock
from tensord_server.pool.moves import MoveSite, PoolMoves
from tensord_server.pool.policy import (
    DEFAULT_POLICY,
    POLICIES,
    PoolPolicy,
    default_warm_reserve,
    policy_named,
)
from tensord_server.pool.stats import DeviceStats, Stat, external_fragmentation, format_summary

__all__ = [
    "DEFAULT_POLICY",
    "LARGE_BUFFER",
    "MIN_BLOCK_SIZE",
    "NULL_MEMORY",
    "POLICIES",
    "SEGMENT_ALIGNMENT",
    "SMALL_BUFFER",
    "SMALL_SIZE",
    "TRACE_MAX_ENTRIES",
    "Backend",
    "BackendOutOfDescriptors",
    "BackendOutOfMemory",
    "Block",
    "BlockCache",
    "BlockPool",
    "CachingPool",
    "CompactionPlan",
    "CompactionResult",
    "CountingLock",
    "DeviceMemory",
    "DeviceStats",
    "MemoryHistory",
    "Move",
    "MoveSite",
    "MoveTarget",
    "PoolMoves",
    "PoolParts",
    "PoolPolicy",
    "Relocator",
    "Segment",
    "SegmentUsage",
    "Stat",
    "background_evacuation_order",
    "check_pool_invariants",
    "compact",
    "compact_step",
    "default_warm_reserve",
    "evacuation_order",
    "external_fragmentation",
    "format_summary",
    "get_allocation_size",
    "place",
    "plan_compaction",
    "policy_named",
    "round_size",
    "should_split",
]
