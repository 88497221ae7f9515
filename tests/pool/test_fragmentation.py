"""Pool policies beyond PyTorch: tight devices, giving memory back, moves that keep bytes.

The policies are ``pytorch`` (torch exactly), ``oom-compaction`` (compaction where torch
would be out of memory) and ``adaptive`` (``tensord serve``'s default).  The property
test runs random alloc/free/hold sequences on real host bytes under each and checks the
pool's invariants and every live block's bytes after each step.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensord.errors import OutOfMemoryError
from tensord_server.data import bundled_trace, bundled_traces
from tensord_server.devices.memory import HostBackend
from tensord_server.domain.compactor import URGENT_RATIO, BackgroundCompactor
from tensord_server.domain.storage import Storage
from tensord_server.domain.store import TensorStore
from tensord_server.pool import (
    DEFAULT_POLICY,
    POLICIES,
    Block,
    CachingPool,
    PoolPolicy,
    Segment,
    compaction,
    policy_named,
)
from tensord_server.tools import replay as replay_tool
from tensord_server.tools.replay import COMPARED_KEYS, load_trace, replay

MiB = 1 << 20
HOST_BYTES = 1 << 30  # the host backend's nominal size (the pools' capacities are smaller)
TRACE = bundled_trace("resnet50_train")

# adaptive, acting on every free and at any slack: the after-free paths on a small pool
EAGER = dataclasses.replace(policy_named("adaptive"), name="eager", min_slack=0, compact_every=1)
# adaptive where nothing decommits (pinned host or GPU memory, bookkeeping): capacity bounds
# segment bytes, so holes cost room and repacking is what gives it back
SEGMENT_BOUND = dataclasses.replace(policy_named("adaptive"), decommit=False)
TEST_POLICIES: list[PoolPolicy] = [*POLICIES.values(), EAGER]


class HoldingRelocator:
    """Owns blocks by name, each with the bytes written into it; a held one never moves."""

    def __init__(self, backend: HostBackend) -> None:
        self.backend = backend
        self.blocks: dict[str, Block] = {}
        self.contents: dict[str, bytes] = {}
        self.held: set[str] = set()

    @contextlib.contextmanager
    def relocation(self, pool: CachingPool) -> Iterator[dict[Block, Callable[[Block], None]]]:
        def repoint(name: str) -> Callable[[Block], None]:
            def to(block: Block) -> None:
                assert name not in self.held
                assert block.size <= self.blocks[name].size  # never charged more
                self.blocks[name] = block

            return to

        yield {b: repoint(n) for n, b in self.blocks.items() if n not in self.held}

    def claim(self, block: Block) -> object:
        """The name owning ``block`` (names are never reused; a toy's holds touch no bytes)."""
        return next((n for n, b in self.blocks.items() if b is block), None)

    def add(self, name: str, block: Block, seed: int) -> None:
        data = np.random.default_rng(seed).integers(0, 256, block.requested_size, np.uint8)
        self.backend.write(block.segment.memory, block.offset, data.tobytes())
        self.blocks[name] = block
        self.contents[name] = data.tobytes()

    def check_bytes(self) -> None:
        for name, block in self.blocks.items():
            data = self.backend.read(block.segment.memory, block.offset, block.requested_size)
            assert data == self.contents[name], name


# ("alloc", size) | ("free", index) | ("hold", index): random sequences on a 40 MiB device
ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("alloc"),
            st.one_of(
                st.integers(1, MiB), st.integers(MiB, 8 * MiB), st.integers(10 * MiB, 14 * MiB)
            ),
        ),
        st.tuples(st.just("free"), st.integers(0, 1000)),
        st.tuples(st.just("hold"), st.integers(0, 1000)),
    ),
    max_size=50,
)


@pytest.mark.slow
@settings(
    derandomize=True,
    database=None,
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(steps=ops, policy=st.sampled_from(TEST_POLICIES))
def test_random_sequences_keep_invariants_and_bytes_under_each_policy(
    steps: list[tuple[str, int]], policy: PoolPolicy
) -> None:
    backend = HostBackend(total_bytes=HOST_BYTES)
    owner = HoldingRelocator(backend)
    pool = CachingPool(backend, capacity=40 * MiB, relocator=owner, policy=policy)
    names = itertools.count()
    ooms = 0
    for action, value in steps:
        live = sorted(owner.blocks)
        held_before = {n: owner.blocks[n] for n in owner.held}
        if action == "alloc":
            try:
                block = pool.malloc(value)
            except OutOfMemoryError:
                ooms += 1
            else:
                name = f"b{next(names)}"
                owner.add(name, block, seed=len(live) * 7919 + value)
        elif action == "free" and live:
            name = live[value % len(live)]
            owner.held.discard(name)
            held_before.pop(name, None)
            owner.contents.pop(name)
            pool.free(owner.blocks.pop(name))
        elif action == "hold" and live:
            owner.held ^= {live[value % len(live)]}
        pool.assert_invariants()
        owner.check_bytes()
        for name, block in held_before.items():
            assert owner.blocks[name] is block, f"held {name} moved"
        spans = sorted((b.address, b.address + b.size) for b in owner.blocks.values())
        assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))
    stats = pool.memory_stats()
    assert stats["num_ooms"] == ooms
    if policy.name == "pytorch":
        assert stats["num_compactions"] == 0
    for block in owner.blocks.values():
        pool.free(block)
    pool.empty_cache()
    assert pool.memory_stats()["reserved_bytes.all.current"] == 0


def holey_pool(
    policy: str | PoolPolicy, capacity: int = 52 * MiB
) -> tuple[CachingPool, HoldingRelocator]:
    """Two 20 MiB segments of [6 MiB kept][6 MiB hole][6 MiB kept][2 MiB hole] (on 52 MiB:
    a 14 MiB request needs 2 MiB back, and no segment can be emptied into the holes)."""
    backend = HostBackend(total_bytes=HOST_BYTES)
    owner = HoldingRelocator(backend)
    if isinstance(policy, str):
        policy = policy_named(policy)
    pool = CachingPool(backend, capacity=capacity, relocator=owner, policy=policy)
    for i in range(6):
        owner.add(f"t{i}", pool.malloc(6 * MiB), seed=i)
    for i in (1, 4):
        owner.contents.pop(f"t{i}")
        pool.free(owner.blocks.pop(f"t{i}"))
    assert pool.memory_stats()["segment.all.current"] == 2
    return pool, owner


def test_compaction_alone_cannot_serve_a_request_among_small_holes() -> None:
    pool, owner = holey_pool("oom-compaction")
    with pytest.raises(OutOfMemoryError, match="Compaction could release 0 bytes"):
        pool.malloc(14 * MiB)
    owner.check_bytes()


def test_adaptive_repacks_a_segment_into_a_tight_one_and_keeps_every_byte() -> None:
    pool, owner = holey_pool(SEGMENT_BOUND)
    before = dict(owner.blocks)
    block = pool.malloc(14 * MiB)
    pool.assert_invariants()
    owner.check_bytes()
    assert block.size == 14 * MiB
    moved = sorted(n for n, b in owner.blocks.items() if b is not before[n])
    # one segment's two blocks: one into the other segment's hole, one into a 6 MiB segment
    assert len(moved) == 2
    stats = pool.memory_stats()
    assert stats["num_ooms"] == 0 and stats["num_compactions"] == 1
    assert stats["compaction_moved_bytes"] == 12 * MiB
    segment_bytes = stats["reserved_bytes.all.current"] + stats["decommitted_bytes.all.current"]
    assert segment_bytes == 20 * MiB + 6 * MiB + 14 * MiB


def test_adaptive_on_host_memory_serves_a_request_among_small_holes_with_no_move() -> None:
    """The holey layout under `adaptive` on host memory: the holes gave their pages back, the
    capacity bounds committed bytes, so the 14 MiB request takes a new segment beside them."""
    pool, owner = holey_pool("adaptive")
    before = dict(owner.blocks)
    block = pool.malloc(14 * MiB)
    pool.assert_invariants()
    owner.check_bytes()
    assert block.size == 14 * MiB and owner.blocks == before
    stats = pool.memory_stats()
    assert stats["num_ooms"] == stats["num_compactions"] == stats["compaction_moved_bytes"] == 0
    assert stats["reserved_bytes.all.current"] <= pool.capacity
    assert stats["reserved_bytes.all.current"] + stats["decommitted_bytes.all.current"] > 52 * MiB


def test_adaptive_gathers_free_blocks_before_the_device_is_too_full_to() -> None:
    """Two 18 MiB requests on 62 MiB after the holey layout (16 MiB free in holes and tails).
    Once the first is reserved, the device has 4 MiB left: too little for the 6 MiB segment
    a repack needs, so the second fails.  adaptive repacks before reserving the first, while
    the device still has room (consolidate), and serves both."""
    outcome = {}
    adaptive = SEGMENT_BOUND
    for policy in (adaptive, dataclasses.replace(adaptive, consolidate=False)):
        pool, owner = holey_pool(policy, capacity=62 * MiB)
        try:
            for i in range(2):
                owner.add(f"big{i}", pool.malloc(18 * MiB), seed=10 + i)
        except OutOfMemoryError:
            outcome[policy.consolidate] = "oom"
        else:
            outcome[policy.consolidate] = "served"
        pool.assert_invariants()
        owner.check_bytes()
    assert outcome == {True: "served", False: "oom"}


def test_adaptive_merges_segment_tails_that_no_segment_gives_back_alone() -> None:
    """Four 12 MiB segments, each a 10.25 MiB block and a 1.75 MiB tail, and 22 MiB left on
    70 MiB: a 24 MiB request needs 2 MiB more.  No segment empties into the tails and none
    repacks smaller alone (10.25 MiB rounds up to 12); two segments' blocks back to back in
    one 22 MiB segment give 2 MiB back, and the request fits.  Without merging: OOM."""
    outcome = {}
    for merging in (True, False):
        policy = dataclasses.replace(SEGMENT_BOUND, merge_segments=merging)
        backend = HostBackend(total_bytes=HOST_BYTES)
        owner = HoldingRelocator(backend)
        pool = CachingPool(backend, capacity=70 * MiB, relocator=owner, policy=policy)
        for i in range(4):
            owner.add(f"t{i}", pool.malloc(10 * MiB + MiB // 4), seed=i)
        assert pool.memory_stats()["reserved_bytes.all.current"] == 48 * MiB
        try:
            owner.add("big", pool.malloc(24 * MiB), seed=9)
        except OutOfMemoryError as exc:
            outcome[merging] = str(exc)
        else:
            outcome[merging] = "served"
        pool.assert_invariants()
        owner.check_bytes()
        if merging:
            stats = pool.memory_stats()
            assert stats["num_ooms"] == 0 and stats["compaction_moved_bytes"] == 20 * MiB + MiB // 2
            # net, as a repack counts: two 12 MiB segments back for a 22 MiB one
            assert stats["compaction_released_bytes"] == 2 * MiB
            assert stats["reserved_bytes.all.current"] == 24 * MiB + 22 * MiB + 24 * MiB
    assert outcome[True] == "served"
    assert "Compaction could release 0 bytes" in outcome[False]


def test_adaptive_merges_tails_before_the_device_has_no_room_left_to() -> None:
    """Ten 12 MiB segments, each a 10.25 MiB block and a 1.75 MiB tail (17.5 MiB free in
    all), on 145 MiB: a 20 MiB request leaves 5 MiB, too little for another segment like
    it, so consolidation merges pairs of segments (two blocks back to back in 22 MiB
    instead of 24) while 25 MiB are still left for a merged one.  The 14 MiB request after
    it then fits.  Without those merges no path serves it: no block fits a tail, no segment
    repacks smaller alone (10.25 MiB rounds up to 12), and 5 MiB left take no merged
    segment (22 MiB): OOM."""
    outcome = {}
    for merging in (True, False):
        policy = dataclasses.replace(SEGMENT_BOUND, consolidate_merges=merging)
        backend = HostBackend(total_bytes=HOST_BYTES)
        owner = HoldingRelocator(backend)
        pool = CachingPool(backend, capacity=145 * MiB, relocator=owner, policy=policy)
        for i in range(10):
            owner.add(f"t{i}", pool.malloc(10 * MiB + MiB // 4), seed=i)
        assert pool.memory_stats()["reserved_bytes.all.current"] == 120 * MiB
        owner.add("first", pool.malloc(20 * MiB), seed=10)
        try:
            owner.add("second", pool.malloc(14 * MiB), seed=11)
        except OutOfMemoryError as exc:
            outcome[merging] = str(exc)
        else:
            outcome[merging] = "served"
        pool.assert_invariants()
        owner.check_bytes()
        stats = pool.memory_stats()
        assert stats["reserved_bytes.all.peak"] <= pool.capacity
        if merging:
            assert stats["num_ooms"] == 0 and stats["compaction_released_bytes"] >= 10 * MiB
    assert outcome[True] == "served"
    assert "Merging segments released 0 bytes" in outcome[False]


def test_a_merge_on_the_oom_path_leaves_a_rest_under_1_mib_free_rather_than_fail() -> None:
    """Four 12 MiB segments, each a 10.75 MiB block and a 1.25 MiB tail, and 22 MiB left on
    70 MiB: a 24 MiB request needs 2 MiB more.  Two blocks back to back take 21.5 MiB of a
    22 MiB segment; the 0.5 MiB left is too little for malloc's rule to split off and
    neither block may grow into it, so the second block takes its 10.75 MiB alone and the
    rest stays free: two 12 MiB segments back for a 22 MiB one, and the request fits."""
    policy = SEGMENT_BOUND
    backend = HostBackend(total_bytes=HOST_BYTES)
    owner = HoldingRelocator(backend)
    pool = CachingPool(backend, capacity=70 * MiB, relocator=owner, policy=policy)
    for i in range(4):
        owner.add(f"t{i}", pool.malloc(10 * MiB + 3 * MiB // 4), seed=i)
    owner.add("big", pool.malloc(24 * MiB), seed=9)
    pool.assert_invariants()
    owner.check_bytes()
    stats = pool.memory_stats()
    assert stats["num_ooms"] == 0 and stats["compaction_moved_bytes"] == 21 * MiB + MiB // 2
    assert stats["reserved_bytes.all.current"] == 24 * MiB + 22 * MiB + 24 * MiB
    assert all(
        block.size == 10 * MiB + 3 * MiB // 4
        for block in owner.blocks.values()
        if block.size < 24 * MiB
    )  # no moved block grew
    merged = [s for s in pool._segments.values() if s.size == 22 * MiB]
    assert len(merged) == 1
    assert [(b.size, b.allocated) for b in merged[0].blocks()][-1] == (MiB // 2, False)


def test_adaptive_merges_small_segments_whose_holes_fit_no_block() -> None:
    """Five 2 MiB small-pool segments, each two 0.75 MiB blocks and a 0.5 MiB hole, and
    8 MiB left on 18 MiB: a 10 MiB request needs 2 MiB more.  No block fits another
    segment's hole; four segments' blocks back to back in one 6 MiB segment give 2 MiB
    back.  Without merging: OOM."""
    outcome = {}
    for merging in (True, False):
        policy = dataclasses.replace(SEGMENT_BOUND, merge_segments=merging)
        backend = HostBackend(total_bytes=HOST_BYTES)
        owner = HoldingRelocator(backend)
        pool = CachingPool(backend, capacity=18 * MiB, relocator=owner, policy=policy)
        for i in range(10):
            owner.add(f"s{i}", pool.malloc(3 * MiB // 4), seed=i)
        assert pool.memory_stats()["segment.small_pool.current"] == 5
        try:
            owner.add("big", pool.malloc(10 * MiB), seed=20)
        except OutOfMemoryError as exc:
            outcome[merging] = str(exc)
        else:
            outcome[merging] = "served"
        pool.assert_invariants()
        owner.check_bytes()
        if merging:
            stats = pool.memory_stats()
            assert stats["num_ooms"] == 0 and stats["compaction_moved_bytes"] == 6 * MiB
            assert stats["segment.small_pool.current"] == 2  # the one left, the merged one
            assert stats["reserved_bytes.all.current"] == 2 * MiB + 6 * MiB + 10 * MiB
    assert outcome[True] == "served"
    assert "Compaction could release 0 bytes" in outcome[False]


def test_adaptive_gives_idle_segments_back_and_pytorch_keeps_them() -> None:
    reserved = {}
    for name in ("pytorch", "adaptive"):
        backend = HostBackend(total_bytes=HOST_BYTES)
        pool = CachingPool(backend, policy=policy_named(name))
        kept = pool.malloc(30 * MiB)
        blocks = [pool.malloc(30 * MiB) for _ in range(3)]
        for block in blocks:
            pool.free(block)
        pool.assert_invariants()
        reserved[name] = pool.memory_stats()["reserved_bytes.all.current"]
        pool.free(kept)
    assert reserved["pytorch"] == 120 * MiB  # torch gives back only on OOM or empty_cache
    # adaptive: reserved <= 1.10 x allocated, or within 16 MiB of it
    assert reserved["adaptive"] == 30 * MiB


def test_pytorch_policy_with_every_allocation_movable_is_torch_exactly() -> None:
    events = load_trace(TRACE)
    plain = replay(events).stats
    movable = replay(events, policy="pytorch", compaction=True).stats
    for key in (*COMPARED_KEYS, "num_device_free", "num_compactions"):
        assert movable[key] == plain[key], key


def replay_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, object]:
    parser = argparse.ArgumentParser()
    replay_tool.add_arguments(parser)
    assert replay_tool.run(parser.parse_args([*args, "--json"])) == 0
    result: dict[str, object] = json.loads(capsys.readouterr().out)
    return result


def test_replay_at_1_01x_peak_has_no_oom_under_the_default_policy(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """0 OOMs at 1.01x the bundled ResNet-50 trace's peak allocated; PyTorch's rules OOM there."""
    adaptive = replay_json(capsys, "resnet50_train", "--compaction", "--capacity-factor", "1.01")
    assert adaptive["policy"] == "adaptive" and adaptive["compaction"] is True
    assert adaptive["num_ooms"] == 0
    assert isinstance(adaptive["num_compactions"], int) and adaptive["num_compactions"] > 0
    assert isinstance(adaptive["compaction_moved_bytes"], int)
    assert adaptive["compaction_moved_bytes"] > 0
    torch_rules = replay_json(
        capsys, "resnet50_train", "--policy", "pytorch", "--capacity-factor", "1.01"
    )
    assert torch_rules["policy"] == "pytorch" and torch_rules["compaction"] is False
    assert isinstance(torch_rules["num_ooms"], int) and torch_rules["num_ooms"] > 0
    assert torch_rules["num_compactions"] == 0


@pytest.mark.parametrize("name", bundled_traces())
def test_every_bundled_trace_at_1_01x_peak_has_no_oom_under_the_default_policy(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """0 OOMs at 1.01x every bundled trace's peak allocated, as `tensord replay` measures it."""
    result = replay_json(capsys, name, "--compaction", "--capacity-factor", "1.01")
    assert result["policy"] == DEFAULT_POLICY and result["compaction"] is True
    assert result["unmatched_frees"] == 0
    assert result["num_ooms"] == 0


# ---------------------------------------------------------------------------
# Compaction after a free, in the background

# adaptive, compacting whatever the slack, with no pause between moves (so only stepping
# aside lets a waiting request through): the after-free path on a small device (holes
# stay committed: decommitting them would leave nothing to compact)
BACKGROUND = dataclasses.replace(
    policy_named("adaptive"),
    name="background",
    min_slack=0,
    compact_every=1,
    background_bytes_per_s=1 << 62,
    decommit=False,
)
WAIT_LIMIT_S = 10.0  # every wait below ends well before this unless something is broken


def wait_until(condition: Callable[[], bool], limit: float = WAIT_LIMIT_S) -> bool:
    deadline = time.monotonic() + limit
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def waiters(store: TensorStore) -> int:
    """Threads blocked on the registry's or a pool's lock (0 where locks do not count them)."""
    pools = sum(getattr(d.pool, "lock_waiters", 0) for d in store.devices)
    return int(getattr(store.storages, "lock_waiters", 0)) + pools


def kept(store: TensorStore, nbytes: int, seed: int) -> tuple[Storage, bytes]:
    """A live, unheld Storage of ``nbytes`` random bytes (as a handle keeps one)."""
    storage = store.storages.allocate(store.devices.get("cpu"), nbytes)
    data = np.random.default_rng(seed).integers(0, 256, nbytes, np.uint8).tobytes()
    storage.write(0, data)
    store.storages.incref(storage)
    store.storages.release_hold(storage)
    return storage, data


def two_segments_one_to_empty(store: TensorStore) -> dict[int, tuple[Storage, bytes]]:
    """Two 20 MiB segments of five 4 MiB Storages; three freed from the first and two from
    the second leave reserved/allocated at 2.0, and the first segment's two Storages fit
    the second's 8 MiB hole: two moves release a segment."""
    storages = {i: kept(store, 4 * MiB, seed=i) for i in range(10)}
    for i in (0, 1, 2, 8, 9):
        store.storages.decref(storages.pop(i)[0])
    return storages


def test_a_request_waits_for_no_background_copy() -> None:
    """A background move copies with neither the pool's lock nor the registry's held:
    a request arriving during a copy is served before the copy ends (it waited for the
    whole copy of the move in progress: milliseconds for a 48 MiB Storage)."""
    store = TensorStore(["cpu=256MiB"])
    store.start()
    try:
        pool = store.devices.get("cpu").pool
        pool.policy = BACKGROUND
        copies_done = 0
        served_during_copy: list[bool] = []
        real_copy = pool.backend.copy

        def request() -> None:
            storage = store.storages.allocate(store.devices.get("cpu"), 1 << 10)
            store.storages.release_hold(storage)

        def copy_during_which_a_request_comes(*args: object) -> None:
            nonlocal copies_done
            if not served_during_copy:
                thread = threading.Thread(target=request, daemon=True)
                thread.start()
                thread.join(5.0)  # a small allocation: milliseconds, unless it waits
                served_during_copy.append(not thread.is_alive())
            real_copy(*args)
            copies_done += 1

        pool.backend.copy = copy_during_which_a_request_comes  # type: ignore[method-assign]
        live = two_segments_one_to_empty(store)
        assert wait_until(lambda: pool.memory_stats()["segment.large_pool.current"] == 1)
        assert served_during_copy == [True] and copies_done == 2
        for storage, data in live.values():
            assert bytes(storage.raw()) == data
        pool.assert_invariants()
    finally:
        store.close()
    # shut down: the thread is gone and frees compact on their own call again
    assert not store.compactor.running and pool.compaction_wanted is None


def owner_of(storages: Iterable[Storage], memory: object, offset: int) -> Storage:
    """The Storage of ``storages`` whose block starts at ``offset`` of the segment ``memory``
    (found without the registry's lock, which a move may hold)."""
    return next(
        s for s in storages if s.block.segment.memory is memory and s.block.offset == offset
    )


def test_a_write_racing_a_background_move_is_never_lost() -> None:
    """An op that holds a Storage and writes it while a background move copies its bytes
    (outside the locks) makes the move give up: the Storage stays at its block with the
    new bytes, the destination goes back to the pool; the next step moves it intact."""
    store = TensorStore(["cpu=256MiB"])
    try:
        pool = store.devices.get("cpu").pool
        pool.policy = BACKGROUND
        pool.compaction_wanted = lambda: None  # frees leave the work to drain() below
        live = two_segments_one_to_empty(store)
        written: list[tuple[Storage, bytes]] = []
        real_copy = pool.backend.copy

        def write_through_the_store(storage: Storage) -> None:
            data = np.random.default_rng(99).integers(0, 256, storage.nbytes, np.uint8)
            store.storages.hold(storage)  # what every op does (OpContext.using, uploads)
            try:
                storage.write(0, data.tobytes())
            finally:
                store.storages.release_hold(storage)
            written.append((storage, data.tobytes()))

        def copy_then_a_write(*args: Any) -> None:
            real_copy(*args)  # the copy is made: an op writes before the owner is repointed
            if not written:
                storage = owner_of((s for s, _ in live.values()), args[0], args[1])
                thread = threading.Thread(target=write_through_the_store, args=(storage,))
                thread.start()
                thread.join(5.0)  # served at once: the copy holds no lock
                assert written, "the write waited for the move"

        pool.backend.copy = copy_then_a_write  # type: ignore[method-assign]
        compactor = BackgroundCompactor([pool], lambda: False)
        assert compactor.drain(pool) == 0  # the move gave up; the step ends there
        ((storage, data),) = written
        block = storage.block
        assert bytes(storage.raw()) == data  # the write is where the Storage is
        stats = pool.memory_stats()
        assert stats["allocated_bytes.all.current"] == sum(
            s.block.size for s in store.storages.live()
        )  # the destination went back to the pool
        assert stats["segment.large_pool.current"] == 2
        pool.assert_invariants()
        assert compactor.drain(pool) == 8 * MiB  # nothing raced this time
        assert storage.block is not block and bytes(storage.raw()) == data
        live = {i: (s, data if s is storage else d) for i, (s, d) in live.items()}
        for s, d in live.values():
            assert bytes(s.raw()) == d
        assert pool.memory_stats()["segment.large_pool.current"] == 1
        pool.assert_invariants()
    finally:
        store.close()


def test_a_background_copy_that_gave_up_is_paced_like_a_move() -> None:
    """A step's second move giving up (its Storage written during the copy) still copied
    its bytes: the step reports both copies to the compactor's pace and budget (a client
    touching each Storage as it is copied must not get unpaced copying), while the pool's
    moved-bytes statistic counts the one move made."""
    store = TensorStore(["cpu=256MiB"])
    try:
        pool = store.devices.get("cpu").pool
        pool.policy = BACKGROUND
        pool.compaction_wanted = lambda: None  # frees leave the work to compact_step below
        live = two_segments_one_to_empty(store)
        real_copy = pool.backend.copy
        copies: list[int] = []

        def copy_then_a_write_on_the_second(*args: Any) -> None:
            real_copy(*args)
            copies.append(args[-1])
            if len(copies) == 2:  # an op holds the second Storage: its move gives up
                storage = owner_of((s for s, _ in live.values()), args[0], args[1])
                store.storages.hold(storage)
                store.storages.release_hold(storage)

        pool.backend.copy = copy_then_a_write_on_the_second  # type: ignore[method-assign]
        before = pool.memory_stats()["compaction_moved_bytes"]
        assert pool.compact_step(64 * MiB, lambda: True) == 8 * MiB  # both copies
        assert copies == [4 * MiB, 4 * MiB]
        assert pool.memory_stats()["compaction_moved_bytes"] - before == 4 * MiB
        for s, d in live.values():
            assert bytes(s.raw()) == d
        pool.assert_invariants()
    finally:
        store.close()


def test_a_segment_emptied_during_a_background_copy_stays_until_the_copy_ends() -> None:
    """Every owner in the segment a copy reads (outside the locks) dropping its last
    reference: the move gives up and frees its destination, and the segment being read
    is not given back to the device (empty_cache) before the copy ends."""
    pool, owner = half_freed_background_pool()
    real_copy = owner.backend.copy
    seen: list[bool] = []

    def free_and_empty_cache(segment: Segment) -> None:
        for name in [n for n, b in owner.blocks.items() if b.segment is segment]:
            pool.free(owner.blocks.pop(name))
            owner.contents.pop(name)
        pool.empty_cache()  # the segment is one free block now

    def copy_while_the_owners_go(*args: Any) -> None:
        if not seen:
            segment = next(b.segment for b in owner.blocks.values() if b.segment.memory is args[0])
            thread = threading.Thread(target=free_and_empty_cache, args=(segment,))
            thread.start()
            thread.join(5.0)
            seen.append(not thread.is_alive() and segment.address in pool._segments)
        real_copy(*args)

    owner.backend.copy = copy_while_the_owners_go  # type: ignore[method-assign]
    compactor = BackgroundCompactor([pool], lambda: False)
    compactor.drain(pool)
    assert seen == [True]
    stats = pool.memory_stats()
    assert stats["allocated_bytes.all.current"] == sum(b.size for b in owner.blocks.values())
    pool.assert_invariants()
    owner.check_bytes()


def test_a_block_reallocated_larger_at_a_planned_source_during_a_copy_is_not_moved() -> None:
    """A plan's later move names its source by address, and the locks are let go while the
    move before it copies: the planned Storage freed then, and a larger one allocated at its
    address, must not be moved into the planned (smaller) destination: its bytes would
    overrun the destination block into its neighbour's, and it would live in a block
    smaller than its bytes."""
    backend = HostBackend(total_bytes=HOST_BYTES)
    owner = HoldingRelocator(backend)
    pool = CachingPool(backend, capacity=256 * MiB, relocator=owner, policy=BACKGROUND)
    pool.compaction_wanted = lambda: None  # frees leave the work to drain() below
    for i in range(5):  # segment D (20 MiB): d0 d1 [free 8 MiB] d4 once d2, d3 go
        owner.add(f"d{i}", pool.malloc(4 * MiB), seed=i)
    for i in range(2):  # segment A (20 MiB): a0 a1 [free 12 MiB]
        owner.add(f"a{i}", pool.malloc(4 * MiB), seed=10 + i)
    for name in ("d2", "d3"):
        owner.contents.pop(name)
        pool.free(owner.blocks.pop(name))
    a0, a1_address = owner.blocks["a0"], owner.blocks["a1"].address
    real_copy = backend.copy
    reallocated: list[Block] = []

    def free_a1_then_allocate_larger_there(*args: Any) -> None:
        if not reallocated:
            assert (args[0], args[1]) == (a0.segment.memory, a0.offset), "a0 moves first"
            del owner.contents["a1"]
            pool.free(owner.blocks.pop("a1"))
            larger = pool.malloc(6 * MiB)  # best fit: the 16 MiB now free from a1's address
            assert larger.address == a1_address
            owner.add("larger", larger, seed=99)
            reallocated.append(larger)
        real_copy(*args)

    backend.copy = free_a1_then_allocate_larger_there  # type: ignore[method-assign]
    BackgroundCompactor([pool], lambda: False).drain(pool)
    assert reallocated
    for name, block in owner.blocks.items():
        assert block.size >= block.requested_size, name
    owner.check_bytes()
    pool.assert_invariants()


def half_freed_background_pool(
    policy: PoolPolicy = BACKGROUND,
) -> tuple[CachingPool, HoldingRelocator]:
    """Ten 4 MiB blocks, five of them freed (0-2 and 8-9): a pool with work for the
    compactor, whose frees leave the compaction to drain() (no compactor thread)."""
    backend = HostBackend(total_bytes=HOST_BYTES)
    owner = HoldingRelocator(backend)
    pool = CachingPool(backend, capacity=256 * MiB, relocator=owner, policy=policy)
    pool.compaction_wanted = lambda: None
    for i in range(10):
        owner.add(f"s{i}", pool.malloc(4 * MiB), seed=i)
    for i in (0, 1, 2, 8, 9):
        owner.contents.pop(f"s{i}")
        pool.free(owner.blocks.pop(f"s{i}"))
    return pool, owner


@pytest.mark.slow
def test_the_compactor_starts_no_move_while_a_request_waits() -> None:
    """Deterministic: while ``contended()`` says a request waits, the compactor polls and
    moves nothing; it finishes the compaction once nobody waits."""
    pool, owner = half_freed_background_pool()
    assert pool.compaction_excess() > 0
    copies = 0
    waiting = False
    polls = 0
    real_copy = owner.backend.copy

    def copy_during_which_a_request_comes(*args: object) -> None:
        nonlocal copies, waiting
        real_copy(*args)
        copies += 1
        waiting = True

    def contended() -> bool:
        nonlocal polls
        polls += 1
        return waiting

    owner.backend.copy = copy_during_which_a_request_comes  # type: ignore[method-assign]
    compactor = BackgroundCompactor([pool], contended)
    drained: list[int] = []
    thread = threading.Thread(target=lambda: drained.append(compactor.drain(pool)))
    thread.start()
    try:
        assert wait_until(lambda: polls >= 5)  # stepping aside, several looks
        assert copies == 1 and not drained
    finally:
        waiting = False
        thread.join(WAIT_LIMIT_S)
    assert drained == [8 * MiB] and copies == 2 and compactor.moves == 2
    assert pool.memory_stats()["segment.all.current"] == 1
    pool.assert_invariants()
    owner.check_bytes()


class LockedRelocator(HoldingRelocator):
    """A HoldingRelocator whose relocation stops the world, as the registry's does: the
    test thread reads, holds and drops blocks under the same lock."""

    def __init__(self, backend: HostBackend) -> None:
        super().__init__(backend)
        self.lock = threading.Lock()

    @contextlib.contextmanager
    def relocation(self, pool: CachingPool) -> Iterator[dict[Block, Callable[[Block], None]]]:
        with self.lock, super().relocation(pool) as movable:
            yield movable


@settings(
    derandomize=True,
    database=None,
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(steps=ops)
def test_random_sequences_with_the_compactor_running_keep_invariants_and_bytes(
    steps: list[tuple[str, int]],
) -> None:
    backend = HostBackend(total_bytes=HOST_BYTES)
    owner = LockedRelocator(backend)
    policy = dataclasses.replace(BACKGROUND, background_min_slack=0)
    pool = CachingPool(backend, capacity=40 * MiB, relocator=owner, policy=policy)
    compactor = BackgroundCompactor([pool], lambda: pool.lock_waiters > 0)
    compactor.start()
    names = itertools.count()
    try:
        for action, value in steps:
            with owner.lock:
                live = sorted(owner.blocks)
                held_before = {n: owner.blocks[n] for n in owner.held}
            if action == "alloc":
                try:
                    block = pool.malloc(value)
                except OutOfMemoryError:
                    pass
                else:
                    with owner.lock:
                        owner.add(f"b{next(names)}", block, seed=len(live) * 7919 + value)
            elif action == "free" and live:
                name = live[value % len(live)]
                with owner.lock:  # out of the relocator's reach first, as decref does
                    owner.held.discard(name)
                    held_before.pop(name, None)
                    owner.contents.pop(name)
                    block = owner.blocks.pop(name)
                pool.free(block)
            elif action == "hold" and live:
                with owner.lock:
                    owner.held ^= {live[value % len(live)]}
            pool.assert_invariants()
            with owner.lock:
                owner.check_bytes()
                for name, block in held_before.items():
                    if name in owner.held:
                        assert owner.blocks[name] is block, f"held {name} moved"
                spans = sorted((b.address, b.address + b.size) for b in owner.blocks.values())
                assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))
    finally:
        compactor.close()
    assert not compactor.running
    pool.assert_invariants()
    owner.check_bytes()
    for block in owner.blocks.values():
        pool.free(block)
    pool.empty_cache()
    assert pool.memory_stats()["reserved_bytes.all.current"] == 0


def test_a_quiet_servers_background_compaction_plans_once_for_many_moves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While nobody waits, one step runs its plan's moves one after another (planning is
    the step's cost: a plan per Storage moved took a third of a loaded server's time)."""
    pool, owner = half_freed_background_pool()
    plans = 0
    real_plan = compaction.plan_compaction

    def counted_plan(*args: Any, **kwargs: Any) -> compaction.CompactionPlan:
        nonlocal plans
        plans += 1
        return real_plan(*args, **kwargs)

    monkeypatch.setattr(compaction, "plan_compaction", counted_plan)
    compactor = BackgroundCompactor([pool], lambda: False)
    assert compactor.drain(pool) == 8 * MiB
    # one plan moved both Storages (then nothing was in excess: no second plan)
    assert compactor.moves == 1 and plans == 1
    assert pool.memory_stats()["segment.all.current"] == 1
    pool.assert_invariants()
    owner.check_bytes()


def test_a_free_below_the_wake_threshold_keeps_idle_segments_cached() -> None:
    """Hysteresis: under a background compactor a free gives idle segments back and rings
    the doorbell only above background_wake_threshold (1.10), and then only down to it,
    so a loaded server keeps a bounded idle cache instead of reserving a new segment (a
    new memfd and its page faults, on a host) right after giving one back.  (Without
    release_idle_s: with it the free gives nothing back, tests/pool/test_idle_release.py.)"""
    backend = HostBackend(total_bytes=HOST_BYTES)
    policy = dataclasses.replace(policy_named("adaptive"), release_idle_s=None)
    pool = CachingPool(backend, relocator=HoldingRelocator(backend), policy=policy)
    rung = 0

    def ring() -> None:
        nonlocal rung
        rung += 1

    pool.compaction_wanted = ring
    blocks = [pool.malloc(12 * MiB) for _ in range(40)]  # one 12 MiB segment each
    for block in blocks[:2]:
        pool.free(block)  # 480 MiB reserved / 456 MiB allocated = 1.053
    stats = pool.memory_stats()
    assert stats["segment.all.current"] == 40 and rung == 0
    for block in blocks[2:4]:
        pool.free(block)  # 480 / 432 = 1.111: back down to <= 1.10 x 432 MiB
    stats = pool.memory_stats()
    assert stats["reserved_bytes.all.current"] == 468 * MiB and rung == 0
    for block in blocks[4:]:
        pool.free(block)
    pool.assert_invariants()


def test_a_failed_background_move_does_not_stop_the_compactor() -> None:
    """A copy that fails (a device error) leaves its Storage where it was (execute_move);
    the compactor thread must survive it: dead, every later free only rang its doorbell,
    and the pool never gave memory back again."""
    backend = HostBackend(total_bytes=HOST_BYTES)
    owner = HoldingRelocator(backend)
    pool = CachingPool(backend, capacity=256 * MiB, relocator=owner, policy=BACKGROUND)
    real_copy = backend.copy
    failures = 0

    def copy_failing_once(*args: object) -> None:
        nonlocal failures
        if failures == 0:
            failures += 1
            raise RuntimeError("injected device copy failure")
        real_copy(*args)

    backend.copy = copy_failing_once  # type: ignore[method-assign]
    compactor = BackgroundCompactor([pool], lambda: False)
    compactor.start()
    try:
        for i in range(10):
            owner.add(f"s{i}", pool.malloc(4 * MiB), seed=i)
        for i in (0, 1, 2, 8, 9):  # the frees ring the doorbell
            owner.contents.pop(f"s{i}")
            pool.free(owner.blocks.pop(f"s{i}"))
        assert wait_until(lambda: failures == 1)
        owner.contents.pop("s3")  # the next free rings again: the compactor, alive, compacts
        pool.free(owner.blocks.pop("s3"))
        assert wait_until(lambda: compactor.moves >= 1 and pool.compaction_excess() == 0)
        assert compactor.running
    finally:
        compactor.close()
    pool.assert_invariants()
    owner.check_bytes()


def test_a_pool_far_above_target_is_compacted_beyond_the_per_wake_up_budget() -> None:
    """Far above target (reserved / allocated > URGENT_RATIO: users freeing at once) one
    wake-up is not held to max_moved_bytes: the segment whose Storages take more than it
    to move is emptied now, not left for later (one move per step, still stepping aside)."""
    pool, owner = half_freed_background_pool(
        dataclasses.replace(BACKGROUND, max_moved_bytes=4 * MiB)
    )
    assert pool.reserved_ratio() == 2.0 > URGENT_RATIO
    compactor = BackgroundCompactor([pool], lambda: False)
    assert compactor.drain(pool) == 8 * MiB  # two 4 MiB Storages, past the 4 MiB budget
    assert pool.memory_stats()["segment.all.current"] == 1
    pool.assert_invariants()
    owner.check_bytes()
