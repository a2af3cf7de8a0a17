"""A request cancelled while the PostgreSQL ledger opens a connection (a client gone, a
deadline, a stop's graceful timeout) leaves nothing for asyncio to report. asyncpg, cancelled
in the middle of its TLS probe (`sslmode=prefer`, the default), left a future holding
`ConnectionError('unexpected connection_lost() call')` that nobody read: asyncio logged
"Future exception was never retrieved" in the host's log, an error for nothing that went
wrong. The real PostgreSQL, cancelled at every turn of the connect in turn.

The route store's watcher opens its LISTEN connection the same way, and a gateway closing
cancels it there: the failure seen once in CI (a budget test's loop ending right after the
gateway closed). The connect goes on for nobody; the owner's `aclose` waits for it, so no
loop ends with it running (and cancels it at that same turn)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import AsyncIterator, Awaitable
from decimal import Decimal
from typing import Any

import pytest

from fallback_mw.config import BudgetConfig
from fallback_mw.store.ledgers.postgres import PostgresLedger
from fallback_mw.store.postgres import PostgresStore

pytestmark = pytest.mark.anyio

BUDGET = BudgetConfig(limit=Decimal("100"), window="month", default_hold=Decimal("0.01"))


@contextlib.asynccontextmanager
async def nothing_reported() -> AsyncIterator[None]:
    """The loop's reports (asyncio's "Future exception was never retrieved"...) collected
    while the block runs: none may be made, and no task the block started may outlive it."""
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    try:
        yield
        gc.collect()
        await asyncio.sleep(0.05)
        assert [c.get("message") for c in reported] == []
    finally:
        loop.set_exception_handler(previous)


async def cancelled_at(turns: int, call: Awaitable[Any]) -> None:
    """`call` in a task of its own, cancelled after `turns` turns of the loop."""
    task = asyncio.ensure_future(call)
    for _ in range(turns):
        await asyncio.sleep(0)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def test_a_connect_cancelled_at_any_turn_leaves_nothing_unread(pg_url: str) -> None:
    running = asyncio.all_tasks()
    async with nothing_reported():
        # A first ledger migrates the schema, so each later one only connects.
        first = PostgresLedger(pg_url)
        assert await first.hold("acme", BUDGET, Decimal("0.01")) is not None
        await first.aclose()
        for turns in range(0, 40):
            ledger = PostgresLedger(pg_url)
            # A read the caller waits for (a hold outlives its caller in a task of its own).
            await cancelled_at(turns, ledger.status("acme", BUDGET))
            await ledger.aclose()
            assert asyncio.all_tasks() - running == set(), turns  # no connect left running
        for _ in range(20):  # a connect finished for nobody is closed on a later turn
            await asyncio.sleep(0.02)


async def test_a_route_store_closed_while_its_watcher_connects_leaves_nothing(
    pg_url: str,
) -> None:
    running = asyncio.all_tasks()
    async with nothing_reported():
        first = PostgresStore(pg_url)  # migrates the schema, so each later one only connects
        assert await first.load_routes() == []
        await first.aclose()
        for turns in range(0, 60):
            store = PostgresStore(pg_url)
            # The reloader's wait: its first connection, then its LISTEN one.
            await cancelled_at(turns, store.wait_for_change(30.0))
            await store.aclose()
            assert asyncio.all_tasks() - running == set(), turns
