"""The strided-layout math of torch's views, as pure functions over (shape, stride, offset).

Both the server (which checks and issues handles) and the SDK (which predicts
shapes) use this package: :mod:`~tensord.layout.shapes` (contiguity, memory formats,
size inference, ``computeStride``, extents, broadcasting), :mod:`~tensord.layout.views`
(the immutable :class:`Layout` and each view op on it) and
:mod:`~tensord.layout.complex` (complex views and the lazy conjugate and negative
bits).  Each function names the ATen / c10 function it mirrors; results, exception
types and error texts match torch 2.13 eager (CPU) exactly —
``tests/layout/test_layout_vs_torch.py`` checks that against torch.

Strides and offsets are in elements.  Exceptions are the plain built-ins torch
raises (RuntimeError, IndexError, ValueError, TypeError); the service maps them
to status codes.
"""

from tensord.layout.complex import (
    COMPLEX_VIEW_OPS,
    VIEW_AS_REAL_OF_CONJ,
    VIEW_DTYPE_OF_CONJ,
    VIEW_DTYPE_OF_NEG,
    LazyView,
    check_view_dtype_bits,
    complex_view,
    view_as_complex_layout,
    view_as_real_layout,
    view_result_count,
)
from tensord.layout.shapes import (
    CHANNELS_LAST,
    CHANNELS_LAST_3D,
    CONTIGUOUS_FORMAT,
    MEMORY_FORMATS,
    PRESERVE_FORMAT,
    Index,
    IntOrSeq,
    Shape,
    broadcast_shapes,
    compute_stride,
    contiguous_strides,
    copy_broadcast_check,
    infer_size,
    memory_format_strides,
    normalize_dim,
    reach_bounds,
    storage_nbytes,
    strip_leading_ones,
)
from tensord.layout.views import (
    Layout,
    empty_strided_layout,
)

__all__ = [
    "CHANNELS_LAST",
    "CHANNELS_LAST_3D",
    "COMPLEX_VIEW_OPS",
    "CONTIGUOUS_FORMAT",
    "MEMORY_FORMATS",
    "PRESERVE_FORMAT",
    "VIEW_AS_REAL_OF_CONJ",
    "VIEW_DTYPE_OF_CONJ",
    "VIEW_DTYPE_OF_NEG",
    "Index",
    "IntOrSeq",
    "Layout",
    "LazyView",
    "Shape",
    "broadcast_shapes",
    "check_view_dtype_bits",
    "complex_view",
    "compute_stride",
    "contiguous_strides",
    "copy_broadcast_check",
    "empty_strided_layout",
    "infer_size",
    "memory_format_strides",
    "normalize_dim",
    "reach_bounds",
    "storage_nbytes",
    "strip_leading_ones",
    "view_as_complex_layout",
    "view_as_real_layout",
    "view_result_count",
]
