"""Storage re-pointing: ``resize_`` and ``set_``, in place on one handle.

Both change what one handle names (its layout, its Storage) and nothing else: other
handles on the Storage keep their layouts, as torch's other tensors keep theirs.  When
the new layout needs more bytes than the Storage has, the Storage grows as torch's
``resize_bytes_cpu`` grows it (:meth:`StorageRegistry.grow`): every handle on it sees
the larger Storage, its bytes kept.  The cost (the grown Storage's elements, the dims)
is bounded before any byte moves; quotas are charged the growth.

The rules mirror ATen's Resize.cpp (``_resize_``, ``_resize_impl_``,
``computeStorageNbytesContiguous``) and TensorShape.cpp (``set_storage_cpu_``,
``checkSetStorage``), with their error texts.  Two deliberate differences, both where
torch would leave a broken tensor: a negative size is always refused (torch keeps
``(0, -1)``), and a layout is never issued past its Storage's end (torch's early return
for an unchanged size skips the storage resize: here the Storage grows).  On an error
the handle is unchanged (torch may have resized it before its memory-format check).
"""

from __future__ import annotations

from collections.abc import Sequence

from tensord import dtypes
from tensord import layout as layouts
from tensord.layout import Layout

from tensord_server.domain import limits
from tensord_server.domain.ops.context import Issued, OpContext
from tensord_server.domain.sessions import Session
from tensord_server.domain.storage import TensorRef

_UINT64 = 1 << 64
_INT64_MAX = (1 << 63) - 1


def _fmt(values: Sequence[int]) -> str:
    return "[" + ", ".join(str(n) for n in values) + "]"


def check_numel(size: Sequence[int]) -> None:
    """c10's safe_compute_numel: a uint64 product with overflow checks (a negative size
    wraps into one); a negative size is refused even when a 0 hides it from torch."""
    product, overflowed = 1, False
    for n in size:
        product *= n % _UINT64
        overflowed |= product >= _UINT64
        product %= _UINT64
    if overflowed or product > _INT64_MAX or any(n < 0 for n in size):
        raise RuntimeError("numel: integer multiplication overflow")


def contiguous_nbytes(size: Sequence[int], itemsize: int, offset: int) -> int:
    """computeStorageNbytesContiguous: itemsize * (offset + numel), overflow-checked."""
    needed = (offset + _product(size)) * itemsize
    if needed > _INT64_MAX:
        raise RuntimeError(f"Storage size calculation overflowed with sizes={_fmt(size)}")
    return needed


def _product(size: Sequence[int]) -> int:
    out = 1
    for n in size:
        out *= n
    return out


def resized_layout(
    layout: Layout, size: Sequence[int], itemsize: int, memory_format: str
) -> tuple[Layout, int]:
    """x.resize_(size, memory_format=...)'s layout and the bytes its Storage must hold
    (0: no resize of the Storage).  The offset stays; the size alone unchanged keeps
    the strides; a memory format restrides (its checks first, before any change)."""
    size = tuple(size)
    limits.check_result_ndim(len(size))
    if memory_format == layouts.PRESERVE_FORMAT:
        raise RuntimeError("Unsupported memory formatPreserve")
    if memory_format:
        stride = layouts.memory_format_strides(size, memory_format)  # its rank check
    if size == layout.shape and not memory_format:
        return layout, 0
    check_numel(size)
    needed = contiguous_nbytes(size, itemsize, layout.offset)
    result = Layout.contiguous(size, layout.offset)
    if memory_format:
        result = Layout(size, stride, layout.offset)
    return result, needed


def set_layout(
    layout: Layout,
    offset: int,
    size: Sequence[int],
    stride: Sequence[int] | None,
    itemsize: int,
) -> tuple[Layout, int]:
    """x.set_(storage, offset, size, stride)'s layout and the bytes its Storage must hold.
    mirrors checkSetStorage then resize_impl_cpu_ (an empty stride is no stride)."""
    size = tuple(size)
    given = tuple(stride) if stride else None
    if given is not None and len(size) != len(given):
        raise RuntimeError(f"unequal size length ({len(size)}) and stride length ({len(given)})")
    if offset < 0:
        raise RuntimeError(f"Tensor: invalid storage offset {offset}")
    limits.check_result_ndim(len(size))
    if size == layout.shape and (given is None or given == layout.stride):
        # torch returns early, strides kept (and skips the storage resize: not here)
        result = Layout(size, layout.stride, offset)
        return result, _reached_nbytes(result, itemsize)
    check_numel(size)
    stride = given if given is not None else layouts.contiguous_strides(size)
    # computeStorageNbytes (0 without elements), then set_sizes_and_strides, which
    # replaces a negative stride left on a tensor without elements, as empty_strided's
    needed = layouts.storage_nbytes(size, stride, itemsize, offset)
    fixed = layouts.empty_strided_layout(size, stride)
    return Layout(size, fixed.stride, offset), needed


def _reached_nbytes(layout: Layout, itemsize: int) -> int:
    reached = layout.element_offset_range()
    return 0 if reached is None else (reached[1] + 1) * itemsize


class Resizing:
    """resize_ and set_ over one :class:`OpContext`."""

    def __init__(self, ops: OpContext) -> None:
        self.ops = ops

    def resize(
        self, session: Session, handle: str, size: Sequence[int], memory_format: str = ""
    ) -> Issued:
        with self.ops.using(session, handle) as (ref,):
            if ref.requires_grad:
                raise RuntimeError("cannot resize variables that require grad")
            layout, needed = resized_layout(ref.layout, size, ref.dtype.itemsize, memory_format)
            target = TensorRef(ref.storage, layout, ref.dtype, ref.requires_grad)
            return self._repoint(session, handle, target, needed, holds=1)

    def set_storage(
        self,
        session: Session,
        handle: str,
        source: str = "",
        source_is_storage: bool = False,
        storage_offset: int | None = None,
        size: Sequence[int] | None = None,
        stride: Sequence[int] | None = None,
    ) -> Issued:
        """x.set_() (no source), x.set_(y), x.set_(y.untyped_storage()) and both with
        (storage_offset, size, stride)."""
        if not source:
            return self._set_empty(session, handle)
        with self.ops.using(session, handle, source) as (ref, src):
            plain = storage_offset is None or size is None
            if plain and not source_is_storage and src.dtype is not ref.dtype:
                raise RuntimeError(
                    f"Could not set tensor of type {_type_meta(src.dtype.name)} to a tensor "
                    f"of type {_type_meta(ref.dtype.name)}"
                )
            _check_in_place(ref)
            if src.device is not ref.device:
                raise RuntimeError(
                    f'Attempted to set the storage of a tensor on device "{ref.device.name}" '
                    f'to a storage on different device "{src.device.name}".  This is no '
                    "longer allowed; the devices must match."
                )
            itemsize = ref.dtype.itemsize
            if storage_offset is None or size is None:
                if source_is_storage:  # the whole Storage, as a 1-D tensor
                    storage_offset, size, stride = 0, (src.storage.nbytes // itemsize,), None
                else:
                    lay = src.layout
                    storage_offset, size, stride = lay.offset, lay.shape, lay.stride
            layout, needed = set_layout(ref.layout, storage_offset, size, stride, itemsize)
            grad = ref.requires_grad or (not source_is_storage and src.requires_grad)
            target = TensorRef(src.storage, layout, ref.dtype, grad)
            holds = 2 if ref.storage is src.storage else 1  # this op's own holds on it
            return self._repoint(session, handle, target, needed, holds)

    def _set_empty(self, session: Session, handle: str) -> Issued:
        """x.set_(): a new Storage of no bytes, size (0,)."""
        with self.ops.using(session, handle) as (ref,):
            _check_in_place(ref)
            empty = Layout.contiguous((0,))
            with self.ops.allocated(session, ref.device, empty, ref.dtype) as out:
                target = TensorRef(out.storage, empty, ref.dtype, ref.requires_grad)
                self.ops.sessions.replace(session, handle, target)
                return Issued(handle, target)

    def _repoint(
        self,
        session: Session,
        handle: str,
        target: TensorRef,
        needed: int,
        holds: int,
    ) -> Issued:
        """The handle names ``target``, its Storage grown first to ``needed`` bytes when it
        has fewer (0: no resize, as torch's maybe_resize_storage skips a 0-byte size)."""
        storage = target.storage
        if needed > storage.nbytes:
            self.ops.check_elements(needed // target.dtype.itemsize)  # copied and zeroed
            self.ops.storages.grow(storage, needed, session.tenant, holds)
        self.ops.sessions.replace(session, handle, target)
        return Issued(handle, target)


def _check_in_place(ref: TensorRef) -> None:
    """torch's check_inplace: a tensor that requires grad here has no graph, a leaf."""
    if ref.requires_grad:
        raise RuntimeError(
            "a leaf Variable that requires grad is being used in an in-place operation."
        )


def _type_meta(name: str) -> str:
    return dtypes.TYPE_META_NAMES.get(name, name)
