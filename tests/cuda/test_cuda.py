"""CUDA devices end to end (marked ``cuda``; skipped without CuPy or a GPU).

Every view and copy op on cuda:0 is checked against the same op on cpu;
cross-device ``to``/``copy_``; stream safety under concurrent clients; OOM on a
capped device; the pool's stats against what was allocated.  Run with
``pytest -m cuda`` (scripts/device_check.sh runs it on a GPU machine).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from tensord_server.devices import table as devices

if devices.gpu_count() == 0:  # without CuPy this never imports it
    pytest.skip("needs CuPy and a CUDA GPU", allow_module_level=True)

import tensord
from conftest import RunningServer, start_server, wait_until
from tensord_server.devices.table import DeviceSpec

pytestmark = pytest.mark.cuda

MiB = 1 << 20
GPU = "cuda:0"


@pytest.fixture(scope="module")
def gpu_server() -> Iterator[RunningServer]:
    running = start_server(devices=(DeviceSpec("cpu", 4 << 30, pinned=True), f"{GPU}=4GiB"))
    yield running
    running.stop()


@pytest.fixture
def c(gpu_server: RunningServer) -> Iterator[Any]:
    with tensord.connect(gpu_server.address) as connected:
        yield connected


def host(t: Any) -> np.ndarray:
    return np.asarray(t.cpu().numpy())


def same(a: Any, b: Any) -> None:
    """Same shape, dtype and values (NaNs equal); the first on cuda:0, the second on cpu."""
    assert str(a.device) == GPU and str(b.device) == "cpu"
    assert tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype
    assert tuple(a.stride()) == tuple(b.stride())
    x, y = host(a), host(b)
    if x.dtype == ml_dtypes.bfloat16:
        x, y = x.view(np.uint16), y.view(np.uint16)
    np.testing.assert_array_equal(x, y)


DATA = np.arange(3 * 4 * 5, dtype=np.float32).reshape(3, 4, 5) / 7 - 3

VIEWS: dict[str, Callable[[Any], Any]] = {
    "transpose": lambda x: x.transpose(0, 2),
    "permute": lambda x: x.permute(2, 0, 1),
    "slice": lambda x: x[1:, ::2, -3:],
    "select": lambda x: x.select(1, 2),
    "narrow": lambda x: x.narrow(2, 1, 3),
    "expand": lambda x: x[:, :1].expand(3, 6, 5),
    "unsqueeze": lambda x: x.unsqueeze(1),
    "flatten": lambda x: x.flatten(),
    "diagonal": lambda x: x.diagonal(0, 1, 2),
    "as_strided": lambda x: x.as_strided((4, 4), (5, 1), 3),
    "view_dtype": lambda x: x.view(tensord.int32),
    "split": lambda x: x.split(2, dim=2)[1],
    "unbind": lambda x: x.unbind(1)[3],
}

COPIES: dict[str, Callable[[Any], Any]] = {
    "clone": lambda x: x.transpose(0, 1).clone(),
    "contiguous": lambda x: x.permute(2, 0, 1).contiguous(),
    "reshape_copy": lambda x: x.transpose(0, 2).reshape(-1),
    "to_float16": lambda x: x.to(tensord.float16),
    "to_bfloat16": lambda x: x.to(tensord.bfloat16),
    "bfloat16_back": lambda x: x.to(tensord.bfloat16).transpose(0, 1).to(tensord.float64),
    "to_int32": lambda x: x.to(tensord.int32),
    "to_uint8": lambda x: x[2].to(tensord.uint8),  # positive: negative floats to uint8 are UB
    "to_bool": lambda x: x.to(tensord.bool),
    "to_complex": lambda x: x.to(tensord.complex64),
    "repeat": lambda x: x[:, 1:3].repeat(2, 1, 3),
    "cat": lambda x: tensord.cat([x, x[:1].to(tensord.float16)], dim=0),
    "stack": lambda x: tensord.stack([x[0], x[2]], dim=1),
}


@pytest.mark.parametrize("name", sorted(VIEWS))
def test_views_match_cpu(c: Any, name: str) -> None:
    op = VIEWS[name]
    same(op(c.tensor(DATA, device=GPU)), op(c.tensor(DATA)))


@pytest.mark.parametrize("name", sorted(COPIES))
def test_copies_match_cpu(c: Any, name: str) -> None:
    op = COPIES[name]
    same(op(c.tensor(DATA, device=GPU)), op(c.tensor(DATA)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64", "complex64", "bool"])
def test_writes_match_cpu(c: Any, dtype: str) -> None:
    dt = getattr(tensord, dtype)
    results = []
    for device in (GPU, "cpu"):
        x = c.zeros(3, 4, 5, dtype=dt, device=device)
        x[1] = 1
        x[:, 2, 1:4] = c.tensor(DATA[0, :1, 1:4], device=device)  # broadcast, converted
        x.transpose(0, 2)[0].fill_(3)
        x[2, :, ::2].copy_(c.tensor(DATA[2, :, ::2] * 5, device=device).to(tensord.float64))
        x[0, 0].zero_()
        results.append(x)
    same(*results)


# torch's lazy conjugate / negative bits through the CUDA kernels
LAZY_BITS: dict[str, Callable[[Any], Any]] = {
    "clone": lambda x: x.conj().transpose(0, 1).clone(),
    "imag_clone": lambda x: x.conj().imag.clone(),
    "expand_contiguous": lambda x: x[:, :1].conj().expand(3, 6, 5).contiguous(),
    "to_complex128": lambda x: x.conj().to(tensord.complex128),
    "cat": lambda x: tensord.cat([x.conj(), x], dim=1),
    "gather": lambda x: x.conj()[[2, 0, 2]],
    "conj_physical": lambda x: x.conj_physical(),
}


@pytest.mark.parametrize("name", sorted(LAZY_BITS))
def test_lazy_bits_match_cpu(c: Any, name: str) -> None:
    data = (DATA + 1j * DATA[::-1]).astype(np.complex64)
    op = LAZY_BITS[name]
    same(op(c.tensor(data, device=GPU)), op(c.tensor(data)))


def test_writes_through_lazy_bits_match_cpu(c: Any) -> None:
    data = (DATA + 1j * DATA[::-1]).astype(np.complex64)
    results = []
    for device in (GPU, "cpu"):
        x = c.tensor(data, device=device)
        x.conj()[0].fill_(1 + 2j)
        x.conj().imag[1] = 5.0
        x.conj()[2, :, ::2].copy_(c.tensor(data[0, :, ::2], device=device))
        x.conj()[[1, 1]] = c.tensor(data[2, :1], device=device)
        results.append(x)
    same(*results)
    np.testing.assert_array_equal(results[0].conj().numpy(force=True), host(results[1]).conj())


def test_bfloat16_round_trip(c: Any) -> None:
    values = np.array([0.1, -2.5, 3.0e38, 1e-40, np.inf, -np.inf, 1 + 2**-8], np.float64)
    on_gpu = c.tensor(values, device=GPU).to(tensord.bfloat16)
    on_cpu = c.tensor(values).to(tensord.bfloat16)
    same(on_gpu, on_cpu)
    same(on_gpu.to(tensord.float32), on_cpu.to(tensord.float32))
    np.testing.assert_array_equal(
        host(c.tensor(values.astype(ml_dtypes.bfloat16), device=GPU)).view(np.uint16),
        values.astype(ml_dtypes.bfloat16).view(np.uint16),
    )


def test_cross_device_to_and_copy(c: Any) -> None:
    x = c.tensor(DATA).transpose(0, 2)  # not contiguous
    y = x.to(GPU)
    assert str(y.device) == GPU and tuple(y.stride()) == tuple(x.stride())  # preserve_format
    np.testing.assert_array_equal(host(y), DATA.transpose(2, 1, 0))
    back = y.to("cpu", tensord.float64)
    np.testing.assert_array_equal(host(back), DATA.transpose(2, 1, 0).astype(np.float64))
    dst = c.zeros(5, 8, 3, device=GPU)
    dst[:, ::2].copy_(x)  # cpu -> a strided cuda destination
    np.testing.assert_array_equal(host(dst)[:, ::2], DATA.transpose(2, 1, 0))
    assert (host(dst)[:, 1::2] == 0).all()
    out = c.zeros(4, 3, dtype=tensord.int64)
    out.copy_(c.tensor(DATA[:, :, 0].T * 10, device=GPU))  # cuda -> cpu, converted
    np.testing.assert_array_equal(host(out), (DATA[:, :, 0].T * 10).astype(np.int64))
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        tensord.cat([c.tensor(DATA), c.tensor(DATA, device=GPU)])


def test_large_transfers_cross_the_staging_buffers(c: Any) -> None:
    data = np.random.default_rng(0).integers(0, 255, 150 * MiB + 3, dtype=np.uint8)
    x = c.tensor(data, device=GPU)  # an upload straight into cuda:0
    np.testing.assert_array_equal(host(x), data)
    np.testing.assert_array_equal(host(c.tensor(data).to(GPU)), data)


@pytest.mark.skipif(devices.gpu_count() < 2, reason="needs two GPUs")
def test_peer_copies(gpu_server: RunningServer) -> None:
    running = start_server(devices=("cpu=1GiB", "cuda:0=1GiB", "cuda:1=1GiB"))
    try:
        with tensord.connect(running.address) as c:
            x = c.tensor(DATA, device="cuda:0").transpose(0, 1)
            y = x.to("cuda:1", tensord.float64)
            assert str(y.device) == "cuda:1"
            np.testing.assert_array_equal(host(y), DATA.transpose(1, 0, 2).astype(np.float64))
            z = c.zeros(4, 3, 5, device="cuda:0")
            z.copy_(y)
            np.testing.assert_array_equal(host(z), DATA.transpose(1, 0, 2))
    finally:
        running.stop()


def test_stream_safety_under_concurrent_clients(gpu_server: RunningServer) -> None:
    """Blocks freed and reused while copies run: every client must read back its own data."""
    failures: list[str] = []

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            with tensord.connect(gpu_server.address) as c:
                for i in range(30):
                    data = rng.standard_normal((64, 257 + i), dtype=np.float32)
                    x = c.tensor(data, device=GPU)
                    y = x.t().contiguous()  # a kernel over x's block
                    del x  # x's block goes back to the pool while y's kernel may run
                    z = c.zeros(257 + i, 64, device=GPU)  # likely x's block again
                    z.copy_(y)
                    if not np.array_equal(host(z), data.T):
                        failures.append(f"client {seed}, round {i}")
                    c.flush()
        except Exception as exc:  # reported below, with the others
            failures.append(f"client {seed}: {exc!r}")

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not failures


def test_oom_on_a_capped_device(gpu_server: RunningServer) -> None:
    running = start_server(devices=("cpu=1GiB", f"{GPU}=64MiB"))
    try:
        with tensord.connect(running.address) as c:
            x = c.empty(40 * MiB, dtype=tensord.uint8, device=GPU)
            with pytest.raises(tensord.OutOfMemoryError, match="Tried to allocate") as info:
                c.empty(40 * MiB, dtype=tensord.uint8, device=GPU)
            assert isinstance(info.value, RuntimeError)
            assert c.memory_stats(GPU)["num_ooms"] == 1
            del x
            c.flush()
            assert wait_until(lambda: c.memory_allocated(GPU) == 0)
            c.empty(40 * MiB, dtype=tensord.uint8, device=GPU)  # the server kept serving
    finally:
        running.stop()


def test_stats_match_allocations(c: Any) -> None:
    c.flush()
    before = c.memory_allocated(GPU)
    tensors = [c.empty(n, dtype=tensord.uint8, device=GPU) for n in (1, 600, 3 * MiB, 30 * MiB)]
    rounded = sum(-(-n // 512) * 512 for n in (1, 600, 3 * MiB, 30 * MiB))
    assert c.memory_allocated(GPU) - before == rounded
    stats = c.memory_stats(GPU)
    assert stats["reserved_bytes.all.current"] >= stats["allocated_bytes.all.current"]
    del tensors
    c.flush()
    assert wait_until(lambda: c.memory_allocated(GPU) == before)


def test_compaction_moves_gpu_storages_and_keeps_their_bytes(gpu_server: RunningServer) -> None:
    """Thirty 2 MiB tensors in three 20 MiB segments of a 60 MiB device, every other one
    released: 12 MiB fits only once compaction empties a segment (device-to-device copies
    queued on the server's stream); every kept tensor then reads and computes right."""
    running = start_server(devices=("cpu=1GiB", f"{GPU}=60MiB"))
    try:
        with tensord.connect(running.address) as c:
            rng = np.random.default_rng(5)
            values = [rng.standard_normal((2 * MiB) // 4).astype(np.float32) for _ in range(30)]
            tensors = [c.tensor(v, device=GPU) for v in values]
            c.synchronize()
            session = running.daemon.sessions.peek(c.session_id)

            def block_address(t: Any) -> int:
                return int(running.daemon.sessions.lookup(session, t.handle).storage.block.address)

            ptrs = [t.data_ptr() for t in tensors]
            addresses = [block_address(t) for t in tensors]
            for i in range(0, 30, 2):
                tensors[i] = None
            c.flush()
            assert wait_until(lambda: c.memory_allocated(GPU) == 15 * 2 * MiB)
            big = c.zeros((12 * MiB) // 4, device=GPU)
            stats = c.memory_stats(GPU)
            assert stats["num_compactions"] == 1 and stats["num_ooms"] == 0
            assert stats["compaction_moved_bytes"] == 10 * MiB
            kept = range(1, 30, 2)
            moved = [i for i in kept if block_address(tensors[i]) != addresses[i]]
            assert len(moved) == 5
            # data_ptr is the Storage's, not its block's: no handle sees a move
            assert [tensors[i].data_ptr() for i in kept] == [ptrs[i] for i in kept]
            for i in kept:
                np.testing.assert_array_equal(host(tensors[i]), values[i])
                # a kernel reading a moved Storage runs after the move's copy (same stream);
                # its output is small: the 2 MiB holes left cannot take another large block
                head = tensors[i][1000:2000].clone()
                np.testing.assert_array_equal(host(head), values[i][1000:2000])
            assert float(host(big).sum()) == 0.0
    finally:
        running.stop()


def test_two_processes_share_a_gpu_storage_through_torch_from_dlpack(
    gpu_server: RunningServer, c: Any
) -> None:
    # same-host zero copy over CUDA IPC: a second process aliases the server's GPU memory,
    # sees the server's queued work complete, and its writes are seen by the next call
    import os
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    values = np.arange(64 * 48, dtype=np.float32).reshape(64, 48)
    x = c.zeros(64, 48, device=GPU)
    x.copy_(c.tensor(values + 1, device=GPU))  # a copy queued on the server's stream
    c.put("ipc-shared", x, overwrite=True)
    body = f"""
        import torch, tensord
        client = tensord.connect({gpu_server.address!r})
        x = client.get("ipc-shared")
        t = torch.from_dlpack(x.t().narrow(0, 2, 10))
        assert t.device.type == "cuda" and t.shape == (10, 64), (t.device, t.shape)
        assert t.stride() == (1, 48), t.stride()
        assert float(t[0, 0]) == 3.0, float(t[0, 0])  # values[0, 2] + 1
        t.mul_(3)  # on torch's stream; the next call waits for it
        client.get("ipc-shared")
        stats = client.memory_stats("cuda:0")
        assert stats["exports.imported_segments.current"] == 1, stats
        del t
        client.close()
        print("done", flush=True)
        """
    env = {
        **os.environ,
        # this checkout first, then whatever the environment adds (carried packages)
        "PYTHONPATH": os.pathsep.join(
            [str(repo / "client"), str(repo / "server"), os.environ.get("PYTHONPATH", "")]
        ),
    }
    child = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(body)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 0, child.stderr
    expected = values + 1
    expected.T[2:12] *= 3
    np.testing.assert_array_equal(host(x), expected)
    assert (
        gpu_server.daemon.memory_reports.memory_stats(GPU)["exports.imported_segments.current"] == 0
    )
    c.delete("ipc-shared")


def test_the_pinned_cpu_pool_is_mapped_zero_copy_and_stays_pinned(
    gpu_server: RunningServer, c: Any
) -> None:
    from tensord_server.devices import cuda as cuda_backend

    values = np.arange(1 << 20, dtype=np.float32)
    x = c.tensor(values)
    alias = np.from_dlpack(x[::4])  # the pinned pool is a memfd pool: mappable
    np.testing.assert_array_equal(alias, values[::4])
    alias[1] = -5.0
    assert host(x.to(GPU))[4] == -5.0  # one DMA from the registered pages
    session = gpu_server.daemon.sessions.peek(c.session_id)
    storage = gpu_server.daemon.sessions.lookup(session, x.handle).storage
    assert cuda_backend.is_pinned(storage.block.segment.memory.address)
    del alias
