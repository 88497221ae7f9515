"""A tensord server as a node of a cluster: membership and one namespace, kept in etcd.

``tensord serve --node-id NAME --cluster etcd://HOST:PORT[,HOST:PORT...]`` joins: the node
registers under an etcd lease it keeps alive, and its name table claims every name in
etcd (:class:`~tensord_server.domain.directory.NameDirectory`), so a name is unique per
tenant across the nodes and resolves to the node that holds the tensor.  Each node keeps
owning its own Storages; etcd holds only the small directory.

This module is the flags' grammar only (no etcd client is imported until a server joins):
:mod:`tensord_server.cluster.node` is the member, :mod:`tensord_server.cluster.etcd` the
calls to etcd.
"""

from __future__ import annotations

import math
import re

# The URL scheme of --cluster.
SCHEME = "etcd://"
# --cluster-lease's default: a lost node's names vanish within it (plus one keep-alive).
DEFAULT_CLUSTER_LEASE_S = 10.0
# The shortest lease etcd grants with its default election timeout (1 s): 1.5 elections.
MIN_CLUSTER_LEASE_S = 2.0
# What a --node-id may be: it is part of etcd keys and of torch-style "node/device" names.
NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
# A node id a caller sent is shown (in an error, in the log) up to this many characters.
SHOWN_NODE_ID_CHARS = 64

_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m)?")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, None: 1.0}


def parse_endpoints(url: str) -> list[str]:
    """--cluster's ``etcd://HOST:PORT[,HOST:PORT...]`` as its HOST:PORT endpoints."""
    if not url.startswith(SCHEME):
        raise ValueError(f"--cluster must be {SCHEME}HOST:PORT[,HOST:PORT...], got {url!r}")
    endpoints = [part.strip() for part in url[len(SCHEME) :].split(",")]
    for endpoint in endpoints:
        host, _, port = endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--cluster: {endpoint!r} is not HOST:PORT (in {url!r})")
    return endpoints


def parse_duration(text: str) -> float:
    """``10s``, ``500ms``, ``1m`` or a bare number of seconds, in seconds."""
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"not a duration: {text!r} (expected e.g. 10s, 500ms, 1m)")
    seconds = float(match.group(1)) * _UNITS[match.group(2)]
    if not math.isfinite(seconds):
        raise ValueError(f"not a duration: {text!r}")
    return seconds


def check_node_id(node: str) -> str:
    """``node`` if it is a valid --node-id, else ValueError saying what one is."""
    if NODE_ID.fullmatch(node) is None:
        raise ValueError(
            f"--node-id must be 1-63 letters, digits, '_', '.' or '-' (starting with a letter "
            f"or digit), got {node!r}"
        )
    return node


def shown_node_id(node: str) -> str:
    """``node`` quoted for a message, cut to SHOWN_NODE_ID_CHARS characters (and its
    length then said): a caller's id may be megabytes."""
    if len(node) <= SHOWN_NODE_ID_CHARS:
        return repr(node)
    return f"{node[:SHOWN_NODE_ID_CHARS]!r}... ({len(node)} characters)"
