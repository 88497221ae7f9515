"""A cluster whose nodes serve TLS calls node to node over TLS, checked against --cluster-ca.

A throwaway CA and node certificates for 127.0.0.1 are made here (``cryptography``); etcd
and the nodes run on loopback.  A put on one node is read from a client of another (the
SDK follows the redirect with the TLS it was given), a copy goes node to node over TLS
bit for bit, and a node whose --cluster-ca did not issue its peers' certificates, or
whose peer serves plaintext, fails the copy saying so: there is no plaintext fallback.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensord
from conftest import run_serve
from tensord import errors
from tensord.wire import requests
from test_cluster import (
    TOKENS,
    EtcdServer,
    Node,
    needs_etcd,
    node_id,
    running_etcd,
    start_nodes,
)

etcd = pytest.fixture(scope="module", name="etcd")(running_etcd)


@dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path


def _pem_key(key: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


def make_ca(directory: Path, name: str) -> tuple[Issued, Any, Any]:
    """A CA's certificate and key files, and the certificate and key as objects."""
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
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    files = Issued(directory / f"{name}.crt", directory / f"{name}.key")
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files.key.write_bytes(_pem_key(key))
    return files, cert, key


def issue(
    directory: Path, name: str, ca_cert: Any, ca_key: Any, hosts: tuple[str, ...] = ()
) -> Issued:
    """A node's certificate for ``hosts`` (DNS names; by default localhost and
    127.0.0.1), issued by the CA, and its key."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    sans: list[Any] = [x509.DNSName(host) for host in hosts] or [
        x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
    ]
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    files = Issued(directory / f"{name}.crt", directory / f"{name}.key")
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files.key.write_bytes(_pem_key(key))
    return files


@dataclass(frozen=True)
class Pki:
    ca: Issued  # the cluster's CA
    other_ca: Issued  # a CA that issued none of the nodes' certificates
    nodes: dict[str, Issued]  # each node's certificate, issued by ``ca``
    elsewhere: Issued  # issued by ``ca``, for another host only (not 127.0.0.1)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    pytest.importorskip("cryptography")
    directory = tmp_path_factory.mktemp("pki")
    ca, ca_cert, ca_key = make_ca(directory, "cluster-ca")
    other, _, _ = make_ca(directory, "other-ca")
    nodes = {name: issue(directory, f"node-{name}", ca_cert, ca_key) for name in "abcp"}
    elsewhere = issue(directory, "node-elsewhere", ca_cert, ca_key, hosts=("other.example",))
    return Pki(ca, other, nodes, elsewhere)


def tls_flags(pki: Pki, name: str, ca: Issued | None = None) -> list[str]:
    node = pki.nodes[name]
    roots = pki.ca if ca is None else ca
    return [
        "--tls-cert",
        str(node.cert),
        "--tls-key",
        str(node.key),
        "--cluster-ca",
        str(roots.cert),
    ]


def serve_tls(etcd: EtcdServer, tokens: str, pki: Pki, name: str, ca: Issued | None = None) -> Node:
    return start_nodes(etcd, tokens, name, *tls_flags(pki, name, ca))[0]


def connect(node: Node, pki: Pki) -> Any:
    return tensord.connect(
        node.address,
        token="alice-token",
        root_certificates=pki.ca.cert,
        local=False,
        call_timeout=10,
    )


@pytest.fixture
def tokens_file(tmp_path: Path) -> str:
    path = tmp_path / "tokens"
    path.write_text(TOKENS)
    return str(path)


@pytest.mark.slow
def test_serve_refuses_tls_in_a_cluster_without_whom_to_trust(pki: Pki, tmp_path: Path) -> None:
    cluster = ["--node-id", "a", "--cluster", "etcd://127.0.0.1:1"]
    node = pki.nodes["a"]
    tls = ["--tls-cert", str(node.cert), "--tls-key", str(node.key)]
    not_pem = tmp_path / "roots.txt"
    not_pem.write_text("not a certificate\n")
    broken = tmp_path / "broken.pem"
    broken.write_text("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    refusals = [
        ([*cluster, *tls], "--tls-cert in a cluster needs --cluster-ca FILE"),
        ([*cluster, "--cluster-ca", str(pki.ca.cert)], "--cluster-ca needs --tls-cert"),
        ([*tls, "--cluster-ca", str(pki.ca.cert)], "--cluster-ca needs --cluster"),
        ([*cluster, *tls, "--cluster-ca", str(not_pem)], "is not a PEM file"),
        ([*cluster, *tls, "--cluster-ca", str(broken)], "holds no usable certificate"),
    ]
    for args, said in refusals:
        result = run_serve("--address", "127.0.0.1:0", *args)
        assert result.returncode == 2, (args, result.stderr)
        assert said in result.stderr, (args, result.stderr)


@needs_etcd
@pytest.mark.slow
def test_tls_nodes_redirect_and_copy_over_tls(etcd: EtcdServer, tokens_file: str, pki: Pki) -> None:
    torch = pytest.importorskip("torch")
    a = serve_tls(etcd, tokens_file, pki, "a")
    b = serve_tls(etcd, tokens_file, pki, "b")
    try:
        with connect(a, pki) as on_a, connect(b, pki) as on_b:
            data = np.arange(24, dtype=np.float32).reshape(4, 6) * 1.5
            on_a.put("weights", on_a.tensor(data))
            got = on_b.get("weights")  # the redirect, followed over TLS with on_b's roots
            assert got.client.address == a.address
            assert got.numpy().tobytes() == data.tobytes()
            base = torch.arange(4 * 6 * 8, dtype=torch.float32).reshape(4, 6, 8) * 0.25 - 7
            x = on_a.tensor(base.numpy())
            for view, oracle in (
                (x, base),
                (x.transpose(0, 2)[1:, ::2], base.transpose(0, 2)[1:, ::2]),
            ):
                moved = view.to(f"{node_id(b)}/cpu")  # a to b: a node call, over TLS only
                assert moved.client.address == b.address
                want = oracle.contiguous().numpy()
                assert np.asarray(moved.numpy()).tobytes() == want.tobytes()
            back = on_b.tensor(data).to(f"{node_id(a)}/cpu")
            assert back.client.address == a.address and back.numpy().tobytes() == data.tobytes()
    finally:
        b.stop()
        a.stop()


@needs_etcd
@pytest.mark.slow
def test_a_node_call_to_an_unvouched_or_plaintext_peer_fails_clearly(
    etcd: EtcdServer, tokens_file: str, pki: Pki
) -> None:
    a = serve_tls(etcd, tokens_file, pki, "a")
    c = serve_tls(etcd, tokens_file, pki, "c", ca=pki.other_ca)  # trusts none of its peers
    try:
        with connect(c, pki) as on_c:
            x = on_c.tensor(np.arange(6, dtype=np.float32))
            with pytest.raises(errors.UnavailableError, match="TLS handshake failed") as raised:
                x.to(f"{node_id(a)}/cpu")
            assert "--cluster-ca" in str(raised.value) and a.address in str(raised.value)
            assert not isinstance(raised.value, errors.NodeLostError)
        # a node serving plaintext does not join a cluster whose nodes serve TLS
        refused = run_serve(
            "--address", "127.0.0.1:0", "--auth-tokens", tokens_file, "--node-id", "p",
            "--cluster", etcd.url(), "--cluster-lease", "2s",
        )  # fmt: skip
        assert refused.returncode == 2, refused.stderr
        assert "serves TLS and this node plaintext" in refused.stderr, refused.stderr
    finally:
        c.stop()
        a.stop()


@pytest.mark.parametrize("peer", ["certified for another host", "serving plaintext"])
def test_a_node_call_to_a_peer_certified_for_another_host_fails_clearly(
    pki: Pki, peer: str
) -> None:
    """The cluster's CA vouches for the peer's certificate, but for another host than
    the address it was dialled at, or the peer does not speak TLS (a record in etcd that
    does not say, of an older node): a failed TLS handshake, not a lost node."""
    from concurrent import futures

    import grpc
    from tensord_server.rpc.nodes import NodeLink

    reached: list[bool] = []

    def upload(chunks: Any, context: Any) -> None:
        reached.append(True)
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "reached the handler")

    handler = grpc.method_handlers_generic_handler(
        "tensord.v1.Tensord", {"Upload": grpc.stream_unary_rpc_method_handler(upload)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers([handler])
    if peer == "serving plaintext":
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    else:
        credentials = grpc.ssl_server_credentials(
            [(pki.elsewhere.key.read_bytes(), pki.elsewhere.cert.read_bytes())]
        )
        address = f"127.0.0.1:{server.add_secure_port('127.0.0.1:0', credentials)}"
    server.start()
    link = NodeLink("cluster-secret-0123456789", pki.ca.cert.read_bytes())
    try:
        header = requests.upload_header((1,), "float32", "cpu", 4, False)
        with pytest.raises(errors.UnavailableError, match="TLS handshake failed") as raised:
            link.send("h", address, "alice", "session", header, [bytes(4)])
        assert not isinstance(raised.value, errors.NodeLostError)
        assert "--cluster-ca" in str(raised.value) and address in str(raised.value)
        assert reached == []  # the call never got past the handshake
    finally:
        link.close()
        server.stop(0)
