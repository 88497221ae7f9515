"""Errors a client can find itself, raised at the call as torch raises them (not at the
next wait of a pipelined client), and the factories' argument rules: torch is the oracle."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
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
