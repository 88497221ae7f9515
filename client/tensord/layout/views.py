"""The :class:`Layout` of a strided view, and each of torch's view ops on it.

A Layout is immutable: every op returns a new one (or raises torch's own error), from the
shape and stride arithmetic of :mod:`tensord.layout.shapes`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tensord.layout.shapes import (
    CHANNELS_LAST,
    CHANNELS_LAST_3D,
    CHANNELS_LAST_ORDER,
    CONTIGUOUS_FORMAT,
    INT64_MAX,
    PRESERVE_FORMAT,
    Index,
    IntOrSeq,
    Shape,
    all_ints,
    as_int_tuple,
    check_ints,
    check_memory_format,
    check_numel,
    compute_stride,
    contiguous_strides,
    format_ints,
    infer_dense_strides,
    infer_size,
    int_or_seq,
    is_channels_last_contiguous,
    is_channels_last_strides,
    is_contiguous_strides,
    is_int,
    is_non_overlapping_and_dense_strides,
    memory_format_strides,
    new_object,
    normalize_dim,
    reach_bounds,
    set_field,
    tuple_storage_nbytes,
)


@dataclass(frozen=True, slots=True)
class Layout:
    """A strided view of a storage: element ``i`` lives at ``offset + sum(i[k]*stride[k])``."""

    shape: Shape
    stride: Shape
    offset: int = 0  # in elements

    def __post_init__(self) -> None:
        # every view makes a Layout on both sides: the checks avoid a generator per call
        assert isinstance(self.shape, tuple) and isinstance(self.stride, tuple), self
        assert all_ints(self.shape) and all_ints(self.stride), self
        assert is_int(self.offset), self
        assert len(self.shape) == len(self.stride), f"shape/stride lengths differ: {self}"
        assert min(self.shape, default=0) >= 0, f"negative size: {self}"
        assert self.offset >= 0, f"negative offset: {self}"

    # -- construction and queries ---------------------------------------------------------

    @staticmethod
    def contiguous(shape: Sequence[int], offset: int = 0) -> Layout:
        shape = tuple(shape)
        check_ints("shape", shape)
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
        check_memory_format(memory_format)
        if memory_format in CHANNELS_LAST_ORDER:
            return is_channels_last_contiguous(self.shape, self.stride, memory_format)
        return is_contiguous_strides(self.shape, self.stride)

    def suggest_memory_format(self) -> str:
        """The format torch reads off the strides.  mirrors TensorBase::suggest_memory_format
        (its default, not the exact-match variant) over TensorImpl's is_channels_last flags."""
        for memory_format in (CHANNELS_LAST, CHANNELS_LAST_3D):
            if is_channels_last_strides(self.shape, self.stride, memory_format):
                return memory_format
        return CONTIGUOUS_FORMAT

    def clone_layout(self, memory_format: str = PRESERVE_FORMAT) -> Layout:
        """The layout of x.clone(memory_format=...) (offset 0).  mirrors ATen clone's
        empty_like: preserve_format keeps a dense tensor's strides, else the format's."""
        check_memory_format(memory_format)
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
        return is_non_overlapping_and_dense_strides(self.shape, self.stride)

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
        return Layout(self.shape, infer_dense_strides(self.shape, self.stride), 0)

    def _with(
        self, shape: Sequence[int], stride: Sequence[int], offset: int | None = None
    ) -> Layout:
        return Layout(tuple(shape), tuple(stride), self.offset if offset is None else offset)

    def _derived(self, shape: Shape, stride: Shape, offset: int) -> Layout:
        """A layout that keeps this one's invariants by construction (its own ints, kept,
        dropped or swapped; a size clamped into [0, size]; an offset moved to an element it
        reaches, checked >= 0 by the caller), so ``__post_init__``'s checks are skipped:
        select, slicing and transpose are every pipelined view's cost, on both sides."""
        layout: Layout = new_object(Layout)
        set_field(layout, "shape", shape)
        set_field(layout, "stride", stride)
        set_field(layout, "offset", offset)
        return layout

    # -- view / reshape ---------------------------------------------------------------------

    def reshape(self, *shape: IntOrSeq) -> Layout | None:
        """torch.reshape as a view, or None when torch would copy."""
        new_shape = infer_size(as_int_tuple(shape, "shape"), self.numel)
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
        hi = INT64_MAX if end is None else end
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
                f"select(): index {index} out of range for tensor of size {format_ints(self.shape)} "
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
            if is_int(index):
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
            if not (is_int(item) or isinstance(item, slice) or item is None or item is Ellipsis):
                raise TypeError(
                    "tensord supports only basic indexing (ints, slices, None, Ellipsis); "
                    f"got {type(item).__name__}"
                )
        specified = sum(1 for i in index if is_int(i) or isinstance(i, slice))
        if specified > self.ndim:
            raise IndexError(f"too many indices for tensor of dimension {self.ndim}")
        result = self
        dim = 0
        for real_dim, item in enumerate(index):
            if is_int(item):
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
            if part is not None and not is_int(part):
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
        order = as_int_tuple(dims, "dims")
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
        src = int_or_seq(source, "source")
        dst = int_or_seq(destination, "destination")
        if len(src) != len(dst):
            raise RuntimeError(
                f"movedim: Invalid source or destination dims: source ({format_ints(src)} dims) should "
                f"contain the same number of dims as destination ({format_ints(dst)} dims)"
            )
        nsrc = [normalize_dim(d, self.ndim) for d in src]
        ndst = [normalize_dim(d, self.ndim) for d in dst]
        if len(set(nsrc)) != len(nsrc):
            raise RuntimeError(f"movedim: repeated dim in `source` ({format_ints(src)})")
        if len(set(ndst)) != len(ndst):
            raise RuntimeError(f"movedim: repeated dim in `destination` ({format_ints(dst)})")
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
        target = as_int_tuple(sizes, "size")
        if len(target) < self.ndim:
            raise RuntimeError(
                f"expand({type_name}{{{format_ints(self.shape)}}}, size={format_ints(target)}): the number of "
                f"sizes provided ({len(target)}) must be greater or equal to the number of "
                f"dimensions in the tensor ({self.ndim})"
            )
        ndim = len(target)
        if self.ndim == 0:
            check_numel(target)
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
                        f"({size}) at non-singleton dimension {i}.  Target sizes: {format_ints(target)}.  "
                        f"Tensor sizes: {format_ints(self.shape)}"
                    )
                size, st = want, 0
            shape[i], stride[i] = size, st
        check_numel(tuple(shape))
        return self._with(shape, stride)

    def squeeze(self, dim: IntOrSeq | None = None) -> Layout:
        """mirrors ATen squeeze / inferSqueezeGeometry (all, one dim, or a list)."""
        if dim is None:
            keep = [d for d in range(self.ndim) if self.shape[d] != 1]
        else:
            dims = int_or_seq(dim, "dim")
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
        if not is_int(dim):  # torch's argument parser, before anything else
            raise TypeError(
                f"unflatten(): argument 'dim' (position 1) must be int, not {type(dim).__name__}"
            )
        sizes = tuple(sizes)
        check_ints("sizes", sizes)
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
                    f"unflatten: Provided sizes {format_ints(sizes)} don't multiply up to the size of "
                    f"dim {dim} ({self.shape[dim]}) in the input tensor"
                ) from None
            raise RuntimeError(f"unflatten got an unexpected error:\n{e}") from None
        return self.view(self.shape[:dim] + inferred + self.shape[dim + 1 :])

    # -- splitting --------------------------------------------------------------------------

    def split(self, split_size_or_sections: IntOrSeq, dim: int = 0) -> tuple[Layout, ...]:
        """mirrors ATen split / split_with_sizes (torch.Tensor.split's dispatch on the type)."""
        if not is_int(split_size_or_sections):
            sections = tuple(split_size_or_sections)  # type: ignore[arg-type]
            check_ints("split_sizes", sections)
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
                f"split_sizes={format_ints(sizes)}"
            )
        if sum(sizes) != self.shape[wrapped]:
            raise RuntimeError(
                f"split_with_sizes expects split_sizes to sum exactly to {self.shape[wrapped]} "
                f"(input tensor's size at dimension {dim}), but got split_sizes={format_ints(sizes)}"
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
        if is_int(indices_or_sections):
            sections = indices_or_sections
            assert isinstance(sections, int)
            if sections <= 0:
                raise RuntimeError(f"number of sections must be larger than 0, got {sections}")
            smallest, extra = divmod(size, sections)
            sizes = [smallest + 1 if i < extra else smallest for i in range(sections)]
            starts = [sum(sizes[:i]) for i in range(sections)]
            return tuple(self._slice(dim, s, s + n, 1) for s, n in zip(starts, sizes, strict=True))
        indices = tuple(indices_or_sections)  # type: ignore[arg-type]
        check_ints("indices", indices)
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
        if is_int(indices_or_sections):
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
        check_ints("size", shape)
        check_ints("stride", strides)
        offset = self.offset if storage_offset is None else storage_offset
        if len(shape) != len(strides):
            raise RuntimeError("mismatch in length of strides and shape")
        if any(s < 0 for s in strides):
            raise RuntimeError(
                "as_strided: Negative strides are not supported at the moment, got strides: "
                f"{format_ints(strides)}"
            )
        if offset < 0:
            raise RuntimeError(f"Tensor: invalid storage offset {offset}")
        needed = tuple_storage_nbytes(shape, strides, itemsize, 0)
        if needed != 0:
            needed_with_offset = tuple_storage_nbytes(shape, strides, itemsize, offset)
            have = storage_elements * itemsize
            if needed_with_offset > have:
                raise RuntimeError(
                    f"setStorage: sizes {format_ints(shape)}, strides {format_ints(strides)}, storage offset "
                    f"{offset}, and itemsize {itemsize} requiring a storage size of "
                    f"{needed_with_offset} are out of bounds for storage of size {have}"
                )
        check_numel(shape)
        return Layout(shape, strides, offset)


def empty_strided_layout(shape: Sequence[int], stride: Sequence[int]) -> Layout:
    """The layout torch.empty_strided(shape, stride) gives its new tensor (offset 0).

    mirrors at::empty_strided: computeStorageNbytes first (any negative stride of a
    tensor with elements wraps its uint64 sum: "Storage size calculation overflowed"),
    then TensorImpl::set_sizes_and_strides, which replaces a negative stride (left only
    on a tensor without elements) by the stride a contiguous tensor would have there.
    """
    shape, stride = tuple(shape), tuple(stride)
    check_ints("size", shape)
    check_ints("stride", stride)
    tuple_storage_nbytes(shape, stride, 1, 0)
    fixed = list(stride)
    for dim in range(len(shape) - 1, -1, -1):
        if fixed[dim] < 0:
            fixed[dim] = 1 if dim == len(shape) - 1 else max(shape[dim + 1], 1) * fixed[dim + 1]
    return Layout(shape, tuple(fixed), 0)
