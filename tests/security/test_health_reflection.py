"""gRPC health and reflection under the same rules as Tensord's own calls: with
--auth-tokens a reflection (or health Watch) stream needs a token, every stream is
admitted within the stream limits and cancelled when idle, and the unary health
Check answers probes without credentials."""

from __future__ import annotations

import threading

import grpc
import pytest
from conftest import open_channel, wait_until
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tensord_server.domain.store import TensorStore
from tensord_server.rpc.grpc_server import create_server

TOKENS = {"tok-alice": "alice"}
ALICE = (("authorization", "Bearer tok-alice"),)
IDLE_TIMEOUT_S = 0.5
# A client gives up after this long: bounds each call on a server that never answers it.
CALL_TIMEOUT_S = 3.0


@pytest.fixture
def auth_server():
    # 4 workers: --max-streams 3, half of them (1) per tenant
    daemon = TensorStore(("cpu=16MiB",), auth_tokens=TOKENS, stream_idle_timeout=IDLE_TIMEOUT_S)
    server, port = create_server("127.0.0.1:0", store=daemon, max_workers=4)
    with open_channel(f"127.0.0.1:{port}") as channel:
        yield daemon, channel
    server.stop(1.0).wait()
    daemon.close()


def _reflection(channel: grpc.Channel, metadata, hold: threading.Event):
    """A reflection stream that asks nothing, until ``hold`` is set (bounded)."""

    def nothing():
        hold.wait(CALL_TIMEOUT_S)
        yield from ()

    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    return stub.ServerReflectionInfo(nothing(), metadata=metadata, timeout=CALL_TIMEOUT_S)


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    return info.value.code()


def test_reflection_without_a_token_is_refused_at_once(auth_server) -> None:
    _, channel = auth_server
    hold = threading.Event()
    try:
        assert _code(_reflection(channel, (), hold)) is grpc.StatusCode.UNAUTHENTICATED
    finally:
        hold.set()


def test_reflection_with_a_token_answers(auth_server) -> None:
    _, channel = auth_server
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    ask = reflection_pb2.ServerReflectionRequest(list_services="")
    (reply,) = stub.ServerReflectionInfo(iter([ask]), metadata=ALICE, timeout=CALL_TIMEOUT_S)
    names = {s.name for s in reply.list_services_response.service}
    assert "tensord.v1.Tensord" in names


def test_reflection_streams_are_admitted_and_cancelled_when_idle(auth_server) -> None:
    daemon, channel = auth_server
    hold = threading.Event()
    try:
        first = _reflection(channel, ALICE, hold)
        second = _reflection(channel, ALICE, hold)  # over alice's share (1 stream)
        codes = sorted((_code(first).name, _code(second).name))
        # one refused at once, the other cancelled once idle (not by the client's deadline)
        assert codes == ["DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"], codes
        # the client sees the status before the handler's end frees the stream's slot
        assert wait_until(lambda: daemon.gate.open_streams() == 0, timeout=2.0)
    finally:
        hold.set()


def test_the_idle_stream_is_cancelled_by_the_server(auth_server) -> None:
    _, channel = auth_server
    hold = threading.Event()
    try:
        call = _reflection(channel, ALICE, hold)
        with pytest.raises(grpc.RpcError) as info:
            list(call)
        assert "--stream-idle-timeout" in info.value.details()
    finally:
        hold.set()


def test_health_check_needs_no_token_but_watch_does(auth_server) -> None:
    _, channel = auth_server
    health = health_pb2_grpc.HealthStub(channel)
    reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=CALL_TIMEOUT_S)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=CALL_TIMEOUT_S)
    assert _code(watch) is grpc.StatusCode.UNAUTHENTICATED
