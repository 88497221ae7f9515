"""Errors a client can find itself, raised at the call as torch raises them (not at the
next wait of a pipelined client), and the factories' argument rules: torch is the oracle."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import tensord
import torch

COPY_SOURCES = [(4,), (2, 2), (5, 2, 3), (1, 2, 3)]


def torch_error(call: Callable[[], Any]) -> BaseException:
    with pytest.raises(Exception) as caught:
        call()
    return caught.value


def assert_raises_like(expected: BaseException, call: Callable[[], Any]) -> None:
    with pytest.raises(type(expected)) as caught:
        call()
    assert str(caught.value) == str(expected)


@pytest.mark.parametrize("src_shape", COPY_SOURCES)
def test_copy_of_a_shape_that_does_not_broadcast_raises_at_the_call(
    client: Any, src_shape: tuple[int, ...]
) -> None:
    assert client.pipelining
    expected = torch_error(lambda: torch.zeros(2, 3).copy_(torch.zeros(src_shape)))
    x = client.zeros(2, 3)
    assert_raises_like(expected, lambda: x.copy_(client.ones(src_shape)))
    assert_raises_like(expected, lambda: x.copy_(np.ones(src_shape, dtype=np.float32)))
    assert_raises_like(expected, lambda: x.copy_(np.ones(src_shape).tolist()))
    client.synchronize()  # nothing was queued: no error waits for the next call
    assert x.tolist() == [[0.0] * 3] * 2


@pytest.mark.slow
@pytest.mark.parametrize("key", [(...,), (0,), (slice(None), 1)])
@pytest.mark.parametrize("src_shape", COPY_SOURCES)
def test_setitem_of_a_shape_that_does_not_expand_raises_at_the_call(
    client: Any, key: tuple[Any, ...], src_shape: tuple[int, ...]
) -> None:
    def assign(x: Any, value: Any) -> None:
        x[key] = value

    try:
        assign(torch.zeros(2, 3), torch.zeros(src_shape))
    except RuntimeError as error:
        expected: BaseException | None = error
    else:
        expected = None
    x = client.zeros(2, 3)
    if expected is None:
        assign(x, client.ones(src_shape))
        assert x.numpy()[key].min() == 1.0
        return
    assert_raises_like(expected, lambda: assign(x, client.ones(src_shape)))
    client.synchronize()
    assert x.tolist() == [[0.0] * 3] * 2


def test_a_copy_that_broadcasts_still_works(client: Any) -> None:
    x = client.zeros(2, 3)
    x.copy_(client.tensor([1.0, 2.0, 3.0]))
    x[0] = client.tensor([[4.0, 5.0, 6.0]])
    assert x.tolist() == [[4.0, 5.0, 6.0], [1.0, 2.0, 3.0]]


# ---- factories: sizes, data and dtypes as torch's argument parser takes them ---------------

FACTORIES: dict[str, Callable[[Any, tuple[int, ...], Any], Any]] = {
    "empty": lambda m, size, dtype: m.empty(*size, dtype=dtype),
    "zeros": lambda m, size, dtype: m.zeros(*size, dtype=dtype),
    "ones": lambda m, size, dtype: m.ones(size, dtype=dtype),
    "full": lambda m, size, dtype: m.full(size, 1.5, dtype=dtype),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", FACTORIES)
@pytest.mark.parametrize("size", [(2**64,), (3, 2**63), (-(2**63) - 1, 2)])
def test_a_size_past_int64_raises_torchs_type_error(
    client: Any, name: str, size: tuple[int, ...]
) -> None:
    expected = torch_error(lambda: FACTORIES[name](torch, size, None))
    with pytest.raises(TypeError) as caught:
        FACTORIES[name](client, size, None)
    # torch's text goes on with a C++ stack trace after its first line
    assert isinstance(expected, TypeError)
    assert str(expected).startswith(str(caught.value).removesuffix('"') + "\n")


@pytest.mark.slow
@pytest.mark.parametrize("name", FACTORIES)
@pytest.mark.parametrize("size", [(2**62,), (2**31, 2**31), (2**63 - 1,)])
def test_a_storage_past_int64_bytes_raises_torchs_runtime_error(
    client: Any, name: str, size: tuple[int, ...]
) -> None:
    expected = torch_error(lambda: FACTORIES[name](torch, size, None))
    assert_raises_like(expected, lambda: FACTORIES[name](client, size, None))


@pytest.mark.parametrize("size", [(2**49,), (2**30, 2**30)])
def test_a_size_past_the_element_limit_is_a_runtime_error_as_torchs_allocation_failure(
    client: Any, size: tuple[int, ...]
) -> None:
    assert isinstance(torch_error(lambda: torch.empty(*size, dtype=torch.uint8)), RuntimeError)
    with pytest.raises(RuntimeError) as caught:
        client.empty(*size, dtype=tensord.uint8)
    assert isinstance(caught.value, ValueError)  # as before: the limit's InvalidArgumentError
    assert "281474976710656" in str(caught.value)


@pytest.mark.parametrize("data", [None, [1, None], [[1.0], [object()]], {}])
def test_tensor_of_data_with_no_dtype_raises_torchs_runtime_error(client: Any, data: Any) -> None:
    expected = torch_error(lambda: torch.tensor(data))
    assert_raises_like(expected, lambda: client.tensor(data))


DTYPE_TAKERS: dict[str, Callable[[Any, Any], Any]] = {
    "empty": lambda m, dtype: m.empty(2, dtype=dtype),
    "zeros": lambda m, dtype: m.zeros(2, dtype=dtype),
    "ones": lambda m, dtype: m.ones(2, dtype=dtype),
    "full": lambda m, dtype: m.full((2,), 1, dtype=dtype),
    "tensor": lambda m, dtype: m.tensor([1, 2], dtype=dtype),
    "empty_like": lambda m, dtype: m.empty_like(m.zeros(2), dtype=dtype),
    "zeros_like": lambda m, dtype: m.zeros_like(m.zeros(2), dtype=dtype),
    "ones_like": lambda m, dtype: m.ones_like(m.zeros(2), dtype=dtype),
    "full_like": lambda m, dtype: m.full_like(m.zeros(2), 1, dtype=dtype),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", DTYPE_TAKERS)
@pytest.mark.parametrize("dtype", ["float32", np.float32, np.dtype("float32"), 5])
def test_a_factory_refuses_a_dtype_that_is_no_torch_dtype_as_torch(
    client: Any, name: str, dtype: Any
) -> None:
    expected = torch_error(lambda: DTYPE_TAKERS[name](torch, dtype))
    assert_raises_like(expected, lambda: DTYPE_TAKERS[name](client, dtype))


def test_arange_refuses_a_string_dtype_with_a_type_error(client: Any) -> None:
    # torch's text for arange lists its overloads; the type is torch's, the text the other factories'
    name: Any = "float32"
    assert isinstance(torch_error(lambda: torch.arange(2, dtype=name)), TypeError)
    with pytest.raises(
        TypeError, match=r"^arange\(\): argument 'dtype' must be torch.dtype, not str$"
    ):
        client.arange(2, dtype=name)


@pytest.mark.slow
@pytest.mark.parametrize("name", DTYPE_TAKERS)
@pytest.mark.parametrize(
    ("dtype", "expected"),
    [(tensord.float64, "float64"), (torch.int16, "int16"), (float, "float64"), (bool, "bool")],
)
def test_a_factory_takes_tensord_and_torch_dtypes_and_python_number_types(
    client: Any, name: str, dtype: Any, expected: str
) -> None:
    assert DTYPE_TAKERS[name](client, dtype).dtype == getattr(torch, expected)
    as_torch = getattr(torch, dtype.name) if isinstance(dtype, tensord.DType) else dtype
    assert str(DTYPE_TAKERS[name](torch, as_torch).dtype) == f"torch.{expected}"


@pytest.mark.parametrize("value", [(4,), (2, 3), (), "scalar"])
def test_setitem_with_the_key_false_writes_nothing_and_checks_no_shape(
    client: Any, value: Any
) -> None:
    # torch's setitem returns before any indexing for a bare False: any tensor or number goes
    def make(factory: Callable[..., Any]) -> Any:
        return 7.0 if value == "scalar" else factory(value)

    expected = torch.zeros(2, 3, requires_grad=True)
    expected[False] = make(torch.ones)  # no leaf-in-place error either
    x = client.zeros(2, 3, requires_grad=True)
    x[False] = make(client.ones)
    client.synchronize()
    assert x.tolist() == expected.tolist() == [[0.0] * 3] * 2
    assert_raises_like(
        torch_error(lambda: expected.__setitem__(False, "a")), lambda: x.__setitem__(False, "a")
    )


@pytest.fixture
def eager(server: Any) -> Iterator[Any]:
    """A client without pipelining: a server-side error is raised at its call, in torch's words."""
    with tensord.connect(server.address, pipelining=False) as connected:
        yield connected


NUMPY_AND_PYTHON_SCALARS = [
    np.True_,
    np.int64(3),
    np.int8(-3),
    np.uint8(3),
    np.float16(1.5),
    np.float32(1.5),
    np.float64(1.5),
    np.complex64(1 + 2j),
    np.complex128(1 + 2j),
    True,
    3,
    1.5,
    1 + 2j,
]


def dtype_and_values(make: Callable[[], Any]) -> tuple[str, Any] | str:
    """A result's dtype name and values, or the error's built-in type and text."""
    try:
        result = make()
        values = result.tolist()  # a pipelined write's error surfaces here
    except Exception as error:
        builtin = next(c for c in type(error).__mro__ if c.__module__ == "builtins")
        kind = "RuntimeError" if isinstance(error, RuntimeError) else builtin.__name__
        return f"{kind}: {error}"
    return str(result.dtype).rpartition(".")[2], values


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Casting complex values to real")
@pytest.mark.parametrize("value", NUMPY_AND_PYTHON_SCALARS, ids=repr)
@pytest.mark.parametrize("into", ["int32", "bool", "float16", "complex64"])
def test_a_scalar_argument_is_read_as_torchs_parser_reads_it(
    eager: Any, value: Any, into: str
) -> None:
    # np.True_ and np.float32/np.complex64 are no Python numbers: torch reads them through
    # __float__ (full's dtype float32, an np.complex64's imaginary part dropped)
    def full(m: Any, dt: Any) -> Any:
        return m.full((2,), value)

    def full_like(m: Any, dt: Any) -> Any:
        return m.full_like(m.zeros(2, dtype=getattr(dt, into)), value)

    def fill(m: Any, dt: Any) -> Any:
        return m.zeros(2, dtype=getattr(dt, into)).fill_(value)

    def tensor(m: Any, dt: Any) -> Any:
        return m.tensor(value)

    for make in (full, full_like, fill, tensor):
        expected = dtype_and_values(functools.partial(make, torch, torch))
        assert dtype_and_values(functools.partial(make, eager, tensord)) == expected, make.__name__


@pytest.mark.parametrize("value", [np.uint64(2**63), np.uint64(2**64 - 1)])
def test_a_numpy_integer_past_int64_is_refused_as_torchs_parser_refuses_it(
    eager: Any, value: Any
) -> None:
    expected = torch_error(lambda: torch.full((2,), value))
    assert_raises_like(expected, lambda: eager.full((2,), value))
    assert_raises_like(expected, lambda: eager.zeros(2).fill_(value))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bool", "complex64", "complex128", "uint16"])
@pytest.mark.parametrize("bounds", [(5,), (0, 5, 0), (5, 0), (0.0, float("inf"))])
def test_arange_of_a_dtype_with_no_kernel_raises_torchs_not_implemented_error(
    client: Any, dtype: str, bounds: tuple[Any, ...]
) -> None:
    # the dtype's kernel is looked for before any bound is checked
    expected = torch_error(lambda: torch.arange(*bounds, dtype=getattr(torch, dtype)))
    assert isinstance(expected, NotImplementedError)
    assert_raises_like(expected, lambda: client.arange(*bounds, dtype=getattr(tensord, dtype)))


TO_ARGUMENTS: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
    (("float32",), {}),
    ((np.float32,), {}),
    ((np.dtype("float32"),), {}),
    (([1],), {}),
    ((object(),), {}),
    (("cud",), {}),
    (("CPU",), {}),
    (("cuda:x",), {}),
    (("cuda:01",), {}),
    (("cuda:1:2",), {}),
    ((" cpu",), {}),
    (("",), {}),
    (("cuda:99999999999",), {}),
    ((-1,), {}),
    (("cpu", "float32"), {}),
    (("cpu", np.float32), {}),
    (("cpu", 1), {}),
    ((None, None, "x"), {}),
    (("cpu", None, True, False, 5), {}),
    ((), {"dtype": "float32"}),
    ((), {"dtype": np.float32}),
    ((), {"device": "float32"}),
    ((), {"device": 1.5}),
    (("float64",), {"copy": "x"}),
    (("float64",), {"foo": 1}),
]


@pytest.mark.slow
@pytest.mark.parametrize(("args", "kwargs"), TO_ARGUMENTS, ids=repr)
def test_to_refuses_a_bad_argument_as_torch(
    client: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    def torch_form(value: Any) -> Any:
        return torch.float64 if value == "float64" else value

    expected = torch_error(lambda: torch.zeros(2).to(*map(torch_form, args), **kwargs))
    dtype_form = [tensord.float64 if a == "float64" else a for a in args]
    assert_raises_like(expected, lambda: client.zeros(2).to(*dtype_form, **kwargs))


@pytest.mark.parametrize("device", ["meta", "xla", "cuda:7", 7])
def test_to_a_well_formed_device_the_server_lacks_stays_a_failed_precondition(
    client: Any, device: Any
) -> None:
    with pytest.raises(tensord.FailedPreconditionError):
        client.zeros(2).to(device)


@pytest.mark.parametrize("device", ["float32", "cuda:x", "", -1])
def test_a_factory_refuses_a_malformed_device_as_torch(client: Any, device: Any) -> None:
    expected = torch_error(lambda: torch.zeros(2, device=device))
    assert_raises_like(expected, lambda: client.zeros(2, device=device))
