"""Multi-stage plans (SPEC §5): exact sequential order, the ceiling as the global bound,
`random` visiting each candidate at most once per pass, per-candidate model mapping."""

from __future__ import annotations

import json
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import httpx
import pytest
from aiohttp import web

from fallback_mw import Gateway
from fallback_mw.config import MAX_PLAN_LENGTH, ConfigError, RouteConfig, load_config
from fallback_mw.plan import candidate_order
from tests.helpers import client_for
from tests.upstreams import Upstream, host_app, upstream

NO_BREAKER = {"min_calls": 10_000, "window": 10_000}  # these tests are about order only


def recording(
    name: str, status: int, calls: list[str]
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handle(request: web.Request) -> web.StreamResponse:
        calls.append(name)
        return web.Response(status=status, body=f"from {name}".encode())

    return handle


@asynccontextmanager
async def plan_gateway(
    statuses: list[int], calls: list[str], **route: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, dict[str, Upstream]]]:
    names = [f"c{i}" for i in range(len(statuses))]
    async with AsyncExitStack() as stack:
        upstreams = {
            name: await stack.enter_async_context(upstream(recording(name, status, calls)))
            for name, status in zip(names, statuses, strict=True)
        }
        route_config: dict[str, Any] = {
            "id": "r",
            "prefix": "/v1/",
            "plan": names,
            "retries": len(names) - 1,
            "backoff_ms": 0,
        }
        route_config.update(route)
        gateway = Gateway(
            host_app,
            config={
                "gateway": {"breaker": NO_BREAKER},
                "upstreams": {name: {"url": up.url} for name, up in upstreams.items()},
                "routes": [route_config],
            },
        )
        stack.push_async_callback(gateway.aclose)
        client = await stack.enter_async_context(client_for(gateway))
        yield client, upstreams


@pytest.mark.anyio
async def test_429_429_200_is_served_by_the_third_in_exact_order() -> None:
    calls: list[str] = []
    async with plan_gateway(
        [429, 429, 200], calls, retries=2, failover_status=[429, 502, 503, 504]
    ) as (client, _):
        response = await client.get("/v1/chat")
        assert response.status_code == 200
        assert response.text == "from c2"
        assert response.headers["x-gateway-provider"] == "c2"
        assert response.headers["x-gateway-attempts"] == "3"
    assert calls == ["c0", "c1", "c2"]


@pytest.mark.anyio
async def test_429_outside_failover_status_is_served_as_is() -> None:
    calls: list[str] = []
    async with plan_gateway([429, 429, 200], calls, retries=2) as (client, _):
        response = await client.get("/v1/chat")
        assert response.status_code == 429
        assert response.headers["x-gateway-provider"] == "c0"
    assert calls == ["c0"]


@pytest.mark.anyio
async def test_the_longest_plan_progresses_in_order() -> None:
    calls: list[str] = []
    statuses = [503] * (MAX_PLAN_LENGTH - 1) + [200]
    async with plan_gateway(statuses, calls) as (client, _):
        response = await client.get("/v1/chat")
        assert response.status_code == 200
        assert response.headers["x-gateway-attempts"] == str(MAX_PLAN_LENGTH)
    assert calls == [f"c{i}" for i in range(MAX_PLAN_LENGTH)]


def test_a_plan_longer_than_the_bound_is_refused() -> None:
    names = [f"c{i}" for i in range(MAX_PLAN_LENGTH + 1)]
    with pytest.raises(ConfigError, match="plan"):
        load_config(
            {
                "upstreams": {name: {"url": "http://127.0.0.1:9"} for name in names},
                "routes": [{"id": "r", "prefix": "/", "plan": names, "retries": 10}],
            }
        )


@pytest.mark.anyio
async def test_an_all_failing_plan_stops_at_the_ceiling_with_backoff_on_repeats() -> None:
    calls: list[str] = []
    async with plan_gateway([503, 502, 503], calls, retries=4, backoff_ms=40) as (client, _):
        started = time.monotonic()
        response = await client.get("/v1/chat")
        elapsed = time.monotonic() - started
        assert response.status_code == 502
        error = response.json()["error"]
        assert error["code"] == "upstream_failed"
        assert error["attempts"] == 5
        assert response.headers["x-gateway-attempts"] == "5"
    assert calls == ["c0", "c1", "c2", "c0", "c1"]
    assert elapsed >= 0.08  # backoff before each of the two repeats, none before the first pass


def test_random_keeps_the_first_candidate_first_and_draws_the_rest() -> None:
    route = RouteConfig(
        id="r", prefix="/", plan=("a", "b", "c", "d", "e"), strategy="random", retries=4
    )
    seen = set()
    for seed in range(300):
        rng = random.Random(seed)
        for canary, pinned in ((False, None), (True, None), (False, "d")):
            order = candidate_order(route, canary=canary, pinned=pinned, rng=rng)
            assert sorted(order) == sorted(route.plan)
            # The head is the plan's first, the canary (the plan's second) or the pin.
            assert order[0] == (pinned or ("b" if canary else "a"))
        order = candidate_order(route, rng=random.Random(seed))
        assert order[0] == "a"
        seen.add(tuple(order))
    assert len(seen) == 24  # every order of the four fallbacks: actually random


@pytest.mark.anyio
async def test_random_never_repeats_a_candidate_in_a_pass() -> None:
    calls: list[str] = []
    async with plan_gateway([503] * 5, calls, strategy="random") as (client, _):
        orders = set()
        for _ in range(25):
            calls.clear()
            response = await client.get("/v1/chat")
            assert response.status_code == 502
            assert sorted(calls) == ["c0", "c1", "c2", "c3", "c4"]
            assert calls[0] == "c0"  # RAND keeps the primary first
            orders.add(tuple(calls))
        assert len(orders) > 1


@pytest.mark.anyio
async def test_random_with_a_second_pass_repeats_only_after_the_whole_pass() -> None:
    calls: list[str] = []
    async with plan_gateway([503] * 3, calls, strategy="random", retries=5) as (client, _):
        for _ in range(10):
            calls.clear()
            await client.get("/v1/chat")
            assert len(calls) == 6
            assert sorted(calls[:3]) == sorted(calls[3:]) == ["c0", "c1", "c2"]
            assert calls[0] == calls[3] == "c0"


@pytest.mark.anyio
async def test_each_candidate_gets_its_own_model() -> None:
    bodies: dict[str, Any] = {}

    def model_handler(name: str, status: int) -> Any:
        async def handle(request: web.Request) -> web.StreamResponse:
            bodies[name] = json.loads(await request.read())
            return web.Response(status=status, body=name.encode())

        return handle

    async with (
        upstream(model_handler("a", 503)) as a,
        upstream(model_handler("b", 503)) as b,
        upstream(model_handler("c", 200)) as c,
    ):
        gateway = Gateway(
            host_app,
            config={
                "upstreams": {
                    "a": {"url": a.url},
                    "b": {"url": b.url, "model": "model-b"},
                    "c": {"url": c.url, "model": "model-c"},
                },
                "routes": [
                    {
                        "id": "r",
                        "prefix": "/v1/",
                        "plan": ["a", "b", "c"],
                        "retries": 2,
                        "replayable_methods": ["POST"],
                    }
                ],
            },
        )
        try:
            async with client_for(gateway) as client:
                response = await client.post(
                    "/v1/chat", json={"model": "caller-model", "messages": [], "n": 1}
                )
        finally:
            await gateway.aclose()
    assert response.text == "c"
    assert bodies["a"] == {"model": "caller-model", "messages": [], "n": 1}
    assert bodies["b"] == {"model": "model-b", "messages": [], "n": 1}
    assert bodies["c"] == {"model": "model-c", "messages": [], "n": 1}
