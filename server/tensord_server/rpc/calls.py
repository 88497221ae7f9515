"""How a call travels through the asyncio server, in order, before and after its work.

1. **Authenticate** from the call's metadata, before anything of its body is read (with
   ``--auth-tokens``, a caller without a valid token gets UNAUTHENTICATED and the server
   never asks gRPC for its request: at most one HTTP/2 flow-control window of it ever
   arrives).  Every method is registered as request-*streaming* so that the handler runs
   before the request is read; unary clients send the same bytes either way.
2. **Read** the request with a deadline (``--stream-idle-timeout``), at most
   ``READS_PER_KEY`` reads in progress per key; refuse it if it is longer than its
   method's receive limit (:data:`RECEIVE_LIMITS`: any call 4 MiB, an upload chunk the
   largest chunk, liveness calls 64 KiB), then reserve its bytes
   in the :class:`~tensord_server.rpc.executor.RequestBudget` until the call ends.
3. **Queue** its work on the :class:`~tensord_server.rpc.executor.FairExecutor`: calls of
   one key (the tenant; without tenants, the connection) take turns with every other key's.
   Liveness calls (OpenSession, Heartbeat, CloseSession) have a pool of their own.
4. **Work** on a worker thread: decode and bound the message
   (:func:`~tensord_server.rpc.codec.decode_message`), call the synchronous
   :class:`~tensord_server.rpc.handlers.TensordService` method, encode the reply.  A
   small call of :data:`INLINE_WORK` (a view, a name, a release) does the same on the
   event loop while no worker is busy or awaited, sparing two thread handoffs.
5. **Answer**: the reply's bytes count against the key's undelivered-answer budget
   (``MAX_UNDELIVERED_ANSWER_BYTES``) until gRPC has delivered them, so a caller that does
   not read its answers is refused new calls instead of pinning their bytes in the server.

Streams are steps of the same shape: an Upload writes each chunk on a worker as it
arrives, a Download computes each chunk on a worker and awaits its reader holding no
thread (each wait bounded by the idle timeout; a Download of one plain chunk of host
memory is read on the loop while no worker is busy, as a small unary call's work is),
and a KeepAlive stream keeps its session connected for as long as gRPC keeps the stream
open (its end is detected by gRPC itself:
the client closing it, the connection breaking, or the transport's keepalive pings going
unanswered), so no amount of load on the server can make a live client's session lapse.

A unary call that comes on a session's *call channel* (the same-host fd socket,
:mod:`tensord_server.rpc.fd_socket`) takes the same steps in the same order
(:meth:`Calls.channel_call`): its channel's bind stands for step 1 (the key names one
session of one tenant), its frame's length is checked against the method's receive limit
before a byte of it is read, and its answer carries the status code, message and trailers'
values that gRPC's status would.

Errors from any step leave through :func:`abort`, with the status of
:mod:`tensord_server.rpc.status`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message
from tensord import schema as pb
from tensord.errors import (
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    UnauthenticatedError,
)
from tensord.protocol import (
    AUTHORIZATION_KEY,
    CHECKSUM_KEY,
    NODE_TENANT_KEY,
    NODE_TOKEN_KEY,
    SESSION_KEY,
)

from tensord_server.domain import auth
from tensord_server.domain.auth import describe_tenant
from tensord_server.domain.exports import Channel
from tensord_server.domain.ops.transfers import (
    MAX_CHUNK_BYTES,
    UploadSink,
    download_chunk_bytes,
)
from tensord_server.domain.store import TensorStore
from tensord_server.observability import observer_for  # observability hook
from tensord_server.pool.stats import is_gpu
from tensord_server.rpc import status
from tensord_server.rpc.codec import decode_message
from tensord_server.rpc.executor import FairExecutor, RequestBudget, within
from tensord_server.rpc.fd_socket import CallFrame, ChannelConnection, FdSocket
from tensord_server.rpc.handlers import SERVICE_NAME, TensordService

log = logging.getLogger(__name__)

T = TypeVar("T")

# A call's request: a few MiB hold any request the list and string limits allow (a Batch of
# MAX_BATCH_OPS ops, an index of MAX_REQUEST_ITEMS items).
CONTROL_REQUEST_BYTES = 4 << 20
# A liveness call's request (a beat, a client name and a session id).
LIVENESS_REQUEST_BYTES = 64 << 10
RECEIVE_LIMITS: dict[str, int] = collections.defaultdict(
    lambda: CONTROL_REQUEST_BYTES,
    {
        "Upload": MAX_CHUNK_BYTES,
        "Heartbeat": LIVENESS_REQUEST_BYTES,
        "KeepAlive": LIVENESS_REQUEST_BYTES,
        "OpenSession": LIVENESS_REQUEST_BYTES,
        "CloseSession": LIVENESS_REQUEST_BYTES,
        "ServerInfo": LIVENESS_REQUEST_BYTES,
    },
)
# gRPC's own per-message limit on the server: the largest of the above (anything longer is
# refused by gRPC core before Python sees a byte of it).
MAX_RECEIVE_BYTES = max(CONTROL_REQUEST_BYTES, MAX_CHUNK_BYTES)
# Calls that keep a client alive run on a pool of their own, never behind other work
# (each only authenticates and takes the session table's lock: its cost is bounded).
LIVENESS_METHODS = frozenset({"OpenSession", "Heartbeat", "CloseSession", "ServerInfo"})
LIVENESS_WORKERS = 2
# Calls whose work is a few table lookups bounded by their small request.  While no worker
# is busy and none is waiting, such a call runs on the event loop itself: its two thread
# handoffs would be most of its latency, and with the workers idle it takes nobody's turn.
# A view that makes a tensor per part (split, chunk, unbind) goes to a worker, and so does
# a flatten: one of a tensor no view can express copies it (up to --max-op-elements), and
# the loop would be held for that copy.
INLINE_REQUEST_BYTES = 1024
_WORKER_VIEWS = frozenset({"split", "chunk", "unbind", "flatten"})


def _always(request: Message) -> bool:
    return True


INLINE_WORK: dict[str, Callable[[Any], bool]] = {
    "Release": _always,
    "View": lambda request: request.WhichOneof("op") not in _WORKER_VIEWS,
    "GetName": _always,
    # a staged put copies its bytes: a worker's
    "PutName": lambda request: not request.HasField("staged"),
    "DeleteName": _always,
    # within INLINE_REQUEST_BYTES a batch names a few dozen names at most
    "GetNames": _always,
    "PutNames": lambda request: not any(i.HasField("staged") for i in request.items),
    "DeleteNames": _always,
    # a get and a host export (GPU tensors are never exported by it): table work, and the
    # mapped segments it searches are bounded by INLINE_REQUEST_BYTES (with tiers, a
    # worker's: TIER_WORK)
    "GetNameExport": _always,
    # an Export of host memory: the same table work as GetNameExport's, without the name
    # (with tiers, a worker's: TIER_WORK; on a server with a GPU, a worker's: GPU_WORK)
    "Export": _always,
    "Share": _always,
    "Revoke": _always,
    "Attach": _always,
    "Heartbeat": _always,
    "ServerInfo": _always,
}
# Name calls that wait on the cluster's directory (a round trip to etcd) once the server
# joined one: never on the loop then.
CLUSTER_WORK = frozenset(
    {
        "GetName",
        "PutName",
        "DeleteName",
        "GetNames",
        "PutNames",
        "DeleteNames",
        "GetNameExport",
        # a share token of another node: etcd says where that node is
        "Attach",
        "Revoke",
    }
)
# Calls that may restore a spilled Storage (an export holds its bytes: a read from the disk
# as large as the pool, and the spills that make its room) once the server has tiers:
# never on the loop then.
TIER_WORK = frozenset({"GetNameExport", "Export"})
# Calls that may wait for a GPU's queued work (an Export of GPU memory synchronizes the
# server stream before it hands out the segment's IPC handle) once the server has a GPU:
# never on the loop then.
GPU_WORK = frozenset({"Export"})
# Health Checks (which need no token) being read at once, in all; and how long one may take.
UNAUTHENTICATED_READS = 8
HEALTH_READ_TIMEOUT_S = 2.0
HEALTH_SERVICE = "grpc.health.v1.Health"
# Requests of one key being read at once (each may be at most its receive limit).
READS_PER_KEY = 16
# Answer bytes of one key gRPC has not delivered yet (a reader that does not read): unary
# answers and Download chunks, counted until their call ends.
MAX_UNDELIVERED_ANSWER_BYTES = 256 << 20
# The largest Download chunk the server sends, whatever the client asks: gRPC takes a
# written message whole, so a stream nobody reads holds about two of them.
MAX_DOWNLOAD_CHUNK_BYTES = 1 << 20

Metadatum = collections.namedtuple("Metadatum", "key value")
DEADLINE = grpc.StatusCode.DEADLINE_EXCEEDED
# The metrics' method label of a call-channel frame naming no method of the service.
UNKNOWN_METHOD = "(unknown)"


class ClientGone(ConnectionError):
    """A call channel's client closed its connection before its request was read whole."""


class CallAborted(Exception):
    """A handler's own status for its call (``Call.abort``)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code


class Call:
    """What a synchronous handler and the observer see of a call: the few methods of gRPC's
    ServicerContext they use, answered from values taken on the event loop (from gRPC's
    context, or given: a call channel's)."""

    __slots__ = (
        "_callbacks",
        "_code",
        "_details",
        "_done",
        "_metadata",
        "_peer",
        "deadline",
        "key",
        "tenant",
    )

    def __init__(
        self,
        context: grpc.aio.ServicerContext | None,
        tenant: str | None,
        key: Hashable,
        metadata: tuple[Metadatum, ...] = (),
        peer: str = "",
    ):
        if context is not None:
            metadata = tuple(Metadatum(k, v) for k, v in context.invocation_metadata() or ())
            peer = context.peer()
        self._metadata = metadata
        self._peer = peer
        self.tenant = tenant
        self.key = key
        #: time.monotonic() past which the caller waits no more (a call channel's; gRPC ends
        #: its own calls at their deadline); None: none
        self.deadline: float | None = None
        self._done = False
        self._callbacks: list[Callable[[], None]] = []
        self._code: grpc.StatusCode | None = None
        self._details = ""

    def invocation_metadata(self) -> tuple[Metadatum, ...]:
        return self._metadata

    def peer(self) -> str:
        return str(self._peer)

    def is_active(self) -> bool:
        return not self._done and (self.deadline is None or time.monotonic() < self.deadline)

    def add_callback(self, callback: Callable[[], None]) -> bool:
        """Run ``callback`` when the call ends (now, if it has ended already)."""
        if self._done:
            callback()
        else:
            self._callbacks.append(callback)
        return True

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        """End the call with ``code`` (as gRPC's ServicerContext.abort: raises)."""
        raise CallAborted(code, details)

    def details(self) -> str:
        return self._details

    def ended(self, code: grpc.StatusCode, details: str = "") -> None:
        self._code, self._details = code, details

    def terminated(self) -> None:
        """gRPC ended the call (delivered, cancelled or broken): run its callbacks."""
        self._done = True
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback()
            except Exception:
                log.exception("a call's end callback failed")


class _DownloadChunks:
    """A Download's chunks, read and closed from any thread, one step at a time: a close
    waits for a read under way (a generator cannot be closed while it runs), and a read
    after the close gets None.  The generator is made by the first read."""

    def __init__(self, make: Callable[[], Iterator[bytes]]) -> None:
        self._make: Callable[[], Iterator[bytes]] | None = make
        self._chunks: Iterator[bytes] | None = None
        self._step = threading.Lock()

    def next(self) -> bytes | None:
        """The next chunk; None after the last one, or once closed."""
        with self._step:
            if self._make is not None:
                self._chunks, self._make = self._make(), None
            chunk = None if self._chunks is None else next(self._chunks, None)
            if chunk is None:
                self._chunks = None  # ran to its end: nothing left to close
            return chunk

    @property
    def open(self) -> bool:
        """Whether a close has anything to end (a read under way keeps it open)."""
        return self._make is not None or self._chunks is not None

    def close(self) -> None:
        with self._step:
            chunks, self._chunks, self._make = self._chunks, None, None
            close = getattr(chunks, "close", None)
            if close is not None:
                close()


def _metadata_value(metadata: Any, key: str) -> Any:
    for item_key, value in metadata or ():
        if item_key == key:
            return value
    return None


@dataclass(frozen=True, slots=True)
class Method:
    name: str
    request_cls: type[Message]
    receive_limit: int
    liveness: bool


class Calls:
    """The asyncio handlers of every Tensord method, over one :class:`TensordService`."""

    def __init__(self, store: TensorStore, workers: int) -> None:
        self.store = store
        self.service = TensordService(store)
        self.observer = observer_for(store)
        self.work = FairExecutor(workers, "tensord")
        self.liveness = FairExecutor(LIVENESS_WORKERS, "tensord-liveness")
        self.budget = RequestBudget()
        #: the fd socket (:meth:`open_fd_socket`, on the server's loop)
        self.fd_socket: FdSocket | None = None
        self.methods = _methods()
        # what a call channel may carry: every unary method of the schema (streams take gRPC)
        self._unary_methods = {
            d.name: self.methods[d.name]
            for d in pb.DESCRIPTOR.services_by_name["Tensord"].methods
            if not (d.client_streaming or d.server_streaming)
        }
        self._reads: dict[Hashable, _Readers] = {}
        self._answers: dict[Hashable, int] = {}
        # the KeepAlive streams' calls, ended first when the server stops; from then on a
        # stream that reaches its handler (accepted before the stop) is ended at once
        self._keepalives: set[grpc.aio.ServicerContext] = set()
        self._ending_keepalives = False
        # health Checks answer without a token: a few read at once, so their bodies (up to
        # gRPC's message limit) cannot pile up in the server
        self._unauthenticated_reads = asyncio.Semaphore(UNAUTHENTICATED_READS)
        # fixed for the server's life: its device table is immutable
        self._has_gpu = any(is_gpu(device.name) for device in store.devices)

    def shutdown(self) -> None:
        self.work.shutdown()
        self.liveness.shutdown()
        if self.fd_socket is not None:
            self.fd_socket.forget()  # (closed already on the loop, unless it never stopped)

    async def end_keepalives(self) -> None:
        """End every KeepAlive stream with UNAVAILABLE (the server is stopping: an open
        stream would hold the stop for its whole grace)."""
        self._ending_keepalives = True
        for context in list(self._keepalives):
            with contextlib.suppress(Exception):  # abort raises once the status is sent
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is stopping")

    async def _held_open(self, context: grpc.aio.ServicerContext) -> None:
        """Count a stream that stays open until its client ends it, which the server's stop
        ends first; one that reached its handler after the stop began is ended now."""
        self._keepalives.add(context)
        if self._ending_keepalives:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is stopping")

    # -- the steps every call takes ------------------------------------------------------

    def authenticate(self, context: grpc.aio.ServicerContext) -> tuple[str, Hashable]:
        """(tenant, fairness key); UnauthenticatedError before anything else is done."""
        metadata = context.invocation_metadata()
        node_token = _metadata_value(metadata, NODE_TOKEN_KEY)
        node_for = _metadata_value(metadata, NODE_TENANT_KEY)
        if node_token is not None or node_for is not None:
            # another node, acting for a tenant: the tenant's own limits and share apply
            tenant = auth.node_tenant(self.store.cluster_token, node_token, node_for)
            if self.store.auth_tokens is None:
                if tenant:
                    raise UnauthenticatedError("node call refused: this node has no tenants")
                return "", ("peer", context.peer())
            return tenant, ("tenant", tenant)
        if self.store.auth_tokens is None:
            return "", ("peer", context.peer())  # one trust domain: each connection its share
        tenant = self.tenant_of(metadata)
        return tenant, ("tenant", tenant)

    def tenant_of(self, metadata: Any) -> str:
        """The tenant a call's metadata authenticates as ("" without --auth-tokens);
        UnauthenticatedError without a valid token."""
        tokens = self.store.auth_tokens
        if tokens is None:
            return ""
        return auth.tenant_of(tokens, _metadata_value(metadata, AUTHORIZATION_KEY))

    def describe(self, call: Call) -> str:
        if self.store.auth_tokens is None:
            return f"the connection {call.peer()}"
        return describe_tenant(call.tenant or "")

    async def read(self, context: grpc.aio.ServicerContext, call: Call, method: Method) -> Any:
        """The next request message's bytes (EOF at the end of a stream), or an error."""
        raw = await self._read_within(call, method, context.read)
        if raw is not grpc.aio.EOF:
            self.check_length(method, len(raw))
        return raw

    async def _read_within(
        self, call: Call, method: Method, reading: Callable[[], Awaitable[Any]]
    ) -> Any:
        """``await reading()`` in one of the key's READS_PER_KEY read slots, within the idle
        timeout (a request that does not arrive in time: DeadlineExceededError)."""
        reads = self._reads.get(call.key)
        if reads is None:
            reads = self._reads[call.key] = _Readers(READS_PER_KEY)
        timeout = self.store.gate.idle_timeout
        reads.users += 1
        try:
            async with reads.slots:
                return await within(
                    reading(),
                    timeout,
                    f"{method.name}: no request message for {timeout:g}s "
                    f"(--stream-idle-timeout {timeout:g})",
                )
        finally:
            reads.users -= 1
            if not reads.users:
                del self._reads[call.key]

    @staticmethod
    def check_length(method: Method, nbytes: int) -> None:
        """A request longer than its method's receive limit is refused by its length."""
        if nbytes > method.receive_limit:
            raise InvalidArgumentError(
                f"a {method.name} request of {nbytes} bytes; the limit is {method.receive_limit}"
            )

    def check_answers(self, call: Call) -> None:
        held = self._answers.get(call.key, 0)
        if held >= MAX_UNDELIVERED_ANSWER_BYTES:
            raise ResourceExhaustedError(
                f"{self.describe(call)} has {held} bytes of answers it has not read, the limit "
                f"({MAX_UNDELIVERED_ANSWER_BYTES}); read them before making more calls"
            )

    def hold_answer(self, call: Call, nbytes: int) -> None:
        """Count ``nbytes`` of answer until the call ends (gRPC delivered it, or gave up)."""
        if not nbytes:
            return
        key = call.key
        self._answers[key] = self._answers.get(key, 0) + nbytes

        def delivered() -> None:
            left = self._answers[key] - nbytes
            if left:
                self._answers[key] = left
            else:
                del self._answers[key]

        call.add_callback(delivered)

    def start(self, context: grpc.aio.ServicerContext) -> Call:
        """Authenticate and make the call's record; its end runs the record's callbacks."""
        tenant, key = self.authenticate(context)
        call = Call(context, tenant, key)
        context.add_done_callback(lambda _: call.terminated())
        return call

    async def abort(
        self, context: grpc.aio.ServicerContext, call: Call | None, method: str, exc: BaseException
    ) -> None:
        code = status.status_for(exc)
        if code is grpc.StatusCode.INTERNAL:
            log.exception("internal error in a tensord handler", exc_info=exc)
        details = status.details_for(exc)
        if call is not None:
            call.ended(code, details)
        await context.abort(code, details, status.trailers_for(exc))

    def observe_other(
        self,
        method: str,
        context: grpc.aio.ServicerContext,
        started: float,
        error: BaseException | None,
    ) -> None:
        """The observer's record of another service's call (health, reflection)."""
        call = Call(context, None, None)
        if error is None:
            call.ended(grpc.StatusCode.OK)
        elif isinstance(error, asyncio.CancelledError):
            call.ended(grpc.StatusCode.CANCELLED)
        else:  # an abort: gRPC holds the code it sent
            code = context.code()
            if not isinstance(code, grpc.StatusCode):
                code = status.status_for(error)
            details = context.details()
            call.ended(code, details.decode() if isinstance(details, bytes) else details or "")
        self.observed(method, call, started)

    def observed(self, method: str, call: Call, started: float, response: Any = None) -> None:
        """The observer's record of a finished call (metrics, access and event logs)."""
        try:
            self.observer.finished(
                method, call, started, call.code() or grpc.StatusCode.OK, response
            )
        except Exception:
            log.exception("observing %s failed", method)

    # -- unary-response calls --------------------------------------------------------------

    async def unary(self, method: Method, requests: Any, context: grpc.aio.ServicerContext) -> Any:
        started = time.perf_counter()
        call: Call | None = None
        try:
            call = self.start(context)
            self.check_answers(call)
            raw = await self.read(context, call, method)
            if raw is grpc.aio.EOF:
                raise InvalidArgumentError(f"a {method.name} call without its request message")
            describe = self.describe(call)
            with self.budget.reserve(call.key, len(raw), describe):
                response, data = await self._run(method, raw, call, describe)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await self._abort_observed(context, call, method.name, exc, started)
            raise AssertionError("unreachable: abort raises") from None
        self.hold_answer(call, len(data))
        call.ended(grpc.StatusCode.OK)
        self.observed(method.name, call, started, response)
        return data

    def _run(
        self, method: Method, raw: bytes, call: Call, describe: str
    ) -> Awaitable[tuple[Message, bytes]]:
        """The call's work, queued fairly under its key (liveness calls on their own pool);
        a small one of INLINE_WORK may run on the loop (FairExecutor.run's ``inline``)."""
        executor = self.liveness if method.liveness else self.work
        request, small = self._decoded_here(method, raw)
        if request is None:
            work = functools.partial(self._work, method, raw, call)
        else:
            work = functools.partial(self._answer, method, request, call)
        return executor.run(call.key, work, describe, inline=small)

    def _work(self, method: Method, raw: bytes, call: Call) -> tuple[Message, bytes]:
        return self._answer(method, decode_message(method.request_cls, raw), call)

    def _answer(self, method: Method, request: Message, call: Call) -> tuple[Message, bytes]:
        response = getattr(self.service, method.name)(request, call)
        return response, response.SerializeToString()

    def _decoded_here(self, method: Method, raw: bytes) -> tuple[Message | None, bool]:
        """(the request decoded on the loop, whether its work is small enough to run there)
        for a call of INLINE_WORK within INLINE_REQUEST_BYTES; (None, False) for any other,
        decoded on its worker (a bad one is refused there).  A decoded request that is not
        small goes to its worker as it is: it is not decoded twice."""
        small = INLINE_WORK.get(method.name)
        if small is None or len(raw) > INLINE_REQUEST_BYTES:
            return None, False
        if method.name in CLUSTER_WORK and self.service.store.names.directory is not None:
            return None, False
        if method.name in TIER_WORK and self.service.store.storages.tiers:
            return None, False
        if method.name in GPU_WORK and self._has_gpu:
            return None, False
        try:
            request = decode_message(method.request_cls, raw)
        except Exception:
            return None, False
        return request, small(request)

    # -- calls on a session's call channel (the fd socket) -----------------------------------

    def open_fd_socket(self) -> None:
        """Make the fd socket on the running loop (the server's): descriptors for tickets and
        the sessions' call channels.  Without it (no private directory could be made, say)
        same-host clients use gRPC for everything."""
        try:
            self.fd_socket = FdSocket(self.store.exports, self)
        except OSError as exc:
            log.warning("no fd socket (same-host clients will use gRPC only): %s", exc)
            return
        self.service.fd_socket = self.fd_socket

    async def close_fd_socket(self, grace: float | None) -> None:
        if self.fd_socket is not None:
            await self.fd_socket.aclose(grace)

    async def channel_call(
        self, channel: Channel, conn: ChannelConnection, frame: CallFrame
    ) -> None:
        """One unary call that came on a session's call channel, through :meth:`unary`'s
        steps in its order: the channel's bind stands for authentication (its session's
        tenant, the key gRPC would use: the tenant, or without tenants the connection), the
        frame's length is checked against the method's receive limit before a byte of the
        request is read, the bytes are reserved and read in one of the key's read slots,
        the same handler runs on the same executor, and an error answers the status code,
        message and trailers gRPC would carry.  The client's deadline, if it sent one,
        bounds the wait as gRPC's does (``Call.is_active`` turns false at it)."""
        started = time.perf_counter()
        tenant = channel.key.tenant
        key = ("tenant", tenant) if self.store.auth_tokens is not None else ("peer", conn.peer)
        session = (Metadatum(SESSION_KEY, channel.key.session_id),)
        call = Call(None, tenant, key, session, conn.peer)
        if frame.timeout is not None:
            call.deadline = time.monotonic() + frame.timeout
        idle_timeout = self.store.gate.idle_timeout
        method = self._unary_methods.get(frame.method)
        # what the metrics count it under: the client names the method, so a name that is
        # none of the service's is counted under one label, not one per name sent
        observed_as = method.name if method is not None else UNKNOWN_METHOD
        try:
            if method is None:
                raise CallAborted(
                    grpc.StatusCode.UNIMPLEMENTED,
                    f"{frame.method!r} is no unary method of {SERVICE_NAME} (streams take gRPC)",
                )
            self.check_answers(call)
            self.check_length(method, frame.nbytes)
            describe = self.describe(call)
            with self.budget.reserve(call.key, frame.nbytes, describe):
                try:
                    # a small frame arrives whole: nothing to wait for, no read slot taken
                    raw = conn.buffered_request(frame.nbytes)
                    if raw is None:
                        raw = await self._read_within(
                            call, method, functools.partial(conn.read_request, frame.nbytes)
                        )
                except OSError as exc:  # the client went mid-request: nobody to answer
                    call.ended(grpc.StatusCode.CANCELLED)
                    self.observed(observed_as, call, started)
                    call.terminated()
                    raise ClientGone(str(exc)) from None
                work = self._run(method, raw, call, describe)
                if frame.timeout is not None:
                    work = within(work, frame.timeout, f"{method.name}: deadline exceeded")
                response, data = await work
        except (asyncio.CancelledError, ClientGone):
            raise
        except Exception as exc:
            if call.deadline is not None and time.monotonic() >= call.deadline:
                # past the client's deadline: what gRPC answers then (its own status, no
                # trailer), which the client reads as its deadline passing
                code, message, error_type, details = DEADLINE, "Deadline Exceeded", "", ""
            else:
                code, message, error_type, details = status.error_fields(exc)
            if code is grpc.StatusCode.INTERNAL:
                log.exception("internal error in a tensord handler", exc_info=exc)
            call.ended(code, message)
            self.observed(observed_as, call, started)
            call.terminated()
            await conn.answer(
                frame.request_id, code.value[0], message, error_type, details, b"", idle_timeout
            )
            return
        self.hold_answer(call, len(data))  # until written: a reader that does not read
        call.ended(grpc.StatusCode.OK)
        self.observed(method.name, call, started, response)
        try:
            await conn.answer(frame.request_id, 0, "", "", "", data, idle_timeout)
        finally:
            call.terminated()

    async def _abort_observed(
        self,
        context: grpc.aio.ServicerContext,
        call: Call | None,
        method: str,
        exc: BaseException,
        started: float,
    ) -> None:
        if call is None:  # refused before it was authenticated
            call = Call(context, None, None)
        code = status.status_for(exc)
        call.ended(code, status.details_for(exc))
        self.observed(method, call, started)
        await self.abort(context, call, method, exc)

    # -- streams -----------------------------------------------------------------------------

    async def upload(self, method: Method, requests: Any, context: grpc.aio.ServicerContext) -> Any:
        started = time.perf_counter()
        call: Call | None = None
        sink = None
        try:
            call = self.start(context)
            self.check_answers(call)
            describe = self.describe(call)
            with self._admitted(call, method.name):
                session, sink = await self.work.run(
                    call.key, functools.partial(self.service.upload_sink, call), describe
                )
                await self._write_chunks(context, call, method, sink, describe)
                reply, checksum = await self.work.run(
                    call.key,
                    functools.partial(self.service.upload_finished, session, sink),
                    describe,
                )
            if checksum is not None:
                context.set_trailing_metadata(((CHECKSUM_KEY, str(checksum)),))
            data = reply.SerializeToString()
            self.hold_answer(call, len(data))
            call.ended(grpc.StatusCode.OK)
            self.observed(method.name, call, started, reply)
            return data
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if sink is not None:  # before the status: the client may look at once
                sink.abort()
            await self._abort_observed(context, call, method.name, exc, started)
        finally:
            if sink is not None:
                sink.abort()  # not issued: its Storage goes back (a no-op after finish)

    async def _write_chunks(
        self,
        context: grpc.aio.ServicerContext,
        call: Call,
        method: Method,
        sink: UploadSink,
        describe: str,
    ) -> None:
        """Each chunk of an Upload written into ``sink`` on a worker while the next one is
        read: one write at a time, in order, each within the budget of bytes in flight.
        Returns (or raises) only once no write runs, so the sink may be finished or
        aborted then."""
        writing: asyncio.Future[None] | None = None  # the chunk before's, while this is read
        try:
            while True:
                chunk = await self.read(context, call, method)
                if writing is not None:
                    # its error, if any, is the call's; a cancelled call still lets it end
                    await asyncio.shield(writing)
                    writing = None
                if chunk is grpc.aio.EOF:
                    return
                self.observer.uploaded.inc(len(chunk))
                writing = asyncio.ensure_future(self._write_chunk(call, sink, chunk, describe))
        finally:
            if writing is not None:  # the call failed while a write ran: it ends first
                await asyncio.gather(writing, return_exceptions=True)

    async def _write_chunk(self, call: Call, sink: UploadSink, chunk: bytes, describe: str) -> None:
        with self.budget.reserve(call.key, len(chunk), describe):
            await self.work.run(call.key, functools.partial(sink.write, chunk), describe)

    async def download(
        self, method: Method, requests: Any, context: grpc.aio.ServicerContext
    ) -> None:
        started = time.perf_counter()
        call: Call | None = None
        chunks: _DownloadChunks | None = None
        reading: asyncio.Future[bytes | None] | None = None  # the next chunk, on a worker
        try:
            call = self.start(context)
            raw = await self.read(context, call, method)
            if raw is grpc.aio.EOF:
                raise InvalidArgumentError("a Download call without its request message")
            describe = self.describe(call)
            timeout = self.store.gate.idle_timeout
            # the stream's slot is held until gRPC frees the stream, not until this handler
            # ends: chunks written to a reader that does not read stay in gRPC meanwhile
            self._admit_until_done(call, method.name)
            request = decode_message(pb.DownloadRequest, raw)
            # the size the chunks will have (none asked, or a negative size: the default)
            request.chunk_bytes = download_chunk_bytes(
                request.chunk_bytes, MAX_DOWNLOAD_CHUNK_BYTES
            )
            # gRPC holds the chunk being sent and the one written after it, and the chunk
            # after those is read meanwhile: counted as the stream's undelivered answer for
            # its whole life
            self.check_answers(call)
            self.hold_answer(call, 3 * request.chunk_bytes)
            # a tensor of one plain chunk is read on the loop: it is the whole stream
            chunk = await self._read_whole_here(request, call, describe)
            if chunk is None:
                chunks = _DownloadChunks(
                    functools.partial(self.service.download_chunks, request, call)
                )
                chunk = await self.work.run(call.key, chunks.next, describe)
            while chunk is not None:
                self.observer.downloaded.inc(len(chunk))
                if chunks is not None:
                    # the next chunk is read on a worker while gRPC takes this one
                    reading = asyncio.ensure_future(self.work.run(call.key, chunks.next, describe))
                await within(
                    context.write(chunk),
                    timeout,
                    f"Download idle for {timeout:g}s (the client neither sent nor read "
                    f"anything; --stream-idle-timeout {timeout:g})",
                )
                chunk = None if reading is None else await reading
                reading = None
            call.ended(grpc.StatusCode.OK)
            self.observed(method.name, call, started)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # before the status (the client may look at once): a read under way ends first
            await self._close_chunks(chunks, reading)
            await self._abort_observed(context, call, method.name, exc, started)
        finally:
            await self._close_chunks(chunks, reading)

    async def _read_whole_here(
        self, request: pb.DownloadRequest, call: Call, describe: str
    ) -> bytes | None:
        """A Download's one chunk read on the loop, while no worker is busy or awaited, when
        it is one plain read of host memory (``Transfers.read_whole``: a lookup and a copy
        of at most MAX_DOWNLOAD_CHUNK_BYTES): the two thread handoffs of its generator
        would cost more than the copy.  None: the chunks stream from a worker (a GPU
        server, tiers, a gathered or lazily conjugated tensor, one of several chunks, or
        a busy server)."""
        if self._has_gpu or self.store.storages.tiers or not self.work.idle:
            return None
        read = functools.partial(self.service.download_whole, request, call)
        return await self.work.run(call.key, read, describe, inline=True)

    @staticmethod
    async def _close_chunks(
        chunks: _DownloadChunks | None, reading: asyncio.Future[bytes | None] | None
    ) -> None:
        """End a Download's chunks on a thread (its held handle goes back): a read still
        queued gives its turn back, one under way ends first (a no-op once closed)."""
        if reading is not None:
            if not reading.done():
                reading.cancel()
            elif not reading.cancelled():
                reading.exception()  # seen: the call failed for another reason first
        if chunks is not None and chunks.open:
            await asyncio.get_running_loop().run_in_executor(None, chunks.close)

    async def keepalive(
        self, method: Method, requests: Any, context: grpc.aio.ServicerContext
    ) -> None:
        started = time.perf_counter()
        call: Call | None = None
        session = None
        sessions = self.store.sessions
        try:
            await self._held_open(context)
            call = self.start(context)
            describe = self.describe(call)
            # no stream admission: a session holds at most a few (sessions.stream_opened)
            session = await self.liveness.run(
                call.key, functools.partial(self.service.keepalive_session, call), describe
            )
            # beats are answered for the client's round-trip time; the session is alive
            # while the stream is, so a beat that waits costs the client nothing
            while True:
                beat = await context.read()
                if beat is grpc.aio.EOF:
                    break
                if len(beat) > method.receive_limit:
                    raise InvalidArgumentError(
                        f"a KeepAlive beat of {len(beat)} bytes; the limit is "
                        f"{method.receive_limit}"
                    )
                message = decode_message(pb.Heartbeat, beat)
                sessions.heartbeat(session)
                await context.write(pb.Heartbeat(sent_at=message.sent_at).SerializeToString())
            call.ended(grpc.StatusCode.OK)
            self.observed(method.name, call, started)
        except asyncio.CancelledError:
            raise
        except grpc.aio.AbortError:
            raise  # ended by the server's stop (end_keepalives): its status is sent
        except Exception as exc:
            await self._abort_observed(context, call, method.name, exc, started)
        finally:
            self._keepalives.discard(context)
            if session is not None:
                sessions.stream_closed(session)

    def _admit_until_done(self, call: Call, method: str) -> None:
        """A stream's admission, held until gRPC ends the call."""
        gate = self.store.gate
        stream_id = gate.open_stream(method, call.tenant or "")
        call.add_callback(functools.partial(gate.close_stream, stream_id))

    @contextlib.contextmanager
    def _admitted(self, call: Call, method: str) -> Iterator[None]:
        """A stream's admission (refused at once over --max-streams or a tenant's share)."""
        gate = self.store.gate
        stream_id = gate.open_stream(method, call.tenant or "")
        call.add_callback(functools.partial(gate.close_stream, stream_id))  # idempotent
        try:
            yield
        finally:
            gate.close_stream(stream_id)

    async def health_check(self, requests: Any, context: grpc.aio.ServicerContext) -> bytes:
        """gRPC's health Check (no token needed): SERVING for "" and the Tensord service."""
        from grpc_health.v1 import health_pb2

        started = time.perf_counter()
        try:
            async with self._unauthenticated_reads:
                raw = await within(
                    context.read(),
                    HEALTH_READ_TIMEOUT_S,
                    f"no health Check request for {HEALTH_READ_TIMEOUT_S:g}s",
                )
            if raw is grpc.aio.EOF or len(raw) > LIVENESS_REQUEST_BYTES:
                raise InvalidArgumentError(
                    f"a health Check request is one message of at most {LIVENESS_REQUEST_BYTES} "
                    "bytes"
                )
            request = decode_message(health_pb2.HealthCheckRequest, raw)
            if request.service not in ("", SERVICE_NAME):
                raise NotFoundError(f"unknown service {request.service!r}")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await self._abort_observed(context, None, "Check", exc, started)
            raise AssertionError("unreachable: abort raises") from None
        checked = Call(context, None, None)
        checked.ended(grpc.StatusCode.OK)
        self.observed("Check", checked, started)
        serving = health_pb2.HealthCheckResponse.SERVING
        answer: bytes = health_pb2.HealthCheckResponse(status=serving).SerializeToString()
        return answer

    async def health_watch(self, requests: Any, context: grpc.aio.ServicerContext) -> None:
        """gRPC's health Watch (a token needed, a stream admitted as any): SERVING, then
        nothing until the server stops or the client goes."""
        from grpc_health.v1 import health_pb2

        started = time.perf_counter()
        call: Call | None = None
        try:
            await self._held_open(context)
            call = self.start(context)
            with self._admitted(call, "Watch"):
                raw = await self.read(context, call, _HEALTH_WATCH)
                if raw is grpc.aio.EOF:
                    raise InvalidArgumentError("a health Watch call without its request message")
                request = decode_message(health_pb2.HealthCheckRequest, raw)
                if request.service not in ("", SERVICE_NAME):
                    raise NotFoundError(f"unknown service {request.service!r}")
                serving = health_pb2.HealthCheckResponse.SERVING
                await context.write(
                    health_pb2.HealthCheckResponse(status=serving).SerializeToString()
                )
                await asyncio.Event().wait()  # the status never changes while serving
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            await self._abort_observed(context, call, "Watch", exc, started)
        finally:
            self._keepalives.discard(context)

    # -- registration --------------------------------------------------------------------------

    def handlers(self) -> grpc.GenericRpcHandler:
        """Every method the schema declares, each registered with a streaming request (the
        handler runs before its request is read) and raw bytes both ways."""
        behaviors = {"Upload": self.upload, "Download": self.download, "KeepAlive": self.keepalive}
        table = {}
        for descriptor in pb.DESCRIPTOR.services_by_name["Tensord"].methods:
            name = descriptor.name
            method = self.methods[name]
            behavior = functools.partial(behaviors.get(name, self.unary), method)
            factory = (
                grpc.stream_stream_rpc_method_handler
                if descriptor.server_streaming
                else grpc.stream_unary_rpc_method_handler
            )
            table[name] = factory(behavior, request_deserializer=None, response_serializer=None)
        return grpc.method_handlers_generic_handler(SERVICE_NAME, table)

    def health_handlers(self) -> grpc.GenericRpcHandler:
        """gRPC's standard health service (grpc.health.v1), under the rules of the other
        calls: Check needs no token and reads a bounded body, Watch needs a token."""
        check = grpc.stream_unary_rpc_method_handler(
            self.health_check, request_deserializer=None, response_serializer=None
        )
        watch = grpc.stream_stream_rpc_method_handler(
            self.health_watch, request_deserializer=None, response_serializer=None
        )
        return grpc.method_handlers_generic_handler(
            HEALTH_SERVICE, {"Check": check, "Watch": watch}
        )


def _methods() -> dict[str, Method]:
    """Every method the schema declares, by name, with its request type and limits."""
    return {
        descriptor.name: Method(
            descriptor.name,
            getattr(pb, descriptor.input_type.name),
            RECEIVE_LIMITS[descriptor.name],
            descriptor.name in LIVENESS_METHODS,
        )
        for descriptor in pb.DESCRIPTOR.services_by_name["Tensord"].methods
    }


class _Readers:
    """The reads of one key in progress, and how many coroutines wait for or hold a slot."""

    __slots__ = ("slots", "users")

    def __init__(self, slots: int) -> None:
        self.slots = asyncio.Semaphore(slots)
        self.users = 0


_HEALTH_WATCH = Method("Watch", Message, LIVENESS_REQUEST_BYTES, True)
