"""SDK deadlines: a hung server raises DeadlineExceededError instead of blocking for ever.

The server here is a fake on loopback: it answers the session's own calls (so connect()
works) and blocks in the methods a test names until teardown releases them.  Every
wait in it is bounded, so a failing test cannot hang the suite.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tensord
from tensord import schema as pb
from tensord.wire import config, connection

# Child processes import the SDK and the CLI from where this process did.
CHILD_PYTHONPATH = os.pathsep.join(
    str(Path(module.__file__).resolve().parents[1])
    for module in (tensord, pytest.importorskip("tensord_server"))
    if module.__file__
)
# The longest any fake handler blocks: teardown releases it far sooner.
HANG_BOUND_S = 30.0
CHUNK = 64 << 10

_ANSWERS: dict[str, Any] = {
    "ServerInfo": pb.ServerInfoResponse(version="fake", chunk_bytes=CHUNK),
    "OpenSession": pb.OpenSessionResponse(session_id="fake-session", lease_seconds=30.0),
    "Heartbeat": pb.Heartbeat(),
    "CloseSession": pb.CloseSessionResponse(),
    "Release": pb.ReleaseResponse(),
    "MemoryStats": pb.MemoryStatsResponse(),
}


def _meta(nbytes: int) -> pb.TensorMeta:
    return pb.TensorMeta(
        handle="h1",
        shape=[nbytes],
        stride=[1],
        dtype="uint8",
        device="cpu",
        storage_id="s1",
        storage_nbytes=nbytes,
    )


class FakeServer(grpc.GenericRpcHandler):
    """Methods named in ``hung`` block until ``release`` (or HANG_BOUND_S).

    ``Empty`` makes a uint8 tensor of ``nbytes``; ``Download`` sends it in CHUNK pieces
    ``chunk_every`` s apart, and stops sending (blocks) after ``stall_after`` pieces.
    """

    def __init__(
        self,
        hung: tuple[str, ...] = (),
        *,
        nbytes: int = 4 * CHUNK,
        chunk_every: float = 0.0,
        stall_after: int | None = None,
    ) -> None:
        self.hung = set(hung)
        self.nbytes = nbytes
        self.chunk_every = chunk_every
        self.stall_after = stall_after
        self.release = threading.Event()
        self.calls: list[str] = []
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        self._server.add_generic_rpc_handlers((self,))
        port = self._server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{port}"
        self._server.start()

    def stop(self) -> None:
        self.release.set()
        self._server.stop(grace=None).wait(5.0)

    def _block_if_hung(self, method: str) -> None:
        if method in self.hung:
            self.release.wait(HANG_BOUND_S)

    def service(self, handler_call_details: Any) -> Any:
        method = handler_call_details.method.rsplit("/", 1)[-1]
        self.calls.append(method)
        if method == "Download":
            return grpc.unary_stream_rpc_method_handler(self._download)
        if method == "Upload":
            return grpc.stream_unary_rpc_method_handler(self._upload)

        def unary(request: bytes, context: Any) -> bytes:
            self._block_if_hung(method)
            answer = _meta(self.nbytes) if method == "Empty" else _ANSWERS.get(method)
            return answer.SerializeToString() if answer is not None else b""

        return grpc.unary_unary_rpc_method_handler(unary)

    def _download(self, request: bytes, context: Any) -> Iterator[bytes]:
        self._block_if_hung("Download")
        for index, start in enumerate(range(0, self.nbytes, CHUNK)):
            if self.stall_after is not None and index >= self.stall_after:
                self.release.wait(HANG_BOUND_S)
            if index and self.chunk_every:
                time.sleep(self.chunk_every)
            if not context.is_active():
                return
            yield bytes([index % 256]) * min(CHUNK, self.nbytes - start)

    def _upload(self, chunks: Iterator[bytes], context: Any) -> bytes:
        self._block_if_hung("Upload")  # before reading a chunk: the client's sends stall
        received = sum(len(chunk) for chunk in chunks)
        return _meta(received).SerializeToString()


@pytest.fixture
def fake() -> Iterator[Callable[..., FakeServer]]:
    started: list[FakeServer] = []

    def make(*hung: str, **settings: Any) -> FakeServer:
        started.append(FakeServer(hung, **settings))
        return started[-1]

    yield make
    for server in started:
        server.stop()


def _timed(fn: Callable[[], Any]) -> tuple[BaseException | None, float]:
    start = time.monotonic()
    try:
        fn()
    except BaseException as exc:  # the test looks at it
        return exc, time.monotonic() - start
    return None, time.monotonic() - start


# ---- unary calls ---------------------------------------------------------------------


@pytest.mark.slow
def test_a_unary_call_to_a_hung_server_raises_deadline_exceeded_after_call_timeout(
    fake: Callable[..., FakeServer],
) -> None:
    server = fake("MemoryStats", "CloseSession")
    with tensord.connect(server.address, call_timeout=0.5) as client:
        error, took = _timed(client.memory_stats)
    assert isinstance(error, tensord.DeadlineExceededError)
    assert isinstance(error, TimeoutError)
    assert 0.4 <= took < 3.0
    assert "MemoryStats" in str(error) and "0.5 s" in str(error)
    assert server.address in str(error)


@pytest.mark.slow
def test_call_timeout_none_waits_for_the_answer(fake: Callable[..., FakeServer]) -> None:
    server = fake("MemoryStats")
    client = tensord.connect(server.address, call_timeout=None)
    outcome: list[Any] = []
    caller = threading.Thread(target=lambda: outcome.append(_timed(client.memory_stats)))
    caller.start()
    caller.join(1.0)  # twice the 0.5 s the other tests time out after
    assert caller.is_alive(), outcome
    server.release.set()
    caller.join(10.0)
    assert outcome and outcome[0][0] is None
    client.close()


@pytest.mark.slow
def test_the_call_timeout_comes_from_the_environment(
    fake: Callable[..., FakeServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    server = fake("MemoryStats", "CloseSession")
    monkeypatch.setenv("TENSORD_CALL_TIMEOUT", "0.5")
    with tensord.connect(server.address) as client:
        assert client._conn.call_timeout == 0.5
        error, took = _timed(client.memory_stats)
    assert isinstance(error, tensord.DeadlineExceededError) and took < 3.0
    monkeypatch.setenv("TENSORD_CALL_TIMEOUT", "none")
    assert config.resolve_call_timeout(config.CALL_TIMEOUT_FROM_ENV) is None
    assert config.resolve_call_timeout(2.0) == 2.0  # the argument wins over the variable
    monkeypatch.delenv("TENSORD_CALL_TIMEOUT")
    assert (
        config.resolve_call_timeout(config.CALL_TIMEOUT_FROM_ENV) == config.DEFAULT_CALL_TIMEOUT_S
    )
    monkeypatch.setenv("TENSORD_CALL_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="TENSORD_CALL_TIMEOUT"):
        config.resolve_call_timeout(config.CALL_TIMEOUT_FROM_ENV)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf")])
def test_a_call_timeout_that_is_not_a_positive_number_is_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="call_timeout"):
        tensord.connect("127.0.0.1:1", call_timeout=bad)


def test_connect_to_a_server_that_never_answers_fails_within_its_timeout(
    fake: Callable[..., FakeServer],
) -> None:
    server = fake("ServerInfo")  # the connection is accepted; the first call hangs
    error, took = _timed(lambda: tensord.connect(server.address, timeout=0.5, call_timeout=None))
    assert isinstance(error, tensord.DeadlineExceededError)
    assert isinstance(error, tensord.UnavailableError)  # what connect() documents
    assert "ServerInfo" in str(error) and "connect timeout 0.5 s" in str(error)
    assert took < 3.0


# ---- transfers: an idle limit, not a total deadline ----------------------------------


@pytest.mark.slow
def test_a_download_that_stops_mid_stream_raises_after_the_idle_timeout(
    fake: Callable[..., FakeServer],
) -> None:
    server = fake("CloseSession", stall_after=2)
    with tensord.connect(server.address, call_timeout=0.5) as client:
        x = client.empty(server.nbytes, dtype=tensord.uint8)
        error, took = _timed(x.numpy)
    assert isinstance(error, tensord.DeadlineExceededError), error
    assert "Download of h1" in str(error) and "0.5 s" in str(error)
    assert 0.4 <= took < 3.0


@pytest.mark.slow
def test_a_slow_download_that_keeps_moving_outlives_the_idle_timeout(
    fake: Callable[..., FakeServer],
) -> None:
    server = fake(nbytes=8 * CHUNK, chunk_every=0.2)  # 1.4 s in all, 0.2 s per chunk
    with tensord.connect(server.address, call_timeout=1.0) as client:
        x = client.empty(server.nbytes, dtype=tensord.uint8)
        start = time.monotonic()
        values = x.numpy()
        assert time.monotonic() - start > 1.0  # longer than the timeout, in total
    expected = np.repeat(np.arange(8, dtype=np.uint8), CHUNK)
    np.testing.assert_array_equal(values, expected)


@pytest.mark.slow
def test_an_upload_the_server_stops_reading_raises_after_the_idle_timeout(
    fake: Callable[..., FakeServer],
) -> None:
    server = fake("Upload", "CloseSession")
    with tensord.connect(server.address, call_timeout=0.5) as client:
        error, took = _timed(lambda: client.tensor(np.zeros(64 * CHUNK, np.uint8)))
    assert isinstance(error, tensord.DeadlineExceededError), error
    assert "Upload of" in str(error) and "0.5 s" in str(error)
    assert 0.4 <= took < 3.0


@pytest.mark.slow
def test_call_timeout_none_lets_a_stalled_download_wait(fake: Callable[..., FakeServer]) -> None:
    server = fake(stall_after=1)
    client = tensord.connect(server.address, call_timeout=None)
    x = client.empty(server.nbytes, dtype=tensord.uint8)
    outcome: list[Any] = []
    caller = threading.Thread(target=lambda: outcome.append(_timed(x.numpy)))
    caller.start()
    caller.join(1.0)
    assert caller.is_alive(), outcome
    server.release.set()
    caller.join(10.0)
    assert outcome and outcome[0][0] is None
    client.close()


# ---- closing and exiting -------------------------------------------------------------


def test_close_on_a_hung_server_returns_within_a_bound(
    fake: Callable[..., FakeServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(connection, "CLOSE_TIMEOUT_S", 0.5)  # read when the client connects
    monkeypatch.setattr(connection, "RELEASE_BATCH", 1)  # each pending release a call of its own
    server = fake("CloseSession", "Release", "Heartbeat")
    client = tensord.connect(server.address, call_timeout=None)
    for _ in range(6):  # dropped at once: releases pending, one in flight to the hung server
        client.empty(4, dtype=tensord.uint8)
    error, took = _timed(client.close)
    # one short deadline for all of close(), not one per pending call
    assert error is None and took < 1.4
    assert client.closed


@pytest.mark.slow
def test_interpreter_exit_does_not_hang_on_a_hung_server(
    fake: Callable[..., FakeServer],
) -> None:
    server = fake("CloseSession", "Release", "MemoryStats")
    script = (
        "import tensord\n"
        f"client = tensord.connect({server.address!r})\n"
        "x = client.empty(4, dtype=tensord.uint8)\n"
        "del x\n"
        "try:\n"
        "    client.memory_stats()\n"
        "except tensord.DeadlineExceededError as e:\n"
        "    print('deadline:', e)\n"
    )
    env = {**os.environ, "PYTHONPATH": CHILD_PYTHONPATH, "TENSORD_CALL_TIMEOUT": "0.5"}
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    assert "deadline: MemoryStats" in done.stdout
    assert time.monotonic() - start < 15.0  # start-up, 0.5 s for the call, 0.5 s to close


@pytest.mark.slow
def test_the_cli_fails_with_a_clear_message_on_a_hung_server(
    fake: Callable[..., FakeServer],
) -> None:
    server = fake("ServerInfo")
    env = {**os.environ, "PYTHONPATH": CHILD_PYTHONPATH}
    command = ["stats", "--address", server.address, "--timeout", "0.5"]
    done = subprocess.run(
        [sys.executable, "-m", "tensord_server", *command],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 1
    assert done.stderr.startswith("tensord stats: the tensord server at")
    assert "did not answer ServerInfo in time" in done.stderr


@pytest.mark.slow
def test_the_cli_fails_within_its_timeout_on_a_server_hung_in_memory_stats(
    fake: Callable[..., FakeServer],
) -> None:
    server = fake("MemoryStats", "CloseSession")
    env = {k: v for k, v in os.environ.items() if k != "TENSORD_CALL_TIMEOUT"}
    env["PYTHONPATH"] = CHILD_PYTHONPATH
    command = ["stats", "--address", server.address, "--timeout", "0.5"]
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "tensord_server", *command],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("tensord stats:") and "MemoryStats" in done.stderr
    assert time.monotonic() - start < 15.0  # start-up and two 0.5 s calls, not the 60 s default
