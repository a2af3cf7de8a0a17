"""The PostgreSQL ledger: many gateway processes share one ledger.

What each call says is store/ledgers/postgres_sql.py's: a hold is one statement, so no
interleaving of processes can hold past the limit. This module sends the calls: the pool,
the outage (calls fail closed at once while the database is known to be away), and the
backlog of usage records an outage kept from the database."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, TypeVar

from fallback_mw.extras import missing_extra
from fallback_mw.loops import CloseAtLoopEnd, close_on_its_loop

try:
    import asyncpg
except ImportError:
    raise missing_extra("postgres", 'store = "postgresql://..."') from None
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
    room_needed,
    window_kind,
)
from fallback_mw.config import BudgetConfig
from fallback_mw.store.ledgers.postgres_sql import (
    FINISH,
    FINISH_REAPED,
    HOLD,
    HOLD_THERE,
    INSERT_KEPT,
    INSERT_USAGE,
    REAP,
    ROLLING_PEAKS,
    ROW_IDS,
    SETTLE_AND_RECORD,
    SETTLE_AND_RECORD_KEPT,
    STATUS,
    migrate,
)
from fallback_mw.store.ledgers.schema import (
    REAP_INTERVAL,
    RECORDED_WINDOWS,
    STALE_HOLD_SECONDS,
    USAGE_COLUMNS,
    BudgetCache,
    SchemaTooNew,
    SQLLedgerBase,
    budget_from_row,
    budgets_from_rows,
    usage_from_row,
    usage_values,
)
from fallback_mw.store.outage import OutageLog
from fallback_mw.store_url import StoreURLError, driver_reason, redact_url, unusable_store

T = TypeVar("T")


logger = logging.getLogger("fallback_mw.budget")


# InternalClientError: a pooled connection the server dropped mid-operation ("cannot switch
# to state ...; another operation is in progress"), seen when PostgreSQL stops under load.
_FAILURES = (
    OSError,
    asyncio.TimeoutError,
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.exceptions.InternalClientError,
)


# What says the database is away (not that it refused one statement).
_UNREACHABLE = (
    OSError,
    asyncio.TimeoutError,
    asyncpg.InterfaceError,
    asyncpg.exceptions.InternalClientError,
    asyncpg.exceptions.PostgresConnectionError,
    asyncpg.exceptions.OperatorInterventionError,
    asyncpg.exceptions.TooManyConnectionsError,
    asyncpg.exceptions.ObjectNotInPrerequisiteStateError,  # "not accepting connections"
)


# A connection refused: by the host (nothing listens), or by the server itself while it
# starts up or shuts down (CannotConnectNowError), has no slot left, or takes no
# connections to this database. Nothing was sent: writing it later cannot write it twice.
_CONNECTION_REFUSED = (
    ConnectionRefusedError,
    asyncpg.exceptions.CannotConnectNowError,
    asyncpg.exceptions.TooManyConnectionsError,
    asyncpg.exceptions.ObjectNotInPrerequisiteStateError,
)


class LedgerOptionError(LedgerUnavailable, StoreURLError):
    """The store URL has an option the driver refuses (`sslmode=requir`): the guard fails
    closed as for any unavailable ledger; the command line refuses the URL (exit 2) with
    the route store's words (store/postgres.py `StoreOptionError`)."""


# While the database is known to be away, calls fail at once (fail closed) instead of each
# waiting out the timeout behind the others; one call per interval tries it again.
RETRY_INTERVAL = 1.0


# Usage records (with their settlements) that an outage kept from the database without
# sending them are kept in memory, up to this many, and written once it answers again.
BACKLOG_LIMIT = 10_000


_DRAIN_BATCH = 500


# (hold id or None, spent units, usage values, sent, row id): one settlement and usage
# record to write; (hold id, 0, None, True, None): the release of a hold whose statement's
# answer was lost. `sent`: a settlement that may have been written already (its answer was
# lost): written again only while its hold is still there, which the first write would
# have deleted. `row id`: the usage row's id, given (from the table's sequence) before its
# batch is first sent, so a batch sent again writes no record twice (None until then).
_Pending = tuple[str | None, int, tuple[object, ...] | None, bool, int | None]


class _NotSent(LedgerUnavailable):
    """Refused before anything reached the database (the outage's fast refusal, a refused
    connection): writing it later cannot write it twice."""


class _AnswerLost(LedgerUnavailable):
    """The database went away (or did not answer in time) while the call was under way:
    it may have been done, its answer lost."""


class PostgresLedger(SQLLedgerBase):
    def __init__(
        self,
        dsn: str,
        *,
        # No connection floor: idle connections are still reused, but asyncpg's floor
        # maintenance would log a traceback per retry while the database is away.
        min_size: int = 0,
        max_size: int = 10,
        timeout: float = 5.0,
        stale_hold_seconds: float = STALE_HOLD_SECONDS,
        retry_interval: float = RETRY_INTERVAL,
        reap_interval: float = REAP_INTERVAL,
    ) -> None:
        self.dsn = dsn
        self._shown = redact_url(dsn)  # the store, as messages name it: no password
        self.retry_interval = retry_interval
        self._retry_at = 0.0
        self.min_size = min_size
        self.max_size = max_size
        self.timeout = timeout
        self.call_timeout = timeout  # the guard bounds a request's ledger wait by it
        self.stale_hold_seconds = stale_hold_seconds
        self.reap_interval = reap_interval
        self._pool: asyncpg.Pool | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the one the pool runs on
        # Closes the pool as its loop ends (TestClient without `with`: a loop per request).
        self._at_loop_end: CloseAtLoopEnd | None = None
        self._opening = asyncio.Lock()
        self._cache = BudgetCache()
        self._outage = OutageLog(logger, "PostgreSQL ledger")  # one WARNING each way
        self._backlog: deque[_Pending] = deque()
        self._backlog_full = False  # said once per outage
        self._draining: asyncio.Task[None] | None = None  # one drain at a time
        # While something is kept, one drain per retry_interval even if no call comes.
        self._waking: asyncio.TimerHandle | None = None
        self._waking_loop: asyncio.AbstractEventLoop | None = None
        self._outliving_calls: set[asyncio.Task[Any]] = set()  # holds and settlements

    # --- connection and schema --------------------------------------------------------

    async def _get_pool(self) -> asyncpg.Pool:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            # Called from another event loop than the pool's (Starlette's TestClient runs
            # each request on a new one when used without `with`, the last one closed):
            # its connections cannot be used from this one. A new pool (and lock) here.
            self._abandon_pool()
            self._loop, self._opening = loop, asyncio.Lock()
        if self._pool is not None:
            return self._pool
        async with self._opening:
            if self._pool is None:
                pool = await _ReleasingPool(
                    self.dsn,
                    min_size=self.min_size,
                    max_size=self.max_size,
                    timeout=self.timeout,
                    command_timeout=self.timeout,
                    # asyncpg.create_pool's defaults (it builds its Pool with these).
                    max_queries=50000,
                    max_inactive_connection_lifetime=300.0,
                    loop=None,
                    connection_class=asyncpg.Connection,
                    record_class=asyncpg.Record,
                    connect=_connect_to_the_end,
                )
                try:
                    async with pool.acquire() as conn:
                        await migrate(conn)
                        await self._reap(conn)
                except BaseException:
                    await pool.close()
                    raise
                self._pool = pool
                self._closes_with(CloseAtLoopEnd(pool.close))
                self._reap_at = time.monotonic() + self.reap_interval
            return self._pool

    async def _reap(self, conn: asyncpg.Pool | asyncpg.pool.PoolConnectionProxy) -> None:
        """Settle the holds older than `stale_hold_seconds` at their amount: left by a
        process that died mid-request, or by a settlement the ledger missed."""
        # The database's clock on both sides (a hold's created_at is its now()): a gateway
        # host whose clock ran an hour ahead settled other processes' live holds.
        await conn.execute(REAP, float(self.stale_hold_seconds), SPENT_CAP_UNITS)

    def _abandon_pool(self) -> None:
        """Close the pool of the previous event loop on that loop while it runs; once it
        is closed, nothing can close its connections (the garbage collector drops them)."""
        pool, loop, self._pool = self._pool, self._loop, None
        self._closes_with(None)
        if pool is not None:
            close_on_its_loop(loop, pool.close)

    def _closes_with(self, at_loop_end: CloseAtLoopEnd | None) -> None:
        if self._at_loop_end is not None:
            self._at_loop_end.forget()  # that pool is closed another way
        self._at_loop_end = at_loop_end

    async def _run(self, work: Callable[[asyncpg.Pool], Awaitable[T]]) -> T:
        """One unit of work, `timeout` at most in all: the wait for a pooled connection
        included, so a hung database refuses every caller within `timeout`, not each after
        the ones queued before it. During an outage, calls fail at once (fail closed) but
        one per `retry_interval`, which tries the database again."""
        if self._outage.down:
            now = time.monotonic()
            if now < self._retry_at:
                raise _NotSent("PostgreSQL ledger unavailable (outage)")
            self._retry_at = now + self.retry_interval
        try:
            async with asyncio.timeout(self.timeout):
                pool = await self._get_pool()
                result = await work(pool)
        except asyncpg.ClientConfigurationError as exc:
            # Read from the URL only when connecting; no retry can change the answer.
            self._retry_at = time.monotonic() + self.retry_interval
            self._outage.failed(type(exc).__name__, "budgeted routes refuse (fail closed)")
            raise LedgerOptionError(unusable_store(self.dsn, exc)) from None
        except (*_FAILURES, SchemaTooNew) as exc:
            # The exception type only: a driver message may quote the DSN.
            if isinstance(exc, _UNREACHABLE):
                self._retry_at = time.monotonic() + self.retry_interval
            else:
                self._retry_at = 0.0  # the database answered: the next call tries at once
            self._outage.failed(type(exc).__name__, "budgeted routes refuse (fail closed)")
            unavailable: type[LedgerUnavailable] = LedgerUnavailable
            if isinstance(exc, _CONNECTION_REFUSED):
                unavailable = _NotSent
            elif isinstance(exc, _UNREACHABLE):
                unavailable = _AnswerLost
            # The driver's reason as `driver_reason` vets it (its type's name when the URL's
            # password could be in it): a class name alone ("InvalidCatalogNameError") left
            # `budgets show` and `usage` unclear where the route verbs named the database.
            kind, reason = type(exc).__name__, driver_reason(exc, self.dsn)
            said = kind if reason == kind else f"{kind}: {' '.join(reason.split())}"
            raise unavailable(f"PostgreSQL ledger {self._shown} unavailable ({said})") from None
        self._outage.recovered()
        if self._backlog and self._draining is None:
            self._start_drain()
        return result

    # --- holds --------------------------------------------------------------------------

    async def hold(self, budget_id: str, budget: BudgetConfig, amount: Decimal) -> Hold | None:
        units = to_units(amount)
        limit = to_units(budget.limit)
        needed = room_needed(units)
        if needed > limit:
            return None  # the insert branch of the upsert does not check the limit
        hold_id = uuid.uuid4().hex

        async def work(pool: asyncpg.Pool) -> object:
            if self._reap_due():  # a running ledger settles stale holds too
                await self._reap(pool)
            return await pool.fetchval(
                HOLD, budget_id, budget.window, units, limit, hold_id, needed
            )

        statement = self._outliving(self._run(work))
        try:
            taken = await asyncio.shield(statement)
        except _AnswerLost:
            # The statement may have reached the database and taken the hold, its answer
            # lost (a terminated connection, a restart, a timeout): the caller is refused
            # and nothing is served, so the hold, if taken, is released once the database
            # answers again (a release of a hold never taken changes nothing).
            self._keep((hold_id, 0, None, True, None))
            raise
        except asyncio.CancelledError:
            # The caller gave up while the statement ran: the database may still take the
            # hold, which nobody would settle (HELD for an hour, then charged). Once the
            # statement is done, a hold it took is released.
            statement.add_done_callback(lambda done: self._release_if_taken(done, hold_id))
            raise
        if taken is None:
            return None
        return Hold(hold_id, budget_id, from_units(units), str(taken))

    def _outliving(self, call: Awaitable[T]) -> asyncio.Task[T]:
        """`call` in a task of its own that a cancelled caller does not cancel (awaited
        through `asyncio.shield`); `aclose` waits for it."""
        task: asyncio.Task[T] = asyncio.ensure_future(call)
        self._outliving_calls.add(task)
        task.add_done_callback(self._outliving_calls.discard)
        task.add_done_callback(_retrieved)
        return task

    def _release_if_taken(self, statement: asyncio.Task[object], hold_id: str) -> None:
        if statement.cancelled():
            return
        error = statement.exception()
        if isinstance(error, _AnswerLost):
            self._keep((hold_id, 0, None, True, None))  # its answer may have been lost
        elif error is None and statement.result() is not None:
            self._outliving(self._release(hold_id))

    async def _release(self, hold_id: str) -> None:
        """Release a hold nobody will settle; one the database did not answer for is kept
        and released when it answers again."""
        try:
            await self._finish(hold_id, 0)
        except (_NotSent, _AnswerLost):
            self._keep((hold_id, 0, None, True, None))

    async def _finish(self, hold_id: str, spent: int) -> None:
        async def work(pool: asyncpg.Pool) -> None:
            spend = min(max(spent, 0), MAX_UNITS)
            ended = await pool.fetchval(FINISH, hold_id, spend, SPENT_CAP_UNITS)
            if not ended:  # no hold, none reaped as it saw them: see FINISH_REAPED
                await pool.execute(FINISH_REAPED, hold_id, spend, SPENT_CAP_UNITS)

        await self._run(work)

    async def _finish_reaped(self, hold_id: str, spent: int) -> None:
        """After a settlement that ended no hold: settled before (nothing to do), or reaped
        while its statement waited for the reaper's lock (FINISH_REAPED). A second round
        trip only then, never for a hold that was there. Unanswered, it is kept as a plain
        settlement (its usage record is written already, never twice)."""

        async def work(pool: asyncpg.Pool) -> None:
            await pool.execute(FINISH_REAPED, hold_id, spent, SPENT_CAP_UNITS)

        try:
            await self._run(work)
        except (_NotSent, _AnswerLost) as exc:
            if not self._keep((hold_id, spent, None, isinstance(exc, _AnswerLost), None)):
                raise

    # --- usage and budgets --------------------------------------------------------------

    async def record_usage(self, record: UsageRecord) -> None:
        await self._write(None, 0, (record.at, *usage_values(record)))

    async def settle_and_record(
        self, hold: Hold | None, amount: Decimal, record: UsageRecord
    ) -> None:
        """The settlement and the usage record in one statement (one round trip, one
        transaction)."""
        values = (record.at, *usage_values(record))
        if hold is None:
            await self._write(None, 0, values)
            return
        await self._write(hold.hold_id, min(max(to_units(amount), 0), MAX_UNITS), values)

    async def _write(self, hold_id: str | None, spent: int, values: tuple[object, ...]) -> None:
        """One usage record, with its hold's settlement when there is one. Refused by an
        outage before it was sent: kept (BACKLOG_LIMIT at most) and written when the
        database answers again, so an outage loses neither the record nor the settlement
        (the hold would otherwise be charged at its full amount once stale)."""

        async def work(pool: asyncpg.Pool) -> object:
            if hold_id is None:
                return await pool.execute(INSERT_USAGE, *values)
            return await pool.fetchval(SETTLE_AND_RECORD, *values, hold_id, spent, SPENT_CAP_UNITS)

        try:
            if hold_id is None:
                await self._run(work)
            else:
                # Not cancelled with its caller: a host's cancel landing while the
                # statement ran (the budget guard's shield holds off an anyio scope's
                # cancel, not a task's own) left the hold HELD.
                ended = await asyncio.shield(self._outliving(self._run(work)))
                if not ended:
                    # The record is written: what is left, if anything, is the settlement
                    # against a reaped row (kept as a plain settlement if unanswered).
                    await asyncio.shield(self._outliving(self._finish_reaped(hold_id, spent)))
        except _NotSent:
            if not self._keep((hold_id, spent, values, False, None)):
                raise
        except _AnswerLost:
            # A settlement on the wire when the database went away: written or not, it is
            # kept, and written again once only if its hold is still there (so neither lost
            # nor written twice). A plain record cannot be told apart: not sent again.
            if hold_id is None or not self._keep((hold_id, spent, values, True, None)):
                raise

    def _keep(self, pending: _Pending) -> bool:
        """Keep `pending` for when the database answers again (False: the backlog is full)."""
        if len(self._backlog) >= BACKLOG_LIMIT:
            if not self._backlog_full:
                self._backlog_full = True
                logger.warning(
                    "PostgreSQL ledger: %d usage records wait for the database; "
                    "later ones are dropped until it answers",
                    len(self._backlog),
                )
            return False
        self._backlog.append(pending)
        self._wake_later()
        return True

    def _start_drain(self) -> asyncio.Task[None]:
        """The drain under way, or a new one: never two at a time (each would take batches
        off the backlog, and write them out of order)."""
        if self._draining is None:
            self._draining = asyncio.create_task(self._drain())
            self._draining.add_done_callback(_retrieved)
        return self._draining

    def _wake_later(self) -> None:
        """A drain in retry_interval, whether or not a call comes: a process whose traffic
        stopped with the outage writes what it kept once the database is back, not at its
        next call. Only while something is kept (`_drain` sets the next one)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if self._waking is not None and self._waking_loop is loop:
            return
        if self._waking is not None:
            self._waking.cancel()  # another loop's (it may never run again)
        self._waking_loop = loop
        self._waking = loop.call_later(self.retry_interval, self._wake)

    def _wake(self) -> None:
        self._waking = None
        if self._backlog:
            self._start_drain()

    @property
    def waiting(self) -> int:
        """Usage records kept through an outage, not yet written."""
        return len(self._backlog)

    async def _drain(self) -> None:
        """Write the kept records in batches, each one transaction; stops (keeping the
        rest) when the database is away again: the next call that reaches it, or the next
        try a retry_interval later (`_wake_later`), resumes."""
        written = 0
        try:
            while self._backlog:
                count = min(_DRAIN_BATCH, len(self._backlog))
                batch = [self._backlog.popleft() for _ in range(count)]
                try:
                    refused = await self._run(_batch_work(batch))
                except LedgerUnavailable:
                    self._backlog.extendleft(reversed(batch))
                    return
                if refused is not None:  # the database answered, and refused these rows
                    logger.warning(
                        "PostgreSQL ledger: %d usage records kept through the outage were "
                        "refused (%s) and dropped",
                        len(batch),
                        refused,
                    )
                    continue
                written += sum(values is not None for _, _, values, _, _ in batch)
            self._backlog_full = False
        finally:
            self._draining = None
            if self._backlog:  # the database is away again (or was not back yet)
                self._wake_later()
            if written:
                logger.info(
                    "PostgreSQL ledger: wrote %d usage records kept through the outage", written
                )

    async def _load_budget(self, budget_id: str) -> BudgetConfig | None:
        async def work(pool: asyncpg.Pool) -> BudgetConfig | None:
            row = await pool.fetchrow(
                "SELECT limit_units, window_kind, default_hold_units FROM fmw_budgets "
                "WHERE budget_id = $1",
                budget_id,
            )
            return None if row is None else budget_from_row(*row)

        return await self._run(work)

    async def set_budget(self, budget_id: str, budget: BudgetConfig) -> None:
        async def work(pool: asyncpg.Pool) -> None:
            await pool.execute(
                "INSERT INTO fmw_budgets "
                "(budget_id, limit_units, window_kind, default_hold_units, updated_at) "
                "VALUES ($1, $2, $3, $4, now()) ON CONFLICT (budget_id) DO UPDATE SET "
                "limit_units = EXCLUDED.limit_units, window_kind = EXCLUDED.window_kind, "
                "default_hold_units = EXCLUDED.default_hold_units, updated_at = now()",
                budget_id,
                to_units(budget.limit),
                budget.window,
                to_units(budget.default_hold),
            )

        await self._run(work)
        self._cache.put(budget_id, budget)

    async def stored_budgets(self) -> dict[str, BudgetConfig]:
        async def work(pool: asyncpg.Pool) -> dict[str, BudgetConfig]:
            rows = await pool.fetch(
                "SELECT budget_id, limit_units, window_kind, default_hold_units "
                "FROM fmw_budgets ORDER BY budget_id"
            )
            return budgets_from_rows([(row[0], row[1], row[2], row[3]) for row in rows])

        return await self._run(work)

    async def recorded_budgets(self) -> dict[str, str]:
        async def work(pool: asyncpg.Pool) -> list[Any]:
            return list(await pool.fetch(RECORDED_WINDOWS))

        return {row[0]: window_kind(row[1]) for row in await self._run(work)}

    async def status(self, budget_id: str, budget: BudgetConfig) -> BudgetStatus:
        async def work(pool: asyncpg.Pool) -> tuple[str, int, int]:
            row = await pool.fetchrow(STATUS, budget_id, budget.window)
            assert row is not None  # the period row is always there
            return str(row[0]), int(row[1] or 0), int(row[2] or 0)

        start, spent, held = await self._run(work)
        return BudgetStatus.of(budget_id, budget, start, spent, held)

    async def usage(
        self,
        *,
        since: datetime | None = None,
        route: str | None = None,
        tenant: str | None = None,
        limit: int = 1000,
    ) -> list[UsageRecord]:
        where: list[str] = []
        params: list[object] = []
        for column, value in (("at >=", since), ("route =", route), ("tenant =", tenant)):
            if value is not None:
                params.append(value)
                where.append(f"{column} ${len(params)}")
        params.append(limit)
        clause = f"WHERE {' AND '.join(where)} " if where else ""

        async def work(pool: asyncpg.Pool) -> list[UsageRecord]:
            rows = await pool.fetch(
                f"SELECT {USAGE_COLUMNS} FROM fmw_usage {clause}"
                f"ORDER BY id DESC LIMIT ${len(params)}",
                *params,
            )
            return [usage_from_row(r[0], list(r.values())[1:]) for r in reversed(rows)]

        return await self._run(work)

    async def rolling_peaks(self, *, since: datetime) -> list[RollingPeak]:
        async def work(pool: asyncpg.Pool) -> list[RollingPeak]:
            return [rolling_peak_of(row) for row in await pool.fetch(ROLLING_PEAKS, since)]

        return await self._run(work)

    async def usage_per_minute(self, *, since: datetime) -> list[MinuteUsage]:
        async def work(pool: asyncpg.Pool) -> list[MinuteUsage]:
            rows = await pool.fetch(
                "SELECT route, date_trunc('minute', at AT TIME ZONE 'UTC') AS minute, "
                "COUNT(*), SUM(COALESCE(input_tokens, 0) + COALESCE(output_tokens, 0)), "
                "SUM(CASE WHEN input_tokens IS NULL AND output_tokens IS NULL THEN 0 "
                "ELSE 1 END) FROM fmw_usage WHERE at >= $1 AND "
                f"{PER_MINUTE_FILTER} GROUP BY route, minute",
                since,
            )
            return [
                MinuteUsage(
                    str(r[0]), r[1].replace(tzinfo=UTC), int(r[2]), int(r[3] or 0), int(r[4] or 0)
                )
                for r in rows
            ]

        return await self._run(work)

    async def aclose(self) -> None:
        if self._outliving_calls:  # settlements and releases a cancelled caller left
            await asyncio.gather(*self._outliving_calls, return_exceptions=True)
            if self._outliving_calls:  # a release started by a hold that just ended
                await asyncio.gather(*self._outliving_calls, return_exceptions=True)
        if self._loop is not asyncio.get_running_loop():
            self._abandon_pool()  # a pool of another loop is closed on that loop
        if self._draining is not None:
            await asyncio.shield(self._draining)
        if self._backlog:
            self._retry_at = 0.0  # one last try, whatever the outage's pace
            await asyncio.shield(self._start_drain())
        if self._waking is not None:  # no try after the close
            self._waking.cancel()
            self._waking = None
        if self._backlog:
            logger.warning(
                "PostgreSQL ledger: %d usage records kept through the outage are lost "
                "(unreachable at close); their holds are charged in full once stale",
                len(self._backlog),
            )
            self._backlog.clear()
        pool, self._pool = self._pool, None
        self._closes_with(None)
        if pool is not None:
            await pool.close()


class _ReleasingPool(asyncpg.Pool):
    """asyncpg's pool, whose release of a connection reads its own error. asyncpg runs the
    release (the connection's reset) in a shielded task: when `_run`'s timeout (or a
    caller's cancellation) ended the wait for it and the reset then failed on a database
    that hangs, nobody read that error and asyncio logged `ERROR Task exception was never
    retrieved` with a driver traceback, once per pooled connection a pause caught. The
    connection is still terminated and the holder given back, as asyncpg does."""

    async def release(
        self,
        connection: asyncpg.pool.PoolConnectionProxy[Any],
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (asyncpg's signature)
    ) -> None:
        release = asyncio.ensure_future(super().release(connection, timeout=timeout))
        release.add_done_callback(_read_release_error)
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            # Released while `_run`'s timeout (or a cancellation) unwinds the call: the reset
            # of a connection whose query did not answer waits out the command timeout
            # again, and the refusal waited with it (10 s for the 5 the docs promise). It
            # goes on here; its holder returns to the pool when it is done.
            return
        await asyncio.shield(release)


async def _connect_to_the_end(*args: Any, **kwargs: Any) -> asyncpg.Connection[Any]:
    """`asyncpg.connect`, run to its end when its caller is cancelled (a client gone, a
    read's deadline, a stop's graceful timeout). Cancelled between the socket's connect and
    its TLS probe (`sslmode=prefer`, the default), asyncpg left a future holding
    `ConnectionError('unexpected connection_lost() call')` that nobody read, and asyncio
    logged "Future exception was never retrieved" in the host's log: an error for nothing
    that went wrong. The connect goes on (its own timeout bounds it); a connection that
    arrives for nobody is closed."""
    connecting = asyncio.ensure_future(asyncpg.connect(*args, **kwargs))
    try:
        return await asyncio.shield(connecting)
    except asyncio.CancelledError as cancelled:
        connecting.add_done_callback(_close_unwanted)
        raise cancelled


def _close_unwanted(connecting: asyncio.Future[asyncpg.Connection[Any]]) -> None:
    if connecting.cancelled():
        return
    if connecting.exception() is None:
        connecting.result().terminate()
    else:
        logger.debug("a connect whose caller was gone failed")


def _read_release_error(release: asyncio.Future[None]) -> None:
    if not release.cancelled() and release.exception() is not None:
        logger.debug("a pooled connection's reset failed: it is closed")


def _batch_work(batch: list[_Pending]) -> Callable[[asyncpg.Pool], Awaitable[str | None]]:
    """One transaction writing `batch` in its order: runs of plain records and of
    settlements, each run one executemany; a settlement that may have been written already
    (and a release) only while its hold is still there. Each record's row id is taken
    first (into `batch`, which is kept whole when its answer is lost): sent again, a
    record its first sending committed is not written twice."""

    async def work(pool: asyncpg.Pool) -> str | None:
        try:
            async with pool.acquire() as conn:
                await _give_row_ids(conn, batch)
                async with conn.transaction():
                    for statement, rows, needs in _runs(batch):
                        if needs is not None and await conn.fetchval(HOLD_THERE, needs) is None:
                            continue  # written before its answer was lost
                        await conn.executemany(statement, rows)
        except asyncpg.PostgresError as exc:
            if isinstance(exc, _UNREACHABLE):
                raise
            return type(exc).__name__
        return None

    return work


async def _give_row_ids(conn: asyncpg.pool.PoolConnectionProxy, batch: list[_Pending]) -> None:
    """Row ids from the usage table's sequence for the batch's records that have none yet
    (a sequence never hands out a number twice, committed or not)."""
    needing = [
        i
        for i, (_, _, values, _, row_id) in enumerate(batch)
        if values is not None and row_id is None
    ]
    if needing:
        ids = sorted(row[0] for row in await conn.fetch(ROW_IDS, len(needing)))
        for i, row_id in zip(needing, ids, strict=True):
            batch[i] = (*batch[i][:4], row_id)


def _runs(batch: list[_Pending]) -> list[tuple[str, list[tuple[object, ...]], str | None]]:
    """(statement, rows, the hold a row that may have been written needs: None for a run)"""
    runs: list[tuple[str, list[tuple[object, ...]], str | None]] = []
    for hold_id, spent, values, sent, row_id in batch:
        row: tuple[object, ...]
        if values is None:  # a release
            statement, row = FINISH, (hold_id, 0, SPENT_CAP_UNITS)
        elif hold_id is None:
            statement, row = INSERT_KEPT, (*values, row_id)
        else:
            statement = SETTLE_AND_RECORD_KEPT
            row = (*values, hold_id, spent, SPENT_CAP_UNITS, row_id)
        if sent and values is not None:
            runs.append((statement, [row], hold_id))
        elif runs and runs[-1][0] is statement and runs[-1][2] is None:
            runs[-1][1].append(row)
        else:
            runs.append((statement, [row], None))
    return runs


def _retrieved(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # seen: never "Task exception was never retrieved"
