"""The pool's figures on every bundled trace under every policy, pinned to a recorded fixture.

Each bundled trace is replayed through a fresh :class:`CachingPool` under each of
:data:`SCENARIOS`: PyTorch's rules, compaction on the out-of-memory path, the ``adaptive``
policy with and without a relocator, with pinned allocations, with decommitting backends
(4 KiB and 2 MiB pages, a tight segment bound), run as a server runs it (a doorbell, a fake
clock, background compaction steps and idle segments kept and given back), and eager
variants of the thresholds.  The figures of each run (peaks, segments, retries, OOMs,
compaction and decommit counters, fragmentation, and digests of every placement, of
``memory_stats()`` and the snapshot's segments at checkpoints and at the end) must equal those recorded in
``data/pool_figures.json``: a change of the pool's code that is meant to keep its
behaviour keeps every one of them.

A change meant to alter the pool's behaviour records the figures again:
``PYTHONPATH=client:server python tests/pool/test_pool_figures.py`` (and says why in its commit).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from tensord.errors import OutOfMemoryError
from tensord_server.data import bundled_trace, bundled_traces
from tensord_server.devices.memory import DeviceMemory, check_range
from tensord_server.pool import Block, CachingPool, PoolPolicy, policy_named
from tensord_server.tools.replay import (
    RecordedAddressBackend,
    Repointers,
    TraceEvent,
    TraceRelocator,
    load_trace,
    peak_allocated,
)

FIXTURE = Path(__file__).resolve().parent / "data" / "pool_figures.json"

MiB = 1 << 20
PYTORCH = policy_named("pytorch")
OOM_COMPACTION = policy_named("oom-compaction")
ADAPTIVE = policy_named("adaptive")

# the fake clock's step per trace event in a server run: release_idle_s (2 s) is 1000 events
TICK_S = 0.002
# a server run's background compactor: steps (plans) per wake-up, as the real one's
PLANS_PER_WAKE = 8
# ... and whether each step may start its plan's next move, in turn (a server now quiet,
# now with requests waiting)
PROCEED_PATTERN = (True, True, False)
# the trace whose runs (about 1 s together) are not marked slow
FAST_TRACE = "lstm_train"
# a run's memory_stats() and segments are digested between these many equal parts of its trace
CHECKPOINTS = 4
# a pinned run keeps every allocation whose trace address, in 512 B units, is a multiple
# of this where it is (as Storages held by an op in flight)
PINNED_EVERY = 5


@dataclasses.dataclass(frozen=True)
class Scenario:
    """How one run builds its pool and drives it."""

    policy: PoolPolicy
    relocator: str = "none"  # "none", "all" (every live allocation may move), "pinned"
    capacity_factor: float | None = None  # x the trace's peak allocated; None: unlimited
    max_split_size: int | None = None
    page_size: int | None = None  # the backend decommits in pages of this size; None: never
    costly_churn: bool = False  # the backend says giving a segment back costs (CUDA)
    background: bool = False  # run as a server: doorbell, fake clock, background steps


SCENARIOS: dict[str, Scenario] = {
    "pytorch": Scenario(PYTORCH),
    "pytorch-tight": Scenario(PYTORCH, capacity_factor=1.02),
    "pytorch-max-split": Scenario(PYTORCH, capacity_factor=1.1, max_split_size=48 * MiB),
    "oom-compaction-tight": Scenario(OOM_COMPACTION, "all", capacity_factor=1.02),
    "adaptive": Scenario(ADAPTIVE, "all"),
    "adaptive-tight": Scenario(ADAPTIVE, "all", capacity_factor=1.02),
    "adaptive-pinned-tight": Scenario(ADAPTIVE, "pinned", capacity_factor=1.05),
    "adaptive-no-relocator-tight": Scenario(ADAPTIVE, capacity_factor=1.05),
    "adaptive-decommit": Scenario(ADAPTIVE, "all", capacity_factor=1.05, page_size=4096),
    "decommit-all": Scenario(
        dataclasses.replace(ADAPTIVE, name="decommit-all", decommit_threshold=None),
        "all",
        capacity_factor=1.05,
        page_size=4096,
    ),
    "decommit-huge-pages-pinned": Scenario(
        ADAPTIVE, "pinned", capacity_factor=1.05, max_split_size=48 * MiB, page_size=2 * MiB
    ),
    "decommit-segment-bound": Scenario(
        dataclasses.replace(ADAPTIVE, name="segment-bound", virtual_capacity_factor=1.1),
        "all",
        capacity_factor=1.02,
        page_size=4096,
    ),
    "eager-after-free": Scenario(
        dataclasses.replace(
            ADAPTIVE,
            name="eager",
            min_slack=0,
            decommit_min_slack=0,
            compact_every=1,
            release_threshold=1.0,
        ),
        "all",
    ),
    "server": Scenario(ADAPTIVE, "all", capacity_factor=1.1, page_size=4096, background=True),
    "server-pinned-costly-churn": Scenario(
        ADAPTIVE, "pinned", capacity_factor=1.1, page_size=4096, costly_churn=True, background=True
    ),
    "server-keep-all-idle": Scenario(
        dataclasses.replace(ADAPTIVE, name="keep-all", keep_idle_fraction=None),
        "all",
        capacity_factor=1.1,
        background=True,
    ),
    "server-eager": Scenario(
        dataclasses.replace(
            ADAPTIVE,
            name="server-eager",
            min_slack=0,
            background_min_slack=0,
            decommit_min_slack=0,
            decommit_min_bytes=4096,
            keep_idle_fraction=0.01,
            keep_idle_below=10.0,
        ),
        "all",
        capacity_factor=1.3,
        page_size=4096,
        background=True,
    ),
}

# the figures of memory_stats() each run records as they are (the rest: in its digest)
STAT_FIGURES = (
    "allocated_bytes.all.peak",
    "reserved_bytes.all.peak",
    "reserved_bytes.all.current",
    "inactive_split_bytes.all.peak",
    "segment.all.peak",
    "segment.all.current",
    "decommitted_bytes.all.peak",
    "num_device_alloc",
    "num_device_free",
    "num_alloc_retries",
    "num_ooms",
    "num_sync_all_streams",
    "num_compactions",
    "compaction_moved_bytes",
    "compaction_released_bytes",
    "num_decommits",
    "largest_free_block_bytes.all",
    "external_fragmentation.all",
)


class DecommittingBackend(RecordedAddressBackend):
    """Recorded addresses, and pages a decommit gives back (bookkeeping: nothing to free)."""

    can_decommit = True

    def __init__(
        self,
        segments: list[tuple[int, int]],
        *,
        total_bytes: int | None,
        page_size: int,
        costly_churn: bool,
    ) -> None:
        super().__init__(segments, total_bytes=total_bytes)
        self.page_size = page_size
        self.costly_segment_churn = costly_churn
        self.decommitted = 0  # bytes given back by decommit calls

    def decommit(self, memory: DeviceMemory, offset: int, nbytes: int) -> None:
        check_range(memory, offset, nbytes)
        if (memory.address + offset) % self.page_size or nbytes % self.page_size:
            raise ValueError(f"decommit of [{offset}, {offset + nbytes}) is not whole pages")
        self.decommitted += nbytes


class ChurnBackend(RecordedAddressBackend):
    """Recorded addresses, on a backend whose segments are costly to give back (CUDA)."""

    costly_segment_churn = True


class PinningRelocator(TraceRelocator):
    """A replay's relocator that keeps some allocations in place (as held Storages)."""

    @contextmanager
    def relocation(self, pool: CachingPool) -> Iterator[Mapping[Block, Callable[[Block], None]]]:
        movable = {
            block: address
            for address, block in self.live.items()
            if (address // 512) % PINNED_EVERY
        }
        yield Repointers(movable, self.live)


class Digest:
    """A running sha256 over the values given, in order."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()

    def add(self, *values: object) -> None:
        self._hash.update(repr(values).encode())

    def hexdigest(self) -> str:
        return self._hash.hexdigest()[:32]


def digest_of(value: object) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:32]


@cache
def trace_events(trace: str) -> list[TraceEvent]:
    return load_trace(bundled_trace(trace))


@cache
def trace_peak_allocated(trace: str) -> int:
    return peak_allocated(bundled_trace(trace), trace_events(trace))


def build_pool(trace: str, scenario: Scenario) -> tuple[CachingPool, TraceRelocator, list[float]]:
    events = trace_events(trace)
    capacity = (
        None
        if scenario.capacity_factor is None
        else int(scenario.capacity_factor * trace_peak_allocated(trace))
    )
    segments = [(addr, size) for action, addr, size, _ in events if action == "segment_alloc"]
    backend: RecordedAddressBackend
    if scenario.page_size is not None:
        backend = DecommittingBackend(
            segments,
            total_bytes=capacity,
            page_size=scenario.page_size,
            costly_churn=scenario.costly_churn,
        )
    elif scenario.costly_churn:
        backend = ChurnBackend(segments, total_bytes=capacity)
    else:
        backend = RecordedAddressBackend(segments, total_bytes=capacity)
    relocator = PinningRelocator() if scenario.relocator == "pinned" else TraceRelocator()
    clock = [1000.0]
    pool = CachingPool(
        backend,
        capacity=capacity,
        max_split_size=scenario.max_split_size,
        policy=scenario.policy,
        relocator=None if scenario.relocator == "none" else relocator,
        clock=lambda: clock[0],
    )
    return pool, relocator, clock


def run_scenario(trace: str, scenario: Scenario) -> dict[str, Any]:
    """Replay ``trace`` under ``scenario``; its figures (see the module docstring)."""
    pool, relocator, clock = build_pool(trace, scenario)
    live = relocator.live
    placements = Digest()
    failed = unmatched = rings = wakeups = steps = moved = idle_waits = 0
    rang = False

    def ring() -> None:
        nonlocal rang, rings
        rang = True
        rings += 1

    if scenario.background:
        pool.compaction_wanted = ring
    proceed = itertools.cycle(PROCEED_PATTERN).__next__
    next_idle_release: float | None = None
    events = trace_events(trace)
    checkpoints = {len(events) * k // CHECKPOINTS for k in range(1, CHECKPOINTS)}
    states = Digest()
    for index, (action, addr, size, stream) in enumerate(events):
        if index in checkpoints:
            states.add(pool.memory_stats(), pool.memory_snapshot()["segments"])
        clock[0] += TICK_S
        if action == "alloc":
            try:
                block = pool.malloc(size, stream)
            except OutOfMemoryError:
                failed += 1
                placements.add("oom", size)
                continue
            live[addr] = block
            placements.add(block.address, block.size)
        elif action == "free_completed":
            freed = live.pop(addr, None)
            if freed is None:
                unmatched += 1
            else:
                pool.free(freed)
        if not scenario.background:
            continue
        if not rang and (next_idle_release is None or clock[0] < next_idle_release):
            continue
        # the background compactor's wake-up: steps within the policy's budget, then a
        # look at when the first kept idle segment may go back
        rang = False
        wakeups += 1
        budget = pool.policy.max_moved_bytes
        done = 0
        for _ in range(PLANS_PER_WAKE):
            if done >= budget:
                break
            step = pool.compact_step(budget - done, proceed)
            if step is None:
                break
            steps += 1
            done += step
        moved += done
        delay = pool.idle_release_delay()
        idle_waits += delay is not None and delay > 0
        next_idle_release = None if delay is None else clock[0] + delay
    pool.assert_invariants()
    stats = pool.memory_stats()
    figures: dict[str, Any] = {key: stats[key] for key in STAT_FIGURES}
    figures.update(failed_allocs=failed, unmatched_frees=unmatched)
    if scenario.background:
        figures.update(
            doorbell_rings=rings,
            wakeups=wakeups,
            background_steps=steps,
            background_moved_bytes=moved,
            idle_release_waits=idle_waits,
        )
    if isinstance(pool.backend, DecommittingBackend):
        figures["backend_decommitted_bytes"] = pool.backend.decommitted
    figures["placements_sha256"] = placements.hexdigest()
    figures["checkpoints_sha256"] = states.hexdigest()
    figures["memory_stats_sha256"] = digest_of(stats)
    figures["segments_sha256"] = digest_of(pool.memory_snapshot()["segments"])
    # everything freed and the cache emptied: nothing may stay reserved
    for block in list(live.values()):
        pool.free(block)
    live.clear()
    pool.empty_cache()
    pool.assert_invariants()
    drained = pool.memory_stats()
    figures["drained_reserved_bytes"] = drained["reserved_bytes.all.current"]
    figures["drained_segments"] = drained["segment.all.current"]
    figures["drained_memory_stats_sha256"] = digest_of(drained)
    return figures


def record() -> dict[str, dict[str, dict[str, Any]]]:
    """Every trace's figures under every scenario, as the fixture holds them."""
    return {
        trace: {name: run_scenario(trace, scenario) for name, scenario in SCENARIOS.items()}
        for trace in bundled_traces()
    }


@cache
def recorded() -> dict[str, dict[str, dict[str, Any]]]:
    result: dict[str, dict[str, dict[str, Any]]] = json.loads(FIXTURE.read_text())
    return result


def cases() -> list[Any]:
    """Every (trace, scenario); all but FAST_TRACE's marked slow (together ~10 s of CPU)."""
    return [
        pytest.param(trace, name, marks=() if trace == FAST_TRACE else (pytest.mark.slow,))
        for trace in bundled_traces()
        for name in SCENARIOS
    ]


@pytest.mark.parametrize(("trace", "scenario"), cases())
def test_replay_figures_equal_the_recorded_ones(trace: str, scenario: str) -> None:
    expected = recorded()[trace][scenario]
    figures = run_scenario(trace, SCENARIOS[scenario])
    differing = {
        key: (expected.get(key), figures.get(key))
        for key in sorted(expected.keys() | figures.keys())
        if expected.get(key) != figures.get(key)
    }
    assert not differing, f"{trace} under {scenario}: (recorded, now) {differing}"


def test_the_fixture_covers_every_trace_and_scenario() -> None:
    assert FAST_TRACE in bundled_traces()
    assert set(recorded()) == set(bundled_traces())
    for trace, runs in recorded().items():
        assert set(runs) == set(SCENARIOS), trace


def test_the_scenarios_reach_every_path_they_pin() -> None:
    """The recorded runs exercise what they are for: out of memory and torch's retries,
    compaction on the OOM path and after frees, decommits, background steps that move
    bytes, idle segments kept and later given back, and oversize segments."""
    runs = recorded()

    def somewhere(scenario: str, key: str) -> bool:
        return any(runs[trace][scenario].get(key, 0) > 0 for trace in runs)

    assert somewhere("pytorch-tight", "num_ooms")
    assert somewhere("pytorch-tight", "num_alloc_retries")
    assert somewhere("pytorch-max-split", "num_device_free")
    assert somewhere("oom-compaction-tight", "num_compactions")
    assert somewhere("adaptive", "num_compactions")
    assert somewhere("eager-after-free", "num_compactions")
    assert somewhere("adaptive-pinned-tight", "compaction_moved_bytes")
    for scenario in ("adaptive-decommit", "decommit-all", "decommit-huge-pages-pinned"):
        assert somewhere(scenario, "num_decommits"), scenario
    assert somewhere("decommit-segment-bound", "num_ooms")
    for scenario in ("server", "server-pinned-costly-churn", "server-keep-all-idle"):
        assert somewhere(scenario, "background_moved_bytes"), scenario
        assert somewhere(scenario, "idle_release_waits"), scenario
    assert somewhere("server-eager", "num_decommits")
    for trace, scenarios in runs.items():
        for name, figures in scenarios.items():
            assert figures["drained_reserved_bytes"] == 0, (trace, name)


if __name__ == "__main__":
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_text(json.dumps(record(), indent=1, sort_keys=True) + "\n")
    print(f"recorded {FIXTURE}", file=sys.stderr)
