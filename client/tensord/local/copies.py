"""Large same-host copies on several threads (np.copyto lets go of the GIL).

One thread reading shared pages, or faulting in a fresh destination, is far from the
memory's bandwidth: a copy of PARALLEL_MIN_BYTES or more is cut into parts of whole rows,
copied at once by the copy pool's threads and the caller's.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

# Same-host copies of at least this many bytes are split into COPY_WORKERS parts copied at
# once; below it a thread's start-up is not repaid.
PARALLEL_MIN_BYTES = 8 << 20


def split_along(shape: tuple[int, ...], parts: int) -> list[tuple[Any, ...]]:
    """Keys cutting an array of ``shape`` into at most ``parts`` disjoint pieces of whole
    rows of about equal size: along the outermost axis with at least ``parts`` entries, else
    along the longest (so a (1, N) or 1-D array still splits); one piece when none is > 1
    (``...``: the key of a view of the whole, even of a 0-d array)."""
    if not shape or parts <= 1 or max(shape) <= 1:
        return [(...,)]
    axis = next((i for i, n in enumerate(shape) if n >= parts), None)
    if axis is None:
        axis = max(range(len(shape)), key=lambda i: shape[i])
    count = min(parts, shape[axis])
    bounds = [shape[axis] * i // count for i in range(count + 1)]
    lead = (slice(None),) * axis
    return [(*lead, slice(start, stop)) for start, stop in itertools.pairwise(bounds)]


def copy_in_slices(out: np.ndarray, src: np.ndarray, slice_bytes: int) -> None:
    """np.copyto(out, src) (same shape) in slices of about ``slice_bytes`` each (whole rows
    along the axis :func:`split_along` picks)."""
    if out.nbytes <= slice_bytes:
        np.copyto(out, src)
        return
    for key in split_along(out.shape, -(-out.nbytes // slice_bytes)):
        np.copyto(out[key], src[key])


def copy_workers() -> int:
    """How many threads a large same-host copy runs on: the CPUs this process may use, at
    most 4 (past that one process's copies gain nothing against the memory's bandwidth)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, 4))


COPY_WORKERS = copy_workers()


class _CopyPool:
    """The threads that copy the other parts of a large copy while its caller copies the first.

    Made on first use; a forked child makes its own (the parent's threads do not exist in
    it); at interpreter exit concurrent.futures lets the queued parts finish (each is one
    bounded copy) and refuses new ones, which the caller then copies itself.  Pool threads
    only copy, never wait on a future: any number of user threads may copy at once.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._marker = threading.local()  # set in the pool's own threads

    def in_worker(self) -> bool:
        return getattr(self._marker, "worker", False)

    def executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    max(1, COPY_WORKERS - 1),
                    thread_name_prefix="tensord-copy",
                    initializer=self._mark_worker,
                )
            return self._executor

    def _mark_worker(self) -> None:
        self._marker.worker = True

    def forget_after_fork(self) -> None:
        """In a forked child: the parent's pool threads are gone, and its lock may be held."""
        self._lock = threading.Lock()
        self._executor = None


_copy_pool = _CopyPool()
os.register_at_fork(after_in_child=_copy_pool.forget_after_fork)


def _copy_part(dst: np.ndarray, src: np.ndarray, slice_bytes: int | None) -> None:
    if slice_bytes is None:
        np.copyto(dst, src)
    else:
        copy_in_slices(dst, src, slice_bytes)


class CopyPart:
    """One part of a large copy, copied at most once, by a pool thread unless the caller
    cancelled ``future`` first.  The future is the part's own, not the executor's:
    ThreadPoolExecutor.submit queues the work before it starts a thread, so a submit that
    raised may have queued it all the same, and that run must then copy nothing."""

    def __init__(self, dst: np.ndarray, src: np.ndarray, slice_bytes: int | None) -> None:
        self.dst, self.src, self.slice_bytes = dst, src, slice_bytes
        self.future: concurrent.futures.Future[None] = concurrent.futures.Future()

    def run(self) -> None:
        if not self.future.set_running_or_notify_cancel():
            return  # cancelled: the caller copied it, or gave the copy up
        try:
            _copy_part(self.dst, self.src, self.slice_bytes)
        except BaseException as exc:
            self.future.set_exception(exc)
        else:
            self.future.set_result(None)


def queue_part(part: CopyPart) -> bool:
    """Queue ``part`` on the copy pool; False: it never runs there (the caller copies it)."""
    try:
        _copy_pool.executor().submit(part.run)
    except RuntimeError:  # after (interpreter) shutdown, or a thread that failed to start
        # cancelled, a run queued all the same copies nothing; else a pool thread has it
        return not part.future.cancel()
    return True


def submit_part(
    dst: np.ndarray, src: np.ndarray, slice_bytes: int | None
) -> concurrent.futures.Future[None] | None:
    """One part of a large copy queued on the copy pool (None: the pool takes no more work,
    at interpreter exit; the caller copies it)."""
    part = CopyPart(dst, src, slice_bytes)
    return part.future if queue_part(part) else None


def parallel_copyto(dst: np.ndarray, src: np.ndarray, slice_bytes: int | None = None) -> None:
    """np.copyto(dst, src) (src broadcast to dst's shape, as np.copyto does), a copy of
    :data:`PARALLEL_MIN_BYTES` or more split into parts of whole rows copied at once on the
    copy pool's threads and this one; each part in slices of ``slice_bytes`` (None: one
    np.copyto).  Returns once every part is copied; raises the first part's error.

    Copies on one thread when ``dst`` and ``src`` may share memory (np.copyto's own
    handling of overlap must see the whole copy) or when called from a pool thread.
    """
    source = np.broadcast_to(src, dst.shape)
    keys = split_along(dst.shape, COPY_WORKERS)
    if (
        len(keys) < 2
        or dst.nbytes < PARALLEL_MIN_BYTES
        or _copy_pool.in_worker()
        or np.may_share_memory(dst, source)
    ):
        _copy_part(dst, source, slice_bytes)
        return
    futures: list[concurrent.futures.Future[None]] = []
    inline = [keys[0]]
    copied = False
    try:
        for key in keys[1:]:
            part = CopyPart(dst[key], source[key], slice_bytes)
            # listed before it is queued: an interrupt from here on still waits for it
            futures.append(part.future)
            if not queue_part(part):
                inline.append(key)
        for key in inline:
            _copy_part(dst[key], source[key], slice_bytes)
        copied = True
    finally:
        if not copied:  # raising: the parts no pool thread started never will
            for future in futures:
                future.cancel()
        # never return (or raise) while a part may still be writing: the caller may end
        # the export, and the server may then hand those bytes to another tensor
        wait_for_every_part(futures)
    for future in futures:
        if not future.cancelled():  # cancelled: copied inline
            future.result()  # the first part that failed raises


def wait_for_every_part(futures: list[concurrent.futures.Future[None]]) -> None:
    """concurrent.futures.wait(futures), waiting on through an interrupt (Ctrl-C's
    KeyboardInterrupt, a signal handler's error) and raising it once every part is done:
    each part is one bounded copy."""
    interrupted: BaseException | None = None
    while True:
        try:
            concurrent.futures.wait(futures)
        except BaseException as exc:  # raised below, after the parts
            interrupted = exc
            continue
        break
    if interrupted is not None:
        raise interrupted
