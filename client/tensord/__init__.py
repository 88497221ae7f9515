"""tensord: tensors whose bytes live in a tensord server, used as if they were torch."""

from tensord.client import Client, cat, connect, stack
from tensord.errors import (
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    OutOfMemoryError,
    PermissionDeniedError,
    ResourceExhaustedError,
    TensordError,
    TensordIndexError,
    TensordRuntimeError,
    TensordTypeError,
    UnauthenticatedError,
    UnavailableError,
)
from tensord.tensor import Device, Size, Tensor

__version__ = "0.1.0"

__all__ = [
    "Client",
    "Device",
    "FailedPreconditionError",
    "InternalError",
    "InvalidArgumentError",
    "NotFoundError",
    "OutOfMemoryError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "Size",
    "Tensor",
    "TensordError",
    "TensordIndexError",
    "TensordRuntimeError",
    "TensordTypeError",
    "UnauthenticatedError",
    "UnavailableError",
    "__version__",
    "cat",
    "connect",
    "stack",
]
