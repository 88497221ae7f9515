"""Same-host object stores side by side: tensord, Ray's object store, torch.multiprocessing.

    python benchmarks/bench_peers.py              # 3 interleaved rounds
    python benchmarks/bench_peers.py --rounds 5   # more rounds, tighter ranges
    python benchmarks/bench_peers.py --quick      # smoke run: 4 KiB and 1 MiB, one round
    python benchmarks/bench_peers.py --json       # the same rows, every round's value, as JSON
    pip install -e '.[bench]'                     # Ray (without it its column says so)

Every peer is one producer process and one consumer process, started with spawn; the
consumer opens its own client and never sees the producer's handles.  tensord: a server
started here on 127.0.0.1 (``tensord serve``, as bench_local.py and bench_rpc.py do), the
producer ``client.put(name, array)``, the consumer
``np.from_dlpack(client.get(name))``.  Ray: ``ray.init`` in the producer (a local
instance on 127.0.0.1, no dashboard, usage stats off, an object store sized for the
largest rows), ``ray.put(array)``; its consumer is an actor (a Ray worker process) that is
handed the ref and times ``ray.get(ref)``.  torch.multiprocessing: the producer's
``torch.from_numpy(array).share_memory_()`` sent through a multiprocessing Pipe (what a
Queue sends through, without the feeder thread, so the send returns when the consumer can
receive), the consumer's ``recv()`` and ``.numpy()``.

Rows, each peer measured in turn and the whole repeated ``--rounds`` times (the order
reversed every other round), a value per round, the median and range of the rounds:

- put: from a NumPy array into the store under a name or ref, returning when a consumer
  could get it; 4 KiB, 1 MiB, 64 MiB and 256 MiB, warm (the median of a few, after one
  unrecorded) and after every peer sat idle for ``--pause`` seconds (default 4);
- get to first byte: from the name or ref to a NumPy array whose first byte was read;
- 10,000 (``--objects``) 4 KiB puts, gets and deletes, one call each and batched (tensord's
  ``put_many`` in runs of ``MAX_STAGED_ITEMS``, ``get_many`` and ``delete_many`` in runs of
  ``MAX_NAME_ITEMS``, where the Client has them, else "not available"; Ray:
  ``ray.get(list)``, no batch put, so its batched put row is the loop again; deletes drop
  the refs, which Ray frees asynchronously, and tensord's are queued, ``wait=False``, the
  flush after them untimed), per object;
- the service's idle RSS (the tensord server; Ray's processes but its workers, the
  consumer actor among them), the CPU it takes while every peer is paused, and the
  anonymous RSS each small object adds to the service and to the producer (the objects'
  bytes live in shared memory, which is not counted).

"tensord vs Ray" and "tensord vs torch" are rates: the other peer's median over tensord's,
so >= 1.00x means tensord is as fast (or as small) or better.  Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import multiprocessing
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

import numpy as np

KiB = 1 << 10
MiB = 1 << 20
SIZES = (4 * KiB, 1 * MiB, 64 * MiB, 256 * MiB)
QUICK_SIZES = (4 * KiB, 1 * MiB)
SMALL = 4 * KiB  # the small objects' size
OBJECTS = 10_000  # small objects per round (--objects)
QUICK_OBJECTS = 200
ROUNDS = 3
PAUSE_S = 4.0  # idle time before the "after a pause" rows (--pause)
QUICK_PAUSE_S = 0.2
# warm puts and gets per size and round, after one unrecorded
REPEATS = {4 * KiB: 15, 1 * MiB: 9, 64 * MiB: 5, 256 * MiB: 3}
QUICK_REPEATS = 2
FILL = 7  # every source byte: the consumer checks the first byte it reads
TENSORD_POOL = "cpu=2GiB"  # the largest object twice over, with room for the small ones
# Ray's object store: a few of the largest objects (its frees are asynchronous, so a put may
# come before the last object of its size is gone), and the small objects
RAY_STORE_LARGEST_OBJECTS = 4
RAY_STORE_SLACK_BYTES = 256 * MiB
CALL_TIMEOUT_S = 900.0  # one command (at most a round's small objects) to a process
START_TIMEOUT_S = 300.0  # a process importing its peer (Ray starts its instance)

PEERS = ("tensord", "ray", "torch")
TITLES = {"tensord": "tensord", "ray": "Ray", "torch": "torch.multiprocessing"}


def small_names(count: int) -> list[str]:
    """The names (tensord) of a round's small objects, the same in producer and consumer."""
    return [f"bench-peers-small-{i}" for i in range(count)]


def chunks(names: list[str], size: int) -> Iterator[list[str]]:
    """``names`` in runs of at most ``size`` (a batch call's item limit)."""
    for start in range(0, len(names), size):
        yield names[start : start + size]


def source(sources: dict[int, np.ndarray], nbytes: int) -> np.ndarray:
    """The producer's array of ``nbytes`` (made once, outside any timing)."""
    if nbytes not in sources:
        sources[nbytes] = np.full(nbytes, FILL, dtype=np.uint8)
    return sources[nbytes]


def check_first_byte(value: int) -> None:
    if value != FILL:
        raise AssertionError(f"the consumer read {value} as the first byte, not {FILL}")


# ---- the peers' sides: each runs in a process of its own -----------------------------------
# A producer and a consumer answer the same commands whatever the peer: put/delete (one
# object under a key), put_small/delete_small (the round's small objects; not torch's),
# get/get_small (timed in the consumer), info.  Times are seconds measured inside the
# process, per object for the small ones; None: the peer has no such operation.


class TensordProducer:
    def __init__(self, address: str) -> None:
        import tensord

        self.version = tensord.__version__
        self.client = tensord.connect(address)
        self.batch = tensord.protocol.MAX_NAME_ITEMS
        # a put_many stages at most this many arrays through the mapping (the rest upload)
        self.staged = tensord.protocol.MAX_STAGED_ITEMS
        self.sources: dict[int, np.ndarray] = {}

    def info(self) -> dict[str, Any]:
        batch = {op: hasattr(self.client, op) for op in ("put_many", "get_many", "delete_many")}
        return {"version": self.version, "pid": os.getpid(), "batch": batch}

    def put(self, key: str, nbytes: int) -> float:
        array = source(self.sources, nbytes)
        start = time.perf_counter()
        self.client.put(key, array)
        elapsed = time.perf_counter() - start
        self.client.flush()  # the dropped handle's release, outside the timing
        return elapsed

    def delete(self, key: str) -> None:
        self.client.delete(key)

    def put_small(self, count: int, batched: bool) -> float | None:
        if batched and not hasattr(self.client, "put_many"):
            return None
        array, names, client = source(self.sources, SMALL), small_names(count), self.client
        start = time.perf_counter()
        if batched:
            for chunk in chunks(names, self.staged):
                client.put_many(dict.fromkeys(chunk, array))
        else:
            for name in names:
                client.put(name, array)
        elapsed = time.perf_counter() - start
        client.flush()
        return elapsed / count

    def delete_small(self, count: int, batched: bool) -> float | None:
        names = small_names(count)
        if batched and not hasattr(self.client, "delete_many"):
            for name in names:  # the objects go all the same, untimed
                self.client.delete(name)
            return None
        # queued (wait=False), as Ray frees a dropped ref's object asynchronously; the
        # flush after, untimed, waits until the server applied them and raises their errors
        start = time.perf_counter()
        if batched:
            for chunk in chunks(names, self.batch):
                self.client.delete_many(chunk, wait=False)
        else:
            for name in names:
                self.client.delete(name, wait=False)
        elapsed = time.perf_counter() - start
        self.client.flush()
        return elapsed / count

    def close(self) -> None:
        self.client.close()


class TensordConsumer:
    def __init__(self, address: str) -> None:
        import tensord

        self.client = tensord.connect(address)  # its own session: no producer handle
        self.batch = tensord.protocol.MAX_NAME_ITEMS
        self.dlpack = True  # np.from_dlpack; x.numpy() once DLPack proves impossible here

    def info(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "array": "np.from_dlpack" if self.dlpack else "x.numpy()"}

    def array(self, x: Any) -> np.ndarray:
        if self.dlpack:
            try:
                return np.from_dlpack(x)
            except BufferError:  # not the server's host: no mapping to alias
                self.dlpack = False
        return x.numpy()

    def get(self, key: str) -> float:
        start = time.perf_counter()
        first = int(self.array(self.client.get(key))[0])
        elapsed = time.perf_counter() - start
        check_first_byte(first)
        self.client.flush()  # the dropped handle's and export's releases, untimed
        return elapsed

    def get_small(self, count: int, batched: bool) -> float | None:
        if batched and not hasattr(self.client, "get_many"):
            return None
        names, client = small_names(count), self.client
        start = time.perf_counter()
        if batched:
            firsts = [
                int(self.array(x)[0])
                for chunk in chunks(names, self.batch)
                for x in client.get_many(chunk)
            ]
        else:
            firsts = [int(self.array(client.get(name))[0]) for name in names]
        elapsed = time.perf_counter() - start
        check_first_byte(min(firsts))
        client.flush()
        return elapsed / count

    def close(self) -> None:
        self.client.close()


def ray_consumer_class(ray: Any) -> Any:
    """The Ray consumer: an actor, so a process of its own that Ray hands refs to (the refs
    come boxed in a list, which Ray passes as refs rather than resolving them).  Made here,
    not at module level, so Ray ships the class by value: its workers cannot import this
    script under the name spawn gives it."""

    class PeersConsumer:
        def pid(self) -> int:
            return os.getpid()

        def get(self, boxed: list[Any]) -> float:
            start = time.perf_counter()
            first = int(ray.get(boxed[0])[0])
            elapsed = time.perf_counter() - start
            check(first)
            return elapsed

        def get_small(self, boxed: list[Any], batched: bool) -> float:
            refs = boxed[0]
            start = time.perf_counter()
            if batched:
                firsts = [int(array[0]) for array in ray.get(refs)]
            else:
                firsts = [int(ray.get(ref)[0]) for ref in refs]
            elapsed = time.perf_counter() - start
            check(min(firsts))
            return elapsed / len(refs)

    fill = FILL

    def check(value: int) -> None:
        if value != fill:
            raise AssertionError(f"the consumer read {value} as the first byte, not {fill}")

    return ray.remote(num_cpus=0)(PeersConsumer)


class RayProducer:
    """The driver: starts a local Ray instance (its processes are this process's
    descendants) and the consumer actor, and relays the consumer's commands to it."""

    def __init__(self, object_store_bytes: int) -> None:
        os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # nothing reported off the host
        # With clusters off (an option meant for macOS and Windows) Ray binds its node to
        # 127.0.0.1; on, the default on Linux, to the host's outward address
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        import ray

        self.ray = ray
        self.temp_dir = tempfile.mkdtemp(prefix="ray-")  # short: Ray's socket paths
        ray.init(
            num_cpus=1,
            include_dashboard=False,
            object_store_memory=object_store_bytes,
            log_to_driver=False,
            _temp_dir=self.temp_dir,
        )
        self.consumer = ray_consumer_class(ray).remote()
        self.consumer_pid = ray.get(self.consumer.pid.remote())
        self.refs: dict[str, Any] = {}
        self.small: list[Any] = []
        self.sources: dict[int, np.ndarray] = {}

    def info(self) -> dict[str, Any]:
        return {
            "version": self.ray.__version__,
            "pid": os.getpid(),
            "consumer_pid": self.consumer_pid,
            "node_ip": self.ray.util.get_node_ip_address(),
        }

    def service_pids(self) -> list[int]:
        """Ray's own processes: this driver's descendants but its workers (the idle ones
        and the consumer actor), which play the clients' part."""
        return [
            pid
            for pid in descendants(os.getpid())
            if pid != self.consumer_pid and not process_title(pid).startswith("ray::IDLE")
        ]

    def put(self, key: str, nbytes: int) -> float:
        array = source(self.sources, nbytes)
        start = time.perf_counter()
        self.refs[key] = self.ray.put(array)
        return time.perf_counter() - start

    def delete(self, key: str) -> None:
        del self.refs[key]

    def get(self, key: str) -> float:
        seconds: float = self.ray.get(self.consumer.get.remote([self.refs[key]]))
        return seconds

    def put_small(self, count: int, batched: bool) -> float:
        # Ray has no batch put: the batched row is the loop again
        array, put = source(self.sources, SMALL), self.ray.put
        start = time.perf_counter()
        self.small = [put(array) for _ in range(count)]
        return (time.perf_counter() - start) / count

    def get_small(self, count: int, batched: bool) -> float:
        seconds: float = self.ray.get(self.consumer.get_small.remote([self.small], batched))
        return seconds

    def delete_small(self, count: int, batched: bool) -> float:
        refs = self.small
        self.small = []
        start = time.perf_counter()
        if batched:
            refs.clear()
        else:
            while refs:
                refs.pop()
        return (time.perf_counter() - start) / count

    def close(self) -> None:
        self.refs.clear()
        self.small.clear()
        self.ray.shutdown()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


class TorchProducer:
    def __init__(self, data: Connection) -> None:
        import torch
        import torch.multiprocessing  # registers the tensor reductions with the pickler

        self.torch = torch
        self.data = data
        self.sent: dict[str, Any] = {}  # alive until deleted: the consumer maps their memory
        self.sources: dict[int, np.ndarray] = {}

    def info(self) -> dict[str, Any]:
        strategy = self.torch.multiprocessing.get_sharing_strategy()
        return {"version": self.torch.__version__, "pid": os.getpid(), "sharing": strategy}

    def put(self, key: str, nbytes: int) -> float:
        array = source(self.sources, nbytes)
        start = time.perf_counter()
        tensor = self.torch.from_numpy(array).share_memory_()  # a copy into shared memory
        self.data.send(tensor)
        elapsed = time.perf_counter() - start
        self.sent[key] = tensor
        return elapsed

    def delete(self, key: str) -> None:
        del self.sent[key]

    def close(self) -> None:
        self.sent.clear()


class TorchConsumer:
    def __init__(self, data: Connection) -> None:
        import torch.multiprocessing  # noqa: F401  (rebuilds the tensors it receives)

        self.data = data

    def info(self) -> dict[str, Any]:
        return {"pid": os.getpid()}

    def get(self, key: str) -> float:
        self.data.poll(None)  # the producer has sent it: time the receiving, not the wait
        start = time.perf_counter()
        first = int(self.data.recv().numpy()[0])
        elapsed = time.perf_counter() - start
        check_first_byte(first)
        return elapsed

    def close(self) -> None:
        pass


def make_side(peer: str, role: str, options: dict[str, Any]) -> Any:
    if peer == "tensord":
        side = TensordProducer if role == "producer" else TensordConsumer
        return side(options["address"])
    if peer == "ray":
        return RayProducer(options["object_store_bytes"])
    return (TorchProducer if role == "producer" else TorchConsumer)(options["data"])


def serve_side(peer: str, role: str, control: Connection, options: dict[str, Any]) -> None:
    """A producer's or consumer's process: make the side, then answer ``(command, args)``
    with ``("ok", result)``, ``("error", traceback)`` or, at start, ``("missing", why)``."""
    os.dup2(2, 1)  # stdout carries the table: whatever this process or its children print
    sys.stdout = sys.stderr
    try:
        side = make_side(peer, role, options)
    except ImportError as exc:
        control.send(("missing", f"{type(exc).__name__}: {exc}"))
        return
    except Exception:
        control.send(("error", traceback.format_exc()))
        return
    control.send(("ok", side.info()))
    while True:
        command, args = control.recv()
        try:
            result = getattr(side, command)(*args)
        except Exception:
            control.send(("error", traceback.format_exc()))
            continue
        control.send(("ok", result))
        if command == "close":
            return


# ---- the processes, from the orchestrating one ---------------------------------------------


class PeerMissing(Exception):
    """The peer's package cannot be imported here."""


class Remote:
    """A side's process and the end of its control pipe."""

    def __init__(self, peer: str, role: str, options: dict[str, Any]) -> None:
        context = multiprocessing.get_context("spawn")
        self.label = f"{peer} {role}"
        self.control, theirs = context.Pipe()
        self.process = context.Process(
            target=serve_side, args=(peer, role, theirs, options), name=self.label, daemon=True
        )
        self.process.start()
        theirs.close()
        self.info: dict[str, Any] = {}

    def answer(self, timeout: float) -> Any:
        if not self.control.poll(timeout):
            raise RuntimeError(f"{self.label}: no answer in {timeout:g} s")
        try:
            status, value = self.control.recv()
        except EOFError:
            raise RuntimeError(f"{self.label}: the process ended") from None
        if status == "missing":
            raise PeerMissing(value)
        if status == "error":
            raise RuntimeError(f"{self.label} failed:\n{value}")
        return value

    def started(self) -> dict[str, Any]:
        self.info = self.answer(START_TIMEOUT_S)
        return self.info

    def call(self, command: str, *args: Any) -> Any:
        self.control.send((command, args))
        return self.answer(CALL_TIMEOUT_S)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            if self.process.is_alive():
                self.call("close")
        self.process.join(30)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(10)


@dataclass
class Peer:
    name: str
    producer: Remote
    consumer: Remote  # Ray's is its producer, which relays to the actor
    server_pid: int | None = None  # tensord's server

    def service_pids(self) -> list[int] | None:
        """The processes that are the store itself (None: the peer has none)."""
        if self.name == "tensord":
            return [self.server_pid] if self.server_pid else []
        if self.name == "ray":
            pids: list[int] = self.producer.call("service_pids")
            return pids
        return None

    def stop(self) -> None:
        self.consumer.stop()
        self.producer.stop()


def start_tensord_server() -> tuple[subprocess.Popen[str], str]:
    command = [sys.executable, "-m", "tensord_server", "serve", "--address", "127.0.0.1:0"]
    process = subprocess.Popen(
        [*command, "--device", TENSORD_POOL],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,  # its event log
        text=True,
    )
    assert process.stdout is not None
    match = re.search(r"tensord listening on (\S+)", process.stdout.readline())
    if not match:
        process.kill()
        raise SystemExit("tensord server did not start")
    return process, match.group(1)


def start_peer(name: str, options: dict[str, Any]) -> Peer:
    """A peer's two processes (not yet answered: see ``Peer.producer.started``)."""
    if name == "torch":
        context = multiprocessing.get_context("spawn")
        produced, received = context.Pipe()
        producer = Remote(name, "producer", {"data": produced})
        consumer = Remote(name, "consumer", {"data": received})
        produced.close()
        received.close()
        return Peer(name, producer, consumer)
    producer = Remote(name, "producer", options)
    if name == "ray":
        return Peer(name, producer, producer)
    return Peer(name, producer, Remote(name, "consumer", options))


# ---- memory, from /proc ----------------------------------------------------------------------


class Memory(NamedTuple):
    rss: int  # VmRSS, bytes
    anon: int  # RssAnon: the process's own heap and stacks, no file or shared-memory pages


def memory_of(pids: list[int]) -> Memory:
    """The processes' RSS summed (a process that ended counts nothing)."""
    rss = anon = 0
    for pid in pids:
        with contextlib.suppress(OSError, KeyError):  # KeyError: a zombie, no memory
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            kib = int(fields["VmRSS"].split()[0]), int(fields["RssAnon"].split()[0])
            rss += kib[0] * KiB
            anon += kib[1] * KiB
    return Memory(rss, anon)


def cpu_seconds(pids: list[int]) -> float:
    """The processes' user and system CPU time so far, summed."""
    ticks = 0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # from field 3, state, on
            ticks += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15
    return ticks / os.sysconf("SC_CLK_TCK")


def descendants(root: int) -> list[int]:
    """Every living process below ``root``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{entry}/stat") as f:
                # pid (comm) state ppid ...: comm may hold spaces and parentheses
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    found, queue = [], [root]
    while queue:
        for child in children.get(queue.pop(), []):
            found.append(child)
            queue.append(child)
    return found


def process_title(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


# ---- the rows ---------------------------------------------------------------------------------


def size_label(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // KiB} KiB"


@dataclass
class Row:
    key: str  # stable, for machines: "put/4KiB/warm"
    label: str
    unit: str  # "s", "B" or "%"
    cells: dict[str, list[float] | str] = field(default_factory=dict)  # values, or why none

    def add(self, peer: str, value: float | None, missing: str = "not available") -> None:
        if value is None:
            self.cells[peer] = missing
            return
        values = self.cells.setdefault(peer, [])
        if isinstance(values, list):
            values.append(value)

    def median(self, peer: str) -> float | None:
        values = self.cells.get(peer)
        return statistics.median(values) if isinstance(values, list) and values else None

    def rate_vs(self, other: str) -> float | None:
        """The other peer's median over tensord's: >= 1 when tensord is faster (smaller)."""
        ours, theirs = self.median("tensord"), self.median(other)
        if ours is None or theirs is None or ours <= 0 or theirs <= 0:
            return None
        return theirs / ours


@dataclass
class Plan:
    sizes: tuple[int, ...]
    rounds: int
    objects: int
    pause_s: float
    repeats: Callable[[int], int]

    def rows(self) -> list[Row]:
        pause = f"after a {self.pause_s:g} s pause"
        rows = []
        for op, title in (("put", "put"), ("get", "get to first byte")):
            for state, when in (("warm", "warm"), ("paused", pause)):
                for nbytes in self.sizes:
                    key = f"{op}/{size_label(nbytes).replace(' ', '')}/{state}"
                    rows.append(Row(key, f"{title} {size_label(nbytes)}, {when}", "s"))
        n, small = f"{self.objects:,}", size_label(SMALL)
        for op, what in (("put", "puts"), ("get", "gets"), ("delete", "deletes")):
            for batched in (False, True):
                how = "batched" if batched else "one call each"
                key = f"small/{op}/{'batched' if batched else 'single'}"
                rows.append(Row(key, f"{n} {small} {what}, {how}, per object", "s"))
        rows += [
            Row("memory/idle_rss", "service idle RSS", "B"),
            Row("cpu/idle", "service CPU while idle, % of one core", "%"),
            Row("memory/service_per_object", f"service anon RSS per object, first {n}", "B"),
            Row("memory/producer_per_object", f"producer anon RSS per object, first {n}", "B"),
        ]
        return rows


class Bench:
    def __init__(self, plan: Plan, peers: list[Peer], skipped: dict[str, str]) -> None:
        self.plan = plan
        self.peers = peers
        self.skipped = skipped  # peer -> why its column is empty
        self.rows = {row.key: row for row in plan.rows()}
        self.services: dict[str, list[str]] = {}  # peer -> its service processes, by name
        # seconds each phase took, all rounds together (the small objects' per peer)
        self.spent = dict.fromkeys(["warm", "paused", *(f"small {p.name}" for p in peers)], 0.0)

    def record(
        self, key: str, peer: str, value: float | None, missing: str = "not available"
    ) -> None:
        self.rows[key].add(peer, value, missing)

    def run(self) -> None:
        self.idle_memory()
        for index in range(self.plan.rounds):
            order = self.peers if index % 2 == 0 else self.peers[::-1]
            spent = dict(self.spent)
            started = time.perf_counter()
            self.warm(order)
            self.spent["warm"] += time.perf_counter() - started
            paused = time.perf_counter()
            self.paused(order)
            self.spent["paused"] += time.perf_counter() - paused
            self.small_objects(order)
            phases = ", ".join(f"{k} {v - spent[k]:.0f} s" for k, v in self.spent.items())
            took = time.perf_counter() - started
            log(f"round {index + 1} of {self.plan.rounds}: {took:.0f} s ({phases})")
        for row in self.rows.values():
            for peer, why in self.skipped.items():
                row.cells[peer] = why

    def idle_memory(self) -> None:
        for peer in self.peers:
            pids = peer.service_pids()
            value = None if pids is None else float(memory_of(pids).rss)
            self.record("memory/idle_rss", peer.name, value, "n/a")
            titles = [process_title(pid).split(" ")[0] for pid in pids or []]
            self.services[peer.name] = [os.path.basename(title) for title in titles]

    def put_get(self, peer: Peer, nbytes: int, key: str) -> tuple[float, float]:
        put = peer.producer.call("put", key, nbytes)
        get = peer.consumer.call("get", key)
        peer.producer.call("delete", key)
        return put, get

    def warm(self, order: list[Peer]) -> None:
        for nbytes in self.plan.sizes:
            label = size_label(nbytes).replace(" ", "")
            for peer in order:
                self.put_get(peer, nbytes, "bench-peers-warm")  # unrecorded
                times = [
                    self.put_get(peer, nbytes, "bench-peers-warm")
                    for _ in range(self.plan.repeats(nbytes))
                ]
                self.record(f"put/{label}/warm", peer.name, statistics.median(t[0] for t in times))
                self.record(f"get/{label}/warm", peer.name, statistics.median(t[1] for t in times))

    def paused(self, order: list[Peer]) -> None:
        """Each peer idle for the pause before its put, and again before its get; the CPU
        its service takes meanwhile."""
        services = {peer.name: peer.service_pids() for peer in order}
        idle_cpu = dict.fromkeys(services, 0.0)
        for nbytes in self.plan.sizes:
            label = size_label(nbytes).replace(" ", "")
            idle_cpu = self.pause(services, idle_cpu)
            for peer in order:
                put = peer.producer.call("put", "bench-peers-paused", nbytes)
                self.record(f"put/{label}/paused", peer.name, put)
            idle_cpu = self.pause(services, idle_cpu)
            for peer in order:
                get = peer.consumer.call("get", "bench-peers-paused")
                self.record(f"get/{label}/paused", peer.name, get)
                peer.producer.call("delete", "bench-peers-paused")
        idle_s = 2 * len(self.plan.sizes) * self.plan.pause_s
        for name, pids in services.items():
            value = None if pids is None or not idle_s else 100 * idle_cpu[name] / idle_s
            self.record("cpu/idle", name, value, "n/a")

    def pause(
        self, services: dict[str, list[int] | None], cpu: dict[str, float]
    ) -> dict[str, float]:
        """Sleep for the pause; ``cpu`` plus the CPU seconds each service took meanwhile."""
        before = {name: cpu_seconds(pids or []) for name, pids in services.items()}
        time.sleep(self.plan.pause_s)
        return {
            name: cpu[name] + cpu_seconds(pids or []) - before[name]
            for name, pids in services.items()
        }

    def small_objects(self, order: list[Peer]) -> None:
        """Per peer: the small objects put one by one (in the first round, the memory they
        add to a service that has held none measured around it), got one by one and batched,
        deleted one by one; put batched, deleted batched."""
        n = self.plan.objects
        for peer in order:
            producer, consumer, name = peer.producer, peer.consumer, peer.name
            pids = peer.service_pids()
            if pids is None:  # torch.multiprocessing: no store (and a descriptor per tensor)
                for key in self.rows:
                    if key.startswith(("small/", "memory/")) and key != "memory/idle_rss":
                        self.record(key, name, None, "n/a")
                continue
            started = time.perf_counter()
            first = name not in self.rows["memory/service_per_object"].cells
            before = memory_of(pids), memory_of([producer.info["pid"]])
            self.record("small/put/single", name, producer.call("put_small", n, False))
            after = memory_of(pids), memory_of([producer.info["pid"]])
            if first:
                service, own = after[0].anon - before[0].anon, after[1].anon - before[1].anon
                self.record("memory/service_per_object", name, service / n)
                self.record("memory/producer_per_object", name, own / n)
            for batched, how in ((False, "single"), (True, "batched")):
                self.record(f"small/get/{how}", name, consumer.call("get_small", n, batched))
            self.record("small/delete/single", name, producer.call("delete_small", n, False))
            batch_delete = producer.info.get("batch", {}).get("delete_many", True)
            put = producer.call("put_small", n, True)
            self.record("small/put/batched", name, put)
            if put is None and batch_delete:  # the objects for the batched delete, one by one
                producer.call("put_small", n, False)
            if put is not None or batch_delete:
                deleted = producer.call("delete_small", n, True)
                self.record("small/delete/batched", name, deleted)
            else:
                self.record("small/delete/batched", name, None)
            self.spent[f"small {name}"] += time.perf_counter() - started


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# ---- output -------------------------------------------------------------------------------


def digits(value: float) -> str:
    """Three significant digits, never in exponent form."""
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def human(value: float, unit: str) -> str:
    if unit == "%":
        return f"{value:.1f} %"
    if unit == "B":
        magnitude = abs(value)
        if magnitude >= MiB:
            return f"{value / MiB:.1f} MiB"
        if magnitude >= KiB:
            return f"{value / KiB:.2f} KiB"
        return f"{value:.0f} B"
    if value >= 1:
        return f"{value:.2f} s"
    if value >= 1e-3:
        return f"{digits(value * 1e3)} ms"
    return f"{digits(value * 1e6)} µs"


def cell_text(cell: list[float] | str | None, unit: str) -> str:
    if cell is None:
        return "-"
    if isinstance(cell, str):
        return cell
    text = human(statistics.median(cell), unit)
    if len(cell) > 1:
        text += f" ({human(min(cell), unit)} - {human(max(cell), unit)})"
    return text


def ratio_text(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def report(bench: Bench, meta: dict[str, Any]) -> dict[str, Any]:
    """Everything measured, for ``--json`` and for the table."""
    rows = []
    for row in bench.rows.values():
        cells: dict[str, Any] = {}
        for peer in PEERS:
            cell = row.cells.get(peer)
            if isinstance(cell, list):
                cells[peer] = {
                    "values": cell,
                    "median": statistics.median(cell),
                    "min": min(cell),
                    "max": max(cell),
                }
            else:
                cells[peer] = {"status": cell or "-"}
        rows.append(
            {
                "key": row.key,
                "label": row.label,
                "unit": row.unit,
                "cells": cells,
                "vs_ray": row.rate_vs("ray"),
                "vs_torch": row.rate_vs("torch"),
            }
        )
    return {"meta": meta, "rows": rows}


def markdown(result: dict[str, Any]) -> str:
    meta = result["meta"]
    peers = meta["peers"]
    lines = [
        f"{meta['host']}; {meta['rounds']} round{'s' if meta['rounds'] > 1 else ''}, "
        f"median (range) of the rounds; {meta['seconds']:.0f} s in all",
        "",
        f"| row | {' | '.join(TITLES[p] for p in PEERS)} | tensord vs Ray | tensord vs torch |",
        f"| --- |{' ---: |' * (len(PEERS) + 2)}",
        f"| peer | {' | '.join(peers[p] for p in PEERS)} | rate | rate |",
    ]
    for row in result["rows"]:
        cells = []
        for peer in PEERS:
            cell = row["cells"][peer]
            cells.append(cell_text(cell.get("values", cell.get("status")), row["unit"]))
        ratios = f"{ratio_text(row['vs_ray'])} | {ratio_text(row['vs_torch'])}"
        lines.append(f"| {row['label']} | {' | '.join(cells)} | {ratios} |")
    lines += [
        "",
        "Rates: the other peer's median over tensord's (>= 1.00x: tensord as fast or as small, "
        "or better). Ray has no batch put: its batched put row is its put loop again.",
    ]
    return "\n".join(lines)


# ---- main ---------------------------------------------------------------------------------------


def installed(peer: str) -> bool:
    """Whether the peer's package (named as the peer) is there to import: one that is there
    but fails to import is found out by its producer, and reported the same way."""
    return importlib.util.find_spec(peer) is not None


def host_line(load_at_start: float) -> str:
    return (
        f"numpy {np.__version__}, {os.cpu_count()} cpus, load average {load_at_start:.1f} at "
        f"the start, {os.getloadavg()[0]:.1f} at the end"
    )


@contextlib.contextmanager
def running(names: list[str], plan: Plan) -> Iterator[tuple[list[Peer], dict[str, str]]]:
    """The selected peers' processes started, and each absent peer's reason; all stopped
    on the way out."""
    server, address = start_tensord_server()
    options = {
        "address": address,
        "object_store_bytes": RAY_STORE_LARGEST_OBJECTS * max(plan.sizes) + RAY_STORE_SLACK_BYTES,
    }
    skipped: dict[str, str] = {}
    started: list[Peer] = []
    try:
        for name in names:
            if installed(name):
                started.append(start_peer(name, options))
            else:
                skipped[name] = f"{name} not installed"
        peers = []
        for peer in started:
            try:
                peer.producer.started()
                if peer.consumer is not peer.producer:
                    peer.consumer.started()
            except PeerMissing as exc:
                log(f"{peer.name}: {exc}")
                skipped[peer.name] = f"{peer.name} not installed"
                continue
            peer.server_pid = server.pid if peer.name == "tensord" else None
            peers.append(peer)
        yield peers, skipped
    finally:
        for peer in started:
            peer.stop()
        server.terminate()
        server.wait(timeout=30)


def peer_versions(peers: list[Peer], skipped: dict[str, str]) -> dict[str, str]:
    versions = {}
    for name in PEERS:
        peer = next((p for p in peers if p.name == name), None)
        if peer is not None:
            versions[name] = f"{name} {peer.producer.info['version']}"
        else:
            versions[name] = skipped.get(name, f"{name} not run")
    return versions


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=0, help=f"(default {ROUNDS}; --quick 1)")
    parser.add_argument(
        "--objects", type=int, default=0, help=f"small objects (default {OBJECTS:,})"
    )
    parser.add_argument("--pause", type=float, default=-1.0, help=f"seconds (default {PAUSE_S:g})")
    parser.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    parser.add_argument("--peers", default=",".join(PEERS), help="comma-separated subset")
    parser.add_argument("--json", action="store_true", help="JSON instead of the table")
    args = parser.parse_args(argv)
    names = [name for name in args.peers.split(",") if name]
    unknown = set(names) - set(PEERS)
    if unknown:
        parser.error(f"unknown peers {sorted(unknown)}; choose from {', '.join(PEERS)}")
    quick = args.quick
    plan = Plan(
        sizes=QUICK_SIZES if quick else SIZES,
        rounds=args.rounds or (1 if quick else ROUNDS),
        objects=args.objects or (QUICK_OBJECTS if quick else OBJECTS),
        pause_s=args.pause if args.pause >= 0 else (QUICK_PAUSE_S if quick else PAUSE_S),
        repeats=(lambda nbytes: QUICK_REPEATS) if quick else REPEATS.__getitem__,
    )
    start, load = time.perf_counter(), os.getloadavg()[0]
    with running(names, plan) as (peers, skipped):
        for name in set(PEERS) - set(names):
            skipped[name] = f"{name} not run (--peers)"
        log("started: " + ", ".join(p.name for p in peers))
        bench = Bench(plan, peers, skipped)
        bench.run()
        for peer in peers:  # what the consumer ended up using (tensord: DLPack or a copy)
            if peer.consumer is not peer.producer:
                peer.consumer.info = peer.consumer.call("info")
        meta = {
            "host": host_line(load),
            "peers": peer_versions(peers, skipped),
            "info": {
                p.name: {"producer": p.producer.info, "consumer": p.consumer.info} for p in peers
            },
            "services": bench.services,
            "seconds_by_phase": bench.spent,
            "rounds": plan.rounds,
            "objects": plan.objects,
            "pause_s": plan.pause_s,
            "sizes": list(plan.sizes),
        }
    meta["seconds"] = time.perf_counter() - start
    result = report(bench, meta)
    print(json.dumps(result, indent=1) if args.json else markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
