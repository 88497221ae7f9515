"""``tensord.connect()`` and the Client: factories, transfers, sharing and the pool's figures.

A Client owns one :class:`~tensord.wire.connection.Connection` (channel + session) and
makes :class:`~tensord.tensor.Tensor` handles.  Every RPC goes through the
connection's ``call``, which raises :mod:`tensord.errors` exceptions; its requests are
built by :mod:`tensord.wire.requests` from plain values.
"""

from __future__ import annotations

import json
import math
import sys
import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from tensord import _convert, dtypes, errors
from tensord._args import as_dtype, check_limit, shape_args, torch_errors
from tensord._convert import INT64_MAX, INT64_MIN, as_scalar
from tensord._session import ClientSession
from tensord.device import device_name
from tensord.dtypes import DType
from tensord.layout import CONTIGUOUS_FORMAT, memory_format_strides
from tensord.local import transfers
from tensord.local.copies import parallel_copyto
from tensord.local.mapper import LocalMapper, local_wanted
from tensord.local.segments import Export
from tensord.memory_format import memory_format_name, python_type_name
from tensord.protocol import MAX_PAGE_SIZE, MAX_RELEASE_HANDLES
from tensord.tensor import Tensor, download, layout_of, own, wrap
from tensord.wire import requests
from tensord.wire import status as wire_status
from tensord.wire.config import (
    CALL_TIMEOUT_FROM_ENV,
    CallTimeoutFromEnv,
    RootCertificates,
    resolve_address,
    resolve_call_timeout,
    resolve_tls,
    resolve_token,
)
from tensord.wire.connection import Connection

if TYPE_CHECKING:
    from tensord._meta import TensorMeta


def connect(
    address: str | None = None,
    *,
    timeout: float = 10.0,
    call_timeout: float | CallTimeoutFromEnv | None = CALL_TIMEOUT_FROM_ENV,
    token: str | None = None,
    tls: bool | None = None,
    root_certificates: RootCertificates | None = None,
    local: bool | None = None,
    pipelining: bool = True,
) -> Client:
    """Open a session on the server at ``address`` (else ``$TENSORD_ADDRESS``, else 127.0.0.1:50051).

    ``address`` is HOST:PORT (a host alone means port 50051) or unix:PATH; a URL
    (``http://...``) is refused with the address to pass instead.

    ``timeout`` bounds connecting only: the wait for the server to answer and open
    the session.  ``call_timeout`` (seconds, else ``$TENSORD_CALL_TIMEOUT``, else 60;
    None or ``none``: no deadline) bounds every call afterwards: a call with no
    answer in that time, or an upload or download in which no chunk moved for that
    long (however long the whole transfer takes), raises
    :class:`tensord.DeadlineExceededError` (a TimeoutError and an UnavailableError).

    ``token`` (else ``$TENSORD_TOKEN``) is sent as ``authorization: Bearer <token>``
    to a server started with ``--auth-tokens``.  ``tls=True`` (else ``$TENSORD_TLS=1``)
    connects over TLS, checking the server's certificate against the system's roots,
    or against ``root_certificates`` (PEM bytes or a file's path; else
    ``$TENSORD_TLS_CA``), which turn TLS on by themselves.  Raises
    :class:`tensord.UnavailableError` (a ConnectionError) at once when the connection
    is refused or the host does not resolve, when no server answers in time or the TLS
    handshake fails, :class:`tensord.UnauthenticatedError` when the
    server refuses the token, ValueError for unreadable root certificates.

    ``local`` (else ``$TENSORD_LOCAL``, default on): on the server's host, map its
    memory for zero-copy DLPack and one-memcpy transfers, and send unary calls over the
    session's call channel (a unix socket) rather than gRPC, falling back to gRPC silently
    when that is impossible; ``local=False`` always uses gRPC (README, "Same-host zero copy").

    ``pipelining`` (default on): views, ``detach`` and in-place writes (``fill_``,
    ``zero_``, ``copy_``, ``x[i] = v``) and releases return at once and are sent in order,
    in batches; a server-side error of one surfaces at the next call that waits for the
    server (a read, a factory, stats, sharing, ``synchronize()``), naming the op, as CUDA's
    asynchronous errors do (README, "Pipelining").  ``pipelining=False``: one RPC per op.
    """
    return Client(
        address,
        timeout=timeout,
        call_timeout=call_timeout,
        token=token,
        tls=tls,
        root_certificates=root_certificates,
        local=local,
        pipelining=pipelining,
    )


# Names whose holder (another node of a cluster) a client remembers, so that the next get
# goes straight there; the least recently used are forgotten first.
MAX_REMEMBERED_HOLDERS = 4096

# torch.tensor(t)'s warning for a tensor argument (torch 2.13's text)
_COPY_CONSTRUCT_WARNING = (
    "To copy construct from a tensor, it is recommended to use sourceTensor.detach().clone() "
    "or sourceTensor.detach().clone().requires_grad_(True), rather than "
    "torch.tensor(sourceTensor)."
)


def _factory_dtype(function: str, dtype: Any) -> DType | None:
    """A factory's ``dtype`` as torch's argument parser takes it: a torch.dtype (tensord's
    dtypes stand for them) or a Python number type; anything else (a string, a NumPy
    dtype) raises its TypeError, as ``torch.zeros(4, dtype="float32")`` does."""
    if dtype is None:
        return None
    if isinstance(dtype, DType) or _is_torch_dtype(dtype) or _is_number_type(dtype):
        return as_dtype(dtype)
    raise errors.TensordTypeError(
        f"{function}(): argument 'dtype' must be torch.dtype, not {python_type_name(dtype)}"
    )


def _is_number_type(value: Any) -> bool:
    # by identity: a NumPy dtype compares equal to the Python type it maps to
    return any(value is number for number in (bool, int, float, complex))


def _is_torch_dtype(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.dtype)


def _factory_size(function: str, size: tuple[Any, ...]) -> tuple[int, ...]:
    """``f(2, 3)`` or ``f((2, 3))``'s sizes; one past int64 raises torch's TypeError (the
    first line of its text: the rest is a C++ stack trace) rather than protobuf's."""
    one = size[0] if len(size) == 1 else None
    values = size if one is None or isinstance(one, (int, np.integer)) else one
    if isinstance(values, Iterable):
        for position, value in enumerate(values, 1):
            if isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
                raise errors.TensordTypeError(
                    f"{function}(): argument 'size' failed to unpack the object at pos "
                    f'{position} with error "Overflow when unpacking long long"'
                )
    shape = shape_args(size)
    check_limit(len(shape), "MAX_DIMS", f"{function}() would make a tensor of {{}} dimensions")
    return shape


def _check_storage_size(shape: tuple[int, ...], dtype: DType) -> None:
    """computeStorageNbytesContiguous's check, before torch's allocator is asked: bytes past
    int64 raise its RuntimeError (a negative size is the server's error, torch's first)."""
    if all(n >= 0 for n in shape) and math.prod(shape) * dtype.itemsize > INT64_MAX:
        raise errors.TensordRuntimeError(
            f"Storage size calculation overflowed with sizes=[{', '.join(map(str, shape))}]"
        )


# full()'s dtype when none is given: torch's for its fill value (the default float32)
_FULL_DTYPES = ((bool, dtypes.bool), (int, dtypes.int64), (float, dtypes.float32))


def _text(what: str, value: Any) -> str:
    """A name or share token as the wire takes it: protobuf would take bytes as text, and
    refuse anything else without saying which argument it was."""
    if not isinstance(value, str):
        raise errors.TensordTypeError(f"{what} must be a str, got {type(value).__name__}")
    return value


class Client:
    """One session on a tensord server.  Thread-safe; a context manager that closes the session."""

    def __init__(
        self,
        address: str | None = None,
        *,
        timeout: float = 10.0,
        call_timeout: float | CallTimeoutFromEnv | None = CALL_TIMEOUT_FROM_ENV,
        token: str | None = None,
        tls: bool | None = None,
        root_certificates: RootCertificates | None = None,
        local: bool | None = None,
        pipelining: bool = True,
    ) -> None:
        same_host = local_wanted(local)
        # what a session this client opens on another node of a cluster is given
        self._options: dict[str, Any] = {
            "timeout": timeout,
            "call_timeout": call_timeout,
            "token": token,
            "tls": tls,
            "root_certificates": root_certificates,
            "local": local,
            "pipelining": pipelining,
        }
        self._peers: dict[str, Client] = {}  # node id -> this client's session there
        # name -> the node a redirect sent this client to for it, the least recently used
        # first (guarded by _peers_lock, as _peers)
        self._holders: OrderedDict[str, str] = OrderedDict()
        self._peers_lock = threading.Lock()
        self._conn = Connection(
            resolve_address(address),
            timeout=timeout,
            call_timeout=resolve_call_timeout(call_timeout),
            token=resolve_token(token),
            credentials=resolve_tls(tls, root_certificates),
            pipelining=pipelining,
            use_call_channel=same_host,
        )
        self._local = LocalMapper(self._conn, same_host)
        self._conn.local = self._local
        self._session = ClientSession(self._conn, self._local)
        self._stagings = transfers.StagingPool()  # small puts' staging tensors
        # A client dropped unclosed (and every tensor of it: they hold it) or still open at
        # exit closes its session, so the server frees its memory now rather than after the
        # grace.  The finalizer holds the connection, not the client.
        self._closer = weakref.finalize(self, self._conn.close)

    # ---- life ------------------------------------------------------------------------

    @property
    def address(self) -> str:
        """The address of the server this client talks to, as ``connect`` resolved it."""
        return self._conn.address

    @property
    def session_id(self) -> str:
        """The id of this client's session on the server.

        When the server no longer has the session (it restarted, or the session expired), the client
        opens a new one and this id changes; tensors of the old session then raise
        ``tensord.SessionLostError``.
        """
        return self._conn.session_id

    @property
    def closed(self) -> bool:
        """Whether ``close()`` has ended this client's session."""
        return self._conn.closed

    def close(self) -> None:
        """Send pending releases, close the session (the server frees its handles) and the channel.

        Same host: before the session ends, each pool segment this client mapped becomes
        private memory at the same addresses (also when the server is found to have lost
        the session).  A ``torch.from_dlpack`` or NumPy alias taken earlier keeps working
        on its own copy of the bytes it last saw, and never reaches pool memory the server
        may give to another session: writes through it stay in this process.
        Sessions this client opened on other nodes of a cluster close too."""
        with self._peers_lock:
            peers, self._peers = list(self._peers.values()), {}
        for peer in peers:
            peer.close()
        self._stagings.clear()
        self._closer()

    def flush(self) -> None:
        """Send the releases of dropped tensors now rather than at the next interval."""
        self._conn.flush_releases()

    def synchronize(self) -> None:
        """Wait until the server applied every op this client queued (pipelining); raise the
        first error one of them met, naming it (torch.cuda.synchronize's role)."""
        self._conn.synchronize()

    @property
    def pipelining(self) -> bool:
        """Whether views and in-place writes are queued and sent in batches
        (``connect(pipelining=...)``).
        """
        return self._conn.pipelining

    def schedule_flushes(self, scheduler: Callable[[Callable[[], None]], None] | None) -> None:
        """Run the flush of a full queue through ``scheduler`` (None: in the issuing thread),
        so issuing a view never waits for the server (tensord.aio uses an executor)."""
        self._conn.flush_scheduler = scheduler

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"session {self.session_id}"
        return f"<tensord.Client {self.address} {state}>"

    def _wrap(self, meta: TensorMeta) -> Tensor:
        return wrap(self, self._session, meta)

    def _call(self, method: str, request: Any) -> Any:
        return self._conn.call(method, request)

    # ---- from Python data --------------------------------------------------------------

    def tensor(
        self, data: Any, dtype: Any = None, device: Any = "cpu", requires_grad: bool = False
    ) -> Tensor:
        """torch.tensor: a new tensor holding a copy of ``data`` (array, nested list, scalar, tensor)."""
        dt = _factory_dtype("tensor", dtype)
        if isinstance(data, Tensor):
            warnings.warn(_COPY_CONSTRUCT_WARNING, UserWarning, stacklevel=2)
            if data.client is not self:  # another server or session: the bytes come across
                copied = self._upload(
                    download(data.detach()),
                    dtypes.canonical(data.dtype),
                    device_name(device),
                    False,
                )
                result = copied if dtype is None else copied.to(dtype=dtype)
                return result.requires_grad_(True) if requires_grad else result
            result = data.to(device, dtype, copy=True).detach()
            return result.requires_grad_(True) if requires_grad else result
        array, dt = _convert.as_array(data, dt)
        return self._upload(array, dt, device_name(device), requires_grad)

    def from_numpy(self, array: np.ndarray) -> Tensor:
        """torch.from_numpy, except that the bytes are copied into the server."""
        if not isinstance(array, np.ndarray):
            raise errors.TensordTypeError(f"expected np.ndarray (got {type(array).__name__})")
        return self.tensor(array)

    def _upload(self, array: np.ndarray, dtype: DType, device: str, requires_grad: bool) -> Tensor:
        fast = self._upload_local(array, dtype, device, requires_grad)
        if fast is not None:
            return fast
        header = requests.upload_header(
            array.shape, dtype.name, device, array.nbytes, requires_grad
        )
        # Bytes through uint8: the buffer protocol knows no bfloat16.
        data = array.reshape(-1).view(np.uint8).data
        return self._wrap(self._conn.upload(header, data))

    def _upload_local(
        self, array: np.ndarray, dtype: DType, device: str, requires_grad: bool
    ) -> Tensor | None:
        """Same host: an empty tensor and its export in one call (EmptyExport), then one
        memcpy through the mapping (None: use gRPC)."""
        if device != "cpu" or not transfers.worth_mapping(self._local, array.nbytes):
            return None
        request = requests.empty(array.shape, dtype.name, device, requires_grad)
        # a large upload carries the releases queued before it (the tensors dropped, the
        # exports of earlier transfers): the server frees their blocks first, so the upload
        # reuses warm pages
        carry = array.nbytes >= transfers.RELEASE_BEFORE_UPLOAD_BYTES
        try:
            made = self._local.empty_exported(request, carry)
        except errors.ResourceExhaustedError as exc:
            if array.nbytes >= transfers.MIN_FAST_BYTES:
                raise
            # a small upload takes an Upload when the session has no room for the export
            # too (--max-handles-per-session): it needs only the handle
            exc.__traceback__ = exc.__context__ = None
            return None
        exported = self._wrap_exported(made)
        if exported is None:
            return None  # the tensor is dropped (released) and gRPC takes over
        tensor, export = exported
        try:
            flat = array.reshape(-1).view(np.uint8)  # C-contiguous (as_array): no copy
            parallel_copyto(export.storage_bytes()[: array.nbytes], flat)
        finally:
            export.close()
        return tensor

    # ---- factories ---------------------------------------------------------------------

    def empty(
        self,
        *size: Any,
        dtype: Any = None,
        device: Any = "cpu",
        requires_grad: bool = False,
        memory_format: Any = None,
    ) -> Tensor:
        """torch.empty; a memory_format other than contiguous_format is sent as its strides."""
        shape = _factory_size("empty", size)
        dt = _factory_dtype("empty", dtype) or dtypes.float32
        _check_storage_size(shape, dt)
        stride = None
        if memory_format is not None:
            fmt = memory_format_name(memory_format, "empty")
            with torch_errors():
                strides = memory_format_strides(shape, fmt)
            if fmt != CONTIGUOUS_FORMAT:
                stride = strides
        request = requests.empty(shape, dt.name, device_name(device), requires_grad, stride)
        return self._wrap(self._call("Empty", request))

    def full(
        self,
        size: Sequence[int],
        fill_value: Any,
        *,
        dtype: Any = None,
        device: Any = "cpu",
        requires_grad: bool = False,
    ) -> Tensor:
        """torch.full: with no dtype, the server infers it from the value as torch does."""
        return self._full(
            "full", _factory_size("full", (size,)), fill_value, dtype, device, requires_grad
        )

    def _full(
        self,
        function: str,
        shape: tuple[int, ...],
        fill_value: Any,
        dtype: Any,
        device: Any,
        requires_grad: bool,
    ) -> Tensor:
        dt = _factory_dtype(function, dtype)
        # the value as torch's parser reads it (np.True_ is 1.0): the server infers from it
        value = as_scalar(fill_value)
        inferred = next((d for t, d in _FULL_DTYPES if isinstance(value, t)), dtypes.complex64)
        _check_storage_size(shape, dt or inferred)
        request = requests.full(
            shape, "" if dt is None else dt.name, device_name(device), value, requires_grad
        )
        return self._wrap(self._call("Full", request))

    def zeros(
        self, *size: Any, dtype: Any = None, device: Any = "cpu", requires_grad: bool = False
    ) -> Tensor:
        """Returns a tensor filled with the scalar value 0, with the shape defined by the variable
        argument ``size``.

        Made on the server by one Full RPC; the dtype is ``tensord.float32`` unless ``dtype`` says
        otherwise, as torch's default.
        """
        shape = _factory_size("zeros", size)
        if any(n < 0 for n in shape):  # torch's zeros checks its sizes itself, in its own words
            raise errors.TensordRuntimeError("zeros: Dimension size must be non-negative.")
        return self._filled("zeros", shape, 0, dtype, device, requires_grad)

    def ones(
        self, *size: Any, dtype: Any = None, device: Any = "cpu", requires_grad: bool = False
    ) -> Tensor:
        """Returns a tensor filled with the scalar value 1, with the shape defined by the variable
        argument ``size``.

        Made on the server by one Full RPC; the dtype is ``tensord.float32`` unless ``dtype`` says
        otherwise, as torch's default.
        """
        return self._filled("ones", _factory_size("ones", size), 1, dtype, device, requires_grad)

    def _filled(
        self,
        function: str,
        shape: tuple[int, ...],
        value: int,
        dtype: Any,
        device: Any,
        requires_grad: bool,
    ) -> Tensor:
        """zeros/ones: torch's default dtype (float32) unless one is given, unlike full()."""
        dt = _factory_dtype(function, dtype) or dtypes.float32
        return self._full(function, shape, value, dt, device, requires_grad)

    def arange(
        self,
        start: Any,
        end: Any = None,
        step: Any = 1,
        *,
        dtype: Any = None,
        device: Any = "cpu",
        requires_grad: bool = False,
    ) -> Tensor:
        """Returns a 1-D tensor with values from the interval ``[start, end)`` taken with common
        difference ``step`` beginning from ``start``.

        ``arange(end)`` starts at 0.  Made on the server by one Arange RPC, which infers the dtype
        from the arguments as torch does when ``dtype`` is None.
        """
        if end is None:
            start, end = 0, start
        dt = _factory_dtype("arange", dtype)
        request = requests.arange(
            start, end, step, "" if dt is None else dt.name, device_name(device), requires_grad
        )
        return self._wrap(self._call("Arange", request))

    def empty_like(
        self, other: Tensor, *, dtype: Any = None, device: Any = None, requires_grad: bool = False
    ) -> Tensor:
        """torch.empty_like with preserve_format: a dense tensor keeps its strides."""
        return self._empty_like("empty_like", other, dtype, device, requires_grad)

    def _empty_like(
        self, function: str, other: Tensor, dtype: Any, device: Any, requires_grad: bool = False
    ) -> Tensor:
        dt = _factory_dtype(function, dtype) or dtypes.canonical(other.dtype)
        dense = layout_of(other).dense_like()
        request = requests.empty(
            dense.shape,
            dt.name,
            device_name(device) if device is not None else other.device,
            requires_grad,
            dense.stride,
        )
        return self._wrap(self._call("Empty", request))

    def zeros_like(self, other: Tensor, *, dtype: Any = None, device: Any = None) -> Tensor:
        """Returns a tensor filled with the scalar value 0, with the same size as ``other``.

        An Empty RPC makes a tensor with ``other``'s shape (a dense ``other`` keeps its strides, as
        torch's preserve_format), on ``other``'s device and with its dtype unless ``device`` or
        ``dtype`` says otherwise; the fill is then a write on the server, queued with pipelining
        (the default).
        """
        return self._empty_like("zeros_like", other, dtype, device).zero_()

    def ones_like(self, other: Tensor, *, dtype: Any = None, device: Any = None) -> Tensor:
        """Returns a tensor filled with the scalar value 1, with the same size as ``other``.

        An Empty RPC makes a tensor with ``other``'s shape (a dense ``other`` keeps its strides, as
        torch's preserve_format), on ``other``'s device and with its dtype unless ``device`` or
        ``dtype`` says otherwise; the fill is then a write on the server, queued with pipelining
        (the default).
        """
        return self._empty_like("ones_like", other, dtype, device).fill_(1)

    def full_like(
        self, other: Tensor, fill_value: Any, *, dtype: Any = None, device: Any = None
    ) -> Tensor:
        """Returns a tensor with the same size as ``other`` filled with ``fill_value``.

        An Empty RPC makes a tensor with ``other``'s shape (a dense ``other`` keeps its strides, as
        torch's preserve_format), on ``other``'s device and with its dtype unless ``device`` or
        ``dtype`` says otherwise; the fill is then a write on the server, queued with pipelining
        (the default).
        """
        return self._empty_like("full_like", other, dtype, device).fill_(fill_value)

    def cat(self, tensors: Iterable[Tensor], dim: int = 0) -> Tensor:
        """Concatenates the given sequence of tensors in ``tensors`` in the given dimension.

        All tensors must either have the same shape (except in the concatenating dimension) or be a
        1-D empty tensor with size ``(0,)``, and all must be this client's.  The result is a new
        tensor made on the server by one Cat RPC.
        """
        return self._join("Cat", tensors, dim)

    def stack(self, tensors: Iterable[Tensor], dim: int = 0) -> Tensor:
        """Concatenates a sequence of tensors along a new dimension.

        All tensors must be this client's and of one shape.  The result is a new tensor made on the
        server by one Stack RPC.
        """
        return self._join("Stack", tensors, dim)

    def _join(self, method: str, tensors: Iterable[Tensor], dim: int) -> Tensor:
        inputs = list(tensors)
        what = f"{method.lower()}() got {{}} tensors"
        check_limit(len(inputs), "MAX_CAT_INPUTS", what)
        handles = [own(self, t, i) for i, t in enumerate(inputs)]
        return self._wrap(self._call(method, requests.join(handles, dim)))

    # ---- sharing -------------------------------------------------------------------------

    def attach(self, token: str) -> Tensor:
        """This session's own handle on the Storage behind another session's ``x.share()``.

        In a cluster a token names the node it was made on: one of another node is
        attached there (the client opens its session on that node once, and follows the
        redirect to it), and the handle lives on that node."""
        request = requests.attach(_text("token", token))
        try:
            return self._wrap(self._call("Attach", request))
        except errors.OwnedElsewhereError as redirect:
            peer = self._peer(redirect)
            return peer._wrap(peer._call("Attach", request))  # followed once

    def revoke(self, token: str) -> bool:
        """End a share token this session issued now; False if it had already ended
        (used up, expired or revoked).  In a cluster, a token of another node is revoked
        there, in this client's session on that node."""
        request = requests.revoke(_text("token", token))
        try:
            answer = self._call("Revoke", request)
        except errors.OwnedElsewhereError as redirect:
            answer = self._peer(redirect)._call("Revoke", request)  # followed once
        revoked: bool = answer.revoked
        return revoked

    def put(self, name: str, tensor: Any, overwrite: bool = False) -> None:
        """Name a tensor server-wide; the name keeps its Storage alive until ``delete``.

        ``tensor`` is a tensor of this client (named as it is: no bytes move), or data
        ``torch.tensor`` takes (a NumPy array, a torch tensor, a nested list): the name then
        gets a new cpu tensor holding a copy, of the dtype ``torch.tensor(data)`` has.  On
        the server's host data of at most 4 MiB is written into a pooled tensor through
        the mapping and named in one call; larger data is uploaded, then named.

        In a cluster the name is the cluster's (one per tenant across the nodes); a tensor
        on another node (one ``get`` brought from there) is named on its own node.

        Raises:
            AlreadyExistsError: the name exists and ``overwrite`` is False.
        """
        name = _text("name", name)
        if isinstance(tensor, Tensor):
            peer = next((p for p in self._peers.values() if p is tensor.client), None)
            if peer is not None and peer is not self:
                peer.put(name, tensor, overwrite)
                return
        self._put_items([(name, tensor)], overwrite, "PutName")

    def put_many(self, tensors: Mapping[str, Any], overwrite: bool = False) -> None:
        """``put`` of every ``name: tensor`` item of ``tensors`` in one call (PutNames).

        All or nothing: when an item fails (a name that exists without ``overwrite``, a
        tensor of another client, the tenant's name limit) no name changes, and the error
        is that item's own, its text prefixed ``item N ('name'): ``.  At most
        ``tensord.protocol.MAX_NAME_ITEMS`` (1,024) items, each name once (a mapping's
        keys).  Data that is not a tensor is staged as ``put`` stages it (4 MiB in all; the
        rest is uploaded first).  In a cluster every tensor must be on this client's node.
        """
        items = list(tensors.items())
        check_limit(len(items), "MAX_NAME_ITEMS", "put_many() got {} items")
        for name, _ in items:
            _text("name", name)
        if items:
            self._put_items(items, overwrite, "PutNames")

    def _put_items(self, items: list[tuple[str, Any]], overwrite: bool, method: str) -> None:
        """Name each item's tensor (``method``: PutName for one, PutNames): a tensor as it
        is, data staged where it fits, else uploaded; in one call."""
        self._forget_holders(name for name, _ in items)  # a get reads this put's
        arrays: dict[int, tuple[np.ndarray, DType]] = {}
        for index, (_, data) in enumerate(items):
            if not isinstance(data, Tensor):
                arrays[index] = _convert.as_array(data)
        staging = None
        offsets: dict[int, int] = {}
        uploaded: list[Tensor] = []  # held until named
        if arrays and self._local.enabled:
            places, used = transfers.staged_offsets([a.nbytes for a, _ in arrays.values()])
            offsets = {i: o for i, o in zip(arrays, places, strict=True) if o is not None}
            staging = self._staging(used) if offsets else None
            if staging is None:
                offsets = {}
        try:
            named = []
            for index, (name, data) in enumerate(items):
                if index in offsets:
                    assert staging is not None
                    array, dt = arrays[index]
                    staging.write(offsets[index], array)
                    handle = own(self, staging.tensor, 0)
                    named.append(
                        requests.put_staged(
                            name, handle, offsets[index], array.shape, dt.name, overwrite
                        )
                    )
                    continue
                if index in arrays:
                    data = self._upload(*arrays[index], "cpu", False)
                    uploaded.append(data)
                named.append(requests.put_name(name, own(self, data, index), overwrite))
            if method == "PutName":
                self._call("PutName", named[0])
            else:
                self._call("PutNames", requests.put_names(named))
        except errors.TensordError:
            if staging is not None:
                self._stagings.give_back(staging)
            raise
        except BaseException:
            # an interrupt: the call may still be running on its worker, reading the
            # staging tensor, which no later put may write into: it is dropped
            raise
        else:
            if staging is not None:
                self._stagings.give_back(staging)

    def _staging(self, nbytes: int) -> transfers.Staging | None:
        """A staging tensor of at least ``nbytes`` (pooled, else made: EmptyExport), or
        None where this client cannot map the server's memory."""
        session_id = self._conn.session_id
        pooled = self._stagings.take(nbytes, session_id)
        if pooled is not None:
            return pooled
        size = transfers.staging_bytes(nbytes)
        made = self._local.empty_exported(requests.empty((size,), "uint8", "cpu", False), False)
        exported = self._wrap_exported(made)
        if exported is None:
            return None
        return transfers.Staging(*exported, size, session_id)

    def _wrap_exported(self, made: Any) -> tuple[Tensor, Export] | None:
        """The tensor and cpu export an EmptyExport made, or None (its tensor dropped, so
        released; any other kind of export closed) where it made no cpu export."""
        if made is None:
            return None
        meta, export = made
        tensor = self._wrap(meta)
        if not isinstance(export, Export):
            if export is not None:
                export.close()
            return None
        return tensor, export

    def get(self, name: str) -> Tensor:
        """This session's handle on the tensor named ``name`` (``put`` by any session of this
        tenant).

        The handle shares the named tensor's Storage: no bytes are copied.  One RPC; on
        the server's host it also brings the Storage's export, so a ``np.from_dlpack`` or
        ``x.numpy()`` of the tensor soon after it needs no other call (the client holds
        that export, a pin, for about a second, then lets it go unless an array uses it).

        In a cluster, a name another node holds is that node's tensor: the client opens its
        own session there (once, when first needed) and the handle lives on that node;
        if the node is lost, its tensors raise ``tensord.NodeLostError``.  The client
        remembers the holder (up to ``MAX_REMEMBERED_HOLDERS`` names): the next ``get`` of
        the name goes straight there, one call, and a holder that no longer has it sends
        the client on (the redirect) or back to its own node (not found there).

        Raises:
            NotFoundError: no tensor has that name.
        """
        name = _text("name", name)
        holder = self._remembered_holder(name)
        if holder is not None:  # where a redirect sent this client before: straight there
            try:
                return holder._get_here(name)
            except errors.OwnedElsewhereError as redirect:  # it moved: the holder says where
                return self._follow(name, redirect)
            except (errors.NotFoundError, errors.NodeLostError):
                self._forget_holders((name,))  # gone from there: ask this client's node
        try:
            return self._get_here(name)
        except errors.OwnedElsewhereError as redirect:
            return self._follow(name, redirect)

    def _follow(self, name: str, redirect: errors.OwnedElsewhereError) -> Tensor:
        """``get`` of ``name`` from the node ``redirect`` names (followed once), which is
        remembered as its holder for the next ``get``."""
        peer = self._peer(redirect)
        got = peer._get_here(name)
        with self._peers_lock:
            self._holders[name] = redirect.node or ""
            self._holders.move_to_end(name)
            while len(self._holders) > MAX_REMEMBERED_HOLDERS:
                self._holders.popitem(last=False)
        return got

    def _remembered_holder(self, name: str) -> Client | None:
        """This client's open session on the node last found holding ``name``, if any."""
        with self._peers_lock:
            node = self._holders.get(name)
            if node is None:
                return None
            peer = self._peers.get(node)
            if peer is None or peer.closed:
                del self._holders[name]
                return None
            self._holders.move_to_end(name)
            return peer

    def _forget_holders(self, names: Iterable[str]) -> None:
        """Forget where ``names`` were held (this client puts or deletes them itself)."""
        with self._peers_lock:
            for name in names:
                self._holders.pop(name, None)

    def _get_here(self, name: str) -> Tensor:
        """``get`` from this client's own server (OwnedElsewhereError: another node's)."""
        try:
            got = self._local.get_exported(name) if self._local.enabled else None
        except errors.ResourceExhaustedError:
            # the session is full, and what the client keeps for itself (the exports held
            # for earlier gets' reads, the staging tensors of puts) among what fills it:
            # they go, and the get is made again as GetName alone
            if not (self._local.let_go(every=True) | self._stagings.clear()):
                raise
            self._conn.flush_releases()
            got = None
        if got is None:
            return self._wrap(self._call("GetName", requests.get_name(name)))
        tensor = self._wrap(got[0])  # its export stays with the mapper for the reads after
        if got[1] is not None:
            self._local.hold_while(tensor, got[0].storage_id)  # ... while the tensor lives
        return tensor

    def get_many(self, names: Iterable[str]) -> list[Tensor]:
        """``get`` of every name in one call (GetNames): this session's handles, in order.

        All or nothing: a name that does not exist raises its item's error (its text
        prefixed ``item N ('name'): ``) and no handle is made.  At most
        ``tensord.protocol.MAX_NAME_ITEMS`` (1,024) names.  On the server's host the one
        call also brings every Storage's export, held for the reads after it as ``get``'s
        (none when the session has no room for them: the handles stand).  In a cluster,
        names another node holds are got one by one from their nodes.
        """
        wanted = [_text("name", n) for n in names]
        check_limit(len(wanted), "MAX_NAME_ITEMS", "get_many() got {} names")
        if not wanted:
            return []
        try:
            answer = self._get_many_here(wanted)
        except errors.OwnedElsewhereError:
            return [self.get(n) for n in wanted]
        tensors = [self._wrap(meta) for meta in answer.tensors]
        if answer.exports:
            for tensor, meta in zip(tensors, answer.tensors, strict=True):
                self._local.hold_while(tensor, meta.storage_id)
        return tensors

    def _get_many_here(self, names: list[str]) -> Any:
        """GetNames on this client's own server; on its host with the exports in the same
        answer (held for the reads after, as ``get``'s)."""
        if self._local.enabled:
            try:
                return self._local.get_many_exported(names)
            except errors.ResourceExhaustedError:
                # the session is full, what the client keeps for itself among what fills
                # it, as in _get_here: that goes, and the get is made again without exports
                if not (self._local.let_go(every=True) | self._stagings.clear()):
                    raise
                self._conn.flush_releases()
        return self._conn.call("GetNames", requests.get_names(names), self._release_all_got)

    def _release_all_got(self, answer: Any) -> None:
        """A GetNames answer its interrupted caller never saw: its handles go back."""
        for meta in answer.tensors:
            self._conn.queue_release(meta.handle)

    def delete(self, name: str, *, wait: bool = True) -> None:
        """Remove the name ``name``; its Storage lives on while a handle still holds it.

        ``wait=False`` with pipelining: the delete is queued with the views and writes and
        sent in order with them, and returns at once; its error (a name that does not
        exist, or in a cluster one another node holds) is raised at the next call that
        waits for the server, naming it, as a queued write's.

        Raises:
            NotFoundError: no tensor has that name.
        """
        name = _text("name", name)
        self._forget_holders((name,))
        request = requests.delete_name(name)
        if not wait and self._conn.pipelining:
            self._conn.enqueue("DeleteName", "delete", name, request)
            return
        try:
            self._call("DeleteName", request)
        except errors.OwnedElsewhereError as redirect:
            self._peer(redirect)._call("DeleteName", request)  # followed once

    def delete_many(self, names: Iterable[str], *, wait: bool = True) -> None:
        """``delete`` of every name in one call (DeleteNames).

        All or nothing: a name that does not exist (or appears twice) raises its item's
        error, its text prefixed ``item N ('name'): ``, and no name is deleted.  At most
        ``tensord.protocol.MAX_NAME_ITEMS`` (1,024) names.  ``wait=False`` with
        pipelining queues the one delete of them all, as ``delete`` queues its one (all or
        nothing still; its error is raised at the next call that waits).  In a cluster every name must be this client's node's: one
        another node holds fails its item with OwnedElsewhereError (``delete`` follows it).
        """
        doomed = [_text("name", n) for n in names]
        check_limit(len(doomed), "MAX_NAME_ITEMS", "delete_many() got {} names")
        self._forget_holders(doomed)
        if not doomed:
            return
        if not wait and self._conn.pipelining:
            what = f"{doomed[0]!r} and {len(doomed) - 1} more" if len(doomed) > 1 else doomed[0]
            self._conn.enqueue("DeleteNames", "delete_many", what, requests.delete_names(doomed))
            return
        self._call("DeleteNames", requests.delete_names(doomed))

    def nodes(self) -> list[dict[str, Any]]:
        """The live nodes of the cluster this client's server joined, sorted by id.

        Returns:
            A dict per node: its ``node`` id, ``address``, ``devices`` (each a dict of
                ``device`` and ``capacity_bytes``), ``version``, ``incarnation`` (new
                each time the node joins) and ``self`` (True for this client's server).

        Raises:
            FailedPreconditionError: the server is not part of a cluster.
            ClusterUnavailableError: the server cannot reach etcd now.
        """
        return self._listed_nodes()

    def _listed_nodes(self, looking_for: str = "") -> list[dict[str, Any]]:
        """:meth:`nodes`; ``looking_for``: a node id the server reads etcd again for when
        its members in memory lack it (one that joined a moment ago)."""
        answer = self._call("ListNodes", requests.list_nodes(looking_for))
        return [
            {
                "node": n.node,
                "address": n.address,
                "devices": [
                    {"device": d.device, "capacity_bytes": d.capacity_bytes} for d in n.devices
                ],
                "version": n.version,
                "incarnation": n.incarnation,
                "self": n.node == answer.node,
            }
            for n in answer.nodes
        ]

    def node(self, node: str) -> Client:
        """This client's session on ``node`` (its ``--node-id``) of the cluster: this client
        itself for its own server's node, else a client on that node's advertised address,
        opened on first use with this client's own options (token, TLS, timeouts) and
        closed with this one.

        Raises:
            NotFoundError: no live node has that id.
            NodeLostError: the node is listed but does not answer.
        """
        with self._peers_lock:
            known = self._peers.get(node)
        if known is not None and not known.closed:
            return known  # a node lost since answers NodeLostError at its first call
        listed = {n["node"]: n for n in self._listed_nodes(node)}
        found = listed.get(node)
        if found is None:
            raise errors.NotFoundError(
                f"no live node {node!r} in the cluster (live: {', '.join(sorted(listed))})"
            )
        if found["self"]:
            return self
        return self._peer_at(node, found["address"])

    def _peer(self, redirect: errors.OwnedElsewhereError) -> Client:
        """This client's session on the node ``redirect`` names."""
        return self._peer_at(redirect.node or "", redirect.address or "")

    def _peer_at(self, node: str, address: str) -> Client:
        """This client's session on ``node`` at ``address``, opened on first use with this
        client's own options (token, TLS, timeouts)."""
        with self._peers_lock:
            peer = self._peers.get(node)
            if peer is not None and peer.address == address and not peer.closed:
                return peer
        try:
            peer = Client(address, **self._options)
        except errors.UnavailableError as exc:
            raise wire_status.node_lost(node, address, str(exc)) from None
        peer._conn.node = node
        with self._peers_lock:
            current = self._peers.get(node)
            chosen: Client = peer
            spare: Client | None = current
            if current is not None and current.address == address and not current.closed:
                chosen, spare = current, peer  # another thread opened one meanwhile
            else:
                self._peers[node] = peer
        if spare is not None:
            spare.close()
        return chosen

    def names(self) -> list[str]:
        """The names of this tenant's tensors, sorted (fetched a page at a time)."""
        names: list[str] = []
        token = ""
        while True:
            request = requests.list_names(MAX_PAGE_SIZE, token)
            page = self._call("ListNames", request)
            names.extend(page.names)
            token = page.next_page_token
            if not token:
                return names

    # ---- the pool --------------------------------------------------------------------------

    def memory_stats(self, device: Any = "cpu") -> dict[str, int | float]:
        """torch.cuda.memory_stats(): torch's key names, sorted as torch returns them."""
        response = self._call("MemoryStats", requests.device(device_name(device)))
        merged: dict[str, int | float] = {**response.counters, **response.ratios}
        return dict(sorted(merged.items()))

    def memory_allocated(self, device: Any = "cpu") -> int:
        """Return the current memory occupied by tensors in bytes for a given device.

        The ``allocated_bytes.all.current`` of ``memory_stats(device)``: the whole server's pool for
        that device (this tenant's own bytes are its ``tenant.allocated_bytes.current``).  Read from
        the server's caching pool by one RPC.
        """
        return int(self.memory_stats(device).get("allocated_bytes.all.current", 0))

    def memory_reserved(self, device: Any = "cpu") -> int:
        """Return the current memory managed by the caching allocator in bytes for a given device.

        The ``reserved_bytes.all.current`` of ``memory_stats(device)``: the whole server's pool for
        that device.  Read from the server's caching pool by one RPC.
        """
        return int(self.memory_stats(device).get("reserved_bytes.all.current", 0))

    def memory_summary(self, device: Any = "cpu") -> str:
        """Return a human-readable printout of the current memory allocator statistics for a given
        device.

        A table like torch.cuda.memory_summary()'s, of the server's pool for ``device``.  Read
        from the server's caching pool by one RPC.
        """
        response = self._call("MemorySummary", requests.device(device_name(device)))
        return str(response.summary)

    def memory_snapshot(self, device: Any = "cpu") -> dict[str, Any]:
        """torch.cuda.memory._snapshot()'s structure; pickle it for PyTorch's memory_viz."""
        device = device_name(device)
        snapshot: dict[str, Any] | None = None
        token = ""
        while True:
            request = requests.memory_snapshot(device, MAX_PAGE_SIZE, token)
            response = self._call("MemorySnapshot", request)
            page: dict[str, Any] = json.loads(response.snapshot_json)
            if snapshot is None:
                snapshot = page
            else:
                _join_snapshot_page(snapshot, page)
            token = response.next_page_token
            if not token:
                return snapshot

    def prefetch(self, tensors: Iterable[Tensor]) -> int:
        """Hint that ``tensors`` are used soon: the server starts restoring those whose
        Storages it spilled to a lower tier, off this call; the count it queued."""
        handles = [t.handle for t in tensors]
        queued = 0
        for start in range(0, len(handles), MAX_RELEASE_HANDLES):
            chunk = handles[start : start + MAX_RELEASE_HANDLES]
            queued += int(self._call("Prefetch", requests.prefetch(chunk)).queued)
        return queued

    def empty_cache(self, device: Any = "cpu") -> int:
        """Return cached, unused segments to the device; the bytes released."""
        response = self._call("EmptyCache", requests.device(device_name(device)))
        return int(response.released_bytes)

    def server_info(self) -> dict[str, Any]:
        """What the server says about itself: one ServerInfo RPC.

        Returns:
            A dict with the server's ``version``, its ``devices`` (each a dict of
                ``device``, ``capacity_bytes`` and ``description``),
                ``max_message_bytes`` and ``chunk_bytes``.
        """
        info = self._call("ServerInfo", requests.server_info())
        return {
            "version": info.version,
            "devices": [
                {
                    "device": d.device,
                    "capacity_bytes": d.capacity_bytes,
                    "description": d.description,
                }
                for d in info.devices
            ],
            "max_message_bytes": info.max_message_bytes,
            "chunk_bytes": info.chunk_bytes,
        }


def _join_snapshot_page(snapshot: dict[str, Any], page: dict[str, Any]) -> None:
    """Add a later page of a paged MemorySnapshot to the pages before it (the proto's
    rules): a first segment with the last one's address holds more of that segment's blocks;
    the trace entries follow those before them."""
    segments = page.get("segments", [])
    if segments and snapshot["segments"]:
        last = snapshot["segments"][-1]
        if segments[0]["address"] == last["address"]:
            last["blocks"].extend(segments.pop(0)["blocks"])
    snapshot["segments"].extend(segments)
    for trace, entries in zip(snapshot["device_traces"], page["device_traces"], strict=False):
        trace.extend(entries)


def _client_of(tensors: Sequence[Any]) -> Client:
    first = tensors[0]
    if not isinstance(first, Tensor):
        raise errors.TensordTypeError(
            f"expected Tensor as element 0 in argument 0, but got {type(first).__name__}"
        )
    return cast(Client, first.client)  # a Tensor's client is a Client


def cat(tensors: Iterable[Tensor], dim: int = 0) -> Tensor:
    """torch.cat, on the server of the tensors' client."""
    items = list(tensors)
    if not items:
        raise errors.InvalidArgumentError("torch.cat(): expected a non-empty list of Tensors")
    return _client_of(items).cat(items, dim)


def stack(tensors: Iterable[Tensor], dim: int = 0) -> Tensor:
    """torch.stack, on the server of the tensors' client."""
    items = list(tensors)
    if not items:
        raise errors.TensordRuntimeError("stack expects a non-empty TensorList")
    return _client_of(items).stack(items, dim)
