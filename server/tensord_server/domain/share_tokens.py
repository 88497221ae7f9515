"""Share tokens: a tensor handed from one session to another, a given number of times.

``share(uses=1, ttl=DEFAULT_SHARE_TTL_S)`` by default makes a token the first attach
consumes; with ``uses=N`` (or None: unlimited) it lasts that many attaches.  A token also
ends at its expiry (the reaper drops it), when its session revokes it, and with its
session.  While it lives it holds a reference on its Storage and counts against
``--max-handles-per-session`` with its session's handles.

A token is a capability (``secrets.token_urlsafe``, as a handle id): looked up by itself,
it attaches only within its tenant; a token of another tenant is NOT_FOUND, as if it did not
exist.  An ended token is remembered a while (at most MAX_ENDED_TOKENS, for
ENDED_TOKEN_MEMORY_S) so that its own tenant's attach says why it ended (used up, expired,
revoked, its session gone); to any other tenant it stays unknown.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from tensord.errors import NotFoundError

from tensord_server.domain.ops.context import Issued
from tensord_server.domain.sessions import Session, SessionManager, new_capability
from tensord_server.domain.storage import StorageRegistry, TensorRef
from tensord_server.pool import CountingLock

# A share token expires this long after share() unless it asks for another lifetime.
DEFAULT_SHARE_TTL_S = 300.0
# The longest ttl a share token may ask for (a token holds its Storage until it ends).
DEFAULT_MAX_SHARE_TTL_S = 86400.0
# Ended share tokens remembered, for an attach to say why a token no longer works: this
# many at most (the oldest forgotten first; ~300 bytes each) and for this long.
MAX_ENDED_TOKENS = 4096
ENDED_TOKEN_MEMORY_S = 3600.0
UNKNOWN_SHARE_TOKEN = "unknown share token"
TOKEN_EXPIRED = (
    "this share token expired: x.share(ttl=SECONDS) makes one that lives longer (at most "
    "the server's --max-share-ttl)"
)
TOKEN_REVOKED = "this share token was revoked by the session that shared it"
TOKEN_SESSION_ENDED = (
    "this share token ended with the session that shared it: a token lives only as long as "
    "that session (to keep a tensor beyond it, put() it under a name)"
)


def token_used_up(uses: int) -> str:
    """An attach's text for a token whose ``uses`` attaches were all made."""
    allowed = "its one attach" if uses == 1 else f"all {uses} of its attaches"
    return (
        f"this share token was already used ({allowed}): x.share(uses=N) makes one for N "
        "attaches, uses=None for any number until it expires"
    )


@dataclass(eq=False)
class ShareToken:
    """A live share token, guarded by the ShareTokens lock."""

    session: Session  # the issuing session (the token dies with it)
    ref: TensorRef  # holds one reference on ref.storage while the token lives
    uses_left: int | None  # attaches still allowed (None: unlimited)
    expires_at: float  # ShareTokens-clock time
    uses: int | None = None  # attaches it was made for (None: unlimited)


@dataclass(frozen=True)
class EndedToken:
    """Why a share token ended, told to its own tenant only."""

    tenant: str
    reason: str
    ended_at: float  # ShareTokens-clock time


class ShareTokens:
    """Every live share token of one server, and the ended ones remembered.  Thread-safe.

    Invariants (under ``_lock``): every token of ``_tokens`` is in its issuing session's
    set of ``_issued`` and holds one reference on its Storage; a token leaves both at
    once, remembered in ``_ended`` with why.  ``_ended`` is in ending order, oldest first.
    Lock order: this lock, then a session's lock (a share looks its handle up under it)."""

    def __init__(
        self,
        sessions: SessionManager,
        storages: StorageRegistry,
        *,
        ttl: float = DEFAULT_SHARE_TTL_S,
        max_ttl: float = DEFAULT_MAX_SHARE_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not ttl > 0:
            raise ValueError(f"the share token ttl must be > 0, got {ttl}")
        if not ttl <= max_ttl < math.inf:  # NaN and inf too
            raise ValueError(
                f"the share token ttl ({ttl:g}) must be at most --max-share-ttl "
                f"({max_ttl:g}), which must be finite"
            )
        self.sessions = sessions
        self.storages = storages
        self.ttl = ttl  # a token's lifetime unless share() asks for another
        self.max_ttl = max_ttl
        self._clock = clock
        # counts its waiters, as the session table's lock: the background compactor steps
        # aside while a request waits here
        self._lock = CountingLock()
        self._tokens: dict[str, ShareToken] = {}
        self._issued: dict[str, set[str]] = {}  # session id -> its live tokens (none: no entry)
        self._ended: collections.OrderedDict[str, EndedToken] = collections.OrderedDict()
        # a session's tokens count against --max-handles-per-session with its handles, and
        # end with it; expired tokens go each time the reaper wakes
        sessions.tokens_of = self.count_of
        sessions.end_listeners.append(self.session_ended)
        sessions.reapers.append(self.reap)

    def share(
        self, session: Session, handle: str, uses: int | None = 1, ttl: float | None = None
    ) -> tuple[str, float]:
        """A token for ``uses`` attaches (None: unlimited) within ``ttl`` seconds (None: the
        server's --share-ttl); returns it and its ttl."""
        if uses is not None and uses < 1:
            raise ValueError(f"a share token needs uses >= 1 (or unlimited), got {uses}")
        ttl = self.ttl if ttl is None else ttl
        if not ttl > 0:  # NaN too
            raise ValueError(f"a share token's ttl must be > 0 seconds, got {ttl}")
        if not ttl <= self.max_ttl:  # inf too: a token that never ends holds its Storage
            raise ValueError(
                f"a share token's ttl must be at most {self.max_ttl:g} seconds "
                f"(--max-share-ttl), got {ttl:g}"
            )
        token = new_capability()

        def counted() -> None:  # under the session's lock, as a handle is counted
            self._issued.setdefault(session.id, set()).add(token)

        with self._lock:
            ref = self.sessions.reference(session, handle, entry=counted)
            self._tokens[token] = ShareToken(session, ref, uses, self._clock() + ttl, uses=uses)
        return token, ttl

    def attach(self, session: Session, token: str) -> Issued:
        """A handle on the token's tensor, using one of its attaches: the last one ends it."""
        with self._lock:
            entry = self._tokens.get(token)
            if entry is None or entry.session.tenant != session.tenant:
                raise NotFoundError(self._ended_text(session, token))
            if entry.session.ended:  # its end listener has not dropped it yet
                raise NotFoundError(TOKEN_SESSION_ENDED)
            if self._clock() >= entry.expires_at:  # the reaper has not dropped it yet
                raise NotFoundError(TOKEN_EXPIRED)
            handle = self.sessions.register(session, entry.ref)
            dropped = None
            if entry.uses_left is not None:
                entry.uses_left -= 1
                if entry.uses_left == 0:
                    dropped = self._drop(token, token_used_up(entry.uses or 1))
        if dropped is not None:
            self.storages.decref(dropped.storage)  # the new handle keeps it alive
        return Issued(handle, entry.ref)

    def revoke(self, session: Session, token: str) -> bool:
        """End a token this session issued now; False when it had already ended (used up,
        expired, revoked) or is not this session's."""
        with self._lock:
            if token not in self._issued.get(session.id, ()):
                return False
            ref = self._drop(token, TOKEN_REVOKED)
        self.storages.decref(ref.storage)
        return True

    def count(self) -> int:
        """Live tokens, all sessions'."""
        with self._lock:
            return len(self._tokens)

    def count_of(self, session_id: str) -> int:
        """A session's live tokens, for the handle limit: read without the lock (one dict
        lookup); a session's own shares add them under its session's lock."""
        return len(self._issued.get(session_id, ()))

    def session_ended(self, session: Session) -> None:
        """A closed, reaped or shut down session's tokens end with it."""
        with self._lock:
            issued = list(self._issued.get(session.id, ()))
            refs = [self._drop(token, TOKEN_SESSION_ENDED) for token in issued]
        for ref in refs:
            self.storages.decref(ref.storage)

    def reap(self) -> None:
        """Drop every expired token, and forget ended ones remembered long enough."""
        with self._lock:
            now = self._clock()
            expired = [t for t, entry in self._tokens.items() if now >= entry.expires_at]
            refs = [self._drop(token, TOKEN_EXPIRED) for token in expired]
            ended = self._ended
            while ended:
                oldest = next(iter(ended.values()))
                if now - oldest.ended_at < ENDED_TOKEN_MEMORY_S:
                    break
                ended.popitem(last=False)
        for ref in refs:
            self.storages.decref(ref.storage)

    @property
    def lock_waiters(self) -> int:
        """Threads blocked on the lock now (the background compactor steps aside)."""
        return self._lock.waiting

    # -- internals (with the lock held) ---------------------------------------------

    def _drop(self, token: str, reason: str) -> TensorRef:
        """Unlink a live token, remembering why; returns the reference to drop."""
        entry = self._tokens.pop(token)
        issued = self._issued[entry.session.id]
        issued.discard(token)
        if not issued:
            del self._issued[entry.session.id]
        self._ended[token] = EndedToken(entry.session.tenant, reason, self._clock())
        if len(self._ended) > MAX_ENDED_TOKENS:
            self._ended.popitem(last=False)
        return entry.ref

    def _ended_text(self, session: Session, token: str) -> str:
        """Why ``token`` no longer attaches, if it was ``session``'s tenant's; else unknown
        (another tenant's token, ended or live, reads as one that never existed)."""
        ended = self._ended.get(token)
        if (
            ended is None
            or ended.tenant != session.tenant
            or self._clock() - ended.ended_at >= ENDED_TOKEN_MEMORY_S
        ):
            return UNKNOWN_SHARE_TOKEN
        return ended.reason
