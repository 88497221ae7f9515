"""The gRPC server factory: a started asyncio server with the service, health, reflection and TLS.

Builds a :class:`grpc.aio.Server` around one :class:`~tensord_server.domain.store.TensorStore`
on an event loop of its own thread, and returns an :class:`AsyncServer` that threads use
as they used the synchronous server (``stop(grace).wait()``, ``wait_for_termination()``).
A call waiting for its request, for a worker or for its reader holds no thread
(:mod:`tensord_server.rpc.calls` says how each call travels); the transport's limits below
bound what a peer can hold without making any call at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Iterable
from typing import Any

import grpc
from tensord import schema as pb
from tensord.protocol import DEFAULT_ADDRESS, MAX_MESSAGE_BYTES

from tensord_server.devices.descriptors import DescriptorBudget, raise_descriptor_limit
from tensord_server.devices.table import DeviceSpec
from tensord_server.domain.call_gate import DEFAULT_MAX_WORKERS
from tensord_server.domain.sessions import DEFAULT_GRACE_S, DEFAULT_LEASE_S
from tensord_server.domain.store import TensorStore
from tensord_server.rpc.binding import bind_problem
from tensord_server.rpc.calls import MAX_RECEIVE_BYTES, Calls
from tensord_server.rpc.other_services import OtherServicesGate

__all__ = ["DEFAULT_ADDRESS", "DEFAULT_MAX_WORKERS", "MAX_MESSAGE_BYTES", "create_server"]

# A unix: socket is readable and writable by the server's user only.
UNIX_SOCKET_MODE = 0o600
# Streams one connection may have open at once (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS).
MAX_CONCURRENT_STREAMS = 128
# A connection with no call in progress for this long is closed (a connection that never
# makes a call included); clients reconnect when they next call.
CONNECTION_IDLE_MS = 30_000
# The transport pings every connection this often and closes one that does not answer
# within the timeout: how a session's KeepAlive stream ends when its client vanished
# without closing its socket.
KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 10_000
# A connection has this long to finish its (TLS) handshake.
HANDSHAKE_TIMEOUT_MS = 10_000
# Calls accepted by gRPC core and not yet taken by the event loop.
MAX_PENDING_REQUESTS = 16384
# Connections in all, at most (fewer where the descriptor limit is lower).
MAX_CONNECTIONS = 4096


def connection_limit() -> int:
    """Connections the server accepts at once: the descriptors left beyond those open now
    and the reserve kept for segments and the fd socket (a connection is one descriptor),
    at most MAX_CONNECTIONS, at least a few so the server stays reachable."""
    return max(16, min(MAX_CONNECTIONS, DescriptorBudget().connections_left()))


def server_options() -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
        ("grpc.so_reuseport", 0),
        ("grpc.max_concurrent_streams", MAX_CONCURRENT_STREAMS),
        ("grpc.max_connection_idle_ms", CONNECTION_IDLE_MS),
        ("grpc.max_allowed_incoming_connections", connection_limit()),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.server_handshake_timeout_ms", HANDSHAKE_TIMEOUT_MS),
        # calls gRPC core queues before the event loop takes them: past this it CANCELs new
        # calls, anyone's, so a burst of refused calls without a token cannot cost others
        ("grpc.server.max_pending_requests", MAX_PENDING_REQUESTS),
        ("grpc.server.max_pending_requests_hard_limit", 2 * MAX_PENDING_REQUESTS),
    ]


def reflection_handlers(gate: OtherServicesGate) -> grpc.GenericRpcHandler:
    """gRPC server reflection of the Tensord and health services, under the gate's rules
    (health itself is served by rpc.calls, under the same rules as Tensord's calls)."""
    from grpc_health.v1 import health, health_pb2  # noqa: F401 (its descriptors, for reflection)
    from grpc_reflection.v1alpha import reflection
    from grpc_reflection.v1alpha import reflection_pb2 as reflection_pb

    service_name = pb.DESCRIPTOR.services_by_name["Tensord"].full_name
    servicer = reflection.aio.ReflectionServicer(
        (service_name, health.SERVICE_NAME, reflection.SERVICE_NAME)
    )
    info = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb.ServerReflectionResponse.SerializeToString,
    )
    return gate.handlers(reflection.SERVICE_NAME, {"ServerReflectionInfo": info})


def unix_socket_path(address: str) -> str:
    """The filesystem path of ``unix:PATH`` or ``unix://PATH``."""
    path = address.removeprefix("unix:")
    return path[2:] if path.startswith("//") else path


# How long a stopped server waits for the handlers it cancels to end (each is at an await).
PENDING_END_TIMEOUT_S = 2.0


async def _end_pending() -> None:
    """Cancel what still runs on the loop once gRPC has stopped (a KeepAlive handler waiting
    for a liveness worker past the grace, say) and let it end: a task the loop's close
    finds pending is destroyed mid-await, its finally blocks never run."""
    current = asyncio.current_task()
    pending = [task for task in asyncio.all_tasks() if task is not current]
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.wait(pending, timeout=PENDING_END_TIMEOUT_S)


class AsyncServer:
    """A started asyncio server, driven from any thread."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        thread: threading.Thread,
        server: grpc.aio.Server,
        calls: Calls,
    ) -> None:
        self._loop = loop
        self._thread = thread
        self._server = server
        self.calls = calls
        self._stopped = threading.Event()
        self._stopping = False
        self._lock = threading.Lock()

    def stop(self, grace: float | None) -> threading.Event:
        """Stop taking calls; those in flight get ``grace`` seconds (None: none).  The event
        is set once every call ended and the workers are gone.  Idempotent."""
        with self._lock:
            if self._stopping:
                return self._stopped
            self._stopping = True

        async def stop() -> None:
            await self.calls.end_keepalives()  # an open one would hold the whole grace
            await asyncio.gather(self._server.stop(grace), self.calls.close_fd_socket(grace))

        stopping = asyncio.run_coroutine_threadsafe(stop(), self._loop)

        def finish() -> None:
            try:
                stopping.result()
            finally:
                with contextlib.suppress(Exception):  # a loop that will not drain still closes
                    drained = asyncio.run_coroutine_threadsafe(_end_pending(), self._loop)
                    drained.result(PENDING_END_TIMEOUT_S + 1.0)
                self.calls.shutdown()
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join()
                self._loop.close()
                self._stopped.set()

        threading.Thread(target=finish, name="tensord-stop", daemon=True).start()
        return self._stopped

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        """True once stopped; False if ``timeout`` passed first."""
        return self._stopped.wait(timeout)


def create_server(
    address: str = "127.0.0.1:0",
    devices: Iterable[DeviceSpec | str] = ("cpu",),
    *,
    session_grace: float = DEFAULT_GRACE_S,
    lease: float = DEFAULT_LEASE_S,
    max_workers: int = DEFAULT_MAX_WORKERS,
    store: TensorStore | None = None,
    credentials: grpc.ServerCredentials | None = None,
) -> tuple[AsyncServer, int]:
    """A started server on ``address`` and its port (port 0: any free one).

    Pass ``store`` to keep a reference for inspection (tests) and for
    ``store.close()`` after ``server.stop()``; otherwise one is made from
    ``devices``, ``session_grace`` and ``lease``.  ``credentials``
    (:func:`tensord_server.rpc.tls.server_credentials`) make the port TLS-only.
    ``max_workers`` threads run the calls' work, shared fairly between tenants.
    """
    raise_descriptor_limit()  # the hard limit: idle connections must not starve segments
    if store is None:
        store = TensorStore(devices, session_grace=session_grace, lease=lease)
    store.gate.resize(max_workers)  # admission and saturation follow the real thread pool
    calls = Calls(store, max_workers)
    loop = asyncio.new_event_loop()
    started: dict[str, Any] = {}
    ready = threading.Event()

    async def start() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server(options=server_options())
        others = OtherServicesGate(store.gate, calls.tenant_of, calls.observe_other)
        server.add_generic_rpc_handlers(
            (calls.handlers(), calls.health_handlers(), reflection_handlers(others))
        )
        if credentials is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, credentials)
        await server.start()
        calls.open_fd_socket()  # on this loop: its connections are coroutines here
        return server, port

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            started["result"] = loop.run_until_complete(start())
        except BaseException as exc:
            started["error"] = exc
            ready.set()
            return
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=run, name="tensord-rpc", daemon=True)
    thread.start()
    ready.wait()
    if "error" in started:
        thread.join()
        loop.close()
        calls.shutdown()
        error = started["error"]
        if isinstance(error, RuntimeError):  # grpc's "Failed to bind to address ..."
            raise OSError(
                f"cannot listen on {address}: {bind_problem(address) or error}"
            ) from error
        raise error
    server, port = started["result"]
    handle = AsyncServer(loop, thread, server, calls)
    if port == 0 and not address.startswith("unix:"):
        handle.stop(None).wait()
        raise OSError(f"cannot listen on {address}")
    if address.startswith("unix:"):
        # only the server's own user may connect (filesystem permissions are the access control)
        os.chmod(unix_socket_path(address), UNIX_SOCKET_MODE)
    store.start()
    return handle, port
