from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorMeta(_message.Message):
    __slots__ = ("handle", "shape", "stride", "storage_offset", "dtype", "device", "requires_grad", "storage_id", "storage_nbytes", "storage_data_ptr", "is_conj", "is_neg")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    REQUIRES_GRAD_FIELD_NUMBER: _ClassVar[int]
    STORAGE_ID_FIELD_NUMBER: _ClassVar[int]
    STORAGE_NBYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_DATA_PTR_FIELD_NUMBER: _ClassVar[int]
    IS_CONJ_FIELD_NUMBER: _ClassVar[int]
    IS_NEG_FIELD_NUMBER: _ClassVar[int]
    handle: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    stride: _containers.RepeatedScalarFieldContainer[int]
    storage_offset: int
    dtype: str
    device: str
    requires_grad: bool
    storage_id: str
    storage_nbytes: int
    storage_data_ptr: int
    is_conj: bool
    is_neg: bool
    def __init__(self, handle: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., stride: _Optional[_Iterable[int]] = ..., storage_offset: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., requires_grad: _Optional[bool] = ..., storage_id: _Optional[str] = ..., storage_nbytes: _Optional[int] = ..., storage_data_ptr: _Optional[int] = ..., is_conj: _Optional[bool] = ..., is_neg: _Optional[bool] = ...) -> None: ...

class Scalar(_message.Message):
    __slots__ = ("bool_value", "int_value", "float_value", "complex_value", "uint_value")
    BOOL_VALUE_FIELD_NUMBER: _ClassVar[int]
    INT_VALUE_FIELD_NUMBER: _ClassVar[int]
    FLOAT_VALUE_FIELD_NUMBER: _ClassVar[int]
    COMPLEX_VALUE_FIELD_NUMBER: _ClassVar[int]
    UINT_VALUE_FIELD_NUMBER: _ClassVar[int]
    bool_value: bool
    int_value: int
    float_value: float
    complex_value: Complex
    uint_value: int
    def __init__(self, bool_value: _Optional[bool] = ..., int_value: _Optional[int] = ..., float_value: _Optional[float] = ..., complex_value: _Optional[_Union[Complex, _Mapping]] = ..., uint_value: _Optional[int] = ...) -> None: ...

class Complex(_message.Message):
    __slots__ = ("real", "imag")
    REAL_FIELD_NUMBER: _ClassVar[int]
    IMAG_FIELD_NUMBER: _ClassVar[int]
    real: float
    imag: float
    def __init__(self, real: _Optional[float] = ..., imag: _Optional[float] = ...) -> None: ...

class HandleRequest(_message.Message):
    __slots__ = ("handle",)
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    handle: str
    def __init__(self, handle: _Optional[str] = ...) -> None: ...

class ServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DeviceInfo(_message.Message):
    __slots__ = ("device", "capacity_bytes", "description")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    device: str
    capacity_bytes: int
    description: str
    def __init__(self, device: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., description: _Optional[str] = ...) -> None: ...

class ServerInfoResponse(_message.Message):
    __slots__ = ("version", "devices", "max_message_bytes", "chunk_bytes")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    version: str
    devices: _containers.RepeatedCompositeFieldContainer[DeviceInfo]
    max_message_bytes: int
    chunk_bytes: int
    def __init__(self, version: _Optional[str] = ..., devices: _Optional[_Iterable[_Union[DeviceInfo, _Mapping]]] = ..., max_message_bytes: _Optional[int] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("client_name", "resume_session_id")
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    RESUME_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    client_name: str
    resume_session_id: str
    def __init__(self, client_name: _Optional[str] = ..., resume_session_id: _Optional[str] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("session_id", "lease_seconds", "grace_seconds", "resumed", "channel_key", "channel_socket")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GRACE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_KEY_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_SOCKET_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    lease_seconds: float
    grace_seconds: float
    resumed: bool
    channel_key: str
    channel_socket: str
    def __init__(self, session_id: _Optional[str] = ..., lease_seconds: _Optional[float] = ..., grace_seconds: _Optional[float] = ..., resumed: _Optional[bool] = ..., channel_key: _Optional[str] = ..., channel_socket: _Optional[str] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("sent_at",)
    SENT_AT_FIELD_NUMBER: _ClassVar[int]
    sent_at: float
    def __init__(self, sent_at: _Optional[float] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ("released_handles",)
    RELEASED_HANDLES_FIELD_NUMBER: _ClassVar[int]
    released_handles: int
    def __init__(self, released_handles: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("handles",)
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    handles: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, handles: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class IntList(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, values: _Optional[_Iterable[int]] = ...) -> None: ...

class Slice(_message.Message):
    __slots__ = ("start", "stop", "step")
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    start: int
    stop: int
    step: int
    def __init__(self, start: _Optional[int] = ..., stop: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class IndexItem(_message.Message):
    __slots__ = ("integer", "slice", "none", "ellipsis")
    INTEGER_FIELD_NUMBER: _ClassVar[int]
    SLICE_FIELD_NUMBER: _ClassVar[int]
    NONE_FIELD_NUMBER: _ClassVar[int]
    ELLIPSIS_FIELD_NUMBER: _ClassVar[int]
    integer: int
    slice: Slice
    none: bool
    ellipsis: bool
    def __init__(self, integer: _Optional[int] = ..., slice: _Optional[_Union[Slice, _Mapping]] = ..., none: _Optional[bool] = ..., ellipsis: _Optional[bool] = ...) -> None: ...

class ViewShape(_message.Message):
    __slots__ = ("shape",)
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, shape: _Optional[_Iterable[int]] = ...) -> None: ...

class ViewDtype(_message.Message):
    __slots__ = ("dtype",)
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    def __init__(self, dtype: _Optional[str] = ...) -> None: ...

class Narrow(_message.Message):
    __slots__ = ("dim", "start", "length")
    DIM_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    dim: int
    start: int
    length: int
    def __init__(self, dim: _Optional[int] = ..., start: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class Select(_message.Message):
    __slots__ = ("dim", "index")
    DIM_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    dim: int
    index: int
    def __init__(self, dim: _Optional[int] = ..., index: _Optional[int] = ...) -> None: ...

class Index(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[IndexItem]
    def __init__(self, items: _Optional[_Iterable[_Union[IndexItem, _Mapping]]] = ...) -> None: ...

class Transpose(_message.Message):
    __slots__ = ("dim0", "dim1")
    DIM0_FIELD_NUMBER: _ClassVar[int]
    DIM1_FIELD_NUMBER: _ClassVar[int]
    dim0: int
    dim1: int
    def __init__(self, dim0: _Optional[int] = ..., dim1: _Optional[int] = ...) -> None: ...

class T(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Permute(_message.Message):
    __slots__ = ("dims",)
    DIMS_FIELD_NUMBER: _ClassVar[int]
    dims: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dims: _Optional[_Iterable[int]] = ...) -> None: ...

class Movedim(_message.Message):
    __slots__ = ("source", "destination")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    source: _containers.RepeatedScalarFieldContainer[int]
    destination: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, source: _Optional[_Iterable[int]] = ..., destination: _Optional[_Iterable[int]] = ...) -> None: ...

class Expand(_message.Message):
    __slots__ = ("shape",)
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, shape: _Optional[_Iterable[int]] = ...) -> None: ...

class Squeeze(_message.Message):
    __slots__ = ("dims",)
    DIMS_FIELD_NUMBER: _ClassVar[int]
    dims: IntList
    def __init__(self, dims: _Optional[_Union[IntList, _Mapping]] = ...) -> None: ...

class Unsqueeze(_message.Message):
    __slots__ = ("dim",)
    DIM_FIELD_NUMBER: _ClassVar[int]
    dim: int
    def __init__(self, dim: _Optional[int] = ...) -> None: ...

class Flatten(_message.Message):
    __slots__ = ("start_dim", "end_dim")
    START_DIM_FIELD_NUMBER: _ClassVar[int]
    END_DIM_FIELD_NUMBER: _ClassVar[int]
    start_dim: int
    end_dim: int
    def __init__(self, start_dim: _Optional[int] = ..., end_dim: _Optional[int] = ...) -> None: ...

class Unflatten(_message.Message):
    __slots__ = ("dim", "sizes")
    DIM_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    dim: int
    sizes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dim: _Optional[int] = ..., sizes: _Optional[_Iterable[int]] = ...) -> None: ...

class Split(_message.Message):
    __slots__ = ("split_size", "sections", "dim")
    SPLIT_SIZE_FIELD_NUMBER: _ClassVar[int]
    SECTIONS_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    split_size: int
    sections: IntList
    dim: int
    def __init__(self, split_size: _Optional[int] = ..., sections: _Optional[_Union[IntList, _Mapping]] = ..., dim: _Optional[int] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("chunks", "dim")
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    chunks: int
    dim: int
    def __init__(self, chunks: _Optional[int] = ..., dim: _Optional[int] = ...) -> None: ...

class Unbind(_message.Message):
    __slots__ = ("dim",)
    DIM_FIELD_NUMBER: _ClassVar[int]
    dim: int
    def __init__(self, dim: _Optional[int] = ...) -> None: ...

class Diagonal(_message.Message):
    __slots__ = ("offset", "dim1", "dim2")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DIM1_FIELD_NUMBER: _ClassVar[int]
    DIM2_FIELD_NUMBER: _ClassVar[int]
    offset: int
    dim1: int
    dim2: int
    def __init__(self, offset: _Optional[int] = ..., dim1: _Optional[int] = ..., dim2: _Optional[int] = ...) -> None: ...

class AsStrided(_message.Message):
    __slots__ = ("size", "stride", "storage_offset")
    SIZE_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    size: _containers.RepeatedScalarFieldContainer[int]
    stride: _containers.RepeatedScalarFieldContainer[int]
    storage_offset: int
    def __init__(self, size: _Optional[_Iterable[int]] = ..., stride: _Optional[_Iterable[int]] = ..., storage_offset: _Optional[int] = ...) -> None: ...

class Detach(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SetRequiresGrad(_message.Message):
    __slots__ = ("requires_grad", "by_write")
    REQUIRES_GRAD_FIELD_NUMBER: _ClassVar[int]
    BY_WRITE_FIELD_NUMBER: _ClassVar[int]
    requires_grad: bool
    by_write: bool
    def __init__(self, requires_grad: _Optional[bool] = ..., by_write: _Optional[bool] = ...) -> None: ...

class ViewRequest(_message.Message):
    __slots__ = ("handle", "view", "view_dtype", "narrow", "select", "index", "transpose", "t", "permute", "movedim", "expand", "squeeze", "unsqueeze", "flatten", "unflatten", "split", "chunk", "unbind", "diagonal", "as_strided", "detach", "set_requires_grad", "complex_view")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    VIEW_FIELD_NUMBER: _ClassVar[int]
    VIEW_DTYPE_FIELD_NUMBER: _ClassVar[int]
    NARROW_FIELD_NUMBER: _ClassVar[int]
    SELECT_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TRANSPOSE_FIELD_NUMBER: _ClassVar[int]
    T_FIELD_NUMBER: _ClassVar[int]
    PERMUTE_FIELD_NUMBER: _ClassVar[int]
    MOVEDIM_FIELD_NUMBER: _ClassVar[int]
    EXPAND_FIELD_NUMBER: _ClassVar[int]
    SQUEEZE_FIELD_NUMBER: _ClassVar[int]
    UNSQUEEZE_FIELD_NUMBER: _ClassVar[int]
    FLATTEN_FIELD_NUMBER: _ClassVar[int]
    UNFLATTEN_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    UNBIND_FIELD_NUMBER: _ClassVar[int]
    DIAGONAL_FIELD_NUMBER: _ClassVar[int]
    AS_STRIDED_FIELD_NUMBER: _ClassVar[int]
    DETACH_FIELD_NUMBER: _ClassVar[int]
    SET_REQUIRES_GRAD_FIELD_NUMBER: _ClassVar[int]
    COMPLEX_VIEW_FIELD_NUMBER: _ClassVar[int]
    handle: str
    view: ViewShape
    view_dtype: ViewDtype
    narrow: Narrow
    select: Select
    index: Index
    transpose: Transpose
    t: T
    permute: Permute
    movedim: Movedim
    expand: Expand
    squeeze: Squeeze
    unsqueeze: Unsqueeze
    flatten: Flatten
    unflatten: Unflatten
    split: Split
    chunk: Chunk
    unbind: Unbind
    diagonal: Diagonal
    as_strided: AsStrided
    detach: Detach
    set_requires_grad: SetRequiresGrad
    complex_view: ComplexView
    def __init__(self, handle: _Optional[str] = ..., view: _Optional[_Union[ViewShape, _Mapping]] = ..., view_dtype: _Optional[_Union[ViewDtype, _Mapping]] = ..., narrow: _Optional[_Union[Narrow, _Mapping]] = ..., select: _Optional[_Union[Select, _Mapping]] = ..., index: _Optional[_Union[Index, _Mapping]] = ..., transpose: _Optional[_Union[Transpose, _Mapping]] = ..., t: _Optional[_Union[T, _Mapping]] = ..., permute: _Optional[_Union[Permute, _Mapping]] = ..., movedim: _Optional[_Union[Movedim, _Mapping]] = ..., expand: _Optional[_Union[Expand, _Mapping]] = ..., squeeze: _Optional[_Union[Squeeze, _Mapping]] = ..., unsqueeze: _Optional[_Union[Unsqueeze, _Mapping]] = ..., flatten: _Optional[_Union[Flatten, _Mapping]] = ..., unflatten: _Optional[_Union[Unflatten, _Mapping]] = ..., split: _Optional[_Union[Split, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., unbind: _Optional[_Union[Unbind, _Mapping]] = ..., diagonal: _Optional[_Union[Diagonal, _Mapping]] = ..., as_strided: _Optional[_Union[AsStrided, _Mapping]] = ..., detach: _Optional[_Union[Detach, _Mapping]] = ..., set_requires_grad: _Optional[_Union[SetRequiresGrad, _Mapping]] = ..., complex_view: _Optional[_Union[ComplexView, _Mapping]] = ...) -> None: ...

class ViewResponse(_message.Message):
    __slots__ = ("tensors",)
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    def __init__(self, tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ...) -> None: ...

class EmptyRequest(_message.Message):
    __slots__ = ("shape", "stride", "dtype", "device", "requires_grad")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    REQUIRES_GRAD_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    stride: IntList
    dtype: str
    device: str
    requires_grad: bool
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., stride: _Optional[_Union[IntList, _Mapping]] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., requires_grad: _Optional[bool] = ...) -> None: ...

class FullRequest(_message.Message):
    __slots__ = ("shape", "dtype", "device", "value", "requires_grad")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    REQUIRES_GRAD_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    device: str
    value: Scalar
    requires_grad: bool
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., value: _Optional[_Union[Scalar, _Mapping]] = ..., requires_grad: _Optional[bool] = ...) -> None: ...

class ArangeRequest(_message.Message):
    __slots__ = ("start", "end", "step", "dtype", "device", "requires_grad")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    REQUIRES_GRAD_FIELD_NUMBER: _ClassVar[int]
    start: Scalar
    end: Scalar
    step: Scalar
    dtype: str
    device: str
    requires_grad: bool
    def __init__(self, start: _Optional[_Union[Scalar, _Mapping]] = ..., end: _Optional[_Union[Scalar, _Mapping]] = ..., step: _Optional[_Union[Scalar, _Mapping]] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., requires_grad: _Optional[bool] = ...) -> None: ...

class CloneRequest(_message.Message):
    __slots__ = ("handle", "memory_format")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FORMAT_FIELD_NUMBER: _ClassVar[int]
    handle: str
    memory_format: str
    def __init__(self, handle: _Optional[str] = ..., memory_format: _Optional[str] = ...) -> None: ...

class ReshapeRequest(_message.Message):
    __slots__ = ("handle", "shape")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    handle: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, handle: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class ToRequest(_message.Message):
    __slots__ = ("handle", "device", "dtype", "copy")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    COPY_FIELD_NUMBER: _ClassVar[int]
    handle: str
    device: str
    dtype: str
    copy: bool
    def __init__(self, handle: _Optional[str] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., copy: _Optional[bool] = ...) -> None: ...

class RepeatRequest(_message.Message):
    __slots__ = ("handle", "repeats")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    REPEATS_FIELD_NUMBER: _ClassVar[int]
    handle: str
    repeats: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, handle: _Optional[str] = ..., repeats: _Optional[_Iterable[int]] = ...) -> None: ...

class CatRequest(_message.Message):
    __slots__ = ("handles", "dim")
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    handles: _containers.RepeatedScalarFieldContainer[str]
    dim: int
    def __init__(self, handles: _Optional[_Iterable[str]] = ..., dim: _Optional[int] = ...) -> None: ...

class CopyRequest(_message.Message):
    __slots__ = ("dst", "src")
    DST_FIELD_NUMBER: _ClassVar[int]
    SRC_FIELD_NUMBER: _ClassVar[int]
    dst: str
    src: str
    def __init__(self, dst: _Optional[str] = ..., src: _Optional[str] = ...) -> None: ...

class FillRequest(_message.Message):
    __slots__ = ("handle", "value")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    handle: str
    value: Scalar
    def __init__(self, handle: _Optional[str] = ..., value: _Optional[_Union[Scalar, _Mapping]] = ...) -> None: ...

class SetItemRequest(_message.Message):
    __slots__ = ("handle", "index", "scalar", "src_handle")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SCALAR_FIELD_NUMBER: _ClassVar[int]
    SRC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    handle: str
    index: _containers.RepeatedCompositeFieldContainer[IndexItem]
    scalar: Scalar
    src_handle: str
    def __init__(self, handle: _Optional[str] = ..., index: _Optional[_Iterable[_Union[IndexItem, _Mapping]]] = ..., scalar: _Optional[_Union[Scalar, _Mapping]] = ..., src_handle: _Optional[str] = ...) -> None: ...

class UploadHeader(_message.Message):
    __slots__ = ("shape", "dtype", "device", "nbytes", "requires_grad", "checksum")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    REQUIRES_GRAD_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    device: str
    nbytes: int
    requires_grad: bool
    checksum: bool
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., nbytes: _Optional[int] = ..., requires_grad: _Optional[bool] = ..., checksum: _Optional[bool] = ...) -> None: ...

class RawChunk(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class DownloadRequest(_message.Message):
    __slots__ = ("handle", "chunk_bytes")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    handle: str
    chunk_bytes: int
    def __init__(self, handle: _Optional[str] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class ShareRequest(_message.Message):
    __slots__ = ("handle", "uses", "unlimited_uses", "ttl_seconds")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    USES_FIELD_NUMBER: _ClassVar[int]
    UNLIMITED_USES_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    handle: str
    uses: int
    unlimited_uses: bool
    ttl_seconds: float
    def __init__(self, handle: _Optional[str] = ..., uses: _Optional[int] = ..., unlimited_uses: _Optional[bool] = ..., ttl_seconds: _Optional[float] = ...) -> None: ...

class ShareResponse(_message.Message):
    __slots__ = ("token", "ttl_seconds")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    token: str
    ttl_seconds: float
    def __init__(self, token: _Optional[str] = ..., ttl_seconds: _Optional[float] = ...) -> None: ...

class RevokeRequest(_message.Message):
    __slots__ = ("token",)
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    token: str
    def __init__(self, token: _Optional[str] = ...) -> None: ...

class RevokeResponse(_message.Message):
    __slots__ = ("revoked",)
    REVOKED_FIELD_NUMBER: _ClassVar[int]
    revoked: bool
    def __init__(self, revoked: _Optional[bool] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("token",)
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    token: str
    def __init__(self, token: _Optional[str] = ...) -> None: ...

class PutNameRequest(_message.Message):
    __slots__ = ("name", "handle", "overwrite", "staged")
    NAME_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    OVERWRITE_FIELD_NUMBER: _ClassVar[int]
    STAGED_FIELD_NUMBER: _ClassVar[int]
    name: str
    handle: str
    overwrite: bool
    staged: StagedTensor
    def __init__(self, name: _Optional[str] = ..., handle: _Optional[str] = ..., overwrite: _Optional[bool] = ..., staged: _Optional[_Union[StagedTensor, _Mapping]] = ...) -> None: ...

class PutNameResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StagedTensor(_message.Message):
    __slots__ = ("handle", "byte_offset", "shape", "dtype")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    BYTE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    handle: str
    byte_offset: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, handle: _Optional[str] = ..., byte_offset: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class PutNamesRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[PutNameRequest]
    def __init__(self, items: _Optional[_Iterable[_Union[PutNameRequest, _Mapping]]] = ...) -> None: ...

class PutNamesResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetNamesRequest(_message.Message):
    __slots__ = ("names", "export", "server_instance", "mapped_segments")
    NAMES_FIELD_NUMBER: _ClassVar[int]
    EXPORT_FIELD_NUMBER: _ClassVar[int]
    SERVER_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    MAPPED_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    export: bool
    server_instance: str
    mapped_segments: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, names: _Optional[_Iterable[str]] = ..., export: _Optional[bool] = ..., server_instance: _Optional[str] = ..., mapped_segments: _Optional[_Iterable[int]] = ...) -> None: ...

class GetNamesResponse(_message.Message):
    __slots__ = ("tensors", "exports", "export_refusal")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    EXPORTS_FIELD_NUMBER: _ClassVar[int]
    EXPORT_REFUSAL_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    exports: _containers.RepeatedCompositeFieldContainer[ExportResponse]
    export_refusal: str
    def __init__(self, tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., exports: _Optional[_Iterable[_Union[ExportResponse, _Mapping]]] = ..., export_refusal: _Optional[str] = ...) -> None: ...

class DeleteNamesRequest(_message.Message):
    __slots__ = ("names",)
    NAMES_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, names: _Optional[_Iterable[str]] = ...) -> None: ...

class DeleteNamesResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetNameExportRequest(_message.Message):
    __slots__ = ("name", "server_instance", "mapped_segments")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SERVER_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    MAPPED_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    server_instance: str
    mapped_segments: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., server_instance: _Optional[str] = ..., mapped_segments: _Optional[_Iterable[int]] = ...) -> None: ...

class GetNameExportResponse(_message.Message):
    __slots__ = ("tensor", "export", "export_refusal")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    EXPORT_FIELD_NUMBER: _ClassVar[int]
    EXPORT_REFUSAL_FIELD_NUMBER: _ClassVar[int]
    tensor: TensorMeta
    export: ExportResponse
    export_refusal: str
    def __init__(self, tensor: _Optional[_Union[TensorMeta, _Mapping]] = ..., export: _Optional[_Union[ExportResponse, _Mapping]] = ..., export_refusal: _Optional[str] = ...) -> None: ...

class GetNameRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeleteNameRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeleteNameResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListNamesRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListNamesResponse(_message.Message):
    __slots__ = ("names", "next_page_token")
    NAMES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    next_page_token: str
    def __init__(self, names: _Optional[_Iterable[str]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: str
    def __init__(self, node: _Optional[str] = ...) -> None: ...

class CopyToNodeRequest(_message.Message):
    __slots__ = ("handle", "node", "device", "target_session_id")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    TARGET_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    handle: str
    node: str
    device: str
    target_session_id: str
    def __init__(self, handle: _Optional[str] = ..., node: _Optional[str] = ..., device: _Optional[str] = ..., target_session_id: _Optional[str] = ...) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("node", "address", "devices", "version", "incarnation")
    NODE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    node: str
    address: str
    devices: _containers.RepeatedCompositeFieldContainer[DeviceInfo]
    version: str
    incarnation: str
    def __init__(self, node: _Optional[str] = ..., address: _Optional[str] = ..., devices: _Optional[_Iterable[_Union[DeviceInfo, _Mapping]]] = ..., version: _Optional[str] = ..., incarnation: _Optional[str] = ...) -> None: ...

class ListNodesResponse(_message.Message):
    __slots__ = ("node", "nodes")
    NODE_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    node: str
    nodes: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    def __init__(self, node: _Optional[str] = ..., nodes: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ...) -> None: ...

class DeviceRequest(_message.Message):
    __slots__ = ("device",)
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    device: str
    def __init__(self, device: _Optional[str] = ...) -> None: ...

class MemoryStatsResponse(_message.Message):
    __slots__ = ("counters", "ratios")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class RatiosEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    RATIOS_FIELD_NUMBER: _ClassVar[int]
    counters: _containers.ScalarMap[str, int]
    ratios: _containers.ScalarMap[str, float]
    def __init__(self, counters: _Optional[_Mapping[str, int]] = ..., ratios: _Optional[_Mapping[str, float]] = ...) -> None: ...

class MemorySummaryResponse(_message.Message):
    __slots__ = ("summary",)
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    summary: str
    def __init__(self, summary: _Optional[str] = ...) -> None: ...

class MemorySnapshotRequest(_message.Message):
    __slots__ = ("device", "page_size", "page_token")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    device: str
    page_size: int
    page_token: str
    def __init__(self, device: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class MemorySnapshotResponse(_message.Message):
    __slots__ = ("snapshot_json", "next_page_token")
    SNAPSHOT_JSON_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    snapshot_json: bytes
    next_page_token: str
    def __init__(self, snapshot_json: _Optional[bytes] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class EmptyCacheResponse(_message.Message):
    __slots__ = ("released_bytes",)
    RELEASED_BYTES_FIELD_NUMBER: _ClassVar[int]
    released_bytes: int
    def __init__(self, released_bytes: _Optional[int] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("handles",)
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    handles: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, handles: _Optional[_Iterable[str]] = ...) -> None: ...

class PrefetchResponse(_message.Message):
    __slots__ = ("queued",)
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    queued: int
    def __init__(self, queued: _Optional[int] = ...) -> None: ...

class PinToDeviceRequest(_message.Message):
    __slots__ = ("handle", "pinned")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    handle: str
    pinned: bool
    def __init__(self, handle: _Optional[str] = ..., pinned: _Optional[bool] = ...) -> None: ...

class PinToDeviceResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExportRequest(_message.Message):
    __slots__ = ("handle", "server_instance", "mapped_segments")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    SERVER_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    MAPPED_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    handle: str
    server_instance: str
    mapped_segments: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, handle: _Optional[str] = ..., server_instance: _Optional[str] = ..., mapped_segments: _Optional[_Iterable[int]] = ...) -> None: ...

class ExportResponse(_message.Message):
    __slots__ = ("export_id", "segment_id", "segment_nbytes", "storage_byte_offset", "device", "fd_socket", "ticket", "ipc_handle", "server_instance", "tensor")
    EXPORT_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_NBYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_BYTE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    FD_SOCKET_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    SERVER_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    export_id: str
    segment_id: int
    segment_nbytes: int
    storage_byte_offset: int
    device: str
    fd_socket: str
    ticket: str
    ipc_handle: bytes
    server_instance: str
    tensor: TensorMeta
    def __init__(self, export_id: _Optional[str] = ..., segment_id: _Optional[int] = ..., segment_nbytes: _Optional[int] = ..., storage_byte_offset: _Optional[int] = ..., device: _Optional[str] = ..., fd_socket: _Optional[str] = ..., ticket: _Optional[str] = ..., ipc_handle: _Optional[bytes] = ..., server_instance: _Optional[str] = ..., tensor: _Optional[_Union[TensorMeta, _Mapping]] = ...) -> None: ...

class ReleaseExportsRequest(_message.Message):
    __slots__ = ("export_ids", "mapped_segments", "closed_imports")
    EXPORT_IDS_FIELD_NUMBER: _ClassVar[int]
    MAPPED_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    CLOSED_IMPORTS_FIELD_NUMBER: _ClassVar[int]
    export_ids: _containers.RepeatedScalarFieldContainer[str]
    mapped_segments: _containers.RepeatedScalarFieldContainer[int]
    closed_imports: _containers.RepeatedCompositeFieldContainer[ClosedImport]
    def __init__(self, export_ids: _Optional[_Iterable[str]] = ..., mapped_segments: _Optional[_Iterable[int]] = ..., closed_imports: _Optional[_Iterable[_Union[ClosedImport, _Mapping]]] = ...) -> None: ...

class ClosedImport(_message.Message):
    __slots__ = ("segment_id", "exports")
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    EXPORTS_FIELD_NUMBER: _ClassVar[int]
    segment_id: int
    exports: int
    def __init__(self, segment_id: _Optional[int] = ..., exports: _Optional[int] = ...) -> None: ...

class ReleaseExportsResponse(_message.Message):
    __slots__ = ("released", "gone_segments")
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    GONE_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    released: int
    gone_segments: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, released: _Optional[int] = ..., gone_segments: _Optional[_Iterable[int]] = ...) -> None: ...

class EmptyExportRequest(_message.Message):
    __slots__ = ("empty", "release_handles", "release_exports")
    EMPTY_FIELD_NUMBER: _ClassVar[int]
    RELEASE_HANDLES_FIELD_NUMBER: _ClassVar[int]
    RELEASE_EXPORTS_FIELD_NUMBER: _ClassVar[int]
    empty: EmptyRequest
    release_handles: _containers.RepeatedScalarFieldContainer[str]
    release_exports: ReleaseExportsRequest
    def __init__(self, empty: _Optional[_Union[EmptyRequest, _Mapping]] = ..., release_handles: _Optional[_Iterable[str]] = ..., release_exports: _Optional[_Union[ReleaseExportsRequest, _Mapping]] = ...) -> None: ...

class EmptyExportResponse(_message.Message):
    __slots__ = ("export", "released_exports")
    EXPORT_FIELD_NUMBER: _ClassVar[int]
    RELEASED_EXPORTS_FIELD_NUMBER: _ClassVar[int]
    export: ExportResponse
    released_exports: ReleaseExportsResponse
    def __init__(self, export: _Optional[_Union[ExportResponse, _Mapping]] = ..., released_exports: _Optional[_Union[ReleaseExportsResponse, _Mapping]] = ...) -> None: ...

class BatchOp(_message.Message):
    __slots__ = ("view", "fill", "copy", "set_item", "release", "reshape", "delete_name", "delete_names", "results")
    VIEW_FIELD_NUMBER: _ClassVar[int]
    FILL_FIELD_NUMBER: _ClassVar[int]
    COPY_FIELD_NUMBER: _ClassVar[int]
    SET_ITEM_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    RESHAPE_FIELD_NUMBER: _ClassVar[int]
    DELETE_NAME_FIELD_NUMBER: _ClassVar[int]
    DELETE_NAMES_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    view: ViewRequest
    fill: FillRequest
    copy: CopyRequest
    set_item: SetItemRequest
    release: ReleaseRequest
    reshape: ReshapeRequest
    delete_name: DeleteNameRequest
    delete_names: DeleteNamesRequest
    results: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, view: _Optional[_Union[ViewRequest, _Mapping]] = ..., fill: _Optional[_Union[FillRequest, _Mapping]] = ..., copy: _Optional[_Union[CopyRequest, _Mapping]] = ..., set_item: _Optional[_Union[SetItemRequest, _Mapping]] = ..., release: _Optional[_Union[ReleaseRequest, _Mapping]] = ..., reshape: _Optional[_Union[ReshapeRequest, _Mapping]] = ..., delete_name: _Optional[_Union[DeleteNameRequest, _Mapping]] = ..., delete_names: _Optional[_Union[DeleteNamesRequest, _Mapping]] = ..., results: _Optional[_Iterable[str]] = ...) -> None: ...

class BatchRequest(_message.Message):
    __slots__ = ("ops",)
    OPS_FIELD_NUMBER: _ClassVar[int]
    ops: _containers.RepeatedCompositeFieldContainer[BatchOp]
    def __init__(self, ops: _Optional[_Iterable[_Union[BatchOp, _Mapping]]] = ...) -> None: ...

class BatchResponse(_message.Message):
    __slots__ = ("applied", "failed", "failed_index", "error_type", "error_message", "error_code", "error_details", "copies")
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    FAILED_INDEX_FIELD_NUMBER: _ClassVar[int]
    ERROR_TYPE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_DETAILS_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    applied: int
    failed: bool
    failed_index: int
    error_type: str
    error_message: str
    error_code: int
    error_details: str
    copies: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    def __init__(self, applied: _Optional[int] = ..., failed: _Optional[bool] = ..., failed_index: _Optional[int] = ..., error_type: _Optional[str] = ..., error_message: _Optional[str] = ..., error_code: _Optional[int] = ..., error_details: _Optional[str] = ..., copies: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ...) -> None: ...

class AdvancedIndexItem(_message.Message):
    __slots__ = ("basic", "tensor", "boolean")
    BASIC_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    BOOLEAN_FIELD_NUMBER: _ClassVar[int]
    basic: IndexItem
    tensor: str
    boolean: bool
    def __init__(self, basic: _Optional[_Union[IndexItem, _Mapping]] = ..., tensor: _Optional[str] = ..., boolean: _Optional[bool] = ...) -> None: ...

class AdvancedIndexRequest(_message.Message):
    __slots__ = ("handle", "index", "raw", "op")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    handle: str
    index: _containers.RepeatedCompositeFieldContainer[AdvancedIndexItem]
    raw: bool
    op: str
    def __init__(self, handle: _Optional[str] = ..., index: _Optional[_Iterable[_Union[AdvancedIndexItem, _Mapping]]] = ..., raw: _Optional[bool] = ..., op: _Optional[str] = ...) -> None: ...

class AdvancedSetItemRequest(_message.Message):
    __slots__ = ("handle", "index", "raw", "scalar", "src_handle", "accumulate", "value_requires_grad")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    SCALAR_FIELD_NUMBER: _ClassVar[int]
    SRC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    ACCUMULATE_FIELD_NUMBER: _ClassVar[int]
    VALUE_REQUIRES_GRAD_FIELD_NUMBER: _ClassVar[int]
    handle: str
    index: _containers.RepeatedCompositeFieldContainer[AdvancedIndexItem]
    raw: bool
    scalar: Scalar
    src_handle: str
    accumulate: bool
    value_requires_grad: bool
    def __init__(self, handle: _Optional[str] = ..., index: _Optional[_Iterable[_Union[AdvancedIndexItem, _Mapping]]] = ..., raw: _Optional[bool] = ..., scalar: _Optional[_Union[Scalar, _Mapping]] = ..., src_handle: _Optional[str] = ..., accumulate: _Optional[bool] = ..., value_requires_grad: _Optional[bool] = ...) -> None: ...

class ResizeRequest(_message.Message):
    __slots__ = ("handle", "size", "memory_format")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FORMAT_FIELD_NUMBER: _ClassVar[int]
    handle: str
    size: _containers.RepeatedScalarFieldContainer[int]
    memory_format: str
    def __init__(self, handle: _Optional[str] = ..., size: _Optional[_Iterable[int]] = ..., memory_format: _Optional[str] = ...) -> None: ...

class SetStorageRequest(_message.Message):
    __slots__ = ("handle", "source", "source_is_storage", "storage_offset", "size", "stride")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_IS_STORAGE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    handle: str
    source: str
    source_is_storage: bool
    storage_offset: int
    size: IntList
    stride: IntList
    def __init__(self, handle: _Optional[str] = ..., source: _Optional[str] = ..., source_is_storage: _Optional[bool] = ..., storage_offset: _Optional[int] = ..., size: _Optional[_Union[IntList, _Mapping]] = ..., stride: _Optional[_Union[IntList, _Mapping]] = ...) -> None: ...

class ComplexView(_message.Message):
    __slots__ = ("op",)
    OP_FIELD_NUMBER: _ClassVar[int]
    op: str
    def __init__(self, op: _Optional[str] = ...) -> None: ...
