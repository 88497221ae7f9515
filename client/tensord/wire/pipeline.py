"""Pipelining's records and rules: what a queued op is, and how a queue goes in Batches.

With pipelining a view or an in-place write returns at once: the op is queued (its
result's id chosen here) and sent in order with the ops before it, in one Batch RPC,
once PIPELINE_BATCH wait, at the next call that waits for the server, or within the
release interval.  The server applies a Batch's ops in order and stops at the first that
fails; the connection raises that error, naming the op, at the next call that waits.
The queue itself is the connection's pipeline (:meth:`tensord.wire.batches.Pipeline.enqueue`);
this module holds its record and the pure rules for cutting it into Batches.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable
from typing import Any, NamedTuple

from tensord import schema as pb
from tensord.protocol import MAX_BATCH_OPS, MAX_BATCH_RESULTS, MAX_NAME_ITEMS

# Queued ops go to the server in one Batch once this many wait (or at the next call that
# waits for the server, or within the connection's release interval).
PIPELINE_BATCH = 256
# While the Batch before is still on the server, a full queue keeps filling up to this many
# ops before it is sent: one larger Batch (fewer RPCs per op for a busy server) instead of
# one at every PIPELINE_BATCH ops; one op short of what a Batch may hold, so that the
# flush's release rides in the same Batch.
PIPELINE_BATCH_MAX = MAX_BATCH_OPS - 1
# A full queue is sent by the connection's flusher thread, never by the thread that queues:
# a loop of views or queued deletes does not wait for the server while it keeps up.  Only a
# queue this long (the server far behind) makes its caller wait for the Batches before,
# which bounds what the client holds queued.
PIPELINE_QUEUE_MAX = 16 * PIPELINE_BATCH_MAX
# The names the queued delete_many ops of one Batch carry together: with its ops, view
# results and releases well within the items a request may hold (MAX_REQUEST_ITEMS)
MAX_BATCH_NAMES = 16 * MAX_NAME_ITEMS

# What a queued op that makes a new Storage hears once its Batch is answered.
CopyAnswered = Callable[[pb.TensorMeta], None]


class QueuedOp(NamedTuple):
    """One queued op, its message built, until its Batch is (the BatchOp is built then:
    building one per view cost more than the view)."""

    #: the RPC it stands for: "View", "Fill", "Copy", "SetItem" or "Reshape"
    method: str
    #: the op as its error names it ("fill_"); of a view, its ViewRequest field ("narrow")
    verb: str
    #: the handle of its input (the tensor written, or viewed)
    handle: str
    #: the request (tensord.wire.requests built it); of a view, its ViewRequest field's
    message: Any
    #: the handle ids this client chose for its results (a view's, a copy's)
    results: tuple[str, ...]
    #: of an op that makes a new Storage: told what the server issued, once answered
    copied: CopyAnswered | None


def batch_parts(
    queued: list[QueuedOp], released: list[str]
) -> list[tuple[list[QueuedOp], list[str]]]:
    """``queued`` then one release of ``released``, in Batches the server takes: at most
    MAX_BATCH_OPS ops, MAX_BATCH_RESULTS view results and MAX_BATCH_NAMES deleted names
    each (an op naming more goes alone, and the server refuses it); the release rides in
    the last."""
    parts: list[tuple[list[QueuedOp], list[str]]] = []
    part: list[QueuedOp] = []
    results = names = 0
    for op in queued:
        named = len(op.results)
        doomed = len(op.message.names) if op.method == "DeleteNames" else 0
        if part and (
            len(part) == MAX_BATCH_OPS
            or results + named > MAX_BATCH_RESULTS
            or names + doomed > MAX_BATCH_NAMES
        ):
            parts.append((part, []))
            part, results, names = [], 0, 0
        part.append(op)
        results += named
        names += doomed
    if released and len(part) == MAX_BATCH_OPS:  # the release is one more op
        parts.append((part, []))
        part = []
    parts.append((part, released))
    return parts


def describe(queued: list[QueuedOp], released: bool, index: int) -> str:
    """The op at ``index`` of a Batch, as its error names it ("fill_ of 3MrLn47C...")."""
    if 0 <= index < len(queued):
        op = queued[index]
        return f"{op.verb} of {op.handle[:8]}..."
    return "release" if released and index == len(queued) else "?"


def take(pending: collections.deque[str], limit: int) -> list[str]:
    """Up to ``limit`` ids from the left of ``pending`` (other threads may take too)."""
    batch: list[str] = []
    with contextlib.suppress(IndexError):
        while len(batch) < limit:
            batch.append(pending.popleft())
    return batch
