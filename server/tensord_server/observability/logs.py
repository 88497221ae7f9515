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

import atexit
import copy
import datetime
import json
import logging
import queue
import sys
import threading
from typing import Any

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
        return json.dumps(entry, default=str)


class LogWriter(logging.Handler):
    """A handler that queues records (at most ``capacity``) for a thread that passes them
    to ``target``; a record that finds the queue full is dropped and counted, and the
    next record written is preceded by a line saying how many were."""

    def __init__(self, target: logging.Handler, capacity: int = LOG_QUEUE_RECORDS) -> None:
        super().__init__()
        self.target = target
        self._queue: queue.Queue[logging.LogRecord | None] = queue.Queue(capacity)
        self._dropped = 0
        self._dropped_lock = threading.Lock()
        self._thread = threading.Thread(target=self._write, name="tensord-log", daemon=True)
        self._thread.start()

    def emit(self, record: logging.LogRecord) -> None:
        # the message is made now (its arguments may change later); exc_info stays, the
        # queue is in this process
        try:
            record = copy.copy(record)
            record.msg, record.args = record.getMessage(), None
        except Exception:
            self.handleError(record)  # a message whose arguments do not fit it, as logging does
            return
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            with self._dropped_lock:
                self._dropped += 1

    def _write(self) -> None:
        while (record := self._queue.get()) is not None:
            with self._dropped_lock:
                dropped, self._dropped = self._dropped, 0
            if dropped:
                self.target.handle(dropped_record(dropped, record.created))
            self.target.handle(record)

    def close(self) -> None:
        """Write what is queued (waiting at most LOG_FLUSH_S), then stop the thread."""
        if self._thread.is_alive():
            try:
                self._queue.put(None, timeout=LOG_FLUSH_S)
            except queue.Full:
                pass  # the reader is stalled: what is queued is lost with the process
            else:
                self._thread.join(LOG_FLUSH_S)
        super().close()


def dropped_record(count: int, created: float) -> logging.LogRecord:
    """The line that says ``count`` log lines were dropped before a record of ``created``."""
    record = logging.LogRecord(
        "tensord.log",
        logging.WARNING,
        __file__,
        0,
        "%d log lines dropped: the log's reader fell behind",
        (count,),
        None,
    )
    record.created = created
    record.fields = {"event": "log_lines_dropped", "dropped": count}
    return record


def configure_logging(log_format: str = "text", level: str = "info") -> None:
    """The root logger writes to stderr in ``log_format`` at ``level`` (replacing handlers),
    through a :class:`LogWriter` (flushed at exit)."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"--log-format must be one of {', '.join(LOG_FORMATS)}")
    stream = logging.StreamHandler(sys.stderr)
    stream.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    writer = LogWriter(stream)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
        old.close()
    root.addHandler(writer)
    root.setLevel(level.upper())
    atexit.register(writer.close)
