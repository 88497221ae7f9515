"""Sessions, their handle tables, leases and the grace reaper.

Liveness: a session is *connected* while its lease has not lapsed (every call,
including the unary Heartbeat the SDK sends every lease/3, renews it) or while an
optional KeepAlive stream is open.  It is *lost* from the moment its last stream ends
without CloseSession (unless a later call shows the client alive), or its lease lapses,
whichever comes first; ``grace`` seconds later the reaper releases everything it held.
OpenSession(resume_session_id=...) before then brings it back whole.

Locks: one lock guards the session table; each session's handle table has a lock of its
own, taken after the table's lock, so a Batch's run of views and releases
(``handle_run``) and every op on handles alone take only their session's lock and one
session's run never holds up another session's; renewing a lease (every call's session
lookup, Heartbeat) takes only a small lock of its own, never the table's nor the
registry's or a pool's, so no compaction or long table operation can make a heartbeat late.

A session keeps more than its handles: its share tokens
(:mod:`tensord_server.domain.share_tokens`) and its exports
(:mod:`tensord_server.domain.exports`) end with it (their tables listen for its end) and
count with its handles against ``--max-handles-per-session`` (:meth:`SessionManager.refuse_beyond_limit`).

Handle ids are capabilities (``secrets.token_urlsafe``), looked up only in the table of
the session presenting them: a foreign handle is as unknown as a made-up one.

Tenants (``--auth-tokens``): every session belongs to the tenant its caller
authenticated as ("" without authentication).  A session of another tenant is
NOT_FOUND, as if it did not exist.
"""

from __future__ import annotations

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


def new_capability() -> str:
    """An unguessable id (128 bits): handle ids and share tokens."""
    return secrets.token_urlsafe(16)


# A handle id a client chooses (a pipelined op's result) has the shape of ours: 16 random
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


def _none_kept(session_id: str) -> int:
    """Entries a session keeps in a table that keeps none (tokens, exports): none."""
    return 0


@dataclass(eq=False)
class Session:
    """One client process's session.  ``last_seen``, ``streams`` and ``stream_ended_at``
    are guarded by the SessionManager's lease lock; ``handles`` and ``ended`` by ``lock``
    (taken after the table lock when both are held; an op on handles alone, a Batch's run
    included, holds ``lock`` only, so a call waiting for its session's run never holds
    the table lock meanwhile)."""

    id: str
    client_name: str
    last_seen: float  # lease-clock time of the last call or heartbeat
    tenant: str = ""  # who authenticated it; its tokens and names are that tenant's
    handles: dict[str, TensorRef] = field(default_factory=dict)
    streams: int = 0  # open KeepAlive streams
    stream_ended_at: float | None = None  # when the last stream ended (None: none ended since)
    # the handle table's lock (one session's Batch never waits for another's)
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
    """A run of a Batch's view registrations and releases under one acquisition
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


class SessionManager:
    """Every session of one server and its handle table; the only owner of handle references."""

    def __init__(
        self,
        storages: StorageRegistry,
        *,
        grace: float = DEFAULT_GRACE_S,
        lease: float = DEFAULT_LEASE_S,
        max_handles: int | None = None,
        max_sessions: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # NaN and inf too: a NaN grace never reaps a lost session, and the lease goes to
        # every client, whose heartbeat waits a third of it
        if not (0 <= grace < math.inf and 0 < lease < math.inf):
            raise ValueError(
                f"grace must be >= 0 and lease > 0, both finite, got grace={grace}, lease={lease}"
            )
        self.storages = storages
        self.grace = grace
        self.lease = lease
        self.max_handles = max_handles  # live handles per session (None: no limit)
        self.max_sessions = max_sessions  # open sessions per tenant (None: no limit)
        self._clock = clock
        # the table lock: the session table; counts its waiters (a call waiting here may be
        # behind a call waiting for the background compactor)
        self._lock = CountingLock()
        # the lease lock (taken after the table lock, never before): liveness fields, and
        # _sessions is changed under both so that a lookup needs only this one
        self._lease_lock = threading.Lock()
        self._sessions: dict[str, Session] = {}
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None
        # called (without the lock) with each session that ended: closed, reaped or shut down
        self.end_listeners: list[Callable[[Session], None]] = []
        # called each time the reaper wakes, after it released the lost sessions (the share
        # tokens drop the expired ones)
        self.reapers: list[Callable[[], None]] = []
        # a session's live share tokens and exports, set by their tables: they count against
        # --max-handles-per-session with its handles
        self.tokens_of: Callable[[str], int] = _none_kept
        self.exports_of: Callable[[str], int] = _none_kept

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
        """Release every session lost for longer than the grace; returns their ids."""
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
                for reap in (self.reap, *self.reapers):
                    try:
                        reap()
                    except Exception:  # keep reaping whatever one round hit
                        log.exception("session reaper")

        self._reaper = threading.Thread(target=loop, name="tensord-reaper", daemon=True)
        self._reaper.start()

    @property
    def lock_waiters(self) -> int:
        """Threads blocked on the table lock now (the background compactor steps aside)."""
        return self._lock.waiting

    def shutdown(self) -> None:
        """Stop the reaper and release every session (server shutdown)."""
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
        ``chosen``: the ids the client chose (a pipelined view), checked as
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
        """Give handles just issued in ``session`` the ids its client chose (a pipelined view).
        All or none: every chosen id must be well formed (``check_chosen_id``) and
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
    def held(
        self, session: Session, *handles: str, restore: bool = True
    ) -> Iterator[list[TensorRef]]:
        """The tensors of ``handles``, their Storages kept alive and in place (compaction
        never moves a held Storage, nor does a spill) until the block ends; spilled ones
        restored to their devices first unless not ``restore`` (the caller reads no bytes:
        a view)."""
        with session.lock:
            refs = [self._lookup(session, h) for h in handles]
            self.storages.hold_all([ref.storage for ref in refs])
        try:
            # a spilled one comes back first (outside the session's lock: a restore may
            # allocate, and spill others to make room)
            if restore:
                self.storages.ensure_resident([ref.storage for ref in refs])
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
        try:
            self.storages.ensure_resident([ref.storage])  # spilled: back first
        except BaseException:
            self.storages.release_hold(ref.storage)
            raise
        return ref

    def reference(
        self, session: Session, handle: str, *, entry: Callable[[], None] | None = None
    ) -> TensorRef:
        """The tensor of ``handle`` with one more reference on its Storage, taken under the
        session's lock, for the caller to keep (a name's, a share token's) and drop with
        ``storages.decref``.  ``entry``: the caller records a new entry of the session (a
        share token) that counts against --max-handles-per-session: refused beyond the
        limit first, then recorded under the session's lock, as a handle is registered."""
        with session.lock:
            ref = self._lookup(session, handle)
            if entry is not None:
                self.refuse_beyond_limit(session)
            self.storages.incref(ref.storage)
            if entry is not None:
                entry()
        return ref

    @contextmanager
    def handle_run(self, session: Session) -> Iterator[HandleRun]:
        """One acquisition of the session's lock (not the table lock: another session's run
        never waits for it) for a run of a Batch's views and releases; their
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

    def tenant_session_count(self, tenant: str) -> int:
        with self._lock:
            return self._count_sessions(tenant)

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
        handles, tokens = len(session.handles), self.tokens_of(session.id)
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
        """Unlink a session's handles and mark it ended (with its lock held too: a Batch's
        run that waited for it then finds it ended); the references to drop."""
        refs = list(session.handles.values())
        session.handles.clear()
        session.ended = True
        return refs

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
