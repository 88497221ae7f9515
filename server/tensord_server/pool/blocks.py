"""The pool's building blocks: PyTorch's size rules, segments, blocks and the free-block pools.

``round_size``/``get_allocation_size``/``should_split`` are the rules of
``c10/cuda/CUDACachingAllocator.cpp`` as pure functions; a :class:`Segment` is one
upstream allocation, cut into a linked list of :class:`Block` s; a :class:`BlockPool`
keeps the free blocks of the small or the large pool sorted by (stream, size, address).
"""

from __future__ import annotations

import bisect

from tensord_server.pool.backend import NULL_MEMORY, DeviceMemory

# ---------------------------------------------------------------------------
# Policy constants (PyTorch's names in the comments)

MIN_BLOCK_SIZE = 512  # kMinBlockSize: every size is rounded up to a multiple of this
SMALL_SIZE = 1 << 20  # kSmallSize: the largest request served by the small pool (1 MiB)
SMALL_BUFFER = 2 << 20  # kSmallBuffer: small requests are packed into 2 MiB segments
LARGE_BUFFER = 20 << 20  # kLargeBuffer: requests of 1-10 MiB share 20 MiB segments
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc: from 10 MiB a request gets its own segment
ROUND_LARGE = 2 << 20  # kRoundLarge: own segments are rounded up to 2 MiB
UNLIMITED_SPLIT_SIZE = (1 << 64) - 1  # SIZE_MAX: max_split_size unset, any block may split

# Indices into a StatArray, in torch's StatType order.
ALL, SMALL_POOL, LARGE_POOL = 0, 1, 2
STAT_TYPE_NAMES = ("all", "small_pool", "large_pool")


# ---------------------------------------------------------------------------
# Pure policy functions


def round_size(nbytes: int) -> int:
    """Mirrors round_size (without roundup_power2_divisions): at least and a multiple of 512 B."""
    if nbytes < MIN_BLOCK_SIZE:
        return MIN_BLOCK_SIZE
    return MIN_BLOCK_SIZE * ((nbytes + MIN_BLOCK_SIZE - 1) // MIN_BLOCK_SIZE)


def is_small_size(size: int) -> bool:
    """Mirrors get_pool: rounded sizes up to 1 MiB go to the small pool."""
    return size <= SMALL_SIZE


def get_allocation_size(size: int) -> int:
    """Mirrors get_allocation_size: the segment to reserve when no cached block fits."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * ((size + ROUND_LARGE - 1) // ROUND_LARGE)


def should_split(block_size: int, size: int, small: bool, max_split_size: int) -> bool:
    """Mirrors should_split: is the rest of a block, after taking ``size``, worth keeping free?"""
    remaining = block_size - size
    if small:
        return remaining >= MIN_BLOCK_SIZE
    return size < max_split_size and remaining > SMALL_SIZE


def oversize_rules_allow(block_size: int, size: int, max_split_size: int) -> bool:
    """Mirrors get_free_block's max_split_size rules for the best-fit candidate.

    A request below max_split_size never takes an oversize block (it would be
    split, and oversize blocks are kept whole); an oversize request takes a
    block only if less than 20 MiB would be wasted.
    """
    if size < max_split_size and block_size >= max_split_size:
        return False
    return not (size >= max_split_size and block_size >= size + LARGE_BUFFER)


def format_size(nbytes: int) -> str:
    """Mirrors c10's format_size, used in the out-of-memory message."""
    if nbytes <= 1024:
        return f"{nbytes} bytes"
    if nbytes <= 1048576:
        return f"{nbytes / 1024.0:.2f} KiB"
    if nbytes <= 1073741824:
        return f"{nbytes / 1048576.0:.2f} MiB"
    return f"{nbytes / 1073741824.0:.2f} GiB"


def device_index(device: str) -> int:
    """The integer torch puts in snapshots: N of "cuda:N", else 0."""
    _, _, index = device.partition(":")
    return int(index) if index.isdigit() else 0


# ---------------------------------------------------------------------------
# Named types: Segment, Block, BlockPool


class Segment:
    """One upstream allocation from the backend, tiled by Blocks.

    Invariants (guarded by the CachingPool lock): walking ``head`` -> ``next``
    visits blocks whose sizes sum to ``size``, each starting where the previous
    ended, from ``address``; ``head.prev is None``; every block's ``segment``
    is this one; no two neighbouring blocks are both free.
    """

    __slots__ = ("head", "is_small", "memory", "stream")

    def __init__(self, memory: DeviceMemory, stream: int, is_small: bool) -> None:
        self.memory = memory  # the backend's allocation; owns the bytes
        self.stream = stream  # every block of the segment has this stream
        self.is_small = is_small  # in the small pool (2 MiB segments) or the large one
        self.head: Block | None = None  # the lowest-address block; None only for NULL_SEGMENT

    @property
    def address(self) -> int:
        return self.memory.address

    @property
    def size(self) -> int:
        return self.memory.nbytes

    def blocks(self) -> list[Block]:
        """The blocks tiling this segment, by address."""
        result = []
        block = self.head
        while block is not None:
            result.append(block)
            block = block.next
        return result

    def __repr__(self) -> str:
        return f"Segment(address={self.address:#x}, size={self.size}, small={self.is_small})"


# Zero-byte blocks point into this empty segment (torch hands back a null pointer).
NULL_SEGMENT = Segment(NULL_MEMORY, stream=0, is_small=True)


class Block:
    """A span of a Segment: allocated to a caller, or cached free in its BlockPool.

    Invariants: ``segment.address <= address`` and ``address + size <=
    segment.address + segment.size``; ``size`` is a positive multiple of 512
    (0 only for zero-byte blocks on NULL_SEGMENT); ``prev``/``next`` are the
    neighbours in the same segment (never another segment's blocks); a free
    block is in ``pool`` under the key (stream, size, address), an allocated
    one is not; ``requested_size <= size`` while allocated, 0 while free.
    """

    __slots__ = (
        "address",
        "allocated",
        "next",
        "pool",
        "prev",
        "requested_size",
        "segment",
        "size",
        "stream",
    )

    def __init__(
        self, address: int, size: int, stream: int, pool: BlockPool | None, segment: Segment
    ) -> None:
        self.address = address  # device address of the first byte
        self.size = size  # bytes in the block (rounded; what allocated_bytes counts)
        self.requested_size = 0  # bytes the caller asked for, while allocated
        self.stream = stream  # allocation stream; reused only on the same stream
        self.pool = pool  # the BlockPool it is cached in when free; None for zero-byte blocks
        self.segment = segment
        self.allocated = False
        self.prev: Block | None = None
        self.next: Block | None = None

    @property
    def offset(self) -> int:
        """Bytes from the start of the segment (what a backend view needs)."""
        return self.address - self.segment.address

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    def key(self) -> tuple[int, int, int]:
        return (self.stream, self.size, self.address)

    def __repr__(self) -> str:
        state = "allocated" if self.allocated else "free"
        return f"Block(address={self.address:#x}, size={self.size}, {state})"


class BlockPool:
    """The cached free blocks of one pool (small or large), torch's BlockPool.

    Invariants: ``keys`` is sorted and holds ``block.key()`` of exactly the
    blocks in ``free_blocks`` (free blocks of this pool, by address); best
    fit is the first key >= (stream, size).
    """

    __slots__ = ("free_blocks", "is_small", "keys", "kind")

    def __init__(self, is_small: bool) -> None:
        self.is_small = is_small
        self.kind = SMALL_POOL if is_small else LARGE_POOL  # its StatType index
        self.keys: list[tuple[int, int, int]] = []  # (stream, size, address), sorted
        self.free_blocks: dict[int, Block] = {}  # address -> free block

    def insert(self, block: Block) -> None:
        bisect.insort(self.keys, (block.stream, block.size, block.address))
        self.free_blocks[block.address] = block

    def remove(self, block: Block) -> None:
        key = (block.stream, block.size, block.address)
        index = bisect.bisect_left(self.keys, key)
        assert self.keys[index] == key, (key, "not in pool")
        del self.keys[index]
        del self.free_blocks[block.address]

    def best_fit(self, stream: int, size: int) -> Block | None:
        """The smallest free block of ``stream`` with at least ``size`` bytes, lowest address first."""
        index = bisect.bisect_left(self.keys, (stream, size, -1))
        if index == len(self.keys) or self.keys[index][0] != stream:
            return None
        return self.free_blocks[self.keys[index][2]]

    def largest_free(self) -> int:
        return max((key[1] for key in self.keys), default=0)

    def free_bytes(self) -> int:
        return sum(key[1] for key in self.keys)
