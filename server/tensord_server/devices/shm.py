"""Host segments in shared memory: each ``cpu`` pool segment is one memfd the server maps.

A same-host client that is handed the memfd (see :mod:`tensord_server.domain.exports`)
maps the very pages the server computes on, so its reads and writes are one
memcpy, or none at all through DLPack.  The memfd is anonymous (no name in any
filesystem): the only way to reach it is to be given its descriptor, so nobody
but the server's own process can map a segment unless the server passes it.

Pages of a fresh memfd read as zeros and are only backed once touched, like
``np.empty``'s; ``mmap`` returns page-aligned memory, which is more than the pool's
512-byte segment alignment.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import mmap
import os
import pathlib
import threading
import weakref
from dataclasses import dataclass, field

import numpy as np

from tensord_server.devices.descriptors import is_descriptor_error, out_of_descriptors
from tensord_server.devices.memory import (
    BackendOutOfDescriptors,
    BackendOutOfMemory,
    DeviceMemory,
    HostBackend,
    advise,
    can_advise,
    check_pages,
)

# Segment ids are never reused within one server process (a client's mapping cache keys
# on them, together with the server's instance id); GPU segments take theirs from here too.
_segment_ids = itertools.count(1)


def next_segment_id() -> int:
    return next(_segment_ids)


def _close_descriptor(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


@dataclass(eq=False)
class HostSegment:
    """One shared-memory segment: its memfd, the server's mapping and a uint8 array over it.

    Its descriptor is closed by :meth:`close` (the backend's release), or when the segment
    is collected unreleased (a pool dropped without giving its segments back): never twice,
    so a number the process has reused since is never closed."""

    id: int
    fd: int
    nbytes: int
    mapping: mmap.mmap = field(repr=False)
    array: np.ndarray = field(repr=False)
    _closer: weakref.finalize[[int], HostSegment] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._closer = weakref.finalize(self, _close_descriptor, self.fd)

    def close(self) -> None:
        """Close the server's descriptor; the pages live on while any mapping (ours: until
        the last array over it is collected; a client's: until it unmaps) still holds them."""
        self._closer()  # closes it once; a no-op after
        self.fd = -1


def advise_huge_pages(mapping: mmap.mmap) -> None:
    """Ask for transparent huge pages: with 4 KiB pages a 1 GiB copy through a shared
    mapping is TLB-bound (~3x slower than anonymous memory with THP).  Honoured only where
    /sys/kernel/mm/transparent_hugepage/shmem_enabled is ``advise`` or ``always``."""
    with contextlib.suppress(OSError, AttributeError, ValueError):
        mapping.madvise(mmap.MADV_HUGEPAGE)


THP_SYSFS = "/sys/kernel/mm/transparent_hugepage"
# shmem_enabled values under which a shared mapping that asks (MADV_HUGEPAGE) may get huge pages
SHMEM_HUGE_MODES = frozenset({"always", "within_size", "advise", "force"})


def shmem_huge_mode(sysfs: str | None = None) -> str:
    """The bracketed value of shmem_enabled ("never" where the file is absent)."""
    try:
        text = pathlib.Path(sysfs or THP_SYSFS, "shmem_enabled").read_text()
    except OSError:
        return "never"
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else "never"


def shared_page_size(sysfs: str | None = None) -> int:
    """The page a segment's memory is committed in: the huge page size where shared memory
    may get transparent huge pages (segments ask for them), else the base page.  Decommits
    and the committed-byte count use it: with huge pages, touching one byte commits 2 MiB
    and a hole punched inside a huge page may free nothing."""
    if shmem_huge_mode(sysfs) not in SHMEM_HUGE_MODES:
        return mmap.PAGESIZE
    try:
        huge = int(pathlib.Path(sysfs or THP_SYSFS, "hpage_pmd_size").read_text())
    except (OSError, ValueError):
        huge = 2 << 20
    return max(huge, mmap.PAGESIZE)


def segment_error(what: str, exc: Exception) -> BackendOutOfDescriptors | BackendOutOfMemory:
    """The backend's error for a segment that could not be made: out of descriptors, said
    so, where the OS ran out of those; else out of memory."""
    if isinstance(exc, OSError) and is_descriptor_error(exc):
        return BackendOutOfDescriptors(f"{out_of_descriptors(exc)}: {what}")
    return BackendOutOfMemory(f"{what}: {exc}")


# A segment's memfd can neither shrink nor grow, and no other seal can be added (a client's
# F_SEAL_WRITE would refuse the server's own writes).
SEGMENT_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def create_segment(nbytes: int) -> HostSegment:
    """A new zero-filled memfd of ``nbytes`` mapped read-write and shared.

    BackendOutOfDescriptors where the process (or the host) has no descriptor left for
    the memfd or the mapping's copy of it (``mmap`` dups the descriptor);
    BackendOutOfMemory where the memory itself is refused.  Nothing is left open either way."""
    try:
        fd = os.memfd_create(f"tensord-segment-{nbytes}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as exc:
        raise segment_error(f"memfd_create for {nbytes} bytes failed", exc) from exc
    try:
        os.ftruncate(fd, nbytes)
        # its size is fixed for good before any client holds a descriptor of it: a client
        # that truncated an exported memfd made the server's next touch of the segment a
        # SIGBUS that killed it (a hole punched in it, as a decommit does, stays allowed)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEGMENT_SEALS)
        mapping = mmap.mmap(
            fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )
    except (OSError, ValueError) as exc:
        os.close(fd)
        raise segment_error(f"shared host allocation of {nbytes} bytes failed", exc) from exc
    advise_huge_pages(mapping)
    array = np.frombuffer(mapping, dtype=np.uint8)
    return HostSegment(next_segment_id(), fd, nbytes, mapping, array)


class SharedHostBackend(HostBackend):
    """The ``cpu`` backend of a server that lets same-host clients map its pool.

    A :class:`HostBackend` whose segment payloads are arrays over memfd mappings;
    ``segment(memory)`` names the :class:`HostSegment` behind a payload, and
    ``live_segment(id)`` tells whether a segment still exists (clients unmap the
    ones that do not).  ``decommit`` punches a hole in a segment's memfd
    (``madvise(MADV_REMOVE)``): the pages go back for every mapping, a client's too,
    and read as zeros when next touched.
    """

    exportable = True
    can_decommit = hasattr(mmap, "MADV_REMOVE")

    def __init__(self, *, device: str = "cpu", total_bytes: int | None = None) -> None:
        super().__init__(device=device, total_bytes=total_bytes)
        self.description = "host memory (shared)"
        self.page_size = shared_page_size()
        self._lock = threading.Lock()  # guards _segments
        self._segments: dict[int, HostSegment] = {}  # live segments by id
        self._by_address: dict[int, HostSegment] = {}

    def reserve(self, nbytes: int) -> DeviceMemory:
        if nbytes == 0:
            return DeviceMemory(address=0, nbytes=0, payload=None)
        segment = create_segment(nbytes)
        address = int(segment.array.ctypes.data)
        with self._lock:
            self._segments[segment.id] = segment
            self._by_address[address] = segment
        return DeviceMemory(address=address, nbytes=nbytes, payload=segment.array)

    def release(self, memory: DeviceMemory) -> None:
        with self._lock:  # closed under the lock: dup_fd never sees a number being reused
            segment = self._by_address.pop(memory.address, None)
            if segment is not None:
                del self._segments[segment.id]
                segment.close()

    def decommit(self, memory: DeviceMemory, offset: int, nbytes: int) -> None:
        """Free the pages of [offset, offset + nbytes) of a live segment (whole pages of
        free bytes only: the pool's lock keeps them free until this returns)."""
        check_pages(memory, offset, nbytes, self.page_size)
        with self._lock:
            segment = self._by_address.get(memory.address)
        if segment is None:
            raise ValueError(f"no live segment at {memory.address:#x}")
        if memory.payload is not segment.array or offset + nbytes > segment.nbytes:
            # libc checks nothing (mmap.madvise refused a range past its mapping): a stale or
            # oversized handle would punch a hole in whatever is mapped next, another segment
            raise ValueError(
                f"decommit of [{offset}, {offset + nbytes}) is not within the segment at "
                f"{memory.address:#x} ({segment.nbytes} bytes)"
            )
        # MADV_REMOVE frees the backing pages (fallocate's PUNCH_HOLE): MADV_DONTNEED on a
        # shared mapping would only drop this process's page-table entries.  Through libc,
        # without the GIL (threads not waiting for the pool's lock run meanwhile);
        # ``segment`` stays mapped during the call: its array holds the mapping, whatever
        # close() does to its descriptor
        if can_advise():
            advise(memory.address + offset, nbytes, mmap.MADV_REMOVE, "MADV_REMOVE")
        else:
            segment.mapping.madvise(mmap.MADV_REMOVE, offset, nbytes)

    def segment(self, memory: DeviceMemory) -> HostSegment | None:
        with self._lock:
            return self._by_address.get(memory.address)

    def segment_by_id(self, segment_id: int) -> HostSegment | None:
        with self._lock:
            return self._segments.get(segment_id)

    def dup_fd(self, segment_id: int) -> int | None:
        """A new descriptor of a live segment's memfd (the caller closes it), or None."""
        with self._lock:
            segment = self._segments.get(segment_id)
            return None if segment is None else os.dup(segment.fd)

    def live_segments(self) -> int:
        with self._lock:
            return len(self._segments)
