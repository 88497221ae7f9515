"""The lookups a node keeps from etcd (no etcd needed): a value enters only from a read the
watch has not overtaken, a newer change drops it, an older one leaves it, and without a
watch nothing is answered."""

from __future__ import annotations

import pytest
from tensord_server.cluster.cache import WatchedCache

KEY = b"/tensord/v1/names/t/x"


def watched(revision: int = 10, limit: int = 8) -> WatchedCache[str]:
    cache: WatchedCache[str] = WatchedCache(limit)
    cache.watching(revision)
    return cache


def test_a_value_read_is_answered_until_the_watch_tells_of_a_newer_change() -> None:
    cache = watched()
    assert cache.get(KEY) is None
    cache.store(KEY, "a", revision=7, read_at=12)
    assert cache.get(KEY) == "a"
    cache.changed(KEY, 7)  # the change that made it, told late: kept
    assert cache.get(KEY) == "a"
    cache.changed(b"/tensord/v1/names/t/y", 13)  # another key's change: kept
    assert cache.get(KEY) == "a"
    cache.changed(KEY, 13)
    assert cache.get(KEY) is None


def test_a_read_the_watch_has_overtaken_is_not_kept() -> None:
    cache = watched(revision=10)
    cache.heard(20)  # the watch told of changes up to 20: one may be to KEY, after 15
    cache.store(KEY, "stale", revision=5, read_at=15)
    assert cache.get(KEY) is None
    cache.store(KEY, "fresh", revision=5, read_at=20)
    assert cache.get(KEY) == "fresh"


def test_without_a_watch_nothing_is_kept_or_answered() -> None:
    cache: WatchedCache[str] = WatchedCache(8)
    cache.store(KEY, "a", revision=1, read_at=2)  # no watch yet
    assert cache.get(KEY) is None
    cache.watching(2)
    cache.store(KEY, "a", revision=1, read_at=2)
    assert cache.get(KEY) == "a"
    cache.unwatched()  # the watch failed: what it would have told is unknown
    assert cache.get(KEY) is None
    cache.store(KEY, "a", revision=1, read_at=3)
    assert cache.get(KEY) is None
    cache.watching(3)  # a new watch: nothing from before it
    assert cache.get(KEY) is None


def test_the_cache_is_bounded_the_least_recently_used_going_first() -> None:
    cache = watched(revision=1, limit=2)
    for name in "abc":
        if name == "c":
            assert cache.get(b"a") == "a"  # a used: b is the least recently used
        cache.store(name.encode(), name, revision=1, read_at=1)
    assert len(cache) == 2
    assert cache.get(b"a") == "a" and cache.get(b"b") is None and cache.get(b"c") == "c"
    cache.drop(b"a")
    assert cache.get(b"a") is None


def test_a_value_cannot_be_newer_than_its_read() -> None:
    with pytest.raises(AssertionError, match="changed at 5 read at 4"):
        watched().store(KEY, "a", revision=5, read_at=4)
