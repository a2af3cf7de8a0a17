"""The SQLite ledger: the embedded default. Several gateway processes may share one file:
every change runs in a `BEGIN IMMEDIATE` transaction (the database write lock), so a hold's
check and its update are one atomic step across processes. WAL mode keeps readers off
the writers' backs. Calls run one at a time per ledger: on the event loop's thread when
that cannot block (`_inline`: about a quarter of a thread hop's CPU), else in a worker
thread. A request's two calls (the hold; the settlement with its usage record) are
committed in groups (`_grouped`): every such call of this process that is ready on one
turn of the event loop shares one transaction."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any, TypeVar

import anyio.to_thread

from fallback_mw.budget.cost import MAX_UNITS, SPENT_CAP_UNITS, from_units, to_units
from fallback_mw.budget.ledger import (
    PER_MINUTE_FILTER,
    BudgetStatus,
    Hold,
    LedgerUnavailable,
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
from fallback_mw.grouping import Failed, Group, Pending, fail, settle
from fallback_mw.request.context import new_request_id
from fallback_mw.store.ledgers.schema import (
    COMPONENT,
    LATEST_VERSION,
    REAP_INTERVAL,
    REAPED_KEPT_SECONDS,
    RECORDED_WINDOWS,
    SCHEMA_TABLE,
    STALE_HOLD_SECONDS,
    USAGE_COLUMNS,
    BudgetCache,
    SchemaTooNew,
    SQLLedgerBase,
    budget_from_row,
    budgets_from_rows,
    decode_sqlite_time,
    encode_sqlite_time,
    pending_migrations,
    usage_from_row,
    usage_values,
)
from fallback_mw.store.outage import OutageLog
from fallback_mw.store.sqlite_connect import connect_wal, disk_full

T = TypeVar("T")
# One ledger call in this many runs on the worker thread (which checkpoints the WAL).
CHECKPOINT_EVERY = 128
logger = logging.getLogger("fallback_mw.budget")


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
        self.stale_hold_seconds = stale_hold_seconds
        self.reap_interval = reap_interval
        self._conn: sqlite3.Connection | None = None
        self._busy_ms = int(busy_timeout * 1000)  # the worker connection's busy timeout
        self._fast: sqlite3.Connection | None = None  # the event loop thread's (_inline)
        self._calls = 0
        self._turns: _Turns | None = None
        self._writers: set[asyncio.Task[None]] = set()  # groups gone to the worker thread
        self._lock = threading.Lock()
        self._cache = BudgetCache()
        self._outage = OutageLog(logger, "SQLite ledger")  # one WARNING each way

    # --- connection and schema --------------------------------------------------------

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            # Autocommit (explicit BEGIN IMMEDIATE / COMMIT below); used from worker
            # threads, under self._lock.
            conn = connect_wal(self.path, timeout=self.busy_timeout, check_same_thread=False)
            try:
                conn.execute("PRAGMA synchronous=NORMAL")
                _migrate(conn)
                with _immediate(conn):
                    _settle_stale_holds(conn, self.stale_hold_seconds)
            except BaseException:
                conn.close()
                raise
            self._conn = conn
            self._busy_ms = int(self.busy_timeout * 1000)
            self._reap_at = time.monotonic() + self.reap_interval
        return self._conn

    def _inline(self, work: Callable[[sqlite3.Connection], T]) -> tuple[bool, T | None]:
        """`work` on the event loop's thread, when that cannot block it: the ledger is
        free in this process (nobody in a worker thread), the connection waits for no
        lock (busy timeout 0: another process holding the write lock is an immediate
        "database is locked") and never checkpoints (wal_autocheckpoint off: the worker
        thread's connection checkpoints, see `_run`). A WAL commit with
        synchronous=NORMAL is a write to the page cache, no fsync. (True, result) when
        done; (False, None) when the worker thread must do it (nothing was committed)."""
        conn = self._fast
        if conn is None or not self._lock.acquire(blocking=False):
            return False, None
        try:
            changes = conn.total_changes
            found = work(conn)
            wrote = conn.total_changes != changes
        except sqlite3.OperationalError:
            # Locked by another process, or a real failure the worker thread will meet
            # again (and report): either way nothing was committed.
            if conn.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
            return False, None
        finally:
            self._lock.release()
        if wrote:
            self._outage.recovered()  # see `_in_thread`
        return True, found

    def _open_fast(self) -> None:
        """The loop thread's connection, opened (from the worker thread) once the main
        one has migrated the schema."""
        if self._fast is None:
            try:
                fast = connect_wal(self.path, timeout=0.0, check_same_thread=False)
            except sqlite3.Error:
                return  # e.g. locked right now: the next call tries again
            try:
                fast.execute("PRAGMA synchronous=NORMAL")
                fast.execute("PRAGMA wal_autocheckpoint=0")
            except sqlite3.Error:
                fast.close()
                return
            self._fast = fast

    def _loop_turns(self) -> _Turns | None:
        """This process's calls take turns on an asyncio lock (one per event loop), so a
        call waits for one running in the worker thread instead of hopping to a thread
        behind it; its grouped calls (`_grouped`) wait with it. None outside asyncio (then
        every call hops, as before)."""
        loop = _running_loop()
        if loop is None:
            return None
        if self._turns is None or self._turns.loop is not loop:
            self._turns = _Turns(loop, self._commit_group)
        return self._turns

    async def _run(self, work: Callable[[sqlite3.Connection], T]) -> T:
        turns = self._loop_turns()
        if turns is None:
            return await self._in_thread(work)
        deadline = turns.loop.time() + self.busy_timeout
        await self._take_turn(turns, deadline)
        try:
            self._calls += 1
            inline = self._calls % CHECKPOINT_EVERY != 0
            return await self._write(work, inline=inline, deadline=deadline)
        finally:
            turns.lock.release()

    async def _take_turn(self, turns: _Turns, deadline: float) -> None:
        """This loop's turn, by `deadline` (the loop's clock): the wait behind the calls
        ahead, each waiting for another process's write lock, counts against the busy
        timeout, so each call is refused within it (as on PostgreSQL), not after the
        timeouts of every call queued before it."""
        lock = turns.lock
        if not lock.locked():
            await lock.acquire()  # free: taken at once
            return
        try:
            async with asyncio.timeout_at(deadline):
                await lock.acquire()
        except TimeoutError:
            raise self._unavailable("locked", "database is locked") from None

    async def _write(
        self, work: Callable[[sqlite3.Connection], T], *, inline: bool, deadline: float
    ) -> T:
        """`work`, in this loop's turn: on the loop's thread when `inline` and that cannot
        block, else in the worker thread, which waits for another process's lock until
        `deadline`. Every CHECKPOINT_EVERY-th call is not inline: the worker thread's
        connection checkpoints the WAL when it has grown past SQLite's default 1000
        pages."""
        if inline:
            done, found = self._inline(work)
            if done:
                return found  # type: ignore[return-value]
        left = deadline - asyncio.get_running_loop().time()
        return await self._in_thread(work, wait=max(left, 0.0))

    async def _in_thread(
        self, work: Callable[[sqlite3.Connection], T], *, wait: float | None = None
    ) -> T:
        """`work` in the worker thread, waiting `wait` seconds at most for another
        process's write lock (None: the busy timeout)."""
        until = None if wait is None else time.monotonic() + wait

        def locked() -> tuple[T, bool]:
            with self._lock:
                conn = self._connection()
                left = self.busy_timeout if until is None else until - time.monotonic()
                busy_ms = max(int(left * 1000), 0)
                if busy_ms != self._busy_ms:
                    conn.execute(f"PRAGMA busy_timeout = {busy_ms}")
                    self._busy_ms = busy_ms
                changes = conn.total_changes
                result = work(conn)
                wrote = conn.total_changes != changes
                self._open_fast()
                return result, wrote

        try:
            result, wrote = await anyio.to_thread.run_sync(locked)
        except (sqlite3.Error, SchemaTooNew) as exc:
            # SQLite's own reason ("file is not a database", "attempt to write a readonly
            # database") names no secret: a file path holds none.
            raise self._unavailable(type(exc).__name__, str(exc)) from None
        except (OSError, RuntimeError) as exc:
            # The host, not the file: no descriptor left for an import or the file's
            # directory (EMFILE), no worker thread ("can't start new thread"). Fail closed
            # (503 budget_unavailable), never a bare 500.
            raise self._unavailable(type(exc).__name__, str(exc)) from None
        if wrote:
            # A write ends an outage; a read does not: a file another process holds the
            # write lock on still answers reads (WAL), and each read would log "reachable
            # again" between two holds refused.
            self._outage.recovered()
        return result

    def _unavailable(self, kind: str, reason: str) -> LedgerUnavailable:
        full = disk_full(self.path)
        if full is not None:  # SQLite says "disk I/O error" for the WAL index it could not make
            kind, reason = f"{kind}: {full}", f"{reason}; {full}"
        self._outage.failed(kind, "budgeted routes refuse (fail closed)")
        reason = " ".join(reason.split())[:200]
        return LedgerUnavailable(f"SQLite ledger {self.path} unavailable ({kind}: {reason})")

    # --- group commit -------------------------------------------------------------------

    async def _grouped(self, work: Callable[[sqlite3.Connection], T]) -> T:
        """`work` (its statements; the transaction is the group's) committed with every
        other grouped call of this process that is ready on this turn of the event loop
        (`fallback_mw.grouping`): one `BEGIN IMMEDIATE` ... `COMMIT` for all of them. A
        commit's cost is its file locks and WAL writes, not its statements (measured: a
        hold alone about 40 µs of CPU, in a group of 16 about 12; a usage record 20 and
        2). Each call's result is its own, as if it ran alone and in this order; a call
        whose statements fail fails alone (the others commit); a group that cannot be
        written (the database locked by another process) goes to the worker thread whole,
        nothing of it committed."""
        turns = self._loop_turns()
        if turns is None:  # outside asyncio: a transaction of its own, as any call
            return await self._run(_transaction(work))
        result: T = await turns.group.join(work)
        return result

    def _commit_group(self, turns: _Turns, calls: list[Pending[_Work]]) -> None:
        work = _group_work(calls)
        self._calls += 1
        inline = self._calls % CHECKPOINT_EVERY != 0  # as `_run`
        if inline and not turns.lock.locked():
            try:
                done, results = self._inline(work)
            except Exception as exc:  # a lone call's own failure (e.g. a constraint)
                fail(calls, exc)
                return
            if done:
                assert results is not None
                settle(calls, results)
                return
            inline = False  # locked by another process: the worker thread waits for it
        # Behind a call in the worker thread (its turn comes when that one is done), or
        # to the worker thread itself: refused once the busy timeout has passed.
        deadline = turns.loop.time() + self.busy_timeout
        task = turns.loop.create_task(self._commit_later(calls, work, turns, inline, deadline))
        self._writers.add(task)
        task.add_done_callback(self._writers.discard)

    async def _commit_later(
        self,
        calls: list[Pending[_Work]],
        work: Callable[[sqlite3.Connection], list[object]],
        turns: _Turns,
        inline: bool,
        deadline: float,
    ) -> None:
        try:
            await self._take_turn(turns, deadline)
            try:
                results = await self._write(work, inline=inline, deadline=deadline)
            finally:
                turns.lock.release()
        except BaseException as exc:  # LedgerUnavailable, a lone call's failure, shutdown
            fail(calls, exc)
            if not isinstance(exc, Exception):
                raise
            return
        settle(calls, results)

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
                _settle_stale_holds(conn, self.stale_hold_seconds)
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

        turns = self._loop_turns()
        if turns is None:
            taken = await self._grouped(work)
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

    def _release_behind(self, turns: _Turns, hold_id: str) -> None:
        """Release a hold on the next group commit, awaited by nobody (a failure leaves it
        to the stale-hold reaper, as a failed settlement does)."""

        def work(conn: sqlite3.Connection) -> None:
            _finish_hold(conn, hold_id, 0)

        turns.group.join(work).add_done_callback(_retrieved)

    async def _finish(self, hold_id: str, spent: int) -> None:
        def work(conn: sqlite3.Connection) -> None:
            with _immediate(conn):
                _finish_hold(conn, hold_id, spent)

        await self._run(work)

    # --- usage and budgets --------------------------------------------------------------

    async def record_usage(self, record: UsageRecord) -> None:
        values = (encode_sqlite_time(record.at), *usage_values(record))

        def work(conn: sqlite3.Connection) -> None:
            conn.execute(_INSERT_USAGE, values)

        await self._run(work)

    async def settle_and_record(
        self, hold: Hold | None, amount: Decimal, record: UsageRecord
    ) -> None:
        """The settlement and the usage record in one transaction (one ledger call)."""
        values = (encode_sqlite_time(record.at), *usage_values(record))
        hold_id = None if hold is None else hold.hold_id
        spent = to_units(amount)

        def work(conn: sqlite3.Connection) -> None:
            if hold_id is not None:
                _finish_hold(conn, hold_id, spent)
            conn.execute(_INSERT_USAGE, values)

        turns = self._loop_turns()
        if turns is None:
            await self._grouped(work)
            return
        # A group leaves out a call whose caller gave up: a host's cancel landing while
        # the settlement waited for its group (the budget guard's shield holds off an
        # anyio scope's cancel, not a task's own) left the hold HELD. Shielded, the group
        # writes it whatever happens to the caller.
        future = turns.group.join(work)
        future.add_done_callback(_retrieved)
        await asyncio.shield(future)

    async def _load_budget(self, budget_id: str) -> BudgetConfig | None:
        def work(conn: sqlite3.Connection) -> BudgetConfig | None:
            row = conn.execute(
                "SELECT limit_units, window_kind, default_hold_units FROM fmw_budgets "
                "WHERE budget_id = ?",
                (budget_id,),
            ).fetchone()
            return None if row is None else budget_from_row(*row)

        return await self._run(work)

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

        await self._run(work)
        self._cache.put(budget_id, budget)

    async def stored_budgets(self) -> dict[str, BudgetConfig]:
        def work(conn: sqlite3.Connection) -> dict[str, BudgetConfig]:
            rows = conn.execute(
                "SELECT budget_id, limit_units, window_kind, default_hold_units "
                "FROM fmw_budgets ORDER BY budget_id"
            ).fetchall()
            return budgets_from_rows([(row[0], row[1], row[2], row[3]) for row in rows])

        return await self._run(work)

    async def recorded_budgets(self) -> dict[str, str]:
        def work(conn: sqlite3.Connection) -> list[tuple[str, str]]:
            return conn.execute(RECORDED_WINDOWS).fetchall()

        return {row[0]: window_kind(row[1]) for row in await self._run(work)}

    async def status(self, budget_id: str, budget: BudgetConfig) -> BudgetStatus:
        start = window_start(budget.window)

        def work(conn: sqlite3.Connection) -> tuple[int, int]:
            row = conn.execute(
                "SELECT spent_units, held_units FROM fmw_budget_windows "
                "WHERE budget_id = ? AND window_start = ?",
                (budget_id, start),
            ).fetchone()
            return (0, 0) if row is None else (int(row[0]), int(row[1]))

        spent, held = await self._run(work)
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
            rows = conn.execute(
                f"SELECT {USAGE_COLUMNS} FROM fmw_usage {clause}ORDER BY id DESC LIMIT ?",
                (*params, limit),
            ).fetchall()
            records = []
            for row in reversed(rows):
                try:
                    at = decode_sqlite_time(str(row[0]))
                except ValueError:
                    continue  # a time this version did not write: the record cannot be placed
                records.append(usage_from_row(at, row[1:]))
            return records

        return await self._run(work)

    async def rolling_peaks(self, *, since: datetime) -> list[RollingPeak]:
        def work(conn: sqlite3.Connection) -> list[RollingPeak]:
            rows = conn.execute(_ROLLING_PEAKS, (encode_sqlite_time(since),)).fetchall()
            return [rolling_peak_of(row) for row in rows]

        return await self._run(work)

    async def usage_per_minute(self, *, since: datetime) -> list[MinuteUsage]:
        def work(conn: sqlite3.Connection) -> list[MinuteUsage]:
            rows = conn.execute(_PER_MINUTE, (encode_sqlite_time(since),)).fetchall()
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

        return await self._run(work)

    async def aclose(self) -> None:
        # Grouped calls already made are written first (a group waiting for its turn of
        # the loop, then the groups in the worker thread), never into a reopened file.
        turns = self._turns
        if turns is not None and turns.loop is _running_loop():
            if turns.group.waiting:
                await asyncio.sleep(0)
            if self._writers:
                await asyncio.gather(*self._writers, return_exceptions=True)

        def close() -> None:
            with self._lock:
                for conn in (self._conn, self._fast):
                    if conn is not None:
                        conn.close()
                self._conn = self._fast = None

        await anyio.to_thread.run_sync(close)


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
_ROLLING_PEAKS = rolling_peaks_sql("CAST(strftime('%s', substr(at, 1, 19)) AS INTEGER)", "?")
_PER_MINUTE = (
    "SELECT route, substr(at, 1, 16), COUNT(*), "
    "SUM(COALESCE(input_tokens, 0) + COALESCE(output_tokens, 0)), "
    "SUM(CASE WHEN input_tokens IS NULL AND output_tokens IS NULL THEN 0 ELSE 1 END) "
    f"FROM fmw_usage WHERE at >= ? AND {PER_MINUTE_FILTER} GROUP BY route, substr(at, 1, 16)"
)


class _immediate:
    """`BEGIN IMMEDIATE` ... `COMMIT`, rolled back on any error."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def __enter__(self) -> None:
        self.conn.execute("BEGIN IMMEDIATE")

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        if kind is None:
            self.conn.execute("COMMIT")
        else:
            self.conn.execute("ROLLBACK")


def _retrieved(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()  # seen: never "Future exception was never retrieved"


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _transaction(work: Callable[[sqlite3.Connection], T]) -> Callable[[sqlite3.Connection], T]:
    def transaction(conn: sqlite3.Connection) -> T:
        with _immediate(conn):
            return work(conn)

    return transaction


_Work = Callable[[sqlite3.Connection], Any]  # a grouped call's statements


class _Turns:
    """One event loop's turn-taking on the ledger: the lock its calls take turns on, and
    the grouped calls waiting for the next commit (handed to `commit`)."""

    __slots__ = ("group", "lock", "loop")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        commit: Callable[[_Turns, list[Pending[_Work]]], None],
    ) -> None:
        self.loop = loop
        self.lock = asyncio.Lock()
        self.group: Group[_Work] = Group(loop, lambda calls: commit(self, calls))


def _group_work(calls: Sequence[Pending[_Work]]) -> Callable[[sqlite3.Connection], list[object]]:
    """One transaction for the group's calls, in order; a call whose caller was cancelled
    before its group was written is left out (its result `None`, never read). When a
    call's statements fail (anything but an `OperationalError`: the database locked or
    unwritable, which fails the group whole with nothing committed), the group is written
    again, in one transaction still, each call in a savepoint: the failing call's changes
    are undone and its exception is its result; the others commit."""

    def work(conn: sqlite3.Connection) -> list[object]:
        live = [call for call in calls if not call.future.cancelled()]
        try:
            with _immediate(conn):
                done = {id(call): call.item(conn) for call in live}
        except sqlite3.OperationalError:
            raise
        except Exception:
            if len(live) == 1:
                raise
            done = {}
            with _immediate(conn):
                for call in live:
                    conn.execute("SAVEPOINT fmw_call")
                    try:
                        done[id(call)] = call.item(conn)
                    except sqlite3.OperationalError:
                        raise
                    except Exception as exc:
                        conn.execute("ROLLBACK TO fmw_call")
                        done[id(call)] = Failed(exc)
                    conn.execute("RELEASE fmw_call")
        return [done.get(id(call)) for call in calls]

    return work


def _finish_hold(conn: sqlite3.Connection, hold_id: str, spent: int) -> None:
    spent = min(max(spent, 0), MAX_UNITS)
    row = conn.execute(
        "DELETE FROM fmw_budget_holds WHERE hold_id = ? "
        "RETURNING budget_id, window_start, amount_units",
        (hold_id,),
    ).fetchone()
    if row is None:
        _settle_reaped(conn, hold_id, spent)
        return
    # Spend saturates at SPENT_CAP_UNITS: never an integer overflow that loses the row.
    conn.execute(
        "UPDATE fmw_budget_windows SET held_units = held_units - ?, "
        "spent_units = spent_units + min(?, ? - spent_units) "
        "WHERE budget_id = ? AND window_start = ?",
        (row[2], spent, SPENT_CAP_UNITS, row[0], row[1]),
    )


def _settle_reaped(conn: sqlite3.Connection, hold_id: str, spent: int) -> None:
    """A hold no longer held: already settled or released (nothing to do, exactly once),
    or settled at its amount by the reaper while its request still ran (a stream read for
    over an hour): what the request cost replaces what the reaper charged, once."""
    row = conn.execute(
        "DELETE FROM fmw_budget_reaped WHERE hold_id = ? "
        "RETURNING budget_id, window_start, amount_units",
        (hold_id,),
    ).fetchone()
    if row is not None:
        conn.execute(
            "UPDATE fmw_budget_windows SET spent_units = max(0, min(spent_units + ? - ?, ?)) "
            "WHERE budget_id = ? AND window_start = ?",
            (spent, row[2], SPENT_CAP_UNITS, row[0], row[1]),
        )


def _migrate(conn: sqlite3.Connection) -> None:
    with _immediate(conn):
        conn.execute(SCHEMA_TABLE)
        row = conn.execute(
            "SELECT version FROM fmw_schema WHERE component = ?", (COMPONENT,)
        ).fetchone()
        current = 0 if row is None else int(row[0])
        for statement in pending_migrations(current, "sqlite"):
            conn.execute(statement)
        if current != LATEST_VERSION:
            conn.execute(
                "INSERT INTO fmw_schema (component, version) VALUES (?, ?) "
                "ON CONFLICT (component) DO UPDATE SET version = excluded.version",
                (COMPONENT, LATEST_VERSION),
            )


def _settle_stale_holds(conn: sqlite3.Connection, older_than: float) -> None:
    """Holds left by a process that died mid-request are settled at their amount (the
    conservative choice: the upstream may have served and billed), and kept a while in
    fmw_budget_reaped: one whose request still runs (a stream read for over an hour)
    settles what it cost when it ends. In the caller's transaction."""
    now = datetime.now(UTC)
    cutoff = encode_sqlite_time(now - timedelta(seconds=older_than))
    rows = conn.execute(
        "SELECT hold_id, budget_id, window_start, amount_units FROM fmw_budget_holds "
        "WHERE created_at < ?",
        (cutoff,),
    ).fetchall()
    for hold_id, budget_id, start, amount in rows:
        _finish_hold(conn, hold_id, int(amount))
        # Kept: a request still running settles what it cost when it ends (_settle_reaped).
        conn.execute(
            "INSERT OR IGNORE INTO fmw_budget_reaped "
            "(hold_id, budget_id, window_start, amount_units, reaped_at) VALUES (?, ?, ?, ?, ?)",
            (hold_id, budget_id, start, amount, encode_sqlite_time(now)),
        )
    forgotten = encode_sqlite_time(now - timedelta(seconds=REAPED_KEPT_SECONDS))
    conn.execute("DELETE FROM fmw_budget_reaped WHERE reaped_at < ?", (forgotten,))
