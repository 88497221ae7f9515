"""The host and bookkeeping backends: where a pool's segments come from without a GPU.

A backend does one upstream allocation per pool segment (``reserve``), gives it
back (``release``), moves bytes in and out of it and, for compaction, from one
segment to another (``copy``).  The pool above it never
touches memory itself, so the same policy runs on host memory (NumPy), on a GPU
(CuPy, in its own module) or on nothing at all (bookkeeping, for replays and
simulations of a device of any size).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
from typing import Any

import numpy as np

from tensord_server.pool.backend import (
    NULL_MEMORY,
    SEGMENT_ALIGNMENT,
    Backend,
    BackendOutOfDescriptors,
    BackendOutOfMemory,
    DeviceMemory,
)

__all__ = [
    "NULL_MEMORY",
    "SEGMENT_ALIGNMENT",
    "Backend",
    "BackendOutOfDescriptors",
    "BackendOutOfMemory",
    "BookkeepingBackend",
    "DeviceMemory",
    "HostBackend",
]

# Host pools may reserve up to this share of physical memory unless told otherwise:
# the server shares the machine with its clients and the OS page cache.
HOST_DEFAULT_CAPACITY_FRACTION = 0.5

# The bookkeeping backend simulates a device this large unless told otherwise:
# "any capacity", yet a finite int that fits int64 stats (1 EiB).
BOOKKEEPING_DEFAULT_CAPACITY = 1 << 60

# First fake address of the bookkeeping backend: nonzero so that 0 stays "null",
# and high like a real device pointer so snapshots look familiar.
BOOKKEEPING_BASE_ADDRESS = 0x7F00_0000_0000


# Reads at least this large copy into their bytes object without the GIL (below it the
# copy is shorter than handing it off).
GIL_FREE_READ_BYTES = 256 << 10

# CPython's own constructor of a bytes object whose contents are still to be written, as C
# code makes one before it hands it out (PyBytes_FromStringAndSize with NULL).
_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype = ctypes.py_object
_new_bytes.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
_bytes_data = ctypes.pythonapi.PyBytes_AsString
_bytes_data.restype = ctypes.c_void_p
_bytes_data.argtypes = (ctypes.py_object,)


def copied_bytes(address: int, nbytes: int) -> bytes:
    """A new bytes object holding the ``nbytes`` at ``address``, copied by ``memmove``,
    which ctypes calls without the GIL: a large read's copy (into pages the allocator
    fetches fresh, each one faulted in) lets the other threads run, where
    ``ndarray.tobytes`` holds the GIL throughout.  The object is filled before anything
    else can see it, as C code fills one."""
    assert nbytes > 0 and address, f"copied_bytes of {nbytes} bytes at {address:#x}"
    out: bytes = _new_bytes(None, nbytes)
    ctypes.memmove(_bytes_data(out), address, nbytes)
    return out


def check_range(memory: DeviceMemory, offset: int, nbytes: int) -> None:
    """Refuse a byte range that leaves its segment (a server bug, never client input)."""
    if offset < 0 or nbytes < 0 or offset + nbytes > memory.nbytes:
        raise IndexError(
            f"byte range [{offset}, {offset + nbytes}) outside a segment of {memory.nbytes} bytes"
        )


def physical_memory_bytes() -> int:
    """Physical RAM of this machine, or 0 where the OS will not say."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def host_default_capacity() -> int:
    """The host pool's default capacity: a share of physical memory (4 GiB if unknown)."""
    physical = physical_memory_bytes()
    if physical <= 0:
        return 4 << 30
    return int(physical * HOST_DEFAULT_CAPACITY_FRACTION)


def _libc_madvise() -> Any:
    """libc's madvise(addr, length, advice), or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return madvise


_MADVISE = _libc_madvise()


def can_advise() -> bool:
    """Whether :func:`advise` may be called (Linux, with libc reachable through ctypes)."""
    return _MADVISE is not None


def advise(address: int, nbytes: int, advice: int, name: str) -> None:
    """madvise(2) of [address, address + nbytes) through libc, which releases the GIL for
    the call: freeing pages takes about a microsecond each (0.1 s for 512 MiB on this
    project's VM), and ``mmap.madvise`` holds the GIL throughout, stalling every other
    thread of the server.  OSError naming ``name`` when it fails."""
    assert _MADVISE is not None, "advise() off Linux"
    if _MADVISE(address, nbytes, advice) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"madvise({name}): {os.strerror(error)}")


def check_pages(memory: DeviceMemory, offset: int, nbytes: int, page: int) -> None:
    """Refuse a decommit of anything but whole pages inside the segment (a server bug)."""
    check_range(memory, offset, nbytes)
    if (memory.address + offset) % page or nbytes % page:
        raise ValueError(f"decommit of [{offset}, {offset + nbytes}) is not whole pages")


def drop_recycled_pages(address: int, nbytes: int, page: int) -> None:
    """Free the whole pages of a new segment: ``np.empty`` may hand back heap memory that
    was written before, and a pool that decommits counts a new segment's pages as
    decommitted until used (so it never gives them back).  Best effort: a failure only
    leaves pages resident, as they were."""
    first = -(-address // page) * page
    last = (address + nbytes) // page * page
    if last > first:
        _MADVISE(first, last - first, mmap.MADV_DONTNEED)


class HostBackend:
    """Host memory on NumPy: each segment is one 512-byte-aligned ``uint8`` array.

    ``address`` is the real data pointer, so a Storage's ``data_ptr()`` means
    something; the array in ``payload`` owns the memory, so releasing is
    dropping the last reference.  ``decommit`` frees the pages of a free range
    (``madvise(MADV_DONTNEED)``: private anonymous pages read as zeros when next
    touched), for a pool whose policy decommits.
    """

    can_decommit = _MADVISE is not None and hasattr(mmap, "MADV_DONTNEED")
    page_size = mmap.PAGESIZE

    def __init__(self, *, device: str = "cpu", total_bytes: int | None = None) -> None:
        self.device = device
        self.xp: Any = np
        self.total_bytes = host_default_capacity() if total_bytes is None else int(total_bytes)

    def reserve(self, nbytes: int) -> DeviceMemory:
        try:
            raw = np.empty(nbytes + SEGMENT_ALIGNMENT, dtype=np.uint8)
        except MemoryError as exc:
            raise BackendOutOfMemory(f"host allocation of {nbytes} bytes failed") from exc
        start = -raw.ctypes.data % SEGMENT_ALIGNMENT
        array = raw[start : start + nbytes]
        if self.can_decommit:
            drop_recycled_pages(int(array.ctypes.data), nbytes, self.page_size)
        return DeviceMemory(address=int(array.ctypes.data), nbytes=nbytes, payload=array)

    def release(self, memory: DeviceMemory) -> None:
        # The payload array owns the bytes; the pool drops its DeviceMemory after this.
        del memory

    def view(self, memory: DeviceMemory, offset: int, nbytes: int) -> np.ndarray:
        check_range(memory, offset, nbytes)
        if memory.payload is None:  # the null allocation of zero-byte blocks
            return np.empty(0, dtype=np.uint8)
        array: np.ndarray = memory.payload[offset : offset + nbytes]
        return array

    def read(self, memory: DeviceMemory, offset: int, nbytes: int) -> bytes:
        view = self.view(memory, offset, nbytes)
        if nbytes < GIL_FREE_READ_BYTES:
            return view.tobytes()
        return copied_bytes(int(view.ctypes.data), nbytes)

    def write(self, memory: DeviceMemory, offset: int, data: bytes | memoryview) -> None:
        source = np.frombuffer(data, dtype=np.uint8)
        self.view(memory, offset, source.size)[:] = source

    def copy(
        self,
        src: DeviceMemory,
        src_offset: int,
        dst: DeviceMemory,
        dst_offset: int,
        nbytes: int,
    ) -> None:
        self.view(dst, dst_offset, nbytes)[:] = self.view(src, src_offset, nbytes)

    def decommit(self, memory: DeviceMemory, offset: int, nbytes: int) -> None:
        """Free the pages of [offset, offset + nbytes): whole pages of free bytes only."""
        check_pages(memory, offset, nbytes, self.page_size)
        payload = memory.payload
        if (
            payload is None
            or int(payload.ctypes.data) != memory.address
            or payload.nbytes < offset + nbytes
        ):
            # libc checks nothing: only the array that owns the pages (and keeps them
            # allocated while it lives) vouches that the range is this segment's
            raise ValueError(
                f"decommit of [{offset}, {offset + nbytes}) is not within the array of the "
                f"segment at {memory.address:#x}"
            )
        advise(memory.address + offset, nbytes, mmap.MADV_DONTNEED, "MADV_DONTNEED")


class BookkeepingBackend:
    """No bytes at all: fake, increasing, never reused addresses, for replays and simulations.

    ``total_bytes`` is the simulated device size; ``reserve`` fails beyond it,
    as cudaMalloc does on a full device.
    """

    def __init__(self, *, device: str = "sim", total_bytes: int | None = None) -> None:
        self.device = device
        self.xp: Any = None
        self.total_bytes = BOOKKEEPING_DEFAULT_CAPACITY if total_bytes is None else int(total_bytes)
        self._lock = threading.Lock()  # guards the two fields below
        self._in_use = 0  # sum of nbytes of reserved, unreleased segments
        self._next_address = BOOKKEEPING_BASE_ADDRESS  # only grows: addresses never reused

    def reserve(self, nbytes: int) -> DeviceMemory:
        with self._lock:
            if self._in_use + nbytes > self.total_bytes:
                raise BackendOutOfMemory(
                    f"simulated device {self.device} of {self.total_bytes} bytes is full"
                )
            self._in_use += nbytes
            address = self._next_address
            # Round the stride up so every segment starts aligned, however odd nbytes is.
            self._next_address += -(-max(nbytes, 1) // SEGMENT_ALIGNMENT) * SEGMENT_ALIGNMENT
        return DeviceMemory(address=address, nbytes=nbytes)

    def release(self, memory: DeviceMemory) -> None:
        with self._lock:
            self._in_use -= memory.nbytes

    def view(self, memory: DeviceMemory, offset: int, nbytes: int) -> Any:
        raise NotImplementedError("the bookkeeping backend holds no bytes")

    def read(self, memory: DeviceMemory, offset: int, nbytes: int) -> bytes:
        raise NotImplementedError("the bookkeeping backend holds no bytes")

    def write(self, memory: DeviceMemory, offset: int, data: bytes | memoryview) -> None:
        raise NotImplementedError("the bookkeeping backend holds no bytes")

    def copy(
        self,
        src: DeviceMemory,
        src_offset: int,
        dst: DeviceMemory,
        dst_offset: int,
        nbytes: int,
    ) -> None:
        """Nothing to move (compaction of a simulated device is bookkeeping only)."""
        check_range(src, src_offset, nbytes)
        check_range(dst, dst_offset, nbytes)
