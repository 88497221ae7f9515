"""File descriptors: a server at its limit says so (never "out of memory"), keeps its pool
consistent and serves again once descriptors come back; `tensord serve` raises its soft limit.

Exhausting descriptors happens in a child process under a lowered soft limit: pytest's own
process (its servers' threads) keeps every descriptor it may need."""

from __future__ import annotations

import errno
import json
import logging
import os
import resource
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import STARTUP_TIMEOUT_S
from tensord import schema as pb
from tensord.local import channel
from tensord_server.devices.descriptors import (
    DescriptorBudget,
    default_reserve,
)
from tensord_server.devices.shm import segment_error
from tensord_server.pool import BackendOutOfDescriptors, BackendOutOfMemory
from tensord_server.rpc.fd_socket import ACCEPT_POLL_S

REPO = Path(__file__).resolve().parents[2]
MiB = 1 << 20
CHILD_TIMEOUT_S = 60

# In the child: a shared host pool with one small segment, the soft limit lowered to a
# few descriptors above those open, then every descriptor but ``spare`` taken.
EXHAUSTED_POOL = """
import errno, json, os, resource
from tensord.errors import OutOfMemoryError, ResourceExhaustedError
from tensord_server.devices.shm import SharedHostBackend
from tensord_server.pool import CachingPool

def open_count():
    return len(os.listdir("/proc/self/fd")) - 1

backend = SharedHostBackend(total_bytes=256 << 20)
pool = CachingPool(backend)
kept = pool.malloc(1 << 20)  # a small segment (2 MiB) with room left in it
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (open_count() + 32, hard))
hogs = []
try:
    while True:
        hogs.append(os.open(os.devnull, os.O_RDONLY))
except OSError as exc:
    assert exc.errno == errno.EMFILE, exc
for _ in range(SPARE):
    os.close(hogs.pop())
before = open_count() if SPARE else None
result = {"segments": backend.live_segments()}
try:
    pool.malloc(8 << 20)  # the large pool: a new 8 MiB segment
except OutOfMemoryError as exc:
    result["error"] = ["OutOfMemoryError", str(exc)]
except ResourceExhaustedError as exc:
    result["error"] = [type(exc).__name__, str(exc)]
result["leaked"] = None if before is None else open_count() - before
pool.assert_invariants()
result["segments_after"] = backend.live_segments()
result["stats"] = {k: pool.memory_stats()[k] for k in ("num_ooms", "segment.all.current")}
small = pool.malloc(4096)  # served from the small segment's free bytes: no descriptor needed
result["small_in_kept_segment"] = pool.memory_stats()["segment.all.current"] == 1
for fd in hogs:
    os.close(fd)
big = pool.malloc(8 << 20)
pool.assert_invariants()
result["served_after"] = pool.memory_stats()["segment.all.current"]
for block in (big, small, kept):
    pool.free(block)
pool.assert_invariants()
print(json.dumps(result))
"""


def run_child(script: str) -> dict[str, Any]:
    path = os.pathsep.join([str(REPO / "client"), str(REPO / "server")])
    done = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


@pytest.mark.parametrize(
    "spare",
    [0, 1],
    ids=["no descriptor for the memfd", "a memfd but none for its mapping"],
)
def test_a_segment_without_descriptors_fails_naming_them_and_the_pool_serves_again(
    spare: int,
) -> None:
    """With no descriptor left, a new memfd segment (or mmap's copy of its descriptor) fails:
    the pool said "out of memory" with nearly all of its capacity free.  Now the error names
    descriptors and the counts, no segment is half made (its memfd closed), the invariants
    hold, and once descriptors are freed the same allocation succeeds."""
    result = run_child(EXHAUSTED_POOL.replace("SPARE", str(spare)))
    kind, message = result["error"]
    assert kind == "ResourceExhaustedError", message
    assert "out of file descriptors" in message and "not out of memory" in message
    assert "open, limit" in message
    assert result["segments"] == result["segments_after"] == 1
    assert result["stats"] == {"num_ooms": 0, "segment.all.current": 1}
    if spare:
        assert result["leaked"] == 0  # the memfd made before mmap failed is closed
    assert result["small_in_kept_segment"]
    assert result["served_after"] == 2


def test_descriptor_errors_of_the_host_and_of_the_process_are_named_apart() -> None:
    own = segment_error("memfd_create failed", OSError(errno.EMFILE, "Too many open files"))
    host = segment_error("memfd_create failed", OSError(errno.ENFILE, "Too many open files"))
    memory = segment_error("memfd_create failed", OSError(errno.ENOMEM, "Cannot allocate"))
    assert isinstance(own, BackendOutOfDescriptors) and isinstance(host, BackendOutOfDescriptors)
    assert str(own).startswith("the server is out of file descriptors (")
    assert str(host).startswith("the host is out of file descriptors (its file table is full")
    assert isinstance(memory, BackendOutOfMemory) and "Cannot allocate" in str(memory)


def test_the_budget_keeps_its_reserve_from_connections() -> None:
    budget = DescriptorBudget(reserve=10)
    open_now = budget.in_use()
    assert 0 < open_now <= budget.limit
    assert budget.connection_limit() == budget.limit - 10
    assert budget.may_accept() == (open_now + 1 <= budget.limit - 10)
    assert budget.connections_left() == max(budget.limit - 10 - open_now, 0)
    assert not DescriptorBudget(reserve=budget.limit).may_accept()
    assert f"limit {budget.limit}" in budget.describe()
    # at least 256 kept, a quarter of a large limit, never more than half of a small one
    assert [default_reserve(n) for n in (1024, 65536, 300)] == [256, 16384, 150]
    with pytest.raises(ValueError, match="reserve"):
        DescriptorBudget(reserve=-1)


def test_the_fd_socket_says_it_is_out_of_descriptors(
    fresh_server: Any, open_session: Any, monkeypatch: Any
) -> None:
    """A ticket redeemed while the server cannot duplicate the segment's descriptor is answered
    with the reason (the connection was closed unanswered: "the fd socket said nothing")."""
    session = open_session(fresh_server.address)
    x = session.upload(np.arange(1000, dtype=np.float32))
    answer = session.Export(pb.ExportRequest(handle=x.handle), metadata=session.md)
    assert answer.ticket and answer.fd_socket

    def no_descriptor(segment_id: int) -> int:
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    monkeypatch.setattr(fresh_server.daemon.devices.get("cpu").backend, "dup_fd", no_descriptor)
    with pytest.raises(OSError, match="the server is out of file descriptors"):
        channel.receive_segment_fd(answer.fd_socket, answer.ticket, answer.segment_nbytes)


@pytest.mark.slow
def test_the_fd_socket_waits_for_descriptors_rather_than_spinning(
    fresh_server: Any, monkeypatch: Any, caplog: Any
) -> None:
    """At the limit the fd socket's accept fails at once while the connection stays queued:
    the loop retried at once, thousands of times a second, until a descriptor was freed.
    Now it waits a poll interval between tries and logs the shortage once."""
    fd = fresh_server.fd_socket
    listener = fd._listener
    tries: list[None] = []

    class NoDescriptors:
        def accept(self) -> Any:
            tries.append(None)
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

        def __getattr__(self, name: str) -> Any:
            return getattr(listener, name)

    queued = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with caplog.at_level(logging.WARNING, logger="tensord_server.rpc.fd_socket"):
        monkeypatch.setattr(fd, "_listener", NoDescriptors())
        queued.connect(fd.path)  # the listener is readable from now on
        time.sleep(1.0)
        monkeypatch.undo()
    queued.close()
    assert 1 <= len(tries) <= 1.0 / ACCEPT_POLL_S + 2
    said = [r.getMessage() for r in caplog.records if "out of file descriptors" in r.getMessage()]
    assert len(said) == 1, said


@pytest.mark.slow
def test_serve_raises_its_soft_descriptor_limit_to_the_hard_limit() -> None:
    """`tensord serve` started with a soft limit of 256 runs with the hard limit, and logs it."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = 256
    if hard == resource.RLIM_INFINITY or hard <= low:
        pytest.skip(f"the hard descriptor limit ({hard}) is not above {low}")
    script = textwrap.dedent(
        f"""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_NOFILE, ({low}, {hard}))
        from tensord_server.cli import main
        sys.exit(main(["serve", "--address", "127.0.0.1:0", "--device", "cpu=64MiB"]))
        """
    )
    path = os.pathsep.join([str(REPO / "client"), str(REPO / "server")])
    process = subprocess.Popen(
        [sys.executable, "-c", script],
        env={**os.environ, "PYTHONPATH": path},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout = process.stdout
        assert stdout is not None
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.append(stdout.readline()))
        reader.start()
        reader.join(STARTUP_TIMEOUT_S)
        assert lines and lines[0].startswith("tensord listening on "), lines
        limits = Path(f"/proc/{process.pid}/limits").read_text()
        row = next(r for r in limits.splitlines() if r.startswith("Max open files"))
        assert row.split()[3:5] == [str(hard), str(hard)], row
    finally:
        process.terminate()  # SIGTERM: a graceful stop, its log written out
        try:
            _out, err = process.communicate(timeout=STARTUP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            _out, err = process.communicate(timeout=STARTUP_TIMEOUT_S)
    assert f"file descriptor limit raised from {low} to the hard limit {hard}" in err


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_pool_dropped_without_releasing_its_segments_closes_their_descriptors() -> None:
    """A shared host pool collected with segments still reserved (an embedding program's,
    or a test's, never emptied) closes their memfds: each kept one descriptor open for the
    process's life.  A segment released first is closed once only (its number, reused by
    another file since, is never closed again)."""
    import gc

    from tensord_server.devices.shm import SharedHostBackend
    from tensord_server.pool import CachingPool

    gc.collect()
    before = open_descriptors()
    pool = CachingPool(SharedHostBackend(total_bytes=256 * MiB))
    blocks = [pool.malloc(size) for size in (1 * MiB, 4 * MiB, 30 * MiB)]  # three segments
    assert open_descriptors() >= before + 3
    released = pool.malloc(64 * MiB)
    pool.free(released)
    pool.empty_cache()  # its segment's descriptor closed by the release
    reused = os.open(os.devnull, os.O_RDONLY)  # likely the number the release freed
    try:
        del pool, blocks, released
        gc.collect()
        assert open_descriptors() == before + 1  # only ``reused`` is left open
        os.fstat(reused)  # still open: the collected segments closed their own numbers
    finally:
        os.close(reused)


def test_a_same_host_client_cannot_resize_a_segment_it_was_handed() -> None:
    """A same-host client is handed the memfd of the segment its tensor lies in; one that
    truncated it made the server's next touch of that segment a SIGBUS that killed the
    server and every tenant's data with it.  A segment's size is sealed before any client
    holds it: truncating, growing or sealing it further is refused, and the server serves
    on (here in a subprocess: an unsealed segment would take pytest down with it)."""
    from conftest import start_serve_process
    from tensord.local import channel as local_channel

    process, address = start_serve_process("--address", "127.0.0.1:0", "--device", "cpu=64MiB")
    received: list[int] = []
    receive = local_channel.receive_segment_fd

    def keeping(*args: Any) -> int:
        fd = receive(*args)
        received.append(os.dup(fd))
        return fd

    try:
        local_channel.receive_segment_fd = keeping
        import tensord

        with tensord.connect(address) as client:
            x = client.from_numpy(np.arange(1 << 16, dtype=np.float32))
            assert np.array_equal(x.numpy(), np.arange(1 << 16, dtype=np.float32))
            assert received, "the read took no segment descriptor (same-host mapping off?)"
            for fd in received:
                for size in (0, 1 << 30):  # shrunk (the SIGBUS) or grown
                    with pytest.raises(PermissionError):
                        os.ftruncate(fd, size)
            with tensord.connect(address, local=False) as other:
                assert np.array_equal(other.from_numpy(np.ones(4, np.float32)).numpy(), np.ones(4))
            # the server copies from the segment the client was handed
            assert np.array_equal(x.clone().numpy(), np.arange(1 << 16, dtype=np.float32))
        assert process.poll() is None, f"the server exited with {process.returncode}"
    finally:
        local_channel.receive_segment_fd = receive
        for fd in received:
            os.close(fd)
        process.kill()
        process.communicate(timeout=30)
