"""``tensord.Tensor``: a torch-like handle on bytes that live in a tensord server.

A Tensor is its client plus immutable metadata (:class:`Meta`): handle, layout,
dtype, device.  Metadata reads never make an RPC.  A view op first computes
the result with :mod:`tensord.layout` — so a bad argument raises torch's
exception type and text without a round trip — then asks the server to
register the handle.  Copies and writes run on the server.

Dropping the last reference to a Tensor queues its handle for release; the
client sends the queue in batches.
"""

from __future__ import annotations

import base64
import builtins
import collections
import contextlib
import itertools
import math
import operator
import os
import re
import secrets
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from tensord import _dlpack, _format, _indexing, _local, dtypes, errors, protocol
from tensord._convert import as_scalar, exact_dtype
from tensord._no_math import NoMath
from tensord._proto.tensord.v1 import tensord_pb2 as pb
from tensord._session import ClientSession, SessionClient
from tensord.dtypes import DType
from tensord.layout import (
    CONTIGUOUS_FORMAT,
    PRESERVE_FORMAT,
    Layout,
    LazyView,
    check_view_dtype_bits,
    complex_view,
    copy_broadcast_check,
    memory_format_strides,
    normalize_dim,
    strip_leading_ones,
    view_result_count,
)
from tensord.memory_format import (
    MemoryFormat,
    is_memory_format,
    memory_format_name,
    no_positional_or_unknown,
    python_type_name,
)

Number = builtins.bool | builtins.int | builtins.float | builtins.complex


class Size(tuple[int, ...]):
    """torch.Size: a tuple of ints that prints as ``tensord.Size([2, 3])``."""

    def numel(self) -> builtins.int:
        """Returns the number of elements a tensor with the given size would contain."""
        return math.prod(self)

    def __repr__(self) -> str:
        return f"tensord.Size([{', '.join(str(s) for s in self)}])"

    __str__ = __repr__


class Device(str):
    """torch.device as a string subclass: ``x.device == "cpu"`` and ``x.device.type`` both work."""

    @property
    def type(self) -> str:
        """The device type: ``"cpu"`` or ``"cuda"`` (torch.device.type)."""
        return self.partition(":")[0]

    @property
    def index(self) -> builtins.int | None:  # type: ignore[override]  # torch.device.index
        """The device index (``1`` of ``"cuda:1"``), or None when the string names none."""
        _, sep, index = self.partition(":")
        return builtins.int(index) if sep else None

    def __repr__(self) -> str:
        if self.index is None:
            return f"device(type='{self.type}')"
        return f"device(type='{self.type}', index={self.index})"


def device_name(device: Any) -> str:
    """torch's device arguments (``"cuda"``, ``"cuda:1"``, ``1``, torch.device) -> ``"cuda:1"``.

    A malformed one raises torch's RuntimeError (c10::Device's parse); a well-formed one
    the server does not have is the server's to refuse (FailedPreconditionError)."""
    if isinstance(device, builtins.int) and not isinstance(device, builtins.bool):
        if device < 0:
            raise errors.TensordRuntimeError("Device index must not be negative")
        return f"cuda:{device}"
    name = str(device)
    if isinstance(device, str) and not isinstance(device, Device):
        check_device_string(name)
    if name == "cuda":
        return "cuda:0"  # torch resolves a bare "cuda" to the current device, 0 here
    if name == "cpu:0":
        return "cpu"
    return name


# c10::Device's device types, in its error text's order
_DEVICE_TYPES = (
    "cpu, cuda, ipu, xpu, mkldnn, opengl, opencl, ideep, hip, ve, fpga, maia, xla, lazy, "
    "vulkan, mps, meta, hpu, mtia, privateuseone"
)
_DEVICE_STRING = re.compile(r"([A-Za-z_]+)(?::(0|[1-9][0-9]*))?")


def check_device_string(name: str) -> None:
    """c10::Device(string)'s checks and texts: a type of letters and underscores, then an
    optional ``:index`` of digits with no leading zero, the type one torch knows."""
    if not name:
        raise errors.TensordRuntimeError("Device string must not be empty")
    parsed = _DEVICE_STRING.fullmatch(name)
    if parsed is None:
        raise errors.TensordRuntimeError(f"Invalid device string: '{name}'")
    index = parsed.group(2)
    if index is not None and builtins.int(index) > _STOI_MAX:
        raise errors.TensordRuntimeError(
            f"Could not parse device index '{index}' in device string '{name}'"
        )
    if parsed.group(1) not in _DEVICE_TYPES.split(", "):
        raise errors.TensordRuntimeError(
            f"Expected one of {_DEVICE_TYPES} device type at start of device string: {name}"
        )


_STOI_MAX = 2**31 - 1  # std::stoi's int


# Python's number types as dtypes, as torch's argument parser reads them (dtype=float)
_PYTHON_TYPE_DTYPES: dict[type, DType] = {
    builtins.float: dtypes.float64,
    builtins.int: dtypes.int64,
    builtins.bool: dtypes.bool,
    builtins.complex: dtypes.complex128,
}


def as_dtype(value: Any) -> DType:
    """A tensord DType from a DType, a torch.dtype, a Python number type or a dtype name."""
    if isinstance(value, DType):
        return value
    if isinstance(value, type) and value in _PYTHON_TYPE_DTYPES:
        return _PYTHON_TYPE_DTYPES[value]
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.dtype):
        return dtypes.from_torch(value)
    if isinstance(value, str):
        with torch_errors():
            return dtypes.dtype_from_name(value)
    raise errors.TensordTypeError(f"expected a dtype, got {type(value).__name__}")


def _is_dtype(value: Any) -> builtins.bool:
    torch = sys.modules.get("torch")
    if isinstance(value, type) and value in _PYTHON_TYPE_DTYPES:
        return True
    return isinstance(value, DType) or (torch is not None and isinstance(value, torch.dtype))


def _is_number(value: Any) -> builtins.bool:
    return isinstance(
        value, (builtins.bool, builtins.int, builtins.float, builtins.complex, np.generic)
    )


def scalar_pb(value: Any) -> pb.Scalar:
    value = as_scalar(value)
    if isinstance(value, builtins.bool):
        return pb.Scalar(bool_value=value)
    if isinstance(value, builtins.int):
        return _int_scalar_pb(value)
    if isinstance(value, builtins.float):
        return pb.Scalar(float_value=value)
    return pb.Scalar(complex_value=pb.Complex(real=value.real, imag=value.imag))


def _int_scalar_pb(value: builtins.int) -> pb.Scalar:
    """A Python int as torch makes it a Scalar: int64, else uint64, else its OverflowError
    (THPUtils_unpackLong, then PyLong_AsUnsignedLongLong), whatever the tensor's dtype."""
    if -(1 << 63) <= value < 1 << 63:
        return pb.Scalar(int_value=value)
    if value < 0:
        raise OverflowError("can't convert negative int to unsigned")
    if value >= 1 << 64:
        raise OverflowError("int too big to convert")
    return pb.Scalar(uint_value=value)


def _ints(values: Any) -> tuple[builtins.int, ...]:
    return tuple(operator.index(v) for v in values)


def shape_args(args: tuple[Any, ...]) -> tuple[builtins.int, ...]:
    """torch's ``f(2, 3)`` == ``f((2, 3))`` convention; NumPy ints accepted."""
    if len(args) == 1 and not isinstance(args[0], (builtins.int, np.integer)):
        return _ints(args[0])
    return _ints(args)


def require_args(method: str, parameter: str, args: tuple[Any, ...]) -> None:
    """torch's argument parser rejects ``x.permute()`` even where ``x.permute(())`` is valid."""
    if not args:
        raise errors.TensordTypeError(
            f'{method}() missing 1 required positional arguments: "{parameter}"'
        )


def check_limit(count: builtins.int, limit: str, what: str) -> None:
    """Refuse a call whose request would hold more than ``protocol.<limit>`` items (``what``
    tells them: "unbind() would return {} tensors"), before anything is sent or queued: the
    server refuses such a request, and a pipelined op it refuses fails at a later call."""
    bound = getattr(protocol, limit)  # read at each call: the protocol's value, not a copy
    if count > bound:
        raise errors.TensordRuntimeError(
            f"{what.format(count)}; the limit is {bound} (tensord.protocol.{limit})"
        )


def index_items(key: Any) -> list[pb.IndexItem]:
    """A basic index (ints, slices, None, Ellipsis) as the wire's IndexItems."""
    items = key if isinstance(key, tuple) else (key,)
    out = []
    for item in items:
        if item is None:
            out.append(pb.IndexItem(none=True))
        elif item is Ellipsis:
            out.append(pb.IndexItem(ellipsis=True))
        elif isinstance(item, slice):
            out.append(
                pb.IndexItem(slice=pb.Slice(start=item.start, stop=item.stop, step=item.step))
            )
        else:
            out.append(pb.IndexItem(integer=item))
    return out


def plain_index(key: Any) -> Any:
    """NumPy ints -> ints, so the layout engine sees what torch would."""

    def bound(value: Any) -> Any:
        # slice bounds: anything with __index__ (NumPy ints, 0-dim integer tensors), as Python's
        if isinstance(value, np.integer) or _is_tensor(value):
            return operator.index(value)
        return value

    def one(item: Any) -> Any:
        if isinstance(item, np.integer):
            return builtins.int(item)
        if _is_tensor(item) and item.ndim == 0:
            return _zero_dim_index(item)
        if isinstance(item, slice):
            return slice(*(bound(v) for v in (item.start, item.stop, item.step)))
        return item

    return tuple(one(i) for i in key) if isinstance(key, tuple) else one(key)


def _zero_dim_index(item: Any) -> Any:
    """A 0-dim tensor used as an index: an integer one (not uint8, which torch reads as a
    mask) is basic indexing by its value, a view; a float one is torch's IndexError; a
    bool/uint8 mask stays a tensor (advanced indexing, refused by the layout engine)."""
    dtype = _dtype_of(item)
    if dtype.is_floating_point or dtype.is_complex:
        raise errors.TensordIndexError(
            "tensors used as indices must be long, int, byte or bool tensors"
        )
    if dtype is dtypes.bool or dtype is dtypes.uint8:
        return item
    return builtins.int(item.item())


class _TorchErrors:
    """Raise the layout engine's built-in errors as tensord's subclasses of the same built-ins.

    ``except RuntimeError`` still catches them, and so does ``except tensord.TensordError``,
    exactly as for the same error coming back from the server.  A class, not a generator
    context manager: every view enters one, and a generator per view cost microseconds.
    """

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any
    ) -> None:
        if exc is None or isinstance(exc, errors.TensordError):
            return
        ours = errors.from_builtin(exc)
        if ours is not None:
            raise ours from None


_TORCH_ERRORS = _TorchErrors()


def torch_errors() -> _TorchErrors:
    """``with torch_errors():`` the layout engine's errors as tensord's (see _TorchErrors)."""
    return _TORCH_ERRORS


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

    def answered(self, meta: pb.TensorMeta) -> None:
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
    def from_pb(cls, m: pb.TensorMeta) -> Meta:
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


_UNSET: Any = object()  # an argument not given (torch's TypeError lists a None given)


class UntypedStorage:
    """What ``x.untyped_storage()`` tells about the Storage under a tensor (no bytes here)."""

    __slots__ = ("_data_ptr", "_id", "_nbytes", "_tensor", "device")

    def __init__(self, meta: Meta, tensor: Tensor | None = None) -> None:
        self._nbytes = meta.storage_nbytes
        self._data_ptr = meta.storage_data_ptr
        self._id = meta.storage_id
        self.device = meta.device
        # a tensor on this Storage: x.set_(storage, ...) reaches the Storage through it
        self._tensor = tensor

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


# View ops whose result's metadata differs from its input's beyond handle and layout.
#: NumPy's own text when ``copy=False`` cannot be honoured (np.asarray(obj, copy=False))
_NO_COPY_AVOIDED = "Unable to avoid copy while creating an array as requested."
_META_CHANGING_VIEWS = frozenset({"view_dtype", "detach", "set_requires_grad", "complex_view"})


class Tensor(NoMath):
    """A handle on a tensor in a tensord server, with torch.Tensor's names and return types.

    No math: ``x + 1`` or ``x.sum()`` raises a TypeError or AttributeError that says what
    to use instead (:mod:`tensord._no_math`)."""

    __slots__ = ("__weakref__", "_client", "_meta", "_owned", "_session", "_session_id")

    def __init__(self, client: SessionClient, session: ClientSession, meta: Meta) -> None:
        self._client = client  # tensors hold their client: it lives while they do
        self._session = session
        self._meta = meta
        # the session the handle lives in: a replaced session (server restart) took it along
        self._session_id = session.conn.session_id
        # the handle this object releases when it goes (None: handed to another object)
        self._owned: str | None = meta.handle

    def __del__(self) -> None:
        # Queue the handle's release (a deque append: never blocks or raises).  __del__, not
        # weakref.finalize: a finalizer per view cost more than the rest of a pipelined view.
        # At exit the client's close ends the session (and the queue takes nothing then).
        handle = getattr(self, "_owned", None)  # None too if __init__ never finished
        if handle is not None:
            self._owned = None
            # late in interpreter shutdown even that may fail: the session's close frees it
            with contextlib.suppress(Exception):
                self._session.conn.queue_release(handle)

    def _release_now(self) -> None:
        """Queue this object's handle for release now (it takes another one)."""
        handle, self._owned = self._owned, None
        if handle is not None:
            self._session.conn.queue_release(handle)

    # ---- metadata: no RPC ----------------------------------------------------------

    @property
    def client(self) -> SessionClient:
        """The Client this tensor belongs to: its handle is valid in that client's session only."""
        return self._client

    @property
    def handle(self) -> str:
        """The server's id of this tensor; raises if its session is gone or not this process's."""
        conn = self._session.conn
        conn.check_session(self._session_id)
        handle = self._meta.handle
        conn.handle_used(handle)  # a queued view whose id is read is never elided
        return handle

    @property
    def shape(self) -> Size:
        """Returns the size of the ``self`` tensor. Alias for ``size()``.

        A ``tensord.Size`` (a tuple of ints). Metadata the SDK keeps: no RPC.
        """
        return Size(self._meta.layout.shape)

    def size(self, dim: builtins.int | None = None) -> Any:
        """Returns the size of the ``self`` tensor.

        Metadata the SDK keeps: no RPC.

        Args:
            dim: A dimension (negative counts from the end), or None for all of them.

        Returns:
            A ``tensord.Size`` (a tuple of ints) when ``dim`` is None, else the size
                of that dimension.

        Raises:
            IndexError: ``dim`` is out of range (``tensord.TensordIndexError``).
        """
        if dim is None:
            return self.shape
        with torch_errors():
            return self._meta.layout.shape[normalize_dim(dim, self.ndim, wrap_scalar=False)]

    def stride(self, dim: builtins.int | None = None) -> Any:
        """Returns the stride of the ``self`` tensor.

        Strides count elements, not bytes. Metadata the SDK keeps: no RPC.

        Args:
            dim: A dimension (negative counts from the end), or None for all of them.

        Returns:
            A tuple of ints when ``dim`` is None, else the stride of that dimension.

        Raises:
            IndexError: ``dim`` is out of range (``tensord.TensordIndexError``).
        """
        if dim is None:
            return self._meta.layout.stride
        with torch_errors():
            return self._meta.layout.stride[normalize_dim(dim, self.ndim, wrap_scalar=False)]

    def storage_offset(self) -> builtins.int:
        """Returns ``self`` tensor's offset in the underlying storage in terms of number of storage
        elements (not bytes).

        Metadata the SDK keeps: no RPC.
        """
        return self._meta.layout.offset

    @property
    def dtype(self) -> DType:
        """The data type of the elements.

        A ``tensord.DType`` (``tensord.float32``, ...), which stands for the ``torch.dtype`` of the
        same name. Metadata the SDK keeps: no RPC.
        """
        return self._meta.dtype

    @property
    def device(self) -> Device:
        """Is the device where this Tensor is.

        A ``tensord.Device``: a string (``"cpu"``, ``"cuda:0"``) that also has torch.device's
        ``type`` and ``index``.  The device is the server's, not this process's. Metadata the SDK
        keeps: no RPC.
        """
        return self._meta.device

    @property
    def is_cuda(self) -> builtins.bool:
        """Is ``True`` if the Tensor is stored on the GPU, ``False`` otherwise.

        The GPU is the server's. Metadata the SDK keeps: no RPC.
        """
        return self.device.type == "cuda"

    @property
    def is_cpu(self) -> builtins.bool:
        """Is ``True`` if the Tensor is stored on the CPU, ``False`` otherwise.

        The CPU is the server's. Metadata the SDK keeps: no RPC.
        """
        return self.device.type == "cpu"

    @property
    def requires_grad(self) -> builtins.bool:
        """Is ``True`` if gradients need to be computed for this Tensor, ``False`` otherwise.

        tensord carries the flag as torch's rules set it (the server holds it too) but records no
        graph and computes no gradients. Metadata the SDK keeps: no RPC.
        """
        return self._meta.requires_grad

    def is_contiguous(self, *args: Any, **kwargs: Any) -> builtins.bool:
        """torch's x.is_contiguous(memory_format=...) (keyword only, as torch's)."""
        fmt = _keyword_memory_format("is_contiguous", args, kwargs)
        with torch_errors():
            return self._meta.layout.is_contiguous(fmt)

    def numel(self) -> builtins.int:
        """Returns the total number of elements in the ``self`` tensor.

        Metadata the SDK keeps: no RPC.
        """
        return self._meta.layout.numel

    def nelement(self) -> builtins.int:
        """Alias for ``numel()``.

        Metadata the SDK keeps: no RPC.
        """
        return self.numel()

    def dim(self) -> builtins.int:
        """Returns the number of dimensions of ``self`` tensor.

        Metadata the SDK keeps: no RPC.
        """
        return self._meta.layout.ndim

    @property
    def ndim(self) -> builtins.int:
        """Alias for ``dim()``.

        Metadata the SDK keeps: no RPC.
        """
        return self._meta.layout.ndim

    def element_size(self) -> builtins.int:
        """Returns the size in bytes of an individual element.

        Metadata the SDK keeps: no RPC.
        """
        return self.dtype.itemsize

    @property
    def itemsize(self) -> builtins.int:
        """Alias for ``element_size()``.

        Metadata the SDK keeps: no RPC.
        """
        return self.dtype.itemsize

    @property
    def nbytes(self) -> builtins.int:
        """Returns the number of bytes consumed by the "view" of elements of the Tensor.

        Defined to be ``numel() * element_size()``. Metadata the SDK keeps: no RPC.
        """
        return self.numel() * self.dtype.itemsize

    def data_ptr(self) -> builtins.int:
        """Returns the address of the first element of ``self`` tensor.

        The address is in the server's memory: its Storage's address as the server reported it, plus
        the offset in bytes; 0 for a tensor with no elements, as torch's.  No RPC (for a tensor a
        queued copy makes, it waits for the server's answer to that copy).
        """
        # torch: the storage's address plus the offset in bytes; 0 (nullptr) with no elements
        if self.numel() == 0:
            return 0
        return self._meta.storage_data_ptr + self._meta.layout.offset * self.dtype.itemsize

    def untyped_storage(self) -> UntypedStorage:
        """Returns the underlying ``UntypedStorage``.

        Here a description of the server's Storage (its id, size in bytes and address), with no
        bytes in this process; ``x.set_(storage, ...)`` takes it.  No RPC (for a tensor a queued
        copy makes, it waits for the server's answer to that copy).
        """
        return UntypedStorage(self._meta, self)

    def __reduce__(self) -> Any:
        # A handle is only valid in its own session: hand another process a token instead.
        raise errors.TensordTypeError(
            "a tensord.Tensor cannot be pickled: pass x.share() (a token) to the other "
            "process and client.attach(token) there, or name it with client.put()"
        )

    def __len__(self) -> builtins.int:
        if self.ndim == 0:
            raise errors.TensordTypeError("len() of a 0-d tensor")
        return self.shape[0]

    # ---- views: checked locally, then registered by one RPC ---------------------------

    def _views(self, layouts: Any = None, **op: Any) -> list[Tensor]:
        """The view op ``op`` (a ViewRequest field); ``layouts`` are its results as the layout
        engine computed them here: with pipelining the op is queued and they are returned at
        once, under handle ids this client chose."""
        conn = self._session.conn
        handle = self.handle
        if layouts:
            check_limit(
                len(layouts), "MAX_VIEW_RESULTS", f"{next(iter(op))}() would return {{}} tensors"
            )
            check_limit(layouts[0].ndim, "MAX_DIMS", "the result would have {} dimensions")
        if layouts is not None and conn.pipelining:
            metas = [self._view_meta(lay, op) for lay in layouts]
            results = tuple(m.handle for m in metas)
            conn.enqueue("view", next(iter(op)), handle, op, results)
            return [Tensor(self._client, self._session, m) for m in metas]
        response = conn.call("View", pb.ViewRequest(handle=handle, **op))
        return [wrap(self._client, self._session, m) for m in response.tensors]

    def _view(self, layout: Layout | None = None, **op: Any) -> Tensor:
        (result,) = self._views(None if layout is None else (layout,), **op)
        return result

    def _elidable_view(self, layout: Layout, **op: Any) -> Tensor:
        """A view the server cannot refuse while this tensor's handle is live: its result
        keeps a subset of this one's dims and strides, reaches a subset of its elements and
        takes one handle.  Queued (with pipelining) as a view that, dropped unused before
        its Batch, is never sent (see Connection.enqueue)."""
        conn = self._session.conn
        if not conn.pipelining:
            return self._view(layout, **op)
        handle = self.handle
        meta = self._view_meta(layout, op)
        conn.enqueue("view", next(iter(op)), handle, op, (meta.handle,), None, True)
        return Tensor(self._client, self._session, meta)

    def _view_meta(self, layout: Layout, op: dict[str, Any]) -> Meta:
        """A view's metadata as the server will make it (same Storage, a new handle)."""
        m = self._meta
        if not op.keys() & _META_CHANGING_VIEWS:  # the common case, built directly
            return Meta(
                new_handle_id(),
                layout,
                m.dtype,
                m.device,
                m.requires_grad,
                m.storage,  # shared: a view's Storage is its input's
                m.conj,  # and so are its lazy bits
                m.neg,
            )
        meta = m.replace(handle=new_handle_id(), layout=layout)
        if "view_dtype" in op:  # view(dtype) is not differentiable: never requires grad
            return meta.replace(
                dtype=dtypes.dtype_from_name(op["view_dtype"].dtype), requires_grad=False
            )
        if "detach" in op:
            return meta.replace(requires_grad=False)
        if "complex_view" in op:
            lazy = self._lazy_view(op["complex_view"].op)
            return meta.replace(
                dtype=dtypes.dtype_from_name(lazy.dtype), conj=lazy.conj, neg=lazy.neg
            )
        if "set_requires_grad" in op:
            return meta.replace(requires_grad=op["set_requires_grad"].requires_grad)
        return meta

    def view(self, *shape: Any) -> Tensor:
        """Returns a new tensor with the same data as the ``self`` tensor but of a different
        ``shape``.

        ``x.view(dtype)`` instead views the same bytes as another dtype, as torch's does.

        A view, no copy: the layout is computed here (a bad argument raises torch's error with no
        round trip), and the server only registers a new handle on the same Storage. With pipelining
        (the default) that op is queued and the call does not wait for the server; without it, one
        View RPC.

        Raises:
            RuntimeError: the shape is not viewable with these strides (torch's text; use
                ``reshape``, which copies then).
        """
        if not shape:
            raise errors.TensordTypeError(
                "view() received an invalid combination of arguments - got (), but expected one "
                "of:\n * (torch.dtype dtype)\n * (tuple of ints size)\n"
            )
        if len(shape) == 1 and _is_dtype(shape[0]):
            return self._view_dtype(as_dtype(shape[0]))
        with torch_errors():
            sizes = shape_args(shape)
            layout = self._meta.layout.view(sizes)
        return self._view(layout, view=pb.ViewShape(shape=sizes))

    def _view_dtype(self, dtype: DType) -> Tensor:
        old = self.dtype
        with torch_errors():
            check_view_dtype_bits(self._meta.conj, self._meta.neg)
            layout = self._meta.layout.view_dtype(
                old.itemsize, dtype.itemsize, old_name=old.scalar_type, new_name=dtype.scalar_type
            )
        return self._view(layout, view_dtype=pb.ViewDtype(dtype=dtype.name))

    def view_as(self, other: Tensor) -> Tensor:
        """View this tensor as the same size as ``other``.

        ``self.view_as(other)`` is equivalent to ``self.view(other.size())``.

        A view, no copy: the layout is computed here (a bad argument raises torch's error with no
        round trip), and the server only registers a new handle on the same Storage. With pipelining
        (the default) that op is queued and the call does not wait for the server; without it, one
        View RPC.
        """
        return self.view(other.shape)

    def reshape(self, *shape: Any) -> Tensor:
        """Returns a tensor with the same data and number of elements as ``self`` but with the
        specified shape.

        A view when ``shape`` is compatible with the current layout (as ``view``).  A view, no copy:
        the layout is computed here (a bad argument raises torch's error with no round trip), and
        the server only registers a new handle on the same Storage. With pipelining (the default)
        that op is queued and the call does not wait for the server; without it, one View RPC.

        Otherwise a contiguous copy made on the server: with pipelining that copy is queued too (the
        new Storage's id and address come with the batch's answer, and reading them waits for it);
        without it, one Reshape RPC.
        """
        require_args("reshape", "shape", shape)
        with torch_errors():
            sizes = shape_args(shape)
            viewed = self._meta.layout.reshape(sizes)
        if viewed is not None:
            return self._view(viewed, view=pb.ViewShape(shape=sizes))
        conn = self._session.conn
        request = pb.ReshapeRequest(handle=self.handle, shape=sizes)
        if conn.pipelining:
            with torch_errors():  # torch's copy: _unsafe_view(clone(contiguous_format), shape)
                layout = Layout.contiguous(self._meta.layout.shape).view(sizes)
            return self._queued_copy(request, layout)
        return wrap(self._client, self._session, conn.call("Reshape", request))

    def _queued_copy(self, request: pb.ReshapeRequest, layout: Layout) -> Tensor:
        """A reshape that must copy, queued: the result's layout is contiguous and
        its id ours; its Storage's facts come with the Batch's answer (StorageInfo)."""
        check_limit(layout.ndim, "MAX_DIMS", "the result would have {} dimensions")
        conn = self._session.conn
        storage = StorageInfo.pending(conn.synchronize)
        meta = Meta(new_handle_id(), layout, self.dtype, self.device, self.requires_grad, storage)
        conn.enqueue(
            "reshape", "reshape", request.handle, request, (meta.handle,), storage.answered
        )
        return Tensor(self._client, self._session, meta)

    def reshape_as(self, other: Tensor) -> Tensor:
        """Returns this tensor as the same shape as ``other``.

        ``self.reshape_as(other)`` is equivalent to ``self.reshape(other.shape)``: a view when the
        layout allows, else a copy on the server (see ``reshape``).
        """
        return self.reshape(other.shape)

    def narrow(self, dim: builtins.int, start: Any, length: builtins.int) -> Tensor:
        """Returns a new tensor that is a narrowed version of ``self`` tensor.

        The dimension ``dim`` is input from ``start`` to ``start + length``; ``start`` may also be a
        0-dim integer tensor, as torch's.

        A view, no copy: the layout is computed here (a bad argument raises torch's error with no
        round trip), and the server only registers a new handle on the same Storage. With pipelining
        (the default) that op is queued and the call does not wait for the server (a view dropped
        unused before its batch is sent is never sent); without it, one View RPC.
        """
        if _is_tensor(start):  # torch's narrow(dim, Tensor start, length) overload
            start = _narrow_start(start)
        with torch_errors():
            layout = self._meta.layout.narrow(dim, start, length)
        return self._elidable_view(layout, narrow=pb.Narrow(dim=dim, start=start, length=length))

    def select(self, dim: builtins.int, index: builtins.int) -> Tensor:
        """Slices the ``self`` tensor along the selected dimension at the given index.

        This returns a view of the original tensor with the given dimension removed.

        A view, no copy: the layout is computed here (a bad argument raises torch's error with no
        round trip), and the server only registers a new handle on the same Storage. With pipelining
        (the default) that op is queued and the call does not wait for the server (a view dropped
        unused before its batch is sent is never sent); without it, one View RPC.
        """
        with torch_errors():
            layout = self._meta.layout.select(dim, index)
        return self._elidable_view(layout, select=pb.Select(dim=dim, index=index))

    def __getitem__(self, key: Any) -> Tensor:
        if type(key) is builtins.int:  # x[i], the commonest view: basic, nothing to normalize
            with torch_errors():
                layout = self._meta.layout[key]
            return self._elidable_view(layout, index=_int_index(key))
        key = plain_index(key)
        items = plain_index(_indexing.key_items(key, _is_tensor))
        if _indexing.is_advanced(items, _is_tensor):
            return self._advanced_index(items)
        with torch_errors():
            layout = self._meta.layout[key]
        index = pb.Index(items=index_items(key))
        if _narrowing_index(key, self._meta.layout.shape):
            return self._elidable_view(layout, index=index)
        return self._view(layout, index=index)

    def __delitem__(self, key: Any) -> None:
        raise errors.TensordTypeError("Tensor does not support deleting items")

    def transpose(self, dim0: builtins.int, dim1: builtins.int) -> Tensor:
        """Returns a tensor that is a transposed version of ``self``.

        The given dimensions ``dim0`` and ``dim1`` are swapped.

        A view, no copy: the layout is computed here (a bad argument raises torch's error with no
        round trip), and the server only registers a new handle on the same Storage. With pipelining
        (the default) that op is queued and the call does not wait for the server (a view dropped
        unused before its batch is sent is never sent); without it, one View RPC.
        """
        with torch_errors():
            layout = self._meta.layout.transpose(dim0, dim1)
        return self._elidable_view(layout, transpose=pb.Transpose(dim0=dim0, dim1=dim1))

    def swapaxes(self, axis0: builtins.int, axis1: builtins.int) -> Tensor:
        """Alias for ``transpose``: a view, queued like it."""
        return self.transpose(axis0, axis1)

    def swapdims(self, dim0: builtins.int, dim1: builtins.int) -> Tensor:
        """Alias for ``transpose``: a view, queued like it."""
        return self.transpose(dim0, dim1)

    def t(self) -> Tensor:
        """Expects ``self`` to be <= 2-D tensor and transposes dimensions 0 and 1.

        A view, no copy: the layout is computed here (a bad argument raises torch's error with no
        round trip), and the server only registers a new handle on the same Storage. With pipelining
        (the default) that op is queued and the call does not wait for the server (a view dropped
        unused before its batch is sent is never sent); without it, one View RPC.
        """
        with torch_errors():
            layout = self._meta.layout.t()
        return self._elidable_view(layout, t=pb.T())

    @property
    def T(self) -> Tensor:
        """torch's ``x.T``: all dims reversed; torch warns (once) unless x is a matrix.

        mirrors ATen numpy_T: a 0-dim tensor gives a new handle on itself (a permute).
        """
        if self.ndim == 0:
            _warn_once(
                "Tensor.T is deprecated on 0-D tensors. This function is the identity in these cases."
            )
        elif self.ndim != 2:
            _warn_once(_T_DEPRECATED)
        return self.permute(tuple(reversed(range(self.ndim))))

    def _matrix_view(self, name: builtins.str, zero_dim_warning: builtins.str) -> Tensor:
        # mT / mH / H / adjoint(): a transpose of the last two dims (of a real tensor)
        # mH / H / adjoint() of a complex tensor: the transpose's lazy conjugate, as torch's
        conjugate = name != "mT" and self.dtype.is_complex
        if self.ndim == 0:
            _warn_once(zero_dim_warning)
            return self.conj() if conjugate else self
        with torch_errors():
            if name == "H":
                self._meta.layout.h()
            else:
                self._meta.layout.matrix_transpose(name)
        transposed = self.transpose(-2, -1)
        return transposed.conj() if conjugate else transposed

    @property
    def mT(self) -> Tensor:
        """Returns a view of this tensor with the last two dimensions transposed.

        A view like ``transpose(-2, -1)``, queued like it.
        """
        return self._matrix_view("mT", _IDENTITY_0D.format("Tensor.mT"))

    @property
    def mH(self) -> Tensor:
        """Accessing this property is equivalent to calling ``adjoint()``.

        A view (a transpose, plus the lazy conjugate of a complex tensor), queued like it.
        """
        return self._matrix_view("mH", _CONJ_0D.format("Tensor.mH"))

    @property
    def H(self) -> Tensor:
        """Returns a view of a matrix (2-D tensor) conjugated and transposed.

        A view (a transpose, plus the lazy conjugate of a complex tensor), queued like it.
        """
        return self._matrix_view("H", _CONJ_0D.format("Tensor.H"))

    def adjoint(self) -> Tensor:
        """Returns a view of the tensor conjugated and with the last two dimensions transposed.

        A view: ``transpose(-2, -1)``, and of a complex tensor its lazy conjugate (a flipped
        conjugate bit, no values changed); queued like every view.
        """
        return self._matrix_view("adjoint()", _CONJ_0D.format("adjoint()"))

    # ---- complex views and torch's lazy conjugate / negative bits ---------------------

    def _lazy_view(self, name: builtins.str) -> LazyView:
        meta = self._meta
        with torch_errors():
            return complex_view(
                name, meta.layout, meta.dtype.name, meta.dtype.scalar_type, meta.conj, meta.neg
            )

    def _complex_view(self, name: builtins.str) -> Tensor:
        """A complex view (the layout engine's rules, checked here first), one View RPC."""
        lazy = self._lazy_view(name)
        return self._view(lazy.layout, complex_view=pb.ComplexView(op=name))

    @property
    def real(self) -> Tensor:
        """torch's x.real: a view of the real parts; a real tensor's is the tensor itself."""
        return self._complex_view("real") if self.dtype.is_complex else self

    @property
    def imag(self) -> Tensor:
        """torch's x.imag: a view of the imaginary parts (of a conjugate: with the neg bit)."""
        return self._complex_view("imag")

    def conj(self) -> Tensor:
        """torch's lazy conjugate: a view with the conjugate bit flipped (self if not complex)."""
        return self._complex_view("conj") if self.dtype.is_complex else self

    def is_conj(self) -> builtins.bool:
        """Returns True if the conjugate bit of ``self`` is set to true.

        Metadata the SDK keeps: no RPC.
        """
        return self._meta.conj

    def is_neg(self) -> builtins.bool:
        """Returns True if the negative bit of ``self`` is set to true.

        Metadata the SDK keeps: no RPC.
        """
        return self._meta.neg

    def resolve_conj(self) -> Tensor:
        """A copy holding the conjugated values when the conjugate bit is set, else self."""
        return self.clone() if self._meta.conj else self

    def resolve_neg(self) -> Tensor:
        """A copy holding the negated values when the negative bit is set, else self."""
        return self.clone() if self._meta.neg else self

    def conj_physical(self) -> Tensor:
        """The conjugated values in a new tensor (never a conjugate view); self if not complex."""
        return self.conj().clone() if self.dtype.is_complex else self

    def conj_physical_(self) -> Tensor:
        """Conjugates the values in place (self if not complex): a copy_ from the conjugate."""
        if self.dtype.is_complex:
            self.copy_(self.conj())
        return self

    def permute(self, *dims: Any) -> Tensor:
        """Returns a view of the original tensor with its dimensions permuted.

        The dims come as ints or as one sequence of them: ``x.permute(1, 0)`` or
        ``x.permute((1, 0))``.

        A view, no copy: the layout is computed here (a bad argument raises torch's error with no
        round trip), and the server only registers a new handle on the same Storage. With pipelining
        (the default) that op is queued and the call does not wait for the server; without it, one
        View RPC.
        """
        require_args("permute", "dims", dims)
        with torch_errors():
            order = shape_args(dims)
            layout = self._meta.layout.permute(order)
        return self._view(layout, permute=pb.Permute(dims=order))

    def moveaxis(self, source: Any, destination: Any) -> Tensor:
        """Alias for ``movedim``: a view, queued like it."""
        return self.movedim(source, destination)

    def movedim(self, source: Any, destination: Any) -> Tensor:
        """Moves the dimension(s) of ``self`` at the position(s) in ``source`` to the position(s) in
        ``destination``.

        Other dimensions of ``self`` that are not explicitly moved remain in their original order
        and appear at the positions not specified in ``destination``.

        A view, no copy: the layout is computed here (a bad argument raises torch's error with no
        round trip), and the server only registers a new handle on the same Storage. With pipelining
        (the default) that op is queued and the call does not wait for the server; without it, one
        View RPC.
        """
        with torch_errors():
            layout = self._meta.layout.movedim(source, destination)
        src = [source] if isinstance(source, builtins.int) else list(source)
        dst = [destination] if isinstance(destination, builtins.int) else list(destination)
        return self._view(layout, movedim=pb.Movedim(source=src, destination=dst))

    def expand(self, *sizes: Any) -> Tensor:
        """Returns a new view of the ``self`` tensor with singleton dimensions expanded to a larger
        size.

        Passing -1 as the size for a dimension means not changing its size.  The expanded dimensions
        have stride 0: no memory is allocated.

        A view, no copy: the layout is computed here (a bad argument raises torch's error with no
        round trip), and the server only registers a new handle on the same Storage. With pipelining
        (the default) that op is queued and the call does not wait for the server; without it, one
        View RPC.
        """
        require_args("expand", "size", sizes)
        with torch_errors():
            target = shape_args(sizes)
            layout = self._meta.layout.expand(target, type_name=self.dtype.legacy_type)
        return self._view(layout, expand=pb.Expand(shape=target))

    def expand_as(self, other: Any) -> Tensor:
        """Expand this tensor to the same size as ``other``.

        ``self.expand_as(other)`` is equivalent to ``self.expand(other.size())``: a view, queued
        like it.
        """
        return self.expand(tuple(other.shape))

    def broadcast_to(self, size: Any) -> Tensor:
        """Broadcasts ``self`` to the shape ``size``.

        Equivalent to calling ``self.expand(size)``: a view, queued like it.
        """
        return self.expand(size)

    def squeeze(self, dim: Any = None) -> Tensor:
        """Returns a tensor with all specified dimensions of ``self`` of size 1 removed.

        ``dim`` is an int, a tuple of ints, or None for every dimension of size 1.

        A view, no copy: the layout is computed here (a bad argument raises torch's error with no
        round trip), and the server only registers a new handle on the same Storage. With pipelining
        (the default) that op is queued and the call does not wait for the server; without it, one
        View RPC.
        """
        with torch_errors():
            layout = self._meta.layout.squeeze(dim)
        if dim is None:
            return self._view(layout, squeeze=pb.Squeeze())
        dims = [dim] if isinstance(dim, builtins.int) else list(dim)
        return self._view(layout, squeeze=pb.Squeeze(dims=pb.IntList(values=dims)))

    def unsqueeze(self, dim: builtins.int) -> Tensor:
        """Returns a new tensor with a dimension of size one inserted at the specified position.

        A view, no copy: the layout is computed here (a bad argument raises torch's error with no
        round trip), and the server only registers a new handle on the same Storage. With pipelining
        (the default) that op is queued and the call does not wait for the server; without it, one
        View RPC.
        """
        with torch_errors():
            layout = self._meta.layout.unsqueeze(dim)
        return self._view(layout, unsqueeze=pb.Unsqueeze(dim=dim))

    def flatten(self, start_dim: builtins.int = 0, end_dim: builtins.int = -1) -> Tensor:
        """Flattens ``self`` by reshaping it into a one-dimensional tensor.

        If ``start_dim`` or ``end_dim`` are passed, only dimensions starting with ``start_dim`` and
        ending with ``end_dim`` are flattened.  With ``start_dim == end_dim`` a tensor of one or
        more dimensions is returned itself, as torch does.

        A view when the dimensions can be merged without a copy: the layout is computed here (a bad
        argument raises torch's error with no round trip), and the server only registers a new
        handle on the same Storage. With pipelining (the default) that op is queued and the call
        does not wait for the server; without it, one View RPC.  Otherwise a copy, as ``reshape``
        makes it.
        """
        with torch_errors():
            viewed = self._meta.layout.flatten(start_dim, end_dim)
        if viewed is self._meta.layout and self.ndim > 0:
            return self  # start_dim == end_dim: torch returns self
        if viewed is not None:
            return self._view(viewed, flatten=pb.Flatten(start_dim=start_dim, end_dim=end_dim))
        # torch.flatten reshapes, and a reshape that cannot view copies
        # the flattened shape: the layout engine's flatten of a contiguous tensor (always a view)
        flat = Layout.contiguous(tuple(self.shape)).flatten(start_dim, end_dim)
        assert flat is not None
        return self.reshape(flat.shape)

    def unflatten(self, dim: builtins.int, sizes: Sequence[builtins.int]) -> Tensor:
        """Expands a dimension of the input tensor over multiple dimensions.

        A view, no copy: the layout is computed here (a bad argument raises torch's error with no
        round trip), and the server only registers a new handle on the same Storage. With pipelining
        (the default) that op is queued and the call does not wait for the server; without it, one
        View RPC.
        """
        with torch_errors():
            layout = self._meta.layout.unflatten(dim, sizes)
        return self._view(layout, unflatten=pb.Unflatten(dim=dim, sizes=list(sizes)))

    def split(self, split_size_or_sections: Any, dim: builtins.int = 0) -> tuple[Tensor, ...]:
        """Splits the tensor into chunks. Each chunk is a view of the original tensor.

        An int ``split_size_or_sections`` makes equal chunks of that size along ``dim`` (the last
        may be smaller); a list of ints gives each chunk's size.

        Views, no copy: the layouts are computed here and the server registers the handles in one op
        on the same Storage, queued with pipelining (the default; one View RPC without it).  More
        parts than ``tensord.protocol.MAX_VIEW_RESULTS`` are made in runs of that many, each waited
        for.

        Returns:
            A tuple of tensors.
        """
        count = self._result_count("split", (split_size_or_sections, dim))
        if count > protocol.MAX_VIEW_RESULTS and isinstance(split_size_or_sections, builtins.int):
            size = split_size_or_sections  # (a list of sections is split below, as views)
            return self._in_groups(count, size, dim, lambda t, n: t.split(size, dim))
        with torch_errors():
            parts = self._meta.layout.split(split_size_or_sections, dim)
        if isinstance(split_size_or_sections, builtins.int):
            op = pb.Split(split_size=split_size_or_sections, dim=dim)
            return tuple(self._views(parts, split=op))
        sections = list(split_size_or_sections)
        if len(sections) > _MAX_SECTIONS:  # more than a Split may list: a view per part
            return self._strided_views(parts)
        op = pb.Split(sections=pb.IntList(values=sections), dim=dim)
        return tuple(self._views(parts, split=op))

    def tensor_split(self, indices_or_sections: Any, dim: builtins.int = 0) -> tuple[Tensor, ...]:
        """mirrors torch.Tensor.tensor_split: an int (sections), a sequence of split
        indices, or a long tensor of either (0-dim: sections; 1-dim: indices)."""
        arg = _split_arg(indices_or_sections, self.ndim)
        with torch_errors():
            parts = self._meta.layout.tensor_split(arg, dim)
        return self._split_views(parts, dim)

    def _split_along(self, name: builtins.str, indices_or_sections: Any) -> tuple[Tensor, ...]:
        arg = indices_or_sections
        if not isinstance(arg, (builtins.int, np.integer)):
            arg = _ints(arg)
        with torch_errors():
            parts = getattr(self._meta.layout, name)(
                operator.index(arg) if isinstance(arg, np.integer) else arg
            )
        return self._split_views(
            parts, {"vsplit": 0, "dsplit": 2}.get(name, 0 if self.ndim == 1 else 1)
        )

    def hsplit(self, indices_or_sections: Any) -> tuple[Tensor, ...]:
        """Splits ``self``, a tensor with one or more dimensions, into multiple tensors horizontally
        according to ``indices_or_sections``.

        Views, no copy: the layouts are computed here; the server registers the handles on the same
        Storage as one split op, or one ``as_strided`` per part where the parts are no plain split,
        queued with pipelining (the default; View RPCs without it).
        """
        return self._split_along("hsplit", indices_or_sections)

    def vsplit(self, indices_or_sections: Any) -> tuple[Tensor, ...]:
        """Splits ``self``, a tensor with two or more dimensions, into multiple tensors vertically
        according to ``indices_or_sections``.

        Views, no copy: the layouts are computed here; the server registers the handles on the same
        Storage as one split op, or one ``as_strided`` per part where the parts are no plain split,
        queued with pipelining (the default; View RPCs without it).
        """
        return self._split_along("vsplit", indices_or_sections)

    def dsplit(self, indices_or_sections: Any) -> tuple[Tensor, ...]:
        """Splits ``self``, a tensor with three or more dimensions, into multiple tensors depthwise
        according to ``indices_or_sections``.

        Views, no copy: the layouts are computed here; the server registers the handles on the same
        Storage as one split op, or one ``as_strided`` per part where the parts are no plain split,
        queued with pipelining (the default; View RPCs without it).
        """
        return self._split_along("dsplit", indices_or_sections)

    def _split_views(self, parts: tuple[Layout, ...], dim: builtins.int) -> tuple[Tensor, ...]:
        """Handles on parts the layout engine computed along ``dim``: one Split RPC when they
        are exactly a split_with_sizes (parts that tile the dim in order) of at most the
        sections a Split may list, else one as_strided per part (the server bounds-checks
        each against the Storage)."""
        sizes = [p.shape[dim] for p in parts]
        tiled = False
        with contextlib.suppress(RuntimeError, IndexError, ValueError, TypeError):
            tiled = self._meta.layout.split(sizes, dim) == parts
        if tiled and len(sizes) <= _MAX_SECTIONS:
            op = pb.Split(sections=pb.IntList(values=sizes), dim=dim)
            return tuple(self._views(parts, split=op))
        runs = [(size, len(list(run))) for size, run in itertools.groupby(sizes)] if tiled else []
        if tiled and len(runs) <= _MAX_SECTIONS:  # tensor_split(n): two runs of equal parts
            return self._split_runs(runs, dim, len(parts))
        return self._strided_views(parts)

    def _split_runs(
        self, runs: list[tuple[builtins.int, builtins.int]], dim: builtins.int, count: builtins.int
    ) -> tuple[Tensor, ...]:
        """The parts of a split into more sections than a Split may list, given as runs of
        (size, how many) that tile ``dim`` in order: each run one split of its span, as
        many a call as a long split (a run of empty parts: a chunk of an empty span)."""
        views: list[Tensor] = []
        start = 0
        for piece, n in runs:
            views.extend(self.narrow(dim, start, piece * n)._split_run(piece, n, dim))
            start += piece * n
        if count > protocol.MAX_VIEW_RESULTS:
            self._session.conn.synchronize()  # as a long split does: its refusal is this call's
        return tuple(views)

    def _split_run(
        self, piece: builtins.int, n: builtins.int, dim: builtins.int
    ) -> tuple[Tensor, ...]:
        """This tensor as ``n`` parts of ``piece`` along ``dim`` (which it spans exactly)."""
        if piece == 0:
            return self._in_groups(n, 0, dim, lambda t, k: t.chunk(k, dim))
        return self._in_groups(n, piece, dim, lambda t, k: t.split(piece, dim))

    def _strided_views(self, parts: Sequence[Layout]) -> tuple[Tensor, ...]:
        """One as_strided per part; of more parts than one view op may return
        (protocol.MAX_VIEW_RESULTS), each run of that many is waited for, as a long split is."""
        group = protocol.MAX_VIEW_RESULTS
        if len(parts) <= group:
            return tuple(self._strided_view(p) for p in parts)
        views: list[Tensor] = []
        for first in range(0, len(parts), group):
            views.extend(self._strided_view(p) for p in parts[first : first + group])
            self._session.conn.synchronize()
        return tuple(views)

    def _strided_view(self, layout: Layout) -> Tensor:
        """A handle on ``layout`` (computed here by the layout engine) as one as_strided."""
        op = pb.AsStrided(size=layout.shape, stride=layout.stride, storage_offset=layout.offset)
        return self._view(layout, as_strided=op)

    def unfold(self, dimension: builtins.int, size: builtins.int, step: builtins.int) -> Tensor:
        """Returns a view of the original tensor which contains all slices of size ``size`` from
        ``self`` tensor in the dimension ``dimension``.

        Step between two slices is given by ``step``.  A view, no copy: the layout is computed here
        (a bad argument raises torch's error with no round trip), and the server only registers a
        new handle on the same Storage. With pipelining (the default) that op is queued and the call
        does not wait for the server; without it, one View RPC.
        """
        with torch_errors():
            layout = self._meta.layout.unfold(dimension, size, step)
        return self._strided_view(layout)

    def ravel(self) -> Tensor:
        """mirrors ATen ravel: contiguous().view(-1) (a copy when not contiguous)."""
        return self.contiguous().view(-1)

    def chunk(self, chunks: builtins.int, dim: builtins.int = 0) -> tuple[Tensor, ...]:
        """Attempts to split a tensor into the specified number of chunks. Each chunk is a view of
        the input tensor.

        Views, no copy: the layouts are computed here and the server registers the handles in one op
        on the same Storage, queued with pipelining (the default; one View RPC without it).  More
        parts than ``tensord.protocol.MAX_VIEW_RESULTS`` are made in runs of that many, each waited
        for.

        Returns:
            A tuple of tensors.
        """
        count = self._result_count("chunk", (chunks, dim))
        if count > protocol.MAX_VIEW_RESULTS:
            # torch's chunk is a split by ceil(size / chunks); of an empty dim, `chunks` empties
            piece = -(-self.shape[normalize_dim(dim, self.ndim)] // chunks)
            if piece == 0:
                return self._in_groups(count, 0, dim, lambda t, n: t.chunk(n, dim))
            return self._in_groups(count, piece, dim, lambda t, n: t.split(piece, dim))
        with torch_errors():
            parts = self._meta.layout.chunk(chunks, dim)
        return tuple(self._views(parts, chunk=pb.Chunk(chunks=chunks, dim=dim)))

    def unbind(self, dim: builtins.int = 0) -> tuple[Tensor, ...]:
        """Removes a tensor dimension.

        Returns a tuple of all slices along a given dimension, already without it.

        Views, no copy: the layouts are computed here and the server registers the handles in one op
        on the same Storage, queued with pipelining (the default; one View RPC without it).  More
        parts than ``tensord.protocol.MAX_VIEW_RESULTS`` are made in runs of that many, each waited
        for.
        """
        count = self._result_count("unbind", (dim,))
        if count > protocol.MAX_VIEW_RESULTS:
            return self._in_groups(count, 1, dim, lambda t, n: t.unbind(dim))
        with torch_errors():
            parts = self._meta.layout.unbind(dim)
        return tuple(self._views(parts, unbind=pb.Unbind(dim=dim)))

    def _in_groups(
        self,
        count: builtins.int,
        piece: builtins.int,
        dim: builtins.int,
        split: Callable[[Tensor, builtins.int], tuple[Tensor, ...]],
    ) -> tuple[Tensor, ...]:
        """The ``count`` pieces of ``piece`` elements along ``dim`` (the last one may be
        shorter) of a split, chunk or unbind that returns more tensors than one call may
        (protocol.MAX_VIEW_RESULTS): each run of that many is ``split(narrowed, n)`` of this
        tensor narrowed to the run's span, which gives the same layouts as one op would.
        Of several runs each is waited for before the next is built: a refusal of one (past
        ``--max-handles-per-session``) is raised by this call, not by a later one, and a
        count no session could hold stops at the first run past it."""
        size = self.shape[normalize_dim(dim, self.ndim)]
        group = protocol.MAX_VIEW_RESULTS
        pieces: list[Tensor] = []
        for first in range(0, count, group):
            n = min(group, count - first)
            start = min(first * piece, size)
            pieces.extend(split(self.narrow(dim, start, min(n * piece, size - start)), n))
            if count > group:
                self._session.conn.synchronize()
        return tuple(pieces)

    def _result_count(self, name: builtins.str, args: tuple[Any, ...]) -> builtins.int:
        """How many tensors split/chunk/unbind will return, counted before the layout
        engine builds one (``c.zeros(1).expand(10**9).unbind(0)`` builds none up front);
        0 for arguments the layout engine refuses (it raises torch's error next)."""
        count = view_result_count(self._meta.layout, name, args)
        return 0 if count is None else count

    def diagonal(
        self, offset: builtins.int = 0, dim1: builtins.int = 0, dim2: builtins.int = 1
    ) -> Tensor:
        """Returns a partial view of ``self`` with its diagonal elements with respect to
        ``dim1`` and ``dim2`` appended as a dimension at the end of the shape.

        A view, no copy: the layout is computed here (a bad argument raises torch's error with no
        round trip), and the server only registers a new handle on the same Storage. With pipelining
        (the default) that op is queued and the call does not wait for the server; without it, one
        View RPC.
        """
        with torch_errors():
            layout = self._meta.layout.diagonal(offset, dim1, dim2)
        return self._view(layout, diagonal=pb.Diagonal(offset=offset, dim1=dim1, dim2=dim2))

    def as_strided(
        self,
        size: Sequence[builtins.int],
        stride: Sequence[builtins.int],
        storage_offset: builtins.int | None = None,
    ) -> Tensor:
        """Create a view of an existing tensor with specified ``size``, ``stride`` and
        ``storage_offset``.

        The view must stay within the Storage: checked here against the Storage's size (the server
        checks it again).  ``storage_offset`` None keeps this tensor's offset.

        A view, no copy: the layout is computed here (a bad argument raises torch's error with no
        round trip), and the server only registers a new handle on the same Storage. With pipelining
        (the default) that op is queued and the call does not wait for the server; without it, one
        View RPC.
        """
        itemsize = self.dtype.itemsize
        with torch_errors():
            layout = self._meta.layout.as_strided(
                size,
                stride,
                storage_offset,
                storage_elements=self._meta.storage_nbytes // itemsize,
                itemsize=itemsize,
            )
        op = pb.AsStrided(size=list(size), stride=list(stride), storage_offset=storage_offset)
        return self._view(layout, as_strided=op)

    # ---- in-place view ops: this object takes a new handle; other handles are unchanged ----

    def _become(self, other: Tensor) -> Tensor:
        other._owned = None  # the handle is ours now: released with self, not other
        self._adopt(other._meta)
        return self

    def t_(self) -> Tensor:
        """In-place version of ``Tensor.t``.

        This object takes the view's new handle (and releases its old one); other tensors on the
        same Storage keep their layouts, as in torch.  Queued like the view.
        """
        return self._become(self.t())

    def transpose_(self, dim0: builtins.int, dim1: builtins.int) -> Tensor:
        """In-place version of ``Tensor.transpose``.

        This object takes the view's new handle (and releases its old one); other tensors on the
        same Storage keep their layouts, as in torch.  Queued like the view.
        """
        return self._become(self.transpose(dim0, dim1))

    def swapdims_(self, dim0: builtins.int, dim1: builtins.int) -> Tensor:
        """In-place version of ``Tensor.swapdims``.

        This object takes the view's new handle (and releases its old one); other tensors on the
        same Storage keep their layouts, as in torch.  Queued like the view.
        """
        return self._become(self.transpose(dim0, dim1))

    def swapaxes_(self, axis0: builtins.int, axis1: builtins.int) -> Tensor:
        """In-place version of ``Tensor.swapaxes``.

        This object takes the view's new handle (and releases its old one); other tensors on the
        same Storage keep their layouts, as in torch.  Queued like the view.
        """
        return self._become(self.transpose(axis0, axis1))

    def squeeze_(self, dim: Any = None) -> Tensor:
        """In-place version of ``Tensor.squeeze``.

        This object takes the view's new handle (and releases its old one); other tensors on the
        same Storage keep their layouts, as in torch.  Queued like the view.
        """
        return self._become(self.squeeze(dim))

    def unsqueeze_(self, dim: builtins.int) -> Tensor:
        """In-place version of ``Tensor.unsqueeze``.

        This object takes the view's new handle (and releases its old one); other tensors on the
        same Storage keep their layouts, as in torch.  Queued like the view.
        """
        return self._become(self.unsqueeze(dim))

    def as_strided_(
        self,
        size: Sequence[builtins.int],
        stride: Sequence[builtins.int],
        storage_offset: builtins.int | None = None,
    ) -> Tensor:
        """In-place version of ``Tensor.as_strided``.

        This object takes the view's new handle (and releases its old one); other tensors on the
        same Storage keep their layouts, as in torch.  Queued like the view.
        """
        return self._become(self.as_strided(size, stride, storage_offset))

    def detach(self) -> Tensor:
        """Returns a new Tensor, detached from the current graph.

        The result shares this tensor's Storage and has ``requires_grad`` False.  A view, no copy:
        the layout is computed here (a bad argument raises torch's error with no round trip), and
        the server only registers a new handle on the same Storage. With pipelining (the default)
        that op is queued and the call does not wait for the server; without it, one View RPC.
        """
        return self._view(self._meta.layout, detach=pb.Detach())

    def requires_grad_(self, requires_grad: builtins.bool = True) -> Tensor:
        """In place, as torch: this object now carries the flag (the server holds it too).
        Pipelined, a metadata change like a view: queued, under a handle id chosen here."""
        return self._set_requires_grad(pb.SetRequiresGrad(requires_grad=requires_grad))

    def _set_requires_grad(self, op: pb.SetRequiresGrad) -> Tensor:
        if self._session.conn.pipelining:
            differentiable = self.dtype.is_floating_point or self.dtype.is_complex
            if op.requires_grad and not op.by_write and not differentiable:
                raise errors.TensordRuntimeError(  # the server's check (kernels), made here
                    "only Tensors of floating point dtype can require gradients"
                )
            return self._become(self._view(self._meta.layout, set_requires_grad=op))
        (meta,) = self._session.conn.call(
            "View", pb.ViewRequest(handle=self.handle, set_requires_grad=op)
        ).tensors
        self._adopt(Meta.from_pb(meta))
        return self

    def _adopt(self, meta: Meta) -> None:
        # Swap in new metadata; a new handle replaces the old one, which is released.
        if meta.handle != self._meta.handle:
            self._release_now()
            self._owned = meta.handle
            self._session_id = self._session.conn.session_id
        self._meta = meta

    def share(self, uses: int | None = 1, ttl: float | None = None) -> str:
        """A token another session turns into its own handle on this Storage (``attach``).

        By default the first attach consumes it; ``uses=N`` allows N attaches, ``uses=None``
        any number.  It expires after ``ttl`` seconds (None: the server's --share-ttl,
        300 s by default) and ends earlier with ``client.revoke(token)`` or this session.
        """
        if uses is not None and uses < 1:
            raise errors.InvalidArgumentError(f"share(uses=...) must be >= 1 or None, got {uses}")
        request = pb.ShareRequest(
            handle=self.handle,
            uses=0 if uses is None else uses,
            unlimited_uses=uses is None,
            ttl_seconds=0.0 if ttl is None else ttl,
        )
        token: str = self._session.conn.call("Share", request).token
        return token

    # ---- copies and writes on the server ----------------------------------------------

    def _copy_op(self, method: str, request: Any) -> Tensor:
        return wrap(self._client, self._session, self._session.conn.call(method, request))

    def clone(self, *args: Any, **kwargs: Any) -> Tensor:
        """Returns a copy of ``self``.

        A new Storage on the server, filled there: one Clone RPC, which waits for it (and for the
        ops queued before it).  Takes torch's keyword ``memory_format`` (``tensord.preserve_format``
        by default, or ``contiguous_format``, ``channels_last``, ``channels_last_3d``, or torch's
        own objects).
        """
        memory_format = kwargs.pop("memory_format", None)
        no_positional_or_unknown("clone", args, kwargs)
        fmt = (
            PRESERVE_FORMAT if memory_format is None else memory_format_name(memory_format, "clone")
        )
        with torch_errors():
            self._meta.layout.clone_layout(fmt)  # the rank check, before a round trip
        return self._copy_op("Clone", pb.CloneRequest(handle=self.handle, memory_format=fmt))

    def contiguous(self, *args: Any, **kwargs: Any) -> Tensor:
        """torch's x.contiguous(memory_format=...): x itself when already so laid out."""
        fmt = _keyword_memory_format("contiguous", args, kwargs)
        with torch_errors():
            copied = self._meta.layout.contiguous_layout(fmt)
        if copied is None:
            return self  # torch returns self
        if fmt == CONTIGUOUS_FORMAT:
            return self._copy_op("Contiguous", pb.HandleRequest(handle=self.handle))
        # the Contiguous RPC knows one format; a copy in any other is exactly a clone
        return self.clone(memory_format=MemoryFormat(fmt))

    def repeat(self, *sizes: Any) -> Tensor:
        """Repeats this tensor along the specified dimensions.

        The repeats come as ints or one sequence of them.  A new tensor made on the server: one
        Repeat RPC, which waits for it.
        """
        require_args("repeat", "repeats", sizes)
        repeats = shape_args(sizes)
        check_limit(len(repeats), "MAX_DIMS", "repeat() would make a tensor of {} dimensions")
        return self._copy_op("Repeat", pb.RepeatRequest(handle=self.handle, repeats=repeats))

    def to(self, *args: Any, **kwargs: Any) -> Tensor:
        """torch's forms: to(device), to(dtype), to(device, dtype), to(other), copy=True,
        memory_format=..."""
        fmt = _to_memory_format(args, kwargs)
        device, dtype, copy = _parse_to(args, kwargs)
        if fmt == PRESERVE_FORMAT:
            return self._to(device, dtype, copy)
        return self._to_format(device, dtype, copy, fmt)

    def _to_format(self, device: Any, dtype: DType | None, copy: builtins.bool, fmt: str) -> Tensor:
        """to(..., memory_format=fmt) as To then Clone (the To RPC carries no format).

        mirrors ATen to / to_will_alias: x itself when nothing changes and the format
        is the one torch reads off x's strides; else a tensor with fmt's strides.
        """
        layout = self._meta.layout
        same_device = device is None or Device(device_name(device)) == self.device
        same_dtype = dtype is None or dtype is self.dtype
        if same_device and same_dtype and not copy and layout.suggest_memory_format() == fmt:
            return self
        with torch_errors():
            target_stride = memory_format_strides(layout.shape, fmt)
        moved = self._to(device, dtype, copy)
        if moved is not self and moved._meta.layout.stride == target_stride:
            return moved  # To kept the dense strides, which are already fmt's
        return moved.clone(memory_format=MemoryFormat(fmt))

    def _to(self, device: Any, dtype: DType | None, copy: builtins.bool) -> Tensor:
        request = pb.ToRequest(
            handle=self.handle,
            device=device_name(device) if device is not None else "",
            dtype=dtype.name if dtype is not None else "",
            copy=copy,
        )
        meta = self._session.conn.call("To", request)
        if meta.handle == self.handle:
            return self  # nothing changed: torch returns self
        return wrap(self._client, self._session, meta)

    def cpu(self) -> Tensor:
        """Returns a copy of this object in CPU memory.

        The server's CPU memory.  One To RPC, which waits for the server: a copy made there, or
        ``self`` when the tensor is there already (as torch returns it).
        """
        return self.to("cpu")

    def cuda(self, device: Any = None) -> Tensor:
        """Returns a copy of this object in CUDA memory.

        The server's GPU (``device``: an index, ``"cuda:N"`` or a torch.device; None is ``cuda:0``):
        one To RPC, which waits for the server: a copy made there, or ``self`` when the tensor is
        there already.  A server without that GPU raises ``tensord.FailedPreconditionError``.
        """
        return self.to(device_name(0 if device is None else device))

    def type_as(self, other: Tensor) -> Tensor:
        """Returns this tensor cast to the type of the given tensor.

        Equivalent to ``self.to(other.dtype)``. One To RPC, which waits for the server: a copy made
        there, or ``self`` when the tensor has that dtype already (as torch returns it).
        """
        return self.to(other.dtype)

    def copy_(self, src: Any) -> Tensor:
        """Copies the elements from ``src`` into ``self`` tensor and returns ``self``.

        ``src`` broadcasts to ``self``'s shape (checked here first, with torch's text) and may be
        another tensor of this client, a NumPy array, a nested list or a number.  From a tensor the
        copy runs on the server, queued with pipelining (the default; one Copy RPC without it).  An
        array or a list is first uploaded (a call that waits), then copied in the same way; on the
        server's host an array of this tensor's dtype is, where it can be, written straight into the
        server's mapped memory instead.

        Args:
            src: The values to copy in.

        Returns:
            ``self``.
        """
        # torch checks the shapes before any work; the server would too, but a queued
        # (pipelined) copy_ would raise only at the next wait, far from this line
        if isinstance(src, np.ndarray):
            self._check_copy_from(src.shape)
            if _local.write_array(self, self._session.local, self._meta.layout, src):
                return self
        source = src if isinstance(src, Tensor) else self._upload_source(src)
        self._check_copy_from(source.shape)
        handle = own(self._client, source, 0)
        self._write("Copy", pb.CopyRequest(dst=self.handle, src=handle))
        return self._written_from(src)

    def fill_(self, value: Any) -> Tensor:
        """Fills ``self`` tensor with the specified value.

        A write on the server, queued with pipelining (the default; one Fill RPC without it). A
        0-dim tensor ``value`` is read first (a call that waits).

        Args:
            value: A number, or a 0-dim tensor.

        Returns:
            ``self``.
        """
        if isinstance(value, Tensor):
            if value.ndim != 0:
                raise errors.TensordRuntimeError(
                    "fill_ only supports 0-dimension value tensor but got tensor with "
                    f"{value.ndim} dimensions."
                )
            self._write("Fill", pb.FillRequest(handle=self.handle, value=scalar_pb(value.item())))
            return self._written_from(value, any_dtype=True)
        self._write("Fill", pb.FillRequest(handle=self.handle, value=scalar_pb(value)))
        return self

    def zero_(self) -> Tensor:
        """Fills ``self`` tensor with zeros.

        ``fill_(0)``: a write on the server, queued with pipelining (the default).
        """
        return self.fill_(0)

    def _check_copy_from(self, src_shape: Sequence[builtins.int]) -> None:
        """copy_'s TensorIterator check, torch's text: src broadcasts to exactly our shape."""
        with torch_errors():
            copy_broadcast_check(tuple(self.shape), tuple(src_shape))

    def _upload_source(self, data: Any) -> Tensor:
        """``data`` on the server, to be copied in: Python floats go as float64, exactly."""
        source: Tensor = self._client.tensor(data, dtype=exact_dtype(data), device=self.device)
        return source

    def __setitem__(self, key: Any, value: Any) -> None:
        # torch's valueToTensor refuses anything but a tensor or a number, before the key
        check_setitem_value(value, self.dtype, self.device.type)
        if key is False:  # THPVariable_setitem returns at once: no shape check, no write
            return
        self._assign(key, value)

    def _assign(self, key: Any, value: Any) -> None:
        """x[key] = value, where value may also be an array or a list (uploaded first)."""
        key = plain_index(key)
        items = plain_index(_indexing.key_items(key, _is_tensor))
        if _indexing.is_advanced(items, _is_tensor):
            self._advanced_put(items, value)
            return
        with torch_errors():
            target = self._meta.layout[key]
        request = pb.SetItemRequest(handle=self.handle, index=index_items(key))
        if isinstance(value, Tensor):
            check_setitem_shape(target, value.shape, value.dtype)
            request.src_handle = own(self._client, value, 0)
        elif _is_number(value):
            request.scalar.CopyFrom(scalar_pb(value))
        elif isinstance(value, np.ndarray) and _local.write_array(
            self, self._session.local, self._meta.layout[key], value, setitem=True
        ):
            return  # written through the mapping, one memcpy
        else:  # an array or nested list: uploaded first, then copied in on the server
            source = self._upload_source(value)
            check_setitem_shape(target, source.shape, source.dtype)
            request.src_handle = source.handle
        self._write("SetItem", request)
        self._written_from(value)

    def _written_from(self, value: Any, any_dtype: builtins.bool = False) -> Tensor:
        """After an in-place write of ``value``: torch's autograd makes the written tensor
        require grad once a value that did was written into it: copy_ and setitem only
        into a dtype that can carry gradients (an integer x stays as it was), fill_ into
        any (``any_dtype``).  The flag only, on this tensor: no graph here, and other views
        of the Storage (torch's view base) keep theirs."""
        if not isinstance(value, Tensor) or not value.requires_grad or self.requires_grad:
            return self
        if any_dtype or self.dtype.is_floating_point or self.dtype.is_complex:
            self._set_requires_grad(pb.SetRequiresGrad(requires_grad=True, by_write=True))
        return self

    def _write(self, method: str, request: Any) -> None:
        """An in-place write: queued with pipelining (its result is this tensor), else one RPC."""
        conn = self._session.conn
        if not conn.pipelining:
            conn.call(method, request)
            return
        field = {"Copy": "copy", "Fill": "fill", "SetItem": "set_item"}[method]
        what = {"Copy": "copy_", "Fill": "fill_", "SetItem": "__setitem__"}[method]
        conn.enqueue(field, what, self._meta.handle, request)

    # ---- bytes to Python ----------------------------------------------------------------

    def _download(self) -> np.ndarray:
        """The elements in logical order, as a new NumPy array (any device)."""
        np_dtype = dtypes.to_numpy_dtype(self.dtype)
        fast = _local.read_array(self, self._session.local, self._meta.layout)
        if fast is not None:  # the stored values: a new array, made values in place
            if self._meta.conj:
                np.conjugate(fast, out=fast)
            if self._meta.neg:
                np.negative(fast, out=fast)
            return fast
        out = np.empty(self.nbytes, dtype=np.uint8)
        if self.nbytes:
            self._session.conn.download_into(self.handle, out.data)
        return out.view(np_dtype).reshape(self.shape)

    def numpy(self, *, force: builtins.bool = False) -> np.ndarray:
        """Returns the tensor as a NumPy ``ndarray``.

        Unlike torch's, the array is always a new copy of the elements and never shares memory with
        the tensor: writes to it do not reach the server (use ``x.copy_(array)``, or
        ``np.asarray(x, copy=False)`` or DLPack for a same-host alias).  The bytes come from the
        server (a gRPC download, or one copy out of the server's mapped memory on the same host);
        the call waits for the ops queued before it.

        Args:
            force: Skip the checks below and download anyway (any device; the lazy conjugate
                and negative bits are applied to the copy).

        Raises:
            RuntimeError: ``self`` requires grad, or has its conjugate or negative bit set
                (torch's texts), unless ``force``.
            TypeError: ``self`` is not on the CPU, unless ``force``.
        """
        if not force and self.requires_grad:
            raise errors.TensordRuntimeError(
                "Can't call numpy() on Tensor that requires grad. Use tensor.detach().numpy() instead."
            )
        if not force and self.device.type != "cpu":
            raise errors.TensordTypeError(
                f"can't convert {self.device} device type tensor to numpy. Use Tensor.cpu() to "
                "copy the tensor to host memory first."
            )
        if not force and self._meta.conj:
            raise errors.TensordRuntimeError(
                "Can't call numpy() on Tensor that has conjugate bit set. Use "
                "tensor.resolve_conj().numpy() instead."
            )
        if not force and self._meta.neg:
            raise errors.TensordRuntimeError(
                "Can't call numpy() on Tensor that has negative bit set. Use "
                "tensor.resolve_neg().numpy() instead."
            )
        return self._download()

    # ---- same-host zero copy: DLPack (tensord._dlpack) -----------------------------------

    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: tuple[builtins.int, builtins.int] | None = None,
        dl_device: tuple[builtins.int, builtins.int] | None = None,
        copy: builtins.bool | None = None,
    ) -> Any:
        """A DLPack capsule aliasing the pooled bytes (same host only; BufferError otherwise)."""
        return _dlpack.to_dlpack(
            self,
            self._session,
            self._meta.layout,
            stream=stream,
            max_version=max_version,
            dl_device=dl_device,
            copy=copy,
        )

    def __dlpack_device__(self) -> tuple[builtins.int, builtins.int]:
        return _dlpack.dlpack_device(self)

    def __array__(self, dtype: Any = None, copy: builtins.bool | None = None) -> np.ndarray:
        """NumPy's conversion protocol: a copy (``np.array``, ``np.asarray``), or with
        ``copy=False`` (``np.asarray(x, copy=False)``) an array aliasing the pooled bytes on
        the same host, and NumPy's ValueError where that is impossible (never a silent copy)."""
        if copy is False:
            return self._numpy_alias(dtype)
        array = self.numpy()
        return array if dtype is None else array.astype(dtype, copy=False)

    def _numpy_alias(self, dtype: Any) -> np.ndarray:
        """The same-host alias of x's elements (no copy), or NumPy's ValueError (torch's type
        for every ``copy=False``) with the reason, numpy()'s refusals included."""
        if self.requires_grad or self.device.type != "cpu" or self._meta.conj or self._meta.neg:
            try:
                self.numpy()  # raises numpy()'s own error for each of these
            except (RuntimeError, TypeError) as refusal:
                raise ValueError(f"{_NO_COPY_AVOIDED} ({refusal})") from refusal
        np_dtype = dtypes.to_numpy_dtype(self.dtype)
        if dtype is not None and np.dtype(dtype) != np_dtype:
            raise ValueError(
                f"{_NO_COPY_AVOIDED} (a {self.dtype} tensor as {np.dtype(dtype)} needs a cast)"
            )
        array = self._session.local_array(
            self.handle, self._meta.layout, np_dtype, self.untyped_storage().storage_id
        )
        if array is None:
            raise ValueError(f"{_NO_COPY_AVOIDED} (no zero-copy: {self._session.local_reason()})")
        return array

    def tolist(self) -> Any:
        """Returns the tensor as a (nested) list.

        For scalars, a standard Python number is returned, just like with ``item()``. Tensors on any
        device are read.  The bytes come from the server (a gRPC download, or one copy out of the
        server's mapped memory on the same host); the call waits for the ops queued before it.
        """
        return _python_values(self._download(), self.dtype).tolist()

    def item(self) -> Number:
        """Returns the value of this tensor as a standard Python number.

        This only works for tensors with one element.  The bytes come from the server (a gRPC
        download, or one copy out of the server's mapped memory on the same host); the call waits
        for the ops queued before it.

        Raises:
            RuntimeError: the tensor does not have exactly one element.
        """
        if self.numel() != 1:
            raise errors.TensordRuntimeError(
                f"a Tensor with {self.numel()} elements cannot be converted to Scalar"
            )
        value: Number = _python_values(self._download(), self.dtype).reshape(()).item()
        return value

    def __bool__(self) -> builtins.bool:
        if self.numel() != 1:
            raise errors.TensordRuntimeError(
                "Boolean value of Tensor with more than one value is ambiguous"
                if self.numel() > 1
                else "Boolean value of Tensor with no values is ambiguous"
            )
        return builtins.bool(self.item())

    def __int__(self) -> builtins.int:
        return builtins.int(self.item().real)

    def __float__(self) -> builtins.float:
        return builtins.float(self.item().real)

    def __index__(self) -> builtins.int:
        if self.dtype.is_floating_point or self.dtype.is_complex or self.numel() != 1:
            raise errors.TensordTypeError(
                "only integer tensors of a single element can be converted to an index"
            )
        return builtins.int(self.item().real)

    def __format__(self, format_spec: str) -> str:
        # torch formats a 0-dim tensor as its number: f"{loss:.3f}"
        if self.ndim == 0:
            return format(self.item(), format_spec)
        return object.__format__(self, format_spec)

    def __iter__(self) -> Iterator[Tensor]:
        if self.ndim == 0:
            raise errors.TensordTypeError("iteration over a 0-d tensor")
        return iter(self.unbind(0))

    def __repr__(self) -> str:
        if self._client.closed:
            return f"<tensord.Tensor {self._meta.handle} of a closed client>"
        if not self._session.conn.holds_session(self._session_id):
            return f"<tensord.Tensor {self._meta.handle} of a lost or inherited session>"
        shape = tuple(self.shape)
        values = self._edge_values() if _format.summarize(shape) else self._download()
        return _format.tensor_repr(values, shape, self.dtype, self.device, self.requires_grad)

    def _edge_values(self, dim: builtins.int = 0) -> np.ndarray:
        # Only the head and tail of each long dim, as torch's summary shows them.
        if dim == self.ndim:
            return self._download()
        parts = [
            self.narrow(dim, s.start, s.stop - s.start)._edge_values(dim + 1)
            for s in _format.edge_index(self.shape[dim])
        ]
        return np.concatenate(parts, axis=dim) if len(parts) > 1 else parts[0]

    # ---- dtype conversions: to(dtype) ---------------------------------------------------

    def double(self) -> Tensor:
        """``self.double()`` is equivalent to ``self.to(tensord.float64)``.

        One To RPC, which waits for the server: a copy made there, or ``self`` when the tensor has
        that dtype already (as torch returns it).
        """
        return self.to(dtypes.float64)

    def half(self) -> Tensor:
        """``self.half()`` is equivalent to ``self.to(tensord.float16)``.

        One To RPC, which waits for the server: a copy made there, or ``self`` when the tensor has
        that dtype already (as torch returns it).
        """
        return self.to(dtypes.float16)

    def bfloat16(self) -> Tensor:
        """``self.bfloat16()`` is equivalent to ``self.to(tensord.bfloat16)``.

        One To RPC, which waits for the server: a copy made there, or ``self`` when the tensor has
        that dtype already (as torch returns it).
        """
        return self.to(dtypes.bfloat16)

    def long(self) -> Tensor:
        """``self.long()`` is equivalent to ``self.to(tensord.int64)``.

        One To RPC, which waits for the server: a copy made there, or ``self`` when the tensor has
        that dtype already (as torch returns it).
        """
        return self.to(dtypes.int64)

    def short(self) -> Tensor:
        """``self.short()`` is equivalent to ``self.to(tensord.int16)``.

        One To RPC, which waits for the server: a copy made there, or ``self`` when the tensor has
        that dtype already (as torch returns it).
        """
        return self.to(dtypes.int16)

    def byte(self) -> Tensor:
        """``self.byte()`` is equivalent to ``self.to(tensord.uint8)``.

        One To RPC, which waits for the server: a copy made there, or ``self`` when the tensor has
        that dtype already (as torch returns it).
        """
        return self.to(dtypes.uint8)

    def char(self) -> Tensor:
        """``self.char()`` is equivalent to ``self.to(tensord.int8)``.

        One To RPC, which waits for the server: a copy made there, or ``self`` when the tensor has
        that dtype already (as torch returns it).
        """
        return self.to(dtypes.int8)

    def cfloat(self) -> Tensor:
        """``self.cfloat()`` is equivalent to ``self.to(tensord.complex64)``.

        One To RPC, which waits for the server: a copy made there, or ``self`` when the tensor has
        that dtype already (as torch returns it).
        """
        return self.to(dtypes.complex64)

    def cdouble(self) -> Tensor:
        """``self.cdouble()`` is equivalent to ``self.to(tensord.complex128)``.

        One To RPC, which waits for the server: a copy made there, or ``self`` when the tensor has
        that dtype already (as torch returns it).
        """
        return self.to(dtypes.complex128)

    # ---- advanced indexing (a gather or scatter on the server) -------------------------

    def _index_handle(self, item: Any, keep: list[Tensor]) -> str:
        """An index item's handle: a tensor of this client as it is, anything else (a list,
        an array, a torch tensor) uploaded first onto this tensor's device."""
        if isinstance(item, Tensor):
            return own(self._client, item, 0)
        data = item.detach().cpu().numpy() if _is_tensor(item) else _indexing.index_data(item)
        uploaded: Tensor = self._client.tensor(data, device=self.device)
        keep.append(uploaded)  # alive until the call is answered
        return uploaded.handle

    def _advanced_items(
        self, items: tuple[Any, ...], keep: list[Tensor]
    ) -> list[pb.AdvancedIndexItem]:
        return _indexing.advanced_items(
            items, _is_tensor, lambda item: self._index_handle(item, keep)
        )

    def _advanced_index(
        self, items: tuple[Any, ...], raw: builtins.bool = False, op: str = ""
    ) -> Tensor:
        keep: list[Tensor] = []
        request = pb.AdvancedIndexRequest(
            handle=self.handle, index=self._advanced_items(items, keep), raw=raw, op=op
        )
        return wrap(self._client, self._session, self._session.conn.call("AdvancedIndex", request))

    def _advanced_put(
        self,
        items: tuple[Any, ...],
        value: Any,
        raw: builtins.bool = False,
        accumulate: builtins.bool = False,
        value_requires_grad: builtins.bool = False,
    ) -> None:
        keep: list[Tensor] = []
        request = pb.AdvancedSetItemRequest(
            handle=self.handle,
            index=self._advanced_items(items, keep),
            raw=raw,
            accumulate=accumulate,
            value_requires_grad=value_requires_grad,
        )
        if isinstance(value, Tensor):
            request.src_handle = own(self._client, value, 0)
        elif _is_number(value):
            request.scalar.CopyFrom(scalar_pb(value))
        else:  # a torch tensor keeps its dtype; an array or list takes this tensor's
            dtype = None if _is_tensor(value) else self.dtype
            source: Tensor = self._client.tensor(value, dtype=dtype, device=self.device)
            keep.append(source)
            request.src_handle = source.handle
        # the handle's metadata after the write: it requires grad once a value did
        self._adopt(Meta.from_pb(self._session.conn.call("AdvancedSetItem", request)))

    def index_select(self, dim: builtins.int, index: Tensor) -> Tensor:
        """torch.index_select: a copy of the rows ``index`` names along ``dim``."""
        own(self._client, index, 1)
        # mirrors index_select_out_cpu_'s checks, in its order
        with torch_errors():
            dim = normalize_dim(dim, self.ndim)
        if index.ndim > 1:
            raise errors.TensordIndexError("index_select(): Index is supposed to be a vector")
        if self.ndim == 0 and index.numel() != 1:
            raise errors.TensordRuntimeError(
                "index_select(): Index to scalar can have only 1 value, got "
                f"{index.numel()} value(s)"
            )
        if index.dtype not in (dtypes.int64, dtypes.int32):
            raise errors.TensordRuntimeError(
                "index_select(): Expected dtype int32 or int64 for index"
            )
        if self.ndim == 0:
            picked = self.view(1)._advanced_index((index.view(1),), raw=True, op="index_select")
            return picked.view(())
        vector = index.view(1) if index.ndim == 0 else index
        return self._advanced_index((None,) * dim + (vector,), raw=True, op="index_select")

    def masked_select(self, mask: Tensor) -> Tensor:
        """torch.masked_select: the elements where ``mask`` (broadcast with self) is True, 1-D."""
        own(self._client, mask, 1)
        if mask.dtype is not dtypes.bool:
            raise errors.TensordRuntimeError("masked_select: expected BoolTensor for mask")
        with torch_errors():
            shape = _indexing.infer_size(mask.shape, self.shape)
        if self.dtype in dtypes.BAREBONES_UNSIGNED:  # torch 2.13 has no kernel for them
            raise errors.TensordNotImplementedError(
                f"\"masked_select\" not implemented for '{self.dtype.scalar_type}'"
            )
        return self.expand(shape)._advanced_index((mask.expand(shape),))

    def masked_fill_(self, mask: Tensor, value: Any) -> Tensor:
        """torch's masked_fill_: ``value`` (a number or a 0-dim tensor) where ``mask`` is True."""
        own(self._client, mask, 1)
        value_requires_grad = False
        if _is_tensor(value):  # masked_fill__cpu checks the value, then the mask
            if value.ndim != 0:
                raise errors.TensordRuntimeError(
                    "masked_fill_ only supports a 0-dimensional value tensor, but got tensor "
                    f"with {value.ndim} dimension(s)."
                )
            # torch's autograd: x requires grad after the fill when the value did
            value_requires_grad = builtins.bool(value.requires_grad)
            value = value.item()
        if mask.dtype is not dtypes.bool:
            name = dtypes.TYPE_META_NAMES.get(mask.dtype.name, mask.dtype.name)
            raise errors.TensordRuntimeError(
                f"masked_fill_ only supports boolean masks, but got mask with dtype {name}"
            )
        with torch_errors():
            shape = _indexing.infer_size(self.shape, mask.shape)
        if shape != tuple(self.shape):
            raise errors.TensordRuntimeError(
                f"output with shape {list(self.shape)} doesn't match the broadcast shape "
                f"{list(shape)}"
            )
        self._advanced_put(
            (mask.expand(self.shape),), value, value_requires_grad=value_requires_grad
        )
        return self

    def index_put_(self, indices: Any, values: Tensor, accumulate: builtins.bool = False) -> Tensor:
        """torch's index_put_: ``self[indices] = values`` (``+=`` with accumulate), where
        ``indices`` is a tuple of index tensors (aten's list: no slicing rules apply)."""
        items = tuple(indices)
        for position, item in enumerate(items):
            own(self._client, item, position)
        own(self._client, values, 1)
        self._advanced_put(items, values, raw=True, accumulate=accumulate)
        return self

    # ---- resize, set_: this handle changes in place; others keep their layout ----

    def is_same_size(self, other: Any) -> builtins.bool:
        """Returns True if ``other`` has the same size as ``self``.

        ``other`` may be a tensord or a torch tensor. Metadata the SDK keeps: no RPC.

        Raises:
            TypeError: ``other`` is not a tensor (torch's text).
        """
        _check_tensor_argument("is_same_size", "other", other)
        return tuple(self.shape) == tuple(other.shape)

    def is_set_to(self, tensor: Any) -> builtins.bool:
        """torch's is_set_to: the same Storage, offset, sizes and strides (any dtype)."""
        _check_tensor_argument("is_set_to", "tensor", tensor)
        if not isinstance(tensor, Tensor):
            return False  # a torch tensor never shares a tensord Storage
        mine, theirs = self._meta.layout, tensor._meta.layout
        return self._meta.storage_id == tensor._meta.storage_id and (
            mine.offset,
            mine.shape,
            mine.stride,
        ) == (theirs.offset, theirs.shape, theirs.stride)

    def resize_(self, *sizes: Any, memory_format: Any = None) -> Tensor:
        """torch's resize_: contiguous at the same offset (the layout kept when the size is);
        a Storage too small grows, seen by every handle on it."""
        size = _resize_size(sizes)
        check_limit(len(size), "MAX_DIMS", "resize_() would make a tensor of {} dimensions")
        fmt = "" if memory_format is None else memory_format_name(memory_format, "resize_")
        request = pb.ResizeRequest(handle=self.handle, size=size, memory_format=fmt)
        self._adopt(Meta.from_pb(self._session.conn.call("Resize", request)))
        return self

    def resize_as_(self, the_template: Any, memory_format: Any = None) -> Tensor:
        """Resizes the ``self`` tensor to be the same size as the specified ``the_template``.

        This is equivalent to ``self.resize_(the_template.size())``; a ``memory_format`` of
        ``preserve_format`` takes the template's own format.  One Resize RPC (see ``resize_``).

        Args:
            the_template: The tensor whose size ``self`` takes (a tensord or torch tensor).
            memory_format: The result's memory format; None: contiguous.
        """
        _check_tensor_argument("resize_as_", "the_template", the_template)
        if memory_format is None:
            return self.resize_(tuple(the_template.shape))
        fmt = memory_format_name(memory_format, "resize_as_")
        if fmt == PRESERVE_FORMAT:  # torch: the template's own format
            template = Layout(tuple(the_template.shape), tuple(the_template.stride()))
            fmt = template.suggest_memory_format()
        return self.resize_(tuple(the_template.shape), memory_format=MemoryFormat(fmt))

    def set_(
        self,
        source: Any = _UNSET,
        storage_offset: Any = _UNSET,
        size: Any = _UNSET,
        stride: Any = _UNSET,
    ) -> Tensor:
        """torch's set_(), set_(tensor), set_(storage) and both with
        (storage_offset, size, stride=None): this handle views the source's Storage."""
        request = _set_request(self.handle, source, storage_offset, size, stride)
        if request.source:
            own(self._client, source if isinstance(source, Tensor) else source._tensor, 0)
        self._adopt(Meta.from_pb(self._session.conn.call("SetStorage", request)))
        return self

    # Last in the class body: these names shadow the built-ins below them.
    def float(self) -> Tensor:
        """``self.float()`` is equivalent to ``self.to(tensord.float32)``.

        One To RPC, which waits for the server: a copy made there, or ``self`` when the tensor has
        that dtype already (as torch returns it).
        """
        return self.to(dtypes.float32)

    def int(self) -> Tensor:
        """``self.int()`` is equivalent to ``self.to(tensord.int32)``.

        One To RPC, which waits for the server: a copy made there, or ``self`` when the tensor has
        that dtype already (as torch returns it).
        """
        return self.to(dtypes.int32)

    def bool(self) -> Tensor:
        """``self.bool()`` is equivalent to ``self.to(tensord.bool)``.

        One To RPC, which waits for the server: a copy made there, or ``self`` when the tensor has
        that dtype already (as torch returns it).
        """
        return self.to(dtypes.bool)


def complex_function(name: builtins.str, input: Any) -> Tensor:
    """torch.view_as_real / torch.view_as_complex (no Tensor methods in torch): the complex
    view of ``input``, after torch's argument check."""
    if not isinstance(input, Tensor):
        raise errors.TensordTypeError(
            f"{name}(): argument 'input' (position 1) must be Tensor, not {type(input).__name__}"
        )
    return input._complex_view(name)


_T_DEPRECATED = (
    "The use of `x.T` on tensors of dimension other than 2 to reverse their shape is deprecated "
    "and it will throw an error in a future release. Consider `x.mT` to transpose batches of "
    "matrices or `x.permute(*torch.arange(x.ndim - 1, -1, -1))` to reverse the dimensions of a "
    "tensor."
)
_IDENTITY_0D = "{} is deprecated on 0-D tensors. This function is the identity in these cases."
_CONJ_0D = "{} is deprecated on 0-D tensors. Consider using x.conj()."
_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    """A UserWarning, once per process, as torch's TORCH_WARN_ONCE."""
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, UserWarning, stacklevel=3)


def _is_tensor(value: Any) -> builtins.bool:
    torch = sys.modules.get("torch")
    return isinstance(value, Tensor) or (torch is not None and isinstance(value, torch.Tensor))


def _dtype_of(value: Any) -> DType:
    return value.dtype if isinstance(value, Tensor) else dtypes.from_torch(value.dtype)


def _is_integral(dtype: DType) -> builtins.bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype is dtypes.bool)


def _narrow_start(start: Any) -> builtins.int:
    """narrow's Tensor start: a 0-dim integral tensor (its value).  mirrors ATen narrow_tensor."""
    if start.ndim != 0 or not _is_integral(_dtype_of(start)):
        raise errors.TensordRuntimeError("start must be an 0-dim integral Tensor.")
    return builtins.int(start.item())


# The sections one Split may list (Split.sections is an IntList, each at most this long).
_MAX_SECTIONS = protocol.list_limit("IntList", "values")


def _split_arg(value: Any, ndim: builtins.int) -> Any:
    """tensor_split's indices_or_sections as an int or a tuple of ints.  A tensor must be a
    long 0-dim (sections) or 1-dim (indices) tensor on the CPU; mirrors ATen tensor_split's
    checks and their order."""
    if isinstance(value, (builtins.int, np.integer)) and not isinstance(value, builtins.bool):
        return operator.index(value)
    if not _is_tensor(value):
        return _ints(value)
    if ndim == 0:
        raise errors.TensordRuntimeError(
            "tensor_split expected at least a 1-dimensional tensor, but got a tensor with 0 dims"
        )
    device = device_name(value.device)
    if device != "cpu":
        raise errors.TensordRuntimeError(
            f"tensor_split expected tensor_indices_or_sections to be on cpu, but it's on {device}"
        )
    dtype = _dtype_of(value)
    if dtype is not dtypes.int64:
        raise errors.TensordRuntimeError(
            "tensor_split expected tensor_indices_or_sections to have dtype of long, but got "
            f"{dtype.scalar_type}"
        )
    if value.ndim not in (0, 1):
        raise errors.TensordRuntimeError(
            "tensor_split expected tensor_indices_or_sections to be a zero-dimensional or "
            f"one-dimensional tensor, but got a tensor with {value.ndim} dims"
        )
    values = value.tolist()
    return builtins.int(values) if value.ndim == 0 else tuple(builtins.int(v) for v in values)


def _python_values(values: np.ndarray, dtype: DType) -> np.ndarray:
    # bfloat16 is an ml_dtypes scalar type; tolist()/item() should give Python floats.
    return values.astype(np.float32) if dtype is dtypes.bfloat16 else values


def _keyword_memory_format(function: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """is_contiguous/contiguous: only the keyword memory_format (contiguous_format by
    default; torch refuses None there, unlike clone's)."""
    memory_format = kwargs.pop("memory_format", _DEFAULT)
    no_positional_or_unknown(function, args, kwargs)
    if memory_format is _DEFAULT:
        return CONTIGUOUS_FORMAT
    return memory_format_name(memory_format, function)


_DEFAULT = object()  # "no memory_format given", which None is not for these methods


# torch.Tensor.to's overloads: their positional and keyword parameters, and their text
_TO_OVERLOADS = (
    (4, ("device", "dtype", "non_blocking", "copy", "memory_format")),
    (3, ("dtype", "non_blocking", "copy", "memory_format")),
    (3, ("tensor", "non_blocking", "copy", "memory_format")),
)
_TO_SIGNATURES = (
    " * (torch.device device = None, torch.dtype dtype = None, bool non_blocking = False, "
    "bool copy = False, *, torch.memory_format memory_format = None)\n"
    " * (torch.dtype dtype, bool non_blocking = False, bool copy = False, *, "
    "torch.memory_format memory_format = None)\n"
    " * (Tensor tensor, bool non_blocking = False, bool copy = False, *, "
    "torch.memory_format memory_format = None)\n"
)


def _to_memory_format(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """to()'s memory_format keyword (None: preserve_format), popped from kwargs.

    A value that is no memory format gets torch's argument parser's text: the one
    overload's complaint when only one could take these arguments, else the list.
    """
    memory_format = kwargs.get("memory_format")
    if memory_format is None or is_memory_format(memory_format):
        kwargs.pop("memory_format", None)
        return PRESERVE_FORMAT if memory_format is None else memory_format_name(memory_format, "to")
    plausible = [
        names
        for max_positional, names in _TO_OVERLOADS
        if len(args) <= max_positional and all(k in names for k in kwargs)
    ]
    if len(plausible) == 1:
        memory_format_name(memory_format, "to")  # raises
    given = [python_type_name(a) for a in args]
    # torch lists the keywords in its hash map's order; for one keyword that is no matter
    given += [f"{k}={python_type_name(v)}" for k, v in kwargs.items()]
    described = ", ".join(given) + (", " if not args else "")
    raise errors.TensordTypeError(
        f"to() received an invalid combination of arguments - got ({described}), but "
        f"expected one of:\n{_TO_SIGNATURES}"
    )


def _parse_to(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, DType | None, builtins.bool]:
    """torch.Tensor.to's overloads -> (device or None, dtype or None, copy): the first
    overload whose parameters take the arguments' types, else torch's TypeError."""
    if len(args) > 4:
        raise errors.TensordTypeError(
            f"to() takes from 0 to 4 positional arguments but {len(args)} were given"
        )
    for _, names in _TO_OVERLOADS:
        bound = _bind_to(names[:-1], args, kwargs)  # memory_format is read before
        if bound is not None:
            break
    else:
        raise _to_invalid_combination(args, kwargs)
    other = bound.get("tensor")
    if other is not None:
        return other.device, other.dtype, builtins.bool(bound.get("copy", False))
    device, dtype = bound.get("device"), bound.get("dtype")
    if device is not None:
        device_name(device)  # a malformed device string: torch's RuntimeError, here
    copy = builtins.bool(bound.get("copy", False))
    return device, (as_dtype(dtype) if dtype is not None else None), copy


def _bind_to(
    names: tuple[str, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any] | None:
    """The arguments bound to one of to()'s overloads, None where it does not take them:
    a parameter's type checked as torch's argument parser checks it (None for the optional
    device and dtype)."""
    if len(args) > len(names) or any(k not in names[len(args) :] for k in kwargs):
        return None
    bound = dict(zip(names, args, strict=False)) | kwargs
    if names[0] != "device" and names[0] not in bound:  # the 2nd and 3rd overloads' first
        return None
    for name, value in bound.items():
        if not _TO_PARAMETER_TAKES[name](value):
            return None
    return bound


def _takes_device(value: Any) -> builtins.bool:
    torch = sys.modules.get("torch")
    return (
        value is None
        or isinstance(value, (str, np.integer))
        or (isinstance(value, builtins.int) and not isinstance(value, builtins.bool))
        or (torch is not None and isinstance(value, torch.device))
    )


_TO_PARAMETER_TAKES: dict[str, Callable[[Any], builtins.bool]] = {
    "device": _takes_device,
    "dtype": lambda value: value is None or _is_dtype(value),
    "tensor": lambda value: isinstance(value, Tensor),
    "non_blocking": lambda value: isinstance(value, (builtins.bool, np.bool_)),
    "copy": lambda value: isinstance(value, (builtins.bool, np.bool_)),
}


def _parser_type_name(value: Any) -> str:
    """A value's type as torch's parser names it; tensord's dtypes and devices stand for torch's."""
    if isinstance(value, DType):
        return "torch.dtype"
    if isinstance(value, Device):
        return "torch.device"
    return "Tensor" if isinstance(value, Tensor) else python_type_name(value)


def _to_invalid_combination(args: tuple[Any, ...], kwargs: dict[str, Any]) -> TypeError:
    """torch's text for to() arguments no overload takes (its _argDesc: a trailing ", "
    is cut only after positional arguments)."""
    given = "".join(f"{_parser_type_name(a)}, " for a in args)
    given += "".join(f"{k}={_parser_type_name(v)}, " for k, v in kwargs.items())
    if args:
        given = given[:-2]
    return errors.TensordTypeError(
        f"to() received an invalid combination of arguments - got ({given}), but "
        f"expected one of:\n{_TO_SIGNATURES}"
    )


# ---- what the client and the same-host paths need of tensors ------------------------------


# Pipelined views' handle ids: 16 random bytes each (the server's own format), drawn from
# the OS this many at a time: one getrandom per view cost more than the rest of the view.
_IDS_PER_DRAW = 256
_random_ids: collections.deque[str] = collections.deque()
# a fork child draws its own ids: the parent's would name the parent's next views
os.register_at_fork(after_in_child=_random_ids.clear)


# x[i]'s Index message for the small ints (read only: the flush copies it into its op)
_INT_INDEXES: dict[builtins.int, pb.Index] = {}
_INT_INDEX_CACHED = 1 << 12


def _int_index(key: builtins.int) -> pb.Index:
    index = _INT_INDEXES.get(key)
    if index is None:
        index = pb.Index(items=(pb.IndexItem(integer=key),))
        if -_INT_INDEX_CACHED <= key < _INT_INDEX_CACHED:
            _INT_INDEXES[key] = index
    return index


def _narrowing_index(key: Any, shape: tuple[builtins.int, ...]) -> builtins.bool:
    """Whether a valid basic index only selects and narrows (ints, one Ellipsis, slices of
    step 1 whose bounds are within the largest size): no new dim (None), no stride
    multiplied by a step, no number past the server's request bounds; its view may be
    elided."""
    items = key if isinstance(key, tuple) else (key,)
    largest = max(shape, default=0)

    def within(bound: Any) -> builtins.bool:
        return bound is None or (type(bound) is builtins.int and -largest <= bound <= largest)

    return sum(item is Ellipsis for item in items) <= 1 and all(
        type(item) is builtins.int
        or item is Ellipsis
        or (
            isinstance(item, slice)
            and item.step in (None, 1)
            and within(item.start)
            and within(item.stop)
        )
        for item in items
    )


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


def wrap(client: SessionClient, session: ClientSession, meta: pb.TensorMeta) -> Tensor:
    """A handle of ``client`` on the tensor the server described in ``meta``."""
    return Tensor(client, session, Meta.from_pb(meta))


def own(client: SessionClient, tensor: Any, position: int) -> str:
    """``tensor``'s handle, once it is a Tensor of ``client`` (torch's error texts)."""
    if not isinstance(tensor, Tensor):
        raise errors.TensordTypeError(
            f"expected Tensor as element {position} in argument 0, but got {type(tensor).__name__}"
        )
    if tensor.client is not client:
        raise errors.InvalidArgumentError(
            f"tensor {position} belongs to another tensord client ({tensor.client.address})"
        )
    return tensor.handle


def _check_tensor_argument(method: str, name: str, value: Any) -> None:
    if not _is_tensor(value):
        raise errors.TensordTypeError(
            f"{method}(): argument '{name}' (position 1) must be Tensor, not "
            f"{python_type_name(value)}"
        )


def _resize_size(sizes: tuple[Any, ...]) -> list[builtins.int]:
    """resize_'s size argument as torch's parser reads it: ints, or one sequence of them
    (a 0-dim integer tensor counts as an int)."""
    if not sizes:
        raise errors.TensordTypeError('resize_() missing 1 required positional arguments: "size"')
    one = sizes[0]
    sequence = isinstance(one, Sequence) and not isinstance(one, str)
    if len(sizes) == 1 and not sequence and _as_size_int(one) is None:
        raise errors.TensordTypeError(
            "resize_(): argument 'size' (position 1) must be tuple of ints, not "
            f"{python_type_name(one)}"
        )
    values = one if len(sizes) == 1 and isinstance(one, Sequence) else sizes
    out = []
    for position, value in enumerate(values):
        number = _as_size_int(value)
        if number is None:
            raise errors.TensordTypeError(
                f"resize_(): argument 'size' failed to unpack the object at pos {position + 1} "
                f'with error "type must be tuple of ints,but got {python_type_name(value)}"'
            )
        out.append(number)
    return out


def _as_size_int(value: Any) -> builtins.int | None:
    if _is_int_like(value):
        return builtins.int(value)
    if isinstance(value, Tensor) and value.ndim == 0 and _is_integral(value.dtype):
        return operator.index(value)
    return None


_SET_OVERLOADS = (
    " * ()\n"
    " * (torch.Storage source)\n"
    " * (torch.Storage source, int storage_offset, tuple of ints size, tuple of ints stride = None)\n"
    " * (Tensor source)\n"
    " * (Tensor source, int storage_offset, tuple of ints size, tuple of ints stride = None)\n"
)


def _set_request(
    handle: str, source: Any, storage_offset: Any, size: Any, stride: Any
) -> pb.SetStorageRequest:
    """set_'s overloads, as torch's parser picks one (its TypeError when none fits)."""
    given = [a for a in (source, storage_offset, size, stride) if a is not _UNSET]
    source, storage_offset, size, stride = (
        None if a is _UNSET else a for a in (source, storage_offset, size, stride)
    )
    is_storage = isinstance(source, UntypedStorage) and source._tensor is not None
    fits = not given
    if isinstance(source, Tensor) or is_storage:
        fits = (storage_offset is None and size is None and stride is None) or (
            _is_int_like(storage_offset)
            and _is_int_list(size)
            and (stride is None or _is_int_list(stride))
        )
    if not fits:
        got = ", ".join(python_type_name(a) for a in given)
        if isinstance(source, UntypedStorage):
            got = got.replace("UntypedStorage", "torch.storage.UntypedStorage", 1)
        raise errors.TensordTypeError(
            f"set_() received an invalid combination of arguments - got ({got}), but "
            "expected one of:\n" + _SET_OVERLOADS
        )
    request = pb.SetStorageRequest(handle=handle)
    if source is None:
        return request
    owner = source if isinstance(source, Tensor) else source._tensor
    request.source = owner.handle
    request.source_is_storage = is_storage
    if size is not None:
        request.storage_offset = builtins.int(storage_offset)
        request.size.values.extend(builtins.int(n) for n in size)
        if stride is not None:
            request.stride.values.extend(builtins.int(n) for n in stride)
    return request


def _is_int_like(value: Any) -> builtins.bool:
    return isinstance(value, (builtins.int, np.integer)) and not isinstance(value, builtins.bool)


def _is_int_list(value: Any) -> builtins.bool:
    return isinstance(value, Sequence) and all(_is_int_like(n) for n in value)


def assign_data(tensor: Tensor, key: Any, data: Any) -> None:
    """``tensor[key] = data`` where ``data`` may also be an array or a list, uploaded in
    ``tensor``'s dtype (tensord.aio's ``await x.setitem(key, data)``; torch's own
    ``__setitem__`` takes only tensors and numbers)."""
    tensor._assign(key, data)


def check_setitem_value(value: Any, dtype: DType, device_type: str) -> None:
    """torch's valueToTensor: a tensor, a Python (or NumPy integer) int, a bool, a float or a
    complex; NumPy float64/complex128 pass as subclasses of float/complex, other NumPy
    scalars, arrays, lists and tuples raise its TypeError."""
    if _is_tensor(value) or isinstance(
        value, (builtins.bool, builtins.int, builtins.float, builtins.complex, np.integer)
    ):
        return
    place = "" if device_type == "cpu" else f"{device_type}."
    raise errors.TensordTypeError(
        f"can't assign a {python_type_name(value)} to a torch.{place}{dtype.scalar_type}Tensor"
    )


def check_setitem_shape(target: Layout, value_shape: Sequence[int], value_dtype: DType) -> None:
    """x[key] = value's shape check, as torch's copy_to makes it before any work (and the
    server again): value's leading 1s dropped, the rest must expand to the slice."""
    with torch_errors():
        Layout.contiguous(strip_leading_ones(tuple(value_shape))).expand(
            target.shape, type_name=value_dtype.legacy_type
        )


def layout_of(tensor: Tensor) -> Layout:
    """The layout the SDK keeps of ``tensor`` (no RPC)."""
    return tensor._meta.layout


def download(tensor: Tensor) -> np.ndarray:
    """``tensor``'s elements in logical order, as a new NumPy array (any device, no checks)."""
    return tensor._download()
