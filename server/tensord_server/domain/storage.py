"""Storages (untyped bytes in one pool block) and the tensors that view them.

A Storage lives while something refers to it: a handle in a session, a share
token or a name.  Each of those holds one reference; so does any operation
that is using the Storage right now (a "hold"), so that a concurrent Release can
never hand a block back to the pool while a copy still reads or writes it.

Compaction may move a Storage to another block of its pool (clients hold
handles on the Storage, never on the block).  What clients see as its address
(``data_ptr``) is not the block's: the registry gives each Storage a virtual
address of its own when it is made (:class:`AddressSpace`): it never changes
while the Storage lives and no other live Storage is given an address inside
its range (torch users compare ``data_ptr()`` to detect aliasing); a freed
Storage's range is reused, as torch's allocator reuses addresses, so the space
in use is bounded by the live Storages, not by every allocation ever made.  Block addresses stay the pool's (snapshots, memory_viz).  Holds
are counted apart from references for that: a held Storage never moves, and
while the pool moves blocks it holds the registry's lock, so no hold starts; a
background move copies without the lock and repoints the Storage only if no hold
began meanwhile (``uses`` unchanged: :meth:`StorageRegistry.claim`).

Tiers (:mod:`tensord_server.domain.tiers`) are the same move with another target: a
spill copies an unheld, unpinned Storage to the host tier or a disk extent outside the
lock, and repoints it there (freeing its block) only if no hold began meanwhile; a
hold on a spilled Storage restores it first (:meth:`StorageRegistry.ensure_resident`,
called by the session table once its lock is let go), so every op that touches bytes
finds them in its pool.  A spilled Storage keeps its id, address and charge.
"""

from __future__ import annotations

import functools
import logging
import random
import secrets
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
from tensord.dtypes import DType
from tensord.errors import (
    InternalError,
    OutOfMemoryError,
    PermissionDeniedError,
    ResourceExhaustedError,
)
from tensord.layout import Layout

from tensord_server.devices.table import Device
from tensord_server.domain import limits
from tensord_server.domain.quotas import TenantLedger
from tensord_server.domain.tiers import Placement, Tier, TierChain
from tensord_server.pool import Block, CachingPool, CountingLock, round_size

log = logging.getLogger(__name__)

# The first virtual address handed out (non-zero, like a real pointer) and the alignment
# of each one (torch's allocators align blocks to 512 B).
ADDRESS_SPACE_BASE = 1 << 40
ADDRESS_ALIGNMENT = 512
# Addresses stay below this (TensorMeta.storage_data_ptr is a uint64; int64 for torch users).
ADDRESS_SPACE_END = 1 << 63

# Spill watermarks, shares of a device pool's capacity (as Mooncake, LMCache and Ray use):
# allocated bytes above HIGH wake the background spiller, which spills down to LOW.
HIGH_WATERMARK = 0.85
LOW_WATERMARK = 0.70
# An allocation that would fail spills synchronously, at most this many rounds (each
# spilling twice the last's bytes, from the request's own size up), then fails.
SYNC_SPILL_ROUNDS = 6
# The least a round of spills frees (fewer, bigger holes for the pool to reuse).
MIN_SPILL_BYTES = 2 << 20
# What each Storage a spill picks counts towards the bytes it wants, at least: a move costs
# per Storage (two lock acquisitions, a 4 KiB extent, a write, a checksum), so one spill
# moves at most want / this Storages however small they are.
SPILL_COUNT_FLOOR_BYTES = 64 << 10


class _Hole:
    """A free range below the top: a node of the holes' treap (ordered by ``start``, a heap
    by ``priority``), ``biggest`` the largest ``size`` in its subtree."""

    __slots__ = ("biggest", "left", "priority", "right", "size", "start")

    def __init__(self, start: int, size: int, priority: int) -> None:
        self.start = start
        self.size = size
        self.priority = priority
        self.left: _Hole | None = None
        self.right: _Hole | None = None
        self.biggest = size

    def update(self) -> _Hole:
        self.biggest = max(
            self.size,
            self.left.biggest if self.left else 0,
            self.right.biggest if self.right else 0,
        )
        return self


def _split(node: _Hole | None, key: int) -> tuple[_Hole | None, _Hole | None]:
    """The holes starting below ``key``, and the others."""
    if node is None:
        return None, None
    if node.start < key:
        node.right, right = _split(node.right, key)
        return node.update(), right
    left, node.left = _split(node.left, key)
    return left, node.update()


def _merge(left: _Hole | None, right: _Hole | None) -> _Hole | None:
    """Two treaps, every hole of ``left`` below every hole of ``right``, as one."""
    if left is None or right is None:
        return left or right
    if left.priority > right.priority:
        left.right = _merge(left.right, right)
        return left.update()
    right.left = _merge(left, right.left)
    return right.update()


class AddressSpace:
    """Aligned virtual ranges for Storages: a live range never overlaps another and never
    moves; a freed one is reused.  Not thread-safe (the registry's lock guards it).

    First fit over the free ranges, coalesced on every release; the top of the
    space comes down whenever the highest range is freed, so it is always the end
    of the highest live range (the base when none lives).  The free ranges are a
    treap by address, each subtree knowing its biggest range, so first fit walks one
    path (O(log n) expected, under the registry's lock) instead of scanning every
    hole: many small Storages do not slow every allocation down.
    """

    def __init__(self, base: int = ADDRESS_SPACE_BASE, end: int = ADDRESS_SPACE_END) -> None:
        self.base = base
        self.end = end
        self.top = base  # everything at or above is free
        self._holes: _Hole | None = None  # free ranges below the top, never adjacent
        self._free = 0  # their bytes
        self._priorities = random.Random(0)  # the treap's balance, not a secret
        # holes looked at by take's searches so far (a test's measure of the search's cost)
        self.inspected = 0

    @staticmethod
    def span(nbytes: int) -> int:
        """The aligned range ``nbytes`` takes (at least one unit: a zero-byte Storage's
        address is its own too)."""
        return -(-max(nbytes, 1) // ADDRESS_ALIGNMENT) * ADDRESS_ALIGNMENT

    def take(self, nbytes: int) -> int:
        span = self.span(nbytes)
        hole = self._first_fit(span)
        if hole is not None:
            start, size = hole.start, hole.size
            self._remove(start)
            if size > span:
                self._add(start + span, size - span)
            return start
        if self.top + span > self.end:
            raise ResourceExhaustedError(
                f"no virtual address range of {span} bytes is left for a new Storage"
            )
        address = self.top
        self.top += span
        return address

    def _first_fit(self, span: int) -> _Hole | None:
        """The lowest free range of at least ``span`` bytes: one path down the treap."""
        node = self._holes
        while node is not None and node.biggest >= span:
            self.inspected += 1
            if node.left is not None and node.left.biggest >= span:
                node = node.left
            elif node.size >= span:
                return node
            else:
                node = node.right
        return None

    def _add(self, start: int, size: int) -> None:
        left, right = _split(self._holes, start)
        hole = _Hole(start, size, self._priorities.getrandbits(32))
        self._holes = _merge(_merge(left, hole), right)
        self._free += size

    def _remove(self, start: int) -> int:
        """Drop the hole at ``start``; its size."""
        left, rest = _split(self._holes, start)
        hole, right = _split(rest, start + 1)
        assert hole is not None and hole.start == start, (hole, start)
        self._holes = _merge(left, right)
        self._free -= hole.size
        return hole.size

    def _hole_at(self, start: int) -> _Hole | None:
        node = self._holes
        while node is not None and node.start != start:
            node = node.left if start < node.start else node.right
        return node

    def _hole_below(self, address: int) -> _Hole | None:
        """The highest hole starting below ``address``."""
        node, found = self._holes, None
        while node is not None:
            if node.start < address:
                found, node = node, node.right
            else:
                node = node.left
        return found

    def give_back(self, address: int, nbytes: int) -> None:
        span = self.span(nbytes)
        if self._hole_at(address + span) is not None:
            span += self._remove(address + span)  # merge the hole above
        below = self._hole_below(address)
        if below is not None and below.start + below.size == address:  # merge into it
            address = below.start
            span += self._remove(address)
        if address + span == self.top:
            self.top = address  # the highest range: the top comes down
            return
        self._add(address, span)

    def free_bytes_below_top(self) -> int:
        return self._free


def charge_for(nbytes: int) -> int:
    """What a tenant is charged for a Storage of ``nbytes``: the request rounded as the pool
    rounds (512 B), the same whichever block serves it, so one tenant's quota never depends
    on how others left the pool."""
    return round_size(nbytes) if nbytes else 0


class Storage:
    """Untyped bytes: one block of one device's pool, or (spilled) one tier's placement.

    Invariants: ``0 <= holds <= refs``, both guarded by the registry's lock;
    exactly one of ``block`` (its pool's) and ``placement`` (a lower tier's) is
    where its bytes are while ``refs > 0`` (``freed`` after); ``block`` is
    allocated in ``device.pool`` exactly while the Storage is resident; it changes
    only under the registry's lock: by compaction while ``holds == 0``, by a
    grow swapping in the block the op holding it filled outside the lock
    (``StorageRegistry.grow``), by a spill (``holds == 0``, not ``pinned``) or a
    restore (its caller holds it).  A held Storage is always resident.
    """

    __slots__ = (
        "_block",
        "address",
        "device",
        "freed",
        "holds",
        "id",
        "last_use",
        "nbytes",
        "pinned",
        "placement",
        "refs",
        "restoring",
        "tenant",
        "tiering",
        "uses",
    )

    def __init__(
        self, device: Device, block: Block, nbytes: int, tenant: str = "", address: int = 0
    ) -> None:
        self.id = secrets.token_hex(8)  # equal for every handle on it, in every session
        self.address = address  # what clients see as data_ptr: fixed for its life
        self.device: Device = device
        self._block: Block | None = block
        self.nbytes: int = nbytes
        self.tenant: str = tenant  # who created it, and is charged its block
        self.refs: int = 0  # handles + share tokens + names + holds
        self.holds: int = 0  # operations reading or writing the bytes now (never moved then)
        # holds ever taken: a grow copying outside the lock sees whether any began meanwhile
        self.uses: int = 0
        self.freed: bool = False
        # where the bytes rest when not in the pool (None: resident, ``block`` holds them)
        self.placement: Placement | None = None
        self.pinned: bool = False  # kept on its device: never spilled (x.pin_memory_tier())
        self.last_use: int = 0  # the registry's clock at its last hold (LRU order of spills)
        # set while one thread restores it; the others wait on it for that one restore
        self.restoring: threading.Event | None = None
        self.tiering: bool = False  # a spill copies it now: compaction leaves it alone

    @property
    def block(self) -> Block:
        """Its block in the pool; only a resident Storage has one (a held one is)."""
        block = self._block
        if block is None:
            raise InternalError(f"the bytes of spilled {self!r} were used without restoring it")
        return block

    @block.setter
    def block(self, block: Block) -> None:
        self._block = block

    @property
    def resident(self) -> bool:
        return self._block is not None

    def resident_block(self) -> Block | None:
        """Its block, or None while spilled (for readers that hold nothing: a report)."""
        return self._block

    @property
    def charge(self) -> int:
        return charge_for(self.nbytes)

    @property
    def data_ptr(self) -> int:
        """The stable virtual address (the block's address is the pool's, and moves)."""
        return self.address

    def raw(self) -> Any:
        """The bytes as a zero-copy 1-D uint8 array of the device's array module."""
        return self.device.backend.view(self.block.segment.memory, self.block.offset, self.nbytes)

    def write(self, offset: int, data: bytes | memoryview) -> None:
        self.device.backend.write(self.block.segment.memory, self.block.offset + offset, data)

    def __repr__(self) -> str:
        where = "" if self.placement is None else f", on the {self.placement.tier.name} tier"
        return (
            f"Storage({self.id}, {self.device.name}, {self.nbytes} bytes, "
            f"refs={self.refs}, holds={self.holds}{where})"
        )


class StorageRegistry:
    """Every live Storage, with reference counting and holds.  Thread-safe.

    ``allocate`` returns a Storage holding one reference that is a hold (the
    caller's: ``release_hold`` when done with the bytes); ``decref`` to zero frees its
    block back to the pool.  The ledger charges each Storage to the tenant that
    created it, within that tenant's quota (``Storage.charge``: a move changes
    nothing); charges and refunds happen under the lock, but for a grow's, charged
    before its copy (outside the lock) and refunded if it fails.

    It is also the pools' :class:`~tensord_server.pool.Relocator` (lock order:
    a pool's lock, then this one; this one is never held while calling a pool).
    """

    def __init__(self, ledger: TenantLedger | None = None) -> None:
        self.ledger = ledger if ledger is not None else TenantLedger()
        # guards _storages, every Storage's refs, holds and block, and the ledger's changes;
        # counts its waiters: the background compactor moves only while nobody waits
        self._lock = CountingLock()
        self._storages: dict[str, Storage] = {}
        # each live Storage by its block: compaction asks "who owns this block?" of every
        # allocated block in a pool, and a plan is cheap only if that is a lookup (building
        # the answer for every Storage per plan took a tenth of a loaded server's GIL)
        self._by_block: dict[Block, Storage] = {}
        self._addresses = AddressSpace()  # data_ptrs: unique among live Storages, reused after
        # tenant -> its pool stream: blocks are only reused and segments only split on
        # their own stream, so no segment ever holds two tenants' Storages (a same-host
        # client maps whole segments); "" (no authentication) keeps stream 0
        self._streams: dict[str, int] = {"": 0}
        # device name -> the tiers under its pool (none: an allocation that cannot be served
        # is an OutOfMemoryError at once, as before tiers)
        self.tiers: dict[str, TierChain] = {}
        self._clock = 0  # ticks at every hold: each Storage's last_use, the spills' LRU order
        # the background spiller's doorbell (a leaf: it only sets an event), rung when an
        # allocation leaves a pool with tiers above HIGH_WATERMARK
        self.spill_wanted: Callable[[], None] | None = None

    def allocate(self, device: Device, nbytes: int, tenant: str = "") -> Storage:
        """A new Storage charged to ``tenant``; ResourceExhaustedError over its quota."""
        charge = charge_for(nbytes)  # known before the block
        # refuse before the pool evicts cached segments or compacts for a request that cannot
        # be kept anyway; the charge below settles races between one tenant's requests
        self.ledger.precheck(tenant, device.name, charge)
        block = self.malloc(device, nbytes, tenant)  # OutOfMemoryError: no undo
        storage = Storage(device, block, nbytes, tenant)
        storage.refs = storage.holds = 1
        try:
            with self._lock:
                self.ledger.charge(tenant, device.name, charge)
                try:
                    storage.address = self._addresses.take(nbytes)
                except BaseException:
                    self.ledger.refund(tenant, device.name, charge)
                    raise
                self._storages[storage.id] = storage
                self._by_block[block] = storage
                storage.last_use = self._tick()
        except BaseException:
            device.pool.free(block)
            raise
        return storage

    # -- tiers ----------------------------------------------------------------------

    def _tick(self) -> int:
        """(lock held) The next tick of the LRU clock."""
        self._clock += 1
        return self._clock

    def malloc(self, device: Device, nbytes: int, tenant: str) -> Block:
        """A block of ``device``'s pool for ``tenant``'s Storage; when the pool cannot serve
        it and the device has tiers, unheld Storages spill synchronously (bounded rounds)
        until it can; OutOfMemoryError naming each tier's use when every tier is full."""
        pool, stream = device.pool, self.stream_of(tenant)
        chain = self.tiers.get(device.name)
        if chain is not None:
            # surely beyond the pool: spill first rather than walk its out-of-memory path
            beyond = pool.allocated_bytes + round_size(nbytes) - pool.capacity
            if beyond > 0:
                self.spill(device, max(beyond, MIN_SPILL_BYTES))
        try:
            # with tiers a refusal is not yet an out-of-memory: a spill may serve it
            block = pool.malloc(nbytes, stream, count_oom=chain is None)
        except OutOfMemoryError as exc:
            if chain is None:
                raise
            block = self._malloc_spilling(device, nbytes, stream, chain, exc)
        self._check_watermark(device)
        return block

    def _malloc_spilling(
        self, device: Device, nbytes: int, stream: int, chain: TierChain, error: Exception
    ) -> Block:
        want = max(nbytes, MIN_SPILL_BYTES)
        for _ in range(SYNC_SPILL_ROUNDS):
            if not self.spill(device, want):
                break
            try:
                return device.pool.malloc(nbytes, stream, count_oom=False)
            except OutOfMemoryError as exc:
                error = exc
            want *= 2
        device.pool.count_oom(nbytes, stream)  # the request's one out-of-memory
        details = getattr(error, "details", {})
        raise OutOfMemoryError(
            f"{error} Every tier below it is full or holds nothing that may move: "
            f"{chain.describe()}.",
            **details,
        ) from None

    def _check_watermark(self, device: Device) -> None:
        pool = device.pool
        if (
            self.spill_wanted is not None
            and device.name in self.tiers
            and pool.allocated_bytes > HIGH_WATERMARK * pool.capacity
        ):
            self.spill_wanted()

    def above_low_watermark(self, device: Device) -> int:
        """Bytes allocated in ``device``'s pool beyond LOW_WATERMARK (0 when below)."""
        pool = device.pool
        return max(0, pool.allocated_bytes - int(LOW_WATERMARK * pool.capacity))

    def spill(self, device: Device, want: int) -> int:
        """Move the least recently used Storages of ``device`` that nobody holds, no
        export maps and nobody pinned down a tier until ``want`` bytes are free (or none
        is left to move), a tenant over its share of the pool first; the bytes freed."""
        chain = self.tiers.get(device.name)
        if chain is None or want <= 0:
            return 0
        with self._lock:
            picked = self._spill_candidates(device, want)
        freed = 0
        for index, storage in enumerate(picked):
            try:
                freed += self._spill_one(storage, chain)
            except BaseException:
                for rest in picked[index + 1 :]:
                    self._unpick(rest)
                raise
        return freed

    def _spill_candidates(self, device: Device, want: int) -> list[Storage]:
        """(lock held) The Storages to spill for ``want`` bytes, each marked ``tiering``
        with one more reference (so none is freed while its bytes are copied)."""
        resident = [s for s in self._storages.values() if s.device is device and s.resident]
        per_tenant: dict[str, int] = {}
        for storage in resident:
            per_tenant[storage.tenant] = per_tenant.get(storage.tenant, 0) + storage.nbytes
        share = device.pool.capacity / max(1, len(per_tenant))  # a fair share each
        movable = [
            s for s in resident if s.holds == 0 and not s.pinned and not s.tiering and s.nbytes
        ]
        # a tenant over its share first, then the least recently used
        movable.sort(key=lambda s: (per_tenant[s.tenant] <= share, s.last_use))
        picked, total = [], 0
        for storage in movable:
            if total >= want:
                break
            storage.tiering = True
            storage.refs += 1
            picked.append(storage)
            # the pool bytes its block gives back, and at least the floor (bounded count)
            total += max(round_size(storage.nbytes), SPILL_COUNT_FLOOR_BYTES)
        return picked

    def _unpick(self, storage: Storage) -> None:
        with self._lock:
            storage.tiering = False
            block = self._decref_locked(storage)
        if block is not None:
            storage.device.pool.free(block)

    def _spill_one(self, storage: Storage, chain: TierChain) -> int:
        """Copy a picked Storage to the first tier with room, outside the lock, and repoint
        it there if nobody held it meanwhile; its source stays until the copy is complete
        (a failed write leaves it where it was, counted by the tier).  The bytes freed."""
        with self._lock:  # a hold from here on changes ``uses``: the move is dropped then
            uses, block = storage.uses, storage._block
            busy = bool(storage.holds or storage.pinned)
        if block is None or busy:
            self._unpick(storage)
            return 0
        device = storage.device
        placement = None
        try:
            data = _host_bytes(storage, block)
            for tier in chain.tiers:
                placement = tier.store(data, storage.id)
                if placement is not None:
                    break
        except OSError as exc:  # ENOSPC, EIO: counted by the tier; the Storage stays
            log.warning("spilling %r failed: %s; it stays on %s", storage, exc, device.name)
        except BaseException:
            self._unpick(storage)
            raise
        with self._lock:
            storage.tiering = False
            moved = (
                placement is not None
                and not storage.freed
                and storage.holds == 0
                and storage.uses == uses
                and not storage.pinned
                and storage._block is block
            )
            if moved:
                del self._by_block[block]
                storage._block = None
                storage.placement = placement
            last = self._decref_locked(storage)
        if placement is not None and not moved:
            placement.tier.release(placement)  # used meanwhile: the copy may be stale
        if last is not None:
            device.pool.free(last)
        if moved:
            device.pool.free(block)
            return storage.nbytes
        return 0

    def demote(self, tier: Tier, want: int) -> int:
        """Move the least recently used Storages resting on ``tier`` (the host tier) one
        tier down their device's chain (the disk), until ``want`` bytes left ``tier``;
        the bytes moved.  Each move keeps its source until the target is written, and
        holds the Storage's ``restoring`` event meanwhile, so an op needing it waits for
        the move and then restores it from wherever it went."""
        with self._lock:
            resting = [
                s
                for s in self._storages.values()
                if s.placement is not None and s.placement.tier is tier and s.restoring is None
            ]
            resting.sort(key=lambda s: s.last_use)
            picked, total = [], 0
            for storage in resting:
                if total >= want:
                    break
                below = self._tier_below(storage, tier)
                if below is None:
                    continue
                storage.refs += 1
                storage.restoring = threading.Event()
                picked.append((storage, below))
                total += storage.nbytes
        moved = 0
        for storage, below in picked:
            moved += self._demote_one(storage, below)
        return moved

    def _tier_below(self, storage: Storage, tier: Tier) -> Tier | None:
        chain = self.tiers.get(storage.device.name)
        if chain is None or tier not in chain.tiers:
            return None
        index = chain.tiers.index(tier)
        return chain.tiers[index + 1] if index + 1 < len(chain.tiers) else None

    def _demote_one(self, storage: Storage, below: Tier) -> int:
        source = storage.placement
        assert source is not None, storage
        placement = None
        try:
            placement = below.store(np.frombuffer(source.buffer, dtype=np.uint8), storage.id)
        except OSError as exc:  # ENOSPC, EIO: counted by the tier; the Storage stays
            log.warning("demoting %r failed: %s; it stays on the host tier", storage, exc)
        finally:
            with self._lock:
                event, storage.restoring = storage.restoring, None
                if placement is not None:
                    storage.placement = placement
                last = self._decref_locked(storage)  # at zero: the placement now set goes
            if event is not None:
                event.set()
        assert last is None, storage  # a spilled Storage has no block to give back
        if placement is None:
            return 0
        source.tier.release(source)
        return storage.nbytes

    def ensure_resident(self, storages: Sequence[Storage]) -> None:
        """Bring every spilled one of ``storages`` (the caller holds each) back to its
        device, verified; concurrent callers on one Storage wait for one restore."""
        for storage in storages:
            if storage._block is None:
                self._restore(storage)

    def _restore(self, storage: Storage) -> None:
        device = storage.device
        while True:
            with self._lock:
                if storage._block is not None:
                    return
                event = storage.restoring
                owner = event is None
                if event is None:
                    event = storage.restoring = threading.Event()
                placement = storage.placement
            if not owner:
                event.wait()
                continue
            try:
                assert placement is not None, storage
                block = self.malloc(device, storage.nbytes, storage.tenant)
                try:
                    _load(placement, storage, block)
                except BaseException:
                    device.pool.free(block)
                    raise
                with self._lock:
                    storage._block = block
                    storage.placement = None
                    self._by_block[block] = storage
                    storage.last_use = self._tick()
                placement.tier.release(placement)
                placement.tier.count_restore(storage.nbytes)
                return
            finally:
                with self._lock:
                    storage.restoring = None
                event.set()

    def set_pinned(self, storage: Storage, pinned: bool) -> None:
        """Keep ``storage`` on its device (the caller holds it: it is resident) or let it
        spill again."""
        with self._lock:
            storage.pinned = pinned

    def tier_figures(self, device: Device) -> dict[str, int]:
        """memory_stats()'s ``tier.*`` keys of ``device`` (none without tiers)."""
        chain = self.tiers.get(device.name)
        if chain is None:
            return {}
        figures = chain.figures()
        with self._lock:
            live = [s for s in self._storages.values() if s.device is device]
            figures["tier.device.storages.current"] = sum(1 for s in live if s.resident)
            figures["tier.device.pinned.current"] = sum(1 for s in live if s.pinned)
        return figures

    @property
    def lock_waiters(self) -> int:
        """Threads blocked on the registry's lock now (the background compactor steps aside)."""
        return self._lock.waiting

    def stream_of(self, tenant: str) -> int:
        """The tenant's stable pool stream key (0 for "", then 1, 2... in order of first use)."""
        with self._lock:
            return self._streams.setdefault(tenant, len(self._streams))

    def incref(self, storage: Storage) -> None:
        with self._lock:
            if storage.freed:
                raise InternalError(f"reference to a freed {storage!r}")
            storage.refs += 1

    def hold(self, storage: Storage) -> None:
        """A reference that also keeps the Storage where it is: its bytes are in use."""
        with self._lock:
            if storage.freed:
                raise InternalError(f"hold of a freed {storage!r}")
            storage.refs += 1
            storage.holds += 1
            storage.uses += 1
            storage.last_use = self._tick()

    def hold_all(self, storages: Sequence[Storage]) -> None:
        """:meth:`hold` of each, under one acquisition of the lock (a call over thousands of
        inputs would otherwise take the server-wide lock thousands of times); all or none."""
        with self._lock:
            for storage in storages:
                if storage.freed:
                    raise InternalError(f"hold of a freed {storage!r}")
            for storage in storages:
                storage.refs += 1
                storage.holds += 1
                storage.uses += 1
                storage.last_use = self._tick()

    def release_holds(self, storages: Sequence[Storage]) -> None:
        """:meth:`release_hold` of each, under one acquisition of the lock."""
        freed = []
        with self._lock:
            for storage in storages:
                storage.holds -= 1
                assert storage.holds >= 0, storage
                block = self._decref_locked(storage)
                if block is not None:
                    freed.append((storage, block))
        for storage, block in freed:
            storage.device.pool.free(block)

    def release_hold(self, storage: Storage) -> None:
        with self._lock:  # one acquisition for both counts: every op's input goes through here
            storage.holds -= 1
            assert storage.holds >= 0, storage
            block = self._decref_locked(storage)
        if block is not None:
            storage.device.pool.free(block)

    def decref(self, storage: Storage) -> None:
        with self._lock:
            block = self._decref_locked(storage)
        if block is not None:
            storage.device.pool.free(block)

    def ref_counts(self) -> RefCounts:
        """For references a Batch's run of views and releases changes: counted,
        then ``counts.settle()`` under one acquisition of the lock, then ``counts.give_back()``."""
        return RefCounts(self)

    def _decref_locked(self, storage: Storage) -> Any:
        """Drop one reference; the block to give back to the pool (outside this lock) if
        that was the last."""
        storage.refs -= 1
        assert storage.refs >= 0, storage
        if storage.refs > 0:
            return None
        storage.freed = True
        del self._storages[storage.id]
        self._addresses.give_back(storage.address, storage.nbytes)
        self.ledger.refund(storage.tenant, storage.device.name, storage.charge)
        block = storage._block
        if block is None:  # spilled: its placement goes (a tier's lock comes after this one)
            placement, storage.placement = storage.placement, None
            if placement is not None:
                placement.tier.release(placement)
            return None
        del self._by_block[block]
        return block

    def grow(self, storage: Storage, nbytes: int, tenant: str, own_holds: int = 1) -> None:
        """``storage`` now has ``nbytes`` (more than it had): torch's resize_bytes_cpu.  Every
        handle on it sees the larger Storage: its bytes are copied into a new block, the
        rest zero-filled (torch leaves them uninitialised; a freed block may hold another
        tenant's bytes), and it takes a new virtual address (torch's realloc moves its
        data_ptr too).  The caller holds it ``own_holds`` times (its op); any other hold (a same-host
        export, DLPack, another op using it right now) means its bytes may be read in
        place, and it is refused as torch refuses a storage it does not own.  Only its own
        tenant may grow it (the grown size is charged to the tenant it is charged to).

        The copy runs outside the registry's lock, so no other op waits for it: the
        caller's hold keeps compaction from moving the Storage, the growth is charged
        before the block is asked for (refunded on any failure), and the new block is
        swapped in under the lock only if no other hold was taken meanwhile (an op that
        wrote the old block during the copy, an export made then): otherwise the grow is
        refused and the Storage is left as it was."""
        if storage.tenant != tenant:
            raise PermissionDeniedError("a Storage shared by another tenant cannot be resized")
        with self._lock:
            self._check_resizable(storage, own_holds)
            uses, old_nbytes = storage.uses, storage.nbytes
        device = storage.device
        delta = charge_for(nbytes) - charge_for(old_nbytes)
        self.ledger.grow(storage.tenant, device.name, delta)  # before any work for it
        try:
            block = self.malloc(device, nbytes, storage.tenant)
            try:
                new = device.backend.view(block.segment.memory, block.offset, nbytes)
                _copy_grown(new, storage.raw())  # held by the caller: the block stays put
                with self._lock:
                    self._check_resizable(storage, own_holds, uses)
                    old = self._swap_grown(storage, block, nbytes)
            except BaseException:
                device.pool.free(block)
                raise
        except BaseException:
            self.ledger.grow(storage.tenant, device.name, -delta)
            raise
        device.pool.free(old)

    @staticmethod
    def _check_resizable(storage: Storage, own_holds: int, uses: int | None = None) -> None:
        """(lock held) Refuse to grow a Storage something else holds, or (``uses`` given:
        the count when the grow began) one another hold reached since, torch's text."""
        if storage.holds != own_holds or (uses is not None and storage.uses != uses):
            raise RuntimeError("Trying to resize storage that is not resizable")

    def _swap_grown(self, storage: Storage, block: Block, nbytes: int) -> Block:
        """(lock held) ``storage`` now lives in ``block`` of ``nbytes`` (its bytes copied
        there), at a new address; returns its old block, for the caller to free."""
        address = self._addresses.take(nbytes)  # first: the new data_ptr is not the old
        self._addresses.give_back(storage.address, storage.nbytes)
        old = storage.block
        del self._by_block[old]  # decref and compaction find it by its block
        storage.block, storage.nbytes, storage.address = block, nbytes, address
        self._by_block[block] = storage
        return old

    @contextmanager
    def relocation(self, pool: CachingPool) -> Iterator[Mapping[Block, Callable[[Block], None]]]:
        """For compaction (the pool calls it holding its own lock): stops the world and yields
        the blocks of unheld live Storages of ``pool``, each with the call repointing it
        (looked up as asked, while the world stays stopped)."""
        with self._lock:
            yield MovableBlocks(self, pool)

    def claim(self, block: Block) -> object:
        """(inside a relocation) The owner of ``block`` as a token for a move that copies
        outside the lock: its Storage and the holds ever taken on it (``uses``), so a
        later claim differs if the Storage was freed, held (an op that read or wrote its
        bytes, an export) or grown meanwhile, even if every such hold has ended."""
        storage = self._by_block.get(block)
        return None if storage is None else (storage, storage.uses)  # the object: by identity

    def _repoint(self, storage: Storage, block: Block) -> None:
        """``storage`` now lives in ``block`` (its bytes copied there; caller holds the lock).

        Its tenant's charge is the rounded request, not the block: nothing to re-charge.
        """
        assert storage.holds == 0 and block.size <= storage.block.size, (storage, block)
        del self._by_block[storage.block]
        storage.block = block
        self._by_block[block] = storage

    def live(self) -> list[Storage]:
        with self._lock:
            return list(self._storages.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._storages)


class RefCounts:
    """References taken and dropped by one session's run of views and releases,
    counted here and settled under one short acquisition of the registry's lock at its end
    (:meth:`settle`), so no run holds that lock while it works; the pools' frees wait for
    :meth:`give_back`.

    Deferring is safe because every Storage a run touches is reached through a handle the
    session held when the run began, whose reference is counted already and which only
    this run could drop (its caller holds the session's lock until after ``settle``): no
    other session's decref can take such a Storage to zero meanwhile."""

    __slots__ = ("_deltas", "_freed", "_registry")

    def __init__(self, registry: StorageRegistry) -> None:
        self._registry = registry
        self._deltas: dict[Storage, int] = {}
        self._freed: list[tuple[Storage, Block]] = []

    def incref(self, storage: Storage) -> None:
        """One more reference, as :meth:`StorageRegistry.incref`, counted at :meth:`settle`."""
        if storage.freed:
            raise InternalError(f"reference to a freed {storage!r}")
        self._deltas[storage] = self._deltas.get(storage, 0) + 1

    def decref(self, storage: Storage) -> None:
        """One reference fewer, counted at :meth:`settle`."""
        self._deltas[storage] = self._deltas.get(storage, 0) - 1

    def settle(self) -> None:
        """Apply the counted references under the registry's lock (once per run); a block
        whose last reference went waits for :meth:`give_back`."""
        deltas, self._deltas = self._deltas, {}
        registry = self._registry
        with registry._lock:
            for storage, delta in deltas.items():
                if delta >= 0:
                    storage.refs += delta
                    continue
                # all but the last one dropped here, the last by _decref_locked (frees at zero)
                storage.refs += delta + 1
                block = registry._decref_locked(storage)
                if block is not None:
                    self._freed.append((storage, block))

    def give_back(self) -> None:
        """Free the blocks whose last reference went: called with no lock held (a pool's
        lock comes before the registry's, and the registry's is never held calling a pool)."""
        freed, self._freed = self._freed, []
        for storage, block in freed:
            storage.device.pool.free(block)


def _host_bytes(storage: Storage, block: Block) -> Any:
    """A spill's source: the block's bytes as a 1-D uint8 host array (zero-copy on the cpu
    device; a GPU's are read to the host first)."""
    backend = storage.device.backend
    if storage.device.xp is np:
        return backend.view(block.segment.memory, block.offset, storage.nbytes)
    data = backend.read(block.segment.memory, block.offset, storage.nbytes)
    return np.frombuffer(data, dtype=np.uint8)


def _load(placement: Placement, storage: Storage, block: Block) -> None:
    """A restore: the placement's bytes into ``block``, verified."""
    backend = storage.device.backend
    if storage.device.xp is np:
        out = backend.view(block.segment.memory, block.offset, storage.nbytes)
        placement.tier.load(placement, out, storage.id)
        return
    staging = np.empty(storage.nbytes, dtype=np.uint8)
    placement.tier.load(placement, staging, storage.id)
    backend.write(block.segment.memory, block.offset, staging.data)


def _copy_grown(new: Any, old: Any) -> None:
    """A grown Storage's bytes: the old ones first, zeros after (uint8 arrays of one device)."""
    new[: old.shape[0]] = old
    new[old.shape[0] :] = 0


@dataclass(frozen=True, slots=True)
class TensorRef:
    """What a handle names: a Storage seen through a layout and a dtype."""

    storage: Storage
    layout: Layout
    dtype: DType
    requires_grad: bool = False
    # torch's lazy bits: the values are the stored ones conjugated / negated
    conj: bool = False
    neg: bool = False

    @property
    def device(self) -> Device:
        return self.storage.device

    @property
    def storage_elements(self) -> int:
        return self.storage.nbytes // self.dtype.itemsize

    def with_layout(self, layout: Layout, dtype: DType | None = None) -> TensorRef:
        return TensorRef(
            self.storage, layout, dtype or self.dtype, self.requires_grad, self.conj, self.neg
        )


# Byte strides and offsets must fit int64: the wire's TensorMeta and the kernels' strided
# arrays hold them as int64 (repeated diagonal/unsqueeze can double a size-1 dim's stride).
_INT64_MAX = 2**63 - 1


def check_in_bounds(ref: TensorRef) -> None:
    """Refuse to issue a handle reaching outside its Storage (mirrors checkInBoundsForStorage).

    Every handle the server issues passes here, whatever op made it.  The check
    uses the exact lowest and highest element the view reaches (a negative
    stride reaches below the offset), so no op can hand out a window onto
    another Storage's bytes.  Reaching outside is a server bug (the layout
    engine should have refused), hence InternalError; a geometry too large to
    express in int64 bytes is the caller's (RuntimeError, torch's text).
    """
    layout, itemsize = ref.layout, ref.dtype.itemsize
    limits.check_result_ndim(layout.ndim)  # any op's result, whatever made it (unflatten, ...)
    largest = max(abs(layout.offset), max(map(abs, layout.stride), default=0))
    if largest * itemsize > _INT64_MAX:
        raise RuntimeError(
            f"Storage size calculation overflowed with sizes={list(layout.shape)} and "
            f"strides={list(layout.stride)}"
        )
    reached = layout.element_offset_range()
    if reached is None:
        return  # no elements: nothing is ever read or written through it
    low, high = reached
    needed = (high + 1) * itemsize
    if low < 0 or needed > ref.storage.nbytes:
        raise InternalError(
            f"setStorage: sizes {list(layout.shape)}, strides {list(layout.stride)}, storage "
            f"offset {layout.offset}, and itemsize {itemsize} reaching elements {low} to "
            f"{high} are out of bounds for storage of size {ref.storage.nbytes}"
        )


class MovableBlocks(Mapping[Block, Callable[[Block], None]]):
    """What :meth:`StorageRegistry.relocation` yields: the blocks of ``pool`` owned by
    unheld live Storages, each with the call repointing its Storage; a view looked up
    per block, valid while the registry's lock is held."""

    def __init__(self, registry: StorageRegistry, pool: CachingPool) -> None:
        self._registry = registry
        self._pool = pool

    def _owner(self, block: object) -> Storage | None:
        if not isinstance(block, Block):
            return None
        storage = self._registry._by_block.get(block)
        if (
            storage is None
            or storage.device.pool is not self._pool
            or storage.holds
            or storage.tiering
        ):
            return None
        return storage

    def __contains__(self, block: object) -> bool:
        return self._owner(block) is not None

    def __getitem__(self, block: Block) -> Callable[[Block], None]:
        storage = self._owner(block)
        if storage is None:
            raise KeyError(block)
        return functools.partial(self._registry._repoint, storage)

    def __iter__(self) -> Iterator[Block]:
        return (block for block in list(self._registry._by_block) if block in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)
