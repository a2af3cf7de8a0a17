"""A PostgreSQL that hangs (accepts, never answers) makes the ledger fail closed within its
timeout for every caller at once, not each after the callers queued before it; while it is
known to be away, calls fail at once; it is tried again once per retry interval and the
ledger recovers without a restart. The real PostgreSQL behind a pausable TCP proxy."""

from __future__ import annotations

import asyncio
import contextlib
import time
from decimal import Decimal
from urllib.parse import urlsplit, urlunsplit

import pytest

from fallback_mw.budget.ledger import LedgerUnavailable
from fallback_mw.config import BudgetConfig
from fallback_mw.store.ledgers.postgres import PostgresLedger
from tests.tcp_proxy import tcp_proxy

pytestmark = pytest.mark.anyio

BUDGET = BudgetConfig(limit=Decimal("100"), window="month", default_hold=Decimal("0.01"))


async def test_a_hung_database_refuses_every_caller_within_the_timeout(pg_url: str) -> None:
    parts = urlsplit(pg_url)
    async with tcp_proxy(parts.hostname or "127.0.0.1", parts.port or 5432) as proxy:
        port = proxy.port
        netloc = f"{parts.username}@127.0.0.1:{port}" if parts.username else f"127.0.0.1:{port}"
        url = urlunsplit((parts.scheme, netloc, parts.path, "", ""))
        ledger = PostgresLedger(url, timeout=0.4, retry_interval=0.5)
        try:
            assert await ledger.hold("acme", BUDGET, Decimal("0.01")) is not None

            proxy.pause()  # the database hangs
            started = time.monotonic()
            results = await asyncio.gather(
                *(ledger.hold("acme", BUDGET, Decimal("0.01")) for _ in range(30)),
                return_exceptions=True,
            )
            waited = time.monotonic() - started
            assert all(isinstance(r, LedgerUnavailable) for r in results), results
            # Ten pooled connections, thirty callers: all refused within one timeout (each
            # after the ones queued before it, it took up to three).
            assert waited < 1.0, f"the last caller was refused after {waited:.2f} s"

            started = time.monotonic()
            with pytest.raises(LedgerUnavailable):
                await ledger.hold("acme", BUDGET, Decimal("0.01"))
            assert time.monotonic() - started < 0.2  # known to be away: refused at once

            proxy.resume()  # back
            for _ in range(40):
                await asyncio.sleep(0.1)
                with contextlib.suppress(LedgerUnavailable):
                    if await ledger.hold("acme", BUDGET, Decimal("0.01")) is not None:
                        break
            else:
                raise AssertionError("the ledger did not recover")
        finally:
            await ledger.aclose()
