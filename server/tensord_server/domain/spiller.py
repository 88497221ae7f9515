"""The background spiller and the prefetch workers: tier moves off the request path.

An allocation that leaves a pool with tiers above ``HIGH_WATERMARK`` of its capacity rings
the spiller's doorbell (``StorageRegistry.spill_wanted``); its thread then spills that
pool's least recently used movable Storages (``StorageRegistry.spill``: not held, not
exported, not pinned; a tenant over its share first) down to ``LOW_WATERMARK``, a bounded
round at a time, and looks again every ``POLL_S`` besides; a host tier above another
tier is kept between the same watermarks of its own limit, its least recently used
Storages demoted to the tier below (``StorageRegistry.demote``).  An allocation that would fail
does not wait for it: it spills synchronously for itself (``StorageRegistry.malloc``).

Restores a client asks for ahead of use (``x.prefetch()``) run on their own workers
(``restore_workers``), apart from the spiller's (``spill_workers``): a burst of
prefetches never starves the spills that make their room, nor the reverse.  A restore an
op needs runs on the op's own thread, as the op's first step.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from tensord_server.devices.table import Device
from tensord_server.domain.storage import (
    HIGH_WATERMARK,
    LOW_WATERMARK,
    Storage,
    StorageRegistry,
)
from tensord_server.domain.tiers import HostTier, Tier

log = logging.getLogger(__name__)

POLL_S = 0.5  # the spiller looks at every pool this often even without a doorbell
ROUND_BYTES = 256 << 20  # the most one round of background spills moves (then it looks again)
DEFAULT_SPILL_WORKERS = 1
DEFAULT_RESTORE_WORKERS = 2
JOIN_TIMEOUT_S = 10.0  # close() waits this long for a spill in progress
# Prefetches queued and not yet done, server-wide: a hint past it is dropped (each queued
# one holds its Storage, and the queue's memory, until its restore ran).
MAX_QUEUED_PREFETCHES = 65536


class Spiller:
    """Spill threads keeping ``devices``' pools under their watermarks, and a pool of
    restore workers for prefetches.  start() installs the doorbell, close() removes it
    and joins the threads."""

    def __init__(
        self,
        storages: StorageRegistry,
        devices: Sequence[Device],
        *,
        spill_workers: int = DEFAULT_SPILL_WORKERS,
        restore_workers: int = DEFAULT_RESTORE_WORKERS,
    ) -> None:
        if spill_workers < 1 or restore_workers < 1:
            raise ValueError("the spill and restore workers must each be at least 1")
        self.storages = storages
        self.devices = [d for d in devices if d.name in storages.tiers]
        # the host tiers above another tier: kept under their watermarks by demotion
        self.host_tiers: list[Tier] = []
        for chain in storages.tiers.values():
            for tier in chain.tiers[:-1]:
                if isinstance(tier, HostTier) and tier not in self.host_tiers:
                    self.host_tiers.append(tier)
        self.spill_workers = spill_workers
        self.restore_workers = restore_workers
        self.rounds = 0  # background rounds that moved something
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._restorer: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()  # guards _restorer and _queued
        self._queued = 0  # prefetches submitted and not yet done
        self.dropped_prefetches = 0  # hints dropped past MAX_QUEUED_PREFETCHES

    def start(self) -> None:
        if self._threads or not self.devices:
            return
        for index in range(self.spill_workers):
            thread = threading.Thread(
                target=self._run, args=(index,), name=f"tensord-spiller-{index}", daemon=True
            )
            thread.start()
            self._threads.append(thread)
        self.storages.spill_wanted = self.wake

    def wake(self) -> None:
        """The doorbell (a leaf: it only sets an event)."""
        self._wake.set()

    def close(self) -> None:
        if self.storages.spill_wanted == self.wake:
            self.storages.spill_wanted = None
        self._stop.set()
        self._wake.set()
        for thread in self._threads:
            thread.join(JOIN_TIMEOUT_S)
        with self._lock:
            restorer, self._restorer = self._restorer, None
        if restorer is not None:
            restorer.shutdown(wait=True)  # each queued one releases its hold when done

    def _run(self, index: int) -> None:
        # with several spill workers, worker i looks after devices i, i+n, ...
        while not self._stop.is_set():
            self._wake.wait(POLL_S)
            self._wake.clear()
            futile = False
            for device in self.devices[index :: self.spill_workers]:
                if self._stop.is_set():
                    return
                try:
                    freed = self.drain(device)
                except Exception:  # a device or tier error: the Storage stayed put
                    log.exception("background spill on %s failed; it goes on", device.name)
                    freed = 0
                pool = device.pool
                futile |= not freed and pool.allocated_bytes > HIGH_WATERMARK * pool.capacity
            if index == 0:
                for tier in self.host_tiers:
                    try:
                        self.demote(tier)
                    except Exception:
                        log.exception("demotion from the host tier failed; it goes on")
            if futile:
                # above the watermark with nothing that may move (held, pinned, exported,
                # or every tier full): each look walks every Storage, so not at every doorbell
                self._stop.wait(POLL_S)

    def drain(self, device: Device) -> int:
        """Spill ``device``'s pool down to LOW_WATERMARK if it is above HIGH_WATERMARK;
        the bytes freed."""
        pool = device.pool
        if pool.allocated_bytes <= HIGH_WATERMARK * pool.capacity:
            return 0
        freed = 0
        while not self._stop.is_set():
            excess = self.storages.above_low_watermark(device)
            if excess <= 0:
                break
            step = self.storages.spill(device, min(excess, ROUND_BYTES))
            if not step:
                break  # nothing left that may move
            freed += step
            self.rounds += 1
        return freed

    def demote(self, tier: Tier) -> int:
        """Move Storages from ``tier`` down to the next tier of their devices while it is
        above HIGH_WATERMARK of its capacity, down to LOW_WATERMARK; the bytes moved."""
        figures = tier.figures()
        current = figures[f"tier.{tier.name}.bytes.current"]
        capacity = figures[f"tier.{tier.name}.capacity_bytes"]
        if current <= HIGH_WATERMARK * capacity:
            return 0
        return self.storages.demote(tier, current - int(LOW_WATERMARK * capacity))

    def prefetch(self, storages: Sequence[Storage]) -> int:
        """Restore ``storages`` on the restore workers; each is held by the caller, and its
        hold is released here once it is back (or its restore failed: the op that needs it
        will try again and raise), or at once for a hint past MAX_QUEUED_PREFETCHES.  The
        count queued."""
        with self._lock:
            if self._restorer is None:
                self._restorer = ThreadPoolExecutor(
                    self.restore_workers, thread_name_prefix="tensord-restore"
                )
            restorer = self._restorer
            room = max(0, MAX_QUEUED_PREFETCHES - self._queued)
            queued, dropped = list(storages[:room]), list(storages[room:])
            self._queued += len(queued)
            self.dropped_prefetches += len(dropped)
        if dropped:
            self.storages.release_holds(dropped)
        for storage in queued:
            restorer.submit(self._restore_one, storage)
        return len(queued)

    def _restore_one(self, storage: Storage) -> None:
        try:
            self.storages.ensure_resident([storage])
        except Exception as exc:  # the op that reads it raises the same, typed
            log.warning("prefetch of %r failed: %s", storage, exc)
        finally:
            self.storages.release_hold(storage)
            with self._lock:
                self._queued -= 1
