"""Each session's handle table has its own lock, for many clients: a Batch's run of
views and releases holds only its session's lock, so one session's run never waits for
another's, and settles its references with the registry once, at its end.  Ordered with
events, never timed: a bounded wait only turns a hang into a failure."""

from __future__ import annotations

import math
import sys
import threading
from typing import Any

import pytest
from conftest import run_serve, server_allocated
from tensord import schema as pb
from tensord.errors import NotFoundError

# A wait that only ever ends early: it bounds a test that would otherwise hang.
BOUND_S = 10.0


def _row_view(handle: str, row: int, result: str) -> pb.BatchOp:
    index = pb.Index(items=[pb.IndexItem(integer=row)])
    return pb.BatchOp(view=pb.ViewRequest(handle=handle, index=index), results=[result])


def _empty(stub: Any, n: int = 12) -> pb.TensorMeta:
    meta: pb.TensorMeta = stub.Empty(pb.EmptyRequest(shape=[n], dtype="float32"), metadata=stub.md)
    return meta


class _HeldRun:
    """A thread inside ``handle_run(session)`` (one view registered) until ``leave`` is set."""

    def __init__(self, daemon: Any, session: Any, base: str, result: str) -> None:
        self.inside, self.leave = threading.Event(), threading.Event()
        self.left = threading.Event()  # its lock let go (after leave, or its bound)
        self.errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, args=(daemon, session, base, result))
        self._thread.start()
        assert self.inside.wait(BOUND_S)

    def _run(self, daemon: Any, session: Any, base: str, result: str) -> None:
        from tensord_server.domain.ops.views import ViewOp, view_in_run

        try:
            with daemon.sessions.handle_run(session) as run:
                view_in_run(run, base, ViewOp("__getitem__", (0,)), [result])
                self.inside.set()
                self.leave.wait(BOUND_S)
        except BaseException as exc:  # seen by the test
            self.errors.append(exc)
            self.inside.set()
        finally:
            self.left.set()

    def finish(self) -> None:
        self.leave.set()
        self._thread.join(BOUND_S)
        assert not self._thread.is_alive() and not self.errors, self.errors


def _two_sessions(fresh_server: Any, open_session: Any) -> tuple[Any, Any, Any]:
    """The server's daemon, and sessions "a" and "b", each with one new tensor: (daemon,
    (a, its tensor), (b, its tensor))."""
    a, b = open_session(fresh_server.address, "a"), open_session(fresh_server.address, "b")
    return fresh_server.daemon, (a, _empty(a)), (b, _empty(b))


def test_a_batch_runs_while_another_sessions_run_holds_its_lock(
    fresh_server: Any, open_session: Any
) -> None:
    # the table lock was held across every session's run: 8 clients' Batches queued on it
    daemon, (a, x), (b, y) = _two_sessions(fresh_server, open_session)
    held = _HeldRun(daemon, daemon.sessions.get(b.session_id), y.handle, "B" * 22)
    answered = threading.Event()
    answers: list[Any] = []

    def batch_of_a() -> None:
        ops = [_row_view(x.handle, 1, "a" * 22), pb.BatchOp(release=pb.ReleaseRequest())]
        answers.append(a.Batch(pb.BatchRequest(ops=ops), metadata=a.md))
        answered.set()

    caller = threading.Thread(target=batch_of_a)
    caller.start()
    try:
        # answered while B's run still holds B's lock (it leaves only after this wait)
        assert answered.wait(BOUND_S), "session A's Batch waited for session B's run"
        assert not answers[0].failed and answers[0].applied == 2
        assert not held.leave.is_set()
    finally:
        held.finish()
        caller.join(BOUND_S)
    assert "a" * 22 in daemon.sessions.get(a.session_id).handles
    assert "B" * 22 in daemon.sessions.get(b.session_id).handles


def test_a_session_closed_during_its_run_leaks_nothing(
    fresh_server: Any, open_session: Any
) -> None:
    # close waits for the run (the session's lock), then releases what the run registered;
    # a run that comes after the close finds the session ended
    daemon = fresh_server.daemon
    before = server_allocated(fresh_server)
    a = open_session(fresh_server.address, "a")
    x = _empty(a, 1 << 16)
    session = daemon.sessions.get(a.session_id)
    held = _HeldRun(daemon, session, x.handle, "v" * 22)
    closer = threading.Thread(target=daemon.sessions.close, args=(session,))
    closer.start()
    held.finish()
    closer.join(BOUND_S)
    assert not closer.is_alive()
    assert session.ended and not session.handles
    assert server_allocated(fresh_server) == before  # the view's reference was dropped too
    with pytest.raises(NotFoundError), daemon.sessions.handle_run(session):
        pass


def test_renaming_handles_of_a_session_that_ended_meanwhile_is_not_found(
    fresh_server: Any, open_session: Any
) -> None:
    # a pipelined view's handle is issued, then renamed to the client's id: a close in
    # between released the issued handle; the rename says the session is gone (it raised
    # KeyError, an internal error, before)
    daemon = fresh_server.daemon
    a = open_session(fresh_server.address, "a")
    x = _empty(a)
    session = daemon.sessions.get(a.session_id)
    ref = daemon.sessions.lookup(session, x.handle)
    [issued] = daemon.sessions.register_all(session, [ref])
    daemon.sessions.close(session)
    with pytest.raises(NotFoundError, match="unknown session"):
        daemon.sessions.rename(session, [issued], ["r" * 22])
    assert not session.handles


def test_a_run_settles_its_references_exactly(fresh_server: Any, open_session: Any) -> None:
    # references counted during a run and applied at its end: the Storage's count is its
    # handles' after it, and it is freed when the run dropped its last handle
    daemon = fresh_server.daemon
    before = server_allocated(fresh_server)
    a = open_session(fresh_server.address, "a")
    x = _empty(a, 1 << 16)
    storage = daemon.sessions.get(a.session_id).handles[x.handle].storage
    views = [f"{i:022d}" for i in range(10)]
    ops = [_row_view(x.handle, i, h) for i, h in enumerate(views)]
    ops.append(pb.BatchOp(release=pb.ReleaseRequest(handles=views[:4])))
    response = a.Batch(pb.BatchRequest(ops=ops), metadata=a.md)
    assert not response.failed
    assert storage.refs == 1 + 6 and storage.holds == 0
    assert server_allocated(fresh_server) > before
    ops = [pb.BatchOp(release=pb.ReleaseRequest(handles=[x.handle, *views]))]
    response = a.Batch(pb.BatchRequest(ops=ops), metadata=a.md)
    assert not response.failed
    assert storage.refs == 0 and storage.freed
    assert server_allocated(fresh_server) == before


def test_serve_sets_the_gil_switch_interval_it_is_given() -> None:
    # each of a call's handoffs waits up to one interval behind another tenant's busy
    # worker: `tensord serve` runs its threads at 2 ms unless told otherwise
    from tensord_server.tools.serve import (
        DEFAULT_GIL_SWITCH_INTERVAL_S,
        apply_gil_switch_interval,
    )

    before = sys.getswitchinterval()
    try:
        assert DEFAULT_GIL_SWITCH_INTERVAL_S == 0.002
        assert apply_gil_switch_interval(DEFAULT_GIL_SWITCH_INTERVAL_S) is None
        assert sys.getswitchinterval() == pytest.approx(0.002)
        for wrong in (0.0, -1.0, math.nan, 2.0):
            problem = apply_gil_switch_interval(wrong)
            assert problem is not None and "--gil-switch-interval must be > 0" in problem
            assert sys.getswitchinterval() == pytest.approx(0.002)
    finally:
        sys.setswitchinterval(before)


@pytest.mark.slow
def test_serve_refuses_a_lease_a_busy_servers_heartbeats_could_miss() -> None:
    # a heartbeat waits up to one switch interval per busy thread: a lease of 0.1 s with
    # threads running 1 s each before a handoff would drop live sessions
    result = run_serve("--address", "127.0.0.1:0", "--lease", "0.1", "--gil-switch-interval", "1")
    assert result.returncode == 2
    assert "--lease (0.1 s) must be at least 10 times --gil-switch-interval (1 s)" in result.stderr
    from tensord_server.tools.serve import apply_gil_switch_interval

    before = sys.getswitchinterval()
    try:
        assert apply_gil_switch_interval(0.05, lease_s=0.49) is not None
        assert sys.getswitchinterval() == before  # refused: nothing set
        assert apply_gil_switch_interval(0.05, lease_s=0.5) is None
    finally:
        sys.setswitchinterval(before)


@pytest.mark.slow
def test_serve_refuses_a_gil_switch_interval_out_of_range() -> None:
    result = run_serve("--address", "127.0.0.1:0", "--gil-switch-interval", "0")
    assert result.returncode == 2
    assert "--gil-switch-interval must be > 0 and at most 1 seconds, got 0" in result.stderr


class _SignallingLock:
    """A session's lock that says when a thread has begun to wait for it."""

    def __init__(self, lock: Any) -> None:
        self._lock, self.waiting = lock, threading.Event()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._lock.acquire(False):
            return True
        self.waiting.set()
        return bool(self._lock.acquire(blocking, timeout))

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def test_a_call_waiting_for_its_own_sessions_run_holds_up_no_other_session(
    fresh_server: Any, open_session: Any
) -> None:
    # review11: every handle op took the table lock, then its session's: A's call waiting
    # for A's run held the table lock meanwhile, and every other session's calls (each
    # op's lookup, hold, new handle) queued behind A's run
    daemon, (a, x), (b, y) = _two_sessions(fresh_server, open_session)
    session_a = daemon.sessions.get(a.session_id)
    session_a.lock = signalling = _SignallingLock(session_a.lock)
    held = _HeldRun(daemon, session_a, x.handle, "v" * 22)
    waiter = threading.Thread(target=lambda: a.Empty(pb.EmptyRequest(shape=[2]), metadata=a.md))
    waiter.start()
    answered, run_still_held = threading.Event(), []

    def calls_of_b() -> None:
        _empty(b)
        daemon.sessions.lookup(daemon.sessions.get(b.session_id), y.handle)
        run_still_held.append(not held.left.is_set())
        answered.set()

    caller = threading.Thread(target=calls_of_b)
    try:
        assert signalling.waiting.wait(BOUND_S)  # A's Empty now waits for A's run
        caller.start()
        assert answered.wait(BOUND_S)
        assert run_still_held == [True], "session B's calls waited for session A's run"
    finally:
        held.finish()
        waiter.join(BOUND_S)
        caller.join(BOUND_S)
    assert not waiter.is_alive() and not caller.is_alive()
    assert daemon.sessions.handle_count(session_a) == 3  # x, the run's view, A's Empty
