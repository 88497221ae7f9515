"""Compaction planning: which allocated blocks move where, as pure functions over numbers.

:func:`plan_compaction` sees segments as :class:`SegmentUsage` (addresses and sizes only)
and returns a :class:`CompactionPlan` of :class:`Move` s, so planning never holds a lock
or touches memory.  :func:`compact` then executes the plan through two narrow interfaces:
the pool's :class:`MoveTarget` (candidate segments, allocate in place, copy, free,
release) and the owner's :class:`Relocator` (which blocks may move, and the call that
repoints each owner).  The allocator keeps PyTorch's policy and only calls :func:`compact`.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from tensord_server.pool.blocks import (
    ROUND_LARGE,
    SMALL_SIZE,
    Block,
    Segment,
    oversize_rules_allow,
    round_size,
    should_split,
)

# ---------------------------------------------------------------------------
# Compaction policy (pure): which segments to empty, and where their blocks go


@dataclass(frozen=True, slots=True)
class SegmentUsage:
    """What compaction planning sees of one segment: plain numbers, no links.

    ``allocated`` holds ``(address, size, rounded request)`` of each allocated
    block, ``free`` ``(address, size)`` of each free one; ``movable`` is false
    when any allocated block may not move (held, or owned by no Storage).  A pool
    that plans often may leave the blocks' part of ``movable`` to a ``may_move``
    predicate the planners ask only about the segments they would empty.
    """

    address: int
    size: int
    is_small: bool
    stream: int
    allocated: tuple[tuple[int, int, int], ...]
    free: tuple[tuple[int, int], ...]
    movable: bool
    # what planning reads of every segment for every plan, computed once (a pool keeps
    # its segments' usages between plans): the allocated blocks' sizes, their rounded
    # requests and the largest one, the free blocks' sizes, and the free blocks as
    # planning's FreeSpots (size, address, this segment's address)
    allocated_bytes: int = field(init=False, repr=False, compare=False)
    requested_bytes: int = field(init=False, repr=False, compare=False)
    largest_request: int = field(init=False, repr=False, compare=False)
    free_bytes: int = field(init=False, repr=False, compare=False)
    free_spots: tuple[tuple[int, int, int], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        requests = [request for _, _, request in self.allocated]
        sums = (
            ("allocated_bytes", sum(size for _, size, _ in self.allocated)),
            ("requested_bytes", sum(requests)),
            ("largest_request", max(requests, default=0)),
            ("free_bytes", sum(size for _, size in self.free)),
            ("free_spots", tuple((size, address, self.address) for address, size in self.free)),
        )
        for name, value in sums:
            object.__setattr__(self, name, value)


# Whether a segment whose ``movable`` is true may be emptied now (its blocks may move).
MayMove = Callable[[SegmentUsage], bool]


@dataclass(frozen=True, slots=True)
class Move:
    """Allocate ``size`` at the front of the free block at ``destination``; move ``source`` there."""

    source: int  # address of the allocated block that moves
    destination: int  # address of the free block it goes into, at the time of the move
    size: int  # the rounded request allocated there (the moved block's new size, if split)
    # the block takes ``size`` bytes and the rest of the free block stays free even where
    # malloc would not split it (under 1 MiB in the large pool): a merge's last block,
    # which may not grow into the rest of its new segment
    exact: bool = False


@dataclass(frozen=True, slots=True)
class CompactionPlan:
    """Moves in the order to run them, the segments they leave wholly free, and their bytes."""

    moves: tuple[Move, ...]
    evacuated: tuple[int, ...]  # segment addresses
    released: int  # bytes those segments give back

    @property
    def empty(self) -> bool:
        return not self.evacuated


def background_evacuation_order(segments: Iterable[SegmentUsage]) -> list[SegmentUsage]:
    """Movable segments, the most bytes released per byte moved first (the least-used
    fraction), then fewest allocated bytes, then by address."""
    movable = (s for s in segments if s.movable)
    return sorted(movable, key=lambda s: (s.allocated_bytes / s.size, s.allocated_bytes, s.address))


def evacuation_order(segments: Iterable[SegmentUsage]) -> list[SegmentUsage]:
    """Movable segments, least-used first: fewest allocated bytes (the least to copy),
    then the largest (the most released for it), then by address."""
    movable = (s for s in segments if s.movable)
    return sorted(movable, key=lambda s: (s.allocated_bytes, -s.size, s.address))


# A free block a planned move may take: (size, address, its segment's address), sorted.
FreeSpot = tuple[int, int, int]


def spots_of_others(free: Sequence[FreeSpot], segment: SegmentUsage) -> list[FreeSpot]:
    """``free`` (sorted) without ``segment``'s own free blocks: a copy, less each of those
    found by bisection (cheaper than filtering every spot; the same list)."""
    others = list(free)
    for spot in segment.free_spots:
        index = bisect.bisect_left(others, spot)
        if index < len(others) and others[index] == spot:
            del others[index]
    return others


def place(
    free: Sequence[FreeSpot], request: int, limit: int, small: bool, max_split_size: int
) -> tuple[int, int] | None:
    """Where malloc's best fit would put ``request`` among ``free`` without the block
    ending up larger than ``limit`` (its size now: a moved Storage is never charged
    more): ``(index into free, resulting block size)``, or None."""
    index = bisect.bisect_left(free, (request, -1, -1))
    for i in range(index, len(free)):
        free_size = free[i][0]
        if not oversize_rules_allow(free_size, request, max_split_size):
            continue
        split = should_split(free_size, request, small, max_split_size)
        block_size = request if split else free_size
        if block_size <= limit:
            return i, block_size
    return None


def could_fit_elsewhere(segment: SegmentUsage, free: Sequence[FreeSpot], free_bytes: int) -> bool:
    """False when ``segment``'s blocks surely cannot all be placed into the free blocks of
    other segments (``free``, sorted, ``free_bytes`` in all, the segment's own included):
    each placed block takes at least its rounded request from one free block, and free
    blocks only shrink as blocks are placed, so the requests must fit in the bytes and the
    largest request in the largest free block.  True says only that planning may try."""
    if not free:
        return False
    return (
        segment.requested_bytes <= free_bytes - segment.free_bytes
        and segment.largest_request <= free[-1][0]
    )


def plan_compaction(
    segments: Sequence[SegmentUsage],
    needed: int,
    max_split_size: int,
    *,
    max_moved: int | None = None,
    may_move: MayMove | None = None,
    order: Callable[[Iterable[SegmentUsage]], list[SegmentUsage]] = evacuation_order,
) -> CompactionPlan:
    """The segments to empty, and where each of their blocks goes, to release ``needed`` bytes.

    Segments are tried least-used first (:func:`evacuation_order`); one is
    emptied whole or not at all, its blocks placed largest first into free
    blocks of *other* segments of the same pool and stream (:func:`place`),
    never into a segment being emptied, and a segment that receives a block is
    not emptied later.  Only existing free blocks are used: compaction never
    reserves.  A plan that cannot reach ``needed`` is empty (nothing moves for
    nothing) but says in ``released`` how far it got.

    With ``max_moved`` (compaction that no request is waiting for) a segment whose
    blocks would take the bytes moved beyond it is skipped, and a plan that releases
    less than ``needed`` is kept: every segment released helps.

    ``may_move`` is asked, last, about each segment the plan would empty (None: every
    segment whose ``movable`` is true may be emptied); a segment it refuses is skipped
    as if it were not movable, so the plan is the same as with that answer in ``movable``.
    """
    free: dict[tuple[bool, int], list[FreeSpot]] = {}
    free_bytes: dict[tuple[bool, int], int] = {}
    for segment in segments:
        key = (segment.is_small, segment.stream)
        free.setdefault(key, []).extend(segment.free_spots)
        free_bytes[key] = free_bytes.get(key, 0) + segment.free_bytes
    for spots in free.values():
        spots.sort()
    receiving: set[int] = set()
    moves: list[Move] = []
    evacuated: list[int] = []
    released = 0
    budget = max_moved
    for segment in order(segments):
        if released >= needed:
            break
        if segment.address in receiving:
            continue
        if budget is not None and segment.allocated_bytes > budget:
            continue
        key = (segment.is_small, segment.stream)
        if not could_fit_elsewhere(segment, free.get(key, []), free_bytes.get(key, 0)):
            continue  # the placement below would fail: a shortcut, not a different decision
        if may_move is not None and not may_move(segment):
            continue  # asked last: the answer costs a look at every block of the segment
        # a segment that never received a block still has its own free blocks as they were
        trial = spots_of_others(free[key], segment)
        placed: list[tuple[Move, int]] = []
        for address, size, request in sorted(segment.allocated, key=lambda b: (-b[1], b[0])):
            spot = place(trial, request, size, segment.is_small, max_split_size)
            if spot is None:
                break
            index, block_size = spot
            free_size, free_address, home = trial.pop(index)
            if block_size < free_size:  # the rest stays free, after the moved block
                bisect.insort(trial, (free_size - block_size, free_address + block_size, home))
            placed.append((Move(address, free_address, request), home))
        else:
            free[key] = trial
            free_bytes[key] = sum(spot[0] for spot in trial)
            moves.extend(move for move, _ in placed)
            receiving.update(home for _, home in placed)
            evacuated.append(segment.address)
            released += segment.size
            if budget is not None:
                budget -= segment.allocated_bytes
    if released < needed and max_moved is None:
        return CompactionPlan((), (), released)
    return CompactionPlan(tuple(moves), tuple(evacuated), released)


@dataclass(frozen=True, slots=True)
class SegmentShape:
    """A segment's blocks as planning sees them, with its allocated Blocks (in
    ``usage.allocated``'s order) to ask who may move them; ``usage.movable`` is true.
    Valid until a block of the segment changes (allocated, freed, split or merged): a
    pool that keeps shapes between plans drops the segment's then."""

    usage: SegmentUsage
    blocks: tuple[Block, ...]


def segment_shape(segment: Segment) -> SegmentShape:
    """``segment``'s blocks as numbers, in one walk."""
    allocated = []
    free = []
    blocks = []
    block = segment.head
    while block is not None:
        if block.allocated:
            allocated.append((block.address, block.size, round_size(block.requested_size)))
            blocks.append(block)
        else:
            free.append((block.address, block.size))
        block = block.next
    usage = SegmentUsage(
        address=segment.address,
        size=segment.size,
        is_small=segment.is_small,
        stream=segment.stream,
        allocated=tuple(allocated),
        free=tuple(free),
        movable=True,
    )
    return SegmentShape(usage, tuple(blocks))


def blocks_may_move(shape: SegmentShape, movable: Mapping[Block, object]) -> bool:
    """Whether every allocated block of ``shape`` is a key of ``movable``."""
    return all(block in movable for block in shape.blocks)


def segment_usage(
    segment: Segment, movable: Mapping[Block, object], *, releasable: bool = True
) -> SegmentUsage:
    """What planning sees of ``segment``: its blocks as numbers, movable if every
    allocated one is a key of ``movable`` and the segment may be released once empty."""
    shape = segment_shape(segment)
    if releasable and blocks_may_move(shape, movable):
        return shape.usage
    return replace(shape.usage, movable=False)


# ---------------------------------------------------------------------------
# Executing a plan, through two narrow interfaces


class Relocator(Protocol):
    """The owner of a pool's allocated blocks, letting compaction move some (the StorageRegistry)."""

    def relocation(
        self, pool: Any
    ) -> AbstractContextManager[Mapping[Block, Callable[[Block], None]]]:
        """Stops the world while open (nothing holds, reads, writes or frees the owned blocks)
        and yields the blocks that may move, each with the call that repoints its owner
        to its new block (after its bytes were copied there).  ``pool`` is the pool asking."""
        ...

    def claim(self, block: Block) -> object:
        """(inside a relocation, ``block`` one of its movable) Who owns ``block`` now, as a
        token: a later claim (inside a later relocation) compares equal only if the same
        owner still owns it and no hold on it began between (its bytes were neither read
        nor written there), so a copy made outside the relocations is still current."""
        ...


class MoveTarget(Protocol):
    """What compaction needs of a pool to execute a plan; every call is made with the
    pool's lock held (the pool calls :func:`compact` from inside its own methods)."""

    max_split_size: int
    max_moved: int | None  # the most bytes one plan may copy (None: any, all or nothing)

    def candidate_segments(self, movable: Mapping[Block, object]) -> list[SegmentUsage]:
        """Every segment as planning sees it: ``movable`` false where the segment may not be
        released once empty; whether its blocks may move (``movable`` owns every one) is
        :meth:`may_move`'s answer, asked only about the segments a plan would empty."""
        ...

    def may_move(self, segment: SegmentUsage) -> bool:
        """Whether every allocated block of ``segment`` (one of the last candidate_segments)
        may move now: a key of the ``movable`` candidate_segments was given."""
        ...

    def allocated_block(self, address: int) -> Block:
        """The allocated block starting at ``address``."""
        ...

    def allocate_in_place(
        self, source: Block, destination: int, size: int, exact: bool = False
    ) -> Block | None:
        """Allocate ``size`` at the front of the free block at ``destination``, as malloc would
        have (split or not; with ``exact`` split whenever the free block is larger), for
        ``source``'s request: the new block, allocated; None when the device has no room to
        commit its pages (a pool whose capacity bounds committed bytes): the move, and the
        rest of its plan, cannot run."""
        ...

    def move_bytes(self, source: Block, destination: Block) -> int:
        """Copy ``source``'s requested bytes into ``destination``; returns the bytes copied."""
        ...

    def allocated_block_now(self, address: int) -> Block | None:
        """The allocated block starting at ``address`` in the pool as it is now (the pool's
        lock was let go since the plan): None when there is none any more."""
        ...

    def allocate_if_placed(self, source: Block, destination: int, size: int) -> Block | None:
        """:meth:`allocate_in_place`, only if the planned move still holds in the pool as it
        is now: ``size`` holds ``source``'s requested bytes (the block now at the planned
        address may not be the planned one), a free block at ``destination`` in another
        segment of ``source``'s pool and stream, not kept idle, that malloc's rules would
        hand out for ``size`` as a block no larger than ``source``; None (nothing
        allocated) otherwise."""
        ...

    def copying(self, source: Block) -> AbstractContextManager[None]:
        """The pool's lock let go while the block is open (``source``'s segment kept from
        going back to the device meanwhile), and taken again once the copies made inside
        are complete on the device."""
        ...

    def free_block(self, block: Block) -> None:
        """Free an allocated block (merging with free neighbours, as free does)."""
        ...

    def release_segment(self, address: int) -> None:
        """Give the wholly free segment at ``address`` back to the device."""
        ...

    def reserve_segment(self, like: SegmentUsage, size: int) -> int | None:
        """Reserve a new segment of ``size`` bytes for ``like``'s pool and stream: its
        address, or None when the device has no room."""
        ...

    def free_segment_size(self, address: int) -> int | None:
        """The size of the segment at ``address`` when it is one whole free block that may
        go back to the device now; None otherwise (blocks allocated, or released already)."""
        ...


@dataclass(frozen=True, slots=True)
class CompactionResult:
    """What :func:`compact` did: the plan it ran (empty: nothing moved) and the bytes moved;
    ``wasted``: the bytes copied by background moves that gave up, which the background
    compactor's pace and budget charge like any other copy."""

    plan: CompactionPlan
    moved: int
    wasted: int = 0


def execute_move(
    target: MoveTarget, move: Move, movable: Mapping[Block, Callable[[Block], None]]
) -> int | None:
    """One planned move: allocate in place, copy, repoint the owner, free the old block.
    A failed copy frees the new block (owned by nothing yet) and the owner stays put.
    None: no room to commit the destination, nothing done."""
    old = target.allocated_block(move.source)
    new = target.allocate_in_place(old, move.destination, move.size, move.exact)
    if new is None:
        return None
    assert new.size <= old.size and new.segment is not old.segment, (old, new)
    try:
        moved = target.move_bytes(old, new)
    except BaseException:
        target.free_block(new)
        raise
    movable[old](new)
    target.free_block(old)
    return moved


def execute_move_outside_locks(
    target: MoveTarget, relocator: Relocator, pool: Any, move: Move
) -> tuple[int, bool]:
    """One planned move of a compaction nobody waits for, its copy made with neither the
    pool's lock nor the relocator's held, as a grow copies (so no request waits for the
    bytes): in a first relocation, allocate the destination and claim the owner (still
    unheld, the move still as planned); copy; in a second, repoint the owner and free the
    old block if the claim still holds, else free the new block (the copy is wasted, the
    owner never left its block).  The bytes copied and whether the owner moved (0 and False
    when nothing was copied)."""
    with relocator.relocation(pool) as movable:
        old = target.allocated_block_now(move.source)
        if old is None or old not in movable:
            return 0, False
        new = target.allocate_if_placed(old, move.destination, move.size)
        if new is None:
            return 0, False
        owner = relocator.claim(old)
    try:
        with target.copying(old):
            moved = target.move_bytes(old, new)
    except BaseException:
        target.free_block(new)
        raise
    with relocator.relocation(pool) as movable:
        current = old in movable and relocator.claim(old) == owner
        if current:
            movable[old](new)
    target.free_block(old if current else new)
    return moved, current


def execute_moves(
    target: MoveTarget, moves: Sequence[Move], movable: Mapping[Block, Callable[[Block], None]]
) -> tuple[int, int]:
    """A plan's moves in order: the bytes moved and how many moves ran (the first that
    finds no room to commit its destination ends the plan: later destinations were
    planned after it)."""
    moved = 0
    for index, move in enumerate(moves):
        nbytes = execute_move(target, move, movable)
        if nbytes is None:
            return moved, index
        moved += nbytes
    return moved, len(moves)


def release_emptied(target: MoveTarget, evacuated: Iterable[int]) -> tuple[tuple[int, ...], int]:
    """The planned segments that are wholly free, released: their addresses and bytes."""
    released: list[tuple[int, int]] = []
    for address in evacuated:
        size = target.free_segment_size(address)
        if size is not None:
            target.release_segment(address)
            released.append((address, size))
    return tuple(a for a, _ in released), sum(size for _, size in released)


def compact(target: MoveTarget, relocator: Relocator, pool: Any, needed: int) -> CompactionResult:
    """Stop the world, plan the release of ``needed`` bytes, run the moves, release the
    emptied segments.  ``pool`` is what the relocator is told is asking (the CachingPool)."""
    with relocator.relocation(pool) as movable:
        plan = plan_compaction(
            target.candidate_segments(movable),
            needed,
            target.max_split_size,
            max_moved=target.max_moved,
            may_move=target.may_move,
        )
        if plan.empty:
            return CompactionResult(plan, 0)
        moved, ran = execute_moves(target, plan.moves, movable)
    # the world runs again: the emptied segments are the pool's alone (its lock is held)
    if ran < len(plan.moves):  # a move found no room to commit: what it emptied goes back
        evacuated, released = release_emptied(target, plan.evacuated)
        return CompactionResult(CompactionPlan(plan.moves[:ran], evacuated, released), moved)
    for address in plan.evacuated:
        target.release_segment(address)
    return CompactionResult(plan, moved)


def compact_step(
    target: MoveTarget,
    relocator: Relocator,
    pool: Any,
    needed: int,
    proceed: Callable[[], bool] = lambda: False,
) -> CompactionResult:
    """One step of a compaction nobody waits for (the background compactor's): plan as
    :func:`compact` does, within ``target.max_moved``, run the plan's first move (one
    Storage), and each further move only while ``proceed()`` says nobody waits for the
    locks (checked before each move); then release the planned segments that are wholly
    free by now.  Each move copies outside the locks (:func:`execute_move_outside_locks`),
    so a request waits for no copy, only for the bookkeeping before and after one; a move
    that no longer holds (its owner held, freed or moved meanwhile, its destination taken)
    ends the step.  One plan serves many moves while the server is quiet, and the next
    step plans again from the pool as it is then.  A result with neither moves nor
    released segments: nothing was left to do."""
    with relocator.relocation(pool) as movable:
        plan = plan_compaction(
            target.candidate_segments(movable),
            needed,
            target.max_split_size,
            max_moved=target.max_moved,
            may_move=target.may_move,
            order=background_evacuation_order,
        )
    if plan.empty:
        return CompactionResult(plan, 0)
    done: list[Move] = []
    moved = wasted = 0
    for move in plan.moves:
        if done and not proceed():
            break
        nbytes, current = execute_move_outside_locks(target, relocator, pool, move)
        if not current:
            wasted += nbytes  # paced and budgeted too
            break
        moved += nbytes
        done.append(move)
    # the emptied segments are the pool's alone (its lock is held)
    emptied = []
    for address in plan.evacuated:
        size = target.free_segment_size(address)
        if size is not None:
            target.release_segment(address)
            emptied.append((address, size))
    step = CompactionPlan(
        tuple(done), tuple(a for a, _ in emptied), sum(size for _, size in emptied)
    )
    return CompactionResult(step, moved, wasted)


def repacked_size(segment: SegmentUsage) -> int:
    """The smallest large-pool segment that holds ``segment``'s blocks back to back
    (their rounded requests, rounded up to 2 MiB as a segment is)."""
    used = sum(request for _, _, request in segment.allocated)
    return ROUND_LARGE * ((used + ROUND_LARGE - 1) // ROUND_LARGE)


def plan_repack(
    segment: SegmentUsage,
    new_address: int,
    new_size: int,
    max_split_size: int,
    *,
    exact: bool = False,
) -> CompactionPlan:
    """Every block of the large-pool ``segment`` moved, back to back, into a new empty
    segment at ``new_address``: each takes its rounded request (the rest of the new
    segment is always over 1 MiB, so malloc's rule splits it), except the last, which
    takes what is left when that is too little to split, so the block that goes last is
    one that was at least that large already (no block grows).  Empty when no block can
    go last (with ``exact``: the last takes its request alone, :attr:`Move.exact`, the
    rest of the new segment left free), or where max_split_size would keep the new
    segment whole."""
    if segment.is_small:
        return plan_small_repack(segment, new_address, new_size)
    if new_size >= max_split_size:
        return CompactionPlan((), (), 0)
    blocks = sorted(segment.allocated, key=lambda b: (-b[2], b[0]))
    left_over = new_size - sum(request for _, _, request in blocks)
    if left_over < 0:
        return CompactionPlan((), (), 0)
    last_exact = False
    if left_over > 0 and not should_split(
        blocks[-1][2] + left_over, blocks[-1][2], False, max_split_size
    ):
        fits = [b for b in blocks if b[1] >= b[2] + left_over]
        if fits:
            blocks.remove(fits[-1])
            blocks.append(fits[-1])
        elif exact:
            last_exact = True
        else:
            return CompactionPlan((), (), 0)
    moves: list[Move] = []
    cursor = new_address
    for address, _, request in blocks:
        moves.append(Move(address, cursor, request))
        cursor += request
    if last_exact:
        moves[-1] = replace(moves[-1], exact=True)
    return CompactionPlan(tuple(moves), (segment.address,), segment.size)


def plan_small_repack(segment: SegmentUsage, new_address: int, new_size: int) -> CompactionPlan:
    """Every block of the small-pool ``segment`` moved, back to back, into a new empty
    segment: each takes its rounded request (the rest of the segment, a multiple of
    512 B, always splits off in the small pool).  Empty when they do not fit."""
    blocks = sorted(segment.allocated, key=lambda b: (-b[2], b[0]))
    if sum(request for _, _, request in blocks) > new_size:
        return CompactionPlan((), (), 0)
    moves: list[Move] = []
    cursor = new_address
    for address, _, request in blocks:
        moves.append(Move(address, cursor, request))
        cursor += request
    return CompactionPlan(tuple(moves), (segment.address,), segment.size)


def spill_into_holes(
    segment: SegmentUsage, free: Sequence[FreeSpot], max_split_size: int
) -> tuple[list[Move], SegmentUsage]:
    """The blocks of ``segment`` that fit holes of ``free`` (other segments' free blocks,
    sorted), largest first, each into the hole malloc's best fit would pick without the
    block growing (:func:`place`): their moves, and ``segment`` with only the blocks left."""
    trial = spots_of_others(free, segment)
    moves: list[Move] = []
    left: list[tuple[int, int, int]] = []
    for address, size, request in sorted(segment.allocated, key=lambda b: (-b[1], b[0])):
        spot = place(trial, request, size, segment.is_small, max_split_size)
        if spot is None:
            left.append((address, size, request))
            continue
        index, block_size = spot
        free_size, free_address, home = trial.pop(index)
        if block_size < free_size:  # the rest stays free, after the moved block
            bisect.insort(trial, (free_size - block_size, free_address + block_size, home))
        moves.append(Move(address, free_address, request))
    rest = SegmentUsage(
        segment.address,
        segment.size,
        segment.is_small,
        segment.stream,
        tuple(sorted(left)),
        segment.free,
        segment.movable,
    )
    return moves, rest


@dataclass(frozen=True, slots=True)
class RepackOption:
    """One way to give back ``segment``: some blocks into holes elsewhere, the rest back to
    back into a new segment of ``new_size`` bytes (0: none needed)."""

    segment: SegmentUsage
    into_holes: tuple[Move, ...]
    rest: SegmentUsage
    new_size: int

    @property
    def gain(self) -> int:
        return self.segment.size - self.new_size


def repack_options(
    segments: Sequence[SegmentUsage], max_split_size: int, may_move: MayMove | None = None
) -> list[RepackOption]:
    """Every movable large-pool segment's repack that gives bytes back, the most first
    (``may_move``: as :func:`plan_compaction`'s)."""
    free: dict[int, list[FreeSpot]] = {}
    for segment in segments:
        if not segment.is_small:
            free.setdefault(segment.stream, []).extend(segment.free_spots)
    for spots in free.values():
        spots.sort()
    options = []
    for segment in segments:
        if segment.is_small or not segment.movable or not segment.allocated:
            continue
        if may_move is not None and not may_move(segment):
            continue
        into_holes, rest = spill_into_holes(segment, free[segment.stream], max_split_size)
        new_size = repacked_size(rest)
        if new_size >= segment.size:
            continue
        # a plan with a stand-in address says whether the rest can go back to back at all
        if rest.allocated and plan_repack(rest, 0, new_size, max_split_size).empty:
            continue
        options.append(RepackOption(segment, tuple(into_holes), rest, new_size))
    return sorted(options, key=lambda o: (-o.gain, o.segment.address))


def repack(target: MoveTarget, relocator: Relocator, pool: Any, needed: int) -> CompactionResult:
    """Beyond compaction: where free space is all holes too small to take a whole segment's
    blocks, move a large-pool segment's blocks into the holes of other segments that fit
    them and the rest into a new segment just large enough (reserved from what the device
    has left), and release the old one, the repack that gives back the most first, until
    ``needed`` bytes went back.  Each repack gives the device its holes and may leave new
    ones elsewhere, so the options are weighed again after each.  Every repack gives back
    at least 2 MiB, so this ends after at most reserved / 2 MiB of them.  With the target's
    ``max_moved``, a repack that would copy the bytes moved beyond it is skipped."""
    moves: list[Move] = []
    evacuated: list[int] = []
    released = moved = 0
    with relocator.relocation(pool) as movable:
        while released < needed:
            options = repack_options(
                target.candidate_segments(movable), target.max_split_size, target.may_move
            )
            chosen = None
            for option in options:
                budget = target.max_moved
                if budget is not None and moved + option.segment.allocated_bytes > budget:
                    continue
                address = (  # all into holes: no new segment
                    target.reserve_segment(option.rest, option.new_size) if option.new_size else 0
                )
                if address is not None:
                    chosen = option, address
                    break
            if chosen is None:
                break
            option, address = chosen
            plan_moves = list(option.into_holes)
            if option.new_size:
                plan = plan_repack(option.rest, address, option.new_size, target.max_split_size)
                plan_moves.extend(plan.moves)
            nbytes, ran = execute_moves(target, plan_moves, movable)
            moved += nbytes
            moves.extend(plan_moves[:ran])
            if ran < len(plan_moves):  # no room to commit a destination: stop there
                emptied, _ = release_emptied(target, (option.segment.address,))
                evacuated.extend(emptied)
                released += option.gain if emptied else 0
                break
            target.release_segment(option.segment.address)
            evacuated.append(option.segment.address)
            released += option.gain
    return CompactionResult(CompactionPlan(tuple(moves), tuple(evacuated), released), moved)


# ---------------------------------------------------------------------------
# Merging: several segments' blocks into one new segment


def plan_merge(
    segments: Sequence[SegmentUsage],
    room: int,
    max_split_size: int,
    *,
    max_moved: int | None = None,
    may_move: MayMove | None = None,
    large_only: bool = False,
    exact: bool = False,
) -> tuple[tuple[SegmentUsage, ...], int] | None:
    """The segments of one pool whose blocks, back to back in one new segment of at most
    ``room`` bytes, give back the most, and that segment's size; None when no group gives
    back at least 2 MiB.

    Near the device's edge the free bytes are mostly segment tails and small holes: every
    segment is a multiple of 2 MiB and its blocks rarely are, so a large segment leaves
    up to 2 MiB that no large request fits and no single repack gives back (its blocks
    round up to the same size), and a small segment's hole may fit none of the blocks of
    the others.  Together the free bytes of several segments are whole 2 MiB units: the
    group's blocks in one segment of their rounded requests' total, rounded up to 2 MiB
    (in the small pool too: a merged small segment may be larger than torch's 2 MiB), give
    back the sum of their sizes less that.  Segments are taken the most free bytes per
    byte of blocks first (the most given back per byte copied) while the new segment fits
    ``room`` (and the blocks ``max_moved``), all of one pool and stream; the group is the
    run of them, in that order, that gives back the most.  ``large_only``: the large
    pool's segments alone.  ``exact``: a group whose blocks leave under 1 MiB at the end
    of the new segment is taken even when no block was that much larger already (its
    last block leaves that rest free, :attr:`Move.exact`, and a segment ends in a free
    block no large request fits: on the out-of-memory path, where the request waits).
    """
    by_pool: dict[tuple[bool, int], list[SegmentUsage]] = {}
    for segment in segments:
        if not segment.movable or not segment.allocated or segment.free_bytes == 0:
            continue
        if large_only and segment.is_small:
            continue
        by_pool.setdefault((segment.is_small, segment.stream), []).append(segment)
    best: tuple[tuple[SegmentUsage, ...], int] | None = None
    best_gain = ROUND_LARGE - 1
    for (small, _), candidates in by_pool.items():
        candidates.sort(key=lambda s: (-s.free_bytes / s.requested_bytes, s.address))
        group: list[SegmentUsage] = []
        sizes = requested = spare = 0  # spare: the most any block is larger than its request
        for segment in candidates:
            total = requested + segment.requested_bytes
            new_size = ROUND_LARGE * ((total + ROUND_LARGE - 1) // ROUND_LARGE)
            if new_size > room or (not small and new_size >= max_split_size):
                continue
            if max_moved is not None and total > max_moved:
                continue
            if may_move is not None and not may_move(segment):
                continue
            group.append(segment)
            sizes += segment.size
            requested = total
            spare = max(spare, *(size - request for _, size, request in segment.allocated))
            gain = sizes - new_size
            if len(group) < 2 or gain <= best_gain:
                continue
            # back to back, the last block takes what is left when that is too little to
            # split (:func:`plan_repack`): some block must have been that much larger
            left = new_size - total
            if exact or small or left == 0 or left > SMALL_SIZE or spare >= left:
                best, best_gain = (tuple(group), new_size), gain
    return best


def merged_usage(group: Sequence[SegmentUsage]) -> SegmentUsage:
    """``group`` as one segment holding all its allocated blocks (for :func:`plan_repack`)."""
    first = group[0]
    return SegmentUsage(
        first.address,
        sum(s.size for s in group),
        first.is_small,
        first.stream,
        tuple(sorted(b for s in group for b in s.allocated)),
        (),
        True,
    )


def merge(
    target: MoveTarget,
    relocator: Relocator,
    pool: Any,
    needed: int,
    room: int,
    large_only: bool = False,
    exact: bool = False,
) -> CompactionResult:
    """Run :func:`plan_merge` until ``needed`` bytes went back (each merge gives the
    device room for the next): reserve the new segment (from ``room``, what the device
    has left), move the group's blocks into it back to back (:func:`plan_repack`), release
    the group's segments.  A move that finds no room to commit its destination ends it,
    releasing what it emptied.  ``large_only``, ``exact``: :func:`plan_merge`'s."""
    moves: list[Move] = []
    evacuated: list[int] = []
    released = moved = 0
    with relocator.relocation(pool) as movable:
        while released < needed:
            budget = None if target.max_moved is None else target.max_moved - moved
            chosen = plan_merge(
                target.candidate_segments(movable),
                room,
                target.max_split_size,
                max_moved=budget,
                may_move=target.may_move,
                large_only=large_only,
                exact=exact,
            )
            if chosen is None:
                break
            group, new_size = chosen
            usage = merged_usage(group)
            address = target.reserve_segment(usage, new_size)
            if address is None:
                break
            plan = plan_repack(usage, address, new_size, target.max_split_size, exact=exact)
            nbytes, ran = execute_moves(target, plan.moves, movable)
            moved += nbytes
            moves.extend(plan.moves[:ran])
            addresses = [s.address for s in group]
            if ran < len(plan.moves):
                emptied, nbytes = release_emptied(target, addresses)
                evacuated.extend(emptied)
                released += nbytes
                break
            for segment_address in addresses:
                target.release_segment(segment_address)
            evacuated.extend(addresses)
            gain = usage.size - new_size
            released += gain
            room += gain
    return CompactionResult(CompactionPlan(tuple(moves), tuple(evacuated), released), moved)
