"""Factories: new tensors from a shape and a value rule (empty, full, arange).

With tenants, ``empty`` zero-fills (no tenant reads bytes another tenant freed);
every factory bounds what it writes before it allocates.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from tensord import dtypes
from tensord.layout import Layout, empty_strided_layout

from tensord_server.domain import kernels
from tensord_server.domain.kernels import Scalar
from tensord_server.domain.ops.context import Issued, OpContext
from tensord_server.domain.sessions import Session


class Factories:
    """The factory ops over one :class:`OpContext`; ``scrub_empty``: empty() zero-fills."""

    def __init__(self, ops: OpContext, scrub_empty: bool) -> None:
        self.ops = ops
        self.scrub_empty = scrub_empty

    def empty(
        self,
        session: Session,
        shape: Sequence[int],
        stride: Sequence[int] | None,
        dtype: str,
        device: str,
        requires_grad: bool = False,
    ) -> Issued:
        shape = kernels.check_shape(shape)
        if stride is None:
            layout = Layout.contiguous(shape)
        else:
            stride = tuple(stride)
            if len(stride) != len(shape):
                raise RuntimeError(
                    f"dimensionality of sizes ({len(shape)}) must match dimensionality of "
                    f"strides ({len(stride)})"
                )
            # torch's rules: a negative stride is refused (or, without elements, replaced)
            layout = empty_strided_layout(shape, stride)
        dt = dtypes.dtype_from_name(dtype) if dtype else dtypes.float32
        with self.ops.allocated(session, self.ops.device(device), layout, dt, requires_grad) as out:
            if self.scrub_empty and out.storage.nbytes:
                # torch's empty hands back whatever the block held: with tenants that may be
                # another tenant's freed bytes (every other op writes all it allocates)
                kernels.fill(out.device.xp, out.storage.raw(), 0)
            return self.ops.issue(session, out)

    def full(
        self,
        session: Session,
        shape: Sequence[int],
        value: Scalar,
        dtype: str,
        device: str,
        requires_grad: bool = False,
    ) -> Issued:
        shape = kernels.check_shape(shape)
        dt = dtypes.dtype_from_name(dtype) if dtype else kernels.scalar_dtype(value)
        kernels.check_scalar_fits(value, dt)
        self.ops.check_elements(math.prod(shape))  # it writes every one
        with self.ops.allocated(
            session, self.ops.device(device), Layout.contiguous(shape), dt, requires_grad
        ) as out:
            kernels.fill(out.device.xp, self.ops.array(out), value)
            return self.ops.issue(session, out)

    def arange(
        self,
        session: Session,
        start: Scalar,
        end: Scalar,
        step: Scalar,
        dtype: str,
        device: str,
        requires_grad: bool = False,
    ) -> Issued:
        dt = dtypes.dtype_from_name(dtype) if dtype else kernels.arange_dtype(start, end, step)
        dev = self.ops.device(device)
        kernels.check_arange_kernel(
            "arange_cuda" if dev.name.startswith("cuda") else "arange_cpu", dt
        )
        try:
            plan = kernels.arange_plan(start, end, step, dt)
        except OverflowError:
            # finite bounds whose (end - start) / step overflows a double (found by fuzzing):
            # torch's own text for a size it cannot represent
            raise RuntimeError("invalid size, possible overflow?") from None
        # each element is computed and cast (a float16 cast is ~200 ns on a loaded 2-core
        # machine): bounded like any op's elements, before the pool (found by the cost fuzz:
        # an arange as large as the pool took 7.5 s)
        self.ops.check_elements(plan.size)
        # then the pool: a range too large fails there (RESOURCE_EXHAUSTED), never in a host
        # temporary of its full size (found by fuzzing: a 32 GiB MemoryError, INTERNAL)
        layout = Layout.contiguous((plan.size,))
        with self.ops.allocated(session, dev, layout, dt, requires_grad) as out:
            kernels.arange_fill(dev.xp, self.ops.array(out), plan, dt)
            return self.ops.issue(session, out)
