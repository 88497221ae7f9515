"""The server's fd socket, the client's side: a segment's descriptor for a ticket, and the
session's export channel (Exports without a gRPC round trip).

Both check that the socket is the server's before trusting what it says: the client
sends the first half of a ticket or key, and the server proves itself by answering with
the second (:func:`tensord.protocol.split_ticket`), so a stranger listening on a path
the client was sent learns nothing it can use.
"""

from __future__ import annotations

import hmac
import os
import socket
import threading
import time

from tensord.protocol import (
    CHANNEL_ANSWER_HEADER,
    CHANNEL_BIND,
    CHANNEL_FRAME_HEADER,
    CHANNEL_OK,
    split_ticket,
)

# The fd socket answers within this many seconds or the client gives up (and falls back).
FD_TIMEOUT_S = 2.0
# The session's export channel (:class:`ExportChannel`): an answer comes within this many
# seconds (or call_timeout, if shorter), else the Export is asked through gRPC.
CHANNEL_TIMEOUT_S = 5.0
# After a failed connect or a refused bind, Exports take gRPC this long before a new try.
CHANNEL_RETRY_S = 5.0
# The longest answer taken from the channel (an ExportResponse is well under 16 KiB).
MAX_CHANNEL_ANSWER_BYTES = 1 << 20


def receive_segment_fd(path: str, ticket: str, nbytes: int) -> int:
    """The descriptor of a segment of ``nbytes``, for a ticket, from the server's fd socket;
    OSError otherwise.

    Only the ticket's key is sent; the server proves it is the one that issued the ticket by
    answering with the rest (a stranger listening on that path learns nothing it can use),
    and the descriptor must be a file of at least ``nbytes`` (a shorter one would raise
    SIGBUS on access, killing this process).
    """
    key, proof = split_ticket(ticket)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(FD_TIMEOUT_S)
        sock.connect(path)
        sock.sendall(key.encode("ascii") + b"\n")
        message, fds, _flags, _addr = socket.recv_fds(sock, 256, 1)
    expected = b"ok " + proof.encode("ascii") + b"\n"
    if not proof or not hmac.compare_digest(message, expected) or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        if message.startswith(b"ok"):
            raise OSError("the fd socket is not the server's: it did not prove the ticket")
        raise OSError(message.decode("ascii", "replace").strip() or "the fd socket said nothing")
    fd = fds[0]
    size = os.fstat(fd).st_size
    if size < nbytes:
        os.close(fd)
        raise OSError(f"the segment's file holds {size} bytes, not the {nbytes} announced")
    return fd


def _receive_exactly(sock: socket.socket, nbytes: int, deadline: float) -> bytes:
    """``nbytes`` from ``sock`` before ``deadline``; OSError otherwise (TimeoutError past it)."""
    data = bytearray()
    while len(data) < nbytes:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the export channel did not answer in time")
        sock.settimeout(left)
        piece = sock.recv(nbytes - len(data))
        if not piece:
            raise ConnectionResetError("the server closed the export channel")
        data += piece
    return bytes(data)


class ExportChannel:
    """A session's export channel: one connection to the server's fd socket, bound to the
    session by its key (``chan LOCATOR.SECRET``, answered with its proof), carrying Exports
    without a gRPC round trip.  One request at a time (another thread meanwhile takes gRPC).  Whatever fails
    (connect, bind, timeout, a closed socket, a bad frame, the server's "use gRPC") answers
    None and the caller asks through gRPC, which raises the proper errors.  Connected
    lazily; reconnected after the server's idle timeout; never used in a forked child."""

    def __init__(self, session_id: str, key: str, path: str) -> None:
        self.session_id = session_id
        self.key = key
        self.path = path
        self.pid = os.getpid()
        self.last_reason = ""  # why the last request was not answered here
        self._lock = threading.Lock()  # one request at a time; guards the fields below
        self._sock: socket.socket | None = None
        self._idle_s = 0.0  # the server closes the channel after this long unused
        self._used = 0.0
        self._retry_at = 0.0

    def request(self, payload: bytes, timeout: float) -> bytes | None:
        """An answer's bytes, or None (use gRPC; ``last_reason`` says why)."""
        if os.getpid() != self.pid or not self._lock.acquire(blocking=False):
            return None
        try:
            deadline = time.monotonic() + timeout
            try:
                sock = self._connected(deadline)
                if sock is None:
                    return None
                answer = self._exchange(sock, payload, deadline)
            except (OSError, ValueError) as exc:
                self.last_reason = f"the export channel failed ({exc})"
                self._drop()
                return None
            except BaseException:  # an interrupt mid-exchange: its answer may be on its way,
                self._drop()  # and must never be read as the next request's
                raise
            self._used = time.monotonic()
            return answer
        finally:
            self._lock.release()

    def _connected(self, deadline: float) -> socket.socket | None:
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
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(max(deadline - now, 0.001))
            sock.connect(self.path)
            sock.sendall(CHANNEL_BIND + sent.encode("ascii") + b"\n")
            line = b""
            while not line.endswith(b"\n") and len(line) < 256:
                line += _receive_exactly(sock, 1, deadline)
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

    def _exchange(self, sock: socket.socket, payload: bytes, deadline: float) -> bytes | None:
        """(lock held) One request and its answer; None for "use gRPC" (the channel stays)."""
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        sock.sendall(CHANNEL_FRAME_HEADER.pack(len(payload)) + payload)
        status, length = CHANNEL_ANSWER_HEADER.unpack(
            _receive_exactly(sock, CHANNEL_ANSWER_HEADER.size, deadline)
        )
        if length > MAX_CHANNEL_ANSWER_BYTES:
            raise ValueError(f"an answer of {length} bytes")
        body = _receive_exactly(sock, length, deadline)
        if status != CHANNEL_OK:
            self.last_reason = body.decode("utf-8", "replace")
            return None
        return body

    def _drop(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def close(self) -> None:
        """Close the connection (in the process that made it: a forked child's copy of the
        descriptor is only forgotten, so nothing reaches the parent's channel; nor is the
        lock taken there: a parent thread may have held it at the fork)."""
        if os.getpid() != self.pid:
            self._sock = None
            return
        with self._lock:
            self._drop()
