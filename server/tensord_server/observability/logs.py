"""``tensord serve --log-format json|text --log-level LEVEL``: the server's log lines.

Text is the historical ``time name: message``.  JSON writes one object per line
with ``time`` (ISO 8601, UTC), ``level``, ``logger``, ``message`` and the
record's structured ``fields`` (``extra={"fields": {...}}``: event, method,
code, tenant, ...), so a log shipper needs no parsing rules.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
from typing import Any

LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")
TEXT_FORMAT = "%(asctime)s %(name)s: %(message)s"


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


def configure_logging(log_format: str = "text", level: str = "info") -> None:
    """The root logger writes to stderr in ``log_format`` at ``level`` (replacing handlers)."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"--log-format must be one of {', '.join(LOG_FORMATS)}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)
    )
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
