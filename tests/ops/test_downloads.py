"""Downloads stream any view with bounded server memory: the gather plan (pure, property
tested against NumPy) and the wire (a huge expanded view streams, never gathered whole)."""

from __future__ import annotations

import itertools
import math
import tracemalloc

import numpy as np
import pytest
from conftest import SessionStub, open_channel
from hypothesis import given, settings
from hypothesis import strategies as st
from tensord import schema as pb
from tensord_server.domain import kernels
from tensord_server.domain.ops.transfers import MIN_CHUNK_BYTES

ITEMSIZES = (1, 2, 4, 8, 16)


@st.composite
def strided_arrays(draw: st.DrawFn) -> np.ndarray:
    """A view of random shape (zero and one sizes included) and random strides (zero,
    negative and overlapping included) over a small random buffer."""
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=4)))
    itemsize = draw(st.sampled_from(ITEMSIZES))
    dtype = np.dtype(f"V{itemsize}")
    strides = tuple(draw(st.integers(-6, 6)) * itemsize for _ in shape)
    # place the view so every element it reaches is inside the buffer
    low = sum(s * (n - 1) for s, n in zip(strides, shape, strict=True) if s < 0 and n > 0)
    high = sum(s * (n - 1) for s, n in zip(strides, shape, strict=True) if s > 0 and n > 0)
    size = (high - low) // itemsize + 1
    buffer = np.frombuffer(
        draw(st.binary(min_size=size * itemsize, max_size=size * itemsize)), dtype
    )
    base = buffer[-low // itemsize :]
    return np.lib.stride_tricks.as_strided(base, shape=shape, strides=strides)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(array=strided_arrays(), chunk=st.integers(1, 200))
def test_gather_plan_pieces_are_the_logical_bytes_in_chunks(array: np.ndarray, chunk: int) -> None:
    itemsize = array.dtype.itemsize
    chunk = max(chunk, itemsize)  # a piece is at least one element
    pieces = [array[key] for key in kernels.gather_plan(array.shape, itemsize, chunk)]
    assert b"".join(np.ascontiguousarray(p).tobytes() for p in pieces) == (
        np.ascontiguousarray(array).tobytes()
    )
    assert all(p.nbytes <= chunk for p in pieces)
    nbytes = array.size * itemsize
    assert len(pieces) <= 3 * nbytes // chunk + 1  # O(nbytes / chunk + 1) whatever the strides
    messages = list(kernels.logical_chunks(array, itemsize, chunk))
    assert b"".join(messages) == np.ascontiguousarray(array).tobytes()
    assert all(len(m) == chunk for m in messages[:-1]) and all(
        0 < len(m) <= chunk for m in messages
    )


@pytest.mark.slow
def test_gather_plan_of_a_huge_expanded_view_is_lazy_and_chunk_sized() -> None:
    # 2**44 elements of one float: the plan is a generator of 1 MiB row ranges
    plan = kernels.gather_plan((2**24, 2**20), 4, 1 << 20)
    first = list(itertools.islice(plan, 3))
    assert first == [(0, slice(0, 2**18)), (0, slice(2**18, 2**19)), (0, slice(2**19, 3 * 2**18))]
    assert list(kernels.gather_plan((3, 0, 2), 4, 4096)) == []
    assert list(kernels.gather_plan((), 8, 4096)) == [()]


def _expanded(stub, n: int) -> pb.TensorMeta:
    base = stub.upload(np.array([1.5], np.float32))
    (expanded,) = stub.view(base, expand=pb.Expand(shape=[n]))
    return expanded


def test_download_of_a_huge_expanded_view_streams_with_bounded_memory(stub) -> None:
    expanded = _expanded(stub, 2**30)  # 4 GiB of logical bytes over one 4-byte Storage
    download = stub.channel.unary_stream(
        "/tensord.v1.Tensord/Download", request_serializer=pb.DownloadRequest.SerializeToString
    )
    tracemalloc.start()
    try:
        stream = download(
            pb.DownloadRequest(handle=expanded.handle, chunk_bytes=MIN_CHUNK_BYTES),
            metadata=stub.md,
            timeout=30,
        )
        first = list(itertools.islice(stream, 4))
        stream.cancel()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [len(c) for c in first] == [MIN_CHUNK_BYTES] * 4
    assert np.all(np.frombuffer(b"".join(first), np.float32) == 1.5)
    # the old download gathered all 4 GiB before its first message (a MemoryError here)
    assert peak < 64 << 20, peak


def test_download_of_an_expanded_view_too_large_for_memory_is_not_internal(make_server) -> None:
    # without --max-op-elements (the default refuses 2**44 elements before any work), such a
    # download streams: the gather's memory is bounded whatever the logical size
    running = make_server(max_op_elements=None)
    with open_channel(running.address) as channel:
        stub = SessionStub(channel)
        expanded = _expanded(stub, 2**44)  # 64 TiB of logical bytes: was INTERNAL MemoryError
        download = stub.channel.unary_stream(
            "/tensord.v1.Tensord/Download",
            request_serializer=pb.DownloadRequest.SerializeToString,
        )
        stream = download(pb.DownloadRequest(handle=expanded.handle), metadata=stub.md, timeout=30)
        first = next(iter(stream))
        stream.cancel()
        assert len(first) == 1 << 20 and set(np.frombuffer(first, np.float32)) == {1.5}
        stub.close()


@pytest.mark.parametrize("shape", [(3, 1000, 7), (5000, 3), (2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2)])
def test_strided_downloads_match_numpy(stub, shape: tuple[int, ...]) -> None:
    values = np.arange(math.prod(shape), dtype=np.float64).reshape(shape)
    meta = stub.upload(values)
    (transposed,) = (
        stub.view(meta, t=pb.T())
        if len(shape) == 2
        else stub.view(meta, transpose=pb.Transpose(dim0=0, dim1=len(shape) - 1))
    )
    got = b"".join(stub.download_bytes(transposed.handle, chunk_bytes=MIN_CHUNK_BYTES))
    expected = values.T if len(shape) == 2 else np.swapaxes(values, 0, len(shape) - 1)
    assert got == np.ascontiguousarray(expected).tobytes()
