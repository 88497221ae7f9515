"""torch's argument parser and its error texts, for the SDK's Tensor methods and factories.

Everything here reads arguments as torch's python_arg_parser and ATen's checks read them
(``f(2, 3)`` == ``f((2, 3))``, to()'s overloads, set_()'s, resize_()'s sizes, a 0-dim
tensor as an index or a narrow start) and raises torch's exception with torch's text,
before any request is built.  The layout engine's own errors (plain built-ins, as torch
raises them) become tensord's subclasses of the same built-ins inside ``with
torch_errors():``.  No RPC and no protobuf here.
"""

from __future__ import annotations

import builtins
import operator
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from tensord import dtypes, errors, protocol
from tensord._meta import TensorBase, UntypedStorage
from tensord.device import Device, device_name
from tensord.dtypes import DType
from tensord.layout import CONTIGUOUS_FORMAT, PRESERVE_FORMAT, Layout, strip_leading_ones
from tensord.memory_format import (
    is_memory_format,
    memory_format_name,
    no_positional_or_unknown,
    python_type_name,
)

#: a Python number, as torch's ``item()`` returns it
Number = builtins.bool | builtins.int | builtins.float | builtins.complex
#: an argument not given (torch's TypeError lists a None given)
UNSET: Any = object()
#: NumPy's own text when ``copy=False`` cannot be honoured (np.asarray(obj, copy=False))
NO_COPY_AVOIDED = "Unable to avoid copy while creating an array as requested."


# Python's number types as dtypes, as torch's argument parser reads them (dtype=float)
_PYTHON_TYPE_DTYPES: dict[type, DType] = {
    builtins.float: dtypes.float64,
    builtins.int: dtypes.int64,
    builtins.bool: dtypes.bool,
    builtins.complex: dtypes.complex128,
}


def as_dtype(value: Any) -> DType:
    """A tensord DType from a DType, a torch.dtype, a Python number type or a dtype name."""
    if isinstance(value, DType):
        return value
    if isinstance(value, type) and value in _PYTHON_TYPE_DTYPES:
        return _PYTHON_TYPE_DTYPES[value]
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.dtype):
        return dtypes.from_torch(value)
    if isinstance(value, str):
        with torch_errors():
            return dtypes.dtype_from_name(value)
    raise errors.TensordTypeError(f"expected a dtype, got {type(value).__name__}")


def is_dtype(value: Any) -> builtins.bool:
    torch = sys.modules.get("torch")
    if isinstance(value, type) and value in _PYTHON_TYPE_DTYPES:
        return True
    return isinstance(value, DType) or (torch is not None and isinstance(value, torch.dtype))


def is_number(value: Any) -> builtins.bool:
    return isinstance(
        value, (builtins.bool, builtins.int, builtins.float, builtins.complex, np.generic)
    )


def ints(values: Any) -> tuple[builtins.int, ...]:
    return tuple(operator.index(v) for v in values)


def shape_args(args: tuple[Any, ...]) -> tuple[builtins.int, ...]:
    """torch's ``f(2, 3)`` == ``f((2, 3))`` convention; NumPy ints accepted."""
    if len(args) == 1 and not isinstance(args[0], (builtins.int, np.integer)):
        return ints(args[0])
    return ints(args)


def require_args(method: str, parameter: str, args: tuple[Any, ...]) -> None:
    """torch's argument parser rejects ``x.permute()`` even where ``x.permute(())`` is valid."""
    if not args:
        raise errors.TensordTypeError(
            f'{method}() missing 1 required positional arguments: "{parameter}"'
        )


def check_limit(count: builtins.int, limit: str, what: str) -> None:
    """Refuse a call whose request would hold more than ``protocol.<limit>`` items (``what``
    tells them: "unbind() would return {} tensors"), before anything is sent or queued: the
    server refuses such a request, and a pipelined op it refuses fails at a later call."""
    bound = getattr(protocol, limit)  # read at each call: the protocol's value, not a copy
    if count > bound:
        raise errors.TensordRuntimeError(
            f"{what.format(count)}; the limit is {bound} (tensord.protocol.{limit})"
        )


def plain_index(key: Any) -> Any:
    """NumPy ints -> ints, so the layout engine sees what torch would."""

    def bound(value: Any) -> Any:
        # slice bounds: anything with __index__ (NumPy ints, 0-dim integer tensors), as Python's
        if isinstance(value, np.integer) or is_tensor(value):
            return operator.index(value)
        return value

    def one(item: Any) -> Any:
        if isinstance(item, np.integer):
            return builtins.int(item)
        if is_tensor(item) and item.ndim == 0:
            return _zero_dim_index(item)
        if isinstance(item, slice):
            return slice(*(bound(v) for v in (item.start, item.stop, item.step)))
        return item

    return tuple(one(i) for i in key) if isinstance(key, tuple) else one(key)


def _zero_dim_index(item: Any) -> Any:
    """A 0-dim tensor used as an index: an integer one (not uint8, which torch reads as a
    mask) is basic indexing by its value, a view; a float one is torch's IndexError; a
    bool/uint8 mask stays a tensor (advanced indexing, refused by the layout engine)."""
    dtype = dtype_of(item)
    if dtype.is_floating_point or dtype.is_complex:
        raise errors.TensordIndexError(
            "tensors used as indices must be long, int, byte or bool tensors"
        )
    if dtype is dtypes.bool or dtype is dtypes.uint8:
        return item
    return builtins.int(item.item())


class _TorchErrors:
    """Raise the layout engine's built-in errors as tensord's subclasses of the same built-ins.

    ``except RuntimeError`` still catches them, and so does ``except tensord.TensordError``,
    exactly as for the same error coming back from the server.  A class, not a generator
    context manager: every view enters one, and a generator per view cost microseconds.
    """

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any
    ) -> None:
        if exc is None or isinstance(exc, errors.TensordError):
            return
        ours = errors.from_builtin(exc)
        if ours is not None:
            raise ours from None


_TORCH_ERRORS = _TorchErrors()


def torch_errors() -> _TorchErrors:
    """``with torch_errors():`` the layout engine's errors as tensord's (see _TorchErrors)."""
    return _TORCH_ERRORS


T_DEPRECATED = (
    "The use of `x.T` on tensors of dimension other than 2 to reverse their shape is deprecated "
    "and it will throw an error in a future release. Consider `x.mT` to transpose batches of "
    "matrices or `x.permute(*torch.arange(x.ndim - 1, -1, -1))` to reverse the dimensions of a "
    "tensor."
)
IDENTITY_0D = "{} is deprecated on 0-D tensors. This function is the identity in these cases."
CONJ_0D = "{} is deprecated on 0-D tensors. Consider using x.conj()."
_WARNED: set[str] = set()


def warn_once(message: str) -> None:
    """A UserWarning, once per process, as torch's TORCH_WARN_ONCE."""
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, UserWarning, stacklevel=3)


def is_tensor(value: Any) -> builtins.bool:
    torch = sys.modules.get("torch")
    return isinstance(value, TensorBase) or (torch is not None and isinstance(value, torch.Tensor))


def is_ours(value: Any) -> builtins.bool:
    """Whether ``value`` is a tensord tensor (not torch's)."""
    return isinstance(value, TensorBase)


def dtype_of(value: Any) -> DType:
    dtype: DType = dtypes.canonical(value.dtype)
    return dtype


def is_integral(dtype: DType) -> builtins.bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype is dtypes.bool)


def narrow_start(start: Any) -> builtins.int:
    """narrow's Tensor start: a 0-dim integral tensor (its value).  mirrors ATen narrow_tensor."""
    if start.ndim != 0 or not is_integral(dtype_of(start)):
        raise errors.TensordRuntimeError("start must be an 0-dim integral Tensor.")
    return builtins.int(start.item())


# The sections one Split may list (Split.sections is an IntList, each at most this long).
MAX_SECTIONS = protocol.list_limit("IntList", "values")


def split_arg(value: Any, ndim: builtins.int) -> Any:
    """tensor_split's indices_or_sections as an int or a tuple of ints.  A tensor must be a
    long 0-dim (sections) or 1-dim (indices) tensor on the CPU; mirrors ATen tensor_split's
    checks and their order."""
    if isinstance(value, (builtins.int, np.integer)) and not isinstance(value, builtins.bool):
        return operator.index(value)
    if not is_tensor(value):
        return ints(value)
    if ndim == 0:
        raise errors.TensordRuntimeError(
            "tensor_split expected at least a 1-dimensional tensor, but got a tensor with 0 dims"
        )
    device = device_name(value.device)
    if device != "cpu":
        raise errors.TensordRuntimeError(
            f"tensor_split expected tensor_indices_or_sections to be on cpu, but it's on {device}"
        )
    dtype = dtype_of(value)
    if dtype is not dtypes.int64:
        raise errors.TensordRuntimeError(
            "tensor_split expected tensor_indices_or_sections to have dtype of long, but got "
            f"{dtype.scalar_type}"
        )
    if value.ndim not in (0, 1):
        raise errors.TensordRuntimeError(
            "tensor_split expected tensor_indices_or_sections to be a zero-dimensional or "
            f"one-dimensional tensor, but got a tensor with {value.ndim} dims"
        )
    values = value.tolist()
    return builtins.int(values) if value.ndim == 0 else tuple(builtins.int(v) for v in values)


def python_values(values: np.ndarray, dtype: DType) -> np.ndarray:
    # bfloat16 is an ml_dtypes scalar type; tolist()/item() should give Python floats.
    return values.astype(np.float32) if dtype is dtypes.bfloat16 else values


def keyword_memory_format(function: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """is_contiguous/contiguous: only the keyword memory_format (contiguous_format by
    default; torch refuses None there, unlike clone's)."""
    memory_format = kwargs.pop("memory_format", _DEFAULT)
    no_positional_or_unknown(function, args, kwargs)
    if memory_format is _DEFAULT:
        return CONTIGUOUS_FORMAT
    return memory_format_name(memory_format, function)


_DEFAULT = object()  # "no memory_format given", which None is not for these methods


# torch.Tensor.to's overloads: their positional and keyword parameters, and their text
_TO_OVERLOADS = (
    (4, ("device", "dtype", "non_blocking", "copy", "memory_format")),
    (3, ("dtype", "non_blocking", "copy", "memory_format")),
    (3, ("tensor", "non_blocking", "copy", "memory_format")),
)
_TO_SIGNATURES = (
    " * (torch.device device = None, torch.dtype dtype = None, bool non_blocking = False, "
    "bool copy = False, *, torch.memory_format memory_format = None)\n"
    " * (torch.dtype dtype, bool non_blocking = False, bool copy = False, *, "
    "torch.memory_format memory_format = None)\n"
    " * (Tensor tensor, bool non_blocking = False, bool copy = False, *, "
    "torch.memory_format memory_format = None)\n"
)


def to_memory_format(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """to()'s memory_format keyword (None: preserve_format), popped from kwargs.

    A value that is no memory format gets torch's argument parser's text: the one
    overload's complaint when only one could take these arguments, else the list.
    """
    memory_format = kwargs.get("memory_format")
    if memory_format is None or is_memory_format(memory_format):
        kwargs.pop("memory_format", None)
        return PRESERVE_FORMAT if memory_format is None else memory_format_name(memory_format, "to")
    plausible = [
        names
        for max_positional, names in _TO_OVERLOADS
        if len(args) <= max_positional and all(k in names for k in kwargs)
    ]
    if len(plausible) == 1:
        memory_format_name(memory_format, "to")  # raises
    given = [python_type_name(a) for a in args]
    # torch lists the keywords in its hash map's order; for one keyword that is no matter
    given += [f"{k}={python_type_name(v)}" for k, v in kwargs.items()]
    described = ", ".join(given) + (", " if not args else "")
    raise errors.TensordTypeError(
        f"to() received an invalid combination of arguments - got ({described}), but "
        f"expected one of:\n{_TO_SIGNATURES}"
    )


def split_node_device(device: Any) -> tuple[str, str] | None:
    """torch's ``"<worker>/<device>"`` form (``"b/cuda:1"``): (node, device) for a string
    naming a device of another node of a cluster, None for any other device."""
    if not isinstance(device, str) or "/" not in device:
        return None
    node, _, local = device.partition("/")
    if not node or not local or "/" in local:
        raise errors.TensordRuntimeError(
            f"Invalid device string: '{device}' (a device of another node is 'NODE/DEVICE')"
        )
    device_name(local)  # a malformed device: torch's RuntimeError, here
    return node, local


def parse_to(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, DType | None, builtins.bool]:
    """torch.Tensor.to's overloads -> (device or None, dtype or None, copy): the first
    overload whose parameters take the arguments' types, else torch's TypeError."""
    if len(args) > 4:
        raise errors.TensordTypeError(
            f"to() takes from 0 to 4 positional arguments but {len(args)} were given"
        )
    for _, names in _TO_OVERLOADS:
        bound = _bind_to(names[:-1], args, kwargs)  # memory_format is read before
        if bound is not None:
            break
    else:
        raise _to_invalid_combination(args, kwargs)
    other = bound.get("tensor")
    if other is not None:
        return other.device, dtypes.canonical(other.dtype), builtins.bool(bound.get("copy", False))
    device, dtype = bound.get("device"), bound.get("dtype")
    if device is not None:
        device_name(device)  # a malformed device string: torch's RuntimeError, here
    copy = builtins.bool(bound.get("copy", False))
    return device, (as_dtype(dtype) if dtype is not None else None), copy


def _bind_to(
    names: tuple[str, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any] | None:
    """The arguments bound to one of to()'s overloads, None where it does not take them:
    a parameter's type checked as torch's argument parser checks it (None for the optional
    device and dtype)."""
    if len(args) > len(names) or any(k not in names[len(args) :] for k in kwargs):
        return None
    bound = dict(zip(names, args, strict=False)) | kwargs
    if names[0] != "device" and names[0] not in bound:  # the 2nd and 3rd overloads' first
        return None
    for name, value in bound.items():
        if not _TO_PARAMETER_TAKES[name](value):
            return None
    return bound


def _takes_device(value: Any) -> builtins.bool:
    torch = sys.modules.get("torch")
    return (
        value is None
        or isinstance(value, (str, np.integer))
        or (isinstance(value, builtins.int) and not isinstance(value, builtins.bool))
        or (torch is not None and isinstance(value, torch.device))
    )


_TO_PARAMETER_TAKES: dict[str, Callable[[Any], builtins.bool]] = {
    "device": _takes_device,
    "dtype": lambda value: value is None or is_dtype(value),
    "tensor": lambda value: isinstance(value, TensorBase),
    "non_blocking": lambda value: isinstance(value, (builtins.bool, np.bool_)),
    "copy": lambda value: isinstance(value, (builtins.bool, np.bool_)),
}


def _parser_type_name(value: Any) -> str:
    """A value's type as torch's parser names it; tensord's dtypes and devices stand for torch's."""
    if isinstance(value, DType):
        return "torch.dtype"
    if isinstance(value, Device):
        return "torch.device"
    return "Tensor" if isinstance(value, TensorBase) else python_type_name(value)


def _to_invalid_combination(args: tuple[Any, ...], kwargs: dict[str, Any]) -> TypeError:
    """torch's text for to() arguments no overload takes (its _argDesc: a trailing ", "
    is cut only after positional arguments)."""
    given = "".join(f"{_parser_type_name(a)}, " for a in args)
    given += "".join(f"{k}={_parser_type_name(v)}, " for k, v in kwargs.items())
    if args:
        given = given[:-2]
    return errors.TensordTypeError(
        f"to() received an invalid combination of arguments - got ({given}), but "
        f"expected one of:\n{_TO_SIGNATURES}"
    )


def narrowing_index(key: Any, shape: tuple[builtins.int, ...]) -> builtins.bool:
    """Whether a valid basic index only selects and narrows (ints, one Ellipsis, slices of
    step 1 whose bounds are within the largest size): no new dim (None), no stride
    multiplied by a step, no number past the server's request bounds; its view may be
    elided."""
    items = key if isinstance(key, tuple) else (key,)
    largest = max(shape, default=0)

    def within(bound: Any) -> builtins.bool:
        return bound is None or (type(bound) is builtins.int and -largest <= bound <= largest)

    return sum(item is Ellipsis for item in items) <= 1 and all(
        type(item) is builtins.int
        or item is Ellipsis
        or (
            isinstance(item, slice)
            and item.step in (None, 1)
            and within(item.start)
            and within(item.stop)
        )
        for item in items
    )


def check_tensor_argument(method: str, name: str, value: Any) -> None:
    if not is_tensor(value):
        raise errors.TensordTypeError(
            f"{method}(): argument '{name}' (position 1) must be Tensor, not "
            f"{python_type_name(value)}"
        )


def resize_size(sizes: tuple[Any, ...]) -> list[builtins.int]:
    """resize_'s size argument as torch's parser reads it: ints, or one sequence of them
    (a 0-dim integer tensor counts as an int)."""
    if not sizes:
        raise errors.TensordTypeError('resize_() missing 1 required positional arguments: "size"')
    one = sizes[0]
    sequence = isinstance(one, Sequence) and not isinstance(one, str)
    if len(sizes) == 1 and not sequence and _as_size_int(one) is None:
        raise errors.TensordTypeError(
            "resize_(): argument 'size' (position 1) must be tuple of ints, not "
            f"{python_type_name(one)}"
        )
    values = one if len(sizes) == 1 and isinstance(one, Sequence) else sizes
    out = []
    for position, value in enumerate(values):
        number = _as_size_int(value)
        if number is None:
            raise errors.TensordTypeError(
                f"resize_(): argument 'size' failed to unpack the object at pos {position + 1} "
                f'with error "type must be tuple of ints,but got {python_type_name(value)}"'
            )
        out.append(number)
    return out


def _as_size_int(value: Any) -> builtins.int | None:
    if _is_int_like(value):
        return builtins.int(value)
    if is_ours(value) and value.ndim == 0 and is_integral(dtype_of(value)):
        return operator.index(value)
    return None


_SET_OVERLOADS = (
    " * ()\n"
    " * (torch.Storage source)\n"
    " * (torch.Storage source, int storage_offset, tuple of ints size, tuple of ints stride = None)\n"
    " * (Tensor source)\n"
    " * (Tensor source, int storage_offset, tuple of ints size, tuple of ints stride = None)\n"
)


class SetArgs(NamedTuple):
    """set_()'s arguments, as torch's parser bound them."""

    #: the tensor whose Storage the handle is to view (None: set_() empties it)
    source: Any
    #: the source was an UntypedStorage (torch's set_(storage) overloads)
    source_is_storage: builtins.bool
    storage_offset: builtins.int | None
    size: tuple[builtins.int, ...] | None
    stride: tuple[builtins.int, ...] | None


def parse_set(source: Any, storage_offset: Any, size: Any, stride: Any) -> SetArgs:
    """set_'s overloads, as torch's parser picks one (its TypeError when none fits)."""
    given = [a for a in (source, storage_offset, size, stride) if a is not UNSET]
    source, storage_offset, size, stride = (
        None if a is UNSET else a for a in (source, storage_offset, size, stride)
    )
    is_storage = isinstance(source, UntypedStorage) and source.tensor is not None
    fits = not given
    if isinstance(source, TensorBase) or is_storage:
        fits = (storage_offset is None and size is None and stride is None) or (
            _is_int_like(storage_offset)
            and _is_int_list(size)
            and (stride is None or _is_int_list(stride))
        )
    if not fits:
        got = ", ".join(python_type_name(a) for a in given)
        if isinstance(source, UntypedStorage):
            got = got.replace("UntypedStorage", "torch.storage.UntypedStorage", 1)
        raise errors.TensordTypeError(
            f"set_() received an invalid combination of arguments - got ({got}), but "
            "expected one of:\n" + _SET_OVERLOADS
        )
    if source is None:
        return SetArgs(None, False, None, None, None)
    owner = source.tensor if isinstance(source, UntypedStorage) else source
    if size is None:
        return SetArgs(owner, is_storage, None, None, None)
    return SetArgs(
        owner,
        is_storage,
        builtins.int(storage_offset),
        tuple(builtins.int(n) for n in size),
        None if stride is None else tuple(builtins.int(n) for n in stride),
    )


def _is_int_like(value: Any) -> builtins.bool:
    return isinstance(value, (builtins.int, np.integer)) and not isinstance(value, builtins.bool)


def _is_int_list(value: Any) -> builtins.bool:
    return isinstance(value, Sequence) and all(_is_int_like(n) for n in value)


def check_setitem_value(value: Any, dtype: DType, device_type: str) -> None:
    """torch's valueToTensor: a tensor, a Python (or NumPy integer) int, a bool, a float or a
    complex; NumPy float64/complex128 pass as subclasses of float/complex, other NumPy
    scalars, arrays, lists and tuples raise its TypeError."""
    if is_tensor(value) or isinstance(
        value, (builtins.bool, builtins.int, builtins.float, builtins.complex, np.integer)
    ):
        return
    place = "" if device_type == "cpu" else f"{device_type}."
    raise errors.TensordTypeError(
        f"can't assign a {python_type_name(value)} to a torch.{place}{dtype.scalar_type}Tensor"
    )


def check_setitem_shape(target: Layout, value_shape: Sequence[int], value_dtype: DType) -> None:
    """x[key] = value's shape check, as torch's copy_to makes it before any work (and the
    server again): value's leading 1s dropped, the rest must expand to the slice."""
    with torch_errors():
        Layout.contiguous(strip_leading_ones(tuple(value_shape))).expand(
            target.shape, type_name=dtypes.canonical(value_dtype).legacy_type
        )
