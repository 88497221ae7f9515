"""Copies that run on the server, compared with torch on the same data."""

from __future__ import annotations

import warnings

import grpc
import numpy as np
import pytest
from rpc_errors import rpc_error, torch_error
from tensord import schema as pb

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.torch


def _t(array: np.ndarray):
    return torch.from_numpy(np.ascontiguousarray(array))


def _values(stub, meta):
    """A tensor's values as a torch tensor (bfloat16 through its bits)."""
    array = stub.download(meta)
    if meta.dtype == "bfloat16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def _check(stub, meta, expected) -> None:
    assert tuple(meta.shape) == tuple(expected.shape)
    assert meta.dtype == str(expected.dtype).removeprefix("torch.")
    got = _values(stub, meta)
    assert torch.equal(got, expected), (got, expected)


def _transposed(stub, shape=(3, 4), dtype=np.float32):
    array = np.arange(int(np.prod(shape))).astype(dtype).reshape(shape)
    base = stub.upload(array)
    (t,) = stub.view(base, t=pb.T())
    return array, base, t


def test_clone_preserves_dense_strides_and_makes_new_storage(stub) -> None:
    array, base, t = _transposed(stub)
    clone = stub.Clone(pb.CloneRequest(handle=t.handle), metadata=stub.md)
    assert tuple(clone.stride) == _t(array).t().clone().stride() == (1, 4)
    assert clone.storage_id != base.storage_id
    _check(stub, clone, _t(array).t())
    contiguous = stub.Clone(
        pb.CloneRequest(handle=t.handle, memory_format="contiguous_format"), metadata=stub.md
    )
    assert tuple(contiguous.stride) == (3, 1)
    _check(stub, contiguous, _t(array).t())


def test_clone_of_expanded_is_dense(stub) -> None:
    base = stub.upload(np.arange(3, dtype=np.float32))
    (expanded,) = stub.view(base, expand=pb.Expand(shape=[2, 3]))
    clone = stub.Clone(pb.CloneRequest(handle=expanded.handle), metadata=stub.md)
    assert tuple(clone.stride) == torch.arange(3.0).expand(2, 3).clone().stride()
    assert clone.storage_nbytes == 6 * 4


def test_contiguous(stub) -> None:
    array, base, t = _transposed(stub)
    same = stub.Contiguous(pb.HandleRequest(handle=base.handle), metadata=stub.md)
    assert same.handle != base.handle and same.storage_id == base.storage_id
    copied = stub.Contiguous(pb.HandleRequest(handle=t.handle), metadata=stub.md)
    assert copied.storage_id != base.storage_id
    assert tuple(copied.stride) == (3, 1)
    _check(stub, copied, _t(array).t().contiguous())


def test_reshape_views_when_it_can_and_copies_otherwise(stub) -> None:
    array, base, t = _transposed(stub)
    viewed = stub.Reshape(pb.ReshapeRequest(handle=base.handle, shape=[2, -1]), metadata=stub.md)
    assert viewed.storage_id == base.storage_id
    _check(stub, viewed, _t(array).reshape(2, -1))
    copied = stub.Reshape(pb.ReshapeRequest(handle=t.handle, shape=[-1]), metadata=stub.md)
    assert copied.storage_id != base.storage_id
    _check(stub, copied, _t(array).t().reshape(-1))
    (flat,) = stub.view(t, flatten=pb.Flatten(start_dim=0, end_dim=-1))  # flatten copies too
    _check(stub, flat, _t(array).t().flatten())


@pytest.mark.parametrize(
    ("src_dtype", "dst_dtype"),
    [
        ("float32", "int32"),
        ("float32", "bfloat16"),
        ("bfloat16", "float64"),
        ("float64", "uint8"),
        ("float32", "bool"),
        ("complex64", "float32"),
        ("int64", "complex128"),
    ],
)
def test_to_dtype_converts_like_torch(stub, src_dtype, dst_dtype) -> None:
    values = torch.tensor([[1.7, -1.7, 0.0], [2.5, 3.0, 250.0]]).to(getattr(torch, src_dtype))
    meta = stub.upload(values.numpy() if src_dtype != "bfloat16" else values.float().numpy())
    if src_dtype == "bfloat16":
        meta = stub.To(pb.ToRequest(handle=meta.handle, dtype="bfloat16"), metadata=stub.md)
    out = stub.To(pb.ToRequest(handle=meta.handle, dtype=dst_dtype), metadata=stub.md)
    with warnings.catch_warnings():
        # torch warns only once per process (TORCH_WARN_ONCE), so whether this call warns
        # depends on which test ran first: the oracle's warning is not what is tested here
        warnings.filterwarnings("ignore", "Casting complex values to real discards")
        expected = values.to(getattr(torch, dst_dtype))
    _check(stub, out, expected)


def test_to_int_drops_requires_grad_as_torch_does(stub) -> None:
    meta = stub.upload(np.ones(4, dtype=np.float32))
    (grad,) = stub.view(meta, set_requires_grad=pb.SetRequiresGrad(requires_grad=True))
    as_int = stub.To(pb.ToRequest(handle=grad.handle, dtype="int32"), metadata=stub.md)
    as_double = stub.To(pb.ToRequest(handle=grad.handle, dtype="float64"), metadata=stub.md)
    x = torch.ones(4, requires_grad=True)
    assert (as_int.requires_grad, as_double.requires_grad) == (
        x.to(torch.int32).requires_grad,
        x.to(torch.float64).requires_grad,
    )


def test_to_same_returns_self_unless_copy(stub) -> None:
    meta = stub.upload(np.ones(4, dtype=np.float32))
    same = stub.To(
        pb.ToRequest(handle=meta.handle, dtype="float32", device="cpu"), metadata=stub.md
    )
    assert same.handle == meta.handle
    copied = stub.To(pb.ToRequest(handle=meta.handle, copy=True), metadata=stub.md)
    assert copied.handle != meta.handle and copied.storage_id != meta.storage_id


def test_copy_broadcasts_and_converts(stub) -> None:
    dst = stub.Empty(pb.EmptyRequest(shape=[2, 3], dtype="int16"), metadata=stub.md)
    src = stub.upload(np.array([1.9, -2.9, 7.0], dtype=np.float64))
    out = stub.Copy(pb.CopyRequest(dst=dst.handle, src=src.handle), metadata=stub.md)
    assert out.handle == dst.handle
    expected = torch.empty(2, 3, dtype=torch.int16).copy_(torch.tensor([1.9, -2.9, 7.0]))
    _check(stub, dst, expected)


@pytest.mark.parametrize(("dst_shape", "src_shape"), [((4,), (1, 4)), ((4,), (3,)), ((3, 1), (2,))])
def test_copy_shape_errors_match_torch(stub, dst_shape, src_shape) -> None:
    dst = stub.Empty(pb.EmptyRequest(shape=dst_shape), metadata=stub.md)
    src = stub.Empty(pb.EmptyRequest(shape=src_shape), metadata=stub.md)
    code, details, kind = rpc_error(
        lambda: stub.Copy(pb.CopyRequest(dst=dst.handle, src=src.handle), metadata=stub.md)
    )
    want = torch_error(lambda: torch.zeros(dst_shape).copy_(torch.zeros(src_shape)))
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert (kind, details) == want


def test_copy_overlap_rules_match_torch(stub) -> None:
    base = stub.upload(np.arange(10, dtype=np.float32))
    (head,) = stub.view(base, narrow=pb.Narrow(dim=0, start=0, length=9))
    (tail,) = stub.view(base, narrow=pb.Narrow(dim=0, start=1, length=9))
    a = torch.arange(10.0)
    want = torch_error(lambda: a[1:].copy_(a[:-1]))
    code, details, kind = rpc_error(
        lambda: stub.Copy(pb.CopyRequest(dst=tail.handle, src=head.handle), metadata=stub.md)
    )
    assert (code, kind, details) == (grpc.StatusCode.INVALID_ARGUMENT, *want)

    small = stub.upload(np.zeros(3, dtype=np.float32))
    (expanded,) = stub.view(small, expand=pb.Expand(shape=[2, 3]))
    ones = stub.upload(np.ones((2, 3), dtype=np.float32))
    want = torch_error(lambda: torch.zeros(3).expand(2, 3).copy_(torch.ones(2, 3)))
    code, details, kind = rpc_error(
        lambda: stub.Copy(pb.CopyRequest(dst=expanded.handle, src=ones.handle), metadata=stub.md)
    )
    assert (code, kind, details) == (grpc.StatusCode.INVALID_ARGUMENT, *want)

    # the same memory is fine, and disjoint halves of one storage are too
    stub.Copy(pb.CopyRequest(dst=base.handle, src=base.handle), metadata=stub.md)
    (first,) = stub.view(base, narrow=pb.Narrow(dim=0, start=0, length=5))
    (second,) = stub.view(base, narrow=pb.Narrow(dim=0, start=5, length=5))
    stub.Copy(pb.CopyRequest(dst=first.handle, src=second.handle), metadata=stub.md)
    expected = torch.arange(10.0)
    expected[:5] = expected[5:].clone()
    _check(stub, base, expected)


def test_repeat_matches_torch(stub) -> None:
    array = np.arange(6, dtype=np.int32).reshape(2, 3)
    meta = stub.upload(array)
    (t,) = stub.view(meta, t=pb.T())
    for repeats in ([2, 1], [1, 2, 3], [0, 2]):
        out = stub.Repeat(pb.RepeatRequest(handle=t.handle, repeats=repeats), metadata=stub.md)
        _check(stub, out, _t(array).t().repeat(*repeats))
    _code, details, kind = rpc_error(
        lambda: stub.Repeat(pb.RepeatRequest(handle=t.handle, repeats=[2]), metadata=stub.md)
    )
    assert (kind, details) == torch_error(lambda: _t(array).repeat(2))


def test_cat_and_stack_promote_like_torch(stub) -> None:
    a = np.arange(6, dtype=np.int32).reshape(2, 3)
    b = np.linspace(0, 1, 6, dtype=np.float64).reshape(2, 3)
    ma, mb = stub.upload(a), stub.upload(b)
    empty = stub.upload(np.zeros(0, dtype=np.float32))
    for dim in (0, 1, -1):
        out = stub.Cat(
            pb.CatRequest(handles=[ma.handle, mb.handle, empty.handle], dim=dim), metadata=stub.md
        )
        _check(stub, out, torch.cat([_t(a), _t(b), torch.zeros(0)], dim))
    for dim in (0, 2, -1):
        out = stub.Stack(pb.CatRequest(handles=[ma.handle, mb.handle], dim=dim), metadata=stub.md)
        _check(stub, out, torch.stack([_t(a), _t(b)], dim))
    bf = stub.To(pb.ToRequest(handle=mb.handle, dtype="bfloat16"), metadata=stub.md)
    out = stub.Cat(pb.CatRequest(handles=[ma.handle, bf.handle]), metadata=stub.md)
    _check(stub, out, torch.cat([_t(a), _t(b).to(torch.bfloat16)]))


@pytest.mark.parametrize(
    ("method", "shapes", "dim"),
    [
        ("Cat", [], 0),
        ("Cat", [(2, 3), (3,)], 0),
        ("Cat", [(2, 3), (2, 4)], 0),
        ("Cat", [(), ()], 0),
        ("Cat", [(2, 3), (2, 3)], 2),
        ("Stack", [], 0),
        ("Stack", [(2, 3), (3,)], 0),
        ("Stack", [(2, 3), (2, 3)], 3),
    ],
)
def test_cat_stack_errors_match_torch(stub, method, shapes, dim) -> None:
    handles = [stub.Empty(pb.EmptyRequest(shape=s), metadata=stub.md).handle for s in shapes]
    code, details, kind = rpc_error(
        lambda: getattr(stub, method)(pb.CatRequest(handles=handles, dim=dim), metadata=stub.md)
    )
    op = torch.cat if method == "Cat" else torch.stack
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert (kind, details) == torch_error(lambda: op([torch.zeros(s) for s in shapes], dim))


def test_fill_zero_and_setitem(stub) -> None:
    base = stub.upload(np.zeros((3, 4), dtype=np.int32))
    expected = torch.zeros(3, 4, dtype=torch.int32)
    (col,) = stub.view(base, select=pb.Select(dim=1, index=2))
    stub.Fill(pb.FillRequest(handle=col.handle, value=pb.Scalar(float_value=2.7)), metadata=stub.md)
    expected[:, 2].fill_(2.7)
    _check(stub, base, expected)
    index = [pb.IndexItem(slice=pb.Slice(start=1)), pb.IndexItem(slice=pb.Slice(step=2))]
    stub.SetItem(
        pb.SetItemRequest(handle=base.handle, index=index, scalar=pb.Scalar(int_value=-5)),
        metadata=stub.md,
    )
    expected[1:, ::2] = -5
    _check(stub, base, expected)
    row = stub.upload(np.array([[9.5, 8.5, 7.5, 6.5]], dtype=np.float32))  # leading 1 dropped
    stub.SetItem(
        pb.SetItemRequest(
            handle=base.handle, index=[pb.IndexItem(integer=0)], src_handle=row.handle
        ),
        metadata=stub.md,
    )
    expected[0] = torch.tensor([[9.5, 8.5, 7.5, 6.5]])
    _check(stub, base, expected)
    bad = stub.upload(np.ones(3, dtype=np.float32))
    _code, details, kind = rpc_error(
        lambda: stub.SetItem(
            pb.SetItemRequest(
                handle=base.handle, index=[pb.IndexItem(integer=0)], src_handle=bad.handle
            ),
            metadata=stub.md,
        )
    )

    def torch_setitem():
        expected[0] = torch.ones(3)

    assert (kind, details) == torch_error(torch_setitem)
    stub.Fill(pb.FillRequest(handle=base.handle, value=pb.Scalar(int_value=0)), metadata=stub.md)
    _check(stub, base, torch.zeros(3, 4, dtype=torch.int32))


@pytest.mark.parametrize(
    ("dtype", "value", "python"),
    [
        ("uint8", pb.Scalar(int_value=-1), -1),
        ("uint8", pb.Scalar(float_value=255.0), 255.0),
        ("bool", pb.Scalar(float_value=0.5), 0.5),
        ("int8", pb.Scalar(float_value=-2.9), -2.9),
        ("complex64", pb.Scalar(complex_value=pb.Complex(real=1, imag=2)), 1 + 2j),
    ],
)
def test_fill_converts_like_torch(stub, dtype, value, python) -> None:
    meta = stub.Empty(pb.EmptyRequest(shape=[3], dtype=dtype), metadata=stub.md)
    stub.Fill(pb.FillRequest(handle=meta.handle, value=value), metadata=stub.md)
    _check(stub, meta, torch.zeros(3, dtype=getattr(torch, dtype)).fill_(python))


@pytest.mark.parametrize(
    ("dtype", "value"),
    [
        ("uint8", pb.Scalar(int_value=300)),
        ("uint8", pb.Scalar(float_value=-0.5)),
        ("int8", pb.Scalar(float_value=127.9)),
        ("int8", pb.Scalar(int_value=-129)),
        ("float32", pb.Scalar(float_value=1e39)),
        ("int32", pb.Scalar(float_value=float("nan"))),
        ("float32", pb.Scalar(complex_value=pb.Complex(real=1, imag=2))),
        # once warned inside the check (NumPy float32 cast): an error under filterwarnings=error
        ("complex64", pb.Scalar(complex_value=pb.Complex(real=1e300, imag=0))),
    ],
)
def test_fill_overflow_matches_torch(stub, dtype, value) -> None:
    meta = stub.Empty(pb.EmptyRequest(shape=[2], dtype=dtype), metadata=stub.md)
    code, details, kind = rpc_error(
        lambda: stub.Fill(pb.FillRequest(handle=meta.handle, value=value), metadata=stub.md)
    )
    python_value = {
        "int_value": value.int_value,
        "float_value": value.float_value,
        "complex_value": complex(value.complex_value.real, value.complex_value.imag),
    }[value.WhichOneof("value")]
    want = torch_error(lambda: torch.zeros(2, dtype=getattr(torch, dtype)).fill_(python_value))
    assert (code, kind, details) == (grpc.StatusCode.INVALID_ARGUMENT, *want)


def test_factories_match_torch(stub) -> None:
    empty = stub.Empty(
        pb.EmptyRequest(shape=[2, 3], stride=pb.IntList(values=[1, 2])), metadata=stub.md
    )
    assert (tuple(empty.stride), empty.dtype, empty.storage_nbytes) == ((1, 2), "float32", 24)
    for value, dtype in [
        (pb.Scalar(bool_value=True), ""),
        (pb.Scalar(int_value=3), ""),
        (pb.Scalar(float_value=0.5), ""),
        (pb.Scalar(complex_value=pb.Complex(real=1, imag=-1)), ""),
        (pb.Scalar(float_value=2.5), "int64"),
    ]:
        meta = stub.Full(pb.FullRequest(shape=[2, 2], value=value, dtype=dtype), metadata=stub.md)
        python = {
            "bool_value": value.bool_value,
            "int_value": value.int_value,
            "float_value": value.float_value,
            "complex_value": complex(value.complex_value.real, value.complex_value.imag),
        }[value.WhichOneof("value")]
        kwargs = {"dtype": getattr(torch, dtype)} if dtype else {}
        _check(stub, meta, torch.full((2, 2), python, **kwargs))


def _scalar(v):
    if isinstance(v, bool):
        return pb.Scalar(bool_value=v)
    if isinstance(v, int):
        return pb.Scalar(int_value=v)
    return pb.Scalar(float_value=v)


@pytest.mark.parametrize(
    ("start", "end", "step", "dtype"),
    [
        (0, 10, 3, ""),
        (0, 1, 0.1, ""),
        (0, 1, 0.3, ""),
        (0.5, 5, 1, "int64"),
        (-3, 3, 1.5, "int32"),
        (10, 0, -2, "float16"),
        (0, 5, 1, "bfloat16"),
        (0, 0, 1, ""),
    ],
)
def test_arange_matches_torch(stub, start, end, step, dtype) -> None:
    request = pb.ArangeRequest(
        start=_scalar(start), end=_scalar(end), step=_scalar(step), dtype=dtype
    )
    meta = stub.Arange(request, metadata=stub.md)
    kwargs = {"dtype": getattr(torch, dtype)} if dtype else {}
    _check(stub, meta, torch.arange(start, end, step, **kwargs))


@pytest.mark.parametrize(("start", "end", "step"), [(0, 10, 0), (10, 0, 1), (0, float("inf"), 1)])
def test_arange_errors_match_torch(stub, start, end, step) -> None:
    request = pb.ArangeRequest(start=_scalar(start), end=_scalar(end), step=_scalar(step))
    _code, details, kind = rpc_error(lambda: stub.Arange(request, metadata=stub.md))
    assert (kind, details) == torch_error(lambda: torch.arange(start, end, step))
