"""tensord.dtypes: the records, name/NumPy/torch mappings, and torch's promotion rules."""

from __future__ import annotations

import itertools
import pickle
import warnings
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import pytest
import tensord
import torch
from tensord import dtypes as D


@dataclass(frozen=True)
class FakeTensor:
    """What result_type needs of a tensor: a dtype and a dim count."""

    dtype: D.DType
    ndim: int


def test_records() -> None:
    assert D.float32.itemsize == 4 and D.float32.is_floating_point and D.float32.is_signed
    assert D.bfloat16.numpy_dtype == np.dtype(ml_dtypes.bfloat16) and D.bfloat16.itemsize == 2
    assert D.complex128.is_complex and not D.complex128.is_floating_point
    assert D.complex128.itemsize == 16
    assert not D.uint8.is_signed and not D.bool.is_signed and D.int8.is_signed
    assert repr(D.float32) == "tensord.float32" and str(D.int64) == "tensord.int64"
    assert len(D.ALL_DTYPES) == 12 and len({d.name for d in D.ALL_DTYPES}) == 12


def test_aliases_and_package_exports() -> None:
    assert D.float is D.float32 and D.double is D.float64 and D.half is D.float16
    assert D.int is D.int32 and D.long is D.int64 and D.short is D.int16
    assert D.cfloat is D.complex64 and D.cdouble is D.complex128
    # once torch is imported the package's names are torch's own dtypes (torch is imported
    # here: the DTypes before that are held in a fresh interpreter, test_torch_interop)
    assert tensord.float32 is torch.float32 and tensord.long is torch.int64
    assert tensord.float32 == D.float32 and tensord.bool == D.bool and tensord.long == D.int64
    assert tensord.promote_types is D.promote_types and tensord.result_type is D.result_type


def test_frozen_hashable_and_picklable() -> None:
    with pytest.raises(AttributeError):
        D.float32.itemsize = 8  # type: ignore[misc]
    assert {D.float32: 1}[D.float] == 1
    assert pickle.loads(pickle.dumps(D.bfloat16)) is D.bfloat16


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("float32", D.float32),
        ("float", D.float32),
        ("torch.float32", D.float32),
        ("torch.long", D.int64),
        ("cdouble", D.complex128),
        ("bool", D.bool),
        ("tensord.bfloat16", D.bfloat16),
    ],
)
def test_dtype_from_name(name: str, expected: D.DType) -> None:
    assert D.dtype_from_name(name) is expected


def test_dtype_from_name_unknown() -> None:
    with pytest.raises(TypeError, match=r"unknown dtype 'float8'; expected one of: .*float32"):
        D.dtype_from_name("float8")
    with pytest.raises(TypeError, match="must be a str"):
        D.dtype_from_name(4)  # type: ignore[arg-type]


def test_numpy_round_trip() -> None:
    for d in D.ALL_DTYPES:
        assert D.dtype_from_numpy(D.to_numpy_dtype(d)) is d
        assert np.dtype(D.to_numpy_dtype(d)).itemsize == d.itemsize
    assert D.dtype_from_numpy("f4") is D.float32
    assert D.dtype_from_numpy(np.bool_) is D.bool
    assert D.dtype_from_numpy(np.uint16) is D.uint16  # torch's barebones unsigned dtypes
    with pytest.raises(TypeError, match="no dtype for numpy dtype"):
        D.dtype_from_numpy(np.str_)


def test_promote_types_by_hand() -> None:
    P = D.promote_types
    assert P(D.bfloat16, D.float16) is D.float32
    assert P(D.uint8, D.int8) is D.int16
    assert P(D.uint8, D.int32) is D.int32
    assert P(D.bool, D.uint8) is D.uint8
    assert P(D.int64, D.float16) is D.float16
    assert P(D.complex64, D.float64) is D.complex128
    assert P(D.complex64, D.bfloat16) is D.complex64


def test_result_type_by_hand() -> None:
    R = D.result_type
    f32_0d = FakeTensor(D.float32, 0)
    assert R(f32_0d, 1) is D.float32  # tensor(0.5) + 1 stays float32
    assert R(FakeTensor(D.int32, 2), 1.5) is D.float32  # int tensor + float -> default dtype
    assert R(FakeTensor(D.float32, 1), 1j) is D.complex64
    assert R(FakeTensor(D.float64, 1), 1j) is D.complex128
    assert R(FakeTensor(D.int8, 1), FakeTensor(D.int64, 0)) is D.int8  # zero-dim can't widen
    assert R(FakeTensor(D.int8, 1), FakeTensor(D.float64, 0)) is D.float64  # but lifts category
    assert R(FakeTensor(D.bool, 1), 1) is D.int64
    assert R(FakeTensor(D.uint8, 1), True) is D.uint8
    assert R(1, 2.0) is D.float32
    assert R([FakeTensor(D.float16, 3), 2]) is D.float16
    with pytest.raises(TypeError, match="complex32"):
        R(FakeTensor(D.float16, 1), 1j)
    with pytest.raises(TypeError, match="tensors or Python scalars"):
        R("x")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="at least one operand"):
        R()


# -- against torch -------------------------------------------------------------------------


@pytest.mark.torch
def test_promote_types_every_pair_matches_torch() -> None:
    torch = pytest.importorskip("torch")
    for a, b in itertools.product(D.ALL_DTYPES, repeat=2):
        expected = torch.promote_types(D.to_torch(a), D.to_torch(b))
        assert D.to_torch(D.promote_types(a, b)) == expected, (a, b)


@pytest.mark.torch
def test_torch_round_trip() -> None:
    torch = pytest.importorskip("torch")
    for d in D.ALL_DTYPES:
        t = D.to_torch(d)
        assert D.from_torch(t) is d
        assert torch.empty((), dtype=t).element_size() == d.itemsize
        assert torch.empty((), dtype=t).is_floating_point() == d.is_floating_point
        assert torch.empty((), dtype=t).is_complex() == d.is_complex
        assert t.is_signed == d.is_signed
        # the name torch prints for the tensor in its error texts (expand's, for one)
        with pytest.raises(RuntimeError) as info:
            torch.empty(2, 3, dtype=t).expand(4)
        assert str(info.value).startswith(f"expand({D.tensor_type_name(d)}{{[2, 3]}}")
    assert D.tensor_type_name(D.float32, "cuda") == "torch.cuda.FloatTensor"
    assert D.tensor_type_name(D.bool, "cuda") == "CUDABoolType"


SCALARS = (True, 3, -2.5, 1j)


@pytest.mark.torch
def test_result_type_pairs_match_torch() -> None:
    """Every pair of (1-d tensor | 0-d tensor | Python scalar) against torch.result_type."""
    torch = pytest.importorskip("torch")
    operands: list[tuple[object, object]] = []  # (tensord operand, torch operand)
    for d in D.ALL_DTYPES:
        for ndim in (0, 1):
            operands.append((FakeTensor(d, ndim), torch.zeros((2,) * ndim, dtype=D.to_torch(d))))
    operands += [(s, s) for s in SCALARS]
    checked = 0
    for (ours_a, torch_a), (ours_b, torch_b) in itertools.product(operands, repeat=2):
        if not (isinstance(ours_a, FakeTensor) or isinstance(ours_b, FakeTensor)):
            continue  # torch.result_type needs a tensor among its two operands
        expected = torch.result_type(torch_a, torch_b)
        if expected == torch.complex32:
            with pytest.raises(TypeError, match="complex32"):
                D.result_type(ours_a, ours_b)  # type: ignore[arg-type]
            continue
        assert D.to_torch(D.result_type(ours_a, ours_b)) == expected, (ours_a, ours_b)  # type: ignore[arg-type]
        checked += 1
    assert checked > 700


@pytest.mark.torch
def test_result_type_three_operands_match_torch_ops() -> None:
    """Three operands fold through one state, as in torch's TensorIterator (torch.addcmul)."""
    torch = pytest.importorskip("torch")
    kinds = [(d, n) for d in D.ALL_DTYPES if d is not D.bool for n in (0, 1)]
    checked = 0
    for (da, na), (db, nb), (dc, nc) in itertools.product(kinds, repeat=3):
        if (D.ALL_DTYPES.index(da) * 7 + D.ALL_DTYPES.index(db) * 3 + na + nb + nc) % 5:
            continue  # a deterministic sample keeps this quick
        ts = [torch.zeros((2,) * n, dtype=D.to_torch(d)) for d, n in ((da, na), (db, nb), (dc, nc))]
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # "ComplexHalf ... experimental"
                expected = torch.addcmul(*ts).dtype
        except RuntimeError:
            continue  # torch has no kernel for that combination
        if expected == torch.complex32:
            with pytest.raises(TypeError, match="complex32"):
                D.result_type(FakeTensor(da, na), FakeTensor(db, nb), FakeTensor(dc, nc))
            continue
        ours = D.result_type(FakeTensor(da, na), FakeTensor(db, nb), FakeTensor(dc, nc))
        assert D.to_torch(ours) == expected, (da, na, db, nb, dc, nc)
        checked += 1
    assert checked > 100


@pytest.mark.parametrize(
    ("a", "b"),
    [("float16", "bfloat16"), ("uint8", "int8"), ("bool", "uint8"), ("float64", "complex64")],
)
def test_promote_types_takes_the_packages_names_once_torch_is_imported(a: str, b: str) -> None:
    # tensord.<name> is torch's own dtype then: promotion must read it as its DType
    ours = tensord.promote_types(getattr(tensord, a), getattr(tensord, b))
    assert ours == torch.promote_types(getattr(torch, a), getattr(torch, b))
