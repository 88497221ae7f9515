"""Raw-byte transfers: chunks, and the watchdog that ends a transfer once no chunk moves.

gRPC has only a total deadline for a call; a big transfer must not hit one, yet a
stalled one must end: every Upload and Download of a connection is watched by one
thread, which cancels a transfer in which no chunk moved for the call timeout.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import grpc

from tensord.wire.fork import FORK_GATE


def chunks(data: memoryview, size: int) -> Iterator[bytes]:
    # Each message must be ``bytes``: gRPC's identity serializer sends it as is.
    for start in range(0, len(data), size):
        yield bytes(data[start : start + size])


class WatchedStream:
    """One transfer under the watchdog: when a chunk last moved, and whether it was cancelled."""

    __slots__ = ("call", "cancelled", "last_progress")

    def __init__(self) -> None:
        self.call: grpc.Future | None = None
        self.last_progress = time.monotonic()
        self.cancelled = False

    def progressed(self) -> None:
        self.last_progress = time.monotonic()  # one float store: no lock needed


def progressing(chunks: Iterator[bytes], stream: WatchedStream) -> Iterator[bytes]:
    # gRPC asks for chunk n once chunk n-1 is sent: each request is progress
    for chunk in chunks:
        stream.progressed()
        yield chunk


class StreamWatchdog:
    """Cancels any transfer of one connection in which no chunk moved for ``idle_timeout`` s.

    gRPC has only a total deadline for a call; a big transfer must not hit one, yet a
    stalled one must end.  One thread per connection (started with the first transfer)
    sleeps until the earliest moment a watched transfer could have been idle too long.
    """

    def __init__(self, idle_timeout: float) -> None:
        self.idle_timeout = idle_timeout
        self._changed = threading.Condition()
        self._streams: set[WatchedStream] = set()
        self._thread: threading.Thread | None = None
        self._stopped = False

    @contextlib.contextmanager
    def watch(self, stream: WatchedStream, call: grpc.Future) -> Iterator[None]:
        """Watch ``call`` while the block runs; it is cancelled after the block, if unfinished."""
        stream.call = call
        with self._changed:
            self._streams.add(stream)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._watch_forever, name="tensord-stream-watchdog", daemon=True
                )
                self._thread.start()
            self._changed.notify()
        try:
            yield
        finally:
            with self._changed:
                self._streams.discard(stream)

    def stop(self) -> None:
        with self._changed:
            self._stopped = True
            self._changed.notify()

    def _take_idle(self) -> tuple[list[WatchedStream], float | None]:
        """Mark the streams idle too long now; also how long until the next one could be."""
        now = time.monotonic()
        idle: list[WatchedStream] = []
        next_in: float | None = None
        for stream in self._streams:
            if stream.cancelled:
                continue
            left = stream.last_progress + self.idle_timeout - now
            if left <= 0:
                stream.cancelled = True
                idle.append(stream)
            else:
                next_in = left if next_in is None else min(next_in, left)
        return idle, next_in

    def _watch_forever(self) -> None:
        while True:
            with self._changed:
                if self._stopped:
                    return
                idle, next_in = self._take_idle()
                if not idle:
                    self._changed.wait(next_in)
                    continue
            with FORK_GATE.busy():  # outside the lock: cancelling may run gRPC's callbacks
                for stream in idle:
                    if stream.call is not None:
                        stream.call.cancel()
