"""The other services (gRPC health and reflection) under the rules of Tensord's own calls.

:class:`OtherServicesGate` wraps the method handlers of a service other than Tensord
(reflection's: health is served by :mod:`tensord_server.rpc.calls`, whose unary Check
needs no token, for load balancers): with ``--auth-tokens`` a valid token is required
before the call's request is read; its streams are admitted within the stream limits (the domain's
:class:`~tensord_server.domain.call_gate.CallGate`) and a stream whose client sends
nothing for ``--stream-idle-timeout`` ends with DEADLINE_EXCEEDED.  Tensord's own calls
take the same steps in :mod:`tensord_server.rpc.calls`.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from tensord_server.domain.call_gate import CallGate
from tensord_server.rpc import status


async def abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """End the call with the status of ``exc`` and its error-type trailer."""
    await context.abort(
        status.status_for(exc),
        status.details_for(exc),
        status.trailers_for(exc),
    )


async def idle_bounded(
    requests: AsyncIterator[Any], context: grpc.aio.ServicerContext, method: str, timeout: float
) -> AsyncIterator[Any]:
    """``requests``, ending the call with DEADLINE_EXCEEDED when one takes over ``timeout``."""
    iterator = aiter(requests)
    while True:
        try:
            item = await asyncio.wait_for(anext(iterator), timeout)
        except StopAsyncIteration:
            return
        except TimeoutError:
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"{method} idle for {timeout:g}s (the client neither sent nor read anything; "
                f"--stream-idle-timeout {timeout:g})",
            )
        yield item


class OtherServicesGate:
    """The method handlers of another service, wrapped under the gate's rules.

    ``tenant_of(metadata)`` authenticates (raises UnauthenticatedError); ``observe`` records
    every call in the metrics and logs, refused ones included.  The handlers are wrapped
    where they are registered, not intercepted per call: an interceptor would run for
    every call of every service, Tensord's own among them."""

    def __init__(
        self,
        gate: CallGate,
        tenant_of: Callable[[Any], str],
        observe: Callable[[str, grpc.aio.ServicerContext, float, BaseException | None], None],
    ) -> None:
        self._gate = gate
        self._tenant_of = tenant_of
        self._observe = observe  # (method, context, started, the error or None): metrics, logs

    def handlers(
        self, service: str, method_handlers: dict[str, grpc.RpcMethodHandler]
    ) -> grpc.GenericRpcHandler:
        """``service``'s handlers, each under the gate's rules."""
        return grpc.method_handlers_generic_handler(
            service,
            {
                name: self.gated(handler, f"/{service}/{name}")
                for name, handler in method_handlers.items()
            },
        )

    def gated(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        """``handler`` of ``method`` (``/pkg.Service/Method``) under the gate's rules."""
        if not (handler.request_streaming or handler.response_streaming):
            return self._gated_unary(handler, method)
        return self._gated_stream(handler, method)

    @contextlib.asynccontextmanager
    async def _observed(
        self, method: str, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[None]:
        started = time.perf_counter()
        name = method.rpartition("/")[2]
        try:
            yield
        except BaseException as exc:
            self._observe(name, context, started, exc)
            raise
        self._observe(name, context, started, None)

    def _gated_unary(self, handler: Any, method: str) -> Any:
        behavior = handler.unary_unary

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            async with self._observed(method, context):
                try:
                    self._tenant_of(context.invocation_metadata())
                except Exception as exc:
                    await abort(context, exc)
                return await behavior(request, context)

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

        async def admitted(context: grpc.aio.ServicerContext) -> int:
            try:
                tenant = self._tenant_of(context.invocation_metadata())
                return gate.open_stream(method, tenant)
            except Exception as exc:
                await abort(context, exc)
                raise  # unreachable: abort raises

        def bounded(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if requests_stream:
                return idle_bounded(request, context, method, gate.idle_timeout)
            return request

        async def unary_response(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            async with self._observed(method, context):
                stream_id = await admitted(context)
                try:
                    return await behavior(bounded(requests, context), context)
                finally:
                    gate.close_stream(stream_id)

        async def stream_response(request: Any, context: grpc.aio.ServicerContext) -> Any:
            async with self._observed(method, context):
                stream_id = await admitted(context)
                try:
                    result = behavior(bounded(request, context), context)
                    if inspect.isasyncgen(result):
                        async for response in result:
                            yield response
                    else:
                        await result
                finally:
                    gate.close_stream(stream_id)

        factory = {
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(requests_stream, responses_stream)]
        gated = stream_response if responses_stream else unary_response
        return factory(gated, handler.request_deserializer, handler.response_serializer)
