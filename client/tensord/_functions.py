"""torch's module-level forms of the view ops (``torch.narrow(x, ...)`` == ``x.narrow(...)``),
plus the few that exist only as functions: broadcast_tensors, broadcast_shapes, atleast_*d.

Each takes torch's parameter names, so code written against torch keeps working.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tensord import errors, layout
from tensord._args import torch_errors
from tensord.device import Size
from tensord.tensor import Tensor, complex_function


def narrow(input: Tensor, dim: int, start: Any, length: int) -> Tensor:
    """Returns a new tensor that is a narrowed version of ``input`` tensor.

    ``input.narrow(dim, start, length)``: a view, queued like every view.
    """
    return input.narrow(dim, start, length)


def select(input: Tensor, dim: int, index: int) -> Tensor:
    """Slices the ``input`` tensor along the selected dimension at the given index.

    ``input.select(dim, index)``: a view, queued like every view.
    """
    return input.select(dim, index)


def transpose(input: Tensor, dim0: int, dim1: int) -> Tensor:
    """Returns a tensor that is a transposed version of ``input``.

    ``input.transpose(dim0, dim1)``: a view, queued like every view.
    """
    return input.transpose(dim0, dim1)


def swapdims(input: Tensor, dim0: int, dim1: int) -> Tensor:
    """Alias for ``tensord.transpose``.

    ``input.swapdims(dim0, dim1)``: a view, queued like every view.
    """
    return input.swapdims(dim0, dim1)


def swapaxes(input: Tensor, axis0: int, axis1: int) -> Tensor:
    """Alias for ``tensord.transpose``.

    ``input.swapaxes(axis0, axis1)``: a view, queued like every view.
    """
    return input.swapaxes(axis0, axis1)


def t(input: Tensor) -> Tensor:
    """Expects ``input`` to be <= 2-D tensor and transposes dimensions 0 and 1.

    ``input.t()``: a view, queued like every view.
    """
    return input.t()


def adjoint(input: Tensor) -> Tensor:
    """Returns a view of the tensor conjugated and with the last two dimensions transposed.

    ``input.adjoint()``: a view, queued like every view.
    """
    return input.adjoint()


def permute(input: Tensor, dims: Sequence[int]) -> Tensor:
    """Returns a view of the original tensor ``input`` with its dimensions permuted.

    ``input.permute(dims)``: a view, queued like every view.
    """
    return input.permute(dims)


def movedim(input: Tensor, source: Any, destination: Any) -> Tensor:
    """Moves the dimension(s) of ``input`` at the position(s) in ``source`` to the position(s) in
    ``destination``.

    ``input.movedim(source, destination)``: a view, queued like every view.
    """
    return input.movedim(source, destination)


def moveaxis(input: Tensor, source: Any, destination: Any) -> Tensor:
    """Alias for ``tensord.movedim``.

    ``input.moveaxis(source, destination)``: a view, queued like every view.
    """
    return input.movedim(source, destination)


def reshape(input: Tensor, shape: Sequence[int]) -> Tensor:
    """Returns a tensor with the same data and number of elements as ``input``, but with the
    specified shape.

    ``input.reshape(shape)``: a view when the layout allows, else a copy on the server.
    """
    return input.reshape(shape)


def flatten(input: Tensor, start_dim: int = 0, end_dim: int = -1) -> Tensor:
    """Flattens ``input`` by reshaping it into a one-dimensional tensor.

    ``input.flatten(start_dim, end_dim)``: a view when the dimensions can be merged, else a copy as
    reshape makes it.
    """
    return input.flatten(start_dim, end_dim)


def unflatten(input: Tensor, dim: int, sizes: Sequence[int]) -> Tensor:
    """Expands a dimension of the input tensor over multiple dimensions.

    ``input.unflatten(dim, sizes)``: a view, queued like every view.
    """
    return input.unflatten(dim, sizes)


def ravel(input: Tensor) -> Tensor:
    """Return a contiguous flattened tensor. A copy is made only if needed.

    ``input.ravel()``: a view of a contiguous tensor, else a contiguous copy made on the server
    (one Contiguous RPC), viewed flat.
    """
    return input.ravel()


def squeeze(input: Tensor, dim: Any = None) -> Tensor:
    """Returns a tensor with all specified dimensions of ``input`` of size 1 removed.

    ``input.squeeze(dim)``: a view, queued like every view.
    """
    return input.squeeze(dim)


def unsqueeze(input: Tensor, dim: int) -> Tensor:
    """Returns a new tensor with a dimension of size one inserted at the specified position.

    ``input.unsqueeze(dim)``: a view, queued like every view.
    """
    return input.unsqueeze(dim)


def split(tensor: Tensor, split_size_or_sections: Any, dim: int = 0) -> tuple[Tensor, ...]:
    """Splits the tensor into chunks. Each chunk is a view of the original tensor.

    ``tensor.split(split_size_or_sections, dim)``: views, queued like every view.
    """
    return tensor.split(split_size_or_sections, dim)


def chunk(input: Tensor, chunks: int, dim: int = 0) -> tuple[Tensor, ...]:
    """Attempts to split a tensor into the specified number of chunks. Each chunk is a view of the
    input tensor.

    ``input.chunk(chunks, dim)``: views, queued like every view.
    """
    return input.chunk(chunks, dim)


def unbind(input: Tensor, dim: int = 0) -> tuple[Tensor, ...]:
    """Removes a tensor dimension.

    ``input.unbind(dim)``: views, queued like every view.
    """
    return input.unbind(dim)


def tensor_split(input: Tensor, indices_or_sections: Any, dim: int = 0) -> tuple[Tensor, ...]:
    """Splits a tensor into multiple sub-tensors, all of which are views of ``input``, along
    dimension ``dim`` according to the indices or number of sections specified by
    ``indices_or_sections``.

    ``input.tensor_split(indices_or_sections, dim)``: views, queued like every view.
    """
    return input.tensor_split(indices_or_sections, dim)


def hsplit(input: Tensor, indices_or_sections: Any) -> tuple[Tensor, ...]:
    """Splits ``input``, a tensor with one or more dimensions, into multiple tensors horizontally
    according to ``indices_or_sections``.

    ``input.hsplit(indices_or_sections)``: views, queued like every view.
    """
    return input.hsplit(indices_or_sections)


def vsplit(input: Tensor, indices_or_sections: Any) -> tuple[Tensor, ...]:
    """Splits ``input``, a tensor with two or more dimensions, into multiple tensors vertically
    according to ``indices_or_sections``.

    ``input.vsplit(indices_or_sections)``: views, queued like every view.
    """
    return input.vsplit(indices_or_sections)


def dsplit(input: Tensor, indices_or_sections: Any) -> tuple[Tensor, ...]:
    """Splits ``input``, a tensor with three or more dimensions, into multiple tensors depthwise
    according to ``indices_or_sections``.

    ``input.dsplit(indices_or_sections)``: views, queued like every view.
    """
    return input.dsplit(indices_or_sections)


def diagonal(input: Tensor, offset: int = 0, dim1: int = 0, dim2: int = 1) -> Tensor:
    """Returns a partial view of ``input`` with its diagonal elements with respect to ``dim1``
    and ``dim2`` appended as a dimension at the end of the shape.

    ``input.diagonal(offset, dim1, dim2)``: a view, queued like every view.
    """
    return input.diagonal(offset, dim1, dim2)


def as_strided(
    input: Tensor, size: Sequence[int], stride: Sequence[int], storage_offset: int | None = None
) -> Tensor:
    """Create a view of an existing tensor ``input`` with specified ``size``, ``stride`` and
    ``storage_offset``.

    ``input.as_strided(size, stride, storage_offset)``: a view, queued like every view.
    """
    return input.as_strided(size, stride, storage_offset)


def broadcast_to(input: Tensor, size: Sequence[int]) -> Tensor:
    """Broadcasts ``input`` to the shape ``size``.

    ``input.broadcast_to(size)``: an expanded view, queued like every view.
    """
    return input.broadcast_to(size)


def detach(input: Tensor) -> Tensor:
    """Returns a new Tensor, detached from the current graph.

    ``input.detach()``: a view with requires_grad False, queued like every view.
    """
    return input.detach()


def broadcast_shapes(*shapes: Any) -> tuple[int, ...]:
    """torch.broadcast_shapes (a torch.Size there; a tensord.Size here)."""
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
    """Returns a 2-dimensional view of each input tensor with zero dimensions.

    Input tensors with two or more dimensions are returned as-is.  One tensor gives a tensor;
    several, or one list or tuple of them, give a tuple.  Views, queued like every view.
    """
    return _atleast(tensors, _at_least_2d)


def atleast_3d(*tensors: Any) -> Any:
    """Returns a 3-dimensional view of each input tensor with zero dimensions.

    Input tensors with three or more dimensions are returned as-is.  One tensor gives a tensor;
    several, or one list or tuple of them, give a tuple.  Views, queued like every view.
    """
    return _atleast(tensors, _at_least_3d)


# ---- complex views and torch's lazy bits ------------------------------------------------


def _tensor_argument(function: str, input: Any) -> Tensor:
    """torch's argument parser's refusal of a non-tensor ``input``, word for word."""
    if not isinstance(input, Tensor):
        raise errors.TensordTypeError(
            f"{function}(): argument 'input' (position 1) must be Tensor, not "
            f"{type(input).__name__}"
        )
    return input


def view_as_real(input: Tensor) -> Tensor:
    """Returns a view of ``input`` as a real tensor.

    For a complex tensor of size ``(m1, ..., mi)``, a real tensor of size ``(m1, ..., mi, 2)`` whose
    last dimension holds the real and imaginary parts.  A view on the same Storage, queued like
    every view.
    """
    return complex_function("view_as_real", input)


def view_as_complex(input: Tensor) -> Tensor:
    """Returns a view of ``input`` as a complex tensor.

    For a real tensor of size ``(m1, ..., mi, 2)``, a complex tensor of size ``(m1, ..., mi)`` whose
    last dimension held the real and imaginary parts.  A view on the same Storage, queued like every
    view.
    """
    return complex_function("view_as_complex", input)


def real(input: Tensor) -> Tensor:
    """Returns a new tensor containing real values of the ``input`` tensor.

    ``input.real``: a view of a complex tensor's real parts, or ``input`` itself if it is real.
    """
    return _tensor_argument("real", input).real


def imag(input: Tensor) -> Tensor:
    """Returns a new tensor containing imaginary values of the ``input`` tensor.

    ``input.imag``: a view of a complex tensor's imaginary parts.
    """
    return _tensor_argument("imag", input).imag


def conj(input: Tensor) -> Tensor:
    """Returns a view of ``input`` with a flipped conjugate bit.

    ``input.conj()``: no values change; ``input`` itself if it is not complex.
    """
    return _tensor_argument("conj", input).conj()


def conj_physical(input: Tensor) -> Tensor:
    """Computes the element-wise conjugate of the given ``input`` tensor.

    ``input.conj_physical()``: a copy on the server (Clone RPC), or ``input`` itself if it is not
    complex.
    """
    return _tensor_argument("conj_physical", input).conj_physical()


def conj_physical_(input: Tensor) -> Tensor:
    """In-place version of ``tensord.conj_physical``.

    ``input.conj_physical_()``: a copy of the conjugate into ``input`` on the server, queued with
    pipelining.
    """
    return _tensor_argument("conj_physical_", input).conj_physical_()


def resolve_conj(input: Tensor) -> Tensor:
    """Returns a new tensor with materialized conjugation if ``input``'s conjugate bit is set to
    True, else returns ``input``.

    ``input.resolve_conj()``: the new tensor is a copy made on the server (Clone RPC).
    """
    return _tensor_argument("resolve_conj", input).resolve_conj()


def resolve_neg(input: Tensor) -> Tensor:
    """Returns a new tensor with materialized negation if ``input``'s negative bit is set to True,
    else returns ``input``.

    ``input.resolve_neg()``: the new tensor is a copy made on the server (Clone RPC).
    """
    return _tensor_argument("resolve_neg", input).resolve_neg()


def is_conj(input: Tensor) -> bool:
    """Returns True if the ``input`` is a conjugated tensor, i.e. its conjugate bit is set to True.

    ``input.is_conj()``: metadata the SDK keeps, no RPC.
    """
    return _tensor_argument("is_conj", input).is_conj()


def is_neg(input: Tensor) -> bool:
    """Returns True if the ``input``'s negative bit is set to True.

    ``input.is_neg()``: metadata the SDK keeps, no RPC.
    """
    return _tensor_argument("is_neg", input).is_neg()
