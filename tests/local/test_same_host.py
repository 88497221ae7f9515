"""Same-host zero copy: memfd segments, Export/ReleaseExports, the fd socket, DLPack, fast
transfers, holds and their lifetime, tenant isolation and the gRPC fallback (torch is the oracle)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import mmap
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tensord
import torch
from conftest import SessionStub, interrupted_after, open_channel, slowed_exports, wait_until
from tensord import schema as pb
from tensord.errors import FailedPreconditionError
from tensord.local import channel, copies, segments, transfers
from tensord.tensor import assign_data
from tensord.wire import worker
from tensord_server.devices.shm import SharedHostBackend
from tensord_server.domain.quotas import QuotaSpec
from test_compaction import BIG_ELEMENTS, POOL, fragment, random_tensor, segments_of, storage_of

REPO = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def exported_storages(daemon: Any) -> int:
    return daemon.exports.stats("cpu")[0]


def run_child(address: str, body: str, *, env: dict[str, str] | None = None) -> Any:
    """A second client process running ``body`` (with ``client`` connected to ``address``)."""
    script = "import numpy as np, torch, tensord\n"
    script += f"client = tensord.connect({address!r})\n" + textwrap.dedent(body)
    path = os.pathsep.join([str(REPO / "client"), str(REPO / "server")])
    return subprocess.Popen(
        [sys.executable, "-c", script],
        env={**os.environ, "PYTHONPATH": path, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_cpu_segments_are_memfds_the_server_maps(server: Any) -> None:
    assert isinstance(server.daemon.devices.get("cpu").backend, SharedHostBackend)


@pytest.mark.slow
def test_another_process_writes_through_torch_from_dlpack_of_a_transposed_narrowed_view(
    server: Any, client: Any
) -> None:
    values = np.arange(64 * 48, dtype=np.float32).reshape(64, 48)
    x = client.tensor(values)
    client.put("zc-shared", x, overwrite=True)
    child = run_child(
        server.address,
        """
        x = client.get("zc-shared")
        view = x.t().narrow(0, 2, 10)
        t = torch.from_dlpack(view)
        assert t.shape == (10, 64) and t.stride() == (1, 48), (t.shape, t.stride())
        t.mul_(3)
        print("done", flush=True)
        """,
    )
    _, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    expected = torch.from_numpy(values.copy())
    expected.t().narrow(0, 2, 10).mul_(3)
    np.testing.assert_array_equal(x.numpy(), expected.numpy())  # through the SDK
    np.testing.assert_array_equal(np.from_dlpack(x), expected.numpy())  # through its own alias
    client.delete("zc-shared")


def test_dlpack_views_alias_the_pool_with_their_sizes_and_strides(client: Any) -> None:
    values = np.arange(24, dtype=np.float32).reshape(4, 6)
    oracle = torch.from_numpy(values.copy())
    x = client.tensor(values)
    cases = [
        (x[1].expand(3, 6), oracle[1].expand(3, 6)),
        (x.view(tensord.int32), oracle.view(torch.int32)),
        (x[:, 1:5].view(tensord.int16), oracle[:, 1:5].view(torch.int16)),
        (x.t()[2:], oracle.t()[2:]),
    ]
    for view, expected in cases:
        alias = torch.from_dlpack(view)
        assert alias.shape == expected.shape and alias.stride() == expected.stride()
        assert alias.dtype == expected.dtype
        assert torch.equal(alias, expected)
        assert np.from_dlpack(view).strides == expected.numpy().strides
    alias = torch.from_dlpack(x[1].expand(3, 6))
    torch.from_dlpack(x)[1, 0] = -1.0  # one write, seen by every alias and by the server
    assert alias[2, 0].item() == -1.0 and x[1, 0].item() == -1.0
    assert tuple(x.__dlpack_device__()) == (1, 0)
    bf = client.tensor(values).to(tensord.bfloat16)
    assert torch.equal(torch.from_dlpack(bf), torch.from_numpy(values).to(torch.bfloat16))
    flags = client.tensor(values > 10)
    assert torch.equal(torch.from_dlpack(flags), torch.from_numpy(values > 10))
    with pytest.raises(RuntimeError, match="Can't export tensors that require gradient"):
        client.tensor(values, requires_grad=True).__dlpack__()


def test_asarray_copy_false_aliases_the_pool_and_asarray_copies(client: Any) -> None:
    values = np.arange(24, dtype=np.float32).reshape(4, 6)
    x = client.tensor(values)
    view = x.t()[1:4]
    alias = np.asarray(view, copy=False)  # NumPy's protocol: never a silent copy
    assert alias.strides == values.T[1:4].strides
    np.testing.assert_array_equal(alias, values.T[1:4])
    alias[0, 0] = -7.0  # x[0, 1]: written through the alias, seen by the server
    assert x[0, 1].item() == -7.0
    assert np.asarray(view, dtype=np.float32, copy=False)[0, 0] == -7.0
    snapshot = np.asarray(view)  # copy=None: a copy, as x.numpy() is
    snapshot[0, 0] = 1.0
    assert x[0, 1].item() == -7.0
    with pytest.raises(ValueError, match=r"Unable to avoid copy.*needs a cast"):
        np.asarray(x, dtype=np.float64, copy=False)
    with pytest.raises(
        ValueError, match=r"Unable to avoid copy.*Can.t call numpy\(\) on Tensor that requires grad"
    ):
        np.asarray(client.tensor(values, requires_grad=True), copy=False)
    complex_values = client.tensor(np.ones(3, dtype=np.complex64))
    with pytest.raises(ValueError, match=r"Unable to avoid copy.*conjugate bit set"):
        np.asarray(complex_values.conj(), copy=False)
    with pytest.raises(ValueError, match=r"Unable to avoid copy.*negative bit set"):
        np.asarray(complex_values.conj().imag, copy=False)


def test_exports_pin_until_the_consumer_collects_its_array(server: Any, client: Any) -> None:
    x = client.tensor(np.ones(1000, dtype=np.float32))
    storage = storage_of_handle(server.daemon, client, x)
    before = exported_storages(server.daemon)
    alias = torch.from_dlpack(x)
    assert storage.holds == 1
    stats = client.memory_stats()
    assert stats["exports.storages.current"] == before + 1
    assert stats["exports.bytes.current"] >= 4000
    del alias
    client.flush()
    assert storage.holds == 0
    assert exported_storages(server.daemon) == before


def count_calls(client: Any, monkeypatch: Any, method: str) -> list[str]:
    """The ``method`` RPCs the client makes from now on (one entry each)."""
    made: list[str] = []
    call = client._conn.call

    def counting(name: str, request: Any, *args: Any) -> Any:
        if name == method:
            made.append(name)
        return call(name, request, *args)

    monkeypatch.setattr(client._conn, "call", counting)
    return made


def count_exports(client: Any, monkeypatch: Any) -> list[str]:
    """The Exports the client asks from now on, through gRPC or its call channel."""
    made: list[str] = []
    call_export = client._local._call_export

    def counting(request: Any) -> Any:
        made.append(request.handle)
        return call_export(request)

    monkeypatch.setattr(client._local, "_call_export", counting)
    return made


def test_dlpack_of_any_view_reuses_a_live_export_without_an_rpc(
    server: Any, client: Any, monkeypatch: Any
) -> None:
    values = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    x = client.tensor(values)
    storage = storage_of_handle(server.daemon, client, x)
    exports = count_exports(client, monkeypatch)
    first = torch.from_dlpack(x)
    aliases = [
        torch.from_dlpack(x),
        torch.from_dlpack(x.t()),
        torch.from_dlpack(x[3:9, ::2]),
        torch.from_dlpack(x.view(tensord.int32)),
    ]
    assert len(exports) == 1  # only the first __dlpack__ asked the server
    assert storage.holds == 1
    assert torch.equal(aliases[1], torch.from_numpy(values).t())
    assert torch.equal(aliases[2], torch.from_numpy(values)[3:9, ::2])
    assert torch.equal(aliases[3], torch.from_numpy(values).view(torch.int32))
    # the pin lasts while any capsule's array does, whichever came first
    del first, aliases[:3]
    client.flush()
    assert storage.holds == 1
    assert aliases[0][0, 5].item() == values.view(np.int32)[0, 5]  # the int32 view
    del aliases
    client.flush()
    assert storage.holds == 0
    # a new __dlpack__ after the last capsule went exports again
    again = torch.from_dlpack(x)
    assert len(exports) == 2
    assert storage.holds == 1
    del again
    client.flush()
    assert storage.holds == 0


def test_a_reused_export_sees_the_writes_queued_before_it(client: Any, monkeypatch: Any) -> None:
    x = client.zeros(4096)
    alias = torch.from_dlpack(x)
    exports = count_exports(client, monkeypatch)
    x.fill_(7.0)  # pipelined: queued, not yet sent
    x[:10] = 3.0
    again = torch.from_dlpack(x)
    assert not exports  # reused, and still the bytes are those of every op issued before
    assert again[:10].eq(3).all() and again[10:].eq(7).all()
    del alias, again


def test_a_reused_export_is_not_reused_by_another_session_or_a_closed_client(
    server: Any, monkeypatch: Any
) -> None:
    with tensord.connect(server.address) as owner, tensord.connect(server.address) as other:
        owner.put("reuse-me", owner.tensor(np.ones(4096, dtype=np.float32)))
        x = owner.get("reuse-me")
        alias = torch.from_dlpack(x)
        y = other.attach(x.share())  # (a get would bring its own export along)
        exports = count_calls(other, monkeypatch, "Export")
        theirs = torch.from_dlpack(y)  # same Storage, another session: its own export
        assert len(exports) == 1
        assert torch.equal(theirs, alias)
        owner.delete("reuse-me")
    with pytest.raises(tensord.errors.TensordError):
        torch.from_dlpack(x)  # a closed client refuses, capsule alive or not
    del alias, theirs


class _NoWalk(dict):  # type: ignore[type-arg]
    """An export table that fails a test when walked whole."""

    def values(self) -> Any:
        raise AssertionError("an Export walked every export of the server")


def test_export_checks_the_handle_limit_without_walking_every_export(make_server: Any) -> None:
    running = make_server(max_handles_per_session=8)
    table = running.daemon.exports
    with tensord.connect(running.address) as client:
        x = client.tensor(np.ones(1000, dtype=np.float32))
        session = running.daemon.sessions.peek(client.session_id)
        room = 8 - running.daemon.sessions.handle_count(session)
        table._exports = _NoWalk(table._exports)
        try:
            exports = [table.export(session, x.handle)[0] for _ in range(room)]
            assert table.count(session.id) == room
            with pytest.raises(tensord.errors.ResourceExhaustedError, match=r"\(8 in all\)"):
                table.export(session, x.handle)
            assert table.release(session, [exports[0].id, "unknown"]) == 1
            assert table.count(session.id) == room - 1
            table.export(session, x.handle)
        finally:
            table._exports = dict(table._exports)
    assert table.count(session.id) == 0  # the session's end released the rest


def test_the_handle_limit_counts_handles_share_tokens_and_exports_together(
    make_server: Any,
) -> None:
    """--max-handles-per-session bounds all a session keeps: before, adding handles never
    counted its exports (a session could hold the limit in exports and as many handles
    again) and an Export never counted its share tokens."""
    limit = 8
    running = make_server(max_handles_per_session=limit)
    table, sessions = running.daemon.exports, running.daemon.sessions
    tokens = running.daemon.share_tokens
    with tensord.connect(running.address) as client:
        x = client.tensor(np.ones(1000, dtype=np.float32))
        client.synchronize()
        session = sessions.peek(client.session_id)
        held = (
            sessions.handle_count(session) + tokens.count_of(session.id) + table.count(session.id)
        )
        exports = [table.export(session, x.handle)[0] for _ in range(limit - held - 1)]
        token = x.share()  # the last entry the limit allows
        full = rf"\({limit} in all\)"
        with pytest.raises(tensord.errors.ResourceExhaustedError, match=full):
            x.view(10, 100)
            client.synchronize()
        with pytest.raises(tensord.errors.ResourceExhaustedError, match=full):
            table.export(session, x.handle)
        assert table.release(session, [exports[0].id]) == 1  # room for one entry again
        y = x.view(10, 100)
        client.synchronize()
        np.testing.assert_array_equal(y.numpy(), np.ones((10, 100), dtype=np.float32))
        client.revoke(token)


def test_concurrent_exports_of_one_session_never_pass_the_handle_limit(
    make_server: Any, monkeypatch: Any
) -> None:
    """Two Exports that both pass the first check (one room left): the one added second is
    refused and its hold dropped (both were added before: the limit overshot)."""
    running = make_server(max_handles_per_session=8)
    table, sessions = running.daemon.exports, running.daemon.sessions
    with tensord.connect(running.address) as client:
        x = client.tensor(np.ones(1000, dtype=np.float32))
        session = sessions.peek(client.session_id)
        storage = storage_of_handle(running.daemon, client, x)
        room = 8 - sessions.handle_count(session)
        for _ in range(room - 1):
            table.export(session, x.handle)
        holds, hold, inner = storage.holds, sessions.hold, []

        def hold_while_another_exports(*args: Any) -> Any:
            ref = hold(*args)
            if not inner:  # the other Export runs between this one's check and its add
                inner.append(None)
                inner[0] = table.export(session, x.handle)[0]
            return ref

        monkeypatch.setattr(sessions, "hold", hold_while_another_exports)
        with pytest.raises(tensord.errors.ResourceExhaustedError, match=r"\(8 in all\)"):
            table.export(session, x.handle)
        assert len(inner) == 1 and table.count(session.id) == room
        assert storage.holds == holds + 1  # the inner export's hold only


def test_an_export_racing_a_release_of_its_handle_is_answered_and_ended_by_its_id(
    server: Any, stub: Any, monkeypatch: Any
) -> None:
    """A Release of the handle landing after the Export's lookup, before its answer: the
    Export is ordered first (answered, so the client can end it), never failed with its
    export added (a pin the client cannot end before its session does)."""
    table, sessions = server.daemon.exports, server.daemon.sessions
    session = sessions.peek(stub.session_id)
    x = stub.upload(np.arange(1000, dtype=np.float32))
    storage = sessions.lookup(session, x.handle).storage
    export = table.export

    def export_then_release(*args: Any, **kwargs: Any) -> Any:
        answer = export(*args, **kwargs)
        sessions.release(session, [x.handle])  # the concurrent Release, in between
        return answer

    monkeypatch.setattr(table, "export", export_then_release)
    answer = stub.Export(pb.ExportRequest(handle=x.handle), metadata=stub.md)
    monkeypatch.undo()
    assert answer.tensor.handle == x.handle and list(answer.tensor.shape) == [1000]
    assert table.count(session.id) == 1 and storage.holds == 1  # the export's hold only
    with pytest.raises(grpc.RpcError) as released:  # the Release did happen
        stub.Export(pb.ExportRequest(handle=x.handle), metadata=stub.md)
    assert released.value.code() == grpc.StatusCode.NOT_FOUND
    ended = stub.ReleaseExports(
        pb.ReleaseExportsRequest(export_ids=[answer.export_id]), metadata=stub.md
    )
    assert ended.released == 1 and table.count(session.id) == 0 and storage.holds == 0


def test_an_export_in_a_segment_the_request_names_as_mapped_comes_without_a_ticket(
    server: Any, stub: Any
) -> None:
    """A ticket only for a segment the client does not map yet (naming segments of
    another server instance, or other segments, changes nothing); the pin is the same."""
    table = server.daemon.exports
    x = stub.upload(np.arange(1000, dtype=np.float32))
    first = stub.Export(pb.ExportRequest(handle=x.handle), metadata=stub.md)
    assert first.ticket and first.fd_socket
    instance, segment = first.server_instance, first.segment_id

    def export(server_instance: str, mapped: list[int]) -> Any:
        request = pb.ExportRequest(
            handle=x.handle, server_instance=server_instance, mapped_segments=mapped
        )
        return stub.Export(request, metadata=stub.md)

    tickets = len(table._tickets)
    mapped = export(instance, [segment + 1, segment])
    assert not mapped.ticket and not mapped.fd_socket and len(table._tickets) == tickets
    assert (mapped.segment_id, mapped.storage_byte_offset) == (segment, first.storage_byte_offset)
    assert export("another server", [segment]).ticket  # ids restart with a server
    assert export(instance, [segment + 1]).ticket
    assert table.count(stub.session_id) == 4 and len({first.export_id, mapped.export_id}) == 2
    ids = [first.export_id, mapped.export_id]
    stub.ReleaseExports(pb.ReleaseExportsRequest(export_ids=ids), metadata=stub.md)
    assert table.count(stub.session_id) == 2


def test_the_mapped_segments_a_request_names_are_searched_outside_the_export_tables_lock(
    server: Any, client: Any
) -> None:
    """A request may name up to 65,536 mapped segments (limits.MAX_LIST_LEN; ~3 ms to search
    a protobuf list): searched under the table's lock, which every session's Exports, the fd
    socket and the GPU pools' release veto share, a few clients stalled all of them."""
    table = server.daemon.exports
    x = client.tensor(np.ones(1000, dtype=np.float32))
    session = server.daemon.sessions.peek(client.session_id)
    searched_under_lock: list[bool] = []

    class Watched(list):  # type: ignore[type-arg]
        def __contains__(self, item: object) -> bool:
            searched_under_lock.append(table._lock.locked())
            return super().__contains__(item)

    export, ticket, _ = table.export(session, x.handle, Watched([-1]))
    assert ticket and searched_under_lock == [False]
    table.release(session, [export.id])


def test_fresh_dlpack_exports_of_a_mapped_segment_issue_no_tickets(
    server: Any, client: Any
) -> None:
    """The SDK names the segments it maps: once mapped, a fresh Export (no capsule alive)
    adds no ticket to the server's table (each one did, never redeemed)."""
    table = server.daemon.exports
    x = client.tensor(np.arange(1000, dtype=np.float32))
    alias = torch.from_dlpack(x)  # maps the segment: a ticket, redeemed
    del alias
    client.flush()
    tickets = len(table._tickets)
    for _ in range(3):
        alias = torch.from_dlpack(x)
        assert int(alias[999]) == 999
        del alias
        client.flush()
    assert len(table._tickets) == tickets and exported_storages(server.daemon) == 0


def test_an_export_answered_without_a_ticket_for_a_forgotten_segment_is_made_again(
    client: Any, server: Any
) -> None:
    """The request named a segment the client no longer maps by the answer (close() forgot
    it): that export is released and one with a ticket replaces it; the alias works."""
    x = client.tensor(np.arange(1000, dtype=np.float32))
    alias = torch.from_dlpack(x)
    del alias
    client.flush()
    mapper = client._session.local
    instance, mapped = mapper._mapped_hint
    assert instance == server.daemon.exports.instance and mapped  # named in the next Exports
    with mapper._lock:
        mapper._segments.clear()  # forgotten, while the hint still names it
    alias = torch.from_dlpack(x)
    assert int(alias[999]) == 999 and mapper.mapped_count() == 1
    del alias
    client.flush()
    assert exported_storages(server.daemon) == 0  # both exports ended


def storage_of_handle(daemon: Any, client: Any, tensor: Any) -> Any:
    session = daemon.sessions.peek(client.session_id)
    return daemon.sessions.lookup(session, tensor.handle).storage


@pytest.mark.slow
@pytest.mark.parametrize("shift", [1, 1 << 16, -(1 << 16)], ids=["1", "64Ki", "-64Ki"])
def test_a_copy_between_two_clients_mappings_of_one_segment_sees_the_overlap(
    server: Any, shift: int
) -> None:
    """Two Clients of one process map the same segment at two addresses: NumPy cannot see
    that an array over one mapping and a destination through the other alias, so the copy
    (on several threads, or one memcpy) read bytes it had already written (before: most of
    the destination came out wrong).  The values are the source's as they were, as on the
    gRPC path, which uploads them first."""
    n = 4 * (copies.PARALLEL_MIN_BYTES // 4)  # int32 elements: 4 x 8 MiB, a parallel copy
    before = np.arange(n, dtype=np.int32)
    with tensord.connect(server.address) as first, tensord.connect(server.address) as second:
        x = first.tensor(before)
        seen = np.from_dlpack(x)  # over the first client's mapping
        y = second.attach(x.share())  # the same Storage, through the second's
        k = abs(shift)
        dst, src = (y[k:], seen[:-k]) if shift > 0 else (y[:-k], seen[k:])
        dst.copy_(src)
        expected = before.copy()
        if shift > 0:
            expected[k:] = before[:-k]
        else:
            expected[:-k] = before[k:]
        np.testing.assert_array_equal(seen, expected)
        np.testing.assert_array_equal(y.numpy(), expected)
        del seen


def test_transfers_take_the_mapping_not_the_grpc_stream(client: Any, monkeypatch: Any) -> None:
    def no_grpc(*args: Any) -> None:
        raise AssertionError("the gRPC transfer path was used")

    monkeypatch.setattr(client._conn, "upload", no_grpc)
    monkeypatch.setattr(client._conn, "download_into", no_grpc)
    values = np.random.default_rng(0).standard_normal((512, 512)).astype(np.float32)
    x = client.tensor(values)
    np.testing.assert_array_equal(x.numpy(), values)
    np.testing.assert_array_equal(client.from_numpy(values * 2).numpy(), values * 2)
    np.testing.assert_array_equal(x.t().numpy(), values.T)  # a strided view, gathered
    oracle = torch.from_numpy(values.copy())
    fresh = np.full((512, 512), 7.0, dtype=np.float32)
    x.t().copy_(fresh)
    oracle.t().copy_(torch.from_numpy(fresh))
    row = np.arange(512, dtype=np.float32)[None, None, :]  # leading 1s, broadcast over rows
    assign_data(x, slice(100, 400), row)  # tensord.aio's x.setitem(key, array)
    oracle[100:400] = torch.from_numpy(row)
    np.testing.assert_array_equal(x.numpy(), oracle.numpy())
    assert x.numpy().flags.owndata  # numpy() copies (np.from_dlpack aliases)


def test_a_large_upload_reuses_the_blocks_dropped_before_it(fresh_server: Any) -> None:
    values = np.ones(transfers.RELEASE_BEFORE_UPLOAD_BYTES, dtype=np.uint8)
    with tensord.connect(fresh_server.address) as client:
        assert client._local.enabled
        for _ in range(3):  # each upload's tensor and export are dropped before the next
            x = client.tensor(values)
            del x
        client.synchronize()
        stats = client.memory_stats()
    # the releases and export releases of the tensor before went first: one block at a time
    assert stats["allocated_bytes.all.peak"] == values.nbytes


class _RecordedStub:
    """A stub method that records each call made for the recording thread, by it or by the
    SDK's worker that runs the main thread's calls (the client's flusher thread may send a
    Batch of its own at any time)."""

    def __init__(self, name: str, method: Any, calls: list[str], thread: int) -> None:
        self._name, self._method, self._calls, self._thread = name, method, calls, thread

    def _record(self) -> None:
        calling = threading.current_thread()
        if calling.ident == self._thread or calling.name == worker.WORKER_THREAD_NAME:
            self._calls.append(self._name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._record()
        return self._method(*args, **kwargs)

    def future(self, *args: Any, **kwargs: Any) -> Any:
        self._record()
        return self._method.future(*args, **kwargs)


def record_rpcs(client: Any, monkeypatch: Any) -> list[str]:
    """The unary RPCs this thread's client makes from now on, by name, through gRPC or the
    session's call channel."""
    calls: list[str] = []
    conn = client._conn
    stub = conn._stub
    names = ("Empty", "Export", "EmptyExport", "Release", "ReleaseExports", "Batch")
    for name in names:
        method = getattr(stub, name)
        monkeypatch.setattr(stub, name, _RecordedStub(name, method, calls, threading.get_ident()))
    on_channel = conn._on_channel
    recorder = _RecordedStub("", None, calls, threading.get_ident())

    def recorded(method: str, *args: Any) -> Any:
        recorder._name = method
        try:
            answered = on_channel(method, *args)
        except Exception:  # answered: with an error
            if method in names:
                recorder._record()
            raise
        if answered is not None and method in names:  # (None: not sent, gRPC takes it)
            recorder._record()
        return answered

    monkeypatch.setattr(conn, "_on_channel", recorded)
    return calls


def test_a_large_upload_is_one_call_carrying_the_releases_before_it(
    fresh_server: Any, monkeypatch: Any
) -> None:
    values = np.arange(transfers.RELEASE_BEFORE_UPLOAD_BYTES // 4, dtype=np.float32)
    with tensord.connect(fresh_server.address) as client:
        x = client.tensor(values)
        y = x[1:]  # pipelined: a queued view, applied before the releases are taken
        assert y.handle  # used: it must be sent (a view dropped unused is never sent)
        del x, y
        calls = record_rpcs(client, monkeypatch)
        z = client.tensor(values * 2)
        # Empty, Export and the releases in one round trip, after the queued view's Batch
        # (unless the client's flusher thread sent that one first)
        assert calls in (["Batch", "EmptyExport"], ["EmptyExport"])
        calls.clear()
        del z
        w = client.tensor(values)
        assert calls == ["EmptyExport"]
        session = fresh_server.daemon.sessions.peek(client.session_id)
        assert fresh_server.daemon.sessions.handle_count(session) == 1  # only w's
        np.testing.assert_array_equal(w.numpy(), values)
        stats = client.memory_stats()
    assert stats["allocated_bytes.all.peak"] == values.nbytes  # one block, reused


def test_a_small_upload_carries_no_releases(fresh_server: Any, monkeypatch: Any) -> None:
    values = np.ones(transfers.MIN_FAST_BYTES, dtype=np.uint8)
    assert values.nbytes < transfers.RELEASE_BEFORE_UPLOAD_BYTES
    with tensord.connect(fresh_server.address) as client:
        x = client.tensor(values)
        del x
        requests: list[Any] = []
        empty_export = client._conn._unary

        def recorded(method: str, request: Any, **kwargs: Any) -> Any:
            requests.append(request)
            return empty_export(method, request, **kwargs)

        monkeypatch.setattr(client._conn, "_unary", recorded)
        y = client.tensor(values)
        [request] = [r for r in requests if isinstance(r, pb.EmptyExportRequest)]
        assert not request.release_handles and not request.release_exports.export_ids
        np.testing.assert_array_equal(y.numpy(), values)


def test_empty_export_checks_the_handle_limit_and_releases_a_refused_handle(
    make_server: Any,
) -> None:
    running = make_server(max_handles_per_session=8)
    sessions = running.daemon.sessions
    with tensord.connect(running.address) as client:
        kept = [client.zeros(4) for _ in range(7)]
        client.synchronize()
        session = sessions.peek(client.session_id)
        assert sessions.handle_count(session) == 7
        request = pb.EmptyRequest(shape=[1000], dtype="float32", device="cpu")
        # the new handle is the 8th; its export would be the 9th: refused
        with pytest.raises(tensord.errors.ResourceExhaustedError, match=r"\(8 in all\)"):
            client._conn.empty_export(request, False)
        assert sessions.handle_count(session) == 7  # the new handle went with the refusal
        assert running.daemon.exports.count(session.id) == 0
        del kept


def test_empty_export_charges_the_quota_after_the_releases_it_carries(make_server: Any) -> None:
    running = make_server(quotas=[QuotaSpec("*", "cpu", 24 * MiB)])
    values = np.ones(transfers.RELEASE_BEFORE_UPLOAD_BYTES, dtype=np.uint8)
    with tensord.connect(running.address) as client:
        x = client.tensor(values)
        with pytest.raises(tensord.errors.ResourceExhaustedError, match="quota exceeded"):
            client.tensor(values)  # both would be over the quota
        del x
        y = client.tensor(values)  # x's release rides first: room again
        np.testing.assert_array_equal(y.numpy(), values)
        assert client.memory_stats()["allocated_bytes.all.current"] == values.nbytes


def test_empty_export_releases_only_the_callers_handles_and_exports(server: Any) -> None:
    with tensord.connect(server.address) as owner:
        x = owner.tensor(np.ones(1 << 18, dtype=np.float32))
        owner.flush()  # the upload's own export ended
        alias = np.from_dlpack(x)
        owner_session = server.daemon.sessions.peek(owner.session_id)
        exports = server.daemon.exports._exports
        [export_id] = [k for k, e in exports.items() if e.session_id == owner_session.id]
        handles = server.daemon.sessions.handle_count(owner_session)
        stranger = SessionStub(open_channel(server.address))
        stranger.EmptyExport(
            pb.EmptyExportRequest(
                empty=pb.EmptyRequest(shape=[4], dtype="float32", device="cpu"),
                release_handles=[x.handle],
                release_exports=pb.ReleaseExportsRequest(export_ids=[export_id]),
            ),
            metadata=stranger.md,
        )
        assert server.daemon.sessions.handle_count(owner_session) == handles
        assert export_id in server.daemon.exports._exports
        alias[:] = 5
        np.testing.assert_array_equal(x.numpy(), np.full(1 << 18, 5, dtype=np.float32))
        stranger.channel.close()
        del alias


def test_an_upload_falls_back_to_grpc_when_the_server_cannot_export(
    fresh_server: Any, monkeypatch: Any
) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise FailedPreconditionError("the memory of cpu cannot be mapped by clients")

    monkeypatch.setattr(fresh_server.daemon.exports, "export", refuse)
    values = np.arange(1 << 18, dtype=np.float32)
    with tensord.connect(fresh_server.address) as client:
        calls = record_rpcs(client, monkeypatch)
        upload = client._conn.upload
        uploads: list[int] = []

        def counted_upload(*args: Any) -> Any:
            uploads.append(1)
            return upload(*args)

        monkeypatch.setattr(client._conn, "upload", counted_upload)
        x = client.tensor(values)
        assert calls == ["EmptyExport"] and len(uploads) == 1
        assert "cannot be mapped" in client._local.last_refusal
        np.testing.assert_array_equal(x.numpy(), values)
        session = fresh_server.daemon.sessions.peek(client.session_id)
        assert fresh_server.daemon.sessions.handle_count(session) == 1  # the refused one went


def test_an_upload_to_a_server_without_empty_export_takes_empty_then_export(
    make_server: Any, monkeypatch: Any
) -> None:
    from tensord_server.rpc.handlers import TensordService

    def unknown(self: Any, request: Any, context: Any) -> Any:
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")

    monkeypatch.setattr(TensordService, "EmptyExport", unknown)  # a server before it
    running = make_server()
    values = np.arange(transfers.RELEASE_BEFORE_UPLOAD_BYTES // 4, dtype=np.float32)
    with tensord.connect(running.address) as client:
        calls = record_rpcs(client, monkeypatch)
        monkeypatch.setattr(client._conn, "upload", None)  # never the gRPC stream
        gc.disable()  # a tensor kept alive by a garbage cycle would stay so: deterministic
        try:
            x = client.tensor(values)
            del x
            y = client.tensor(values * 3)
        finally:
            gc.enable()
        assert calls.count("EmptyExport") == 1  # asked once, then Empty + Export
        assert calls.count("Empty") == 2
        assert calls.count("Export") == 2
        assert client._local.enabled
        np.testing.assert_array_equal(y.numpy(), values * 3)
        stats = client.memory_stats()
    assert stats["allocated_bytes.all.peak"] == values.nbytes  # the releases went first


@pytest.mark.parametrize("code", [grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAVAILABLE])
def test_releases_carried_by_an_empty_export_the_server_never_ran_are_sent_again(
    make_server: Any, monkeypatch: Any, code: grpc.StatusCode
) -> None:
    from tensord_server.rpc.handlers import TensordService

    def refused(self: Any, request: Any, context: Any) -> Any:
        context.abort(code, "not run")  # as a server before EmptyExport, or one going away

    monkeypatch.setattr(TensordService, "EmptyExport", refused)
    running = make_server()
    values = np.arange(transfers.RELEASE_BEFORE_UPLOAD_BYTES // 4, dtype=np.float32)
    with tensord.connect(running.address) as client:
        monkeypatch.setattr(client._conn, "upload", None)  # never the gRPC stream
        gc.disable()  # a tensor kept alive by a garbage cycle would stay so: deterministic
        try:
            dropped = client.zeros(values.shape)
            dropped_handle = dropped.handle
            del dropped  # its release is queued: the upload's EmptyExport carries it
            with contextlib.suppress(tensord.errors.TensordError):  # UNAVAILABLE: raised
                client.tensor(values)
        finally:
            gc.enable()
        client._conn.flush_releases()
        session = running.daemon.sessions.peek(client.session_id)
        assert dropped_handle not in session.handles  # released, not lost with the call


@pytest.mark.slow
@pytest.mark.parametrize("slice_bytes", [1, 4096, 100_000, 1 << 40])
def test_numpy_copies_out_of_the_mapping_in_slices_for_any_view(
    client: Any, monkeypatch: Any, slice_bytes: int
) -> None:
    calls: list[int] = []
    copy_in_slices = copies.copy_in_slices

    def counted(out: np.ndarray, src: np.ndarray, size: int) -> None:
        calls.append(size)
        copy_in_slices(out, src, size)

    monkeypatch.setattr(transfers, "READ_SLICE_BYTES", slice_bytes)
    monkeypatch.setattr(copies, "copy_in_slices", counted)
    values = np.random.default_rng(1).standard_normal((300, 7, 50)).astype(np.float32)
    x = client.tensor(values)
    oracle = torch.from_numpy(values.copy())
    views = [
        (x, oracle),
        (x.transpose(0, 2), oracle.transpose(0, 2)),
        # these two are under MIN_FAST_BYTES: the mapping too, a segment being mapped
        (x[5:290:3], oracle[5:290:3]),
        (x.view(-1), oracle.view(-1)),
        (x.permute(1, 2, 0)[2], oracle.permute(1, 2, 0)[2]),
    ]
    for view, expected in views:
        np.testing.assert_array_equal(view.numpy(), expected.numpy())
    small = [v for v, _ in views if v.nbytes < transfers.MIN_FAST_BYTES]
    assert len(small) == 2 and calls == [slice_bytes] * len(views)


@pytest.mark.parametrize("shape", [(), (1,), (5,), (3, 1000), (1000, 3), (2, 3, 4)])
@pytest.mark.parametrize("slice_bytes", [1, 7, 64, 1 << 30])
def test_copy_in_slices_equals_one_copyto(shape: tuple[int, ...], slice_bytes: int) -> None:
    src = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    src = src.T  # a strided source
    out = np.zeros(src.shape, dtype=np.int64)
    copies.copy_in_slices(out, src, slice_bytes)
    np.testing.assert_array_equal(out, src)


def counting_submits(monkeypatch: Any) -> list[int]:
    """The bytes of each part a same-host copy hands to the copy pool, from now on."""
    submitted: list[int] = []
    queue_part = copies.queue_part

    def counted(part: copies.CopyPart) -> bool:
        submitted.append(part.dst.nbytes)
        return queue_part(part)

    monkeypatch.setattr(copies, "queue_part", counted)
    return submitted


@pytest.mark.parametrize(
    "shape", [(), (1,), (5,), (1, 1000), (1000, 1), (2, 3, 4), (3, 1, 7), (1, 1, 1), (0, 9)]
)
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 64])
def test_split_along_cuts_any_shape_into_disjoint_pieces_of_whole_rows(
    shape: tuple[int, ...], parts: int
) -> None:
    keys = copies.split_along(shape, parts)
    seen = np.zeros(shape, dtype=np.int64)
    for key in keys:
        seen[key] += 1
    assert (seen == 1).all()  # every element in exactly one piece
    longest = max(shape, default=1)
    assert len(keys) == (min(parts, longest) if longest > 1 and parts > 1 else 1)


@pytest.mark.parametrize("workers", [2, 3, 4])
@pytest.mark.parametrize("slice_bytes", [None, 1000])
def test_parallel_copyto_equals_one_copyto_for_any_layout(
    monkeypatch: Any, workers: int, slice_bytes: int | None
) -> None:
    monkeypatch.setattr(copies, "COPY_WORKERS", workers)
    monkeypatch.setattr(copies, "PARALLEL_MIN_BYTES", 1)
    submitted = counting_submits(monkeypatch)
    base = np.random.default_rng(2).standard_normal((40, 30, 6)).astype(np.float32)
    sources = [
        base,
        base.transpose(2, 0, 1),
        base[3:37:2, ::-1, 1:5],  # narrowed, reversed
        np.broadcast_to(base[:1], (40, 30, 6)),  # expanded: stride 0
        base.reshape(1, -1),  # (1, N): splits along its long axis
        base.reshape(-1),
        base[:, :1],  # (40, 1, 6)
    ]
    for src in sources:
        for dst in (np.zeros(src.shape, np.float32), np.zeros(src.shape[::-1], np.float32).T):
            before = len(submitted)
            copies.parallel_copyto(dst, src, slice_bytes)  # dst: fresh, or transposed
            np.testing.assert_array_equal(dst, src)
            assert len(submitted) - before == workers - 1  # the caller copies one part
    row = np.arange(6, dtype=np.float32)
    dst = np.zeros((40, 30, 6), np.float32)
    copies.parallel_copyto(dst, row)  # broadcast as np.copyto broadcasts
    np.testing.assert_array_equal(dst, np.broadcast_to(row, dst.shape))


def test_parallel_copyto_of_overlapping_arrays_copies_on_one_thread(monkeypatch: Any) -> None:
    monkeypatch.setattr(copies, "COPY_WORKERS", 3)
    monkeypatch.setattr(copies, "PARALLEL_MIN_BYTES", 1)
    submitted = counting_submits(monkeypatch)
    square = np.arange(300 * 300, dtype=np.int64).reshape(300, 300)
    expected = square.T.copy()
    copies.parallel_copyto(square, square.T)  # np.copyto buffers an overlapping source
    np.testing.assert_array_equal(square, expected)
    assert submitted == []


def test_a_failing_part_raises_after_every_part_is_done(monkeypatch: Any) -> None:
    monkeypatch.setattr(copies, "COPY_WORKERS", 3)
    monkeypatch.setattr(copies, "PARALLEL_MIN_BYTES", 1)
    copy_part = copies._copy_part
    finished: list[int] = []
    failed = threading.Lock()

    def failing_in_the_pool(dst: np.ndarray, src: np.ndarray, slice_bytes: int | None) -> None:
        if copies._copy_pool.in_worker() and failed.acquire(blocking=False):
            finished.append(0)  # the first part the pool runs fails
            raise MemoryError("a part failed")
        copy_part(dst, src, slice_bytes)
        finished.append(dst.size)

    monkeypatch.setattr(copies, "_copy_part", failing_in_the_pool)
    dst = np.zeros((90, 100), np.float32)
    with pytest.raises(MemoryError, match="a part failed"):
        copies.parallel_copyto(dst, np.ones((90, 100), np.float32))
    assert sorted(finished) == [0, 3000, 3000]  # the other two parts were waited for


def test_an_interrupt_while_parts_run_raises_only_once_every_part_is_done(
    monkeypatch: Any,
) -> None:
    """Ctrl-C while the caller waits for the pool's parts: the interrupt is raised after they
    end (raised at once, the caller ended the export while a pool thread still wrote: the
    server could move or reuse those bytes, and the late write land in another tensor)."""
    monkeypatch.setattr(copies, "COPY_WORKERS", 2)
    monkeypatch.setattr(copies, "PARALLEL_MIN_BYTES", 1)
    copy_part = copies._copy_part
    caller_done, pool_started, pool_may_go, pool_done = (threading.Event() for _ in range(4))

    def slow_in_the_pool(dst: np.ndarray, src: np.ndarray, slice_bytes: int | None) -> None:
        if copies._copy_pool.in_worker():
            pool_started.set()
            pool_may_go.wait(10)
            copy_part(dst, src, slice_bytes)
            pool_done.set()
        else:
            copy_part(dst, src, slice_bytes)
            caller_done.set()

    def interrupt_the_waiting_caller() -> None:
        if caller_done.wait(10) and pool_started.wait(10):
            time.sleep(0.2)  # the caller is in its wait for the pool's part
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
            time.sleep(0.3)
        pool_may_go.set()

    monkeypatch.setattr(copies, "_copy_part", slow_in_the_pool)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    helper = threading.Thread(target=interrupt_the_waiting_caller, daemon=True)
    try:
        helper.start()
        with pytest.raises(KeyboardInterrupt):
            copies.parallel_copyto(np.zeros((2, 1000), np.float32), np.ones((2, 1000), np.float32))
        assert pool_done.is_set()  # not raised while the pool's part still wrote
    finally:
        pool_may_go.set()
        helper.join(10)
        signal.signal(signal.SIGINT, previous)


class _QueuedThenRaises:
    """A copy pool whose submit queues the part and then raises ``error``: a thread that
    failed to start (ThreadPoolExecutor queues the work item first), or an interrupt arriving
    just as submit returns.  Its one thread is busy until ``release`` is set."""

    def __init__(self, error: BaseException) -> None:
        self.error = error
        self.release = threading.Event()
        self.pool = concurrent.futures.ThreadPoolExecutor(1)
        self.pool.submit(self.release.wait, 10)  # the queued part waits behind it

    def submit(self, fn: Any, *args: Any) -> Any:
        self.pool.submit(fn, *args)
        raise self.error

    def drain(self) -> None:
        self.release.set()
        self.pool.shutdown(wait=True)


@pytest.mark.slow
@pytest.mark.parametrize(
    "error",
    [RuntimeError("can't start new thread"), KeyboardInterrupt()],
    ids=["thread start failed", "interrupt"],
)
def test_a_part_queued_by_a_submit_that_raised_never_writes_after_the_copy_returns(
    monkeypatch: Any, error: BaseException
) -> None:
    """Once parallel_copyto returned (or raised), the caller ends the export and the server
    may hand those bytes to another tensor: a part queued on the pool must not write then."""
    monkeypatch.setattr(copies, "COPY_WORKERS", 2)
    monkeypatch.setattr(copies, "PARALLEL_MIN_BYTES", 1)
    pool = _QueuedThenRaises(error)
    monkeypatch.setattr(copies._copy_pool, "executor", lambda: pool)
    dst = np.zeros((2, 1000), np.float32)
    try:
        with contextlib.suppress(KeyboardInterrupt):
            copies.parallel_copyto(dst, np.ones((2, 1000), np.float32))
        dst[...] = 7  # the memory is another tensor's now
    finally:
        pool.drain()  # the queued part runs now, if it still may
    assert (dst == 7).all()


def test_many_threads_copying_at_once_all_finish(monkeypatch: Any) -> None:
    monkeypatch.setattr(copies, "COPY_WORKERS", 4)
    monkeypatch.setattr(copies, "PARALLEL_MIN_BYTES", 1)
    src = np.random.default_rng(3).integers(0, 1 << 30, (64, 512), dtype=np.int64)
    results: list[bool] = []

    def copy_many() -> None:
        for _ in range(20):
            out = np.zeros_like(src)
            copies.parallel_copyto(out, src.T.T, 4096)
            results.append(bool((out == src).all()))

    threads = [threading.Thread(target=copy_many, daemon=True) for _ in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert results == [True] * 240


def test_same_host_transfers_split_large_copies_for_any_layout(
    client: Any, monkeypatch: Any
) -> None:
    # every same-host path, with copies from 256 KiB up on 3 threads: torch is the oracle
    monkeypatch.setattr(copies, "COPY_WORKERS", 3)
    monkeypatch.setattr(copies, "PARALLEL_MIN_BYTES", transfers.MIN_FAST_BYTES)
    submitted = counting_submits(monkeypatch)
    values = np.random.default_rng(4).standard_normal((512, 384)).astype(np.float32)
    x = client.tensor(values)
    assert submitted == [values.nbytes // 3] * 2 and client._local.enabled
    oracle = torch.from_numpy(values.copy())
    for view, expected in [
        (x, oracle),
        (x.t(), oracle.t()),
        (x[:, 10:300], oracle[:, 10:300]),  # narrowed
        (x[7:8].expand(700, 384), oracle[7:8].expand(700, 384)),  # stride 0
        (x.view(1, -1), oracle.view(1, -1)),  # (1, N)
        (x.view(-1)[1:], oracle.view(-1)[1:]),
    ]:
        before = len(submitted)
        np.testing.assert_array_equal(view.numpy(), expected.numpy())
        assert len(submitted) - before == 2
    fresh = np.random.default_rng(5).standard_normal((384, 512)).astype(np.float32)
    x.t().copy_(fresh)  # a transposed destination
    oracle.t().copy_(torch.from_numpy(fresh))
    x[:, 200:].copy_(fresh.T[::-1, 200:])  # a narrowed destination, a reversed source
    oracle[:, 200:].copy_(torch.from_numpy(fresh.T[::-1, 200:].copy()))
    row = np.arange(384, dtype=np.float32)
    x[100:500].copy_(np.broadcast_to(row, (400, 384)))  # an expanded source
    oracle[100:500].copy_(torch.from_numpy(row).expand(400, 384))
    assign_data(x, slice(3, 450), row[None, None, :])  # x[3:450] = array, leading 1s
    oracle[3:450] = torch.from_numpy(row)
    np.testing.assert_array_equal(x.numpy(), oracle.numpy())
    line = np.random.default_rng(6).standard_normal((1, 300_000)).astype(np.float32)
    for array in (line, line.reshape(-1)):  # (1, N) and 1-D uploads split too
        before = len(submitted)
        np.testing.assert_array_equal(client.from_numpy(array).numpy(), array)
        assert len(submitted) - before == 4  # 2 for the upload, 2 for the download


def test_only_large_same_host_copies_use_the_copy_pool(client: Any, monkeypatch: Any) -> None:
    monkeypatch.setattr(copies, "COPY_WORKERS", 2)
    submitted = counting_submits(monkeypatch)
    small = np.ones(copies.PARALLEL_MIN_BYTES // 2, dtype=np.uint8)
    assert client.tensor(small).numpy().sum() == small.size  # fast path, one thread
    assert submitted == [] and client._local.enabled
    large = np.arange(copies.PARALLEL_MIN_BYTES, dtype=np.uint8)
    np.testing.assert_array_equal(client.tensor(large).numpy(), large)
    assert submitted == [large.nbytes // 2] * 2  # upload, download: one part each on the pool


def test_ended_exports_unmap_segments_the_server_released(fresh_server: Any) -> None:
    with tensord.connect(fresh_server.address) as client:
        x = client.tensor(np.ones(4 * MiB, dtype=np.uint8))
        x.numpy()
        client.flush()
        assert client._local.mapped_count() == 1  # cached while the segment lives
        del x
        client.flush()
        assert client.empty_cache() >= 4 * MiB
        torch.from_dlpack(client.zeros(1))  # an export ending: its batch asks about the rest
        client.flush()
        assert client._local.mapped_count() == 1  # only the new small segment's


@pytest.mark.slow
def test_compaction_skips_exported_storages_and_moves_them_once_released(make_server: Any) -> None:
    running = make_server(devices=(POOL,))
    daemon = running.daemon
    pool = daemon.devices.get("cpu").pool
    with open_channel(running.address) as channel:
        stub = SessionStub(channel)
        kept = fragment(stub)
        session = daemon.sessions.peek(stub.session_id)
        segments = segments_of(daemon, stub, kept)
        exports = [daemon.exports.export(session, kept[s[0]][0].handle)[0] for s in segments]
        ptrs = {i: storage_of(daemon, stub, m).block.address for i, (m, _) in kept.items()}
        big_values = random_tensor(99, BIG_ELEMENTS)
        with pytest.raises(grpc.RpcError) as info:
            stub.upload(big_values)
        assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert {i: storage_of(daemon, stub, m).block.address for i, (m, _) in kept.items()} == ptrs
        assert daemon.memory_reports.memory_stats("cpu")["exports.storages.current"] == 3
        assert daemon.exports.release(session, [e.id for e in exports]) == 3
        big = stub.upload(big_values)  # released: compaction moves them now
        assert pool.memory_stats()["num_compactions"] == 1
        moved = {
            i for i, (m, _) in kept.items() if storage_of(daemon, stub, m).block.address != ptrs[i]
        }
        assert moved == set(segments[0])
        for meta, values in kept.values():
            np.testing.assert_array_equal(stub.download(meta), values)
        np.testing.assert_array_equal(stub.download(big), big_values)
        stub.close()


@pytest.mark.slow
def test_a_killed_consumers_pins_are_dropped_after_the_grace(make_server: Any) -> None:
    running = make_server(lease=0.5, session_grace=0.2)
    with tensord.connect(running.address) as client:
        x = client.tensor(np.ones(1000, dtype=np.float32))
        client.put("zc-victim", x)
        storage = storage_of_handle(running.daemon, client, x)
        child = run_child(
            running.address,
            """
            import os, signal
            alias = np.from_dlpack(client.get("zc-victim"))
            print("exported", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
            """,
        )
        _, err = child.communicate(timeout=60)
        assert child.returncode == -signal.SIGKILL, err
        assert wait_until(lambda: storage.holds == 0, timeout=10)
        assert exported_storages(running.daemon) == 0
        client.delete("zc-victim")


def test_a_tenant_can_never_map_another_tenants_bytes(make_server: Any) -> None:
    running = make_server(auth_tokens={"token-a": "alice", "token-b": "bob"})
    daemon = running.daemon
    secret = np.full(64 * 1024, 0x5EC12E7, dtype=np.int32)  # 256 KiB: a small-pool block
    with (
        tensord.connect(running.address, token="token-a") as alice,
        tensord.connect(running.address, token="token-b") as bob,
    ):
        a = alice.tensor(secret)
        b = bob.tensor(np.zeros_like(secret))
        seg_a = storage_of_handle(daemon, alice, a).block.segment
        seg_b = storage_of_handle(daemon, bob, b).block.segment
        assert seg_a is not seg_b and seg_a.stream != seg_b.stream
        del a
        alice.flush()
        later = bob.tensor(np.zeros_like(secret))  # alice's freed block is never bob's
        assert storage_of_handle(daemon, bob, later).block.segment is not seg_a
        # everything bob can map holds no byte of alice's
        for tensor in (b, later):
            export = bob._local.export(tensor.handle)
            assert export is not None
            assert not np.any(export._segment.base.view(np.int32) == 0x5EC12E7)
        # tickets: made-up or used twice, the fd socket refuses
        session = daemon.sessions.peek(bob.session_id)
        _, ticket, _ = daemon.exports.export(session, b.handle)
        path = running.fd_socket.path
        os.close(channel.receive_segment_fd(path, ticket, 0))
        with pytest.raises(OSError, match="unknown or expired ticket"):
            channel.receive_segment_fd(path, ticket, 0)
        with pytest.raises(OSError, match="unknown or expired ticket"):
            channel.receive_segment_fd(path, "made-up-ticket-of-32-characters", 0)


def test_without_auth_only_the_servers_user_reaches_the_fd_socket(client: Any) -> None:
    path = client._conn.call("Export", pb.ExportRequest(handle=client.zeros(1).handle)).fd_socket
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert os.stat(os.path.dirname(path)).st_mode & 0o777 == 0o700


@pytest.mark.parametrize("how", ["argument", "environment", "unreachable socket"])
def test_a_remote_looking_client_falls_back_to_grpc(
    server: Any, monkeypatch: Any, how: str
) -> None:
    if how == "environment":
        monkeypatch.setenv("TENSORD_LOCAL", "0")
    if how == "unreachable socket":

        def another_host(path: str, ticket: str, nbytes: int) -> int:
            raise FileNotFoundError(2, "No such file or directory", path)

        monkeypatch.setattr(channel, "receive_segment_fd", another_host)
    with tensord.connect(server.address, local=False if how == "argument" else None) as client:
        values = np.arange(MiB, dtype=np.float32)
        x = client.tensor(values)
        np.testing.assert_array_equal(x.numpy(), values)
        x[:10].copy_(np.ones(10, dtype=np.float32) * 5)
        assert x[9].item() == 5.0
        with pytest.raises(BufferError, match="zero-copy DLPack export is impossible"):
            x.__dlpack__()
        with pytest.raises(BufferError):
            torch.from_dlpack(x)
        np.testing.assert_array_equal(np.from_dlpack(x, copy=True), x.numpy())
        with pytest.raises(ValueError, match=r"Unable to avoid copy.*no zero-copy"):
            np.asarray(x, copy=False)
        np.testing.assert_array_equal(np.asarray(x), x.numpy())
        client.flush()
        session = server.daemon.sessions.peek(client.session_id)
        assert server.daemon.exports.count(session.id) == 0  # the failed export was released


def test_a_silent_fd_socket_connection_does_not_delay_another_clients_mapping(
    fresh_server: Any,
) -> None:
    import socket
    import time

    with tensord.connect(fresh_server.address) as first:
        first.tensor(np.ones(MIN_FAST, np.uint8))  # the fd socket exists now
        path = fresh_server.fd_socket.path
        silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        silent.connect(path)  # connects and sends nothing
        try:
            time.sleep(0.1)  # the server accepted it and waits for its ticket line
            with tensord.connect(fresh_server.address) as second:
                started = time.monotonic()
                x = second.tensor(np.arange(MIN_FAST, dtype=np.uint8))
                elapsed = time.monotonic() - started
                assert second._local.enabled, second._local.reason  # it mapped, no fallback
                assert second._local.mapped_count() == 1
                assert elapsed < 1.0, elapsed
                np.testing.assert_array_equal(x.numpy(), np.arange(MIN_FAST, dtype=np.uint8))
        finally:
            silent.close()


MIN_FAST = transfers.MIN_FAST_BYTES


def _squatter(path: str, answer: bytes, fd: int) -> threading.Thread:
    """A stranger listening on a socket path a client was sent: answers one request."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    listener.settimeout(10)

    def serve() -> None:
        with listener:
            conn, _ = listener.accept()
            with conn:
                conn.recv(256)
                socket.send_fds(conn, [answer], [fd])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def test_a_socket_that_cannot_prove_the_ticket_gives_no_descriptor(tmp_path: Any) -> None:
    # someone else's socket at the path (a remote server's path squatted on this host): it
    # answers "ok" with a descriptor of its own memory, but cannot answer the ticket's proof
    fd = os.memfd_create("squatter")
    os.ftruncate(fd, 4096)
    path = str(tmp_path / "fd.sock")
    thread = _squatter(path, b"ok\n", fd)
    with pytest.raises(OSError, match="did not prove the ticket"):
        channel.receive_segment_fd(path, "k" * 16 + "p" * 16, 4096)
    thread.join(10)
    os.close(fd)


def test_a_descriptor_shorter_than_its_segment_is_refused(tmp_path: Any) -> None:
    # mapping past a file's end faults (SIGBUS) on access: the size is checked first
    fd = os.memfd_create("short")
    os.ftruncate(fd, 4096)
    path = str(tmp_path / "fd.sock")
    thread = _squatter(path, b"ok " + b"p" * 16 + b"\n", fd)
    with pytest.raises(OSError, match="holds 4096 bytes, not the 1048576 announced"):
        channel.receive_segment_fd(path, "k" * 16 + "p" * 16, 1 << 20)
    thread.join(10)
    os.close(fd)


def test_an_export_reaching_past_its_segment_falls_back_to_grpc(
    client: Any, monkeypatch: Any
) -> None:
    x = client.tensor(np.arange(1 << 17, dtype=np.float32))
    real_export = client._local._call_export

    def lying(request: Any) -> Any:  # through gRPC or the call channel
        response = real_export(request)
        if response is not None:
            response.storage_byte_offset = response.segment_nbytes  # past the segment
        return response

    monkeypatch.setattr(client._local, "_call_export", lying)
    np.testing.assert_array_equal(x.numpy(), np.arange(1 << 17, dtype=np.float32))
    assert not client._local.enabled and "of a" in client._local.reason
    with pytest.raises(BufferError):
        x.__dlpack__()


@pytest.mark.slow
@pytest.mark.parametrize("answered_first", [False, True], ids=["mid-call", "just-answered"])
@pytest.mark.parametrize("call", ["dlpack", "upload"])
def test_an_export_whose_caller_was_interrupted_is_released(
    server: Any, client: Any, monkeypatch: Any, answered_first: bool, call: str
) -> None:
    """Ctrl-C while an Export (or an upload's EmptyExport) is in flight: the caller walks
    away (KeyboardInterrupt) and the call runs on to its end on the SDK's worker; the export
    (and the new tensor) it made, which nobody will ever see, are released (before: pinned,
    and counted against the handle limit, until the session ended)."""
    x = client.tensor(np.ones(1000, dtype=np.float32))
    session = server.daemon.sessions.peek(client.session_id)
    handles = len(session.handles)
    table = server.daemon.exports
    big = np.ones(1 << 20, dtype=np.float32)  # an upload large enough to take the mapping
    # the interrupt lands while the answer is on its way
    slow_export, answered = slowed_exports(table, 0.0 if answered_first else 0.3)
    monkeypatch.setattr(table, "export", slow_export)
    if answered_first:  # the interrupt comes once the worker holds the answer
        monkeypatch.setattr(worker.Job, "outcome", _interrupt_first(worker.Job.outcome))
    with interrupted_after(None if answered_first else 0.05):
        torch.from_dlpack(x) if call == "dlpack" else client.tensor(big)
    monkeypatch.undo()
    assert answered.wait(5)
    session_id = client.session_id
    assert wait_until(lambda: client.flush() or table.count(session_id) == 0, timeout=5)
    assert len(session.handles) == handles  # an upload's new tensor released too
    assert int(torch.from_dlpack(x)[999]) == 1  # the client still exports


def _interrupt_first(outcome: Any) -> Any:
    """_Job.outcome raising KeyboardInterrupt once, as a signal landing just before it."""
    fired: list[bool] = []

    def interrupted(job: Any) -> Any:
        if not fired and job.result is not None:
            fired.append(True)
            raise KeyboardInterrupt
        return outcome(job)

    return interrupted


def _aliased(client: Any, n: int) -> tuple[Any, torch.Tensor, np.ndarray, int]:
    """A tensor of 0..n-1, a torch and a NumPy alias of it, and its Storage's address."""
    x = client.tensor(np.arange(n, dtype=np.float32))
    return x, torch.from_dlpack(x), np.asarray(x, copy=False), x.untyped_storage().data_ptr()


def _writes_through_old_aliases_miss(
    server: Any, alias: torch.Tensor, array: np.ndarray, address: int
) -> None:
    """A second session gets the freed Storage's memory; writes through the first session's
    old aliases stay theirs: the aliases keep their last bytes, the new tensor its zeros."""
    n = alias.numel()
    with tensord.connect(server.address) as other:
        y = other.zeros(n)
        assert y.untyped_storage().data_ptr() == address  # the same pool memory, reused
        assert torch.equal(alias, torch.arange(n, dtype=torch.float32))
        alias.fill_(7.0)
        array[1] = 9.0
        assert not y.numpy().any() and y[:3].tolist() == [0.0, 0.0, 0.0]
        assert alias[1].item() == 9.0 and array[0] == 7.0  # each alias still works


def test_aliases_taken_before_close_never_reach_the_pool_after_it(fresh_server: Any) -> None:
    client = tensord.connect(fresh_server.address)
    _x, alias, array, address = _aliased(client, 1 << 20)
    client.close()
    _writes_through_old_aliases_miss(fresh_server, alias, array, address)


def test_aliases_of_a_lost_session_never_reach_the_pool_once_the_loss_is_seen(
    fresh_server: Any,
) -> None:
    with tensord.connect(fresh_server.address) as client:
        x, alias, array, address = _aliased(client, 1 << 20)
        fresh_server.daemon.sessions.close(fresh_server.daemon.sessions.peek(client.session_id))
        with pytest.raises(tensord.errors.SessionLostError):
            x.clone()
        _writes_through_old_aliases_miss(fresh_server, alias, array, address)
        assert torch.equal(torch.from_dlpack(client.ones(8)), torch.ones(8))  # maps afresh


def test_remap_private_keeps_the_bytes_or_zeroes_them_and_leaves_the_shared_memory() -> None:
    size = 4 * mmap.PAGESIZE
    for keep in (True, False):
        fd = os.memfd_create("remap-private")
        try:
            os.ftruncate(fd, size)
            mapped, witness = (mmap.mmap(fd, size, flags=mmap.MAP_SHARED) for _ in range(2))
        finally:
            os.close(fd)
        base, seen = np.frombuffer(mapped, dtype=np.uint8), np.frombuffer(witness, dtype=np.uint8)
        base[:] = 5
        segments.remap_private(int(base.ctypes.data), size, keep=keep)
        assert (base == (5 if keep else 0)).all()
        base[:] = 6
        seen[:] = 8
        assert (seen == 8).all() and (base == 6).all()  # two memories now, not one
        del base, seen
        mapped.close()
        witness.close()
