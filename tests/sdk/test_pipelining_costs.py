"""Pipelining's cost per queued op: what a view costs the server and its caller,
counted (lock acquisitions, ops sent), never timed."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import torch
from tensord import schema as pb
from tensord.wire import batches as pipeline_batches


def _count_acquisitions(monkeypatch: Any, *locks: Any) -> list[int]:
    """Counts of acquire() of each of ``locks`` from now until monkeypatch.undo()."""
    from tensord_server.pool.locks import CountingLock

    taken = [0] * len(locks)
    acquire = CountingLock.acquire

    def counting(self: CountingLock, blocking: bool = True, timeout: float = -1) -> bool:
        for i, lock in enumerate(locks):
            taken[i] += self is lock
        return bool(acquire(self, blocking, timeout))

    monkeypatch.setattr(CountingLock, "acquire", counting)
    return taken


def _row_view(handle: str, row: int, result: str) -> pb.BatchOp:
    index = pb.Index(items=[pb.IndexItem(integer=row)])
    return pb.BatchOp(view=pb.ViewRequest(handle=handle, index=index), results=[result])


def test_a_run_of_views_and_releases_takes_each_lock_once(
    server: Any, open_session: Any, monkeypatch: Any
) -> None:
    # the server's cost per queued view: one view takes three steps (hold the input,
    # register the result, let the input go) and its release one more, but a run of views
    # and releases takes the registry's lock once (to settle its references) and the table
    # lock not at all (its session's lock instead), not each lock at every step
    from tensord_server.domain.ops.batch import RUN_OPS

    session = open_session(server.address)
    meta = session.Empty(pb.EmptyRequest(shape=[12], dtype="float32"), metadata=session.md)
    chosen = [f"{i:022d}" for i in range(RUN_OPS - 1)]
    ops = [_row_view(meta.handle, i % 12, h) for i, h in enumerate(chosen)]
    ops.append(pb.BatchOp(release=pb.ReleaseRequest(handles=chosen[:10])))
    daemon = server.daemon
    taken = _count_acquisitions(monkeypatch, daemon.sessions._lock, daemon.storages._lock)
    response = session.Batch(pb.BatchRequest(ops=ops), metadata=session.md)
    monkeypatch.undo()
    assert not response.failed and response.applied == RUN_OPS
    assert taken == [0, 1]
    # the views are there (and the released ones gone), with torch's geometry
    kept = daemon.sessions.get(session.session_id).handles
    assert not set(chosen[:10]) & kept.keys()
    for i, handle in enumerate(chosen[10:], start=10):
        assert kept[handle].layout.offset == torch.arange(12)[i % 12].storage_offset()
    session.Release(pb.ReleaseRequest(handles=chosen), metadata=session.md)


def test_a_view_failing_in_a_run_keeps_the_ops_before_it(server: Any, open_session: Any) -> None:
    # a run applies its ops one by one: the op that fails stops the batch there, the views
    # before it are registered and a release before it has dropped its handles
    session = open_session(server.address)
    meta = session.Empty(pb.EmptyRequest(shape=[4], dtype="float32"), metadata=session.md)
    ops = [_row_view(meta.handle, 0, "a" * 22), _row_view(meta.handle, 1, "b" * 22)]
    ops.append(pb.BatchOp(release=pb.ReleaseRequest(handles=["a" * 22])))
    ops.append(_row_view(meta.handle, 9, "c" * 22))  # out of range: torch's IndexError
    ops.append(_row_view(meta.handle, 2, "d" * 22))  # skipped
    response = session.Batch(pb.BatchRequest(ops=ops), metadata=session.md)
    assert response.failed and (response.applied, response.failed_index) == (3, 3)
    assert response.error_type == "IndexError"
    with pytest.raises(IndexError) as expected:
        torch.zeros(4)[9]
    assert response.error_message == str(expected.value)
    handles = server.daemon.sessions.get(session.session_id).handles
    assert "b" * 22 in handles
    assert not {"a" * 22, "c" * 22, "d" * 22} & handles.keys()
    (row,) = session.View(pb.ViewRequest(handle="b" * 22, t=pb.T()), metadata=session.md).tensors
    np.testing.assert_array_equal(session.download(row), np.zeros((), np.float32))


@pytest.fixture
def ops_sent(monkeypatch: Any) -> list[str]:
    """The kind of every op the server's Batch handler is given, from now on."""
    from tensord_server.domain.ops import batch

    sent: list[str] = []
    run = batch.Batches.run

    def recording(batches: Any, session: Any, ops: Any, *args: Any, **kwargs: Any) -> Any:
        sent.extend(type(op).__name__ for op in ops)
        return run(batches, session, ops, *args, **kwargs)

    monkeypatch.setattr(batch.Batches, "run", recording)
    return sent


def test_a_dropped_unused_view_is_never_sent(
    client: Any, server: Any, ops_sent: list[str], monkeypatch: Any
) -> None:
    # a view dropped before its Batch, that nothing used, would cost the server a
    # registration and a release for nothing: it is removed from the queue instead
    x = client.arange(12).view(3, 4)
    client.synchronize()
    # the background flusher may send a view while its statement still holds it (it is
    # alive then, so sent, rightly): it sleeps through this test (once its 50 ms wait ends)
    monkeypatch.setattr(pipeline_batches, "RELEASE_INTERVAL_S", 3600.0)
    time.sleep(0.2)
    session = server.daemon.sessions.get(client.session_id)
    handles = server.daemon.sessions.handle_count(session)
    ops_sent.clear()
    for i in range(300):  # more than a batch: a full queue would flush
        x[i % 3]
        x.t()
        x.narrow(1, 1, 2)
        x.select(0, 2)
        x[1:3, ..., 0:2]
        x.transpose(0, 1)
    client.synchronize()
    assert ops_sent == []
    assert server.daemon.sessions.handle_count(session) == handles


def test_views_that_are_used_or_may_fail_are_still_sent(
    client: Any, server: Any, ops_sent: list[str]
) -> None:
    # eliding must change nothing observable: a view an op, another view or a call used
    # goes to the server even once dropped, and so do views the server might refuse
    x = client.arange(12).view(3, 4)
    oracle = torch.arange(12).view(3, 4)
    client.synchronize()
    ops_sent.clear()
    for t in (x, oracle):
        row = t[1]
        row.fill_(-1)  # used by a later op
        del row
        part = t[0:2]
        inner = part[1, 1:3]  # its base is a queued view
        del part
        inner.zero_()
        del inner
    np.testing.assert_array_equal(x.numpy(), oracle.numpy())
    assert ops_sent.count("QueuedView") == 3 and ops_sent.count("QueuedFill") == 2
    # a handle read for a call (the temporary is gone before the call runs)
    reply = client._conn.call("View", pb.ViewRequest(handle=x[2].handle, t=pb.T()))
    (meta,) = reply.tensors
    assert (tuple(meta.shape), meta.storage_offset) == ((4,), 8)
    # views the server may refuse (a new dim, a step, a bound past the sizes) are sent
    ops_sent.clear()
    x[None]
    x[::2]
    x[0:100]
    x.view(12)
    client.synchronize()
    assert ops_sent.count("QueuedView") == 4


def test_eliding_from_many_threads_keeps_every_kept_view(client: Any, server: Any) -> None:
    # threads queue views, drop most at once and keep some: only dropped ones are elided
    import threading

    x = client.arange(12)
    client.synchronize()
    session = server.daemon.sessions.get(client.session_id)
    handles = server.daemon.sessions.handle_count(session)
    kept: list[list[Any]] = [[] for _ in range(4)]

    def work(n: int) -> None:
        for i in range(400):
            view = x[(i + n) % 12]
            if i % 7 == 0:
                kept[n].append(((i + n) % 12, view))

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    read = [[(row, view.item()) for row, view in views] for views in kept]
    assert sum(map(len, read)) == 4 * 58 and all(row == value for r in read for row, value in r)
    kept.clear()
    client.synchronize()
    client.synchronize()  # the releases of the kept views, in the first one's Batch
    assert server.daemon.sessions.handle_count(session) == handles


def test_a_batch_of_int_index_views_is_bounded_without_the_generic_walk(
    server: Any, open_session: Any, monkeypatch: Any
) -> None:
    # the server's cost per queued x[i]: the request's generic bounds walk and generic
    # decode would take as long as applying the view, so x[i] ops are bounded and read
    # field by field (other ops are walked)
    from tensord_server.domain import limits

    session = open_session(server.address)
    meta = session.Empty(pb.EmptyRequest(shape=[12], dtype="float32"), metadata=session.md)
    chosen = [f"{i:022d}" for i in range(20)]
    ops = [_row_view(meta.handle, i % 12, h) for i, h in enumerate(chosen)]
    ops.append(pb.BatchOp(release=pb.ReleaseRequest(handles=chosen)))
    walked: list[str] = []
    check_request = limits.check_request

    def recording(message: Any, *args: Any) -> None:
        walked.append(message.DESCRIPTOR.name)
        check_request(message, *args)

    monkeypatch.setattr(limits, "check_request", recording)
    response = session.Batch(pb.BatchRequest(ops=ops), metadata=session.md)
    monkeypatch.undo()
    assert not response.failed and response.applied == 21
    assert walked == ["BatchOp", "ReleaseRequest"]  # the release alone


def _batch_ops_to_bound() -> list[pb.BatchOp]:
    """x[i] ops at and past each bound the walk checks, and ops that only look like x[i]."""
    long_id, ok_id = "é" * 2049, "a" * 22  # 4,098 bytes in UTF-8; 22
    index = pb.Index(items=[pb.IndexItem(integer=-(2**63))])
    two = pb.Index(items=[pb.IndexItem(integer=1), pb.IndexItem(integer=2**62)])
    big_slice = pb.Index(items=[pb.IndexItem(slice=pb.Slice(start=2**60))])
    return [
        pb.BatchOp(view=pb.ViewRequest(handle=ok_id, index=index), results=[ok_id]),
        pb.BatchOp(view=pb.ViewRequest(handle=long_id, index=index), results=[ok_id]),
        pb.BatchOp(view=pb.ViewRequest(handle="é" * 1024, index=index), results=[ok_id]),
        pb.BatchOp(view=pb.ViewRequest(handle=ok_id, index=index), results=[ok_id, long_id]),
        pb.BatchOp(view=pb.ViewRequest(handle=ok_id, index=index), results=[ok_id] * 65537),
        pb.BatchOp(view=pb.ViewRequest(handle=ok_id, index=index), results=[ok_id] * 65536),
        pb.BatchOp(view=pb.ViewRequest(handle=ok_id, index=two), results=[ok_id]),
        pb.BatchOp(view=pb.ViewRequest(handle=ok_id, index=big_slice), results=[ok_id]),
        pb.BatchOp(view=pb.ViewRequest(handle=long_id, t=pb.T()), results=[ok_id]),
    ]


@pytest.mark.parametrize("repeat", [1, 17])
@pytest.mark.parametrize("position", range(9))
def test_the_batch_bounds_are_the_walks(position: int, repeat: int) -> None:
    # the x[i] ops' own checks must refuse exactly what the generic walk refuses, with
    # its text (the lists' total too: 17 ops of 65,536 results are over 2**20 items)
    from tensord.errors import InvalidArgumentError
    from tensord_server.domain import limits

    request = pb.BatchRequest(ops=[_batch_ops_to_bound()[position]] * repeat)

    def outcome(check: Any) -> str:
        try:
            check(request)
        except InvalidArgumentError as exc:
            return str(exc)
        return "accepted"

    assert outcome(limits.check_batch_request) == outcome(limits.check_request)


def test_a_fill_asks_numpy_for_no_integer_limits(client: Any, monkeypatch: Any) -> None:
    # the server's cost per queued x[i].fill_(i): an np.iinfo per fill of an integer tensor
    # would be a tenth of the fill, so the limits of each dtype are kept
    x = client.zeros(8, dtype=torch.int16)
    x[0].fill_(1)
    client.synchronize()
    asked = 0
    iinfo = np.iinfo

    def counting(*args: Any) -> Any:
        nonlocal asked
        asked += 1
        return iinfo(*args)

    monkeypatch.setattr(np, "iinfo", counting)
    for i in range(8):
        x[i].fill_(i - 4)
    client.synchronize()
    monkeypatch.undo()
    assert asked == 0
    np.testing.assert_array_equal(x.numpy(), np.arange(8, dtype=np.int16) - 4)
    with pytest.raises(RuntimeError) as expected:
        torch.zeros(1, dtype=torch.int16).fill_(2**15)
    x[0].fill_(2**15)
    with pytest.raises(RuntimeError, match=r"fill_ of .* failed on the server") as got:
        client.synchronize()
    assert str(got.value).startswith(str(expected.value))


def test_a_full_queue_keeps_filling_while_the_batch_before_is_on_the_server(
    client: Any, server: Any, monkeypatch: Any
) -> None:
    # many clients: a queue that waited for its Batch at 256 ops would leave the 50 ms
    # flusher to send what came meanwhile, many small Batches (an RPC's cost each) from
    # clients waiting on a busy server, so it fills up to 1,024 ops
    import threading

    from tensord.wire.pipeline import PIPELINE_BATCH, PIPELINE_BATCH_MAX
    from tensord_server.domain.ops import batch

    x = client.arange(12)
    client.synchronize()
    gate, entered, sizes = threading.Event(), threading.Event(), []
    run = batch.Batches.run

    def held(batches: Any, session: Any, ops: Any, *args: Any, **kwargs: Any) -> Any:
        sizes.append(len(ops))
        entered.set()
        gate.wait(30)  # the first Batch stays on the server until the test lets it go
        return run(batches, session, ops, *args, **kwargs)

    monkeypatch.setattr(batch.Batches, "run", held)
    views = [x[i % 12].view(1) for i in range(PIPELINE_BATCH // 2)]  # 256 ops: one Batch
    assert entered.wait(30)
    queued = threading.Event()

    def more() -> None:
        views.extend(x[i % 12].view(1) for i in range(PIPELINE_BATCH_MAX // 2 - 1))
        queued.set()

    worker = threading.Thread(target=more)
    worker.start()
    did_not_wait = queued.wait(30)  # before: the 512th op waited for the held Batch
    gate.set()
    worker.join()
    client.synchronize()
    monkeypatch.undo()
    assert did_not_wait
    # each Batch: its views, then one op releasing the dropped x[i] they were made from
    assert sizes == [PIPELINE_BATCH + 1, 2 * (PIPELINE_BATCH_MAX // 2 - 1) + 1]
    assert [v.item() for v in views[:24]] == [i % 12 for i in range(24)]


def _split_view(handle: str, results: list[str]) -> pb.BatchOp:
    split = pb.Split(split_size=1, dim=0)
    return pb.BatchOp(view=pb.ViewRequest(handle=handle, split=split), results=results)


def test_a_run_names_a_bounded_number_of_handles(
    server: Any, open_session: Any, monkeypatch: Any
) -> None:
    # a run held the table and registry locks (every session's calls wait) for all its ops:
    # 64 splits or releases naming 65,536 handles each were seconds under them (15 splits,
    # ~1M results: ~14 s); a run names at most RUN_HANDLES handles now, a bigger op runs alone
    from tensord_server.domain import sessions
    from tensord_server.domain.ops.batch import RUN_HANDLES

    session = open_session(server.address)
    rows = RUN_HANDLES + 8
    meta = session.Empty(pb.EmptyRequest(shape=[rows], dtype="float32"), metadata=session.md)
    firsts = [f"a{i:021d}" for i in range(rows)]
    seconds = [f"b{i:021d}" for i in range(rows)]
    small = [f"c{i:021d}" for i in range(RUN_HANDLES // 2 + 1)]
    ops = [_split_view(meta.handle, firsts), _split_view(meta.handle, seconds)]
    ops += [_row_view(meta.handle, i % rows, h) for i, h in enumerate(small)]
    ops.append(pb.BatchOp(release=pb.ReleaseRequest(handles=firsts)))
    ops.append(pb.BatchOp(release=pb.ReleaseRequest(handles=small)))
    named: list[int] = []  # handles registered and released under each acquisition
    register, release = sessions.HandleRun.register, sessions.HandleRun.release
    handle_run = sessions.SessionManager.handle_run

    def counted_run(self: Any, session: Any) -> Any:
        named.append(0)
        return handle_run(self, session)

    def counted_register(self: Any, refs: Any, chosen: Any) -> None:
        named[-1] += len(chosen)
        register(self, refs, chosen)

    def counted_release(self: Any, handles: Any) -> int:
        named[-1] += len(handles)
        return release(self, handles)

    monkeypatch.setattr(sessions.SessionManager, "handle_run", counted_run)
    monkeypatch.setattr(sessions.HandleRun, "register", counted_register)
    monkeypatch.setattr(sessions.HandleRun, "release", counted_release)
    response = session.Batch(pb.BatchRequest(ops=ops), metadata=session.md)
    monkeypatch.undo()
    assert not response.failed and response.applied == len(ops)
    assert named and max(named) <= RUN_HANDLES
    # the same results: the second split's views and nothing else of the batch live
    kept = server.daemon.sessions.get(session.session_id).handles
    assert not (set(firsts) | set(small)) & kept.keys()
    for i, handle in enumerate(seconds):
        assert kept[handle].layout.offset == torch.arange(rows).split(1)[i].storage_offset()
    session.Release(pb.ReleaseRequest(handles=seconds), metadata=session.md)


def test_a_view_in_a_run_naming_fewer_results_is_refused_before_any_is_built(
    server: Any, open_session: Any, monkeypatch: Any
) -> None:
    # a split naming one result id was weighed as one handle, then built its 1,024 views
    # under the locks before registering refused the count; now refused before building
    from tensord_server.domain.ops import views

    session = open_session(server.address)
    meta = session.Empty(pb.EmptyRequest(shape=[1024], dtype="float32"), metadata=session.md)
    built: list[str] = []
    apply_view = views.apply_view

    def recording(ref: Any, op: Any) -> Any:
        built.append(op.name)
        return apply_view(ref, op)

    monkeypatch.setattr(views, "apply_view", recording)
    ops = [_split_view(meta.handle, ["d" * 22])]
    response = session.Batch(pb.BatchRequest(ops=ops), metadata=session.md)
    monkeypatch.undo()
    assert response.failed and (response.applied, response.failed_index) == (0, 0)
    assert response.error_type == "ValueError"  # InvalidArgumentError, as torch names it
    assert response.error_message == (
        "the op made 1024 tensors but the batch named 1 result handles"
    )
    assert built == []
    assert "d" * 22 not in server.daemon.sessions.get(session.session_id).handles
