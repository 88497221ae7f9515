"""This server as a member of a cluster: its registration, its lease, its names in etcd.

etcd's keys (values are JSON):

- ``/tensord/v1/nodes/<node>``: the member (address, devices, version, incarnation),
  bound to the node's lease;
- ``/tensord/v1/names/<tenant>/<name>``: the node holding the tensor named ``name``
  for ``tenant`` (percent-encoded, so a tenant cannot reach into another's keys), bound
  to the owner's lease.

A lease lapses when its node stops renewing it (killed, partitioned, paused): etcd then
deletes the member and every name it held at once.  Two threads of the node's own keep
it (no request can hold them up): one renews the lease every third of its TTL, and
re-registers, as a new incarnation, after a lapse; one watches the names, so a name
another node takes over (``put(..., overwrite=True)``) or deletes stops keeping its
tensor alive here.

The same watch keeps the node's lookups current (:mod:`tensord_server.cluster.cache`):
the owner of a name another node holds, and the members, are read from etcd once and
answered from memory until the watch tells of a change to them.  Such an answer may be a
watch's delay behind etcd; it only ever sends a client to a node, which checks for itself.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any
from urllib.parse import quote, unquote

from tensord.errors import AlreadyExistsError, ClusterUnavailableError
from tensord.protocol import VERSION

from tensord_server.cluster import NODE_ID, shown_node_id
from tensord_server.cluster.cache import RereadBudget, SharedRead, WatchedCache
from tensord_server.cluster.etcd import CompactedError, Etcd, prefix_end
from tensord_server.domain.directory import NameLost, NameOwner, NodeRecord

PREFIX = b"/tensord/v1/"
NODES = PREFIX + b"nodes/"
NAMES = PREFIX + b"names/"
# A lease is renewed this many times per TTL: a renewal lost on the way leaves two more.
RENEWALS_PER_LEASE = 3
# After a failed watch, wait this long before watching again.
WATCH_RETRY_S = 0.5
# Names of lost nodes remembered (for NodeLostError rather than NotFoundError), the
# oldest forgotten first.
MAX_LOST_NAMES = 65_536
# Owners of other nodes' names kept from earlier lookups (the least recently used go first).
MAX_CACHED_OWNERS = 65_536
# A member missing from the members held in memory (it may have joined a moment ago, its
# record not yet told by the watch) is read from etcd once more, within this deadline: it
# bounds the whole re-read (one try, on the endpoint in use; one that runs out is a miss,
# never a reason to fail over from an endpoint that may only be slower than this)...
MISS_READ_TIMEOUT_S = 0.5
# ...at most this many times a second (after a burst of as many), whatever ids are asked.
MISS_READS_PER_S = 4.0

log = logging.getLogger("tensord.cluster")


def name_key(tenant: str, name: str) -> bytes:
    return NAMES + quote(tenant, safe="").encode() + b"/" + name.encode()


def tenant_prefix(tenant: str) -> bytes:
    return NAMES + quote(tenant, safe="").encode() + b"/"


def _find(records: Iterable[NodeRecord], node: str) -> NodeRecord | None:
    return next((record for record in records if record.node == node), None)


def split_name_key(key: bytes) -> tuple[str, str]:
    """(tenant, name) of a name's key."""
    tenant, _, name = key[len(NAMES) :].partition(b"/")
    return unquote(tenant.decode()), name.decode()


class NodeIdTakenError(RuntimeError):
    """Another live member already registered under this --node-id."""


class MixedTransportError(RuntimeError):
    """A live member serves TLS where this node serves plaintext, or the other way round."""


def _transport(tls: bool) -> str:
    return "TLS" if tls else "plaintext"


class ClusterNode:
    """One member of a tensord cluster (a :class:`NameDirectory` for the name table).

    Invariants: ``_lease`` is the lease the member record and every name this node claimed
    are bound to (None between a lapse and the next registration: claims are refused);
    ``_incarnation`` changes with each registration."""

    def __init__(
        self,
        node: str,
        address: str,
        endpoints: list[str],
        lease_s: float,
        devices: Iterable[tuple[str, int]],
        tls: bool = False,
    ) -> None:
        self._node = node
        self.tls = tls  # whether this node serves TLS (its member record says so)
        self.address = address
        self.lease_s = lease_s
        self.ttl = max(1, round(lease_s))  # etcd's TTLs are whole seconds
        self.devices = tuple(devices)
        self.etcd = Etcd(endpoints)
        self._lock = threading.Lock()
        self._lease: int | None = None
        self._incarnation = ""
        self._lost: list[NameLost] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        # (tenant, name) -> the node it was on when that node's lease lapsed
        self._lost_names: OrderedDict[tuple[str, str], NameOwner] = OrderedDict()
        # a name's key -> its owner; NODES -> the members: both as the watch keeps them
        self._owners: WatchedCache[NameOwner] = WatchedCache(MAX_CACHED_OWNERS)
        self._members: WatchedCache[tuple[NodeRecord, ...]] = WatchedCache(1)
        self._miss_reads = RereadBudget(MISS_READS_PER_S, round(MISS_READS_PER_S))
        # misses at once share one re-read (it reads every member, whatever id missed)
        self._miss_read: SharedRead[list[NodeRecord] | None] = SharedRead()

    # ---- membership --------------------------------------------------------------------

    @property
    def node(self) -> str:
        return self._node

    @property
    def incarnation(self) -> str:
        return self._incarnation

    def join(self) -> None:
        """Register (ClusterUnavailableError, NodeIdTakenError, MixedTransportError) and
        start the threads that keep the lease and watch the names."""
        self._refuse_a_mixed_cluster()
        self._register()
        for target, what in ((self._keep_alive_forever, "lease"), (self._watch_forever, "watch")):
            thread = threading.Thread(target=target, name=f"tensord-cluster-{what}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _refuse_a_mixed_cluster(self) -> None:
        """MixedTransportError when a live member serves TLS and this node does not, or
        the other way round: their node calls could never succeed (a node call never
        falls back to plaintext), so the node does not join."""
        for member in self._read_members():
            if member.node != self._node and member.tls is not None and member.tls != self.tls:
                raise MixedTransportError(
                    f"node {member.node!r} ({member.address}) of the cluster serves "
                    f"{_transport(member.tls)} and this node {_transport(self.tls)}: every "
                    "node of a cluster serves TLS (--tls-cert, --cluster-ca), or none does"
                )

    def _register(self) -> None:
        lease = self.etcd.grant(self.ttl)
        incarnation = uuid.uuid4().hex
        record = {
            "node": self._node,
            "address": self.address,
            "devices": [list(device) for device in self.devices],
            "version": VERSION,
            "incarnation": incarnation,
            "tls": self.tls,
        }
        created, _, held = self.etcd.create(
            NODES + self._node.encode(), json.dumps(record).encode(), lease
        )
        if not created:
            self.etcd.revoke(lease)
            other = json.loads(held) if held else {}
            raise NodeIdTakenError(
                f"--node-id {self._node!r} is taken by a live member at "
                f"{other.get('address', '?')}; pick another, or wait for its lease to lapse"
            )
        with self._lock:
            self._lease, self._incarnation = lease, incarnation
        log.info("joined the cluster as %s (incarnation %s)", self._node, incarnation)

    def _keep_alive_forever(self) -> None:
        interval = self.lease_s / RENEWALS_PER_LEASE
        renewed = time.monotonic()
        while not self._stop.wait(interval):
            with self._lock:
                lease = self._lease
            try:
                if lease is None:
                    self._register()
                    renewed = time.monotonic()
                    continue
                if self.etcd.keep_alive(lease) > 0:
                    renewed = time.monotonic()
                    continue
                self._lapsed("etcd no longer has this node's lease")
            except (ClusterUnavailableError, NodeIdTakenError) as exc:
                if isinstance(exc, ClusterUnavailableError):
                    self._rewatch()
                if lease is not None and time.monotonic() - renewed >= self.lease_s:
                    self._lapsed(str(exc))
                else:
                    log.warning("cluster: %s", exc)

    def _rewatch(self) -> None:
        """etcd did not answer a renewal: the watch may be as cut off and not know it yet
        (a partition closes no connection), so nothing is answered from memory until it
        is started again, and it is ended so that it is."""
        self._owners.unwatched()
        self._members.unwatched()
        self.etcd.stop_watching()

    def _lapsed(self, why: str) -> None:
        """The lease is gone (or may be, unrenewed for a whole TTL): so are this node's
        names in etcd; drop them here too, and register anew at the next renewal."""
        with self._lock:
            if self._lease is None:
                return
            self._lease = None
        log.warning("cluster: this node's membership lapsed (%s); its names are gone", why)
        for callback in self._lost:
            callback("", None, None)

    def _claim_lease(self) -> int:
        with self._lock:
            lease = self._lease
        if lease is None:
            raise ClusterUnavailableError(
                f"node {self._node!r} is not a member of the cluster now (its lease lapsed; "
                "it registers again once etcd answers)"
            )
        return lease

    # ---- the names (NameDirectory) -------------------------------------------------------

    def on_name_lost(self, callback: NameLost) -> None:
        self._lost.append(callback)

    def _record(self) -> bytes:
        return json.dumps(
            {"node": self._node, "address": self.address, "incarnation": self._incarnation}
        ).encode()

    def claim(self, tenant: str, name: str, overwrite: bool) -> int:
        lease = self._claim_lease()
        key = name_key(tenant, name)
        self._owners.drop(key)  # this node's now, or another's it was told of
        if overwrite:
            return self.etcd.put(key, self._record(), lease)
        created, revision, held = self.etcd.create(key, self._record(), lease)
        if not created:
            owner = json.loads(held).get("node", "?") if held else "?"
            raise AlreadyExistsError(
                f"name {name!r} already exists (on node {owner!r}) (pass overwrite=True)"
            )
        return revision

    def release(self, tenant: str, name: str, revision: int) -> None:
        key = name_key(tenant, name)
        self._owners.drop(key)
        self.etcd.delete_if(key, revision)

    def owner(self, tenant: str, name: str) -> NameOwner | None:
        key = name_key(tenant, name)
        cached = self._owners.get(key)
        if cached is not None:
            return cached
        read = self.etcd.read(key)
        if read.value is None:
            return None  # not kept: a name put elsewhere just now is found at once
        record = json.loads(read.value)
        owner = NameOwner(record["node"], record["address"])
        if owner.node != self._node:  # this node's own names are its table's
            self._owners.store(key, owner, read.revision, read.read_at)
        return owner

    def names(self, tenant: str, after: str | None, limit: int) -> tuple[list[str], bool]:
        prefix = tenant_prefix(tenant)
        start = prefix if after is None else prefix + after.encode() + b"\0"
        found, more = self.etcd.range(start, prefix_end(prefix), limit=limit, keys_only=True)
        return [key[len(prefix) :].decode() for key, _ in found], more

    def nodes(self) -> list[NodeRecord]:
        cached = self._members.get(NODES)
        if cached is not None:
            return list(cached)
        return self._read_members()

    def member(self, node: str) -> NodeRecord | None:
        if NODE_ID.fullmatch(node) is None:  # no member's id: never worth a re-read
            return None
        cached = self._members.get(NODES)
        records = list(cached) if cached is not None else self._read_members()
        found = _find(records, node)
        if found is not None or cached is None:  # read just now: etcd's own answer
            return found
        reread = self._miss_read.read(lambda: self._reread_members(node))
        return None if reread is None else _find(reread, node)

    def _reread_members(self, node: str) -> list[NodeRecord] | None:
        """The members read again for a miss of ``node`` (None: over the re-read budget,
        or etcd did not answer in time: the members in memory answer, as before).  Its
        log lines are as few as the budget's re-reads, each with the id cut short."""
        if not self._miss_reads.take():
            return None
        try:
            return self._read_members(MISS_READ_TIMEOUT_S)
        except ClusterUnavailableError as exc:
            log.info("cluster: reading the members again for %s: %s", shown_node_id(node), exc)
            return None

    def _read_members(self, timeout: float | None = None) -> list[NodeRecord]:
        """The members as etcd lists them now, kept until the watch tells of a change."""
        listed = self.etcd.listing(NODES, prefix_end(NODES), timeout=timeout)
        records = []
        for _, value in listed.kvs:
            r = json.loads(value)
            devices = tuple((str(d), int(c)) for d, c in r.get("devices", ()))
            tls = r.get("tls")
            records.append(
                NodeRecord(
                    r["node"],
                    r["address"],
                    devices,
                    r["version"],
                    r["incarnation"],
                    tls if isinstance(tls, bool) else None,
                )
            )
        records.sort()
        self._members.store(NODES, tuple(records), listed.revision, listed.read_at)
        return records

    def lost_owner(self, tenant: str, name: str) -> NameOwner | None:
        with self._lock:
            return self._lost_names.get((tenant, name))

    def _watch_forever(self) -> None:
        """Tell the name table of each name this node held that another node replaced or
        deleted (the table keeps its own newer claims); remember the names that went with
        another node's lapsed lease."""
        start = 0
        while not self._stop.is_set():
            try:
                for batch in self.etcd.watch(PREFIX, start, prev_kv=True):
                    if not batch.events:  # started: the lookups may be kept from now on
                        self._owners.watching(batch.revision)
                        self._members.watching(batch.revision)
                        continue
                    self._heard_lapses(batch.events)
                    for event in batch.events:
                        key, revision = bytes(event.kv.key), int(event.kv.mod_revision)
                        if key.startswith(NAMES):
                            self._owners.changed(key, revision)
                            self._heard(event)
                        elif key.startswith(NODES):
                            self._members.changed(NODES, revision)
                        start = revision + 1
                    self._owners.heard(batch.revision)
                    self._members.heard(batch.revision)
            except CompactedError as exc:
                log.warning("cluster: %s; watching from now on", exc)
                start = 0
            except ClusterUnavailableError as exc:
                if not self._stop.is_set():
                    log.warning("cluster: %s", exc)
                    self._stop.wait(WATCH_RETRY_S)
            finally:  # between two watches nothing is answered from memory
                self._owners.unwatched()
                self._members.unwatched()

    def _heard_lapses(self, events: list[Any]) -> None:
        """The names deleted in the same revision as their owner's member record: etcd
        deleted them together when that owner's lease lapsed (a lost node, not a delete).
        A name claimed again is no longer lost."""
        gone: dict[int, set[str]] = {}  # revision -> members deleted at it
        for event in events:
            key = bytes(event.kv.key)
            if event.type == event.DELETE and key.startswith(NODES):
                node = key[len(NODES) :].decode()
                if node != self._node:  # this node's own names: it dropped them itself
                    gone.setdefault(int(event.kv.mod_revision), set()).add(node)
        with self._lock:
            for event in events:
                key = bytes(event.kv.key)
                if not key.startswith(NAMES):
                    continue
                tenant_name = split_name_key(key)
                if event.type != event.DELETE:
                    self._lost_names.pop(tenant_name, None)
                    continue
                try:
                    record = json.loads(event.prev_kv.value)
                except ValueError:
                    continue
                if record.get("node") in gone.get(int(event.kv.mod_revision), ()):
                    owner = NameOwner(str(record["node"]), str(record.get("address", "?")))
                    self._lost_names[tenant_name] = owner
                    self._lost_names.move_to_end(tenant_name)
                    while len(self._lost_names) > MAX_LOST_NAMES:
                        self._lost_names.popitem(last=False)

    def _heard(self, event: Any) -> None:
        if event.type == event.PUT:
            try:
                if json.loads(event.kv.value).get("node") == self._node:
                    return  # this node's own claim
            except ValueError:
                pass
        tenant, name = split_name_key(bytes(event.kv.key))
        for callback in self._lost:
            callback(tenant, name, int(event.kv.mod_revision))

    def close(self) -> None:
        """Leave the cluster: revoke the lease (the member and its names vanish at once)."""
        self._stop.set()
        self.etcd.stop_watching()
        with self._lock:
            lease, self._lease = self._lease, None
        if lease is not None:
            try:
                self.etcd.revoke(lease)
            except ClusterUnavailableError as exc:
                log.warning("cluster: leaving without revoking the lease: %s", exc)
        for thread in self._threads:
            thread.join(timeout=5.0)
        self.etcd.close()
