"""Ctrl-C during a call: the KeyboardInterrupt reaches the caller, and the client keeps working.

A signal handler's exception is raised in the main thread between any two bytecodes; when
it landed inside gRPC's Python or Cython code (a `with condition:` half entered or half
left), the channel's lock stayed held and the next call on that connection, the Batch
pipeline and the heartbeat hung for ever, past call_timeout (3 runs in 6 of the new-user
reproducer).  Each case runs a client in a fresh interpreter that interrupts itself many
times at random moments in one kind of call, then checks that the next calls answer at
once and that its heartbeats kept the session (its lease is short); a hang there shows as
every thread's stack (faulthandler) and a non-zero exit, within a bound.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from typing import Any

import numpy as np
import pytest

# the server's lease: a client whose heartbeat is stuck loses its session in lease + grace
LEASE_S = 0.4
# interrupts per case: 25 hung each of the four gRPC cases before the fix (the first hang
# came within a few); the aio client, whose calls run on executor threads, never hung
ROUNDS = {"download": 20, "upload": 20, "unary": 20, "batch": 20, "aio": 8}
# one interrupted call and the check after it take ~0.05 s; far above what a run needs
HANG_S = 40.0

CHILD = textwrap.dedent(
    """
    import asyncio, faulthandler, os, random, signal, sys, threading, time
    import numpy as np
    import tensord
    import tensord.aio

    address, mode, rounds, lease = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    faulthandler.dump_traceback_later(float(sys.argv[5]), exit=True)  # a hang: stacks, exit 1
    # SIGALRM raises KeyboardInterrupt as Ctrl-C does, at a moment the itimer picks
    signal.signal(signal.SIGALRM, signal.default_int_handler)
    random.seed(f"{mode}-interrupts")
    NBYTES = 16 << 20
    MAX_WORKERS = 8  # 2-3 seen: the abandoned call's, a cancel's, the next call's

    def interrupt_soon(limit):
        signal.setitimer(signal.ITIMER_REAL, random.uniform(0.0005, limit))

    def interrupted(work, limit=0.03):
        interrupt_soon(limit)
        try:
            for _ in range(200):  # until the interrupt (each call takes ms)
                work()
        except KeyboardInterrupt:
            return True
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        return False

    def answers_at_once(client, x, timeout):
        started = time.monotonic()
        client.synchronize()
        assert x[:2].tolist() == [0, 0], x[:2].tolist()
        assert client.zeros(3).tolist() == [0.0, 0.0, 0.0]
        took = time.monotonic() - started
        assert took < timeout, f"the calls after an interrupt took {took:.2f} s"

    if mode == "aio":
        # asyncio.run turns SIGINT into cancelling its task; the calls run on executor threads
        async def connect():
            c = await tensord.aio.connect(address, local=False, call_timeout=5)
            return c, await c.zeros(NBYTES, dtype=tensord.uint8)

        client_async, x_async = asyncio.run(connect())
        client, x = client_async.sync_client, x_async.sync_tensor

        async def downloads():
            for _ in range(200):
                await x_async.numpy()

        signal.signal(signal.SIGALRM, lambda *_: os.kill(os.getpid(), signal.SIGINT))
        hits = 0
        for _ in range(rounds):
            interrupt_soon(0.03)
            try:
                asyncio.run(downloads())
            except KeyboardInterrupt:
                hits += 1
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            answers_at_once(client, x, 4.0)
    else:
        client = tensord.connect(address, local=False, call_timeout=5)
        x = client.zeros(NBYTES, dtype=tensord.uint8)
        data = np.zeros(NBYTES, dtype=np.uint8)
        small = client.zeros(64)

        def batch():  # queued writes, sent in one Batch, and the wait for its answer
            for i in range(8):
                small[i].fill_(1)
            client.synchronize()

        work = {
            "download": x.numpy,
            "upload": lambda: client.tensor(data),
            "unary": lambda: small.clone(),
            "batch": batch,
        }[mode]
        hits = 0
        for _ in range(rounds):
            hits += interrupted(work)
            answers_at_once(client, x, 4.0)
    assert hits >= rounds // 2, f"only {hits} of {rounds} calls were interrupted"
    # an interrupted transfer is cancelled, so its worker is soon idle again: no thread
    # piles up per interrupt
    workers = [t for t in threading.enumerate() if t.name == "tensord-call"]
    print("workers", len(workers))
    assert len(workers) <= MAX_WORKERS, f"{len(workers)} worker threads after {hits} interrupts"
    session = client.session_id
    time.sleep(3 * lease)  # past the lease: only heartbeats keep the session
    answers_at_once(client, x, 4.0)
    assert client.session_id == session, "the heartbeat stopped: the session lapsed"
    client.close()
    print("ok", hits)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(ROUNDS))
def test_an_interrupted_call_leaves_the_client_working(make_server: Any, mode: str) -> None:
    server = make_server(lease=LEASE_S)
    arguments = (server.address, mode, str(ROUNDS[mode]), str(LEASE_S), str(HANG_S))
    run = subprocess.run(
        [sys.executable, "-c", CHILD, *arguments],
        capture_output=True,
        text=True,
        timeout=HANG_S + 30,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr[-6000:]
    assert "ok " in run.stdout, run.stdout + run.stderr[-6000:]


class _InterruptedOnAcquire:
    """A lock whose main-thread acquire succeeds and then raises KeyboardInterrupt, as a
    signal landing right after the acquire returns does."""

    def __init__(self, real: Any) -> None:
        self.real = real

    def acquire(self, *args: Any, **kwargs: Any) -> bool:
        got = self.real.acquire(*args, **kwargs)
        if got and threading.current_thread() is threading.main_thread():
            raise KeyboardInterrupt
        return bool(got)

    def release(self) -> None:
        self.real.release()

    def locked(self) -> bool:
        return bool(self.real.locked())

    def __enter__(self) -> None:
        self.real.acquire()

    def __exit__(self, *exc: object) -> None:
        self.real.release()


def test_a_main_thread_flush_with_nothing_to_send_takes_no_lock_a_signal_could_keep(
    client: Any,
) -> None:
    """The main thread's look at whether a flush has anything to do never acquires the
    send lock: a signal between that acquire and its release kept it for good, and every
    later flush, call and close hung."""
    x = client.tensor(np.arange(6, dtype=np.float32))
    client.synchronize()
    pipeline = client._conn.pipeline
    real = pipeline._send_lock
    pipeline._send_lock = _InterruptedOnAcquire(real)
    interrupted = False
    try:
        client.synchronize()  # nothing queued: answered on the main thread
    except KeyboardInterrupt:
        interrupted = True
    finally:
        pipeline._send_lock = real
    leaked = real.locked()
    if leaked:
        real.release()  # so the client can close
    assert not interrupted and not leaked
    y = x + 1  # a queued op, then a flush on the worker: they need the lock
    np.testing.assert_array_equal(y.numpy(), np.arange(6, dtype=np.float32) + 1)
