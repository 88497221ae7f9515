"""The CUDA support that runs without a GPU: device names, default capacities and
devices, the lazy import of CuPy, the clear error without it, and the backend's
logic (reserve, OOM mapping, pinned staging, stream order) against a fake ``cupy``.

The fake runs every "asynchronous" copy only when its stream (or an event
recorded after it) is synchronized, so a staging loop that reuses a buffer, or
reads one, before its copy ran moves wrong bytes and fails here.  Its array
module is NumPy, which checks the bfloat16 conversions against torch and ml_dtypes.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import importlib.util
import itertools
import os
import subprocess
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import tensord
from conftest import interrupted_after, run_serve, slowed_exports, start_server
from tensord import dtypes
from tensord.errors import FailedPreconditionError, OutOfMemoryError
from tensord.layout import Layout
from tensord_server.devices import cuda as cuda_backend
from tensord_server.devices import table as devices
from tensord_server.devices.memory import BackendOutOfMemory
from tensord_server.devices.shm import SharedHostBackend
from tensord_server.devices.table import DeviceSpec, DeviceTable, parse_device_spec, resolve_specs
from tensord_server.domain import kernels

GiB = 1 << 30
MiB = 1 << 20
SERVE_ARGS = ("--address", "127.0.0.1:0", "--device", "cuda:0")
HAVE_CUPY = importlib.util.find_spec("cupy") is not None


# ---------------------------------------------------------------------------
# pure math and parsing


def test_default_capacity_keeps_a_reserve() -> None:
    # 5% of free memory, at least 512 MiB, never below zero
    assert cuda_backend.default_capacity(80 * GiB) == 76 * GiB
    assert cuda_backend.default_capacity(4 * GiB) == 4 * GiB - 512 * MiB
    assert cuda_backend.default_capacity(512 * MiB) == 0
    assert cuda_backend.default_capacity(100 * MiB) == 0


def test_device_names() -> None:
    assert cuda_backend.parse_index("cuda:3") == 3
    for bad in ("cpu", "cuda", "cuda:x", "cuda:-1"):
        with pytest.raises(ValueError, match="not a CUDA device name"):
            cuda_backend.parse_index(bad)
    assert devices.canonical_device("cuda") == "cuda:0"
    assert parse_device_spec("cuda:1=40GiB") == DeviceSpec("cuda:1", 40 * GiB)
    assert parse_device_spec("cuda:01") == DeviceSpec("cuda:1")
    with pytest.raises(ValueError, match="unknown device 'gpu:0'"):
        parse_device_spec("gpu:0")


# ---------------------------------------------------------------------------
# without CuPy


@pytest.mark.slow
def test_importing_never_imports_cupy() -> None:
    code = (
        "import sys\n"
        "import tensord, tensord_server.rpc.grpc_server, tensord_server.rpc.handlers, tensord_server.tools.serve\n"
        "import tensord_server.domain.kernels, tensord_server.devices.table, tensord_server.devices.cuda\n"
        "from tensord_server.domain.store import TensorStore\n"
        "d = TensorStore(['cpu']); d.close()\n"
        "assert 'cupy' not in sys.modules, 'cupy imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.skipif(HAVE_CUPY, reason="CuPy is installed here")
def test_cuda_device_without_cupy_is_a_clear_error() -> None:
    with pytest.raises(
        FailedPreconditionError, match=r"needs CuPy: pip install 'tensord\[cuda12\]'"
    ):
        DeviceTable(["cpu", "cuda:0"])
    serve = run_serve(*SERVE_ARGS)
    assert serve.returncode == 2
    assert "device cuda:0 needs CuPy: pip install 'tensord[cuda12]' (or [cuda13])" in serve.stderr


@pytest.mark.skipif(HAVE_CUPY, reason="CuPy is installed here")
def test_default_devices_without_cupy() -> None:
    assert devices.gpu_count() == 0
    assert resolve_specs(None) == [DeviceSpec("cpu")]
    # asked for a GPU without CuPy: the cpu pool stays pageable, the GPU fails clearly
    assert resolve_specs(["cpu", "cuda:0"])[0] == DeviceSpec("cpu")


# ---------------------------------------------------------------------------
# a fake CuPy: host memory, copies that run when their stream is synchronized


class FakeCudaError(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(f"fake CUDA error {status}")
        self.status = status


class FakeStream:
    def __init__(self, runtime: FakeRuntime, non_blocking: bool = False) -> None:
        self.runtime = runtime
        self.queue: list[Callable[[], None]] = []  # copies not run yet, in order
        self.ptr = id(self)
        runtime.streams[self.ptr] = self

    def run_until(self, position: int) -> None:
        todo, self.queue = self.queue[:position], self.queue[position:]
        for op in todo:
            op()
        for event in self.runtime.events:
            if event.stream is self:
                event.position = max(0, event.position - position)

    def synchronize(self) -> None:
        self.run_until(len(self.queue))

    def record(self) -> FakeEvent:
        return FakeEvent(self)

    def wait_event(self, event: FakeEvent) -> None:
        event.synchronize()

    def __enter__(self) -> FakeStream:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class FakeEvent:
    def __init__(self, stream: FakeStream) -> None:
        self.stream = stream
        self.position = len(stream.queue)  # the copies queued before it
        stream.runtime.events.append(self)

    @property
    def done(self) -> bool:
        return self.position == 0

    def synchronize(self) -> None:
        self.stream.run_until(self.position)


class FakeDevice:
    def __init__(self, index: int = 0) -> None:
        self.id = index

    def __enter__(self) -> FakeDevice:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class FakeRuntime:
    errorMemoryAllocation = 2
    memcpyHostToDevice = 1
    memcpyDeviceToHost = 2
    CUDARuntimeError = FakeCudaError

    def __init__(self, count: int, free: int, physical: int) -> None:
        self.count = count
        self.free_bytes = free
        self.physical = physical  # what malloc really grants (other processes use the rest)
        self.in_use = 0
        self.buffers: dict[int, np.ndarray] = {}  # device allocations by address
        self.pinned: list[tuple[int, int]] = []  # (address, nbytes) of page-locked memory
        self.streams: dict[int, FakeStream] = {}
        self.events: list[FakeEvent] = []
        self.copies: list[tuple[str, int]] = []  # (kind, nbytes), as queued
        self.fail_status = 0  # nonzero: the next malloc fails with it
        # CUDA IPC: handles made, imports open by address, frees of imported allocations
        self.handles: dict[bytes, int] = {}
        self.open_imports: dict[int, int] = {}
        self.opened: list[int] = []  # flags of every ipcOpenMemHandle
        self.freed_while_imported: list[int] = []
        self.device_syncs = 0
        self.registrations: list[tuple[str, int, int]] = []  # (what, address, flags), in order

    def getDeviceCount(self) -> int:
        return self.count

    def memGetInfo(self) -> tuple[int, int]:
        return self.free_bytes, self.free_bytes

    def getDeviceProperties(self, index: int) -> dict[str, bytes]:
        return {"name": b"Fake GPU"}

    def malloc(self, nbytes: int) -> int:
        if self.fail_status:
            status, self.fail_status = self.fail_status, 0
            raise FakeCudaError(status)
        if self.in_use + nbytes > self.physical:
            raise FakeCudaError(self.errorMemoryAllocation)
        buffer = np.zeros(nbytes, dtype=np.uint8)
        self.buffers[buffer.ctypes.data] = buffer
        self.in_use += nbytes
        return int(buffer.ctypes.data)

    cudaIpcMemLazyEnablePeerAccess = 1

    def free(self, address: int) -> None:
        assert all(not s.queue for s in self.streams.values()), "freed with copies pending"
        if self.open_imports.get(address):  # CUDA: the allocation must outlive its importers
            self.freed_while_imported.append(address)
        self.in_use -= self.buffers.pop(address).size

    def memcpyAsync(self, dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
        self.copies.append(("h2d" if kind == self.memcpyHostToDevice else "d2h", nbytes))
        self.streams[stream].queue.append(lambda: ctypes.memmove(dst, src, nbytes))

    def pointerGetAttributes(self, address: int) -> Any:
        pinned = any(a <= address < a + n for a, n in self.pinned)
        return types.SimpleNamespace(type=1 if pinned else 0, device=0)

    # page-locking of memory the caller allocated: registering a range twice, or
    # unregistering one never registered, is cudaErrorHostMemoryAlready(Not)Registered
    def hostRegister(self, address: int, nbytes: int, flags: int) -> None:
        if any(a == address for a, _n in self.pinned):
            raise FakeCudaError(712)
        if self.fail_status:
            status, self.fail_status = self.fail_status, 0
            raise FakeCudaError(status)
        self.pinned.append((address, nbytes))
        self.registrations.append(("register", address, flags))

    def hostUnregister(self, address: int) -> None:
        registered = [(a, n) for a, n in self.pinned if a == address]
        if not registered:
            raise FakeCudaError(713)
        self.pinned.remove(registered[0])
        self.registrations.append(("unregister", address, 0))

    def deviceSynchronize(self) -> None:
        self.device_syncs += 1
        for stream in list(self.streams.values()):
            stream.synchronize()

    # CUDA IPC as the runtime behaves: a 64-byte handle of a whole allocation; opening it
    # maps the same memory (here: the same address, one process plays both sides);
    # closing an address not open is cudaErrorInvalidValue
    def ipcGetMemHandle(self, address: int) -> bytes:
        if address not in self.buffers:
            raise FakeCudaError(1)
        handle = address.to_bytes(8, "little") + bytes(56)
        self.handles[handle] = address
        return handle

    def ipcOpenMemHandle(self, handle: bytes, flags: int = 1) -> int:
        address = self.handles.get(bytes(handle)) if len(handle) == 64 else None
        if address is None or address not in self.buffers:
            raise FakeCudaError(400)  # cudaErrorInvalidResourceHandle
        self.opened.append(flags)
        self.open_imports[address] = self.open_imports.get(address, 0) + 1
        return address

    def ipcCloseMemHandle(self, address: int) -> None:
        if not self.open_imports.get(address):
            raise FakeCudaError(1)
        self.open_imports[address] -= 1


class FakePinnedMemory:
    def __init__(self, nbytes: int, runtime: FakeRuntime) -> None:
        self.buffer = bytearray(nbytes)
        self.ptr = ctypes.addressof(ctypes.c_char.from_buffer(self.buffer)) if nbytes else 0
        runtime.pinned.append((self.ptr, nbytes))


def fake_cupy(count: int = 1, free: int = 2 * GiB, physical: int = 2 * GiB) -> Any:
    runtime = FakeRuntime(count, free, physical)
    cuda = types.SimpleNamespace(
        runtime=runtime,
        Device=FakeDevice,
        Stream=lambda non_blocking=False: FakeStream(runtime, non_blocking),
        PinnedMemory=lambda nbytes: FakePinnedMemory(nbytes, runtime),
        PinnedMemoryPointer=lambda memory, offset: memoryview(memory.buffer)[offset:],
        UnownedMemory=FakeUnownedMemory,
        MemoryPointer=FakeMemoryPointer,
    )
    module = types.ModuleType("cupy")
    module.__spec__ = importlib.machinery.ModuleSpec("cupy", None)
    module.cuda = cuda  # type: ignore[attr-defined]
    # NumPy stands in for CuPy's array functions; "GPU arrays" are FakeGpuArrays
    for name in (
        "float32",
        "uint8",
        "uint16",
        "uint32",
        "where",
        "isnan",
        "abs",
        "rint",
        "signbit",
        "may_share_memory",
        "nextafter",
    ):
        setattr(module, name, getattr(np, name))
    module.ndarray = FakeGpuArray  # type: ignore[attr-defined]
    module.empty = lambda shape, dtype: np.empty(shape, dtype).view(FakeGpuArray)  # type: ignore[attr-defined]
    module.lib = types.SimpleNamespace(  # type: ignore[attr-defined]
        stride_tricks=types.SimpleNamespace(
            as_strided=lambda x, shape, strides: np.lib.stride_tricks.as_strided(
                x, shape, strides, subok=True
            )
        )
    )
    module.iscomplexobj = np.iscomplexobj  # type: ignore[attr-defined]
    module.broadcast_to = lambda x, shape: np.broadcast_to(x, shape, subok=True)  # type: ignore[attr-defined]
    module.int64, module.float64 = np.int64, np.float64  # type: ignore[attr-defined]
    module.arange = lambda *a, **k: np.arange(*a, **k).view(FakeGpuArray)  # type: ignore[attr-defined]
    module.ascontiguousarray = lambda x: np.ascontiguousarray(x).view(FakeGpuArray)  # type: ignore[attr-defined]
    return module


class FakeUnownedMemory:
    def __init__(self, ptr: int, size: int, owner: object, device_id: int = 0) -> None:
        self.ptr, self.size, self.owner, self.device_id = ptr, size, owner, device_id


class FakeMemoryPointer:
    def __init__(self, mem: FakeUnownedMemory, offset: int) -> None:
        self.mem, self.offset, self.ptr = mem, offset, mem.ptr + offset


class _FakeDeviceBytes:
    """The bytes of a memory pointer as an array source; keeps the pointer (and its owner)."""

    def __init__(self, memptr: FakeMemoryPointer) -> None:
        self.memptr = memptr
        self.__array_interface__ = {
            "version": 3,
            "shape": (memptr.mem.size - memptr.offset,),
            "typestr": "|u1",
            "data": (memptr.ptr, False),
        }


class FakeGpuArray(np.ndarray):
    """A "CuPy array" on fake GPU 0: host memory, with CuPy's ``device`` and ``data.ptr``;
    ``FakeGpuArray(shape, dtype, memptr=, strides=)`` is over a memory pointer, as CuPy's."""

    def __new__(
        cls, shape: Any, dtype: Any = float, memptr: Any = None, strides: Any = None
    ) -> FakeGpuArray:
        source = np.asarray(_FakeDeviceBytes(memptr))
        return np.ndarray.__new__(cls, shape, dtype, buffer=source, strides=strides)

    @property
    def device(self) -> FakeDevice:
        return FakeDevice(0)

    @property
    def data(self) -> Any:  # type: ignore[override]
        return types.SimpleNamespace(ptr=self.ctypes.data)


def on_gpu(array: np.ndarray) -> FakeGpuArray:
    return np.array(array).view(FakeGpuArray)


@pytest.fixture
def cupy(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    module = fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", module)
    monkeypatch.setattr(cuda_backend, "_GPUS", {})
    monkeypatch.setattr(cuda_backend, "_PEERS", set())
    yield module
    assert not module.cuda.runtime.freed_while_imported, "cudaFree of an imported segment"


def small_staging(buffer_bytes: int = 4096, kept: int = 1) -> cuda_backend.PinnedStagingPool:
    pool = cuda_backend.PinnedStagingPool(buffer_bytes, kept)
    cuda_backend.gpu(0).staging = pool
    return pool


# ---------------------------------------------------------------------------
# the backend against the fake


def test_default_devices_are_cpu_and_every_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    module = fake_cupy(count=2)
    monkeypatch.setitem(sys.modules, "cupy", module)
    assert devices.gpu_count() == 2
    assert resolve_specs(None) == [
        DeviceSpec("cpu", pinned=True),
        DeviceSpec("cuda:0"),
        DeviceSpec("cuda:1"),
    ]
    assert resolve_specs(None, pinned_host=False)[0] == DeviceSpec("cpu")
    assert resolve_specs(["cpu=1GiB", "cuda:1"]) == [
        DeviceSpec("cpu", GiB, pinned=True),
        DeviceSpec("cuda:1"),
    ]
    assert resolve_specs(["cpu"]) == [DeviceSpec("cpu")]  # no GPU owned: nothing to pin for

    def broken() -> int:
        raise RuntimeError("no CUDA driver")

    module.cuda.runtime.getDeviceCount = broken
    assert devices.gpu_count() == 0


def test_capacity_and_missing_gpu(cupy: Any) -> None:
    table = DeviceTable(["cuda:0", DeviceSpec("cpu", pinned=True)])
    gpu = table.get("cuda:0")
    assert gpu.description == "Fake GPU"
    assert gpu.backend.total_bytes == cuda_backend.default_capacity(2 * GiB)
    assert table.get("cpu").description == "host memory (pinned)"
    capped = DeviceTable([parse_device_spec("cuda:0=1GiB")]).get("cuda:0")
    assert capped.pool.memory_stats()["reserved_bytes.all.current"] == 0
    assert capped.backend.total_bytes == GiB
    with pytest.raises(FailedPreconditionError, match=r"cuda:1: this machine has 1 CUDA device"):
        DeviceTable(["cuda:1"])

    def no_driver() -> int:
        raise FakeCudaError(35)  # cudaErrorInsufficientDriver

    cupy.cuda.runtime.getDeviceCount = no_driver
    with pytest.raises(FailedPreconditionError, match=r"cuda:0: CUDA is not usable on this"):
        DeviceTable(["cuda:0"])


def test_reserve_maps_cuda_oom(cupy: Any) -> None:
    runtime = cupy.cuda.runtime
    backend = cuda_backend.CudaBackend(device="cuda:0")
    memory = backend.reserve(MiB)
    assert memory.nbytes == MiB and memory.payload == 0
    runtime.physical = MiB  # the GPU is full: cudaMalloc fails
    with pytest.raises(BackendOutOfMemory, match=r"cudaMalloc of 4096 bytes on cuda:0 failed"):
        backend.reserve(4096)
    runtime.fail_status = 999  # any other CUDA error is not an OOM
    with pytest.raises(FakeCudaError):
        backend.reserve(4096)
    backend.release(memory)
    assert runtime.in_use == 0


def test_pool_oom_on_a_full_gpu_names_the_figures(cupy: Any) -> None:
    cupy.cuda.runtime.physical = 64 * MiB  # the pool may reserve 1 GiB, the GPU grants 64 MiB
    device = DeviceTable([parse_device_spec("cuda:0=1GiB")]).get("cuda:0")
    block = device.pool.malloc(40 * MiB)
    with pytest.raises(OutOfMemoryError, match="Tried to allocate") as info:
        device.pool.malloc(40 * MiB)
    assert isinstance(info.value, RuntimeError)
    stats = device.pool.memory_stats()
    assert stats["num_ooms"] == 1
    assert stats["allocated_bytes.all.current"] == 40 * MiB
    device.pool.free(block)
    device.pool.empty_cache()
    assert cupy.cuda.runtime.in_use == 0


@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4096, 4097, 3 * 4096 + 5])
def test_write_and_read_through_staging(cupy: Any, nbytes: int) -> None:
    runtime = cupy.cuda.runtime
    backend = cuda_backend.CudaBackend(device="cuda:0")
    staging = small_staging(kept=1)  # one buffer: every chunk reuses it
    memory = backend.reserve(max(nbytes, 1) + 100)
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    backend.write(memory, 100, data)
    assert [n for _, n in runtime.copies] == [min(4096, nbytes - s) for s in range(0, nbytes, 4096)]
    assert backend.read(memory, 100, nbytes) == data  # read waits for the queued writes
    assert staging.made <= 2
    assert all(not s.queue for s in runtime.streams.values())
    backend.release(memory)


def test_writes_return_before_their_copies_run(cupy: Any) -> None:
    backend = cuda_backend.CudaBackend(device="cuda:0")
    small_staging(kept=4)
    memory = backend.reserve(8192)
    backend.write(memory, 0, b"\x07" * 8192)
    assert len(backend.stream.queue) == 2  # queued, not waited for: the upload overlaps
    assert runtime_bytes(cupy, memory.address, 8192) == b"\x00" * 8192
    backend.synchronize()
    assert runtime_bytes(cupy, memory.address, 8192) == b"\x07" * 8192
    backend.release(memory)  # release itself waits for the stream (the fake checks)


def runtime_bytes(cupy: Any, address: int, nbytes: int) -> bytes:
    return ctypes.string_at(address, nbytes)


def test_pinned_host_memory_takes_one_dma(cupy: Any) -> None:
    runtime = cupy.cuda.runtime
    host = cuda_backend.PinnedHostBackend()
    memory = host.reserve(10_000)
    assert memory.address % 512 == 0 and cuda_backend.is_pinned(memory.address)
    source = host.view(memory, 0, 10_000)
    source[:] = np.arange(10_000) % 251
    gpu = cuda_backend.gpu(0)
    staging = small_staging()
    device = cuda_backend.CudaBackend(device="cuda:0").reserve(10_000)
    gpu.copy_from_host(source, device.address)
    out = host.view(host.reserve(10_000), 0, 10_000)
    gpu.copy_to_host(device.address, out)
    assert runtime.copies == [("h2d", 10_000), ("d2h", 10_000)]
    assert staging.made == 0
    np.testing.assert_array_equal(out, source)


def test_pinned_host_segments_are_registered_memfds_unregistered_before_closing(
    cupy: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = cupy.cuda.runtime
    host = cuda_backend.PinnedHostBackend()
    assert isinstance(host, SharedHostBackend)  # same-host clients may map it
    first, second = host.reserve(8192), host.reserve(4096)
    assert host.reserve(0).nbytes == 0  # a zero-byte segment: nothing to register
    segment = host.segment(first)
    assert segment is not None and os.fstat(segment.fd).st_size == 8192  # a memfd
    assert cuda_backend.is_pinned(first.address) and cuda_backend.is_pinned(second.address)
    portable = cuda_backend.CUDA_HOST_REGISTER_PORTABLE
    assert runtime.registrations == [
        ("register", first.address, portable),
        ("register", second.address, portable),
    ]
    # unregistered first, while the segment (its memfd and the server's mapping) still is
    seen_at_unregister: list[bool] = []
    unregister = runtime.hostUnregister

    def watching(address: int) -> None:
        seen_at_unregister.append(host.segment_by_id(segment.id) is not None and segment.fd >= 0)
        unregister(address)

    monkeypatch.setattr(runtime, "hostUnregister", watching)
    host.release(first)
    assert seen_at_unregister == [True]
    assert host.segment_by_id(segment.id) is None and segment.fd == -1
    host.release(second)
    assert_paired(runtime.registrations)
    assert runtime.registrations[2:] == [
        ("unregister", first.address, 0),
        ("unregister", second.address, 0),
    ]
    assert not runtime.pinned and host.live_segments() == 0


def test_a_refused_registration_releases_the_segment(cupy: Any) -> None:
    runtime = cupy.cuda.runtime
    host = cuda_backend.PinnedHostBackend()
    runtime.fail_status = runtime.errorMemoryAllocation
    with pytest.raises(BackendOutOfMemory, match="pinned host allocation of 4096 bytes"):
        host.reserve(4096)
    runtime.fail_status = 999  # any other error is not an out-of-memory
    with pytest.raises(FakeCudaError):
        host.reserve(4096)
    assert host.live_segments() == 0 and not runtime.registrations


def test_a_pinned_cpu_pool_is_mapped_by_same_host_clients(cupy: Any) -> None:
    running = start_server(devices=(DeviceSpec("cpu", 64 << 20, pinned=True),))
    try:
        assert isinstance(running.daemon.devices.get("cpu").backend, cuda_backend.PinnedHostBackend)
        with tensord.connect(running.address) as client:
            values = np.arange(1 << 16, dtype=np.float32)
            x = client.tensor(values)
            alias = np.from_dlpack(x[1::2])  # zero copy: before, a BufferError
            np.testing.assert_array_equal(alias, values[1::2])
            alias[0] = -1.0
            assert x[1].item() == -1.0
            # the server computes on pinned pages (its address, not this mapping's)
            session = running.daemon.sessions.peek(client.session_id)
            storage = running.daemon.sessions.lookup(session, x.handle).storage
            assert cuda_backend.is_pinned(storage.block.segment.memory.address)
            del alias
            client.flush()
        backend = running.daemon.devices.get("cpu").backend
        assert len(cupy.cuda.runtime.pinned) == backend.live_segments() > 0
        running.daemon.memory_reports.empty_cache("cpu")
        assert backend.live_segments() == 0
    finally:
        running.stop()
    assert_paired(cupy.cuda.runtime.registrations)
    assert not cupy.cuda.runtime.pinned


def assert_paired(registrations: list[tuple[str, int, int]]) -> None:
    """Each address unregistered only while registered, registered only while not."""
    registered: set[int] = set()
    for what, address, _flags in registrations:
        if what == "register":
            assert address not in registered
            registered.add(address)
        else:
            assert address in registered
            registered.remove(address)


def test_staging_pool_reuses_after_the_copy() -> None:
    runtime = FakeRuntime(1, GiB, GiB)
    stream = FakeStream(runtime)
    pool = cuda_backend.PinnedStagingPool(16, kept=1)
    pool._new = lambda: cuda_backend.StagingBuffer(None, np.zeros(16, np.uint8))  # type: ignore[method-assign]
    first = pool.take()
    done: list[int] = []
    stream.queue.append(lambda: done.append(1))
    pool.give_back(first, stream.record())
    assert pool.take() is first and done == [1]  # waited for the copy before handing it out
    second = pool.take()  # none free: a new one
    assert second is not first
    pool.give_back(first)
    stream.queue.append(lambda: done.append(2))
    pool.give_back(second, stream.record())  # beyond `kept`: dropped after its copy ran
    assert done == [1, 2]


# ---------------------------------------------------------------------------
# bfloat16 conversions (NumPy standing in for CuPy), checked against torch


def _interesting_floats() -> np.ndarray:
    rng = np.random.default_rng(0)
    special = [0.0, -0.0, 1.0, -1.5, np.inf, -np.inf, np.nan, 3.4e38, -3.4e38, 1e-40, 1e-45]
    ties = [1 + 2.0**-8, 1 + 3 * 2.0**-8, 2.0**24 + 2.0**16, 1 + 2.0**-8 + 2.0**-30]
    randoms = rng.standard_normal(2000) * 10.0 ** rng.integers(-30, 30, 2000)
    return np.concatenate([special, ties, randoms])


@pytest.mark.torch
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.int64, np.bool_])
def test_bfloat16_rounding_matches_torch(cupy: Any, dtype: Any) -> None:
    """torch is the oracle: it rounds float64 to bfloat16 through float32 (1 + 2**-8 + 2**-30
    gives 16256), where ml_dtypes 0.7 rounds float64 directly (16257)."""
    torch = pytest.importorskip("torch")
    with np.errstate(all="ignore"):
        values = _interesting_floats().astype(dtype)
    expected = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy()
    expected = expected.view(np.uint16)
    got = np.asarray(cuda_backend.float32_to_bfloat16_bits(on_gpu(values)))
    assert got.dtype == np.uint16
    # a NaN's payload bits are not torch's promise (its CPU kernels give 0xffff): NaN stays NaN
    nan = np.isnan(values) if values.dtype.kind == "f" else np.zeros(values.shape, bool)
    assert nan.any() == (values.dtype.kind == "f")
    np.testing.assert_array_equal(got[~nan], expected[~nan])
    assert ((got[nan] & 0x7F80) == 0x7F80).all() and (got[nan] & 0x007F).all()


def test_bfloat16_from_float64_keeps_float32_subnormals_where_the_gpu_flushes_them(
    cupy: Any, monkeypatch: Any
) -> None:
    """On an H200, CuPy's float64 -> float32 astype flushed float32 subnormals to zero
    (1e-40 became bfloat16 0; torch on the CPU gives 9.18e-41): the fake GPU flushes
    them too here, and the bits must still be the CPU's (float64 -> float32 -> bfloat16)."""

    def flushing_astype(self: Any, dtype: Any, *args: Any, **kwargs: Any) -> Any:
        out = np.ndarray.astype(self, dtype, *args, **kwargs)
        if self.dtype == np.float64 and np.dtype(dtype) == np.float32:
            out[np.abs(out) < np.float32(2.0**-126)] *= 0  # keeps the sign, as a GPU's FTZ
        return out

    monkeypatch.setattr(FakeGpuArray, "astype", flushing_astype)
    subnormals = [1e-40, -1e-40, 1e-45, 7e-46, 1.5 * 2.0**-149, 2.5 * 2.0**-149]
    edges = [2.0**-126 * (1 - 2.0**-25), 2.0**-126, 5e-324, -0.0, 0.0]
    values = np.concatenate([subnormals, edges, _interesting_floats()])
    with np.errstate(all="ignore"):
        narrow = values.astype(np.float32)
    np.testing.assert_array_equal(
        np.asarray(cuda_backend.float64_to_float32_bits(on_gpu(values))), narrow.view(np.uint32)
    )
    got = cuda_backend.float32_to_bfloat16_bits(on_gpu(values))
    np.testing.assert_array_equal(got, narrow.astype(ml_dtypes.bfloat16).view(np.uint16))


def test_bfloat16_array_conversions(cupy: Any) -> None:
    values = _interesting_floats()[:64].astype(ml_dtypes.bfloat16)
    array = cuda_backend.BFloat16Array(on_gpu(values.view(np.uint16)).reshape(8, 8))
    assert array.shape == (8, 8) and array.dtype == np.dtype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(
        array.to_float32(), values.astype(np.float32).reshape(8, 8)
    )  # exact, NaNs included (assert_array_equal treats NaN == NaN)
    view = array[1:3].reshape(16)
    view[...] = 2.5  # a scalar, as the host pool's NumPy arrays convert it
    assert (array.bits[1:3] == np.array(2.5, ml_dtypes.bfloat16).view(np.uint16)).all()
    array[0] = on_gpu(np.array([1 + 3j] * 8, dtype=np.complex64))  # complex -> real part
    assert (array.to_float32()[0] == 1.0).all()
    other = cuda_backend.BFloat16Array(on_gpu(np.full((8,), 0x4049, np.uint16)))  # bits as they are
    array[7] = other
    assert (array.bits[7] == 0x4049).all()


# ---------------------------------------------------------------------------
# cross-device copies through kernels.assign (the fake's "GPU" is host memory)


def _gpu_tensor(cupy: Any, values: np.ndarray, dtype: Any) -> Any:
    """The array the server would make over a fresh contiguous Storage of ``dtype`` on cuda:0."""
    layout = Layout.contiguous(values.shape)
    raw = on_gpu(np.zeros(max(values.size, 1) * dtype.itemsize, np.uint8))
    array = kernels.strided_array(cupy, raw, layout, dtype)
    kernels.assign(cupy, array, kernels.to_module(cupy, values))
    return array


def test_contiguous_same_dtype_copies_go_straight(cupy: Any) -> None:
    runtime = cupy.cuda.runtime
    small_staging(4096, kept=2)
    values = np.random.default_rng(1).standard_normal((33, 65)).astype(np.float32)
    gpu_array = _gpu_tensor(cupy, values, dtypes.float32)
    assert runtime.copies == [("h2d", 4096)] * 2 + [("h2d", 33 * 65 * 4 - 8192)]  # no temporary
    host = np.zeros_like(values)
    assert kernels.to_module(np, gpu_array) is gpu_array  # assign moves it, knowing the target
    kernels.assign(np, host, kernels.to_module(np, gpu_array))
    np.testing.assert_array_equal(host, values)
    assert [kind for kind, _ in runtime.copies].count("d2h") == 3
    assert all(not s.queue for s in runtime.streams.values())  # a download waits for its copies


def test_strided_and_converting_copies(cupy: Any) -> None:
    small_staging(256, kept=2)
    values = np.random.default_rng(2).standard_normal((6, 10))
    gpu_array = _gpu_tensor(cupy, values[:, ::3].T, dtypes.float32)  # strided, float64 -> float32
    np.testing.assert_array_equal(
        cuda_backend.array_to_host(gpu_array), values[:, ::3].T.astype(np.float32)
    )
    host = np.zeros((4, 6), np.int16)
    kernels.assign(np, host, gpu_array)  # GPU -> host, converted on the host
    np.testing.assert_array_equal(host, values[:, ::3].T.astype(np.float32).astype(np.int16))


@pytest.mark.parametrize("to_gpu", [False, True])
def test_cross_device_copies_go_a_piece_at_a_time(
    cupy: Any, monkeypatch: pytest.MonkeyPatch, to_gpu: bool
) -> None:
    # a broadcast (expanded) source, converted: the temporaries it was gathered into were the
    # destination's whole size, outside the pool; now each is at most one piece
    monkeypatch.setattr(cuda_backend, "CROSS_DEVICE_PIECE_BYTES", 256)
    small_staging(256, kept=2)
    moved: list[int] = []
    for name in ("array_to_host", "array_to_device"):
        original = getattr(cuda_backend, name)

        def counted(array: Any, *args: Any, _original: Any = original) -> Any:
            moved.append(array.size * array.dtype.itemsize)
            return _original(array, *args)

        monkeypatch.setattr(cuda_backend, name, counted)
    row = np.arange(33, dtype=np.float32) * 1.5
    expected = np.broadcast_to(row, (40, 33)).astype(np.float64)
    if to_gpu:
        dst = _gpu_tensor(cupy, np.zeros((40, 33)), dtypes.float64)
        kernels.assign(cupy, dst, np.broadcast_to(row, (40, 33)))
        pieces = list(moved)
        result = cuda_backend.array_to_host(dst)
    else:
        src = _gpu_tensor(cupy, row, dtypes.float32)
        result = np.zeros((40, 33), np.float64)
        kernels.assign(np, result, cupy.broadcast_to(src, (40, 33)))
        pieces = list(moved)
    np.testing.assert_array_equal(result, expected)
    assert pieces and max(pieces) <= 256, pieces


@pytest.mark.parametrize("source", ["float64", "bfloat16", "int32"])
def test_bfloat16_tensors_on_a_gpu(cupy: Any, source: str) -> None:
    small_staging(256, kept=2)
    values = (np.random.default_rng(3).standard_normal((5, 7)) * 100).astype(
        dtypes.dtype_from_name(source).numpy_dtype
    )
    array = _gpu_tensor(cupy, values, dtypes.bfloat16)
    assert isinstance(array, cuda_backend.BFloat16Array) and array.shape == (5, 7)
    expected = values.astype(np.float32).astype(ml_dtypes.bfloat16)
    back = cuda_backend.array_to_host(array)
    assert back.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(back.view(np.uint16), expected.view(np.uint16))
    # logical_chunks (strided downloads, a few rows at a time) sees the bits
    chunks = list(kernels.logical_chunks(array.reshape(7, 5)[::2], 2, 16))
    assert all(type(c) is bytes for c in chunks) and [len(c) for c in chunks] == [16, 16, 8]
    flat = np.frombuffer(b"".join(chunks), np.uint16)
    np.testing.assert_array_equal(flat, expected.reshape(7, 5)[::2].reshape(-1).view(np.uint16))
    kernels.fill(cupy, array[1:3], 2.5)
    assert (cuda_backend.array_to_host(array)[1:3] == 2.5).all()
    as_float = np.zeros((5, 7), np.float64)
    kernels.assign(np, as_float, array)
    np.testing.assert_array_equal(as_float, cuda_backend.array_to_host(array).astype(np.float64))


def test_arange_in_bfloat16_on_a_gpu(cupy: Any) -> None:
    values = kernels.arange_values(cupy, 0, 3.3, 0.1, dtypes.bfloat16)
    expected = kernels.arange_values(np, 0, 3.3, 0.1, dtypes.bfloat16)
    array = _gpu_tensor(cupy, np.zeros(expected.shape), dtypes.bfloat16)
    kernels.assign(cupy, array, values)
    np.testing.assert_array_equal(
        cuda_backend.array_to_host(array).view(np.uint16), expected.view(np.uint16)
    )


def test_complex_to_bool_on_a_gpu_is_nonzero(cupy: Any) -> None:
    # torch: 1j -> True (nonzero), not its real part 0 -> False
    values = np.array([1j, 0j, 2 + 0j, -0.5j], np.complex64)
    gpu_bool = _gpu_tensor(cupy, np.zeros(4, np.bool_), dtypes.bool)
    kernels.assign(cupy, gpu_bool, _gpu_tensor(cupy, values, dtypes.complex64))
    np.testing.assert_array_equal(cuda_backend.array_to_host(gpu_bool), [True, False, True, True])
    kernels.fill(cupy, gpu_bool, 0j)
    kernels.fill(cupy, gpu_bool[:1], 1j)
    np.testing.assert_array_equal(cuda_backend.array_to_host(gpu_bool), [True, False, False, False])
    host_bool = np.zeros(4, np.bool_)  # GPU -> host converts on the host
    kernels.assign(np, host_bool, _gpu_tensor(cupy, values, dtypes.complex128))
    np.testing.assert_array_equal(host_bool, [True, False, True, True])


# ---------------------------------------------------------------------------
# the steady state of a loop of GPU copies (bench_cuda's contiguous())


def _count_calls(
    monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, counts: dict[str, int]
) -> None:
    original = getattr(owner, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        counts[name] = counts.get(name, 0) + 1
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)


def test_a_loop_of_contiguous_copies_reuses_its_segments(
    cupy: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``x.t().contiguous()`` in a loop, as bench_cuda times it, each result dropped at once:
    the SDK sends a release after the next call's ops (or on its 50 ms timer), so one or two
    earlier results are still alive when the next is allocated, and two may be freed
    together.  Once the loop has run, no call reserves or gives back a segment: on an H200
    each such call paid a cudaMalloc of 1 GiB and a cudaFree (which waits for the device),
    about 4 ms beside a 1.9 ms copy.  The freed blocks are reused at once: the copies into
    them are queued on the server stream after the work that read them."""
    from tensord_server.domain.ops.views import ViewOp
    from tensord_server.domain.store import TensorStore
    from tensord_server.pool import policy_named

    runtime = cupy.cuda.runtime
    daemon = TensorStore(["cpu=64MiB", "cuda:0=512MiB"])
    daemon.start()  # as tensord serve: with its background compactor
    try:
        pool = daemon.devices.get("cuda:0").pool
        pool.policy = policy_named("adaptive")  # tensord serve's default
        pool.clock = lambda: 0.0  # nothing idle decays meanwhile
        session, _ = daemon.sessions.open()
        values = np.arange(1536 * 2048, dtype=np.float32).reshape(1536, 2048)  # 12 MiB: a segment
        square = daemon.transfers.upload(
            session, values.shape, "float32", "cuda:0", values.nbytes, [values.tobytes()]
        ).handle
        cuda_backend.gpu(
            0
        ).stream.synchronize()  # the fake's kernels run at once, not after queued copies
        counts: dict[str, int] = {}
        _count_calls(monkeypatch, runtime, "malloc", counts)
        _count_calls(monkeypatch, runtime, "free", counts)
        alive: list[str] = []
        for call in range(12):
            if call == 4:  # the loop has run: from here on, the steady state
                counts.clear()
            (t,) = daemon.views.view(session, square, ViewOp("t"))
            out = daemon.copies.contiguous(session, t.handle)
            daemon.sessions.release(session, [t.handle])
            alive.append(out.handle)
            # the releases that reached the server before the next call: all but the
            # latest result, or all but the latest two (a release that waited for the timer)
            late = 1 if call % 2 else 2
            daemon.sessions.release(session, alive[:-late])
            del alive[:-late]
        assert counts == {}, "a loop of copies reserved or gave back segments"
        last = b"".join(daemon.transfers.download(session, alive[-1]))
        np.testing.assert_array_equal(np.frombuffer(last, np.float32).reshape(2048, 1536), values.T)
    finally:
        daemon.close()


# ---------------------------------------------------------------------------
# CUDA IPC (same-host zero copy of GPU Storages) against the fake


@pytest.fixture
def gpu_server(cupy: Any) -> Iterator[Any]:
    from conftest import start_server

    running = start_server(devices=("cpu=64MiB", "cuda:0=64MiB"))
    yield running
    running.stop()


def _imported(server: Any) -> tuple[int, int]:
    stats = server.daemon.memory_reports.memory_stats("cuda:0")
    return stats["exports.imported_segments.current"], stats["exports.imported_bytes.current"]


def test_a_gpu_export_is_an_ipc_import_of_final_bytes(cupy: Any, gpu_server: Any) -> None:
    import tensord

    runtime = cupy.cuda.runtime
    values = np.arange(48, dtype=np.float32).reshape(6, 8)
    with tensord.connect(gpu_server.address) as client:
        x = client.tensor(values, device="cuda:0")  # its copies stay queued on the stream
        assert x.__dlpack_device__() == (2, 0)
        view = x.t().narrow(0, 1, 5)
        alias = np.from_dlpack(view)  # the fake's capsules are NumPy's over the same bytes
        # Export synchronized the server stream first: the queued upload is visible
        np.testing.assert_array_equal(alias, values.T[1:6])
        assert runtime.opened == [runtime.cudaIpcMemLazyEnablePeerAccess]
        syncs = runtime.device_syncs
        alias *= 2  # the consumer's write, ordered before the next call
        np.testing.assert_array_equal(x.cpu().numpy()[:, 1:6], values[:, 1:6] * 2)
        assert runtime.device_syncs > syncs  # the call waited for this process's GPU work
        second = np.from_dlpack(x)  # a second export of the same segment: opened once
        assert len(runtime.opened) == 1 and sum(runtime.open_imports.values()) == 1
        assert _imported(gpu_server)[0] == 1
        del alias, second
        client._conn.flush_releases()  # the import is closed and reported
        assert sum(runtime.open_imports.values()) == 0
        assert _imported(gpu_server) == (0, 0)


def test_a_segment_with_imports_is_never_returned_to_the_device(cupy: Any, gpu_server: Any) -> None:
    import tensord
    from tensord import schema as pb

    runtime = cupy.cuda.runtime
    pool = gpu_server.daemon.devices.get("cuda:0").pool
    with tensord.connect(gpu_server.address) as client:
        local = client._local
        local.close_idle_imports = lambda: []  # a client that keeps its import open
        x = client.zeros(10 * MiB, dtype=tensord.float32, device="cuda:0")  # 40 MiB
        alias = np.from_dlpack(x)
        del x, alias  # the handle and the export end; the segment stays imported
        client._conn.flush_releases()
        assert sum(runtime.open_imports.values()) == 1
        assert _imported(gpu_server) == (1, 40 * MiB)
        gpu_server.daemon.memory_reports.empty_cache("cuda:0")  # vetoed
        with pytest.raises(OutOfMemoryError):  # the OOM release is vetoed too
            client.zeros(13 * MiB, dtype=tensord.float32, device="cuda:0")  # 52 MiB
        assert pool.memory_stats()["reserved_bytes.all.current"] == 40 * MiB
        assert not runtime.freed_while_imported
        del local.close_idle_imports
        closed = local.close_idle_imports()
        assert [(c.segment_id, c.exports) for c in closed] == [(closed[0].segment_id, 1)]
        client._conn.call("ReleaseExports", pb.ReleaseExportsRequest(closed_imports=closed))
        assert _imported(gpu_server) == (0, 0)
        gpu_server.daemon.memory_reports.empty_cache("cuda:0")
        assert pool.memory_stats()["reserved_bytes.all.current"] == 0


def test_a_sessions_imports_end_with_it(cupy: Any, gpu_server: Any) -> None:
    import tensord

    client = tensord.connect(gpu_server.address)
    x = client.ones(1000, device="cuda:0")
    alias = np.from_dlpack(x)
    assert _imported(gpu_server)[0] == 1
    client.close()  # the array outlives the client: its import stays open, the count ends
    assert _imported(gpu_server) == (0, 0)
    assert alias.sum() == 1000
    cupy.cuda.runtime.ipcCloseMemHandle(next(iter(cupy.cuda.runtime.handles.values())))


@pytest.mark.parametrize("open_import", [False, True], ids=["none-open", "segment-open"])
def test_an_interrupted_gpu_export_leaves_no_import_counted(
    cupy: Any, gpu_server: Any, open_import: bool
) -> None:
    """Ctrl-C while a GPU Export is in flight: the server counted an import of the segment
    for the session, which the client never opened (it never saw the answer).  The client
    reports it closed (with its open import of the segment when it has one, whose count
    must then match), so the segment can be freed (before: vetoed until the session ended)."""

    from conftest import wait_until

    runtime = cupy.cuda.runtime
    pool = gpu_server.daemon.devices.get("cuda:0").pool
    table = gpu_server.daemon.exports
    slow_export, answered = slowed_exports(table)  # the interrupt lands meanwhile

    with tensord.connect(gpu_server.address) as client:
        x = client.zeros(10 * MiB, dtype=tensord.float32, device="cuda:0")  # 40 MiB
        alias = np.from_dlpack(x) if open_import else None
        assert _imported(gpu_server)[0] == (1 if open_import else 0)
        table.export = slow_export
        try:
            with interrupted_after(0.05):
                np.from_dlpack(x)
        finally:
            del table.export
        assert answered.wait(5)
        session_id = client.session_id
        assert wait_until(lambda: client.flush() or table.count(session_id) == int(open_import))
        assert sum(runtime.open_imports.values()) == int(open_import)
        assert _imported(gpu_server) == ((1, 40 * MiB) if open_import else (0, 0))
        del alias, x  # the open import (if any) closes: its report covers both Exports
        client._conn.flush_releases()
        assert sum(runtime.open_imports.values()) == 0
        assert _imported(gpu_server) == (0, 0)
        gpu_server.daemon.memory_reports.empty_cache("cuda:0")
        assert pool.memory_stats()["reserved_bytes.all.current"] == 0


def test_a_gpu_export_a_client_without_cupy_drops_leaves_no_import_counted(
    cupy: Any, gpu_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client without CuPy falls back to gRPC; the import the server counted for the
    Export it could not open is reported closed, so the segment can be freed."""
    from tensord.local import cuda_ipc

    def no_cupy() -> Any:
        raise ImportError("No module named 'cupy'")

    pool = gpu_server.daemon.devices.get("cuda:0").pool
    with tensord.connect(gpu_server.address) as client:
        x = client.zeros(10 * MiB, dtype=tensord.float32, device="cuda:0")  # 40 MiB
        monkeypatch.setattr(cuda_ipc, "load_cupy", no_cupy)
        assert client._local.export(x.handle) is None
        assert "needs CuPy" in client._local.last_refusal
        del x
        client._conn.flush_releases()
        assert _imported(gpu_server) == (0, 0)
        gpu_server.daemon.memory_reports.empty_cache("cuda:0")
        assert pool.memory_stats()["reserved_bytes.all.current"] == 0


def test_an_unopened_import_is_reported_only_in_its_own_session() -> None:
    """A session replaced meanwhile (its end dropped its counts): reported in the new one,
    the close would lower the count of an import the new session may hold open."""
    from tensord import schema as pb
    from tensord.local import mapper as local_mapper

    conn = types.SimpleNamespace(session_id="old")
    mapper = local_mapper.LocalMapper(conn, enabled=True)  # type: ignore[arg-type]
    answer = pb.ExportResponse(device="cuda:0", ipc_handle=b"h", segment_id=7)
    mapper._never_opened("old", answer)
    mapper._never_opened("old", answer)
    mapper._never_opened("old", pb.ExportResponse(device="cpu", segment_id=8))  # no import
    conn.session_id = "new"
    mapper._never_opened("new", pb.ExportResponse(device="cuda:0", ipc_handle=b"h", segment_id=9))
    assert [(c.segment_id, c.exports) for c in mapper.close_idle_imports()] == [(9, 1)]
    assert mapper.close_idle_imports() == []  # reported once


def test_an_export_answered_while_its_import_closes_keeps_the_count(cupy: Any) -> None:
    from tensord_server.domain.exports import ExportTable

    table = ExportTable.__new__(ExportTable)
    table._lock = __import__("threading").Lock()
    table._imports = {5: {"s": 3}}
    table._import_sizes = {5: ("cuda:0", MiB)}
    session = types.SimpleNamespace(id="s")
    table.imports_closed(session, [(5, 2)])  # the client closed after two; a third is in flight
    assert table._imports == {5: {"s": 1}}
    table.imports_closed(types.SimpleNamespace(id="other"), [(5, 9)])  # not its import
    assert table._imports == {5: {"s": 1}}
    table.imports_closed(session, [(5, 1)])
    assert table._imports == {} and table._import_sizes == {}


def test_a_zero_byte_gpu_export_for_a_session_that_ended_meanwhile_keeps_no_hold() -> None:
    """The session ended between the export's hold and its add (its end released nothing of
    this export's): the export is refused and its hold dropped, as every other export's is
    (it was kept, counted for the dead session, with its Storage held, for good)."""
    from tensord_server.domain.exports import ExportTable

    table = ExportTable.__new__(ExportTable)
    table._lock = __import__("threading").Lock()
    table._exports, table._per_session, table._imports, table._import_sizes = {}, {}, {}, {}
    table.instance, table._export_ids = "i", itertools.count(1)  # the export ids' parts
    table.sessions = types.SimpleNamespace(
        refuse_beyond_limit=lambda session, wanted=1: None, peek=lambda session_id: None
    )
    released: list[Any] = []
    table.storages = types.SimpleNamespace(release_hold=released.append)
    memory = types.SimpleNamespace(nbytes=0)
    storage = types.SimpleNamespace(
        block=types.SimpleNamespace(segment=types.SimpleNamespace(memory=memory))
    )
    session = types.SimpleNamespace(id="s")
    with pytest.raises(tensord.errors.NotFoundError, match="unknown session"):
        table._export_cuda(session, storage, None)
    assert table.count("s") == 0 and table._exports == {} and released == [storage]


def test_lazy_bits_of_a_host_source_for_a_gpu_destination_stay_on_the_host() -> None:
    """x_cuda.conj().copy_(y_cpu): to_module leaves the host source on the host (one DMA
    later), so its stored form is computed by NumPy, the source's own module (CuPy refuses
    NumPy arrays), whatever the destination's device."""
    source = np.array([1 + 2j, 3 - 4j], dtype=np.complex64)
    stored = kernels.apply_lazy_bits(source, True, False)
    assert isinstance(stored, np.ndarray)
    np.testing.assert_array_equal(stored, np.conj(source))
    negated = kernels.apply_lazy_bits(np.array([1, 2], np.uint8), False, True, np.float32)
    np.testing.assert_array_equal(negated, np.array([-1.0, -2.0], np.float32))
