"""Torch's barebones unsigned dtypes (uint16, uint32, uint64) against torch 2.13.

torch has storage, views, conversions and copies for them, few kernels (arange,
index_put, index_select, masked_fill, masked_select raise NotImplementedError) and no
promotion but with a floating dtype: every case runs on both sides and must give the
same dtype, shape and values, or the same error type and text.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import tensord
from tensord import dtypes

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.torch]

UNSIGNED = ["uint16", "uint32", "uint64"]


class Ours:
    """The tensord side of a case: the client's factories, tensord's names."""

    def __init__(self, client: tensord.Client) -> None:
        self.client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name, None) or getattr(tensord, name)


def outcome(op: Callable[[], Any]) -> tuple[str, Any]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return "ok", op()
    except Exception as e:  # the oracle's error, compared by type and text
        return "error", e


def as_python(value: Any) -> Any:
    if isinstance(value, tensord.Tensor):
        return (
            str(value.dtype).removeprefix("torch."),
            tuple(value.shape),
            value.stride(),
            value.tolist(),
        )
    if _is_torch(value):
        return (
            str(value.dtype).removeprefix("torch."),
            tuple(value.shape),
            value.stride(),
            value.tolist(),
        )
    if isinstance(value, (dtypes.DType,)):
        return value.name
    return str(value).removeprefix("torch.")


def _is_torch(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


CASES: list[Callable[[Any, Any], Any]] = [
    lambda m, d: m.zeros(2, 3, dtype=d),
    lambda m, d: m.ones(2, dtype=d),
    lambda m, d: m.full((2,), 7, dtype=d),
    lambda m, d: m.full((2,), -1, dtype=d),  # wraps, as C++
    lambda m, d: m.full((2,), 1.5, dtype=d),
    lambda m, d: m.full((2,), 2**40, dtype=d),
    lambda m, d: m.tensor([1, 2], dtype=d),
    lambda m, d: m.tensor([-1], dtype=d),
    lambda m, d: m.tensor([2**64 - 1], dtype=d),
    lambda m, d: m.tensor([2**64], dtype=d),
    lambda m, d: m.tensor([1.5, 2.0], dtype=d),
    lambda m, d: m.tensor([-1.0], dtype=d),
    lambda m, d: m.tensor([[True, False]], dtype=d),
    lambda m, d: m.arange(3, dtype=d),
    lambda m, d: m.from_numpy(np.arange(5, dtype=dtypes.dtype_from_name(str(d)).numpy_dtype)),
    lambda m, d: m.tensor([1, 2, 3], dtype=d).view(3, 1).t(),
    lambda m, d: m.tensor([1, 2, 3], dtype=d).view(m.uint8),
    lambda m, d: m.tensor([1, 2, 3, 4], dtype=d).view(m.int16),
    lambda m, d: m.tensor([1, 2], dtype=m.int64).view(d),
    lambda m, d: m.tensor([1, 2, 3], dtype=d).clone(),
    lambda m, d: m.tensor([[1, 2, 3]], dtype=d).t().contiguous(),
    lambda m, d: m.tensor([1, 2, 3], dtype=d).to(m.float32),
    lambda m, d: m.tensor([1, 2, 3], dtype=d).to(m.int64),
    lambda m, d: m.tensor([0, 2], dtype=d).to(m.bool),
    lambda m, d: m.tensor([1, 2], dtype=d).to(m.complex64),
    lambda m, d: m.tensor([1, 2], dtype=d).to(m.bfloat16),
    lambda m, d: m.tensor([1.5, -1.0, 70000.0]).to(d),
    lambda m, d: m.tensor([-1, 70000]).to(d),
    lambda m, d: m.tensor([1, 2], dtype=d).to(m.uint16 if d is not m.uint16 else m.uint32),
    lambda m, d: m.tensor([1, 2, 3], dtype=d).fill_(5),
    lambda m, d: m.tensor([1, 2, 3], dtype=d).fill_(-1),
    lambda m, d: m.tensor([1, 2, 3], dtype=d).fill_(2**40),
    lambda m, d: m.tensor([1, 2, 3], dtype=d).copy_(m.tensor([1.0, 2.0, 3.0])),
    lambda m, d: m.tensor([1, 2, 3], dtype=d)[[0, 2]],
    lambda m, d: m.tensor([1, 2, 3], dtype=d)[m.tensor([True, False, True])],
    lambda m, d: m.tensor([1, 2, 3], dtype=d).index_select(0, m.tensor([0])),
    lambda m, d: m.tensor([1, 2, 3], dtype=d).masked_select(m.tensor([True, False, True])),
    lambda m, d: m.tensor([1, 2, 3], dtype=d).masked_fill_(m.tensor([True, False, True]), 4),
    lambda m, d: m.tensor([1, 2, 3], dtype=d).index_put_(
        (m.tensor([0, 0]),), m.tensor([1, 1], dtype=d), True
    ),
    lambda m, d: m.tensor([1, 2, 3], dtype=d).__setitem__([0, 1], 9),
    lambda m, d: m.tensor([1, 2, 3], dtype=d).__setitem__(slice(0, 2), 9),
    lambda m, d: m.cat([m.tensor([1], dtype=d), m.tensor([2], dtype=d)]),
    lambda m, d: m.cat([m.tensor([1], dtype=d), m.tensor([2.0])]),
    lambda m, d: m.cat([m.tensor([1], dtype=d), m.tensor([2])]),
    lambda m, d: m.stack([m.tensor([1], dtype=d), m.tensor([2], dtype=d)]),
    lambda m, d: m.tensor([1, 2], dtype=d).repeat(2, 1),
    lambda m, d: m.tensor([7], dtype=d)[0].item(),
    lambda m, d: m.promote_types(d, m.float16),
    lambda m, d: m.promote_types(m.float64, d),
    lambda m, d: m.promote_types(d, m.int64),
    lambda m, d: m.promote_types(m.bool, d),
    lambda m, d: m.promote_types(d, m.complex64),
    lambda m, d: m.promote_types(d, d),
]


@pytest.fixture(scope="module")
def unpipelined(server: Any) -> Any:
    """One RPC per op: a write's error is raised by the write itself, as torch's."""
    with tensord.connect(server.address, pipelining=False) as client:
        yield client


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("name", UNSIGNED)
def test_unsigned_dtypes_match_torch(unpipelined: tensord.Client, name: str, case: int) -> None:
    client = unpipelined
    kind, theirs = outcome(lambda: CASES[case](torch, getattr(torch, name)))
    if kind == "error":
        with pytest.raises(Exception) as got:
            CASES[case](Ours(client), getattr(tensord, name))
        ours = got.value
        assert isinstance(ours, type(theirs)), (ours, theirs)
        assert str(ours) == str(theirs).split("\nException raised from")[0]
        return
    ours = CASES[case](Ours(client), getattr(tensord, name))
    assert as_python(ours) == as_python(theirs)


@pytest.mark.parametrize("name", UNSIGNED)
def test_unsigned_numpy_and_dlpack_round_trip(client: tensord.Client, name: str) -> None:
    values = np.array([0, 1, np.iinfo(name).max], dtype=name)
    x = client.tensor(values)
    assert x.dtype == getattr(tensord, name)
    assert x.numpy().dtype == values.dtype
    np.testing.assert_array_equal(x.numpy(), values)
    np.testing.assert_array_equal(np.from_dlpack(x), values)
    t = torch.from_dlpack(x)
    assert t.dtype is getattr(torch, name) and t.tolist() == values.tolist()
    assert repr(x).replace("tensord.", "torch.") == repr(torch.from_numpy(values))
    assert client.tensor(torch.from_numpy(values)).tolist() == values.tolist()


@pytest.mark.slow
@pytest.mark.parametrize("pipelining", [True, False])
@pytest.mark.parametrize("dtype", ["int64", "uint16", "uint64", "bool"])
def test_requires_grad_of_a_non_float_tensor_is_torchs_error(
    server: Any, pipelining: bool, dtype: str
) -> None:
    with tensord.connect(server.address, pipelining=pipelining) as client:
        x = client.zeros(2, dtype=getattr(tensord, dtype))
        t = torch.zeros(2, dtype=getattr(torch, dtype))
        with pytest.raises(RuntimeError) as theirs:
            t.requires_grad_()
        with pytest.raises(RuntimeError) as ours:
            x.requires_grad_()
            client.synchronize()
        assert str(ours.value) == str(theirs.value)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["uint64", "int64", "int32", "float32", "bool", "complex64"])
@pytest.mark.parametrize("value", [2**63, 2**64 - 1, 2**64, 2**70, -(2**63) - 1])
def test_python_ints_past_int64_as_fill_values_are_torchs(
    server: Any, dtype: str, value: int
) -> None:
    """torch's Scalar takes an int64, else a uint64 (2**63 fills a uint64 or float tensor;
    an int64 tensor overflows), else raises OverflowError, whatever the dtype.  Unpipelined,
    so the server's error is raised by the call itself, with torch's text alone."""
    client = tensord.connect(server.address, pipelining=False)

    def outcome(make: Callable[[], Any]) -> Any:
        try:
            return make().tolist()
        except (RuntimeError, OverflowError) as exc:
            return exc

    def ours_full() -> Any:
        return client.full((2,), value, dtype=getattr(tensord, dtype))

    def ours_fill() -> Any:
        x = client.zeros(2, dtype=getattr(tensord, dtype))
        x.fill_(value)
        return x

    theirs = outcome(lambda: torch.full((2,), value, dtype=getattr(torch, dtype)))
    also = outcome(lambda: torch.zeros(2, dtype=getattr(torch, dtype)).fill_(value))
    assert repr(also) == repr(theirs)
    for make in (ours_full, ours_fill):
        ours = outcome(make)
        if isinstance(theirs, Exception):  # the built-in type torch raises (ours may subclass it)
            assert isinstance(ours, type(theirs)) and str(ours) == str(theirs), (ours, theirs)
        else:
            assert ours == theirs
    client.close()


@pytest.mark.parametrize("dtype", ["uint16", "uint32", "uint64"])
def test_a_barebones_unsigned_mask_in_masked_fill_names_its_c10_type(
    client: tensord.Client, dtype: str
) -> None:
    t = torch.zeros(3)
    x = client.zeros(3)
    with pytest.raises(RuntimeError) as theirs:
        t.masked_fill_(torch.zeros(3, dtype=getattr(torch, dtype)), 1.0)
    with pytest.raises(RuntimeError) as ours:
        x.masked_fill_(client.zeros(3, dtype=getattr(tensord, dtype)), 1.0)
        client.synchronize()
    assert str(ours.value) == str(theirs.value)


@pytest.mark.slow
@pytest.mark.parametrize(
    "args", [(2**63,), (0, 2**63), (0, 10, 2**63), (2**64 - 1,), (2**63, 2**63 + 2)]
)
def test_arange_with_ints_past_int64_is_torchs_error(
    client: tensord.Client, args: tuple[int, ...]
) -> None:
    # found by the RPC fuzz test once such ints could travel (Scalar.uint_value): INTERNAL
    with pytest.raises(RuntimeError) as theirs:
        torch.arange(*args)
    with pytest.raises(RuntimeError) as ours:
        client.arange(*args)
    assert str(ours.value) == str(theirs.value)


def test_a_float_arange_takes_ints_past_int64_as_torch(client: tensord.Client) -> None:
    ours = client.arange(0, 2**63, 2**62, dtype=tensord.float32).tolist()
    assert ours == torch.arange(0, 2**63, 2**62, dtype=torch.float32).tolist()
