"""torch's module-level forms of the view ops (``torch.narrow(x, ...)`` == ``x.narrow(...)``),
plus the few that exist only as functions: broadcast_tensors, broadcast_shapes, atleast_*d.

Each takes torch's parameter names, so code written against torch keeps working.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tensord import errors, layout
from tensord.tensor import Tensor, complex_function, torch_errors


def narrow(input: Tensor, dim: int, start: Any, length: int) -> Tensor:
    return input.narrow(dim, start, length)


def select(input: Tensor, dim: int, index: int) -> Tensor:
    return input.select(dim, index)


def transpose(input: Tensor, dim0: int, dim1: int) -> Tensor:
    return input.transpose(dim0, dim1)


def swapdims(input: Tensor, dim0: int, dim1: int) -> Tensor:
    return input.swapdims(dim0, dim1)


def swapaxes(input: Tensor, axis0: int, axis1: int) -> Tensor:
    return input.swapaxes(axis0, axis1)


def t(input: Tensor) -> Tensor:
    return input.t()


def adjoint(input: Tensor) -> Tensor:
    return input.adjoint()


def permute(input: Tensor, dims: Sequence[int]) -> Tensor:
    return input.permute(dims)


def movedim(input: Tensor, source: Any, destination: Any) -> Tensor:
    return input.movedim(source, destination)


def moveaxis(input: Tensor, source: Any, destination: Any) -> Tensor:
    return input.movedim(source, destination)


def reshape(input: Tensor, shape: Sequence[int]) -> Tensor:
    return input.reshape(shape)


def flatten(input: Tensor, start_dim: int = 0, end_dim: int = -1) -> Tensor:
    return input.flatten(start_dim, end_dim)


def unflatten(input: Tensor, dim: int, sizes: Sequence[int]) -> Tensor:
    return input.unflatten(dim, sizes)


def ravel(input: Tensor) -> Tensor:
    return input.ravel()


def squeeze(input: Tensor, dim: Any = None) -> Tensor:
    return input.squeeze(dim)


def unsqueeze(input: Tensor, dim: int) -> Tensor:
    return input.unsqueeze(dim)


def split(tensor: Tensor, split_size_or_sections: Any, dim: int = 0) -> tuple[Tensor, ...]:
    return tensor.split(split_size_or_sections, dim)


def chunk(input: Tensor, chunks: int, dim: int = 0) -> tuple[Tensor, ...]:
    return input.chunk(chunks, dim)


def unbind(input: Tensor, dim: int = 0) -> tuple[Tensor, ...]:
    return input.unbind(dim)


def tensor_split(input: Tensor, indices_or_sections: Any, dim: int = 0) -> tuple[Tensor, ...]:
    return input.tensor_split(indices_or_sections, dim)


def hsplit(input: Tensor, indices_or_sections: Any) -> tuple[Tensor, ...]:
    return input.hsplit(indices_or_sections)


def vsplit(input: Tensor, indices_or_sections: Any) -> tuple[Tensor, ...]:
    return input.vsplit(indices_or_sections)


def dsplit(input: Tensor, indices_or_sections: Any) -> tuple[Tensor, ...]:
    return input.dsplit(indices_or_sections)


def diagonal(input: Tensor, offset: int = 0, dim1: int = 0, dim2: int = 1) -> Tensor:
    return input.diagonal(offset, dim1, dim2)


def as_strided(
    input: Tensor, size: Sequence[int], stride: Sequence[int], storage_offset: int | None = None
) -> Tensor:
    return input.as_strided(size, stride, storage_offset)


def broadcast_to(input: Tensor, size: Sequence[int]) -> Tensor:
    return input.broadcast_to(size)


def detach(input: Tensor) -> Tensor:
    return input.detach()


def broadcast_shapes(*shapes: Any) -> tuple[int, ...]:
    """torch.broadcast_shapes (a torch.Size there; a tensord.Size here)."""
    from tensord.tensor import Size

    with torch_errors():
        return Size(layout.broadcast_shapes(*shapes))


def _infer_size(a: Sequence[int], b: Sequence[int]) -> tuple[int, ...]:
    # mirrors ATen infer_size_impl (broadcast_tensors' shape, with its text)
    ndim = max(len(a), len(b))
    out = [0] * ndim
    for i in range(ndim - 1, -1, -1):
        offset = ndim - 1 - i
        size_a = a[len(a) - 1 - offset] if len(a) - 1 - offset >= 0 else 1
        size_b = b[len(b) - 1 - offset] if len(b) - 1 - offset >= 0 else 1
        if size_a != size_b and size_a != 1 and size_b != 1:
            raise errors.TensordRuntimeError(
                f"The size of tensor a ({size_a}) must match the size of tensor b ({size_b}) at "
                f"non-singleton dimension {i}"
            )
        out[i] = size_b if size_a == 1 else size_a
    return tuple(out)


def broadcast_tensors(*tensors: Tensor) -> tuple[Tensor, ...]:
    """mirrors ATen broadcast_tensors / expand_outplace: a tensor already of the common
    shape is returned itself, the others are expanded views."""
    items = (
        list(tensors[0]) if len(tensors) == 1 and isinstance(tensors[0], (list, tuple)) else tensors
    )
    shape: tuple[int, ...] = ()
    for i, x in enumerate(items):
        shape = tuple(x.shape) if i == 0 else _infer_size(shape, tuple(x.shape))
    return tuple(x if tuple(x.shape) == shape else x.expand(shape) for x in items)


def _atleast(args: tuple[Any, ...], one: Any) -> Any:
    # torch: one tensor -> a tensor; several, or one list/tuple -> a tuple
    if len(args) == 1 and isinstance(args[0], Tensor):
        return one(args[0])
    items = args[0] if len(args) == 1 and isinstance(args[0], (list, tuple)) else args
    return tuple(one(x) for x in items)


def _at_least_1d(x: Tensor) -> Tensor:
    return x.reshape(1) if x.ndim == 0 else x


def _at_least_2d(x: Tensor) -> Tensor:
    if x.ndim == 0:
        return x.reshape(1, 1)
    return x.unsqueeze(0) if x.ndim == 1 else x


def _at_least_3d(x: Tensor) -> Tensor:
    if x.ndim == 0:
        return x.reshape(1, 1, 1)
    if x.ndim == 1:
        return x.unsqueeze(0).unsqueeze(-1)
    return x.unsqueeze(-1) if x.ndim == 2 else x


def atleast_1d(*tensors: Any) -> Any:
    """mirrors ATen atleast_1d: a 0-dim tensor as shape (1,); others themselves."""
    return _atleast(tensors, _at_least_1d)


def atleast_2d(*tensors: Any) -> Any:
    return _atleast(tensors, _at_least_2d)


def atleast_3d(*tensors: Any) -> Any:
    return _atleast(tensors, _at_least_3d)


# ---- complex views and torch's lazy bits (issue 14) -------------------------------------


def _tensor_argument(function: str, input: Any) -> Tensor:
    """torch's argument parser's refusal of a non-tensor ``input``, word for word."""
    if not isinstance(input, Tensor):
        raise errors.TensordTypeError(
            f"{function}(): argument 'input' (position 1) must be Tensor, not "
            f"{type(input).__name__}"
        )
    return input


def view_as_real(input: Tensor) -> Tensor:
    return complex_function("view_as_real", input)


def view_as_complex(input: Tensor) -> Tensor:
    return complex_function("view_as_complex", input)


def real(input: Tensor) -> Tensor:
    return _tensor_argument("real", input).real


def imag(input: Tensor) -> Tensor:
    return _tensor_argument("imag", input).imag


def conj(input: Tensor) -> Tensor:
    return _tensor_argument("conj", input).conj()


def conj_physical(input: Tensor) -> Tensor:
    return _tensor_argument("conj_physical", input).conj_physical()


def conj_physical_(input: Tensor) -> Tensor:
    return _tensor_argument("conj_physical_", input).conj_physical_()


def resolve_conj(input: Tensor) -> Tensor:
    return _tensor_argument("resolve_conj", input).resolve_conj()


def resolve_neg(input: Tensor) -> Tensor:
    return _tensor_argument("resolve_neg", input).resolve_neg()


def is_conj(input: Tensor) -> bool:
    return _tensor_argument("is_conj", input).is_conj()


def is_neg(input: Tensor) -> bool:
    return _tensor_argument("is_neg", input).is_neg()
