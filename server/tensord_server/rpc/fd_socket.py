"""Same-host zero copy, the server's side: exports of Storages, tickets and the fd socket.

An *export* is a hold on a Storage, kept for a client that maps its segment: while
it lives the Storage never moves (compaction skips held Storages) and stays
charged to its tenant.  It ends by ReleaseExports or with its session (a crashed
client's after the grace, through the session's end listeners).

The descriptor of a segment (a memfd, :mod:`tensord_server.devices.shm`) is handed out on a
unix socket in a fresh private directory, to whoever presents a *ticket*'s key: 192
random bits (a key the client sends and a proof the server answers with), usable once, for one segment, for :data:`TICKET_TTL_S`, issued only to
a session that exported a Storage of that segment.  Segments are never shared
between tenants (each tenant allocates on its own pool stream, see
:meth:`StorageRegistry.stream_of`), so a ticket never reveals another tenant's byte.
Without ``--auth-tokens`` the socket is 0600 in a 0700 directory and the peer's uid
(SO_PEERCRED) must be the server's; with tenants it may be reached by any local
user (0666 in a 0711 directory): the ticket, known only to its session, is the key.
A client on another host never gets a descriptor: the socket is local.

The same socket carries each session's *export channel* (issue 13): a gRPC Export answers
the session's channel key (a locator, 192 secret bits and a proof, one per session, kept
here beside the session), and a connection that sends ``chan LOCATOR.SECRET`` (the peer rule
above applies) is bound to that session; the answer carries the proof.  It then carries Exports as frames: a 4-byte length and an ExportRequest's
bytes in, a status byte, a 4-byte length and an ExportResponse's bytes (or, with status
"use gRPC", a short reason) out.  The socket code only moves bytes: the rpc layer's
:attr:`ExportTable.channel_handler` parses, exports and encodes, as its Export handler does.
At most :data:`MAX_CHANNELS` channels live at once (with tenants, at most
:data:`MAX_CHANNELS_PER_TENANT` of them one tenant's) and one per session (a second bind of a
session replaces its first); an idle one closes after :data:`CHANNEL_IDLE_S`; the session's
end drops its key and closes its channel.  Whatever the channel refuses, the client asks
again through gRPC, which raises the proper errors.

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
import logging
import os
import secrets
import shutil
import socket
import struct
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Container, Iterator
from dataclasses import dataclass, field

from tensord.errors import FailedPreconditionError, NotFoundError, ResourceExhaustedError
from tensord.protocol import (
    CHANNEL_ANSWER_HEADER,
    CHANNEL_BIND,
    CHANNEL_FRAME_HEADER,
    CHANNEL_OK,
    CHANNEL_USE_GRPC,
    split_ticket,
)

from tensord_server.devices.cuda import CudaBackend
from tensord_server.devices.descriptors import is_descriptor_error, out_of_descriptors
from tensord_server.devices.memory import DeviceMemory
from tensord_server.devices.shm import SharedHostBackend
from tensord_server.domain.sessions import Session, SessionManager
from tensord_server.domain.storage import Storage, StorageRegistry, TensorRef
from tensord_server.pool import CachingPool

log = logging.getLogger(__name__)

# A ticket must be redeemed this soon after its Export (the SDK does it at once).
TICKET_TTL_S = 30.0
# Unredeemed tickets kept at most (the oldest are dropped beyond it): bounds the table
# whatever a client does with its Exports.
MAX_TICKETS = 4096
# One fd request: a ticket line of at most this many bytes, within this many seconds.
MAX_TICKET_LINE = 128
FD_REQUEST_TIMEOUT_S = 2.0
# Requests answered at once (a thread each), and per peer uid: a connection that sends
# nothing holds one for at most FD_REQUEST_TIMEOUT_S and never delays another client's.
# A connection beyond either bound is closed unanswered (its client falls back to gRPC).
MAX_FD_HANDLERS = 16
MAX_FD_HANDLERS_PER_PEER = 4
# How often the accept loop checks for shutdown.
ACCEPT_POLL_S = 0.2
_SOCKET_NAME = "fd.sock"
# Export channels (issue 13): threads serving a channel at once, the whole server (a bound
# connection each, and a replaced one whose thread is still finishing a request: it counts
# until that thread ends, else rebinding a session whose requests wait, on its session's lock
# say, would start a thread per bind); a bind beyond it is refused ("no: ...") and its client
# keeps using gRPC.  A session replacing its own channel may pass it by one meanwhile.
MAX_CHANNELS = 64
# With tenants (``--auth-tokens``): channel threads one tenant may hold at once (counted as
# MAX_CHANNELS counts them), so that one tenant's sessions cannot take every channel and
# leave the others only gRPC.
MAX_CHANNELS_PER_TENANT = 16
# A channel that carries no request for this long is closed (its client reconnects lazily;
# the bind's answer tells it this number).
CHANNEL_IDLE_S = 30.0
# One request frame: an ExportRequest (a handle, a server instance and at most the SDK's 256
# mapped segment ids: about 3 KiB); a longer frame is refused and its channel closed.
MAX_CHANNEL_REQUEST_BYTES = 16 << 10
# Longest "use gRPC" reason sent back (the client only logs it).
MAX_CHANNEL_REASON_BYTES = 256
# What the rpc layer does with one channel request: (answer bytes, the id of the export it
# made, released when the answer cannot be delivered).  Raises to say "use gRPC".
ChannelHandler = Callable[[Session, bytes], tuple[bytes, str]]


# not frozen: a frozen dataclass's __init__ sets each field through object.__setattr__, a
# cost every Export pays (issue 13); nothing changes an Export once it is made
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


class ExportTable:
    """Every live export and unredeemed ticket of one server, and its fd socket.  Thread-safe."""

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
        self._lock = threading.Lock()  # guards the two dicts below
        self._exports: dict[str, Export] = {}
        # session id -> its live exports: the handle limit's check is O(1) per Export, not
        # a walk over every export of the server
        self._per_session: dict[str, int] = {}
        self._tickets: OrderedDict[str, Ticket] = OrderedDict()
        # CUDA IPC imports: segment id -> {session id: Exports answered with its handle}
        self._imports: dict[int, dict[str, int]] = {}
        self._import_sizes: dict[int, tuple[str, int]] = {}  # segment id -> (device, bytes)
        self._dir = tempfile.mkdtemp(prefix="tensord-shm-")  # 0700
        self.socket_path = os.path.join(self._dir, _SOCKET_NAME)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.socket_path)
        if tenants:  # any local user may ask; the ticket is the capability
            os.chmod(self._dir, 0o711)
            os.chmod(self.socket_path, 0o666)
        else:  # the server's user only (and SO_PEERCRED checks it again)
            os.chmod(self.socket_path, 0o600)
        self._listener.listen(64)
        self._listener.settimeout(ACCEPT_POLL_S)
        self._stop = threading.Event()
        self._short_of_descriptors = False  # the accept loop's only: a shortage is logged once
        self._handlers: dict[int, int] = {}  # peer uid -> requests being answered; _lock
        # export channels (issue 13), all under _lock: set by the rpc layer (None: no channel)
        self.channel_handler: ChannelHandler | None = None
        self._channel_keys: dict[str, ChannelKey] = {}  # locator -> key
        self._session_keys: dict[str, ChannelKey] = {}  # session id -> its key
        self._channels: dict[str, socket.socket] = {}  # session id -> its bound connection
        # threads serving a channel (bound, or replaced and still finishing a request) per
        # tenant, until they end: MAX_CHANNELS_PER_TENANT each, MAX_CHANNELS in all
        self._channel_threads: collections.Counter[str] = collections.Counter()
        # channel requests so far, by outcome ("answered", "use_grpc"): the metrics' count of
        # the Exports no gRPC interceptor sees
        self._channel_requests: collections.Counter[str] = collections.Counter()
        self._thread = threading.Thread(target=self._serve, name="tensord-fd", daemon=True)
        self._thread.start()
        sessions.end_listeners.append(self.session_ended)
        sessions.exports_of = self._live_exports

    # -- exports ------------------------------------------------------------------

    def export(
        self, session: Session, handle: str, mapped: Container[int] = (), *, host_only: bool = False
    ) -> tuple[Export, str, TensorRef]:
        """Hold the Storage of ``handle`` for the session; the export, a fd ticket and the
        tensor the handle named when it was looked up.  The answer describes that tensor,
        never a second lookup: a Release of the handle landing in between would fail the
        call after the export was added, and the client, never told its id, could not end
        it (it would pin the Storage until the session ends).

        ``mapped``: segment ids the client says it maps already; an export in one of them
        gets no ticket ("": the client has the descriptor's mapping, and an unredeemed
        ticket would only crowd the table).  Trusting it grants nothing: a ticket is the
        only thing withheld.  ``host_only``: a GPU Storage is refused (FailedPreconditionError)
        before anything is exported (the channel leaves CUDA IPC to gRPC)."""
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
        if host_only and isinstance(backend, CudaBackend):
            self.storages.release_hold(storage)
            raise FailedPreconditionError("GPU exports take gRPC")
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

    # -- tickets and the fd socket ------------------------------------------------

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

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._stop.is_set():
                    return
                if is_descriptor_error(exc):
                    # the connection stays queued and the listener readable: retrying at
                    # once would spin until a descriptor is freed
                    self._refuse_for_descriptors(exc)
                continue
            self._short_of_descriptors = False
            try:
                creds = conn.getsockopt(
                    socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")
                )
                _pid, uid, _gid = struct.unpack("3i", creds)
            except OSError:
                conn.close()
                continue
            if not self._take_handler(uid):
                conn.close()
                continue
            threading.Thread(
                target=self._handle, args=(conn, uid), name="tensord-fd-request", daemon=True
            ).start()

    def _refuse_for_descriptors(self, exc: OSError) -> None:
        """The fd socket cannot accept for want of descriptors: say so (once until it
        accepts again) and wait before the next try."""
        if not self._short_of_descriptors:
            self._short_of_descriptors = True
            log.warning("the fd socket cannot accept requests: %s", out_of_descriptors(exc))
        self._stop.wait(ACCEPT_POLL_S)

    def _take_handler(self, uid: int) -> bool:
        with self._lock:
            if (
                sum(self._handlers.values()) >= MAX_FD_HANDLERS
                or self._handlers.get(uid, 0) >= MAX_FD_HANDLERS_PER_PEER
            ):
                return False
            self._handlers[uid] = self._handlers.get(uid, 0) + 1
            return True

    def _handle(self, conn: socket.socket, uid: int) -> None:
        key: ChannelKey | None = None
        try:
            with contextlib.suppress(OSError):
                key = self._answer(conn, uid)
        finally:
            with self._lock:
                self._handlers[uid] -= 1
                if not self._handlers[uid]:
                    del self._handlers[uid]
            if key is None:
                conn.close()
        if key is not None:  # a bound channel: this thread serves it (counted in _channels)
            self._serve_channel(conn, key)

    def _answer(self, conn: socket.socket, uid: int) -> ChannelKey | None:
        """One request: a ticket line in, ``ok`` with the descriptor (or ``no: why``) out; or
        a channel bind (``chan KEY``): its key once the channel is counted and bound."""
        conn.settimeout(FD_REQUEST_TIMEOUT_S)
        if not self.tenants and uid != os.getuid():
            conn.sendall(b"no: only the server's user may map its memory\n")
            return None
        line = b""
        deadline = time.monotonic() + FD_REQUEST_TIMEOUT_S
        while not line.endswith(b"\n") and len(line) <= MAX_TICKET_LINE:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            # each wait gets only the time left: a byte trickled just inside each full wait
            # would hold this handler (a bind slot) for twice the bound
            conn.settimeout(left)
            piece = conn.recv(MAX_TICKET_LINE + 1 - len(line))
            if not piece:
                return None
            line += piece
        if line.startswith(CHANNEL_BIND):
            return self._bind(conn, line[len(CHANNEL_BIND) :].strip().decode("ascii", "replace"))
        try:
            fd, proof = self.redeem(line.strip().decode("ascii", "replace"))
        except KeyError as exc:
            conn.sendall(f"no: {exc.args[0]}\n".encode())
            return None
        except OSError as exc:  # the segment's descriptor could not be duplicated
            if not is_descriptor_error(exc):
                raise
            conn.sendall(f"no: {out_of_descriptors(exc)}\n".encode())
            return None
        try:
            socket.send_fds(conn, [f"ok {proof}\n".encode("ascii")], [fd])
        finally:
            os.close(fd)
        return None

    # -- export channels (issue 13) -----------------------------------------------

    def channel_key(self, session: Session) -> str:
        """The session's channel key ("" when this server has no channel), made on first use.
        Called after the session's Export succeeded: a session that ended meanwhile keeps none."""
        if self.channel_handler is None:
            return ""
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

    def _bind(self, conn: socket.socket, text: str) -> ChannelKey | None:
        """Bind ``conn`` to the session of key ``text`` (locator.secret: a live session's, one
        channel per session: a second bind replaces the first), answering ``ok IDLE_S PROOF``
        or ``no: why``."""
        locator, _, secret = text.partition(".")
        replaced = None
        with self._lock:
            key = self._channel_keys.get(locator)
            if key is None or not hmac.compare_digest(key.secret.encode(), secret.encode()):
                refusal = "unknown channel key"
            else:
                replacing = key.session_id in self._channels  # may pass a bound by one
                if self._channel_threads.total() - replacing >= MAX_CHANNELS:
                    refusal = f"too many channels ({MAX_CHANNELS})"
                elif (
                    self.tenants
                    and self._channel_threads[key.tenant] - replacing >= MAX_CHANNELS_PER_TENANT
                ):
                    refusal = f"too many channels for this tenant ({MAX_CHANNELS_PER_TENANT})"
                else:
                    refusal = ""
                    replaced = self._channels.get(key.session_id)
                    self._channels[key.session_id] = conn
                    self._channel_threads[key.tenant] += 1  # until _unbind
        if refusal:
            conn.sendall(f"no: {refusal}\n".encode())
            return None
        assert key is not None
        if replaced is not None:
            _wake(replaced)  # its thread ends; its client falls back once, then reconnects
        try:
            conn.sendall(f"ok {CHANNEL_IDLE_S:g} {key.proof}\n".encode())
        except OSError:
            self._unbind(key, conn)
            raise
        return key

    def _serve_channel(self, conn: socket.socket, key: ChannelKey) -> None:
        """Answer the channel's requests, one at a time, until it is idle, closed or broken."""
        try:
            with conn, contextlib.suppress(OSError):
                while not self._stop.is_set() and self._channels.get(key.session_id) is conn:
                    request = _read_frame(conn)
                    if request is None or not self._answer_frame(conn, key, request):
                        return
        finally:
            self._unbind(key, conn)

    def _answer_frame(self, conn: socket.socket, key: ChannelKey, request: bytes) -> bool:
        """One Export on the channel; False when the channel must close."""
        try:  # what every call does first: the session's lookup, which renews its lease
            session = self.sessions.get(key.session_id, key.tenant)
        except NotFoundError:
            self._send_counted(conn, CHANNEL_USE_GRPC, b"unknown session")
            return False
        handler = self.channel_handler
        if handler is None:
            self._send_counted(conn, CHANNEL_USE_GRPC, b"no channel")
            return False
        try:
            answer, export_id = handler(session, request)
        except Exception as exc:  # the client asks again through gRPC, which raises it
            reason = f"{type(exc).__name__}: {exc}".encode()[:MAX_CHANNEL_REASON_BYTES]
            self._send_counted(conn, CHANNEL_USE_GRPC, reason)
            return True
        try:
            self._send_counted(conn, CHANNEL_OK, answer)
        except OSError:
            self.release(session, [export_id])  # never delivered: nobody else would end it
            raise
        return True

    def _send_counted(self, conn: socket.socket, status: int, payload: bytes) -> None:
        """Answer one channel request, counted by its outcome for the metrics."""
        with self._lock:
            self._channel_requests["answered" if status == CHANNEL_OK else "use_grpc"] += 1
        _send_answer(conn, status, payload)

    def channel_stats(self) -> tuple[int, dict[str, int]]:
        """Channels served now, and the channel's requests so far by outcome."""
        with self._lock:
            return self._channel_threads.total(), dict(self._channel_requests)

    def _unbind(self, key: ChannelKey, conn: socket.socket) -> None:
        """Once per bound ``conn``, when its thread stops serving it."""
        with self._lock:
            self._channel_threads[key.tenant] -= 1
            if not self._channel_threads[key.tenant]:
                del self._channel_threads[key.tenant]
            if self._channels.get(key.session_id) is conn:
                del self._channels[key.session_id]

    def _forget_channel(self, session_id: str) -> None:
        """Drop a session's key and wake its channel's thread (which then closes it)."""
        with self._lock:
            key = self._session_keys.pop(session_id, None)
            if key is not None:
                self._channel_keys.pop(key.locator, None)
            conn = self._channels.pop(session_id, None)
        if conn is not None:
            _wake(conn)

    def channel_count(self) -> int:
        with self._lock:
            return len(self._channels)

    def close(self) -> None:
        """Stop the fd socket and every channel, and remove its directory (after every
        session ended)."""
        self._stop.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            channels = list(self._channels.values())
            self._channels.clear()
            self._channel_keys.clear()
            self._session_keys.clear()
        for conn in channels:
            _wake(conn)
        self._thread.join(timeout=ACCEPT_POLL_S * 5)
        shutil.rmtree(self._dir, ignore_errors=True)


def _wake(conn: socket.socket) -> None:
    """Make the thread blocked in ``conn``'s recv return (close() alone would not wake it);
    that thread closes it."""
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)


def _receive_exactly(conn: socket.socket, nbytes: int, deadline: float) -> bytes | None:
    """``nbytes`` from ``conn`` before ``deadline``; None at its end or past the deadline."""
    data = bytearray()
    while len(data) < nbytes:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        conn.settimeout(left)
        piece = conn.recv(nbytes - len(data))
        if not piece:
            return None
        data += piece
    return bytes(data)


def _read_frame(conn: socket.socket) -> bytes | None:
    """The next request of a channel: waits CHANNEL_IDLE_S for it to begin, then
    FD_REQUEST_TIMEOUT_S for the rest; None when idle, closed, late or too long (the
    last answered "use gRPC" first)."""
    try:
        header = _receive_exactly(
            conn, CHANNEL_FRAME_HEADER.size, time.monotonic() + CHANNEL_IDLE_S
        )
    except TimeoutError:
        return None
    if header is None:
        return None
    (length,) = CHANNEL_FRAME_HEADER.unpack(header)
    if length > MAX_CHANNEL_REQUEST_BYTES:
        _send_answer(
            conn, CHANNEL_USE_GRPC, f"frame over {MAX_CHANNEL_REQUEST_BYTES} bytes".encode()
        )
        return None
    try:
        return _receive_exactly(conn, length, time.monotonic() + FD_REQUEST_TIMEOUT_S)
    except TimeoutError:
        return None


def _send_answer(conn: socket.socket, status: int, payload: bytes) -> None:
    conn.settimeout(FD_REQUEST_TIMEOUT_S)
    conn.sendall(CHANNEL_ANSWER_HEADER.pack(status, len(payload)) + payload)
