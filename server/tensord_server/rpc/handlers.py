"""The gRPC handlers, one per RPC: decoded request -> the domain object it names -> reply.

Each method of :class:`TensordService` is synchronous and runs on a worker thread of the
asyncio server (:mod:`tensord_server.rpc.calls` authenticates the call, reads and decodes
its request, and queues it fairly before a worker runs it).  The three streaming RPCs are
split into the steps a worker runs between the stream's messages (:meth:`upload_sink`,
:meth:`download_chunks`, :meth:`keepalive_session`), so no worker waits on a client.  Any
exception a handler lets escape becomes a status code in :mod:`tensord_server.rpc.status`,
the one place that decides.  A unary call that came on a session's call channel (the
same-host fd socket) runs the same method, with a context of the same shape.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Container, Iterator, Sequence
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message
from tensord import schema as pb
from tensord.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    OwnedElsewhereError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
)
from tensord.protocol import (
    MAX_MESSAGE_BYTES,
    SESSION_KEY,
    UPLOAD_HEADER_KEY,
    VERSION,
)

from tensord_server.cluster import NODE_ID, shown_node_id
from tensord_server.devices.shm import SharedHostBackend
from tensord_server.domain import limits
from tensord_server.domain.names import NameItem, item_error
from tensord_server.domain.ops.context import Issued
from tensord_server.domain.ops.transfers import DEFAULT_CHUNK_BYTES, UploadSink
from tensord_server.domain.sessions import Session
from tensord_server.domain.share_tokens import UNKNOWN_SHARE_TOKEN
from tensord_server.domain.storage import TensorRef
from tensord_server.domain.store import TensorStore
from tensord_server.rpc import status
from tensord_server.rpc.codec import (
    decode_advanced_index,
    decode_batch_op,
    decode_index,
    decode_message,
    decode_scalar,
    decode_view_op,
    encode_meta,
)
from tensord_server.rpc.fd_socket import FdSocket
from tensord_server.rpc.nodes import NodeLink

# Between a cluster's share token's node and the token itself: in neither a --node-id nor
# a token (secrets.token_urlsafe).
TOKEN_NODE_SEPARATOR = "~"
# A cross-node copy's chunks: large, since each is one message between two servers.
MAX_NODE_CHUNK_BYTES = 4 << 20

M = TypeVar("M", bound=Message)

SERVICE_NAME = "tensord.v1.Tensord"


def _metadata(context: grpc.ServicerContext, key: str) -> Any:
    for item in context.invocation_metadata() or ():
        if item.key == key:
            return item.value
    return None


def _unary(handler: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(handler)
    def wrapper(self: TensordService, request: Any, context: Any) -> Any:
        with self.store.gate.call():  # this call holds a worker (the saturation clock)
            return handler(self, request, context)

    return wrapper


class TensordService:
    """One method per RPC of the schema, each a thin wrapper over the domain's objects."""

    def __init__(self, store: TensorStore) -> None:
        self.store = store
        #: same-host zero copy's and the call channels' socket (the rpc layer makes it on
        #: the server's event loop; None where it could not)
        self.fd_socket: FdSocket | None = None
        self._link: NodeLink | None = None
        self._link_lock = threading.Lock()

    def _tenant(self, context: Any) -> str:
        return str(context.tenant)  # authenticated before the call was read (rpc.calls)

    def _replies(self, session: Session, issued: list[Issued], *inputs: str) -> list[pb.TensorMeta]:
        """The replies for handles an op issued (``inputs``: the request's own handles, which
        an op may return unchanged).  If one cannot be encoded, the new handles are released:
        the client never learns them, so nothing else would until its session ended."""
        try:
            return [encode_meta(i) for i in issued]
        except BaseException:
            self.store.sessions.release(
                session, [i.handle for i in issued if i.handle not in inputs]
            )
            raise

    def _reply(self, session: Session, issued: Issued, *inputs: str) -> pb.TensorMeta:
        return self._replies(session, [issued], *inputs)[0]

    def _session(self, context: grpc.ServicerContext) -> Session:
        session_id = _metadata(context, SESSION_KEY)
        if not session_id:
            raise UnauthenticatedError(
                f"missing {SESSION_KEY} metadata: call OpenSession and send its session_id"
            )
        if isinstance(session_id, bytes):
            session_id = session_id.decode("ascii", "replace")
        return self.store.sessions.get(session_id, self._tenant(context))

    # -- sessions ---------------------------------------------------------------

    @_unary
    def ServerInfo(self, request: pb.ServerInfoRequest, context: Any) -> pb.ServerInfoResponse:
        return pb.ServerInfoResponse(
            version=VERSION,
            devices=[
                pb.DeviceInfo(
                    device=d.name, capacity_bytes=d.pool.capacity, description=d.description
                )
                for d in self.store.devices
            ],
            max_message_bytes=MAX_MESSAGE_BYTES,
            chunk_bytes=DEFAULT_CHUNK_BYTES,
        )

    @_unary
    def OpenSession(self, request: pb.OpenSessionRequest, context: Any) -> pb.OpenSessionResponse:
        sessions = self.store.sessions
        session, resumed = sessions.open(
            request.client_name, request.resume_session_id, self._tenant(context)
        )
        fd_socket = self.fd_socket
        key = self.store.exports.channel_key(session) if fd_socket is not None else ""
        return pb.OpenSessionResponse(
            session_id=session.id,
            lease_seconds=sessions.lease,
            grace_seconds=sessions.grace,
            resumed=resumed,
            channel_key=key,
            channel_socket=fd_socket.path if key and fd_socket is not None else "",
        )

    @_unary
    def Heartbeat(self, request: pb.Heartbeat, context: Any) -> pb.Heartbeat:
        self._session(context)  # looking the session up renews its lease
        return pb.Heartbeat(sent_at=request.sent_at)

    def keepalive_session(self, context: Any) -> Session:
        """The session a KeepAlive stream keeps alive: counted as connected while the stream
        is open, whatever its beats do (the rpc layer calls ``sessions.stream_closed`` when
        gRPC ends the stream: the client closed it, its connection broke or stopped
        answering the transport's keepalive pings)."""
        session = self._session(context)
        self.store.sessions.stream_opened(session)
        return session

    @_unary
    def CloseSession(self, request: Any, context: Any) -> pb.CloseSessionResponse:
        released = self.store.sessions.close(self._session(context))
        return pb.CloseSessionResponse(released_handles=released)

    @_unary
    def Release(self, request: pb.ReleaseRequest, context: Any) -> pb.ReleaseResponse:
        count = self.store.sessions.release(self._session(context), list(request.handles))
        return pb.ReleaseResponse(released=count)

    # -- views ------------------------------------------------------------------

    @_unary
    def View(self, request: pb.ViewRequest, context: Any) -> pb.ViewResponse:
        session = self._session(context)
        issued = self.store.views.view(session, request.handle, decode_view_op(request))
        return pb.ViewResponse(tensors=self._replies(session, issued, request.handle))

    # -- pipelining ------------------------------------------------------------------

    @_unary
    def Batch(self, request: pb.BatchRequest, context: Any) -> pb.BatchResponse:
        session = self._session(context)
        limits.check_batch_ops(len(request.ops))  # bounded before any op is even decoded
        ops = [decode_batch_op(o) for o in request.ops]
        # a caller that cancelled or ran out of time stops the batch at its next op
        outcome = self.store.batches.run(session, ops, keep_going=context.is_active)
        copies = self._replies(session, list(outcome.copies))
        if outcome.error is None:
            return pb.BatchResponse(applied=outcome.applied, copies=copies)
        exc = outcome.error
        return pb.BatchResponse(
            applied=outcome.applied,
            copies=copies,
            failed=True,
            failed_index=outcome.failed_index or 0,
            **status.batch_error_fields(exc),
        )

    # -- factories ----------------------------------------------------------------

    @_unary
    def Empty(self, request: pb.EmptyRequest, context: Any) -> pb.TensorMeta:
        stride = tuple(request.stride.values) if request.HasField("stride") else None
        session = self._session(context)
        return self._reply(
            session,
            self.store.factories.empty(
                session,
                tuple(request.shape),
                stride,
                request.dtype,
                request.device,
                request.requires_grad,
            ),
        )

    @_unary
    def Full(self, request: pb.FullRequest, context: Any) -> pb.TensorMeta:
        session = self._session(context)
        return self._reply(
            session,
            self.store.factories.full(
                session,
                tuple(request.shape),
                decode_scalar(request.value),
                request.dtype,
                request.device,
                request.requires_grad,
            ),
        )

    @_unary
    def Arange(self, request: pb.ArangeRequest, context: Any) -> pb.TensorMeta:
        start = decode_scalar(request.start) if request.HasField("start") else 0
        step = decode_scalar(request.step) if request.HasField("step") else 1
        session = self._session(context)
        return self._reply(
            session,
            self.store.factories.arange(
                session,
                start,
                decode_scalar(request.end),
                step,
                request.dtype,
                request.device,
                request.requires_grad,
            ),
        )

    # -- copies ---------------------------------------------------------------------

    @_unary
    def Clone(self, request: pb.CloneRequest, context: Any) -> pb.TensorMeta:
        session = self._session(context)
        issued = self.store.copies.clone(session, request.handle, request.memory_format)
        return self._reply(session, issued)

    @_unary
    def Contiguous(self, request: pb.HandleRequest, context: Any) -> pb.TensorMeta:
        session = self._session(context)
        return self._reply(session, self.store.copies.contiguous(session, request.handle))

    @_unary
    def Reshape(self, request: pb.ReshapeRequest, context: Any) -> pb.TensorMeta:
        session = self._session(context)
        issued = self.store.copies.reshape(session, request.handle, tuple(request.shape))
        return self._reply(session, issued)

    @_unary
    def To(self, request: pb.ToRequest, context: Any) -> pb.TensorMeta:
        session = self._session(context)
        issued = self.store.copies.to(
            session, request.handle, request.device, request.dtype, request.copy
        )
        return self._reply(session, issued, request.handle)  # torch's to() may return self

    @_unary
    def Repeat(self, request: pb.RepeatRequest, context: Any) -> pb.TensorMeta:
        session = self._session(context)
        issued = self.store.copies.repeat(session, request.handle, tuple(request.repeats))
        return self._reply(session, issued)

    @_unary
    def Cat(self, request: pb.CatRequest, context: Any) -> pb.TensorMeta:
        session = self._session(context)
        return self._reply(
            session, self.store.copies.cat(session, list(request.handles), request.dim)
        )

    @_unary
    def Stack(self, request: pb.CatRequest, context: Any) -> pb.TensorMeta:
        session = self._session(context)
        issued = self.store.copies.stack(session, list(request.handles), request.dim)
        return self._reply(session, issued)

    @_unary
    def Copy(self, request: pb.CopyRequest, context: Any) -> pb.TensorMeta:
        session = self._session(context)
        return encode_meta(self.store.writes.copy(session, request.dst, request.src))

    @_unary
    def Fill(self, request: pb.FillRequest, context: Any) -> pb.TensorMeta:
        session = self._session(context)
        return encode_meta(
            self.store.writes.fill(session, request.handle, decode_scalar(request.value))
        )

    @_unary
    def SetItem(self, request: pb.SetItemRequest, context: Any) -> pb.TensorMeta:
        session = self._session(context)
        index = decode_index(request.index)
        if request.WhichOneof("value") == "src_handle":
            issued = self.store.writes.setitem(
                session, request.handle, index, src_handle=request.src_handle
            )
        else:
            issued = self.store.writes.setitem(
                session, request.handle, index, value=decode_scalar(request.scalar)
            )
        return encode_meta(issued)

    # -- transfers ------------------------------------------------------------------

    def upload_sink(self, context: Any) -> tuple[Session, UploadSink]:
        """An Upload's session and its allocated target (the header comes as metadata, the
        chunks as the stream's messages: the rpc layer writes each into the sink)."""
        session = self._session(context)
        raw_header = _metadata(context, UPLOAD_HEADER_KEY)
        if raw_header is None:
            raise ValueError(f"Upload needs the {UPLOAD_HEADER_KEY} metadata (an UploadHeader)")
        header = decode_message(pb.UploadHeader, raw_header)
        sink = self.store.transfers.upload_sink(
            session,
            tuple(header.shape),
            header.dtype,
            header.device,
            header.nbytes,
            header.requires_grad,
        )
        sink.checksum_wanted = header.checksum
        return session, sink

    def upload_finished(
        self, session: Session, sink: UploadSink
    ) -> tuple[pb.TensorMeta, int | None]:
        """The new handle's reply, and the CRC-32 of its stored bytes when the header
        asked for it (read back from the Storage before the handle is issued)."""
        with self.store.gate.call():
            checksum = sink.crc32() if sink.checksum_wanted else None
            return self._reply(session, sink.finish()), checksum

    def download_whole(self, request: pb.DownloadRequest, context: Any) -> bytes | None:
        """A Download's one chunk when it is a plain read of host memory, else None."""
        session = self._session(context)
        return self.store.transfers.read_whole(session, request.handle, request.chunk_bytes)

    def download_chunks(self, request: pb.DownloadRequest, context: Any) -> Iterator[bytes]:
        """A Download's chunks, a generator the rpc layer advances on a worker per chunk."""
        session = self._session(context)
        return self.store.transfers.download(session, request.handle, request.chunk_bytes)

    # -- sharing --------------------------------------------------------------------

    @_unary
    def Share(self, request: pb.ShareRequest, context: Any) -> pb.ShareResponse:
        session = self._session(context)
        if request.unlimited_uses and request.uses:
            raise InvalidArgumentError("ShareRequest: pass uses or unlimited_uses, not both")
        uses = None if request.unlimited_uses else (request.uses or 1)
        token, ttl = self.store.share_tokens.share(
            session, request.handle, uses, request.ttl_seconds or None
        )
        directory = self.store.names.directory
        if directory is not None:  # in a cluster a token carries its node: it routes itself
            token = f"{directory.node}{TOKEN_NODE_SEPARATOR}{token}"
        return pb.ShareResponse(token=token, ttl_seconds=ttl)

    def _local_token(self, token: str) -> str:
        """A share token as this node's table knows it: a token of another node of the
        cluster is OwnedElsewhereError naming that node (the SDK follows it once, to the
        owner, which checks the tenant as for any attach); one of a node no longer in the
        cluster is NotFoundError."""
        directory = self.store.names.directory
        node, separator, local = token.partition(TOKEN_NODE_SEPARATOR)
        if directory is None or not separator:
            return token
        if node == directory.node:
            return local
        if NODE_ID.fullmatch(node) is None:  # no node's: as unknown as any made-up token
            raise NotFoundError(UNKNOWN_SHARE_TOKEN)
        owner = directory.member(node)
        if owner is None:
            raise NotFoundError(
                f"the share token's node {node!r} is not in the cluster (it was lost or "
                "left): its tokens went with it"
            )
        raise OwnedElsewhereError(
            f"the share token is node {node!r}'s ({owner.address})",
            node=owner.node,
            address=owner.address,
        )

    @_unary
    def Revoke(self, request: pb.RevokeRequest, context: Any) -> pb.RevokeResponse:
        session = self._session(context)
        token = self._local_token(request.token)
        return pb.RevokeResponse(revoked=self.store.share_tokens.revoke(session, token))

    @_unary
    def Attach(self, request: pb.AttachRequest, context: Any) -> pb.TensorMeta:
        session = self._session(context)
        token = self._local_token(request.token)
        return self._reply(session, self.store.share_tokens.attach(session, token))

    @_unary
    def PutName(self, request: pb.PutNameRequest, context: Any) -> pb.PutNameResponse:
        session = self._session(context)
        if not request.HasField("staged"):
            self.store.names.put(session, request.name, request.handle, request.overwrite)
            return pb.PutNameResponse()
        made = self._staged(session, request)
        try:
            item = NameItem(request.name, "", request.overwrite, made)
            self.store.names.put_many(session, [item], itemized=False)
        finally:
            self.store.storages.release_hold(made.storage)  # the name holds it
        return pb.PutNameResponse()

    @_unary
    def PutNames(self, request: pb.PutNamesRequest, context: Any) -> pb.PutNamesResponse:
        return self._put_names(self._session(context), request.items)

    def _put_names(
        self, session: Session, items: Sequence[pb.PutNameRequest]
    ) -> pb.PutNamesResponse:
        """Name every item's tensor, all or none; a staged item's new tensor is made first
        (at most MAX_STAGED_ITEMS of them, their elements charged to one batch budget, as a
        Batch's ops; never issued: no handle counts for it) and its hold ended after (its
        name holds it)."""
        limits.check_staged_items(sum(item.HasField("staged") for item in items))
        made: list[TensorRef] = []
        try:
            named = []
            with limits.batch_budget(self.store.batches.max_batch_elements):
                for index, item in enumerate(items):
                    ref = None
                    if item.HasField("staged"):
                        try:
                            ref = self._staged(session, item)
                        except Exception as exc:
                            raise item_error(index, item.name, exc) from None
                        made.append(ref)
                    named.append(NameItem(item.name, item.handle, item.overwrite, ref))
            self.store.names.put_many(session, named)
        finally:
            self.store.storages.release_holds([ref.storage for ref in made])
        return pb.PutNamesResponse()

    def _staged(self, session: Session, item: pb.PutNameRequest) -> TensorRef:
        if item.handle:
            raise InvalidArgumentError("a PutNameRequest names a handle or staged bytes, not both")
        staged = item.staged
        return self.store.transfers.staged(
            session, staged.handle, staged.byte_offset, tuple(staged.shape), staged.dtype
        )

    @_unary
    def GetName(self, request: pb.GetNameRequest, context: Any) -> pb.TensorMeta:
        session = self._session(context)
        return self._reply(session, self.store.names.get(session, request.name))

    @_unary
    def GetNames(self, request: pb.GetNamesRequest, context: Any) -> pb.GetNamesResponse:
        session = self._session(context)
        issued = self.store.names.get_many(session, list(request.names))
        tensors = self._replies(session, issued)
        if not request.export or any(i.ref.device.name != "cpu" for i in issued):
            return pb.GetNamesResponse(tensors=tensors)
        same_server = request.server_instance == self.store.exports.instance
        mapped = request.mapped_segments if same_server else ()
        exports: list[pb.ExportResponse] = []
        try:
            for one in issued:
                exports.append(self._export(session, one.handle, mapped))
        except (FailedPreconditionError, ResourceExhaustedError) as exc:
            # as GetNameExport's: the gets stand, without their exports (all or none)
            self.store.exports.release(session, [e.export_id for e in exports])
            return pb.GetNamesResponse(tensors=tensors, export_refusal=str(exc))
        except BaseException:
            self.store.exports.release(session, [e.export_id for e in exports])
            self.store.sessions.release(session, [one.handle for one in issued])  # never learned
            raise
        return pb.GetNamesResponse(tensors=tensors, exports=exports)

    @_unary
    def GetNameExport(
        self, request: pb.GetNameExportRequest, context: Any
    ) -> pb.GetNameExportResponse:
        session = self._session(context)
        issued = self.store.names.get(session, request.name)
        tensor = self._reply(session, issued)
        if issued.ref.device.name != "cpu":
            return pb.GetNameExportResponse(tensor=tensor)
        same_server = request.server_instance == self.store.exports.instance
        mapped = request.mapped_segments if same_server else ()
        try:
            export = self._export(session, issued.handle, mapped)
        except (FailedPreconditionError, ResourceExhaustedError) as exc:
            # memory this server cannot share, or no room for an export under
            # --max-handles-per-session: the get itself stands, as GetName's would
            return pb.GetNameExportResponse(tensor=tensor, export_refusal=str(exc))
        except BaseException:
            self.store.sessions.release(session, [issued.handle])  # never learned
            raise
        return pb.GetNameExportResponse(tensor=tensor, export=export)

    @_unary
    def DeleteName(self, request: pb.DeleteNameRequest, context: Any) -> pb.DeleteNameResponse:
        session = self._session(context)
        self.store.names.delete(request.name, session.tenant)
        return pb.DeleteNameResponse()

    @_unary
    def DeleteNames(self, request: pb.DeleteNamesRequest, context: Any) -> pb.DeleteNamesResponse:
        session = self._session(context)
        self.store.names.delete_many(list(request.names), session.tenant)
        return pb.DeleteNamesResponse()

    @_unary
    def ListNames(self, request: pb.ListNamesRequest, context: Any) -> pb.ListNamesResponse:
        session = self._session(context)
        names, token = self.store.names.page(session.tenant, request.page_size, request.page_token)
        return pb.ListNamesResponse(names=names, next_page_token=token)

    @_unary
    def ListNodes(self, request: pb.ListNodesRequest, context: Any) -> pb.ListNodesResponse:
        self._session(context)
        directory = self.store.names.directory
        if directory is None:
            raise FailedPreconditionError(
                "this server is not part of a cluster (tensord serve --cluster etcd://...)"
            )
        if request.node:  # one the caller looks for: a node that just joined is listed too
            directory.member(_checked_node_id(request.node, "ListNodesRequest.node"))
        return pb.ListNodesResponse(
            node=directory.node,
            nodes=[
                pb.NodeInfo(
                    node=n.node,
                    address=n.address,
                    devices=[pb.DeviceInfo(device=d, capacity_bytes=c) for d, c in n.devices],
                    version=n.version,
                    incarnation=n.incarnation,
                )
                for n in directory.nodes()
            ],
        )

    @_unary
    def CopyToNode(self, request: pb.CopyToNodeRequest, context: Any) -> pb.TensorMeta:
        """The tensor's bytes streamed from here to the node ``request.node`` (whose address
        is etcd's, never the caller's), into the caller's session there; its handle there,
        once the stored bytes' CRC-32 matched.  The source is only read."""
        session = self._session(context)
        directory = self.store.names.directory
        if directory is None:
            raise FailedPreconditionError(
                "this server is not part of a cluster (tensord serve --cluster etcd://...)"
            )
        link = self.node_link()
        if link is None:
            raise FailedPreconditionError(
                f"node {directory.node!r} has no cluster credential (--cluster-token-file): "
                "it cannot copy to other nodes"
            )
        _checked_node_id(request.node, "CopyToNodeRequest.node")
        if request.node == directory.node:
            raise InvalidArgumentError(
                f"node {request.node!r} is this tensor's own node: use to({request.device!r})"
            )
        if not request.target_session_id or not request.device:
            raise InvalidArgumentError("CopyToNode needs the device and the target session")
        target = directory.member(request.node)
        if target is None:
            raise NotFoundError(f"no live node {request.node!r} in the cluster")
        if target.tls is not None and target.tls != link.tls:
            raise UnavailableError(
                f"node {target.node!r} of the cluster ({target.address}) serves "
                f"{'TLS' if target.tls else 'plaintext'} and this node "
                f"{'TLS' if link.tls else 'plaintext'} (by its member record in etcd): "
                "node calls never cross between the two; every node of a cluster serves "
                "TLS, or none does"
            )
        ref = self.store.sessions.lookup(session, request.handle)
        numel = ref.layout.numel
        header = pb.UploadHeader(
            shape=list(ref.layout.shape),
            dtype=ref.dtype.name,
            device=request.device,
            nbytes=numel * ref.dtype.itemsize,
            requires_grad=ref.requires_grad,
        )
        chunks = self.store.transfers.download(session, request.handle, MAX_NODE_CHUNK_BYTES)
        try:
            return link.send(
                target.node,
                target.address,
                session.tenant,
                request.target_session_id,
                header,
                chunks,
            )
        finally:
            chunks.close()  # type: ignore[attr-defined]  # a generator: its hold ends

    def node_link(self) -> NodeLink | None:
        """The channels to the other nodes (None: this node has no cluster credential)."""
        token = self.store.cluster_token
        if token is None:
            return None
        with self._link_lock:
            if self._link is None:
                self._link = NodeLink(token, self.store.cluster_roots)
            return self._link

    # -- the pool -------------------------------------------------------------------

    @_unary
    def MemoryStats(self, request: pb.DeviceRequest, context: Any) -> pb.MemoryStatsResponse:
        session = self._session(context)
        stats = self.store.memory_reports.memory_stats(request.device, session.tenant)
        return pb.MemoryStatsResponse(
            counters={k: v for k, v in stats.items() if not isinstance(v, float)},
            ratios={k: v for k, v in stats.items() if isinstance(v, float)},
        )

    @_unary
    def MemorySummary(self, request: pb.DeviceRequest, context: Any) -> pb.MemorySummaryResponse:
        self._session(context)
        return pb.MemorySummaryResponse(
            summary=self.store.memory_reports.memory_summary(request.device)
        )

    @_unary
    def MemorySnapshot(
        self, request: pb.MemorySnapshotRequest, context: Any
    ) -> pb.MemorySnapshotResponse:
        session = self._session(context)
        data, token = self.store.memory_reports.memory_snapshot_page(
            request.device, session.tenant, request.page_size, request.page_token
        )
        return pb.MemorySnapshotResponse(snapshot_json=data, next_page_token=token)

    @_unary
    def EmptyCache(self, request: pb.DeviceRequest, context: Any) -> pb.EmptyCacheResponse:
        self._session(context)
        return pb.EmptyCacheResponse(
            released_bytes=self.store.memory_reports.empty_cache(request.device)
        )

    # -- the tiers ----------------------------------------------------------------

    @_unary
    def Prefetch(self, request: pb.PrefetchRequest, context: Any) -> pb.PrefetchResponse:
        session = self._session(context)
        queued = self.store.tiering.prefetch(session, list(request.handles))
        return pb.PrefetchResponse(queued=queued)

    @_unary
    def PinToDevice(self, request: pb.PinToDeviceRequest, context: Any) -> pb.PinToDeviceResponse:
        self.store.tiering.pin(self._session(context), request.handle, request.pinned)
        return pb.PinToDeviceResponse()

    # -- same-host zero copy ----------------------------------------------------------

    @_unary
    def Export(self, request: pb.ExportRequest, context: Any) -> pb.ExportResponse:
        session = self._session(context)
        # the client's mapped segments, if of this server (ids restart with a server)
        same_server = request.server_instance == self.store.exports.instance
        mapped = request.mapped_segments if same_server else ()
        return self._export(session, request.handle, mapped)

    def _export(
        self, session: Session, handle: str, mapped: Container[int] = ()
    ) -> pb.ExportResponse:
        table = self.store.exports
        export, ticket, ref = table.export(session, handle, mapped)  # ref: no second lookup
        path = self.fd_socket.path if self.fd_socket is not None else ""
        if ticket and not path:  # host memory, and no socket to hand its descriptor over
            table.release(session, [export.id])
            raise FailedPreconditionError(
                "this server has no fd socket: clients cannot map its memory; use the gRPC "
                "transfers"
            )
        return pb.ExportResponse(
            export_id=export.id,
            segment_id=export.segment_id,
            segment_nbytes=export.segment_nbytes,
            storage_byte_offset=export.byte_offset,
            device=export.storage.device.name,
            fd_socket=path if ticket else "",
            ticket=ticket,
            ipc_handle=export.ipc_handle,
            server_instance=table.instance,
            tensor=encode_meta(Issued(handle, ref)),
        )

    @_unary
    def ReleaseExports(
        self, request: pb.ReleaseExportsRequest, context: Any
    ) -> pb.ReleaseExportsResponse:
        return self._release_exports(self._session(context), request)

    @_unary
    def EmptyExport(self, request: pb.EmptyExportRequest, context: Any) -> pb.EmptyExportResponse:
        session = self._session(context)
        # releases first: the new tensor reuses the blocks they free (warm pages)
        self.store.sessions.release(session, list(request.release_handles))
        released = self._release_exports(session, request.release_exports)
        empty = request.empty
        issued = self.store.factories.empty(
            session,
            tuple(empty.shape),
            tuple(empty.stride.values) if empty.HasField("stride") else None,
            empty.dtype,
            empty.device,
            empty.requires_grad,
        )
        try:
            export = self._export(session, issued.handle)
        except BaseException:
            # the client never learns the handle: nothing else would release it
            self.store.sessions.release(session, [issued.handle])
            raise
        return pb.EmptyExportResponse(export=export, released_exports=released)

    def _release_exports(
        self, session: Session, request: pb.ReleaseExportsRequest
    ) -> pb.ReleaseExportsResponse:
        table = self.store.exports
        table.imports_closed(session, [(c.segment_id, c.exports) for c in request.closed_imports])
        released = table.release(session, list(request.export_ids))
        backends = [
            d.backend for d in self.store.devices if isinstance(d.backend, SharedHostBackend)
        ]
        gone = table.gone_segments(backends, list(request.mapped_segments))
        return pb.ReleaseExportsResponse(released=released, gone_segments=gone)

    # -- advanced indexing ------------------------------------------------------------

    @_unary
    def AdvancedIndex(self, request: pb.AdvancedIndexRequest, context: Any) -> pb.TensorMeta:
        session = self._session(context)
        items = decode_advanced_index(request.index)
        return encode_meta(
            self.store.indexing.advanced_index(
                session, request.handle, items, request.raw, request.op
            )
        )

    @_unary
    def AdvancedSetItem(self, request: pb.AdvancedSetItemRequest, context: Any) -> pb.TensorMeta:
        session = self._session(context)
        items = decode_advanced_index(request.index)
        is_tensor = request.WhichOneof("value") == "src_handle"
        return encode_meta(
            self.store.indexing.advanced_setitem(
                session,
                request.handle,
                items,
                value=None if is_tensor else decode_scalar(request.scalar),
                src_handle=request.src_handle if is_tensor else None,
                accumulate=request.accumulate,
                raw=request.raw,
                value_requires_grad=request.value_requires_grad,
            )
        )

    # -- resize, set_ --------------------------------------------------------------------

    @_unary
    def Resize(self, request: pb.ResizeRequest, context: Any) -> pb.TensorMeta:
        session = self._session(context)
        return encode_meta(
            self.store.resizing.resize(
                session, request.handle, list(request.size), request.memory_format
            )
        )

    @_unary
    def SetStorage(self, request: pb.SetStorageRequest, context: Any) -> pb.TensorMeta:
        session = self._session(context)
        return encode_meta(
            self.store.resizing.set_storage(
                session,
                request.handle,
                request.source,
                request.source_is_storage,
                request.storage_offset if request.HasField("storage_offset") else None,
                list(request.size.values) if request.HasField("size") else None,
                list(request.stride.values) if request.HasField("stride") else None,
            )
        )


def _checked_node_id(node: str, field: str) -> str:
    """``node`` if it can be a node's id (``--node-id``'s rule), else InvalidArgumentError:
    no id a node could not have is looked for in etcd, nor repeated in full."""
    if NODE_ID.fullmatch(node) is None:
        raise InvalidArgumentError(
            f"{field}: {shown_node_id(node)} is not a node id (1-63 letters, digits, '_', "
            "'.' or '-', starting with a letter or digit)"
        )
    return node
