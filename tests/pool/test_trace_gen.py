"""Generated allocator traces: the generator's guarantees, and the default policy on them.

The policy was tuned on the bundled traces; the generated families (``tools.trace_gen``)
are workloads it was not tuned on.  The property: on every generated trace, at a capacity
of F x its peak allocated under PyTorch's rules, the default policy (every allocation
movable, as ``tensord replay --compaction`` runs it) has 0 OOMs, or the test names the
trace (family, seed) and its first OOM.  F is 1.01 for every family (an expected failure
for those that still OOM there) and each family's worst factor now.  A capacity below
the trace's floor (:func:`~tensord_server.tools.trace_gen.capacity_floor`: what the
pool's rounding rules need whatever the policy) is skipped, with the arithmetic.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from tensord_server.pool import DEFAULT_POLICY, SMALL_BUFFER
from tensord_server.tools import replay as replay_tool
from tensord_server.tools.replay import load_trace, replay, save_trace
from tensord_server.tools.trace_gen import FAMILIES, capacity_floor, generate

MiB = 1 << 20
SEEDS = range(12)  # per family: 0.02-0.3 s a replay, two replays a trace


def test_a_family_and_seed_give_the_same_trace_and_seeds_differ() -> None:
    for family in FAMILIES:
        first = generate(family, 3)
        assert first == generate(family, 3), family
        assert first != generate(family, 4), family


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_generated_trace_frees_only_what_it_holds(family: str) -> None:
    events = generate(family, 0)
    live: dict[int, int] = {}
    seen: set[int] = set()
    for action, addr, size, stream in events:
        assert stream == 0 and size > 0
        if action == "alloc":
            assert addr not in seen, "an address is a key: never reused"
            seen.add(addr)
            live[addr] = size
        else:
            assert action == "free_completed"
            assert live.pop(addr) == size
    assert not live  # every trace ends with its tensors freed
    assert len(events) < 20_000  # bounded: a replay of one is well under a second


def test_unknown_family_names_the_families() -> None:
    with pytest.raises(ValueError, match="families: transformer"):
        generate("nope", 0)


def test_a_saved_trace_reads_back_as_it_was(tmp_path: Path) -> None:
    events = generate("kv_cache", 1)
    path = tmp_path / "kv.events.json.gz"
    save_trace(path, events)
    assert load_trace(path) == events


def test_the_floor_is_the_rounded_bytes_in_whole_segments() -> None:
    # three 700 KiB small blocks (rounded: 700 KiB each) need two 2 MiB segments; a 3 MiB
    # block beside them rounds to 4 MiB; freeing one small block changes no floor
    kib = 1 << 10
    events = [("alloc", i, 700 * kib, 0) for i in range(3)]
    events += [("alloc", 10, 3 * MiB + 1, 0), ("free_completed", 0, 700 * kib, 0)]
    floor = capacity_floor(events)
    assert floor.bytes == 2 * SMALL_BUFFER + 4 * MiB
    assert (floor.event, floor.small_bytes, floor.large_bytes) == (3, 2100 * kib, 3 * MiB + 512)
    why = floor.explain(7 * MiB)
    assert "ceil(2,150,400 / 2,097,152) x 2,097,152" in why and "event 3" in why


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_floor_is_never_above_what_pytorchs_rules_reserve(family: str) -> None:
    events = generate(family, 0)
    floor = capacity_floor(events)
    assert 0 < floor.bytes <= replay(events, recorded_addresses=False).peak_reserved_bytes


def ooms_at(factor: float, family: str) -> tuple[list[str], list[str]]:
    """Each seed's trace at ``factor`` x its peak allocated under the default policy: the
    traces that ran out of memory, named with their first OOM, and those skipped (below
    their floor), with why."""
    failures: list[str] = []
    skipped: list[str] = []
    for seed in SEEDS:
        events = generate(family, seed)
        peak = replay(events, recorded_addresses=False).peak_allocated_bytes
        capacity = int(factor * peak)
        floor = capacity_floor(events)
        if capacity < floor.bytes:
            skipped.append(f"{family} seed {seed}: {floor.explain(capacity)}")
            continue
        result = replay(
            events,
            capacity=capacity,
            policy=DEFAULT_POLICY,
            compaction=True,
            recorded_addresses=False,
        )
        assert result.unmatched_frees <= result.failed_allocs  # only frees of failed ones
        if result.failed_allocs:
            assert result.first_oom is not None
            addr, size, message = result.first_oom
            index = next(i for i, e in enumerate(events) if e[:2] == ("alloc", addr))
            failures.append(
                f"{family} seed {seed} ({len(events)} events, peak {peak:,} B, capacity "
                f"{capacity:,} B): {result.failed_allocs} OOMs, the first at event {index} "
                f"(alloc of {size:,} B): {message}"
            )
    return failures, skipped


# Per family, the smallest factor of bench_fragmentation's ladder at which every seed of
# SEEDS has 0 OOMs under the default policy (docs/benchmarks.md's table): a change that
# needs more room on a family fails here; one that needs less lowers its entry.
WORST_FACTOR = {
    "transformer": 1.01,
    "kv_cache": 1.03,
    "weights_activations": 1.02,
    "small_bursts": 1.05,
    "edge_mass_free": 1.03,
}


def test_every_family_has_a_worst_factor() -> None:
    assert set(WORST_FACTOR) == set(FAMILIES)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_generated_traces_at_their_worst_factor_have_no_oom_under_the_default_policy(
    family: str,
) -> None:
    failures, skipped = ooms_at(WORST_FACTOR[family], family)
    assert not failures, "\n".join(failures)
    assert len(skipped) < len(SEEDS), "\n".join(skipped)


# The families with seeds whose trace still OOMs at 1.01x (docs/benchmarks.md's per-family
# table), each with its first OOM's arithmetic.  None of them is impossible there by the
# pool's rounding: every seed's capacity_floor is below 1.01x its peak allocated (at most
# 1.0075x, kv_cache seed 8; a capacity below it is skipped above), so these are the
# policy's OOMs, held at WORST_FACTOR.  In each, the request needs a new segment, the
# device has less room left than that segment, and the free bytes lie where no path can
# gather them: in 1-2 MiB tails of segments rounded up to 2 MiB (whose blocks fit no
# other tail), or in small-pool holes; a merge needs a new segment of the merged blocks
# beside the ones it replaces.  strict: once the policy serves a family, its case fails
# and the family leaves this map.
OOM_AT_1_01 = {
    "kv_cache": (
        "seed 8 (floor 1.0075x): a 29.25 MiB K/V copy needs a 30 MiB segment with 26.76 MiB "
        "left; the 3.24 MiB short are most of the 6.3 MiB free, 3.62 MiB of them in "
        "small-pool holes of up to 832 KiB in 17 segments and 2.69 MiB in one large tail"
    ),
    "weights_activations": (
        "7 of 12 seeds; seed 3: a 37.27 MiB weight needs a 38 MiB segment with 32.47 MiB "
        "left, 5.53 MiB short; 13.13 MiB lie in the tails of 9 large segments (weights of "
        "every size, each rounded up to 2 MiB) whose blocks fit no other tail, and merging "
        "the two smallest of them (20 and 36 MiB) needs a 54 MiB segment"
    ),
    "small_bursts": (
        "every seed; seed 1: a 538 KiB tensor needs a new 2 MiB small-pool segment with "
        "1.76 MiB left; 7.6 MiB lie in five large-pool tails of 1.0-1.9 MiB (small blocks "
        "never go there) and 0.33 MiB in small holes; merging the two smallest large "
        "segments with tails needs a 30 MiB one, and with under 16 MiB free in segments "
        "(min_slack) nothing consolidates before"
    ),
    "edge_mass_free": (
        "6 of 12 seeds; seed 1: a 26.98 MiB tensor needs a 28 MiB segment with 23.67 MiB "
        "left after merging gave back 2 MiB; 45 MiB lie in 35 large tails of 1.1-1.9 MiB "
        "and no segment's blocks all fit the others' tails"
    ),
}


@pytest.mark.parametrize(
    "family",
    [
        pytest.param(
            family,
            marks=[pytest.mark.xfail(strict=True, reason=OOM_AT_1_01[family])]
            if family in OOM_AT_1_01
            else [],
        )
        for family in sorted(FAMILIES)
    ],
)
@pytest.mark.slow
def test_generated_traces_at_1_01x_peak_have_no_oom_under_the_default_policy(
    family: str,
) -> None:
    failures, skipped = ooms_at(1.01, family)
    assert not failures, "\n".join(failures)
    assert len(skipped) < len(SEEDS), "\n".join(skipped)


def test_replay_runs_a_generated_trace_by_family_and_seed(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    parser = argparse.ArgumentParser()
    replay_tool.add_arguments(parser)
    saved = tmp_path / "t.events.json.gz"
    args = ["--synthetic", "transformer", "--seed", "2", "--save", str(saved), "--json"]
    assert replay_tool.run(parser.parse_args(args)) == 0
    result = json.loads(capsys.readouterr().out)
    events = generate("transformer", 2)
    assert result["events"] == len(events) and result["first_oom"] is None
    assert load_trace(saved) == events
    peak = result["peak_allocated_bytes"]
    tight = ["--synthetic", "transformer", "--seed", "2", "--capacity", str(peak // 2), "--json"]
    assert replay_tool.run(parser.parse_args(tight)) == 0
    starved = json.loads(capsys.readouterr().out)
    assert starved["num_ooms"] > 0
    assert "out of memory" in starved["first_oom"]["message"]
