"""The server's fd socket, the client's side: a segment's descriptor for a ticket.

It checks that the socket is the server's before trusting what it says: the client sends
the first half of a ticket, and the server proves itself by answering with the second
(:func:`tensord.protocol.split_ticket`), so a stranger listening on a path the client was
sent learns nothing it can use.  (The same socket carries the session's call channel:
:mod:`tensord.wire.channel`.)
"""

from __future__ import annotations

import hmac
import os
import socket

from tensord.protocol import split_ticket

# The fd socket answers within this many seconds or the client gives up (and falls back).
FD_TIMEOUT_S = 2.0


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
