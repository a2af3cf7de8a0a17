"""Credential pool rules (SPEC §6) that hand-made mutants showed no other test held: a
request uses each pool credential at most once, also when its session is bound to the
credential it already used and that credential is usable again; a 401 retires a key for
good, whatever shorter mark comes after it. Through the whole gateway
against a real upstream server, on the memory state and on the real Redis."""

from __future__ import annotations

import pytest
from aiohttp import web

from fallback_mw import Gateway
from fallback_mw.health.memory import MemoryHealth
from tests.helpers import client_for
from tests.upstreams import host_app, status_handler, upstream

pytestmark = pytest.mark.anyio

ENV = {"KEY_A": "key-a", "KEY_B": "key-b"}


@pytest.fixture(params=["memory", "redis"])
def state(request: pytest.FixtureRequest) -> str:
    if request.param == "memory":
        return "memory://"
    url: str = request.getfixturevalue("redis_url")
    return url


async def test_a_session_bound_key_used_once_is_not_used_again_in_the_same_request(
    state: str,
) -> None:
    # The session is bound to key-a, which answers 503 and cools down for 1 ms; the other
    # upstream takes 50 ms to answer 503 too, and the walk's second pass comes back to the
    # pool. key-a is usable again by then, and the session is still bound to it, but this
    # request has used it: key-b.
    async def handler(request: web.Request) -> web.StreamResponse:
        key = request.headers.get("authorization", "").removeprefix("Bearer ")
        return web.Response(status=503 if key == "key-a" else 200, text=key)

    async with upstream(handler) as pool, upstream(status_handler(503, delay=0.05)) as other:
        conf = {
            "gateway": {
                "state": state,
                # The breaker stays closed: only the credential's own cool-down is at play.
                "breaker": {"cooldown_ms": 1, "min_calls": 100, "window": 100},
            },
            "upstreams": {
                "pool": {"url": pool.url, "auth_env": ["KEY_A", "KEY_B"]},
                "other": {"url": other.url},
            },
            "routes": [{"id": "r", "prefix": "/v1/", "plan": ["pool", "other"], "retries": 2,
                        "backoff_ms": 0}],
        }  # fmt: skip
        gateway = Gateway(host_app, config=conf, environ=ENV)
        try:
            async with client_for(gateway) as client:
                response = await client.get("/v1/x", headers={"x-session-id": "s1"})
        finally:
            await gateway.aclose()
    assert (response.status_code, response.text) == (200, "key-b")
    assert response.headers["x-gateway-attempts"] == "3"
    keys = [dict(r.headers)["authorization"] for r in pool.received]
    assert keys == ["Bearer key-a", "Bearer key-b"]


async def test_a_late_short_cool_down_never_brings_a_retired_key_back() -> None:
    # key-a was retired by a 401; a request that used it at the same time then hears a 429
    # with `Retry-After: 0` (it went out before the 401 came back). The shorter mark
    # replaced the retirement: the revoked key was asked again at once, and for good.
    health = MemoryHealth()

    async def handler(request: web.Request) -> web.StreamResponse:
        key = request.headers.get("authorization", "").removeprefix("Bearer ")
        return web.Response(status=401 if key == "key-a" else 200, text=key)

    await health.pick_credential("pool", 2, exclude=frozenset(), session=None)
    for status, retry_after in ((401, None), (429, 0.0)):
        await health.credential_result(
            "pool", 0, status=status, failure=False, retry_after=retry_after, session=None
        )
    async with upstream(handler) as pool:
        conf = {
            "upstreams": {"pool": {"url": pool.url, "auth_env": ["KEY_A", "KEY_B"]}},
            "routes": [{"id": "r", "prefix": "/v1/", "plan": ["pool"], "retries": 1}],
        }
        gateway = Gateway(host_app, config=conf, environ=ENV, health=health)
        try:
            async with client_for(gateway) as client:
                answers = [(await client.get("/v1/x")).text for _ in range(3)]
        finally:
            await gateway.aclose()
    assert answers == ["key-b"] * 3
    assert pool.count == 3
