"""A host that cancels the request's task (serve's `--timeout-graceful-shutdown` cutting a
stream in flight; a host that cancels on disconnect) ends the request as `cancelled` in
its log line and usage record: the gateway did not fail, and it is not `internal_error`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from decimal import Decimal
from typing import Any

import anyio
import pytest
from aiohttp import web

from fallback_mw import Gateway
from fallback_mw.config import BudgetConfig
from fallback_mw.request.types import Message
from fallback_mw.store.ledgers.memory import MemoryLedger
from tests.upstreams import host_app, upstream

SCOPE = {
    "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
    "scheme": "http", "path": "/v1/chat", "raw_path": b"/v1/chat", "query_string": b"",
    "root_path": "", "headers": [(b"host", b"gw")], "client": ("127.0.0.1", 1),
    "server": ("127.0.0.1", 80),
}  # fmt: skip


def outcomes(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage().split("outcome=")[1].split()[0]
        for r in caplog.records
        if r.name == "fallback_mw.request"
    ]


@pytest.mark.anyio
@pytest.mark.parametrize("budget", [False, True], ids=["plain", "budgeted"])
@pytest.mark.parametrize("committed", [True, False], ids=["mid-stream", "before-the-head"])
async def test_a_request_the_host_cancels_is_recorded_as_cancelled(
    caplog: pytest.LogCaptureFixture, budget: bool, committed: bool
) -> None:
    reached = asyncio.Event()  # the moment to cancel: mid-stream, or waiting for the head

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        if committed:
            await response.prepare(request)
            await response.write(b'data: {"n": 0}\n\n')
        else:
            reached.set()
        await asyncio.sleep(60)  # never ends in time
        return response

    requested = False

    async def receive() -> Message:
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await asyncio.sleep(3600)  # the client never leaves: the host cancels
        raise AssertionError("unreachable")

    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)
        if message["type"] == "http.response.body":
            reached.set()

    async with upstream(handler) as primary:
        route: dict[str, Any] = {"id": "r", "prefix": "/v1/", "plan": ["a"]}
        config: dict[str, Any] = {
            "gateway": {"deadline_ms": 60000},
            "upstreams": {"a": {"url": primary.url, "first_byte_timeout_ms": 60000}},
            "routes": [route],
        }
        ledger = MemoryLedger()
        if budget:
            route["budget"] = "acme"
            config["budgets"] = {"acme": {"limit": 1, "window": "month", "default_hold": 0.01}}
        gateway = Gateway(host_app, config=config, ledger=ledger)
        try:
            with caplog.at_level(logging.INFO, logger="fallback_mw.request"):
                task = asyncio.create_task(gateway(dict(SCOPE), receive, send))
                with anyio.fail_after(5):
                    await reached.wait()
                task.cancel()
                with anyio.fail_after(5), pytest.raises(asyncio.CancelledError):
                    await task
            assert outcomes(caplog) == ["cancelled"]
            assert any(m["type"] == "http.response.start" for m in sent) is committed
            if budget:
                (record,) = await ledger.usage()
                assert record.outcome == "cancelled"
                status = await ledger.status("acme", BudgetConfig.model_validate(
                    config["budgets"]["acme"]
                ))  # fmt: skip
                # Cut mid-stream: charged the hold; cut before any answer: released.
                assert status.spent == (Decimal("0.01") if committed else Decimal(0))
                assert status.held == 0
        finally:
            await gateway.aclose()


@pytest.mark.anyio
async def test_a_cancel_that_lands_while_the_ledger_writes_leaves_nothing_held(
    ledger_store: str,
) -> None:
    # A host cancelling the request (a client gone behind a cancelling middleware, a stop's
    # graceful timeout) while the guard waited for the ledger: a hold the ledger had
    # already written was never learnt by the guard, and a settlement waiting for its
    # group (SQLite) or in flight (PostgreSQL) was dropped, so 0.01 stayed HELD for an hour
    # and was then charged as spent (for a request no upstream saw, or one served). Cancelled
    # at every turn of the request in turn, nothing stays held.
    from tests.test_budget_guard import gateway_config

    async def answer(request: web.Request) -> web.StreamResponse:
        return web.Response(text="ok")

    async with upstream(answer) as primary:
        conf = gateway_config({"primary": primary.url}, store=ledger_store, limit="1")
        gateway = Gateway(host_app, config=conf)
        ledger = gateway.services.ledger
        assert ledger is not None
        budget = BudgetConfig(limit=Decimal(1), window="month")
        try:
            await ledger.status("acme", budget)  # opened
            for turns in range(60):
                delivered = False

                async def receive() -> Message:
                    nonlocal delivered
                    if not delivered:
                        delivered = True
                        return {"type": "http.request", "body": b"{}", "more_body": False}
                    await asyncio.sleep(30)
                    return {"type": "http.disconnect"}

                async def send(message: Message) -> None:
                    return None

                scope = {**SCOPE, "method": "POST"}
                task = asyncio.ensure_future(gateway(scope, receive, send))
                for _ in range(turns):
                    await asyncio.sleep(0)
                task.cancel()  # a request already done (many turns) is not cancelled
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            for _ in range(200):  # a release left behind is written on a later turn
                held = (await ledger.status("acme", budget)).held
                if held == 0:
                    break
                await asyncio.sleep(0.05)
            assert held == 0
        finally:
            await gateway.aclose()
