"""Every protobuf message the SDK sends, built here from plain values.

The rest of the SDK speaks torch's terms (a dim, a shape, a dtype name, a handle) and
hands them to one function here per message; what comes back is opaque to it and goes
to the connection as is.  A view's op is a :data:`ViewOp`: the ViewRequest field it goes
in, and that field's message, built at the call (so a value the wire cannot carry is
refused there, not at a later flush) and copied into its BatchOp when its Batch is built.
"""

from __future__ import annotations

import builtins
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from tensord import schema as pb
from tensord._convert import as_scalar
from tensord._indexing import is_sequence
from tensord.wire.pipeline import QueuedOp

#: a view op: (its ViewRequest field, that field's message)
ViewOp = tuple[str, Any]

# ---- values --------------------------------------------------------------------------


def scalar(value: Any) -> pb.Scalar:
    """A Python (or NumPy) number as the wire's Scalar."""
    value = as_scalar(value)
    if isinstance(value, builtins.bool):
        return pb.Scalar(bool_value=value)
    if isinstance(value, builtins.int):
        return _int_scalar(value)
    if isinstance(value, builtins.float):
        return pb.Scalar(float_value=value)
    return pb.Scalar(complex_value=pb.Complex(real=value.real, imag=value.imag))


def _int_scalar(value: builtins.int) -> pb.Scalar:
    """A Python int as torch makes it a Scalar: int64, else uint64, else its OverflowError
    (THPUtils_unpackLong, then PyLong_AsUnsignedLongLong), whatever the tensor's dtype."""
    if -(1 << 63) <= value < 1 << 63:
        return pb.Scalar(int_value=value)
    if value < 0:
        raise OverflowError("can't convert negative int to unsigned")
    if value >= 1 << 64:
        raise OverflowError("int too big to convert")
    return pb.Scalar(uint_value=value)


def index_item(item: Any) -> pb.IndexItem:
    """One item of a basic index (an int, a slice, None or Ellipsis)."""
    if item is None:
        return pb.IndexItem(none=True)
    if item is Ellipsis:
        return pb.IndexItem(ellipsis=True)
    if isinstance(item, slice):
        return pb.IndexItem(slice=pb.Slice(start=item.start, stop=item.stop, step=item.step))
    return pb.IndexItem(integer=item)


def index_items(key: Any) -> list[pb.IndexItem]:
    """A basic index (ints, slices, None, Ellipsis) as the wire's IndexItems."""
    items = key if isinstance(key, tuple) else (key,)
    return [index_item(item) for item in items]


def advanced_items(
    items: tuple[Any, ...],
    is_tensor: Callable[[Any], bool],
    handle_of: Callable[[Any], str],
) -> list[pb.AdvancedIndexItem]:
    """An advanced index's items: tensors (and lists/arrays, uploaded by ``handle_of``) by
    handle, Python bools, and basic items."""
    out = []
    for item in items:
        if isinstance(item, builtins.bool):
            out.append(pb.AdvancedIndexItem(boolean=item))
        elif is_tensor(item) or is_sequence(item):
            out.append(pb.AdvancedIndexItem(tensor=handle_of(item)))
        else:
            out.append(pb.AdvancedIndexItem(basic=index_item(item)))
    return out


# ---- view ops: a ViewRequest field and its message -------------------------------------

# x[i]'s op for the small ints (read only: a Batch copies it into its op)
_INT_INDEXES: dict[builtins.int, ViewOp] = {}
_INT_INDEX_CACHED = 1 << 12


def int_index(key: builtins.int) -> ViewOp:
    """``x[key]`` for an int ``key``, the commonest view."""
    op = _INT_INDEXES.get(key)
    if op is None:
        op = ("index", pb.Index(items=(pb.IndexItem(integer=key),)))
        if -_INT_INDEX_CACHED <= key < _INT_INDEX_CACHED:
            _INT_INDEXES[key] = op
    return op


def index(key: Any) -> ViewOp:
    """A basic index (ints, slices, None, Ellipsis)."""
    return ("index", pb.Index(items=index_items(key)))


def view_shape(shape: Sequence[builtins.int]) -> ViewOp:
    return ("view", pb.ViewShape(shape=shape))


def view_dtype(dtype: str) -> ViewOp:
    return ("view_dtype", pb.ViewDtype(dtype=dtype))


def narrow(dim: builtins.int, start: builtins.int, length: builtins.int) -> ViewOp:
    return ("narrow", pb.Narrow(dim=dim, start=start, length=length))


def select(dim: builtins.int, index: builtins.int) -> ViewOp:
    return ("select", pb.Select(dim=dim, index=index))


def transpose(dim0: builtins.int, dim1: builtins.int) -> ViewOp:
    return ("transpose", pb.Transpose(dim0=dim0, dim1=dim1))


def t() -> ViewOp:
    return ("t", pb.T())


def permute(dims: Sequence[builtins.int]) -> ViewOp:
    return ("permute", pb.Permute(dims=dims))


def movedim(source: Sequence[builtins.int], destination: Sequence[builtins.int]) -> ViewOp:
    return ("movedim", pb.Movedim(source=source, destination=destination))


def expand(shape: Sequence[builtins.int]) -> ViewOp:
    return ("expand", pb.Expand(shape=shape))


def squeeze(dims: Sequence[builtins.int] | None) -> ViewOp:
    """squeeze(): every dim of size 1 when ``dims`` is None."""
    if dims is None:
        return ("squeeze", pb.Squeeze())
    return ("squeeze", pb.Squeeze(dims=pb.IntList(values=dims)))


def unsqueeze(dim: builtins.int) -> ViewOp:
    return ("unsqueeze", pb.Unsqueeze(dim=dim))


def flatten(start_dim: builtins.int, end_dim: builtins.int) -> ViewOp:
    return ("flatten", pb.Flatten(start_dim=start_dim, end_dim=end_dim))


def unflatten(dim: builtins.int, sizes: Sequence[builtins.int]) -> ViewOp:
    return ("unflatten", pb.Unflatten(dim=dim, sizes=sizes))


def split(split_size: builtins.int, dim: builtins.int) -> ViewOp:
    """split(int): equal parts of ``split_size`` (the last may be smaller)."""
    return ("split", pb.Split(split_size=split_size, dim=dim))


def split_sections(sections: Sequence[builtins.int], dim: builtins.int) -> ViewOp:
    """split(list): a part of each size in ``sections``."""
    return ("split", pb.Split(sections=pb.IntList(values=sections), dim=dim))


def chunk(chunks: builtins.int, dim: builtins.int) -> ViewOp:
    return ("chunk", pb.Chunk(chunks=chunks, dim=dim))


def unbind(dim: builtins.int) -> ViewOp:
    return ("unbind", pb.Unbind(dim=dim))


def diagonal(offset: builtins.int, dim1: builtins.int, dim2: builtins.int) -> ViewOp:
    return ("diagonal", pb.Diagonal(offset=offset, dim1=dim1, dim2=dim2))


def as_strided(
    size: Sequence[builtins.int],
    stride: Sequence[builtins.int],
    storage_offset: builtins.int | None,
) -> ViewOp:
    """as_strided: ``storage_offset`` None keeps the input's offset."""
    return (
        "as_strided",
        pb.AsStrided(size=size, stride=stride, storage_offset=storage_offset),
    )


def detach() -> ViewOp:
    return ("detach", pb.Detach())


def set_requires_grad(requires_grad: builtins.bool, by_write: builtins.bool = False) -> ViewOp:
    """The flag as a view op (a new handle with it); ``by_write``: set because a value
    that requires grad was written in (allowed on any dtype)."""
    return (
        "set_requires_grad",
        pb.SetRequiresGrad(requires_grad=requires_grad, by_write=by_write),
    )


def complex_view(name: str) -> ViewOp:
    """A complex view or lazy bit ("real", "imag", "conj", "view_as_real", ...)."""
    return ("complex_view", pb.ComplexView(op=name))


def view(handle: str, op: ViewOp) -> pb.ViewRequest:
    """The View RPC of ``op`` on ``handle``."""
    request = pb.ViewRequest(handle=handle)
    getattr(request, op[0]).CopyFrom(op[1])
    return request


# ---- tensors' other requests --------------------------------------------------------------


def handle(handle: str) -> pb.HandleRequest:
    return pb.HandleRequest(handle=handle)


def reshape(handle: str, shape: Sequence[builtins.int]) -> pb.ReshapeRequest:
    return pb.ReshapeRequest(handle=handle, shape=shape)


def clone(handle: str, memory_format: str) -> pb.CloneRequest:
    return pb.CloneRequest(handle=handle, memory_format=memory_format)


def repeat(handle: str, repeats: Sequence[builtins.int]) -> pb.RepeatRequest:
    return pb.RepeatRequest(handle=handle, repeats=repeats)


def to(handle: str, device: str, dtype: str, copy: builtins.bool) -> pb.ToRequest:
    """To: ``device`` and ``dtype`` "" where they stay."""
    return pb.ToRequest(handle=handle, device=device, dtype=dtype, copy=copy)


def share(handle: str, uses: builtins.int | None, ttl: builtins.float | None) -> pb.ShareRequest:
    """Share: ``uses`` None for any number of attaches, ``ttl`` None for the server's."""
    return pb.ShareRequest(
        handle=handle,
        uses=0 if uses is None else uses,
        unlimited_uses=uses is None,
        ttl_seconds=0.0 if ttl is None else ttl,
    )


def copy(dst: str, src: str) -> pb.CopyRequest:
    return pb.CopyRequest(dst=dst, src=src)


def fill(handle: str, value: Any) -> pb.FillRequest:
    return pb.FillRequest(handle=handle, value=scalar(value))


def set_item(
    handle: str, index: list[pb.IndexItem], *, src: str | None = None, value: Any = None
) -> pb.SetItemRequest:
    """``x[index] = src`` (a handle) or ``= value`` (a number); ``index`` from
    :func:`index_items`."""
    request = pb.SetItemRequest(handle=handle, index=index)
    if src is not None:
        request.src_handle = src
    else:
        request.scalar.CopyFrom(scalar(value))
    return request


def advanced_index(
    handle: str, items: list[pb.AdvancedIndexItem], raw: builtins.bool, op: str
) -> pb.AdvancedIndexRequest:
    return pb.AdvancedIndexRequest(handle=handle, index=items, raw=raw, op=op)


def advanced_set_item(
    handle: str,
    items: list[pb.AdvancedIndexItem],
    *,
    raw: builtins.bool,
    accumulate: builtins.bool,
    value_requires_grad: builtins.bool,
    src: str | None = None,
    value: Any = None,
) -> pb.AdvancedSetItemRequest:
    """``x[items] = src`` (a handle) or ``= value`` (a number)."""
    request = pb.AdvancedSetItemRequest(
        handle=handle,
        index=items,
        raw=raw,
        accumulate=accumulate,
        value_requires_grad=value_requires_grad,
    )
    if src is not None:
        request.src_handle = src
    else:
        request.scalar.CopyFrom(scalar(value))
    return request


def resize(handle: str, size: Sequence[builtins.int], memory_format: str) -> pb.ResizeRequest:
    return pb.ResizeRequest(handle=handle, size=size, memory_format=memory_format)


def set_storage(
    handle: str,
    source: str | None,
    *,
    source_is_storage: builtins.bool = False,
    storage_offset: builtins.int | None = None,
    size: Sequence[builtins.int] | None = None,
    stride: Sequence[builtins.int] | None = None,
) -> pb.SetStorageRequest:
    """set_(): ``source`` None empties the tensor; else it views the source's Storage,
    at ``storage_offset`` with ``size`` (and ``stride``) when given."""
    request = pb.SetStorageRequest(handle=handle)
    if source is None:
        return request
    request.source = source
    request.source_is_storage = source_is_storage
    if size is not None:
        request.storage_offset = storage_offset or 0
        request.size.values.extend(size)
        if stride is not None:
            request.stride.values.extend(stride)
    return request


# ---- factories, names, the pool ---------------------------------------------------------


def upload_header(
    shape: Sequence[builtins.int],
    dtype: str,
    device: str,
    nbytes: builtins.int,
    requires_grad: builtins.bool,
) -> pb.UploadHeader:
    return pb.UploadHeader(
        shape=shape, dtype=dtype, device=device, nbytes=nbytes, requires_grad=requires_grad
    )


def empty(
    shape: Sequence[builtins.int],
    dtype: str,
    device: str,
    requires_grad: builtins.bool = False,
    stride: Sequence[builtins.int] | None = None,
) -> pb.EmptyRequest:
    """Empty (empty_strided when ``stride`` is given)."""
    request = pb.EmptyRequest(shape=shape, dtype=dtype, device=device, requires_grad=requires_grad)
    if stride is not None:
        request.stride.values.extend(stride)
    return request


def full(
    shape: Sequence[builtins.int],
    dtype: str,
    device: str,
    value: Any,
    requires_grad: builtins.bool,
) -> pb.FullRequest:
    """Full: ``dtype`` "" for the one torch infers from ``value``."""
    return pb.FullRequest(
        shape=shape, dtype=dtype, device=device, value=scalar(value), requires_grad=requires_grad
    )


def arange(
    start: Any, end: Any, step: Any, dtype: str, device: str, requires_grad: builtins.bool
) -> pb.ArangeRequest:
    """Arange: ``dtype`` "" for the one torch infers from the arguments."""
    return pb.ArangeRequest(
        start=scalar(start),
        end=scalar(end),
        step=scalar(step),
        dtype=dtype,
        device=device,
        requires_grad=requires_grad,
    )


def join(handles: Sequence[str], dim: builtins.int) -> pb.CatRequest:
    """Cat or Stack of ``handles`` along ``dim``."""
    return pb.CatRequest(handles=handles, dim=dim)


def attach(token: str) -> pb.AttachRequest:
    return pb.AttachRequest(token=token)


def revoke(token: str) -> pb.RevokeRequest:
    return pb.RevokeRequest(token=token)


def put_name(name: str, handle: str, overwrite: builtins.bool) -> pb.PutNameRequest:
    return pb.PutNameRequest(name=name, handle=handle, overwrite=overwrite)


def get_name(name: str) -> pb.GetNameRequest:
    return pb.GetNameRequest(name=name)


def delete_name(name: str) -> pb.DeleteNameRequest:
    return pb.DeleteNameRequest(name=name)


def put_staged(
    name: str,
    staging: str,
    byte_offset: builtins.int,
    shape: Sequence[builtins.int],
    dtype: str,
    overwrite: builtins.bool,
) -> pb.PutNameRequest:
    """A put of bytes staged at ``byte_offset`` of the tensor ``staging``."""
    staged = pb.StagedTensor(handle=staging, byte_offset=byte_offset, shape=shape, dtype=dtype)
    return pb.PutNameRequest(name=name, overwrite=overwrite, staged=staged)


def put_names(items: Sequence[pb.PutNameRequest]) -> pb.PutNamesRequest:
    return pb.PutNamesRequest(items=items)


def get_names(
    names: Sequence[str],
    export: bool = False,
    instance: str = "",
    mapped: Sequence[builtins.int] = (),
) -> pb.GetNamesRequest:
    """GetNames; ``export``: each Storage exported too (the segments this client maps of
    server ``instance`` need no ticket)."""
    if not export:
        return pb.GetNamesRequest(names=names)
    return pb.GetNamesRequest(
        names=names, export=True, server_instance=instance, mapped_segments=mapped
    )


def delete_names(names: Sequence[str]) -> pb.DeleteNamesRequest:
    return pb.DeleteNamesRequest(names=names)


def get_name_export(
    name: str, server_instance: str, mapped_segments: Sequence[builtins.int]
) -> pb.GetNameExportRequest:
    """GetNameExport: the segments this client maps of ``server_instance`` need no ticket."""
    return pb.GetNameExportRequest(
        name=name, server_instance=server_instance, mapped_segments=mapped_segments
    )


def list_names(page_size: builtins.int, page_token: str) -> pb.ListNamesRequest:
    return pb.ListNamesRequest(page_size=page_size, page_token=page_token)


def device(device: str) -> pb.DeviceRequest:
    """MemoryStats, MemorySummary, EmptyCache: the pool of ``device``."""
    return pb.DeviceRequest(device=device)


def memory_snapshot(
    device: str, page_size: builtins.int, page_token: str
) -> pb.MemorySnapshotRequest:
    return pb.MemorySnapshotRequest(device=device, page_size=page_size, page_token=page_token)


def server_info() -> pb.ServerInfoRequest:
    return pb.ServerInfoRequest()


def list_nodes(looking_for: str = "") -> pb.ListNodesRequest:
    return pb.ListNodesRequest(node=looking_for)


def copy_to_node(
    handle: str, node: str, device: str, target_session_id: str
) -> pb.CopyToNodeRequest:
    return pb.CopyToNodeRequest(
        handle=handle, node=node, device=device, target_session_id=target_session_id
    )


# ---- the session and its queues (the connection's own) -------------------------------------


def open_session(client_name: str) -> pb.OpenSessionRequest:
    return pb.OpenSessionRequest(client_name=client_name)


def close_session() -> pb.CloseSessionRequest:
    return pb.CloseSessionRequest()


def heartbeat() -> pb.Heartbeat:
    """A beat, stamped now."""
    return pb.Heartbeat(sent_at=time.time())


def release(handles: Iterable[str]) -> pb.ReleaseRequest:
    return pb.ReleaseRequest(handles=handles)


def prefetch(handles: Iterable[str]) -> pb.PrefetchRequest:
    return pb.PrefetchRequest(handles=handles)


def pin_to_device(handle: str, pinned: bool) -> pb.PinToDeviceRequest:
    return pb.PinToDeviceRequest(handle=handle, pinned=pinned)


def download(handle: str, chunk_bytes: builtins.int) -> pb.DownloadRequest:
    return pb.DownloadRequest(handle=handle, chunk_bytes=chunk_bytes)


def export(
    handle: str, server_instance: str = "", mapped_segments: Sequence[builtins.int] = ()
) -> pb.ExportRequest:
    """Export: the segments this client maps of ``server_instance`` need no ticket."""
    return pb.ExportRequest(
        handle=handle, server_instance=server_instance, mapped_segments=mapped_segments
    )


def closed_import(segment_id: builtins.int, exports: builtins.int) -> pb.ClosedImport:
    """A GPU segment's import closed here, having served ``exports`` Exports."""
    return pb.ClosedImport(segment_id=segment_id, exports=exports)


def release_exports(
    export_ids: Sequence[str],
    mapped_segments: Sequence[builtins.int],
    closed_imports: Sequence[pb.ClosedImport],
) -> pb.ReleaseExportsRequest:
    return pb.ReleaseExportsRequest(
        export_ids=export_ids, mapped_segments=mapped_segments, closed_imports=closed_imports
    )


def empty_export(
    empty: pb.EmptyRequest,
    release_handles: Sequence[str] = (),
    released_exports: pb.ReleaseExportsRequest | None = None,
) -> pb.EmptyExportRequest:
    """Empty then Export, after the releases it carries."""
    request = pb.EmptyExportRequest(empty=empty, release_handles=release_handles)
    if released_exports is not None:
        request.release_exports.CopyFrom(released_exports)
    return request


# The BatchOp field of each RPC a queued op stands for.
_BATCH_FIELDS = {
    "Fill": "fill",
    "Copy": "copy",
    "SetItem": "set_item",
    "Reshape": "reshape",
    "DeleteName": "delete_name",
    "DeleteNames": "delete_names",
}


def batch(queued: Sequence[QueuedOp], released: Sequence[str]) -> pb.BatchRequest:
    """The Batch of ``queued`` (in order), then one release of ``released`` if any: each
    BatchOp filled in place (a message passed to BatchOp() would be copied)."""
    request = pb.BatchRequest()
    add = request.ops.add
    for method, verb, handle, message, results, _ in queued:
        op = add()
        if results:
            op.results.extend(results)
        if method == "View":
            view = op.view
            view.handle = handle
            getattr(view, verb).CopyFrom(message)
        else:
            getattr(op, _BATCH_FIELDS[method]).CopyFrom(message)
    if released:
        add().release.handles.extend(released)
    return request
