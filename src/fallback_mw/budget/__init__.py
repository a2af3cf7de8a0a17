"""Budgets: the ledger interface, its records (budget/ledger.py), and how a ledger is
chosen from a store URL. The backends (memory, sqlite, postgres) import budget.ledger, so
this facade may import them without a cycle."""

from __future__ import annotations

from fallback_mw.budget.ledger import (
    AttemptOutcome,
    BudgetStatus,
    Hold,
    Ledger,
    LedgerUnavailable,
    MinuteUsage,
    UsageRecord,
    window_kind,
    window_start,
)


def open_ledger(store: str | None) -> Ledger:
    """The ledger for a `gateway.store` URL: memory without a store. Connections are made
    lazily, on first use, so an unreachable store fails requests closed rather than
    failing start-up."""
    if store is None:
        from fallback_mw.budget.memory import MemoryLedger

        return MemoryLedger()
    from fallback_mw.store.url import parse_store_url

    url = parse_store_url(store)
    if url.kind == "sqlite":
        from fallback_mw.budget.sqlite import SQLiteLedger

        return SQLiteLedger(url.target)
    from fallback_mw.budget.postgres import PostgresLedger

    return PostgresLedger(url.target)


__all__ = [
    "AttemptOutcome",
    "BudgetStatus",
    "Hold",
    "Ledger",
    "LedgerUnavailable",
    "MinuteUsage",
    "UsageRecord",
    "open_ledger",
    "window_kind",
    "window_start",
]
