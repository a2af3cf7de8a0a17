"""A half-open breaker admits one probe at a time (SPEC §6), and an admission that proves
nothing of the upstream gives its slot back at once: an attempt the walk deadline ended
(a local outcome, never booked against the upstream), and an admission declared capacity
then refused. Held instead, the slot kept the upstream skipped as `breaker_open` for the
probe's whole lease (30 s and more) with nothing in flight. Each test kills a hand-made
mutant no other test did. Real upstream servers, in-process gateway."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp import web

from tests.helpers import gateway_client
from tests.upstreams import Upstream, status_handler, upstream

pytestmark = pytest.mark.anyio

# Opens on one failure; half-open 50 ms later.
BREAKER = {"window": 1, "min_calls": 1, "cooldown_ms": 50}


def config(primary: Upstream, backup: Upstream) -> dict[str, Any]:
    return {
        "gateway": {"breaker": BREAKER},
        "upstreams": {"primary": {"url": primary.url}, "backup": {"url": backup.url}},
        "routes": [{"id": "r", "prefix": "/v1/", "plan": ["primary", "backup"], "retries": 1}],
    }


async def test_a_probe_the_callers_deadline_ended_frees_its_slot() -> None:
    arrivals = 0

    async def primary_handler(request: web.Request) -> web.StreamResponse:
        nonlocal arrivals
        arrivals += 1
        if arrivals == 1:
            return web.Response(status=503)  # opens the breaker
        if arrivals == 2:
            await asyncio.sleep(2)  # the probe, cut by the caller's 150 ms deadline
        return web.Response(body=b"primary")

    async with (
        upstream(primary_handler) as primary,
        upstream(status_handler(200, b"backup")) as backup,
        gateway_client(config(primary, backup)) as client,
    ):
        assert (await client.get("/v1/x")).text == "backup"
        await asyncio.sleep(0.1)  # half-open
        cut = await client.get("/v1/x", headers={"x-gateway-deadline-ms": "150"})
        assert cut.status_code == 504, cut.text
        # The deadline was the caller's: nothing proven of the primary, its slot is free.
        response = await client.get("/v1/x")
    assert (response.status_code, response.text) == (200, "primary")
    assert "x-gateway-skipped" not in response.headers
    assert (primary.count, backup.count) == (3, 1)


async def test_an_admission_capacity_refused_frees_the_probe_slot() -> None:
    # The primary declares rpm = 1, spent by the request that opened its breaker. Once
    # half-open, each request's admission is refused by capacity: skipped for `capacity`,
    # never for `breaker_open` (no probe is in flight).
    async with (
        upstream(status_handler(503)) as primary,
        upstream(status_handler(200, b"backup")) as backup,
    ):
        conf = config(primary, backup)
        conf["upstreams"]["primary"]["rpm"] = 1
        async with gateway_client(conf) as client:
            assert (await client.get("/v1/x")).text == "backup"
            await asyncio.sleep(0.1)  # half-open
            skipped = []
            for _ in range(2):
                response = await client.get("/v1/x")
                assert response.text == "backup"
                skipped.append(response.headers["x-gateway-skipped"])
    assert skipped == ["primary;reason=capacity"] * 2
    assert (primary.count, backup.count) == (1, 3)
