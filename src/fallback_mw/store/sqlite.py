"""The embedded route store: stdlib sqlite3 in WAL mode, one short connection per operation
(run in a worker thread). Triggers bump a change counter: the gateway's cheap change check."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import TypeVar

from fallback_mw.store.model import (
    SCHEMA_COMPONENT,
    SCHEMA_VERSION,
    Fault,
    RouteExists,
    StoredRoute,
    StoreError,
    fault_from_row,
    faults_from_rows,
    owned_upstreams,
    pending_migrations,
    stored_routes,
    stored_version,
)
from fallback_mw.store.sqlite_connect import (
    connect_wal,
    disk_full,
    read_only_reason,
    read_steadily,
    write_transaction,
)
from fallback_mw.store.sqlite_serials import read_serials

T = TypeVar("T")
logger = logging.getLogger("fallback_mw.store")


_SCHEMA_TABLE = (
    "CREATE TABLE IF NOT EXISTS fmw_schema (component TEXT PRIMARY KEY, version INTEGER NOT NULL)"
)

# Step n migrates from version n-1 to n.
_MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        "CREATE TABLE fmw_routes (id TEXT PRIMARY KEY, doc TEXT NOT NULL, "
        "updated_at REAL NOT NULL)",
        "CREATE TABLE fmw_faults (scope TEXT NOT NULL, target TEXT NOT NULL, "
        "kind TEXT NOT NULL, candidate TEXT, expires_at REAL NOT NULL, "
        "PRIMARY KEY (scope, target))",
        "CREATE TABLE fmw_route_changes (name TEXT PRIMARY KEY, serial INTEGER NOT NULL)",
        "INSERT INTO fmw_route_changes (name, serial) VALUES ('routes', 0), ('faults', 0)",
        *(
            f"CREATE TRIGGER fmw_{table}_{op.lower()} AFTER {op} ON fmw_{table} BEGIN "
            f"UPDATE fmw_route_changes SET serial = serial + 1 WHERE name = '{table}'; END"
            for table in ("routes", "faults")
            for op in ("INSERT", "UPDATE", "DELETE")
        ),
    ),
)


# Text columns are read as their bytes: Python's sqlite3 fails the whole query on one value
# that is not UTF-8 (a row written by hand or by another tool), and its message quoted the
# whole value. `routes list` / `remove` and `faults list` failed, and every gateway's
# reloads stopped as "route store unreachable", fault changes included.
_FAULT_COLUMNS = (
    "CAST(kind AS BLOB), CAST(target AS BLOB), expires_at, CAST(candidate AS BLOB), "
    "CAST(scope AS BLOB)"
)


def _shown_text(value: object) -> str:
    """A text column read as bytes, for naming it: what is not UTF-8 shows as U+FFFD."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _record(kind: object, value: object) -> str | bytes:
    """A route record as text; its bytes when they are not UTF-8 text (StoredRoute.from_doc
    says so), "" (an unreadable record) for a value that is not text at all."""
    if kind != "text" or not isinstance(value, bytes):
        return ""
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return value


def _fault_row(
    kind: object, target: object, expires_at: object, candidate: object, scope: object
) -> tuple[object, object, object, object, object]:
    return (
        _shown_text(kind),
        _shown_text(target),
        expires_at,
        None if candidate is None else _shown_text(candidate),
        _shown_text(scope),
    )


# How long a store call waits for another connection's write lock.
_BUSY_MS = 5000


def _schema_current(conn: sqlite3.Connection) -> bool:
    try:
        row = conn.execute(
            "SELECT version FROM fmw_schema WHERE component = ?", (SCHEMA_COMPONENT,)
        ).fetchone()
    except sqlite3.Error:  # no such table: a new file (or not one of ours: said below)
        return False
    return row is not None and row[0] == SCHEMA_VERSION  # an int: as written


def _with_disk(exc: sqlite3.Error, path: Path) -> str:
    """SQLite's reason, and the full disk or the read-only file behind it when that is
    what it is."""
    full = disk_full(path)
    if full is None and "readonly" in str(exc):
        full = read_only_reason(path)
    return f"{exc} ({full})" if full else str(exc)


class SqliteStore:
    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self._migrated = False

    def _connect(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = None
        try:
            conn = connect_wal(self.path, timeout=_BUSY_MS / 1000)
            conn.execute(f"PRAGMA busy_timeout = {_BUSY_MS}")
            if not self._migrated:  # a read-only file fails here, at its first write
                self._migrate(conn)
                self._migrated = True
        except BaseException as exc:
            if conn is not None:
                conn.close()
            if isinstance(exc, sqlite3.Error):
                raise StoreError(
                    f"cannot open the SQLite store {self.path}: {_with_disk(exc, self.path)}"
                ) from None
            raise
        return conn

    def _migrate(self, conn: sqlite3.Connection) -> None:
        # A current schema is left alone: rewriting its version failed every verb, reads
        # too, on a file this process may not write (`routes list` on a read-only store).
        if _schema_current(conn):
            return
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.execute(_SCHEMA_TABLE)
            row = conn.execute(
                "SELECT version FROM fmw_schema WHERE component = ?", (SCHEMA_COMPONENT,)
            ).fetchone()
            current = stored_version(row[0]) if row else 0
            for statement in pending_migrations(current, _MIGRATIONS):
                conn.execute(statement)
            conn.execute(
                "INSERT INTO fmw_schema (component, version) VALUES (?, ?) "
                "ON CONFLICT (component) DO UPDATE SET version = excluded.version",
                (SCHEMA_COMPONENT, SCHEMA_VERSION),
            )
            conn.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):  # never hide why the migration failed
                conn.execute("ROLLBACK")
            raise

    async def _run(self, operation: Callable[[sqlite3.Connection], T]) -> T:
        def call() -> T:
            try:
                # A connection that reads the file alone (this user may not write it) is
                # read again while a writer changes the file under it.
                return read_steadily(self.path, self._connect, operation)
            except sqlite3.Error as exc:
                raise StoreError(f"SQLite store error: {_with_disk(exc, self.path)}") from None

        return await asyncio.to_thread(call)

    # --- routes -----------------------------------------------------------------------

    async def load_routes(self, *, unreadable: list[str] | None = None) -> list[StoredRoute]:
        rows = await self._run(
            lambda c: c.execute(
                "SELECT CAST(id AS BLOB), typeof(doc), CAST(doc AS BLOB) FROM fmw_routes "
                "ORDER BY id"
            ).fetchall()
        )
        # Off the event loop: parsing 2,000 records takes most of a second.
        records = [(_shown_text(i), _record(kind, doc)) for i, kind, doc in rows]
        return await asyncio.to_thread(stored_routes, records, unreadable)

    async def insert_route(self, stored: StoredRoute) -> None:
        def insert(conn: sqlite3.Connection) -> None:
            try:
                conn.execute(
                    "INSERT INTO fmw_routes (id, doc, updated_at) VALUES (?, ?, ?)",
                    (stored.route.id, stored.to_doc(), time.time()),
                )
            except sqlite3.IntegrityError:
                raise RouteExists(
                    f"route {stored.route.id!r} already exists in the store"
                ) from None

        await self._run(insert)

    async def replace_route(self, stored: StoredRoute, *, expected: str | None = None) -> bool:
        def replace(conn: sqlite3.Connection) -> bool:
            if expected is not None:
                cursor = conn.execute(
                    "UPDATE fmw_routes SET doc = ?, updated_at = ? WHERE id = ? AND doc = ?",
                    (stored.to_doc(), time.time(), stored.route.id, expected),
                )
                return cursor.rowcount > 0
            conn.execute(
                "INSERT INTO fmw_routes (id, doc, updated_at) VALUES (?, ?, ?) "
                "ON CONFLICT (id) DO UPDATE SET doc = excluded.doc, "
                "updated_at = excluded.updated_at",
                (stored.route.id, stored.to_doc(), time.time()),
            )
            return True

        return await self._run(replace)

    async def replace_route_clearing(
        self, stored: StoredRoute, *, expected: str | None, dropped: Collection[str]
    ) -> int | None:
        def replace(conn: sqlite3.Connection) -> int | None:
            # One write transaction, as remove_route: the route and its faults together.
            with write_transaction(conn):
                cursor = conn.execute(
                    "UPDATE fmw_routes SET doc = ?, updated_at = ? WHERE id = ? AND doc IS ?",
                    (stored.to_doc(), time.time(), stored.route.id, expected),
                )
                if cursor.rowcount == 0:
                    conn.execute("ROLLBACK")
                    return None
                names = list(dropped)
                marks = ", ".join("?" * len(names)) or "NULL"
                cleared = conn.execute(
                    f"DELETE FROM fmw_faults WHERE (scope = 'upstream' AND target IN ({marks})) "
                    f"OR (scope = 'route' AND target = ? AND candidate IN ({marks}))",
                    (*names, stored.route.id, *names),
                ).rowcount
                return int(cleared)

        return await self._run(replace)

    async def remove_route(
        self, route_id: str, *, keep_upstreams: Collection[str] = (), keep_pin: bool = False
    ) -> int | None:
        def remove(conn: sqlite3.Connection) -> int | None:
            # One write transaction: a gateway's reload sees the route with its faults or
            # neither, and a failure between the two deletes leaves both in place.
            with write_transaction(conn):
                row = conn.execute(
                    "SELECT CAST(doc AS BLOB) FROM fmw_routes WHERE id = ?", (route_id,)
                ).fetchone()
                if row is None:
                    conn.execute("ROLLBACK")
                    return None
                conn.execute("DELETE FROM fmw_routes WHERE id = ?", (route_id,))
                owned = owned_upstreams(_shown_text(row[0]))
                names = [n for n in owned if n not in keep_upstreams]
                cleared = conn.execute(
                    "DELETE FROM fmw_faults WHERE (scope = 'upstream' AND target IN "
                    f"({', '.join('?' * len(names)) or 'NULL'})) "
                    "OR (scope = 'route' AND target = ? AND NOT ?)",
                    (*names, route_id, keep_pin),
                ).rowcount
                return int(cleared)

        return await self._run(remove)

    # --- faults -----------------------------------------------------------------------

    async def clock(self) -> float:
        return time.time()  # the file is this host's: its processes share this clock

    async def load_faults(self, unreadable: list[str] | None = None) -> list[Fault]:
        now = time.time()
        rows = await self._run(
            lambda c: c.execute(
                f"SELECT {_FAULT_COLUMNS} FROM fmw_faults WHERE expires_at > ? "
                "ORDER BY scope, target",
                (now,),
            ).fetchall()
        )
        return faults_from_rows([_fault_row(*row) for row in rows], unreadable, now=now)

    async def set_fault(self, fault: Fault, *, replace: bool = False) -> Fault | None:
        def put(conn: sqlite3.Connection) -> Fault | None:
            # One write transaction: the check for an active fault and the insert cannot
            # interleave with another process's (BEGIN IMMEDIATE takes the write lock).
            with write_transaction(conn):
                conn.execute("DELETE FROM fmw_faults WHERE expires_at <= ?", (time.time(),))
                row = conn.execute(
                    f"SELECT {_FAULT_COLUMNS} FROM fmw_faults WHERE scope = ? AND target = ?",
                    (fault.scope, fault.target),
                ).fetchone()
                active = None if row is None else fault_from_row(*_fault_row(*row))
                if active is not None and not replace:  # an unreadable row is replaced
                    conn.execute("ROLLBACK")
                    return active
                conn.execute(
                    "INSERT INTO fmw_faults (scope, target, kind, candidate, expires_at) "
                    "VALUES (?, ?, ?, ?, ?) ON CONFLICT (scope, target) DO UPDATE SET "
                    "kind = excluded.kind, candidate = excluded.candidate, "
                    "expires_at = excluded.expires_at",
                    (fault.scope, fault.target, fault.kind, fault.candidate, fault.expires_at),
                )
                return None

        return await self._run(put)

    async def clear_faults(
        self,
        *,
        upstream: str | None = None,
        route: str | None = None,
        expires_at: float | None = None,
    ) -> int:
        def clear(conn: sqlite3.Connection) -> int:
            target = upstream if upstream is not None else route
            if target is not None:
                scope = "upstream" if upstream is not None else "route"
                if expires_at is not None:
                    cursor = conn.execute(
                        "DELETE FROM fmw_faults WHERE scope = ? AND target = ? AND expires_at = ?",
                        (scope, target, expires_at),
                    )
                else:
                    cursor = conn.execute(
                        "DELETE FROM fmw_faults WHERE scope = ? AND target = ?", (scope, target)
                    )
            else:
                cursor = conn.execute("DELETE FROM fmw_faults")
            return cursor.rowcount

        return await self._run(clear)

    async def schema_version(self, component: str) -> int:
        row = await self._run(
            lambda c: c.execute(
                "SELECT version FROM fmw_schema WHERE component = ?", (component,)
            ).fetchone()
        )
        return 0 if row is None else stored_version(row[0], component)

    # --- change detection -------------------------------------------------------------

    async def change_serials(self) -> tuple[int, int]:
        return await self._run(read_serials)

    async def wait_for_change(self, poll_interval: float) -> None:
        await asyncio.sleep(poll_interval)

    async def aclose(self) -> None:
        return None
