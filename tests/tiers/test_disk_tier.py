"""The disk tier's parts, in process: the extent allocator's invariants, checksummed
extents, a disk that fails (ENOSPC, EIO), a corrupted extent, the scratch sweep."""

from __future__ import annotations

import errno
import fcntl
import os
import random
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tensord.errors import OutOfMemoryError, SpillCorruptedError
from tensord_server.devices.table import DeviceTable
from tensord_server.domain import storage as storage_module
from tensord_server.domain import tiers as tiers_module
from tensord_server.domain.checksum import crc32 as checksum_crc32
from tensord_server.domain.storage import StorageRegistry
from tensord_server.domain.tiers import (
    EXTENT_ALIGNMENT,
    IO_CHUNK_BYTES,
    SCRATCH_PREFIX,
    DiskTier,
    ExtentAllocator,
    ExtentIO,
    HostTier,
    TierChain,
    align_up,
    sweep_scratch,
)

A = EXTENT_ALIGNMENT


# ---- the extent allocator ---------------------------------------------------------------


def test_first_fit_splits_and_a_free_coalesces_with_both_neighbours() -> None:
    extents = ExtentAllocator(8 * A)
    a, b, c = (extents.allocate(A) for _ in range(3))
    assert (a, b, c) == (0, A, 2 * A)
    assert extents.allocate(1) == 3 * A  # one byte takes one aligned unit
    extents.free(b)  # type: ignore[arg-type]
    assert extents.allocate(A + 1) == 4 * A  # the hole at A is too small: first fit after
    extents.free(a)  # type: ignore[arg-type]
    extents.free(c)  # type: ignore[arg-type]
    extents.assert_invariants()
    assert extents.allocate(3 * A) == 0  # a, b and c coalesced into one free extent
    extents.assert_invariants()


def test_the_allocator_refuses_what_does_not_fit_and_counts_its_peak() -> None:
    extents = ExtentAllocator(4 * A)
    assert extents.allocate(4 * A) == 0
    assert extents.allocate(1) is None
    assert extents.used == extents.peak == 4 * A
    extents.free(0)
    assert extents.used == 0 and extents.peak == 4 * A
    assert extents.largest_free() == 4 * A
    with pytest.raises(KeyError):
        extents.free(0)  # not handed out (twice freed)


def test_the_invariants_check_catches_a_broken_free_list() -> None:
    extents = ExtentAllocator(4 * A)
    extents.allocate(A)
    extents._sizes[0] += A  # an overlap with the used extent
    with pytest.raises(AssertionError):
        extents.assert_invariants()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5 * A)), max_size=60), st.randoms())
def test_the_allocator_keeps_its_invariants_under_any_sequence(
    steps: list[tuple[bool, int]], rnd: random.Random
) -> None:
    extents = ExtentAllocator(32 * A)
    live: dict[int, int] = {}
    for allocate, nbytes in steps:
        if allocate or not live:
            offset = extents.allocate(nbytes)
            if offset is None:
                assert extents.largest_free() < -(-nbytes // A) * A
            else:
                for other, size in live.items():  # never overlaps a live extent
                    assert offset + nbytes <= other or other + size <= offset
                live[offset] = nbytes
        else:
            offset = rnd.choice(sorted(live))
            extents.free(offset)
            del live[offset]
        extents.assert_invariants()
        assert extents.used <= extents.capacity


# ---- the disk tier ------------------------------------------------------------------------


def data(nbytes: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def test_an_extent_reads_back_verified_and_the_file_never_passes_its_cap(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 64 * A, "cpu")
    try:
        assert tier.path.stat().st_size == 64 * A  # preallocated to its cap
        stored = [(tier.store(data(n, n), f"s{n}"), n) for n in (1, 5000, 3 * A)]
        for placement, n in stored:
            assert placement is not None
            out = np.empty(n, dtype=np.uint8)
            tier.load(placement, out, f"s{n}")
            assert np.array_equal(out, data(n, n))
        tier.assert_invariants()
        assert tier.store(data(64 * A), "big") is None  # no room: nothing written
        assert tier.path.stat().st_size == 64 * A
        for placement, _ in stored:
            tier.release(placement)  # type: ignore[arg-type]
        assert tier.figures()["tier.disk.bytes.current"] == 0
        assert tier.figures()["tier.disk.bytes.peak"] == A + 2 * A + 3 * A
    finally:
        tier.close()
    assert not tier.path.exists()  # scratch: removed at stop


def test_a_corrupted_extent_is_the_typed_error_naming_the_storage(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 16 * A, "cpu")
    try:
        placement = tier.store(data(3 * A), "abc123")
        assert placement is not None
        with open(tier.path, "r+b") as f:  # one flipped byte inside the extent
            f.seek(placement.offset + 100)
            byte = f.read(1)
            f.seek(placement.offset + 100)
            f.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(SpillCorruptedError, match="abc123") as raised:
            tier.load(placement, np.empty(3 * A, dtype=np.uint8), "abc123")
        assert raised.value.storage_id == "abc123" and raised.value.tier == "disk"
        assert tier.figures()["tier.disk.num_corruptions"] == 1
    finally:
        tier.close()


def test_each_chunk_has_zlibs_crc32_and_a_flip_in_a_later_piece_is_caught(
    tmp_path: Path,
) -> None:
    """A store checksums its chunks piece by piece: the values must be each whole chunk's
    CRC-32 (zlib's), and a flipped byte past the first piece of a later chunk must fail."""
    nbytes = 2 * IO_CHUNK_BYTES + 5000
    source = data(nbytes, 3)
    expected = tuple(
        zlib.crc32(source[start : start + IO_CHUNK_BYTES])
        for start in range(0, nbytes, IO_CHUNK_BYTES)
    )
    host = HostTier(nbytes)
    disk = DiskTier(tmp_path, align_up(nbytes), "cpu")
    try:
        placements = [tier.store(source, "c1") for tier in (host, disk)]
        for placement in placements:
            assert placement is not None and placement.checksum == expected
            out = np.zeros(nbytes, dtype=np.uint8)
            placement.tier.load(placement, out, "c1")
            assert np.array_equal(out, source)
        flip = IO_CHUNK_BYTES + 3 * (1 << 20) + 17  # the second chunk, its fourth MiB
        host_placement, disk_placement = placements
        assert host_placement is not None and disk_placement is not None
        host_placement.buffer[flip] ^= 0x10
        with open(disk.path, "r+b") as f:
            f.seek(disk_placement.offset + flip)
            byte = f.read(1)
            f.seek(disk_placement.offset + flip)
            f.write(bytes([byte[0] ^ 0x10]))
        for placement in placements:
            assert placement is not None
            with pytest.raises(SpillCorruptedError, match="c1"):
                placement.tier.load(placement, np.zeros(nbytes, dtype=np.uint8), "c1")
        assert host.figures()["tier.host.num_corruptions"] == 1
        assert disk.figures()["tier.disk.num_corruptions"] == 1
    finally:
        disk.close()


class RecordingIO(ExtentIO):
    """A disk that records the (offset, length) of every write and read."""

    def __init__(self, fd: int) -> None:
        super().__init__(fd)
        self.calls: list[tuple[str, int, int]] = []

    def write(self, offset: int, data: memoryview) -> None:
        self.calls.append(("write", offset, len(data)))
        super().write(offset, data)

    def read_into(self, offset: int, out: memoryview) -> None:
        self.calls.append(("read", offset, len(out)))
        super().read_into(offset, out)


CACHED_PIECE_BYTES = 256 << 10  # a piece and its source fit a core's 2 MiB L2 together


def test_every_move_checksums_pieces_that_its_copy_left_in_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each tier stores and loads in pieces of at most 256 KiB, in order, each checksummed
    right after its copy (over larger pieces the checksum reads bytes the copy already
    pushed out of the core's L2), and on the disk one system call per piece."""
    nbytes = IO_CHUNK_BYTES + (1 << 20) + 5000
    source = data(nbytes, 5)
    checksummed: list[int] = []

    def recording_crc32(piece: Any, value: int = 0) -> int:
        checksummed.append(len(piece))
        return checksum_crc32(piece, value)

    monkeypatch.setattr(tiers_module, "crc32", recording_crc32)
    host = HostTier(nbytes)
    disk = DiskTier(tmp_path, align_up(nbytes), "cpu", io=RecordingIO)
    try:
        for tier in (host, disk):
            checksummed.clear()
            placement = tier.store(source, "p1")
            assert placement is not None
            stored = list(checksummed)
            checksummed.clear()
            out = np.zeros(nbytes, dtype=np.uint8)
            tier.load(placement, out, "p1")
            assert np.array_equal(out, source)
            for direction, pieces in (("store", stored), ("load", checksummed)):
                assert sum(pieces) == nbytes, (tier.name, direction)
                assert max(pieces) <= CACHED_PIECE_BYTES, (tier.name, direction)
        io = disk.io
        assert isinstance(io, RecordingIO)
        for kind in ("write", "read"):
            calls = [(offset, length) for k, offset, length in io.calls if k == kind]
            assert max(length for _, length in calls) <= CACHED_PIECE_BYTES, kind
            ends = [offset + length for offset, length in calls]
            assert [offset for offset, _ in calls[1:]] == ends[:-1], kind  # in order, no gap
            assert ends[-1] - calls[0][0] == nbytes, kind
    finally:
        disk.close()


def test_a_changed_host_buffer_is_the_typed_error_too() -> None:
    tier = HostTier(1 << 20)
    placement = tier.store(data(1000), "h1")
    assert placement is not None
    placement.buffer[7] ^= 1
    with pytest.raises(SpillCorruptedError, match="h1"):
        tier.load(placement, np.empty(1000, dtype=np.uint8), "h1")


class FailingIO(ExtentIO):
    """A disk that fails every write after the first ``good`` with ``code``."""

    def __init__(self, fd: int, code: int = errno.ENOSPC, good: int = 0) -> None:
        super().__init__(fd)
        self.code = code
        self.good = good

    def write(self, offset: int, view: memoryview) -> None:
        if self.good <= 0:
            raise OSError(self.code, os.strerror(self.code))
        self.good -= 1
        super().write(offset, view)


def registry_over(tmp_path: Path, io: Any = ExtentIO, capacity: str = "cpu=48MiB") -> Any:
    device = next(iter(DeviceTable([capacity])))
    registry = StorageRegistry()
    disk = DiskTier(tmp_path, 256 << 20, device.name, io=io)
    registry.tiers[device.name] = TierChain([disk])
    return registry, device, disk


def fill_storage(registry: StorageRegistry, device: Any, nbytes: int, seed: int) -> Any:
    storage = registry.allocate(device, nbytes)
    storage.raw()[:] = data(nbytes, seed)
    registry.incref(storage)  # a handle's reference, beside the creating op's hold
    registry.release_hold(storage)
    return storage


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO], ids=["ENOSPC", "EIO"])
def test_a_failing_disk_leaves_every_storage_where_it_was_and_counts(
    tmp_path: Path, code: int
) -> None:
    registry, device, disk = registry_over(tmp_path, lambda fd: FailingIO(fd, code), "cpu=24MiB")
    try:
        kept = [fill_storage(registry, device, 4 << 20, seed) for seed in range(4)]
        assert registry.spill(device, 8 << 20) == 0  # every write failed
        assert all(s.resident and s.placement is None for s in kept)
        figures = disk.figures()
        assert figures["tier.disk.num_spill_failures"] >= 1
        assert figures["tier.disk.bytes.current"] == 0
        disk.assert_invariants()
        with pytest.raises(OutOfMemoryError, match="disk tier 0 of") as raised:
            for _ in range(8):  # more than the pool holds: no tier takes anything
                kept.append(registry.allocate(device, 4 << 20))
        assert raised.value.device == "cpu"
        for seed, storage in enumerate(kept[:4]):
            registry.hold(storage)
            assert np.array_equal(storage.raw(), data(4 << 20, seed))  # not a byte lost
            registry.release_hold(storage)
    finally:
        disk.close()


def test_a_spill_restores_verified_and_corruption_names_the_storage(tmp_path: Path) -> None:
    registry, device, disk = registry_over(tmp_path)
    try:
        storages = [fill_storage(registry, device, 2 << 20, seed) for seed in range(4)]
        assert registry.spill(device, 8 << 20) == 8 << 20
        assert not any(s.resident for s in storages)
        victim = storages[1]
        assert victim.placement is not None
        with open(disk.path, "r+b") as f:
            f.seek(victim.placement.offset + 12345)
            f.write(b"\x00\x01\x02\x03")
        registry.hold_all(storages)
        with pytest.raises(SpillCorruptedError) as raised:
            registry.ensure_resident(storages)
        assert raised.value.storage_id == victim.id
        assert not victim.resident  # it stays where it was: never silent data
        registry.ensure_resident([s for s in storages if s is not victim])
        for seed, storage in enumerate(storages):
            if storage is not victim:
                assert np.array_equal(storage.raw(), data(2 << 20, seed))
        registry.release_holds(storages)
        for storage in storages:
            registry.decref(storage)
        disk.assert_invariants()
        assert disk.figures()["tier.disk.bytes.current"] == 0  # the freed extent went too
    finally:
        disk.close()


def fragmented(registry: StorageRegistry, device: Any) -> list[Any]:
    """Ten 2 MiB Storages filling one 20 MiB segment, every other one freed: 10 MiB
    allocated in a 24 MiB pool, yet no 12 MiB block fits without a spill."""
    storages = [fill_storage(registry, device, 2 << 20, seed) for seed in range(10)]
    for storage in storages[::2]:
        registry.decref(storage)
    return storages[1::2]


def test_a_refusal_that_a_spill_serves_is_no_out_of_memory(tmp_path: Path) -> None:
    registry, device, disk = registry_over(tmp_path, capacity="cpu=24MiB")
    try:
        kept = fragmented(registry, device)
        big = registry.allocate(device, 12 << 20)  # the pool refuses; a spill serves it
        assert disk.figures()["tier.disk.num_spills"] >= 1
        assert device.pool.memory_stats()["num_ooms"] == 0
        registry.release_hold(big)
        registry.hold_all(kept)
        registry.ensure_resident(kept)
        for seed, storage in zip(range(1, 10, 2), kept, strict=True):
            assert np.array_equal(storage.raw(), data(2 << 20, seed))
        registry.release_holds(kept)
    finally:
        disk.close()


def test_a_refusal_no_tier_can_serve_is_one_out_of_memory(tmp_path: Path) -> None:
    registry, device, disk = registry_over(tmp_path, lambda fd: FailingIO(fd), "cpu=24MiB")
    try:
        fragmented(registry, device)
        with pytest.raises(OutOfMemoryError):
            registry.allocate(device, 12 << 20)  # every spill's write fails
        assert device.pool.memory_stats()["num_ooms"] == 1  # one request, one count
    finally:
        disk.close()


# ---- the scratch sweep --------------------------------------------------------------------


def test_the_sweep_removes_a_dead_servers_file_and_keeps_a_live_ones(tmp_path: Path) -> None:
    dead = tmp_path / f"{SCRATCH_PREFIX}cpu-99999.tier"
    dead.write_bytes(b"x" * 100)
    other = tmp_path / "unrelated.tier"
    other.write_bytes(b"y")
    live = DiskTier(tmp_path, 4 * A, "cpu")
    try:
        assert sweep_scratch(tmp_path) == [dead]
        assert live.path.exists() and other.exists() and not dead.exists()
        # a file another server's tier holds (its flock: a lock of another open file
        # description, as another process's is) is live: kept
        held = tmp_path / f"{SCRATCH_PREFIX}cuda-0-1.tier"
        held.write_bytes(b"z")
        fd = os.open(held, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            assert sweep_scratch(tmp_path) == []
            assert held.exists()
        finally:
            os.close(fd)
        assert sweep_scratch(tmp_path) == [held]  # its owner is gone
    finally:
        live.close()


def test_the_sweep_removes_only_its_users_regular_files_and_follows_no_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The directory may be shared (``/tmp``): whatever else matches the scratch name (a
    directory, a link to someone's file, another user's file) is left as it is, and never
    stops the server from starting."""
    outside = tmp_path / "outside"
    outside.mkdir()
    target = outside / "precious"
    target.write_bytes(b"keep")
    tier_dir = tmp_path / "tier"
    tier_dir.mkdir()
    (tier_dir / f"{SCRATCH_PREFIX}dir.tier").mkdir()
    link = tier_dir / f"{SCRATCH_PREFIX}link.tier"
    link.symlink_to(target)
    dead = tier_dir / f"{SCRATCH_PREFIX}cpu-99999.tier"
    dead.write_bytes(b"x")
    assert sweep_scratch(tier_dir) == [dead]
    assert link.is_symlink() and target.read_bytes() == b"keep"
    assert (tier_dir / f"{SCRATCH_PREFIX}dir.tier").is_dir()
    # a file of another user (as the server sees it: its owner is not the server's uid)
    theirs = tier_dir / f"{SCRATCH_PREFIX}cpu-77777.tier"
    theirs.write_bytes(b"theirs")
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(theirs).st_uid + 1)
    assert sweep_scratch(tier_dir) == []
    assert theirs.read_bytes() == b"theirs"


def test_a_scratch_name_taken_in_the_directory_does_not_stop_a_tier(tmp_path: Path) -> None:
    """Other users of a directory (`/tmp`) can make files of any name there: one at the name a
    server would pick (its pid is no secret) must not stop it from starting, nor be used."""
    squatted = tmp_path / f"{SCRATCH_PREFIX}cpu-{os.getpid()}.tier"
    squatted.write_bytes(b"someone else's")
    first = DiskTier(tmp_path, 4 * A, "cpu")
    second = DiskTier(tmp_path, 4 * A, "cpu")  # a second store of this process, too
    try:
        assert len({first.path, second.path, squatted}) == 3
        assert squatted.read_bytes() == b"someone else's"
        assert first.path.name.startswith(SCRATCH_PREFIX) and first.path.suffix == ".tier"
    finally:
        first.close()
        second.close()


def test_a_spill_of_tiny_storages_moves_a_bounded_number(tmp_path: Path) -> None:
    """A spill's cost is per Storage (two lock acquisitions, a 4 KiB extent, a write): many
    tiny Storages must not make one spill, an allocation's own included, move them all
    (20,000 8-byte Storages took 2.65 s and 80 MB of disk for a 1 MiB ask)."""
    registry, device, disk = registry_over(tmp_path)
    try:
        tiny = [fill_storage(registry, device, 8, seed) for seed in range(4096)]
        want = 2 << 20
        registry.spill(device, want)
        moved = [s for s in tiny if not s.resident]
        assert 0 < len(moved) <= want // storage_module.SPILL_COUNT_FLOOR_BYTES
        registry.hold_all(moved)
        registry.ensure_resident(moved)  # and they come back whole
        assert all(np.array_equal(s.raw(), data(8, seed)) for seed, s in enumerate(tiny))
        registry.release_holds(moved)
        for storage in tiny:
            registry.decref(storage)
        disk.assert_invariants()
    finally:
        disk.close()


class SlowReads(ExtentIO):
    """A disk whose reads take a while: concurrent restores overlap."""

    def read_into(self, offset: int, out: memoryview) -> None:
        time.sleep(0.05)
        super().read_into(offset, out)


def test_concurrent_ops_on_one_spilled_storage_wait_for_one_restore(tmp_path: Path) -> None:
    registry, device, disk = registry_over(tmp_path, SlowReads)
    try:
        storage = fill_storage(registry, device, 2 << 20, 7)
        assert registry.spill(device, 1) == 2 << 20
        barrier = threading.Barrier(4)
        seen: list[bool] = []

        def op() -> None:
            registry.hold(storage)
            barrier.wait()
            registry.ensure_resident([storage])
            seen.append(bool(np.array_equal(storage.raw(), data(2 << 20, 7))))
            registry.release_hold(storage)

        threads = [threading.Thread(target=op) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert seen == [True] * 4
        assert disk.figures()["tier.disk.num_restores"] == 1
        assert disk.figures()["tier.disk.bytes.current"] == 0
    finally:
        disk.close()


def test_a_failed_demotion_keeps_the_host_copy(tmp_path: Path) -> None:
    (device,) = DeviceTable(["cpu=48MiB"])
    registry = StorageRegistry()
    host = HostTier(8 << 20)
    disk = DiskTier(tmp_path, 64 << 20, device.name, io=lambda fd: FailingIO(fd, errno.EIO))
    registry.tiers[device.name] = TierChain([host, disk])
    try:
        storages = [fill_storage(registry, device, 2 << 20, seed) for seed in range(3)]
        assert registry.spill(device, 6 << 20) == 6 << 20
        assert all(s.placement is not None and s.placement.tier is host for s in storages)
        assert registry.demote(host, 6 << 20) == 0  # every disk write failed
        assert all(s.placement is not None and s.placement.tier is host for s in storages)
        assert all(s.restoring is None for s in storages)
        assert disk.figures()["tier.disk.num_spill_failures"] == 3
        registry.hold_all(storages)
        registry.ensure_resident(storages)
        for seed, storage in enumerate(storages):
            assert np.array_equal(storage.raw(), data(2 << 20, seed))
        registry.release_holds(storages)
        assert host.figures()["tier.host.bytes.current"] == 0
        disk.assert_invariants()
    finally:
        disk.close()
