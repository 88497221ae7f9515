"""Complex views and torch's lazy conjugate / negative bits, against torch 2.13.

``x.real``, ``x.imag``, ``view_as_real``, ``view_as_complex``, ``x.conj()`` (a view with
the conjugate bit), ``x.conj().imag`` (the negative bit), ``H``/``mH``/``adjoint``, and
every path that reads or writes values through a tensor with a lazy bit.  Each result is
compared with torch's on shape, stride, storage offset, dtype, the two bits,
requires_grad, values and view-or-copy; each error on type and text.
"""

from __future__ import annotations

import tracemalloc
import warnings
from collections.abc import Callable, Iterator
from typing import Any, cast

import numpy as np
import pytest
import tensord
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensord import dtypes
from tensord import schema as pb
from tensord_server.domain import kernels
from tensord_server.domain.ops import indexing

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

HYPOTHESIS = settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(params=[True, False], ids=["pipelined", "unary"])
def either(request: Any, server: Any) -> Iterator[tensord.Client]:
    """Both ways a view's metadata is made: predicted by the SDK (pipelining) or the server's."""
    with tensord.connect(server.address, pipelining=request.param) as connected:
        yield connected


def values(t: Any) -> np.ndarray:
    return t.detach().resolve_conj().resolve_neg().numpy()


def assert_same(x: tensord.Tensor, t: Any) -> None:
    assert tuple(x.shape) == tuple(t.shape)
    assert x.stride() == t.stride()
    assert x.storage_offset() == t.storage_offset()
    assert x.dtype == dtypes.from_torch(t.dtype)
    assert (x.is_conj(), x.is_neg()) == (t.is_conj(), t.is_neg())
    assert x.requires_grad == t.requires_grad
    np.testing.assert_array_equal(x.numpy(force=True), values(t))


def same_storage(a: tensord.Tensor, b: tensord.Tensor) -> bool:
    return a.untyped_storage().storage_id == b.untyped_storage().storage_id


def both(x: tensord.Tensor, t: Any, op: Callable[[Any], Any]) -> Any:
    """op on both: the same result (a view exactly when torch's is), or the same error."""
    try:
        theirs = op(t)
    except Exception as expected:
        with pytest.raises(type(expected)) as got:
            op(x)
        assert isinstance(got.value, (tensord.TensordError, BufferError))
        assert str(got.value) == str(expected).split("\nException raised from")[0]
        return None
    ours = op(x)
    if not isinstance(theirs, torch.Tensor):
        assert ours == theirs
        return ours
    assert_same(ours, theirs)
    if theirs.untyped_storage().nbytes() and t.untyped_storage().nbytes():  # else no address
        shares = theirs.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
        assert same_storage(ours, x) == shares
    assert (ours is x) == (theirs is t)
    return ours


def complex_base(n: int, dtype: Any = torch.complex64) -> Any:
    """n distinct complex values (exact in float32): real parts k, imaginary parts -2k-1."""
    k = torch.arange(n, dtype=torch.float64)
    return torch.complex(k, -2 * k - 1).to(dtype)


def strided_pair(
    client: tensord.Client, data: st.DataObject, dtype: Any = torch.complex64
) -> tuple[tensord.Tensor, Any]:
    """The same random strided complex tensor (size-0/1 dims, random strides) on both sides."""
    ndim = data.draw(st.integers(0, 3))
    shape = data.draw(st.lists(st.sampled_from((0, 1, 2, 3)), min_size=ndim, max_size=ndim))
    stride = data.draw(st.lists(st.integers(0, 5), min_size=ndim, max_size=ndim))
    offset = data.draw(st.integers(0, 3))
    extent = offset + sum((n - 1) * s for n, s in zip(shape, stride, strict=True) if n) + 1
    base_t = complex_base(extent, dtype)
    base_x = client.tensor(base_t)
    return base_x.as_strided(shape, stride, offset), base_t.as_strided(shape, stride, offset)


# ---- 1. views: real, imag, view_as_real, view_as_complex, conj, chains of them ----------

CHAIN_OPS: list[tuple[str, Callable[[Any], Any]]] = [
    ("real", lambda v: v.real),
    ("imag", lambda v: v.imag),
    ("conj", lambda v: v.conj()),
    (
        "view_as_real",
        lambda v: (tensord if isinstance(v, tensord.Tensor) else torch).view_as_real(v),
    ),
    (
        "view_as_complex",
        lambda v: (tensord if isinstance(v, tensord.Tensor) else torch).view_as_complex(v),
    ),
    ("transpose", lambda v: v.transpose(0, -1)),
    ("select", lambda v: v.select(-1, 0)),
    ("slice", lambda v: v[..., ::2]),
    ("unsqueeze", lambda v: v.unsqueeze(-1)),
    ("expand", lambda v: v.unsqueeze(0).expand(2, *v.shape)),
    ("mH", lambda v: v.mH),
    ("adjoint", lambda v: v.adjoint()),
    ("detach", lambda v: v.detach()),
    ("resolve_conj", lambda v: v.resolve_conj()),
    ("resolve_neg", lambda v: v.resolve_neg()),
    ("conj_physical", lambda v: v.conj_physical()),
    ("contiguous", lambda v: v.contiguous()),
    ("clone", lambda v: v.clone()),
]


@pytest.mark.slow
@HYPOTHESIS
@given(data=st.data())
def test_random_chains_of_complex_views_match_torch(
    either: tensord.Client, data: st.DataObject
) -> None:
    dtype = data.draw(st.sampled_from((torch.complex64, torch.complex128)))
    x, t = strided_pair(either, data, dtype)
    for _ in range(data.draw(st.integers(1, 5))):
        _name, op = data.draw(st.sampled_from(CHAIN_OPS))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # 0-dim mH/adjoint: torch's deprecation warning
            result = both(x, t, op)
        if result is None:
            return
        x, t = result, op(t)


def test_real_imag_of_a_conjugate_and_their_bits(either: tensord.Client) -> None:
    t = complex_base(6).view(2, 3)
    x = either.tensor(t)
    c, tc = both(x, t, lambda v: v.conj()), t.conj()
    assert c.is_conj() and same_storage(c, x)
    both(c, tc, lambda v: v.real)
    imag = both(c, tc, lambda v: v.imag)
    assert imag.is_neg() and imag.storage_offset() == 1
    both(imag, tc.imag, lambda v: v.conj())  # a real tensor's conj is itself
    both(imag, tc.imag, lambda v: v.resolve_neg())
    both(c, tc, lambda v: v.conj())  # the bit flips back: a plain view


def test_views_keep_requires_grad(either: tensord.Client) -> None:
    t = complex_base(4).view(2, 2).requires_grad_()
    x = either.tensor(complex_base(4).view(2, 2)).requires_grad_()
    for op in (
        lambda v: v.real,
        lambda v: v.imag,
        lambda v: v.conj(),
        lambda v: v.H,
        lambda v: (tensord if isinstance(v, tensord.Tensor) else torch).view_as_real(v),
    ):
        assert op(x).requires_grad is op(t).requires_grad is True


def test_real_tensors_and_refusals_match_torch(client: tensord.Client) -> None:
    t = torch.arange(12, dtype=torch.float32).view(3, 2, 2)
    x = client.tensor(t)
    for op in (
        lambda v: v.real,  # itself
        lambda v: v.conj(),  # itself
        lambda v: v.conj_physical(),  # itself
        lambda v: v.conj_physical_(),  # itself
        lambda v: v.resolve_conj(),
        lambda v: v.resolve_neg(),
        lambda v: v.imag,
        lambda v: v.is_conj(),
        lambda v: v.is_neg(),
        lambda v: v.int().real,
        lambda v: v.bool().imag,
    ):
        both(x, t, op)
    for op_name in ("view_as_real", "view_as_complex", "real", "imag", "conj", "is_conj"):
        with pytest.raises(TypeError) as expected:
            getattr(torch, op_name)(1)
        with pytest.raises(tensord.TensordTypeError) as got:
            getattr(tensord, op_name)(1)
        assert str(got.value) == str(expected.value)


def test_view_as_real_and_view_as_complex_checks_match_torch(either: tensord.Client) -> None:
    cases: list[tuple[Any, Callable[[Any], Any]]] = [
        (torch.zeros(3, 2), lambda v: v),
        (torch.zeros(3, 2, dtype=torch.float64), lambda v: v[1:]),
        (torch.zeros(3, 2), lambda v: v.t()),  # last dim not 2
        (torch.zeros(4, 2), lambda v: v.t().t()),
        (torch.zeros(3, 3), lambda v: v[:, :2]),  # stride 3: not even
        (torch.zeros(7), lambda v: v[1:].view(3, 2)),  # odd offset
        (torch.zeros(2, 4), lambda v: v.as_strided((2, 2), (4, 2))),  # last stride 2
        (torch.zeros(()), lambda v: v),
        (torch.zeros(4, dtype=torch.int32), lambda v: v.view(2, 2)),
        (torch.zeros(4, dtype=torch.bfloat16), lambda v: v.view(2, 2)),
        (torch.zeros(2, 1, 2), lambda v: v.expand(2, 3, 2)),  # stride 0 is even
    ]
    for base, view in cases:
        x = view(either.tensor(base))
        both(x, view(base), torch_or_tensord("view_as_complex"))
    for base, view in [
        (complex_base(6), lambda v: v.view(2, 3).t()),
        (complex_base(1).view(()), lambda v: v),
        (complex_base(6), lambda v: v.conj()),
        (torch.zeros(2), lambda v: v),
    ]:
        both(view(either.tensor(base)), view(base), torch_or_tensord("view_as_real"))


def torch_or_tensord(name: str) -> Callable[[Any], Any]:
    return lambda v: getattr(tensord if isinstance(v, tensord.Tensor) else torch, name)(v)


def test_view_as_complex_of_half_is_refused_without_complex32(client: tensord.Client) -> None:
    x = client.zeros(3, 2, dtype=tensord.float16)
    with pytest.raises(tensord.TensordTypeError, match="no complex32"):
        tensord.view_as_complex(x)
    with pytest.raises(tensord.TensordRuntimeError, match="last dimension of size 2"):
        tensord.view_as_complex(x.t())  # torch's checks come first


def test_view_dtype_of_a_tensor_with_a_bit_is_refused(either: tensord.Client) -> None:
    t = complex_base(4)
    x = either.tensor(t)
    for dtype in (torch.complex64, torch.float32, torch.int64):
        both(x.conj(), t.conj(), lambda v, d=dtype: v.view(d))
        both(x.conj().imag, t.conj().imag, lambda v, d=dtype: v.view(d))


def test_matrix_views_of_complex_tensors_are_conjugate_transposes(either: tensord.Client) -> None:
    t = complex_base(24).view(2, 3, 4)
    x = either.tensor(t)
    both(x, t, lambda v: v.mH)
    both(x, t, lambda v: v.adjoint())
    both(x, t, lambda v: v.mT)
    both(x, t, lambda v: v.H)  # not a matrix: torch's error
    both(x[0], t[0], lambda v: v.H)
    both(x[0].conj(), t[0].conj(), lambda v: v.H)  # conj twice: a plain transpose
    both(x, t, lambda v: tensord.adjoint(v) if isinstance(v, tensord.Tensor) else v.adjoint())
    with warnings.catch_warnings():  # torch's deprecation warning, once per process
        warnings.simplefilter("ignore")
        both(x[0, 0, 0], t[0, 0, 0], lambda v: v.H)  # 0-dim: the conjugate itself


# ---- 2. every read path sees the conjugated (negated) values ----------------------------

READS: list[tuple[str, Callable[[Any], Any]]] = [
    ("clone", lambda v: v.clone()),
    ("contiguous of a transpose", lambda v: v.t().contiguous()),
    ("contiguous", lambda v: v.contiguous()),
    ("to dtype", lambda v: v.to(torch.complex128 if v.dtype.is_complex else torch.float64)),
    ("to copy", lambda v: v.to(v.dtype, copy=True)),
    ("to same", lambda v: v.to(v.dtype)),
    ("to real", lambda v: v.to(torch.float32)),
    ("reshape copy", lambda v: v.t().reshape(-1)),
    ("flatten copy", lambda v: v.t().flatten()),
    ("ravel", lambda v: v.t().ravel()),
    ("repeat", lambda v: v.repeat(2, 1)),
    ("advanced index", lambda v: v[[1, 0, 1]]),
    ("mask index", lambda v: v[mask_of(v)]),
    ("index_select", lambda v: v.index_select(1, index_of(v, [2, 0]))),
    ("clone channels_last", lambda v: v.reshape(1, 2, 1, 3).clone(memory_format=fmt_of(v))),
    ("resolve_conj", lambda v: v.resolve_conj()),
    ("resolve_neg", lambda v: v.resolve_neg()),
    ("conj_physical", lambda v: v.conj_physical()),
    ("tolist", lambda v: v.tolist()),
    ("item", lambda v: v[1, 2].item()),
    ("numpy", lambda v: v.numpy()),
    ("dlpack", lambda v: v.__dlpack__() and None),
]


def index_of(v: Any, items: list[int]) -> Any:
    if isinstance(v, tensord.Tensor):
        return v.client.tensor(items)
    return torch.tensor(items)


def fmt_of(v: Any) -> Any:
    return tensord.channels_last if isinstance(v, tensord.Tensor) else torch.channels_last


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n, _ in READS])
@pytest.mark.parametrize("bit", ["conj", "neg"])
def test_reads_through_a_lazy_bit_match_torch(client: tensord.Client, name: str, bit: str) -> None:
    op = dict(READS)[name]
    t = complex_base(6).view(2, 3)
    x = client.tensor(t)
    tv, xv = (t.conj(), x.conj()) if bit == "conj" else (t.conj().imag, x.conj().imag)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex -> real casts warn in torch
        result = both(xv, tv, op)
    if isinstance(result, tensord.Tensor) and not same_storage(result, xv):
        assert not (result.is_conj() or result.is_neg())  # a copy holds the values


def test_cat_and_stack_of_conjugates(client: tensord.Client) -> None:
    t = complex_base(6).view(2, 3)
    x = client.tensor(t)
    for xs, ts in (
        ([x.conj(), x], [t.conj(), t]),
        ([x, x.conj().conj()], [t, t.conj().conj()]),
    ):
        assert_same(tensord.cat(xs), torch.cat(ts))
        assert_same(tensord.stack(xs, 1), torch.stack(ts, 1))
    real_t, real_x = t.conj().imag, x.conj().imag
    assert_same(tensord.cat([real_x, real_x.t().contiguous().t()]), torch.cat([real_t, real_t]))


def test_numpy_force_and_repr_resolve_the_bits(client: tensord.Client) -> None:
    t = complex_base(6).view(2, 3)
    x = client.tensor(t)
    np.testing.assert_array_equal(x.conj().numpy(force=True), t.conj().numpy(force=True))
    np.testing.assert_array_equal(x.conj().imag.numpy(force=True), t.conj().imag.numpy(force=True))
    assert repr(x.conj()) == repr(t.conj())
    assert repr(x.conj().imag) == repr(t.conj().imag)
    with pytest.raises(RuntimeError, match="conjugate bit set"):
        np.asarray(x.conj())


def test_same_host_downloads_resolve_the_bits(client: tensord.Client) -> None:
    """Large enough for the mapped (no-gRPC) read path, and for several download chunks."""
    t = complex_base(1 << 16).view(256, 256)
    x = client.tensor(t)
    for xv, tv in (
        (x.conj(), t.conj()),
        (x.conj().imag, t.conj().imag),
        (x.t().conj(), t.t().conj()),
    ):
        assert_same(xv, tv)
        np.testing.assert_array_equal(np.array(xv.tolist()), np.array(tv.tolist()))
    with tensord.connect(client.address, local=False) as remote:
        y = remote.tensor(t)
        np.testing.assert_array_equal(y.conj().numpy(force=True), t.conj().resolve_conj().numpy())
        np.testing.assert_array_equal(
            y.conj().imag.numpy(force=True), t.conj().imag.resolve_neg().numpy()
        )


# ---- 3. writes into a view with a bit store the conjugate (negation), as torch does ------

WRITES: list[tuple[str, Callable[[Any, Any], Any]]] = [
    ("fill_", lambda v, src: v.fill_(3 + 4j if v.dtype.is_complex else 5.0)),
    ("zero_", lambda v, src: v.zero_()),
    ("copy_", lambda v, src: v.copy_(src)),
    ("copy_ expanded", lambda v, src: v.copy_(src[0])),
    (
        "setitem scalar",
        lambda v, src: v.__setitem__((0, slice(1, None)), 7 - 1j if v.dtype.is_complex else 7.0),
    ),
    ("setitem tensor", lambda v, src: v.__setitem__(1, src[0])),
    ("setitem uploaded row", lambda v, src: v.__setitem__(0, plain_row(v, [1, 2, 3]))),
    ("advanced setitem", lambda v, src: v.__setitem__((slice(None), [2, 0]), src[:, :2])),
    ("index_put_ accumulate", lambda v, src: v.index_put_((index_of(v, [1, 1]),), src[0], True)),
    ("masked_fill_", lambda v, src: v.masked_fill_(mask_of(v), 2.0)),
    ("conj_physical_", lambda v, src: v.conj_physical_()),
]


def plain_row(v: Any, row: Any) -> Any:
    """A row as a tensor of v's dtype (torch's setitem takes only tensors and numbers)."""
    if isinstance(v, tensord.Tensor):
        return v.client.tensor(np.asarray(row)).to(v.dtype)
    return torch.tensor(np.asarray(row), dtype=v.dtype)


def mask_of(v: Any) -> Any:
    rows = [[True, False, True], [False, False, True]]
    return v.client.tensor(rows) if isinstance(v, tensord.Tensor) else torch.tensor(rows)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n, _ in WRITES])
@pytest.mark.parametrize("target", ["conj", "neg", "conj source"])
def test_writes_through_a_lazy_bit_match_torch(
    client: tensord.Client, name: str, target: str
) -> None:
    op = dict(WRITES)[name]
    t = complex_base(6).view(2, 3)
    x = client.tensor(t)
    src_t = complex_base(6).view(2, 3) * (1 + 1j) + 1
    src_x = client.tensor(src_t)
    if target == "conj":
        tv, xv = t.conj(), x.conj()
    elif target == "neg":
        tv, xv = t.conj().imag, x.conj().imag
        src_t, src_x = src_t.conj().imag, src_x.conj().imag
    else:  # a plain target, a source with the bit
        tv, xv = t, x
        src_t, src_x = src_t.conj(), src_x.conj()
    op(tv, src_t)
    op(xv, src_x)
    np.testing.assert_array_equal(x.numpy(), t.numpy())  # the stored values
    assert_same(xv, tv)


def test_copy_onto_its_own_conjugate_conjugates(client: tensord.Client) -> None:
    t = complex_base(6).view(2, 3)
    x = client.tensor(t)
    t.copy_(t.conj())
    x.copy_(x.conj())
    np.testing.assert_array_equal(x.numpy(), t.numpy())
    t.conj().copy_(t)
    x.conj().copy_(x)
    np.testing.assert_array_equal(x.numpy(), t.numpy())


def test_shared_and_named_handles_keep_the_bits(client: tensord.Client) -> None:
    t = complex_base(4)
    x = client.tensor(t)
    token = x.conj().imag.share()
    with tensord.connect(client.address) as other:
        y = other.attach(token)
        assert (y.is_conj(), y.is_neg()) == (False, True)
        np.testing.assert_array_equal(y.numpy(force=True), values(t.conj().imag))


# ---- 4. the server trusts nothing: the same checks when the SDK is bypassed ------------


def test_server_checks_complex_views_itself(server: Any, open_session: Any) -> None:
    stub = open_session(server.address)
    full = stub.Full(
        pb.FullRequest(shape=[3, 2], value=pb.Scalar(float_value=1.0), dtype="float32"),
        metadata=stub.md,
    )
    grpc = pytest.importorskip("grpc")

    def view(handle: str, **op: Any) -> Any:
        return stub.View(pb.ViewRequest(handle=handle, **op), metadata=stub.md).tensors[0]

    with pytest.raises(grpc.RpcError) as got:
        view(full.handle, complex_view=pb.ComplexView(op="imag"))
    assert got.value.details() == "imag is not implemented for tensors with non-complex dtypes."
    with pytest.raises(grpc.RpcError) as got:
        view(full.handle, complex_view=pb.ComplexView(op="polar"))
    assert got.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    cplx = view(full.handle, complex_view=pb.ComplexView(op="view_as_complex"))
    assert (cplx.dtype, list(cplx.shape), list(cplx.stride)) == ("complex64", [3], [1])
    conj = view(cplx.handle, complex_view=pb.ComplexView(op="conj"))
    assert conj.is_conj and not conj.is_neg
    neg = view(conj.handle, complex_view=pb.ComplexView(op="imag"))
    assert neg.is_neg and (neg.storage_offset, list(neg.stride)) == (1, [2])
    for handle in (conj.handle, neg.handle):
        with pytest.raises(grpc.RpcError, match=r"torch\.Tensor\.view is not supported"):
            view(handle, view_dtype=pb.ViewDtype(dtype="int32"))
    with pytest.raises(grpc.RpcError, match="view_as_real doesn't work on unresolved"):
        view(conj.handle, complex_view=pb.ComplexView(op="view_as_real"))


def test_index_put_of_a_conjugate_view_of_itself(client: tensord.Client) -> None:
    """The scatter copies a value sharing the written Storage before writing (the chunked
    scatter's rule); that copy must hold the value's conjugated values, not its stored ones."""
    t = complex_base(6)
    x = client.tensor(t)
    rows = torch.tensor([0, 1])
    t[rows] = t.conj()[4:6]
    x[client.tensor(rows)] = x.conj()[4:6]
    np.testing.assert_array_equal(x.numpy(), t.numpy())
    t.index_put_((rows,), t.conj()[2:4], accumulate=True)
    x.index_put_((client.tensor(rows),), x.conj()[2:4], accumulate=True)
    np.testing.assert_array_equal(x.numpy(), t.numpy())


@pytest.mark.parametrize("src_dtype", ["bool", "uint8", "int8", "int64"])
def test_integer_and_bool_sources_written_into_a_negative_view_match_torch(
    client: tensord.Client, src_dtype: str
) -> None:
    """The stored form of a bool or integer value is the negated *converted* value: NumPy's
    negative of the source itself raised for bool and wrapped uint8 5 -> 251, int8 -128."""
    src_t = torch.tensor([5, -128, 1, 0]).to(getattr(torch, src_dtype))
    src_x = client.tensor(src_t)
    t = complex_base(8).view(2, 4)
    x = client.tensor(t)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # int8 overflow in the source's conversion
        for op in (
            lambda v, s: v.copy_(s),
            lambda v, s: v.__setitem__(1, s),
            lambda v, s: v[:, 1:].copy_(s[:3].expand(2, 3)),
        ):
            op(t.conj().imag, src_t)
            op(x.conj().imag, src_x)
            np.testing.assert_array_equal(x.numpy(), t.numpy())  # the stored values
            assert_same(x.conj().imag, t.conj().imag)


# ---- 5. a view naming the same elements many times: its bits are applied per location ---

OVERLAPPING_READS: list[tuple[str, Callable[[Any], Any]]] = [
    ("clone", lambda v: v.clone()),
    ("contiguous", lambda v: v.contiguous()),
    ("to bool", lambda v: v.to(torch.bool)),
    ("to wider", lambda v: v.to(torch.complex128 if v.dtype.is_complex else torch.float64)),
    ("to half", lambda v: v.to(torch.float16)),
    ("reshape copy", lambda v: v.reshape(-1)),
    ("repeat", lambda v: v.repeat(2, 1)),
    ("cat", lambda v: (tensord if isinstance(v, tensord.Tensor) else torch).cat([v, v])),
    ("stack", lambda v: (tensord if isinstance(v, tensord.Tensor) else torch).stack([v, v], 1)),
    ("copy_", lambda v: zeros(v).copy_(v)),
    ("copy_ into a conjugate", lambda v: zeros(v).conj().copy_(v)),
    ("setitem", lambda v: written(zeros(v), v)),
]


def zeros(v: Any) -> Any:
    if isinstance(v, tensord.Tensor):
        # made by the server (a client-side array would count in the server's measurements)
        return cast(tensord.Client, v.client).zeros(tuple(v.shape), dtype=v.dtype)
    return torch.zeros(v.shape, dtype=v.dtype)


def written(dst: Any, v: Any) -> Any:
    dst[...] = v
    return dst


def overlapping(v: Any, bit: str, shape: tuple[int, ...], stride: tuple[int, ...]) -> Any:
    """An as_strided view of complex ``v`` naming elements more than once, with the bit."""
    view = v.as_strided(shape, stride)
    return view.conj() if bit == "conj" else view.conj().imag


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n, _ in OVERLAPPING_READS])
@pytest.mark.parametrize("bit", ["conj", "neg"])
@settings(HYPOTHESIS, max_examples=10)
@given(data=st.data())
def test_reads_of_an_overlapping_view_with_a_bit_match_torch(
    client: tensord.Client, name: str, bit: str, data: st.DataObject
) -> None:
    rows, cols = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 5))
    stride = (data.draw(st.integers(0, 3)), data.draw(st.integers(0, 3)))
    t = complex_base(1 + (rows - 1) * stride[0] + (cols - 1) * stride[1] + 2)
    x = client.tensor(t)
    op = dict(OVERLAPPING_READS)[name]
    tv, xv = (overlapping(v, bit, (rows, cols), stride) for v in (t, x))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex -> real casts warn in torch
        theirs, ours = op(tv), op(xv)
    assert_same(ours, theirs)
    np.testing.assert_array_equal(x.numpy(), t.numpy())  # the source's Storage is unchanged


# A 256 KiB Storage and views of 32 MiB of logical bytes over it: each op's memory outside
# the pool is bounded by the Storage, never the view (the pool's own segments are made by
# a first call, before the measured one).
STORAGE_ELEMENTS = 1 << 15
LOGICAL_SHAPE = (2048, 2048)
BOUNDED_TEMPORARY_BYTES = 2 << 20  # the Storage's 256 KiB (a span of it) and gRPC's own


@pytest.mark.slow
@pytest.mark.parametrize("stride", [(1, 1), (1, 15)], ids=["a few elements", "the whole Storage"])
@pytest.mark.parametrize("name", [n for n, _ in OVERLAPPING_READS])
@pytest.mark.parametrize("bit", ["conj", "neg"])
def test_an_overlapping_view_with_a_bit_is_copied_within_its_storage(
    client: tensord.Client, name: str, bit: str, stride: tuple[int, int]
) -> None:
    t = complex_base(STORAGE_ELEMENTS, torch.complex64)
    view = overlapping(client.tensor(t), bit, LOGICAL_SHAPE, stride)
    assert view.numel() * view.element_size() >= 64 * t.nbytes
    op = dict(OVERLAPPING_READS)[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex -> real casts warn in torch
        op(view)  # makes the pool's segments for the result, dropped at once
        client.synchronize()
        tracemalloc.start()
        try:
            result = op(view)
            client.synchronize()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        expected = op(overlapping(t, bit, LOGICAL_SHAPE, stride))
    # unbounded, it was a temporary of the view's logical size (16 or 32 MiB)
    assert peak < BOUNDED_TEMPORARY_BYTES, peak
    assert (result.is_conj(), result.is_neg()) == (expected.is_conj(), expected.is_neg())
    sample = (slice(None, None, 97),) * expected.ndim  # a sample of the result's elements
    np.testing.assert_array_equal(result[sample].numpy(force=True), values(expected[sample]))


def test_a_complex_overlapping_view_to_bool_is_computed_into_the_result(
    client: tensord.Client,
) -> None:
    """complex -> bool is "nonzero": computed straight into the result, not into a
    temporary of the view's logical size first (with or without a bit)."""
    t = complex_base(STORAGE_ELEMENTS, torch.complex64)
    view = client.tensor(t).as_strided(LOGICAL_SHAPE, (1, 15))
    view.to(torch.bool)  # makes the pool's segment for the result, dropped at once
    client.synchronize()
    tracemalloc.start()
    try:
        result = view.to(torch.bool)
        client.synchronize()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < BOUNDED_TEMPORARY_BYTES, peak  # unbounded: 4 MiB of bools
    expected = t.as_strided(LOGICAL_SHAPE, (1, 15)).to(torch.bool)
    np.testing.assert_array_equal(result[::97, ::89].numpy(), expected[::97, ::89].numpy())


@pytest.mark.parametrize("bit", ["conj", "neg"])
def test_a_gather_from_a_view_with_a_bit_resolves_its_result_in_place(
    client: tensord.Client, bit: str
) -> None:
    """The gather itself holds a chunk of index positions at a time; its result's bits are
    then resolved over the result itself, not through a temporary of its size."""
    t = complex_base(STORAGE_ELEMENTS, torch.complex64)
    view = overlapping(client.tensor(t), bit, LOGICAL_SHAPE, (1, 15))
    rows = list(range(LOGICAL_SHAPE[0] - 1, -1, -1))
    view[index_of(view, rows)]  # makes the pool's segment for the result, dropped at once
    client.synchronize()
    tracemalloc.start()
    try:
        result = view[index_of(view, rows)]
        client.synchronize()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    chunk_bytes = indexing.INDEX_CHUNK_ELEMENTS * view.element_size()
    assert peak < chunk_bytes + BOUNDED_TEMPORARY_BYTES, peak  # the result: 16 or 32 MiB more
    expected = overlapping(t, bit, LOGICAL_SHAPE, (1, 15))[rows]
    assert (result.is_conj(), result.is_neg()) == (False, False)
    np.testing.assert_array_equal(result[::97, ::89].numpy(), values(expected[::97, ::89]))


@st.composite
def host_views(draw: st.DrawFn) -> np.ndarray:
    """A NumPy view of random shape and strides (zero, negative, overlapping) over a
    small buffer, of a dtype a tensor with a bit (or a value written into one) has."""
    dtype = np.dtype(draw(st.sampled_from(["complex64", "complex128", "float32", "int8"])))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    strides = tuple(draw(st.integers(-3, 3)) for _ in shape)
    low = sum(s * (n - 1) for s, n in zip(strides, shape, strict=True) if s < 0 and n)
    high = sum(s * (n - 1) for s, n in zip(strides, shape, strict=True) if s > 0 and n)
    values = np.arange(high - low + 1) % 100 * (1 - 2j) + 3
    buffer = (values if dtype.kind == "c" else values.real).astype(dtype)
    return np.lib.stride_tricks.as_strided(
        buffer[-low:], shape, tuple(s * dtype.itemsize for s in strides)
    )


@pytest.mark.slow
@settings(HYPOTHESIS, max_examples=300)
@given(
    array=host_views(),
    conj=st.booleans(),
    neg=st.booleans(),
    written_as=st.sampled_from([None, np.float32, np.complex128]),
)
def test_lazy_bits_over_any_host_view_are_computed_per_element(
    array: np.ndarray, conj: bool, neg: bool, written_as: Any
) -> None:
    """Whatever the strides, each element as if computed on its own (a view over the span
    of memory it reaches reads the same values as a copy of each element)."""
    before = array.copy()
    expected = np.ascontiguousarray(array)
    if neg and written_as is not None and expected.dtype.kind in "biu":
        expected = expected.astype(written_as)
    if conj:
        expected = np.conj(expected)
    if neg:
        expected = np.negative(expected)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = kernels.apply_lazy_bits(array, conj, neg, written_as)
    assert result.shape == array.shape and result.dtype == expected.dtype
    np.testing.assert_array_equal(result, expected)
    np.testing.assert_array_equal(array, before)  # read, never written


def test_lazy_bits_of_a_view_naming_its_memory_many_times_are_bounded_by_it() -> None:
    buffer = np.arange(1 << 12, dtype=np.complex128)  # 64 KiB
    # 2**22 elements (64 MiB) over it, one dim running backwards
    view = np.lib.stride_tricks.as_strided(buffer[2047:], (2048, 2048), (-16, 16))
    tracemalloc.start()
    try:
        result = kernels.apply_lazy_bits(view, True, True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < buffer.nbytes + (16 << 10), peak  # a span of the buffer, and Python's own
    np.testing.assert_array_equal(result[::131, ::127], -np.conj(view[::131, ::127]))
