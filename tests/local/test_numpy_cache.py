"""x.numpy()'s reused same-host destinations (tensord.local.host_cache.HostBufferCache): never handed
out while anything references them, bounded, thread-safe, empty in a forked child."""

from __future__ import annotations

import functools
import gc
import os
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensord
import torch
from tensord.local import host_cache, transfers

REPO = Path(__file__).resolve().parents[2]
ELEMENTS = transfers.MIN_FAST_BYTES // 4  # float32: the smallest same-host download


@pytest.fixture
def cache(monkeypatch: Any) -> host_cache.HostBufferCache:
    """A cache of its own for the test (the process-wide one may hold other tests' arrays)."""
    fresh = host_cache.HostBufferCache(64 * transfers.MIN_FAST_BYTES, 3)
    monkeypatch.setattr(host_cache, "numpy_cache", fresh)
    return fresh


def values(seed: int, n: int = ELEMENTS) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def test_an_unreferenced_array_is_reused_with_the_new_bytes(
    client: Any, cache: host_cache.HostBufferCache
) -> None:
    first, second = values(0), values(1)
    x, y = client.tensor(first), client.tensor(second)
    a = x.numpy()
    address = a.ctypes.data
    np.testing.assert_array_equal(a, first)
    del a
    b = y.numpy()
    assert b.ctypes.data == address  # the warm pages again
    assert b.flags.owndata and b.flags.writeable
    np.testing.assert_array_equal(b, second)
    assert cache.cached() == (1, first.nbytes)


@pytest.mark.slow
@pytest.mark.parametrize(
    "alias",
    [
        lambda a: a[10:],
        lambda a: a[::2].reshape(-1, 8),
        lambda a: a.view(np.int32),
        memoryview,
        torch.from_numpy,
        lambda a: np.from_dlpack(a),
        lambda a: [a],  # any container
    ],
    ids=["slice", "view of a view", "view(dtype)", "memoryview", "from_numpy", "dlpack", "list"],
)
def test_an_alias_of_a_returned_array_blocks_its_reuse(
    client: Any, cache: host_cache.HostBufferCache, alias: Any
) -> None:
    first, second = values(0), values(1)
    x, y = client.tensor(first), client.tensor(second)
    a = x.numpy()
    address = a.ctypes.data
    kept = alias(a)
    del a
    b = y.numpy()
    assert b.ctypes.data != address
    np.testing.assert_array_equal(b, second)
    # the alias still reads x's bytes: nothing wrote over them
    np.testing.assert_array_equal(as_array(kept), as_array(alias(first.copy())))
    addresses = {address, b.ctypes.data}
    del kept, b
    c = y.numpy()  # every alias died: one of the two cached arrays again
    assert c.ctypes.data in addresses
    np.testing.assert_array_equal(c, second)


def as_array(value: Any) -> np.ndarray:
    return np.asarray(value[0] if isinstance(value, list) else value)


@pytest.mark.parametrize("weak", ["ref", "WeakValueDictionary"])
def test_an_array_still_weakly_referenced_is_not_reused(
    client: Any, cache: host_cache.HostBufferCache, weak: str
) -> None:
    # a weak reference is not counted by sys.getrefcount, yet it still reaches the array
    # (the cache keeps it alive): handing it out again would rewrite what it reads
    first, second = values(0), values(1)
    x, y = client.tensor(first), client.tensor(second)
    a = x.numpy()
    ref: Callable[[], np.ndarray | None]
    if weak == "ref":
        ref = weakref.ref(a)
    else:
        memo: weakref.WeakValueDictionary[str, np.ndarray] = weakref.WeakValueDictionary()
        memo["x"] = a
        ref = functools.partial(memo.get, "x")
    del a
    b = y.numpy()
    np.testing.assert_array_equal(b, second)
    reached = ref()
    if reached is not None:  # still reachable: it must still hold x's bytes
        assert reached is not b
        np.testing.assert_array_equal(reached, first)


def test_the_cache_is_bounded_in_count_and_bytes(
    client: Any, cache: host_cache.HostBufferCache
) -> None:
    x = client.tensor(values(0))
    kept = [x.numpy() for _ in range(5)]  # all alive: five arrays, the cache keeps three
    assert len({a.ctypes.data for a in kept}) == 5
    assert cache.cached() == (3, 3 * x.nbytes)
    del kept
    big = client.tensor(values(1, ELEMENTS * 65))  # over max_bytes: never cached
    b = big.numpy()
    assert cache.cached() == (3, 3 * x.nbytes)
    del b
    cache.max_bytes = 2 * x.nbytes  # the next array made trims the oldest
    y = client.tensor(values(2, ELEMENTS * 2))
    c = y.numpy()
    assert cache.cached() == (1, 2 * x.nbytes)
    np.testing.assert_array_equal(c, values(2, ELEMENTS * 2))


def test_a_cache_of_zero_bytes_keeps_nothing(client: Any, monkeypatch: Any) -> None:
    monkeypatch.setenv(host_cache.NUMPY_CACHE_ENV, "0")
    off = host_cache.HostBufferCache(host_cache.numpy_cache_bytes(), host_cache.NUMPY_CACHE_COUNT)
    monkeypatch.setattr(host_cache, "numpy_cache", off)
    x = client.tensor(values(0))
    a = x.numpy()
    del a
    assert off.cached() == (0, 0)
    monkeypatch.setenv(host_cache.NUMPY_CACHE_ENV, "")
    assert host_cache.numpy_cache_bytes() == host_cache.NUMPY_CACHE_DEFAULT_BYTES


def test_the_default_bound_is_an_eighth_of_memory_within_its_limits() -> None:
    GiB = 1 << 30
    assert host_cache.default_numpy_cache_bytes(24 * GiB) == 2 * GiB  # capped
    assert host_cache.default_numpy_cache_bytes(8 * GiB) == GiB
    assert host_cache.default_numpy_cache_bytes(1 * GiB) == 256 << 20  # the floor
    assert host_cache.default_numpy_cache_bytes(0) == 256 << 20  # unknown memory
    assert host_cache.default_numpy_cache_bytes() == host_cache.NUMPY_CACHE_DEFAULT_BYTES


@pytest.mark.slow
def test_a_1_gib_download_reuses_its_destination_under_the_default_bound(
    client: Any, monkeypatch: Any
) -> None:
    """A 1 GiB download, over the smallest default bound (256 MiB), pays a fresh array's
    page faults at every x.numpy() unless cached: under a bound that takes it, the next
    x.numpy() of the same shape gets the same, dropped array back."""
    big = host_cache.HostBufferCache(
        host_cache.default_numpy_cache_bytes(8 << 30), host_cache.NUMPY_CACHE_COUNT
    )
    monkeypatch.setattr(host_cache, "numpy_cache", big)
    x = client.zeros(300 << 18, dtype=tensord.float32)  # 300 MiB: over the old bound
    a = x.numpy()
    address = a.ctypes.data
    del a
    b = x.numpy()
    assert b.ctypes.data == address
    assert big.cached()[1] == 300 << 20


def test_threads_never_share_an_array(client: Any, cache: host_cache.HostBufferCache) -> None:
    tensors = [client.tensor(values(seed)) for seed in range(4)]
    errors: list[BaseException] = []

    def download(seed: int) -> None:
        try:
            for _ in range(10):
                a = tensors[seed].numpy()
                np.testing.assert_array_equal(a, values(seed))
                del a
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=download, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads)
    assert cache.cached()[0] <= 3


def test_an_array_resized_in_place_leaves_the_cache(
    client: Any, cache: host_cache.HostBufferCache
) -> None:
    # resize(refcheck=False) reallocates an array the cache holds: its size is no longer
    # the one recorded, so the byte count (and the bound on it) would drift
    x = client.tensor(values(0))
    a = x.numpy()
    a.resize((2 * ELEMENTS,), refcheck=False)
    assert cache.cached() == (0, 0)
    y = client.tensor(values(1, 2 * ELEMENTS))
    del a
    b = y.numpy()  # of the resized array's shape: a new one, recorded at its size
    np.testing.assert_array_equal(b, values(1, 2 * ELEMENTS))
    assert cache.cached() == (1, b.nbytes)
    b.resize((ELEMENTS // 2,), refcheck=False)
    del b
    cache.clear()
    assert cache.cached() == (0, 0)


def test_a_finalizer_calling_numpy_inside_the_cache_does_not_deadlock(
    client: Any, cache: host_cache.HostBufferCache, monkeypatch: Any
) -> None:
    x, y = client.tensor(values(0)), client.tensor(values(1))
    outer: list[np.ndarray] = []
    inner: list[np.ndarray] = []

    class Cycle:
        """Garbage only a collection frees; its finalizer downloads y."""

        def __init__(self) -> None:
            self.me = self

        def __del__(self) -> None:
            inner.append(y.numpy())

    search = host_cache._first_free

    def collecting_search(*args: Any) -> Any:
        # as an automatic collection inside the cache's critical section would
        if not inner and not outer:
            Cycle()
            gc.collect()
        return search(*args)

    monkeypatch.setattr(host_cache, "_first_free", collecting_search)
    thread = threading.Thread(target=lambda: outer.append(x.numpy()), daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "x.numpy() waited on its own thread's cache lock"
    assert len(outer) == len(inner) == 1 and outer[0] is not inner[0]
    np.testing.assert_array_equal(outer[0], values(0))
    np.testing.assert_array_equal(inner[0], values(1))
    assert cache.cached() == (1, x.nbytes)  # the nested one went uncached


def test_a_forked_child_starts_with_an_empty_cache(client: Any) -> None:
    x = client.tensor(values(0))
    a = x.numpy()
    del a
    assert host_cache.numpy_cache.cached()[0] >= 1
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what its cache holds, and nothing else
        try:
            os.write(write, str(host_cache.numpy_cache.cached()).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        answer = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert answer == "(0, 0)"


def test_the_reference_count_probe_sees_one_more_reference() -> None:
    """Run in a fresh interpreter: _FREE_REFS is measured at import, and a held array shows."""
    script = (
        "import collections, numpy as np\n"
        "from tensord.local import host_cache\n"
        "d = collections.OrderedDict(); d[0] = (np.empty(4, np.uint8), 4)\n"
        "assert host_cache._first_free(d, (4,), np.dtype(np.uint8), host_cache._FREE_REFS) is d[0][0]\n"
        "held = d[0][0]\n"
        "assert host_cache._first_free(d, (4,), np.dtype(np.uint8), host_cache._FREE_REFS) is None\n"
    )
    path = os.pathsep.join([str(REPO / "client"), str(REPO / "server")])
    done = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
