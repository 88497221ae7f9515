"""``tensord.aio``: the SDK for asyncio programs.

    client = await tensord.aio.connect(address)
    x = await client.tensor([[1, 2], [3, 4]])
    x[0].fill_(5)                 # a view and a queued write: synchronous, no round trip
    print(await x.numpy())        # a read waits for the server: awaitable
    await client.synchronize()
    await client.close()

The same Tensor API as :mod:`tensord`, with every call that waits for the server
awaitable, and views, ``detach`` and the queued in-place writes (``fill_``,
``zero_``, ``copy_`` from a tensor, ``x[k] = scalar or tensor``) synchronous.

Why the synchronous client in a thread executor rather than ``grpc.aio``: the
synchronous client is the one that keeps the session (heartbeats, batched
releases, session replacement after a restart, same-host mapping, deadlines and
the stalled-transfer watchdog); a second implementation of all of it on
``grpc.aio`` would be a second SDK to keep in step.  With pipelining, the calls
that do not wait only append to the client's queue, so they run on the loop;
the calls that wait run on a small executor of this client's own, and a full
queue's flush is handed to it too, so the event loop never blocks on the network.
Calls from several tasks keep their issue order (the client's queue is ordered
and each waiting call flushes it first).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from tensord import errors
from tensord.client import Client
from tensord.tensor import Tensor, assign_data

# Threads that run one client's waiting calls (each call holds one while it waits).
EXECUTOR_THREADS = 4

# Tensor methods that never wait for the server with pipelining on: views and queued writes.
_SYNC_METHODS = frozenset(
    {
        "view", "view_as", "narrow", "select", "transpose", "swapaxes", "swapdims", "t",
        "permute", "moveaxis", "movedim", "expand", "expand_as", "broadcast_to", "squeeze",
        "unsqueeze", "unflatten", "split", "tensor_split", "hsplit", "vsplit", "dsplit",
        "unfold", "chunk", "unbind", "diagonal", "as_strided", "detach", "fill_", "zero_",
        "t_", "transpose_", "swapdims_", "swapaxes_", "squeeze_", "unsqueeze_", "as_strided_",
        "adjoint", "conj",
    }
)  # fmt: skip
# Tensor properties that are views (no call).
_VIEW_PROPERTIES = frozenset({"T", "mT", "mH", "H", "real", "imag"})
# Metadata: read locally, never a call.
_METADATA = frozenset(
    {
        "shape", "size", "stride", "storage_offset", "dtype", "device", "is_cuda", "is_cpu",
        "requires_grad", "is_contiguous", "numel", "nelement", "dim", "ndim", "element_size",
        "itemsize", "nbytes", "data_ptr", "untyped_storage", "handle", "is_conj", "is_neg",
    }
)  # fmt: skip


def _wrap(client: AsyncClient, value: Any) -> Any:
    if isinstance(value, Tensor):
        return AsyncTensor(client, value)
    if isinstance(value, tuple):
        return tuple(_wrap(client, v) for v in value)
    if isinstance(value, list):
        return [_wrap(client, v) for v in value]
    return value


def _unwrap(value: Any) -> Any:
    if isinstance(value, AsyncTensor):
        return value.sync_tensor
    if isinstance(value, (list, tuple)):
        return type(value)(_unwrap(v) for v in value)
    if isinstance(value, dict):  # put_many's mapping
        return {k: _unwrap(v) for k, v in value.items()}
    return value


class AsyncTensor:
    """A :class:`tensord.Tensor` for asyncio: views synchronous, waiting calls awaitable."""

    __slots__ = ("_client", "_tensor")

    def __init__(self, client: AsyncClient, tensor: Tensor) -> None:
        self._client = client
        self._tensor = tensor

    @property
    def sync_tensor(self) -> Tensor:
        """The synchronous Tensor underneath (its waiting calls block: not on the loop)."""
        return self._tensor

    @property
    def client(self) -> AsyncClient:
        """The ``AsyncClient`` this tensor belongs to."""
        return self._client

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._tensor, name)
        if name in _METADATA:
            return attr
        if name in _VIEW_PROPERTIES:
            return _wrap(self._client, attr)
        if name in _SYNC_METHODS:

            @functools.wraps(attr)
            def queued(*args: Any, **kwargs: Any) -> Any:
                result = attr(*_unwrap(args), **{k: _unwrap(v) for k, v in kwargs.items()})
                return self if result is self._tensor else _wrap(self._client, result)

            return queued
        if callable(attr):
            return self._client.awaitable(attr)
        return attr

    def copy_(self, src: AsyncTensor) -> AsyncTensor:
        """Queued (synchronous) from a tensor of this client; ``await x.copy_from(data)``
        uploads an array or a list first."""
        if not isinstance(src, AsyncTensor):
            raise errors.TensordTypeError(
                "in tensord.aio, copy_ takes a tensor (queued); await x.copy_from(data) to "
                "upload an array or a list"
            )
        self._tensor.copy_(src.sync_tensor)
        return self

    async def copy_from(self, data: Any) -> AsyncTensor:
        """Copy ``data`` (an array, a nested list or a tensor) into this tensor; awaitable.

        ``copy_`` from a tensor is queued and synchronous; data from Python must be uploaded first,
        which waits for the server, so it is this awaitable call instead.

        Returns:
            This tensor.
        """
        await self._client.run(self._tensor.copy_, _unwrap(data))
        return self

    def __getitem__(self, key: Any) -> AsyncTensor:
        result: AsyncTensor = _wrap(self._client, self._tensor[key])
        return result

    def __setitem__(self, key: Any, value: Any) -> None:
        if isinstance(value, np.ndarray | list):
            raise errors.TensordTypeError(
                "in tensord.aio, x[key] = value takes a number or a tensor (queued); "
                "await x.setitem(key, data) to upload an array or a list"
            )
        self._tensor[key] = _unwrap(value)

    async def setitem(self, key: Any, value: Any) -> None:
        """``x[key] = value`` where ``value`` may also be an array or a list; awaitable.

        The array or list is uploaded in this tensor's dtype first (which waits for the server),
        then written; ``x[key] = value`` itself takes only numbers and tensors.
        """
        await self._client.run(assign_data, self._tensor, key, _unwrap(value))

    def __iter__(self) -> Iterator[AsyncTensor]:
        return iter(_wrap(self._client, tuple(self._tensor.unbind(0))))

    def __len__(self) -> int:
        return len(self._tensor)

    def __repr__(self) -> str:
        return f"<tensord.aio.AsyncTensor {self._tensor.shape} {self._tensor.dtype}>"


class AsyncClient:
    """A :class:`tensord.Client` for asyncio: every call that waits for the server is awaitable."""

    def __init__(self, client: Client, executor: ThreadPoolExecutor) -> None:
        self._client = client
        self._executor = executor
        loop = asyncio.get_running_loop()

        def schedule(flush: Callable[[], None]) -> None:
            # called on the loop (a view filled the queue) or a worker: never waits itself
            loop.call_soon_threadsafe(loop.run_in_executor, executor, flush)

        client.schedule_flushes(schedule)

    @property
    def sync_client(self) -> Client:
        """The synchronous Client underneath (its waiting calls block: not on the loop)."""
        return self._client

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on this client's executor; tensors in the result wrapped."""
        loop = asyncio.get_running_loop()
        result = await loop.run_in_executor(self._executor, functools.partial(fn, *args))
        return _wrap(self, result)

    def awaitable(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` as a coroutine function that runs it on this client's executor.

        Its AsyncTensor arguments are passed as their synchronous tensors, and the tensors in its
        result come back wrapped as AsyncTensors.
        """

        @functools.wraps(fn)
        async def call(*args: Any, **kwargs: Any) -> Any:
            bound = functools.partial(
                fn, *_unwrap(args), **{k: _unwrap(v) for k, v in kwargs.items()}
            )
            return await self.run(bound)

        return call

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if name in {"address", "session_id", "closed", "pipelining"}:
            return attr
        return self.awaitable(attr) if callable(attr) else attr

    async def close(self) -> None:
        """Send pending releases and close the session, as ``Client.close``; awaitable.

        Then this client's executor is shut down.
        """
        await self.run(self._client.close)
        self._executor.shutdown(wait=False)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def connect(address: str | None = None, **kwargs: Any) -> AsyncClient:
    """``tensord.connect(...)`` for asyncio (the same arguments; pipelining stays on)."""
    if kwargs.get("pipelining") is False:
        raise errors.InvalidArgumentError(
            "tensord.aio needs pipelining: without it every view would wait for the server"
        )
    executor = ThreadPoolExecutor(EXECUTOR_THREADS, thread_name_prefix="tensord-aio")
    loop = asyncio.get_running_loop()
    try:
        client = await loop.run_in_executor(executor, functools.partial(Client, address, **kwargs))
    except BaseException:
        executor.shutdown(wait=False)
        raise
    return AsyncClient(client, executor)
