"""The strided-layout math of torch's views, as pure functions over (shape, stride, offset).

Both the server (which checks and issues handles) and the SDK (which predicts
shapes) use this module.  Each function names the ATen / c10 function it
mirrors; results, exception types and error texts match torch 2.13 eager
(CPU) exactly — ``tests/test_layout_vs_torch.py`` checks that against torch.

Strides and offsets are in elements.  Exceptions are the plain built-ins torch
raises (RuntimeError, IndexError, ValueError, TypeError); the service maps them
to status codes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from types import EllipsisType
from typing import TypeAlias

Shape: TypeAlias = tuple[int, ...]
Index: TypeAlias = int | slice | EllipsisType | None
IntOrSeq: TypeAlias = int | Sequence[int]

_INT64_MAX = 2**63 - 1
_UINT64 = 2**64


def _fmt(values: Sequence[int]) -> str:
    """c10's printing of an IntArrayRef: ``[2, 3]``."""
    return "[" + ", ".join(str(v) for v in values) + "]"


# Layout._derived's constructor: a frozen dataclass's fields are set as its __init__ does
_new_object = object.__new__
_set_field = object.__setattr__


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _all_ints(values: tuple[object, ...]) -> bool:
    """Whether every value is an int (not a bool): ``all(map(_is_int, values))``, faster."""
    return all(type(v) is int for v in values) or all(map(_is_int, values))


def _check_ints(name: str, values: Sequence[object]) -> None:
    for v in values:
        if not _is_int(v):
            raise TypeError(f"{name} must be a sequence of ints, got {type(v).__name__} {v!r}")


def _as_tuple(args: tuple[IntOrSeq, ...], name: str) -> tuple[int, ...]:
    """torch's varargs-or-one-sequence convention: ``f(2, 3)`` == ``f((2, 3))``."""
    if len(args) == 1 and not _is_int(args[0]):
        seq = args[0]
        assert not isinstance(seq, int)
        result = tuple(seq)
    else:
        result = tuple(args)  # type: ignore[arg-type]
    _check_ints(name, result)
    return result


def _int_or_seq(value: IntOrSeq, name: str) -> tuple[int, ...]:
    """An int or a sequence of ints -> a tuple of ints."""
    result = (value,) if isinstance(value, int) else tuple(value)
    _check_ints(name, result)
    return result


def normalize_dim(dim: int, ndim: int, *, wrap_scalar: bool = True) -> int:
    """Wrap a negative dim.  mirrors c10::maybe_wrap_dim (a 0-dim tensor takes -1 and 0)."""
    if not _is_int(dim):
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


def _is_contiguous(shape: Shape, stride: Shape) -> bool:
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


def _is_non_overlapping_and_dense(shape: Shape, stride: Shape) -> bool:
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
_CHANNELS_LAST_ORDER = {CHANNELS_LAST: (1, 3, 2, 0), CHANNELS_LAST_3D: (1, 4, 3, 2, 0)}
# c10's enum names, which its error texts print.
_C10_NAMES = {
    CONTIGUOUS_FORMAT: "Contiguous",
    CHANNELS_LAST: "ChannelsLast",
    CHANNELS_LAST_3D: "ChannelsLast3d",
    PRESERVE_FORMAT: "Preserve",
}


def _check_memory_format(memory_format: str) -> None:
    if memory_format not in MEMORY_FORMATS:
        raise ValueError(f"unsupported memory_format {memory_format!r}")


def memory_format_strides(shape: Sequence[int], memory_format: str) -> Shape:
    """The strides torch.empty(shape, memory_format=...) gives.

    mirrors TensorImpl::empty_tensor_restride (its rank checks and texts) with
    c10::get_channels_last_strides_2d/3d, which, unlike contiguous strides, do
    not count a size-0 dim as 1.
    """
    _check_memory_format(memory_format)
    shape = tuple(shape)
    if memory_format == CONTIGUOUS_FORMAT:
        return contiguous_strides(shape)
    if memory_format == PRESERVE_FORMAT:
        raise RuntimeError(f"unsupported memory format {_C10_NAMES[memory_format]}")
    rank = len(_CHANNELS_LAST_ORDER[memory_format])
    if len(shape) != rank:
        raise RuntimeError(f"required rank {rank} tensor to use {memory_format} format")
    strides = [0] * rank
    expected = 1
    for d in _CHANNELS_LAST_ORDER[memory_format]:
        strides[d] = expected
        expected *= shape[d]
    return tuple(strides)


def _is_channels_last_contiguous(shape: Shape, stride: Shape, memory_format: str) -> bool:
    # mirrors c10 _compute_channels_last_contiguous_2d/3d: size-1 dims ignored, and
    # (unlike compute_contiguous) no shortcut for a tensor without elements
    order = _CHANNELS_LAST_ORDER[memory_format]
    if len(shape) != len(order):
        return False
    expected = 1
    for d in order:
        if shape[d] != 1:
            if stride[d] != expected:
                return False
            expected *= shape[d]
    return True


def _is_channels_last_strides(shape: Shape, stride: Shape, memory_format: str) -> bool:
    # mirrors c10 is_channels_last_strides_2d_s4 / _3d_s5 (torch's guess of a format)
    order = _CHANNELS_LAST_ORDER[memory_format]
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
                f"invalid shape dimension {size} at index {i} of shape {_fmt(shape)}"
            )
    if numel == newsize or (infer_dim is not None and newsize > 0 and numel % newsize == 0):
        if infer_dim is None:
            return tuple(shape)
        if newsize == 0:
            raise RuntimeError(
                f"cannot reshape tensor of 0 elements into shape {_fmt(shape)} because the "
                "unspecified dimension size -1 can be any value and is ambiguous"
            )
        result = list(shape)
        result[infer_dim] = numel // newsize
        return tuple(result)
    raise RuntimeError(f"shape '{_fmt(shape)}' is invalid for input of size {numel}")


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


def _infer_dense_strides(shape: Shape, stride: Shape) -> Shape:
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


def _storage_nbytes(shape: Shape, stride: Shape, itemsize: int, offset: int) -> int:
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
    overflowed |= size > _INT64_MAX
    if overflowed:
        raise RuntimeError(
            f"Storage size calculation overflowed with sizes={_fmt(shape)} and strides={_fmt(stride)}"
        )
    return size


def storage_nbytes(shape: Sequence[int], stride: Sequence[int], itemsize: int, offset: int) -> int:
    """The bytes a storage needs for this strided layout (0 without elements): torch's
    computeStorageNbytes, its overflow checks and text (set_, resize_)."""
    return _storage_nbytes(tuple(shape), tuple(stride), itemsize, offset)


def empty_strided_layout(shape: Sequence[int], stride: Sequence[int]) -> Layout:
    """The layout torch.empty_strided(shape, stride) gives its new tensor (offset 0).

    mirrors at::empty_strided: computeStorageNbytes first (any negative stride of a
    tensor with elements wraps its uint64 sum: "Storage size calculation overflowed"),
    then TensorImpl::set_sizes_and_strides, which replaces a negative stride (left only
    on a tensor without elements) by the stride a contiguous tensor would have there.
    """
    shape, stride = tuple(shape), tuple(stride)
    _check_ints("size", shape)
    _check_ints("stride", stride)
    _storage_nbytes(shape, stride, 1, 0)
    fixed = list(stride)
    for dim in range(len(shape) - 1, -1, -1):
        if fixed[dim] < 0:
            fixed[dim] = 1 if dim == len(shape) - 1 else max(shape[dim + 1], 1) * fixed[dim + 1]
    return Layout(shape, tuple(fixed), 0)


def _check_numel(shape: Shape) -> None:
    # torch computes numel with unsigned overflow checks; a negative size trips it
    if any(s < 0 for s in shape):
        raise RuntimeError("numel: integer multiplication overflow")


def broadcast_shapes(*shapes: IntOrSeq) -> Shape:
    """torch.broadcast_shapes.  mirrors torch._refs._broadcast_shapes (its texts)."""
    normalized: list[Sequence[int]] = [(s,) if _is_int(s) else s for s in shapes]  # type: ignore[misc]
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
            f"output with shape {_fmt(dst_shape)} doesn't match the broadcast shape {_fmt(common)}"
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


@dataclass(frozen=True, slots=True)
class Layout:
    """A strided view of a storage: element ``i`` lives at ``offset + sum(i[k]*stride[k])``."""

    shape: Shape
    stride: Shape
    offset: int = 0  # in elements

    def __post_init__(self) -> None:
        # every view makes a Layout on both sides: the checks avoid a generator per call
        assert isinstance(self.shape, tuple) and isinstance(self.stride, tuple), self
        assert _all_ints(self.shape) and _all_ints(self.stride), self
        assert _is_int(self.offset), self
        assert len(self.shape) == len(self.stride), f"shape/stride lengths differ: {self}"
        assert min(self.shape, default=0) >= 0, f"negative size: {self}"
        assert self.offset >= 0, f"negative offset: {self}"

    # -- construction and queries ---------------------------------------------------------

    @staticmethod
    def contiguous(shape: Sequence[int], offset: int = 0) -> Layout:
        shape = tuple(shape)
        _check_ints("shape", shape)
        return Layout(shape, contiguous_strides(shape), offset)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def is_contiguous(self, memory_format: str = CONTIGUOUS_FORMAT) -> bool:
        """torch's x.is_contiguous(memory_format=...).

        mirrors TensorImpl::is_contiguous_default over the flags _refresh_contiguous
        sets: a format of the wrong rank is simply False, and preserve_format asks
        the plain (contiguous_format) question.
        """
        _check_memory_format(memory_format)
        if memory_format in _CHANNELS_LAST_ORDER:
            return _is_channels_last_contiguous(self.shape, self.stride, memory_format)
        return _is_contiguous(self.shape, self.stride)

    def suggest_memory_format(self) -> str:
        """The format torch reads off the strides.  mirrors TensorBase::suggest_memory_format
        (its default, not the exact-match variant) over TensorImpl's is_channels_last flags."""
        for memory_format in (CHANNELS_LAST, CHANNELS_LAST_3D):
            if _is_channels_last_strides(self.shape, self.stride, memory_format):
                return memory_format
        return CONTIGUOUS_FORMAT

    def clone_layout(self, memory_format: str = PRESERVE_FORMAT) -> Layout:
        """The layout of x.clone(memory_format=...) (offset 0).  mirrors ATen clone's
        empty_like: preserve_format keeps a dense tensor's strides, else the format's."""
        _check_memory_format(memory_format)
        if memory_format == PRESERVE_FORMAT:
            return self.dense_like()
        return Layout(self.shape, memory_format_strides(self.shape, memory_format), 0)

    def contiguous_layout(self, memory_format: str = CONTIGUOUS_FORMAT) -> Layout | None:
        """x.contiguous(memory_format=...): None when torch returns x itself, else the
        layout of the copy.  mirrors ATen contiguous (its check order and text)."""
        if self.is_contiguous(memory_format):
            return None
        if memory_format == PRESERVE_FORMAT:
            raise RuntimeError("preserve memory format is unsupported by the contiguous operator")
        return self.clone_layout(memory_format)

    def is_non_overlapping_and_dense(self) -> bool:
        return _is_non_overlapping_and_dense(self.shape, self.stride)

    def element_offset_range(self) -> tuple[int, int] | None:
        """The lowest and highest element offset the view reaches (None: it has no elements).

        Exact whatever the signs of the strides: a negative stride reaches *below* the
        offset, so a bounds check using only the highest offset would let it read or
        write outside its Storage.
        """
        if self.numel == 0:
            return None
        return reach_bounds(self.offset, self.shape, self.stride)

    def storage_extent(self) -> int:
        """Elements a storage must hold for this view (0 when it has no elements)."""
        reached = self.element_offset_range()
        return 0 if reached is None else reached[1] + 1

    def dense_like(self) -> Layout:
        """The layout of torch.empty_like(x) (preserve_format), offset 0; used by clone()."""
        if self.is_non_overlapping_and_dense():
            return Layout(self.shape, self.stride, 0)
        return Layout(self.shape, _infer_dense_strides(self.shape, self.stride), 0)

    def _with(
        self, shape: Sequence[int], stride: Sequence[int], offset: int | None = None
    ) -> Layout:
        return Layout(tuple(shape), tuple(stride), self.offset if offset is None else offset)

    def _derived(self, shape: Shape, stride: Shape, offset: int) -> Layout:
        """A layout that keeps this one's invariants by construction (its own ints, kept,
        dropped or swapped; a size clamped into [0, size]; an offset moved to an element it
        reaches, checked >= 0 by the caller), so ``__post_init__``'s checks are skipped:
        select, slicing and transpose are every pipelined view's cost, on both sides."""
        layout: Layout = _new_object(Layout)
        _set_field(layout, "shape", shape)
        _set_field(layout, "stride", stride)
        _set_field(layout, "offset", offset)
        return layout

    # -- view / reshape ---------------------------------------------------------------------

    def reshape(self, *shape: IntOrSeq) -> Layout | None:
        """torch.reshape as a view, or None when torch would copy."""
        new_shape = infer_size(_as_tuple(shape, "shape"), self.numel)
        stride = compute_stride(self.shape, self.stride, new_shape)
        return None if stride is None else self._with(new_shape, stride)

    def view(self, *shape: IntOrSeq) -> Layout:
        """torch.Tensor.view(shape).  mirrors ATen view_impl."""
        result = self.reshape(*shape)
        if result is None:
            raise RuntimeError(
                "view size is not compatible with input tensor's size and stride (at least one "
                "dimension spans across two contiguous subspaces). Use .reshape(...) instead."
            )
        return result

    def view_dtype(
        self,
        old_itemsize: int,
        new_itemsize: int,
        *,
        old_name: str | None = None,
        new_name: str | None = None,
    ) -> Layout:
        """torch.Tensor.view(dtype) between element sizes.  mirrors ATen view_dtype.

        ``old_name``/``new_name`` are c10 ScalarType names (``DType.scalar_type``,
        e.g. "Float") used in the error texts, as torch prints them.
        """
        if old_itemsize == new_itemsize:
            return self
        what = (
            f"to view {old_name or f'{old_itemsize}-byte elements'} as "
            f"{new_name or f'{new_itemsize}-byte elements'} (different element sizes)"
        )
        if self.ndim == 0:
            raise RuntimeError(f"self.dim() cannot be 0 {what}")
        shape, stride = list(self.shape), list(self.stride)
        if old_itemsize > new_itemsize:
            ratio = old_itemsize // new_itemsize
            if stride[-1] != 1:
                raise RuntimeError(f"self.stride(-1) must be 1 {what}, but got {stride[-1]}")
            stride = [s * ratio for s in stride[:-1]] + [1]
            shape[-1] *= ratio
            return self._with(shape, stride, self.offset * ratio)
        ratio = new_itemsize // old_itemsize
        if shape[-1] % ratio != 0:
            raise RuntimeError(
                f"self.size(-1) must be divisible by {ratio} {what}, but got {shape[-1]}"
            )
        if self.offset % ratio != 0:
            raise RuntimeError(
                f"self.storage_offset() must be divisible by {ratio} {what}, but got {self.offset}"
            )
        if stride[-1] != 1:
            raise RuntimeError(f"self.stride(-1) must be 1 {what}, but got {stride[-1]}")
        for i in range(self.ndim - 1):
            if stride[i] % ratio != 0:
                raise RuntimeError(
                    f"self.stride({i}) must be divisible by {ratio} {what}, but got {stride[i]}"
                )
        stride = [s // ratio for s in stride[:-1]] + [1]
        shape[-1] //= ratio
        return self._with(shape, stride, self.offset // ratio)

    # -- slicing ----------------------------------------------------------------------------

    def _slice(self, dim: int, start: int | None, end: int | None, step: int) -> Layout:
        # mirrors ATen slice: clamp start/end into [0, size], round the length up by step
        size = self.shape[dim]
        lo = 0 if start is None else start
        hi = _INT64_MAX if end is None else end
        if lo < 0:
            lo += size
        if hi < 0:
            hi += size
        lo = min(max(lo, 0), size)
        hi = min(max(hi, lo), size)
        shape, stride = list(self.shape), list(self.stride)
        shape[dim] = (hi - lo + step - 1) // step
        stride[dim] *= step
        offset = self.offset + lo * self.stride[dim]
        if type(lo) is int and type(hi) is int and type(step) is int and step > 0 and offset >= 0:
            return self._derived(tuple(shape), tuple(stride), offset)
        return self._with(shape, stride, offset)

    def narrow(self, dim: int, start: int, length: int) -> Layout:
        """mirrors ATen narrow."""
        if self.ndim == 0:
            raise RuntimeError("narrow() cannot be applied to a 0-dim tensor.")
        if length < 0:
            raise RuntimeError("narrow(): length must be non-negative.")
        dim = normalize_dim(dim, self.ndim)
        size = self.shape[dim]
        if not -size <= start <= size:
            raise IndexError(
                f"start out of range (expected to be in range of [{-size}, {size}], but got {start})"
            )
        if start < 0:
            start += size
        if start > size - length:
            raise RuntimeError(
                f"start ({start}) + length ({length}) exceeds dimension size ({size})."
            )
        return self._slice(dim, start, start + length, 1)

    def select(self, dim: int, index: int) -> Layout:
        """mirrors ATen select."""
        if self.ndim == 0:
            raise IndexError("select() cannot be applied to a 0-dim tensor.")
        dim = normalize_dim(dim, self.ndim)
        size = self.shape[dim]
        if index < -size or index >= size:
            raise IndexError(
                f"select(): index {index} out of range for tensor of size {_fmt(self.shape)} "
                f"at dimension {dim}"
            )
        if index < 0:
            index += size
        shape = self.shape[:dim] + self.shape[dim + 1 :]
        stride = self.stride[:dim] + self.stride[dim + 1 :]
        offset = self.offset + index * self.stride[dim]
        if type(index) is int and offset >= 0:  # (a negative stride could move it below 0)
            return self._derived(shape, stride, offset)
        return self._with(shape, stride, offset)

    def __getitem__(self, index: Index | tuple[Index, ...]) -> Layout:
        """Basic indexing x[...]: ints, slices (step > 0), None, Ellipsis.

        mirrors torch/csrc/autograd/python_variable_indexing.cpp and applySlicing.
        """
        if not isinstance(index, tuple):
            # torch's single-index fast paths skip the "too many indices" count
            if _is_int(index):
                assert isinstance(index, int)
                return self._index_int(0, index, 0)
            if isinstance(index, slice):
                return self._index_slice(0, index)
            if index is None:
                return self.unsqueeze(0)
            if index is Ellipsis:
                return self
            index = (index,)
        for item in index:
            if isinstance(item, float):
                raise IndexError(
                    "only integers, slices (`:`), ellipsis (`...`), None and long or byte "
                    "Variables are valid indices (got float)"
                )
            if not (_is_int(item) or isinstance(item, slice) or item is None or item is Ellipsis):
                raise TypeError(
                    "tensord supports only basic indexing (ints, slices, None, Ellipsis); "
                    f"got {type(item).__name__}"
                )
        specified = sum(1 for i in index if _is_int(i) or isinstance(i, slice))
        if specified > self.ndim:
            raise IndexError(f"too many indices for tensor of dimension {self.ndim}")
        result = self
        dim = 0
        for real_dim, item in enumerate(index):
            if _is_int(item):
                assert isinstance(item, int)
                result = result._index_int(dim, item, real_dim)
            elif isinstance(item, slice):
                result = result._index_slice(dim, item)
                dim += 1
            elif item is None:
                result = result.unsqueeze(dim)
                dim += 1
            else:
                dim += self.ndim - specified
        return result

    def _index_int(self, dim: int, index: int, real_dim: int) -> Layout:
        # mirrors applySelect
        if index == 0 and dim == 0 and self.ndim == 0:
            raise IndexError(
                "invalid index of a 0-dim tensor. Use `tensor.item()` in Python or "
                "`tensor.item<T>()` in C++ to convert a 0-dim tensor to a number"
            )
        if dim >= self.ndim > 0:
            # torch reads past the sizes here (more than one Ellipsis); select then rejects the dim
            return self.select(dim, index)
        size = self.shape[dim] if self.ndim else 0  # what torch reports for a 0-dim tensor
        if not -size <= index < size:
            raise IndexError(
                f"index {index} is out of bounds for dimension {real_dim} with size {size}"
            )
        return self.select(dim, index)

    def _index_slice(self, dim: int, item: slice) -> Layout:
        step = 1 if item.step is None else item.step
        for part in (item.start, item.stop, item.step):
            if part is not None and not _is_int(part):
                raise TypeError(
                    "slice indices must be integers or None or have an __index__ method"
                )
        if step == 0:
            raise ValueError("slice step cannot be zero")
        if step < 0:
            raise ValueError("step must be greater than zero")
        if self.ndim == 0:
            raise IndexError("slice() cannot be applied to a 0-dim tensor.")
        dim = normalize_dim(dim, self.ndim)
        return self._slice(dim, item.start, item.stop, step)

    # -- dim shuffles -----------------------------------------------------------------------

    def transpose(self, dim0: int, dim1: int) -> Layout:
        dim0 = normalize_dim(dim0, self.ndim)
        dim1 = normalize_dim(dim1, self.ndim)
        if dim0 == dim1:
            return self
        shape, stride = list(self.shape), list(self.stride)
        shape[dim0], shape[dim1] = shape[dim1], shape[dim0]
        stride[dim0], stride[dim1] = stride[dim1], stride[dim0]
        return self._derived(tuple(shape), tuple(stride), self.offset)

    def t(self) -> Layout:
        if self.ndim > 2:
            raise RuntimeError(
                f"t() expects a tensor with <= 2 dimensions, but self is {self.ndim}D"
            )
        return self.transpose(0, 1) if self.ndim == 2 else self

    def permute(self, *dims: IntOrSeq) -> Layout:
        """mirrors ATen permute (its text, oddly naming sparse_coo, included)."""
        order = _as_tuple(dims, "dims")
        if len(order) != self.ndim:
            raise RuntimeError(
                "permute(sparse_coo): number of dimensions in the tensor input does not match "
                "the length of the desired ordering of dimensions i.e. input.dim() = "
                f"{self.ndim} is not equal to len(dims) = {len(order)}"
            )
        seen: set[int] = set()
        wrapped = []
        for d in order:
            w = normalize_dim(d, self.ndim)
            if w in seen:
                raise RuntimeError("permute(): duplicate dims are not allowed.")
            seen.add(w)
            wrapped.append(w)
        return self._with([self.shape[d] for d in wrapped], [self.stride[d] for d in wrapped])

    def movedim(self, source: IntOrSeq, destination: IntOrSeq) -> Layout:
        """mirrors ATen movedim."""
        src = _int_or_seq(source, "source")
        dst = _int_or_seq(destination, "destination")
        if len(src) != len(dst):
            raise RuntimeError(
                f"movedim: Invalid source or destination dims: source ({_fmt(src)} dims) should "
                f"contain the same number of dims as destination ({_fmt(dst)} dims)"
            )
        nsrc = [normalize_dim(d, self.ndim) for d in src]
        ndst = [normalize_dim(d, self.ndim) for d in dst]
        if len(set(nsrc)) != len(nsrc):
            raise RuntimeError(f"movedim: repeated dim in `source` ({_fmt(src)})")
        if len(set(ndst)) != len(ndst):
            raise RuntimeError(f"movedim: repeated dim in `destination` ({_fmt(dst)})")
        if self.ndim == 0:
            return self
        order: list[int | None] = [None] * self.ndim
        for s, d in zip(nsrc, ndst, strict=True):
            order[d] = s
        rest = iter(d for d in range(self.ndim) if d not in set(nsrc))
        perm = [next(rest) if o is None else o for o in order]
        return self._with([self.shape[d] for d in perm], [self.stride[d] for d in perm])

    def expand(self, *sizes: IntOrSeq, type_name: str = "Tensor") -> Layout:
        """mirrors ATen expand / inferExpandGeometry.

        ``type_name`` is what torch prints for the tensor in one error text
        (``tensord.dtypes.tensor_type_name(dtype, device_type)``, e.g. "torch.FloatTensor").
        """
        target = _as_tuple(sizes, "size")
        if len(target) < self.ndim:
            raise RuntimeError(
                f"expand({type_name}{{{_fmt(self.shape)}}}, size={_fmt(target)}): the number of "
                f"sizes provided ({len(target)}) must be greater or equal to the number of "
                f"dimensions in the tensor ({self.ndim})"
            )
        ndim = len(target)
        if self.ndim == 0:
            _check_numel(target)
            return self._with(target, (0,) * ndim)
        shape = [0] * ndim
        stride = [0] * ndim
        for i in range(ndim - 1, -1, -1):
            dim = self.ndim - (ndim - i)
            size = self.shape[dim] if dim >= 0 else 1
            st = self.stride[dim] if dim >= 0 else shape[i + 1] * stride[i + 1]
            want = target[i]
            if want == -1:
                if dim < 0:
                    raise RuntimeError(
                        f"The expanded size of the tensor ({want}) isn't allowed in a leading, "
                        f"non-existing dimension {i}"
                    )
                want = size
            if size != want:
                if size != 1:
                    raise RuntimeError(
                        f"The expanded size of the tensor ({want}) must match the existing size "
                        f"({size}) at non-singleton dimension {i}.  Target sizes: {_fmt(target)}.  "
                        f"Tensor sizes: {_fmt(self.shape)}"
                    )
                size, st = want, 0
            shape[i], stride[i] = size, st
        _check_numel(tuple(shape))
        return self._with(shape, stride)

    def squeeze(self, dim: IntOrSeq | None = None) -> Layout:
        """mirrors ATen squeeze / inferSqueezeGeometry (all, one dim, or a list)."""
        if dim is None:
            keep = [d for d in range(self.ndim) if self.shape[d] != 1]
        else:
            dims = _int_or_seq(dim, "dim")
            wrapped: set[int] = set()
            for d in dims:
                w = normalize_dim(d, self.ndim)
                if w in wrapped:
                    raise RuntimeError(f"dim {w} appears multiple times in the list of dims")
                wrapped.add(w)
            keep = [d for d in range(self.ndim) if not (d in wrapped and self.shape[d] == 1)]
        return self._with([self.shape[d] for d in keep], [self.stride[d] for d in keep])

    def unsqueeze(self, dim: int) -> Layout:
        """mirrors ATen inferUnsqueezeGeometry."""
        dim = normalize_dim(dim, self.ndim + 1)
        new_stride = 1 if dim >= self.ndim else self.shape[dim] * self.stride[dim]
        return self._with(
            (*self.shape[:dim], 1, *self.shape[dim:]),
            (*self.stride[:dim], new_stride, *self.stride[dim:]),
        )

    def flatten(self, start_dim: int = 0, end_dim: int = -1) -> Layout | None:
        """torch.flatten as a view, or None when torch would copy (it reshapes)."""
        start = normalize_dim(start_dim, self.ndim)
        end = normalize_dim(end_dim, self.ndim)
        if start > end:
            raise RuntimeError("flatten() has invalid args: start_dim cannot come after end_dim")
        if self.ndim == 0:
            return self.reshape((1,))
        if start == end:
            return self
        merged = math.prod(self.shape[start : end + 1])
        return self.reshape((*self.shape[:start], merged, *self.shape[end + 1 :]))

    def unflatten(self, dim: int, sizes: Sequence[int]) -> Layout:
        """mirrors ATen unflatten (a view: raises when not viewable)."""
        if not _is_int(dim):  # torch's argument parser, before anything else
            raise TypeError(
                f"unflatten(): argument 'dim' (position 1) must be int, not {type(dim).__name__}"
            )
        sizes = tuple(sizes)
        _check_ints("sizes", sizes)
        if not sizes:
            raise RuntimeError("unflatten: sizes must be non-empty")
        dim = normalize_dim(dim, self.ndim)
        if self.ndim == 0:
            raise RuntimeError(
                "unflatten got an unexpected error:\n"
                f"Dimension specified as {dim} but tensor has no dimensions"
            )
        try:
            inferred = infer_size(sizes, self.shape[dim])
        except RuntimeError as e:
            if "is invalid for input of size" in str(e):
                raise RuntimeError(
                    f"unflatten: Provided sizes {_fmt(sizes)} don't multiply up to the size of "
                    f"dim {dim} ({self.shape[dim]}) in the input tensor"
                ) from None
            raise RuntimeError(f"unflatten got an unexpected error:\n{e}") from None
        return self.view(self.shape[:dim] + inferred + self.shape[dim + 1 :])

    # -- splitting --------------------------------------------------------------------------

    def split(self, split_size_or_sections: IntOrSeq, dim: int = 0) -> tuple[Layout, ...]:
        """mirrors ATen split / split_with_sizes (torch.Tensor.split's dispatch on the type)."""
        if not _is_int(split_size_or_sections):
            sections = tuple(split_size_or_sections)  # type: ignore[arg-type]
            _check_ints("split_sizes", sections)
            return self._split_with_sizes(sections, dim)
        split_size = split_size_or_sections
        assert isinstance(split_size, int)
        if self.ndim == 0:
            raise RuntimeError("split expects at least a 1-dimensional tensor")
        if split_size < 0:
            raise RuntimeError(
                f"split expects split_size be non-negative, but got split_size={split_size}"
            )
        dim = normalize_dim(dim, self.ndim)
        size = self.shape[dim]
        if split_size == 0 and size != 0:
            raise RuntimeError(
                f"split_size can only be 0 if dimension size is 0, but got dimension size of {size}"
            )
        n = max((size + split_size - 1) // split_size, 1) if split_size else 1
        last = split_size - (split_size * n - size)
        return tuple(
            self.narrow(dim, i * split_size, last if i == n - 1 else split_size) for i in range(n)
        )

    def _split_with_sizes(self, sizes: Shape, dim: int) -> tuple[Layout, ...]:
        if self.ndim == 0:
            raise RuntimeError("split expects at least a 1-dimensional tensor")
        wrapped = normalize_dim(dim, self.ndim)
        if any(n < 0 for n in sizes):
            raise RuntimeError(
                "split_with_sizes expects split_sizes have only non-negative entries, but got "
                f"split_sizes={_fmt(sizes)}"
            )
        if sum(sizes) != self.shape[wrapped]:
            raise RuntimeError(
                f"split_with_sizes expects split_sizes to sum exactly to {self.shape[wrapped]} "
                f"(input tensor's size at dimension {dim}), but got split_sizes={_fmt(sizes)}"
            )
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        parts = [self.narrow(wrapped, s, n) for s, n in zip(starts, sizes, strict=True)]
        return tuple(parts)

    def chunk(self, chunks: int, dim: int = 0) -> tuple[Layout, ...]:
        """mirrors ATen chunk."""
        if self.ndim == 0:
            raise RuntimeError("chunk expects at least a 1-dimensional tensor")
        if chunks <= 0:
            raise RuntimeError(f"chunk expects `chunks` to be greater than 0, got: {chunks}")
        dim = normalize_dim(dim, self.ndim)
        size = self.shape[dim]
        split_size = (size + chunks - 1) // chunks
        if split_size == 0 and size == 0:
            # split() would lose the chunk count: n empty chunks add up to 0
            return self._split_with_sizes((0,) * chunks, dim)
        return self.split(split_size, dim)

    def unbind(self, dim: int = 0) -> tuple[Layout, ...]:
        """mirrors ATen unbind."""
        dim = normalize_dim(dim, self.ndim)
        if self.ndim == 0:  # torch then asks a 0-dim tensor for size(dim)
            raise IndexError(f"Dimension specified as {dim} but tensor has no dimensions")
        return tuple(self.select(dim, i) for i in range(self.shape[dim]))

    def tensor_split(self, indices_or_sections: IntOrSeq, dim: int = 0) -> tuple[Layout, ...]:
        """mirrors ATen tensor_split (an int: that many sections; a sequence: split indices).

        Each part is a slice, so indices out of order or past the end give empty parts
        (clamped as slice clamps), and parts may overlap nothing but never repeat data.
        """
        if self.ndim == 0:
            raise RuntimeError(
                "tensor_split expected at least a 1-dimensional tensor, but got a tensor with "
                f"{self.ndim} dims"
            )
        dim = normalize_dim(dim, self.ndim)
        size = self.shape[dim]
        if _is_int(indices_or_sections):
            sections = indices_or_sections
            assert isinstance(sections, int)
            if sections <= 0:
                raise RuntimeError(f"number of sections must be larger than 0, got {sections}")
            smallest, extra = divmod(size, sections)
            sizes = [smallest + 1 if i < extra else smallest for i in range(sections)]
            starts = [sum(sizes[:i]) for i in range(sections)]
            return tuple(self._slice(dim, s, s + n, 1) for s, n in zip(starts, sizes, strict=True))
        indices = tuple(indices_or_sections)  # type: ignore[arg-type]
        _check_ints("indices", indices)
        bounds = [0, *indices]
        parts = [self._slice(dim, lo, hi, 1) for lo, hi in zip(bounds, indices, strict=False)]
        parts.append(self._slice(dim, bounds[-1], size, 1))
        return tuple(parts)

    def _split_along(
        self, name: str, dim: int, min_ndim: int, indices_or_sections: IntOrSeq
    ) -> tuple[Layout, ...]:
        # mirrors ATen hsplit/vsplit/dsplit: a rank check, then a divisibility check on an int
        if self.ndim < min_ndim:
            raise RuntimeError(  # torch says "dimension" whatever the count
                f"torch.{name} requires a tensor with at least {min_ndim} dimension, but got a "
                f"tensor with {self.ndim} dimensions!"
            )
        if _is_int(indices_or_sections):
            split_size = indices_or_sections
            assert isinstance(split_size, int)
            if split_size == 0 or self.shape[dim] % split_size != 0:
                raise RuntimeError(
                    f"torch.{name} attempted to split along dimension {dim}, but the size of the "
                    f"dimension {self.shape[dim]} is not divisible by the split_size "
                    f"{split_size}!"
                )
        return self.tensor_split(indices_or_sections, dim)

    def hsplit(self, indices_or_sections: IntOrSeq) -> tuple[Layout, ...]:
        """mirrors ATen hsplit (dim 1, or 0 for a 1-dim tensor)."""
        return self._split_along("hsplit", 0 if self.ndim == 1 else 1, 1, indices_or_sections)

    def vsplit(self, indices_or_sections: IntOrSeq) -> tuple[Layout, ...]:
        """mirrors ATen vsplit (dim 0)."""
        return self._split_along("vsplit", 0, 2, indices_or_sections)

    def dsplit(self, indices_or_sections: IntOrSeq) -> tuple[Layout, ...]:
        """mirrors ATen dsplit (dim 2)."""
        return self._split_along("dsplit", 2, 3, indices_or_sections)

    def unfold(self, dim: int, size: int, step: int) -> Layout:
        """mirrors ATen unfold (a 0-dim tensor unfolds along its one implicit dim)."""
        dim = normalize_dim(dim, self.ndim)
        max_size = 1 if self.ndim == 0 else self.shape[dim]
        if size > max_size:
            raise RuntimeError(
                f"maximum size for tensor at dimension {dim} is {max_size} but size is {size}"
            )
        if size < 0:
            raise RuntimeError(f"size is {size} but must be >= 0")
        if step <= 0:
            raise RuntimeError(f"step is {step} but must be > 0")
        shape, stride = (
            [*self.shape, size],
            [*self.stride, 1 if self.ndim == 0 else self.stride[dim]],
        )
        if dim < self.ndim:
            shape[dim] = (shape[dim] - size) // step + 1
            stride[dim] *= step
        return self._with(shape, stride)

    def ravel(self) -> Layout | None:
        """torch.ravel as a view, or None when it copies.  mirrors ATen ravel:
        contiguous().view(-1), so a non-contiguous tensor copies even where reshape
        could view it."""
        if not self.is_contiguous():
            return None
        return self.view(-1)

    def matrix_transpose(self, name: str) -> Layout:
        """x.mT / x.mH / x.adjoint() of a real tensor (``name`` is what torch's text says).

        mirrors ATen _adjoint: a 0-dim tensor is itself (torch warns once; the SDK does).
        """
        if self.ndim == 0:
            return self
        if self.ndim < 2:
            raise RuntimeError(
                f"tensor.{name} is only supported on matrices or batches of matrices. "
                f"Got {self.ndim}-D tensor."
            )
        return self.transpose(-2, -1)

    def h(self) -> Layout:
        """x.H of a real tensor.  mirrors ATen matrix_H (0-dim: itself, with a warning)."""
        if self.ndim == 0:
            return self
        if self.ndim != 2:
            hint = " For batches of matrices, consider using tensor.mH" if self.ndim > 2 else ""
            raise RuntimeError(
                f"tensor.H is only supported on matrices (2-D tensors). Got {self.ndim}-D tensor."
                + hint
            )
        return self.transpose(0, 1)

    def diagonal(self, offset: int = 0, dim1: int = 0, dim2: int = 1) -> Layout:
        """mirrors ATen diagonal."""
        d1 = normalize_dim(dim1, self.ndim)
        d2 = normalize_dim(dim2, self.ndim)
        if d1 == d2:
            raise RuntimeError(f"diagonal dimensions cannot be identical {dim1}, {dim2}")
        new_offset = self.offset
        if offset >= 0:
            diag = max(min(self.shape[d1], self.shape[d2] - offset), 0)
        else:
            diag = max(min(self.shape[d1] + offset, self.shape[d2]), 0)
        if diag > 0:
            new_offset += offset * self.stride[d2] if offset >= 0 else -offset * self.stride[d1]
        keep = [d for d in range(self.ndim) if d not in (d1, d2)]
        return self._with(
            [self.shape[d] for d in keep] + [diag],
            [self.stride[d] for d in keep] + [self.stride[d1] + self.stride[d2]],
            new_offset,
        )

    def as_strided(
        self,
        size: Sequence[int],
        stride: Sequence[int],
        storage_offset: int | None = None,
        *,
        storage_elements: int,
        itemsize: int = 1,
    ) -> Layout:
        """mirrors ATen as_strided / setStrided / checkInBoundsForStorage.

        ``storage_elements`` is the storage's size in elements of ``itemsize``
        bytes; the error text speaks in bytes, as torch's does.
        """
        shape, strides = tuple(size), tuple(stride)
        _check_ints("size", shape)
        _check_ints("stride", strides)
        offset = self.offset if storage_offset is None else storage_offset
        if len(shape) != len(strides):
            raise RuntimeError("mismatch in length of strides and shape")
        if any(s < 0 for s in strides):
            raise RuntimeError(
                "as_strided: Negative strides are not supported at the moment, got strides: "
                f"{_fmt(strides)}"
            )
        if offset < 0:
            raise RuntimeError(f"Tensor: invalid storage offset {offset}")
        needed = _storage_nbytes(shape, strides, itemsize, 0)
        if needed != 0:
            needed_with_offset = _storage_nbytes(shape, strides, itemsize, offset)
            have = storage_elements * itemsize
            if needed_with_offset > have:
                raise RuntimeError(
                    f"setStorage: sizes {_fmt(shape)}, strides {_fmt(strides)}, storage offset "
                    f"{offset}, and itemsize {itemsize} requiring a storage size of "
                    f"{needed_with_offset} are out of bounds for storage of size {have}"
                )
        _check_numel(shape)
        return Layout(shape, strides, offset)


# ---- complex views -----------------------------------------------------------------
# torch's complex views and its lazy conjugate and negative bits.  A tensor's values are
# its stored values, conjugated if its conj bit is set and negated if its neg bit is; a
# view keeps both bits (they are part of what the handle names, not of the bytes).

VIEW_AS_REAL_OF_CONJ = (
    "view_as_real doesn't work on unresolved conjugated tensors.  To resolve the conjugate "
    "tensor so you can view it as real, use self.resolve_conj(); however, be warned that the "
    "resulting tensor will NOT alias the original."
)
VIEW_DTYPE_OF_CONJ = (
    "torch.Tensor.view is not supported for conjugate view tensors when converting to a "
    "different dtype."
)
VIEW_DTYPE_OF_NEG = (
    "torch.Tensor.view is not supported for tensors with negative bit set when converting to "
    "a different dtype."
)
COMPLEX_VIEW_OPS = ("real", "imag", "view_as_real", "view_as_complex", "conj")

# complex dtype name <-> the real dtype of its parts (c10 toRealValueType / toComplexType)
_REAL_OF_COMPLEX = {"complex64": "float32", "complex128": "float64"}
_COMPLEX_OF_REAL = {"float32": "complex64", "float64": "complex128"}
_VIEW_AS_COMPLEX_INPUTS = ("float16", "float32", "float64")


def view_result_count(layout: Layout, name: str, args: Sequence[object]) -> int | None:
    """How many tensors ``split``/``chunk``/``unbind`` will return (mirrors their ATen
    arithmetic), from the arguments alone, before one is built; None for any other op,
    or for arguments the layout engine refuses with torch's own error (it raises it)."""
    if name not in ("split", "chunk", "unbind") or layout.ndim == 0:
        return None
    dim = args[-1] if len(args) == (1 if name == "unbind" else 2) else 0
    try:
        size = layout.shape[normalize_dim(dim, layout.ndim)]  # type: ignore[arg-type]
    except (IndexError, TypeError):
        return None
    if name == "unbind":
        return size
    amount = args[0]
    if name == "split" and isinstance(amount, Sequence):
        return len(amount)
    if not isinstance(amount, int) or isinstance(amount, bool):
        return None
    if name == "chunk":
        if amount <= 0:
            return None
        if size == 0:
            return amount  # torch returns `chunks` empty tensors
        amount = -(-size // amount)  # chunk is split by this size
    if amount < 0 or (amount == 0 and size != 0):
        return None
    return max(-(-size // amount), 1) if amount else 1


@dataclass(frozen=True, slots=True)
class LazyView:
    """What a complex view names: a layout, a dtype (by name) and torch's two lazy bits."""

    layout: Layout
    dtype: str
    conj: bool = False
    neg: bool = False


def check_view_dtype_bits(conj: bool, neg: bool) -> None:
    """x.view(dtype) of a tensor with a lazy bit (even to its own dtype).  mirrors ATen view_dtype."""
    if conj:
        raise RuntimeError(VIEW_DTYPE_OF_CONJ)
    if neg:
        raise RuntimeError(VIEW_DTYPE_OF_NEG)


def view_as_real_layout(layout: Layout) -> Layout:
    """mirrors ATen _view_as_real_physical: a new last dim of 2 (real, imag), in real elements."""
    return Layout((*layout.shape, 2), (*(2 * s for s in layout.stride), 1), 2 * layout.offset)


def view_as_complex_layout(layout: Layout) -> Layout:
    """mirrors ATen view_as_complex's checks (after the dtype's), in its order."""
    if layout.ndim == 0:
        raise RuntimeError("Input tensor must have one or more dimensions")
    if layout.shape[-1] != 2:
        raise RuntimeError("Tensor must have a last dimension of size 2")
    if layout.stride[-1] != 1:
        raise RuntimeError("Tensor must have a last dimension with stride 1")
    if any(s % 2 != 0 for s in layout.stride[:-1]):
        raise RuntimeError("Tensor must have a stride divisible by 2 for all but last dimension")
    if layout.offset % 2 != 0:
        raise RuntimeError("Tensor must have a storage_offset divisible by 2")
    return Layout(layout.shape[:-1], tuple(s // 2 for s in layout.stride[:-1]), layout.offset // 2)


def complex_view(
    op: str, layout: Layout, dtype: str, scalar_type: str, conj: bool, neg: bool
) -> LazyView:
    """One of torch's complex views of a tensor (``dtype`` by name, ``scalar_type`` c10's
    name of it for error texts): ``real``, ``imag``, ``view_as_real``, ``view_as_complex``
    or ``conj``.  Where torch returns the tensor itself (``real``/``conj`` of a real
    tensor) the result is the same view.  mirrors ATen real, imag, view_as_real,
    view_as_complex and conj (_conj flips the bit)."""
    complex_ = dtype in _REAL_OF_COMPLEX
    if op == "conj":
        return LazyView(layout, dtype, conj != complex_, neg)  # torch: self when not complex
    if op == "real" and not complex_:
        return LazyView(layout, dtype, conj, neg)
    if op == "imag" and not complex_:
        raise RuntimeError("imag is not implemented for tensors with non-complex dtypes.")
    if op in ("real", "imag"):
        # view_as_real of the unconjugated tensor; imag of a conjugate is the negated imag
        parts = view_as_real_layout(layout)
        which = 0 if op == "real" else 1
        return LazyView(
            parts.select(-1, which), _REAL_OF_COMPLEX[dtype], False, neg != (conj and which == 1)
        )
    if op == "view_as_real":
        if conj:
            raise RuntimeError(VIEW_AS_REAL_OF_CONJ)
        if not complex_:
            raise RuntimeError("view_as_real is only supported for complex tensors")
        return LazyView(view_as_real_layout(layout), _REAL_OF_COMPLEX[dtype], False, neg)
    if op == "view_as_complex":
        if dtype not in _VIEW_AS_COMPLEX_INPUTS:
            raise RuntimeError(
                "view_as_complex is only supported for half, float and double tensors, but got "
                f"a tensor of scalar type: {scalar_type}"
            )
        viewed = view_as_complex_layout(layout)
        if dtype not in _COMPLEX_OF_REAL:
            raise TypeError(
                "tensord has no complex32 (ComplexHalf) dtype, which torch would use here"
            )
        return LazyView(viewed, _COMPLEX_OF_REAL[dtype], False, neg)
    raise ValueError(f"unknown complex view {op!r}")
