"""Same-host zero copy, the server's books: exports of Storages, tickets, channel keys.

An *export* is a hold on a Storage, kept for a client that maps its segment: while
it lives the Storage never moves (compaction skips held Storages) and stays
charged to its tenant.  It ends by ReleaseExports or with its session (a crashed
client's after the grace, through the session's end listeners).

The descriptor of a segment (a memfd, :mod:`tensord_server.devices.shm`) is handed out
(by the fd socket, :mod:`tensord_server.rpc.fd_socket`) to whoever presents a *ticket*'s
key: 192 random bits (a key the client sends and a proof the server answers with), usable
once, for one segment, for :data:`TICKET_TTL_S`, issued only to a session that exported a
Storage of that segment.  Segments are never shared between tenants (each tenant allocates
on its own pool stream, see :meth:`StorageRegistry.stream_of`), so a ticket never reveals
another tenant's byte.

Each session may have a *call channel* on the same socket: OpenSession answers the
session's channel key (a locator, 192 secret bits and a proof, one per session, kept here
beside the session), and a connection that presents locator and secret is bound to that
session and carries its unary calls.  At most :data:`MAX_CHANNELS` channels are served at
once (with tenants, at most :data:`MAX_CHANNELS_PER_TENANT` of them one tenant's) and one
per session (a second bind of a session replaces its first); the session's end drops its
key and closes its channel.
This table keeps the keys and the bound channels; the socket's side (reading frames,
sending descriptors, the idle close) is the rpc layer's transport.

GPU segments (raw ``cudaMalloc``) are exported by their CUDA IPC handle instead
(:meth:`CudaBackend.ipc_export`, after the server stream is synchronized).  An
Export of a GPU Storage counts as an *import* of its segment by the session until
the client reports the handle closed (ReleaseExports' ``closed_imports``) or the
session ends; the segment's pool never returns a segment with imports to the device
(:meth:`ExportTable.segment_releasable`, the pool's veto): CUDA requires the
allocation to outlive every process that opened it.
"""

from __future__ import annotations

import collections
import contextlib
import hmac
import itertools
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Container, Iterator
from dataclasses import dataclass, field

from tensord.errors import FailedPreconditionError, NotFoundError, ResourceExhaustedError
from tensord.protocol import split_ticket

from tensord_server.devices.cuda import CudaBackend
from tensord_server.devices.memory import DeviceMemory
from tensord_server.devices.shm import SharedHostBackend
from tensord_server.domain.sessions import Session, SessionManager
from tensord_server.domain.storage import Storage, StorageRegistry, TensorRef
from tensord_server.pool import CachingPool

# A ticket must be redeemed this soon after its Export (the SDK does it at once).
TICKET_TTL_S = 30.0
# Unredeemed tickets kept at most (the oldest are dropped beyond it): bounds the table
# whatever a client does with its Exports.
MAX_TICKETS = 4096
# Call channels served at once, the whole server (a bound connection each, a descriptor and a
# coroutine, and a replaced one still finishing its call: it counts until it ends, else
# rebinding a session whose calls wait, on its session's lock say, would hold a connection
# per bind); a bind beyond it is refused ("no: ...") and its client keeps using gRPC.  A
# session replacing its own channel may pass it by one meanwhile.
MAX_CHANNELS = 64
# With tenants (``--auth-tokens``): channels one tenant may hold at once (counted as
# MAX_CHANNELS counts them), so that one tenant's sessions cannot take every channel and
# leave the others only gRPC.
MAX_CHANNELS_PER_TENANT = 16


# not frozen: a frozen dataclass's __init__ sets each field through object.__setattr__, a
# cost every Export pays; nothing changes an Export once it is made
@dataclass(slots=True)
class Export:
    id: str
    session_id: str
    storage: Storage
    segment_id: int
    segment_nbytes: int
    byte_offset: int  # of the Storage's first byte in its segment (fixed: it is held)
    ipc_handle: bytes = b""  # a GPU segment's cudaIpcMemHandle_t; empty for host memory


@dataclass(frozen=True, slots=True)
class Ticket:
    segment_id: int
    backend: SharedHostBackend
    expires: float
    proof: str  # the ticket's second half, answered with the descriptor


@dataclass(frozen=True, slots=True)
class ChannelKey:
    """A session's channel key: looked up by its locator, its secret compared in constant
    time; the proof, which the client never sends, answers its bind (a socket squatted at
    the path on another host, which learns locator and secret, cannot pose as the server)."""

    locator: str
    # never in a repr (a log line, a traceback's message): they bind or name the session
    secret: str = field(repr=False)
    proof: str = field(repr=False)
    session_id: str = field(repr=False)
    tenant: str

    @property
    def text(self) -> str:
        return f"{self.locator}.{self.secret}.{self.proof}"


@dataclass(eq=False, slots=True)
class Channel:
    """A connection bound to a session's key.  ``wake`` (the transport's) makes the thread
    serving it stop, and that thread then unbinds it."""

    key: ChannelKey
    wake: Callable[[], None] = field(repr=False)


class ExportTable:
    """Every live export, unredeemed ticket, channel key and bound channel of one server.
    Thread-safe; ``_lock`` guards every table below and is a leaf (nothing is called
    while it is held but the session manager's lock-free count)."""

    def __init__(
        self, storages: StorageRegistry, sessions: SessionManager, *, tenants: bool
    ) -> None:
        self.storages = storages
        self.sessions = sessions
        self.tenants = tenants
        self.instance = secrets.token_hex(8)  # a client's mapping cache is per server instance
        # export ids: the instance and a counter, never reused by this server or another (a
        # release queued for a restarted server's session never ends a new export), and need
        # no secrecy: only the session that made an export ends it by its id (release)
        self._export_ids = itertools.count(1)
        self._lock = threading.Lock()
        self._exports: dict[str, Export] = {}
        # session id -> its live exports: the handle limit's check is O(1) per Export, not
        # a walk over every export of the server
        self._per_session: dict[str, int] = {}
        self._tickets: OrderedDict[str, Ticket] = OrderedDict()
        # CUDA IPC imports: segment id -> {session id: Exports answered with its handle}
        self._imports: dict[int, dict[str, int]] = {}
        self._import_sizes: dict[int, tuple[str, int]] = {}  # segment id -> (device, bytes)
        # call channels
        self._channel_keys: dict[str, ChannelKey] = {}  # locator -> key
        self._session_keys: dict[str, ChannelKey] = {}  # session id -> its key
        self._channels: dict[str, Channel] = {}  # session id -> its bound channel
        # channels served (bound, or replaced and still finishing a call) per tenant, until
        # they end: MAX_CHANNELS_PER_TENANT each, MAX_CHANNELS in all
        self._served_channels: collections.Counter[str] = collections.Counter()
        # calls the channels carried so far (the metrics' share of calls that took no gRPC)
        self._channel_calls = 0
        sessions.end_listeners.append(self.session_ended)
        sessions.exports_of = self._live_exports

    # -- exports ------------------------------------------------------------------

    def export(
        self, session: Session, handle: str, mapped: Container[int] = ()
    ) -> tuple[Export, str, TensorRef]:
        """Hold the Storage of ``handle`` for the session; the export, a fd ticket and the
        tensor the handle named when it was looked up.  The answer describes that tensor,
        never a second lookup: a Release of the handle landing in between would fail the
        call after the export was added, and the client, never told its id, could not end
        it (it would pin the Storage until the session ends).

        ``mapped``: segment ids the client says it maps already; an export in one of them
        gets no ticket ("": the client has the descriptor's mapping, and an unredeemed
        ticket would only crowd the table).  Trusting it grants nothing: a ticket is the
        only thing withheld."""
        with self._lock:  # refused before any work; checked again where the export is added
            self.sessions.refuse_beyond_limit(session)
        ref = self.sessions.hold(session, handle)  # the export's own hold, kept past this call
        storage = ref.storage
        backend = storage.device.backend
        if not isinstance(backend, SharedHostBackend | CudaBackend):
            self.storages.release_hold(storage)
            raise FailedPreconditionError(
                f"the memory of {storage.device.name} ({storage.device.description}) cannot "
                "be mapped by clients; use the gRPC transfers"
            )
        block = storage.block  # fixed now: a held Storage never moves
        if isinstance(backend, CudaBackend):
            return self._export_cuda(session, storage, backend), "", ref
        segment = backend.segment(block.segment.memory)
        export = Export(
            id=self._new_id(),
            session_id=session.id,
            storage=storage,
            segment_id=segment.id if segment is not None else 0,
            segment_nbytes=segment.nbytes if segment is not None else 0,
            byte_offset=block.offset if segment is not None else 0,
        )
        # searched before the lock: the list may be long (limits.MAX_LIST_LEN), and the lock
        # is every session's Exports', the fd socket's and the GPU pools' release veto's
        wants_ticket = segment is not None and segment.id not in mapped
        ticket = ""
        with self._counted(export, session):
            if segment is not None and wants_ticket:
                ticket = self._issue_ticket(segment.id, backend)
        self._refuse_if_ended(session)
        return export, ticket, ref

    def _export_cuda(self, session: Session, storage: Storage, backend: CudaBackend) -> Export:
        """(the Storage is held) Its segment's IPC handle, the import counted first."""
        memory = storage.block.segment.memory
        if memory.nbytes == 0:  # a zero-byte Storage: no segment, nothing to open
            export = Export(self._new_id(), session.id, storage, 0, 0, 0)
            with self._counted(export, session):
                pass
            self._refuse_if_ended(session)
            return export
        try:
            segment_id, handle = backend.ipc_export(memory)
        except BaseException:
            self.storages.release_hold(storage)
            raise
        export = Export(
            id=self._new_id(),
            session_id=session.id,
            storage=storage,
            segment_id=segment_id,
            segment_nbytes=memory.nbytes,
            byte_offset=storage.block.offset,
            ipc_handle=handle,
        )
        with self._counted(export, session):
            importers = self._imports.setdefault(segment_id, {})
            importers[session.id] = importers.get(session.id, 0) + 1
            self._import_sizes[segment_id] = (storage.device.name, memory.nbytes)
        self._refuse_if_ended(session)
        return export

    def _new_id(self) -> str:
        return f"{self.instance}.{next(self._export_ids):x}"

    def _refuse_if_ended(self, session: Session) -> None:
        """(after an export was added) NotFoundError if the session ended meanwhile: its end
        released the exports it had then, so this one's (and any other added since) go now."""
        if self.sessions.peek(session.id) is not session:
            self._end_exports(session)  # (its end listener dropped its channel already)
            raise NotFoundError("unknown session")

    def imports_closed(self, session: Session, closed: list[tuple[int, int]]) -> None:
        """The client closed these imports: (segment id, Exports it opened the handle for).
        Only this session's own counts drop, never below zero."""
        with self._lock:
            for segment_id, exports in closed:
                importers = self._imports.get(segment_id)
                if importers is None or session.id not in importers:
                    continue
                left = importers[session.id] - max(0, exports)
                if left > 0:
                    importers[session.id] = left
                    continue
                del importers[session.id]
                if not importers:
                    del self._imports[segment_id]
                    del self._import_sizes[segment_id]

    def segment_releasable(self, backend: CudaBackend) -> Callable[[DeviceMemory], bool]:
        """The veto for ``backend``'s pool: a segment some session imported stays."""

        def releasable(memory: DeviceMemory) -> bool:
            segment_id = backend.ipc_segment_id(memory)
            if segment_id is None:
                return True
            with self._lock:
                return segment_id not in self._imports

        return releasable

    def watch_pools(self, pools: list[CachingPool]) -> None:
        """Install the import veto on every GPU pool."""
        for pool in pools:
            if isinstance(pool.backend, CudaBackend):
                pool.segment_releasable = self.segment_releasable(pool.backend)

    def import_stats(self, device_name: str) -> tuple[int, int]:
        """(segments some session imported, their bytes) on a device."""
        with self._lock:
            sizes = [n for d, n in self._import_sizes.values() if d == device_name]
        return len(sizes), sum(sizes)

    def release(self, session: Session, export_ids: list[str]) -> int:
        """End exports of this session; unknown ids are ignored (a deleter may run twice)."""
        ended = []
        with self._lock:
            for export_id in export_ids:
                export = self._exports.get(export_id)
                if export is not None and export.session_id == session.id:
                    ended.append(self._remove(export_id))
        for export in ended:
            self.storages.release_hold(export.storage)
        return len(ended)

    def session_ended(self, session: Session) -> None:
        """A closed or reaped session's exports end with it (a crashed client's holds drop),
        and its channel key and channel."""
        self._forget_channel(session.id)
        self._end_exports(session)

    def _end_exports(self, session: Session) -> None:
        with self._lock:
            ended = [e for e in self._exports.values() if e.session_id == session.id]
            for export in ended:
                self._remove(export.id)
            for segment_id, importers in list(self._imports.items()):
                importers.pop(session.id, None)  # its process closed them, or soon dies
                if not importers:
                    del self._imports[segment_id]
                    del self._import_sizes[segment_id]
        for export in ended:
            self.storages.release_hold(export.storage)

    def _live_exports(self, session_id: str) -> int:
        """A session's live exports, for the handle limit: read without the lock (one dict
        lookup), held by callers that add an export."""
        return self._per_session.get(session_id, 0)

    @contextlib.contextmanager
    def _counted(self, export: Export, session: Session) -> Iterator[None]:
        """Under the lock (the body too): the held ``export`` counted for ``session`` (with
        its handles and share tokens), or refused beyond the limit and its hold dropped once the
        lock is let go (a free takes the pool's lock, which may call back into ours).
        Concurrent Exports of one session each passed the first check before any was added."""
        self._lock.acquire()
        try:
            self.sessions.refuse_beyond_limit(session)
        except ResourceExhaustedError:
            self._lock.release()
            self.storages.release_hold(export.storage)
            raise
        try:
            self._add(export)
            yield
        finally:
            self._lock.release()

    def _add(self, export: Export) -> None:
        """(lock held)"""
        self._exports[export.id] = export
        self._per_session[export.session_id] = self._per_session.get(export.session_id, 0) + 1

    def _remove(self, export_id: str) -> Export:
        """(lock held)"""
        export = self._exports.pop(export_id)
        left = self._per_session[export.session_id] - 1
        if left:
            self._per_session[export.session_id] = left
        else:
            del self._per_session[export.session_id]
        return export

    def count(self, session_id: str) -> int:
        with self._lock:
            return self._per_session.get(session_id, 0)

    def stats(self, device_name: str) -> tuple[int, int]:
        """(exported Storages, their bytes) on a device, each Storage counted once."""
        with self._lock:
            storages = {
                e.storage.id: e.storage.nbytes
                for e in self._exports.values()
                if e.storage.device.name == device_name
            }
        return len(storages), sum(storages.values())

    def gone_segments(self, backends: list[SharedHostBackend], segment_ids: list[int]) -> list[int]:
        """Which of ``segment_ids`` no backend has any more (the client may unmap them)."""
        return [
            sid
            for sid in segment_ids
            if all(backend.segment_by_id(sid) is None for backend in backends)
        ]

    # -- tickets ----------------------------------------------------------------------

    def _issue_ticket(self, segment_id: int, backend: SharedHostBackend) -> str:
        """(lock held) A one-time ticket for one segment; the oldest dropped past MAX_TICKETS."""
        now = time.monotonic()
        while self._tickets:
            oldest = next(iter(self._tickets.values()))
            if oldest.expires > now and len(self._tickets) < MAX_TICKETS:
                break
            self._tickets.popitem(last=False)
        ticket = secrets.token_urlsafe(24)  # 32 characters: a 16-character key and proof
        key, proof = split_ticket(ticket)
        self._tickets[key] = Ticket(segment_id, backend, now + TICKET_TTL_S, proof)
        return ticket

    def redeem(self, key: str) -> tuple[int, str]:
        """A new descriptor of the segment of a valid ticket's key (used up; the caller
        closes the descriptor) and the ticket's proof; KeyError otherwise."""
        with self._lock:
            entry = self._tickets.pop(key, None)
        if entry is None or entry.expires < time.monotonic():
            raise KeyError("unknown or expired ticket")
        fd = entry.backend.dup_fd(entry.segment_id)
        if fd is None:
            raise KeyError("the segment is gone")
        return fd, entry.proof

    # -- call channels ------------------------------------------------------------

    def channel_key(self, session: Session) -> str:
        """The session's channel key, made on first use ("" for a session that ended).
        Called once the session is open: a session that ended meanwhile keeps none."""
        with self._lock:
            key = self._session_keys.get(session.id)
            if key is None:
                key = ChannelKey(
                    locator=secrets.token_urlsafe(12),
                    secret=secrets.token_urlsafe(24),
                    proof=secrets.token_urlsafe(12),
                    session_id=session.id,
                    tenant=session.tenant,
                )
                self._session_keys[session.id] = key
                self._channel_keys[key.locator] = key
        if self.sessions.peek(session.id) is not session:  # its end listener ran already
            self._forget_channel(session.id)
            return ""
        return key.text

    def bind_channel(self, text: str, wake: Callable[[], None]) -> Channel:
        """A channel bound to the session of key ``text`` (locator.secret: a live session's;
        one channel per session: a second bind wakes the first, which then ends).
        NotFoundError for an unknown key, ResourceExhaustedError past the channel bounds."""
        locator, _, secret = text.partition(".")
        replaced = None
        with self._lock:
            key = self._channel_keys.get(locator)
            if key is None or not hmac.compare_digest(key.secret.encode(), secret.encode()):
                raise NotFoundError("unknown channel key")
            replacing = key.session_id in self._channels  # may pass a bound by one
            if self._served_channels.total() - replacing >= MAX_CHANNELS:
                raise ResourceExhaustedError(f"too many channels ({MAX_CHANNELS})")
            if self.tenants and self._served_channels[key.tenant] - replacing >= (
                MAX_CHANNELS_PER_TENANT
            ):
                raise ResourceExhaustedError(
                    f"too many channels for this tenant ({MAX_CHANNELS_PER_TENANT})"
                )
            channel = Channel(key, wake)
            replaced = self._channels.get(key.session_id)
            self._channels[key.session_id] = channel
            self._served_channels[key.tenant] += 1  # until unbind_channel
        if replaced is not None:
            replaced.wake()  # its thread ends; its client falls back once, then reconnects
        return channel

    def serves(self, channel: Channel) -> bool:
        """Whether ``channel`` is still its session's (read without the lock: one lookup)."""
        return self._channels.get(channel.key.session_id) is channel

    def unbind_channel(self, channel: Channel) -> None:
        """Once per bound channel, when the transport stops serving it."""
        tenant = channel.key.tenant
        with self._lock:
            self._served_channels[tenant] -= 1
            if not self._served_channels[tenant]:
                del self._served_channels[tenant]
            if self._channels.get(channel.key.session_id) is channel:
                del self._channels[channel.key.session_id]

    def count_channel_call(self) -> None:
        """One call came on a channel (it is observed as any call, by method and code)."""
        with self._lock:
            self._channel_calls += 1

    def channel_stats(self) -> tuple[int, int]:
        """Channels served now, and the calls they carried so far."""
        with self._lock:
            return self._served_channels.total(), self._channel_calls

    def _forget_channel(self, session_id: str) -> None:
        """Drop a session's key and wake its channel (closed once its call, if any, ends)."""
        with self._lock:
            key = self._session_keys.pop(session_id, None)
            if key is not None:
                self._channel_keys.pop(key.locator, None)
            channel = self._channels.pop(session_id, None)
        if channel is not None:
            channel.wake()

    def channel_count(self) -> int:
        with self._lock:
            return len(self._channels)

    def close(self) -> None:
        """Close every channel and forget every key (after every session ended)."""
        with self._lock:
            channels = list(self._channels.values())
            self._channels.clear()
            self._channel_keys.clear()
            self._session_keys.clear()
        for channel in channels:
            channel.wake()
