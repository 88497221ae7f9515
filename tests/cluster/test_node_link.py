"""The source side of a cross-node copy against a stand-in target (no etcd needed): what it
sends, and what it does when the target's stored bytes do not match."""

from __future__ import annotations

import threading
import zlib
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import numpy as np
import pytest
from tensord import errors
from tensord import schema as pb
from tensord.protocol import (
    CHECKSUM_KEY,
    NODE_TENANT_KEY,
    NODE_TOKEN_KEY,
    SESSION_KEY,
    UPLOAD_HEADER_KEY,
)
from tensord_server.rpc.nodes import CopyWindow, NodeLink

SECRET = "link-secret-0123456789"


class Target:
    """Upload and Release of a node that answers ``crc`` (None: the real one) as the
    stored bytes' checksum, recording what it got."""

    def __init__(self, crc: int | None) -> None:
        self.crc = crc
        self.received = b""
        self.metadata: dict[str, Any] = {}
        self.released: list[str] = []

    def upload(self, chunks: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        self.metadata = dict(context.invocation_metadata())
        self.received = b"".join(chunks)
        crc = zlib.crc32(self.received) if self.crc is None else self.crc
        context.set_trailing_metadata(((CHECKSUM_KEY, str(crc)),))
        return pb.TensorMeta(handle="h1").SerializeToString()

    def release(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        self.released.extend(pb.ReleaseRequest.FromString(request).handles)
        return pb.ReleaseResponse(released=1).SerializeToString()


def serve(target: Target) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    handlers = {
        "Upload": grpc.stream_unary_rpc_method_handler(target.upload),
        "Release": grpc.unary_unary_rpc_method_handler(target.release),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("tensord.v1.Tensord", handlers),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


@pytest.mark.parametrize("matches", [True, False])
def test_a_copy_is_answered_only_when_the_stored_bytes_match(matches: bool) -> None:
    chunks = [b"abc", b"defg", b"\x00" * 1000]
    sent = b"".join(chunks)
    target = Target(None if matches else zlib.crc32(sent) ^ 1)
    server, address = serve(target)
    link = NodeLink(SECRET)
    try:
        header = pb.UploadHeader(shape=[len(sent)], dtype="uint8", device="cpu", nbytes=len(sent))
        if matches:
            meta = link.send("b", address, "alice", "session-1", header, iter(chunks))
            assert meta.handle == "h1" and target.released == []
        else:
            with pytest.raises(errors.CopyCorruptedError, match="does not match") as bad:
                link.send("b", address, "alice", "session-1", header, iter(chunks))
            assert bad.value.node == "b"
            assert target.released == ["h1"]  # nothing is kept on the target
        assert target.received == sent
        assert target.metadata[NODE_TOKEN_KEY] == SECRET
        assert target.metadata[NODE_TENANT_KEY] == "alice"
        assert target.metadata[SESSION_KEY] == "session-1"
        assert "authorization" not in target.metadata  # never a tenant's token
        assert pb.UploadHeader.FromString(target.metadata[UPLOAD_HEADER_KEY]).checksum
    finally:
        link.close()
        server.stop(None)


def test_a_target_that_does_not_answer_is_a_lost_node() -> None:
    link = NodeLink(SECRET)
    header = pb.UploadHeader(shape=[1], dtype="uint8", device="cpu", nbytes=1)
    try:
        with pytest.raises(errors.NodeLostError) as lost:
            link.send("b", "127.0.0.1:1", "alice", "s", header, iter([b"x"]))
        assert lost.value.node == "b" and lost.value.address == "127.0.0.1:1"
    finally:
        link.close()


def test_the_copy_window_holds_at_most_its_chunks_and_an_abort_frees_both_sides() -> None:
    window = CopyWindow(2)
    assert window.put(b"1") and window.put(b"2")
    third: list[bool] = []
    putter = threading.Thread(target=lambda: third.append(window.put(b"3")))
    putter.start()
    putter.join(timeout=0.2)
    assert putter.is_alive() and not third  # full: the reader waits
    chunks = iter(window)
    assert next(chunks) == b"1"
    putter.join(timeout=5)
    assert third == [True]  # one taken: room for one more
    window.close()
    assert list(chunks) == [b"2", b"3"]  # closed: what waited is still sent

    aborted = CopyWindow(1)
    assert aborted.put(b"1")
    blocked: list[bool] = []
    putter = threading.Thread(target=lambda: blocked.append(aborted.put(b"2")))
    putter.start()
    aborted.abort()
    putter.join(timeout=5)
    assert blocked == [False] and list(aborted) == []  # dropped, and the stream ends


def test_a_target_that_fails_mid_copy_stops_the_source_reading() -> None:
    class Failing(Target):
        def upload(self, chunks: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
            next(chunks)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "quota exceeded")
            raise AssertionError("unreachable")

    read = 0

    def source() -> Iterator[bytes]:
        nonlocal read
        for _ in range(10_000):
            read += 1
            yield b"\x00" * (64 << 10)

    server, address = serve(Failing(None))
    link = NodeLink(SECRET)
    nbytes = 10_000 << 16
    header = pb.UploadHeader(shape=[nbytes], dtype="uint8", device="cpu", nbytes=nbytes)
    try:
        with pytest.raises(errors.ResourceExhaustedError, match="quota exceeded"):
            link.send("b", address, "alice", "s", header, source())
        assert read < 1_000  # the window and gRPC's buffers, not the whole tensor
    finally:
        link.close()
        server.stop(None)


def test_the_copy_checksum_is_zlibs_crc32_in_any_chunking() -> None:
    from tensord_server.domain import checksum

    data = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    crc = 0
    for start in range(0, len(data), 1 << 20 | 12345):
        crc = checksum.crc32(memoryview(data)[start : start + (1 << 20 | 12345)], crc)
    assert crc == zlib.crc32(data)
