"""The same-host data plane's mapper: one client's segment mappings, imports and exports.

A client on the server's host asks the server to *export* a tensor's Storage
(``Export``: the Storage is pinned in place) and maps the pool segment holding it,
once per segment: the server hands the segment's memfd over its fd socket to whoever
presents the one-time ticket the Export returned.  Anything failing there (another
host, another user, an older server) turns the fast path off for the client, silently:
every transfer then goes through gRPC as before.  ``tensord.connect(local=False)`` or
``$TENSORD_LOCAL=0`` turn it off from the start.

Mappings are cached by (server instance, segment id) and unmapped once no array over
them is alive and the server says the segment is gone (it answers that with each
batch of ReleaseExports).  An :class:`~tensord.local.segments.Export` lives while any array made over it does;
when the last one is collected its id is queued and sent in the next batch.  While a cpu
export made for DLPack lives, another ``__dlpack__`` of any view of the same Storage in the
same session reuses it (:meth:`LocalMapper.shared_export`): no Export RPC.

A GPU segment is *imported* instead: the Export's answer carries its CUDA IPC handle
(the server synchronized its stream first, so every op queued before is complete),
opened once per (server instance, segment) with ``cupy.cuda.runtime.ipcOpenMemHandle``;
arrays over it are CuPy arrays (:class:`~tensord.local.cuda_ipc.CudaExport`), whose DLPack capsules are of
device kDLCUDA.  The server never frees a segment a session imported, so an import is
closed (``ipcCloseMemHandle``) as soon as no array over it is alive, at the next batch
of ReleaseExports, which reports it closed.  While imports are open, every call the
client makes first waits for the GPUs it imported from (``cudaDeviceSynchronize``):
the consumer's writes, on whatever stream, are complete before the server's next op.
CuPy is needed only here, and imported only for a GPU export.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import mmap
import os
import threading
import time
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tensord import errors
from tensord import schema as pb
from tensord.local import channel, cuda_ipc
from tensord.local.cuda_ipc import CudaExport, CudaImport
from tensord.local.segments import Export, Segment
from tensord.protocol import MAX_NAME_ITEMS
from tensord.wire import requests
from tensord.wire.status import is_unimplemented

if TYPE_CHECKING:
    from tensord.wire.connection import Connection

LOCAL_ENV = "TENSORD_LOCAL"
# An Export names at most this many of the segments the client maps (the latest mapped):
# an export in one of them needs no ticket.  Bounds the request's size.
MAX_MAPPED_HINTS = 256
# A same-host get's export is kept this long for the reads that follow the get (DLPack,
# x.numpy(): no Export call), then let go unless an array uses it: a tensor kept unread
# does not pin its Storage (a pin keeps compaction from moving it and resize_ from growing it).
PREFETCH_HOLD_S = 1.0
# ... and at most this many at once (the oldest let go first): each counts against
# --max-handles-per-session while held (a get refused for the limit lets them all go and
# is made again without one).
MAX_PREFETCHED = 8


def local_wanted(local: bool | None) -> bool:
    """``local`` if given, else false only when ``$TENSORD_LOCAL`` says 0/false/no/off."""
    if local is not None:
        return local
    return os.environ.get(LOCAL_ENV, "1").strip().lower() not in {"0", "false", "no", "off"}


class SegmentForgotten(Exception):
    """An Export answered without a ticket (the request named its segment as mapped here)
    for a segment this client no longer maps."""


class LocalMapper:
    """One client's mappings of its server's segments and its exports.  Thread-safe."""

    def __init__(self, conn: Connection, enabled: bool) -> None:
        self._conn = conn
        self.enabled = enabled
        self.reason = "same-host mapping is turned off (local=False or $TENSORD_LOCAL=0)"
        self.last_refusal = ""  # why the server last refused an Export
        self._empty_export = True  # false once the server turned EmptyExport down as unknown
        self._get_export = True  # false once the server turned GetNameExport down as unknown
        # guards _segments, _imports and their counters; reentrant: an export's finalizer may
        # run on a collection triggered while this thread holds it
        self._lock = threading.RLock()
        self._segments: dict[tuple[str, int], Segment] = {}
        # every Segment an array may still use, cached or not (:meth:`make_private`); _lock
        self._live: weakref.WeakSet[Segment] = weakref.WeakSet()
        self._open_lock = threading.Lock()  # one CUDA IPC open or close at a time
        self._imports: dict[tuple[str, int], CudaImport] = {}
        # (session id, segment id) -> GPU Exports answered in that session whose import
        # this client never opened (no array was made): reported closed like a closed import
        self._unopened: collections.Counter[tuple[str, int]] = collections.Counter()
        self._pending: collections.deque[str] = collections.deque()
        # (session id, storage id) -> the live cpu export DLPack capsules of that Storage
        # hold: another __dlpack__ of any view of it reuses it (no Export RPC); _lock
        self._reusable: dict[tuple[str, str], weakref.ref[Export]] = {}
        # what an Export says this client maps: (the server instance of the latest segment
        # mapped, at most MAX_MAPPED_HINTS of its segment ids); replaced whole under _lock
        self._mapped_hint: tuple[str, tuple[int, ...]] = ("", ())
        # (session id, storage id) -> (when, the export a get brought): held PREFETCH_HOLD_S
        # for the reads after the get (let_go); _lock
        self._prefetched: dict[tuple[str, str], tuple[float, Export]] = {}

    def disable(self, reason: str) -> None:
        self.enabled = False
        self.reason = reason

    def shared_export(self, handle: str, storage_id: str) -> Export | CudaExport | None:
        """An export for an alias that may outlive the call (a DLPack capsule): a live cpu
        export of the same Storage in this session if there is one, else a new one.

        Reusing one is safe because the export lives as long as anything made over it: the
        new capsule's array holds it like the old ones, so its pin ends with the last of
        them.  Only cpu exports are reused: a GPU Export also synchronizes the server's
        stream, which each capsule needs (the server's ops on cpu memory are complete when
        their RPC answers).
        """
        if not self.enabled:
            return None
        reused = self.live_export(storage_id)
        if reused is not None:
            return reused
        session_id = self._conn.session_id
        export = self.export(handle, reuse_key=(session_id, storage_id))
        if isinstance(export, Export) and export.meta.storage_id == storage_id:
            with self._lock:
                self._reusable[(session_id, storage_id)] = weakref.ref(export)
        return export

    def live_export(self, storage_id: str) -> Export | None:
        """A live cpu export of the Storage ``storage_id`` in this session (one a DLPack
        capsule or a same-host ``get`` holds), once the ops queued before are applied; None
        when there is none (the caller exports)."""
        if not self.enabled:
            return None
        session_id = self._conn.session_id
        with self._lock:
            ref = self._reusable.get((session_id, storage_id))
        reused = ref() if ref is not None else None
        if reused is None:
            return None
        # what a call would check and wait for: a closed, forked or replaced session
        # raises, and ops queued before this call are applied before it sees the bytes
        self._conn.check_session(session_id)
        if self._conn.pipelining:
            self._conn.synchronize(releases=False)
        return reused

    @property
    def mapping(self) -> bool:
        """Whether this client maps a segment of its server now: an export then costs one
        call and no descriptor, whatever the transfer's size."""
        return self.enabled and bool(self._segments)

    def get_exported(self, name: str) -> tuple[pb.TensorMeta, Export | None] | None:
        """GetName and an export of the new handle's host Storage in one call
        (GetNameExport); the export None where the server did not export it or this client
        cannot map it.  None: the server does not know the call (use GetName).  The export
        is the Storage's reusable one (:meth:`live_export`, :meth:`shared_export`), held
        here PREFETCH_HOLD_S for the reads that follow the get (:meth:`let_go`)."""
        if not self._get_export:
            return None
        instance, mapped = self._mapped_hint
        request = requests.get_name_export(name, instance, mapped)
        session_id = self._conn.session_id
        orphaned = functools.partial(self._release_got, session_id)
        try:
            response: pb.GetNameExportResponse = self._conn.call("GetNameExport", request, orphaned)
        except errors.TensordError as exc:
            if not is_unimplemented(exc):
                raise
            self._get_export = False  # a server older than GetNameExport
            return None
        meta = response.tensor
        if not response.HasField("export"):
            self.last_refusal = response.export_refusal or self.last_refusal
            return meta, None
        export = self._hold_got(session_id, meta, response.export, MAX_PREFETCHED)
        return meta, export

    def get_many_exported(self, names: Sequence[str]) -> pb.GetNamesResponse:
        """GetNames asking for an export of each new handle's host Storage in the same
        call; the exports answered are mapped and held as :meth:`get_exported` holds its
        one (all of them, up to MAX_NAME_ITEMS, for the reads that follow the get).  An
        older server answers no exports (the reads then export each)."""
        instance, mapped = self._mapped_hint
        request = requests.get_names(names, export=True, instance=instance, mapped=mapped)
        session_id = self._conn.session_id
        orphaned = functools.partial(self._release_got_many, session_id)
        response: pb.GetNamesResponse = self._conn.call("GetNames", request, orphaned)
        if len(response.exports) != len(response.tensors):
            for export in response.exports:  # never the case from a server that adds up
                self._conn.queue_export_release(export.export_id)
            self.last_refusal = response.export_refusal or self.last_refusal
            return response
        for meta, exported in zip(response.tensors, response.exports, strict=True):
            self._hold_got(session_id, meta, exported, MAX_NAME_ITEMS)
        return response

    def _hold_got(
        self, session_id: str, meta: pb.TensorMeta, exported: pb.ExportResponse, most: int
    ) -> Export | None:
        """A got tensor's export mapped, and held PREFETCH_HOLD_S beside at most ``most``
        others (the oldest let go first); None where it is not one to map here."""
        reuse_key = (session_id, meta.storage_id)
        try:
            export = self._mapped(meta.handle, exported, reuse_key)
        except SegmentForgotten:  # no ticket for an unmapped segment: not one to map
            return None
        if not isinstance(export, Export):
            if export is not None:
                export.close()
            return None
        with self._lock:
            self._reusable[reuse_key] = weakref.ref(export)
            self._prefetched.pop(reuse_key, None)  # put back last: the newest
            self._prefetched[reuse_key] = (time.monotonic(), export)
            spare = []  # dicts keep insertion order: the first is the oldest
            while len(self._prefetched) > most:
                spare.append(self._prefetched.pop(next(iter(self._prefetched))))
        del spare  # an export let go is released once no array uses it
        return export

    def hold_while(self, tensor: Any, storage_id: str) -> None:
        """The export a get brought for ``tensor`` (of the Storage ``storage_id``) is held
        no longer than ``tensor`` lives: dropped unread, it unpins the Storage with its
        handle's release (a name deleted next frees its memory for the next put, rather than
        a second later), where only an array over it (which holds it itself) keeps it."""
        key = (self._conn.session_id, storage_id)
        with self._lock:
            held = self._prefetched.get(key)
        if held is not None:
            weakref.finalize(tensor, self._tensor_gone, key, weakref.ref(held[1]))

    def _tensor_gone(self, key: tuple[str, str], export: weakref.ref[Export]) -> None:
        with self._lock:
            held = self._prefetched.get(key)
            gone = self._prefetched.pop(key) if held is not None and held[1] is export() else None
        del gone  # (outside the lock: an export let go may end here, and its end locks)

    def let_go(self, storage_id: str | None = None, *, every: bool = False) -> bool:
        """Stop holding the exports gets brought: of the Storage ``storage_id`` now (before
        an op a pin would refuse), all of them (``every``: the session is full), or those
        held PREFETCH_HOLD_S.  Whether one went (its release is queued once no array uses
        it)."""
        if not self._prefetched:
            return False
        with self._lock:
            if every:
                dropped = list(self._prefetched.values())
                self._prefetched.clear()
            elif storage_id is not None:
                gone = self._prefetched.pop((self._conn.session_id, storage_id), None)
                dropped = [] if gone is None else [gone]
            else:
                oldest = time.monotonic() - PREFETCH_HOLD_S
                keys = [k for k, (when, _) in self._prefetched.items() if when < oldest]
                dropped = [self._prefetched.pop(k) for k in keys]
        return bool(dropped)  # (the exports' finalizers run as the list goes)

    def _release_got_many(self, session_id: str, response: pb.GetNamesResponse) -> None:
        """A GetNames answer its caller never saw: its handles and its exports."""
        for export in response.exports:
            self._conn.queue_export_release(export.export_id)
        for meta in response.tensors:
            self._conn.queue_release(meta.handle)

    def _release_got(self, session_id: str, response: pb.GetNameExportResponse) -> None:
        """A GetNameExport answer its caller never saw: its handle and its export."""
        if response.HasField("export"):
            self._conn.queue_export_release(response.export.export_id)
        if response.tensor.handle:
            self._conn.queue_release(response.tensor.handle)

    def export(
        self, handle: str, *, reuse_key: tuple[str, str] | None = None
    ) -> Export | CudaExport | None:
        """An export of the handle's Storage mapped here, or None (the caller uses gRPC):
        this client cannot map the server's memory, or this device's memory is not mappable."""
        if not self.enabled:
            return None
        instance, mapped = self._mapped_hint
        request = requests.export(handle, instance, mapped)
        response = self._call_export(request)
        if response is None:
            return None
        try:
            return self._mapped(handle, response, reuse_key)
        except SegmentForgotten:
            # answered without a ticket for a segment no longer mapped here (close() forgot
            # it meanwhile): that export is released, and one naming no mapped segment, so
            # answered with a ticket, replaces it
            response = self._call_export(requests.export(handle))
            return None if response is None else self._mapped(handle, response, reuse_key)

    def _call_export(self, request: pb.ExportRequest) -> pb.ExportResponse | None:
        """One Export (released if an interrupt takes its caller away; on the session's call
        channel when it has one, as any call); None when the server cannot share this memory
        (the reason kept in ``last_refusal``)."""
        orphaned = functools.partial(self._release_orphan, self._conn.session_id)
        try:
            response: pb.ExportResponse = self._conn.call("Export", request, orphaned)
        except errors.FailedPreconditionError as exc:  # memory this server cannot share
            self.last_refusal = str(exc)
            return None
        return response

    def _release_orphan(self, session_id: str, response: pb.ExportResponse) -> None:
        """An Export answer its caller never saw (an interrupt took it away): released, and
        a GPU one's import, which the server counted for ``session_id``, reported closed."""
        self._never_opened(session_id, response)  # first: the release's batch carries it
        self._conn.queue_export_release(response.export_id)

    def _never_opened(self, session_id: str, response: pb.ExportResponse) -> None:
        """(any thread) A GPU Export answered in ``session_id`` that this client drops
        without opening its segment: the server counted an import of the segment for the
        session, which vetoes the segment's release until the session ends unless reported
        closed.  When this client has the segment open, that import counts it (its close
        reports it, see :meth:`close_idle_imports`); else the next ReleaseExports does."""
        if not (response.device.startswith("cuda") and response.ipc_handle):
            return  # a cpu export, or a zero-byte Storage's: no import was counted
        with self._lock:
            imported = self._imports.get((response.server_instance, int(response.segment_id)))
            if imported is not None:
                imported.opened_for += 1
            else:
                self._unopened[(session_id, int(response.segment_id))] += 1

    def _update_mapped_hint(self, instance: str) -> None:
        """(_lock held) What the next Exports say this client maps of ``instance``."""
        ids = [k[1] for k in self._segments if k[0] == instance]
        self._mapped_hint = (instance, tuple(ids[-MAX_MAPPED_HINTS:]))

    def empty_exported(
        self, empty: pb.EmptyRequest, carry_releases: bool
    ) -> tuple[pb.TensorMeta, Export | CudaExport | None] | None:
        """A new empty tensor and its export, in one call (EmptyExport); None when the server
        cannot share that memory (it released the new handle: use gRPC).  The export is None
        when this client cannot map it (the caller drops the tensor and uses gRPC).
        ``carry_releases``: the releases queued so far ride along, applied first."""
        if not self._empty_export:
            return self._empty_then_export(empty, carry_releases)
        unknown = False
        try:
            response = self._conn.empty_export(empty, carry_releases)
        except errors.TensordError as exc:
            refused = isinstance(exc, errors.FailedPreconditionError)
            unknown = is_unimplemented(exc)
            if not (refused or unknown):
                raise
            self.last_refusal = str(exc) if refused else self.last_refusal
            # the error and the failed call's frames form a cycle that holds this frame, and
            # through it the caller's: what the caller makes next (the tensor, the upload's
            # view of the array) would outlive its last reference until a garbage collection
            exc.__traceback__ = exc.__context__ = None
            if refused:
                return None
        if unknown:
            self._empty_export = False  # a server older than EmptyExport: two calls
            return self._empty_then_export(empty, carry_releases)
        exported = response.export
        if not exported.tensor.handle or not exported.export_id:
            self.disable(f"the server's EmptyExport answered no tensor ({exported.tensor!r})")
            return None
        self.unmap_gone(list(response.released_exports.gone_segments))
        try:
            return exported.tensor, self._mapped(exported.tensor.handle, exported, None)
        except SegmentForgotten:  # no ticket for an unmapped segment: not one to map
            return exported.tensor, None

    def _empty_then_export(
        self, empty: pb.EmptyRequest, carry_releases: bool
    ) -> tuple[pb.TensorMeta, Export | CudaExport | None]:
        """:meth:`empty_exported` in an Empty and an Export, after the releases if asked."""
        if carry_releases:
            self._conn.flush_releases()
        meta: pb.TensorMeta = self._conn.call("Empty", empty)
        return meta, self.export(meta.handle)

    def _mapped(
        self, handle: str, response: pb.ExportResponse, reuse_key: tuple[str, str] | None
    ) -> Export | CudaExport | None:
        """The export the server answered, mapped here (None: released, use gRPC)."""
        key = (response.server_instance, int(response.segment_id))
        end = response.storage_byte_offset + response.tensor.storage_nbytes
        if (
            response.tensor.handle != handle
            or response.storage_byte_offset < 0
            or end > response.segment_nbytes
        ):
            # never build an array past what is mapped (it would reach another mapping's
            # memory, or fault): a server whose answer does not add up is not used locally
            self._conn.queue_export_release(response.export_id)
            self.disable(
                f"the server's Export does not add up (bytes {response.storage_byte_offset}.."
                f"{end} of a {response.segment_nbytes}-byte segment, for tensor "
                f"{response.tensor.handle[:8]!r})"
            )
            return None
        if response.device.startswith("cuda"):
            return self._export_cuda(key, response)
        try:
            segment = self._segment(key, response)
        except SegmentForgotten:
            self._conn.queue_export_release(response.export_id)
            raise
        except (OSError, ValueError) as exc:
            self._conn.queue_export_release(response.export_id)
            self.disable(f"this client cannot map the server's memory ({exc})")
            return None
        if end > segment.base.size:
            # never build an array past the mapping (that would read or write another
            # mapping's memory, or fault): a server this client cannot trust to be local
            self.ended(response.export_id, segment)
            self.disable(
                f"the server exported bytes {response.storage_byte_offset}..{end} of a "
                f"{segment.base.size}-byte segment"
            )
            return None
        return Export(self.ended, response, segment, reuse_key)

    def _segment(self, key: tuple[str, int], response: pb.ExportResponse) -> Segment:
        with self._lock:
            segment = self._segments.get(key)
            if segment is not None:
                segment.exports += 1
                return segment
        shared = response.segment_nbytes != 0
        if not shared:  # a zero-byte Storage: nothing to map
            mapping = mmap.mmap(-1, 1)
        elif not response.ticket:  # the Export was told it is mapped here: no longer
            raise SegmentForgotten(key)
        else:
            fd = channel.receive_segment_fd(
                response.fd_socket, response.ticket, response.segment_nbytes
            )
            try:
                mapping = mmap.mmap(fd, response.segment_nbytes, flags=mmap.MAP_SHARED)
            finally:
                os.close(fd)
            with contextlib.suppress(OSError, AttributeError, ValueError):
                mapping.madvise(
                    mmap.MADV_HUGEPAGE
                )  # see tensord_server.devices.shm.advise_huge_pages
        with self._lock:
            segment = self._segments.setdefault(key, Segment(key, mapping, shared))
            self._live.add(segment)
            segment.exports += 1
            self._update_mapped_hint(key[0])
        return segment

    def _export_cuda(self, key: tuple[str, int], response: pb.ExportResponse) -> CudaExport | None:
        """A GPU export over this process's import of its segment (opened here if new)."""
        try:
            imported = self._import(key, response)
        except ImportError:
            self.last_refusal = "zero copy of GPU memory needs CuPy in the client"
            # nothing was opened (answered just now, in this session): not an import
            self._never_opened(self._conn.session_id, response)
            self._conn.queue_export_release(response.export_id)
            return None
        except Exception as exc:  # CuPy's CUDARuntimeError (no GPU, another host)
            # (the handle may have opened before the error: the import keeps counting)
            self.last_refusal = f"this client cannot open the server's GPU memory ({exc})"
            self._conn.queue_export_release(response.export_id)
            return None
        return CudaExport(self.cuda_ended, response, imported)

    def _import(self, key: tuple[str, int], response: pb.ExportResponse) -> CudaImport:
        with self._open_lock:
            with self._lock:
                imported = self._imports.get(key)
                if imported is not None:
                    imported.exports += 1
                    imported.opened_for += 1
                    return imported
            imported = CudaImport.open(key, response)
            with self._lock:
                self._imports[key] = imported
            return imported

    def cuda_ended(self, export_id: str, imported: CudaImport) -> None:
        """A GPU export's last array was collected (any thread): never blocks for long."""
        with self._lock:
            imported.exports -= 1
        self._conn.queue_export_release(export_id)

    def close_idle_imports(self) -> list[pb.ClosedImport]:
        """Close the imports no array uses any more; what to report to the server (with
        the imports it counted that were never opened here)."""
        if not self._imports and not self._unopened:
            return []
        with self._open_lock:
            with self._lock:
                idle = [k for k, i in self._imports.items() if i.exports == 0 and i.opened_for]
                closing = [self._imports.pop(k) for k in idle]
            for imported in closing:
                imported.close()
        closed = [requests.closed_import(i.id, i.opened_for) for i in closing]
        return closed + self._take_unopened()

    def _take_unopened(self) -> list[pb.ClosedImport]:
        """The never-opened imports to report in this session.  Those of another session
        are dropped: its end dropped their counts, and reported here they would lower this
        session's count of an import it may hold open."""
        session_id = self._conn.session_id
        with self._lock:
            taken, self._unopened = self._unopened, collections.Counter()
        return [
            requests.closed_import(segment_id, exports)
            for (owner, segment_id), exports in taken.items()
            if owner == session_id
        ]

    def before_call(self) -> None:
        """Make the consumer's GPU work on imported memory complete before the next call."""
        if not self._imports:
            return
        with self._lock:
            indices = {i.device_index for i in self._imports.values()}
        cupy = cuda_ipc.load_cupy()
        for index in sorted(indices):
            with cupy.cuda.Device(index):
                cupy.cuda.runtime.deviceSynchronize()

    def imported_segments(self) -> list[int]:
        with self._lock:
            return [k[1] for k in self._imports]

    def ended(
        self, export_id: str, segment: Segment, reuse_key: tuple[str, str] | None = None
    ) -> None:
        """An export's last array was collected (any thread, even at exit): never blocks."""
        with self._lock:
            segment.exports -= 1
            if reuse_key is not None and reuse_key in self._reusable:
                current = self._reusable[reuse_key]()
                if current is None or current.id == export_id:  # not a newer one's entry
                    del self._reusable[reuse_key]
        self._conn.queue_export_release(export_id)

    def mapped_segments(self, server_instance: str | None = None) -> list[int]:
        with self._lock:
            return [k[1] for k in self._segments if server_instance in (None, k[0])]

    def unmap_gone(self, gone: list[int]) -> None:
        """Drop the cache's mappings of segments the server released (and no export uses)."""
        gone_ids = set(gone)
        with self._lock:
            unmapped = [
                key
                for key, segment in self._segments.items()
                if segment.id in gone_ids and segment.exports == 0
            ]
            for key in unmapped:
                del self._segments[key]
            if unmapped:
                self._update_mapped_hint(self._mapped_hint[0])
        # the mmap itself closes when the last array over it (if any) is collected

    def mapped_count(self) -> int:
        with self._lock:
            return len(self._segments)

    def make_private(self) -> None:
        """The session ends (its client closes, or the server lost it): every mapping of a
        pool segment in this process becomes private memory at the same addresses, so an
        alias taken before (``torch.from_dlpack``, ``np.asarray(x, copy=False)``) keeps
        working on its own copy of the bytes and never reaches pool memory the server may
        give to another session.  The cache forgets them: later exports map afresh."""
        with self._lock:
            live = list(self._live)
            self._live = weakref.WeakSet()
            self._segments.clear()
            self._reusable.clear()
            self._prefetched.clear()
            self._mapped_hint = ("", ())
        for segment in live:
            segment.make_private()

    def close(self) -> None:
        """Forget the mappings; close the GPU imports no array uses (an array still alive
        keeps its import open until this process exits)."""
        with self._lock:
            self._segments.clear()
            self._reusable.clear()
            self._prefetched.clear()
            self._mapped_hint = ("", ())
        with contextlib.suppress(Exception):
            self.close_idle_imports()
