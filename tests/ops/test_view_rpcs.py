"""Views through the raw stub: one RPC, a new handle on the same Storage, values as torch's."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from rpc_errors import rpc_error, torch_error
from tensord import schema as pb

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.torch


def _base(stub, shape=(2, 3, 4)):
    array = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    return array, stub.upload(array)


def _same_as_torch(stub, meta, expected) -> None:
    assert tuple(meta.shape) == tuple(expected.shape)
    assert tuple(meta.stride) == expected.stride()
    assert meta.storage_offset == expected.storage_offset()
    np.testing.assert_array_equal(stub.download(meta), expected.numpy())


# (ViewRequest field, message, the same op on a torch tensor)
VIEW_CASES = [
    ("view", pb.ViewShape(shape=[6, -1]), lambda t: t.view(6, -1)),
    ("narrow", pb.Narrow(dim=2, start=1, length=2), lambda t: t.narrow(2, 1, 2)),
    ("select", pb.Select(dim=1, index=-1), lambda t: t.select(1, -1)),
    ("transpose", pb.Transpose(dim0=0, dim1=2), lambda t: t.transpose(0, 2)),
    ("permute", pb.Permute(dims=[2, 0, 1]), lambda t: t.permute(2, 0, 1)),
    ("movedim", pb.Movedim(source=[0], destination=[2]), lambda t: t.movedim(0, 2)),
    ("unsqueeze", pb.Unsqueeze(dim=1), lambda t: t.unsqueeze(1)),
    ("flatten", pb.Flatten(start_dim=1, end_dim=-1), lambda t: t.flatten(1)),
    ("unflatten", pb.Unflatten(dim=2, sizes=[2, 2]), lambda t: t.unflatten(2, (2, 2))),
    ("diagonal", pb.Diagonal(offset=1, dim1=1, dim2=2), lambda t: t.diagonal(1, 1, 2)),
    (
        "as_strided",
        pb.AsStrided(size=[3, 3], stride=[2, 1], storage_offset=1),
        lambda t: t.as_strided((3, 3), (2, 1), 1),
    ),
    (
        "index",
        pb.Index(
            items=[
                pb.IndexItem(integer=1),
                pb.IndexItem(none=True),
                pb.IndexItem(slice=pb.Slice(start=0, step=2)),
                pb.IndexItem(ellipsis=True),
            ]
        ),
        lambda t: t[1, None, 0::2, ...],
    ),
]


@pytest.mark.parametrize(
    ("field", "message", "torch_op"), VIEW_CASES, ids=[c[0] for c in VIEW_CASES]
)
def test_view_matches_torch_and_shares_storage(stub, field, message, torch_op) -> None:
    array, base = _base(stub)
    (meta,) = stub.view(base, **{field: message})
    _same_as_torch(stub, meta, torch_op(torch.from_numpy(array)))
    assert meta.storage_id == base.storage_id
    assert meta.handle != base.handle


def test_expand_and_squeeze_match_torch(stub) -> None:
    array = np.arange(3, dtype=np.int64).reshape(3, 1)
    base = stub.upload(array)
    (expanded,) = stub.view(base, expand=pb.Expand(shape=[2, 3, 4]))
    _same_as_torch(stub, expanded, torch.from_numpy(array).expand(2, 3, 4))
    (squeezed,) = stub.view(base, squeeze=pb.Squeeze())
    _same_as_torch(stub, squeezed, torch.from_numpy(array).squeeze())


@pytest.mark.parametrize(
    ("field", "message", "torch_op"),
    [
        ("split", pb.Split(split_size=2, dim=2), lambda t: t.split(2, 2)),
        (
            "split",
            pb.Split(sections=pb.IntList(values=[1, 2]), dim=1),
            lambda t: t.split([1, 2], 1),
        ),
        ("chunk", pb.Chunk(chunks=3, dim=1), lambda t: t.chunk(3, 1)),
        ("unbind", pb.Unbind(dim=0), lambda t: t.unbind(0)),
    ],
)
def test_multi_output_views(stub, field, message, torch_op) -> None:
    array, base = _base(stub)
    metas = stub.view(base, **{field: message})
    expected = torch_op(torch.from_numpy(array))
    assert len(metas) == len(expected)
    for meta, want in zip(metas, expected, strict=True):
        _same_as_torch(stub, meta, want)
    assert len({m.handle for m in metas}) == len(metas)


def test_view_dtype_and_t(stub) -> None:
    array = np.arange(8, dtype=np.float32).reshape(2, 4)
    base = stub.upload(array)
    (as_int,) = stub.view(base, view_dtype=pb.ViewDtype(dtype="int32"))
    assert as_int.dtype == "int32"
    np.testing.assert_array_equal(stub.download(as_int), array.view(np.int32))
    (halves,) = stub.view(base, view_dtype=pb.ViewDtype(dtype="bfloat16"))
    assert tuple(halves.shape) == (2, 8)
    expected = torch.from_numpy(array).view(torch.bfloat16)
    got = stub.download(halves)
    np.testing.assert_array_equal(got.view(np.int16), expected.view(torch.int16).numpy())
    (transposed,) = stub.view(base, t=pb.T())
    _same_as_torch(stub, transposed, torch.from_numpy(array).t())


def test_detach_and_requires_grad(stub) -> None:
    _, base = _base(stub)
    (grad,) = stub.view(base, set_requires_grad=pb.SetRequiresGrad(requires_grad=True))
    assert grad.requires_grad
    (narrowed,) = stub.view(grad, narrow=pb.Narrow(dim=0, start=0, length=1))
    assert narrowed.requires_grad  # views keep requires_grad, as torch's do
    (detached,) = stub.view(grad, detach=pb.Detach())
    assert not detached.requires_grad
    assert detached.storage_id == base.storage_id


def test_int_tensor_cannot_require_grad(stub) -> None:
    meta = stub.upload(np.arange(3, dtype=np.int64))
    with pytest.raises(grpc.RpcError) as info:
        stub.view(meta, set_requires_grad=pb.SetRequiresGrad(requires_grad=True))
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    # torch's x.requires_grad_() text (its factories' differs: "Only ... and complex dtype")
    assert info.value.details() == "only Tensors of floating point dtype can require gradients"


@pytest.mark.parametrize(
    ("field", "message", "torch_op"),
    [
        ("view", pb.ViewShape(shape=[4, 6]), lambda t: t.transpose(0, 2).view(4, 6)),
        ("narrow", pb.Narrow(dim=5, start=0, length=1), lambda t: t.narrow(5, 0, 1)),
        ("select", pb.Select(dim=0, index=7), lambda t: t.select(0, 7)),
        ("permute", pb.Permute(dims=[0, 0, 1]), lambda t: t.permute(0, 0, 1)),
        ("expand", pb.Expand(shape=[5, 3, 4]), lambda t: t.expand(5, 3, 4)),
        (
            "as_strided",
            pb.AsStrided(size=[5, 5], stride=[5, 1]),
            lambda t: t.as_strided((5, 5), (5, 1)),
        ),
    ],
)
def test_view_errors_carry_torch_type_and_text(stub, field, message, torch_op) -> None:
    array, base = _base(stub)
    if field == "view":  # the non-viewable case needs a transposed base
        (base,) = stub.view(base, transpose=pb.Transpose(dim0=0, dim1=2))
    code, details, error_type = rpc_error(lambda: stub.view(base, **{field: message}))
    want_type, want_text = torch_error(lambda: torch_op(torch.from_numpy(array)))
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert (error_type, details) == (want_type, want_text)
