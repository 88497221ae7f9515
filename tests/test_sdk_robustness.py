"""The SDK against a server that goes away: a lost session is a typed error, not "unknown handle"."""

from __future__ import annotations

import pytest
import tensord
from conftest import start_server
from tensord_server.server import Daemon, create_server


def restart_on_same_port(port: int) -> tuple[object, Daemon]:
    daemon = Daemon(("cpu=64MiB",), session_grace=0.5, lease=30.0)
    grpc_server, bound = create_server(f"127.0.0.1:{port}", daemon=daemon)
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
