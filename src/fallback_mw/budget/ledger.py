"""The ledger interface and its records (the backends import this, never the package).

A ledger keeps, per budget and window, the money `spent` and the money `held` by requests
in flight. Money is exact: `Decimal` at the interface, integer nano-units (1e-9) in the
stores. Three implementations share the interface: memory (no store, one process),
SQLite (embedded default) and PostgreSQL (many gateway processes)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, Protocol, runtime_checkable

from fallback_mw.budget.records import AttemptOutcome as AttemptOutcome  # re-exported
from fallback_mw.budget.records import UsageRecord as UsageRecord  # re-exported
from fallback_mw.config import BudgetConfig

SCHEMA_COMPONENT = "ledger"


class LedgerUnavailable(Exception):
    """The ledger cannot be reached; the guard fails closed (503 budget_unavailable)."""


class BudgetUnreadable(LedgerUnavailable):
    """A stored budget this version cannot read (a window another version wrote, a row
    edited by hand): its routes fail closed as if the ledger were unreachable."""

    @classmethod
    def named(cls, budget_id: str) -> BudgetUnreadable:
        """The error naming the row (its values are not quoted) and the fix."""
        return cls(
            f"stored budget {budget_id!r} is a row this version cannot read (a window or amount "
            "another version or a hand edit wrote): `fallback-mw budgets set --budget ID "
            "--limit ...` stores it again"
        )


@dataclass(frozen=True, slots=True)
class Hold:
    hold_id: str
    budget_id: str
    amount: Decimal
    window_start: str = "total"


@dataclass(frozen=True, slots=True)
class BudgetStatus:
    budget_id: str
    limit: Decimal
    window: str
    window_start: str
    spent: Decimal
    held: Decimal
    default_hold: Decimal

    @property
    def remaining(self) -> Decimal:
        return self.limit - self.spent - self.held

    @classmethod
    def of(
        cls, budget_id: str, budget: BudgetConfig, start: str, spent_units: int, held_units: int
    ) -> BudgetStatus:
        """The status every ledger reports, from its stored integer nano-units."""
        from fallback_mw.budget.cost import from_units

        return cls(
            budget_id=budget_id,
            limit=budget.limit,
            window=budget.window,
            window_start=start,
            spent=from_units(spent_units),
            held=from_units(held_units),
            default_hold=budget.default_hold,
        )


@dataclass(frozen=True, slots=True)
class MinuteUsage:
    """One route's routed requests in one UTC minute (or one second: what a rolling minute
    is summed from)."""

    route: str
    minute: datetime  # the minute's (or the second's) start, UTC
    requests: int
    tokens: int  # input + output tokens, as the upstreams reported them
    metered: int  # requests whose usage was reported (tokens are known for these only)


@dataclass(frozen=True, slots=True)
class RollingPeak:
    """One route's busiest rolling minute (any 60 seconds, as `rpm` / `tpm` are enforced)
    for requests and, separately, for reported tokens; each time is its window's first
    second (the latest such window on a tie)."""

    route: str
    requests: int
    requests_at: datetime
    tokens: int
    tokens_at: datetime
    total: int  # the route's requests in the whole period
    metered: int  # of which reported usage (tokens are known for these only)


ROLLING_SECONDS = 60


def rolling_peaks(seconds: list[MinuteUsage]) -> list[RollingPeak]:
    """`RollingPeak`s from per-second rows (what the SQL ledgers compute in SQL)."""
    by_route: dict[str, list[MinuteUsage]] = {}
    for second in seconds:
        by_route.setdefault(second.route, []).append(second)
    found = []
    for route, rows in by_route.items():
        rows.sort(key=lambda m: m.minute)
        requests, requests_at = _busiest(rows, requests=True)
        tokens, tokens_at = _busiest(rows, requests=False)
        total, metered = sum(m.requests for m in rows), sum(m.metered for m in rows)
        found.append(RollingPeak(route, requests, requests_at, tokens, tokens_at, total, metered))
    return found


def _busiest(rows: list[MinuteUsage], *, requests: bool) -> tuple[int, datetime]:
    best, best_at = -1, rows[0].minute
    total, start = 0, 0
    for row in rows:
        total += row.requests if requests else row.tokens
        while (row.minute - rows[start].minute).total_seconds() >= ROLLING_SECONDS:
            total -= rows[start].requests if requests else rows[start].tokens
            start += 1
        if total >= best:
            best, best_at = total, rows[start].minute
    return best, best_at


# Outcomes of requests refused before the plan was walked (the resolver, the budget guard,
# the body read), when no candidate was attempted or skipped: no upstream saw them and none
# would in a failover, so they are not demand a fallback must carry (capacity planning).
# The SQL ledgers filter the same way (`attempts` is stored as JSON text, '[]' when empty).
REFUSED_BEFORE_THE_PLAN = (
    "method_not_allowed",
    "headers_too_large",
    "overloaded",
    "budget_exceeded",
    "budget_unavailable",
    "request_too_large",
    "bad_request",
    "request_timeout",
    "loop_detected",
)
PER_MINUTE_FILTER = "(outcome IS NULL OR attempts <> '[]' OR outcome NOT IN ({}))".format(
    ", ".join(f"'{outcome}'" for outcome in REFUSED_BEFORE_THE_PLAN)
)


def rolling_peaks_sql(second: str, since: str, *, tokens: str, total: str) -> str:
    """The SQL ledgers' `rolling_peaks`: per-second counts, summed over each second's
    preceding minute (a window function, in the database), the busiest such window per
    route for requests and for tokens, with the route's totals. `second` is the dialect's
    epoch second of `at`, `since` its parameter, `tokens` its expression of one record's
    tokens and `total` its sum of them that no count overflows. Rows: route, requests,
    requests_at, tokens, tokens_at (epoch seconds), total, metered. A record whose `at` is
    no time (a hand edit: SQLite's `at` is text) is left out: it made `capacity` an
    internal error."""
    return f"""
WITH s AS (
  SELECT route, {second} AS sec, COUNT(*) AS n, {total}({tokens}) AS t,
    SUM(CASE WHEN input_tokens IS NULL AND output_tokens IS NULL THEN 0 ELSE 1 END) AS m
  FROM fmw_usage WHERE at >= {since} AND {second} IS NOT NULL AND {PER_MINUTE_FILTER}
  GROUP BY route, {second}
), w AS (
  SELECT route, SUM(n) OVER win AS rn, {total}(t) OVER win AS rt, MIN(sec) OVER win AS first
  FROM s WINDOW win AS (PARTITION BY route ORDER BY sec
    RANGE BETWEEN {ROLLING_SECONDS - 1} PRECEDING AND CURRENT ROW)
), bn AS (
  SELECT route, rn, first,
    ROW_NUMBER() OVER (PARTITION BY route ORDER BY rn DESC, first DESC) AS k FROM w
), bt AS (
  SELECT route, rt, first,
    ROW_NUMBER() OVER (PARTITION BY route ORDER BY rt DESC, first DESC) AS k FROM w
), totals AS (SELECT route, SUM(n) AS n, SUM(m) AS m FROM s GROUP BY route)
SELECT totals.route, bn.rn, bn.first, bt.rt, bt.first, totals.n, totals.m
FROM totals JOIN bn ON bn.route = totals.route AND bn.k = 1
JOIN bt ON bt.route = totals.route AND bt.k = 1"""


def rolling_peak_of(row: Sequence[Any] | Any) -> RollingPeak:
    """A row of `rolling_peaks_sql` as a `RollingPeak`."""
    route, requests, requests_at, tokens, tokens_at, total, metered = row
    return RollingPeak(
        str(route), int(requests), datetime.fromtimestamp(int(requests_at), UTC),
        int(tokens or 0), datetime.fromtimestamp(int(tokens_at), UTC), int(total),
        int(metered or 0),
    )  # fmt: skip


def refused_before_the_plan(record: UsageRecord) -> bool:
    return not record.attempts and record.outcome in REFUSED_BEFORE_THE_PLAN


def minute_usage(records: list[UsageRecord], *, per_second: bool = False) -> list[MinuteUsage]:
    """Records grouped by route and UTC minute, or second (what the SQL ledgers do in
    SQL), without the requests refused before the plan."""
    groups: dict[tuple[str, datetime], list[int]] = {}
    for record in records:
        if refused_before_the_plan(record):
            continue
        at = record.at.astimezone(UTC)
        minute = at.replace(microsecond=0) if per_second else at.replace(second=0, microsecond=0)
        counts = groups.setdefault((record.route, minute), [0, 0, 0])
        counts[0] += 1
        if record.input_tokens is not None or record.output_tokens is not None:
            counts[1] += (record.input_tokens or 0) + (record.output_tokens or 0)
            counts[2] += 1
    return [MinuteUsage(route, minute, *counts) for (route, minute), counts in groups.items()]


class Ledger(Protocol):
    async def hold(self, budget_id: str, budget: BudgetConfig, amount: Decimal) -> Hold | None:
        """Atomically reserve `amount`; None when that would pass the limit."""
        ...

    async def settle(self, hold: Hold, amount: Decimal) -> None:
        """Turn the hold into spend of `amount`. A hold is settled or released once: a
        second call for the same hold changes nothing."""
        ...

    async def release(self, hold: Hold) -> None: ...

    async def record_usage(self, record: UsageRecord) -> None: ...

    async def stored_budget(self, budget_id: str) -> BudgetConfig | None:
        """A budget created with `budgets set` (briefly cached); None if the store has none."""
        ...

    async def set_budget(self, budget_id: str, budget: BudgetConfig) -> None: ...

    async def stored_budgets(self) -> dict[str, BudgetConfig]: ...

    async def recorded_budgets(self) -> dict[str, str]:
        """Every budget id the ledger has spend or holds for, defined in the store or not
        (a config file's budgets live only in the file), with the window kind of its newest
        window: what `budgets show` lists when it is given the store alone."""
        ...

    async def status(self, budget_id: str, budget: BudgetConfig) -> BudgetStatus: ...

    async def usage(
        self,
        *,
        since: datetime | None = None,
        route: str | None = None,
        tenant: str | None = None,
        limit: int = 1000,
    ) -> list[UsageRecord]: ...

    async def usage_per_minute(self, *, since: datetime) -> list[MinuteUsage]:
        """Every route's requests and reported tokens per UTC minute since `since` (the
        requests that reached the plan: not those `refused_before_the_plan`)."""
        ...

    async def rolling_peaks(self, *, since: datetime) -> list[RollingPeak]:
        """Every route's busiest rolling minute since `since`, computed where the records
        are (a week of busy seconds is never sent over), of the same requests as
        `usage_per_minute`."""
        ...

    async def aclose(self) -> None: ...


@runtime_checkable
class SettlesAndRecords(Protocol):
    """What a ledger may add to `Ledger` (the SQL ledgers do): the end of a request in one
    step. The guard uses it when the ledger has it, else `settle` / `release` and then
    `record_usage`."""

    async def settle_and_record(
        self, hold: Hold | None, amount: Decimal, record: UsageRecord
    ) -> None:
        """Settle `hold` at `amount` (a hold settled at 0 is released; no hold: nothing to
        settle) and store `record`, in one transaction: both or neither."""
        ...


def room_needed(units: int) -> int:
    """The room (nano-units) a hold of `units` needs left in its window: itself, and at least
    one nano-unit. A hold of 0 (`default_hold = 0`, a request priced at nothing) would
    otherwise fit `spent + held + 0 <= limit` in a window spent to its limit, or under a
    limit of 0, and be served and charged past it."""
    return max(units, 1)


def window_start(window: str, now: datetime | None = None) -> str:
    """The key of the current window (UTC): `2026-11-30`, `2026-11` or `total`."""
    if window == "total":
        return "total"
    moment = (now or datetime.now(UTC)).astimezone(UTC)
    if window == "day":
        return moment.strftime("%Y-%m-%d")
    return moment.strftime("%Y-%m")


def window_kind(start: str) -> str:
    """The window kind a `window_start` key was made for: the inverse of `window_start`."""
    if start == "total":
        return "total"
    return "day" if len(start) == len("2026-11-30") else "month"


__all__ = [
    "AttemptOutcome",
    "BudgetStatus",
    "Hold",
    "Ledger",
    "LedgerUnavailable",
    "MinuteUsage",
    "RollingPeak",
    "SettlesAndRecords",
    "UsageRecord",
    "room_needed",
    "window_kind",
    "window_start",
]
