"""x.numpy()'s same-host destinations, kept for reuse (PyTorch's CachingHostAllocator idea).

A large copy into fresh pages pays for their faults (the kernel zeroes every page before
the copy writes it), so each array x.numpy() makes through the mapping is kept, and
handed out again once nothing else references it.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import sys
import threading
import weakref
from collections.abc import Iterator

import numpy as np

# x.numpy()'s destinations are kept for reuse (:class:`HostBufferCache`): at most this many
# bytes (``$TENSORD_NUMPY_CACHE_BYTES``, 0 turns it off) in NUMPY_CACHE_COUNT arrays.  By
# default an eighth of the machine's memory, within these bounds: the bound must hold one
# large download's array for the cache to help it at all.
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
    into fresh pages costs their faults and zeroing, so each array x.numpy() makes here is
    kept, and handed out again by a later x.numpy() of the same shape and dtype once nothing else references
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
