"""The CUDA backend: pool segments are raw ``cudaMalloc`` allocations made through CuPy.

CuPy's own memory pool is bypassed (``cupy.cuda.runtime.malloc``/``free``) so the
pool's figures are the truth about the device.  (Temporaries of copies — a
strided source gathered before a transfer, a source overlapping its
destination — come from CuPy's pool, out of the reserve held back from ours.)
CuPy is imported when a CUDA device is opened, never before: a machine without
CuPy never imports it.

Stream safety.  Every kernel and copy the server runs on a GPU is issued on
that GPU's one server-owned stream (:class:`Gpu`, one per GPU per process,
shared by every pool on it).  A block freed after a kernel was queued, and
handed out again, is only touched by work queued later on the same stream, so
the stream's order is the guarantee — PyTorch's caching allocator relies on the
same fact for single-stream use and needs ``record_stream`` events only across
streams.  The exceptions wait explicitly: anything that hands bytes to the host
(``read``, downloads, cuda->cpu copies) waits for its copy, so a download
returns only final bytes; a DMA from pinned host memory waits (the host may
reuse it at once); a peer copy waits on an event of the source GPU's stream
and finishes before it returns, so neither GPU's pool reuses a block it reads;
a pinned staging buffer is reused only after the event of its last copy.
Uploads (``write``) return once their chunk is staged, with the copy still
queued: that overlaps the network with the copies.  Compaction's moves
(``copy``) are queued on the server stream too and not waited for: whatever
later reads the new block or reuses the old one is queued after them on that
stream, and releasing a segment synchronizes the stream first; a background move,
whose copy runs outside the pool's lock, waits for it before repointing the Storage.

Nothing here imports CuPy at import time; ``kernels`` and ``devices`` reach this
module only for GPU arrays and devices.
"""

from __future__ import annotations

import collections
import contextlib
import sys
import threading
from typing import Any

import ml_dtypes
import numpy as np

from tensord_server.devices.host_copies import assign_host, complex_to_real, gather_plan
from tensord_server.devices.memory import (
    BackendOutOfMemory,
    DeviceMemory,
    check_range,
)
from tensord_server.devices.shm import SharedHostBackend, next_segment_id

# Capacity held back from the pool by default: CUDA contexts, cuBLAS workspaces and
# CuPy's kernel cache need device memory outside our pool.
DEFAULT_RESERVE_FRACTION = 0.05
DEFAULT_RESERVE_MIN_BYTES = 512 << 20

# Host staging buffers for cpu<->cuda copies: pinned memory reaches the bus's speed
# (about 55 GB/s on an H200 against ~6 GB/s pageable); each buffer is this large.
STAGING_BUFFER_BYTES = 64 << 20
# Pinned buffers kept for reuse per GPU; more are made on demand and dropped when returned.
STAGING_BUFFERS_KEPT = 4
# cudaPointerAttributes.type of page-locked host memory (cudaMemoryTypeHost).
CUDA_MEMORY_TYPE_HOST = 1
# cudaHostRegisterPortable: the cpu pool's pages count as pinned for every GPU of the server,
# not only the one current when a segment was registered
CUDA_HOST_REGISTER_PORTABLE = 1


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


class StagingBuffer:
    """One page-locked host buffer and the event of the last asynchronous copy that used it."""

    __slots__ = ("array", "event", "memory")

    def __init__(self, memory: Any, array: np.ndarray) -> None:
        self.memory = memory  # the cupy.cuda.PinnedMemory that owns the bytes
        self.array = array  # a NumPy uint8 array over them
        self.event: Any = None  # recorded after the last copy queued on it; None when idle


class PinnedStagingPool:
    """Reusable page-locked host buffers for asynchronous host<->device copies.

    ``take`` hands out a buffer of :attr:`buffer_bytes` whose last copy has
    finished (it waits on that copy's event); ``give_back`` returns it with the
    event of the copy just queued on it, so a buffer is reused only after the
    GPU is done with it and a caller never waits for its own copy to finish
    before queueing the next one (that is the overlap).  Up to
    :data:`STAGING_BUFFERS_KEPT` buffers are kept; more are made on demand and
    dropped when given back.
    """

    def __init__(
        self, buffer_bytes: int = STAGING_BUFFER_BYTES, kept: int = STAGING_BUFFERS_KEPT
    ) -> None:
        self.buffer_bytes = buffer_bytes
        self.kept = kept
        self._lock = threading.Lock()  # guards _free
        self._free: list[StagingBuffer] = []  # oldest first: its copy is the likeliest done
        self.made = 0  # buffers allocated so far (pinned allocations are slow: tests count them)

    def take(self) -> StagingBuffer:
        """An idle buffer if there is one; else a new one while fewer than ``kept`` wait
        for their copies; else the oldest, once its copy is done."""
        buffer = None
        with self._lock:
            for i, candidate in enumerate(self._free):
                if candidate.event is None or candidate.event.done:
                    buffer = self._free.pop(i)
                    break
            else:
                if len(self._free) >= self.kept:
                    buffer = self._free.pop(0)
        if buffer is None:
            buffer = self._new()
        if buffer.event is not None:
            buffer.event.synchronize()
            buffer.event = None
        return buffer

    def give_back(self, buffer: StagingBuffer, event: Any = None) -> None:
        buffer.event = event
        with self._lock:
            if len(self._free) < self.kept:
                self._free.append(buffer)
                return
        if event is not None:  # dropped: its memory must outlive the copy still using it
            event.synchronize()

    def _new(self) -> StagingBuffer:
        cuda = _cupy().cuda
        memory = cuda.PinnedMemory(self.buffer_bytes)
        pointer = cuda.PinnedMemoryPointer(memory, 0)
        array = np.frombuffer(pointer, dtype=np.uint8, count=self.buffer_bytes)
        self.made += 1
        return StagingBuffer(memory, array)


def is_pinned(address: int) -> bool:
    """Whether host ``address`` is page-locked (cudaHostAlloc'd or registered)."""
    runtime = _cupy().cuda.runtime
    try:
        attributes = runtime.pointerGetAttributes(address)
    except runtime.CUDARuntimeError:  # CUDA < 11 refuses pageable pointers
        return False
    return int(getattr(attributes, "type", 0)) == CUDA_MEMORY_TYPE_HOST


class Gpu:
    """What every pool on one GPU shares in this process: the server stream and the staging.

    One per GPU index (:func:`gpu`), so that two servers in one process (tests)
    and the cross-device copies in :mod:`tensord_server.domain.kernels` order their work
    on the same stream as the device's kernels.
    """

    def __init__(self, index: int) -> None:
        cupy = _cupy()
        self.index = index
        self.device = cupy.cuda.Device(index)
        with self.device:
            self.stream = cupy.cuda.Stream(non_blocking=True)
        self.staging = PinnedStagingPool()

    def context(self) -> contextlib.ExitStack:
        """This GPU as the current device and its server stream as the current stream."""
        stack = contextlib.ExitStack()
        stack.enter_context(self.device)
        stack.enter_context(self.stream)
        return stack

    def copy_to_host(self, device_address: int, out: np.ndarray) -> None:
        """Device bytes at ``device_address`` -> the contiguous uint8 array ``out``; final on return.

        Pinned ``out`` takes one DMA; pageable ``out`` goes through the staging
        buffers, the copy of chunk k+1 running while chunk k is unpacked.
        """
        runtime = _cupy().cuda.runtime
        if out.size == 0:
            return
        with self.device:
            if is_pinned(out.ctypes.data):
                runtime.memcpyAsync(
                    out.ctypes.data,
                    device_address,
                    out.size,
                    runtime.memcpyDeviceToHost,
                    self.stream.ptr,
                )
                self.stream.synchronize()
                return
            pending: collections.deque[tuple[StagingBuffer, Any, int, int]] = collections.deque()
            try:
                for start in range(0, out.size, self.staging.buffer_bytes):
                    count = min(self.staging.buffer_bytes, out.size - start)
                    buffer = self.staging.take()
                    pending.append((buffer, None, start, count))
                    runtime.memcpyAsync(
                        buffer.array.ctypes.data,
                        device_address + start,
                        count,
                        runtime.memcpyDeviceToHost,
                        self.stream.ptr,
                    )
                    pending[-1] = (buffer, self.stream.record(), start, count)
                    if len(pending) > 1:
                        self._unstage(pending.popleft(), out)
                while pending:
                    self._unstage(pending.popleft(), out)
            finally:
                for buffer, event, _, _ in pending:  # only after an error
                    self.staging.give_back(buffer, event)

    def _unstage(self, item: tuple[StagingBuffer, Any, int, int], out: np.ndarray) -> None:
        buffer, event, start, count = item
        event.synchronize()
        out[start : start + count] = buffer.array[:count]
        self.staging.give_back(buffer)

    def copy_from_host(self, source: np.ndarray, device_address: int, *, wait: bool = True) -> None:
        """The contiguous uint8 array ``source`` -> device bytes at ``device_address``.

        Pinned ``source`` takes one DMA and always waits (the host may reuse it
        on return).  Pageable ``source`` is packed into staging buffers, the copy
        of chunk k running while chunk k+1 is packed; ``source`` is free to reuse
        on return either way.  ``wait=False`` returns with the last copies still
        queued on the server stream: anything later on that stream sees the
        bytes, and a download synchronizes first (that is how an upload overlaps
        the network with the copies).
        """
        runtime = _cupy().cuda.runtime
        if source.size == 0:
            return
        with self.device:
            if is_pinned(source.ctypes.data):
                runtime.memcpyAsync(
                    device_address,
                    source.ctypes.data,
                    source.size,
                    runtime.memcpyHostToDevice,
                    self.stream.ptr,
                )
                self.stream.synchronize()
                return
            for start in range(0, source.size, self.staging.buffer_bytes):
                count = min(self.staging.buffer_bytes, source.size - start)
                buffer = self.staging.take()
                event = None
                try:
                    buffer.array[:count] = source[start : start + count]
                    runtime.memcpyAsync(
                        device_address + start,
                        buffer.array.ctypes.data,
                        count,
                        runtime.memcpyHostToDevice,
                        self.stream.ptr,
                    )
                    event = self.stream.record()
                finally:
                    self.staging.give_back(buffer, event)
            if wait:
                self.stream.synchronize()

    def copy_from_peer(self, dst_address: int, src_gpu: Gpu, src_address: int, nbytes: int) -> None:
        """Device bytes of ``src_gpu`` -> this GPU, after the work queued on the source's
        stream (which produced them); final on return, so the source may be reused."""
        runtime = _cupy().cuda.runtime
        if nbytes == 0:
            return
        _enable_peer_access(self, src_gpu)
        with src_gpu.device:
            ready = src_gpu.stream.record()
        with self.device:
            self.stream.wait_event(ready)
            runtime.memcpyPeerAsync(
                dst_address, self.index, src_address, src_gpu.index, nbytes, self.stream.ptr
            )
            self.stream.synchronize()


_GPUS: dict[int, Gpu] = {}  # by CUDA device index; guarded by _GPUS_LOCK
_GPUS_LOCK = threading.Lock()
_PEERS: set[tuple[int, int]] = set()  # (device, peer) pairs already asked for peer access


def gpu(index: int) -> Gpu:
    """The process-wide :class:`Gpu` of CUDA device ``index`` (made on first use)."""
    with _GPUS_LOCK:
        state = _GPUS.get(index)
        if state is None:
            state = _GPUS[index] = Gpu(index)
        return state


def _enable_peer_access(dst: Gpu, src: Gpu) -> None:
    """Direct peer copies where the hardware allows (else the driver stages through the host)."""
    pair = (dst.index, src.index)
    with _GPUS_LOCK:
        if pair in _PEERS:
            return
        _PEERS.add(pair)
    runtime = _cupy().cuda.runtime
    if not runtime.deviceCanAccessPeer(dst.index, src.index):
        return
    # already enabled (by CuPy itself, say) is fine
    with dst.device, contextlib.suppress(runtime.CUDARuntimeError):
        runtime.deviceEnablePeerAccess(src.index)


class CudaBackend:
    """One CUDA device: raw ``cudaMalloc`` segments, the GPU's server stream, pinned staging."""

    # a cudaFree waits for the whole device and a cudaMalloc maps the segment afresh: the
    # pool keeps wholly free segments for its policy's release_idle_s instead of giving
    # back at once those over keep_idle_fraction (pool.backend.costly_segment_churn)
    costly_segment_churn = True

    def __init__(self, *, device: str = "cuda:0", total_bytes: int | None = None) -> None:
        cupy = _cupy()
        self.device = device
        self.index = parse_index(device)
        self.xp: Any = cupy
        count = cupy.cuda.runtime.getDeviceCount()
        if self.index >= count:
            raise ValueError(f"{device}: this machine has {count} CUDA device(s)")
        self.gpu = gpu(self.index)
        self._cuda_device = self.gpu.device
        self.stream = self.gpu.stream
        self.staging = self.gpu.staging
        with self._cuda_device:
            free_bytes, _total = cupy.cuda.runtime.memGetInfo()
            name = cupy.cuda.runtime.getDeviceProperties(self.index)["name"]
        self.description = name.decode() if isinstance(name, bytes) else str(name)
        self.total_bytes = default_capacity(free_bytes) if total_bytes is None else int(total_bytes)
        # CUDA IPC (same-host zero copy): each exported segment's id and handle, by address
        self._ipc_lock = threading.Lock()
        self._ipc: dict[int, tuple[int, bytes]] = {}

    # -- the Backend protocol -------------------------------------------------

    def reserve(self, nbytes: int) -> DeviceMemory:
        runtime = _cupy().cuda.runtime
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
        with self._ipc_lock:  # a later segment at this address gets a new id and handle
            self._ipc.pop(memory.address, None)
        with self._cuda_device:
            # Work queued on the server stream may still read this segment.
            self.stream.synchronize()
            runtime.free(memory.address)

    # -- CUDA IPC -------------------------------------------------------------

    def ipc_export(self, memory: DeviceMemory) -> tuple[int, bytes]:
        """(segment id, cudaIpcMemHandle_t) of a segment, for a same-host client to open.

        Waits first for every kernel and copy queued on the server stream: the
        importer's work is on its own streams and must see the bytes final.  The
        handle is made once per segment (cudaIpcGetMemHandle of the whole
        cudaMalloc allocation) and cached until the segment is released.
        """
        self.synchronize()
        with self._ipc_lock:
            known = self._ipc.get(memory.address)
        if known is not None:
            return known
        runtime = _cupy().cuda.runtime
        with self._cuda_device:
            handle = bytes(runtime.ipcGetMemHandle(memory.address))
        with self._ipc_lock:
            return self._ipc.setdefault(memory.address, (next_segment_id(), handle))

    def ipc_segment_id(self, memory: DeviceMemory) -> int | None:
        """The id of a segment ever exported (None: never exported, so never imported)."""
        with self._ipc_lock:
            known = self._ipc.get(memory.address)
        return None if known is None else known[0]

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
        """Final bytes: the copy waits for every kernel queued before it on the server stream."""
        check_range(memory, offset, nbytes)
        out = np.empty(nbytes, dtype=np.uint8)
        self.gpu.copy_to_host(memory.address + offset, out)
        return out.tobytes()

    def write(self, memory: DeviceMemory, offset: int, data: bytes | memoryview) -> None:
        """Queues the copy on the server stream and returns once ``data`` is staged (uploads
        write chunk after chunk: the next chunk arrives while this one is copied)."""
        source = np.frombuffer(data, dtype=np.uint8)
        check_range(memory, offset, source.size)
        self.gpu.copy_from_host(source, memory.address + offset, wait=False)

    def copy(
        self,
        src: DeviceMemory,
        src_offset: int,
        dst: DeviceMemory,
        dst_offset: int,
        nbytes: int,
    ) -> None:
        """A compaction move, device to device, queued on the server stream (see the
        module's stream-safety note: nothing needs to wait for it)."""
        check_range(src, src_offset, nbytes)
        check_range(dst, dst_offset, nbytes)
        if nbytes == 0:
            return
        runtime = _cupy().cuda.runtime
        with self._cuda_device:
            runtime.memcpyAsync(
                dst.address + dst_offset,
                src.address + src_offset,
                nbytes,
                runtime.memcpyDeviceToDevice,
                self.stream.ptr,
            )

    # -- transfers through pinned staging ---------------------------------------

    def copy_to_host(self, device_address: int, out: np.ndarray) -> None:
        self.gpu.copy_to_host(device_address, out)

    def copy_from_host(self, source: np.ndarray, device_address: int) -> None:
        self.gpu.copy_from_host(source, device_address)

    def synchronize(self) -> None:
        """Wait for every kernel and copy queued on the server stream."""
        with self._cuda_device:
            self.stream.synchronize()


class PinnedHostBackend(SharedHostBackend):
    """Host memory for the ``cpu`` pool of a server that owns a GPU: page-locked, so
    cpu<->cuda copies of its Storages are one DMA each, with no staging, and mappable by
    same-host clients like :class:`SharedHostBackend`'s.

    Each segment is a memfd mapping (what clients map) registered with
    ``cudaHostRegister`` (what makes it page-locked) once mapped, and unregistered in
    ``release`` before anything else: the server's mapping is unmapped only after, when the
    last array over it is collected.  Never decommits: registered pages stay the GPU's
    DMA targets, so a hole punched in the memfd would leave the CPU faulting in new pages
    that copies to and from the GPU never see.
    """

    can_decommit = False

    def __init__(self, *, device: str = "cpu", total_bytes: int | None = None) -> None:
        super().__init__(device=device, total_bytes=total_bytes)
        self.description = "host memory (pinned)"

    def reserve(self, nbytes: int) -> DeviceMemory:
        memory = super().reserve(nbytes)
        if nbytes == 0:
            return memory
        runtime = _cupy().cuda.runtime
        try:
            runtime.hostRegister(memory.address, nbytes, CUDA_HOST_REGISTER_PORTABLE)
        except runtime.CUDARuntimeError as exc:
            super().release(memory)  # never registered: nothing to unregister
            if getattr(exc, "status", None) == runtime.errorMemoryAllocation:
                raise BackendOutOfMemory(
                    f"pinned host allocation of {nbytes} bytes failed"
                ) from exc
            raise
        return memory

    def release(self, memory: DeviceMemory) -> None:
        if memory.nbytes:
            runtime = _cupy().cuda.runtime
            # a failure leaves nothing to undo: the pages go with the mapping either way
            with contextlib.suppress(runtime.CUDARuntimeError):
                runtime.hostUnregister(memory.address)
        super().release(memory)


# ---------------------------------------------------------------------------
# bfloat16 on CuPy
#
# CuPy has no bfloat16 dtype.  A bfloat16 tensor on a GPU is a BFloat16Array: a
# CuPy uint16 array of the same shape and strides over the same bytes.  Copies
# between bfloat16 tensors move the bits; conversions go through float32, as
# c10's BFloat16 does (to float32: the bits shifted left by 16, exact; from
# float32: round to nearest even on the upper half, NaN kept quiet, as
# c10::round_to_nearest_even and ml_dtypes do; wider sources are first rounded
# to float32, as torch's and ml_dtypes' casts are).


class BFloat16Array:
    """A bfloat16 array on a GPU: a CuPy uint16 array ``bits`` read as bfloat16.

    Supports what the copy kernels use: ``shape``, ``dtype``, indexing and
    ``reshape`` (views), ``[...] = value`` (scalars, bfloat16 or any CuPy array)
    and :meth:`to_float32`.
    """

    __slots__ = ("bits",)

    def __init__(self, bits: Any) -> None:
        self.bits = bits

    dtype = np.dtype(ml_dtypes.bfloat16)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.bits.shape)

    @property
    def ndim(self) -> int:
        return int(self.bits.ndim)

    @property
    def size(self) -> int:
        return int(self.bits.size)

    @property
    def device(self) -> Any:
        return self.bits.device

    def __getitem__(self, key: Any) -> BFloat16Array:
        return BFloat16Array(self.bits[key])

    def reshape(self, *shape: Any) -> BFloat16Array:
        return BFloat16Array(self.bits.reshape(*shape))

    def __setitem__(self, key: Any, value: Any) -> None:
        if isinstance(value, BFloat16Array):
            self.bits[key] = value.bits
        elif _is_cupy_array(value):
            self.bits[key] = float32_to_bfloat16_bits(value)
        else:  # a scalar, converted exactly as the host pool's NumPy arrays convert it
            host = np.empty((), dtype=self.dtype)
            host[...] = value
            self.bits[key] = host.view(np.uint16)

    def to_float32(self) -> Any:
        """The values as a CuPy float32 array (exact)."""
        cupy = _cupy()
        return (self.bits.astype(cupy.uint32) << 16).view(cupy.float32)

    def __repr__(self) -> str:
        return f"BFloat16Array(shape={self.shape}, device={self.bits.device})"


def float32_to_bfloat16_bits(values: Any) -> Any:
    """A CuPy array of any real or complex dtype -> bfloat16 bits (uint16), rounded to nearest even."""
    cupy = _cupy()
    if values.dtype.kind == "c":
        values = values.real  # torch: a complex -> real copy drops the imaginary part
    if values.dtype == cupy.float64:
        wide, nan = float64_to_float32_bits(values), cupy.isnan(values)
    else:
        narrow = values.astype(cupy.float32)
        wide, nan = narrow.view(cupy.uint32), cupy.isnan(narrow)
    rounded = (wide + (((wide >> 16) & 1) + 0x7FFF)) >> 16
    quiet_nan = (wide >> 16) | 0x0040
    bits = cupy.where(nan, quiet_nan, rounded)
    return bits.astype(cupy.uint16)


# float32's smallest normal, and the scale that makes a float32 subnormal's bits an integer
_FLOAT32_TINY = 2.0**-126
_FLOAT32_SUBNORMAL_SCALE = 2.0**149


def float64_to_float32_bits(values: Any) -> Any:
    """float64 -> float32 bits (uint32), rounded to nearest even as a CPU rounds, float32
    subnormals included: on an H200, CuPy's float64 -> float32 ``astype`` flushed them to
    zero (1e-40 -> 0; torch on the CPU: 9.18e-41), so a bfloat16 made from it differed.
    A value below the smallest normal is scaled exactly (a power of two, in float64) so
    that its subnormal's mantissa bits are an integer, rounded half to even by ``rint``
    (rounding up to 2**23 is the smallest normal's bits, as it should be)."""
    cupy = _cupy()
    bits = values.astype(cupy.float32).view(cupy.uint32)
    magnitude = cupy.abs(values)
    tiny = magnitude < _FLOAT32_TINY  # False for NaN
    scaled = cupy.where(tiny, magnitude, 0.0) * _FLOAT32_SUBNORMAL_SCALE  # < 2**23: no overflow
    sign = cupy.signbit(values).astype(cupy.uint32) << 31
    return cupy.where(tiny, sign | cupy.rint(scaled).astype(cupy.uint32), bits)


# ---------------------------------------------------------------------------
# copies that cross devices (cpu<->cuda, cuda:i<->cuda:j), for kernels.assign


def _is_cupy_array(value: Any) -> bool:
    cupy = sys.modules.get("cupy")
    return cupy is not None and isinstance(value, cupy.ndarray)


def is_gpu_array(value: Any) -> bool:
    """A CuPy array or a BFloat16Array.  Never imports CuPy (without it, no such arrays exist)."""
    return isinstance(value, BFloat16Array) or _is_cupy_array(value)


def _bits(array: Any) -> Any:
    return array.bits if isinstance(array, BFloat16Array) else array


def _contiguous(array: Any) -> Any:
    """``array`` itself when C-contiguous, else a C-contiguous copy (0-d stays 0-d)."""
    return array if array.flags.c_contiguous else array.copy(order="C")


def array_to_host(array: Any) -> np.ndarray:
    """A GPU array -> a NumPy array of the same shape and dtype, through pinned staging.

    Gathered on its own GPU (a strided array is made contiguous there, on the
    server stream, after any work queued on it), then copied; final on return.
    """
    raw = _bits(array)
    state = gpu(raw.device.id)
    with state.context():
        flat = _contiguous(raw)
        host = np.empty(raw.shape, dtype=raw.dtype)
        state.copy_to_host(flat.data.ptr, host.reshape(-1).view(np.uint8))
        del flat  # the copy has finished: CuPy's pool may hand it out again
    return host.view(BFloat16Array.dtype) if isinstance(array, BFloat16Array) else host


def array_to_device(array: Any, index: int) -> Any:
    """A NumPy array, or a GPU array on another GPU, -> a GPU array on GPU ``index``.

    From the host: packed into pinned staging and copied on the server stream
    (the caller's kernels follow on that stream).  From another GPU: gathered
    there, then one peer copy ordered after the source's stream; both final on
    return, so the source Storage may be freed and reused at once.
    """
    cupy = _cupy()
    target = gpu(index)
    if not is_gpu_array(array):  # a NumPy array
        bf16 = array.dtype == BFloat16Array.dtype
        host = _contiguous(array.view(np.uint16) if bf16 else array)
        with target.context():
            out = cupy.empty(host.shape, dtype=host.dtype)
            target.copy_from_host(host.reshape(-1).view(np.uint8), out.data.ptr)
        return BFloat16Array(out) if bf16 else out
    raw = _bits(array)
    source = gpu(raw.device.id)
    if source is target:
        return array
    with source.context():
        flat = _contiguous(raw)
    with target.context():
        out = cupy.empty(raw.shape, dtype=raw.dtype)
        target.copy_from_peer(out.data.ptr, source, flat.data.ptr, flat.nbytes)
    del flat
    return BFloat16Array(out) if isinstance(array, BFloat16Array) else out


def _host_bits(array: np.ndarray) -> np.ndarray:
    return array.view(np.uint16) if array.dtype == BFloat16Array.dtype else array


def _copy_straight(dst: Any, src: Any) -> bool:
    """One copy, host<->GPU, when both sides hold the same elements in the same
    contiguous order (``x.to(device)`` of a contiguous tensor): a DMA straight
    into the destination when the host side is pinned (the cpu pool of a server
    owning a GPU), else through the staging buffers, with no temporary.  False
    (nothing done) when dtypes, shapes or layouts differ."""
    to_host = not is_gpu_array(dst)
    host, device = (dst, src) if to_host else (src, dst)
    if host.dtype != device.dtype:  # bfloat16 on both sides compares equal here
        return False
    host, device = _host_bits(host), _bits(device)
    if not (host.shape == device.shape and host.flags.c_contiguous and device.flags.c_contiguous):
        return False
    state = gpu(device.device.id)
    host_bytes = host.reshape(-1).view(np.uint8)
    with state.context():
        if to_host:
            state.copy_to_host(device.data.ptr, host_bytes)
        else:
            state.copy_from_host(host_bytes, device.data.ptr)
    return True


# A copy across devices that cannot go straight (converting, strided, broadcast) moves
# this many destination bytes at a time: its temporaries (the gathered source, host or
# GPU) are pieces, never the whole tensor, whose logical size may be any expand's.
CROSS_DEVICE_PIECE_BYTES = 4 << 20


def _broadcast_to(array: Any, shape: tuple[int, ...]) -> Any:
    """A zero-copy broadcast of a NumPy, CuPy or BFloat16 array (torch's copy_ rules)."""
    if isinstance(array, BFloat16Array):
        return BFloat16Array(_cupy().broadcast_to(array.bits, shape))
    if _is_cupy_array(array):
        return _cupy().broadcast_to(array, shape)
    return np.broadcast_to(array, shape)


def assign(dst: Any, src: Any) -> None:
    """``dst[...] = src`` when either side is on a GPU, with torch's conversions.

    Same-device copies are one CuPy kernel.  Across devices, a copy that is not
    one straight DMA goes a piece of the destination at a time (the gather plan):
    each piece of the source is brought to the destination's device, then
    converted and scattered there.
    """
    if _same_gpu(dst, src) or dst.ndim == 0:
        _assign_piece(dst, src)
        return
    if _copy_straight(dst, src):  # one DMA, no temporary
        return
    src = _broadcast_to(src, dst.shape)
    itemsize = max(dst.dtype.itemsize, src.dtype.itemsize)
    for key in gather_plan(dst.shape, itemsize, CROSS_DEVICE_PIECE_BYTES):
        _assign_piece(dst[key], src[key])


def _same_gpu(dst: Any, src: Any) -> bool:
    return is_gpu_array(dst) and is_gpu_array(src) and _bits(dst).device.id == _bits(src).device.id


def _assign_piece(dst: Any, src: Any) -> None:
    if not is_gpu_array(dst):  # GPU -> host
        if not _copy_straight(dst, src):
            assign_host(np, dst, array_to_host(src))
        return
    cupy = _cupy()
    index = _bits(dst).device.id
    if not is_gpu_array(src):  # host -> GPU
        if _copy_straight(dst, src):
            return
        src = array_to_device(src, index)
    elif _bits(src).device.id != index:
        src = array_to_device(src, index)
    with gpu(index).context():
        if is_gpu_array(src) and cupy.may_share_memory(_bits(dst), _bits(src)):
            src = BFloat16Array(src.bits.copy()) if isinstance(src, BFloat16Array) else src.copy()
        if isinstance(src, BFloat16Array) and not isinstance(dst, BFloat16Array):
            src = src.to_float32()
        if src.dtype.kind == "c" and dst.dtype.kind != "c":
            src = complex_to_real(src, dst.dtype)
        dst[...] = src
