"""A tensord address: how gRPC dials it, and why nothing answers there.

``dial_address`` completes what a user typed (tensord's port where none is named, a URL
refused with the form to use).  Before gRPC dials, a plain socket probes the same place
(:func:`probe`): a refused connection or an unknown host raises at once, where gRPC would
retry until the connect timeout, and every such error says how to start a server that
the address would reach (:func:`serve_hint`).
"""

from __future__ import annotations

import contextlib
import enum
import ipaddress
import os
import socket

from tensord import errors
from tensord.protocol import DEFAULT_ADDRESS

# tensord's port: a host given without one means it (gRPC's own default port is 443)
DEFAULT_PORT = DEFAULT_ADDRESS.rpartition(":")[2]
# gRPC target schemes that name no host and port: left as they are
_OTHER_SCHEMES = ("unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:")
_URL_SCHEMES = ("http://", "https://", "grpc://", "grpcs://")


def _with_port(host_port: str) -> str:
    if not host_port:
        return host_port
    with contextlib.suppress(ValueError):
        ip = ipaddress.ip_address(host_port)  # a bare IP: "::1" is all host, no port
        return f"[{ip}]:{DEFAULT_PORT}" if ip.version == 6 else f"{ip}:{DEFAULT_PORT}"
    if host_port.startswith("["):
        return f"{host_port}:{DEFAULT_PORT}" if host_port.endswith("]") else host_port
    return host_port if ":" in host_port else f"{host_port}:{DEFAULT_PORT}"


def dial_address(address: str) -> str:
    """``address`` with tensord's port where it names none (``myhost`` -> ``myhost:50051``).

    A URL (``http://host:port``) is refused with the form to use: gRPC would read it as
    a host named ``http`` and wait out the whole connect timeout."""
    if address.lower().startswith(_URL_SCHEMES):
        rest = address.split("://", 1)[1].rstrip("/")
        tls = " and tls=True" if address.lower().startswith(("https://", "grpcs://")) else ""
        raise ValueError(
            f"a tensord address is HOST:PORT (or unix:PATH), not a URL: got {address!r}; "
            f"pass {_with_port(rest)!r}{tls} (the gRPC port of `tensord serve`, default "
            f"{DEFAULT_PORT}; not the dashboard's or the metrics' HTTP port)"
        )
    if address.startswith(_OTHER_SCHEMES):
        return address
    if address.startswith("dns:"):
        rest = address.removeprefix("dns:")
        if rest.startswith("//"):  # dns://[authority]/host:port
            authority, _, rest = rest[2:].partition("/")
            return f"dns://{authority}/{_with_port(rest)}"
        return f"dns:{_with_port(rest)}"
    return _with_port(address)


# gRPC dials through a proxy these name; a direct probe would judge another path
_PROXY_VARIABLES = ("grpc_proxy", "https_proxy", "http_proxy")


def _host_and_port(address: str) -> tuple[str, int] | None:
    """(host, port) of a dialled HOST:PORT or dns: address; None for any other."""
    if address.startswith(_OTHER_SCHEMES):
        return None
    host_port = address.removeprefix("dns:")
    if host_port.startswith("//"):  # dns://[authority]/host:port
        host_port = host_port[2:].partition("/")[2]
    host, _, port = host_port.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not port.isdigit():
        return None
    return host, int(port)


def _probe_target(address: str) -> str | tuple[str, int] | None:
    """Where a plain socket reaches what gRPC dials for ``address``: a unix socket's path,
    or (host, port); None where a socket cannot tell (other schemes, a proxy)."""
    if address.startswith("unix:"):
        path = address.removeprefix("unix:")
        return "/" + path.lstrip("/") if path.startswith("//") else path
    if address.startswith("unix-abstract:"):
        return "\0" + address.removeprefix("unix-abstract:")
    if any(os.environ.get(name) or os.environ.get(name.upper()) for name in _PROXY_VARIABLES):
        return None
    return _host_and_port(address)


class Probe(enum.Enum):
    """What a plain socket connect where gRPC dials found (when it raised nothing)."""

    ACCEPTED = "accepted"
    SILENT = "silent"  # neither accepted nor refused in time: a host down, a firewall
    UNTRIED = "untried"


def probe(address: str, timeout: float) -> Probe:
    """Connect a plain socket where gRPC would dial.  Refused, unresolvable or unreachable
    raise UnavailableError at once, where gRPC would retry until the connect timeout; an
    accepted connection is closed unused."""
    target = _probe_target(address)
    if target is None:
        return Probe.UNTRIED
    try:
        if isinstance(target, str):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(timeout)
                sock.connect(target)
        else:
            socket.create_connection(target, timeout=timeout).close()
    except TimeoutError:
        return Probe.SILENT
    except socket.gaierror as exc:
        raise errors.UnavailableError(
            f"cannot resolve the host {target[0]!r} of the tensord address {address}: "
            f"{exc.strerror}; a tensord address is HOST:PORT (default {DEFAULT_ADDRESS})"
        ) from None
    except (ConnectionRefusedError, FileNotFoundError) as exc:
        why = "connection refused" if isinstance(exc, ConnectionRefusedError) else "no such socket"
        raise errors.UnavailableError(
            f"no tensord server answers at {address} ({why}: nothing listens there); "
            f"{serve_hint(address)}"
        ) from None
    except OSError as exc:  # no route to the host, the network down
        raise errors.UnavailableError(
            f"no tensord server answers at {address} ({exc.strerror or exc}); "
            f"check the address, or {serve_hint(address)}"
        ) from None
    return Probe.ACCEPTED


def serve_hint(address: str) -> str:
    """How to start a server that ``address`` reaches, in `tensord serve`'s flags."""
    if address == DEFAULT_ADDRESS:
        return f"start one with `tensord serve` (it listens on {DEFAULT_ADDRESS})"
    if address.startswith(("unix:", "unix-abstract:")):
        return f"start one with `tensord serve --address {address}`"
    host_port = _host_and_port(address)
    if host_port is None:
        return "start one with `tensord serve`, or pass the address of a running one"
    host, port = host_port
    try:
        remote = not ipaddress.ip_address(host).is_loopback
    except ValueError:
        remote = host != "localhost"
    if remote:  # serve refuses a non-loopback address without tokens
        return (
            f"start one on {host} with `tensord serve --address 0.0.0.0:{port} "
            "--auth-tokens FILE`, or pass the address of a running one"
        )
    shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return f"start one with `tensord serve --address {shown}`"
