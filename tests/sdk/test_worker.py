"""The main thread's worker threads: a signal's exception never loses one.

``off_main_thread`` takes an idle worker and hands it the job; a KeyboardInterrupt raised
between the two (a signal strikes the main thread between any two bytecodes) used to
leave that worker blocked for ever outside the idle ones, a thread lost per interrupt.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from tensord.wire import worker

SETTLE_S = 5.0


def settled(condition: Callable[[], bool]) -> bool:
    """Whether ``condition()`` holds within SETTLE_S (the worker goes idle on its thread)."""
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.005)
    return condition()


def worker_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == worker.WORKER_THREAD_NAME)


def idle_once_each() -> bool:
    idle = list(worker._IDLE_WORKERS)
    return len({id(w) for w in idle}) == len(idle)


@pytest.fixture
def one_idle_worker() -> int:
    assert worker.off_main_thread(lambda: 0) == 0  # at least one worker, idle after it
    assert settled(lambda: len(worker._IDLE_WORKERS) >= 1)
    return len(worker._IDLE_WORKERS)


def test_an_interrupt_before_the_hand_puts_the_worker_back(
    monkeypatch: pytest.MonkeyPatch, one_idle_worker: int
) -> None:
    real_hand = worker._Worker.hand
    struck: list[Any] = []

    def interrupted_before(self: Any, job: Any) -> None:
        if job is not None and not struck:
            struck.append(job)
            raise KeyboardInterrupt  # the signal, before the job was handed
        real_hand(self, job)

    monkeypatch.setattr(worker._Worker, "hand", interrupted_before)
    threads = worker_threads()
    ran: list[int] = []
    with pytest.raises(KeyboardInterrupt):
        worker.off_main_thread(lambda: ran.append(1))
    assert settled(lambda: len(worker._IDLE_WORKERS) == one_idle_worker), (
        f"{len(worker._IDLE_WORKERS)} idle workers, {one_idle_worker} before the interrupt"
    )
    assert ran == []  # never handed: never run
    assert worker.off_main_thread(lambda: 2) == 2
    assert worker_threads() == threads  # the next call took the same worker
    assert idle_once_each()


def test_an_interrupt_after_the_hand_lets_the_job_run_and_the_worker_idle_once(
    monkeypatch: pytest.MonkeyPatch, one_idle_worker: int
) -> None:
    real_hand = worker._Worker.hand
    struck: list[Any] = []

    def interrupted_after(self: Any, job: Any) -> None:
        real_hand(self, job)
        if job is not None and not struck:
            struck.append(job)
            raise KeyboardInterrupt  # the signal, once the job was handed

    monkeypatch.setattr(worker._Worker, "hand", interrupted_after)
    ran = threading.Event()
    with pytest.raises(KeyboardInterrupt):
        worker.off_main_thread(ran.set)
    assert ran.wait(SETTLE_S)
    assert settled(lambda: len(worker._IDLE_WORKERS) == one_idle_worker)
    assert idle_once_each()
    assert worker.off_main_thread(lambda: 3) == 3
