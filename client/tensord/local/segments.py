"""Pool segments mapped into this process, and exports: arrays over a pinned Storage's bytes.

A :class:`Segment` is one memfd segment of the server's pool, mapped shared here once
and kept while any array over it lives; when the session ends it becomes private memory
at the same addresses (:meth:`Segment.make_private`), so an alias taken before keeps
working but never reaches the pool again.  An :class:`Export` is one pinned Storage in a
segment: every array it makes holds it, and its end (the last array collected) is
reported to whoever made it.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import mmap
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from tensord.layout import Layout, reach_bounds

if TYPE_CHECKING:
    from tensord.schema import ExportResponse

#: what an export's end tells its mapper: (export id, its segment, its reuse key)
ExportEnded = Callable[[str, "Segment", "tuple[str, str] | None"], None]


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


class Export:
    """A pinned Storage mapped here: arrays over its bytes (any layout, any dtype).

    Keeps its segment mapped and its pin held while this object lives; every array made
    by :meth:`array` holds it.  :meth:`close` (or collection) calls ``ended``, which queues
    the release.
    """

    def __init__(
        self,
        ended: ExportEnded,
        response: ExportResponse,
        segment: Segment,
        reuse_key: tuple[str, str] | None = None,
    ) -> None:
        self.id = export_id = response.export_id
        self.meta = meta = response.tensor  # each read of a field builds its object anew
        self.storage_start = response.storage_byte_offset
        self.storage_nbytes = meta.storage_nbytes
        self._segment = segment
        self._finalizer = weakref.finalize(self, ended, export_id, segment, reuse_key)
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
