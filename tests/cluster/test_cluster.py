"""Servers joined into one cluster through a real etcd (Debian's etcd-server on loopback ports).

Units first (the flags' grammar, the refusals of ``tensord serve``), then the member against
etcd in this process (claims, the watch, a lapsed lease), then three ``tensord serve``
processes: a name put on one node read from a client of another, a node killed with
SIGKILL, etcd stopped under running nodes.  Every test that needs etcd skips without it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensord
from conftest import run_serve, start_serve_process, wait_until
from tensord import errors
from tensord_server.cluster import check_node_id, parse_duration, parse_endpoints

ETCD = shutil.which("etcd")
needs_etcd = pytest.mark.skipif(ETCD is None, reason="no etcd (apt-get install etcd-server)")
# etcd answers its first call within this long of starting, or the test fails
ETCD_STARTUP_S = 20.0
# the lease the test nodes hold: etcd's shortest
LEASE_S = 2.0
TOKENS = "alice-token alice\nbob-token bob\n"
# the nodes' shared secret for node-to-node calls (--cluster-token-file)
CLUSTER_SECRET = "cluster-secret-0123456789"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class EtcdServer:
    process: subprocess.Popen[bytes]
    endpoint: str  # HOST:PORT of its client URL
    data_dir: str
    command: tuple[str, ...] = ()

    def restart(self) -> None:
        """Start it again on its ports and data (after :meth:`stop`); returns once it answers."""
        self.process = subprocess.Popen(
            list(self.command), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        wait_for_etcd(self)

    def url(self) -> str:
        return f"etcd://{self.endpoint}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


def start_etcd() -> EtcdServer:
    """A one-member etcd on two free loopback ports with a temporary data dir; returns once
    it answers a call (bounded by ETCD_STARTUP_S)."""
    assert ETCD is not None
    data = tempfile.mkdtemp(prefix="tensord-etcd-")
    client, peer = free_port(), free_port()
    command = (
        ETCD,
        "--name=test",
        f"--data-dir={data}",
        f"--listen-client-urls=http://127.0.0.1:{client}",
        f"--advertise-client-urls=http://127.0.0.1:{client}",
        f"--listen-peer-urls=http://127.0.0.1:{peer}",
        f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
        f"--initial-cluster=test=http://127.0.0.1:{peer}",
        "--log-level=error",
    )
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = EtcdServer(process, f"127.0.0.1:{client}", data, command)
    wait_for_etcd(server)
    return server


def wait_for_etcd(server: EtcdServer) -> None:
    from tensord_server.cluster.etcd import Etcd

    process = server.process
    probe = Etcd([server.endpoint], timeout=0.5)
    deadline = time.monotonic() + ETCD_STARTUP_S
    try:
        while True:
            try:
                probe.range(b"/", b"\0", limit=1)
                return
            except errors.ClusterUnavailableError:
                if time.monotonic() > deadline or process.poll() is not None:
                    server.stop()
                    pytest.fail(f"etcd did not answer within {ETCD_STARTUP_S:g} s")
                time.sleep(0.1)
    finally:
        probe.close()


@pytest.fixture
def make_etcd() -> Iterator[Callable[[], EtcdServer]]:
    started: list[EtcdServer] = []

    def make() -> EtcdServer:
        started.append(start_etcd())
        return started[-1]

    yield make
    for server in started:
        server.stop()
        shutil.rmtree(server.data_dir, ignore_errors=True)


def running_etcd() -> Iterator[EtcdServer]:
    """One etcd for a module's tests (skipped where none is installed); each cluster test
    module makes it its ``etcd`` fixture."""
    if ETCD is None:
        pytest.skip("no etcd (apt-get install etcd-server)")
    server = start_etcd()
    yield server
    server.stop()
    shutil.rmtree(server.data_dir, ignore_errors=True)


etcd = pytest.fixture(scope="module", name="etcd")(running_etcd)


# ---- the flags ------------------------------------------------------------------------


def test_the_cluster_flags_grammar() -> None:
    assert parse_endpoints("etcd://127.0.0.1:2379") == ["127.0.0.1:2379"]
    assert parse_endpoints("etcd://a:1,b:2") == ["a:1", "b:2"]
    for bad in ("http://a:1", "etcd://a", "etcd://a:1,:2", "etcd://a:99999"):
        with pytest.raises(ValueError):
            parse_endpoints(bad)
    assert parse_duration("10s") == 10.0
    assert parse_duration("2500ms") == 2.5
    assert parse_duration("1m") == 60.0
    assert parse_duration("3") == 3.0
    for bad in ("", "ten", "10h", "-1s"):
        with pytest.raises(ValueError):
            parse_duration(bad)
    assert check_node_id("gpu-7.rack2") == "gpu-7.rack2"
    for bad in ("", "a/b", "-a", "x" * 64):
        with pytest.raises(ValueError):
            check_node_id(bad)


def test_a_device_of_another_node_is_named_as_torch_names_it() -> None:
    from tensord._args import split_node_device

    assert split_node_device("b/cpu") == ("b", "cpu")
    assert split_node_device("gpu-7.rack2/cuda:1") == ("gpu-7.rack2", "cuda:1")
    assert split_node_device("cpu") is None and split_node_device(None) is None
    for bad in ("/cpu", "b/", "a/b/cpu", "b/gpu"):
        with pytest.raises(RuntimeError):
            split_node_device(bad)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--cluster", "etcd://127.0.0.1:1"], "--cluster needs --node-id"),
        (["--node-id", "a"], "--node-id needs --cluster"),
        (["--node-id", "a", "--cluster", "127.0.0.1:1"], "--cluster must be etcd://"),
        (["--node-id", "a/b", "--cluster", "etcd://127.0.0.1:1"], "--node-id must be"),
        (
            ["--node-id", "a", "--cluster", "etcd://127.0.0.1:1", "--cluster-lease", "1s"],
            "--cluster-lease must be at least 2s",
        ),
    ],
)
def test_serve_refuses_bad_cluster_flags(args: list[str], said: str) -> None:
    done = run_serve("--address", "127.0.0.1:0", "--device", "cpu=64MiB", *args)
    assert done.returncode == 2
    assert said in done.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    ("secret", "said"),
    [
        ("short", "at least 16 characters"),
        ("a-tenant-token-0123456789", "must not be a tenant's token"),
    ],
)
def test_serve_refuses_a_weak_cluster_secret(tmp_path: Path, secret: str, said: str) -> None:
    tokens, secret_file = tmp_path / "tokens", tmp_path / "secret"
    tokens.write_text("a-tenant-token-0123456789 alice\n")
    secret_file.write_text(secret + "\n")
    done = run_serve(
        "--address", "127.0.0.1:0", "--device", "cpu=64MiB", "--auth-tokens", str(tokens),
        "--node-id", "a", "--cluster", "etcd://127.0.0.1:1",
        "--cluster-token-file", str(secret_file),
    )  # fmt: skip
    assert done.returncode == 2
    assert said in done.stderr


@pytest.mark.slow
def test_serve_without_a_reachable_etcd_does_not_start() -> None:
    done = run_serve(
        "--address", "127.0.0.1:0", "--device", "cpu=64MiB",
        "--node-id", "a", "--cluster", f"etcd://127.0.0.1:{free_port()}",
    )  # fmt: skip
    assert done.returncode == 2
    assert "cannot join the cluster" in done.stderr and "cannot reach etcd" in done.stderr


# ---- the member, in this process ------------------------------------------------------------


@pytest.mark.slow
@needs_etcd
def test_names_are_claimed_once_and_a_takeover_is_heard(etcd: EtcdServer) -> None:
    from tensord_server.cluster.node import ClusterNode, NodeIdTakenError

    lost: list[tuple[str, str | None, int | None]] = []
    a = ClusterNode("unit-a", "127.0.0.1:1", [etcd.endpoint], LEASE_S, [("cpu", 1 << 20)])
    b = ClusterNode("unit-b", "127.0.0.1:2", [etcd.endpoint], LEASE_S, [("cpu", 1 << 20)])
    a.join()
    b.join()
    try:
        a.on_name_lost(lambda *change: lost.append(change))
        assert [n.node for n in a.nodes() if n.node.startswith("unit-")] == ["unit-a", "unit-b"]
        revision = a.claim("t/1", "x", overwrite=False)
        assert b.owner("t/1", "x") == ("unit-a", "127.0.0.1:1")
        assert b.owner("t/2", "x") is None  # another tenant's (even one that looks nested)
        with pytest.raises(errors.AlreadyExistsError, match="on node 'unit-a'"):
            b.claim("t/1", "x", overwrite=False)
        a.claim("t/1", "y", overwrite=False)
        assert b.names("t/1", None, 10) == (["x", "y"], False)
        assert b.names("t/1", None, 1) == (["x"], True)
        assert b.names("t/1", "x", 10) == (["y"], False)
        taken = b.claim("t/1", "x", overwrite=True)
        assert taken > revision
        assert wait_until(lambda: ("t/1", "x", taken) in lost, timeout=5)
        assert a.owner("t/1", "x") == ("unit-b", "127.0.0.1:2")
        a.release("t/1", "x", revision)  # no longer a's claim: nothing is deleted
        assert a.owner("t/1", "x") is not None
        b.release("t/1", "x", taken)
        # a answered b from memory: it does so until its watch tells of the delete
        assert wait_until(lambda: a.owner("t/1", "x") is None, timeout=5)
        with pytest.raises(NodeIdTakenError, match=r"taken by a live member at 127\.0\.0\.1:1"):
            ClusterNode("unit-a", "127.0.0.1:3", [etcd.endpoint], LEASE_S, []).join()
    finally:
        a.close()
        b.close()
    from tensord_server.cluster.etcd import Etcd
    from tensord_server.cluster.node import name_key

    probe = Etcd([etcd.endpoint])
    assert probe.get(name_key("t/1", "y")) is None  # the revoked lease took a's names at once
    probe.close()


@pytest.mark.slow
@needs_etcd
def test_lookups_are_answered_from_the_watch_until_what_they_read_changes(
    etcd: EtcdServer,
) -> None:
    from tensord_server.cluster.node import ClusterNode

    a = ClusterNode("unit-ca", "127.0.0.1:1", [etcd.endpoint], LEASE_S, [("cpu", 1 << 20)])
    b = ClusterNode("unit-cb", "127.0.0.1:2", [etcd.endpoint], LEASE_S, [("cpu", 1 << 20)])
    a.join()
    b.join()
    reads: list[bytes] = []
    listings: list[bytes] = []
    read, listing = b.etcd.read, b.etcd.listing
    b.etcd.read = lambda key: reads.append(key) or read(key)  # type: ignore[method-assign]
    b.etcd.listing = lambda start, *more, **options: (  # type: ignore[method-assign]
        listings.append(start) or listing(start, *more, **options)
    )
    try:
        revision = a.claim("t", "x", overwrite=False)

        def from_memory() -> bool:  # once b's watch started, a read is kept
            reads.clear()
            return b.owner("t", "x") == ("unit-ca", "127.0.0.1:1") and not reads

        assert wait_until(from_memory, timeout=5)
        for _ in range(5):
            assert b.owner("t", "x") == ("unit-ca", "127.0.0.1:1")
        assert reads == []  # from memory: no round trip to etcd
        assert wait_until(lambda: "unit-ca" in [n.node for n in b.nodes()], timeout=5)
        listings.clear()
        assert "unit-ca" in [n.node for n in b.nodes()] and listings == []
        a.release("t", "x", revision)
        assert wait_until(lambda: b.owner("t", "x") is None, timeout=5)  # the watch dropped it
        assert reads  # and the lookup read etcd again
        a.close()  # a leaves: the members are read again, without it
        assert wait_until(lambda: "unit-ca" not in [n.node for n in b.nodes()], timeout=5)
        assert listings
    finally:
        a.close()
        b.close()


@pytest.mark.slow
@needs_etcd
def test_a_lapsed_lease_drops_the_names_and_registers_anew(etcd: EtcdServer) -> None:
    from tensord_server.cluster.node import ClusterNode

    lost: list[tuple[str, str | None, int | None]] = []
    node = ClusterNode("unit-lapse", "127.0.0.1:1", [etcd.endpoint], LEASE_S, [])
    node.join()
    try:
        node.on_name_lost(lambda *change: lost.append(change))
        node.claim("t", "kept", overwrite=False)
        first = node.incarnation
        lease = node._lease
        assert lease is not None
        node.etcd.revoke(lease)  # as etcd does when the lease lapses
        assert node.owner("t", "kept") is None
        assert wait_until(lambda: ("", None, None) in lost, timeout=5)
        assert wait_until(lambda: node.incarnation != first, timeout=5)
        records = {n.node: n for n in node.nodes()}
        assert records["unit-lapse"].incarnation == node.incarnation
    finally:
        node.close()


# ---- three servers ----------------------------------------------------------------------


@dataclass
class Node:
    name: str
    process: subprocess.Popen[str]
    address: str

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        if self.process.stdout is not None:
            self.process.stdout.close()


@pytest.fixture
def tokens_file() -> Iterator[str]:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "tokens"
        path.write_text(TOKENS)
        yield str(path)


def start_nodes(
    etcd: EtcdServer | EtcdCluster,
    tokens: str,
    names: str = "abc",
    *extra: str,
    secret: str | None = None,
) -> list[Node]:
    """``tensord serve`` nodes, each with ``extra`` flags (a flag given again there wins);
    ``secret``: the cluster token file (default: the tokens file's sibling
    ``cluster-token``, written here)."""
    if secret is None:
        secret = str(Path(tokens).with_name("cluster-token"))
        Path(secret).write_text(CLUSTER_SECRET + "\n")
    nodes = []
    for name in names:
        process, address = start_serve_process(
            "--address", "127.0.0.1:0", "--device", "cpu=256MiB", "--auth-tokens", tokens,
            "--node-id", f"{name}-{os.getpid()}", "--cluster", etcd.url(),
            "--cluster-lease", f"{LEASE_S:g}s", "--cluster-token-file", secret, *extra,
        )  # fmt: skip
        nodes.append(Node(name, process, address))
    return nodes


def node_id(node: Node) -> str:
    return f"{node.name}-{os.getpid()}"


@pytest.fixture
def three_nodes(etcd: EtcdServer, tokens_file: str) -> Iterator[list[Node]]:
    nodes = start_nodes(etcd, tokens_file)
    yield nodes
    for node in nodes:
        node.stop()


def connect(node: Node, tenant: str = "alice") -> Any:
    return tensord.connect(node.address, token=f"{tenant}-token", local=False, call_timeout=10)


@needs_etcd
@pytest.mark.slow
def test_a_name_put_on_one_node_is_read_from_another(three_nodes: list[Node]) -> None:
    a, _, c = three_nodes
    with connect(a) as on_a, connect(c) as on_c, connect(c, "bob") as bob_on_c:
        assert [n["node"] for n in on_c.nodes()] == [f"{x}-{os.getpid()}" for x in "abc"]
        assert [n["self"] for n in on_c.nodes()] == [False, False, True]
        data = np.arange(24, dtype=np.float32).reshape(4, 6) * 1.5
        x = on_a.tensor(data)
        on_a.put("weights", x.t())  # a strided view: the name keeps its layout
        got = on_c.get("weights")  # the redirect, followed once
        assert got.client.address == a.address  # a handle on a's Storage
        assert got.shape == (6, 4) and got.stride() == (1, 6)
        np.testing.assert_array_equal(got.numpy(), data.T)
        assert got.numpy().tobytes() == data.T.tobytes()
        with pytest.raises(errors.AlreadyExistsError, match="already exists"):
            on_c.put("weights", on_c.zeros(2))  # one namespace: c may not claim it too
        with pytest.raises(errors.NotFoundError):
            bob_on_c.get("weights")  # tenants stay apart across nodes
        on_c.put("bias", on_c.ones(3))
        assert on_a.names() == ["bias", "weights"]
        assert bob_on_c.names() == []
        on_c.put("weights", got, overwrite=True)  # a's tensor, named again on a
        on_c.put("weights", on_c.zeros(5), overwrite=True)  # now c holds the name
        assert wait_until(lambda: on_a.get("weights").shape == (5,), timeout=5)
        on_a.delete("bias")  # c's name, deleted through a
        with pytest.raises(errors.NotFoundError):
            on_c.get("bias")
        assert on_a.names() == ["weights"]


@needs_etcd
@pytest.mark.slow
def test_a_client_goes_straight_to_the_holder_a_redirect_sent_it_to(
    three_nodes: list[Node],
) -> None:
    a, b, c = three_nodes
    with connect(a) as on_a, connect(b) as on_b, connect(c) as on_c:
        on_a.put("w", on_a.arange(3))
        assert on_c.get("w").client.address == a.address  # the redirect, followed
        # another node takes the name: the holder it was sends the client on
        on_b.put("w", on_b.ones(2), overwrite=True)
        assert wait_until(lambda: on_c.get("w").client.address == b.address, timeout=5)
        assert on_c.get("w").tolist() == [1.0, 1.0]
        on_b.delete("w")  # gone from its holder: the client's own node answers
        assert wait_until(lambda: _absent(on_c, "w"), timeout=5)
        # the client's own put: a get reads it at once, whatever it remembered
        on_a.put("v", on_a.arange(2))
        assert on_c.get("v").client.address == a.address
        on_c.put("v", on_c.zeros(1), overwrite=True)
        got = on_c.get("v")
        assert got.client.address == c.address and got.tolist() == [0.0]
        # a remembered holder answers without the client's own node, even a stopped one
        on_a.put("u", on_a.arange(4))
        assert on_c.get("u").client.address == a.address
        c.stop()
        assert on_c.get("u").tolist() == [0, 1, 2, 3]


@needs_etcd
@pytest.mark.slow
def test_batched_names_in_a_cluster_act_as_the_single_name_calls(
    etcd: EtcdServer, tokens_file: str
) -> None:
    nodes = start_nodes(etcd, tokens_file, "ab")
    a, b = nodes
    try:
        with (
            connect(a) as on_a,
            connect(b) as on_b,
            tensord.connect(b.address, token="alice-token", call_timeout=10) as same_host_b,
        ):
            on_a.put_many({"w1": on_a.ones(2), "w2": [1, 2]})
            # a claim another node holds is refused, and the claims before it taken back
            with pytest.raises(errors.AlreadyExistsError, match=r"item 1 \('w1'\)"):
                on_b.put_many({"fresh": on_b.zeros(1), "w1": on_b.zeros(1)})
            assert on_a.names() == ["w1", "w2"]
            with pytest.raises(errors.NotFoundError):
                on_a.get("fresh")
            # names another node holds: got from that node, one by one
            got = on_b.get_many(["w1", "w2"])
            assert [t.tolist() for t in got] == [[1.0, 1.0], [1, 2]]
            assert {t.client.address for t in got} == {a.address}
            # the same-host get follows the redirect once, to a's one-call get
            x = same_host_b.get("w2")
            assert x.client.address == a.address
            assert np.from_dlpack(x).tolist() == [1, 2]
            with pytest.raises(errors.OwnedElsewhereError, match=r"item 0 \('w1'\)") as lost:
                on_b.delete_many(["w1"])
            assert lost.value.node == f"a-{os.getpid()}"
            on_a.delete("w1", wait=False)  # queued, then applied at the next wait
            on_a.delete_many(["w2"])
            assert on_b.names() == []
    finally:
        for node in nodes:
            node.stop()


@needs_etcd
@pytest.mark.slow
def test_a_killed_node_takes_its_names_and_the_others_serve_on(three_nodes: list[Node]) -> None:
    a, b, c = three_nodes
    with connect(a) as on_a, connect(b) as on_b, connect(c) as on_c:
        on_a.put("on-a", on_a.full((3,), 7.0))
        on_b.put("on-b", on_b.arange(5))
        held = on_c.get("on-b")  # a handle on b's Storage, through c's client
        assert held.tolist() == [0, 1, 2, 3, 4]
        b.process.send_signal(signal.SIGKILL)
        b.process.wait(timeout=10)
        killed = time.monotonic()
        assert wait_until(lambda: "on-b" not in on_c.names(), timeout=LEASE_S * 2 + 3)
        # within the lease, plus a keep-alive, plus etcd's expiry sweep
        assert time.monotonic() - killed < LEASE_S + LEASE_S / 3 + 2.0
        assert [n["node"] for n in on_c.nodes()] == [f"{x}-{os.getpid()}" for x in "ac"]
        with pytest.raises(errors.NodeLostError) as lost:
            held.tolist()
        assert lost.value.node == f"b-{os.getpid()}" and lost.value.address == b.address
        assert isinstance(lost.value, ConnectionError)
        with pytest.raises(errors.NodeLostError, match="left the cluster") as gone:
            on_a.get("on-b")  # not a name never made: one lost with its node
        assert gone.value.node == f"b-{os.getpid()}" and gone.value.address == b.address
        with pytest.raises(errors.NotFoundError):
            on_a.get("never-made")
        assert on_c.get("on-a").tolist() == [7.0, 7.0, 7.0]  # the others keep what they hold
        on_c.put("on-b", on_c.zeros(1))  # claimed again: no longer lost
        assert on_a.get("on-b").tolist() == [0.0]
        on_c.put("after", on_c.ones(2))
        assert on_a.get("after").tolist() == [1.0, 1.0]


@needs_etcd
@pytest.mark.slow
def test_without_etcd_local_operations_go_on_and_cluster_ones_fail_clearly(
    make_etcd: Callable[[], EtcdServer], tokens_file: str
) -> None:
    etcd = make_etcd()
    nodes = start_nodes(etcd, tokens_file, "ab")
    try:
        a, b = nodes
        with connect(a) as on_a, connect(b) as on_b:
            on_a.put("kept", on_a.arange(4))
            assert on_b.get("kept").tolist() == [0, 1, 2, 3]
            etcd.stop()
            x = on_a.tensor([1.0, 2.0])  # local work: tensors, copies, views
            assert x.clone().view(2, 1).tolist() == [[1.0], [2.0]]
            assert on_a.get("kept").tolist() == [0, 1, 2, 3]  # a's own name: held here
            with pytest.raises(errors.ClusterUnavailableError, match="cannot reach etcd"):
                on_a.put("new", x)
            with pytest.raises(errors.ClusterUnavailableError, match="cannot reach etcd"):
                on_a.nodes()

            def b_asks_etcd() -> bool:
                try:
                    on_b.get("kept")
                except errors.ClusterUnavailableError:
                    return True
                return False

            # b answers who holds it from memory until it notices etcd is gone (its
            # watch's connection closing, at the latest its next renewal failing); then
            # it must ask etcd
            assert wait_until(b_asks_etcd, timeout=LEASE_S + 3)
            assert on_a.tensor([3]).tolist() == [3]
    finally:
        for node in nodes:
            node.stop()


# ---- copies between nodes, node calls ----------------------------------------------------


@needs_etcd
@pytest.mark.slow
def test_a_copy_to_another_node_is_the_source_bit_for_bit(three_nodes: list[Node]) -> None:
    torch = pytest.importorskip("torch")
    a, b, c = three_nodes
    with connect(a) as on_a, connect(c) as on_c:
        base = torch.arange(4 * 6 * 8, dtype=torch.float32).reshape(4, 6, 8) * 0.25 - 7
        x = on_a.tensor(base.numpy())
        views = {
            "contiguous": (x, base),
            "strided": (x.transpose(0, 2)[1:, ::2], base.transpose(0, 2)[1:, ::2]),
            "expanded": (x[0, :1].expand(5, 8), base[0, :1].expand(5, 8)),
            "view(dtype)": (x.view(tensord.int32), base.view(torch.int32)),
        }
        for what, (view, oracle) in views.items():
            moved = view.to(f"{node_id(b)}/cpu")
            assert moved.client.address == b.address, what  # a handle on b, in its session
            assert moved.shape == tuple(oracle.shape) and moved.is_contiguous(), what
            got = np.asarray(moved.numpy())
            want = oracle.contiguous().numpy()
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), what
        assert x.numpy().tobytes() == base.numpy().tobytes()  # the source is intact
        # a copy of a copy, onward to a third node; dtype too
        y = x.to(f"{node_id(b)}/cpu").to(f"{node_id(c)}/cpu", torch.float64)
        assert y.client.address == c.address
        np.testing.assert_array_equal(y.numpy(), base.double().numpy())
        # the copy is b's own: the name put of it lives on b
        on_a.put("moved", x.to(f"{node_id(b)}/cpu"))
        assert on_c.get("moved").client.address == b.address
        with pytest.raises(errors.NotFoundError, match="no live node 'nowhere'"):
            x.to("nowhere/cpu")
        same = x.to(f"{node_id(a)}/cpu")  # this node's own: a local copy
        assert same.client is on_a and same.handle != x.handle


@needs_etcd
@pytest.mark.slow
def test_node_calls_need_the_cluster_secret(three_nodes: list[Node]) -> None:
    import grpc
    from tensord import schema as pb
    from tensord.protocol import (
        CHECKSUM_KEY,
        NODE_TENANT_KEY,
        NODE_TOKEN_KEY,
        SESSION_KEY,
        UPLOAD_HEADER_KEY,
    )

    _, b, _ = three_nodes
    with connect(b) as on_b:
        header = pb.UploadHeader(shape=[4], dtype="uint8", device="cpu", nbytes=4)
        with grpc.insecure_channel(b.address) as channel:
            upload = channel.stream_unary(
                "/tensord.v1.Tensord/Upload",
                request_serializer=bytes,
                response_deserializer=pb.TensorMeta.FromString,
            )

            def send(*metadata: tuple[str, Any]) -> Any:
                base = [
                    (SESSION_KEY, on_b.session_id),
                    (UPLOAD_HEADER_KEY, header.SerializeToString()),
                ]
                return upload(iter([b"\x01\x02\x03\x04"]), metadata=[*base, *metadata], timeout=10)

            for metadata in (
                [(NODE_TENANT_KEY, "alice")],  # no secret
                [(NODE_TENANT_KEY, "alice"), (NODE_TOKEN_KEY, "wrong-secret-0123456789")],
                # a tenant's token is no node credential
                [(NODE_TENANT_KEY, "alice"), (NODE_TOKEN_KEY, "alice-token")],
                [(NODE_TOKEN_KEY, CLUSTER_SECRET)],  # names no tenant
            ):
                with pytest.raises(grpc.RpcError) as refused:
                    send(*metadata)
                assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED, metadata
                assert "node call refused" in refused.value.details()
            # with the secret, as the tenant: the tenant's own session checks still apply
            with pytest.raises(grpc.RpcError) as other:
                send((NODE_TENANT_KEY, "bob"), (NODE_TOKEN_KEY, CLUSTER_SECRET))
            assert other.value.code() is not grpc.StatusCode.OK
            assert other.value.code() is not grpc.StatusCode.UNAUTHENTICATED
            meta = send((NODE_TENANT_KEY, "alice"), (NODE_TOKEN_KEY, CLUSTER_SECRET))
            assert meta.handle
            # asked for it, the target answers the CRC-32 of the bytes it stored
            header.checksum = True
            meta, call = upload.with_call(
                iter([b"\x01\x02", b"\x03\x04"]),
                metadata=[
                    (SESSION_KEY, on_b.session_id),
                    (UPLOAD_HEADER_KEY, header.SerializeToString()),
                    (NODE_TENANT_KEY, "alice"),
                    (NODE_TOKEN_KEY, CLUSTER_SECRET),
                ],
                timeout=10,
            )
            trailers = dict(call.trailing_metadata())
            assert int(trailers[CHECKSUM_KEY]) == zlib.crc32(b"\x01\x02\x03\x04")


@needs_etcd
@pytest.mark.slow
def test_a_node_without_the_secret_refuses_to_copy_and_to_be_copied_to(
    etcd: EtcdServer, tokens_file: str
) -> None:
    other = str(Path(tokens_file).with_name("other-secret"))
    Path(other).write_text("another-secret-0123456789\n")
    a, b = start_nodes(etcd, tokens_file, "ab")
    (c,) = start_nodes(etcd, tokens_file, "c", secret=other)
    try:
        with connect(a) as on_a, connect(c) as on_c:
            x = on_a.arange(16)
            with pytest.raises(errors.UnauthenticatedError, match="node call refused"):
                x.to(f"{node_id(c)}/cpu")  # c holds another secret
            with pytest.raises(errors.UnauthenticatedError, match="node call refused"):
                on_c.arange(3).to(f"{node_id(b)}/cpu")
            assert x.to(f"{node_id(b)}/cpu").tolist() == list(range(16))
    finally:
        for node in (a, b, c):
            node.stop()


@needs_etcd
@pytest.mark.slow
def test_a_copy_to_another_node_obeys_its_limits(etcd: EtcdServer, tokens_file: str) -> None:
    nodes = [
        *start_nodes(etcd, tokens_file, "a"),
        *start_nodes(etcd, tokens_file, "b", "--quota", "alice:cpu=1MiB"),
    ]
    a, b = nodes
    try:
        with connect(a) as on_a:
            small = on_a.zeros(1024, dtype=tensord.uint8)
            assert small.to(f"{node_id(b)}/cpu").shape == (1024,)
            big = on_a.zeros(2 << 20, dtype=tensord.uint8)  # past alice's quota on b (and a)
            with pytest.raises(errors.ResourceExhaustedError):
                big.to(f"{node_id(b)}/cpu")
    finally:
        for node in nodes:
            node.stop()


@needs_etcd
@pytest.mark.slow
def test_a_share_token_routes_itself_to_its_node(three_nodes: list[Node]) -> None:
    a, b, c = three_nodes
    with connect(a) as on_a, connect(b) as on_b, connect(c) as on_c, connect(b, "bob") as bob:
        data = np.arange(12, dtype=np.int64).reshape(3, 4)
        x = on_a.tensor(data)
        token = x[1:].share(uses=2)
        assert token.startswith(f"{node_id(a)}~")  # it names its node
        got = on_b.attach(token)  # a client of b: redirected to a, once
        assert got.client.address == a.address
        np.testing.assert_array_equal(got.numpy(), data[1:])
        got[0, 0] = -1  # the same Storage as x's, on a
        got.client.synchronize()  # the write was queued on the session on a
        assert x[1, 0].item() == -1
        with pytest.raises(errors.NotFoundError):
            bob.attach(token)  # another tenant, on the owner as on one node
        assert on_c.attach(token).client.address == a.address  # the second and last use
        with pytest.raises(errors.NotFoundError, match="used"):
            on_b.attach(token)
        again = on_a.arange(3).share(uses=None)
        assert on_b.attach(again).tolist() == [0, 1, 2]
        assert on_a.revoke(again) is True
        with pytest.raises(errors.NotFoundError):
            on_c.attach(again)
        with pytest.raises(errors.NotFoundError, match="not in the cluster"):
            on_b.attach("gone-node~" + again.partition("~")[2])
        local = on_b.arange(2).share()
        assert on_b.attach(local).client is on_b  # b's own token: no redirect


@needs_etcd
@pytest.mark.slow
def test_a_paused_node_lapses_and_comes_back_as_a_new_incarnation(
    three_nodes: list[Node],
) -> None:
    a, b, c = three_nodes
    quick = tensord.connect(c.address, token="alice-token", local=False, call_timeout=1)
    with connect(a) as on_a, connect(b) as on_b, connect(c) as on_c, quick:
        on_b.put("on-b", on_b.arange(4))
        assert on_c.get("on-b").tolist() == [0, 1, 2, 3]
        held = quick.get("on-b")  # a handle on b's Storage
        first = {n["node"]: n["incarnation"] for n in on_a.nodes()}[node_id(b)]
        b.process.send_signal(signal.SIGSTOP)
        paused = time.monotonic()
        try:
            # a paused node still holds its connections: a call waits out its timeout
            with pytest.raises(errors.DeadlineExceededError):
                held.tolist()
            assert wait_until(lambda: "on-b" not in on_c.names(), timeout=LEASE_S * 2 + 3)
            assert time.monotonic() - paused < LEASE_S + LEASE_S / 3 + 2.0
            assert node_id(b) not in [n["node"] for n in on_a.nodes()]
            with pytest.raises(errors.NodeLostError) as gone:
                on_a.get("on-b")  # gone with b's lease, on every other node
            assert gone.value.node == node_id(b)
            with pytest.raises(errors.NotFoundError, match="no live node"):
                on_a.arange(2).to(f"{node_id(b)}/cpu")
            on_a.put("during", on_a.ones(1))  # the others serve on
            assert on_c.get("during").tolist() == [1.0]
        finally:
            b.process.send_signal(signal.SIGCONT)

        def rejoined() -> bool:
            listed = {n["node"]: n["incarnation"] for n in on_a.nodes()}
            return listed.get(node_id(b)) not in (None, first)

        assert wait_until(rejoined, timeout=LEASE_S * 3 + 3)  # a new incarnation
        assert wait_until(lambda: _absent(on_b, "on-b"), timeout=5)  # b dropped it too
        on_b.put("after", on_b.full((2,), 3.0))  # and takes new names again
        assert on_a.get("after").tolist() == [3.0, 3.0]
        assert on_a.arange(3).to(f"{node_id(b)}/cpu").tolist() == [0, 1, 2]


def _absent(client: Any, name: str) -> bool:
    try:
        client.get(name)
    except errors.NotFoundError:
        return True
    return False


@needs_etcd
@pytest.mark.slow
def test_a_cluster_recovers_when_etcd_comes_back(
    make_etcd: Callable[[], EtcdServer], tokens_file: str
) -> None:
    etcd = make_etcd()
    nodes = start_nodes(etcd, tokens_file, "ab")
    try:
        a, b = nodes
        with connect(a) as on_a, connect(b) as on_b:
            on_a.put("before", on_a.arange(3))
            etcd.stop()
            with pytest.raises(errors.ClusterUnavailableError, match="cannot reach etcd"):
                on_b.put("while-down", on_b.ones(1))
            with pytest.raises(errors.ClusterUnavailableError):
                on_a.arange(2).to(f"{node_id(b)}/cpu")  # where b is, etcd says
            time.sleep(LEASE_S + 1)  # past a whole lease unrenewed: the nodes lapse
            etcd.restart()

            def serving() -> bool:
                try:
                    on_b.put("after", on_b.ones(2), overwrite=True)
                except errors.ClusterUnavailableError:
                    return False
                return True

            assert wait_until(serving, timeout=LEASE_S * 3 + 5)
            assert wait_until(lambda: len(on_a.nodes()) == 2, timeout=LEASE_S * 3 + 5)
            assert on_a.get("after").client.address == b.address
            assert on_a.get("after").tolist() == [1.0, 1.0]
            assert on_a.arange(2).to(f"{node_id(b)}/cpu").tolist() == [0, 1]
    finally:
        for node in nodes:
            node.stop()


# ---- a three-member etcd ------------------------------------------------------------------

# The lease the nodes hold while etcd elects a new leader: several elections long (etcd's
# election timeout is 1 s), so that an election on a loaded machine does not lapse them.
ELECTION_LEASE_S = 8.0
# A new leader is elected, and the nodes have moved to it, within this long.
ELECTION_S = 20.0


@dataclass
class EtcdCluster:
    """etcd members on loopback ports, one raft cluster."""

    members: list[EtcdServer]

    def url(self, *first: EtcdServer) -> str:
        """--cluster's URL: the ``first`` members' endpoints, then the others'."""
        ordered = [*first, *(m for m in self.members if m not in first)]
        return "etcd://" + ",".join(m.endpoint for m in ordered)

    def leader(self) -> EtcdServer | None:
        """The member a live member names as its leader (None: none is elected)."""
        import grpc
        from aetcd import rpc

        ids: dict[int, EtcdServer] = {}
        leader = 0
        for member in self.members:
            if member.process.poll() is not None:
                continue
            with grpc.insecure_channel(member.endpoint) as channel:
                try:
                    status = rpc.MaintenanceStub(channel).Status(rpc.StatusRequest(), timeout=1)
                except grpc.RpcError:
                    continue
            ids[int(status.header.member_id)] = member
            leader = leader or int(status.leader)
        return ids.get(leader)

    def stop(self) -> None:
        for member in self.members:
            member.stop()
            shutil.rmtree(member.data_dir, ignore_errors=True)


def start_etcd_cluster(size: int) -> EtcdCluster:
    """``size`` etcd members forming one cluster; returns once each answers a call."""
    assert ETCD is not None
    ports = [(free_port(), free_port()) for _ in range(size)]
    initial = ",".join(f"m{i}=http://127.0.0.1:{peer}" for i, (_, peer) in enumerate(ports))
    members = []
    for i, (client, peer) in enumerate(ports):
        data = tempfile.mkdtemp(prefix="tensord-etcd-")
        command = (
            ETCD, f"--name=m{i}", f"--data-dir={data}",
            f"--listen-client-urls=http://127.0.0.1:{client}",
            f"--advertise-client-urls=http://127.0.0.1:{client}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster={initial}", "--initial-cluster-state=new",
            "--initial-cluster-token=tensord-test", "--log-level=error",
        )  # fmt: skip
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        members.append(EtcdServer(process, f"127.0.0.1:{client}", data, command))
    cluster = EtcdCluster(members)
    try:
        for member in members:  # each answers once a quorum has formed
            wait_for_etcd(member)
    except BaseException:
        cluster.stop()
        raise
    return cluster


@needs_etcd
@pytest.mark.slow
def test_names_and_copies_outlive_the_loss_of_etcds_leader(tokens_file: str) -> None:
    cluster = start_etcd_cluster(3)
    nodes: list[Node] = []
    try:
        assert wait_until(lambda: cluster.leader() is not None, timeout=ELECTION_S)
        leader = cluster.leader()
        assert leader is not None
        follower = next(m for m in cluster.members if m is not leader)
        # a talks to the leader first, b to a follower: a must move, b need not
        for name, first in (("a", leader), ("b", follower)):
            nodes += start_nodes(
                cluster, tokens_file, name, "--cluster", cluster.url(first),
                "--cluster-lease", f"{ELECTION_LEASE_S:g}s",
            )  # fmt: skip
        a, b = nodes
        rng = np.random.default_rng(7)
        with connect(a) as on_a, connect(b) as on_b:
            held = {
                f"{where}-{i}": rng.standard_normal((64, 33)).astype(np.float32)
                for i in range(3)
                for where in ("on-a", "on-b")
            }
            for name, values in held.items():
                owner = on_a if name.startswith("on-a") else on_b
                owner.put(name, owner.tensor(values))
            members = {n["node"]: n["incarnation"] for n in on_a.nodes()}
            payload = rng.integers(0, 256, 5 << 20, dtype=np.uint8)
            source = on_a.tensor(payload)

            leader.stop()  # SIGKILL: the raft leader and a's etcd endpoint

            assert wait_until(lambda: cluster.leader() not in (None, leader), timeout=ELECTION_S)

            def names_work() -> bool:
                try:
                    on_b.put("after", on_b.ones(4), overwrite=True)
                    on_a.put("after-on-a", on_a.zeros(2), overwrite=True)
                except errors.ClusterUnavailableError:
                    return False
                return True

            assert wait_until(names_work, timeout=ELECTION_S)
            # nothing lost: every name, from either node (the other one's by redirect)
            for name, values in held.items():
                for client in (on_a, on_b):
                    got = client.get(name)
                    assert got.client.address == (a if name.startswith("on-a") else b).address
                    assert got.numpy().tobytes() == values.tobytes()
            expected = sorted([*held, "after", "after-on-a"])
            assert on_a.names() == expected and on_b.names() == expected
            # the nodes kept their membership: no lease lapsed, no new incarnation
            assert {n["node"]: n["incarnation"] for n in on_b.nodes()} == members
            # copies both ways, bit for bit
            copied = source.to(f"{node_id(b)}/cpu")
            assert copied.client.address == b.address
            assert copied.numpy().tobytes() == payload.tobytes()
            back = on_b.get("on-b-0").to(f"{node_id(a)}/cpu")
            assert back.client.address == a.address
            assert back.numpy().tobytes() == held["on-b-0"].tobytes()
    finally:
        for node in nodes:
            node.stop()
        cluster.stop()
