"""``tensord_node_info``: which member of a cluster a server's /metrics come from.

A server that joined a cluster (``tensord serve --node-id NAME --cluster ...``) exports one
series, ``tensord_node_info{node="NAME", incarnation="...", version="..."} 1``, read from
its directory at scrape time: the incarnation is the one of its current registration, so
a node that lapsed and registered again shows the new one (and the old series ends).  A
server alone exports no such series.  Prometheus joins it to any other series of the same
target (``* on(instance) group_left(node) tensord_node_info``) to name the node.

Labels are bounded: one series per server at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from tensord.protocol import VERSION

if TYPE_CHECKING:
    from tensord_server.domain.store import TensorStore

NAME = "tensord_node_info"
LABELS = ("node", "incarnation", "version")


@runtime_checkable
class Member(Protocol):
    """What the collector reads of a cluster member (:class:`~tensord_server.cluster.node.
    ClusterNode` is one); a directory without an incarnation is named with an empty one."""

    @property
    def node(self) -> str: ...

    @property
    def incarnation(self) -> str: ...


class NodeLabels(NamedTuple):
    """The labels of a node's one ``tensord_node_info`` series."""

    node: str
    incarnation: str
    version: str


def node_labels(directory: object | None) -> NodeLabels | None:
    """The labels of the member ``directory`` is (None: a server alone)."""
    if directory is None:
        return None
    node = str(getattr(directory, "node", ""))
    assert node, "a cluster's directory names its node"
    incarnation = directory.incarnation if isinstance(directory, Member) else ""
    return NodeLabels(node, str(incarnation), VERSION)


class NodeInfoCollector(Collector):
    """``tensord_node_info`` of one TensorStore, read when scraped (nothing polls)."""

    def __init__(self, store: TensorStore) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        labels = node_labels(self.store.names.directory)
        family = GaugeMetricFamily(
            NAME,
            "This server as a member of its cluster (1; only on a server with --cluster): "
            "its --node-id, the incarnation of its current registration, tensord's version",
            labels=list(LABELS),
        )
        if labels is not None:
            family.add_metric(list(labels), 1.0)
        yield family
