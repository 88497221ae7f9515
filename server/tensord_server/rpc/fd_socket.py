"""The fd socket: the same-host transport beside the gRPC server, served on its event loop.

A unix socket in a fresh private directory that hands out segment descriptors and carries
the sessions' *call channels*; the books it answers from (tickets, channel keys, bound
channels) are the domain's :class:`~tensord_server.domain.exports.ExportTable`.  Every
connection is a coroutine on the gRPC server's event loop: one waiting for its client (its
first line, a frame's bytes, its next call, a reader of its answer) holds its descriptor and
a coroutine, never a thread.

A connection sends one line.  A ticket's key: answered ``ok PROOF`` with the segment's
descriptor (``SCM_RIGHTS``), or ``no: why``.  ``call LOCATOR.SECRET``: the connection is
bound to that key's session (answered ``ok IDLE_S PROOF``) and then carries that session's
unary calls, one at a time, as frames (:data:`tensord.protocol.CALL_HEADER` and
``ANSWER_HEADER``).  This module only moves their bytes: the rpc layer's
:class:`ChannelCalls` takes each call through the steps of its gRPC twin (the method's
receive limit before a byte of the request is read, the request budget, the fair executor
under the key gRPC would use, the same handler, the same status code, message and
trailers).  A frame that breaks the framing (request id CHANNEL_CLOSING, a method name over
MAX_METHOD_NAME_BYTES) closes the channel unanswered; so does a request refused before its
bytes were read (answered first), since they would be taken for the next frame.  The
server closes a channel idle for :data:`CHANNEL_IDLE_S`, one whose session ended or that a
second bind of its session replaced, and every one at shutdown, each between two calls and
saying so first (an answer with request id CHANNEL_CLOSING), so a request its client sent
meanwhile is known unread and may go through gRPC.

Without ``--auth-tokens`` the socket is 0600 in a 0700 directory and the peer's uid
(SO_PEERCRED) must be the server's; with tenants it may be reached by any local user (0666
in a 0711 directory): the ticket or the key, known only to its session, is the capability.
A client on another host never gets a descriptor or a channel: the socket is local.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import socket
import struct
import tempfile
from dataclasses import dataclass
from typing import Protocol

from tensord.errors import DeadlineExceededError, NotFoundError, ResourceExhaustedError
from tensord.protocol import (
    ANSWER_HEADER,
    CALL_HEADER,
    CHANNEL_BIND,
    CHANNEL_CLOSING,
    MAX_METHOD_NAME_BYTES,
)

from tensord_server.devices.descriptors import is_descriptor_error, out_of_descriptors
from tensord_server.domain.exports import Channel, ExportTable
from tensord_server.rpc.executor import within

log = logging.getLogger(__name__)

# A connection's first line (a ticket's key, a bind): at most this many bytes, all of it
# within this many seconds of its accept (so are the rest of a frame after its first byte,
# and a method's name).
MAX_TICKET_LINE = 128
FD_REQUEST_TIMEOUT_S = 2.0
# Connections accepted and not yet answered or bound, in all and per peer uid: each holds a
# descriptor and a coroutine for at most FD_REQUEST_TIMEOUT_S.  A connection beyond either
# bound is closed unanswered (its client uses gRPC).
MAX_FD_HANDLERS = 64
MAX_FD_HANDLERS_PER_PEER = 16
# How long the socket stops accepting after an accept failed for want of descriptors (the
# connection stays queued: retrying at once would spin until a descriptor is freed).
ACCEPT_POLL_S = 0.2
# Connections one wake-up of the listener accepts before other work on the loop has a turn.
ACCEPTS_PER_WAKE = 64
_SOCKET_NAME = "fd.sock"
# A channel that carries no call for this long is closed (its client reconnects lazily; the
# bind's answer tells it this number).
CHANNEL_IDLE_S = 30.0
# Bytes asked of the kernel per read: a small frame arrives whole in one read; a large
# request is read a piece of at most MAX_READ_BYTES at a time.
READ_BYTES = 64 << 10
MAX_READ_BYTES = 1 << 20
# An answer longer than this goes out as two writes (its header, then its bytes unjoined).
JOIN_ANSWER_BYTES = 64 << 10
# At shutdown, how long channels in a call get to answer it when the stop gives no grace.
CLOSE_WAIT_S = 0.5
# What a channel's closing notice says (the client only logs it).
_CLOSING_TEXT = b"the server closed the channel before reading another request"
# The status code a closing notice carries: UNAVAILABLE's value (the transport speaks no gRPC).
_UNAVAILABLE = 14


@dataclass(frozen=True, slots=True)
class CallFrame:
    """One call's frame, its request's bytes not read yet."""

    request_id: int
    method: str
    nbytes: int  # the request's length
    timeout: float | None  # the client's deadline, in seconds from now (None: no deadline)


class ChannelCalls(Protocol):
    """What the rpc layer does with one call on a bound channel: reads its request through
    ``conn.read_request`` (or refuses it unread) and answers it through ``conn.answer``."""

    async def channel_call(
        self, channel: Channel, conn: ChannelConnection, frame: CallFrame
    ) -> None: ...


class ChannelConnection:
    """A connection of the fd socket: its non-blocking socket, the bytes read ahead of what
    was asked (at most READ_BYTES beyond it), and once bound its channel's idle state.  Used
    on the event loop only."""

    __slots__ = (
        "_idle_timer",
        "_loop",
        "buffer",
        "idle",
        "idle_since",
        "peer",
        "request_read",
        "sock",
        "task",
        "woken",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, peer: str) -> None:
        self._loop = loop
        self.sock = sock
        #: what the calls and the logs name this connection by (a channel's fairness key
        #: without --auth-tokens, as a gRPC connection's peer is)
        self.peer = peer
        self.buffer = bytearray()
        self.task: asyncio.Task[None] | None = None
        self.idle = False  # waiting for the next call: a wake ends the wait at once
        self.woken = False  # the server closes it once its call in progress (if any) ends
        self.request_read = False  # the current frame's request bytes were taken
        # when its wait for the next call began (the loop's clock): one idle timer per
        # CHANNEL_IDLE_S that looks at this, not one per call
        self.idle_since = loop.time()
        self._idle_timer: asyncio.TimerHandle | None = None

    def wake(self) -> None:
        """Close the channel: now if it waits for a call, else once its call is answered."""
        self.woken = True
        if self.idle and self.task is not None:
            self.idle = False  # cancelled once: a second wake must not cancel what follows
            self.task.cancel()

    async def _fill(self, nbytes: int) -> None:
        while len(self.buffer) < nbytes:
            wanted = min(max(nbytes - len(self.buffer), READ_BYTES), MAX_READ_BYTES)
            piece = await self._loop.sock_recv(self.sock, wanted)
            if not piece:
                raise ConnectionResetError("the client closed the connection")
            self.buffer += piece

    def _take(self, nbytes: int) -> bytes:
        data = bytes(self.buffer[:nbytes])
        del self.buffer[:nbytes]
        return data

    async def receive(self, nbytes: int, timeout: float, expired: str) -> bytes:
        """Exactly ``nbytes``, all within ``timeout``; ConnectionResetError at the stream's
        end, DeadlineExceededError(``expired``) past the time."""
        if len(self.buffer) < nbytes:
            await within(self._fill(nbytes), timeout, expired)
        return self._take(nbytes)

    async def read_request(self, nbytes: int) -> bytes:
        """The current frame's request bytes (the caller bounds the wait)."""
        self.request_read = True
        if len(self.buffer) < nbytes:
            await self._fill(nbytes)
        return self._take(nbytes)

    def buffered_request(self, nbytes: int) -> bytes | None:
        """The current frame's request bytes if they were all read with its header (a small
        frame arrives whole): nothing left to wait for; None: :meth:`read_request`."""
        if len(self.buffer) < nbytes:
            return None
        self.request_read = True
        return self._take(nbytes)

    async def line(self) -> bytes | None:
        """The first line, without its newline; None past MAX_TICKET_LINE bytes or at the
        stream's end.  What follows it stays in the buffer (a bound channel's first frame)."""
        while b"\n" not in self.buffer:
            if len(self.buffer) > MAX_TICKET_LINE:
                return None
            piece = await self._loop.sock_recv(self.sock, MAX_TICKET_LINE + 1 - len(self.buffer))
            if not piece:
                return None
            self.buffer += piece
        line, _, rest = bytes(self.buffer).partition(b"\n")
        if len(line) > MAX_TICKET_LINE:
            return None
        self.buffer = bytearray(rest)
        return line

    async def next_header(self) -> bytes | None:
        """The next call's header: it may begin CHANNEL_IDLE_S after the last answer, the
        rest within FD_REQUEST_TIMEOUT_S; None when idle, woken or closed."""
        if not self.buffer:
            if self.woken:
                return None
            self.idle = True
            self.idle_since = self._loop.time()
            if self._idle_timer is None:
                self._idle_timer = self._loop.call_at(
                    self.idle_since + CHANNEL_IDLE_S, self._idle_check
                )
            try:
                piece = await self._loop.sock_recv(self.sock, READ_BYTES)
            except asyncio.CancelledError:
                if not self.woken:
                    raise  # the server's own cancellation (shutdown)
                task = asyncio.current_task()
                if task is not None:
                    task.uncancel()
                return None
            finally:
                self.idle = False
            if not piece:
                return None
            self.buffer += piece
        return await self.receive(
            CALL_HEADER.size, FD_REQUEST_TIMEOUT_S, "a call frame's header came too slowly"
        )

    def _idle_check(self) -> None:
        """The idle timer: close a channel that has waited CHANNEL_IDLE_S for its next call;
        else look again when its current wait will have lasted that long (a call in
        progress: CHANNEL_IDLE_S from now)."""
        self._idle_timer = None
        if self.woken or self.sock.fileno() < 0:
            return
        now = self._loop.time()
        due = self.idle_since + CHANNEL_IDLE_S if self.idle else now + CHANNEL_IDLE_S
        if self.idle and now >= due:
            self.wake()
            return
        self._idle_timer = self._loop.call_at(due, self._idle_check)

    def stop_idle_timer(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    async def send(self, data: bytes | memoryview, timeout: float) -> None:
        """All of ``data`` within ``timeout``: written at once where the socket has room (a
        small answer to a reader waiting for it), else through the loop, bounded."""
        try:
            sent = self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        if sent < len(data):
            rest = memoryview(data)[sent:]
            await within(self._loop.sock_sendall(self.sock, rest), timeout, "a reader too slow")

    async def answer(
        self,
        request_id: int,
        code: int,
        message: str,
        error_type: str,
        details: str,
        body: bytes,
        timeout: float,
    ) -> None:
        """One call's answer (``code``: the status code's value, 0 for OK), all of it written
        within ``timeout`` (a reader slower than that loses its channel)."""
        texts = (message.encode(), error_type.encode(), details.encode())
        header = ANSWER_HEADER.pack(request_id, code, *(len(t) for t in texts), len(body))
        head = header + b"".join(texts)
        if len(body) <= JOIN_ANSWER_BYTES:
            await self.send(head + body, timeout)
        else:
            await self.send(head, timeout)
            await self.send(body, timeout)

    def say_closing(self) -> None:
        """Tell the client no request of its is being read (best effort, never waits)."""
        notice = ANSWER_HEADER.pack(CHANNEL_CLOSING, _UNAVAILABLE, len(_CLOSING_TEXT), 0, 0, 0)
        with contextlib.suppress(OSError):
            self.sock.send(notice + _CLOSING_TEXT)


class FdSocket:
    """The listening socket and a coroutine per connection, on the loop that made it (make
    it there); its fields are the loop's only.  ``calls`` answers the channels' calls."""

    def __init__(self, exports: ExportTable, calls: ChannelCalls) -> None:
        self.exports = exports
        self.calls = calls
        self.tenants = exports.tenants
        self._loop = asyncio.get_running_loop()
        self._dir = tempfile.mkdtemp(prefix="tensord-shm-")  # 0700
        self.path = os.path.join(self._dir, _SOCKET_NAME)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._listener.bind(self.path)
            if self.tenants:  # any local user may ask; the ticket or the key is the capability
                os.chmod(self._dir, 0o711)
                os.chmod(self.path, 0o666)
            else:  # the server's user only (and SO_PEERCRED checks it again)
                os.chmod(self.path, 0o600)
            self._listener.listen(64)
            self._listener.setblocking(False)
        except BaseException:
            self._listener.close()
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        self._closed = False
        self._short_of_descriptors = False  # a shortage is logged once until an accept works
        self._handlers: dict[int, int] = {}  # peer uid -> connections not yet answered or bound
        self._connections: set[ChannelConnection] = set()
        self._served = 0  # channels bound so far: each one's peer name
        self._loop.add_reader(self._listener.fileno(), self._accept)

    # -- accepting ---------------------------------------------------------------------

    def _accept(self) -> None:
        for _ in range(ACCEPTS_PER_WAKE):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if not self._closed and is_descriptor_error(exc):
                    self._pause_for_descriptors(exc)
                return
            self._short_of_descriptors = False
            try:
                sock.setblocking(False)
                creds = sock.getsockopt(
                    socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")
                )
                _pid, uid, _gid = struct.unpack("3i", creds)
            except OSError:
                sock.close()
                continue
            if not self._take_handler(uid):
                sock.close()
                continue
            conn = ChannelConnection(self._loop, sock, "fd-socket")
            self._connections.add(conn)
            conn.task = self._loop.create_task(self._serve(conn, uid))

    def _pause_for_descriptors(self, exc: OSError) -> None:
        """The socket cannot accept for want of descriptors: say so (once until it accepts
        again) and try again after ACCEPT_POLL_S."""
        if not self._short_of_descriptors:
            self._short_of_descriptors = True
            log.warning("the fd socket cannot accept requests: %s", out_of_descriptors(exc))
        self._loop.remove_reader(self._listener.fileno())
        self._loop.call_later(ACCEPT_POLL_S, self._resume)

    def _resume(self) -> None:
        if not self._closed:
            self._loop.add_reader(self._listener.fileno(), self._accept)

    def _take_handler(self, uid: int) -> bool:
        if (
            sum(self._handlers.values()) >= MAX_FD_HANDLERS
            or self._handlers.get(uid, 0) >= MAX_FD_HANDLERS_PER_PEER
        ):
            return False
        self._handlers[uid] = self._handlers.get(uid, 0) + 1
        return True

    def _release_handler(self, uid: int) -> None:
        self._handlers[uid] -= 1
        if not self._handlers[uid]:
            del self._handlers[uid]

    # -- one connection ------------------------------------------------------------------

    async def _serve(self, conn: ChannelConnection, uid: int) -> None:
        channel: Channel | None = None
        try:
            try:
                channel = await within(
                    self._answer(conn, uid), FD_REQUEST_TIMEOUT_S, "no fd request in time"
                )
            except (OSError, DeadlineExceededError):
                return
            finally:
                self._release_handler(uid)
            if channel is not None:  # bound: it carries its session's calls from now on
                await self._serve_channel(conn, channel)
        finally:
            self._connections.discard(conn)
            conn.stop_idle_timer()
            conn.sock.close()

    async def _answer(self, conn: ChannelConnection, uid: int) -> Channel | None:
        """The first line: a ticket's key, answered ``ok PROOF`` with the descriptor (or
        ``no: why``); or a channel bind (``call KEY``): the channel once counted and bound."""
        if not self.tenants and uid != os.getuid():
            await conn.send(
                b"no: only the server's user may map its memory\n", FD_REQUEST_TIMEOUT_S
            )
            return None
        line = await conn.line()
        if line is None:
            return None
        if line.startswith(CHANNEL_BIND):
            return await self._bind(
                conn, line[len(CHANNEL_BIND) :].strip().decode("ascii", "replace")
            )
        try:
            fd, proof = self.exports.redeem(line.strip().decode("ascii", "replace"))
        except KeyError as exc:
            await conn.send(f"no: {exc.args[0]}\n".encode(), FD_REQUEST_TIMEOUT_S)
            return None
        except OSError as exc:  # the segment's descriptor could not be duplicated
            if not is_descriptor_error(exc):
                raise
            await conn.send(f"no: {out_of_descriptors(exc)}\n".encode(), FD_REQUEST_TIMEOUT_S)
            return None
        try:
            # a fresh connection's buffer is empty: the short answer never waits for room
            socket.send_fds(conn.sock, [f"ok {proof}\n".encode("ascii")], [fd])
        finally:
            os.close(fd)
        return None

    async def _bind(self, conn: ChannelConnection, text: str) -> Channel | None:
        """Bind ``conn`` to the session of key ``text``, answering ``ok IDLE_S PROOF`` or
        ``no: why``; the bound channel, which this coroutine then serves."""
        try:
            channel = self.exports.bind_channel(text, lambda: self._wake(conn))
        except (NotFoundError, ResourceExhaustedError) as refusal:
            await conn.send(f"no: {refusal}\n".encode(), FD_REQUEST_TIMEOUT_S)
            return None
        self._served += 1
        conn.peer = f"fd-channel:{self._served}"
        try:
            answer = f"ok {CHANNEL_IDLE_S:g} {channel.key.proof}\n".encode()
            await conn.send(answer, FD_REQUEST_TIMEOUT_S)
        except BaseException:
            self.exports.unbind_channel(channel)
            raise
        return channel

    def _wake(self, conn: ChannelConnection) -> None:
        """(any thread) Close a channel: its session ended, or another bind replaced it."""
        with contextlib.suppress(RuntimeError):  # the loop closed: the channel is gone too
            self._loop.call_soon_threadsafe(conn.wake)

    async def _serve_channel(self, conn: ChannelConnection, channel: Channel) -> None:
        """Answer the channel's calls, one at a time, until it is idle, closed or broken."""
        try:
            while not conn.woken and self.exports.serves(channel):
                header = await conn.next_header()
                if header is None:
                    break
                request_id, deadline_ms, name_bytes, nbytes = CALL_HEADER.unpack(header)
                if request_id == CHANNEL_CLOSING or name_bytes > MAX_METHOD_NAME_BYTES:
                    return  # no frame of a client of this protocol: closed unanswered
                name = await conn.receive(
                    name_bytes, FD_REQUEST_TIMEOUT_S, "a call frame's method came too slowly"
                )
                frame = CallFrame(
                    request_id,
                    name.decode("ascii", "replace"),
                    nbytes,
                    deadline_ms / 1000 if deadline_ms else None,
                )
                conn.request_read = False
                self.exports.count_channel_call()
                await self.calls.channel_call(channel, conn, frame)
                if not conn.request_read:
                    return  # refused unread: its bytes would be taken for the next frame
            conn.say_closing()
        except (OSError, DeadlineExceededError):
            pass  # broken, or too slow: closed (its client's call fails or takes gRPC)
        finally:
            self.exports.unbind_channel(channel)

    # -- closing -------------------------------------------------------------------------

    async def aclose(self, grace: float | None) -> None:
        """Stop accepting and close every connection (a channel in a call answers it first,
        within ``grace``), then remove the socket's directory."""
        if self._closed:
            return
        self._closed = True
        self._loop.remove_reader(self._listener.fileno())
        self._listener.close()
        connections = list(self._connections)
        for conn in connections:
            conn.wake()
        tasks = [c.task for c in connections if c.task is not None]
        if tasks:
            _done, pending = await asyncio.wait(tasks, timeout=grace or CLOSE_WAIT_S)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        shutil.rmtree(self._dir, ignore_errors=True)

    def forget(self) -> None:
        """(any thread, once the loop is gone) Remove the socket's directory if :meth:`aclose`
        never ran."""
        if not self._closed:
            self._closed = True
            with contextlib.suppress(OSError):
                self._listener.close()
            shutil.rmtree(self._dir, ignore_errors=True)
