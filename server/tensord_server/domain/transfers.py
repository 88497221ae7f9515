"""Raw-byte transfers: a new tensor from uploaded chunks, a tensor's elements as chunks.

The server's temporary memory is a few chunks whatever the tensor's size: an
upload is written as it arrives, a download read (or gathered in logical order)
a chunk at a time.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from tensord import dtypes
from tensord.layout import Layout

from tensord_server.devices.table import activate
from tensord_server.domain import kernels
from tensord_server.domain.ops import Issued, OpContext
from tensord_server.domain.sessions import Session

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
        shape = kernels.check_shape(shape)
        dt = dtypes.dtype_from_name(dtype)
        layout = Layout.contiguous(shape)
        expected = layout.numel * dt.itemsize
        if nbytes != expected:
            raise ValueError(
                f"upload header declares {nbytes} bytes, but shape {list(shape)} of {dt.name} "
                f"holds {expected}"
            )
        with self.ops.allocated(session, self.ops.device(device), layout, dt, requires_grad) as out:
            received = 0
            for chunk in chunks:
                if received + len(chunk) > nbytes:
                    raise ValueError(f"upload carried more than the declared {nbytes} bytes")
                out.storage.write(received, chunk)
                received += len(chunk)
            if received != nbytes:
                raise ValueError(f"upload ended after {received} of {nbytes} bytes")
            return self.ops.issue(session, out)

    def download(self, session: Session, handle: str, chunk_bytes: int = 0) -> Iterator[bytes]:
        """The tensor's elements in logical order, as raw chunks (a generator: held while it runs).

        A contiguous tensor streams straight from its Storage, one chunk read at a
        time; any other is gathered in logical order a chunk at a time (the server's
        temporary memory is a few chunks, whatever the tensor's logical size).
        """
        chunk = DEFAULT_CHUNK_BYTES if chunk_bytes <= 0 else chunk_bytes
        chunk = min(max(chunk, MIN_CHUNK_BYTES), MAX_CHUNK_BYTES)
        with self.ops.sessions.held(session, handle) as (ref,):
            layout, itemsize = ref.layout, ref.dtype.itemsize
            self.ops.check_elements(layout.numel)
            nbytes = layout.numel * itemsize
            if layout.is_contiguous() and not (ref.conj or ref.neg):
                block, backend = ref.storage.block, ref.device.backend
                base = block.offset + layout.offset * itemsize
                for start in range(0, nbytes, chunk):
                    size = min(chunk, nbytes - start)
                    yield backend.read(block.segment.memory, base + start, size)
                return
            # an expanded view's logical size is unbounded by its Storage: gather it a chunk
            # at a time, never whole (a 2**27-element expand grew the server by 528 MB)
            # a tensor with lazy bits (issue 14): its values, a gathered piece at a time
            lazy = ref.conj or ref.neg
            yield from kernels.logical_chunks(
                self.ops.array(ref),
                itemsize,
                chunk,
                lambda: activate(ref.device),
                (lambda piece: kernels.apply_lazy_bits(piece, ref.conj, ref.neg)) if lazy else None,
            )
