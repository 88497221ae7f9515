"""TLS: `tensord serve --tls-cert/--tls-key` and the SDK's ``tls=`` / ``root_certificates=``,
tested with self-signed certificates made here (cryptography)."""

from __future__ import annotations

import datetime
import ipaddress
import socket
import ssl
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tensord
from conftest import run_serve, start_serve_process
from tensord_server.domain.store import TensorStore
from tensord_server.rpc.grpc_server import create_server
from tensord_server.rpc.tls import server_credentials

# Quick failures: a refused handshake looks like a server that never answers.
REFUSED_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class CertFiles:
    cert: Path
    key: Path


def make_self_signed(directory: Path, name: str = "tensord-test") -> CertFiles:
    """A self-signed certificate for localhost and 127.0.0.1, and its key, as PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    files = CertFiles(directory / f"{name}.crt", directory / f"{name}.key")
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files.key.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return files


@dataclass
class TlsServer:
    address: str
    certs: CertFiles
    daemon: TensorStore


@pytest.fixture
def certs(tmp_path: Path) -> CertFiles:
    return make_self_signed(tmp_path / "server")


@pytest.fixture
def tls_server(certs: CertFiles) -> Iterator[TlsServer]:
    daemon = TensorStore(["cpu=256MiB"], auth_tokens={"tok-alice": "alice"})
    server, port = create_server(
        "127.0.0.1:0", store=daemon, credentials=server_credentials(certs.cert, certs.key)
    )
    yield TlsServer(f"127.0.0.1:{port}", certs, daemon)
    server.stop(2.0).wait()
    daemon.close()


def test_a_client_with_the_servers_root_round_trips_tensors(tls_server: TlsServer) -> None:
    data = np.arange(300_000, dtype=np.float32).reshape(600, 500)
    with tensord.connect(
        tls_server.address, token="tok-alice", root_certificates=tls_server.certs.cert
    ) as client:
        tensor = client.tensor(data)
        transposed = tensor.t().contiguous()  # kept: a dropped one is released in the background
        np.testing.assert_array_equal(transposed.numpy(), data.T)
        assert client.memory_stats()["tenant.storages.live"] == 2


def test_roots_may_be_pem_bytes_or_come_from_the_environment(
    tls_server: TlsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    pem = tls_server.certs.cert.read_bytes()
    with tensord.connect(tls_server.address, token="tok-alice", root_certificates=pem) as client:
        assert client.arange(3).tolist() == [0, 1, 2]
    monkeypatch.setenv("TENSORD_TLS_CA", str(tls_server.certs.cert))
    monkeypatch.setenv("TENSORD_TOKEN", "tok-alice")
    with tensord.connect(tls_server.address) as client:
        assert client.arange(2).tolist() == [0, 1]


@pytest.mark.slow
def test_a_plaintext_client_cannot_talk_to_a_tls_server(tls_server: TlsServer) -> None:
    with pytest.raises(tensord.UnavailableError, match="connect with tls=True"):
        tensord.connect(tls_server.address, token="tok-alice", tls=False, timeout=REFUSED_TIMEOUT_S)


@pytest.mark.slow
def test_a_certificate_the_client_does_not_trust_is_refused(
    tls_server: TlsServer, tmp_path: Path
) -> None:
    stranger = make_self_signed(tmp_path / "other", name="someone-else")
    with pytest.raises(tensord.UnavailableError, match="root_certificates sign"):
        tensord.connect(
            tls_server.address,
            token="tok-alice",
            root_certificates=stranger.cert,
            timeout=REFUSED_TIMEOUT_S,
        )
    # the system's roots do not know a self-signed certificate either
    with pytest.raises(tensord.UnavailableError):
        tensord.connect(tls_server.address, token="tok-alice", tls=True, timeout=REFUSED_TIMEOUT_S)


def test_tls_does_not_replace_the_token(tls_server: TlsServer) -> None:
    with pytest.raises(tensord.UnauthenticatedError):
        tensord.connect(tls_server.address, root_certificates=tls_server.certs.cert, token="nope")


@pytest.mark.slow
def test_a_tls_client_cannot_talk_to_a_plaintext_server(server, certs: CertFiles) -> None:
    with pytest.raises(tensord.UnavailableError):
        tensord.connect(server.address, root_certificates=certs.cert, timeout=REFUSED_TIMEOUT_S)


def test_bad_client_tls_arguments(certs: CertFiles, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tls=False"):
        tensord.connect("127.0.0.1:1", tls=False, root_certificates=certs.cert)
    with pytest.raises(ValueError, match="cannot read root certificates"):
        tensord.connect("127.0.0.1:1", root_certificates=tmp_path / "missing.pem")


@pytest.mark.slow
def test_serve_with_tls_says_so_and_serves(certs: CertFiles) -> None:
    process, address = start_serve_process(
        "--address", "127.0.0.1:0", "--device", "cpu=64MiB",
        "--tls-cert", str(certs.cert), "--tls-key", str(certs.key),
    )  # fmt: skip
    try:
        mode = process.stdout.readline()
        assert "TLS" in mode and "plaintext" not in mode
        with tensord.connect(address, root_certificates=certs.cert) as client:
            assert client.ones(4).tolist() == [1.0, 1.0, 1.0, 1.0]
    finally:
        process.terminate()
        process.communicate(timeout=30)
    assert process.returncode == 0


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tls-cert", "CERT"], "--tls-cert and --tls-key go together"),
        (["--tls-cert", "CERT", "--tls-key", "MISSING"], "cannot read the TLS private key"),
        (["--tls-cert", "KEYLESS", "--tls-key", "KEY"], "is not a PEM file"),
        (["--tls-cert", "KEY", "--tls-key", "CERT"], "do not go together"),  # swapped
        (["--tls-cert", "CERT", "--tls-key", "OTHER_KEY"], "do not go together"),
    ],
)
def test_serve_refuses_bad_tls_files(
    args: list[str], message: str, certs: CertFiles, tmp_path: Path
) -> None:
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello")
    paths = {
        "CERT": str(certs.cert),
        "KEY": str(certs.key),
        "MISSING": str(tmp_path / "missing.key"),
        "KEYLESS": str(not_pem),
        "OTHER_KEY": str(make_self_signed(tmp_path / "other", name="other").key),
    }
    result = run_serve("--address", "127.0.0.1:0", *(paths.get(a, a) for a in args))
    assert result.returncode == 2
    assert message in result.stderr


def test_tokens_in_clear_text_on_a_network_address_are_warned_about() -> None:
    from tensord_server.tools.serve import cleartext_warning, mode_line

    assert "clear text" in cleartext_warning("0.0.0.0:1", authenticated=True, tls=False)
    assert cleartext_warning("0.0.0.0:1", authenticated=True, tls=True) is None
    assert cleartext_warning("127.0.0.1:1", authenticated=True, tls=False) is None
    assert mode_line("0.0.0.0:1", authenticated=True, tls=True).endswith(", TLS")


@pytest.mark.slow
def test_a_silent_connection_does_not_hold_up_an_https_scrape(
    certs: CertFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the handshake ran in the accept loop: one connection that sent nothing stopped every scrape
    from tensord_server.observability import HttpEndpoints, dashboard

    monkeypatch.setattr(dashboard, "TLS_HANDSHAKE_TIMEOUT_S", 1.0)
    daemon = TensorStore(["cpu=16MiB"])
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certs.cert, certs.key)
    endpoints = HttpEndpoints(daemon, "127.0.0.1", 0, ssl_context=context).start()
    trusted = ssl.create_default_context(cafile=certs.cert)
    try:
        with socket.create_connection(("127.0.0.1", endpoints.port), timeout=10) as silent:
            url = f"https://127.0.0.1:{endpoints.port}/metrics"
            with urllib.request.urlopen(url, context=trusted, timeout=10) as response:
                assert response.status == 200
                assert b"tensord_pool_allocated_bytes" in response.read()
            assert silent.recv(1) == b""  # closed once its handshake's time ran out
    finally:
        endpoints.close()
        daemon.close()
