"""A cost fuzz: small requests that ask for large work, against `tensord serve` in a subprocess.

Each request is a few hundred bytes at most, yet names huge work: expands and as_strided
views of astronomical logical size (stride 0, overlapping strides) fed to fill_, copy_,
setitem, clone, contiguous, to, repeat, cat, stack, download and reshape; split, chunk
and unbind with huge counts; indexes of many None/Ellipsis; aranges and factories of huge
sizes; repeats of huge repeats; uploads declaring huge byte counts; view chains that grow
dims; many handles.  The server must refuse or finish each one within the documented
limits (SECURITY.md, "Limits and their defaults"), so over the run:

* the largest growth of the server's memory outside the pool (its RSS less the pool's
  resident bytes, above the level after warm-up) stays under OUTSIDE_POOL_BOUND_BYTES;
* the slowest single request (client-side wall time) stays under SLOWEST_REQUEST_BOUND_S;
* no request ends INTERNAL/UNKNOWN (a cost the server did not foresee).

The server's memory is read per mapping from /proc/PID/smaps, in one pass: a mapping that
lies in a pool segment (one the server's MemorySnapshot names just before or just after
that pass) is the pool's, every other mapping's resident bytes are outside it.  The
pool's reserved bytes are not all resident (a segment is rounded up, an `empty` is
never written), so RSS less `reserved_bytes` would hide real growth; and a segment the
pool made while a sample was taken is the pool's in either snapshot, never "outside"
(RSS read apart from the pool's pages counted it outside: a flake), while a released
segment that stays mapped (a real leak) is in neither, so it counts outside.

`TENSORD_COST_FUZZ_SECONDS` (default 12, the CI setting; 300 for the long run) and
`TENSORD_COST_FUZZ_SEED` (default a fixed seed; `random` for a new one, printed with the
figures under `pytest -s`).
"""

from __future__ import annotations

import bisect
import gc
import json
import math
import os
import random
import secrets
import sys
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import SessionStub, open_channel, start_serve_process
from tensord import schema as pb
from tensord_server.devices.memory import HostBackend
from tensord_server.devices.shm import create_segment
from tensord_server.domain import limits
from tensord_server.domain.store import TensorStore
from tensord_server.pool import CachingPool

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc/PID/status and /proc/PID/pagemap"
)

COST_FUZZ_SECONDS = float(os.environ.get("TENSORD_COST_FUZZ_SECONDS", "12"))
DEFAULT_SEED = 20240611
_seed_setting = os.environ.get("TENSORD_COST_FUZZ_SEED", str(DEFAULT_SEED))
SEED = secrets.randbits(32) if _seed_setting == "random" else int(_seed_setting)

# The server under test.  A small pool, and --max-op-elements well below the default
# (2**32) so that the largest op the limit allows stays about a second on a loaded
# 2-core CI machine; the bounds below scale with these figures.
POOL_BYTES = 256 << 20
MAX_OP_ELEMENTS = 1 << 24
MAX_HANDLES = 20_000
MAX_NAMES = 64
SERVE_ARGS = (
    "--address", "127.0.0.1:0",
    "--device", f"cpu={POOL_BYTES}",
    "--max-op-elements", str(MAX_OP_ELEMENTS),
    "--max-handles-per-session", str(MAX_HANDLES),
    "--max-names-per-tenant", str(MAX_NAMES),
    "--lease", "600", "--session-grace", "600",
)  # fmt: skip

# Memory outside the pool one request may add (SECURITY.md, "How it is tested"):
# a download's gather holds a few chunks of at most 16 MiB (server.MAX_CHUNK_BYTES) plus
# gRPC's copies of the message in flight: 6 chunks; a handle costs the session table under
# 1 KiB, and --max-handles-per-session bounds them; a ViewResponse of the most views one
# op returns, its protobuf objects included; a copy through overlapping memory takes a
# temporary of its destination, which lives in the pool (so at most the pool's size, and
# only for copies whose source overlaps it, which the fuzzer does not build: see the
# docstring of _copy_through_overlap); and some slack for the interpreter's arenas.
HANDLE_BYTES = 1024
OUTSIDE_POOL_BOUND_BYTES = (
    6 * (16 << 20) + MAX_HANDLES * HANDLE_BYTES + 64 * limits.MAX_DIMS * 1024 + (48 << 20)
)
# The slowest request: the most elements an op may touch at a slow cast's 300 ns each
# (float16 casts measured ~210 ns on a loaded 2-core machine; a plain copy is a few ns),
# plus a Cat/Stack of the most inputs a list may name at ~100 us of bookkeeping each
# (pinning, promoting, one small kernel each), plus 5 s of scheduling noise.  An
# unbounded fill of an expanded view took hours.
SLOWEST_REQUEST_BOUND_S = MAX_OP_ELEMENTS * 300e-9 + limits.MAX_LIST_LEN * 100e-6 + 5.0
CALL_TIMEOUT_S = 120.0  # far above the bound: a call that hits it failed the bound anyway
BUG_CODES = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
SAMPLE_INTERVAL_S = 0.02

DTYPES = (
    "float32", "float64", "int8", "uint8", "int64", "bool", "complex64", "complex128",
    "bfloat16", "float16",
)  # fmt: skip
BIG = (1 << 10, 1 << 16, 1 << 20, 1 << 24, 1 << 26, 1 << 32, 1 << 40, 1 << 47, 1 << 48)


# -- measuring the server ---------------------------------------------------------------


def mapped_resident(pid: int) -> list[tuple[int, int, int]]:
    """Every mapping of the process as (start, end, resident bytes), from one read of
    /proc/PID/smaps (each mapping's figure is the kernel's, at the moment it was read)."""
    mappings: list[tuple[int, int, int]] = []
    start = end = 0
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):  # a mapping's header line
                low, high = head.split("-")
                start, end = int(low, 16), int(high, 16)
            elif head == "Rss:":
                mappings.append((start, end, int(line.split()[1]) * 1024))
    return mappings


def outside_pool_bytes(
    mappings: list[tuple[int, int, int]], segments: list[tuple[int, int]]
) -> tuple[int, int]:
    """(resident bytes outside the pool, all resident bytes): a mapping inside one of the
    pool's segments is the pool's, any other is outside it."""
    pool_ranges = sorted((address, address + size) for address, size in segments)
    starts = [low for low, _ in pool_ranges]
    outside = total = 0
    for start, end, rss in mappings:
        total += rss
        i = bisect.bisect_right(starts, start) - 1
        if i < 0 or end > pool_ranges[i][1]:
            outside += rss
    return outside, total


@dataclass
class Sampler:
    """Samples the server's resident bytes outside the pool every few ms, in a thread.

    The pool's segments are read before and after one pass over the server's mappings:
    a segment made meanwhile is the pool's (it is in the second list), one released
    meanwhile too (in the first), and only memory that was never a live segment during
    the pass counts outside the pool."""

    pid: int
    monitor: SessionStub
    samples: int = 0
    peak: int = 0
    peak_rss: int = 0
    current: str = ""  # the request in flight (set by the fuzzing loop)
    peak_during: str = ""
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def segments(self) -> list[tuple[int, int]]:
        found: dict[int, int] = {}  # a segment cut between pages is on both
        token = ""
        while True:
            page = self.monitor.MemorySnapshot(
                pb.MemorySnapshotRequest(device="cpu", page_token=token),
                metadata=self.monitor.md,
                timeout=CALL_TIMEOUT_S,
            )
            for s in json.loads(page.snapshot_json)["segments"]:
                found[int(s["address"])] = int(s["total_size"])
            token = page.next_page_token
            if not token:
                return sorted(found.items())

    def outside_pool(self) -> tuple[int, int]:
        before = self.segments()
        mappings = mapped_resident(self.pid)
        return outside_pool_bytes(mappings, before + self.segments())

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_INTERVAL_S):
            outside, rss = self.outside_pool()
            self.samples += 1
            if outside > self.peak:
                self.peak, self.peak_rss, self.peak_during = outside, rss, self.current

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)


# -- the requests -----------------------------------------------------------------------


def scalar(rng: random.Random) -> pb.Scalar:
    return rng.choice(
        (
            pb.Scalar(float_value=rng.choice((0.5, -2.0, float("nan"), 1e300))),
            pb.Scalar(int_value=rng.choice((0, 1, -1, 7))),
            pb.Scalar(bool_value=True),
            pb.Scalar(complex_value=pb.Complex(real=1.0, imag=rng.choice((0.0, 2.0)))),
        )
    )


class CostFuzzer:
    """Random small requests, each naming large work, over raw gRPC."""

    def __init__(self, rng: random.Random, stub: SessionStub) -> None:
        self.rng = rng
        self.stub = stub
        self.bases: list[pb.TensorMeta] = []  # small tensors the views are made over
        self.views: list[pb.TensorMeta] = []  # huge views (metadata only)
        self.made: list[str] = []  # handles of op results, released in batches
        for dtype, n in (("float32", 1), ("float32", 1024), ("int8", 4096), ("complex128", 64)):
            array = np.arange(n).astype({"complex128": np.complex128}.get(dtype, dtype))
            self.bases.append(stub.upload(array))
        self.bases.append(
            stub.Empty(pb.EmptyRequest(shape=[1024], dtype="bfloat16"), metadata=stub.md)
        )

    # each op returns (description, call); the call's result may carry new handles

    def huge_view(self) -> tuple[str, Callable[[], Any]]:
        rng, base = self.rng, self.rng.choice(self.bases)
        n = base.shape[0]
        if rng.random() < 0.5:  # stride 0: any logical size over one element
            dims = rng.randint(1, 6)
            size = [rng.choice(BIG) for _ in range(dims)]
            while math.prod(size) > limits.MAX_NUMEL:
                size[rng.randrange(dims)] = rng.choice((1, 2, 1 << 8, 1 << 16))
            op = pb.ViewRequest(
                handle=base.handle, as_strided=pb.AsStrided(size=size, stride=[0] * dims)
            )
        else:  # overlapping strides: a lattice of k**dims elements over dims*k of them
            dims = rng.randint(2, 6)
            k = max(1, (n - 1) // dims + 1)
            size = [k] * dims
            stride = [rng.choice((0, 1)) for _ in range(dims)]
            op = pb.ViewRequest(
                handle=base.handle, as_strided=pb.AsStrided(size=size, stride=stride)
            )
        return f"as_strided({list(op.as_strided.size)}, {list(op.as_strided.stride)})", (
            lambda: self._keep_views(self.stub.View(op, metadata=self.stub.md))
        )

    def expand(self) -> tuple[str, Callable[[], Any]]:
        rng = self.rng
        one = self.bases[0]
        shape = [rng.choice(BIG) for _ in range(rng.randint(1, 5))]
        op = pb.ViewRequest(handle=one.handle, expand=pb.Expand(shape=shape))
        return f"expand({shape})", lambda: self._keep_views(
            self.stub.View(op, metadata=self.stub.md)
        )

    def _keep_views(self, response: pb.ViewResponse) -> pb.ViewResponse:
        for meta in response.tensors[:2]:
            self.views.append(meta)
        if len(self.views) > 48:
            dropped, self.views = self.views[:16], self.views[16:]
            self.made.extend(m.handle for m in dropped)
        self.made.extend(m.handle for m in response.tensors[2:])
        return response

    def _target(self) -> pb.TensorMeta:
        pool = self.views if self.views and self.rng.random() < 0.85 else self.bases
        return self.rng.choice(pool)

    def consume(self) -> tuple[str, Callable[[], Any]]:
        """One op that reads or writes every element of a (usually huge) view."""
        rng, stub, x = self.rng, self.stub, self._target()
        md = stub.md
        name = rng.choice(
            ("fill", "copy", "copy_into_lattice", "setitem", "setitem_src", "clone",
             "contiguous", "to", "repeat", "cat", "stack", "download", "reshape", "flatten")
        )  # fmt: skip
        src = rng.choice(self.bases[:1] + self.views[:4])
        calls: dict[str, Callable[[], Any]] = {
            "fill": lambda: stub.Fill(
                pb.FillRequest(handle=x.handle, value=scalar(rng)), metadata=md
            ),
            "copy": lambda: stub.Copy(pb.CopyRequest(dst=x.handle, src=src.handle), metadata=md),
            "copy_into_lattice": lambda: stub.Copy(
                pb.CopyRequest(dst=x.handle, src=self.bases[0].handle), metadata=md
            ),
            "setitem": lambda: stub.SetItem(
                pb.SetItemRequest(
                    handle=x.handle, index=[pb.IndexItem(ellipsis=True)], scalar=scalar(rng)
                ),
                metadata=md,
            ),
            "setitem_src": lambda: stub.SetItem(
                pb.SetItemRequest(
                    handle=x.handle, index=[pb.IndexItem(ellipsis=True)], src_handle=src.handle
                ),
                metadata=md,
            ),
            "clone": lambda: stub.Clone(pb.CloneRequest(handle=x.handle), metadata=md),
            "contiguous": lambda: stub.Contiguous(pb.HandleRequest(handle=x.handle), metadata=md),
            "to": lambda: stub.To(
                pb.ToRequest(handle=x.handle, dtype=rng.choice(DTYPES), copy=True), metadata=md
            ),
            "repeat": lambda: stub.Repeat(
                pb.RepeatRequest(
                    handle=x.handle,
                    repeats=[rng.choice((1, 2, 1 << 12, 1 << 30))]
                    * (len(x.shape) + rng.randint(0, 2)),
                ),
                metadata=md,
            ),
            "cat": lambda: stub.Cat(
                pb.CatRequest(handles=[x.handle] * rng.choice((2, 64, 4096, 65536))), metadata=md
            ),
            "stack": lambda: stub.Stack(
                pb.CatRequest(handles=[x.handle] * rng.choice((2, 64, 4096))), metadata=md
            ),
            "download": lambda: sum(
                len(chunk)  # raw bytes on the wire (service.py), not RawChunk messages
                for chunk in stub.channel.unary_stream(
                    "/tensord.v1.Tensord/Download",
                    request_serializer=pb.DownloadRequest.SerializeToString,
                )(
                    pb.DownloadRequest(
                        handle=x.handle, chunk_bytes=rng.choice((0, 4096, 16 << 20, 1 << 40))
                    ),
                    metadata=md,
                    timeout=CALL_TIMEOUT_S,
                )
            ),
            "reshape": lambda: stub.Reshape(
                pb.ReshapeRequest(handle=x.handle, shape=[-1]), metadata=md
            ),
            "flatten": lambda: stub.View(
                pb.ViewRequest(handle=x.handle, flatten=pb.Flatten(start_dim=0, end_dim=-1)),
                metadata=md,
            ),
        }
        return f"{name}({list(x.shape)}, {list(x.stride)}, {x.dtype})", calls[name]

    def many_views(self) -> tuple[str, Callable[[], Any]]:
        """split/chunk/unbind with huge counts (the limit, the session's room, or fine)."""
        rng, stub = self.rng, self.stub
        n = rng.choice((100, 5000, 19_000, 65_536, 65_537, 1 << 20, 1 << 40))
        which = rng.choice(("unbind", "split", "chunk"))
        op = {
            "unbind": {"unbind": pb.Unbind(dim=0)},
            "split": {"split": pb.Split(split_size=1, dim=0)},
            "chunk": {"chunk": pb.Chunk(chunks=n, dim=0)},
        }[which]

        def call() -> Any:
            x = stub.View(
                pb.ViewRequest(handle=self.bases[0].handle, expand=pb.Expand(shape=[n, 2])),
                metadata=stub.md,
            ).tensors[0]
            self.made.append(x.handle)
            response = stub.View(pb.ViewRequest(handle=x.handle, **op), metadata=stub.md)
            self.made.extend(m.handle for m in response.tensors)
            return response

        return f"{which}(expand([{n}, 2]))", call

    def index(self) -> tuple[str, Callable[[], Any]]:
        rng, x = self.rng, self._target()
        count = rng.choice((10, 63, 64, 1000, limits.MAX_LIST_LEN))
        kind = rng.choice(("none", "ellipsis", "mixed"))
        items = [
            pb.IndexItem(none=True)
            if kind == "none" or (kind == "mixed" and i % 2)
            else pb.IndexItem(ellipsis=True)
            for i in range(count)
        ]
        request = pb.ViewRequest(handle=x.handle, index=pb.Index(items=items))
        return f"index({count} x {kind})", lambda: self._keep_views(
            self.stub.View(request, metadata=self.stub.md)
        )

    def grow_dims(self) -> tuple[str, Callable[[], Any]]:
        """A chain of unsqueezes and unflattens, each on the last result, past MAX_DIMS."""
        stub, rng = self.stub, self.rng

        def call() -> None:
            x = self._target()
            for _ in range(limits.MAX_DIMS + 2):
                if rng.random() < 0.5:
                    op = pb.ViewRequest(handle=x.handle, unsqueeze=pb.Unsqueeze(dim=0))
                else:
                    op = pb.ViewRequest(
                        handle=x.handle, unflatten=pb.Unflatten(dim=0, sizes=[1, -1])
                    )
                x = stub.View(op, metadata=stub.md).tensors[0]
                self.made.append(x.handle)

        return "unsqueeze/unflatten chain", call

    def factory(self) -> tuple[str, Callable[[], Any]]:
        rng, stub, md = self.rng, self.stub, self.stub.md
        dtype = rng.choice(DTYPES)
        shape = [rng.choice((*BIG, 0, 1, 3)) for _ in range(rng.randint(1, 3))]
        kind = rng.choice(("empty", "empty_strided", "full", "arange"))
        if kind == "empty":
            request: Any = pb.EmptyRequest(shape=shape, dtype=dtype)
            return f"empty({shape}, {dtype})", lambda: stub.Empty(request, metadata=md)
        if kind == "empty_strided":
            request = pb.EmptyRequest(
                shape=shape, stride=pb.IntList(values=[0] * len(shape)), dtype=dtype
            )
            return f"empty_strided({shape}, 0s)", lambda: stub.Empty(request, metadata=md)
        if kind == "full":
            request = pb.FullRequest(shape=shape, value=scalar(rng), dtype=dtype)
            return f"full({shape}, {dtype})", lambda: stub.Full(request, metadata=md)
        end = rng.choice((*BIG, 1 << 28, 1 << 62))
        step = rng.choice((1, 1, 3, 0.5, 1e-300))
        step_scalar = (
            pb.Scalar(int_value=step) if isinstance(step, int) else pb.Scalar(float_value=step)
        )
        request = pb.ArangeRequest(
            start=pb.Scalar(int_value=0),
            end=pb.Scalar(int_value=end),
            step=step_scalar,
            dtype=rng.choice(("", "int8", "float64", "bfloat16", "int64", "float16")),
        )
        return f"arange(0, {end}, {step}, {request.dtype or 'inferred'})", lambda: stub.Arange(
            request, metadata=md
        )

    def upload(self) -> tuple[str, Callable[[], Any]]:
        """A header declaring huge bytes, then a few bytes (or none, or the wrong count)."""
        rng, stub = self.rng, self.stub
        n = rng.choice((1 << 20, 1 << 24, 1 << 26, 1 << 40, 1 << 47))
        nbytes = n * 4 if rng.random() < 0.8 else rng.choice((n, 1 << 62))
        header = pb.UploadHeader(shape=[n], dtype="float32", device="cpu", nbytes=nbytes)
        sent = rng.choice((0, 4096, 1 << 20))

        def chunks() -> Iterator[bytes]:
            for start in range(0, sent, 1 << 16):
                yield bytes(min(1 << 16, sent - start))

        upload = stub.channel.stream_unary(
            "/tensord.v1.Tensord/Upload", response_deserializer=pb.TensorMeta.FromString
        )
        md = (*stub.md, ("tensord-upload-bin", header.SerializeToString()))
        return f"upload(declared {nbytes} B, sent {sent} B)", lambda: upload(
            chunks(), metadata=md, timeout=CALL_TIMEOUT_S
        )

    def names(self) -> tuple[str, Callable[[], Any]]:
        stub, x = self.stub, self._target()
        name = f"cost-{self.rng.randrange(4 * MAX_NAMES)}-" + "n" * 3000
        request = pb.PutNameRequest(name=name, handle=x.handle, overwrite=True)
        return "put_name(3 KB name)", lambda: stub.PutName(request, metadata=stub.md)

    def next_request(self) -> tuple[str, Callable[[], Any]]:
        kinds = (
            (self.huge_view, 3), (self.expand, 2), (self.consume, 10), (self.many_views, 1),
            (self.index, 1), (self.grow_dims, 1), (self.factory, 3), (self.upload, 1),
            (self.names, 1),
        )  # fmt: skip
        make = self.rng.choices([k for k, _ in kinds], weights=[w for _, w in kinds])[0]
        return make()

    def remember(self, result: Any) -> None:
        """Op results are released in batches, so the pool and the session never fill up."""
        kept = {m.handle for m in (*self.bases, *self.views)}
        if isinstance(result, pb.TensorMeta) and result.handle and result.handle not in kept:
            self.made.append(result.handle)  # fill_, copy_ and setitem answer their target
        if len(self.made) > 256 or (self.made and self.rng.random() < 0.2):
            for start in range(0, len(self.made), limits.MAX_LIST_LEN):
                batch = self.made[start : start + limits.MAX_LIST_LEN]
                self.stub.Release(pb.ReleaseRequest(handles=batch), metadata=self.stub.md)
            self.made = []


@dataclass
class Slowest:
    seconds: float = 0.0
    what: str = ""


def run_requests(
    fuzzer: CostFuzzer,
    seconds: float,
    outcomes: Counter[str],
    slowest: Slowest,
    bugs: list[str],
    sampler: Sampler,
) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        what, call = fuzzer.next_request()
        sampler.current = f"{what} (after {sampler.current.split(' (after')[0]})"
        started = time.monotonic()
        try:
            result = call()
            outcome = "OK"
        except grpc.RpcError as err:
            result, outcome = None, err.code().name
            if err.code() in BUG_CODES:
                bugs.append(f"{what}: {outcome}: {err.details()}")
        elapsed = time.monotonic() - started
        outcomes[outcome] += 1
        if elapsed > slowest.seconds:
            slowest.seconds, slowest.what = elapsed, f"{what} -> {outcome}"
        fuzzer.remember(result)


WARMUP_S = 2.0


@pytest.mark.slow
def test_small_requests_cannot_ask_for_unbounded_work() -> None:
    process, address = start_serve_process(*SERVE_ARGS)
    try:
        with (
            open_channel(address, CALL_TIMEOUT_S) as channel,
            open_channel(address, CALL_TIMEOUT_S) as monitor_channel,
        ):
            stub = SessionStub(channel, "cost-fuzz")
            sampler = Sampler(process.pid, SessionStub(monitor_channel, "monitor"))
            rng = random.Random(SEED)
            fuzzer = CostFuzzer(rng, stub)
            outcomes: Counter[str] = Counter()
            slowest = Slowest()
            bugs: list[str] = []
            # warm-up: every kind of request once or more (imports, worker threads, caches)
            run_requests(fuzzer, WARMUP_S, Counter(), Slowest(), bugs, sampler)
            baseline = min(sampler.outside_pool()[0] for _ in range(5))
            sampler.start()
            run_requests(fuzzer, COST_FUZZ_SECONDS, outcomes, slowest, bugs, sampler)
            sampler.stop()
            final = sampler.outside_pool()[0]
            growth = max(sampler.peak, final) - baseline
            total = sum(outcomes.values())
            print(
                f"\ncost fuzz seed {SEED}: {total} requests in {COST_FUZZ_SECONDS:g} s, outcomes "
                f"{dict(outcomes)}; max growth outside the pool {growth / 2**20:.1f} MiB "
                f"(bound {OUTSIDE_POOL_BOUND_BYTES / 2**20:.0f} MiB; baseline "
                f"{baseline / 2**20:.1f} MiB, {sampler.samples} samples, peak during "
                f"{sampler.peak_during}); slowest request "
                f"{slowest.seconds:.3f} s (bound {SLOWEST_REQUEST_BOUND_S:.1f} s): {slowest.what}"
            )
            assert not bugs, f"seed {SEED}: {sorted(set(b[:200] for b in bugs))[:10]}"
            assert total > 20 and sampler.samples > 5
            assert growth <= OUTSIDE_POOL_BOUND_BYTES, f"seed {SEED}: {growth} bytes"
            assert slowest.seconds <= SLOWEST_REQUEST_BOUND_S, f"seed {SEED}: {slowest}"
            # the server still answers
            stub.ServerInfo(pb.ServerInfoRequest(), timeout=CALL_TIMEOUT_S)
            stub.close()
            sampler.monitor.close()
    finally:
        process.terminate()
        try:
            process.communicate(timeout=30)
        except Exception:
            process.kill()
            process.communicate(timeout=10)


# -- what the cost fuzz found ---------------------------------------------------------


def test_a_released_host_segment_is_freed_at_once() -> None:
    """Found by the cost fuzz: a segment and its head block point at each other, so a
    released host segment (an OOM's release of the cache, empty_cache) stayed resident
    until the cyclic GC ran: 200 MiB outside the pool after one refused arange."""
    pool = CachingPool(HostBackend(total_bytes=64 << 20), capacity=64 << 20)
    block = pool.malloc(8 << 20)
    payload = weakref.ref(block.segment.memory.payload)
    pool.free(block)
    del block
    gc.disable()  # the GC must not be what frees it
    try:
        pool.empty_cache()
        assert payload() is None
        big = pool.malloc(20 << 20)
        payload = weakref.ref(big.segment.memory.payload)
        pool.free(big)
        del big
        with pytest.raises(Exception, match="out of memory"):
            pool.malloc(1 << 40)  # the OOM path releases every cached segment first
        assert payload() is None
    finally:
        gc.enable()


def test_the_measure_splits_pool_segments_from_the_rest_exactly() -> None:
    """The cost fuzz's measure on this process: a touched memfd segment (as the cpu pool
    makes) is the pool's while the segment list names it and outside it once not (a
    released segment still mapped: a leak), and anonymous memory is always outside."""
    segment = create_segment(32 << 20)
    segment.array[:] = 1  # resident
    anonymous = np.ones(16 << 20, dtype=np.uint8)
    listed = [(int(segment.array.ctypes.data), segment.nbytes)]
    mappings = mapped_resident(os.getpid())
    with_segment, total = outside_pool_bytes(mappings, listed)
    without_segment, same_total = outside_pool_bytes(mappings, [])
    assert same_total == total >= (48 << 20)
    assert without_segment - with_segment >= (32 << 20)  # the segment's pages, all of them
    assert with_segment >= anonymous.nbytes  # the NumPy array is never the pool's
    segment.close()


@pytest.mark.parametrize("op", ["arange", "full"])
def test_factories_count_the_elements_they_write(make_server, op: str) -> None:
    """Found by the cost fuzz: arange and full write every element of their result but were
    bounded only by the pool (an arange of 2**26 float16 took 7.5 s)."""
    server: Any = make_server(max_op_elements=1000)
    assert isinstance(server.daemon, TensorStore)
    with open_channel(server.address) as channel:
        stub = SessionStub(channel)
        arange = pb.ArangeRequest(
            start=pb.Scalar(int_value=0), end=pb.Scalar(int_value=1001), dtype="float16"
        )
        full = pb.FullRequest(shape=[7, 143], value=pb.Scalar(float_value=1.0), dtype="float16")
        call = (
            (lambda: stub.Arange(arange, metadata=stub.md))
            if op == "arange"
            else (lambda: stub.Full(full, metadata=stub.md))
        )
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-op-elements 1000" in (info.value.details() or "")
        assert server.daemon.storages.live() == [] or not list(server.daemon.storages.live())
        # at the limit it works
        arange.end.int_value, full.shape[:] = 1000, [8, 125]
        assert stub.download(call()).size == 1000
        stub.close()
