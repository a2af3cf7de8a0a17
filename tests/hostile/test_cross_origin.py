"""A web page as the caller: the gateway authenticates nobody and injects the operator's
key, so an upstream's cross-origin permission (`Access-Control-Allow-Origin: *`, which
providers send because a page there spends only a key it holds) must not be relayed: it
let any page a caller's browser opened call the gateway and read the answers."""

from __future__ import annotations

import pytest
from aiohttp import web

from tests.helpers import gateway_client
from tests.upstreams import upstream

SECRET = "sk-operator-0123456789abcdef"
CORS = {
    "Access-Control-Allow-Origin": "*",
    "Access-Control-Allow-Credentials": "true",
    "Access-Control-Allow-Headers": "*",
    "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
    "Access-Control-Allow-Private-Network": "true",
    "Access-Control-Expose-Headers": "x-request-id",
    "Access-Control-Max-Age": "86400",
}


async def permissive(request: web.Request) -> web.StreamResponse:
    """A provider's API as browsers see it: every answer, the preflight's included,
    allows any origin."""
    status = 204 if request.method == "OPTIONS" else 200
    return web.Response(status=status, body=None if status == 204 else b"{}", headers=CORS)


@pytest.mark.anyio
@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
async def test_an_upstreams_cross_origin_permission_never_reaches_a_browser_with_the_key(
    engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPERATOR_KEY", SECRET)
    async with upstream(permissive) as keyed, upstream(permissive) as keyless:
        conf = {
            "gateway": {"engine": engine},
            "upstreams": {
                "keyed": {"url": keyed.url, "auth_env": "OPERATOR_KEY"},
                "keyless": {"url": keyless.url},
            },
            "routes": [
                {"id": "a", "prefix": "/a/", "plan": ["keyed"]},
                {"id": "b", "prefix": "/b/", "plan": ["keyless"]},
            ],
        }
        page = {"origin": "https://evil.example"}
        preflight = {
            **page,
            "access-control-request-method": "POST",
            "access-control-request-headers": "content-type",
            "access-control-request-private-network": "true",
        }
        async with gateway_client(conf) as client:
            answers = [
                await client.options("/a/v1/chat/completions", headers=preflight),
                await client.post("/a/v1/chat/completions", json={}, headers=page),
            ]
            bare = await client.post("/b/v1/chat/completions", json={}, headers=page)
    # The preflight and the request went to the keyed upstream, with the operator's key.
    assert [r.method for r in keyed.received] == ["OPTIONS", "POST"]
    assert all(("authorization", f"Bearer {SECRET}") in r.headers for r in keyed.received)
    for answer in answers:
        assert answer.status_code in (200, 204)
        relayed = [name for name in answer.headers if name.startswith("access-control-")]
        assert relayed == [], answer.headers
    # An upstream the gateway sent no key to: its answer is relayed as it is.
    assert bare.headers["access-control-allow-origin"] == "*"
    assert bare.headers["access-control-allow-private-network"] == "true"


@pytest.mark.anyio
async def test_the_readmes_cors_middleware_still_answers_the_origins_it_allows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """README: a host that serves browsers puts Starlette's CORSMiddleware in front of the
    gateway. Its policy decides: the origin it allows gets its headers, another none,
    whatever the upstream allowed."""
    from starlette.applications import Starlette
    from starlette.middleware.cors import CORSMiddleware

    from fallback_mw import Gateway
    from tests.helpers import client_for

    monkeypatch.setenv("OPERATOR_KEY", SECRET)
    async with upstream(permissive) as keyed:
        conf = {
            "upstreams": {"keyed": {"url": keyed.url, "auth_env": "OPERATOR_KEY"}},
            "routes": [{"id": "a", "prefix": "/v1/", "plan": ["keyed"]}],
        }
        app = Starlette()
        app.add_middleware(Gateway, config=conf)
        app.add_middleware(
            CORSMiddleware, allow_origins=["https://app.example.com"], allow_methods=["*"]
        )
        async with client_for(app) as client:
            allowed = await client.post(
                "/v1/chat/completions", json={}, headers={"origin": "https://app.example.com"}
            )
            other = await client.post(
                "/v1/chat/completions", json={}, headers={"origin": "https://evil.example"}
            )
    assert allowed.status_code == other.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == "https://app.example.com"
    assert "access-control-allow-origin" not in other.headers
    assert "access-control-allow-private-network" not in allowed.headers
