"""Pipelining's cost per queued op (issue 15): what a view costs the server and its caller,
counted (lock acquisitions, ops sent), never timed."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from tensord._proto.tensord.v1 import tensord_pb2 as pb


def _count_acquisitions(monkeypatch: Any, *locks: Any) -> list[int]:
    """Counts of acquire() of each of ``locks`` from now until monkeypatch.undo()."""
    from tensord_server.pool.locks import CountingLock

    taken = [0] * len(locks)
    acquire = CountingLock.acquire

    def counting(self: CountingLock, blocking: bool = True, timeout: float = -1) -> bool:
        for i, lock in enumerate(locks):
            taken[i] += self is lock
        return acquire(self, blocking, timeout)

    monkeypatch.setattr(CountingLock, "acquire", counting)
    return taken


def _row_view(handle: str, row: int, result: str) -> pb.BatchOp:
    index = pb.Index(items=[pb.IndexItem(integer=row)])
    return pb.BatchOp(view=pb.ViewRequest(handle=handle, index=index), results=[result])


def test_a_run_of_views_and_releases_takes_each_lock_once(
    server: Any, open_session: Any, monkeypatch: Any
) -> None:
    # issue 15's server cost per queued view: each took the table lock three times and the
    # registry's three (hold the input, register the result, let the input go), and each
    # release one more of each; a run of views and releases takes each lock once now
    from tensord_server.domain.batch import RUN_OPS

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
    assert taken == [1, 1]
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
