"""No caller can take the server down: the hostile callers of SECURITY.md's availability
guarantee, at reduced scale, each beside a well-behaved client that must keep its session
and its bytes.

Covered here: calls whose request never comes (no token) hold no thread and starve no
liveness; requests are authenticated before a byte of their body is read, and bounded by
their method's receive limit before they are parsed; one tenant's heaviest calls, however
many, cannot make another tenant's idle session lapse; the fair queue's turns; the
undelivered-answer budget.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import tensord
from conftest import SessionStub, open_channel, start_server, wait_until
from tensord import schema as pb
from tensord_server.domain.fairness import FairQueue
from tensord_server.rpc import calls as rpc_calls

TOKENS = {"tok-alice": "alice", "tok-bob": "bob"}
ALICE = (("authorization", "Bearer tok-alice"),)
# Short, so a starved liveness path would reap within the test.
LEASE_S = 1.5
GRACE_S = 0.5


@pytest.fixture
def auth_server() -> Iterator[Any]:
    running = start_server(
        devices=("cpu=256MiB",), auth_tokens=TOKENS, lease=LEASE_S, session_grace=GRACE_S
    )
    yield running
    running.stop()


def _stalled_calls(
    channel: grpc.Channel, methods: tuple[str, ...], count: int, hold: threading.Event
) -> list[Any]:
    """``count`` calls of each method whose request message never comes (bounded by hold)."""

    def never() -> Iterator[bytes]:
        hold.wait(30)
        yield from ()

    calls = []
    for method in methods:
        callable_ = channel.stream_unary(f"/tensord.v1.Tensord/{method}")
        calls += [callable_.future(never(), timeout=30) for _ in range(count)]
    return calls


def test_stalled_calls_without_a_token_are_refused_before_their_request(auth_server) -> None:
    """The sync server gave each of these a worker: four stalled Heartbeats and two stalled
    OpenSessions took the liveness threads, and every idle session was reaped."""
    hold = threading.Event()
    with open_channel(auth_server.address) as channel:
        try:
            stalled = _stalled_calls(channel, ("Heartbeat", "OpenSession", "View"), 20, hold)
            for call in stalled:
                with pytest.raises(grpc.RpcError) as info:
                    call.result(timeout=10)  # at once: the request was never waited for
                assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED
        finally:
            hold.set()


@pytest.mark.slow
def test_stalled_calls_hold_no_thread_and_starve_no_session(auth_server) -> None:
    """A tenant's calls whose request never comes wait as coroutines: no worker, no
    liveness thread; other tenants connect, and their idle sessions live on."""
    hold = threading.Event()
    with tensord.connect(auth_server.address, token="tok-bob") as victim:
        kept = victim.arange(1000, dtype=tensord.int32)
        # a connection of its own each (grpc shares one between alike channels otherwise,
        # and queues streams past its 128 in the client)
        channels = [
            grpc.insecure_channel(
                auth_server.address, options=(("grpc.use_local_subchannel_pool", 1),)
            )
            for _ in range(4)
        ]
        try:
            stalled = []
            for channel in channels:
                callables = [
                    channel.stream_unary(f"/tensord.v1.Tensord/{m}")
                    for m in ("Heartbeat", "OpenSession", "View")
                ]
                stalled += [
                    c.future(_never(hold), metadata=ALICE, timeout=30)
                    for c in callables
                    for _ in range(30)
                ]
            time.sleep(0.5)  # they reach the server
            assert not any(c.done() for c in stalled)
            # more stalls than the server has workers (64): none holds one
            with tensord.connect(auth_server.address, token="tok-bob") as newcomer:
                assert newcomer.arange(3).tolist() == [0, 1, 2]
            time.sleep(3 * LEASE_S + GRACE_S)
            assert victim.session_id in auth_server.daemon.sessions.session_ids()
            assert kept.tolist() == list(range(1000))
        finally:
            hold.set()
            for channel in channels:
                channel.close()


def _never(hold: threading.Event) -> Iterator[bytes]:
    hold.wait(30)
    yield from ()


def test_an_unauthenticated_request_is_refused_before_its_body_is_read(auth_server) -> None:
    """A 64 MiB Empty with no token was parsed (+1.1 GB) and answered INVALID_ARGUMENT."""
    body = b"\x0a" + b"\xff\xff\xff\x07" + bytes(8 << 20)  # a packed shape, then garbage
    with open_channel(auth_server.address) as channel:
        empty = channel.unary_unary("/tensord.v1.Tensord/Empty")
        with pytest.raises(grpc.RpcError) as info:
            empty(body, timeout=10)
        assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED
        # an authenticated one over the control limit is refused by its length, unparsed
        session = SessionStub(channel, "alice", token="tok-alice")
        with pytest.raises(grpc.RpcError) as info:
            empty(body, metadata=session.md, timeout=10)
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert f"the limit is {rpc_calls.CONTROL_REQUEST_BYTES}" in info.value.details()
        # past gRPC's own limit, core refuses it before Python sees a byte
        huge = bytes(rpc_calls.MAX_RECEIVE_BYTES + 1)
        with pytest.raises(grpc.RpcError) as info:
            empty(huge, metadata=session.md, timeout=10)
        assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        session.close()


def test_every_method_has_a_receive_limit_within_grpcs() -> None:
    methods = pb.DESCRIPTOR.services_by_name["Tensord"].methods
    limits = {m.name: rpc_calls.RECEIVE_LIMITS[m.name] for m in methods}
    assert max(limits.values()) == rpc_calls.MAX_RECEIVE_BYTES
    assert limits["Heartbeat"] < limits["View"] == limits["Batch"] < limits["Upload"]


@pytest.mark.slow
def test_one_tenants_heavy_calls_cannot_reap_another_tenants_idle_session(auth_server) -> None:
    """8 threads of 65,536-input Cats starved another tenant's heartbeats through the GIL
    (reaped at --lease 3); the session now lives while its KeepAlive stream does."""
    stop = threading.Event()
    with tensord.connect(auth_server.address, token="tok-bob") as victim:
        kept = victim.arange(100)
        flooder = tensord.connect(auth_server.address, token="tok-alice")
        parts = [flooder.zeros(1) for _ in range(64)]
        inputs = (parts * 1024)[: _cat_inputs()]
        done = [0]

        def flood() -> None:
            while not stop.is_set():
                try:
                    tensord.cat(inputs)
                    done[0] += 1
                except tensord.TensordError:
                    pass

        threads = [threading.Thread(target=flood) for _ in range(8)]
        for thread in threads:
            thread.start()
        try:
            time.sleep(4 * LEASE_S + GRACE_S)
            assert victim.session_id in auth_server.daemon.sessions.session_ids()
            assert not auth_server.daemon.sessions.is_lost(
                auth_server.daemon.sessions.peek(victim.session_id)
            )
        finally:
            stop.set()
            for thread in threads:
                thread.join(60)
            flooder.close()
        assert done[0] > 0  # the flood ran
        assert kept.tolist() == list(range(100))


def _cat_inputs() -> int:
    """The most inputs the server takes in one Cat (the old limit: any list's, 65,536)."""
    try:
        from tensord.protocol import MAX_CAT_INPUTS
    except ImportError:
        return 65536
    return int(MAX_CAT_INPUTS)


@pytest.mark.slow
def test_a_session_whose_client_vanishes_is_still_reaped(auth_server) -> None:
    """The KeepAlive stream keeps only a live client: its end makes the session lost."""
    with open_channel(auth_server.address) as channel:
        session = SessionStub(channel, "gone", token="tok-alice")
        beats = threading.Event()

        def one_beat() -> Iterator[pb.Heartbeat]:
            yield pb.Heartbeat(sent_at=1.0)
            beats.wait(30)

        stream = session.raw.KeepAlive(one_beat(), metadata=session.md, timeout=30)
        next(stream)
        sessions = auth_server.daemon.sessions
        time.sleep(2 * LEASE_S)  # no call at all: the open stream keeps it
        assert session.session_id in sessions.session_ids()
        stream.cancel()  # as a killed client's connection ends it
        beats.set()
        assert wait_until(lambda: session.session_id not in sessions.session_ids(), 10)


def test_a_session_holds_a_bounded_number_of_keepalive_streams(auth_server) -> None:
    with open_channel(auth_server.address) as channel:
        session = SessionStub(channel, "greedy", token="tok-alice")
        release = threading.Event()

        def beats() -> Iterator[pb.Heartbeat]:
            yield pb.Heartbeat(sent_at=1.0)
            release.wait(30)

        streams = [
            session.raw.KeepAlive(beats(), metadata=session.md, timeout=30) for _ in range(6)
        ]
        codes = []
        for stream in streams:
            try:
                next(stream)
                codes.append("OK")
            except grpc.RpcError as err:
                codes.append(err.code().name)
        release.set()
        assert codes.count("RESOURCE_EXHAUSTED") == 2, codes


# -- the fair queue (pure) -------------------------------------------------------------


def test_keys_take_turns_whatever_one_has_queued() -> None:
    queue: FairQueue[str] = FairQueue(2, max_queued_per_key=1000)
    for i in range(100):
        queue.submit("flood", f"f{i}")
    queue.submit("victim", "v0")
    started = [queue.next(), queue.next()]
    queue.assert_invariants()
    assert queue.next() is None  # both workers busy
    assert started == [("flood", "f0"), ("victim", "v0")]
    queue.finished("flood")
    assert queue.next() == ("flood", "f1")
    queue.assert_invariants()


def test_a_key_over_its_share_waits_while_another_key_waits() -> None:
    queue: FairQueue[str] = FairQueue(4, max_running_per_key=2)
    for i in range(4):
        queue.submit("a", f"a{i}")
    assert [queue.next() for _ in range(4)] == [("a", "a0"), ("a", "a1"), ("a", "a2"), ("a", "a3")]
    queue.submit("a", "a4")
    queue.submit("b", "b0")
    queue.finished("a")  # a holds 3 > its share: b goes first
    assert queue.next() == ("b", "b0")
    queue.finished("a")
    queue.finished("a")  # a holds 1 now
    assert queue.next() == ("a", "a4")
    queue.assert_invariants()


def test_the_queue_refuses_beyond_its_bounds() -> None:
    queue: FairQueue[int] = FairQueue(1, max_queued_per_key=3, max_queued=5)
    for i in range(3):
        queue.submit("a", i)
    with pytest.raises(tensord.ResourceExhaustedError, match="3 calls waiting"):
        queue.submit("a", 3, "tenant 'a'")
    queue.submit("b", 0)
    queue.submit("c", 0)
    with pytest.raises(tensord.ResourceExhaustedError, match="the server has 5 calls waiting"):
        queue.submit("d", 0)
    assert queue.drop_waiting("a", 1) and not queue.drop_waiting("a", 1)
    queue.assert_invariants()


def test_a_flood_of_calls_does_not_delay_another_tenants_call_behind_it(auth_server) -> None:
    """With one worker, a tenant's hundred queued calls let another tenant's call through
    after at most one of them, not after all."""
    import asyncio

    from tensord_server.rpc.executor import FairExecutor

    order: list[str] = []

    async def scenario() -> None:
        executor = FairExecutor(1, "test-fair")
        gate = threading.Event()

        def slow(tag: str) -> None:
            gate.wait(5)
            order.append(tag)

        flood = [
            asyncio.ensure_future(executor.run("a", lambda i=i: slow(f"a{i}"))) for i in range(100)
        ]
        await asyncio.sleep(0.05)
        victim = asyncio.ensure_future(executor.run("b", lambda: slow("b")))
        await asyncio.sleep(0.05)
        gate.set()
        await asyncio.gather(victim, *flood)
        executor.shutdown()

    asyncio.run(scenario())
    assert order.index("b") <= 1, order[:5]


def test_answers_a_caller_does_not_read_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unread answers pinned their bytes in the server for the connection's life (64 unread
    8 MB ListNames held 1 GB); over the budget a caller's new calls are refused."""
    monkeypatch.setattr(rpc_calls, "MAX_UNDELIVERED_ANSWER_BYTES", 1000)
    running = start_server(devices=("cpu=16MiB",))
    try:
        calls = rpc_calls.Calls(running.daemon, 1)
        call = rpc_calls.Call(_FakeContext(), "", "conn")
        calls.check_answers(call)
        calls.hold_answer(call, 600)
        calls.check_answers(call)
        calls.hold_answer(call, 600)
        with pytest.raises(tensord.ResourceExhaustedError, match="1200 bytes of answers"):
            calls.check_answers(call)
        call.terminated()  # gRPC delivered them (or gave up): the budget comes back
        calls.check_answers(call)
        calls.shutdown()
    finally:
        running.stop()


class _FakeContext:
    def invocation_metadata(self) -> tuple[()]:
        return ()

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"


def test_uploaded_bytes_arrive_whole_through_the_chunked_sink(auth_server) -> None:
    """Each chunk is written on a worker as it arrives: the bytes are the same."""
    with tensord.connect(auth_server.address, token="tok-alice") as client:
        data = np.random.default_rng(0).standard_normal((3 << 20) // 8)
        assert np.array_equal(client.from_numpy(data).numpy(), data)


def test_the_request_budget_takes_empty_and_overlapping_reservations() -> None:
    """Two empty requests of one key in flight at once (ListNames, CloseSession) left a
    zero entry the second one's end could not find (KeyError -> INTERNAL)."""
    from tensord_server.rpc.executor import RequestBudget

    budget = RequestBudget(per_key=100, total=150)
    with budget.reserve("k", 0), budget.reserve("k", 0):
        pass
    with budget.reserve("k", 60):
        with budget.reserve("k", 0), budget.reserve("j", 80):
            with (
                pytest.raises(tensord.ResourceExhaustedError, match="60 bytes of requests"),
                budget.reserve("k", 50),
            ):
                pass
            with (
                pytest.raises(tensord.ResourceExhaustedError, match="the server holds 140"),
                budget.reserve("i", 20),
            ):
                pass
        assert budget.reserved_by("k") == 60 and budget.reserved_by("j") == 0
    assert budget.reserved == 0 and budget.reserved_by("k") == 0


def test_an_answer_held_after_its_call_ended_is_released_at_once() -> None:
    call = rpc_calls.Call(_FakeContext(), "", "conn")
    call.terminated()
    ran: list[int] = []
    call.add_callback(lambda: ran.append(1))
    assert ran == [1]


@pytest.mark.slow
def test_downloads_a_tenant_never_reads_hold_their_stream_slots_and_small_chunks() -> None:
    """Unread Downloads of 16 MiB chunks grew the server ~770 MB per round: the idle timeout
    handed their slots back while gRPC still held the chunks written to them."""
    running = start_server(
        devices=("cpu=256MiB",),
        auth_tokens=TOKENS,
        stream_idle_timeout=0.5,
        max_streams_per_tenant=2,
    )
    try:
        with open_channel(running.address) as channel:
            session = SessionStub(channel, "hoarder", token="tok-alice")
            meta = session.upload(np.zeros(8 << 20, np.float32))  # 32 MiB
            download = channel.unary_stream(
                "/tensord.v1.Tensord/Download",
                request_serializer=pb.DownloadRequest.SerializeToString,
            )
            request = pb.DownloadRequest(handle=meta.handle, chunk_bytes=16 << 20)
            unread = [download(request, metadata=session.md, timeout=30) for _ in range(2)]
            first = next(unread[0])
            assert len(first) <= rpc_calls.MAX_DOWNLOAD_CHUNK_BYTES  # not the 16 MiB asked
            time.sleep(1.5)  # past the idle timeout: their handlers ended
            third = download(request, metadata=session.md, timeout=30)
            with pytest.raises(grpc.RpcError) as info:
                next(third)
            assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            for call in unread:
                call.cancel()  # gRPC ends the calls: their slots come back
            assert wait_until(lambda: running.daemon.gate.open_streams() == 0, 10)
            assert len(next(download(request, metadata=session.md, timeout=30))) > 0
            session.close()
    finally:
        running.stop()


def test_a_downloads_chunks_close_only_after_a_read_under_way_ends() -> None:
    """The next chunk is read on a worker while gRPC takes the one before: a call that
    fails or is cancelled meanwhile closes its chunks (its held handle goes back) once
    that read ends; closed at once, the generator raised "already executing" and kept
    its handle until garbage collection.  A read after the close gets None, and a second
    close does nothing."""
    reading_began, read_may_end = threading.Event(), threading.Event()
    closed: list[bool] = []

    def make() -> Iterator[bytes]:
        try:
            yield b"first"
            reading_began.set()
            read_may_end.wait(10)
            yield b"second"
            yield b"third"
        finally:
            closed.append(True)

    chunks = rpc_calls._DownloadChunks(make)
    assert chunks.next() == b"first"
    second: list[bytes | None] = []
    reader = threading.Thread(target=lambda: second.append(chunks.next()))
    reader.start()
    assert reading_began.wait(10)
    closer = threading.Thread(target=chunks.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive() and not closed  # waits for the read under way
    read_may_end.set()
    reader.join(10)
    closer.join(10)
    assert second == [b"second"] and closed == [True]
    assert chunks.next() is None and not chunks.open
    chunks.close()
    assert closed == [True]


def test_a_download_counts_its_real_chunk_size_as_undelivered_answer() -> None:
    """A negative chunk size asked for is the default one: counted as it was asked, it
    made the tenant's undelivered answers negative, and nothing was refused after."""
    running = start_server(devices=("cpu=64MiB",), auth_tokens=TOKENS)
    try:
        with open_channel(running.address) as channel:
            session = SessionStub(channel, "asker", token="tok-alice")
            meta = session.upload(np.zeros(1 << 20, np.float32))  # 4 MiB: 4 chunks
            download = channel.unary_stream(
                "/tensord.v1.Tensord/Download",
                request_serializer=pb.DownloadRequest.SerializeToString,
            )
            answers = running.grpc_server.calls._answers
            for asked in (-(1 << 50), 0, 1):
                request = pb.DownloadRequest(handle=meta.handle, chunk_bytes=asked)
                stream = download(request, metadata=session.md, timeout=30)
                first = next(stream)
                expected = len(first)  # the chunk size served
                assert list(answers.values()) == [3 * expected], (asked, answers)
                stream.cancel()
                assert wait_until(lambda: not answers, 10)
            session.close()
    finally:
        running.stop()


def test_the_health_check_answers_without_a_token_and_reads_a_bounded_body(auth_server) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with open_channel(auth_server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "tensord.v1.Tensord"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as info:
            health.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=10)
        assert info.value.code() is grpc.StatusCode.NOT_FOUND
        check = channel.unary_unary("/grpc.health.v1.Health/Check")
        with pytest.raises(grpc.RpcError) as info:
            check(b"\x0a\x80\x80\x10" + bytes(1 << 18), timeout=10)  # a 256 KiB service name
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT


def test_a_stop_does_not_wait_its_grace_for_connected_clients() -> None:
    """Every SDK client holds a KeepAlive stream: a stop ended them only at its grace."""
    running = start_server(devices=("cpu=16MiB",))
    client = tensord.connect(running.address)
    client.arange(3)
    stopped = running.grpc_server.stop(10.0)
    if not stopped.wait(5.0):  # the grace is 10 s
        held = _in_flight(running.grpc_server.calls)
        stopped.wait(30)
        pytest.fail(f"the stop waited for its grace; 5 s into it: {held}")
    running.daemon.close()
    client.close()


def _in_flight(calls: rpc_calls.Calls) -> str:
    """What a stop may be waiting for (read from another thread: a snapshot, for a
    failure's message)."""
    fd_socket = calls.fd_socket
    connections = [] if fd_socket is None else list(fd_socket._connections)
    return (
        f"{len(calls._keepalives)} KeepAlive streams; fd socket connections (idle, woken, "
        f"task done): {[(c.idle, c.woken, c.task is None or c.task.done()) for c in connections]}; "
        f"workers running/queued {calls.work.queue.running}/{calls.work.queue.queued}, "
        f"liveness {calls.liveness.queue.running}/{calls.liveness.queue.queued}"
    )


def test_a_stop_does_not_wait_its_grace_for_a_silent_fd_socket_connection() -> None:
    """A connection to the fd socket that never sends its first line (a ticket or a
    channel bind) is in no call: a stop closed it only at the end of its grace."""
    running = start_server(devices=("cpu=16MiB",))
    calls = running.grpc_server.calls
    assert calls.fd_socket is not None
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        silent.connect(calls.fd_socket.path)
        fd_socket = calls.fd_socket
        assert wait_until(lambda: any(c.task for c in fd_socket._connections), 10)
        started = time.monotonic()
        running.grpc_server.stop(10.0).wait(30)
        assert time.monotonic() - started < 5.0  # the grace is 10 s
    finally:
        silent.close()
        running.daemon.close()


def test_a_keepalive_stream_that_reaches_its_handler_as_the_stop_begins_is_ended() -> None:
    """The stop ends the KeepAlive streams it knows of, then waits for the calls in flight:
    a stream accepted just before the stop, whose handler ran after that, held the whole
    grace."""
    running = start_server(devices=("cpu=16MiB",))
    calls = running.grpc_server.calls
    loop = running.grpc_server._loop
    try:
        asyncio.run_coroutine_threadsafe(calls.end_keepalives(), loop).result(10)
        client = tensord.connect(running.address)  # its KeepAlive reaches the handler now
        client.arange(3)
        deadline = time.monotonic() + 10
        while calls._keepalives and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not calls._keepalives  # ended at once, not held until the stop's grace
        client.close()
    finally:
        running.grpc_server.stop(0).wait(30)
        running.daemon.close()


def test_a_stop_ends_a_keepalive_handler_still_waiting_for_its_liveness_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A KeepAlive whose handler still waits for a busy liveness worker when gRPC stops was
    left pending on the loop, and the loop's close destroyed it mid-await ("Task was
    destroyed but it is pending!"): the stop cancels what is left and lets it end."""
    from tensord_server.rpc import handlers

    release = threading.Event()
    entered = threading.Event()
    keepalive_session = handlers.TensordService.keepalive_session

    def slow(self: Any, context: Any) -> Any:
        entered.set()
        release.wait(2)  # the liveness worker is busy past the stop
        return keepalive_session(self, context)

    monkeypatch.setattr(handlers.TensordService, "keepalive_session", slow)
    running = start_server(devices=("cpu=16MiB",))
    server = running.grpc_server
    loop = server._loop
    left: list[asyncio.Task[Any]] = []
    close = loop.close

    def recording_close() -> None:
        left.extend(task for task in asyncio.all_tasks(loop) if not task.done())
        close()

    monkeypatch.setattr(loop, "close", recording_close)
    client = None
    try:
        client = tensord.connect(running.address)
        assert entered.wait(10)
        assert server.stop(0).wait(30)
    finally:
        release.set()
        running.daemon.close()
        if client is not None:
            client.close()
    assert not left, f"tasks pending at the loop's close: {left}"


def test_a_call_over_many_inputs_takes_the_registrys_lock_a_few_times(
    fresh_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 2,048-input Cat took the server-wide Storage registry's lock twice per input (hold
    and release), so a tenant's flood of them stood in every other tenant's way."""
    registry = fresh_server.daemon.storages
    acquired = [0]
    lock = registry._lock

    class Counting:
        def __enter__(self) -> None:
            acquired[0] += 1
            lock.acquire()

        def __exit__(self, *exc: object) -> None:
            lock.release()

    with tensord.connect(fresh_server.address) as client:
        parts = [client.zeros(1) for _ in range(8)]
        inputs = parts * 64  # 512 inputs
        client.synchronize()
        monkeypatch.setattr(registry, "_lock", Counting())
        joined = tensord.cat(inputs)
        assert joined.shape == (512,)
        monkeypatch.setattr(registry, "_lock", lock)
    assert acquired[0] < 32, acquired[0]


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_tenant_between_its_calls_still_caps_a_flood_at_its_share() -> None:
    """A well-behaved tenant has nothing queued between two calls; a flood must not take
    every worker in that gap (each of its threads would take the GIL from the tenant)."""
    clock = _Clock()
    queue: FairQueue[str] = FairQueue(8, max_running_per_key=1, active_window_s=1.0, clock=clock)
    queue.submit("victim", "v0")
    assert queue.next() == ("victim", "v0")
    queue.finished("victim")  # the victim is between calls: nothing queued or running
    for i in range(8):
        queue.submit("flood", f"f{i}")
    assert queue.next() == ("flood", "f0")
    assert queue.next() is None  # the victim is still active: the flood keeps its share
    queue.assert_invariants()
    clock.now += 1.5  # the victim went quiet: the flood may use every worker
    assert [queue.next() for _ in range(7)] == [("flood", f"f{i}") for i in range(1, 8)]
    queue.assert_invariants()


def test_a_key_alone_uses_every_worker() -> None:
    queue: FairQueue[str] = FairQueue(4, clock=_Clock())
    for i in range(4):
        queue.submit("a", f"a{i}")
    assert [queue.next() for _ in range(4)] == [("a", f"a{i}") for i in range(4)]
    queue.assert_invariants()


def test_a_key_with_a_backlog_is_paced_to_its_share_of_the_time() -> None:
    """A flood's next call waits its last call's CPU time per other active key, so it
    holds the GIL at most its share; a key sending one call at a time is never paced."""
    clock = _Clock()
    queue: FairQueue[str] = FairQueue(8, max_running_per_key=1, clock=clock)
    for i in range(3):
        queue.submit("flood", f"f{i}")
    queue.submit("victim", "v0")
    assert {queue.next(), queue.next()} == {("flood", "f0"), ("victim", "v0")}
    queue.finished("victim", 0.010)  # no backlog: not paced
    queue.finished("flood", 0.020)  # a backlog, one other active key: 20 ms of pause
    assert queue.next() is None
    assert queue.wake_at() == pytest.approx(clock.now + 0.020)
    queue.submit("victim", "v1")
    assert queue.next() == ("victim", "v1")  # the victim goes at once, never paced
    clock.now += 0.021
    assert queue.next() == ("flood", "f1")
    assert queue.wake_at() is None
    queue.assert_invariants()


def test_a_paced_key_alone_is_not_held_back() -> None:
    clock = _Clock()
    queue: FairQueue[str] = FairQueue(1, clock=clock)
    for i in range(2):
        queue.submit("a", f"a{i}")
    assert queue.next() == ("a", "a0")
    queue.finished("a", 0.5)
    assert queue.next() == ("a", "a1") and queue.wake_at() is None


def test_the_executor_runs_a_paced_keys_calls_when_their_pause_ends() -> None:
    import asyncio

    from tensord_server.rpc.executor import FairExecutor

    def busy(tag: str) -> str:
        deadline = time.thread_time() + 0.005
        while time.thread_time() < deadline:
            pass
        return tag

    async def scenario() -> list[str]:
        executor = FairExecutor(4, "test-paced")
        try:
            calls = [executor.run("flood", lambda i=i: busy(f"f{i}")) for i in range(6)]
            calls.append(executor.run("victim", lambda: busy("v")))
            return await asyncio.wait_for(asyncio.gather(*calls), 10)
        finally:
            executor.shutdown()

    assert asyncio.run(scenario()) == [f"f{i}" for i in range(6)] + ["v"]


def test_a_small_call_runs_on_the_loop_only_while_no_worker_is_busy() -> None:
    """``inline`` work runs on the event loop's thread when nothing runs or waits (its turn
    and CPU time still counted); beside a running call it waits for a worker like any."""
    import asyncio

    from tensord_server.rpc.executor import FairExecutor

    async def scenario() -> tuple[str, str, str]:
        executor = FairExecutor(2, "test-inline")
        loop_thread = threading.current_thread().name
        gate = threading.Event()
        try:
            alone = await executor.run("a", lambda: threading.current_thread().name, inline=True)
            assert executor.queue.running == 0 and executor.queue.queued == 0
            executor.queue.assert_invariants()
            busy = asyncio.ensure_future(executor.run("b", lambda: gate.wait(5)))
            await asyncio.sleep(0.05)
            beside = await executor.run("a", lambda: threading.current_thread().name, inline=True)
            gate.set()
            await busy
            executor.queue.assert_invariants()
            return loop_thread, alone, beside
        finally:
            executor.shutdown()

    loop_thread, alone, beside = asyncio.run(scenario())
    assert alone == loop_thread
    assert beside != loop_thread and beside.startswith("test-inline")


def test_only_small_bounded_calls_are_taken_on_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """A view, a name and a release of an idle server run on its event loop; a view making a
    tensor per part, a factory and a request over INLINE_REQUEST_BYTES go to a worker."""
    from tensord_server.rpc import calls as calls_module
    from tensord_server.rpc.grpc_server import create_server

    ran: list[tuple[str, bool]] = []
    answer = calls_module.Calls._answer

    def recording(self: Any, method: Any, request: Any, call: Any) -> Any:
        ran.append((method.name, threading.current_thread().name == "tensord-rpc"))
        return answer(self, method, request, call)

    monkeypatch.setattr(calls_module.Calls, "_answer", recording)
    server, port = create_server("127.0.0.1:0", ("cpu=64MiB",))
    try:
        with tensord.connect(f"127.0.0.1:{port}", pipelining=False) as client:
            x = client.arange(12)
            ran.clear()
            x.view(3, 4)
            x.unbind(0)
            client.put("n", x)
            client.get("n")
            client.delete("n")
            client.zeros(4)
            big = "b" * (calls_module.INLINE_REQUEST_BYTES + 10)
            with pytest.raises(tensord.NotFoundError):
                client.get(big)
    finally:
        server.stop(None).wait()
    on_loop = {name: inline for name, inline in ran}
    assert on_loop["View"] is False  # the last View was the unbind's
    assert [inline for name, inline in ran if name == "View"] == [True, False]
    assert on_loop["PutName"] and on_loop["DeleteName"]
    # a same-host client's get is a GetNameExport
    gets = [inline for name, inline in ran if name in ("GetName", "GetNameExport")]
    assert gets == [True, False]
    assert on_loop["Full"] is False


def exports_on_the_loop(monkeypatch: pytest.MonkeyPatch, gpu: bool) -> list[bool]:
    """Whether each Export of an idle same-host client's reads ran on the event loop, on a
    host-only server made to count as one with a GPU when ``gpu``."""
    from tensord_server.rpc import calls as calls_module
    from tensord_server.rpc.grpc_server import create_server

    ran: list[tuple[str, bool]] = []
    answer = calls_module.Calls._answer

    def recording(self: Any, method: Any, request: Any, call: Any) -> Any:
        ran.append((method.name, threading.current_thread().name == "tensord-rpc"))
        return answer(self, method, request, call)

    monkeypatch.setattr(calls_module.Calls, "_answer", recording)
    if gpu:
        monkeypatch.setattr(calls_module, "is_gpu", lambda device: True)
    server, port = create_server("127.0.0.1:0", ("cpu=64MiB",))
    try:
        with tensord.connect(f"127.0.0.1:{port}", pipelining=False) as client:
            n = 1 << 18  # 1 MiB of float32: read through the mapping, so exported
            x = client.arange(n, dtype=tensord.float32)
            ran.clear()
            for _ in range(2):
                assert np.array_equal(x.numpy(), np.arange(n, dtype=np.float32))
    finally:
        server.stop(None).wait()
    return [inline for name, inline in ran if name == "Export"]


def test_a_host_export_is_taken_on_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """A same-host read's Export of host memory is table work, as a GetNameExport's: on an
    idle server it runs on the event loop, sparing the two thread handoffs that were most
    of a small download's time."""
    assert exports_on_the_loop(monkeypatch, gpu=False) == [True, True]


def test_an_export_is_a_workers_on_a_server_with_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """An Export of GPU memory waits for the server stream's queued work before it hands
    out the IPC handle: on a server with a GPU no Export runs on the event loop."""
    assert exports_on_the_loop(monkeypatch, gpu=True) == [False, False]


def downloads_on_the_loop(
    monkeypatch: pytest.MonkeyPatch, gpu: bool
) -> list[tuple[str, str, bool]]:
    """(tensor, what served it, on the event loop) for each Download of a remote client of
    an idle host-only server (made to count as one with a GPU when ``gpu``): "whole" a
    one-chunk read, "chunks" the streamed generator; each read checked against NumPy."""
    from tensord_server.rpc import calls as calls_module
    from tensord_server.rpc import handlers
    from tensord_server.rpc.grpc_server import create_server

    ran: list[tuple[str, bool]] = []
    whole, chunks = handlers.TensordService.download_whole, handlers.TensordService.download_chunks

    def recording_whole(self: Any, request: Any, context: Any) -> Any:
        read = whole(self, request, context)
        ran.append(("whole" if read is not None else "none", on_loop()))
        return read

    def recording_chunks(self: Any, request: Any, context: Any) -> Any:
        ran.append(("chunks", on_loop()))
        return chunks(self, request, context)

    def on_loop() -> bool:
        return threading.current_thread().name == "tensord-rpc"

    monkeypatch.setattr(handlers.TensordService, "download_whole", recording_whole)
    monkeypatch.setattr(handlers.TensordService, "download_chunks", recording_chunks)
    if gpu:
        monkeypatch.setattr(calls_module, "is_gpu", lambda device: True)
    server, port = create_server("127.0.0.1:0", ("cpu=64MiB",))
    seen: list[tuple[str, str, bool]] = []
    try:
        with tensord.connect(f"127.0.0.1:{port}", local=False, pipelining=False) as client:
            small = np.arange(1 << 18, dtype=np.float32)  # 1 MiB: one chunk
            large = np.arange(3 << 18, dtype=np.float32)  # 3 MiB: three chunks
            cases = {
                "1 MiB": (client.from_numpy(small), small),
                "4 KiB": (client.from_numpy(small[:1024]), small[:1024]),
                "transposed": (
                    client.from_numpy(small.reshape(512, 512)).t(),
                    small.reshape(512, 512).T,
                ),
                "3 MiB": (client.from_numpy(large), large),
            }
            for label, (tensor, expected) in cases.items():
                ran.clear()
                assert np.array_equal(tensor.numpy(), expected), label
                seen.extend((label, what, inline) for what, inline in ran)
    finally:
        server.stop(None).wait()
    return seen


def test_a_one_chunk_download_of_host_memory_is_read_on_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Download of one plain chunk (contiguous, at most 1 MiB) on an idle server is a
    lookup and one copy: read on the event loop, without its generator's two thread
    handoffs; a transposed view (gathered) and a tensor of several chunks stream from a
    worker, after a look on the loop that finds them not plain."""
    assert downloads_on_the_loop(monkeypatch, gpu=False) == [
        ("1 MiB", "whole", True),
        ("4 KiB", "whole", True),
        ("transposed", "none", True),
        ("transposed", "chunks", False),
        ("3 MiB", "none", True),
        ("3 MiB", "chunks", False),
    ]


def test_a_download_read_on_the_loop_keeps_the_op_element_bound() -> None:
    """--max-op-elements bounds a download whether it is read on the loop or streamed: the
    read on the loop served a tensor the streamed path refuses, so whether a read was
    refused depended on whether a worker was busy."""
    from tensord_server.domain.store import TensorStore
    from tensord_server.rpc.grpc_server import create_server

    store = TensorStore(("cpu=64MiB",), max_op_elements=1000)
    server, port = create_server("127.0.0.1:0", store=store)
    try:
        with tensord.connect(f"127.0.0.1:{port}", local=False, pipelining=False) as client:
            fits = client.from_numpy(np.arange(1000, dtype=np.uint8))
            assert np.array_equal(fits.numpy(), np.arange(1000, dtype=np.uint8))
            over = client.from_numpy(np.zeros(4096, np.uint8))  # an upload is not an op
            with pytest.raises(tensord.ResourceExhaustedError, match="--max-op-elements 1000"):
                over.numpy()
    finally:
        server.stop(None).wait()
        store.close()


def test_no_download_is_read_on_the_loop_of_a_server_with_a_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A GPU tensor's read copies from the device: on a server with a GPU every Download
    streams from a worker."""
    assert {(what, inline) for _, what, inline in downloads_on_the_loop(monkeypatch, gpu=True)} == {
        ("chunks", False)
    }


def test_a_flatten_that_copies_is_never_taken_on_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A raw View flatten of a tensor no view can express copies it (up to
    --max-op-elements): on the event loop that copy would hold every call waiting on the
    loop for its whole length (the SDK sends such a flatten as a Reshape; a raw caller
    need not)."""
    from tensord_server.rpc import calls as calls_module
    from tensord_server.rpc.grpc_server import create_server

    ran: list[tuple[str, bool]] = []
    answer = calls_module.Calls._answer

    def recording(self: Any, method: Any, request: Any, call: Any) -> Any:
        ran.append((method.name, threading.current_thread().name == "tensord-rpc"))
        return answer(self, method, request, call)

    monkeypatch.setattr(calls_module.Calls, "_answer", recording)
    server, port = create_server("127.0.0.1:0", ("cpu=64MiB",))
    try:
        with open_channel(f"127.0.0.1:{port}") as channel:
            stub = SessionStub(channel)
            x = stub.upload(np.arange(12, dtype=np.int64).reshape(3, 4).T)
            t = stub.View(
                pb.ViewRequest(handle=x.handle, transpose=pb.Transpose(dim0=0, dim1=1)),
                metadata=stub.md,
            ).tensors[0]
            ran.clear()
            flat = stub.View(
                pb.ViewRequest(handle=t.handle, flatten=pb.Flatten(start_dim=0, end_dim=-1)),
                metadata=stub.md,
            ).tensors[0]
            assert list(flat.shape) == [12] and flat.handle != t.handle
    finally:
        server.stop(None).wait()
    assert ran == [("View", False)]
