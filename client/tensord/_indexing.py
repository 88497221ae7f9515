"""Advanced indexing keys: which keys torch reads as advanced, and their items.

torch's python_variable_indexing.cpp decides, before any work, how it reads a key:
a tuple is a list of items; a tensor or an array is one index tensor; another
sequence is a tuple when it holds a tensor, a sequence, a slice, None or Ellipsis
(NumPy's old heuristic, kept with a deprecation warning), else one index tensor.
Lists and arrays become index tensors as ``indexing_tensor_from_data`` makes them:
bool and uint8 data stay masks, anything else becomes int64.
"""

from __future__ import annotations

import builtins
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

_TUPLE_WARNING = (
    "Using a non-tuple sequence for multidimensional indexing is deprecated and will be changed "
    "in pytorch 2.9; use x[tuple(seq)] instead of x[seq]. In pytorch 2.9 this will be "
    "interpreted as tensor index, x[torch.tensor(seq)], which will result either in an error "
    "or a different result"
)


def is_sequence(value: Any) -> bool:
    """A sequence or an array that torch's indexing reads as one (a str is not)."""
    return isinstance(value, Sequence | np.ndarray) and not isinstance(value, str | bytes)


def key_items(key: Any, is_tensor: Callable[[Any], bool]) -> tuple[Any, ...]:
    """The items of ``key`` as torch reads them (treatSequenceAsTuple)."""
    if isinstance(key, tuple):
        return key
    if is_tensor(key) or isinstance(key, np.ndarray) or not is_sequence(key):
        return (key,)
    if len(key) >= 32:
        return (key,)
    for item in key:
        if is_tensor(item) or is_sequence(item) or isinstance(item, slice) or item is None:
            warnings.warn(_TUPLE_WARNING, UserWarning, stacklevel=3)
            return tuple(key)
        if item is Ellipsis:
            warnings.warn(_TUPLE_WARNING, UserWarning, stacklevel=3)
            return tuple(key)
    return (key,)


def is_advanced(items: tuple[Any, ...], is_tensor: Callable[[Any], bool]) -> bool:
    """Whether any item is a tensor, a sequence or a Python bool (the rest is basic)."""
    return any(
        isinstance(item, builtins.bool) or is_tensor(item) or is_sequence(item) for item in items
    )


def index_data(data: Any) -> np.ndarray:
    """A list or array as torch's indexing_tensor_from_data makes it: masks stay bool/uint8,
    anything else becomes int64 (floats truncated, as torch's cast)."""
    array = np.asarray(data)
    if array.dtype == np.bool_ or array.dtype == np.uint8:
        return array
    return array.astype(np.int64)


def infer_size(a: Sequence[int], b: Sequence[int]) -> tuple[int, ...]:
    """Two shapes broadcast together.  mirrors ATen's infer_size (its text: a, then b)."""
    ndim = max(len(a), len(b))
    out = []
    for i in range(ndim):
        offset = ndim - 1 - i
        size_a = a[len(a) - 1 - offset] if len(a) - 1 - offset >= 0 else 1
        size_b = b[len(b) - 1 - offset] if len(b) - 1 - offset >= 0 else 1
        if size_a != size_b and size_a != 1 and size_b != 1:
            raise RuntimeError(
                f"The size of tensor a ({size_a}) must match the size of tensor b ({size_b}) "
                f"at non-singleton dimension {i}"
            )
        out.append(size_a if size_a != 1 else size_b)
    return tuple(out)
