"""The pool's collaborators: the commit cap and its ledger, the idle segments, consolidation.

Each owns its fields and checks its invariants from ``CachingPool.assert_invariants``:
these tests run their rules on plain numbers and segments, and break each invariant on
purpose to see the pool's check name it.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import random
from collections.abc import Callable

import pytest
from tensord_server.devices.memory import BookkeepingBackend
from tensord_server.pool import (
    BlockCache,
    CachingPool,
    DeviceMemory,
    PoolMoves,
    Segment,
    commit,
    idle,
    moves,
    policy_named,
    pressure,
)
from tensord_server.pool.commit import CommitCap
from tensord_server.pool.consolidation import Consolidation
from tensord_server.pool.idle import IdleKeeping, IdleSegments
from tensord_server.pool.pressure import PressureSteps
from test_pool_figures import DecommittingBackend

MiB = 1 << 20
PAGE = 4096
ADAPTIVE = policy_named("adaptive")
# decommits nothing after a free: holes stay committed, candidates for making room
HOLES_STAY = dataclasses.replace(ADAPTIVE, decommit_threshold=100.0)


def segment(address: int, nbytes: int) -> Segment:
    return Segment(DeviceMemory(address=address, nbytes=nbytes), stream=0, is_small=False)


def decommitting_pool() -> CachingPool:
    """One 20 MiB segment of [6 MiB][hole of 6 MiB][6 MiB][2 MiB never touched]."""
    backend = DecommittingBackend([], total_bytes=None, page_size=PAGE, costly_churn=False)
    pool = CachingPool(backend, policy=HOLES_STAY)
    blocks = [pool.malloc(6 * MiB) for _ in range(3)]
    pool.free(blocks[1])
    pool.assert_invariants()
    return pool


# -- the commit ledger -------------------------------------------------------------


def test_the_ledger_counts_untouched_pages_and_takes_them_back_when_a_block_lands() -> None:
    pool = decommitting_pool()
    ledger = pool._commits.ledger
    (seg,) = pool._segments.values()
    assert ledger.decommitted_in(seg) == 2 * MiB  # the tail no block was allocated over
    assert ledger.committed_in(seg) == 18 * MiB
    assert pool.memory_stats()["reserved_bytes.all.current"] == 18 * MiB
    tail = pool.malloc(2 * MiB)  # best fit: the tail, whose pages now count as committed
    assert tail.segment is seg and ledger.decommitted_in(seg) == 0
    assert pool.memory_stats()["reserved_bytes.all.current"] == 20 * MiB
    pool.free(tail)
    pool.assert_invariants()


def test_a_decommit_gives_back_whole_pages_once_and_the_pool_counts_them() -> None:
    pool = decommitting_pool()
    ledger = pool._commits.ledger
    hole = next(b for b in pool._large.free_blocks.values() if b.size == 6 * MiB)
    assert hole.is_split() and ledger.committed_pages_of(hole) == [
        (hole.address, hole.address + 6 * MiB)
    ]
    assert pool._commits.decommit_free_block(hole, minimum=0) == 6 * MiB
    stats = pool.memory_stats()
    assert stats["num_decommits"] == 1 and stats["reserved_bytes.all.current"] == 12 * MiB
    assert ledger.decommit(hole, minimum=0) == (0, 0)  # nothing left to give
    assert ledger.committed_pages_of(hole) == []
    pool.assert_invariants()
    assert ledger.edge_pages(DeviceMemory(address=PAGE + 512, nbytes=3 * PAGE)) == PAGE
    assert ledger.pages_of(PAGE + 1, 2 * PAGE + 1) == (PAGE, 3 * PAGE)


def shift_a_span(pool: CachingPool) -> None:
    spans = next(iter(pool._commits.ledger.spans.values()))
    start, end = spans[0]
    spans[0] = (start + 512, end)


def span_over_an_allocated_block(pool: CachingPool) -> None:
    (seg,) = pool._segments.values()
    pool._commits.ledger.spans[seg.address].insert(0, (seg.address, seg.address + PAGE))


def span_of_no_segment(pool: CachingPool) -> None:
    pool._commits.ledger.spans[1 << 50] = [(1 << 50, (1 << 50) + PAGE)]


def forget_the_candidates(pool: CachingPool) -> None:
    pool._commits.ledger.candidates.clear()


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (shift_a_span, "not whole pages"),
        (span_over_an_allocated_block, "is not inside a free block"),
        (span_of_no_segment, "decommitted pages of no segment"),
        (forget_the_candidates, "is no decommit candidate"),
    ],
)
def test_the_pools_check_names_a_broken_ledger(
    corrupt: Callable[[CachingPool], None], message: str
) -> None:
    pool = decommitting_pool()
    corrupt(pool)
    with pytest.raises(AssertionError, match=message):
        pool.assert_invariants()


# -- the idle segments ---------------------------------------------------------------


def test_kept_segments_decay_and_stay_within_their_budget_most_recent_first() -> None:
    policy = dataclasses.replace(ADAPTIVE, release_idle_s=2.0, keep_idle_fraction=0.5)
    idle = IdleSegments(costly_churn=False)
    segments = [segment(i << 30, (10 + 10 * i) * MiB) for i in range(3)]
    for since, seg in enumerate(segments):
        idle.became_idle(seg, float(since), seg.size)
    assert list(idle) == [s.address for s in segments] and idle.committed == 60 * MiB
    unbudgeted = idle.kept(policy, 2.5, 40 * MiB, budgeted=False)
    assert unbudgeted == {segments[1].address: 3.0, segments[2].address: 4.0}  # one decayed
    # 20 MiB of budget: the most recent (30 MiB) is kept whatever its size, then nothing
    assert idle.kept(policy, 2.5, 40 * MiB) == {segments[2].address: 4.0}
    assert idle.beyond_budget(policy, unbudgeted, 40 * MiB) == [segments[1].address]
    assert idle.kept(policy, 2.5, 100 * MiB) == unbudgeted  # 50 MiB of budget: both
    # a warm reserve of 50 MiB keeps the two most recent (30 + 20 MiB) warm_reserve_s
    assert policy.warm_reserve_s == 60.0
    assert idle.kept(policy, 2.5, 40 * MiB, reserve=50 * MiB) == {
        segments[2].address: 62.0,
        segments[1].address: 61.0,
    }
    churn = IdleSegments(costly_churn=True)  # every one kept, whatever the budget
    for since, seg in enumerate(segments):
        churn.became_idle(seg, float(since), seg.size)
    assert churn.kept(policy, 2.5, 0) == unbudgeted
    idle.decommitted(segments[2], MiB)
    idle.left(segments[0])
    assert idle.committed == 49 * MiB and segments[0].address not in idle


def test_the_warm_reserve_never_holds_more_than_its_bytes_most_recent_first() -> None:
    """Random idle segments and reserves: the warm ones' committed bytes never exceed the
    reserve, none has been idle warm_reserve_s, and, the most recently freed first, a
    segment is warm exactly when it fits beside the warm ones freed after it."""
    decay = ADAPTIVE.warm_reserve_s
    assert decay is not None
    rng = random.Random(0)
    now = 2 * decay  # some segments idle longer than the decay, some not
    for _ in range(300):
        idle = IdleSegments(costly_churn=False)
        since: dict[int, float] = {}
        committed: dict[int, int] = {}
        for index in range(rng.randint(1, 12)):
            seg = segment((index + 1) << 32, rng.choice([2, 20, 64, 128, 256, 512]) * MiB)
            since[seg.address] = rng.uniform(0.0, now)
            committed[seg.address] = seg.size - rng.choice([0, MiB])  # some decommitted
            idle.became_idle(seg, since[seg.address], committed[seg.address])
        reserve = rng.choice([0, 100, 256, 300, 1024]) * MiB
        warm = idle.warm(ADAPTIVE, now, reserve)
        assert sum(committed[address] for address in warm) <= reserve
        taken = 0
        for address in sorted(since, key=since.__getitem__, reverse=True):
            if now >= since[address] + decay:
                assert address not in warm
                continue
            fits = taken + committed[address] <= reserve
            assert (address in warm) == fits, (address, reserve)
            if fits:
                taken += committed[address]
                assert warm[address] == since[address] + decay
    no_reserve = dataclasses.replace(ADAPTIVE, warm_reserve_s=None)
    assert idle.warm(no_reserve, now, 1 << 40) == {}


def test_the_pools_check_names_a_warm_reserve_beyond_its_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pool's check recomputes the reserve: one that holds more than its bytes (a
    broken rule) is named."""
    backend = DecommittingBackend([], total_bytes=None, page_size=PAGE, costly_churn=False)
    pool = CachingPool(backend, policy=ADAPTIVE, relocator=None)
    pool.compaction_wanted = lambda: None
    pool.free(pool.malloc(64 * MiB))
    pool.warm_reserve = 64 * MiB
    pool.assert_invariants()

    def every_segment(
        self: IdleSegments, policy: object, now: float, reserve: int
    ) -> dict[int, float]:
        return dict.fromkeys(self, now + 1.0)  # a rule that ignores the reserve's bytes

    monkeypatch.setattr(IdleSegments, "warm", every_segment)
    pool.warm_reserve = 32 * MiB
    with pytest.raises(AssertionError, match="the warm reserve holds"):
        pool.assert_invariants()


def test_the_pools_check_names_a_broken_idle_segment() -> None:
    pool = CachingPool(BookkeepingBackend(), policy=policy_named("pytorch"))
    pool.free(pool.malloc(4 * MiB))
    pool.assert_invariants()
    (seg,) = pool._segments.values()
    pool._idle.decommitted(seg, 512)  # disagrees with the ledger, which gave nothing back
    with pytest.raises(AssertionError, match=r"counts \d+ committed bytes"):
        pool.assert_invariants()
    split = CachingPool(BookkeepingBackend(), policy=policy_named("pytorch"))
    block = split.malloc(4 * MiB)
    split._idle.record.became_idle(block.segment, 0.0, block.segment.size)
    with pytest.raises(AssertionError, match="is counted idle but is not one free block"):
        split.assert_invariants()


# -- consolidation -------------------------------------------------------------------


def test_excess_counts_only_beyond_the_slack_and_the_threshold() -> None:
    policy = dataclasses.replace(ADAPTIVE, min_slack=16 * MiB)
    assert Consolidation.excess(policy, 100 * MiB, 90 * MiB, 1.0) == 0  # 10 MiB of slack
    assert Consolidation.excess(policy, 120 * MiB, 90 * MiB, 1.1) == 21 * MiB
    assert Consolidation.excess(policy, 120 * MiB, 90 * MiB, 1.1, slack=40 * MiB) == 0
    assert Consolidation.excess(policy, 120 * MiB, 90 * MiB, 1.1, kept=10 * MiB) == 11 * MiB
    assert Consolidation.background_threshold(ADAPTIVE, waking=True) == 1.10
    assert Consolidation.background_threshold(ADAPTIVE) == 1.04
    bare = dataclasses.replace(ADAPTIVE, background_threshold=None, background_wake_threshold=None)
    assert Consolidation.background_threshold(bare, waking=True) == bare.compact_threshold
    assert Consolidation.should_consolidate(ADAPTIVE, 32 * MiB, 16 * MiB)
    assert not Consolidation.should_consolidate(ADAPTIVE, 32 * MiB, 64 * MiB)
    assert ADAPTIVE.keep_idle_below == 0.75
    assert Consolidation.near_the_edge(ADAPTIVE, 80, 100)
    assert not Consolidation.near_the_edge(ADAPTIVE, 70, 100)


def test_a_free_compacts_once_per_compact_every_and_only_with_excess() -> None:
    policy = dataclasses.replace(ADAPTIVE, compact_every=4, min_slack=0)
    consolidation = Consolidation()
    dues = [consolidation.compaction_due(policy, 100, 100) for _ in range(6)]
    assert dues == [0] * 6 and consolidation.frees_since_compaction == 6  # never any excess
    assert consolidation.compaction_due(policy, 200, 100) == 200 - int(1.15 * 100)
    assert consolidation.frees_since_compaction == 0
    assert [consolidation.compaction_due(policy, 200, 100) > 0 for _ in range(4)] == [
        False,
        False,
        False,
        True,
    ]


def test_the_pools_check_names_a_broken_count_of_frees() -> None:
    pool = CachingPool(BookkeepingBackend())
    pool._pressure.consolidation.frees_since_compaction = -1
    with pytest.raises(AssertionError, match="-1"):
        pool.assert_invariants()


# -- composition ----------------------------------------------------------------------


def test_the_collaborators_are_composed_and_know_the_pool_only_by_their_sites() -> None:
    """The pool derives from its block cache alone; each collaborator beyond torch is an
    object it holds, whose module imports neither the cache nor the pool (it sees them
    only through the narrow site protocol it declares)."""
    assert CachingPool.__mro__ == (CachingPool, BlockCache, object)
    pool = CachingPool(BookkeepingBackend(), policy=ADAPTIVE)
    held = {type(value) for value in vars(pool).values()}
    assert {IdleKeeping, CommitCap, PressureSteps} <= held
    for collaborator in (IdleKeeping, CommitCap, PressureSteps, PoolMoves):
        assert not issubclass(collaborator, BlockCache), collaborator
    for module in (idle, commit, pressure, moves):
        imported = {
            node.module
            for node in ast.walk(ast.parse(inspect.getsource(module)))
            if isinstance(node, ast.ImportFrom) and node.module is not None
        }
        assert not imported & {"tensord_server.pool.cache", "tensord_server.pool.allocator"}, (
            module.__name__,
            imported,
        )
