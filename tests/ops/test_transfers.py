"""Upload and Download: raw chunks, beyond gRPC's 4 MiB default, nothing left behind on failure."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest
from tensord import schema as pb


def _allocated(server) -> int:
    return int(server.daemon.memory_reports.memory_stats("cpu")["allocated_bytes.all.current"])


def test_round_trip_beyond_4_mib(stub) -> None:
    rng = np.random.default_rng(0)
    array = rng.standard_normal((3, 1000, 700)).astype(np.float32)  # ~8 MiB
    meta = stub.upload(array)
    assert meta.storage_nbytes == array.nbytes > 4 << 20
    chunks = stub.download_bytes(meta.handle)
    assert len(chunks) == -(-array.nbytes // (1 << 20))  # the 1 MiB default
    assert max(len(c) for c in chunks) == 1 << 20
    np.testing.assert_array_equal(stub.download(meta), array)


def test_download_of_a_non_contiguous_view_is_in_logical_order(stub) -> None:
    array = np.arange(2 * 1024 * 1024, dtype=np.int64).reshape(1024, 2048)  # 16 MiB
    meta = stub.upload(array, chunk=3 << 20)
    (t,) = stub.view(meta, t=pb.T())
    (part,) = stub.view(t, narrow=pb.Narrow(dim=0, start=7, length=1000))
    np.testing.assert_array_equal(stub.download(part), array.T[7:1007])
    chunks = stub.download_bytes(part.handle, chunk_bytes=64 << 10)
    assert {len(c) for c in chunks[:-1]} == {64 << 10}
    np.testing.assert_array_equal(
        np.frombuffer(b"".join(chunks), dtype=np.int64).reshape(1000, 1024), array.T[7:1007]
    )


def test_bfloat16_and_zero_size(stub) -> None:
    import ml_dtypes

    array = np.linspace(-2, 2, 9).astype(ml_dtypes.bfloat16).reshape(3, 3)
    meta = stub.upload(array)
    assert meta.dtype == "bfloat16"
    np.testing.assert_array_equal(stub.download(meta), array)
    empty = stub.upload(np.zeros((0, 5), dtype=np.float32))
    assert tuple(empty.shape) == (0, 5) and stub.download_bytes(empty.handle) == []


def _upload_raw(stub, header: pb.UploadHeader, chunks):
    upload = stub.channel.stream_unary("/tensord.v1.Tensord/Upload")
    metadata = (*stub.md, ("tensord-upload-bin", header.SerializeToString()))
    return upload(chunks, metadata=metadata)


@pytest.mark.parametrize(
    ("nbytes", "sent", "message"),
    [
        (4000, 3000, "upload ended after 3000 of 4000 bytes"),
        (4000, 5000, "upload carried more than the declared 4000 bytes"),
        (
            3000,
            3000,
            "upload header declares 3000 bytes, but shape [1000] of float32 holds 4000",
        ),
    ],
)
def test_bad_upload_is_refused_and_frees_everything(server, stub, nbytes, sent, message) -> None:
    before = _allocated(server)
    header = pb.UploadHeader(shape=[1000], dtype="float32", nbytes=nbytes)
    chunks = (bytes(1000) for _ in range(sent // 1000))
    with pytest.raises(grpc.RpcError) as info:
        _upload_raw(stub, header, chunks)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == message
    assert _allocated(server) == before


def test_upload_without_header_is_invalid(stub) -> None:
    upload = stub.channel.stream_unary("/tensord.v1.Tensord/Upload")
    with pytest.raises(grpc.RpcError) as info:
        upload(iter([b"1234"]), metadata=stub.md)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT


def test_broken_upload_leaves_allocated_bytes_unchanged(server, stub) -> None:
    """The client dies mid-stream: the server frees the half-written Storage."""
    before = _allocated(server)
    header = pb.UploadHeader(shape=[8 << 20], dtype="uint8", nbytes=8 << 20)
    sent_some = threading.Event()
    release = threading.Event()

    def chunks():
        yield bytes(1 << 20)
        yield bytes(1 << 20)
        sent_some.set()
        release.wait(10)  # hold the stream open until the test cancels it

    upload = stub.channel.stream_unary("/tensord.v1.Tensord/Upload")
    metadata = (*stub.md, ("tensord-upload-bin", header.SerializeToString()))
    future = upload.future(chunks(), metadata=metadata)
    assert sent_some.wait(10)
    for _ in range(200):  # the server has allocated the 8 MiB Storage by now, or soon
        if _allocated(server) > before:
            break
        threading.Event().wait(0.01)
    assert _allocated(server) >= before + (8 << 20)
    future.cancel()
    release.set()
    with pytest.raises(grpc.FutureCancelledError):
        future.result(timeout=10)
    for _ in range(500):  # the handler notices the cancellation and unwinds
        if _allocated(server) == before:
            break
        threading.Event().wait(0.01)
    assert _allocated(server) == before
    assert all(s.refs > 0 for s in server.daemon.storages.live())
