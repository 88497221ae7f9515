"""Worker starvation: idle streams cannot hold every server thread, idle streams time out,
heartbeats are answered while every worker is busy (the lease clock never stops), and
heartbeats never wait on the tables or a compaction."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest
import tensord
from conftest import SessionStub, open_channel
from tensord import schema as pb
from tensord._proto.tensord.v1 import tensord_pb2_grpc
from tensord_server.domain.call_gate import CallGate
from tensord_server.domain.store import TensorStore
from tensord_server.rpc.grpc_server import create_server

# The reproducer: --max-workers 4 --lease 1 --session-grace 2, and 4 idle uploads.
WORKERS = 4
LEASE_S = 1.0
GRACE_S = 2.0
IDLE_TIMEOUT_S = 2.0
# An idle upload's client waits this long at most for the test to let it go (bounds the test
# on a server without idle timeouts, where nothing else would end it).
HOLD_S = 6.0


def _allocated(daemon: TensorStore) -> int:
    return int(daemon.memory_reports.memory_stats("cpu")["allocated_bytes.all.current"])


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


@pytest.mark.slow
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
            # a stream's slot goes back when gRPC ends its call, a moment after its caller
            # saw the status: on a loaded machine, that moment can come after the sleep
            deadline = time.monotonic() + 10.0
            while daemon.gate.open_streams() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert daemon.gate.open_streams() == 0
        finally:
            release.set()
        attacker.close()


def test_a_tenant_holds_at_most_its_fair_share_of_streams() -> None:
    gate = CallGate(16, multi_tenant=True)
    assert (gate.max_streams, gate.max_streams_per_tenant) == (12, 6)
    for _ in range(6):
        gate.open_stream("Upload", "alice")
    with pytest.raises(tensord.errors.ResourceExhaustedError, match="--max-streams-per-tenant 6"):
        gate.open_stream("Upload", "alice")
    gate.open_stream("Download", "bob")  # another tenant still gets in
    assert gate.open_streams("alice") == 6 and gate.open_streams() == 7


@pytest.fixture
def saturated_server(monkeypatch):
    """A server with 2 workers, both held by MemoryStats calls blocked in the daemon (the
    attack: a tenant's slow allowed unary calls), and a silent session (a crashed client)."""
    daemon = TensorStore(("cpu=64MiB",), session_grace=0.3, lease=0.3)
    server, port = create_server("127.0.0.1:0", store=daemon, max_workers=2)
    address = f"127.0.0.1:{port}"
    release, entered = threading.Event(), threading.Semaphore(0)
    real_stats = daemon.memory_reports.memory_stats

    def slow_stats(*args, **kwargs):
        entered.release()
        release.wait(10.0)  # bounded: the test sets it when done
        return real_stats(*args, **kwargs)

    with open_channel(address) as busy_channel, open_channel(address) as channel:
        silent = SessionStub(channel, "silent")
        busy = SessionStub(busy_channel, "busy")
        monkeypatch.setattr(daemon.memory_reports, "memory_stats", slow_stats)
        calls = [
            busy.raw.MemoryStats.future(pb.DeviceRequest(device="cpu"), metadata=busy.md)
            for _ in range(2)
        ]
        try:
            assert entered.acquire(timeout=5) and entered.acquire(timeout=5)  # both workers held
            yield daemon, address, silent
        finally:
            release.set()
            for call in calls:
                call.result(timeout=10)
    server.stop(1.0).wait()
    daemon.close()


def test_heartbeats_are_answered_while_every_worker_is_busy(saturated_server) -> None:
    daemon, address, _ = saturated_server
    with open_channel(address) as channel:
        raw = tensord_pb2_grpc.TensordStub(channel)
        # OpenSession too runs beside the busy workers
        opened = raw.OpenSession(pb.OpenSessionRequest(client_name="alive"), timeout=2)
        md = (("tensord-session", opened.session_id),)
        for _ in range(4):  # well past lease + grace: renewed by its heartbeats alone
            raw.Heartbeat(pb.Heartbeat(sent_at=1.0), metadata=md, timeout=2)
            time.sleep(0.2)
        assert opened.session_id in daemon.sessions.session_ids()


def test_the_lease_clock_runs_while_the_server_is_saturated(saturated_server, wait_until) -> None:
    """Busy workers no longer stop the clock: a silent session is reaped on time (a tenant
    keeping the server busy cannot keep lost sessions and their memory alive)."""
    daemon, _, silent = saturated_server
    assert wait_until(lambda: silent.session_id not in daemon.sessions.session_ids(), timeout=3)


def test_a_heartbeat_never_waits_on_the_tables_or_a_compaction(small_server) -> None:
    daemon, address = small_server
    with open_channel(address) as channel:
        stub = SessionStub(channel)
        stub.upload(np.ones(256, np.float32))
        pool = daemon.devices.get("cpu").pool
        # a compaction in progress: the registry stopped, and a call waiting on it
        # holding the session tables
        with daemon.storages.relocation(pool), daemon.sessions._lock:
            started = time.monotonic()
            stub.Heartbeat(pb.Heartbeat(sent_at=1.0), metadata=stub.md, timeout=5)
            assert time.monotonic() - started < 1.0
        stub.close()


@pytest.mark.slow
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
        time.sleep(IDLE_TIMEOUT_S + 0.5)
        # its slot stays taken while gRPC holds what was written to it...
        assert daemon.gate.open_streams() == 1
        with pytest.raises(grpc.RpcError) as info:
            for _ in stream:  # what was in flight, then the status
                pass
        assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        # ...and comes back once the call has ended
        assert wait_until(lambda: daemon.gate.open_streams() == 0, timeout=5)
        stub.close()
