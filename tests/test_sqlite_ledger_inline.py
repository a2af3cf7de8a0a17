"""The SQLite ledger runs its calls on the event loop's thread when that cannot block
(store/ledgers/sqlite.py `_inline`): the database locked by another connection sends the
call to the worker thread, which waits for the lock as before; the WAL is still
checkpointed although the loop thread's connection never does it."""

from __future__ import annotations

import sqlite3
import threading
from decimal import Decimal
from pathlib import Path

import pytest

from fallback_mw.budget.ledger import UsageRecord
from fallback_mw.config import BudgetConfig
from fallback_mw.store.ledgers.sqlite import SQLiteLedger

BUDGET = BudgetConfig(limit=Decimal(100), window="total")


def record(number: int) -> UsageRecord:
    return UsageRecord(
        request_id=f"{number:032x}",
        route="chat",
        tenant="default",
        budget_id="b",
        candidates=("a",),
        attempts=(),
        chosen="a",
        outcome="served",
        status=200,
        model="m",
        input_tokens=9,
        output_tokens=3,
        cost=Decimal("0.001"),
        charged=Decimal("0.001"),
        duration_ms=1.0,
    )


@pytest.mark.anyio
async def test_a_write_lock_held_elsewhere_sends_the_call_to_the_worker_thread(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ledger.db"
    ledger = SQLiteLedger(str(path))
    try:
        assert await ledger.hold("b", BUDGET, Decimal(1)) is not None  # opens both
        other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        other.execute("BEGIN IMMEDIATE")  # another process's writer, say
        released = threading.Timer(0.3, lambda: other.execute("COMMIT"))
        released.start()
        try:
            # On the loop thread this is "database is locked" at once; the worker thread
            # waits (busy timeout 5 s) until the other writer commits.
            hold = await ledger.hold("b", BUDGET, Decimal(2))
        finally:
            released.join()
            other.close()
        assert hold is not None
        status = await ledger.status("b", BUDGET)
        assert status.held == Decimal(3)
        await ledger.settle(hold, Decimal("1.5"))
        status = await ledger.status("b", BUDGET)
        assert (status.held, status.spent) == (Decimal(1), Decimal("1.5"))
    finally:
        await ledger.aclose()


@pytest.mark.anyio
async def test_the_wal_is_checkpointed(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    ledger = SQLiteLedger(str(path))
    try:
        for number in range(5000):
            await ledger.record_usage(record(number))
        # Never checkpointed, 5,000 usage rows leave about 46 MB of WAL; checkpointed at
        # SQLite's default 1,000 pages, about 5 MB.
        assert (tmp_path / "ledger.db-wal").stat().st_size < 12_000_000
        assert len(await ledger.usage(limit=10_000)) == 5000
    finally:
        await ledger.aclose()
