"""The tensor store: the server's state, built and wired once, and the op families over it.

The store makes the shared state (the device table, the Storage registry, the sessions,
the admission gate, the tenants' tokens, the export table) and one object per family of
ops over an :class:`~tensord_server.domain.ops.context.OpContext` made on that state
(:mod:`tensord_server.domain.ops`).  It runs no op itself: the gRPC handlers
(:mod:`tensord_server.rpc.handlers`) call the family an RPC belongs to
(``store.copies.clone(...)``), and the store only starts and stops what runs in the
background (the reaper, the compactor).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

from tensord_server.devices.table import DeviceSpec, DeviceTable
from tensord_server.domain import limits, paging
from tensord_server.domain.call_gate import (
    DEFAULT_MAX_WORKERS,
    DEFAULT_STREAM_IDLE_TIMEOUT_S,
    CallGate,
)
from tensord_server.domain.compactor import BackgroundCompactor
from tensord_server.domain.exports import ExportTable
from tensord_server.domain.memory_reports import MemoryReports
from tensord_server.domain.names import TensorNames
from tensord_server.domain.ops.batch import Batches
from tensord_server.domain.ops.context import OpContext
from tensord_server.domain.ops.copies import Copies
from tensord_server.domain.ops.factories import Factories
from tensord_server.domain.ops.indexing import Indexing
from tensord_server.domain.ops.resizing import Resizing
from tensord_server.domain.ops.tiering import Tiering
from tensord_server.domain.ops.transfers import Transfers
from tensord_server.domain.ops.views import Views
from tensord_server.domain.ops.writes import Writes
from tensord_server.domain.quotas import QuotaSpec, QuotaTable, TenantLedger
from tensord_server.domain.sessions import DEFAULT_GRACE_S, DEFAULT_LEASE_S, SessionManager
from tensord_server.domain.share_tokens import (
    DEFAULT_MAX_SHARE_TTL_S,
    DEFAULT_SHARE_TTL_S,
    ShareTokens,
)
from tensord_server.domain.spiller import (
    DEFAULT_RESTORE_WORKERS,
    DEFAULT_SPILL_WORKERS,
    Spiller,
)
from tensord_server.domain.storage import StorageRegistry
from tensord_server.domain.tiers import DiskTier, HostTier, Tier, TierChain, sweep_scratch


class TensorStore:
    """Everything a tensord server owns: its state and the objects over it, each thread-safe
    (the gRPC handlers call them concurrently)."""

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
        host_tier: int | None = None,
        disk_tier: tuple[str, int] | None = None,
        spill_workers: int = DEFAULT_SPILL_WORKERS,
        restore_workers: int = DEFAULT_RESTORE_WORKERS,
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
        # the tiers under the pools (tensord serve --host-tier, --disk-tier): one host
        # buffer budget shared by every device, one scratch file per device
        self.tiers: list[Tier] = self._make_tiers(host_tier, disk_tier)
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
        )
        self.share_tokens = ShareTokens(
            self.sessions, self.storages, ttl=share_ttl, max_ttl=max_share_ttl
        )
        # token -> tenant; None: no authentication, every caller is tenant ""
        self.auth_tokens = dict(auth_tokens) if auth_tokens is not None else None
        #: the cluster's shared secret that node-to-node calls present (--cluster-token-file;
        #: None: this node accepts none)
        self.cluster_token: str | None = None
        #: PEM roots a TLS node checks the other nodes' certificates against in its node
        #: calls (--cluster-ca; None: this node serves plaintext, and so do its node calls)
        self.cluster_roots: bytes | None = None
        # same-host zero copy's books (the fd socket that serves them is the rpc layer's)
        self.exports = ExportTable(
            self.storages, self.sessions, tenants=self.auth_tokens is not None
        )
        self.exports.watch_pools([d.pool for d in self.devices])
        # the op families, one module each, all over the state above
        self.ops = OpContext(self.devices, self.storages, self.sessions, max_op_elements)
        self.views = Views(self.ops)
        self.copies = Copies(self.ops)
        self.writes = Writes(self.ops)
        self.indexing = Indexing(self.ops)
        self.resizing = Resizing(self.ops)
        # with tenants, empty() zero-fills: no tenant reads bytes another tenant freed
        self.factories = Factories(self.ops, scrub_empty=self.auth_tokens is not None)
        self.transfers = Transfers(self.ops)
        # spills above the high watermark, and prefetches, off the request path
        self.spiller = Spiller(
            self.storages,
            list(self.devices),
            spill_workers=spill_workers,
            restore_workers=restore_workers,
        )
        self.tiering = Tiering(self.ops, self.spiller)
        # the listings' page tokens (names, snapshots): valid in this process only
        self.page_tokens = paging.PageTokens()
        self.names = TensorNames(
            self.sessions, self.storages, self.page_tokens, max_names=max_names_per_tenant
        )
        self.batches = Batches(
            self.sessions,
            self.views,
            self.copies,
            self.writes,
            self.names.delete,
            self.names.delete_many,
            max_batch_elements,
        )
        self.memory_reports = MemoryReports(
            self.devices, self.storages, self.sessions, self.exports, self.page_tokens
        )
        # compaction after a free, off the freeing call (policies with a compact_threshold);
        # it steps aside while any request waits for a lock one of its moves takes
        self.compactor = BackgroundCompactor([d.pool for d in self.devices], self._contended)

    def _make_tiers(self, host_tier: int | None, disk_tier: tuple[str, int] | None) -> list[Tier]:
        """Each device's TierChain in the registry; every tier made (closed at close())."""
        made: list[Tier] = []
        host = HostTier(host_tier) if host_tier else None
        if host is not None:
            made.append(host)
        directory = None
        if disk_tier is not None:
            directory = Path(disk_tier[0])
            if not directory.is_dir():
                raise ValueError(f"--disk-tier: {directory} is not a directory")
            sweep_scratch(directory)  # a killed server's scratch files
        try:
            for device in self.devices:
                chain: list[Tier] = [host] if host is not None else []
                if directory is not None and disk_tier is not None:
                    disk = DiskTier(directory, disk_tier[1], device.name)
                    made.append(disk)
                    chain.append(disk)
                if chain:
                    self.storages.tiers[device.name] = TierChain(chain)
        except BaseException:
            for tier in made:
                tier.close()
            raise
        return made

    def _contended(self) -> bool:
        """Whether a request waits for a lock a background compaction step takes."""
        return bool(
            self.sessions.lock_waiters
            or self.share_tokens.lock_waiters
            or self.names.lock_waiters
            or self.storages.lock_waiters
            or any(device.pool.lock_waiters for device in self.devices)
        )

    def start(self) -> None:
        self.sessions.start_reaper()
        self.compactor.start()
        self.spiller.start()

    def close(self) -> None:
        """Stop the reaper and the compactor and release everything (after the gRPC server
        stopped)."""
        self.compactor.close()
        self.spiller.close()
        self.sessions.shutdown()  # the sessions' share tokens and exports end with them
        self.names.close()
        self.exports.close()
        for tier in self.tiers:  # scratch: the disk tiers' files go
            tier.close()
