"""Sessions: handle tables as capabilities, KeepAlive/lease liveness, resume within the grace,
release after it, sharing by token and by name."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest
from tensord import schema as pb


def _allocated(server) -> int:
    return int(server.daemon.memory_reports.memory_stats("cpu")["allocated_bytes.all.current"])


def _error(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def _clone(session, handle: str):
    return session.Clone(pb.CloneRequest(handle=handle), metadata=session.md)


def test_missing_session_is_unauthenticated_and_unknown_is_not_found(stub) -> None:
    request = pb.ListNamesRequest()
    code, _ = _error(lambda: stub.ListNames(request))
    assert code is grpc.StatusCode.UNAUTHENTICATED
    code, details = _error(lambda: stub.ListNames(request, metadata=(("tensord-session", "nope"),)))
    assert (code, details) == (grpc.StatusCode.NOT_FOUND, "unknown session")
    assert stub.ServerInfo(pb.ServerInfoRequest()).chunk_bytes == 1 << 20  # needs no session


def test_foreign_handle_is_indistinguishable_from_a_made_up_one(server, stub, open_session) -> None:
    other = open_session(server.address)
    meta = stub.upload(np.arange(4, dtype=np.float32))
    foreign = _error(lambda: _clone(other, meta.handle))
    made_up = _error(lambda: _clone(other, meta.handle[:-4] + "AAAA"))
    assert foreign[0] is made_up[0] is grpc.StatusCode.NOT_FOUND
    assert foreign[1].split("'")[0] == made_up[1].split("'")[0]  # same text but the id
    # the owner still uses it
    assert _clone(stub, meta.handle).storage_nbytes == 16


def test_release_frees_the_storage_once_nothing_refers_to_it(server, stub) -> None:
    before = _allocated(server)
    meta = stub.upload(np.zeros(1 << 16, dtype=np.float32))
    (view,) = stub.view(meta, narrow=pb.Narrow(dim=0, start=1, length=10))
    assert _allocated(server) > before
    assert stub.Release(pb.ReleaseRequest(handles=[meta.handle]), metadata=stub.md).released == 1
    assert _allocated(server) > before  # the view still holds the Storage
    released = stub.Release(
        pb.ReleaseRequest(handles=[view.handle, view.handle, "x"]), metadata=stub.md
    )
    assert released.released == 1
    assert _allocated(server) == before


def test_close_session_releases_its_handles(server, open_session) -> None:
    before = _allocated(server)
    session = open_session(server.address)
    for _ in range(3):
        session.upload(np.ones(1000, dtype=np.float64))
    response = session.CloseSession(pb.CloseSessionRequest(), metadata=session.md)
    assert response.released_handles == 3
    assert _allocated(server) == before
    code, _ = _error(lambda: session.ListNames(pb.ListNamesRequest(), metadata=session.md))
    assert code is grpc.StatusCode.NOT_FOUND


class _KeepAlive:
    """A KeepAlive stream held open by a background heartbeat generator until ``end()``."""

    def __init__(self, session) -> None:
        self._stop = threading.Event()
        self.beats = 0

        def heartbeats():
            while not self._stop.is_set():
                yield pb.Heartbeat(sent_at=1.0)
                self._stop.wait(0.05)

        self.call = session.KeepAlive(heartbeats(), metadata=session.md)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for _ in self.call:
                self.beats += 1
        except grpc.RpcError:
            pass  # cancelled by end()

    def end(self) -> None:
        """The client "dies": its stream breaks without CloseSession."""
        self.call.cancel()
        self._stop.set()
        self._reader.join(10)


@pytest.mark.slow
def test_lost_stream_then_grace_releases_everything(make_server, open_session, wait_until) -> None:
    server = make_server(session_grace=0.3, lease=60.0)
    before = _allocated(server)
    session = open_session(server.address)
    keepalive = _KeepAlive(session)
    meta = session.upload(np.ones(1 << 18, dtype=np.float32))
    session.Share(pb.ShareRequest(handle=meta.handle), metadata=session.md)
    assert wait_until(lambda: keepalive.beats >= 3)
    # while the stream lives, the session outlives its grace many times over
    threading.Event().wait(0.8)
    assert session.session_id in server.daemon.sessions.session_ids()
    keepalive.end()
    assert wait_until(lambda: session.session_id not in server.daemon.sessions.session_ids())
    assert _allocated(server) == before
    assert len(server.daemon.storages) == 0
    code, details = _error(
        lambda: session.OpenSession(pb.OpenSessionRequest(resume_session_id=session.session_id))
    )
    assert (code, details) == (grpc.StatusCode.NOT_FOUND, "unknown session")


def test_a_vanished_keepalive_client_is_a_normal_end_of_stream(
    make_server, open_session, wait_until, caplog
) -> None:
    server = make_server(session_grace=5.0, lease=60.0)
    session = open_session(server.address)
    keepalive = _KeepAlive(session)
    assert wait_until(lambda: keepalive.beats >= 2)
    with caplog.at_level("INFO", logger="tensord_server"):
        keepalive.end()
        live = server.daemon.sessions.peek(session.session_id)
        assert live is not None
        assert wait_until(lambda: live.streams == 0)
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]


@pytest.mark.slow
def test_unary_heartbeat_renews_the_lease(make_server, open_session) -> None:
    server = make_server(session_grace=0.1, lease=0.3)
    session = open_session(server.address)
    for _ in range(8):  # 1.2 s: four leases
        beat = session.Heartbeat(pb.Heartbeat(sent_at=2.5), metadata=session.md)
        assert beat.sent_at == 2.5
        threading.Event().wait(0.15)
    assert session.session_id in server.daemon.sessions.session_ids()


def test_resume_within_grace_keeps_every_handle(make_server, open_session, wait_until) -> None:
    server = make_server(session_grace=3.0, lease=60.0)
    session = open_session(server.address)
    keepalive = _KeepAlive(session)
    array = np.arange(100, dtype=np.int16)
    meta = session.upload(array)
    keepalive.end()
    assert wait_until(lambda: server.daemon.sessions.peek(session.session_id).streams == 0)
    resumed = session.OpenSession(pb.OpenSessionRequest(resume_session_id=session.session_id))
    assert resumed.resumed and resumed.session_id == session.session_id
    assert resumed.grace_seconds == 3.0
    np.testing.assert_array_equal(session.download(meta), array)


def test_a_call_after_the_stream_broke_keeps_the_session_on_its_lease(
    make_server, open_session, wait_until
) -> None:
    server = make_server(session_grace=0.2, lease=60.0)
    session = open_session(server.address)
    keepalive = _KeepAlive(session)
    meta = session.upload(np.arange(10, dtype=np.int64))
    keepalive.end()
    assert wait_until(lambda: server.daemon.sessions.peek(session.session_id).streams == 0)
    session.ListNames(pb.ListNamesRequest(), metadata=session.md)
    threading.Event().wait(0.6)  # three graces: the lease, not the broken stream, counts now
    np.testing.assert_array_equal(session.download(meta), np.arange(10))


def test_lease_lapse_without_heartbeats_starts_the_grace(
    make_server, open_session, wait_until
) -> None:
    server = make_server(session_grace=0.1, lease=0.2)
    before = _allocated(server)
    session = open_session(server.address)
    session.upload(np.ones(4096, dtype=np.float32))
    assert wait_until(lambda: session.session_id not in server.daemon.sessions.session_ids())
    assert _allocated(server) == before


def test_share_and_attach(server, stub, open_session) -> None:
    other = open_session(server.address)
    base = stub.upload(np.arange(12, dtype=np.float32).reshape(3, 4))
    (view,) = stub.view(base, t=pb.T())
    token = stub.Share(pb.ShareRequest(handle=view.handle), metadata=stub.md).token
    attached = other.Attach(pb.AttachRequest(token=token), metadata=other.md)
    assert attached.storage_id == base.storage_id and attached.handle != view.handle
    assert (tuple(attached.shape), tuple(attached.stride)) == ((4, 3), (1, 4))
    # a write through one session is seen through the other
    other.Fill(
        pb.FillRequest(handle=attached.handle, value=pb.Scalar(float_value=7.0)), metadata=other.md
    )
    assert (stub.download(base) == 7.0).all()
    code, _ = _error(lambda: other.Attach(pb.AttachRequest(token="made-up"), metadata=other.md))
    assert code is grpc.StatusCode.NOT_FOUND


def test_tokens_die_with_their_session(server, open_session) -> None:
    before = _allocated(server)
    owner, other = open_session(server.address), open_session(server.address)
    meta = owner.upload(np.ones(1024, dtype=np.float32))
    token = owner.Share(pb.ShareRequest(handle=meta.handle), metadata=owner.md).token
    owner.CloseSession(pb.CloseSessionRequest(), metadata=owner.md)
    assert _allocated(server) == before  # the token's reference went with the session
    code, _ = _error(lambda: other.Attach(pb.AttachRequest(token=token), metadata=other.md))
    assert code is grpc.StatusCode.NOT_FOUND


def test_names_keep_storage_alive_until_deleted(server, open_session) -> None:
    before = _allocated(server)
    writer, reader = open_session(server.address), open_session(server.address)
    array = np.arange(64, dtype=np.int32)
    meta = writer.upload(array)
    writer.PutName(pb.PutNameRequest(name="table", handle=meta.handle), metadata=writer.md)
    code, details = _error(
        lambda: writer.PutName(
            pb.PutNameRequest(name="table", handle=meta.handle), metadata=writer.md
        )
    )
    assert code is grpc.StatusCode.ALREADY_EXISTS and "table" in details
    writer.PutName(
        pb.PutNameRequest(name="table", handle=meta.handle, overwrite=True), metadata=writer.md
    )
    writer.CloseSession(pb.CloseSessionRequest(), metadata=writer.md)
    assert _allocated(server) > before  # the name holds it
    assert "table" in reader.ListNames(pb.ListNamesRequest(), metadata=reader.md).names
    got = reader.GetName(pb.GetNameRequest(name="table"), metadata=reader.md)
    np.testing.assert_array_equal(reader.download(got), array)
    reader.DeleteName(pb.DeleteNameRequest(name="table"), metadata=reader.md)
    assert _allocated(server) > before  # reader's handle still holds it
    reader.Release(pb.ReleaseRequest(handles=[got.handle]), metadata=reader.md)
    assert _allocated(server) == before
    code, _ = _error(lambda: reader.GetName(pb.GetNameRequest(name="table"), metadata=reader.md))
    assert code is grpc.StatusCode.NOT_FOUND
    code, _ = _error(
        lambda: reader.DeleteName(pb.DeleteNameRequest(name="table"), metadata=reader.md)
    )
    assert code is grpc.StatusCode.NOT_FOUND
