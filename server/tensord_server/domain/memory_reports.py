"""The memory reports a client asks for per device, and pool control: torch's memory_stats()
with the server's live counts (sessions, Storages, the caller's tenant, exports), the
summary, the snapshot (whole, or a page at a time), and empty_cache.  The pool's own
counters and snapshot are :mod:`tensord_server.pool.stats`'s; this module adds what only
the server knows and pages what a message cannot hold.

A paged snapshot (MemorySnapshot, domain/paging.py): each page is a ``_snapshot()`` dict
holding part of the whole, at most paging.MAX_PAGE_BYTES of JSON -- the segments by address,
then the device trace's entries, page_size items (segments and entries) at most.  The first
page records the snapshot's trace entry and carries ``allocator_settings``; the trace ends
at that entry, as torch's does.  A segment with more blocks than fit is cut: the next page
starts with it again (same address, its header as it is then) holding the blocks after the
last one sent, and a client joins the two.  The token holds the place: the last segment's
and block's addresses and the next trace entry's sequence number, never an index.
"""

from __future__ import annotations

import json
import struct
from typing import Any

from tensord.errors import InvalidArgumentError

from tensord_server.devices.table import Device, DeviceTable
from tensord_server.domain import paging
from tensord_server.domain.exports import ExportTable
from tensord_server.domain.sessions import SessionManager
from tensord_server.domain.storage import StorageRegistry


class MemoryReports:
    """The pools' reports, with the server's live counts beside them.  Thread-safe."""

    def __init__(
        self,
        devices: DeviceTable,
        storages: StorageRegistry,
        sessions: SessionManager,
        exports: ExportTable,
        tokens: paging.PageTokens,
    ) -> None:
        self.tokens = tokens
        self.devices = devices
        self.storages = storages
        self.sessions = sessions
        self.exports = exports

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
        exported, exported_bytes = self.exports.stats(dev.name)
        stats["exports.storages.current"] = exported  # held for same-host clients
        stats["exports.bytes.current"] = exported_bytes
        imported, imported_bytes = self.exports.import_stats(dev.name)
        stats["exports.imported_segments.current"] = imported  # held open by CUDA IPC clients
        stats["exports.imported_bytes.current"] = imported_bytes
        stats.update(self.storages.tier_figures(dev))  # tier.* (a device with tiers only)
        return stats

    def memory_summary(self, device: str) -> str:
        return self.device(device).pool.memory_summary()

    def memory_snapshot_json(self, device: str) -> bytes:
        return json.dumps(self.device(device).pool.memory_snapshot()).encode()

    def memory_snapshot_page(
        self, device: str, tenant: str, page_size: int, page_token: str
    ) -> tuple[bytes, str]:
        """One page of the device's snapshot as JSON (see the module's docstring), and the
        next page's token ("" after the last)."""
        limit = paging.page_size(page_size)
        dev = self.device(device)
        scope = (tenant, dev.name)
        place = _SnapshotPlace.opened(self.tokens.open(SNAPSHOT_LISTING, scope, page_token))
        page: dict[str, Any] = {"segments": [], "device_traces": [[]]}
        if place is None:
            settings, trace_end = dev.pool.snapshot_begin()
            page["allocator_settings"] = settings
            place = _SnapshotPlace(SEGMENTS, -1, -1, 0, trace_end)
        budget = paging.MAX_PAGE_BYTES - paging.PAGE_FRAMING_BYTES
        used = _json_bytes(page)
        segments: list[dict[str, Any]] = page["segments"]
        if place.phase == SEGMENTS:
            block = None if place.block < 0 else place.block
            part = dev.pool.snapshot_segments(
                place.segment, block, limit, budget // _MIN_BLOCK_JSON_BYTES
            )
            sent_all = True
            for info in part.segments:
                blocks = info["blocks"]
                info["blocks"] = []
                cost = _json_bytes(info) + 2  # ", " before it
                if blocks:
                    cost += _json_bytes(blocks[0]) + 2
                if segments and used + cost > budget:
                    sent_all = False
                    break
                used += cost
                kept = min(len(blocks), 1)
                for later in blocks[1:]:
                    later_cost = _json_bytes(later) + 2
                    if used + later_cost > budget:
                        break
                    used += later_cost
                    kept += 1
                info["blocks"] = blocks[:kept]
                segments.append(info)
                whole = kept == len(blocks) and (
                    info is not part.segments[-1] or part.last_complete
                )
                if not whole:
                    place = place.after(info["address"], blocks[kept - 1]["address"])
                    sent_all = False
                    break
                place = place.after(info["address"], -1)
            if sent_all and not part.more:
                place = place.after_segments()
        if place.phase == TRACE and len(segments) < limit:
            first, entries = dev.pool.trace_entries(
                place.trace, place.trace_end, limit - len(segments)
            )
            trace: list[dict[str, Any]] = page["device_traces"][0]
            for entry in entries:
                entry_cost = _json_bytes(entry) + 2
                if used + entry_cost > budget and (trace or segments):
                    break
                used += entry_cost
                trace.append(entry)
            place = place.at_trace(first + len(trace))
        more = place.phase == SEGMENTS or place.trace < place.trace_end
        data = json.dumps(page).encode()
        token = self.tokens.issue(SNAPSHOT_LISTING, scope, place.packed()) if more else ""
        return data, token

    def empty_cache(self, device: str) -> int:
        """Release cached segments; returns the reserved bytes given back to the device."""
        pool = self.device(device).pool
        before = int(pool.memory_stats()["reserved_bytes.all.current"])
        pool.empty_cache()
        return before - int(pool.memory_stats()["reserved_bytes.all.current"])


# The listing's kind in its page tokens, and its two phases.
SNAPSHOT_LISTING = "memory_snapshot"
SEGMENTS, TRACE = 0, 1
# No block's JSON is shorter ({"address": 0, "size": 512, ...}): a page asks the pool for at
# most its bytes over this many blocks, so the pool's work under its lock follows the page.
_MIN_BLOCK_JSON_BYTES = 64
_PLACE = struct.Struct("!Bqqqq")


class _SnapshotPlace:
    """Where a paged snapshot goes on: the phase, the last segment's address and block's
    address sent (-1: none; a segment with no block sent was sent whole), the next trace
    entry's sequence number and the one that ends this snapshot's trace."""

    __slots__ = ("block", "phase", "segment", "trace", "trace_end")

    def __init__(self, phase: int, segment: int, block: int, trace: int, trace_end: int) -> None:
        self.phase = phase
        self.segment = segment
        self.block = block
        self.trace = trace
        self.trace_end = trace_end

    @classmethod
    def opened(cls, place: bytes | None) -> _SnapshotPlace | None:
        if place is None:
            return None
        if len(place) != _PLACE.size:
            raise InvalidArgumentError("invalid page_token for a memory snapshot")
        phase, segment, block, trace, trace_end = _PLACE.unpack(place)
        if phase not in (SEGMENTS, TRACE):
            raise InvalidArgumentError("invalid page_token for a memory snapshot")
        return cls(phase, segment, block, trace, trace_end)

    def after(self, segment: int, block: int) -> _SnapshotPlace:
        return _SnapshotPlace(SEGMENTS, segment, block, self.trace, self.trace_end)

    def after_segments(self) -> _SnapshotPlace:
        return _SnapshotPlace(TRACE, self.segment, -1, self.trace, self.trace_end)

    def at_trace(self, trace: int) -> _SnapshotPlace:
        return _SnapshotPlace(TRACE, self.segment, -1, trace, self.trace_end)

    def packed(self) -> bytes:
        return _PLACE.pack(self.phase, self.segment, self.block, self.trace, self.trace_end)


def _json_bytes(value: Any) -> int:
    return len(json.dumps(value))  # ASCII (json's default): characters are bytes
