"""The tensor store: the domain object that owns devices, storages and sessions, and runs tensor ops.

The store owns the state (the device table, the Storage registry, the sessions,
the admission gate, the tenants' tokens, the export table); each family of ops
lives in a module of its own, over an :class:`~tensord_server.domain.ops.OpContext`
made on that state, and the store's methods of the same names delegate to them:

==================  =================================================================
``ops.py``          what every op shares: hold, bound, allocate, issue
``views.py``        view ops (no bytes move): view, narrow, index, split, as_strided...
``copies.py``       clone, contiguous, reshape, to, repeat, cat, stack
``writes.py``       in-place writes: copy, fill, setitem
``factories.py``    empty, full, arange
``resizing.py``     resize_, set_ (a handle re-pointed in place, a Storage grown)
``transfers.py``    upload and download of raw bytes
``sharing.py``      share tokens and names
``stats.py``        memory statistics, summary, snapshot (paged), empty_cache
==================  =================================================================

The gRPC layer (:mod:`tensord_server.rpc.service`) only decodes requests into
calls here and encodes the results.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from tensord_server.devices.table import Device, DeviceSpec, DeviceTable
from tensord_server.domain import limits, paging
from tensord_server.domain.admission import (
    DEFAULT_MAX_WORKERS,
    DEFAULT_STREAM_IDLE_TIMEOUT_S,
    CallGate,
)
from tensord_server.domain.compactor import BackgroundCompactor
from tensord_server.domain.copies import Copies
from tensord_server.domain.exports import ChannelHandler, ExportTable
from tensord_server.domain.factories import Factories
from tensord_server.domain.indexing import Indexing
from tensord_server.domain.kernels import Scalar
from tensord_server.domain.ops import Issued, OpContext
from tensord_server.domain.quotas import QuotaSpec, QuotaTable, TenantLedger
from tensord_server.domain.resizing import Resizing
from tensord_server.domain.sessions import (
    DEFAULT_GRACE_S,
    DEFAULT_LEASE_S,
    DEFAULT_MAX_SHARE_TTL_S,
    DEFAULT_SHARE_TTL_S,
    Session,
    SessionManager,
)
from tensord_server.domain.sharing import Sharing
from tensord_server.domain.stats import Stats
from tensord_server.domain.storage import StorageRegistry, TensorRef
from tensord_server.domain.transfers import (
    DEFAULT_CHUNK_BYTES,
    MAX_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    Transfers,
)
from tensord_server.domain.views import (
    VIEW_OPS,
    ViewOp,
    Views,
    apply_view,
    flattened_shape,
    index_key,
)
from tensord_server.domain.writes import Writes

# Names callers imported from here before the op families had modules of their own.
__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "MAX_CHUNK_BYTES",
    "MIN_CHUNK_BYTES",
    "VIEW_OPS",
    "Issued",
    "TensorStore",
    "ViewOp",
    "apply_view",
    "flattened_shape",
    "index_key",
]


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
        max_batch_elements: int | None = limits.DEFAULT_MAX_BATCH_ELEMENTS,
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
        # same-host zero copy: made on the first Export (its fd socket is a thread and a dir)
        self._exports: ExportTable | None = None
        self._exports_lock = threading.Lock()
        # what a session's export channel runs per request (issue 13): set by the rpc layer,
        # which parses and encodes the messages (None: the export table offers no channel)
        self.export_channel_handler: ChannelHandler | None = None
        # the op families, one module each, all over the state above
        self.ops = OpContext(self.devices, self.storages, self.sessions, max_op_elements)
        # elements the ops of one pipelined Batch may touch together (None: no budget)
        self.max_batch_elements = max_batch_elements
        self.views = Views(self.ops)
        self.copies = Copies(self.ops)
        self.writes = Writes(self.ops)
        self.indexing = Indexing(self.ops)
        self.resizing = Resizing(self.ops)
        # with tenants, empty() zero-fills: no tenant reads bytes another tenant freed
        self.factories = Factories(self.ops, scrub_empty=self.auth_tokens is not None)
        self.transfers = Transfers(self.ops)
        # the listings' page tokens (names, snapshots): valid in this process only
        self.page_tokens = paging.PageTokens()
        self.sharing = Sharing(self.sessions, self.page_tokens)
        self.stats = Stats(
            self.devices, self.storages, self.sessions, lambda: self._exports, self.page_tokens
        )
        # compaction after a free, off the freeing call (policies with a compact_threshold);
        # it steps aside while any request waits for a lock one of its moves takes
        self.compactor = BackgroundCompactor([d.pool for d in self.devices], self._contended)

    @property
    def exports(self) -> ExportTable:
        with self._exports_lock:
            if self._exports is None:
                self._exports = ExportTable(
                    self.storages, self.sessions, tenants=self.auth_tokens is not None
                )
                self._exports.watch_pools([d.pool for d in self.devices])
                self._exports.channel_handler = self.export_channel_handler
            return self._exports

    def export_channel_stats(self) -> tuple[int, dict[str, int]]:
        """Export channels served now and their requests by outcome (none before the first
        Export made the export table)."""
        table = self._exports
        return (0, {}) if table is None else table.channel_stats()

    def _contended(self) -> bool:
        """Whether a request waits for a lock a background compaction step takes."""
        return bool(
            self.sessions.lock_waiters
            or self.storages.lock_waiters
            or any(device.pool.lock_waiters for device in self.devices)
        )

    def start(self) -> None:
        self.sessions.start_reaper()
        self.compactor.start()

    def close(self) -> None:
        """Stop the reaper and the compactor and release everything (after the gRPC server
        stopped)."""
        self.compactor.close()
        self.sessions.shutdown()
        with self._exports_lock:
            if self._exports is not None:
                self._exports.close()

    def device(self, name: str) -> Device:
        return self.devices.get(name)

    @property
    def max_op_elements(self) -> int | None:
        """Elements one op may read or write (None: no limit), checked before the work."""
        return self.ops.max_op_elements

    @max_op_elements.setter
    def max_op_elements(self, elements: int | None) -> None:
        self.ops.max_op_elements = elements

    @property
    def scrub_empty(self) -> bool:
        """empty() zero-fills (with tenants: no tenant reads bytes another tenant freed)."""
        return self.factories.scrub_empty

    @scrub_empty.setter
    def scrub_empty(self, scrub: bool) -> None:
        self.factories.scrub_empty = scrub

    @staticmethod
    def array(ref: TensorRef) -> Any:
        """A zero-copy strided array over the tensor's bytes (see :meth:`OpContext.array`)."""
        return OpContext.array(ref)

    # -- views (views.py) -----------------------------------------------------

    def view(
        self, session: Session, handle: str, op: ViewOp, chosen: Sequence[str] | None = None
    ) -> list[Issued]:
        return self.views.view(session, handle, op, chosen)

    # -- copies (copies.py) ---------------------------------------------------

    def clone(self, session: Session, handle: str, memory_format: str = "") -> Issued:
        return self.copies.clone(session, handle, memory_format)

    def contiguous(self, session: Session, handle: str) -> Issued:
        return self.copies.contiguous(session, handle)

    def reshape(self, session: Session, handle: str, shape: Sequence[int]) -> Issued:
        return self.copies.reshape(session, handle, shape)

    def to(
        self, session: Session, handle: str, device: str = "", dtype: str = "", copy: bool = False
    ) -> Issued:
        return self.copies.to(session, handle, device, dtype, copy)

    def repeat(self, session: Session, handle: str, repeats: Sequence[int]) -> Issued:
        return self.copies.repeat(session, handle, repeats)

    def cat(self, session: Session, handles: Sequence[str], dim: int) -> Issued:
        return self.copies.cat(session, handles, dim)

    def stack(self, session: Session, handles: Sequence[str], dim: int) -> Issued:
        return self.copies.stack(session, handles, dim)

    # -- in-place writes (writes.py) ------------------------------------------

    def copy(self, session: Session, dst_handle: str, src_handle: str) -> Issued:
        return self.writes.copy(session, dst_handle, src_handle)

    def fill(self, session: Session, handle: str, value: Scalar) -> Issued:
        return self.writes.fill(session, handle, value)

    def setitem(
        self,
        session: Session,
        handle: str,
        index: tuple[Any, ...],
        value: Scalar | None = None,
        src_handle: str | None = None,
    ) -> Issued:
        return self.writes.setitem(session, handle, index, value, src_handle)

    # -- factories (factories.py) ---------------------------------------------

    def empty(
        self,
        session: Session,
        shape: Sequence[int],
        stride: Sequence[int] | None,
        dtype: str,
        device: str,
        requires_grad: bool = False,
    ) -> Issued:
        return self.factories.empty(session, shape, stride, dtype, device, requires_grad)

    def full(
        self,
        session: Session,
        shape: Sequence[int],
        value: Scalar,
        dtype: str,
        device: str,
        requires_grad: bool = False,
    ) -> Issued:
        return self.factories.full(session, shape, value, dtype, device, requires_grad)

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
        return self.factories.arange(session, start, end, step, dtype, device, requires_grad)

    # -- transfers (transfers.py) ---------------------------------------------

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
        return self.transfers.upload(session, shape, dtype, device, nbytes, chunks, requires_grad)

    def download(self, session: Session, handle: str, chunk_bytes: int = 0) -> Iterator[bytes]:
        return self.transfers.download(session, handle, chunk_bytes)

    # -- sharing (sharing.py) -------------------------------------------------

    def share(
        self, session: Session, handle: str, uses: int | None = 1, ttl: float | None = None
    ) -> tuple[str, float]:
        return self.sharing.share(session, handle, uses, ttl)

    def revoke(self, session: Session, token: str) -> bool:
        return self.sharing.revoke(session, token)

    def attach(self, session: Session, token: str) -> Issued:
        return self.sharing.attach(session, token)

    def get_name(self, session: Session, name: str) -> Issued:
        return self.sharing.get_name(session, name)

    def list_names(self, tenant: str, page_size: int, page_token: str) -> tuple[list[str], str]:
        return self.sharing.list_names(tenant, page_size, page_token)

    # -- the pool (stats.py) --------------------------------------------------

    def memory_stats(self, device: str, tenant: str = "") -> dict[str, int | float]:
        return self.stats.memory_stats(device, tenant)

    def memory_summary(self, device: str) -> str:
        return self.stats.memory_summary(device)

    def memory_snapshot_json(self, device: str) -> bytes:
        return self.stats.memory_snapshot_json(device)

    def memory_snapshot_page(
        self, device: str, tenant: str, page_size: int, page_token: str
    ) -> tuple[bytes, str]:
        return self.stats.memory_snapshot_page(device, tenant, page_size, page_token)

    def empty_cache(self, device: str) -> int:
        return self.stats.empty_cache(device)

    # -- issue 14 indexing: advanced indexing (domain/indexing.py) ---------------------------

    def advanced_index(
        self,
        session: Session,
        handle: str,
        items: tuple[Any, ...],
        raw: bool = False,
        op: str = "",
    ) -> Issued:
        return self.indexing.advanced_index(session, handle, items, raw, op)

    def advanced_setitem(
        self,
        session: Session,
        handle: str,
        items: tuple[Any, ...],
        value: Scalar | None = None,
        src_handle: str | None = None,
        accumulate: bool = False,
        raw: bool = False,
        value_requires_grad: bool = False,
    ) -> Issued:
        return self.indexing.advanced_setitem(
            session, handle, items, value, src_handle, accumulate, raw, value_requires_grad
        )

    # ---- resize, set_ (issue 14): in place on one handle -------------------------------

    def resize(
        self, session: Session, handle: str, size: Sequence[int], memory_format: str = ""
    ) -> Issued:
        return self.resizing.resize(session, handle, size, memory_format)

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
        return self.resizing.set_storage(
            session, handle, source, source_is_storage, storage_offset, size, stride
        )
