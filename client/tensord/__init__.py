"""tensord: tensors whose bytes live in a tensord server, used as if they were torch."""

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

__version__ = "0.1.0"

__all__ = [
    "FailedPreconditionError",
    "InternalError",
    "InvalidArgumentError",
    "NotFoundError",
    "OutOfMemoryError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "TensordError",
    "TensordIndexError",
    "TensordRuntimeError",
    "TensordTypeError",
    "UnauthenticatedError",
    "UnavailableError",
    "__version__",
]
