"""Tiered memory behind handles, through a real server: spill under pressure, fault back on
use, views that need no bytes, pins and exports that never move, prefetch, per-tier
figures, a state machine against a NumPy model, and ``tensord serve``'s flags and scratch."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensord
from conftest import RunningServer, start_server, wait_until
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from tensord.errors import OutOfMemoryError
from tensord.protocol import MAX_RELEASE_HANDLES
from tensord_server.domain import spiller as spiller_module
from tensord_server.domain.quotas import parse_quota
from tensord_server.domain.tiers import SCRATCH_PREFIX, DiskTier
from tensord_server.observability.metrics import StoreCollector
from tensord_server.rpc import calls as calls_module

MiB = 1 << 20
# a client that never maps the server's memory: its uploads leave no export behind (a
# same-host client's do until its next batched release, and an export never moves)
remote = functools.partial(tensord.connect, local=False)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def tiered(tmp_path: Path) -> Iterator[RunningServer]:
    running = start_server(devices=("cpu=64MiB",), disk_tier=(str(tmp_path), 512 * MiB))
    yield running
    running.stop()


def floats(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def storages_of(server: RunningServer) -> list[Any]:
    return server.daemon.storages.live()


def disk_of(server: RunningServer) -> DiskTier:
    (disk,) = (t for t in server.daemon.tiers if isinstance(t, DiskTier))
    return disk


def spilled_count(server: RunningServer) -> int:
    return sum(1 for s in storages_of(server) if not s.resident)


def test_live_data_twice_the_device_reads_back_equal(tiered: RunningServer) -> None:
    client = tensord.connect(tiered.address)
    try:
        n = MiB  # 4 MiB of float32 each: 32 of them are 128 MiB in a 64 MiB pool
        kept = [(client.tensor(floats(n, seed)), seed) for seed in range(32)]
        assert spilled_count(tiered) >= 16  # at least the half that cannot fit moved down
        for x, seed in kept:
            assert np.array_equal(x.numpy(), floats(n, seed))
        stats = client.memory_stats()
        assert stats["tier.disk.num_spills"] >= 16
        assert stats["tier.disk.num_restores"] >= 16
        assert stats["tier.disk.restored_bytes"] >= 16 * 4 * MiB
        assert stats["tier.disk.bytes.peak"] >= 64 * MiB
        assert stats["allocated_bytes.all.peak"] <= 64 * MiB
        # quotas, the ledger and the handles count every Storage wherever it rests
        assert stats["storages.live"] == 32
        assert stats["tenant.allocated_bytes.current"] == 32 * 4 * MiB
        disk_of(tiered).assert_invariants()
        metrics = {
            sample.name: sample.value
            for family in StoreCollector(tiered.daemon).collect()
            for sample in family.samples
        }
        assert metrics["tensord_tier_disk_spilled_bytes_total"] == stats["tier.disk.spilled_bytes"]
        assert metrics["tensord_tier_disk_restored_bytes_total"] >= 16 * 4 * MiB
    finally:
        client.close()


def test_a_view_needs_no_bytes_and_a_read_faults_the_storage_back(
    tiered: RunningServer,
) -> None:
    client = remote(tiered.address)
    try:
        x = client.tensor(floats(MiB, 1))
        (storage,) = storages_of(tiered)
        assert tiered.daemon.storages.spill(storage.device, 1) == 4 * MiB
        assert not storage.resident
        view = x.view(1024, 1024)[3:5].t()  # views: metadata only
        assert not storage.resident
        assert view.shape == (1024, 2) and view.data_ptr() == x.data_ptr() + 3 * 4096
        assert np.array_equal(view.numpy(), floats(MiB, 1).reshape(1024, 1024)[3:5].T)
        assert storage.resident  # the read restored it
        assert tiered.daemon.storages.spill(storage.device, 1) == 4 * MiB
        x.fill_(2.5)  # a write faults it back too
        client.synchronize()
        assert storage.resident
        assert np.all(view.numpy() == 2.5)
    finally:
        client.close()


def test_pinned_and_exported_storages_never_move(tiered: RunningServer) -> None:
    client = remote(tiered.address)
    try:
        pinned = client.tensor(floats(MiB, 1)).pin_to_device()
        local = tensord.connect(tiered.address, local=True)
        exported = local.tensor(floats(MiB, 2))
        alias = np.asarray(exported, copy=False)  # a same-host mapping: an export
        plain = client.tensor(floats(MiB, 3))
        by_size = {s.id: s for s in storages_of(tiered)}
        assert len(by_size) == 3
        device = next(iter(by_size.values())).device
        tiered.daemon.storages.spill(device, 64 * MiB)  # everything that may move
        resident = {s.id: s.resident for s in storages_of(tiered)}
        assert sorted(resident.values()) == [False, True, True]
        assert np.array_equal(alias, floats(MiB, 2))
        assert np.array_equal(pinned.numpy(), floats(MiB, 1))
        assert np.array_equal(plain.numpy(), floats(MiB, 3))  # restored
        pinned.unpin_from_device()
        tiered.daemon.storages.spill(device, 64 * MiB)
        assert sum(1 for s in storages_of(tiered) if not s.resident) == 2  # only the export stays
        assert np.array_equal(pinned.numpy(), floats(MiB, 1))
        local.close()
    finally:
        client.close()


def test_pinning_restores_a_spilled_storage_and_prefetch_brings_the_rest_back(
    tiered: RunningServer,
) -> None:
    client = remote(tiered.address)
    try:
        xs = [client.tensor(floats(MiB // 4, seed)) for seed in range(6)]
        device = storages_of(tiered)[0].device
        tiered.daemon.storages.spill(device, 64 * MiB)
        assert spilled_count(tiered) == 6
        xs[0].pin_to_device()
        assert spilled_count(tiered) == 5
        assert client.prefetch(xs[1:4]) == 3
        assert xs[4].prefetch() is xs[4]
        assert wait_until(lambda: spilled_count(tiered) == 1)  # the last one stays down
        assert client.memory_stats()["tier.device.pinned.current"] == 1
        for seed, x in enumerate(xs):
            assert np.array_equal(x.numpy(), floats(MiB // 4, seed))
    finally:
        client.close()


def test_the_background_spiller_keeps_the_pool_under_its_watermarks(
    tiered: RunningServer,
) -> None:
    client = remote(tiered.address)
    try:
        kept = [client.tensor(floats(MiB, seed)) for seed in range(15)]  # 60 MiB of 64
        pool = storages_of(tiered)[0].device.pool
        # past 85 % (the 14th) the spiller took it below 70 %; the 15th left it between
        assert wait_until(lambda: spilled_count(tiered) >= 3, timeout=10)
        assert pool.allocated_bytes <= 0.85 * pool.capacity
        assert tiered.daemon.spiller.rounds >= 1
        assert np.array_equal(kept[0].numpy(), floats(MiB, 0))
    finally:
        client.close()


def test_a_full_hierarchy_is_an_out_of_memory_naming_each_tier(tmp_path: Path) -> None:
    running = start_server(devices=("cpu=32MiB",), disk_tier=(str(tmp_path), 16 * MiB))
    client = remote(running.address)
    try:
        kept = []
        with pytest.raises(OutOfMemoryError, match=r"disk tier \d+ of 16777216 bytes") as raised:
            for seed in range(20):
                kept.append(client.tensor(floats(MiB, seed)))
        assert raised.value.device == "cpu"
        assert len(kept) >= 6
        # the disk's 16 MiB was used before the error
        assert client.memory_stats()["tier.disk.bytes.current"] >= 12 * MiB
        # a spilled Storage comes back only where another can go down: free some room
        del kept[-2:]
        client.flush()
        for seed, x in enumerate(kept):  # nothing already stored was lost
            assert np.array_equal(x.numpy(), floats(MiB, seed))
    finally:
        client.close()
        running.stop()


def test_the_host_tier_takes_spills_before_the_disk(tmp_path: Path) -> None:
    running = start_server(
        devices=("cpu=32MiB",), host_tier=16 * MiB, disk_tier=(str(tmp_path), 128 * MiB)
    )
    client = remote(running.address)
    try:
        kept = [client.tensor(floats(MiB, seed)) for seed in range(14)]  # 56 MiB
        stats = client.memory_stats()
        assert stats["tier.host.num_spills"] >= 1 and stats["tier.host.bytes.current"] > 0
        assert stats["tier.disk.num_spills"] >= 1
        assert stats["tier.host.bytes.peak"] <= 16 * MiB
        for seed, x in enumerate(kept):
            assert np.array_equal(x.numpy(), floats(MiB, seed))
    finally:
        client.close()
        running.stop()


def test_a_full_host_tier_demotes_its_least_recently_used_to_the_disk(tmp_path: Path) -> None:
    running = start_server(
        devices=("cpu=64MiB",), host_tier=16 * MiB, disk_tier=(str(tmp_path), 128 * MiB)
    )
    client = remote(running.address)
    try:
        kept = [client.tensor(floats(MiB, seed)) for seed in range(8)]  # 32 MiB
        storages = running.daemon.storages
        device = storages_of(running)[0].device
        (host,) = running.daemon.spiller.host_tiers
        storages.spill(device, 16 * MiB)  # the host tier, full
        assert host.figures()["tier.host.bytes.current"] == 16 * MiB
        # the spiller takes it from above 85 % to below 70 %, the oldest first, to the disk
        assert wait_until(lambda: host.figures()["tier.host.bytes.current"] <= 0.70 * 16 * MiB)
        on_disk = [
            s for s in storages_of(running) if s.placement and s.placement.tier.name == "disk"
        ]
        assert on_disk and all(s.nbytes == 4 * MiB for s in on_disk)
        oldest = min(storages_of(running), key=lambda s: s.last_use)
        assert oldest.placement is not None and oldest.placement.tier.name == "disk"
        stats = client.memory_stats()
        assert stats["tier.host.storages.current"] + stats["tier.disk.storages.current"] == 4
        for seed, x in enumerate(kept):
            assert np.array_equal(x.numpy(), floats(MiB, seed))
        assert client.memory_stats()["tier.host.bytes.current"] == 0
    finally:
        client.close()
        running.stop()


def test_a_tenant_over_its_share_spills_first(tmp_path: Path) -> None:
    tokens = {"token-a": "a", "token-b": "b"}
    running = start_server(
        devices=("cpu=64MiB",), disk_tier=(str(tmp_path), 256 * MiB), auth_tokens=tokens
    )
    heavy = remote(running.address, token="token-a")
    light = remote(running.address, token="token-b")
    try:
        light_kept = [light.tensor(floats(MiB // 2, seed)) for seed in range(4)]  # 8 MiB, first
        heavy_kept = [heavy.tensor(floats(MiB, seed)) for seed in range(11)]  # 44 MiB
        device = storages_of(running)[0].device
        running.daemon.storages.spill(device, 16 * MiB)
        spilled = {s.tenant for s in storages_of(running) if not s.resident}
        assert spilled == {"a"}  # b's older Storages stayed: a is over its half
        for seed, x in enumerate(light_kept):
            assert np.array_equal(x.numpy(), floats(MiB // 2, seed))
        assert np.array_equal(heavy_kept[0].numpy(), floats(MiB, 0))
    finally:
        heavy.close()
        light.close()
        running.stop()


def test_a_quota_counts_storages_wherever_they_rest(tmp_path: Path) -> None:
    running = start_server(
        devices=("cpu=64MiB",),
        disk_tier=(str(tmp_path), 256 * MiB),
        auth_tokens={"t": "a"},
        quotas=[parse_quota("a:cpu=16MiB")],
    )
    client = remote(running.address, token="t")
    try:
        kept = [client.tensor(floats(MiB, seed)) for seed in range(4)]  # the whole quota
        running.daemon.storages.spill(storages_of(running)[0].device, 64 * MiB)
        assert spilled_count(running) == 4
        with pytest.raises(tensord.ResourceExhaustedError, match="quota"):
            client.tensor(floats(MiB, 9))  # spilled bytes still count
        assert np.array_equal(kept[3].numpy(), floats(MiB, 3))
    finally:
        client.close()
        running.stop()


# ---- a state machine against a NumPy model --------------------------------------------

ELEMENTS = st.sampled_from([64 * 1024, 256 * 1024, 512 * 1024])  # 256 KiB to 2 MiB
VIEWS = st.sampled_from([slice(None), slice(1, None, 2), slice(None, 1000), slice(5, -5)])


class Entry:
    """A tensor the machine holds, its Storage's key in the model and its views' slices."""

    def __init__(self, tensor: Any, key: int, slices: tuple[slice, ...]) -> None:
        self.tensor, self.key, self.slices = tensor, key, slices

    def model(self, bases: dict[int, np.ndarray]) -> np.ndarray:
        return functools.reduce(lambda a, s: a[s], self.slices, bases[self.key])


class TieredModel(RuleBasedStateMachine):
    """Creates, views, writes, reads, releases, shares and pins tensors in a 24 MiB pool
    over a small host tier (which the spiller demotes from) and a disk tier; values always
    equal the model's, whatever moved and wherever to."""

    server: RunningServer
    client: Any
    entries = Bundle("entries")

    def __init__(self) -> None:
        super().__init__()
        self.bases: dict[int, np.ndarray] = {}
        self.next_key = 0
        self.live: list[Entry] = []
        self.refusals = 0

    @rule(target=entries, n=ELEMENTS, seed=st.integers(0, 2**16))
    def create(self, n: int, seed: int) -> Entry:
        values = floats(n, seed)
        key, self.next_key = self.next_key, self.next_key + 1
        self.bases[key] = values.copy()
        entry = Entry(self.client.tensor(values), key, ())
        self.live.append(entry)
        return entry

    @rule(target=entries, entry=entries, view=VIEWS)
    def view(self, entry: Entry, view: slice) -> Entry:
        made = Entry(entry.tensor[view], entry.key, (*entry.slices, view))
        self.live.append(made)
        return made

    @rule(entry=entries, value=st.floats(-4, 4, width=32))
    def write(self, entry: Entry, value: float) -> None:
        entry.tensor.fill_(value)
        entry.model(self.bases)[...] = value

    @rule(entry=entries)
    def read(self, entry: Entry) -> None:
        assert np.array_equal(entry.tensor.numpy(), entry.model(self.bases))

    @rule(entry=consumes(entries))
    def release(self, entry: Entry) -> None:
        self.live.remove(entry)
        entry.tensor = None

    @rule(target=entries, entry=entries)
    def share(self, entry: Entry) -> Entry:
        made = Entry(self.client.attach(entry.tensor.share()), entry.key, entry.slices)
        self.live.append(made)
        return made

    @rule(entry=entries, pinned=st.booleans())
    def pin(self, entry: Entry, pinned: bool) -> None:
        if pinned:
            entry.tensor.pin_to_device()
        else:
            entry.tensor.unpin_from_device()

    @precondition(lambda self: len(self.live) > 0)
    @rule()
    def pressure(self) -> None:
        """A burst the pool cannot hold beside everything else: a synchronous spill."""
        try:
            burst = self.client.empty(2 * MiB)  # 8 MiB
            burst.fill_(1)
            self.client.synchronize()
            del burst
        except OutOfMemoryError:
            # pins may hold the pool: the refusal is torch's, and nothing stored is lost
            self.refusals += 1
        self.client.flush()

    @invariant()
    def pinned_and_held_storages_are_resident(self) -> None:
        for storage in self.server.daemon.storages.live():
            if storage.pinned or storage.holds:
                assert storage.resident, storage

    @invariant()
    def the_tiers_stay_within_their_caps(self) -> None:
        disk = disk_of(self.server)
        disk.assert_invariants()
        assert disk.figures()["tier.disk.bytes.peak"] <= disk.stats.capacity
        for tier in self.server.daemon.tiers:
            figures = tier.figures()
            assert figures[f"tier.{tier.name}.bytes.peak"] <= tier.stats.capacity

    def teardown(self) -> None:
        for entry in self.live:
            assert np.array_equal(entry.tensor.numpy(), entry.model(self.bases))
        self.live.clear()
        for storage in self.server.daemon.storages.live():
            storage.pinned = False  # the next example starts with nothing pinned


@pytest.mark.slow
def test_values_equal_a_numpy_model_through_every_move(tmp_path: Path) -> None:
    running = start_server(
        devices=("cpu=24MiB",), host_tier=6 * MiB, disk_tier=(str(tmp_path), 96 * MiB)
    )
    client = remote(running.address)
    TieredModel.server, TieredModel.client = running, client
    try:
        run_state_machine_as_test(
            TieredModel,
            settings=settings(
                max_examples=20,
                stateful_step_count=25,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow],
            ),
        )
        stats = client.memory_stats()
        assert stats["tier.disk.num_spills"] > 0  # the pressure really moved Storages
        assert stats["tier.host.num_spills"] > 0
    finally:
        client.close()
        running.stop()


# ---- tensord serve ------------------------------------------------------------------------


def serve(*flags: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'client'}:{REPO / 'server'}"}
    return subprocess.run(
        [sys.executable, "-m", "tensord_server", "serve", "--address", "127.0.0.1:0", *flags],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--disk-tier", "nowhere"], "expected DIR=LIMIT"),
        (["--disk-tier", "/definitely/not/here=1GiB"], "is not a directory"),
        (["--disk-tier", "/tmp=0"], "its limit must be above 0"),
        (["--host-tier", "lots"], "invalid size"),
        (["--spill-workers", "0"], "--spill-workers must be >= 1"),
    ],
)
@pytest.mark.slow
def test_serve_refuses_bad_tier_flags(flags: list[str], message: str) -> None:
    done = serve("--device", "cpu=64MiB", *flags)
    assert done.returncode == 2
    assert message in done.stderr


def start_serving(tmp_path: Path, *flags: str) -> tuple[subprocess.Popen[str], str]:
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'client'}:{REPO / 'server'}"}
    process = subprocess.Popen(
        [sys.executable, "-m", "tensord_server", "serve", "--address", "127.0.0.1:0", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    assert process.stdout is not None
    address = ""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if line.startswith("tensord listening on "):
            address = line.split()[-1]
        if line.startswith("tensord tiers under cpu"):
            assert "disk tier" in line
            return process, address
        if not line and process.poll() is not None:
            break
    process.kill()
    process.wait(10)
    process.stdout.close()
    raise AssertionError("tensord serve did not start")


@pytest.mark.slow
def test_a_server_killed_mid_spill_restarts_and_sweeps_its_scratch(tmp_path: Path) -> None:
    flags = ("--device", "cpu=64MiB", "--disk-tier", f"{tmp_path}=256MiB")
    process, address = start_serving(tmp_path, *flags)
    try:
        client = tensord.connect(address)
        kept = [client.tensor(floats(MiB, seed)) for seed in range(24)]  # 96 MiB: spilling
        (scratch,) = tmp_path.glob(f"{SCRATCH_PREFIX}*")
        assert client.memory_stats()["tier.disk.num_spills"] > 0
        for seed in range(24, 40):  # and more, killed while it spills
            kept.append(client.tensor(floats(MiB, seed)))
            if seed == 30:
                process.send_signal(signal.SIGKILL)
                break
        process.wait(10)
        process.stdout.close()  # type: ignore[union-attr]
        client.close()
        assert scratch.exists()  # a killed server leaves its file behind
        second, address = start_serving(tmp_path, *flags)
        try:
            left = list(tmp_path.glob(f"{SCRATCH_PREFIX}*"))
            assert scratch not in left and len(left) == 1  # swept; the new one's own
            again = tensord.connect(address)
            x = again.tensor(floats(MiB, 1))
            assert np.array_equal(x.numpy(), floats(MiB, 1))
            again.close()
        finally:
            second.send_signal(signal.SIGTERM)
            second.wait(30)
            second.stdout.close()  # type: ignore[union-attr]
        assert not list(tmp_path.glob(f"{SCRATCH_PREFIX}*"))  # removed at stop
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
        if process.stdout is not None and not process.stdout.closed:
            process.stdout.close()


@pytest.mark.slow
def test_the_tier_benchmark_runs_quick(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'client'}:{REPO / 'server'}"}
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "bench_tiers.py"),
            "--quick",
            "--dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    for row in ("2MiB", "16MiB", "64MiB", "tiered", "resident", "ratio"):
        assert row in done.stdout
    assert "nan" not in done.stdout


def test_a_prefetch_is_bounded_by_the_release_limit(tiered: RunningServer) -> None:
    client = remote(tiered.address)
    try:
        x = client.zeros(16)
        session = tiered.daemon.sessions.peek(client.session_id)
        assert session is not None
        with pytest.raises(tensord.InvalidArgumentError, match="MAX_RELEASE_HANDLES"):
            tiered.daemon.tiering.prefetch(session, [x.handle] * (MAX_RELEASE_HANDLES + 1))
        assert client.prefetch([x] * 3) == 0  # resident: nothing to queue
    finally:
        client.close()


def test_prefetches_past_the_queue_bound_are_dropped_holding_nothing(
    tiered: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(spiller_module, "MAX_QUEUED_PREFETCHES", 0)
    client = remote(tiered.address)
    try:
        x = client.tensor(floats(MiB, 4))
        (storage,) = storages_of(tiered)
        tiered.daemon.storages.spill(storage.device, 1)
        assert client.prefetch([x]) == 0  # over the bound: a hint dropped
        assert tiered.daemon.spiller.dropped_prefetches == 1
        assert storage.holds == 0 and not storage.resident
        assert np.array_equal(x.numpy(), floats(MiB, 4))  # the read restores it itself
    finally:
        client.close()


def test_a_same_host_get_of_a_spilled_name_restores_it_on_a_worker(
    tiered: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GetNameExport exports (so restores first) the named Storage: a restore from the disk
    of a Storage as large as the pool, with the spills that make its room, must never run
    on the event loop, where it would hold every other caller's calls."""
    ran: list[tuple[str, bool]] = []
    answer = calls_module.Calls._answer

    def recording(self: Any, method: Any, request: Any, call: Any) -> Any:
        ran.append((method.name, threading.current_thread().name == "tensord-rpc"))
        return answer(self, method, request, call)

    values = floats(MiB, 7)
    with remote(tiered.address) as putter:  # no export holds what it uploads
        putter.put("spilled", putter.tensor(values))
    (storage,) = storages_of(tiered)
    assert tiered.daemon.storages.spill(storage.device, 1) == 4 * MiB
    assert not storage.resident
    with tensord.connect(tiered.address, pipelining=False) as client:
        monkeypatch.setattr(calls_module.Calls, "_answer", recording)
        got = client.get("spilled")
        assert storage.resident
        assert np.array_equal(got.numpy(), values)
    gets = [inline for name, inline in ran if name == "GetNameExport"]
    assert gets == [False]


def test_a_same_host_read_of_a_spilled_tensor_restores_it_on_a_worker(
    tiered: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A same-host read exports (so restores first) the tensor's Storage: with tiers an
    Export is a worker's, never the event loop's, as GetNameExport is."""
    ran: list[tuple[str, bool]] = []
    answer = calls_module.Calls._answer

    def recording(self: Any, method: Any, request: Any, call: Any) -> Any:
        ran.append((method.name, threading.current_thread().name == "tensord-rpc"))
        return answer(self, method, request, call)

    values = floats(MiB, 8)
    with remote(tiered.address) as putter:  # no export holds what it uploads
        putter.put("spilled", putter.tensor(values))
    with tensord.connect(tiered.address, pipelining=False) as client:
        got = client.get("spilled")
        assert np.array_equal(got.numpy(), values)
        del got
        client.synchronize()  # the get's export and handle released
        token = client.get("spilled").share()
        client.synchronize()
        (storage,) = storages_of(tiered)
        wait_until(lambda: tiered.daemon.storages.spill(storage.device, 1) == 4 * MiB)
        assert not storage.resident
        attached = client.attach(token)
        monkeypatch.setattr(calls_module.Calls, "_answer", recording)
        assert np.array_equal(attached.numpy(), values)
        assert storage.resident
    exports = [inline for name, inline in ran if name == "Export"]
    assert exports == [False]
