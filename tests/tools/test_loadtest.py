"""The load test: workloads against a real server, the report, the compose file, one short run.

Locust (gevent) never enters this process: the short run starts ``tensord
loadtest`` in a subprocess, which starts the server and Locust in theirs.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import itertools
import json
import os
import random
import re
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tensord
from tensord import _torch as torch_interop
from tensord_server.data import bundled_traces
from tensord_server.domain.store import TensorStore
from tensord_server.rpc.grpc_server import create_server
from tensord_server.tools.loadtest import nodes, workloads
from tensord_server.tools.loadtest import runner as loadtest

REPO = Path(__file__).resolve().parents[2]
#: the workloads a server alone runs (the cross-node one needs a cluster: tests/cluster)
SINGLE_SERVER = sorted(n for n, w in workloads.WORKLOADS.items() if not w.needs_cluster)


# -- a real server in this process ----------------------------------------------------
class Running:
    def __init__(self, device: str) -> None:
        self.daemon = TensorStore((device,), session_grace=0.5, lease=30.0)
        self.grpc_server, port = create_server("127.0.0.1:0", store=self.daemon)
        self.address = f"127.0.0.1:{port}"

    def stop(self) -> None:
        self.grpc_server.stop(2.0).wait()
        self.daemon.close()


@pytest.fixture
def gib_server() -> Iterator[Running]:
    server = Running("cpu=1GiB")
    yield server
    server.stop()


@pytest.fixture
def tiny_server() -> Iterator[Running]:
    server = Running("cpu=24MiB")
    yield server
    server.stop()


class Log:
    """A recorder: every op, and the unexpected failures in full."""

    def __init__(self) -> None:
        self.ops: Counter[tuple[str, str]] = Counter()
        self.failures: list[str] = []

    def __call__(self, op: str, seconds: float, nbytes: int, exc: Any, expected: bool) -> None:
        kind = "expected" if expected else ("failed" if exc is not None else "ok")
        self.ops[(op, kind)] += 1
        if exc is not None and not expected:
            self.failures.append(f"{op}: {type(exc).__name__}: {exc}")

    def kinds(self, kind: str) -> set[str]:
        return {op for (op, k) in self.ops if k == kind}


def drive(address: str, name: str, steps: int, log: Log, seed: int = 0) -> None:
    """One workload's whole life on its own session, as a Locust user lives it."""
    with tensord.connect(address) as client:
        workload = workloads.WORKLOADS[name](client, log, rng=random.Random(seed), run_id="t")
        workload.start()
        for _ in range(steps):
            workload.step()
        workload.stop()


def wait_for_allocated(client: Any, target: int, timeout_steps: int = 100) -> int:
    """Allocated bytes once they reach ``target`` (releases are batched), polled a bounded time."""
    import time

    allocated = client.memory_allocated()
    for _ in range(timeout_steps):
        if allocated <= target:
            break
        time.sleep(0.05)
        allocated = client.memory_allocated()
    return allocated


# -- workloads -------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", SINGLE_SERVER)
def test_each_workload_runs_clean_and_gives_everything_back(gib_server: Running, name: str) -> None:
    log = Log()
    drive(gib_server.address, name, steps=25, log=log)
    assert log.failures == []
    assert log.kinds("ok"), "the workload made no call"
    with tensord.connect(gib_server.address) as monitor:
        assert wait_for_allocated(monitor, 0) == 0
        assert [n for n in monitor.names() if n.startswith("loadtest/")] == []


class Sequence:
    """A recorder keeping every op in order, with its bytes and outcome."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, str]] = []

    def __call__(self, op: str, seconds: float, nbytes: int, exc: Any, expected: bool) -> None:
        self.calls.append((op, nbytes, "expected" if expected else type(exc).__name__))


@pytest.mark.slow
@pytest.mark.parametrize("name", SINGLE_SERVER)
def test_a_seed_makes_a_workload_choose_alike_run_after_run(gib_server: Running, name: str) -> None:
    """tensord loadtest --seed: a user seeded alike (workload_rng) makes the same calls with
    the same sizes in every run, so paired runs of two policies serve the same work; a
    workload drawing from any other random source (the random module, numpy's) fails this."""
    runs = []
    for _ in range(2):
        # a run is a fresh process: no share tokens left over from another run's users
        workloads._TOKENS.clear()
        sequence = Sequence()
        with tensord.connect(gib_server.address) as client:
            rng = workloads.workload_rng("7", name, 0)
            workload = workloads.WORKLOADS[name](client, sequence, rng=rng, run_id="seeded")
            workload.start()
            for step in range(12):
                workloads.seeded_step(workload, "7", 0, 0, step)
            workload.stop()
        runs.append(sequence.calls)
    assert len(runs[0]) >= 12  # at least a call a step
    assert runs[0] == runs[1]


def test_workload_rng_streams() -> None:
    first = [workloads.workload_rng("7", "kv", 0).random() for _ in range(2)]
    assert first[0] == first[1]  # same (seed, worker, workload, number): the same stream
    others = [
        workloads.workload_rng("8", "kv", 0),
        workloads.workload_rng("7", "churn", 0),
        workloads.workload_rng("7", "kv", 1),
        workloads.workload_rng("7", "kv", 0, worker=1),
    ]
    assert len({first[0], *(rng.random() for rng in others)}) == 5
    unseeded = [workloads.workload_rng(None, "kv", 0).random() for _ in range(2)]
    assert unseeded[0] != unseeded[1]


def test_a_seeded_step_draws_from_its_own_generator() -> None:
    """seeded_step: each step has its own generator, so a step that draws more in one run
    (a call that failed under one policy and not under the other) leaves the later steps'
    choices alike; unseeded, the workload keeps its own generator."""

    class Draws(workloads.Workload):
        name = "draws"

        def __init__(self, extra_at: int | None) -> None:
            super().__init__(client=None, record=lambda *args: None)
            self.extra_at, self.steps_taken, self.drawn = extra_at, 0, []

        def step(self) -> None:
            if self.steps_taken == self.extra_at:
                self.rng.random()  # the path only one run takes
            self.drawn.append(self.rng.random())
            self.steps_taken += 1

    runs = []
    for extra_at in (None, 2):
        workload = Draws(extra_at)
        for step in range(5):
            workloads.seeded_step(workload, "7", 0, 0, step)
        runs.append(workload.drawn)
    assert runs[0][:2] == runs[1][:2] and runs[0][3:] == runs[1][3:]
    assert runs[0][2] != runs[1][2]
    assert len(set(runs[0])) == 5  # every step its own stream
    unseeded = Draws(None)
    kept = unseeded.rng
    workloads.seeded_step(unseeded, None, 0, 0, 0)
    assert unseeded.rng is kept


def test_seed_with_locust_workers_is_refused_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With worker processes Locust's master assigns users to workers in an order that
    changes between runs: a seeded run would not be paired, so it is refused."""
    parser = argparse.ArgumentParser()
    loadtest.add_arguments(parser)
    out = tmp_path / "out"
    args = parser.parse_args(["--seed", "3", "--workers", "2", "--out", str(out)])
    assert loadtest.run(args) == 2
    assert "--seed needs --workers 0" in capsys.readouterr().err
    assert not out.exists()


def recorded_locust_envs(
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[argparse.ArgumentParser, list[dict[str, str]]]:
    """The loadtest's parser, and the environments it starts Locust with, in order (each
    start is recorded, then fails with OSError: no Locust runs)."""
    parser = argparse.ArgumentParser()
    loadtest.add_arguments(parser)
    envs: list[dict[str, str]] = []

    def popen(command: list[str], **kwargs: Any) -> None:
        envs.append(kwargs["env"])
        raise OSError("not started")

    monkeypatch.setattr(loadtest.subprocess, "Popen", popen)
    return parser, envs


def test_loadtest_seed_reaches_every_locust_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tensord loadtest --seed N: Locust (master and workers) runs with TENSORD_SEED=N; without
    it, with none (an inherited one removed would be a surprise too: it is passed through)."""
    parser, envs = recorded_locust_envs(monkeypatch)
    monkeypatch.delenv("TENSORD_SEED", raising=False)
    for argv in (["--seed", "11"], []):
        with pytest.raises(OSError):
            loadtest.run_locust(parser.parse_args(argv), "127.0.0.1:1", tmp_path, "run")
    assert envs[0]["TENSORD_SEED"] == "11"
    assert "TENSORD_SEED" not in envs[1]


def test_views_workload_checks_data_it_reads_back(gib_server: Running) -> None:
    log = Log()
    with tensord.connect(gib_server.address) as client:
        views = workloads.ViewHeavy(client, log, rng=random.Random(3))
        views.verify_probability = 1.0
        views.start()
        for _ in range(10):
            views.step()
        views.stop()
    assert log.failures == []
    assert log.ops[("views.verify", "ok")] == 10


def test_sharing_users_read_each_others_tensors(gib_server: Running) -> None:
    log = Log()
    with tensord.connect(gib_server.address) as a, tensord.connect(gib_server.address) as b:
        users = [
            workloads.Sharing(c, log, rng=random.Random(i), run_id="t")
            for i, c in enumerate((a, b))
        ]
        for user in users:
            user.start()
        for _ in range(40):
            for user in users:
                user.step()
        for user in users:
            user.stop()
        assert [n for n in a.names() if n.startswith("loadtest/t/")] == []
    assert log.failures == []
    assert {"share.put", "share.token"} <= log.kinds("ok")
    assert log.kinds("ok") & {"share.get.verify", "share.attach.verify"}


@pytest.mark.slow
def test_no_workload_lets_torch_compute(
    gib_server: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Under Locust every user is a gevent greenlet, and a torch error raised in a greenlet
    # kills the whole process with SIGSEGV: torch records a C++ backtrace for each error,
    # and the unwinder walks past the greenlet's stack into stale frames.  The workloads
    # drive the server through tensord's own calls only; == on tensors (list.remove,
    # ``in``, dict comparison) would be torch's elementwise one.
    used: list[str] = []

    def refuse(func: Any, args: Any, kwargs: Any) -> Any:
        used.append(getattr(func, "__name__", repr(func)))
        raise AssertionError(f"a workload computed with torch: {used[-1]}")

    monkeypatch.setattr(torch_interop, "call", refuse)
    log = Log()
    with tensord.connect(gib_server.address) as client:
        kv = workloads.KVCache(client, log, rng=random.Random(1), run_id="t")
        kv.max_sequences = 8  # more live sequences: a finished one is rarely the first
        kv.start()
        for _ in range(400):
            kv.step()
        kv.stop()
    for name in sorted(set(SINGLE_SERVER) - {"kv"}):
        drive(gib_server.address, name, steps=25, log=log)
    assert used == []
    assert log.failures == []


def test_a_full_pool_is_an_expected_error_not_a_failure(tiny_server: Running) -> None:
    log = Log()
    drive(tiny_server.address, "bimodal", steps=30, log=log, seed=1)
    assert log.failures == []
    assert "bimodal.large" in log.kinds("expected")  # 8..48 MiB never fits 24 MiB
    with tensord.connect(tiny_server.address) as monitor:
        assert monitor.memory_stats()["num_ooms"] > 0
        assert wait_for_allocated(monitor, 0) == 0


def test_unexpected_errors_are_recorded_and_raised() -> None:
    log = Log()
    workload = workloads.Workload(client=None, record=log)

    def broken() -> None:
        raise tensord.InvalidArgumentError("bad shape")

    with pytest.raises(workloads.OpFailed, match="bad shape"):
        workload.call("x.op", broken)
    assert log.failures == ["x.op: InvalidArgumentError: bad shape"]
    with pytest.raises(workloads.OpFailed):
        workload.verify("x.verify", False, "mixed values")
    assert workload.call("x.oom", _raise_oom) is None
    assert log.ops[("x.oom", "expected")] == 1


def _raise_oom() -> None:
    raise tensord.OutOfMemoryError("out of memory")


def test_weights() -> None:
    defaults = workloads.parse_weights("")
    assert set(defaults) == set(workloads.WORKLOADS)
    assert all(defaults[name] > 0 for name in SINGLE_SERVER) and defaults["cross"] == 0
    # against a cluster the default mix adds the cross-node users
    cluster = workloads.parse_weights("", cluster=True)
    assert cluster == defaults | {"cross": workloads.CrossNode.cluster_weight}
    assert workloads.parse_weights("kv,cross") == dict.fromkeys(workloads.WORKLOADS, 0) | {
        "kv": workloads.KVCache.default_weight,
        "cross": workloads.CrossNode.cluster_weight,
    }
    weights = workloads.parse_weights("kv=5,views")
    assert weights["kv"] == 5 and weights["views"] == workloads.ViewHeavy.default_weight
    assert weights["trace"] == 0
    with pytest.raises(ValueError, match="unknown workload 'nope'"):
        workloads.parse_weights("nope=1")


def test_trace_scaling_pairs_allocs_with_frees() -> None:
    events = [
        ["segment_alloc", 100, 2097152, 0],
        ["alloc", 100, 1000, 0],
        ["alloc", 2000, 512, 0],
        ["free_requested", 100, 1000, 0],
        ["free_completed", 100, 1000, 0],
        ["alloc", 100, 3000, 0],  # the same address, a new block
        ["free_completed", 2000, 512, 0],
    ]
    ops = workloads.scale_trace(events, divisor=10)
    assert ops == [(True, 0, 100), (True, 1, 51), (False, 0, 0), (True, 2, 300), (False, 1, 0)]


TRACE = workloads.DEFAULT_TRACE


def test_the_bundled_trace_scaled_down_fits_a_user() -> None:
    ops = workloads.load_trace(TRACE, 256)
    live: dict[int, int] = {}
    peak = current = 0
    for is_alloc, block, nbytes in ops:
        if is_alloc:
            live[block] = nbytes
            current += nbytes
            peak = max(peak, current)
        else:
            current -= live.pop(block)
    assert sum(1 for op in ops if op[0]) == 4531  # every alloc of the trace
    assert 16 << 20 < peak < 32 << 20  # ~6.6 GiB / 256


# -- the report ---------------------------------------------------------------------
def test_memory_row_takes_torch_keys_and_leaves_missing_figures_blank() -> None:
    stats = {
        "allocated_bytes.all.current": 100,
        "reserved_bytes.all.current": 250,
        "num_ooms": 2,
        "external_fragmentation.all": 0.5,
    }
    row = loadtest.memory_row(stats, now=12.5, t0=10.0, phase="load")
    assert list(row) == list(loadtest.COLUMNS)
    assert row["elapsed_s"] == "2.500" and row["phase"] == "load"
    assert row["allocated_bytes"] == 100 and row["reserved_over_allocated"] == "2.5000"
    assert row["num_ooms"] == 2 and row["external_fragmentation"] == 0.5
    assert row["live_sessions"] == "" and row["largest_free_block_bytes"] == ""
    assert loadtest.memory_row({}, now=1, t0=0, phase="x")["reserved_over_allocated"] == ""


@pytest.mark.parametrize(
    ("text", "seconds"), [("60", 60), ("60s", 60), ("2m", 120), ("1h30m", 5400)]
)
def test_run_time_syntax(text: str, seconds: float) -> None:
    assert loadtest.parse_duration(text) == seconds


def test_summary_fails_on_a_leak_and_counts_expected_errors_apart(tmp_path: Path) -> None:
    header = [
        "Type",
        "Name",
        "Request Count",
        "Failure Count",
        "Median Response Time",
        "Requests/s",
        "95%",
        "50%",
        "99%",
    ]
    rows = [
        ["grpc", "kv.cat", "90", "0", "5", "9.0", "8", "5", "9"],
        ["expected", "kv.cat (OutOfMemoryError)", "10", "0", "5", "1.0", "8", "5", "9"],
        ["", "Aggregated", "100", "0", "5", "10.0", "8", "5", "9"],
    ]
    with open(tmp_path / "locust_stats.csv", "w", newline="") as f:
        csv.writer(f).writerows([header, *rows])
    with loadtest.TimeSeries(tmp_path / "timeseries.csv") as series:
        assert series.path.exists()
    key = "allocated_bytes.all.current"
    clean = loadtest.summarize(tmp_path, baseline={key: 0}, final={key: 0}, leftover_names=[])
    assert clean["passed"] and clean["expected_errors"] == 10 and clean["unexpected_failures"] == 0
    leak = loadtest.summarize(tmp_path, baseline={key: 0}, final={key: 512}, leftover_names=[])
    assert not leak["passed"] and leak["leaked_bytes"] == 512
    markdown = loadtest.render_markdown(leak, command="tensord loadtest", settings={"users": 1})
    assert "**FAIL**" in markdown and "| leaked bytes | 512 |" in markdown
    # compactions during the run: the difference between the server's counters
    before = {key: 0, "num_compactions": 1, "compaction_moved_bytes": 5 << 20}
    after = {
        key: 0,
        "num_compactions": 3,
        "compaction_moved_bytes": 7 << 20,
        "compaction_released_bytes": 40 << 20,
    }
    moved = loadtest.summarize(tmp_path, baseline=before, final=after, leftover_names=[])
    assert (moved["num_compactions"], moved["compaction_moved_bytes"]) == (2, 2 << 20)
    markdown = loadtest.render_markdown(moved, command="tensord loadtest", settings={})
    assert "| compactions: count / bytes moved / bytes released | 2 / 2.0 MiB / 40.0 MiB |" in (
        markdown
    )
    # the policy's cost: bytes moved per byte the run allocated
    before["allocated_bytes.all.allocated"] = 10 << 20
    after["allocated_bytes.all.allocated"] = 50 << 20
    cost = loadtest.summarize(tmp_path, baseline=before, final=after, leftover_names=[])
    assert cost["compaction_moved_per_allocated"] == 2 / 40
    markdown = loadtest.render_markdown(cost, command="tensord loadtest", settings={})
    assert "| bytes moved by compaction / byte allocated | 0.0500 |" in markdown
    # throughput without the cheap failures: 100 requests at 10/s took 10 s, 90 succeeded
    assert cost["requests_per_s"] == 10.0 and cost["successful_requests_per_s"] == 9.0
    assert cost["allocated_bytes_per_s"] == (40 << 20) / 10
    assert "| successful requests/s (without expected errors such as OOMs) | 9.0 |" in markdown


def test_the_started_server_runs_the_policy_asked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tensord loadtest --policy NAME: the server it starts runs ``tensord serve --policy NAME``."""
    parser = argparse.ArgumentParser()
    loadtest.add_arguments(parser)
    commands: list[list[str]] = []

    def popen(command: list[str], **kwargs: Any) -> None:
        commands.append(command)
        raise OSError("not started")

    monkeypatch.setattr(loadtest.subprocess, "Popen", popen)
    for argv in (["--policy", "pytorch"], []):
        with pytest.raises(OSError):
            loadtest.start_server(parser.parse_args(argv), tmp_path / "server.log")
    policy = commands[0].index("--policy")
    assert commands[0][policy + 1] == "pytorch"
    assert "--policy" not in commands[1]  # the server's own default


# -- docker-compose.yml --------------------------------------------------------------
def interpolate(text: str) -> str:
    """Compose's ``${VAR:-default}`` / ``${VAR}``, with every variable unset."""
    return re.sub(r"\$\{[A-Z_]+(?::?-([^}]*))?\}", lambda m: m.group(1) or "", text)


def test_compose_file_follows_the_compose_spec() -> None:
    yaml = pytest.importorskip("yaml")
    jsonschema = pytest.importorskip("jsonschema")
    text = (REPO / "docker-compose.yml").read_text()
    config = yaml.safe_load(interpolate(text))
    schema = json.loads((REPO / "tests" / "compose-spec.json").read_text())
    validator = jsonschema.Draft201909Validator(schema)  # the draft its $schema names
    validator.validate(config)
    broken = {"services": {"server": {"image": "x", "ports": 50051, "restart_policy": 1}}}
    assert not validator.is_valid(broken)  # the schema does reject what is wrong
    services = config["services"]
    assert {"server", "locust-master", "locust-worker"} <= set(services)
    assert "--master" in services["locust-master"]["command"]
    assert "--worker" in services["locust-worker"]["command"]
    assert services["locust-worker"]["deploy"]["replicas"] == 2
    # the GPU reservation, commented, in compose's own syntax
    gpu = re.search(r"# deploy:\n(#.*\n)*?#\s+capabilities: \[gpu\]", text.replace("    #", "#"))
    assert gpu, "the commented GPU reservation is missing"
    commented = yaml.safe_load(
        "\n".join(line.split("#", 1)[1][1:] for line in gpu.group(0).splitlines())
    )
    devices = commented["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]


def test_compose_workers_replay_the_bundled_trace_by_default() -> None:
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load(interpolate((REPO / "docker-compose.yml").read_text()))
    worker = config["services"]["locust-worker"]
    trace = worker["environment"]["TENSORD_TRACE"]
    assert trace in bundled_traces()  # a name the image resolves in its own package
    mounted = [v.split(":")[0] for v in worker["volumes"] if v.endswith(":/traces:ro")]
    assert len(mounted) == 1 and not Path(mounted[0]).is_absolute()
    folder = (REPO / mounted[0]).resolve()
    assert folder.is_relative_to(REPO) and (folder / f"{trace}.events.json.gz").is_file()


def test_the_trace_users_load_the_bundled_trace_by_name() -> None:
    assert workloads.load_trace("resnet50_train", 256) == workloads.load_trace(TRACE, 256)
    with pytest.raises(FileNotFoundError, match=r"bundled: .*resnet50_train"):
        workloads.load_trace("no-such-trace", 256)


@pytest.mark.skipif(
    shutil.which("docker-compose") is None, reason="docker-compose is not installed"
)
def test_docker_compose_config_accepts_the_file() -> None:
    result = subprocess.run(
        ["docker-compose", "-f", str(REPO / "docker-compose.yml"), "config", "-q"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


# -- one short run of the whole thing -------------------------------------------------
@pytest.mark.slow
def test_short_headless_run_has_no_unexpected_failures_and_leaks_nothing(tmp_path: Path) -> None:
    # find_spec, not importorskip: importing locust monkey-patches threading and
    # sockets with gevent inside this process, and every later gRPC test hangs.
    for module in ("locust", "matplotlib"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed")
    out = tmp_path / "results"
    command = [sys.executable, "-m", "tensord_server", "loadtest", "-u", "8", "-r", "8", "-t", "8s"]
    mix = "kv=1,train=1,churn=1,bimodal=1,views=1,sharing=2,trace=1"
    command += ["--workloads", mix]
    command += ["--out", str(out), "--interval", "0.25", "--leak-timeout", "20"]
    command += ["--progress-interval", "2"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORD_")}
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=180, check=False, env=env, cwd=tmp_path
    )
    log = result.stdout + result.stderr + _tail(out / "locust.log")
    assert result.returncode == 0, log
    # while it ran: users, request rate and failures on stderr, every 2 s
    progress = re.findall(
        r"^tensord loadtest: \d+ s of 8 s: (\d+) users, [\d,.]+ requests/s, [\d,]+ requests "
        r"\((\d+) failed, \d+ expected errors\); allocated [\d,.]+ MiB, reserved [\d,.]+ MiB$",
        result.stderr,
        re.M,
    )
    assert len(progress) >= 2, result.stderr
    assert any(int(users) == 8 for users, _ in progress), progress
    assert all(failures == "0" for _, failures in progress), progress
    summary = json.loads((out / "summary.json").read_text())
    assert summary["passed"], log
    assert summary["unexpected_failures"] == 0, summary["failures_by_op"]
    assert summary["exceptions"] == 0, summary["exception_messages"]
    assert summary["leaked_bytes"] == 0 and summary["final_allocated_bytes"] == 0
    assert summary["requests"] > 100
    workload_ops = {op["name"].split(".")[0] for op in summary["ops"]}
    assert {"kv", "train", "churn", "bimodal", "views", "share", "trace"} <= workload_ops
    assert summary["peak_reserved_bytes"] >= summary["peak_allocated_bytes"] > 0
    assert summary["capacity_bytes"] == 1 << 30  # the started server's default pool
    with open(out / "timeseries.csv", newline="") as f:
        phases = Counter(row["phase"] for row in csv.DictReader(f))
    assert phases["baseline"] == 1 and phases["load"] > 10 and phases["after"] == 1
    for name in ("locust_stats.csv", "locust_stats_history.csv", "locust.html", "summary.md"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _tail(path: Path) -> str:
    return path.read_text()[-4000:] if path.exists() else ""


@pytest.mark.slow
def test_a_run_that_fails_leaves_no_empty_results_folder(tmp_path: Path) -> None:
    # nothing answers at the address: the run fails before writing anything, and left an
    # empty folder (and its parents) behind
    out = tmp_path / "results" / "run"
    command = [sys.executable, "-m", "tensord_server", "loadtest", "--address", "127.0.0.1:1"]
    result = subprocess.run(
        [*command, "--out", str(out)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 2 and "no tensord server answers" in result.stderr, result.stderr
    assert list(tmp_path.iterdir()) == []


def test_progress_lines_read_the_stats_history_as_it_grows(tmp_path: Path) -> None:
    path = tmp_path / "locust_stats_history.csv"
    history = loadtest.LocustHistory(path)
    stats = {"allocated_bytes.all.current": 3 << 20, "reserved_bytes.all.current": 4 << 20}
    assert loadtest.progress_line(history, 30, None) == (  # not written yet
        "tensord loadtest: Locust is starting users"
    )
    columns = "Timestamp,User Count,Type,Name,Requests/s,Failures/s,Total Request Count,"
    path.write_text(
        columns
        + "Total Failure Count\n"
        + "100,0,,Aggregated,0.0,0.0,0,0\n"
        + "112,4,op,kv.append,10.0,0.0,20,0\n"
        + "112,4,expected,kv.oom,1.0,0.0,2,0\n"
        + "112,4,,Aggregated,11.0,0.0,22,0\n"
        + "113,8,op,kv.append,30.0,1.0,50,1\n"  # a second still being written
        + "113,8,expected,kv.o"
    )
    assert loadtest.progress_line(history, 30, stats) == (
        "tensord loadtest: 12 s of 30 s: 4 users, 11.0 requests/s, 22 requests (0 failed, "
        "2 expected errors); allocated 3.0 MiB, reserved 4.0 MiB"
    )
    with open(path, "a") as f:
        f.write("om,2.0,0.0,3,0\n113,8,,Aggregated,32.0,1.0,53,1\n")
    assert loadtest.progress_line(history, 30, None) == (
        "tensord loadtest: 13 s of 30 s: 8 users, 32.0 requests/s, 53 requests (1 failed, "
        "3 expected errors)"
    )


@pytest.mark.slow
def test_an_unknown_workload_is_refused_before_anything_starts(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "tensord_server", "loadtest", "--workloads", "kv,nope"]
    result = subprocess.run(
        [*command, "--out", str(tmp_path)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 2
    assert "unknown workload 'nope'" in result.stderr


@pytest.mark.slow
def test_an_unknown_trace_is_refused_before_anything_starts(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "tensord_server", "loadtest", "--trace", "no-such-trace"]
    result = subprocess.run(
        [*command, "--out", str(tmp_path)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 2
    assert "--trace: no trace file 'no-such-trace'" in result.stderr
    assert "bundled: gpt_train, lstm_train, resnet50_train, unet_train" in result.stderr
    assert list(tmp_path.iterdir()) == []  # no server was started, nothing written


@pytest.mark.slow
@pytest.mark.parametrize("module", ["locust", "matplotlib"])
def test_a_missing_extra_is_named_before_anything_starts(tmp_path: Path, module: str) -> None:
    # an install without '.[loadtest]': before, the server started, Locust's child failed
    # and the plot ended the run in a ModuleNotFoundError traceback
    hide = f"import sys; sys.modules[{module!r}] = None"  # as if it were not installed
    run = f"from tensord_server.cli import main; sys.exit(main(['loadtest', '--out', {str(tmp_path)!r}]))"
    result = subprocess.run(
        [sys.executable, "-c", f"{hide}; {run}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert f"needs {module}" in result.stderr and "pip install 'tensord[loadtest]'" in result.stderr
    assert "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []  # no server was started, nothing written


def test_ratios_under_load_skip_the_samples_while_users_arrive_or_leave(tmp_path: Path) -> None:
    """At the stop, users leave and free at once while segments are still reserved: a
    sample then (fewer live sessions) says nothing about the pool under load."""
    rows = []
    for sessions, allocated, reserved in (
        (3, 300, 900),
        (51, 400, 440),
        (51, 500, 550),
        (26, 300, 750),
    ):
        row = dict.fromkeys(loadtest.COLUMNS, "")
        row.update(phase="load", live_sessions=sessions, allocated_bytes=allocated)
        row.update(reserved_bytes=reserved, reserved_over_allocated=reserved / allocated)
        rows.append(row)
    with open(tmp_path / "timeseries.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=loadtest.COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    summary = loadtest.summarize(tmp_path, baseline={}, final={}, leftover_names=[])
    assert summary["max_reserved_over_allocated"] == 1.1
    assert summary["mean_reserved_over_allocated"] == pytest.approx(1.1)


@pytest.mark.slow
def test_the_top_level_locustfile_runs_the_packages_users() -> None:
    """`locust -f loadtest/locustfile.py` from a checkout finds the very user classes
    `tensord loadtest` runs (one source, no copy).  In a child: Locust's import
    monkey-patches the process (gevent)."""
    root = Path(__file__).resolve().parents[2]
    probe = (
        "import importlib.util, json, sys\n"
        "from locust import User\n"
        "from tensord_server.tools.loadtest import locustfile as packaged\n"
        "spec = importlib.util.spec_from_file_location('top', sys.argv[1])\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "def users(ns):\n"
        "    return {n: v for n, v in ns.items()\n"
        "            if isinstance(v, type) and issubclass(v, User) and v is not User}\n"
        "found = users(vars(module))\n"
        "print(json.dumps([sorted(found), found == users(vars(packaged))]))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe, str(root / "loadtest" / "locustfile.py")],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    names, same = json.loads(result.stdout.strip().splitlines()[-1])
    assert same, names
    assert {"KVCacheUser", "TrainingStepUser", "TraceReplayUser"} <= set(names)


# -- against a cluster (the run itself: tests/cluster/test_loadtest_cluster.py) ---------
def test_the_address_given_again_or_as_a_list_names_every_node() -> None:
    parser = argparse.ArgumentParser()
    loadtest.add_arguments(parser)
    args = parser.parse_args(["--address", "a:1,b:2", "--address", " c:3"])
    assert nodes.parse_addresses(args.address) == ["a:1", "b:2", "c:3"]
    assert nodes.parse_addresses(parser.parse_args([]).address) == []  # start a server
    assert nodes.parse_addresses(["a:1"]) == ["a:1"]
    with pytest.raises(ValueError, match="an empty address"):
        nodes.parse_addresses(["a:1,,b:2"])
    with pytest.raises(ValueError, match="a:1 is given twice"):
        nodes.parse_addresses(["a:1", "b:2,a:1"])


def test_a_bad_address_list_is_refused_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    loadtest.add_arguments(parser)
    out = tmp_path / "out"
    args = parser.parse_args(["--address", "a:1", "--address", "a:1", "--out", str(out)])
    assert loadtest.run(args) == 2
    assert "--address: a:1 is given twice" in capsys.readouterr().err
    assert not out.exists()


def test_users_spread_round_robin_over_the_nodes() -> None:
    addresses = ["a:1", "b:2", "c:3"]
    for name in workloads.WORKLOADS:
        # each workload's users in turn over the nodes: six users, two on each
        spread = [workloads.user_address(addresses, name, n) for n in range(6)]
        assert Counter(spread) == dict.fromkeys(addresses, 2), (name, spread)
        assert all(a != b for a, b in itertools.pairwise(spread))
    # the workloads' first users start on different nodes
    firsts = [workloads.user_address(addresses, name, 0) for name in ("kv", "train", "churn")]
    assert sorted(firsts) == addresses
    # with Locust workers, the n-th user of each worker goes elsewhere, and all spread evenly
    by_worker = [workloads.user_address(addresses, "kv", n, w, 2) for n in range(3) for w in (0, 1)]
    assert Counter(by_worker) == dict.fromkeys(addresses, 2)
    assert workloads.user_address(addresses, "kv", 0, 0, 2) != workloads.user_address(
        addresses, "kv", 0, 1, 2
    )
    assert {workloads.user_address(["only:1"], "cross", n) for n in range(5)} == {"only:1"}
    with pytest.raises(ValueError, match="no address"):
        workloads.user_address([], "kv", 0)


def test_the_nodes_given_come_first_then_every_other_live_node() -> None:
    listed = [
        {"node": "a", "address": "10.0.0.1:5", "self": True},
        {"node": "b", "address": "10.0.0.2:5", "self": False},
        {"node": "c", "address": "10.0.0.3:5", "self": False},
    ]
    assert nodes.own_node(listed) == "a"
    # the address given for a node wins over the one it registered
    assert nodes.node_addresses(listed, {"c": "localhost:3", "a": "localhost:1"}) == {
        "c": "localhost:3",
        "a": "localhost:1",
        "b": "10.0.0.2:5",
    }
    with pytest.raises(ValueError, match=r"localhost:9 \(z\) not among the cluster's live nodes"):
        nodes.node_addresses(listed, {"z": "localhost:9"})


class FakeNodeClient:
    """A session on a fake node: its listing of the cluster, and its allocated bytes, one
    reading after the other (the last one repeats)."""

    def __init__(self, me: str | None, members: str = "abc", allocated: Any = (0,)) -> None:
        self.me, self.members = me, members
        self.readings = list(allocated)
        self.closed = False

    def nodes(self) -> list[dict[str, Any]]:
        if self.me is None:
            raise tensord.errors.FailedPreconditionError("not part of a cluster")
        return [{"node": m, "address": f"{m}.reg:1", "self": m == self.me} for m in self.members]

    def memory_stats(self, device: str = "cpu") -> dict[str, int]:
        value = self.readings.pop(0) if len(self.readings) > 1 else self.readings[0]
        return {"allocated_bytes.all.current": value}

    def close(self) -> None:
        self.closed = True


def test_a_cluster_run_opens_a_session_on_every_live_node() -> None:
    alone = FakeNodeClient(None)
    assert [(n.node, n.address) for n in loadtest.open_nodes(alone, ["s:1"], None)] == [("", "s:1")]
    with pytest.raises(RuntimeError, match="not a node of a cluster"):
        loadtest.open_nodes(alone, ["s:1", "s:2"], None)
    opened: dict[str, FakeNodeClient] = {}

    def connect(address: str) -> FakeNodeClient:
        opened[address] = FakeNodeClient({"given-b:2": "b"}.get(address, "a"))
        return opened[address]

    monitor = FakeNodeClient("a")
    found = loadtest.open_nodes(monitor, ["given-a:1", "given-b:2"], connect)
    assert [(n.node, n.address) for n in found] == [
        ("a", "given-a:1"),
        ("b", "given-b:2"),
        ("c", "c.reg:1"),  # not given: where it registered
    ]
    assert found[0].client is monitor and found[1].client is opened["given-b:2"]
    # two addresses of one node: refused, and the sessions opened for it closed
    opened.clear()
    with pytest.raises(RuntimeError, match="both node 'a'"):
        loadtest.open_nodes(FakeNodeClient("a"), ["given-a:1", "other-a:1"], connect)
    assert all(client.closed for client in opened.values())


def test_every_node_is_read_until_it_is_back_to_its_baseline() -> None:
    now = [0.0]
    back = nodes.NodeMonitor("a", "a:1", FakeNodeClient("a", allocated=(300, 200, 100)))
    leaky = nodes.NodeMonitor("b", "b:1", FakeNodeClient("b", allocated=(50, 40)))
    for monitor in (back, leaky):
        monitor.baseline = {"allocated_bytes.all.current": 100 if monitor is back else 0}

    def sleep(seconds: float) -> None:
        now[0] += seconds

    nodes.wait_for_baselines([back, leaky], "cpu", 2.0, clock=lambda: now[0], sleep=sleep)
    assert now[0] == pytest.approx(2.0)  # the leaky one was waited for until the timeout
    assert back.report()["leaked_bytes"] == 0 and back.report()["final_allocated_bytes"] == 100
    # the users each node got: its connect row's successes
    connects = [
        {"Name": workloads.connect_op("a:1"), "Request Count": "3", "Failure Count": "1"},
        {"Name": workloads.connect_op("a:10"), "Request Count": "5", "Failure Count": "0"},
    ]
    assert back.report(connects)["users"] == 2 and leaky.report(connects)["users"] == 0
    # its time series: a file of its own, and the peak its samples saw
    samples = [{"allocated_bytes": "100"}, {"allocated_bytes": "700"}, {"allocated_bytes": ""}]
    assert leaky.report(samples=samples)["peak_allocated_bytes"] == 700
    assert leaky.report()["timeseries"] == "timeseries-b.csv"
    assert nodes.NodeMonitor("a", "a:1", None, series_name="timeseries.csv").series_name == (
        "timeseries.csv"
    )
    assert leaky.report() == {
        "node": "b",
        "address": "b:1",
        "users": 0,
        "timeseries": "timeseries-b.csv",
        "peak_allocated_bytes": 0,
        "baseline_allocated_bytes": 0,
        "final_allocated_bytes": 40,
        "leaked_bytes": 40,
    }


def test_a_cluster_summary_fails_on_any_nodes_leak_and_without_cross_node_ops(
    tmp_path: Path,
) -> None:
    header = ["Type", "Name", "Request Count", "Failure Count", "Median Response Time"]
    header += ["Requests/s", "95%", "50%", "99%"]
    rows = [
        ["grpc", "cross.get", "5", "0", "5", "1.0", "8", "5", "9"],
        ["check", "cross.get.verify", "5", "1", "0", "1.0", "0", "0", "0"],
        ["check", "cross.to.verify", "3", "0", "0", "1.0", "0", "0", "0"],
        ["check", "cross.attach.verify", "2", "0", "0", "1.0", "0", "0", "0"],
        ["", "Aggregated", "15", "0", "5", "4.0", "8", "5", "9"],
    ]
    with open(tmp_path / "locust_stats.csv", "w", newline="") as f:
        csv.writer(f).writerows([header, *rows])
    with loadtest.TimeSeries(tmp_path / "timeseries.csv"):
        pass
    key = "allocated_bytes.all.current"

    def node(name: str, before: int, after: int) -> dict[str, Any]:
        return {"node": name, "address": f"{name}:1", "baseline_allocated_bytes": before,
                "final_allocated_bytes": after, "leaked_bytes": after - before}  # fmt: skip

    def summary(reports: list[dict[str, Any]], ops: list[list[str]] | None = None) -> Any:
        if ops is not None:
            with open(tmp_path / "locust_stats.csv", "w", newline="") as f:
                csv.writer(f).writerows([header, *ops])
        return loadtest.summarize(tmp_path, baseline={key: 0}, final={key: 0},
                                  leftover_names=[], nodes=reports, cross_node=True)  # fmt: skip

    clean = summary([node("a", 0, 0), node("b", 4096, 4096), node("c", 0, 0)])
    assert clean["passed"] and clean["leaked_bytes"] == 0
    assert clean["cross_node_ops"] == {"get": 4, "to": 3, "attach": 2}  # a failed check: not done
    markdown = loadtest.render_markdown(clean, command="tensord loadtest", settings={})
    assert "| b | b:1 | 0 | 0.0 MiB | 4,096 -> 4,096 B | 0 |" in markdown
    assert "Cross-node operations done and checked: get 4, to 3, attach 2" in markdown
    # one node leaked, though the first one (whose pool figures the summary gives) did not
    leak = summary([node("a", 0, 0), node("b", 4096, 8192), node("c", 100, 0)])
    assert not leak["passed"] and leak["leaked_bytes"] == 4096
    # no attach across nodes was done: the cross-node mix was not tested
    none = summary([node("a", 0, 0), node("b", 0, 0)], [r for r in rows if "attach" not in r[1]])
    assert none["cross_node_ops"]["attach"] == 0 and not none["passed"]
    # a run without the cross users does not ask for them
    plain = loadtest.summarize(tmp_path, baseline={key: 0}, final={key: 0}, leftover_names=[])
    assert plain["passed"] and plain["nodes"] == []


def test_locust_gets_the_nodes_and_the_cluster_mix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parser, envs = recorded_locust_envs(monkeypatch)
    monkeypatch.setenv("TENSORD_ADDRESSES", "left:1,over:2")  # not the run's: removed
    args = parser.parse_args(["--workers", "3", "--workloads", "kv"])
    with pytest.raises(OSError):
        loadtest.run_locust(
            args, "a:1", tmp_path, "run", nodes=["a:1", "b:2"], workloads="kv=1,cross=2"
        )
    with pytest.raises(OSError):
        loadtest.run_locust(args, "a:1", tmp_path, "run")
    cluster, alone = envs
    assert cluster["TENSORD_ADDRESSES"] == "a:1,b:2" and cluster["TENSORD_WORKERS"] == "3"
    assert cluster["TENSORD_WORKLOADS"] == "kv=1,cross=2"
    assert "TENSORD_ADDRESSES" not in alone and alone["TENSORD_WORKLOADS"] == "kv"


def test_the_cross_workload_needs_a_cluster(
    gib_server: Running, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = Log()
    drive(gib_server.address, "cross", steps=5, log=log)
    assert log.failures == []  # a server alone refuses nodes(): expected, and nothing more
    assert set(log.ops) == {("cross.nodes", "expected")}
    parser = argparse.ArgumentParser()
    loadtest.add_arguments(parser)
    out = tmp_path / "out"
    argv = ["--address", gib_server.address, "--workloads", "kv,cross", "--out", str(out)]
    assert loadtest.run(parser.parse_args(argv)) == 2
    assert "the cross workload needs a cluster of two nodes or more" in capsys.readouterr().err
    assert not out.exists()
