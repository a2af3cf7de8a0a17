"""Budgets: the ledger interface and the guard layer."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from typing import Protocol

from fallback_mw.config import BudgetConfig


class LedgerUnavailable(Exception):
    """The ledger cannot be reached; the guard fails closed (503 budget_unavailable)."""


@dataclass(frozen=True, slots=True)
class Hold:
    hold_id: str
    budget_id: str
    amount: Decimal


class Ledger(Protocol):
    async def hold(self, budget_id: str, budget: BudgetConfig, amount: Decimal) -> Hold | None:
        """Atomically reserve `amount`; None when that would pass the limit."""
        ...

    async def settle(self, hold: Hold, amount: Decimal) -> None: ...

    async def release(self, hold: Hold) -> None: ...

    async def aclose(self) -> None: ...
