"""torch on tensord tensors: a forward pass over pooled weights, and the cost of one op.

    python benchmarks/bench_torch.py            # the full run
    python benchmarks/bench_torch.py --quick    # fewer rounds, smaller modules

Starts ``tensord serve`` in its own process and connects on the same host (the mapping).
Side by side in one run, taking turns ``--rounds N`` times (default 9): the best round of
each side (the least disturbed by other load), and the median and range of the rounds:

- forward: an MLP and a ``TransformerEncoderLayer`` whose weights live in the pool
  (``load_state_dict(tensord.as_torch(state), assign=True)``) against the same module with
  its own weights; the ratio is local time / pooled time (1.0: as fast).  Target >= 0.95x
  for a forward of >= 1 ms.
- per op: ``x + 1``, ``x.add_(1)``, ``torch.add(x, x)``, ``x.sum()``, ``F.relu(x)`` and
  ``x[1:] + 1`` (a tensord view made each time, then its alias) on a 4-element tensord
  tensor (an alias of the pool) against the same op on a torch tensor: microseconds per op
  and the difference.  Target <= 20 us more per op.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tensord
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from servers import start_server

F = torch.nn.functional
ROUNDS = 9
FORWARD_TARGET = 0.95  # pooled forward speed / local forward speed, at least
OP_TARGET_US = 20.0  # extra microseconds per aliased op, at most


def best_of(run: Callable[[], Any], repeat: int) -> float:
    """Seconds per call of ``run``, the mean over ``repeat`` calls."""
    start = time.perf_counter()
    for _ in range(repeat):
        run()
    return (time.perf_counter() - start) / repeat


def taking_turns(
    pooled: Callable[[], Any], local: Callable[[], Any], repeat: int, rounds: int
) -> tuple[list[float], list[float]]:
    for _ in range(max(1, repeat // 10)):  # warm both (the allocator, the alias)
        pooled()
        local()
    mine, theirs = [], []
    for _ in range(rounds):
        mine.append(best_of(pooled, repeat))
        theirs.append(best_of(local, repeat))
    return mine, theirs


def modules(quick: bool) -> list[tuple[str, Callable[..., torch.nn.Module], tuple[int, ...]]]:
    width = 1024 if quick else 2048
    return [
        (
            f"mlp {width}x{4 * width}",
            lambda **kw: torch.nn.Sequential(
                torch.nn.Linear(width, 4 * width, **kw),
                torch.nn.GELU(),
                torch.nn.Linear(4 * width, width, **kw),
            ),
            (32, width),
        ),
        (
            "encoder 512/8/2048",
            lambda **kw: torch.nn.TransformerEncoderLayer(
                512, 8, dim_feedforward=2048, dropout=0.0, batch_first=True, **kw
            ),
            (8, 64, 512),
        ),
    ]


def forward_row(
    client: tensord.Client,
    name: str,
    build: Callable[..., torch.nn.Module],
    shape: Any,
    rounds: int,
) -> str:
    torch.manual_seed(0)
    local = build().eval()
    state = {key: client.tensor(value) for key, value in local.state_dict().items()}
    pooled = build(device="meta").eval()
    pooled.load_state_dict(tensord.as_torch(state), assign=True)
    inputs = torch.randn(*shape)
    with torch.no_grad():
        torch.testing.assert_close(pooled(inputs), local(inputs))
        once = best_of(lambda: local(inputs), 3)
        repeat = max(3, int(0.2 / once))
        mine, theirs = taking_turns(lambda: pooled(inputs), lambda: local(inputs), repeat, rounds)
    ratios = [t / m for m, t in zip(mine, theirs, strict=True)]
    best = min(theirs) / min(mine)  # the best of each side: least of a shared box's noise
    verdict = "ok" if best >= FORWARD_TARGET or min(theirs) < 1e-3 else "MISS"
    return (
        f"| forward {name} | {min(mine) * 1e3:.2f} ms | {min(theirs) * 1e3:.2f} ms | "
        f"{best:.3f}x (rounds: median {statistics.median(ratios):.3f}, "
        f"{min(ratios):.3f}-{max(ratios):.3f}) | >= {FORWARD_TARGET}x {verdict} |"
    )


def forward_rows(client: tensord.Client, quick: bool, rounds: int) -> list[str]:
    return [forward_row(client, *module, rounds) for module in modules(quick)]


def op_rows(client: tensord.Client, quick: bool, rounds: int) -> list[str]:
    x = client.tensor([1.0, -2.0, 3.0, -4.0])
    t = torch.tensor([1.0, -2.0, 3.0, -4.0])
    # (name, op, whether the per-op target applies: the view rows add tensord's own view)
    ops: list[tuple[str, Callable[[Any], Any], bool]] = [
        ("x + 1", lambda v: v + 1, True),
        ("x.add_(1)", lambda v: v.add_(1), True),
        ("torch.add(x, x)", lambda v: torch.add(v, v), True),
        ("x.sum()", lambda v: v.sum(), True),
        ("F.relu(x)", lambda v: F.relu(v), True),
        ("x[1:] alone (tensord's view)", lambda v: v[1:], False),
        ("x[1:] + 1, a new view each time", lambda v: v[1:] + 1, False),
    ]
    repeat = 2000 if quick else 20000
    rows = []
    for name, op, targeted in ops:
        mine, theirs = taking_turns(lambda op=op: op(x), lambda op=op: op(t), repeat, rounds)
        extra = [(ours - local) * 1e6 for ours, local in zip(mine, theirs, strict=True)]
        more = (min(mine) - min(theirs)) * 1e6
        verdict = ("ok" if more <= OP_TARGET_US else "MISS") if targeted else "(no target)"
        rows.append(
            f"| op {name} | {min(mine) * 1e6:.2f} us | {min(theirs) * 1e6:.2f} us | "
            f"+{more:.2f} us (rounds: median {statistics.median(extra):.2f}, "
            f"{min(extra):.2f}-{max(extra):.2f}) | <= {OP_TARGET_US} us {verdict} |"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, smaller modules")
    parser.add_argument("--rounds", type=int, default=None, help=f"rounds (default {ROUNDS})")
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else ROUNDS)
    process, address = start_server("--device", "cpu=4GiB")
    try:
        with tensord.connect(address) as client:
            print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {rounds} rounds")
            print("| what | tensord (pooled) | torch (local) | ratio / extra | target |")
            print("|---|---|---|---|---|")
            for row in forward_rows(client, args.quick, rounds) + op_rows(
                client, args.quick, rounds
            ):
                print(row, flush=True)
    finally:
        process.terminate()
        process.wait(timeout=30)


if __name__ == "__main__":
    main()
