"""tensord's dtypes and torch's type-promotion rules.

A :class:`DType` is a plain immutable record; the module constants mirror
``torch.float32`` and friends (with torch's aliases), and
:func:`promote_types` / :func:`result_type` follow ``c10/core/ScalarType.cpp``
and ``ATen/native/TypeProperties.cpp`` exactly, so that code written for torch
gets the same result dtypes here.  torch itself is imported only by
:func:`from_torch` / :func:`to_torch`; :func:`public` gives what a tensor's ``dtype``
shows (torch's own once torch is imported) and :func:`canonical` reads either back.
"""

from __future__ import annotations

import builtins
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import ml_dtypes
import numpy as np

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class DType:
    """One element type.  Instances are singletons: compare with ``==`` or ``is``.

    Equal, both ways, to the ``torch.dtype`` of its name (``tensord.float32 ==
    torch.float32``), which is what a tensor's ``dtype`` gives once torch is imported.  Equal
    objects must hash alike, and torch's hashes by identity: a DType made while torch is
    imported (torch imported before tensord) takes its torch.dtype's hash, so either kind
    finds the other as a dict key.  One made before torch is imported hashes by its name
    (a hash never changes), apart from torch's."""

    name: str  # "float32": torch's canonical name without the "torch." prefix
    itemsize: builtins.int  # bytes per element
    is_floating_point: builtins.bool
    is_complex: builtins.bool
    is_signed: builtins.bool
    scalar_type: str  # c10's ScalarType name ("Float"), used in torch's error texts
    legacy_type: str  # what torch's Tensor::toString() prints on CPU, ditto (see tensor_type_name)
    numpy_dtype: np.dtype[Any] = field(compare=False, hash=False)
    hash_value: builtins.int = field(compare=False, hash=False, repr=False, default=0)

    def __post_init__(self) -> None:
        assert self.itemsize in (1, 2, 4, 8, 16), f"bad itemsize {self.itemsize} for {self.name}"
        assert self.numpy_dtype.itemsize == self.itemsize, (
            f"numpy itemsize mismatch for {self.name}"
        )
        assert not (self.is_floating_point and self.is_complex), self.name

    def __eq__(self, other: object) -> builtins.bool:
        # equal to itself and, both ways (torch.dtype's == defers to this one), to the
        # torch.dtype of its name
        if isinstance(other, DType):
            return self is other or self.name == other.name
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(other, torch.dtype):
            name = _TORCH_NAMES.get(other)
            if name is None:
                try:
                    name = from_torch(other).name
                except TypeError:  # a torch dtype tensord has not (float8_e4m3fn, ...)
                    return False
            return name == self.name
        return NotImplemented

    def __hash__(self) -> builtins.int:
        return self.hash_value

    def __repr__(self) -> str:
        return f"tensord.{self.name}"

    __str__ = __repr__

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        # Pickle by name so unpickling yields the module singleton.
        return (dtype_from_name, (self.name,))


def _make(
    name: str,
    itemsize: builtins.int,
    np_dtype: Any,
    scalar_type: str,
    legacy: str,
    *,
    floating: builtins.bool = False,
    complex_: builtins.bool = False,
    signed: builtins.bool = True,
) -> DType:
    return DType(
        name=name,
        itemsize=itemsize,
        is_floating_point=floating,
        is_complex=complex_,
        is_signed=signed,
        scalar_type=scalar_type,
        # only the pre-1.0 types have a legacy name; the rest print as "CPU<ScalarType>Type"
        legacy_type=f"torch.{legacy}Tensor" if legacy else f"CPU{scalar_type}Type",
        numpy_dtype=np.dtype(np_dtype),
        hash_value=_hash_for(name),
    )


def _hash_for(name: str) -> builtins.int:
    """The hash of the torch.dtype named ``name`` when torch is imported, else the name's."""
    torch = sys.modules.get("torch")
    torch_dtype = getattr(torch, name, None) if torch is not None else None
    if torch is not None and isinstance(torch_dtype, torch.dtype):
        return hash(torch_dtype)
    return hash(name)


bool = _make(
    "bool", 1, np.bool_, "Bool", "", signed=False
)  # shadows the builtin on purpose: torch's name
uint8 = _make("uint8", 1, np.uint8, "Byte", "Byte", signed=False)
int8 = _make("int8", 1, np.int8, "Char", "Char")
int16 = _make("int16", 2, np.int16, "Short", "Short")
int32 = _make("int32", 4, np.int32, "Int", "Int")
int64 = _make("int64", 8, np.int64, "Long", "Long")
float16 = _make("float16", 2, np.float16, "Half", "Half", floating=True)
bfloat16 = _make("bfloat16", 2, ml_dtypes.bfloat16, "BFloat16", "", floating=True)
float32 = _make("float32", 4, np.float32, "Float", "Float", floating=True)
float64 = _make("float64", 8, np.float64, "Double", "Double", floating=True)
complex64 = _make("complex64", 8, np.complex64, "ComplexFloat", "", complex_=True)
complex128 = _make("complex128", 16, np.complex128, "ComplexDouble", "", complex_=True)
# torch's "barebones" unsigned dtypes: storage, views, conversions and few ops
uint16 = _make("uint16", 2, np.uint16, "UInt16", "", signed=False)
uint32 = _make("uint32", 4, np.uint32, "UInt32", "", signed=False)
uint64 = _make("uint64", 8, np.uint64, "UInt64", "", signed=False)

# torch's aliases
float = float32
double = float64
half = float16
int = int32
long = int64
short = int16
cfloat = complex64
cdouble = complex128

#: every dtype, in c10's ScalarType order
ALL_DTYPES: tuple[DType, ...] = (
    uint8,
    int8,
    int16,
    int32,
    int64,
    float16,
    float32,
    float64,
    complex64,
    complex128,
    bool,
    bfloat16,
)

_ALIASES: dict[str, DType] = {
    "float": float32,
    "double": float64,
    "half": float16,
    "int": int32,
    "long": int64,
    "short": int16,
    "cfloat": complex64,
    "cdouble": complex128,
}
#: torch's barebones unsigned dtypes (c10's UInt16..UInt64), not in ALL_DTYPES: torch 2.13
#: has few kernels for them and no integer promotion (see README's table)
BAREBONES_UNSIGNED: tuple[DType, ...] = (uint16, uint32, uint64)

_BY_NAME: dict[str, DType] = {d.name: d for d in ALL_DTYPES + BAREBONES_UNSIGNED} | _ALIASES
_BY_NUMPY: dict[np.dtype[Any], DType] = {d.numpy_dtype: d for d in ALL_DTYPES + BAREBONES_UNSIGNED}

# Python scalars are "wrapped numbers" in torch: int -> int64, float -> the default
# dtype, complex -> the default complex dtype (torch's defaults).
_DEFAULT_FLOAT = float32
_DEFAULT_COMPLEX = complex64


def tensor_type_name(dtype: DType, device_type: str = "cpu") -> str:
    """What torch's Tensor::toString() prints for a tensor (as in expand's error text).

    ``torch.FloatTensor`` / ``torch.cuda.FloatTensor`` for the legacy types,
    ``CPUBoolType`` / ``CUDABoolType`` for the others.
    """
    if dtype.legacy_type.startswith("torch."):
        if device_type == "cpu":
            return dtype.legacy_type
        return dtype.legacy_type.replace("torch.", f"torch.{device_type}.", 1)
    return f"{device_type.upper()}{dtype.scalar_type}Type"


def dtype_from_name(name: str) -> DType:
    """``"float32"``, ``"torch.float32"`` or an alias such as ``"float"`` -> the DType."""
    if not isinstance(name, str):
        raise TypeError(f"dtype name must be a str, got {type(name).__name__}")
    key = name.removeprefix("torch.").removeprefix("tensord.")
    try:
        return _BY_NAME[key]
    except KeyError:
        known = ", ".join(sorted(_BY_NAME))
        raise TypeError(f"unknown dtype {name!r}; expected one of: {known}") from None


def dtype_from_numpy(dtype: Any) -> DType:
    """A NumPy dtype (or anything ``np.dtype()`` accepts) -> the DType."""
    np_dtype = np.dtype(dtype)
    try:
        return _BY_NUMPY[np_dtype]
    except KeyError:
        raise TypeError(f"tensord has no dtype for numpy dtype {np_dtype}") from None


def to_numpy_dtype(dtype: Any) -> np.dtype[Any]:
    """The NumPy dtype of a DType or a torch.dtype."""
    return canonical(dtype).numpy_dtype


# torch.dtype -> its name, DType -> torch.dtype: filled on first use (torch imported then)
_TORCH_NAMES: dict[Any, str] = {}
_TO_TORCH: dict[DType, Any] = {}


def from_torch(dtype: torch.dtype) -> DType:
    """``torch.float32`` -> ``tensord.float32``."""
    name = _TORCH_NAMES.get(dtype)
    if name is None:
        result = dtype_from_name(str(dtype))
        _TORCH_NAMES[dtype] = result.name
        return result
    return _BY_NAME[name]


def to_torch(dtype: DType) -> torch.dtype:
    """``tensord.dtypes.float32`` -> ``torch.float32`` (imports torch); a torch.dtype (what
    ``tensord.float32`` is once torch is imported) as it is."""
    known: torch.dtype | None = _TO_TORCH.get(dtype)
    if known is not None:
        return known
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype

    result = getattr(torch, dtype.name)
    assert isinstance(result, torch.dtype), dtype
    _TO_TORCH[dtype] = result
    _TORCH_NAMES[result] = dtype.name
    return result


def canonical(dtype: Any) -> DType:
    """A tensord tensor's ``dtype`` as a DType: tensors give torch's own once torch is
    imported (so that torch takes it), the SDK computes with tensord's."""
    if isinstance(dtype, DType):
        return dtype
    return from_torch(dtype)


def public(dtype: DType) -> Any:
    """What ``x.dtype`` gives for a tensor of ``dtype``: the torch.dtype of that name once
    torch is imported (torch's own arguments take only those), else the DType."""
    result = _TO_TORCH.get(dtype)
    if result is not None:
        return result
    if sys.modules.get("torch") is None:  # not imported (or blocked: None)
        return dtype
    return to_torch(dtype)


# ---------------------------------------------------------------------------
# promotion — mirrors c10::promoteTypes


def _is_integral(d: DType) -> builtins.bool:
    return not (d.is_floating_point or d.is_complex or d is bool)


def _to_complex(d: DType) -> DType:
    # mirrors c10::toComplexType (ComplexHalf is not a tensord dtype)
    if d is float64 or d is complex128:
        return complex128
    if d is float16:
        raise TypeError("tensord has no complex32 (ComplexHalf) dtype, which torch would use here")
    return complex64


def promote_types(a: DType, b: DType) -> DType:
    """torch.promote_types: the smallest dtype both ``a`` and ``b`` convert to safely (each a
    DType or a torch.dtype: ``tensord.float16`` is torch's once torch is imported)."""
    a, b = canonical(a), canonical(b)
    if a is b:
        return a
    if a in BAREBONES_UNSIGNED or b in BAREBONES_UNSIGNED:
        # c10: a barebones unsigned dtype promotes with a floating dtype only
        if a.is_floating_point or b.is_floating_point:
            return a if a.is_floating_point else b
        raise RuntimeError(
            "Promotion for uint16, uint32, uint64 types is not supported, attempted to "
            f"promote {a.scalar_type} and {b.scalar_type}"
        )
    if a is bool:
        return b
    if b is bool:
        return a
    if a.is_complex or b.is_complex:
        # a complex wins, widened to hold the other side's precision
        if a.is_complex and b.is_complex:
            return a if a.itemsize >= b.itemsize else b
        other = b if a.is_complex else a
        cplx = a if a.is_complex else b
        return complex128 if other is float64 or cplx is complex128 else complex64
    if a.is_floating_point and b.is_floating_point:
        if {a, b} == {float16, bfloat16}:
            return float32  # neither holds the other's range/precision
        return a if a.itemsize >= b.itemsize else b
    if a.is_floating_point:
        return a
    if b.is_floating_point:
        return b
    assert _is_integral(a) and _is_integral(b), (a, b)
    if a is uint8 or b is uint8:
        signed = b if a is uint8 else a
        return int16 if signed is int8 else signed
    return a if a.itemsize >= b.itemsize else b


class _HasDtype(Protocol):
    @property
    def dtype(self) -> DType: ...

    @property
    def ndim(self) -> builtins.int: ...


Operand = _HasDtype | builtins.bool | builtins.int | builtins.float | builtins.complex


def _scalar_dtype(value: builtins.bool | builtins.int | builtins.float | builtins.complex) -> DType:
    if isinstance(value, builtins.bool):
        return bool
    if isinstance(value, builtins.int):
        return int64
    if isinstance(value, builtins.float):
        return _DEFAULT_FLOAT
    return _DEFAULT_COMPLEX


def _promote_opt(a: DType | None, b: DType) -> DType:
    return b if a is None else promote_types(a, b)


def _combine_categories(higher: DType | None, lower: DType | None) -> DType | None:
    # mirrors at::native::combine_categories
    if higher is not None and higher.is_complex:
        return higher
    if lower is not None and lower.is_complex:
        if higher is not None and higher.is_floating_point:
            return _to_complex(higher)
        return lower
    if higher is not None and higher.is_floating_point:
        return higher
    if higher is bool or (lower is not None and lower.is_floating_point):
        if higher is None:
            return lower
        return higher if lower is None else promote_types(higher, lower)
    return higher if higher is not None else lower


def result_type(*operands: Operand | Sequence[Operand]) -> DType:
    """torch.result_type over tensors (anything with ``.dtype`` and ``.ndim``) and Python scalars.

    Dimensioned tensors outrank zero-dim tensors, which outrank Python scalars;
    a lower rank only raises the category (bool < integral < floating < complex).
    """
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    if not operands:
        raise TypeError("result_type() needs at least one operand")
    dim_result: DType | None = None
    zero_result: DType | None = None
    wrapped_result: DType | None = None
    for op in operands:
        if isinstance(op, (builtins.bool, builtins.int, builtins.float, builtins.complex)):
            wrapped_result = _promote_opt(wrapped_result, _scalar_dtype(op))
            continue
        dtype = getattr(op, "dtype", None)
        ndim = getattr(op, "ndim", None)
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(dtype, torch.dtype):
            dtype = from_torch(dtype)
        if not isinstance(dtype, DType) or not isinstance(ndim, builtins.int):
            raise TypeError(
                f"result_type() operands must be tensors or Python scalars, got {type(op).__name__}"
            )
        if ndim > 0:
            dim_result = _promote_opt(dim_result, dtype)
        else:
            zero_result = _promote_opt(zero_result, dtype)
    result = _combine_categories(dim_result, _combine_categories(zero_result, wrapped_result))
    assert result is not None, operands
    return result


# c10's TypeMeta names, which torch prints for a dtype in some errors (masked_fill_'s mask,
# set_'s storage)
TYPE_META_NAMES = {
    "float32": "float",
    "float64": "double",
    "float16": "c10::Half",
    "bfloat16": "c10::BFloat16",
    "int64": "long int",
    "int32": "int",
    "int16": "short int",
    "int8": "signed char",
    "uint8": "unsigned char",
    "bool": "bool",
    "complex64": "c10::complex<float>",
    "complex128": "c10::complex<double>",
    "uint16": "short unsigned int",
    "uint32": "unsigned int",
    "uint64": "long unsigned int",
}
