"""Torch's wider view surface through the SDK, end to end, against torch 2.13.

Every result is compared with torch's on shape, stride, storage offset, dtype,
values, requires_grad and whether it shares the input's Storage (view or copy);
every error on type and text.
"""

from __future__ import annotations

import json
import subprocess
import sys
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
pytestmark = pytest.mark.torch

HYPOTHESIS = settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def same_storage(a: tensord.Tensor, b: tensord.Tensor) -> bool:
    return a.untyped_storage().storage_id == b.untyped_storage().storage_id


def assert_same(x: tensord.Tensor, t: Any) -> None:
    assert tuple(x.shape) == tuple(t.shape)
    assert x.stride() == t.stride()
    assert x.storage_offset() == t.storage_offset()
    assert x.dtype == dtypes.from_torch(t.dtype)
    assert x.requires_grad == t.requires_grad
    np.testing.assert_array_equal(x.detach().numpy(), t.detach().numpy())


def assert_same_result(x: tensord.Tensor, t: Any, ours: Any, theirs: Any) -> None:
    """Results (one or a tuple) alike, and each a view of x exactly when torch's is of t."""
    if isinstance(theirs, tuple):
        assert isinstance(ours, tuple) and len(ours) == len(theirs)
    else:
        ours, theirs = (ours,), (theirs,)
    for o, th in zip(ours, theirs, strict=True):
        assert_same(o, th)
        shares = th.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
        assert same_storage(o, x) == shares


def both(x: tensord.Tensor, t: Any, op: Callable[[Any], Any]) -> Any:
    """Apply op to both: same result, or the same exception type and text."""
    try:
        theirs = op(t)
    except Exception as expected:
        with pytest.raises(type(expected)) as got:
            op(x)
        assert isinstance(got.value, tensord.TensordError)
        assert str(got.value) == str(expected).split("\nException raised from")[0]
        return None
    ours = op(x)
    assert_same_result(x, t, ours, theirs)
    return ours


def strided_pair(client: tensord.Client, data: st.DataObject) -> tuple[tensord.Tensor, Any]:
    """The same random strided tensor (size-0/1 dims, random strides) on both sides."""
    ndim = data.draw(st.integers(0, 4))
    shape = data.draw(st.lists(st.sampled_from((0, 1, 1, 2, 3, 4)), min_size=ndim, max_size=ndim))
    stride = data.draw(st.lists(st.integers(0, 6), min_size=ndim, max_size=ndim))
    offset = data.draw(st.integers(0, 3))
    extent = offset + sum((n - 1) * s for n, s in zip(shape, stride, strict=True) if n) + 1
    base_t = torch.arange(extent, dtype=torch.float32)
    base_x = client.arange(extent, dtype=tensord.float32)
    return base_x.as_strided(shape, stride, offset), base_t.as_strided(shape, stride, offset)


def dim(data: st.DataObject, ndim: int) -> int:
    return data.draw(st.integers(-max(ndim, 1) - 1, max(ndim, 1)))


# ---- 1. splitting ------------------------------------------------------------------------


@pytest.mark.slow
@HYPOTHESIS
@given(data=st.data())
def test_splits_match_torch(client: tensord.Client, data: st.DataObject) -> None:
    x, t = strided_pair(client, data)
    d = dim(data, t.ndim)
    sections = data.draw(st.integers(-1, 5))
    indices = data.draw(st.lists(st.integers(-5, 6), max_size=4))
    both(x, t, lambda a: a.tensor_split(sections, d))
    both(x, t, lambda a: a.tensor_split(indices, d))
    both(
        x,
        t,
        lambda a: (
            tensord.tensor_split(a, indices, d) if a is x else torch.tensor_split(a, indices, d)
        ),
    )
    for name in ("hsplit", "vsplit", "dsplit"):
        both(x, t, lambda a, n=name: getattr(a, n)(sections))
        both(x, t, lambda a, n=name: getattr(a, n)(indices))


def test_tensor_split_takes_a_long_tensor(client: tensord.Client) -> None:
    x, t = client.arange(10).view(2, 5), torch.arange(10).view(2, 5)
    for indices in ([1, 3], [4, 1, 9], [], 3):
        ours = x.tensor_split(client.tensor(indices, dtype=tensord.int64), 1)
        theirs = t.tensor_split(torch.tensor(indices, dtype=torch.int64), 1)
        assert_same_result(x, t, ours, theirs)
        # a torch tensor of indices works too, as code ported from torch passes one
        ours = x.tensor_split(torch.tensor(indices, dtype=torch.int64), 1)
        assert_same_result(x, t, ours, theirs)
    both(x, t, lambda a: a.tensor_split((client if a is x else torch).tensor([1.0])))
    both(x, t, lambda a: a.tensor_split((client if a is x else torch).tensor([[1]])))
    both(x, t, lambda a: a.tensor_split((client if a is x else torch).tensor(0)))


# ---- 2. shape ----------------------------------------------------------------------------


@pytest.mark.slow
@HYPOTHESIS
@given(data=st.data())
def test_shape_ops_match_torch(client: tensord.Client, data: st.DataObject) -> None:
    x, t = strided_pair(client, data)
    d = dim(data, t.ndim)
    size, step = data.draw(st.integers(-1, 4)), data.draw(st.integers(-1, 3))
    both(x, t, lambda a: a.unfold(d, size, step))
    both(x, t, lambda a: a.ravel())
    target = data.draw(st.lists(st.sampled_from((-1, 1, 2, 3)), max_size=5))
    both(x, t, lambda a: a.broadcast_to(target))
    shape = tuple(t.shape)
    other_x, other_t = client.empty((2, *shape)), torch.empty((2, *shape))
    both(x, t, lambda a: a.expand_as(other_x if a is x else other_t))
    flat_x, flat_t = client.empty(t.numel()), torch.empty(t.numel())
    both(x, t, lambda a: a.view_as(flat_x if a is x else flat_t))
    both(x, t, lambda a: a.reshape_as(flat_x if a is x else flat_t))
    for name in ("atleast_1d", "atleast_2d", "atleast_3d"):
        ours, theirs = getattr(tensord, name)(x), getattr(torch, name)(t)
        assert_same_result(x, t, ours, theirs)
        assert (ours is x) == (theirs is t)
        assert_same_result(x, t, getattr(tensord, name)(x, x), getattr(torch, name)(t, t))
        assert_same_result(x, t, getattr(tensord, name)([x]), getattr(torch, name)([t]))


def test_module_forms_match_torch(client: tensord.Client) -> None:
    x, t = client.arange(24).view(2, 3, 4), torch.arange(24).view(2, 3, 4)
    calls: list[tuple[str, tuple[Any, ...]]] = [
        ("narrow", (1, 1, 2)), ("select", (2, -1)), ("transpose", (0, 2)),
        ("swapdims", (0, 1)), ("swapaxes", (1, 2)), ("permute", ((2, 0, 1),)),
        ("movedim", (0, -1)), ("moveaxis", ((0, 1), (2, 0))), ("reshape", ((4, 6),)),
        ("flatten", (1,)), ("unflatten", (2, (2, 2))), ("ravel", ()), ("squeeze", ()),
        ("unsqueeze", (1,)), ("split", (2, 2)), ("chunk", (2, 1)), ("unbind", (1,)),
        ("tensor_split", (3, 2)), ("hsplit", (3,)), ("vsplit", ([1],)), ("dsplit", (2,)),
        ("diagonal", (0, 1, 2)), ("as_strided", ((2, 2), (1, 2), 1)),
        ("broadcast_to", ((2, 2, 3, 4),)), ("detach", ()), ("adjoint", ()),
    ]  # fmt: skip
    for name, args in calls:
        assert_same_result(x, t, getattr(tensord, name)(x, *args), getattr(torch, name)(t, *args))
    m_x, m_t = client.arange(6).view(2, 3), torch.arange(6).view(2, 3)
    assert_same_result(m_x, m_t, tensord.t(m_x), torch.t(m_t))


def test_broadcast_tensors_and_shapes_match_torch(client: tensord.Client) -> None:
    a_x, a_t = client.arange(3).view(3, 1), torch.arange(3).view(3, 1)
    b_x, b_t = client.arange(4), torch.arange(4)
    ours, theirs = tensord.broadcast_tensors(a_x, b_x), torch.broadcast_tensors(a_t, b_t)
    assert_same_result(a_x, a_t, ours[0], theirs[0])
    assert_same_result(b_x, b_t, ours[1], theirs[1])
    c_x, c_t = client.zeros(3, 4), torch.zeros(3, 4)
    assert tensord.broadcast_tensors(c_x, b_x)[0] is c_x  # already that shape: itself
    assert torch.broadcast_tensors(c_t, b_t)[0] is c_t
    with pytest.raises(RuntimeError) as expected:
        torch.broadcast_tensors(torch.zeros(3), torch.zeros(4))
    with pytest.raises(tensord.TensordRuntimeError) as got:
        tensord.broadcast_tensors(client.zeros(3), client.zeros(4))
    assert str(got.value) == str(expected.value)
    for shapes in [((2, 1), (3,)), (4, (1, 4)), ((), (2,)), ((0,), (1,))]:
        assert tensord.broadcast_shapes(*shapes) == torch.broadcast_shapes(*shapes)
    with pytest.raises(RuntimeError) as expected:
        torch.broadcast_shapes((2,), (3,))
    with pytest.raises(RuntimeError) as got:
        tensord.broadcast_shapes((2,), (3,))
    assert str(got.value) == str(expected.value)


# ---- 3. aliases and matrix views ---------------------------------------------------------


@HYPOTHESIS
@given(data=st.data())
def test_matrix_views_match_torch(client: tensord.Client, data: st.DataObject) -> None:
    x, t = strided_pair(client, data)
    a, b = dim(data, t.ndim), dim(data, t.ndim)
    both(x, t, lambda v: v.swapdims(a, b))
    both(x, t, lambda v: v.swapaxes(a, b))
    both(x, t, lambda v: v.moveaxis(a, b))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for name in ("T", "mT", "mH", "H"):
            ours = both(x, t, lambda v, n=name: getattr(v, n))
            if ours is not None:
                assert (ours is x) == (getattr(t, name) is t)
        both(x, t, lambda v: v.adjoint())


WARNING_CASES = [((2, 3, 4), "T"), ((), "T"), ((), "mT"), ((), "mH"), ((), "H")]


def torch_warnings_in_a_fresh_process() -> list[list[str]]:
    """torch's warnings for WARNING_CASES, each accessed twice (torch warns once per process,
    so they are read where nothing used them up)."""
    script = (
        "import json, warnings, torch\n"
        f"cases = {WARNING_CASES!r}\n"
        "out = []\n"
        "for shape, attr in cases:\n"
        "    with warnings.catch_warnings(record=True) as w:\n"
        "        warnings.simplefilter('always')\n"
        "        getattr(torch.zeros(shape), attr); getattr(torch.zeros(shape), attr)\n"
        "    out.append([str(m.message).split(' (Triggered internally')[0] for m in w])\n"
        "print(json.dumps(out))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    result: list[list[str]] = json.loads(done.stdout)
    return result


@pytest.mark.slow
def test_T_and_friends_warn_once_as_torch(client: tensord.Client) -> None:
    from tensord import _args

    expected = torch_warnings_in_a_fresh_process()
    _args._WARNED.clear()
    for (shape, attr), theirs in zip(WARNING_CASES, expected, strict=True):
        x = client.zeros(shape)
        with warnings.catch_warnings(record=True) as ours:
            warnings.simplefilter("always")
            getattr(x, attr)
            getattr(x, attr)
        assert [str(w.message) for w in ours] == theirs
        assert len(theirs) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        client.zeros(2, 3).T  # noqa: B018  # a matrix: no warning


def test_conjugating_views_of_complex_tensors_are_conjugate_transposes(
    client: tensord.Client,
) -> None:
    x = client.zeros(2, 2, dtype=tensord.complex64)
    assert not x.mT.is_conj()  # no conjugate in mT
    for op in (lambda v: v.mH, lambda v: v.H, lambda v: v.adjoint()):
        assert op(x).is_conj()  # torch's lazy conjugate (tests/parity/test_complex_views.py)


# ---- 4. in-place view ops ----------------------------------------------------------------


IN_PLACE: list[tuple[str, tuple[Any, ...]]] = [
    ("t_", ()), ("transpose_", (0, 2)), ("swapdims_", (1, 2)), ("swapaxes_", (0, 1)),
    ("squeeze_", ()), ("squeeze_", (1,)), ("unsqueeze_", (3,)), ("unsqueeze_", (-1,)),
    ("as_strided_", ((2, 3), (1, 2), 1)), ("transpose_", (0, 5)),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(("name", "args"), IN_PLACE)
def test_in_place_view_ops_change_only_the_handle_itself(
    client: tensord.Client, name: str, args: tuple[Any, ...]
) -> None:
    shape = (2, 1, 3) if name != "t_" else (2, 3)
    t = torch.arange(6).view(shape)
    x = client.arange(6).view(shape)
    other_t, other_x = t.view(shape), x.view(shape)
    try:
        returned_t = getattr(t, name)(*args)
    except Exception as expected:
        with pytest.raises(type(expected)) as got:
            getattr(x, name)(*args)
        assert str(got.value) == str(expected)
        assert_same(x, t)  # unchanged
        return
    old_handle = x.handle
    assert getattr(x, name)(*args) is x and returned_t is t
    assert_same(x, t)
    assert_same(other_x, other_t)  # other handles on the Storage keep their layout
    assert same_storage(x, other_x)
    assert x.handle != old_handle
    x.zero_()  # writes through the new handle reach the same bytes
    np.testing.assert_array_equal(other_x.numpy(), np.zeros(shape, dtype=np.int64))


# ---- 5. the listed differences -----------------------------------------------------------


def test_view_dtype_drops_requires_grad(client: tensord.Client) -> None:
    x = client.zeros(2, 4, requires_grad=True)
    t = torch.zeros(2, 4, requires_grad=True)
    for dtype in (tensord.int32, tensord.float32, tensord.float16, tensord.float64):
        assert x.view(dtype).requires_grad == t.view(dtypes.to_torch(dtype)).requires_grad
        assert not x.view(dtype).requires_grad


def test_flatten_of_one_dim_returns_self(client: tensord.Client) -> None:
    x, t = client.zeros(2, 3), torch.zeros(2, 3)
    for a, b in [(1, 1), (0, 0), (-1, 1)]:
        assert (x.flatten(a, b) is x) == (t.flatten(a, b) is t)
    y, u = client.zeros(4), torch.zeros(4)
    assert (y.flatten() is y) == (u.flatten() is u) is True
    z, w = client.zeros(()), torch.zeros(())
    assert (z.flatten() is z) == (w.flatten() is w)


def test_narrow_takes_a_zero_dim_integer_tensor_start(client: tensord.Client) -> None:
    x, t = client.arange(12).view(3, 4), torch.arange(12).view(3, 4)
    for start in (0, 1, -2):
        assert_same_result(
            x, t, x.narrow(1, client.tensor(start), 2), t.narrow(1, torch.tensor(start), 2)
        )
        assert_same_result(
            x,
            t,
            tensord.narrow(x, 0, torch.tensor(start), 1),
            torch.narrow(t, 0, torch.tensor(start), 1),
        )
    for bad in ([0], 0.0, True):
        both(x, t, lambda a, v=bad: a.narrow(0, (client if a is x else torch).tensor(v), 1))


def test_indexing_differences_match_torch(client: tensord.Client) -> None:
    x, t = client.arange(12).view(3, 4), torch.arange(12).view(3, 4)

    def tensor_like(a: Any, value: Any, dtype: Any = None) -> Any:
        if a is x:
            return client.tensor(value, dtype=dtype)
        return torch.tensor(value, dtype=None if dtype is None else dtypes.to_torch(dtype))

    both(x, t, lambda a: a[0.0])
    both(x, t, lambda a: a[0, 0.5])
    both(x, t, lambda a: a[(None, 1.5)])
    both(x, t, lambda a: a[tensor_like(a, 1)])
    both(x, t, lambda a: a[tensor_like(a, 2, tensord.int8), tensor_like(a, -1)])
    both(x, t, lambda a: a[tensor_like(a, 5)])
    both(x, t, lambda a: a[tensor_like(a, 0.5)])
    both(x, t, lambda a: a[tensor_like(a, 0) : tensor_like(a, 2)])
    both(x, t, lambda a: a[:, tensor_like(a, 1) :: tensor_like(a, 2)])
    both(x, t, lambda a: a[tensor_like(a, 0.5) :])
    with pytest.raises(TypeError) as expected:
        del t[0]
    with pytest.raises(tensord.TensordTypeError) as got:
        del x[0]
    assert str(got.value) == str(expected.value)
    # the index also works for writes, as basic indexing
    x[client.tensor(1)] = 7
    t[torch.tensor(1)] = 7
    assert x.tolist() == t.tolist()


def test_unflatten_dim_must_be_an_int(client: tensord.Client) -> None:
    x, t = client.zeros(2, 4), torch.zeros(2, 4)
    both(x, t, lambda a: a.unflatten("A", (2, 2)))
    both(x, t, lambda a: a.unflatten(1.0, (2, 2)))


# ---- 6. Python types as dtypes -------------------------------------------------------------


@pytest.mark.parametrize("py_type", [float, int, bool, complex])
def test_python_types_are_dtypes_as_in_torch(client: tensord.Client, py_type: type) -> None:
    expected = dtypes.from_torch(torch.zeros(2, dtype=py_type).dtype)
    assert client.zeros(2, dtype=py_type).dtype == expected
    assert client.empty(2, 2, dtype=py_type).dtype == expected
    assert client.tensor([1, 0], dtype=py_type).dtype == expected
    assert client.zeros(2).to(py_type).dtype == dtypes.from_torch(torch.zeros(2).to(py_type).dtype)
    t = torch.zeros(2, 4, dtype=torch.float64)
    x = client.zeros(2, 4, dtype=tensord.float64)
    both(x, t, lambda a: a.view(py_type))
