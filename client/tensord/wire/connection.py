"""A connection: one gRPC channel to one server, the session on it, and its queues.

Everything a Client's tensors send goes through one :class:`Connection`: unary calls
(each under the call deadline, its failure raised as :mod:`tensord.errors`' class by
:mod:`tensord.wire.status`; on the server's host over the session's call channel,
:mod:`tensord.wire.channel`, whenever it can take them), raw-byte transfers (:mod:`tensord.wire.streams`), the
pipelined ops and the batched releases (:mod:`tensord.wire.batches`), and the
session's liveness (a KeepAlive stream, a new session when the server lost the old).
The pipeline's state (the queue, the Batch in flight, the releases, the flusher) is its
:class:`~tensord.wire.batches.Pipeline`'s; the connection sends its Batches.
The main thread's calls run on worker threads (:mod:`tensord.wire.worker`); a fork
waits for the background ones (:mod:`tensord.wire.fork`).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc
import grpc.experimental

from tensord import errors
from tensord import schema as pb
from tensord._proto.tensord.v1 import tensord_pb2_grpc
from tensord.protocol import (
    AUTHORIZATION_KEY,
    BEARER,
    MAX_MESSAGE_BYTES,
    SESSION_KEY,
    UPLOAD_HEADER_KEY,
)
from tensord.wire import fork, requests
from tensord.wire.address import Probe, probe, serve_hint
from tensord.wire.batches import BatchFuture, Pipeline
from tensord.wire.channel import CallChannel, ChannelBroken
from tensord.wire.config import CALL_TIMEOUT_ENV, DEFAULT_CALL_TIMEOUT_S
from tensord.wire.fork import FORK_GATE, LIVE_CONNECTIONS
from tensord.wire.pipeline import QueuedOp, take
from tensord.wire.status import call as _call
from tensord.wire.status import error_from_rpc, is_own_deadline
from tensord.wire.streams import StreamWatchdog, WatchedStream, chunks, progressing
from tensord.wire.worker import off_main_thread, track

# The server's NOT_FOUND text for a session id it does not have (sessions.py).
UNKNOWN_SESSION = "unknown session"

# Payloads travel in ~1 MiB chunks: streaming beats one big message by 6-8x (DESIGN.md).
CHUNK_BYTES = 1 << 20
# an Upload of at most this many bytes goes as one message (see Connection.upload)
ONE_MESSAGE_UPLOAD_BYTES = 64 << 10
CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # A Download runs on its caller's thread: otherwise gRPC starts a "channel spin" thread
    # per download that is still winding down when the caller forks next (tensord.wire.fork).
    (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1),
)
# Dropped handles are sent in one Release per interval of the pipeline's flusher
# (tensord.wire.batches.RELEASE_INTERVAL_S), this many at most in one.
RELEASE_BATCH = 1024
# the longest wait between heartbeats, whatever lease the server grants (one hour)
MAX_HEARTBEAT_INTERVAL_S = 3600.0
# close() may run at exit or from a finalizer: it must not hang on a server that is gone.
CLOSE_TIMEOUT_S = 5.0

_UPLOAD_METHOD = "/tensord.v1.Tensord/Upload"
_DOWNLOAD_METHOD = "/tensord.v1.Tensord/Download"

M = TypeVar("M")


class Settled:
    """A Batch the call channel answered, in the shape of the gRPC future it stands for."""

    def __init__(self, response: Any = None, error: errors.TensordError | None = None) -> None:
        self._response = response
        self._error = error

    def result(self) -> Any:
        if self._error is not None:
            raise self._error
        return self._response

    def add_done_callback(self, callback: Callable[[Settled], None]) -> None:
        callback(self)


# A forked child inherits every Connection (its session id, its channel) but none of its
# threads.  The session is the parent's: the child must never close, release or beat it.
# Nor may the child touch the inherited gRPC channel: closing it there hangs (a gRPC core
# thread that held its locks exists only in the parent).  So in the child every inherited
# Connection refuses use, its close does nothing, and its channel is kept referenced for
# the life of the process (deallocating a channel closes it).
# (this process's id is fork.PROCESS_ID, kept by the fork hook)
_INHERITED_CHANNELS: list[grpc.Channel] = []
# every connection's channel, for the child to keep (the connection is held weakly)
_CHANNELS: weakref.WeakKeyDictionary[Connection, grpc.Channel] = weakref.WeakKeyDictionary()


def _after_fork_in_child() -> None:
    _INHERITED_CHANNELS.extend(_CHANNELS.values())


os.register_at_fork(after_in_child=_after_fork_in_child)


def session_lost_message(session_id: str) -> str:
    return (
        f"this tensor's tensord session ({session_id[:8]}...) is gone: the server restarted or "
        "the session expired, and the tensor's data went with it; the client has opened a new "
        "session: tensors made from now on work, so make this one again"
    )


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
        use_call_channel: bool = True,
    ) -> None:
        self.address = address
        #: the cluster node this connection's server is, for a client's peer (else None):
        #: a server that stops answering then raises NodeLostError
        self.node: str | None = None
        #: queue views and in-place writes (tensord.wire.pipeline); False: one RPC each
        self.pipelining = pipelining
        self.tls = credentials is not None
        #: every unary call's deadline and every transfer's idle limit (None: neither)
        self.call_timeout = call_timeout
        self._watchdog = StreamWatchdog(call_timeout) if call_timeout is not None else None
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
        probed = probe(address, timeout)
        if probed is Probe.SILENT:
            raise errors.UnavailableError(
                f"no tensord server answers at {address}: the connection was neither "
                f"accepted nor refused in {timeout:g} s (the host may be down, or a firewall "
                f"drops it); check the address, or {serve_hint(address)}"
            )
        if credentials is None:
            self._channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        else:
            self._channel = grpc.secure_channel(address, credentials, options=CHANNEL_OPTIONS)
        fork.GATE_HOOKS.install()  # after gRPC's own, which its first channel installed
        left = max(connect_deadline - time.monotonic(), 0.001)
        try:
            off_main_thread(lambda: grpc.channel_ready_future(self._channel).result(timeout=left))
        except grpc.FutureTimeoutError:
            off_main_thread(self._channel.close)
            raise errors.UnavailableError(self._not_ready_message(probed, timeout)) from None
        self._stub = tensord_pb2_grpc.TensordStub(self._channel)  # type: ignore[no-untyped-call]
        self._upload = self._channel.stream_unary(
            _UPLOAD_METHOD, request_serializer=None, response_deserializer=pb.TensorMeta.FromString
        )
        # a small Upload as a call of one message: the same stream on the wire, without
        # the thread gRPC starts to consume a stream's request iterator (a 1 MiB message
        # sent by the caller's thread was slower than the stream)
        self._upload_one = self._channel.unary_unary(
            _UPLOAD_METHOD, request_serializer=None, response_deserializer=pb.TensorMeta.FromString
        )
        self._download = self._channel.unary_stream(
            _DOWNLOAD_METHOD,
            request_serializer=pb.DownloadRequest.SerializeToString,
            response_deserializer=None,
        )
        self._lock = threading.Lock()
        self._closed = threading.Event()
        #: the queued ops, the Batch in flight, the pending releases and their flusher
        self.pipeline = Pipeline(
            send=self._send_batch,
            answer=self._batch_answer,
            tick=self._tick,
            closed=self._closed,
            pipelining=pipelining,
        )
        # the pipeline's own methods, not wrappers: one Python call per view, not two
        self.enqueue = self.pipeline.enqueue
        self.handle_used = self.pipeline.handle_used
        self.queue_release = self.pipeline.queue_release
        self.synchronize = self.pipeline.synchronize
        self.settle = self.pipeline.settle
        # same-host zero copy (tensord.local): ended exports, sent in batches like handles
        self._pending_exports: collections.deque[str] = collections.deque()
        self.local: Any = None  # the client's LocalMapper, when it may map the server's memory
        name = client_name or f"pid {os.getpid()} on {socket.gethostname()}"
        try:
            self.server_info: pb.ServerInfoResponse = self._opening_call(
                "ServerInfo", requests.server_info(), connect_deadline, timeout
            )
            session = self._opening_call(
                "OpenSession", requests.open_session(name), connect_deadline, timeout
            )
        except BaseException:
            off_main_thread(self._channel.close)
            raise
        self.session_id: str = session.session_id
        #: the session's call channel (tensord.wire.channel), when the server offers one and
        #: ``use_call_channel`` allows it: unary calls take it before gRPC
        self.call_channel: CallChannel | None = None
        self._wants_channel = use_call_channel
        self._learn_channel(session)
        self.lease_seconds: float = session.lease_seconds or 10.0
        self.grace_seconds: float = session.grace_seconds
        LIVE_CONNECTIONS.add(self)
        _CHANNELS[self] = self._channel
        self._keepalive_call: Any = None  # the KeepAlive stream in progress
        self._keepalive = threading.Thread(
            target=self._heartbeat_forever, name="tensord-heartbeat", daemon=True
        )
        self._keepalive.start()
        self.pipeline.start()

    def _not_ready_message(self, probed: Probe, timeout: float) -> str:
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
        if probed is Probe.ACCEPTED:
            return (
                f"something at {self.address} accepted the connection but did not complete a "
                f"gRPC handshake in {timeout:g} s: a tensord server that is hung or "
                "overloaded, or no gRPC server (a dashboard's or metrics' HTTP port?); "
                f"{tls}"
            )
        return (
            f"no tensord server answers at {self.address} (waited {timeout:g} s); "
            f"{serve_hint(self.address)}; {tls}"
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
        return self._pid != fork.PROCESS_ID

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
            raise errors.SessionLostError(session_lost_message(session_id))

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
        ``orphaned``: see :func:`tensord.wire.worker.off_main_thread`."""
        self._check_open()
        return off_main_thread(
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
            if session:
                answered = self._on_channel(method, request, metadata[0][1], grpc_timeout)
                if answered is not None:
                    return answered
            try:
                return stub_method(request, metadata=metadata, timeout=grpc_timeout)
            except grpc.RpcError as err:
                if grpc_timeout is None or not is_own_deadline(err):
                    raise  # the server's own word, a DeadlineExceededError among them
                raise self._no_answer(method, grpc_timeout, str(error_from_rpc(err))) from None

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
            exc = error_from_rpc(err, self.address, self.node)
        except errors.NotFoundError as err:  # a call channel's answer, read back already
            exc = err
        if isinstance(exc, errors.NotFoundError) and str(exc) == UNKNOWN_SESSION:
            self._replace_session(session_id)
            raise errors.SessionLostError(session_lost_message(session_id)) from None
        raise exc from None

    # ---- the call channel (tensord.wire.channel) --------------------------------------

    def _learn_channel(self, session: pb.OpenSessionResponse) -> None:
        """Take the call channel an OpenSession answered (closing the one it replaces)."""
        old = self.call_channel
        self.call_channel = None
        if self._wants_channel and session.channel_key and session.channel_socket:
            self.call_channel = CallChannel(
                session.session_id, session.channel_key, session.channel_socket
            )
        if old is not None:
            old.close()

    def _on_channel(self, method: str, request: Any, session_id: str, timeout: float | None) -> Any:
        """The answer of a call in ``session_id`` on its call channel, or None: take gRPC
        (no channel, or it could not take this call now).  The call's errors are raised as
        gRPC's would read back."""
        channel = self.call_channel
        if channel is None or channel.session_id != session_id:
            return None
        try:
            return channel.unary(method, request, timeout)
        except errors.TensordError:  # the server's own word (a DeadlineExceededError among them)
            raise
        except TimeoutError:
            assert timeout is not None
            raise self._no_answer(method, timeout, "no answer on the call channel") from None
        except ChannelBroken as exc:
            raise errors.UnavailableError(
                f"{method}: the connection to the tensord server at {self.address} broke "
                f"during the call ({exc}); the server may have stopped"
            ) from None

    def _no_answer(self, method: str, timeout: float, why: str) -> errors.DeadlineExceededError:
        return errors.DeadlineExceededError(
            f"{method}: the tensord server at {self.address} did not answer within "
            f"{timeout:g} s ({why}); it may be hung or overloaded "
            f"(the deadline is connect()'s call_timeout, or ${CALL_TIMEOUT_ENV})"
        )

    def _batch_on_channel(self, request: pb.BatchRequest) -> Settled | None:
        """A Batch its caller waits for at once, answered on the call channel; None: gRPC."""
        timeout = self.call_timeout
        try:
            response = self._on_channel("Batch", request, self.session_id, timeout)
        except errors.TensordError as exc:
            return Settled(error=exc)
        return None if response is None else Settled(response)

    def call(self, method: str, request: Any, orphaned: Callable[[Any], None] | None = None) -> Any:
        """One unary call in this session (``method`` as named in the proto); ``orphaned``
        gets its answer if an interrupt took the caller away first (see off_main_thread)."""
        return self._unary(method, request, orphaned=orphaned)

    def upload(self, header: pb.UploadHeader, data: memoryview) -> pb.TensorMeta:
        """Stream ``data`` (bytes in logical order) as raw chunks; the server makes the tensor."""
        self._check_open()
        chunk = self.server_info.chunk_bytes or CHUNK_BYTES
        metadata = (*self.metadata(), (UPLOAD_HEADER_KEY, header.SerializeToString()))

        flat = data.cast("B")

        def send() -> pb.TensorMeta:
            stream = WatchedStream()
            if 0 < len(flat) <= min(chunk, ONE_MESSAGE_UPLOAD_BYTES):
                call = self._upload_one.future(bytes(flat), metadata=metadata)
            else:
                pieces = progressing(chunks(flat, chunk), stream)
                call = self._upload.future(pieces, metadata=metadata)
            with self._watched(stream, call):
                try:
                    meta: pb.TensorMeta = call.result()
                except (grpc.RpcError, grpc.FutureCancelledError):
                    if stream.cancelled:
                        raise self._stalled(f"Upload of {header.nbytes} bytes") from None
                    raise
            return meta

        return off_main_thread(lambda: self._in_session(metadata[0][1], send))

    def download_into(self, handle: str, out: memoryview) -> None:
        """Fill ``out`` (a writable byte buffer of the tensor's nbytes) with its elements."""
        self._check_open()
        request = requests.download(handle, CHUNK_BYTES)

        metadata = self.metadata()

        def receive() -> int:
            pos = 0
            stream = WatchedStream()
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

        received = off_main_thread(lambda: self._in_session(metadata[0][1], receive))
        if received != len(out):
            raise errors.InternalError(
                f"download of {handle} ended after {received} of {len(out)} bytes"
            )

    @contextlib.contextmanager
    def _watched(self, stream: WatchedStream, call: grpc.Future) -> Iterator[None]:
        """Run a transfer under the idle watchdog; an unfinished call is cancelled after it
        (an error or an interrupt mid-stream must not leave the server sending)."""
        track(call)
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

    # ---- pipelining (tensord.wire.batches) ------------------------------------------
    # enqueue, handle_used, queue_release, synchronize and settle are the pipeline's own
    # (bound in __init__); the connection sends its Batches and reads their answers

    @property
    def flush_scheduler(self) -> Callable[[Callable[[], None]], None] | None:
        """Where a full queue's flush runs (None: in the thread that filled it); tensord.aio
        hands it to an executor so a view never blocks the event loop."""
        return self.pipeline.flush_scheduler

    @flush_scheduler.setter
    def flush_scheduler(self, scheduler: Callable[[Callable[[], None]], None] | None) -> None:
        self.pipeline.flush_scheduler = scheduler

    def _send_batch(self, queued: list[QueuedOp], released: list[str], now: bool) -> BatchFuture:
        """Send one Batch of ``queued`` then ``released`` (the pipeline holds its send lock
        and collected the Batch before); ``now``: its caller waits for its answer at once, so
        the call channel may answer it (a Batch left in flight goes through gRPC)."""
        request = requests.batch(queued, released)
        if self.local is not None:
            self.local.before_call()
        future: grpc.Future | Settled | None = self._batch_on_channel(request) if now else None
        if future is None:
            timeout = None if self.call_timeout is None else self.call_timeout
            future = self._stub.Batch.future(request, metadata=self.metadata(), timeout=timeout)
        return future

    def _batch_answer(self, future: BatchFuture) -> Any:
        """A sent Batch's BatchResponse once it is answered, or its failure as tensord's
        error (returned: the pipeline keeps it for the next wait)."""
        try:
            return future.result()
        except grpc.RpcError as err:
            return error_from_rpc(err, self.address, self.node)
        except errors.TensordError as exc:  # a Batch the call channel answered
            return exc

    # ---- releases (batched) --------------------------------------------------------

    def queue_export_release(self, export_id: str) -> None:
        """Called from array finalizers and DLPack deleters: only appends, like queue_release."""
        if not self._closed.is_set():
            self._pending_exports.append(export_id)

    def _export_releases(self, batch: list[str]) -> pb.ReleaseExportsRequest:
        """ReleaseExports of ``batch``, with the segments mapped and the imports closed here."""
        mapped = self.local.mapped_segments() if self.local is not None else []
        closed = self.local.close_idle_imports() if self.local is not None else []
        return requests.release_exports(batch, mapped, closed)

    def _carried_releases(self) -> list[str]:
        """Handle releases a call may carry, applied before it (EmptyExport): only when every
        op queued before is applied, so no carried handle is one a queued op has yet to issue."""
        if self.inherited or self._closed.is_set():
            return []
        return self.pipeline.releases_applied_first(RELEASE_BATCH)

    def empty_export(self, empty: pb.EmptyRequest, carry_releases: bool) -> pb.EmptyExportResponse:
        """Empty then Export of the new tensor in one call (a same-host upload).

        ``carry_releases``: the handles and exports dropped before it are released first,
        in the same call, so the new tensor reuses the warm pages they free (fresh host pages
        cost about ten times the copy: `del x; x = client.tensor(a)` in a loop) without the
        round trips of a flush.  A failed call queues them again: the server may never have
        run it (UNIMPLEMENTED from an older server, UNAVAILABLE), and releasing an id twice
        is harmless (ids are random and never reused; unknown ones are ignored)."""
        # on a worker as a whole: an interrupt must not drop the releases it took
        return off_main_thread(
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
        handles: list[str] = []
        exports: list[str] = []
        if carry_releases and not self.inherited:
            handles = self._carried_releases()
            exports = take(self._pending_exports, RELEASE_BATCH)
        request = requests.empty_export(
            empty, handles, self._export_releases(exports) if exports else None
        )
        try:
            response: pb.EmptyExportResponse = self._unary("EmptyExport", request, sync=False)
        except BaseException:
            if not self._closed.is_set():  # else the session's end frees them
                self.pipeline.return_releases(handles)
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
            self.pipeline.flush_releases()
            return
        while self.pipeline.releases_pending and not self.inherited:
            # (another flusher may have emptied it meanwhile)
            batch = self.pipeline.take_releases(RELEASE_BATCH)
            if batch and not self._closed.is_set():
                # A failed release is harmless: the session's close or grace frees them anyway.
                with contextlib.suppress(errors.TensordError):
                    self._unary("Release", requests.release(batch), timeout=self._close_timeout)

    def _tick(self) -> None:
        """The flusher's work of each interval (on its thread), before the pipeline sends
        what is queued: gets' exports held past their time, then the export releases; without
        pipelining the handle releases too (with it they ride in the pipeline's ordered Batch,
        after the queued view that issued each handle)."""
        if self.local is not None:
            self.local.let_go()  # gets' exports held past their time go first
        if self.pipelining:
            self.flush_export_releases()
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
            with FORK_GATE.busy():
                self._beat(interval)

    def _keep_stream_open(self, session_id: str, interval: float) -> None:
        """Hold a KeepAlive stream of ``session_id`` until it ends or the client closes."""

        def beats() -> Iterator[pb.Heartbeat]:
            yield requests.heartbeat()
            while not self._closed.wait(interval) and self.session_id == session_id:
                with FORK_GATE.busy():  # spans the send of the beat yielded
                    yield requests.heartbeat()

        with FORK_GATE.busy():
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
                requests.heartbeat(),
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
        off_main_thread(functools.partial(self._replace_session_now, lost_id))

    def _replace_session_now(self, lost_id: str) -> None:
        request = requests.open_session(f"pid {os.getpid()} on {socket.gethostname()} (reopened)")
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
                self._learn_channel(response)

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
        off_main_thread(self._close_now)

    def _close_now(self) -> None:
        if self._closed.is_set():  # closed by another thread meanwhile
            return
        # One short deadline for all of it, so exit never hangs on a hung server.  No Release
        # first: closing the session frees its handles, the pending ones included.
        deadline = time.monotonic() + self._close_timeout
        if self.pipelining:  # queued writes may reach Storages other sessions share
            with contextlib.suppress(errors.TensordError, grpc.RpcError):
                self.pipeline.flush(wait=True)
            self.pipeline.drop_error()  # the session ends: nothing waits for its ops any more
        if self.local is not None:  # while the pool's memory there is still this session's
            self.local.make_private()
        with contextlib.suppress(errors.TensordError):
            self._unary(
                "CloseSession", requests.close_session(), timeout=self._close_timeout, sync=False
            )
        self._closed.set()
        self.pipeline.wake_flusher()  # the flusher sees the end now
        if self._watchdog is not None:
            self._watchdog.stop()
        # a beat or a release in flight has its own deadline, and closing the channel
        # cancels it: the threads are daemons, so no need to wait them out
        if self._keepalive_call is not None:  # its beats end with _closed; end it now
            with contextlib.suppress(Exception):
                self._keepalive_call.cancel()
        self._keepalive.join(timeout=max(deadline - time.monotonic(), 0.0))
        self.pipeline.stop(timeout=max(deadline - time.monotonic(), 0.0))
        self._pending_exports.clear()
        channel, self.call_channel = self.call_channel, None
        if channel is not None:  # the session's end made its key useless
            channel.close()
        self._channel.close()
