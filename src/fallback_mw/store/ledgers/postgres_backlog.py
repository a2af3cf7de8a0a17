"""What an outage kept from the PostgreSQL ledger: usage records (with their settlements)
refused before they were sent, and the releases of holds whose answer was lost, written in
their order, in batches, once the database answers again."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg

from fallback_mw.budget.cost import SPENT_CAP_UNITS
from fallback_mw.budget.ledger import LedgerUnavailable
from fallback_mw.store.ledgers.postgres_pool import UNREACHABLE
from fallback_mw.store.ledgers.postgres_sql import (
    FINISH,
    HOLD_THERE,
    INSERT_KEPT,
    ROW_IDS,
    SETTLE_AND_RECORD_KEPT,
)

logger = logging.getLogger("fallback_mw.budget")


# Usage records (with their settlements) that an outage kept from the database without
# sending them are kept in memory, up to this many, and written once it answers again.
BACKLOG_LIMIT = 10_000


# Kept work written per transaction.
DRAIN_BATCH = 500


# (hold id or None, spent units, usage values, sent, row id): one settlement and usage
# record to write; (hold id, 0, None, True, None): the release of a hold whose statement's
# answer was lost. `sent`: a settlement that may have been written already (its answer was
# lost): written again only while its hold is still there, which the first write would
# have deleted. `row id`: the usage row's id, given (from the table's sequence) before its
# batch is first sent, so a batch sent again writes no record twice (None until then).
Pending = tuple[str | None, int, tuple[object, ...] | None, bool, int | None]

# One unit of the ledger's work (its `_run`): what it answers.
Run = Callable[[Callable[[asyncpg.Pool], Awaitable[str | None]]], Awaitable[str | None]]


class Backlog:
    """The kept work of one ledger, written through its `run` (which fails closed during
    the outage); one drain at a time, and one try per `retry_interval` while something is
    kept, whether or not a call comes."""

    def __init__(self, run: Run, retry_interval: float) -> None:
        self._run = run
        self.retry_interval = retry_interval
        self._kept: deque[Pending] = deque()
        self._full = False  # said once per outage
        self.draining: asyncio.Task[None] | None = None  # one drain at a time
        # While something is kept, one drain per retry_interval even if no call comes.
        self._waking: asyncio.TimerHandle | None = None
        self._waking_loop: asyncio.AbstractEventLoop | None = None

    def __len__(self) -> int:
        """Usage records and releases kept through an outage, not yet written."""
        return len(self._kept)

    def keep(self, pending: Pending) -> bool:
        """Keep `pending` for when the database answers again (False: the backlog is full)."""
        if len(self._kept) >= BACKLOG_LIMIT:
            if not self._full:
                self._full = True
                logger.warning(
                    "PostgreSQL ledger: %d usage records wait for the database; "
                    "later ones are dropped until it answers",
                    len(self._kept),
                )
            return False
        self._kept.append(pending)
        self._wake_later()
        return True

    def resume(self) -> None:
        """The database answered: write what is kept, unless a drain is under way."""
        if self._kept and self.draining is None:
            self.start_drain()

    def start_drain(self) -> asyncio.Task[None]:
        """The drain under way, or a new one: never two at a time (each would take batches
        off the backlog, and write them out of order)."""
        if self.draining is None:
            self.draining = asyncio.create_task(self._drain())
            self.draining.add_done_callback(retrieved)
        return self.draining

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
        if self._kept:
            self.start_drain()

    async def _drain(self) -> None:
        """Write the kept records in batches, each one transaction; stops (keeping the
        rest) when the database is away again: the next call that reaches it, or the next
        try a retry_interval later (`_wake_later`), resumes."""
        written = 0
        try:
            while self._kept:
                count = min(DRAIN_BATCH, len(self._kept))
                batch = [self._kept.popleft() for _ in range(count)]
                try:
                    refused = await self._run(_batch_work(batch))
                except LedgerUnavailable:
                    self._kept.extendleft(reversed(batch))
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
            self._full = False
        finally:
            self.draining = None
            if self._kept:  # the database is away again (or was not back yet)
                self._wake_later()
            if written:
                logger.info(
                    "PostgreSQL ledger: wrote %d usage records kept through the outage", written
                )

    async def close(self, last_try: Callable[[], None]) -> None:
        """At the ledger's close: the drain under way ended, then one last try at what is
        left (`last_try` first: whatever the outage's pace); what still cannot be written
        is lost, said once."""
        if self.draining is not None:
            await asyncio.shield(self.draining)
        if self._kept:
            last_try()
            await asyncio.shield(self.start_drain())
        if self._waking is not None:  # no try after the close
            self._waking.cancel()
            self._waking = None
        if self._kept:
            logger.warning(
                "PostgreSQL ledger: %d usage records kept through the outage are lost "
                "(unreachable at close); their holds are charged in full once stale",
                len(self._kept),
            )
            self._kept.clear()


def _batch_work(batch: list[Pending]) -> Callable[[asyncpg.Pool], Awaitable[str | None]]:
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
            if isinstance(exc, UNREACHABLE):
                raise
            return type(exc).__name__
        return None

    return work


async def _give_row_ids(conn: asyncpg.pool.PoolConnectionProxy, batch: list[Pending]) -> None:
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


def _runs(batch: list[Pending]) -> list[tuple[str, list[tuple[object, ...]], str | None]]:
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


def retrieved(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # seen: never "Task exception was never retrieved"
