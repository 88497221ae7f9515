"""tensord.aio: awaitable waits, synchronous views, the event loop never blocked."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest
import tensord
import tensord.aio
import torch


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # tensord.aio is for asyncio programs


@pytest.mark.anyio
async def test_aio_reads_writes_and_views(server: Any) -> None:
    async with await tensord.aio.connect(server.address) as client:
        x = await client.tensor([[1.0, 2.0], [3.0, 4.0]])
        oracle = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
        for t in (x, oracle):
            t[0].fill_(5)  # synchronous in both: a queued write
            t.t()[1].zero_()
            t[1, 0] = 7
        assert x.shape == (2, 2) and x.T.shape == (2, 2)
        np.testing.assert_array_equal(await x.numpy(), oracle.numpy())
        assert await x[1, 0].item() == 7.0
        y = await x.clone()
        y.copy_(x.detach())
        await y.copy_from(np.full((2, 2), 3.0, np.float32))
        assert await y.tolist() == [[3.0, 3.0], [3.0, 3.0]]
        await client.synchronize()


@pytest.mark.anyio
async def test_aio_error_surfaces_at_the_next_await(server: Any) -> None:
    async with await tensord.aio.connect(server.address) as client:
        x = await client.zeros(3, dtype=torch.uint8)
        x.fill_(1000)  # queued; the server's kernel refuses it
        with pytest.raises(RuntimeError, match="fill_ of"):
            await client.synchronize()
        assert await x.tolist() == [0, 0, 0]


@pytest.mark.slow
@pytest.mark.anyio
async def test_aio_never_blocks_the_loop(server: Any, monkeypatch: Any) -> None:
    """Thousands of views (several full queues) and waits from many tasks: no call that
    waits on the network ever runs on the event loop's thread (checked call by call, not
    by timing, which a loaded machine makes meaningless)."""
    async with await tensord.aio.connect(server.address) as client:
        conn = client.sync_client._conn
        loop_thread = threading.get_ident()
        on_loop: list[str] = []

        def watched(name: str) -> Any:
            real = getattr(conn, name)

            def call(*args: Any, **kwargs: Any) -> Any:
                if threading.get_ident() == loop_thread:
                    on_loop.append(name)
                return real(*args, **kwargs)

            return call

        # every session call (the Batch flushes included), uploads and downloads
        for name in ("_in_session", "upload", "download_into"):
            monkeypatch.setattr(conn, name, watched(name))
        x = await client.zeros(64, 16)

        async def worker(row: int) -> None:
            for j in range(16):
                x[row, j].fill_(row * 16 + j)
                await asyncio.sleep(0)
            assert await x[row].tolist() == [float(row * 16 + j) for j in range(16)]

        views = [x[i % 64] for i in range(3000)]  # > 10 full queues, flushed off the loop
        await asyncio.gather(*(worker(r) for r in range(64)))
        del views
        np.testing.assert_array_equal((await x.numpy()).ravel(), np.arange(64 * 16))
        assert on_loop == []


@pytest.mark.anyio
async def test_aio_refuses_pipelining_off(server: Any) -> None:
    with pytest.raises(ValueError, match="needs pipelining"):
        await tensord.aio.connect(server.address, pipelining=False)
