"""The session's call channel: its unary calls over the server's fd socket, without gRPC.

On the server's host a gRPC unary round trip costs a few times a plain unix socket's, and
every small operation pays one.  OpenSession answers the session's channel key (known only
to that session; it travels under TLS when TLS is on) and the server's fd socket; the
connection binds one socket to the session with the key less its last part (``call
LOCATOR.SECRET``), which the server answers with that part, its proof (a socket squatted
at the path, another host's, learns nothing it can use and cannot pose as the server), and
then sends the session's unary calls there as frames (:data:`tensord.protocol.CALL_HEADER`:
a request id, the call's deadline, the method's name, the request's bytes).  The server
takes each through the steps of the same call over gRPC and answers the status code,
message, error type and details its status and trailers would carry, which
:meth:`CallChannel.unary` reads back into the same answer or the same exception.

One call at a time: a call that finds the channel busy for longer than
:data:`CHANNEL_WAIT_S` takes gRPC meanwhile.  Whatever keeps a call from being sent (no
socket on this host, a failed connect or a refused bind, then gRPC for
:data:`CHANNEL_RETRY_S` before a new try; a busy channel; a forked child; a request too long
to gain anything here) or from being read (the server closed the channel between two calls
and said so) makes :meth:`CallChannel.unary` answer None, and the caller uses gRPC.  Once a
frame is sent the call is the channel's, as a gRPC call is its connection's: its answer,
its deadline passing (TimeoutError), or the channel breaking (:class:`ChannelBroken`: the
server may have run it).
"""

from __future__ import annotations

import hmac
import itertools
import math
import os
import socket
import threading
import time
from typing import Any, NamedTuple

import grpc
from google.protobuf.message import DecodeError

from tensord import schema as pb
from tensord.protocol import (
    ANSWER_HEADER,
    CALL_HEADER,
    CHANNEL_BIND,
    CHANNEL_CLOSING,
    MAX_MESSAGE_BYTES,
)
from tensord.wire.status import error_from_answer

# After a failed connect or a refused bind, calls take gRPC this long before a new try.
CHANNEL_RETRY_S = 5.0
# A connect and its bind get at most this long (or what is left of the call's deadline).
BIND_TIMEOUT_S = 2.0
# A call waits this long for the channel another call holds (a short call ends sooner, and
# the wait costs less than gRPC's round trip), then takes gRPC.
CHANNEL_WAIT_S = 0.002
# Requests longer than this take gRPC: their copies cost more than the round trip saved.
MAX_CHANNEL_REQUEST_BYTES = 1 << 20
# The longest answer taken: gRPC's message limit; and the longest error texts, together.
MAX_ANSWER_BYTES = MAX_MESSAGE_BYTES
MAX_ANSWER_TEXT_BYTES = 1 << 20
# The longest bind answer line ("ok IDLE_S PROOF", or "no: why").
MAX_BIND_LINE = 256
# the status gRPC itself ends a call with at its deadline (a server sends it so too)
DEADLINE_EXCEEDED = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
# Every unary method's answer type, by the method's name as the schema spells it.
_ANSWER_TYPES: dict[str, Any] = {
    method.name: getattr(pb, method.output_type.name)
    for method in pb.DESCRIPTOR.services_by_name["Tensord"].methods
}


class ChannelBroken(ConnectionError):
    """The channel broke after a call's frame was sent: the server may have run the call."""


class Answer(NamedTuple):
    """A call's answer as the channel carries it."""

    #: the status code's value (0: OK)
    code: int
    message: str
    #: what the ``tensord-error-type`` and ``tensord-error-details`` trailers would carry
    error_type: str
    details: str
    #: the response's bytes (empty for an error)
    body: bytes


def _receive_exactly(sock: socket.socket, nbytes: int, deadline: float | None) -> bytes:
    """``nbytes`` from ``sock`` before ``deadline`` (None: none); TimeoutError past it,
    ConnectionResetError at the stream's end."""
    data = bytearray()
    while len(data) < nbytes:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no answer on the call channel in time")
            sock.settimeout(left)
        else:
            sock.settimeout(None)
        piece = sock.recv(nbytes - len(data))
        if not piece:
            raise ConnectionResetError("the server closed the call channel")
        data += piece
    return bytes(data)


class CallChannel:
    """A session's call channel: one connection to the server's fd socket, bound to the
    session by its key.  Thread-safe (one call at a time; another waits CHANNEL_WAIT_S for
    it, then answers None).
    Connected lazily, again after the server's idle close; never used in a forked child."""

    def __init__(self, session_id: str, key: str, path: str) -> None:
        self.session_id = session_id
        self.key = key
        self.path = path
        self.pid = os.getpid()
        self.last_reason = ""  # why the last call was not answered here
        self.calls = 0  # calls answered here
        self._lock = threading.Lock()  # one call at a time; guards the fields below
        self._sock: socket.socket | None = None
        self._ids = itertools.count(CHANNEL_CLOSING + 1)
        self._idle_s = 0.0  # the server closes the channel after this long unused
        self._used = 0.0
        self._retry_at = 0.0
        self._closed = False  # closed: no call from now on; the one in progress drops it

    def unary(self, method: str, request: Any, timeout: float | None) -> Any:
        """The answer to ``method`` (as the schema names it) with ``request``, or None (not
        sent or not read: use gRPC; ``last_reason`` says why).  Raises the call's error as
        gRPC's would read back, TimeoutError past ``timeout`` (None: no deadline), or
        ChannelBroken."""
        body = request.SerializeToString()
        answer = self.call(method, body, timeout)
        if answer is None:
            return None
        if answer.code == DEADLINE_EXCEEDED and not answer.error_type:
            # the server's word that the deadline passed (gRPC's own status, no trailer)
            raise TimeoutError(answer.message)
        if answer.code:
            raise error_from_answer(answer.code, answer.message, answer.error_type, answer.details)
        try:
            return _ANSWER_TYPES[method].FromString(answer.body)
        except DecodeError as exc:
            self.close()
            raise ChannelBroken(f"an answer to {method} that does not parse ({exc})") from None

    def call(self, method: str, body: bytes, timeout: float | None) -> Answer | None:
        """One call's answer, or None (not sent, or known unread: use gRPC)."""
        if (
            os.getpid() != self.pid
            or len(body) > MAX_CHANNEL_REQUEST_BYTES
            or not self._lock.acquire(timeout=CHANNEL_WAIT_S)
        ):
            return None
        try:
            if self._closed:
                return None
            deadline = None if timeout is None else time.monotonic() + timeout
            try:
                sock = self._connected(deadline)
            except (OSError, ValueError) as exc:
                self.last_reason = f"the call channel cannot be bound ({exc})"
                self._drop()
                return None
            if sock is None:
                return None
            return self._exchange(sock, method, body, timeout, deadline)
        finally:
            if self._closed:  # closed while this call ran
                self._drop()
            self._lock.release()

    def _exchange(
        self,
        sock: socket.socket,
        method: str,
        body: bytes,
        timeout: float | None,
        deadline: float | None,
    ) -> Answer | None:
        """(lock held) One frame out and its answer in."""
        request_id = next(self._ids) & 0xFFFFFFFF or next(self._ids)
        name = method.encode("ascii")
        deadline_ms = 0 if timeout is None else min(max(math.ceil(timeout * 1000), 1), 2**32 - 1)
        frame = CALL_HEADER.pack(request_id, deadline_ms, len(name), len(body)) + name + body
        try:
            sock.settimeout(None if deadline is None else max(deadline - time.monotonic(), 0.001))
            sock.sendall(frame)
        except OSError as exc:  # not all sent: the server never runs a partial frame
            self.last_reason = f"the call channel took no request ({exc})"
            self._drop()
            return None
        try:
            answer = self._answer(sock, request_id, deadline)
        except TimeoutError:
            self._drop()  # its answer may come later: never read as the next call's
            raise
        except (OSError, ValueError) as exc:
            self._drop()
            raise ChannelBroken(str(exc)) from None
        except BaseException:  # an interrupt mid-exchange: its answer may be on its way,
            self._drop()  # and must never be read as the next call's
            raise
        if answer is None:  # the server closed the channel without reading it
            self._drop()
            return None
        self._used = time.monotonic()
        self.calls += 1
        return answer

    def _answer(
        self, sock: socket.socket, request_id: int, deadline: float | None
    ) -> Answer | None:
        header = _receive_exactly(sock, ANSWER_HEADER.size, deadline)
        answered, code, message, error_type, details, nbytes = ANSWER_HEADER.unpack(header)
        texts = message + error_type + details
        if texts > MAX_ANSWER_TEXT_BYTES or nbytes > MAX_ANSWER_BYTES:
            raise ValueError(f"an answer of {texts} + {nbytes} bytes")
        if answered == CHANNEL_CLOSING:
            self.last_reason = _receive_exactly(sock, texts, deadline).decode("utf-8", "replace")
            return None
        if answered != request_id:
            raise ValueError(f"an answer to request {answered}, not {request_id}")
        rest = _receive_exactly(sock, texts + nbytes, deadline)
        a, b = message, message + error_type
        return Answer(
            code,
            rest[:a].decode("utf-8", "replace"),
            rest[a:b].decode("ascii", "replace"),
            rest[b:texts].decode("utf-8", "replace"),
            rest[texts:],
        )

    def _connected(self, deadline: float | None) -> socket.socket | None:
        """(lock held) The bound connection, made now if there is none or it was idle long
        enough for the server to have closed it; None while a failed bind's pause lasts."""
        now = time.monotonic()
        if self._sock is not None and now - self._used < self._idle_s / 2:
            return self._sock
        self._drop()
        if now < self._retry_at:
            return None
        self._retry_at = now + CHANNEL_RETRY_S  # cleared once bound
        # the proof is never sent: the server answers with it (as a ticket's), so a socket
        # squatted at the path (another host's) cannot pose as the server
        sent, _, proof = self.key.rpartition(".")
        wait = BIND_TIMEOUT_S if deadline is None else min(BIND_TIMEOUT_S, deadline - now)
        bind_deadline = now + max(wait, 0.001)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(max(wait, 0.001))
            try:
                sock.connect(self.path)
            except (FileNotFoundError, PermissionError):
                self._retry_at = math.inf  # no such socket here (another host): for good
                raise
            sock.sendall(CHANNEL_BIND + sent.encode("ascii") + b"\n")
            line = b""
            while not line.endswith(b"\n") and len(line) < MAX_BIND_LINE:
                line += _receive_exactly(sock, 1, bind_deadline)  # nothing past the line
            if not line.startswith(b"ok "):
                raise ConnectionRefusedError(line.decode("ascii", "replace").strip())
            idle, _, answered = line[3:].strip().partition(b" ")
            if not proof or not hmac.compare_digest(answered, proof.encode("ascii")):
                raise ConnectionRefusedError("the socket is not the server's: no proof of the key")
            self._idle_s = float(idle)
        except BaseException:
            sock.close()
            raise
        self._sock, self._used, self._retry_at = sock, now, 0.0
        return sock

    def _drop(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def close(self) -> None:
        """Close the connection, now or, when a call is in progress, as it ends (never
        waiting for it).  In a forked child the copy of the descriptor is only forgotten,
        so nothing reaches the parent's channel (nor is the lock taken there: a parent
        thread may have held it at the fork)."""
        self._closed = True
        if os.getpid() != self.pid:
            self._sock = None
            return
        if self._lock.acquire(blocking=False):
            try:
                self._drop()
            finally:
                self._lock.release()
