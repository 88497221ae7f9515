"""Sessions, their handle tables, share tokens, names, leases and the grace reaper.

Liveness: a session is *connected* while its lease has not lapsed (every call,
including the unary Heartbeat the SDK sends every lease/3, renews it) or while an
optional KeepAlive stream is open.  It is *lost* from
the moment its last stream ends without CloseSession (unless a later call
shows the client alive), or its lease lapses, whichever comes first; ``grace`` seconds later the reaper releases everything
it held.  OpenSession(resume_session_id=...) before then brings it back whole.

Locks: one lock guards the tables (sessions, tokens, names); each session's handle
table has a lock of its own too, taken after the tables' lock, so a Batch's run of
views and releases (``handle_run``) and every op on handles alone take only their
session's lock and one session's run never holds up another session (issue 15); renewing a lease (every call's session lookup,
Heartbeat) takes only a small lock of its own, never the tables' nor the registry's or
a pool's, so no compaction or long table operation can make a heartbeat late.

Share tokens: ``share(uses=1, ttl=DEFAULT_SHARE_TTL_S)`` by default makes a token
the first attach consumes; with ``uses=N`` (or None: unlimited) it lasts that many
attaches.  A token also ends at its expiry (the reaper drops it), when its session
revokes it, and with its session.  While it lives it holds a reference on its
Storage and counts against ``--max-handles-per-session``.

Handle ids and share tokens are capabilities (``secrets.token_urlsafe``), looked
up only in the table of the session presenting them: a foreign handle is as
unknown as a made-up one.  An ended share token is remembered a while (at most
MAX_ENDED_TOKENS, ENDED_TOKEN_MEMORY_S) so that its own tenant's attach says why it
ended (used up, expired, revoked, its session gone); to any other tenant it stays
unknown.

Tenants (``--auth-tokens``): every session belongs to the tenant its caller
authenticated as ("" without authentication).  A session, share token or name
of another tenant is NOT_FOUND, as if it did not exist.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import logging
import math
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from tensord.errors import (
    AlreadyExistsError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
)

from tensord_server.domain import paging
from tensord_server.domain.auth import describe_tenant
from tensord_server.domain.storage import RefCounts, StorageRegistry, TensorRef, check_in_bounds
from tensord_server.pool import CountingLock

log = logging.getLogger(__name__)

# The reaper wakes this often relative to the shortest of grace and lease, so a
# lost session is released at most ~25% late...
REAPER_INTERVAL_FRACTION = 0.25
# ...but never busier than every 20 ms nor lazier than every 1 s.
REAPER_MIN_INTERVAL_S = 0.02
REAPER_MAX_INTERVAL_S = 1.0

DEFAULT_GRACE_S = 30.0
# KeepAlive streams one session may hold open (the SDK holds one; a reconnect overlaps it).
MAX_STREAMS_PER_SESSION = 4
# Clients heartbeat every lease/3 (a unary Heartbeat), so two beats may be lost before it lapses.
DEFAULT_LEASE_S = 10.0
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


def new_capability() -> str:
    """An unguessable id (128 bits): handle ids and share tokens."""
    return secrets.token_urlsafe(16)


# A handle id a client chooses (pipelining, issue 15) has the shape of ours: 16 random
# bytes in URL-safe base64, so it is as hard to guess and no longer than a server's.
CHOSEN_ID_LENGTH = 22
_CHOSEN_ID_ALPHABET = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


def check_chosen_id(handle_id: str) -> None:
    """Refuse a client-chosen handle id that is not 22 URL-safe base64 characters."""
    if len(handle_id) != CHOSEN_ID_LENGTH or not _CHOSEN_ID_ALPHABET.issuperset(handle_id):
        raise InvalidArgumentError(
            f"a client-chosen handle id must be {CHOSEN_ID_LENGTH} characters of the URL-safe "
            f"base64 alphabet (16 random bytes, as secrets.token_urlsafe(16)); got "
            f"{handle_id[:32]!r}"
        )


def check_result_count(count: int, chosen: Sequence[str]) -> None:
    """A pipelined op names exactly one result handle per tensor it makes."""
    if len(chosen) != count:
        raise InvalidArgumentError(
            f"the op made {count} tensors but the batch named {len(chosen)} result handles"
        )


def _check_chosen_ids(chosen: Sequence[str], count: int) -> None:
    """Every chosen id well formed, one per result, none twice."""
    check_result_count(count, chosen)
    for handle_id in chosen:
        check_chosen_id(handle_id)
    if len(chosen) > 1 and len(set(chosen)) != len(chosen):
        raise AlreadyExistsError("a pipelined op names the same result handle twice")


def _check_not_ended(session: Session) -> None:
    """(under the session's lock) NotFoundError once the session ended: its end released
    its handles, and no change of its handles may come after it."""
    if session.ended:
        raise NotFoundError("unknown session")


def _check_not_live(session: Session, chosen: Sequence[str]) -> None:
    """No chosen id names a live handle of ``session`` (under the session's lock)."""
    for handle_id in chosen:
        if handle_id in session.handles:
            raise AlreadyExistsError(
                f"handle {handle_id[:8]!r}... is live in this session: a result id "
                "is never reused while it names a tensor"
            )


def _no_exports(session_id: str) -> int:
    """Live exports before any ExportTable exists: none."""
    return 0


@dataclass(eq=False)
class Session:
    """One client process's session.  ``last_seen``, ``streams`` and ``stream_ended_at``
    are guarded by the SessionManager's lease lock; ``handles`` and ``ended`` by ``lock``
    (taken after the table lock when both are held; an op on handles alone, a Batch's run
    included, holds ``lock`` only, so a call waiting for its session's run never holds
    the table lock meanwhile); ``tokens`` by the table lock (only this session's own calls
    add one, under ``lock`` too, so a run that counts them sees at most the real number)."""

    id: str
    client_name: str
    last_seen: float  # lease-clock time of the last call or heartbeat
    tenant: str = ""  # who authenticated it; its tokens and names are that tenant's
    handles: dict[str, TensorRef] = field(default_factory=dict)
    tokens: set[str] = field(default_factory=set)  # share tokens this session issued
    streams: int = 0  # open KeepAlive streams
    stream_ended_at: float | None = None  # when the last stream ended (None: none ended since)
    # the handle table's lock (issue 15: one session's Batch never waits for another's)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    ended: bool = False  # closed, reaped or shut down: its handles are released

    def lost_since(self, lease: float) -> float | None:
        """When the session lost its client (None while connected)."""
        if self.streams > 0:
            return None
        lapsed = self.last_seen + lease
        if self.stream_ended_at is not None:
            return min(lapsed, self.stream_ended_at)
        return lapsed


class HandleRun:
    """A run of a Batch's view registrations and releases (issue 15) under one acquisition
    of its session's lock (:meth:`SessionManager.handle_run`), the references counted and
    settled at its end: the checks of ``register_all`` and ``release``, without a lock
    acquisition and a hold per op.  Only for ops that touch no bytes: a view reads its
    input's metadata, never its Storage."""

    __slots__ = ("_counts", "_manager", "session")

    def __init__(self, manager: SessionManager, session: Session, counts: RefCounts) -> None:
        self._manager = manager
        self._counts = counts
        self.session = session

    def lookup(self, handle: str) -> TensorRef:
        return self._manager._lookup(self.session, handle)

    def check_room(self, wanted: int) -> None:
        self._manager.refuse_beyond_limit(self.session, wanted)

    def register(self, refs: Sequence[TensorRef], chosen: Sequence[str]) -> None:
        """Handles ``chosen`` (the client's ids) on ``refs``: all or none, as register_all."""
        for ref in refs:
            check_in_bounds(ref)
        _check_chosen_ids(chosen, len(refs))
        session = self.session
        self._manager.refuse_beyond_limit(session, len(refs))
        _check_not_live(session, chosen)
        for handle, ref in zip(chosen, refs, strict=True):
            self._counts.incref(ref.storage)
            session.handles[handle] = ref

    def release(self, handles: Sequence[str]) -> int:
        """Drop handles (unknown ones ignored, as release); the count dropped."""
        table, counts, dropped = self.session.handles, self._counts, 0
        for handle in handles:
            ref = table.pop(handle, None)
            if ref is not None:
                counts.decref(ref.storage)
                dropped += 1
        return dropped


class TenantNames:
    """One tenant's named tensors.  Guarded by the session manager's table lock."""

    __slots__ = ("order", "refs")

    def __init__(self) -> None:
        self.refs: dict[str, TensorRef] = {}  # name -> the tensor it keeps alive
        # the same names, sorted (code points: UTF-8's byte order): a page is a bisect away
        self.order: list[str] = []

    def add(self, name: str, ref: TensorRef) -> None:
        if name not in self.refs:
            bisect.insort(self.order, name)
        self.refs[name] = ref

    def pop(self, name: str) -> TensorRef | None:
        ref = self.refs.pop(name, None)
        if ref is not None:
            del self.order[bisect.bisect_left(self.order, name)]
        return ref


@dataclass(eq=False)
class ShareToken:
    """A share token's state, guarded by the SessionManager's table lock."""

    session_id: str  # the issuing session (the token dies with it)
    tenant: str
    ref: TensorRef  # holds one reference on ref.storage while the token lives
    uses_left: int | None  # attaches still allowed (None: unlimited)
    expires_at: float  # manager-clock time
    uses: int | None = None  # attaches it was made for (None: unlimited)


@dataclass(frozen=True)
class EndedToken:
    """Why a share token ended, told to its own tenant only."""

    tenant: str
    reason: str
    ended_at: float  # manager-clock time


class SessionManager:
    """Every session, share token and name of one server; the only owner of handle references."""

    def __init__(
        self,
        storages: StorageRegistry,
        *,
        grace: float = DEFAULT_GRACE_S,
        lease: float = DEFAULT_LEASE_S,
        max_handles: int | None = None,
        max_sessions: int | None = None,
        max_names: int | None = None,
        share_ttl: float = DEFAULT_SHARE_TTL_S,
        max_share_ttl: float = DEFAULT_MAX_SHARE_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # NaN and inf too: a NaN grace never reaps a lost session, and the lease goes to
        # every client, whose heartbeat waits a third of it
        if not (0 <= grace < math.inf and 0 < lease < math.inf):
            raise ValueError(
                f"grace must be >= 0 and lease > 0, both finite, got grace={grace}, lease={lease}"
            )
        if not share_ttl > 0:
            raise ValueError(f"the share token ttl must be > 0, got {share_ttl}")
        if not share_ttl <= max_share_ttl < math.inf:  # NaN and inf too
            raise ValueError(
                f"the share token ttl ({share_ttl:g}) must be at most --max-share-ttl "
                f"({max_share_ttl:g}), which must be finite"
            )
        self.max_share_ttl = max_share_ttl
        self.share_ttl = share_ttl  # a token's lifetime unless share() asks for another
        self.storages = storages
        self.grace = grace
        self.lease = lease
        self.max_handles = max_handles  # live handles per session (None: no limit)
        self.max_sessions = max_sessions  # open sessions per tenant (None: no limit)
        self.max_names = max_names  # named tensors per tenant (None: no limit)
        self._clock = clock
        # the table lock: the three dicts, handles and tokens; counts its waiters (a held()
        # waiting here may be behind a call waiting for the background compactor)
        self._lock = CountingLock()
        # the lease lock (taken after the table lock, never before): liveness fields, and
        # _sessions is changed under both so that a lookup needs only this one
        self._lease_lock = threading.Lock()
        self._sessions: dict[str, Session] = {}
        self._tokens: dict[str, ShareToken] = {}
        # ended tokens, oldest first (insertion order is ended_at order)
        self._ended_tokens: collections.OrderedDict[str, EndedToken] = collections.OrderedDict()
        self._names: dict[str, TenantNames] = {}  # tenant -> its names (none: no entry)
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None
        # called (without the lock) with each session that ended: closed, reaped or shut down
        self.end_listeners: list[Callable[[Session], None]] = []
        # a session's live exports (same-host zero copy), set by the ExportTable once made:
        # they count against --max-handles-per-session with its handles and share tokens
        self.exports_of: Callable[[str], int] = _no_exports

    # -- sessions -------------------------------------------------------------

    def open(
        self, client_name: str = "", resume_id: str = "", tenant: str = ""
    ) -> tuple[Session, bool]:
        """A new session, or the one ``resume_id`` names if it is still within its grace."""
        if resume_id:
            return self.get(resume_id, tenant), True
        now = self._clock()
        with self._lock:
            held = self._count_sessions(tenant)
            if self.max_sessions is not None and held >= self.max_sessions:
                raise ResourceExhaustedError(
                    f"{describe_tenant(tenant)} has {held} open sessions, the limit "
                    f"(--max-sessions-per-tenant {self.max_sessions}); close some (a lost one "
                    "ends after its lease and grace)"
                )
            session = Session(new_capability(), client_name, last_seen=now, tenant=tenant)
            with self._lease_lock:
                self._sessions[session.id] = session
            return session, False

    def get(self, session_id: str, tenant: str = "") -> Session:
        """The live session of a call (renewing its lease); NotFoundError otherwise.

        Takes the lease lock only: a heartbeat never waits on the tables or the pools."""
        with self._lease_lock:
            session = self._sessions.get(session_id)
            if session is None or session.tenant != tenant:
                raise NotFoundError("unknown session")
            session.last_seen = self._clock()
            # a call proves the client alive after its stream broke: it lives on its lease
            session.stream_ended_at = None
            return session

    def close(self, session: Session) -> int:
        """End a session now; returns how many handles it released."""
        with self._lock, session.lock:
            with self._lease_lock:
                if self._sessions.pop(session.id, None) is None:
                    raise NotFoundError("unknown session")
            released = len(session.handles)
            refs = self._end_session(session)
        self._decref_all(refs)
        self._notify_ended([session])
        return released

    def peek(self, session_id: str) -> Session | None:
        """A session by id without renewing its lease (for inspection), or None."""
        with self._lease_lock:
            return self._sessions.get(session_id)

    def session_ids(self) -> list[str]:
        with self._lease_lock:
            return list(self._sessions)

    def handle_count(self, session: Session) -> int:
        with session.lock:
            return len(session.handles)

    # -- liveness -----------------------------------------------------------------

    def stream_opened(self, session: Session) -> None:
        """A KeepAlive stream of ``session`` opened: connected until its last one ends.
        ResourceExhaustedError beyond MAX_STREAMS_PER_SESSION (one is all a client needs)."""
        with self._lease_lock:
            if session.streams >= MAX_STREAMS_PER_SESSION:
                raise ResourceExhaustedError(
                    f"session {session.id[:8]} has {session.streams} KeepAlive streams open, "
                    f"the limit ({MAX_STREAMS_PER_SESSION})"
                )
            session.streams += 1
            session.last_seen = self._clock()

    def stream_closed(self, session: Session) -> None:
        with self._lease_lock:
            session.streams -= 1
            if session.streams == 0:
                session.stream_ended_at = self._clock()

    def heartbeat(self, session: Session) -> None:
        with self._lease_lock:
            session.last_seen = self._clock()

    def is_lost(self, session: Session) -> bool:
        """Whether ``session`` has lost its client by now (it is released once the grace
        has passed too); read by the metrics, which split sessions into live and lost."""
        with self._lease_lock:
            lost = session.lost_since(self.lease)
            return lost is not None and lost <= self._clock()

    def reap(self) -> list[str]:
        """Release every session lost for longer than the grace, and every expired share
        token; returns the ids of the sessions."""
        refs: list[TensorRef] = []
        reaped: list[str] = []
        ended: list[Session] = []
        with self._lock:
            with self._lease_lock:
                now = self._clock()
                lost_sessions = []
                for session in list(self._sessions.values()):
                    lost = session.lost_since(self.lease)
                    if lost is not None and now - lost >= self.grace:
                        del self._sessions[session.id]
                        lost_sessions.append(session)
            for session in lost_sessions:
                with session.lock:
                    refs.extend(self._end_session(session))
                reaped.append(session.id)
                ended.append(session)
            for token, entry in list(self._tokens.items()):
                if now >= entry.expires_at:
                    refs.append(self._drop_token(token, TOKEN_EXPIRED))
            ended_tokens = self._ended_tokens
            while ended_tokens:
                oldest = next(iter(ended_tokens.values()))
                if now - oldest.ended_at < ENDED_TOKEN_MEMORY_S:
                    break
                ended_tokens.popitem(last=False)
        self._decref_all(refs)
        self._notify_ended(ended)
        for session_id in reaped:
            log.info("session %s lost for more than %.3gs: released", session_id[:8], self.grace)
        return reaped

    def start_reaper(self) -> None:
        if self._reaper is not None:
            return
        interval = min(self.grace, self.lease) * REAPER_INTERVAL_FRACTION
        interval = min(max(interval, REAPER_MIN_INTERVAL_S), REAPER_MAX_INTERVAL_S)

        def loop() -> None:
            while not self._stop.wait(interval):
                try:
                    self.reap()
                except Exception:  # keep reaping whatever one round hit
                    log.exception("session reaper")

        self._reaper = threading.Thread(target=loop, name="tensord-reaper", daemon=True)
        self._reaper.start()

    @property
    def lock_waiters(self) -> int:
        """Threads blocked on the table lock now (the background compactor steps aside)."""
        return self._lock.waiting

    def shutdown(self) -> None:
        """Stop the reaper and release every session, token and name (server shutdown)."""
        self._stop.set()
        if self._reaper is not None:
            self._reaper.join(timeout=5.0)
        with self._lock:
            refs: list[TensorRef] = []
            for session in self._sessions.values():
                with session.lock:
                    refs.extend(self._end_session(session))
            ended = list(self._sessions.values())
            with self._lease_lock:
                self._sessions.clear()
            for names in self._names.values():
                refs.extend(names.refs.values())
            self._names.clear()
        self._decref_all(refs)
        self._notify_ended(ended)

    # -- handles ------------------------------------------------------------------

    def register(self, session: Session, ref: TensorRef) -> str:
        """A new handle on ``ref`` in ``session`` (the caller has a hold on its Storage)."""
        return self.register_all(session, [ref])[0]

    def register_all(
        self, session: Session, refs: Sequence[TensorRef], chosen: Sequence[str] | None = None
    ) -> list[str]:
        """New handles on all of ``refs`` or, when the session has no room for all, none:
        a split or chunk refused halfway must not leave handles its client never learns.
        ``chosen``: the ids the client chose (a pipelined view, issue 15), checked as
        :meth:`rename` checks them; None: new random ids."""
        for ref in refs:
            check_in_bounds(ref)
        if chosen is not None:
            _check_chosen_ids(chosen, len(refs))
        return self._register_locked(session, refs, chosen)

    def _register_locked(
        self, session: Session, refs: Sequence[TensorRef], chosen: Sequence[str] | None = None
    ) -> list[str]:
        with session.lock:
            _check_not_ended(session)  # its end released its handles: none may come after it
            self.refuse_beyond_limit(session, len(refs))
            if chosen is None:
                handles = [new_capability() for _ in refs]
            else:
                _check_not_live(session, chosen)
                handles = list(chosen)
            for handle, ref in zip(handles, refs, strict=True):
                self.storages.incref(ref.storage)
                session.handles[handle] = ref
        return handles

    def rename(self, session: Session, issued: Sequence[str], chosen: Sequence[str]) -> None:
        """Give handles just issued in ``session`` the ids its client chose (a pipelined view,
        issue 15).  All or none: every chosen id must be well formed (``check_chosen_id``) and
        not live in the session.  A client-chosen id is a name in this session's table only."""
        _check_chosen_ids(chosen, len(issued))
        with session.lock:
            _check_not_ended(session)  # its end released the issued handles: nothing to rename
            _check_not_live(session, chosen)
            for old, new in zip(issued, chosen, strict=True):
                session.handles[new] = session.handles.pop(old)

    def flag_requires_grad(self, session: Session, handle: str) -> TensorRef:
        """The handle requires grad from now on (an in-place write of a value that did):
        whatever it names *now* is flagged under the lock, so a concurrent set_/resize_ of
        the same handle is never undone by a write that looked the handle up before it."""
        with session.lock:
            ref = self._lookup(session, handle)
            if not ref.requires_grad:
                ref = dataclasses.replace(ref, requires_grad=True)
                session.handles[handle] = ref  # same Storage: its count is unchanged
            return ref

    def replace(self, session: Session, handle: str, ref: TensorRef) -> TensorRef:
        """The handle names ``ref`` from now on (an in-place op changed what it names: set_,
        resize_, a write that made it require grad); other handles keep theirs.  Returns
        what it named before."""
        check_in_bounds(ref)
        with session.lock:
            old = self._lookup(session, handle)
            self.storages.incref(ref.storage)
            session.handles[handle] = ref
        self.storages.decref(old.storage)
        return old

    def check_room(self, session: Session, wanted: int) -> None:
        """Refuse now, before any work, what register_all would refuse for ``wanted`` handles."""
        with session.lock:
            self.refuse_beyond_limit(session, wanted)

    def lookup(self, session: Session, handle: str) -> TensorRef:
        with session.lock:
            return self._lookup(session, handle)

    @contextmanager
    def held(self, session: Session, *handles: str) -> Iterator[list[TensorRef]]:
        """The tensors of ``handles``, their Storages kept alive and in place (compaction
        never moves a held Storage) until the block ends."""
        with session.lock:
            refs = [self._lookup(session, h) for h in handles]
            self.storages.hold_all([ref.storage for ref in refs])
        try:
            yield refs
        finally:
            self.storages.release_holds([ref.storage for ref in refs])

    def hold(self, session: Session, handle: str) -> TensorRef:
        """The tensor of ``handle``, its Storage held (kept alive and in place) from the
        lookup on, under the session's lock as :meth:`held`, until the caller's
        ``storages.release_hold``: a hold that outlives the call (an export's)."""
        with session.lock:
            ref = self._lookup(session, handle)
            self.storages.hold(ref.storage)
        return ref

    @contextmanager
    def handle_run(self, session: Session) -> Iterator[HandleRun]:
        """One acquisition of the session's lock (not the table lock: another session's run
        never waits for it) for a run of a Batch's views and releases (issue 15); their
        references are settled under one short acquisition of the registry's lock before
        the session's lock goes, and blocks freed go back to their pools after both."""
        counts = self.storages.ref_counts()
        try:
            with session.lock:
                _check_not_ended(session)
                try:
                    yield HandleRun(self, session, counts)
                finally:  # the ops applied before a failed one keep their handles
                    counts.settle()
        finally:
            counts.give_back()

    def release(self, session: Session, handles: Sequence[str]) -> int:
        """Drop handles; unknown ones are ignored (the SDK may release twice). Returns the count."""
        refs = []
        with session.lock:
            for handle in handles:
                ref = session.handles.pop(handle, None)
                if ref is not None:
                    refs.append(ref)
        self._decref_all(refs)
        return len(refs)

    # -- sharing ------------------------------------------------------------------

    def share(
        self, session: Session, handle: str, uses: int | None = 1, ttl: float | None = None
    ) -> tuple[str, float]:
        """A token for ``uses`` attaches (None: unlimited) within ``ttl`` seconds (None: the
        server's --share-ttl); returns it and its ttl."""
        if uses is not None and uses < 1:
            raise ValueError(f"a share token needs uses >= 1 (or unlimited), got {uses}")
        ttl = self.share_ttl if ttl is None else ttl
        if not ttl > 0:  # NaN too
            raise ValueError(f"a share token's ttl must be > 0 seconds, got {ttl}")
        if not ttl <= self.max_share_ttl:  # inf too: a token that never ends holds its Storage
            raise ValueError(
                f"a share token's ttl must be at most {self.max_share_ttl:g} seconds "
                f"(--max-share-ttl), got {ttl:g}"
            )
        token = new_capability()
        with self._lock, session.lock:
            ref = self._lookup(session, handle)
            self.refuse_beyond_limit(session)
            self.storages.incref(ref.storage)
            expires_at = self._clock() + ttl
            self._tokens[token] = ShareToken(
                session.id, session.tenant, ref, uses, expires_at, uses=uses
            )
            session.tokens.add(token)
        return token, ttl

    def attach(self, session: Session, token: str) -> tuple[str, TensorRef]:
        """A handle on the token's tensor, using one of its attaches: the last one ends it."""
        with self._lock:
            entry = self._tokens.get(token)
            if entry is None or entry.tenant != session.tenant:
                raise NotFoundError(self._ended_token_text(session, token))
            if self._clock() >= entry.expires_at:  # the reaper has not dropped it yet
                raise NotFoundError(TOKEN_EXPIRED)
            (handle,) = self._register_locked(session, [entry.ref])
            dropped = None
            if entry.uses_left is not None:
                entry.uses_left -= 1
                if entry.uses_left == 0:
                    dropped = self._drop_token(token, token_used_up(entry.uses or 1))
        if dropped is not None:
            self.storages.decref(dropped.storage)  # the new handle keeps it alive
        return handle, entry.ref

    def revoke(self, session: Session, token: str) -> bool:
        """End a token this session issued now; False when it had already ended (used up,
        expired, revoked) or is not this session's."""
        with self._lock:
            if token not in session.tokens:
                return False
            ref = self._drop_token(token, TOKEN_REVOKED)
        self.storages.decref(ref.storage)
        return True

    def token_count(self) -> int:
        with self._lock:
            return len(self._tokens)

    def put_name(self, session: Session, name: str, handle: str, overwrite: bool) -> None:
        if not name:
            raise ValueError("a tensor name must not be empty")
        with self._lock, session.lock:
            ref = self._lookup(session, handle)
            names = self._names.get(session.tenant) or TenantNames()
            old = names.refs.get(name)
            if old is not None and not overwrite:
                raise AlreadyExistsError(f"name {name!r} already exists (pass overwrite=True)")
            if old is None and self.max_names is not None and len(names.refs) >= self.max_names:
                raise ResourceExhaustedError(
                    f"this tenant has {len(names.refs)} named tensors, the limit "
                    f"(--max-names-per-tenant {self.max_names}); delete some first"
                )
            self.storages.incref(ref.storage)
            names.add(name, ref)
            self._names[session.tenant] = names
        if old is not None:
            self.storages.decref(old.storage)

    def get_name(self, session: Session, name: str) -> tuple[str, TensorRef]:
        with self._lock:
            names = self._names.get(session.tenant)
            ref = names.refs.get(name) if names is not None else None
            if ref is None:
                raise NotFoundError(f"no tensor named {name!r}")
            self.storages.incref(ref.storage)  # a hold for register()
        try:
            return self.register(session, ref), ref
        finally:
            self.storages.decref(ref.storage)

    def delete_name(self, name: str, tenant: str = "") -> None:
        with self._lock:
            names = self._names.get(tenant)
            ref = names.pop(name) if names is not None else None
            if names is not None and not names.refs:
                del self._names[tenant]
        if ref is None:
            raise NotFoundError(f"no tensor named {name!r}")
        self.storages.decref(ref.storage)

    def tenant_session_count(self, tenant: str) -> int:
        with self._lock:
            return self._count_sessions(tenant)

    def names(self, tenant: str = "") -> list[str]:
        """All of a tenant's names, sorted (in-process callers; the wire pages them)."""
        with self._lock:
            names = self._names.get(tenant)
            return list(names.order) if names is not None else []

    def names_page(
        self, tenant: str, after: str | None, limit: int, max_bytes: int
    ) -> tuple[list[str], bool]:
        """A tenant's names sorted after ``after`` (None: from the first), at most ``limit``
        of them and at most ``max_bytes`` of UTF-8 plus paging.ITEM_FRAMING_BYTES each (at
        least one name however long: one fits any page); and whether more follow."""
        with self._lock:
            names = self._names.get(tenant)
            order = names.order if names is not None else []
            start = 0 if after is None else bisect.bisect_right(order, after)
            page: list[str] = []
            used = 0
            for name in order[start : start + limit]:
                used += len(name.encode()) + paging.ITEM_FRAMING_BYTES
                if used > max_bytes and page:
                    break
                page.append(name)
            return page, start + len(page) < len(order)

    # -- internals (call with the table lock held, and the session's lock for its handles,
    #    except _decref_all) --------------------------------------------------------

    def refuse_beyond_limit(self, session: Session, wanted: int = 1) -> None:
        """Refuse ``wanted`` more entries beyond ``--max-handles-per-session``: handles, share
        tokens (a token lives until its session ends) and exports are all entries the session
        keeps, counted together wherever one is added.  Takes no lock: a caller adding handles
        holds the session's lock, an Export the export table's (two such calls of one session
        at once may pass the limit by the other's ``wanted``, never more)."""
        if self.max_handles is None:
            return
        handles, tokens = len(session.handles), len(session.tokens)
        exports = self.exports_of(session.id)
        held = handles + tokens + exports
        if held + wanted > self.max_handles:
            raise ResourceExhaustedError(
                f"this session holds {handles} handles, {tokens} share tokens and {exports} "
                f"exports ({held} in all) and asked for {wanted} more, over the limit "
                f"(--max-handles-per-session {self.max_handles}); release some first"
            )

    def _count_sessions(self, tenant: str) -> int:
        return sum(1 for s in self._sessions.values() if s.tenant == tenant)

    def _lookup(self, session: Session, handle: str) -> TensorRef:
        ref = session.handles.get(handle)
        if ref is None:
            raise NotFoundError(f"unknown handle {handle[:8]!r}..." if handle else "empty handle")
        return ref

    def _end_session(self, session: Session) -> list[TensorRef]:
        """Unlink a session's handles and tokens and mark it ended (with its lock held too:
        a Batch's run that waited for it then finds it ended); the references to drop."""
        refs = list(session.handles.values())
        for token in session.tokens:
            entry = self._tokens.pop(token, None)
            if entry is not None:
                refs.append(entry.ref)
                self._remember_ended(token, entry, TOKEN_SESSION_ENDED)
        session.tokens.clear()
        session.handles.clear()
        session.ended = True
        return refs

    def _drop_token(self, token: str, reason: str) -> TensorRef:
        """Unlink a live token from the tables, remembering why; returns the reference to drop."""
        entry = self._tokens.pop(token)
        issuer = self._sessions.get(entry.session_id)
        if issuer is not None:
            issuer.tokens.discard(token)
        self._remember_ended(token, entry, reason)
        return entry.ref

    def _remember_ended(self, token: str, entry: ShareToken, reason: str) -> None:
        self._ended_tokens[token] = EndedToken(entry.tenant, reason, self._clock())
        if len(self._ended_tokens) > MAX_ENDED_TOKENS:
            self._ended_tokens.popitem(last=False)

    def _ended_token_text(self, session: Session, token: str) -> str:
        """Why ``token`` no longer attaches, if it was ``session``'s tenant's; else unknown
        (another tenant's token, ended or live, reads as one that never existed)."""
        ended = self._ended_tokens.get(token)
        if (
            ended is None
            or ended.tenant != session.tenant
            or self._clock() - ended.ended_at >= ENDED_TOKEN_MEMORY_S
        ):
            return UNKNOWN_SHARE_TOKEN
        return ended.reason

    def _decref_all(self, refs: list[TensorRef]) -> None:
        for ref in refs:
            self.storages.decref(ref.storage)

    def _notify_ended(self, sessions: list[Session]) -> None:
        for session in sessions:
            for listener in self.end_listeners:
                try:
                    listener(session)
                except Exception:  # one listener's failure must not keep the others' state
                    log.exception("session end listener")
