"""Eight threads issuing mixed ops: the pool stays consistent and returns to its baseline."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest
from tensord import schema as pb

THREADS = 8
ROUNDS = 25


def _mixed_ops(session, seed: int, failures: list[BaseException]) -> None:
    rng = np.random.default_rng(seed)
    md = session.md
    try:
        for _ in range(ROUNDS):
            n = int(rng.integers(1, 4000))
            array = rng.standard_normal((n, 3)).astype(np.float32)
            a = session.upload(array)
            (t,) = session.view(a, t=pb.T())
            c = session.Contiguous(pb.HandleRequest(handle=t.handle), metadata=md)
            r = session.Repeat(pb.RepeatRequest(handle=a.handle, repeats=[2, 1]), metadata=md)
            cat = session.Cat(pb.CatRequest(handles=[a.handle, r.handle], dim=0), metadata=md)
            z = session.Full(
                pb.FullRequest(shape=[n, 3], value=pb.Scalar(float_value=1.5)), metadata=md
            )
            session.Copy(pb.CopyRequest(dst=z.handle, src=a.handle), metadata=md)
            h = session.To(pb.ToRequest(handle=c.handle, dtype="float64"), metadata=md)
            np.testing.assert_array_equal(session.download(z), array)
            np.testing.assert_array_equal(session.download(h), array.T.astype(np.float64))
            assert tuple(cat.shape) == (3 * n, 3)
            try:  # an error in the mix must not disturb anyone
                session.view(t, view=pb.ViewShape(shape=[-1]))
            except grpc.RpcError as exc:
                assert exc.code() is grpc.StatusCode.INVALID_ARGUMENT
            handles = [a.handle, t.handle, c.handle, r.handle, cat.handle, z.handle, h.handle]
            session.Release(pb.ReleaseRequest(handles=handles), metadata=md)
    except BaseException as exc:
        failures.append(exc)


@pytest.mark.slow
def test_eight_threads_of_mixed_ops(make_server, open_session) -> None:
    server = make_server()
    pool = server.daemon.devices.get("cpu").pool
    baseline = pool.memory_stats()["allocated_bytes.all.current"]
    sessions = [open_session(server.address, f"worker {i}") for i in range(THREADS)]
    failures: list[BaseException] = []
    threads = [
        threading.Thread(target=_mixed_ops, args=(s, i, failures)) for i, s in enumerate(sessions)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(thread.is_alive() for thread in threads)
    assert not failures, failures
    pool.assert_invariants()
    assert pool.memory_stats()["allocated_bytes.all.current"] == baseline
    assert len(server.daemon.storages) == 0
