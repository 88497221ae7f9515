"""Named tensors and share tokens as domain tables, without gRPC: every name and live token
holds exactly one reference on its Storage, a refusal keeps none, and what ends (a session,
the server) drops them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from tensord.errors import AlreadyExistsError, NotFoundError, ResourceExhaustedError
from tensord_server.domain import share_tokens
from tensord_server.domain.sessions import Session
from tensord_server.domain.storage import Storage
from tensord_server.domain.store import TensorStore


@pytest.fixture
def store() -> Iterator[TensorStore]:
    daemon = TensorStore(("cpu=64MiB",), max_names_per_tenant=2, max_handles_per_session=3)
    yield daemon
    daemon.close()


def _tensor(store: TensorStore, session: Session) -> tuple[str, Storage]:
    issued = store.factories.full(session, (4,), 1.0, "float32", "cpu")
    return issued.handle, issued.ref.storage


def test_a_name_holds_one_reference_and_a_refused_put_none(store: TensorStore) -> None:
    session, _ = store.sessions.open("names")
    handle, storage = _tensor(store, session)
    store.names.put(session, "a", handle, overwrite=False)
    assert storage.refs == 2  # the handle's and the name's
    with pytest.raises(AlreadyExistsError):
        store.names.put(session, "a", handle, overwrite=False)
    store.names.put(session, "b", handle, overwrite=False)
    with pytest.raises(ResourceExhaustedError, match="--max-names-per-tenant 2"):
        store.names.put(session, "c", handle, overwrite=False)
    with pytest.raises(NotFoundError, match="unknown handle"):
        store.names.put(session, "a", "no-such-handle", overwrite=True)
    assert storage.refs == 3 and store.names.of() == ["a", "b"]
    other, other_storage = _tensor(store, session)
    store.names.put(session, "a", other, overwrite=True)  # the old tensor loses a reference
    assert (storage.refs, other_storage.refs) == (2, 2)


def test_names_outlive_their_session_until_deleted_or_the_server_closes(
    store: TensorStore,
) -> None:
    session, _ = store.sessions.open("putter")
    handle, storage = _tensor(store, session)
    store.names.put(session, "kept", handle, overwrite=False)
    store.names.put(session, "deleted", handle, overwrite=False)
    store.sessions.close(session)
    assert storage.refs == 2 and not storage.freed
    reader, _ = store.sessions.open("reader")
    got = store.names.get(reader, "kept")
    assert got.ref.storage is storage and storage.refs == 3
    store.names.delete("deleted")
    with pytest.raises(NotFoundError):
        store.names.get(reader, "deleted")
    store.sessions.close(reader)
    store.names.close()
    assert storage.freed and store.names.of() == []


def test_a_sessions_tokens_end_with_it_and_count_against_its_handles(
    store: TensorStore,
) -> None:
    owner, _ = store.sessions.open("owner")
    handle, storage = _tensor(store, owner)
    first, _ = store.share_tokens.share(owner, handle, uses=None)
    store.share_tokens.share(owner, handle)
    assert store.share_tokens.count_of(owner.id) == 2 and storage.refs == 3
    with pytest.raises(ResourceExhaustedError, match="1 handles, 2 share tokens"):
        store.share_tokens.share(owner, handle)  # one handle and two tokens: full
    assert store.share_tokens.count_of(owner.id) == 2 and storage.refs == 3
    consumer, _ = store.sessions.open("consumer")
    attached = store.share_tokens.attach(consumer, first)
    assert attached.ref.storage is storage and storage.refs == 4
    store.sessions.close(owner)
    assert store.share_tokens.count() == 0 and storage.refs == 1  # the consumer's handle
    with pytest.raises(NotFoundError) as caught:
        store.share_tokens.attach(consumer, first)
    assert str(caught.value) == share_tokens.TOKEN_SESSION_ENDED
    store.sessions.close(consumer)
    assert storage.freed
