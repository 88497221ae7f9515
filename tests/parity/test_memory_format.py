"""Memory formats (tensord.channels_last, ...) against torch 2.13, the oracle.

The layout engine (pure: strides, is_contiguous under each format, view-or-copy
of contiguous/clone/to, error texts) over random 3-D/4-D/5-D strided tensors,
then the SDK end to end on a server (strides, data_ptr, values, errors), then
the TypeError texts for objects that are no memory format.
"""

from __future__ import annotations

import itertools
import pickle
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import tensord
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensord.layout import MEMORY_FORMATS, Layout, memory_format_strides

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.torch

SETTINGS = settings(
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

FORMATS = {name: getattr(torch, name) for name in MEMORY_FORMATS}
OURS = {name: getattr(tensord, name) for name in MEMORY_FORMATS}


def _message(exc: BaseException) -> str:
    return str(exc).split("\nException raised from")[0]


@st.composite
def strided(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """(shape, stride, offset) of 3 to 5 dims with size-0/1 dims: a permuted dense
    layout (channels_last among them), then perhaps strides stretched or zeroed."""
    ndim = draw(st.sampled_from((3, 4, 4, 5, 5)))
    shape = tuple(draw(st.lists(st.sampled_from((0, 1, 1, 2, 3, 4)), min_size=ndim, max_size=ndim)))
    # fastest-varying dim first: channels_last's order often, else any permutation
    channels_last = (1, *range(ndim - 1, 1, -1), 0)
    order = draw(st.one_of(st.just(channels_last), st.permutations(range(ndim))))
    kind = draw(st.sampled_from(("dense", "dense", "padded", "scrambled")))
    stride = [0] * ndim
    step = 1
    for d in order:
        stride[d] = step
        # padded: gaps between dims (a slice of a bigger tensor), the order kept
        step *= max(shape[d], 1) + (draw(st.integers(0, 2)) if kind == "padded" else 0)
    if kind == "scrambled":  # strides stretched, shifted or 0
        for d in range(ndim):
            stride[d] = stride[d] * draw(st.sampled_from((1, 1, 2))) + draw(
                st.sampled_from((0, 0, 1))
            )
            if draw(st.integers(0, 5)) == 0:
                stride[d] = 0
    offset = draw(st.integers(0, 2))
    return shape, tuple(stride), offset


def _torch_tensor(shape: tuple[int, ...], stride: tuple[int, ...], offset: int) -> Any:
    n = Layout(shape, stride, offset).storage_extent() + 1 + offset
    return torch.arange(n, dtype=torch.float32).as_strided(shape, stride, offset)


def _both(torch_call: Callable[[], Any], our_call: Callable[[], Any]) -> tuple[Any, Any] | None:
    """Both results, or None when both raised the same type with the same text."""
    try:
        expected = torch_call()
    except (RuntimeError, TypeError) as e:
        with pytest.raises(type(e)) as ours:
            our_call()
        assert _message(ours.value) == _message(e)
        return None
    return expected, our_call()


# -- the layout engine -----------------------------------------------------------------------


@pytest.mark.slow
@settings(SETTINGS, max_examples=1500)
@given(case=strided())
def test_layout_formats_match_torch(case: tuple[tuple[int, ...], tuple[int, ...], int]) -> None:
    shape, stride, offset = case
    t = _torch_tensor(shape, stride, offset)
    layout = Layout(shape, stride, offset)
    for name, fmt in FORMATS.items():
        assert layout.is_contiguous(name) == t.is_contiguous(memory_format=fmt), name
        pair = _both(
            lambda fmt=fmt: t.contiguous(memory_format=fmt),
            lambda name=name: layout.contiguous_layout(name),
        )
        if pair is not None:
            result, ours = pair
            assert (ours is None) == (result is t), name  # a view (x itself) or a copy
            if ours is not None:
                assert ours.stride == result.stride() and ours.shape == result.shape
        pair = _both(
            lambda fmt=fmt: t.clone(memory_format=fmt),
            lambda name=name: layout.clone_layout(name),
        )
        if pair is not None:
            assert pair[1].stride == pair[0].stride(), name
        # to() returns x itself exactly when torch reads fmt off its strides
        try:
            aliases = t.to(memory_format=fmt) is t
        except RuntimeError:  # the wrong rank for fmt: never x itself
            aliases = False
        if name != "preserve_format":
            assert aliases == (layout.suggest_memory_format() == name), name


@pytest.mark.slow
@pytest.mark.parametrize("ndim", [2, 3, 4, 5, 6])
def test_memory_format_strides_match_torch_empty(ndim: int) -> None:
    for shape in itertools.product((0, 1, 2, 3), repeat=ndim):
        for name, fmt in FORMATS.items():
            pair = _both(
                lambda: torch.empty(shape, memory_format=fmt).stride(),  # noqa: B023
                lambda: memory_format_strides(shape, name),  # noqa: B023
            )
            assert pair is None or pair[0] == pair[1], (shape, name)


def test_layout_refuses_an_unknown_format_name() -> None:
    with pytest.raises(ValueError, match="unsupported memory_format 'channels_first'"):
        Layout.contiguous((1, 2, 3, 4)).clone_layout("channels_first")


# -- the SDK on a server ----------------------------------------------------------------------


def _sdk_tensor(client: tensord.Client, shape: Any, stride: Any, offset: int) -> Any:
    n = Layout(shape, stride, offset).storage_extent() + 1 + offset
    return client.arange(n, dtype=tensord.float32).as_strided(shape, stride, offset)


def _same_tensor(ours: Any, ours_in: Any, theirs: Any, theirs_in: Any, what: str = "") -> None:
    assert ours.shape == theirs.shape and ours.stride() == theirs.stride(), what
    assert ours.dtype == theirs.dtype
    # a view of the input (the input itself) or a new tensor, as torch
    if theirs.numel():
        assert (ours.data_ptr() == ours_in.data_ptr()) == (
            theirs.data_ptr() == theirs_in.data_ptr()
        )
    assert (ours is ours_in) == (theirs is theirs_in), what
    np.testing.assert_array_equal(ours.numpy(), theirs.numpy())
    for name, fmt in FORMATS.items():
        assert ours.is_contiguous(memory_format=OURS[name]) == theirs.is_contiguous(
            memory_format=fmt
        )


@pytest.mark.slow
@settings(SETTINGS, max_examples=60)
@given(case=strided())
def test_sdk_formats_match_torch(
    client: tensord.Client, case: tuple[tuple[int, ...], tuple[int, ...], int]
) -> None:
    shape, stride, offset = case
    t = _torch_tensor(shape, stride, offset)
    x = _sdk_tensor(client, shape, stride, offset)
    for name, fmt in FORMATS.items():
        ours_fmt = OURS[name]
        assert x.is_contiguous(memory_format=ours_fmt) == t.is_contiguous(memory_format=fmt)
        calls: list[tuple[Callable[[Any, Any], Any], str]] = [
            (lambda v, f: v.contiguous(memory_format=f), "contiguous"),
            (lambda v, f: v.clone(memory_format=f), "clone"),
            (lambda v, f: v.to(memory_format=f), "to"),
            (lambda v, f: v.to(memory_format=f, copy=True), "to copy"),
        ]
        for call, what in calls:
            pair = _both(lambda: call(t, fmt), lambda: call(x, ours_fmt))  # noqa: B023
            if pair is not None:
                _same_tensor(pair[1], x, pair[0], t, f"{what} {name}")
        # a dtype change as well: a torch dtype as the SDK takes it
        pair = _both(
            lambda: t.to(torch.float64, memory_format=fmt),  # noqa: B023
            lambda: x.to(torch.float64, memory_format=ours_fmt),  # noqa: B023
        )
        if pair is not None:
            _same_tensor(pair[1], x, pair[0], t)
        pair = _both(
            lambda: torch.empty(shape, memory_format=fmt),  # noqa: B023
            lambda: client.empty(shape, memory_format=ours_fmt),  # noqa: B023
        )
        if pair is not None:
            assert pair[1].stride() == pair[0].stride() and pair[1].shape == pair[0].shape


def test_torch_formats_are_accepted_too(client: tensord.Client) -> None:
    x = client.arange(24, dtype=tensord.float32).view(1, 2, 3, 4)
    y = x.contiguous(memory_format=torch.channels_last)
    assert y.stride() == (24, 1, 8, 2) and y.is_contiguous(memory_format=torch.channels_last)
    assert y.clone().stride() == (24, 1, 8, 2)  # preserve_format keeps channels_last
    assert y.clone(memory_format=tensord.preserve_format).stride() == (24, 1, 8, 2)
    assert y.contiguous(memory_format=tensord.channels_last) is y
    z = client.empty(2, 3, 4, 5, 6, memory_format=tensord.channels_last_3d)
    assert z.stride() == torch.empty(2, 3, 4, 5, 6, memory_format=torch.channels_last_3d).stride()


def test_format_objects_print_and_pickle_as_singletons() -> None:
    assert repr(tensord.channels_last) == "tensord.channels_last"
    assert str(tensord.contiguous_format) == "tensord.contiguous_format"
    for fmt in OURS.values():
        assert pickle.loads(pickle.dumps(fmt)) is fmt


# -- objects that are no memory format: torch's TypeError texts --------------------------------


class Foo:
    pass


NOT_FORMATS = ["channels_last", 1, True, 2.0, np.int64(1), Foo(), None]


@pytest.mark.slow
@pytest.mark.parametrize("value", NOT_FORMATS, ids=lambda v: type(v).__name__)
def test_not_a_memory_format_raises_torchs_type_error(client: tensord.Client, value: Any) -> None:
    t = torch.zeros(2, 3, 4, 5)
    x = client.zeros(2, 3, 4, 5)
    calls: list[tuple[Callable[[], Any], Callable[[], Any]]] = [
        (
            lambda: t.is_contiguous(memory_format=value),
            lambda: x.is_contiguous(memory_format=value),
        ),
        (lambda: t.contiguous(memory_format=value), lambda: x.contiguous(memory_format=value)),
        (lambda: t.clone(memory_format=value), lambda: x.clone(memory_format=value)),
        (lambda: t.to(memory_format=value), lambda: x.to(memory_format=value)),
        (
            lambda: t.to(torch.float64, memory_format=value),
            lambda: x.to(torch.float64, memory_format=value),
        ),
        (
            lambda: t.to("cpu", torch.float64, memory_format=value),
            lambda: x.to("cpu", torch.float64, memory_format=value),
        ),
        (
            lambda: t.to("cpu", torch.float64, False, False, memory_format=value),
            lambda: x.to("cpu", torch.float64, False, False, memory_format=value),
        ),
        (lambda: t.to(t, memory_format=value), lambda: x.to(x, memory_format=value)),
        (
            lambda: torch.empty(2, 3, memory_format=value),
            lambda: client.empty(2, 3, memory_format=value),
        ),
    ]
    for torch_call, our_call in calls:
        pair = _both(torch_call, our_call)
        if pair is not None:  # None: torch's default (clone, to, empty)
            assert value is None and pair[1].stride() == pair[0].stride()


def test_memory_format_is_keyword_only_as_in_torch(client: tensord.Client) -> None:
    t, x = torch.zeros(2, 3, 4, 5), client.zeros(2, 3, 4, 5)
    for method in ("is_contiguous", "contiguous", "clone"):
        for args in ((torch.channels_last,), (1, 2)):
            _both(lambda: getattr(t, method)(*args), lambda: getattr(x, method)(*args))  # noqa: B023
        _both(
            lambda: getattr(t, method)(memory_format=torch.channels_last, foo=1),  # noqa: B023
            lambda: getattr(x, method)(memory_format=torch.channels_last, foo=1),  # noqa: B023
        )
