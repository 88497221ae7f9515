"""resize_, resize_as_, set_, is_same_size and is_set_to against torch 2.13.

The handle changes in place (sizes, strides, offset, Storage), other handles keep their
layouts, a Storage too small grows with its bytes kept and every handle on it sees it
grown, and every error has torch's type and text.  The server's own rules: a grown
Storage is charged to its tenant, refused while exported, bounded by --max-op-elements.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import tensord
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensord import dtypes
from tensord_server.domain import storage as storage_module
from tensord_server.domain.quotas import QuotaSpec

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.torch]

HYPOTHESIS = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def outcome(op: Callable[[], Any]) -> tuple[str, Any]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return "ok", op()
    except Exception as e:  # the oracle's error, compared by type and text
        return "error", e


def assert_layout(x: tensord.Tensor, t: Any) -> None:
    assert tuple(x.shape) == tuple(t.shape)
    assert x.stride() == t.stride()
    assert x.storage_offset() == t.storage_offset()
    assert x.dtype == dtypes.from_torch(t.dtype)
    assert x.requires_grad == t.requires_grad
    assert x.untyped_storage().nbytes() == t.untyped_storage().nbytes()


def assert_values(x: tensord.Tensor, t: Any) -> None:
    """Elements compared where torch's are defined (grown bytes are uninitialised there)."""
    np.testing.assert_array_equal(x.detach().numpy(), t.detach().numpy())


def both(x_op: Callable[[], Any], t_op: Callable[[], Any], first_line: bool = False) -> bool:
    """Torch's op then ours: both succeed (True), or the same error type and text."""
    kind, theirs = outcome(t_op)
    if kind == "error":
        with pytest.raises(Exception) as got:
            x_op()
        ours = got.value
        assert isinstance(ours, type(theirs)), (ours, theirs)
        assert isinstance(ours, tensord.TensordError)
        text = str(theirs).split("\nException raised from")[0]
        if first_line:
            assert str(ours).splitlines()[0] == text.splitlines()[0]
        else:
            assert str(ours) == text
        return False
    x_op()
    return True


# ---- resize_ ------------------------------------------------------------------------


@HYPOTHESIS
@given(data=st.data())
def test_resize_matches_torch(client: tensord.Client, data: st.DataObject) -> None:
    n = data.draw(st.integers(0, 12))
    start = data.draw(st.integers(0, n))
    ndim = data.draw(st.integers(0, 4))
    size = tuple(data.draw(st.lists(st.integers(0, 5), min_size=ndim, max_size=ndim)))
    transposed = data.draw(st.booleans())
    fmt = data.draw(st.sampled_from((None, None, "contiguous_format", "channels_last")))
    base_t, base_x = torch.arange(float(n)), client.arange(float(n))
    t, x = base_t[start:], base_x[start:]
    if transposed and n - start >= 6:
        t, x = t[:6].view(2, 3).t(), x[:6].view(2, 3).t()
        size = data.draw(st.sampled_from((size, (3, 2))))  # the same size keeps strides
    kwargs_t = {} if fmt is None else {"memory_format": getattr(torch, fmt)}
    kwargs_x = {} if fmt is None else {"memory_format": getattr(tensord, fmt)}
    before = t.detach().clone()
    if both(lambda: x.resize_(*size, **kwargs_x), lambda: t.resize_(*size, **kwargs_t)):
        assert_layout(x, t)
        # the bytes the old layout had are kept; the base keeps its layout
        assert_values(base_x, base_t)
        kept = min(before.numel(), t.numel())
        if t.is_contiguous() and before.is_contiguous():
            assert_values(x.reshape(-1)[:kept], t.reshape(-1)[:kept])
    else:
        assert_values(base_x, base_t)


RESIZE_CASES: list[Callable[[Any, Any], Any]] = [
    lambda m, y: y.resize_(),
    lambda m, y: y.resize_(-1),
    lambda m, y: y.resize_(2, -3),
    lambda m, y: y.resize_(2**47, 2**14),  # bytes past int64 (sizes within the wire's bound)
    lambda m, y: y.resize_(2**40, 2**40),
    lambda m, y: y.resize_(2.0),
    lambda m, y: y.resize_("a"),
    lambda m, y: y.resize_(None),
    lambda m, y: y.resize_(2, "a"),
    lambda m, y: y.resize_((2, 3.0)),
    lambda m, y: y.resize_([2, 3]),
    lambda m, y: y.resize_(m.Size([2, 3])) if hasattr(m, "Size") else y.resize_((2, 3)),
    lambda m, y: y.resize_(m.tensor(3)),
    lambda m, y: y.resize_(m.tensor([2, 3])),
    lambda m, y: y.resize_(np.int64(2)),
    lambda m, y: y.resize_(()),
    lambda m, y: y.resize_(2, 3, memory_format=m.preserve_format),
    lambda m, y: y.resize_(2, 3, memory_format=m.channels_last),
    lambda m, y: y.resize_(1, 2, 3, 1, memory_format=m.channels_last),
    lambda m, y: y.resize_(1, 2, 3, 1, 1, memory_format=m.channels_last_3d),
    lambda m, y: y.resize_(2, memory_format=3),
    lambda m, y: y.requires_grad_().resize_(6),
    lambda m, y: y.requires_grad_().resize_(7),
    lambda m, y: y.resize_as_(m.zeros(2, 5)),
    lambda m, y: y.resize_as_(m.zeros(3, 2).t()),
    lambda m, y: y.resize_as_(m.zeros(1, 2, 3, 1).contiguous(memory_format=m.channels_last)),
    lambda m, y: y.resize_as_(m.zeros(1, 2, 3, 1), memory_format=m.channels_last),
    lambda m, y: y.resize_as_(
        m.zeros(1, 2, 3, 1).contiguous(memory_format=m.channels_last),
        memory_format=m.preserve_format,
    ),
    lambda m, y: y.resize_as_(m.zeros(2, 5, dtype=m.int64)),
    lambda m, y: y.resize_as_([2, 5]),
    lambda m, y: y.expand(2, 6).resize_(2, 6),  # the same size: the layout kept
    lambda m, y: y.expand(2, 6).resize_(13),
]


class Ours:
    """The tensord side of a case written once for both: the client's factories and
    tensord's names under torch's (``m.zeros(3)``, ``m.int64``)."""

    def __init__(self, client: tensord.Client) -> None:
        self.client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name, None) or getattr(tensord, name)


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(RESIZE_CASES)))
def test_resize_cases_match_torch(client: tensord.Client, case: int) -> None:
    t, x = torch.arange(6.0), client.arange(6.0)
    results: dict[str, Any] = {}

    def ours() -> None:
        results["x"] = RESIZE_CASES[case](Ours(client), x)

    def theirs() -> None:
        results["t"] = RESIZE_CASES[case](torch, t)

    if both(ours, theirs):
        assert results["x"] is not None
        assert_layout(results["x"], results["t"])


def test_resize_grows_the_storage_every_handle_sees_and_keeps_the_bytes(
    client: tensord.Client,
) -> None:
    base = client.arange(6.0)
    view = base[2:4]
    pointer = base.data_ptr()
    grown = base.resize_(3, 4)
    assert grown is base and base.shape == (3, 4) and base.stride() == (4, 1)
    assert base.data_ptr() != pointer  # a new allocation, as torch's realloc
    assert base.reshape(-1)[:6].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert view.shape == (2,) and view.storage_offset() == 2  # other handles: their layout
    view.fill_(9.0)  # ... on the grown Storage: the write lands in base
    assert base.reshape(-1)[:6].tolist() == [0.0, 1.0, 9.0, 9.0, 4.0, 5.0]
    view.resize_(10)  # growing from a view at offset 2: 12 elements needed, 12 there
    assert base.untyped_storage().nbytes() == 48
    view.resize_(11)  # 13 elements: grows again, base sees it on its next metadata refresh
    assert view.untyped_storage().nbytes() == 52
    assert base.reshape(-1).tolist()[:6] == [0.0, 1.0, 9.0, 9.0, 4.0, 5.0]


# ---- set_ -----------------------------------------------------------------------------


SET_CASES: list[Callable[[Any, Any, Any], Any]] = [
    lambda m, y, s: y.set_(),
    lambda m, y, s: y.set_(s.view(3, 4).t()),
    lambda m, y, s: y.set_(s[3:].view(3, 3)),
    lambda m, y, s: y.set_(s.to(m.int64)),
    lambda m, y, s: y.set_(s.untyped_storage()),
    lambda m, y, s: y.set_(s.untyped_storage(), 0),
    lambda m, y, s: y.set_(s.untyped_storage(), 2, (3,)),
    lambda m, y, s: y.set_(s.untyped_storage(), 2, (3, 2), (1, 3)),
    lambda m, y, s: y.set_(s.untyped_storage(), 2, [3, 2], [1, 3]),
    lambda m, y, s: y.set_(s.untyped_storage(), 0, (13,)),  # grows s's Storage
    lambda m, y, s: y.set_(s.untyped_storage(), 0, (4,), (4,)),
    lambda m, y, s: y.set_(s.untyped_storage(), -1, (4,)),
    lambda m, y, s: y.set_(s.untyped_storage(), 0, (-1,)),
    lambda m, y, s: y.set_(s.untyped_storage(), 0, (2, 2), (1,)),
    lambda m, y, s: y.set_(s.untyped_storage(), -1, (3, 2), (1,)),
    lambda m, y, s: y.set_(s.untyped_storage(), 0, (2,), (-1,)),
    lambda m, y, s: y.set_(s.untyped_storage(), 100, (0,)),
    lambda m, y, s: y.set_(s.untyped_storage(), 0, (2,), ()),
    lambda m, y, s: y.set_(s.untyped_storage(), 0, (2,), stride=(2,)),
    lambda m, y, s: y.set_(source=s.untyped_storage(), storage_offset=1, size=(2,), stride=(2,)),
    lambda m, y, s: y.set_(s, 1, (3,), (2,)),
    lambda m, y, s: y.set_(s.to(m.int64), 0, (3,)),
    lambda m, y, s: y.to(m.float64).set_(s.untyped_storage()),
    lambda m, y, s: y.to(m.float64).set_(s.untyped_storage(), 1, (2, 2)),
    lambda m, y, s: y.set_(s.clone().requires_grad_()),
    lambda m, y, s: y.requires_grad_().set_(s),
    lambda m, y, s: y.requires_grad_().set_(),
    lambda m, y, s: y.set_(s, 1),
    lambda m, y, s: y.set_([1, 2]),
    lambda m, y, s: y.set_(s.untyped_storage(), 0, None),
    lambda m, y, s: y.view(2, 1).t().set_(s.untyped_storage(), 4, (1, 2)),  # strides kept
    lambda m, y, s: y.set_().resize_(5),  # a zero-byte Storage grows
    lambda m, y, s: y.set_(y.set_().untyped_storage(), 0, (4,)),
    lambda m, y, s: y.set_(s.to(m.int8).untyped_storage(), 0, (4, 4)),  # another dtype's, grown
    lambda m, y, s: s.set_(s.untyped_storage(), 0, (20,)),  # its own Storage, grown
    lambda m, y, s: y.set_(s.untyped_storage(), 1, (2,), (-1,)),  # reaching below the offset
]


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(SET_CASES)))
def test_set_cases_match_torch(client: tensord.Client, case: int) -> None:
    t, x = torch.zeros(2), client.zeros(2)
    s_t, s_x = torch.arange(12.0), client.arange(12.0)
    results: dict[str, Any] = {}

    def ours() -> None:
        results["x"] = SET_CASES[case](Ours(client), x, s_x)

    def theirs() -> None:
        results["t"] = SET_CASES[case](torch, t, s_t)

    if both(ours, theirs, first_line=True):
        y, r = results["x"], results["t"]
        assert_layout(y, r)
        if r.untyped_storage().data_ptr() == s_t.untyped_storage().data_ptr():
            assert y.untyped_storage().storage_id == s_x.untyped_storage().storage_id
            if r.untyped_storage().nbytes() == 48:  # grown bytes: uninitialised in torch
                assert_values(y, r)  # the source's elements, seen through the new layout
        assert y.is_set_to(s_x) == r.is_set_to(s_t)


def test_set_changes_this_handle_only(client: tensord.Client) -> None:
    x = client.zeros(2)
    other = x.view(2, 1)
    source = client.arange(12.0)
    assert x.set_(source.view(3, 4)) is x
    assert x.is_set_to(source.view(3, 4)) and not x.is_set_to(source)
    assert x.untyped_storage().storage_id == source.untyped_storage().storage_id
    assert other.shape == (2, 1) and other.tolist() == [[0.0], [0.0]]
    x[0, 0] = 100.0  # writes through the shared Storage
    assert source[0].item() == 100.0
    x.set_()
    assert x.shape == (0,) and x.untyped_storage().nbytes() == 0 and x.data_ptr() == 0


def test_sizes_past_the_wire_bound_are_refused_before_torch_would_overflow(
    client: tensord.Client,
) -> None:
    x = client.arange(6.0)
    for size in ((2**62,), (2**61, 2)):
        with pytest.raises(tensord.InvalidArgumentError, match="is outside"):
            x.resize_(*size)
    assert x.shape == (6,)


def test_is_same_size_and_is_set_to_match_torch(client: tensord.Client) -> None:
    x, t = client.zeros(2, 3), torch.zeros(2, 3)
    assert x.is_same_size(client.ones(2, 3, dtype=tensord.int64))
    assert not x.is_same_size(client.ones(3, 2))
    assert x.is_set_to(x) and x[:].is_set_to(x) and not x.t().is_set_to(x)
    assert x.view(tensord.int32).is_set_to(x) == t.view(torch.int32).is_set_to(t)
    assert not client.zeros(0).is_set_to(client.zeros(0))
    for method, arg in (("is_same_size", [2, 3]), ("is_set_to", [1])):
        both(lambda m=method, a=arg: getattr(x, m)(a), lambda m=method, a=arg: getattr(t, m)(a))


# ---- the server's rules for growing a Storage --------------------------------------------


def test_growth_is_bounded_by_max_op_elements_and_charged(make_server: Any) -> None:
    server = make_server(max_op_elements=1000)
    with tensord.connect(server.address) as client:
        x = client.zeros(10)
        with pytest.raises(tensord.ResourceExhaustedError):
            x.resize_(2000)
        assert x.shape == (10,) and x.untyped_storage().nbytes() == 40  # unchanged
        with pytest.raises(tensord.ResourceExhaustedError):
            x.set_(x.untyped_storage(), 0, (2000,))
        before = server.daemon.storages.ledger.usage("", "cpu")
        x.resize_(1000)
        after = server.daemon.storages.ledger.usage("", "cpu")
        assert after.current == before.current - 512 + 4096  # charged as the pool rounds
        assert after.storages == before.storages


def test_growth_of_an_exported_storage_is_refused(client: tensord.Client) -> None:
    x = client.arange(4.0)
    held = np.from_dlpack(x)  # a same-host DLPack export holds the Storage in place
    with pytest.raises(RuntimeError, match="Trying to resize storage that is not resizable"):
        x.resize_(100)
    x.resize_(2)  # shrinking needs no new bytes: allowed, as torch's
    assert held.tolist() == [0.0, 1.0, 2.0, 3.0]
    del held


def test_grown_bytes_are_zeros_never_a_freed_blocks_bytes(client: tensord.Client) -> None:
    # torch leaves them uninitialised; here a freed block may hold another tenant's bytes
    client.full((64,), 5.0).tolist()  # a block that held fives, freed
    x = client.full((3,), 7.0)
    x.resize_(64)
    assert x.tolist() == [7.0] * 3 + [0.0] * 61


def test_a_grown_storage_is_freed_on_release_with_its_block_and_charge(
    fresh_server: Any,
) -> None:
    # the registry's block index must follow the grown Storage to its new block: a stale
    # entry made its free fail (KeyError), leaking the block, its address and its charge
    ledger = fresh_server.daemon.storages.ledger
    with tensord.connect(fresh_server.address) as client:
        before = ledger.usage("", "cpu").current
        x = client.zeros(10)
        x.resize_(1000)
        del x  # its handle's release is queued, sent with the next call
        client.synchronize()  # the release ran (it raised the server's error here before)
        assert ledger.usage("", "cpu").current == before
        assert fresh_server.daemon.storages.live() == []


def test_a_grown_storage_is_freed_and_refunded_when_released(make_server: Any) -> None:
    # the registry finds a Storage by its block (compaction, decref): the grown one's new block
    server = make_server()
    with tensord.connect(server.address) as client:
        x = client.arange(6.0)
        x.resize_(1000)
        (storage,) = server.daemon.storages.live()
        with server.daemon.storages.relocation(storage.device.pool) as movable:
            assert storage.block in movable  # the compactor may move it, by its new block
        del x
        client.flush()
        assert len(server.daemon.storages) == 0
        usage = server.daemon.storages.ledger.usage("", "cpu")
        assert usage.current == 0 and usage.storages == 0
        assert (
            server.daemon.devices.get("cpu").pool.memory_stats()["allocated_bytes.all.current"] == 0
        )


# ---- growing outside the registry's lock: nobody else waits for the copy -----------------

WAIT_S = 5.0  # what another session's quick ops may take while a grow copies (it waited forever)
MiB = 1 << 20


class GatedCopy:
    """A grow's copy made observable: ``entered`` is set inside it, and it goes on only
    after ``release()`` (or GATE_S), so a test acts while a Storage is being copied."""

    GATE_S = 20.0

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered = threading.Event()
        self._go = threading.Event()
        real = storage_module._copy_grown

        def gated(new: Any, old: Any) -> None:
            self.entered.set()
            self._go.wait(self.GATE_S)
            real(new, old)

        monkeypatch.setattr(storage_module, "_copy_grown", gated)

    def release(self) -> None:
        self._go.set()


def in_thread(work: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """``work`` started in a daemon thread; its outcome lands in the dict ("value"/"error")."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = work()
        except BaseException as e:  # reported to the test, which asserts on it
            outcome["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def storage_of(server: Any, x: tensord.Tensor) -> Any:
    (storage,) = (
        s for s in server.daemon.storages.live() if s.id == x.untyped_storage().storage_id
    )
    return storage


def test_a_storage_being_grown_never_stalls_another_sessions_ops(
    make_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = make_server()
    gate = GatedCopy(monkeypatch)
    with tensord.connect(server.address) as grower, tensord.connect(server.address) as other:
        x = grower.arange(6.0)
        mine = other.zeros(4)

        def others_ops() -> Any:
            other.zeros(3)  # an allocation
            mine.view(2, 2).fill_(1.0)  # a view, a write
            return mine.tolist()

        growing, grown = in_thread(lambda: x.resize_(1000))
        worker: threading.Thread | None = None
        done: dict[str, Any] = {}
        try:
            assert gate.entered.wait(10)
            worker, done = in_thread(others_ops)
            worker.join(WAIT_S)
            assert done == {"value": [1.0] * 4}, "another session waited for the copy"
        finally:
            gate.release()
            growing.join(10)
            if worker is not None:
                worker.join(10)
        assert grown == {"value": x}
        assert x.shape == (1000,) and x[:7].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 0.0]


def test_the_compactor_never_moves_a_storage_being_grown(
    make_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = make_server()
    gate = GatedCopy(monkeypatch)
    registry = server.daemon.storages
    with tensord.connect(server.address) as client:
        x, idle = client.arange(6.0), client.ones(3)
        storage, unheld = storage_of(server, x), storage_of(server, idle)
        growing, grown = in_thread(lambda: x.resize_(1000))
        try:
            assert gate.entered.wait(10)

            def movable_now() -> set[Any]:
                with registry.relocation(storage.device.pool) as movable:
                    return set(movable)

            looking, seen = in_thread(movable_now)
            looking.join(WAIT_S)
            # neither its old block (held) nor the new one (not swapped in yet) may move
            assert seen == {"value": {unheld.block}}
        finally:
            gate.release()
            growing.join(10)
        assert grown == {"value": x}
        assert x[:7].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 0.0]
        with registry.relocation(storage.device.pool) as movable:
            assert storage.block in movable  # released: an ordinary Storage again


@pytest.mark.parametrize("meddling", ["write", "export"])
def test_a_hold_taken_during_the_copy_refuses_the_growth_and_changes_nothing(
    make_server: Any, monkeypatch: pytest.MonkeyPatch, meddling: str
) -> None:
    # another session of the tenant writes the old bytes (lost if swapped) or maps them
    server = make_server()
    gate = GatedCopy(monkeypatch)
    ledger, pool = server.daemon.storages.ledger, server.daemon.devices.get("cpu").pool
    with tensord.connect(server.address) as alice, tensord.connect(server.address) as alice2:
        x = alice.arange(6.0)
        y = alice2.attach(x.share())
        pointer, charged = x.data_ptr(), ledger.usage("", "cpu")
        allocated = pool.memory_stats()["allocated_bytes.all.current"]
        exported: list[Any] = []

        def meddle() -> None:
            if meddling == "write":
                y.fill_(5.0)
                alice2.synchronize()  # applied now, not queued (pipelining)
            else:
                exported.append(np.from_dlpack(y))

        growing, grown = in_thread(lambda: x.resize_(1000))
        worker: threading.Thread | None = None
        done: dict[str, Any] = {}
        try:
            assert gate.entered.wait(10)
            worker, done = in_thread(meddle)
            worker.join(WAIT_S)
            assert done == {"value": None}, "the other session waited for the copy"
        finally:
            gate.release()
            growing.join(10)
            if worker is not None:
                worker.join(10)
        error = grown.get("error")
        assert isinstance(error, RuntimeError), grown
        assert str(error) == "Trying to resize storage that is not resizable"
        expected = [5.0] * 6 if meddling == "write" else [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
        assert x.tolist() == expected and x.shape == (6,) and x.data_ptr() == pointer
        assert storage_of(server, x).nbytes == 24
        assert ledger.usage("", "cpu").current == charged.current  # the charge refunded
        assert pool.memory_stats()["allocated_bytes.all.current"] == allocated
        exported.clear()


@pytest.mark.parametrize("limit", ["pool", "quota"])
def test_a_refused_growth_leaves_the_storage_the_handle_and_the_quota_as_they_were(
    make_server: Any, limit: str
) -> None:
    if limit == "pool":
        server = make_server(devices=("cpu=8MiB",))
        error: type[Exception] = tensord.OutOfMemoryError
    else:
        server = make_server(quotas=[QuotaSpec("*", "cpu", 4 * MiB)])
        error = tensord.ResourceExhaustedError
    ledger = server.daemon.storages.ledger
    with tensord.connect(server.address) as client:
        x = client.arange(6.0)
        view = x[1:3]
        pointer, charged = x.data_ptr(), ledger.usage("", "cpu")
        with pytest.raises(error):
            x.resize_(4 * MiB)  # 16 MiB
        with pytest.raises(error):
            view.set_(view.untyped_storage(), 0, (4 * MiB,))
        assert ledger.usage("", "cpu").current == charged.current
        storage = storage_of(server, x)
        assert storage.nbytes == 24 and storage.data_ptr == pointer
        assert x.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
        assert view.shape == (2,) and view.tolist() == [1.0, 2.0]
        x.resize_(100)  # and it may still grow within the limits
        assert x[:7].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 0.0]


def test_a_write_that_flags_requires_grad_keeps_a_concurrent_resize(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """x[idx] = v with a value requiring grad flags x's handle; a resize_ of the same
    handle (another thread of the session) landing while the write runs is not undone
    by the flag (the flag once re-stored the layout the write had looked up)."""
    from tensord_server.domain.ops import indexing
    from tensord_server.domain.ops.context import OpContext
    from tensord_server.domain.ops.indexing import TensorItem
    from tensord_server.domain.store import TensorStore

    daemon = TensorStore(("cpu=64MiB",))
    session, _ = daemon.sessions.open()
    try:
        x = daemon.factories.full(session, [4], 1.0, "float32", "cpu").handle
        index = daemon.factories.full(session, [1], 2, "int64", "cpu").handle
        scatter = indexing.scatter

        def scatter_then_resize(*args: Any, **kwargs: Any) -> None:
            scatter(*args, **kwargs)
            daemon.resizing.resize(session, x, [2, 2])  # lands between the write and its flag

        monkeypatch.setattr(indexing, "scatter", scatter_then_resize)
        issued = daemon.indexing.advanced_setitem(
            session, x, (TensorItem(index),), value=5.0, value_requires_grad=True
        )
        ref = daemon.sessions.lookup(session, x)
        assert ref.layout.shape == (2, 2) and ref.layout.stride == (2, 1)
        assert ref.requires_grad and issued.ref == ref
        assert np.asarray(OpContext.array(ref)).tolist() == [[1.0, 1.0], [5.0, 1.0]]
    finally:
        daemon.close()
