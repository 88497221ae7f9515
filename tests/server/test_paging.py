"""Listings a page at a time: ListNames and MemorySnapshot answer at most paging.MAX_PAGE_BYTES
whatever the request or the tenant's data, their page tokens hold a place that survives
concurrent changes, a token the server did not issue is INVALID_ARGUMENT, and the SDK's
names() and memory_snapshot() join the pages into what one answer used to hold."""

from __future__ import annotations

import base64
import itertools
import json
import random
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import tensord
import tensord.aio
from conftest import SessionStub, open_channel
from rpc_errors import rpc_error
from tensord import schema as pb
from tensord.protocol import MAX_PAGE_SIZE
from tensord_server.devices.memory import BookkeepingBackend
from tensord_server.devices.table import Device
from tensord_server.domain import paging
from tensord_server.domain.memory_reports import MemoryReports
from tensord_server.pool import CachingPool

TOKENS = {"alice-token": "alice", "bob-token": "bob"}


@pytest.fixture
def tenant_session() -> Iterator[Callable[[str, str, str], SessionStub]]:
    """Sessions with a bearer token: ``tenant_session(address, name, token)``."""
    opened: list[tuple[grpc.Channel, SessionStub]] = []

    def open_(address: str, name: str, token: str) -> SessionStub:
        channel = open_channel(address)
        opened.append((channel, SessionStub(channel, name, token)))
        return opened[-1][1]

    yield open_
    for channel, session in opened:
        session.close()
        channel.close()


def _named(session: Any, names: list[str]) -> None:
    meta = session.upload(np.arange(4, dtype=np.float32))
    for name in names:
        session.PutName(pb.PutNameRequest(name=name, handle=meta.handle), metadata=session.md)
    session.Release(pb.ReleaseRequest(handles=[meta.handle]), metadata=session.md)


def _name_pages(session: Any, page_size: int = 0) -> Iterator[pb.ListNamesResponse]:
    token = ""
    while True:
        request = pb.ListNamesRequest(page_size=page_size, page_token=token)
        page = session.ListNames(request, metadata=session.md)
        yield page
        token = page.next_page_token
        if not token:
            return


def _snapshot_pages(session: Any, page_size: int = 0) -> Iterator[pb.MemorySnapshotResponse]:
    token = ""
    while True:
        request = pb.MemorySnapshotRequest(page_size=page_size, page_token=token)
        page = session.MemorySnapshot(request, metadata=session.md)
        yield page
        token = page.next_page_token
        if not token:
            return


def _refused(session: SessionStub, request: Any) -> str:
    """The details of a listing request's INVALID_ARGUMENT."""
    if isinstance(request, pb.ListNamesRequest):
        method = session.ListNames
    else:
        method = session.MemorySnapshot
    code, details, _ = rpc_error(lambda: method(request, metadata=session.md))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    return details


# ---- names ------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_names_answer_never_exceeds_the_page_bytes_however_many_and_long_the_names(
    make_server: Callable[..., Any], open_session: Callable[..., Any]
) -> None:
    server = make_server()
    session = open_session(server.address)
    # 1.6 MB of names of 4,096 UTF-8 bytes (the longest a request may carry), some of
    # two-byte characters: one unpaged answer held them all
    names = [f"{i:04d}" + "x" * 4092 for i in range(300)]
    names += [f"{i:04d}" + "é" * 2046 for i in range(300, 400)]
    _named(session, names)
    for page_size in (0, 1, 3, MAX_PAGE_SIZE, 1 << 30):
        pages = list(_name_pages(session, page_size))
        assert all(page.ByteSize() <= paging.MAX_PAGE_BYTES for page in pages)
        assert all(len(page.names) <= page_size for page in pages if page_size)
        assert [n for page in pages for n in page.names] == sorted(names)
        assert len(pages) >= 2 and pages[-1].next_page_token == ""
    # a request with no page fields (an older client) gets the first page and a token
    first = session.ListNames(pb.ListNamesRequest(), metadata=session.md)
    assert 0 < len(first.names) < len(names) and first.next_page_token
    assert first.ByteSize() <= paging.MAX_PAGE_BYTES


def test_page_size_defaults_and_caps(
    make_server: Callable[..., Any], open_session: Callable[..., Any]
) -> None:
    server = make_server()
    session = open_session(server.address)
    names = [f"n{i:05d}" for i in range(paging.DEFAULT_PAGE_SIZE + 5)]
    _named(session, names)
    default = session.ListNames(pb.ListNamesRequest(), metadata=session.md)
    assert list(default.names) == names[: paging.DEFAULT_PAGE_SIZE]
    whole = session.ListNames(pb.ListNamesRequest(page_size=1 << 30), metadata=session.md)
    assert list(whole.names) == names and whole.next_page_token == ""
    code, details, _ = rpc_error(
        lambda: session.ListNames(pb.ListNamesRequest(page_size=-1), metadata=session.md)
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "page_size must be >= 0" in details


@pytest.mark.slow
def test_paging_lists_every_name_once_while_names_come_and_go(
    make_server: Callable[..., Any], open_session: Callable[..., Any]
) -> None:
    server = make_server()
    session = open_session(server.address)
    churner = open_session(server.address, "churner")
    stable = [f"k{i:05d}" for i in range(0, 3000, 2)]
    volatile = [f"k{i:05d}" for i in range(1, 3000, 2)]
    _named(session, stable + volatile)
    meta = churner.upload(np.arange(2, dtype=np.float32))
    stop = threading.Event()

    def churn() -> None:  # names added and deleted everywhere, ahead of the pages and behind
        rng = random.Random(0)
        while not stop.is_set():
            name = f"k{rng.randrange(3000):05d}-c"
            request = pb.PutNameRequest(name=name, handle=meta.handle, overwrite=True)
            churner.PutName(request, metadata=churner.md)
            churner.DeleteName(pb.DeleteNameRequest(name=name), metadata=churner.md)

    thread = threading.Thread(target=churn)
    thread.start()
    seen: list[str] = []
    pages = 0
    try:
        token = ""
        while True:
            request = pb.ListNamesRequest(page_size=7, page_token=token)
            page = session.ListNames(request, metadata=session.md)
            seen.extend(page.names)
            pages += 1
            # delete what this page listed of the volatile names, its last name among them:
            # a place kept as an offset would now skip the stable names after it
            for name in page.names:
                if name in volatile:
                    session.DeleteName(pb.DeleteNameRequest(name=name), metadata=session.md)
            token = page.next_page_token
            if not token:
                break
    finally:
        stop.set()
        thread.join()
    assert [n for n in seen if n in set(stable)] == stable
    assert len(seen) == len(set(seen)) and seen == sorted(seen)
    assert pages > 400


def test_garbage_and_forged_page_tokens_are_invalid_arguments(
    make_server: Callable[..., Any], tenant_session: Callable[[str, str, str], SessionStub]
) -> None:
    server = make_server(auth_tokens=TOKENS)
    other = make_server(auth_tokens=TOKENS)
    alice = tenant_session(server.address, "alice", "alice-token")
    bob = tenant_session(server.address, "bob", "bob-token")
    elsewhere = tenant_session(other.address, "alice", "alice-token")
    _named(alice, [f"a{i}" for i in range(5)])
    _named(bob, [f"b{i}" for i in range(5)])
    _named(elsewhere, [f"a{i}" for i in range(5)])
    issued = alice.ListNames(pb.ListNamesRequest(page_size=2), metadata=alice.md).next_page_token
    raw = bytearray(base64.urlsafe_b64decode(issued + "=" * (-len(issued) % 4)))
    raw[1] ^= 1  # the place changed, the MAC not
    flipped = base64.urlsafe_b64encode(bytes(raw)).decode().rstrip("=")
    snapshot_token = alice.MemorySnapshot(
        pb.MemorySnapshotRequest(page_size=1), metadata=alice.md
    ).next_page_token
    garbage = ["x", "!!!!", "é", "AAAA", issued[:-2], issued + "AA", flipped, "A" * 8000]
    for token in garbage:
        for request in (
            pb.ListNamesRequest(page_token=token),
            pb.MemorySnapshotRequest(page_token=token),
        ):
            assert "invalid page_token" in _refused(alice, request), token
    # issued, but for another tenant, another server process, another listing or device
    for session, request in (
        (bob, pb.ListNamesRequest(page_token=issued)),
        (elsewhere, pb.ListNamesRequest(page_token=issued)),
        (alice, pb.MemorySnapshotRequest(page_token=issued)),
        (alice, pb.ListNamesRequest(page_token=snapshot_token)),
    ):
        assert "invalid page_token" in _refused(session, request)
    code, details, _ = rpc_error(
        lambda: alice.ListNames(pb.ListNamesRequest(page_token="A" * 9000), metadata=alice.md)
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "page_token" in details
    # the server keeps serving, each tenant its own names only
    follow = alice.ListNames(pb.ListNamesRequest(page_token=issued), metadata=alice.md)
    assert list(follow.names) == ["a2", "a3", "a4"] and follow.next_page_token == ""
    assert list(bob.ListNames(pb.ListNamesRequest(), metadata=bob.md).names) == [
        f"b{i}" for i in range(5)
    ]


def test_sdk_names_fetches_every_page(server: Any) -> None:
    with tensord.connect(server.address) as client:
        x = client.arange(3)
        names = [f"sdk-page/{i:04d}-" + "y" * 3000 for i in range(500)]  # 1.5 MB: 2+ pages
        for name in names:
            client.put(name, x)
        try:
            assert [n for n in client.names() if n.startswith("sdk-page/")] == names
        finally:
            for name in names:
                client.delete(name)
        assert not [n for n in client.names() if n.startswith("sdk-page/")]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.slow
@pytest.mark.anyio
async def test_aio_names_and_snapshot_fetch_every_page(
    make_server: Callable[..., Any],
) -> None:
    server = make_server()
    pool = server.daemon.devices.get("cpu").pool
    blocks = [pool.malloc(512) for _ in range(12_000)]  # ~1.2 MB of snapshot: 2+ pages
    try:
        async with await tensord.aio.connect(server.address) as client:
            x = await client.arange(2)
            names = [f"aio/{i:03d}-" + "z" * 4000 for i in range(300)]  # 1.2 MB: 2+ pages
            for name in names:
                await client.put(name, x)
            assert await client.names() == names
            snapshot = await client.memory_snapshot()
        assert snapshot["segments"] == _json_round_trip(pool.memory_snapshot())["segments"]
    finally:
        for block in blocks:
            pool.free(block)


# ---- snapshots -----------------------------------------------------------------------


def _json_round_trip(value: Any) -> Any:
    return json.loads(json.dumps(value))


@pytest.mark.slow
def test_snapshot_pages_stay_under_the_page_bytes_and_join_to_the_whole(
    make_server: Callable[..., Any], open_session: Callable[..., Any]
) -> None:
    server = make_server()
    session = open_session(server.address)
    pool = server.daemon.devices.get("cpu").pool
    # ~20,000 blocks (2 MB of snapshot JSON): small segments of 4,096 blocks, cut across pages
    blocks = [pool.malloc(512) for _ in range(20_000)]
    try:
        whole = _json_round_trip(pool.memory_snapshot())
        for page_size in (0, 1, 3, MAX_PAGE_SIZE):
            pages = list(_snapshot_pages(session, page_size))
            assert len(pages) >= 2
            assert all(page.ByteSize() <= paging.MAX_PAGE_BYTES for page in pages)
            parts = [json.loads(page.snapshot_json) for page in pages]
            assert all(len(p["segments"]) <= page_size for p in parts if page_size)
            cuts = sum(
                1
                for before, after in itertools.pairwise(parts)
                if before["segments"][-1]["address"] == after["segments"][0]["address"]
            )
            assert cuts >= (1 if page_size != 1 else 0)
            assert "allocator_settings" in parts[0]
            assert all("allocator_settings" not in p for p in parts[1:])
        with tensord.connect(server.address) as client:
            joined = client.memory_snapshot()
        assert list(joined) == list(whole)
        assert joined["segments"] == whole["segments"]
        assert joined["allocator_settings"] == whole["allocator_settings"]
        assert joined["device_traces"] == whole["device_traces"] == [[]]
        # a request with no page fields (an older client's DeviceRequest) gets the first page
        old = pb.DeviceRequest().SerializeToString()
        first = pb.MemorySnapshotRequest.FromString(old)
        answer = session.MemorySnapshot(first, metadata=session.md)
        assert answer.next_page_token and answer.ByteSize() <= paging.MAX_PAGE_BYTES
    finally:
        for block in blocks:
            pool.free(block)


class _OneDevice:
    def __init__(self, device: Device) -> None:
        self.device = device

    def get(self, name: str) -> Device:
        return self.device


def _paged_stats(pool: CachingPool) -> MemoryReports:
    devices: Any = _OneDevice(Device("cpu", pool, "test"))
    return MemoryReports(devices, None, None, None, paging.PageTokens())  # type: ignore[arg-type]


def _stats_pages(stats: MemoryReports, page_size: int = 0) -> list[tuple[bytes, str]]:
    pages = []
    token = ""
    while True:
        data, token = stats.memory_snapshot_page("cpu", "", page_size, token)
        pages.append((data, token))
        if not token:
            return pages


def _joined(pages: list[tuple[bytes, str]]) -> dict[str, Any]:
    snapshot: dict[str, Any] = json.loads(pages[0][0])
    for data, _ in pages[1:]:
        part = json.loads(data)
        segments = part["segments"]
        last = snapshot["segments"][-1] if snapshot["segments"] else None
        if segments and last is not None and segments[0]["address"] == last["address"]:
            snapshot["segments"][-1]["blocks"].extend(segments.pop(0)["blocks"])
        snapshot["segments"].extend(segments)
        snapshot["device_traces"][0].extend(part["device_traces"][0])
    return snapshot


@pytest.mark.slow
def test_a_recorded_trace_is_paged_after_the_segments_and_ends_at_the_snapshot() -> None:
    pool = CachingPool(BookkeepingBackend(), record_history=True)
    live = [pool.malloc(512) for _ in range(15_000)]  # ~30,000 trace entries: 3 MB of JSON
    for block in live[::2]:
        pool.free(block)
    stats = _paged_stats(pool)
    pages = _stats_pages(stats)
    assert all(len(data) <= paging.MAX_PAGE_BYTES - paging.PAGE_FRAMING_BYTES for data, _ in pages)
    joined = _joined(pages)
    whole = _json_round_trip(pool.memory_snapshot())
    assert joined["segments"] == whole["segments"]
    # the trace ends at the listing's own snapshot entry (the whole one made another)
    trace = joined["device_traces"][0]
    assert trace[-1]["action"] == "snapshot" and len(trace) > 20_000
    assert trace == whole["device_traces"][0][:-1]
    assert sum(1 for data, _ in pages if json.loads(data)["device_traces"][0]) >= 3
    small = _stats_pages(stats, page_size=100)
    items = [json.loads(d) for d, _ in small]
    assert all(len(p["segments"]) + len(p["device_traces"][0]) <= 100 for p in items)
    del live
