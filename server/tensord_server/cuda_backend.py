"""The CUDA backend: pool segments are raw ``cudaMalloc`` allocations made through CuPy.

CuPy's own memory pool is bypassed (``cupy.cuda.runtime.malloc``/``free``) so the
pool's figures are the truth about the device.  CuPy is imported when a CUDA
device is opened, never before: a machine without CuPy never loads this module.

Stream safety.  Every kernel and copy the server runs on a device is issued on
that device's one server-owned stream (:attr:`CudaBackend.stream`).  A block
freed after a kernel was queued, and handed out again, is only touched by work
queued later on the same stream, so the stream's order is the guarantee —
PyTorch's caching allocator relies on the same fact for single-stream use and
needs ``record_stream`` events only across streams.  Anything that hands bytes
to the host (``read``, downloads) synchronizes the stream first, so a download
returns only final bytes.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from tensord_server.backends import BackendOutOfMemory, DeviceMemory, check_range

# Capacity held back from the pool by default: CUDA contexts, cuBLAS workspaces and
# CuPy's kernel cache need device memory outside our pool.
DEFAULT_RESERVE_FRACTION = 0.05
DEFAULT_RESERVE_MIN_BYTES = 512 << 20

# Host staging buffers for cpu<->cuda copies: pinned memory reaches the bus's speed
# (about 55 GB/s on an H200 against ~6 GB/s pageable); each buffer is this large.
STAGING_BUFFER_BYTES = 64 << 20
# Pinned buffers kept for reuse; more are made on demand and dropped when returned.
STAGING_BUFFERS_KEPT = 4


def _cupy() -> Any:
    import cupy  # deferred: CuPy is an optional extra

    return cupy


def parse_index(device: str) -> int:
    """``"cuda:3"`` -> 3."""
    kind, _, index = device.partition(":")
    if kind != "cuda" or not index.isdigit():
        raise ValueError(f"not a CUDA device name: {device!r}")
    return int(index)


def default_capacity(free_bytes: int) -> int:
    """The pool's default cap: free memory at start minus a reserve for CUDA's own needs."""
    reserve = max(DEFAULT_RESERVE_MIN_BYTES, int(free_bytes * DEFAULT_RESERVE_FRACTION))
    return max(0, free_bytes - reserve)


class PinnedStagingPool:
    """Reusable page-locked host buffers for asynchronous host<->device copies.

    ``take`` hands out a NumPy uint8 array over pinned memory of at least the
    size asked; ``give_back`` returns it.  Buffers of the standard size are kept
    (up to :data:`STAGING_BUFFERS_KEPT`); larger ones are dropped.
    """

    def __init__(self, buffer_bytes: int = STAGING_BUFFER_BYTES) -> None:
        self.buffer_bytes = buffer_bytes
        self._lock = threading.Lock()  # guards _free
        self._free: list[Any] = []  # (pinned memory, array) pairs ready for reuse

    def take(self, nbytes: int) -> tuple[Any, np.ndarray]:
        if nbytes <= self.buffer_bytes:
            with self._lock:
                if self._free:
                    return self._free.pop()
            nbytes = self.buffer_bytes
        memory = _cupy().cuda.alloc_pinned_memory(nbytes)
        array = np.frombuffer(memory, dtype=np.uint8, count=nbytes)
        return memory, array

    def give_back(self, buffer: tuple[Any, np.ndarray]) -> None:
        if buffer[1].size != self.buffer_bytes:
            return
        with self._lock:
            if len(self._free) < STAGING_BUFFERS_KEPT:
                self._free.append(buffer)


class CudaBackend:
    """One CUDA device: raw ``cudaMalloc`` segments, one server stream, pinned staging."""

    def __init__(self, *, device: str = "cuda:0", total_bytes: int | None = None) -> None:
        cupy = _cupy()
        self.device = device
        self.index = parse_index(device)
        self.xp: Any = cupy
        count = cupy.cuda.runtime.getDeviceCount()
        if self.index >= count:
            raise ValueError(f"{device}: this machine has {count} CUDA device(s)")
        self._cuda_device = cupy.cuda.Device(self.index)
        with self._cuda_device:
            free_bytes, _total = cupy.cuda.runtime.memGetInfo()
            self.stream = cupy.cuda.Stream(non_blocking=True)
            name = cupy.cuda.runtime.getDeviceProperties(self.index)["name"]
        self.description = name.decode() if isinstance(name, bytes) else str(name)
        self.total_bytes = default_capacity(free_bytes) if total_bytes is None else int(total_bytes)
        self.staging = PinnedStagingPool()

    # -- the Backend protocol -------------------------------------------------

    def reserve(self, nbytes: int) -> DeviceMemory:
        cupy = _cupy()
        runtime = cupy.cuda.runtime
        try:
            with self._cuda_device:
                address = runtime.malloc(nbytes)
        except runtime.CUDARuntimeError as exc:
            if getattr(exc, "status", None) == runtime.errorMemoryAllocation:
                raise BackendOutOfMemory(
                    f"cudaMalloc of {nbytes} bytes on {self.device} failed"
                ) from exc
            raise
        return DeviceMemory(address=int(address), nbytes=nbytes, payload=self.index)

    def release(self, memory: DeviceMemory) -> None:
        if memory.nbytes == 0:
            return
        runtime = _cupy().cuda.runtime
        with self._cuda_device:
            # Work queued on the server stream may still read this segment.
            self.stream.synchronize()
            runtime.free(memory.address)

    def view(self, memory: DeviceMemory, offset: int, nbytes: int) -> Any:
        """A zero-copy CuPy uint8 array over ``nbytes`` of the segment from ``offset``."""
        check_range(memory, offset, nbytes)
        cupy = _cupy()
        if nbytes == 0:
            with self._cuda_device:
                return cupy.empty(0, dtype=cupy.uint8)
        unowned = cupy.cuda.UnownedMemory(
            memory.address + offset, nbytes, self, device_id=self.index
        )
        pointer = cupy.cuda.MemoryPointer(unowned, 0)
        return cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=pointer)

    def read(self, memory: DeviceMemory, offset: int, nbytes: int) -> bytes:
        out = np.empty(nbytes, dtype=np.uint8)
        self.copy_to_host(memory.address + offset, out)
        return out.tobytes()

    def write(self, memory: DeviceMemory, offset: int, data: bytes | memoryview) -> None:
        source = np.frombuffer(data, dtype=np.uint8)
        check_range(memory, offset, source.size)
        self.copy_from_host(source, memory.address + offset)

    # -- transfers through pinned staging ---------------------------------------

    def copy_to_host(self, device_address: int, out: np.ndarray) -> None:
        """Device bytes at ``device_address`` -> the contiguous uint8 array ``out``; final on return."""
        runtime = _cupy().cuda.runtime
        with self._cuda_device:
            buffer = self.staging.take(min(out.size, self.staging.buffer_bytes))
            try:
                staged = buffer[1]
                for start in range(0, out.size, staged.size):
                    count = min(staged.size, out.size - start)
                    runtime.memcpyAsync(
                        staged.ctypes.data,
                        device_address + start,
                        count,
                        runtime.memcpyDeviceToHost,
                        self.stream.ptr,
                    )
                    self.stream.synchronize()
                    out[start : start + count] = staged[:count]
            finally:
                self.staging.give_back(buffer)

    def copy_from_host(self, source: np.ndarray, device_address: int) -> None:
        """The contiguous uint8 array ``source`` -> device bytes at ``device_address``."""
        runtime = _cupy().cuda.runtime
        with self._cuda_device:
            buffer = self.staging.take(min(source.size, self.staging.buffer_bytes))
            try:
                staged = buffer[1]
                for start in range(0, source.size, staged.size):
                    count = min(staged.size, source.size - start)
                    # The previous chunk's copy must have left the staging buffer.
                    self.stream.synchronize()
                    staged[:count] = source[start : start + count]
                    runtime.memcpyAsync(
                        device_address + start,
                        staged.ctypes.data,
                        count,
                        runtime.memcpyHostToDevice,
                        self.stream.ptr,
                    )
                self.stream.synchronize()
            finally:
                self.staging.give_back(buffer)

    def synchronize(self) -> None:
        """Wait for every kernel and copy queued on the server stream."""
        with self._cuda_device:
            self.stream.synchronize()
