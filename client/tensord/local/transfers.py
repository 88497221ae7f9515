"""The same-host paths of x.numpy(), x.copy_(array), x[key] = array and uploads.

Each takes an export of the tensor's Storage for the length of one copy through the
mapping, and answers that it did not (None, False) whenever the gRPC path must run
instead: another device, a small transfer, a layout or dtype the copy cannot serve.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from tensord import dtypes
from tensord.layout import Layout
from tensord.local import host_cache
from tensord.local.copies import parallel_copyto
from tensord.local.mapper import LocalMapper
from tensord.local.segments import aliases_through_another_mapping

# Transfers smaller than this keep the gRPC path: one Upload/Download call beats
# Empty + Export + a release for small tensors.
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


@contextlib.contextmanager
def exported(mapper: LocalMapper | None, handle: str) -> Any:
    """An export for the length of a transfer (None: take the gRPC path), released after."""
    export = mapper.export(handle) if mapper is not None and mapper.enabled else None
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
    if tensor.device.type != "cpu" or tensor.nbytes < MIN_FAST_BYTES:
        return None
    with exported(mapper, tensor.handle) as export:
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
    if max(src.nbytes, layout.numel * tensor.itemsize) < MIN_FAST_BYTES:
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
