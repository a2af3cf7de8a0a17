"""serve's request log writer (telemetry.line_writer.LineHandler / LineFormatter): lines
formatted when logged, written in order in batches, nothing lost at close, still usable
after logging.config closes it (uvicorn does)."""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from select import PIPE_BUF
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from fallback_mw.telemetry import line_writer
from fallback_mw.telemetry.line_writer import (
    FLUSH_LINES,
    MAX_PENDING_LINES,
    SERVE_FORMAT,
    SERVE_FORMAT_PID,
    LineFormatter,
    LineHandler,
    direct_handler,
)


def record(message: str, created: float | None = None) -> logging.LogRecord:
    item = logging.LogRecord("fallback_mw.request", logging.INFO, "", 0, message, None, None)
    if created is not None:
        item.created = created
        item.msecs = (created - int(created)) * 1000
    return item


def wait_for(stream: io.StringIO, text: str) -> None:
    deadline = time.monotonic() + 10
    while text not in stream.getvalue():
        assert time.monotonic() < deadline, stream.getvalue()
        time.sleep(0.01)


def test_lines_are_written_in_order_by_the_writer_thread_and_at_close() -> None:
    stream = io.StringIO()
    handler = LineHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    for number in range(5):
        handler.handle(record(f"line {number}"))
    wait_for(stream, "line 4\n")  # no flush asked for: the writer thread wrote them
    assert stream.getvalue() == "".join(f"line {n}\n" for n in range(5))
    handler.handle(record("last"))
    handler.close()
    assert stream.getvalue().endswith("line 4\nlast\n")
    # dictConfig closes every handler and keeps using it: so must this one.
    handler.handle(record("after close"))
    wait_for(stream, "after close\n")
    handler.close()


def test_a_full_buffer_is_handed_to_the_writer_at_once(monkeypatch: Any) -> None:
    # The writer's tick made an hour long: only a full buffer can have it write this soon.
    monkeypatch.setattr(line_writer, "FLUSH_SECONDS", 3600.0)
    stream = io.StringIO()
    handler = LineHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    try:
        for number in range(FLUSH_LINES - 1):
            handler.handle(record(f"n{number}"))
        time.sleep(0.2)
        assert stream.getvalue() == ""  # not full yet: waiting for the tick
        handler.handle(record(f"n{FLUSH_LINES - 1}"))
        wait_for(stream, f"n{FLUSH_LINES - 1}\n")  # the last line woke the writer
        assert stream.getvalue().count("\n") == FLUSH_LINES
    finally:
        handler.close()


class Stalled(io.StringIO):
    """A stream whose writes wait until `go` is set: a log reader that stopped reading."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()
        self.writing = threading.Event()

    def write(self, text: str) -> int:
        self.writing.set()
        assert self.go.wait(30), "never let go"
        return super().write(text)


def in_thread_within(seconds: float, work: Callable[[], None]) -> None:
    """Run `work` in a thread; fail if it has not returned within `seconds` (blocked)."""
    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), "a logged line waited for the stalled write"


def test_a_log_reader_that_stopped_reading_never_holds_up_a_logged_line(monkeypatch: Any) -> None:
    """`serve 2>&1 | shipper` whose shipper stopped reading (or `docker logs` behind):
    the writer thread blocked in its write while holding the handler's lock, every
    request's line waited for that lock, and the gateway stopped answering once the pipe
    was full. A line is only queued now; past MAX_PENDING_LINES lines are counted, and
    once the log takes lines again one line says how many were dropped."""
    monkeypatch.setattr(line_writer, "FLUSH_SECONDS", 3600.0)  # full buffers only
    stream = Stalled()
    handler = LineHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    try:
        for number in range(FLUSH_LINES):
            handler.handle(record(f"first {number}"))
        assert stream.writing.wait(10)  # the writer took them and is stuck writing
        extra = 100

        def log_many() -> None:
            for number in range(MAX_PENDING_LINES + extra):
                handler.handle(record(f"later {number}"))

        in_thread_within(10, log_many)
        stream.go.set()
        wait_for(stream, f"later {MAX_PENDING_LINES - 1}\n")
        text = stream.getvalue()
        assert f"{extra} request log lines were dropped" in text
        assert text.count("\n") == FLUSH_LINES + 1 + MAX_PENDING_LINES
        assert text.index("were dropped") < text.index("later 0\n")
    finally:
        stream.go.set()
        handler.close()


def test_the_exit_flush_gives_up_on_a_log_reader_that_stopped_reading() -> None:
    """A stopped `serve` whose stderr reader stopped reading hung at exit, writing its last
    lines, until killed; it gives up after its bound now."""
    stream = Stalled()
    handler = LineHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    owner = logging.getLogger("fallback_mw.test_exit_flush")
    before = line_writer._installed
    handler.install(owner)
    try:
        for number in range(FLUSH_LINES + 10):
            handler.handle(record(f"line {number}"))
        assert stream.writing.wait(10)  # the writer is stuck in its write
        in_thread_within(10, lambda: line_writer.flush_request_lines(stall=0.5))
    finally:
        stream.go.set()
        owner.removeHandler(handler)
        line_writer._installed = before
        handler.close()
    assert stream.getvalue().count("\n") == FLUSH_LINES + 10  # all written once let go


class Slow(io.StringIO):
    """A log collector that lags but reads on: each write takes `pause` seconds."""

    def __init__(self, pause: float) -> None:
        super().__init__()
        self.pause = pause

    def write(self, text: str) -> int:
        time.sleep(self.pause)
        return super().write(text)


def test_the_exit_flush_waits_for_a_log_reader_that_reads_slowly_on() -> None:
    """A stopped `serve` whose log collector lagged but was still taking lines lost the
    last ones: the exit flush gave up after its fixed bound, progress or not. It waits
    while its writes make progress (a bound on none: `stall`), up to `cap` in all."""
    stream = Slow(0.05)
    handler = LineHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    owner = logging.getLogger("fallback_mw.test_exit_flush_slow")
    before = line_writer._installed
    handler.install(owner)
    try:
        for number in range(FLUSH_LINES + 10):
            handler.handle(record(f"line {number} " + "x" * 200))
        started = time.monotonic()
        line_writer.flush_request_lines(stall=0.3, cap=30)
        took = time.monotonic() - started
    finally:
        owner.removeHandler(handler)
        line_writer._installed = before
        handler.close()
    assert took > 0.3  # longer than the bound on no progress: the writes went on
    assert stream.getvalue().count("\n") == FLUSH_LINES + 10


def test_the_exit_flush_ends_at_its_cap_while_a_reader_still_reads() -> None:
    stream = Slow(0.05)
    handler = LineHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    owner = logging.getLogger("fallback_mw.test_exit_flush_cap")
    before = line_writer._installed
    handler.install(owner)
    try:
        for number in range(FLUSH_LINES + 10):
            handler.handle(record(f"line {number} " + "x" * 200))
        started = time.monotonic()
        line_writer.flush_request_lines(stall=0.3, cap=0.4)
        took = time.monotonic() - started
    finally:
        owner.removeHandler(handler)
        line_writer._installed = before
        handler.close()
    assert 0.4 <= took < 5


def test_a_forked_child_writes_only_its_own_lines(tmp_path: Path) -> None:
    """A process that forks with request lines waiting: the parent writes them, and the
    child wrote its copy too (every such line twice in the log)."""
    path = tmp_path / "log"
    with open(path, "w", encoding="utf-8") as stream:
        handler = LineHandler(stream)
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler.handle(record("before the fork"))
        pid = os.fork()
        if pid == 0:  # the child: its own line, then out
            try:
                handler.handle(record("the child's"))
                handler.flush()
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        handler.close()
    lines = path.read_text().splitlines()
    assert sorted(lines) == ["before the fork", "the child's"], lines


def test_a_full_pipe_nobody_reads_never_holds_up_a_logged_line() -> None:
    # The real thing: a pipe whose reader reads nothing, filled past its 64 KiB.
    read_end, write_end = os.pipe()
    stream = open(write_end, "w", encoding="utf-8", closefd=True)  # noqa: SIM115
    handler = LineHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    line = "x" * 200
    try:
        # 4,000 lines of 201 bytes: three times what the pipe holds.
        in_thread_within(10, lambda: [handler.handle(record(line)) for _ in range(4_000)])
    finally:
        drained = threading.Thread(target=lambda: _drain(read_end), daemon=True)
        drained.start()
        handler.close()
        stream.close()
        drained.join(10)


def _drain(fd: int) -> None:
    with contextlib.suppress(OSError):
        while os.read(fd, 65536):
            pass
    with contextlib.suppress(OSError):
        os.close(fd)


class Writes(io.RawIOBase):
    """A raw stream recording each write system call `serve`'s stderr would make."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.calls.append(bytes(data))
        return len(data)


def test_each_write_holds_whole_lines_no_more_than_a_pipe_takes_whole(monkeypatch: Any) -> None:
    """The workers of `serve --workers N` share one stderr pipe (systemd, Docker,
    Kubernetes): a batch written in one write over PIPE_BUF was spliced with another
    worker's when the pipe was full, tearing lines of both. Each write now holds whole
    lines within PIPE_BUF; a line longer than that goes alone, whole."""
    monkeypatch.setattr(line_writer, "FLUSH_SECONDS", 3600.0)  # the full buffer writes
    raw = Writes()
    # As Python sets up a non-interactive stderr: buffered, line-buffered text.
    stream = io.TextIOWrapper(io.BufferedWriter(raw), encoding="utf-8", line_buffering=True)
    handler = LineHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    lines = [f"line {n} " + ("é" if n % 7 == 0 else "x") * 300 for n in range(FLUSH_LINES - 1)]
    lines.insert(50, "long " + "y" * (2 * PIPE_BUF))
    try:
        for line in lines:
            handler.handle(record(line))  # the last one fills the buffer: written at once
        expected = "".join(f"{line}\n" for line in lines).encode()
        deadline = time.monotonic() + 10
        while len(b"".join(raw.calls)) < len(expected):
            assert time.monotonic() < deadline, "not written"
            time.sleep(0.01)
        assert raw.calls, "nothing written"
        assert len(raw.calls) > 1
        for call in raw.calls:
            assert call.endswith(b"\n")
            assert len(call) <= PIPE_BUF or call.count(b"\n") == 1, len(call)
        assert b"".join(raw.calls).decode() == "".join(f"{line}\n" for line in lines)
    finally:
        handler.close()


def test_the_formatter_writes_what_logging_formatter_writes() -> None:
    fmt = "%(asctime)s %(levelname)s %(name)s %(message)s"
    for created in (1_700_000_000.0, 1_700_000_000.5, 1_700_000_001.25, 1_700_003_599.999):
        item = record("x", created)
        assert LineFormatter(fmt).format(item) == logging.Formatter(fmt).format(item)
    cached = LineFormatter(fmt)
    for created in (1_700_000_000.1, 1_700_000_000.9, 1_700_000_002.0):
        item = record("y", created)
        assert cached.format(item) == logging.Formatter(fmt).format(item)


def test_a_line_written_from_its_parts_is_the_line_the_record_would_give() -> None:
    for fmt in (SERVE_FORMAT, SERVE_FORMAT_PID):
        formatter = LineFormatter(fmt)
        assert formatter.direct
        for created in (1_700_000_000.0, 1_700_000_000.5, 1_700_000_001.2501, 1_700_003_599.999):
            for level in (logging.INFO, logging.WARNING):
                item = record("gateway request route=r outcome=served", created)
                item.levelno, item.levelname = level, logging.getLevelName(level)
                expected = logging.Formatter(fmt).format(item)
                assert formatter.line(level, item.name, item.getMessage(), created) == expected
    assert not LineFormatter("%(message)s %(request_id)s").direct  # reads the record


@settings(max_examples=300, deadline=None)
@given(
    created=st.floats(min_value=0, max_value=4_102_444_800, allow_nan=False),
    level=st.sampled_from([logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR, 5]),
    with_pid=st.booleans(),
)
def test_any_moment_and_level_is_written_as_the_record_would_be(
    created: float, level: int, with_pid: bool
) -> None:
    # The milliseconds come from a table (`_MILLIS`), not a formatted int: every moment
    # (a second's last microseconds included) and level reads as logging writes it.
    fmt = SERVE_FORMAT_PID if with_pid else SERVE_FORMAT
    item = logging.LogRecord("fallback_mw.request", level, "", 0, "m", None, None)
    item.created = created
    item.msecs = int((created - int(created)) * 1000) + 0.0  # as LogRecord computes it
    expected = logging.Formatter(fmt).format(item)
    assert LineFormatter(fmt).line(level, item.name, "m", created) == expected


@contextlib.contextmanager
def serve_logging() -> Iterator[tuple[LineHandler, io.StringIO]]:
    """serve's logging set up on the real `fallback_mw` logger, restored afterwards."""
    owner = logging.getLogger("fallback_mw")
    saved = owner.handlers[:], owner.level
    owner.handlers = []
    stream = io.StringIO()
    handler = LineHandler(stream)
    handler.setFormatter(LineFormatter(SERVE_FORMAT))
    handler.install(owner)
    owner.setLevel(logging.INFO)
    try:
        yield handler, stream
    finally:
        handler.close()
        owner.handlers, level = saved
        owner.setLevel(level)


def test_the_line_skips_the_record_only_while_nothing_else_would_see_it() -> None:
    request_logger = logging.getLogger("fallback_mw.request")
    root = logging.getLogger()
    runner = root.handlers[:]  # pytest's capture handlers: a host's handlers, like any
    with serve_logging() as (handler, _):
        if runner:
            assert direct_handler(logging.INFO) is None
        root.handlers = []
        try:
            check_direct(handler, request_logger, root)
        finally:
            root.handlers = runner


def check_direct(
    handler: LineHandler, request_logger: logging.Logger, root: logging.Logger
) -> None:
    assert direct_handler(logging.INFO) is handler
    added = logging.NullHandler()
    request_logger.addHandler(added)
    assert direct_handler(logging.INFO) is None
    request_logger.removeHandler(added)
    owner = logging.getLogger("fallback_mw")
    owner.addFilter(lambda _: True)
    assert direct_handler(logging.INFO) is None
    owner.filters.clear()
    handler.setLevel(logging.WARNING)
    assert direct_handler(logging.INFO) is None
    assert direct_handler(logging.WARNING) is handler
    handler.setLevel(logging.NOTSET)
    root.addHandler(added)
    try:
        assert direct_handler(logging.INFO) is None
    finally:
        root.removeHandler(added)
    assert direct_handler(logging.INFO) is handler


def test_a_line_logged_just_before_exit_is_written_after_uvicorn_configured_logging() -> None:
    """serve installs its LineHandler, then uvicorn's dictConfig empties logging's handler
    list (which logging.shutdown flushes at exit). A request line still waiting when the
    process ends (a request a stop cut, the last one served) is written all the same."""
    import subprocess
    import sys

    script = (
        "import logging, logging.config\n"
        "from uvicorn.config import LOGGING_CONFIG\n"
        "from fallback_mw.cli.serve_logging import configure_logging\n"
        "configure_logging()\n"
        "logging.config.dictConfig(LOGGING_CONFIG)\n"
        "logging.getLogger('fallback_mw.request').warning('the last line outcome=cancelled')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "the last line outcome=cancelled" in done.stderr


def test_a_line_logged_by_an_exit_callback_is_written_and_raises_nothing() -> None:
    """Python 3.12 starts no thread once the interpreter is exiting (atexit callbacks
    included): serve's exit flush failed with 'Exception ignored in atexit callback ...
    RuntimeError: can't create new thread at interpreter shutdown' after every serve, and a
    line logged by a program's own exit callback (no writer thread running yet) raised that
    RuntimeError in the caller. Both lines are written, with no traceback, on every
    Python."""
    import subprocess
    import sys

    script = (
        "import atexit, logging\n"
        "from fallback_mw.cli.serve_logging import configure_logging\n"
        "configure_logging()\n"
        "request = logging.getLogger('fallback_mw.request')\n"
        "def at_exit():\n"
        "    try:\n"
        "        request.warning('logged at exit')\n"
        "    except Exception as exc:\n"
        "        print('the caller got', type(exc).__name__)\n"
        "atexit.register(at_exit)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "the caller got" not in done.stdout, done.stdout
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr
    assert done.stderr.count("logged at exit") == 1, done.stderr


def test_the_exit_flush_is_quiet_when_the_stream_was_closed_under_it(tmp_path: Path) -> None:
    """A program that gave serve's handler its own file and closed it (the layer benchmark
    did) got 'Exception ignored in atexit callback ... I/O operation on closed file' from
    the exit flush. Waiting lines cannot be written then; the flush says nothing."""
    stream = (tmp_path / "requests.log").open("a")
    handler = LineHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    try:
        handler.handle(record("written"))
        handler.flush()
        assert (tmp_path / "requests.log").read_text() == "written\n"
        stream.close()
        handler.flush()  # nothing waiting: StreamHandler.flush raised ValueError
        handler.handle(record("lost"))
        handler.flush()  # the line cannot be written; the flush does not raise
    finally:
        handler.close()


class FillingDisk(io.StringIO):
    """A log file on a disk that fills up: while `full`, a write puts down what the last
    blocks took (the first 30 characters) and fails with ENOSPC, as the kernel does."""

    def __init__(self) -> None:
        super().__init__()
        self.full = False

    def write(self, text: str) -> int:
        if self.full:
            super().write(text[:30])
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write(text)


def test_lines_a_full_disk_lost_are_said_once_space_returns_on_a_line_of_their_own() -> None:
    """serve's stderr in a file on a disk that filled up: the lines of that time were lost
    without a word, and the one cut off mid-way ran on into the first line written once
    space returned (`... WARNING fallba2026-12-05 ... WARNING fallback_mw.request ...`), a
    line no log parser reads. Once the log can be written again, the cut line is ended and
    one WARNING says lines were lost, and why."""
    stream = FillingDisk()
    handler = LineHandler(stream)
    handler.setFormatter(LineFormatter(SERVE_FORMAT))
    try:
        handler.handle(record("before"))
        handler.flush()
        stream.full = True
        handler.handle(record("lost one"))
        handler.handle(record("lost two"))
        handler.flush()  # never raises: a full disk must not fail a request
        handler.flush()
        stream.full = False
        handler.handle(record("after"))
        handler.flush()
    finally:
        handler.close()
    lines = stream.getvalue().splitlines()
    assert lines[0].endswith("INFO fallback_mw.request before"), lines
    assert "lost two" not in stream.getvalue()
    assert lines[1] == lines[1][:30] and "fallback_mw.request" not in lines[1][20:], lines
    assert lines[2].endswith(
        "WARNING fallback_mw.request request log lines were lost: the log could not be "
        "written (No space left on device)"
    ), lines
    assert lines[3].endswith("INFO fallback_mw.request after"), lines
    assert len(lines) == 4, lines


def test_a_flush_under_the_handlers_lock_during_the_writers_write_ends() -> None:
    """logging.shutdown and dictConfig (uvicorn's, as each `serve --workers` worker starts)
    flush every handler under its lock. The writer thread, in the middle of a write, then
    took that lock for the stream's flush while the shutdown waited for the write: each
    waited for the other for ever (a worker that never served; seen under CI)."""
    started, go_on = threading.Event(), threading.Event()

    class Held(io.StringIO):
        def write(self, text: str) -> int:
            started.set()
            go_on.wait(5)
            return super().write(text)

    stream = Held()
    handler = LineHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.emit(record("first"))
    handler._wake.set()  # the writer writes it now
    assert started.wait(5)  # the writer is in its write, holding the handler's stream
    done = threading.Event()

    def shutdown_flush() -> None:  # as logging.shutdown does for each handler
        handler.acquire()
        try:
            handler.flush()
        finally:
            handler.release()
        done.set()

    flusher = threading.Thread(target=shutdown_flush, daemon=True)
    flusher.start()
    time.sleep(0.2)  # the shutdown holds the lock and waits for the write
    go_on.set()
    assert done.wait(5), "the writer and a flush under the handler's lock waited for each other"
    assert "first" in stream.getvalue()
    handler.close()
