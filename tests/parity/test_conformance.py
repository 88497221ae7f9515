"""A torch tutorial on tensor storage, run through tensord and through torch side by side.

Every step compares shape, stride, storage offset, dtype, contiguity, values and
``data_ptr`` relations with torch's, and every error with torch's exception type
and text, word for word.
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
pytestmark = pytest.mark.torch


def assert_same(x: tensord.Tensor, t: torch.Tensor) -> None:
    """The handle describes the same tensor as torch's, values included."""
    assert tuple(x.shape) == tuple(t.shape)
    assert x.stride() == t.stride()
    assert x.storage_offset() == t.storage_offset()
    assert x.dtype == dtypes.from_torch(t.dtype)
    assert x.is_contiguous() == t.is_contiguous()
    assert x.numel() == t.numel() and x.dim() == t.dim() and x.nbytes == t.nbytes
    assert x.element_size() == t.element_size()
    np.testing.assert_array_equal(x.numpy(), t.numpy())


def same_storage(a: tensord.Tensor, b: tensord.Tensor) -> bool:
    return a.untyped_storage().storage_id == b.untyped_storage().storage_id


def assert_same_error(ours: Callable[[], Any], theirs: Callable[[], Any]) -> None:
    """Both raise; ours is a TensordError of torch's type, with torch's text."""
    with pytest.raises(Exception) as expected:
        theirs()
    with pytest.raises(type(expected.value)) as got:
        ours()
    assert isinstance(got.value, tensord.TensordError)
    assert str(got.value) == str(expected.value)


def test_arange_view(client: tensord.Client) -> None:
    x = client.arange(12).view(3, 4)
    t = torch.arange(12).view(3, 4)
    assert_same(x, t)
    assert x.shape == (3, 4) and repr(x.shape) == "tensord.Size([3, 4])"
    assert x.size(1) == 4 and x.size(-2) == 3 and x.stride(0) == 4
    assert repr(x) == repr(t)
    assert x.tolist() == t.tolist()
    assert x[1, 2].item() == 6 and len(x) == 3


def test_narrow_offsets_add_up_as_in_torch(client: tensord.Client) -> None:
    x, t = client.arange(12).view(3, 4), torch.arange(12).view(3, 4)
    rows, trows = x.narrow(0, 1, 2), t.narrow(0, 1, 2)
    cols, tcols = x.narrow(1, 1, 2), t.narrow(1, 1, 2)
    assert_same(rows, trows)
    assert_same(cols, tcols)
    assert same_storage(rows, x) and same_storage(cols, x)
    assert rows.data_ptr() == x.data_ptr() + 1 * x.stride(0) * x.element_size()
    assert cols.data_ptr() - x.data_ptr() == tcols.data_ptr() - t.data_ptr()
    inner, tinner = cols.narrow(0, 2, 1), tcols.narrow(0, 2, 1)
    assert_same(inner, tinner)
    assert inner.data_ptr() - x.data_ptr() == tinner.data_ptr() - t.data_ptr()


def test_t_shares_storage_and_address(client: tensord.Client) -> None:
    x, t = client.arange(12).view(3, 4), torch.arange(12).view(3, 4)
    y, ty = x.t(), t.t()
    assert_same(y, ty)
    assert not y.is_contiguous()
    assert y.data_ptr() == x.data_ptr() and same_storage(x, y)


def test_contiguous_copies_only_when_needed(client: tensord.Client) -> None:
    x = client.arange(12).view(3, 4)
    assert x.contiguous() is x  # torch returns self
    y = x.t()
    z, tz = y.contiguous(), torch.arange(12).view(3, 4).t().contiguous()
    assert_same(z, tz)
    assert z.data_ptr() != y.data_ptr() and not same_storage(z, y)


def test_detach_shares_and_clone_does_not(client: tensord.Client) -> None:
    x = client.arange(6, dtype=tensord.dtypes.float32, requires_grad=True)
    assert x.requires_grad
    d = x.detach()
    assert not d.requires_grad and d.data_ptr() == x.data_ptr() and same_storage(d, x)
    c = x.detach().clone()
    assert c.data_ptr() != x.data_ptr() and not same_storage(c, x)
    d[0] = 100.0
    c[1] = -1.0
    t = torch.arange(6, dtype=torch.float32)
    t[0] = 100.0
    np.testing.assert_array_equal(x.detach().numpy(), t.numpy())
    # clone keeps the strides of a dense non-contiguous tensor (preserve_format)
    p, tp = (
        client.arange(24).view(2, 3, 4).permute(2, 0, 1),
        torch.arange(24).view(2, 3, 4).permute(2, 0, 1),
    )
    assert_same(p.clone(), tp.clone())
    assert_same(
        p.clone(memory_format=tensord.contiguous_format),
        tp.clone(memory_format=torch.contiguous_format),
    )


def test_expand_is_a_view_with_stride_zero_and_repeat_copies(client: tensord.Client) -> None:
    x, t = client.tensor([[1], [2], [3]]), torch.tensor([[1], [2], [3]])
    e, te = x.expand(3, 4), t.expand(3, 4)
    assert_same(e, te)
    assert e.stride() == (1, 0) and same_storage(e, x)
    assert_same(x.expand(-1, 2), t.expand(-1, 2))
    assert_same(x.expand(2, 3, 2), t.expand(2, 3, 2))
    r, tr = x.repeat(2, 4), t.repeat(2, 4)
    assert_same(r, tr)
    assert not same_storage(r, x)
    assert_same(x.expand_as(e), t.expand_as(te))
    assert_same_error(lambda: x.expand(4, 4), lambda: t.expand(4, 4))
    assert_same_error(lambda: x.repeat(2), lambda: t.repeat(2))


def test_reshape_views_when_it_can_and_copies_when_it_must(client: tensord.Client) -> None:
    x, t = client.arange(12).view(3, 4), torch.arange(12).view(3, 4)
    v, tv = x.reshape(6, 2), t.reshape(6, 2)
    assert_same(v, tv)
    assert same_storage(v, x)
    c, tc = x.t().reshape(12), t.t().reshape(12)
    assert_same(c, tc)
    assert not same_storage(c, x)
    assert_same(x.reshape(-1, 6), t.reshape(-1, 6))
    assert_same(x.t().flatten(), t.t().flatten())
    assert_same_error(lambda: x.t().view(12), lambda: t.t().view(12))
    assert_same_error(lambda: x.view(5, -1), lambda: t.view(5, -1))
    assert_same_error(lambda: x.reshape(-1, -1), lambda: t.reshape(-1, -1))


def test_nchw_to_nhwc_permute(client: tensord.Client) -> None:
    x, t = (
        client.arange(2 * 3 * 4 * 5).view(2, 3, 4, 5),
        torch.arange(2 * 3 * 4 * 5).view(2, 3, 4, 5),
    )
    nhwc, tnhwc = x.permute(0, 2, 3, 1), t.permute(0, 2, 3, 1)
    assert_same(nhwc, tnhwc)
    assert nhwc.data_ptr() == x.data_ptr()
    assert_same(nhwc.contiguous(), tnhwc.contiguous())
    assert_same(x.movedim(1, -1), t.movedim(1, -1))
    assert_same_error(lambda: x.permute(0, 1, 2), lambda: t.permute(0, 1, 2))
    assert_same_error(lambda: x.permute(0, 1, 2, 2), lambda: t.permute(0, 1, 2, 2))


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_cat_and_stack_shapes(client: tensord.Client, dim: int) -> None:
    a, ta = client.arange(6).view(2, 3), torch.arange(6).view(2, 3)
    b, tb = client.arange(6, 12).view(2, 3), torch.arange(6, 12).view(2, 3)
    assert_same(tensord.cat([a, b], dim), torch.cat([ta, tb], dim))
    assert_same(tensord.stack([a, b], dim), torch.stack([ta, tb], dim))
    assert_same(client.cat((a, b.t().t()), dim=dim), torch.cat((ta, tb), dim=dim))


def test_cat_promotes_dtypes_as_torch(client: tensord.Client) -> None:
    a, ta = client.tensor([1, 2]), torch.tensor([1, 2])
    b, tb = client.tensor([0.5]), torch.tensor([0.5])
    c, tc = client.tensor([True]), torch.tensor([True])
    assert_same(tensord.cat([a, b, c]), torch.cat([ta, tb, tc]))
    assert_same(tensord.stack([a, a.to(tensord.dtypes.int8)]), torch.stack([ta, ta.to(torch.int8)]))


def test_cat_and_stack_errors_match_torch(client: tensord.Client) -> None:
    a, ta = client.zeros(2, 3), torch.zeros(2, 3)
    b, tb = client.zeros(3, 2), torch.zeros(3, 2)
    c, tc = client.zeros(2), torch.zeros(2)
    assert_same_error(lambda: tensord.cat([a, b]), lambda: torch.cat([ta, tb]))
    assert_same_error(lambda: tensord.cat([a, c]), lambda: torch.cat([ta, tc]))
    assert_same_error(lambda: tensord.cat([a, b], dim=2), lambda: torch.cat([ta, tb], dim=2))
    assert_same_error(lambda: tensord.stack([a, b]), lambda: torch.stack([ta, tb]))
    assert_same_error(lambda: tensord.stack([a, a], dim=3), lambda: torch.stack([ta, ta], dim=3))
    assert_same_error(lambda: tensord.cat([]), lambda: torch.cat([]))
    assert_same_error(lambda: tensord.stack([]), lambda: torch.stack([]))


def test_writes_through_views_are_visible_in_the_base(client: tensord.Client) -> None:
    x, t = client.zeros(3, 4), torch.zeros(3, 4)
    x[1] = 5.0
    t[1] = 5.0
    x.narrow(1, 2, 2).fill_(7)
    t.narrow(1, 2, 2).fill_(7)
    x.t()[0] = client.tensor([1.0, 2.0, 3.0])
    t.t()[0] = torch.tensor([1.0, 2.0, 3.0])
    x[2, 1:3] = client.tensor([8.0, 9.0])
    t[2, 1:3] = torch.tensor([8.0, 9.0])
    x.diagonal().zero_()
    t.diagonal().zero_()
    x[..., 3].copy_(client.tensor([4.0]))  # broadcast
    t[..., 3].copy_(torch.tensor([4.0]))
    col = x.select(1, 1)
    col.copy_(client.arange(3).to(tensord.dtypes.float64))  # dtype conversion on the server
    t.select(1, 1).copy_(torch.arange(3).double())
    assert_same(x, t)
    assert_same(col, t.select(1, 1))


def test_views_of_every_kind_match_torch(client: tensord.Client) -> None:
    x, t = client.arange(60).view(3, 4, 5), torch.arange(60).view(3, 4, 5)
    for ours, theirs in [
        (x[1], t[1]),
        (x[:, 1:3], t[:, 1:3]),
        (x[::2, None, ..., -1], t[::2, None, ..., -1]),
        (x.select(2, -1), t.select(2, -1)),
        (x.transpose(0, 2), t.transpose(0, 2)),
        (x.unsqueeze(1), t.unsqueeze(1)),
        (x[:, :1].squeeze(), t[:, :1].squeeze()),
        (x[:, :1].squeeze(1), t[:, :1].squeeze(1)),
        (x.flatten(1), t.flatten(1)),
        (x.unflatten(2, (5, 1)), t.unflatten(2, (5, 1))),
        (x.diagonal(1, 1, 2), t.diagonal(1, 1, 2)),
        (x.as_strided((2, 2), (1, 5), 3), t.as_strided((2, 2), (1, 5), 3)),
        (x.view(tensord.dtypes.int32), t.view(torch.int32)),
    ]:
        assert_same(ours, theirs)
        assert same_storage(ours, x)
    for ours_parts, theirs_parts in [
        (x.split(2, 1), t.split(2, 1)),
        (x.split([1, 4], 2), t.split([1, 4], 2)),
        (x.chunk(2), t.chunk(2)),
        (x.unbind(1), t.unbind(1)),
    ]:
        assert len(ours_parts) == len(theirs_parts)
        for ours, theirs in zip(ours_parts, theirs_parts, strict=True):
            assert_same(ours, theirs)
    assert [p.tolist() for p in x[0]] == [p.tolist() for p in t[0]]


def test_every_error_type(client: tensord.Client) -> None:
    x, t = client.arange(12).view(3, 4), torch.arange(12).view(3, 4)
    # RuntimeError: not viewable, out-of-bounds as_strided, narrow past the end
    assert_same_error(lambda: x.t().view(-1), lambda: t.t().view(-1))
    assert_same_error(lambda: x.as_strided((4, 4), (4, 1)), lambda: t.as_strided((4, 4), (4, 1)))
    assert_same_error(lambda: x.narrow(1, 3, 2), lambda: t.narrow(1, 3, 2))
    assert_same_error(
        lambda: x.view(tensord.dtypes.int32)[:, :3].view(tensord.dtypes.int64),
        lambda: t.view(torch.int32)[:, :3].view(torch.int64),
    )
    # IndexError: a dim or index out of range
    assert_same_error(lambda: x.transpose(0, 2), lambda: t.transpose(0, 2))
    assert_same_error(lambda: x.select(0, 3), lambda: t.select(0, 3))
    assert_same_error(lambda: x[3], lambda: t[3])
    assert_same_error(lambda: x[1, 2, 3], lambda: t[1, 2, 3])
    assert_same_error(lambda: x.size(2), lambda: t.size(2))
    # TypeError: a missing argument, len() of a 0-d tensor, iteration over one
    s, ts = x[0, 0], t[0, 0]
    for method in ("view", "reshape", "permute", "expand", "repeat"):
        assert_same_error(lambda m=method: getattr(s, m)(), lambda m=method: getattr(ts, m)())
    assert_same_error(lambda: len(x[0, 0]), lambda: len(t[0, 0]))
    assert_same_error(lambda: list(x[0, 0]), lambda: list(t[0, 0]))
    # RuntimeError from values: item() of many elements
    assert_same_error(lambda: x.item(), lambda: t.item())
    # ValueError for an empty cat
    assert_same_error(lambda: tensord.cat([]), lambda: torch.cat([]))
    # errors torch has no counterpart for: they still subclass the built-in
    with pytest.raises(tensord.NotFoundError) as missing:
        client.get("no such name in this server")
    assert isinstance(missing.value, LookupError)
    with pytest.raises(tensord.NotFoundError):
        client.attach("not-a-token")
    with pytest.raises(tensord.FailedPreconditionError) as no_gpu:
        x.to("cuda:7")
    assert isinstance(no_gpu.value, RuntimeError)
    with pytest.raises(TypeError):
        del x[0]  # as torch: "Tensor does not support deleting items"
    with pytest.raises(tensord.InvalidArgumentError):
        client.empty(2, dtype="no-such-dtype")
    # the server keeps serving, and what it stored is intact
    assert_same(x, t)


# ---- random chains of views, end to end ----------------------------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def _draw_op(data: st.DataObject, shape: tuple[int, ...]) -> tuple[str, tuple[Any, ...]]:
    """One view op with arguments that are mostly valid for ``shape`` (sometimes not)."""
    ndim = len(shape)
    dim = st.integers(-max(ndim, 1) - 1, max(ndim, 1))  # one past each end: IndexError cases
    name = data.draw(
        st.sampled_from(
            [
                "transpose",
                "narrow",
                "select",
                "unsqueeze",
                "squeeze",
                "permute",
                "t",
                "flatten",
                "reshape",
                "expand",
                "diagonal",
                "getitem",
                "view",
                # torch's wider view surface
                "tensor_split",
                "unfold",
                "ravel",
                "broadcast_to",
                "mT",
                "swapdims",
                "moveaxis",
                "hsplit",
            ]
        )
    )
    if name == "transpose" or name == "diagonal":
        return name, (data.draw(dim), data.draw(dim)) if name == "transpose" else (
            data.draw(st.integers(-2, 2)),
            data.draw(dim),
            data.draw(dim),
        )
    if name == "narrow":
        return name, (data.draw(dim), data.draw(st.integers(-3, 4)), data.draw(st.integers(0, 3)))
    if name == "select":
        return name, (data.draw(dim), data.draw(st.integers(-3, 3)))
    if name in ("unsqueeze", "squeeze"):
        return name, (data.draw(dim),)
    if name == "permute":
        return name, tuple(data.draw(st.permutations(range(ndim))))
    if name in ("reshape", "view"):
        numel = int(np.prod(shape))
        first = data.draw(
            st.sampled_from([d for d in range(1, numel + 1) if numel % d == 0] or [1])
        )
        return name, (first, -1)
    if name == "expand":
        return name, (data.draw(st.integers(1, 2)), *[-1] * ndim)
    if name in ("tensor_split", "hsplit"):
        last = data.draw(st.integers(0, 5))
        arg = data.draw(st.sampled_from([last, [1, last], [last, 1]]))
        return name, (arg, data.draw(dim)) if name == "tensor_split" else (arg,)
    if name == "unfold":
        return name, (data.draw(dim), data.draw(st.integers(0, 3)), data.draw(st.integers(1, 2)))
    if name == "broadcast_to":
        return name, ((data.draw(st.integers(1, 2)), *shape),)
    if name in ("swapdims", "moveaxis"):
        return name, (data.draw(dim), data.draw(dim))
    if name == "getitem":
        stop = data.draw(st.integers(-2, 3))
        return name, ((slice(None, stop, data.draw(st.integers(1, 2))), Ellipsis),)
    return name, ()


def _apply(x: Any, name: str, args: tuple[Any, ...]) -> Any:
    if name == "getitem":
        return x[args[0]]
    if name == "mT":
        with warnings.catch_warnings():  # of a 0-dim tensor: a deprecation warning (once)
            warnings.simplefilter("ignore", UserWarning)
            return x.mT
    result = getattr(x, name)(*args)
    # a split's last part: the chain goes on with one view (an empty tuple raises here alike)
    return result[-1] if isinstance(result, tuple) else result


@pytest.mark.slow
@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_random_view_chains_match_torch(server: Any, data: st.DataObject) -> None:
    shape = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple))
    with tensord.connect(server.address) as client:
        numel = int(np.prod(shape))
        x, t = client.arange(numel).view(shape), torch.arange(numel).view(shape)
        for _ in range(data.draw(st.integers(1, 4))):
            name, args = _draw_op(data, tuple(t.shape))
            try:
                t_next = _apply(t, name, args)
            except Exception as expected:
                with pytest.raises(type(expected)) as got:
                    _apply(x, name, args)
                assert str(got.value) == str(expected)
                break
            x, t = _apply(x, name, args), t_next
            assert_same(x, t)
            assert (x.data_ptr() == 0) == (t.data_ptr() == 0)  # torch: 0 with no elements
            if t.data_ptr():
                ours = x.data_ptr() - x.untyped_storage().data_ptr()
                assert ours == t.data_ptr() - t.untyped_storage().data_ptr()
