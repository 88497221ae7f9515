"""The gRPC server factory: a started server with the service, health, reflection and TLS.

Builds a :class:`grpc.Server` around one :class:`~tensord_server.domain.store.TensorStore`:
the message limits of the wire protocol, the worker pool the admission gate follows, the
standard health and reflection services, and the listening port (TCP, TLS or a private
unix socket).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from concurrent import futures

import grpc
from tensord._proto.tensord.v1 import tensord_pb2 as pb
from tensord.protocol import DEFAULT_ADDRESS, MAX_MESSAGE_BYTES

from tensord_server.devices.table import DeviceSpec
from tensord_server.domain.admission import DEFAULT_MAX_WORKERS
from tensord_server.domain.sessions import DEFAULT_GRACE_S, DEFAULT_LEASE_S
from tensord_server.domain.store import TensorStore
from tensord_server.observability import interceptor_for  # observability hook
from tensord_server.rpc import status
from tensord_server.rpc.admission import GateInterceptor, cancel_idle_stream, liveness_pool
from tensord_server.rpc.service import SERVICE_NAME, add_to_server, tenant_of_context

__all__ = ["DEFAULT_ADDRESS", "DEFAULT_MAX_WORKERS", "MAX_MESSAGE_BYTES", "create_server"]

# A unix: socket is readable and writable by the server's user only.
UNIX_SOCKET_MODE = 0o600


def _add_health_and_reflection(server: grpc.Server) -> None:
    """Standard gRPC health checking (SERVING for "" and the service) and reflection."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    service_name = pb.DESCRIPTOR.services_by_name["Tensord"].full_name
    servicer = health.HealthServicer()
    for name in ("", service_name):
        servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    reflection.enable_server_reflection(
        (service_name, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )


def unix_socket_path(address: str) -> str:
    """The filesystem path of ``unix:PATH`` or ``unix://PATH``."""
    path = address.removeprefix("unix:")
    return path[2:] if path.startswith("//") else path


def create_server(
    address: str = "127.0.0.1:0",
    devices: Iterable[DeviceSpec | str] = ("cpu",),
    *,
    session_grace: float = DEFAULT_GRACE_S,
    lease: float = DEFAULT_LEASE_S,
    max_workers: int = DEFAULT_MAX_WORKERS,
    store: TensorStore | None = None,
    credentials: grpc.ServerCredentials | None = None,
) -> tuple[grpc.Server, int]:
    """A started gRPC server on ``address`` and its port (port 0: any free one).

    Pass ``store`` to keep a reference for inspection (tests) and for
    ``store.close()`` after ``server.stop()``; otherwise one is made from
    ``devices``, ``session_grace`` and ``lease``.  ``credentials``
    (:func:`tensord_server.rpc.tls.server_credentials`) make the port TLS-only.
    """
    if store is None:
        store = TensorStore(devices, session_grace=session_grace, lease=lease)
    store.gate.resize(max_workers)  # admission and saturation follow the real thread pool
    store.gate.cancel_stream = cancel_idle_stream  # an idle stream ends with DEADLINE_EXCEEDED
    # health and reflection calls counted, their streams admitted and watched, tokens checked
    gate_all = GateInterceptor(
        store.gate, SERVICE_NAME, functools.partial(tenant_of_context, store), status.abort
    )
    # No maximum_concurrent_rpcs: grpc counts every call against it, heartbeats too, so a
    # flood of other calls would get heartbeats refused; admission bounds the streams instead.
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="tensord"),
        # observability hook: per-RPC metrics and logs (tensord_server.observability), outside
        # the gate so that its refusals (UNAUTHENTICATED, RESOURCE_EXHAUSTED) are counted too
        interceptors=(interceptor_for(store), gate_all),
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
        ],
    )
    add_to_server(store, server, liveness_pool())  # liveness never queues behind other calls
    _add_health_and_reflection(server)
    if credentials is None:
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, credentials)
    if port == 0 and not address.startswith("unix:"):
        raise OSError(f"cannot listen on {address}")
    if address.startswith("unix:"):
        # only the server's own user may connect (filesystem permissions are the access control)
        os.chmod(unix_socket_path(address), UNIX_SOCKET_MODE)
    store.start()
    server.start()
    return server, port
