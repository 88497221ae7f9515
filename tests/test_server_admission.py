"""Worker starvation: idle streams cannot hold every server thread, idle streams time out,
busy time never lapses a lease, and heartbeats never wait on the tables or a compaction."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest
import tensord
from conftest import SessionStub, open_channel
from tensord._proto.tensord.v1 import tensord_pb2 as pb
from tensord_server.domain.admission import CallGate
from tensord_server.domain.sessions import SessionManager
from tensord_server.domain.storage import StorageRegistry
from tensord_server.domain.store import TensorStore
from tensord_server.rpc.server import create_server

# The reproducer: --max-workers 4 --lease 1 --session-grace 2, and 4 idle uploads.
WORKERS = 4
LEASE_S = 1.0
GRACE_S = 2.0
IDLE_TIMEOUT_S = 2.0
# An idle upload's client waits this long at most for the test to let it go (bounds the test
# on a server without idle timeouts, where nothing else would end it).
HOLD_S = 6.0


def _allocated(daemon: TensorStore) -> int:
    return int(daemon.memory_stats("cpu")["allocated_bytes.all.current"])


@pytest.fixture
def small_server():
    daemon = TensorStore(
        ("cpu=64MiB",), session_grace=GRACE_S, lease=LEASE_S, stream_idle_timeout=IDLE_TIMEOUT_S
    )
    server, port = create_server("127.0.0.1:0", store=daemon, max_workers=WORKERS)
    yield daemon, f"127.0.0.1:{port}"
    server.stop(1.0).wait()
    daemon.close()


def _idle_upload(stub: SessionStub, release: threading.Event) -> grpc.Future:
    """An Upload of 1 MiB that sends one chunk, then nothing until ``release`` (bounded)."""
    header = pb.UploadHeader(shape=[1 << 18], dtype="float32", device="cpu", nbytes=1 << 20)

    def chunks():
        yield b"\0" * 4096
        release.wait(HOLD_S)

    upload = stub.channel.stream_unary("/tensord.v1.Tensord/Upload")
    metadata = (*stub.md, ("tensord-upload-bin", header.SerializeToString()))
    return upload.future(chunks(), metadata=metadata)


def test_idle_uploads_cannot_starve_other_clients_of_their_session(small_server) -> None:
    daemon, address = small_server
    release = threading.Event()
    with tensord.connect(address) as victim, open_channel(address) as channel:
        kept = victim.arange(1000, dtype=tensord.int32)
        before = _allocated(daemon)
        attacker = SessionStub(channel, "attacker")
        started = time.monotonic()
        uploads = [_idle_upload(attacker, release) for _ in range(WORKERS)]
        try:
            # the stream beyond --max-streams (workers less the unary reserve) is refused at once
            deadline = time.monotonic() + 1.0
            while not any(u.done() for u in uploads) and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.1)  # a second refusal, if any, comes as fast
            refused = [u for u in uploads if u.done()]
            assert len(refused) == 1, [u.done() for u in uploads]
            assert refused[0].code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-streams 3" in refused[0].details()
            assert time.monotonic() - started < IDLE_TIMEOUT_S
            # the rest are cancelled once idle for the timeout...
            idle = [u for u in uploads if u is not refused[0]]
            for upload in idle:
                with pytest.raises(grpc.RpcError) as info:
                    upload.result(timeout=IDLE_TIMEOUT_S + 3)
                assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED, info.value
                assert "--stream-idle-timeout" in info.value.details()
            # ...their partial Storages freed; meanwhile the victim heartbeated all along
            time.sleep(LEASE_S + GRACE_S - (time.monotonic() - started) + 0.5)
            assert victim.session_id in daemon.sessions.session_ids()
            assert kept.tolist() == list(range(1000))
            assert _allocated(daemon) == before
            assert daemon.gate.open_streams() == 0
        finally:
            release.set()
        attacker.close()


def test_a_tenant_holds_at_most_its_fair_share_of_streams() -> None:
    gate = CallGate(16, multi_tenant=True)
    assert (gate.max_streams, gate.max_streams_per_tenant) == (12, 6)
    for _ in range(6):
        gate.open_stream(object(), "Upload", "alice")
    with pytest.raises(tensord.errors.ResourceExhaustedError, match="--max-streams-per-tenant 6"):
        gate.open_stream(object(), "Upload", "alice")
    gate.open_stream(object(), "Download", "bob")  # another tenant still gets in
    assert gate.open_streams("alice") == 6 and gate.open_streams() == 7


def test_busy_time_never_counts_against_a_lease() -> None:
    now = [0.0]
    gate = CallGate(2, clock=lambda: now[0])
    sessions = SessionManager(StorageRegistry(), grace=2.0, lease=1.0, clock=gate.lease_clock)
    session, _ = sessions.open("busy")
    with gate.call(), gate.call():  # every worker busy: the client's heartbeat is queued
        now[0] += 60.0
        assert sessions.reap() == []
    assert session.id in sessions.session_ids()
    now[0] += 2.9  # not saturated any more: lease (1) + grace (2) later it is lost
    assert sessions.reap() == []
    now[0] += 0.2
    assert sessions.reap() == [session.id]


def test_a_heartbeat_never_waits_on_the_tables_or_a_compaction(small_server) -> None:
    daemon, address = small_server
    with open_channel(address) as channel:
        stub = SessionStub(channel)
        stub.upload(np.ones(256, np.float32))
        pool = daemon.device("cpu").pool
        # a compaction in progress: the registry stopped, and a call waiting on it
        # holding the session tables
        with daemon.storages.relocation(pool), daemon.sessions._lock:
            started = time.monotonic()
            stub.Heartbeat(pb.Heartbeat(sent_at=1.0), metadata=stub.md, timeout=5)
            assert time.monotonic() - started < 1.0
        stub.close()


def test_a_download_whose_consumer_stops_reading_is_cancelled(small_server, wait_until) -> None:
    daemon, address = small_server
    with open_channel(address) as channel:
        stub = SessionStub(channel)
        meta = stub.upload(np.zeros(8 << 20, np.float32))  # 32 MiB: far past the flow window
        download = channel.unary_stream(
            "/tensord.v1.Tensord/Download",
            request_serializer=pb.DownloadRequest.SerializeToString,
        )
        stream = download(pb.DownloadRequest(handle=meta.handle), metadata=stub.md)
        next(stream)  # then read nothing: the server blocks on flow control
        assert wait_until(lambda: daemon.gate.open_streams() == 0, timeout=IDLE_TIMEOUT_S + 3)
        with pytest.raises(grpc.RpcError) as info:
            for _ in stream:  # what was in flight, then the status
                pass
        assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        stub.close()
