"""What the name table asks of a cluster: a directory of names shared by every node.

A server alone has none (its names are its own).  A server that joined a cluster
(``tensord serve --cluster``) is given one: :class:`tensord_server.cluster.ClusterNode`
keeps it in etcd.  The domain knows only this interface, never the store behind it.

A name belongs to one node, the one that holds its tensor: the directory records the
owner, and the record lives as long as the owner's membership (its lease), so a node
that is lost takes its names with it.  Each record has a revision (the directory's
own clock, rising with every change), so a node can tell its own newer claim from an
older change it hears about late.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol


class NameOwner(NamedTuple):
    """The node that holds a named tensor."""

    node: str  # its --node-id
    address: str  # where its clients connect


class NodeRecord(NamedTuple):
    """A live member of the cluster, as it registered."""

    node: str
    address: str
    devices: tuple[tuple[str, int], ...]  # (device, capacity_bytes) of each pool it owns
    version: str  # tensord's
    incarnation: str  # new at each registration: a node back from a lapse is a new one
    tls: bool | None = None  # whether it serves TLS (None: its record does not say)


# Called by the directory when a name this node holds locally stopped being its own:
# (tenant, name, revision of the change); revision None: every name (the membership lapsed).
NameLost = Callable[[str, str | None, int | None], None]


class NameDirectory(Protocol):
    """The cluster's names, and its members.  Every call may raise
    :class:`tensord.errors.ClusterUnavailableError` (the directory cannot be reached)."""

    @property
    def node(self) -> str:
        """This node's id."""
        ...

    def claim(self, tenant: str, name: str, overwrite: bool) -> int:
        """Record this node as the owner of ``name``: AlreadyExistsError when another owns
        it and ``overwrite`` is False.  The claim's revision."""
        ...

    def release(self, tenant: str, name: str, revision: int) -> None:
        """Remove the record of ``name`` if it is still the claim made at ``revision``."""
        ...

    def owner(self, tenant: str, name: str) -> NameOwner | None:
        """Who holds ``name`` (None: nobody)."""
        ...

    def names(self, tenant: str, after: str | None, limit: int) -> tuple[list[str], bool]:
        """The tenant's names on every node, sorted after ``after`` (None: from the first),
        at most ``limit`` of them; and whether more follow."""
        ...

    def nodes(self) -> list[NodeRecord]:
        """The live members, sorted by id."""
        ...

    def member(self, node: str) -> NodeRecord | None:
        """The live member ``node`` (None: none).  Unlike :meth:`nodes`, a member missing
        from what this node last heard is looked for in the directory itself (rate-limited),
        so a node that joined a moment ago is found."""
        ...

    def lost_owner(self, tenant: str, name: str) -> NameOwner | None:
        """The node ``name`` was on when that node's membership lapsed (it was lost, not
        deleted), as long as the name was not claimed again since; None otherwise.  Told
        from what this node heard, so it may forget (a bounded memory)."""
        ...

    def on_name_lost(self, callback: NameLost) -> None:
        """Have ``callback`` told of names this node no longer owns (replaced by another
        node's ``put(..., overwrite=True)``, deleted on another node, or lapsed)."""
        ...
