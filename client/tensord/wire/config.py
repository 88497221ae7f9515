"""What a connect() takes from its arguments, else the environment, else the defaults.

The server's address (``$TENSORD_ADDRESS``), the tenant's token (``$TENSORD_TOKEN``),
TLS (``$TENSORD_TLS``, ``$TENSORD_TLS_CA``) and the call deadline
(``$TENSORD_CALL_TIMEOUT``): each resolved once, at connect, into a plain value.
"""

from __future__ import annotations

import enum
import math
import numbers
import os

import grpc

from tensord.protocol import DEFAULT_ADDRESS
from tensord.wire.address import dial_address

ADDRESS_ENV = "TENSORD_ADDRESS"
TOKEN_ENV = "TENSORD_TOKEN"
# TLS without an argument: TENSORD_TLS_CA names a PEM file of root certificates (TLS on);
# TENSORD_TLS=1 turns TLS on with the system's roots.
TLS_ENV = "TENSORD_TLS"
TLS_CA_ENV = "TENSORD_TLS_CA"
_TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
# Every unary call's deadline, and how long a transfer may go without a chunk moving: a
# hung server then raises DeadlineExceededError instead of blocking its caller for ever.
# Not a total deadline for transfers: a 10 GiB download that keeps moving never ends early.
DEFAULT_CALL_TIMEOUT_S = 60.0
CALL_TIMEOUT_ENV = "TENSORD_CALL_TIMEOUT"
_NO_DEADLINE_WORDS = frozenset({"none", "off"})


class CallTimeoutFromEnv(enum.Enum):
    """``call_timeout``'s default: ``$TENSORD_CALL_TIMEOUT``, else 60 s."""

    FROM_ENV = "from $TENSORD_CALL_TIMEOUT, else 60 s"


CALL_TIMEOUT_FROM_ENV = CallTimeoutFromEnv.FROM_ENV


def resolve_address(address: str | None) -> str:
    """The address argument, else ``$TENSORD_ADDRESS``, else 127.0.0.1:50051, as gRPC dials
    it (:func:`dial_address`)."""
    return dial_address(address or os.environ.get(ADDRESS_ENV) or DEFAULT_ADDRESS)


def resolve_token(token: str | None) -> str | None:
    """The token argument, else ``$TENSORD_TOKEN``, else None (no authorization sent)."""
    return token or os.environ.get(TOKEN_ENV) or None


def _checked_call_timeout(value: float, source: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{source} must be a number of seconds or None, got {type(value).__name__}")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{source} must be a finite number of seconds > 0 (or None), got {value}")
    return float(value)


def resolve_call_timeout(call_timeout: float | CallTimeoutFromEnv | None) -> float | None:
    """The call_timeout argument, else ``$TENSORD_CALL_TIMEOUT``, else 60 s; None: no deadline.

    The variable holds seconds, or ``none`` (``off``) for no deadline.
    """
    if call_timeout is not CALL_TIMEOUT_FROM_ENV:
        return None if call_timeout is None else _checked_call_timeout(call_timeout, "call_timeout")
    raw = os.environ.get(CALL_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_CALL_TIMEOUT_S
    if raw.lower() in _NO_DEADLINE_WORDS:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(
            f"${CALL_TIMEOUT_ENV} must be a number of seconds or 'none', got {raw!r}"
        ) from None
    return _checked_call_timeout(seconds, f"${CALL_TIMEOUT_ENV}")


RootCertificates = bytes | str | os.PathLike[str]


def resolve_tls(
    tls: bool | None, root_certificates: RootCertificates | None
) -> grpc.ChannelCredentials | None:
    """Channel credentials for TLS, or None for a plaintext channel.

    ``root_certificates`` is PEM bytes or the path of a PEM file (else
    ``$TENSORD_TLS_CA``); giving roots turns TLS on.  ``tls=None`` means: on when
    roots are given or ``$TENSORD_TLS`` is set true, off otherwise.  Without roots
    the system's trusted roots check the server's certificate.
    """
    if root_certificates is None and tls is not False:
        root_certificates = os.environ.get(TLS_CA_ENV) or None
    if tls is None:
        wanted = os.environ.get(TLS_ENV, "").strip().lower() in _TRUE_WORDS
        tls = root_certificates is not None or wanted
    if not tls:
        if root_certificates is not None:
            raise ValueError("root_certificates given with tls=False")
        return None
    roots = root_certificates
    if roots is not None and not isinstance(roots, bytes):
        try:
            with open(roots, "rb") as f:
                roots = f.read()
        except OSError as exc:
            raise ValueError(
                f"cannot read root certificates {str(roots)!r}: {exc.strerror}"
            ) from None
    return grpc.ssl_channel_credentials(root_certificates=roots)
