"""Pool policies: PyTorch's rules exactly, or rules that go beyond them for a shared device.

A :class:`PoolPolicy` is a handful of switches the :class:`~.allocator.CachingPool`
reads; it never changes how a block is found or split (that stays PyTorch's), only
what the pool does *besides*:

- ``compact_on_oom``: where torch would raise OutOfMemoryError, move unheld blocks
  out of the least-used segments and release them (needs a relocator);
- ``tight_segments``: on the out-of-memory path, before compacting, reserve only the
  request rounded to 2 MiB instead of torch's 20 MiB shared segment for a 1-10 MiB
  request (what expandable segments achieve by mapping only what is used);
- ``merge_segments``: on the out-of-memory path, when no segment can be emptied or
  repacked alone, move the blocks of several segments of one pool, back to back, into
  one new segment and release them: each segment's tail (its 2 MiB rounding) or a small
  segment's hole is too small for the request and too small to give back alone, several
  make whole 2 MiB units; the last block may leave a rest under 1 MiB of the new
  segment free rather than grow into it (needs a relocator, and room on the device for
  the new segment);
- ``consolidate``: before reserving a new segment that would leave the device less
  headroom (capacity - reserved) than the pool's free-but-reserved bytes, compact and
  repack (into holes of other segments and tight new segments) so those bytes go back
  to the device while there is still room to gather them: near the device's edge,
  free bytes left in the tails and holes of partly used segments are what later
  makes a large request fail (at most ``max_moved_bytes`` moved each time, and only
  with at least ``min_slack`` free-but-reserved bytes);
- ``consolidate_merges``: with ``consolidate``, when the room the device would have left
  after the reservation could not take another segment of its size, also merge
  large-pool segments whose tails together are whole 2 MiB units (as
  ``merge_segments`` does, within ``max_moved_bytes``), while the room for a merged
  segment is still there: on the out-of-memory path that room is gone, a merged segment
  must fit beside the ones it replaces, and tails of 1-2 MiB are what a request that
  needs a new segment then fails on.  The small pool's segments are left alone here (a
  merged one is larger than 2 MiB and goes back only once all its small blocks are
  freed; the out-of-memory path still merges them);
- ``release_threshold``: after a free, while reserved / allocated exceeds it, give
  back whole idle cached segments (torch's garbage_collection_threshold idea, for a
  pool other programs share; torch only gives memory back on OOM or empty_cache);
- ``compact_threshold``: after a free, when reserved / allocated still exceeds it,
  compact until it no longer does (not only on OOM).  With a background compactor
  (``tensord serve``: ``tensord_server.domain.compactor``) the free only wakes it, and
  it moves one Storage per lock acquisition, at most ``max_moved_bytes`` per wake-up and
  ``background_bytes_per_s`` on average, until reserved / allocated is down to
  ``background_threshold`` (or within ``background_min_slack``): moving costs requests
  at most one move there, so it may aim lower than the freeing call does; without
  one (a replay) the freeing call compacts, at most ``max_moved_bytes`` once per
  ``compact_every`` frees.  Hysteresis: with a background compactor a free acts only
  once reserved / allocated exceeds ``background_wake_threshold``, and gives idle
  segments back only down to it (a bounded idle cache, so the next requests reuse
  segments instead of reserving new ones); the compactor then brings it down to
  ``background_threshold``;
- ``release_idle_s``: with a background compactor, time hysteresis on top (jemalloc's
  dirty-page decay, tcmalloc's release rate): a segment left wholly free is *kept* for
  this long after its last block was freed: compaction neither empties nor fills it and
  its bytes do not count as excess, so a client that drops a Storage and allocates one
  like it again (upload, drop, upload) reuses the segment instead of faulting in a new
  one (on a host a new segment is a new memfd whose every page faults in, far dearer
  than writing warm pages).  Once it has been idle that long, the compactor (woken at that time)
  gives it back like any other idle segment, so a pool left idle gives its memory back
  within ``release_idle_s``; the out-of-memory and ``consolidate`` paths give kept
  segments back at once, when the device needs the room.  None: idle segments go back
  as soon as a threshold says so.  Without a background compactor (a replay: no thread,
  no clock) a release is immediate, so a replay stays deterministic;
- ``warm_reserve_s``: with ``release_idle_s``, a longer decay for a bounded *warm
  reserve*: of the wholly free segments idle less than this, the most recently freed
  first, those whose committed bytes fit the pool's ``warm_reserve`` bytes together (one
  that does not fit is skipped) are kept this long after their last block was freed,
  whatever keep_idle_fraction says, so a client that puts an array again after a pause of
  a few seconds writes warm pages instead of faulting in a new segment's.  Beyond the
  reserve, segments go back as ``release_idle_s`` and ``keep_idle_fraction`` say; the
  reserve goes back once it has been idle this long, near the device's edge
  (``keep_idle_below``) and on the out-of-memory and ``consolidate`` paths, as any kept
  segment.  The pool's ``warm_reserve`` is 0 unless its owner sets it (``tensord serve
  --warm-reserve``, by default :func:`default_warm_reserve` of each device), so a replay
  sees no reserve.  None: no reserve;
- ``keep_idle_below``: segments are kept (``release_idle_s``) only while reserved is
  at most this fraction of the device's capacity: near the device's edge a kept
  segment is room other requests need, so there a free that leaves reserved above the compactor's wake-up threshold gives idle
  segments back itself, as without ``release_idle_s``;
- ``keep_idle_fraction``: kept segments (``release_idle_s``), the most recently freed
  first, hold at most this fraction of the allocated bytes; the most recently freed one
  is kept whatever its size (a client's upload, drop, upload needs that one).  A free
  that leaves reserved above the compactor's wake-up threshold gives the others back at
  once (no copy).  None: every segment is kept for ``release_idle_s``;
- ``decommit``: free page ranges inside split segments go back to the device while
  the segment stays (on backends that can: host memory, by ``madvise``; never on
  bookkeeping, pinned or CUDA memory): their pages are freed and fault back in as zeros
  when a block is allocated over them, so no bytes are copied.  ``reserved_bytes``
  then counts committed bytes (segment bytes less decommitted ones), as PyTorch's
  expandable segments count mapped pages, and the device's capacity bounds committed
  bytes: a segment may be reserved, and a block allocated over decommitted pages, while
  committed bytes after it stay within capacity (else free pages elsewhere are given
  back first, and only then compaction or out of memory); segment bytes, the address
  space and (on a shared host) memfds, are bounded by ``virtual_capacity_factor`` x
  capacity, beyond which the other paths apply (consolidation, compaction, OOM).  Only
  free ranges with at least ``decommit_min_bytes`` of whole pages are decommitted, and, with ``decommit_threshold``, only while committed / allocated
  exceeds it, the largest free ranges first (None: every such range once freed); with
  ``decommit_wake_threshold`` too (hysteresis), a free starts giving pages back only
  once committed / allocated exceeds that, and then down to ``decommit_threshold``: the
  holes in between stay warm for the next requests (a given-back page faults in again,
  zeroed, when a block is allocated over it: far dearer than writing a warm one), and
  so do holes of at most ``decommit_min_slack`` committed-but-unallocated bytes in all
  (a ratio alone would give back the one hole of a pool that holds little).
  The pages of a new segment count as decommitted until a block is allocated over
  them (a fresh memfd has none until touched).  Wholly free segments keep their pages
  (the kept idle ones are warm for the next upload); segments go back whole;
- ``min_slack``: below this many reserved-but-unallocated bytes none of the last three
  acts (a pool that close to its allocation is tight already).
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class PoolPolicy:
    """The switches above; every threshold is a ratio of committed (reserved) bytes to
    allocated bytes."""

    name: str
    compact_on_oom: bool = False  # compact where torch would be out of memory
    tight_segments: bool = False  # on the OOM path, segments of the request rounded to 2 MiB
    consolidate: bool = False  # compact and repack before reserving near the device's edge
    merge_segments: bool = False  # on the OOM path, several segments' blocks into one new one
    consolidate_merges: bool = False  # consolidation merges large-pool tails near the edge
    release_threshold: float | None = None  # above it a free gives idle segments back
    compact_threshold: float | None = None  # above it a free compacts (or wakes the compactor)
    min_slack: int = 16 * MiB  # up to this much unallocated: no release, compaction, consolidation
    max_moved_bytes: int = 256 * MiB  # bytes one compaction (or one wake-up) may copy
    compact_every: int = 16  # without a compactor, a free compacts at most once per this many
    background_bytes_per_s: int = 1024 * MiB  # the background compactor's average pace
    background_threshold: float | None = None  # None: compact_threshold
    background_min_slack: int | None = None  # None: min_slack
    background_wake_threshold: float | None = None  # None: background_threshold
    release_idle_s: float | None = None  # None: idle segments go back without delay
    warm_reserve_s: float | None = None  # the warm reserve's decay; None: no reserve
    keep_idle_below: float = 0.75  # of capacity: above it no idle segment is kept
    keep_idle_fraction: float | None = None  # of allocated: the kept segments' bytes at most
    decommit: bool = False  # give free page ranges of split segments back (host backends)
    decommit_min_bytes: int = 2 * MiB  # the smallest free range worth a decommit
    decommit_threshold: float | None = None  # None: every such range at once
    decommit_wake_threshold: float | None = None  # None: decommit_threshold
    # up to this many committed-but-unallocated bytes in split segments, a free gives no
    # page back (with decommit_threshold)
    decommit_min_slack: int = 0
    # with decommit: segment bytes may reach this x capacity (committed ones stay <= capacity)
    virtual_capacity_factor: float = 2.0

    @property
    def acts_after_free(self) -> bool:
        """Whether a free has work beyond torch's (a release or a compaction threshold)."""
        return self.release_threshold is not None or self.compact_threshold is not None


#: PyTorch's DeviceCachingAllocator rule for rule: nothing beyond it
PYTORCH = PoolPolicy("pytorch")
#: PyTorch's rules, plus compaction where torch would raise OutOfMemoryError
OOM_COMPACTION = PoolPolicy("oom-compaction", compact_on_oom=True)
#: beyond PyTorch: tight segments, compaction and repacking under pressure (and before the
#: device runs out), idle segments given back,
#: compaction when reserved / allocated crosses a threshold
ADAPTIVE = PoolPolicy(
    "adaptive",
    compact_on_oom=True,
    tight_segments=True,
    merge_segments=True,
    consolidate_merges=True,
    consolidate=True,
    release_threshold=1.10,
    compact_threshold=1.15,
    background_threshold=1.04,
    background_min_slack=8 * MiB,
    background_wake_threshold=1.10,
    release_idle_s=2.0,
    # a minute: a client that puts arrays of a few sizes in turn, with pauses of a few
    # seconds between them, comes back to each size after tens of seconds (bench_peers'
    # rows: four sizes, two 4 s pauses each and the other peers' turns, 30-35 s), and
    # finds its segment warm; an idle server still gives the reserve back within a minute
    warm_reserve_s=60.0,
    # kept segments, unbounded, would hold reserved / allocated above its target by
    # themselves; with the warm holes (decommit_wake_threshold) they stay within it
    keep_idle_fraction=0.15,
    decommit=True,
    decommit_threshold=1.02,  # under background_threshold: holes go back before any copy
    # hysteresis, at most background_threshold: below it a free leaves its hole warm (giving
    # back every byte freed makes the next blocks allocated there fault their pages in again)
    decommit_wake_threshold=1.04,
    # and none while the holes hold at most what the background compactor leaves alone: a
    # client that frees and allocates the same few MiB in turn (uploads of one size) reuses
    # a warm hole, instead of giving its pages back on each free and faulting them in again
    decommit_min_slack=8 * MiB,
    # small holes too (the small pool's and the 20 MiB segments' tails): left committed,
    # they are what the background compactor would copy Storages to close
    decommit_min_bytes=128 << 10,
)

# tensord serve's default warm reserve per device: this share of the device's capacity
# (a 2 GiB pool keeps a 256 MiB put's segment and a 64 MiB one's beside it warm: with an
# eighth, the 256 MiB one alone filled the reserve, and any segment freed after it pushed
# it out),
WARM_RESERVE_SHARE = 1 / 4
# ... at most this many bytes (a 256 MiB put's segment and a few more stay warm)
WARM_RESERVE_MAX = 1 << 30


def default_warm_reserve(capacity: int) -> int:
    """The warm reserve ``tensord serve`` gives a device's pool of ``capacity`` bytes
    (policy ``warm_reserve_s``): min(WARM_RESERVE_SHARE of it, WARM_RESERVE_MAX)."""
    return min(int(capacity * WARM_RESERVE_SHARE), WARM_RESERVE_MAX)


POLICIES: dict[str, PoolPolicy] = {p.name: p for p in (PYTORCH, OOM_COMPACTION, ADAPTIVE)}

#: what `tensord serve` runs unless told otherwise
DEFAULT_POLICY = ADAPTIVE.name


def policy_named(name: str) -> PoolPolicy:
    """The policy called ``name``; ValueError naming the ones there are."""
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"no pool policy {name!r}; policies: {', '.join(POLICIES)}") from None
