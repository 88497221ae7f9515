"""Calls this node makes to another node of its cluster: a cross-node copy's stream.

A node call is an ordinary call of the target's schema (an Upload into the caller's
session there) that authenticates with the cluster's shared secret
(``--cluster-token-file``) and names the tenant it acts for, never with a tenant's
token: the target then treats it as that tenant's call, with the same limits (the
tenant's streams, bytes in flight, quotas, handles per session).  Where the target
is comes from etcd's member record, never from the client, so a client cannot point
this node's credential at an address of its choosing.

A node that serves TLS calls the others over TLS, checking each one's certificate against
the cluster's roots (``--cluster-ca``) for the address it registered: the secret and the
tensor bytes are never sent in the clear, and a certificate the roots do not vouch for
fails the call (there is no plaintext fallback).
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

import grpc
from tensord import errors
from tensord import schema as pb
from tensord.protocol import (
    CHECKSUM_KEY,
    ERROR_DETAILS_KEY,
    ERROR_TYPE_KEY,
    MAX_MESSAGE_BYTES,
    NODE_TENANT_KEY,
    NODE_TOKEN_KEY,
    SESSION_KEY,
    UPLOAD_HEADER_KEY,
)

from tensord_server.domain import checksum

# A copy's stream gets this long per MiB beyond its first minute (a slow link still ends).
COPY_BASE_TIMEOUT_S = 60.0
COPY_TIMEOUT_PER_MIB_S = 0.5
# Chunks a copy's source reads ahead of the stream (each at most the copy's chunk size).
COPY_WINDOW_CHUNKS = 4
# The release of a copy that failed its checksum.
RELEASE_TIMEOUT_S = 5.0
_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


class NodeLink:
    """Channels to the other nodes, one per address, opened on first use: TLS checked
    against ``roots`` (PEM) when given, else plaintext.  Thread-safe."""

    def __init__(self, cluster_token: str, roots: bytes | None = None) -> None:
        self._token = cluster_token
        self._credentials = (
            grpc.ssl_channel_credentials(root_certificates=roots) if roots is not None else None
        )
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}

    @property
    def tls(self) -> bool:
        return self._credentials is not None

    def _channel(self, address: str) -> grpc.Channel:
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = self._open(address)
                self._channels[address] = channel
            return channel

    def _open(self, address: str) -> grpc.Channel:
        if self._credentials is None:
            return grpc.insecure_channel(address, options=_CHANNEL_OPTIONS)
        return grpc.secure_channel(address, self._credentials, options=_CHANNEL_OPTIONS)

    def _metadata(self, tenant: str, session_id: str) -> list[tuple[str, Any]]:
        return [
            (NODE_TOKEN_KEY, self._token),
            (NODE_TENANT_KEY, tenant),
            (SESSION_KEY, session_id),
        ]

    def send(
        self,
        node: str,
        address: str,
        tenant: str,
        session_id: str,
        header: pb.UploadHeader,
        chunks: Iterable[bytes],
    ) -> pb.TensorMeta:
        """Upload ``chunks`` to ``node`` at ``address`` into ``session_id`` (``tenant``'s);
        the target's handle once the CRC-32 it computed over the stored bytes equals the
        one of the bytes sent (CopyCorruptedError, the handle released, when not)."""
        channel = self._channel(address)
        upload = channel.stream_unary(
            "/tensord.v1.Tensord/Upload",
            request_serializer=bytes,
            response_deserializer=pb.TensorMeta.FromString,
        )
        header.checksum = True
        metadata = [
            *self._metadata(tenant, session_id),
            (UPLOAD_HEADER_KEY, header.SerializeToString()),
        ]
        timeout = COPY_BASE_TIMEOUT_S + COPY_TIMEOUT_PER_MIB_S * (header.nbytes >> 20)
        window = CopyWindow(COPY_WINDOW_CHUNKS)
        call = upload.future(iter(window), metadata=metadata, timeout=timeout)
        call.add_done_callback(lambda _: window.abort())  # a failed call stops the reads
        try:
            # this thread reads and checksums the next chunks while gRPC's sends the
            # ones before: at most the window's chunks are read ahead of the link
            crc = 0
            for chunk in chunks:
                crc = checksum.crc32(chunk, crc)
                if not window.put(chunk):
                    break  # the call ended: its result says why
            window.close()
            meta = call.result()
        except grpc.RpcError as err:
            raise _error(err, node, address, self.tls) from None
        except BaseException:
            call.cancel()  # the target drops what it got
            raise
        finally:
            window.abort()
        trailers = {k: v for k, v in call.trailing_metadata() or ()}
        stored = trailers.get(CHECKSUM_KEY)
        if stored is None or int(stored) != crc:
            self._release(address, tenant, session_id, meta.handle)
            raise errors.CopyCorruptedError(
                f"the copy on node {node!r} ({address}) does not match the source: CRC-32 "
                f"{stored} stored, {crc} sent; nothing was kept",
                node=node,
            )
        answered: pb.TensorMeta = meta
        return answered

    def _release(self, address: str, tenant: str, session_id: str, handle: str) -> None:
        release = self._channel(address).unary_unary(
            "/tensord.v1.Tensord/Release",
            request_serializer=pb.ReleaseRequest.SerializeToString,
            response_deserializer=pb.ReleaseResponse.FromString,
        )
        # failing, the session's end (or its grace) frees it
        with contextlib.suppress(grpc.RpcError):
            release(
                pb.ReleaseRequest(handles=[handle]),
                metadata=self._metadata(tenant, session_id),
                timeout=RELEASE_TIMEOUT_S,
            )

    def close(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()


class CopyWindow:
    """The chunks of a copy's stream between the thread that reads them from the source
    and gRPC's thread that sends them: at most ``limit`` chunks wait, so the source's
    extra memory is bounded whatever the tensor's size.

    Invariants (under ``_ready``): ``len(_chunks) <= limit``; once ``_aborted`` no chunk
    waits and none is taken in; once ``_closed`` none is added."""

    def __init__(self, limit: int) -> None:
        assert limit >= 1, f"a copy window holds at least one chunk, got {limit}"
        self.limit = limit
        self._chunks: deque[bytes] = deque()
        self._ready = threading.Condition()
        self._closed = False
        self._aborted = False

    def put(self, chunk: bytes) -> bool:
        """Add ``chunk`` once there is room; False (not added): the stream was aborted."""
        with self._ready:
            assert not self._closed, "a chunk put after the copy window was closed"
            self._ready.wait_for(lambda: self._aborted or len(self._chunks) < self.limit)
            if self._aborted:
                return False
            self._chunks.append(chunk)
            self._ready.notify_all()
            return True

    def close(self) -> None:
        """No more chunks: the stream ends once the waiting ones are sent."""
        with self._ready:
            self._closed = True
            self._ready.notify_all()

    def abort(self) -> None:
        """End the stream now (idempotent): waiting chunks are dropped, a blocked put and
        a blocked read return."""
        with self._ready:
            self._aborted = True
            self._chunks.clear()
            self._ready.notify_all()

    def __iter__(self) -> Iterator[bytes]:
        while True:
            with self._ready:
                self._ready.wait_for(lambda: self._aborted or self._closed or self._chunks)
                if self._aborted or not self._chunks:
                    return
                chunk = self._chunks.popleft()
                self._ready.notify_all()
            yield chunk


def _error(err: grpc.RpcError, node: str, address: str, tls: bool) -> errors.TensordError:
    """The target's refusal as the tensord error it raised there; a target that does not
    answer is a lost node, and one whose certificate the roots do not vouch for (or that
    does not speak TLS) says so."""
    call = err if isinstance(err, grpc.Call) else None
    code = call.code() if call is not None else None
    message = (call.details() if call is not None else None) or str(err)
    trailers = dict(call.trailing_metadata() or ()) if call is not None else {}
    error_type = trailers.get(ERROR_TYPE_KEY)
    unanswered = code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    if unanswered and not error_type and tls and _handshake_failed(message):
        return errors.UnavailableError(
            f"node {node!r} of the cluster ({address}) did not take the copy: the TLS "
            f"handshake failed (is its certificate, for {address}, issued by a CA of this "
            f"node's --cluster-ca, and does it serve TLS?); node calls never fall back to "
            f"plaintext: {message}"
        )
    if unanswered and not error_type:
        return errors.NodeLostError(
            f"node {node!r} of the cluster ({address}) did not take the copy: {message}",
            node=node,
            address=address,
        )
    return errors.read_back(
        None if code is None else code.name,
        error_type,
        f"node {node!r} refused the copy: {message}",
        trailers.get(ERROR_DETAILS_KEY, ""),
    )


# What gRPC's message of a failed connection says when the TLS handshake was the failure.
# gRPC gives nothing sturdier: such a call ends UNAVAILABLE like any unreachable peer,
# with the reason in its details only.  "verification check failed" is how gRPC's
# checks of a chain the roots did vouch for fail (its "Hostname Verification Check
# failed", a certificate for another host; its "Custom verification check failed").
_HANDSHAKE_MARKERS = (
    "handshake",
    "certificate_verify_failed",
    "ssl_error",
    "tsi_",
    "verification check failed",
)


def _handshake_failed(message: str) -> bool:
    lowered = message.lower()
    return any(marker in lowered for marker in _HANDSHAKE_MARKERS)
