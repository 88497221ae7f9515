"""The server's log lines are written by a thread of their own (observability/logs.py):
a log reader that stalls costs lines, counted and said, never the thread that logs."""

from __future__ import annotations

import io
import json
import logging
import os
import threading

from tensord_server.observability.logs import JsonFormatter, LogWriter

LINE = "x" * 500


def test_a_stalled_reader_drops_lines_not_callers_and_says_how_many() -> None:
    read_end, write_end = os.pipe()
    pipe = io.TextIOWrapper(os.fdopen(write_end, "wb"), write_through=True)
    stream = logging.StreamHandler(pipe)
    stream.setFormatter(JsonFormatter())
    writer = LogWriter(stream, capacity=100)
    logger = logging.getLogger("tensord.test-log-writer")
    logger.propagate = False
    logger.addHandler(writer)
    logger.setLevel(logging.INFO)
    try:
        # 2,000 lines of 500 bytes: 1 MB into a 64 KiB pipe nobody reads
        done = threading.Event()

        def log_many() -> None:
            for index in range(2000):
                logger.info("line %d %s", index, LINE)
            done.set()

        threading.Thread(target=log_many, daemon=True).start()
        assert done.wait(30), "a caller waited for the stalled reader"
        output: list[bytes] = []
        reader = threading.Thread(
            target=lambda: output.extend(iter(lambda: os.read(read_end, 1 << 16), b"")),
            daemon=True,
        )
        reader.start()  # the reader is back
        logger.info("after %s", "the stall")
        writer.close()  # writes what is queued, then stops
        pipe.close()  # EOF for the reader
        reader.join(30)
    finally:
        logger.removeHandler(writer)
        os.close(read_end)
    lines = [json.loads(line) for line in b"".join(output).decode().splitlines()]
    messages = [line["message"] for line in lines]
    assert messages[-1] == "after the stall"
    notices = [line for line in lines if line.get("event") == "log_lines_dropped"]
    written = [m for m in messages if m.startswith("line ")]
    assert notices and sum(n["dropped"] for n in notices) == 2000 - len(written)
    assert "log lines dropped: the log's reader fell behind" in notices[0]["message"]
    indexes = [int(m.split()[1]) for m in written]
    assert indexes == sorted(indexes)  # in order, the dropped ones missing


def test_a_message_is_made_when_logged_not_when_written() -> None:
    """A mutable argument changed after the call does not change the line."""
    out = io.StringIO()
    stream = logging.StreamHandler(out)
    writer = LogWriter(stream)
    logger = logging.getLogger("tensord.test-log-writer-args")
    logger.propagate = False
    logger.addHandler(writer)
    logger.setLevel(logging.INFO)
    values = [1, 2]
    logger.info("values %s", values)
    values.append(3)
    writer.close()
    logger.removeHandler(writer)
    assert out.getvalue() == "values [1, 2]\n"
