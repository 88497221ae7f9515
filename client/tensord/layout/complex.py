"""torch's complex views (``real``, ``imag``, ``view_as_real``, ``view_as_complex``,
``conj``) and its lazy conjugate and negative bits, over :class:`~tensord.layout.views.Layout`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tensord.layout.shapes import (
    normalize_dim,
)
from tensord.layout.views import (
    Layout,
)

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
