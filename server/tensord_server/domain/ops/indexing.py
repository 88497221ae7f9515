"""Advanced indexing: ``x[tensor]``, ``x[mask]``, ``x[idx] = v``, ``index_put_``.

Torch's two steps, mirrored so that result shapes and errors are torch's:

1. ``applySlicing`` (torch/csrc/autograd/python_variable_indexing.cpp): the basic items
   (ints, slices, None, Ellipsis) make a view; each tensor item (and a Python bool, and a
   0-dim bool tensor) is recorded at the dim it stands at, for the second step.
2. ``aten::index`` / ``aten::index_put_``: masks become their nonzero coordinates, the
   index tensors broadcast together, and the broadcast dims land where the indexed dims
   were when those are adjacent, else in front (NumPy's rule, which the array gather
   below follows once every index is an integer array).

Every cost a client controls (index tensor and mask elements, result elements) is
checked against ``--max-op-elements`` before any array work.  The work itself goes
``INDEX_CHUNK_ELEMENTS`` at a time over the broadcast index (no temporary follows the index's size): an
index tensor is read a piece of its broadcast at a time (an expanded index is never
materialised), and so are the bounds checks, the gathered values and the scattered ones,
so memory outside the pool is O(chunk) whatever the index's size.  A mask's nonzero
coordinates (torch's own temporary) live in the pool, charged to the tenant like an output.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from tensord import dtypes
from tensord.dtypes import DType
from tensord.layout import CHANNELS_LAST, Layout, broadcast_shapes

from tensord_server.devices.host_copies import gather_plan
from tensord_server.devices.table import Device
from tensord_server.domain import kernels, limits
from tensord_server.domain.kernels import Scalar
from tensord_server.domain.ops.context import Issued, OpContext
from tensord_server.domain.sessions import Session
from tensord_server.domain.storage import TensorRef

# a held tensor's zero-copy array (OpContext.array)
ArrayOf = Callable[[TensorRef], Any]
# a new int64 tensor of this contiguous shape in the pool, held for the op (a mask's nonzero)
AllocateIndex = Callable[[tuple[int, ...]], TensorRef]

# Elements of temporaries (index values, the gathered or scattered values, a mask's piece)
# that a gather or scatter makes at a time, outside the pool: it walks the broadcast index
# this many positions (divided by the elements each position moves) at a time.
INDEX_CHUNK_ELEMENTS = 1 << 20


@dataclass(frozen=True, slots=True)
class TensorItem:
    """An index item naming a tensor of the session (an integer tensor or a mask)."""

    handle: str


# an index item as decoded: int | slice | None | Ellipsis | bool (a Python bool) | TensorItem
IndexItem = Any

_INDEX_DTYPES = frozenset({"int64", "int32", "uint8", "bool"})


def _is_mask(ref: TensorRef) -> bool:
    return ref.dtype is dtypes.bool or ref.dtype is dtypes.uint8


def _fmt(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(n) for n in shape) + "]"


@dataclass(slots=True)
class _Index:
    """An index entry of aten::index's list: an index tensor, or a Python bool's
    ``[0]``/``[]`` (torch's boolToIndexingTensor)."""

    ref: TensorRef | None = None
    constant: tuple[int, ...] | None = None


def _specified_dims(items: tuple[IndexItem, ...], refs: dict[str, TensorRef]) -> int:
    """torch's count_specified_dimensions: a mask counts its dims, None/Ellipsis/bool none."""
    count = 0
    for item in items:
        if isinstance(item, TensorItem):
            ref = refs[item.handle]
            count += ref.layout.ndim if _is_mask(ref) else 1
        elif item is None or item is Ellipsis or isinstance(item, bool):
            continue
        else:
            count += 1
    return count


def _view_ndim(ndim: int, items: tuple[IndexItem, ...], refs: dict[str, TensorRef]) -> int:
    """Dims of applySlicing's view once every item is applied: an int or a 0-dim integer
    tensor takes one, a None, a Python bool or a 0-dim mask adds one."""
    for item in items:
        if item is None or isinstance(item, bool):
            ndim += 1
        elif isinstance(item, TensorItem):
            ref = refs[item.handle]
            if ref.layout.ndim == 0 and dtypes_integral(ref):
                ndim += 1 if _is_mask(ref) else -1
        elif isinstance(item, int):
            ndim -= 1
    return ndim


def _scalar_value(array: ArrayOf, ref: TensorRef) -> Any:
    return kernels.to_host(array(ref)).reshape(()).item()


def apply_slicing(
    array: ArrayOf, layout: Layout, items: tuple[IndexItem, ...], refs: dict[str, TensorRef]
) -> tuple[Layout, list[_Index | None]]:
    """torch's applySlicing: the basic view and aten::index's list (None: the whole dim)."""
    ndim = layout.ndim
    specified = _specified_dims(items, refs)  # once: every Ellipsis needs it
    if specified > ndim:
        raise IndexError(f"too many indices for tensor of dimension {ndim}")
    # bounded before the view is built: each None or bool unsqueezes it (O(dims) a time)
    limits.check_result_ndim(_view_ndim(ndim, items, refs))
    result, dim = layout, 0
    indices: list[_Index | None] = []

    def width(entry: _Index | None) -> int:
        return (
            1
            if entry is None or entry.ref is None or not _is_mask(entry.ref)
            else entry.ref.layout.ndim
        )

    def record(entry: _Index) -> None:
        # torch's recordTensorIndex: the entry stands at dim, a mask then covers its dims
        nonlocal dim
        covered = sum(width(e) for e in indices)
        indices.extend([None] * (dim - covered))
        indices.append(entry)
        dim += width(entry)

    for position, item in enumerate(items):
        if item is Ellipsis:
            dim += ndim - specified
        elif item is None:
            result = result.unsqueeze(dim)
            dim += 1
        elif isinstance(item, bool):
            result = result.unsqueeze(dim)
            record(_Index(constant=(0,) if item else ()))
        elif isinstance(item, TensorItem):
            ref = refs[item.handle]
            if ref.layout.ndim == 0 and dtypes_integral(ref):
                if not _is_mask(ref):  # a 0-dim integer tensor selects, a view
                    result = _select(result, dim, int(_scalar_value(array, ref)), position)
                else:
                    result = result.unsqueeze(dim)
                    record(_Index(constant=(0,) if _scalar_value(array, ref) else ()))
            else:
                record(_Index(ref=ref))
        elif isinstance(item, slice):
            result = result[(slice(None),) * dim + (item,)]
            dim += 1
        else:  # an int: select, the dim goes
            result = _select(result, dim, int(item), position)
    return result, indices


def _select(layout: Layout, dim: int, index: int, position: int) -> Layout:
    """layout.select(dim, index) with torch's applySelect text, which names the item's
    position in the key ("real_dim"), not the dim it selects."""
    try:
        return layout[(slice(None),) * dim + (index,)]
    except IndexError as e:
        text = str(e)
        prefix = f"index {index} is out of bounds for dimension {dim} "
        if text.startswith(prefix):
            raise IndexError(
                text.replace(f"dimension {dim} ", f"dimension {position} ", 1)
            ) from None
        raise


def dtypes_integral(ref: TensorRef) -> bool:
    return not (ref.dtype.is_floating_point or ref.dtype.is_complex)


@dataclass(frozen=True, slots=True)
class _Column:
    """One index tensor of aten's list after masks are expanded: where its values are (an
    index tensor, a mask's coordinates in the pool, or a Python bool's constant), its shape
    and torch's strides for it (the result's strides follow them)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    ref: TensorRef | None = None
    constant: tuple[int, ...] | None = None  # a Python bool's [0] or []


@dataclass(frozen=True, slots=True)
class Plan:
    """aten::index's work on a sliced tensor: one index column (or None) per dim, each read
    a piece of its broadcast to ``common`` at a time."""

    columns: tuple[_Column | None, ...]
    common: tuple[int, ...]  # the index tensors' broadcast shape
    before: int  # the result's dims in front of the broadcast dims (adjacent indices)
    shape: tuple[int, ...]  # the result's shape
    sizes: tuple[int, ...]  # the indexed dims' sizes, in order (for the bounds check)
    stride: tuple[int, ...]  # the strides torch's TensorIterator gives the gathered result

    @property
    def defined(self) -> list[_Column]:
        return [c for c in self.columns if c is not None]


def _expanded_stride(
    shape: tuple[int, ...], stride: tuple[int, ...], common: tuple[int, ...]
) -> tuple[int, ...]:
    """Tensor.expand's strides: new leading dims and broadcast size-1 dims take 0."""
    lead = len(common) - len(shape)
    out = [0] * lead
    for n, st, want in zip(shape, stride, common[lead:], strict=True):
        out.append(st if n == want else 0)
    return tuple(out)


def _dense_stride(shape: tuple[int, ...], stride: tuple[int, ...]) -> tuple[int, ...]:
    """Tensor.to(long)'s strides (preserve_format): kept when non-overlapping and dense,
    contiguous otherwise (an expanded int32 index)."""
    layout = Layout(shape, stride)
    if layout.is_non_overlapping_and_dense():
        return stride
    return Layout.contiguous(shape).stride


def _fast_setup_stride(
    shape: tuple[int, ...], operands: list[tuple[tuple[int, ...], tuple[int, ...]]]
) -> tuple[int, ...] | None:
    """TensorIterator's fast setup: inputs all of the output's shape and all contiguous
    (or all channels-last, or all dense with one set of strides) give the output that
    layout, with no reordering.  mirrors compute_fast_setup_type."""
    if any(op_shape != shape for op_shape, _ in operands):
        return None
    layouts = [Layout(op_shape, op_stride) for op_shape, op_stride in operands]
    if all(lay.is_contiguous() for lay in layouts):
        return Layout.contiguous(shape).stride
    if all(lay.is_contiguous(CHANNELS_LAST) for lay in layouts):
        return Layout.contiguous(shape).clone_layout(CHANNELS_LAST).stride
    if all(lay.is_non_overlapping_and_dense() for lay in layouts) and (
        len({lay.stride for lay in layouts}) == 1
    ):
        return layouts[0].stride
    return None


def iterator_stride(
    shape: tuple[int, ...], operands: list[tuple[tuple[int, ...], tuple[int, ...]]]
) -> tuple[int, ...]:
    """The strides TensorIterator gives an output it allocates, from its inputs' shapes and
    strides: the fast setup, else its reorder_dimensions (an insertion sort of the dims by
    the inputs' strides, ties to the smaller size), then compatible_stride in that order.
    mirrors aten/src/ATen/TensorIterator.cpp."""
    fast = _fast_setup_stride(shape, operands)
    if fast is not None:
        return fast
    inputs = [_broadcast_input(op_shape, op_stride, shape) for op_shape, op_stride in operands]
    ndim = len(shape)
    if ndim <= 1:
        return Layout.contiguous(shape).stride
    perm = list(range(ndim - 1, -1, -1))

    def should_swap(dim0: int, dim1: int) -> int:
        for stride in inputs:
            s0, s1 = stride[dim0], stride[dim1]
            if s0 == 0 or s1 == 0:
                continue
            if s0 != s1:
                return -1 if s0 < s1 else 1
            if shape[dim0] > shape[dim1]:
                return 1
        return 0

    for i in range(1, ndim):
        dim1 = i
        for dim0 in range(i - 1, -1, -1):
            comparison = should_swap(perm[dim0], perm[dim1])
            if comparison > 0:
                perm[dim0], perm[dim1] = perm[dim1], perm[dim0]
                dim1 = dim0
            elif comparison < 0:
                break
    if perm == list(range(ndim - 1, -1, -1)):
        return Layout.contiguous(shape).stride
    out = [0] * ndim
    step = 1
    for d in perm:
        out[d] = step
        step *= shape[d]
    return tuple(out)


def _broadcast_input(
    op_shape: tuple[int, ...], op_stride: tuple[int, ...], shape: tuple[int, ...]
) -> tuple[int, ...]:
    """An input's strides as TensorIterator's compute_strides sees them (broadcast: 0)."""
    return tuple(
        0 if n == 1 and want != 1 else st
        for n, st, want in zip(op_shape, op_stride, shape, strict=True)
    )


def _result_stride(
    sliced: Layout,
    columns: list[_Column | None],
    common: tuple[int, ...],
    result: tuple[int, ...],
    on_gpu: bool,
) -> tuple[int, ...]:
    """torch's gathered result's strides: AdvancedIndex's restrided source and reshaped
    indices (after make_info's transposeToFront) as the TensorIterator's inputs."""
    dims = [d for d, c in enumerate(columns) if c is not None]
    adjacent = dims == list(range(dims[0], dims[-1] + 1))
    order = (
        list(range(len(columns)))
        if adjacent
        else dims + [d for d in range(len(columns)) if columns[d] is None]
    )
    src_stride = [sliced.stride[d] for d in order]
    before = order.index(dims[0]) if adjacent else 0
    after = len(order) - before - len(dims)
    operands = [
        (result, (*src_stride[:before], *([0] * len(common)), *src_stride[before + len(dims) :]))
    ]
    index_strides = []
    for d in dims:
        column = columns[d]
        assert column is not None
        index_strides.append(_expanded_stride(column.shape, column.stride, common))
    if on_gpu and len(set(index_strides)) > 1:  # torch makes CUDA indices contiguous
        index_strides = [Layout.contiguous(common).stride] * len(index_strides)
    for stride in index_strides:
        shape = (1,) * before + common + (1,) * after
        operands.append((shape, Layout(common, stride).view(shape).stride))
    return iterator_stride(result, operands)


def plan_index(
    array: ArrayOf,
    check_elements: Callable[[int], None],
    allocate: AllocateIndex,
    sliced: Layout,
    indices: list[_Index | None],
    op: str = "",
    on_gpu: bool = False,
) -> Plan:
    """Masks to coordinates, broadcast, result shape: every error torch raises before the
    kernel, every cost bounded before the index tensors are read."""
    for entry in indices:
        if entry is not None and entry.ref is not None:
            if entry.ref.dtype.name not in _INDEX_DTYPES:
                raise IndexError("tensors used as indices must be long, int, byte or bool tensors")
            check_elements(entry.ref.layout.numel)
    shape = sliced.shape
    expanded: list[_Column | None] = []
    for entry in indices:
        if entry is None:
            expanded.append(None)
        elif entry.constant is not None:  # torch's boolToIndexingTensor: [0] or []
            expanded.append(_Column((len(entry.constant),), (1,), constant=entry.constant))
        elif entry.ref is not None and _is_mask(entry.ref):
            mask_shape = entry.ref.layout.shape
            for j, n in enumerate(mask_shape):
                src = len(expanded) + j
                if src >= len(shape):  # self.size(src) in expandTensors
                    raise IndexError(
                        f"Dimension out of range (expected to be in range of "
                        f"[{-max(len(shape), 1)}, {max(len(shape), 1) - 1}], but got {src})"
                    )
                if n != shape[src]:
                    raise IndexError(
                        f"The shape of the mask {_fmt(mask_shape)} at index {j} does not match "
                        f"the shape of the indexed tensor {_fmt(shape)} at index {src}"
                    )
            expanded.extend(mask_columns(array, allocate, entry.ref))
        elif entry.ref is not None:
            # read a piece at a time when the work runs: an expanded index stays a view
            layout = entry.ref.layout
            expanded.append(_Column(layout.shape, layout.stride, ref=entry.ref))
    if len(expanded) > len(shape):
        raise IndexError(
            f"too many indices for tensor of dimension {len(shape)} (got {len(expanded)})"
        )
    expanded.extend([None] * (len(shape) - len(expanded)))
    defined = [(d, c) for d, c in enumerate(expanded) if c is not None]
    if not defined:  # only 0-dim masks in aten's list (never from x[...]): no index at all
        return Plan((None,) * len(shape), (), 0, shape, (), Layout.contiguous(shape).stride)
    try:
        common: tuple[int, ...] = tuple(broadcast_shapes(*(c.shape for _, c in defined)))
    except RuntimeError:
        shapes = ", ".join(_fmt(c.shape) for _, c in defined)
        raise IndexError(
            f"shape mismatch: indexing tensors could not be broadcast together with shapes {shapes}"
        ) from None
    check_elements(math.prod(common))
    dims = [d for d, _ in defined]
    rest = [shape[d] for d in range(len(shape)) if expanded[d] is None]
    before: list[int] = []
    if dims == list(range(dims[0], dims[-1] + 1)):  # adjacent: in place
        before = [shape[d] for d in range(dims[0])]
        result = (*before, *common, *rest[len(before) :])
    else:
        result = (*common, *rest)
    limits.check_result_ndim(len(result))
    check_elements(math.prod(result))
    # int32 indices become int64 (Tensor.to) after the broadcast, as make_info does
    columns: list[_Column | None] = []
    for entry, column in zip(indices_per_dim(indices, expanded), expanded, strict=True):
        if column is not None and entry is not None and entry.ref is not None:
            column = _as_long(column, entry.ref.dtype, tuple(common))
        columns.append(column)
    stride = (
        Layout.contiguous(result).stride
        if op == "index_select"
        else _result_stride(sliced, columns, tuple(common), tuple(result), on_gpu)
    )
    plan = Plan(
        tuple(expanded), common, len(before), tuple(result), tuple(shape[d] for d in dims), stride
    )
    if op == "index_select":
        column = expanded[dims[0]]
        assert column is not None
        check_index_select(array, shape, dims[0], column, common)
        return plan
    if 0 in plan.sizes and 0 not in common:  # torch's AdvancedIndex, before its kernel
        raise IndexError("index is out of bounds for dimension with size 0")
    return plan


def mask_columns(array: ArrayOf, allocate: AllocateIndex, mask: TensorRef) -> list[_Column]:
    """A mask's nonzero coordinates, one column per mask dim (torch's nonzero: (n, k) with
    strides (1, n), each column of stride 1).  Counted, then written into a pooled (k, n)
    int64 tensor, a piece of the mask at a time (a piece's coordinates: O(chunk))."""
    ndim = mask.layout.ndim
    if ndim == 0:  # never from x[...] (a 0-dim mask is a constant there): no coordinates
        return []
    pieces = list(_mask_pieces(mask.layout.shape))
    count = sum(int(np.count_nonzero(_host(array, mask, key))) for key in pieces)
    if count == 0:
        return [_Column((0,), (1,), constant=()) for _ in range(ndim)]
    coords = allocate((ndim, count))
    out = array(coords)
    start = 0
    for key in pieces:
        found = _piece_nonzero(key, np.nonzero(_host(array, mask, key)))
        n = len(found[0])
        for j in range(ndim):
            kernels.assign(coords.device.xp, out[j, start : start + n], found[j])
        start += n
    return [
        _Column((count,), (1,), ref=coords.with_layout(Layout((count,), (1,), j * count)))
        for j in range(ndim)
    ]


def _mask_pieces(shape: tuple[int, ...]) -> Iterator[tuple[int | slice, ...]]:
    """Keys into a mask, in row-major order, each piece at most a chunk of coordinates
    (a piece of m elements may give m nonzero positions, each of len(shape) int64s)."""
    return gather_plan(shape, max(len(shape), 1), INDEX_CHUNK_ELEMENTS)


def _piece_nonzero(key: tuple[int | slice, ...], found: tuple[Any, ...]) -> list[Any]:
    """A piece's nonzero coordinates (over the piece's dims) as coordinates of the mask:
    the key's ints first, then its slice's start added to the first piece dim."""
    n = len(found[0]) if found else 1
    ints = [np.full(n, k, dtype=np.int64) for k in key[:-1]]
    if not key:
        return [c.astype(np.int64) for c in found]
    last = key[-1]
    assert isinstance(last, slice)
    first = found[0].astype(np.int64) + (last.start or 0)
    return [*ints, first, *(c.astype(np.int64) for c in found[1:])]


def _host(array: ArrayOf, ref: TensorRef, key: tuple[int | slice, ...]) -> Any:
    """The elements of ``ref[key]`` (a bounded piece) as a NumPy array on the host."""
    return np.asarray(kernels.to_host(array(ref.with_layout(ref.layout[key]))))


def _column_values(
    array: ArrayOf, column: _Column, common: tuple[int, ...], key: tuple[int | slice, ...]
) -> Any:
    """A column's int64 values at positions ``key`` of its broadcast to ``common``, on the
    host: only that piece is read (an expanded index is never made whole)."""
    if column.constant is not None:
        constant = np.asarray(column.constant, dtype=np.int64)
        return np.ascontiguousarray(np.broadcast_to(constant, common)[key])
    assert column.ref is not None
    layout = column.ref.layout
    broadcast = Layout(common, _expanded_stride(layout.shape, layout.stride, common), layout.offset)
    return _host(array, column.ref.with_layout(broadcast), key).astype(np.int64)


def _position_keys(common: tuple[int, ...], per_position: int) -> Iterator[tuple[Any, ...]]:
    """Keys into the broadcast index, in row-major order, each for at most a chunk of
    elements when each position costs ``per_position`` (ints alone once one position
    is more than a chunk: its values are then a view, never a temporary)."""
    if per_position > INDEX_CHUNK_ELEMENTS:
        return itertools.product(*(range(n) for n in common))
    return gather_plan(common, per_position, INDEX_CHUNK_ELEMENTS)


def _per_position(plan: Plan) -> int:
    """Elements of temporaries per index position: the values it moves, or its indices."""
    common = math.prod(plan.common)
    moved = math.prod(plan.shape) // common if common else 0
    return max(moved, len(plan.defined), 1)


def _array_key(xp: Any, array: ArrayOf, plan: Plan, key: tuple[Any, ...]) -> tuple[Any, ...]:
    """The key into the sliced tensor for index positions ``key``: a column's piece of
    values (an int for a single position), the whole dim where no index stands."""
    out: list[Any] = []
    for column in plan.columns:
        if column is None:
            out.append(slice(None))
            continue
        values = _column_values(array, column, plan.common, key)
        out.append(int(values) if values.ndim == 0 else xp.asarray(values))
    return tuple(out)


def _result_key(plan: Plan, key: tuple[Any, ...]) -> tuple[Any, ...]:
    """The key into the result for index positions ``key`` (the broadcast dims stand
    after ``before`` dims: NumPy's rule for an indexed array's result, as torch's)."""
    return (slice(None),) * plan.before + tuple(key) + (Ellipsis,)  # ints alone: a 0-d view


# What torch 2.13's CPU index kernels raise when aten's list held only 0-dim masks (their
# expandTensors drops such a mask: no index is left), word for word, as the oracle does.
NO_INDEX_ASSERT = (
    'ntensor >= 3 INTERNAL ASSERT FAILED at "/__w/pytorch/pytorch/aten/src/ATen/native/cpu/'
    'IndexKernelUtils.h":8, please report a bug to PyTorch. '
)


def check_some_index(plan: Plan) -> None:
    """aten::index / index_put_ with no index left reach torch's kernel, which asserts; with
    no elements its kernel never runs and the op does nothing."""
    elements: int = math.prod(plan.shape)
    if elements and not plan.defined:
        raise RuntimeError(NO_INDEX_ASSERT)


def indices_per_dim(
    indices: list[_Index | None], expanded: list[_Column | None]
) -> list[_Index | None]:
    """Which entry of aten's list each expanded column came from (a mask gives several)."""
    out: list[_Index | None] = []
    for entry in indices:
        if entry is not None and entry.ref is not None and _is_mask(entry.ref):
            out.extend([entry] * entry.ref.layout.ndim)
        else:
            out.append(entry)
    out.extend([None] * (len(expanded) - len(out)))
    return out


def _as_long(column: _Column, dtype: DType, common: tuple[int, ...]) -> _Column:
    """An int32 index after make_info's Tensor.to(long) of its broadcast (int64: as is)."""
    if dtype is not dtypes.int32:
        return column
    broad = _expanded_stride(column.shape, column.stride, common)
    return replace(column, shape=common, stride=_dense_stride(common, broad))


def check_index_select(
    array: ArrayOf, shape: tuple[int, ...], dim: int, column: _Column, common: tuple[int, ...]
) -> None:
    """index_select's own bounds rules: no negative index, and with no elements in self a
    check of its own.  mirrors index_select_out_cpu_ (the index read a chunk at a time)."""
    if not math.prod(common):
        return
    size = shape[dim]
    if len(shape) > 1 and math.prod(shape) == 0 and size <= 0:
        raise RuntimeError("index_select(): self indexing axis dim should be positive")
    # its dim-1 fast path names the first bad value, in order
    one_by_one = len(shape) > 1 and (math.prod(shape) == 0 or dim == 1)
    for key in _position_keys(common, 1):
        values = _column_values(array, column, common, key).reshape(-1)
        bad = (values < 0) | (values >= size)
        if not bad.any():
            continue
        if one_by_one:
            value = int(values[int(np.argmax(bad))])
            raise RuntimeError(f"INDICES element is out of DATA bounds, id={value} axis_dim={size}")
        raise IndexError("index out of range in self")


def check_bounds(array: ArrayOf, plan: Plan, op: str) -> None:
    """torch's error for the first index out of range, in element order then dim order
    (the dim counted among the indexed dims, as torch's kernel numbers them); its kernel
    checks as it runs: no elements, no check.  A chunk of positions at a time."""
    if not math.prod(plan.shape) or op == "index_select":
        return
    defined = plan.defined
    for key in _position_keys(plan.common, len(defined)):
        values = [_column_values(array, c, plan.common, key).reshape(-1) for c in defined]
        bad = [(v < -n) | (v >= n) for v, n in zip(values, plan.sizes, strict=True)]
        any_bad = np.logical_or.reduce(bad)
        if not any_bad.any():
            continue
        first = int(np.argmax(any_bad))
        for k, (v, n) in enumerate(zip(values, plan.sizes, strict=True)):
            value = int(v[first])
            if value < -n or value >= n:
                raise IndexError(f"index {value} is out of bounds for dimension {k} with size {n}")


def gather(xp: Any, array: ArrayOf, source: Any, out: Any, plan: Plan) -> None:
    """out = source[plan] (out has the plan's shape), a chunk of index positions at a time."""
    if not math.prod(plan.shape):
        return
    for key in _position_keys(plan.common, _per_position(plan)):
        index = _array_key(xp, array, plan, key)
        kernels.assign(xp, out[_result_key(plan, key)], source[index])


def tensor_handles(items: tuple[IndexItem, ...]) -> tuple[str, ...]:
    """The index tensors' handles, each once (x[i, i] holds i once)."""
    return tuple(dict.fromkeys(i.handle for i in items if isinstance(i, TensorItem)))


def sliced(
    array: ArrayOf,
    ref: TensorRef,
    items: tuple[IndexItem, ...],
    refs: dict[str, TensorRef],
    raw: bool = False,
) -> tuple[TensorRef, list[_Index | None]]:
    """The tensor the index reads or writes (the basic view) and aten::index's list on it."""
    if raw:  # index_put_/index_select: the items are aten's list itself (tensors, None)
        if not all(i is None or isinstance(i, TensorItem) for i in items):
            raise ValueError("a raw index holds only index tensors and None")
        if len(items) > ref.layout.ndim:
            raise IndexError(
                f"too many indices for tensor of dimension {ref.layout.ndim} (got {len(items)})"
            )
        layout = ref.layout
        indices = [None if i is None else _Index(ref=refs[i.handle]) for i in items]
    else:
        layout, indices = apply_slicing(array, ref.layout, items, refs)
    target = ref.with_layout(layout)
    array(target)  # the view's geometry checked like any issued one
    return target, indices


def planned(
    array: ArrayOf,
    check_elements: Callable[[int], None],
    allocate: AllocateIndex,
    target: TensorRef,
    indices: list[_Index | None],
    op: str = "",
) -> Plan:
    on_gpu = target.device.xp is not np
    return plan_index(array, check_elements, allocate, target.layout, indices, op, on_gpu)


def dispatches_to_masked_fill(indices: list[_Index | None], src: TensorRef | None) -> bool:
    """torch's canDispatchToMaskedFill (index_put_ without accumulate): one mask and no
    other index, and a one-element value on the host; torch then runs
    masked_fill_(mask, value.item()), with no check of the value's shape or dtype."""
    if src is not None and (src.layout.numel != 1 or src.device.xp is not np):
        return False
    defined = [e for e in indices if e is not None]
    return len(defined) == 1 and defined[0].ref is not None and _is_mask(defined[0].ref)


def check_masked_fill_mask(indices: list[_Index | None]) -> None:
    (mask,) = (e.ref for e in indices if e is not None and e.ref is not None)
    if mask.dtype is not dtypes.bool:
        raise RuntimeError(
            "masked_fill_ only supports boolean masks, but got mask with dtype unsigned char"
        )


def masked_fill_mask_value(array: ArrayOf, indices: list[_Index | None]) -> bool:
    """The truth of masked_fill_'s single 0-dim mask (its expandTensors left no index)."""
    (mask,) = (e.ref for e in indices if e is not None and e.ref is not None)
    return bool(_scalar_value(array, mask))


def check_put_source(
    dst: TensorRef, src: TensorRef, plan: Plan, raw: bool = False
) -> tuple[int, ...]:
    """torch's index_put_ checks of a tensor value; the shape it is read as (torch's
    setitem drops leading 1s first, index_put_ itself does not)."""
    stripped = src.layout.shape if raw else kernels.strip_leading_ones(src.layout.shape)
    try:
        fits = broadcast_shapes(stripped, plan.shape) == plan.shape
    except RuntimeError:
        fits = False
    if not fits:
        raise RuntimeError(
            f"shape mismatch: value tensor of shape {_fmt(stripped)} cannot be "
            f"broadcast to indexing result of shape {_fmt(plan.shape)}"
        )
    if src.dtype is not dst.dtype:
        raise RuntimeError(
            "Index put requires the source and destination dtypes match, got "
            f"{dst.dtype.scalar_type} for the destination and {src.dtype.scalar_type} "
            "for the source."
        )
    return stripped


def scalar_source(xp: Any, like: Any, value: Scalar, dtype: DType) -> Any:
    """A 0-dim array of ``like``'s array dtype holding ``value`` as torch casts it."""
    kernels.check_scalar_fits(value, dtype)
    source = xp.empty((), dtype=like.dtype)
    kernels.fill(xp, source, value)
    return source


def scatter(xp: Any, array: ArrayOf, dst: Any, source: Any, plan: Plan, accumulate: bool) -> None:
    """dst[plan] = source, or += with accumulate (duplicates add up, as torch's do), a
    chunk of index positions at a time, in row-major order (so a later duplicate's value
    stays, as in one pass).  ``source`` never shares memory with ``dst`` (see
    :func:`unaliased`): a piece read after an earlier piece's write is still the value."""
    if not math.prod(plan.shape):
        return
    values = xp.broadcast_to(source, plan.shape)
    for key in _position_keys(plan.common, _per_position(plan)):
        index = _array_key(xp, array, plan, key)
        piece = values[_result_key(plan, key)]
        if accumulate:
            xp.add.at(dst, index, piece)
        else:
            dst[index] = piece


class Indexing:
    """Advanced indexing ops (gather and scatter) over one :class:`OpContext`."""

    def __init__(self, ops: OpContext) -> None:
        self.ops = ops

    def _allocator(
        self, stack: contextlib.ExitStack[Any], session: Session, device: Device
    ) -> AllocateIndex:
        """Pooled int64 temporaries (a mask's coordinates) held until the op ends."""

        def allocate(shape: tuple[int, ...]) -> TensorRef:
            layout = Layout.contiguous(shape)
            return stack.enter_context(self.ops.allocated(session, device, layout, dtypes.int64))

        return allocate

    def _unaliased(
        self,
        stack: contextlib.ExitStack[Any],
        session: Session,
        dst: TensorRef,
        ref: TensorRef,
    ) -> TensorRef:
        """``ref``, or a pooled copy of it when it shares ``dst``'s Storage: the scatter
        reads its values a chunk at a time while it writes, so they are copied first (as
        one pass would read them all before writing); the copy is charged like an output."""
        if ref.storage is not dst.storage:
            return ref
        copy = stack.enter_context(
            self.ops.allocated(session, ref.device, Layout.contiguous(ref.layout.shape), ref.dtype)
        )
        self.ops.assign(copy, self.ops.values(ref))  # keeps its lazy bits' values
        return copy

    def advanced_index(
        self,
        session: Session,
        handle: str,
        items: tuple[Any, ...],
        raw: bool = False,
        op: str = "",
    ) -> Issued:
        """x[items] with a tensor (or Python bool) among them: a gather into a new tensor.
        ``raw``: the items are aten::index's list (tensors and None), as index_select's."""
        extra = tensor_handles(items)
        with (
            self.ops.using(session, handle, *extra) as held,
            contextlib.ExitStack() as temporaries,
        ):
            ref, refs = held[0], dict(zip(extra, held[1:], strict=True))
            target, indices = sliced(self.ops.array, ref, items, refs, raw)
            if op == "index_select":
                kernels.check_kernel("index_select", ref.dtype)
            allocate = self._allocator(temporaries, session, ref.device)
            plan = planned(self.ops.array, self.ops.check_elements, allocate, target, indices, op)
            check_bounds(self.ops.array, plan, op)
            check_some_index(plan)
            layout = Layout(plan.shape, plan.stride)
            with self.ops.allocated(
                session, ref.device, layout, ref.dtype, ref.requires_grad
            ) as out:
                out_array = self.ops.array(out)
                xp, source = ref.device.xp, self.ops.array(target)
                gather(xp, self.ops.array, source, out_array, plan)
                # the gathered stored values -> values: only out's elements, never target's,
                # in place (a gather's result, as torch's, names each location once)
                if target.conj or target.neg:
                    assert out.layout.is_non_overlapping_and_dense(), out.layout
                    kernels.apply_lazy_bits_in_place(out_array, target.conj, target.neg)
                return self.ops.issue(session, out)

    def advanced_setitem(
        self,
        session: Session,
        handle: str,
        items: tuple[Any, ...],
        value: Scalar | None = None,
        src_handle: str | None = None,
        accumulate: bool = False,
        raw: bool = False,
        value_requires_grad: bool = False,
    ) -> Issued:
        """x[items] = value (a scalar or a tensor); x.index_put_(items, value, accumulate)
        with ``raw``.  Checks in torch's order: the scalar, the slicing, the masked_fill_
        dispatch or the value's shape and dtype, then the indices' bounds.  A value that
        requires grad (a tensor, or ``value_requires_grad`` for a scalar taken from one)
        makes x's handle require grad, whatever its dtype, as torch's autograd does."""
        extra = tensor_handles(items)
        sources = () if src_handle is None else (src_handle,)
        with (
            self.ops.using(session, handle, *extra, *sources) as held,
            contextlib.ExitStack() as temporaries,
        ):
            ref, refs = held[0], dict(zip(extra, held[1 : 1 + len(extra)], strict=True))
            src = held[-1] if src_handle is not None else None
            if src is None:  # torch makes the scalar a tensor of x's dtype first
                assert value is not None
                kernels.check_scalar_fits(value, ref.dtype)
            target, indices = sliced(self.ops.array, ref, items, refs, raw)
            allocate = self._allocator(temporaries, session, ref.device)
            plan = planned(self.ops.array, self.ops.check_elements, allocate, target, indices)
            xp, dst = ref.device.xp, self.ops.array(target)
            if not accumulate and dispatches_to_masked_fill(indices, src):
                check_masked_fill_mask(indices)
                if src is not None:
                    value = kernels.to_host(self.ops.values(src)).reshape(()).item()
                    value_requires_grad = value_requires_grad or src.requires_grad
                    src = None  # masked_fill_(mask, value.item()): a scalar from here on
                assert value is not None
                source = scalar_source(xp, dst, value, ref.dtype)
                kernels.check_kernel("masked_fill", ref.dtype)
                if not plan.defined:  # one 0-dim mask: all of x or none
                    if masked_fill_mask_value(self.ops.array, indices):
                        self.ops.fill(target, value)
                    return self._written(session, handle, ref, src, value_requires_grad)
            elif src is None:
                assert value is not None
                source = scalar_source(xp, dst, value, ref.dtype)
            else:
                shape = check_put_source(ref, src, plan, raw)
            kernels.check_kernel("index_put", ref.dtype)
            check_bounds(self.ops.array, plan, "")
            check_some_index(plan)
            if src is not None:
                src = self._unaliased(temporaries, session, ref, src)
                source = kernels.to_module(xp, self.ops.values(src)).reshape(shape)
            plan = replace(
                plan,
                columns=tuple(
                    c
                    if c is None or c.ref is None
                    else replace(c, ref=self._unaliased(temporaries, session, ref, c.ref))
                    for c in plan.columns
                ),
            )
            # into a tensor with lazy bits: their stored form (conj / neg are involutions)
            source = kernels.apply_lazy_bits(source, target.conj, target.neg)
            scatter(xp, self.ops.array, dst, source, plan, accumulate)
            return self._written(session, handle, ref, src, value_requires_grad)

    def _written(
        self,
        session: Session,
        handle: str,
        ref: TensorRef,
        src: TensorRef | None,
        value_requires_grad: bool,
    ) -> Issued:
        """x after an in-place write: it requires grad once its value did (torch's rule for
        an in-place op; no autograd graph here, so only the flag)."""
        if ref.requires_grad or not (value_requires_grad or (src and src.requires_grad)):
            return Issued(handle, ref)
        return Issued(handle, self.ops.sessions.flag_requires_grad(session, handle))
