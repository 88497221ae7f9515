"""tensord.aio (issue 15): awaitable waits, synchronous views, the event loop never blocked."""

from __future__ import annotations

import asyncio
import threading
import time
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


@pytest.mark.anyio
async def test_aio_never_blocks_the_loop(server: Any) -> None:
    """Thousands of views (several full queues) and waits from many tasks, while a ticker
    on the loop measures its longest stall."""
    async with await tensord.aio.connect(server.address) as client:
        x = await client.zeros(64, 16)
        stop = threading.Event()
        gaps: list[float] = []

        async def ticker() -> None:
            last = time.perf_counter()
            while not stop.is_set():
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        async def worker(row: int) -> None:
            for j in range(16):
                x[row, j].fill_(row * 16 + j)
                await asyncio.sleep(0)
            assert await x[row].tolist() == [float(row * 16 + j) for j in range(16)]

        tick = asyncio.create_task(ticker())
        views = [x[i % 64] for i in range(3000)]  # > 10 full queues, flushed off the loop
        await asyncio.gather(*(worker(r) for r in range(64)))
        stop.set()
        await tick
        del views
        np.testing.assert_array_equal((await x.numpy()).ravel(), np.arange(64 * 16))
        # a network wait on the loop would show as a stall of one round trip per call
        assert max(gaps) < 0.5, max(gaps)


@pytest.mark.anyio
async def test_aio_refuses_pipelining_off(server: Any) -> None:
    with pytest.raises(ValueError, match="needs pipelining"):
        await tensord.aio.connect(server.address, pipelining=False)
