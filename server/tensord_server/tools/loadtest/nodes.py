"""``tensord loadtest`` against a cluster: the nodes it drives, their baselines, their leaks.

Given several ``--address`` (or one node of a cluster), the run asks the first for the
cluster's live nodes (``client.nodes()``), opens a monitor session on every one of them
(at the address given for it, else the one it registered), records each node's
allocated bytes before the users start, and after they left waits for every node to
come back to its own baseline.  The ``cross`` users' checks (``cross.get.verify``,
``cross.to.verify``, ``cross.attach.verify``) count the cross-node operations actually
done.  No Locust and no gevent here: the runner's process imports it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tensord_server.tools.loadtest.workloads import connect_op

#: the allocated bytes a node must come back to (torch's key)
ALLOCATED = "allocated_bytes.all.current"

#: cross-node operation -> the check that counts one done (its bytes read back on the
#: node that holds them, through a client of another node)
CROSS_NODE_CHECKS = {
    "get": "cross.get.verify",
    "to": "cross.to.verify",
    "attach": "cross.attach.verify",
}


def parse_addresses(values: Sequence[str] | None) -> list[str]:
    """The servers ``--address`` names, in order: given once or more, each one
    ``HOST:PORT`` or a comma-separated list of them; [] when none is given.

    Raises ValueError for an empty item or an address given twice.
    """
    addresses: list[str] = []
    for value in values or ():
        for item in value.split(","):
            address = item.strip()
            if not address:
                raise ValueError(f"an empty address in {value!r}")
            if address in addresses:
                raise ValueError(f"{address} is given twice")
            addresses.append(address)
    return addresses


def node_addresses(listed: Sequence[Mapping[str, Any]], given: Mapping[str, str]) -> dict[str, str]:
    """Node id -> the address this run reaches it at: the one given for it (``given``, node
    id -> ``--address``, in the order given) first, then every other live node of
    ``listed`` (``client.nodes()``) at the address it registered, sorted by id.

    Raises ValueError when a given address is not a live node of the listing's cluster.
    """
    registered = {str(n["node"]): str(n["address"]) for n in listed}
    strangers = [f"{address} ({node})" for node, address in given.items() if node not in registered]
    if strangers:
        raise ValueError(
            f"{', '.join(strangers)} not among the cluster's live nodes "
            f"({', '.join(sorted(registered))})"
        )
    found = dict(given)
    for node in sorted(registered):
        found.setdefault(node, registered[node])
    return found


def node_series_name(node: str) -> str:
    """The time series of a cluster's node: ``timeseries-<node>.csv`` (a node id is
    letters, digits, ``.``, ``_`` and ``-``)."""
    return f"timeseries-{node}.csv"


def own_node(listed: Sequence[Mapping[str, Any]]) -> str:
    """The id of the node that answered ``client.nodes()`` (its ``self`` entry)."""
    for entry in listed:
        if entry.get("self"):
            return str(entry["node"])
    raise ValueError("the node answering lists no entry for itself")


@dataclass
class NodeMonitor:
    """One node of the run: its id ("" for a server alone), where it is reached, a session
    that watches its pool, and its pool's figures before the users started."""

    node: str
    address: str
    client: Any
    baseline: dict[str, Any] = field(default_factory=dict)
    final: dict[str, Any] = field(default_factory=dict)
    #: its time series' file in the results folder (the runner names the first node's
    #: ``timeseries.csv``)
    series_name: str = ""

    def __post_init__(self) -> None:
        self.series_name = self.series_name or node_series_name(self.node)

    def leaked_bytes(self) -> int:
        return int(self.final.get(ALLOCATED, 0)) - int(self.baseline.get(ALLOCATED, 0))

    def report(
        self, ops: Sequence[Mapping[str, str]] = (), samples: Sequence[Mapping[str, str]] = ()
    ) -> dict[str, Any]:
        """The node's figures; ``ops``: Locust's ``locust_stats.csv`` rows, for the users
        that connected to it (its ``session.connect ADDRESS`` row); ``samples``: its time
        series' rows, for its peak allocated bytes."""
        return {
            "node": self.node,
            "address": self.address,
            "users": done(ops, connect_op(self.address)),
            "timeseries": self.series_name,
            "peak_allocated_bytes": max(
                (int(float(r["allocated_bytes"])) for r in samples if r.get("allocated_bytes")),
                default=0,
            ),
            "baseline_allocated_bytes": int(self.baseline.get(ALLOCATED, 0)),
            "final_allocated_bytes": int(self.final.get(ALLOCATED, 0)),
            "leaked_bytes": self.leaked_bytes(),
        }


def wait_for_baselines(
    monitors: Sequence[NodeMonitor],
    device: str,
    timeout: float,
    *,
    poll_s: float = 0.25,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Read every node's pool until each is back to its baseline's allocated bytes, or
    ``timeout`` seconds passed; each monitor's ``final`` holds its last reading."""
    deadline = clock() + timeout
    pending = list(monitors)
    while True:
        for monitor in pending:
            monitor.final = monitor.client.memory_stats(device)
        pending = [m for m in pending if m.leaked_bytes() > 0]
        if not pending or clock() >= deadline:
            return
        sleep(poll_s)


def cross_node_counts(ops: Sequence[Mapping[str, str]]) -> dict[str, int]:
    """Per cross-node operation, how many were done and checked: the successful rows of its
    check in Locust's ``locust_stats.csv`` rows (``ops``)."""

    return {kind: done(ops, check) for kind, check in CROSS_NODE_CHECKS.items()}


def done(ops: Sequence[Mapping[str, str]], name: str) -> int:
    """How many of the op ``name`` succeeded, from Locust's ``locust_stats.csv`` rows."""
    return sum(
        int(float(r.get("Request Count") or 0)) - int(float(r.get("Failure Count") or 0))
        for r in ops
        if r.get("Name") == name
    )
