"""Authentication and tenants: bearer tokens, tenant-scoped sessions, share tokens and
names, the per-session handle limit, and what `tensord serve` refuses and prints."""

from __future__ import annotations

import grpc
import pytest
import tensord
from conftest import SessionStub, open_channel, run_serve
from tensord import schema as pb
from tensord._proto.tensord.v1 import tensord_pb2_grpc
from tensord_server.domain.auth import parse_tokens, tenant_of

TOKENS = {"tok-alice-1": "alice", "tok-alice-2": "alice", "tok-bob": "bob"}


@pytest.fixture
def auth_server(make_server):
    return make_server(auth_tokens=TOKENS)


def test_the_tokens_file_format() -> None:
    assert parse_tokens(["# who", "", "  t1 alice ", "t2 bob"]) == {"t1": "alice", "t2": "bob"}
    for bad in (["t1"], ["t1 a b"], ["t1 a", "t1 b"], ["# nothing"]):
        with pytest.raises(ValueError):
            parse_tokens(bad)
    assert tenant_of(TOKENS, "Bearer tok-bob") == "bob"
    for header in (None, "", "tok-bob", "Bearer nope", "Basic tok-bob"):
        with pytest.raises(tensord.UnauthenticatedError):
            tenant_of(TOKENS, header)


def test_missing_or_wrong_tokens_are_unauthenticated(auth_server) -> None:
    for token in (None, "wrong"):
        with pytest.raises(tensord.UnauthenticatedError):
            tensord.connect(auth_server.address, token=token)
    with open_channel(auth_server.address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            SessionStub(channel)
        assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED


def test_the_token_comes_from_the_environment(auth_server, monkeypatch) -> None:
    monkeypatch.setenv("TENSORD_TOKEN", "tok-bob")
    with tensord.connect(auth_server.address) as client:
        assert client.arange(3).tolist() == [0, 1, 2]


def test_names_tokens_and_sessions_are_scoped_to_the_tenant(auth_server) -> None:
    alice = tensord.connect(auth_server.address, token="tok-alice-1")
    alice2 = tensord.connect(auth_server.address, token="tok-alice-2")
    bob = tensord.connect(auth_server.address, token="tok-bob")
    try:
        secret = alice.arange(5)
        alice.put("w", secret)
        token = secret.share()
        # another tenant: as if they did not exist
        with pytest.raises(tensord.NotFoundError):
            bob.get("w")
        with pytest.raises(tensord.NotFoundError):
            bob.attach(token)
        assert "w" not in bob.names()
        bob.put("w", bob.zeros(2))  # bob's own "w", beside alice's
        assert alice.get("w").tolist() == [0, 1, 2, 3, 4]
        # the same tenant through another token shares as usual
        assert alice2.get("w").tolist() == [0, 1, 2, 3, 4]
        assert alice2.attach(token).tolist() == [0, 1, 2, 3, 4]
        # alice's session id presented with bob's credentials is unknown
        with open_channel(auth_server.address) as channel:
            names = channel.unary_unary(
                "/tensord.v1.Tensord/ListNames",
                request_serializer=pb.ListNamesRequest.SerializeToString,
                response_deserializer=pb.ListNamesResponse.FromString,
            )
            md = (("tensord-session", alice.session_id), ("authorization", "Bearer tok-bob"))
            with pytest.raises(grpc.RpcError) as info:
                names(pb.ListNamesRequest(), metadata=md)
            assert info.value.code() is grpc.StatusCode.NOT_FOUND
        bob.delete("w")
        assert alice.names() == ["w"]
        alice.delete("w")
    finally:
        for client in (alice, alice2, bob):
            client.close()


def test_the_handle_limit_per_session_is_resource_exhausted(make_server) -> None:
    server = make_server(max_handles_per_session=3)
    with tensord.connect(server.address) as client:
        kept = [client.zeros(1), client.zeros(2), client.zeros(3)]
        with pytest.raises(tensord.ResourceExhaustedError, match="max-handles-per-session") as info:
            client.zeros(4)
        assert not isinstance(info.value, tensord.OutOfMemoryError)
        # share tokens are entries the session keeps too (until it ends): they count
        kept.pop()
        client.flush()
        kept[0].share()
        with pytest.raises(tensord.ResourceExhaustedError, match="1 share tokens"):
            kept[1].share()
        del kept


def test_a_multi_handle_view_at_the_handle_limit_issues_all_or_none(make_server) -> None:
    server = make_server(max_handles_per_session=4)
    with tensord.connect(server.address) as client:
        x = client.arange(16)
        # a limit only the server knows: with pipelining it surfaces at the next wait
        with pytest.raises(tensord.ResourceExhaustedError, match="asked for 8 more"):
            x.chunk(8)
            client.synchronize()
        session = server.daemon.sessions.peek(client.session_id)
        # no handle the client never learnt of stays behind to eat the limit
        assert server.daemon.sessions.handle_count(session) == 1
        # torch: chunk sizes of ceil(16 / 3) = 6
        assert [t.tolist() for t in x.chunk(3)] == [
            list(range(6)),
            list(range(6, 12)),
            list(range(12, 16)),
        ]


def test_the_session_limit_per_tenant_is_resource_exhausted(make_server) -> None:
    server = make_server(auth_tokens=TOKENS, max_sessions_per_tenant=2)
    first = tensord.connect(server.address, token="tok-alice-1")
    second = tensord.connect(server.address, token="tok-alice-2")  # same tenant, other token
    try:
        with pytest.raises(tensord.ResourceExhaustedError, match="max-sessions-per-tenant 2"):
            tensord.connect(server.address, token="tok-alice-1")
        with tensord.connect(server.address, token="tok-bob") as bob:  # another tenant's own
            assert bob.arange(2).tolist() == [0, 1]
        # a resumed session is not a new one
        with open_channel(server.address) as channel:
            stub = tensord_pb2_grpc.TensordStub(channel)
            resumed = stub.OpenSession(
                pb.OpenSessionRequest(resume_session_id=first.session_id),
                metadata=(("authorization", "Bearer tok-alice-1"),),
            )
            assert resumed.resumed
        second.close()
        with tensord.connect(server.address, token="tok-alice-1") as third:  # room again
            assert third.arange(1).tolist() == [0]
    finally:
        first.close()
        second.close()


def test_the_name_limit_per_tenant_is_resource_exhausted(make_server) -> None:
    server = make_server(auth_tokens=TOKENS, max_names_per_tenant=2)
    with (
        tensord.connect(server.address, token="tok-alice-1") as alice,
        tensord.connect(server.address, token="tok-bob") as bob,
    ):
        x = alice.zeros(3)
        alice.put("a", x)
        alice.put("b", x)
        with pytest.raises(tensord.ResourceExhaustedError, match="max-names-per-tenant 2"):
            alice.put("c", x)
        alice.put("b", alice.ones(3), overwrite=True)  # overwriting is not a new name
        bob.put("c", bob.zeros(1))  # bob's names are his own
        alice.delete("a")
        alice.put("c", x)  # room again
        assert sorted(alice.names()) == ["b", "c"]


@pytest.mark.slow
def test_serve_refuses_a_limit_below_one() -> None:
    for flag in (
        "--max-handles-per-session",
        "--max-sessions-per-tenant",
        "--max-names-per-tenant",
    ):
        result = run_serve("--address", "127.0.0.1:0", "--device", "cpu", flag, "0")
        assert result.returncode == 2 and f"{flag} must be >= 1" in result.stderr


@pytest.mark.slow
def test_serve_refuses_a_remote_bind_without_authentication() -> None:
    result = run_serve("--address", "0.0.0.0:0")
    assert result.returncode == 2
    assert "--auth-tokens" in result.stderr and "--insecure-allow-remote" in result.stderr


@pytest.mark.slow
def test_serve_says_which_mode_it_runs_in(tmp_path) -> None:
    from tensord_server.tools.serve import is_loopback, mode_line

    assert is_loopback("127.0.0.1:0") and is_loopback("unix:/tmp/x") and is_loopback("[::1]:5")
    assert not is_loopback("0.0.0.0:50051")
    assert "loopback only" in mode_line("127.0.0.1:0", authenticated=False)
    assert "authenticated" in mode_line("0.0.0.0:1", authenticated=True)
    assert "UNAUTHENTICATED" in mode_line("0.0.0.0:1", authenticated=False)
    bad = tmp_path / "tokens"
    bad.write_text("only-a-token\n")
    result = run_serve("--address", "127.0.0.1:0", "--auth-tokens", str(bad))
    assert result.returncode == 2
    assert "TOKEN TENANT" in result.stderr


def test_a_unix_socket_is_private_to_the_servers_user(tmp_path) -> None:
    import os
    import stat

    from tensord_server.domain.store import TensorStore
    from tensord_server.rpc.grpc_server import create_server

    path = tmp_path / "tensord.sock"
    daemon = TensorStore(("cpu=64MiB",))
    server, _ = create_server(f"unix:{path}", store=daemon)
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        with tensord.connect(f"unix:{path}") as client:
            assert client.arange(2).tolist() == [0, 1]
    finally:
        server.stop(1.0).wait()
        daemon.close()


def test_memory_stats_count_the_callers_tenant_only(auth_server) -> None:
    with (
        tensord.connect(auth_server.address, token="tok-alice-1") as alice,
        tensord.connect(auth_server.address, token="tok-bob") as bob,
    ):
        kept = [alice.zeros(1000), alice.zeros(10)]
        kept.append(kept[0].narrow(0, 0, 5))  # a view: the same Storage, counted once
        alice.put("n", kept[1])
        mine = alice.memory_stats()
        assert mine["tenant.sessions.live"] == 1
        assert mine["tenant.storages.live"] == 2
        # 4000 and 40 bytes, each rounded up to 512 B as the pool rounds
        assert mine["tenant.allocated_bytes.current"] == 4096 + 512
        blocks = sum(s.block.size for s in auth_server.daemon.storages.live())
        assert blocks == mine["allocated_bytes.all.current"] == 4096 + 512
        theirs = bob.memory_stats()
        assert theirs["tenant.storages.live"] == 0
        assert theirs["tenant.allocated_bytes.current"] == 0
        alice.delete("n")
        del kept


def _block_address(server, data_ptr: int) -> int:
    """The pool block (the server's view) under the Storage whose data_ptr is ``data_ptr``."""
    (storage,) = (s for s in server.daemon.storages.live() if s.data_ptr == data_ptr)
    return int(storage.block.address)


def _bytes_left_in_a_reused_block(server, owner_token: str | None, reader_token: str | None):
    """The owner fills 1 MiB with 0xAB and frees it; the reader's empty() of the same size
    gets that block back (best fit, the pool caches it): what does the reader see?"""
    with tensord.connect(server.address, token=owner_token) as owner:
        secret = owner.full((1 << 20,), 0xAB, dtype=tensord.uint8)
        secret_ptr = secret.data_ptr()
        address = _block_address(server, secret_ptr)
        del secret
        owner.flush()
    with tensord.connect(server.address, token=reader_token) as reader:
        fresh = reader.empty(1 << 20, dtype=tensord.uint8)
        # (data_ptr is the Storage's stable address: a freed one may be given out again, as
        # torch's allocator does, so only the pool block tells whether the block was reused)
        if owner_token == reader_token:  # the very block the owner freed
            assert _block_address(server, fresh.data_ptr()) == address
        else:  # tenants allocate on their own pool streams: never another tenant's block
            assert _block_address(server, fresh.data_ptr()) != address
        return fresh.numpy()


def test_empty_never_shows_another_tenants_freed_bytes(auth_server) -> None:
    seen = _bytes_left_in_a_reused_block(auth_server, "tok-alice-1", "tok-bob")
    assert not seen.any()


def test_without_tenants_empty_is_torchs_uninitialized_memory(fresh_server) -> None:
    # one trust domain: empty() returns what the block held, as torch.empty does (and this
    # is how the test above would see a leak)
    seen = _bytes_left_in_a_reused_block(fresh_server, None, None)
    assert (seen == 0xAB).all()
