"""The caching pool: each PyTorch policy rule on its own, OOM and retry paths, stats,
summary, snapshot, thread safety and the host backend."""

from __future__ import annotations

import pickle
import random
import threading
from unittest import mock

import numpy as np
import pytest
from tensord.errors import InvalidArgumentError, OutOfMemoryError
from tensord_server.devices.memory import (
    SEGMENT_ALIGNMENT,
    BackendOutOfMemory,
    BookkeepingBackend,
    HostBackend,
    physical_memory_bytes,
)
from tensord_server.pool import (
    LARGE_BUFFER,
    SMALL_BUFFER,
    Block,
    CachingPool,
    external_fragmentation,
    get_allocation_size,
    round_size,
    should_split,
)

KiB = 1 << 10
MiB = 1 << 20

STAT_ARRAYS = (
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


def make_pool(**kwargs: object) -> CachingPool:
    return CachingPool(BookkeepingBackend(), **kwargs)  # type: ignore[arg-type]


# --- pure policy functions -------------------------------------------------------


def test_round_size_is_512_byte_granular() -> None:
    assert [round_size(n) for n in (1, 511, 512, 513, 1024, 1025)] == [
        512,
        512,
        512,
        1024,
        1024,
        1536,
    ]


def test_allocation_size_small_large_and_own_segments() -> None:
    assert get_allocation_size(512) == SMALL_BUFFER
    assert get_allocation_size(MiB) == SMALL_BUFFER
    assert get_allocation_size(MiB + 512) == LARGE_BUFFER
    assert get_allocation_size(10 * MiB - 512) == LARGE_BUFFER
    assert get_allocation_size(10 * MiB) == 10 * MiB
    assert get_allocation_size(10 * MiB + 512) == 12 * MiB


def test_should_split_thresholds() -> None:
    unlimited = (1 << 64) - 1
    assert should_split(1024, 512, small=True, max_split_size=unlimited)  # remainder 512 >= 512
    assert not should_split(1024, 1024, small=True, max_split_size=unlimited)
    assert not should_split(20 * MiB, 19 * MiB, small=False, max_split_size=unlimited)  # == 1 MiB
    assert should_split(20 * MiB, 19 * MiB - 512, small=False, max_split_size=unlimited)
    assert not should_split(100 * MiB, 50 * MiB, small=False, max_split_size=40 * MiB)


# --- pools, best fit, split, merge ----------------------------------------------------


def test_small_requests_pack_into_2mib_segments() -> None:
    pool = make_pool()
    a, b = pool.malloc(1000), pool.malloc(MiB)
    assert a.segment is b.segment and a.segment.size == SMALL_BUFFER
    assert b.address == a.address + 1024 and a.offset == 0 and b.offset == 1024
    large = pool.malloc(MiB + 1)
    assert large.segment.size == LARGE_BUFFER and not large.segment.is_small
    pool.assert_invariants()
    stats = pool.memory_stats()
    assert stats["segment.small_pool.current"] == 1 and stats["segment.large_pool.current"] == 1
    assert stats["reserved_bytes.all.current"] == SMALL_BUFFER + LARGE_BUFFER


def test_best_fit_by_size_then_address() -> None:
    pool = make_pool()
    a = pool.malloc(256 * KiB)
    guard1 = pool.malloc(512)
    b = pool.malloc(128 * KiB)
    guard2 = pool.malloc(512)
    c = pool.malloc(128 * KiB)
    guard3 = pool.malloc(512)
    a_address, b_address = a.address, b.address
    for block in (a, b, c):
        pool.free(block)
    pool.assert_invariants()
    # 100 KiB fits a (256 KiB), b and c (128 KiB each) and the tail: the smallest, lowest wins.
    assert pool.malloc(100 * KiB).address == b_address
    assert pool.malloc(200 * KiB).address == a_address
    pool.assert_invariants()
    del guard1, guard2, guard3


def test_large_remainder_of_one_mib_is_not_split_and_counts_whole() -> None:
    pool = make_pool()
    whole = pool.malloc(19 * MiB)  # a 20 MiB segment; the 1 MiB rest is not worth a block
    assert whole.size == 20 * MiB and not whole.is_split()
    assert pool.memory_stats()["allocated_bytes.all.current"] == 20 * MiB
    assert pool.memory_stats()["requested_bytes.all.current"] == 19 * MiB
    split = pool.malloc(19 * MiB - 512)  # rest 1 MiB + 512 > 1 MiB: split
    assert split.size == 19 * MiB - 512 and split.next is not None
    own = pool.malloc(11 * MiB)  # its own 12 MiB segment; the 1 MiB rest stays attached
    assert own.size == 12 * MiB
    pool.assert_invariants()


def test_blocks_are_reused_only_on_their_stream() -> None:
    pool = make_pool()
    first = pool.malloc(1000, stream=0)
    segment = first.segment
    pool.free(first)
    other = pool.malloc(1000, stream=1)
    assert other.segment is not segment and other.stream == 1
    assert pool.malloc(1000, stream=0).segment is segment
    pool.assert_invariants()


def test_small_split_leaves_512_byte_remainder() -> None:
    pool = make_pool()
    left, hole, right = pool.malloc(512), pool.malloc(1024), pool.malloc(512)
    pool.free(hole)
    taken = pool.malloc(512)
    assert taken.size == 512 and taken.next is not None and taken.next.size == 512
    assert not taken.next.allocated
    pool.assert_invariants()
    del left, right


def test_free_merges_neighbours_in_any_order() -> None:
    pool = make_pool()
    a, b, c = pool.malloc(4096), pool.malloc(4096), pool.malloc(4096)
    segment = a.segment
    pool.free(a)
    pool.free(c)
    stats = pool.memory_stats()
    assert stats["inactive_split.all.current"] == 2  # a, and c merged with the tail
    pool.free(b)
    pool.assert_invariants()
    assert len(segment.blocks()) == 1 and segment.blocks()[0].size == SMALL_BUFFER
    stats = pool.memory_stats()
    assert (
        stats["inactive_split.all.current"] == 0 and stats["inactive_split_bytes.all.current"] == 0
    )


def test_free_never_merges_across_adjacent_segments() -> None:
    pool = make_pool()
    first = [pool.malloc(MiB), pool.malloc(MiB)]  # fills the first segment
    second = pool.malloc(MiB)
    assert second.segment.address == first[0].segment.address + SMALL_BUFFER  # adjacent memory
    for block in [*first, second]:
        pool.free(block)
    pool.assert_invariants()
    assert [len(s.blocks()) for s in (first[0].segment, second.segment)] == [1, 1]
    assert pool.memory_stats()["largest_free_block_bytes.small_pool"] == SMALL_BUFFER


def test_empty_cache_releases_only_whole_free_segments() -> None:
    pool = make_pool()
    keep = pool.malloc(4096)
    spare = pool.malloc(4096)
    big = pool.malloc(30 * MiB)
    pool.free(spare)
    pool.free(big)
    pool.empty_cache()
    pool.assert_invariants()
    stats = pool.memory_stats()
    assert stats["segment.all.current"] == 1 and stats["reserved_bytes.all.current"] == SMALL_BUFFER
    assert stats["num_device_free"] == 1 and stats["num_device_alloc"] == 2
    assert keep.allocated


def test_zero_byte_malloc_takes_no_memory() -> None:
    pool = make_pool()
    block = pool.malloc(0)
    assert block.size == 0 and block.address == 0 and block.offset == 0
    assert pool.memory_stats()["reserved_bytes.all.current"] == 0
    assert pool.memory_stats()["allocation.all.current"] == 0
    pool.free(block)
    pool.assert_invariants()


def test_double_free_and_negative_size_are_refused() -> None:
    pool = make_pool()
    block = pool.malloc(100)
    pool.free(block)
    with pytest.raises(InvalidArgumentError, match="invalid device pointer"):
        pool.free(block)
    with pytest.raises(InvalidArgumentError):
        pool.malloc(-1)
    pool.assert_invariants()


# --- capacity, retries, out of memory ------------------------------------------------


def test_out_of_memory_message_and_consistency() -> None:
    pool = make_pool(capacity=4 * MiB)
    live = pool.malloc(1000)
    with pytest.raises(OutOfMemoryError) as info:
        pool.malloc(3 * MiB)
    assert isinstance(info.value, RuntimeError)
    message = str(info.value)
    assert "Tried to allocate 3.00 MiB" in message
    assert "total capacity of 4.00 MiB of which 2.00 MiB is free" in message
    assert "1024 bytes is allocated by tensord" in message
    assert "2.00 MiB is reserved by tensord but unallocated" in message
    pool.assert_invariants()
    stats = pool.memory_stats()
    assert stats["num_ooms"] == 1 and stats["num_alloc_retries"] == 1
    assert stats["allocation.all.current"] == 1 and stats["allocation.all.allocated"] == 1
    pool.free(live)
    assert pool.malloc(MiB).segment.size == SMALL_BUFFER  # still serves what fits
    pool.assert_invariants()


def test_retry_releases_cached_segments_then_succeeds() -> None:
    pool = make_pool(capacity=22 * MiB)
    pool.free(pool.malloc(1000))  # a cached 2 MiB segment
    pool.free(pool.malloc(11 * MiB))  # a cached 12 MiB segment, too small for what follows
    block = pool.malloc(13 * MiB)  # needs 14 MiB: only fits once the cache is released
    assert block.segment.size == 14 * MiB
    stats = pool.memory_stats()
    assert stats["num_alloc_retries"] == 1 and stats["num_ooms"] == 0
    assert stats["num_device_free"] == 2 and stats["reserved_bytes.all.current"] == 14 * MiB
    assert stats["num_sync_all_streams"] == 1
    pool.assert_invariants()


def test_backend_refusal_is_an_out_of_memory_too() -> None:
    pool = CachingPool(BookkeepingBackend(total_bytes=3 * MiB), capacity=100 * MiB)
    pool.malloc(100)
    with pytest.raises(OutOfMemoryError):
        pool.malloc(100 * KiB * 20)  # 2 MiB more segment: the device itself is full
    assert pool.memory_stats()["num_ooms"] == 1
    pool.assert_invariants()
    with pytest.raises(BackendOutOfMemory):
        BookkeepingBackend(total_bytes=MiB).reserve(2 * MiB)


# --- max_split_size ----------------------------------------------------------------


def test_max_split_size_must_exceed_20_mib() -> None:
    with pytest.raises(ValueError, match="max_split_size"):
        make_pool(max_split_size=20 * MiB)


def test_oversize_block_is_not_given_to_a_smaller_request() -> None:
    pool = make_pool(max_split_size=40 * MiB)
    big = pool.malloc(50 * MiB)
    big_segment = big.segment
    pool.free(big)
    other = pool.malloc(30 * MiB)
    assert other.segment is not big_segment and other.size == 30 * MiB
    pool.assert_invariants()


def test_oversize_request_takes_a_block_less_than_20_mib_bigger() -> None:
    pool = make_pool(max_split_size=40 * MiB)
    pool.free(pool.malloc(60 * MiB))
    refused = pool.malloc(40 * MiB)  # 60 >= 40 + 20: would waste 20 MiB
    assert refused.segment.size == 40 * MiB
    taken = pool.malloc(41 * MiB)  # 60 < 41 + 20: taken whole, never split
    assert taken.size == 60 * MiB and not taken.is_split()
    stats = pool.memory_stats()
    assert stats["oversize_allocations.current"] == 2 and stats["oversize_segments.current"] == 2
    assert stats["max_split_size"] == 40 * MiB
    pool.assert_invariants()


def test_release_available_cached_blocks_frees_one_oversize_segment() -> None:
    pool = make_pool(max_split_size=40 * MiB, capacity=60 * MiB)
    pool.free(pool.malloc(50 * MiB))
    block = pool.malloc(30 * MiB)  # may not use the 50 MiB block, and no room beside it
    assert block.segment.size == 30 * MiB
    stats = pool.memory_stats()
    assert stats["num_device_free"] == 1 and stats["num_alloc_retries"] == 0
    pool.assert_invariants()


def test_release_available_cached_blocks_frees_several_largest_first() -> None:
    pool = make_pool(max_split_size=40 * MiB, capacity=86 * MiB)
    a, b = pool.malloc(42 * MiB), pool.malloc(44 * MiB)
    pool.free(a)
    pool.free(b)
    block = pool.malloc(60 * MiB)
    assert block.segment.size == 60 * MiB
    stats = pool.memory_stats()
    assert stats["num_device_free"] == 2 and stats["num_alloc_retries"] == 0
    pool.assert_invariants()


# --- statistics ---------------------------------------------------------------------


def test_memory_stats_has_torch_keys_and_extras() -> None:
    pool = make_pool()
    stats = pool.memory_stats()
    for name in STAT_ARRAYS:
        for kind in ("all", "small_pool", "large_pool"):
            for field in ("current", "peak", "allocated", "freed"):
                assert f"{name}.{kind}.{field}" in stats
    for key in ("num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free"):
        assert stats[key] == 0
    assert stats["max_split_size"] == -1
    for kind in ("all", "small_pool", "large_pool"):
        assert stats[f"largest_free_block_bytes.{kind}"] == 0
        assert stats[f"external_fragmentation.{kind}"] == 0.0
    assert list(stats) == sorted(stats)


def test_external_fragmentation_figures() -> None:
    assert external_fragmentation(0, 0) == 0.0
    assert external_fragmentation(3, 4) == pytest.approx(0.25)
    assert external_fragmentation(3, 8, releasable_bytes=5) == pytest.approx(3 / 8)
    assert external_fragmentation(3, 8, releasable_bytes=8) == 0.0
    pool = make_pool()
    a, guard = pool.malloc(MiB // 2), pool.malloc(512)
    pool.free(a)  # free: 512 KiB hole and the 2 MiB - 512 KiB - 512 B tail
    stats = pool.memory_stats()
    tail = SMALL_BUFFER - MiB // 2 - 512
    assert stats["largest_free_block_bytes.small_pool"] == tail
    assert stats["external_fragmentation.small_pool"] == pytest.approx(1 - tail / (tail + MiB // 2))
    assert stats["external_fragmentation.large_pool"] == 0.0
    del guard


def test_an_idle_cache_is_reserved_not_fragmented() -> None:
    # whole free segments count as one: torch's OOM path releases them and reserves one
    # segment in their place, so a cache holding no allocation reads 0, not 1 - 30/52
    pool = make_pool()
    blocks = [pool.malloc(5 * MiB), pool.malloc(30 * MiB), pool.malloc(1000)]
    for block in blocks:
        pool.free(block)
    stats = pool.memory_stats()
    assert stats["allocated_bytes.all.current"] == 0 and stats["segment.all.current"] == 3
    assert stats["releasable_bytes.all"] == stats["reserved_bytes.all.current"] == 52 * MiB
    assert stats["largest_free_block_bytes.all"] == 30 * MiB
    for kind in ("all", "small_pool", "large_pool"):
        assert stats[f"external_fragmentation.{kind}"] == 0.0
    pool.empty_cache()
    assert pool.memory_stats()["releasable_bytes.all"] == 0


def test_fragmentation_counts_holes_against_the_releasable_segments() -> None:
    pool = make_pool()
    hole, guard = pool.malloc(6 * MiB), pool.malloc(6 * MiB)  # one 20 MiB segment
    whole = pool.malloc(9 * MiB)  # a second 20 MiB segment (below 10 MiB: not its own size)
    pool.free(hole)
    pool.free(whole)  # free: a 6 MiB hole, the 8 MiB tail, a whole 20 MiB segment
    stats = pool.memory_stats()
    assert stats["releasable_bytes.large_pool"] == 20 * MiB
    assert stats["external_fragmentation.large_pool"] == pytest.approx(1 - 20 / 34)
    pool.empty_cache()  # only the split segment's holes are left
    stats = pool.memory_stats()
    assert stats["releasable_bytes.large_pool"] == 0
    assert stats["external_fragmentation.large_pool"] == pytest.approx(1 - 8 / 14)
    pool.assert_invariants()
    del guard


def test_peaks_and_reset() -> None:
    pool = make_pool()
    blocks = [pool.malloc(MiB) for _ in range(4)]
    for block in blocks:
        pool.free(block)
    stats = pool.memory_stats()
    assert (
        stats["allocated_bytes.all.peak"] == 4 * MiB and stats["allocated_bytes.all.current"] == 0
    )
    assert stats["allocated_bytes.all.allocated"] == stats["allocated_bytes.all.freed"] == 4 * MiB
    pool.reset_peak_memory_stats()
    stats = pool.memory_stats()
    assert stats["allocated_bytes.all.peak"] == 0
    assert (
        stats["reserved_bytes.all.peak"] == stats["reserved_bytes.all.current"] == 2 * SMALL_BUFFER
    )
    pool.reset_accumulated_memory_stats()
    assert pool.memory_stats()["allocated_bytes.all.allocated"] == 0


@pytest.mark.torch
def test_memory_summary_matches_torch_layout() -> None:
    torch_memory = pytest.importorskip("torch.cuda.memory")
    pool = CachingPool(BookkeepingBackend(device="cuda:0"))  # a GPU's words: torch's
    live = [pool.malloc(n) for n in (100, 5 * MiB, 30 * MiB, 700_000)]
    pool.free(live[0])
    with mock.patch.object(torch_memory, "memory_stats", lambda device=None: pool.memory_stats()):
        theirs = torch_memory.memory_summary(device=0).splitlines()
    ours = pool.memory_summary().splitlines()
    assert len(ours) == len(theirs)
    differing = [i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b]
    assert differing == [1]  # only the title line names tensord
    assert "tensord memory summary, device cuda:0" in ours[1] and len(ours[1]) == len(theirs[1])


def test_a_host_memory_summary_says_no_gpu_and_keeps_the_layout() -> None:
    # the cpu pool's table spoke of "CUDA OOMs", "cudaMalloc retries", "GPU reserved memory"
    live = [(n, None) for n in (100, 5 * MiB, 30 * MiB)]
    summaries = {}
    for device in ("cpu", "cuda:0"):
        pool = CachingPool(BookkeepingBackend(device=device))
        live = [(n, pool.malloc(n)) for n, _ in live]
        summaries[device] = pool.memory_summary().splitlines()
    host, gpu = summaries["cpu"], summaries["cuda:0"]
    text = "\n".join(host)
    assert "GPU" not in text and "CUDA" not in text and "cuda" not in text, text
    assert "Reserved memory" in text and "Reserved segments" in text and "OOMs: 0" in text
    assert "alloc retries: 0" in text
    assert "GPU reserved memory" in "\n".join(gpu) and "cudaMalloc retries" in "\n".join(gpu)
    assert [len(line) for line in host] == [len(line) for line in gpu]
    assert [line.count("|") for line in host] == [line.count("|") for line in gpu]


# --- snapshots --------------------------------------------------------------------


def test_snapshot_structure_and_pickling() -> None:
    pool = make_pool(record_history=True)
    a, b = pool.malloc(1000), pool.malloc(30 * MiB)
    pool.free(a)
    snapshot = pool.memory_snapshot()
    assert pickle.loads(pickle.dumps(snapshot)) == snapshot
    assert set(snapshot) == {"segments", "device_traces", "allocator_settings"}
    segments = snapshot["segments"]
    assert [s["segment_type"] for s in segments] == ["small", "large"]
    for segment in segments:
        assert sum(block["size"] for block in segment["blocks"]) == segment["total_size"]
        assert segment["blocks"][0]["address"] == segment["address"]
        assert {
            "device",
            "stream",
            "allocated_size",
            "active_size",
            "requested_size",
            "segment_pool_id",
            "is_expandable",
            "frames",
        } <= set(segment)
    assert segments[0]["blocks"][0]["state"] == "inactive"
    assert segments[1]["blocks"][0]["state"] == "active_allocated"
    assert segments[1]["allocated_size"] == 30 * MiB
    actions = [entry["action"] for entry in snapshot["device_traces"][0]]
    assert actions == [
        "segment_alloc",
        "alloc",
        "segment_alloc",
        "alloc",
        "free_requested",
        "free_completed",
        "snapshot",
    ]
    entry = snapshot["device_traces"][0][1]
    assert entry["size"] == 1000 and entry["addr"] == a.address and "time_us" in entry
    del b


def test_snapshot_without_history_has_empty_trace() -> None:
    pool = make_pool()
    pool.malloc(10)
    assert pool.memory_snapshot()["device_traces"] == [[]]


def test_oom_is_recorded_in_trace() -> None:
    pool = make_pool(capacity=MiB, record_history=True)
    with pytest.raises(OutOfMemoryError):
        pool.malloc(10)
    oom = pool.memory_snapshot()["device_traces"][0][-2]  # the last is the snapshot itself
    assert oom["action"] == "oom" and oom["device_free"] == MiB and oom["size"] == 512


@pytest.mark.torch
def test_snapshot_opens_in_memory_viz() -> None:
    memory_viz = pytest.importorskip("torch.cuda._memory_viz")
    pool = make_pool(record_history=True)
    live = [pool.malloc(n) for n in (100, 5 * MiB, 30 * MiB, 700_000)]
    pool.free(live[1])
    snapshot = pool.memory_snapshot()
    assert "segments: 3" in memory_viz.segsum(snapshot)
    assert "<html" in memory_viz.trace_plot(snapshot).lower()
    assert "<html" in memory_viz.segment_plot(snapshot).lower()


# --- threads --------------------------------------------------------------------------


def test_many_threads_share_one_pool() -> None:
    pool = make_pool(capacity=512 * MiB)
    threads_count, steps = 8, 150
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        live: list[Block] = []
        try:
            for _ in range(steps):
                if live and rng.random() < 0.45:
                    pool.free(live.pop(rng.randrange(len(live))))
                else:
                    live.append(
                        pool.malloc(rng.choice((rng.randint(1, 4096), rng.randint(1, 3 * MiB))))
                    )
            for block in live:
                pool.free(block)
        except BaseException as exc:  # reported to the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(threads_count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors and not any(thread.is_alive() for thread in threads)
    pool.assert_invariants()
    stats = pool.memory_stats()
    assert stats["allocation.all.current"] == 0 and stats["allocated_bytes.all.current"] == 0
    assert stats["allocation.all.allocated"] == stats["allocation.all.freed"] > 0


# --- host backend --------------------------------------------------------------------


def test_host_backend_segments_are_aligned_real_memory() -> None:
    backend = HostBackend()
    memory = backend.reserve(4096)
    assert memory.address % SEGMENT_ALIGNMENT == 0
    assert memory.address == backend.view(memory, 0, 4096).ctypes.data
    backend.write(memory, 100, b"hello")
    assert backend.read(memory, 100, 5) == b"hello"
    view = backend.view(memory, 100, 5)
    view[0] = ord("j")
    assert backend.read(memory, 100, 5) == b"jello"  # the view is zero-copy
    with pytest.raises(IndexError):
        backend.read(memory, 4000, 200)
    backend.release(memory)
    if physical_memory_bytes() > 0:
        assert backend.total_bytes == physical_memory_bytes() // 2


def test_pool_on_host_backend_hands_out_usable_bytes() -> None:
    backend = HostBackend(total_bytes=64 * MiB)
    pool = CachingPool(backend)
    assert pool.capacity == 64 * MiB and pool.device == "cpu"
    a, b = pool.malloc(1000), pool.malloc(3000)
    backend.write(b.segment.memory, b.offset, bytes(range(256)) * 4)
    array = backend.view(b.segment.memory, b.offset, 1024)
    assert isinstance(array, np.ndarray) and array.ctypes.data == b.address
    assert backend.read(b.segment.memory, b.offset, 256) == bytes(range(256))
    assert backend.view(pool.malloc(0).segment.memory, 0, 0).size == 0
    pool.free(a)
    pool.free(b)
    pool.empty_cache()
    assert pool.memory_stats()["reserved_bytes.all.current"] == 0


def test_bookkeeping_backend_has_no_bytes() -> None:
    backend = BookkeepingBackend()
    memory = backend.reserve(3 * MiB + 1)
    assert backend.reserve(512).address == memory.address + 3 * MiB + 512
    with pytest.raises(NotImplementedError):
        backend.view(memory, 0, 1)
