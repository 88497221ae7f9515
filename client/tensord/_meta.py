"""What the SDK keeps of one handle: its metadata, decoded once from the server's TensorMeta.

A :class:`Meta` is immutable (``replace`` makes another); a view's is built here, with a
handle id this client chose (:func:`new_handle_id`), before the server has heard of it.
:class:`TensorBase` is what the modules below :mod:`tensord.tensor` know of a tensor:
only that it is one.
"""

from __future__ import annotations

import base64
import builtins
import collections
import os
import secrets
from typing import TYPE_CHECKING, Any

from tensord import dtypes, errors
from tensord.device import Device
from tensord.dtypes import DType
from tensord.layout import Layout

if TYPE_CHECKING:
    from tensord.schema import TensorMeta as TensorMeta


class TensorBase:
    """A tensord tensor, as the modules below :mod:`tensord.tensor` see it (its one
    subclass is :class:`tensord.Tensor`): argument parsing tells it from torch's own."""

    __slots__ = ()


class StorageInfo:
    """What the server said about a Storage: its id, size in bytes and address.

    A pipelined copy's Storage (a reshape that must copy) is made by the server
    after the call returned: its facts arrive with the Batch's answer (``answered``), and
    reading them before that waits for it (``settle``: the connection's synchronize, which
    raises the copy's error if it failed).  Views of that tensor share this object.
    """

    __slots__ = ("_data_ptr", "_id", "_nbytes", "_settle")

    def __init__(
        self,
        storage_id: str,
        nbytes: builtins.int,
        data_ptr: builtins.int,
        settle: Any = None,
    ) -> None:
        self._id = storage_id
        self._nbytes = nbytes
        self._data_ptr = data_ptr
        self._settle = settle

    @classmethod
    def pending(cls, settle: Any) -> StorageInfo:
        """A Storage a queued op will make; ``settle()`` waits until the server answered."""
        return cls("", 0, 0, settle)

    def answered(self, meta: TensorMeta) -> None:
        """The server made it: its facts, from the Batch's answer."""
        self._id, self._nbytes = meta.storage_id, meta.storage_nbytes
        self._data_ptr = meta.storage_data_ptr
        self._settle = None  # last: a reader that sees it gone sees the facts

    def _known(self) -> None:
        settle = self._settle
        if settle is None:
            return
        settle()
        if self._settle is not None:
            raise errors.TensordRuntimeError(
                "this tensor's Storage was never made: the queued copy that makes it (a "
                "reshape or flatten that could not view) failed on the server, and its error "
                "was raised at an earlier wait"
            )

    @property
    def id(self) -> str:
        self._known()
        return self._id

    @property
    def nbytes(self) -> builtins.int:
        self._known()
        return self._nbytes

    @property
    def data_ptr(self) -> builtins.int:
        self._known()
        return self._data_ptr


class Meta:
    """What the server said about one handle (TensorMeta), decoded once; never changed after
    (``replace`` makes another).  A plain class: a frozen dataclass's __init__ cost a
    pipelined view more than its layout math."""

    __slots__ = ("conj", "device", "dtype", "handle", "layout", "neg", "requires_grad", "storage")

    def __init__(
        self,
        handle: str,
        layout: Layout,
        dtype: DType,
        device: Device,
        requires_grad: builtins.bool,
        storage: StorageInfo,
        conj: builtins.bool = False,
        neg: builtins.bool = False,
    ) -> None:
        self.handle = handle
        self.layout = layout
        self.dtype = dtype
        self.device = device
        self.requires_grad = requires_grad
        self.storage = storage
        # torch's lazy bits: the values are the stored ones conjugated / negated
        self.conj = conj
        self.neg = neg

    def replace(self, **changes: Any) -> Meta:
        """A copy with ``changes`` (dataclasses.replace's contract)."""
        fields = {name: getattr(self, name) for name in self.__slots__} | changes
        return Meta(**fields)

    def __repr__(self) -> str:
        return (
            f"Meta(handle={self.handle!r}, layout={self.layout!r}, dtype={self.dtype!r}, "
            f"device={self.device!r}, requires_grad={self.requires_grad!r}, "
            f"storage={self.storage!r}, conj={self.conj!r}, neg={self.neg!r})"
        )

    @property
    def storage_id(self) -> str:
        return self.storage.id

    @property
    def storage_nbytes(self) -> builtins.int:
        return self.storage.nbytes

    @property
    def storage_data_ptr(self) -> builtins.int:
        return self.storage.data_ptr

    @classmethod
    def from_pb(cls, m: TensorMeta) -> Meta:
        return cls(
            handle=m.handle,
            layout=Layout(tuple(m.shape), tuple(m.stride), m.storage_offset),
            dtype=dtypes.dtype_from_name(m.dtype),
            device=Device(m.device or "cpu"),
            requires_grad=m.requires_grad,
            storage=StorageInfo(m.storage_id, m.storage_nbytes, m.storage_data_ptr),
            conj=m.is_conj,
            neg=m.is_neg,
        )


class UntypedStorage:
    """What ``x.untyped_storage()`` tells about the Storage under a tensor (no bytes here)."""

    __slots__ = ("_data_ptr", "_id", "_nbytes", "_tensor", "device")

    def __init__(self, meta: Meta, tensor: TensorBase | None = None) -> None:
        self._nbytes = meta.storage_nbytes
        self._data_ptr = meta.storage_data_ptr
        self._id = meta.storage_id
        self.device = meta.device
        # a tensor on this Storage: x.set_(storage, ...) reaches the Storage through it
        self._tensor = tensor

    @property
    def tensor(self) -> TensorBase | None:
        """A tensor on this Storage (``x.set_(storage, ...)`` reaches the Storage through it)."""
        return self._tensor

    def nbytes(self) -> builtins.int:
        """The Storage's size in bytes, as the server reported it (no RPC)."""
        return self._nbytes

    def size(self) -> builtins.int:
        """The Storage's size in bytes, as torch's ``UntypedStorage.size()``."""
        return self._nbytes

    def data_ptr(self) -> builtins.int:
        """The Storage's address, as the server reported it (no RPC)."""
        return self._data_ptr

    @property
    def storage_id(self) -> str:
        """The server's id of this Storage: equal ids, one Storage."""
        return self._id

    def __repr__(self) -> str:
        return f"<tensord.UntypedStorage {self._id} of {self._nbytes} bytes on {self.device}>"


# Pipelined views' handle ids: 16 random bytes each (the server's own format), drawn from
# the OS this many at a time: one getrandom per view cost more than the rest of the view.
_IDS_PER_DRAW = 256
_random_ids: collections.deque[str] = collections.deque()
# a fork child draws its own ids: the parent's would name the parent's next views
os.register_at_fork(after_in_child=_random_ids.clear)


def new_handle_id() -> str:
    """A handle id this client chooses for a pipelined view: as secrets.token_urlsafe(16)."""
    try:
        return _random_ids.popleft()
    except IndexError:
        raw = secrets.token_bytes(16 * _IDS_PER_DRAW)
        _random_ids.extend(
            base64.urlsafe_b64encode(raw[i : i + 16]).rstrip(b"=").decode()
            for i in range(0, len(raw), 16)
        )
        return _random_ids.popleft()
