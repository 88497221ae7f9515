"""Property test: random alloc/free/empty_cache sequences keep every pool invariant.

After every step, ``assert_invariants`` checks that blocks tile their segment
exactly with no overlap, free neighbours are merged, the free lists hold exactly
the free blocks, and every statistic equals the sum recomputed from the blocks.
The test also checks the caller's view: live blocks never overlap and
``allocated_bytes`` is the sum of their sizes.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensord.errors import OutOfMemoryError
from tensord_server.devices.memory import BookkeepingBackend
from tensord_server.pool import Block, CachingPool

MiB = 1 << 20

# Sizes that exercise both pools, the 1-10 MiB shared segments and own segments.
sizes = st.one_of(
    st.integers(0, 4096),
    st.integers(1, 2 * MiB),
    st.integers(MiB, 12 * MiB),
    st.integers(10 * MiB, 48 * MiB),
)

# ("alloc", size, stream) | ("free", index into the live blocks, 0) | ("empty_cache", 0, 0)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), sizes, st.sampled_from([0, 0, 0, 7])),
        st.tuples(st.just("free"), st.integers(0, 1000), st.just(0)),
        st.tuples(st.just("empty_cache"), st.just(0), st.just(0)),
    ),
    max_size=60,
)


def check_live_blocks(pool: CachingPool, live: list[Block]) -> None:
    spans = sorted((b.address, b.address + b.size) for b in live if b.size)
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))
    stats = pool.memory_stats()
    assert stats["allocated_bytes.all.current"] == sum(b.size for b in live)
    assert stats["requested_bytes.all.current"] == sum(b.requested_size for b in live if b.size)
    assert stats["reserved_bytes.all.current"] <= pool.capacity


@pytest.mark.slow
@settings(
    derandomize=True,
    database=None,
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    ops=operations,
    max_split_size=st.sampled_from([None, 24 * MiB]),
    capacity=st.sampled_from([None, 64 * MiB]),
)
def test_random_sequences_keep_invariants(
    ops: list[tuple[str, int, int]], max_split_size: int | None, capacity: int | None
) -> None:
    pool = CachingPool(BookkeepingBackend(), capacity=capacity, max_split_size=max_split_size)
    live: list[Block] = []
    ooms = 0
    for action, value, stream in ops:
        if action == "alloc":
            try:
                live.append(pool.malloc(value, stream))
            except OutOfMemoryError:
                ooms += 1
        elif action == "free" and live:
            pool.free(live.pop(value % len(live)))
        elif action == "empty_cache":
            pool.empty_cache()
        pool.assert_invariants()
        check_live_blocks(pool, live)
    assert pool.memory_stats()["num_ooms"] == ooms
    for block in live:
        pool.free(block)
    pool.empty_cache()
    pool.assert_invariants()
    stats = pool.memory_stats()
    assert stats["reserved_bytes.all.current"] == 0 and stats["segment.all.current"] == 0
    assert stats["num_device_alloc"] == stats["num_device_free"]
