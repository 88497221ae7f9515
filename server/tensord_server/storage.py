"""Storages (untyped bytes in one pool block) and the tensors that view them.

A Storage lives while something refers to it: a handle in a session, a share
token or a name.  Each of those holds one reference; so does any operation
that is using the Storage right now (a "pin"), so that a concurrent Release can
never hand a block back to the pool while a copy still reads or writes it.
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass
from typing import Any

from tensord.dtypes import DType
from tensord.errors import InternalError
from tensord.layout import Layout

from tensord_server.devices import Device
from tensord_server.pool import Block, round_size
from tensord_server.quotas import TenantLedger


class Storage:
    """Untyped bytes: one block of one device's pool.

    Invariants: ``refs >= 0``, guarded by the registry's lock; ``block`` is
    allocated in ``device.pool`` exactly while ``refs > 0`` (``freed`` after).
    """

    __slots__ = ("block", "device", "freed", "id", "nbytes", "refs", "tenant")

    def __init__(self, device: Device, block: Block, nbytes: int, tenant: str = "") -> None:
        self.id = secrets.token_hex(8)  # equal for every handle on it, in every session
        self.device: Device = device
        self.block: Block = block
        self.nbytes: int = nbytes
        self.tenant: str = tenant  # who created it, and is charged its block
        self.refs: int = 0  # handles + share tokens + names + pins
        self.freed: bool = False

    @property
    def data_ptr(self) -> int:
        return int(self.block.address)

    def raw(self) -> Any:
        """The bytes as a zero-copy 1-D uint8 array of the device's array module."""
        return self.device.backend.view(self.block.segment.memory, self.block.offset, self.nbytes)

    def write(self, offset: int, data: bytes | memoryview) -> None:
        self.device.backend.write(self.block.segment.memory, self.block.offset + offset, data)

    def __repr__(self) -> str:
        return f"Storage({self.id}, {self.device.name}, {self.nbytes} bytes, refs={self.refs})"


class StorageRegistry:
    """Every live Storage, with reference counting.  Thread-safe.

    ``allocate`` returns a Storage holding one reference (the caller's pin);
    ``decref`` to zero frees its block back to the pool.  The ledger charges each
    block to the tenant that created it, within that tenant's quota.
    """

    def __init__(self, ledger: TenantLedger | None = None) -> None:
        self.ledger = ledger if ledger is not None else TenantLedger()
        self._lock = threading.Lock()  # guards _storages and every Storage.refs
        self._storages: dict[str, Storage] = {}

    def allocate(self, device: Device, nbytes: int, tenant: str = "") -> Storage:
        """A new Storage charged to ``tenant``; ResourceExhaustedError over its quota."""
        # the rounded request is the least the block will be: refuse before the pool
        # evicts cached segments for a request that cannot be kept anyway
        self.ledger.precheck(tenant, device.name, round_size(nbytes) if nbytes else 0)
        block = device.pool.malloc(nbytes)  # raises OutOfMemoryError, nothing to undo
        try:
            self.ledger.charge(tenant, device.name, block.size)
        except BaseException:
            device.pool.free(block)
            raise
        storage = Storage(device, block, nbytes, tenant)
        storage.refs = 1
        with self._lock:
            self._storages[storage.id] = storage
        return storage

    def incref(self, storage: Storage) -> None:
        with self._lock:
            if storage.freed:
                raise InternalError(f"reference to a freed {storage!r}")
            storage.refs += 1

    def decref(self, storage: Storage) -> None:
        with self._lock:
            storage.refs -= 1
            assert storage.refs >= 0, storage
            if storage.refs > 0:
                return
            storage.freed = True
            del self._storages[storage.id]
        # refund first: freeing coalesces the block with its free neighbours, changing its size
        self.ledger.refund(storage.tenant, storage.device.name, storage.block.size)
        storage.device.pool.free(storage.block)

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


def check_in_bounds(ref: TensorRef) -> None:
    """Refuse to issue a handle reaching outside its Storage (mirrors checkInBoundsForStorage).

    Every handle the server issues passes here, whatever op made it; a failure
    is a server bug (the layout engine should have refused), hence InternalError.
    """
    layout = ref.layout
    needed = layout.storage_extent() * ref.dtype.itemsize
    if layout.numel > 0 and needed > ref.storage.nbytes:
        raise InternalError(
            f"setStorage: sizes {list(layout.shape)}, strides {list(layout.stride)}, storage "
            f"offset {layout.offset}, and itemsize {ref.dtype.itemsize} requiring a storage size "
            f"of {needed} are out of bounds for storage of size {ref.storage.nbytes}"
        )
