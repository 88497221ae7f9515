"""Wire messages <-> domain values: the protobuf side of every request and reply.

Decoding bounds a request before anything else reads it (:func:`decode_message`
-> ``limits.check_request``); the rest turns messages into the plain Python
values the domain takes (scalars, indices, view ops) and the domain's results
into messages (:func:`encode_meta`).  No handler logic here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from google.protobuf.message import DecodeError, Message
from tensord import schema as pb
from tensord.errors import InvalidArgumentError
from tensord.layout import COMPLEX_VIEW_OPS

from tensord_server.domain import limits
from tensord_server.domain.kernels import Scalar
from tensord_server.domain.ops import batch
from tensord_server.domain.ops.context import Issued
from tensord_server.domain.ops.indexing import TensorItem
from tensord_server.domain.ops.views import ViewOp, index_key

M = TypeVar("M", bound=Message)


def decode_message(cls: type[M], data: bytes) -> M:
    """A request message from the wire; malformed bytes are the caller's fault (INVALID_ARGUMENT)."""
    message: M = cls()
    try:
        message.ParseFromString(data)
    except DecodeError as exc:
        raise InvalidArgumentError(f"malformed {cls.DESCRIPTOR.full_name}: {exc}") from None
    if isinstance(message, pb.BatchRequest):  # the same bounds, its x[i] ops checked faster
        limits.check_batch_request(message)
    else:
        limits.check_request(message)  # bounded before anything reaches the pool
    return message


def encode_meta(issued: Issued) -> pb.TensorMeta:
    ref = issued.ref
    return pb.TensorMeta(
        handle=issued.handle,
        shape=ref.layout.shape,
        stride=ref.layout.stride,
        storage_offset=ref.layout.offset,
        dtype=ref.dtype.name,
        device=ref.device.name,
        requires_grad=ref.requires_grad,
        storage_id=ref.storage.id,
        storage_nbytes=ref.storage.nbytes,
        storage_data_ptr=ref.storage.data_ptr,
        is_conj=ref.conj,
        is_neg=ref.neg,
    )


def decode_scalar(message: pb.Scalar) -> Scalar:
    kind = message.WhichOneof("value")
    if kind == "bool_value":
        return bool(message.bool_value)
    if kind == "int_value":
        return int(message.int_value)
    if kind == "uint_value":
        return int(message.uint_value)
    if kind == "float_value":
        return float(message.float_value)
    if kind == "complex_value":
        return complex(message.complex_value.real, message.complex_value.imag)
    raise ValueError("a Scalar must carry a value")


def decode_index_item(item: pb.IndexItem) -> Any:
    kind = item.WhichOneof("item")
    if kind == "integer":
        return int(item.integer)
    if kind == "slice":
        s = item.slice
        return slice(
            s.start if s.HasField("start") else None,
            s.stop if s.HasField("stop") else None,
            s.step if s.HasField("step") else None,
        )
    if kind == "none":
        return None
    if kind == "ellipsis":
        return Ellipsis
    raise ValueError("an IndexItem must carry an integer, a slice, None or Ellipsis")


def decode_index(items: Any) -> tuple[Any, ...]:
    return tuple(decode_index_item(item) for item in items)


# ViewRequest's oneof field -> how to turn its message into a layout-engine call.
_VIEW_DECODERS: dict[str, Callable[[Any], ViewOp]] = {
    "view": lambda m: ViewOp("view", (tuple(m.shape),)),
    "view_dtype": lambda m: ViewOp("view_dtype", (m.dtype,)),
    "narrow": lambda m: ViewOp("narrow", (m.dim, m.start, m.length)),
    "select": lambda m: ViewOp("select", (m.dim, m.index)),
    "index": lambda m: ViewOp("__getitem__", (index_key(decode_index(m.items)),)),
    "transpose": lambda m: ViewOp("transpose", (m.dim0, m.dim1)),
    "t": lambda m: ViewOp("t"),
    "permute": lambda m: ViewOp("permute", (tuple(m.dims),)),
    "movedim": lambda m: ViewOp("movedim", (tuple(m.source), tuple(m.destination))),
    "expand": lambda m: ViewOp("expand", (tuple(m.shape),)),
    "squeeze": lambda m: ViewOp("squeeze", (tuple(m.dims.values),) if m.HasField("dims") else ()),
    "unsqueeze": lambda m: ViewOp("unsqueeze", (m.dim,)),
    "flatten": lambda m: ViewOp("flatten", (m.start_dim, m.end_dim)),
    "unflatten": lambda m: ViewOp("unflatten", (m.dim, tuple(m.sizes))),
    "split": lambda m: ViewOp(
        "split",
        (m.split_size if m.WhichOneof("how") == "split_size" else tuple(m.sections.values), m.dim),
    ),
    "chunk": lambda m: ViewOp("chunk", (m.chunks, m.dim)),
    "unbind": lambda m: ViewOp("unbind", (m.dim,)),
    "diagonal": lambda m: ViewOp("diagonal", (m.offset, m.dim1, m.dim2)),
    "as_strided": lambda m: ViewOp(
        "as_strided",
        (
            tuple(m.size),
            tuple(m.stride),
            m.storage_offset if m.HasField("storage_offset") else None,
        ),
    ),
    "detach": lambda m: ViewOp("detach"),
    "set_requires_grad": lambda m: ViewOp(
        "set_requires_grad", (bool(m.requires_grad), bool(m.by_write))
    ),
    "complex_view": lambda m: ViewOp("complex_view", (decode_complex_view(m.op),)),
}


def decode_complex_view(op: str) -> str:
    """A ComplexView's op, one the layout engine knows."""
    if op not in COMPLEX_VIEW_OPS:
        raise ValueError(f"unknown complex view {op[:40]!r}")
    return op


def decode_view_op(request: pb.ViewRequest) -> ViewOp:
    kind = request.WhichOneof("op")
    if kind is None:
        raise ValueError("ViewRequest names no op")
    return _VIEW_DECODERS[kind](getattr(request, kind))


def decode_batch_op(message: pb.BatchOp) -> batch.QueuedOp:
    """One queued op of a Batch as the domain's value."""
    kind = message.WhichOneof("op")
    if kind == "view":
        view = message.view
        if view.WhichOneof("op") == "index":  # x[i], what clients queue most: read directly
            items = view.index.items
            if len(items) == 1 and items[0].WhichOneof("item") == "integer":
                op = ViewOp("__getitem__", (items[0].integer,))
                return batch.QueuedView(view.handle, op, tuple(message.results))
        return batch.QueuedView(view.handle, decode_view_op(view), tuple(message.results))
    if kind == "fill":
        return batch.QueuedFill(message.fill.handle, decode_scalar(message.fill.value))
    if kind == "copy":
        return batch.QueuedCopy(message.copy.dst, message.copy.src)
    if kind == "set_item":
        item = message.set_item
        by_handle = item.WhichOneof("value") == "src_handle"
        return batch.QueuedSetItem(
            item.handle,
            decode_index(item.index),
            None if by_handle else decode_scalar(item.scalar),
            item.src_handle if by_handle else None,
        )
    if kind == "release":
        return batch.QueuedRelease(tuple(message.release.handles))
    if kind == "reshape":
        reshape = message.reshape
        return batch.QueuedReshape(reshape.handle, tuple(reshape.shape), tuple(message.results))
    if kind == "delete_name":
        return batch.QueuedDeleteName(message.delete_name.name)
    if kind == "delete_names":
        return batch.QueuedDeleteNames(tuple(message.delete_names.names))
    raise InvalidArgumentError("a BatchOp names no op")


def decode_advanced_item(item: pb.AdvancedIndexItem) -> Any:
    kind = item.WhichOneof("item")
    if kind == "basic":
        return decode_index_item(item.basic)
    if kind == "tensor":
        return TensorItem(item.tensor)
    if kind == "boolean":
        return bool(item.boolean)
    raise ValueError("an AdvancedIndexItem must carry a basic item, a tensor or a bool")


def decode_advanced_index(items: Any) -> tuple[Any, ...]:
    return tuple(decode_advanced_item(item) for item in items)
