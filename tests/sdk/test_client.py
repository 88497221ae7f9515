"""The SDK against a real server: transfers, factories, conversions, releases, sessions,
introspection and the admin CLI."""

from __future__ import annotations

import pickle
import re
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensord
from conftest import client_allocated, wait_until
from tensord import dtypes
from tensord.wire.connection import ONE_MESSAGE_UPLOAD_BYTES
from tensord_server import cli

torch = pytest.importorskip("torch")

WAIT_S = 30.0  # bound on every poll below


# ---- transfers ---------------------------------------------------------------------------


def test_upload_and_download_beyond_the_default_message_limit(client: tensord.Client) -> None:
    array = np.random.default_rng(0).standard_normal((3, 1024, 1024)).astype(np.float32)  # 12 MiB
    x = client.from_numpy(array)
    assert x.nbytes == array.nbytes > 4 << 20
    np.testing.assert_array_equal(x.numpy(), array)
    # a non-contiguous tensor downloads in logical order
    np.testing.assert_array_equal(x.permute(2, 0, 1).numpy(), array.transpose(2, 0, 1))
    np.testing.assert_array_equal(x[:, ::3, 5].numpy(), array[:, ::3, 5])


def test_uploads_either_side_of_the_one_message_size_arrive_whole(fresh_server: Any) -> None:
    """Up to ONE_MESSAGE_UPLOAD_BYTES an Upload is one message, above it a stream of
    chunks: both over gRPC (not shared memory), bit for bit, none left allocated."""
    rng = np.random.default_rng(3)
    sizes = (
        1,
        ONE_MESSAGE_UPLOAD_BYTES - 1,
        ONE_MESSAGE_UPLOAD_BYTES,
        ONE_MESSAGE_UPLOAD_BYTES + 1,
    )
    with tensord.connect(fresh_server.address, local=False) as remote:
        for nbytes in (0, *sizes, 3 << 20):
            array = rng.integers(0, 256, nbytes, dtype=np.uint8)
            x = remote.from_numpy(array)
            assert x.nbytes == nbytes
            np.testing.assert_array_equal(x.numpy(), array)
            del x
        remote.flush()
        assert wait_until(lambda: client_allocated(remote) == 0, WAIT_S)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [d for d in dtypes.ALL_DTYPES], ids=lambda d: d.name)
def test_every_dtype_round_trips(client: tensord.Client, dtype: dtypes.DType) -> None:
    t = (torch.arange(-3, 9).view(3, 4) % 5).to(dtypes.to_torch(dtype))
    x = client.tensor(t)
    assert x.dtype == dtype and tuple(x.shape) == (3, 4)
    assert x.tolist() == t.tolist()
    assert x[1, 2].item() == t[1, 2].item()
    assert repr(x).replace("tensord.", "torch.") == repr(t)
    assert x.t().tolist() == t.t().tolist()


def test_tensor_from_python_data_infers_dtypes_as_torch(client: tensord.Client) -> None:
    for data in [1.5, 3, True, [1, 2, 3], [[1.0, 2.0]], [True, False], [1, 2.5], 2 + 1j]:
        x, t = client.tensor(data), torch.tensor(data)
        assert x.dtype == dtypes.from_torch(t.dtype), data
        assert x.tolist() == t.tolist()
        assert repr(x).replace("tensord.", "torch.") == repr(t)
    x = client.tensor([1, 2], dtype=tensord.dtypes.float64, requires_grad=True)
    assert x.dtype == dtypes.float64 and x.requires_grad
    with pytest.raises(RuntimeError, match="Can't call numpy"):
        x.numpy()
    assert x.detach().numpy().tolist() == [1.0, 2.0]
    assert np.asarray(x.detach()).dtype == np.float64
    with pytest.warns(UserWarning, match="To copy construct from a tensor"):  # as torch warns
        copy = client.tensor(x)
    assert not copy.requires_grad
    assert copy.untyped_storage().storage_id != x.untyped_storage().storage_id


def test_repr_of_a_large_tensor_matches_torch(client: tensord.Client) -> None:
    t = torch.arange(4000, dtype=torch.float64).view(20, 200) / 3
    x = client.tensor(t)
    assert repr(x).replace("tensord.", "torch.") == repr(t)
    assert repr(client.zeros(2, 0)) == repr(torch.zeros(2, 0))


# ---- factories and copies ------------------------------------------------------------------


def test_factories_match_torch(client: tensord.Client) -> None:
    pairs = [
        (client.zeros(2, 3), torch.zeros(2, 3)),
        (client.ones((2, 3), dtype=tensord.dtypes.int32), torch.ones((2, 3), dtype=torch.int32)),
        (client.full((2, 2), 7), torch.full((2, 2), 7)),
        (client.full((2,), 1.5), torch.full((2,), 1.5)),
        (client.full((2,), True), torch.full((2,), True)),
        (client.arange(5), torch.arange(5)),
        (client.arange(1, 4, 0.5), torch.arange(1, 4, 0.5)),
        (client.arange(10, 0, -3), torch.arange(10, 0, -3)),
    ]
    for ours, theirs in pairs:
        assert ours.dtype == dtypes.from_torch(theirs.dtype)
        assert ours.tolist() == theirs.tolist()
    e = client.empty(3, 4, dtype=tensord.dtypes.float16)
    assert e.shape == (3, 4) and e.dtype == dtypes.float16 and e.is_contiguous()
    p = client.arange(24).view(2, 3, 4).permute(2, 0, 1)
    like = client.empty_like(p)
    assert (
        like.stride() == torch.empty_like(torch.arange(24).view(2, 3, 4).permute(2, 0, 1)).stride()
    )
    assert client.zeros_like(p).tolist() == torch.zeros(4, 2, 3, dtype=torch.int64).tolist()
    assert (
        client.ones_like(p, dtype=tensord.dtypes.bool).tolist()
        == torch.ones(4, 2, 3).bool().tolist()
    )


@pytest.mark.parametrize("sizes", [(-1,), (2, -3), ((0, -2),)])
def test_factories_refuse_a_negative_size_with_torchs_text(
    client: tensord.Client, sizes: tuple[Any, ...]
) -> None:
    # torch's zeros checks its sizes itself, with its own text; ones, full and empty share
    # empty's check ("Trying to create tensor with negative dimension")
    for factory in ("zeros", "ones", "empty"):
        with pytest.raises(RuntimeError) as theirs:
            getattr(torch, factory)(*sizes)
        with pytest.raises(RuntimeError) as ours:
            getattr(client, factory)(*sizes)
        assert str(ours.value) == str(theirs.value)


def test_to_forms_and_conversions(client: tensord.Client) -> None:
    x = client.arange(6).view(2, 3)
    assert x.to(tensord.dtypes.int64) is x  # nothing to do: torch returns self
    assert x.to("cpu") is x and x.cpu() is x
    y = x.to("cpu", copy=True)
    assert y is not x and y.data_ptr() != x.data_ptr() and y.tolist() == x.tolist()
    assert x.to(tensord.float16).dtype == dtypes.float16 == tensord.half
    assert x.to("cpu", tensord.bool).dtype == tensord.bool
    assert x.to(torch.float64).dtype == dtypes.float64
    assert x.to("cpu", tensord.dtypes.int8).dtype == dtypes.int8
    assert x.to(dtype=tensord.dtypes.bool).tolist() == torch.arange(6).view(2, 3).bool().tolist()
    assert x.to(x.float()).dtype == dtypes.float32
    for method, dtype in [
        ("float", "float32"),
        ("double", "float64"),
        ("half", "float16"),
        ("int", "int32"),
        ("long", "int64"),
        ("bool", "bool"),
    ]:
        assert getattr(x, method)().dtype == getattr(tensord, dtype)
    assert x.float().t().tolist() == torch.arange(6).view(2, 3).float().t().tolist()
    with pytest.raises(tensord.FailedPreconditionError):
        x.cuda()
    r = x.requires_grad_(False)
    assert r is x and not x.requires_grad


def test_setitem_from_scalar_and_tensor(client: tensord.Client) -> None:
    x, t = client.zeros(4, 4, dtype=tensord.dtypes.int32), torch.zeros(4, 4, dtype=torch.int32)
    for key, value in [
        ((0,), 1),
        ((slice(1, 3), 2), client.tensor([5, 6])),
        ((3, slice(None)), np.int64(4)),
        ((Ellipsis, 0), client.tensor([9])),
        ((None, 2, slice(0, 2)), 2.7),
    ]:
        x[key] = value
        t[key] = torch.as_tensor(value.tolist() if isinstance(value, tensord.Tensor) else value)
    assert x.tolist() == t.tolist()


# ---- releases and sessions -------------------------------------------------------------------


def test_dropped_tensors_are_released_in_batches(fresh_server: Any) -> None:
    # one RPC per view, releases in Release calls: the unpipelined path (pipelining batches
    # views and releases together, tests/sdk/test_pipelining.py)
    with tensord.connect(fresh_server.address, pipelining=False) as client:
        baseline = client_allocated(client)
        calls: list[str] = []
        real_unary = client._conn._unary

        def counting(method: str, request: Any, **kwargs: Any) -> Any:
            calls.append(method)
            return real_unary(method, request, **kwargs)

        client._conn._unary = counting  # type: ignore[method-assign]
        tensors = [client.empty(1000) for _ in range(100)]
        views = [t.view(10, 100) for t in tensors]
        assert client_allocated(client) >= baseline + 100 * 4000
        del tensors, views
        client.flush()
        assert wait_until(lambda: client_allocated(client) == baseline, WAIT_S)
        assert calls.count("Empty") == 100 and calls.count("View") == 100
        # 200 dropped handles cost a handful of Release calls, not one each
        assert 1 <= calls.count("Release") <= 5


def test_close_ends_the_session_and_frees_its_memory(fresh_server: Any) -> None:
    with tensord.connect(fresh_server.address) as observer:
        baseline = client_allocated(observer)
        client = tensord.connect(fresh_server.address)
        kept = client.zeros(1 << 18)
        assert client_allocated(observer) > baseline
        client.close()
        client.close()  # idempotent
        assert client_allocated(observer) == baseline
        assert client.session_id not in fresh_server.daemon.sessions.session_ids()
        with pytest.raises(ConnectionError, match="closed"):
            kept.clone()
        del kept


@pytest.mark.slow
def test_heartbeats_keep_an_idle_session_past_many_leases(make_server: Any) -> None:
    server = make_server(lease=0.3, session_grace=0.1)
    with tensord.connect(server.address) as client:
        x = client.arange(10)
        session_id = client.session_id
        time.sleep(1.5)  # five leases, fifteen graces, no call but the heartbeats
        assert client.session_id == session_id
        assert x.tolist() == list(range(10))


def test_a_lease_too_long_to_wait_for_keeps_the_heartbeat_alive(
    make_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the server's lease is the client's to trust only so far: lease/3 past what a
    # thread can wait (threading.TIMEOUT_MAX) killed the heartbeat with an OverflowError
    died: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: died.append(args.exc_value))
    server = make_server(lease=1e300)
    with tensord.connect(server.address) as client:
        x = client.arange(3)
        time.sleep(0.2)  # the heartbeat thread's first wait has begun
        assert x.tolist() == [0, 1, 2]
    assert died == []


def test_more_clients_than_server_threads_all_work(make_server: Any) -> None:
    # unary heartbeats hold no worker between beats: 4 workers serve 12 idle clients
    from tensord_server.rpc.grpc_server import create_server

    server = make_server()
    small, port = create_server("127.0.0.1:0", store=server.daemon, max_workers=4)
    try:
        clients = [tensord.connect(f"127.0.0.1:{port}") for _ in range(12)]
        time.sleep(0.2)
        assert [c.arange(3).tolist() for c in clients] == [[0, 1, 2]] * 12
        for c in clients:
            c.close()
    finally:
        small.stop(1.0).wait()


def test_memory_stats_count_live_sessions_and_storages(fresh_server: Any) -> None:
    with tensord.connect(fresh_server.address) as client:
        kept = [client.zeros(4), client.zeros(5)]
        stats = client.memory_stats()
        assert stats["sessions.live"] == 1
        assert stats["storages.live"] == 2
        del kept


def test_connect_reads_the_address_from_the_environment(
    server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TENSORD_ADDRESS", server.address)
    with tensord.connect() as client:
        assert client.address == server.address
        assert client.server_info()["devices"][0]["device"] == "cpu"


def test_out_of_memory_is_a_runtime_error() -> None:
    from tensord_server.domain.store import TensorStore
    from tensord_server.rpc.grpc_server import create_server

    daemon = TensorStore(("cpu=64MiB",))
    server, port = create_server("127.0.0.1:0", store=daemon)
    try:
        with tensord.connect(f"127.0.0.1:{port}") as client:
            keep = client.empty(10 << 20)  # 40 MiB of float32
            with pytest.raises(tensord.OutOfMemoryError) as info:
                client.empty(10 << 20)
            assert isinstance(info.value, RuntimeError)
            assert keep.numel() == 10 << 20  # and the server keeps serving
            assert client.zeros(2).tolist() == [0.0, 0.0]
    finally:
        server.stop(None).wait(10)
        daemon.close()


def test_names_put_get_delete(client: tensord.Client) -> None:
    x = client.arange(4)
    client.put("sdk-test-name", x)
    with pytest.raises(tensord.AlreadyExistsError, match="already exists") as info:
        client.put("sdk-test-name", x)
    assert isinstance(info.value, ValueError)
    client.put("sdk-test-name", x.clone(), overwrite=True)
    assert "sdk-test-name" in client.names()
    assert client.get("sdk-test-name").tolist() == [0, 1, 2, 3]
    client.delete("sdk-test-name")
    assert "sdk-test-name" not in client.names()


def test_a_name_or_token_that_is_not_a_str_is_a_type_error_naming_it(
    client: tensord.Client,
) -> None:
    # before: protobuf's "bad argument type for built-in operation", naming nothing, and
    # get(None) looked up the name ''
    x = client.arange(2)
    calls = [
        ("name", lambda: client.put(3, x)),
        ("name", lambda: client.put(b"n", x)),
        ("name", lambda: client.get(None)),
        ("name", lambda: client.delete(3)),
        ("token", lambda: client.attach(None)),
        ("token", lambda: client.revoke(1)),
    ]
    for what, call in calls:
        with pytest.raises(TypeError, match=f"^{what} must be a str, got "):
            call()
    assert "3" not in client.names() and "n" not in client.names()


# ---- introspection and CLI -------------------------------------------------------------------


def test_memory_stats_summary_and_snapshot(client: tensord.Client) -> None:
    x = client.zeros(1 << 16)
    stats = client.memory_stats()
    for key in ("allocated_bytes.all.current", "reserved_bytes.all.peak", "num_alloc_retries"):
        assert key in stats
    assert list(stats) == sorted(stats)
    assert stats["allocated_bytes.all.current"] >= x.nbytes
    assert "allocated" in client.memory_summary().lower()
    snapshot = client.memory_snapshot()
    assert "segments" in snapshot and "device_traces" in snapshot
    pickle.loads(pickle.dumps(snapshot))
    assert client.empty_cache() >= 0


def test_admin_cli(server: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    address = ["--address", server.address]
    assert cli.main(["stats", *address]) == 0
    assert "allocated_bytes.all.current" in capsys.readouterr().out
    assert cli.main(["summary", *address]) == 0
    assert capsys.readouterr().out.strip()
    out = tmp_path / "snap.pickle"
    assert cli.main(["snapshot", *address, "-o", str(out)]) == 0
    with out.open("rb") as f:
        assert "segments" in pickle.load(f)
    assert cli.main(["empty-cache", *address]) == 0
    assert "released" in capsys.readouterr().out
    assert cli.main(["stats", "--address", "127.0.0.1:1", "--timeout", "0.2"]) == 1
    assert "no tensord server answers" in capsys.readouterr().err


def test_readme_quick_start_runs(server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    (code,) = re.findall(r"```python\n(.+?)```", readme, flags=re.DOTALL)
    monkeypatch.setenv("TENSORD_ADDRESS", server.address)
    exec(compile(code, "README.md", "exec"), {})


def test_a_tensor_does_not_pickle_but_its_token_travels(client: tensord.Client) -> None:
    x = client.arange(3)
    with pytest.raises(TypeError, match="share"):
        pickle.dumps(x)
    assert client.attach(pickle.loads(pickle.dumps(x.share()))).tolist() == [0, 1, 2]


def test_tensors_of_two_clients_do_not_mix(server: Any, client: tensord.Client) -> None:
    with tensord.connect(server.address) as other:
        theirs = other.zeros(2)
        ours = client.zeros(2)
        for attempt in (
            lambda: ours.copy_(theirs),
            lambda: ours.__setitem__(0, theirs[0]),
            lambda: tensord.cat([ours, theirs]),
            lambda: client.put("mixed", theirs),
        ):
            with pytest.raises(ValueError, match="another tensord client"):
                attempt()
        # the supported way: a share token (or a name)
        ours.copy_(client.attach(theirs.fill_(3).share()))
        assert ours.tolist() == [3.0, 3.0]


def test_python_number_protocols_match_torch(client: tensord.Client) -> None:
    x, t = client.tensor([[1.5, 2.0], [3.0, 4.0]]), torch.tensor([[1.5, 2.0], [3.0, 4.0]])
    assert f"{x[0, 0]:.3f}" == f"{t[0, 0]:.3f}" == "1.500"
    assert float(x[1, 1]) == 4.0 and int(x[0, 0]) == 1 and bool(x[0, 0])
    assert list(range(10))[client.tensor(3)] == 3  # __index__
    with pytest.raises(TypeError, match="only integer tensors"):
        list(range(10))[x[0, 0]]
    with pytest.raises(RuntimeError, match="ambiguous"):
        bool(x)
    assert x.T.tolist() == t.T.tolist()
    assert [row.tolist() for row in x] == [row.tolist() for row in t]


def test_metadata_reads_and_bad_views_make_no_rpc(
    client: tensord.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = client.arange(24).view(2, 3, 4).permute(2, 0, 1)
    client.flush()

    def no_rpc(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("an RPC was made")

    # (monkeypatch restores them before the client fixture closes the session)
    monkeypatch.setattr(client._conn, "call", no_rpc)
    monkeypatch.setattr(client._conn, "download_into", no_rpc)
    assert x.shape == (4, 2, 3) and x.size() == (4, 2, 3) and x.size(-1) == 3
    assert x.stride() == (1, 12, 4) and x.stride(0) == 1 and x.storage_offset() == 0
    assert x.dtype == tensord.int64 and x.device == "cpu" and not x.is_cuda
    assert not x.is_contiguous() and x.numel() == 24 and x.dim() == x.ndim == 3
    assert x.element_size() == x.itemsize == 8 and x.nbytes == 192 and len(x) == 4
    assert x.data_ptr() == x.untyped_storage().data_ptr() and x.untyped_storage().nbytes() == 192
    assert not x.requires_grad and x.contiguous is not None
    # invalid views fail locally, with torch's types and texts
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        x.view(24)
    with pytest.raises(IndexError, match="Dimension out of range"):
        x.transpose(0, 3)
    with pytest.raises(RuntimeError, match="exceeds dimension size"):
        x.narrow(0, 3, 2)
    with pytest.raises(IndexError, match="too many indices for tensor of dimension 3"):
        x[0, 0, 0, 0]


def test_a_dropped_client_closes_its_session(fresh_server: Any) -> None:
    import gc

    with tensord.connect(fresh_server.address) as observer:
        baseline = client_allocated(observer)
        dropped = tensord.connect(fresh_server.address)
        session_id = dropped.session_id
        x = dropped.zeros(1 << 18)
        assert client_allocated(observer) > baseline
        del dropped, x  # never closed: the tensor held the client, now both are gone
        gc.collect()
        assert session_id not in fresh_server.daemon.sessions.session_ids()
        assert client_allocated(observer) == baseline
