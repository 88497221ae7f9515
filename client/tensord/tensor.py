"""``tensord.Tensor``: a torch-like handle on bytes that live in a tensord server.

A Tensor is its client plus immutable metadata (:class:`~tensord._meta.Meta`): handle,
layout, dtype, device.  Metadata reads never make an RPC.  A view op first computes
the result with :mod:`tensord.layout` — so a bad argument raises torch's exception type
and text without a round trip — then asks the server to register the handle.  Copies
and writes run on the server.

This module keeps torch's surface: arguments are read by :mod:`tensord._args` (torch's
parser and texts), requests are built by :mod:`tensord.wire.requests` from plain values,
and the same-host data plane is :mod:`tensord.local`.

Dropping the last reference to a Tensor queues its handle for release; the
client sends the queue in batches.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import itertools
import operator
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from tensord import _dlpack, _format, _indexing, dtypes, errors, protocol
from tensord._args import (
    CONJ_0D,
    IDENTITY_0D,
    MAX_SECTIONS,
    NO_COPY_AVOIDED,
    T_DEPRECATED,
    UNSET,
    Number,
    as_dtype,
    check_limit,
    check_setitem_shape,
    check_setitem_value,
    check_tensor_argument,
    ints,
    is_dtype,
    is_number,
    is_tensor,
    keyword_memory_format,
    narrow_start,
    narrowing_index,
    parse_set,
    parse_to,
    plain_index,
    python_values,
    require_args,
    resize_size,
    shape_args,
    split_arg,
    split_node_device,
    to_memory_format,
    torch_errors,
    warn_once,
)
from tensord._convert import exact_dtype
from tensord._meta import Meta, StorageInfo, TensorBase, UntypedStorage, new_handle_id
from tensord._session import ClientSession, SessionClient
from tensord._torch import TorchInterop, load_torch, no_alias_error, torch_policy
from tensord.device import Device, Size, device_name
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
    view_result_count,
)
from tensord.local import transfers
from tensord.memory_format import MemoryFormat, memory_format_name, no_positional_or_unknown
from tensord.wire import requests
from tensord.wire.requests import ViewOp

if TYPE_CHECKING:
    from tensord._meta import TensorMeta


class Tensor(TensorBase, TorchInterop):
    """A handle on a tensor in a tensord server, with torch.Tensor's names and return types.

    tensord's own methods (views, copies, indexing) run on the server; torch's math
    (``x + 1``, ``x.sum()``, ``torch.matmul(x, w)``, ``torch.nn.functional``) is torch's,
    computed on an alias of the pooled bytes (:mod:`tensord._torch`)."""

    __slots__ = (
        "__weakref__",
        "_alias",
        "_client",
        "_meta",
        "_owned",
        "_session",
        "_session_id",
    )

    def __init__(self, client: SessionClient, session: ClientSession, meta: Meta) -> None:
        self._client = client  # tensors hold their client: it lives while they do
        self._session = session
        self._meta = meta
        # the session the handle lives in: a replaced session (server restart) took it along
        self._session_id = session.conn.session_id
        # the handle this object releases when it goes (None: handed to another object)
        self._owned: str | None = meta.handle
        # (meta, Storage's torch bytes, torch alias): the alias while meta is this tensor's
        self._alias: tuple[Meta, Any, Any] | None = None

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
    def dtype(self) -> Any:
        """The data type of the elements.

        Once torch is imported, the ``torch.dtype`` itself (``torch.float32``), which torch's own
        arguments take (``torch.zeros(3, dtype=x.dtype)``); before, a ``tensord.DType``
        (``tensord.float32``).  The two compare equal both ways. Metadata the SDK keeps: no RPC.
        """
        return dtypes.public(self._meta.dtype)

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
        fmt = keyword_memory_format("is_contiguous", args, kwargs)
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
        return self._meta.dtype.itemsize

    @property
    def itemsize(self) -> builtins.int:
        """Alias for ``element_size()``.

        Metadata the SDK keeps: no RPC.
        """
        return self._meta.dtype.itemsize

    @property
    def nbytes(self) -> builtins.int:
        """Returns the number of bytes consumed by the "view" of elements of the Tensor.

        Defined to be ``numel() * element_size()``. Metadata the SDK keeps: no RPC.
        """
        return self.numel() * self._meta.dtype.itemsize

    def data_ptr(self) -> builtins.int:
        """Returns the address of the first element of ``self`` tensor.

        The address is in the server's memory: its Storage's address as the server reported it, plus
        the offset in bytes; 0 for a tensor with no elements, as torch's.  No RPC (for a tensor a
        queued copy makes, it waits for the server's answer to that copy).
        """
        # torch: the storage's address plus the offset in bytes; 0 (nullptr) with no elements
        if self.numel() == 0:
            return 0
        return self._meta.storage_data_ptr + self._meta.layout.offset * self._meta.dtype.itemsize

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

    def _views(
        self, layouts: Sequence[Layout], op: ViewOp, changes: dict[str, Any] | None = None
    ) -> list[Tensor]:
        """The view ``op`` (:mod:`tensord.wire.requests` built it); ``layouts`` are its
        results as the layout engine computed them here: with pipelining the op is queued and
        they are returned at once, under handle ids this client chose.  ``changes``: what
        the op changes of the metadata beyond the handle and the layout (a dtype view's
        dtype, detach's requires_grad)."""
        conn = self._session.conn
        handle = self.handle
        if layouts:
            check_limit(len(layouts), "MAX_VIEW_RESULTS", f"{op[0]}() would return {{}} tensors")
            check_limit(layouts[0].ndim, "MAX_DIMS", "the result would have {} dimensions")
        if not conn.pipelining:
            response = conn.call("View", requests.view(handle, op))
            return [wrap(self._client, self._session, m) for m in response.tensors]
        metas = [self._view_meta(lay, changes) for lay in layouts]
        conn.enqueue("View", op[0], handle, op[1], tuple(m.handle for m in metas))
        return [Tensor(self._client, self._session, m) for m in metas]

    def _view(self, layout: Layout, op: ViewOp, changes: dict[str, Any] | None = None) -> Tensor:
        (result,) = self._views((layout,), op, changes)
        return result

    def _elidable_view(self, layout: Layout, op: ViewOp) -> Tensor:
        """A view the server cannot refuse while this tensor's handle is live: its result
        keeps a subset of this one's dims and strides, reaches a subset of its elements and
        takes one handle.  Queued (with pipelining) as a view that, dropped unused before
        its Batch, is never sent (see Pipeline.enqueue in tensord.wire.batches)."""
        conn = self._session.conn
        if not conn.pipelining:
            return self._view(layout, op)
        handle = self.handle
        m = self._meta
        # the common case, built directly: a view's Storage and lazy bits are its input's
        meta = Meta(
            new_handle_id(), layout, m.dtype, m.device, m.requires_grad, m.storage, m.conj, m.neg
        )
        conn.enqueue("View", op[0], handle, op[1], (meta.handle,), None, True)
        return Tensor(self._client, self._session, meta)

    def _view_meta(self, layout: Layout, changes: dict[str, Any] | None) -> Meta:
        """A view's metadata as the server will make it (same Storage, a new handle)."""
        m = self._meta
        if changes is None:  # the common case, built directly
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
        return m.replace(handle=new_handle_id(), layout=layout, **changes)

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
        if len(shape) == 1 and is_dtype(shape[0]):
            return self._view_dtype(as_dtype(shape[0]))
        with torch_errors():
            sizes = shape_args(shape)
            layout = self._meta.layout.view(sizes)
        return self._view(layout, requests.view_shape(sizes))

    def _view_dtype(self, dtype: DType) -> Tensor:
        old = self._meta.dtype
        with torch_errors():
            check_view_dtype_bits(self._meta.conj, self._meta.neg)
            layout = self._meta.layout.view_dtype(
                old.itemsize, dtype.itemsize, old_name=old.scalar_type, new_name=dtype.scalar_type
            )
        # view(dtype) is not differentiable: never requires grad
        changes = {"dtype": dtype, "requires_grad": False}
        return self._view(layout, requests.view_dtype(dtype.name), changes)

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
            return self._view(viewed, requests.view_shape(sizes))
        conn = self._session.conn
        handle = self.handle
        if conn.pipelining:
            with torch_errors():  # torch's copy: _unsafe_view(clone(contiguous_format), shape)
                layout = Layout.contiguous(self._meta.layout.shape).view(sizes)
            return self._queued_copy(handle, sizes, layout)
        return wrap(
            self._client, self._session, conn.call("Reshape", requests.reshape(handle, sizes))
        )

    def _queued_copy(self, handle: str, sizes: tuple[builtins.int, ...], layout: Layout) -> Tensor:
        """A reshape that must copy, queued: the result's layout is contiguous and
        its id ours; its Storage's facts come with the Batch's answer (StorageInfo)."""
        check_limit(layout.ndim, "MAX_DIMS", "the result would have {} dimensions")
        conn = self._session.conn
        storage = StorageInfo.pending(conn.synchronize)
        meta = Meta(
            new_handle_id(), layout, self._meta.dtype, self.device, self.requires_grad, storage
        )
        request = requests.reshape(handle, sizes)
        conn.enqueue("Reshape", "reshape", handle, request, (meta.handle,), storage.answered)
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
        if is_tensor(start):  # torch's narrow(dim, Tensor start, length) overload
            start = narrow_start(start)
        with torch_errors():
            layout = self._meta.layout.narrow(dim, start, length)
        return self._elidable_view(layout, requests.narrow(dim, start, length))

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
        return self._elidable_view(layout, requests.select(dim, index))

    def __getitem__(self, key: Any) -> Tensor:
        if type(key) is builtins.int:  # x[i], the commonest view: basic, nothing to normalize
            with torch_errors():
                layout = self._meta.layout[key]
            return self._elidable_view(layout, requests.int_index(key))
        key = plain_index(key)
        items = plain_index(_indexing.key_items(key, is_tensor))
        if _indexing.is_advanced(items, is_tensor):
            return self._advanced_index(items)
        with torch_errors():
            layout = self._meta.layout[key]
        index = requests.index(key)
        if narrowing_index(key, self._meta.layout.shape):
            return self._elidable_view(layout, index)
        return self._view(layout, index)

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
        return self._elidable_view(layout, requests.transpose(dim0, dim1))

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
        return self._elidable_view(layout, requests.t())

    @property
    def T(self) -> Tensor:
        """torch's ``x.T``: all dims reversed; torch warns (once) unless x is a matrix.

        mirrors ATen numpy_T: a 0-dim tensor gives a new handle on itself (a permute).
        """
        if self.ndim == 0:
            warn_once(
                "Tensor.T is deprecated on 0-D tensors. This function is the identity in these cases."
            )
        elif self.ndim != 2:
            warn_once(T_DEPRECATED)
        return self.permute(tuple(reversed(range(self.ndim))))

    def _matrix_view(self, name: builtins.str, zero_dim_warning: builtins.str) -> Tensor:
        # mT / mH / H / adjoint(): a transpose of the last two dims (of a real tensor)
        # mH / H / adjoint() of a complex tensor: the transpose's lazy conjugate, as torch's
        conjugate = name != "mT" and self._meta.dtype.is_complex
        if self.ndim == 0:
            warn_once(zero_dim_warning)
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
        return self._matrix_view("mT", IDENTITY_0D.format("Tensor.mT"))

    @property
    def mH(self) -> Tensor:
        """Accessing this property is equivalent to calling ``adjoint()``.

        A view (a transpose, plus the lazy conjugate of a complex tensor), queued like it.
        """
        return self._matrix_view("mH", CONJ_0D.format("Tensor.mH"))

    @property
    def H(self) -> Tensor:
        """Returns a view of a matrix (2-D tensor) conjugated and transposed.

        A view (a transpose, plus the lazy conjugate of a complex tensor), queued like it.
        """
        return self._matrix_view("H", CONJ_0D.format("Tensor.H"))

    def adjoint(self) -> Tensor:
        """Returns a view of the tensor conjugated and with the last two dimensions transposed.

        A view: ``transpose(-2, -1)``, and of a complex tensor its lazy conjugate (a flipped
        conjugate bit, no values changed); queued like every view.
        """
        return self._matrix_view("adjoint()", CONJ_0D.format("adjoint()"))

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
        changes = {"dtype": dtypes.dtype_from_name(lazy.dtype), "conj": lazy.conj, "neg": lazy.neg}
        return self._view(lazy.layout, requests.complex_view(name), changes)

    @property
    def real(self) -> Tensor:
        """torch's x.real: a view of the real parts; a real tensor's is the tensor itself."""
        return self._complex_view("real") if self._meta.dtype.is_complex else self

    @property
    def imag(self) -> Tensor:
        """torch's x.imag: a view of the imaginary parts (of a conjugate: with the neg bit)."""
        return self._complex_view("imag")

    def conj(self) -> Tensor:
        """torch's lazy conjugate: a view with the conjugate bit flipped (self if not complex)."""
        return self._complex_view("conj") if self._meta.dtype.is_complex else self

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
        return self.conj().clone() if self._meta.dtype.is_complex else self

    def conj_physical_(self) -> Tensor:
        """Conjugates the values in place (self if not complex): a copy_ from the conjugate."""
        if self._meta.dtype.is_complex:
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
        return self._view(layout, requests.permute(order))

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
        return self._view(layout, requests.movedim(src, dst))

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
            layout = self._meta.layout.expand(target, type_name=self._meta.dtype.legacy_type)
        return self._view(layout, requests.expand(target))

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
            return self._view(layout, requests.squeeze(None))
        dims = [dim] if isinstance(dim, builtins.int) else list(dim)
        return self._view(layout, requests.squeeze(dims))

    def unsqueeze(self, dim: builtins.int) -> Tensor:
        """Returns a new tensor with a dimension of size one inserted at the specified position.

        A view, no copy: the layout is computed here (a bad argument raises torch's error with no
        round trip), and the server only registers a new handle on the same Storage. With pipelining
        (the default) that op is queued and the call does not wait for the server; without it, one
        View RPC.
        """
        with torch_errors():
            layout = self._meta.layout.unsqueeze(dim)
        return self._view(layout, requests.unsqueeze(dim))

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
            return self._view(viewed, requests.flatten(start_dim, end_dim))
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
        return self._view(layout, requests.unflatten(dim, list(sizes)))

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
            return tuple(self._views(parts, requests.split(split_size_or_sections, dim)))
        sections = list(split_size_or_sections)
        if len(sections) > MAX_SECTIONS:  # more than a Split may list: a view per part
            return self._strided_views(parts)
        return tuple(self._views(parts, requests.split_sections(sections, dim)))

    def tensor_split(self, indices_or_sections: Any, dim: builtins.int = 0) -> tuple[Tensor, ...]:
        """mirrors torch.Tensor.tensor_split: an int (sections), a sequence of split
        indices, or a long tensor of either (0-dim: sections; 1-dim: indices)."""
        arg = split_arg(indices_or_sections, self.ndim)
        with torch_errors():
            parts = self._meta.layout.tensor_split(arg, dim)
        return self._split_views(parts, dim)

    def _split_along(self, name: builtins.str, indices_or_sections: Any) -> tuple[Tensor, ...]:
        arg = indices_or_sections
        if not isinstance(arg, (builtins.int, np.integer)):
            arg = ints(arg)
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
        if tiled and len(sizes) <= MAX_SECTIONS:
            return tuple(self._views(parts, requests.split_sections(sizes, dim)))
        runs = [(size, len(list(run))) for size, run in itertools.groupby(sizes)] if tiled else []
        if tiled and len(runs) <= MAX_SECTIONS:  # tensor_split(n): two runs of equal parts
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
        op = requests.as_strided(layout.shape, layout.stride, layout.offset)
        return self._view(layout, op)

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
        return tuple(self._views(parts, requests.chunk(chunks, dim)))

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
        return tuple(self._views(parts, requests.unbind(dim)))

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
        return self._view(layout, requests.diagonal(offset, dim1, dim2))

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
        itemsize = self._meta.dtype.itemsize
        with torch_errors():
            layout = self._meta.layout.as_strided(
                size,
                stride,
                storage_offset,
                storage_elements=self._meta.storage_nbytes // itemsize,
                itemsize=itemsize,
            )
        return self._view(layout, requests.as_strided(list(size), list(stride), storage_offset))

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
        return self._view(self._meta.layout, requests.detach(), {"requires_grad": False})

    def requires_grad_(self, requires_grad: builtins.bool = True) -> Tensor:
        """In place, as torch: this object now carries the flag (the server holds it too).
        Pipelined, a metadata change like a view: queued, under a handle id chosen here."""
        return self._set_requires_grad(requires_grad)

    def _set_requires_grad(
        self, requires_grad: builtins.bool, by_write: builtins.bool = False
    ) -> Tensor:
        """The flag, set in place (``by_write``: a value that requires grad was written in)."""
        op = requests.set_requires_grad(requires_grad, by_write)
        if self._session.conn.pipelining:
            differentiable = self._meta.dtype.is_floating_point or self._meta.dtype.is_complex
            if requires_grad and not by_write and not differentiable:
                raise errors.TensordRuntimeError(  # the server's check (kernels), made here
                    "only Tensors of floating point dtype can require gradients"
                )
            changes = {"requires_grad": requires_grad}
            return self._become(self._view(self._meta.layout, op, changes))
        (meta,) = self._session.conn.call("View", requests.view(self.handle, op)).tensors
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
        request = requests.share(self.handle, uses, ttl)
        token: str = self._session.conn.call("Share", request).token
        return token

    # ---- the tiers below the pool ------------------------------------------------------

    def prefetch(self) -> Tensor:
        """A hint that this tensor is used soon: if the server spilled its Storage to a
        lower tier (``tensord serve --host-tier``/``--disk-tier``), it starts bringing it back
        to its device now, off this call.  Returns self."""
        self._session.conn.call("Prefetch", requests.prefetch([self.handle]))
        return self

    def pin_to_device(self) -> Tensor:
        """Keep this tensor's Storage on its device: restored now if spilled, never spilled
        until :meth:`unpin_from_device` or its last reference goes (every handle on the
        Storage sees it pinned).  Returns self."""
        self._session.conn.call("PinToDevice", requests.pin_to_device(self.handle, True))
        return self

    def unpin_from_device(self) -> Tensor:
        """Let this tensor's Storage spill again (:meth:`pin_to_device`).  Returns self."""
        self._session.conn.call("PinToDevice", requests.pin_to_device(self.handle, False))
        return self

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
        return self._copy_op("Clone", requests.clone(self.handle, fmt))

    def contiguous(self, *args: Any, **kwargs: Any) -> Tensor:
        """torch's x.contiguous(memory_format=...): x itself when already so laid out."""
        fmt = keyword_memory_format("contiguous", args, kwargs)
        with torch_errors():
            copied = self._meta.layout.contiguous_layout(fmt)
        if copied is None:
            return self  # torch returns self
        if fmt == CONTIGUOUS_FORMAT:
            return self._copy_op("Contiguous", requests.handle(self.handle))
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
        return self._copy_op("Repeat", requests.repeat(self.handle, repeats))

    def to(self, *args: Any, **kwargs: Any) -> Tensor:
        """torch's forms: to(device), to(dtype), to(device, dtype), to(other), copy=True,
        memory_format=..."""
        fmt = to_memory_format(args, kwargs)
        remote = split_node_device(args[0] if args else kwargs.get("device"))
        if remote is not None:  # "NODE/DEVICE": a copy on another node of the cluster
            node, local = remote
            if args:
                args = (local, *args[1:])
            else:
                kwargs = {**kwargs, "device": local}
            _, dtype, _ = parse_to(args, kwargs)
            moved = self._to_node(node, local)
            return moved if dtype is None or dtype is moved.dtype else moved.to(dtype)
        device, dtype, copy = parse_to(args, kwargs)
        if fmt == PRESERVE_FORMAT:
            return self._to(device, dtype, copy)
        return self._to_format(device, dtype, copy, fmt)

    def _to_node(self, node: str, device: str) -> Tensor:
        """A copy on ``node``'s ``device``, in this client's session there: one CopyToNode
        call to this tensor's own node, which streams the bytes to that node itself (they
        never pass through this process) and answers once their checksum matched there."""
        target: Any = self._client.node(node)  # a tensord.Client
        if target is self._client:
            return self.to(device, copy=True)
        request = requests.copy_to_node(self.handle, node, device, target.session_id)
        meta = self._session.conn.call("CopyToNode", request)
        return wrap(target, target._session, meta)

    def _to_format(self, device: Any, dtype: DType | None, copy: builtins.bool, fmt: str) -> Tensor:
        """to(..., memory_format=fmt) as To then Clone (the To RPC carries no format).

        mirrors ATen to / to_will_alias: x itself when nothing changes and the format
        is the one torch reads off x's strides; else a tensor with fmt's strides.
        """
        layout = self._meta.layout
        same_device = device is None or Device(device_name(device)) == self.device
        same_dtype = dtype is None or dtype is self._meta.dtype
        if same_device and same_dtype and not copy and layout.suggest_memory_format() == fmt:
            return self
        with torch_errors():
            target_stride = memory_format_strides(layout.shape, fmt)
        moved = self._to(device, dtype, copy)
        if moved is not self and moved._meta.layout.stride == target_stride:
            return moved  # To kept the dense strides, which are already fmt's
        return moved.clone(memory_format=MemoryFormat(fmt))

    def _to(self, device: Any, dtype: DType | None, copy: builtins.bool) -> Tensor:
        request = requests.to(
            self.handle,
            device_name(device) if device is not None else "",
            dtype.name if dtype is not None else "",
            copy,
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
            if transfers.write_array(self, self._session.local, self._meta.layout, src):
                return self
        source = src if isinstance(src, Tensor) else self._upload_source(src)
        self._check_copy_from(source.shape)
        handle = own(self._client, source, 0)
        self._write("Copy", "copy_", requests.copy(self.handle, handle))
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
            self._write("Fill", "fill_", requests.fill(self.handle, value.item()))
            return self._written_from(value, any_dtype=True)
        self._write("Fill", "fill_", requests.fill(self.handle, value))
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
        check_setitem_value(value, self._meta.dtype, self.device.type)
        if key is False:  # THPVariable_setitem returns at once: no shape check, no write
            return
        self._assign(key, value)

    def _assign(self, key: Any, value: Any) -> None:
        """x[key] = value, where value may also be an array or a list (uploaded first)."""
        key = plain_index(key)
        items = plain_index(_indexing.key_items(key, is_tensor))
        if _indexing.is_advanced(items, is_tensor):
            self._advanced_put(items, value)
            return
        with torch_errors():
            target = self._meta.layout[key]
        handle, index = self.handle, requests.index_items(key)
        if isinstance(value, Tensor):
            check_setitem_shape(target, value.shape, value.dtype)
            request = requests.set_item(handle, index, src=own(self._client, value, 0))
        elif is_number(value):
            request = requests.set_item(handle, index, value=value)
        elif isinstance(value, np.ndarray) and transfers.write_array(
            self, self._session.local, self._meta.layout[key], value, setitem=True
        ):
            return  # written through the mapping, one memcpy
        else:  # an array or nested list: uploaded first, then copied in on the server
            source = self._upload_source(value)
            check_setitem_shape(target, source.shape, source.dtype)
            request = requests.set_item(handle, index, src=source.handle)
        self._write("SetItem", "__setitem__", request)
        self._written_from(value)

    def _written_from(self, value: Any, any_dtype: builtins.bool = False) -> Tensor:
        """After an in-place write of ``value``: torch's autograd makes the written tensor
        require grad once a value that did was written into it: copy_ and setitem only
        into a dtype that can carry gradients (an integer x stays as it was), fill_ into
        any (``any_dtype``).  The flag only, on this tensor: no graph here, and other views
        of the Storage (torch's view base) keep theirs."""
        if not isinstance(value, Tensor) or not value.requires_grad or self.requires_grad:
            return self
        if any_dtype or self._meta.dtype.is_floating_point or self._meta.dtype.is_complex:
            self._set_requires_grad(True, by_write=True)
        return self

    def _write(self, method: str, verb: str, request: Any) -> None:
        """An in-place write of RPC ``method`` (``verb`` names it in an error): queued with
        pipelining (its result is this tensor), else one RPC."""
        conn = self._session.conn
        if not conn.pipelining:
            conn.call(method, request)
            return
        conn.enqueue(method, verb, self._meta.handle, request)

    # ---- bytes to Python ----------------------------------------------------------------

    def _download(self) -> np.ndarray:
        """The elements in logical order, as a new NumPy array (any device)."""
        np_dtype = dtypes.to_numpy_dtype(self._meta.dtype)
        fast = transfers.read_array(self, self._session.local, self._meta.layout)
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

    # ---- torch computes on an alias (tensord._torch) -----------------------------------

    def _torch_alias(self) -> tuple[Any, builtins.bool]:
        """The torch tensor torch computes on in this tensor's place, and whether it is a
        downloaded copy.  On the server's host an alias of the pooled bytes: a view of one
        torch tensor over its Storage's mapping, made once per Storage (the export's round
        trip) and kept on this tensor while its metadata and the client's Storages hold."""
        session = self._session
        cached = self._alias
        if cached is not None and cached[0] is self._meta:
            conn = session.conn
            conn.check_session(self._session_id)
            conn.settle()  # ops queued before this one are applied before torch reads
            return cached[2], False
        torch = load_torch()
        meta = self._meta
        if meta.device.type == "cuda":
            # the export synchronizes the server's stream: made again for each use
            return torch.from_dlpack(self), False
        made = self._pooled_alias(torch)
        if made is None:
            if torch_policy() != "download":
                raise no_alias_error(session.local_reason())
            return self._downloaded_alias(torch), True
        base, alias = made
        self._alias = (meta, base, alias)
        session.torch_holders.add(self)
        return alias, False

    def _pooled_alias(self, torch: Any) -> tuple[Any, Any] | None:
        """A torch view of this tensor's elements over its Storage's mapped bytes, with the
        torch tensor of the Storage's bytes it views (which holds the export), or None."""
        session, meta = self._session, self._meta
        if not session.local.enabled:
            return None
        # the Storage's bytes are all torch needs: a view's handle is not read (a queued
        # view that nothing names is never sent)
        session.conn.check_session(self._session_id)
        storage_id = meta.storage.id
        base = session.torch_bases.get(storage_id)
        if base is None:
            export = session.local.shared_export(self.handle, storage_id)
            if export is None or not hasattr(export, "storage_bytes"):
                return None
            base = _PooledBytes(torch.from_numpy(export.storage_bytes()))
            session.torch_bases[storage_id] = base
        session.conn.settle()
        dtype, layout = meta.dtype, meta.layout
        if meta.neg:
            alias = _negative_alias(base, dtype, layout)
        else:
            alias = base.typed(dtype).as_strided(layout.shape, layout.stride, layout.offset)
        if meta.conj:
            alias = alias.conj()
        if meta.requires_grad:
            alias = alias.detach().requires_grad_()
        return base, alias

    def _downloaded_alias(self, torch: Any) -> Any:
        """A torch tensor of a downloaded copy of the elements (the "download" policy)."""
        values = self._download()
        if self._meta.dtype is dtypes.bfloat16:  # torch takes no NumPy bfloat16: its bits
            copy = torch.from_numpy(values.view(np.uint16)).view(torch.bfloat16)
        else:
            copy = torch.from_numpy(values)
        return copy.requires_grad_() if self._meta.requires_grad else copy

    def _torch_written(self, alias: Any) -> None:
        # an in-place op wrote the downloaded copy: its values go back into the pool
        values = alias.detach().resolve_conj().resolve_neg()
        if values.dtype == dtypes.to_torch(dtypes.bfloat16):
            self.copy_(
                values.view(dtypes.to_torch(dtypes.uint16))
                .numpy()
                .view(dtypes.bfloat16.numpy_dtype)
            )
        else:
            self.copy_(values.numpy())

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
                raise ValueError(f"{NO_COPY_AVOIDED} ({refusal})") from refusal
        np_dtype = dtypes.to_numpy_dtype(self._meta.dtype)
        if dtype is not None and np.dtype(dtype) != np_dtype:
            raise ValueError(
                f"{NO_COPY_AVOIDED} (a {self._meta.dtype} tensor as {np.dtype(dtype)} needs a cast)"
            )
        array = self._session.local_array(
            self.handle, self._meta.layout, np_dtype, self.untyped_storage().storage_id
        )
        if array is None:
            raise ValueError(f"{NO_COPY_AVOIDED} (no zero-copy: {self._session.local_reason()})")
        return array

    def tolist(self) -> Any:
        """Returns the tensor as a (nested) list.

        For scalars, a standard Python number is returned, just like with ``item()``. Tensors on any
        device are read.  The bytes come from the server (a gRPC download, or one copy out of the
        server's mapped memory on the same host); the call waits for the ops queued before it.
        """
        return python_values(self._download(), self._meta.dtype).tolist()

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
        value: Number = python_values(self._download(), self._meta.dtype).reshape(()).item()
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
        if self._meta.dtype.is_floating_point or self._meta.dtype.is_complex or self.numel() != 1:
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
        return _format.tensor_repr(values, shape, self._meta.dtype, self.device, self.requires_grad)

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
        data = item.detach().cpu().numpy() if is_tensor(item) else _indexing.index_data(item)
        uploaded: Tensor = self._client.tensor(data, device=self.device)
        keep.append(uploaded)  # alive until the call is answered
        return uploaded.handle

    def _advanced_items(self, items: tuple[Any, ...], keep: list[Tensor]) -> list[Any]:
        return requests.advanced_items(
            items, is_tensor, lambda item: self._index_handle(item, keep)
        )

    def _advanced_index(
        self, items: tuple[Any, ...], raw: builtins.bool = False, op: str = ""
    ) -> Tensor:
        keep: list[Tensor] = []
        handle = self.handle
        request = requests.advanced_index(handle, self._advanced_items(items, keep), raw, op)
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
        handle = self.handle
        index = self._advanced_items(items, keep)
        put = functools.partial(
            requests.advanced_set_item,
            handle,
            index,
            raw=raw,
            accumulate=accumulate,
            value_requires_grad=value_requires_grad,
        )
        if isinstance(value, Tensor):
            request = put(src=own(self._client, value, 0))
        elif is_number(value):
            request = put(value=value)
        else:  # a torch tensor keeps its dtype; an array or list takes this tensor's
            dtype = None if is_tensor(value) else self._meta.dtype
            source: Tensor = self._client.tensor(value, dtype=dtype, device=self.device)
            keep.append(source)
            request = put(src=source.handle)
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
        if dtypes.canonical(index.dtype) not in (dtypes.int64, dtypes.int32):
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
        if dtypes.canonical(mask.dtype) is not dtypes.bool:
            raise errors.TensordRuntimeError("masked_select: expected BoolTensor for mask")
        with torch_errors():
            shape = _indexing.infer_size(mask.shape, self.shape)
        if self._meta.dtype in dtypes.BAREBONES_UNSIGNED:  # torch 2.13 has no kernel for them
            raise errors.TensordNotImplementedError(
                f"\"masked_select\" not implemented for '{self._meta.dtype.scalar_type}'"
            )
        return self.expand(shape)._advanced_index((mask.expand(shape),))

    def masked_fill_(self, mask: Tensor, value: Any) -> Tensor:
        """torch's masked_fill_: ``value`` (a number or a 0-dim tensor) where ``mask`` is True."""
        own(self._client, mask, 1)
        value_requires_grad = False
        if is_tensor(value):  # masked_fill__cpu checks the value, then the mask
            if value.ndim != 0:
                raise errors.TensordRuntimeError(
                    "masked_fill_ only supports a 0-dimensional value tensor, but got tensor "
                    f"with {value.ndim} dimension(s)."
                )
            # torch's autograd: x requires grad after the fill when the value did
            value_requires_grad = builtins.bool(value.requires_grad)
            value = value.item()
        if dtypes.canonical(mask.dtype) is not dtypes.bool:
            mask_dtype = dtypes.canonical(mask.dtype)
            name = dtypes.TYPE_META_NAMES.get(mask_dtype.name, mask_dtype.name)
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
        check_tensor_argument("is_same_size", "other", other)
        return tuple(self.shape) == tuple(other.shape)

    def is_set_to(self, tensor: Any) -> builtins.bool:
        """torch's is_set_to: the same Storage, offset, sizes and strides (any dtype)."""
        check_tensor_argument("is_set_to", "tensor", tensor)
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
        size = resize_size(sizes)
        check_limit(len(size), "MAX_DIMS", "resize_() would make a tensor of {} dimensions")
        fmt = "" if memory_format is None else memory_format_name(memory_format, "resize_")
        request = requests.resize(self.handle, size, fmt)
        self._let_go_of_storage()
        self._adopt(Meta.from_pb(self._session.conn.call("Resize", request)))
        return self

    def _let_go_of_storage(self) -> None:
        """Before an op a pin would refuse (a Storage that grows): this client's torch aliases
        and the export a same-host get brought of this Storage go now (the server grows no
        pinned Storage); each is made again at its next use.  An alias a caller still holds
        (``as_torch``) or an array still using the get's export keeps its pin."""
        session = self._session
        for holder in list(session.torch_holders):
            holder._alias = None
        session.torch_holders.clear()
        session.torch_bases.clear()
        session.local.let_go(self.untyped_storage().storage_id)
        session.conn.flush_export_releases()

    def resize_as_(self, the_template: Any, memory_format: Any = None) -> Tensor:
        """Resizes the ``self`` tensor to be the same size as the specified ``the_template``.

        This is equivalent to ``self.resize_(the_template.size())``; a ``memory_format`` of
        ``preserve_format`` takes the template's own format.  One Resize RPC (see ``resize_``).

        Args:
            the_template: The tensor whose size ``self`` takes (a tensord or torch tensor).
            memory_format: The result's memory format; None: contiguous.
        """
        check_tensor_argument("resize_as_", "the_template", the_template)
        if memory_format is None:
            return self.resize_(tuple(the_template.shape))
        fmt = memory_format_name(memory_format, "resize_as_")
        if fmt == PRESERVE_FORMAT:  # torch: the template's own format
            template = Layout(tuple(the_template.shape), tuple(the_template.stride()))
            fmt = template.suggest_memory_format()
        return self.resize_(tuple(the_template.shape), memory_format=MemoryFormat(fmt))

    def set_(
        self,
        source: Any = UNSET,
        storage_offset: Any = UNSET,
        size: Any = UNSET,
        stride: Any = UNSET,
    ) -> Tensor:
        """torch's set_(), set_(tensor), set_(storage) and both with
        (storage_offset, size, stride=None): this handle views the source's Storage."""
        handle = self.handle
        bound = parse_set(source, storage_offset, size, stride)
        request = requests.set_storage(
            handle,
            None if bound.source is None else own(self._client, bound.source, 0),
            source_is_storage=bound.source_is_storage,
            storage_offset=bound.storage_offset,
            size=bound.size,
            stride=bound.stride,
        )
        self._let_go_of_storage()
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


class _PooledBytes:
    """One Storage's mapped bytes in torch: a uint8 tensor over them (which keeps the
    export alive) and its views as each dtype asked for, which each alias views."""

    __slots__ = ("__weakref__", "_as", "data")

    def __init__(self, data: Any) -> None:
        self.data = data
        self._as: dict[DType, Any] = {}

    def typed(self, dtype: DType) -> Any:
        """The bytes as elements of ``dtype`` (a torch view, no copy), made once."""
        view = self._as.get(dtype)
        if view is None:
            usable = self.data.numel() - self.data.numel() % dtype.itemsize
            view = self._as[dtype] = self.data[:usable].view(dtypes.to_torch(dtype))
        return view


# the complex dtype whose imaginary parts a real view with torch's negative bit reads
_COMPLEX_OF = {dtypes.float32: dtypes.complex64, dtypes.float64: dtypes.complex128}


def _negative_alias(base: _PooledBytes, dtype: DType, layout: Layout) -> Any:
    """A torch view with the negative bit (a conjugate's imaginary part, as x.conj().imag):
    the same in torch, the imaginary parts of a conjugated complex view of the Storage."""
    complex_dtype = _COMPLEX_OF.get(dtype)
    if complex_dtype is None or layout.offset % 2 != 1 or any(s % 2 for s in layout.stride):
        raise errors.TensordNotImplementedError(
            "torch cannot compute on this view in place: its negative bit reads no complex "
            "elements torch could view; call x.resolve_neg() first for a copy"
        )
    complex_view = base.typed(complex_dtype).as_strided(
        layout.shape, tuple(s // 2 for s in layout.stride), (layout.offset - 1) // 2
    )
    return complex_view.conj().imag


def complex_function(name: builtins.str, input: Any) -> Tensor:
    """torch.view_as_real / torch.view_as_complex (no Tensor methods in torch): the complex
    view of ``input``, after torch's argument check."""
    if not isinstance(input, Tensor):
        raise errors.TensordTypeError(
            f"{name}(): argument 'input' (position 1) must be Tensor, not {type(input).__name__}"
        )
    return input._complex_view(name)


def wrap(client: SessionClient, session: ClientSession, meta: TensorMeta) -> Tensor:
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


def assign_data(tensor: Tensor, key: Any, data: Any) -> None:
    """``tensor[key] = data`` where ``data`` may also be an array or a list, uploaded in
    ``tensor``'s dtype (tensord.aio's ``await x.setitem(key, data)``; torch's own
    ``__setitem__`` takes only tensors and numbers)."""
    tensor._assign(key, data)


def layout_of(tensor: Tensor) -> Layout:
    """The layout the SDK keeps of ``tensor`` (no RPC)."""
    return tensor._meta.layout


def download(tensor: Tensor) -> np.ndarray:
    """``tensor``'s elements in logical order, as a new NumPy array (any device, no checks)."""
    return tensor._download()
