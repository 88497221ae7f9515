"""Why the listening address cannot be bound, in words an operator can act on.

gRPC reports every failed bind as "Failed to bind to address ...": binding a plain
socket the same way (SO_REUSEADDR, as gRPC does) finds the system's reason.
"""

from __future__ import annotations

import errno
import socket


def bind_problem(address: str) -> str | None:
    """Why HOST:PORT cannot be bound (None: a plain socket binds it, or it cannot tell)."""
    if address.startswith("unix:"):
        return None
    host, _, port_text = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        port = int(port_text)
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except (OSError, ValueError, UnicodeError):
        return None
    for family, kind, proto, _, where in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(where)
            except OSError as exc:
                return _described(exc, host, port)
    return None


def _described(exc: OSError, host: str, port: int) -> str:
    if exc.errno == errno.EADDRINUSE:
        return (
            f"address already in use: another tensord serve or another program listens on "
            f"port {port}; stop it, or choose another port (--address {host or '0.0.0.0'}:PORT; "
            "port 0 picks a free one)"
        )
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"cannot assign requested address: {host} is not an address of this machine"
    if exc.errno == errno.EACCES:
        return f"permission denied: port {port} needs privileges; choose one above 1023"
    return exc.strerror or str(exc)
