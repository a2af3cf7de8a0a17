"""The SQLite ledger: the embedded default. Several gateway processes may share one file:
every change runs in a `BEGIN IMMEDIATE` transaction (the database write lock), so a hold's
check and its update are one atomic step across processes. WAL mode keeps readers off
the writers' backs. This module says what the calls do (their statements);
store/ledgers/sqlite_calls.py runs them: one at a time per ledger, inline on the event
loop's thread when that cannot block, a request's calls committed in groups."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Callable
from datetime import UTC, datetime
from decimal import Decimal
from typing import TypeVar

from fallback_mw.budget.cost import from_units, to_units
from fallback_mw.budget.ledger import (
    PER_MINUTE_FILTER,
    BudgetStatus,
    Hold,
    MinuteUsage,
    RollingPeak,
    UsageRecord,
    rolling_peak_of,
    rolling_peaks_sql,
    room_needed,
    window_kind,
    window_start,
)
from fallback_mw.config import BudgetConfig
from fallback_mw.request.context import new_request_id
from fallback_mw.store.ledgers.schema import (
    REAP_INTERVAL,
    RECORDED_WINDOWS_BYTES,
    STALE_HOLD_SECONDS,
    USAGE_COLUMNS,
    BudgetCache,
    SQLLedgerBase,
    budget_from_row,
    budgets_from_rows,
    decode_sqlite_time,
    encode_sqlite_time,
    usage_from_row,
    usage_values,
)
from fallback_mw.store.ledgers.sqlite_calls import SQLiteCalls, retrieved
from fallback_mw.store.ledgers.sqlite_groups import Turns
from fallback_mw.store.ledgers.sqlite_holds import finish_hold, settle_stale_holds
from fallback_mw.store.ledgers.sqlite_open import migrate, stale_work
from fallback_mw.store.sqlite_connect import fetch_leniently, immediate, is_read_only

T = TypeVar("T")


class SQLiteLedger(SQLLedgerBase):
    def __init__(
        self,
        path: str,
        *,
        busy_timeout: float = 5.0,
        stale_hold_seconds: float = STALE_HOLD_SECONDS,
        reap_interval: float = REAP_INTERVAL,
    ) -> None:
        self.path = path
        self.busy_timeout = busy_timeout
        self.call_timeout = busy_timeout  # the guard bounds a request's ledger wait by it
        self.stale_hold_seconds = stale_hold_seconds
        self.reap_interval = reap_interval
        self._db = SQLiteCalls(path, busy_timeout=busy_timeout, opened=self._opened)
        self._cache = BudgetCache()

    def _opened(self, conn: sqlite3.Connection) -> None:
        """The worker connection, just opened: the schema migrated, the holds left by a
        process that died mid-request settled."""
        migrate(conn)
        # A file this process may not write (`budgets show` on a read-only store): read as is.
        if not is_read_only(conn) and stale_work(conn, self.stale_hold_seconds):
            with immediate(conn):
                settle_stale_holds(conn, self.stale_hold_seconds)
        self._reap_at = time.monotonic() + self.reap_interval

    # --- holds --------------------------------------------------------------------------

    async def hold(self, budget_id: str, budget: BudgetConfig, amount: Decimal) -> Hold | None:
        start = window_start(budget.window)
        units = to_units(amount)
        limit = to_units(budget.limit)
        needed = room_needed(units)
        if needed > limit:
            return None
        hold_id = new_request_id()  # random hex, as a request id
        now = encode_sqlite_time(datetime.now(UTC))

        reap = self._reap_due()  # a running ledger settles stale holds too

        def work(conn: sqlite3.Connection) -> bool:
            if reap:
                settle_stale_holds(conn, self.stale_hold_seconds)
            reserve = (units, budget_id, start, needed, limit)
            if conn.execute(_RESERVE, reserve).rowcount != 1:
                # No such window yet (its first hold), or the hold does not fit.
                created = conn.execute(
                    "INSERT OR IGNORE INTO fmw_budget_windows (budget_id, window_start) "
                    "VALUES (?, ?)",
                    (budget_id, start),
                ).rowcount
                if created != 1 or conn.execute(_RESERVE, reserve).rowcount != 1:
                    return False
            conn.execute(
                "INSERT INTO fmw_budget_holds "
                "(hold_id, budget_id, window_start, amount_units, created_at) "
                "VALUES (?, ?, ?, ?, ?)",
                (hold_id, budget_id, start, units, now),
            )
            return True

        turns = self._db.loop_turns()
        if turns is None:
            taken = await self._db.grouped(work)
        else:
            future = turns.group.join(work)
            try:
                taken = await future
            except asyncio.CancelledError:
                # Cancelled after its group committed the hold but before this caller
                # resumed: the caller will never settle it, so it is released on the next
                # group, not left HELD. Cancelled before (its future cancelled), the hold
                # may be written still: its group can be in the worker thread, its calls
                # chosen, waiting for another process's lock. Released behind that group
                # too (the turns lock orders them; a no-op when it was left out).
                if future.cancelled() or (
                    future.done() and future.exception() is None and future.result()
                ):
                    self._release_behind(turns, hold_id)
                raise
        if not taken:
            return None
        return Hold(hold_id, budget_id, from_units(units), start)

    def _release_behind(self, turns: Turns, hold_id: str) -> None:
        """Release a hold on the next group commit, awaited by nobody (a failure leaves it
        to the stale-hold reaper, as a failed settlement does)."""

        def work(conn: sqlite3.Connection) -> None:
            finish_hold(conn, hold_id, 0)

        turns.group.join(work).add_done_callback(retrieved)

    async def _finish(self, hold_id: str, spent: int) -> None:
        def work(conn: sqlite3.Connection) -> None:
            with immediate(conn):
                finish_hold(conn, hold_id, spent)

        await self._db.run(work)

    # --- usage and budgets --------------------------------------------------------------

    async def record_usage(self, record: UsageRecord) -> None:
        values = (encode_sqlite_time(record.at), *usage_values(record))

        def work(conn: sqlite3.Connection) -> None:
            conn.execute(_INSERT_USAGE, values)

        await self._db.run(work)

    async def settle_and_record(
        self, hold: Hold | None, amount: Decimal, record: UsageRecord
    ) -> None:
        """The settlement and the usage record in one transaction (one ledger call)."""
        values = (encode_sqlite_time(record.at), *usage_values(record))
        hold_id = None if hold is None else hold.hold_id
        spent = to_units(amount)

        def work(conn: sqlite3.Connection) -> None:
            if hold_id is not None:
                finish_hold(conn, hold_id, spent)
            conn.execute(_INSERT_USAGE, values)

        turns = self._db.loop_turns()
        if turns is None:
            await self._db.grouped(work)
            return
        # A group leaves out a call whose caller gave up: a host's cancel landing while
        # the settlement waited for its group (the budget guard's shield holds off an
        # anyio scope's cancel, not a task's own) left the hold HELD. Shielded, the group
        # writes it whatever happens to the caller.
        future = turns.group.join(work)
        future.add_done_callback(retrieved)
        await asyncio.shield(future)

    async def _load_budget(self, budget_id: str) -> BudgetConfig | None:
        def work(conn: sqlite3.Connection) -> BudgetConfig | None:
            row = conn.execute(
                "SELECT limit_units, window_kind, default_hold_units FROM fmw_budgets "
                "WHERE budget_id = ?",
                (budget_id,),
            ).fetchone()
            return None if row is None else budget_from_row(*row)

        return await self._db.run(work)

    async def set_budget(self, budget_id: str, budget: BudgetConfig) -> None:
        values = (
            budget_id,
            to_units(budget.limit),
            budget.window,
            to_units(budget.default_hold),
            encode_sqlite_time(datetime.now(UTC)),
        )

        def work(conn: sqlite3.Connection) -> None:
            conn.execute(
                "INSERT INTO fmw_budgets "
                "(budget_id, limit_units, window_kind, default_hold_units, updated_at) "
                "VALUES (?, ?, ?, ?, ?) ON CONFLICT (budget_id) DO UPDATE SET "
                "limit_units = excluded.limit_units, window_kind = excluded.window_kind, "
                "default_hold_units = excluded.default_hold_units, "
                "updated_at = excluded.updated_at",
                values,
            )

        await self._db.run(work)
        self._cache.put(budget_id, budget)

    async def stored_budgets(self) -> dict[str, BudgetConfig]:
        def work(conn: sqlite3.Connection) -> dict[str, BudgetConfig]:
            rows = conn.execute(
                "SELECT budget_id, limit_units, window_kind, default_hold_units "
                "FROM fmw_budgets ORDER BY budget_id"
            ).fetchall()
            return budgets_from_rows([(row[0], row[1], row[2], row[3]) for row in rows])

        return await self._db.run(work)

    async def recorded_budgets(self) -> dict[str, str]:
        def work(conn: sqlite3.Connection) -> list[tuple[bytes, str]]:
            return conn.execute(RECORDED_WINDOWS_BYTES).fetchall()

        return {
            bytes(row[0]).decode("utf-8", "replace"): window_kind(row[1])
            for row in await self._db.run(work)
        }

    async def status(self, budget_id: str, budget: BudgetConfig) -> BudgetStatus:
        start = window_start(budget.window)

        def work(conn: sqlite3.Connection) -> tuple[int, int]:
            # As the holds' arithmetic reads them: a hand edit's text was an internal error.
            row = conn.execute(
                "SELECT CAST(spent_units AS INTEGER), CAST(held_units AS INTEGER) "
                "FROM fmw_budget_windows "
                "WHERE budget_id = ? AND window_start = ?",
                (budget_id, start),
            ).fetchone()
            return (0, 0) if row is None else (int(row[0]), int(row[1]))

        spent, held = await self._db.run(work)
        return BudgetStatus.of(budget_id, budget, start, spent, held)

    async def usage(
        self,
        *,
        since: datetime | None = None,
        route: str | None = None,
        tenant: str | None = None,
        limit: int = 1000,
    ) -> list[UsageRecord]:
        where, params = [], []
        if since is not None:
            where.append("at >= ?")
            params.append(encode_sqlite_time(since))
        if route is not None:
            where.append("route = ?")
            params.append(route)
        if tenant is not None:
            where.append("tenant = ?")
            params.append(tenant)
        clause = f"WHERE {' AND '.join(where)} " if where else ""

        def work(conn: sqlite3.Connection) -> list[UsageRecord]:
            rows = fetch_leniently(
                conn,
                f"SELECT {USAGE_COLUMNS} FROM fmw_usage {clause}ORDER BY id DESC LIMIT ?",
                (*params, limit),
            )
            records = []
            for row in reversed(rows):
                try:
                    at = decode_sqlite_time(str(row[0]))
                except ValueError:
                    continue  # a time this version did not write: the record cannot be placed
                records.append(usage_from_row(at, row[1:]))
            return records

        return await self._db.run(work)

    async def rolling_peaks(self, *, since: datetime) -> list[RollingPeak]:
        def work(conn: sqlite3.Connection) -> list[RollingPeak]:
            since_at = (encode_sqlite_time(since),)
            rows = _summed(lambda total: fetch_leniently(conn, _ROLLING_PEAKS[total], since_at))
            return [rolling_peak_of(row) for row in rows]

        return await self._db.run(work)

    async def usage_per_minute(self, *, since: datetime) -> list[MinuteUsage]:
        def work(conn: sqlite3.Connection) -> list[MinuteUsage]:
            since_at = (encode_sqlite_time(since),)
            rows = _summed(lambda total: conn.execute(_PER_MINUTE[total], since_at).fetchall())
            return [
                MinuteUsage(
                    str(route),
                    datetime.fromisoformat(str(minute)).replace(tzinfo=UTC),
                    int(requests),
                    int(tokens or 0),
                    int(metered or 0),
                )
                for route, minute, requests, tokens, metered in rows
            ]

        return await self._db.run(work)

    async def aclose(self) -> None:
        await self._db.aclose()


# The check and the update of a hold, one statement (in the group's transaction).
_RESERVE = (
    "UPDATE fmw_budget_windows SET held_units = held_units + ? "
    "WHERE budget_id = ? AND window_start = ? AND spent_units + held_units + ? <= ?"
)
_INSERT_USAGE = (
    f"INSERT INTO fmw_usage ({USAGE_COLUMNS}) "
    f"VALUES ({', '.join('?' * (USAGE_COLUMNS.count(',') + 1))})"
)
# `at` is stored as 2026-11-30T12:34:56.123456Z: its first 16 characters are the minute,
# its first 19 the second.
# Tokens as `usage` reads them (a hand edit's real, `1e999`, is unknown: it was an internal
# error), summed exactly in SUM's integers; past 2^63 (hand edits: SQLite's SUM raises
# "integer overflow") in TOTAL's floating point. Summed in TOTAL always, a minute's tokens
# past 2^53 lost their last digits (`capacity` printed 11,000,000,000,000,076 for ...077).
_TOKENS = (
    "CASE WHEN typeof(input_tokens) = 'integer' THEN input_tokens ELSE 0 END + "
    "CASE WHEN typeof(output_tokens) = 'integer' THEN output_tokens ELSE 0 END"
)
_SECOND = "CAST(strftime('%s', substr(at, 1, 19)) AS INTEGER)"
_ROLLING_PEAKS = {
    total: rolling_peaks_sql(_SECOND, "?", tokens=_TOKENS, total=total)
    for total in ("SUM", "TOTAL")
}
_PER_MINUTE = {
    total: "SELECT route, substr(at, 1, 16), COUNT(*), "
    f"{total}({_TOKENS}), "
    "SUM(CASE WHEN input_tokens IS NULL AND output_tokens IS NULL THEN 0 ELSE 1 END) "
    f"FROM fmw_usage WHERE at >= ? AND {PER_MINUTE_FILTER} GROUP BY route, substr(at, 1, 16)"
    for total in ("SUM", "TOTAL")
}


def _summed(read: Callable[[str], T]) -> T:
    """`read("SUM")`: exact; `read("TOTAL")` when that overflows SQLite's integers."""
    try:
        return read("SUM")
    except sqlite3.OperationalError as exc:
        if "integer overflow" not in str(exc):
            raise
    return read("TOTAL")
