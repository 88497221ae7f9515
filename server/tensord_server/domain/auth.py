"""Bearer-token authentication: the ``--auth-tokens`` file and the check of each call.

The file maps tokens to tenants, one per line::

    # comments and blank lines are ignored
    <token> <tenant>

A token is any run of non-blank characters (use at least 128 random bits, e.g.
``python -c "import secrets; print(secrets.token_urlsafe(32))"``); a tenant is a
name.  Several tokens may name one tenant.  Clients send
``authorization: Bearer <token>`` with every call.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping, Sequence
from pathlib import Path

from tensord.errors import UnauthenticatedError
from tensord.protocol import BEARER


def describe_tenant(tenant: str) -> str:
    """A tenant as error messages name it ("" is every client of a server without tokens)."""
    return f"tenant {tenant!r}" if tenant else "this server's (unnamed) tenant"


def parse_tokens(lines: Sequence[str]) -> dict[str, str]:
    """token -> tenant from the file's lines; ValueError naming the first bad line."""
    tokens: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        parts = text.split()
        if len(parts) != 2:
            raise ValueError(f"auth tokens line {number}: expected 'TOKEN TENANT'")
        token, tenant = parts
        if token in tokens:
            raise ValueError(f"auth tokens line {number}: a token appears twice")
        tokens[token] = tenant
    if not tokens:
        raise ValueError("the auth tokens file names no token")
    return tokens


def load_tokens(path: str | Path) -> dict[str, str]:
    return parse_tokens(Path(path).read_text().splitlines())


def tenant_of(tokens: Mapping[str, str], authorization: str | None) -> str:
    """The tenant of an ``authorization`` header; UnauthenticatedError when missing or wrong."""
    if not authorization:
        # what a first-time user needs: how the SDK (and the tensord commands) send a token
        raise UnauthenticatedError(
            "missing authorization metadata (Bearer token): this server requires a token; "
            "pass it as tensord.connect(token=...) or set $TENSORD_TOKEN"
        )
    if not authorization.startswith(BEARER):
        raise UnauthenticatedError("authorization must be 'Bearer <token>'")
    presented = authorization[len(BEARER) :].strip().encode()
    tenant = None
    for token, owner in tokens.items():  # compare with every token, in constant time each
        if hmac.compare_digest(token.encode(), presented):
            tenant = owner
    if tenant is None:
        raise UnauthenticatedError("invalid token")
    return tenant


def node_tenant(cluster_token: str | None, presented: str | None, tenant: str | None) -> str:
    """The tenant a node-to-node call acts for: the one it names, if it presents the
    cluster's secret; UnauthenticatedError when this node has none, or it is missing or
    wrong (a tenant's token never stands in for it)."""
    if cluster_token is None:
        raise UnauthenticatedError(
            "node call refused: this node has no cluster credential (--cluster-token-file)"
        )
    if not presented or not hmac.compare_digest(cluster_token.encode(), presented.encode()):
        raise UnauthenticatedError("node call refused: missing or invalid cluster credential")
    if tenant is None:
        raise UnauthenticatedError("node call refused: it names no tenant")
    return tenant


def load_cluster_token(path: str | Path, tenant_tokens: Mapping[str, str] | None) -> str:
    """The cluster's secret from its file (the first line, stripped); ValueError when it is
    empty, shorter than 16 characters, or one of the tenants' tokens."""
    lines = Path(path).read_text().splitlines()
    token = lines[0].strip() if lines else ""
    if len(token) < 16:
        raise ValueError("the cluster token file must hold a secret of at least 16 characters")
    if tenant_tokens is not None and token in tenant_tokens:
        raise ValueError("the cluster token must not be a tenant's token (--auth-tokens)")
    return token
