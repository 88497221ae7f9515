"""Same-host zero copy, the SDK's side: segment mappings, exports and arrays over pooled bytes.

A client on the server's host asks the server to *export* a tensor's Storage
(``Export``: the Storage is pinned in place) and maps the pool segment holding it,
once per segment: the server hands the segment's memfd over its fd socket to whoever
presents the one-time ticket the Export returned.  Anything failing there (another
host, another user, an older server) turns the fast path off for the client, silently:
every transfer then goes through gRPC as before.  ``tensord.connect(local=False)`` or
``$TENSORD_LOCAL=0`` turn it off from the start.

Mappings are cached by (server instance, segment id) and unmapped once no array over
them is alive and the server says the segment is gone (it answers that with each
batch of ReleaseExports).  An :class:`Export` lives while any array made over it does;
when the last one is collected its id is queued and sent in the next batch.  While a cpu
export made for DLPack lives, another ``__dlpack__`` of any view of the same Storage in the
same session reuses it (:meth:`LocalMapper.shared_export`): no Export RPC.

A GPU segment is *imported* instead: the Export's answer carries its CUDA IPC handle
(the server synchronized its stream first, so every op queued before is complete),
opened once per (server instance, segment) with ``cupy.cuda.runtime.ipcOpenMemHandle``;
arrays over it are CuPy arrays (:class:`CudaExport`), whose DLPack capsules are of
device kDLCUDA.  The server never frees a segment a session imported, so an import is
closed (``ipcCloseMemHandle``) as soon as no array over it is alive, at the next batch
of ReleaseExports, which reports it closed.  While imports are open, every call the
client makes first waits for the GPUs it imported from (``cudaDeviceSynchronize``):
the consumer's writes, on whatever stream, are complete before the server's next op.
CuPy is needed only here, and imported only for a GPU export.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import ctypes
import functools
import hmac
import itertools
import math
import mmap
import os
import socket
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from tensord import dtypes, errors
from tensord._proto.tensord.v1 import tensord_pb2 as pb
from tensord.layout import Layout, reach_bounds
from tensord.protocol import (
    CHANNEL_ANSWER_HEADER,
    CHANNEL_BIND,
    CHANNEL_FRAME_HEADER,
    CHANNEL_OK,
    split_ticket,
)
from tensord.wire import requests

if TYPE_CHECKING:
    from tensord.wire.connection import Connection

LOCAL_ENV = "TENSORD_LOCAL"
# Transfers smaller than this keep the gRPC path: one Upload/Download call beats
# Empty + Export + a release for small tensors.
MIN_FAST_BYTES = 256 << 10
#: a same-host upload of at least this many bytes carries the releases queued before it
RELEASE_BEFORE_UPLOAD_BYTES = 16 << 20
# The fd socket answers within this many seconds or the client gives up (and falls back).
FD_TIMEOUT_S = 2.0
RELEASE_BATCH = 1024
# x.numpy() copies out of the mapping in slices of about this many bytes.  One np.copyto of
# a whole large array ends in glibc's large-copy loop, which reads several 4 KiB pages at
# once; from a memfd mapping (shared memory gets no huge pages where the host's
# shmem_enabled is "never") that ran at 1.75 GB/s for 1 GiB on the build VM, 8 MiB slices
# at 4.1 GB/s (benchmarks/bench_local.py).  Copies into the mapping keep one np.copyto per
# part: there the large-copy loop is the fast one.
READ_SLICE_BYTES = 8 << 20
# Same-host copies of at least this many bytes are split into COPY_WORKERS parts copied at
# once (np.copyto lets go of the GIL): one thread reading 4 KiB shared pages, or faulting in
# a fresh destination, is far from the memory's bandwidth (bench_local: 1 GiB out of a memfd
# mapping 4.2 GB/s on one thread, 8.4 on two).  Below it a thread's start-up is not repaid.
PARALLEL_MIN_BYTES = 8 << 20
# x.numpy()'s same-host destinations are kept for reuse (:class:`HostBufferCache`): at most
# this many bytes (``$TENSORD_NUMPY_CACHE_BYTES``, 0 turns it off) in NUMPY_CACHE_COUNT arrays.
# By default an eighth of the machine's memory, within these bounds: a fresh destination
# costs its page faults (the kernel zeroes every page), which held a 1 GiB download at
# 0.61x of a warm np.copyto against 0.81x into a kept one (bench_local, issue 13), and the
# bound must take one such array to help it.
NUMPY_CACHE_ENV = "TENSORD_NUMPY_CACHE_BYTES"
NUMPY_CACHE_MIN_DEFAULT_BYTES = 256 << 20
NUMPY_CACHE_MAX_DEFAULT_BYTES = 2 << 30
NUMPY_CACHE_COUNT = 4


def default_numpy_cache_bytes(physical_bytes: int | None = None) -> int:
    """The destination cache's bound unless ``$TENSORD_NUMPY_CACHE_BYTES`` says: an eighth of
    ``physical_bytes`` (default: this machine's memory), within [256 MiB, 2 GiB]; 256 MiB
    where the machine's memory is unknown."""
    if physical_bytes is None:
        try:
            physical_bytes = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, ValueError, OSError):
            physical_bytes = 0
    if physical_bytes <= 0:
        return NUMPY_CACHE_MIN_DEFAULT_BYTES
    eighth = physical_bytes // 8
    return max(NUMPY_CACHE_MIN_DEFAULT_BYTES, min(eighth, NUMPY_CACHE_MAX_DEFAULT_BYTES))


NUMPY_CACHE_DEFAULT_BYTES = default_numpy_cache_bytes()
# An Export names at most this many of the segments the client maps (the latest mapped):
# an export in one of them needs no ticket (issue 13).  Bounds the request's size.
MAX_MAPPED_HINTS = 256
# The session's export channel (issue 13, :class:`ExportChannel`): an answer comes within
# this many seconds (or call_timeout, if shorter), else the Export is asked through gRPC.
CHANNEL_TIMEOUT_S = 5.0
# After a failed connect or a refused bind, Exports take gRPC this long before a new try.
CHANNEL_RETRY_S = 5.0
# The longest answer taken from the channel (an ExportResponse is well under 16 KiB).
MAX_CHANNEL_ANSWER_BYTES = 1 << 20


def local_wanted(local: bool | None) -> bool:
    """``local`` if given, else false only when ``$TENSORD_LOCAL`` says 0/false/no/off."""
    if local is not None:
        return local
    return os.environ.get(LOCAL_ENV, "1").strip().lower() not in {"0", "false", "no", "off"}


def receive_segment_fd(path: str, ticket: str, nbytes: int) -> int:
    """The descriptor of a segment of ``nbytes``, for a ticket, from the server's fd socket;
    OSError otherwise.

    Only the ticket's key is sent; the server proves it is the one that issued the ticket by
    answering with the rest (a stranger listening on that path learns nothing it can use),
    and the descriptor must be a file of at least ``nbytes`` (a shorter one would raise
    SIGBUS on access, killing this process).
    """
    key, proof = split_ticket(ticket)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(FD_TIMEOUT_S)
        sock.connect(path)
        sock.sendall(key.encode("ascii") + b"\n")
        message, fds, _flags, _addr = socket.recv_fds(sock, 256, 1)
    expected = b"ok " + proof.encode("ascii") + b"\n"
    if not proof or not hmac.compare_digest(message, expected) or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        if message.startswith(b"ok"):
            raise OSError("the fd socket is not the server's: it did not prove the ticket")
        raise OSError(message.decode("ascii", "replace").strip() or "the fd socket said nothing")
    fd = fds[0]
    size = os.fstat(fd).st_size
    if size < nbytes:
        os.close(fd)
        raise OSError(f"the segment's file holds {size} bytes, not the {nbytes} announced")
    return fd


def _receive_exactly(sock: socket.socket, nbytes: int, deadline: float) -> bytes:
    """``nbytes`` from ``sock`` before ``deadline``; OSError otherwise (TimeoutError past it)."""
    data = bytearray()
    while len(data) < nbytes:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the export channel did not answer in time")
        sock.settimeout(left)
        piece = sock.recv(nbytes - len(data))
        if not piece:
            raise ConnectionResetError("the server closed the export channel")
        data += piece
    return bytes(data)


class ExportChannel:
    """A session's export channel (issue 13): one connection to the server's fd socket,
    bound to the session by its key (``chan LOCATOR.SECRET``, answered with its proof), carrying Exports without a gRPC round
    trip.  One request at a time (another thread meanwhile takes gRPC).  Whatever fails
    (connect, bind, timeout, a closed socket, a bad frame, the server's "use gRPC") answers
    None and the caller asks through gRPC, which raises the proper errors.  Connected
    lazily; reconnected after the server's idle timeout; never used in a forked child."""

    def __init__(self, session_id: str, key: str, path: str) -> None:
        self.session_id = session_id
        self.key = key
        self.path = path
        self.pid = os.getpid()
        self.last_reason = ""  # why the last request was not answered here
        self._lock = threading.Lock()  # one request at a time; guards the fields below
        self._sock: socket.socket | None = None
        self._idle_s = 0.0  # the server closes the channel after this long unused
        self._used = 0.0
        self._retry_at = 0.0

    def request(self, payload: bytes, timeout: float) -> bytes | None:
        """An answer's bytes, or None (use gRPC; ``last_reason`` says why)."""
        if os.getpid() != self.pid or not self._lock.acquire(blocking=False):
            return None
        try:
            deadline = time.monotonic() + timeout
            try:
                sock = self._connected(deadline)
                if sock is None:
                    return None
                answer = self._exchange(sock, payload, deadline)
            except (OSError, ValueError) as exc:
                self.last_reason = f"the export channel failed ({exc})"
                self._drop()
                return None
            except BaseException:  # an interrupt mid-exchange: its answer may be on its way,
                self._drop()  # and must never be read as the next request's
                raise
            self._used = time.monotonic()
            return answer
        finally:
            self._lock.release()

    def _connected(self, deadline: float) -> socket.socket | None:
        """(lock held) The bound connection, made now if there is none or it was idle long
        enough for the server to have closed it; None while a failed bind's pause lasts."""
        now = time.monotonic()
        if self._sock is not None and now - self._used < self._idle_s / 2:
            return self._sock
        self._drop()
        if now < self._retry_at:
            return None
        self._retry_at = now + CHANNEL_RETRY_S  # cleared once bound
        # the proof is never sent: the server answers with it (as a ticket's), so a socket
        # squatted at the path (another host's) cannot pose as the server
        sent, _, proof = self.key.rpartition(".")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(max(deadline - now, 0.001))
            sock.connect(self.path)
            sock.sendall(CHANNEL_BIND + sent.encode("ascii") + b"\n")
            line = b""
            while not line.endswith(b"\n") and len(line) < 256:
                line += _receive_exactly(sock, 1, deadline)
            if not line.startswith(b"ok "):
                raise ConnectionRefusedError(line.decode("ascii", "replace").strip())
            idle, _, answered = line[3:].strip().partition(b" ")
            if not proof or not hmac.compare_digest(answered, proof.encode("ascii")):
                raise ConnectionRefusedError("the socket is not the server's: no proof of the key")
            self._idle_s = float(idle)
        except BaseException:
            sock.close()
            raise
        self._sock, self._used, self._retry_at = sock, now, 0.0
        return sock

    def _exchange(self, sock: socket.socket, payload: bytes, deadline: float) -> bytes | None:
        """(lock held) One request and its answer; None for "use gRPC" (the channel stays)."""
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        sock.sendall(CHANNEL_FRAME_HEADER.pack(len(payload)) + payload)
        status, length = CHANNEL_ANSWER_HEADER.unpack(
            _receive_exactly(sock, CHANNEL_ANSWER_HEADER.size, deadline)
        )
        if length > MAX_CHANNEL_ANSWER_BYTES:
            raise ValueError(f"an answer of {length} bytes")
        body = _receive_exactly(sock, length, deadline)
        if status != CHANNEL_OK:
            self.last_reason = body.decode("utf-8", "replace")
            return None
        return body

    def _drop(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def close(self) -> None:
        """Close the connection (in the process that made it: a forked child's copy of the
        descriptor is only forgotten, so nothing reaches the parent's channel; nor is the
        lock taken there: a parent thread may have held it at the fork)."""
        if os.getpid() != self.pid:
            self._sock = None
            return
        with self._lock:
            self._drop()


# Where each live segment mapping of this process lies: token -> (first address, end,
# (server instance, segment id)).  Two Clients (two LocalMappers) map one segment at two
# addresses, and NumPy's overlap checks compare addresses: this maps an array back to the
# segment and offsets it reaches (:func:`aliases_through_another_mapping`).  Plain dict
# operations, atomic under the GIL, and no lock: a mapping's finalizer may run on a
# collection triggered anywhere.
_mapped_ranges: dict[int, tuple[int, int, tuple[str, int]]] = {}
_mapping_tokens = itertools.count()


class Segment:
    """One mapped pool segment; ``exports`` counts the live exports over it."""

    __slots__ = ("__weakref__", "address", "base", "exports", "id", "key", "mapping", "pooled")

    def __init__(self, key: tuple[str, int], mapping: mmap.mmap, shared: bool = True) -> None:
        self.key = key
        self.id = key[1]
        self.mapping = mapping
        self.exports = 0
        # the pool's memory (a memfd mapped shared); False once :meth:`make_private` ran
        self.pooled = shared
        # a uint8 array over the whole mapping: every export's arrays are views of it
        self.base = np.frombuffer(mapping, dtype=np.uint8)
        # its first byte's address, read once: ndarray.ctypes builds an object per read
        self.address = int(self.base.ctypes.data)
        # every array over the mapping holds this Segment (through its export): the range
        # is forgotten only once none is left
        token = next(_mapping_tokens)
        start = self.address
        _mapped_ranges[token] = (start, start + self.base.size, key)
        weakref.finalize(self, _mapped_ranges.pop, token, None).atexit = False

    def make_private(self) -> None:
        """Put private memory at the mapping's addresses in place of the pool's: the arrays
        over it stay valid but never reach the pool again.  They keep the bytes they see
        while an export over the segment lives (an alias may still read them); zeros else."""
        if self.pooled:
            remap_private(self.address, self.base.size, keep=self.exports > 0)
            self.pooled = False


# Linux's mmap/mremap flags that Python's mmap module does not name
_MAP_FIXED = 0x10
_MREMAP_MAYMOVE = 1
_MREMAP_FIXED = 2
_MAP_FAILED = ctypes.c_void_p(-1).value


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    )
    libc.mremap.restype = ctypes.c_void_p
    libc.mremap.argtypes = (
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_void_p,
    )
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    return libc


def remap_private(address: int, nbytes: int, *, keep: bool) -> None:
    """Replace the mapping of ``nbytes`` at ``address`` (page-aligned) with private anonymous
    memory at the same addresses, holding the bytes it held when ``keep`` (else zeros).

    ``keep`` copies into a fresh private mapping, then moves that over the old one in one
    mremap: a reader on another thread sees the old bytes or the copy, never a hole."""
    length = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    libc = _libc()
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if not keep:
        if libc.mmap(address, length, prot, flags | _MAP_FIXED, -1, 0) in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), "mmap over a segment mapping failed")
        return
    fresh = libc.mmap(None, length, prot, flags, -1, 0)
    if fresh in (None, _MAP_FAILED):
        raise OSError(ctypes.get_errno(), "mmap of a private copy of a segment failed")
    ctypes.memmove(fresh, address, length)
    moved = libc.mremap(fresh, length, length, _MREMAP_MAYMOVE | _MREMAP_FIXED, address)
    if moved in (None, _MAP_FAILED):
        error = ctypes.get_errno()
        libc.munmap(fresh, length)
        raise OSError(error, "mremap of a private copy over a segment mapping failed")


def _mapped_place(array: np.ndarray) -> tuple[int, tuple[str, int], int, int] | None:
    """(the mapping's first address, its segment's key, the first and past-the-last offset
    ``array``'s bytes reach in it), or None for an array over no live segment mapping."""
    if array.size == 0:
        return None
    low, high = _byte_bounds(array)
    for start, end, key in list(_mapped_ranges.values()):
        if start <= low and high <= end:
            return start, key, low - start, high - start
    return None


def _byte_bounds(array: np.ndarray) -> tuple[int, int]:
    """The first address a non-empty ``array`` reaches and the one past its last byte
    (NumPy's byte_bounds, which moved between NumPy 1 and 2)."""
    low, high = reach_bounds(int(array.ctypes.data), array.shape, array.strides)
    return low, high + array.itemsize


def aliases_through_another_mapping(dst: np.ndarray, src: np.ndarray) -> bool:
    """Whether ``src`` may hold bytes of ``dst``'s segment that ``dst`` reaches, seen
    through another mapping of that segment (another Client's): an overlap
    np.may_share_memory cannot see, the addresses differing."""
    into, source = _mapped_place(dst), _mapped_place(src)
    if into is None or source is None:
        return False
    (into_start, into_key, into_low, into_high) = into
    (source_start, source_key, source_low, source_high) = source
    return (
        into_key == source_key
        and into_start != source_start
        and source_low < into_high
        and into_low < source_high
    )


class SegmentForgotten(Exception):
    """An Export answered without a ticket (the request named its segment as mapped here)
    for a segment this client no longer maps."""


class Export:
    """A pinned Storage mapped here: arrays over its bytes (any layout, any dtype).

    Keeps its segment mapped and its pin held while this object lives; every array made
    by :meth:`array` holds it.  :meth:`close` (or collection) queues the release.
    """

    def __init__(
        self,
        mapper: LocalMapper,
        response: pb.ExportResponse,
        segment: Segment,
        reuse_key: tuple[str, str] | None = None,
    ) -> None:
        self.id = export_id = response.export_id
        self.meta = meta = response.tensor  # each read of a field builds its object anew
        self.storage_start = response.storage_byte_offset
        self.storage_nbytes = meta.storage_nbytes
        self._segment = segment
        self._finalizer = weakref.finalize(self, mapper.ended, export_id, segment, reuse_key)
        self._finalizer.atexit = False  # at exit the session's close ends every export

    def storage_bytes(self) -> np.ndarray:
        """The Storage's bytes, a uint8 array aliasing the pool (it keeps this export alive)."""
        return np.asarray(
            _Holder(self, self._segment, (self.storage_nbytes,), "|u1", self.storage_start, None)
        )

    def array(self, dtype: np.dtype, layout: Layout) -> np.ndarray:
        """The elements of ``layout`` (in elements of ``dtype``) over the Storage, aliasing it.

        One array straight over the layout's bytes (no array of the Storage's bytes to view
        first: a DLPack export makes one per capsule), once the layout is seen to fit."""
        itemsize = dtype.itemsize
        if layout.storage_extent() * itemsize > self.storage_nbytes:
            raise ValueError(
                f"a layout reaching {layout.storage_extent() * itemsize} bytes does not fit the "
                f"{self.storage_nbytes}-byte Storage exported"
            )
        return np.asarray(
            _Holder(
                self,
                self._segment,
                layout.shape,
                dtype.str,
                self.storage_start + layout.offset * itemsize,
                tuple(s * itemsize for s in layout.stride),
            )
        )

    def close(self) -> None:
        self._finalizer()


class _Holder:
    """What arrays over an export are based on: NumPy keeps a reference to the object that
    gave it ``__array_interface__``, so the export lives exactly as long as its arrays.

    The array is ``shape`` elements of ``typestr`` at ``start`` bytes into the segment,
    ``strides`` apart (bytes; None: C-contiguous): the caller checked that they fit."""

    __slots__ = ("__array_interface__", "export", "source")

    def __init__(
        self,
        export: Export,
        segment: Segment,
        shape: tuple[int, ...],
        typestr: str,
        start: int,
        strides: tuple[int, ...] | None,
    ) -> None:
        self.export = export
        self.source = segment.base  # the segment's mapping stays mapped while this lives
        self.__array_interface__ = {
            "version": 3,
            "shape": shape,
            "typestr": typestr,
            "data": (segment.address + start, False),
            "strides": strides,
        }


class LocalMapper:
    """One client's mappings of its server's segments and its exports.  Thread-safe."""

    def __init__(self, conn: Connection, enabled: bool) -> None:
        self._conn = conn
        self.enabled = enabled
        self.reason = "same-host mapping is turned off (local=False or $TENSORD_LOCAL=0)"
        self.last_refusal = ""  # why the server last refused an Export
        self._empty_export = True  # false once the server turned EmptyExport down as unknown
        # guards _segments, _imports and their counters; reentrant: an export's finalizer may
        # run on a collection triggered while this thread holds it
        self._lock = threading.RLock()
        self._segments: dict[tuple[str, int], Segment] = {}
        # every Segment an array may still use, cached or not (:meth:`make_private`); _lock
        self._live: weakref.WeakSet[Segment] = weakref.WeakSet()
        self._open_lock = threading.Lock()  # one CUDA IPC open or close at a time
        self._imports: dict[tuple[str, int], CudaImport] = {}
        # (session id, segment id) -> GPU Exports answered in that session whose import
        # this client never opened (no array was made): reported closed like a closed import
        self._unopened: collections.Counter[tuple[str, int]] = collections.Counter()
        self._pending: collections.deque[str] = collections.deque()
        # (session id, storage id) -> the live cpu export DLPack capsules of that Storage
        # hold: another __dlpack__ of any view of it reuses it (no Export RPC); _lock
        self._reusable: dict[tuple[str, str], weakref.ref[Export]] = {}
        # what an Export says this client maps: (the server instance of the latest segment
        # mapped, at most MAX_MAPPED_HINTS of its segment ids); replaced whole under _lock
        self._mapped_hint: tuple[str, tuple[int, ...]] = ("", ())
        # the session's export channel (issue 13), learnt from a gRPC Export's answer
        self._channel: ExportChannel | None = None
        self.channel_exports = 0  # Exports the channel answered (the rest took gRPC)

    def disable(self, reason: str) -> None:
        self.enabled = False
        self.reason = reason

    def shared_export(self, handle: str, storage_id: str) -> Export | CudaExport | None:
        """An export for an alias that may outlive the call (a DLPack capsule): a live cpu
        export of the same Storage in this session if there is one, else a new one.

        Reusing one is safe because the export lives as long as anything made over it: the
        new capsule's array holds it like the old ones, so its pin ends with the last of
        them.  Only cpu exports are reused: a GPU Export also synchronizes the server's
        stream, which each capsule needs (the server's ops on cpu memory are complete when
        their RPC answers).
        """
        if not self.enabled:
            return None
        session_id = self._conn.session_id
        with self._lock:
            ref = self._reusable.get((session_id, storage_id))
        reused = ref() if ref is not None else None
        if reused is not None:
            # what a call would check and wait for: a closed, forked or replaced session
            # raises, and ops queued before this call are applied before it sees the bytes
            self._conn.check_session(session_id)
            if self._conn.pipelining:
                self._conn.synchronize(releases=False)
            return reused
        export = self.export(handle, reuse_key=(session_id, storage_id))
        if isinstance(export, Export) and export.meta.storage_id == storage_id:
            with self._lock:
                self._reusable[(session_id, storage_id)] = weakref.ref(export)
        return export

    def export(
        self, handle: str, *, reuse_key: tuple[str, str] | None = None
    ) -> Export | CudaExport | None:
        """An export of the handle's Storage mapped here, or None (the caller uses gRPC):
        this client cannot map the server's memory, or this device's memory is not mappable."""
        if not self.enabled:
            return None
        instance, mapped = self._mapped_hint
        request = requests.export(handle, instance, mapped)
        response = self._call_export(request)
        if response is None:
            return None
        try:
            return self._mapped(handle, response, reuse_key)
        except SegmentForgotten:
            # answered without a ticket for a segment no longer mapped here (close() forgot
            # it meanwhile): that export is released, and one naming no mapped segment, so
            # answered with a ticket, replaces it
            response = self._call_export(requests.export(handle))
            return None if response is None else self._mapped(handle, response, reuse_key)

    def _call_export(self, request: pb.ExportRequest) -> pb.ExportResponse | None:
        """One Export (released if an interrupt takes its caller away): on the session's
        export channel if it answers, else through gRPC; None when the server cannot share
        this memory (the reason kept in ``last_refusal``)."""
        session_id = self._conn.session_id
        orphaned = functools.partial(self._release_orphan, session_id)
        channel = self._channel
        if channel is not None:
            exported = functools.partial(self._export_on_channel, channel, request)
            answered: pb.ExportResponse | None = self._conn.call_local(exported, orphaned)
            if answered is not None:
                self.channel_exports += 1
                return answered
        try:
            response: pb.ExportResponse = self._conn.call("Export", request, orphaned)
        except errors.FailedPreconditionError as exc:  # memory this server cannot share
            self.last_refusal = str(exc)
            return None
        self._learn_channel(session_id, response)
        return response

    def _export_on_channel(
        self, channel: ExportChannel, request: pb.ExportRequest, session_id: str
    ) -> pb.ExportResponse | None:
        """(after what a call does first) The Export on ``channel`` if it is this session's
        (a replaced session's key names the lost one) and it answers; None: use gRPC."""
        if channel.session_id != session_id:
            return None
        timeout = min(CHANNEL_TIMEOUT_S, self._conn.call_timeout or CHANNEL_TIMEOUT_S)
        answer = channel.request(request.SerializeToString(), timeout)
        if answer is None:
            return None
        try:
            response: pb.ExportResponse = pb.ExportResponse.FromString(answer)
        except DecodeError:
            channel.close()
            return None
        return response

    def _learn_channel(self, session_id: str, response: pb.ExportResponse) -> None:
        """Keep the export channel a gRPC Export in ``session_id`` answered (a new key: a new
        session or server replaces the channel of the old one)."""
        if not response.channel_key or not response.channel_socket:
            return
        current = self._channel
        if (
            current is not None
            and current.key == response.channel_key
            and current.path == response.channel_socket
            and current.session_id == session_id
            and current.pid == os.getpid()
        ):
            return
        self._channel = ExportChannel(session_id, response.channel_key, response.channel_socket)
        if current is not None:
            current.close()

    def _release_orphan(self, session_id: str, response: pb.ExportResponse) -> None:
        """An Export answer its caller never saw (an interrupt took it away): released, and
        a GPU one's import, which the server counted for ``session_id``, reported closed."""
        self._never_opened(session_id, response)  # first: the release's batch carries it
        self._conn.queue_export_release(response.export_id)

    def _never_opened(self, session_id: str, response: pb.ExportResponse) -> None:
        """(any thread) A GPU Export answered in ``session_id`` that this client drops
        without opening its segment: the server counted an import of the segment for the
        session, which vetoes the segment's release until the session ends unless reported
        closed.  When this client has the segment open, that import counts it (its close
        reports it, see :meth:`close_idle_imports`); else the next ReleaseExports does."""
        if not (response.device.startswith("cuda") and response.ipc_handle):
            return  # a cpu export, or a zero-byte Storage's: no import was counted
        with self._lock:
            imported = self._imports.get((response.server_instance, int(response.segment_id)))
            if imported is not None:
                imported.opened_for += 1
            else:
                self._unopened[(session_id, int(response.segment_id))] += 1

    def _update_mapped_hint(self, instance: str) -> None:
        """(_lock held) What the next Exports say this client maps of ``instance``."""
        ids = [k[1] for k in self._segments if k[0] == instance]
        self._mapped_hint = (instance, tuple(ids[-MAX_MAPPED_HINTS:]))

    def empty_exported(
        self, empty: pb.EmptyRequest, carry_releases: bool
    ) -> tuple[pb.TensorMeta, Export | CudaExport | None] | None:
        """A new empty tensor and its export, in one call (EmptyExport); None when the server
        cannot share that memory (it released the new handle: use gRPC).  The export is None
        when this client cannot map it (the caller drops the tensor and uses gRPC).
        ``carry_releases``: the releases queued so far ride along, applied first."""
        if not self._empty_export:
            return self._empty_then_export(empty, carry_releases)
        unknown = False
        session_id = self._conn.session_id
        try:
            response = self._conn.empty_export(empty, carry_releases)
        except errors.TensordError as exc:
            refused = isinstance(exc, errors.FailedPreconditionError)
            unknown = getattr(exc, "grpc_code", None) is grpc.StatusCode.UNIMPLEMENTED
            if not (refused or unknown):
                raise
            self.last_refusal = str(exc) if refused else self.last_refusal
            # the error and the failed call's frames form a cycle that holds this frame, and
            # through it the caller's: what the caller makes next (the tensor, the upload's
            # view of the array) would outlive its last reference until a garbage collection
            exc.__traceback__ = exc.__context__ = None
            if refused:
                return None
        if unknown:
            self._empty_export = False  # a server older than EmptyExport: two calls
            return self._empty_then_export(empty, carry_releases)
        exported = response.export
        self._learn_channel(session_id, exported)
        if not exported.tensor.handle or not exported.export_id:
            self.disable(f"the server's EmptyExport answered no tensor ({exported.tensor!r})")
            return None
        self.unmap_gone(list(response.released_exports.gone_segments))
        try:
            return exported.tensor, self._mapped(exported.tensor.handle, exported, None)
        except SegmentForgotten:  # no ticket for an unmapped segment: not one to map
            return exported.tensor, None

    def _empty_then_export(
        self, empty: pb.EmptyRequest, carry_releases: bool
    ) -> tuple[pb.TensorMeta, Export | CudaExport | None]:
        """:meth:`empty_exported` in an Empty and an Export, after the releases if asked."""
        if carry_releases:
            self._conn.flush_releases()
        meta: pb.TensorMeta = self._conn.call("Empty", empty)
        return meta, self.export(meta.handle)

    def _mapped(
        self, handle: str, response: pb.ExportResponse, reuse_key: tuple[str, str] | None
    ) -> Export | CudaExport | None:
        """The export the server answered, mapped here (None: released, use gRPC)."""
        key = (response.server_instance, int(response.segment_id))
        end = response.storage_byte_offset + response.tensor.storage_nbytes
        if (
            response.tensor.handle != handle
            or response.storage_byte_offset < 0
            or end > response.segment_nbytes
        ):
            # never build an array past what is mapped (it would reach another mapping's
            # memory, or fault): a server whose answer does not add up is not used locally
            self._conn.queue_export_release(response.export_id)
            self.disable(
                f"the server's Export does not add up (bytes {response.storage_byte_offset}.."
                f"{end} of a {response.segment_nbytes}-byte segment, for tensor "
                f"{response.tensor.handle[:8]!r})"
            )
            return None
        if response.device.startswith("cuda"):
            return self._export_cuda(key, response)
        try:
            segment = self._segment(key, response)
        except SegmentForgotten:
            self._conn.queue_export_release(response.export_id)
            raise
        except (OSError, ValueError) as exc:
            self._conn.queue_export_release(response.export_id)
            self.disable(f"this client cannot map the server's memory ({exc})")
            return None
        if end > segment.base.size:
            # never build an array past the mapping (that would read or write another
            # mapping's memory, or fault): a server this client cannot trust to be local
            self.ended(response.export_id, segment)
            self.disable(
                f"the server exported bytes {response.storage_byte_offset}..{end} of a "
                f"{segment.base.size}-byte segment"
            )
            return None
        return Export(self, response, segment, reuse_key)

    def _segment(self, key: tuple[str, int], response: pb.ExportResponse) -> Segment:
        with self._lock:
            segment = self._segments.get(key)
            if segment is not None:
                segment.exports += 1
                return segment
        shared = response.segment_nbytes != 0
        if not shared:  # a zero-byte Storage: nothing to map
            mapping = mmap.mmap(-1, 1)
        elif not response.ticket:  # the Export was told it is mapped here: no longer
            raise SegmentForgotten(key)
        else:
            fd = receive_segment_fd(response.fd_socket, response.ticket, response.segment_nbytes)
            try:
                mapping = mmap.mmap(fd, response.segment_nbytes, flags=mmap.MAP_SHARED)
            finally:
                os.close(fd)
            with contextlib.suppress(OSError, AttributeError, ValueError):
                mapping.madvise(
                    mmap.MADV_HUGEPAGE
                )  # see tensord_server.devices.shm.advise_huge_pages
        with self._lock:
            segment = self._segments.setdefault(key, Segment(key, mapping, shared))
            self._live.add(segment)
            segment.exports += 1
            self._update_mapped_hint(key[0])
        return segment

    def _export_cuda(self, key: tuple[str, int], response: pb.ExportResponse) -> CudaExport | None:
        """A GPU export over this process's import of its segment (opened here if new)."""
        try:
            imported = self._import(key, response)
        except ImportError:
            self.last_refusal = "zero copy of GPU memory needs CuPy in the client"
            # nothing was opened (answered just now, in this session): not an import
            self._never_opened(self._conn.session_id, response)
            self._conn.queue_export_release(response.export_id)
            return None
        except Exception as exc:  # CuPy's CUDARuntimeError (no GPU, another host)
            # (the handle may have opened before the error: the import keeps counting)
            self.last_refusal = f"this client cannot open the server's GPU memory ({exc})"
            self._conn.queue_export_release(response.export_id)
            return None
        return CudaExport(self, response, imported)

    def _import(self, key: tuple[str, int], response: pb.ExportResponse) -> CudaImport:
        with self._open_lock:
            with self._lock:
                imported = self._imports.get(key)
                if imported is not None:
                    imported.exports += 1
                    imported.opened_for += 1
                    return imported
            imported = CudaImport.open(key, response)
            with self._lock:
                self._imports[key] = imported
            return imported

    def cuda_ended(self, export_id: str, imported: CudaImport) -> None:
        """A GPU export's last array was collected (any thread): never blocks for long."""
        with self._lock:
            imported.exports -= 1
        self._conn.queue_export_release(export_id)

    def close_idle_imports(self) -> list[pb.ClosedImport]:
        """Close the imports no array uses any more; what to report to the server (with
        the imports it counted that were never opened here)."""
        if not self._imports and not self._unopened:
            return []
        with self._open_lock:
            with self._lock:
                idle = [k for k, i in self._imports.items() if i.exports == 0 and i.opened_for]
                closing = [self._imports.pop(k) for k in idle]
            for imported in closing:
                imported.close()
        closed = [requests.closed_import(i.id, i.opened_for) for i in closing]
        return closed + self._take_unopened()

    def _take_unopened(self) -> list[pb.ClosedImport]:
        """The never-opened imports to report in this session.  Those of another session
        are dropped: its end dropped their counts, and reported here they would lower this
        session's count of an import it may hold open."""
        session_id = self._conn.session_id
        with self._lock:
            taken, self._unopened = self._unopened, collections.Counter()
        return [
            requests.closed_import(segment_id, exports)
            for (owner, segment_id), exports in taken.items()
            if owner == session_id
        ]

    def before_call(self) -> None:
        """Make the consumer's GPU work on imported memory complete before the next call."""
        if not self._imports:
            return
        with self._lock:
            indices = {i.device_index for i in self._imports.values()}
        cupy = _cupy()
        for index in sorted(indices):
            with cupy.cuda.Device(index):
                cupy.cuda.runtime.deviceSynchronize()

    def imported_segments(self) -> list[int]:
        with self._lock:
            return [k[1] for k in self._imports]

    def ended(
        self, export_id: str, segment: Segment, reuse_key: tuple[str, str] | None = None
    ) -> None:
        """An export's last array was collected (any thread, even at exit): never blocks."""
        with self._lock:
            segment.exports -= 1
            if reuse_key is not None and reuse_key in self._reusable:
                current = self._reusable[reuse_key]()
                if current is None or current.id == export_id:  # not a newer one's entry
                    del self._reusable[reuse_key]
        self._conn.queue_export_release(export_id)

    def mapped_segments(self, server_instance: str | None = None) -> list[int]:
        with self._lock:
            return [k[1] for k in self._segments if server_instance in (None, k[0])]

    def unmap_gone(self, gone: list[int]) -> None:
        """Drop the cache's mappings of segments the server released (and no export uses)."""
        gone_ids = set(gone)
        with self._lock:
            unmapped = [
                key
                for key, segment in self._segments.items()
                if segment.id in gone_ids and segment.exports == 0
            ]
            for key in unmapped:
                del self._segments[key]
            if unmapped:
                self._update_mapped_hint(self._mapped_hint[0])
        # the mmap itself closes when the last array over it (if any) is collected

    def mapped_count(self) -> int:
        with self._lock:
            return len(self._segments)

    def make_private(self) -> None:
        """The session ends (its client closes, or the server lost it): every mapping of a
        pool segment in this process becomes private memory at the same addresses, so an
        alias taken before (``torch.from_dlpack``, ``np.asarray(x, copy=False)``) keeps
        working on its own copy of the bytes and never reaches pool memory the server may
        give to another session.  The cache forgets them: later exports map afresh."""
        with self._lock:
            live = list(self._live)
            self._live = weakref.WeakSet()
            self._segments.clear()
            self._reusable.clear()
            self._mapped_hint = ("", ())
        for segment in live:
            segment.make_private()

    def close(self) -> None:
        """Forget the mappings; close the GPU imports no array uses (an array still alive
        keeps its import open until this process exits)."""
        with self._lock:
            self._segments.clear()
            self._reusable.clear()
            self._mapped_hint = ("", ())
        self.close_channel()
        with contextlib.suppress(Exception):
            self.close_idle_imports()

    def close_channel(self) -> None:
        """Close the export channel (the client closes: its session, and so its key, ends)."""
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()


def _cupy() -> Any:
    import cupy  # deferred: CuPy is an optional extra, needed only for GPU exports

    return cupy


class CudaImport:
    """A server GPU segment opened in this process through its CUDA IPC handle.

    ``exports`` counts the live :class:`CudaExport` objects over it, ``opened_for`` the
    Exports this open served (reported back when it is closed).
    """

    __slots__ = ("device_index", "device_ptr", "exports", "id", "key", "nbytes", "opened_for")

    def __init__(self, key: tuple[str, int], device_ptr: int, device_index: int, nbytes: int):
        self.key = key
        self.id = key[1]
        self.device_ptr = device_ptr
        self.device_index = device_index
        self.nbytes = nbytes
        self.exports = 1
        self.opened_for = 1

    @classmethod
    def open(cls, key: tuple[str, int], response: pb.ExportResponse) -> CudaImport:
        cupy = _cupy()
        runtime = cupy.cuda.runtime
        server_index = int(response.device.partition(":")[2] or 0)
        if not response.ipc_handle:  # a zero-byte Storage: nothing to open
            return cls(key, 0, server_index, 0)
        flags = getattr(runtime, "cudaIpcMemLazyEnablePeerAccess", 1)
        with cupy.cuda.Device(server_index):
            pointer = int(runtime.ipcOpenMemHandle(bytes(response.ipc_handle), flags))
        # the GPU it is on, as this process numbers them (CUDA_VISIBLE_DEVICES may differ)
        device = int(getattr(runtime.pointerGetAttributes(pointer), "device", server_index))
        return cls(key, pointer, device, int(response.segment_nbytes))

    def close(self) -> None:
        if self.device_ptr:
            cupy = _cupy()
            with cupy.cuda.Device(self.device_index):
                cupy.cuda.runtime.ipcCloseMemHandle(self.device_ptr)
        self.device_ptr = 0


class CudaExport:
    """A pinned GPU Storage of the server, imported here: CuPy arrays over its bytes.

    Every array made by :meth:`array` holds this object (as the owner of its memory), so
    the import stays open while any array, or DLPack capsule of one, lives.
    """

    def __init__(
        self, mapper: LocalMapper, response: pb.ExportResponse, imported: CudaImport
    ) -> None:
        self.id = response.export_id
        self.meta = response.tensor
        self.storage_start = response.storage_byte_offset
        self.storage_nbytes = response.tensor.storage_nbytes
        self.imported = imported
        self._finalizer = weakref.finalize(self, mapper.cuda_ended, response.export_id, imported)
        self._finalizer.atexit = False

    @property
    def device_index(self) -> int:
        return self.imported.device_index

    def array(self, dtype: np.dtype, layout: Layout) -> Any:
        """A CuPy array of ``layout`` (in elements of ``dtype``) aliasing the Storage."""
        cupy = _cupy()
        itemsize = dtype.itemsize
        with cupy.cuda.Device(self.device_index):
            if self.storage_nbytes == 0 or layout.numel == 0:
                return cupy.empty(layout.shape, dtype=dtype)
            memory = cupy.cuda.UnownedMemory(
                self.imported.device_ptr + self.storage_start,
                self.storage_nbytes,
                self,
                device_id=self.device_index,
            )
            pointer = cupy.cuda.MemoryPointer(memory, layout.offset * itemsize)
            return cupy.ndarray(
                layout.shape,
                dtype=dtype,
                memptr=pointer,
                strides=tuple(s * itemsize for s in layout.stride),
            )

    def close(self) -> None:
        self._finalizer()


def no_internal_overlap(layout: Layout) -> bool:
    """True when no two elements of ``layout`` share an address (a sufficient test: dims by
    stride, each stride beyond the extent of the smaller ones)."""
    dims = sorted((st, n) for n, st in zip(layout.shape, layout.stride, strict=True) if n > 1)
    extent = 0
    for stride, size in dims:
        if stride <= extent:
            return False
        extent += (size - 1) * stride
    return True


@contextlib.contextmanager
def exported(mapper: LocalMapper | None, handle: str) -> Any:
    """An export for the length of a transfer (None: take the gRPC path), released after."""
    export = mapper.export(handle) if mapper is not None and mapper.enabled else None
    try:
        yield export
    finally:
        if export is not None:
            export.close()


def numpy_cache_bytes() -> int:
    """``$TENSORD_NUMPY_CACHE_BYTES`` (bytes; 0: no cache), else the default."""
    value = os.environ.get(NUMPY_CACHE_ENV, "").strip()
    try:
        return max(0, int(value)) if value else NUMPY_CACHE_DEFAULT_BYTES
    except ValueError:
        return NUMPY_CACHE_DEFAULT_BYTES


def _first_free(
    buffers: collections.OrderedDict[int, tuple[np.ndarray, int]],
    shape: tuple[int, ...],
    dtype: np.dtype,
    free_refs: int,
) -> np.ndarray | None:
    """The oldest buffer of ``shape`` and ``dtype`` nothing but ``buffers`` references
    (sys.getrefcount at most ``free_refs`` here, and no weak reference: one still reaches
    it, the cache keeping it alive), still as it was made.  The buffer itself, not its key:
    the caller's reference keeps a nested search (a finalizer's x.numpy()) from taking it."""
    for buffer, _nbytes in buffers.values():
        if (
            sys.getrefcount(buffer) <= free_refs
            and weakref.getweakrefcount(buffer) == 0
            and buffer.shape == shape
            and buffer.dtype == dtype
            and buffer.flags.writeable
            and buffer.flags.c_contiguous
            and buffer.flags.owndata
        ):
            return buffer
    return None


def _free_refs() -> int:
    """What sys.getrefcount says in :func:`_first_free` of a buffer only its dict holds
    (the interpreter's own references differ between versions: measured, not assumed)."""
    probe: collections.OrderedDict[int, tuple[np.ndarray, int]] = collections.OrderedDict()
    probe[0] = (np.empty(1, dtype=np.uint8), 1)
    shape, dtype = probe[0][0].shape, probe[0][0].dtype
    refs = next(r for r in range(1, 64) if _first_free(probe, shape, dtype, r) is not None)
    held = probe[0][0]  # one reference more must show
    assert _first_free(probe, shape, dtype, refs) is None, "sys.getrefcount misses references"
    del held
    return refs


class HostBufferCache:
    """x.numpy()'s destinations, reused (PyTorch's CachingHostAllocator idea): a large copy
    into fresh pages costs their faults and zeroing (a 64 MiB download ran at 0.6x of a copy
    into warm pages, bench_local), so each array x.numpy() makes here is kept, and handed
    out again by a later x.numpy() of the same shape and dtype once nothing else references
    it: every view, memoryview, torch.from_numpy or DLPack alias of it, or of a view of it,
    holds a reference to it, which sys.getrefcount sees (a weak reference, which it does not
    see, blocks reuse too).  Bounded: at most ``max_bytes`` in
    at most ``max_count`` arrays, the least recently handed out dropped first (one still in
    use stays its holder's, uncached).  Thread-safe; a forked child starts empty.

    An array's size is checked, never assumed: one its holder resized in place
    (``a.resize(..., refcheck=False)``) is no longer the array recorded, and leaves the
    cache (its bytes are counted as recorded, so the count stays exact).  Re-entrant: a
    garbage collection inside the critical section may run a finalizer that calls
    x.numpy(); that nested call finds the cache mid-change (``_busy``) and makes its array
    uncached instead of waiting for a lock its own thread holds.
    """

    def __init__(self, max_bytes: int, max_count: int) -> None:
        self.max_bytes = max_bytes
        self.max_count = max_count
        self._lock = threading.RLock()
        # id(buffer) -> (buffer, its nbytes when recorded), least recently handed out
        # first; _lock
        self._buffers: collections.OrderedDict[int, tuple[np.ndarray, int]] = (
            collections.OrderedDict()
        )
        self._nbytes = 0  # the recorded nbytes, summed; _lock
        self._busy = False  # a critical section is running on the lock's thread; _lock

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """An uninitialized C-contiguous array of ``shape`` that nothing else references."""
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > self.max_bytes or self.max_count < 1:
            return np.empty(shape, dtype=dtype)
        with self._exclusive() as first:
            if not first:  # called from inside ours (a finalizer): this one goes uncached
                return np.empty(shape, dtype=dtype)
            return self._take_or_make(shape, dtype, nbytes)

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[bool]:
        """Hold the lock; True unless this thread is already inside a critical section
        (a finalizer run by a garbage collection there): then the state is mid-change and
        the caller must leave it alone.  A collection before ``_busy`` is set or after it
        is cleared runs its nested call to the end first, which is safe."""
        with self._lock:
            if self._busy:
                yield False
                return
            self._busy = True
            try:
                yield True
            finally:
                self._busy = False

    def _take_or_make(self, shape: tuple[int, ...], dtype: np.dtype, nbytes: int) -> np.ndarray:
        """(_lock held, _busy) A free cached buffer of ``shape``, else a new one, recorded."""
        self._drop_resized()
        buffer = _first_free(self._buffers, shape, dtype, _FREE_REFS)
        if buffer is not None:
            self._buffers.move_to_end(id(buffer))
            return buffer
        buffer = np.empty(shape, dtype=dtype)
        self._trim(self.max_bytes - nbytes, self.max_count - 1)
        self._buffers[id(buffer)] = (buffer, buffer.nbytes)
        self._nbytes += buffer.nbytes
        return buffer

    def _drop_resized(self) -> None:
        """(_lock held) Drop every buffer whose size is no longer the one recorded."""
        for key, (buffer, recorded) in list(self._buffers.items()):
            if buffer.nbytes != recorded:
                del self._buffers[key]
                self._nbytes -= recorded

    def _trim(self, max_bytes: int, max_count: int) -> None:
        """(_lock held) Drop the least recently handed out until within the bounds."""
        while self._buffers and (self._nbytes > max_bytes or len(self._buffers) > max_count):
            _key, (_dropped, recorded) = self._buffers.popitem(last=False)
            self._nbytes -= recorded

    def cached(self) -> tuple[int, int]:
        """How many arrays and bytes the cache holds."""
        with self._exclusive() as first:
            if first:
                self._drop_resized()
            return len(self._buffers), self._nbytes

    def clear(self) -> None:
        with self._exclusive() as first:
            if first:  # else called from inside ours (a finalizer): the cache is mid-change
                self._trim(-1, 0)

    def forget_after_fork(self) -> None:
        """In a forked child: start empty (the parent's lock may be held)."""
        self._lock = threading.RLock()
        self._buffers = collections.OrderedDict()
        self._nbytes = 0
        self._busy = False


_FREE_REFS = _free_refs()
numpy_cache = HostBufferCache(numpy_cache_bytes(), NUMPY_CACHE_COUNT)
os.register_at_fork(after_in_child=numpy_cache.forget_after_fork)


def read_array(tensor: Any, mapper: LocalMapper, layout: Layout) -> np.ndarray | None:
    """x.numpy() on the same host: one copy out of the mapping into a new array, a large one
    on several threads (:func:`parallel_copyto`); None: use gRPC.  The result never aliases
    the pool: numpy() keeps copying (use np.from_dlpack for an alias).  The array may be
    one an earlier x.numpy() returned and nothing references any more (:data:`numpy_cache`)."""
    if tensor.device.type != "cpu" or tensor.nbytes < MIN_FAST_BYTES:
        return None
    with exported(mapper, tensor.handle) as export:
        if export is None:
            return None
        np_dtype = dtypes.to_numpy_dtype(tensor.dtype)
        view = export.array(np_dtype, layout)
        out = numpy_cache.empty(view.shape, np_dtype)
        parallel_copyto(out, view, READ_SLICE_BYTES)
        return out


def split_along(shape: tuple[int, ...], parts: int) -> list[tuple[Any, ...]]:
    """Keys cutting an array of ``shape`` into at most ``parts`` disjoint pieces of whole
    rows of about equal size: along the outermost axis with at least ``parts`` entries, else
    along the longest (so a (1, N) or 1-D array still splits); one piece when none is > 1
    (``...``: the key of a view of the whole, even of a 0-d array)."""
    if not shape or parts <= 1 or max(shape) <= 1:
        return [(...,)]
    axis = next((i for i, n in enumerate(shape) if n >= parts), None)
    if axis is None:
        axis = max(range(len(shape)), key=lambda i: shape[i])
    count = min(parts, shape[axis])
    bounds = [shape[axis] * i // count for i in range(count + 1)]
    lead = (slice(None),) * axis
    return [(*lead, slice(start, stop)) for start, stop in itertools.pairwise(bounds)]


def copy_in_slices(out: np.ndarray, src: np.ndarray, slice_bytes: int) -> None:
    """np.copyto(out, src) (same shape) in slices of about ``slice_bytes`` each (whole rows
    along the axis :func:`split_along` picks)."""
    if out.nbytes <= slice_bytes:
        np.copyto(out, src)
        return
    for key in split_along(out.shape, -(-out.nbytes // slice_bytes)):
        np.copyto(out[key], src[key])


def copy_workers() -> int:
    """How many threads a large same-host copy runs on: the CPUs this process may use, at
    most 4 (past that one process's copies gain nothing against the memory's bandwidth)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, 4))


COPY_WORKERS = copy_workers()


class _CopyPool:
    """The threads that copy the other parts of a large copy while its caller copies the first.

    Made on first use; a forked child makes its own (the parent's threads do not exist in
    it); at interpreter exit concurrent.futures lets the queued parts finish (each is one
    bounded copy) and refuses new ones, which the caller then copies itself.  Pool threads
    only copy, never wait on a future: any number of user threads may copy at once.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._marker = threading.local()  # set in the pool's own threads

    def in_worker(self) -> bool:
        return getattr(self._marker, "worker", False)

    def executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    max(1, COPY_WORKERS - 1),
                    thread_name_prefix="tensord-copy",
                    initializer=self._mark_worker,
                )
            return self._executor

    def _mark_worker(self) -> None:
        self._marker.worker = True

    def forget_after_fork(self) -> None:
        """In a forked child: the parent's pool threads are gone, and its lock may be held."""
        self._lock = threading.Lock()
        self._executor = None


_copy_pool = _CopyPool()
os.register_at_fork(after_in_child=_copy_pool.forget_after_fork)


def _copy_part(dst: np.ndarray, src: np.ndarray, slice_bytes: int | None) -> None:
    if slice_bytes is None:
        np.copyto(dst, src)
    else:
        copy_in_slices(dst, src, slice_bytes)


class CopyPart:
    """One part of a large copy, copied at most once, by a pool thread unless the caller
    cancelled ``future`` first.  The future is the part's own, not the executor's:
    ThreadPoolExecutor.submit queues the work before it starts a thread, so a submit that
    raised may have queued it all the same, and that run must then copy nothing."""

    def __init__(self, dst: np.ndarray, src: np.ndarray, slice_bytes: int | None) -> None:
        self.dst, self.src, self.slice_bytes = dst, src, slice_bytes
        self.future: concurrent.futures.Future[None] = concurrent.futures.Future()

    def run(self) -> None:
        if not self.future.set_running_or_notify_cancel():
            return  # cancelled: the caller copied it, or gave the copy up
        try:
            _copy_part(self.dst, self.src, self.slice_bytes)
        except BaseException as exc:
            self.future.set_exception(exc)
        else:
            self.future.set_result(None)


def queue_part(part: CopyPart) -> bool:
    """Queue ``part`` on the copy pool; False: it never runs there (the caller copies it)."""
    try:
        _copy_pool.executor().submit(part.run)
    except RuntimeError:  # after (interpreter) shutdown, or a thread that failed to start
        # cancelled, a run queued all the same copies nothing; else a pool thread has it
        return not part.future.cancel()
    return True


def submit_part(
    dst: np.ndarray, src: np.ndarray, slice_bytes: int | None
) -> concurrent.futures.Future[None] | None:
    """One part of a large copy queued on the copy pool (None: the pool takes no more work,
    at interpreter exit; the caller copies it)."""
    part = CopyPart(dst, src, slice_bytes)
    return part.future if queue_part(part) else None


def parallel_copyto(dst: np.ndarray, src: np.ndarray, slice_bytes: int | None = None) -> None:
    """np.copyto(dst, src) (src broadcast to dst's shape, as np.copyto does), a copy of
    :data:`PARALLEL_MIN_BYTES` or more split into parts of whole rows copied at once on the
    copy pool's threads and this one; each part in slices of ``slice_bytes`` (None: one
    np.copyto).  Returns once every part is copied; raises the first part's error.

    Copies on one thread when ``dst`` and ``src`` may share memory (np.copyto's own
    handling of overlap must see the whole copy) or when called from a pool thread.
    """
    source = np.broadcast_to(src, dst.shape)
    keys = split_along(dst.shape, COPY_WORKERS)
    if (
        len(keys) < 2
        or dst.nbytes < PARALLEL_MIN_BYTES
        or _copy_pool.in_worker()
        or np.may_share_memory(dst, source)
    ):
        _copy_part(dst, source, slice_bytes)
        return
    futures: list[concurrent.futures.Future[None]] = []
    inline = [keys[0]]
    copied = False
    try:
        for key in keys[1:]:
            part = CopyPart(dst[key], source[key], slice_bytes)
            # listed before it is queued: an interrupt from here on still waits for it
            futures.append(part.future)
            if not queue_part(part):
                inline.append(key)
        for key in inline:
            _copy_part(dst[key], source[key], slice_bytes)
        copied = True
    finally:
        if not copied:  # raising: the parts no pool thread started never will
            for future in futures:
                future.cancel()
        # never return (or raise) while a part may still be writing: the caller may end
        # the export, and the server may then hand those bytes to another tensor
        wait_for_every_part(futures)
    for future in futures:
        if not future.cancelled():  # cancelled: copied inline
            future.result()  # the first part that failed raises


def wait_for_every_part(futures: list[concurrent.futures.Future[None]]) -> None:
    """concurrent.futures.wait(futures), waiting on through an interrupt (Ctrl-C's
    KeyboardInterrupt, a signal handler's error) and raising it once every part is done:
    each part is one bounded copy."""
    interrupted: BaseException | None = None
    while True:
        try:
            concurrent.futures.wait(futures)
        except BaseException as exc:  # raised below, after the parts
            interrupted = exc
            continue
        break
    if interrupted is not None:
        raise interrupted


def write_array(
    tensor: Any, mapper: LocalMapper, layout: Layout, src: np.ndarray, *, setitem: bool = False
) -> bool:
    """x.copy_(ndarray) / x[key] = ndarray on the same host: one copy into the mapping.

    False (the caller takes the gRPC path, which also raises torch's errors) unless the
    array has the tensor's dtype, broadcasts to ``layout`` as torch would (``setitem``
    first drops src's leading 1s, as torch's copy_to does) and ``layout`` has no two
    elements at one address.
    """
    if tensor.device.type != "cpu" or tensor.requires_grad:
        return False
    if tensor.is_conj() or tensor.is_neg():
        return False  # values are not the stored bytes: the server writes their stored form
    try:
        if dtypes.dtype_from_numpy(src.dtype) is not tensor.dtype:
            return False
    except (TypeError, ValueError, KeyError):
        return False
    if max(src.nbytes, layout.numel * tensor.dtype.itemsize) < MIN_FAST_BYTES:
        return False
    shape = tuple(src.shape)
    if setitem:
        while shape and shape[0] == 1:
            shape = shape[1:]
    if len(shape) > layout.ndim or not no_internal_overlap(layout):
        return False
    target = layout.shape[len(layout.shape) - len(shape) :]
    if any(s not in (1, t) for s, t in zip(shape, target, strict=True)):
        return False
    with exported(mapper, tensor.handle) as export:
        if export is None:
            return False
        dst = export.array(dtypes.to_numpy_dtype(tensor.dtype), layout)
        source = src.reshape(shape)
        if aliases_through_another_mapping(dst, source):
            # its values as they are now, as the gRPC path's upload takes them: the copy
            # would otherwise read bytes it already wrote through the other address
            source = source.copy()
        parallel_copyto(dst, source)
        return True
