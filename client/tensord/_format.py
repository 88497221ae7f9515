"""``repr`` of a tensor, printed as torch prints it (mirrors ``torch/_tensor_str.py``).

Pure functions over NumPy arrays, with torch's default print options.  A large
tensor is summarised from its edges only (``edge_values`` below says which
elements), so printing a 1 GiB tensor downloads a few dozen numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from tensord import dtypes
from tensord.dtypes import DType

# torch's default PRINT_OPTS
PRECISION = 4
THRESHOLD = 1000
EDGEITEMS = 3
LINEWIDTH = 80

# dtypes torch does not print a suffix for (default float, default complex, int64, bool)
_DEFAULT_DTYPES = (dtypes.float32, dtypes.complex64, dtypes.int64, dtypes.bool)


def summarize(shape: Sequence[int]) -> bool:
    return math.prod(shape) > THRESHOLD


def edge_index(size: int) -> list[slice]:
    """The parts of a dimension torch shows when summarising: all, or head and tail."""
    if size > 2 * EDGEITEMS:
        return [slice(0, EDGEITEMS), slice(size - EDGEITEMS, size)]
    return [slice(0, size)]


class _Formatter:
    """Mirrors torch's ``_Formatter``: one width and notation for all elements."""

    def __init__(self, values: np.ndarray, floating: bool) -> None:
        self.floating = floating
        self.int_mode = True
        self.sci_mode = False
        self.max_width = 1
        flat = values.reshape(-1)
        if not floating:
            for value in flat.tolist():
                self.max_width = max(self.max_width, len(f"{value}"))
            return
        flat = flat.astype(np.float64)
        nonzero_finite = flat[np.isfinite(flat) & (flat != 0)]
        if nonzero_finite.size == 0:
            return
        magnitudes = np.abs(nonzero_finite)
        lo, hi = float(magnitudes.min()), float(magnitudes.max())
        self.int_mode = bool(np.all(nonzero_finite == np.ceil(nonzero_finite)))
        self.sci_mode = hi / lo > 1000.0 or hi > 1.0e8 or lo < 1.0e-4
        for value in nonzero_finite.tolist():
            if self.sci_mode:
                width = len(f"{value:.{PRECISION}e}")
            elif self.int_mode:
                width = len(f"{value:.0f}") + 1  # the trailing "."
            else:
                width = len(f"{value:.{PRECISION}f}")
            self.max_width = max(self.max_width, width)

    def format(self, value: Any) -> str:
        if self.floating:
            if self.sci_mode:
                text = f"{value:{self.max_width}.{PRECISION}e}"
            elif self.int_mode:
                text = f"{value:.0f}"
                if not (math.isinf(value) or math.isnan(value)):
                    text += "."
            else:
                text = f"{value:.{PRECISION}f}"
        else:
            text = f"{value}"
        return (self.max_width - len(text)) * " " + text


def _element(value: Any, real: _Formatter, imag: _Formatter | None) -> str:
    if imag is None:
        return real.format(value)
    real_text = real.format(value.real)
    imag_text = (imag.format(value.imag) + "j").lstrip()
    if imag_text[0] in "+-":
        return real_text + imag_text
    return real_text + "+" + imag_text


def _vector(
    values: np.ndarray,
    size: int,
    indent: int,
    summarized: bool,
    real: _Formatter,
    imag: _Formatter | None,
) -> str:
    element_length = real.max_width + 2 + (imag.max_width + 1 if imag is not None else 0)
    per_line = max(1, math.floor((LINEWIDTH - indent) / element_length))
    items = values.tolist()
    if summarized and size > 2 * EDGEITEMS:
        data = [_element(v, real, imag) for v in items[:EDGEITEMS]]
        data += [" ..."] + [_element(v, real, imag) for v in items[-EDGEITEMS:]]
    else:
        data = [_element(v, real, imag) for v in items]
    lines = [", ".join(data[i : i + per_line]) for i in range(0, len(data), per_line)]
    return "[" + (",\n" + " " * (indent + 1)).join(lines) + "]"


def _nested(
    values: np.ndarray,
    shape: Sequence[int],
    indent: int,
    summarized: bool,
    real: _Formatter,
    imag: _Formatter | None,
) -> str:
    # ``values`` holds every element, or (summarized) only each dim's head and tail.
    if len(shape) == 0:
        return _element(values.item(), real, imag)
    if len(shape) == 1:
        return _vector(values, shape[0], indent, summarized, real, imag)
    rest = shape[1:]
    if summarized and shape[0] > 2 * EDGEITEMS:
        head = [
            _nested(values[i], rest, indent + 1, summarized, real, imag) for i in range(EDGEITEMS)
        ]
        tail = [
            _nested(values[i], rest, indent + 1, summarized, real, imag)
            for i in range(EDGEITEMS, 2 * EDGEITEMS)
        ]
        parts = [*head, "...", *tail]
    else:
        parts = [
            _nested(values[i], rest, indent + 1, summarized, real, imag) for i in range(shape[0])
        ]
    return "[" + ("," + "\n" * (len(shape) - 1) + " " * (indent + 1)).join(parts) + "]"


def _plain_values(values: np.ndarray, dtype: DType) -> np.ndarray:
    # bfloat16/float16 print through float64 so tolist() gives Python floats.
    if dtype.is_floating_point:
        return values.astype(np.float64)
    return values


def tensor_str(values: np.ndarray, shape: Sequence[int], dtype: DType, indent: int) -> str:
    """Mirrors torch's ``_tensor_str``: ``values`` as :func:`edge_values` chose them."""
    if math.prod(shape) == 0:
        return "[]"
    summarized = summarize(shape)
    values = _plain_values(values, dtype)
    if dtype.is_complex:
        real = _Formatter(values.real, True)
        imag = _Formatter(values.imag, True)
        return _nested(values, shape, indent, summarized, real, imag)
    return _nested(
        values, shape, indent, summarized, _Formatter(values, dtype.is_floating_point), None
    )


def _add_suffixes(text: str, suffixes: list[str], indent: int) -> str:
    parts = [text]
    last_line_len = len(text) - text.rfind("\n") + 1
    for suffix in suffixes:
        if last_line_len + len(suffix) + 2 > LINEWIDTH:
            parts.append(",\n" + " " * indent + suffix)
            last_line_len = indent + len(suffix)
        else:
            parts.append(", " + suffix)
            last_line_len += len(suffix) + 2
    parts.append(")")
    return "".join(parts)


def tensor_repr(
    values: np.ndarray, shape: Sequence[int], dtype: DType, device: str, requires_grad: bool
) -> str:
    """Mirrors torch's ``_str_intern`` for a plain strided tensor."""
    prefix = "tensor("
    indent = len(prefix)
    suffixes: list[str] = []
    if device != "cpu":
        suffixes.append(f"device='{device}'")
    if math.prod(shape) == 0:
        if len(shape) != 1:
            suffixes.append(f"size={tuple(shape)}")
        if dtype != dtypes.float32:
            suffixes.append(f"dtype={dtype!r}")
        text = "[]"
    else:
        if dtype not in _DEFAULT_DTYPES:
            suffixes.append(f"dtype={dtype!r}")
        text = tensor_str(values, shape, dtype, indent)
    if requires_grad:
        suffixes.append("requires_grad=True")
    return _add_suffixes(prefix + text, suffixes, indent)


def edge_values(values: np.ndarray) -> np.ndarray:
    """The elements torch's summary shows of a full array: each long dim's head and tail."""
    for axis, size in enumerate(values.shape):
        parts = [values[(slice(None),) * axis + (s,)] for s in edge_index(size)]
        values = np.concatenate(parts, axis=axis) if len(parts) > 1 else values
    return values
