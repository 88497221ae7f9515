"""What every tensor op shares: hold the inputs, bound the cost, allocate the output, issue the handle.

The op families (:mod:`tensord_server.domain.ops`, whose docstring tells an op's story in
order) are built on one :class:`OpContext`, which the
:class:`~tensord_server.domain.store.TensorStore` makes over its own state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tensord.dtypes import DType
from tensord.layout import Layout

from tensord_server.devices.table import Device, DeviceTable, activate
from tensord_server.domain import kernels, limits
from tensord_server.domain.sessions import Session, SessionManager
from tensord_server.domain.storage import StorageRegistry, TensorRef, check_in_bounds


@dataclass(frozen=True, slots=True)
class Issued:
    """A handle the server issued (or returned unchanged) and what it names."""

    handle: str
    ref: TensorRef


class OpContext:
    """The store's devices, Storages and sessions as the ops use them.  Thread-safe."""

    def __init__(
        self,
        devices: DeviceTable,
        storages: StorageRegistry,
        sessions: SessionManager,
        max_op_elements: int | None,
    ) -> None:
        self.devices = devices
        self.storages = storages
        self.sessions = sessions
        # elements one op may read or write (None: no limit), checked before the work
        self.max_op_elements = max_op_elements

    def device(self, name: str) -> Device:
        return self.devices.get(name)

    def check_elements(self, elements: int) -> None:
        limits.check_op_elements(elements, self.max_op_elements)

    def issue(self, session: Session, ref: TensorRef) -> Issued:
        return Issued(self.sessions.register(session, ref), ref)

    @contextlib.contextmanager
    def using(self, session: Session, *handles: str) -> Iterator[list[TensorRef]]:
        """The handles' tensors, held, with their devices' kernel contexts entered."""
        with self.sessions.held(session, *handles) as refs, activate(*(r.device for r in refs)):
            yield refs

    @staticmethod
    def array(ref: TensorRef) -> Any:
        """A zero-copy strided array over the tensor's bytes.

        Every layout a kernel sees passes the issued handles' check here, including
        those an op derives without issuing them (a setitem target): a geometry past
        int64 is the caller's error (INVALID_ARGUMENT), never an INTERNAL overflow.
        """
        check_in_bounds(ref)
        return kernels.strided_array(ref.device.xp, ref.storage.raw(), ref.layout, ref.dtype)

    @classmethod
    def values(cls, ref: TensorRef) -> Any:
        """The tensor's values, for reading: :meth:`array` with its lazy conjugate and
        negative bits applied (then a temporary of at most the memory it reaches
        in its Storage, whatever its logical size; else the array itself)."""
        return kernels.apply_lazy_bits(cls.array(ref), ref.conj, ref.neg)

    def fill(self, dst: TensorRef, value: Any) -> None:
        """dst.fill_(value) (after check_scalar_fits): its stored form, if dst has lazy bits."""
        stored = kernels.lazy_scalar(value, dst.conj, dst.neg)
        kernels.fill(dst.device.xp, self.array(dst), stored)

    @contextlib.contextmanager
    def allocated(
        self,
        session: Session,
        device: Device,
        layout: Layout,
        dtype: DType,
        requires_grad: bool = False,
    ) -> Iterator[TensorRef]:
        """A new Storage just big enough for ``layout``, charged to the session's tenant and
        held (never moved by compaction) while the block runs."""
        kernels.check_requires_grad(dtype, requires_grad)
        storage = self.storages.allocate(
            device, layout.storage_extent() * dtype.itemsize, session.tenant
        )
        try:
            with activate(device):
                yield TensorRef(storage, layout, dtype, requires_grad)
        finally:
            self.storages.release_hold(storage)

    def assign(self, dst: TensorRef, src_array: Any) -> None:
        """dst's elements = src_array's (broadcast and cast by torch's rules); into a tensor
        with lazy bits, their stored form (conjugated / negated back)."""
        xp = dst.device.xp
        source = kernels.apply_lazy_bits(
            kernels.to_module(xp, src_array), dst.conj, dst.neg, dst.dtype.numpy_dtype
        )
        kernels.assign(xp, self.array(dst), source)
