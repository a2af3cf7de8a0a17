"""A shared cache in front of the gateway (a CDN, nginx's proxy_cache, Varnish) keys a
stored answer by its URL and the request fields its `Vary` names (RFC 9111 §4.1). Where the
tenant header chooses the route, and so the upstream, the gateway's answer varies by that
header: without it in `Vary`, one tenant's cached answer (its dedicated deployment's
catalogue, marked `Cache-Control: public`) was served to every other tenant. A canary
slice chooses the candidate by the session header: its answers vary by that one."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp import web

from tests.helpers import gateway_client
from tests.upstreams import upstream

pytestmark = pytest.mark.anyio


def cacheable(owner: bytes) -> Any:
    async def handle(request: web.Request) -> web.StreamResponse:
        fields = {"cache-control": "public, max-age=300", "etag": '"v1"', "vary": "Accept"}
        if request.headers.get("if-none-match") == '"v1"':
            return web.Response(status=304, headers=fields)
        return web.Response(status=200, body=owner, headers=fields)

    return handle


def conf(acme: str, shared: str) -> dict[str, Any]:
    return {
        "gateway": {"tenant_header": "X-Tenant-ID"},
        "upstreams": {"acme": {"url": acme}, "shared": {"url": shared}},
        "routes": [
            {"id": "acme", "prefix": "/v1/", "tenant": "acme", "plan": ["acme"]},
            {"id": "shared", "prefix": "/v1/", "plan": ["shared"]},
            {"id": "other", "prefix": "/v2/", "plan": ["shared"]},
        ],
    }


def vary(response: Any) -> list[str]:
    return [
        item.strip().lower()
        for value in response.headers.get_list("vary")
        for item in value.split(",")
    ]


async def test_an_answer_the_tenant_header_chose_says_it_varies_by_it() -> None:
    async with (
        upstream(cacheable(b"acme's")) as a,
        upstream(cacheable(b"everyone's")) as s,
        gateway_client(conf(a.url, s.url)) as client,
    ):
        acme = await client.get("/v1/catalog", headers={"x-tenant-id": "acme"})
        other = await client.get("/v1/catalog", headers={"x-tenant-id": "globex"})
        revalidated = await client.get(
            "/v1/catalog", headers={"x-tenant-id": "acme", "if-none-match": '"v1"'}
        )
        untouched = await client.get("/v2/catalog", headers={"x-tenant-id": "acme"})
    assert (acme.content, other.content) == (b"acme's", b"everyone's")
    for response in (acme, other, revalidated):
        assert vary(response) == ["accept", "x-tenant-id"], response.headers
        assert len(response.headers.get_list("vary")) == 1  # one field, as caches read it
    assert revalidated.status_code == 304
    # No route of another tenant can take /v2/: its answer varies by nothing new.
    assert vary(untouched) == ["accept"]


async def test_a_canary_routes_answer_says_it_varies_by_the_session_header() -> None:
    async with (
        upstream(cacheable(b"stable")) as a,
        upstream(cacheable(b"canary")) as s,
    ):
        config = {
            "upstreams": {"stable": {"url": a.url}, "canary": {"url": s.url}},
            "routes": [
                {"id": "c", "prefix": "/v1/", "plan": ["stable", "canary"], "retries": 1,
                 "canary_eligible": True, "canary_percent": 100.0},
                {"id": "plain", "prefix": "/v2/", "plan": ["stable", "canary"], "retries": 1},
            ],
        }  # fmt: skip
        async with gateway_client(config) as client:
            canary = await client.get("/v1/catalog", headers={"x-session-id": "s1"})
            sessionless = await client.get("/v1/catalog")
            plain = await client.get("/v2/catalog", headers={"x-session-id": "s1"})
    assert (canary.content, sessionless.content) == (b"canary", b"stable")
    assert canary.headers["x-gateway-canary"] == "1"
    assert vary(canary) == vary(sessionless) == ["accept", "x-session-id"]
    assert vary(plain) == ["accept"]


async def test_a_tenant_header_spelled_with_underscores_is_named_as_it_came() -> None:
    # The gateway reads `x_tenant_id` as `x-tenant-id` (WSGI-style upstreams do too): a
    # cache keying by `x-tenant-id` alone stored acme's answer under "no tenant header"
    # and served it to every caller sending none.
    async with (
        upstream(cacheable(b"acme's")) as a,
        upstream(cacheable(b"everyone's")) as s,
        gateway_client(conf(a.url, s.url)) as client,
    ):
        spelled = await client.get("/v1/catalog", headers={"x_tenant_id": "acme"})
        plain = await client.get("/v1/catalog")
    assert (spelled.content, plain.content) == (b"acme's", b"everyone's")
    assert vary(spelled) == ["accept", "x-tenant-id", "x_tenant_id"], spelled.headers
    assert len(spelled.headers.get_list("vary")) == 1
    assert vary(plain) == ["accept", "x-tenant-id"]
