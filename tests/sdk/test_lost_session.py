"""The SDK against a server that goes away: a lost session is a typed error, not "unknown handle"."""

from __future__ import annotations

import re

import pytest
import tensord
from conftest import start_server
from tensord_server.domain.store import TensorStore
from tensord_server.rpc.grpc_server import create_server


def restart_on_same_port(port: int) -> tuple[object, TensorStore]:
    daemon = TensorStore(("cpu=64MiB",), session_grace=0.5, lease=30.0)
    grpc_server, bound = create_server(f"127.0.0.1:{port}", store=daemon)
    assert bound == port
    return grpc_server, daemon


def test_tensors_of_a_session_lost_in_a_server_restart_raise_session_lost() -> None:
    first = start_server()
    client = tensord.connect(first.address)
    x = client.arange(6)
    old_session = client.session_id
    first.stop()
    grpc_server, daemon = restart_on_same_port(first.port)
    try:
        # the first call after the restart learns it; later ones find the session replaced
        for use in (x.tolist, x.clone, lambda: x.view(2, 3), x.tolist):
            with pytest.raises(tensord.SessionLostError, match="server restarted") as caught:
                use()
            assert isinstance(caught.value, RuntimeError)
        assert client.session_id != old_session
        y = client.arange(3)  # made after reconnecting: works
        assert y.clone().tolist() == [0, 1, 2]
        assert "lost" in repr(x)
    finally:
        client.close()
        grpc_server.stop(1.0).wait()  # type: ignore[attr-defined]
        daemon.close()


def test_client_tensor_of_another_clients_tensor_copies_it_into_this_client(
    client: tensord.Client,
) -> None:
    import torch

    with tensord.connect(client.address) as other:
        source = other.arange(6).view(2, 3)
        with pytest.warns(UserWarning, match=re.escape("sourceTensor.detach().clone()")) as ours:
            copy = client.tensor(source, dtype=tensord.float64)
        with pytest.warns(UserWarning) as theirs:
            torch.tensor(torch.arange(6).view(2, 3), dtype=torch.float64)
        assert str(ours[0].message) == str(theirs[0].message)
        assert copy.client is client and copy.dtype == tensord.float64
        assert copy.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
        source[0, 0] = 100  # a copy: the source's later writes do not show
        assert copy.tolist()[0][0] == 0.0
    assert copy.tolist()[1] == [3.0, 4.0, 5.0]  # outlives the other client's session


def test_client_tensor_of_its_own_tensor_is_a_copy(client: tensord.Client) -> None:
    source = client.arange(3)
    with pytest.warns(UserWarning, match="To copy construct from a tensor"):
        copy = client.tensor(source)
    assert copy is not source and copy.handle != source.handle
    source[0] = 9
    assert copy.tolist() == [0, 1, 2]


@pytest.mark.parametrize("shape", [(1,), (1, 1), (2,)])
def test_fill_with_a_tensor_of_dimensions_raises_as_torch(
    client: tensord.Client, shape: tuple[int, ...]
) -> None:
    import torch

    with pytest.raises(RuntimeError) as expected:
        torch.zeros(3).fill_(torch.ones(shape))
    with pytest.raises(tensord.TensordRuntimeError) as got:
        client.zeros(3).fill_(client.ones(*shape))
    assert str(got.value) == str(expected.value)
    assert client.zeros(3).fill_(client.tensor(2.0)).tolist() == [2.0, 2.0, 2.0]


def test_a_deadline_exceeded_is_a_typed_timeout_error() -> None:
    import grpc
    from tensord.wire.status import error_class

    cls = error_class(grpc.StatusCode.DEADLINE_EXCEEDED, None)
    assert cls is tensord.DeadlineExceededError
    assert issubclass(cls, TimeoutError) and issubclass(cls, tensord.UnavailableError)
