"""The Storages' virtual address space (data_ptr): live ranges never overlap and never
move, freed ranges are reused, so the space in use is bounded by the live Storages (an
attacker's aborted huge uploads once advanced a space that only grew, towards 2**64)."""

from __future__ import annotations

import itertools
import math

import grpc
import numpy as np
import pytest
from conftest import SessionStub, open_channel
from hypothesis import given, settings
from hypothesis import strategies as st
from tensord import schema as pb
from tensord.errors import ResourceExhaustedError
from tensord_server.domain.storage import ADDRESS_ALIGNMENT, ADDRESS_SPACE_BASE, AddressSpace
from tensord_server.domain.store import TensorStore
from tensord_server.rpc import handlers

# One step: allocate this many bytes, or free the live range at this index (mod the count).
steps = st.lists(
    st.one_of(
        st.tuples(st.just("take"), st.integers(0, 20_000)),
        st.tuples(st.just("free"), st.integers(0, 1 << 30)),
    ),
    max_size=300,
)


@settings(max_examples=300, deadline=None)
@given(steps)
def test_live_ranges_never_overlap_and_the_space_follows_the_live_bytes(ops) -> None:
    space = AddressSpace()
    live: dict[int, int] = {}  # address -> span
    peak_live, biggest = 0, ADDRESS_ALIGNMENT
    for kind, n in ops:
        if kind == "take":
            address = space.take(n)
            span = AddressSpace.span(n)
            assert address % ADDRESS_ALIGNMENT == 0 and address >= ADDRESS_SPACE_BASE
            assert address not in live
            live[address] = span
            biggest = max(biggest, span)
        elif live:
            address = sorted(live)[n % len(live)]
            space.give_back(address, live.pop(address) - 1)  # any nbytes of the same span
        ranges = sorted(live.items())
        for (a, sa), (b, _) in itertools.pairwise(ranges):
            assert a + sa <= b, "two live Storages overlap"
        live_bytes = sum(live.values())
        peak_live = max(peak_live, live_bytes)
        # nothing is kept above the highest live range; below it, holes only
        assert space.top == (ranges[-1][0] + ranges[-1][1] if ranges else ADDRESS_SPACE_BASE)
        assert space.top - ADDRESS_SPACE_BASE == live_bytes + space.free_bytes_below_top()
        # first fit's fragmentation bound (Robson): peak live bytes x (log2 of the size ratio + 1)
        ratio = biggest // ADDRESS_ALIGNMENT
        assert space.top - ADDRESS_SPACE_BASE <= peak_live * (math.log2(ratio) + 2)
    for address, span in list(live.items()):
        space.give_back(address, span)
    assert space.top == ADDRESS_SPACE_BASE and space.free_bytes_below_top() == 0


def test_first_fit_looks_at_a_path_not_at_every_hole() -> None:
    """Many small Storages leave many holes; finding a range walks one path of the holes'
    tree (O(log n)), not all of them (a scan under the registry's lock slowed every
    allocation by every other tenant's small Storages)."""
    holes = 4096
    space = AddressSpace()
    small = [space.take(ADDRESS_ALIGNMENT) for _ in range(2 * holes)]
    big = space.take(8 * ADDRESS_ALIGNMENT)
    space.take(ADDRESS_ALIGNMENT)  # keeps the big range below the top
    for address in small[::2]:
        space.give_back(address, ADDRESS_ALIGNMENT)
    space.give_back(big, 8 * ADDRESS_ALIGNMENT)
    assert space.free_bytes_below_top() == (holes + 8) * ADDRESS_ALIGNMENT
    before = space.inspected
    assert space.take(8 * ADDRESS_ALIGNMENT) == big  # the only fit: the highest hole
    assert space.inspected - before <= 6 * math.log2(holes)
    before = space.inspected
    assert space.take(ADDRESS_ALIGNMENT) == small[0]  # the lowest hole that fits
    assert space.inspected - before <= 6 * math.log2(holes)


def test_the_end_of_the_space_is_refused_not_wrapped() -> None:
    space = AddressSpace(base=1 << 20, end=(1 << 20) + 4 * ADDRESS_ALIGNMENT)
    space.take(3 * ADDRESS_ALIGNMENT)
    with pytest.raises(ResourceExhaustedError):
        space.take(2 * ADDRESS_ALIGNMENT)
    assert space.take(ADDRESS_ALIGNMENT) == (1 << 20) + 3 * ADDRESS_ALIGNMENT


def test_freed_storages_give_their_addresses_back() -> None:
    """The attack's pattern: big Storages made and freed over and over; the space does
    not grow, and a live Storage's address never changes."""
    daemon = TensorStore(("cpu=64MiB",))
    try:
        registry, cpu = daemon.storages, daemon.devices.get("cpu")
        kept = registry.allocate(cpu, 1000)
        first = registry.allocate(cpu, 32 << 20)
        address = first.data_ptr
        registry.release_hold(first)
        for _ in range(100):
            again = registry.allocate(cpu, 32 << 20)
            assert again.data_ptr == address  # reused: the space did not move on
            assert not address <= kept.data_ptr < address + (32 << 20)
            registry.release_hold(again)
        assert kept.data_ptr == ADDRESS_SPACE_BASE
        registry.release_hold(kept)
    finally:
        daemon.close()


def test_a_reply_that_cannot_be_encoded_leaves_no_handle(make_server, monkeypatch) -> None:
    """A handle the client never receives is released at once, not kept until its session
    ends (a data_ptr past uint64 once failed every reply after the handle was registered)."""
    server = make_server()
    with open_channel(server.address) as channel:
        stub = SessionStub(channel)
        x = stub.upload(np.arange(8, dtype=np.float32))
        session = server.daemon.sessions.get(stub.session_id, "")
        storages, handles = len(server.daemon.storages), len(session.handles)

        def unencodable(issued):
            raise ValueError("Value out of range: 18446744073709551616")

        monkeypatch.setattr(handlers, "encode_meta", unencodable)
        calls = [
            lambda: stub.Clone(pb.CloneRequest(handle=x.handle), metadata=stub.md),
            lambda: stub.View(
                pb.ViewRequest(handle=x.handle, split=pb.Split(split_size=2)), metadata=stub.md
            ),
            lambda: stub.Full(
                pb.FullRequest(shape=[4], value=pb.Scalar(float_value=1.0)), metadata=stub.md
            ),
            lambda: stub.To(pb.ToRequest(handle=x.handle), metadata=stub.md),  # returns self
        ]
        for call in calls:
            with pytest.raises(grpc.RpcError):
                call()
        assert len(session.handles) == handles and x.handle in session.handles
        assert len(server.daemon.storages) == storages
        monkeypatch.undo()
        assert stub.download(x).tolist() == list(range(8))
        stub.close()
