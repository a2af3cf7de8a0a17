"""The Redis health state under load: 200 requests in flight share one bounded pool and
never fall back to local state while Redis is up (the pool waits, it does not fail)."""

from __future__ import annotations

import asyncio
import logging

import pytest
from aiohttp import web

from fallback_mw import Gateway
from fallback_mw.health.redis import RedisHealth
from tests.helpers import client_for
from tests.upstreams import host_app, upstream

pytestmark = pytest.mark.anyio


async def test_200_concurrent_requests_keep_the_breakers_shared(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="fallback_mw.health")

    async def slow_ok(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(0.2)  # keep all 200 in flight at once
        return web.Response(body=b"ok")

    async with upstream(slow_ok) as primary, upstream(slow_ok) as backup:
        conf = {
            "gateway": {"state": redis_url, "deadline_ms": 60_000},
            "upstreams": {
                "primary": {"url": primary.url, "first_byte_timeout_ms": 60_000},
                "backup": {"url": backup.url},
            },
            "routes": [{"id": "r", "prefix": "/v1/", "plan": ["primary", "backup"],
                        "retries": 1}],
        }  # fmt: skip
        # A generous socket timeout: on a loaded 2-core test machine 200 requests in one
        # event loop can delay a reply past the default 0.5 s; what is tested here is the
        # pool (redis-py's default one failed at once past 100 connections).
        health = RedisHealth(redis_url, socket_timeout=5.0)
        gateway = Gateway(host_app, config=conf, health=health)
        try:
            async with client_for(gateway) as client:
                client.timeout = 120
                responses = await asyncio.gather(*(client.get("/v1/x") for _ in range(200)))
        finally:
            await gateway.aclose()
    assert [r.status_code for r in responses] == [200] * 200
    assert primary.count == 200
    assert health.local_fallback_calls == 0  # not one call served on local state
    assert not [r for r in caplog.records if "unreachable" in r.getMessage()]
