"""Several processes on one server: sharing by token and by name, a client killed with
SIGKILL giving all its memory back after the grace, and 8 threads through one Client."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import numpy as np
import pytest
import tensord
from conftest import client_allocated, run_client_child, wait_until

WAIT_S = 30.0  # bound on every poll below: far above what any of them needs


def run_child(address: str, code: str, *args: str, timeout: float = 60.0) -> str:
    """Run ``code`` in a fresh interpreter with ``client`` connected; return its stdout."""
    return run_client_child(address, code, *args, imports="numpy as np", timeout=timeout)


@pytest.mark.slow
def test_two_processes_share_a_storage_by_token(client: tensord.Client) -> None:
    x = client.zeros(4, 5)
    token = x.share()
    out = run_child(
        client.address,
        """
        y = client.attach(sys.argv[2])
        print(y.tolist()[0][0], y.untyped_storage().storage_id)
        y[1:3] = 7.0          # the other process writes...
        """,
        token,
    )
    first, storage_id = out.split()
    assert float(first) == 0.0 and storage_id == x.untyped_storage().storage_id
    expected = np.zeros((4, 5), np.float32)
    expected[1:3] = 7.0
    np.testing.assert_array_equal(x.numpy(), expected)  # ...and this one sees it
    x[0, 0] = 42.0
    again = run_child(client.address, "print(client.attach(sys.argv[2])[0, 0].item())", x.share())
    assert float(again) == 42.0


@pytest.mark.slow
def test_two_processes_share_a_storage_by_name(client: tensord.Client) -> None:
    name = f"test-share-{os.getpid()}-{time.monotonic_ns()}"
    run_child(
        client.address,
        """
        client.put(sys.argv[2], client.arange(10).view(2, 5))
        """,
        name,
    )
    assert name in client.names()  # the name outlives the process that made it
    y = client.get(name)
    assert y.tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    y.t()[4] = -1
    out = run_child(client.address, "print(client.get(sys.argv[2]).tolist())", name)
    assert out == "[[0, 1, 2, 3, -1], [5, 6, 7, 8, -1]]"
    client.delete(name)
    assert name not in client.names()
    with pytest.raises(tensord.NotFoundError):
        client.get(name)


@pytest.mark.slow
def test_a_killed_client_returns_all_its_memory_after_the_grace(make_server: Any) -> None:
    # the SDK heartbeats at lease/3: a killed client is lost once its short lease lapses,
    # and released half a second (the grace) later
    fresh_server = make_server(lease=1.0)
    with tensord.connect(fresh_server.address) as observer:
        baseline = client_allocated(observer)
        child = subprocess.Popen(
            [
                sys.executable,
                "-c",
                textwrap.dedent(
                    """
                    import sys, time, tensord
                    client = tensord.connect(sys.argv[1])
                    keep = [client.empty(1 << 20, dtype=tensord.dtypes.uint8) for _ in range(8)]
                    keep += [client.zeros(100, 100), client.arange(1000).view(10, 100).t()]
                    keep.append(keep[0].narrow(0, 0, 10))
                    keep.append(client.attach(keep[1].share()))
                    print("ready", flush=True)
                    time.sleep(600)
                    """
                ),
                fresh_server.address,
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == "ready"
            assert client_allocated(observer) >= baseline + 8 * (1 << 20)
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=WAIT_S)
            if child.stdout is not None:
                child.stdout.close()
        assert wait_until(lambda: client_allocated(observer) == baseline, WAIT_S), (
            f"allocated {client_allocated(observer)} bytes, baseline {baseline}"
        )


@pytest.mark.slow
def test_eight_threads_through_one_client_leave_the_server_consistent(fresh_server: Any) -> None:
    failures: list[BaseException] = []
    with tensord.connect(fresh_server.address) as client:
        baseline = client_allocated(client)

        def work(seed: int) -> None:
            try:
                rng = np.random.default_rng(seed)
                for i in range(15):
                    a = rng.standard_normal((8, 16)).astype(np.float32)
                    x = client.tensor(a)
                    np.testing.assert_array_equal(x.t().contiguous().numpy(), a.T)
                    y = x.view(16, 8).narrow(0, 2, 4).clone()
                    np.testing.assert_array_equal(y.numpy(), a.reshape(16, 8)[2:6])
                    z = tensord.cat([x, x.clone()], 1)
                    assert tuple(z.shape) == (8, 32)
                    x[0] = float(i)
                    assert x[0, 5].item() == float(i)
                    name = f"thread-{seed}-{i}"
                    client.put(name, z)
                    assert client.get(name).shape == (8, 32)
                    client.delete(name)
                    s = client.arange(100).view(10, 10).permute(1, 0).reshape(100)
                    assert s[:3].tolist() == [0, 10, 20]
            except BaseException as e:  # reported by the main thread
                failures.append(e)

        threads = [threading.Thread(target=work, args=(seed,)) for seed in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not any(thread.is_alive() for thread in threads)
        assert not failures, failures[0]
        # every tensor above is garbage now: its release goes out in a batch
        client.flush()
        assert wait_until(lambda: client_allocated(client) == baseline, WAIT_S), (
            f"allocated {client_allocated(client)} bytes, baseline {baseline}"
        )
        stats = client.memory_stats()
        assert stats["allocated_bytes.all.current"] <= stats["reserved_bytes.all.current"]
        fresh_server.daemon.devices.get("cpu").pool.assert_invariants()
