"""Batched names (PutNames, GetNames, DeleteNames): one call for many names, all or nothing,
bounded by MAX_NAME_ITEMS, each failure naming its item; tenants kept apart; the SDK's
put_many / get_many / delete_many and their tensord.aio forms (torch is the oracle)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tensord
import tensord.aio
import torch
from tensord import schema as pb
from tensord.errors import (
    AlreadyExistsError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
)
from tensord.protocol import MAX_NAME_ITEMS
from tensord_server.domain.names import NameItem
from tensord_server.domain.sessions import Session
from tensord_server.domain.store import TensorStore

TOKENS = {"tok-alice": "alice", "tok-bob": "bob"}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def store() -> Iterator[TensorStore]:
    daemon = TensorStore(("cpu=64MiB",), max_names_per_tenant=4, max_handles_per_session=6)
    yield daemon
    daemon.close()


def _full(store: TensorStore, session: Session, value: float) -> tuple[str, Any]:
    issued = store.factories.full(session, (4,), value, "float32", "cpu")
    return issued.handle, issued.ref.storage


# -- the domain table -------------------------------------------------------------------------


def test_a_refused_put_many_keeps_no_reference_and_changes_no_name(store: TensorStore) -> None:
    session, _ = store.sessions.open("batches")
    a, storage_a = _full(store, session, 1.0)
    b, storage_b = _full(store, session, 2.0)
    store.names.put(session, "kept", b, overwrite=False)
    assert storage_b.refs == 2
    # item 2 exists: items 0 and 1 must not be named, their references not kept
    items = [NameItem("x", a, False), NameItem("y", a, False), NameItem("kept", a, False)]
    with pytest.raises(AlreadyExistsError, match=re.escape("item 2 ('kept'): name 'kept'")):
        store.names.put_many(session, items)
    assert store.names.of() == ["kept"]
    assert storage_a.refs == 1 and storage_b.refs == 2
    # overwriting replaces the old reference, all at once
    store.names.put_many(session, [NameItem("kept", a, True), NameItem("x", a, False)])
    assert store.names.of() == ["kept", "x"]
    assert storage_a.refs == 3 and storage_b.refs == 1


def test_empty_batches_change_nothing(store: TensorStore) -> None:
    session, _ = store.sessions.open("empty")
    store.names.put_many(session, [])
    assert store.names.get_many(session, []) == []
    store.names.delete_many([])
    assert store.names._names == {}  # a tenant without names keeps no entry


def test_put_many_counts_its_own_new_names_against_the_tenant_limit(store: TensorStore) -> None:
    session, _ = store.sessions.open("limit")
    handle, storage = _full(store, session, 1.0)
    store.names.put(session, "old", handle, overwrite=False)
    items = [NameItem(f"n{i}", handle, False) for i in range(4)]  # 1 + 4 > 4
    with pytest.raises(ResourceExhaustedError, match=r"item 3 \('n3'\).*--max-names-per-tenant 4"):
        store.names.put_many(session, items)
    assert store.names.of() == ["old"] and storage.refs == 2
    # an overwrite of a held name is no new name
    store.names.put_many(session, [NameItem("old", handle, True), *items[:3]])
    assert len(store.names.of()) == 4


def test_get_many_past_the_handle_limit_issues_no_handle(store: TensorStore) -> None:
    session, _ = store.sessions.open("handles")
    handle, storage = _full(store, session, 1.0)
    store.names.put(session, "a", handle, overwrite=False)
    got = store.names.get_many(session, ["a", "a"])  # a name twice: two handles
    assert len(got) == 2 and storage.refs == 4
    with pytest.raises(ResourceExhaustedError):
        store.names.get_many(session, ["a"] * 4)  # 3 held + 4 > 6
    assert storage.refs == 4 and len(session.handles) == 3


def test_delete_many_is_all_or_nothing(store: TensorStore) -> None:
    session, _ = store.sessions.open("deletes")
    handle, storage = _full(store, session, 1.0)
    for name in ("a", "b"):
        store.names.put(session, name, handle, overwrite=False)
    with pytest.raises(NotFoundError, match=re.escape("item 1 ('gone'): no tensor named 'gone'")):
        store.names.delete_many(["a", "gone", "b"])
    with pytest.raises(InvalidArgumentError, match=r"item 1 \('a'\): name 'a' appears twice"):
        store.names.delete_many(["a", "a"])
    assert store.names.of() == ["a", "b"] and storage.refs == 3
    store.names.delete_many(["b", "a"])
    assert store.names.of() == [] and storage.refs == 1


# -- over the wire ----------------------------------------------------------------------------


def test_put_many_get_many_delete_many_round_trip(client: Any) -> None:
    data = {
        "f32": np.arange(12, dtype=np.float32).reshape(3, 4),
        "list": [[1, 2], [3, 4]],
        "torch": torch.arange(5, dtype=torch.bfloat16),
        "tensor": client.arange(6).view(2, 3),
    }
    client.put_many(data)
    got = client.get_many(["torch", "f32", "list", "tensor"])
    oracle = [
        data["torch"].clone(),  # torch.tensor of a torch tensor: a copy (and a warning)
        torch.tensor(data["f32"]),
        torch.tensor(data["list"]),
        torch.arange(6).view(2, 3),
    ]
    for tensor, expected in zip(got, oracle, strict=True):
        assert tensor.dtype == expected.dtype
        assert torch.equal(torch.from_numpy(tensor.float().numpy()), expected.float())
    assert set(data) <= set(client.names())
    client.delete_many(list(data))
    assert not set(data) & set(client.names())


def test_a_failing_item_leaves_every_name_as_it_was(client: Any) -> None:
    client.put("kept", client.full((2,), 1.0))
    with pytest.raises(AlreadyExistsError, match=re.escape("item 1 ('kept'): name 'kept'")):
        client.put_many({"new": client.zeros(2), "kept": client.zeros(2)})
    assert "new" not in client.names()
    assert client.get("kept").tolist() == [1.0, 1.0]
    with pytest.raises(NotFoundError, match=re.escape("item 1 ('absent'): no tensor named")):
        client.get_many(["kept", "absent"])
    with pytest.raises(NotFoundError, match=re.escape("item 0 ('absent'): no tensor named")):
        client.delete_many(["absent", "kept"])
    assert client.get("kept").tolist() == [1.0, 1.0]
    other = tensord.connect(client.address)
    try:  # another client's tensor is refused before anything is sent
        with pytest.raises(InvalidArgumentError, match="another tensord client"):
            client.put_many({"mine": client.zeros(1), "theirs": other.zeros(1)})
    finally:
        other.close()
    assert "mine" not in client.names()
    client.delete("kept")


def test_more_than_max_name_items_is_refused_by_the_sdk_and_the_server(
    server: Any, client: Any
) -> None:
    names = [f"n{i}" for i in range(MAX_NAME_ITEMS + 1)]
    text = f"the limit is {MAX_NAME_ITEMS} (tensord.protocol.MAX_NAME_ITEMS)"
    for call in (
        lambda: client.put_many({n: [1.0] for n in names}),
        lambda: client.get_many(names),
        lambda: client.delete_many(names),
    ):
        with pytest.raises(RuntimeError, match=re.escape(text)):
            call()
    # a client that sends them anyway: refused by its length before any item is looked at
    x = client.zeros(1)
    server_text = (
        f"has {MAX_NAME_ITEMS + 1} items; the limit is {MAX_NAME_ITEMS} (limits.MAX_NAME_ITEMS)"
    )
    items = [pb.PutNameRequest(name=n, handle=x.handle) for n in names]
    for method, request in (
        ("PutNames", pb.PutNamesRequest(items=items)),
        ("GetNames", pb.GetNamesRequest(names=names)),
        ("DeleteNames", pb.DeleteNamesRequest(names=names)),
        (
            "Batch",
            pb.BatchRequest(ops=[pb.BatchOp(delete_names=pb.DeleteNamesRequest(names=names))]),
        ),
    ):
        with pytest.raises(InvalidArgumentError, match=re.escape(server_text)):
            client._conn.call(method, request)
    assert not {"n0", "n1024"} & set(client.names())
    # exactly the limit goes through
    client.put_many({n: x for n in names[:MAX_NAME_ITEMS]})
    assert len(client.get_many(names[:MAX_NAME_ITEMS])) == MAX_NAME_ITEMS
    client.delete_many(names[:MAX_NAME_ITEMS])
    assert "n0" not in client.names()


def test_a_name_twice_in_one_put_is_refused(client: Any) -> None:
    x = client.zeros(1)
    request = pb.PutNamesRequest(
        items=[pb.PutNameRequest(name="twice", handle=x.handle) for _ in range(2)]
    )
    with pytest.raises(InvalidArgumentError, match=r"item 1 \('twice'\): .*appears twice"):
        client._conn.call("PutNames", request)
    assert "twice" not in client.names()


def test_another_tenants_names_cannot_be_read_or_deleted_through_a_batch(make_server: Any) -> None:
    running = make_server(auth_tokens=TOKENS)
    with (
        tensord.connect(running.address, token="tok-alice") as alice,
        tensord.connect(running.address, token="tok-bob") as bob,
    ):
        alice.put_many({"secret": alice.full((3,), 7.0), "plans": [1, 2, 3]})
        with pytest.raises(NotFoundError, match=re.escape("item 0 ('secret')")):
            bob.get_many(["secret"])
        bob.put("bobs", [5])
        with pytest.raises(NotFoundError, match=re.escape("item 1 ('plans')")):
            bob.delete_many(["bobs", "plans"])
        assert bob.names() == ["bobs"]  # all or nothing: his own name stays too
        bob.delete("bobs")
        with pytest.raises(NotFoundError):
            bob.get("secret")
        bob.delete("plans", wait=False)  # queued: refused at bob's next wait
        with pytest.raises(NotFoundError, match="no tensor named 'plans'"):
            bob.synchronize()
        # bob's own names of the same spelling are his, alice's stay hers
        bob.put_many({"secret": [0.0]})
        assert bob.get("secret").tolist() == [0.0]
        assert [t.tolist() for t in alice.get_many(["secret", "plans"])] == [
            [7.0, 7.0, 7.0],
            [1, 2, 3],
        ]
        alice.delete_many(["secret", "plans"])
        assert bob.names() == ["secret"]


@pytest.mark.anyio
async def test_aio_batches(server: Any) -> None:
    async with await tensord.aio.connect(server.address) as client:
        x = await client.tensor([1.0, 2.0])
        await client.put_many({"aio-a": x, "aio-b": np.arange(3, dtype=np.int16)})
        a, b = await client.get_many(["aio-a", "aio-b"])
        assert isinstance(a, tensord.aio.AsyncTensor)
        assert await a.tolist() == [1.0, 2.0]
        assert await b.tolist() == [0, 1, 2] and b.dtype == tensord.int16
        with pytest.raises(NotFoundError, match=re.escape("item 1 ('aio-c')")):
            await client.get_many(["aio-a", "aio-c"])
        await client.delete_many(["aio-a", "aio-b"])
        assert not {"aio-a", "aio-b"} & set(await client.names())


def test_name_calls_are_classified_as_the_single_name_calls_are() -> None:
    """Small batches run on the loop while the workers are idle, a staged put never does,
    and in a cluster every name call waits on a worker (a round trip to etcd)."""
    from tensord_server.rpc.calls import CLUSTER_WORK, INLINE_WORK

    staged = pb.PutNameRequest(name="s", staged=pb.StagedTensor(handle="h", shape=[1]))
    plain = pb.PutNameRequest(name="p", handle="h")
    assert INLINE_WORK["PutName"](plain) and not INLINE_WORK["PutName"](staged)
    assert INLINE_WORK["PutNames"](pb.PutNamesRequest(items=[plain, plain]))
    assert not INLINE_WORK["PutNames"](pb.PutNamesRequest(items=[plain, staged]))
    assert INLINE_WORK["GetNames"](pb.GetNamesRequest(names=["a"]))
    assert INLINE_WORK["DeleteNames"](pb.DeleteNamesRequest(names=["a"]))
    names = {"GetName", "PutName", "DeleteName", "GetNames", "PutNames", "DeleteNames"}
    assert names | {"GetNameExport"} <= CLUSTER_WORK
