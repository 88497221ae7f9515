"""The one error registry (tensord.errors): every class travels both ways as itself.

Each class declares its status code (and its machine-readable details); the server's
rpc/status.py and the SDK's wire read the same declarations.  These tests walk every
registered class: encoded by the server, decoded by the SDK (a status with trailers, and
a failed op of a Batch answer), and raised for real by a server handler and a queued op.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import tensord
from tensord import errors
from tensord import schema as pb
from tensord.protocol import ERROR_DETAILS_KEY, ERROR_TYPE_KEY
from tensord.wire import status as wire_status
from tensord_server.domain.ops.copies import Copies
from tensord_server.domain.ops.writes import Writes
from tensord_server.rpc import status

CLASSES = sorted(errors.registered().values(), key=lambda cls: cls.__name__)
TEXT = "the server's own words: 3 of 4"


def sample(cls: type[errors.TensordError]) -> errors.TensordError:
    """An instance of ``cls`` with a value in every detail field."""
    details = {
        name: ("cpu" if name == "device" else 1000 + i) for i, name in enumerate(cls.detail_fields)
    }
    return cls(TEXT, **details)


class FailedCall(grpc.RpcError, grpc.Call):  # type: ignore[misc]
    """What gRPC raises on the SDK's side for a failed call: a status and trailers."""

    def __init__(self, code: grpc.StatusCode, details: str, trailers: Any) -> None:
        self._code, self._details, self._trailers = code, details, trailers

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> Any:
        return self._trailers

    def initial_metadata(self) -> Any:
        return ()

    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> float | None:
        return None

    def cancel(self) -> bool:
        return False

    def add_callback(self, callback: Any) -> bool:
        return False


def test_the_registry_holds_every_error_class() -> None:
    defined = {
        name
        for name, value in vars(errors).items()
        if isinstance(value, type) and issubclass(value, errors.TensordError)
    }
    assert set(errors.registered()) == defined - {"TensordError"}
    assert len(CLASSES) >= 17


@pytest.mark.parametrize("cls", CLASSES, ids=lambda cls: cls.__name__)
def test_each_class_reads_back_as_itself_from_a_status(cls: type[errors.TensordError]) -> None:
    exc = sample(cls)
    code = status.status_for(exc)
    assert code.name == cls.status_code  # the class's own declaration, nothing else
    call = FailedCall(code, status.details_for(exc), status.trailers_for(exc))
    back = wire_status.error_from_rpc(call, "127.0.0.1:1")
    assert type(back) is cls
    assert str(back) == TEXT
    assert back.details == exc.details
    assert back.grpc_code is code  # type: ignore[attr-defined]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda cls: cls.__name__)
def test_each_class_reads_back_as_itself_from_a_batch_answer(
    cls: type[errors.TensordError],
) -> None:
    exc = sample(cls)
    response = pb.BatchResponse(failed=True, **status.batch_error_fields(exc))
    back = wire_status.batch_error(response, response.error_message)
    assert type(back) is cls
    assert str(back) == TEXT
    assert back.details == exc.details


def test_the_deadline_keeps_its_own_code_and_is_a_timeout() -> None:
    exc = errors.DeadlineExceededError(TEXT)
    assert status.status_for(exc) is grpc.StatusCode.DEADLINE_EXCEEDED  # not UNAVAILABLE
    assert status.error_type_for(exc) == "TimeoutError"
    back = wire_status.error_class(grpc.StatusCode.DEADLINE_EXCEEDED, "TimeoutError")
    assert back is errors.DeadlineExceededError
    assert issubclass(back, TimeoutError) and issubclass(back, errors.UnavailableError)


def test_an_out_of_memory_carries_the_pools_figures_beside_torchs_text() -> None:
    exc = errors.OutOfMemoryError(
        "cpu out of memory. Tried to allocate 2.00 MiB.",
        device="cpu",
        requested_bytes=2 << 20,
        capacity_bytes=4 << 20,
    )
    trailers = dict(status.trailers_for(exc))
    assert trailers[ERROR_TYPE_KEY] == "RuntimeError"  # torch's built-in, as before
    assert '"requested_bytes":2097152' in trailers[ERROR_DETAILS_KEY]
    back = errors.read_back(
        "RESOURCE_EXHAUSTED", "RuntimeError", str(exc), trailers[ERROR_DETAILS_KEY]
    )
    assert isinstance(back, errors.OutOfMemoryError)
    assert (back.requested_bytes, back.capacity_bytes, back.free_bytes) == (2 << 20, 4 << 20, None)
    assert str(back) == str(exc)


def test_bad_details_never_keep_the_error_from_being_raised() -> None:
    for details in ("not json", "[1, 2]", '{"nothing_declared": 1}', ""):
        back = errors.read_back("RESOURCE_EXHAUSTED", "RuntimeError", "oom", details)
        assert type(back) is errors.OutOfMemoryError and back.details == {}
    with pytest.raises(TypeError, match="no detail"):
        errors.NotFoundError("x", requested_bytes=1)


def test_builtins_of_bad_input_map_to_our_subclasses_both_ways() -> None:
    for builtin, ours in (
        (IndexError, errors.TensordIndexError),
        (TypeError, errors.TensordTypeError),
        (RuntimeError, errors.TensordRuntimeError),
        (NotImplementedError, errors.TensordNotImplementedError),
        (ValueError, errors.InvalidArgumentError),
    ):
        exc = builtin("bad input")
        assert status.status_for(exc) is grpc.StatusCode.INVALID_ARGUMENT
        mapped = errors.from_builtin(exc)
        assert type(mapped) is ours and str(mapped) == "bad input"
        back = errors.read_back("INVALID_ARGUMENT", status.error_type_for(exc), "bad input")
        assert type(back) is ours
    assert errors.from_builtin(KeyError("a bug")) is None
    assert status.status_for(KeyError("a bug")) is grpc.StatusCode.INTERNAL


def test_a_status_gRPC_sends_itself_reads_as_the_code_s_class() -> None:
    # no trailer: gRPC's own statuses (a message over the size limit, a handler that died)
    assert errors.error_class("RESOURCE_EXHAUSTED", None) is errors.OutOfMemoryError
    assert errors.error_class("UNKNOWN", None) is errors.InternalError
    assert errors.error_class("CANCELLED", None) is errors.TensordError
    assert errors.error_class(None, None) is errors.TensordError
    unreachable = wire_status.error_from_rpc(
        FailedCall(grpc.StatusCode.UNAVAILABLE, "connect failed", ()), "127.0.0.1:1"
    )
    assert type(unreachable) is errors.UnavailableError
    assert "cannot reach the tensord server at 127.0.0.1:1" in str(unreachable)


# ---- raised for real: a handler of the server, and a queued op of a Batch ------------------


@pytest.fixture
def raising(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[BaseException]]:
    """The server's clone and fill raise what the test puts in the list."""
    planted: list[BaseException] = []

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise planted[0]

    monkeypatch.setattr(Copies, "clone", fail)
    monkeypatch.setattr(Writes, "fill", fail)
    yield planted


@pytest.mark.slow
@pytest.mark.parametrize("cls", CLASSES, ids=lambda cls: cls.__name__)
def test_each_class_a_server_raises_reaches_the_caller_as_itself(
    client: tensord.Client, raising: list[BaseException], cls: type[errors.TensordError]
) -> None:
    x = client.arange(4)
    exc = sample(cls)
    raising.append(exc)
    with pytest.raises(cls) as unary:
        x.clone()
    assert type(unary.value) is cls and unary.value.details == exc.details
    assert str(unary.value) == TEXT  # the server's words, even for a deadline or UNAVAILABLE
    x.fill_(1)  # queued: its error is raised at the next wait, naming the op
    with pytest.raises(cls) as queued:
        client.synchronize()
    assert type(queued.value) is cls and queued.value.details == exc.details
    assert str(queued.value).startswith(f"{TEXT} (pipelined op fill_ of ")


def test_the_pools_out_of_memory_reaches_the_caller_with_its_figures(make_server: Any) -> None:
    server = make_server(devices=("cpu=4MiB",))
    with (
        tensord.connect(server.address, local=False) as client,
        pytest.raises(tensord.OutOfMemoryError) as info,
    ):
        client.empty(16 << 20, dtype=tensord.uint8)
    error = info.value
    assert "Tried to allocate 16.00 MiB" in str(error)  # torch's text, as before
    assert error.device == "cpu"
    assert error.requested_bytes == 16 << 20
    assert error.capacity_bytes == 4 << 20
    assert error.free_bytes is not None and error.free_bytes <= 4 << 20
    assert error.allocated_bytes is not None and error.reserved_bytes is not None
