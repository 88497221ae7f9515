"""torch's code takes tensord tensors: its functions, ``torch.nn.functional``, operators and methods.

A tensord Tensor is tensor-like to torch (``__torch_function__``): ``torch.add(x, 1)``,
``F.linear(x, w)``, ``x + 1``, ``x @ w``, ``x.sum()`` and ``x.exp()`` all come to :func:`call`,
which puts in each tensord tensor's place a torch tensor aliasing its pooled bytes (made by
the Tensor, once per Storage on the server's host, and reused), then lets torch compute.  So:

- an out-of-place result is an ordinary torch tensor, in this process's memory;
- an in-place op (``x.add_(1)``, ``x += 1``, ``out=x``) writes the pooled bytes, which every
  other process sees: torch answers with the alias, and ``x`` itself is returned;
- ``x == y`` compares elements, as torch's (a Tensor hashes by identity, as torch's).

tensord's own methods (views, ``to``, ``copy_``, indexing, ...) are not torch's: they keep
running on the server and give tensord tensors.

Without the server's memory mapped here (a remote client, ``local=False``) there is nothing
to alias.  By default torch's use of such a tensor raises FailedPreconditionError naming the
ways to compute; :func:`set_torch_policy` ``("download")`` opts in to computing on downloaded
copies, whose in-place results are uploaded back.  A multi-GiB download is never silent.

torch is imported at the first such use, never by ``import tensord``.
"""

from __future__ import annotations

import collections
import sys
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from tensord import dtypes, errors

#: what torch does with a tensord tensor that has no alias here (a remote client)
POLICIES = ("raise", "download")
_policy = {"value": "raise"}
_lock = threading.Lock()

NO_ALIAS = (
    "torch computes on a tensord tensor through an alias of its pooled bytes, which needs "
    "the server's memory mapped in this process (a client on the server's host, local not "
    "False){why}. Ways to compute: x.numpy() for a copy of the values (write a result back "
    "with x.copy_(result)); tensord.set_torch_policy('download') to let torch compute on "
    "downloaded copies (each use downloads the tensor; in-place results are uploaded back); "
    "or connect from the server's host"
)


NO_PARAMETER = (
    "a tensord tensor cannot be a torch.nn.Parameter (a Module's parameters are torch "
    "tensors): module.load_state_dict(tensord.as_torch(state), assign=True) gives the module "
    "torch aliases of the pooled bytes, and load_state_dict(state) without assign copies them"
)


def set_torch_policy(policy: str) -> None:
    """What torch does with a tensord tensor it cannot alias (no same-host mapping).

    ``"raise"`` (the default): FailedPreconditionError, saying how to compute instead.
    ``"download"``: torch computes on a downloaded copy of each such tensor, per use; an
    in-place op or ``out=`` uploads the result back into the pooled bytes.
    """
    if policy not in POLICIES:
        raise errors.InvalidArgumentError(
            f"set_torch_policy(): policy must be one of {', '.join(map(repr, POLICIES))}, "
            f"got {policy!r}"
        )
    with _lock:
        _policy["value"] = policy


def torch_policy() -> str:
    """The policy :func:`set_torch_policy` set (``"raise"`` by default)."""
    return _policy["value"]


def no_alias_error(why: str) -> errors.FailedPreconditionError:
    """The refusal of the ``"raise"`` policy, with ``why`` there is no alias."""
    return errors.FailedPreconditionError(NO_ALIAS.format(why=f" ({why})" if why else ""))


def load_torch() -> Any:
    """torch, imported now if it is not yet; a TypeError saying so where it is not installed."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return torch
    try:
        import torch
    except ImportError as missing:
        raise errors.TensordTypeError(
            "torch's math on tensord tensors needs torch (pip install torch); without it, "
            "compute on x.numpy() and write the result back with x.copy_(result)"
        ) from missing
    return torch


class TorchInterop:
    """What makes :class:`tensord.Tensor` tensor-like to torch (see the module's docstring)."""

    __slots__ = ()

    # torch.Tensor's own: NumPy's binary operators defer to the tensor's reflected ones
    __array_priority__ = 1000

    def __array_wrap__(self, array: Any, *context: Any) -> Any:
        """What NumPy makes of its result when torch left an operator to it (``x + array``):
        a torch tensor, as torch.Tensor's own ``__array_wrap__`` makes."""
        return call(load_torch().Tensor.__array_wrap__, (self, array), None)

    def _torch_alias(self) -> tuple[Any, bool]:
        """A torch tensor of this tensor's elements, and whether it is a downloaded copy
        (False: it aliases the pooled bytes).  The Tensor's."""
        raise NotImplementedError

    def _torch_written(self, alias: Any) -> None:
        """torch wrote ``alias``, a downloaded copy of this tensor: upload it back."""
        raise NotImplementedError

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        return call(func, args, kwargs)

    __hash__ = object.__hash__  # __eq__ is torch's elementwise one; hashing stays identity

    @property
    def _is_param(self) -> bool:
        # torch.nn.Parameter(data) marks a tensor-like ``data`` by setting this: a tensord
        # tensor cannot be one (a Module registers torch tensors only), so say what can
        return False

    @_is_param.setter
    def _is_param(self, value: bool) -> None:
        raise errors.TensordTypeError(NO_PARAMETER)

    if not TYPE_CHECKING:

        def __getattr__(self, name: str) -> Any:
            # only reached when normal lookup failed: costs nothing on tensord's own methods
            if name.startswith("_"):
                raise AttributeError(
                    f"'Tensor' object has no attribute {name!r}", name=name, obj=self
                )
            try:
                torch = load_torch()
            except TypeError as missing:
                raise AttributeError(
                    f"'Tensor' object has no attribute {name!r}: {missing}", name=name, obj=self
                ) from None
            member = getattr(torch.Tensor, name, None)
            if member is None:
                raise AttributeError(
                    f"'Tensor' object has no attribute {name!r}", name=name, obj=self
                )
            if callable(member):
                method = _method(member)
                # kept on the class: the next x.sum() is an ordinary method lookup
                setattr(type(self), name, method)
                return method.__get__(self, type(self))
            return call(getattr, (self, name), None)  # a data attribute: x.grad, x.is_leaf


def _method(member: Callable[..., Any]) -> Callable[..., Any]:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return call(member, (self, *args), kwargs)

    method.__name__ = getattr(member, "__name__", "method")
    method.__doc__ = f"torch.Tensor.{method.__name__}, computed by torch (tensord._torch)."
    return method


def _binary(name: str) -> Callable[[Any, Any], Any]:
    def operator(self: Any, other: Any) -> Any:
        return call(getattr(load_torch().Tensor, name), (self, other), None)

    operator.__name__ = name
    return operator


def _unary(name: str) -> Callable[[Any], Any]:
    def operator(self: Any) -> Any:
        return call(getattr(load_torch().Tensor, name), (self,), None)

    operator.__name__ = name
    return operator


# torch.Tensor's operators, each computed by torch's own (x < y falls back on y > x there too)
_BINARY = [
    "__add__",
    "__radd__",
    "__iadd__",
    "__sub__",
    "__rsub__",
    "__isub__",
    "__mul__",
    "__rmul__",
    "__imul__",
    "__truediv__",
    "__rtruediv__",
    "__itruediv__",
    "__floordiv__",
    "__rfloordiv__",
    "__ifloordiv__",
    "__mod__",
    "__rmod__",
    "__imod__",
    "__pow__",
    "__rpow__",
    "__ipow__",
    "__matmul__",
    "__rmatmul__",
    "__imatmul__",
    "__and__",
    "__rand__",
    "__iand__",
    "__or__",
    "__ror__",
    "__ior__",
    "__xor__",
    "__rxor__",
    "__ixor__",
    "__lshift__",
    "__rlshift__",
    "__ilshift__",
    "__rshift__",
    "__rrshift__",
    "__irshift__",
    "__lt__",
    "__le__",
    "__gt__",
    "__ge__",
    "__eq__",
    "__ne__",
    "__contains__",
]
_UNARY = ["__neg__", "__pos__", "__invert__", "__abs__"]
for _name in _BINARY:
    setattr(TorchInterop, _name, _binary(_name))
for _name in _UNARY:
    setattr(TorchInterop, _name, _unary(_name))


def _swap(value: Any, inputs: dict[int, tuple[Any, Any, bool]]) -> Any:
    """``value`` with each tensord tensor in it (also in a list or tuple) replaced by its
    torch tensor and each tensord dtype by torch's; ``inputs`` records the tensors."""
    if isinstance(value, TorchInterop):
        known = inputs.get(id(value))
        if known is None:
            alias, copied = value._torch_alias()
            inputs[id(value)] = known = (alias, value, copied)
        return known[0]
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        swapped = [_swap(item, inputs) for item in value]
        if all(new is old for new, old in zip(swapped, value, strict=True)):
            return value
        return swapped if isinstance(value, list) else tuple(swapped)
    if isinstance(value, dtypes.DType):
        return dtypes.to_torch(value)
    return value


def call(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> Any:
    """``func(*args, **kwargs)`` computed by torch on the aliases of the tensord tensors in
    the arguments; a result that is one of those aliases (an in-place op, ``out=``) comes
    back as its tensord tensor."""
    inputs: dict[int, tuple[Any, Any, bool]] = {}
    args = tuple(_swap(arg, inputs) for arg in args)
    if kwargs:
        kwargs = {key: _swap(value, inputs) for key, value in kwargs.items()}
        result = func(*args, **kwargs)
    else:
        result = func(*args)
    return _mapped(result, inputs)


def _mapped(result: Any, inputs: dict[int, tuple[Any, Any, bool]]) -> Any:
    for alias, tensor, copied in inputs.values():
        if result is alias:
            if copied:
                tensor._torch_written(alias)
            return tensor
    if (
        isinstance(result, tuple)
        and inputs
        and any(item is alias for item in result for alias, _, _ in inputs.values())
    ):
        items = [_mapped(item, inputs) for item in result]
        return type(result)(items) if hasattr(result, "n_fields") else tuple(items)
    return result


def as_torch(value: Any) -> Any:
    """torch tensors for tensord tensors: a Tensor's alias of its pooled bytes, or a mapping
    (a state dict) with each tensord tensor in it so replaced.

    For ``module.load_state_dict(tensord.as_torch(state), assign=True)``: a Module's
    parameters must be torch tensors, and these alias the pool, so the module computes on
    the pooled weights with no copy (on the server's host; elsewhere as
    :func:`set_torch_policy` says).  torch tensors and other values pass unchanged.
    """
    if isinstance(value, TorchInterop):
        return value._torch_alias()[0]
    if isinstance(value, Mapping):
        converted: collections.OrderedDict[Any, Any] = collections.OrderedDict()
        for key, item in value.items():
            converted[key] = item._torch_alias()[0] if isinstance(item, TorchInterop) else item
        metadata = getattr(value, "_metadata", None)  # load_state_dict reads its versions
        if metadata is not None:
            setattr(converted, "_metadata", metadata)  # noqa: B010
        return converted
    return value
