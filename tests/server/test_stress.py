"""Stress: several client processes x threads issuing mixed ops through the SDK.

Views, copies, transfers, sharing, frees and deliberate errors for a fixed time,
each process a tenant of its own under a byte quota whose sum exceeds the pool,
so long runs meet both quota refusals and pool OOMs (which compact the pool,
moving Storages while other clients read and write theirs); every read checks
the bytes.  Then: the pool's invariants hold, allocated bytes equal the sum of
the live Storages' blocks, and once every client has left, allocated is 0 and
so is every tenant's ledger.

Bounded by ``TENSORD_STRESS_SECONDS`` (default 12, the CI setting; e.g. 300 for a
long run); ``TENSORD_STRESS_PROCS`` x ``TENSORD_STRESS_THREADS`` clients (3 x 3).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from conftest import server_allocated, wait_until
from tensord_server.domain.quotas import QuotaSpec

STRESS_SECONDS = float(os.environ.get("TENSORD_STRESS_SECONDS", "12"))
PROCS = int(os.environ.get("TENSORD_STRESS_PROCS", "3"))
THREADS = int(os.environ.get("TENSORD_STRESS_THREADS", "3"))

CHILD = textwrap.dedent(
    """
    import random, sys, threading, time
    import numpy as np
    import tensord

    address, seconds, threads, seed = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    client = tensord.connect(address, token=f"tok-{seed}")
    counts = {"ops": 0, "errors": 0, "refused": 0}
    lock = threading.Lock()
    failures = []

    def worker(k):
        rng = random.Random(seed * 100 + k)
        kept = []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            op = rng.randrange(10)
            try:
                if op == 0 or not kept:
                    n = rng.choice((1, 16, 1000, 1 << 16))
                    a = np.arange(n, dtype=np.float32)
                    t = client.tensor(a)
                    kept.append((t, a))
                elif op == 1:
                    t, a = rng.choice(kept)
                    assert np.array_equal(t.numpy(), a), "bytes changed"
                elif op == 2:
                    t, a = rng.choice(kept)
                    kept.append((t.clone(), a.copy()))
                elif op == 3:
                    t, a = rng.choice(kept)
                    n = a.shape[0]
                    kept.append((t.narrow(0, 0, max(n // 2, 1)), a[: max(n // 2, 1)]))
                elif op == 4:
                    t, a = rng.choice(kept)
                    if a.ndim == 1 and a.shape[0] % 4 == 0:
                        kept.append((t.view(4, -1).t().contiguous(), a.reshape(4, -1).T.copy()))
                elif op == 5:
                    t, a = rng.choice(kept)
                    kept.append((client.attach(t.share()), a))
                elif op == 6 and len(kept) > 1:
                    kept.pop(rng.randrange(len(kept)))
                elif op == 7:
                    t, a = rng.choice(kept)
                    kept.append((t.to(dtype=tensord.float64), a.astype(np.float64)))
                elif op == 8:
                    t, a = rng.choice(kept)
                    try:
                        t.view(-1, 7, 3, 5)  # deliberate error
                    except RuntimeError:
                        with lock:
                            counts["errors"] += 1
                    try:
                        client.empty(1 << 40)  # deliberate OOM
                    except RuntimeError:
                        with lock:
                            counts["errors"] += 1
                else:
                    t, a = rng.choice(kept)
                    if a.size <= 1 << 20:  # cat doubles: bound the growth
                        kept.append((client.cat([t, t]), np.concatenate([a, a])))
                if len(kept) > 24:
                    del kept[: len(kept) - 24]
                with lock:
                    counts["ops"] += 1
            except tensord.ResourceExhaustedError:
                # the pool or the quota is full (long runs accumulate): expected; free some
                with lock:
                    counts["refused"] += 1
                del kept[: len(kept) // 2]
            except Exception as exc:
                failures.append(repr(exc))
                return

    pool = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    print(counts["ops"], counts["errors"], counts["refused"], len(failures), failures[:3], flush=True)
    client.close()
    """
)


# Each tenant may hold half the pool: one heavy tenant meets its quota, all of them the pool.
STRESS_POOL = 64 << 20
STRESS_QUOTA = QuotaSpec("*", "cpu", STRESS_POOL // 2)


@pytest.mark.slow
def test_clients_by_processes_and_threads_leave_a_consistent_pool(make_server) -> None:
    server = make_server(
        devices=(f"cpu={STRESS_POOL}",),
        auth_tokens={f"tok-{i}": f"t{i}" for i in range(PROCS)},
        quotas=[STRESS_QUOTA],
        # a client's close has one short deadline (exit never hangs on a busy server); a
        # close that ran out of it under this load leaves its session to the reaper, so the
        # reaper's clock is short here
        lease=5.0,
        session_grace=5.0,
    )
    children = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                CHILD,
                server.address,
                str(STRESS_SECONDS),
                str(THREADS),
                str(i),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(PROCS)
    ]
    ops = errors = refused = 0
    for child in children:
        out, err = child.communicate(timeout=STRESS_SECONDS + 120)
        assert child.returncode == 0, err
        done, deliberate, full, failed, first = out.strip().split(" ", 4)
        assert failed == "0", first
        ops += int(done)
        errors += int(deliberate)
        refused += int(full)
    stats = server.daemon.devices.get("cpu").pool.memory_stats()
    print(
        f"stress: {PROCS} processes x {THREADS} threads, {ops} ops, {errors} deliberate errors, "
        f"{refused} refused by the pool or the quota, {stats['num_ooms']} pool OOMs, "
        f"{stats['num_compactions']} compactions moving {stats['compaction_moved_bytes']} bytes"
    )
    assert ops > PROCS * THREADS
    for device in server.daemon.devices:
        device.pool.assert_invariants()
    # every client closed its session: nothing is left
    assert wait_until(lambda: server_allocated(server) == 0, 30.0)
    assert len(server.daemon.storages) == 0
    ledger = server.daemon.storages.ledger
    assert [ledger.usage(f"t{i}", "cpu").current for i in range(PROCS)] == [0] * PROCS
    assert wait_until(lambda: server.daemon.sessions.session_ids() == [], 30.0)


def test_allocated_equals_the_live_storages_blocks_mid_run(make_server) -> None:
    import tensord

    server = make_server()
    with tensord.connect(server.address) as client:
        kept = [client.zeros(n) for n in (1, 100, 300_000, 5_000_000)]
        kept.append(kept[2].clone().narrow(0, 5, 10))
        live = sum(s.block.size for s in server.daemon.storages.live())
        assert server_allocated(server) == live > 0
        del kept
    assert wait_until(lambda: server_allocated(server) == 0, 30.0)
