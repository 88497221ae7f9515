"""Advanced indexing's temporaries are bounded by a chunk, not by the index (as every
temporary of a request is): a gather or scatter walks the broadcast index ``INDEX_CHUNK_ELEMENTS``
positions at a time, an expanded (stride-0) index is never materialised, and a mask's
nonzero coordinates go to the pool.  Memory outside the pool is measured with
tracemalloc (NumPy reports its buffers to it; the pool's segments are not Python's),
and the chunked results are checked against torch with a tiny chunk.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from tensord_server.domain.ops import indexing
from tensord_server.domain.ops.indexing import TensorItem
from tensord_server.domain.ops.views import ViewOp
from tensord_server.domain.sessions import Session
from tensord_server.domain.store import TensorStore

torch = pytest.importorskip("torch")

# The broadcast index: one element named 2**24 times (its int64 values alone: 128 MiB).
INDEX_ELEMENTS = 1 << 24
# The chunk the tests run with, and the peak allowed outside the pool: a small multiple
# of the chunk's bytes, far below one int64 copy of the index (or one bool copy of a mask).
CHUNK = 1 << 17
PEAK_LIMIT_BYTES = 8 * CHUNK * 8


@pytest.fixture
def store() -> Iterator[tuple[TensorStore, Session]]:
    daemon = TensorStore(("cpu=1GiB",))
    session, _ = daemon.sessions.open()
    try:
        yield daemon, session
    finally:
        daemon.close()


@pytest.fixture
def small_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(indexing, "INDEX_CHUNK_ELEMENTS", CHUNK, raising=False)


def _full(daemon: TensorStore, session: Session, shape: list[int], value: Any, dtype: str) -> str:
    return daemon.factories.full(session, shape, value, dtype, "cpu").handle


def _expanded(daemon: TensorStore, session: Session, handle: str, shape: list[int]) -> str:
    (issued,) = daemon.views.view(session, handle, ViewOp("expand", (tuple(shape),)))
    return issued.handle


def _peak_outside_pool(op: Callable[[], Any]) -> int:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        op()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _ops(daemon: TensorStore, session: Session) -> dict[str, Callable[[], Any]]:
    """Each gather/scatter path with a 2**24-element broadcast index or mask."""
    n = INDEX_ELEMENTS
    x = _full(daemon, session, [4], 1.0, "float32")
    one = _full(daemon, session, [1], 1.0, "float32")
    index = _expanded(daemon, session, _full(daemon, session, [1], 2, "int64"), [n])
    index32 = _expanded(daemon, session, _full(daemon, session, [1], -1, "int32"), [n])
    values = _expanded(daemon, session, _full(daemon, session, [1], 3.0, "float32"), [n])
    mask = _expanded(daemon, session, _full(daemon, session, [1], True, "bool"), [n])
    wide = _expanded(daemon, session, x, [n // 4, 4])
    column = _expanded(daemon, session, _full(daemon, session, [1, 1], True, "bool"), [n // 4, 4])
    big = _full(daemon, session, [n // 4, 4], 0.0, "float32")
    return {
        "gather": lambda: daemon.indexing.advanced_index(session, x, (TensorItem(index),)),
        "gather int32": lambda: daemon.indexing.advanced_index(session, x, (TensorItem(index32),)),
        "index_select": lambda: daemon.indexing.advanced_index(
            session, x, (TensorItem(index),), raw=True, op="index_select"
        ),
        "setitem scalar": lambda: daemon.indexing.advanced_setitem(
            session, x, (TensorItem(index),), value=5.0
        ),
        "setitem tensor": lambda: daemon.indexing.advanced_setitem(
            session, x, (TensorItem(index),), src_handle=values
        ),
        "index_put accumulate": lambda: daemon.indexing.advanced_setitem(
            session, x, (TensorItem(index),), src_handle=values, accumulate=True, raw=True
        ),
        "masked_select": lambda: daemon.indexing.advanced_index(
            session, _expanded(daemon, session, one, [n]), (TensorItem(mask),)
        ),
        "masked 2-d gather": lambda: daemon.indexing.advanced_index(
            session, wide, (TensorItem(column),)
        ),
        "masked_fill_": lambda: daemon.indexing.advanced_setitem(
            session, big, (TensorItem(column),), value=2.0
        ),
    }


PATHS = [
    "gather",
    "gather int32",
    "index_select",
    "setitem scalar",
    "setitem tensor",
    "index_put accumulate",
    "masked_select",
    "masked 2-d gather",
    "masked_fill_",
]


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS)
def test_temporaries_stay_a_small_multiple_of_the_chunk(
    store: tuple[TensorStore, Session], small_chunk: None, path: str
) -> None:
    daemon, session = store
    op = _ops(daemon, session)[path]
    peak = _peak_outside_pool(op)
    assert peak < PEAK_LIMIT_BYTES, (path, peak)


def test_the_chunked_results_are_the_whole_ones(store: tuple[TensorStore, Session]) -> None:
    """A broadcast index over a few chunks gives what one pass gives (values checked)."""
    daemon, session = store
    x = daemon.transfers.upload(
        session, [5], "float32", "cpu", 20, [np.arange(5, dtype=np.float32).tobytes()]
    ).handle
    index = _expanded(daemon, session, _full(daemon, session, [1], 3, "int64"), [3 * CHUNK + 7])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(indexing, "INDEX_CHUNK_ELEMENTS", CHUNK)
        out = daemon.indexing.advanced_index(session, x, (TensorItem(index),))
        daemon.indexing.advanced_setitem(session, x, (TensorItem(index),), value=1.0)
    assert bytes(b"".join(daemon.transfers.download(session, out.handle))) == (
        np.full(3 * CHUNK + 7, 3.0, dtype=np.float32).tobytes()
    )
    assert (
        b"".join(daemon.transfers.download(session, x))
        == np.array([0, 1, 2, 1, 4], dtype=np.float32).tobytes()
    )


@pytest.fixture
def tiny_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """A few positions at a time, so that every case below spans many chunks."""
    monkeypatch.setattr(indexing, "INDEX_CHUNK_ELEMENTS", 4, raising=False)


def _same(x: Any, t: Any) -> None:
    np.testing.assert_array_equal(x.numpy(), t.numpy())


def test_duplicates_across_chunks_match_torch(client: Any, tiny_chunk: None) -> None:
    """Without accumulate the last duplicate in row-major order stays (torch CPU's order);
    with accumulate every duplicate adds up, whichever chunk it falls in."""
    idx = [[0, 2, 0, 1, 2], [2, 2, 0, 0, 1], [1, 1, 1, 1, 1]]
    values = np.arange(15, dtype=np.float32).reshape(3, 5) + 1
    for accumulate in (False, True):
        t = torch.zeros(4, 3)
        x = client.zeros(4, 3)
        t.index_put_((torch.tensor(idx),), torch.tensor(values)[..., None], accumulate)
        x.index_put_((client.tensor(idx),), client.tensor(values)[..., None], accumulate)
        _same(x, t)
    # an expanded index: one position named many times, across many chunks
    t, x = torch.zeros(3), client.zeros(3)
    t.index_put_((torch.tensor([1]).expand(50),), torch.arange(50.0), accumulate=True)
    x.index_put_((client.tensor([1]).expand(50),), client.arange(50.0), accumulate=True)
    _same(x, t)


def test_gathers_and_masks_across_chunks_match_torch(client: Any, tiny_chunk: None) -> None:
    base = np.arange(60, dtype=np.float32).reshape(3, 4, 5)
    t, x = torch.tensor(base), client.tensor(base)
    rows, cols = [[2, 0], [1, -1]], [[0], [3]]
    _same(
        x[client.tensor(rows), :, client.tensor(cols)], t[torch.tensor(rows), :, torch.tensor(cols)]
    )
    _same(x[:, client.tensor(rows)], t[:, torch.tensor(rows)])
    mask = base % 3 == 0
    _same(x[client.tensor(mask)], t[torch.tensor(mask)])
    _same(x[:, client.tensor(mask[0])], t[:, torch.tensor(mask[0])])
    _same(x.masked_select(client.tensor(mask[0, 0])), t.masked_select(torch.tensor(mask[0, 0])))
    _same(x.index_select(2, client.tensor([4, 0, 4])), t.index_select(2, torch.tensor([4, 0, 4])))
    x[client.tensor(mask)] = -1.0
    t[torch.tensor(mask)] = -1.0
    _same(x, t)


def test_a_value_sharing_the_written_storage_is_read_before_any_write(
    client: Any, tiny_chunk: None
) -> None:
    """A value or index that shares the written Storage in a way torch cannot judge (not
    dense: torch's kernel then reads it as it goes) is read whole before the first write,
    as one pass did before the work went in chunks: a later chunk never reads what an
    earlier one wrote."""
    index = [10, 11, 8, 9, 0, 1]
    expected = np.arange(12.0, dtype=np.float32)
    expected[index] = expected[::2].copy()
    x = client.arange(12.0)
    x[client.tensor(index)] = x[::2]
    np.testing.assert_array_equal(x.numpy(), expected)
    # an int64 tensor indexed by a (non-dense) view of itself, written in chunks
    values = np.array([6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1])
    expected_int = values.copy()
    np.add.at(expected_int, expected_int[::3].copy(), 5)
    y = client.tensor(values)
    y.index_put_((y[::3],), client.tensor(5), accumulate=True)
    np.testing.assert_array_equal(y.numpy(), expected_int)


def test_many_basic_items_beside_a_tensor_cost_linear_time(
    store: tuple[TensorStore, Session],
) -> None:
    """Found by an attacker's read: each Ellipsis recounted the whole key, and each None
    or Python bool unsqueezed a view that kept growing, before the result's dims were
    checked: 8,000 Nones held a worker for a minute (65,536 items: hours)."""
    import time

    from tensord.errors import InvalidArgumentError

    daemon, session = store
    x = _full(daemon, session, [4], 1.0, "float32")
    index = _full(daemon, session, [2], 1, "int64")
    n = 6000
    for filler in (None, True):
        started = time.monotonic()
        with pytest.raises(InvalidArgumentError, match="MAX_DIMS"):
            daemon.indexing.advanced_index(session, x, (filler,) * n + (TensorItem(index),))
        assert time.monotonic() - started < 2.0
    started = time.monotonic()
    out = daemon.indexing.advanced_index(session, x, (Ellipsis,) * n + (TensorItem(index),))
    assert time.monotonic() - started < 2.0
    assert tuple(out.ref.layout.shape) == (2,)


def test_a_setitem_with_many_nones_is_refused_before_its_view(
    store: tuple[TensorStore, Session],
) -> None:
    """Found by an attacker's read: x[None, None, ..., 0] = v (a unary SetItem, or one op of
    a Batch) built its view one unsqueeze at a time before any dims check: 4,000 Nones
    held a worker for 11 s, 16,000 for four minutes."""
    import time

    from tensord.errors import InvalidArgumentError

    daemon, session = store
    x = _full(daemon, session, [4], 1.0, "float32")
    started = time.monotonic()
    with pytest.raises(InvalidArgumentError, match="MAX_DIMS"):
        daemon.writes.setitem(session, x, (None,) * 6000 + (0,), value=2.0)
    assert time.monotonic() - started < 2.0
