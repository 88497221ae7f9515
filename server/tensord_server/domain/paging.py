"""Pages of a listing, as google's API design has them (AIP-158): a size, a byte cap, opaque tokens.

A listing (ListNames, MemorySnapshot) answers at most ``page_size`` items -- 0 asks for
DEFAULT_PAGE_SIZE, more than MAX_PAGE_SIZE gets MAX_PAGE_SIZE -- and at most MAX_PAGE_BYTES
of answer whatever the size asks, so no answer a client leaves unread pins more than that.
The next page's token holds the place after the last item returned (a name; a segment's and
a block's address; a trace entry's sequence number), never an offset: an item that exists
for the whole listing is returned exactly once however others come and go meanwhile.

Tokens are opaque: the place, then an HMAC over it, the listing's kind and its scope (the
caller's tenant, the device) under a key of this server process.  A token this process did
not issue for this listing and this tenant is refused (INVALID_ARGUMENT) before it is
looked at, so a forged one can neither crash a listing nor move it into another scope.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
import struct
from collections.abc import Sequence

__all__ = ["MAX_PAGE_SIZE", "PageTokens", "page_size"]

from tensord.errors import InvalidArgumentError
from tensord.protocol import MAX_PAGE_SIZE

from tensord_server.domain.limits import MAX_PAGE_TOKEN_BYTES

# Items of one page when the request says 0...
DEFAULT_PAGE_SIZE = 1000
# ...and at most MAX_PAGE_SIZE (tensord.protocol), whatever it says.
# Bytes of one answer, items, token and framing together.
MAX_PAGE_BYTES = 1 << 20
# What an item of a repeated string field costs beside its bytes: the tag and a length
# (a varint of 2 bytes up to 16 KiB; every name is at most limits.MAX_STRING_BYTES).
ITEM_FRAMING_BYTES = 3
# Of the answer's bytes, its items may fill all but this: the next_page_token (at most a 4 KiB name, in
# base64, with its tag) and the answer's own field tags and lengths.
PAGE_FRAMING_BYTES = 8 << 10

_VERSION = 1
_MAC_BYTES = 16  # a truncated HMAC-SHA256: 128 bits, never guessed


def page_size(requested: int) -> int:
    """The items a page may hold for a request's ``page_size`` (AIP-158's rules)."""
    if requested < 0:
        raise InvalidArgumentError(f"page_size must be >= 0, got {requested}")
    if requested == 0:
        return DEFAULT_PAGE_SIZE
    return min(requested, MAX_PAGE_SIZE)


class PageTokens:
    """Issues and opens the page tokens of one server process (its key dies with it)."""

    __slots__ = ("_key",)

    def __init__(self) -> None:
        self._key = secrets.token_bytes(32)

    def issue(self, kind: str, scope: Sequence[str], place: bytes) -> str:
        """The token of the page after ``place`` in the listing ``kind`` over ``scope``."""
        body = bytes((_VERSION,)) + place
        mac = self._mac(kind, scope, body)
        return base64.urlsafe_b64encode(body + mac).decode().rstrip("=")

    def open(self, kind: str, scope: Sequence[str], token: str) -> bytes | None:
        """The place a token of this listing holds (None for "": the first page);
        InvalidArgumentError for any other string."""
        if not token:
            return None
        raw = _decode(token)
        if raw is None or len(raw) < 1 + _MAC_BYTES or raw[0] != _VERSION:
            raise _invalid()
        body, mac = raw[:-_MAC_BYTES], raw[-_MAC_BYTES:]
        if not hmac.compare_digest(mac, self._mac(kind, scope, body)):
            raise _invalid()
        return body[1:]

    def _mac(self, kind: str, scope: Sequence[str], body: bytes) -> bytes:
        digest = hmac.new(self._key, digestmod=hashlib.sha256)
        for part in (kind.encode(), *(s.encode() for s in scope), body):
            digest.update(struct.pack("!I", len(part)))  # length-prefixed: no two readings
            digest.update(part)
        return digest.digest()[:_MAC_BYTES]


def _decode(token: str) -> bytes | None:
    if len(token) > MAX_PAGE_TOKEN_BYTES or not token.isascii():
        return None
    try:
        return base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
    except (binascii.Error, ValueError):
        return None


def _invalid() -> InvalidArgumentError:
    return InvalidArgumentError(
        "invalid page_token: pass the next_page_token of the previous page of the same "
        "listing, or none for the first page"
    )
