"""Documented limits on every request, checked before anything touches the pool (SECURITY.md).

One pure walk over a decoded request message: list lengths, string lengths and
the integers of shapes, strides and offsets.  The layout engine and the pool do
the semantic checks (views inside their Storage, sizes against capacity); these
bounds make sure the numbers they compute with stay far from int64 overflow.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

from google.protobuf import descriptor as d
from google.protobuf.message import Message
from tensord.errors import InvalidArgumentError, ResourceExhaustedError, TensordRuntimeError
from tensord.protocol import DIM_FIELDS as DIM_FIELDS
from tensord.protocol import MAX_BATCH_OPS as MAX_BATCH_OPS
from tensord.protocol import MAX_DIMS as MAX_DIMS
from tensord.protocol import MAX_LIST_LEN as MAX_LIST_LEN
from tensord.protocol import MAX_REQUEST_ITEMS as MAX_REQUEST_ITEMS
from tensord.protocol import MAX_VIEW_RESULTS as MAX_VIEW_RESULTS
from tensord.protocol import list_limit

# The limits on lists (MAX_DIMS, MAX_LIST_LEN, MAX_VIEW_RESULTS, MAX_REQUEST_ITEMS,
# MAX_BATCH_OPS and list_limit's per-field ones) are the protocol's: the SDK checks them too.
# Names, handles, tokens, dtypes, devices, client names.
MAX_STRING_BYTES = 4096
# A listing's page_token (domain/paging.py): one holds a name of MAX_STRING_BYTES, in base64.
PAGE_TOKEN_FIELD = "page_token"
MAX_PAGE_TOKEN_BYTES = 8192
# Every integer in a shape, stride or offset: |n| <= 2**48, so a product or sum of up
# to 64 of them, times an itemsize, is checked by the pool long before int64 overflows.
MAX_EXTENT = 1 << 48
# Elements of one tensor (2**48 is also far beyond any pool's capacity).
MAX_NUMEL = 1 << 48
# Index/shape-like integer fields bounded by MAX_EXTENT.
EXTENT_FIELDS = DIM_FIELDS | frozenset({"storage_offset", "start", "length", "index", "offset"})
# Elements one op may read or write (fill_, copy_, setitem, clone, contiguous, to, cat,
# stack, repeat, reshape's copy, download, arange, full): an expanded view names 2**48 elements over one,
# and a kernel over all of them would run for hours.  `tensord serve --max-op-elements`.
DEFAULT_MAX_OP_ELEMENTS = 1 << 32
# Elements all the ops of one pipelined Batch may read or write together, each op's count
# (the one checked against --max-op-elements) added before it runs: without it one message
# held a worker for MAX_BATCH_OPS times one op's cost.  `tensord serve --max-batch-elements`.
DEFAULT_MAX_BATCH_ELEMENTS = DEFAULT_MAX_OP_ELEMENTS


def check_request(message: Message, depth: int = 0, seen: list[int] | None = None) -> None:
    """Refuse a request whose lists, strings or extents exceed the limits above, or whose
    lists hold more than MAX_REQUEST_ITEMS items together (counted as they are walked)."""
    if seen is None:
        seen = [0]
    for field, value in message.ListFields():
        kind, list_limit = _field_plan(field)
        if field.is_repeated:
            if len(value) > list_limit:
                raise InvalidArgumentError(
                    f"{message.DESCRIPTOR.name}.{field.name} has {len(value)} items; "
                    f"the limit is {list_limit}"
                )
            seen[0] += len(value)
            if seen[0] > MAX_REQUEST_ITEMS:
                raise InvalidArgumentError(
                    f"the request's lists hold more than {MAX_REQUEST_ITEMS} items together "
                    "(limits.MAX_REQUEST_ITEMS)"
                )
            if kind is not _UNBOUNDED:
                for item in value:
                    _check_value(message, field, kind, item, depth, seen)
        elif kind is not _UNBOUNDED:
            _check_value(message, field, kind, value, depth, seen)
    if _has_shape(message.DESCRIPTOR):
        numel = 1
        for n in message.shape:
            numel *= max(int(n), 0)
        if numel > MAX_NUMEL:
            # torch raises RuntimeError for a size it cannot allocate (still a ValueError here)
            raise TensordRuntimeError(f"a tensor of {numel} elements exceeds the limit {MAX_NUMEL}")


def check_batch_request(message: Message) -> None:
    """check_request for a pipelined Batch (issue 15): the same bounds, but each op that is
    ``x[i]`` (a view indexing one int, what clients queue most) bounded field by field, not
    walked: its handle and result ids (strings) and its two lists (an int item is unbounded)."""
    ops = message.ops
    if len(ops) > MAX_LIST_LEN:
        raise InvalidArgumentError(
            f"BatchRequest.ops has {len(ops)} items; the limit is {MAX_LIST_LEN}"
        )
    seen = [len(ops)]
    for op in ops:
        if not _checked_int_index_view(op, seen):
            check_request(op, 1, seen)  # as the walk checks each item of a list


def _checked_int_index_view(op: Message, seen: list[int]) -> bool:
    """Bound ``op`` as check_request would if it is a view indexing one int; False if not.
    Such an op holds no field but these: BatchOp.results, ViewRequest.handle and the one
    IndexItem's integer (oneofs: no other field of those messages can be set with them)."""
    if op.WhichOneof("op") != "view":
        return False
    view = op.view
    if view.WhichOneof("op") != "index":
        return False
    items = view.index.items
    if len(items) != 1 or items[0].WhichOneof("item") != "integer":
        return False
    _check_short_string(view, "handle", view.handle)
    results = op.results
    if len(results) > _BATCH_RESULTS:
        raise InvalidArgumentError(
            f"BatchOp.results has {len(results)} items; the limit is {_BATCH_RESULTS}"
        )
    seen[0] += 1 + len(results)
    if seen[0] > MAX_REQUEST_ITEMS:
        raise InvalidArgumentError(
            f"the request's lists hold more than {MAX_REQUEST_ITEMS} items together "
            "(limits.MAX_REQUEST_ITEMS)"
        )
    for result in results:
        _check_short_string(op, "results", result)
    return True


def _check_short_string(message: Message, name: str, value: str) -> None:
    if len(value) > _SHORT_STRING and len(value.encode()) > MAX_STRING_BYTES:
        raise InvalidArgumentError(
            f"{message.DESCRIPTOR.name}.{name} is longer than {MAX_STRING_BYTES} bytes"
        )


# What check_request bounds in a field's values, decided once per field of the schema
# (the walk runs over every op of every Batch: no per-value type tests on the hot path).
_MESSAGE, _STRING, _EXTENT, _UNBOUNDED = "message", "string", "extent", "unbounded"
_PAGE_TOKEN = "page token"
_INT_TYPES = frozenset(
    {d.FieldDescriptor.CPPTYPE_INT32, d.FieldDescriptor.CPPTYPE_INT64}
    | {d.FieldDescriptor.CPPTYPE_UINT32, d.FieldDescriptor.CPPTYPE_UINT64}
    | {d.FieldDescriptor.CPPTYPE_ENUM}
)
_FIELD_PLANS: dict[d.FieldDescriptor, tuple[str, int]] = {}
_SHAPED: dict[d.Descriptor, bool] = {}
# A str of at most this many characters is at most MAX_STRING_BYTES in UTF-8.
_SHORT_STRING = MAX_STRING_BYTES // 4
_BATCH_RESULTS = list_limit("BatchOp", "results")


def _field_plan(field: d.FieldDescriptor) -> tuple[str, int]:
    plan = _FIELD_PLANS.get(field)
    if plan is None:
        limit = list_limit(field.containing_type.name, field.name)
        if field.cpp_type == d.FieldDescriptor.CPPTYPE_MESSAGE:
            kind = _MESSAGE
        elif field.type == d.FieldDescriptor.TYPE_STRING:
            kind = _PAGE_TOKEN if field.name == PAGE_TOKEN_FIELD else _STRING
        elif field.cpp_type in _INT_TYPES and field.name in EXTENT_FIELDS:
            kind = _EXTENT
        else:
            kind = _UNBOUNDED
        plan = _FIELD_PLANS[field] = (kind, limit)
    return plan


def _has_shape(descriptor: d.Descriptor) -> bool:
    shaped = _SHAPED.get(descriptor)
    if shaped is None:
        shaped = _SHAPED[descriptor] = "shape" in descriptor.fields_by_name
    return shaped


def _check_value(
    message: Message,
    field: d.FieldDescriptor,
    kind: str,
    item: object,
    depth: int,
    seen: list[int],
) -> None:
    if kind is _MESSAGE:
        if depth < 8:
            assert isinstance(item, Message)
            check_request(item, depth + 1, seen)
    elif kind is _STRING:
        assert isinstance(item, str)
        if len(item) > _SHORT_STRING and len(item.encode()) > MAX_STRING_BYTES:
            raise InvalidArgumentError(
                f"{message.DESCRIPTOR.name}.{field.name} is longer than {MAX_STRING_BYTES} bytes"
            )
    elif kind is _PAGE_TOKEN:
        assert isinstance(item, str)
        if len(item.encode()) > MAX_PAGE_TOKEN_BYTES:
            raise InvalidArgumentError(
                f"{message.DESCRIPTOR.name}.{field.name} is longer than "
                f"{MAX_PAGE_TOKEN_BYTES} bytes"
            )
    elif abs(item) > MAX_EXTENT:  # type: ignore[arg-type]
        # a size torch cannot allocate is its RuntimeError; other fields stay ValueErrors
        error = TensordRuntimeError if field.name == "shape" else InvalidArgumentError
        raise error(f"{message.DESCRIPTOR.name}.{field.name} = {item} is outside +-{MAX_EXTENT}")


# -- what an op will produce, from the request and the input layout, before any work --------


def index_result_ndim(ndim: int, index: object) -> int:
    """Dims of ``x[index]`` (basic indexing): each int removes one, each None adds one."""
    items = index if isinstance(index, tuple) else (index,)
    ints = sum(1 for i in items if isinstance(i, int) and not isinstance(i, bool))
    nones = sum(1 for i in items if i is None)
    return ndim - ints + nones


def check_view_results(count: int) -> None:
    if count > MAX_VIEW_RESULTS:
        raise InvalidArgumentError(
            f"this view op would return {count} tensors; the limit is {MAX_VIEW_RESULTS} "
            "(limits.MAX_VIEW_RESULTS)"
        )


def check_result_ndim(ndim: int) -> None:
    if ndim > MAX_DIMS:
        raise InvalidArgumentError(
            f"the result would have {ndim} dimensions; the limit is {MAX_DIMS} (limits.MAX_DIMS)"
        )


def check_op_elements(elements: int, limit: int | None) -> None:
    """Refuse an op that would read or write more than ``limit`` elements (None: no limit),
    or that would take the running Batch (if any) over its budget."""
    if limit is not None and elements > limit:
        raise ResourceExhaustedError(
            f"this op would touch {elements} elements, over the limit (--max-op-elements {limit})"
        )
    budget = _BATCH_BUDGET.get()
    if budget is not None:
        budget.charge(elements)


@dataclass
class BatchBudget:
    """Elements the ops of one Batch have touched so far, against its limit."""

    limit: int
    spent: int = 0

    def charge(self, elements: int) -> None:
        total = self.spent + elements
        if total > self.limit:
            raise ResourceExhaustedError(
                f"this op would take its Batch to {total} elements touched, over the budget "
                f"(--max-batch-elements {self.limit}); the ops before it were applied"
            )
        self.spent = total


# The Batch the current thread is applying (its ops run one after another, on the thread
# of the call): every op's element check charges it too.
_BATCH_BUDGET: ContextVar[BatchBudget | None] = ContextVar("batch_budget", default=None)


@contextlib.contextmanager
def batch_budget(limit: int | None) -> Iterator[None]:
    """Charge the element checks of the ops run in the block to one budget (None: none)."""
    token = _BATCH_BUDGET.set(None if limit is None else BatchBudget(limit))
    try:
        yield
    finally:
        _BATCH_BUDGET.reset(token)


def check_batch_ops(count: int) -> None:
    if count > MAX_BATCH_OPS:
        raise InvalidArgumentError(
            f"a Batch of {count} ops exceeds the limit {MAX_BATCH_OPS} (limits.MAX_BATCH_OPS)"
        )
