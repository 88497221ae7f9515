"""CRC-32 of bytes, with zlib's polynomial and values, as fast as the machine allows.

Every byte a tier moves or a node copies is checksummed (a spill as it stores, a restore
as it loads; a copy's source as it sends and its target as it stores), so the checksum's
speed bounds theirs.  ISA-L's ``crc32`` folds with carry-less multiplies, an order of
magnitude faster than zlib's over cached bytes, gives the same values (a node, a tier file
and a test's ``zlib.crc32`` agree), and releases the GIL over a large buffer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from isal.isal_zlib import crc32 as _crc32

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer


def crc32(data: ReadableBuffer, crc: int = 0) -> int:
    """zlib.crc32(data, crc): the CRC-32 of ``data`` continuing ``crc``."""
    return _crc32(data, crc)
