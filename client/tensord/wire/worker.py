"""The main thread never runs gRPC code: its calls run on worker threads while it waits.

A signal handler's exception (KeyboardInterrupt from Ctrl-C, or whatever a handler of
the user's raises) is raised in the main thread between any two bytecodes, also inside
the `with condition:` blocks of gRPC's Python and Cython code: Condition.__enter__ and
__exit__ are Python functions, so an exception raised just after the lock was taken (or
just before it is released) leaves the channel's lock held for ever, and every later
call on that channel, the heartbeat's and the Batch flusher's included, waits for it for
ever.  So the main thread never runs gRPC code: it hands each call to a worker thread
and waits on a plain lock, whose acquire a signal interrupts cleanly.  The exception
then reaches the caller at once; a transfer in flight is cancelled (by another worker),
and any other call goes on to its end on its worker (a Batch is applied and its errors
kept for the next wait, as if it had been queued).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from tensord.wire.fork import FORK_GATE

M = TypeVar("M")

# the name of the threads that run the main thread's calls
WORKER_THREAD_NAME = "tensord-call"


class Job:
    """One piece of the main thread's gRPC work, run by a worker thread."""

    __slots__ = (
        "_finished",
        "_state",
        "abandoned",
        "calls",
        "done",
        "error",
        "orphaned",
        "result",
        "work",
    )

    def __init__(
        self, work: Callable[[], Any], orphaned: Callable[[Any], None] | None = None
    ) -> None:
        self.work = work
        self.done = threading.Lock()  # held until the work ended: the main thread waits on it
        self.done.acquire()
        self.result: Any = None
        self.error: BaseException | None = None
        self.calls: list[grpc.Future] = []  # streams to cancel if the main thread walks away
        self.abandoned = False
        # what to do with a result its caller never takes (it was interrupted): what the
        # call made on the server (an export, a handle) is released, else it stays pinned
        # until the session ends
        self.orphaned = orphaned
        self._state = threading.Lock()  # orders the work's end with the caller's walking away
        self._finished = False

    def run(self) -> None:
        try:
            self.result = self.work()
        except BaseException as exc:  # handed to the waiting thread, which raises it
            self.error = exc
        finally:
            self.work = None  # type: ignore[assignment]  # nothing kept alive by an idle job
            with self._state:
                self._finished = True
                walked_away = self.abandoned
            self.done.release()
        if walked_away:
            self._drop_result()

    def outcome(self) -> Any:
        self.orphaned = None  # the caller takes it (or the error)
        if self.error is not None:
            error, self.error = self.error, None  # no cycle through the traceback
            raise error
        return self.result

    def abandon(self) -> None:
        """The waiting thread was interrupted: cancel the streams started so far (a worker
        does it: cancelling takes gRPC's locks); :func:`track` cancels any started later.
        Work that ended already has its result dropped instead (nothing left to cancel)."""
        with self._state:
            self.abandoned = True
            finished = self._finished
        if finished:
            self._drop_result()
            return
        calls = list(self.calls)
        if calls:
            start_job(Job(functools.partial(_cancel_calls, calls)))

    def _drop_result(self) -> None:
        """(once the work ended and its caller walked away) Hand a result to ``orphaned``."""
        orphaned, self.orphaned = self.orphaned, None
        result, self.result = self.result, None
        if orphaned is not None and self.error is None:
            # only appends to a release queue; never let it end a worker thread
            with contextlib.suppress(Exception):
                orphaned(result)


def _cancel_calls(calls: list[grpc.Future]) -> None:
    with FORK_GATE.busy():  # like the watchdog's: a fork waits for a cancel under way
        for call in calls:
            call.cancel()  # a no-op on a finished call


class _Worker:
    """A thread that runs the main thread's gRPC work, one job at a time; idle between
    jobs (long-lived: a thread that starts or ends while the process forks is a hazard)."""

    def __init__(self) -> None:
        self.job: Job | None = None
        self._go = threading.Lock()
        self._go.acquire()
        threading.Thread(target=self._serve, name=WORKER_THREAD_NAME, daemon=True).start()

    def hand(self, job: Job) -> None:
        self.job = job
        self._go.release()

    def _serve(self) -> None:
        while True:
            self._go.acquire()
            job, self.job = self.job, None
            if job is not None:
                _CURRENT.job = job
                job.run()
                _CURRENT.job = None
            _IDLE_WORKERS.append(self)


_IDLE_WORKERS: collections.deque[_Worker] = collections.deque()
# a fork child has none of the parent's workers: no thread here runs them
os.register_at_fork(after_in_child=_IDLE_WORKERS.clear)
# the job a worker runs now, for track (a thread's own attribute: no lock)
_CURRENT = threading.local()


def start_job(job: Job) -> bool:
    """Hand ``job`` to an idle worker (a new one if none is); False if no thread can start."""
    try:
        worker = _IDLE_WORKERS.pop()
    except IndexError:
        try:
            worker = _Worker()
        except RuntimeError:  # "can't create new thread at interpreter shutdown"
            return False
    worker.hand(job)
    return True


def off_main_thread(work: Callable[[], M], orphaned: Callable[[M], None] | None = None) -> M:
    """Run ``work`` (which may enter gRPC); from the main thread, on a worker while it waits.

    Other threads run it themselves: signal handlers run only in the main thread.  So do
    nested calls (a worker is not the main thread) and calls during the interpreter's
    finalization (its daemon threads are stopped then).

    ``orphaned``: called with the result when the main thread was interrupted before it
    took it (to release what the call made on the server).
    """
    if threading.current_thread() is not threading.main_thread() or sys.is_finalizing():
        return work()
    job = Job(work, orphaned)
    try:
        if not start_job(job):
            return work()
        job.done.acquire()  # a signal interrupts this wait, and nothing else
        result: M = job.outcome()  # (an interrupt just before it leaves the result orphaned)
    except BaseException:
        job.abandon()
        raise
    return result


def track(call: grpc.Future) -> None:
    """A stream the main thread's job started: cancelled if the main thread is interrupted."""
    job: Job | None = getattr(_CURRENT, "job", None)
    if job is not None:
        job.calls.append(call)
        if job.abandoned:  # it walked away before this call was started
            call.cancel()
