"""Storages (untyped bytes in one pool block) and the tensors that view them.

A Storage lives while something refers to it: a handle in a session, a share
token or a name.  Each of those holds one reference; so does any operation
that is using the Storage right now (a "hold"), so that a concurrent Release can
never hand a block back to the pool while a copy still reads or writes it.

Compaction may move a Storage to another block of its pool (clients hold
handles on the Storage, never on the block).  What clients see as its address
(``data_ptr``) is not the block's: the registry gives each Storage a virtual
address of its own when it is made, from a space that only grows, so it never
changes while the Storage lives, and no other Storage, live or later, is given
an address inside its range (torch users compare ``data_ptr()`` to detect
aliasing).  Block addresses stay the pool's (snapshots, memory_viz).  Pins
are counted apart from references for that: a held Storage never moves, and
while the pool moves blocks it holds the registry's lock, so no hold starts.
"""

from __future__ import annotations

import functools
import secrets
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from tensord.dtypes import DType
from tensord.errors import InternalError
from tensord.layout import Layout

from tensord_server.devices.table import Device
from tensord_server.domain import limits
from tensord_server.domain.quotas import TenantLedger
from tensord_server.pool import Block, CachingPool, round_size

# The first virtual address handed out (non-zero, like a real pointer) and the alignment
# of each one (torch's allocators align blocks to 512 B).
ADDRESS_SPACE_BASE = 1 << 40
ADDRESS_ALIGNMENT = 512


def charge_for(nbytes: int) -> int:
    """What a tenant is charged for a Storage of ``nbytes``: the request rounded as the pool
    rounds (512 B), the same whichever block serves it, so one tenant's quota never depends
    on how others left the pool."""
    return round_size(nbytes) if nbytes else 0


class Storage:
    """Untyped bytes: one block of one device's pool.

    Invariants: ``0 <= holds <= refs``, both guarded by the registry's lock;
    ``block`` is allocated in ``device.pool`` exactly while ``refs > 0``
    (``freed`` after); ``block`` changes only by compaction, under the
    registry's lock, while ``holds == 0``.
    """

    __slots__ = ("address", "block", "device", "freed", "holds", "id", "nbytes", "refs", "tenant")

    def __init__(
        self, device: Device, block: Block, nbytes: int, tenant: str = "", address: int = 0
    ) -> None:
        self.id = secrets.token_hex(8)  # equal for every handle on it, in every session
        self.address = address  # what clients see as data_ptr: fixed for its life
        self.device: Device = device
        self.block: Block = block
        self.nbytes: int = nbytes
        self.tenant: str = tenant  # who created it, and is charged its block
        self.refs: int = 0  # handles + share tokens + names + holds
        self.holds: int = 0  # operations reading or writing the bytes now (never moved then)
        self.freed: bool = False

    @property
    def charge(self) -> int:
        return charge_for(self.nbytes)

    @property
    def data_ptr(self) -> int:
        """The stable virtual address (the block's address is the pool's, and moves)."""
        return self.address

    def raw(self) -> Any:
        """The bytes as a zero-copy 1-D uint8 array of the device's array module."""
        return self.device.backend.view(self.block.segment.memory, self.block.offset, self.nbytes)

    def write(self, offset: int, data: bytes | memoryview) -> None:
        self.device.backend.write(self.block.segment.memory, self.block.offset + offset, data)

    def __repr__(self) -> str:
        return (
            f"Storage({self.id}, {self.device.name}, {self.nbytes} bytes, "
            f"refs={self.refs}, holds={self.holds})"
        )


class StorageRegistry:
    """Every live Storage, with reference counting and holds.  Thread-safe.

    ``allocate`` returns a Storage holding one reference that is a hold (the
    caller's: ``release_hold`` when done with the bytes); ``decref`` to zero frees its
    block back to the pool.  The ledger charges each Storage to the tenant that
    created it, within that tenant's quota (``Storage.charge``: a move changes
    nothing); charges and refunds happen under the lock.

    It is also the pools' :class:`~tensord_server.pool.Relocator` (lock order:
    a pool's lock, then this one; this one is never held while calling a pool).
    """

    def __init__(self, ledger: TenantLedger | None = None) -> None:
        self.ledger = ledger if ledger is not None else TenantLedger()
        # guards _storages, every Storage's refs, holds and block, and the ledger's changes
        self._lock = threading.Lock()
        self._storages: dict[str, Storage] = {}
        self._next_address = ADDRESS_SPACE_BASE  # grows only: no address is handed out twice
        # tenant -> its pool stream: blocks are only reused and segments only split on
        # their own stream, so no segment ever holds two tenants' Storages (a same-host
        # client maps whole segments); "" (no authentication) keeps stream 0
        self._streams: dict[str, int] = {"": 0}

    def _take_address(self, nbytes: int) -> int:
        """A fresh aligned range of ``nbytes`` (at least one alignment unit, so a zero-byte
        Storage's address is its own too); the caller holds the lock."""
        address = self._next_address
        span = max(nbytes, 1)
        self._next_address += -(-span // ADDRESS_ALIGNMENT) * ADDRESS_ALIGNMENT
        return address

    def allocate(self, device: Device, nbytes: int, tenant: str = "") -> Storage:
        """A new Storage charged to ``tenant``; ResourceExhaustedError over its quota."""
        charge = charge_for(nbytes)  # known before the block
        # refuse before the pool evicts cached segments or compacts for a request that cannot
        # be kept anyway; the charge below settles races between one tenant's requests
        self.ledger.precheck(tenant, device.name, charge)
        block = device.pool.malloc(nbytes, self.stream_of(tenant))  # OutOfMemoryError: no undo
        storage = Storage(device, block, nbytes, tenant)
        storage.refs = storage.holds = 1
        try:
            with self._lock:
                self.ledger.charge(tenant, device.name, charge)
                storage.address = self._take_address(nbytes)
                self._storages[storage.id] = storage
        except BaseException:
            device.pool.free(block)
            raise
        return storage

    def stream_of(self, tenant: str) -> int:
        """The tenant's stable pool stream key (0 for "", then 1, 2... in order of first use)."""
        with self._lock:
            return self._streams.setdefault(tenant, len(self._streams))

    def incref(self, storage: Storage) -> None:
        with self._lock:
            if storage.freed:
                raise InternalError(f"reference to a freed {storage!r}")
            storage.refs += 1

    def hold(self, storage: Storage) -> None:
        """A reference that also keeps the Storage where it is: its bytes are in use."""
        with self._lock:
            if storage.freed:
                raise InternalError(f"hold of a freed {storage!r}")
            storage.refs += 1
            storage.holds += 1

    def release_hold(self, storage: Storage) -> None:
        with self._lock:
            storage.holds -= 1
            assert storage.holds >= 0, storage
        self.decref(storage)

    def decref(self, storage: Storage) -> None:
        with self._lock:
            storage.refs -= 1
            assert storage.refs >= 0, storage
            if storage.refs > 0:
                return
            storage.freed = True
            del self._storages[storage.id]
            self.ledger.refund(storage.tenant, storage.device.name, storage.charge)
            block = storage.block
        storage.device.pool.free(block)

    @contextmanager
    def relocation(self, pool: CachingPool) -> Iterator[dict[Block, Callable[[Block], None]]]:
        """For compaction (the pool calls it holding its own lock): stops the world and yields
        the blocks of unheld live Storages of ``pool``, each with the call repointing it."""
        with self._lock:
            yield {
                s.block: functools.partial(self._repoint, s)
                for s in self._storages.values()
                if s.device.pool is pool and s.holds == 0
            }

    def _repoint(self, storage: Storage, block: Block) -> None:
        """``storage`` now lives in ``block`` (its bytes copied there; caller holds the lock).

        Its tenant's charge is the rounded request, not the block: nothing to re-charge.
        """
        assert storage.holds == 0 and block.size <= storage.block.size, (storage, block)
        storage.block = block

    def live(self) -> list[Storage]:
        with self._lock:
            return list(self._storages.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._storages)


@dataclass(frozen=True, slots=True)
class TensorRef:
    """What a handle names: a Storage seen through a layout and a dtype."""

    storage: Storage
    layout: Layout
    dtype: DType
    requires_grad: bool = False

    @property
    def device(self) -> Device:
        return self.storage.device

    @property
    def storage_elements(self) -> int:
        return self.storage.nbytes // self.dtype.itemsize

    def with_layout(self, layout: Layout, dtype: DType | None = None) -> TensorRef:
        return TensorRef(self.storage, layout, dtype or self.dtype, self.requires_grad)


# Byte strides and offsets must fit int64: the wire's TensorMeta and the kernels' strided
# arrays hold them as int64 (repeated diagonal/unsqueeze can double a size-1 dim's stride).
_INT64_MAX = 2**63 - 1


def check_in_bounds(ref: TensorRef) -> None:
    """Refuse to issue a handle reaching outside its Storage (mirrors checkInBoundsForStorage).

    Every handle the server issues passes here, whatever op made it.  The check
    uses the exact lowest and highest element the view reaches (a negative
    stride reaches below the offset), so no op can hand out a window onto
    another Storage's bytes.  Reaching outside is a server bug (the layout
    engine should have refused), hence InternalError; a geometry too large to
    express in int64 bytes is the caller's (RuntimeError, torch's text).
    """
    layout, itemsize = ref.layout, ref.dtype.itemsize
    limits.check_result_ndim(layout.ndim)  # any op's result, whatever made it (unflatten, ...)
    numbers = (layout.offset, *layout.stride)
    if any(abs(n) * itemsize > _INT64_MAX for n in numbers):
        raise RuntimeError(
            f"Storage size calculation overflowed with sizes={list(layout.shape)} and "
            f"strides={list(layout.stride)}"
        )
    reached = layout.element_offset_range()
    if reached is None:
        return  # no elements: nothing is ever read or written through it
    low, high = reached
    needed = (high + 1) * itemsize
    if low < 0 or needed > ref.storage.nbytes:
        raise InternalError(
            f"setStorage: sizes {list(layout.shape)}, strides {list(layout.stride)}, storage "
            f"offset {layout.offset}, and itemsize {itemsize} reaching elements {low} to "
            f"{high} are out of bounds for storage of size {ref.storage.nbytes}"
        )
