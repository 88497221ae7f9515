"""CRC-32 of bytes, with zlib's polynomial and values, as fast as the machine allows.

A cross-node copy checksums every byte twice (the source as it sends, the target as it
stores), so the checksum's speed bounds the copy's: zlib-ng's ``crc32`` (the ``cluster``
extra) folds with carry-less multiplies, several times zlib's speed, and gives the same
values, so nodes with and without it agree.  Without it, zlib's.  Either releases the GIL
over a large buffer.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

_crc32: Callable[[Any, int], int]
try:
    from zlib_ng.zlib_ng import crc32 as _crc32
except ImportError:  # not installed: zlib's own, the same values
    _crc32 = zlib.crc32

#: the implementation in use: "zlib-ng" or "zlib"
IMPLEMENTATION = "zlib" if _crc32 is zlib.crc32 else "zlib-ng"


def crc32(data: ReadableBuffer, crc: int = 0) -> int:
    """zlib.crc32(data, crc): the CRC-32 of ``data`` continuing ``crc``."""
    return _crc32(data, crc)
