"""Record the allocation trace of a real model's training steps on CPU, in ``tensord replay``'s format.

No GPU is needed, and none is used: the model runs on CPU under
``torch.profiler.profile(profile_memory=True)``, which reports every allocation and
free that goes through c10's CPU allocator (the storages of parameters, activations,
gradients, optimizer state, and the buffers ops allocate inside themselves), with its
address and size, in order.  Those become the ``alloc`` / ``free_completed`` events of
a ``*.events.json.gz`` (``[action, addr, size, stream]``, see docs/design.md "Trace
format").  There is no caching allocator in between, so each size is the bytes the
model asked for, as a CUDA trace's ``alloc`` size is; segment events are not written
(replay lets the pool decide its segments).  Addresses are replaced by allocation
numbers (1, 2, ...), which identify a block until it is freed as well and make the
file the same on every run; frees of memory allocated before recording began are
dropped.

Each workload builds its model and optimizer inside the recording (their storages are
in the trace, as they are in a GPU trace from the start of a run) and runs a few
training steps whose input shapes vary from step to step:

- ``gpt_train``: a 4-layer GPT-style decoder (d_model 512, 8 heads, vocab 8192),
  AdamW, batch 8, sequence lengths 512, 192, 384, 256, 448 (one per step);
- ``lstm_train``: a 2-layer LSTM language model (hidden 512, vocab 8192), SGD with
  momentum, batch 32, sequence lengths 64, 96, 48, 80;
- ``unet_train``: a 4-level U-Net (32 base channels, GroupNorm), Adam, batch 4,
  images 192, 128, 160 pixels square.

    python scripts/record_trace.py [WORKLOAD ...] [--out DIR]

writes ``DIR/<workload>.events.json.gz`` (default DIR: the bundled traces' folder).
The figures depend on torch's CPU kernels, so they can differ slightly between torch
versions; the bundled ones were recorded with torch 2.13 (CPU, 2 threads).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

TRACES_DIR = (
    Path(__file__).resolve().parent.parent / "server" / "tensord_server" / "data" / "traces"
)
SEED = 0
# CPU kernels may split work (and their buffers) per thread: the bundled traces used 2
THREADS = 2

# One trace event: (action, addr, size, stream), as tensord replay reads them.
TraceEvent = tuple[str, int, int, int]


# ---------------------------------------------------------------------------
# The workloads


class Block(nn.Module):
    """One pre-norm decoder block: causal self-attention and an MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        shape = (batch, length, self.heads, width // self.heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        # written out (not scaled_dot_product_attention) so the score matrix is a tensor,
        # as in most GPT training code
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(width // self.heads)
        mask = torch.ones(length, length, dtype=torch.bool).triu(1)
        attention = scores.masked_fill(mask, float("-inf")).softmax(dim=-1)
        y = (attention @ v).transpose(1, 2).reshape(batch, length, width)
        x = x + self.proj(y)
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, width: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def gpt_train() -> Iterator[None]:
    vocab, batch = 8192, 8
    model = GPT(vocab, width=512, layers=4, heads=8, context=512)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    yield
    for length in (512, 192, 384, 256, 448):
        ids = torch.randint(vocab, (batch, length + 1))
        logits = model(ids[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del ids, logits, loss
        yield


class LanguageLSTM(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, hidden)
        self.lstm = nn.LSTM(hidden, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        output, _ = self.lstm(self.embedding(ids))
        return self.head(output)


def lstm_train() -> Iterator[None]:
    vocab, batch = 8192, 32
    model = LanguageLSTM(vocab, hidden=512, layers=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    yield
    for length in (64, 96, 48, 80):
        ids = torch.randint(vocab, (batch, length + 1))
        logits = model(ids[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1))
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del ids, logits, loss
        yield


def conv_block(inputs: int, outputs: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(inputs, outputs, 3, padding=1),
        nn.GroupNorm(8, outputs),
        nn.ReLU(),
        nn.Conv2d(outputs, outputs, 3, padding=1),
        nn.GroupNorm(8, outputs),
        nn.ReLU(),
    )


class UNet(nn.Module):
    def __init__(self, channels: int, base: int, levels: int) -> None:
        super().__init__()
        widths = [base * 2**i for i in range(levels)]
        self.down = nn.ModuleList()
        previous = channels
        for width in widths:
            self.down.append(conv_block(previous, width))
            previous = width
        self.middle = conv_block(widths[-1], widths[-1] * 2)
        self.up = nn.ModuleList()
        self.merge = nn.ModuleList()
        previous = widths[-1] * 2
        for width in reversed(widths):
            self.up.append(nn.ConvTranspose2d(previous, width, 2, stride=2))
            self.merge.append(conv_block(2 * width, width))
            previous = width
        self.out = nn.Conv2d(previous, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)
            x = nn.functional.max_pool2d(x, 2)
        x = self.middle(x)
        for up, merge, skip in zip(self.up, self.merge, reversed(skips), strict=True):
            x = merge(torch.cat([up(x), skip], dim=1))
        out: torch.Tensor = self.out(x)
        return out


def unet_train() -> Iterator[None]:
    batch = 4
    model = UNet(channels=3, base=32, levels=4)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    yield
    for side in (192, 128, 160):
        images = torch.randn(batch, 3, side, side)
        loss = nn.functional.mse_loss(model(images + 0.1 * torch.randn_like(images)), images)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del images, loss
        yield


WORKLOADS: dict[str, Callable[[], Iterator[None]]] = {
    "gpt_train": gpt_train,
    "lstm_train": lstm_train,
    "unet_train": unet_train,
}


# ---------------------------------------------------------------------------
# Recording


def record(workload: Callable[[], Iterator[None]]) -> list[TraceEvent]:
    """Run ``workload`` to the end under the profiler; its allocator events, in order."""
    torch.manual_seed(SEED)
    torch.set_num_threads(THREADS)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in workload():
            pass
    return trace_events(allocation_events(prof))


def allocation_events(prof: profile) -> list[tuple[int, int, int]]:
    """``(time_ns, ptr, alloc_size)`` of every CPU allocator event (a free has a negative size)."""
    found: list[tuple[int, int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            fields = node.extra_fields
            if str(fields.device) == "cpu" and fields.alloc_size != 0:
                found.append((node.start_time_ns, fields.ptr, fields.alloc_size))
        stack.extend(node.children)
    # time order; at one timestamp a free goes before an alloc (an address is reused only after)
    found.sort(key=lambda e: (e[0], e[2] > 0))
    return found


def trace_events(allocations: list[tuple[int, int, int]]) -> list[TraceEvent]:
    """Allocator events as trace events, addresses replaced by allocation numbers.

    A free of an address not allocated in the recording (allocated before it began)
    is dropped; an allocation never freed stays live at the end, as in a GPU trace.
    """
    live: dict[int, tuple[int, int]] = {}  # pointer -> (allocation number, bytes)
    events: list[TraceEvent] = []
    allocations_seen = 0
    for _, ptr, size in allocations:
        if size > 0:
            number = allocations_seen + 1
            allocations_seen = number
            live[ptr] = (number, size)
            events.append(("alloc", number, size, 0))
        elif ptr in live:
            number, nbytes = live.pop(ptr)
            events.append(("free_completed", number, nbytes, 0))
    return events


def write_trace(events: list[TraceEvent], path: Path) -> None:
    """Gzipped JSON, one event per line, with a fixed mtime so the bytes depend only on the events."""
    text = "[\n" + ",\n".join(json.dumps(list(e)) for e in events) + "\n]\n"
    with path.open("wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as handle:
        handle.write(text.encode())


def describe(events: list[TraceEvent]) -> str:
    allocated = peak = 0
    for action, _, size, _ in events:
        allocated += size if action == "alloc" else -size
        peak = max(peak, allocated)
    allocs = sum(1 for e in events if e[0] == "alloc")
    return f"{len(events)} events, {allocs} allocations, peak {peak / (1 << 20):.1f} MiB requested"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "workloads",
        nargs="*",
        metavar="WORKLOAD",
        help=f"any of {', '.join(WORKLOADS)} (default: all)",
    )
    parser.add_argument("--out", type=Path, default=TRACES_DIR)
    args = parser.parse_args(argv)
    unknown = sorted(set(args.workloads) - set(WORKLOADS))
    if unknown:
        parser.error(f"no workload {', '.join(unknown)}; workloads: {', '.join(WORKLOADS)}")
    for name in args.workloads or list(WORKLOADS):
        events = record(WORKLOADS[name])
        path = args.out / f"{name}.events.json.gz"
        write_trace(events, path)
        print(f"{path}: {describe(events)}, {path.stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
