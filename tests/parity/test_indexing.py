"""Advanced indexing against torch 2.13 as the oracle.

``x[key]`` and ``x[key] = v`` with integer tensors, lists, masks and Python bools,
mixed with ints, slices, None and Ellipsis (random keys on random strided tensors,
size-0 dims included), ``index_select``, ``masked_select``, ``masked_fill_`` and
``index_put_``: same values, shape, strides, dtype and requires_grad, a copy never
a view, and every error of the same type with the same text.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import tensord
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensord import dtypes

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.torch, pytest.mark.filterwarnings("ignore::UserWarning")]

HYPOTHESIS = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


class Ours:
    """The tensord side of a case written once for both: the client's factories and
    tensord's dtypes under torch's names (``m.ones(3)``, ``m.int64``)."""

    def __init__(self, client: tensord.Client) -> None:
        self.client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name, None) or getattr(tensord, name)


def same_storage(a: tensord.Tensor, b: tensord.Tensor) -> bool:
    return a.untyped_storage().storage_id == b.untyped_storage().storage_id


def outcome(op: Callable[[], Any]) -> tuple[str, Any]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return "ok", op()
    except Exception as e:  # the oracle's error, compared by type and text
        return "error", e


def assert_same_error(ours: BaseException, theirs: BaseException) -> None:
    assert isinstance(ours, type(theirs)), (ours, theirs)
    assert isinstance(ours, tensord.TensordError)
    assert str(ours) == str(theirs).split("\nException raised from")[0]


def assert_same_tensor(x: tensord.Tensor, t: Any) -> None:
    assert tuple(x.shape) == tuple(t.shape)
    assert x.stride() == t.stride()
    assert x.storage_offset() == t.storage_offset()
    assert x.dtype == dtypes.from_torch(t.dtype)
    assert x.requires_grad == t.requires_grad
    np.testing.assert_array_equal(x.detach().numpy(), t.detach().numpy())


def both(x_op: Callable[[], Any], t_op: Callable[[], Any]) -> tuple[Any, Any] | None:
    """Run torch's op then ours: the same result or the same error."""
    kind, theirs = outcome(t_op)
    if kind == "error":
        with pytest.raises(Exception) as got:
            x_op()
        assert_same_error(got.value, theirs)
        return None
    ours = x_op()
    return ours, theirs


def strided_pair(client: tensord.Client, data: st.DataObject, overlap: bool = True) -> Any:
    """The same random strided float tensor on both sides (size-0/1 dims; stride 0 and
    overlapping strides only when ``overlap``)."""
    ndim = data.draw(st.integers(0, 4))
    shape = data.draw(st.lists(st.sampled_from((0, 1, 2, 3, 4)), min_size=ndim, max_size=ndim))
    if overlap:
        stride = data.draw(st.lists(st.integers(0, 6), min_size=ndim, max_size=ndim))
    else:  # a permuted contiguous layout: every element its own location
        order = data.draw(st.permutations(range(ndim)))
        stride = [0] * ndim
        step = 1
        for d in reversed(order):
            stride[d] = step
            step *= max(shape[d], 1)
    offset = data.draw(st.integers(0, 3))
    extent = offset + sum((n - 1) * s for n, s in zip(shape, stride, strict=True) if n) + 1
    base_t = torch.arange(extent, dtype=torch.float32)
    base_x = client.arange(extent, dtype=tensord.float32)
    return (
        base_x,
        base_t,
        base_x.as_strided(shape, stride, offset),
        base_t.as_strided(shape, stride, offset),
    )


@st.composite
def index_specs(draw: Any, shape: tuple[int, ...]) -> list[tuple[Any, ...]]:
    """A random key: basic items and at least one advanced one, sized mostly to fit."""
    size = max(shape, default=2) or 2
    value = st.integers(-size - 1, size)
    small_shape = st.sampled_from(((), (0,), (1,), (2,), (3,), (1, 2), (2, 1), (2, 2)))
    items: list[tuple[Any, ...]] = []
    dims_left = list(shape)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(
            st.sampled_from(
                ("int", "slice", "none", "ellipsis", "bool", "list", "tensor", "mask", "mask0")
            )
        )
        if kind == "int":
            items.append(("int", draw(value)))
        elif kind == "slice":
            bound = st.none() | value
            items.append(("slice", draw(bound), draw(bound), draw(st.sampled_from((None, 1, 2)))))
        elif kind in ("none", "ellipsis"):
            items.append((kind,))
        elif kind == "bool":
            items.append(("bool", draw(st.booleans())))
        elif kind == "list":
            items.append(("list", draw(st.lists(value, min_size=0, max_size=3))))
        elif kind == "tensor":
            ishape = draw(small_shape)
            values = draw(st.lists(value, min_size=int(np.prod(ishape)), max_size=8))
            dtype = draw(st.sampled_from(("int64", "int64", "int32")))
            items.append(("tensor", ishape, values[: int(np.prod(ishape))], dtype))
        elif kind == "mask":
            k = draw(st.integers(1, 2))
            mshape = tuple(dims_left[:k]) if len(dims_left) >= k else draw(small_shape)
            if draw(st.integers(0, 9)) == 0:
                mshape = draw(small_shape)  # sometimes a mismatch
            n = int(np.prod(mshape))
            bits = draw(st.lists(st.booleans(), min_size=n, max_size=n))
            items.append(("mask", mshape, bits))
            dims_left = dims_left[k:]
            continue
        else:
            items.append(("mask0", draw(st.booleans())))
        if kind in ("int", "slice", "list", "tensor"):
            dims_left = dims_left[1:]
    if not any(i[0] in ("bool", "list", "tensor", "mask", "mask0") for i in items):
        items.append(("list", [0]))
    return items


def make_key(spec: list[tuple[Any, ...]], side: Any) -> tuple[Any, ...]:
    """The key on one side: ``side`` is the tensord client or the torch module."""
    is_torch = side is torch

    def tensor(array: np.ndarray) -> Any:
        return torch.from_numpy(array.copy()) if is_torch else side.tensor(array)

    out: list[Any] = []
    for item in spec:
        kind = item[0]
        if kind == "int":
            out.append(item[1])
        elif kind == "slice":
            out.append(slice(*item[1:]))
        elif kind == "none":
            out.append(None)
        elif kind == "ellipsis":
            out.append(Ellipsis)
        elif kind == "bool":
            out.append(item[1])
        elif kind == "list":
            out.append(list(item[1]))
        elif kind == "tensor":
            _, ishape, values, dtype = item
            out.append(tensor(np.asarray(values, dtype=dtype).reshape(ishape)))
        elif kind == "mask":
            out.append(tensor(np.asarray(item[2], dtype=bool).reshape(item[1])))
        else:
            out.append(tensor(np.asarray(item[1], dtype=bool)))
    return tuple(out)


@pytest.mark.slow
@HYPOTHESIS
@given(data=st.data())
def test_getitem_matches_torch(client: tensord.Client, data: st.DataObject) -> None:
    _, _, x, t = strided_pair(client, data)
    spec = data.draw(index_specs(tuple(t.shape)))
    result = both(lambda: x[make_key(spec, client)], lambda: t[make_key(spec, torch)])
    if result is not None:
        ours, theirs = result
        assert_same_tensor(ours, theirs)
        # a gather is a copy; a 0-dim integer tensor alone selects, a view: as torch's
        assert same_storage(ours, x) == (theirs._base is not None)


@pytest.mark.slow
@HYPOTHESIS
@given(data=st.data())
def test_setitem_matches_torch(client: tensord.Client, data: st.DataObject) -> None:
    base_x, base_t, x, t = strided_pair(client, data, overlap=False)
    spec = data.draw(index_specs(tuple(t.shape)))
    kind, got = outcome(lambda: t.clone()[make_key(spec, torch)])
    result_shape = tuple(got.shape) if kind == "ok" else (2,)
    if data.draw(st.booleans()):
        value: Any = data.draw(st.sampled_from((-1.5, 7, True, 1e100)))
        x_value, t_value = value, value
    else:
        shape = list(result_shape[data.draw(st.integers(0, len(result_shape))) :])
        shape = [1 if data.draw(st.integers(0, 3)) == 0 else n for n in shape]
        shape = [1] * data.draw(st.integers(0, 2)) + shape
        if data.draw(st.integers(0, 9)) == 0:
            shape = [3, 5]  # rarely fits
        dtype = data.draw(st.sampled_from(("float32", "float32", "float32", "int64")))
        array = np.asarray(np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape) + 100)
        x_value, t_value = client.tensor(array), torch.from_numpy(array)

    def ours() -> None:
        x[make_key(spec, client)] = x_value

    def theirs() -> None:
        t[make_key(spec, torch)] = t_value

    both(ours, theirs)
    np.testing.assert_array_equal(base_x.numpy(), base_t.numpy())


KEYS: list[Callable[[Any], Any]] = [
    # adjacent advanced indices stay in place, separated ones go in front
    lambda m: ([0, 1], slice(None), [1, 2]),
    lambda m: (slice(None), [0, 1], [1, 2]),
    lambda m: ([0, 1], 1, [1, 2]),
    lambda m: (1, slice(None), [1, 2]),
    lambda m: ([0], None, [0]),
    lambda m: (slice(None), None, [0, 1]),
    lambda m: (Ellipsis, [0], Ellipsis),
    lambda m: (True, [0]),
    lambda m: (False,),
    lambda m: [True, False],  # a list of bools is a mask
    lambda m: [[0, 1]],  # a list holding a list: a tuple (deprecated, as torch warns)
    lambda m: [0.7, 1.2],  # floats in a list: truncated to int64 as torch does
    lambda m: [],
    lambda m: m.tensor(np.array([[0, 1]])),  # an array key is one index tensor
    lambda m: m.tensor(np.array([1, 0], dtype=np.uint8)),  # uint8: a mask (deprecated)
    lambda m: m.tensor(np.ones((2, 3), dtype=bool)),
    lambda m: (m.tensor(np.ones((2, 3), dtype=bool)), 0),
    lambda m: (0, m.tensor(np.ones(3, dtype=bool))),
    lambda m: (m.tensor(np.ones((2, 2), dtype=bool)),),  # mask shape mismatch
    lambda m: (m.tensor(np.ones((2, 3), dtype=bool)), m.tensor(np.ones((2, 3), dtype=bool))),
    lambda m: ([0, 1], [0, 1, 2], [0]),  # cannot broadcast
    lambda m: (m.tensor(np.array([0.0])),),  # a float index tensor
    lambda m: (m.tensor(np.array(1)),),  # a 0-dim integer tensor selects (a view)
    lambda m: (m.tensor(np.array(True)), 0, [1]),
    lambda m: ([0, 5],),
    lambda m: (slice(None), [0], [9]),
    lambda m: ([3, 0], [9, 0]),
    lambda m: ([0], [0], [0], [0]),
]


@pytest.mark.slow
@pytest.mark.parametrize("key", range(len(KEYS)))
def test_getitem_cases_match_torch(client: tensord.Client, key: int) -> None:
    x, t = client.arange(24.0).view(2, 3, 4), torch.arange(24.0).view(2, 3, 4)
    result = both(lambda: x[KEYS[key](client)], lambda: t[KEYS[key](torch)])
    if result is not None:
        assert_same_tensor(*result)


def test_getitem_keeps_requires_grad_and_bounds_nothing_when_empty(client: tensord.Client) -> None:
    x = client.arange(6.0).view(2, 3).requires_grad_()
    t = torch.arange(6.0).view(2, 3).requires_grad_()
    assert_same_tensor(x[[1, 0]], t[[1, 0]])
    # torch checks an index only when its kernel runs: no elements, no error
    assert_same_tensor(client.zeros(2, 0)[[5]], torch.zeros(2, 0)[[5]])


def test_setitem_errors_and_accepted_values_match_torch(client: tensord.Client) -> None:
    x, t = client.zeros(2, 3, 4), torch.zeros(2, 3, 4)
    cases: list[tuple[Any, Callable[[Any], Any]]] = [
        (([0, 1],), lambda m: m.ones(1, 1, 5)),  # leading 1s dropped, then refused
        (([0, 1],), lambda m: m.ones(1, 1, 3, 4)),
        (([0, 1],), lambda m: m.ones(2, 3, 4, dtype=m.int64)),
        (([0, 7],), lambda m: 1.0),
        (([0],), lambda m: 1e100),
    ]
    for key, value in cases:

        def ours(key: Any = key, value: Any = value) -> None:
            x[key] = value(Ours(client))

        def theirs(key: Any = key, value: Any = value) -> None:
            t[key] = value(torch)

        both(ours, theirs)
        np.testing.assert_array_equal(x.numpy(), t.numpy())


# ---- index_select, masked_select, masked_fill_, index_put_ -----------------------------


@HYPOTHESIS
@given(data=st.data())
def test_index_select_matches_torch(client: tensord.Client, data: st.DataObject) -> None:
    _, _, x, t = strided_pair(client, data)
    dim = data.draw(st.integers(-x.ndim - 1, max(x.ndim, 1)))
    ishape = data.draw(st.sampled_from(((), (0,), (1,), (3,), (2, 2))))
    size = max(t.shape, default=1) or 1
    values = data.draw(
        st.lists(st.integers(-size - 1, size), min_size=int(np.prod(ishape)), max_size=4)
    )
    dtype = data.draw(st.sampled_from(("int64", "int32", "int16")))
    array = np.asarray(values[: int(np.prod(ishape))], dtype=dtype).reshape(ishape)
    result = both(
        lambda: x.index_select(dim, client.tensor(array)),
        lambda: t.index_select(dim, torch.from_numpy(array)),
    )
    if result is not None:
        assert_same_tensor(*result)


@pytest.mark.slow
@HYPOTHESIS
@given(data=st.data())
def test_masked_select_and_fill_match_torch(client: tensord.Client, data: st.DataObject) -> None:
    base_x, base_t, x, t = strided_pair(client, data, overlap=False)
    shape = list(t.shape[data.draw(st.integers(0, t.ndim)) :])
    shape = [1 if data.draw(st.integers(0, 3)) == 0 else n for n in shape]
    shape = [1] * data.draw(st.integers(0, 1)) + shape
    if data.draw(st.integers(0, 7)) == 0:
        shape = [5]
    n = int(np.prod(shape))
    bits = np.asarray(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=bool)
    dtype = data.draw(st.sampled_from((bool, bool, bool, np.uint8, np.float32, np.int64)))
    mask = bits.reshape(shape).astype(dtype)
    x_mask, t_mask = client.tensor(mask), torch.from_numpy(mask)
    result = both(lambda: x.masked_select(x_mask), lambda: t.masked_select(t_mask))
    if result is not None:
        assert_same_tensor(*result)
    value = data.draw(st.sampled_from(("number", "tensor0", "tensor1")))
    x_value: Any = -2.5
    t_value: Any = -2.5
    if value == "tensor0":
        x_value, t_value = client.tensor(3.0), torch.tensor(3.0)
    elif value == "tensor1":
        x_value, t_value = client.tensor([3.0]), torch.tensor([3.0])
    both(lambda: x.masked_fill_(x_mask, x_value), lambda: t.masked_fill_(t_mask, t_value))
    np.testing.assert_array_equal(base_x.numpy(), base_t.numpy())


@pytest.mark.slow
@HYPOTHESIS
@given(data=st.data())
def test_index_put_matches_torch(client: tensord.Client, data: st.DataObject) -> None:
    base_x, base_t, x, t = strided_pair(client, data, overlap=False)
    size = max(t.shape, default=1) or 1
    count = data.draw(st.integers(1, max(t.ndim, 1) + 1))
    ishape = data.draw(st.sampled_from(((), (1,), (3,), (2, 1))))
    arrays = []
    for _ in range(count):
        values = data.draw(
            st.lists(st.integers(-size, size - 1), min_size=int(np.prod(ishape)), max_size=4)
        )
        arrays.append(np.asarray(values[: int(np.prod(ishape))], dtype=np.int64).reshape(ishape))
    accumulate = data.draw(st.booleans())
    kind, got = outcome(lambda: t.clone()[tuple(torch.from_numpy(a) for a in arrays)])
    vshape = tuple(got.shape) if kind == "ok" else (2,)
    vshape = vshape[data.draw(st.integers(0, len(vshape))) :]
    if data.draw(st.integers(0, 5)) == 0:
        vshape = (1, *vshape)  # index_put_ keeps leading 1s (and refuses them)
    array = np.asarray(np.arange(int(np.prod(vshape)), dtype=np.float32).reshape(vshape) + 100)
    both(
        lambda: x.index_put_(
            tuple(client.tensor(a) for a in arrays), client.tensor(array), accumulate
        ),
        lambda: t.index_put_(
            tuple(torch.from_numpy(a) for a in arrays), torch.from_numpy(array), accumulate
        ),
    )
    np.testing.assert_array_equal(base_x.numpy(), base_t.numpy())


def test_index_ops_errors_match_torch(client: tensord.Client) -> None:
    x, t = client.arange(24.0).view(2, 3, 4), torch.arange(24.0).view(2, 3, 4)
    cases: list[Callable[[Any, Any], Any]] = [
        lambda m, y: y.index_select(0, m.tensor([5])),
        lambda m, y: y.index_select(0, m.tensor([[0]])),
        lambda m, y: y.index_select(0, m.tensor([0.0])),
        lambda m, y: y.index_select(5, m.tensor([0])),
        lambda m, y: m.tensor(5.0).index_select(0, m.tensor([0, 0])),
        lambda m, y: m.tensor(5.0).index_select(0, m.tensor([-1])),
        lambda m, y: m.tensor(5.0).index_select(0, m.tensor([1])),
        lambda m, y: y.masked_select(m.ones(4)),
        lambda m, y: m.zeros(3).masked_select(m.ones(5, dtype=m.bool)),
        lambda m, y: m.zeros(3).masked_fill_(m.ones(2, 3, dtype=m.bool), 1),
        lambda m, y: y.masked_fill_(m.ones(4, dtype=m.uint8), 1),
        lambda m, y: y.masked_fill_(m.ones(4, dtype=m.int64), 1),
        lambda m, y: y.masked_fill_(m.ones(4, dtype=m.float64), 1),
        lambda m, y: y.masked_fill_(m.ones(4, dtype=m.bool), m.ones(1)),
        lambda m, y: m.zeros(3, dtype=m.uint8).masked_fill_(m.ones(3, dtype=m.bool), 300),
        lambda m, y: y.index_put_((m.tensor([0]),), m.ones(3, 4, dtype=m.int64)),
        lambda m, y: y.index_put_((m.tensor([0]), None), m.ones(4)),
        lambda m, y: y.index_put_((m.tensor([0]),) * 4, m.ones(())),
    ]
    for case in cases:
        result = both(lambda case=case: case(Ours(client), x), lambda case=case: case(torch, t))
        if result is not None:
            assert_same_tensor(*result)
        np.testing.assert_array_equal(x.numpy(), t.numpy())


def test_index_tensors_and_results_are_bounded_by_max_op_elements(make_server) -> None:
    server = make_server(max_op_elements=1000)
    with tensord.connect(server.address) as client:
        x = client.zeros(10)
        with pytest.raises(tensord.errors.ResourceExhaustedError, match="max-op-elements"):
            x[client.zeros(2000, dtype=tensord.int64)]  # the index tensor itself
        with pytest.raises(tensord.errors.ResourceExhaustedError, match="max-op-elements"):
            client.zeros(10, 10)[  # the broadcast of two small index tensors
                client.zeros(40, 1, dtype=tensord.int64), client.zeros(40, dtype=tensord.int64)
            ]
        with pytest.raises(tensord.errors.ResourceExhaustedError, match="max-op-elements"):
            client.zeros(2, 600)[[0, 1]]  # 1200 result elements
        with pytest.raises(tensord.errors.ResourceExhaustedError, match="max-op-elements"):
            client.zeros(2, 600)[[0, 1]] = 1.0
        assert x[client.zeros(1000, dtype=tensord.int64)].shape == (1000,)


# ---- values torch refuses in x[key] = v; index_put_ with only 0-dim masks -------------

REFUSED_VALUES: list[Callable[[], Any]] = [
    lambda: [1.0, 2.0, 3.0, 4.0],
    lambda: (1.0, 2.0, 3.0, 4.0),
    lambda: np.arange(4.0),
    lambda: np.array(1.0),  # a 0-dim array is an array too
    lambda: np.float32(1.0),  # only float64 is a Python float
    lambda: np.bool_(True),
    lambda: "a",
    lambda: None,
]


@pytest.mark.slow
@pytest.mark.parametrize("value", range(len(REFUSED_VALUES)))
@pytest.mark.parametrize("key", [(slice(None), 1), [0, 1], False, 7])
def test_setitem_refuses_what_torch_refuses_before_reading_the_key(
    client: tensord.Client, value: int, key: Any
) -> None:
    x, t = client.zeros(2, 4), torch.zeros(2, 4)

    def ours() -> None:
        x[key] = REFUSED_VALUES[value]()

    def theirs() -> None:
        t[key] = REFUSED_VALUES[value]()

    both(ours, theirs)
    np.testing.assert_array_equal(x.numpy(), t.numpy())  # nothing written


def test_setitem_refusal_names_the_tensor_type_as_torch(client: tensord.Client) -> None:
    for dtype in ("int64", "uint8", "float16", "bfloat16", "complex128", "bool"):
        x = client.zeros(2, dtype=getattr(tensord, dtype))
        t = torch.zeros(2, dtype=getattr(torch, dtype))

        def ours(x: Any = x) -> None:
            x[0] = [1]

        def theirs(t: Any = t) -> None:
            t[0] = [1]

        both(ours, theirs)


@pytest.mark.parametrize("value", [np.int32(3), np.uint64(2), np.float64(1.5), np.complex128(2)])
def test_setitem_takes_the_numbers_torch_takes(client: tensord.Client, value: Any) -> None:
    x, t = client.zeros(2, 4, dtype=tensord.complex64), torch.zeros(2, 4, dtype=torch.complex64)
    x[0] = value
    t[0] = value
    np.testing.assert_array_equal(x.numpy(), t.numpy())


ZERO_DIM_MASK_CASES: list[Callable[[Any, Any, Any], Any]] = [
    lambda m, y, b: y.index_put_((b,), m.tensor(9.0)),
    lambda m, y, b: y.index_put_((b,), m.tensor([9.0])),  # one element: masked_fill_
    lambda m, y, b: y.index_put_((b,), m.tensor(9)),  # masked_fill_ casts any dtype
    lambda m, y, b: y.index_put_((b.to(m.uint8),), m.tensor(1.0)),
    lambda m, y, b: y.index_put_((b, b), m.tensor(9.0)),  # two masks: no masked_fill_
    lambda m, y, b: y.index_put_((b,), m.tensor([1.0, 2.0, 3.0])),
    lambda m, y, b: y.index_put_((b,), m.ones(2, 3)),
    lambda m, y, b: y.index_put_((b,), m.ones(1, 2, 3)),
    lambda m, y, b: y.index_put_((b,), m.tensor([1.0, 2.0])),
    lambda m, y, b: y.index_put_((b,), m.tensor([1, 2, 3])),
    lambda m, y, b: y.index_put_((b,), m.tensor(1.0), True),
    lambda m, y, b: y.index_put_((b,), m.tensor([1.0, 2.0]), True),
    lambda m, y, b: y.index_put_((b, m.tensor([True, False, True])), m.tensor(1.0)),
    lambda m, y, b: y.index_put_((b, b, b), m.tensor(1.0)),
    lambda m, y, b: m.tensor(5.0).index_put_((b,), m.tensor(1.0)),
    lambda m, y, b: m.zeros(0, 3).index_put_((b,), m.tensor([1.0, 2.0, 3.0])),
    lambda m, y, b: m.zeros(0, 3).index_put_((b,), m.tensor(1.0), True),
    lambda m, y, b: m.zeros(4).index_put_((b,), m.tensor(2.0)),
    lambda m, y, b: m.zeros(3, dtype=m.uint8).index_put_((b,), m.tensor(300)),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(ZERO_DIM_MASK_CASES)))
@pytest.mark.parametrize("truth", [True, False])
def test_index_put_with_only_zero_dim_masks_matches_torch(
    client: tensord.Client, case: int, truth: bool
) -> None:
    x, t = client.arange(6.0).view(2, 3), torch.arange(6.0).view(2, 3)
    result = both(
        lambda: ZERO_DIM_MASK_CASES[case](Ours(client), x, client.tensor(truth)),
        lambda: ZERO_DIM_MASK_CASES[case](torch, t, torch.tensor(truth)),
    )
    if result is not None:
        assert_same_tensor(*result)
    np.testing.assert_array_equal(x.numpy(), t.numpy())


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "float64", "int64", "complex64", "bool"])
@pytest.mark.parametrize("grad", [True, False])
def test_masked_fill_value_that_requires_grad_makes_x_require_grad(
    client: tensord.Client, dtype: str, grad: bool
) -> None:
    x = client.zeros(3, dtype=getattr(tensord, dtype))
    t = torch.zeros(3, dtype=getattr(torch, dtype))
    value_x = client.tensor(2.0).requires_grad_(grad)
    value_t = torch.tensor(2.0).requires_grad_(grad)
    assert x.masked_fill_(client.tensor([True, False, True]), value_x) is x
    t.masked_fill_(torch.tensor([True, False, True]), value_t)
    assert x.requires_grad == t.requires_grad == grad
    np.testing.assert_array_equal(x.detach().numpy(), t.detach().numpy())
    assert not client.tensor([True]).requires_grad  # the mask and others unchanged


def test_index_put_and_setitem_values_that_require_grad_make_x_require_grad(
    client: tensord.Client,
) -> None:
    for op in (
        lambda m, y, v: y.index_put_((m.tensor([0, 2]),), v),
        lambda m, y, v: y.__setitem__(m.tensor([True, False, True]), v),
        lambda m, y, v: y.__setitem__([0, 2], v),
    ):
        x, t = client.zeros(3), torch.zeros(3)
        op(client, x, client.ones(2).requires_grad_())
        op(torch, t, torch.ones(2).requires_grad_())
        assert x.requires_grad == t.requires_grad is True
        np.testing.assert_array_equal(x.detach().numpy(), t.detach().numpy())


BASIC_WRITES_OF_A_GRAD_VALUE = {
    "copy_": lambda y, v: y.copy_(v),
    "x[0:2] = v[:2]": lambda y, v: y.__setitem__(slice(0, 2), v[:2]),
    "x[1] = v[0]": lambda y, v: y.__setitem__(1, v[0]),
    "x[...] = v": lambda y, v: y.__setitem__(Ellipsis, v),
    "fill_(v[0])": lambda y, v: y.fill_(v[0]),
}


@pytest.mark.slow
@pytest.mark.parametrize("pipelining", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "float16", "complex64", "int64", "bool"])
@pytest.mark.parametrize("case", list(BASIC_WRITES_OF_A_GRAD_VALUE))
def test_basic_writes_of_a_value_that_requires_grad_flag_x_as_torch(
    server: Any, pipelining: bool, dtype: str, case: str
) -> None:
    """copy_ and basic setitem flag x only in a dtype that carries gradients, fill_ in any
    (torch 2.13's autograd); the flag is the server's too (a fresh handle reads it)."""
    op = BASIC_WRITES_OF_A_GRAD_VALUE[case]
    with tensord.connect(server.address, pipelining=pipelining) as client:
        x = client.zeros(3, dtype=getattr(tensord, dtype))
        t = torch.zeros(3, dtype=getattr(torch, dtype))
        op(x, client.ones(3).requires_grad_())
        op(t, torch.ones(3).requires_grad_())
        assert x.requires_grad == t.requires_grad
        client.synchronize()
        session = server.daemon.sessions.peek(client.session_id)
        assert server.daemon.sessions.lookup(session, x.handle).requires_grad == t.requires_grad
        np.testing.assert_array_equal(x.detach().numpy(), t.detach().numpy())
        op(x, client.ones(3))  # a value without grad changes nothing either way
        assert x.requires_grad == t.requires_grad
