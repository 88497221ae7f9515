"""``tensord replay``: run a recorded allocator trace through the pool and compare with PyTorch.

A trace is PyTorch's ``torch.cuda.memory._snapshot()["device_traces"][0]``,
either as a ``*.events.json.gz`` (a gzipped JSON list of
``[action, addr, size, stream]``) or as the pickled snapshot itself.  The ResNet-50
training trace ships with the package (``tensord replay resnet50_train``;
``tensord replay --list`` names every bundled trace).  Replay
mallocs on ``alloc`` (size = the bytes requested) and frees on
``free_completed``; ``free_requested`` and ``segment_*`` are skipped, because
the pool's own policy decides when and how large segments are.

One thing is taken from the trace when it has it: the *addresses* cudaMalloc
returned.  Best fit breaks ties between equal-sized free blocks by address,
and CUDA does not hand out addresses in increasing order, so on a device the
tie-breaks follow the recorded addresses.  ``RecordedAddressBackend`` gives a
new segment the next recorded address of the same size (falling back to fresh
fake addresses), which makes the replay follow PyTorch block for block.

A replay that runs longer than ``--progress-interval`` seconds (5) prints a line
to stderr every that many seconds: events done, percent, events/s and the time
left; the result alone goes to stdout.

``--policy`` picks what the pool does beyond PyTorch (``pytorch``: nothing, the
default without ``--compaction``); ``--compaction`` makes every allocation the trace
holds movable between events (:class:`TraceRelocator`: the trace's "Storages" are
never in use while the pool works) and defaults the policy to the server's
(``adaptive``).  ``--capacity-factor F`` sizes the device at F x the trace's peak
allocated (PyTorch's, from its stats file, else a first unlimited replay's).

``--synthetic FAMILY --seed N`` replays a generated trace instead of a file
(:mod:`tensord_server.tools.trace_gen`: the same events for the same family and seed
anywhere); ``--save FILE`` writes the events replayed as a ``.events.json.gz``.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import math
import pickle
import sys
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from tensord.errors import OutOfMemoryError

from tensord_server.data import DEFAULT_TRACE_NAME, bundled_traces, resolve_trace
from tensord_server.devices.memory import BookkeepingBackend, DeviceMemory
from tensord_server.pool import DEFAULT_POLICY, POLICIES, Block, CachingPool, policy_named
from tensord_server.tools.trace_gen import FAMILIES, generate

# One trace event: (action, addr, size, stream), as in the bundled traces.
TraceEvent = tuple[str, int, int, int]

# Suffixes of a trace file name that its PyTorch stats file does not share.
TRACE_SUFFIXES = (".events.json.gz", ".json.gz", ".json", ".pickle", ".pkl")

# Space left between the highest recorded segment and the first fresh fake address.
RECORDED_ADDRESS_GAP = 1 << 30

# The figures compared with PyTorch's, in the order they are printed.
COMPARED_KEYS = (
    "allocated_bytes.all.peak",
    "reserved_bytes.all.peak",
    "inactive_split_bytes.all.peak",
    "segment.all.peak",
    "num_device_alloc",
    "num_alloc_retries",
    "num_ooms",
)

# The compaction figures the --json object adds.
COMPACTION_KEYS = ("num_compactions", "compaction_moved_bytes", "compaction_released_bytes")

# Seconds of replay between progress lines on stderr (--progress-interval's default): a
# replay shorter than this prints none.
DEFAULT_PROGRESS_INTERVAL_S = 5.0
# Events replayed between two looks at the clock, when progress is reported.
PROGRESS_CHUNK = 16384


# ---------------------------------------------------------------------------
# Loading


def events_from_snapshot(snapshot: Any) -> list[TraceEvent]:
    """The events of a ``_snapshot()`` dict (device 0) or of a bare list of trace dicts."""
    if isinstance(snapshot, dict):
        traces = snapshot.get("device_traces") or [[]]
        if not traces[0]:
            raise ValueError(
                "the snapshot has no device trace: record one before taking it, with "
                "torch.cuda.memory._record_memory_history() in PyTorch or "
                "tensord serve --record-history for a tensord snapshot"
            )
        entries = traces[0]
    else:
        entries = snapshot
    return [
        (
            entry["action"],
            int(entry.get("addr", 0)),
            int(entry["size"]),
            int(entry.get("stream", 0)),
        )
        for entry in entries
    ]


# The first byte of a pickle of protocol 2 or later (torch's and tensord snapshot's).
PICKLE_PROTO = b"\x80"
# The first two bytes of a gzip file.
GZIP_MAGIC = b"\x1f\x8b"


def load_trace(path: str | Path) -> list[TraceEvent]:
    """Read a pickled ``_snapshot()`` (``tensord snapshot``'s and torch's files, whatever
    their name) or a ``.events.json.gz`` / ``.json`` list; the content tells which."""
    path = Path(path)
    with path.open("rb") as handle:
        start = handle.read(2)
    if start[:1] == PICKLE_PROTO:
        with path.open("rb") as handle:
            # Only open pickles you trust: this is the format torch itself writes.
            return events_from_snapshot(pickle.load(handle))
    opener = gzip.open if start == GZIP_MAGIC else open
    with opener(path, "rt") as handle:
        data = json.load(handle)
    if isinstance(data, dict) or (data and isinstance(data[0], dict)):
        return events_from_snapshot(data)
    return [(str(a), int(addr), int(size), int(stream)) for a, addr, size, stream in data]


def save_trace(path: str | Path, events: Iterable[TraceEvent]) -> None:
    """Write ``events`` as a gzipped JSON list of ``[action, addr, size, stream]``, the
    format :func:`load_trace` reads (and the bundled traces have)."""
    with gzip.open(path, "wt") as handle:
        json.dump([list(event) for event in events], handle)


def trace_stem(path: str | Path) -> str:
    """``resnet50_train`` for ``resnet50_train.events.json.gz``."""
    name = Path(path).name
    for suffix in TRACE_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def load_pytorch_stats(path: str | Path, variant: str = "") -> dict[str, Any] | None:
    """PyTorch's own figures for the trace (``<stem>.pytorch[_variant]_stats.json``), if beside it."""
    suffix = f".pytorch_{variant}_stats.json" if variant else ".pytorch_stats.json"
    stats_path = Path(path).with_name(trace_stem(path) + suffix)
    if not stats_path.exists():
        return None
    result: dict[str, Any] = json.loads(stats_path.read_text())
    return result


# ---------------------------------------------------------------------------
# Replaying


class RecordedAddressBackend(BookkeepingBackend):
    """Bookkeeping, but a new segment takes the next address the trace recorded for its size.

    Invariant: a recorded address is handed out at most once while reserved;
    released ones go back to the front of their size's queue (CUDA reuses them).
    """

    def __init__(self, segments: Iterable[tuple[int, int]], *, total_bytes: int | None = None):
        super().__init__(device="sim", total_bytes=total_bytes)
        self._recorded: defaultdict[int, deque[int]] = defaultdict(deque)  # size -> free addresses
        self._recorded_addresses: set[int] = set()  # every address the trace recorded
        for address, size in segments:
            self._recorded[size].append(address)
            self._recorded_addresses.add(address)
            # Fresh fake addresses start above every recorded one, so the two never overlap.
            self._next_address = max(self._next_address, address + size + RECORDED_ADDRESS_GAP)

    def reserve(self, nbytes: int) -> DeviceMemory:
        memory = super().reserve(nbytes)  # the capacity accounting and a fresh address
        queue = self._recorded.get(nbytes)
        if not queue:
            return memory
        return DeviceMemory(address=queue.popleft(), nbytes=nbytes)

    def release(self, memory: DeviceMemory) -> None:
        super().release(memory)
        if memory.address in self._recorded_addresses:
            self._recorded[memory.nbytes].appendleft(memory.address)


class TraceRelocator:
    """Compaction's view of a replay: every live allocation may move between events.

    ``live`` maps a trace address to the block serving it now; a move repoints it.
    """

    def __init__(self) -> None:
        self.live: dict[int, Block] = {}

    @contextmanager
    def relocation(self, pool: CachingPool) -> Iterator[Mapping[Block, Callable[[Block], None]]]:
        # a repointer made only for a block that moves: making one for every live block on
        # each compaction was a good part of a replay's time
        yield Repointers({block: addr for addr, block in self.live.items()}, self.live)

    def claim(self, block: Block) -> object:
        """The trace address ``block`` serves (a replay holds nothing: only the owner counts);
        a replay compacts on its own calls, so only a move outside the locks asks."""
        return next((address for address, live in self.live.items() if live is block), None)


class Repointers(Mapping[Block, Callable[[Block], None]]):
    """Each live block, with the call that makes its trace address name the block it moved to."""

    def __init__(self, addresses: dict[Block, int], live: dict[int, Block]) -> None:
        self._addresses = addresses  # block -> its trace address, when the world stopped
        self._live = live

    def __getitem__(self, block: Block) -> Callable[[Block], None]:
        return functools.partial(self._live.__setitem__, self._addresses[block])

    def __contains__(self, block: object) -> bool:
        return block in self._addresses

    def __iter__(self) -> Iterator[Block]:
        return iter(self._addresses)

    def __len__(self) -> int:
        return len(self._addresses)


@dataclass(frozen=True)
class ReplayResult:
    """What one replay measured.  Invariant: ``events > 0`` implies ``seconds > 0``."""

    events: int  # trace events walked
    seconds: float  # wall time of the replay loop alone (loading excluded)
    stats: dict[str, int | float]  # the pool's memory_stats() at the end
    unmatched_frees: (
        int  # free_completed of blocks allocated before the trace began (or that OOMed)
    )
    failed_allocs: int  # allocations that raised OutOfMemoryError
    policy: str = "pytorch"  # the pool policy's name
    compaction: bool = False  # whether allocations could move
    # the first allocation that raised OutOfMemoryError: its trace address, bytes and the
    # error's message (None: none did)
    first_oom: tuple[int, int, str] | None = None

    @property
    def peak_allocated_bytes(self) -> int:
        return int(self.stats["allocated_bytes.all.peak"])

    @property
    def peak_reserved_bytes(self) -> int:
        return int(self.stats["reserved_bytes.all.peak"])

    @property
    def reserved_over_allocated(self) -> float:
        return ratio(self.peak_reserved_bytes, self.peak_allocated_bytes)

    @property
    def events_per_second(self) -> float:
        return self.events / self.seconds if self.seconds > 0 else float("inf")


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else 0.0


class ProgressLines:
    """A replay's progress on a stream (stderr): a line every ``interval`` seconds of it,
    none before, so a short replay prints nothing."""

    def __init__(
        self, total: int, interval: float, label: str = "", stream: TextIO | None = None
    ) -> None:
        self.total, self.interval, self.label = total, interval, label
        self.stream = sys.stderr if stream is None else stream
        self.start = time.monotonic()
        self._next = self.start + interval

    def __call__(self, done: int) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.interval
        rate = done / (now - self.start)
        left = (self.total - done) / rate if rate > 0 else math.inf
        print(
            f"tensord replay: {self.label}{done:,} of {self.total:,} events "
            f"({100 * done / self.total:.0f} %), {rate:,.0f} events/s, about {left:,.0f} s left",
            file=self.stream,
            flush=True,
        )


def replay(
    events: Sequence[TraceEvent],
    *,
    capacity: int | None = None,
    max_split_size: int | None = None,
    recorded_addresses: bool = True,
    policy: str = "pytorch",
    compaction: bool = False,
    progress: Callable[[int], None] | None = None,
) -> ReplayResult:
    """Run ``events`` through a fresh pool on a bookkeeping backend, under ``policy``;
    with ``compaction`` every live allocation may move between events.  ``progress``, if
    given, is called with the events done after every ``PROGRESS_CHUNK`` of them."""
    if recorded_addresses:
        segments = [(addr, size) for action, addr, size, _ in events if action == "segment_alloc"]
        backend: BookkeepingBackend = RecordedAddressBackend(segments, total_bytes=capacity)
    else:
        backend = BookkeepingBackend(total_bytes=capacity)
    relocator = TraceRelocator()
    pool = CachingPool(
        backend,
        capacity=capacity,
        max_split_size=max_split_size,
        policy=policy_named(policy),
        relocator=relocator if compaction else None,
    )
    live = relocator.live  # trace address -> our Block (compaction repoints it)
    unmatched = failed = 0
    first_oom: tuple[int, int, str] | None = None
    malloc, free = pool.malloc, pool.free
    # a look at the clock every PROGRESS_CHUNK events when progress is reported, else none
    pieces: Iterable[Sequence[TraceEvent]] = (
        (events,)
        if progress is None
        else (events[i : i + PROGRESS_CHUNK] for i in range(0, len(events), PROGRESS_CHUNK))
    )
    done = 0
    start = time.perf_counter()
    for piece in pieces:
        for action, addr, size, stream in piece:
            if action == "alloc":
                try:
                    live[addr] = malloc(size, stream)
                except OutOfMemoryError as exc:
                    failed += 1
                    if first_oom is None:
                        first_oom = (addr, size, str(exc))
            elif action == "free_completed":
                block = live.pop(addr, None)
                if block is None:
                    unmatched += 1
                else:
                    free(block)
        done += len(piece)
        if progress is not None:
            progress(done)
    seconds = time.perf_counter() - start
    stats = pool.memory_stats()
    return ReplayResult(
        len(events), seconds, stats, unmatched, failed, policy, compaction, first_oom
    )


def peak_allocated(
    path: str | Path, events: Sequence[TraceEvent], progress: Callable[[int], None] | None = None
) -> int:
    """The trace's peak allocated: PyTorch's figure when its stats file is beside the
    trace, else an unlimited replay's (the same, as the replay follows PyTorch's rules)."""
    pytorch = load_pytorch_stats(path)
    if pytorch is not None and "allocated_bytes.all.peak" in pytorch:
        return int(pytorch["allocated_bytes.all.peak"])
    return replay(events, progress=progress).peak_allocated_bytes


# ---------------------------------------------------------------------------
# Reporting


def summary(result: ReplayResult, pytorch: dict[str, Any] | None) -> dict[str, Any]:
    """The ``--json`` object."""
    stats = result.stats
    report: dict[str, Any] = {
        "peak_allocated_bytes": result.peak_allocated_bytes,
        "peak_reserved_bytes": result.peak_reserved_bytes,
        "reserved_over_allocated": result.reserved_over_allocated,
        "peak_inactive_split_bytes": int(stats["inactive_split_bytes.all.peak"]),
        "peak_segments": int(stats["segment.all.peak"]),
        "num_device_alloc": int(stats["num_device_alloc"]),
        "num_alloc_retries": int(stats["num_alloc_retries"]),
        "num_ooms": int(stats["num_ooms"]),
        "policy": result.policy,
        "compaction": result.compaction,
        **{key: int(stats[key]) for key in COMPACTION_KEYS},
        "compaction_moved_per_allocated": ratio(
            int(stats["compaction_moved_bytes"]), int(stats["allocated_bytes.all.allocated"])
        ),
        "unmatched_frees": result.unmatched_frees,
        # the first allocation that ran out of memory, or None
        "first_oom": (
            None
            if result.first_oom is None
            else dict(zip(("addr", "size", "message"), result.first_oom, strict=True))
        ),
        "events": result.events,
        "seconds": result.seconds,
        "events_per_second": result.events_per_second,
        "memory_stats": stats,
    }
    if pytorch is not None:
        report["pytorch"] = {key: pytorch[key] for key in COMPARED_KEYS if key in pytorch}
        report["pytorch"]["reserved_over_allocated"] = ratio(
            pytorch["reserved_bytes.all.peak"], pytorch["allocated_bytes.all.peak"]
        )
    return report


def format_table(result: ReplayResult, pytorch: dict[str, Any] | None) -> str:
    """A plain table: our figure, and PyTorch's beside it when known."""
    stats = result.stats
    rows: list[tuple[str, str, str]] = []
    for key in COMPARED_KEYS:
        theirs = f"{pytorch[key]:,}" if pytorch and key in pytorch else "-"
        rows.append((key, f"{int(stats[key]):,}", theirs))
    theirs_ratio = (
        f"{ratio(pytorch['reserved_bytes.all.peak'], pytorch['allocated_bytes.all.peak']):.4f}"
        if pytorch
        else "-"
    )
    rows.append(
        ("reserved / allocated (peaks)", f"{result.reserved_over_allocated:.4f}", theirs_ratio)
    )
    lines = [f"{'figure':<32} {'tensord':>18} {'pytorch':>18}"]
    lines += [f"{name:<32} {ours:>18} {theirs:>18}" for name, ours, theirs in rows]
    lines.append(
        f"{result.events:,} events in {result.seconds:.3f} s: "
        f"{result.events_per_second:,.0f} events/s; {result.unmatched_frees} unmatched frees"
    )
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# Command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "trace",
        nargs="?",
        default=DEFAULT_TRACE_NAME,
        help="a .events.json.gz trace, a pickled torch.cuda.memory._snapshot() (a 'tensord "
        "snapshot' file is one), or the name of a bundled trace (see --list; default "
        f"{DEFAULT_TRACE_NAME}); a file wins over a name",
    )
    parser.add_argument("--list", action="store_true", help="list the bundled traces and exit")
    parser.add_argument(
        "--synthetic",
        choices=sorted(FAMILIES),
        default=None,
        metavar="FAMILY",
        help="replay a generated trace of FAMILY instead of a file (one of "
        f"{', '.join(sorted(FAMILIES))})",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="the generated trace's seed (--synthetic; default 0)"
    )
    parser.add_argument(
        "--save",
        type=Path,
        default=None,
        metavar="FILE",
        help="also write the events replayed to FILE, a gzipped JSON list any replay reads",
    )
    capacity = parser.add_mutually_exclusive_group()
    capacity.add_argument("--capacity", type=int, default=None, help="device capacity in bytes")
    capacity.add_argument(
        "--capacity-factor",
        type=float,
        default=None,
        metavar="F",
        help="device capacity as F x the trace's peak allocated (e.g. 1.01)",
    )
    parser.add_argument(
        "--policy",
        choices=sorted(POLICIES),
        default=None,
        help="what the pool does beyond PyTorch's rules (default: pytorch, or "
        f"{DEFAULT_POLICY} with --compaction)",
    )
    parser.add_argument(
        "--compaction",
        action="store_true",
        help="every allocation the trace holds may move between events (as unheld Storages)",
    )
    parser.add_argument("--max-split-size", type=int, default=None, help="max_split_size in bytes")
    parser.add_argument(
        "--fresh-addresses",
        action="store_true",
        help="give segments fresh increasing addresses instead of the recorded ones",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--progress-interval",
        type=float,
        default=DEFAULT_PROGRESS_INTERVAL_S,
        metavar="SECONDS",
        help="a long replay prints a line to stderr every SECONDS while it runs (events done, "
        "percent, events/s, time left), so one shorter than SECONDS prints none; the result "
        f"still goes alone to stdout (default {DEFAULT_PROGRESS_INTERVAL_S:g}; 0: no progress)",
    )


def run(args: argparse.Namespace) -> int:
    if args.list:
        for name in bundled_traces():
            print(name)
        return 0
    path: Path | None = None
    if args.synthetic is not None:
        events = generate(args.synthetic, args.seed)
    else:
        try:
            path = resolve_trace(args.trace)
            events = load_trace(path)
        except (OSError, ValueError, KeyError, pickle.UnpicklingError) as exc:
            print(f"tensord replay: cannot read {args.trace}: {exc}", file=sys.stderr)
            return 2
    if args.save is not None:
        try:
            save_trace(args.save, events)
        except OSError as exc:
            print(f"tensord replay: cannot write {args.save}: {exc}", file=sys.stderr)
            return 2

    def progress(label: str = "") -> ProgressLines | None:
        if args.progress_interval <= 0 or not events:
            return None
        return ProgressLines(len(events), args.progress_interval, label)

    capacity = args.capacity
    if args.capacity_factor is not None:
        if not args.capacity_factor > 0:
            print("tensord replay: --capacity-factor must be > 0", file=sys.stderr)
            return 2
        sizing = progress("finding the peak allocated: ")
        peak = (
            replay(events, progress=sizing).peak_allocated_bytes
            if path is None
            else peak_allocated(path, events, sizing)
        )
        capacity = int(args.capacity_factor * peak)
    policy = args.policy or (DEFAULT_POLICY if args.compaction else "pytorch")
    result = replay(
        events,
        capacity=capacity,
        max_split_size=args.max_split_size,
        recorded_addresses=not args.fresh_addresses,
        policy=policy,
        compaction=args.compaction,
        progress=progress(),
    )
    pytorch = None if path is None else load_pytorch_stats(path)
    if args.json:
        print(json.dumps(summary(result, pytorch)))
    else:
        print(format_table(result, pytorch))
    return 0
