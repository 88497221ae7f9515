"""DESIGN.md's error table, over the wire: status codes, texts and the tensord-error-type trailer."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from tensord import errors
from tensord import schema as pb
from tensord_server.rpc import status


def _error(call) -> tuple[grpc.StatusCode, str, str | None]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    trailer = dict(info.value.trailing_metadata() or ())
    return info.value.code(), info.value.details(), trailer.get("tensord-error-type")


def test_unknown_handle_token_and_name_are_not_found(stub) -> None:
    md = stub.md
    for call in (
        lambda: stub.Clone(pb.CloneRequest(handle="made-up"), metadata=md),
        lambda: stub.Attach(pb.AttachRequest(token="made-up"), metadata=md),
        lambda: stub.GetName(pb.GetNameRequest(name="made-up"), metadata=md),
    ):
        code, _, kind = _error(call)
        assert (code, kind) == (grpc.StatusCode.NOT_FOUND, "LookupError")


def test_bad_arguments_are_invalid_argument_with_torch_type(stub) -> None:
    meta = stub.upload(np.arange(6, dtype=np.float32).reshape(2, 3))
    (t,) = stub.view(meta, t=pb.T())
    cases = [
        (lambda: stub.view(t, view=pb.ViewShape(shape=[6])), "RuntimeError"),  # not viewable
        (lambda: stub.view(meta, select=pb.Select(dim=3, index=0)), "IndexError"),  # bad dim
        (lambda: stub.view(meta, view_dtype=pb.ViewDtype(dtype="float7")), "TypeError"),  # dtype
        (
            lambda: stub.view(meta, as_strided=pb.AsStrided(size=[4, 4], stride=[4, 1])),
            "RuntimeError",
        ),  # out of bounds
        (lambda: stub.Empty(pb.EmptyRequest(shape=[-1]), metadata=stub.md), "RuntimeError"),
        (lambda: stub.view(meta), "ValueError"),  # no op at all
    ]
    for call, kind in cases:
        code, details, got_kind = _error(call)
        assert (code, got_kind) == (grpc.StatusCode.INVALID_ARGUMENT, kind), details
    code, details, kind = _error(lambda: stub.view(t, view=pb.ViewShape(shape=[6])))
    assert details.startswith("view size is not compatible with input tensor's size and stride")


def test_exhausted_pool_is_resource_exhausted(make_server, open_session) -> None:
    server = make_server(devices=("cpu=4MiB",))
    session = open_session(server.address)
    code, details, kind = _error(
        lambda: session.Empty(pb.EmptyRequest(shape=[64 << 20], dtype="uint8"), metadata=session.md)
    )
    assert (code, kind) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "RuntimeError")
    assert "out of memory" in details.lower() or "Tried to allocate" in details
    # nothing was lost: the server keeps serving from the same pool
    small = session.upload(np.ones(1000, dtype=np.float32))
    assert (session.download(small) == 1).all()


def test_missing_session_is_unauthenticated(stub) -> None:
    code, details, kind = _error(lambda: stub.ListNames(pb.ListNamesRequest()))
    assert code is grpc.StatusCode.UNAUTHENTICATED
    assert "tensord-session" in details and kind == "PermissionError"


def test_absent_device_is_failed_precondition(stub) -> None:
    for device in ("cuda:0", "cuda", "tpu"):
        code, details, kind = _error(
            lambda device=device: stub.Empty(
                pb.EmptyRequest(shape=[2], device=device), metadata=stub.md
            )
        )
        assert (code, kind) == (grpc.StatusCode.FAILED_PRECONDITION, "RuntimeError"), details
    meta = stub.upload(np.ones(2, dtype=np.float32))
    code, details, _ = _error(
        lambda: stub.To(pb.ToRequest(handle=meta.handle, device="cuda:1"), metadata=stub.md)
    )
    assert code is grpc.StatusCode.FAILED_PRECONDITION
    assert details == "device cuda:1 is not present on this server (it has: cpu)"
    code, *_ = _error(lambda: stub.MemoryStats(pb.DeviceRequest(device="cuda:0"), metadata=stub.md))
    assert code is grpc.StatusCode.FAILED_PRECONDITION


@pytest.mark.parametrize(
    ("exc", "code", "kind"),
    [
        (errors.NotFoundError("x"), grpc.StatusCode.NOT_FOUND, "LookupError"),
        (errors.AlreadyExistsError("x"), grpc.StatusCode.ALREADY_EXISTS, "ValueError"),
        (errors.TensordRuntimeError("x"), grpc.StatusCode.INVALID_ARGUMENT, "RuntimeError"),
        (errors.TensordIndexError("x"), grpc.StatusCode.INVALID_ARGUMENT, "IndexError"),
        (errors.TensordTypeError("x"), grpc.StatusCode.INVALID_ARGUMENT, "TypeError"),
        (errors.InvalidArgumentError("x"), grpc.StatusCode.INVALID_ARGUMENT, "ValueError"),
        (errors.OutOfMemoryError("x"), grpc.StatusCode.RESOURCE_EXHAUSTED, "RuntimeError"),
        (
            errors.ResourceExhaustedError("x"),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "ResourceExhaustedError",
        ),
        (errors.UnauthenticatedError("x"), grpc.StatusCode.UNAUTHENTICATED, "PermissionError"),
        (errors.PermissionDeniedError("x"), grpc.StatusCode.PERMISSION_DENIED, "PermissionError"),
        (errors.FailedPreconditionError("x"), grpc.StatusCode.FAILED_PRECONDITION, "RuntimeError"),
        (errors.UnavailableError("x"), grpc.StatusCode.UNAVAILABLE, "ConnectionError"),
        (errors.InternalError("x"), grpc.StatusCode.INTERNAL, "RuntimeError"),
        (RuntimeError("x"), grpc.StatusCode.INVALID_ARGUMENT, "RuntimeError"),
        (IndexError("x"), grpc.StatusCode.INVALID_ARGUMENT, "IndexError"),
        (TypeError("x"), grpc.StatusCode.INVALID_ARGUMENT, "TypeError"),
        (ValueError("x"), grpc.StatusCode.INVALID_ARGUMENT, "ValueError"),
        (KeyError("x"), grpc.StatusCode.INTERNAL, "KeyError"),
    ],
)
def test_status_table(exc, code, kind) -> None:
    assert status.status_for(exc) is code
    assert status.error_type_for(exc) == kind
    # every code the table uses is one the SDK's error classes know
    assert exc.__class__.__name__ == "KeyError" or code.name in {
        cls.status_code for cls in errors.registered().values()
    }


def test_the_sdk_reads_the_limit_and_oom_trailers_back() -> None:
    from tensord.wire.status import error_class

    limit = status.error_type_for(errors.ResourceExhaustedError("x"))
    oom = status.error_type_for(errors.OutOfMemoryError("x"))
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error_class(code, limit) is errors.ResourceExhaustedError
    assert error_class(code, oom) is errors.OutOfMemoryError


def test_server_survives_an_internal_error(stub, monkeypatch) -> None:
    from tensord_server.domain.ops.copies import Copies

    def boom(*args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr(Copies, "clone", boom)
    meta = stub.upload(np.ones(3, dtype=np.float32))
    code, details, _ = _error(
        lambda: stub.Clone(pb.CloneRequest(handle=meta.handle), metadata=stub.md)
    )
    assert code is grpc.StatusCode.INTERNAL and "KeyError" in details
    monkeypatch.undo()
    assert stub.Clone(pb.CloneRequest(handle=meta.handle), metadata=stub.md).storage_nbytes == 12


def test_every_issued_handle_is_checked_against_its_storage(make_server) -> None:
    """A layout reaching past its Storage is never registered, whatever op computed it."""
    from tensord import dtypes
    from tensord.layout import Layout
    from tensord_server.domain.storage import TensorRef

    daemon = make_server().daemon
    session, _ = daemon.sessions.open("bounds")
    storage = daemon.storages.allocate(daemon.devices.get("cpu"), 48)  # 12 float32
    try:
        fits = TensorRef(storage, Layout((3, 4), (4, 1), 0), dtypes.float32)
        daemon.sessions.register(session, fits)
        for layout in (Layout((3, 4), (4, 1), 1), Layout((2, 7), (7, 1), 0)):
            with pytest.raises(errors.InternalError, match="out of bounds for storage of size 48"):
                daemon.sessions.register(session, TensorRef(storage, layout, dtypes.float32))
        with pytest.raises(errors.InternalError):  # the same bytes, read as wider elements
            daemon.sessions.register(
                session, fits.with_layout(Layout((7,), (1,), 0), dtypes.float64)
            )
        empty = TensorRef(storage, Layout((0, 100), (100, 1), 999), dtypes.float32)
        daemon.sessions.register(session, empty)  # nothing to reach: torch allows it
        assert daemon.sessions.handle_count(session) == 2
    finally:
        daemon.storages.release_hold(storage)  # allocate returned it held
