"""What the SQLite ledger does to its file when it opens it: the schema migrated, and the
holds left by a process that died mid-request settled. Each writes only when there is
something to write, so opening takes no write lock otherwise: `budgets show` and `usage`
read a file another process (an operator's `sqlite3` session, a `VACUUM`) holds the write
lock on, or one they may not write, as the route verbs do."""

from __future__ import annotations

import contextlib
import sqlite3
from datetime import UTC, datetime, timedelta

from fallback_mw.store.ledgers.schema import (
    COMPONENT,
    LATEST_VERSION,
    REAPED_KEPT_SECONDS,
    SCHEMA_TABLE,
    check_version,
    encode_sqlite_time,
    pending_migrations,
)
from fallback_mw.store.sqlite_connect import immediate, is_read_only

_VERSION = "SELECT version FROM fmw_schema WHERE component = ?"


def migrate(conn: sqlite3.Connection) -> None:
    row = None
    with contextlib.suppress(sqlite3.OperationalError):  # no fmw_schema yet: a new file
        row = conn.execute(_VERSION, (COMPONENT,)).fetchone()
        if row is not None and row[0] == LATEST_VERSION:  # an int: as written
            return
    if is_read_only(conn):  # a file this process may not write (sqlite_connect.connect_wal)
        if row is not None:
            check_version(row[0])  # a newer schema is said as such
        raise sqlite3.OperationalError(
            "attempt to write a readonly database, to make its budget ledger (it has none "
            "yet: nothing was held, spent or recorded in it)"
            if row is None
            else "attempt to write a readonly database, to migrate its budget ledger"
        )
    with immediate(conn):
        conn.execute(SCHEMA_TABLE)
        row = conn.execute(_VERSION, (COMPONENT,)).fetchone()
        current = 0 if row is None else check_version(row[0])
        for statement in pending_migrations(current, "sqlite"):
            conn.execute(statement)
        if current != LATEST_VERSION:
            conn.execute(
                "INSERT INTO fmw_schema (component, version) VALUES (?, ?) "
                "ON CONFLICT (component) DO UPDATE SET version = excluded.version",
                (COMPONENT, LATEST_VERSION),
            )


def stale_work(conn: sqlite3.Connection, older_than: float) -> bool:
    """Whether the stale-hold settlement has anything to do: a hold older than
    `older_than` seconds, or a reaped one kept past its time."""
    now = datetime.now(UTC)
    cutoff = encode_sqlite_time(now - timedelta(seconds=older_than))
    forgotten = encode_sqlite_time(now - timedelta(seconds=REAPED_KEPT_SECONDS))
    row = conn.execute(
        "SELECT EXISTS (SELECT 1 FROM fmw_budget_holds WHERE created_at < ?) "
        "OR EXISTS (SELECT 1 FROM fmw_budget_reaped WHERE reaped_at < ?)",
        (cutoff, forgotten),
    ).fetchone()
    return bool(row[0])
