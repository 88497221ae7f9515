"""The pool's statistics and reports: torch's Stat/DeviceStats, summary table and snapshot.

Counters keep torch's ``memory_stats()`` names and move exactly as torch's do; the
summary is ``torch.cuda.memory_summary``'s table and the snapshot is the dict
``torch.cuda.memory._snapshot()`` returns (what ``memory_viz`` reads).
"""

from __future__ import annotations

from typing import Any

from tensord_server.pool.blocks import (
    ALL,
    Segment,
)

# The StatArrays of memory_stats(), in torch's order.
STAT_ARRAY_NAMES = (
    "allocation",
    "segment",
    "active",
    "inactive_split",
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "requested_bytes",
)


# ---------------------------------------------------------------------------
# Statistics


class Stat:
    """One torch Stat.  Invariants: 0 <= current <= peak; allocated - freed == current
    unless reset_accumulated_memory_stats() ran since."""

    __slots__ = ("allocated", "current", "freed", "peak")

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0
        self.allocated = 0
        self.freed = 0

    def increase(self, amount: int) -> None:
        self.current += amount
        if self.current > self.peak:
            self.peak = self.current
        self.allocated += amount

    def decrease(self, amount: int) -> None:
        self.current -= amount
        self.freed += amount


# One Stat per StatType: [all, small_pool, large_pool].
StatArray = list[Stat]


def new_stat_array() -> StatArray:
    return [Stat(), Stat(), Stat()]


def increase(array: StatArray, kind: int, amount: int) -> None:
    """increase_stat on the aggregate and on one pool's Stat (for_each_selected_stat_type)."""
    array[ALL].increase(amount)
    array[kind].increase(amount)


def decrease(array: StatArray, kind: int, amount: int) -> None:
    array[ALL].decrease(amount)
    array[kind].decrease(amount)


class DeviceStats:
    """torch's DeviceStats: one StatArray per name in STAT_ARRAY_NAMES plus counters."""

    def __init__(self) -> None:
        self.allocation = new_stat_array()  # allocated blocks
        self.segment = new_stat_array()  # segments reserved from the backend
        self.active = new_stat_array()  # blocks in use (== allocation: no cross-stream events)
        self.inactive_split = new_stat_array()  # free blocks inside split segments
        self.allocated_bytes = new_stat_array()  # sum of allocated block sizes
        # sum of segment sizes, less decommitted_bytes (policy ``decommit``)
        self.reserved_bytes = new_stat_array()
        self.active_bytes = new_stat_array()
        self.inactive_split_bytes = new_stat_array()  # non-releasable cached bytes
        self.requested_bytes = new_stat_array()  # sum of the sizes callers asked for
        self.oversize_allocations = Stat()  # allocated blocks >= max_split_size
        self.oversize_segments = Stat()  # segments >= max_split_size
        self.num_alloc_retries = (
            0  # allocations that succeeded or failed after release_cached_blocks
        )
        self.num_ooms = 0  # OutOfMemoryErrors raised
        self.num_sync_all_streams = 0  # release_cached_blocks calls (they synchronize in torch)
        self.num_device_alloc = 0  # backend.reserve calls that succeeded
        self.num_device_free = 0  # backend.release calls
        # beyond torch (compaction):
        self.num_compactions = 0  # compactions that moved blocks and released segments
        self.compaction_moved_bytes = 0  # bytes copied to new blocks
        self.compaction_released_bytes = 0  # bytes of the segments they released
        # beyond torch (policy decommit): pages of segments that hold none, free ranges given
        # back to the device or never used since the segment was reserved (reserved_bytes
        # counts the rest, as torch's expandable segments count mapped pages); allocated:
        # bytes decommitted, freed: recommitted or released
        self.decommitted_bytes = new_stat_array()
        self.num_decommits = 0  # ranges decommitted (one backend call each)

    def arrays(self) -> dict[str, StatArray]:
        return {name: getattr(self, name) for name in STAT_ARRAY_NAMES}

    def all_stats(self) -> list[Stat]:
        stats = [stat for array in self.arrays().values() for stat in array]
        return [
            *stats,
            self.oversize_allocations,
            self.oversize_segments,
            *self.decommitted_bytes,
        ]


# ---------------------------------------------------------------------------
# Pure helpers for compaction, stats, summaries and snapshots


def external_fragmentation(largest_free: int, free_bytes: int, releasable_bytes: int = 0) -> float:
    """The share of the cache's free bytes that one allocation could not use:
    ``1 - max(largest_free, releasable_bytes) / free_bytes``.

    ``releasable_bytes`` are the whole free segments the pool may give back (what
    ``empty_cache`` returns): they count together, as one block, because torch's
    out-of-memory path releases them and reserves one segment in their place.  So the
    figure is 0.0 when the free memory is one block, when it is all in segments holding no
    allocation (an idle cache is reserved, not fragmented), or when there is none.
    """
    if free_bytes <= 0:
        return 0.0
    return 1.0 - max(largest_free, releasable_bytes) / free_bytes


def stat_items(prefix: str, stat: Stat) -> dict[str, int]:
    return {
        f"{prefix}.current": stat.current,
        f"{prefix}.peak": stat.peak,
        f"{prefix}.allocated": stat.allocated,
        f"{prefix}.freed": stat.freed,
    }


def segment_info(segment: Segment, device: int) -> dict[str, Any]:
    """One segment of _snapshot(), as torch's _memory_snapshot_pickled writes it."""
    return segment_part_info(segment, device)[0]


def segment_part_info(
    segment: Segment, device: int, after_block: int = -1, max_blocks: int | None = None
) -> tuple[dict[str, Any], bool]:
    """segment_info holding only the blocks after address ``after_block``, at most
    ``max_blocks`` of them (a page of a snapshot; the header is the whole segment's), and
    whether those are all its blocks after that address."""
    blocks: list[dict[str, Any]] = []
    allocated_size = requested_size = 0
    complete = True
    for block in segment.blocks():
        if block.address > after_block:
            if max_blocks is not None and len(blocks) >= max_blocks:
                complete = False
            else:
                blocks.append(
                    {
                        "address": block.address,
                        "size": block.size,
                        "requested_size": block.requested_size,
                        "state": "active_allocated" if block.allocated else "inactive",
                        "frames": [],
                    }
                )
        if block.allocated:
            allocated_size += block.size
            requested_size += block.requested_size
    info = {
        "device": device,
        "address": segment.address,
        "total_size": segment.size,
        "allocated_size": allocated_size,
        "active_size": allocated_size,  # no block awaits a cross-stream free
        "requested_size": requested_size,
        "stream": segment.stream,
        "segment_type": "small" if segment.is_small else "large",
        "segment_pool_id": (0, 0),
        "is_expandable": False,
        "frames": [],
        "blocks": blocks,
    }
    return info, complete


def _format_size_cell(size: int, preferred: float) -> str:
    """memory_summary's _format_size: the unit follows the first (aggregate) value of the row group."""
    prefix = "B  "
    for new_prefix in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        if preferred < 768 * 1024:
            break
        prefix = new_prefix
        size //= 1024
        preferred /= 1024
    return f"{size:6d} {prefix}"


def _format_count_cell(count: int, preferred: float) -> str:
    prefix = " "
    for new_prefix in ("K", "M"):
        if preferred < 750 * 1000:
            break
        prefix = new_prefix
        count //= 1000
        preferred /= 1000
    return f"{count:7d} {prefix} "


SUMMARY_METRICS = (
    ("allocated_bytes", "Allocated memory", _format_size_cell),
    ("active_bytes", "Active memory", _format_size_cell),
    ("requested_bytes", "Requested memory", _format_size_cell),
    ("reserved_bytes", "GPU reserved memory", _format_size_cell),
    ("inactive_split_bytes", "Non-releasable memory", _format_size_cell),
    ("allocation", "Allocations", _format_count_cell),
    ("active", "Active allocs", _format_count_cell),
    ("segment", "GPU reserved segments", _format_count_cell),
    ("inactive_split", "Non-releasable allocs", _format_count_cell),
)

SUMMARY_WIDTH = 75  # memory_summary's table width

# torch's words for a GPU -> the same cell of another device's summary (no GPU or CUDA in it)
HOST_WORDS = {
    "CUDA OOMs": "OOMs",
    "cudaMalloc retries": "alloc retries",
    "GPU reserved memory": "Reserved memory",
    "GPU reserved segments": "Reserved segments",
    "Oversize GPU segments": "Oversize segments",
}


def is_gpu(device: str) -> bool:
    return device.partition(":")[0] == "cuda"


def format_summary(stats: dict[str, int | float], device: str, abbreviated: bool = False) -> str:
    """Mirrors torch.cuda.memory_summary's layout line for line (the title names tensord);
    on a device that is not a GPU, torch's GPU and CUDA words become ``HOST_WORDS``'."""

    def words(text: str) -> str:
        return text if is_gpu(device) else HOST_WORDS.get(text, text)

    lines = ["=" * SUMMARY_WIDTH]
    lines.append(f" {'':16} tensord memory summary, device {device}".ljust(SUMMARY_WIDTH))
    lines.append("-" * SUMMARY_WIDTH)
    lines.append(
        f"  {'':9} {words('CUDA OOMs'):>9}: {int(stats['num_ooms']):<12d} | "
        f"{'':6} {words('cudaMalloc retries'):>18}: {int(stats['num_alloc_retries']):<8d}  "
    )
    lines.append("=" * SUMMARY_WIDTH)
    lines.append("        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  ")
    for key, name, cell in SUMMARY_METRICS:
        lines.append("-" * SUMMARY_WIDTH)
        rows = [("all", name)]
        if not abbreviated:
            rows += [
                ("large_pool", "      from large pool"),
                ("small_pool", "      from small pool"),
            ]
        preferred: list[int] = []
        for kind, row_name in rows:
            values = [
                int(stats[f"{key}.{kind}.{field}"])
                for field in ("current", "peak", "allocated", "freed")
            ]
            preferred = preferred or values
            cells = " | ".join(cell(v, p) for v, p in zip(values, preferred, strict=True))
            lines.append(f" {words(row_name):<21} | {cells} ")
    for key, name in (
        ("oversize_allocations", "Oversize allocations"),
        ("oversize_segments", "Oversize GPU segments"),
    ):
        lines.append("-" * SUMMARY_WIDTH)
        values = [
            int(stats[f"{key}.{field}"]) for field in ("current", "peak", "allocated", "freed")
        ]
        cells = " | ".join(_format_count_cell(v, v) for v in values)
        lines.append(f" {words(name):<21} | {cells} ")
    lines.append("=" * SUMMARY_WIDTH)
    return "|" + "|\n|".join(lines) + "|\n"
