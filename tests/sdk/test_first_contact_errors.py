"""What a new user reads when something is down or missing: no server at the address (or
one that never answers), a server that has gone away, a server that wants a token, and
`tensord serve` flags that cannot work together."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensord
import torch
from conftest import run_serve, start_serve_process, start_server
from tensord.wire import address as addresses
from tensord.wire import config
from tensord_server import cli
from tensord_server.rpc.grpc_server import create_server
from tensord_server.tools.serve import max_streams_problem

# Long enough that a wait for gRPC's retries would show in the text ("waited 20 s").
UNHURRIED_TIMEOUT_S = 20.0


@contextlib.contextmanager
def bound_port() -> Iterator[int]:
    """A loopback port bound but not listening: a connection to it is refused, and no other
    socket can take the port meanwhile."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def test_a_refused_port_says_so_at_once_and_names_the_serve_command() -> None:
    with bound_port() as port, pytest.raises(tensord.UnavailableError) as caught:
        tensord.connect(f"127.0.0.1:{port}", timeout=UNHURRIED_TIMEOUT_S)
    text = str(caught.value)
    assert text.startswith(f"no tensord server answers at 127.0.0.1:{port} (connection refused")
    assert "waited" not in text  # not gRPC's retries until the timeout
    assert f"start one with `tensord serve --address 127.0.0.1:{port}`" in text


def test_a_missing_unix_socket_says_so_at_once(tmp_path: Any) -> None:
    address = f"unix:{tmp_path}/tensord.sock"
    with pytest.raises(tensord.UnavailableError) as caught:
        tensord.connect(address, timeout=UNHURRIED_TIMEOUT_S)
    text = str(caught.value)
    assert text.startswith(f"no tensord server answers at {address} (no such socket")
    assert f"`tensord serve --address {address}`" in text


def test_a_host_that_does_not_resolve_says_so_at_once() -> None:
    with pytest.raises(tensord.UnavailableError) as caught:
        tensord.connect("no-such-host.invalid:50051", timeout=UNHURRIED_TIMEOUT_S)
    assert str(caught.value).startswith("cannot resolve the host 'no-such-host.invalid'")


def test_a_remote_host_is_told_to_serve_on_it_with_tokens() -> None:
    hint = addresses.serve_hint("10.1.2.3:6000")
    assert hint.startswith("start one on 10.1.2.3 with `tensord serve --address 0.0.0.0:6000 ")
    assert "--auth-tokens FILE`" in hint  # serve refuses a remote address without them
    assert addresses.serve_hint(tensord.protocol.DEFAULT_ADDRESS).startswith(
        "start one with `tensord serve` "
    )


@pytest.mark.slow
def test_a_silent_address_fails_within_the_connect_timeout_and_says_why() -> None:
    # A full accept queue drops new SYNs, as a firewall does: neither accepted nor refused.
    with socket.socket() as listener, contextlib.ExitStack() as held:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        for _ in range(8):
            filler = held.enter_context(socket.socket())
            filler.settimeout(0.5)
            try:
                filler.connect(listener.getsockname())
            except TimeoutError:
                break
        else:
            pytest.skip("this kernel accepted every connection: no silent address to test")
        with pytest.raises(tensord.UnavailableError) as caught:
            tensord.connect(f"127.0.0.1:{listener.getsockname()[1]}", timeout=1.0)
    text = str(caught.value)
    assert text.startswith("no tensord server answers at 127.0.0.1:")
    assert "neither accepted nor refused in 1 s" in text


@pytest.mark.slow
def test_a_server_that_accepts_but_never_answers_is_not_called_missing() -> None:
    with socket.socket() as hung:  # listening, never accepting: the kernel completes TCP
        hung.bind(("127.0.0.1", 0))
        hung.listen(16)
        address = f"127.0.0.1:{hung.getsockname()[1]}"
        with pytest.raises(tensord.UnavailableError) as caught:
            tensord.connect(address, timeout=1.0)
    text = str(caught.value)
    assert text.startswith(f"something at {address} accepted the connection but did not ")
    assert "no tensord server" not in text
    assert "hung or overloaded" in text
    # the TLS hint is a whole call, not a dangling "root_certificates="
    assert 'connect with tls=True, or root_certificates="ca.pem" for a private CA' in text


@pytest.mark.parametrize(
    ("url", "meant"),
    [
        ("http://127.0.0.1:50051", "'127.0.0.1:50051'"),
        ("https://tensord.example:443/", "'tensord.example:443' and tls=True"),
        ("http://localhost", "'localhost:50051'"),
    ],
)
def test_a_url_is_refused_naming_the_address_to_pass(url: str, meant: str) -> None:
    with pytest.raises(ValueError, match="not a URL") as caught:
        tensord.connect(url, timeout=UNHURRIED_TIMEOUT_S)
    assert f"pass {meant} " in str(caught.value)


@pytest.mark.parametrize(
    ("given", "dialled"),
    [
        ("localhost", "localhost:50051"),
        ("10.0.0.7", "10.0.0.7:50051"),
        ("::1", "[::1]:50051"),
        ("[::1]", "[::1]:50051"),
        ("dns:///tensord.example", "dns:///tensord.example:50051"),
        ("dns:tensord.example", "dns:tensord.example:50051"),
        ("tensord.example:6000", "tensord.example:6000"),
        ("[::1]:6000", "[::1]:6000"),
        ("unix:/run/tensord.sock", "unix:/run/tensord.sock"),
    ],
)
def test_an_address_without_a_port_means_tensords_port_not_443(given: str, dialled: str) -> None:
    assert config.resolve_address(given) == dialled


def test_a_host_without_a_port_connects_to_the_default_port(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = start_server()
    try:
        monkeypatch.setattr(addresses, "DEFAULT_PORT", str(server.port))  # the tests' own port
        monkeypatch.setenv("TENSORD_ADDRESS", "127.0.0.1")
        with tensord.connect(timeout=UNHURRIED_TIMEOUT_S) as client:
            assert client.address == f"127.0.0.1:{server.port}"
            assert client.ones(2).tolist() == [1.0, 1.0]
    finally:
        server.stop()


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


@pytest.mark.slow
def test_serve_refuses_more_streams_than_the_workers_leave_naming_both_flags() -> None:
    result = run_serve("--address", "127.0.0.1:0", "--max-workers", "4", "--max-streams", "5")
    assert result.returncode == 2
    assert "--max-streams (5)" in result.stderr
    assert "--max-workers 4" in result.stderr
    assert "tensord listening" not in result.stdout


@pytest.mark.slow
def test_tensord_aio_works_after_a_plain_import_tensord(server: Any) -> None:
    script = (
        "import asyncio, sys, tensord\n"
        "assert 'tensord.aio' not in sys.modules  # imported on first use only\n"
        "async def main():\n"
        "    async with await tensord.aio.connect(sys.argv[1]) as client:\n"
        "        x = await client.ones(2)\n"
        "        print(await x.tolist())\n"
        "asyncio.run(main())\n"
    )
    completed = subprocess.run(
        [sys.executable, "-c", script, server.address],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert completed.stdout.strip() == "[1.0, 1.0]"


def test_any_other_missing_attribute_of_tensord_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="module 'tensord' has no attribute 'aoi'"):
        tensord.aoi  # noqa: B018


# ---- a torch user's first math on a tensord Tensor: torch's (tests/sdk/test_torch_interop.py) -------


def test_the_way_out_without_torch_still_works(client: Any) -> None:
    x = client.ones(3)
    x.copy_(x.numpy() + 1)
    assert x.tolist() == [2.0, 2.0, 2.0]


def test_any_other_missing_attribute_keeps_pythons_words(client: Any) -> None:
    x = client.ones(1)
    with pytest.raises(AttributeError) as caught:
        x.no_such_thing  # noqa: B018
    assert str(caught.value) == "'Tensor' object has no attribute 'no_such_thing'"
    with pytest.raises(AttributeError) as caught:
        x._no_such_thing  # noqa: B018
    assert str(caught.value) == "'Tensor' object has no attribute '_no_such_thing'"


def _outcome(op: Callable[[Any], Any], operand: Any) -> tuple[str, Any]:
    try:
        with warnings.catch_warnings():  # torch's own __array_wrap__ is deprecated by NumPy 2
            warnings.simplefilter("ignore", DeprecationWarning)
            result = op(operand)
    except Exception as error:
        return type(error).__name__, str(error)
    return type(result).__name__, np.asarray(result).tolist()


@pytest.mark.parametrize(
    "op",
    [lambda v: v + np.arange(3.0), lambda v: np.arange(3.0) + v, lambda v: v > np.arange(3.0)],
)
def test_numpy_operands_compute_as_with_a_torch_tensor(
    client: Any, op: Callable[[Any], Any]
) -> None:
    assert _outcome(op, client.ones(3)) == _outcome(op, torch.ones(3))


def test_tensors_stay_dict_keys_with_an_elementwise_eq(client: Any) -> None:
    x, y = client.ones(3), client.ones(3)
    assert {x: 1, y: 2}[x] == 1 and len({x, y}) == 2  # hashed by identity, as torch's
    assert (x == y).tolist() == [True, True, True]


def test_version_prints_the_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        cli.main(["--version"])
    assert caught.value.code == 0
    assert capsys.readouterr().out == f"tensord {tensord.__version__}\n"


@contextlib.contextmanager
def port_in_use() -> Iterator[int]:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        yield taken.getsockname()[1]


@pytest.mark.slow
def test_serve_on_a_port_in_use_says_address_already_in_use() -> None:
    with port_in_use() as port:
        result = run_serve("--address", f"127.0.0.1:{port}")
    assert result.returncode == 2
    assert f"tensord serve: cannot listen on 127.0.0.1:{port}: address already in use" in (
        result.stderr
    )
    assert result.stderr.count("cannot listen on") == 1
    assert "tensord listening" not in result.stdout


def test_create_server_on_a_port_in_use_raises_address_already_in_use() -> None:
    with port_in_use() as port, pytest.raises(OSError, match="address already in use") as caught:
        create_server(f"127.0.0.1:{port}")
    assert "choose another port (--address 127.0.0.1:PORT; port 0 " in str(caught.value)


@pytest.mark.parametrize(
    ("max_streams", "max_workers", "refused"),
    [(None, 4, False), (3, 4, False), (4, 4, True), (48, 64, False), (49, 64, True), (1, 1, False)],
)
def test_max_streams_leaves_a_quarter_of_the_workers_as_security_md_says(
    max_streams: int | None, max_workers: int, refused: bool
) -> None:
    assert (max_streams_problem(max_streams, max_workers) is not None) is refused


# ---- the Docker image's default command, run without docker ---------------------------------

DOCKERFILE = Path(__file__).resolve().parents[2] / "Dockerfile"


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


@pytest.mark.slow
def test_the_images_default_command_without_its_tokens_file_says_how_to_provide_it() -> None:
    args = dockerfile_serve_args()
    assert not Path(option(args, "--auth-tokens")).exists()  # as in a first `docker run`
    result = run_serve(*args)  # it stops before it binds the address
    assert result.returncode == 2
    assert f"cannot read the --auth-tokens file {option(args, '--auth-tokens')}" in result.stderr
    assert "docker run -v" in result.stderr
    assert "docker-compose.yml" in result.stderr
    assert "tensord listening" not in result.stdout


@pytest.mark.slow
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
