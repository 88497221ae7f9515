"""Helpers the raw-stub tests share: what a failed RPC says, and what torch says for the same call."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import pytest


def rpc_error(call: Callable[[], Any]) -> tuple[grpc.StatusCode, str, str | None]:
    """Run a call that must fail; its status code, details and `tensord-error-type` trailer."""
    with pytest.raises(grpc.RpcError) as info:
        call()
    trailer = dict(info.value.trailing_metadata() or ())
    return info.value.code(), info.value.details(), trailer.get("tensord-error-type")


def torch_error(call: Callable[[], Any]) -> tuple[str, str]:
    """Run a torch call that must fail; its exception type name and message."""
    with pytest.raises(Exception) as info:
        call()
    return type(info.value).__name__, str(info.value)
