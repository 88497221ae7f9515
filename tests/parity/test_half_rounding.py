"""float64 -> float16/bfloat16 as torch casts: through float32 (c10::Half and BFloat16 are
made from a float), on the server (to, copy_) and in the SDK (tensor(ndarray, dtype=...))."""

from __future__ import annotations

import numpy as np
import pytest
import tensord
import torch
from tensord_server.devices import host_copies
from tensord_server.domain import kernels

# Random doubles with many ties between halves that round differently once vs twice.
N = 200_000


def _doubles(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.standard_normal(N) * np.exp2(rng.integers(-20, 16, N))


HALVES = [(tensord.float16, torch.float16), (tensord.bfloat16, torch.bfloat16)]


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy()


def _our_bits(t: tensord.Tensor) -> np.ndarray:
    return t.view(tensord.int16).numpy()


@pytest.mark.parametrize(("ours", "theirs"), HALVES)
def test_the_server_casts_doubles_to_half_as_torch(client, ours, theirs) -> None:
    values = _doubles(1)
    x = client.tensor(values)
    assert x.dtype == tensord.float64
    expected = _bits(torch.from_numpy(values).to(theirs))
    np.testing.assert_array_equal(_our_bits(x.to(ours)), expected)
    y = client.empty(N, dtype=ours)
    y.copy_(x)
    np.testing.assert_array_equal(_our_bits(y), expected)


@pytest.mark.parametrize(("ours", "theirs"), HALVES)
def test_the_sdk_casts_a_double_ndarray_to_half_as_torch(client, ours, theirs) -> None:
    values = _doubles(2)
    expected = _bits(torch.tensor(values, dtype=theirs))
    np.testing.assert_array_equal(_our_bits(client.tensor(values, dtype=ours)), expected)


def test_the_chunked_cast_covers_every_element(monkeypatch) -> None:
    monkeypatch.setattr(host_copies, "HALF_CAST_CHUNK_ELEMENTS", 7)
    values = np.clip(_doubles(3)[: 5 * 4 * 9], -6e4, 6e4).reshape(5, 4, 9)  # no overflow
    out = np.empty((5, 4, 9), np.float16)
    kernels.assign(np, out, values)
    np.testing.assert_array_equal(out, values.astype(np.float32).astype(np.float16))
    kernels.assign(np, out, values[0, 0])  # a broadcast source
    np.testing.assert_array_equal(out[3, 2], values[0, 0].astype(np.float32).astype(np.float16))
