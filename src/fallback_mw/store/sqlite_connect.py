"""Opening a SQLite database that several connections (and processes) share, in WAL mode."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path


def connect_wal(
    path: str | Path, *, timeout: float = 5.0, check_same_thread: bool = True
) -> sqlite3.Connection:
    """Open `path` in autocommit mode (explicit BEGIN IMMEDIATE by the callers) and switch
    it to WAL. Switching the journal mode needs an exclusive lock and SQLite answers
    "database is locked" at once, without its busy handler, when another connection is
    opening the same fresh file (seen: 18 of 600 racing openers) — so retry until
    `timeout`."""
    conn = sqlite3.connect(
        path, timeout=timeout, isolation_level=None, check_same_thread=check_same_thread
    )
    deadline = time.monotonic() + timeout
    delay = 0.005
    while True:
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            return conn
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() >= deadline:
                conn.close()
                raise
        time.sleep(delay)
        delay = min(delay * 2, 0.1)
