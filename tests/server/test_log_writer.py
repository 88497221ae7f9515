"""The server's log lines are written by a thread of their own (observability/logs.py):
a log reader that stalls costs lines, counted and said, never the thread that logs, nor
the process's exit."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from tensord_server.observability.logs import JsonFormatter, LogWriter

LINE = "x" * 500


def quiet_logger(name: str, writer: LogWriter) -> logging.Logger:
    logger = logging.getLogger(name)
    logger.propagate = False
    logger.handlers = [writer]
    logger.setLevel(logging.INFO)
    return logger


def test_a_stalled_reader_drops_lines_not_callers_and_says_how_many() -> None:
    read_end, write_end = os.pipe()
    pipe = io.TextIOWrapper(os.fdopen(write_end, "wb"), write_through=True)
    writer = LogWriter(pipe, JsonFormatter(), capacity=100)
    logger = quiet_logger("tensord.test-log-writer", writer)
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
        deadline = time.monotonic() + 30
        while writer.pending() >= 100 and time.monotonic() < deadline:
            time.sleep(0.01)  # room in the queue again
        logger.info("after %s", "the stall")
        writer.close()  # writes what is queued, then stops
        pipe.close()  # EOF for the reader
        reader.join(30)
    finally:
        logger.handlers = []
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


def test_lines_dropped_while_the_writer_waits_are_said_before_the_next_line() -> None:
    out = io.StringIO()
    gate = threading.Lock()
    gate.acquire()

    class Stalled(io.StringIO):
        def write(self, text: str) -> int:  # a reader that stalls until the gate opens
            with gate:
                return out.write(text)

    writer = LogWriter(Stalled(), logging.Formatter("%(message)s"), capacity=1)
    logger = quiet_logger("tensord.test-log-writer-stall", writer)
    logger.info("first")  # taken by the writer, which then waits for the reader
    deadline = time.monotonic() + 10
    while writer.pending() and time.monotonic() < deadline:
        time.sleep(0.01)
    logger.info("second")  # queued (capacity 1)
    for _ in range(5):
        logger.info("dropped")
    gate.release()
    writer.close()
    logger.handlers = []
    assert out.getvalue().splitlines() == [
        "first",
        "5 log lines dropped: the log's reader fell behind",
        "second",
    ]


def test_a_message_and_its_exception_are_made_when_logged() -> None:
    """A mutable argument changed after the call does not change the line, and a queued
    record holds the exception's text, not its traceback (whose frames hold requests)."""
    out = io.StringIO()
    writer = LogWriter(out, logging.Formatter("%(message)s"))
    logger = quiet_logger("tensord.test-log-writer-args", writer)
    queued: list[logging.LogRecord] = []
    put = writer._queue.put_nowait

    def keep(record: logging.LogRecord | None) -> None:
        assert record is not None
        queued.append(record)
        put(record)

    writer._queue.put_nowait = keep  # type: ignore[method-assign]
    values = [1, 2]
    logger.info("values %s", values)
    values.append(3)
    try:
        raise KeyError("the failure")
    except KeyError:
        logger.exception("failed")
    logger.info("%d and %d", 1)  # arguments that do not fit
    writer.close()
    logger.handlers = []
    text = out.getvalue()
    assert text.startswith("values [1, 2]\nfailed\nTraceback")
    assert "KeyError: 'the failure'" in text
    assert "(a log call's arguments that do not fit)" in text
    assert all(r.exc_info is None and r.args is None for r in queued)
    json_line = JsonFormatter().format(queued[1])
    assert "KeyError" in json.loads(json_line)["exception"]


@pytest.mark.slow
def test_the_process_exits_with_a_stalled_reader() -> None:
    """At exit the queue is written out for at most LOG_FLUSH_S; a reader that never
    reads again does not keep the process (logging's own exit took the handler's lock
    the stuck writer held: it hung for good)."""
    script = textwrap.dedent(
        """
        import logging
        from tensord_server.observability.logs import configure_logging
        configure_logging("text", "info")
        for index in range(3000):
            logging.getLogger("tensord.test").info("line %d %s", index, "x" * 500)
        """
    )
    process = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        started = time.monotonic()
        assert process.wait(timeout=30) == 0  # stderr never read
        assert time.monotonic() - started < 20
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=10)


def test_every_queued_line_is_written_at_exit(tmp_path) -> None:
    """The writer thread is a daemon: at exit logging.shutdown closes the writer, which
    writes out what is queued before the process goes."""
    script = textwrap.dedent(
        """
        import logging
        from tensord_server.observability.logs import configure_logging
        configure_logging("text", "info")
        for index in range(5000):
            logging.getLogger("tensord.test").info("line %d", index)
        """
    )
    log = tmp_path / "stderr.txt"
    with log.open("w") as stderr:
        subprocess.run([sys.executable, "-c", script], stderr=stderr, check=True, timeout=60)
    lines = log.read_text().splitlines()
    assert len(lines) == 5000 and lines[-1].endswith("tensord.test: line 4999")
