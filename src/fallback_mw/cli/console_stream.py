"""The stream OpenTelemetry's `console` exporters write to when no `out` is given (serve's
OTEL_TRACES_EXPORTER / OTEL_METRICS_EXPORTER=console): stdout, never written from a
request. The span exporter writes each span as it ends, on the event loop: on a stdout
nobody reads (`serve | less` left on one page, a stalled log shipper) the pipe filled and
the next write blocked the loop, every request with it, and the stop; on a stdout gone
(a reader that exited, `>&-`) every span wrote a traceback to the log.

Here a write only queues the text; one thread writes it to its own copy of stdout's file
descriptor (a write blocked there holds no lock the interpreter needs at exit). Past
MAX_PENDING_CHARS the records are counted, not kept (one larger than that alone is kept
while nothing else waits), and one line in the output says how many went missing once
stdout takes text again. A stdout that cannot be written (closed,
EPIPE, a full disk) is said once in the log; console telemetry then stops."""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
import time
from collections import deque
from typing import TextIO

from fallback_mw.cli.serve_logging import heard

_log = logging.getLogger("fallback_mw.telemetry")

# About 500 spans as the console exporter writes them.
MAX_PENDING_CHARS = 1 << 20


class ConsoleStream:
    """A text stream whose `write` never blocks; `close(timeout)` writes what is pending
    for at most `timeout` seconds."""

    def __init__(self, target: TextIO | None) -> None:
        self._fd: int | None = None
        self._target = target
        self._encoding = getattr(target, "encoding", None) or "utf-8"
        if target is not None:
            try:
                self._fd = os.dup(target.fileno())
            except (OSError, ValueError, AttributeError):
                self._fd = None  # no descriptor (a test's capture): written through `target`
        self._pending: deque[str] = deque()
        self._size = 0
        self._dropped = 0
        self._busy = False
        self._gone = target is None
        self._told = False
        self._closed = False
        self._ready = threading.Condition()
        self._thread: threading.Thread | None = None

    def write(self, text: str) -> int:
        with self._ready:
            if self._closed:
                return len(text)
            if self._gone:
                self._say_gone()
                return len(text)
            if self._pending and self._size + len(text) > MAX_PENDING_CHARS:
                # Only behind other records: one larger than the bound alone (a metric
                # export of a large route table) is queued, or it never got through.
                self._dropped += 1
                return len(text)
            self._pending.append(text)
            self._size += len(text)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="fallback-mw console telemetry", daemon=True
                )
                self._thread.start()
            self._ready.notify()
        return len(text)

    def flush(self) -> None:
        """Nothing: the writer thread writes as soon as it can."""

    def close(self, timeout: float) -> None:
        """Write what is pending, for at most `timeout` seconds; later writes are dropped."""
        deadline = time.monotonic() + timeout
        with self._ready:
            while (self._pending or self._busy) and not self._gone:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._ready.wait(left)
            self._closed = True
            self._ready.notify_all()
            if self._thread is None:
                self._close_fd()  # never written: no thread to close it
            # Else the writer thread closes its descriptor as it ends (not here, under a
            # write it may still be blocked in: the number could be reused meanwhile).

    def _close_fd(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _run(self) -> None:
        try:
            self._write_until_closed()
        finally:
            self._close_fd()

    def _write_until_closed(self) -> None:
        while True:
            with self._ready:
                while not self._pending and not self._closed:
                    self._ready.wait()
                if self._closed and not self._pending:
                    return
                texts = list(self._pending)
                self._pending.clear()
                self._size = 0
                dropped, self._dropped = self._dropped, 0
                self._busy = True
            if dropped:
                texts.insert(
                    0,
                    f"[fallback-mw: {dropped} console telemetry record(s) dropped: stdout "
                    "was not taking them]\n",
                )
            ok = self._write("".join(texts))
            with self._ready:
                self._busy = False
                if not ok:
                    self._gone = True
                    self._pending.clear()
                    self._say_gone()
                self._ready.notify_all()
                if self._gone:
                    return

    def _write(self, text: str) -> bool:
        try:
            if self._fd is None:
                assert self._target is not None
                self._target.write(text)
                self._target.flush()
                return True
            data = text.encode(self._encoding, "replace")
            while data:
                try:
                    data = data[os.write(self._fd, data) :]
                except BlockingIOError:
                    # A stdout left non-blocking (by a parent that shares it): full for now,
                    # not gone.
                    select.select([], [self._fd], [], 1.0)
        except (OSError, ValueError):
            return False
        return True

    def _say_gone(self) -> None:
        """Once, in the log (under the lock). Not before the log has a handler: serve sets
        up telemetry before its log handler, and a metric export in between said it to a
        NullHandler only (then never again); the next write says it."""
        if self._told or not heard(_log):
            return
        self._told = True
        why = "closed" if self._target is None else "not writable (its reader has gone?)"
        _log.warning(
            "console telemetry stopped: stdout is %s; OTEL_TRACES_EXPORTER / "
            "OTEL_METRICS_EXPORTER=console write nothing more (use otlp, or none)",
            why,
        )
