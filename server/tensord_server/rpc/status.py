"""Domain errors -> gRPC status codes, read from the error classes (DESIGN.md, "Errors across the wire").

Handlers never pick a status code themselves: they let exceptions propagate and
the call's abort asks this module.  The facts come from :mod:`tensord.errors`, where
each class declares its status code: the SDK reads the same declarations back, so the
two directions cannot disagree.  Besides the status code, every error carries the
trailing metadata ``tensord-error-type`` (the Python built-in torch raises in the same
case, so the SDK can raise a subclass of it) and, for an error with machine-readable
facts (an out-of-memory's byte counts), ``tensord-error-details``.
"""

from __future__ import annotations

from typing import Any

import grpc
from tensord import errors
from tensord.protocol import ERROR_DETAILS_KEY, ERROR_TYPE_KEY


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The status code of an exception; INTERNAL for anything unexpected (a server bug)."""
    own = getattr(exc, "code", None)
    if isinstance(own, grpc.StatusCode):  # a handler's own abort(code, details)
        return own
    return grpc.StatusCode[errors.status_code_of(exc)]


def error_type_for(exc: BaseException) -> str:
    """The ``tensord-error-type`` trailer: the torch built-in, or the class's own name
    where the built-in would read back as another class (a limit's ResourceExhaustedError,
    which the SDK would otherwise take for the pool's OutOfMemoryError)."""
    return errors.type_name(exc)


def details_for(exc: BaseException) -> str:
    """The message the client sees: the exception's text, word for word."""
    text = str(exc)
    if isinstance(getattr(exc, "code", None), grpc.StatusCode):
        return text
    if errors.is_unexpected(exc):
        return f"{type(exc).__name__}: {text}"  # an unexpected error: say what it was
    return text


def trailers_for(exc: BaseException) -> tuple[tuple[str, str], ...]:
    """The trailing metadata of an error: its type, and its details when it has any."""
    details = errors.details_json(exc)
    if details:
        return ((ERROR_TYPE_KEY, errors.type_name(exc)), (ERROR_DETAILS_KEY, details))
    return ((ERROR_TYPE_KEY, errors.type_name(exc)),)


def error_fields(exc: BaseException) -> tuple[grpc.StatusCode, str, str, str]:
    """(status code, message, error type, details JSON): what an error's status and its
    trailers carry, as four values (a call channel's answer sends them so)."""
    return status_for(exc), details_for(exc), errors.type_name(exc), errors.details_json(exc)


def batch_error_fields(exc: BaseException) -> dict[str, Any]:
    """A failed Batch op's error as BatchResponse's fields: what a status and its trailers
    would carry for it."""
    return {
        "error_code": status_for(exc).value[0],
        "error_message": details_for(exc),
        "error_type": errors.type_name(exc),
        "error_details": errors.details_json(exc),
    }
