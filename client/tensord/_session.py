"""What every tensor of one Client shares: the connection and the same-host mapper.

:mod:`tensord.tensor` depends on this object rather than on :mod:`tensord.client`, so
the SDK's modules form layers (client -> tensor -> _session -> wire, local) with no
cycle, and a tensor never reaches into its client's private members.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import numpy as np

from tensord.layout import Layout
from tensord.local.cuda_ipc import CudaExport
from tensord.local.mapper import LocalMapper
from tensord.local.segments import Export
from tensord.wire.connection import Connection


class SessionClient(Protocol):
    """The public face of a :class:`tensord.Client`, as its tensors use it."""

    @property
    def address(self) -> str: ...

    @property
    def closed(self) -> bool: ...

    def tensor(
        self, data: Any, dtype: Any = None, device: Any = "cpu", requires_grad: bool = False
    ) -> Any: ...

    def node(self, node: str) -> Any: ...


class ClientSession:
    """One Client's connection state, handed to each of its tensors."""

    # no reference back to the Client: the Client holds this object, and a cycle would keep
    # a dropped Client (and its server session) alive until the garbage collector runs
    __slots__ = ("conn", "local", "torch_bases", "torch_holders")

    def __init__(self, conn: Connection, local: LocalMapper) -> None:
        self.conn = conn
        self.local = local
        # storage id -> a torch uint8 tensor over that Storage's mapped bytes, which every
        # torch alias of a tensor on it views (weak: it goes with the last tensor holding one)
        self.torch_bases: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
        # the tensors holding an alias (tensord.tensor drops theirs before a resize_ or set_)
        self.torch_holders: weakref.WeakSet[Any] = weakref.WeakSet()

    def local_export(self, handle: str) -> Export | CudaExport | None:
        """A same-host export of the Storage behind ``handle`` (None: use gRPC)."""
        return self.local.export(handle)

    def local_reason(self) -> str:
        """Why the last same-host export was impossible, in words for an error message."""
        if not self.local.enabled:
            return self.local.reason
        return self.local.last_refusal or "the server refused to export this tensor"

    def local_array(
        self, handle: str, layout: Layout, np_dtype: np.dtype, storage_id: str
    ) -> np.ndarray | None:
        """An array of ``layout`` aliasing the pool (the export lives as long as it), or None;
        a live export of the Storage (``storage_id``) is reused."""
        export = self.local.shared_export(handle, storage_id)
        if export is None:
            return None
        array: np.ndarray = export.array(np_dtype, layout)
        return array
