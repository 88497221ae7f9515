"""Raw-byte transfers: a new tensor from uploaded chunks, a tensor's elements as chunks.

The server's temporary memory is a few chunks whatever the tensor's size: an
upload is written as it arrives, a download read (or gathered in logical order)
a chunk at a time.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import numpy as np
from tensord import dtypes
from tensord.errors import InvalidArgumentError
from tensord.layout import Layout

from tensord_server.devices.table import Device, activate
from tensord_server.domain import checksum, kernels
from tensord_server.domain.ops.context import Issued, OpContext
from tensord_server.domain.sessions import Session
from tensord_server.domain.storage import Storage, TensorRef
from tensord_server.pool.backend import Backend, DeviceMemory

# Raw-byte transfers move this much per message unless the client asks otherwise.
DEFAULT_CHUNK_BYTES = 1 << 20
# Chunk sizes a client may ask for: at least 4 KiB (fewer, larger messages) ...
MIN_CHUNK_BYTES = 4 << 10
# ... and at most 16 MiB, well inside the message limit below.
MAX_CHUNK_BYTES = 16 << 20


class Transfers:
    """Upload and download over one :class:`OpContext`."""

    def __init__(self, ops: OpContext) -> None:
        self.ops = ops

    def upload(
        self,
        session: Session,
        shape: Sequence[int],
        dtype: str,
        device: str,
        nbytes: int,
        chunks: Iterable[bytes],
        requires_grad: bool = False,
    ) -> Issued:
        """A new tensor from raw bytes, written as they arrive; nothing is left on any failure."""
        sink = self.upload_sink(session, shape, dtype, device, nbytes, requires_grad)
        try:
            for chunk in chunks:
                sink.write(chunk)
            return sink.finish()
        finally:
            sink.abort()  # after finish: nothing left to undo

    def upload_sink(
        self,
        session: Session,
        shape: Sequence[int],
        dtype: str,
        device: str,
        nbytes: int,
        requires_grad: bool = False,
    ) -> UploadSink:
        """An upload whose chunks come one call at a time (the asyncio server writes each
        chunk on whichever worker is free, holding none while the client is sending)."""
        shape = kernels.check_shape(shape)
        dt = dtypes.dtype_from_name(dtype)
        layout = Layout.contiguous(shape)
        expected = layout.numel * dt.itemsize
        if nbytes != expected:
            raise ValueError(
                f"upload header declares {nbytes} bytes, but shape {list(shape)} of {dt.name} "
                f"holds {expected}"
            )
        return UploadSink(self.ops, session, self.ops.device(device), layout, dt, requires_grad)

    def staged(
        self, session: Session, handle: str, byte_offset: int, shape: Sequence[int], dtype: str
    ) -> TensorRef:
        """A new contiguous tensor of ``shape`` and ``dtype`` holding a copy of the bytes a
        same-host client wrote into its staging tensor ``handle`` (a contiguous tensor of
        its session), from ``byte_offset`` on; on the staging tensor's device.  Not issued:
        the caller gets it with a hold on its Storage (a name takes its own reference) and
        ends the hold with ``storages.release_hold``."""
        shape = kernels.check_shape(shape)
        dt = dtypes.dtype_from_name(dtype)
        layout = Layout.contiguous(shape)
        nbytes = layout.numel * dt.itemsize
        with self.ops.sessions.held(session, handle) as (ref,):
            if not ref.layout.is_contiguous() or ref.conj or ref.neg:
                raise InvalidArgumentError("a staging tensor must be contiguous, its bits plain")
            have = ref.layout.numel * ref.dtype.itemsize
            if byte_offset < 0 or byte_offset + nbytes > have:
                raise InvalidArgumentError(
                    f"staged bytes {byte_offset}..{byte_offset + nbytes} are not inside the "
                    f"{have}-byte staging tensor"
                )
            self.ops.check_elements(layout.numel)
            sink = UploadSink(self.ops, session, ref.device, layout, dt, False)
            try:
                if nbytes:
                    start = ref.layout.offset * ref.dtype.itemsize + byte_offset
                    sink.copy_from(ref.storage, start)
                return sink.take()
            finally:
                sink.abort()  # after finish: nothing left to undo

    def read_whole(self, session: Session, handle: str, chunk_bytes: int = 0) -> bytes | None:
        """The tensor's bytes when they are one plain read of at most one chunk: a
        contiguous tensor with no lazy bits, of 1 to ``chunk_bytes`` bytes; None for any
        other (its download streams its chunks).  The work is one lookup and one copy of at
        most a chunk, whatever the tensor."""
        chunk = download_chunk_bytes(chunk_bytes)
        with self.ops.sessions.held(session, handle) as (ref,):
            layout, itemsize = ref.layout, ref.dtype.itemsize
            self.ops.check_elements(layout.numel)  # as a streamed download is bounded
            nbytes = layout.numel * itemsize
            if not 0 < nbytes <= chunk or not _stored_as_read(ref):
                return None
            block, backend = ref.storage.block, ref.device.backend
            return backend.read(block.segment.memory, _first_byte(ref), nbytes)

    def download(self, session: Session, handle: str, chunk_bytes: int = 0) -> Iterator[bytes]:
        """The tensor's elements in logical order, as raw chunks (a generator: held while it runs).

        A contiguous tensor streams straight from its Storage, one chunk read at a
        time; any other is gathered in logical order a chunk at a time (the server's
        temporary memory is a few chunks, whatever the tensor's logical size).
        """
        chunk = download_chunk_bytes(chunk_bytes)
        with self.ops.sessions.held(session, handle) as (ref,):
            layout, itemsize = ref.layout, ref.dtype.itemsize
            self.ops.check_elements(layout.numel)
            nbytes = layout.numel * itemsize
            if _stored_as_read(ref):
                block, backend = ref.storage.block, ref.device.backend
                base = _first_byte(ref)
                for start in range(0, nbytes, chunk):
                    size = min(chunk, nbytes - start)
                    yield backend.read(block.segment.memory, base + start, size)
                return
            # an expanded view's logical size is unbounded by its Storage: gather it a chunk
            # at a time, never whole (a 2**27-element expand grew the server by 528 MB)
            # a tensor with lazy bits: its values, a gathered piece at a time
            lazy = ref.conj or ref.neg
            yield from kernels.logical_chunks(
                self.ops.array(ref),
                itemsize,
                chunk,
                lambda: activate(ref.device),
                (lambda piece: kernels.apply_lazy_bits(piece, ref.conj, ref.neg)) if lazy else None,
            )


def _stored_as_read(ref: TensorRef) -> bool:
    """Whether ``ref``'s values are its stored bytes in order: contiguous, no lazy bits."""
    return ref.layout.is_contiguous() and not (ref.conj or ref.neg)


def _first_byte(ref: TensorRef) -> int:
    """The offset of ``ref``'s first element in its Storage's segment memory."""
    return ref.storage.block.offset + ref.layout.offset * ref.dtype.itemsize


def download_chunk_bytes(asked: int, most: int = MAX_CHUNK_BYTES) -> int:
    """The size of a Download's chunks when ``asked`` (0 or less: the default) for them:
    within [MIN_CHUNK_BYTES, ``most``]."""
    chunk = DEFAULT_CHUNK_BYTES if asked <= 0 else asked
    return min(max(chunk, MIN_CHUNK_BYTES), max(most, MIN_CHUNK_BYTES))


def stored_crc32(backend: Backend, memory: DeviceMemory, offset: int, size: int, crc: int) -> int:
    """The CRC-32 of ``size`` stored bytes at ``offset`` of ``memory``, continuing ``crc``:
    in place where the backend's view is host memory (the checksum releases the GIL over
    it), else over a host copy read a chunk at a time."""
    view = backend.view(memory, offset, size)
    if isinstance(view, np.ndarray):
        return checksum.crc32(view.data, crc)
    for start in range(0, size, DEFAULT_CHUNK_BYTES):
        piece = min(DEFAULT_CHUNK_BYTES, size - start)
        crc = checksum.crc32(backend.read(memory, offset + start, piece), crc)
    return crc


class UploadSink:
    """An upload in progress: its Storage allocated and held (never moved by compaction),
    written chunk by chunk, issued by :meth:`finish`; :meth:`abort` frees it if it was not.

    Each method may run on a different thread, one at a time (the caller's order)."""

    def __init__(
        self,
        ops: OpContext,
        session: Session,
        device: Device,
        layout: Layout,
        dtype: dtypes.DType,
        requires_grad: bool,
    ) -> None:
        kernels.check_requires_grad(dtype, requires_grad)
        self._ops = ops
        self._session = session
        self.nbytes = layout.numel * dtype.itemsize
        storage = ops.storages.allocate(
            device, layout.storage_extent() * dtype.itemsize, session.tenant
        )
        self._out: TensorRef | None = TensorRef(storage, layout, dtype, requires_grad)
        self.received = 0
        #: whether the caller wants :meth:`crc32` of the stored bytes (a node's copy)
        self.checksum_wanted = False
        self._crc = 0  # of the stored bytes [0, received), while checksum_wanted

    def write(self, chunk: bytes) -> None:
        """Store ``chunk`` after the bytes before it; with ``checksum_wanted``, read it back
        from the Storage into the running CRC-32 (while the next chunk is on its way)."""
        out = self._live()
        if self.received + len(chunk) > self.nbytes:
            raise ValueError(f"upload carried more than the declared {self.nbytes} bytes")
        with activate(out.device):
            out.storage.write(self.received, chunk)
            if self.checksum_wanted:
                block = out.storage.block
                self._crc = stored_crc32(
                    out.device.backend,
                    block.segment.memory,
                    block.offset + self.received,
                    len(chunk),
                    self._crc,
                )
        self.received += len(chunk)

    def copy_from(self, source: Storage, offset: int) -> None:
        """All the tensor's bytes, from ``offset`` bytes into ``source`` (held by the caller,
        on the same device), in one copy on the device."""
        out = self._live()
        if self.received:
            raise ValueError("a copy_from fills a whole upload, from its first byte")
        src, dst = source.block, out.storage.block
        with activate(out.device):
            out.device.backend.copy(
                src.segment.memory, src.offset + offset, dst.segment.memory, dst.offset, self.nbytes
            )
        self.received = self.nbytes

    def crc32(self) -> int:
        """The CRC-32 of the bytes written, as each was read back from the Storage once
        stored (what is stored, not what arrived); only with ``checksum_wanted`` set
        before the first write."""
        self._live()
        assert self.checksum_wanted, "crc32() of an upload that did not want its checksum"
        return self._crc

    def finish(self) -> Issued:
        out = self._live()
        if self.received != self.nbytes:
            raise ValueError(f"upload ended after {self.received} of {self.nbytes} bytes")
        with activate(out.device):
            issued = self._ops.issue(self._session, out)
        self.abort()  # the handle holds the Storage now: only the hold goes
        return issued

    def take(self) -> TensorRef:
        """The written tensor, not issued, its hold now the caller's."""
        out = self._live()
        if self.received != self.nbytes:
            raise ValueError(f"upload ended after {self.received} of {self.nbytes} bytes")
        self._out = None
        return out

    def abort(self) -> None:
        """Give up the hold (idempotent): an unissued Storage returns to the pool."""
        out, self._out = self._out, None
        if out is not None:
            self._ops.storages.release_hold(out.storage)

    def _live(self) -> TensorRef:
        if self._out is None:
            raise ValueError("upload already finished or aborted")
        return self._out
