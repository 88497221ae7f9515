"""The op pipeline's state: the queue, the Batch in flight, the releases, the flusher.

A :class:`Pipeline` holds what pipelining keeps between calls: the ops queued in issue
order (:mod:`tensord.wire.pipeline` defines their record and how a queue is cut into
Batches), the one Batch in flight, the handles dropped and not yet released, the first
error a Batch met, and the background thread that sends them.  It speaks no gRPC: the
connection hands it a callable that sends one Batch (answered at once, or left as a
future) and one that reads a sent Batch's answer as tensord's error, and it keeps the
order, the locks and the wakeups.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from tensord import errors
from tensord.wire import fork
from tensord.wire.fork import FORK_GATE
from tensord.wire.pipeline import (
    PIPELINE_BATCH,
    PIPELINE_BATCH_MAX,
    PIPELINE_QUEUE_MAX,
    CopyAnswered,
    QueuedOp,
    batch_parts,
    describe,
    take,
)
from tensord.wire.status import batch_error
from tensord.wire.worker import off_main_thread

# Dropped handles are sent in one Release per interval (or sooner once this many wait).
RELEASE_INTERVAL_S = 0.05
# the name of the thread that sends full queues and, each interval, what waits
FLUSHER_THREAD_NAME = "tensord-release"


class BatchFuture(Protocol):
    """A Batch sent: gRPC's future of it, or the call channel's answer in its shape."""

    def result(self) -> Any: ...

    def add_done_callback(self, callback: Callable[[Any], None]) -> None: ...


#: send one Batch of these ops then one release of these handles; True: its caller waits
#: for the answer at once (the call channel may take it), else it is left in flight
SendBatch = Callable[[list[QueuedOp], list[str], bool], BatchFuture]
#: a sent Batch's BatchResponse, or its failure as tensord's error (returned, not raised)
AnswerOf = Callable[[BatchFuture], Any]


class BatchInFlight(NamedTuple):
    """The Batch sent and not yet collected (one at a time: the server applies them in order)."""

    future: BatchFuture
    queued: list[QueuedOp]
    released: list[str]
    #: the copies' callbacks, in op order (BatchResponse.copies answers them)
    answered: list[CopyAnswered]
    #: whether an op in it writes bytes (any but a view): a read of the pool waits for it
    writes: bool


class Pipeline:
    """The queued ops, the Batch in flight, the pending releases and the flusher of one session.

    Invariants (the cheap ones asserted where a Batch is sent):

    - At most one Batch is in flight (``_inflight``), and only a thread holding
      ``_send_lock`` sends or collects one: the server applies Batches in queue order.
    - Every flush holds ``_send_lock`` from taking the queue until it has sent it (and
      collected it, when it waits), and counts itself in ``_sends`` before it takes
      anything: :meth:`_idle`'s lock-free look relies on both.
    - The main thread never acquires ``_send_lock``: a signal landing between its acquire
      and its release would keep it for good.  Every flush runs through
      :func:`~tensord.wire.worker.off_main_thread`, and ``_idle`` only looks.
    - ``_queue`` holds the ops in issue order; ``None`` is an elided view's place.
      ``_queued_writes`` counts its ops that write bytes (any but a "View"), which are
      never elided; ``_elidable`` maps the result id of each queued view that may still
      be elided to its place in ``_queue``.  All three change under ``_queue_lock`` only.
    - A flush takes the pending releases after the queue, under the same ``_send_lock``,
      and they ride last in its Batch: a handle is released after every op queued before
      its drop (the view that issues it among them).  Releases a failed Batch skipped go
      back to ``_pending`` (not after an RPC error: the next Batch would fail the same).
    - ``_async_error`` is the first error a Batch met since the last wait; the next
      :meth:`synchronize` raises it (the first explains the rest).
    - ``_answered_batch`` is the future of the last Batch answered (stored by its done
      callback, one atomic store); :meth:`_busy` compares it with ``_inflight``'s, never
      asking the future (its done() takes a Condition the main thread must not).
    - In a fork child (``inherited``) or after the session closed nothing is sent, and a
      dropped handle is not queued for release: the session is not this process's, or
      its end freed them all.
    """

    def __init__(
        self,
        *,
        send: SendBatch,
        answer: AnswerOf,
        tick: Callable[[], None],
        closed: threading.Event,
        pipelining: bool,
    ) -> None:
        self._send = send
        self._answer = answer
        # the connection's work of each interval, before the queue's own flush
        self._tick = tick
        self._closed = closed  # the connection's: set once its session ended
        #: queue views and in-place writes (fixed at connect); False: only the releases
        self.pipelining = pipelining
        # the process whose session this is; in any other (a fork child) it is inherited
        self._pid = fork.PROCESS_ID
        self._pending: collections.deque[str] = collections.deque()
        # pipelining: ops queued in issue order (with a word each for errors), the Batch in
        # flight (one at a time, so the server applies them in order) and the first error
        # of a Batch, raised at the next call that waits
        self._queue: list[QueuedOp | None] = []  # None: a dead view's place (elided)
        self._queued_writes = 0  # the ops in _queue that write bytes (not views)
        self._queue_lock = threading.Lock()
        # dead-view elision: each queued view that may be elided (one result, an op the
        # server cannot refuse on a live base) whose id no later op and no caller has read
        # yet -> its place in _queue; such a view dropped before its flush is never sent
        self._elidable: dict[str, int] = {}
        self._send_lock = threading.Lock()
        self._sends = 0  # flushes that took _send_lock (counted under it)
        # the Batch in flight: its future, its queued ops, its releases, the copies' callbacks
        self._inflight: BatchInFlight | None = None
        self._async_error: errors.TensordError | None = None
        # the last Batch answered (set by its done callback): _busy() compares it with _inflight's
        self._answered_batch: BatchFuture | None = None
        #: where a full queue's flush runs (None: in the thread that filled it); tensord.aio
        #: hands it to an executor so a view never blocks the event loop
        self.flush_scheduler: Callable[[Callable[[], None]], None] | None = None
        # released when the queue is full: the flusher sends it at once, not at its next
        # tick.  A plain Lock, not an Event: its release and acquire are one C call each,
        # which a signal in the main thread cannot interrupt halfway (an Event's set takes
        # a Condition in Python code, which an interrupt there would leave held)
        self._flush_wanted = threading.Lock()
        self._flush_wanted.acquire()
        self._flusher = threading.Thread(
            target=self._flush_forever, name=FLUSHER_THREAD_NAME, daemon=True
        )

    @property
    def inherited(self) -> bool:
        """True in a process forked from the one that connected: the session is the parent's."""
        return self._pid != fork.PROCESS_ID

    # ---- queueing ------------------------------------------------------------------

    def enqueue(
        self,
        method: str,
        verb: str,
        handle: str,
        message: Any,
        results: tuple[str, ...] = (),
        copied: CopyAnswered | None = None,
        elidable: bool = False,
    ) -> None:
        """Queue the op of RPC ``method`` (its request ``message``) on ``handle``, its result
        known here; sent in order in the next Batch, which builds its BatchOp
        (:func:`tensord.wire.requests.batch`).  ``verb`` names the op in its error; of a
        "View", it is the ViewRequest field ``message`` goes in.  ``copied``: for an op that makes a new Storage, called with what the
        server issued once the Batch is answered (the Storage's id and address are the server's).
        ``elidable``: a view of one result that the server cannot refuse while its input is
        live (no room beyond its input's, no new dims or strides): dropped before it is
        sent, and unused, it is removed from the queue with its release (:meth:`queue_release`)."""
        # not _check_open() again: every caller took ``handle`` through Tensor.handle, which did
        with self._queue_lock:
            queue = self._queue
            elidable_views = self._elidable
            if elidable_views:
                elidable_views.pop(handle, None)  # its input is used now: that view must go
            # tuple.__new__: NamedTuple's own __new__ is a Python call, and this runs per view
            queue.append(tuple.__new__(QueuedOp, (method, verb, handle, message, results, copied)))
            if method != "View":
                self._queued_writes += 1
            if elidable:
                elidable_views[results[0]] = len(queue) - 1
            queued = len(queue)
        if queued < PIPELINE_BATCH:
            return
        if self.flush_scheduler is not None:
            if queued >= PIPELINE_BATCH_MAX or not self._busy():
                self.flush_scheduler(lambda: self.flush(wait=False))
        elif queued >= PIPELINE_QUEUE_MAX:
            self.flush(wait=False)  # the server far behind: wait for the Batches before
        elif self._flush_wanted.locked():
            self.wake_flusher()  # the flusher sends it (once its Batch before is answered)

    @property
    def queued(self) -> int:
        """The places in the queue now (an elided view's among them)."""
        return len(self._queue)

    def handle_used(self, handle: str) -> None:
        """``handle`` was read (Tensor.handle: for another op, a call, a share, a name): a
        queued view that issues it must be sent, even once its tensor is dropped."""
        if handle in self._elidable:
            with self._queue_lock:
                self._elidable.pop(handle, None)

    def _busy(self) -> bool:
        """Whether a Batch is in flight and not answered yet (the server still works on it)."""
        inflight = self._inflight
        return inflight is not None and self._answered_batch is not inflight.future

    def _batch_answered(self, future: BatchFuture) -> None:
        # gRPC's done() takes the call's Condition, which a view (enqueue, on the main
        # thread) must not: a signal there could leave it held; one store is atomic
        self._answered_batch = future

    # ---- waiting -------------------------------------------------------------------

    def synchronize(self, releases: bool = True) -> None:
        """Send what is queued and wait until the server applied it; raise the first error
        a queued op met since the last wait (the error names that op)."""
        self.flush(wait=True, releases=releases)
        error, self._async_error = self._async_error, None
        if error is not None:
            raise error

    def settle(self) -> None:
        """:meth:`synchronize`, only when a write is queued or in flight (or an error kept):
        what a read of the pooled bytes needs first.  Views write no bytes: a queue of views
        is left to its Batch, so torch on a fresh view costs no round trip."""
        if self._async_error is not None or self._writes_pending():
            self.synchronize(releases=False)

    def drop_error(self) -> None:
        """Forget the error kept for the next wait (the session ends: nothing waits any more)."""
        self._async_error = None

    def _writes_pending(self) -> bool:
        inflight = self._inflight
        return self._queued_writes > 0 or (inflight is not None and inflight.writes)

    # ---- flushing ------------------------------------------------------------------

    def flush(self, wait: bool, releases: bool = True) -> None:
        """Send what is queued (and, with ``releases``, the releases pending) in order;
        ``wait``: until the server applied it (its error is kept for the next wait)."""
        if self._idle(releases):
            return  # nothing to send or wait for: no hop to the worker (a read's settle)
        # all of it off the main thread, its lock included: an interrupted caller leaves
        # the Batch to be sent and answered on the worker, in order with the next ones
        off_main_thread(functools.partial(self._flush_now, wait, releases))

    def _idle(self, releases: bool) -> bool:
        """Whether a flush has nothing to do: no op queued, no Batch in flight or being
        sent, and (with ``releases``) no release pending.  Every flush holds _send_lock
        from taking the queue until it has sent it (and answered, when it waits), so an op
        taken but not yet in flight is never missed: a flush under way, or one that began
        while this looked, answers False."""
        if not self._nothing_pending(releases):
            return False
        # never acquired here: this runs on the main thread, where a signal landing between
        # an acquire and its release would leave the lock held for good.  A flush that took
        # the lock after the first look has counted itself in _sends before taking anything.
        sends = self._sends
        if self._send_lock.locked():
            return False
        idle = self._nothing_pending(releases)
        return idle and not self._send_lock.locked() and self._sends == sends

    def _nothing_pending(self, releases: bool) -> bool:
        return not (self._queue or self._inflight is not None or (releases and self._pending))

    def _flush_now(self, wait: bool, releases: bool) -> None:
        with self._send_lock:
            self._sends += 1  # before anything is taken: what _idle looks for
            self._collect()  # at most one Batch in flight: the server applies them in order
            with self._queue_lock:
                queued = [op for op in self._queue if op is not None]
                assert self._queued_writes <= len(queued), "a write was elided"
                self._queue = []
                self._queued_writes = 0
                self._elidable.clear()  # sent now: past eliding
            # releases after the ops queued so far: a handle dropped was issued before it
            released = self._take_pending() if releases else []
            if not (queued or released) or self._closed.is_set() or self.inherited:
                return
            parts = batch_parts(queued, released)
            for index, (part, part_released) in enumerate(parts):
                if index and not self._collect():
                    # the part before failed: the ops after it are skipped, as they are
                    # after a failed op in one Batch; the releases wait for the next one
                    self._requeue_releases(released)
                    return
                # the last, when its caller waits for it at once: the call channel may take it
                self._send_batch(part, part_released, wait and index == len(parts) - 1)
            if wait:
                self._collect()

    def _send_batch(self, queued: list[QueuedOp], released: list[str], now: bool) -> None:
        """Send one Batch of ``queued`` then ``released`` (the caller holds _send_lock and
        collected the Batch before); ``now``: its caller waits for its answer at once, so the
        call channel may answer it (a Batch left in flight goes through gRPC)."""
        assert self._inflight is None, "one Batch in flight at a time"
        assert self._send_lock.locked(), "a Batch is sent under the send lock"
        answered = [op.copied for op in queued if op.copied is not None]
        future = self._send(queued, released, now)
        writes = any(op.method != "View" for op in queued)
        self._inflight = BatchInFlight(future, queued, released, answered, writes)
        future.add_done_callback(self._batch_answered)

    def _collect(self) -> bool:
        """Wait for the Batch in flight; keep its first error for the next wait.  Whether
        it was applied whole (True when none was in flight)."""
        if self._inflight is None:
            return True
        future, queued, released, answered, _ = self._inflight
        self._inflight = None
        response = self._answer(future)
        if isinstance(response, errors.TensordError):
            self._keep_error(response)
            return False
        for copied, meta in zip(answered, response.copies, strict=False):  # the applied ones
            copied(meta)
        if response.failed:
            index = response.failed_index
            ops = len(queued) + bool(released)  # the releases ride last, in one op
            if released and index < ops - 1:  # skipped
                self._requeue_releases(released)
            what = describe(queued, bool(released), index)
            skipped = ops - index - 1
            self._keep_error(
                batch_error(
                    response,
                    f"{response.error_message} (pipelined op {what} failed on the server; "
                    f"the {skipped} op(s) queued after it in the same batch were skipped)",
                )
            )
            return False
        return True

    def _keep_error(self, error: errors.TensordError) -> None:
        if self._async_error is None:  # the first error is the one that explains the rest
            self._async_error = error

    # ---- releases ------------------------------------------------------------------

    def queue_release(self, handle: str) -> None:
        """Called from finalizers: must never block or raise, so it only appends, or elides
        a dead view: when ``handle`` is a queued view's that nothing used (see enqueue),
        that view and its release are never sent.  It only tries the queue's lock (a
        finalizer may run in a thread holding it), and releases as usual when it is taken."""
        # after close the session has freed them all; an inherited session is not ours to free
        if self._closed.is_set() or self.inherited:
            return
        if handle in self._elidable and self._queue_lock.acquire(blocking=False):
            try:
                index = self._elidable.pop(handle, None)
                if index is not None:
                    queue = self._queue
                    if index == len(queue) - 1:
                        queue.pop()  # the commonest case: a view dropped at once
                    else:
                        queue[index] = None  # the places of the others stay as they are
                    return
            finally:
                self._queue_lock.release()
        self._pending.append(handle)

    @property
    def releases_pending(self) -> bool:
        return bool(self._pending)

    def take_releases(self, limit: int) -> list[str]:
        """Up to ``limit`` pending releases, oldest first, for a Release of their own."""
        return take(self._pending, limit)

    def return_releases(self, handles: list[str]) -> None:
        """Releases taken for a call that failed: first in line again, in their order."""
        self._pending.extendleft(reversed(handles))

    def releases_applied_first(self, limit: int) -> list[str]:
        """Pending releases a call may carry, applied before it: only when every op queued
        before is applied, so no carried handle is one a queued op has yet to issue."""
        if not self.pipelining:
            return take(self._pending, limit)
        with self._send_lock:
            self._sends += 1
            self._collect()  # the Batch in flight issued its handles
            with self._queue_lock:
                if any(op is not None for op in self._queue):
                    return []  # queued since: the flusher sends them in order
                return self._take_pending()

    def flush_releases(self) -> None:
        """Send what is queued and the releases pending, in order, until none is left; an
        op's error waits for the next synchronize."""
        self.flush(wait=True)
        while self._pending and not self.inherited and not self._closed.is_set():
            self.flush(wait=True)

    def _take_pending(self) -> list[str]:
        batch: list[str] = []
        with contextlib.suppress(IndexError):
            while len(batch) < PIPELINE_BATCH * 4 and self._pending:
                batch.append(self._pending.popleft())
        return batch

    def _requeue_releases(self, released: list[str]) -> None:
        """Handles whose release a Batch skipped (an op before it failed) go back to the
        queue: without this they kept their Storages until the session ended.  Not after
        an RPC error: the next Batch would fail too, and flush_releases loops while any wait."""
        if not self._closed.is_set():
            self._pending.extend(released)

    # ---- the flusher thread --------------------------------------------------------

    def start(self) -> None:
        """Start the flusher: each full queue at once, and every RELEASE_INTERVAL_S the
        connection's tick then what is queued."""
        self._flusher.start()

    def stop(self, timeout: float) -> None:
        """(after the session closed and the flusher was woken) Wait for the flusher, at most
        ``timeout``, and drop the releases pending: the session's end freed them."""
        self._flusher.join(timeout=timeout)
        self._pending.clear()

    def wake_flusher(self) -> None:
        """Wake the flusher now (a full queue, or the session's end)."""
        with contextlib.suppress(RuntimeError):  # woken already
            self._flush_wanted.release()

    def _flush_forever(self) -> None:
        ticked = time.monotonic()
        while not self._closed.is_set():
            full = self._flush_wanted.acquire(timeout=RELEASE_INTERVAL_S)
            if self._closed.is_set():
                return
            with contextlib.suppress(Exception), FORK_GATE.busy():  # never die loudly
                if full and self.pipelining:
                    # sent now, after the Batch in flight is answered (waited for here);
                    # what the caller queued meanwhile is sent at once if it is full too
                    self.flush(wait=False)
                    if len(self._queue) >= PIPELINE_BATCH:
                        self.wake_flusher()
                    if time.monotonic() - ticked < RELEASE_INTERVAL_S:
                        continue  # else the tick's work too: a queue kept full never starves it
                ticked = time.monotonic()
                self._tick()
                # queued ops and releases in one ordered Batch: a release sent alone could
                # overtake the queued view that issues its handle
                if self.pipelining and not self._busy():  # else it goes in one Batch after it
                    self.flush(wait=False)
