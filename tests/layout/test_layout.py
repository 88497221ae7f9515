"""Hand-written cases for tensord.layout: each op, each error text (copied from torch 2.13)."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
from tensord.layout import Layout, broadcast_shapes, contiguous_strides, normalize_dim

C = Layout.contiguous
X = C((2, 3))  # a small matrix used by the error cases
S = C(())  # a 0-dim tensor


def test_permute_reorders_the_contiguous_strides() -> None:
    assert C((2, 3, 4)).permute(2, 0, 1).stride == (1, 12, 4)


def test_record_invariants() -> None:
    lay = Layout((2, 3), (3, 1), 4)
    assert (lay.ndim, lay.numel) == (2, 6)
    assert hash(lay) == hash(Layout((2, 3), (3, 1), 4))
    with pytest.raises(AttributeError):
        lay.offset = 1  # type: ignore[misc]
    for bad in [((2,), (1, 1)), ((-1,), (1,)), ((2,), (1,), -1), ([2], [1])]:
        with pytest.raises(AssertionError):
            Layout(*bad)  # type: ignore[arg-type]


def test_contiguity_and_extent() -> None:
    assert contiguous_strides((2, 0, 3)) == (3, 3, 1)
    assert C((2, 3)).is_contiguous() and C(()).is_contiguous()
    assert Layout((1, 3), (100, 1)).is_contiguous()  # size-1 dims are ignored
    assert Layout((0, 3), (7, 7)).is_contiguous()  # zero elements: contiguous
    t = C((2, 3)).t()
    assert not t.is_contiguous() and t.is_non_overlapping_and_dense()
    assert not Layout((2, 2), (1, 1)).is_non_overlapping_and_dense()  # overlapping
    assert not Layout((2,), (2,)).is_non_overlapping_and_dense()  # gaps
    assert C((2, 3), offset=5).storage_extent() == 11
    assert Layout((2, 3), (1, 2), 1).storage_extent() == 1 + 1 + 4 + 1
    assert Layout((0, 3), (3, 1), 9).storage_extent() == 0
    assert C(()).storage_extent() == 1


def test_dense_like() -> None:
    assert C((2, 3), offset=4).dense_like() == C((2, 3))
    assert C((2, 3, 4)).permute(2, 0, 1).dense_like().stride == (1, 12, 4)  # kept: dense
    assert Layout((2, 3), (0, 1)).dense_like().stride == (3, 1)  # expanded -> contiguous
    assert Layout((3, 2), (2, 12)).dense_like().stride == (1, 3)  # gaps -> keeps the order


def test_view_and_reshape() -> None:
    assert X.view(3, 2) == C((3, 2))
    assert X.view(-1) == C((6,))
    assert X.view((1, -1, 1)).shape == (1, 6, 1)
    assert S.view(1, 1).stride == (1, 1)
    assert C((1,)).view(()) == S
    assert C((2, 0)).view(0, 5).stride == (5, 1)
    assert C((4, 6))[:, :4].view(4, 2, 2).stride == (6, 2, 1)  # splits one chunk
    assert X.t().reshape(6) is None  # torch copies
    assert X.t().reshape(3, 2) == X.t()
    assert X.t().view(3, 1, 2).stride == (1, 6, 3)  # torch 2.13 gives this too


def test_view_dtype() -> None:
    lay = C((2, 4), offset=2)
    assert lay.view_dtype(4, 8) == Layout((2, 2), (2, 1), 1)
    assert lay.view_dtype(4, 2) == Layout((2, 8), (8, 1), 4)
    assert lay.view_dtype(4, 4) is lay


def test_narrow_select_index() -> None:
    lay = C((4, 5))
    assert lay.narrow(1, 1, 3) == Layout((4, 3), (5, 1), 1)
    assert lay.narrow(0, -2, 2) == Layout((2, 5), (5, 1), 10)
    assert lay.select(1, -1) == Layout((4,), (5,), 4)
    assert lay[1] == Layout((5,), (1,), 5)
    assert lay[-1, 2] == Layout((), (), 17)
    assert lay[1:3, ::2] == Layout((2, 3), (5, 2), 5)
    assert lay[-100:100] == lay  # slices clamp
    assert lay[3:1].shape == (0, 5)
    assert lay[None, ..., None].shape == (1, 4, 5, 1)
    assert lay[..., 0] == Layout((4,), (5,), 0)
    assert lay[None] == lay.unsqueeze(0) and lay[...] is lay
    assert S[None].shape == (1,) and S[...] is S
    assert lay[..., ...] == lay  # torch accepts several Ellipsis; each skips the unindexed dims
    with pytest.raises(IndexError, match="Dimension out of range"):
        lay[..., ..., 0]  # torch reads past its sizes here (undefined); tensord rejects the dim


def test_dim_shuffles() -> None:
    lay = C((2, 3, 4))
    assert lay.transpose(0, -1) == Layout((4, 3, 2), (1, 4, 12))
    assert lay.permute([1, 2, 0]).stride == (4, 1, 12)
    assert lay.movedim(0, -1).shape == (3, 4, 2)
    assert lay.movedim((0, 1), (2, 0)).shape == (3, 4, 2)
    assert C((5,)).t() == C((5,)) and S.t() == S
    assert S.transpose(0, -1) == S and S.permute() == S


def test_expand() -> None:
    assert C((3, 1)).expand(2, 3, 4) == Layout((2, 3, 4), (0, 1, 0))
    assert C((3, 1)).expand((-1, 5)) == Layout((3, 5), (1, 0))
    assert S.expand(2, 2) == Layout((2, 2), (0, 0))
    assert C((1,)).expand(0) == Layout((0,), (0,))


def test_squeeze_unsqueeze_flatten_unflatten() -> None:
    lay = C((1, 3, 1, 2))
    assert lay.squeeze().shape == (3, 2)
    assert lay.squeeze(0).shape == (3, 1, 2)
    assert lay.squeeze(1) == lay
    assert lay.squeeze((0, -2)).shape == (3, 2)
    assert C((2, 3)).unsqueeze(1) == Layout((2, 1, 3), (3, 3, 1))
    assert C((2, 3)).unsqueeze(-1) == Layout((2, 3, 1), (3, 1, 1))
    assert C((2, 3, 4)).flatten(1) == C((2, 12))
    assert C((2, 3, 4)).permute(2, 0, 1).flatten() is None  # torch copies
    assert S.flatten() == C((1,))
    assert C((2, 12)).unflatten(1, (3, -1)) == C((2, 3, 4))


def test_split_chunk_unbind_diagonal() -> None:
    lay = C((5, 2))
    assert [p.shape[0] for p in lay.split(2)] == [2, 2, 1]
    assert [p.offset for p in lay.split([1, 4])] == [0, 2]
    assert [p.shape[0] for p in lay.chunk(3)] == [2, 2, 1]
    assert len(C((0,)).chunk(3)) == 3
    assert len(C((0,)).split(0)) == 1
    assert [p.offset for p in lay.unbind(1)] == [0, 1]
    assert C((3, 4)).diagonal() == Layout((3,), (5,), 0)
    assert C((3, 4)).diagonal(1) == Layout((3,), (5,), 1)
    assert C((3, 4)).diagonal(-1) == Layout((2,), (5,), 4)
    assert C((3, 4)).diagonal(9) == Layout((0,), (5,), 0)


def test_as_strided() -> None:
    base = C((6,), offset=2)
    assert base.as_strided((2, 2), (1, 2), storage_elements=8) == Layout((2, 2), (1, 2), 2)
    assert base.as_strided((0, 9), (1, 1), 50, storage_elements=8).numel == 0  # nothing to bound
    assert base.as_strided((2,), (3,), 0, storage_elements=4) == Layout((2,), (3,), 0)


def test_broadcast_shapes_and_normalize_dim() -> None:
    assert broadcast_shapes((2, 1), (3,), 1) == (2, 3)
    assert broadcast_shapes() == ()
    assert broadcast_shapes((0,), (1,)) == (0,)
    assert normalize_dim(-1, 3) == 2 and normalize_dim(0, 0) == 0 and normalize_dim(-1, 0) == 0


# -- errors: (call, type, message), the messages torch 2.13 gives ----------------------------

VIEW_MSG = (
    "view size is not compatible with input tensor's size and stride (at least one dimension "
    "spans across two contiguous subspaces). Use .reshape(...) instead."
)

ERRORS: list[tuple[str, Callable[[], object], type[BaseException], str]] = [
    ("view-strides", lambda: X.t().view(6), RuntimeError, VIEW_MSG),
    ("view-size", lambda: C((3, 4)).view(3, 5), RuntimeError, "shape '[3, 5]' is invalid for input of size 12"),
    ("view-2-infer", lambda: X.view(-1, -1), RuntimeError, "only one dimension can be inferred"),
    ("view-neg", lambda: X.view(-2, 3), RuntimeError, "invalid shape dimension -2 at index 0 of shape [-2, 3]"),
    ("view-0-infer", lambda: C((0,)).view(0, -1), RuntimeError,
     "cannot reshape tensor of 0 elements into shape [0, -1] because the unspecified dimension size -1 can be any value and is ambiguous"),
    ("dim", lambda: X.transpose(0, 5), IndexError,
     "Dimension out of range (expected to be in range of [-2, 1], but got 5)"),
    ("dim-0d", lambda: S.transpose(0, 1), IndexError,
     "Dimension out of range (expected to be in range of [-1, 0], but got 1)"),
    ("dtype-up", lambda: X.view_dtype(4, 8, old_name="Float", new_name="Double"), RuntimeError,
     "self.size(-1) must be divisible by 2 to view Float as Double (different element sizes), but got 3"),
    ("dtype-stride", lambda: X.t().view_dtype(4, 2, old_name="Float", new_name="Half"), RuntimeError,
     "self.stride(-1) must be 1 to view Float as Half (different element sizes), but got 3"),
    ("dtype-offset", lambda: C((2,), offset=1).view_dtype(1, 2, old_name="Char", new_name="Short"),
     RuntimeError, "self.storage_offset() must be divisible by 2 to view Char as Short (different element sizes), but got 1"),
    ("dtype-0d", lambda: S.view_dtype(4, 8, old_name="Float", new_name="Double"), RuntimeError,
     "self.dim() cannot be 0 to view Float as Double (different element sizes)"),
    ("narrow-start", lambda: X.narrow(0, 5, 1), IndexError,
     "start out of range (expected to be in range of [-2, 2], but got 5)"),
    ("narrow-len", lambda: X.narrow(0, 1, 5), RuntimeError, "start (1) + length (5) exceeds dimension size (2)."),
    ("narrow-neg", lambda: X.narrow(0, 1, -1), RuntimeError, "narrow(): length must be non-negative."),
    ("narrow-0d", lambda: S.narrow(0, 0, 1), RuntimeError, "narrow() cannot be applied to a 0-dim tensor."),
    ("select", lambda: X.select(0, 5), IndexError,
     "select(): index 5 out of range for tensor of size [2, 3] at dimension 0"),
    ("select-0d", lambda: S.select(0, 0), IndexError, "select() cannot be applied to a 0-dim tensor."),
    ("index", lambda: X[:, 7], IndexError, "index 7 is out of bounds for dimension 1 with size 3"),
    ("index-0d", lambda: S[0], IndexError,
     "invalid index of a 0-dim tensor. Use `tensor.item()` in Python or `tensor.item<T>()` in C++ to convert a 0-dim tensor to a number"),
    ("index-many", lambda: X[0, 0, 0], IndexError, "too many indices for tensor of dimension 2"),
    ("index-step", lambda: X[::-1], ValueError, "step must be greater than zero"),
    ("index-step0", lambda: X[::0], ValueError, "slice step cannot be zero"),
    ("index-slice-0d", lambda: S[:], IndexError, "slice() cannot be applied to a 0-dim tensor."),
    ("index-type", lambda: X[[0, 1]], TypeError, "tensord supports only basic indexing"),  # type: ignore[index]
    ("t", lambda: C((2, 3, 4)).t(), RuntimeError, "t() expects a tensor with <= 2 dimensions, but self is 3D"),
    ("permute-len", lambda: X.permute(0), RuntimeError,
     "permute(sparse_coo): number of dimensions in the tensor input does not match the length of the desired ordering of dimensions i.e. input.dim() = 2 is not equal to len(dims) = 1"),
    ("permute-dup", lambda: X.permute(0, 0), RuntimeError, "permute(): duplicate dims are not allowed."),
    ("movedim-len", lambda: X.movedim((0, 1), (0,)), RuntimeError,
     "movedim: Invalid source or destination dims: source ([0, 1] dims) should contain the same number of dims as destination ([0] dims)"),
    ("movedim-src", lambda: X.movedim((0, 0), (0, 1)), RuntimeError, "movedim: repeated dim in `source` ([0, 0])"),
    ("movedim-dst", lambda: X.movedim((0, 1), (1, 1)), RuntimeError, "movedim: repeated dim in `destination` ([1, 1])"),
    ("expand-few", lambda: X.expand(4, type_name="torch.FloatTensor"), RuntimeError,
     "expand(torch.FloatTensor{[2, 3]}, size=[4]): the number of sizes provided (1) must be greater or equal to the number of dimensions in the tensor (2)"),
    ("expand-size", lambda: X.expand(2, 4), RuntimeError,
     "The expanded size of the tensor (4) must match the existing size (3) at non-singleton dimension 1.  Target sizes: [2, 4].  Tensor sizes: [2, 3]"),
    ("expand-lead", lambda: X.expand(-1, -1, 3), RuntimeError,
     "The expanded size of the tensor (-1) isn't allowed in a leading, non-existing dimension 0"),
    ("squeeze-dup", lambda: X.squeeze((0, 0)), RuntimeError, "dim 0 appears multiple times in the list of dims"),
    ("unsqueeze", lambda: X.unsqueeze(5), IndexError,
     "Dimension out of range (expected to be in range of [-3, 2], but got 5)"),
    ("flatten", lambda: X.flatten(1, 0), RuntimeError, "flatten() has invalid args: start_dim cannot come after end_dim"),
    ("unflatten", lambda: X.unflatten(1, (2, 2)), RuntimeError,
     "unflatten: Provided sizes [2, 2] don't multiply up to the size of dim 1 (3) in the input tensor"),
    ("unflatten-empty", lambda: X.unflatten(1, ()), RuntimeError, "unflatten: sizes must be non-empty"),
    ("unflatten-infer", lambda: X.unflatten(1, (-1, -1)), RuntimeError,
     "unflatten got an unexpected error:\nonly one dimension can be inferred"),
    ("split-0", lambda: X.split(0), RuntimeError,
     "split_size can only be 0 if dimension size is 0, but got dimension size of 2"),
    ("split-neg", lambda: X.split(-1), RuntimeError, "split expects split_size be non-negative, but got split_size=-1"),
    ("split-sum", lambda: X.split([1, 2]), RuntimeError,
     "split_with_sizes expects split_sizes to sum exactly to 2 (input tensor's size at dimension 0), but got split_sizes=[1, 2]"),
    ("split-0d", lambda: S.split(1), RuntimeError, "split expects at least a 1-dimensional tensor"),
    ("chunk-0", lambda: X.chunk(0), RuntimeError, "chunk expects `chunks` to be greater than 0, got: 0"),
    ("unbind-0d", lambda: S.unbind(0), IndexError, "Dimension specified as 0 but tensor has no dimensions"),
    ("diagonal", lambda: X.diagonal(0, 0, 0), RuntimeError, "diagonal dimensions cannot be identical 0, 0"),
    ("as_strided-oob", lambda: X.as_strided((3, 3), (1, 1), 10, storage_elements=6, itemsize=4), RuntimeError,
     "setStorage: sizes [3, 3], strides [1, 1], storage offset 10, and itemsize 4 requiring a storage size of 60 are out of bounds for storage of size 24"),
    ("as_strided-off", lambda: X.as_strided((3, 3), (1, 1), -1, storage_elements=6), RuntimeError,
     "Tensor: invalid storage offset -1"),
    ("as_strided-neg", lambda: X.as_strided((3, 3), (1, -1), 0, storage_elements=6), RuntimeError,
     "as_strided: Negative strides are not supported at the moment, got strides: [1, -1]"),
    ("as_strided-len", lambda: X.as_strided((3, 3), (1,), 0, storage_elements=6), RuntimeError,
     "mismatch in length of strides and shape"),
    ("as_strided-overflow", lambda: X.as_strided((3, -3), (1, 1), 0, storage_elements=6), RuntimeError,
     "Storage size calculation overflowed with sizes=[3, -3] and strides=[1, 1]"),
    ("broadcast", lambda: broadcast_shapes((2, 3), (4,)), RuntimeError,
     "Attempting to broadcast a dimension of length 4 at -1! Mismatching argument at index 1 had (4,); but expected shape should be broadcastable to [2, 3]"),
    ("broadcast-neg", lambda: broadcast_shapes((1, -1), (3, 4)), ValueError,
     "Attempting to broadcast a dimension with negative length!"),
    ("normalize_dim", lambda: normalize_dim(5, 2), IndexError,
     "Dimension out of range (expected to be in range of [-2, 1], but got 5)"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("call", "exc", "message"), [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS]
)
def test_errors(call: Callable[[], object], exc: type[BaseException], message: str) -> None:
    with pytest.raises(exc) as info:
        call()
    assert type(info.value) is exc
    assert str(info.value).startswith(message), str(info.value)
    if exc is not TypeError:  # the one text of tensord's own
        assert str(info.value) == message


@pytest.mark.slow
@pytest.mark.torch
def test_error_texts_match_torch() -> None:
    """The texts above are torch 2.13's own: replay the same calls on real tensors."""
    torch = pytest.importorskip("torch")
    x, s = torch.empty(2, 3), torch.empty(())
    replay: dict[str, Callable[[], object]] = {
        "view-strides": lambda: x.t().view(6),
        "dim": lambda: x.transpose(0, 5),
        "expand-few": lambda: x.expand(4),
        "expand-size": lambda: x.expand(2, 4),
        "select": lambda: x.select(0, 5),
        "index-0d": lambda: s[0],
        "index-step": lambda: x[::-1],
        "permute-len": lambda: x.permute(0),
        "narrow-len": lambda: x.narrow(0, 1, 5),
        "dtype-up": lambda: x.view(torch.float64),
        "as_strided-oob": lambda: x.as_strided((3, 3), (1, 1), 10),
        "broadcast": lambda: torch.broadcast_shapes((2, 3), (4,)),
        "unbind-0d": lambda: s.unbind(0),
    }
    expected = {e[0]: (e[2], e[3]) for e in ERRORS}
    for name, call in replay.items():
        exc, message = expected[name]
        with pytest.raises(exc, match=re.escape(message)):
            call()
