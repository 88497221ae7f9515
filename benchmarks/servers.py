"""Starting the server a benchmark measures: one ``tensord serve`` process of its own."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Mapping


def start_server(
    *extra: str, env: Mapping[str, str] | None = None
) -> tuple[subprocess.Popen[str], str]:
    """``tensord serve`` on a free loopback port with ``extra`` flags, and its address
    (its stderr stays the benchmark's, so a failed start says why); ``env`` replaces the
    environment (another version's PYTHONPATH)."""
    command = [sys.executable, "-m", "tensord_server", "serve", "--address", "127.0.0.1:0"]
    process = subprocess.Popen([*command, *extra], stdout=subprocess.PIPE, text=True, env=env)
    assert process.stdout is not None
    match = re.search(r"tensord listening on (\S+)", process.stdout.readline())
    if not match:
        process.kill()
        raise SystemExit("server did not start")
    return process, match.group(1)
