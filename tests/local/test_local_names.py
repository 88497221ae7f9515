"""Names on the server's host: a get that brings its export (one call to a mapped array), a
put of arrays, torch tensors and lists staged through the mapping in one call, transfers of
any size through the mapping once a segment is mapped, and deletes queued with the
pipelined ops (torch is the oracle)."""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import numpy as np
import pytest
import tensord
import torch
from conftest import interrupted_after, wait_until
from tensord import schema as pb
from tensord.errors import InvalidArgumentError, NotFoundError, ResourceExhaustedError
from tensord.local import transfers
from tensord.local.mapper import MAX_PREFETCHED, PREFETCH_HOLD_S
from tensord.protocol import MAX_STAGED_ITEMS

MiB = 1 << 20


def record_calls(client: Any, monkeypatch: Any) -> list[str]:
    """Every unary method the client calls from now on (through gRPC or its call channel;
    a Batch is sent apart), and the streams, as "Upload" and "Download"."""
    made: list[str] = []
    unary_now = client._conn._unary_now
    upload = client._conn.upload
    download_into = client._conn.download_into

    def unary(method: str, *args: Any) -> Any:
        if threading.current_thread().name != "tensord-release":  # not the flusher's releases
            made.append(method)
        return unary_now(method, *args)

    def uploading(*args: Any) -> Any:
        made.append("Upload")
        return upload(*args)

    def downloading(*args: Any) -> Any:
        made.append("Download")
        return download_into(*args)

    monkeypatch.setattr(client._conn, "_unary_now", unary)
    monkeypatch.setattr(client._conn, "upload", uploading)
    monkeypatch.setattr(client._conn, "download_into", downloading)
    return made


def held_exports(server: Any) -> int:
    return int(server.daemon.exports.stats("cpu")[0])


# -- get -----------------------------------------------------------------------------------


def test_a_same_host_get_and_from_dlpack_are_one_call(client: Any, monkeypatch: Any) -> None:
    values = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)
    client.put("mapped-get", values)
    calls = record_calls(client, monkeypatch)
    x = client.get("mapped-get")
    alias = np.from_dlpack(x)
    first = float(alias[0, 0])
    assert calls == ["GetNameExport"]
    assert first == float(values[0, 0])
    np.testing.assert_array_equal(alias, values)
    assert torch.equal(torch.from_dlpack(x.t()), torch.from_numpy(values).t())
    np.testing.assert_array_equal(x.numpy(), values)  # the held export: no call either
    assert calls == ["GetNameExport"]
    client.delete("mapped-get")


def test_a_gets_export_is_held_for_the_reads_after_it_then_let_go(server: Any, client: Any) -> None:
    client.put("pinned-get", [1.0, 2.0, 3.0])
    before = held_exports(server)
    x = client.get("pinned-get")
    assert held_exports(server) == before + 1
    alias = torch.from_dlpack(x)  # the array holds the export on past the hold
    time.sleep(PREFETCH_HOLD_S)
    assert wait_until(lambda: not client._local._prefetched)
    client.flush()
    assert held_exports(server) == before + 1
    assert alias.tolist() == [1.0, 2.0, 3.0]
    del alias
    client.flush()
    assert held_exports(server) == before
    # unread, a got tensor's pin ends by itself: compaction may move its Storage again
    y = client.get("pinned-get")
    assert held_exports(server) == before + 1
    assert wait_until(lambda: held_exports(server) == before, timeout=PREFETCH_HOLD_S + 5)
    assert y.tolist() == [1.0, 2.0, 3.0]
    client.delete("pinned-get")


def test_a_got_tensor_dropped_unread_unpins_its_storage_with_its_release(
    server: Any, client: Any
) -> None:
    client.put_many({"dropped-get": [1.0, 2.0], "dropped-many": [3.0]})
    client.flush()
    before = held_exports(server)
    x = client.get("dropped-get")
    kept = client.get("dropped-get")
    assert held_exports(server) == before + 1
    del x  # another tensor of the Storage keeps the hold
    client.flush()
    assert held_exports(server) == before + 1
    del kept
    client.flush()
    assert held_exports(server) == before  # at once, not PREFETCH_HOLD_S later
    got = client.get_many(["dropped-get", "dropped-many"])
    assert held_exports(server) == before + 2
    alias = np.from_dlpack(got[1])
    del got
    client.flush()
    assert held_exports(server) == before + 1  # the array holds its own
    assert alias.tolist() == [3.0]
    del alias
    client.flush()
    assert held_exports(server) == before
    client.delete_many(["dropped-get", "dropped-many"])


def test_a_same_host_get_many_brings_every_export_in_its_one_call(
    server: Any, client: Any, monkeypatch: Any
) -> None:
    arrays = {f"many-{i}": np.arange(i, i + 6, dtype=np.float32).reshape(2, 3) for i in range(20)}
    client.put_many({**arrays, "many-warm": [0.0]})
    with tensord.connect(server.address) as reader:  # its own session: no handle of the put
        reader.get("many-warm").numpy()  # maps the pool's segment
        before = held_exports(server)
        calls = record_calls(reader, monkeypatch)
        got = reader.get_many(list(arrays))
        assert held_exports(server) == before + len(arrays)
        aliases = [np.from_dlpack(x) for x in got]
        assert calls == ["GetNames"]
        for alias, x, expected in zip(aliases, got, arrays.values(), strict=True):
            np.testing.assert_array_equal(alias, expected)
            assert torch.equal(torch.from_dlpack(x.t()), torch.from_numpy(expected).t())
        assert calls == ["GetNames"]
        del aliases, got
        assert wait_until(lambda: not reader._local._prefetched, timeout=PREFETCH_HOLD_S + 5)
        reader.flush()
        assert wait_until(lambda: held_exports(server) <= before, timeout=5)
    client.delete_many([*arrays, "many-warm"])


def test_a_get_many_past_the_handle_limit_still_gets_without_exports(make_server: Any) -> None:
    limit = 24
    running = make_server(max_handles_per_session=limit)
    with tensord.connect(running.address) as client:
        names = [f"h{i}" for i in range(limit - 4)]
        client.put_many({n: [i, i] for i, n in enumerate(names)})
        client.flush()
        # handles and exports together pass the limit: the exports are refused, the gets stand
        got = client.get_many(names)
        assert len(client._local._prefetched) == 0
        assert "max-handles-per-session" in client._local.last_refusal
        assert [t.tolist() for t in got] == [[i, i] for i in range(len(names))]
        del got
        client.delete_many(names)


def test_a_got_tensor_resizes_at_once_as_a_tensor_got_by_get_name_would(client: Any) -> None:
    client.put("grows", np.arange(4, dtype=np.float32))
    x = client.get("grows")  # its export held for the reads after it
    x.resize_(64)  # a pin would refuse to grow the Storage: the held export goes first
    assert x.shape == (64,) and x[:4].tolist() == [0.0, 1.0, 2.0, 3.0]
    y = client.get("grows")
    alias = np.from_dlpack(y)  # an alias the caller holds: torch's refusal, as before
    with pytest.raises(RuntimeError, match="Trying to resize storage that is not resizable"):
        y.resize_(1024)
    del alias
    client.delete("grows")


def test_a_get_sees_the_bytes_written_after_it_through_another_client(server: Any) -> None:
    with tensord.connect(server.address) as writer, tensord.connect(server.address) as reader:
        writer.put("shared-get", np.zeros(64, dtype=np.int32))
        got = reader.get("shared-get")
        mine = writer.get("shared-get")
        mine[:8] = 5  # a queued write in the writer's session
        writer.synchronize()
        expected = torch.zeros(64, dtype=torch.int32)
        expected[:8] = 5
        assert torch.equal(torch.from_dlpack(got), expected)
        writer.delete("shared-get")


def test_a_get_without_the_mapping_is_one_get_name(server: Any, monkeypatch: Any) -> None:
    with tensord.connect(server.address, local=False) as client:
        client.put("remote-get", [[1, 2], [3, 4]])
        calls = record_calls(client, monkeypatch)
        x = client.get("remote-get")
        assert calls == ["GetName"]
        assert torch.equal(torch.tensor(x.tolist()), torch.tensor([[1, 2], [3, 4]]))
        with pytest.raises(NotFoundError, match="no tensor named 'nothing'"):
            client.get("nothing")
        client.delete("remote-get")


def test_a_missing_name_raises_on_the_one_call_path(client: Any) -> None:
    with pytest.raises(NotFoundError, match="no tensor named 'not-there'"):
        client.get("not-there")


# -- put -----------------------------------------------------------------------------------


DATA = {
    "float64 array": np.linspace(-1.0, 1.0, 10),
    "int16 array": np.arange(-6, 6, dtype=np.int16).reshape(3, 4),
    "bool array": np.array([True, False, True]),
    "transposed array": np.arange(12, dtype=np.float32).reshape(3, 4).T,
    "float list": [[0.5, 1.5], [2.5, -3.25]],
    "int list": [1, 2, 3],
    "bool list": [True, False],
    "scalar": 3.5,
    "empty list": [],
    "float16 torch": torch.arange(7, dtype=torch.float16) / 3,
    "bfloat16 torch": torch.linspace(0, 1, 5, dtype=torch.bfloat16),
    "complex torch": torch.tensor([1 + 2j, -3j]),
    "strided torch": torch.arange(20).view(4, 5)[:, 1::2],
}


def _oracle(data: Any) -> torch.Tensor:
    if isinstance(data, torch.Tensor):
        return data.clone()  # torch.tensor(t) copies too (with a warning)
    return torch.tensor(data)


@pytest.mark.parametrize("kind", list(DATA))
@pytest.mark.parametrize("local", [True, False], ids=["mapped", "grpc"])
def test_put_of_data_equals_torch_tensor_of_it(server: Any, kind: str, local: bool) -> None:
    data = DATA[kind]
    expected = _oracle(data)
    with tensord.connect(server.address, local=local) as client:
        client.put("put-data", data, overwrite=True)
        got = client.get("put-data")
        client.delete("put-data")
        assert got.dtype == expected.dtype
        assert got.shape == tuple(expected.shape)
        assert got.is_contiguous()
        if got.numel():  # the bytes, compared whole (bfloat16 and complex included)
            values = torch.from_numpy(got.reshape(-1).view(tensord.uint8).numpy())
            assert torch.equal(values, expected.contiguous().view(-1).view(torch.uint8))


def test_a_small_put_is_one_staged_call_with_a_pooled_staging_tensor(
    client: Any, monkeypatch: Any
) -> None:
    client.put("warm", [0.0])  # makes the staging tensor
    calls = record_calls(client, monkeypatch)
    values = np.arange(1024, dtype=np.float32)  # 4 KiB
    client.put("staged", values)
    client.put("staged", values * 2, overwrite=True)
    assert calls == ["PutName", "PutName"]
    np.testing.assert_array_equal(client.get("staged").numpy(), values * 2)
    client.delete_many(["warm", "staged"])


def test_a_put_above_the_staging_bound_uploads_then_names(client: Any, monkeypatch: Any) -> None:
    values = np.arange((transfers.STAGED_PUT_BYTES // 4) + 1, dtype=np.int32)
    calls = record_calls(client, monkeypatch)
    client.put("big-put", values)
    assert calls == ["EmptyExport", "PutName"]  # through the mapping, then named
    np.testing.assert_array_equal(client.get("big-put").numpy(), values)
    client.delete("big-put")


def test_put_many_stages_what_fits_and_names_all_in_one_call(client: Any, monkeypatch: Any) -> None:
    big = np.ones(transfers.STAGED_PUT_BYTES // 4 - 1000, dtype=np.float32)  # most of it
    small = [np.full(3000, i, dtype=np.float32) for i in range(3)]  # the third one won't fit
    tensor = client.arange(4)
    client.put("warm-many", [0])
    calls = record_calls(client, monkeypatch)
    client.put_many({"big": big, "s0": small[0], "s1": small[1], "s2": small[2], "t": tensor})
    assert calls.count("PutNames") == 1 and "PutName" not in calls
    got = client.get_many(["big", "s0", "s1", "s2", "t"])
    for tensor_got, expected in zip(got, [big, *small, np.arange(4)], strict=True):
        np.testing.assert_array_equal(tensor_got.numpy(), expected)
    client.delete_many(["warm-many", "big", "s0", "s1", "s2", "t"])


def test_putting_a_tensor_names_it_without_copying(client: Any) -> None:
    x = client.zeros(4)
    client.put("same-storage", x)
    got = client.get("same-storage")
    assert got.untyped_storage().storage_id == x.untyped_storage().storage_id
    x.fill_(2.0)
    assert got.tolist() == [2.0] * 4
    client.delete("same-storage")


def test_staged_bytes_are_bounded_by_the_staging_tensor_and_its_session(
    server: Any, client: Any
) -> None:
    staging = client.zeros(16, dtype=tensord.uint8)

    def staged(handle: str, offset: int, shape: tuple[int, ...], dtype: str = "float32") -> Any:
        request = pb.PutNameRequest(
            name="bad-staged",
            staged=pb.StagedTensor(handle=handle, byte_offset=offset, shape=shape, dtype=dtype),
        )
        return client._conn.call("PutName", request)

    with pytest.raises(InvalidArgumentError, match=re.escape("staged bytes 8..24 are not inside")):
        staged(staging.handle, 8, (4,))
    with pytest.raises(InvalidArgumentError, match="not inside"):
        staged(staging.handle, -4, (1,))
    with pytest.raises(InvalidArgumentError, match="must be contiguous"):
        staged(staging.view(4, 4).t().handle, 0, (1,))
    with pytest.raises(InvalidArgumentError, match="names a handle or staged bytes"):
        client._conn.call(
            "PutName",
            pb.PutNameRequest(
                name="bad-staged",
                handle=staging.handle,
                staged=pb.StagedTensor(handle=staging.handle, shape=(1,), dtype="uint8"),
            ),
        )
    with tensord.connect(server.address) as other:
        theirs = other.zeros(16, dtype=tensord.uint8)
        with pytest.raises(NotFoundError, match="unknown handle"):
            staged(theirs.handle, 0, (4,), "uint8")
    assert "bad-staged" not in client.names()
    staged(staging.handle, 4, (2, 2), "uint8")
    assert client.get("bad-staged").tolist() == [[0, 0], [0, 0]]
    client.delete("bad-staged")


def test_staged_items_are_bounded_by_count_and_by_the_batch_budget(make_server: Any) -> None:
    running = make_server(max_batch_elements=1000)
    with tensord.connect(running.address) as client:
        staging = client.zeros(4096, dtype=tensord.uint8)

        def item(name: str, offset: int, numel: int) -> pb.PutNameRequest:
            staged = pb.StagedTensor(
                handle=staging.handle, byte_offset=offset, shape=(numel,), dtype="uint8"
            )
            return pb.PutNameRequest(name=name, staged=staged)

        too_many = [item(f"s{i}", i, 1) for i in range(MAX_STAGED_ITEMS + 1)]
        limit = f"exceeds the limit {MAX_STAGED_ITEMS} (limits.MAX_STAGED_ITEMS)"
        with pytest.raises(InvalidArgumentError, match=re.escape(limit)):
            client._conn.call("PutNames", pb.PutNamesRequest(items=too_many))
        # 600 + 600 elements: the second crosses the batch's budget, nothing is named
        over = [item("first", 0, 600), item("second", 600, 600)]
        with pytest.raises(ResourceExhaustedError, match=r"item 1 \('second'\)"):
            client._conn.call("PutNames", pb.PutNamesRequest(items=over))
        assert client.names() == []
        client.put("warm", [0])  # the client's staging tensor, kept for the next puts
        client.delete("warm")
        allocated = client.memory_allocated()
        # the SDK stages MAX_STAGED_ITEMS items of a put_many and uploads the others
        values = {f"v{i}": [i] for i in range(MAX_STAGED_ITEMS + 3)}
        client.put_many(values)
        got = client.get_many(list(values))
        assert [t.item() for t in got] == list(range(MAX_STAGED_ITEMS + 3))
        client.delete_many(list(values))
        del got
        client.flush()
        assert wait_until(lambda: client.memory_allocated() <= allocated)


# -- the mapping at any size --------------------------------------------------------------


def test_small_transfers_take_the_mapping_once_a_segment_is_mapped(
    client: Any, monkeypatch: Any
) -> None:
    warm = client.tensor(np.zeros(transfers.MIN_FAST_BYTES // 4, dtype=np.float32))
    assert client._local.mapping  # a segment is mapped now
    calls = record_calls(client, monkeypatch)
    values = np.arange(1024, dtype=np.float32)  # 4 KiB
    x = client.tensor(values)
    np.testing.assert_array_equal(x.numpy(), values)
    x.copy_(values[::-1].copy())
    np.testing.assert_array_equal(x.numpy(), values[::-1])
    assert "Upload" not in calls and "Download" not in calls
    assert calls.count("EmptyExport") == 1
    del warm


def test_small_transfers_stream_while_nothing_is_mapped(server: Any, monkeypatch: Any) -> None:
    with tensord.connect(server.address) as client:
        assert not client._local.mapping
        calls = record_calls(client, monkeypatch)
        x = client.tensor(np.arange(16, dtype=np.int64))
        assert x.tolist() == list(range(16))
        assert "Upload" in calls and "EmptyExport" not in calls


# -- queued deletes ------------------------------------------------------------------------


def test_a_delete_that_does_not_wait_is_queued_with_the_pipelined_ops(
    client: Any, monkeypatch: Any
) -> None:
    x = client.zeros(3)
    client.put("queued-delete", x)
    calls = record_calls(client, monkeypatch)
    x.fill_(1.0)
    client.delete("queued-delete", wait=False)
    client.delete_many(["nothing-1"], wait=False)
    assert calls == []  # nothing sent yet
    with pytest.raises(NotFoundError, match=r"no tensor named 'nothing-1' \(pipelined op delete"):
        client.synchronize()
    assert not {"DeleteName", "DeleteNames"} & set(calls)  # they went in the Batch
    assert "queued-delete" not in client.names()
    assert x.tolist() == [1.0, 1.0, 1.0]  # the write queued before it was applied


def test_a_delete_many_that_does_not_wait_is_one_queued_op_all_or_nothing(client: Any) -> None:
    client.put_many({"dm-1": [1], "dm-2": [2]})
    client.delete_many(["dm-1", "dm-missing"], wait=False)
    assert client._conn.pipeline.queued == 1
    with pytest.raises(NotFoundError, match=r"item 1 \('dm-missing'\)"):
        client.synchronize()
    assert {"dm-1", "dm-2"} <= set(client.names())  # neither deleted
    client.delete_many(["dm-1", "dm-2"], wait=False)
    client.synchronize()
    assert not {"dm-1", "dm-2"} & set(client.names())


def test_without_pipelining_a_delete_that_does_not_wait_is_a_call(
    server: Any, monkeypatch: Any
) -> None:
    with tensord.connect(server.address, pipelining=False) as client:
        client.put("unqueued", [1])
        calls = record_calls(client, monkeypatch)
        client.delete("unqueued", wait=False)
        assert calls == ["DeleteName"]
        with pytest.raises(NotFoundError):
            client.delete("unqueued", wait=False)


def test_gets_hold_a_bounded_number_of_exports_and_a_full_session_still_gets(
    make_server: Any,
) -> None:
    limit = 40
    running = make_server(max_handles_per_session=limit)
    with tensord.connect(running.address) as client:
        names = [f"g{i}" for i in range(limit + 1)]
        client.put_many({n: [i, i] for i, n in enumerate(names)})
        got = [client.get(n) for n in names[: MAX_PREFETCHED + 4]]
        assert len(client._local._prefetched) == MAX_PREFETCHED  # the oldest let go
        # gets fill the session with handles as GetName's would: the held exports go when
        # a get is refused for them, and it is made again without one
        got += [client.get(n) for n in names[len(got) : limit]]
        assert [t.tolist() for t in got[-2:]] == [[limit - 2] * 2, [limit - 1] * 2]
        with pytest.raises(ResourceExhaustedError, match="max-handles-per-session"):
            client.get(names[-1])
        del got
        client.delete_many(names)


def test_an_interrupted_staged_put_leaves_its_staging_tensor_to_no_later_put(
    server: Any, client: Any, monkeypatch: Any
) -> None:
    client.put("warm-interrupted", [0.0])  # a pooled staging tensor
    service = server.grpc_server.calls.service
    put_name = service.PutName
    release = threading.Event()

    def slow(request: Any, context: Any) -> Any:
        release.wait(10)
        return put_name(request, context)

    monkeypatch.setattr(service, "PutName", slow)
    values = np.arange(100, dtype=np.float32)
    with interrupted_after(0.2):
        client.put("interrupted", values)  # the call goes on, on its worker
    assert client._stagings.take(1, client.session_id) is None  # dropped, not pooled
    monkeypatch.setattr(service, "PutName", put_name)
    client.put("later", np.full(100, 7.0, dtype=np.float32))  # its own staging tensor
    release.set()
    assert wait_until(lambda: "interrupted" in client.names())
    np.testing.assert_array_equal(client.get("interrupted").numpy(), values)
    client.delete_many(["warm-interrupted", "interrupted", "later"])
