"""Where a call's work runs: a bounded thread pool shared fairly, and a budget of request bytes.

The asyncio server (:mod:`tensord_server.rpc.grpc_server`) hands each call's synchronous work
(decode, domain call, encode) to a :class:`FairExecutor`, whose threads are handed out by
:class:`~tensord_server.domain.fairness.FairQueue` (a key's calls take turns with every
other key's).  A call that waits for a worker, for its request or for its reader holds no
thread, only a coroutine.  Only a call whose work is a few lookups bounded by its small
request runs on the event loop itself, and only while no worker is busy or awaited.

:class:`RequestBudget` bounds the request bytes the server holds: a call reserves its
request's bytes once read, until it ends, per key and in all, so a flood of large requests
is refused (RESOURCE_EXHAUSTED) instead of queued (how many a key reads at once is bounded
in :mod:`tensord_server.rpc.calls`).

Both are used from the event loop's thread only (no locks); the pool's threads only run
the functions handed to them.  :func:`within` bounds any wait on the loop (a request's
read, a reader, a call channel's frame) by one timer.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import Awaitable, Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from tensord.errors import DeadlineExceededError, ResourceExhaustedError

from tensord_server.domain.fairness import FairQueue

T = TypeVar("T")

# Request bytes one key (tenant or connection) may have reserved at once: sixteen of the
# largest requests (a Batch or an upload chunk) or a few hundred control calls.
DEFAULT_KEY_REQUEST_BYTES = 256 << 20
# Request bytes all callers together may have reserved at once.
DEFAULT_TOTAL_REQUEST_BYTES = 1 << 30


class FairExecutor:
    """Run synchronous functions on ``workers`` threads, keys taking turns (FairQueue)."""

    def __init__(self, workers: int, thread_name_prefix: str, **queue_limits: Any) -> None:
        self.queue: FairQueue[_Job] = FairQueue(workers, **queue_limits)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0  # when _timer fires (time.monotonic, FairQueue's clock)
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._work, name=f"{thread_name_prefix}_{i}", daemon=True)
            for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    async def run(
        self,
        key: Hashable,
        fn: Callable[[], T],
        describe: str = "this caller",
        inline: bool = False,
    ) -> T:
        """``fn()`` on a worker when ``key``'s turn comes; refused at once over the queue's
        limits.  A caller cancelled while waiting gives its turn back; one cancelled while
        running lets ``fn`` finish (its work is bounded) and drops the result.

        ``inline``: ``fn`` is small (bounded well below a millisecond); when no call runs or
        waits it runs at once on the calling (event loop) thread, its turn and its CPU time
        counted as a worker's would be."""
        loop = asyncio.get_running_loop()
        job = _Job(key, fn, loop.create_future(), loop)
        self.queue.submit(key, job, describe)
        if inline and self.queue.running == 0 and self.queue.queued == 1:
            picked = self.queue.next()
            if picked is not None and picked[1] is job:
                return self._run_here(job)  # type: ignore[no-any-return]
            if picked is not None:
                self._jobs.put(picked[1])
        self._dispatch()
        try:
            return await job.result  # type: ignore[no-any-return]
        except asyncio.CancelledError:
            self.queue.drop_waiting(key, job)  # not started: its turn goes back
            raise

    @property
    def idle(self) -> bool:
        """No call runs or waits: a ``run(..., inline=True)`` now runs on the loop."""
        return self.queue.running == 0 and self.queue.queued == 0

    def _run_here(self, job: _Job) -> Any:
        started = time.thread_time()
        try:
            return job.fn()
        finally:
            self.queue.finished(job.key, time.thread_time() - started)
            self._dispatch()

    def _dispatch(self) -> None:
        while (picked := self.queue.next()) is not None:
            self._jobs.put(picked[1])
        wake = self.queue.wake_at()  # a paced key's next call: dispatch again then
        if wake is not None and (self._timer is None or wake < self._timer_at):
            if self._timer is not None:
                self._timer.cancel()
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(max(wake - time.monotonic(), 0.0), self._woken)
            self._timer_at = wake

    def _woken(self) -> None:
        self._timer = None
        self._dispatch()

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            started = time.thread_time()
            try:
                outcome: tuple[Any, BaseException | None] = (job.fn(), None)
            except BaseException as exc:
                outcome = (None, exc)
            busy = time.thread_time() - started
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
                job.loop.call_soon_threadsafe(self._settle, job, busy, *outcome)
            del job, outcome  # hold no request's objects while idle

    def _settle(self, job: _Job, busy: float, value: Any, error: BaseException | None) -> None:
        self.queue.finished(job.key, busy)
        if not job.result.done():  # its caller may have gone (cancelled)
            if error is not None:
                job.result.set_exception(error)
            else:
                job.result.set_result(value)
        self._dispatch()

    def shutdown(self) -> None:
        """Let the running calls finish, then end the threads (waiting calls never start)."""
        for _ in self._threads:
            self._jobs.put(None)
        for thread in self._threads:
            thread.join()


@dataclass(eq=False, slots=True)
class _Job:
    key: Hashable
    fn: Callable[[], Any]
    result: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop


class RequestBudget:
    """Request bytes reserved per key and in all, from before a read to the call's end."""

    def __init__(
        self,
        per_key: int = DEFAULT_KEY_REQUEST_BYTES,
        total: int = DEFAULT_TOTAL_REQUEST_BYTES,
    ) -> None:
        self.per_key = per_key
        self.total = total
        self.reserved = 0
        self._by_key: dict[Hashable, int] = {}

    @contextlib.contextmanager
    def reserve(self, key: Hashable, nbytes: int, describe: str = "this caller") -> Iterator[None]:
        held = self._by_key.get(key, 0)
        if held + nbytes > self.per_key:
            raise ResourceExhaustedError(
                f"{describe} has {held} bytes of requests in progress; another of up to "
                f"{nbytes} would pass the limit ({self.per_key}): wait for answers first"
            )
        if self.reserved + nbytes > self.total:
            raise ResourceExhaustedError(
                f"the server holds {self.reserved} bytes of requests in progress; another of "
                f"up to {nbytes} would pass the limit ({self.total}): retry later"
            )
        if not nbytes:  # an empty request holds nothing (and leaves no zero entry behind)
            yield
            return
        self._by_key[key] = held + nbytes
        self.reserved += nbytes
        try:
            yield
        finally:
            self.reserved -= nbytes
            left = self._by_key[key] - nbytes
            if left:
                self._by_key[key] = left
            else:
                del self._by_key[key]

    def reserved_by(self, key: Hashable) -> int:
        return self._by_key.get(key, 0)


async def within(awaitable: Awaitable[T], timeout: float, expired: str) -> T:
    """``await awaitable``, or DeadlineExceededError(``expired``) after ``timeout`` seconds.

    One timer on the loop (asyncio.wait_for makes a task per wait: this is every call's
    read); at the deadline it cancels the waiting task, which turns into the error."""
    task = asyncio.current_task()
    assert task is not None
    fired = []

    def expire() -> None:
        fired.append(True)
        task.cancel()

    timer = asyncio.get_running_loop().call_later(timeout, expire)
    try:
        return await awaitable
    except asyncio.CancelledError:
        if not fired:
            raise
        task.uncancel()
        raise DeadlineExceededError(expired) from None
    finally:
        timer.cancel()
