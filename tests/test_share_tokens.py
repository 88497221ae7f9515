"""Share tokens have a lifetime: single use by default, uses=N or unlimited, an expiry,
revocation; the default share -> attach -> drop pattern leaves nothing allocated."""

from __future__ import annotations

import gc

import pytest
import tensord
from conftest import client_allocated
from tensord.errors import NotFoundError, ResourceExhaustedError

MIB = 1 << 20


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
    assert server.daemon.sessions.token_count() == 0


def test_a_token_is_single_use_by_default(server, client) -> None:
    x = client.arange(4)
    token = x.share()
    with tensord.connect(server.address) as consumer:
        assert consumer.attach(token).tolist() == [0, 1, 2, 3]
        with pytest.raises(NotFoundError, match="unknown share token"):
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
