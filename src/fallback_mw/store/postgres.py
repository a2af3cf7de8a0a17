"""The shared route store: PostgreSQL via asyncpg. A statement trigger on the routes and
faults tables bumps a change counter and NOTIFYs, so every gateway LISTENing reloads at once
(the counter is the safety net when a notification is missed)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection
from typing import Any, TypeVar

from fallback_mw.extras import missing_extra

try:
    import asyncpg
except ImportError:
    raise missing_extra("postgres", 'store = "postgresql://..."') from None

from fallback_mw.store.model import (
    SCHEMA_COMPONENT,
    SCHEMA_TABLE_LOCK,
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
)
from fallback_mw.store.postgres_connect import Connects
from fallback_mw.store_url import StoreURLError, driver_reason, redact_url, unusable_store

T = TypeVar("T")

CHANNEL = "fmw_route_changes"
# The database's clock in epoch seconds, the clock fault expiries are kept in (`clock`).
_DB_NOW = "extract(epoch FROM clock_timestamp())::float8"
_MIGRATION_LOCK = 0x666D7772  # "fmwr": serialises concurrent migrations of this component
# The longest one use of the connection may take (a connect has its own 5 s): a connection
# the database's side forgot without a reset (a failover to another host, a NAT or
# firewall that dropped the flow) never answers, and the kernel gives up on it only after
# some 15 minutes; every reload (routes, faults) waited on it that long.
QUERY_TIMEOUT = 5.0

logger = logging.getLogger("fallback_mw.store")

_MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        "CREATE TABLE fmw_routes (id TEXT PRIMARY KEY, doc TEXT NOT NULL, "
        "updated_at TIMESTAMPTZ NOT NULL DEFAULT now())",
        "CREATE TABLE fmw_faults (scope TEXT NOT NULL, target TEXT NOT NULL, "
        "kind TEXT NOT NULL, candidate TEXT, expires_at DOUBLE PRECISION NOT NULL, "
        "PRIMARY KEY (scope, target))",
        "CREATE TABLE fmw_route_changes (name TEXT PRIMARY KEY, serial BIGINT NOT NULL)",
        "INSERT INTO fmw_route_changes (name, serial) VALUES ('routes', 0), ('faults', 0)",
        f"""CREATE FUNCTION fmw_route_changed() RETURNS trigger LANGUAGE plpgsql AS $$
        DECLARE which TEXT := CASE TG_TABLE_NAME WHEN 'fmw_routes' THEN 'routes'
                                                 ELSE 'faults' END;
        BEGIN
            UPDATE fmw_route_changes SET serial = serial + 1 WHERE name = which;
            PERFORM pg_notify('{CHANNEL}', which);
            RETURN NULL;
        END $$""",
        "CREATE TRIGGER fmw_routes_changed AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE "
        "ON fmw_routes FOR EACH STATEMENT EXECUTE FUNCTION fmw_route_changed()",
        "CREATE TRIGGER fmw_faults_changed AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE "
        "ON fmw_faults FOR EACH STATEMENT EXECUTE FUNCTION fmw_route_changed()",
    ),
)


class StoreOptionError(StoreError, StoreURLError):
    """The store URL has an option the driver refuses (`sslmode=requir`): a StoreError to
    the running gateway, a refused configuration (exit 2) to the command line."""


class PostgresStore:
    def __init__(self, dsn: str) -> None:
        self._dsn = dsn
        self._conn: asyncpg.Connection[Any] | None = None
        self._listener: asyncpg.Connection[Any] | None = None
        self._lock: asyncio.Lock | None = None
        self._changed: asyncio.Event | None = None
        self._migrated = False
        self._connects = Connects()  # `aclose` waits for those a cancelled caller left

    async def _connect(self) -> asyncpg.Connection[Any]:
        try:
            return await self._connects.connect(self._dsn, timeout=5)
        except (OSError, TimeoutError, asyncpg.PostgresConnectionError) as exc:
            # The class name alone ("gaierror") left an operator guessing: the reason too
            # ("Name or service not known", "Connect call failed ('10.0.0.5', 5432)"), as
            # `driver_reason` vets it (never a line holding the URL's password).
            kind = type(exc).__name__
            reason = driver_reason(exc, self._dsn)
            said = kind if reason == kind else f"{kind}: {reason}"
            raise StoreError(f"cannot reach the store {redact_url(self._dsn)}: {said}") from None
        except asyncpg.PostgresError as exc:
            # The server answered and said why (a database or role that does not exist, a
            # password it refused): its reason, as `driver_reason` vets it (the type's name
            # when the URL's password could be in it), not the driver's class name.
            raise StoreError(
                f"cannot reach the store {redact_url(self._dsn)}: the server refused the "
                f"connection: {driver_reason(exc, self._dsn)}"
            ) from None
        except asyncpg.ClientConfigurationError as exc:
            # The driver reads the URL's options (sslmode, target_session_attrs...) only
            # here. Its reason names the option, never the password: it is said, once the
            # URL's own password is known not to be in it.
            raise StoreOptionError(unusable_store(self._dsn, exc)) from None

    async def _connection(self) -> asyncpg.Connection[Any]:
        if self._conn is None or self._conn.is_closed():
            self._conn = await self._connect()
            if not self._migrated:
                await self._migrate(self._conn)
                self._migrated = True
        return self._conn

    async def _migrate(self, conn: asyncpg.Connection[Any]) -> None:
        async with conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1)", _MIGRATION_LOCK)
            await conn.execute("SELECT pg_advisory_xact_lock($1)", SCHEMA_TABLE_LOCK)
            await conn.execute(
                "CREATE TABLE IF NOT EXISTS fmw_schema "
                "(component TEXT PRIMARY KEY, version INTEGER NOT NULL)"
            )
            current = await conn.fetchval(
                "SELECT version FROM fmw_schema WHERE component = $1", SCHEMA_COMPONENT
            )
            current = int(current or 0)
            for statement in pending_migrations(current, _MIGRATIONS):
                await conn.execute(statement)
            await conn.execute(
                "INSERT INTO fmw_schema (component, version) VALUES ($1, $2) "
                "ON CONFLICT (component) DO UPDATE SET version = excluded.version",
                SCHEMA_COMPONENT,
                SCHEMA_VERSION,
            )

    async def _with_connection(self, use: Callable[[asyncpg.Connection[Any]], Awaitable[T]]) -> T:
        """`use` the one connection, one caller at a time, for QUERY_TIMEOUT at most; a lost
        or silent connection is dropped (the next call reconnects) and reported as
        StoreError. Database errors such as UniqueViolationError pass through."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            conn = await self._connection()
            try:
                async with asyncio.timeout(QUERY_TIMEOUT):
                    return await use(conn)
            except TimeoutError:  # an OSError: caught before the clause below
                await self._drop()
                raise StoreError(
                    f"the store {redact_url(self._dsn)} did not answer within {QUERY_TIMEOUT:g} s"
                ) from None
            except (OSError, asyncpg.exceptions.ConnectionDoesNotExistError) as exc:
                await self._drop()
                raise StoreError(f"lost the store connection: {type(exc).__name__}") from None

    async def _fetch(self, query: str, *args: Any) -> list[asyncpg.Record]:
        return await self._with_connection(lambda conn: conn.fetch(query, *args))

    async def _execute(self, query: str, *args: Any) -> str:
        return await self._with_connection(lambda conn: conn.execute(query, *args))

    async def _drop(self) -> None:
        if self._conn is not None:
            self._conn.terminate()
            self._conn = None

    # --- routes -----------------------------------------------------------------------

    async def load_routes(self, *, unreadable: list[str] | None = None) -> list[StoredRoute]:
        rows = await self._fetch("SELECT id, doc FROM fmw_routes ORDER BY id")
        # Off the event loop: parsing 2,000 records takes most of a second.
        records = [(row["id"], row["doc"]) for row in rows]
        return await asyncio.to_thread(stored_routes, records, unreadable)

    async def insert_route(self, stored: StoredRoute) -> None:
        try:
            await self._execute(
                "INSERT INTO fmw_routes (id, doc) VALUES ($1, $2)",
                stored.route.id,
                stored.to_doc(),
            )
        except asyncpg.UniqueViolationError:
            raise RouteExists(f"route {stored.route.id!r} already exists in the store") from None

    async def replace_route(self, stored: StoredRoute, *, expected: str | None = None) -> bool:
        if expected is not None:
            status = await self._execute(
                "UPDATE fmw_routes SET doc = $2, updated_at = now() WHERE id = $1 AND doc = $3",
                stored.route.id,
                stored.to_doc(),
                expected,
            )
            return status != "UPDATE 0"
        await self._execute(
            "INSERT INTO fmw_routes (id, doc) VALUES ($1, $2) ON CONFLICT (id) "
            "DO UPDATE SET doc = excluded.doc, updated_at = now()",
            stored.route.id,
            stored.to_doc(),
        )
        return True

    async def replace_route_clearing(
        self, stored: StoredRoute, *, expected: str | None, dropped: Collection[str]
    ) -> int | None:
        async def replace(conn: asyncpg.Connection[Any]) -> int | None:
            # One transaction, as remove_route: the route and its faults together.
            async with conn.transaction():
                status = await conn.execute(
                    "UPDATE fmw_routes SET doc = $2, updated_at = now() "
                    "WHERE id = $1 AND doc IS NOT DISTINCT FROM $3",
                    stored.route.id,
                    stored.to_doc(),
                    expected,
                )
                if status == "UPDATE 0":
                    return None
                status = await conn.execute(
                    "DELETE FROM fmw_faults WHERE (scope = 'upstream' AND target = ANY($1)) "
                    "OR (scope = 'route' AND target = $2 AND candidate = ANY($1))",
                    list(dropped),
                    stored.route.id,
                )
            return int(status.rsplit(" ", 1)[-1])

        return await self._with_connection(replace)

    async def remove_route(
        self, route_id: str, *, keep_upstreams: Collection[str] = (), keep_pin: bool = False
    ) -> int | None:
        async def remove(conn: asyncpg.Connection[Any]) -> int | None:
            # One transaction: every gateway's reload (told at the commit) sees the route
            # with its faults or neither, and a failure in between leaves both in place.
            async with conn.transaction():
                doc = await conn.fetchval(
                    "DELETE FROM fmw_routes WHERE id = $1 RETURNING doc", route_id
                )
                if doc is None:
                    return None
                names = [n for n in owned_upstreams(doc) if n not in keep_upstreams]
                status = await conn.execute(
                    "DELETE FROM fmw_faults WHERE (scope = 'upstream' AND target = ANY($1)) "
                    "OR (scope = 'route' AND target = $2 AND NOT $3)",
                    names,
                    route_id,
                    keep_pin,
                )
            return int(status.rsplit(" ", 1)[-1])

        return await self._with_connection(remove)

    # --- faults -----------------------------------------------------------------------

    async def clock(self) -> float:
        # The database's clock, as the budget ledger's windows: with each host's own, a
        # gateway ten minutes ahead never applied a 5-minute fault, one behind kept it ten
        # minutes too long, and an operator's skewed laptop stretched or cut every --ttl.
        rows = await self._fetch(f"SELECT {_DB_NOW} AS now")
        return float(rows[0]["now"])

    async def load_faults(self, unreadable: list[str] | None = None) -> list[Fault]:
        rows = await self._fetch(
            f"SELECT kind, target, expires_at, candidate, scope, {_DB_NOW} FROM fmw_faults "
            f"WHERE expires_at > {_DB_NOW} ORDER BY scope, target",
        )
        found = [tuple(row.values()) for row in rows]
        now = float(found[0][5]) if found else 0.0  # the store's clock: no row, no matter
        return faults_from_rows((row[:5] for row in found), unreadable, now=now)

    async def set_fault(self, fault: Fault, *, replace: bool = False) -> Fault | None:
        now = await self.clock()
        await self._execute("DELETE FROM fmw_faults WHERE expires_at <= $1", now)
        # One statement: the row is written when the target is free, its fault has expired
        # or `replace` says so; otherwise nothing is written and nothing is returned.
        rows = await self._fetch(
            "INSERT INTO fmw_faults (scope, target, kind, candidate, expires_at) "
            "VALUES ($1, $2, $3, $4, $5) ON CONFLICT (scope, target) DO UPDATE SET "
            "kind = excluded.kind, candidate = excluded.candidate, "
            "expires_at = excluded.expires_at "
            "WHERE $7 OR fmw_faults.expires_at <= $6 RETURNING target",
            fault.scope,
            fault.target,
            fault.kind,
            fault.candidate,
            fault.expires_at,
            now,
            replace,
        )
        if rows:
            return None
        found = await self._fetch(
            "SELECT kind, target, expires_at, candidate, scope FROM fmw_faults "
            "WHERE scope = $1 AND target = $2",
            fault.scope,
            fault.target,
        )
        if not found:  # cleared in between: the refusal still stands, described as it was
            return Fault(fault.kind, fault.target, now, None)
        row = found[0]
        active = fault_from_row(*row.values())
        if active is None:  # a row written by hand, no fault: replaced, as on SQLite
            return await self.set_fault(fault, replace=True)
        return active

    async def clear_faults(
        self,
        *,
        upstream: str | None = None,
        route: str | None = None,
        expires_at: float | None = None,
    ) -> int:
        target = upstream if upstream is not None else route
        if target is not None:
            scope = "upstream" if upstream is not None else "route"
            if expires_at is not None:
                status = await self._execute(
                    "DELETE FROM fmw_faults WHERE scope = $1 AND target = $2 AND expires_at = $3",
                    scope,
                    target,
                    expires_at,
                )
            else:
                status = await self._execute(
                    "DELETE FROM fmw_faults WHERE scope = $1 AND target = $2", scope, target
                )
        else:
            status = await self._execute("DELETE FROM fmw_faults")
        return int(status.rsplit(" ", 1)[-1])

    async def schema_version(self, component: str) -> int:
        rows = await self._fetch("SELECT version FROM fmw_schema WHERE component = $1", component)
        return int(rows[0]["version"]) if rows else 0

    # --- change detection -------------------------------------------------------------

    async def change_serials(self) -> tuple[int, int]:
        rows = await self._fetch("SELECT name, serial FROM fmw_route_changes")
        serials = {row["name"]: int(row["serial"]) for row in rows}
        return serials.get("routes", 0), serials.get("faults", 0)

    def _notified(self, *_: object) -> None:
        if self._changed is not None:
            self._changed.set()

    async def _listen(self) -> bool:
        if self._listener is not None and not self._listener.is_closed():
            return True
        await self._connection()  # migrated: the channel's trigger exists
        try:
            self._listener = await self._connect()
            await self._listener.add_listener(CHANNEL, self._notified)
        except (StoreError, OSError, asyncpg.PostgresError) as exc:
            logger.warning("store LISTEN failed (%s); polling instead", type(exc).__name__)
            if self._listener is not None:  # opened, LISTEN refused (a hot standby): closed
                self._listener.terminate()
            self._listener = None
            return False
        return True

    async def wait_for_change(self, poll_interval: float) -> None:
        if self._changed is None:
            self._changed = asyncio.Event()
        if not await self._listen():
            await asyncio.sleep(poll_interval)
            return
        try:
            async with asyncio.timeout(poll_interval):
                await self._changed.wait()
        except TimeoutError:
            pass
        self._changed.clear()

    async def aclose(self) -> None:
        for conn in (self._listener, self._conn):
            if conn is not None and not conn.is_closed():
                try:
                    await asyncio.wait_for(conn.close(), timeout=2)
                except (OSError, TimeoutError, asyncpg.PostgresError):
                    conn.terminate()
        self._listener = None
        self._conn = None
        await self._connects.ended()  # the watcher's LISTEN connect, cut by a close
