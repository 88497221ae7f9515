"""The same-host paths of x.numpy(), x.copy_(array), x[key] = array, uploads and staged puts.

Each takes an export of the tensor's Storage for the length of one copy through the
mapping, and answers that it did not (None, False) whenever the gRPC path must run
instead: another device, a small transfer, a layout or dtype the copy cannot serve.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import numpy as np

from tensord import dtypes, errors
from tensord.layout import Layout
from tensord.local import host_cache
from tensord.local.copies import parallel_copyto
from tensord.local.mapper import LocalMapper
from tensord.local.segments import aliases_through_another_mapping
from tensord.protocol import MAX_STAGED_ITEMS

# Transfers smaller than this keep the gRPC path until the client maps a segment: before,
# one Upload/Download call beats Empty + Export + receiving the segment's descriptor and
# mapping it; once one is mapped, an export is one call on the call channel (or none: a
# live export of the Storage is reused), which any stream's setup costs more than.
MIN_FAST_BYTES = 256 << 10
#: a same-host upload of at least this many bytes carries the releases queued before it
RELEASE_BEFORE_UPLOAD_BYTES = 16 << 20
# x.numpy() copies out of the mapping in slices of about this many bytes: one np.copyto of
# a whole large array ends in glibc's large-copy loop, which reads several 4 KiB pages at
# once, and from a memfd mapping (shared memory gets no huge pages where the host's
# shmem_enabled is "never") that is far slower than slices.  Copies into the mapping keep
# one np.copyto per part: there the large-copy loop is the fast one.
READ_SLICE_BYTES = 8 << 20


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


def worth_mapping(mapper: LocalMapper | None, nbytes: int) -> bool:
    """Whether a transfer of ``nbytes`` goes through the mapping: any size once a segment
    is mapped, else from MIN_FAST_BYTES on."""
    if mapper is None or not mapper.enabled:
        return False
    return nbytes >= MIN_FAST_BYTES or mapper.mapping


@contextlib.contextmanager
def exported(mapper: LocalMapper | None, handle: str, storage_id: str = "") -> Any:
    """An export for the length of a transfer (None: take the gRPC path), released after;
    a live export of the Storage (``storage_id``) is used, and kept, if there is one."""
    if mapper is None or not mapper.enabled:
        yield None
        return
    live = mapper.live_export(storage_id) if storage_id else None
    if live is not None:
        yield live
        return
    try:
        export = mapper.export(handle)
    except errors.ResourceExhaustedError as exc:
        # a session with no room for an export (--max-handles-per-session): the gRPC path
        # needs none.  (Its traceback's frames would hold the caller's until a collection.)
        exc.__traceback__ = exc.__context__ = None
        export = None
    try:
        yield export
    finally:
        if export is not None:
            export.close()


def read_array(tensor: Any, mapper: LocalMapper, layout: Layout) -> np.ndarray | None:
    """x.numpy() on the same host: one copy out of the mapping into a new array, a large one
    on several threads (:func:`parallel_copyto`); None: use gRPC.  The result never aliases
    the pool: numpy() keeps copying (use np.from_dlpack for an alias).  The array may be
    one an earlier x.numpy() returned and nothing references any more (:data:`tensord.local.host_cache.numpy_cache`)."""
    if tensor.device.type != "cpu" or not worth_mapping(mapper, tensor.nbytes):
        return None
    with exported(mapper, tensor.handle, tensor.untyped_storage().storage_id) as export:
        if export is None:
            return None
        np_dtype = dtypes.to_numpy_dtype(tensor.dtype)
        view = export.array(np_dtype, layout)
        out = host_cache.numpy_cache.empty(view.shape, np_dtype)
        parallel_copyto(out, view, READ_SLICE_BYTES)
        return out


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
        if dtypes.dtype_from_numpy(src.dtype) is not dtypes.canonical(tensor.dtype):
            return False
    except (TypeError, ValueError, KeyError):
        return False
    if not worth_mapping(mapper, max(src.nbytes, layout.numel * tensor.itemsize)):
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
    with exported(mapper, tensor.handle, tensor.untyped_storage().storage_id) as export:
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


# A put of at most this many bytes (of all the items of a put_many together) is staged: its
# bytes written into a pooled tensor through the mapping, and the server copies them into
# the named tensor in the same call that names it.  Larger ones upload, then name.
STAGED_PUT_BYTES = 4 << 20
# The smallest staging tensor made, and how many are kept for the next puts (the largest).
MIN_STAGING_BYTES = 64 << 10
STAGINGS_KEPT = 2
# Staged items start at multiples of this (a cache line).
STAGING_ALIGN = 64


class Staging:
    """A pooled uint8 tensor of this client's session, exported and mapped here."""

    __slots__ = ("export", "nbytes", "session_id", "tensor")

    def __init__(self, tensor: Any, export: Any, nbytes: int, session_id: str) -> None:
        self.tensor = tensor  # holds the handle (its release when dropped)
        self.export = export  # holds the pin and the mapping
        self.nbytes = nbytes
        self.session_id = session_id

    def write(self, offset: int, array: np.ndarray) -> None:
        """``array``'s bytes (C-contiguous) at ``offset`` of the staging tensor."""
        flat = array.reshape(-1).view(np.uint8)
        np.copyto(self.export.storage_bytes()[offset : offset + flat.size], flat)


def staging_bytes(nbytes: int) -> int:
    """The size of a staging tensor made for ``nbytes``: a power of two, at least
    MIN_STAGING_BYTES."""
    return max(MIN_STAGING_BYTES, 1 << max(nbytes - 1, 0).bit_length())


def staged_offsets(sizes: list[int], limit: int = STAGED_PUT_BYTES) -> tuple[list[int | None], int]:
    """Where each of ``sizes`` goes in one staging tensor (None: it does not fit in
    ``limit`` bytes beside the ones before it, or MAX_STAGED_ITEMS are placed already, and
    uploads), and the bytes they need."""
    offsets: list[int | None] = []
    used = placed = 0
    for size in sizes:
        start = -(-used // STAGING_ALIGN) * STAGING_ALIGN
        if start + size > limit or placed == MAX_STAGED_ITEMS:
            offsets.append(None)
            continue
        offsets.append(start)
        used = start + size
        placed += 1
    return offsets, used


class StagingPool:
    """The staging tensors a client's puts take turns with.  Thread-safe: each is one
    put's at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[Staging] = []

    def take(self, nbytes: int, session_id: str) -> Staging | None:
        """The smallest free staging tensor of ``session_id`` that holds ``nbytes`` (None:
        the caller makes one); those of another session are dropped."""
        with self._lock:
            self._free = [s for s in self._free if s.session_id == session_id]
            fitting = [s for s in self._free if s.nbytes >= nbytes]
            if not fitting:
                return None
            chosen = min(fitting, key=lambda s: s.nbytes)
            self._free.remove(chosen)
            return chosen

    def give_back(self, staging: Staging) -> None:
        with self._lock:
            self._free.append(staging)
            self._free.sort(key=lambda s: s.nbytes, reverse=True)
            del self._free[STAGINGS_KEPT:]

    def clear(self) -> bool:
        """Drop the pooled staging tensors (their handles and exports are released as they
        go); whether there were any."""
        with self._lock:
            dropped, self._free = self._free, []
        return bool(dropped)
