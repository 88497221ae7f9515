"""NumPy array helpers every device type shares: torch's host copy rules and the gather plan.

The lowest layer of array work: knows NumPy only, so the CUDA module builds on it
(host ends of cross-device copies, piece-wise copies) without importing anything above.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from tensord import dtypes

Index = tuple[int | slice, ...]


@contextlib.contextmanager
def quiet(xp: Any) -> Iterator[None]:
    """Casts of NaN/inf/out-of-range values are defined by torch's rules, not warnings."""
    errstate = getattr(xp, "errstate", None)
    if errstate is None:
        yield
        return
    with errstate(all="ignore"):
        yield


def complex_to_real(src: Any, dst_dtype: Any) -> Any:
    """torch's complex -> real cast: bool is "nonzero" (1j is True), any other type takes
    the real part (c10::static_cast_with_inter_type)."""
    return src != 0 if dst_dtype == np.bool_ else src.real


def assign_host(xp: Any, dst: Any, src: Any) -> None:
    """``dst[...] = src`` between arrays of the host module ``xp``, with torch's conversions
    (complex to real drops the imaginary part; NaN/inf/out-of-range casts do not warn)."""
    if xp.iscomplexobj(src) and not xp.iscomplexobj(dst):
        if dst.dtype == np.bool_:
            # "nonzero" computed straight into dst: src may name far more elements than its
            # Storage holds (overlapping strides), and a temporary of them is not bounded
            src = src.reshape(src.shape[max(0, src.ndim - dst.ndim) :])  # leading 1s off
            xp.not_equal(src, 0, out=dst)
            return
        src = complex_to_real(src, dst.dtype)
    with quiet(xp):
        if src.dtype == np.float64 and dst.dtype in _HALF_TYPES:
            _assign_through_float32(dst, src)
        else:
            dst[...] = src


# NumPy's float16 and bfloat16: torch makes them from a float, never straight from a double.
_HALF_TYPES = tuple(dtypes.to_numpy_dtype(d) for d in (dtypes.float16, dtypes.bfloat16))
# Elements converted at a time on the double -> float -> half path (its temporary).
HALF_CAST_CHUNK_ELEMENTS = 1 << 20


def _assign_through_float32(dst: Any, src: Any) -> None:
    """``dst[...] = src`` for float64 into float16/bfloat16 as torch casts: c10::Half and
    BFloat16 are made from a float, so a double is rounded to float32 first (rounding
    once, straight to half, differs in ties).  The float32 temporary is a chunk at a time."""
    if dst.size <= HALF_CAST_CHUNK_ELEMENTS or dst.ndim == 0:
        dst[...] = np.asarray(src, dtype=np.float32)
        return
    src = np.broadcast_to(src, dst.shape)
    inner = dst.size // dst.shape[0]
    if inner > HALF_CAST_CHUNK_ELEMENTS:
        for i in range(dst.shape[0]):
            _assign_through_float32(dst[i], src[i])
        return
    step = max(1, HALF_CAST_CHUNK_ELEMENTS // inner)
    for start in range(0, dst.shape[0], step):
        dst[start : start + step] = src[start : start + step].astype(np.float32)


def gather_plan(shape: Sequence[int], itemsize: int, chunk_bytes: int) -> Iterator[Index]:
    """Keys into an array of ``shape`` whose pieces, in order, hold its elements in logical
    (row-major) order, each piece at most ``chunk_bytes`` (at least one element).

    The smallest k with ``prod(shape[k:]) * itemsize <= chunk_bytes`` fixes the rows: the
    plan walks the outer indices of ``shape[:k-1]`` and takes dim k-1 ``m`` rows at a
    time, ``m = chunk_bytes // row_bytes``.  A piece is at least half a chunk except the
    last of each outer index, whose rows span more than a chunk: the pieces number
    O(nbytes / chunk_bytes + 1) whatever the strides, and a piece made contiguous is a
    temporary of at most one chunk (no gather of the whole tensor: an expanded view's
    logical size is unbounded by its Storage).
    """
    shape = tuple(shape)
    if 0 in shape:
        return
    k = 0
    while k < len(shape) and math.prod(shape[k:]) * itemsize > chunk_bytes:
        k += 1
    if k == 0:  # the whole array is one piece
        yield ()
        return
    rows = max(1, chunk_bytes // (math.prod(shape[k:]) * itemsize))
    for outer in itertools.product(*(range(n) for n in shape[: k - 1])):
        for low in range(0, shape[k - 1], rows):
            yield (*outer, slice(low, min(low + rows, shape[k - 1])))
