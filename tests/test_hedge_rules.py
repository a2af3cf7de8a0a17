"""Which attempt may be hedged, and which head wins a race (`failover.replay.may_hedge`,
`failover.outcome.fails_in_a_race`): only the walk's first attempt, at the plan's first
candidate, of a request that can be repeated; an answer outside `failover_status` from an upstream
without a credential pool (a 429) wins the race and is served as-is (SPEC §5). Each test
here kills a hand-made mutant no other test did. Real upstream servers, in-process gateway."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp import web

from fallback_mw import load_config
from fallback_mw.failover.replay import may_hedge
from tests.helpers import gateway_client
from tests.upstreams import Upstream, status_handler, upstream

pytestmark = pytest.mark.anyio


def config(primary: Upstream, backup: Upstream, **route: Any) -> dict[str, Any]:
    route_config: dict[str, Any] = {
        "id": "r",
        "prefix": "/v1/",
        "plan": ["primary", "backup"],
        "retries": 2,
        "backoff_ms": 0,
        "hedge_after_ms": 100,
    }
    route_config.update(route)
    return {
        "upstreams": {"primary": {"url": primary.url}, "backup": {"url": backup.url}},
        "routes": [route_config],
    }


async def test_a_429_without_a_pool_wins_the_race_and_is_served_as_is() -> None:
    # The first attempt is answered 429 while the hedge still waits. Outside a credential
    # pool a 429 is an answer like a 400 (not failover_status): it wins, and the caller gets
    # it. Taken for a pool key's refusal, it was finished as a failure and the hedge's
    # later 200 served instead.
    hedge_arrived = asyncio.Event()
    arrivals = 0

    async def primary_handler(request: web.Request) -> web.StreamResponse:
        nonlocal arrivals
        arrivals += 1
        if arrivals == 1:
            await asyncio.wait_for(hedge_arrived.wait(), timeout=10)
            return web.Response(status=429, body=b"slow down", headers={"retry-after": "3"})
        hedge_arrived.set()
        await asyncio.sleep(0.5)
        return web.Response(body=b"hedge")

    async with (
        upstream(primary_handler) as primary,
        upstream(status_handler(200, b"backup")) as backup,
        gateway_client(config(primary, backup, hedge_after_ms=50)) as client,
    ):
        response = await client.get("/v1/x")
    assert (response.status_code, response.text) == (429, "slow down")
    assert response.headers["retry-after"] == "3"
    assert response.headers["x-gateway-attempts"] == "2"
    assert (primary.count, backup.count) == (2, 0)


async def test_no_hedge_when_the_walk_comes_back_to_the_primary() -> None:
    # Primary 503, backup 503, then the primary again (retries 3): that third attempt is
    # slow but is no longer the walk's first, so it is not hedged.
    arrivals = 0

    async def primary_handler(request: web.Request) -> web.StreamResponse:
        nonlocal arrivals
        arrivals += 1
        if arrivals == 1:
            return web.Response(status=503)
        await asyncio.sleep(0.5)
        return web.Response(body=b"late but fine")

    async with (
        upstream(primary_handler) as primary,
        upstream(status_handler(503)) as backup,
        gateway_client(config(primary, backup, retries=3)) as client,
    ):
        response = await client.get("/v1/x")
    assert (response.status_code, response.text) == (200, "late but fine")
    assert response.headers["x-gateway-attempts"] == "3"
    assert (primary.count, backup.count) == (2, 1)


async def test_no_hedge_at_the_fallback_when_the_primary_is_skipped() -> None:
    # The primary's breaker opens on the first request (one failure in one call); on the
    # second the primary is skipped and the walk's first attempt goes to the backup, which
    # is slow: a hedge races a second attempt at the primary only, never at a fallback.
    backup_arrivals = 0

    async def backup_handler(request: web.Request) -> web.StreamResponse:
        nonlocal backup_arrivals
        backup_arrivals += 1
        if backup_arrivals > 1:
            await asyncio.sleep(0.5)
        return web.Response(body=b"backup")

    async with (
        upstream(status_handler(503)) as primary,
        upstream(backup_handler) as backup,
    ):
        conf = config(primary, backup)
        conf["gateway"] = {"breaker": {"window": 1, "min_calls": 1, "cooldown_ms": 60_000}}
        async with gateway_client(conf) as client:
            first = await client.get("/v1/x")
            assert (first.text, first.headers["x-gateway-attempts"]) == ("backup", "2")
            response = await client.get("/v1/x")
    assert (response.status_code, response.text) == (200, "backup")
    assert response.headers["x-gateway-attempts"] == "1"
    assert response.headers["x-gateway-skipped"] == "primary;reason=breaker_open"
    assert (primary.count, backup.count) == (1, 2)


@pytest.mark.parametrize(
    "asked",
    [
        {"replayable": False},
        {"first_attempt": False},
        {"at_first_candidate": False},
    ],
)
def test_may_hedge_needs_each_of_its_conditions(asked: dict[str, bool]) -> None:
    # The walk also asks further_attempt_possible before it starts a hedge (a request that
    # cannot be repeated never is): each condition here must hold on its own.
    primary, backup = Upstream(url="http://127.0.0.1:9"), Upstream(url="http://127.0.0.1:10")
    route = load_config(config(primary, backup)).routes[0]
    facts = {"replayable": True, "first_attempt": True, "at_first_candidate": True}
    assert may_hedge(route, **facts)
    assert not may_hedge(route, **(facts | asked))
