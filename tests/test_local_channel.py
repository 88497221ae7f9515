"""The session's export channel: fresh same-host Exports without a gRPC round trip.

A gRPC Export answers the session's channel key; the SDK binds one connection to the
server's fd socket with it and sends later Exports there.  Whatever the channel cannot do
(a wrong key, another session's handle, a garbage frame, a closed session, too many
channels) the client asks through gRPC, which raises the proper errors (torch is the oracle
for the bytes)."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from typing import Any

import numpy as np
import pytest
import tensord
import torch
from conftest import interrupted_after, slowed_exports, wait_until
from tensord import schema as pb
from tensord.local.channel import ExportChannel
from tensord.protocol import CHANNEL_OK, CHANNEL_USE_GRPC
from tensord_server.domain import exports as server_exports
from tensord_server.rpc import fd_socket
from test_fork import run_parent
from test_local import count_calls, storage_of_handle

ANSWER = struct.Struct("!BI")


def learn_key(client: Any) -> pb.ExportResponse:
    """A gRPC Export in the client's session (its answer carries the channel key)."""
    response: pb.ExportResponse = client._conn.call(
        "Export", pb.ExportRequest(handle=client.zeros(4).handle)
    )
    return response


def bind_raw(path: str, sent: str) -> tuple[socket.socket, bytes]:
    """A raw connection to the fd socket that sent ``chan SENT``, and the server's line."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5.0)
    sock.connect(path)
    sock.sendall(b"chan " + sent.encode() + b"\n")
    line = b""
    while not line.endswith(b"\n"):
        piece = sock.recv(1)
        if not piece:
            break
        line += piece
    return sock, line


def bind(path: str, key: str) -> tuple[socket.socket, bytes]:
    """:func:`bind_raw` with a channel key as the SDK sends it (all but its proof), the
    answer's proof checked."""
    sent, _, proof = key.rpartition(".")
    sock, line = bind_raw(path, sent)
    if line.startswith(b"ok "):
        assert line.split() == [b"ok", line.split()[1], proof.encode()]
    return sock, line


def receive(sock: socket.socket, nbytes: int) -> bytes:
    data = b""
    while len(data) < nbytes:
        piece = sock.recv(nbytes - len(data))
        if not piece:
            raise ConnectionResetError("closed")
        data += piece
    return data


def ask(sock: socket.socket, payload: bytes) -> tuple[int, bytes]:
    """One raw channel request: (status, answer bytes)."""
    sock.sendall(struct.pack("!I", len(payload)) + payload)
    status, length = ANSWER.unpack(receive(sock, ANSWER.size))
    return status, receive(sock, length)


def fresh_dlpack(client: Any, tensor: Any) -> torch.Tensor:
    """torch.from_dlpack with no capsule of the Storage alive: a new Export each time."""
    client.flush()
    return torch.from_dlpack(tensor)


def export_fresh(client: Any, tensor: Any, times: int = 1) -> None:
    """``times`` fresh exports, each array dropped at once (the first teaches the key)."""
    for _ in range(times):
        fresh_dlpack(client, tensor)


def test_a_fresh_export_after_the_first_takes_the_channel_and_aliases_the_pool(
    server: Any, client: Any, monkeypatch: Any
) -> None:
    x = client.tensor(np.arange(1000, dtype=np.float32))
    exports = count_calls(client, monkeypatch, "Export")
    first = torch.from_dlpack(x)
    assert len(exports) == 1  # the first Export of the session: gRPC, which answers the key
    del first
    storage = storage_of_handle(server.daemon, client, x)
    for i in range(3):
        alias = fresh_dlpack(client, x)
        assert storage.holds == 1  # an export of its own, counted like a gRPC one
        alias[7] = 100.0 + i  # write through the mapping, read back through the SDK
        assert x[7].item() == 100.0 + i
        del alias
    assert len(exports) == 1  # no gRPC Export after the first
    assert server.daemon.exports.channel_count() >= 1
    client.flush()
    assert storage.holds == 0  # the channel's exports are released like any other


def test_a_channel_export_sees_the_writes_queued_before_it(client: Any, monkeypatch: Any) -> None:
    x = client.zeros(4096)
    export_fresh(client, x)  # the key learnt
    exports = count_calls(client, monkeypatch, "Export")
    x.fill_(7.0)  # pipelined: queued, not yet sent
    x[:10] = 3.0
    alias = fresh_dlpack(client, x)
    assert not exports
    assert alias[:10].eq(3).all() and alias[10:].eq(7).all()
    del alias


def test_a_wrong_key_is_refused_and_the_client_falls_back_and_learns_it_again(
    server: Any, client: Any, monkeypatch: Any
) -> None:
    response = learn_key(client)
    key = response.channel_key
    assert key and response.channel_socket == server.fd_socket.path
    locator, secret, proof = key.split(".")
    wrong = f"{locator}.{'A' * len(secret)}"  # the right locator, the wrong secret
    for made_up in (wrong, key, f"{locator}.{secret}.", "made-up", "", "x" * 60):
        sock, line = bind_raw(response.channel_socket, made_up)
        assert line == b"no: unknown channel key\n"  # (the whole key, proof sent too: refused)
        sock.close()
    x = client.tensor(np.ones(100, dtype=np.float32))
    export_fresh(client, x)  # the client's channel, bound
    path = client._local._channel.path
    client._local.close_channel()
    client._local._channel = ExportChannel(client.session_id, f"{wrong}.{proof}", path)
    exports = count_calls(client, monkeypatch, "Export")
    alias = fresh_dlpack(client, x)  # refused bind: gRPC, whose answer brings the right key
    assert len(exports) == 1 and alias.sum().item() == 100.0
    del alias
    again = fresh_dlpack(client, x)
    assert len(exports) == 1  # the channel again
    del again


def test_a_socket_that_cannot_prove_the_key_is_never_used(
    server: Any, client: Any, monkeypatch: Any, tmp_path: Any
) -> None:
    """A socket squatted at the channel's path (on another host, say) learns what the client
    sends, never the proof: the client refuses it and takes gRPC."""
    x = client.arange(6.0)
    export_fresh(client, x)  # the key learnt
    key = client._local._channel.key
    path = str(tmp_path / "fd.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    listener.settimeout(10)
    heard: list[bytes] = []
    forged = pb.ExportResponse(export_id="forged", tensor=pb.TensorMeta(handle="forged"))
    forged = forged.SerializeToString()

    def squat() -> None:
        with listener:
            conn, _ = listener.accept()
            with conn:
                heard.append(conn.recv(256))
                conn.sendall(b"ok 30 not-the-proof\n")
                with contextlib.suppress(OSError):  # an Export, answered falsely if sent
                    conn.recv(256)
                    conn.sendall(ANSWER.pack(0, len(forged)) + forged)

    thread = threading.Thread(target=squat, daemon=True)
    thread.start()
    client._local.close_channel()
    client._local._channel = ExportChannel(client.session_id, key, path)
    exports = count_calls(client, monkeypatch, "Export")
    alias = fresh_dlpack(client, x)
    assert len(exports) == 1 and torch.equal(alias, torch.arange(6.0))  # gRPC's answer
    assert client._local.enabled  # the forged answer was never read
    assert heard and key.rpartition(".")[2].encode() not in heard[0]  # the proof never sent
    # gRPC's answer named the real socket: the channel is the server's again
    assert client._local._channel.path == server.fd_socket.path
    del alias
    thread.join(5)
    again = fresh_dlpack(client, x)
    assert len(exports) == 1 and again[5].item() == 5.0


def test_a_key_reaches_only_its_own_session(server: Any, monkeypatch: Any) -> None:
    with tensord.connect(server.address) as owner, tensord.connect(server.address) as other:
        key = learn_key(owner).channel_key
        theirs = other.tensor(np.full(64, 9.0, dtype=np.float32))
        mine = owner.tensor(np.full(64, 5.0, dtype=np.float32))
        sock, line = bind(server.fd_socket.path, key)
        try:
            assert line.startswith(b"ok ")
            before = server.daemon.exports.count(other.session_id)
            status, reason = ask(sock, pb.ExportRequest(handle=theirs.handle).SerializeToString())
            assert status == CHANNEL_USE_GRPC and b"NotFoundError" in reason
            assert server.daemon.exports.count(other.session_id) == before
            status, answer = ask(sock, pb.ExportRequest(handle=mine.handle).SerializeToString())
            assert status == CHANNEL_OK
            made = pb.ExportResponse.FromString(answer)
            assert made.tensor.handle == mine.handle and not made.channel_key
            owner._conn.call(
                "ReleaseExports", pb.ReleaseExportsRequest(export_ids=[made.export_id])
            )
        finally:
            sock.close()
        # a client handed another session's key: refused on its own handles, it uses gRPC
        export_fresh(other, theirs)
        monkeypatch.setattr(other._local._channel, "key", key)
        exports = count_calls(other, monkeypatch, "Export")
        alias = fresh_dlpack(other, theirs)
        assert len(exports) == 1 and alias[0].item() == 9.0
        del alias


def test_a_second_bind_of_a_session_replaces_its_first(server: Any, client: Any) -> None:
    key = learn_key(client).channel_key
    x = client.zeros(5)
    request = pb.ExportRequest(handle=x.handle).SerializeToString()
    first, line = bind(server.fd_socket.path, key)
    second = None
    try:
        assert line.startswith(b"ok ") and ask(first, request)[0] == CHANNEL_OK
        second, line = bind(server.fd_socket.path, key)
        assert line.startswith(b"ok ")
        assert first.recv(1) == b""  # the first was closed by the server
        assert ask(second, request)[0] == CHANNEL_OK
    finally:
        first.close()
        if second is not None:
            second.close()


@pytest.mark.parametrize("frame", ["garbage", "oversized"])
def test_a_garbage_or_oversized_frame_is_refused(server: Any, client: Any, frame: str) -> None:
    key = learn_key(client).channel_key
    sock, line = bind(server.fd_socket.path, key)
    try:
        assert line.startswith(b"ok ")
        if frame == "garbage":
            status, reason = ask(sock, b"\xff" * 40)
            assert status == CHANNEL_USE_GRPC
            assert b"InvalidArgumentError" in reason
            # the channel still answers: a refused request keeps its framing
            x = client.zeros(3)
            status, _ = ask(sock, pb.ExportRequest(handle=x.handle).SerializeToString())
            assert status == CHANNEL_OK
        else:
            sock.sendall(struct.pack("!I", 1 << 30))  # a length past the bound, no body
            status, length = ANSWER.unpack(receive(sock, ANSWER.size))
            assert status == CHANNEL_USE_GRPC
            assert b"frame over" in receive(sock, length)
            assert sock.recv(1) == b""  # and closed: nothing read or allocated for it
    finally:
        sock.close()


def test_a_closed_session_drops_its_key_and_channel_and_the_client_gets_grpcs_error(
    server: Any, client: Any
) -> None:
    x = client.tensor(np.ones(16, dtype=np.float32))
    export_fresh(client, x, 2)  # the second bound the channel
    key = client._local._channel.key
    assert server.daemon.exports.channel_count() >= 1
    channels = server.daemon.exports.channel_count()
    session = server.daemon.sessions.peek(client.session_id)
    server.daemon.sessions.close(session)  # as a reap or another client's CloseSession would
    assert wait_until(lambda: server.daemon.exports.channel_count() == channels - 1, timeout=5)
    sock, line = bind(server.fd_socket.path, key)
    sock.close()
    assert line == b"no: unknown channel key\n"
    with pytest.raises(tensord.errors.SessionLostError):
        fresh_dlpack(client, x)


def test_a_bind_past_the_channel_bound_is_refused_and_exports_take_grpc(
    fresh_server: Any, monkeypatch: Any
) -> None:
    monkeypatch.setattr(server_exports, "MAX_CHANNELS", 1)
    with tensord.connect(fresh_server.address) as one, tensord.connect(fresh_server.address) as two:
        x = one.zeros(8)
        y = two.arange(8.0)
        export_fresh(one, x, 2)  # bound: the one channel
        assert fresh_server.daemon.exports.channel_count() == 1
        exports = count_calls(two, monkeypatch, "Export")
        for _ in range(2):
            alias = fresh_dlpack(two, y)
            assert torch.equal(alias, torch.arange(8.0))
            del alias
        assert len(exports) == 2  # refused: both through gRPC
        assert "too many channels" in two._local._channel.last_reason
        assert fresh_server.daemon.exports.channel_count() == 1


def test_an_idle_channel_is_closed_and_the_client_reconnects(
    fresh_server: Any, monkeypatch: Any
) -> None:
    monkeypatch.setattr(fd_socket, "CHANNEL_IDLE_S", 0.3)
    table = fresh_server.daemon.exports
    with tensord.connect(fresh_server.address) as client:
        x = client.arange(16.0)
        export_fresh(client, x, 2)
        assert table.channel_count() == 1
        assert wait_until(lambda: table.channel_count() == 0, timeout=5)  # closed when idle
        exports = count_calls(client, monkeypatch, "Export")
        alias = fresh_dlpack(client, x)
        assert not exports and table.channel_count() == 1  # reconnected, no gRPC Export
        assert alias[15].item() == 15.0
        del alias


def test_a_forked_child_never_uses_its_parents_channel(server: Any) -> None:
    out = run_parent(
        server.address,
        """
        import torch
        made = []
        call = client._conn.call
        client._conn.call = lambda m, r, *a: (made.append(m), call(m, r, *a))[1]
        torch.from_dlpack(x)  # the key learnt (the capsule dropped at once)
        client.flush()
        for _ in range(2):
            pid = os.fork()
            if pid == 0:
                ok = client._local._channel.request(b"\\x00", 1.0) is None
                try:
                    torch.from_dlpack(x)
                    ok = False
                except tensord.InheritedClientError:
                    pass
                client._local.close_channel()  # forgets it: the parent's socket untouched
                sys.exit(0 if ok else 3)
            print(wait_child(pid))
            check_parent()
            alias = torch.from_dlpack(x)  # the parent's channel still answers
            print(made.count("Export"), int(alias[2, 3]))
            del alias
            client.flush()
        client.close()
        """,
    )
    assert out == ["0", "1", "11", "0", "1", "11"]


def test_tenant_b_cannot_export_tenant_as_handle_through_its_channel(
    make_server: Any, monkeypatch: Any
) -> None:
    running = make_server(auth_tokens={"token-a": "alice", "token-b": "bob"})
    with (
        tensord.connect(running.address, token="token-a") as alice,
        tensord.connect(running.address, token="token-b") as bob,
    ):
        secret = alice.tensor(np.full(64, 7.0, dtype=np.float32))
        key = learn_key(bob).channel_key
        sock, line = bind(running.fd_socket.path, key)
        try:
            assert line.startswith(b"ok ")
            status, reason = ask(sock, pb.ExportRequest(handle=secret.handle).SerializeToString())
            assert status == CHANNEL_USE_GRPC and b"NotFoundError" in reason
        finally:
            sock.close()
        assert running.daemon.exports.count(alice.session_id) == 0
        bob_x = bob.zeros(4)
        export_fresh(bob, bob_x)
        with pytest.raises(tensord.errors.NotFoundError):  # gRPC's answer, after the channel's
            bob._local.export(secret.handle)


def test_one_tenant_cannot_take_every_channel(make_server: Any, monkeypatch: Any) -> None:
    """With tenants, a tenant's sessions bind at most MAX_CHANNELS_PER_TENANT channels: past
    it that tenant's next session takes gRPC, and another tenant still binds (before: the
    first tenant's sessions could hold all MAX_CHANNELS)."""
    monkeypatch.setattr(server_exports, "MAX_CHANNELS", 3)
    monkeypatch.setattr(server_exports, "MAX_CHANNELS_PER_TENANT", 1)
    running = make_server(auth_tokens={"token-a": "alice", "token-b": "bob"})
    path = running.fd_socket.path
    with (
        tensord.connect(running.address, token="token-a") as alice1,
        tensord.connect(running.address, token="token-a") as alice2,
        tensord.connect(running.address, token="token-b") as bob,
    ):
        first, line = bind(path, learn_key(alice1).channel_key)
        assert line.startswith(b"ok ")
        second, line = bind(path, learn_key(alice2).channel_key)
        second.close()
        assert line == b"no: too many channels for this tenant (1)\n"
        again, line = bind(path, learn_key(alice1).channel_key)  # replacing its own: allowed
        assert line.startswith(b"ok ")
        other, line = bind(path, learn_key(bob).channel_key)
        assert line.startswith(b"ok ")
        for sock in (first, again, other):
            sock.close()


def test_an_answer_the_client_never_reads_releases_its_export(
    server: Any, client: Any, monkeypatch: Any
) -> None:
    key = learn_key(client).channel_key
    x = client.zeros(8)
    table = server.daemon.exports
    before = table.count(client.session_id)
    export = table.export
    answered = threading.Event()

    def slow_export(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.3)  # the client is gone before the answer
        made = export(*args, **kwargs)
        answered.set()
        return made

    monkeypatch.setattr(table, "export", slow_export)
    sock, line = bind(server.fd_socket.path, key)
    assert line.startswith(b"ok ")
    payload = pb.ExportRequest(handle=x.handle).SerializeToString()
    sock.sendall(struct.pack("!I", len(payload)) + payload)
    sock.close()
    assert answered.wait(5)
    assert wait_until(lambda: table.count(client.session_id) == before, timeout=5)


def test_a_channel_export_whose_caller_was_interrupted_is_released(
    server: Any, client: Any, monkeypatch: Any
) -> None:
    x = client.tensor(np.ones(1000, dtype=np.float32))
    export_fresh(client, x)  # the key learnt: the next Export takes the channel
    client.flush()
    table = server.daemon.exports
    slow_export, answered = slowed_exports(table)  # the interrupt lands meanwhile
    monkeypatch.setattr(table, "export", slow_export)
    exports = count_calls(client, monkeypatch, "Export")
    with interrupted_after(0.05):
        torch.from_dlpack(x)
    assert not exports  # it was the channel's
    monkeypatch.undo()
    assert answered.wait(5)
    session_id = client.session_id
    assert wait_until(lambda: client.flush() or table.count(session_id) == 0, timeout=5)
    assert int(fresh_dlpack(client, x)[999]) == 1


def test_closing_the_client_or_the_server_closes_their_channels(make_server: Any) -> None:
    running = make_server()
    table = running.daemon.exports
    client = tensord.connect(running.address)
    x = client.zeros(4)
    export_fresh(client, x, 2)
    other = tensord.connect(running.address)
    y = other.zeros(4)
    export_fresh(other, y, 2)
    assert table.channel_count() == 2
    client.close()
    assert wait_until(lambda: table.channel_count() == 1, timeout=5)
    sock = other._local._channel._sock
    running.daemon.close()
    assert table.channel_count() == 0
    sock.settimeout(5)
    assert sock.recv(1) == b""  # the server's side closed
    other.close()


def channel_threads() -> int:
    """The server's threads serving a channel or an fd request now (in-process server)."""
    return sum(1 for t in threading.enumerate() if t.name == "tensord-fd-request")


def test_rebinding_a_session_whose_requests_block_never_passes_the_channel_bound(
    fresh_server: Any, monkeypatch: Any
) -> None:
    # A key's holder rebinds over and over, each channel left waiting in a request (here on
    # its session's lock, as behind a long Batch of that session): a replaced channel's
    # thread is still busy, so it must count against MAX_CHANNELS until it ends, else
    # each rebind is one more thread of the server.
    monkeypatch.setattr(server_exports, "MAX_CHANNELS", 2)
    table = fresh_server.daemon.exports
    with tensord.connect(fresh_server.address) as client:
        key = learn_key(client).channel_key
        x = client.zeros(8)
        client.flush()
        before = table.count(client.session_id)
        baseline = channel_threads()
        payload = pb.ExportRequest(handle=x.handle).SerializeToString()
        session = fresh_server.daemon.sessions.peek(client.session_id)
        entered = threading.Semaphore(0)
        handler = fresh_server.fd_socket.channel_handler

        def counted(*args: Any) -> Any:
            entered.release()
            return handler(*args)

        monkeypatch.setattr(fresh_server.fd_socket, "channel_handler", counted)
        socks, lines = [], []
        session.lock.acquire()
        try:
            for _ in range(5):
                sock, line = bind(fresh_server.fd_socket.path, key)
                socks.append(sock)
                lines.append(line)
                if line.startswith(b"ok "):
                    sock.sendall(struct.pack("!I", len(payload)) + payload)
                    assert entered.acquire(timeout=5)  # its thread waits for the session's lock
            # (a refused bind's thread ends just after its answer)
            bound = server_exports.MAX_CHANNELS + 1
            assert wait_until(lambda: channel_threads() - baseline <= bound, timeout=2)
            assert lines[-1] == b"no: too many channels (2)\n"
        finally:
            for sock in socks:  # gone before any answer: each export made is released
                sock.close()
            session.lock.release()
        # once the lock is free every waiting request ends, its export released
        assert wait_until(lambda: channel_threads() == baseline, timeout=5)
        assert wait_until(lambda: table.count(client.session_id) == before, timeout=5)


def test_an_interrupt_inside_a_channel_exchange_never_leaves_its_answer_for_the_next(
    server: Any, client: Any, monkeypatch: Any
) -> None:
    # An interrupt that lands in the thread running the exchange (the main thread, when a
    # call runs there) after its frame was sent: the connection must go, else the next
    # request reads this one's answer (another handle's export, or a stale one's).
    from tensord.local import channel as channel_module

    x = client.zeros(8)
    y = client.ones(8)
    export_fresh(client, x, 2)  # the second bound the channel
    channel = client._local._channel
    receive_exactly = channel_module._receive_exactly
    interrupted: list[bool] = []

    def interrupted_once(*args: Any) -> bytes:
        if not interrupted:
            interrupted.append(True)
            raise KeyboardInterrupt
        return receive_exactly(*args)

    monkeypatch.setattr(channel_module, "_receive_exactly", interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        channel.request(pb.ExportRequest(handle=x.handle).SerializeToString(), 5.0)
    monkeypatch.undo()
    answer = channel.request(pb.ExportRequest(handle=y.handle).SerializeToString(), 5.0)
    assert answer is not None, channel.last_reason
    made = pb.ExportResponse.FromString(answer)
    assert made.tensor.handle == y.handle
    client._conn.call("ReleaseExports", pb.ReleaseExportsRequest(export_ids=[made.export_id]))


def test_channel_exports_count_against_the_handle_limit(make_server: Any) -> None:
    running = make_server(max_handles_per_session=8)
    table = running.daemon.exports
    with tensord.connect(running.address) as client:
        key = learn_key(client).channel_key
        x = client.zeros(8)
        client.flush()
        session = running.daemon.sessions.peek(client.session_id)
        request = pb.ExportRequest(handle=x.handle).SerializeToString()
        sock, line = bind(running.fd_socket.path, key)
        try:
            assert line.startswith(b"ok ")
            answers = [ask(sock, request) for _ in range(8)]
        finally:
            sock.close()
        statuses = [status for status, _ in answers]
        made = statuses.count(CHANNEL_OK)
        assert statuses == [CHANNEL_OK] * made + [CHANNEL_USE_GRPC] * (8 - made)
        assert made and b"ResourceExhaustedError" in answers[-1][1]
        assert len(session.handles) + table.count(client.session_id) == 8


def test_a_channel_key_never_shows_its_secret_or_proof_in_its_repr(
    server: Any, client: Any
) -> None:
    learn_key(client)
    table = server.daemon.exports
    key = table._session_keys[client.session_id]
    assert key.secret not in repr(key) and key.proof not in repr(key)
    assert client.session_id not in repr(key)  # a capability too
    assert key.locator in repr(key)  # enough to tell keys apart in a log


def test_a_trickled_bind_line_is_cut_off_at_the_request_timeout(
    server: Any, client: Any, monkeypatch: Any
) -> None:
    # one byte just inside each wait: the line's whole time is bounded, not each wait's
    monkeypatch.setattr(fd_socket, "FD_REQUEST_TIMEOUT_S", 0.6)
    learn_key(client)
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


def test_threads_exporting_at_once_each_get_their_own_tensor(server: Any, client: Any) -> None:
    # one request at a time on the channel, the others through gRPC: never another's answer
    tensors = [client.full((16,), float(i)) for i in range(4)]
    export_fresh(client, tensors[0], 2)  # the channel bound
    client.flush()
    before = client._local.channel_exports
    wrong: list[tuple[int, float]] = []

    def export_many(i: int) -> None:
        for _ in range(10):
            alias = torch.from_dlpack(tensors[i])
            if not bool((alias == float(i)).all()):
                wrong.append((i, float(alias[0])))
            del alias

    threads = [threading.Thread(target=export_many, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not wrong and not any(thread.is_alive() for thread in threads)
    assert client._local.channel_exports > before
    session_id = client.session_id
    table = server.daemon.exports
    assert wait_until(lambda: client.flush() or table.count(session_id) == 0, timeout=5)
