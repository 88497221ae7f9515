"""`tensord serve` as a process, its arguments, the device table and the pool RPCs."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess

import grpc
import numpy as np
import pytest
from conftest import SessionStub, run_serve, start_serve_process
from tensord import schema as pb
from tensord._proto.tensord.v1 import tensord_pb2_grpc
from tensord.errors import FailedPreconditionError
from tensord_server.devices.table import DeviceSpec, DeviceTable, parse_bytes, parse_device_spec
from tensord_server.domain.store import TensorStore
from tensord_server.tools.serve import configure_pools, shown_address


@pytest.mark.slow
def test_serve_answers_health_and_reflection_and_exits_0_on_sigterm() -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    process, address = start_serve_process("--address", "127.0.0.1:0", "--device", "cpu=256MiB")
    try:
        assert address.startswith("127.0.0.1:") and not address.endswith(":0")
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("", "tensord.v1.Tensord"):
                reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
            replies = reflect.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
            )
            names = {s.name for r in replies for s in r.list_services_response.service}
            assert {"tensord.v1.Tensord", "grpc.health.v1.Health"} <= names
            stub = tensord_pb2_grpc.TensordStub(channel)
            info = stub.ServerInfo(pb.ServerInfoRequest(), timeout=10)
            assert [(d.device, d.capacity_bytes) for d in info.devices] == [("cpu", 256 << 20)]
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=10)


@pytest.mark.slow
def test_a_server_that_logs_a_lot_keeps_answering() -> None:
    """At debug every call is a log line (a refusal's with its ~500-byte message): a thousand
    of them outgrow a pipe's 64 KiB.  With its stderr a pipe nobody reads, the server used
    to block in the request that logged, for good (the cost fuzz hung the suite so); now
    only its log writer thread waits, and the lines beyond its queue are dropped."""
    process, address = start_serve_process(
        "--address", "127.0.0.1:0", "--device", "cpu=64MiB", "--log-level", "debug",
        stderr=subprocess.PIPE,  # never read until the end
    )  # fmt: skip
    try:
        with grpc.insecure_channel(address) as channel:
            stub = SessionStub(channel)
            huge = pb.EmptyRequest(shape=[1 << 40], dtype="float32", device="cpu")
            for _ in range(1000):
                with pytest.raises(grpc.RpcError) as refused:
                    stub.Empty(huge, metadata=stub.md, timeout=10)
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            stub.ServerInfo(pb.ServerInfoRequest(), timeout=10)
            stub.close()
    finally:
        process.terminate()
        _, err = process.communicate(timeout=30)
    # read at last, the queued lines come out, down to the stop's own
    assert "Empty RESOURCE_EXHAUSTED" in err and "stopping: in-flight calls" in err, err[-2000:]


@pytest.mark.slow
def test_serve_on_a_unix_socket(tmp_path) -> None:
    path = tmp_path / "tensord.sock"
    process, address = start_serve_process("--address", f"unix:{path}")
    try:
        assert address == f"unix:{path}"
        with grpc.insecure_channel(address) as channel:
            info = tensord_pb2_grpc.TensordStub(channel).ServerInfo(
                pb.ServerInfoRequest(), timeout=10
            )
            assert info.devices[0].device == "cpu"
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=10)


@pytest.mark.slow
@pytest.mark.parametrize(("device", "needle"), [("cuda:0", "CuPy"), ("tpu", "unknown device")])
def test_serve_refuses_devices_it_cannot_open(device, needle) -> None:
    env = os.environ.copy()
    if device.startswith("cuda"):
        pytest.importorskip("tensord_server.devices.cuda")
        try:
            import cupy  # noqa: F401

            pytest.skip("CuPy is installed here: cuda:0 may well open")
        except ImportError:
            pass
    result = run_serve("--device", device, env=env)
    assert result.returncode == 2
    assert needle in result.stderr


@pytest.mark.slow
def test_serve_refuses_fewer_than_one_worker_without_a_traceback() -> None:
    result = run_serve("--address", "127.0.0.1:0", "--max-workers", "0")
    assert result.returncode == 2
    assert "tensord serve: --max-workers must be >= 1" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(("grace", "lease"), [(math.nan, 10.0), (math.inf, 10.0), (30.0, math.inf)])
def test_a_store_refuses_a_grace_or_lease_that_is_not_finite(grace, lease) -> None:
    # a NaN grace never reaps a lost session; an infinite lease reaches clients, whose
    # heartbeat cannot wait that long; `tensord serve` prints this ValueError and exits 2
    with pytest.raises(ValueError, match="finite"):
        TensorStore(("cpu=64MiB",), session_grace=grace, lease=lease)


def test_parse_sizes_and_device_specs() -> None:
    assert parse_bytes("8GiB") == 8 << 30
    assert parse_bytes("512mib") == 512 << 20
    assert parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes("1024") == 1024
    with pytest.raises(ValueError):
        parse_bytes("lots")
    assert parse_device_spec("cpu") == DeviceSpec("cpu", None)
    assert parse_device_spec("cpu=1GiB") == DeviceSpec("cpu", 1 << 30)
    assert parse_device_spec("cuda=40GiB") == DeviceSpec("cuda:0", 40 << 30)
    assert parse_device_spec("cuda:3") == DeviceSpec("cuda:3", None)
    with pytest.raises(ValueError):
        parse_device_spec("gpu:0")
    assert shown_address("0.0.0.0:0", 1234) == "0.0.0.0:1234"
    assert shown_address("[::1]:0", 1234) == "[::1]:1234"


def test_serve_gives_each_pool_its_policy_and_warm_reserve() -> None:
    """--warm-reserve: by default 1/4 of each device's capacity, at most 1 GiB; a value
    given applies to every device (0: none)."""
    store = TensorStore(("cpu=256MiB",))
    try:
        configure_pools(store, "adaptive", None, record_history=False)
        pool = store.devices.get("cpu").pool
        assert pool.policy.name == "adaptive" and pool.warm_reserve == 64 << 20
        configure_pools(store, "pytorch", 0, record_history=False)
        assert pool.policy.name == "pytorch" and pool.warm_reserve == 0
    finally:
        store.close()
    store = TensorStore(("cpu=64GiB",))  # a limit, not an allocation
    try:
        configure_pools(store, "adaptive", None, record_history=False)
        assert store.devices.get("cpu").pool.warm_reserve == 1 << 30
    finally:
        store.close()


@pytest.mark.slow
def test_serve_refuses_a_warm_reserve_that_is_no_size() -> None:
    result = run_serve("--address", "127.0.0.1:0", "--warm-reserve", "lots")
    assert result.returncode == 2
    assert "tensord serve: invalid size 'lots'" in result.stderr
    assert "Traceback" not in result.stderr


def test_device_table() -> None:
    table = DeviceTable(["cpu=64MiB"])
    assert table.names == ("cpu",)
    assert table.get("").pool.capacity == 64 << 20
    assert table.get("cpu:0") is table.get("cpu")
    with pytest.raises(FailedPreconditionError):
        table.get("cuda:0")
    with pytest.raises(ValueError):
        DeviceTable(["cpu", "cpu=1GiB"])


def test_pool_rpcs(make_server, open_session) -> None:
    server = make_server()
    session = open_session(server.address)
    md = session.md
    meta = session.upload(np.ones(1 << 20, dtype=np.float32))
    stats = session.MemoryStats(pb.DeviceRequest(), metadata=md)
    assert stats.counters["allocated_bytes.all.current"] >= 4 << 20
    assert stats.counters["num_device_alloc"] >= 1
    assert all(k.startswith("external_fragmentation") for k in stats.ratios)
    summary = session.MemorySummary(pb.DeviceRequest(device="cpu"), metadata=md).summary
    assert "Allocated memory" in summary
    snapshot = json.loads(
        session.MemorySnapshot(pb.MemorySnapshotRequest(), metadata=md).snapshot_json
    )
    assert snapshot["segments"] and "device_traces" in snapshot
    session.Release(pb.ReleaseRequest(handles=[meta.handle]), metadata=md)
    released = session.EmptyCache(pb.DeviceRequest(), metadata=md).released_bytes
    assert released >= 4 << 20
    after = session.MemoryStats(pb.DeviceRequest(), metadata=md).counters
    assert after["reserved_bytes.all.current"] == 0


def test_stop_lets_an_in_flight_download_finish(make_server, open_session) -> None:
    server = make_server()
    session = open_session(server.address)
    array = np.arange(2 << 20, dtype=np.float32)  # 8 MiB
    meta = session.upload(array)
    download = session.channel.unary_stream(
        "/tensord.v1.Tensord/Download", request_serializer=pb.DownloadRequest.SerializeToString
    )
    stream = download(
        pb.DownloadRequest(handle=meta.handle, chunk_bytes=64 << 10), metadata=session.md
    )
    chunks = [next(stream)]  # the call is in flight, most of it not yet sent
    stopped = server.grpc_server.stop(10)
    chunks.extend(stream)
    assert stopped.wait(30)
    np.testing.assert_array_equal(np.frombuffer(b"".join(chunks), dtype=np.float32), array)
