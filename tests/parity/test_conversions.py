"""Conversions between dtypes match torch's (the oracle), value for value."""

from __future__ import annotations

import numpy as np
import pytest
import tensord
import torch

DTYPES = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64")
# (no negative real part: its cast to an unsigned type is undefined in C++)
COMPLEX_VALUES = [1j, 0j, 2.5 + 0j, 3 - 1j, 0.25j]


def _torch_values(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.float64).numpy() if t.dtype == torch.float16 else t.numpy()


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Casting complex values to real discards")
@pytest.mark.parametrize("source", ["complex64", "complex128"])
@pytest.mark.parametrize("target", DTYPES)
def test_complex_to_real_matches_torch(client, source: str, target: str) -> None:
    # bool is "nonzero" (1j is True); every other real type takes the real part
    expected = torch.tensor(COMPLEX_VALUES, dtype=getattr(torch, source)).to(getattr(torch, target))
    ours = client.tensor(COMPLEX_VALUES, dtype=getattr(tensord, source)).to(
        getattr(tensord, target)
    )
    np.testing.assert_array_equal(ours.numpy().astype(np.float64), _torch_values(expected))


def test_fill_and_setitem_of_a_complex_into_bool_match_torch(client) -> None:
    for value in (1j, 0j, 2 + 0j):
        expected = torch.zeros(3, dtype=torch.bool).fill_(value)
        ours = client.zeros(3, dtype=tensord.bool)
        ours.fill_(value)
        assert ours.tolist() == expected.tolist()
        expected[1] = 0j
        ours[1] = 0j
        assert ours.tolist() == expected.tolist()


# ---------------------------------------------------------------------------
# torch.tensor(data, dtype): overflow raises, floats truncate, as torch's unpacking does

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from tensord import _convert  # noqa: E402
from tensord.tensor import assign_data  # noqa: E402

TENSOR_DTYPES = (*DTYPES, "bfloat16", "complex64", "complex128")
I64 = 2**63
EDGE_NUMBERS = [
    *(0, 1, -1, True, False, 127, 128, -128, -129, 255, 256, -255, -256, 300, -300),
    *(2**31 - 1, 2**31, -(2**31), -(2**31) - 1, I64 - 1, I64, -I64, -I64 - 1, 2**64, 2**1024),
    *(0.0, -0.0, 1.5, -1.5, -0.5, 127.9, -128.9, 255.5, 256.0, -1.0, 1e10, -1e10, 2.0**63),
    *(
        -(2.0**63),
        9.3e18,
        2.0**53 + 2,
        1e300,
        float("nan"),
        -float("nan"),
        float("inf"),
        -float("inf"),
    ),
    *(3.5e38, 65520.0, 0.1, 1 / 3, 1j, 0j, 2.5 + 0j, 1 + 2j),
]


def _outcome(make) -> tuple:  # type: ignore[no-untyped-def, type-arg]
    """("ok", dtype name, bytes) or ("error", type name, text)."""
    try:
        array, dtype = make()
    except Exception as e:
        return ("error", type(e).__name__, str(e))
    return ("ok", dtype, np.ascontiguousarray(array).view(np.uint8).tobytes())


def _torch_outcome(data, dtype: str | None) -> tuple:  # type: ignore[no-untyped-def, type-arg]
    def make():  # type: ignore[no-untyped-def]
        t = torch.tensor(data, dtype=getattr(torch, dtype) if dtype else None)
        bits = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
        return bits.numpy(), str(t.dtype).removeprefix("torch.")

    return _outcome(make)


def _our_outcome(data, dtype: str | None) -> tuple:  # type: ignore[no-untyped-def, type-arg]
    def make():  # type: ignore[no-untyped-def]
        array, dt = _convert.as_array(data, getattr(tensord.dtypes, dtype) if dtype else None)
        return array, dt.name

    return _outcome(make)


@pytest.mark.parametrize("dtype", [*TENSOR_DTYPES, None])
def test_tensor_from_python_numbers_matches_torch(dtype: str | None) -> None:
    # each number alone, in a (nested) list, beside an int that overflows uint8, beside a
    # float (NumPy would make a float64 array) and beside a complex (complex128 array)
    for number in EDGE_NUMBERS:
        for data in (number, [number], [[number]], [1, number], [number, 300], [number, 1.5],
                     [number, 1j], [I64, number], [number, 2**64]):  # fmt: skip
            assert _our_outcome(data, dtype) == _torch_outcome(data, dtype), (data, dtype)


python_numbers = st.one_of(
    st.booleans(),
    st.integers(min_value=-(2**65), max_value=2**65),
    st.integers(min_value=-300, max_value=300),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=-1e3, max_value=1e3),
    st.complex_numbers(max_magnitude=1e3),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.lists(python_numbers, min_size=1, max_size=6) | python_numbers,
    dtype=st.sampled_from([*TENSOR_DTYPES, None]),
)
def test_tensor_conversions_match_torch_property(data, dtype: str | None) -> None:  # type: ignore[no-untyped-def]
    assert _our_outcome(data, dtype) == _torch_outcome(data, dtype)


def test_tensor_overflow_raises_over_the_wire(client) -> None:
    with pytest.raises(ValueError, match=r"^Overflow when unpacking long long$"):
        client.tensor([2**63])
    with pytest.raises(
        RuntimeError, match=r"^value cannot be converted to type uint8 without overflow$"
    ):
        client.tensor([[1], [300]], dtype=tensord.uint8)
    with pytest.raises(
        RuntimeError, match=r"^value cannot be converted to type int32 without overflow$"
    ):
        client.tensor(1e10, dtype=tensord.int32)
    assert client.tensor([1.5, -1.5, -1], dtype=tensord.int32).tolist() == [1, -1, -1]
    assert client.tensor([-1, -255], dtype=tensord.uint8).tolist() == [255, 1]  # C++ wraps


def test_python_floats_copied_into_float64_stay_exact(client) -> None:
    values = [0.1, 1 / 3, 1e300, 2.0**-1070, 1 + 2**-52]
    expected = torch.zeros(5, dtype=torch.float64)
    expected.copy_(torch.tensor(values, dtype=torch.float64))
    ours = client.zeros(5, dtype=tensord.float64)
    assign_data(ours, slice(None), values)  # tensord.aio's x.setitem(key, list)
    assert ours.tolist() == expected.tolist() == values
    ours.zero_()
    ours.copy_(values)
    assert ours.tolist() == values
    cplx = client.zeros(2, dtype=tensord.complex128)
    cplx.copy_([0.1 + 1j / 3, 1j])
    assert cplx.tolist() == [0.1 + 1j / 3, 1j]
    # a narrower destination rounds once, from the exact value (as torch's copy_)
    half = client.zeros(2, dtype=tensord.float32)
    half.copy_([0.1, 1 / 3])
    assert half.tolist() == torch.tensor([0.1, 1 / 3], dtype=torch.float64).float().tolist()


# ---------------------------------------------------------------------------
# arange: torch's CPU kernel, bit for bit

FLOAT_ARANGE_DTYPES = ("float16", "bfloat16", "float32", "float64")
INT_ARANGE_DTYPES = ("uint8", "int8", "int16", "int32", "int64")


def _bits(t: torch.Tensor) -> bytes:
    return (
        t.view(torch.int16).numpy().tobytes() if t.dtype == torch.bfloat16 else t.numpy().tobytes()
    )


def _builtin_name(e: Exception) -> str:
    return next(c.__name__ for c in type(e).__mro__ if c.__module__ == "builtins")


def _arange_outcome(make) -> tuple:  # type: ignore[no-untyped-def, type-arg]
    try:
        return ("ok", _bits(make()))
    except Exception as e:
        # (tensord's RuntimeErrors from the server are ValueErrors too: InvalidArgumentError)
        kind = "RuntimeError" if isinstance(e, RuntimeError) else _builtin_name(e)
        return ("error", kind, str(e))


def _ours_as_torch(t) -> torch.Tensor:  # type: ignore[no-untyped-def]
    array = t.numpy()
    if t.dtype == tensord.bfloat16:
        return torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(array.copy())


bounds = st.floats(min_value=-1e4, max_value=1e4) | st.integers(-10_000, 10_000)
steps = (
    st.floats(min_value=1e-3, max_value=100)
    | st.sampled_from([0.1, 0.3, 0.5, 1.5, 2.0, 1 / 3, 0.7])
    | st.integers(1, 50)
)


@st.composite
def arange_args(draw, dtypes_: tuple[str, ...]):  # type: ignore[no-untyped-def]
    start, step = draw(bounds), draw(steps)
    sign = draw(st.sampled_from([1, -1]))
    count = draw(st.integers(0, 200))
    end = start + sign * step * count + draw(st.floats(0, 1)) * sign * step
    if draw(st.booleans()):
        end = round(end, draw(st.integers(0, 3)))
    return start, end, sign * step, draw(st.sampled_from(dtypes_))


@pytest.mark.slow
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(args=arange_args(FLOAT_ARANGE_DTYPES + INT_ARANGE_DTYPES))
def test_arange_kernel_matches_torch_bit_for_bit(args) -> None:  # type: ignore[no-untyped-def]
    from tensord_server.domain import kernels

    start, end, step, dtype = args
    expected = _arange_outcome(lambda: torch.arange(start, end, step, dtype=getattr(torch, dtype)))
    ours = _arange_outcome(
        lambda: (
            torch.from_numpy(
                kernels.arange_values(np, start, end, step, getattr(tensord.dtypes, dtype))
            )
            if dtype != "bfloat16"
            else torch.from_numpy(
                kernels.arange_values(np, start, end, step, tensord.dtypes.bfloat16).view(np.int16)
            ).view(torch.bfloat16)
        )
    )
    assert ours == expected


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(args=arange_args(FLOAT_ARANGE_DTYPES + INT_ARANGE_DTYPES))
def test_arange_over_the_wire_matches_torch(client, args) -> None:  # type: ignore[no-untyped-def]
    start, end, step, dtype = args
    expected = _arange_outcome(lambda: torch.arange(start, end, step, dtype=getattr(torch, dtype)))
    ours = _arange_outcome(
        lambda: _ours_as_torch(client.arange(start, end, step, dtype=getattr(tensord, dtype)))
    )
    assert ours == expected


@pytest.mark.slow
@pytest.mark.parametrize("dtype", INT_ARANGE_DTYPES)
def test_integer_arange_with_float_bounds_matches_torch(client, dtype: str) -> None:
    # int64 counts from truncated bounds (a fractional step is a ValueError); the other
    # integer types count in double and step by the truncated step (0 here: all zeros)
    for start, end, step in [
        (0, 5, 0.5),
        (0, 5, 1.5),
        (0.5, 3, 1.5),
        (-3.7, 2.2, 0.9),
        (0, 5, -0.5),
    ]:
        bounds = (start, end, step)
        expected = _arange_outcome(lambda: torch.arange(*bounds, dtype=getattr(torch, dtype)))  # noqa: B023
        ours = _arange_outcome(
            lambda: _ours_as_torch(client.arange(*bounds, dtype=getattr(tensord, dtype)))  # noqa: B023
        )
        assert ours == expected, (start, end, step)
