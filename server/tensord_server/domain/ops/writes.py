"""In-place writes into existing tensors: copy_, fill_ and x[index] = value.

Torch's overlap rules come first (an expanded or partly overlapping destination
is refused), then the elements written are bounded, then the kernel runs.
"""

from __future__ import annotations

from typing import Any

from tensord.layout import Layout

from tensord_server.domain import kernels, limits
from tensord_server.domain.kernels import Scalar
from tensord_server.domain.ops.context import Issued, OpContext
from tensord_server.domain.ops.views import index_key
from tensord_server.domain.sessions import Session
from tensord_server.domain.storage import TensorRef


class Writes:
    """The in-place ops over one :class:`OpContext`."""

    def __init__(self, ops: OpContext) -> None:
        self.ops = ops

    def copy(self, session: Session, dst_handle: str, src_handle: str) -> Issued:
        with self.ops.using(session, dst_handle, src_handle) as (dst, src):
            kernels.copy_broadcast_check(dst.layout.shape, src.layout.shape)
            self.ops.check_elements(dst.layout.numel)
            self._write(dst, src, self.ops.values(src))
            return Issued(dst_handle, dst)

    def _write(self, dst: TensorRef, src: TensorRef, src_array: Any) -> None:
        """dst.copy_(src) after the shape checks: torch's overlap rules, then the kernel."""
        same = dst.storage is src.storage and dst.layout == src.layout and dst.dtype == src.dtype
        if same and (dst.conj, dst.neg) == (src.conj, src.neg):
            return  # torch: copying a tensor onto itself is a no-op (not onto its conjugate)
        kernels.assert_no_internal_overlap(dst.layout)
        kernels.assert_no_partial_overlap(
            dst.storage is src.storage,
            dst.layout,
            dst.dtype.itemsize,
            src.layout,
            src.dtype.itemsize,
        )
        self.ops.assign(dst, src_array)

    def fill(self, session: Session, handle: str, value: Scalar) -> Issued:
        with self.ops.using(session, handle) as (ref,):
            kernels.check_scalar_fits(value, ref.dtype)
            # torch's fill_ takes an expanded tensor; writing each location once is the same
            once = ref.with_layout(kernels.collapse_expanded(ref.layout))
            self.ops.check_elements(once.layout.numel)
            self.ops.fill(once, value)
            return Issued(handle, ref)

    def setitem(
        self,
        session: Session,
        handle: str,
        index: tuple[Any, ...],
        value: Scalar | None = None,
        src_handle: str | None = None,
    ) -> Issued:
        handles = (handle,) if src_handle is None else (handle, src_handle)
        with self.ops.using(session, *handles) as refs:
            ref = refs[0]
            # bounded before the view is built: each None unsqueezes it (O(dims) a time)
            limits.check_result_ndim(limits.index_result_ndim(ref.layout.ndim, index))
            target = ref.with_layout(ref.layout[index_key(index)])
            if src_handle is None:
                assert value is not None
                kernels.check_scalar_fits(value, ref.dtype)
                # torch writes x[i] = v as a copy_: an expanded target is refused
                kernels.assert_no_internal_overlap(target.layout)
                self.ops.check_elements(target.layout.numel)
                self.ops.fill(target, value)
                return Issued(handle, ref)
            src = refs[1]
            # mirrors torch's copy_to: drop src's leading 1s, then expand to the slice
            stripped = kernels.strip_leading_ones(src.layout.shape)
            Layout.contiguous(stripped).expand(target.layout.shape, type_name=src.dtype.legacy_type)
            self.ops.check_elements(target.layout.numel)
            self._write(target, src, self.ops.values(src).reshape(stripped))
            return Issued(handle, ref)
