"""The op pipeline on its own (tensord.wire.batches.Pipeline): a recording sender stands for
the connection, so its order, elision and error rules are checked with no server and no gRPC."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from tensord import errors
from tensord import schema as pb
from tensord.wire import pipeline as wire_pipeline
from tensord.wire import requests
from tensord.wire.batches import Pipeline
from tensord.wire.pipeline import QueuedOp


class Answered:
    """A Batch answered at once, in the shape of the future the connection hands back."""

    def __init__(self, response: pb.BatchResponse) -> None:
        self.response = response

    def result(self) -> pb.BatchResponse:
        return self.response

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        callback(self)


class Recorder:
    """The connection's side: each Batch sent (its ops' verbs, its releases, whether its
    caller waits) and each answer read, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.responses: list[pb.BatchResponse] = []

    def send(self, queued: list[QueuedOp], released: list[str], now: bool) -> Answered:
        self.events.append(("sent", [op.verb for op in queued], list(released), now))
        answer = self.responses.pop(0) if self.responses else pb.BatchResponse()
        return Answered(answer)

    def answer(self, future: Any) -> Any:
        self.events.append(("answered",))
        return future.result()

    def sent(self) -> list[tuple[Any, ...]]:
        return [event[1:] for event in self.events if event[0] == "sent"]


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def closed() -> threading.Event:
    return threading.Event()


@pytest.fixture
def pipe(recorder: Recorder, closed: threading.Event) -> Pipeline:
    # the flusher is never started: every Batch here is one this test's thread sends
    return Pipeline(
        send=recorder.send,
        answer=recorder.answer,
        tick=lambda: None,
        closed=closed,
        pipelining=True,
    )


def test_releases_ride_after_every_op_queued_before_them(
    pipe: Pipeline, recorder: Recorder
) -> None:
    pipe.enqueue("Fill", "fill_", "h-base", None)
    pipe.queue_release("h-old")  # dropped between the two ops: released after both
    pipe.enqueue("View", "narrow", "h-base", None, ("h-view",))
    pipe.synchronize()
    assert recorder.sent() == [(["fill_", "narrow"], ["h-old"], True)]
    assert pipe.queued == 0 and not pipe.releases_pending


def test_one_batch_in_flight_collected_before_the_next_is_sent(
    pipe: Pipeline, recorder: Recorder
) -> None:
    pipe.enqueue("Fill", "fill_", "h-a", None)
    pipe.flush(wait=False)
    pipe.enqueue("Fill", "fill_", "h-b", None)
    pipe.flush(wait=False)
    assert [event[0] for event in recorder.events] == ["sent", "answered", "sent"]
    assert [event[3] for event in recorder.events if event[0] == "sent"] == [False, False]
    pipe.settle()  # a write in flight: a read of the pool waits for it
    assert [event[0] for event in recorder.events] == ["sent", "answered", "sent", "answered"]
    pipe.settle()  # nothing left: no wait
    assert len(recorder.events) == 4


def test_a_dropped_unused_view_is_elided_and_a_used_one_is_sent(
    pipe: Pipeline, recorder: Recorder
) -> None:
    pipe.enqueue("View", "narrow", "h-base", None, ("h-dead",), None, True)
    pipe.queue_release("h-dead")
    assert pipe.queued == 0 and not pipe.releases_pending
    pipe.synchronize()
    assert recorder.sent() == []  # nothing to send: not even a Batch
    pipe.enqueue("View", "narrow", "h-base", None, ("h-used",), None, True)
    pipe.handle_used("h-used")  # its id was read: it must reach the server
    pipe.queue_release("h-used")
    pipe.synchronize()
    assert recorder.sent() == [(["narrow"], ["h-used"], True)]


def test_a_failed_op_is_raised_at_the_next_wait_and_its_skipped_releases_wait_again(
    pipe: Pipeline, recorder: Recorder
) -> None:
    recorder.responses.append(
        pb.BatchResponse(
            failed=True,
            failed_index=0,
            error_message="no room",
            error_code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
        )
    )
    pipe.enqueue("Fill", "fill_", "3MrLn47Cxyz", None)
    pipe.enqueue("Fill", "fill_", "h-next", None)
    pipe.queue_release("h-old")
    pipe.flush(wait=True)  # the error is kept, not raised here
    assert pipe.releases_pending  # skipped with the op after the failed one
    with pytest.raises(errors.TensordError, match=r"fill_ of 3MrLn47C\.\.\. failed") as info:
        pipe.synchronize()
    assert "the 2 op(s) queued after it" in str(info.value)
    pipe.synchronize()  # raised once; the release goes now
    assert recorder.sent()[-1] == ([], ["h-old"], True)


def test_a_batch_that_never_reached_the_server_keeps_its_error_not_its_releases(
    recorder: Recorder, closed: threading.Event
) -> None:
    lost = errors.UnavailableError("the server went away")
    pipe = Pipeline(
        send=recorder.send,
        answer=lambda future: lost,
        tick=lambda: None,
        closed=closed,
        pipelining=True,
    )
    pipe.enqueue("Fill", "fill_", "h-a", None)
    pipe.queue_release("h-old")
    with pytest.raises(errors.UnavailableError, match="went away"):
        pipe.synchronize()
    assert not pipe.releases_pending  # the next Batch would fail the same


def test_nothing_is_sent_or_queued_for_release_once_the_session_closed(
    pipe: Pipeline, recorder: Recorder, closed: threading.Event
) -> None:
    pipe.enqueue("Fill", "fill_", "h-a", None)
    closed.set()
    pipe.queue_release("h-old")
    pipe.synchronize()
    assert recorder.sent() == [] and not pipe.releases_pending


def test_a_long_queue_is_cut_into_batches_sent_in_order(pipe: Pipeline, recorder: Recorder) -> None:
    count = wire_pipeline.MAX_BATCH_NAMES // 2 + 1  # names: two ops fill one Batch
    for index in range(3):
        names = [f"n{index}-{i}" for i in range(count)]
        message = requests.delete_names(names)
        pipe.enqueue("DeleteNames", f"delete_many {index}", names[0], message)
    pipe.queue_release("h-old")
    pipe.synchronize()
    assert recorder.sent() == [
        (["delete_many 0"], [], False),
        (["delete_many 1"], [], False),
        (["delete_many 2"], ["h-old"], True),
    ]
