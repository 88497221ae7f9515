"""Memory statistics and pool control per device: torch's memory_stats() plus live counters,
the summary, the snapshot, and empty_cache.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from tensord_server.devices.table import Device, DeviceTable
from tensord_server.domain.exports import ExportTable
from tensord_server.domain.sessions import SessionManager
from tensord_server.domain.storage import StorageRegistry


class Stats:
    """The pools' statistics; ``exports_made()`` is the export table if one was made (counting
    exports never makes one)."""

    def __init__(
        self,
        devices: DeviceTable,
        storages: StorageRegistry,
        sessions: SessionManager,
        exports_made: Callable[[], ExportTable | None],
    ) -> None:
        self.devices = devices
        self.storages = storages
        self.sessions = sessions
        self.exports_made = exports_made

    def device(self, name: str) -> Device:
        return self.devices.get(name)

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
        exports = self.exports_made()
        exported, exported_bytes = exports.stats(dev.name) if exports is not None else (0, 0)
        stats["exports.storages.current"] = exported  # held for same-host clients
        stats["exports.bytes.current"] = exported_bytes
        imported, imported_bytes = exports.import_stats(dev.name) if exports is not None else (0, 0)
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
