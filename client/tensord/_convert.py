"""Python data -> (a C-contiguous NumPy array, its tensord dtype), as ``torch.tensor`` infers it.

NumPy arrays keep their dtype (as ``torch.tensor(ndarray)`` does); Python
scalars and nested lists follow torch's defaults: bool -> bool, int -> int64,
float -> float32, complex -> complex64, the widest category winning.  torch
tensors are read through NumPy only when torch is already imported.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np

from tensord import dtypes, errors
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


# The int64 range: torch.tensor unpacks a Python int into a C long long first.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Below this magnitude a float64 holds every Python int exactly: a float array that
# NumPy made from ints and floats converts to an integer dtype as torch converts each item.
_EXACT_INT_IN_DOUBLE = 2.0**53


def _is_integral(dtype: DType) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype is dtypes.bool)


def _overflow(dtype: DType) -> RuntimeError:
    return RuntimeError(f"value cannot be converted to type {dtype.name} without overflow")


def _int_range(dtype: DType) -> tuple[int, int]:
    """c10::checked_convert's range for an integer going into ``dtype``: an unsigned type
    also takes the negatives down to -max, which wrap (-1 -> 255, as in C++)."""
    info = np.iinfo(dtypes.to_numpy_dtype(dtype))
    return (-int(info.max) if not dtype.is_signed else int(info.min)), int(info.max)


def _float_to_int(value: float, dtype: DType) -> int:
    """c10::checked_convert<int>(double): NaN and values outside [lowest, max] (compared as
    doubles, untruncated) overflow; the rest truncate toward zero."""
    info = np.iinfo(dtypes.to_numpy_dtype(dtype))
    if not float(info.min) <= value <= float(info.max):  # NaN fails too
        raise _overflow(dtype)
    result = math.trunc(value)
    # int64's max is 2**63 as a double: 2.0**63 passes the check, and x86 converts it to
    # the "integer indefinite" value, int64's min
    return int(info.min) if result > int(info.max) else result


def _wrap(value: int, dtype: DType) -> int:
    """``value`` as a C++ integer of ``dtype`` (two's complement)."""
    bits = 8 * dtype.itemsize
    value &= (1 << bits) - 1
    return value - (1 << bits) if dtype.is_signed and value >> (bits - 1) else value


def _uint64_item(item: Any) -> int:
    """torch.tensor's uint64 element: THPUtils_unpackUInt64 (PyLong_AsUnsignedLongLong)."""
    if not isinstance(item, int):
        raise TypeError("an integer is required")
    if item < 0:
        raise OverflowError("can't convert negative int to unsigned")
    if item >= 1 << 64:
        raise OverflowError("int too big to convert")
    return int(item)


def _python_item(item: Any, dtype: DType) -> bool | int | float | complex:
    """One Python number as torch.tensor stores it into ``dtype``, or torch's error for it
    (torch/csrc/utils/python_arg_parsing: unpack the Python object, then checked_convert)."""
    if dtype is dtypes.bool:
        return bool(item)  # PyObject_IsTrue: nan, 1j and 2**70 are True
    if dtype is dtypes.uint64:  # unpacked as an unsigned long long: ints only, no wrap
        return _uint64_item(item)
    if _is_integral(dtype):
        if isinstance(item, complex):
            raise TypeError("'complex' object cannot be interpreted as an integer")
        if isinstance(item, float):
            return _float_to_int(item, dtype)
        if not INT64_MIN <= item <= INT64_MAX:
            raise ValueError("Overflow when unpacking long long")
        low, high = _int_range(dtype)
        if not low <= item <= high:
            raise _overflow(dtype)
        return _wrap(int(item), dtype)
    if isinstance(item, complex):
        if not dtype.is_complex:
            raise TypeError("must be real number, not complex")
        return item
    return float(item)  # an int past float64's range: OverflowError, as torch's


def _cast(array: np.ndarray, dtype: DType) -> np.ndarray | None:
    """``array`` (NumPy's reading of Python numbers) cast as torch.tensor converts its
    items into ``dtype``; None where that needs each item (an error, or exactness)."""
    kind = array.dtype.kind
    target = dtypes.to_numpy_dtype(dtype)
    if dtype is dtypes.bool:
        return np.asarray(array != 0)
    if kind == "b":
        return array.astype(target)
    if dtype is dtypes.uint64:
        return None  # its items unpack one by one (no negatives, no floats)
    if not _is_integral(dtype):
        if kind == "c" and not dtype.is_complex:
            return None  # TypeError at the first complex item: only the items know which
        if kind not in "bifc":
            return None
        with np.errstate(over="ignore"):  # torch.tensor([1e300]) is inf, quietly
            wide = array.astype(np.complex128 if kind == "c" else np.float64)
            if dtype.itemsize == 2:  # c10::Half and BFloat16 are made from a float, not a double
                wide = wide.astype(np.float32)
            out = np.asarray(wide.astype(target))
            if dtype is dtypes.bfloat16:  # c10's round_to_nearest_even: every NaN is 0x7FC0
                out.view(np.uint16)[np.isnan(wide)] = 0x7FC0
            return out
    if kind == "i":
        low, high = _int_range(dtype)
        if array.size and (int(array.min()) < low or int(array.max()) > high):
            return None
        return array.astype(target)  # C++'s wrap of negatives into an unsigned type
    if kind == "f":
        info = np.iinfo(target)
        bound = min(_EXACT_INT_IN_DOUBLE, float(info.max))
        with np.errstate(invalid="ignore"):
            fits = (array >= float(info.min)) & (array <= bound) & (array > -_EXACT_INT_IN_DOUBLE)
        if not fits.all():
            return None
        return np.asarray(np.trunc(array).astype(target))
    return None  # ints past int64 ("u"), complex items into an integer dtype


def _each_item(data: Any, shape: tuple[int, ...], dtype: DType) -> np.ndarray:
    """torch.tensor's conversion one item at a time, in order: the first bad item raises."""
    items = [_python_item(item, dtype) for item in _items(data)]
    if _is_integral(dtype) or dtype is dtypes.bool:
        return np.array(items, dtype=dtypes.to_numpy_dtype(dtype)).reshape(shape)
    holder = np.complex128 if dtype.is_complex else np.float64
    array = _cast(np.array(items, dtype=holder).reshape(shape), dtype)
    assert array is not None
    return array


def _items(data: Any) -> Iterator[Any]:
    """The numbers in nested lists and tuples (or a lone number), in C order."""
    if isinstance(data, (list, tuple)):
        for item in data:
            yield from _items(item)
    else:
        yield data.item() if isinstance(data, np.generic) else data


def _category(item: Any) -> DType:
    """torch's default dtype for one Python number."""
    for python_type, kind in ((bool, "b"), (int, "i"), (float, "f"), (complex, "c")):
        if isinstance(item, python_type):
            return _DEFAULT_BY_KIND[kind]
    if isinstance(item, str):
        raise TypeError(
            f"tensord cannot make a tensor from {type(item).__name__} data of mixed or "
            "unsupported element types"
        )
    # torch.tensor(None), torch.tensor([1, None]): its RuntimeError and text
    raise errors.TensordRuntimeError(f"Could not infer dtype of {type(item).__name__}")


_CATEGORY_ORDER = (dtypes.bool, dtypes.int64, dtypes.float32, dtypes.complex64)


def _past_int64(array: np.ndarray) -> bool:
    with np.errstate(invalid="ignore"):
        return bool((np.abs(array) >= 2.0**63).any())


def _infer(data: Any, array: np.ndarray) -> DType:
    """torch.tensor's dtype for Python data: the widest category of its numbers."""
    # object: ints past 64 bits, or something that is no number; a float array with
    # values past int64 may be NumPy's reading of ints alone ([1, 2**63] is float64)
    walk = array.dtype == object or (array.dtype.kind == "f" and _past_int64(array))
    if walk:
        return max((_category(item) for item in _items(data)), key=_CATEGORY_ORDER.index)
    default = _DEFAULT_BY_KIND.get(array.dtype.kind)
    if default is None:
        raise TypeError(f"tensord cannot make a tensor from elements of type {array.dtype}")
    return default


def _from_python(data: Any, dtype: DType | None) -> tuple[np.ndarray, DType]:
    array = np.array(data)  # the shape (and NumPy's ragged-list error), and a fast path
    if array.size == 0:
        target = dtype or dtypes.float32  # torch.tensor([]) is float32
        return array.astype(dtypes.to_numpy_dtype(target)), target
    inferred = _infer(data, array)  # also refuses what is no number
    target = dtype or inferred
    converted = None if array.dtype == object else _cast(array, target)
    if converted is None:
        converted = _each_item(data, array.shape, target)
    return converted, target


def as_array(data: Any, dtype: DType | None = None) -> tuple[np.ndarray, DType]:
    """``data`` as a C-contiguous array in the dtype torch.tensor would give it.

    Python numbers convert as torch.tensor converts them: an int past int64 or past
    the target integer type, a NaN or out-of-range float into an integer type, and a
    complex into a real one raise torch's errors rather than wrap."""
    if _is_torch_tensor(data):
        array, inferred = _from_torch(data)
    elif isinstance(data, np.ndarray):
        array, inferred = data, dtypes.dtype_from_numpy(data.dtype)
    elif isinstance(data, np.generic):
        array, inferred = np.asarray(data), dtypes.dtype_from_numpy(data.dtype)
    else:
        array, inferred = _from_python(data, dtype)
    target = dtype or inferred
    if array.dtype == np.float64 and target.itemsize == 2 and target.is_floating_point:
        # c10::Half and BFloat16 are made from a float: a double is rounded to float32 first
        with np.errstate(over="ignore"):  # torch's overflow is inf, quietly
            array = array.astype(np.float32).astype(dtypes.to_numpy_dtype(target))
    array = np.asarray(array, dtype=dtypes.to_numpy_dtype(target), order="C")
    return array, target


def exact_dtype(data: Any) -> DType | None:
    """The dtype to upload ``data`` in before it is copied into a tensor: float64 or
    complex128 for Python floats and complex numbers, whose values torch.tensor's
    default float32 would round before the copy casts them; None (inferred) otherwise."""
    if _is_torch_tensor(data) or isinstance(data, (np.ndarray, np.generic)):
        return None
    array = np.array(data)
    if array.size == 0:
        return None
    inferred = _infer(data, array)
    return {dtypes.float32: dtypes.float64, dtypes.complex64: dtypes.complex128}.get(inferred)


def as_scalar(value: Any) -> bool | int | float | complex:
    """A Python number from a Python, NumPy or one-element torch scalar, as torch's argument
    parser reads a Scalar argument (PythonArgs::scalar_slow): NumPy integers are ints, and
    the other NumPy scalars that are no Python number (np.bool_, np.float32, np.complex64)
    are read through ``__float__``: ``torch.full((2,), np.True_)`` is float32 ones, and an
    np.complex64 loses its imaginary part, with NumPy's ComplexWarning."""
    if isinstance(value, np.integer):
        return _numpy_int_scalar(value)
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, complex):  # np.complex128 too: a Python complex
        return complex(value)
    if isinstance(value, (float, np.generic)):  # np.float64 is a Python float
        return float(value)
    if _is_torch_tensor(value):
        return value.item()  # type: ignore[no-any-return]
    raise TypeError(f"expected a number, got {type(value).__name__}")


def _numpy_int_scalar(value: np.integer[Any]) -> int:
    """A NumPy integer as a Scalar: an int64, else PyLong_AsUnsignedLongLong's TypeError (it
    takes Python ints only, so a NumPy uint64 past int64 is refused, unlike the same int)."""
    result = int(value)
    if not INT64_MIN <= result <= INT64_MAX:
        raise TypeError("an integer is required")
    return result
