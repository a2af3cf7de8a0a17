"""serve's writer of log lines (`LineHandler`, `LineFormatter`): a request only queues its
line; one writer thread writes whole lines (at most PIPE_BUF each, so the lines of several
workers on one pipe never tear), flushed every FLUSH_SECONDS or FLUSH_LINES; a reader that
stops reading drops lines past MAX_PENDING_LINES (counted, one WARNING), never a request.
The request log line itself is telemetry/request_log.py's."""

from __future__ import annotations

import atexit
import logging
import os
import select
import threading
import time
from collections.abc import Iterator
from typing import IO

from fallback_mw.telemetry.exit_writer import exit_writer

_request_logger = logging.getLogger("fallback_mw.request")

# serve's LineHandler, when serve installed it (LineHandler.install); the line skips the
# LogRecord while nothing else could see it (direct_handler).
_installed: LineHandler | None = None


def direct_handler(level: int) -> LineHandler | None:
    """serve's LineHandler when it is the only thing that would see this line: the
    request logger and its parent without filters, the parent's one handler serve's, no
    handler above it, the handler's level and filters letting it pass. Anything else (a
    host's handlers, a filter, a formatter that reads the record's fields) gets the
    LogRecord, as always."""
    handler = _installed
    if (
        handler is None
        or _request_logger.handlers
        or _request_logger.filters
        or not _request_logger.propagate
    ):
        return None
    parent = handler.owner
    if (
        _request_logger.parent is not parent
        or parent.filters
        or len(parent.handlers) != 1
        or parent.handlers[0] is not handler
        or (parent.propagate and logging.root.handlers)
        or handler.filters
        or level < handler.level
        or not isinstance(handler.formatter, LineFormatter)
        or not handler.formatter.direct
    ):
        return None
    return handler


# --- serve's writer -------------------------------------------------------------------

FLUSH_SECONDS = 0.1  # the longest a line waits in LineHandler's buffer
FLUSH_LINES = 256  # or until this many are waiting
# The most lines kept while the log cannot take them (a reader that stopped reading the
# pipe: a stalled log shipper, `docker logs` behind): past it, lines are counted, not kept,
# and one line says how many were dropped once the log takes lines again.
MAX_PENDING_LINES = 64 * FLUSH_LINES

# serve's line formats: the ones LineFormatter can also write without a LogRecord.
SERVE_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
SERVE_FORMAT_PID = "%(asctime)s %(levelname)s %(name)s[%(process)d] %(message)s"


class LineFormatter(logging.Formatter):
    """`logging.Formatter` with `asctime` computed once per second, not per line (the
    same text: `%Y-%m-%d %H:%M:%S,mmm` in local time). With one of serve's formats it
    also writes a line from its parts (`line`), the text `format` gives for the record."""

    def __init__(self, fmt: str) -> None:
        super().__init__(fmt)
        self._second = -1
        self._prefix = ""
        self.direct = fmt in (SERVE_FORMAT, SERVE_FORMAT_PID)
        self._with_pid = fmt == SERVE_FORMAT_PID

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        if datefmt is not None:
            return super().formatTime(record, datefmt)
        return f"{self._seconds(record.created)},{int(record.msecs):03d}"

    def _seconds(self, created: float) -> str:  # `%Y-%m-%d %H:%M:%S`, made once a second
        second = int(created)
        if second != self._second:
            self._prefix = time.strftime("%Y-%m-%d %H:%M:%S", self.converter(second))
            self._second = second
        return self._prefix

    def line(self, level: int, name: str, message: str, created: float) -> str:
        """What `format` writes for a record of `name` at `level` with this message, created
        at `created` (serve's formats only). The milliseconds (as LogRecord computes them, 0
        to 999) from a table: 1.9 us a line with an int formatted `03d`, 1.2 now."""
        stamp = self._seconds(created) + _MILLIS[int((created - int(created)) * 1000)]
        pid = f"[{os.getpid()}]" if self._with_pid else ""
        return f"{stamp} {logging.getLevelName(level)} {name}{pid} {message}"


_MILLIS = tuple(f",{n:03d}" for n in range(1000))  # ",000" to ",999", as formatTime writes


# The largest write a pipe takes whole (POSIX: at least 512; Linux 4096). Under systemd,
# Docker or Kubernetes the output of `serve --workers N` is one pipe or socket every worker
# writes to: a larger write is spliced with another worker's when the reader lags.
PIPE_BUF = getattr(select, "PIPE_BUF", 512)


def whole_lines(lines: list[str], terminator: str = "\n") -> Iterator[str]:
    """`lines` as pieces of whole lines, each at most PIPE_BUF bytes (a longer line alone),
    so that no write of one process can splice a line of another's sharing the pipe."""
    piece: list[str] = []
    size = 0
    for line in lines:
        text = line + terminator
        length = len(text) if text.isascii() else len(text.encode("utf-8", "replace"))
        if piece and size + length > PIPE_BUF:
            yield "".join(piece)
            piece, size = [], 0
        piece.append(text)
        size += length
    if piece:
        yield "".join(piece)


class LineHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A StreamHandler for a process that logs a line per request (`serve`): each
    record is formatted on the spot (its fields are read while they are current) and
    the lines are written in batches, by one background thread at most every
    FLUSH_SECONDS or at once when FLUSH_LINES are waiting, instead of a write and flush
    system call per request. A request never writes, nor waits for a write: a reader that
    stops reading the pipe blocks the writer thread alone, and the gateway serves on
    (keeping MAX_PENDING_LINES lines, counting those past it). `flush()` / `close()`
    (logging.shutdown at exit) write what is waiting."""

    def __init__(self, stream: IO[str] | None = None) -> None:
        super().__init__(stream)
        self._pending: list[str] = []
        self._wake = threading.Event()
        self._writer: threading.Thread | None = None
        self.owner = logging.getLogger("fallback_mw")
        # Why the last write failed (a full disk), until a write gets through again: then
        # a line says lines were lost, after ending the line the failure may have cut.
        self._failed: str | None = None
        self._dropped = 0  # lines past MAX_PENDING_LINES, not kept (under the handler lock)
        # Held while writing to the stream (which may block), never with the handler's
        # lock held: a line is queued under that lock while a write is under way.
        self._io = threading.Lock()
        # Set when the exit gave up on a write that never ended (flush_request_lines):
        # nothing more is written, so that the exit is not held by that write.
        self.gave_up = False
        self.pieces_written = 0  # writes that got through: the exit flush's progress

    def install(self, owner: logging.Logger) -> None:
        """Add this handler to `owner` (the `fallback_mw` logger) and let the request log
        line reach it without a LogRecord while nothing else would see the line."""
        global _installed
        self.owner = owner
        for quiet in [h for h in owner.handlers if isinstance(h, logging.NullHandler)]:
            owner.removeHandler(quiet)  # it only kept logging's last resort away
        owner.addHandler(self)
        if _installed is None:
            # logging.shutdown at exit flushes only the handlers in logging's own list, and
            # uvicorn's dictConfig (after this) empties that list: the lines still waiting
            # (the last 0.1 s: the requests a stop cut, the last ones served) were lost.
            atexit.register(flush_request_lines)
        _installed = self
        exit_writer()  # now: the exit cannot start it (Python 3.12)

    def write_line(self, level: int, message: str) -> None:
        """The request line, as `emit` would write its record (serve's format)."""
        formatter = self.formatter
        assert isinstance(formatter, LineFormatter)
        line = formatter.line(level, _request_logger.name, message, time.time())
        with self._locked():  # as Handler.handle holds it around emit
            self._enqueue(line)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:
            self.handleError(record)
            return
        self._enqueue(line)

    def _enqueue(self, line: str) -> None:
        # Under the handler's lock, as flush's swap. The line is queued, never written
        # here: a write to a pipe its reader stopped reading blocks, and it would block
        # the event loop and every request with it.
        pending = self._pending
        if len(pending) >= MAX_PENDING_LINES:
            self._dropped += 1
            return
        pending.append(line)
        if self._writer is None:
            self._start_writer()
        if len(pending) >= FLUSH_LINES:
            self._wake.set()  # the writer writes them now, not at its next tick

    def _start_writer(self) -> None:
        with self._locked():
            if self._writer is None:
                self._wake.clear()
                self._writer = threading.Thread(
                    target=self._write_periodically, name="fallback-mw-log", daemon=True
                )
                try:
                    self._writer.start()
                except RuntimeError:
                    # A line logged at exit (an atexit callback) on Python 3.12, which
                    # starts no thread then: the line waits for the exit flush (or
                    # logging.shutdown's), never raises in the caller.
                    self._writer = None

    def _write_periodically(self) -> None:
        me = threading.current_thread()
        while self._writer is me:
            self._wake.wait(FLUSH_SECONDS)
            self._wake.clear()
            if self._pending or self._dropped:
                self.flush()

    def _locked(self) -> threading.RLock:
        assert self.lock is not None  # created by logging.Handler.__init__
        return self.lock

    def flush(self) -> None:
        """Write what is waiting (writer thread, exit, setStream, close), under `_io` only."""
        if self.gave_up:
            return
        self._take_io()
        try:
            try:  # the lines swapped out under the handler's lock (_take_io took it)
                pending, self._pending = self._pending, []
                dropped, self._dropped = self._dropped, 0
            finally:
                self._locked().release()
            if (pending or dropped) and self.stream is not None:
                lines = pending
                if dropped:
                    lines = [self._warning(f"{dropped} request log lines were dropped: "
                                           "the log did not take them (a reader that "
                                           "stopped reading); the gateway served on"),
                             *lines]  # fmt: skip
                if self._failed is not None:
                    # On a line of its own (the empty one ends it): the failed write may
                    # have cut a line short.
                    lost = (
                        "request log lines were lost: the log could not be written "
                        f"({self._failed})"
                    )
                    lines = ["", self._warning(lost), *lines]
                try:
                    for piece in whole_lines(lines, self.terminator):
                        self.stream.write(piece)
                        self.stream.flush()  # one write of whole lines each
                        self.pieces_written += 1
                except Exception as exc:
                    self._failed = _why(exc)
                    return  # a full disk must not fail a request
            try:  # StreamHandler.flush without its lock: `_io` keeps the stream
                stream = self.stream
                if stream is not None and hasattr(stream, "flush"):
                    stream.flush()
            except (OSError, ValueError) as exc:
                # nor a stream its owner closed (the exit flush runs after)
                self._failed = _why(exc)
                return
            if pending:
                self._failed = None
        finally:
            self._io.release()

    def _take_io(self) -> None:
        """`_io` and the handler's lock, both held on return; `_io` let go while another
        thread holds the lock (logging.shutdown and dictConfig flush under it)."""
        lock = self._locked()
        while True:
            self._io.acquire()
            if lock.acquire(blocking=False):
                return
            self._io.release()  # the lock's holder may be waiting for `_io`
            time.sleep(0.001)

    def _warning(self, message: str) -> str:
        """`message` as the request log writes a WARNING line."""
        formatter = self.formatter
        if isinstance(formatter, LineFormatter) and formatter.direct:
            message = formatter.line(logging.WARNING, _request_logger.name, message, time.time())
        return message

    def _at_fork_reinit(self) -> None:
        # logging calls this in a forked child for every handler: its writer thread (and a
        # write it held `_io` for) stayed in the parent, and so do the lines waiting, which
        # the parent writes (the child's copy would write them twice).
        super()._at_fork_reinit()  # type: ignore[misc]
        self._io = threading.Lock()
        self._writer = None
        self._pending = []
        self._dropped = 0

    def setStream(self, stream: IO[str]) -> IO[str] | None:
        self.flush()
        return super().setStream(stream)

    def close(self) -> None:
        """Writes what is waiting and stops the writer thread. Like StreamHandler, still
        usable afterwards (logging.config.dictConfig, which uvicorn calls, closes every
        existing handler and keeps using them): the next line starts a writer again."""
        with self._locked():
            self._writer = None
        self._wake.set()
        self.flush()
        super().close()


def _why(exc: BaseException) -> str:
    """What stopped a write, as the system said it (`No space left on device`)."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return type(exc).__name__


# The exit waits for the last lines while its writes make progress: it gives up after
# EXIT_STALL_SECONDS without a write getting through (a reader that stopped reading), or
# EXIT_FLUSH_CAP_SECONDS in all (a reader that takes a line now and then).
EXIT_STALL_SECONDS = 5.0
EXIT_FLUSH_CAP_SECONDS = 30.0


# The server's own loggers (uvicorn's) whose lines go through a LineHandler in serve
# (queue_server_lines): flushed at exit with the request lines.
_SERVER_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access")
_queued: list[LineHandler] = []


def queue_server_lines() -> None:
    """uvicorn's own lines (its startup, "Shutting down", "Application shutdown complete")
    were written by its StreamHandler in the thread that logged them, the event loop's: a
    stderr whose reader stopped reading (a stalled log shipper) blocked that write for
    ever, and a stopped serve never exited. Each of its stream handlers (after uvicorn's
    dictConfig) becomes a LineHandler on the same stream, with its formatter, level and
    filters: the same text, queued, written by a writer thread."""
    for name in _SERVER_LOGGERS:
        owner = logging.getLogger(name)
        for handler in list(owner.handlers):
            if type(handler) is not logging.StreamHandler:
                continue  # a file, a host's own handler: as it is
            queued = LineHandler(handler.stream)
            queued.setFormatter(handler.formatter)
            queued.setLevel(handler.level)
            for kept in handler.filters:
                queued.addFilter(kept)
            owner.removeHandler(handler)
            owner.addHandler(queued)
            _queued.append(queued)


def flush_request_lines(
    stall: float = EXIT_STALL_SECONDS, cap: float = EXIT_FLUSH_CAP_SECONDS
) -> None:
    """Write the request lines still waiting in serve's LineHandler, and uvicorn's lines
    (queue_server_lines) (at exit; a worker of `serve --workers`, which ends with os._exit,
    calls it itself). Waits while the writes make progress: a lagging log collector still
    gets the last lines. With a reader that stopped reading the pipe the write never ends,
    and a stopped `serve` would not exit until killed: after `stall` seconds without a
    write getting through (or `cap` in all) the lines go unwritten, and uvicorn's handlers
    write nothing more (logging.shutdown's flush would wait for that write for ever)."""
    handlers = [h for h in (_installed, *_queued) if h is not None]
    if not handlers:
        return
    written = threading.Event()

    def write_all() -> None:
        try:
            for handler in handlers:
                handler.flush()
        finally:
            written.set()

    try:
        exit_writer().put(write_all)
    except RuntimeError:  # no thread to write on (Python 3.12 at exit, in a forked child)
        write_all()
    started = progressed = time.monotonic()
    done = sum(h.pieces_written for h in handlers)
    while not written.wait(min(0.05, stall)):
        now = time.monotonic()
        if (now_done := sum(h.pieces_written for h in handlers)) != done:
            done, progressed = now_done, now
        if now - progressed >= stall or now - started >= cap:
            # logging.shutdown flushes uvicorn's handlers next (in logging's list, where
            # dictConfig left serve's own out): they would wait for the stuck write for ever.
            for handler in _queued:
                handler.gave_up = True
            return
