"""Requests cut at every point of their walk leave nothing behind. Concurrent requests
through the whole gateway (a credential pool, hedging, a shadow copy, declared rpm / tpm,
a connection cap of one, a budget) are cancelled by the host or left by their client after
each number of event-loop turns in turn, then after each few milliseconds (a hedge, a wait
for the connection). Once they have all ended, every count is back:
no hold held, no half-open probe slot taken, every connection slot free, no shadow copy
in flight, and each upstream's rpm counts exactly the attempts that left the gateway."""

from __future__ import annotations

import asyncio
import contextlib
import json
from decimal import Decimal

import pytest
from aiohttp import web

from fallback_mw import Gateway
from fallback_mw.config import BreakerConfig, BudgetConfig
from fallback_mw.health.memory import MemoryHealth
from fallback_mw.request.types import Message
from fallback_mw.store.ledgers.memory import MemoryLedger
from fallback_mw.upstream import make_client
from fallback_mw.upstream.base import UpstreamRequest, UpstreamResponse
from tests.helpers import http_scope
from tests.upstreams import host_app, upstream

pytestmark = pytest.mark.anyio

BUDGET = BudgetConfig(limit=Decimal(1000), window="month", default_hold=Decimal("0.01"))


class CountingClient:
    """The real engine, counting the attempts that took a connection slot (left the
    gateway) per upstream."""

    def __init__(self, engine: str) -> None:
        self.engine = make_client(engine, allow_hosts=("127.0.0.1",))
        self.sent: dict[str, int] = {}

    async def send(self, request: UpstreamRequest) -> UpstreamResponse:
        try:
            return await self.engine.send(request)
        finally:
            if request.slot_taken:
                name = request.pool_key.split(" ", 1)[0]
                self.sent[name] = self.sent.get(name, 0) + 1

    async def aclose(self) -> None:
        await self.engine.aclose()


@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
async def test_requests_cut_at_any_turn_leave_every_count_as_it_was(
    engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KEY_A", "a")
    monkeypatch.setenv("KEY_B", "b")
    arrivals = {"n": 0}

    async def primary_handler(request: web.Request) -> web.StreamResponse:
        arrivals["n"] += 1
        turn = arrivals["n"] % 4
        if turn == 0:
            return web.Response(status=503, body=b"busy")
        if turn in (1, 2):
            await asyncio.sleep(0.03)  # slow: hedged
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"x": 1}\n\n')
        await asyncio.sleep(0)
        usage = {"usage": {"prompt_tokens": 3, "completion_tokens": 4}}
        await response.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
        return response

    async def backup_handler(request: web.Request) -> web.StreamResponse:
        return web.json_response({"usage": {"prompt_tokens": 3, "completion_tokens": 4}})

    breaker = {"window": 8, "min_calls": 4, "cooldown_ms": 20}
    health = MemoryHealth(BreakerConfig(**breaker))
    ledger = MemoryLedger()
    client = CountingClient(engine)
    async with upstream(primary_handler) as primary, upstream(backup_handler) as backup:
        conf = {
            "gateway": {"deadline_ms": 2000, "session_header": "x-session-id",
                        "breaker": breaker},
            "upstreams": {
                "primary": {"url": primary.url, "auth_env": ["KEY_A", "KEY_B"],
                            "rpm": 100_000, "tpm": 10_000_000, "max_connections": 1},
                "backup": {"url": backup.url, "rpm": 100_000, "max_connections": 1},
            },
            "routes": [{"id": "r", "prefix": "/v1/", "plan": ["primary", "backup"],
                        "retries": 3, "backoff_ms": 1, "hedge_after_ms": 10,
                        "replayable_methods": ["POST"], "budget": "acme",
                        "shadow": "backup", "shadow_percent": 100}],
            "budgets": {"acme": {"limit": 1000, "window": "month", "default_hold": 0.01}},
        }  # fmt: skip
        gateway = Gateway(host_app, config=conf, health=health, ledger=ledger, client=client)
        try:

            async def request(turns: int, how: str, ms: float = 0.0) -> None:
                gone = asyncio.Event()
                asked = False

                async def receive() -> Message:
                    nonlocal asked
                    if not asked:
                        asked = True
                        body = b'{"model": "m", "max_tokens": 5}'
                        return {"type": "http.request", "body": body, "more_body": False}
                    await gone.wait()
                    return {"type": "http.disconnect"}

                async def send(message: Message) -> None:
                    await asyncio.sleep(0)

                scope = http_scope("POST", "/v1/chat", headers=[(b"x-session-id", b"s")])
                task = asyncio.ensure_future(gateway(scope, receive, send))
                for _ in range(turns):
                    await asyncio.sleep(0)
                await asyncio.sleep(ms)  # the time a hedge or a connection takes
                if how == "cancel":
                    task.cancel()
                elif how == "leave":
                    gone.set()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

            cuts = [(turns, 0.0) for turns in range(0, 100, 2)]
            cuts += [(0, ms / 1000) for ms in range(1, 60, 2)]
            for turns, ms in cuts:
                await asyncio.gather(
                    request(turns, "cancel", ms), request(turns + 1, "leave", ms),
                    request(turns, "", ms),
                )  # fmt: skip
            shadows = gateway.services.shadows
            for _ in range(500):
                if not shadows.in_flight:
                    break
                await asyncio.sleep(0.01)
            assert shadows.in_flight == 0 and shadows.bytes_in_flight == 0
            assert (await ledger.status("acme", BUDGET)).held == 0
            for name in ("primary", "backup"):
                breaker = health.breaker(name)
                assert breaker.state != "half_open" or breaker.probe_until is None, name
            caps = client.engine._caps._slots  # type: ignore[attr-defined]
            assert all(slots._value == size for (_, size), slots in caps.items())
            capacity = gateway.services.capacity._capacity  # type: ignore[attr-defined]
            counted = {name: rolling.totals[0] for name, rolling in capacity.items()}
            assert counted == client.sent
        finally:
            await gateway.aclose()
