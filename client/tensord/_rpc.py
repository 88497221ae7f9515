"""The SDK's wire: one gRPC channel, one ``_call``, raw-byte transfers, the session.

Everything that knows about gRPC lives here, so the rest of the SDK deals in
protobuf messages and :mod:`tensord.errors` only.  :func:`error_from_rpc` is
the single place that maps a status code (and the ``tensord-error-type``
trailer) back to an exception class.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import functools
import ipaddress
import math
import numbers
import os
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc
import grpc.experimental

from tensord import errors
from tensord._proto.tensord.v1 import tensord_pb2 as pb
from tensord._proto.tensord.v1 import tensord_pb2_grpc
from tensord.protocol import (
    AUTHORIZATION_KEY,
    BEARER,
    DEFAULT_ADDRESS,
    MAX_BATCH_OPS,
    MAX_BATCH_RESULTS,
    MAX_MESSAGE_BYTES,
    SESSION_KEY,
    UPLOAD_HEADER_KEY,
)
from tensord.wire.status import batch_error, error_from_rpc, is_own_deadline
from tensord.wire.status import call as _call

ADDRESS_ENV = "TENSORD_ADDRESS"
TOKEN_ENV = "TENSORD_TOKEN"
# TLS without an argument: TENSORD_TLS_CA names a PEM file of root certificates (TLS on);
# TENSORD_TLS=1 turns TLS on with the system's roots.
TLS_ENV = "TENSORD_TLS"
TLS_CA_ENV = "TENSORD_TLS_CA"
_TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
# The server's NOT_FOUND text for a session id it does not have (sessions.py).
UNKNOWN_SESSION = "unknown session"

# Payloads travel in ~1 MiB chunks: streaming beats one big message by 6-8x (DESIGN.md).
CHUNK_BYTES = 1 << 20
CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # A Download runs on its caller's thread: otherwise gRPC starts a "channel spin" thread
    # per download that is still winding down when the caller forks next (see _ForkGate).
    (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1),
)
# Dropped handles are sent in one Release per interval (or sooner once this many wait).
RELEASE_INTERVAL_S = 0.05
RELEASE_BATCH = 1024
# the longest wait between heartbeats, whatever lease the server grants (one hour)
MAX_HEARTBEAT_INTERVAL_S = 3600.0
# Pipelining (issue 15): queued ops go to the server in one Batch once this many wait (or
# at the next call that waits for the server, or within RELEASE_INTERVAL_S).
PIPELINE_BATCH = 256
# While the Batch before is still on the server, a full queue keeps filling up to this many
# ops before its caller waits: one larger Batch (fewer RPCs per op for the server) instead
# of a wait at every PIPELINE_BATCH ops (issue 15, many clients); one op short of what a
# Batch may hold, so that the flush's release rides in the same Batch.
PIPELINE_BATCH_MAX = MAX_BATCH_OPS - 1
# close() may run at exit or from a finalizer: it must not hang on a server that is gone.
CLOSE_TIMEOUT_S = 5.0
# Every unary call's deadline, and how long a transfer may go without a chunk moving: a
# hung server then raises DeadlineExceededError instead of blocking its caller for ever.
# Not a total deadline for transfers: a 10 GiB download that keeps moving never ends early.
DEFAULT_CALL_TIMEOUT_S = 60.0
CALL_TIMEOUT_ENV = "TENSORD_CALL_TIMEOUT"
_NO_DEADLINE_WORDS = frozenset({"none", "off"})


class CallTimeoutFromEnv(enum.Enum):
    """``call_timeout``'s default: ``$TENSORD_CALL_TIMEOUT``, else 60 s."""

    FROM_ENV = "from $TENSORD_CALL_TIMEOUT, else 60 s"


CALL_TIMEOUT_FROM_ENV = CallTimeoutFromEnv.FROM_ENV

_UPLOAD_METHOD = "/tensord.v1.Tensord/Upload"
_DOWNLOAD_METHOD = "/tensord.v1.Tensord/Download"

M = TypeVar("M")
# What a queued op that makes a new Storage hears once its Batch is answered.
CopyAnswered = Callable[[pb.TensorMeta], None]
# One queued op, kept as plain values until its Batch is built (issue 15: building a
# BatchOp per view cost more than the view): (BatchOp field, verb for errors, input handle,
# message -- for a view, {ViewRequest field: its message} --, result ids, copy callback).
QueuedOp = tuple[str, str, str, Any, tuple[str, ...], CopyAnswered | None]


def resolve_address(address: str | None) -> str:
    """The address argument, else ``$TENSORD_ADDRESS``, else 127.0.0.1:50051, as gRPC dials
    it (:func:`dial_address`)."""
    return dial_address(address or os.environ.get(ADDRESS_ENV) or DEFAULT_ADDRESS)


# tensord's port: a host given without one means it (gRPC's own default port is 443)
DEFAULT_PORT = DEFAULT_ADDRESS.rpartition(":")[2]
# gRPC target schemes that name no host and port: left as they are
_OTHER_SCHEMES = ("unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:")
_URL_SCHEMES = ("http://", "https://", "grpc://", "grpcs://")


def _with_port(host_port: str) -> str:
    if not host_port:
        return host_port
    with contextlib.suppress(ValueError):
        ip = ipaddress.ip_address(host_port)  # a bare IP: "::1" is all host, no port
        return f"[{ip}]:{DEFAULT_PORT}" if ip.version == 6 else f"{ip}:{DEFAULT_PORT}"
    if host_port.startswith("["):
        return f"{host_port}:{DEFAULT_PORT}" if host_port.endswith("]") else host_port
    return host_port if ":" in host_port else f"{host_port}:{DEFAULT_PORT}"


def dial_address(address: str) -> str:
    """``address`` with tensord's port where it names none (``myhost`` -> ``myhost:50051``).

    A URL (``http://host:port``) is refused with the form to use: gRPC would read it as
    a host named ``http`` and wait out the whole connect timeout."""
    if address.lower().startswith(_URL_SCHEMES):
        rest = address.split("://", 1)[1].rstrip("/")
        tls = " and tls=True" if address.lower().startswith(("https://", "grpcs://")) else ""
        raise ValueError(
            f"a tensord address is HOST:PORT (or unix:PATH), not a URL: got {address!r}; "
            f"pass {_with_port(rest)!r}{tls} (the gRPC port of `tensord serve`, default "
            f"{DEFAULT_PORT}; not the dashboard's or the metrics' HTTP port)"
        )
    if address.startswith(_OTHER_SCHEMES):
        return address
    if address.startswith("dns:"):
        rest = address.removeprefix("dns:")
        if rest.startswith("//"):  # dns://[authority]/host:port
            authority, _, rest = rest[2:].partition("/")
            return f"dns://{authority}/{_with_port(rest)}"
        return f"dns:{_with_port(rest)}"
    return _with_port(address)


# gRPC dials through a proxy these name; a direct probe would judge another path
_PROXY_VARIABLES = ("grpc_proxy", "https_proxy", "http_proxy")


def _host_and_port(address: str) -> tuple[str, int] | None:
    """(host, port) of a dialled HOST:PORT or dns: address; None for any other."""
    if address.startswith(_OTHER_SCHEMES):
        return None
    host_port = address.removeprefix("dns:")
    if host_port.startswith("//"):  # dns://[authority]/host:port
        host_port = host_port[2:].partition("/")[2]
    host, _, port = host_port.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not port.isdigit():
        return None
    return host, int(port)


def _probe_target(address: str) -> str | tuple[str, int] | None:
    """Where a plain socket reaches what gRPC dials for ``address``: a unix socket's path,
    or (host, port); None where a socket cannot tell (other schemes, a proxy)."""
    if address.startswith("unix:"):
        path = address.removeprefix("unix:")
        return "/" + path.lstrip("/") if path.startswith("//") else path
    if address.startswith("unix-abstract:"):
        return "\0" + address.removeprefix("unix-abstract:")
    if any(os.environ.get(name) or os.environ.get(name.upper()) for name in _PROXY_VARIABLES):
        return None
    return _host_and_port(address)


class _Probe(enum.Enum):
    """What a plain socket connect where gRPC dials found (when it raised nothing)."""

    ACCEPTED = "accepted"
    SILENT = "silent"  # neither accepted nor refused in time: a host down, a firewall
    UNTRIED = "untried"


def _probe(address: str, timeout: float) -> _Probe:
    """Connect a plain socket where gRPC would dial.  Refused, unresolvable or unreachable
    raise UnavailableError at once, where gRPC would retry until the connect timeout; an
    accepted connection is closed unused."""
    target = _probe_target(address)
    if target is None:
        return _Probe.UNTRIED
    try:
        if isinstance(target, str):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(timeout)
                sock.connect(target)
        else:
            socket.create_connection(target, timeout=timeout).close()
    except TimeoutError:
        return _Probe.SILENT
    except socket.gaierror as exc:
        raise errors.UnavailableError(
            f"cannot resolve the host {target[0]!r} of the tensord address {address}: "
            f"{exc.strerror}; a tensord address is HOST:PORT (default {DEFAULT_ADDRESS})"
        ) from None
    except (ConnectionRefusedError, FileNotFoundError) as exc:
        why = "connection refused" if isinstance(exc, ConnectionRefusedError) else "no such socket"
        raise errors.UnavailableError(
            f"no tensord server answers at {address} ({why}: nothing listens there); "
            f"{_serve_hint(address)}"
        ) from None
    except OSError as exc:  # no route to the host, the network down
        raise errors.UnavailableError(
            f"no tensord server answers at {address} ({exc.strerror or exc}); "
            f"check the address, or {_serve_hint(address)}"
        ) from None
    return _Probe.ACCEPTED


def _serve_hint(address: str) -> str:
    """How to start a server that ``address`` reaches, in `tensord serve`'s flags."""
    if address == DEFAULT_ADDRESS:
        return f"start one with `tensord serve` (it listens on {DEFAULT_ADDRESS})"
    if address.startswith(("unix:", "unix-abstract:")):
        return f"start one with `tensord serve --address {address}`"
    host_port = _host_and_port(address)
    if host_port is None:
        return "start one with `tensord serve`, or pass the address of a running one"
    host, port = host_port
    try:
        remote = not ipaddress.ip_address(host).is_loopback
    except ValueError:
        remote = host != "localhost"
    if remote:  # serve refuses a non-loopback address without tokens
        return (
            f"start one on {host} with `tensord serve --address 0.0.0.0:{port} "
            "--auth-tokens FILE`, or pass the address of a running one"
        )
    shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return f"start one with `tensord serve --address {shown}`"


def resolve_token(token: str | None) -> str | None:
    """The token argument, else ``$TENSORD_TOKEN``, else None (no authorization sent)."""
    return token or os.environ.get(TOKEN_ENV) or None


def _checked_call_timeout(value: float, source: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{source} must be a number of seconds or None, got {type(value).__name__}")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{source} must be a finite number of seconds > 0 (or None), got {value}")
    return float(value)


def resolve_call_timeout(call_timeout: float | CallTimeoutFromEnv | None) -> float | None:
    """The call_timeout argument, else ``$TENSORD_CALL_TIMEOUT``, else 60 s; None: no deadline.

    The variable holds seconds, or ``none`` (``off``) for no deadline.
    """
    if call_timeout is not CALL_TIMEOUT_FROM_ENV:
        return None if call_timeout is None else _checked_call_timeout(call_timeout, "call_timeout")
    raw = os.environ.get(CALL_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_CALL_TIMEOUT_S
    if raw.lower() in _NO_DEADLINE_WORDS:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(
            f"${CALL_TIMEOUT_ENV} must be a number of seconds or 'none', got {raw!r}"
        ) from None
    return _checked_call_timeout(seconds, f"${CALL_TIMEOUT_ENV}")


RootCertificates = bytes | str | os.PathLike[str]


def resolve_tls(
    tls: bool | None, root_certificates: RootCertificates | None
) -> grpc.ChannelCredentials | None:
    """Channel credentials for TLS, or None for a plaintext channel.

    ``root_certificates`` is PEM bytes or the path of a PEM file (else
    ``$TENSORD_TLS_CA``); giving roots turns TLS on.  ``tls=None`` means: on when
    roots are given or ``$TENSORD_TLS`` is set true, off otherwise.  Without roots
    the system's trusted roots check the server's certificate.
    """
    if root_certificates is None and tls is not False:
        root_certificates = os.environ.get(TLS_CA_ENV) or None
    if tls is None:
        wanted = os.environ.get(TLS_ENV, "").strip().lower() in _TRUE_WORDS
        tls = root_certificates is not None or wanted
    if not tls:
        if root_certificates is not None:
            raise ValueError("root_certificates given with tls=False")
        return None
    roots = root_certificates
    if roots is not None and not isinstance(roots, bytes):
        try:
            with open(roots, "rb") as f:
                roots = f.read()
        except OSError as exc:
            raise ValueError(
                f"cannot read root certificates {str(roots)!r}: {exc.strerror}"
            ) from None
    return grpc.ssl_channel_credentials(root_certificates=roots)


def _take(pending: collections.deque[str], limit: int) -> list[str]:
    """Up to ``limit`` ids from the left of ``pending`` (other threads may take too)."""
    batch: list[str] = []
    with contextlib.suppress(IndexError):
        while len(batch) < limit:
            batch.append(pending.popleft())
    return batch


def _session_lost_message(session_id: str) -> str:
    return (
        f"this tensor's tensord session ({session_id[:8]}...) is gone: the server restarted or "
        "the session expired, and the tensor's data went with it; the client has opened a new "
        "session: tensors made from now on work, so make this one again"
    )


def _chunks(data: memoryview, size: int) -> Iterator[bytes]:
    # Each message must be ``bytes``: gRPC's identity serializer sends it as is.
    for start in range(0, len(data), size):
        yield bytes(data[start : start + size])


class _WatchedStream:
    """One transfer under the watchdog: when a chunk last moved, and whether it was cancelled."""

    __slots__ = ("call", "cancelled", "last_progress")

    def __init__(self) -> None:
        self.call: grpc.Future | None = None
        self.last_progress = time.monotonic()
        self.cancelled = False

    def progressed(self) -> None:
        self.last_progress = time.monotonic()  # one float store: no lock needed


def _progressing(chunks: Iterator[bytes], stream: _WatchedStream) -> Iterator[bytes]:
    # gRPC asks for chunk n once chunk n-1 is sent: each request is progress
    for chunk in chunks:
        stream.progressed()
        yield chunk


class _StreamWatchdog:
    """Cancels any transfer of one connection in which no chunk moved for ``idle_timeout`` s.

    gRPC has only a total deadline for a call; a big transfer must not hit one, yet a
    stalled one must end.  One thread per connection (started with the first transfer)
    sleeps until the earliest moment a watched transfer could have been idle too long.
    """

    def __init__(self, idle_timeout: float) -> None:
        self.idle_timeout = idle_timeout
        self._changed = threading.Condition()
        self._streams: set[_WatchedStream] = set()
        self._thread: threading.Thread | None = None
        self._stopped = False

    @contextlib.contextmanager
    def watch(self, stream: _WatchedStream, call: grpc.Future) -> Iterator[None]:
        """Watch ``call`` while the block runs; it is cancelled after the block, if unfinished."""
        stream.call = call
        with self._changed:
            self._streams.add(stream)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._watch_forever, name="tensord-stream-watchdog", daemon=True
                )
                self._thread.start()
            self._changed.notify()
        try:
            yield
        finally:
            with self._changed:
                self._streams.discard(stream)

    def stop(self) -> None:
        with self._changed:
            self._stopped = True
            self._changed.notify()

    def _take_idle(self) -> tuple[list[_WatchedStream], float | None]:
        """Mark the streams idle too long now; also how long until the next one could be."""
        now = time.monotonic()
        idle: list[_WatchedStream] = []
        next_in: float | None = None
        for stream in self._streams:
            if stream.cancelled:
                continue
            left = stream.last_progress + self.idle_timeout - now
            if left <= 0:
                stream.cancelled = True
                idle.append(stream)
            else:
                next_in = left if next_in is None else min(next_in, left)
        return idle, next_in

    def _watch_forever(self) -> None:
        while True:
            with self._changed:
                if self._stopped:
                    return
                idle, next_in = self._take_idle()
                if not idle:
                    self._changed.wait(next_in)
                    continue
            with _FORK_GATE.busy():  # outside the lock: cancelling may run gRPC's callbacks
                for stream in idle:
                    if stream.call is not None:
                        stream.call.cancel()


# ---- fork ------------------------------------------------------------------------------
# os.fork() while another thread is inside gRPC, or while a thread is starting or ending,
# copies that half-done state into the child: about 1 child in 300 died of SIGSEGV in
# Python's own threading._after_fork, and with GRPC_ENABLE_FORK_SUPPORT=1 the parent
# could hang in gRPC's fork handlers.  So a fork waits, a bounded time, until no SDK
# thread is inside gRPC (and holds them out of it until the fork is done), and until the
# short-lived Python threads gRPC starts for the SDK's own calls have ended.

# How long a fork waits for calls in flight on SDK threads: a beat or a release has a
# deadline of a few seconds, so this is reached only with a hung server.
FORK_QUIESCE_S = CLOSE_TIMEOUT_S
# How long it waits for gRPC's per-call Python threads (an upload's, connect()'s
# connectivity poll, which checks every 0.2 s): they end in milliseconds once their call
# is done; one that lives on belongs to a call still running, not worth waiting for.
FORK_GRPC_THREADS_S = 0.5


class _ForkGate:
    """Keeps the SDK's background threads out of gRPC while the process forks."""

    def __init__(self) -> None:
        self._changed = threading.Condition(threading.Lock())
        self._busy = 0
        self._forking = False

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


_FORK_GATE = _ForkGate()


def _is_grpc_python_thread(thread: threading.Thread) -> bool:
    # gRPC's own Python threads (channel spin, request consumer, connectivity poll) all
    # run a target made by grpc._cython.cygrpc; Thread keeps no public record of it.
    target = getattr(thread, "_target", None)
    return getattr(target, "__module__", "") == "grpc._cython.cygrpc"


def _join_grpc_threads(timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and _is_grpc_python_thread(thread):
            thread.join(max(deadline - time.monotonic(), 0.0))


def _quiesce_before_fork() -> None:
    _FORK_GATE.before_fork()
    if any(not connection.inherited for connection in list(_LIVE_CONNECTIONS)):
        _join_grpc_threads(FORK_GRPC_THREADS_S)


def _resume_after_fork_in_parent() -> None:
    _FORK_GATE.after_fork_in_parent()


def _reset_after_fork_in_child() -> None:
    global _FORK_GATE, _PROCESS_ID, _IDLE_WORKERS
    _PROCESS_ID = os.getpid()
    # the parent's gate is locked (by the forking thread) and counts the parent's threads
    _FORK_GATE = _ForkGate()
    _IDLE_WORKERS = collections.deque()  # the parent's workers: no thread here runs them
    _keep_inherited_channels()


# A forked child inherits every Connection (its session id, its channel) but none of its
# threads.  The session is the parent's: the child must never close, release or beat it.
# Nor may the child touch the inherited gRPC channel: closing it there hangs (a gRPC core
# thread that held its locks exists only in the parent).  So in the child every inherited
# Connection refuses use, its close does nothing, and its channel is kept referenced for
# the life of the process (deallocating a channel closes it).
_LIVE_CONNECTIONS: weakref.WeakSet[Connection] = weakref.WeakSet()
# This process's id, kept by the fork hook: every pipelined view asks whether its
# connection was inherited, and os.getpid() is a system call each time.
_PROCESS_ID = os.getpid()
_INHERITED_CHANNELS: list[grpc.Channel] = []


def _keep_inherited_channels() -> None:
    for connection in list(_LIVE_CONNECTIONS):
        _INHERITED_CHANNELS.append(connection._channel)


os.register_at_fork(
    before=_quiesce_before_fork,
    after_in_parent=_resume_after_fork_in_parent,
    after_in_child=_reset_after_fork_in_child,
)


# ---- interrupts --------------------------------------------------------------------------
# A signal handler's exception (KeyboardInterrupt from Ctrl-C, or whatever a handler of
# the user's raises) is raised in the main thread between any two bytecodes, also inside
# the `with condition:` blocks of gRPC's Python and Cython code: Condition.__enter__ and
# __exit__ are Python functions, so an exception raised just after the lock was taken (or
# just before it is released) leaves the channel's lock held for ever, and every later
# call on that channel, the heartbeat's and the Batch flusher's included, waits for it for
# ever.  So the main thread never runs gRPC code: it hands each call to a worker thread
# and waits on a plain lock, whose acquire a signal interrupts cleanly.  The exception
# then reaches the caller at once; a transfer in flight is cancelled (by another worker),
# and any other call goes on to its end on its worker (a Batch is applied and its errors
# kept for the next wait, as if it had been queued).


# the name of the threads that run the main thread's calls
WORKER_THREAD_NAME = "tensord-call"


class _Job:
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
        does it: cancelling takes gRPC's locks); :func:`_track` cancels any started later.
        Work that ended already has its result dropped instead (nothing left to cancel)."""
        with self._state:
            self.abandoned = True
            finished = self._finished
        if finished:
            self._drop_result()
            return
        calls = list(self.calls)
        if calls:
            _start_job(_Job(functools.partial(_cancel_calls, calls)))

    def _drop_result(self) -> None:
        """(once the work ended and its caller walked away) Hand a result to ``orphaned``."""
        orphaned, self.orphaned = self.orphaned, None
        result, self.result = self.result, None
        if orphaned is not None and self.error is None:
            # only appends to a release queue; never let it end a worker thread
            with contextlib.suppress(Exception):
                orphaned(result)


def _cancel_calls(calls: list[grpc.Future]) -> None:
    with _FORK_GATE.busy():  # like the watchdog's: a fork waits for a cancel under way
        for call in calls:
            call.cancel()  # a no-op on a finished call


class _Worker:
    """A thread that runs the main thread's gRPC work, one job at a time; idle between
    jobs (long-lived: a thread that starts or ends while the process forks is a hazard)."""

    def __init__(self) -> None:
        self.job: _Job | None = None
        self._go = threading.Lock()
        self._go.acquire()
        threading.Thread(target=self._serve, name=WORKER_THREAD_NAME, daemon=True).start()

    def hand(self, job: _Job) -> None:
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
# the job a worker runs now, for _track (a thread's own attribute: no lock)
_CURRENT = threading.local()


def _start_job(job: _Job) -> bool:
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


def _off_main_thread(work: Callable[[], M], orphaned: Callable[[M], None] | None = None) -> M:
    """Run ``work`` (which may enter gRPC); from the main thread, on a worker while it waits.

    Other threads run it themselves: signal handlers run only in the main thread.  So do
    nested calls (a worker is not the main thread) and calls during the interpreter's
    finalization (its daemon threads are stopped then).

    ``orphaned``: called with the result when the main thread was interrupted before it
    took it (to release what the call made on the server).
    """
    if threading.current_thread() is not threading.main_thread() or sys.is_finalizing():
        return work()
    job = _Job(work, orphaned)
    try:
        if not _start_job(job):
            return work()
        job.done.acquire()  # a signal interrupts this wait, and nothing else
        result: M = job.outcome()  # (an interrupt just before it leaves the result orphaned)
    except BaseException:
        job.abandon()
        raise
    return result


def _track(call: grpc.Future) -> None:
    """A stream the main thread's job started: cancelled if the main thread is interrupted."""
    job: _Job | None = getattr(_CURRENT, "job", None)
    if job is not None:
        job.calls.append(call)
        if job.abandoned:  # it walked away before this call was started
            call.cancel()


def _batch_request(queued: list[QueuedOp], released: list[str]) -> pb.BatchRequest:
    """The Batch of ``queued`` (in order), then one release of ``released`` if any: each
    BatchOp filled in place (a message passed to BatchOp() would be copied)."""
    request = pb.BatchRequest()
    add = request.ops.add
    for field, _, handle, message, results, _ in queued:
        op = add()
        if results:
            op.results.extend(results)
        if field == "view":
            view = op.view
            view.handle = handle
            for name, part in message.items():
                getattr(view, name).CopyFrom(part)
        else:
            getattr(op, field).CopyFrom(message)
    if released:
        add().release.handles.extend(released)
    return request


def _batch_parts(
    queued: list[QueuedOp], released: list[str]
) -> list[tuple[list[QueuedOp], list[str]]]:
    """``queued`` then one release of ``released``, in Batches the server takes: at most
    MAX_BATCH_OPS ops and MAX_BATCH_RESULTS view results each (an op naming more goes
    alone, and the server refuses it); the release rides in the last."""
    parts: list[tuple[list[QueuedOp], list[str]]] = []
    part: list[QueuedOp] = []
    results = 0
    for op in queued:
        named = len(op[4])
        if part and (len(part) == MAX_BATCH_OPS or results + named > MAX_BATCH_RESULTS):
            parts.append((part, []))
            part, results = [], 0
        part.append(op)
        results += named
    if released and len(part) == MAX_BATCH_OPS:  # the release is one more op
        parts.append((part, []))
        part = []
    parts.append((part, released))
    return parts


def _describe(queued: list[QueuedOp], released: bool, index: int) -> str:
    """The op at ``index`` of a Batch, as its error names it ("fill_ of 3MrLn47C...")."""
    if 0 <= index < len(queued):
        _, verb, handle, _, _, _ = queued[index]
        return f"{verb} of {handle[:8]}..."
    return "release" if released and index == len(queued) else "?"


class Connection:
    """A channel to one server, the session on it, and the background threads that keep it.

    Thread-safe: gRPC channels are, and the session id only changes under ``_lock``.
    """

    def __init__(
        self,
        address: str,
        *,
        timeout: float,
        call_timeout: float | None = DEFAULT_CALL_TIMEOUT_S,
        client_name: str | None = None,
        token: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        pipelining: bool = True,
    ) -> None:
        self.address = address
        #: queue views and in-place writes (issue 15); False: one RPC each, as before
        self.pipelining = pipelining
        self.tls = credentials is not None
        #: every unary call's deadline and every transfer's idle limit (None: neither)
        self.call_timeout = call_timeout
        self._watchdog = _StreamWatchdog(call_timeout) if call_timeout is not None else None
        # close() and background releases: short, so exit never waits long on a hung server
        self._close_timeout = min(CLOSE_TIMEOUT_S, call_timeout or CLOSE_TIMEOUT_S)
        # connect() as a whole (the channel, then the session's opening calls) waits `timeout`
        connect_deadline = time.monotonic() + timeout
        # the process whose session this is; in any other (a fork child) it is inherited
        self._pid = os.getpid()
        # sent with every call, the session-less ones included
        self._auth: tuple[tuple[str, str], ...] = (
            ((AUTHORIZATION_KEY, f"{BEARER}{token}"),) if token else ()
        )
        # gRPC retries a refused connection until the timeout, and a server that never
        # answers looks the same to it: a plain socket tells them apart first
        probe = _probe(address, timeout)
        if probe is _Probe.SILENT:
            raise errors.UnavailableError(
                f"no tensord server answers at {address}: the connection was neither "
                f"accepted nor refused in {timeout:g} s (the host may be down, or a firewall "
                f"drops it); check the address, or {_serve_hint(address)}"
            )
        if credentials is None:
            self._channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        else:
            self._channel = grpc.secure_channel(address, credentials, options=CHANNEL_OPTIONS)
        left = max(connect_deadline - time.monotonic(), 0.001)
        try:
            _off_main_thread(lambda: grpc.channel_ready_future(self._channel).result(timeout=left))
        except grpc.FutureTimeoutError:
            _off_main_thread(self._channel.close)
            raise errors.UnavailableError(self._not_ready_message(probe, timeout)) from None
        self._stub = tensord_pb2_grpc.TensordStub(self._channel)  # type: ignore[no-untyped-call]
        self._upload = self._channel.stream_unary(
            _UPLOAD_METHOD, request_serializer=None, response_deserializer=pb.TensorMeta.FromString
        )
        self._download = self._channel.unary_stream(
            _DOWNLOAD_METHOD,
            request_serializer=pb.DownloadRequest.SerializeToString,
            response_deserializer=None,
        )
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._pending: collections.deque[str] = collections.deque()
        # pipelining: ops queued in issue order (with a word each for errors), the Batch in
        # flight (one at a time, so the server applies them in order) and the first error
        # of a Batch, raised at the next call that waits
        self._queue: list[QueuedOp | None] = []  # None: a dead view's place (elided)
        self._queue_lock = threading.Lock()
        # dead-view elision: each queued view that may be elided (one result, an op the
        # server cannot refuse on a live base) whose id no later op and no caller has read
        # yet -> its place in _queue; such a view dropped before its flush is never sent
        self._elidable: dict[str, int] = {}
        self._send_lock = threading.Lock()
        # the Batch in flight: its future, its queued ops, its releases, the copies' callbacks
        self._inflight: tuple[grpc.Future, list[QueuedOp], list[str], list[CopyAnswered]] | None = (
            None
        )
        self._async_error: errors.TensordError | None = None
        # the last Batch answered (set by gRPC's callback): _busy() compares it with _inflight's
        self._answered_batch: grpc.Future | None = None
        #: where a full queue's flush runs (None: in the thread that filled it); tensord.aio
        #: hands it to an executor so a view never blocks the event loop
        self.flush_scheduler: Callable[[Callable[[], None]], None] | None = None
        # same-host zero copy (tensord._local): ended exports, sent in batches like handles
        self._pending_exports: collections.deque[str] = collections.deque()
        self.local: Any = None  # the client's LocalMapper, when it may map the server's memory
        name = client_name or f"pid {os.getpid()} on {socket.gethostname()}"
        try:
            self.server_info: pb.ServerInfoResponse = self._opening_call(
                "ServerInfo", pb.ServerInfoRequest(), connect_deadline, timeout
            )
            session = self._opening_call(
                "OpenSession", pb.OpenSessionRequest(client_name=name), connect_deadline, timeout
            )
        except BaseException:
            _off_main_thread(self._channel.close)
            raise
        self.session_id: str = session.session_id
        self.lease_seconds: float = session.lease_seconds or 10.0
        self.grace_seconds: float = session.grace_seconds
        _LIVE_CONNECTIONS.add(self)
        self._keepalive_call: Any = None  # the KeepAlive stream in progress
        self._keepalive = threading.Thread(
            target=self._heartbeat_forever, name="tensord-heartbeat", daemon=True
        )
        self._flusher = threading.Thread(
            target=self._flush_forever, name="tensord-release", daemon=True
        )
        self._keepalive.start()
        self._flusher.start()

    def _not_ready_message(self, probe: _Probe, timeout: float) -> str:
        """Why the channel was not ready in ``timeout``, as far as the probe tells."""
        if self.tls:  # a failed TLS handshake looks the same as a server that is hung
            tls = (
                "if its certificate is the problem, check that root_certificates sign it and "
                "that it names this host"
            )
        else:
            tls = (
                "if it serves TLS (`tensord serve --tls-cert`), connect with tls=True, or "
                'root_certificates="ca.pem" for a private CA'
            )
        if probe is _Probe.ACCEPTED:
            return (
                f"something at {self.address} accepted the connection but did not complete a "
                f"gRPC handshake in {timeout:g} s: a tensord server that is hung or "
                "overloaded, or no gRPC server (a dashboard's or metrics' HTTP port?); "
                f"{tls}"
            )
        return (
            f"no tensord server answers at {self.address} (waited {timeout:g} s); "
            f"{_serve_hint(self.address)}; {tls}"
        )

    def _opening_call(
        self, method: str, request: Any, connect_deadline: float, connect_timeout: float
    ) -> Any:
        """A session-less call of connect(), within what is left of its ``timeout``."""
        left = max(connect_deadline - time.monotonic(), 0.001)
        try:
            return self._unary(method, request, session=False, timeout=min(left, self._deadline()))
        except errors.DeadlineExceededError:
            raise errors.DeadlineExceededError(
                f"the tensord server at {self.address} accepted the connection but did not "
                f"answer {method} in time (connect timeout {connect_timeout:g} s, call_timeout "
                f"{self._describe_call_timeout()}); it may be hung or overloaded"
            ) from None

    # ---- calls ---------------------------------------------------------------------

    def _deadline(self) -> float:
        return math.inf if self.call_timeout is None else self.call_timeout

    def _describe_call_timeout(self) -> str:
        return "none" if self.call_timeout is None else f"{self.call_timeout:g} s"

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((SESSION_KEY, self.session_id), *self._auth)

    @property
    def inherited(self) -> bool:
        """True in a process forked from the one that connected: the session is the parent's."""
        return self._pid != _PROCESS_ID

    def _check_open(self) -> None:
        if self.inherited:
            raise errors.InheritedClientError(
                f"this tensord client (session of process {self._pid}) was inherited through "
                f"fork(): process {os.getpid()} cannot use its parent's session or the "
                "parent's tensors; call tensord.connect() in this process for its own session"
            )
        if self._closed.is_set():
            raise errors.UnavailableError(f"this tensord client ({self.address}) is closed")

    def holds_session(self, session_id: str) -> bool:
        """Whether a tensor made in ``session_id`` can be used through this connection now."""
        return not self.inherited and session_id == self.session_id

    def check_session(self, session_id: str) -> None:
        """Raise the typed error for a tensor of an inherited or a lost session."""
        self._check_open()
        if session_id != self.session_id:
            raise errors.SessionLostError(_session_lost_message(session_id))

    def _unary(
        self,
        method: str,
        request: Any,
        *,
        session: bool = True,
        timeout: float | None = None,
        sync: bool = True,
        orphaned: Callable[[Any], None] | None = None,
    ) -> Any:
        """One unary call with ``timeout`` (default: call_timeout; inf or None: no deadline);
        ``orphaned``: see :func:`_off_main_thread`."""
        self._check_open()
        return _off_main_thread(
            functools.partial(self._unary_now, method, request, session, timeout, sync), orphaned
        )

    def _unary_now(
        self, method: str, request: Any, session: bool, timeout: float | None, sync: bool
    ) -> Any:
        stub_method = getattr(self._stub, method)
        deadline = self.call_timeout if timeout is None else timeout
        grpc_timeout = None if deadline is None or math.isinf(deadline) else deadline
        metadata = self.metadata() if session else self._auth

        def send() -> Any:
            try:
                return stub_method(request, metadata=metadata, timeout=grpc_timeout)
            except grpc.RpcError as err:
                if grpc_timeout is None or not is_own_deadline(err):
                    raise  # the server's own word, a DeadlineExceededError among them
                raise errors.DeadlineExceededError(
                    f"{method}: the tensord server at {self.address} did not answer within "
                    f"{grpc_timeout:g} s ({error_from_rpc(err)}); it may be hung or overloaded "
                    f"(the deadline is connect()'s call_timeout, or ${CALL_TIMEOUT_ENV})"
                ) from None

        if not session:
            return _call(send)
        return self._in_session(metadata[0][1], send, sync=sync)

    def _in_session(self, session_id: str, fn: Callable[[], M], sync: bool = True) -> M:
        """Run a call sent in ``session_id``; "unknown session" means it was lost.

        The server restarted, or reaped the session after its grace: a new session
        replaces it at once (so new tensors work) and the caller learns its tensors
        are gone from a SessionLostError, not from an "unknown handle" later.
        """
        if self.local is not None:  # a consumer's GPU writes complete before the server's op
            self.local.before_call()
        if self.pipelining and sync:
            # what was queued first is applied first; dropped handles wait for the flusher,
            # as without pipelining: a temporary's handle read just before this call
            # (`call(..., x.zeros(1).handle)`) must outlive it
            self.synchronize(releases=False)
        try:
            return fn()
        except grpc.RpcError as err:
            exc = error_from_rpc(err, self.address)
            if isinstance(exc, errors.NotFoundError) and str(exc) == UNKNOWN_SESSION:
                self._replace_session(session_id)
                raise errors.SessionLostError(_session_lost_message(session_id)) from None
            raise exc from None

    def call(self, method: str, request: Any, orphaned: Callable[[Any], None] | None = None) -> Any:
        """One unary call in this session (``method`` as named in the proto); ``orphaned``
        gets its answer if an interrupt took the caller away first (see _off_main_thread)."""
        return self._unary(method, request, orphaned=orphaned)

    def call_local(
        self, work: Callable[[str], M | None], orphaned: Callable[[M], None] | None = None
    ) -> M | None:
        """``work(session_id)``: a request to this server that is no gRPC call (the same-host
        export channel), with every guarantee a call gives: a closed or inherited client
        raises, imported GPU memory is synchronized and the ops queued before it are applied
        first (their error raised), off the main thread; ``orphaned`` gets a result an
        interrupt took the caller away from.  ``work`` answers None to have the caller use
        gRPC instead."""
        self._check_open()

        def run() -> M | None:
            if self.local is not None:
                self.local.before_call()
            if self.pipelining:
                self.synchronize(releases=False)
            return work(self.session_id)

        def drop(result: M | None) -> None:
            if result is not None and orphaned is not None:
                orphaned(result)

        return _off_main_thread(run, drop)

    def upload(self, header: pb.UploadHeader, data: memoryview) -> pb.TensorMeta:
        """Stream ``data`` (bytes in logical order) as raw chunks; the server makes the tensor."""
        self._check_open()
        chunk = self.server_info.chunk_bytes or CHUNK_BYTES
        metadata = (*self.metadata(), (UPLOAD_HEADER_KEY, header.SerializeToString()))

        def send() -> pb.TensorMeta:
            stream = _WatchedStream()
            chunks = _progressing(_chunks(data.cast("B"), chunk), stream)
            call = self._upload.future(chunks, metadata=metadata)
            with self._watched(stream, call):
                try:
                    meta: pb.TensorMeta = call.result()
                except (grpc.RpcError, grpc.FutureCancelledError):
                    if stream.cancelled:
                        raise self._stalled(f"Upload of {header.nbytes} bytes") from None
                    raise
            return meta

        return _off_main_thread(lambda: self._in_session(metadata[0][1], send))

    def download_into(self, handle: str, out: memoryview) -> None:
        """Fill ``out`` (a writable byte buffer of the tensor's nbytes) with its elements."""
        self._check_open()
        request = pb.DownloadRequest(handle=handle, chunk_bytes=CHUNK_BYTES)

        metadata = self.metadata()

        def receive() -> int:
            pos = 0
            stream = _WatchedStream()
            call = self._download(request, metadata=metadata)
            with self._watched(stream, call):
                try:
                    for piece in call:
                        stream.progressed()
                        end = pos + len(piece)
                        if end > len(out):
                            raise errors.InternalError(
                                f"download of {handle} sent more than the {len(out)} bytes expected"
                            )
                        out[pos:end] = piece
                        pos = end
                except grpc.RpcError:
                    if stream.cancelled:
                        raise self._stalled(f"Download of {handle}") from None
                    raise
            return pos

        received = _off_main_thread(lambda: self._in_session(metadata[0][1], receive))
        if received != len(out):
            raise errors.InternalError(
                f"download of {handle} ended after {received} of {len(out)} bytes"
            )

    @contextlib.contextmanager
    def _watched(self, stream: _WatchedStream, call: grpc.Future) -> Iterator[None]:
        """Run a transfer under the idle watchdog; an unfinished call is cancelled after it
        (an error or an interrupt mid-stream must not leave the server sending)."""
        _track(call)
        try:
            if self._watchdog is None:
                yield
            else:
                with self._watchdog.watch(stream, call):
                    yield
        finally:
            call.cancel()  # a no-op on a finished call

    def _stalled(self, what: str) -> errors.DeadlineExceededError:
        return errors.DeadlineExceededError(
            f"{what}: no data moved to or from the tensord server at {self.address} for "
            f"{self._describe_call_timeout()} (call_timeout), so the transfer was cancelled; "
            "the server may be hung or overloaded"
        )

    # ---- pipelining (issue 15) ------------------------------------------------------

    def enqueue(
        self,
        field: str,
        verb: str,
        handle: str,
        message: Any,
        results: tuple[str, ...] = (),
        copied: CopyAnswered | None = None,
        elidable: bool = False,
    ) -> None:
        """Queue the BatchOp ``field`` = ``message`` on ``handle`` (its result is known here);
        sent in order in the next Batch, which builds the BatchOp (see :func:`_batch_request`).
        ``field`` "view": ``message`` is {ViewRequest field: its message}.  ``verb`` names the
        op in its error.  ``copied``: for an op that makes a new Storage, called with what the
        server issued once the Batch is answered (the Storage's id and address are the server's).
        ``elidable``: a view of one result that the server cannot refuse while its input is
        live (no room beyond its input's, no new dims or strides): dropped before it is
        sent, and unused, it is removed from the queue with its release (:meth:`queue_release`)."""
        # not _check_open() again: every caller took ``handle`` through Tensor.handle, which did
        with self._queue_lock:
            queue = self._queue
            elidable_views = self._elidable
            if elidable_views:
                elidable_views.pop(handle, None)  # its input is used now: that view must go
            queue.append((field, verb, handle, message, results, copied))
            if elidable:
                elidable_views[results[0]] = len(queue) - 1
            queued = len(queue)
        if queued >= PIPELINE_BATCH and (queued >= PIPELINE_BATCH_MAX or not self._busy()):
            if self.flush_scheduler is None:
                self._flush(wait=False)
            else:
                self.flush_scheduler(lambda: self._flush(wait=False))

    def _busy(self) -> bool:
        """Whether a Batch is in flight and not answered yet (the server still works on it)."""
        inflight = self._inflight
        return inflight is not None and self._answered_batch is not inflight[0]

    def _batch_answered(self, future: grpc.Future) -> None:
        # gRPC's done() takes the call's Condition, which a view (enqueue, on the main
        # thread) must not: a signal there could leave it held; one store is atomic
        self._answered_batch = future

    def synchronize(self, releases: bool = True) -> None:
        """Send what is queued and wait until the server applied it; raise the first error
        a queued op met since the last wait (the error names that op)."""
        self._flush(wait=True, releases=releases)
        error, self._async_error = self._async_error, None
        if error is not None:
            raise error

    def _flush(self, wait: bool, releases: bool = True) -> None:
        # all of it off the main thread, its lock included: an interrupted caller leaves
        # the Batch to be sent and answered on the worker, in order with the next ones
        _off_main_thread(functools.partial(self._flush_now, wait, releases))

    def _flush_now(self, wait: bool, releases: bool) -> None:
        with self._send_lock:
            self._collect()  # at most one Batch in flight: the server applies them in order
            with self._queue_lock:
                queued = [op for op in self._queue if op is not None]
                self._queue = []
                self._elidable.clear()  # sent now: past eliding
            # releases after the ops queued so far: a handle dropped was issued before it
            released = self._take_pending() if releases else []
            if not (queued or released) or self._closed.is_set() or self.inherited:
                return
            parts = _batch_parts(queued, released)
            for index, (part, part_released) in enumerate(parts):
                if index and not self._collect():
                    # the part before failed: the ops after it are skipped, as they are
                    # after a failed op in one Batch; the releases wait for the next one
                    self._requeue_releases(released)
                    return
                self._send_batch(part, part_released)
            if wait:
                self._collect()

    def _send_batch(self, queued: list[QueuedOp], released: list[str]) -> None:
        """Send one Batch of ``queued`` then ``released`` (the caller holds _send_lock and
        collected the Batch before)."""
        answered = [op[5] for op in queued if op[5] is not None]
        request = _batch_request(queued, released)
        if self.local is not None:
            self.local.before_call()
        timeout = None if self.call_timeout is None else self.call_timeout
        future = self._stub.Batch.future(request, metadata=self.metadata(), timeout=timeout)
        self._inflight = (future, queued, released, answered)
        future.add_done_callback(self._batch_answered)

    def _take_pending(self) -> list[str]:
        batch: list[str] = []
        with contextlib.suppress(IndexError):
            while len(batch) < PIPELINE_BATCH * 4 and self._pending:
                batch.append(self._pending.popleft())
        return batch

    def _collect(self) -> bool:
        """Wait for the Batch in flight; keep its first error for the next wait.  Whether
        it was applied whole (True when none was in flight)."""
        if self._inflight is None:
            return True
        future, queued, released, answered = self._inflight
        self._inflight = None
        try:
            response = future.result()
        except grpc.RpcError as err:
            self._keep_error(error_from_rpc(err, self.address))
            return False
        for copied, meta in zip(answered, response.copies, strict=False):  # the applied ones
            copied(meta)
        if response.failed:
            index = response.failed_index
            ops = len(queued) + bool(released)  # the releases ride last, in one op
            if released and index < ops - 1:  # skipped
                self._requeue_releases(released)
            what = _describe(queued, bool(released), index)
            skipped = ops - index - 1
            self._keep_error(
                batch_error(
                    response,
                    f"{response.error_message} (pipelined op {what} failed on the server; "
                    f"the {skipped} op(s) queued after it in the same batch were skipped)",
                )
            )
            return False
        return True

    def _requeue_releases(self, released: list[str]) -> None:
        """Handles whose release a Batch skipped (an op before it failed) go back to the
        queue: without this they kept their Storages until the session ended.  Not after
        an RPC error: the next Batch would fail too, and flush_releases loops while any wait."""
        if not self._closed.is_set():
            self._pending.extend(released)

    def _keep_error(self, error: errors.TensordError) -> None:
        if self._async_error is None:  # the first error is the one that explains the rest
            self._async_error = error

    # ---- releases (batched) --------------------------------------------------------

    def handle_used(self, handle: str) -> None:
        """``handle`` was read (Tensor.handle: for another op, a call, a share, a name): a
        queued view that issues it must be sent, even once its tensor is dropped."""
        if handle in self._elidable:
            with self._queue_lock:
                self._elidable.pop(handle, None)

    def queue_release(self, handle: str) -> None:
        """Called from finalizers: must never block or raise, so it only appends, or elides
        a dead view: when ``handle`` is a queued view's that nothing used (see enqueue),
        that view and its release are never sent.  It only tries the queue's lock (a
        finalizer may run in a thread holding it), and releases as usual when it is taken."""
        # after close the session has freed them all; an inherited session is not ours to free
        if self._closed.is_set() or self.inherited:
            return
        if handle in self._elidable and self._queue_lock.acquire(blocking=False):
            try:
                index = self._elidable.pop(handle, None)
                if index is not None:
                    queue = self._queue
                    if index == len(queue) - 1:
                        queue.pop()  # the commonest case: a view dropped at once
                    else:
                        queue[index] = None  # the places of the others stay as they are
                    return
            finally:
                self._queue_lock.release()
        self._pending.append(handle)

    def queue_export_release(self, export_id: str) -> None:
        """Called from array finalizers and DLPack deleters: only appends, like queue_release."""
        if not self._closed.is_set():
            self._pending_exports.append(export_id)

    def _export_releases(self, batch: list[str]) -> pb.ReleaseExportsRequest:
        """ReleaseExports of ``batch``, with the segments mapped and the imports closed here."""
        mapped = self.local.mapped_segments() if self.local is not None else []
        closed = self.local.close_idle_imports() if self.local is not None else []
        return pb.ReleaseExportsRequest(
            export_ids=batch, mapped_segments=mapped, closed_imports=closed
        )

    def _carried_releases(self) -> list[str]:
        """Handle releases a call may carry, applied before it (EmptyExport): only when every
        op queued before is applied, so no carried handle is one a queued op has yet to issue."""
        if self.inherited or self._closed.is_set():
            return []
        if not self.pipelining:
            return _take(self._pending, RELEASE_BATCH)
        with self._send_lock:
            self._collect()  # the Batch in flight issued its handles
            with self._queue_lock:
                if any(op is not None for op in self._queue):
                    return []  # queued since: the flusher sends them in order
                return self._take_pending()

    def empty_export(self, empty: pb.EmptyRequest, carry_releases: bool) -> pb.EmptyExportResponse:
        """Empty then Export of the new tensor in one call (a same-host upload).

        ``carry_releases``: the handles and exports dropped before it are released first,
        in the same call, so the new tensor reuses the warm pages they free (fresh host pages
        cost about ten times the copy: `del x; x = client.tensor(a)` in a loop) without the
        round trips of a flush.  A failed call queues them again: the server may never have
        run it (UNIMPLEMENTED from an older server, UNAVAILABLE), and releasing an id twice
        is harmless (ids are random and never reused; unknown ones are ignored)."""
        # on a worker as a whole: an interrupt must not drop the releases it took
        return _off_main_thread(
            functools.partial(self._empty_export_now, empty, carry_releases),
            self._release_empty_export,
        )

    def _release_empty_export(self, response: pb.EmptyExportResponse) -> None:
        """An EmptyExport answer its interrupted caller never saw: its tensor and export."""
        if response.export.export_id:
            self.queue_export_release(response.export.export_id)
        if response.export.tensor.handle:
            self.queue_release(response.export.tensor.handle)

    def _empty_export_now(
        self, empty: pb.EmptyRequest, carry_releases: bool
    ) -> pb.EmptyExportResponse:
        if self.pipelining:
            self.synchronize(releases=False)  # ops queued before it are applied first
        request = pb.EmptyExportRequest(empty=empty)
        handles: list[str] = []
        exports: list[str] = []
        if carry_releases and not self.inherited:
            handles = self._carried_releases()
            request.release_handles.extend(handles)
            exports = _take(self._pending_exports, RELEASE_BATCH)
            if exports:
                request.release_exports.CopyFrom(self._export_releases(exports))
        try:
            response: pb.EmptyExportResponse = self._unary("EmptyExport", request, sync=False)
        except BaseException:
            if not self._closed.is_set():  # else the session's end frees them
                self._pending.extendleft(reversed(handles))
                self._pending_exports.extendleft(reversed(exports))
            raise
        return response

    def flush_export_releases(self) -> None:
        while self._pending_exports and not self.inherited:
            batch: list[str] = []
            with contextlib.suppress(IndexError):
                while len(batch) < RELEASE_BATCH:
                    batch.append(self._pending_exports.popleft())
            if batch and not self._closed.is_set():
                request = self._export_releases(batch)
                with contextlib.suppress(errors.TensordError):  # the session's end frees them
                    response = self._unary(
                        "ReleaseExports", request, timeout=CLOSE_TIMEOUT_S, sync=False
                    )
                    if self.local is not None:
                        self.local.unmap_gone(list(response.gone_segments))

    def flush_releases(self) -> None:
        self.flush_export_releases()
        if self.pipelining:  # in order with the queued ops; an op's error waits for a sync
            self._flush(wait=True)
            while self._pending and not self.inherited and not self._closed.is_set():
                self._flush(wait=True)
            return
        while self._pending and not self.inherited:
            batch: list[str] = []
            with contextlib.suppress(IndexError):  # another flusher emptied the deque
                while len(batch) < RELEASE_BATCH:
                    batch.append(self._pending.popleft())
            if batch and not self._closed.is_set():
                # A failed release is harmless: the session's close or grace frees them anyway.
                with contextlib.suppress(errors.TensordError):
                    self._unary(
                        "Release", pb.ReleaseRequest(handles=batch), timeout=self._close_timeout
                    )

    def _flush_forever(self) -> None:
        while not self._closed.wait(RELEASE_INTERVAL_S):
            with contextlib.suppress(Exception), _FORK_GATE.busy():  # never die loudly
                if self.pipelining:
                    # queued ops and releases in one ordered Batch: a release sent alone
                    # could overtake the queued view that issues its handle
                    self.flush_export_releases()
                    if not self._busy():  # else what is queued goes in one Batch after it
                        self._flush(wait=False)
                else:
                    self.flush_releases()

    # ---- the session's liveness ------------------------------------------------------

    def _heartbeat_forever(self) -> None:
        """Keep the session connected through a KeepAlive stream open as long as the client.

        The server counts the session alive while the stream is open, however busy it is:
        gRPC ends the stream when this process exits or its connection breaks or stops
        answering the transport's pings, so no beat has to win the server's CPU in time.
        A stream that breaks (the server restarting, a network blip) is reopened at the
        next tick, after a unary Heartbeat that renews the lease meanwhile and finds a
        session the server no longer knows (reaped after its grace), which is replaced by
        a new one, its handles gone.
        """
        # the lease is the server's word: a third of a huge one is past what a thread can
        # wait (OverflowError), and beating more often than needed costs nothing
        interval = min(max(self.lease_seconds / 3.0, 0.05), MAX_HEARTBEAT_INTERVAL_S)
        while not self._closed.is_set():
            with contextlib.suppress(Exception):  # never let a background thread die loudly
                self._keep_stream_open(self.session_id, interval)
            if self._closed.wait(interval):
                return
            with _FORK_GATE.busy():
                self._beat(interval)

    def _keep_stream_open(self, session_id: str, interval: float) -> None:
        """Hold a KeepAlive stream of ``session_id`` until it ends or the client closes."""

        def beats() -> Iterator[pb.Heartbeat]:
            yield pb.Heartbeat(sent_at=time.time())
            while not self._closed.wait(interval) and self.session_id == session_id:
                with _FORK_GATE.busy():  # spans the send of the beat yielded
                    yield pb.Heartbeat(sent_at=time.time())

        with _FORK_GATE.busy():
            if self._closed.is_set():
                return
            answers = self._stub.KeepAlive(
                beats(), metadata=((SESSION_KEY, session_id), *self._auth)
            )
            self._keepalive_call = answers
        for _ in answers:
            pass

    def _beat(self, interval: float) -> None:
        if self._closed.is_set():
            return
        beat_session = self.session_id
        try:
            self._stub.Heartbeat(
                pb.Heartbeat(sent_at=time.time()),
                metadata=((SESSION_KEY, beat_session), *self._auth),
                timeout=max(interval, 1.0),
            )
        except grpc.RpcError as err:
            if err.code() is grpc.StatusCode.NOT_FOUND and not self._closed.is_set():
                self._replace_session(beat_session)
        except Exception:  # never let a background thread die loudly
            pass

    def _replace_session(self, lost_id: str) -> None:
        """A new session for one the server no longer has (its handles are gone with it).

        Once per lost session: whoever comes second (the heartbeat or a call) finds it
        replaced already.  Tensors of the lost one then raise SessionLostError.
        """
        _off_main_thread(functools.partial(self._replace_session_now, lost_id))

    def _replace_session_now(self, lost_id: str) -> None:
        request = pb.OpenSessionRequest(
            client_name=f"pid {os.getpid()} on {socket.gethostname()} (reopened)"
        )
        with self._lock:
            if self.session_id != lost_id or self._closed.is_set():
                return
            if self.local is not None:  # the server freed what the lost session mapped
                self.local.make_private()
            with contextlib.suppress(grpc.RpcError):
                response = self._stub.OpenSession(
                    request, metadata=self._auth, timeout=max(self.lease_seconds, 1.0)
                )
                self.session_id = response.session_id

    # ---- closing ---------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def close(self) -> None:
        # Inherited (run by the child's exit hook or finalizers): the parent's session stays
        # open and its channel untouched; the Event's lock may have been held by a parent
        # thread at the fork, so not even that is set.
        if self._closed.is_set() or self.inherited:
            return
        _off_main_thread(self._close_now)

    def _close_now(self) -> None:
        if self._closed.is_set():  # closed by another thread meanwhile
            return
        # One short deadline for all of it, so exit never hangs on a hung server.  No Release
        # first: closing the session frees its handles, the pending ones included.
        deadline = time.monotonic() + self._close_timeout
        if self.pipelining:  # queued writes may reach Storages other sessions share
            with contextlib.suppress(errors.TensordError, grpc.RpcError):
                self._flush(wait=True)
            self._async_error = None  # the session ends: nothing waits for its ops any more
        if self.local is not None:  # while the pool's memory there is still this session's
            self.local.make_private()
        with contextlib.suppress(errors.TensordError):
            self._unary(
                "CloseSession", pb.CloseSessionRequest(), timeout=self._close_timeout, sync=False
            )
        self._closed.set()
        if self._watchdog is not None:
            self._watchdog.stop()
        # a beat or a release in flight has its own deadline, and closing the channel
        # cancels it: the threads are daemons, so no need to wait them out
        if self._keepalive_call is not None:  # its beats end with _closed; end it now
            with contextlib.suppress(Exception):
                self._keepalive_call.cancel()
        self._keepalive.join(timeout=max(deadline - time.monotonic(), 0.0))
        self._flusher.join(timeout=max(deadline - time.monotonic(), 0.0))
        self._pending.clear()
        self._pending_exports.clear()
        if self.local is not None:  # its socket: the session's end made its key useless
            self.local.close_channel()
        self._channel.close()
