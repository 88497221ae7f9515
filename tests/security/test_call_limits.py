"""Every count a request names is bounded so that one call's Python work stays within
limits.CALL_BUDGET_MS, refused before any work; the SDK splits what must keep working
(releases, Batches, a long split, chunk or unbind) into calls within the limits."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import tensord
import torch
from conftest import SessionStub as Stub
from google.protobuf import descriptor as d
from rpc_errors import rpc_error
from tensord import protocol
from tensord import schema as pb
from tensord.wire import connection, pipeline
from tensord_server.domain import limits
from tensord_server.domain.ops import batch


def _request_messages() -> Iterator[d.Descriptor]:
    """Every message a request may hold, nested ones included (each once)."""
    seen: set[str] = set()
    todo = [m.input_type for m in pb.DESCRIPTOR.services_by_name["Tensord"].methods]
    todo.append(pb.UploadHeader.DESCRIPTOR)  # an Upload's request, sent as metadata
    while todo:
        message = todo.pop()
        if message.full_name in seen:
            continue
        seen.add(message.full_name)
        yield message
        todo.extend(f.message_type for f in message.fields if f.message_type is not None)


def test_every_list_of_a_request_has_a_limit_of_its_own() -> None:
    lists = [(m, f) for m in _request_messages() for f in m.fields if f.is_repeated]
    assert len(lists) > 10
    for message, field in lists:
        limit, name = limits.list_limit(field)
        assert name != "MAX_LIST_LEN", f"{message.name}.{field.name} has no limit of its own"
        assert limit == getattr(limits, name) <= limits.MAX_LIST_LEN


def test_the_sdk_and_the_server_share_one_definition_of_each_limit() -> None:
    for name in ("MAX_CAT_INPUTS", "MAX_RELEASE_HANDLES", "MAX_VIEW_RESULTS", "MAX_BATCH_OPS"):
        assert getattr(limits, name) is getattr(protocol, name)
    assert protocol.MAX_INDEX_ITEMS == 2 * limits.MAX_DIMS + 1
    assert limits.MAX_BATCH_OPS * 2 <= limits.MAX_REQUEST_ITEMS  # an x[i] op is two items


@pytest.mark.parametrize("method", ["Cat", "Stack"])
def test_a_join_of_more_inputs_than_the_limit_is_refused_before_any_input_is_held(
    server: Any, stub: Stub, monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    x = stub.upload(np.ones(1, dtype=np.float32))
    held: list[int] = []
    sessions = server.daemon.sessions
    real_held = sessions.held
    monkeypatch.setattr(sessions, "held", lambda *a: held.append(len(a)) or real_held(*a))
    over = pb.CatRequest(handles=[x.handle] * (limits.MAX_CAT_INPUTS + 1))
    code, details, _ = rpc_error(lambda: getattr(stub, method)(over, metadata=stub.md))
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert "MAX_CAT_INPUTS" in details and str(limits.MAX_CAT_INPUTS + 1) in details
    assert held == []
    # at the limit it works, as torch's
    at = pb.CatRequest(handles=[x.handle] * limits.MAX_CAT_INPUTS)
    out = stub.download(getattr(stub, method)(at, metadata=stub.md))
    join = torch.cat if method == "Cat" else torch.stack
    np.testing.assert_array_equal(out, join([torch.ones(1)] * limits.MAX_CAT_INPUTS).numpy())


def test_the_store_refuses_a_long_join_before_holding_its_inputs(
    server: Any, stub: Stub, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = server.daemon
    session = store.sessions.peek(stub.session_id)
    x = stub.upload(np.ones(1, dtype=np.float32))
    monkeypatch.setattr(store.sessions, "held", lambda *a: pytest.fail("held an input"))
    for join in (store.copies.cat, store.copies.stack):
        with pytest.raises(ValueError, match="MAX_CAT_INPUTS"):
            join(session, [x.handle] * (limits.MAX_CAT_INPUTS + 1), 0)


def test_a_release_of_more_handles_than_the_limit_is_refused(server: Any, stub: Stub) -> None:
    x = stub.upload(np.ones(1, dtype=np.float32))
    over = [x.handle] + ["unknown"] * limits.MAX_RELEASE_HANDLES
    code, details, _ = rpc_error(
        lambda: stub.Release(pb.ReleaseRequest(handles=over), metadata=stub.md)
    )
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "MAX_RELEASE_HANDLES" in details
    assert x.handle in server.daemon.sessions.peek(stub.session_id).handles  # not released
    empty = pb.EmptyRequest(shape=[1], dtype="float32", device="cpu")
    code, details, _ = rpc_error(
        lambda: stub.EmptyExport(
            pb.EmptyExportRequest(empty=empty, release_handles=over), metadata=stub.md
        )
    )
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "MAX_RELEASE_HANDLES" in details


def test_an_index_longer_than_any_torch_takes_is_refused_by_its_length(stub: Stub) -> None:
    x = stub.upload(np.zeros((1,) * limits.MAX_DIMS, dtype=np.float32))
    # the longest index torch takes: an int for each of 64 dims, 64 Nones and an Ellipsis
    key = (0,) * limits.MAX_DIMS + (None,) * limits.MAX_DIMS + (Ellipsis,)
    assert len(key) == limits.MAX_INDEX_ITEMS
    items = [pb.IndexItem(integer=0)] * limits.MAX_DIMS + [pb.IndexItem(none=True)] * 64
    items.append(pb.IndexItem(ellipsis=True))
    (viewed,) = stub.view(x, index=pb.Index(items=items))
    assert tuple(viewed.shape) == torch.zeros((1,) * limits.MAX_DIMS)[key].shape
    longer = [*items, pb.IndexItem(slice=pb.Slice())]
    code, details, _ = rpc_error(lambda: stub.view(x, index=pb.Index(items=longer)))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "MAX_INDEX_ITEMS" in details
    for call in (
        lambda: stub.SetItem(
            pb.SetItemRequest(handle=x.handle, index=longer, scalar=pb.Scalar(int_value=1)),
            metadata=stub.md,
        ),
        lambda: stub.AdvancedIndex(
            pb.AdvancedIndexRequest(
                handle=x.handle, index=[pb.AdvancedIndexItem(basic=i) for i in longer]
            ),
            metadata=stub.md,
        ),
    ):
        code, details, _ = rpc_error(call)
        assert code is grpc.StatusCode.INVALID_ARGUMENT and "MAX_INDEX_ITEMS" in details


def _ids(n: int) -> list[str]:
    return [f"r{i:021d}" for i in range(n)]


def test_a_batch_is_bounded_by_its_ops_its_results_and_its_releases_together(
    server: Any, stub: Stub
) -> None:
    rows = stub.upload(np.zeros(limits.MAX_VIEW_RESULTS, dtype=np.float32))
    session = server.daemon.sessions.peek(stub.session_id)
    before = len(session.handles)
    unbind = pb.ViewRequest(handle=rows.handle, unbind=pb.Unbind(dim=0))
    one = _ids(limits.MAX_VIEW_RESULTS)
    two = [f"s{i:021d}" for i in range(limits.MAX_VIEW_RESULTS)]
    release = [pb.IndexItem(integer=0)]
    cases = {
        "MAX_BATCH_OPS": [
            pb.BatchOp(view=pb.ViewRequest(handle=rows.handle, index=pb.Index(items=release)))
        ]
        * (limits.MAX_BATCH_OPS + 1),
        # each op within its own limit, both together over the Batch's
        "MAX_BATCH_RESULTS": [
            pb.BatchOp(view=unbind, results=one),
            pb.BatchOp(view=unbind, results=two),
        ],
        "MAX_RELEASE_HANDLES": [
            pb.BatchOp(release=pb.ReleaseRequest(handles=[rows.handle] * 9000)),
            pb.BatchOp(release=pb.ReleaseRequest(handles=[rows.handle] * 9000)),
        ],
    }
    for name, ops in cases.items():
        code, details, _ = rpc_error(
            lambda ops=ops: stub.Batch(pb.BatchRequest(ops=ops), metadata=stub.md)
        )
        assert code is grpc.StatusCode.INVALID_ARGUMENT and name in details, details
        assert len(session.handles) == before  # no op was applied
    # each alone is within the limits
    answer = stub.Batch(pb.BatchRequest(ops=cases["MAX_BATCH_RESULTS"][:1]), metadata=stub.md)
    assert not answer.failed and len(session.handles) == before + limits.MAX_VIEW_RESULTS


def test_batch_refuses_more_results_than_its_limit_before_any_op_runs() -> None:
    view = batch.QueuedView("h", batch.ViewOp("unbind", (0,)), tuple(_ids(4)))
    with pytest.raises(ValueError, match="MAX_BATCH_RESULTS"):
        batch.check_batch([view] * (limits.MAX_BATCH_RESULTS // 4 + 1))


@pytest.fixture
def pipelined(server: Any) -> Iterator[tensord.Client]:
    with tensord.connect(server.address) as c:
        yield c


def test_the_sdk_sends_a_long_queue_in_batches_within_the_limits(
    server: Any, pipelined: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A queue longer than one Batch may be (an asyncio caller queues without waiting)
    goes in several Batches, in order, each within the ops' and the results' limits."""
    sizes: list[tuple[int, int]] = []
    real_run = batch.Batches.run

    def run(batches: Any, session: Any, ops: Any, **kwargs: Any) -> Any:
        results = sum(len(getattr(op, "results", ())) for op in ops)
        sizes.append((len(ops), results))
        return real_run(batches, session, ops, **kwargs)

    monkeypatch.setattr(batch.Batches, "run", run)
    conn = pipelined._conn
    x = pipelined.tensor(np.arange(4000, dtype=np.float32))
    conn.synchronize()
    sizes.clear()
    with monkeypatch.context() as held:
        held.setattr(conn, "flush_scheduler", lambda flush: None)  # nothing sent meanwhile
        with conn.pipeline._send_lock:  # nor by the background flusher
            rows = [x[i] for i in range(2500)]
            pieces = [x.narrow(0, 1000 * i, 1000).unbind() for i in range(3)]
    rows[2499].fill_(-1.0)
    conn.synchronize()
    assert sum(n for n, _ in sizes) >= 2500 + 3 + 1
    assert len(sizes) >= 3
    assert all(n <= limits.MAX_BATCH_OPS and r <= limits.MAX_BATCH_RESULTS for n, r in sizes)
    assert float(rows[2499].item()) == -1.0 and float(rows[5].item()) == 5.0
    assert [float(p[999].item()) for p in pieces] == [999.0, 1999.0, 2999.0]


def test_a_failed_batch_skips_the_batches_of_the_same_flush_after_it(
    server: Any, pipelined: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    conn = pipelined._conn
    x = pipelined.tensor(np.zeros(4, dtype=np.float32))
    conn.synchronize()
    writes = server.daemon.writes
    real_fill = writes.fill
    failed: list[str] = []

    def fill(session: Any, handle: str, value: Any) -> Any:
        if not failed:
            failed.append(handle)
            raise RuntimeError("the first fill fails")
        return real_fill(session, handle, value)

    monkeypatch.setattr(writes, "fill", fill)
    with monkeypatch.context() as held:
        held.setattr(conn, "flush_scheduler", lambda flush: None)
        with conn.pipeline._send_lock:
            for _ in range(limits.MAX_BATCH_OPS + 10):
                x.fill_(7.0)  # all after the first skipped with it, in its Batch and the next
    with pytest.raises(RuntimeError, match="the first fill fails"):
        conn.synchronize()
    assert x.tolist() == [0.0] * 4


@pytest.mark.slow
@pytest.mark.parametrize("pipelining", [True, False])
def test_a_long_split_chunk_or_unbind_is_sent_in_groups_with_torchs_results(
    server: Any, pipelining: bool
) -> None:
    n = limits.MAX_VIEW_RESULTS * 2 + 3
    data = np.arange(n * 2, dtype=np.float32).reshape(n, 2)
    with tensord.connect(server.address, pipelining=pipelining) as client:
        x = client.tensor(data)
        t = torch.from_numpy(data)
        cases = [
            (x.unbind(0), t.unbind(0)),
            (x.split(1), t.split(1)),
            (x.split(2), t.split(2)),
            (x.chunk(n), t.chunk(n)),
            (x.t().unbind(1), t.t().unbind(1)),
        ]
        empty = client.tensor(np.zeros((0, 2), dtype=np.float32))
        cases.append((empty.chunk(n), torch.zeros(0, 2).chunk(n)))
        for ours, theirs in cases:
            assert len(ours) == len(theirs)
            for a, b in zip(ours, theirs, strict=True):
                assert (tuple(a.shape), a.stride(), a.storage_offset()) == (
                    tuple(b.shape),
                    b.stride(),
                    b.storage_offset(),
                )
        assert ours[-1].tolist() == theirs[-1].tolist()
        np.testing.assert_array_equal(cases[0][0][n - 1].numpy(), data[n - 1])
        np.testing.assert_array_equal(cases[2][0][-1].numpy(), data[n - 1 :])


def test_the_sdk_sends_its_releases_within_the_release_limit() -> None:
    assert connection.RELEASE_BATCH <= protocol.MAX_RELEASE_HANDLES
    assert pipeline.PIPELINE_BATCH * 4 <= protocol.MAX_RELEASE_HANDLES
