"""A node missing from the members a node holds in memory is read from etcd once more.

A node that joined a moment ago is not among the members until the watch tells of it; a
lookup of it (a copy's target, a share token's node, a client's ``node()``) reads etcd
again rather than answering "no live node".  Ids that never exist do not turn every call
into an etcd read: the re-reads are rate-limited.  The watch is held back here by making
it forget to drop the members it keeps (as a slow watch would, deterministically).
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import tensord
from conftest import start_server, wait_until
from tensord import errors
from tensord_server.cluster.cache import RereadBudget, SharedRead
from test_cluster import CLUSTER_SECRET, LEASE_S, EtcdServer, needs_etcd, running_etcd

etcd = pytest.fixture(scope="module", name="etcd")(running_etcd)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_reread_budget_allows_a_burst_then_its_rate() -> None:
    clock = FakeClock()
    budget = RereadBudget(per_second=4.0, burst=4, clock=clock)
    assert [budget.take() for _ in range(6)] == [True] * 4 + [False] * 2
    clock.now += 0.5  # two refilled
    assert [budget.take() for _ in range(3)] == [True, True, False]
    clock.now += 60.0  # never more than the burst
    assert sum(budget.take() for _ in range(10)) == 4
    clock.now -= 5.0  # a clock that steps back refills nothing
    assert budget.take() is False


def count_listings(node: Any) -> list[bytes]:
    """The etcd listings ``node`` makes from now on (the members' reads among them)."""
    listings: list[bytes] = []
    listing = node.etcd.listing

    def counted(start: bytes, *more: Any, **options: Any) -> Any:
        listings.append(start)
        return listing(start, *more, **options)

    node.etcd.listing = counted
    return listings


def hold_back_the_members_watch(node: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``node`` keeps answering the members it holds, as if its watch had not yet told of
    any change to them."""
    monkeypatch.setattr(node._members, "changed", lambda key, revision: None)


def members_from_memory(node: Any, listings: list[bytes]) -> bool:
    listings.clear()
    node.nodes()
    return not listings


@pytest.mark.slow
@needs_etcd
def test_a_member_that_joined_a_moment_ago_is_found_and_garbage_is_bounded(
    etcd: EtcdServer, monkeypatch: pytest.MonkeyPatch, wait_until: Callable[..., bool]
) -> None:
    from tensord_server.cluster.node import MISS_READS_PER_S, ClusterNode

    a = ClusterNode("miss-a", "127.0.0.1:1", [etcd.endpoint], LEASE_S, [("cpu", 1 << 20)])
    b = ClusterNode("miss-b", "127.0.0.1:2", [etcd.endpoint], LEASE_S, [("cpu", 1 << 20)])
    a.join()
    try:
        listings = count_listings(a)
        assert wait_until(lambda: members_from_memory(a, listings), timeout=5)
        hold_back_the_members_watch(a, monkeypatch)
        clock = FakeClock()
        a._miss_reads = RereadBudget(MISS_READS_PER_S, round(MISS_READS_PER_S), clock)
        b.join()
        listings.clear()
        assert "miss-b" not in [n.node for n in a.nodes()]  # what a holds lacks b
        found = a.member("miss-b")
        assert found is not None and found.address == "127.0.0.1:2"
        assert len(listings) == 1  # one read of etcd for the miss
        assert "miss-b" in [n.node for n in a.nodes()]  # and what a holds has it now
        assert a.member("miss-a") is not None and len(listings) == 1  # a hit reads nothing
        listings.clear()
        assert all(a.member(f"garbage-{i}") is None for i in range(50))
        assert len(listings) == round(MISS_READS_PER_S) - 1  # the burst, less b's read
        clock.now += 1.0
        assert all(a.member(f"garbage-{i}") is None for i in range(50))
        assert len(listings) == round(MISS_READS_PER_S) * 2 - 1  # one second's worth more
    finally:
        b.close()
        a.close()


@dataclass
class InProcessNode:
    """A server of this process joined to etcd, with its members' watch at hand."""

    node_id: str
    address: str
    member: Any  # its ClusterNode
    stop: Callable[[], None]


@pytest.fixture
def make_node(etcd: EtcdServer) -> Iterator[Callable[[str], InProcessNode]]:
    from tensord_server.cluster.node import ClusterNode

    started: list[InProcessNode] = []

    def make(name: str) -> InProcessNode:
        running = start_server(auth_tokens={"alice-token": "alice"})
        running.daemon.cluster_token = CLUSTER_SECRET
        node_id = f"{name}-{os.getpid()}"
        member = ClusterNode(node_id, running.address, [etcd.endpoint], LEASE_S, [("cpu", 1)])
        member.join()
        running.daemon.names.join(member)

        def stop() -> None:
            running.stop()
            member.close()

        started.append(InProcessNode(node_id, running.address, member, stop))
        return started[-1]

    yield make
    for node in reversed(started):
        node.stop()


@pytest.mark.slow
@needs_etcd
def test_a_node_that_just_joined_is_a_copys_target_and_a_tokens_node(
    make_node: Callable[[str], InProcessNode],
    monkeypatch: pytest.MonkeyPatch,
    wait_until: Callable[..., bool],
) -> None:
    a = make_node("fresh-a")
    listings = count_listings(a.member)
    assert wait_until(lambda: members_from_memory(a.member, listings), timeout=5)
    hold_back_the_members_watch(a.member, monkeypatch)
    b = make_node("fresh-b")  # a's watch has not told a of b
    assert b.node_id not in [n.node for n in a.member.nodes()]
    with (
        tensord.connect(a.address, token="alice-token", local=False, call_timeout=10) as on_a,
        tensord.connect(b.address, token="alice-token", local=False, call_timeout=10) as on_b,
    ):
        data = np.arange(12, dtype=np.float32).reshape(3, 4) * 0.5
        x = on_a.tensor(data)
        moved = x.to(f"{b.node_id}/cpu")  # the SDK's ListNodes, then a's CopyToNode
        assert moved.client.address == b.address
        assert np.asarray(moved.numpy()).tobytes() == data.tobytes()
        token = on_b.arange(3).share()
        attached = on_a.attach(token)  # b's token, sent on to b by a
        assert attached.client.address == b.address and attached.tolist() == [0, 1, 2]
        with pytest.raises(errors.NotFoundError, match="no live node 'nowhere'"):
            x.to("nowhere/cpu")
        with pytest.raises(errors.NotFoundError, match="not in the cluster"):
            on_a.attach("gone-node~" + token.partition("~")[2])


@pytest.fixture
def silent_endpoints() -> Iterator[list[str]]:
    """Two loopback ports that take connections and never answer (a paused etcd): every
    call to them runs out of its deadline."""
    listeners = []
    for _ in range(2):
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listeners.append(listener)
    yield [f"127.0.0.1:{listener.getsockname()[1]}" for listener in listeners]
    for listener in listeners:
        listener.close()


def test_a_listing_with_its_own_deadline_fails_no_endpoint_over(
    silent_endpoints: list[str],
) -> None:
    from tensord_server.cluster.etcd import Etcd
    from tensord_server.cluster.node import NODES

    client = Etcd(silent_endpoints)
    try:
        in_use = client.stubs
        with pytest.raises(errors.ClusterUnavailableError, match="did not answer in time"):
            client.listing(NODES, NODES + b"\xff", timeout=0.05)
        assert client.stubs is in_use  # the same endpoint, its channel left open
        assert in_use.endpoint == silent_endpoints[0]
    finally:
        client.close()


@pytest.mark.slow
@needs_etcd
def test_a_miss_reread_that_runs_out_leaves_the_endpoint_and_its_channel(
    etcd: EtcdServer,
    silent_endpoints: list[str],
    monkeypatch: pytest.MonkeyPatch,
    wait_until: Callable[..., bool],
) -> None:
    import tensord_server.cluster.node as cluster_node

    # etcd first, then a second endpoint; a re-read's deadline always runs out here
    endpoints = [etcd.endpoint, silent_endpoints[0]]
    a = cluster_node.ClusterNode("slow-a", "127.0.0.1:1", endpoints, LEASE_S, [("cpu", 1)])
    a.join()
    try:
        listings = count_listings(a)
        assert wait_until(lambda: members_from_memory(a, listings), timeout=5)
        in_use = a.etcd.stubs
        monkeypatch.setattr(cluster_node, "MISS_READ_TIMEOUT_S", 1e-6)
        listings.clear()
        assert [a.member(f"ghost-{i}") for i in range(3)] == [None] * 3
        assert len(listings) == 3  # each was read, and ran out
        assert a.etcd.stubs is in_use  # no tenant's miss moved the node off etcd
        assert a.claim("bob", "after-the-misses", overwrite=False) > 0  # its channel works
    finally:
        a.close()


def test_reads_at_once_share_one_read() -> None:
    shared: SharedRead[int] = SharedRead()
    reads: list[int] = []
    release = threading.Event()

    def read() -> int:
        reads.append(1)
        assert release.wait(timeout=10)
        return 42

    answers: list[int] = []
    threads = [threading.Thread(target=lambda: answers.append(shared.read(read))) for _ in range(4)]
    threads[0].start()
    assert wait_until(lambda: len(reads) == 1, timeout=10)  # the first is reading
    for thread in threads[1:]:
        thread.start()
    assert wait_until(lambda: shared.waiting == 3, timeout=10)  # the others wait for it
    release.set()
    for thread in threads:
        thread.join(timeout=10)
    assert answers == [42] * 4 and len(reads) == 1
    assert shared.read(lambda: 7) == 7  # the next read is a read of its own

    def fails() -> int:
        raise errors.ClusterUnavailableError("etcd did not answer")

    with pytest.raises(errors.ClusterUnavailableError):
        shared.read(fails)
    assert shared.read(lambda: 8) == 8


def test_an_id_no_node_can_have_reads_nothing_and_takes_no_budget(
    silent_endpoints: list[str],
) -> None:
    from tensord_server.cluster.node import ClusterNode

    a = ClusterNode("bad-ids", "127.0.0.1:1", silent_endpoints, LEASE_S, [("cpu", 1)])
    try:
        listings = count_listings(a)
        a._miss_reads = RereadBudget(4.0, 4, FakeClock())
        malformed = ["", "a b", "../nodes/x", "-leading-dash", "x" * 64, "y" * (4 << 20)]
        assert [a.member(node) for node in malformed] == [None] * len(malformed)
        assert listings == []  # etcd was not asked
        assert [a._miss_reads.take() for _ in range(4)] == [True] * 4  # the budget is whole
    finally:
        a.close()


def test_a_callers_node_id_is_shown_cut_short() -> None:
    from tensord_server.cluster import SHOWN_NODE_ID_CHARS, shown_node_id

    assert shown_node_id("node-b") == "'node-b'"
    huge = shown_node_id("z" * (4 << 20))
    assert len(huge) < 2 * SHOWN_NODE_ID_CHARS and f"({4 << 20} characters)" in huge


@pytest.mark.slow
@needs_etcd
def test_a_malformed_node_id_is_refused_before_any_lookup(
    make_node: Callable[[str], InProcessNode],
) -> None:
    from tensord.wire import requests

    a = make_node("ids-a")
    listings = count_listings(a.member)
    long = "q" * 4000  # within the request limits on strings, far past a node id
    with tensord.connect(a.address, token="alice-token", local=False, call_timeout=10) as on_a:
        conn = on_a._session.conn
        x = on_a.tensor(np.arange(3, dtype=np.float32))
        for bad in ("a b", "../names/alice", long):
            listings.clear()
            with pytest.raises(errors.InvalidArgumentError, match="is not a node id") as raised:
                conn.call("ListNodes", requests.list_nodes(bad))
            assert len(str(raised.value)) < 1000  # the id is not echoed in full
            copy = requests.copy_to_node(x.handle, bad, "cpu", on_a.session_id)
            with pytest.raises(errors.InvalidArgumentError, match="is not a node id"):
                conn.call("CopyToNode", copy)
            with pytest.raises(errors.NotFoundError, match="unknown share token"):
                on_a.attach(f"{bad}~{'0' * 32}")
            assert listings == []  # none of them read etcd
        assert conn.call("ListNodes", requests.list_nodes(a.node_id)).node == a.node_id


@pytest.mark.slow
@needs_etcd
def test_nodes_of_the_other_transport_neither_join_nor_take_copies(
    make_node: Callable[[str], InProcessNode], etcd: EtcdServer
) -> None:
    from tensord.wire import requests
    from tensord_server.cluster.node import ClusterNode, MixedTransportError

    a = make_node("plain-a")  # serves plaintext, and its member record says so
    t_id = f"tls-t-{os.getpid()}"
    t = ClusterNode(t_id, "127.0.0.1:9", [etcd.endpoint], LEASE_S, [("cpu", 1)], tls=True)
    try:
        with pytest.raises(MixedTransportError, match="serves plaintext and this node TLS"):
            t.join()
        assert t_id not in [n.node for n in a.member.nodes()]
        t._register()  # as a node that joined first, or at the same moment, would be
        assert a.member.member(t_id) is not None and a.member.member(t_id).tls is True
        with tensord.connect(a.address, token="alice-token", local=False) as on_a:
            x = on_a.tensor(np.arange(3, dtype=np.float32))
            copy = requests.copy_to_node(x.handle, t_id, "cpu", on_a.session_id)
            with pytest.raises(errors.UnavailableError, match="serves TLS and this node plain"):
                on_a._session.conn.call("CopyToNode", copy)  # refused before any dial
    finally:
        t.close()
