"""Locust users that drive tensord through its SDK, one workload per user class.

Run by ``tensord loadtest`` (which starts a server, Locust and the sampler and
writes the report), or by hand / by docker-compose::

    locust -f loadtest/locustfile.py --headless -u 20 -t 30s --host 127.0.0.1:50051

Every SDK operation fires one Locust request event (``request_type="grpc"``,
named ``workload.op``), so Locust's statistics cover every op.  Errors a
workload provokes on purpose (an out-of-memory pool, a name deleted under a
reader) are fired with ``request_type="expected"`` and no exception: they
show in their own rows and never count as failures.

Configuration, by environment variable (read by master and workers alike):

- ``TENSORD_ADDRESS``: the server, when ``--host`` is not given;
- ``TENSORD_ADDRESSES``: the nodes of a cluster, comma-separated: each user connects to one
  of them, round robin (:func:`user_address`), overriding ``--host``, and its connect is
  the op ``session.connect ADDRESS`` (the users each node got);
- ``TENSORD_WORKERS``: how many Locust workers share the users (for that round robin);
- ``TENSORD_TOKEN``: the tenant's token every user (and the sampler) presents, as the SDK
  reads it;
- ``TENSORD_WORKLOADS``: weights, e.g. ``kv=3,train=2,churn=3`` (unnamed: off;
  empty: every workload at its default weight);
- ``TENSORD_DEVICE``: the device every tensor lives on (default ``cpu``; ``cuda:0``
  when the server has a GPU; a ``=LIMIT`` suffix is ignored);
- ``TENSORD_SCALE``: multiplies every allocation size (default 1.0);
- ``TENSORD_TRACE``, ``TENSORD_TRACE_DIVISOR``: the trace the ``trace`` users
  replay, a file or a bundled trace's name (default the bundled ``resnet50_train``),
  and how much to divide its sizes by (default 256);
- ``TENSORD_WAIT``: ``min,max`` seconds each user waits between steps;
- ``TENSORD_SEED``: seeds each user's choices step by step (:func:`seeded_step`: the n-th
  user of a workload makes the same choices in every run with this seed); unset: unseeded;
- ``TENSORD_RUN_ID``: names shared tensors ``loadtest/<run id>/...``;
- ``TENSORD_SAMPLER``: ``on`` (default when ``--csv`` is given) samples the
  server's memory statistics into ``<csv prefix>_timeseries.csv`` from the
  master; ``off`` when ``tensord loadtest`` samples by itself;
- ``TENSORD_SAMPLE_INTERVAL``: seconds between samples (default 0.5).
"""

from __future__ import annotations

import os

# gRPC must cooperate with gevent before any channel exists (Locust's gRPC pattern).
import gevent
import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()
# In gevent mode gRPC waits on its completion queues in the hub's thread pool, and a
# session's KeepAlive stream holds one of those threads for its whole life: with
# gevent's default of 10, the eleventh user stalls every call for seconds.
gevent.get_hub().threadpool.maxsize = int(os.environ.get("TENSORD_GEVENT_THREADS", "1024"))
# Every user is a greenlet, and any torch error raised in one (a broadcast that fails,
# x == y of other shapes) kills this process with SIGSEGV: torch records a C++ backtrace
# for each error, and the unwinder walks past the greenlet's stack into stale frames.
# So the workloads never let torch compute on a tensor (see the tests).

import contextlib  # noqa: E402
import itertools  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402
from typing import Any  # noqa: E402

import locust.stats  # noqa: E402
import tensord  # noqa: E402
from locust import User, between, events, task  # noqa: E402
from locust.runners import WorkerRunner  # noqa: E402

from tensord_server.tools.loadtest.workloads import (  # noqa: E402
    WORKLOADS,
    OpFailed,
    TraceReplay,
    Workload,
    connect_op,
    parse_weights,
    seeded_step,
    user_address,
    workload_rng,
)

WEIGHTS = parse_weights(os.environ.get("TENSORD_WORKLOADS"))
SCALE = float(os.environ.get("TENSORD_SCALE", "1.0"))
RUN_ID = os.environ.get("TENSORD_RUN_ID", "run")
WAIT_MIN, WAIT_MAX = (float(v) for v in os.environ.get("TENSORD_WAIT", "0,0.05").split(","))
SEED = os.environ.get("TENSORD_SEED") or None
ADDRESSES = [a for a in os.environ.get("TENSORD_ADDRESSES", "").split(",") if a]
WORKERS = int(os.environ.get("TENSORD_WORKERS") or 1)
# The stats history (--csv-full-history) on disk each second, not every 5 s: tensord
# loadtest's progress lines read it while the run goes on.
locust.stats.CSV_STATS_FLUSH_INTERVAL_SEC = 1
# each workload's users numbered in the order they start (this process's), for workload_rng
USER_NUMBERS: defaultdict[str, itertools.count[int]] = defaultdict(itertools.count)


class TensordUser(User):
    """One tensord session running one :class:`Workload`."""

    abstract = True
    workload_class: type[Workload]
    wait_time = between(WAIT_MIN, WAIT_MAX)

    def on_start(self) -> None:
        # numbered before the first call that yields to another user's greenlet: in the
        # order Locust starts the users, which its dispatcher keeps from run to run
        number = next(USER_NUMBERS[self.workload_class.name])
        worker = getattr(self.environment.runner, "worker_index", 0)
        self.seed_key = (number, worker)
        self.steps = 0
        address: str | None = self.host or os.environ.get("TENSORD_ADDRESS")
        connect = "session.connect"
        if ADDRESSES:  # a cluster: this user's node, round robin; its row names the node
            address = user_address(ADDRESSES, self.workload_class.name, number, worker, WORKERS)
            connect = connect_op(address)
        start = time.perf_counter()
        try:
            self.client = tensord.connect(address)
        except Exception as exc:
            self._record(connect, time.perf_counter() - start, 0, exc, False)
            raise
        self._record(connect, time.perf_counter() - start, 0, None, False)
        rng = workload_rng(SEED, self.workload_class.name, number, worker)
        kwargs: dict[str, Any] = {"rng": rng, "scale": SCALE, "run_id": RUN_ID}
        kwargs["device"] = os.environ.get("TENSORD_DEVICE", "cpu").split("=")[0]
        if self.workload_class is TraceReplay:
            kwargs["divisor"] = int(os.environ.get("TENSORD_TRACE_DIVISOR", "256"))
        self.workload = self.workload_class(self.client, self._record, **kwargs)
        with contextlib.suppress(OpFailed):  # recorded; the user carries on with what it has
            self.workload.start()

    @task
    def step(self) -> None:
        step, self.steps = self.steps, self.steps + 1
        with contextlib.suppress(OpFailed):  # recorded as a failure already
            seeded_step(self.workload, SEED, *self.seed_key, step)

    def on_stop(self) -> None:
        client = getattr(self, "client", None)
        if client is None:
            return
        try:
            workload = getattr(self, "workload", None)
            if workload is not None:
                workload.stop()
        except OpFailed:
            pass
        finally:
            start = time.perf_counter()
            try:
                client.close()
            except Exception as exc:
                self._record("session.close", time.perf_counter() - start, 0, exc, False)
            else:
                self._record("session.close", time.perf_counter() - start, 0, None, False)

    def _record(
        self, op: str, seconds: float, nbytes: int, exc: BaseException | None, expected: bool
    ) -> None:
        fire = self.environment.events.request.fire
        if expected:
            name = f"{op} ({type(exc).__name__})"
            fire(request_type="expected", name=name, response_time=seconds * 1000.0,
                 response_length=0, exception=None, context={})  # fmt: skip
        else:  # a data check (".verify") is no RPC: its own type keeps it apart
            kind = "check" if op.endswith(".verify") else "grpc"
            fire(request_type=kind, name=op, response_time=seconds * 1000.0,
                 response_length=nbytes, exception=exc, context={})  # fmt: skip


def _user_class(workload: type[Workload]) -> type[TensordUser]:
    weight = WEIGHTS[workload.name]
    attrs = {
        "workload_class": workload,
        "weight": max(weight, 1),
        "abstract": weight == 0,  # off: Locust skips abstract classes
        "__module__": __name__,
        "__doc__": workload.__doc__,
    }
    return type(f"{workload.__name__}User", (TensordUser,), attrs)


for _workload in WORKLOADS.values():
    globals()[f"{_workload.__name__}User"] = _user_class(_workload)


# -- the sampler, when Locust runs without `tensord loadtest` ------------------------
_sampler: gevent.Greenlet | None = None


@events.test_start.add_listener
def _start_sampler(environment: Any, **_: Any) -> None:
    global _sampler
    options = environment.parsed_options
    prefix = getattr(options, "csv_prefix", None)
    wanted = os.environ.get("TENSORD_SAMPLER", "on" if prefix else "off") == "on"
    if not wanted or not prefix or isinstance(environment.runner, WorkerRunner) or _sampler:
        return
    from tensord_server.tools.loadtest.runner import TimeSeries

    address = environment.host or os.environ.get("TENSORD_ADDRESS")
    interval = float(os.environ.get("TENSORD_SAMPLE_INTERVAL", "0.5"))

    def sample() -> None:
        with tensord.connect(address) as client, TimeSeries(f"{prefix}_timeseries.csv") as series:
            while True:
                series.sample(client, "load")
                gevent.sleep(interval)

    _sampler = gevent.spawn(sample)


@events.quitting.add_listener
def _stop_sampler(**_: Any) -> None:
    if _sampler is not None:
        _sampler.kill()
