"""The PostgreSQL ledger: many gateway processes share one ledger.

What each call says is store/ledgers/postgres_sql.py's: a hold is one statement, so no
interleaving of processes can hold past the limit. This module sends the calls: the pool,
the outage (calls fail closed at once while the database is known to be away), the holds
and settlements. The backlog an outage kept is postgres_backlog.py's, the readers' answers
postgres_reads.py's, which driver errors mean the database is away postgres_pool.py's."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
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
    Hold,
    LedgerUnavailable,
    UsageRecord,
    room_needed,
)
from fallback_mw.config import BudgetConfig
from fallback_mw.store.ledgers.postgres_backlog import Backlog, retrieved
from fallback_mw.store.ledgers.postgres_pool import (
    CONNECTION_REFUSED,
    FAILURES,
    UNREACHABLE,
    ReleasingPool,
)
from fallback_mw.store.ledgers.postgres_reads import PostgresReads
from fallback_mw.store.ledgers.postgres_sql import (
    FINISH,
    FINISH_REAPED,
    HOLD,
    INSERT_USAGE,
    REAP,
    SETTLE_AND_RECORD,
    migrate,
)
from fallback_mw.store.ledgers.schema import (
    REAP_INTERVAL,
    STALE_HOLD_SECONDS,
    BudgetCache,
    SchemaTooNew,
    usage_values,
)
from fallback_mw.store.outage import OutageLog
from fallback_mw.store.postgres_connect import Connects
from fallback_mw.store_url import StoreURLError, driver_reason, redact_url, unusable_store

T = TypeVar("T")


logger = logging.getLogger("fallback_mw.budget")


class LedgerOptionError(LedgerUnavailable, StoreURLError):
    """The store URL has an option the driver refuses (`sslmode=requir`): the guard fails
    closed as for any unavailable ledger; the command line refuses the URL (exit 2) with
    the route store's words (store/postgres.py `StoreOptionError`)."""


# While the database is known to be away, calls fail at once (fail closed) instead of each
# waiting out the timeout behind the others; one call per interval tries it again.
RETRY_INTERVAL = 1.0


class _NotSent(LedgerUnavailable):
    """Refused before anything reached the database (the outage's fast refusal, a refused
    connection): writing it later cannot write it twice."""


class _AnswerLost(LedgerUnavailable):
    """The database went away (or did not answer in time) while the call was under way:
    it may have been done, its answer lost."""


class PostgresLedger(PostgresReads):
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
        self._backlog = Backlog(self._run, retry_interval)  # what an outage kept
        self._outliving_calls: set[asyncio.Task[Any]] = set()  # holds and settlements
        self._connects = Connects()  # the pool's: `aclose` waits for those left running

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
                pool = await ReleasingPool(
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
                    connect=self._connects.connect,
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
        except (*FAILURES, SchemaTooNew) as exc:
            # The exception type only: a driver message may quote the DSN.
            if isinstance(exc, UNREACHABLE):
                self._retry_at = time.monotonic() + self.retry_interval
            else:
                self._retry_at = 0.0  # the database answered: the next call tries at once
            self._outage.failed(type(exc).__name__, "budgeted routes refuse (fail closed)")
            unavailable: type[LedgerUnavailable] = LedgerUnavailable
            if isinstance(exc, CONNECTION_REFUSED):
                unavailable = _NotSent
            elif isinstance(exc, UNREACHABLE):
                unavailable = _AnswerLost
            # The driver's reason as `driver_reason` vets it (its type's name when the URL's
            # password could be in it): a class name alone ("InvalidCatalogNameError") left
            # `budgets show` and `usage` unclear where the route verbs named the database.
            kind, reason = type(exc).__name__, driver_reason(exc, self.dsn)
            said = kind if reason == kind else f"{kind}: {' '.join(reason.split())}"
            raise unavailable(f"PostgreSQL ledger {self._shown} unavailable ({said})") from None
        self._outage.recovered()
        self._backlog.resume()
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
            self._backlog.keep((hold_id, 0, None, True, None))
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
        task.add_done_callback(retrieved)
        return task

    def _release_if_taken(self, statement: asyncio.Task[object], hold_id: str) -> None:
        if statement.cancelled():
            return
        error = statement.exception()
        if isinstance(error, _AnswerLost):
            self._backlog.keep((hold_id, 0, None, True, None))  # its answer may have been lost
        elif error is None and statement.result() is not None:
            self._outliving(self._release(hold_id))

    async def _release(self, hold_id: str) -> None:
        """Release a hold nobody will settle; one the database did not answer for is kept
        and released when it answers again."""
        try:
            await self._finish(hold_id, 0)
        except (_NotSent, _AnswerLost):
            self._backlog.keep((hold_id, 0, None, True, None))

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
            if not self._backlog.keep((hold_id, spent, None, isinstance(exc, _AnswerLost), None)):
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
            if not self._backlog.keep((hold_id, spent, values, False, None)):
                raise
        except _AnswerLost:
            # A settlement on the wire when the database went away: written or not, it is
            # kept, and written again once only if its hold is still there (so neither lost
            # nor written twice). A plain record cannot be told apart: not sent again.
            if hold_id is None or not self._backlog.keep((hold_id, spent, values, True, None)):
                raise

    @property
    def waiting(self) -> int:
        """Usage records kept through an outage, not yet written."""
        return len(self._backlog)

    def _try_at_once(self) -> None:
        self._retry_at = 0.0  # one last try, whatever the outage's pace

    async def aclose(self) -> None:
        if self._outliving_calls:  # settlements and releases a cancelled caller left
            await asyncio.gather(*self._outliving_calls, return_exceptions=True)
            if self._outliving_calls:  # a release started by a hold that just ended
                await asyncio.gather(*self._outliving_calls, return_exceptions=True)
        if self._loop is not asyncio.get_running_loop():
            self._abandon_pool()  # a pool of another loop is closed on that loop
        await self._backlog.close(self._try_at_once)
        pool, self._pool = self._pool, None
        self._closes_with(None)
        await self._connects.ended()  # a cancelled caller's, terminated as it arrives
        if pool is not None:
            await pool.close()
