"""The SQLite ledger runs its calls on the event loop's thread when that cannot block
(store/ledgers/sqlite_calls.py `_inline`): the database locked by another connection sends the
call to the worker thread, which waits for the lock as before; the WAL is still
checkpointed although the loop thread's connection never does it."""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio
import pytest

from fallback_mw import Gateway
from fallback_mw.budget.ledger import LedgerUnavailable, UsageRecord
from fallback_mw.config import BudgetConfig
from fallback_mw.store.ledgers.sqlite import SQLiteLedger
from tests.helpers import client_for, http_scope, request_then_disconnect
from tests.test_budget_guard import gateway_config
from tests.upstreams import host_app, status_handler, upstream

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


@pytest.mark.anyio
async def test_a_database_locked_elsewhere_refuses_each_request_within_the_busy_timeout(
    tmp_path: Path,
) -> None:
    # Another process held the write lock (an operator's `sqlite3` session, a VACUUM): each
    # group of ledger calls waited out the 5 s busy timeout behind the groups before it,
    # so requests arriving a moment apart got their 503 after 5, 10, 15 ... seconds (the
    # twentieth after over a minute), or a 504 once the lock went. Each ledger call waits
    # the busy timeout at most now, its wait for the calls ahead of it included, as on
    # PostgreSQL (a request makes two at most: the stored budget's read, and the hold).
    path = tmp_path / "ledger.db"
    ledger = SQLiteLedger(str(path), busy_timeout=1.0)
    async with upstream(status_handler(200)) as primary:
        conf = gateway_config({"primary": primary.url}, store=f"sqlite:///{path}")
        gateway = Gateway(host_app, config=conf, ledger=ledger)
        other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        try:
            async with client_for(gateway) as client:
                assert (await client.post("/v1/chat", content=b"{}")).status_code == 200
                other.execute("BEGIN IMMEDIATE")  # another process's writer, and it stays
                answered: list[tuple[int, float]] = []  # status, seconds to the answer

                async def one(delay: float) -> None:
                    await anyio.sleep(delay)  # one request every 0.1 s: a group each
                    started = time.monotonic()

                    async def send(message: dict[str, Any]) -> None:
                        if message["type"] == "http.response.start":
                            answered.append((message["status"], time.monotonic() - started))

                    await gateway(http_scope("POST", "/v1/chat"), request_then_disconnect(30), send)

                with anyio.fail_after(30):
                    async with anyio.create_task_group() as group:
                        for n in range(6):
                            group.start_soon(one, n * 0.1)
            assert [status for status, _ in answered] == [503] * 6
            slowest = max(seconds for _, seconds in answered)
            assert slowest < 2.5, answered  # two calls' busy timeouts (1 s) at most, and a margin
        finally:
            other.close()
            await gateway.aclose()
    assert primary.count == 1


@pytest.mark.anyio
async def test_a_locked_file_is_one_outage_in_the_log_though_reads_still_answer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Locked by another process's writer, the file still answers reads (WAL): each read
    # (a stored budget's, every 2 s per budget; `budgets show`) logged "reachable again"
    # and the next hold "unreachable" again, a WARNING pair each time for as long as the
    # lock lasted. An outage is two lines (docs/budgets.md): it ends when a write succeeds.
    path = tmp_path / "ledger.db"
    ledger = SQLiteLedger(str(path), busy_timeout=0.2)
    try:
        assert await ledger.hold("b", BUDGET, Decimal(1)) is not None  # opens both
        other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        try:
            other.execute("BEGIN IMMEDIATE")  # another process's writer
            caplog.set_level(logging.DEBUG, logger="fallback_mw.budget")
            for _ in range(3):
                with pytest.raises(LedgerUnavailable):
                    await ledger.hold("b", BUDGET, Decimal(1))
                assert (await ledger.status("b", BUDGET)).held == Decimal(1)  # reads answer
                assert await ledger.stored_budget("b") is None
            other.execute("COMMIT")
        finally:
            other.close()
        assert await ledger.hold("b", BUDGET, Decimal(1)) is not None
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert warnings == [
            "SQLite ledger unreachable (OperationalError): budgeted routes refuse (fail closed)",
            "SQLite ledger reachable again",
        ]
    finally:
        await ledger.aclose()
