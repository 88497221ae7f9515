"""``tensord serve --log-format json|text --log-level LEVEL``: the server's log lines.

Text is the historical ``time name: message``.  JSON writes one object per line
with ``time`` (ISO 8601, UTC), ``level``, ``logger``, ``message`` and the
record's structured ``fields`` (``extra={"fields": {...}}``: event, method,
code, tenant, ...), so a log shipper needs no parsing rules.

A thread of its own writes the lines (:class:`LogWriter`): a request's thread only puts
its record on a bounded queue, so a log reader that stalls (a pipe nobody drains, a
stuck terminal) costs log lines, counted and said once the reader is back, never a
request, a heartbeat or the session reaper (they all log).
"""

from __future__ import annotations

import copy
import datetime
import json
import logging
import queue
import sys
import threading
import time
from typing import Any, TextIO

LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")
TEXT_FORMAT = "%(asctime)s %(name)s: %(message)s"
# records waiting for the writer: beyond them a stalled reader costs lines, not requests
LOG_QUEUE_RECORDS = 10_000
# how long exit waits for the writer to write what is queued (a stalled reader: no longer)
LOG_FLUSH_S = 2.0


class JsonFormatter(logging.Formatter):
    """One JSON object per record."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update({k: v for k, v in fields.items() if k not in entry})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:  # formatted already (LogWriter queues text, not frames)
            entry["exception"] = record.exc_text
        return json.dumps(entry, default=str)


class LogWriter(logging.Handler):
    """A handler that queues records (at most ``capacity``) for a thread that formats and
    writes them to ``stream``; a record that finds the queue full is dropped and counted,
    and a line saying how many goes out before the next one written (or at close).

    The thread writes to the stream itself, through no other handler: logging's own exit
    (``logging.shutdown``) takes every registered handler's lock, and a handler stuck in
    a write to a stalled reader would hold its lock, and the exit, for good."""

    def __init__(
        self, stream: TextIO, formatter: logging.Formatter, capacity: int = LOG_QUEUE_RECORDS
    ) -> None:
        super().__init__()
        self.stream = stream
        self.setFormatter(formatter)
        self._queue: queue.Queue[logging.LogRecord | None] = queue.Queue(capacity)
        self._dropped = 0
        self._dropped_lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._write, name="tensord-log", daemon=True)
        self._thread.start()

    def emit(self, record: logging.LogRecord) -> None:
        # the message is made now (its arguments may change later), and an exception's
        # text too: a queued traceback would keep its frames, and what they hold, alive
        record = copy.copy(record)
        try:
            record.msg = record.getMessage()
        except Exception:  # arguments that do not fit the message: both said, as they are
            record.msg = (
                f"{record.msg!r} % {record.args!r} (a log call's arguments that do not fit)"
            )
        record.args = None
        if record.exc_info:
            if not record.exc_text:
                record.exc_text = logging.Formatter().formatException(record.exc_info)
            record.exc_info = None
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            with self._dropped_lock:
                self._dropped += 1

    def pending(self) -> int:
        """Records waiting for the writer (about: the writer may be taking one)."""
        return self._queue.qsize()

    def _write(self) -> None:
        while (record := self._queue.get()) is not None:
            self._say_dropped(record.created)
            self._write_line(record)
        self._say_dropped(None)  # drops after the last record written

    def _say_dropped(self, created: float | None) -> None:
        with self._dropped_lock:
            dropped, self._dropped = self._dropped, 0
        if dropped:
            self._write_line(dropped_record(dropped, created))

    def _write_line(self, record: logging.LogRecord) -> None:
        try:
            self.stream.write(self.format(record) + "\n")
            self.stream.flush()
        except Exception:
            pass  # a closed or broken stream: the line is lost, as the reader is gone

    def close(self) -> None:
        """Write what is queued (waiting at most LOG_FLUSH_S in all for a stalled reader),
        then stop the thread; a second call does nothing."""
        if not self._closed:
            self._closed = True
            deadline = time.monotonic() + LOG_FLUSH_S
            try:
                self._queue.put(None, timeout=LOG_FLUSH_S)
            except queue.Full:
                pass  # the reader is stalled: what is queued is lost with the process
            else:
                self._thread.join(max(0.0, deadline - time.monotonic()))
        super().close()


def dropped_record(count: int, created: float | None) -> logging.LogRecord:
    """The line that says ``count`` log lines were dropped before a record of ``created``
    (None: now)."""
    record = logging.LogRecord(
        "tensord.log",
        logging.WARNING,
        __file__,
        0,
        "%d log lines dropped: the log's reader fell behind",
        (count,),
        None,
    )
    if created is not None:
        record.created = created
    record.fields = {"event": "log_lines_dropped", "dropped": count}
    return record


def configure_logging(log_format: str = "text", level: str = "info") -> None:
    """The root logger writes to stderr in ``log_format`` at ``level`` (replacing handlers),
    through a :class:`LogWriter` (written out at exit: ``logging.shutdown`` closes it)."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"--log-format must be one of {', '.join(LOG_FORMATS)}")
    formatter = JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)
    writer = LogWriter(sys.stderr, formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
        old.close()
    root.addHandler(writer)
    root.setLevel(level.upper())
