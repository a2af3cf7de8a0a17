"""One hold and one settlement per request (SPEC §7), also when the host cancels the
request with anyio's cancel scope (level-triggered: every await inside it is cancelled
again, as Starlette's and hypercorn's task groups cancel a request), on the shipped
ledgers and on a ledger of one's own (`BudgetGuard(..., ledger=...)`, `Gateway(...,
ledger=...)`). The budget guard settles in a shielded `finally`; a hand-made mutant without
that shield passed every test (they cancel with asyncio's one-shot `Task.cancel`, use the
in-memory ledger, which never suspends, or the SQL ledgers, which shield their own
write): a ledger whose settlement awaits was cancelled at its first await, and the hold
stayed held."""

from __future__ import annotations

import asyncio
from decimal import Decimal
from pathlib import Path

import anyio
import pytest
from aiohttp import web

from fallback_mw import Gateway
from fallback_mw.budget import Hold
from fallback_mw.config import BudgetConfig
from fallback_mw.request.types import Message
from fallback_mw.store.ledgers import open_ledger
from fallback_mw.store.ledgers.memory import MemoryLedger
from tests.helpers import http_scope
from tests.upstreams import host_app, upstream

pytestmark = pytest.mark.anyio

BUDGET = BudgetConfig(limit=Decimal(10), window="month", default_hold=Decimal("0.25"))


class AwaitingLedger(MemoryLedger):
    """A ledger of one's own whose calls suspend (a remote store would)."""

    never_suspends = False

    async def settle(self, hold: Hold, amount: Decimal) -> None:
        await asyncio.sleep(0.01)
        await super().settle(hold, amount)

    async def release(self, hold: Hold) -> None:
        await asyncio.sleep(0.01)
        await super().release(hold)


@pytest.fixture(params=["sqlite", "postgresql", "own"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> str | None:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ledger.db'}"
    if request.param == "own":
        return None
    url: str = request.getfixturevalue("pg_url")
    return url


async def test_a_request_an_anyio_host_cancels_mid_stream_still_settles_its_hold(
    store: str | None,
) -> None:
    async def streaming(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"x": 1}\n\n')
        await asyncio.sleep(10)  # cut by the host long before
        return response

    started = anyio.Event()

    async def receive() -> Message:
        if not started.is_set():
            return {"type": "http.request", "body": b"{}", "more_body": False}
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    async def send(message: Message) -> None:
        if message["type"] == "http.response.body":
            started.set()  # the first chunk is relayed: mid-stream

    async with upstream(streaming) as primary:
        conf = {
            "gateway": {"store": store} if store else {},
            "upstreams": {"primary": {"url": primary.url}},
            "routes": [{"id": "r", "prefix": "/v1/", "plan": ["primary"], "budget": "acme"}],
            "budgets": {"acme": {"limit": 10, "window": "month", "default_hold": 0.25}},
        }
        own = AwaitingLedger() if store is None else None
        gateway = Gateway(host_app, config=conf, ledger=own)
        try:
            scope = http_scope("POST", "/v1/chat")
            async with anyio.create_task_group() as host:
                host.start_soon(gateway, scope, receive, send)
                with anyio.fail_after(10):
                    await started.wait()
                host.cancel_scope.cancel()
        finally:
            await gateway.aclose()
    ledger = own or open_ledger(store)
    try:
        status = await ledger.status("acme", BUDGET)
    finally:
        await ledger.aclose()
    # Cut short with no usage reported: charged the hold, and nothing is left held.
    assert (status.held, status.spent) == (Decimal(0), Decimal("0.25"))
