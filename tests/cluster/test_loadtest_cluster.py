"""``tensord loadtest`` against three ``tensord serve`` nodes joined through a real etcd.

A few seconds of load from a few users spread over the nodes, the ``cross`` users among
them: no unexpected failure, every kind of cross-node operation done and checked, and every
node's pool back to what it held before the run.  Skipped without etcd (Debian's
etcd-server), Locust or matplotlib; Locust (gevent) never enters this process.
"""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import json
import os
import random
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tensord
from tensord_server.tools.loadtest import workloads
from test_cluster import TOKENS, EtcdServer, Node, needs_etcd, node_id, running_etcd, start_nodes

etcd = pytest.fixture(scope="module", name="etcd")(running_etcd)

# a Locust run of a few seconds, its start and its drain: well within this
RUN_TIMEOUT_S = 240


@pytest.fixture
def nodes(etcd: EtcdServer, tmp_path: Path) -> Iterator[list[Node]]:
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKENS)
    started = start_nodes(etcd, str(tokens))
    yield started
    for node in started:
        node.stop()


def needs_loadtest_extra() -> None:
    # find_spec, not importorskip: importing locust patches threading and sockets with
    # gevent in this process, and every later gRPC test would hang
    for module in ("locust", "matplotlib"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed")


def loadtest(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``tensord loadtest ARGS --out OUT`` as tenant alice (the nodes take tokens)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORD_")}
    env["TENSORD_TOKEN"] = "alice-token"
    command = [sys.executable, "-m", "tensord_server", "loadtest", *args, "--out", str(out)]
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
        env=env,
        cwd=out.parent,
    )


class Log:
    """A recorder: each op's outcomes, and the unexpected failures in full."""

    def __init__(self) -> None:
        self.ops: Counter[tuple[str, str]] = Counter()
        self.failures: list[str] = []

    def __call__(self, op: str, seconds: float, nbytes: int, exc: Any, expected: bool) -> None:
        self.ops[(op, "expected" if expected else "failed" if exc else "ok")] += 1
        if exc is not None and not expected:
            self.failures.append(f"{op}: {type(exc).__name__}: {exc}")


def drive_cross(node: Node, log: Log, steps: int, kind: type[Any] = workloads.CrossNode) -> None:
    """One ``cross`` user's whole life on ``node``, as a Locust user lives it."""
    with tensord.connect(node.address, token="alice-token", local=False) as client:
        user = kind(client, log, rng=random.Random(5), run_id="unit")
        user.start()
        for _ in range(steps):
            with contextlib.suppress(workloads.OpFailed):  # recorded; the step ends, as in Locust
                user.step()
        user.stop()


@needs_etcd
@pytest.mark.slow
def test_a_cross_user_alone_still_crosses_nodes_and_checks_where_its_bytes_are(
    nodes: list[Node],
) -> None:
    a = nodes[0]
    before = [allocated(n) for n in nodes]
    log = Log()
    drive_cross(a, log, steps=6)  # no other user: its own names and tokens, from b and c
    assert log.failures == []
    for check in ("cross.get.verify", "cross.to.verify", "cross.attach.verify"):
        assert log.ops[(check, "ok")] == 6, log.ops
    assert [allocated(n) for n in nodes] == before

    # through its own node nothing crosses, and each check says so (a failed check ends
    # the step: the ops after it are left out, one kind a time)
    for kind in ("get", "to", "attach"):
        skipped = {op: (lambda self: None) for op in ("_get", "_to") if op != f"_{kind}"}
        local = type(
            "Local", (workloads.CrossNode,), {"_other": lambda self: self.node_id, **skipped}
        )
        wrong = Log()
        drive_cross(a, wrong, steps=3, kind=local)
        assert wrong.ops[(f"cross.{kind}.verify", "failed")] == 3, (kind, wrong.ops)
        assert len(wrong.failures) == 3 and all(
            f"cross.{kind}.verify: DataMismatch" in f and "the handle is not on the holder" in f
            for f in wrong.failures
        ), wrong.failures
    assert [allocated(n) for n in nodes] == before


def allocated(node: Node) -> int:
    with tensord.connect(node.address, token="alice-token", local=False) as client:
        return int(client.memory_stats()["allocated_bytes.all.current"])


@needs_etcd
@pytest.mark.slow
def test_a_cluster_load_test_crosses_nodes_and_leaks_nothing_on_any(
    nodes: list[Node], tmp_path: Path
) -> None:
    needs_loadtest_extra()
    a, b, c = nodes
    with tensord.connect(b.address, token="alice-token", local=False) as held:
        # memory a tenant holds before the run (and after it) is no leak of the run
        kept = held.ones(1000)
        before = [allocated(n) for n in nodes]
        assert before[1] > 0
        out = tmp_path / "results"
        result = loadtest(
            out,
            # both shapes of the flag: a list, and the option again
            "--address", f"{a.address},{b.address}", "--address", c.address,
            "-u", "9", "-r", "9", "-t", "6s", "--scale", "0.25",
            "--workloads", "kv=1,churn=1,views=1,sharing=1,cross=3",
            "--interval", "0.25", "--leak-timeout", "20", "--progress-interval", "0",
            "--no-plot",
        )  # fmt: skip
        log = result.stdout + result.stderr
        if (out / "locust.log").exists():
            log += (out / "locust.log").read_text()[-4000:]
        assert result.returncode == 0, log
        summary = json.loads((out / "summary.json").read_text())
        assert summary["passed"], log
        assert summary["unexpected_failures"] == 0, summary["failures_by_op"]
        assert summary["exceptions"] == 0, summary["exception_messages"]
        # each kind of cross-node operation was done, and its check passed
        assert set(summary["cross_node_ops"]) == {"get", "to", "attach"}
        assert all(n > 0 for n in summary["cross_node_ops"].values()), summary["cross_node_ops"]
        cross_checks = {o["name"]: o for o in summary["ops"] if o["name"].startswith("cross.")}
        for check in ("cross.get.verify", "cross.to.verify", "cross.attach.verify"):
            assert cross_checks[check]["failures"] == 0
        # the other workloads ran beside them
        assert {"kv", "churn", "views", "share"} <= {
            o["name"].split(".")[0] for o in summary["ops"]
        }
        # every node, in the order given, back to what it held before the run
        assert [n["node"] for n in summary["nodes"]] == [node_id(n) for n in nodes]
        assert [n["address"] for n in summary["nodes"]] == [n.address for n in nodes]
        # the users spread over the nodes (each workload's in turn, so not exactly 3 each)
        users = [n["users"] for n in summary["nodes"]]
        assert sum(users) == 9 and all(u > 0 for u in users), users
        # each node sampled into its own time series, through the whole run
        names = [n["timeseries"] for n in summary["nodes"]]
        assert names == ["timeseries.csv", *(f"timeseries-{node_id(n)}.csv" for n in (b, c))]
        for report in summary["nodes"]:
            with open(out / report["timeseries"], newline="") as f:
                phases = Counter(row["phase"] for row in csv.DictReader(f))
            assert phases["baseline"] == 1 and phases["load"] > 5 and phases["after"] == 1
            assert report["peak_allocated_bytes"] > report["baseline_allocated_bytes"]
        for report, baseline in zip(summary["nodes"], before, strict=True):
            assert report["leaked_bytes"] == 0, report
            assert report["baseline_allocated_bytes"] == baseline > 0 or report["node"] != node_id(
                b
            )
            assert report["final_allocated_bytes"] == baseline, report
        assert summary["leaked_bytes"] == 0 and summary["leftover_names"] == []
        assert [allocated(n) for n in nodes] == before
        assert "Cross-node operations done and checked" in (out / "summary.md").read_text()
        assert kept.tolist()[:2] == [1.0, 1.0]
