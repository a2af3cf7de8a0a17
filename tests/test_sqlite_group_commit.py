"""The SQLite ledger commits a request's calls in groups (store/ledgers/sqlite_calls.py
`grouped`): the holds and settlements of this process that are ready on one turn of the
event loop share one transaction. Each call keeps its own result, a failing call fails
alone, a group the database refuses for now waits in the worker thread whole, and a
caller cancelled before its group is written leaves nothing behind."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import AsyncIterator
from decimal import Decimal
from pathlib import Path

import anyio
import pytest

from fallback_mw.budget.ledger import Hold, UsageRecord
from fallback_mw.config import BudgetConfig
from fallback_mw.store.ledgers.sqlite import SQLiteLedger
from tests.helpers import record_the_store_refuses

BUDGET = BudgetConfig(limit=Decimal(25), window="total")


def record(request_id: str) -> UsageRecord:
    return UsageRecord(request_id=request_id, route="chat", tenant="t", budget_id="b")


@pytest.fixture
async def ledger(tmp_path: Path) -> AsyncIterator[SQLiteLedger]:
    opened = SQLiteLedger(str(tmp_path / "ledger.db"))
    try:
        await opened.set_budget("other", BUDGET)  # opens both connections
        await opened.status("b", BUDGET)
        yield opened
    finally:
        await opened.aclose()


def held_in_the_file(path: Path) -> int:
    """Budget `b`'s held units as another connection (another process) reads them."""
    reader = sqlite3.connect(path)
    try:
        (held,) = reader.execute(
            "SELECT held_units FROM fmw_budget_windows WHERE budget_id = 'b'"
        ).fetchone()
    finally:
        reader.close()
    return int(held)


def count_commits(ledger: SQLiteLedger) -> list[str]:
    """The statements the event loop thread's connection runs (where groups are written
    while nothing holds the database)."""
    statements: list[str] = []
    assert ledger._db._fast is not None
    ledger._db._fast.set_trace_callback(statements.append)
    return statements


@pytest.mark.anyio
async def test_concurrent_holds_share_commits_and_each_gets_its_own_answer(
    ledger: SQLiteLedger,
) -> None:
    statements = count_commits(ledger)
    holds = await asyncio.gather(*(ledger.hold("b", BUDGET, Decimal(1)) for _ in range(40)))
    granted = [h for h in holds if h is not None]
    assert len(granted) == 25  # the limit: the 26th and later are refused, in order
    assert holds[:25] == granted and holds[25:] == [None] * 15
    assert len({h.hold_id for h in granted}) == 25
    begins = [s for s in statements if s.startswith("BEGIN")]
    assert 1 <= len(begins) <= 2, begins  # one group (two if the loop split them)
    status = await ledger.status("b", BUDGET)
    assert (status.held, status.spent) == (Decimal(25), 0)

    settled = [
        ledger.settle_and_record(h, Decimal("0.5"), record(f"r{n}")) for n, h in enumerate(granted)
    ]
    statements.clear()
    await asyncio.gather(*settled)
    assert len([s for s in statements if s.startswith("BEGIN")]) <= 2
    status = await ledger.status("b", BUDGET)
    assert (status.held, status.spent) == (0, Decimal("12.5"))
    assert sorted(r.request_id for r in await ledger.usage()) == sorted(f"r{n}" for n in range(25))


@pytest.mark.anyio
async def test_a_call_whose_statements_fail_fails_alone(ledger: SQLiteLedger) -> None:
    first = await ledger.hold("b", BUDGET, Decimal(2))
    second = await ledger.hold("b", BUDGET, Decimal(2))
    assert isinstance(first, Hold) and isinstance(second, Hold)
    bad = record_the_store_refuses()  # request_id None: NOT NULL
    results = await asyncio.gather(
        ledger.settle_and_record(first, Decimal(1), record("good-1")),
        ledger.settle_and_record(second, Decimal(1), bad),
        ledger.hold("b", BUDGET, Decimal(3)),
        ledger.settle_and_record(None, Decimal(0), record("good-2")),
        return_exceptions=True,
    )
    assert results[0] is None and results[3] is None
    assert isinstance(results[1], sqlite3.IntegrityError)
    assert isinstance(results[2], Hold)
    # The failing call's settlement went with its record; everything else committed.
    status = await ledger.status("b", BUDGET)
    assert (status.spent, status.held) == (Decimal(1), Decimal(2) + Decimal(3))
    assert [r.request_id for r in await ledger.usage()] == ["good-1", "good-2"]


@pytest.mark.anyio
async def test_a_group_the_database_refuses_waits_whole_in_the_worker_thread(
    ledger: SQLiteLedger, tmp_path: Path
) -> None:
    path = tmp_path / "ledger.db"
    other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        other.execute("BEGIN IMMEDIATE")  # another process's writer
        released = threading.Timer(0.3, lambda: other.execute("COMMIT"))
        released.start()
        try:
            with anyio.fail_after(10):
                holds = await asyncio.gather(
                    *(ledger.hold("b", BUDGET, Decimal(n)) for n in (1, 2, 3, 4))
                )
        finally:
            released.join()
        assert all(isinstance(h, Hold) for h in holds)
        status = await ledger.status("b", BUDGET)
        assert status.held == Decimal(10)  # each once: nothing of the refused try stayed
    finally:
        other.close()


@pytest.mark.anyio
async def test_a_caller_cancelled_before_its_group_is_written_leaves_nothing(
    ledger: SQLiteLedger,
) -> None:
    tasks = [asyncio.ensure_future(ledger.hold("b", BUDGET, Decimal(n))) for n in (1, 2, 4)]
    await asyncio.sleep(0)  # every call has joined the group; none is written yet
    tasks[1].cancel()
    with anyio.fail_after(5):
        done = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(done[0], Hold) and isinstance(done[2], Hold)
    assert isinstance(done[1], asyncio.CancelledError)
    status = await ledger.status("b", BUDGET)
    assert status.held == Decimal(5)  # 1 + 4: the cancelled hold was never written


@pytest.mark.anyio
async def test_a_caller_cancelled_while_its_group_waits_in_the_worker_thread_leaves_nothing(
    ledger: SQLiteLedger, tmp_path: Path
) -> None:
    # Another process held the write lock, so the hold's group went to the worker thread,
    # which chose its calls and then waited for the lock; the caller was cancelled meanwhile
    # (a host cancelling the request). The group still wrote the hold, nobody learnt of it:
    # HELD for an hour, then charged as spent.
    path = tmp_path / "ledger.db"
    other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        other.execute("BEGIN IMMEDIATE")  # another process's writer
        released = threading.Timer(0.5, lambda: other.execute("COMMIT"))
        released.start()
        try:
            kept = asyncio.ensure_future(ledger.hold("b", BUDGET, Decimal(1)))
            cancelled = asyncio.ensure_future(ledger.hold("b", BUDGET, Decimal(2)))
            await asyncio.sleep(0.2)  # the group is in the worker thread, waiting
            cancelled.cancel()
            with anyio.fail_after(10):
                done = await asyncio.gather(kept, cancelled, return_exceptions=True)
        finally:
            released.join()
        assert isinstance(done[0], Hold)
        assert isinstance(done[1], asyncio.CancelledError)
        for _ in range(100):  # a release behind the group is written on a later turn
            if (await ledger.status("b", BUDGET)).held == Decimal(1):
                break
            await asyncio.sleep(0.02)
        assert (await ledger.status("b", BUDGET)).held == Decimal(1)  # the kept hold only
        assert held_in_the_file(path) == 1_000_000_000
    finally:
        other.close()


@pytest.mark.anyio
async def test_a_hold_alone_is_committed_at_once(ledger: SQLiteLedger, tmp_path: Path) -> None:
    statements = count_commits(ledger)
    hold = await ledger.hold("b", BUDGET, Decimal(1))
    assert hold is not None
    assert [s for s in statements if s.startswith(("BEGIN", "COMMIT"))] == [
        "BEGIN IMMEDIATE",
        "COMMIT",
    ]
    # Visible to another connection (another process) as soon as the call returns.
    assert held_in_the_file(tmp_path / "ledger.db") > 0


@pytest.mark.anyio
async def test_closing_writes_the_calls_already_made_first(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    ledger = SQLiteLedger(str(path))
    await ledger.status("b", BUDGET)  # opened
    other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")  # another process's writer: groups go to the thread
    released = threading.Timer(0.3, lambda: other.execute("COMMIT"))
    released.start()
    try:
        first = asyncio.ensure_future(ledger.hold("b", BUDGET, Decimal(1)))
        for _ in range(3):  # its group refused on the loop thread, waiting in the worker
            await asyncio.sleep(0)
        second = asyncio.ensure_future(ledger.hold("b", BUDGET, Decimal(2)))
        await asyncio.sleep(0)  # a second group, behind the first
        await ledger.aclose()
    finally:
        released.join()
        other.close()
    assert isinstance(await first, Hold) and isinstance(await second, Hold)
    assert ledger._db._conn is None and ledger._db._fast is None  # closed, not opened again
    assert held_in_the_file(path) == 3 * 10**9  # both holds, in the ledger's units


@pytest.mark.anyio
async def test_grouped_calls_alone_keep_the_wal_checkpointed(tmp_path: Path) -> None:
    ledger = SQLiteLedger(str(tmp_path / "ledger.db"))
    try:
        for number in range(5000):  # only grouped calls, as a budgeted route makes them
            await ledger.settle_and_record(None, Decimal(0), record(f"{number:032x}"))
        # Never checkpointed, 5,000 usage rows leave tens of MB of WAL; a group in every
        # CHECKPOINT_EVERY goes to the worker thread, whose connection checkpoints.
        assert (tmp_path / "ledger.db-wal").stat().st_size < 12_000_000
        assert len(await ledger.usage(limit=10_000)) == 5000
    finally:
        await ledger.aclose()
