"""NumPy array helpers every device type shares: torch's host copy rule and the gather plan.

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
        src = complex_to_real(src, dst.dtype)
    with quiet(xp):
        dst[...] = src


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
