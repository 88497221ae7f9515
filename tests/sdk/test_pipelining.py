"""Pipelining: queued views and writes, applied in the order issued, errors at the next wait."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from typing import Any

import grpc
import numpy as np
import pytest
import tensord
import torch
from conftest import server_allocated
from tensord import schema as pb


def test_views_and_writes_are_queued_not_sent(client: Any, server: Any) -> None:
    x = client.zeros(4, 3)
    before = server.daemon.sessions.handle_count(server.daemon.sessions.get(client.session_id))
    row = x[1]
    row.fill_(5)
    assert row.shape == (3,) and row.stride() == (1,) and row.storage_offset() == 3
    # nothing reached the server yet: the view's handle is not in the session
    session = server.daemon.sessions.get(client.session_id)
    assert server.daemon.sessions.handle_count(session) == before
    client.synchronize()
    assert server.daemon.sessions.handle_count(session) == before + 1


def test_write_then_read(client: Any) -> None:
    x = client.zeros(100, 2)
    oracle = torch.zeros(100, 2)
    for i in range(100):
        x[i].fill_(i)
        oracle[i].fill_(i)
    np.testing.assert_array_equal(x.numpy(), oracle.numpy())


def test_view_then_write_through_the_view(client: Any) -> None:
    x = client.zeros(3, 4)
    oracle = torch.zeros(3, 4)
    for t in (x, oracle):
        t.t()[2].fill_(7)
        t.transpose(0, 1).narrow(0, 0, 1).zero_()
        _, b = t.split(2)
        b.copy_(t[0:1])
        t[1, 1:3] = 9
        d = t.detach()
        d[0, 3] = -1
    np.testing.assert_array_equal(x.numpy(), oracle.numpy())
    assert x.detach().requires_grad is False


def test_release_then_reuse(client: Any, server: Any) -> None:
    session = server.daemon.sessions.get(client.session_id)
    x = client.zeros(8)
    client.synchronize()
    baseline = server.daemon.sessions.handle_count(session)
    for i in range(50):
        v = x[i % 8 : i % 8 + 1]
        v.fill_(i)
        del v  # released through the queue, after the view that issued it
    client.flush()
    assert server.daemon.sessions.handle_count(session) == baseline
    assert x.tolist() == [48.0, 49.0, 42.0, 43.0, 44.0, 45.0, 46.0, 47.0]


def test_error_surfaces_at_next_wait_naming_the_op(client: Any) -> None:
    x = client.zeros(4, dtype=torch.uint8)
    x.fill_(1)
    x.fill_(300)  # fits no uint8: only the server's kernel checks it
    x[0].fill_(2)  # skipped: it comes after the failure in the same batch
    with pytest.raises(RuntimeError, match=r"fill_ of .*failed on the server.*skipped"):
        x.numpy()
    assert x.tolist() == [1, 1, 1, 1]  # the first fill ran, the one after the error did not
    client.synchronize()  # the error was raised once


def test_unknown_client_ids_are_refused(server: Any, open_session: Any) -> None:
    session = open_session(server.address)
    meta = session.Empty(pb.EmptyRequest(shape=[4], dtype="float32"), metadata=session.md)

    def view_t(chosen: str) -> pb.BatchRequest:
        op = pb.BatchOp(view=pb.ViewRequest(handle=meta.handle, t=pb.T()), results=[chosen])
        return pb.BatchRequest(ops=[op])

    # malformed ids: the whole batch is refused before any op runs
    for chosen in ("short", "x" * 21 + "!"):
        with pytest.raises(grpc.RpcError) as info:
            session.Batch(view_t(chosen), metadata=session.md)
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    # a live id (here the input's own): the op fails and is named, nothing was renamed
    response = session.Batch(view_t(meta.handle), metadata=session.md)
    assert response.failed and response.failed_index == 0 and "live" in response.error_message
    ok = session.Batch(view_t("B" * 22), metadata=session.md)
    assert not ok.failed and ok.applied == 1
    again = session.Batch(view_t("B" * 22), metadata=session.md)  # never a live id twice
    assert again.failed
    # two results with one id: refused, and the view issued nothing
    op = pb.BatchOp(
        view=pb.ViewRequest(handle=meta.handle, chunk=pb.Chunk(chunks=2, dim=0)),
        results=["A" * 22, "A" * 22],
    )
    response = session.Batch(pb.BatchRequest(ops=[op]), metadata=session.md)
    assert response.failed and "twice" in response.error_message
    too_many = [pb.BatchOp(release=pb.ReleaseRequest(handles=["h"]))] * 4097
    with pytest.raises(grpc.RpcError) as info:
        session.Batch(pb.BatchRequest(ops=too_many), metadata=session.md)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT


def test_many_threads_share_one_client(client: Any) -> None:
    x = client.zeros(8, 64)

    def work(row: int) -> None:
        for j in range(64):
            x[row, j].fill_(row * 100 + j)
        assert x[row].tolist() == [row * 100 + j for j in range(64)]

    threads = [threading.Thread(target=work, args=(r,)) for r in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    expected = np.arange(64)[None, :] + 100 * np.arange(8)[:, None]
    np.testing.assert_array_equal(x.numpy(), expected)


@pytest.mark.slow
def test_killed_client_with_ops_queued_leaks_nothing(make_server: Any, wait_until: Any) -> None:
    server = make_server(lease=0.5, session_grace=0.2)
    before = server_allocated(server)
    script = textwrap.dedent(
        f"""
        import os, tensord
        c = tensord.connect({server.address!r})
        x = c.zeros(1024, 256)
        c.synchronize()
        views = [x[i] for i in range(200)]
        for v in views:
            v.fill_(1)
        print("queued", flush=True)
        os._exit(0)  # killed: no close, ops still queued
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert "queued" in done.stdout, done.stderr
    assert server_allocated(server) > before or server.daemon.sessions.session_ids() == []
    assert wait_until(lambda: server_allocated(server) == before, timeout=20)
    assert server.daemon.sessions.session_ids() == []


def test_pipelining_off_sends_each_op(server: Any) -> None:
    with tensord.connect(server.address, pipelining=False) as c:
        x = c.zeros(2, dtype=torch.uint8)
        with pytest.raises(RuntimeError):
            x.fill_(300)  # raised at once, as before
        assert not c.pipelining


def test_a_batch_stops_at_the_next_op_once_its_caller_is_gone(make_server: Any) -> None:
    # found by an attacker's read: a Batch of 4,096 element-limit ops went on working for a
    # caller that had already given up (DEADLINE_EXCEEDED after 0.2 s, 3 s of fills after)
    from conftest import SessionStub, open_channel
    from tensord_server.domain.ops import batch

    running = make_server()
    with open_channel(running.address) as channel:
        stub = SessionStub(channel)
        meta = stub.upload(np.zeros(4, np.float32))
        session = running.daemon.sessions.peek(stub.session_id)
        ops = [batch.QueuedFill(meta.handle, float(i)) for i in range(1, 6)]
        answers = iter([True, True, False])  # the call goes inactive before the third op
        outcome = running.daemon.batches.run(session, ops, keep_going=lambda: next(answers))
        assert (outcome.applied, outcome.failed_index) == (2, 2)
        assert isinstance(outcome.error, tensord.DeadlineExceededError)
        np.testing.assert_array_equal(stub.download(meta), np.full(4, 2.0, np.float32))
        stub.close()


def test_a_batch_has_one_element_budget_for_all_its_ops(make_server: Any) -> None:
    # found by an attacker's read: each op was bounded by --max-op-elements alone, so one
    # Batch of 4,096 ops held a worker for 4,096 times the per-op cost
    from conftest import SessionStub, open_channel
    from tensord_server.domain.ops import batch

    running = make_server(max_op_elements=1000, max_batch_elements=2500)
    with open_channel(running.address) as channel:
        stub = SessionStub(channel)
        meta = stub.upload(np.zeros(1000, np.float32))
        session = running.daemon.sessions.peek(stub.session_id)
        ops = [batch.QueuedFill(meta.handle, float(i)) for i in range(1, 6)]
        outcome = running.daemon.batches.run(session, ops)
        # 1,000 + 1,000 elements fit; the third fill would make 3,000: refused before its work
        assert (outcome.applied, outcome.failed_index) == (2, 2)
        assert isinstance(outcome.error, tensord.ResourceExhaustedError)
        assert "--max-batch-elements 2500" in str(outcome.error)
        np.testing.assert_array_equal(stub.download(meta), np.full(1000, 2.0, np.float32))
        # the budget is the batch's: the next batch starts from nothing (views cost none)
        view = pb.BatchOp(view=pb.ViewRequest(handle=meta.handle, t=pb.T()), results=["C" * 22])
        fill = pb.BatchOp(fill=pb.FillRequest(handle=meta.handle, value=pb.Scalar(float_value=7)))
        response = stub.Batch(pb.BatchRequest(ops=[view, fill, fill, fill]), metadata=stub.md)
        assert response.failed and response.applied == 3 and response.failed_index == 3
        assert response.error_code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert "--max-batch-elements" in response.error_message
        # outside a Batch an op is bounded by --max-op-elements alone
        for _ in range(4):
            stub.Fill(
                pb.FillRequest(handle=meta.handle, value=pb.Scalar(float_value=1)), metadata=stub.md
            )
        stub.close()


def test_a_batch_request_holds_a_bounded_number_of_list_items(server: Any, open_session) -> None:
    # found by an attacker's read: each op's lists were bounded alone, so one Batch could
    # nest 4,096 x 65,536 index items (within the message size, a million of them took
    # minutes to walk and apply); the request's items are counted together as it is checked
    from tensord_server.domain import limits

    session = open_session(server.address)
    meta = session.Empty(pb.EmptyRequest(shape=[4], dtype="float32"), metadata=session.md)
    many = [pb.IndexItem(ellipsis=True)] * limits.MAX_INDEX_ITEMS
    op = pb.BatchOp(
        set_item=pb.SetItemRequest(handle=meta.handle, index=many, scalar=pb.Scalar(int_value=1))
    )
    ops = [op] * (limits.MAX_REQUEST_ITEMS // limits.MAX_INDEX_ITEMS + 1)
    with pytest.raises(grpc.RpcError) as info:
        session.Batch(pb.BatchRequest(ops=ops), metadata=session.md)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "MAX_REQUEST_ITEMS" in info.value.details()


def _count_unary_calls(conn: Any, monkeypatch: Any) -> list[str]:
    """The unary RPCs ``conn`` makes from now on (a Batch is not one: it is a future)."""
    calls: list[str] = []
    unary = conn._unary

    def counting(method: str, *args: Any, **kwargs: Any) -> Any:
        calls.append(method)
        return unary(method, *args, **kwargs)

    monkeypatch.setattr(conn, "_unary", counting)
    return calls


def test_requires_grad_and_copying_reshape_are_queued(client: Any, monkeypatch: Any) -> None:
    x = client.arange(12, dtype=torch.float32).view(3, 4)
    oracle = torch.arange(12, dtype=torch.float32).view(3, 4)
    client.synchronize()
    calls = _count_unary_calls(client._conn, monkeypatch)
    y, y_oracle = x.t().reshape(2, 6), oracle.t().reshape(2, 6)  # no view can: a copy
    f, f_oracle = x.t().flatten(), oracle.t().flatten()  # the same through flatten
    row = y[1]  # a view of a copy not yet made
    assert x.requires_grad_() is x and x.requires_grad and oracle.requires_grad_().requires_grad
    assert calls == []  # nothing waited for the server (the flusher sends the Batch)
    for ours, theirs in ((y, y_oracle), (f, f_oracle), (row, y_oracle[1])):
        assert ours.shape == theirs.shape and ours.stride() == theirs.stride()
        assert ours.storage_offset() == theirs.storage_offset()
    assert (y.requires_grad, x.t().reshape(12).requires_grad) == (False, True)
    # the copies' Storages are the server's: their facts come with the Batch's answer
    assert y.untyped_storage().nbytes() == 48 and row.data_ptr() == y.data_ptr() + 24
    assert y.data_ptr() not in (x.data_ptr(), f.data_ptr())
    assert calls == []
    y.fill_(-1)  # a copy: x is untouched
    assert row.tolist() == y_oracle.detach().fill_(-1)[1].tolist() == [-1.0] * 6
    assert f.tolist() == f_oracle.tolist()
    assert x.detach().tolist() == oracle.detach().tolist()
    with pytest.raises(RuntimeError, match=r"^only Tensors of floating point dtype can require"):
        client.arange(3).requires_grad_()  # refused at once, as torch (nothing queued)
    client.synchronize()


def test_a_queued_reshape_that_fails_is_named_at_the_next_wait(make_server: Any) -> None:
    server = make_server(max_op_elements=8)
    with tensord.connect(server.address) as c:
        x = c.tensor(np.zeros((3, 4), np.float32))  # an upload: no element limit
        y = x.t().reshape(12)  # 12 elements to copy: over the server's limit
        assert y.shape == (12,)
        with pytest.raises(tensord.ResourceExhaustedError, match=r"reshape of .*failed on the"):
            c.synchronize()
        with pytest.raises(RuntimeError, match="Storage was never made"):
            y.data_ptr()
        assert x[0].tolist() == [0.0] * 4  # the session goes on


def test_a_queued_view_makes_no_system_call_and_no_finalizer(client: Any, monkeypatch: Any) -> None:
    # a queued view's hot path, as the caller sees it: an os.getpid() (a system call) per
    # view or a weakref.finalize per Tensor would cost more than the view's own work, so
    # the fork hooks keep the pid and a Tensor releases from __del__
    import os
    import weakref

    x = client.arange(12)
    x[0]  # the first draw of random ids is allowed its system call
    counts = {"getpid": 0, "finalize": 0}
    getpid, finalize = os.getpid, weakref.finalize

    def counting_getpid() -> int:
        counts["getpid"] += 1
        return getpid()

    def counting_finalize(*args: Any, **kwargs: Any) -> Any:
        counts["finalize"] += 1
        return finalize(*args, **kwargs)

    monkeypatch.setattr(os, "getpid", counting_getpid)
    monkeypatch.setattr(weakref, "finalize", counting_finalize)
    views = [x[i % 12] for i in range(100)] + [x.t() for _ in range(10)]
    monkeypatch.undo()
    assert counts == {"getpid": 0, "finalize": 0}
    assert [v.item() for v in views[:12]] == list(range(12))


def test_a_queued_view_builds_no_protobuf_op_until_its_batch(client: Any, monkeypatch: Any) -> None:
    # a queued view's hot path: a BatchOp built per view (its ViewRequest copied in) would
    # be copied again into the BatchRequest at the flush, so the queue keeps plain values
    # and the flush fills each op of the request in place
    x = client.arange(12).view(3, 4)
    client.synchronize()
    built = 0
    batch_op = pb.BatchOp

    def counting(*args: Any, **kwargs: Any) -> Any:
        nonlocal built
        built += 1
        return batch_op(*args, **kwargs)

    monkeypatch.setattr(pb, "BatchOp", counting)
    views = [x[i % 3] for i in range(30)] + [x.t(), x.narrow(1, 1, 2), x.view(4, 3)]
    views[0].fill_(7)
    client.synchronize()
    monkeypatch.undo()
    assert built == 0
    oracle = torch.arange(12).view(3, 4)
    oracle[0].fill_(7)
    np.testing.assert_array_equal(views[1].numpy(), oracle[1].numpy())
    np.testing.assert_array_equal(views[30].numpy(), oracle.t().numpy())
    np.testing.assert_array_equal(views[31].numpy(), oracle.narrow(1, 1, 2).numpy())
    np.testing.assert_array_equal(views[32].numpy(), oracle.view(4, 3).numpy())


def test_a_queued_fill_takes_the_storage_registry_lock_twice(
    server: Any, open_session: Any, monkeypatch: Any
) -> None:
    # the server's cost per op: letting go of an op's input (the hold, then the reference)
    # takes the registry's lock once, not once for each
    from tensord_server.pool.locks import CountingLock

    session = open_session(server.address)
    meta = session.Empty(pb.EmptyRequest(shape=[4], dtype="float32"), metadata=session.md)
    registry_lock = server.daemon.storages._lock
    taken = 0
    acquire = CountingLock.acquire

    def counting(self: CountingLock, blocking: bool = True, timeout: float = -1) -> bool:
        nonlocal taken
        taken += self is registry_lock
        return acquire(self, blocking, timeout)

    fill = pb.BatchOp(fill=pb.FillRequest(handle=meta.handle, value=pb.Scalar(int_value=3)))
    monkeypatch.setattr(CountingLock, "acquire", counting)
    response = session.Batch(pb.BatchRequest(ops=[fill]), metadata=session.md)
    monkeypatch.undo()
    assert response.applied == 1 and not response.failed
    assert taken == 2  # one to hold the input, one to let it go
    np.testing.assert_array_equal(session.download(meta), np.full(4, 3, np.float32))


def test_the_server_registers_chosen_ids_without_drawing_its_own(
    server: Any, open_session: Any, monkeypatch: Any
) -> None:
    # a queued view drew a random id (secrets.token_urlsafe), then renamed it to the
    # client's: the draw and the rename were a fifth of the server's work per view
    from tensord_server.domain import sessions

    session = open_session(server.address)
    meta = session.Empty(pb.EmptyRequest(shape=[4, 3], dtype="float32"), metadata=session.md)
    drawn: list[str] = []
    capability = sessions.new_capability

    def counting() -> str:
        drawn.append(capability())
        return drawn[-1]

    monkeypatch.setattr(sessions, "new_capability", counting)
    chosen = [f"{i:022d}" for i in range(3)]
    ops = [
        pb.BatchOp(
            view=pb.ViewRequest(
                handle=meta.handle, index=pb.Index(items=[pb.IndexItem(integer=i)])
            ),
            results=[chosen[i]],
        )
        for i in range(3)
    ]
    response = session.Batch(pb.BatchRequest(ops=ops), metadata=session.md)
    assert not response.failed and response.applied == 3
    assert drawn == []
    for i, handle in enumerate(chosen):
        (row,) = session.View(pb.ViewRequest(handle=handle, t=pb.T()), metadata=session.md).tensors
        assert (tuple(row.shape), row.storage_offset) == ((3,), 3 * i)


def test_releases_in_a_batch_that_fails_before_them_are_sent_again(
    client: Any, server: Any
) -> None:
    # a Batch's releases ride at its end: an op failing earlier skipped them, and their
    # handles (and Storages) stayed in the session until it ended
    session = server.daemon.sessions.get(client.session_id)
    x = client.zeros(4, dtype=torch.uint8)
    client.synchronize()
    baseline = server.daemon.sessions.handle_count(session)
    dropped = client.zeros(1000)
    client.synchronize()
    del dropped  # its release waits for the next Batch
    x.fill_(300)  # fits no uint8: fails on the server, before the release in its Batch
    with pytest.raises(RuntimeError, match=r"fill_ of .*failed on the server"):
        client.synchronize()
    client.synchronize()
    assert server.daemon.sessions.handle_count(session) == baseline


def test_a_flush_with_nothing_to_send_stays_on_the_main_thread(
    client: Any, server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read's settle with nothing queued or in flight costs no hop to the worker; one
    with an op queued still sends it, and waits for it."""
    from tensord.wire import batches, connection

    hops: list[Any] = []
    real = connection.off_main_thread

    def counted(work: Any, *args: Any) -> Any:
        if threading.current_thread() is threading.main_thread():  # not the flusher's tick
            hops.append(work)
        return real(work, *args)

    x = client.zeros(4, 3)
    client.synchronize()
    monkeypatch.setattr(connection, "off_main_thread", counted)
    monkeypatch.setattr(batches, "off_main_thread", counted)  # the pipeline's flushes
    client.synchronize()
    client.flush()
    assert hops == []
    session = server.daemon.sessions.get(client.session_id)
    before = server.daemon.sessions.handle_count(session)
    row = x[1]
    client.synchronize()
    assert len(hops) == 1
    assert server.daemon.sessions.handle_count(session) == before + 1
    assert row.numpy().tolist() == [0.0, 0.0, 0.0]


def test_queued_name_deletes_are_split_into_batches_the_server_takes() -> None:
    from tensord.protocol import MAX_NAME_ITEMS, MAX_REQUEST_ITEMS
    from tensord.wire import pipeline, requests

    names = [f"n{i}" for i in range(MAX_NAME_ITEMS)]
    op = pipeline.QueuedOp(
        "DeleteNames", "delete_many", "n0", requests.delete_names(names), (), None
    )
    count = MAX_REQUEST_ITEMS // MAX_NAME_ITEMS + 2
    parts = pipeline.batch_parts([op] * count, [])
    assert sum(len(part) for part, _ in parts) == count
    for part, _ in parts:
        assert sum(len(queued.message.names) for queued in part) <= pipeline.MAX_BATCH_NAMES
        assert pipeline.MAX_BATCH_NAMES < MAX_REQUEST_ITEMS
        assert requests.batch(part, []).ByteSize() > 0


def test_a_full_queue_is_sent_by_the_flusher_not_by_its_caller(
    client: Any, server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loop of queued deletes well past a Batch's size never waits for the server (no
    flush runs on its thread: the flusher thread sends each full queue), and every delete
    is applied by the next wait; only a queue of PIPELINE_QUEUE_MAX makes its caller send."""
    from tensord.wire import batches, connection, pipeline

    count = 3 * pipeline.PIPELINE_BATCH_MAX
    names = [f"full-queue-{i}" for i in range(count)]
    one = np.ones(4, dtype=np.float32)
    for start in range(0, count, 256):
        client.put_many(dict.fromkeys(names[start : start + 256], one))
    client.synchronize()
    flushed_by: list[str] = []
    real = batches.Pipeline._flush_now

    def recorded(self: Any, wait: bool, releases: bool) -> None:
        flushed_by.append(threading.current_thread().name)
        real(self, wait, releases)

    monkeypatch.setattr(batches.Pipeline, "_flush_now", recorded)
    caller = threading.current_thread().name
    monkeypatch.setattr(connection, "off_main_thread", lambda work, *args: work())
    monkeypatch.setattr(batches, "off_main_thread", lambda work, *args: work())
    for name in names:
        client.delete(name, wait=False)
    assert caller not in flushed_by, flushed_by
    client.synchronize()
    assert not [n for n in client.names() if n.startswith("full-queue-")]
    assert count < pipeline.PIPELINE_QUEUE_MAX
