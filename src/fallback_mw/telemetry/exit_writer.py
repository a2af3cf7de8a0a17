"""The thread the request log's exit flush writes on (`line_writer.flush_request_lines`).

Python 3.12 starts no thread once the interpreter is exiting (atexit callbacks included),
so it is started with serve's log handler and idles until the exit hands it the flush."""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable

# "RuntimeError: can't create new thread at interpreter shutdown" at exit on 3.12, and the
# last lines were lost. One per process (a forked child starts its own).
_exit_lock = threading.Lock()
_exit_jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
_exit_thread: threading.Thread | None = None


def exit_writer() -> queue.SimpleQueue[Callable[[], None]]:
    """The queue of the exit's writer thread, started if it is not running (RuntimeError
    when no thread can start)."""
    global _exit_thread
    with _exit_lock:
        if _exit_thread is None or not _exit_thread.is_alive():
            thread = threading.Thread(
                target=_write_at_exit, name="fallback-mw-log-exit", daemon=True
            )
            thread.start()
            _exit_thread = thread
    return _exit_jobs


def _write_at_exit() -> None:
    while True:
        _exit_jobs.get()()


def _forget_exit_writer() -> None:  # in a forked child: the thread, its lock and queue stayed
    global _exit_lock, _exit_jobs, _exit_thread
    _exit_lock, _exit_jobs, _exit_thread = threading.Lock(), queue.SimpleQueue(), None


os.register_at_fork(after_in_child=_forget_exit_writer)
