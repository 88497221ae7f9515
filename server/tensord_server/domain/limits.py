"""Documented limits on every request, checked before anything touches the pool (SECURITY.md).

One pure walk over a decoded request message: list lengths, string lengths and
the integers of shapes, strides and offsets.  The layout engine and the pool do
the semantic checks (views inside their Storage, sizes against capacity); these
bounds make sure the numbers they compute with stay far from int64 overflow.

Every count a request names is bounded so that one call's Python work (decode, this
walk, the store's work, the reply) stays within CALL_BUDGET_MS: a call holds the GIL
for its work, so a heavier one delays every other tenant's calls and heartbeats, which
must land well within the session lease (10 s by default, 2-3 s in tests).  Each limit
is the budget over the cost per item of the heaviest call that names it, measured by
``benchmarks/bench_call_costs.py`` on one core of the reference 2-core machine:

======================  ==============================  ===========  ======  ==========
limit                   counts                          us per item  limit   ms at most
======================  ==============================  ===========  ======  ==========
MAX_CAT_INPUTS          inputs of a Cat or Stack        16-25        2,048   33-50
MAX_RELEASE_HANDLES     handles of a Release (and of    1.0-1.7      16,384  16-28
                        EmptyExport, ReleaseExports,
                        a Batch's release ops)
MAX_VIEW_RESULTS        tensors of a split/chunk/unbind 13-19        2,048   27-39
MAX_BATCH_RESULTS       tensors of a Batch's views      13-19        2,048   27-39
MAX_BATCH_OPS           ops of a Batch: x[i] / writes   17 / 35-69   1,024   18 / 36-70
MAX_INDEX_ITEMS         items of an index               3-5          129     < 1
MAX_NAME_ITEMS          names of a PutNames, GetNames   6-15         1,024   6-16
                        or DeleteNames
MAX_STAGED_ITEMS        staged items of a PutNames      110-160      256     28-41
MAX_REQUEST_ITEMS       list items of one request       0.5-1.6      32,768  16-52
======================  ==============================  ===========  ======  ==========

The limits the SDK must know live in :mod:`tensord.protocol`: it splits releases and
Batches and the results of a long split, chunk or unbind into several calls, and
refuses the rest at the call.  Element counts (a kernel's cost, not Python's) are
``--max-op-elements`` and ``--max-batch-elements``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

from google.protobuf import descriptor as d
from google.protobuf.message import Message
from tensord.errors import InvalidArgumentError, ResourceExhaustedError, TensordRuntimeError
from tensord.protocol import (
    DIM_FIELDS,
    LIST_LIMITS,
    MAX_BATCH_OPS,
    MAX_BATCH_RESULTS,
    MAX_CAT_INPUTS,
    MAX_DIMS,
    MAX_INDEX_ITEMS,
    MAX_LIST_LEN,
    MAX_MAPPED_SEGMENTS,
    MAX_NAME_ITEMS,
    MAX_RELEASE_HANDLES,
    MAX_REQUEST_ITEMS,
    MAX_STAGED_ITEMS,
    MAX_VIEW_RESULTS,
    named_list_limit,
)

# The limits on a request's lists are the protocol's (one definition, which the SDK reads
# too): LIST_LIMITS gives each repeated field its own, and names it in the refusal.
__all__ = [
    "DIM_FIELDS",
    "LIST_LIMITS",
    "MAX_BATCH_OPS",
    "MAX_BATCH_RESULTS",
    "MAX_CAT_INPUTS",
    "MAX_DIMS",
    "MAX_INDEX_ITEMS",
    "MAX_LIST_LEN",
    "MAX_MAPPED_SEGMENTS",
    "MAX_NAME_ITEMS",
    "MAX_RELEASE_HANDLES",
    "MAX_REQUEST_ITEMS",
    "MAX_STAGED_ITEMS",
    "MAX_VIEW_RESULTS",
]

# The Python work one call may do, in milliseconds (the limits above are this budget
# over the measured cost per item).
CALL_BUDGET_MS = 50
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
        kind, list_limit, limit_name = _field_plan(field)
        if field.is_repeated:
            if len(value) > list_limit:
                raise InvalidArgumentError(
                    f"{message.DESCRIPTOR.name}.{field.name} has {len(value)} items; "
                    f"the limit is {list_limit} (limits.{limit_name})"
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
    """check_request for a pipelined Batch: the same bounds, but each op that is
    ``x[i]`` (a view indexing one int, what clients queue most) bounded field by field, not
    walked: its handle and result ids (strings) and its two lists (an int item is unbounded)."""
    ops = message.ops
    check_batch_ops(len(ops))
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
    if len(results) > MAX_VIEW_RESULTS:
        raise InvalidArgumentError(
            f"BatchOp.results has {len(results)} items; the limit is {MAX_VIEW_RESULTS} "
            "(limits.MAX_VIEW_RESULTS)"
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
_FIELD_PLANS: dict[d.FieldDescriptor, tuple[str, int, str]] = {}
_SHAPED: dict[d.Descriptor, bool] = {}
# A str of at most this many characters is at most MAX_STRING_BYTES in UTF-8.
_SHORT_STRING = MAX_STRING_BYTES // 4


def list_limit(field: d.FieldDescriptor) -> tuple[int, str]:
    """The most items a request's repeated ``field`` may hold, and that limit's name
    (protocol.LIST_LIMITS, the table the SDK reads)."""
    return named_list_limit(field.containing_type.name, field.name)


def _field_plan(field: d.FieldDescriptor) -> tuple[str, int, str]:
    plan = _FIELD_PLANS.get(field)
    if plan is None:
        limit, name = list_limit(field)
        if field.cpp_type == d.FieldDescriptor.CPPTYPE_MESSAGE:
            kind = _MESSAGE
        elif field.type == d.FieldDescriptor.TYPE_STRING:
            kind = _PAGE_TOKEN if field.name == PAGE_TOKEN_FIELD else _STRING
        elif field.cpp_type in _INT_TYPES and field.name in EXTENT_FIELDS:
            kind = _EXTENT
        else:
            kind = _UNBOUNDED
        plan = _FIELD_PLANS[field] = (kind, limit, name)
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


def check_join_inputs(op: str, count: int) -> None:
    """Refuse a cat or stack of more tensors than MAX_CAT_INPUTS, before any is looked up."""
    if count > MAX_CAT_INPUTS:
        raise InvalidArgumentError(
            f"{op}(): expected at most {MAX_CAT_INPUTS} tensors, got {count} "
            f"(limits.MAX_CAT_INPUTS); {op} them in groups"
        )


def check_batch_counts(results: int, released: int) -> None:
    """Refuse a Batch whose views return more than MAX_BATCH_RESULTS tensors together, or
    whose release ops name more than MAX_RELEASE_HANDLES handles together."""
    if results > MAX_BATCH_RESULTS:
        raise InvalidArgumentError(
            f"a Batch whose views return {results} tensors exceeds the limit "
            f"{MAX_BATCH_RESULTS} (limits.MAX_BATCH_RESULTS)"
        )
    if released > MAX_RELEASE_HANDLES:
        raise InvalidArgumentError(
            f"a Batch that releases {released} handles exceeds the limit "
            f"{MAX_RELEASE_HANDLES} (limits.MAX_RELEASE_HANDLES)"
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


def check_staged_items(count: int) -> None:
    if count > MAX_STAGED_ITEMS:
        raise InvalidArgumentError(
            f"a PutNames of {count} staged items exceeds the limit {MAX_STAGED_ITEMS} "
            "(limits.MAX_STAGED_ITEMS)"
        )


def check_batch_ops(count: int) -> None:
    if count > MAX_BATCH_OPS:
        raise InvalidArgumentError(
            f"a Batch of {count} ops exceeds the limit {MAX_BATCH_OPS} (limits.MAX_BATCH_OPS)"
        )
