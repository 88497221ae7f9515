"""TLS for the listening port: ``tensord serve --tls-cert FILE --tls-key FILE``.

With TLS the channel is encrypted and the client checks the server's
certificate against its roots (the SDK's ``root_certificates=``, or the system's),
so bearer tokens and tensor bytes can cross an untrusted network.  Clients are
not asked for certificates: they authenticate with ``--auth-tokens``.

A node of a cluster that serves TLS makes its node-to-node calls over TLS too, checking
the other node's certificate against ``--cluster-ca`` (:func:`read_roots`).
"""

from __future__ import annotations

import ssl
from pathlib import Path

import grpc

PEM_MARKER = b"-----BEGIN "


def read_pem(path: str | Path, what: str) -> bytes:
    """A PEM file's bytes; ValueError naming the file when unreadable or not PEM."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read the TLS {what} {str(path)!r}: {exc.strerror}") from None
    if PEM_MARKER not in data:
        raise ValueError(f"the TLS {what} {str(path)!r} is not a PEM file")
    return data


def check_key_pair(cert_path: str | Path, key_path: str | Path) -> None:
    """ValueError unless the files are a certificate chain and its own private key.

    gRPC would only fail later, binding the port ("cannot listen"), which sends an
    operator after the address rather than the files.
    """
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(certfile=str(cert_path), keyfile=str(key_path))
    except ssl.SSLError as exc:
        raise ValueError(
            f"the TLS certificate {str(cert_path)!r} and private key {str(key_path)!r} do not "
            f"go together (swapped, or the key of another certificate?): {exc.reason or exc}"
        ) from None


def server_credentials(cert_path: str | Path, key_path: str | Path) -> grpc.ServerCredentials:
    """Credentials for ``add_secure_port`` from a PEM certificate chain and its private key."""
    key, cert = read_pem(key_path, "private key"), read_pem(cert_path, "certificate")
    check_key_pair(cert_path, key_path)
    return grpc.ssl_server_credentials([(key, cert)])


def read_roots(path: str | Path, flag: str) -> bytes:
    """A PEM bundle of root certificates (``flag``'s file); ValueError naming the flag and
    the file when unreadable, not PEM, or holding no certificate a TLS client can load."""
    data = read_pem(path, f"root certificates ({flag})")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_verify_locations(cadata=data.decode("ascii", errors="replace"))
    except ssl.SSLError as exc:
        raise ValueError(
            f"{flag} {str(path)!r} holds no usable certificate: {exc.reason or exc}"
        ) from None
    return data
