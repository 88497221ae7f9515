"""A node missing from the members a node holds in memory is read from etcd once more.

A node that joined a moment ago is not among the members until the watch tells of it; a
lookup of it (a copy's target, a share token's node, a client's ``node()``) reads etcd
again rather than answering "no live node".  Ids that never exist do not turn every call
into an etcd read: the re-reads are rate-limited.  The watch is held back here by making
it forget to drop the members it keeps (as a slow watch would, deterministically).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import tensord
from conftest import start_server
from tensord import errors
from tensord_server.cluster.cache import RereadBudget
from test_cluster import CLUSTER_SECRET, ETCD, LEASE_S, EtcdServer, needs_etcd, start_etcd


@pytest.fixture(scope="module")
def etcd() -> Iterator[EtcdServer]:
    if ETCD is None:
        pytest.skip("no etcd (apt-get install etcd-server)")
    server = start_etcd()
    yield server
    server.stop()
    shutil.rmtree(server.data_dir, ignore_errors=True)


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
