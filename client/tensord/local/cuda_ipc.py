"""GPU segments of the server, imported here through CUDA IPC: CuPy arrays over their bytes.

A GPU segment is *imported* rather than mapped: the Export's answer carries its CUDA IPC
handle (the server synchronized its stream first, so every op queued before is
complete), opened once per (server instance, segment) with
``cupy.cuda.runtime.ipcOpenMemHandle``.  CuPy is needed only here, and imported only for
a GPU export.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from tensord.layout import Layout

if TYPE_CHECKING:
    from tensord.schema import ExportResponse

#: what a GPU export's end tells its mapper: (export id, its import)
CudaExportEnded = Callable[[str, "CudaImport"], None]


def load_cupy() -> Any:
    """CuPy, imported on first use."""
    import cupy  # deferred: CuPy is an optional extra, needed only for GPU exports

    return cupy


class CudaImport:
    """A server GPU segment opened in this process through its CUDA IPC handle.

    ``exports`` counts the live :class:`CudaExport` objects over it, ``opened_for`` the
    Exports this open served (reported back when it is closed).
    """

    __slots__ = ("device_index", "device_ptr", "exports", "id", "key", "nbytes", "opened_for")

    def __init__(self, key: tuple[str, int], device_ptr: int, device_index: int, nbytes: int):
        self.key = key
        self.id = key[1]
        self.device_ptr = device_ptr
        self.device_index = device_index
        self.nbytes = nbytes
        self.exports = 1
        self.opened_for = 1

    @classmethod
    def open(cls, key: tuple[str, int], response: ExportResponse) -> CudaImport:
        cupy = load_cupy()
        runtime = cupy.cuda.runtime
        server_index = int(response.device.partition(":")[2] or 0)
        if not response.ipc_handle:  # a zero-byte Storage: nothing to open
            return cls(key, 0, server_index, 0)
        flags = getattr(runtime, "cudaIpcMemLazyEnablePeerAccess", 1)
        with cupy.cuda.Device(server_index):
            pointer = int(runtime.ipcOpenMemHandle(bytes(response.ipc_handle), flags))
        # the GPU it is on, as this process numbers them (CUDA_VISIBLE_DEVICES may differ)
        device = int(getattr(runtime.pointerGetAttributes(pointer), "device", server_index))
        return cls(key, pointer, device, int(response.segment_nbytes))

    def close(self) -> None:
        if self.device_ptr:
            cupy = load_cupy()
            with cupy.cuda.Device(self.device_index):
                cupy.cuda.runtime.ipcCloseMemHandle(self.device_ptr)
        self.device_ptr = 0


class CudaExport:
    """A pinned GPU Storage of the server, imported here: CuPy arrays over its bytes.

    Every array made by :meth:`array` holds this object (as the owner of its memory), so
    the import stays open while any array, or DLPack capsule of one, lives.
    """

    def __init__(
        self, ended: CudaExportEnded, response: ExportResponse, imported: CudaImport
    ) -> None:
        self.id = response.export_id
        self.meta = response.tensor
        self.storage_start = response.storage_byte_offset
        self.storage_nbytes = response.tensor.storage_nbytes
        self.imported = imported
        self._finalizer = weakref.finalize(self, ended, response.export_id, imported)
        self._finalizer.atexit = False

    @property
    def device_index(self) -> int:
        return self.imported.device_index

    def array(self, dtype: np.dtype, layout: Layout) -> Any:
        """A CuPy array of ``layout`` (in elements of ``dtype``) aliasing the Storage."""
        cupy = load_cupy()
        itemsize = dtype.itemsize
        with cupy.cuda.Device(self.device_index):
            if self.storage_nbytes == 0 or layout.numel == 0:
                return cupy.empty(layout.shape, dtype=dtype)
            memory = cupy.cuda.UnownedMemory(
                self.imported.device_ptr + self.storage_start,
                self.storage_nbytes,
                self,
                device_id=self.device_index,
            )
            pointer = cupy.cuda.MemoryPointer(memory, layout.offset * itemsize)
            return cupy.ndarray(
                layout.shape,
                dtype=dtype,
                memptr=pointer,
                strides=tuple(s * itemsize for s in layout.stride),
            )

    def close(self) -> None:
        self._finalizer()
