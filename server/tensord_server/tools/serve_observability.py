"""``tensord serve``'s observability flags and the HTTP endpoints they start.

``--metrics-address`` and ``--dashboard-address`` take HOST:PORT (a bare PORT
means 127.0.0.1:PORT; the same address for both serves both from one port).
The rules follow the gRPC port's: a non-loopback address needs --auth-tokens
(or --insecure-allow-remote); with --auth-tokens the data routes need an
operator tenant's token (--operator-tenant, required then); with --tls-cert
the endpoints serve HTTPS with the same certificate, each connection's handshake on
its own thread.  What one caller can hold of them is bounded (a few connections per
peer address, each for one request that must arrive within 10 s): the limits are
named and explained in ``observability/dashboard.py``'s docstring.
"""

from __future__ import annotations

import argparse
import ssl
from collections.abc import Callable

from tensord_server.domain.store import TensorStore
from tensord_server.observability.dashboard import HttpEndpoints
from tensord_server.observability.logs import LOG_FORMATS, LOG_LEVELS

DEFAULT_HTTP_HOST = "127.0.0.1"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--metrics-address",
        metavar="HOST:PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (a bare PORT: on "
        f"{DEFAULT_HTTP_HOST}; default: off)",
    )
    parser.add_argument(
        "--dashboard-address",
        metavar="HOST:PORT",
        help="serve the live pool dashboard at http://HOST:PORT/ (a bare PORT: on "
        f"{DEFAULT_HTTP_HOST}; default: off)",
    )
    parser.add_argument(
        "--operator-tenant",
        action="append",
        dest="operator_tenants",
        default=[],
        metavar="TENANT",
        help="with --auth-tokens: a tenant whose tokens open /metrics and the dashboard, which "
        "show every tenant's figures (repeatable; required for them with --auth-tokens)",
    )
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="text",
        help="text lines or one JSON object per line (default: text)",
    )
    parser.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default="info",
        help="info: session lifecycle, OOMs, compactions, refusals; debug adds an access "
        "line per RPC (default: info)",
    )


def split_address(address: str) -> tuple[str, int]:
    """(host, port) of HOST:PORT, [V6]:PORT or a bare PORT; ValueError otherwise."""
    host, _, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"expected HOST:PORT or PORT, got {address!r}") from None
    if not 0 <= number <= 65535:
        raise ValueError(f"port out of range in {address!r}")
    return host or DEFAULT_HTTP_HOST, number


def check_arguments(args: argparse.Namespace, is_loopback: Callable[[str], bool]) -> str | None:
    """Why the observability flags cannot be served as given (None: they can).

    ``is_loopback`` judges a host as serve judges its gRPC address (passed in: serve imports
    this module, so importing serve here would close a cycle); it raises a ValueError for a
    host that does not resolve.
    """
    addresses = [a for a in (args.metrics_address, args.dashboard_address) if a is not None]
    if args.operator_tenants and args.auth_tokens is None:
        return "--operator-tenant needs --auth-tokens"
    for address in addresses:
        try:
            host, _ = split_address(address)
            loopback = is_loopback(host)
        except ValueError as exc:
            return str(exc)
        if args.auth_tokens is None and not loopback and not args.insecure_allow_remote:
            return (
                f"refusing to serve metrics or the dashboard on {address} without --auth-tokens "
                "(pass --insecure-allow-remote to do it anyway)"
            )
        if args.auth_tokens is not None and not args.operator_tenants:
            return (
                "--metrics-address and --dashboard-address show every tenant's figures: with "
                "--auth-tokens name the tenant(s) whose tokens may see them (--operator-tenant)"
            )
    return None


def start_endpoints(args: argparse.Namespace, store: TensorStore) -> list[HttpEndpoints]:
    """The HTTP endpoints the flags ask for, started (OSError if a port cannot be had)."""
    if store.auth_tokens is not None:
        unknown = set(args.operator_tenants) - set(store.auth_tokens.values())
        if unknown:
            raise ValueError(f"--operator-tenant names no tenant of the tokens file: {unknown}")
    wanted: dict[tuple[str, int], set[str]] = {}
    for route, address in (
        ("metrics", args.metrics_address),
        ("dashboard", args.dashboard_address),
    ):
        if address is not None:
            wanted.setdefault(split_address(address), set()).add(route)
    context = None
    if args.tls_cert is not None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(args.tls_cert, args.tls_key)
    started: list[HttpEndpoints] = []
    try:
        for (host, port), routes in wanted.items():
            endpoints = HttpEndpoints(
                store,
                host,
                port,
                metrics="metrics" in routes,
                dashboard="dashboard" in routes,
                operator_tenants=args.operator_tenants,
                ssl_context=context,
            )
            started.append(endpoints.start())
    except BaseException:
        for endpoints in started:
            endpoints.close()
        raise
    return started


def describe(endpoints: HttpEndpoints, tls: bool) -> str:
    """What ``tensord serve`` prints for one endpoint: its real URLs."""
    scheme = "https" if tls else "http"
    shown = f"[{endpoints.host}]" if ":" in endpoints.host else endpoints.host
    routes = [r for r, on in (("/metrics", endpoints.metrics), ("/", endpoints.dashboard)) if on]
    return " ".join(f"{scheme}://{shown}:{endpoints.port}{route}" for route in routes)
