"""Faults: a client killed mid-upload, a cut connection through and past its grace,
SIGTERM with a call in flight, and an OOM in one client beside another's tensors."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time

import grpc
import numpy as np
import pytest
from conftest import (
    SessionStub,
    open_channel,
    server_allocated,
    start_serve_process,
    wait_until,
)
from tensord import schema as pb

WAIT_S = 30.0


def test_a_client_killed_mid_upload_leaves_nothing_allocated(make_server) -> None:
    server = make_server(
        lease=60.0
    )  # the child's session outlives the test: only the upload may go
    code = textwrap.dedent(
        """
        import sys, time, grpc
        from tensord import schema as pb
        channel = grpc.insecure_channel(sys.argv[1])
        stub = __import__("tensord._proto.tensord.v1.tensord_pb2_grpc", fromlist=["x"]).TensordStub(channel)
        sid = stub.OpenSession(pb.OpenSessionRequest(client_name="doomed")).session_id
        nbytes = 64 << 20
        header = pb.UploadHeader(shape=[nbytes], dtype="uint8", device="cpu", nbytes=nbytes)
        def chunks():
            for i in range(64):
                yield bytes(1 << 20)
                if i == 8:
                    print("uploading", flush=True)
                    time.sleep(600)
        upload = channel.stream_unary("/tensord.v1.Tensord/Upload")
        upload(chunks(), metadata=(("tensord-session", sid), ("tensord-upload-bin", header.SerializeToString())))
        """
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code, server.address], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "uploading"
        assert wait_until(
            lambda: server_allocated(server) >= 64 << 20, WAIT_S
        )  # the upload's Storage
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=WAIT_S)
        if child.stdout is not None:
            child.stdout.close()
    assert wait_until(lambda: server_allocated(server) == 0, WAIT_S)
    assert len(server.daemon.storages) == 0
    for device in server.daemon.devices:
        device.pool.assert_invariants()


@pytest.mark.slow
def test_a_cut_connection_keeps_handles_through_the_grace_and_loses_them_after(
    make_server,
) -> None:
    server = make_server(lease=0.3, session_grace=1.5)
    channel = open_channel(server.address)
    session = SessionStub(channel, "cut")
    meta = session.upload(np.arange(1000, dtype=np.float32))
    channel.close()  # the connection is cut; no heartbeat follows
    sessions = server.daemon.sessions
    # the lease lapses after 0.3 s; the handles wait for the grace (1.5 s more)
    time.sleep(0.6)
    assert session.session_id in sessions.session_ids()
    with open_channel(server.address) as again:
        stub = SessionStub(again, "probe")
        reopened = stub.raw.OpenSession(pb.OpenSessionRequest(resume_session_id=session.session_id))
        assert reopened.resumed
        md = (("tensord-session", session.session_id),)
        data = b"".join(
            again.unary_stream(
                "/tensord.v1.Tensord/Download",
                request_serializer=pb.DownloadRequest.SerializeToString,
            )(pb.DownloadRequest(handle=meta.handle), metadata=md)
        )
        assert np.array_equal(
            np.frombuffer(data, dtype=np.float32), np.arange(1000, dtype=np.float32)
        )
        stub.close()
    # silent again: lost after the lease, released after the grace
    assert wait_until(lambda: session.session_id not in sessions.session_ids(), WAIT_S)
    assert server_allocated(server) == 0


@pytest.mark.slow
def test_sigterm_lets_an_inflight_upload_finish(tmp_path) -> None:
    """SIGTERM while an upload is half sent: the upload finishes within the grace.  The
    signal goes only once the server has the call (its tensor allocated: before that a
    stopping server refuses the call, CANCELLED, which this test once hit on a busy
    machine), and the rest of the chunks only once the signal was sent."""
    proc, address = start_serve_process("--address", "127.0.0.1:0")
    signalled = threading.Event()
    try:
        with open_channel(address) as channel, open_channel(address) as monitor_channel:
            session = SessionStub(channel, "inflight")
            monitor = SessionStub(monitor_channel, "monitor")
            nbytes = 8 << 20

            def chunks():
                for i in range(8):
                    yield bytes(1 << 20)
                    if i == 0:
                        signalled.wait(WAIT_S)  # the rest after SIGTERM
                    time.sleep(0.05)

            header = pb.UploadHeader(shape=[nbytes], dtype="uint8", device="cpu", nbytes=nbytes)
            upload = channel.stream_unary(
                "/tensord.v1.Tensord/Upload", response_deserializer=pb.TensorMeta.FromString
            )
            future = upload.future(
                chunks(),
                metadata=(*session.md, ("tensord-upload-bin", header.SerializeToString())),
            )

            def allocated() -> int:
                stats = monitor.MemoryStats(
                    pb.DeviceRequest(device="cpu"), metadata=monitor.md, timeout=WAIT_S
                )
                return int(stats.counters["allocated_bytes.all.current"])

            assert wait_until(lambda: allocated() >= nbytes, WAIT_S)  # the server has the call
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.2)  # the server is stopping when the next chunks come
            signalled.set()
            meta = future.result(timeout=WAIT_S)  # finished, not cancelled
            assert list(meta.shape) == [nbytes]
        assert proc.wait(timeout=WAIT_S) == 0
    finally:
        signalled.set()
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=WAIT_S)


def test_an_oom_in_one_client_leaves_every_other_clients_tensors_intact(
    make_server, open_session
) -> None:
    server = make_server(devices=("cpu=64MiB",))
    victim = open_session(server.address, "victim")
    rng = np.random.default_rng(7)
    data = [rng.standard_normal(n).astype(np.float32) for n in (10, 1 << 16, 1 << 22)]
    metas = [victim.upload(a) for a in data]
    greedy = open_session(server.address, "greedy")
    for shape in ([1 << 30], [16 << 20, 4], [(1 << 24) + 1, 3]):
        with pytest.raises(grpc.RpcError) as info:
            greedy.Empty(pb.EmptyRequest(shape=shape, dtype="float32"), metadata=greedy.md)
        assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    for meta, array in zip(metas, data, strict=True):
        assert np.array_equal(victim.download(meta), array)
    for device in server.daemon.devices:
        device.pool.assert_invariants()
