"""The one table that maps domain errors to gRPC status codes (DESIGN.md, "Errors across the wire").

Handlers never pick a status code themselves: they let exceptions propagate and
:func:`abort` looks the exception up here.  Besides the status code, every
error carries the trailing metadata ``tensord-error-type``: the Python built-in
torch raises in the same case, so the SDK can raise a subclass of it.
"""

from __future__ import annotations

import logging

import grpc
from tensord import errors

log = logging.getLogger(__name__)


# Exception class -> status code.  Order matters: the first row whose class the
# exception is an instance of wins, so subclasses come before their bases (the
# layout engine's plain built-ins come last: RuntimeError would also catch
# ResourceExhaustedError, FailedPreconditionError and InternalError).
STATUS_TABLE: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (errors.NotFoundError, grpc.StatusCode.NOT_FOUND),
    (errors.AlreadyExistsError, grpc.StatusCode.ALREADY_EXISTS),
    (errors.InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.ResourceExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.UnauthenticatedError, grpc.StatusCode.UNAUTHENTICATED),
    (errors.PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    (errors.FailedPreconditionError, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.DeadlineExceededError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.UnavailableError, grpc.StatusCode.UNAVAILABLE),
    (errors.InternalError, grpc.StatusCode.INTERNAL),
    # What the layout engine and dtype helpers raise, as torch does, for bad input.
    (IndexError, grpc.StatusCode.INVALID_ARGUMENT),
    (TypeError, grpc.StatusCode.INVALID_ARGUMENT),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (RuntimeError, grpc.StatusCode.INVALID_ARGUMENT),
)

# Bases that say nothing about the torch built-in (skipped when naming the error type).
_GENERIC_BASES = frozenset({BaseException, Exception, object})


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The status code of an exception; INTERNAL for anything unexpected (a server bug)."""
    own = getattr(exc, "code", None)
    if isinstance(own, grpc.StatusCode):  # a handler's own abort(code, details)
        return own
    for cls, code in STATUS_TABLE:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


def builtin_type_name(exc: BaseException) -> str:
    """The Python built-in torch would raise: the first built-in class in the MRO.

    ``TensordIndexError`` -> "IndexError", ``OutOfMemoryError`` -> "RuntimeError",
    a plain ``ValueError`` -> "ValueError".  Errors of our own that are not
    torch's built-ins name their first built-in base too (NotFoundError ->
    "LookupError"), so the trailer is always present and always a built-in.
    """
    for cls in type(exc).__mro__:
        # the most derived class's own built-in base wins: TensordRuntimeError is an
        # InvalidArgumentError (a ValueError) *and* a RuntimeError, and torch raises RuntimeError
        for candidate in (cls, *cls.__bases__):
            if candidate.__module__ == "builtins" and candidate not in _GENERIC_BASES:
                return candidate.__name__
    return "RuntimeError"


def error_type_for(exc: BaseException) -> str:
    """The ``tensord-error-type`` trailer: the torch built-in, except for limits.

    A quota or limit (a ResourceExhaustedError that is not the pool's
    OutOfMemoryError) names its own class, so the SDK raises
    ResourceExhaustedError rather than the OutOfMemoryError it assumes for
    RESOURCE_EXHAUSTED (``_rpc.error_class`` accepts a tensord class name whose
    status code matches).
    """
    if isinstance(exc, errors.ResourceExhaustedError) and not isinstance(
        exc, errors.OutOfMemoryError
    ):
        return "ResourceExhaustedError"  # the class name the SDK looks up
    return builtin_type_name(exc)


def details_for(exc: BaseException) -> str:
    """The message the client sees: the exception's text, word for word."""
    text = str(exc)
    if isinstance(getattr(exc, "code", None), grpc.StatusCode):
        return text
    if status_for(exc) is grpc.StatusCode.INTERNAL and not isinstance(exc, errors.InternalError):
        return f"{type(exc).__name__}: {text}"  # an unexpected error: say what it was
    return text
