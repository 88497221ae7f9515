"""Fixtures: a real tensord server on 127.0.0.1, port 0, in this process.

``server`` (module-scoped) and ``fresh_server`` (per test) yield a
:class:`RunningServer` with ``.address`` ("127.0.0.1:PORT") and ``.daemon``
(devices, storages and sessions, for inspection).  ``client`` is the SDK's
``tensord.connect(server.address)``; ``stub`` is the raw generated stub with an
open session (``stub.md`` is the metadata to pass with each call).
"""

from __future__ import annotations

import collections
import contextlib
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import pytest
from tensord import schema as pb
from tensord._proto.tensord.v1 import tensord_pb2_grpc
from tensord.dtypes import dtype_from_name, dtype_from_numpy
from tensord.protocol import MAX_MESSAGE_BYTES
from tensord_server.domain.store import TensorStore
from tensord_server.rpc.fd_socket import FdSocket
from tensord_server.rpc.grpc_server import create_server

# The fixtures' pool: big enough for every test, small enough to find leaks fast.
TEST_DEVICES = ("cpu=1GiB",)
# Short, so tests of the grace period finish quickly...
TEST_GRACE_S = 0.5
# ...and a lease long enough that a test's own idle session never lapses mid-test.
TEST_LEASE_S = 30.0
# In-flight calls get this long to finish when a fixture stops its server.
STOP_GRACE_S = 2.0

CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)


@dataclass
class RunningServer:
    address: str
    port: int
    daemon: TensorStore
    grpc_server: grpc.Server

    @property
    def fd_socket(self) -> FdSocket:
        """The server's fd socket (made as the server starts)."""
        fd_socket = self.grpc_server.calls.fd_socket
        assert fd_socket is not None
        return fd_socket

    def stop(self) -> None:
        self.grpc_server.stop(STOP_GRACE_S).wait()
        self.daemon.close()


def start_server(**daemon_kwargs: Any) -> RunningServer:
    kwargs = {"session_grace": TEST_GRACE_S, "lease": TEST_LEASE_S} | daemon_kwargs
    devices = kwargs.pop("devices", TEST_DEVICES)
    daemon = TensorStore(devices, **kwargs)
    grpc_server, port = create_server("127.0.0.1:0", store=daemon)
    return RunningServer(f"127.0.0.1:{port}", port, daemon, grpc_server)


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    running = start_server()
    yield running
    running.stop()


@pytest.fixture
def fresh_server() -> Iterator[RunningServer]:
    running = start_server()
    yield running
    running.stop()


@pytest.fixture
def make_server() -> Iterator[Callable[..., RunningServer]]:
    """A factory of servers with other settings (``make_server(lease=0.2)``), stopped after."""
    started: list[RunningServer] = []

    def make(**daemon_kwargs: Any) -> RunningServer:
        started.append(start_server(**daemon_kwargs))
        return started[-1]

    yield make
    for running in started:
        running.stop()


@pytest.fixture
def open_session() -> Iterator[Callable[..., SessionStub]]:
    """A factory of extra sessions (each on its own channel): ``open_session(server.address)``."""
    opened: list[tuple[grpc.Channel, SessionStub]] = []

    def open_(address: str, name: str = "extra") -> SessionStub:
        channel = open_channel(address)
        session = SessionStub(channel, name)
        opened.append((channel, session))
        return session

    yield open_
    for channel, session in opened:
        session.close()
        channel.close()


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Poll ``predicate`` (bounded): True once it holds, False after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


STARTUP_TIMEOUT_S = 30


def slowed_exports(table: Any, seconds: float = 0.3) -> tuple[Callable[..., Any], threading.Event]:
    """A stand-in for ``table.export`` that exports, then sleeps ``seconds`` (an interrupt
    lands while the answer is on its way), then sets the event it returns with it."""
    export = table.export
    answered = threading.Event()

    def slow_export(*args: Any, **kwargs: Any) -> Any:
        made = export(*args, **kwargs)
        time.sleep(seconds)
        answered.set()
        return made

    return slow_export, answered


@contextlib.contextmanager
def interrupted_after(seconds: float | None = 0.05) -> Iterator[None]:
    """The block must raise KeyboardInterrupt: a SIGALRM ``seconds`` in delivers it as
    Ctrl-C would (None: no timer, the block interrupts itself); the handler and timer are
    restored after."""
    previous = signal.signal(signal.SIGALRM, signal.default_int_handler)
    try:
        if seconds is not None:
            signal.setitimer(signal.ITIMER_REAL, seconds)
        with pytest.raises(KeyboardInterrupt):
            yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_client_child(
    address: str, code: str, *args: str, imports: str = "", timeout: float = 60.0
) -> str:
    """Run ``code`` in a fresh interpreter with ``client`` connected to ``address`` (``sys``,
    ``tensord`` and ``imports`` imported, ``args`` in ``sys.argv[2:]``); its stdout, stripped.
    A non-zero exit fails the test with the child's stderr."""
    modules = ", ".join(m for m in ("sys", "tensord", imports) if m)
    prelude = f"import {modules}\nclient = tensord.connect(sys.argv[1])\n"
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            prelude + textwrap.dedent(code) + "\nclient.close()\n",
            address,
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def run_serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`tensord serve ARGS` to its end (for arguments it refuses at start), output captured."""
    return subprocess.run(
        [sys.executable, "-m", "tensord_server", "serve", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )


def start_serve_process(*args: str, stderr: Any = None) -> tuple[subprocess.Popen[str], str]:
    """`tensord serve ARGS` in a subprocess; waits (bounded) for its listening line, returns its address.

    Its log (stderr) goes to a temporary file unless ``stderr`` says otherwise: a pipe
    nobody reads fills after 64 KiB, and then only the server's log writer thread waits
    (lines are dropped), but a test reading it at the end would miss them."""
    log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (the child writes it; closed here)
    process = subprocess.Popen(
        [sys.executable, "-m", "tensord_server", "serve", *args],
        stdout=subprocess.PIPE,
        stderr=log if stderr is None else stderr,
        text=True,
    )
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(process.stdout.readline()), daemon=True)
    reader.start()
    reader.join(STARTUP_TIMEOUT_S)
    if not line or not line[0].startswith("tensord listening on "):
        process.kill()
        process.communicate(timeout=10)
        log.seek(0)
        pytest.fail(f"no listening line: {line!r} {log.read()[-4000:]}")
    log.close()  # the child keeps its own descriptor
    return process, line[0].removeprefix("tensord listening on ").strip()


def server_allocated(server: Any) -> int:
    """Bytes allocated across every pool of an in-process server (read on the server side)."""
    return sum(
        int(d.pool.memory_stats()["allocated_bytes.all.current"]) for d in server.daemon.devices
    )


def client_allocated(client: Any) -> int:
    """Bytes allocated in the cpu pool, as a client sees it through memory_stats()."""
    return int(client.memory_stats()["allocated_bytes.all.current"])


@pytest.fixture(name="wait_until")
def wait_until_fixture() -> Callable[..., bool]:
    return wait_until


@pytest.fixture
def client(server: RunningServer) -> Iterator[Any]:
    import tensord
    import tensord.client  # lazily: the server's tests run without the SDK

    connect = getattr(tensord, "connect", None) or tensord.client.connect
    with connect(server.address) as connected:
        yield connected


class SessionStub:
    """The raw generated stub plus an open session: ``stub.View(req, metadata=stub.md)``."""

    def __init__(self, channel: grpc.Channel, name: str = "test", token: str | None = None) -> None:
        self.channel = channel
        self.raw = tensord_pb2_grpc.TensordStub(channel)
        # a server with --auth-tokens wants the bearer token on every call
        self.auth: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {token}"),) if token else ()
        )
        opened = self.raw.OpenSession(
            pb.OpenSessionRequest(client_name=name), metadata=self.auth, timeout=30
        )
        self.session_id = opened.session_id
        self.md: tuple[tuple[str, str], ...] = (
            ("tensord-session", self.session_id),
            *self.auth,
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)

    # -- helpers over the raw stub -------------------------------------------------

    def upload(
        self, array: np.ndarray, *, chunk: int = 1 << 20, device: str = "cpu"
    ) -> pb.TensorMeta:
        """An Upload of ``array``'s bytes (C order) in raw chunks."""
        data = np.ascontiguousarray(array).tobytes()
        header = pb.UploadHeader(
            shape=array.shape,
            dtype=dtype_from_numpy(array.dtype).name,
            device=device,
            nbytes=len(data),
        )
        chunks = (data[i : i + chunk] for i in range(0, len(data), chunk))
        upload = self.channel.stream_unary("/tensord.v1.Tensord/Upload")
        return pb.TensorMeta.FromString(
            upload(chunks, metadata=(*self.md, ("tensord-upload-bin", header.SerializeToString())))
        )

    def download_bytes(self, handle: str, chunk_bytes: int = 0) -> list[bytes]:
        download = self.channel.unary_stream(
            "/tensord.v1.Tensord/Download",
            request_serializer=pb.DownloadRequest.SerializeToString,
        )
        request = pb.DownloadRequest(handle=handle, chunk_bytes=chunk_bytes)
        return list(download(request, metadata=self.md))

    def download(self, meta: pb.TensorMeta) -> np.ndarray:
        """The tensor's values as a NumPy array of its shape and dtype."""
        data = b"".join(self.download_bytes(meta.handle))
        np_dtype = dtype_from_name(meta.dtype).numpy_dtype
        return np.frombuffer(data, dtype=np_dtype).reshape(tuple(meta.shape)).copy()

    def view(self, meta: pb.TensorMeta, **op: Any) -> list[pb.TensorMeta]:
        """One View op: ``stub.view(x, narrow=pb.Narrow(dim=0, start=1, length=2))``."""
        return list(
            self.raw.View(pb.ViewRequest(handle=meta.handle, **op), metadata=self.md).tensors
        )

    def close(self) -> None:
        with contextlib.suppress(grpc.RpcError):  # already closed or reaped by the test
            self.raw.CloseSession(pb.CloseSessionRequest(), metadata=self.md, timeout=10)


def open_channel(address: str, deadline_s: float | None = None) -> grpc.Channel:
    """A channel to ``address``; with ``deadline_s``, every call made without a timeout
    gets that one, so a server that stops answering fails the test instead of hanging
    the suite."""
    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    if deadline_s is None:
        return channel
    return grpc.intercept_channel(channel, DefaultDeadline(deadline_s))


class _CallDetails(
    collections.namedtuple(
        "_CallDetails",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    pass


class DefaultDeadline(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Gives every call without a timeout ``seconds`` of one."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def _details(self, details: Any) -> Any:
        if details.timeout is not None:
            return details
        return _CallDetails(
            details.method,
            self.seconds,
            details.metadata,
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


@pytest.fixture
def stub(server: RunningServer) -> Iterator[SessionStub]:
    with open_channel(server.address) as channel:
        session = SessionStub(channel)
        yield session
        session.close()
