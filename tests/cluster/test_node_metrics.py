"""/metrics of a cluster's node say which node they are: ``tensord_node_info``.

A unit test on a TensorStore given a directory (no etcd), then one ``tensord serve`` node
joined to a real etcd and scraped over HTTP (skipped without etcd).
"""

from __future__ import annotations

import os
import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import tensord
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from tensord.protocol import VERSION
from tensord_server.domain.store import TensorStore
from tensord_server.observability.metrics import observer_for
from tensord_server.observability.node_info import NAME, node_labels
from test_cluster import (
    CLUSTER_SECRET,
    TOKENS,
    EtcdServer,
    Node,
    free_port,
    needs_etcd,
    start_etcd,
    start_nodes,
)


def node_info_samples(text: str) -> list[dict[str, str]]:
    """The labels of every ``tensord_node_info`` sample of a /metrics text (each valued 1)."""
    found = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == NAME:
                assert sample.value == 1.0, sample
                found.append(dict(sample.labels))
    return found


class Member:
    """A directory's identity, as a ClusterNode shows it."""

    def __init__(self, node: str, incarnation: str) -> None:
        self.node = node
        self.incarnation = incarnation


@pytest.fixture
def store() -> Iterator[TensorStore]:
    made = TensorStore(("cpu=16MiB",))
    yield made
    made.close()


def scrape_registry(store: TensorStore) -> str:
    return generate_latest(observer_for(store).registry).decode()


def test_a_server_alone_exports_no_node_and_a_member_exactly_one(store: TensorStore) -> None:
    assert node_info_samples(scrape_registry(store)) == []
    member = Member("a", "inc-1")
    store.names.directory = member  # type: ignore[assignment]  # only its identity is read
    try:
        assert node_info_samples(scrape_registry(store)) == [
            {"node": "a", "incarnation": "inc-1", "version": VERSION}
        ]
        member.incarnation = "inc-2"  # registered again after a lapse: the new one only
        assert node_info_samples(scrape_registry(store)) == [
            {"node": "a", "incarnation": "inc-2", "version": VERSION}
        ]
    finally:
        store.names.directory = None


def test_a_directory_without_an_incarnation_is_named_with_an_empty_one() -> None:
    class Bare:
        node = "b"

    assert node_labels(None) is None
    labels = node_labels(Bare())
    assert labels is not None and (labels.node, labels.incarnation) == ("b", "")


@pytest.fixture
def etcd_server() -> Iterator[EtcdServer]:
    server = start_etcd()
    yield server
    server.stop()
    shutil.rmtree(server.data_dir, ignore_errors=True)


@pytest.fixture
def metered_node(etcd_server: EtcdServer, tmp_path: Path) -> Iterator[tuple[Node, int]]:
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKENS)
    secret = tmp_path / "cluster-token"
    secret.write_text(CLUSTER_SECRET + "\n")
    port = free_port()
    nodes = start_nodes(
        etcd_server, str(tokens), "m", "--metrics-address", f"127.0.0.1:{port}",
        "--operator-tenant", "alice", secret=str(secret),
    )  # fmt: skip
    yield nodes[0], port
    for node in nodes:
        node.stop()


@needs_etcd
@pytest.mark.slow
def test_a_node_s_metrics_name_its_node_and_current_incarnation(
    metered_node: tuple[Node, int],
) -> None:
    node, port = metered_node
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    request.add_header("Authorization", "Bearer alice-token")
    with urllib.request.urlopen(request, timeout=10) as response:
        text = response.read().decode()
    with tensord.connect(node.address, token="alice-token", local=False) as client:
        (record,) = [n for n in client.nodes() if n["node"] == f"m-{os.getpid()}"]
    assert node_info_samples(text) == [
        {"node": f"m-{os.getpid()}", "incarnation": record["incarnation"], "version": VERSION}
    ]
