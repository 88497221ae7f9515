"""Calls this node makes to another node of its cluster: a cross-node copy's stream.

A node call is an ordinary call of the target's schema (an Upload into the caller's
session there) that authenticates with the cluster's shared secret
(``--cluster-token-file``) and names the tenant it acts for, never with a tenant's
token: the target then treats it as that tenant's call, with the same limits (the
tenant's streams, bytes in flight, quotas, handles per session).  Where the target
is comes from etcd's member record, never from the client, so a client cannot point
this node's credential at an address of its choosing.
"""

from __future__ import annotations

import contextlib
import threading
import zlib
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

# A copy's stream gets this long per MiB beyond its first minute (a slow link still ends).
COPY_BASE_TIMEOUT_S = 60.0
COPY_TIMEOUT_PER_MIB_S = 0.5
# The release of a copy that failed its checksum.
RELEASE_TIMEOUT_S = 5.0
_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


class NodeLink:
    """Channels to the other nodes, one per address, opened on first use.  Thread-safe."""

    def __init__(self, cluster_token: str) -> None:
        self._token = cluster_token
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}

    def _channel(self, address: str) -> grpc.Channel:
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = grpc.insecure_channel(address, options=_CHANNEL_OPTIONS)
                self._channels[address] = channel
            return channel

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
        sent = _Checksummed(chunks)
        timeout = COPY_BASE_TIMEOUT_S + COPY_TIMEOUT_PER_MIB_S * (header.nbytes >> 20)
        try:
            meta, call = upload.with_call(iter(sent), metadata=metadata, timeout=timeout)
        except grpc.RpcError as err:
            raise _error(err, node, address) from None
        finally:
            sent.stop()
        trailers = {k: v for k, v in call.trailing_metadata() or ()}
        stored = trailers.get(CHECKSUM_KEY)
        if stored is None or int(stored) != sent.crc:
            self._release(address, tenant, session_id, meta.handle)
            raise errors.CopyCorruptedError(
                f"the copy on node {node!r} ({address}) does not match the source: CRC-32 "
                f"{stored} stored, {sent.crc} sent; nothing was kept",
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


class _Checksummed:
    """The chunks of a stream, their CRC-32 kept as they go by.  gRPC reads them on a
    thread of its own, which may still be reading when the call has failed: :meth:`stop`
    waits out a read in progress and ends the stream, so the source can be closed."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._chunks = iter(chunks)
        self._lock = threading.Lock()
        self._stopped = False
        self.crc = 0

    def __iter__(self) -> Iterator[bytes]:
        while True:
            with self._lock:
                chunk = None if self._stopped else next(self._chunks, None)
            if chunk is None:
                return
            self.crc = zlib.crc32(chunk, self.crc)
            yield chunk

    def stop(self) -> None:
        with self._lock:
            self._stopped = True


def _error(err: grpc.RpcError, node: str, address: str) -> errors.TensordError:
    """The target's refusal as the tensord error it raised there; a target that does not
    answer is a lost node."""
    call = err if isinstance(err, grpc.Call) else None
    code = call.code() if call is not None else None
    message = (call.details() if call is not None else None) or str(err)
    trailers = dict(call.trailing_metadata() or ()) if call is not None else {}
    error_type = trailers.get(ERROR_TYPE_KEY)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) and not error_type:
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
