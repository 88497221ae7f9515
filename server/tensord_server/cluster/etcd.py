"""Blocking calls to etcd's v3 API over gRPC, failing over between the cluster's endpoints.

The messages and stubs are etcd's own ``rpc.proto``, generated and packaged by ``aetcd``
(the ``cluster`` extra); this module calls them on a plain (blocking) gRPC channel, so a
call is one round trip with a deadline and needs no event loop.  Every failure to reach
etcd becomes :class:`tensord.errors.ClusterUnavailableError`, naming the endpoint.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, TypeVar

import grpc
from aetcd import rpc  # etcd's generated v3 messages and stubs
from tensord.errors import ClusterUnavailableError

T = TypeVar("T")

# Every call to etcd gets this long; an etcd that does not answer in it is unreachable.
CALL_TIMEOUT_S = 2.0
# Status codes that mean "this endpoint is not answering": try the next one.
_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# etcd's compare targets and results (rpc.proto's Compare)
CREATE = rpc.Compare.CREATE
MOD = rpc.Compare.MOD
EQUAL = rpc.Compare.EQUAL


class Read(NamedTuple):
    """One key as read: its value (None: no such key), the revision it was last changed
    at (0 for none) and the revision it was read at."""

    value: bytes | None
    revision: int
    read_at: int


class Listing(NamedTuple):
    """A range as read: its keys and values, whether more follow, the newest revision any
    of them was changed at, and the revision it was read at."""

    kvs: list[tuple[bytes, bytes]]
    more: bool
    revision: int
    read_at: int


class Watched(NamedTuple):
    """One answer of a watch: its header's revision and its events (rpc.Event)."""

    revision: int
    events: list[Any]


class Stubs(NamedTuple):
    """One endpoint's channel and etcd's services on it."""

    endpoint: str
    channel: grpc.Channel
    kv: Any  # rpc.KVStub
    lease: Any  # rpc.LeaseStub
    watch: Any  # rpc.WatchStub


def prefix_end(prefix: bytes) -> bytes:
    """The range end that makes ``[prefix, end)`` every key starting with ``prefix``
    (etcd's clientv3.GetPrefixRangeEnd)."""
    end = bytearray(prefix)
    for i in reversed(range(len(end))):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\0"  # every key


class Etcd:
    """An etcd cluster at ``endpoints`` (HOST:PORT each).  Thread-safe: calls from many
    threads share the current endpoint's channel; one that cannot reach it moves every
    caller on to the next."""

    def __init__(self, endpoints: list[str], timeout: float = CALL_TIMEOUT_S) -> None:
        self.endpoints = list(endpoints)
        self.timeout = timeout
        self._lock = threading.Lock()
        self._index = 0
        self._stubs = self._open(self.endpoints[0])
        self._watching: Any = None  # the watch stream being read (to cancel it)

    @staticmethod
    def _open(endpoint: str) -> Stubs:
        channel = grpc.insecure_channel(endpoint)
        return Stubs(
            endpoint,
            channel,
            rpc.KVStub(channel),
            rpc.LeaseStub(channel),
            rpc.WatchStub(channel),
        )

    @property
    def stubs(self) -> Stubs:
        with self._lock:
            return self._stubs

    def _fail_over(self, failed: Stubs) -> None:
        """Move on from ``failed`` to the next endpoint (unless another caller did)."""
        with self._lock:
            if self._stubs is not failed or len(self.endpoints) == 1:
                return
            self._index = (self._index + 1) % len(self.endpoints)
            self._stubs = self._open(self.endpoints[self._index])
        failed.channel.close()

    def call(self, what: str, fn: Callable[[Stubs], T], fail_over: bool = True) -> T:
        """``fn(stubs)``, retried once on each other endpoint while etcd is unreachable;
        ClusterUnavailableError (``what`` failed, and why) when none answers.

        Without ``fail_over``, ``fn`` is tried once, on the current endpoint, and its
        failure moves no caller on: a call with a deadline shorter than the client's (a
        quick look) that runs out says nothing about the endpoint, which may be healthy
        but slower than that deadline, and failing it over would close the channel that
        the watch, the lease's renewals and every other call in flight share."""
        error: grpc.RpcError | None = None
        for _ in self.endpoints if fail_over else self.endpoints[:1]:
            stubs = self.stubs
            try:
                return fn(stubs)
            except grpc.RpcError as err:
                code = err.code() if isinstance(err, grpc.Call) else None
                if code not in _UNREACHABLE:
                    raise ClusterUnavailableError(
                        f"{what}: etcd at {stubs.endpoint} refused it: {_describe(err)}"
                    ) from None
                if not fail_over:
                    raise ClusterUnavailableError(
                        f"{what}: etcd at {stubs.endpoint} did not answer in time: {_describe(err)}"
                    ) from None
                error = err
                self._fail_over(stubs)
        raise ClusterUnavailableError(
            f"{what}: cannot reach etcd ({', '.join(self.endpoints)}): {_describe(error)}; "
            "this node's own tensors keep working"
        ) from None

    # ---- the calls tensord makes ---------------------------------------------------

    def grant(self, ttl: int) -> int:
        """A new lease of ``ttl`` seconds; its id."""
        request = rpc.LeaseGrantRequest(TTL=ttl)
        answer = self.call(
            "granting a lease", lambda s: s.lease.LeaseGrant(request, timeout=self.timeout)
        )
        return int(answer.ID)

    def keep_alive(self, lease: int) -> int:
        """Renew ``lease`` once; its remaining TTL (0: etcd no longer has it)."""

        def renew(s: Stubs) -> int:
            requests = iter([rpc.LeaseKeepAliveRequest(ID=lease)])
            for answer in s.lease.LeaseKeepAlive(requests, timeout=self.timeout):
                return int(answer.TTL)
            return 0

        return self.call("renewing this node's lease", renew)

    def revoke(self, lease: int) -> None:
        """End ``lease`` now: every key bound to it is deleted."""
        request = rpc.LeaseRevokeRequest(ID=lease)
        self.call("revoking a lease", lambda s: s.lease.LeaseRevoke(request, timeout=self.timeout))

    def create(self, key: bytes, value: bytes, lease: int) -> tuple[bool, int, bytes]:
        """Put ``key`` bound to ``lease`` if it does not exist: (created, the revision,
        the existing value when it did exist)."""
        request = rpc.TxnRequest(
            compare=[rpc.Compare(key=key, target=CREATE, result=EQUAL, create_revision=0)],
            success=[rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=value, lease=lease))],
            failure=[rpc.RequestOp(request_range=rpc.RangeRequest(key=key))],
        )
        answer = self.call("claiming a name", lambda s: s.kv.Txn(request, timeout=self.timeout))
        if answer.succeeded:
            return True, int(answer.header.revision), b""
        kvs = answer.responses[0].response_range.kvs
        return False, int(answer.header.revision), bytes(kvs[0].value) if kvs else b""

    def put(self, key: bytes, value: bytes, lease: int) -> int:
        """Put ``key`` bound to ``lease`` whatever was there; the revision."""
        request = rpc.PutRequest(key=key, value=value, lease=lease)
        answer = self.call("claiming a name", lambda s: s.kv.Put(request, timeout=self.timeout))
        return int(answer.header.revision)

    def delete_if(self, key: bytes, mod_revision: int) -> bool:
        """Delete ``key`` if it was last written at ``mod_revision``; whether it was."""
        request = rpc.TxnRequest(
            compare=[rpc.Compare(key=key, target=MOD, result=EQUAL, mod_revision=mod_revision)],
            success=[rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key))],
        )
        answer = self.call("deleting a name", lambda s: s.kv.Txn(request, timeout=self.timeout))
        return bool(answer.succeeded)

    def get(self, key: bytes) -> bytes | None:
        """``key``'s value (None: no such key)."""
        return self.read(key).value

    def read(self, key: bytes) -> Read:
        """``key``'s value, the revision it was last changed at, and the revision read at."""
        request = rpc.RangeRequest(key=key)
        answer = self.call("looking a name up", lambda s: s.kv.Range(request, timeout=self.timeout))
        at = int(answer.header.revision)
        if not answer.kvs:
            return Read(None, 0, at)
        return Read(bytes(answer.kvs[0].value), int(answer.kvs[0].mod_revision), at)

    def range(
        self, start: bytes, end: bytes, limit: int = 0, keys_only: bool = False
    ) -> tuple[list[tuple[bytes, bytes]], bool]:
        """The keys in ``[start, end)`` in key order, at most ``limit`` (0: all), with their
        values (empty with ``keys_only``); and whether more follow."""
        listed = self.listing(start, end, limit, keys_only)
        return listed.kvs, listed.more

    def listing(
        self,
        start: bytes,
        end: bytes,
        limit: int = 0,
        keys_only: bool = False,
        timeout: float | None = None,
    ) -> Listing:
        """:meth:`range` with the newest ``mod_revision`` among the keys listed and the
        revision read at.  ``timeout``: a deadline for the whole listing (None: the
        client's, failing over between the endpoints); given, it is one try on the current
        endpoint, which no failure of it fails over (see :meth:`call`)."""
        request = rpc.RangeRequest(key=start, range_end=end, limit=limit, keys_only=keys_only)
        deadline = self.timeout if timeout is None else timeout
        answer = self.call(
            "listing",
            lambda s: s.kv.Range(request, timeout=deadline),
            fail_over=timeout is None,
        )
        kvs = [(bytes(kv.key), bytes(kv.value)) for kv in answer.kvs]
        newest = max((int(kv.mod_revision) for kv in answer.kvs), default=0)
        return Listing(kvs, bool(answer.more), newest, int(answer.header.revision))

    def watch(self, prefix: bytes, start_revision: int, prev_kv: bool = False) -> Iterator[Watched]:
        """The events (rpc.Event) under ``prefix`` from ``start_revision`` (0: now), each
        with the key's value before it with ``prev_kv``, a batch at a time, until
        :meth:`stop_watching` or etcd is lost (then ClusterUnavailableError;
        CompactedError for a start etcd has compacted away).  The first batch, with no
        events, says the watch started: every change after its revision is to come."""
        stubs = self.stubs
        create = rpc.WatchCreateRequest(
            key=prefix, range_end=prefix_end(prefix), start_revision=start_revision,
            prev_kv=prev_kv,
        )  # fmt: skip
        ended = threading.Event()

        def requests() -> Iterator[Any]:
            yield rpc.WatchRequest(create_request=create)
            ended.wait()  # the stream stays open while it is read

        answers = stubs.watch.Watch(requests())
        with self._lock:
            self._watching = answers
        try:
            for answer in answers:
                if answer.compact_revision:
                    raise CompactedError(int(answer.compact_revision))
                if answer.canceled:
                    raise ClusterUnavailableError(f"etcd ended the watch: {answer.cancel_reason}")
                if answer.created or answer.events:
                    yield Watched(int(answer.header.revision), list(answer.events))
        except grpc.RpcError as err:
            if isinstance(err, grpc.Call) and err.code() is grpc.StatusCode.CANCELLED:
                return
            self._fail_over(stubs)
            raise ClusterUnavailableError(
                f"watching the names: lost etcd at {stubs.endpoint}: {_describe(err)}"
            ) from None
        finally:
            ended.set()

    def stop_watching(self) -> None:
        """End the watch being read (its iterator returns)."""
        with self._lock:
            answers, self._watching = self._watching, None
        if answers is not None:
            answers.cancel()

    def close(self) -> None:
        self.stubs.channel.close()


class CompactedError(Exception):
    """A watch started before etcd's compacted revision: the events between are gone."""

    def __init__(self, revision: int) -> None:
        super().__init__(f"etcd compacted its history past revision {revision}")
        self.revision = revision


def _describe(err: BaseException | None) -> str:
    if isinstance(err, grpc.Call):
        return f"{err.code().name}: {err.details()}"
    return str(err)
