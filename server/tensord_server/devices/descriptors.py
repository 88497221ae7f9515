"""File descriptors: the server's limit, the reserve kept for segments, and the error when they run out.

Every segment of the shared host pool holds two descriptors (its memfd, and the copy
``mmap`` keeps of it), every fd-socket connection and call channel one, every gRPC
connection one.  A process at its limit (EMFILE) cannot make a segment however much
memory is free, so:

- at start the server raises its soft RLIMIT_NOFILE to the hard limit
  (:func:`raise_descriptor_limit`): the usual soft default, 1024, is a few hundred
  idle connections' worth;
- the network side accepts a connection only while a reserve stays free for
  segments and the fd socket (:class:`DescriptorBudget`);
- a segment that cannot get its descriptor fails naming descriptors, never memory
  (:func:`out_of_descriptors`).
"""

from __future__ import annotations

import errno
import logging
import os
import resource

log = logging.getLogger(__name__)

# The errors of a process (EMFILE) or a host (ENFILE) that has no descriptor left to give.
DESCRIPTOR_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE})
# Descriptors connections may never take, kept for new segments (two each) and the fd
# socket's requests and channels: at least this many ...
MIN_DESCRIPTOR_RESERVE = 256
# ... or this share of the limit, where that is more ...
DESCRIPTOR_RESERVE_FRACTION = 0.25
# ... but at most this share, so that a low limit still leaves connections some.
MAX_DESCRIPTOR_RESERVE_FRACTION = 0.5
# Where the kernel lists this process's open descriptors (one entry each).
PROC_FD = "/proc/self/fd"


def is_descriptor_error(exc: BaseException) -> bool:
    """Whether ``exc`` says the process or the host has no descriptor left (EMFILE, ENFILE)."""
    return isinstance(exc, OSError) and exc.errno in DESCRIPTOR_ERRNOS


def descriptor_limit() -> int:
    """The soft RLIMIT_NOFILE: the most descriptors this process may hold."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return int(soft)


def open_descriptors() -> int | None:
    """How many descriptors this process holds now (None where /proc does not say).

    Listing /proc/self/fd takes a descriptor itself: at the limit the listing fails,
    and then every descriptor is taken."""
    try:
        return len(os.listdir(PROC_FD)) - 1  # less the listing's own
    except OSError as exc:
        return descriptor_limit() if is_descriptor_error(exc) else None


def default_reserve(limit: int) -> int:
    """The descriptors kept from connections under ``limit``: MIN_DESCRIPTOR_RESERVE, or
    DESCRIPTOR_RESERVE_FRACTION of the limit where more, at most its
    MAX_DESCRIPTOR_RESERVE_FRACTION."""
    wanted = max(MIN_DESCRIPTOR_RESERVE, int(limit * DESCRIPTOR_RESERVE_FRACTION))
    return min(wanted, int(limit * MAX_DESCRIPTOR_RESERVE_FRACTION))


def raise_descriptor_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (logged when it changes); the soft
    limit now.  A hard limit the kernel will not grant as a soft one (unlimited, past
    fs.nr_open) leaves the soft limit as it was, with a warning."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard:
        return int(soft)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (OSError, ValueError) as exc:
        log.warning(
            "file descriptor limit stays at %d: raising it to the hard limit %d failed: %s",
            soft,
            hard,
            exc,
        )
        return int(soft)
    log.info("file descriptor limit raised from %d to the hard limit %d", soft, hard)
    return int(hard)


class DescriptorBudget:
    """The descriptors this process holds against its limit, and whether a connection
    may take another: connections leave ``reserve`` free for segments and the fd socket.

    Stateless but for the reserve: the count and the limit are read when asked (a
    listing of /proc/self/fd, a getrlimit), so they follow what the process does."""

    def __init__(self, reserve: int | None = None) -> None:
        if reserve is not None and reserve < 0:
            raise ValueError(f"a descriptor reserve must be >= 0, got {reserve}")
        self._reserve = reserve

    @property
    def limit(self) -> int:
        return descriptor_limit()

    @property
    def reserve(self) -> int:
        return default_reserve(self.limit) if self._reserve is None else self._reserve

    def in_use(self) -> int:
        """Descriptors open now (the limit itself where /proc cannot be read: a caller that
        cannot count assumes the worst)."""
        count = open_descriptors()
        return self.limit if count is None else count

    def connection_limit(self) -> int:
        """The most descriptors the process may hold and still accept a connection."""
        return max(self.limit - self.reserve, 0)

    def may_accept(self) -> bool:
        """Whether one more connection leaves the reserve free."""
        return self.in_use() + 1 <= self.connection_limit()

    def connections_left(self) -> int:
        """How many more connections may be accepted now (for a static cap at start, such
        as gRPC's ``grpc.max_allowed_incoming_connections``)."""
        return max(self.connection_limit() - self.in_use(), 0)

    def describe(self) -> str:
        """``N open, limit M``, for messages."""
        return f"{self.in_use()} open, limit {self.limit}"


def out_of_descriptors(exc: OSError) -> str:
    """What an EMFILE or ENFILE means, with the process's count and limit, for a message."""
    counts = DescriptorBudget().describe()
    if exc.errno == errno.ENFILE:
        return (
            f"the host is out of file descriptors (its file table is full; the server has {counts})"
        )
    return f"the server is out of file descriptors ({counts})"
