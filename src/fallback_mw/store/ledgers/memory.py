"""The in-memory ledger: no store configured, one process. Holds are atomic because
nothing awaits between the check and the update."""

from __future__ import annotations

import uuid
from collections import deque
from dataclasses import replace
from datetime import datetime
from decimal import Decimal

from fallback_mw.budget.cost import SPENT_CAP_UNITS, from_units, to_units
from fallback_mw.budget.ledger import (
    BudgetStatus,
    Hold,
    MinuteUsage,
    RollingPeak,
    UsageRecord,
    minute_usage,
    rolling_peaks,
    room_needed,
    window_kind,
    window_start,
)
from fallback_mw.config import BudgetConfig

USAGE_KEPT = 10_000  # the newest usage records; memory must stay bounded


def _in_units(amount: Decimal | None) -> Decimal | None:
    return None if amount is None else from_units(to_units(amount))


def _as_stored(record: UsageRecord) -> UsageRecord:
    """`record` in the budget's own units, as the SQL ledgers store it: a cost of 1.4e-11
    was kept as it came while the settlement charged 1e-9, so the records' charges did not
    add up to the spend `status` reports. Converted when read, not on the request path
    (a `dataclasses.replace` and two conversions per request, for records rarely read)."""
    if record.cost is None and record.charged is None:
        return record
    return replace(record, cost=_in_units(record.cost), charged=_in_units(record.charged))


class MemoryLedger:
    # No call awaits anything: none can be suspended, so none can be cancelled part-way
    # (the budget guard settles without a shield scope).
    never_suspends = True

    def __init__(self, *, usage_kept: int = USAGE_KEPT) -> None:
        self._spent: dict[tuple[str, str], int] = {}
        self._held: dict[tuple[str, str], int] = {}
        self._holds: dict[str, tuple[str, str, int]] = {}
        self._budgets: dict[str, BudgetConfig] = {}
        self._usage: deque[UsageRecord] = deque(maxlen=usage_kept)

    async def hold(self, budget_id: str, budget: BudgetConfig, amount: Decimal) -> Hold | None:
        key = (budget_id, window_start(budget.window))
        units = to_units(amount)
        # A hold of 0 needs room left too (`room_needed`): 0 always "fits" a spent budget.
        needed = room_needed(units)
        if self._spent.get(key, 0) + self._held.get(key, 0) + needed > to_units(budget.limit):
            return None
        self._held[key] = self._held.get(key, 0) + units
        hold_id = uuid.uuid4().hex
        self._holds[hold_id] = (budget_id, key[1], units)
        return Hold(hold_id, budget_id, from_units(units), key[1])

    async def settle(self, hold: Hold, amount: Decimal) -> None:
        self._finish(hold, to_units(amount))

    def settle_now(self, hold: Hold, amount: Decimal) -> None:
        """`settle`, answered at the call (the budget guard's request path); 0 releases."""
        self._finish(hold, to_units(amount))

    async def release(self, hold: Hold) -> None:
        self._finish(hold, 0)

    def _finish(self, hold: Hold, spent: int) -> None:
        entry = self._holds.pop(hold.hold_id, None)
        if entry is None:
            return  # already settled or released: exactly once
        budget_id, start, units = entry
        key = (budget_id, start)
        self._held[key] = self._held.get(key, 0) - units
        # Saturates as the SQL ledgers' 64-bit columns do (docs/budgets.md).
        self._spent[key] = min(self._spent.get(key, 0) + spent, SPENT_CAP_UNITS)

    async def record_usage(self, record: UsageRecord) -> None:
        self.record_usage_now(record)

    def record_usage_now(self, record: UsageRecord) -> None:
        self._usage.append(record)  # read back in the budget's units (`_as_stored`)

    async def stored_budget(self, budget_id: str) -> BudgetConfig | None:
        return self._budgets.get(budget_id)

    async def set_budget(self, budget_id: str, budget: BudgetConfig) -> None:
        self._budgets[budget_id] = budget

    async def stored_budgets(self) -> dict[str, BudgetConfig]:
        return dict(self._budgets)

    async def recorded_budgets(self) -> dict[str, str]:
        newest: dict[str, str] = {}
        for budget_id, start in [*self._spent, *self._held]:
            newest[budget_id] = max(start, newest.get(budget_id, start))
        return {budget_id: window_kind(start) for budget_id, start in newest.items()}

    async def status(self, budget_id: str, budget: BudgetConfig) -> BudgetStatus:
        start = window_start(budget.window)
        key = (budget_id, start)
        return BudgetStatus.of(
            budget_id, budget, start, self._spent.get(key, 0), self._held.get(key, 0)
        )

    async def usage(
        self,
        *,
        since: datetime | None = None,
        route: str | None = None,
        tenant: str | None = None,
        limit: int = 1000,
    ) -> list[UsageRecord]:
        found = [
            _as_stored(r)
            for r in self._usage
            if (since is None or r.at >= since)
            and (route is None or r.route == route)
            and (tenant is None or r.tenant == tenant)
        ]
        # The newest `limit`, as the SQL ledgers' LIMIT: `found[-0:]` was every record.
        return found[-limit:] if limit > 0 else []

    async def usage_per_minute(self, *, since: datetime) -> list[MinuteUsage]:
        return minute_usage([_as_stored(r) for r in self._usage if r.at >= since])

    async def rolling_peaks(self, *, since: datetime) -> list[RollingPeak]:
        records = [_as_stored(r) for r in self._usage if r.at >= since]
        return rolling_peaks(minute_usage(records, per_second=True))

    async def aclose(self) -> None:
        return None
