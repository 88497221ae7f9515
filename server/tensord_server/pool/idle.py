"""Idle segments: the pool's wholly free segments, since when, and which of them it keeps.

Beyond PyTorch (policy ``release_idle_s``): where a background compactor runs, a segment
left wholly free is *kept* for a while, so that the next request like the last one reuses
warm pages instead of reserving, and faulting in, a new segment.  Compaction neither
empties nor fills a kept segment and its bytes do not count as excess; once it has been
idle ``release_idle_s`` it goes back like any idle segment.  The kept ones, the most
recently freed first, hold at most the policy's ``keep_idle_fraction`` of the allocated
bytes (the most recently freed one is kept whatever its size), except on a backend where
giving a segment back and reserving another costs more than keeping it
(:func:`~.backend.costly_segment_churn`): there every idle segment is kept that long.

A bounded *warm reserve* outlasts that decay (policy ``warm_reserve_s``): of the
segments idle less than ``warm_reserve_s``, the most recently freed first, those whose
committed bytes fit the owner's reserve together are kept until ``warm_reserve_s``
after their last free, so a client's put after a pause of a few seconds finds its
segment warm; the reserve never holds more than its bytes, and segments beyond it keep
the schedule above.

:class:`IdleSegments` records the idle segments and answers, on plain numbers, which are
kept.  :class:`IdleKeeping`, the pool's collaborator, owns that record and acts on it
through the narrow :class:`IdleSite` the pool gives it: whether the pool keeps any at all
(a background compactor runs, the device is not near its edge), which are kept now, and
giving idle segments back (those beyond the budget, or the largest ones after a free).
Neither takes a lock: the owning :class:`~.allocator.CachingPool` calls them with the
pool's lock held.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

from tensord_server.pool.blocks import Block, Segment
from tensord_server.pool.policy import PoolPolicy


@dataclass(slots=True)
class IdleSegment:
    """One wholly free segment's entry."""

    since: float  # the pool's clock() when its last block was freed
    committed: int  # its committed bytes (its size less its decommitted pages)


class IdleSegments:
    """The segments that are one free block since their last block was freed.

    Guarded by the owning pool's lock: every method is called with it held.

    Invariants (:meth:`assert_invariants`): each entry names a live segment whose head
    block spans it, free; its ``committed`` equals the commit ledger's figure for the
    segment; ``committed`` is their sum.  Entries keep the order in which their segments
    became idle (the order they are looked at and given back in).  A new segment no block
    was allocated from yet is not idle: it has no warm page to keep.
    """

    __slots__ = ("_entries", "committed", "costly_churn")

    def __init__(self, costly_churn: bool) -> None:
        # whether the backend's segment churn costs more than keeping (keep every one)
        self.costly_churn = costly_churn
        self._entries: dict[int, IdleSegment] = {}  # segment address -> its entry
        self.committed = 0  # the entries' committed bytes, summed

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, address: object) -> bool:
        return address in self._entries

    def __iter__(self) -> Iterator[int]:
        """The idle segments' addresses, in the order they became idle."""
        return iter(self._entries)

    # -- changes ----------------------------------------------------------------

    def became_idle(self, segment: Segment, now: float, committed: int) -> None:
        """``segment`` is one free block again (a free merged its last block)."""
        entry = self._entries.get(segment.address)
        if entry is None:
            self._entries[segment.address] = IdleSegment(now, committed)
            self.committed += committed
        else:
            entry.since = now

    def left(self, segment: Segment) -> None:
        """``segment`` is no longer idle: a block is allocated from it, or it goes back."""
        entry = self._entries.pop(segment.address, None)
        if entry is not None:
            self.committed -= entry.committed

    def decommitted(self, segment: Segment, nbytes: int) -> None:
        """``nbytes`` of ``segment``'s pages went back to the device."""
        entry = self._entries.get(segment.address)
        if entry is not None:
            entry.committed -= nbytes
            self.committed -= nbytes

    # -- which are kept -------------------------------------------------------------

    def keep_fraction(self, policy: PoolPolicy) -> float | None:
        """The policy's keep_idle_fraction, or None (keep every one) on a backend whose
        segment churn is costly."""
        return None if self.costly_churn else policy.keep_idle_fraction

    def kept(
        self,
        policy: PoolPolicy,
        now: float,
        allocated: int,
        budgeted: bool = True,
        reserve: int = 0,
    ) -> dict[int, float]:
        """The segments kept at ``now`` (the pool keeps some): address -> the clock() time
        from which each may go back.  Not ``budgeted``: those keep_idle_fraction would not
        keep included.  With a ``reserve`` of bytes: the warm reserve's segments
        (:meth:`warm`) too, each until the later of its two times."""
        decay = policy.release_idle_s
        if decay is None or not self._entries:
            return {}
        kept = {
            address: entry.since + decay
            for address, entry in self._entries.items()
            if now < entry.since + decay
        }
        if budgeted:
            kept = self.within_budget(policy, kept, allocated)
        for address, until in self.warm(policy, now, reserve).items():
            kept[address] = max(until, kept.get(address, until))
        return kept

    def warm(self, policy: PoolPolicy, now: float, reserve: int) -> dict[int, float]:
        """The warm reserve at ``now`` (policy ``warm_reserve_s``): of the segments idle
        less than warm_reserve_s, the most recently freed first, each whose committed bytes
        still fit in ``reserve`` bytes with those before it (one that does not is
        skipped): address -> the clock() time from which it may go back.  Their committed
        bytes together never exceed ``reserve``."""
        decay = policy.warm_reserve_s
        if decay is None or reserve <= 0 or policy.release_idle_s is None:
            return {}
        warm: dict[int, float] = {}
        total = 0
        recent_first = sorted(self._entries.items(), key=lambda item: -item[1].since)
        for address, entry in recent_first:
            until = entry.since + decay
            if now >= until:
                break  # the rest were freed earlier: decayed too
            if total + entry.committed <= reserve:
                total += entry.committed
                warm[address] = until
        return warm

    def within_budget(
        self, policy: PoolPolicy, kept: dict[int, float], allocated: int
    ) -> dict[int, float]:
        """Of the ``kept`` segments (unbudgeted), those keep_idle_fraction x ``allocated``
        bytes keep: the most recently freed first, the first one whatever its size."""
        fraction = self.keep_fraction(policy)
        if fraction is None or len(kept) <= 1:
            return kept
        budget = fraction * allocated
        within: dict[int, float] = {}
        total = 0
        for address in sorted(kept, key=kept.__getitem__, reverse=True):
            total += self._entries[address].committed
            if within and total > budget:
                break
            within[address] = kept[address]
        return within

    def beyond_budget(
        self, policy: PoolPolicy, kept: dict[int, float], allocated: int
    ) -> list[int]:
        """Of the ``kept`` segments (unbudgeted), the addresses of those keep_idle_fraction
        does not keep, in the order they became idle."""
        within = self.within_budget(policy, kept, allocated)
        return [address for address in kept if address not in within]

    def cached_heads(self, segments: Mapping[int, Segment]) -> list[Block]:
        """The idle segments' blocks, the largest first, less one out of its pool (being
        allocated); ``segments``: the pool's, by address."""
        heads = [segments[address].head for address in self._entries]
        cached = [
            block
            for block in heads
            if block is not None
            and block.pool is not None
            and block.pool.free_blocks.get(block.address) is block
        ]
        return sorted(cached, key=lambda block: (-block.size, block.address))

    def all_within_budget(self, policy: PoolPolicy, allocated: int) -> bool:
        """Whether every idle segment together fits keep_idle_fraction x ``allocated``
        (there is a fraction)."""
        fraction = self.keep_fraction(policy)
        return fraction is not None and self.committed <= fraction * allocated

    # -- invariants -----------------------------------------------------------------

    def assert_invariants(
        self, segments: Mapping[int, Segment], committed_in: Callable[[Segment], int]
    ) -> None:
        """The invariants above, for the pool's ``segments`` and the commit ledger's
        ``committed_in``."""
        for address, entry in self._entries.items():
            segment = segments.get(address)
            head = None if segment is None else segment.head
            assert head is not None and not head.allocated and not head.is_split(), (
                f"the segment at {address:#x} is counted idle but is not one free block"
            )
            assert segment is not None and entry.committed == committed_in(segment), (
                f"the idle segment at {address:#x} counts {entry.committed} committed bytes"
            )
        total = sum(entry.committed for entry in self._entries.values())
        assert self.committed == total, "the idle segments' committed bytes"


class IdleSite(Protocol):
    """What :class:`IdleKeeping` needs of a pool: its policy and clock, its allocated bytes,
    its whole free segments and giving them back.  The caller holds the pool's lock."""

    policy: PoolPolicy
    clock: Callable[[], float]
    warm_reserve: int

    @property
    def allocated_bytes(self) -> int: ...
    def compacts_in_background(self) -> bool: ...
    def near_the_edge(self) -> bool: ...
    def segment_at(self, address: int) -> Segment: ...
    def has_whole_free_block(self) -> bool: ...
    def whole_free_blocks(self) -> list[Block]: ...
    def releasable_segment(self, segment: Segment) -> bool: ...
    def release_free_segment(self, address: int) -> None: ...
    def committed_in(self, segment: Segment) -> int: ...


class IdleKeeping:
    """The pool's idle segments (an :class:`IdleSegments` it owns), which of them it keeps
    now, and giving them back (policy ``release_idle_s``, ``keep_idle_fraction``,
    ``warm_reserve_s``, and after a free ``release_threshold``).

    Guarded by the owning pool's lock: every method is called with it held.  Its
    invariants are its record's (:meth:`IdleSegments.assert_invariants`) and the warm
    reserve's bound (:meth:`assert_invariants`).
    """

    __slots__ = ("record", "site")

    def __init__(self, site: IdleSite, costly_churn: bool) -> None:
        self.site = site
        self.record = IdleSegments(costly_churn)

    # -- what the pool's steps tell it (the record's changes) ------------------------

    def became_idle(self, segment: Segment) -> None:
        """``segment`` is one free block again (a free merged its last block)."""
        site = self.site
        self.record.became_idle(segment, site.clock(), site.committed_in(segment))

    def left(self, segment: Segment) -> None:
        """``segment`` is no longer idle: a block is allocated from it, or it goes back."""
        self.record.left(segment)

    def decommitted(self, segment: Segment, nbytes: int) -> None:
        """``nbytes`` of ``segment``'s pages went back to the device."""
        self.record.decommitted(segment, nbytes)

    @property
    def committed(self) -> int:
        """The idle segments' committed bytes, summed."""
        return self.record.committed

    @property
    def costly_churn(self) -> bool:
        return self.record.costly_churn

    def cached_heads(self) -> list[Block]:
        """The idle segments' blocks, the largest first, less one out of its pool."""
        segment_at = self.site.segment_at
        return self.record.cached_heads({address: segment_at(address) for address in self.record})

    # -- which are kept ----------------------------------------------------------------

    def keeps(self) -> bool:
        """Whether the policy's release_idle_s applies: only where a background compactor
        gives kept segments back later (the pool has a doorbell, and may compact)."""
        return self.site.policy.release_idle_s is not None and self.site.compacts_in_background()

    def kept(self) -> dict[int, float]:
        """The wholly free segments kept now (policy ``release_idle_s``, and the warm
        reserve's, ``warm_reserve_s``): address -> the clock() time from which they may go
        back.  Background compaction neither empties nor fills them, nor counts them as
        excess; the out-of-memory paths ignore this."""
        site = self.site
        if not self.record or not self.keeps() or site.near_the_edge():
            return {}
        return self.record.kept(
            site.policy, site.clock(), site.allocated_bytes, reserve=site.warm_reserve
        )

    def warm(self) -> dict[int, float]:
        """The warm reserve now (:meth:`IdleSegments.warm`)."""
        site = self.site
        return self.record.warm(site.policy, site.clock(), site.warm_reserve)

    def decayed_beyond(self, kept: Mapping[int, float]) -> bool:
        """Whether some idle segment not ``kept`` may go back now."""
        site = self.site
        return any(
            address not in kept and site.releasable_segment(site.segment_at(address))
            for address in self.record
        )

    def keeps_within_a_fraction(self) -> bool:
        """Whether the kept ones are bounded by keep_idle_fraction (not a costly churn)."""
        return self.record.keep_fraction(self.site.policy) is not None

    # -- giving them back --------------------------------------------------------------

    def release_unkept(self) -> bool:
        """Give back the wholly free segments beyond the kept ones' budget (policy
        keep_idle_fraction), the warm reserve's excepted: no copy, so cheap on a freeing
        call, and the room is back before the compactor, woken, would come.  Whether any
        went back."""
        record, site = self.record, self.site
        if len(record) <= 1:
            return False  # the most recently freed one is kept whatever its size
        policy, allocated = site.policy, site.allocated_bytes
        if record.all_within_budget(policy, allocated):
            return False  # every idle segment together fits the budget (most frees)
        now = site.clock()
        unbudgeted = record.kept(policy, now, allocated, budgeted=False)
        if len(unbudgeted) <= 1:
            return False  # within any budget
        warm = record.warm(policy, now, site.warm_reserve)
        released = False
        for address in record.beyond_budget(policy, unbudgeted, allocated):
            if address in warm:
                continue  # the warm reserve keeps it
            if site.releasable_segment(site.segment_at(address)):
                site.release_free_segment(address)
                released = True
        return released

    def release_largest(self, target: int) -> bool:
        """Give back whole free segments, the largest first, until ``target`` bytes went
        back; whether any went back."""
        site = self.site
        if not site.has_whole_free_block():
            return False  # most calls: looking costs a walk of every free block
        idle = [
            block for block in site.whole_free_blocks() if site.releasable_segment(block.segment)
        ]
        released = 0
        for block in sorted(idle, key=lambda b: (-b.size, b.address)):
            if released >= target:
                break
            released += site.committed_in(block.segment)
            site.release_free_segment(block.segment.address)
        return bool(idle)

    # -- invariants --------------------------------------------------------------------

    def assert_invariants(
        self, segments: Mapping[int, Segment], committed_in: Callable[[Segment], int]
    ) -> None:
        """The record's invariants, and the warm reserve holds no more than its bytes."""
        self.record.assert_invariants(segments, committed_in)
        reserve = self.site.warm_reserve
        held = sum(committed_in(segments[address]) for address in self.warm())
        assert held <= reserve, (
            f"the warm reserve holds {held} committed bytes, beyond its {reserve}"
        )
