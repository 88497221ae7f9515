"""Compaction: on the out-of-memory path the pool moves unheld Storages out of its
least-used segments, releases them, and retries — and nothing else changes.

Pure policy first (which segments, where the blocks go), then the pool with a
toy relocator (every block movable), then a real server: the fragmentation
that OOMs without compaction succeeds with it, every byte and every kind of
handle intact; held Storages (an op in flight, a download streaming) stay
put; the quota ledger is unchanged by moves; concurrent clients leave invariants holding.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import SessionStub, open_channel
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensord import schema as pb
from tensord.errors import OutOfMemoryError
from tensord_server.data import bundled_trace
from tensord_server.devices import cuda as cuda_backend
from tensord_server.devices.memory import BookkeepingBackend, HostBackend
from tensord_server.domain.quotas import QuotaSpec
from tensord_server.domain.storage import Storage
from tensord_server.pool import (
    LARGE_BUFFER,
    Block,
    CachingPool,
    CompactionPlan,
    Move,
    PoolMoves,
    SegmentUsage,
    background_evacuation_order,
    cache,
    compaction,
    evacuation_order,
    place,
    plan_compaction,
)
from tensord_server.pool.compaction import repack_options, segment_usage
from tensord_server.tools.replay import (
    COMPARED_KEYS,
    RecordedAddressBackend,
    load_pytorch_stats,
    load_trace,
    replay,
)

MiB = 1 << 20
HOST_BYTES = 1 << 30  # the host backend's nominal size (the pools' capacities are smaller)
UNLIMITED = (1 << 64) - 1

# The server scenario: three 20 MiB segments of ten 2 MiB tensors each fill the pool;
# every other tensor is freed (30 MiB free, no piece above 2 MiB), then 12 MiB is asked for.
POOL = "cpu=60MiB"
TENSOR_ELEMENTS = (2 * MiB) // 4  # float32
BIG_ELEMENTS = (12 * MiB) // 4
TRACE = bundled_trace("resnet50_train")  # ships with the package


# ---------------------------------------------------------------------------
# pure policy


def usage(
    address: int,
    size: int,
    allocated: list[int],
    free: list[int],
    *,
    movable: bool = True,
    small: bool = False,
    stream: int = 0,
) -> SegmentUsage:
    """A segment tiled by ``allocated`` then ``free`` block sizes (MiB), in that order."""
    blocks, cursor = [], address
    for n in allocated:
        blocks.append((cursor, n * MiB, n * MiB))
        cursor += n * MiB
    spaces = []
    for n in free:
        spaces.append((cursor, n * MiB))
        cursor += n * MiB
    assert cursor == address + size * MiB
    return SegmentUsage(address, size * MiB, small, stream, tuple(blocks), tuple(spaces), movable)


def test_evacuation_order_is_least_used_first_and_skips_unmovable() -> None:
    a = usage(0x1000_0000, 20, [8], [12])
    b = usage(0x2000_0000, 20, [2, 2], [16])
    c = usage(0x3000_0000, 40, [4], [36])  # as used as b, but releases more
    d = usage(0x4000_0000, 20, [2], [18], movable=False)
    assert [s.address for s in evacuation_order([a, b, c, d])] == [c.address, b.address, a.address]


def test_place_is_best_fit_and_never_grows_a_block() -> None:
    free = [(2 * MiB, 0x100, 1), (4 * MiB, 0x200, 1), (6 * MiB, 0x300, 2)]
    assert place(free, 2 * MiB, 2 * MiB, False, UNLIMITED) == (0, 2 * MiB)
    assert place(free, 3 * MiB, 4 * MiB, False, UNLIMITED) == (1, 4 * MiB)  # 1 MiB left: unsplit
    # the 4 MiB block would be taken whole (growing a 3 MiB block): the 6 MiB one is split instead
    assert place(free, 3 * MiB, 3 * MiB, False, UNLIMITED) == (2, 3 * MiB)
    assert place(free, 7 * MiB, 7 * MiB, False, UNLIMITED) is None
    # max_split_size: a request below it never takes an oversize block
    big = [(30 * MiB, 0x400, 3)]
    assert place(big, 2 * MiB, 2 * MiB, False, 25 * MiB) is None
    assert place(big, 2 * MiB, 2 * MiB, False, UNLIMITED) == (0, 2 * MiB)


def test_plan_empties_the_least_used_segment_into_the_others() -> None:
    a = usage(0x1000_0000, 20, [2, 2, 2], [14])
    b = usage(0x2000_0000, 20, [2, 2, 2, 2], [12])
    plan = plan_compaction([a, b], needed=12 * MiB, max_split_size=UNLIMITED)
    assert plan.evacuated == (a.address,) and plan.released == 20 * MiB
    # largest first (all equal: by address), each into the front of b's free space
    free_start = b.address + 8 * MiB
    assert plan.moves == tuple(
        Move(a.address + i * 2 * MiB, free_start + i * 2 * MiB, 2 * MiB) for i in range(3)
    )


def test_plan_never_moves_into_an_emptied_segment_nor_empties_a_receiver() -> None:
    a = usage(0x1000_0000, 20, [2], [18])
    b = usage(0x2000_0000, 20, [4], [16])
    c = usage(0x3000_0000, 20, [6], [14])
    plan = plan_compaction([a, b, c], needed=40 * MiB, max_split_size=UNLIMITED)
    # a goes into c's 14 MiB (best fit); c received a block, so b is emptied next, into c
    assert plan.evacuated == (a.address, b.address) and plan.released == 40 * MiB
    assert plan.moves == (
        Move(a.address, c.address + 6 * MiB, 2 * MiB),
        Move(b.address, c.address + 8 * MiB, 4 * MiB),
    )
    # not into a (being emptied) although its 18 MiB fit b's block


def test_plan_that_cannot_reach_the_need_moves_nothing() -> None:
    a = usage(0x1000_0000, 20, [10], [10])
    b = usage(0x2000_0000, 20, [12], [8])  # a's 10 MiB fits nowhere, b's 12 neither
    plan = plan_compaction([a, b], needed=MiB, max_split_size=UNLIMITED)
    assert plan == CompactionPlan((), (), 0) and plan.empty
    c = usage(0x3000_0000, 2, [1], [1], small=True)
    d = usage(0x4000_0000, 2, [1], [1], small=True)
    partial = plan_compaction([c, d], needed=4 * MiB, max_split_size=UNLIMITED)
    assert partial.empty and partial.released == 2 * MiB  # how far it got, for the OOM note
    # blocks never cross pools or streams
    e = usage(0x5000_0000, 20, [1], [19], stream=7)
    assert plan_compaction([c, e], needed=MiB, max_split_size=UNLIMITED).empty


# ---------------------------------------------------------------------------
# the pool, with a relocator that lets every block move


class ToyRelocator:
    """Owns blocks by name; every one may move unless held."""

    def __init__(self) -> None:
        self.blocks: dict[str, Block] = {}
        self.pinned: set[str] = set()
        self.moves = 0

    @contextlib.contextmanager
    def relocation(self, pool: CachingPool) -> Iterator[dict[Block, Callable[[Block], None]]]:
        def repoint(name: str) -> Callable[[Block], None]:
            def to(block: Block) -> None:
                assert block.size <= self.blocks[name].size
                self.blocks[name] = block
                self.moves += 1

            return to

        yield {b: repoint(n) for n, b in self.blocks.items() if n not in self.pinned and b.size}

    def claim(self, block: Block) -> object:
        """The name owning ``block`` (names are never reused; a toy's holds touch no bytes)."""
        return next((n for n, b in self.blocks.items() if b is block), None)


def fragmented_pool(
    backend: Any, relocator: ToyRelocator | None
) -> tuple[CachingPool, dict[str, bytes]]:
    """60 MiB capacity, three 20 MiB segments, every other 2 MiB block freed; bytes per name."""
    pool = CachingPool(backend, capacity=60 * MiB, relocator=relocator)
    owner = relocator or ToyRelocator()
    contents: dict[str, bytes] = {}
    for i in range(30):
        block = pool.malloc(2 * MiB)
        owner.blocks[f"t{i}"] = block
        if backend.xp is not None:
            data = np.random.default_rng(i).integers(0, 256, 2 * MiB, np.uint8).tobytes()
            backend.write(block.segment.memory, block.offset, data)
            contents[f"t{i}"] = data
    for i in range(0, 30, 2):
        pool.free(owner.blocks.pop(f"t{i}"))
        contents.pop(f"t{i}", None)
    pool.assert_invariants()
    return pool, contents


def test_pool_without_a_relocator_is_torch_exactly() -> None:
    pool, _ = fragmented_pool(BookkeepingBackend(), None)
    with pytest.raises(OutOfMemoryError) as info:
        pool.malloc(12 * MiB)
    assert str(info.value).endswith("is reserved by tensord but unallocated.")  # no note
    stats = pool.memory_stats()
    assert stats["num_ooms"] == 1 and stats["num_compactions"] == 0
    pool.assert_invariants()


def test_pool_compacts_and_keeps_every_byte() -> None:
    relocator = ToyRelocator()
    backend = HostBackend(total_bytes=HOST_BYTES)
    pool, contents = fragmented_pool(backend, relocator)
    before = {n: b.address for n, b in relocator.blocks.items()}
    block = pool.malloc(12 * MiB)
    pool.assert_invariants()
    assert block.size == 12 * MiB
    moved = [n for n, b in relocator.blocks.items() if b.address != before[n]]
    assert len(moved) == relocator.moves == 5  # one segment's five blocks
    for name, data in contents.items():
        b = relocator.blocks[name]
        assert backend.read(b.segment.memory, b.offset, 2 * MiB) == data, name
    stats = pool.memory_stats()
    assert stats["num_ooms"] == 0 and stats["num_compactions"] == 1
    assert stats["compaction_moved_bytes"] == 10 * MiB
    assert stats["compaction_released_bytes"] == 20 * MiB
    assert stats["reserved_bytes.all.current"] == 52 * MiB
    assert stats["segment.all.current"] == 3
    pool.reset_accumulated_memory_stats()
    assert pool.memory_stats()["num_compactions"] == 0


def test_a_move_without_room_to_commit_ends_the_plan_and_keeps_every_byte(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A destination the device has no room to commit (a pool whose capacity bounds
    committed bytes) refuses its move: the plan stops there, the moves made stand (counted),
    the segment they did not empty stays, and the request is out of memory."""
    allocate = PoolMoves.allocate_in_place
    calls = itertools.count()

    def refuse_the_third(
        self: PoolMoves, source: Block, destination: int, size: int, exact: bool = False
    ) -> Any:
        return None if next(calls) >= 2 else allocate(self, source, destination, size, exact)

    monkeypatch.setattr(PoolMoves, "allocate_in_place", refuse_the_third)
    relocator = ToyRelocator()
    backend = HostBackend(total_bytes=HOST_BYTES)
    pool, contents = fragmented_pool(backend, relocator)
    with pytest.raises(OutOfMemoryError, match="Compaction could release 0 bytes"):
        pool.malloc(12 * MiB)
    pool.assert_invariants()
    assert relocator.moves == 2
    for name, data in contents.items():
        b = relocator.blocks[name]
        assert backend.read(b.segment.memory, b.offset, 2 * MiB) == data, name
    stats = pool.memory_stats()
    assert stats["num_compactions"] == 0 and stats["compaction_moved_bytes"] == 4 * MiB
    assert stats["segment.all.current"] == 3


def test_a_hopeless_request_does_not_stop_the_world() -> None:
    """More than all free space: no plan could help, so the relocator is never entered."""

    class Refusing(ToyRelocator):
        entered = 0

        @contextlib.contextmanager
        def relocation(self, pool: CachingPool) -> Iterator[dict[Block, Callable[[Block], None]]]:
            self.entered += 1
            with super().relocation(pool) as movable:
                yield movable

    relocator = Refusing()
    pool, _ = fragmented_pool(BookkeepingBackend(), relocator)  # 30 MiB free in 60 MiB
    with pytest.raises(OutOfMemoryError) as info:
        pool.malloc(40 * MiB)
    assert str(info.value).endswith(
        "Compaction could release at most 30.00 MiB of the 40.00 MiB needed."
    )
    assert relocator.entered == 0
    pool.malloc(12 * MiB)  # a request compaction can serve still enters it
    assert relocator.entered == 1 and relocator.moves > 0
    pool.assert_invariants()


def test_a_failed_copy_leaves_no_block_behind() -> None:
    """A device error in the middle of a compaction (the third copy fails): the blocks
    already moved stay consistently moved, the one being moved stays put, nothing leaks."""

    class FailingCopies(HostBackend):
        copies = 0

        def copy(self, *args: Any) -> None:
            self.copies += 1
            if self.copies == 3:
                raise RuntimeError("device error")
            super().copy(*args)

    relocator = ToyRelocator()
    pool, contents = fragmented_pool(FailingCopies(total_bytes=HOST_BYTES), relocator)
    allocated = pool.memory_stats()["allocated_bytes.all.current"]
    with pytest.raises(RuntimeError, match="device error"):
        pool.malloc(12 * MiB)
    assert pool.memory_stats()["allocated_bytes.all.current"] == allocated
    assert relocator.moves == 2
    pool.assert_invariants()
    for name, block in relocator.blocks.items():  # every owner still reads its own bytes
        assert pool.backend.read(block.segment.memory, block.offset, 2 * MiB) == contents[name]


def test_pool_gives_up_cleanly_when_nothing_may_move() -> None:
    relocator = ToyRelocator()
    pool, _ = fragmented_pool(BookkeepingBackend(), relocator)
    relocator.pinned = {"t1", "t11", "t21"}  # one block in each segment
    untouched = dict(relocator.blocks)
    with pytest.raises(OutOfMemoryError) as info:
        pool.malloc(12 * MiB)
    plain, _ = fragmented_pool(BookkeepingBackend(), None)  # the same state, no relocator
    with pytest.raises(OutOfMemoryError) as torch_info:
        plain.malloc(12 * MiB)
    # torch's message unchanged, plus the note
    note = " Compaction could release 0 bytes of the 12.00 MiB needed."
    assert str(info.value) == str(torch_info.value) + note
    assert relocator.blocks == untouched and relocator.moves == 0
    stats = pool.memory_stats()
    assert stats["num_ooms"] == 1 and stats["num_compactions"] == 0
    pool.assert_invariants()
    relocator.pinned = {"t1", "t11"}  # now one segment may be emptied
    pool.malloc(12 * MiB)
    assert relocator.blocks["t1"] is untouched["t1"] and relocator.blocks["t11"] is untouched["t11"]
    pool.assert_invariants()


# ("alloc", size, 0) | ("free", index, 0) | ("pin", index, 0): random sequences on a small pool
pool_ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("alloc"),
            st.one_of(
                st.integers(1, MiB), st.integers(MiB, 12 * MiB), st.integers(10 * MiB, 30 * MiB)
            ),
            st.just(0),
        ),
        st.tuples(st.just("free"), st.integers(0, 1000), st.just(0)),
        st.tuples(st.just("pin"), st.integers(0, 1000), st.just(0)),
    ),
    max_size=80,
)


@pytest.mark.slow
@settings(
    derandomize=True,
    database=None,
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(ops=pool_ops, max_split_size=st.sampled_from([None, LARGE_BUFFER + 4 * MiB]))
def test_random_sequences_with_compaction_keep_invariants(
    ops: list[tuple[str, int, int]], max_split_size: int | None
) -> None:
    relocator = ToyRelocator()
    pool = CachingPool(
        BookkeepingBackend(), capacity=64 * MiB, max_split_size=max_split_size, relocator=relocator
    )
    names = itertools.count()
    ooms = 0
    for action, value, _ in ops:
        live = sorted(relocator.blocks)
        if action == "alloc":
            try:
                relocator.blocks[f"b{next(names)}"] = pool.malloc(value)
            except OutOfMemoryError:
                ooms += 1
        elif action == "free" and live:
            name = live[value % len(live)]
            relocator.pinned.discard(name)
            pool.free(relocator.blocks.pop(name))
        elif action == "pin" and live:
            relocator.pinned ^= {live[value % len(live)]}
        pool.assert_invariants()
        spans = sorted((b.address, b.address + b.size) for b in relocator.blocks.values() if b.size)
        assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))
        stats = pool.memory_stats()
        assert stats["allocated_bytes.all.current"] == sum(
            b.size for b in relocator.blocks.values()
        )
    stats = pool.memory_stats()
    assert stats["num_ooms"] == ooms
    assert stats["compaction_moved_bytes"] >= 0 and (stats["num_compactions"] > 0) == (
        stats["compaction_released_bytes"] > 0
    )
    for block in relocator.blocks.values():
        pool.free(block)
    pool.empty_cache()
    assert pool.memory_stats()["reserved_bytes.all.current"] == 0


def random_pinned_pool(seed: int) -> tuple[CachingPool, ToyRelocator, random.Random]:
    """A pool of small and large segments, some blocks freed and some pinned, no compaction
    yet (a 4 GiB bookkeeping device, so nothing runs out)."""
    rng = random.Random(seed)
    relocator = ToyRelocator()
    pool = CachingPool(BookkeepingBackend(), capacity=4 << 30, relocator=relocator)
    for i in range(rng.randint(20, 120)):
        small = rng.random() < 0.4
        nbytes = rng.randint(1, MiB) if small else rng.randint(MiB, 24 * MiB)
        relocator.blocks[f"b{i}"] = pool.malloc(nbytes)
    churn(pool, relocator, rng)
    return pool, relocator, rng


def churn(pool: CachingPool, relocator: ToyRelocator, rng: random.Random) -> None:
    """Free some blocks, allocate a few more, pin and unpin a few."""
    names = sorted(relocator.blocks)
    for name in rng.sample(names, len(names) // 3):
        relocator.pinned.discard(name)
        pool.free(relocator.blocks.pop(name))
    for _ in range(rng.randint(0, 5)):
        relocator.blocks[f"n{rng.getrandbits(40)}"] = pool.malloc(rng.randint(1, 8 * MiB))
    names = sorted(relocator.blocks)
    relocator.pinned ^= set(rng.sample(names, min(len(names), rng.randint(0, 6))))


@pytest.mark.parametrize("seed", range(12))
def test_kept_segment_views_plan_as_a_walk_from_scratch(seed: int) -> None:
    """Planning from the pool's kept segment views, asking may_move only about the segments
    a plan would empty, gives the very plans and repack options of a fresh walk of every
    segment with movability decided up front, pool after pool as blocks come, go and
    get pinned between plans (and between moves)."""
    pool, relocator, rng = random_pinned_pool(seed)
    for _round in range(6):
        with relocator.relocation(pool) as movable:
            target = PoolMoves(pool, max_moved=rng.choice([None, 8 * MiB, 64 * MiB]))
            kept = target.candidate_segments(movable)
            fresh = [segment_usage(s, movable) for _, s in sorted(pool._segments.items())]
            assert [s.address for s in kept] == [s.address for s in fresh]
            assert [s.movable for s in fresh] == [s.movable and target.may_move(s) for s in kept]
            for needed in (1, 8 * MiB, 40 * MiB, UNLIMITED):
                assert plan_compaction(
                    kept,
                    needed,
                    pool.max_split_size,
                    max_moved=target.max_moved,
                    may_move=target.may_move,
                ) == plan_compaction(fresh, needed, pool.max_split_size, max_moved=target.max_moved)
            assert repack_options(kept, pool.max_split_size, target.may_move) == repack_options(
                fresh, pool.max_split_size
            )
        if rng.random() < 0.5:  # run a step's moves, so the next plan sees moved blocks
            pool.compact_step(64 * MiB)
        churn(pool, relocator, rng)
        pool.assert_invariants()  # the kept views equal fresh walks of their segments


def test_a_plan_walks_only_the_segments_changed_since_the_last(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Planning keeps each segment's view between plans and walks again only the segments
    whose blocks changed since (planning walked every block of every segment for each
    plan, holding the GIL and the registry's lock)."""
    pool, relocator, _ = random_pinned_pool(0)
    walked: list[int] = []

    def counting_shape(segment: Any) -> Any:
        walked.append(segment.address)
        return compaction.segment_shape(segment)

    monkeypatch.setattr(cache, "segment_shape", counting_shape)
    with relocator.relocation(pool) as movable:
        PoolMoves(pool).candidate_segments(movable)
    assert sorted(walked) == sorted(pool._segments)  # the first plan walks every segment
    name = sorted(relocator.blocks)[0]
    freed = relocator.blocks[name]
    relocator.pinned.discard(name)
    pool.free(relocator.blocks.pop(name))
    walked.clear()
    with relocator.relocation(pool) as movable:
        PoolMoves(pool).candidate_segments(movable)
    assert walked == [freed.segment.address]
    pool.assert_invariants()


def test_replay_with_a_relocator_matches_pytorch_exactly() -> None:
    """No OOM, no compaction: a pool that may compact replays ResNet-50 exactly as torch."""
    events = load_trace(TRACE)
    pytorch = load_pytorch_stats(TRACE)
    assert pytorch is not None
    plain = replay(events).stats
    segments = [(addr, size) for action, addr, size, _ in events if action == "segment_alloc"]
    relocator = ToyRelocator()
    pool = CachingPool(RecordedAddressBackend(segments), relocator=relocator)
    live: dict[int, Block] = {}
    for action, addr, size, stream in events:
        if action == "alloc":
            live[addr] = relocator.blocks[str(addr)] = pool.malloc(size, stream)
        elif action == "free_completed" and addr in live:
            pool.free(live.pop(addr))
            del relocator.blocks[str(addr)]
    stats = pool.memory_stats()
    assert stats["num_compactions"] == 0
    for key in COMPARED_KEYS:
        assert stats[key] == plain[key] == pytorch[key], key


def test_cuda_moves_are_queued_on_the_server_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU (a fake CuPy: copies run when their stream is synchronized) a move is a
    device-to-device copy on the server stream; releasing the emptied segment waits for it."""
    from test_cuda_units import fake_cupy  # the fake CuPy of the CUDA unit tests

    cupy = fake_cupy()
    cupy.cuda.runtime.memcpyDeviceToDevice = 3
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(cuda_backend, "_GPUS", {})
    backend = cuda_backend.CudaBackend(device="cuda:0", total_bytes=1 << 30)
    relocator = ToyRelocator()
    pool = CachingPool(backend, capacity=60 * MiB, relocator=relocator)
    for i in range(30):
        relocator.blocks[f"t{i}"] = block = pool.malloc(2 * MiB)
        data = bytes([i]) * (2 * MiB)
        backend.write(block.segment.memory, block.offset, data)
    for i in range(0, 30, 2):
        pool.free(relocator.blocks.pop(f"t{i}"))
    before = {n: b.address for n, b in relocator.blocks.items()}
    pool.malloc(12 * MiB)
    moved = [n for n, b in relocator.blocks.items() if b.address != before[n]]
    assert len(moved) == 5
    kinds = [kind for kind, _ in cupy.cuda.runtime.copies]
    assert kinds.count("d2h") == 5  # the fake labels every non-h2d copy so: the five moves
    assert not backend.stream.queue  # releasing the emptied segment synchronized the stream
    for name, block in relocator.blocks.items():
        expected = bytes([int(name[1:])]) * (2 * MiB)
        assert backend.read(block.segment.memory, block.offset, 2 * MiB) == expected, name
    pool.assert_invariants()


# ---------------------------------------------------------------------------
# a real server


def random_tensor(seed: int, elements: int = TENSOR_ELEMENTS) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(elements).astype(np.float32)


def data_ptr(stub: SessionStub, meta: pb.TensorMeta) -> int:
    return int(stub.view(meta, detach=pb.Detach())[0].storage_data_ptr)


def release(stub: SessionStub, *metas: pb.TensorMeta) -> None:
    stub.Release(pb.ReleaseRequest(handles=[m.handle for m in metas]), metadata=stub.md)


def fragment(stub: SessionStub) -> dict[int, tuple[pb.TensorMeta, np.ndarray]]:
    """Fill the 60 MiB pool with thirty 2 MiB tensors, release every other one; the kept."""
    tensors = {i: (stub.upload(random_tensor(i)), random_tensor(i)) for i in range(30)}
    release(stub, *(tensors[i][0] for i in range(0, 30, 2)))
    return {i: tensors[i] for i in range(1, 30, 2)}


def storage_of(daemon: Any, stub: SessionStub, meta: pb.TensorMeta) -> Storage:
    session = daemon.sessions.peek(stub.session_id)
    return daemon.sessions.lookup(session, meta.handle).storage


def block_of(daemon: Any, stub: SessionStub, meta: pb.TensorMeta) -> int:
    """The pool block's address (where compaction moves a Storage; clients never see it)."""
    return int(storage_of(daemon, stub, meta).block.address)


def ledger_matches_blocks(daemon: Any, tenant: str = "") -> None:
    """The ledger holds each live Storage's charge (its size rounded up to 512 B)."""
    live = daemon.storages.live()
    assert daemon.storages.ledger.usage(tenant, "cpu").current == sum(s.charge for s in live)
    assert daemon.storages.ledger.usage(tenant, "cpu").storages == len(live)


@pytest.mark.slow
def test_fragmentation_ooms_without_compaction(make_server: Any) -> None:
    running = make_server(devices=(POOL,), compaction=False)
    pool = running.daemon.devices.get("cpu").pool
    assert pool.relocator is None
    with open_channel(running.address) as channel:
        stub = SessionStub(channel)
        kept = fragment(stub)
        with pytest.raises(grpc.RpcError) as info:
            stub.upload(random_tensor(99, BIG_ELEMENTS))
        assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "Tried to allocate 12.00 MiB" in info.value.details()
        assert "Compaction" not in info.value.details()
        stats = pool.memory_stats()
        assert stats["allocated_bytes.all.current"] == 30 * MiB  # half the pool free, yet OOM
        assert stats["num_ooms"] == 1 and stats["num_compactions"] == 0
        for meta, values in kept.values():
            np.testing.assert_array_equal(stub.download(meta), values)
        stub.close()


@pytest.mark.slow
def test_fragmentation_succeeds_with_compaction_and_every_handle_reads_right(
    make_server: Any,
) -> None:
    running = make_server(devices=(POOL,), quotas=[QuotaSpec("*", "cpu", 60 * MiB)])
    daemon = running.daemon
    pool = daemon.devices.get("cpu").pool
    with open_channel(running.address) as channel, open_channel(running.address) as other:
        stub, peer = SessionStub(channel), SessionStub(other, "peer")
        kept = fragment(stub)
        ptrs = {i: data_ptr(stub, meta) for i, (meta, _) in kept.items()}
        blocks = {i: block_of(daemon, stub, meta) for i, (meta, _) in kept.items()}
        # every kind of handle on every kept Storage: a view, a share in another session, a name
        views, attached = {}, {}
        for i, (meta, _) in kept.items():
            views[i] = stub.view(meta, narrow=pb.Narrow(dim=0, start=1000, length=5000))[0]
            token = stub.Share(pb.ShareRequest(handle=meta.handle), metadata=stub.md).token
            attached[i] = peer.Attach(pb.AttachRequest(token=token), metadata=peer.md)
            stub.PutName(pb.PutNameRequest(name=f"t{i}", handle=meta.handle), metadata=stub.md)
        ledger_matches_blocks(daemon)

        big_values = random_tensor(99, BIG_ELEMENTS)
        big = stub.upload(big_values)  # OOMs without compaction (the test above)

        stats = pool.memory_stats()
        assert stats["num_ooms"] == 0 and stats["num_compactions"] == 1
        assert stats["compaction_moved_bytes"] == 10 * MiB  # one segment's five tensors
        assert stats["compaction_released_bytes"] == 20 * MiB
        pool.assert_invariants()
        ledger_matches_blocks(daemon)
        moved = {i for i, (meta, _) in kept.items() if block_of(daemon, stub, meta) != blocks[i]}
        assert len(moved) == 5
        for i in kept:  # data_ptr is the Storage's, not the block's: no handle sees a move
            assert attached[i].storage_data_ptr == ptrs[i]
            assert data_ptr(peer, attached[i]) == data_ptr(stub, kept[i][0]) == ptrs[i]
            assert data_ptr(stub, views[i]) == ptrs[i]  # the offset travels apart
        # no live Storage's address range overlaps another's, a new one's included (it may
        # reuse a freed tensor's range, as torch's allocator reuses addresses)
        later = stub.upload(random_tensor(7, 1000))
        spans = sorted((s.data_ptr, s.data_ptr + s.nbytes) for s in daemon.storages.live())
        assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))
        assert data_ptr(stub, later) in {start for start, _ in spans}
        release(stub, later)
        for i, (meta, values) in kept.items():
            np.testing.assert_array_equal(stub.download(meta), values)
            np.testing.assert_array_equal(stub.download(views[i]), values[1000:6000])
            np.testing.assert_array_equal(peer.download(attached[i]), values)
            named = stub.GetName(pb.GetNameRequest(name=f"t{i}"), metadata=stub.md)
            np.testing.assert_array_equal(stub.download(named), values)
        np.testing.assert_array_equal(stub.download(big), big_values)
        # memory_viz still reads the snapshot: every block inside its segment, states as torch's
        snapshot = pool.memory_snapshot()
        for segment in snapshot["segments"]:
            assert sum(b["size"] for b in segment["blocks"]) == segment["total_size"]
        stub.close()
        peer.close()


@contextlib.contextmanager
def downloading(daemon: Any, session: Any, handle: str) -> Iterator[list[bytes]]:
    """A download streaming (its first chunk sent, the rest not), finished on exit."""
    stream = daemon.transfers.download(session, handle, chunk_bytes=64 << 10)
    chunks = [next(stream)]
    yield chunks
    chunks.extend(stream)


def segments_of(daemon: Any, stub: SessionStub, kept: dict[int, Any]) -> list[list[int]]:
    """The kept tensors grouped by the segment their Storage is in, segments by address."""
    groups: dict[int, list[int]] = {}
    for i, (meta, _) in kept.items():
        groups.setdefault(storage_of(daemon, stub, meta).block.segment.address, []).append(i)
    return [groups[address] for address in sorted(groups)]


@pytest.mark.slow
def test_pinned_storages_never_move(make_server: Any) -> None:
    """An op in flight (a hold) or a download streaming keeps its Storage in place: with one
    in each segment compaction gives up; with the first segment held it empties another."""
    running = make_server(devices=(POOL,))
    daemon = running.daemon
    pool = daemon.devices.get("cpu").pool
    with open_channel(running.address) as channel:
        stub = SessionStub(channel)
        kept = fragment(stub)
        session = daemon.sessions.peek(stub.session_id)
        segments = segments_of(daemon, stub, kept)
        assert [len(s) for s in segments] == [5, 5, 5]
        a, b, c = (kept[s[0]][0] for s in segments)
        ptrs = {i: block_of(daemon, stub, meta) for i, (meta, _) in kept.items()}
        big_values = random_tensor(99, BIG_ELEMENTS)
        with (
            daemon.sessions.held(session, a.handle, b.handle),
            downloading(daemon, session, c.handle) as chunks,
        ):
            assert storage_of(daemon, stub, c).holds == 1
            with pytest.raises(grpc.RpcError) as info:
                stub.upload(big_values)
            assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert info.value.details().endswith(
                "Compaction could release 0 bytes of the 12.00 MiB needed."
            )
        np.testing.assert_array_equal(
            np.frombuffer(b"".join(chunks), np.float32), kept[segments[2][0]][1]
        )
        assert {i: block_of(daemon, stub, m) for i, (m, _) in kept.items()} == ptrs
        stats = pool.memory_stats()
        assert stats["num_ooms"] == 1 and stats["num_compactions"] == 0

        with daemon.sessions.held(session, a.handle):  # the first segment must stay
            big = stub.upload(big_values)
        moved = {i for i, (m, _) in kept.items() if block_of(daemon, stub, m) != ptrs[i]}
        assert moved == set(segments[1])  # the next least-used (by address) went instead
        assert pool.memory_stats()["num_compactions"] == 1
        pool.assert_invariants()
        for meta, values in kept.values():
            np.testing.assert_array_equal(stub.download(meta), values)
        np.testing.assert_array_equal(stub.download(big), big_values)
        stub.close()


def test_a_move_leaves_the_ledger_alone_whatever_block_serves_a_storage() -> None:
    """A 1.5 MiB Storage served by a whole unsplit 2 MiB block, then moved into a split
    1.5 MiB spot: its tenant is charged 1.5 MiB throughout (the request, not the block)."""
    from tensord_server.devices.table import Device
    from tensord_server.domain.quotas import QuotaTable, TenantLedger
    from tensord_server.domain.storage import StorageRegistry

    registry = StorageRegistry(TenantLedger(QuotaTable([QuotaSpec("*", "cpu", 40 * MiB)])))
    pool = CachingPool(BookkeepingBackend(), capacity=40 * MiB, relocator=registry)
    device = Device("cpu", pool, "simulated")

    def keep(nbytes: int) -> Storage:
        storage = registry.allocate(device, nbytes, "alice")
        registry.incref(storage)  # a handle's reference
        registry.release_hold(storage)
        return storage

    f1, f2, f3, f4 = keep(2 * MiB), keep(8 * MiB), keep(8 * MiB), keep(2 * MiB)  # segment 1
    g1, g2, g3 = keep(8 * MiB), keep(8 * MiB), keep(4 * MiB)  # segment 2: the pool is full
    registry.decref(f1)
    s = keep(3 * MiB // 2)  # into f1's 2 MiB hole, unsplit (0.5 MiB left): a 2 MiB block
    assert s.block.size == 2 * MiB and s.block.segment is f4.block.segment
    for storage in (f2, f3, g2):
        registry.decref(storage)
    usage = registry.ledger.usage("alice", "cpu")
    assert usage.current == 15 * MiB + MiB // 2 == sum(x.charge for x in registry.live())
    assert sum(x.block.size for x in registry.live()) == 16 * MiB  # the unsplit block
    old_segment = s.block.segment

    big = keep(18 * MiB)  # no hole fits: segment 1 (4 MiB used) goes into segment 2's 8 MiB

    assert s.block.segment is g1.block.segment is f4.block.segment is not old_segment
    assert s.block.size == 3 * MiB // 2  # split this time
    usage = registry.ledger.usage("alice", "cpu")
    assert usage.current == sum(x.charge for x in registry.live()) == 33 * MiB + MiB // 2
    assert sum(x.block.size for x in registry.live()) == usage.current  # now split exactly
    assert usage.storages == 5 and usage.current <= 40 * MiB
    assert big.block.size == 18 * MiB
    pool.assert_invariants()
    for storage in (s, f4, g1, g3, big):
        registry.decref(storage)
    assert registry.ledger.usage("alice", "cpu").current == 0
    pool.empty_cache()
    assert pool.memory_stats()["reserved_bytes.all.current"] == 0


@pytest.mark.slow
def test_concurrent_clients_while_compacting(make_server: Any) -> None:
    """Clients upload, download and release while another's 12 MiB requests compact the
    pool: afterwards the invariants hold, the ledger is exact and every byte is right."""
    running = make_server(devices=(POOL,))
    daemon = running.daemon
    pool = daemon.devices.get("cpu").pool
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def guarded(work: Callable[[SessionStub, random.Random], None], seed: int) -> None:
        try:
            with open_channel(running.address) as channel:
                stub = SessionStub(channel, f"worker{seed}")
                start.wait(timeout=30)
                work(stub, random.Random(seed))
                stub.close()
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    def upload_or_oom(stub: SessionStub, values: np.ndarray) -> pb.TensorMeta | None:
        try:
            return stub.upload(values)
        except grpc.RpcError as exc:
            assert exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, exc
            return None

    def big_requests(stub: SessionStub, rng: random.Random) -> None:
        for attempt in range(20):  # until one compaction happened (holds may block a few)
            values = random_tensor(1000 + attempt, BIG_ELEMENTS)
            meta = upload_or_oom(stub, values)
            if meta is not None:
                np.testing.assert_array_equal(stub.download(meta), values)
                release(stub, meta)
            if pool.memory_stats()["num_compactions"] > 0:
                return

    def churn(stub: SessionStub, rng: random.Random) -> None:
        held: list[tuple[pb.TensorMeta, np.ndarray]] = []
        for _ in range(25):
            if held and rng.random() < 0.4:
                meta, values = held.pop(rng.randrange(len(held)))
                np.testing.assert_array_equal(stub.download(meta), values)
                release(stub, meta)
                continue
            values = random_tensor(rng.randrange(1 << 30), rng.choice([TENSOR_ELEMENTS, 1000]))
            meta = upload_or_oom(stub, values)
            if meta is not None:
                held.append((meta, values))
        for meta, values in held:
            np.testing.assert_array_equal(stub.download(meta), values)

    with open_channel(running.address) as channel:
        owner = SessionStub(channel, "owner")
        kept = fragment(owner)

        def reader(stub: SessionStub, rng: random.Random) -> None:
            for _ in range(30):
                meta, values = kept[rng.choice(sorted(kept))]
                np.testing.assert_array_equal(owner.download(meta), values)

        threads = [
            threading.Thread(target=guarded, args=(work, seed))
            for seed, work in enumerate((big_requests, churn, churn, reader))
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a worker did not finish"
        assert not errors, errors
        assert pool.memory_stats()["num_compactions"] >= 1
        pool.assert_invariants()
        ledger_matches_blocks(daemon)
        for meta, values in kept.values():
            np.testing.assert_array_equal(owner.download(meta), values)
        owner.close()


@pytest.mark.slow
def test_serve_no_compaction_flag(tmp_path: Path) -> None:
    """`tensord serve --no-compaction` under a policy that does not decommit is torch's
    allocator: the fragmentation OOMs (under `adaptive` the holes' pages go back and the
    capacity bounds committed bytes, so it would not)."""
    from conftest import start_serve_process

    process, address = start_serve_process(
        "--address",
        "127.0.0.1:0",
        "--device",
        POOL,
        "--no-compaction",
        "--policy",
        "oom-compaction",
    )
    try:
        with open_channel(address) as channel:
            stub = SessionStub(channel)
            fragment(stub)
            with pytest.raises(grpc.RpcError) as info:
                stub.upload(random_tensor(99, BIG_ELEMENTS))
            assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            stub.close()
    finally:
        process.terminate()
        process.communicate(timeout=30)


def test_background_plans_empty_the_least_used_fraction_first() -> None:
    """Nobody waits for a background plan: within its budget it empties the segment that
    releases the most bytes per byte moved, not the one with the fewest bytes to move."""
    a = usage(0x1000_0000, 4, [2], [2])  # 2 MiB moved for 4 MiB released
    b = usage(0x2000_0000, 40, [3], [37])  # 3 MiB moved for 40 MiB released
    home = usage(0x3000_0000, 20, [15], [5])
    assert [s.address for s in background_evacuation_order([a, b, home])] == [
        b.address,
        a.address,
        home.address,
    ]
    plan = plan_compaction(
        [a, b, home], 1, UNLIMITED, max_moved=3 * MiB, order=background_evacuation_order
    )
    assert plan.evacuated == (b.address,) and plan.released == 40 * MiB
