"""The tiers below a device's pool: a host buffer and a disk extent file.

A Storage lives in exactly one place at a time: its device's pool, the host tier or an
extent of the disk tier (:class:`Placement` says which, and where).  The registry
(:class:`~tensord_server.domain.storage.StorageRegistry`) moves it; this module only
stores and loads bytes, and counts.

- :class:`ExtentAllocator`: first fit over the free extents of one file, in address
  order, coalesced on every free; every extent aligned to :data:`EXTENT_ALIGNMENT`, so
  the file's physical use is never above its capacity.
- :class:`DiskTier`: one preallocated scratch file per device (``--disk-tier DIR=CAP``),
  every extent checksummed (CRC-32 of each ``IO_CHUNK_BYTES`` chunk) and verified on load;
  a mismatch is :class:`~tensord.errors.SpillCorruptedError` naming the Storage.  The file
  is flocked by its owner; a server starting sweeps every unlocked scratch file of the
  directory (a killed server's: a regular file of its user, never a link), and removes its
  own at stop.
- :class:`HostTier`: plain host buffers outside every pool, under one cap
  (``--host-tier CAP``), checksummed as the disk's extents; on a GPU host it is the level
  between the device and the disk, on a cpu-only server the same RAM, outside the pool's
  own limit.

Both tiers move bytes in one pass (:func:`move_checksummed`): each piece is copied, then
checksummed while it is in the core's cache, so the checksum adds no second trip through
memory; the CRC-32 is ISA-L's (the CPU's carry-less multiply, about ten times zlib's
rate, with zlib's values), so the pass runs at about the rate of the copy alone.

Lock order: the registry's lock, then a tier's own (a tier never calls the registry).
"""

from __future__ import annotations

import bisect
import errno
import fcntl
import os
import secrets
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tensord.errors import SpillCorruptedError

from tensord_server.domain.checksum import crc32

# Extents start and end on this boundary (a page: aligned I/O, and no two extents share one).
EXTENT_ALIGNMENT = 4096
# Each chunk of this many bytes of a placement has its own CRC-32.
IO_CHUNK_BYTES = 8 << 20
# A move copies, then checksums, this much at a time (one system call on the disk), in
# either direction and on either tier.  The piece and its source must both still be in
# the core's L2 (2 MiB on the development VM) when the checksum reads it: over 1 MiB
# pieces the copy has pushed part of the piece out and the CRC-32 runs at about 40% of
# its cached rate, costing a warm host copy or a disk write a quarter of its rate; over
# 256 KiB it costs about a tenth.  Below 256 KiB the system calls of a disk move (a few
# microseconds each) cost more than the cache saves.
PASS_BYTES = 256 << 10
assert IO_CHUNK_BYTES % PASS_BYTES == 0, "a pass never straddles two checksums"
# The name every scratch file of a disk tier starts with (the sweep removes only these).
SCRATCH_PREFIX = "tensord-spill-"
SCRATCH_SUFFIX = ".tier"
# Random names a disk tier tries for its scratch file before it gives up.
SCRATCH_NAME_TRIES = 8


def align_up(nbytes: int, alignment: int = EXTENT_ALIGNMENT) -> int:
    return -(-nbytes // alignment) * alignment


class ExtentAllocator:
    """Aligned extents of a file of ``capacity`` bytes: first fit, coalesced.  Not
    thread-safe (its tier's lock guards it).

    Invariants (:meth:`assert_invariants`): the free extents are sorted by offset, never
    empty, never adjacent (a free merges with both neighbours), never overlapping any
    used one; every offset and size is aligned; used + free == capacity.
    """

    def __init__(self, capacity: int, alignment: int = EXTENT_ALIGNMENT) -> None:
        if capacity < 0 or capacity % alignment:
            raise ValueError(f"capacity {capacity} is not a multiple of {alignment}")
        self.capacity = capacity
        self.alignment = alignment
        self._starts: list[int] = [0] if capacity else []  # free extents' offsets, sorted
        self._sizes: list[int] = [capacity] if capacity else []  # ... and their sizes
        self._used: dict[int, int] = {}  # offset -> size of each extent handed out
        self.used = 0
        self.peak = 0

    def allocate(self, nbytes: int) -> int | None:
        """The offset of a new extent of at least ``nbytes``; None when none fits."""
        size = align_up(max(nbytes, 1), self.alignment)
        for index, free in enumerate(self._sizes):
            if free >= size:
                offset = self._starts[index]
                if free == size:
                    del self._starts[index], self._sizes[index]
                else:
                    self._starts[index] += size
                    self._sizes[index] -= size
                self._used[offset] = size
                self.used += size
                self.peak = max(self.peak, self.used)
                return offset
        return None

    def free(self, offset: int) -> None:
        size = self._used.pop(offset)  # KeyError: not an extent handed out
        self.used -= size
        index = bisect.bisect_left(self._starts, offset)
        if index < len(self._starts) and offset + size == self._starts[index]:
            size += self._sizes[index]  # merge the free extent after
            del self._starts[index], self._sizes[index]
        if index > 0 and self._starts[index - 1] + self._sizes[index - 1] == offset:
            self._sizes[index - 1] += size  # merge into the free extent before
            return
        self._starts.insert(index, offset)
        self._sizes.insert(index, size)

    def largest_free(self) -> int:
        return max(self._sizes, default=0)

    def assert_invariants(self) -> None:
        spans = sorted(
            [(s, n, "free") for s, n in zip(self._starts, self._sizes, strict=True)]
            + [(s, n, "used") for s, n in self._used.items()]
        )
        assert self._starts == sorted(self._starts), self._starts
        end = 0
        previous = ""
        for start, size, kind in spans:
            assert size > 0 and start % self.alignment == 0 and size % self.alignment == 0, (
                start,
                size,
            )
            assert start == end, ("gap or overlap", start, end, spans)
            assert not (kind == previous == "free"), ("adjacent free extents", start, spans)
            end, previous = start + size, kind
        assert end == self.capacity, (end, self.capacity)
        assert self.used == sum(self._used.values()), (self.used, self._used)


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a spilled Storage's bytes rest: ``tier`` (a :class:`HostTier` or
    :class:`DiskTier`), its extent's ``offset`` (disk) or buffer (host), and the
    checksums of its ``nbytes`` bytes (one per ``IO_CHUNK_BYTES`` chunk)."""

    tier: Tier
    nbytes: int
    checksum: tuple[int, ...]
    offset: int = 0
    buffer: Any = None


@dataclass(slots=True)
class TierStats:
    """One tier's figures (memory_stats()'s ``tier.<name>.*``); its tier's lock guards them."""

    capacity: int
    current: int = 0  # bytes of Storages resting here (aligned extents for the disk)
    peak: int = 0
    storages: int = 0
    spills: int = 0  # Storages moved here
    restores: int = 0  # Storages moved back to their device from here
    spilled_bytes: int = 0
    restored_bytes: int = 0
    spill_failures: int = 0  # writes that failed (ENOSPC, EIO): the Storage stayed put
    corruptions: int = 0  # loads whose checksum did not match

    def items(self, name: str) -> dict[str, int]:
        prefix = f"tier.{name}."
        return {
            prefix + "capacity_bytes": self.capacity,
            prefix + "bytes.current": self.current,
            prefix + "bytes.peak": self.peak,
            prefix + "storages.current": self.storages,
            prefix + "num_spills": self.spills,
            prefix + "num_restores": self.restores,
            prefix + "spilled_bytes": self.spilled_bytes,
            prefix + "restored_bytes": self.restored_bytes,
            prefix + "num_spill_failures": self.spill_failures,
            prefix + "num_corruptions": self.corruptions,
        }


class Tier:
    """What the registry asks of a tier: store, load (verified), release; thread-safe."""

    name = ""

    def __init__(self, capacity: int) -> None:
        self._lock = threading.Lock()
        self.stats = TierStats(capacity)

    def store(self, data: Any, storage_id: str) -> Placement | None:
        """Copy ``data`` (a 1-D uint8 array) here; None when there is no room.  Raises
        OSError when the copy failed (nothing is kept then)."""
        raise NotImplementedError

    def load(self, placement: Placement, out: Any, storage_id: str) -> None:
        """Copy the bytes back into ``out`` (a 1-D uint8 array), verified; raises
        SpillCorruptedError on a checksum mismatch, OSError on a failed read."""
        raise NotImplementedError

    def release(self, placement: Placement) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Give everything back (the server stops)."""

    def describe(self) -> str:
        with self._lock:
            return f"{self.name} tier {self.stats.current} of {self.stats.capacity} bytes"

    def _count_store(self, size: int, nbytes: int) -> None:
        stats = self.stats
        stats.current += size
        stats.peak = max(stats.peak, stats.current)
        stats.storages += 1
        stats.spills += 1
        stats.spilled_bytes += nbytes

    def _count_release(self, size: int) -> None:
        self.stats.current -= size
        self.stats.storages -= 1

    def count_restore(self, nbytes: int) -> None:
        with self._lock:
            self.stats.restores += 1
            self.stats.restored_bytes += nbytes

    def figures(self) -> dict[str, int]:
        with self._lock:
            return self.stats.items(self.name)


def move_checksummed(
    view: memoryview, move: Callable[[int, memoryview], None], step: int
) -> tuple[int, ...]:
    """Run ``move(start, piece)`` over ``view`` in ``step``-byte pieces, in order, each
    piece checksummed right after its move (which read or wrote it: it is in cache), and
    return the CRC-32 of each ``IO_CHUNK_BYTES`` chunk of ``view`` (one, of nothing, for
    no bytes)."""
    assert step > 0 and IO_CHUNK_BYTES % step == 0, step
    sums = []
    for chunk in range(0, max(len(view), 1), IO_CHUNK_BYTES):
        value = 0
        for start in range(chunk, min(chunk + IO_CHUNK_BYTES, len(view)), step):
            piece = view[start : start + step]
            move(start, piece)
            value = crc32(piece, value)
        sums.append(value)
    return tuple(sums)


def _corrupted(storage_id: str, tier: str) -> SpillCorruptedError:
    return SpillCorruptedError(
        f"the bytes of Storage {storage_id} read back from the {tier} tier do not match "
        "their checksum: they were changed or lost while spilled (the Storage keeps them "
        "there; it cannot be read)",
        storage_id=storage_id,
        tier=tier,
    )


class HostTier(Tier):
    """Host buffers outside every pool, ``capacity`` bytes in all."""

    name = "host"

    def store(self, data: Any, storage_id: str) -> Placement | None:
        nbytes = int(data.shape[0])
        with self._lock:
            if self.stats.current + nbytes > self.stats.capacity:
                return None
            self.stats.current += nbytes  # reserved before the copy, outside the lock
        try:
            buffer = np.empty(nbytes, dtype=np.uint8)
            source = memoryview(data).cast("B")

            def copy(start: int, piece: memoryview) -> None:
                piece[:] = source[start : start + len(piece)]

            # the copy is checksummed (what rests here), piece by piece as it is written
            value = move_checksummed(buffer.data, copy, PASS_BYTES)
        except BaseException:
            with self._lock:
                self.stats.current -= nbytes
                self.stats.spill_failures += 1
            raise
        placement = Placement(self, nbytes, value, buffer=buffer)
        with self._lock:
            self.stats.current -= nbytes
            self._count_store(nbytes, nbytes)
        return placement

    def load(self, placement: Placement, out: Any, storage_id: str) -> None:
        stored = memoryview(placement.buffer).cast("B")

        def copy(start: int, piece: memoryview) -> None:
            piece[:] = stored[start : start + len(piece)]

        view = memoryview(out).cast("B")
        if move_checksummed(view, copy, PASS_BYTES) != placement.checksum:
            with self._lock:
                self.stats.corruptions += 1
            raise _corrupted(storage_id, self.name)

    def release(self, placement: Placement) -> None:
        with self._lock:
            self._count_release(placement.nbytes)


class ExtentIO:
    """The file under a :class:`DiskTier`: positioned writes and reads (tests replace it
    with one that fails as a full or broken disk does)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def write(self, offset: int, data: memoryview) -> None:
        done = 0
        while done < len(data):
            written = os.pwrite(self.fd, data[done:], offset + done)
            if written <= 0:
                raise OSError(errno.EIO, "short write to the disk tier")
            done += written

    def read_into(self, offset: int, out: memoryview) -> None:
        done = 0
        while done < len(out):
            read = os.preadv(self.fd, [out[done:]], offset + done)
            if read <= 0:
                raise OSError(errno.EIO, "short read from the disk tier")
            done += read


def sweep_scratch(directory: Path) -> list[Path]:
    """Remove the scratch files of ``directory`` no live server holds (a killed one's:
    its flock went with it); the paths removed.  The directory may be shared: only a
    regular file of the server's own user is a scratch file (never a link, followed or
    removed, nor another user's file), and one that cannot be opened is left as it is."""
    removed = []
    for path in sorted(directory.glob(f"{SCRATCH_PREFIX}*{SCRATCH_SUFFIX}")):
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:  # gone, a link, a directory, another user's: not ours to remove
            continue
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live server's file
            try:
                now = os.stat(path, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if (now.st_dev, now.st_ino) != (info.st_dev, info.st_ino):
                continue  # replaced since it was opened: not the file looked at
            path.unlink(missing_ok=True)
            removed.append(path)
        finally:
            os.close(fd)
    return removed


class DiskTier(Tier):
    """One preallocated scratch file of ``capacity`` bytes in ``directory`` for one device,
    its extents checksummed."""

    name = "disk"

    def __init__(
        self,
        directory: str | os.PathLike[str],
        capacity: int,
        device: str,
        io: Callable[[int], ExtentIO] = ExtentIO,
    ) -> None:
        capacity = capacity // EXTENT_ALIGNMENT * EXTENT_ALIGNMENT
        super().__init__(capacity)
        self.directory = Path(directory)
        safe = "".join(c if c.isalnum() else "-" for c in device)
        self._extents = ExtentAllocator(capacity)
        self._writing = 0  # bytes of extents handed out whose writes are under way
        # a name nobody can take first: the directory may be shared, and a pid is no secret
        # (O_EXCL: never a file or a link someone made there)
        for attempt in range(SCRATCH_NAME_TRIES):
            self.path = self.directory / (
                f"{SCRATCH_PREFIX}{safe}-{os.getpid()}-{secrets.token_hex(8)}{SCRATCH_SUFFIX}"
            )
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                break
            except FileExistsError:
                if attempt == SCRATCH_NAME_TRIES - 1:
                    raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            try:
                os.posix_fallocate(fd, 0, capacity) if capacity else None
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise  # ENOSPC: the directory cannot hold the cap
                os.ftruncate(fd, capacity)  # a filesystem without fallocate: sparse
        except BaseException:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            raise
        self._fd = fd
        self.io = io(fd)

    def store(self, data: Any, storage_id: str) -> Placement | None:
        nbytes = int(data.shape[0])
        size = align_up(max(nbytes, 1))
        with self._lock:
            offset = self._extents.allocate(nbytes)
            if offset is None:
                return None
            self._writing += size
        try:
            value = self._write(offset, memoryview(data).cast("B"))
        except BaseException:
            with self._lock:
                self._writing -= size
                self._extents.free(offset)
                self.stats.spill_failures += 1
            raise
        with self._lock:
            self._writing -= size
            self._count_store(size, nbytes)
        return Placement(self, nbytes, value, offset=offset)

    def _write(self, offset: int, view: memoryview) -> tuple[int, ...]:
        def write(start: int, piece: memoryview) -> None:
            self.io.write(offset + start, piece)

        return move_checksummed(view, write, PASS_BYTES)

    def load(self, placement: Placement, out: Any, storage_id: str) -> None:
        def read(start: int, piece: memoryview) -> None:
            self.io.read_into(placement.offset + start, piece)

        view = memoryview(out).cast("B")
        if move_checksummed(view, read, PASS_BYTES) != placement.checksum:
            with self._lock:
                self.stats.corruptions += 1
            raise _corrupted(storage_id, self.name)

    def release(self, placement: Placement) -> None:
        with self._lock:
            self._extents.free(placement.offset)
            self._count_release(align_up(max(placement.nbytes, 1)))

    def assert_invariants(self) -> None:
        with self._lock:
            self._extents.assert_invariants()
            used = self._extents.used
            assert self.stats.current + self._writing == used <= self.stats.capacity, (
                self.stats,
                self._writing,
                used,
            )

    def close(self) -> None:
        if self._fd < 0:
            return
        self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = -1


@dataclass
class TierChain:
    """The tiers under one device, top first (host, then disk): a spill goes to the first
    with room."""

    tiers: list[Tier]

    def describe(self) -> str:
        return "; ".join(tier.describe() for tier in self.tiers) or "no tiers"

    def figures(self) -> dict[str, int]:
        result: dict[str, int] = {}
        for tier in self.tiers:
            result.update(tier.figures())
        return result
