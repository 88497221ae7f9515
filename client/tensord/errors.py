"""The tensord error hierarchy, shared by the server and the SDK, and its one registry.

One class per gRPC status code.  Each also subclasses the built-in exception
torch raises in the same situation, so code written for torch (``except
RuntimeError``) keeps working against tensord.

Every fact about how an error travels is declared on its class, and both directions
of the wire read it from there (as google-api-core's exceptions do):

- ``status_code``: the gRPC status code (its name) the error travels as;
- ``bare_codes``: status codes that read back as this class when the answer names no
  class (a status gRPC itself sends);
- ``detail_fields``: machine-readable facts beside the text (an out-of-memory's byte
  counts), sent as JSON and set as attributes of the exception the SDK raises.

``__init_subclass__`` files each class in the registry as it is defined.  The server
turns an exception into ``(status_code_of(exc), type_name(exc), details_json(exc))``;
the SDK turns those three back into the same class with :func:`read_back`.  The type
name is the trailer ``tensord-error-type`` (:data:`tensord.protocol.ERROR_TYPE_KEY`):
the Python built-in torch raises in the same case, or the class's own name where the
built-in would read back as another class.  Pure: no gRPC here, so every layer of both
sides may import it.
"""

from __future__ import annotations

import builtins
import json
from typing import Any, ClassVar

# Bases that say nothing about the torch built-in (skipped when naming the error type).
_GENERIC_BASES = frozenset({BaseException, Exception, object})
# What an error that names no code of its own travels as: a server bug.
_UNEXPECTED = "INTERNAL"

# The registry, filled by TensordError.__init_subclass__.
# Every class by name: a trailer may name one precisely.
_BY_NAME: dict[str, type[TensordError]] = {}
# What a status code names when the answer names no class: the first class declaring the
# code, unless a later one claims it in ``bare_codes``.
_BY_STATUS: dict[str, type[TensordError]] = {}
# torch's built-ins for bad input -> our subclass of the same built-in (INVALID_ARGUMENT).
_BY_BUILTIN: dict[type[BaseException], type[TensordError]] = {}


class TensordError(Exception):
    """Base of every error tensord raises on purpose."""

    #: the gRPC status code name this error travels as
    status_code: ClassVar[str] = "UNKNOWN"
    #: status codes that read back as this class when the answer names no class
    bare_codes: ClassVar[tuple[str, ...]] = ()
    #: the machine-readable facts this error carries beside its text (keyword arguments
    #: of the constructor, attributes of the instance; None where not known)
    detail_fields: ClassVar[tuple[str, ...]] = ()

    def __init__(self, *args: object, **details: Any) -> None:
        super().__init__(*args)
        unknown = details.keys() - set(self.detail_fields)
        if unknown:
            raise TypeError(f"{type(self).__name__} has no detail {sorted(unknown)[0]!r}")
        for name in self.detail_fields:
            setattr(self, name, details.get(name))

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _BY_NAME[cls.__name__] = cls
        if "status_code" in vars(cls):
            _BY_STATUS.setdefault(cls.status_code, cls)
        for code in vars(cls).get("bare_codes", ()):
            _BY_STATUS[code] = cls
        if cls.status_code == "INVALID_ARGUMENT":
            for base in cls.__bases__:
                if base.__module__ == "builtins":
                    _BY_BUILTIN[base] = cls

    @property
    def details(self) -> dict[str, Any]:
        """The detail fields that are known, by name (empty for most errors)."""
        return {
            name: value
            for name in self.detail_fields
            if (value := getattr(self, name, None)) is not None
        }


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
    """The device pool cannot satisfy an allocation (torch.OutOfMemoryError).

    Beside torch's text, the pool's figures at the failure: ``device``, ``requested_bytes``
    (what the call asked for), ``capacity_bytes``, ``free_bytes``, ``allocated_bytes`` and
    ``reserved_bytes`` (None where the server did not say).
    """

    # a RESOURCE_EXHAUSTED naming no class (gRPC's own) reads as the pool's: memory is the
    # resource a client exhausts, and torch raises OutOfMemoryError there
    bare_codes = ("RESOURCE_EXHAUSTED",)
    detail_fields = (
        "device",
        "requested_bytes",
        "capacity_bytes",
        "free_bytes",
        "allocated_bytes",
        "reserved_bytes",
    )
    device: str | None
    requested_bytes: int | None
    capacity_bytes: int | None
    free_bytes: int | None
    allocated_bytes: int | None
    reserved_bytes: int | None


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


class OwnedElsewhereError(NotFoundError):
    """A name another node of the cluster owns: ``node`` (its ``--node-id``) and ``address``
    (where its clients connect) say which.  The SDK follows it once, to a session it opens
    on that node; code that talks to the wire itself can do the same."""

    detail_fields = ("node", "address")
    node: str | None
    address: str | None


class NodeLostError(UnavailableError):
    """A tensor (or name) on a node of the cluster that is gone: it stopped answering, or
    left the cluster.  The tensor's data went with it (Ray's OwnerDiedError); the other
    nodes, and what they hold, serve on.  ``node`` and ``address`` say which it was."""

    detail_fields = ("node", "address")
    node: str | None
    address: str | None


class ClusterUnavailableError(UnavailableError):
    """A cluster operation (a name, the node list) while the server cannot reach etcd.

    Local operations go on: tensors, views, copies and transfers on this node."""


class SpillCorruptedError(TensordError, RuntimeError):
    """The bytes of a Storage the server had spilled to a lower tier (its host buffer or
    its disk file) did not match their checksum when read back: ``storage_id`` names the
    Storage and ``tier`` the tier.  The server never hands out such bytes; the Storage stays
    where it is, unreadable, and everything else serves on."""

    status_code = "DATA_LOSS"
    detail_fields = ("storage_id", "tier")
    storage_id: str | None
    tier: str | None


class CopyCorruptedError(TensordError, RuntimeError):
    """A cross-node copy (``x.to("b/cpu")``) whose bytes as stored on the target node did
    not match the CRC-32 of the bytes the source node sent: ``node`` names the target.
    Nothing was kept there; the source is as it was."""

    status_code = "DATA_LOSS"
    detail_fields = ("node",)
    node: str | None


class InternalError(TensordError, RuntimeError):
    """A server-side bug; the server keeps serving."""

    status_code = "INTERNAL"
    # gRPC's own UNKNOWN: an exception that escaped a handler
    bare_codes = ("UNKNOWN",)


# ---- the wire, both directions -------------------------------------------------------


def from_builtin(exc: BaseException) -> TensordError | None:
    """The layout engine's built-in error (torch's type and text) as our subclass of the
    same built-in (IndexError -> TensordIndexError), or None for anything else."""
    for cls in type(exc).__mro__:
        ours = _BY_BUILTIN.get(cls)
        if ours is not None:
            return ours(str(exc))
    return None


def _travels_as(cls: type[BaseException]) -> str:
    if issubclass(cls, TensordError):
        return _UNEXPECTED if cls.status_code == "UNKNOWN" else cls.status_code
    return "INVALID_ARGUMENT" if any(c in _BY_BUILTIN for c in cls.__mro__) else _UNEXPECTED


def status_code_of(exc: BaseException) -> str:
    """The status code (its name) ``exc`` travels as: its class's for ours,
    INVALID_ARGUMENT for torch's built-ins of bad input, INTERNAL for anything else."""
    return _travels_as(type(exc))


def is_unexpected(exc: BaseException) -> bool:
    """An exception that is no error of ours nor bad input: a bug (its text says its type)."""
    return not isinstance(exc, TensordError) and _travels_as(type(exc)) == _UNEXPECTED


def builtin_name(cls: type[BaseException]) -> str:
    """The Python built-in torch would raise: the first built-in class in the MRO.

    ``TensordIndexError`` -> "IndexError", ``OutOfMemoryError`` -> "RuntimeError", a plain
    ``ValueError`` -> "ValueError"; errors of our own that are not torch's name their first
    built-in base too (NotFoundError -> "LookupError").
    """
    for klass in cls.__mro__:
        # the most derived class's own built-in base wins: TensordRuntimeError is an
        # InvalidArgumentError (a ValueError) *and* a RuntimeError, and torch raises RuntimeError
        for candidate in (klass, *klass.__bases__):
            if candidate.__module__ == "builtins" and candidate not in _GENERIC_BASES:
                return candidate.__name__
    return "RuntimeError"


def type_name(exc: BaseException) -> str:
    """The ``tensord-error-type`` trailer of ``exc``: the built-in torch raises, or our
    class's own name where that built-in would read back as another class (a limit's
    ResourceExhaustedError, which RESOURCE_EXHAUSTED with "RuntimeError" reads as the
    pool's OutOfMemoryError)."""
    cls = type(exc)
    name = builtin_name(cls)
    if isinstance(exc, TensordError) and error_class(_travels_as(cls), name) is not cls:
        return cls.__name__
    return name


def details_json(exc: BaseException) -> str:
    """The detail fields of ``exc`` as one JSON object ("" when it carries none)."""
    details = exc.details if isinstance(exc, TensordError) else {}
    return json.dumps(details, sort_keys=True, separators=(",", ":")) if details else ""


def error_class(status: str | None, type_name: str | None) -> type[TensordError]:
    """The class of an error that arrived as ``status`` (a status code's name; None: no
    status) with ``type_name`` (the ``tensord-error-type`` trailer, or None)."""
    base = _BY_STATUS.get(status, TensordError) if status else TensordError
    named = _BY_NAME.get(type_name or "")
    if named is not None and _travels_as(named) == _travels_as(base):
        return named
    if base.status_code == "INVALID_ARGUMENT":
        builtin = getattr(builtins, type_name or "", None)
        ours = _BY_BUILTIN.get(builtin) if isinstance(builtin, type) else None
        return ours or base
    return base


def read_back(
    status: str | None, type_name: str | None, message: str, details: str = ""
) -> TensordError:
    """The exception the SDK raises for an error that arrived as these: its class from
    ``status`` and ``type_name``, its text ``message``, its detail fields from ``details``
    (JSON; fields the class does not declare, or a malformed text, are ignored: a detail
    never keeps the error itself from being raised)."""
    cls = error_class(status, type_name)
    known: dict[str, Any] = {}
    if details and cls.detail_fields:
        try:
            parsed = json.loads(details)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            known = {k: v for k, v in parsed.items() if k in cls.detail_fields}
    return cls(message, **known)


def registered() -> dict[str, type[TensordError]]:
    """Every error class of the registry, by name (tests walk them all)."""
    return dict(_BY_NAME)
