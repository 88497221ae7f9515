"""tensord: tensors whose bytes live in a tensord server, used as if they were torch.

Every public name is imported on first use (PEP 562): ``import tensord`` costs next to
nothing, and a program that uses only ``tensord.errors`` or ``tensord.layout`` (the
server does) never loads gRPC or the SDK's wire.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

from tensord.protocol import VERSION

__version__ = VERSION

# Where each public name lives (imported, then kept here, at its first use).
# fmt: off
_LAZY: dict[str, tuple[str, ...]] = {
    "tensord._functions": (
        "adjoint", "as_strided", "atleast_1d", "atleast_2d", "atleast_3d", "broadcast_shapes",
        "broadcast_tensors", "broadcast_to", "chunk", "conj", "conj_physical", "conj_physical_",
        "detach", "diagonal", "dsplit", "flatten", "hsplit", "imag", "is_conj", "is_neg",
        "moveaxis", "movedim", "narrow", "permute", "ravel", "real", "reshape", "resolve_conj",
        "resolve_neg", "select", "split", "squeeze", "swapaxes", "swapdims", "t",
        "tensor_split", "transpose", "unbind", "unflatten", "unsqueeze", "view_as_complex",
        "view_as_real", "vsplit",
    ),
    "tensord._torch": (
        "as_torch", "set_torch_policy", "torch_policy",
    ),
    "tensord.client": (
        "Client", "cat", "connect", "stack",
    ),
    "tensord.device": (
        "Device", "Size",
    ),
    "tensord.dtypes": (
        "DType", "bfloat16", "bool", "cdouble", "cfloat", "complex64", "complex128", "double",
        "float", "float16", "float32", "float64", "half", "int", "int8", "int16", "int32",
        "int64", "long", "promote_types", "result_type", "short", "uint8", "uint16", "uint32",
        "uint64",
    ),
    "tensord.errors": (
        "AlreadyExistsError", "ClusterUnavailableError", "CopyCorruptedError",
        "DeadlineExceededError",
        "FailedPreconditionError", "InheritedClientError", "InternalError",
        "InvalidArgumentError", "NodeLostError", "NotFoundError", "OutOfMemoryError",
        "OwnedElsewhereError", "PermissionDeniedError", "ResourceExhaustedError",
        "SessionLostError", "SpillCorruptedError", "TensordError", "TensordIndexError",
        "TensordNotImplementedError", "TensordRuntimeError", "TensordTypeError",
        "UnauthenticatedError", "UnavailableError",
    ),
    "tensord.memory_format": (
        "MemoryFormat", "channels_last", "channels_last_3d", "contiguous_format",
        "preserve_format",
    ),
    "tensord.tensor": (
        "Tensor",
    ),
}
# fmt: on
_MODULE_OF = {name: module for module, names in _LAZY.items() for name in names}
# tensord.dtypes' names of dtypes (the rest of its names are functions and the type)
_DTYPE_NAMES = frozenset(_LAZY["tensord.dtypes"]) - {"DType", "promote_types", "result_type"}
# The public submodules (any submodule is reached as an attribute on first use).
_SUBMODULES = ("aio", "dtypes", "errors", "layout", "memory_format", "protocol", "schema")

if TYPE_CHECKING:  # what type checkers and the API reference read: the same names, eagerly
    from tensord import aio as aio
    from tensord import schema as schema
    from tensord._functions import (  # torch's module forms of the view ops: tensord.narrow, ...
        adjoint,
        as_strided,
        atleast_1d,
        atleast_2d,
        atleast_3d,
        broadcast_shapes,
        broadcast_tensors,
        broadcast_to,
        chunk,
        conj,
        conj_physical,
        conj_physical_,
        detach,
        diagonal,
        dsplit,
        flatten,
        hsplit,
        imag,
        is_conj,
        is_neg,
        moveaxis,
        movedim,
        narrow,
        permute,
        ravel,
        real,
        reshape,
        resolve_conj,
        resolve_neg,
        select,
        split,
        squeeze,
        swapaxes,
        swapdims,
        t,
        tensor_split,
        transpose,
        unbind,
        unflatten,
        unsqueeze,
        view_as_complex,
        view_as_real,
        vsplit,
    )
    from tensord._torch import as_torch, set_torch_policy, torch_policy
    from tensord.client import Client, cat, connect, stack
    from tensord.device import Device, Size
    from tensord.dtypes import (  # torch's dtype names: tensord.float32, tensord.bool, ...
        DType,
        bfloat16,
        bool,
        cdouble,
        cfloat,
        complex64,
        complex128,
        double,
        float,
        float16,
        float32,
        float64,
        half,
        int,
        int8,
        int16,
        int32,
        int64,
        long,
        promote_types,
        result_type,
        short,
        uint8,
        uint16,
        uint32,
        uint64,
    )
    from tensord.errors import (
        AlreadyExistsError,
        ClusterUnavailableError,
        CopyCorruptedError,
        DeadlineExceededError,
        FailedPreconditionError,
        InheritedClientError,
        InternalError,
        InvalidArgumentError,
        NodeLostError,
        NotFoundError,
        OutOfMemoryError,
        OwnedElsewhereError,
        PermissionDeniedError,
        ResourceExhaustedError,
        SessionLostError,
        SpillCorruptedError,
        TensordError,
        TensordIndexError,
        TensordNotImplementedError,
        TensordRuntimeError,
        TensordTypeError,
        UnauthenticatedError,
        UnavailableError,
    )
    from tensord.memory_format import (  # torch's memory formats: tensord.channels_last, ...
        MemoryFormat,
        channels_last,
        channels_last_3d,
        contiguous_format,
        preserve_format,
    )
    from tensord.tensor import Tensor


def __getattr__(name: str) -> object:
    module = _MODULE_OF.get(name)
    if module is not None:
        home = importlib.import_module(module)
        value = getattr(home, name)
        if name in _DTYPE_NAMES:
            # what x.dtype is: torch's own dtype once torch is imported (torch's arguments
            # take only those: torch.zeros(3, dtype=tensord.float32)), else the DType; never
            # kept, so an import of torch later is seen
            return home.public(value)
    elif not name.startswith("__") and importlib.util.find_spec(f"tensord.{name}") is not None:
        value = importlib.import_module(f"tensord.{name}")  # tensord.aio, tensord.layout, ...
    else:
        raise AttributeError(f"module 'tensord' has no attribute {name!r}")
    globals()[name] = value  # later lookups find it without this hook
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, *_SUBMODULES})


__all__ = [
    "AlreadyExistsError",
    "Client",
    "ClusterUnavailableError",
    "CopyCorruptedError",
    "DType",
    "DeadlineExceededError",
    "Device",
    "FailedPreconditionError",
    "InheritedClientError",
    "InternalError",
    "InvalidArgumentError",
    "MemoryFormat",
    "NodeLostError",
    "NotFoundError",
    "OutOfMemoryError",
    "OwnedElsewhereError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "SessionLostError",
    "Size",
    "SpillCorruptedError",
    "Tensor",
    "TensordError",
    "TensordIndexError",
    "TensordNotImplementedError",
    "TensordRuntimeError",
    "TensordTypeError",
    "UnauthenticatedError",
    "UnavailableError",
    "__version__",
    "adjoint",
    "as_strided",
    "as_torch",
    "atleast_1d",
    "atleast_2d",
    "atleast_3d",
    "bfloat16",
    "bool",
    "broadcast_shapes",
    "broadcast_tensors",
    "broadcast_to",
    "cat",
    "cdouble",
    "cfloat",
    "channels_last",
    "channels_last_3d",
    "chunk",
    "complex64",
    "complex128",
    "conj",
    "conj_physical",
    "conj_physical_",
    "connect",
    "contiguous_format",
    "detach",
    "diagonal",
    "double",
    "dsplit",
    "flatten",
    "float",
    "float16",
    "float32",
    "float64",
    "half",
    "hsplit",
    "imag",
    "int",
    "int8",
    "int16",
    "int32",
    "int64",
    "is_conj",
    "is_neg",
    "long",
    "moveaxis",
    "movedim",
    "narrow",
    "permute",
    "preserve_format",
    "promote_types",
    "ravel",
    "real",
    "reshape",
    "resolve_conj",
    "resolve_neg",
    "result_type",
    "select",
    "set_torch_policy",
    "short",
    "split",
    "squeeze",
    "stack",
    "swapaxes",
    "swapdims",
    "t",
    "tensor_split",
    "torch_policy",
    "transpose",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "unbind",
    "unflatten",
    "unsqueeze",
    "view_as_complex",
    "view_as_real",
    "vsplit",
]
