"""Budgets (money): the ledger interface and its records (budget/ledger.py), prices and
costs (cost.py). The usage meter belongs to the response path (request/usage.py). The
ledger backends live beside the other stores (store/ledgers/), which also picks one from a
store URL (`open_ledger`)."""

from __future__ import annotations

from fallback_mw.budget.ledger import (
    AttemptOutcome,
    BudgetStatus,
    BudgetUnreadable,
    Hold,
    Ledger,
    LedgerUnavailable,
    MinuteUsage,
    RollingPeak,
    SettlesAndRecords,
    UsageRecord,
    room_needed,
    window_kind,
    window_start,
)

__all__ = [
    "AttemptOutcome",
    "BudgetStatus",
    "BudgetUnreadable",
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
