"""``tensord loadtest``: a fragmentation load test in one command.

Starts a server (unless ``--address``), samples its memory statistics into a
time series while Locust drives it headless with the workloads of
``tensord_server/tools/loadtest/locustfile.py``, waits for every user's memory to come back, stops
everything and writes a results folder:

- ``locust_stats.csv``, ``locust_stats_history.csv``, ``locust_failures.csv``,
  ``locust_exceptions.csv``, ``locust.html``: Locust's own report;
- ``timeseries.csv``: the server's memory statistics at a fixed interval;
- ``summary.md`` and ``summary.json``: the figures and the verdict;
- ``report.png``: memory, fragmentation and request rate over time.

While Locust runs, a line on stderr every ``--progress-interval`` seconds (10)
gives its users, requests/s, requests, failures and expected errors (read from
the stats history it writes every second) and the pool's allocated and reserved
bytes (from the sampler).

Against a cluster (``--address`` given again, or a comma-separated list, of its nodes;
or one node's address) each user connects to one of the nodes given, round robin; the
mix adds the ``cross`` users (names, copies and share tokens handed from node to node),
every live node of the cluster is checked for leaks, and the summary counts the
cross-node operations done (:mod:`.nodes`).  ``timeseries.csv`` and the pool figures
are the first node's; every other node samples into ``timeseries-<node>.csv``.

It exits 1 when a request failed unexpectedly, a workload raised, or the
server's allocated bytes did not return to their baseline after all users left
(a leak; in a cluster, any node's, or no cross-node operation of a kind was done);
2 when the run itself could not be made, and then the results folder
is removed if nothing was written to it.  Locust and matplotlib are imported
only in the processes that need them.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from tensord_server.tools.loadtest.nodes import (
    NodeMonitor,
    cross_node_counts,
    node_addresses,
    own_node,
    parse_addresses,
    wait_for_baselines,
)

#: this package's folder: the locustfile and its workloads ship inside it, so an install
#: (not only a checkout) runs the load test
LOADTEST_DIR = Path(__file__).resolve().parent

#: the time series' columns, in order
COLUMNS = (
    "time",
    "elapsed_s",
    "phase",
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "largest_free_block_bytes",
    "reserved_over_allocated",
    "external_fragmentation",
    "num_alloc_retries",
    "num_ooms",
    "num_compactions",
    "allocated_bytes_peak",
    "reserved_bytes_peak",
    "live_sessions",
    "live_storages",
)

#: time-series column -> the server's memory_stats() key (torch's names)
STAT_KEYS = {
    "allocated_bytes": "allocated_bytes.all.current",
    "reserved_bytes": "reserved_bytes.all.current",
    "active_bytes": "active_bytes.all.current",
    "inactive_split_bytes": "inactive_split_bytes.all.current",
    "largest_free_block_bytes": "largest_free_block_bytes.all",
    "external_fragmentation": "external_fragmentation.all",
    "num_alloc_retries": "num_alloc_retries",
    "num_ooms": "num_ooms",
    # beyond torch: OOMs the server avoided by moving Storages (0 with --no-compaction)
    "num_compactions": "num_compactions",
    "allocated_bytes_peak": "allocated_bytes.all.peak",
    "reserved_bytes_peak": "reserved_bytes.all.peak",
}

#: keys a server may report its live sessions and Storages under (blank when none does)
SESSION_KEYS = ("sessions.live", "sessions.active", "num_sessions", "live_sessions")
STORAGE_KEYS = ("storages.live", "storages.active", "num_storages", "live_storages")

LISTENING = re.compile(r"tensord listening on (\S+)")
SERVER_START_TIMEOUT_S = 60.0
RATIO_FLOOR = 0.25  # ratios count only while at least this share of the peak is allocated
LOCUST_GRACE_S = 90.0  # beyond the run time: spawning, stopping, writing the report


# -- the time series ---------------------------------------------------------------
def memory_row(stats: Mapping[str, Any], *, now: float, t0: float, phase: str) -> dict[str, Any]:
    """One time-series row from a ``memory_stats()`` dict; missing figures stay blank."""
    row: dict[str, Any] = dict.fromkeys(COLUMNS, "")
    row.update(time=f"{now:.3f}", elapsed_s=f"{now - t0:.3f}", phase=phase)
    for column, key in STAT_KEYS.items():
        if key in stats:
            row[column] = stats[key]
    allocated, reserved = (
        stats.get(STAT_KEYS["allocated_bytes"]),
        stats.get(STAT_KEYS["reserved_bytes"]),
    )
    if allocated and reserved is not None:
        row["reserved_over_allocated"] = f"{reserved / allocated:.4f}"
    for column, keys in (("live_sessions", SESSION_KEYS), ("live_storages", STORAGE_KEYS)):
        row[column] = next((stats[k] for k in keys if k in stats), "")
    return row


class TimeSeries:
    """A CSV of :func:`memory_row` rows, flushed as it grows (a killed run keeps its rows)."""

    def __init__(
        self, path: str | os.PathLike[str], *, device: str = "cpu", t0: float | None = None
    ):
        self.path = Path(path)
        self.device = device
        self.t0 = time.time() if t0 is None else t0
        self._file: TextIO = open(self.path, "w", newline="")  # noqa: SIM115 (closed in close())
        self._writer = csv.DictWriter(self._file, fieldnames=COLUMNS)
        self._writer.writeheader()
        self._lock = threading.Lock()

    def sample(self, client: Any, phase: str) -> dict[str, Any]:
        """Append one row from ``client.memory_stats()``; returns those stats."""
        stats: dict[str, Any] = client.memory_stats(self.device)
        row = memory_row(stats, now=time.time(), t0=self.t0, phase=phase)
        with self._lock:
            self._writer.writerow(row)
            self._file.flush()
        return stats

    def close(self) -> None:
        with self._lock:
            self._file.close()

    def __enter__(self) -> TimeSeries:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Sampler(threading.Thread):
    """Samples ``memory_stats`` every ``interval`` seconds on its own client until stopped."""

    def __init__(self, client: Any, series: TimeSeries, interval: float) -> None:
        super().__init__(name="tensord-loadtest-sampler", daemon=True)
        self.client, self.series, self.interval = client, series, interval
        self.phase = "baseline"
        self.errors = 0
        self.last: dict[str, Any] | None = None  # the latest sample's memory_stats()
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                self.last = self.series.sample(self.client, self.phase)
            except Exception:  # a busy server answers late: the next sample will do
                self.errors += 1
            self._stop_event.wait(self.interval)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=30)


class LocustHistory:
    """Locust's ``locust_stats_history.csv`` read as it grows: the latest complete second."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0  # bytes of the file read so far (whole lines only)
        self._columns: list[str] | None = None
        self._group: list[dict[str, str]] = []  # the rows of a second, up to its Aggregated row
        self.latest: list[dict[str, str]] = []  # the last complete second's rows
        self.started: float | None = None  # the first row's Timestamp: when users started

    def read(self) -> list[dict[str, str]]:
        """The rows of the latest second Locust has written in full (one per request name,
        with --csv-full-history, then the Aggregated row); [] before the first."""
        try:
            with open(self.path, newline="") as f:
                f.seek(self._offset)
                text = f.read()
        except OSError:
            return self.latest
        whole = text[: text.rfind("\n") + 1]  # a line being written waits for the next read
        self._offset += len(whole.encode())
        for values in csv.reader(whole.splitlines()):
            if self._columns is None:
                self._columns = values
                continue
            row = dict(zip(self._columns, values, strict=False))
            if self.started is None:
                self.started = _num(row.get("Timestamp"))
            self._group.append(row)
            if row.get("Name") == "Aggregated":
                self.latest, self._group = self._group, []
        return self.latest


def progress_line(history: LocustHistory, run_time: float, stats: Mapping[str, Any] | None) -> str:
    """One progress line: Locust's time, users, requests/s and failures, the pool's memory."""
    rows = history.read()
    total = next((r for r in rows if r.get("Name") == "Aggregated"), None)
    if total is None or history.started is None:
        line = "tensord loadtest: Locust is starting users"
    else:
        expected = sum(
            int(_num(r.get("Total Request Count"))) for r in rows if r.get("Type") == "expected"
        )
        elapsed = _num(total.get("Timestamp")) - history.started
        line = (
            f"tensord loadtest: {elapsed:.0f} s of {run_time:.0f} s: "
            f"{int(_num(total.get('User Count')))} users, "
            f"{_num(total.get('Requests/s')):,.1f} requests/s, "
            f"{int(_num(total.get('Total Request Count'))):,} requests "
            f"({int(_num(total.get('Total Failure Count')))} failed, "
            f"{expected} expected errors)"
        )
    if stats:
        line += (
            f"; allocated {mib(stats.get(STAT_KEYS['allocated_bytes'], 0))}, "
            f"reserved {mib(stats.get(STAT_KEYS['reserved_bytes'], 0))}"
        )
    return line


class Progress(threading.Thread):
    """A progress line on stderr every ``interval`` seconds while Locust runs (Locust itself
    runs with --only-summary, its log in locust.log)."""

    def __init__(self, history: Path, sampler: Sampler, run_time: float, interval: float) -> None:
        super().__init__(name="tensord-loadtest-progress", daemon=True)
        self.history = LocustHistory(history)
        self.sampler, self.run_time, self.interval = sampler, run_time, interval
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            line = progress_line(self.history, self.run_time, self.sampler.last)
            print(line, file=sys.stderr, flush=True)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=10)


# -- processes -----------------------------------------------------------------------
def _pump(stream: TextIO, log: TextIO, lines: queue.Queue[str] | None) -> None:
    for line in stream:
        log.write(line)
        log.flush()
        if lines is not None:
            lines.put(line)


def start_server(args: argparse.Namespace, log_path: Path) -> tuple[subprocess.Popen[str], str]:
    """``tensord serve`` on a free loopback port; returns the process and its address."""
    command = [sys.executable, "-m", "tensord_server", "serve", "--address", "127.0.0.1:0"]
    command += ["--device", args.device, "--session-grace", str(args.session_grace)]
    if getattr(args, "policy", None):
        command += ["--policy", args.policy]
    # Each user has one call in flight, and its session's unary heartbeats come on top
    # (sessions hold no thread since the KeepAlive stream became optional): twice the
    # users leaves headroom, so calls never queue for a server thread.
    command += ["--max-workers", str(max(64, 2 * args.users + 16))]
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    lines: queue.Queue[str] = queue.Queue()
    log = open(log_path, "w")  # noqa: SIM115 (the pump thread owns it until the server exits)
    assert proc.stdout is not None
    threading.Thread(target=_pump, args=(proc.stdout, log, lines), daemon=True).start()
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.2)
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        if match := LISTENING.search(line):
            return proc, match.group(1)
    stop_process(proc)
    raise RuntimeError(f"the server did not start; see {log_path}")


def stop_process(proc: subprocess.Popen[Any], timeout: float = 15.0) -> int | None:
    """SIGTERM, then SIGKILL after ``timeout`` seconds; returns the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def free_loopback_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_locust(
    args: argparse.Namespace,
    address: str,
    out: Path,
    run_id: str,
    *,
    nodes: Sequence[str] = (),
    workloads: str | None = None,
) -> int:
    """Locust headless (a master and ``--workers`` workers when asked); returns its exit
    status.  ``nodes``: a cluster's addresses, the users spread over them round robin;
    ``workloads``: the weights to run (default ``--workloads``)."""
    env = dict(os.environ)
    env.pop("TENSORD_ADDRESSES", None)
    env.update(
        TENSORD_ADDRESS=address,
        TENSORD_WORKLOADS=(args.workloads or "") if workloads is None else workloads,
        TENSORD_SCALE=str(args.scale),
        TENSORD_TRACE_DIVISOR=str(args.trace_divisor),
        TENSORD_RUN_ID=run_id,
        TENSORD_DEVICE=args.device,
        TENSORD_SAMPLER="off",  # this process samples
    )
    if nodes:
        env.update(TENSORD_ADDRESSES=",".join(nodes), TENSORD_WORKERS=str(max(1, args.workers)))
    if args.trace:
        env["TENSORD_TRACE"] = str(args.trace)
    if args.wait:
        env["TENSORD_WAIT"] = args.wait
    if args.seed is not None:
        env["TENSORD_SEED"] = str(args.seed)
    locust = [sys.executable, "-m", "locust", "-f", str(args.locustfile)]
    master = [*locust, "--headless", "-u", str(args.users), "-r", str(args.spawn_rate)]
    master += ["-t", args.run_time, "--host", address, "--stop-timeout", str(args.stop_timeout)]
    master += [
        "--csv",
        str(out / "locust"),
        "--csv-full-history",
        "--html",
        str(out / "locust.html"),
    ]
    master += ["--only-summary", "--loglevel", "WARNING"]
    workers: list[list[str]] = []
    if args.workers > 0:
        port = free_loopback_port()
        master += ["--master", "--expect-workers", str(args.workers)]
        master += ["--master-bind-host", "127.0.0.1", "--master-bind-port", str(port)]
        worker = [*locust, "--worker", "--master-host", "127.0.0.1", "--master-port", str(port)]
        workers = [[*worker, "--host", address, "--loglevel", "WARNING"]] * args.workers
    limit = parse_duration(args.run_time) + args.stop_timeout + LOCUST_GRACE_S
    with open(out / "locust.log", "w") as log:
        procs = [
            subprocess.Popen(c, stdout=log, stderr=subprocess.STDOUT, env=env)
            for c in [master, *workers]
        ]
        try:
            procs[0].wait(timeout=limit)
        except subprocess.TimeoutExpired:
            log.write(f"tensord loadtest: Locust ran past {limit:.0f} s; stopped\n")
        for proc in procs:
            try:
                proc.wait(timeout=30 if proc.poll() is None else 0)
            except subprocess.TimeoutExpired:
                stop_process(proc)
        return procs[0].returncode if procs[0].returncode is not None else -1


def parse_duration(text: str) -> float:
    """Locust's run-time syntax: ``60``, ``60s``, ``2m``, ``1h30m``."""
    if re.fullmatch(r"\d+", text):
        return float(text)
    parts = re.fullmatch(r"(?:(\d+)h)?\s*(?:(\d+)m)?\s*(?:(\d+)s)?", text.strip())
    if not parts or not any(parts.groups()):
        raise argparse.ArgumentTypeError(f"bad run time {text!r}: use e.g. 60s, 2m, 1h30m")
    h, m, s = (int(g or 0) for g in parts.groups())
    return float(h * 3600 + m * 60 + s)


# -- the report --------------------------------------------------------------------
def read_csv(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _num(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def under_load(load: list[dict[str, str]]) -> list[dict[str, str]]:
    """The load samples taken while every user was connected: as many live sessions
    as the run ever had (the users' and the sampler's), not while users were still
    arriving or already leaving.  Samples without a session count all count."""
    sessions = [_num(r.get("live_sessions", "")) for r in load]
    full = max((n for n in sessions if not math.isnan(n)), default=math.nan)
    if math.isnan(full):
        return load
    return [r for r, n in zip(load, sessions, strict=True) if math.isnan(n) or n >= full]


def summarize(
    out: Path,
    *,
    baseline: Mapping[str, Any],
    final: Mapping[str, Any],
    leftover_names: list[str],
    fresh_server: bool = True,
    capacity: int | None = None,
    nodes: Sequence[Mapping[str, Any]] | None = None,
    cross_node: bool = False,
) -> dict[str, Any]:
    """The run's figures from Locust's CSVs, the time series and the server's last stats.

    ``nodes``: against a cluster, every node's :meth:`~.nodes.NodeMonitor.report` (its
    allocated bytes before and after): the run leaked when any node did, and
    ``leaked_bytes`` adds up the nodes' leaks (the pool figures are the first node's, whose
    ``baseline`` and ``final`` these are).  ``cross_node``: the ``cross`` users ran, so each
    kind of cross-node operation must have been done at least once for the run to pass.

    Peaks come from the server's own peak counters when it was started for this
    run (``fresh_server``), else from the samples alone (the counters would
    include whatever ran before).  The reserved/allocated ratios (mean and max) count
    only samples *under load*: every user connected (:func:`under_load`) and at least
    ``RATIO_FLOOR`` of the peak allocated, so neither the ramp-up's near-empty pool nor
    the stop, when users leave and free at once, dominates them.
    """
    stats = read_csv(out / "locust_stats.csv")
    total = next((r for r in stats if r.get("Name") == "Aggregated"), None)
    per_op = [r for r in stats if r.get("Name") != "Aggregated"]
    expected = [r for r in per_op if r.get("Type") == "expected"]
    exceptions = read_csv(out / "locust_exceptions.csv")
    failures = read_csv(out / "locust_failures.csv")
    series = read_csv(out / "timeseries.csv")
    load = [r for r in series if r["phase"] == "load"]

    def peak(column: str, key: str) -> int:
        samples = [_num(r[column]) for r in series if r[column] != ""]
        sampled = max((v for v in samples if not math.isnan(v)), default=0.0)
        counter = _num(final[key]) if fresh_server and key in final else 0.0
        return int(max(sampled, counter))

    def delta(key: str) -> int:
        return int(_num(final.get(key, 0)) - _num(baseline.get(key, 0)))

    peak_allocated = peak("allocated_bytes", "allocated_bytes.all.peak")
    floor = RATIO_FLOOR * peak_allocated
    busy = [
        r
        for r in under_load(load)
        if r["allocated_bytes"] != "" and _num(r["allocated_bytes"]) >= floor
    ]
    ratios = [_num(r["reserved_over_allocated"]) for r in busy if r["reserved_over_allocated"]]
    frags = [_num(r["external_fragmentation"]) for r in busy if r["external_fragmentation"] != ""]
    peak_reserved = peak("reserved_bytes", "reserved_bytes.all.peak")
    allocated_key = STAT_KEYS["allocated_bytes"]
    leaked = int(_num(final.get(allocated_key, 0)) - _num(baseline.get(allocated_key, 0)))
    node_reports = [dict(n) for n in nodes or ()]
    if node_reports:
        leaked = sum(max(0, int(n["leaked_bytes"])) for n in node_reports)
    cross_ops = cross_node_counts(per_op)
    requests = int(_num(total["Request Count"])) if total else 0
    # allocated bytes at the samples where the OOM count rose: did requests fail while memory was free?
    at_oom = [
        _num(now["allocated_bytes"])
        for before, now in itertools.pairwise(series)
        if _num(now["num_ooms"]) > _num(before["num_ooms"])
    ]
    requests_per_s = _num(total["Requests/s"]) if total else 0.0
    expected_errors = sum(int(_num(r["Request Count"])) for r in expected)
    unexpected = int(_num(total["Failure Count"])) if total else 0
    # Locust's rate counts every request, the cheap ones that failed with an OOM too: a
    # policy that refuses more would look faster, so the successful requests' rate and
    # the bytes the pool allocated per second are the fair throughput figures
    seconds = requests / requests_per_s if requests and requests_per_s > 0 else math.nan
    summary: dict[str, Any] = {
        "requests": requests,
        "requests_per_s": requests_per_s,
        "successful_requests_per_s": (requests - expected_errors - unexpected) / seconds
        if requests
        else 0.0,
        "allocated_bytes_per_s": delta("allocated_bytes.all.allocated") / seconds
        if requests
        else 0.0,
        "expected_errors": sum(int(_num(r["Request Count"])) for r in expected),
        "expected_by_op": {r["Name"]: int(_num(r["Request Count"])) for r in expected},
        "unexpected_failures": int(_num(total["Failure Count"])) if total else 0,
        "failures_by_op": {
            f"{r['Name']}: {r['Error']}": int(_num(r["Occurrences"])) for r in failures
        },
        "exceptions": sum(int(_num(r["Count"])) for r in exceptions),
        "exception_messages": [r["Message"] for r in exceptions][:10],
        "latency_ms": {
            p: _num(total[p]) if total and p in total else math.nan for p in ("50%", "95%", "99%")
        },
        "peak_allocated_bytes": peak_allocated,
        "peak_reserved_bytes": peak_reserved,
        "peak_reserved_over_peak_allocated": peak_reserved / peak_allocated
        if peak_allocated
        else math.nan,
        "mean_reserved_over_allocated": sum(ratios) / len(ratios) if ratios else math.nan,
        "max_reserved_over_allocated": max(ratios, default=math.nan),
        "max_external_fragmentation": max(frags, default=math.nan),
        "num_ooms": delta("num_ooms"),
        "num_alloc_retries": delta("num_alloc_retries"),
        "num_compactions": delta("num_compactions"),
        "compaction_moved_bytes": delta("compaction_moved_bytes"),
        "compaction_released_bytes": delta("compaction_released_bytes"),
        # the policy's cost: bytes compaction copied per byte the run allocated
        "compaction_moved_per_allocated": delta("compaction_moved_bytes")
        / delta("allocated_bytes.all.allocated")
        if delta("allocated_bytes.all.allocated") > 0
        else math.nan,
        "capacity_bytes": capacity,
        "min_allocated_at_oom_bytes": int(min(at_oom)) if at_oom else None,
        "baseline_allocated_bytes": int(_num(baseline.get(allocated_key, 0))),
        "final_allocated_bytes": int(_num(final.get(allocated_key, 0))),
        "final_reserved_bytes": int(_num(final.get(STAT_KEYS["reserved_bytes"], 0))),
        "leaked_bytes": leaked,
        "nodes": node_reports,
        "cross_node_ops": cross_ops,
        "leftover_names": leftover_names,
        "samples": len(series),
        "locust_ran": total is not None,
        "ops": [
            {
                "type": r["Type"],
                "name": r["Name"],
                "count": int(_num(r["Request Count"])),
                "failures": int(_num(r["Failure Count"])),
                "median_ms": _num(r["Median Response Time"]),
                "p95_ms": _num(r.get("95%")),
                "per_s": _num(r["Requests/s"]),
            }
            for r in sorted(per_op, key=lambda r: -_num(r["Request Count"]))
        ],
    }
    summary["passed"] = bool(
        summary["locust_ran"]
        and summary["unexpected_failures"] == 0
        and summary["exceptions"] == 0
        and leaked <= 0
        and all(int(n["leaked_bytes"]) <= 0 for n in node_reports)
        and not leftover_names
        and (not cross_node or all(cross_ops.values()))
    )
    return summary


def mib(nbytes: float) -> str:
    return f"{nbytes / (1 << 20):,.1f} MiB"


def _at_oom(summary: Mapping[str, Any]) -> str:
    allocated, capacity = summary.get("min_allocated_at_oom_bytes"), summary.get("capacity_bytes")
    if allocated is None:
        return "no OOM"
    share = f" ({allocated / capacity:.0%} of the pool)" if capacity else ""
    return f"{mib(allocated)}{share}"


def render_markdown(
    summary: Mapping[str, Any], *, command: str, settings: Mapping[str, Any]
) -> str:
    s = summary
    lat = s["latency_ms"]
    lines = [
        "# tensord load test",
        "",
        f"Verdict: **{'PASS' if s['passed'] else 'FAIL'}**",
        "",
        f"Command: `{command}`",
        "",
        "| setting | value |",
        "| --- | --- |",
        *(f"| {k} | {v} |" for k, v in settings.items()),
        "",
        "| figure | value |",
        "| --- | --- |",
        f"| requests (all ops) | {s['requests']:,} |",
        f"| requests/s | {s['requests_per_s']:,.1f} |",
        f"| successful requests/s (without expected errors such as OOMs) | "
        f"{s.get('successful_requests_per_s', math.nan):,.1f} |",
        f"| latency p50 / p95 / p99 | {lat['50%']:.0f} / {lat['95%']:.0f} / {lat['99%']:.0f} ms |",
        f"| unexpected failures | {s['unexpected_failures']} |",
        f"| exceptions in workloads | {s['exceptions']} |",
        f"| expected errors (OOM, races) | {s['expected_errors']} |",
        f"| peak allocated | {mib(s['peak_allocated_bytes'])} |",
        f"| peak reserved | {mib(s['peak_reserved_bytes'])} |",
        f"| peak reserved / peak allocated | {s['peak_reserved_over_peak_allocated']:.3f} |",
        f"| mean reserved / allocated under load (*) | {s['mean_reserved_over_allocated']:.3f} |",
        f"| max reserved / allocated under load (*) | "
        f"{s.get('max_reserved_over_allocated', math.nan):.3f} |",
        f"| max external fragmentation under load (*) | {s['max_external_fragmentation']:.3f} |",
        f"| OOMs / allocation retries | {s['num_ooms']} / {s['num_alloc_retries']} |",
        f"| compactions: count / bytes moved / bytes released | {s['num_compactions']} / "
        f"{mib(s['compaction_moved_bytes'])} / {mib(s['compaction_released_bytes'])} |",
        f"| bytes moved by compaction / byte allocated | "
        f"{s.get('compaction_moved_per_allocated', math.nan):.4f} |",
        f"| pool capacity | {mib(s['capacity_bytes']) if s.get('capacity_bytes') else 'unknown'} |",
        f"| allocated when an OOM was sampled (lowest) | {_at_oom(s)} |",
        f"| allocated: baseline -> after users left | {s['baseline_allocated_bytes']:,} -> {s['final_allocated_bytes']:,} B |",
        f"| leaked bytes | {s['leaked_bytes']:,} |",
        f"| reserved after users left (cached) | {mib(s['final_reserved_bytes'])} |",
        f"| named tensors left behind | {len(s['leftover_names'])} |",
        "",
    ]
    if s.get("nodes"):
        cross = s.get("cross_node_ops", {})
        lines += [
            "Nodes (the pool figures above are the first one's):",
            "",
            "| node | address | users | peak allocated (sampled) | "
            "allocated: baseline -> after users left | leaked bytes | time series |",
            "| --- | --- | ---: | ---: | --- | ---: | --- |",
            *(
                f"| {n['node']} | {n['address']} | {n.get('users', 0)} | "
                f"{mib(n.get('peak_allocated_bytes', 0))} | "
                f"{n['baseline_allocated_bytes']:,} -> {n['final_allocated_bytes']:,} B | "
                f"{n['leaked_bytes']:,} | `{n.get('timeseries', '')}` |"
                for n in s["nodes"]
            ),
            "",
            "Cross-node operations done and checked: "
            + ", ".join(f"{kind} {count:,}" for kind, count in cross.items())
            + " (`get`: a name read through a node that does not hold it; `to`: a copy to "
            "another node; `attach`: a share token attached from a node it was not made on).",
            "",
        ]
    if s["expected_by_op"]:
        lines += ["Expected errors by op:", ""]
        lines += [f"- `{name}`: {n}" for name, n in s["expected_by_op"].items()]
        lines.append("")
    if s["failures_by_op"] or s["exception_messages"]:
        lines += ["Unexpected failures and exceptions:", ""]
        lines += [f"- `{name}`: {n}" for name, n in s["failures_by_op"].items()]
        lines += [f"- exception: {m}" for m in s["exception_messages"]]
        lines.append("")
    lines += [
        "| type | op | count | failures | median ms | p95 ms | per s |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {o['type']} | {o['name']} | {o['count']:,} | {o['failures']} | {o['median_ms']:.0f} | {o['p95_ms']:.0f} | {o['per_s']:.1f} |"
        for o in s["ops"]
    ]
    lines += [
        "",
        f"(*) over the load samples with every user connected and at least {RATIO_FLOOR:.0%} "
        "of the peak allocated.",
        "Expected errors are fired as their own request type and never count as failures;",
        "`check` rows are data read back and compared, not RPCs.",
        "",
        "![memory, fragmentation and requests over time](report.png)",
        "",
    ]
    return "\n".join(lines)


def plot(out: Path, t0: float, capacity: int | None = None) -> Path:
    """``report.png``: memory, fragmentation and requests over the run, one x axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = read_csv(out / "timeseries.csv")
    history = read_csv(out / "locust_stats_history.csv")
    x = [_num(r["elapsed_s"]) for r in series]

    def col(name: str, div: float = 1.0) -> list[float]:
        return [_num(r[name]) / div for r in series]

    fig, (ax_mem, ax_frag, ax_req) = plt.subplots(3, 1, figsize=(11, 10), sharex=True)
    for name, label in (
        ("reserved_bytes", "reserved"),
        ("allocated_bytes", "allocated"),
        ("active_bytes", "active (dashed)"),
        ("inactive_split_bytes", "inactive split"),
        ("largest_free_block_bytes", "largest free block"),
    ):
        ax_mem.plot(x, col(name, 1 << 20), label=label, ls="--" if name == "active_bytes" else "-")
    if capacity:
        ax_mem.axhline(capacity / (1 << 20), color="black", ls=":", label="pool capacity")
    ax_mem.set_ylabel("MiB")
    ax_mem.set_title("server memory (sampled memory_stats)")
    ax_mem.legend(loc="upper left", fontsize="small")

    allocated = col("allocated_bytes")
    floor = RATIO_FLOOR * max((a for a in allocated if not math.isnan(a)), default=0.0)
    ratio = [
        r if a >= floor else math.nan
        for r, a in zip(col("reserved_over_allocated"), allocated, strict=True)
    ]
    ax_frag.plot(
        x, ratio, label=f"reserved / allocated (allocated >= {RATIO_FLOOR:.0%} of peak)", color="C0"
    )
    ax_frag.plot(x, col("external_fragmentation"), label="external fragmentation", color="C1")
    shown = sorted(v for v in ratio if not math.isnan(v))
    if shown:  # the last samples of a teardown may still spike: keep the scale of the run
        ax_frag.set_ylim(0, 1.2 * max(1.0, shown[int(0.98 * (len(shown) - 1))]))
    ax_frag.set_ylabel("ratio")
    ax_frag.set_title("fragmentation")
    ax_count = ax_frag.twinx()
    ax_count.step(x, col("num_ooms"), where="post", label="OOMs (cumulative)", color="C3")
    ax_count.step(x, col("num_alloc_retries"), where="post", label="alloc retries", color="C4")
    ax_count.step(x, col("num_compactions"), where="post", label="compactions", color="C5")
    ax_count.set_ylabel("count")
    counts = [
        v
        for v in col("num_ooms") + col("num_alloc_retries") + col("num_compactions")
        if not math.isnan(v)
    ]
    ax_count.set_ylim(bottom=0, top=1.1 * max([1.0, *counts]))
    handles = ax_frag.get_legend_handles_labels()
    extra = ax_count.get_legend_handles_labels()
    ax_frag.legend(handles[0] + extra[0], handles[1] + extra[1], loc="upper left", fontsize="small")

    by_time: dict[float, dict[str, float]] = {}
    for r in history:
        at = by_time.setdefault(
            _num(r["Timestamp"]) - t0, {"rps": 0.0, "fail": 0.0, "exp": 0.0, "users": 0.0}
        )
        if r["Name"] == "Aggregated":
            at["rps"] = _num(r["Requests/s"])
            at["fail"] = _num(r["Failures/s"])
            at["users"] = _num(r["User Count"])
        elif r["Type"] == "expected":
            at["exp"] += _num(r["Requests/s"])
    times = sorted(by_time)
    for key, label, color in (
        ("rps", "requests/s", "C0"),
        ("exp", "expected errors/s", "C1"),
        ("fail", "unexpected failures/s", "C3"),
    ):
        ax_req.plot(times, [by_time[t][key] for t in times], label=label, color=color)
    ax_req.set_ylabel("per second")
    ax_req.set_xlabel("seconds since start")
    ax_req.set_title("Locust")
    ax_users = ax_req.twinx()
    ax_users.plot(times, [by_time[t]["users"] for t in times], label="users", color="grey", ls="--")
    ax_users.set_ylabel("users")
    handles = ax_req.get_legend_handles_labels()
    extra = ax_users.get_legend_handles_labels()
    ax_req.legend(handles[0] + extra[0], handles[1] + extra[1], loc="upper left", fontsize="small")
    for ax in (ax_mem, ax_frag, ax_req):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out / "report.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# -- the subcommand ------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address",
        action="append",
        metavar="HOST:PORT[,HOST:PORT...]",
        help="an existing server (default: start one on loopback); a cluster's nodes: the "
        "option again or a comma-separated list, each user connecting to one of them, round "
        "robin, with the cross-node users in the mix and every node checked for leaks",
    )
    parser.add_argument("-u", "--users", type=int, default=20, help="Locust users (default 20)")
    parser.add_argument(
        "-r", "--spawn-rate", type=float, default=10.0, help="users started per second"
    )
    parser.add_argument("-t", "--run-time", default="30s", help="how long users run: 30s, 2m...")
    parser.add_argument(
        "--workers", type=int, default=0, help="Locust worker processes (0: one process)"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="results folder (default loadtest-results/<time>)"
    )
    parser.add_argument(
        "--device",
        default="cpu=1GiB",
        help="the device the workloads use and the started server's pool for it: cpu=1GiB, cuda:0=40GiB",
    )
    parser.add_argument(
        "--workloads",
        default="",
        help="weights, e.g. kv=3,train=2,churn=3,bimodal=1,views=2,sharing=1,trace=1 (those "
        "are the defaults; against a cluster cross=2 too: the cross-node users)",
    )
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every allocation size")
    parser.add_argument(
        "--trace",
        default=None,
        help="the trace the trace users replay: a file or a bundled trace's name "
        "(default: the bundled resnet50_train; see tensord replay --list)",
    )
    parser.add_argument(
        "--trace-divisor", type=int, default=256, help="divide the trace's sizes by this"
    )
    parser.add_argument("--wait", default="", help="min,max seconds a user waits between steps")
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed every user's choices (sizes, lengths, ...), step by step: two runs with one "
        "seed make the same choices user by user, as paired runs of two policies should "
        "(default: unseeded; not with --workers)",
    )
    parser.add_argument(
        "--interval", type=float, default=0.5, help="seconds between memory samples"
    )
    parser.add_argument(
        "--progress-interval",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="while Locust runs, a line on stderr every SECONDS: users, requests/s, requests, "
        "failures, expected errors, and the pool's allocated and reserved bytes (default 10; "
        "0: none)",
    )
    parser.add_argument(
        "--leak-timeout", type=float, default=30.0, help="seconds to wait for memory to return"
    )
    parser.add_argument(
        "--session-grace", type=float, default=2.0, help="the started server's session grace"
    )
    parser.add_argument(
        "--stop-timeout", type=int, default=10, help="seconds users get to finish when stopping"
    )
    parser.add_argument(
        "--policy",
        default=None,
        help="the started server's pool policy (tensord serve --policy; default: its default)",
    )
    parser.add_argument("--locustfile", type=Path, default=LOADTEST_DIR / "locustfile.py")
    parser.add_argument("--no-plot", action="store_true", help="skip report.png")


def folders_to_make(out: Path) -> list[Path]:
    """The folders ``out.mkdir(parents=True)`` would create, deepest first."""
    made = []
    for folder in (out, *out.parents):
        if folder.exists():
            break
        made.append(folder)
    return made


def remove_if_empty(folders: list[Path]) -> None:
    """Remove ``folders`` (deepest first) while each is empty."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:  # something was written there (a server log to read): keep it
            return


def workload_weights(locustfile: Path, spec: str, *, cluster: bool = False) -> dict[str, int]:
    """The weights ``spec`` gives, checked by the ``workloads.py`` beside the locustfile
    (``cluster``: the default mix of a run against a cluster, the ``cross`` users in it)."""
    import importlib.util

    path = locustfile.parent / "workloads.py"
    module_spec = importlib.util.spec_from_file_location("_tensord_loadtest_workloads", path)
    if module_spec is None or module_spec.loader is None or not path.exists():
        return {}
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    weights: dict[str, int] = (
        module.parse_weights(spec, cluster=True) if cluster else module.parse_weights(spec)
    )
    return weights


def open_nodes(monitor: Any, addresses: Sequence[str], connect: Any) -> list[NodeMonitor]:
    """The nodes of the run: ``monitor`` (a session on ``addresses[0]``) alone for a server
    alone, else every live node of its cluster, each with a session of its own (``connect``:
    ``tensord.connect``), the nodes given first.  Raises RuntimeError when several
    addresses name no cluster, or one that is not a live node of the first one's."""
    import tensord

    try:
        listed = monitor.nodes()
    except tensord.errors.FailedPreconditionError:
        if len(addresses) > 1:
            raise RuntimeError(
                f"{addresses[0]} is not a node of a cluster: several --address must be the "
                "nodes of one cluster (tensord serve --cluster)"
            ) from None
        return [NodeMonitor("", addresses[0], monitor)]
    given = {own_node(listed): addresses[0]}
    opened: dict[str, Any] = {}
    try:
        for address in addresses[1:]:
            client = connect(address)
            node = own_node(client.nodes())
            opened[node] = client
            if node in given:
                raise RuntimeError(f"{address} and {given[node]} are both node {node!r}")
            given[node] = address
        found = node_addresses(listed, given)
        for node, address in found.items():
            if node not in given:
                opened[node] = connect(address)
    except (ValueError, RuntimeError, tensord.TensordError) as exc:
        for client in opened.values():
            client.close()
        raise RuntimeError(f"the cluster's nodes: {exc}") from exc
    opened[own_node(listed)] = monitor
    return [NodeMonitor(node, address, opened[node]) for node, address in found.items()]


def missing_extra() -> str | None:
    """The first module of the 'loadtest' extra this interpreter cannot import, if any
    (Locust runs as this interpreter's child; matplotlib draws report.png)."""
    import importlib.util

    for module in ("locust", "matplotlib"):
        if importlib.util.find_spec(module) is None:
            return module
    return None


def run(args: argparse.Namespace) -> int:
    import tensord

    module = missing_extra()
    if module is not None:  # before a server starts and a run is written, not at its end
        print(
            f"tensord loadtest: needs {module}: pip install 'tensord[loadtest]' "
            "(pip install -e '.[loadtest]' in a checkout)",
            file=sys.stderr,
        )
        return 2
    parse_duration(args.run_time)
    try:
        addresses = parse_addresses(args.address)
    except ValueError as exc:
        print(f"tensord loadtest: --address: {exc}", file=sys.stderr)
        return 2
    if args.seed is not None and args.workers > 0:
        # Locust's master numbers its workers in the order they connect and hands out users
        # in another order: which worker runs which users changes from run to run
        print(
            "tensord loadtest: --seed needs --workers 0 (with worker processes, which "
            "worker runs which users changes from run to run, so two seeded runs would "
            "not make the same choices)",
            file=sys.stderr,
        )
        return 2
    try:
        weights = workload_weights(args.locustfile, args.workloads)
    except ValueError as exc:
        print(f"tensord loadtest: --workloads: {exc}", file=sys.stderr)
        return 2
    if args.trace:  # a wrong --trace fails here, not in every trace user
        from tensord_server.data import resolve_trace

        try:
            args.trace = resolve_trace(args.trace)
        except FileNotFoundError as exc:
            print(f"tensord loadtest: --trace: {exc}", file=sys.stderr)
            return 2
    if not args.locustfile.exists():
        print(
            f"tensord loadtest: no locustfile at {args.locustfile} (use --locustfile)",
            file=sys.stderr,
        )
        return 2
    out: Path = args.out or Path("loadtest-results") / time.strftime("%Y%m%d-%H%M%S")
    made = folders_to_make(out)
    out.mkdir(parents=True, exist_ok=True)
    run_id = uuid.uuid4().hex[:8]
    command = (
        "tensord loadtest " + " ".join(sys.argv[2:])
        if sys.argv[1:2] == ["loadtest"]
        else "tensord loadtest"
    )
    device = args.device.split("=")[0]  # where the workloads allocate, and what is sampled
    server = None
    nodes: list[NodeMonitor] = []
    try:
        if addresses:
            address = addresses[0]
        else:
            server, address = start_server(args, out / "server.log")
            addresses = [address]
        print(f"tensord loadtest: server {', '.join(addresses)}, results in {out}", flush=True)
        with tensord.connect(address) as monitor:
            nodes = open_nodes(monitor, addresses, tensord.connect)
            cluster = len(nodes) > 1
            if cluster:
                weights = workload_weights(args.locustfile, args.workloads, cluster=True)
                print(
                    "tensord loadtest: cluster of "
                    + ", ".join(f"{n.node} ({n.address})" for n in nodes)
                    + f"; users on {', '.join(addresses)}",
                    flush=True,
                )
            if weights.get("cross", 0) > 0 and not cluster:
                raise RuntimeError(
                    "the cross workload needs a cluster of two nodes or more (--address of "
                    "a cluster's node)"
                )
            series = TimeSeries(out / "timeseries.csv", device=device)
            nodes[0].series_name = series.path.name
            # every other node of a cluster: its own time series, on the same clock
            node_series = [
                TimeSeries(out / n.series_name, device=device, t0=series.t0) for n in nodes[1:]
            ]
            try:
                for node, its_series in zip(nodes[1:], node_series, strict=True):
                    node.baseline = its_series.sample(node.client, "baseline")
                baseline = series.sample(monitor, "baseline")
                nodes[0].baseline = baseline
                devices = monitor.server_info()["devices"]
                capacity = next(
                    (d["capacity_bytes"] for d in devices if d["device"] == device), None
                )
                sampler = Sampler(monitor, series, args.interval)
                samplers = [sampler] + [
                    Sampler(n.client, its_series, args.interval)
                    for n, its_series in zip(nodes[1:], node_series, strict=True)
                ]
                for each in samplers:
                    each.phase = "load"
                    each.start()
                progress = None
                if args.progress_interval > 0:
                    history = out / "locust_stats_history.csv"
                    run_time = parse_duration(args.run_time)
                    progress = Progress(history, sampler, run_time, args.progress_interval)
                    progress.start()
                try:
                    locust_status = run_locust(
                        args,
                        address,
                        out,
                        run_id,
                        nodes=addresses if cluster else (),
                        workloads=",".join(f"{k}={w}" for k, w in weights.items() if w)
                        if cluster
                        else None,
                    )
                finally:
                    if progress is not None:
                        progress.stop()
                for each in samplers:
                    each.phase = "drain"
                wait_for_baselines(nodes, device, args.leak_timeout)
                for each in samplers:
                    each.stop()
                final = series.sample(monitor, "after")  # the figures the verdict reads
                nodes[0].final = final
                for node, its_series in zip(nodes[1:], node_series, strict=True):
                    node.final = its_series.sample(node.client, "after")
                prefix = f"loadtest/{run_id}/"
                leftover = sorted(n for n in monitor.names() if n.startswith(prefix))
            finally:
                for each_series in (series, *node_series):
                    each_series.close()
        summary = summarize(
            out,
            baseline=baseline,
            final=final,
            leftover_names=leftover,
            fresh_server=server is not None,
            capacity=capacity,
            nodes=[
                n.report(read_csv(out / "locust_stats.csv"), read_csv(out / n.series_name))
                for n in nodes
            ]
            if cluster
            else None,
            cross_node=weights.get("cross", 0) > 0,
        )
        summary["locust_exit_status"] = locust_status
        if locust_status not in (0, 1):  # 1: Locust saw failures, which the summary counts
            summary["passed"] = False
        settings = {
            "users": args.users,
            "spawn rate": args.spawn_rate,
            "run time": args.run_time,
            "workers": args.workers,
            "server": ", ".join(parse_addresses(args.address))
            or f"started here, --device {args.device}"
            + (f" --policy {args.policy}" if args.policy else ""),
            **(
                {"nodes": ", ".join(f"{n['node']} ({n['address']})" for n in summary["nodes"])}
                if summary["nodes"]
                else {}
            ),
            "workloads": ",".join(f"{k}={w}" for k, w in weights.items() if w) or args.workloads,
            "size scale": args.scale,
            "seed": "unseeded" if args.seed is None else args.seed,
            "sample interval": f"{args.interval} s",
        }
        (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
        (out / "summary.md").write_text(
            render_markdown(summary, command=command, settings=settings)
        )
        if not args.no_plot:
            plot(out, series.t0, capacity)
    except (RuntimeError, OSError, tensord.TensordError) as exc:
        print(f"tensord loadtest: {type(exc).__name__}: {exc}", file=sys.stderr)
        remove_if_empty(made)  # a run that wrote nothing leaves no folder behind
        return 2
    finally:
        for node in nodes[1:]:  # the first is the monitor, closed above
            node.client.close()
        if server is not None:
            stop_process(server)
    print(
        f"tensord loadtest: {'PASS' if summary['passed'] else 'FAIL'}: "
        f"{summary['requests']:,} requests, {summary['requests_per_s']:,.1f}/s, "
        f"{summary['unexpected_failures']} unexpected failures, {summary['exceptions']} exceptions, "
        f"{summary['expected_errors']} expected errors, peak reserved/allocated "
        f"{mib(summary['peak_reserved_bytes'])}/{mib(summary['peak_allocated_bytes'])}, "
        f"leaked {summary['leaked_bytes']:,} B"
        + (
            f" on {len(summary['nodes'])} nodes, cross-node "
            + ", ".join(f"{k} {n:,}" for k, n in summary["cross_node_ops"].items())
            if summary["nodes"]
            else ""
        )
        + f"; {out / 'summary.md'}",
        flush=True,
    )
    return 0 if summary["passed"] else 1
