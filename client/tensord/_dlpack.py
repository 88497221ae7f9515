"""DLPack for tensord tensors: ``__dlpack__`` / ``__dlpack_device__`` (Python array API).

The capsule is NumPy's own (``ndarray.__dlpack__``) of an array that aliases the
pooled bytes through the client's mapping (:mod:`tensord.local`): NumPy already
implements both capsule kinds (``dltensor`` and, for ``max_version >= (1, 0)``,
``dltensor_versioned``), their deleters (safe from any thread and at exit: they take
the GIL and drop one reference) and the copy/device keywords.  That reference is
what keeps the export alive: when the consumer frees its tensor, the array goes,
and with it the export's pin (its id is queued for the next ReleaseExports).

A ``cuda`` tensor's capsule is CuPy's, of a CuPy array over this process's CUDA IPC
import of the server's segment (:class:`tensord.local.cuda_ipc.CudaExport`), device kDLCUDA.
The Export behind it synchronized the server's stream, so the bytes are final for
any consumer stream: ``stream`` needs no wait and is accepted as the array API says.

NumPy and CuPy have no bfloat16: such tensors are exported as uint16 and the capsule's
dtype is then rewritten in place to DLPack's kDLBfloat, 16 bits, before anyone sees it.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

import numpy as np

from tensord import dtypes, errors

if TYPE_CHECKING:
    from tensord._session import ClientSession
    from tensord.layout import Layout

# ``tensor`` below is a tensord.Tensor (typed Any: tensor.py imports this module), used
# through its public members only; what it keeps privately comes as the other arguments.

_UINT16 = np.dtype(np.uint16)  # what a bfloat16 tensor is exported as

# DLDeviceType
KDL_CPU = 1
KDL_CUDA = 2
# DLDataTypeCode
KDL_BFLOAT = 4

# Byte offsets of DLTensor.dtype.code in the two managed-tensor structs (64-bit ABI):
# DLTensor = {void* data; DLDevice device (2 x int32); int32 ndim; DLDataType dtype; ...}
_DTYPE_IN_DLTENSOR = 8 + 8 + 4
# DLManagedTensor = {DLTensor dl_tensor; ...}
_DTYPE_IN_MANAGED = _DTYPE_IN_DLTENSOR
# DLManagedTensorVersioned = {DLPackVersion (2 x uint32); void* ctx; deleter; uint64 flags;
#                             DLTensor dl_tensor}
_DTYPE_IN_VERSIONED = 8 + 8 + 8 + 8 + _DTYPE_IN_DLTENSOR

_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_get_name = ctypes.pythonapi.PyCapsule_GetName
_get_name.restype = ctypes.c_char_p
_get_name.argtypes = [ctypes.py_object]


def dlpack_device(tensor: Any) -> tuple[int, int]:
    if tensor.device.type == "cuda":
        return (KDL_CUDA, tensor.device.index or 0)
    return (KDL_CPU, 0)


def _retag_bfloat16(capsule: Any) -> None:
    """Rewrite a uint16 capsule's dtype as bfloat16 (same size, same lanes)."""
    name = _get_name(capsule)
    pointer = _get_pointer(capsule, name)
    offset = _DTYPE_IN_VERSIONED if name == b"dltensor_versioned" else _DTYPE_IN_MANAGED
    ctypes.c_uint8.from_address(pointer + offset).value = KDL_BFLOAT


def to_dlpack(
    tensor: Any,
    session: ClientSession,
    layout: Layout,
    *,
    stream: Any = None,
    max_version: tuple[int, int] | None = None,
    dl_device: tuple[int, int] | None = None,
    copy: bool | None = None,
) -> Any:
    """A DLPack capsule of ``tensor`` aliasing the pooled bytes (BufferError when it cannot)."""
    if tensor.requires_grad:  # torch's own refusal, word for word
        raise errors.TensordRuntimeError(
            "Can't export tensors that require gradient, use tensor.detach()"
        )
    if tensor.is_conj():  # torch's own refusal, word for word
        raise BufferError("Can't export tensors with the conjugate bit set")
    device_type = tensor.device.type
    if device_type == "cuda":
        return _cuda_capsule(
            tensor, session, layout, max_version=max_version, dl_device=dl_device, copy=copy
        )
    if device_type != "cpu":
        raise BufferError(f"DLPack export of {tensor.device} tensors is not supported")
    if dl_device is not None and tuple(dl_device) != (KDL_CPU, 0):
        raise BufferError(
            f"a tensord cpu tensor cannot be exported to DLPack device {tuple(dl_device)}"
        )
    if stream is not None:
        raise BufferError("stream must be None for a cpu tensor")
    bfloat16 = dtypes.canonical(tensor.dtype) is dtypes.bfloat16
    array: np.ndarray | None
    if copy:  # asked for a copy: the bytes downloaded, whatever the path
        values = tensor.numpy(force=True)
        array = values.view(np.uint16) if bfloat16 else values
    else:
        array = session.local_array(
            tensor.handle,
            layout,
            _UINT16 if bfloat16 else dtypes.to_numpy_dtype(tensor.dtype),
            tensor.untyped_storage().storage_id,
        )
        if array is None:
            raise BufferError(
                f"zero-copy DLPack export is impossible: {session.local_reason()}; "
                "pass copy=True for a copy"
            )
    capsule = (
        array.__dlpack__() if max_version is None else array.__dlpack__(max_version=max_version)
    )
    if bfloat16:
        _retag_bfloat16(capsule)
    return capsule


def _cuda_capsule(
    tensor: Any,
    session: ClientSession,
    layout: Layout,
    *,
    max_version: tuple[int, int] | None,
    dl_device: tuple[int, int] | None,
    copy: bool | None,
) -> Any:
    """A kDLCUDA capsule aliasing the server's GPU memory (a device copy when ``copy``)."""
    export = session.local_export(tensor.handle)
    if export is None or not hasattr(export, "device_index"):
        raise BufferError(
            f"zero-copy DLPack export of a {tensor.device} tensor is impossible: "
            f"{session.local_reason()}; copy it to the cpu first"
        )
    here = (KDL_CUDA, export.device_index)
    if dl_device is not None and tuple(dl_device) != here:
        raise BufferError(
            f"this {tensor.device} tensor cannot be exported to DLPack device "
            f"{tuple(dl_device)}: it lives on {here}"
        )
    if export.device_index != (tensor.device.index or 0):
        raise BufferError(
            f"the server's {tensor.device} is cuda:{export.device_index} in this process: "
            "give both the same CUDA_VISIBLE_DEVICES"
        )
    bfloat16 = dtypes.canonical(tensor.dtype) is dtypes.bfloat16
    np_dtype = np.dtype(np.uint16) if bfloat16 else dtypes.to_numpy_dtype(tensor.dtype)
    array: Any = export.array(np_dtype, layout)  # a CuPy array
    if copy:
        array = array.copy()  # on the same GPU; the export goes once the copy is made
    try:
        capsule = array.__dlpack__(**({"max_version": max_version} if max_version else {}))
    except TypeError:  # a CuPy older than the versioned protocol
        capsule = array.__dlpack__()
    if bfloat16:
        _retag_bfloat16(capsule)
    return capsule
