"""The host backend's reads: a large one is copied into its bytes object without the GIL
(``copied_bytes``); either way the bytes are the segment's, and a copy of them."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from tensord_server.devices.memory import GIL_FREE_READ_BYTES, HostBackend, copied_bytes


@pytest.mark.parametrize(
    ("offset", "nbytes"),
    [(0, 1), (7, GIL_FREE_READ_BYTES - 1), (0, GIL_FREE_READ_BYTES), (513, 3 << 20)],
)
def test_a_read_is_the_segments_bytes_and_a_copy_of_them(offset: int, nbytes: int) -> None:
    backend = HostBackend(total_bytes=64 << 20)
    memory = backend.reserve(4 << 20)
    data = np.random.default_rng(nbytes).integers(0, 256, 4 << 20, dtype=np.uint8)
    backend.write(memory, 0, data.tobytes())
    read = backend.read(memory, offset, nbytes)
    assert type(read) is bytes and read == data[offset : offset + nbytes].tobytes()
    backend.view(memory, offset, 1)[:] = ~data[offset]  # the segment changes, not the read
    assert read[0] == data[offset]
    if nbytes >= GIL_FREE_READ_BYTES:  # this name and the call's argument: nothing leaked
        assert sys.getrefcount(read) == 2
    backend.release(memory)


def test_copied_bytes_refuses_nothing_to_copy() -> None:
    with pytest.raises(AssertionError, match="copied_bytes of 0 bytes"):
        copied_bytes(1, 0)
