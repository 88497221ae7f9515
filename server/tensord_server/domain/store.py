"""The tensor store: the domain object that owns devices, storages and sessions, and runs tensor ops.

Every tensor op reads as: hold the input handles' Storages -> layout math (the
shared layout engine) -> allocate an output Storage if the op copies -> run a
kernel -> issue a handle.  The gRPC layer (:mod:`tensord_server.rpc.service`) only decodes requests
into calls here and encodes the results.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tensord import dtypes
from tensord.dtypes import DType
from tensord.layout import PRESERVE_FORMAT, Layout, empty_strided_layout

from tensord_server.devices.table import Device, DeviceSpec, DeviceTable, activate
from tensord_server.domain import indexing, kernels, limits
from tensord_server.domain.admission import (
    DEFAULT_MAX_WORKERS,
    DEFAULT_STREAM_IDLE_TIMEOUT_S,
    CallGate,
)
from tensord_server.domain.exports import ExportTable
from tensord_server.domain.kernels import Scalar
from tensord_server.domain.quotas import QuotaSpec, QuotaTable, TenantLedger
from tensord_server.domain.sessions import (
    DEFAULT_GRACE_S,
    DEFAULT_LEASE_S,
    DEFAULT_MAX_SHARE_TTL_S,
    DEFAULT_SHARE_TTL_S,
    Session,
    SessionManager,
)
from tensord_server.domain.storage import StorageRegistry, TensorRef, check_in_bounds

# Raw-byte transfers move this much per message unless the client asks otherwise.
DEFAULT_CHUNK_BYTES = 1 << 20
# Chunk sizes a client may ask for: at least 4 KiB (fewer, larger messages) ...
MIN_CHUNK_BYTES = 4 << 10
# ... and at most 16 MiB, well inside the message limit below.
MAX_CHUNK_BYTES = 16 << 20


@dataclass(frozen=True, slots=True)
class Issued:
    """A handle the server issued (or returned unchanged) and what it names."""

    handle: str
    ref: TensorRef


@dataclass(frozen=True, slots=True)
class ViewOp:
    """One layout-engine call: ``Layout.<name>(*args, **kwargs)`` (plus the dtype/grad ops)."""

    name: str
    args: tuple[Any, ...] = ()
    kwargs: tuple[tuple[str, Any], ...] = ()


def index_key(index: tuple[Any, ...]) -> Any:
    """x[index] as torch reads it: one item alone takes torch's single-index fast path
    (``x[1]``, not ``x[(1,)]``)."""
    return index[0] if len(index) == 1 else index


def apply_view(ref: TensorRef, op: ViewOp) -> list[TensorRef] | None:
    """The tensors a view op makes (no bytes move); None when torch would copy (flatten)."""
    layout, kwargs = ref.layout, dict(op.kwargs)
    if op.name == "view_dtype":
        new = dtypes.dtype_from_name(op.args[0])
        old = ref.dtype
        viewed = layout.view_dtype(
            old.itemsize, new.itemsize, old_name=old.scalar_type, new_name=new.scalar_type
        )
        # view(dtype) is not differentiable: torch's result never requires grad
        return [TensorRef(ref.storage, viewed, new, False)]
    if op.name == "detach":
        return [TensorRef(ref.storage, layout, ref.dtype, False)]
    if op.name == "set_requires_grad":
        kernels.check_requires_grad(ref.dtype, op.args[0])
        return [TensorRef(ref.storage, layout, ref.dtype, bool(op.args[0]))]
    if op.name == "expand":
        kwargs["type_name"] = ref.dtype.legacy_type
    if op.name == "as_strided":
        kwargs["storage_elements"] = ref.storage_elements
        kwargs["itemsize"] = ref.dtype.itemsize
    if op.name not in VIEW_OPS:
        raise ValueError(f"unknown view op {op.name!r}")
    result = getattr(layout, op.name)(*op.args, **kwargs)
    if result is None:
        return None
    layouts = result if isinstance(result, tuple) else (result,)
    return [ref.with_layout(lay) for lay in layouts]


VIEW_OPS = frozenset(
    {
        "view",
        "narrow",
        "select",
        "__getitem__",
        "transpose",
        "t",
        "permute",
        "movedim",
        "expand",
        "squeeze",
        "unsqueeze",
        "flatten",
        "unflatten",
        "split",
        "chunk",
        "unbind",
        "diagonal",
        "as_strided",
    }
)


class TensorStore:
    """Everything a tensord server owns.  Thread-safe; the gRPC handlers call it concurrently."""

    def __init__(
        self,
        devices: Iterable[DeviceSpec | str] = ("cpu",),
        *,
        session_grace: float = DEFAULT_GRACE_S,
        lease: float = DEFAULT_LEASE_S,
        auth_tokens: Mapping[str, str] | None = None,
        max_handles_per_session: int | None = None,
        max_sessions_per_tenant: int | None = None,
        max_names_per_tenant: int | None = None,
        quotas: Iterable[QuotaSpec] = (),
        compaction: bool = True,
        max_streams: int | None = None,
        max_streams_per_tenant: int | None = None,
        stream_idle_timeout: float = DEFAULT_STREAM_IDLE_TIMEOUT_S,
        share_ttl: float = DEFAULT_SHARE_TTL_S,
        max_share_ttl: float = DEFAULT_MAX_SHARE_TTL_S,
        max_op_elements: int | None = limits.DEFAULT_MAX_OP_ELEMENTS,
    ) -> None:
        self.devices = DeviceTable(devices)
        # worker accounting (create_server tells it the real worker count); without tenants
        # every caller is tenant "", whose fair share of the streams is all of them
        self.gate = CallGate(
            DEFAULT_MAX_WORKERS,
            max_streams=max_streams,
            max_streams_per_tenant=max_streams_per_tenant,
            idle_timeout=stream_idle_timeout,
            multi_tenant=auth_tokens is not None,
        )
        table = QuotaTable(quotas)
        table.check_against(
            (d.name for d in self.devices),
            None if auth_tokens is None else auth_tokens.values(),
        )
        self.storages = StorageRegistry(TenantLedger(table))
        # compaction (tensord serve --no-compaction turns it off): on the out-of-memory
        # path the pools may move unheld Storages, which the registry repoints
        for device in self.devices:
            device.pool.relocator = self.storages if compaction else None
        self.sessions = SessionManager(
            self.storages,
            grace=session_grace,
            lease=lease,
            max_handles=max_handles_per_session,
            max_sessions=max_sessions_per_tenant,
            max_names=max_names_per_tenant,
            share_ttl=share_ttl,
            max_share_ttl=max_share_ttl,
        )
        # token -> tenant; None: no authentication, every caller is tenant ""
        self.auth_tokens = dict(auth_tokens) if auth_tokens is not None else None
        # with tenants, empty() zero-fills: no tenant reads bytes another tenant freed
        self.scrub_empty = self.auth_tokens is not None
        # elements one op may read or write (None: no limit), checked before the work
        self.max_op_elements = max_op_elements
        # same-host zero copy: made on the first Export (its fd socket is a thread and a dir)
        self._exports: ExportTable | None = None
        self._exports_lock = threading.Lock()

    @property
    def exports(self) -> ExportTable:
        with self._exports_lock:
            if self._exports is None:
                self._exports = ExportTable(
                    self.storages, self.sessions, tenants=self.auth_tokens is not None
                )
                self._exports.watch_pools([d.pool for d in self.devices])
            return self._exports

    def start(self) -> None:
        self.sessions.start_reaper()

    def close(self) -> None:
        """Stop the reaper and release everything (after the gRPC server stopped)."""
        self.gate.shutdown()
        self.sessions.shutdown()
        with self._exports_lock:
            if self._exports is not None:
                self._exports.close()

    def device(self, name: str) -> Device:
        return self.devices.get(name)

    # -- helpers ----------------------------------------------------------------

    def _check_elements(self, elements: int) -> None:
        limits.check_op_elements(elements, self.max_op_elements)

    def _issue(self, session: Session, ref: TensorRef) -> Issued:
        return Issued(self.sessions.register(session, ref), ref)

    @contextlib.contextmanager
    def _using(self, session: Session, *handles: str) -> Iterator[list[TensorRef]]:
        """The handles' tensors, held, with their devices' kernel contexts entered."""
        with self.sessions.held(session, *handles) as refs, activate(*(r.device for r in refs)):
            yield refs

    @staticmethod
    def array(ref: TensorRef) -> Any:
        """A zero-copy strided array over the tensor's bytes.

        Every layout a kernel sees passes the issued handles' check here, including
        those an op derives without issuing them (a setitem target): a geometry past
        int64 is the caller's error (INVALID_ARGUMENT), never an INTERNAL overflow.
        """
        check_in_bounds(ref)
        return kernels.strided_array(ref.device.xp, ref.storage.raw(), ref.layout, ref.dtype)

    @contextlib.contextmanager
    def _allocated(
        self,
        session: Session,
        device: Device,
        layout: Layout,
        dtype: DType,
        requires_grad: bool = False,
    ) -> Iterator[TensorRef]:
        """A new Storage just big enough for ``layout``, charged to the session's tenant and
        held (never moved by compaction) while the block runs."""
        kernels.check_requires_grad(dtype, requires_grad)
        storage = self.storages.allocate(
            device, layout.storage_extent() * dtype.itemsize, session.tenant
        )
        try:
            with activate(device):
                yield TensorRef(storage, layout, dtype, requires_grad)
        finally:
            self.storages.release_hold(storage)

    def _copy_of(
        self, session: Session, src: TensorRef, layout: Layout, dtype: DType, device: Device
    ) -> Issued:
        """A new tensor of ``layout`` (same shape as src) holding src's values."""
        # autograd follows a copy only into a dtype that can carry gradients (x.to(int32) can't)
        grad = src.requires_grad and (dtype.is_floating_point or dtype.is_complex)
        self._check_elements(src.layout.numel)
        with self._allocated(session, device, layout, dtype, grad) as out:
            self._assign(out, self.array(src))
            return self._issue(session, out)

    def _assign(self, dst: TensorRef, src_array: Any) -> None:
        xp = dst.device.xp
        kernels.assign(xp, self.array(dst), kernels.to_module(xp, src_array))

    # -- views ------------------------------------------------------------------

    def view(self, session: Session, handle: str, op: ViewOp) -> list[Issued]:
        with self.sessions.held(session, handle) as (ref,):  # metadata only: no kernel context
            self._check_view_cost(session, ref.layout, op)
            results = apply_view(ref, op)
            if results is None:  # flatten of a non-viewable tensor copies, as reshape does
                return [self._reshape_copy(session, ref, flattened_shape(ref.layout.shape, op))]
            handles = self.sessions.register_all(session, results)
            return [Issued(h, r) for h, r in zip(handles, results, strict=True)]

    def _check_view_cost(self, session: Session, layout: Layout, op: ViewOp) -> None:
        """What a view op will produce, refused before any view is built: the number of
        tensors (split/chunk/unbind, against the limit and the session's room) and the
        dims of an index (each None adds one; the rest is cheap and checked on issue)."""
        count = limits.view_result_count(layout, op.name, op.args)
        if count is not None:
            limits.check_view_results(count)
            self.sessions.check_room(session, count)
        if op.name == "__getitem__":
            limits.check_result_ndim(limits.index_result_ndim(layout.ndim, op.args[0]))

    # -- copies -----------------------------------------------------------------

    def clone(self, session: Session, handle: str, memory_format: str = "") -> Issued:
        with self._using(session, handle) as (ref,):
            # "" (the wire's default) is preserve_format; an unknown name is a ValueError
            layout = ref.layout.clone_layout(memory_format or PRESERVE_FORMAT)
            return self._copy_of(session, ref, layout, ref.dtype, ref.device)

    def contiguous(self, session: Session, handle: str) -> Issued:
        with self._using(session, handle) as (ref,):
            if ref.layout.is_contiguous():  # torch returns self: a new handle on the same tensor
                return self._issue(session, ref)
            return self._copy_of(
                session, ref, Layout.contiguous(ref.layout.shape), ref.dtype, ref.device
            )

    def reshape(self, session: Session, handle: str, shape: Sequence[int]) -> Issued:
        with self._using(session, handle) as (ref,):
            viewed = ref.layout.reshape(tuple(shape))
            if viewed is not None:
                return self._issue(session, ref.with_layout(viewed))
            return self._reshape_copy(session, ref, tuple(shape))

    def _reshape_copy(self, session: Session, ref: TensorRef, shape: tuple[int, ...]) -> Issued:
        # mirrors torch: _unsafe_view(clone(contiguous_format), shape)
        self._check_elements(ref.layout.numel)
        target = Layout.contiguous(ref.layout.shape).view(shape)
        with self._allocated(
            session, ref.device, Layout.contiguous(ref.layout.shape), ref.dtype, ref.requires_grad
        ) as out:
            self._assign(out, self.array(ref))
            return self._issue(session, out.with_layout(target))

    def to(
        self, session: Session, handle: str, device: str = "", dtype: str = "", copy: bool = False
    ) -> Issued:
        with self._using(session, handle) as (ref,):
            target_device = self.device(device) if device else ref.device
            target_dtype = dtypes.dtype_from_name(dtype) if dtype else ref.dtype
            if target_device is ref.device and target_dtype is ref.dtype and not copy:
                return Issued(handle, ref)  # torch returns self
            return self._copy_of(session, ref, ref.layout.dense_like(), target_dtype, target_device)

    def repeat(self, session: Session, handle: str, repeats: Sequence[int]) -> Issued:
        with self._using(session, handle) as (ref,):
            repeats = tuple(repeats)
            shape = kernels.repeat_shape(ref.layout.shape, repeats)
            self._check_elements(math.prod(shape))
            with self._allocated(
                session, ref.device, Layout.contiguous(shape), ref.dtype, ref.requires_grad
            ) as out:
                # out viewed as (r0, n0, r1, n1, ...) takes src broadcast along each r_k
                padded = (1,) * (len(repeats) - ref.layout.ndim) + ref.layout.shape
                pairs = tuple(x for r, n in zip(repeats, padded, strict=True) for x in (r, n))
                src_pairs = tuple(x for n in padded for x in (1, n))
                if math.prod(shape) > 0:
                    src = self.array(ref).reshape(src_pairs)
                    kernels.assign(out.device.xp, self.array(out).reshape(pairs), src)
                return self._issue(session, out)

    def cat(self, session: Session, handles: Sequence[str], dim: int) -> Issued:
        with self._using(session, *handles) as refs:
            shape, dim, kept = kernels.cat_shape([r.layout.shape for r in refs], dim)
            self._check_elements(math.prod(shape))
            device = _common_device(refs)
            dtype = _promote(refs)
            with self._allocated(
                session, device, Layout.contiguous(shape), dtype, any(r.requires_grad for r in refs)
            ) as out:
                out_array = self.array(out)
                start = 0
                for i in kept:
                    n = refs[i].layout.shape[dim]
                    part = out_array[(slice(None),) * dim + (slice(start, start + n),)]
                    kernels.assign(
                        device.xp, part, kernels.to_module(device.xp, self.array(refs[i]))
                    )
                    start += n
                return self._issue(session, out)

    def stack(self, session: Session, handles: Sequence[str], dim: int) -> Issued:
        with self._using(session, *handles) as refs:
            dim = kernels.stack_dim([r.layout.shape for r in refs], dim)
            device = _common_device(refs)
            dtype = _promote(refs)
            base = refs[0].layout.shape
            shape = (*base[:dim], len(refs), *base[dim:])
            limits.check_result_ndim(len(shape))
            self._check_elements(math.prod(shape))
            with self._allocated(
                session, device, Layout.contiguous(shape), dtype, any(r.requires_grad for r in refs)
            ) as out:
                out_array = self.array(out)
                for i, ref in enumerate(refs):
                    part = out_array[(slice(None),) * dim + (i,)]
                    kernels.assign(device.xp, part, kernels.to_module(device.xp, self.array(ref)))
                return self._issue(session, out)

    # -- in-place writes --------------------------------------------------------

    def copy(self, session: Session, dst_handle: str, src_handle: str) -> Issued:
        with self._using(session, dst_handle, src_handle) as (dst, src):
            kernels.copy_broadcast_check(dst.layout.shape, src.layout.shape)
            self._check_elements(dst.layout.numel)
            self._write(dst, src, self.array(src))
            return Issued(dst_handle, dst)

    def _write(self, dst: TensorRef, src: TensorRef, src_array: Any) -> None:
        """dst.copy_(src) after the shape checks: torch's overlap rules, then the kernel."""
        if dst.storage is src.storage and dst.layout == src.layout and dst.dtype == src.dtype:
            return  # torch: copying a tensor onto itself is a no-op
        kernels.assert_no_internal_overlap(dst.layout)
        kernels.assert_no_partial_overlap(
            dst.storage is src.storage,
            dst.layout,
            dst.dtype.itemsize,
            src.layout,
            src.dtype.itemsize,
        )
        self._assign(dst, src_array)

    def fill(self, session: Session, handle: str, value: Scalar) -> Issued:
        with self._using(session, handle) as (ref,):
            kernels.check_scalar_fits(value, ref.dtype)
            # torch's fill_ takes an expanded tensor; writing each location once is the same
            once = ref.with_layout(kernels.collapse_expanded(ref.layout))
            self._check_elements(once.layout.numel)
            kernels.fill(ref.device.xp, self.array(once), value)
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
        with self._using(session, *handles) as refs:
            ref = refs[0]
            target = ref.with_layout(ref.layout[index_key(index)])
            if src_handle is None:
                assert value is not None
                kernels.check_scalar_fits(value, ref.dtype)
                # torch writes x[i] = v as a copy_: an expanded target is refused
                kernels.assert_no_internal_overlap(target.layout)
                self._check_elements(target.layout.numel)
                kernels.fill(ref.device.xp, self.array(target), value)
                return Issued(handle, ref)
            src = refs[1]
            # mirrors torch's copy_to: drop src's leading 1s, then expand to the slice
            stripped = kernels.strip_leading_ones(src.layout.shape)
            Layout.contiguous(stripped).expand(target.layout.shape, type_name=src.dtype.legacy_type)
            self._check_elements(target.layout.numel)
            self._write(target, src, self.array(src).reshape(stripped))
            return Issued(handle, ref)

    # -- factories --------------------------------------------------------------

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
        with self._allocated(session, self.device(device), layout, dt, requires_grad) as out:
            if self.scrub_empty and out.storage.nbytes:
                # torch's empty hands back whatever the block held: with tenants that may be
                # another tenant's freed bytes (every other op writes all it allocates)
                kernels.fill(out.device.xp, out.storage.raw(), 0)
            return self._issue(session, out)

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
        self._check_elements(math.prod(shape))  # it writes every one
        with self._allocated(
            session, self.device(device), Layout.contiguous(shape), dt, requires_grad
        ) as out:
            kernels.fill(out.device.xp, self.array(out), value)
            return self._issue(session, out)

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
        dev = self.device(device)
        try:
            plan = kernels.arange_plan(start, end, step, dt)
        except OverflowError:
            # finite bounds whose (end - start) / step overflows a double (found by fuzzing):
            # torch's own text for a size it cannot represent
            raise RuntimeError("invalid size, possible overflow?") from None
        # each element is computed and cast (a float16 cast is ~200 ns on a loaded 2-core
        # machine): bounded like any op's elements, before the pool (found by the cost fuzz:
        # an arange as large as the pool took 7.5 s)
        self._check_elements(plan.size)
        # then the pool: a range too large fails there (RESOURCE_EXHAUSTED), never in a host
        # temporary of its full size (found by fuzzing: a 32 GiB MemoryError, INTERNAL)
        layout = Layout.contiguous((plan.size,))
        with self._allocated(session, dev, layout, dt, requires_grad) as out:
            kernels.arange_fill(dev.xp, self.array(out), plan, dt)
            return self._issue(session, out)

    # -- transfers --------------------------------------------------------------

    def upload(
        self,
        session: Session,
        shape: Sequence[int],
        dtype: str,
        device: str,
        nbytes: int,
        chunks: Iterable[bytes],
        requires_grad: bool = False,
    ) -> Issued:
        """A new tensor from raw bytes, written as they arrive; nothing is left on any failure."""
        shape = kernels.check_shape(shape)
        dt = dtypes.dtype_from_name(dtype)
        layout = Layout.contiguous(shape)
        expected = layout.numel * dt.itemsize
        if nbytes != expected:
            raise ValueError(
                f"upload header declares {nbytes} bytes, but shape {list(shape)} of {dt.name} "
                f"holds {expected}"
            )
        with self._allocated(session, self.device(device), layout, dt, requires_grad) as out:
            received = 0
            for chunk in chunks:
                if received + len(chunk) > nbytes:
                    raise ValueError(f"upload carried more than the declared {nbytes} bytes")
                out.storage.write(received, chunk)
                received += len(chunk)
            if received != nbytes:
                raise ValueError(f"upload ended after {received} of {nbytes} bytes")
            return self._issue(session, out)

    def download(self, session: Session, handle: str, chunk_bytes: int = 0) -> Iterator[bytes]:
        """The tensor's elements in logical order, as raw chunks (a generator: held while it runs).

        A contiguous tensor streams straight from its Storage, one chunk read at a
        time; any other is gathered in logical order a chunk at a time (the server's
        temporary memory is a few chunks, whatever the tensor's logical size).
        """
        chunk = DEFAULT_CHUNK_BYTES if chunk_bytes <= 0 else chunk_bytes
        chunk = min(max(chunk, MIN_CHUNK_BYTES), MAX_CHUNK_BYTES)
        with self.sessions.held(session, handle) as (ref,):
            layout, itemsize = ref.layout, ref.dtype.itemsize
            self._check_elements(layout.numel)
            nbytes = layout.numel * itemsize
            if layout.is_contiguous():
                block, backend = ref.storage.block, ref.device.backend
                base = block.offset + layout.offset * itemsize
                for start in range(0, nbytes, chunk):
                    size = min(chunk, nbytes - start)
                    yield backend.read(block.segment.memory, base + start, size)
                return
            # an expanded view's logical size is unbounded by its Storage: gather it a chunk
            # at a time, never whole (a 2**27-element expand grew the server by 528 MB)
            yield from kernels.logical_chunks(
                self.array(ref), itemsize, chunk, lambda: activate(ref.device)
            )

    # -- sharing ----------------------------------------------------------------

    def share(
        self, session: Session, handle: str, uses: int | None = 1, ttl: float | None = None
    ) -> tuple[str, float]:
        """A share token (see SessionManager.share) and the ttl it got."""
        return self.sessions.share(session, handle, uses, ttl)

    def revoke(self, session: Session, token: str) -> bool:
        return self.sessions.revoke(session, token)

    def attach(self, session: Session, token: str) -> Issued:
        return Issued(*self.sessions.attach(session, token))

    def get_name(self, session: Session, name: str) -> Issued:
        return Issued(*self.sessions.get_name(session, name))

    # -- the pool ---------------------------------------------------------------

    def memory_stats(self, device: str, tenant: str = "") -> dict[str, int | float]:
        """torch's memory_stats() of the device's pool plus live counters (not torch's keys).

        ``tenant.*`` counts the caller's own tenant only: what other tenants use is
        theirs.  ``tenant.quota_bytes`` is present only when a quota applies.
        """
        dev = self.device(device)
        stats: dict[str, int | float] = dict(dev.pool.memory_stats())
        stats["sessions.live"] = len(self.sessions.session_ids())
        stats["storages.live"] = sum(1 for s in self.storages.live() if s.device is dev)
        usage = self.storages.ledger.usage(tenant, dev.name)
        stats["tenant.sessions.live"] = self.sessions.tenant_session_count(tenant)
        stats["tenant.storages.live"] = usage.storages
        stats["tenant.allocated_bytes.current"] = usage.current
        stats["tenant.allocated_bytes.peak"] = usage.peak
        if usage.limit is not None:
            stats["tenant.quota_bytes"] = usage.limit
        exported, exported_bytes = (
            self._exports.stats(dev.name) if self._exports is not None else (0, 0)
        )
        stats["exports.storages.current"] = exported  # held for same-host clients
        stats["exports.bytes.current"] = exported_bytes
        imported, imported_bytes = (
            self._exports.import_stats(dev.name) if self._exports is not None else (0, 0)
        )
        stats["exports.imported_segments.current"] = imported  # held open by CUDA IPC clients
        stats["exports.imported_bytes.current"] = imported_bytes
        return stats

    def memory_summary(self, device: str) -> str:
        return self.device(device).pool.memory_summary()

    def memory_snapshot_json(self, device: str) -> bytes:
        return json.dumps(self.device(device).pool.memory_snapshot()).encode()

    def empty_cache(self, device: str) -> int:
        """Release cached segments; returns the reserved bytes given back to the device."""
        pool = self.device(device).pool
        before = int(pool.memory_stats()["reserved_bytes.all.current"])
        pool.empty_cache()
        return before - int(pool.memory_stats()["reserved_bytes.all.current"])

    # -- issue 14 indexing: advanced indexing (the rules in domain/indexing.py) -------------

    def advanced_index(
        self,
        session: Session,
        handle: str,
        items: tuple[Any, ...],
        raw: bool = False,
        op: str = "",
    ) -> Issued:
        """x[items] with a tensor (or Python bool) among them: a gather into a new tensor.
        ``raw``: the items are aten::index's list (tensors and None), as index_select's."""
        extra = indexing.tensor_handles(items)
        with self._using(session, handle, *extra) as held:
            ref, refs = held[0], dict(zip(extra, held[1:], strict=True))
            target, indices = indexing.sliced(self.array, ref, items, refs, raw)
            plan = indexing.planned(self.array, self._check_elements, target, indices, op)
            indexing.check_bounds(plan, op)
            layout = Layout(plan.shape, plan.stride)
            with self._allocated(session, ref.device, layout, ref.dtype, ref.requires_grad) as out:
                indexing.gather(ref.device.xp, self.array(target), self.array(out), plan)
                return self._issue(session, out)

    def advanced_setitem(
        self,
        session: Session,
        handle: str,
        items: tuple[Any, ...],
        value: Scalar | None = None,
        src_handle: str | None = None,
        accumulate: bool = False,
        raw: bool = False,
    ) -> Issued:
        """x[items] = value (a scalar or a tensor); x.index_put_(items, value, accumulate)
        with ``raw``.  Checks in torch's order: the scalar, the slicing, the masked_fill_
        dispatch or the value's shape and dtype, then the indices' bounds."""
        extra = indexing.tensor_handles(items)
        sources = () if src_handle is None else (src_handle,)
        with self._using(session, handle, *extra, *sources) as held:
            ref, refs = held[0], dict(zip(extra, held[1 : 1 + len(extra)], strict=True))
            src = held[-1] if src_handle is not None else None
            if src is None:  # torch makes the scalar a tensor of x's dtype first
                assert value is not None
                kernels.check_scalar_fits(value, ref.dtype)
            target, indices = indexing.sliced(self.array, ref, items, refs, raw)
            plan = indexing.planned(self.array, self._check_elements, target, indices)
            xp, dst = ref.device.xp, self.array(target)
            if not accumulate and indexing.dispatches_to_masked_fill(indices, src):
                indexing.check_masked_fill_mask(indices)
                if src is not None:
                    value = kernels.to_host(self.array(src)).reshape(()).item()
                assert value is not None
                source = indexing.scalar_source(xp, dst, value, ref.dtype)
            elif src is None:
                assert value is not None
                source = indexing.scalar_source(xp, dst, value, ref.dtype)
            else:
                shape = indexing.check_put_source(ref, src, plan, raw)
                source = kernels.to_module(xp, self.array(src)).reshape(shape)
            indexing.check_bounds(plan, "")
            indexing.scatter(xp, dst, source, plan, accumulate)
            return Issued(handle, ref)


def flattened_shape(shape: tuple[int, ...], op: ViewOp) -> tuple[int, ...]:
    """The shape torch.flatten gives: the layout engine's flatten of a contiguous tensor
    (always a view), so the rule lives in one place."""
    flat = Layout.contiguous(shape).flatten(*op.args)
    assert flat is not None  # a contiguous tensor always flattens as a view
    return flat.shape


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
