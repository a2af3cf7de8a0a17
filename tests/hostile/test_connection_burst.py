"""The gateway does not DoS its own upstreams (SPEC §12): a per-upstream connection cap
(`max_connections`), a connect timeout that survives a dropped SYN (3 s by default), and a
wait for a connection slot that is the gateway's own (never a breaker mark).

A bounded version of the 500-connection half-failing load, on loopback, both engines: 300
concurrent callers through uvicorn; the primary fails every other request with 503; the
backup listens with a backlog of 16. With the backup capped at 16 connections the burst of
failovers queues in the gateway instead of overflowing the backup's listen queue: every
request is served and the backup's breaker records no failure."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from fallback_mw import Gateway
from fallback_mw.health.memory import MemoryHealth
from fallback_mw.upstream import Timeouts, UpstreamRequest, make_client
from tests.upstreams import host_app, serve_asgi

pytestmark = pytest.mark.anyio

ENGINES = ["aiohttp", "httpx"]
CALLERS = 300
BACKLOG = 16


class Server:
    def __init__(self, url: str) -> None:
        self.url = url
        self.in_flight = 0
        self.peak = 0
        self.served = 0


@asynccontextmanager
async def server(fail_every_other: bool, *, backlog: int = 128) -> AsyncIterator[Server]:
    counter = itertools.count()
    state = Server("")

    async def handle(request: web.Request) -> web.StreamResponse:
        state.in_flight += 1
        state.peak = max(state.peak, state.in_flight)
        try:
            await request.read()
            await asyncio.sleep(0.01)
            if fail_every_other and next(counter) % 2:
                return web.Response(status=503, text="busy")
            state.served += 1
            return web.Response(text="ok")
        finally:
            state.in_flight -= 1

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=backlog)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    state.url = f"http://127.0.0.1:{port}"
    try:
        yield state
    finally:
        await runner.cleanup()


def config(primary: str, backup: str, engine: str) -> dict[str, Any]:
    return {
        "gateway": {"allow_hosts": ["127.0.0.1"], "engine": engine, "deadline_ms": 60_000},
        "upstreams": {
            "primary": {"url": primary, "max_connections": 64},
            "backup": {"url": backup, "max_connections": BACKLOG},
        },
        "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary", "backup"],
                    "retries": 1, "failover_status": [503]}],
    }  # fmt: skip


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_failover_burst_opens_no_healthy_breaker(engine: str) -> None:
    async with (
        server(fail_every_other=True) as primary,
        server(fail_every_other=False, backlog=BACKLOG) as backup,
    ):
        gateway = Gateway(host_app, config=config(primary.url, backup.url, engine))
        try:
            async with (
                serve_asgi(gateway, backlog=4096) as base,
                aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=CALLERS),
                    timeout=aiohttp.ClientTimeout(total=120),
                ) as session,
            ):

                async def call(n: int) -> int:
                    async with session.get(f"{base}/v1/chat/{n}") as response:
                        await response.read()
                        return response.status

                statuses = await asyncio.gather(*(call(n) for n in range(CALLERS)))
            health = gateway.services.health
            assert isinstance(health, MemoryHealth)
            backup_breaker = health.breaker("backup")
        finally:
            await gateway.aclose()
    assert statuses == [200] * CALLERS
    assert backup_breaker.state == "closed"
    assert 1 not in backup_breaker.outcomes  # not one failure booked to the healthy backup
    assert backup.peak <= BACKLOG  # the cap held
    assert primary.peak <= 64


@pytest.mark.parametrize("engine", ENGINES)
async def test_the_cap_queues_in_the_gateway(engine: str) -> None:
    """Ten requests at an upstream capped at 2: never more than 2 at once, all answered."""
    client = make_client(engine, allow_hosts=("127.0.0.1",))
    timeouts = Timeouts(connect=3.0, first_byte=10.0, idle=10.0)
    async with server(fail_every_other=False) as target:

        async def fetch() -> bytes:
            request = UpstreamRequest(
                "GET", target.url + "/x", [], b"", timeouts, max_connections=2, pool_key="t"
            )
            response = await client.send(request)
            try:
                return b"".join([chunk async for chunk in response.iter_chunks()])
            finally:
                await response.aclose()

        try:
            bodies = await asyncio.gather(*(fetch() for _ in range(10)))
        finally:
            await client.aclose()
    assert bodies == [b"ok"] * 10
    assert target.peak <= 2


def test_the_defaults_survive_a_dropped_syn() -> None:
    from fallback_mw.config import UpstreamConfig

    upstream = UpstreamConfig(url="http://127.0.0.1:1")
    assert upstream.connect_timeout_ms == 3000  # Linux retransmits the first SYN after 1 s
    assert upstream.max_connections == 100
