"""The fd socket: same-host zero copy's transport, beside the gRPC server.

A unix socket in a fresh private directory that hands out segment descriptors and carries
the sessions' export channels; the books it answers from (tickets, channel keys, bound
channels, exports) are the domain's :class:`~tensord_server.domain.exports.ExportTable`.

A connection sends one line.  A ticket's key: answered ``ok PROOF`` with the segment's
descriptor (``SCM_RIGHTS``), or ``no: why``.  ``chan LOCATOR.SECRET``: the connection is
bound to that key's session (answered ``ok IDLE_S PROOF``) and then carries Exports as
frames: a 4-byte length and an ExportRequest's bytes in, a status byte, a 4-byte length and
an ExportResponse's bytes (or, with status "use gRPC", a short reason) out.  This module
only moves bytes: the rpc layer's :data:`ChannelHandler` parses, exports and encodes, as
its Export handler does.  An idle channel closes after :data:`CHANNEL_IDLE_S`; whatever the
channel refuses, the client asks again through gRPC, which raises the proper errors.

Without ``--auth-tokens`` the socket is 0600 in a 0700 directory and the peer's uid
(SO_PEERCRED) must be the server's; with tenants it may be reached by any local user (0666
in a 0711 directory): the ticket or the key, known only to its session, is the capability.
A client on another host never gets a descriptor: the socket is local.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable

from tensord.errors import NotFoundError, ResourceExhaustedError
from tensord.protocol import (
    CHANNEL_ANSWER_HEADER,
    CHANNEL_BIND,
    CHANNEL_FRAME_HEADER,
    CHANNEL_OK,
    CHANNEL_USE_GRPC,
)

from tensord_server.devices.descriptors import is_descriptor_error, out_of_descriptors
from tensord_server.domain.exports import Channel, ExportTable
from tensord_server.domain.sessions import Session

log = logging.getLogger(__name__)

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


class FdSocket:
    """The listening socket, its accept thread and a thread per request or bound channel.
    Thread-safe; ``_lock`` guards ``_handlers`` only."""

    def __init__(self, exports: ExportTable, channel_handler: ChannelHandler) -> None:
        self.exports = exports
        self.channel_handler = channel_handler
        self.tenants = exports.tenants
        self._dir = tempfile.mkdtemp(prefix="tensord-shm-")  # 0700
        self.path = os.path.join(self._dir, _SOCKET_NAME)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        if self.tenants:  # any local user may ask; the ticket is the capability
            os.chmod(self._dir, 0o711)
            os.chmod(self.path, 0o666)
        else:  # the server's user only (and SO_PEERCRED checks it again)
            os.chmod(self.path, 0o600)
        self._listener.listen(64)
        self._listener.settimeout(ACCEPT_POLL_S)
        self._stop = threading.Event()
        self._short_of_descriptors = False  # the accept loop's only: a shortage is logged once
        self._lock = threading.Lock()
        self._handlers: dict[int, int] = {}  # peer uid -> requests being answered
        self._thread = threading.Thread(target=self._serve, name="tensord-fd", daemon=True)
        self._thread.start()

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
        channel: Channel | None = None
        try:
            with contextlib.suppress(OSError):
                channel = self._answer(conn, uid)
        finally:
            with self._lock:
                self._handlers[uid] -= 1
                if not self._handlers[uid]:
                    del self._handlers[uid]
            if channel is None:
                conn.close()
        if channel is not None:  # a bound channel: this thread serves it (counted bound)
            self._serve_channel(conn, channel)

    def _answer(self, conn: socket.socket, uid: int) -> Channel | None:
        """One request: a ticket line in, ``ok`` with the descriptor (or ``no: why``) out; or
        a channel bind (``chan KEY``): the channel once it is counted and bound."""
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
            fd, proof = self.exports.redeem(line.strip().decode("ascii", "replace"))
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

    def _bind(self, conn: socket.socket, text: str) -> Channel | None:
        """Bind ``conn`` to the session of key ``text``, answering ``ok IDLE_S PROOF`` or
        ``no: why``; the bound channel, which this thread then serves."""
        try:
            channel = self.exports.bind_channel(text, lambda: _wake(conn))
        except (NotFoundError, ResourceExhaustedError) as refusal:
            conn.sendall(f"no: {refusal}\n".encode())
            return None
        try:
            conn.sendall(f"ok {CHANNEL_IDLE_S:g} {channel.key.proof}\n".encode())
        except OSError:
            self.exports.unbind_channel(channel)
            raise
        return channel

    def _serve_channel(self, conn: socket.socket, channel: Channel) -> None:
        """Answer the channel's requests, one at a time, until it is idle, closed or broken."""
        try:
            with conn, contextlib.suppress(OSError):
                while not self._stop.is_set() and self.exports.serves(channel):
                    request = _read_frame(conn)
                    if request is None or not self._answer_frame(conn, channel, request):
                        return
        finally:
            self.exports.unbind_channel(channel)

    def _answer_frame(self, conn: socket.socket, channel: Channel, request: bytes) -> bool:
        """One Export on the channel; False when the channel must close."""
        try:  # what every call does first: the session's lookup, which renews its lease
            session = self.exports.sessions.get(channel.key.session_id, channel.key.tenant)
        except NotFoundError:
            self._send_counted(conn, CHANNEL_USE_GRPC, b"unknown session")
            return False
        try:
            answer, export_id = self.channel_handler(session, request)
        except Exception as exc:  # the client asks again through gRPC, which raises it
            reason = f"{type(exc).__name__}: {exc}".encode()[:MAX_CHANNEL_REASON_BYTES]
            self._send_counted(conn, CHANNEL_USE_GRPC, reason)
            return True
        try:
            self._send_counted(conn, CHANNEL_OK, answer)
        except OSError:
            # never delivered: nobody else would end it
            self.exports.release(session, [export_id])
            raise
        return True

    def _send_counted(self, conn: socket.socket, status: int, payload: bytes) -> None:
        """Answer one channel request, counted by its outcome for the metrics."""
        self.exports.count_channel_request(status == CHANNEL_OK)
        _send_answer(conn, status, payload)

    def close(self) -> None:
        """Stop accepting and remove the socket's directory (the channels close with the
        export table, or as their connections end)."""
        self._stop.set()
        with contextlib.suppress(OSError):
            self._listener.close()
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
