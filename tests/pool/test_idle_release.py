"""Idle segments go back with time hysteresis (policy ``release_idle_s``), warm until then.

A segment left wholly free is kept for ``release_idle_s`` under a background compactor,
so a client that uploads, drops and uploads again reuses warm pages instead of faulting
in a new segment each time (~1.2 s per GiB of fresh memfd pages on a host, against
~0.12 s per GiB to copy into warm ones); the compactor gives it back once it has been
idle that long, and the out-of-memory path at once.  Every clock here is injected: the
assertions never depend on how long a step took.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator

from tensord.local.transfers import STAGED_PUT_BYTES, staging_bytes
from tensord_server.devices.memory import HostBackend
from tensord_server.domain.compactor import IDLE_RELEASE_MARGIN_S, BackgroundCompactor
from tensord_server.domain.store import TensorStore
from tensord_server.pool import (
    DEFAULT_POLICY,
    Block,
    CachingPool,
    PoolPolicy,
    default_warm_reserve,
    policy_named,
)

MiB = 1 << 20
ADAPTIVE = policy_named("adaptive")
DECAY_S = ADAPTIVE.release_idle_s
WARM_S = ADAPTIVE.warm_reserve_s
WAIT_LIMIT_S = 10.0  # the one real wait below ends well before this unless something is broken


class FakeClock:
    """A clock that moves only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class NothingMoves:
    """A relocator owning no block: compaction may only give wholly free segments back."""

    @contextlib.contextmanager
    def relocation(self, pool: CachingPool) -> Iterator[dict[Block, Callable[[Block], None]]]:
        yield {}


def background_pool(
    policy: PoolPolicy = ADAPTIVE,
    capacity: int = 1 << 30,
    backend: type[HostBackend] = HostBackend,
    warm_reserve: int = 0,
) -> tuple[CachingPool, FakeClock, list[int]]:
    """A pool as a server's (a doorbell: frees leave the work to drain()), on a fake clock,
    with a warm reserve of ``warm_reserve`` bytes; the list counts the doorbell's rings."""
    clock = FakeClock()
    pool = CachingPool(
        backend(total_bytes=1 << 30),
        capacity=capacity,
        relocator=NothingMoves(),
        policy=policy,
        clock=clock,
    )
    pool.warm_reserve = warm_reserve
    rings: list[int] = []
    pool.compaction_wanted = lambda: rings.append(1)
    return pool, clock, rings


def segments(pool: CachingPool) -> int:
    return int(pool.memory_stats()["segment.all.current"])


def test_the_default_policy_keeps_idle_segments_for_a_while() -> None:
    assert DECAY_S is not None and 0.5 <= DECAY_S <= 10


def test_a_freed_segment_is_kept_until_it_has_been_idle_release_idle_s() -> None:
    """Kept before the decay time (the free rings the doorbell and gives nothing back;
    the compactor, woken, leaves it), given back by the compactor's step after it."""
    assert DECAY_S is not None
    pool, clock, rings = background_pool()
    pool.free(pool.malloc(64 * MiB))
    assert segments(pool) == 1 and rings  # kept, and the compactor told
    compactor = BackgroundCompactor([pool], lambda: False)
    clock.now += DECAY_S / 2
    compactor.drain(pool)
    assert segments(pool) == 1 and pool.compaction_excess() == 0
    # the compactor's next wake-up comes when the segment may go back
    delay = compactor.until_idle_release()
    assert delay is not None and abs(delay - (DECAY_S / 2 + IDLE_RELEASE_MARGIN_S)) < 1e-9
    clock.now += DECAY_S / 2
    compactor.drain(pool)
    assert segments(pool) == 0 and pool.memory_stats()["num_device_free"] == 1
    assert compactor.until_idle_release() is None  # nothing kept: wait for the doorbell
    pool.assert_invariants()


def test_segments_that_decayed_unseen_are_given_back_at_the_next_look() -> None:
    """The compactor may be busy (or backing off) past a segment's decay time: it must
    then look at once, not sleep until a doorbell that may never ring."""
    assert DECAY_S is not None
    pool, clock, _ = background_pool()
    first, second = pool.malloc(64 * MiB), pool.malloc(64 * MiB)
    pool.free(first)
    clock.now += DECAY_S / 2
    pool.free(second)
    compactor = BackgroundCompactor([pool], lambda: False)
    clock.now += DECAY_S * 2  # both decayed while the compactor was not looking
    assert compactor.until_idle_release() == IDLE_RELEASE_MARGIN_S
    compactor.drain(pool)
    assert segments(pool) == 0 and compactor.until_idle_release() is None
    pool.assert_invariants()


def test_reusing_a_kept_segment_restarts_its_idle_time() -> None:
    assert DECAY_S is not None
    pool, clock, _ = background_pool()
    pool.free(pool.malloc(64 * MiB))
    clock.now += DECAY_S * 0.9
    block = pool.malloc(64 * MiB)  # the kept segment, warm
    assert pool.memory_stats()["num_device_alloc"] == 1
    clock.now += DECAY_S * 0.9
    pool.free(block)
    clock.now += DECAY_S * 0.9  # 2.7 x the decay since the first free, 0.9 x since the last
    BackgroundCompactor([pool], lambda: False).drain(pool)
    assert segments(pool) == 1
    pool.assert_invariants()


def test_upload_drop_upload_reserves_no_new_segment() -> None:
    """A client's `x = client.tensor(a)` in a loop: each new Storage is allocated before
    the old one is released (its handle dies after the assignment, its release is sent
    later), so two segments alternate: both must stay reserved, with the compactor
    running, rather than be given back and faulted in again on every upload."""
    store = TensorStore(["cpu=1GiB"])
    pool = store.devices.get("cpu").pool
    pool.policy = ADAPTIVE  # as `tensord serve` sets it
    clock = FakeClock()
    pool.clock = clock
    store.start()
    try:
        cpu = store.devices.get("cpu")
        previous = None
        for _ in range(6):
            storage = store.storages.allocate(cpu, 256 * MiB)  # an upload: held while written
            store.storages.incref(storage)  # ... then owned by the client's handle
            store.storages.release_hold(storage)
            if previous is not None:
                store.storages.decref(previous)  # the previous upload's handle dropped
            previous = storage
            clock.now += 0.1
        stats = pool.memory_stats()
        assert stats["num_device_alloc"] == 2 and stats["num_device_free"] == 0
        assert previous is not None
        store.storages.decref(previous)
        pool.assert_invariants()
    finally:
        store.close()


def test_kept_segments_hold_at_most_keep_idle_fraction_of_allocated() -> None:
    """keep_idle_fraction (0.15): of the segments freed within release_idle_s, the most
    recently freed are kept within 0.15x the allocated bytes; a free that leaves reserved
    above the compactor's wake-up threshold gives the others back at once, before any
    compactor step (under a 50-user load test 2-5 kept segments held 90-150 MiB, up to
    0.3x allocated: the samples above the 1.25 target)."""
    assert ADAPTIVE.keep_idle_fraction == 0.15
    pool, clock, _ = background_pool()
    live = pool.malloc(200 * MiB)
    for block in [pool.malloc(20 * MiB) for _ in range(3)]:
        clock.now += 0.1
        pool.free(block)
    # 0.15 x 200 MiB = 30 MiB: the last 20 MiB segment kept, the two before it given back
    assert segments(pool) == 2
    assert pool.memory_stats()["reserved_bytes.all.current"] == 220 * MiB
    clock.now += 0.1
    pool.free(live)  # the most recently freed is kept whatever its size (nothing allocated)
    assert segments(pool) == 1
    assert pool.memory_stats()["reserved_bytes.all.current"] == 200 * MiB
    pool.assert_invariants()


def test_the_out_of_memory_path_gives_kept_segments_back() -> None:
    """A kept segment is a cache, not a reservation: a request the device has no room for
    while it is kept gets it (torch's release_cached_blocks, before any OOM)."""
    pool, _, _ = background_pool(capacity=256 * MiB)
    pool.free(pool.malloc(128 * MiB))
    assert segments(pool) == 1  # kept
    block = pool.malloc(200 * MiB)  # 128 + 200 > 256: only without the kept segment
    stats = pool.memory_stats()
    assert stats["num_ooms"] == 0 and stats["num_device_free"] == 1
    assert stats["reserved_bytes.all.current"] == 200 * MiB
    pool.free(block)
    pool.assert_invariants()


class CostlyChurnBackend(HostBackend):
    """Host memory flagged as CUDA's is: giving a segment back waits for the device."""

    costly_segment_churn = True


def test_near_the_devices_edge_no_segment_is_kept() -> None:
    """Above keep_idle_below x capacity (0.75) a free segment is room, not a cache: the
    free that leaves reserved above the compactor's wake-up threshold gives it back
    itself (no copy; the compactor comes late under load).  Further from the edge the
    same free keeps it.  Where giving a segment back waits for the device (CUDA) the free
    leaves it to the compactor, which gives it back at its next look, decayed or not."""
    cases = (  # capacity, backend, segments after the free, after the compactor's look
        (256 * MiB, HostBackend, 1, 1),
        (512 * MiB, HostBackend, 2, 2),  # kept: not decayed yet
        (256 * MiB, CostlyChurnBackend, 2, 1),
    )
    # the warm reserve changes none of it: near the edge it keeps nothing either
    for capacity, backend, after_free, after_compactor in cases:
        for reserve in (0, 1 << 30):
            pool, _, _ = background_pool(capacity=capacity, backend=backend, warm_reserve=reserve)
            live = pool.malloc(150 * MiB)
            pool.free(pool.malloc(48 * MiB))  # 198 MiB reserved: above 0.75 x 256, not x 512
            assert segments(pool) == after_free, (capacity, backend, reserve)
            BackgroundCompactor([pool], lambda: False).drain(pool)
            assert segments(pool) == after_compactor, (capacity, backend, reserve)
            pool.free(live)
            pool.assert_invariants()


def test_the_warm_reserve_outlasts_the_decay_within_its_bytes_then_goes_back() -> None:
    """A put after a pause of a few seconds (past release_idle_s) finds its segment warm:
    the reserve keeps the most recently freed segments that fit its bytes for
    warm_reserve_s, and never more; without it the same frees keep nothing past the decay."""
    assert DECAY_S is not None and WARM_S is not None and WARM_S >= 10 * DECAY_S
    for reserve in (0, 300 * MiB):
        pool, clock, _ = background_pool(warm_reserve=reserve)
        start = clock.now
        for block in [pool.malloc(128 * MiB) for _ in range(3)]:
            clock.now += 0.1
            pool.free(block)
        # nothing allocated, so keep_idle_fraction keeps only the last one freed; the reserve
        # also the one before it (256 MiB), not the first (384 MiB > 300 MiB): that one went
        # back on the last free, without waiting for its decay
        assert segments(pool) == (2 if reserve else 1), reserve
        compactor = BackgroundCompactor([pool], lambda: False)
        clock.now = start + 0.3 + 2 * DECAY_S  # past release_idle_s: the decay alone is over
        compactor.drain(pool)
        stats = pool.memory_stats()
        assert stats["reserved_bytes.all.current"] == (256 * MiB if reserve else 0), reserve
        assert stats["reserved_bytes.all.current"] <= reserve
        pool.assert_invariants()
        if not reserve:
            assert compactor.until_idle_release() is None
            continue
        # the next wake-up: when the older of the two has been idle warm_reserve_s
        delay = compactor.until_idle_release()
        expected = start + 0.2 + WARM_S - clock.now + IDLE_RELEASE_MARGIN_S
        assert delay is not None and abs(delay - expected) < 1e-9
        clock.now = start + 0.25 + WARM_S
        compactor.drain(pool)
        assert segments(pool) == 1  # the older went back, the newer has 0.05 s to go
        clock.now = start + 0.35 + WARM_S
        compactor.drain(pool)
        assert segments(pool) == 0 and compactor.until_idle_release() is None
        pool.assert_invariants()


def test_segments_beyond_the_warm_reserve_keep_the_decays_schedule() -> None:
    """What does not fit the reserve goes back as release_idle_s says (here, with every
    idle segment kept for it, once it has been idle that long), while the reserve's
    segment stays warm until warm_reserve_s."""
    assert DECAY_S is not None and WARM_S is not None
    keep_all = dataclasses.replace(ADAPTIVE, keep_idle_fraction=None)
    pool, clock, _ = background_pool(keep_all, warm_reserve=100 * MiB)
    start = clock.now
    first, second = pool.malloc(64 * MiB), pool.malloc(64 * MiB)
    pool.free(first)
    clock.now += 0.1
    pool.free(second)  # the reserve holds it; 128 MiB would not fit: the first is outside
    compactor = BackgroundCompactor([pool], lambda: False)
    clock.now = start + DECAY_S / 2
    compactor.drain(pool)
    assert segments(pool) == 2  # both within their decay
    clock.now = start + DECAY_S + 0.05  # the first's decay is over, not the second's
    compactor.drain(pool)
    assert segments(pool) == 1
    clock.now = start + 0.1 + DECAY_S + 0.05  # the second is past it too, but warm
    compactor.drain(pool)
    assert segments(pool) == 1
    clock.now = start + 0.15 + WARM_S
    compactor.drain(pool)
    assert segments(pool) == 0
    pool.assert_invariants()


def test_a_warm_segment_is_reused_and_its_idle_time_restarts() -> None:
    """A put after the decay reuses the warm segment (no new segment, no page faults)."""
    assert DECAY_S is not None and WARM_S is not None
    pool, clock, _ = background_pool(warm_reserve=256 * MiB)
    compactor = BackgroundCompactor([pool], lambda: False)
    block = pool.malloc(256 * MiB)
    for _ in range(3):
        pool.free(block)
        clock.now += 2 * DECAY_S
        compactor.drain(pool)
        block = pool.malloc(256 * MiB)
    stats = pool.memory_stats()
    assert stats["num_device_alloc"] == 1 and stats["num_device_free"] == 0
    pool.free(block)
    pool.assert_invariants()


def test_without_a_background_compactor_idle_segments_go_back_at_once() -> None:
    """A replay (no compactor thread, no clock) stays deterministic: release is immediate."""
    pool, _, _ = background_pool()
    pool.compaction_wanted = None
    pool.warm_reserve = 1 << 30  # a warm reserve changes nothing without a compactor either
    kept = pool.malloc(30 * MiB)
    for block in [pool.malloc(30 * MiB) for _ in range(3)]:
        pool.free(block)
    assert pool.memory_stats()["reserved_bytes.all.current"] == 30 * MiB
    pool.free(kept)


def test_the_compactor_thread_wakes_up_to_give_a_kept_segment_back() -> None:
    """No doorbell after the decay: the thread's own timed wake-up gives the segment back."""
    policy = dataclasses.replace(ADAPTIVE, release_idle_s=0.2)
    pool, clock, _ = background_pool(policy)
    compactor = BackgroundCompactor([pool], lambda: False)
    compactor.start()
    try:
        pool.free(pool.malloc(64 * MiB))  # rings: the compactor wakes, keeps it, sleeps 0.2 s
        assert segments(pool) == 1
        clock.now += 0.2  # the pool's clock says it may go back when the thread looks again
        deadline = time.monotonic() + WAIT_LIMIT_S
        while segments(pool) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert segments(pool) == 0
    finally:
        compactor.close()
    pool.assert_invariants()


class PeersBenchPool:
    """What bench_peers' tensord puts ask of a server's pool (`tensord serve --device
    cpu=2GiB`, its default policy and warm reserve), on a fake clock, its compactor
    looking whenever time passes (as its thread wakes when a kept segment may go back).

    A same-host put of at most STAGED_PUT_BYTES writes a staging tensor the client keeps
    (made once per size) and the server copies it into the named tensor; a larger one
    allocates the named tensor itself.  A get allocates nothing; a delete frees."""

    def __init__(self) -> None:
        capacity = 2 << 30
        self.clock = FakeClock()
        self.pool = CachingPool(
            HostBackend(total_bytes=capacity),
            capacity=capacity,
            relocator=NothingMoves(),
            policy=policy_named(DEFAULT_POLICY),
            clock=self.clock,
        )
        self.pool.warm_reserve = default_warm_reserve(capacity)  # as `tensord serve` sets it
        self.pool.compaction_wanted = lambda: None
        self.compactor = BackgroundCompactor([self.pool], lambda: False)
        self.stagings: dict[int, Block] = {}

    def wait(self, seconds: float) -> None:
        self.clock.now += seconds
        self.compactor.drain(self.pool)

    def put(self, nbytes: int) -> Block:
        if nbytes <= STAGED_PUT_BYTES:
            size = staging_bytes(nbytes)
            if size not in self.stagings:
                self.stagings[size] = self.pool.malloc(size)
        return self.pool.malloc(nbytes)

    def segments_reserved(self) -> int:
        return int(self.pool.memory_stats()["num_device_alloc"])


def test_puts_after_a_pause_in_the_peers_benchmark_reserve_no_new_segment() -> None:
    """bench_peers' put rows, tensord's side, two rounds: warm puts of each size, the other
    peers' turns, then each size again after a 4 s pause (and its get after another), then
    the small objects.  The bench revisits each size about every 30 s (four sizes, two
    pauses each, the other peers' turns), so the last size's segment has been idle more
    than 30 s when its paused put comes, beside the other sizes' segments: every paused
    put must still find a warm segment (a new one is a new memfd whose every page faults
    in: 83 ms instead of 8 ms at 64 MiB).  And the pool still gives all of it back once
    left idle for the reserve's decay."""
    assert WARM_S is not None and DECAY_S is not None
    bench = PeersBenchPool()
    sizes = (4 << 10, 1 * MiB, 64 * MiB, 256 * MiB)
    repeats = {4 << 10: 15, 1 * MiB: 9, 64 * MiB: 5, 256 * MiB: 3}  # bench_peers.REPEATS
    pause_s, others_warm_s, others_paused_s = 4.0, 2.0, 0.5
    new_segments = []
    for _ in range(2):
        for nbytes in sizes:  # warm: one unrecorded put, then the recorded ones
            for _ in range(1 + repeats[nbytes]):
                block = bench.put(nbytes)
                bench.wait(0.01)
                bench.pool.free(block)
            bench.wait(others_warm_s)
        for nbytes in sizes:  # after a pause: tensord last, its segment the longest idle
            bench.wait(pause_s + others_paused_s)
            before = bench.segments_reserved()
            block = bench.put(nbytes)
            if bench.segments_reserved() != before:
                new_segments.append(nbytes)
            bench.wait(pause_s + others_paused_s)
            bench.pool.free(block)
        for _ in range(2):  # the small objects: put one by one, then batched; deleted
            blocks = [bench.put(4 << 10) for _ in range(2_000)]
            bench.wait(2.0)
            for block in blocks:
                bench.pool.free(block)
            bench.wait(0.5)
    assert new_segments == [], f"puts of {new_segments} bytes after a pause faulted in anew"
    bench.pool.assert_invariants()
    # left idle for the reserve's decay, the pool gives back the large segments and the
    # small ones but what the compactor leaves (background_min_slack, beside the stagings')
    bench.wait(WARM_S + IDLE_RELEASE_MARGIN_S)
    stats = bench.pool.memory_stats()
    slack = bench.pool.policy.background_min_slack
    assert slack is not None and slack < 64 * MiB
    assert stats["reserved_bytes.all.current"] <= 2 * MiB + slack
    for block in bench.stagings.values():
        bench.pool.free(block)
    bench.wait(WARM_S + IDLE_RELEASE_MARGIN_S)
    assert bench.pool.memory_stats()["reserved_bytes.all.current"] <= slack
    bench.pool.assert_invariants()
