"""The tensord error hierarchy, shared by the server and the SDK.

One class per gRPC status code.  Each also subclasses the built-in exception
torch raises in the same situation, so code written for torch (``except
RuntimeError``) keeps working against tensord.  The server raises these (and
the plain built-ins the layout engine raises, as torch does); one table in the
service maps them to status codes, and the SDK maps the codes back.
"""

from __future__ import annotations

from typing import ClassVar


class TensordError(Exception):
    """Base of every error tensord raises on purpose."""

    #: the gRPC status code name this error travels as
    status_code: ClassVar[str] = "UNKNOWN"


class NotFoundError(TensordError, LookupError):
    """An unknown or foreign handle, share token or name."""

    status_code = "NOT_FOUND"

    def __str__(self) -> str:  # LookupError's KeyError-style quoting is not wanted
        return str(self.args[0]) if self.args else ""


class SessionLostError(NotFoundError, RuntimeError):
    """A tensor of a session the server no longer has (it restarted, or the session expired).

    The tensor's data is gone with its session.  The client has opened a new
    session already: tensors made from now on work.
    """


class AlreadyExistsError(TensordError, ValueError):
    """A name that exists already (``client.put`` without ``overwrite=True``)."""

    status_code = "ALREADY_EXISTS"


class InvalidArgumentError(TensordError, ValueError):
    """A bad shape, dim, dtype or argument (torch raises ValueError)."""

    status_code = "INVALID_ARGUMENT"


class TensordRuntimeError(InvalidArgumentError, RuntimeError):
    """Invalid input for which torch raises RuntimeError (a non-viewable ``view``)."""


class TensordIndexError(InvalidArgumentError, IndexError):
    """Invalid input for which torch raises IndexError (a dim out of range)."""


class TensordTypeError(InvalidArgumentError, TypeError):
    """Invalid input for which torch raises TypeError."""


class TensordNotImplementedError(InvalidArgumentError, NotImplementedError):
    """An op torch has no kernel for with this dtype (uint16/32/64's "not implemented for")."""


class ResourceExhaustedError(TensordError, RuntimeError):
    """A pool, quota or limit is exhausted."""

    status_code = "RESOURCE_EXHAUSTED"


class OutOfMemoryError(ResourceExhaustedError):
    """The device pool cannot satisfy an allocation (torch.OutOfMemoryError)."""


class UnauthenticatedError(TensordError, PermissionError):
    """A server started with ``--auth-tokens`` got no token, or one it does not know.

    The token is ``connect(token=...)`` or ``$TENSORD_TOKEN``.
    """

    status_code = "UNAUTHENTICATED"


class PermissionDeniedError(TensordError, PermissionError):
    """A call this tenant may not make (resizing a Storage another tenant shared with it)."""

    status_code = "PERMISSION_DENIED"


class FailedPreconditionError(TensordError, RuntimeError):
    """The request needs something this server lacks (a device it does not own)."""

    status_code = "FAILED_PRECONDITION"


class UnavailableError(TensordError, ConnectionError):
    """No server answers at the address."""

    status_code = "UNAVAILABLE"


class InheritedClientError(FailedPreconditionError):
    """A client (or a tensor of it) used in a process forked from the one that connected it.

    The parent's session belongs to the parent: a child calls ``tensord.connect()``
    to get its own.
    """


class DeadlineExceededError(UnavailableError, TimeoutError):
    """The server did not answer within the client's ``timeout`` (a hung or overloaded server)."""

    status_code = "DEADLINE_EXCEEDED"


class InternalError(TensordError, RuntimeError):
    """A server-side bug; the server keeps serving."""

    status_code = "INTERNAL"
