"""A PostgreSQL that hangs (accepts, never answers) makes the ledger fail closed within its
timeout for every caller at once, not each after the callers queued before it; while it is
known to be away, calls fail at once; it is tried again once per retry interval and the
ledger recovers without a restart. The real PostgreSQL behind a pausable TCP proxy."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from decimal import Decimal
from urllib.parse import urlsplit, urlunsplit

import pytest

from fallback_mw.budget.ledger import LedgerUnavailable
from fallback_mw.config import BudgetConfig
from fallback_mw.store.ledgers.postgres import PostgresLedger

pytestmark = pytest.mark.anyio

BUDGET = BudgetConfig(limit=Decimal("100"), window="month", default_hold=Decimal("0.01"))


class PausableProxy:
    """Forwards to (host, port) until paused; paused, it holds every byte (a hung server)."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.running = asyncio.Event()
        self.running.set()
        self.tasks: set[asyncio.Task[None]] = set()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.CancelledError):
            while data := await reader.read(65536):
                await self.running.wait()
                writer.write(data)
                await writer.drain()
        writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self.running.wait()
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        for task in (self._pipe(reader, up_writer), self._pipe(up_reader, writer)):
            started = asyncio.ensure_future(task)
            self.tasks.add(started)
            started.add_done_callback(self.tasks.discard)

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[int]:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        try:
            yield server.sockets[0].getsockname()[1]
        finally:
            server.close()
            for task in list(self.tasks):
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)


async def test_a_hung_database_refuses_every_caller_within_the_timeout(pg_url: str) -> None:
    parts = urlsplit(pg_url)
    proxy = PausableProxy(parts.hostname or "127.0.0.1", parts.port or 5432)
    async with proxy.serving() as port:
        netloc = f"{parts.username}@127.0.0.1:{port}" if parts.username else f"127.0.0.1:{port}"
        url = urlunsplit((parts.scheme, netloc, parts.path, "", ""))
        ledger = PostgresLedger(url, timeout=0.4, retry_interval=0.5)
        try:
            assert await ledger.hold("acme", BUDGET, Decimal("0.01")) is not None

            proxy.running.clear()  # the database hangs
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

            proxy.running.set()  # back
            for _ in range(40):
                await asyncio.sleep(0.1)
                with contextlib.suppress(LedgerUnavailable):
                    if await ledger.hold("acme", BUDGET, Decimal("0.01")) is not None:
                        break
            else:
                raise AssertionError("the ledger did not recover")
        finally:
            await ledger.aclose()
