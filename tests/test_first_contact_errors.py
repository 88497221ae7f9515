"""What a new user reads when something is down or missing: a server that has gone away,
a server that wants a token, and `tensord serve` flags that cannot work together."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import tensord
from conftest import run_serve, start_serve_process, start_server
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


# ---- the Docker image's default command, run without docker ---------------------------------

DOCKERFILE = Path(__file__).resolve().parent.parent / "Dockerfile"


def dockerfile_serve_args() -> list[str]:
    """The arguments after `tensord serve` in the Dockerfile's CMD (its JSON form)."""
    lines = [line for line in DOCKERFILE.read_text().splitlines() if line.startswith("CMD ")]
    assert len(lines) == 1
    command = json.loads(lines[0].removeprefix("CMD "))
    assert command[:2] == ["tensord", "serve"]
    return list(command[2:])


def option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_the_images_default_command_listens_beyond_the_container_only_with_tokens() -> None:
    args = dockerfile_serve_args()
    assert not option(args, "--address").startswith("127.")
    assert "--insecure-allow-remote" not in args


def test_the_images_default_command_without_its_tokens_file_says_how_to_provide_it() -> None:
    args = dockerfile_serve_args()
    assert not Path(option(args, "--auth-tokens")).exists()  # as in a first `docker run`
    result = run_serve(*args)  # it stops before it binds the address
    assert result.returncode == 2
    assert f"cannot read the --auth-tokens file {option(args, '--auth-tokens')}" in result.stderr
    assert "docker run -v" in result.stderr
    assert "docker-compose.yml" in result.stderr
    assert "tensord listening" not in result.stdout


def test_the_images_default_command_with_its_tokens_file_serves(tmp_path: Path) -> None:
    args = dockerfile_serve_args()
    tokens = tmp_path / "tensord_tokens"
    tokens.write_text("tok-alice alice\n")
    args[args.index("--auth-tokens") + 1] = str(tokens)
    args[args.index("--address") + 1] = "127.0.0.1:0"  # the tests listen on loopback only
    process, address = start_serve_process(*args)
    try:
        with tensord.connect(address, token="tok-alice") as client:
            assert client.ones(2).tolist() == [1.0, 1.0]
    finally:
        process.terminate()
        process.communicate(timeout=30)
