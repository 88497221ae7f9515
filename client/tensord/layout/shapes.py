"""Shapes and strides as torch computes them: contiguity, memory formats, size inference,
``computeStride``, storage extents and broadcasting, as pure functions over tuples.

Each function names the ATen / c10 function it mirrors; results, exception types and
error texts match torch 2.13 eager (CPU) exactly (``tests/layout/test_layout_vs_torch.py``).
Strides and offsets are in elements.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import EllipsisType
from typing import TypeAlias

Shape: TypeAlias = tuple[int, ...]
Index: TypeAlias = int | slice | EllipsisType | None
IntOrSeq: TypeAlias = int | Sequence[int]

INT64_MAX = 2**63 - 1
_UINT64 = 2**64


def format_ints(values: Sequence[int]) -> str:
    """c10's printing of an IntArrayRef: ``[2, 3]``."""
    return "[" + ", ".join(str(v) for v in values) + "]"


# Layout._derived's constructor: a frozen dataclass's fields are set as its __init__ does
new_object = object.__new__
set_field = object.__setattr__


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def all_ints(values: tuple[object, ...]) -> bool:
    """Whether every value is an int (not a bool): ``all(map(is_int, values))``, faster."""
    return all(type(v) is int for v in values) or all(map(is_int, values))


def check_ints(name: str, values: Sequence[object]) -> None:
    for v in values:
        if not is_int(v):
            raise TypeError(f"{name} must be a sequence of ints, got {type(v).__name__} {v!r}")


def as_int_tuple(args: tuple[IntOrSeq, ...], name: str) -> tuple[int, ...]:
    """torch's varargs-or-one-sequence convention: ``f(2, 3)`` == ``f((2, 3))``."""
    if len(args) == 1 and not is_int(args[0]):
        seq = args[0]
        assert not isinstance(seq, int)
        result = tuple(seq)
    else:
        result = tuple(args)  # type: ignore[arg-type]
    check_ints(name, result)
    return result


def int_or_seq(value: IntOrSeq, name: str) -> tuple[int, ...]:
    """An int or a sequence of ints -> a tuple of ints."""
    result = (value,) if isinstance(value, int) else tuple(value)
    check_ints(name, result)
    return result


def normalize_dim(dim: int, ndim: int, *, wrap_scalar: bool = True) -> int:
    """Wrap a negative dim.  mirrors c10::maybe_wrap_dim (a 0-dim tensor takes -1 and 0)."""
    if not is_int(dim):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    if ndim <= 0:
        if not wrap_scalar:
            raise IndexError(f"Dimension specified as {dim} but tensor has no dimensions")
        ndim = 1
    lo, hi = -ndim, ndim - 1
    if dim < lo or dim > hi:
        raise IndexError(
            f"Dimension out of range (expected to be in range of [{lo}, {hi}], but got {dim})"
        )
    return dim + ndim if dim < 0 else dim


def contiguous_strides(shape: Sequence[int]) -> Shape:
    """Row-major strides.  mirrors c10::contiguous_strides (size-0 dims count as 1)."""
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * max(shape[i + 1], 1)
    return tuple(strides)


def is_contiguous_strides(shape: Shape, stride: Shape) -> bool:
    # mirrors c10 compute_contiguous: size-1 dims ignored, zero-numel contiguous
    if math.prod(shape) == 0:
        return True
    expected = 1
    for size, st in zip(reversed(shape), reversed(stride), strict=True):
        if size != 1:
            if st != expected:
                return False
            expected *= size
    return True


def is_non_overlapping_and_dense_strides(shape: Shape, stride: Shape) -> bool:
    # mirrors torch._prims_common._is_non_overlapping_and_dense_or_false
    if math.prod(shape) < 2:
        return True
    if len(shape) == 1:
        return stride[0] == 1
    pairs = sorted(zip(stride, shape, strict=True))
    expected = 1
    for st, size in pairs:
        if size != 1:
            if st != expected:
                return False
            expected *= size
    return True


# -- memory formats (c10/core/MemoryFormat.h, Contiguity.h, TensorImpl) -------------------------
# A memory format is named here by torch's attribute name ("channels_last" for
# torch.channels_last); the SDK's tensord.channels_last objects carry these names.

CONTIGUOUS_FORMAT = "contiguous_format"
CHANNELS_LAST = "channels_last"
CHANNELS_LAST_3D = "channels_last_3d"
PRESERVE_FORMAT = "preserve_format"
MEMORY_FORMATS = (CONTIGUOUS_FORMAT, CHANNELS_LAST, CHANNELS_LAST_3D, PRESERVE_FORMAT)

# The dims from the fastest-varying out: C, then W, H (and D), then N.
CHANNELS_LAST_ORDER = {CHANNELS_LAST: (1, 3, 2, 0), CHANNELS_LAST_3D: (1, 4, 3, 2, 0)}
# c10's enum names, which its error texts print.
_C10_NAMES = {
    CONTIGUOUS_FORMAT: "Contiguous",
    CHANNELS_LAST: "ChannelsLast",
    CHANNELS_LAST_3D: "ChannelsLast3d",
    PRESERVE_FORMAT: "Preserve",
}


def check_memory_format(memory_format: str) -> None:
    if memory_format not in MEMORY_FORMATS:
        raise ValueError(f"unsupported memory_format {memory_format!r}")


def memory_format_strides(shape: Sequence[int], memory_format: str) -> Shape:
    """The strides torch.empty(shape, memory_format=...) gives.

    mirrors TensorImpl::empty_tensor_restride (its rank checks and texts) with
    c10::get_channels_last_strides_2d/3d, which, unlike contiguous strides, do
    not count a size-0 dim as 1.
    """
    check_memory_format(memory_format)
    shape = tuple(shape)
    if memory_format == CONTIGUOUS_FORMAT:
        return contiguous_strides(shape)
    if memory_format == PRESERVE_FORMAT:
        raise RuntimeError(f"unsupported memory format {_C10_NAMES[memory_format]}")
    rank = len(CHANNELS_LAST_ORDER[memory_format])
    if len(shape) != rank:
        raise RuntimeError(f"required rank {rank} tensor to use {memory_format} format")
    strides = [0] * rank
    expected = 1
    for d in CHANNELS_LAST_ORDER[memory_format]:
        strides[d] = expected
        expected *= shape[d]
    return tuple(strides)


def is_channels_last_contiguous(shape: Shape, stride: Shape, memory_format: str) -> bool:
    # mirrors c10 _compute_channels_last_contiguous_2d/3d: size-1 dims ignored, and
    # (unlike compute_contiguous) no shortcut for a tensor without elements
    order = CHANNELS_LAST_ORDER[memory_format]
    if len(shape) != len(order):
        return False
    expected = 1
    for d in order:
        if shape[d] != 1:
            if stride[d] != expected:
                return False
            expected *= shape[d]
    return True


def is_channels_last_strides(shape: Shape, stride: Shape, memory_format: str) -> bool:
    # mirrors c10 is_channels_last_strides_2d_s4 / _3d_s5 (torch's guess of a format)
    order = CHANNELS_LAST_ORDER[memory_format]
    if len(shape) != len(order):
        return False
    if stride[1] == 0:  # a trivial C dim: NCHW by default
        return False
    low = 0
    for d in order:
        if shape[d] == 0 or stride[d] < low:
            return False
        if d == 0 and low == stride[1]:  # ambiguous (N111): NCHW by default
            return False
        low = stride[d] * shape[d] if shape[d] > 1 else stride[d]
    return True


def infer_size(shape: Sequence[int], numel: int) -> Shape:
    """Resolve one ``-1``.  mirrors ATen infer_size_impl (its texts, RuntimeError)."""
    newsize = 1
    infer_dim: int | None = None
    for i, size in enumerate(shape):
        if size == -1:
            if infer_dim is not None:
                raise RuntimeError("only one dimension can be inferred")
            infer_dim = i
        elif size >= 0:
            newsize *= size
        else:
            raise RuntimeError(
                f"invalid shape dimension {size} at index {i} of shape {format_ints(shape)}"
            )
    if numel == newsize or (infer_dim is not None and newsize > 0 and numel % newsize == 0):
        if infer_dim is None:
            return tuple(shape)
        if newsize == 0:
            raise RuntimeError(
                f"cannot reshape tensor of 0 elements into shape {format_ints(shape)} because the "
                "unspecified dimension size -1 can be any value and is ambiguous"
            )
        result = list(shape)
        result[infer_dim] = numel // newsize
        return tuple(result)
    raise RuntimeError(f"shape '{format_ints(shape)}' is invalid for input of size {numel}")


def compute_stride(old_shape: Shape, old_stride: Shape, new_shape: Shape) -> Shape | None:
    """Strides viewing (old_shape, old_stride) as new_shape, or None if a copy is needed.

    mirrors ATen computeStride_impl (TensorUtils.cpp), including its zero-numel rules.
    """
    if not old_shape:
        return (1,) * len(new_shape)
    numel = math.prod(old_shape)
    if numel == 0 and old_shape == new_shape:
        return old_stride
    if numel == 0:
        return contiguous_strides(new_shape)
    new_stride = [0] * len(new_shape)
    view_d = len(new_shape) - 1
    chunk_base_stride = old_stride[-1]
    tensor_numel = 1
    view_numel = 1
    for tensor_d in range(len(old_shape) - 1, -1, -1):
        tensor_numel *= old_shape[tensor_d]
        # a chunk ends where the next-outer dim is not laid out right after this one
        if tensor_d == 0 or (
            old_shape[tensor_d - 1] != 1
            and old_stride[tensor_d - 1] != tensor_numel * chunk_base_stride
        ):
            while view_d >= 0 and (view_numel < tensor_numel or new_shape[view_d] == 1):
                new_stride[view_d] = view_numel * chunk_base_stride
                view_numel *= new_shape[view_d]
                view_d -= 1
            if view_numel != tensor_numel:
                return None
            if tensor_d > 0:
                chunk_base_stride = old_stride[tensor_d - 1]
                tensor_numel = 1
                view_numel = 1
    if view_d != -1:
        return None
    return tuple(new_stride)


def infer_dense_strides(shape: Shape, stride: Shape) -> Shape:
    # mirrors ATen infer_dense_strides: keep the input's dim order (TensorIterator's sort)
    ndim = len(shape)
    perm = list(range(ndim - 1, -1, -1))

    def should_swap(d0: int, d1: int) -> int:
        s0, s1 = stride[d0], stride[d1]
        if s0 == 0 or s1 == 0:
            return 0  # ambiguous: keep the contiguous order
        if s0 != s1:
            return -1 if s0 < s1 else 1
        return 1 if shape[d0] > shape[d1] else 0

    for i in range(1, ndim):
        dim1 = i
        for j in range(1, i + 1):
            dim0 = i - j
            cmp = should_swap(perm[dim0], perm[dim1])
            if cmp > 0:
                perm[dim0], perm[dim1] = perm[dim1], perm[dim0]
                dim1 = dim0
            elif cmp < 0:
                break
    out = [0] * ndim
    current = 1
    for idx in perm:
        out[idx] = current
        if shape[idx] > 1:
            current *= shape[idx]
    return tuple(out)


def tuple_storage_nbytes(shape: Shape, stride: Shape, itemsize: int, offset: int) -> int:
    # mirrors at::detail::computeStorageNbytes: uint64 arithmetic with overflow checks
    size = (offset + 1) % _UINT64
    overflowed = False
    for sz, st in zip(shape, stride, strict=True):
        if sz == 0:
            return 0
        strided = (st % _UINT64) * ((sz - 1) % _UINT64)
        overflowed |= strided >= _UINT64
        size += strided % _UINT64
        overflowed |= size >= _UINT64
        size %= _UINT64
    size *= itemsize
    overflowed |= size >= _UINT64
    size %= _UINT64
    overflowed |= size > INT64_MAX
    if overflowed:
        raise RuntimeError(
            f"Storage size calculation overflowed with sizes={format_ints(shape)} and strides={format_ints(stride)}"
        )
    return size


def storage_nbytes(shape: Sequence[int], stride: Sequence[int], itemsize: int, offset: int) -> int:
    """The bytes a storage needs for this strided layout (0 without elements): torch's
    computeStorageNbytes, its overflow checks and text (set_, resize_)."""
    return tuple_storage_nbytes(tuple(shape), tuple(stride), itemsize, offset)


def check_numel(shape: Shape) -> None:
    # torch computes numel with unsigned overflow checks; a negative size trips it
    if any(s < 0 for s in shape):
        raise RuntimeError("numel: integer multiplication overflow")


def broadcast_shapes(*shapes: IntOrSeq) -> Shape:
    """torch.broadcast_shapes.  mirrors torch._refs._broadcast_shapes (its texts)."""
    normalized: list[Sequence[int]] = [(s,) if is_int(s) else s for s in shapes]  # type: ignore[misc]
    if not normalized:
        return ()
    for shape in normalized:
        if not isinstance(shape, Sequence):
            raise RuntimeError(
                "Input shapes should be of type ints, a tuple of ints, or a list of ints, "
                f"got {shape}"
            )
    common = [1] * max(len(s) for s in normalized)
    for arg_idx, shape in enumerate(normalized):
        for idx in range(-1, -1 - len(shape), -1):
            if shape[idx] == common[idx]:
                continue
            if common[idx] == 1:
                if shape[idx] < 0:
                    raise ValueError("Attempting to broadcast a dimension with negative length!")
                common[idx] = shape[idx]
            if shape[idx] != 1 and common[idx] != shape[idx]:
                raise RuntimeError(
                    f"Attempting to broadcast a dimension of length {shape[idx]} at {idx}! "
                    f"Mismatching argument at index {arg_idx} had {shape}; but expected shape "
                    f"should be broadcastable to {common}"
                )
    return tuple(common)


def copy_broadcast_check(dst_shape: tuple[int, ...], src_shape: tuple[int, ...]) -> None:
    """copy_'s TensorIterator check: src must broadcast to exactly dst's shape."""
    try:
        common = broadcast_shapes(dst_shape, src_shape)
    except RuntimeError:
        # TensorIterator's own wording (infer_size), naming the first mismatching dim
        ndim = max(len(dst_shape), len(src_shape))
        for i in range(ndim - 1, -1, -1):
            offset = ndim - 1 - i
            a = dst_shape[len(dst_shape) - 1 - offset] if offset < len(dst_shape) else 1
            b = src_shape[len(src_shape) - 1 - offset] if offset < len(src_shape) else 1
            if a != b and a != 1 and b != 1:
                raise RuntimeError(
                    f"The size of tensor a ({a}) must match the size of tensor b ({b}) at "
                    f"non-singleton dimension {i}"
                ) from None
        raise
    if tuple(common) != tuple(dst_shape):
        raise RuntimeError(
            f"output with shape {format_ints(dst_shape)} doesn't match the broadcast shape {format_ints(common)}"
        )


def strip_leading_ones(shape: tuple[int, ...]) -> tuple[int, ...]:
    """mirrors slicePrefix1sSize: x[i] = v ignores v's leading size-1 dims."""
    first = next((i for i, n in enumerate(shape) if n != 1), len(shape))
    return shape[first:]


def reach_bounds(start: int, shape: Sequence[int], strides: Sequence[int]) -> tuple[int, int]:
    """The lowest and highest offset a non-empty view of ``shape`` and ``strides`` from
    ``start`` reaches (in the strides' unit: elements, or bytes for NumPy's strides);
    exact whatever the strides' signs (a negative stride reaches below ``start``)."""
    low = high = start
    for extent, stride in zip(shape, strides, strict=True):
        reach = (extent - 1) * stride
        if reach < 0:
            low += reach
        else:
            high += reach
    return low, high
