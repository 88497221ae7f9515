"""SDK pieces that need no tensord server: repr formatting, data conversion, to() parsing,
and the status-code -> exception mapping (against a bare gRPC server that only fails)."""

from __future__ import annotations

from concurrent import futures

import grpc
import numpy as np
import pytest
import tensord
from tensord import _convert, _format, dtypes, errors
from tensord._args import parse_to, shape_args
from tensord.device import device_name
from tensord.protocol import ERROR_TYPE_KEY
from tensord.wire import status as wire_status
from tensord.wire.requests import index_items

torch = pytest.importorskip("torch")


def torch_repr_of(array: np.ndarray, dtype: dtypes.DType, **suffix: object) -> str:
    """tensord's repr for these values, with torch's prefix so the two compare equal."""
    shape = array.shape
    values = _format.edge_values(array) if _format.summarize(shape) else array
    text = _format.tensor_repr(
        values, shape, dtype, str(suffix.get("device", "cpu")), bool(suffix.get("requires_grad"))
    )
    return text.replace("tensord.", "torch.")


REPR_CASES = [
    torch.arange(12).view(3, 4),
    torch.arange(12, dtype=torch.float32).view(3, 4),
    torch.tensor([1.5, -2.25, 3.0]),
    torch.tensor([1e-5, 1.0, 1e5]),
    torch.tensor([[True, False], [False, True]]),
    torch.tensor(3.5),
    torch.tensor(7),
    torch.tensor([1.0, float("inf"), float("nan")]),
    torch.zeros(0),
    torch.zeros(2, 0, dtype=torch.int32),
    torch.arange(2000).view(40, 50),
    torch.arange(5000, dtype=torch.float64).view(10, 500) / 7,
    torch.arange(24, dtype=torch.int16).view(2, 3, 4),
    torch.tensor([1 + 2j, -3.5 - 1j]),
    torch.tensor([0.1, 0.2], dtype=torch.float16),
    torch.tensor([0.1, 123.0], dtype=torch.bfloat16),
    torch.arange(100, dtype=torch.float32) * 1.5,
    torch.linspace(-1, 1, 30).view(3, 10),
    torch.ones(11, 100, dtype=torch.uint8),
]


@pytest.mark.torch
@pytest.mark.parametrize("t", REPR_CASES, ids=lambda t: f"{t.dtype}-{list(t.shape)}")
def test_repr_matches_torch(t: torch.Tensor) -> None:
    array, dtype = _convert.as_array(t)
    assert torch_repr_of(array, dtype) == repr(t)


@pytest.mark.torch
def test_repr_suffixes_match_torch() -> None:
    t = torch.arange(6, dtype=torch.float32).view(2, 3).requires_grad_()
    array, dtype = _convert.as_array(t)
    assert torch_repr_of(array, dtype, requires_grad=True) == repr(t)
    # torch prints device='cuda:0' for a GPU tensor; we reproduce it without one
    expected = repr(torch.arange(3)).replace(")", ", device='cuda:0')")
    assert torch_repr_of(np.arange(3), dtypes.int64, device="cuda:0") == expected


@pytest.mark.torch
@pytest.mark.parametrize(
    "data",
    [
        1.5,
        3,
        True,
        1 + 2j,
        [1, 2, 3],
        [[1.0, 2.0], [3.0, 4.0]],
        [True, False],
        [True, 2],
        [1, 2.5],
        [],
    ],
)
def test_dtype_inference_matches_torch_tensor(data: object) -> None:
    array, dtype = _convert.as_array(data)
    expected = torch.tensor(data)
    assert dtype == dtypes.from_torch(expected.dtype)
    assert array.shape == tuple(expected.shape)
    np.testing.assert_array_equal(array, expected.numpy())


def test_numpy_and_torch_inputs_keep_their_dtype() -> None:
    array, dtype = _convert.as_array(np.arange(4, dtype=np.float64))
    assert dtype is dtypes.float64
    array, dtype = _convert.as_array(torch.ones(2, 2, dtype=torch.bfloat16))
    assert dtype is dtypes.bfloat16 and array.dtype == dtypes.to_numpy_dtype(dtypes.bfloat16)
    assert array.astype(np.float32).tolist() == [[1.0, 1.0], [1.0, 1.0]]
    array, dtype = _convert.as_array([1, 2], dtypes.float16)
    assert dtype is dtypes.float16 and array.dtype == np.float16
    assert _convert.as_array(np.float64(2.0))[1] is dtypes.float64


def test_argument_forms() -> None:
    assert shape_args((2, 3)) == (2, 3) == shape_args(((2, 3),)) == shape_args(([2, 3],))
    assert shape_args((np.int64(4),)) == (4,)
    assert device_name("cuda") == "cuda:0" and device_name(1) == "cuda:1"
    assert device_name(torch.device("cpu")) == "cpu"
    assert parse_to(("cuda:0",), {}) == ("cuda:0", None, False)
    assert parse_to((tensord.dtypes.float16,), {}) == (None, dtypes.float16, False)
    assert parse_to((torch.float64,), {"copy": True}) == (None, dtypes.float64, True)
    assert parse_to(("cpu", dtypes.int32), {}) == ("cpu", dtypes.int32, False)
    assert parse_to((), {"device": "cpu", "dtype": dtypes.bool}) == ("cpu", dtypes.bool, False)
    assert parse_to(("cpu", dtypes.int8, False, True), {}) == ("cpu", dtypes.int8, True)
    items = index_items((1, slice(None, 3), None, Ellipsis))
    assert [i.WhichOneof("item") for i in items] == ["integer", "slice", "none", "ellipsis"]
    assert not items[1].slice.HasField("start") and items[1].slice.stop == 3


def test_size_and_device_print_like_torch() -> None:
    assert repr(tensord.Size([3, 4])) == repr(torch.Size([3, 4])).replace("torch", "tensord")
    assert tensord.Size([3, 4]).numel() == 12
    assert repr(tensord.Device("cuda:1")) == repr(torch.device("cuda:1"))
    assert repr(tensord.Device("cpu")) == repr(torch.device("cpu"))
    assert tensord.Device("cpu") == "cpu" and tensord.Device("cuda:1").index == 1


@pytest.mark.parametrize(
    ("code", "error_type", "cls", "builtin"),
    [
        (grpc.StatusCode.NOT_FOUND, "", errors.NotFoundError, LookupError),
        (
            grpc.StatusCode.INVALID_ARGUMENT,
            "RuntimeError",
            errors.TensordRuntimeError,
            RuntimeError,
        ),
        (grpc.StatusCode.INVALID_ARGUMENT, "IndexError", errors.TensordIndexError, IndexError),
        (grpc.StatusCode.INVALID_ARGUMENT, "TypeError", errors.TensordTypeError, TypeError),
        (grpc.StatusCode.INVALID_ARGUMENT, "ValueError", errors.InvalidArgumentError, ValueError),
        (grpc.StatusCode.INVALID_ARGUMENT, "", errors.InvalidArgumentError, ValueError),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "RuntimeError", errors.OutOfMemoryError, RuntimeError),
        (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "ResourceExhaustedError",
            errors.ResourceExhaustedError,
            RuntimeError,
        ),
        (grpc.StatusCode.FAILED_PRECONDITION, "", errors.FailedPreconditionError, RuntimeError),
        (grpc.StatusCode.UNAVAILABLE, "", errors.UnavailableError, ConnectionError),
        (grpc.StatusCode.PERMISSION_DENIED, "", errors.PermissionDeniedError, PermissionError),
        (grpc.StatusCode.UNAUTHENTICATED, "", errors.UnauthenticatedError, PermissionError),
        (grpc.StatusCode.INTERNAL, "", errors.InternalError, RuntimeError),
    ],
)
def test_error_class_for_each_status(code, error_type, cls, builtin) -> None:
    found = wire_status.error_class(code, error_type)
    assert found is cls
    assert issubclass(found, builtin) and issubclass(found, errors.TensordError)


class _FailingHandler(grpc.GenericRpcHandler):
    """Fails every call with the status and trailer named in the method path."""

    def service(self, handler_call_details):  # type: ignore[no-untyped-def]
        code_name, error_type = handler_call_details.method.rsplit("/", 2)[-2:]

        def fail(request, context):  # type: ignore[no-untyped-def]
            if error_type:
                context.set_trailing_metadata(((ERROR_TYPE_KEY, error_type),))
            context.abort(grpc.StatusCode[code_name], f"message for {code_name}")

        return grpc.unary_unary_rpc_method_handler(fail)


def test_call_raises_the_mapped_exception_with_the_servers_message() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), handlers=(_FailingHandler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        cases = [
            ("INVALID_ARGUMENT", "IndexError", errors.TensordIndexError),
            ("NOT_FOUND", "", errors.NotFoundError),
            ("RESOURCE_EXHAUSTED", "", errors.OutOfMemoryError),
        ]
        for code_name, error_type, cls in cases:
            method = channel.unary_unary(f"/x/{code_name}/{error_type}")
            with pytest.raises(cls) as info:
                wire_status.call(lambda m=method: m(b"", timeout=10))
            assert str(info.value) == f"message for {code_name}"
    finally:
        channel.close()
        server.stop(None)


def test_connect_without_a_server_raises_a_connection_error() -> None:
    with pytest.raises(ConnectionError, match="no tensord server answers"):
        tensord.connect("127.0.0.1:1", timeout=0.5)
