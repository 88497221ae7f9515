"""Share tokens have a lifetime: single use by default, uses=N or unlimited, an expiry,
revocation; the default share -> attach -> drop pattern leaves nothing allocated; an ended
token says why to its own tenant, and stays unknown to any other."""

from __future__ import annotations

import gc

import pytest
import tensord
from conftest import client_allocated
from tensord.errors import NotFoundError, ResourceExhaustedError
from tensord_server.domain import share_tokens

MIB = 1 << 20


@pytest.mark.slow
def test_share_attach_drop_twenty_times_leaves_nothing_allocated(
    server, client, wait_until
) -> None:
    before = client_allocated(client)
    with tensord.connect(server.address) as consumer:
        for i in range(20):
            x = client.full((MIB,), float(i))  # 4 MiB
            y = consumer.attach(x.share())
            assert y[0].item() == float(i)
            del x, y  # no handle is left on it anywhere
            gc.collect()
        # the last releases may still be on their way (bounded wait); tokens left none
        assert wait_until(lambda: client_allocated(client) == before, timeout=5)
    assert server.daemon.share_tokens.count() == 0


def test_a_token_is_single_use_by_default(server, client) -> None:
    x = client.arange(4)
    token = x.share()
    with tensord.connect(server.address) as consumer:
        assert consumer.attach(token).tolist() == [0, 1, 2, 3]
        with pytest.raises(NotFoundError, match=r"already used \(its one attach\)"):
            consumer.attach(token)


def test_uses_n_and_unlimited(server, client) -> None:
    x = client.arange(3)
    twice, forever = x.share(uses=2), x.share(uses=None)
    with tensord.connect(server.address) as consumer:
        kept = [consumer.attach(twice), consumer.attach(twice)]
        with pytest.raises(NotFoundError):
            consumer.attach(twice)
        kept += [consumer.attach(forever) for _ in range(5)]
        assert all(t.tolist() == [0, 1, 2] for t in kept)
    assert client.revoke(forever) is True  # an unlimited token lives until revoked...
    assert client.revoke(forever) is False
    with pytest.raises(NotFoundError):
        client.attach(forever)


def test_revoke_frees_the_storage_and_only_the_issuer_may(server, client) -> None:
    before = client_allocated(client)
    x = client.zeros(MIB // 4)
    token = x.share(uses=None)
    del x
    gc.collect()
    with tensord.connect(server.address) as other:
        assert other.revoke(token) is False  # not its token
        assert other.attach(token).shape == (MIB // 4,)
    assert client.revoke(token) is True
    client.memory_stats()
    assert client_allocated(client) == before


@pytest.mark.slow
def test_a_token_expires(server, client, wait_until) -> None:
    before = client_allocated(client)
    x = client.zeros(1024)
    token = x.share(ttl=0.2)
    del x
    gc.collect()
    # the reaper drops it (and its reference on the Storage) soon after
    assert wait_until(lambda: client_allocated(client) == before, timeout=5)
    with pytest.raises(NotFoundError):
        client.attach(token)
    with pytest.raises(tensord.errors.InvalidArgumentError):
        client.arange(2).share(uses=0)


def test_tokens_count_against_the_handle_limit_until_consumed(make_server) -> None:
    server = make_server(max_handles_per_session=3)
    with tensord.connect(server.address) as producer, tensord.connect(server.address) as consumer:
        x = producer.arange(2)
        tokens = [x.share(), x.share()]  # 1 handle + 2 tokens: full
        with pytest.raises(ResourceExhaustedError, match="--max-handles-per-session"):
            x.share()
        consumer.attach(tokens[0])  # consumed: its room comes back
        producer.revoke(tokens[1])
        assert len([x.share(), x.share()]) == 2


def test_a_token_lives_at_most_max_share_ttl(make_server) -> None:
    """ttl=inf (or 1e308) made a token that never ended, holding its Storage for ever."""
    server = make_server(share_ttl=30.0, max_share_ttl=60.0)
    with tensord.connect(server.address) as client:
        x = client.arange(4)
        for ttl in (float("inf"), 1e308, 60.5):
            with pytest.raises(tensord.errors.InvalidArgumentError, match="--max-share-ttl"):
                x.share(ttl=ttl)
        assert client.attach(x.share(ttl=60.0)).tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="--max-share-ttl"):
        make_server(share_ttl=120.0, max_share_ttl=60.0)


# ---- why an ended token no longer attaches ---------------------------------------------------

TOKENS = {"tok-alice": "alice", "tok-bob": "bob"}


def test_a_used_up_token_says_so_naming_its_uses(server, client) -> None:
    x = client.arange(3)
    once, twice = x.share(), x.share(uses=2)
    with tensord.connect(server.address) as consumer:
        consumer.attach(once)
        consumer.attach(twice), consumer.attach(twice)
        with pytest.raises(NotFoundError) as caught:
            consumer.attach(once)
        assert str(caught.value) == share_tokens.token_used_up(1)
        with pytest.raises(NotFoundError, match=r"already used \(all 2 of its attaches\)"):
            consumer.attach(twice)


def test_an_expired_token_says_it_expired_before_and_after_the_reaper(
    server, client, monkeypatch
) -> None:
    tokens = server.daemon.share_tokens
    token = client.arange(2).share(uses=None, ttl=1.0)
    real_clock = tokens._clock
    monkeypatch.setattr(tokens, "_clock", lambda: real_clock() + 2.0)  # past its expiry
    with pytest.raises(NotFoundError) as caught:
        client.attach(token)  # still in the table until the reaper drops it
    assert str(caught.value) == share_tokens.TOKEN_EXPIRED
    tokens.reap()
    with pytest.raises(NotFoundError) as caught:
        client.attach(token)
    assert str(caught.value) == share_tokens.TOKEN_EXPIRED


def test_a_revoked_token_and_one_whose_session_ended_say_so(server, client) -> None:
    token = client.arange(2).share(uses=None)
    assert client.revoke(token) is True
    with pytest.raises(NotFoundError) as caught:
        client.attach(token)
    assert str(caught.value) == share_tokens.TOKEN_REVOKED
    with tensord.connect(server.address) as producer:
        orphan = producer.arange(2).share()
    with pytest.raises(NotFoundError) as caught:
        client.attach(orphan)
    assert str(caught.value) == share_tokens.TOKEN_SESSION_ENDED


def test_a_made_up_token_is_unknown(client) -> None:
    with pytest.raises(NotFoundError) as caught:
        client.attach("A" * 22)
    assert str(caught.value) == share_tokens.UNKNOWN_SHARE_TOKEN


def test_another_tenants_token_reads_as_unknown_live_or_ended(make_server) -> None:
    server = make_server(auth_tokens=TOKENS)
    alice = tensord.connect(server.address, token="tok-alice")
    bob = tensord.connect(server.address, token="tok-bob")
    try:
        x = alice.arange(2)
        live, used, revoked = x.share(), x.share(), x.share()
        alice.attach(used)
        alice.revoke(revoked)
        for token in (live, used, revoked):
            with pytest.raises(NotFoundError) as caught:
                bob.attach(token)
            assert str(caught.value) == share_tokens.UNKNOWN_SHARE_TOKEN
        with pytest.raises(NotFoundError, match="already used"):
            alice.attach(used)  # its own tenant is told
    finally:
        alice.close()
        bob.close()


def test_ended_tokens_remembered_are_bounded(make_server, monkeypatch) -> None:
    monkeypatch.setattr(share_tokens, "MAX_ENDED_TOKENS", 3)
    server = make_server()
    with tensord.connect(server.address) as client:
        x = client.arange(1)
        tokens = [x.share() for _ in range(5)]
        for token in tokens:
            client.attach(token)
        assert len(server.daemon.share_tokens._ended) == 3
        with pytest.raises(NotFoundError) as caught:
            client.attach(tokens[0])  # the oldest is forgotten: unknown again
        assert str(caught.value) == share_tokens.UNKNOWN_SHARE_TOKEN
        with pytest.raises(NotFoundError, match="already used"):
            client.attach(tokens[-1])


def test_ended_tokens_are_forgotten_after_their_memory_time(make_server, monkeypatch) -> None:
    monkeypatch.setattr(share_tokens, "ENDED_TOKEN_MEMORY_S", 0.0)
    server = make_server()
    with tensord.connect(server.address) as client:
        token = client.arange(1).share()
        client.attach(token)
        server.daemon.share_tokens.reap()
        assert not server.daemon.share_tokens._ended
        with pytest.raises(NotFoundError) as caught:
            client.attach(token)
        assert str(caught.value) == share_tokens.UNKNOWN_SHARE_TOKEN
