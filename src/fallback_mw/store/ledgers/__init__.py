"""The budget ledger backends (memory, SQLite, PostgreSQL), beside the route store, and
how one is chosen from a store URL."""

from __future__ import annotations

from fallback_mw.budget.ledger import Ledger


def open_ledger(store: str | None) -> Ledger:
    """The ledger for a `gateway.store` URL: memory without a store. Connections are made
    lazily, on first use, so an unreachable store fails requests closed rather than
    failing start-up."""
    if store is None:
        from fallback_mw.store.ledgers.memory import MemoryLedger

        return MemoryLedger()
    from fallback_mw.store_url import parse_store_url

    url = parse_store_url(store)
    if url.kind == "sqlite":
        from fallback_mw.store.ledgers.sqlite import SQLiteLedger

        return SQLiteLedger(url.target)
    from fallback_mw.store.ledgers.postgres import PostgresLedger

    return PostgresLedger(url.target)
