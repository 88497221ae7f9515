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
