"""The session's call channel: its unary calls over the server's fd socket, without gRPC.

OpenSession answers the session's channel key; the SDK binds one connection to the
server's fd socket with it and sends the session's unary calls there.  Each call gets what
it would over gRPC: the same handler and answers, the same errors (status code, message,
the type and details trailers), the method's receive limit checked before a byte of the
request is read, the fair executor under the same key, the client's deadline.  Whatever the
channel cannot do (a wrong key, no socket, a busy channel, a channel the server closed)
the call takes gRPC.  A connection waiting on its client holds no server thread."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from typing import Any

import grpc
import numpy as np
import pytest
import tensord
import torch
from conftest import SessionStub, open_channel, wait_until
from tensord import schema as pb
from tensord.protocol import ANSWER_HEADER, CALL_HEADER, ERROR_DETAILS_KEY, ERROR_TYPE_KEY
from tensord.wire import batches
from tensord.wire.channel import CallChannel
from tensord_server.domain import exports as server_exports
from tensord_server.rpc import calls as rpc_calls
from tensord_server.rpc import fd_socket
from test_fork import run_parent


class RawSession(SessionStub):
    """A raw gRPC session that also kept its OpenSession answer (its channel key)."""

    def __init__(self, channel: grpc.Channel, token: str | None = None) -> None:
        super().__init__(channel, "raw", token)
        opened = self.raw.OpenSession(
            pb.OpenSessionRequest(resume_session_id=self.session_id), metadata=self.auth
        )
        assert opened.resumed and opened.session_id == self.session_id
        self.key, self.path = opened.channel_key, opened.channel_socket


def bind_raw(path: str, sent: str) -> tuple[socket.socket, bytes]:
    """A raw connection to the fd socket that sent ``call SENT``, and the server's line."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5.0)
    sock.connect(path)
    sock.sendall(b"call " + sent.encode() + b"\n")
    line = b""
    while not line.endswith(b"\n"):
        piece = sock.recv(1)
        if not piece:
            break
        line += piece
    return sock, line


def bind(path: str, key: str) -> socket.socket:
    """:func:`bind_raw` with a key as the SDK sends it (less its proof), the proof checked."""
    sent, _, proof = key.rpartition(".")
    sock, line = bind_raw(path, sent)
    assert line.startswith(b"ok ") and line.split()[2] == proof.encode(), line
    return sock


def receive(sock: socket.socket, nbytes: int) -> bytes:
    data = b""
    while len(data) < nbytes:
        piece = sock.recv(nbytes - len(data))
        if not piece:
            raise ConnectionResetError("closed")
        data += piece
    return data


def closed(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (a reset: it closed with bytes of ours unread)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def grpc_only(client: Any) -> None:
    """The client's call channel closed and gone: every unary call over gRPC."""
    channel, client._conn.call_channel = client._conn.call_channel, None
    if channel is not None:
        channel.close()


def frame(method: str, body: bytes, request_id: int = 1, deadline_ms: int = 0) -> bytes:
    name = method.encode()
    return CALL_HEADER.pack(request_id, deadline_ms, len(name), len(body)) + name + body


def read_answer(sock: socket.socket) -> tuple[int, int, str, str, str, bytes]:
    """(request id, code, message, error type, details, response bytes)."""
    request_id, code, message, kind, details, nbytes = ANSWER_HEADER.unpack(
        receive(sock, ANSWER_HEADER.size)
    )
    rest = receive(sock, message + kind + details + nbytes)
    texts = rest[: message + kind + details].decode()
    return (
        request_id,
        code,
        texts[:message],
        texts[message : message + kind],
        texts[message + kind :],
        rest[message + kind + details :],
    )


def ask(sock: socket.socket, method: str, request: Any, request_id: int = 7) -> tuple[Any, ...]:
    sock.sendall(frame(method, request.SerializeToString(), request_id))
    answer = read_answer(sock)
    assert answer[0] == request_id
    return answer[1:]


def over_grpc(session: SessionStub, method: str, request: Any) -> tuple[Any, ...]:
    """What gRPC answers: (code, message, error type, details, response bytes)."""
    call = session.channel.unary_unary(
        f"/tensord.v1.Tensord/{method}",
        request_serializer=lambda m: m if isinstance(m, bytes) else m.SerializeToString(),
    )
    try:
        return 0, "", "", "", call(request, metadata=session.md, timeout=30)
    except grpc.RpcError as err:
        trailers = dict(err.trailing_metadata() or ())
        return (
            err.code().value[0],
            err.details(),
            trailers.get(ERROR_TYPE_KEY, ""),
            trailers.get(ERROR_DETAILS_KEY, ""),
            b"",
        )


class _Counted:
    """A stub method that notes each call it makes."""

    def __init__(self, name: str, method: Any, made: list[str]) -> None:
        self.name, self.method, self.made = name, method, made

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.made.append(self.name)
        return self.method(*args, **kwargs)

    def future(self, *args: Any, **kwargs: Any) -> Any:
        self.made.append(self.name)
        return self.method.future(*args, **kwargs)


def count_grpc_unaries(client: Any, monkeypatch: Any, *names: str) -> list[str]:
    """The unary calls of ``names`` the client makes through gRPC from now on."""
    made: list[str] = []
    stub = client._conn._stub
    for name in names:
        monkeypatch.setattr(stub, name, _Counted(name, getattr(stub, name), made))
    return made


UNARIES = ("View", "GetName", "PutName", "Release", "Empty", "Export", "Batch", "Fill")


# -- the calls ----------------------------------------------------------------------------


def test_a_clients_unary_calls_take_the_channel_and_answer_as_torch(
    server: Any, monkeypatch: Any
) -> None:
    # no background release while it runs: its call could hold the channel a while, and
    # a call meanwhile take gRPC
    monkeypatch.setattr(batches, "RELEASE_INTERVAL_S", 60.0)
    with tensord.connect(server.address, pipelining=False) as client:
        channel = client._conn.call_channel
        assert channel is not None and channel.path == server.fd_socket.path
        grpc_calls = count_grpc_unaries(client, monkeypatch, *UNARIES)
        x = client.tensor(np.arange(12, dtype=np.float32))  # small: the Upload stream
        before = channel.calls
        view = x.view(3, 4)[1]
        client.put("channel-x", view, overwrite=True)
        got = client.get("channel-x")
        got.fill_(2.5)
        assert torch.equal(
            torch.from_numpy(x.numpy()),
            torch.tensor([0, 1, 2, 3, 2.5, 2.5, 2.5, 2.5, 8, 9, 10, 11]),
        )
        assert not grpc_calls and channel.calls - before >= 5
        client.delete("channel-x")


def test_a_pipelined_queue_its_caller_waits_for_goes_on_the_channel(
    client: Any, monkeypatch: Any
) -> None:
    x = client.zeros(8, dtype=torch.uint8)
    client.synchronize()
    grpc_calls = count_grpc_unaries(client, monkeypatch, "Batch")
    before = client._conn.call_channel.calls
    x[2:4].fill_(3)  # queued
    y = x.view(2, 4)
    client.synchronize()  # the Batch, answered on the channel
    assert not grpc_calls and client._conn.call_channel.calls > before
    assert y.tolist() == [[0, 0, 3, 3], [0, 0, 0, 0]]
    x.fill_(300)  # queued; only the server's kernel refuses it (no uint8 holds 300)
    with pytest.raises(RuntimeError, match=r"fill_ of .*failed on the server"):
        client.synchronize()
    assert not grpc_calls


@pytest.mark.parametrize(
    "case",
    ["view", "bad view", "unknown name", "out of memory", "release", "server info", "put twice"],
)
def test_the_channel_answers_what_grpc_answers(server: Any, case: str) -> None:
    with open_channel(server.address) as grpc_channel:
        session = RawSession(grpc_channel)
        x = session.upload(np.arange(12, dtype=np.float32))
        requests = {
            "view": ("View", pb.ViewRequest(handle=x.handle, view=pb.ViewShape(shape=[3, 4]))),
            "bad view": ("View", pb.ViewRequest(handle=x.handle, view=pb.ViewShape(shape=[5]))),
            "unknown name": ("GetName", pb.GetNameRequest(name="no-such-name")),
            "out of memory": (
                "Empty",
                pb.EmptyRequest(shape=[1 << 31], dtype="float32", device="cpu"),
            ),
            "release": ("Release", pb.ReleaseRequest(handles=["made-up", "another"])),
            "server info": ("ServerInfo", pb.ServerInfoRequest()),
            "put twice": ("PutName", pb.PutNameRequest(name=f"twice-{x.handle}", handle=x.handle)),
        }
        method, request = requests[case]
        if case == "put twice":  # the second PutName of a name: ALREADY_EXISTS
            session.PutName(request, metadata=session.md)
        sock = bind(session.path, session.key)
        try:
            channel_answer = ask(sock, method, request)
        finally:
            sock.close()
        grpc_answer = over_grpc(session, method, request)
        code, message, kind, details, body = channel_answer
        assert (code, message, kind, details) == grpc_answer[:4]
        if code:
            assert message and kind and not body
            if case == "out of memory":
                assert json.loads(details)["requested_bytes"] == 8 << 30
        elif case == "view":  # a new handle each: the rest alike
            ours, theirs = (
                pb.ViewResponse.FromString(body),
                pb.ViewResponse.FromString(grpc_answer[4]),
            )
            for meta in (*ours.tensors, *theirs.tensors):
                meta.handle = ""
            assert ours == theirs and list(ours.tensors[0].shape) == [3, 4]
        else:
            assert body == grpc_answer[4]
        if case == "put twice":
            session.DeleteName(pb.DeleteNameRequest(name=request.name), metadata=session.md)
        session.close()


def sdk_errors(client: Any) -> list[tuple[type, str, dict[str, Any]]]:
    """The errors of a few refused calls: (class, text, detail fields)."""
    x = client.zeros(4, dtype=torch.uint8)
    client.put("sdk-errors", x, overwrite=True)
    refused: list[tuple[type, str, dict[str, Any]]] = []
    for attempt in (
        lambda: client.get("no-such-name"),
        lambda: client.put("sdk-errors", x),  # exists already
        lambda: x.fill_(300),  # only the server's kernel refuses it
        lambda: client.zeros(1 << 31),  # 8 GiB: past the pool
    ):
        with pytest.raises(tensord.errors.TensordError) as info:
            attempt()
        refused.append((type(info.value), str(info.value), info.value.details))
    client.delete("sdk-errors")
    return refused


def test_a_call_refused_on_the_channel_raises_what_grpc_raises(server: Any) -> None:
    with tensord.connect(server.address, pipelining=False) as client:
        before = client._conn.call_channel.calls
        on_channel = sdk_errors(client)
        assert client._conn.call_channel.calls - before >= 4
        grpc_only(client)  # the same calls
        over_grpc = sdk_errors(client)
    # the same classes, texts and details (an out-of-memory's figures are the pool's now)
    assert on_channel[:3] == over_grpc[:3]
    assert on_channel[3][0] is over_grpc[3][0] and on_channel[3][2].keys() == over_grpc[3][2].keys()
    kinds = [kind for kind, _, _ in on_channel]
    assert kinds[:2] == [tensord.errors.NotFoundError, tensord.errors.AlreadyExistsError]
    assert kinds[3] is tensord.errors.OutOfMemoryError and on_channel[3][2]["requested_bytes"]


def test_a_channel_call_is_queued_under_the_key_grpc_uses(
    make_server: Any, monkeypatch: Any
) -> None:
    running = make_server(auth_tokens={"token-a": "alice"})
    work = running.grpc_server.calls.work
    run = work.run
    keys: list[Any] = []

    async def recorded(key: Any, *args: Any, **kwargs: Any) -> Any:
        keys.append(key)
        return await run(key, *args, **kwargs)

    monkeypatch.setattr(work, "run", recorded)
    with tensord.connect(running.address, token="token-a", pipelining=False) as client:
        x = client.zeros(4)
        keys.clear()
        x.view(2, 2)  # on the channel
        channel_key = keys[-1]
        client._conn.call_channel, channel = None, client._conn.call_channel
        x.view(2, 2)  # through gRPC
        client._conn.call_channel = channel
        assert channel_key == keys[-1] == ("tenant", "alice")
        assert channel.calls >= 1


# -- what reaches a call ------------------------------------------------------------------


def test_an_unbound_connection_or_a_wrong_key_gets_no_request_parsed(
    server: Any, monkeypatch: Any
) -> None:
    with open_channel(server.address) as grpc_channel:
        session = RawSession(grpc_channel)
        decoded: list[Any] = []
        decode = rpc_calls.decode_message
        monkeypatch.setattr(
            rpc_calls, "decode_message", lambda cls, raw: decoded.append(cls) or decode(cls, raw)
        )
        call = frame("Release", pb.ReleaseRequest(handles=["x"]).SerializeToString())
        # a frame with no bind first: read as a ticket's key, refused, closed
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(5)
        sock.connect(session.path)
        sock.sendall(call + b"\n")
        assert sock.recv(256).startswith(b"no: ") and closed(sock)
        sock.close()
        locator, secret, _ = session.key.split(".")
        for made_up in (f"{locator}.{'A' * len(secret)}", session.key, "made-up", ""):
            sock, line = bind_raw(session.path, made_up)
            assert line == b"no: unknown channel key\n"
            with contextlib.suppress(OSError):
                sock.sendall(call)
            assert closed(sock)  # the frame never read
            sock.close()
        assert not decoded
        monkeypatch.undo()
        session.close()


@pytest.mark.parametrize("method", ["View", "Heartbeat"])
def test_a_request_over_its_methods_receive_limit_is_refused_unread(
    server: Any, method: str
) -> None:
    limit = rpc_calls.RECEIVE_LIMITS[method]
    with open_channel(server.address) as grpc_channel:
        session = RawSession(grpc_channel)
        sock = bind(session.path, session.key)
        name = method.encode()
        try:  # the header alone: the length says it all
            sock.sendall(CALL_HEADER.pack(3, 0, len(name), limit + 1) + name)
            request_id, code, message, kind, _, body = read_answer(sock)
            assert closed(sock)  # its body would read as the next frame
        finally:
            sock.close()
        assert (request_id, code, body) == (3, grpc.StatusCode.INVALID_ARGUMENT.value[0], b"")
        assert message == f"a {method} request of {limit + 1} bytes; the limit is {limit}"
        # gRPC, sent the bytes, answers the same
        assert over_grpc(session, method, b"\0" * (limit + 1))[:3] == (code, message, kind)
        assert server.grpc_server.calls.budget.reserved == 0
        session.close()


def test_a_stream_method_takes_grpc(server: Any) -> None:
    with open_channel(server.address) as grpc_channel:
        session = RawSession(grpc_channel)
        sock = bind(session.path, session.key)
        try:
            answer = ask(sock, "Download", pb.DownloadRequest(handle="x"))
        finally:
            sock.close()
        assert answer[0] == grpc.StatusCode.UNIMPLEMENTED.value[0] and "Download" in answer[1]
        session.close()


def test_a_key_reaches_only_its_own_session(server: Any) -> None:
    with tensord.connect(server.address) as owner, tensord.connect(server.address) as other:
        theirs = other.tensor(np.full(64, 9.0, dtype=np.float32))
        sock = bind(owner._conn.call_channel.path, owner._conn.call_channel.key)
        try:
            before = server.daemon.exports.count(other.session_id)
            code, *_ = ask(sock, "Export", pb.ExportRequest(handle=theirs.handle))
            assert code == grpc.StatusCode.NOT_FOUND.value[0]
            assert server.daemon.exports.count(other.session_id) == before
        finally:
            sock.close()


def test_tenant_b_cannot_reach_tenant_as_handles_through_its_channel(make_server: Any) -> None:
    running = make_server(auth_tokens={"token-a": "alice", "token-b": "bob"})
    with (
        tensord.connect(running.address, token="token-a") as alice,
        tensord.connect(running.address, token="token-b") as bob,
    ):
        secret = alice.tensor(np.full(64, 7.0, dtype=np.float32))
        alice.put("alices", secret)
        sock = bind(bob._conn.call_channel.path, bob._conn.call_channel.key)
        try:
            for method, request in (
                ("Export", pb.ExportRequest(handle=secret.handle)),
                ("View", pb.ViewRequest(handle=secret.handle, view=pb.ViewShape(shape=[64]))),
                ("GetName", pb.GetNameRequest(name="alices")),
            ):
                assert ask(sock, method, request)[0] == grpc.StatusCode.NOT_FOUND.value[0]
        finally:
            sock.close()
        assert running.daemon.exports.count(alice.session_id) == 0


# -- waiting costs nothing ------------------------------------------------------------------


def test_a_stalled_channel_holds_no_thread_and_delays_no_other_call(server: Any) -> None:
    with open_channel(server.address) as grpc_channel:
        sessions = [RawSession(grpc_channel) for _ in range(6)]
        threads = threading.active_count()
        stalled = []
        for session in sessions:  # bound, then half a frame: the rest of it never comes
            sock = bind(session.path, session.key)
            sock.sendall(CALL_HEADER.pack(1, 0, 4, 1 << 20) + b"View" + b"x" * 10)
            stalled.append(sock)
        silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        silent.connect(sessions[0].path)  # never even binds
        stalled.append(silent)
        try:
            time.sleep(0.2)  # each waits in the server by now
            assert threading.active_count() == threads  # not a thread among them
            with tensord.connect(server.address, pipelining=False) as client:
                x = client.zeros(16)
                before = client._conn.call_channel.calls
                slowest = 0.0
                for _ in range(20):
                    started = time.monotonic()
                    x.view(4, 4)
                    slowest = max(slowest, time.monotonic() - started)
                assert client._conn.call_channel.calls - before >= 20 and slowest < 0.5, slowest
        finally:
            for sock in stalled:
                sock.close()
        for session in sessions:
            session.close()


def test_a_hung_server_raises_deadline_exceeded_on_the_channel(
    fresh_server: Any, monkeypatch: Any
) -> None:
    service = fresh_server.grpc_server.calls.service
    get_name = service.GetNameExport  # a same-host get's one call
    release = threading.Event()

    def hung(request: Any, context: Any) -> Any:
        release.wait(10)
        return get_name(request, context)

    with tensord.connect(fresh_server.address, call_timeout=0.5, pipelining=False) as client:
        client.put("there", client.zeros(2))
        monkeypatch.setattr(service, "GetNameExport", hung)
        started = time.monotonic()
        with pytest.raises(
            tensord.errors.DeadlineExceededError, match=r"did not answer within 0\.5 s"
        ):
            client.get("there")
        assert time.monotonic() - started < 2.0
        release.set()
        monkeypatch.undo()
        before = client._conn.call_channel.calls
        assert client.get("there").tolist() == [0.0, 0.0]
        assert client._conn.call_channel.calls > before  # a new connection, on the channel again


# -- falling back ----------------------------------------------------------------------


def test_a_channel_the_server_closed_sends_the_next_call_through_grpc_then_comes_back(
    fresh_server: Any, monkeypatch: Any
) -> None:
    with tensord.connect(fresh_server.address, pipelining=False) as client:
        x = client.zeros(4)
        x.view(2, 2)  # bound
        channel = client._conn.call_channel
        grpc_calls = count_grpc_unaries(client, monkeypatch, "View")
        replacing = bind(channel.path, channel.key)  # a second bind: the first is closed
        try:
            assert wait_until(lambda: fresh_server.daemon.exports.channel_count() == 1)
            assert x.view(4).tolist() == [0.0] * 4  # the channel said it closed: gRPC
            # (its frame refused at once, or answered by the closing notice: unread either way)
            reason = channel.last_reason
            assert grpc_calls == ["View"] and (
                "closed the channel" in reason or "took no" in reason
            )
        finally:
            replacing.close()
        before = channel.calls
        x.view(4)  # bound again
        assert grpc_calls == ["View"] and channel.calls == before + 1


def test_an_idle_channel_is_closed_and_the_client_reconnects(
    fresh_server: Any, monkeypatch: Any
) -> None:
    monkeypatch.setattr(fd_socket, "CHANNEL_IDLE_S", 0.3)
    table = fresh_server.daemon.exports
    with tensord.connect(fresh_server.address, pipelining=False) as client:
        x = client.arange(16.0)
        x.view(4, 4)
        assert table.channel_count() == 1
        assert wait_until(lambda: table.channel_count() == 0, timeout=5)  # closed when idle
        grpc_calls = count_grpc_unaries(client, monkeypatch, "View")
        x.view(4, 4)
        assert not grpc_calls and table.channel_count() == 1  # reconnected at once


def test_a_bind_past_the_channel_bound_is_refused_and_calls_take_grpc(
    fresh_server: Any, monkeypatch: Any
) -> None:
    monkeypatch.setattr(server_exports, "MAX_CHANNELS", 1)
    with (
        tensord.connect(fresh_server.address, pipelining=False) as one,
        tensord.connect(fresh_server.address, pipelining=False) as two,
    ):
        one.zeros(8).view(2, 4)  # bound: the one channel
        assert fresh_server.daemon.exports.channel_count() == 1
        y = two.arange(8.0)
        grpc_calls = count_grpc_unaries(two, monkeypatch, "View")
        assert y.view(2, 4).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert grpc_calls == ["View"] and "too many channels" in two._conn.call_channel.last_reason
        assert fresh_server.daemon.exports.channel_count() == 1


def test_one_tenant_cannot_take_every_channel(make_server: Any, monkeypatch: Any) -> None:
    """With tenants, a tenant's sessions bind at most MAX_CHANNELS_PER_TENANT channels: past
    it that tenant's next session takes gRPC, and another tenant still binds."""
    monkeypatch.setattr(server_exports, "MAX_CHANNELS", 3)
    monkeypatch.setattr(server_exports, "MAX_CHANNELS_PER_TENANT", 1)
    running = make_server(auth_tokens={"token-a": "alice", "token-b": "bob"})
    with open_channel(running.address) as grpc_channel:
        alice1, alice2, bob = (
            RawSession(grpc_channel, token) for token in ("token-a", "token-a", "token-b")
        )
        first = bind(alice1.path, alice1.key)
        sock, line = bind_raw(alice2.path, alice2.key.rpartition(".")[0])
        sock.close()
        assert line == b"no: too many channels for this tenant (1)\n"
        again = bind(alice1.path, alice1.key)  # replacing its own: allowed
        other = bind(bob.path, bob.key)
        for each in (first, again, other):
            each.close()
        for session in (alice1, alice2, bob):
            session.close()


def test_a_client_told_local_false_makes_no_call_channel(server: Any) -> None:
    with tensord.connect(server.address, local=False) as client:
        assert client._conn.call_channel is None
        assert client.zeros(2).view(1, 2).tolist() == [[0.0, 0.0]]


def test_a_closed_session_closes_its_channel_and_the_client_gets_grpcs_error(
    fresh_server: Any,
) -> None:
    with tensord.connect(fresh_server.address, pipelining=False) as client:
        x = client.zeros(4)
        x.view(2, 2)
        key = client._conn.call_channel.key
        table = fresh_server.daemon.exports
        assert table.channel_count() == 1
        fresh_server.daemon.sessions.close(fresh_server.daemon.sessions.peek(client.session_id))
        assert wait_until(lambda: table.channel_count() == 0, timeout=5)
        sock, line = bind_raw(client._conn.call_channel.path, key.rpartition(".")[0])
        sock.close()
        assert line == b"no: unknown channel key\n"
        with pytest.raises(tensord.errors.SessionLostError):
            x.view(4)
        assert client._conn.call_channel.key != key  # the new session's channel
        assert client.zeros(2).view(1, 2).tolist() == [[0.0, 0.0]]


def test_closing_the_client_or_the_server_closes_their_channels(make_server: Any) -> None:
    running = make_server()
    table = running.daemon.exports
    client = tensord.connect(running.address, pipelining=False)
    client.zeros(4).view(2, 2)
    other = tensord.connect(running.address, pipelining=False)
    other.zeros(4).view(2, 2)
    assert table.channel_count() == 2
    client.close()
    assert wait_until(lambda: table.channel_count() == 1, timeout=5)
    sock = other._conn.call_channel._sock
    running.stop()
    assert table.channel_count() == 0
    sock.settimeout(5)
    assert read_answer(sock)[0] == 0  # the closing notice (no request unread)
    assert sock.recv(1) == b""  # then closed
    other.close()


def test_a_socket_that_cannot_prove_the_key_is_never_used(
    server: Any, monkeypatch: Any, tmp_path: Any
) -> None:
    """A socket squatted at the channel's path (on another host, say) learns what the client
    sends, never the proof: the client refuses it and takes gRPC."""
    with tensord.connect(server.address, pipelining=False) as client:
        x = client.arange(6.0)
        key = client._conn.call_channel.key
        path = str(tmp_path / "fd.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(1)
        listener.settimeout(10)
        heard: list[bytes] = []

        def squat() -> None:
            with listener:
                conn, _ = listener.accept()
                with conn:
                    heard.append(conn.recv(256))
                    conn.sendall(b"ok 30 not-the-proof\n")
                    with contextlib.suppress(OSError):  # a call, answered falsely if sent
                        conn.recv(256)
                        conn.sendall(ANSWER_HEADER.pack(1, 0, 0, 0, 0, 0))

        thread = threading.Thread(target=squat, daemon=True)
        thread.start()
        grpc_only(client)
        client._conn.call_channel = CallChannel(client.session_id, key, path)
        grpc_calls = count_grpc_unaries(client, monkeypatch, "View")
        assert x.view(2, 3).tolist() == [[0, 1, 2], [3, 4, 5]]  # gRPC's answer
        assert grpc_calls == ["View"] and "no proof" in client._conn.call_channel.last_reason
        assert heard and key.rpartition(".")[2].encode() not in heard[0]  # the proof unsent
        thread.join(5)


def test_a_trickled_bind_line_is_cut_off_at_the_request_timeout(
    server: Any, monkeypatch: Any
) -> None:
    # one byte just inside each wait: the line's whole time is bounded, not each wait's
    monkeypatch.setattr(fd_socket, "FD_REQUEST_TIMEOUT_S", 0.6)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(server.fd_socket.path)
    sent = 0
    try:
        for _ in range(6):
            time.sleep(0.45)
            try:
                sock.send(b"c")
            except OSError:  # the server closed it
                break
            sent += 1
    finally:
        sock.close()
    assert sent == 1  # the server gave up at 0.6 s, before the second byte (0.9 s)


def test_rebinding_a_session_whose_calls_block_never_passes_the_channel_bound(
    fresh_server: Any, monkeypatch: Any
) -> None:
    # A key's holder rebinds over and over, each channel left in a call (here waiting on its
    # session's lock, as behind a long Batch of that session): a replaced channel still in
    # its call counts against MAX_CHANNELS until it ends, else each rebind would hold one
    # more connection of the server.  The call is a worker's (Contiguous): one the loop may
    # take itself while no worker is busy would wait for the lock on the loop, where no
    # bind is answered meanwhile.
    monkeypatch.setattr(server_exports, "MAX_CHANNELS", 2)
    table = fresh_server.daemon.exports
    with open_channel(fresh_server.address) as grpc_channel:
        session = RawSession(grpc_channel)
        x = session.upload(np.zeros(8, dtype=np.float32))
        held = fresh_server.daemon.sessions.peek(session.session_id)
        request = frame("Contiguous", pb.HandleRequest(handle=x.handle).SerializeToString())
        socks, lines = [], []
        held.lock.acquire()
        try:
            for _ in range(5):
                sock, line = bind_raw(session.path, session.key.rpartition(".")[0])
                socks.append(sock)
                lines.append(line)
                if line.startswith(b"ok "):
                    sock.sendall(request)  # its call waits for the session's lock
                    time.sleep(0.1)
            assert table.channel_stats()[0] <= server_exports.MAX_CHANNELS + 1
            assert lines[-1] == b"no: too many channels (2)\n"
        finally:
            for sock in socks:
                sock.close()
            held.lock.release()
        assert wait_until(lambda: table.channel_stats()[0] == 0, timeout=5)
        session.close()


# -- the client's side -----------------------------------------------------------------


def test_an_interrupt_inside_an_exchange_never_leaves_its_answer_for_the_next(
    client: Any, monkeypatch: Any
) -> None:
    # An interrupt that lands in the thread running the exchange after its frame was sent:
    # the connection must go, else the next call reads this one's answer.
    from tensord.wire import channel as channel_module

    channel = client._conn.call_channel
    client.zeros(2).view(2)  # bound
    receive_exactly = channel_module._receive_exactly
    interrupted: list[bool] = []

    def interrupted_once(*args: Any) -> bytes:
        if not interrupted:
            interrupted.append(True)
            raise KeyboardInterrupt
        return receive_exactly(*args)

    monkeypatch.setattr(channel_module, "_receive_exactly", interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        channel.unary("ServerInfo", pb.ServerInfoRequest(), 5.0)
    monkeypatch.undo()
    x = client.arange(3.0)
    made = channel.unary(
        "View", pb.ViewRequest(handle=x.handle, view=pb.ViewShape(shape=[3, 1])), 5.0
    )
    assert made is not None and list(made.tensors[0].shape) == [3, 1]


def test_threads_calling_at_once_each_get_their_own_answer(server: Any) -> None:
    with tensord.connect(server.address, pipelining=False) as client:
        tensors = [client.full((4, 4), float(i)) for i in range(4)]
        for i, t in enumerate(tensors):
            client.put(f"thread-{i}", t, overwrite=True)
        before = client._conn.call_channel.calls
        wrong: list[Any] = []

        def call_many(i: int) -> None:
            for j in range(25):
                got = client.get(f"thread-{i}")
                row = got.view(16)[j % 16 : j % 16 + 1]
                if row.item() != float(i) or tuple(got.shape) != (4, 4):
                    wrong.append((i, j))

        threads = [threading.Thread(target=call_many, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert not wrong and not any(thread.is_alive() for thread in threads)
        assert client._conn.call_channel.calls > before  # some on the channel, the rest gRPC
        for i in range(4):
            client.delete(f"thread-{i}")


@pytest.mark.slow
def test_a_forked_child_never_uses_its_parents_channel(server: Any) -> None:
    out = run_parent(
        server.address,
        """
        from tensord import schema as pb
        channel = client._conn.call_channel
        client.synchronize()
        for _ in range(2):
            pid = os.fork()
            if pid == 0:
                ok = channel.call("ServerInfo", b"", 1.0) is None
                try:
                    x.view(12)
                    client.synchronize()
                    ok = False
                except tensord.InheritedClientError:
                    pass
                channel.close()  # forgets it: the parent's socket untouched
                sys.exit(0 if ok else 3)
            print(wait_child(pid))
            check_parent()
            before = channel.calls
            value = x.view(12).tolist()[5]
            for _ in range(20):  # a call that finds the channel busy (a heartbeat) takes gRPC
                if channel.calls > before:
                    break
                x.view(12).tolist()
            print(value, channel.calls > before)
        client.close()
        """,
    )
    assert out == ["0", "5", "True", "0", "5", "True"]


def test_a_channel_key_never_shows_its_secret_or_proof_in_its_repr(
    server: Any, client: Any
) -> None:
    key = server.daemon.exports._session_keys[client.session_id]
    assert key.secret not in repr(key) and key.proof not in repr(key)
    assert client.session_id not in repr(key)  # a capability too
    assert key.locator in repr(key)  # enough to tell keys apart in a log


def test_garbage_requests_on_a_channel_are_refused_never_internal(server: Any) -> None:
    """Random bytes as the request of every unary method: each answered, none INTERNAL or
    UNKNOWN (a request is decoded and bounded as over gRPC), the channel still serving."""
    import random

    rng = random.Random(20240611)
    unary = [
        m.name
        for m in pb.DESCRIPTOR.services_by_name["Tensord"].methods
        if not (m.client_streaming or m.server_streaming)
        and m.name not in ("CloseSession", "OpenSession")
    ]
    with open_channel(server.address) as grpc_channel:
        session = RawSession(grpc_channel)
        sock = bind(session.path, session.key)
        codes = set()
        try:
            for i in range(300):
                method = rng.choice(unary)
                body = rng.randbytes(rng.randrange(0, 600))
                sock.sendall(frame(method, body, i + 1))
                request_id, code, message, *_ = read_answer(sock)
                assert request_id == i + 1
                assert code not in (2, 13), (method, body, message)  # UNKNOWN, INTERNAL
                codes.add(code)
            assert ask(sock, "ServerInfo", pb.ServerInfoRequest())[0] == 0
        finally:
            sock.close()
        assert grpc.StatusCode.INVALID_ARGUMENT.value[0] in codes
        session.close()


def test_method_names_no_service_has_are_counted_under_one_label(server: Any) -> None:
    """The client names a frame's method: names of no method must not each make a series
    of their own in the metrics (a client could grow them without bound)."""
    requests = server.grpc_server.calls.observer.requests

    def counted() -> dict[str, float]:
        return {
            sample.labels["method"]: sample.value
            for metric in requests.collect()
            for sample in metric.samples
            if sample.name.endswith("_total") and sample.labels["code"] == "UNIMPLEMENTED"
        }

    before = counted()
    with open_channel(server.address) as grpc_channel:
        session = RawSession(grpc_channel)
        for i in range(20):  # a frame refused unread closes its channel: a bind each
            sock = bind(session.path, session.key)
            try:
                code, *_ = ask(sock, f"NoSuchMethod{i}", pb.ServerInfoRequest())
            finally:
                sock.close()
            assert code == grpc.StatusCode.UNIMPLEMENTED.value[0]
        session.close()
    after = counted()
    assert not [name for name in after if name.startswith("NoSuchMethod")]
    unknown = rpc_calls.UNKNOWN_METHOD
    assert after[unknown] == before.get(unknown, 0.0) + 20


def test_a_channel_in_steady_use_is_not_closed_as_idle(fresh_server: Any, monkeypatch: Any) -> None:
    monkeypatch.setattr(fd_socket, "CHANNEL_IDLE_S", 0.3)
    table = fresh_server.daemon.exports
    fd = fresh_server.grpc_server.calls.fd_socket
    with tensord.connect(fresh_server.address, pipelining=False) as client:
        x = client.arange(16.0)
        x.view(4, 4)
        binds = fd._served
        for _ in range(12):  # 1.2 s of calls 0.1 s apart: never 0.3 s idle
            x.view(4, 4)
            time.sleep(0.1)
        assert table.channel_count() == 1 and fd._served == binds
        assert wait_until(lambda: table.channel_count() == 0, timeout=5)  # then idle: closed
