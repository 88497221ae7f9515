"""Ops that make new tensors from existing ones: clone, contiguous, reshape, to, repeat, cat, stack.

Each holds its inputs, bounds the elements it will write, allocates one new
Storage and copies into it with torch's rules (an op torch answers with self,
such as ``contiguous`` of a contiguous tensor, issues a handle on the same tensor).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from tensord import dtypes
from tensord.dtypes import DType
from tensord.layout import PRESERVE_FORMAT, Layout

from tensord_server.devices.table import Device
from tensord_server.domain import kernels, limits
from tensord_server.domain.ops.context import Issued, OpContext
from tensord_server.domain.sessions import Session
from tensord_server.domain.storage import TensorRef


class Copies:
    """The copy ops over one :class:`OpContext`."""

    def __init__(self, ops: OpContext) -> None:
        self.ops = ops

    def clone(self, session: Session, handle: str, memory_format: str = "") -> Issued:
        with self.ops.using(session, handle) as (ref,):
            # "" (the wire's default) is preserve_format; an unknown name is a ValueError
            layout = ref.layout.clone_layout(memory_format or PRESERVE_FORMAT)
            return self._copy_of(session, ref, layout, ref.dtype, ref.device)

    def contiguous(self, session: Session, handle: str) -> Issued:
        with self.ops.using(session, handle) as (ref,):
            if ref.layout.is_contiguous():  # torch returns self: a new handle on the same tensor
                return self.ops.issue(session, ref)
            return self._copy_of(
                session, ref, Layout.contiguous(ref.layout.shape), ref.dtype, ref.device
            )

    def reshape(self, session: Session, handle: str, shape: Sequence[int]) -> Issued:
        with self.ops.using(session, handle) as (ref,):
            viewed = ref.layout.reshape(tuple(shape))
            if viewed is not None:
                return self.ops.issue(session, ref.with_layout(viewed))
            return reshape_copy(self.ops, session, ref, tuple(shape))

    def to(
        self, session: Session, handle: str, device: str = "", dtype: str = "", copy: bool = False
    ) -> Issued:
        with self.ops.using(session, handle) as (ref,):
            target_device = self.ops.device(device) if device else ref.device
            target_dtype = dtypes.dtype_from_name(dtype) if dtype else ref.dtype
            if target_device is ref.device and target_dtype is ref.dtype and not copy:
                return Issued(handle, ref)  # torch returns self
            return self._copy_of(session, ref, ref.layout.dense_like(), target_dtype, target_device)

    def repeat(self, session: Session, handle: str, repeats: Sequence[int]) -> Issued:
        with self.ops.using(session, handle) as (ref,):
            repeats = tuple(repeats)
            shape = kernels.repeat_shape(ref.layout.shape, repeats)
            self.ops.check_elements(math.prod(shape))
            with self.ops.allocated(
                session, ref.device, Layout.contiguous(shape), ref.dtype, ref.requires_grad
            ) as out:
                # out viewed as (r0, n0, r1, n1, ...) takes src broadcast along each r_k
                padded = (1,) * (len(repeats) - ref.layout.ndim) + ref.layout.shape
                pairs = tuple(x for r, n in zip(repeats, padded, strict=True) for x in (r, n))
                src_pairs = tuple(x for n in padded for x in (1, n))
                if math.prod(shape) > 0:
                    src = self.ops.values(ref).reshape(src_pairs)
                    kernels.assign(out.device.xp, self.ops.array(out).reshape(pairs), src)
                return self.ops.issue(session, out)

    def cat(self, session: Session, handles: Sequence[str], dim: int) -> Issued:
        limits.check_join_inputs("cat", len(handles))  # before any input is held
        with self.ops.using(session, *handles) as refs:
            shape, dim, kept = kernels.cat_shape([r.layout.shape for r in refs], dim)
            self.ops.check_elements(math.prod(shape))
            device = _common_device(refs)
            dtype = _promote(refs)
            with self.ops.allocated(
                session, device, Layout.contiguous(shape), dtype, any(r.requires_grad for r in refs)
            ) as out:
                out_array = self.ops.array(out)
                start = 0
                for i in kept:
                    n = refs[i].layout.shape[dim]
                    part = out_array[(slice(None),) * dim + (slice(start, start + n),)]
                    kernels.assign(
                        device.xp, part, kernels.to_module(device.xp, self.ops.values(refs[i]))
                    )
                    start += n
                return self.ops.issue(session, out)

    def stack(self, session: Session, handles: Sequence[str], dim: int) -> Issued:
        limits.check_join_inputs("stack", len(handles))  # before any input is held
        with self.ops.using(session, *handles) as refs:
            dim = kernels.stack_dim([r.layout.shape for r in refs], dim)
            device = _common_device(refs)
            dtype = _promote(refs)
            base = refs[0].layout.shape
            shape = (*base[:dim], len(refs), *base[dim:])
            limits.check_result_ndim(len(shape))
            self.ops.check_elements(math.prod(shape))
            with self.ops.allocated(
                session, device, Layout.contiguous(shape), dtype, any(r.requires_grad for r in refs)
            ) as out:
                out_array = self.ops.array(out)
                for i, ref in enumerate(refs):
                    part = out_array[(slice(None),) * dim + (i,)]
                    kernels.assign(
                        device.xp, part, kernels.to_module(device.xp, self.ops.values(ref))
                    )
                return self.ops.issue(session, out)

    def _copy_of(
        self, session: Session, src: TensorRef, layout: Layout, dtype: DType, device: Device
    ) -> Issued:
        """A new tensor of ``layout`` (same shape as src) holding src's values."""
        # autograd follows a copy only into a dtype that can carry gradients (x.to(int32) can't)
        grad = src.requires_grad and (dtype.is_floating_point or dtype.is_complex)
        self.ops.check_elements(src.layout.numel)
        with self.ops.allocated(session, device, layout, dtype, grad) as out:
            self.ops.assign(out, self.ops.values(src))
            return self.ops.issue(session, out)


def reshape_copy(
    ops: OpContext, session: Session, ref: TensorRef, shape: tuple[int, ...]
) -> Issued:
    """x.reshape(shape) when no view can: mirrors torch's _unsafe_view(clone(contiguous_format),
    shape) (also flatten's copy of a non-viewable tensor)."""
    ops.check_elements(ref.layout.numel)
    target = Layout.contiguous(ref.layout.shape).view(shape)
    with ops.allocated(
        session, ref.device, Layout.contiguous(ref.layout.shape), ref.dtype, ref.requires_grad
    ) as out:
        ops.assign(out, ops.values(ref))
        return ops.issue(session, out.with_layout(target))


def _common_device(refs: Sequence[TensorRef]) -> Device:
    first = refs[0].device
    for ref in refs[1:]:
        if ref.device is not first:
            raise RuntimeError(
                "Expected all tensors to be on the same device, but found at least two devices, "
                f"{first.name} and {ref.device.name}!"
            )
    return first


def _promote(refs: Sequence[TensorRef]) -> DType:
    result = refs[0].dtype
    for ref in refs[1:]:
        result = dtypes.promote_types(result, ref.dtype)
    return result
