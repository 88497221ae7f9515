"""Every op's cost is bounded by what it will produce, checked before the work: tensors a
view op returns, dims of an index, elements an op reads or writes (SECURITY.md's limits)."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest
import torch
from conftest import SessionStub as Stub
from conftest import open_channel, run_serve
from hypothesis import given, settings
from hypothesis import strategies as st
from rpc_errors import rpc_error, torch_error
from tensord import schema as pb
from tensord.layout import Layout, view_result_count
from tensord_server.domain import limits

# Each refusal answers this fast: nothing was built before it.
FAST_S = 2.0


def _expanded(stub: Stub, n: int) -> pb.TensorMeta:
    """zeros(1).expand(n): one float32 element named n times."""
    one = stub.upload(np.zeros(1, dtype=np.float32))
    return stub.view(one, expand=pb.Expand(shape=[n]))[0]


def _timed_error(call) -> tuple[grpc.StatusCode, str]:  # type: ignore[no-untyped-def]
    started = time.monotonic()
    code, details, _ = rpc_error(call)
    assert time.monotonic() - started < FAST_S, details
    return code, details


def test_unbind_split_chunk_count_their_results_first(stub: Stub) -> None:
    big = _expanded(stub, 400_000)
    for op in (
        {"unbind": pb.Unbind(dim=0)},
        {"split": pb.Split(split_size=1, dim=0)},
        {"chunk": pb.Chunk(chunks=400_000, dim=0)},
    ):
        code, details = _timed_error(lambda op=op: stub.view(big, **op))
        assert code is grpc.StatusCode.INVALID_ARGUMENT
        assert "400000 tensors" in details and "MAX_VIEW_RESULTS" in details
    # an empty tensor splits into `chunks` empty ones: 2**40 of them was a MemoryError
    empty = stub.upload(np.zeros(0, dtype=np.float32))
    code, details = _timed_error(lambda: stub.view(empty, chunk=pb.Chunk(chunks=2**40, dim=0)))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "MAX_VIEW_RESULTS" in details


def test_the_handle_limit_refuses_before_any_view_is_built(make_server, monkeypatch) -> None:
    server = make_server(max_handles_per_session=50)
    built = []
    real_unbind = Layout.unbind
    monkeypatch.setattr(Layout, "unbind", lambda self, *a: built.append(1) or real_unbind(self, *a))
    with open_channel(server.address) as channel:
        stub = Stub(channel)
        big = _expanded(stub, 1000)
        code, details = _timed_error(lambda: stub.view(big, unbind=pb.Unbind(dim=0)))
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-handles-per-session 50" in details
        assert built == []  # refused from the count alone
        assert len(stub.view(_expanded(stub, 10), unbind=pb.Unbind(dim=0))) == 10
        assert built == [1]
        stub.close()


def test_an_index_cannot_make_more_than_max_dims(stub: Stub) -> None:
    x = stub.upload(np.zeros(3, dtype=np.float32))
    nones = [pb.IndexItem(none=True)] * limits.MAX_INDEX_ITEMS
    code, details = _timed_error(lambda: stub.view(x, index=pb.Index(items=nones)))
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert f"{limits.MAX_INDEX_ITEMS + 1} dimensions" in details and "MAX_DIMS" in details
    # at the limit it works, as in torch
    (y,) = stub.view(x, index=pb.Index(items=[pb.IndexItem(none=True)] * 63))
    assert len(y.shape) == limits.MAX_DIMS
    code, details = _timed_error(lambda: stub.view(y, unsqueeze=pb.Unsqueeze(dim=0)))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "65 dimensions" in details


def test_fill_writes_an_expanded_location_once(stub: Stub) -> None:
    """torch's fill_ takes an expanded tensor (2**40 elements over one float here): written
    once, it answers at once."""
    huge = _expanded(stub, 2**40)
    started = time.monotonic()
    stub.Fill(
        pb.FillRequest(handle=huge.handle, value=pb.Scalar(float_value=7.0)), metadata=stub.md
    )
    assert time.monotonic() - started < FAST_S
    one = stub.view(huge, narrow=pb.Narrow(dim=0, start=5, length=1))[0]
    assert stub.download(one).tolist() == [7.0]


def test_setitem_of_a_scalar_refuses_an_expanded_target_as_torch_does(stub: Stub) -> None:
    x = _expanded(stub, 10)
    request = pb.SetItemRequest(
        handle=x.handle,
        index=[pb.IndexItem(slice=pb.Slice(start=0, stop=5))],
        scalar=pb.Scalar(float_value=1.0),
    )
    code, details, kind = rpc_error(lambda: stub.SetItem(request, metadata=stub.md))

    def torch_setitem() -> None:
        torch.zeros(1).expand(10)[0:5] = 1.0

    assert (code, (kind, details)) == (grpc.StatusCode.INVALID_ARGUMENT, torch_error(torch_setitem))


def test_ops_touching_too_many_elements_are_refused(make_server) -> None:
    server = make_server(max_op_elements=1000)
    with open_channel(server.address) as channel:
        stub = Stub(channel)
        small = stub.upload(np.zeros(100, dtype=np.float32))
        # 50 x 50 elements over 99 floats (overlapping, not expanded): 2500 to touch
        lattice = stub.view(small, as_strided=pb.AsStrided(size=[50, 50], stride=[1, 1]))[0]
        calls = {
            "fill_": lambda: stub.Fill(
                pb.FillRequest(handle=lattice.handle, value=pb.Scalar(float_value=1.0)),
                metadata=stub.md,
            ),
            "clone": lambda: stub.Clone(pb.CloneRequest(handle=lattice.handle), metadata=stub.md),
            "contiguous": lambda: stub.Contiguous(
                pb.HandleRequest(handle=lattice.handle), metadata=stub.md
            ),
            "download": lambda: stub.download_bytes(lattice.handle),
            "repeat": lambda: stub.Repeat(
                pb.RepeatRequest(handle=small.handle, repeats=[20]), metadata=stub.md
            ),
            "cat": lambda: stub.Cat(pb.CatRequest(handles=[small.handle] * 20), metadata=stub.md),
        }
        for name, call in calls.items():
            code, details = _timed_error(call)
            assert code is grpc.StatusCode.RESOURCE_EXHAUSTED, name
            assert "--max-op-elements 1000" in details, (name, details)
        # within the limit all is as before
        stub.Fill(
            pb.FillRequest(handle=small.handle, value=pb.Scalar(float_value=2.0)), metadata=stub.md
        )
        assert stub.download(small).tolist() == [2.0] * 100
        stub.close()


@pytest.mark.slow
def test_serve_takes_max_op_elements() -> None:
    result = run_serve("--address", "127.0.0.1:0", "--device", "cpu", "--max-op-elements", "0")
    assert result.returncode == 2 and "--max-op-elements must be >= 1" in result.stderr
    result = run_serve("--address", "127.0.0.1:0", "--device", "cpu", "--max-batch-elements", "0")
    assert result.returncode == 2 and "--max-batch-elements must be >= 1" in result.stderr


_SHAPES = st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple)


@settings(max_examples=300, deadline=None)
@given(
    shape=_SHAPES,
    name=st.sampled_from(["split", "chunk", "unbind", "sections"]),
    amount=st.integers(-2, 9),
    dim=st.integers(-4, 3),
)
def test_view_result_count_is_what_the_op_returns(
    shape: tuple[int, ...], name: str, amount: int, dim: int
) -> None:
    """The count computed from the request alone equals the number of views the layout
    engine builds; None exactly when the engine refuses (its own torch error)."""
    layout = Layout.contiguous(shape)
    if name == "unbind":
        op, args = "unbind", (dim,)
    elif name == "sections":
        op, args = "split", ((1,) * max(amount, 0), dim)
    else:
        op, args = name, (amount, dim)
    count = view_result_count(layout, op, args)
    try:
        built = getattr(layout, op)(*args)
    except (RuntimeError, IndexError):
        assert count is None or layout.ndim == 0 or op == "split"
        return
    assert count == len(built)
