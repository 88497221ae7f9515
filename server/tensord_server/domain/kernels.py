"""Copy kernels and the torch rules around them, written against an array module ``xp``.

Nothing here knows about sessions or gRPC.  The array functions take the
backend's array module (numpy for host memory) so a CuPy backend reuses them
unchanged; the rest are small pure functions over shapes, layouts and Python
scalars that mirror the torch checks they name, with torch's texts.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tensord import dtypes
from tensord.dtypes import DType
from tensord.layout import Layout, normalize_dim
from tensord.layout import copy_broadcast_check as copy_broadcast_check  # shared with the SDK
from tensord.layout import strip_leading_ones as strip_leading_ones

from tensord_server.devices import array_dispatch
from tensord_server.devices.host_copies import gather_plan, quiet

Scalar = bool | int | float | complex

# torch's text when a write would go through an expanded (stride-0) destination.
INTERNAL_OVERLAP_TEXT = (
    "unsupported operation: more than one element of the written-to tensor refers to a single "
    "memory location. Please clone() the tensor before performing the operation."
)
PARTIAL_OVERLAP_TEXT = (
    "unsupported operation: some elements of the input tensor and the written-to tensor refer "
    "to a single memory location. Please clone() the tensor before performing the operation."
)

# c10's C++ type names, as torch prints them in "value cannot be converted" errors.
_CXX_TYPE_NAMES = {
    "bool": "bool",
    "uint8": "uint8_t",
    "int8": "int8_t",
    "int16": "int16_t",
    "int32": "int",
    "int64": "int64_t",
    "float16": "c10::Half",
    "bfloat16": "c10::BFloat16",
    "float32": "float",
    "float64": "double",
    "complex64": "c10::complex<float>",
    "complex128": "c10::complex<double>",
    "uint16": "uint16_t",
    "uint32": "uint32_t",
    "uint64": "uint64_t",
}


def check_kernel(op: str, dtype: DType) -> None:
    """torch 2.13 has no kernel of ``op`` for its barebones unsigned dtypes (uint16/32/64):
    its dispatch macro's NotImplementedError, word for word."""
    if dtype in dtypes.BAREBONES_UNSIGNED:
        raise NotImplementedError(f"\"{op}\" not implemented for '{dtype.scalar_type}'")


def check_arange_kernel(op: str, dtype: DType) -> None:
    """torch's arange kernels take the real dtypes only: bool and the complex dtypes raise
    its dispatch macro's NotImplementedError too, before any bound is looked at."""
    if dtype is dtypes.bool or dtype.is_complex:
        raise NotImplementedError(f"\"{op}\" not implemented for '{dtype.scalar_type}'")
    check_kernel(op, dtype)


# ---------------------------------------------------------------------------
# arrays over Storage bytes


def _gpu_bfloat16(xp: Any, dtype: DType) -> bool:
    """CuPy has no bfloat16: such tensors are uint16 bits in a BFloat16Array (cuda_backend)."""
    return dtype is dtypes.bfloat16 and xp is not np


def strided_array(xp: Any, raw: Any, layout: Layout, dtype: DType) -> Any:
    """A zero-copy array of ``dtype`` over the uint8 bytes ``raw`` of a Storage, as ``layout`` sees them."""
    bf16 = _gpu_bfloat16(xp, dtype)
    np_dtype = np.dtype(np.uint16) if bf16 else dtype.numpy_dtype
    if layout.numel == 0:
        array = xp.empty(layout.shape, dtype=np_dtype)
    else:
        itemsize = dtype.itemsize
        start = layout.offset * itemsize
        stop = layout.storage_extent() * itemsize
        base = raw[start:stop].view(np_dtype)
        strides = tuple(s * itemsize for s in layout.stride)
        if xp is np and type(base) is np.ndarray:
            # as_strided's result, without its per-call __array_interface__ detour: NumPy
            # checks that shape and strides stay inside base's bytes
            array = np.ndarray(layout.shape, np_dtype, base, 0, strides)
        else:
            array = xp.lib.stride_tricks.as_strided(base, shape=layout.shape, strides=strides)
    return array_dispatch.CUDA.bfloat16_array(array) if bf16 else array


def assign(xp: Any, dst: Any, src: Any) -> None:
    """``dst[...] = src`` with torch's conversions (complex to real drops the imaginary part).

    The array ops of the device the arrays are on do it: either side on a GPU (cpu<->cuda,
    cuda:i<->cuda:j, bfloat16 on CuPy) means pinned staging or peer copies, then a CuPy kernel.
    """
    array_dispatch.for_arrays(dst, src).assign(xp, dst, src)


def to_module(xp: Any, array: Any) -> Any:
    """``array`` ready to be assigned into an array of module ``xp``.

    A source on another device is returned as it is: only :func:`assign` knows
    the destination, and moves the bytes straight into it (one DMA from or into
    a pinned cpu pool; pinned staging or a peer copy otherwise) rather than
    through a temporary on the way.  Anything else becomes an ``xp`` array.
    """
    if array_dispatch.on_gpu(array) or (xp is not np and isinstance(array, np.ndarray)):
        return array
    return xp.asarray(array)


def to_host(array: Any) -> Any:
    """``array``'s values as a NumPy array (an index tensor read on the host to plan a gather;
    its size is bounded by the op limit before)."""
    if not array_dispatch.on_gpu(array):
        return np.asarray(array)
    data = array_dispatch.CUDA.to_bytes(array)
    return np.frombuffer(data, dtype=np.dtype(array.dtype)).reshape(array.shape)


def logical_chunks(
    array: Any,
    itemsize: int,
    chunk_bytes: int,
    context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    transform: Callable[[Any], Any] | None = None,
) -> Iterator[bytes]:
    """``array``'s elements in logical order as messages of exactly ``chunk_bytes`` (the last
    one shorter), gathered a piece at a time (:func:`gather_plan`): for downloads.  The
    memory it holds at any time is a few chunks, whatever the array's logical size.
    ``context`` is entered around each piece's gather only (never across a yield: the
    consumer may stop, or close the generator from another thread, between chunks).
    ``transform`` maps each piece first (a tensor's lazy bits)."""
    pending = bytearray()
    for key in gather_plan(array.shape, itemsize, chunk_bytes):
        with context():
            piece = array[key]
            if transform is not None:
                piece = transform(piece)
            pending += array_dispatch.for_arrays(piece).to_bytes(piece)
        while len(pending) >= chunk_bytes:
            yield bytes(pending[:chunk_bytes])
            del pending[:chunk_bytes]
    if pending:
        yield bytes(pending)


# ---------------------------------------------------------------------------
# overlap rules — mirrors ATen MemoryOverlap.cpp


def has_internal_overlap(layout: Layout) -> bool:
    """mirrors at::has_internal_overlap: only "YES" counts (a size>1 dim of stride 0)."""
    if layout.is_non_overlapping_and_dense():
        return False
    return any(n > 1 and s == 0 for n, s in zip(layout.shape, layout.stride, strict=True))


def collapse_expanded(layout: Layout) -> Layout:
    """``layout`` with each expanded (stride-0) dim cut to one element: the same memory
    locations, each named once (a fill through it writes what a fill of ``layout`` writes)."""
    if 0 not in layout.stride:  # nothing expanded (most fills): the layout itself
        return layout
    shape = tuple(
        1 if s == 0 and n > 1 else n for n, s in zip(layout.shape, layout.stride, strict=True)
    )
    return Layout(shape, layout.stride, layout.offset)


def assert_no_internal_overlap(layout: Layout) -> None:
    if has_internal_overlap(layout):
        raise RuntimeError(INTERNAL_OVERLAP_TEXT)


def _byte_span(layout: Layout, itemsize: int) -> tuple[int, int]:
    start = layout.offset * itemsize
    return start, start + layout.numel * itemsize


def assert_no_partial_overlap(
    same_storage: bool, a: Layout, a_itemsize: int, b: Layout, b_itemsize: int
) -> None:
    """mirrors at::assert_no_partial_overlap / get_overlap_status for two tensors.

    Exactly the same memory (FULL) is fine; overlap torch cannot judge (either
    tensor not dense) is left to the kernel, which copies through a temporary.
    """
    if not same_storage or a.numel == 0 or b.numel == 0:
        return
    if not (a.is_non_overlapping_and_dense() and b.is_non_overlapping_and_dense()):
        return
    a_begin, a_end = _byte_span(a, a_itemsize)
    b_begin, b_end = _byte_span(b, b_itemsize)
    if a_begin == b_begin and a_end == b_end:
        if a.stride == b.stride:
            return  # FULL overlap: the same elements
        raise RuntimeError(PARTIAL_OVERLAP_TEXT)
    if a_begin < b_end and b_begin < a_end:
        raise RuntimeError(PARTIAL_OVERLAP_TEXT)


# ---------------------------------------------------------------------------
# shapes of copies


def _fmt(values: Sequence[int]) -> str:
    return "[" + ", ".join(str(v) for v in values) + "]"


def repeat_shape(shape: tuple[int, ...], repeats: Sequence[int]) -> tuple[int, ...]:
    """mirrors ATen repeat's checks and output size."""
    if len(repeats) < len(shape):
        raise RuntimeError(
            "Number of dimensions of repeat dims can not be smaller than number of dimensions of "
            "tensor"
        )
    padded = (1,) * (len(repeats) - len(shape)) + tuple(shape)
    result = tuple(n * r for n, r in zip(padded, repeats, strict=True))
    for n in result:
        if n < 0:
            raise RuntimeError(
                f"Trying to create tensor with negative dimension {n}: {_fmt(result)}"
            )
    return result


def cat_shape(
    shapes: Sequence[tuple[int, ...]], dim: int
) -> tuple[tuple[int, ...], int, list[int]]:
    """mirrors ATen cat's checks: (output shape, wrapped dim, indices of the inputs that count).

    Legacy 1-D empty tensors (shape ``(0,)``) are skipped, as torch skips them.
    """
    if not shapes:
        raise ValueError("torch.cat(): expected a non-empty list of Tensors")
    for i, shape in enumerate(shapes):
        if len(shape) == 0:
            raise RuntimeError(f"zero-dimensional tensor (at position {i}) cannot be concatenated")
    kept = [i for i, s in enumerate(shapes) if s != (0,)]
    if not kept:
        return shapes[0], normalize_dim(dim, 1), []
    ref = shapes[kept[0]]
    dim = normalize_dim(dim, len(ref))
    total = 0
    for i in kept:
        shape = shapes[i]
        if len(shape) != len(ref):
            raise RuntimeError(
                f"Tensors must have same number of dimensions: got {len(ref)} and {len(shape)}"
            )
        for d in range(len(ref)):
            if d != dim and shape[d] != ref[d]:
                raise RuntimeError(
                    f"Sizes of tensors must match except in dimension {dim}. Expected size "
                    f"{ref[d]} but got size {shape[d]} for tensor number {i} in the list."
                )
        total += shape[dim]
    return (*ref[:dim], total, *ref[dim + 1 :]), dim, kept


def stack_dim(shapes: Sequence[tuple[int, ...]], dim: int) -> int:
    """mirrors ATen stack's checks: the wrapped dim of the new axis."""
    if not shapes:
        raise RuntimeError("stack expects a non-empty TensorList")
    dim = normalize_dim(dim, len(shapes[0]) + 1)
    for i, shape in enumerate(shapes):
        if shape != shapes[0]:
            raise RuntimeError(
                f"stack expects each tensor to be equal size, but got {_fmt(shapes[0])} at entry "
                f"0 and {_fmt(shape)} at entry {i}"
            )
    return dim


def check_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """A factory's size argument: torch refuses negative dims."""
    shape = tuple(int(n) for n in shape)
    for n in shape:
        if n < 0:
            raise RuntimeError(
                f"Trying to create tensor with negative dimension {n}: {_fmt(shape)}"
            )
    return shape


# torch's texts: a factory's requires_grad=True (and the x.requires_grad setter, lowercase),
# and x.requires_grad_(), which names floating point dtypes only (complex ones may, though)
REQUIRES_GRAD_TEXT = "Only Tensors of floating point and complex dtype can require gradients"
REQUIRES_GRAD_INPLACE_TEXT = "only Tensors of floating point dtype can require gradients"


def check_requires_grad(dtype: DType, requires_grad: bool, text: str = REQUIRES_GRAD_TEXT) -> None:
    if requires_grad and not (dtype.is_floating_point or dtype.is_complex):
        raise RuntimeError(text)


# ---------------------------------------------------------------------------
# scalars


def scalar_dtype(value: Scalar) -> DType:
    """torch.full's inferred dtype: bool, int64, the default float or complex dtype."""
    if isinstance(value, bool):
        return dtypes.bool
    if isinstance(value, int):
        return dtypes.int64
    if isinstance(value, float):
        return dtypes.float32
    return dtypes.complex64


def _overflow(dtype: DType) -> RuntimeError:
    name = _CXX_TYPE_NAMES.get(dtype.name, dtype.name)
    return RuntimeError(f"value cannot be converted to type {name} without overflow")


def check_scalar_fits(value: Scalar, dtype: DType) -> None:
    """mirrors c10::checked_convert: refuse a value the dtype cannot hold (bool takes anything)."""
    if dtype is dtypes.bool or isinstance(value, bool):
        return
    if isinstance(value, complex):
        if not dtype.is_complex and value.imag != 0:
            raise _overflow(dtype)
        value = value.real if not dtype.is_complex else value
    if dtype.is_complex:
        parts = (value.real, value.imag) if isinstance(value, complex) else (value,)
        # a Python float beside a NumPy float32 is cast to float32 (NEP 50), which warns on
        # overflow: compare Python floats only
        largest = float(np.finfo(np.float32 if dtype is dtypes.complex64 else np.float64).max)
        if any(math.isfinite(p) and abs(p) > largest for p in parts):
            raise _overflow(dtype)
        return
    assert isinstance(value, (int, float))
    if dtype.is_floating_point:
        if isinstance(value, float) and not math.isfinite(value):
            return
        limit = float(ml_max(dtype))
        if abs(float(value)) > limit:
            raise _overflow(dtype)
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise _overflow(dtype)
    low, high = _int_range(dtype.name)
    if isinstance(value, int) and not dtype.is_signed:
        low = -high  # c10 lets an integer wrap into an unsigned type (-1 -> 255)
    if not low <= value <= high:  # a float compares untruncated: 127.9 overflows int8
        raise _overflow(dtype)


@functools.cache  # every fill of an integer tensor asks (a few dtypes): iinfo per call cost
def _int_range(name: str) -> tuple[int, int]:
    info = np.iinfo(dtypes.dtype_from_name(name).numpy_dtype)
    return int(info.min), int(info.max)


def ml_max(dtype: DType) -> float:
    """The largest finite value of a floating dtype (bfloat16 included)."""
    return _ml_max(dtype.name)


@functools.cache  # every fill of a float tensor asks (a few dtypes): finfo per call cost
def _ml_max(name: str) -> float:
    import ml_dtypes

    numpy_dtype = dtypes.dtype_from_name(name).numpy_dtype
    return float(ml_dtypes.finfo(numpy_dtype).max)  # type: ignore[no-untyped-call]


def fill(xp: Any, dst: Any, value: Scalar) -> None:
    """``dst.fill_(value)`` (after check_scalar_fits); expanded destinations are fine, as in torch."""
    if isinstance(value, complex) and not xp.iscomplexobj(dst):
        value = value != 0 if dst.dtype == np.bool_ else value.real  # as complex_to_real
    if isinstance(value, float) and np.issubdtype(dst.dtype, np.integer):
        value = math.trunc(value)  # C++ truncation toward zero
    if isinstance(value, int) and value < 0 and np.issubdtype(dst.dtype, np.unsignedinteger):
        value += 1 << (8 * dst.dtype.itemsize)  # C++ wraps small negatives (-1 -> 255)
    with quiet(xp):
        dst[...] = value


# ---------------------------------------------------------------------------
# arange — mirrors ATen RangeFactories.cpp


def arange_dtype(start: Scalar, end: Scalar, step: Scalar) -> DType:
    """torch.arange's inferred dtype: the default float if any bound is a float, else int64."""
    if any(isinstance(v, complex) for v in (start, end, step)):
        raise RuntimeError("value cannot be converted to type double without overflow")
    if any(isinstance(v, float) for v in (start, end, step)):
        return dtypes.float32
    return dtypes.int64


def _cfmt(value: float | int) -> str:
    """A number as C++'s default ostream prints it ("0", "inf", "0.5")."""
    return f"{value:g}"


@dataclass(frozen=True, slots=True)
class ArangePlan:
    """torch.arange's elements before any is computed: ``start + i * step`` for i < size,
    in int64 (``integral``) or in the accumulate type, then cast to the output dtype."""

    size: int
    start: int | float
    step: int | float
    integral: bool


# arange computes this many elements at a time: its temporaries stay small whatever the size
# (the output is a pool Storage, allocated first; a huge range must fail there, cleanly)
ARANGE_CHUNK = 1 << 16

# torch's CPU arange kernel (RangeFactoriesKernel.cpp, AVX2 build) writes whole pairs of
# vectors of these many elements, each vector from its first element ``base`` as
# ``base + k * step``; the last ``size % (2 * width)`` elements are ``start + i * step``.
# Both compile to fused multiply-adds.  (Bit for bit as torch up to its parallel grain,
# 32768 elements: past it, torch's own result depends on its thread count.)
_ARANGE_VECTOR_WIDTH = {"float64": 4, "float32": 8, "float16": 16, "bfloat16": 16}


def arange_plan(start: Scalar, end: Scalar, step: Scalar, dtype: DType) -> ArangePlan:
    """torch.arange's checks and size (as torch computes them), no element made yet."""
    start, end, step = _real(start), _real(end), _real(step)
    check_arange_kernel("arange_cpu", dtype)
    if not dtype.is_floating_point and any(
        isinstance(v, int) and not -(1 << 63) <= v < 1 << 63 for v in (start, end, step)
    ):
        # an unsigned Scalar (2**63..2**64-1) in an integer arange: torch's int64 conversion
        # refuses it (an int32/int8 arange of one wraps in torch; refused here too)
        raise RuntimeError("value cannot be converted to type int64_t without overflow")
    # arange_check_bounds: in double precision, whatever the dtype
    dstart, dend, dstep = float(start), float(end), float(step)
    if not (dstep > 0 or dstep < 0):
        raise RuntimeError("step must be nonzero")
    if not (math.isfinite(dstart) and math.isfinite(dend)):
        raise RuntimeError(f"unsupported range: {_cfmt(dstart)} -> {_cfmt(dend)}")
    if not ((dstep > 0 and dend >= dstart) or (dstep < 0 and dend <= dstart)):
        raise RuntimeError("upper bound and lower bound inconsistent with step sign")
    integral = not dtype.is_floating_point
    if dtype is dtypes.int64:  # int64 counts in int64, from bounds truncated toward zero
        xstart, xend, xstep = math.trunc(start), math.trunc(end), math.trunc(step)
        if xstep == 0:  # a fractional step, such as 0.5
            raise ValueError("step must be nonzero")
        sgn = (xstep > 0) - (xstep < 0)
        size_d = float(_trunc_div(xend - xstart + xstep - sgn, xstep))
    else:
        size_d = math.ceil((dend - dstart) / dstep)
    if not (0 <= size_d <= 2**63 - 1):
        raise RuntimeError("invalid size, possible overflow?")
    if integral:  # the other integer types count in int64 too: arange(0, 5, 0.5) is zeros
        return ArangePlan(int(size_d), math.trunc(start), math.trunc(step), True)
    return ArangePlan(int(size_d), dstart, dstep, False)


def arange_fill(xp: Any, out: Any, plan: ArangePlan, dtype: DType) -> None:
    """Write the plan's elements into ``out`` (1-D, ``plan.size`` long), a chunk at a time."""
    for low in range(0, plan.size, ARANGE_CHUNK):
        high = min(low + ARANGE_CHUNK, plan.size)
        if plan.integral:
            values = plan.start + xp.arange(low, high, dtype=xp.int64) * plan.step
        else:
            with quiet(xp):  # past a dtype's range the elements are inf, as torch's are
                values = _arange_floats(xp, plan, dtype, low, high)
        if _gpu_bfloat16(xp, dtype):
            values = values.astype(xp.float32)  # assign rounds to bfloat16 (as ml_dtypes)
        else:
            with quiet(xp):
                values = values.astype(dtype.numpy_dtype)
        assign(xp, out[low:high], values)


def _arange_floats(xp: Any, plan: ArangePlan, dtype: DType, low: int, high: int) -> Any:
    """Elements ``low:high`` of a floating arange, rounded as torch's CPU kernel rounds them
    (float64 values, exactly representable in ``dtype``)."""
    width = _ARANGE_VECTOR_WIDTH[dtype.name]
    # float16 and bfloat16 accumulate in float, the others in double
    acc = xp.float64 if dtype.itemsize >= 4 else xp.float32
    start, step = float(acc(plan.start)), float(acc(plan.step))
    index = xp.arange(low, high, dtype=xp.int64)
    lane = index % width
    vectorized_end = plan.size - plan.size % (2 * width)

    def rounded(values: Any) -> Any:  # to the output type, kept in float64
        with quiet(xp):
            return _to_dtype(xp, values, dtype).astype(xp.float64)

    def acc_float(values: Any) -> Any:  # an integer index as the accumulate type sees it
        return values.astype(acc).astype(xp.float64)

    scalar = _fma(xp, step, acc_float(index), start, acc)
    base = rounded(_fma(xp, step, acc_float(index - lane), start, acc))
    if dtype is dtypes.bfloat16:  # its vectors add a rounded ``k * step``: not fused
        vector = acc_float(acc_float(acc_float(lane) * step) + base)
    else:
        vector = _fma(xp, acc_float(lane), step, base, acc)
    vector = xp.where(lane == 0, base, vector)  # a vector's first lane is its base (-0.0 too)
    return rounded(xp.where(index < vectorized_end, vector, scalar))


def _to_dtype(xp: Any, values: Any, dtype: DType) -> Any:
    if _gpu_bfloat16(xp, dtype):  # CuPy has no bfloat16: round through its bits
        bits = array_dispatch.CUDA.float32_to_bfloat16_bits(values.astype(xp.float32))
        return (bits.astype(xp.uint32) << 16).view(xp.float32)
    return values.astype(dtype.numpy_dtype)


def _fma(xp: Any, a: Any, b: Any, c: Any, acc: Any) -> Any:
    """``a * b + c`` rounded once to ``acc`` (float64 or float32), as C's fma/fmaf, from
    float64 operands that are ``acc`` values: Boldo and Melquiond's emulation (the exact
    product and sum, their tail rounded to odd, then one rounding to nearest)."""
    product, product_error = _two_product(xp, a, b)
    head, tail = _two_sum(xp, c, product)
    rest, rest_error = _two_sum(xp, tail, product_error)
    rest = _round_to_odd(xp, rest, rest_error)
    exact = rest == 0  # head is the result, with the sign of a zero that C's fma gives
    if acc is xp.float64:
        return xp.where(exact, head, head + rest)
    # float operands: the product and sum are exact in double, the tail rounded to odd
    total, total_error = _two_sum(xp, head, rest)
    total = xp.where(exact, head, _round_to_odd(xp, total, total_error))
    return total.astype(xp.float32).astype(xp.float64)


def _two_sum(xp: Any, a: Any, b: Any) -> tuple[Any, Any]:
    """``a + b`` and its rounding error (Knuth): their sum is exactly ``a + b``."""
    total = a + b
    b_part = total - a
    return total, (a - (total - b_part)) + (b - b_part)


def _split(xp: Any, a: Any) -> tuple[Any, Any]:
    """Veltkamp's split of a double into two 26-bit halves."""
    scaled = 134217729.0 * a  # 2**27 + 1
    high = scaled - (scaled - a)
    return high, a - high


def _two_product(xp: Any, a: Any, b: Any) -> tuple[Any, Any]:
    """``a * b`` and its rounding error (Dekker): their sum is exactly ``a * b``."""
    product = a * b
    a_high, a_low = _split(xp, a)
    b_high, b_low = _split(xp, b)
    error = ((a_high * b_high - product) + a_high * b_low + a_low * b_high) + a_low * b_low
    return product, error


def _round_to_odd(xp: Any, value: Any, error: Any) -> Any:
    """``value`` (= round-to-nearest of ``value + error``) rounded to odd instead: an inexact
    result whose last bit is even moves one step toward the exact sum."""
    even = (value.view(xp.int64) & 1) == 0
    toward = xp.where(error > 0, math.inf, -math.inf)
    return xp.where((error != 0) & even, xp.nextafter(value, toward), value)


def arange_values(xp: Any, start: Scalar, end: Scalar, step: Scalar, dtype: DType) -> Any:
    """torch.arange's elements as a new ``xp`` array (the server fills pool memory instead)."""
    plan = arange_plan(start, end, step, dtype)
    out = xp.empty(plan.size, dtype=dtype.numpy_dtype)
    arange_fill(xp, out, plan, dtype)
    return out


def _real(value: Scalar) -> int | float:
    """A bound of arange: torch converts it to double, which a complex value cannot be."""
    if isinstance(value, complex):
        raise RuntimeError("value cannot be converted to type double without overflow")
    return value


def _trunc_div(a: int, b: int) -> int:
    """C++ integer division (truncation toward zero)."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b > 0) else -q


# ---------------------------------------------------------------------------
# complex views: torch's lazy conjugate and negative bits


def apply_lazy_bits(array: Any, conj: bool, neg: bool, written_as: np.dtype | None = None) -> Any:
    """``array`` conjugated and/or negated: a tensor's values from its stored ones, and (each
    an involution) the stored form of values written into it.

    Computed once per distinct memory location: a view that names locations more than once
    (an expanded dim, overlapping strides) has its values computed over the span of memory
    it reaches, then read with its own strides over that temporary.  The temporary is thus
    at most ``min(logical size, span)`` elements, bounded by the Storage, never by a view's
    logical size (an as_strided view of a 256 KiB Storage may name 64 GiB).

    ``written_as``: the dtype of the tensor ``array``'s values are written into.  A bool or
    integer source is converted to it before it is negated: NumPy's negative of a bool array
    raises, of a uint8 5 is 251 and of an int8 -128 is -128, where torch negates the value
    it wrote (a tensor with a bit is always floating or complex)."""
    conj = conj and np.dtype(array.dtype).kind == "c"  # a real value is its own conjugate
    if not (conj or neg):
        return array
    # the array's own module: a source on another device than the tensor it is written
    # into is left where it is (to_module, for one DMA), and computed there
    xp = array_dispatch.for_arrays(array).module()
    if neg and written_as is not None and np.dtype(array.dtype).kind in "biu":
        dtype = np.dtype(written_as)
    else:
        dtype = np.dtype(array.dtype)
    span = memory_span(xp, array)
    if span is None:  # each location named at most once: its elements are the fewer
        return _lazy_values(xp, array, dtype, conj, neg)
    flat, forward, flips = span
    values = _lazy_values(xp, flat, dtype, conj, neg)
    itemsize = np.dtype(array.dtype).itemsize
    strides = tuple(s // itemsize * values.itemsize for s in forward.strides)
    return xp.lib.stride_tricks.as_strided(values, shape=forward.shape, strides=strides)[flips]


def apply_lazy_bits_in_place(array: Any, conj: bool, neg: bool) -> None:
    """``array``'s stored values made its values, over themselves: for a new tensor's
    array, which names each location once (no temporary at all)."""
    conj = conj and np.dtype(array.dtype).kind == "c"
    xp = array_dispatch.for_arrays(array).module()
    with quiet(xp):
        if conj:
            xp.conj(array, out=array)
        if neg:
            xp.negative(array, out=array)


def memory_span(xp: Any, array: Any) -> tuple[Any, Any, tuple[slice, ...]] | None:
    """The memory ``array`` reaches, when it holds fewer elements than ``array`` names:
    ``(flat, forward, flips)``, ``flat`` a 1-D contiguous view from ``array``'s lowest
    address to its highest, ``forward`` ``array`` with each negative stride flipped (its
    first element at ``flat[0]``) and ``flips`` the key that flips it back.  None when the
    span holds as many elements as ``array`` or more (a dense, sparse or empty view), or
    when ``array`` has no strides in whole elements to read a span with."""
    strides = getattr(array, "strides", None)  # a GPU BFloat16Array has none
    itemsize = np.dtype(array.dtype).itemsize
    if strides is None or array.size == 0 or any(s % itemsize for s in strides):
        return None
    flips = tuple(slice(None, None, -1) if s < 0 else slice(None) for s in strides)
    forward = array[flips]
    extent = sum((n - 1) * s for n, s in zip(forward.shape, forward.strides, strict=True))
    elements = extent // itemsize + 1
    if elements >= array.size:
        return None
    flat = xp.lib.stride_tricks.as_strided(forward, shape=(elements,), strides=(itemsize,))
    return flat, forward, flips


def _lazy_values(xp: Any, values: Any, dtype: np.dtype, conj: bool, neg: bool) -> Any:
    """A new array of ``values`` as ``dtype``, conjugated and/or negated in place (one
    temporary the size of ``values``; a span's gaps are any bytes, quiet in the ops)."""
    result = xp.array(values, dtype=dtype)  # a copy (also of a 0-dim piece, a NumPy scalar)
    apply_lazy_bits_in_place(result, conj, neg)
    return result


def lazy_scalar(value: Scalar, conj: bool, neg: bool) -> Scalar:
    """A fill value's stored form in a tensor with lazy bits (after check_scalar_fits)."""
    if conj and isinstance(value, complex):
        value = value.conjugate()
    if neg:
        value = -value
    return value
