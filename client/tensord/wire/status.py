"""Failed calls -> tensord's exceptions: the wire's side of the error registry.

The classes and what each travels as are declared in :mod:`tensord.errors`; this
module only reads a failed call (its status code, its message, the
``tensord-error-type`` and ``tensord-error-details`` trailers) or a Batch answer's
failed op (the same four facts as fields) and asks the registry for the exception.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import grpc

from tensord import errors
from tensord import schema as pb
from tensord.protocol import ERROR_DETAILS_KEY, ERROR_TYPE_KEY

M = TypeVar("M")

# a BatchResponse's error_code (an int) -> the status code
_CODES_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


def error_class(code: grpc.StatusCode | None, error_type: str | None) -> type[errors.TensordError]:
    """The tensord exception class for a status code and ``tensord-error-type`` trailer."""
    return errors.error_class(None if code is None else code.name, error_type)


def error_from_rpc(
    err: grpc.RpcError, address: str | None = None, node: str | None = None
) -> errors.TensordError:
    """Turn a failed call into the matching tensord exception, keeping the server's message
    and details.  gRPC's own UNAVAILABLE (no server at ``address`` any more: no trailer)
    says so, gRPC's text after it; for the cluster's ``node`` it is a NodeLostError."""
    call = err if isinstance(err, grpc.Call) else None
    code = call.code() if call is not None else None
    message = (call.details() if call is not None else None) or str(err)
    trailers = _trailers(call)
    error_type = trailers.get(ERROR_TYPE_KEY)
    if code is grpc.StatusCode.UNAVAILABLE and node is not None and error_type is None:
        return node_lost(node, address or "?", message)
    if code is grpc.StatusCode.UNAVAILABLE and address is not None and error_type is None:
        message = (
            f"cannot reach the tensord server at {address}: is the server running? "
            f"(gRPC status UNAVAILABLE: {message})"
        )
    exc = errors.read_back(
        None if code is None else code.name,
        error_type,
        message,
        trailers.get(ERROR_DETAILS_KEY, ""),
    )
    exc.grpc_code = code  # type: ignore[attr-defined]  # kept for callers who want it
    return exc


def node_lost(node: str, address: str, why: str) -> errors.NodeLostError:
    """The error for a tensor on the cluster's ``node`` that no longer answers."""
    exc = errors.NodeLostError(
        f"node {node!r} of the cluster ({address}) is lost: its tensors are gone with it ({why})",
        node=node,
        address=address,
    )
    exc.grpc_code = grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]  # as below
    return exc


def error_from_answer(
    code_value: int, message: str, error_type: str, details: str
) -> errors.TensordError:
    """The exception of an error that arrived as four values (a status code's value, the
    message, the ``tensord-error-type`` and ``tensord-error-details`` texts): what a call
    channel's answer or a Batch's failed op carries instead of a status and its trailers."""
    code = _CODES_BY_VALUE.get(code_value)
    exc = errors.read_back(
        None if code is None else code.name, error_type or None, message, details
    )
    exc.grpc_code = code  # type: ignore[attr-defined]  # as error_from_rpc's
    return exc


def batch_error(response: pb.BatchResponse, message: str) -> errors.TensordError:
    """The exception of a Batch answer's failed op, with ``message`` as its text."""
    return error_from_answer(
        response.error_code, message, response.error_type, response.error_details
    )


def _trailers(call: grpc.Call | None) -> dict[str, str]:
    """The tensord keys of a failed call's trailing metadata, as text."""
    found: dict[str, str] = {}
    if call is not None:
        for key, value in call.trailing_metadata() or ():
            if key in (ERROR_TYPE_KEY, ERROR_DETAILS_KEY):
                found[key] = value.decode() if isinstance(value, bytes) else value
    return found


def is_own_deadline(err: grpc.RpcError) -> bool:
    """A DEADLINE_EXCEEDED gRPC itself raised here (this call's deadline passed), not a
    DeadlineExceededError the server sent (that one names its type in the trailer)."""
    return (
        isinstance(err, grpc.Call)
        and err.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        and ERROR_TYPE_KEY not in _trailers(err)
    )


def is_unimplemented(exc: errors.TensordError) -> bool:
    """Whether the call ``exc`` came from is one the server does not know (an older server)."""
    return getattr(exc, "grpc_code", None) is grpc.StatusCode.UNIMPLEMENTED


def call(fn: Callable[[], M]) -> M:
    """Run one gRPC call, raising tensord's exception instead of grpc.RpcError."""
    try:
        return fn()
    except grpc.RpcError as err:
        raise error_from_rpc(err) from None
