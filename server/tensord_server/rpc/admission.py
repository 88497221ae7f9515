"""The gRPC side of admission: cancelling calls, the liveness threads, gating other services.

The counting and the limits are the domain's (:mod:`tensord_server.domain.admission`,
:class:`CallGate`); this module holds what needs gRPC itself:

* :func:`cancel_idle_stream`, the canceller the server installs on the gate: an
  idle stream's call ends with DEADLINE_EXCEEDED, which its client receives.
* Liveness never queues: Heartbeat and OpenSession run on a small pool of
  their own (:func:`liveness_pool`), so a server whose workers are all busy
  still renews leases, and the lease clock never has to stop (a stopped clock
  let one tenant keep everyone's lost sessions and expired tokens alive).
* :class:`GateInterceptor` puts every other service's calls (gRPC health and
  reflection) under the same rules as Tensord's own: counted, streams admitted
  and watched, and, with ``--auth-tokens``, a valid token required (except the
  unary health Check, which load balancers probe without credentials).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc

from tensord_server.domain.admission import CallGate, watched

log = logging.getLogger(__name__)

# Threads running Heartbeat and OpenSession apart from --max-workers: each such call only
# authenticates and takes the session table's lock, so a few serve any number of clients.
LIVENESS_WORKERS = 4


def cancel_rpc(context: Any, code: grpc.StatusCode, details: str) -> None:
    """Cancel a call from another thread, telling its client why.

    The sync server's public ``context.cancel()`` reports a bare CANCELLED; its
    call object can cancel with a status, which the client then receives.
    """
    call = getattr(getattr(context, "_rpc_event", None), "call", None)
    try:
        if call is not None:
            call.cancel(code.value[0], details)
            return
    except Exception:  # an older/newer grpc without the status form: plain cancel below
        log.debug("cancel with status failed", exc_info=True)
    context.cancel()


def cancel_idle_stream(context: Any, details: str) -> None:
    """The gate's canceller: an idle stream's call ends with DEADLINE_EXCEEDED and ``details``."""
    cancel_rpc(context, grpc.StatusCode.DEADLINE_EXCEEDED, details)


def liveness_pool() -> futures.ThreadPoolExecutor:
    """The threads Heartbeat and OpenSession run on, never queued behind other calls."""
    return futures.ThreadPoolExecutor(LIVENESS_WORKERS, thread_name_prefix="tensord-liveness")


def _service_of(method: str) -> str:
    """``/pkg.Service/Method`` -> ``pkg.Service``."""
    return method.lstrip("/").rpartition("/")[0]


# Calls of other services any caller may make, token or not: the unary health check.
UNAUTHENTICATED_METHODS = frozenset({"/grpc.health.v1.Health/Check"})


class GateInterceptor(grpc.ServerInterceptor):  # type: ignore[misc]
    """Every call of a service other than ``own_service`` under the gate's rules.

    Tensord's own handlers do this themselves (service.py); the interceptor
    covers what the server registers beside them (health, reflection), whose
    streams would otherwise hold workers without admission, idle timeout or token.
    ``tenant_of(context)`` authenticates (raises UnauthenticatedError) and
    ``abort(context, exc)`` ends a call with the status of ``exc``.
    """

    def __init__(
        self,
        gate: CallGate,
        own_service: str,
        tenant_of: Callable[[Any], str],
        abort: Callable[[Any, BaseException], None],
    ) -> None:
        self._gate = gate
        self._own_service = own_service
        self._tenant_of = tenant_of
        self._abort = abort

    def intercept_service(
        self, continuation: Callable[[Any], Any], handler_call_details: Any
    ) -> Any:
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or _service_of(method) == self._own_service:
            return handler
        if handler.request_streaming or handler.response_streaming:
            return self._gated_stream(handler, method)
        return self._gated_unary(handler, method)

    def _gated_unary(self, handler: Any, method: str) -> Any:
        behavior = handler.unary_unary

        def unary(request: Any, context: Any) -> Any:
            with self._gate.call():
                if method not in UNAUTHENTICATED_METHODS:
                    try:
                        self._tenant_of(context)
                    except Exception as exc:
                        self._abort(context, exc)
                return behavior(request, context)

        return grpc.unary_unary_rpc_method_handler(
            unary, handler.request_deserializer, handler.response_serializer
        )

    def _gated_stream(self, handler: Any, method: str) -> Any:
        gate = self._gate
        requests_stream, responses_stream = handler.request_streaming, handler.response_streaming
        behavior = {
            (False, True): handler.unary_stream,
            (True, False): handler.stream_unary,
            (True, True): handler.stream_stream,
        }[(requests_stream, responses_stream)]

        def admitted(context: Any) -> int:
            try:
                stream_id = gate.open_stream(context, method, self._tenant_of(context))
            except Exception as exc:
                self._abort(context, exc)
            context.add_callback(functools.partial(gate.close_stream, stream_id))
            return stream_id

        def unary_response(requests: Any, context: Any) -> Any:
            with gate.call():
                stream_id = admitted(context)
                try:
                    return behavior(watched(gate, stream_id, requests), context)
                finally:
                    gate.close_stream(stream_id)

        def stream_response(request: Any, context: Any) -> Iterator[Any]:
            with gate.call():
                stream_id = admitted(context)
                try:
                    if requests_stream:
                        request = watched(gate, stream_id, request)
                    for response in behavior(request, context):
                        gate.waiting(stream_id, True)  # its consumer reading it
                        try:
                            yield response
                        finally:
                            gate.waiting(stream_id, False)
                finally:
                    gate.close_stream(stream_id)

        factory = {
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(requests_stream, responses_stream)]
        gated = stream_response if responses_stream else unary_response
        return factory(gated, handler.request_deserializer, handler.response_serializer)
