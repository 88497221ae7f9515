"""Views never reach outside their Storage: negative strides (torch refuses them), the
exact bounds math every issued handle passes, and geometry too large for int64 bytes."""

from __future__ import annotations

import itertools

import grpc
import numpy as np
import pytest
import torch
from conftest import SessionStub, open_channel
from rpc_errors import rpc_error, torch_error
from tensord import dtypes, errors
from tensord import schema as pb
from tensord.layout import Layout, empty_strided_layout
from tensord_server.domain.storage import TensorRef

TOKENS = {"tok-alice": "alice", "tok-bob": "bob"}
BOBS_VALUE = 3.14159


def test_element_offset_range_with_negative_strides() -> None:
    assert Layout((2, 3), (3, 1), 4).element_offset_range() == (4, 9)
    assert Layout((2, 2), (-128, 128), 0).element_offset_range() == (-128, 128)
    assert Layout((3,), (-2,), 10).element_offset_range() == (6, 10)
    assert Layout((1, 5), (-99, 0), 2).element_offset_range() == (2, 2)  # size 1: no reach
    assert Layout((0, 4), (-5, 1), 0).element_offset_range() is None  # no elements
    # the extent a storage needs is the highest element + 1, whatever the lower ones do
    assert Layout((2, 2), (-128, 128), 0).storage_extent() == 129
    assert Layout((3,), (-2,), 10).storage_extent() == 11


@pytest.mark.parametrize("shape", [(2, 2), (2, 0), (0,), (1,), (3, 1, 2), (1, 1)])
def test_empty_strided_layout_matches_torch(shape: tuple[int, ...]) -> None:
    """Negative strides: refused with torch's text when the tensor has elements; otherwise
    replaced as TensorImpl::set_sizes_and_strides does."""
    for stride in itertools.product((-128, -1, 0, 1, 5), repeat=len(shape)):
        try:
            expected: object = torch.empty_strided(shape, stride).stride()
        except RuntimeError as e:
            with pytest.raises(RuntimeError) as info:
                empty_strided_layout(shape, stride)
            assert str(info.value) == str(e)
            continue
        assert empty_strided_layout(shape, stride).stride == expected, (shape, stride)


def test_every_handle_is_checked_with_its_lowest_element(make_server) -> None:
    daemon = make_server().daemon
    session, _ = daemon.sessions.open("bounds")
    storage = daemon.storages.allocate(daemon.devices.get("cpu"), 16)  # 4 float32
    try:
        inside = Layout((2,), (-1,), 1)  # elements 1 and 0: fine
        daemon.sessions.register(session, TensorRef(storage, inside, dtypes.float32))
        for below in (Layout((2, 2), (-128, 128), 0), Layout((2,), (-1,), 0)):
            with pytest.raises(errors.InternalError, match="out of bounds for storage of size 16"):
                daemon.sessions.register(session, TensorRef(storage, below, dtypes.float32))
        # a byte stride past int64 (a size-1 dim reaches nothing, but no int64 can carry it)
        huge = Layout((1, 2), (2**62, 1), 0)
        with pytest.raises(RuntimeError, match="Storage size calculation overflowed"):
            daemon.sessions.register(session, TensorRef(storage, huge, dtypes.float32))
        assert daemon.sessions.handle_count(session) == 1
    finally:
        daemon.storages.release_hold(storage)


def _float(value: float) -> np.ndarray:
    return np.array([value], dtype=np.float32)


def test_a_tenant_cannot_reach_another_tenants_bytes(make_server) -> None:
    """The issue's reproducer: alice's empty_strided with a negative stride got a 4-byte
    Storage that passed the bounds check and read and overwrote bob's neighbouring block."""
    server = make_server(auth_tokens=TOKENS)
    with open_channel(server.address) as bob_ch, open_channel(server.address) as alice_ch:
        bob = SessionStub(bob_ch, "bob", token="tok-bob")
        alice = SessionStub(alice_ch, "alice", token="tok-alice")
        secret = bob.upload(_float(BOBS_VALUE))
        for shape, stride in (([2, 2], [-128, 128]), ([2], [-1]), ([2, 3], [2**40, -(2**40)])):
            request = pb.EmptyRequest(
                shape=shape, stride=pb.IntList(values=stride), dtype="float32"
            )
            code, details, kind = rpc_error(lambda r=request: alice.Empty(r, metadata=alice.md))
            torch_kind, torch_text = torch_error(
                lambda sh=shape, st=stride: torch.empty_strided(sh, st)
            )
            assert (code, details, kind) == (
                grpc.StatusCode.INVALID_ARGUMENT,
                torch_text,
                torch_kind,
            )
        # as_strided refuses a negative stride on any handle, as torch does
        mine = alice.upload(np.zeros(4, dtype=np.float32))
        op = pb.AsStrided(size=[2, 2], stride=[-128, 128], storage_offset=0)
        code, details, _ = rpc_error(lambda: alice.view(mine, as_strided=op))
        assert code is grpc.StatusCode.INVALID_ARGUMENT
        assert details.startswith("as_strided: Negative strides are not supported")
        # without elements torch keeps no negative stride either
        request = pb.EmptyRequest(shape=[2, 0], stride=pb.IntList(values=[-1, 1]))
        assert list(alice.Empty(request, metadata=alice.md).stride) == [1, 1]
        assert bob.download(secret).tolist() == [pytest.approx(BOBS_VALUE)]
        alice.close()
        bob.close()


def test_strides_too_large_for_int64_bytes_are_refused(stub) -> None:
    """unsqueeze + diagonal doubles a size-1 dim's stride each round; past int64 bytes the
    handle cannot be described (TensorMeta is int64) nor used: refused, not INTERNAL."""
    x = stub.view(
        stub.upload(np.zeros(4, dtype=np.float32)),
        as_strided=pb.AsStrided(size=[1], stride=[2**48], storage_offset=0),
    )[0]
    for _ in range(20):
        try:
            y = stub.view(x, unsqueeze=pb.Unsqueeze(dim=0))[0]
            x = stub.view(y, diagonal=pb.Diagonal(offset=0, dim1=0, dim2=1))[0]
        except grpc.RpcError as e:
            assert e.code() is grpc.StatusCode.INVALID_ARGUMENT, e.details()
            assert "Storage size calculation overflowed" in (e.details() or "")
            break
    else:
        pytest.fail("a stride of 2**68 elements was issued")
    assert max(x.stride) * 4 < 2**63


@pytest.mark.parametrize(
    "items",
    [
        [pb.IndexItem(slice=pb.Slice(step=2**48))],
        [pb.IndexItem(integer=0), pb.IndexItem(slice=pb.Slice(start=-(2**48), step=2**48))],
    ],
)
@pytest.mark.parametrize("with_src", [False, True])
def test_a_setitem_target_past_int64_bytes_is_refused(stub, items, with_src) -> None:
    """A setitem's target is a layout the op derives and never issues: it passes the same
    check as a handle before any kernel sees it (the attack: a slice step of 2**48 on a
    size-1 dim of stride 2**48 made a 2**96 stride, INTERNAL OverflowError)."""
    x = stub.upload(np.zeros(64, dtype=np.uint8))
    big = stub.view(x, as_strided=pb.AsStrided(size=[1, 1, 64], stride=[2**48, 2**48, 1]))[0]
    request = pb.SetItemRequest(handle=big.handle, index=items)
    if with_src:
        request.src_handle = stub.upload(np.ones(64, dtype=np.uint8)).handle
    else:
        request.scalar.int_value = 9
    with pytest.raises(grpc.RpcError) as info:
        stub.SetItem(request, metadata=stub.md)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert "Storage size calculation overflowed" in (info.value.details() or "")
    assert stub.download(x).tolist() == [0] * 64
