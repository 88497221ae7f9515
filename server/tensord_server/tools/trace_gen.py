"""Synthetic allocator traces: seeded workloads no policy was tuned on, in the replay's format.

Each *family* is a pure function of a seed: :func:`generate` ``(family, seed)`` gives the
same list of ``(action, addr, size, stream)`` events on every machine and Python (one
:class:`random.Random` per trace, nothing global), the format ``tensord replay`` reads
(``alloc`` with the bytes requested, ``free_completed`` with the same size; the addresses
are keys, unique per trace; every event on stream 0; no ``segment_*`` events, so the pool
decides segments).  ``tensord replay --synthetic FAMILY --seed N`` replays one, ``--save
FILE`` writes it as a ``.events.json.gz`` any replay reads.  The families:

- ``transformer``: weights, their gradients and Adam's two moments live throughout; each
  step draws a batch size and a sequence length, so activations (saved for backward,
  attention scores growing with the square of the length, temporaries freed at once)
  change size from step to step;
- ``kv_cache``: inference weights, then sequences that come and go, each one's per-layer
  K and V caches growing by appends (a larger copy, then the old one freed, as
  ``torch.cat`` does), beside each step's short-lived activations;
- ``weights_activations``: a model loaded tensor by tensor (each through a staging copy
  twice its size, freed once cast), long-lived weights of many sizes interleaved with
  short-lived activations, then adapters swapped for ones of other sizes;
- ``small_bursts``: bursts of hundreds of tensors of 512 B-1 MiB, a few of each burst
  outliving many bursts, among medium tensors;
- ``edge_mass_free``: the device filled to the same total again and again, each time
  most of the live tensors freed at once at random and the total reached again with
  tensors of another size range.

Sizes are GPU-scale (on seeds 0-11, peaks of 0.2-0.5 GiB for ``small_bursts``, 0.2-4.7
GiB for ``kv_cache``, 2.3-14 GiB for ``transformer``): a 1 % margin is then one to several
dozen 2 MiB segments.
:func:`capacity_floor` says, from the pool's rounding rules, below which capacity no
policy can serve a trace at all.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from tensord_server.pool import SMALL_BUFFER, SMALL_SIZE, round_size

# One trace event: (action, addr, size, stream), as tools.replay reads them.
Event = tuple[str, int, int, int]

MiB = 1 << 20
KiB = 1 << 10
# Addresses are keys: a fresh one per allocation, spaced as a device's might be.
ADDRESS_BASE = 0x7F00_0000_0000
ADDRESS_STRIDE = 1 << 12


class TraceBuilder:
    """Emits a trace's events; ``alloc`` returns the key ``free`` takes.

    Invariant: every key in ``live`` was allocated and not yet freed; a key is never reused.
    """

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.live: dict[int, int] = {}  # key -> bytes requested
        self._next = ADDRESS_BASE

    def alloc(self, nbytes: int) -> int:
        key = self._next
        self._next += ADDRESS_STRIDE
        size = max(1, int(nbytes))
        self.live[key] = size
        self.events.append(("alloc", key, size, 0))
        return key

    def free(self, key: int) -> None:
        self.events.append(("free_completed", key, self.live.pop(key), 0))

    def free_all(self) -> None:
        for key in list(self.live):
            self.free(key)

    @property
    def live_bytes(self) -> int:
        return sum(self.live.values())


def transformer(rng: random.Random) -> list[Event]:
    """Training steps of a decoder whose batch size and sequence length vary by step."""
    out = TraceBuilder()
    hidden = rng.choice((768, 1024, 1536, 2048))
    heads = hidden // 64
    layers = rng.randint(4, 8)
    vocab = rng.choice((32_000, 50_257))
    fp32 = 4
    shapes = [vocab * hidden]  # the embedding (tied with the head)
    for _ in range(layers):
        shapes += [3 * hidden * hidden, 3 * hidden, hidden * hidden, hidden]
        shapes += [4 * hidden * hidden, 4 * hidden, 4 * hidden * hidden, hidden]
        shapes += [hidden, hidden, hidden, hidden]  # two layer norms
    params = [out.alloc(n * fp32) for n in shapes]
    grads: list[int] = []
    moments: list[int] = []
    batches = (1, 2, 4, 8)
    lengths = (128, 256, 384, 512, 768, 1024)
    for step in range(rng.randint(4, 7)):
        batch, length = rng.choice(batches), rng.choice(lengths)
        tokens = batch * length
        saved: list[list[int]] = []
        x = out.alloc(tokens * hidden * fp32)  # the embedding's output
        for _ in range(layers):
            kept = [out.alloc(tokens * hidden * fp32)]  # layer norm out
            qkv = out.alloc(3 * tokens * hidden * fp32)
            kept.append(qkv)
            scores = out.alloc(batch * heads * length * length * fp32)
            probs = out.alloc(batch * heads * length * length * fp32)
            out.free(scores)
            kept.append(probs)
            mask = out.alloc(batch * heads * length * length)  # dropout's mask, bytes
            kept.append(mask)
            kept.append(out.alloc(tokens * hidden * fp32))  # attention out
            kept.append(out.alloc(tokens * hidden * fp32))  # second layer norm out
            up = out.alloc(4 * tokens * hidden * fp32)
            kept.append(up)
            kept.append(out.alloc(4 * tokens * hidden * fp32))  # gelu out
            new_x = out.alloc(tokens * hidden * fp32)
            kept.append(x)
            x = new_x
            saved.append(kept)
        logits = out.alloc(tokens * vocab * fp32)
        loss_tmp = out.alloc(tokens * vocab * fp32)  # log-softmax
        out.free(loss_tmp)
        grad = out.alloc(tokens * vocab * fp32)
        out.free(logits)
        dx = out.alloc(tokens * hidden * fp32)
        out.free(grad)
        out.free(x)
        if step == 0:  # the first backward allocates every .grad, kept afterwards
            grads = [out.alloc(n * fp32) for n in shapes[:1]]
        for layer in reversed(range(layers)):
            tmp = out.alloc(4 * tokens * hidden * fp32)
            dprobs = out.alloc(batch * heads * length * length * fp32)
            out.free(tmp)
            out.free(dprobs)
            if step == 0:
                first = 1 + 12 * layer
                grads += [out.alloc(n * fp32) for n in shapes[first : first + 12]]
            new_dx = out.alloc(tokens * hidden * fp32)
            out.free(dx)
            dx = new_dx
            for key in saved.pop():
                out.free(key)
        out.free(dx)
        if step == 0:  # Adam's moments, on the first optimizer step
            moments = [out.alloc(n * fp32) for n in shapes for _ in range(2)]
        for n in shapes[:: max(1, len(shapes) // 8)]:  # the step's foreach temporaries
            out.free(out.alloc(n * fp32))
    del params, grads, moments
    out.free_all()
    return out.events


def kv_cache(rng: random.Random) -> list[Event]:
    """Serving: sequences come and go, each one's K and V caches grown by appends."""
    out = TraceBuilder()
    hidden = rng.choice((1024, 2048, 4096))
    layers = rng.randint(4, 8)
    fp16 = 2
    for _ in range(layers):
        for n in (3 * hidden * hidden, hidden * hidden, 4 * hidden * hidden, 4 * hidden * hidden):
            out.alloc(n * fp16)
    chunk = rng.choice((16, 32, 64))  # tokens per append (the cache's growth step)
    seqs: dict[int, tuple[int, list[int]]] = {}  # id -> (tokens cached, K/V keys per layer)
    next_id = 0
    most = rng.randint(6, 14)
    for _ in range(rng.randint(60, 110)):
        if len(seqs) < most and (not seqs or rng.random() < 0.35):
            prompt = rng.randint(1, 32) * chunk
            seqs[next_id] = (prompt, [out.alloc(prompt * hidden * fp16) for _ in range(2 * layers)])
            next_id += 1
        tokens = sum(n for n, _ in seqs.values())
        act = out.alloc(max(tokens, 1) * hidden * fp16)  # the step's activations
        tmp = out.alloc(max(tokens, 1) * 4 * hidden * fp16)
        out.free(tmp)
        for sid in list(seqs):
            cached, keys = seqs[sid]
            if rng.random() < 0.5:
                continue  # no new chunk this step
            grown = []
            for key in keys:  # torch.cat: the larger copy first, then the old one goes
                grown.append(out.alloc((cached + chunk) * hidden * fp16))
                out.free(key)
            seqs[sid] = (cached + chunk, grown)
            if rng.random() < 0.08 or cached + chunk >= 2048:
                for key in grown:
                    out.free(key)
                del seqs[sid]
        out.free(act)
    out.free_all()
    return out.events


def log_uniform(rng: random.Random, low: int, high: int) -> int:
    return int(low * (high / low) ** rng.random())


def weights_activations(rng: random.Random) -> list[Event]:
    """Weights loaded among staging copies and activations; adapters swapped."""
    out = TraceBuilder()
    weights = []
    for _ in range(rng.randint(60, 140)):
        nbytes = log_uniform(rng, 4 * KiB, 160 * MiB)
        staging = out.alloc(2 * nbytes)  # read as fp32, then cast
        weights.append(out.alloc(nbytes))
        out.free(staging)
        if rng.random() < 0.3:  # a check run on the way: an activation or two
            act = out.alloc(log_uniform(rng, 256 * KiB, 64 * MiB))
            out.free(act)
    adapters = [out.alloc(log_uniform(rng, 1 * MiB, 48 * MiB)) for _ in range(rng.randint(4, 12))]
    for _ in range(rng.randint(30, 60)):
        acts = [out.alloc(log_uniform(rng, 64 * KiB, 96 * MiB)) for _ in range(rng.randint(3, 12))]
        rng.shuffle(acts)
        for key in acts:
            out.free(key)
        if rng.random() < 0.3:  # swap an adapter for one of another size
            out.free(adapters.pop(rng.randrange(len(adapters))))
            adapters.append(out.alloc(log_uniform(rng, 1 * MiB, 48 * MiB)))
    del weights
    out.free_all()
    return out.events


def small_bursts(rng: random.Random) -> list[Event]:
    """Bursts of small tensors, a few of each kept for many bursts, among medium ones."""
    out = TraceBuilder()
    base = [out.alloc(log_uniform(rng, 2 * MiB, 64 * MiB)) for _ in range(rng.randint(8, 20))]
    survivors: list[tuple[int, int]] = []  # (key, the burst it goes after)
    medium: list[int] = []
    for burst in range(rng.randint(12, 20)):
        tensors = []
        for _ in range(rng.randint(100, 300)):
            nbytes = (
                log_uniform(rng, 512, SMALL_SIZE) if rng.random() < 0.9 else rng.randint(1, 511)
            )
            tensors.append(out.alloc(nbytes))
        if rng.random() < 0.5:
            medium.append(out.alloc(log_uniform(rng, 1 * MiB, 24 * MiB)))
        rng.shuffle(tensors)
        for key in tensors:
            if rng.random() < 0.06:
                survivors.append((key, burst + rng.randint(1, 8)))
            else:
                out.free(key)
        for key, until in survivors:
            if until <= burst:
                out.free(key)
        survivors = [s for s in survivors if s[1] > burst]
        if medium and rng.random() < 0.4:
            out.free(medium.pop(rng.randrange(len(medium))))
    del base
    out.free_all()
    return out.events


def edge_mass_free(rng: random.Random) -> list[Event]:
    """Filled to one total again and again; each time most tensors freed at once."""
    out = TraceBuilder()
    target = rng.randint(3, 8) * 256 * MiB
    ranges = [(64 * KiB, 4 * MiB), (1 * MiB, 32 * MiB), (8 * MiB, 128 * MiB), (256 * KiB, 64 * MiB)]
    for phase in range(rng.randint(4, 6)):
        low, high = ranges[rng.randrange(len(ranges))] if phase else ranges[0]
        while True:
            nbytes = log_uniform(rng, low, high)
            if out.live_bytes + nbytes > target:
                break
            out.alloc(nbytes)
        keys = list(out.live)
        share = rng.uniform(0.5, 0.85)
        for key in rng.sample(keys, int(share * len(keys))):
            out.free(key)
    out.free_all()
    return out.events


#: each family's generator, by name
FAMILIES: dict[str, Callable[[random.Random], list[Event]]] = {
    "transformer": transformer,
    "kv_cache": kv_cache,
    "weights_activations": weights_activations,
    "small_bursts": small_bursts,
    "edge_mass_free": edge_mass_free,
}


def generate(family: str, seed: int) -> list[Event]:
    """The trace of ``family`` for ``seed``: the same events for the same pair, anywhere."""
    try:
        make = FAMILIES[family]
    except KeyError:
        raise ValueError(
            f"no synthetic trace family {family!r}; families: {', '.join(FAMILIES)}"
        ) from None
    return make(random.Random(f"{family}:{seed}"))


@dataclass(frozen=True)
class CapacityFloor:
    """The least capacity any policy of the pool could serve a trace in, and why.

    ``bytes`` is the largest, over the trace's events, of the live small blocks' rounded
    bytes up to whole ``SMALL_BUFFER`` segments plus the live large blocks' rounded bytes
    up to whole 2 MiB: small and large blocks never share a segment and segments come
    in those units, so no packing and no move does with less.
    """

    bytes: int
    event: int  # the index of the event where it is reached
    small_bytes: int  # live small blocks' rounded bytes there
    large_bytes: int  # live large blocks' rounded bytes there

    def explain(self, capacity: int) -> str:
        """Why ``capacity`` cannot serve the trace (call only when it is below ``bytes``)."""
        return (
            f"capacity {capacity:,} B is below the trace's floor {self.bytes:,} B: at event "
            f"{self.event} the live blocks round (512 B each, the small ones into "
            f"{SMALL_BUFFER // MiB} MiB segments, the large ones to {SEGMENT_UNIT // MiB} MiB) "
            f"to ceil({self.small_bytes:,} / {SMALL_BUFFER:,}) x {SMALL_BUFFER:,} + "
            f"ceil({self.large_bytes:,} / {SEGMENT_UNIT:,}) x {SEGMENT_UNIT:,} B"
        )


SEGMENT_UNIT = 2 * MiB  # large segments are reserved in multiples of kRoundLarge


def round_up(nbytes: int, unit: int) -> int:
    return -(-nbytes // unit) * unit


def capacity_floor(events: list[Event]) -> CapacityFloor:
    """The :class:`CapacityFloor` of ``events`` (frees of unknown keys ignored)."""
    live: dict[int, int] = {}
    small = large = 0
    best = CapacityFloor(0, 0, 0, 0)
    for index, (action, addr, size, _stream) in enumerate(events):
        if action == "alloc":
            rounded = round_size(size)
            live[addr] = rounded
            if rounded <= SMALL_SIZE:
                small += rounded
            else:
                large += rounded
            floor = round_up(small, SMALL_BUFFER) + round_up(large, SEGMENT_UNIT)
            if floor > best.bytes:
                best = CapacityFloor(floor, index, small, large)
        elif action == "free_completed" and addr in live:
            rounded = live.pop(addr)
            if rounded <= SMALL_SIZE:
                small -= rounded
            else:
                large -= rounded
    return best
