"""The remote-bind refusal resolves the host: every address it names must be loopback."""

from __future__ import annotations

import pytest
from conftest import run_serve
from tensord_server.tools.serve import UnresolvableHostError, is_loopback


@pytest.mark.parametrize(
    "address", ["127.0.0.1:0", "127.9.9.9:1", "localhost:50051", "[::1]:50051", "::1", "unix:/x"]
)
def test_loopback_addresses(address: str) -> None:
    assert is_loopback(address)


@pytest.mark.parametrize("address", ["0.0.0.0:50051", "[::]:1", ":50051", "10.1.2.3:5"])
def test_other_addresses(address: str) -> None:
    assert not is_loopback(address)


@pytest.mark.slow
def test_a_name_is_judged_by_where_it_points_and_an_unresolvable_one_is_refused() -> None:
    # 127.example.invalid looked loopback to a prefix test; .invalid never resolves
    with pytest.raises(UnresolvableHostError, match=r"127\.example\.invalid"):
        is_loopback("127.example.invalid:50051")
    result = run_serve("--address", "127.example.invalid:0", "--device", "cpu=1MiB")
    assert result.returncode == 2
    assert "cannot resolve the host '127.example.invalid'" in result.stderr
