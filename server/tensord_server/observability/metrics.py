"""Prometheus metrics of one TensorStore: its pools, tenants and sessions (read at scrape time) and
its RPCs (each reported by the rpc layer as it ends), plus the info-level event log.

Names follow Prometheus' conventions: base units (bytes, seconds), ``_bytes``,
``_seconds``, ``_total`` on counters.  Labels are bounded: device (configured),
tenant (named in the --auth-tokens file, or "" without one), method (the
service's registered RPCs) and code (gRPC's status codes); never a session or
handle id.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from tensord.protocol import AUTHORIZATION_KEY, SESSION_KEY

from tensord_server.domain import auth
from tensord_server.observability.log_budget import LogBudget
from tensord_server.observability.node_info import NodeInfoCollector

if TYPE_CHECKING:
    from tensord_server.domain.sessions import Session
    from tensord_server.domain.store import TensorStore

# The event log (session lifecycle, OOMs, compactions, refusals) at info, the access log at debug.
events = logging.getLogger("tensord.events")
access = logging.getLogger("tensord.access")

# Latency buckets from 0.5 ms (a Heartbeat) to a minute (a large Upload or Download).
RPC_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)

# Status codes an operator wants to see at info: the server said no.
REFUSAL_CODES = frozenset(
    {
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
    }
)
# The pool's out-of-memory message (CachingPool's OutOfMemoryError) starts its second sentence so.
OOM_MARK = " out of memory. Tried to allocate "

# memory_stats() key -> (metric name, help) for the per-device gauges.
POOL_GAUGES = (
    ("allocated_bytes.all.current", "tensord_pool_allocated_bytes", "Bytes in allocated blocks"),
    (
        "reserved_bytes.all.current",
        "tensord_pool_reserved_bytes",
        "Bytes of reserved segments, less decommitted ones",
    ),
    (
        "decommitted_bytes.all.current",
        "tensord_pool_decommitted_bytes",
        "Free bytes of kept segments given back to the device (policy decommit)",
    ),
    ("active_bytes.all.current", "tensord_pool_active_bytes", "Bytes in active blocks"),
    (
        "inactive_split_bytes.all.current",
        "tensord_pool_inactive_split_bytes",
        "Free bytes in split segments (not releasable)",
    ),
    ("requested_bytes.all.current", "tensord_pool_requested_bytes", "Bytes clients asked for"),
    (
        "largest_free_block_bytes.all",
        "tensord_pool_largest_free_block_bytes",
        "The largest free block of the pool",
    ),
    (
        "releasable_bytes.all",
        "tensord_pool_releasable_bytes",
        "Bytes of cached segments that hold no allocation (empty_cache returns them)",
    ),
    (
        "external_fragmentation.all",
        "tensord_pool_external_fragmentation_ratio",
        "Share of the cache's free bytes one allocation could not use: 1 - max(largest free "
        "block, releasable bytes) / free bytes (0: one free block, an idle cache, or none)",
    ),
    ("segment.all.current", "tensord_pool_segments", "Reserved segments"),
    ("allocation.all.current", "tensord_pool_allocations", "Allocated blocks"),
    ("inactive_split.all.current", "tensord_pool_inactive_split_blocks", "Free split blocks"),
    ("storages.live", "tensord_pool_storages", "Live Storages on the device"),
    ("tier.disk.bytes.current", "tensord_tier_disk_bytes", "Bytes of Storages on the disk tier"),
    ("tier.host.bytes.current", "tensord_tier_host_bytes", "Bytes of Storages on the host tier"),
    (
        "exports.storages.current",
        "tensord_exported_storages",
        "Storages held for same-host clients",
    ),
    ("exports.bytes.current", "tensord_exported_bytes", "Bytes held for same-host clients"),
    (
        "exports.imported_segments.current",
        "tensord_mapped_segments",
        "Segments held open by CUDA IPC clients",
    ),
    (
        "exports.imported_bytes.current",
        "tensord_mapped_bytes",
        "Bytes of segments held open by CUDA IPC clients",
    ),
)
# memory_stats() key -> (counter name without _total, help).
POOL_COUNTERS = (
    ("num_ooms", "tensord_pool_ooms", "Allocations that ended out of memory"),
    ("num_alloc_retries", "tensord_pool_alloc_retries", "Allocations retried after a release"),
    ("num_compactions", "tensord_pool_compactions", "Compactions run on the OOM path"),
    ("compaction_moved_bytes", "tensord_pool_compaction_moved_bytes", "Bytes moved by compaction"),
    (
        "compaction_released_bytes",
        "tensord_pool_compaction_released_bytes",
        "Bytes of segments released by compaction",
    ),
    ("num_decommits", "tensord_pool_decommits", "Free page ranges given back to the device"),
    ("num_device_alloc", "tensord_pool_device_allocs", "Segments reserved from the device"),
    ("num_device_free", "tensord_pool_device_frees", "Segments released to the device"),
    # the tiers below the pool (a device with --host-tier / --disk-tier; 0 without)
    ("tier.disk.spilled_bytes", "tensord_tier_disk_spilled_bytes", "Bytes spilled to disk"),
    ("tier.disk.restored_bytes", "tensord_tier_disk_restored_bytes", "Bytes restored from disk"),
    ("tier.disk.num_spills", "tensord_tier_disk_spills", "Storages spilled to the disk tier"),
    ("tier.disk.num_restores", "tensord_tier_disk_restores", "Storages restored from disk"),
    (
        "tier.disk.num_spill_failures",
        "tensord_tier_disk_spill_failures",
        "Spills to disk that failed (ENOSPC, EIO): the Storage stayed put",
    ),
    (
        "tier.disk.num_corruptions",
        "tensord_tier_disk_corruptions",
        "Restores from disk whose checksum did not match",
    ),
    ("tier.host.spilled_bytes", "tensord_tier_host_spilled_bytes", "Bytes spilled to host"),
    ("tier.host.restored_bytes", "tensord_tier_host_restored_bytes", "Bytes restored from host"),
)


def tenants_of(store: TensorStore) -> list[str]:
    """The tenants a server can have: those of its tokens file, or "" without one."""
    if store.auth_tokens is None:
        return [""]
    return sorted(set(store.auth_tokens.values()))


def session_figures(store: TensorStore) -> tuple[int, int, dict[str, tuple[int, int]]]:
    """(connected sessions, lost ones within their grace, tenant -> (sessions, handles))."""
    sessions = store.sessions
    live = lost = 0
    per_tenant: dict[str, tuple[int, int]] = {}
    for session_id in sessions.session_ids():
        session = sessions.peek(session_id)
        if session is None:
            continue  # ended between the two reads
        if sessions.is_lost(session):
            lost += 1
        else:
            live += 1
        count, handles = per_tenant.get(session.tenant, (0, 0))
        per_tenant[session.tenant] = (count + 1, handles + sessions.handle_count(session))
    return live, lost, per_tenant


class StoreCollector(Collector):
    """Reads the TensorStore at scrape time: nothing polls in the background."""

    def __init__(self, store: TensorStore) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        store = self.store
        devices = [d.name for d in store.devices]
        stats = {name: store.memory_reports.memory_stats(name) for name in devices}
        for key, name, help_text in POOL_GAUGES:
            family = GaugeMetricFamily(name, help_text, labels=["device"])
            for device in devices:
                family.add_metric([device], float(stats[device].get(key, 0)))
            yield family
        capacity = GaugeMetricFamily(
            "tensord_pool_capacity_bytes", "The pool's limit", labels=["device"]
        )
        for each in store.devices:
            capacity.add_metric([each.name], float(each.pool.capacity))
        yield capacity
        for key, name, help_text in POOL_COUNTERS:
            counter = CounterMetricFamily(name, help_text, labels=["device"])
            for device in devices:
                counter.add_metric([device], float(stats[device].get(key, 0)))
            yield counter
        yield from self._tenant_metrics(devices)
        yield from self._session_metrics()
        yield from self._channel_metrics()

    def _channel_metrics(self) -> Iterator[Metric]:
        """Same-host call channels (their calls are counted with gRPC's, by method)."""
        channels, calls = self.store.exports.channel_stats()
        yield GaugeMetricFamily(
            "tensord_call_channels", "Same-host call channels served now", value=channels
        )
        yield CounterMetricFamily(
            "tensord_channel_calls",
            "Unary calls that came on a session's call channel rather than gRPC (also counted "
            "in tensord_rpc_requests_total)",
            value=calls,
        )

    def _tenant_metrics(self, devices: list[str]) -> Iterator[Metric]:
        ledger = self.store.storages.ledger
        allocated = GaugeMetricFamily(
            "tensord_tenant_allocated_bytes",
            "Bytes charged to the tenant's live Storages",
            labels=["tenant", "device"],
        )
        quota = GaugeMetricFamily(
            "tensord_tenant_quota_bytes",
            "The tenant's quota (only where one applies)",
            labels=["tenant", "device"],
        )
        storages = GaugeMetricFamily(
            "tensord_tenant_storages", "The tenant's live Storages", labels=["tenant", "device"]
        )
        for tenant in tenants_of(self.store):
            for device in devices:
                usage = ledger.usage(tenant, device)
                allocated.add_metric([tenant, device], float(usage.current))
                storages.add_metric([tenant, device], float(usage.storages))
                if usage.limit is not None:
                    quota.add_metric([tenant, device], float(usage.limit))
        yield from (allocated, quota, storages)

    def _session_metrics(self) -> Iterator[Metric]:
        live, lost, per_tenant = session_figures(self.store)
        sessions = GaugeMetricFamily(
            "tensord_sessions",
            "Open sessions: live (connected) or lost (within their grace)",
            labels=["state"],
        )
        sessions.add_metric(["live"], float(live))
        sessions.add_metric(["lost"], float(lost))
        yield sessions
        tenant_sessions = GaugeMetricFamily(
            "tensord_tenant_sessions", "The tenant's open sessions", labels=["tenant"]
        )
        tenant_handles = GaugeMetricFamily(
            "tensord_tenant_handles", "Handles the tenant's sessions hold", labels=["tenant"]
        )
        for tenant in tenants_of(self.store):
            count, handles = per_tenant.get(tenant, (0, 0))
            tenant_sessions.add_metric([tenant], float(count))
            tenant_handles.add_metric([tenant], float(handles))
        yield from (tenant_sessions, tenant_handles)


class Observer:
    """One TensorStore's metrics registry, RPC instruments and event log."""

    def __init__(self, store: TensorStore) -> None:
        self.store = store
        # a registry per TensorStore: tests run many servers in one process
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(StoreCollector(store))
        self.registry.register(NodeInfoCollector(store))
        self.requests = Counter(
            "tensord_rpc_requests",
            "RPCs handled, by method and status code",
            ["method", "code"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "tensord_rpc_duration_seconds",
            "RPC latency (a stream: until its last message), by method and status code",
            ["method", "code"],
            buckets=RPC_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._per_call: dict[tuple[str, grpc.StatusCode], tuple[Any, Any]] = {}
        self.uploaded = Counter(
            "tensord_uploaded_bytes", "Tensor bytes received by Upload", registry=self.registry
        )
        self.downloaded = Counter(
            "tensord_downloaded_bytes", "Tensor bytes sent by Download", registry=self.registry
        )
        self.sessions_ended = Counter(
            "tensord_sessions_ended",
            "Sessions ended: closed by their client, or lost (released after the grace)",
            ["reason"],
            registry=self.registry,
        )
        self._compactions_lock = threading.Lock()
        self._compactions_seen = {d.name: 0 for d in store.devices}
        # refusal lines per tenant: refused requests do not set the log's volume (log_budget.py)
        self._refusal_lines = LogBudget()
        self.refusal_lines_left_out = Counter(
            "tensord_refusal_log_lines_left_out",
            "Refused requests not logged, over their tenant's log budget (each is in "
            "tensord_rpc_requests_total too)",
            ["tenant"],
            registry=self.registry,
        )
        store.sessions.end_listeners.append(self._session_ended)

    def _session_ended(self, session: Session) -> None:
        lost = self.store.sessions.is_lost(session)
        self.sessions_ended.labels("lost" if lost else "closed").inc()

    def finished(
        self,
        method: str,
        context: grpc.ServicerContext,
        started: float,
        code: grpc.StatusCode,
        response: Any = None,
    ) -> None:
        """Count and log one finished call."""
        elapsed = time.perf_counter() - started
        counted = self._per_call.get((method, code))
        if counted is None:  # methods and codes are few: each pair's series looked up once
            counted = self._per_call[(method, code)] = (
                self.requests.labels(method, code.name),
                self.latency.labels(method, code.name),
            )
        counted[0].inc()
        counted[1].observe(elapsed)
        if access.isEnabledFor(logging.DEBUG):
            access.debug(
                "%s %s %.6fs",
                method,
                code.name,
                elapsed,
                extra={
                    "fields": {
                        "method": method,
                        "code": code.name,
                        "duration_s": round(elapsed, 6),
                        "peer": context.peer(),
                        "tenant": self._tenant(context),
                    }
                },
            )
        if code in REFUSAL_CODES:
            self._log_refusal(method, context, code)
        elif code is grpc.StatusCode.OK and method in ("OpenSession", "CloseSession"):
            self._log_session(method, context, response)
        self._log_compactions(method)

    def _tenant(self, context: grpc.ServicerContext) -> str | None:
        tokens = self.store.auth_tokens
        if tokens is None:
            return ""
        known = getattr(context, "tenant", None)  # authenticated already (rpc.calls' Call)
        if known is not None:
            return str(known)
        metadata = dict(context.invocation_metadata() or ())
        try:
            return auth.tenant_of(tokens, metadata.get(AUTHORIZATION_KEY))
        except Exception:
            return None  # not authenticated: no tenant to name

    def _log_refusal(
        self, method: str, context: grpc.ServicerContext, code: grpc.StatusCode
    ) -> None:
        tenant = self._tenant(context)
        left_out = self._refusal_lines.take(tenant)
        if left_out is None:  # over the tenant's budget: counted, said with its next line
            self.refusal_lines_left_out.labels(tenant or "").inc()
            return
        details = context.details()
        text = details.decode(errors="replace") if isinstance(details, bytes) else details or ""
        event = "oom" if OOM_MARK in text else "refused"
        fields = {
            "event": event,
            "method": method,
            "code": code.name,
            "tenant": tenant,
            "details": text,
        }
        if left_out:
            fields["left_out"] = left_out
            text += f" ({left_out} more refusals of this tenant not logged before this one)"
        events.info("%s: %s %s: %s", event, method, code.name, text, extra={"fields": fields})

    def _log_session(self, method: str, context: grpc.ServicerContext, response: Any) -> None:
        if method == "OpenSession":
            session_id = getattr(response, "session_id", "")
            event = "session_resumed" if getattr(response, "resumed", False) else "session_opened"
        else:
            metadata = dict(context.invocation_metadata() or ())
            session_id = str(metadata.get(SESSION_KEY, ""))
            event = "session_closed"
        short = session_id[:8]  # as the reaper logs it: enough to follow, not to use
        events.info(
            "%s %s",
            event.replace("_", " "),
            short,
            extra={"fields": {"event": event, "session": short, "tenant": self._tenant(context)}},
        )

    def _log_compactions(self, method: str) -> None:
        """One info line per compaction a call ran (the pool counts them; a cheap read)."""
        for device in self.store.devices:
            count = device.pool.num_compactions
            with self._compactions_lock:
                seen = self._compactions_seen.get(device.name, 0)
                self._compactions_seen[device.name] = count
            if count > seen:
                stats = device.pool.memory_stats()
                events.info(
                    "compaction on %s during %s: %d so far, %d bytes moved in all",
                    device.name,
                    method,
                    count,
                    stats["compaction_moved_bytes"],
                    extra={
                        "fields": {
                            "event": "compaction",
                            "device": device.name,
                            "method": method,
                            "compactions_total": count,
                            "moved_bytes_total": stats["compaction_moved_bytes"],
                            "released_bytes_total": stats["compaction_released_bytes"],
                        }
                    },
                )


_observers: weakref.WeakKeyDictionary[TensorStore, Observer] = weakref.WeakKeyDictionary()
_observers_lock = threading.Lock()


def observer_for(store: TensorStore) -> Observer:
    """The TensorStore's one Observer (made on first use)."""
    with _observers_lock:
        observer = _observers.get(store)
        if observer is None:
            observer = _observers[store] = Observer(store)
        return observer
