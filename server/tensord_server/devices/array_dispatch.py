"""One array-ops object per device type: how arrays on that device are copied and read.

The kernels (torch's rules, in :mod:`tensord_server.domain.kernels`) work on arrays of
either module and ask :func:`for_arrays` which device's ops apply, instead of testing
"is this on a GPU?" themselves.  :data:`HOST` works on NumPy arrays; :data:`CUDA` on
CuPy arrays and bfloat16 arrays on a GPU, and reaches :mod:`.cuda` only when called
(CuPy is an optional extra: without it there are no GPU arrays, and nothing imports it).
"""

from __future__ import annotations

import sys
from typing import Any, Protocol

import numpy as np

from tensord_server.devices.host_copies import assign_host


class ArrayOps(Protocol):
    """What the kernels need from a device type's arrays."""

    def assign(self, xp: Any, dst: Any, src: Any) -> None:
        """``dst[...] = src`` with torch's conversions (``xp``: the destination's module)."""
        ...

    def to_bytes(self, piece: Any) -> bytes:
        """A (small) array's elements in logical order, as bytes on the host."""
        ...

    def module(self) -> Any:
        """The array module of these arrays (numpy, cupy)."""
        ...


class HostArrayOps:
    """NumPy arrays in host memory."""

    def assign(self, xp: Any, dst: Any, src: Any) -> None:
        assign_host(xp, dst, src)

    def to_bytes(self, piece: Any) -> bytes:
        return np.ascontiguousarray(piece).tobytes()

    def module(self) -> Any:
        return np


class CudaArrayOps:
    """CuPy arrays (and bfloat16 arrays, CuPy having no bfloat16) on a GPU."""

    @staticmethod
    def _cuda() -> Any:
        from tensord_server.devices import cuda  # deferred: only GPU arrays need it

        return cuda

    def owns(self, array: Any) -> bool:
        """A CuPy array or a BFloat16Array (never imports CuPy: without it there are none)."""
        return "cupy" in sys.modules and self._cuda().is_gpu_array(array)

    def assign(self, xp: Any, dst: Any, src: Any) -> None:
        # either side may be on the host: pinned staging or peer copies, then a CuPy kernel
        self._cuda().assign(dst, src)

    def to_bytes(self, piece: Any) -> bytes:
        bits = getattr(piece, "bits", piece)  # a BFloat16Array's bytes are its bits'
        return bytes(self._cuda().array_to_host(bits).reshape(-1).view(np.uint8).data)

    def module(self) -> Any:
        import cupy  # deferred: only GPU arrays need it

        return cupy

    def bfloat16_array(self, bits: Any) -> Any:
        """A bfloat16 array over a CuPy uint16 array of its bits."""
        return self._cuda().BFloat16Array(bits)

    def float32_to_bfloat16_bits(self, values: Any) -> Any:
        return self._cuda().float32_to_bfloat16_bits(values)


HOST = HostArrayOps()
CUDA = CudaArrayOps()


def on_gpu(array: Any) -> bool:
    return CUDA.owns(array)


def for_arrays(*arrays: Any) -> ArrayOps:
    """The ops of the device type the arrays live on: a GPU's as soon as one is on a GPU
    (a cross-device copy is the GPU's work), the host's otherwise."""
    return CUDA if any(CUDA.owns(array) for array in arrays) else HOST
