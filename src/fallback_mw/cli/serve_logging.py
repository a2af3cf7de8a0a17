"""What `serve`'s log says: one line per routed request (fallback_mw.request, written in
batches), uvicorn's colours (none under NO_COLOR), and a request a stop cut said in one
line instead of uvicorn's traceback."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Callable


def heard(logger: logging.Logger) -> bool:
    """Whether a record `logger` logs now reaches a handler other than a NullHandler (or
    logging's last resort, used when the loggers have no handler at all). serve sets up
    telemetry before its log handler: a line said once (console_stream, otel_session) must
    wait for one, or an export in between says it to a NullHandler only, then never again."""
    found = False
    current: logging.Logger | None = logger
    while current is not None:
        for handler in current.handlers:
            if not isinstance(handler, logging.NullHandler):
                return True
            found = True
        if not current.propagate:
            break
        current = current.parent
    return not found


def uvicorn_colours() -> bool:
    """uvicorn's `use_colors`: none under NO_COLOR (no-color.org: set and not empty) or
    TERM=dumb, else colour when stderr, where its lines go, is a terminal (uvicorn's own
    choice asked stdout: `serve 2> serve.log` from a shell wrote escapes into the file).
    Started with stderr closed there is no terminal to ask: none."""
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb" or sys.stderr is None:
        return False
    try:
        return sys.stderr.isatty()
    except (OSError, ValueError):  # closed under us
        return False


class CutRequestLine(logging.Filter):
    """uvicorn logs each request its graceful-shutdown timeout cuts as "Exception in ASGI
    application" with the CancelledError's traceback, once per request: on every deploy
    with a long stream in flight. That record becomes one line saying what happened (the
    request's own line says `outcome=cancelled`); any other error keeps its traceback.
    `forced()`: whether a second Ctrl-C cut them (uvicorn's force quit), not the timeout."""

    def __init__(self, forced: Callable[[], bool] = lambda: False) -> None:
        super().__init__()
        self.forced = forced

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info
        if (
            exc is not None
            and exc[0] is not None
            and issubclass(exc[0], asyncio.CancelledError)
            and str(record.msg).startswith("Exception in ASGI application")
        ):
            record.msg = (
                "a request in flight was cut by a forced stop (a second Ctrl-C) "
                "(its line says outcome=cancelled)"
                if self.forced()
                else "a request in flight was cut: it outlasted --timeout-graceful-shutdown "
                "(its line says outcome=cancelled)"
            )
            record.args = ()
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def configure_logging(*, with_pid: bool = False) -> None:
    # One line per routed request (fallback_mw.request); names and codes only. Workers of
    # `serve --workers` say which process wrote the line: `fallback_mw.request[PID]`.
    # The lines are written in batches (LineHandler: at most 0.1 s late), and the
    # process (serve's own) skips what no serve format shows: the caller's source line,
    # thread and multiprocessing names, the pid unless it is printed (about a quarter of
    # the line's cost).
    from fallback_mw.telemetry.line_writer import (
        SERVE_FORMAT,
        SERVE_FORMAT_PID,
        LineFormatter,
        LineHandler,
    )

    root = logging.getLogger("fallback_mw")
    if all(isinstance(handler, logging.NullHandler) for handler in root.handlers):
        handler = LineHandler()
        handler.setFormatter(LineFormatter(SERVE_FORMAT_PID if with_pid else SERVE_FORMAT))
        handler.install(root)
        root.setLevel(logging.INFO)
        logging._srcfile = None  # the logging HOWTO's "Optimization" section
        logging.logThreads = False
        logging.logMultiprocessing = False
        logging.logProcesses = with_pid
