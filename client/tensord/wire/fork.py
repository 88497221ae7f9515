"""Fork safety: no SDK thread is inside gRPC, and none is starting or ending, at a fork.

os.fork() while another thread is inside gRPC, or while a thread is starting or ending,
copies that half-done state into the child: a child could die of SIGSEGV in Python's
own threading._after_fork, and with GRPC_ENABLE_FORK_SUPPORT=1 the parent could hang in
gRPC's fork handlers.  So a fork waits, a bounded time, until no SDK thread is inside
gRPC (and holds them out of it until the fork is done), and until the short-lived
Python threads gRPC starts for the SDK's own calls have ended.

A forked child inherits every Connection (its session id, its channel) but none of its
threads; what the child may still do with one is the connection's own rule
(:attr:`tensord.wire.connection.Connection.inherited`).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any, Protocol

# How long a fork waits for calls in flight on SDK threads: a beat or a release has a
# deadline of a few seconds (a connection's close timeout), so this is reached only with
# a hung server.
FORK_QUIESCE_S = 5.0
# How long it waits for gRPC's per-call Python threads (an upload's, connect()'s
# connectivity poll, which checks every 0.2 s): they end in milliseconds once their call
# is done; one that lives on belongs to a call still running, not worth waiting for.
FORK_GRPC_THREADS_S = 0.5


class ForkGate:
    """Keeps the SDK's background threads out of gRPC while the process forks."""

    def __init__(self) -> None:
        self._changed = threading.Condition(threading.Lock())
        self._busy = 0  # background threads inside gRPC now; _changed
        self._forking = False  # a fork is under way; _changed

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Around a background thread's gRPC work: waits while a fork is under way."""
        with self._changed:
            while self._forking:
                self._changed.wait()
            self._busy += 1
        try:
            yield
        finally:
            with self._changed:
                self._busy -= 1
                self._changed.notify_all()

    def before_fork(self) -> None:
        """Wait for the background calls in flight, and keep the lock through the fork:
        no thread can then be halfway through the gate when the child is made."""
        self._changed.acquire()
        self._forking = True
        deadline = time.monotonic() + FORK_QUIESCE_S
        while self._busy and (left := deadline - time.monotonic()) > 0:
            self._changed.wait(left)

    def after_fork_in_parent(self) -> None:
        self._forking = False
        self._changed.notify_all()
        self._changed.release()

    def after_fork_in_child(self) -> None:
        """A fresh gate: the parent's is locked (by the forking thread) and counts the
        parent's threads, none of which exists here."""
        self._changed = threading.Condition(threading.Lock())
        self._busy = 0
        self._forking = False


#: this process's id, kept by the fork hook: every pipelined view asks whether its
#: connection was inherited, and os.getpid() is a system call each time
PROCESS_ID = os.getpid()


def _after_fork_in_child() -> None:
    global PROCESS_ID
    PROCESS_ID = os.getpid()


os.register_at_fork(after_in_child=_after_fork_in_child)

#: the one gate of this process (reset in place in a child, so importers keep it)
FORK_GATE = ForkGate()


class Forked(Protocol):
    """What the fork hook asks of a live connection."""

    @property
    def inherited(self) -> bool: ...


#: every Connection of this process that may be inside gRPC (weakly held)
LIVE_CONNECTIONS: weakref.WeakSet[Forked] = weakref.WeakSet()


def is_grpc_python_thread(thread: threading.Thread) -> bool:
    """Whether ``thread`` is one of gRPC's own Python threads (channel spin, request
    consumer, connectivity poll): they all run a target made by grpc._cython.cygrpc, and
    Thread keeps no public record of it."""
    target = getattr(thread, "_target", None)
    return getattr(target, "__module__", "") == "grpc._cython.cygrpc"


def join_grpc_threads(timeout: float) -> None:
    """Wait, at most ``timeout`` in all, for gRPC's Python threads to end."""
    deadline = time.monotonic() + timeout
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and is_grpc_python_thread(thread):
            thread.join(max(deadline - time.monotonic(), 0.0))


def _grpc_fork_state() -> Any | None:
    """gRPC's own record of the threads its fork support parks (GRPC_ENABLE_FORK_SUPPORT=1),
    or None without that support or in a gRPC that keeps no such record."""
    try:
        from grpc._cython import cygrpc
    except ImportError:
        return None
    if not cygrpc.is_fork_support_enabled():
        return None
    return getattr(cygrpc, "_fork_state", None)


def await_grpc_threads_parked(timeout: float) -> None:
    """Wait, at most ``timeout``, until gRPC's fork support counts none of its threads active.

    gRPC's handler counts its threads once, before this module's, and the count can be
    wrong: a thread the previous fork parked may not have woken yet when the next fork
    begins (multiprocessing starts its workers back to back), so it is counted as parked,
    then wakes and goes back into gRPC core.  Core then skips its own fork handlers
    ("Other threads are currently calling into gRPC"), and the child's gRPC can hang.
    Such a thread parks again within a second (gRPC's threads check for a fork that often).
    """
    state = _grpc_fork_state()
    if state is None or not state.fork_in_progress:  # gRPC's handler has not run: it counts
        return
    state.active_thread_count.await_zero_threads(timeout)


def _quiesce_before_fork() -> None:
    FORK_GATE.before_fork()
    if any(not connection.inherited for connection in list(LIVE_CONNECTIONS)):
        join_grpc_threads(FORK_GRPC_THREADS_S)


def _recount_grpc_threads_before_fork() -> None:
    if any(not connection.inherited for connection in list(LIVE_CONNECTIONS)):
        await_grpc_threads_parked(FORK_QUIESCE_S)


class _GateHooks:
    """The gate's fork hooks, installed once a gRPC channel exists.

    Python runs the ``before`` hooks of a fork last-installed first, and gRPC installs its
    own when the process makes its first channel: the gate's, installed after that, run
    before gRPC's.  So the SDK's threads leave gRPC while gRPC's threads still run (what
    a call of theirs waits for may need gRPC's threads), gRPC parks its threads after,
    and last the count of them is checked again (installed with this module, before any
    channel: :func:`await_grpc_threads_parked`).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._installed = False

    def install(self) -> None:
        """Install the hooks (the first call only); call it after making a gRPC channel."""
        with self._lock:
            if self._installed:
                return
            os.register_at_fork(
                before=_quiesce_before_fork,
                after_in_parent=FORK_GATE.after_fork_in_parent,
                after_in_child=FORK_GATE.after_fork_in_child,
            )
            self._installed = True

    def after_fork_in_child(self) -> None:
        """A fresh lock: the parent's may have been held by a thread the child lacks."""
        self._lock = threading.Lock()


#: installs the gate's fork hooks once a channel exists (tensord.wire.connection does)
GATE_HOOKS = _GateHooks()

os.register_at_fork(
    before=_recount_grpc_threads_before_fork, after_in_child=GATE_HOOKS.after_fork_in_child
)
