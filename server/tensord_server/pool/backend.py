"""The memory interface the pool allocates from: what a device backend must provide.

A backend does one upstream allocation per pool segment (``reserve``), gives it
back (``release``), moves bytes in and out of it and, for compaction, from one
segment to another (``copy``).  The pool never touches memory itself, so the
same policy runs on host memory, on a GPU or on nothing at all (bookkeeping);
the implementations live in :mod:`tensord_server.devices`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

# Segments start on a 512-byte boundary: the pool's own granularity (kMinBlockSize),
# so every block handed out is 512-byte aligned, as cudaMalloc's are (at least).
SEGMENT_ALIGNMENT = 512


class BackendOutOfMemory(MemoryError):
    """The device itself cannot provide another segment (cudaErrorMemoryAllocation)."""


class BackendOutOfDescriptors(Exception):
    """The process cannot open the descriptor a new segment needs (EMFILE, ENFILE): the
    segment fails for want of descriptors, not memory.  The message says so, with the
    process's count and limit."""


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """One upstream allocation (one pool segment).

    Invariants: ``address % SEGMENT_ALIGNMENT == 0`` when ``nbytes > 0``;
    ``nbytes >= 0``; ``payload`` is the backend's own handle (a NumPy array for
    the host backend, ``None`` for bookkeeping) and keeps the memory alive.
    """

    address: int
    nbytes: int
    payload: Any = field(default=None, compare=False, repr=False)


# The null allocation that zero-byte requests point into (torch hands back nullptr).
NULL_MEMORY = DeviceMemory(address=0, nbytes=0, payload=None)


@runtime_checkable
class Backend(Protocol):
    """What the pool needs from a device."""

    device: str  # "cpu", "cuda:0", "sim"
    xp: Any  # the array module of ``view`` results, or None (bookkeeping)
    total_bytes: int  # the device's capacity; the pool's default capacity

    def reserve(self, nbytes: int) -> DeviceMemory: ...

    def release(self, memory: DeviceMemory) -> None: ...

    def view(self, memory: DeviceMemory, offset: int, nbytes: int) -> Any: ...

    def read(self, memory: DeviceMemory, offset: int, nbytes: int) -> bytes: ...

    def write(self, memory: DeviceMemory, offset: int, data: bytes | memoryview) -> None: ...

    def copy(
        self,
        src: DeviceMemory,
        src_offset: int,
        dst: DeviceMemory,
        dst_offset: int,
        nbytes: int,
    ) -> None:
        """Bytes from one segment to another (never overlapping): a compaction move."""
        ...


#: a backend's ``decommit(memory, offset, nbytes)``: frees the pages of that range
Decommit = Callable[[DeviceMemory, int, int], None]


def decommitter(backend: object) -> tuple[Decommit, int] | None:
    """The backend's optional decommit capability and its page size, or None.

    A backend that can give the pages of a range inside a segment back to the device,
    keeping the segment (host memory: ``madvise``), sets ``can_decommit`` and
    ``page_size`` and has ``decommit(memory, offset, nbytes)`` for page-aligned ranges
    of free bytes: their pages read as zeros when next touched.  Others (bookkeeping,
    pinned host memory, CUDA) lack it, and the pool never asks them.
    """
    if not getattr(backend, "can_decommit", False):
        return None
    decommit: Decommit = backend.decommit  # type: ignore[attr-defined]
    return decommit, int(backend.page_size)  # type: ignore[attr-defined]


def costly_segment_churn(backend: object) -> bool:
    """Whether giving a wholly free segment back to this backend, to reserve another soon
    after, costs more than keeping it: set (``costly_segment_churn``) on CUDA, where a
    cudaFree waits for the whole device and a cudaMalloc of a large segment maps it afresh
    (a pair of them can cost more than the copy that made the segment's Storage).  The pool then keeps every wholly free
    segment for the policy's ``release_idle_s`` (its ``keep_idle_fraction`` does not
    apply): the compactor gives them back once idle that long, and the out-of-memory and
    ``consolidate`` paths at once, when the device needs the room."""
    return bool(getattr(backend, "costly_segment_churn", False))
