"""What the PostgreSQL ledger answers its readers: the stored budgets (`budgets set`,
`budgets show`), a budget's period, the usage records and their counts per minute (`usage`,
game days). Sent through the ledger's own `_run` (its pool, its outage)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

import asyncpg

from fallback_mw.budget.cost import to_units
from fallback_mw.budget.ledger import (
    PER_MINUTE_FILTER,
    BudgetStatus,
    MinuteUsage,
    RollingPeak,
    UsageRecord,
    rolling_peak_of,
    window_kind,
)
from fallback_mw.config import BudgetConfig
from fallback_mw.store.ledgers.postgres_sql import ROLLING_PEAKS, STATUS
from fallback_mw.store.ledgers.schema import (
    RECORDED_WINDOWS,
    USAGE_COLUMNS,
    SQLLedgerBase,
    budget_from_row,
    budgets_from_rows,
    usage_from_row,
)

T = TypeVar("T")


class PostgresReads(SQLLedgerBase):
    """The reads of PostgresLedger, which gives `_run`."""

    async def _run(self, work: Callable[[asyncpg.Pool], Awaitable[T]]) -> T:
        raise NotImplementedError

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
