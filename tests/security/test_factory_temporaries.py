"""A factory's temporaries outside the pool stay a small multiple of its chunk.

A floating arange computes each element through torch's fused multiply-adds, emulated
in float64 with a dozen temporaries per element: over the whole range at once (or a
chunk of a million elements) that is over 100 MiB outside the pool for one small
request.  Memory outside the pool is measured with tracemalloc (NumPy reports its
buffers to it; the pool's segments are not Python's); the chunked values are checked
against torch across chunk edges.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator

import pytest
from tensord_server.domain import kernels
from tensord_server.domain.sessions import Session
from tensord_server.domain.store import TensorStore

torch = pytest.importorskip("torch")

FLOATING = ("float32", "float64", "float16", "bfloat16")
# A range of 2**21 elements: one float64 copy of it alone is 16 MiB.
RANGE_ELEMENTS = 1 << 21
PEAK_LIMIT_BYTES = 16 << 20


@pytest.fixture
def store() -> Iterator[tuple[TensorStore, Session]]:
    daemon = TensorStore(("cpu=256MiB",))
    session, _ = daemon.sessions.open()
    try:
        yield daemon, session
    finally:
        daemon.close()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", FLOATING)
def test_a_floating_arange_holds_little_outside_the_pool(
    store: tuple[TensorStore, Session], dtype: str
) -> None:
    daemon, session = store
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        daemon.factories.arange(session, 0, RANGE_ELEMENTS, 1, dtype, "cpu")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < PEAK_LIMIT_BYTES, (dtype, peak)


@pytest.mark.parametrize("dtype", FLOATING)
def test_an_arange_across_chunk_edges_matches_torch(
    store: tuple[TensorStore, Session], dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks of 40 elements (not a multiple of torch's vector pairs) over 1,003: each
    chunk's vector lanes are the whole range's."""
    monkeypatch.setattr(kernels, "ARANGE_CHUNK", 40)
    daemon, session = store
    out = daemon.factories.arange(session, -3.25, 997.5, 0.997, dtype, "cpu")
    expected = torch.arange(-3.25, 997.5, 0.997, dtype=getattr(torch, dtype))
    got = b"".join(daemon.transfers.download(session, out.handle))
    assert expected.numel() > 1000
    assert got == expected.view(torch.uint8).numpy().tobytes()
