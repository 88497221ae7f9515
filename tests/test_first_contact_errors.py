"""What a new user reads when something is down or missing: a server that has gone away,
a server that wants a token, and `tensord serve` flags that cannot work together."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import tensord
from conftest import run_serve, start_server
from tensord_server.tools.serve import max_streams_problem


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda c, x: c.zeros(2), id="unary"),
        pytest.param(lambda c, x: x.tolist(), id="download"),
        pytest.param(lambda c, x: (x[0].fill_(1), c.synchronize()), id="pipelined"),
    ],
)
def test_a_server_that_went_away_is_named_with_a_hint_and_grpcs_status(
    call: Callable[[Any, Any], Any],
) -> None:
    server = start_server()
    client = tensord.connect(server.address)
    try:
        x = client.zeros(3)
        server.stop()
        with pytest.raises(tensord.UnavailableError) as caught:
            call(client, x)
        text = str(caught.value)
        assert text.startswith(f"cannot reach the tensord server at {server.address}: ")
        assert "is the server running?" in text
        assert "(gRPC status UNAVAILABLE: " in text  # gRPC's own words kept after ours
        assert isinstance(caught.value, ConnectionError)
    finally:
        client.close()  # the server is gone: closing gives up on it quietly


def test_a_missing_token_says_how_the_sdk_passes_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TENSORD_TOKEN", raising=False)
    server = start_server(auth_tokens={"tok-alice": "alice"})
    try:
        with pytest.raises(tensord.UnauthenticatedError) as caught:
            tensord.connect(server.address)
        text = str(caught.value)
        assert text.startswith("missing authorization metadata (Bearer token)")
        assert "tensord.connect(token=...)" in text
        assert "$TENSORD_TOKEN" in text
    finally:
        server.stop()


def test_serve_refuses_more_streams_than_the_workers_leave_naming_both_flags() -> None:
    result = run_serve("--address", "127.0.0.1:0", "--max-workers", "4", "--max-streams", "5")
    assert result.returncode == 2
    assert "--max-streams (5)" in result.stderr
    assert "--max-workers 4" in result.stderr
    assert "tensord listening" not in result.stdout


@pytest.mark.parametrize(
    ("max_streams", "max_workers", "refused"),
    [(None, 4, False), (3, 4, False), (4, 4, True), (48, 64, False), (49, 64, True), (1, 1, False)],
)
def test_max_streams_leaves_a_quarter_of_the_workers_as_security_md_says(
    max_streams: int | None, max_workers: int, refused: bool
) -> None:
    assert (max_streams_problem(max_streams, max_workers) is not None) is refused
