"""Python data -> (a C-contiguous NumPy array, its tensord dtype), as ``torch.tensor`` infers it.

NumPy arrays keep their dtype (as ``torch.tensor(ndarray)`` does); Python
scalars and nested lists follow torch's defaults: bool -> bool, int -> int64,
float -> float32, complex -> complex64, the widest category winning.  torch
tensors are read through NumPy only when torch is already imported.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from tensord import dtypes
from tensord.dtypes import DType

# NumPy's kind letter -> torch's default dtype for Python values of that kind.
_DEFAULT_BY_KIND: dict[str, DType] = {
    "b": dtypes.bool,
    "i": dtypes.int64,
    "u": dtypes.int64,
    "f": dtypes.float32,
    "c": dtypes.complex64,
}


def _is_torch_tensor(data: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(data, torch.Tensor)


def _from_torch(data: Any) -> tuple[np.ndarray, DType]:
    import torch

    source = data.detach().cpu().resolve_conj().resolve_neg()
    dtype = dtypes.from_torch(source.dtype)
    if source.dtype == torch.bfloat16:  # NumPy has no bfloat16: go through its bits
        array = source.view(torch.int16).numpy().view(dtypes.to_numpy_dtype(dtype))
    else:
        array = source.numpy()
    return array, dtype


def _from_python(data: Any) -> tuple[np.ndarray, DType]:
    array = np.array(data)
    if array.dtype == object:
        raise TypeError(
            f"tensord cannot make a tensor from {type(data).__name__} data of mixed or "
            "unsupported element types"
        )
    if array.size == 0:
        return array.astype(np.float32), dtypes.float32  # torch.tensor([]) is float32
    default = _DEFAULT_BY_KIND.get(array.dtype.kind)
    if default is None:
        raise TypeError(f"tensord cannot make a tensor from elements of type {array.dtype}")
    return array, default


def as_array(data: Any, dtype: DType | None = None) -> tuple[np.ndarray, DType]:
    """``data`` as a C-contiguous array in the dtype torch.tensor would give it."""
    if _is_torch_tensor(data):
        array, inferred = _from_torch(data)
    elif isinstance(data, np.ndarray):
        array, inferred = data, dtypes.dtype_from_numpy(data.dtype)
    elif isinstance(data, np.generic):
        array, inferred = np.asarray(data), dtypes.dtype_from_numpy(data.dtype)
    else:
        array, inferred = _from_python(data)
    target = dtype or inferred
    array = np.asarray(array, dtype=dtypes.to_numpy_dtype(target), order="C")
    return array, target


def as_scalar(value: Any) -> bool | int | float | complex:
    """A Python number from a Python, NumPy or one-element torch scalar."""
    if isinstance(value, (bool, int, float, complex)):
        return value
    if isinstance(value, np.generic) or _is_torch_tensor(value):
        return value.item()  # type: ignore[no-any-return]
    raise TypeError(f"expected a number, got {type(value).__name__}")
