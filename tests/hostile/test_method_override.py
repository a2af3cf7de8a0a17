"""Method-override headers as an attacker uses them: `X-HTTP-Method-Override: DELETE` on a
POST, which Google's APIs, Rails, Express, Laravel and ASP.NET Core run as a DELETE. The
gateway judges a request by the method the upstream will act on."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp import web

from fallback_mw import Gateway
from tests.helpers import client_for
from tests.upstreams import host_app, upstream

pytestmark = pytest.mark.anyio


async def honours_override(request: web.Request) -> web.StreamResponse:
    """An upstream that acts on the override, as the frameworks above do (on any method)."""
    acted = request.method
    for name, value in request.headers.items():
        if name.lower().replace("_", "-") in (
            "x-http-method-override", "x-http-method", "x-method-override"
        ):  # fmt: skip
            acted = value.split(",")[0].strip().upper()
    status = 503 if request.app.get("fail") else 200
    return web.Response(status=status, text=f"acted {acted}")


def config(url: str, **route: Any) -> dict[str, Any]:
    return {
        "gateway": {"allow_hosts": ["127.0.0.1"]},
        "upstreams": {"primary": {"url": url}},
        "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"], **route}],
    }


@pytest.mark.parametrize(
    "field",
    [
        ("X-HTTP-Method-Override", "DELETE"),
        ("x-http-method-override", "delete"),
        ("X_HTTP_Method_Override", "DELETE"),
        ("X-HTTP-Method", "DELETE"),
        ("X-Method-Override", "DELETE"),
        ("X-HTTP-Method-Override", "DELETE, POST"),
    ],
    ids=["canonical", "lowercase", "underscores", "x-http-method", "x-method-override", "list"],
)
async def test_an_override_to_a_method_the_route_does_not_forward_is_405(
    field: tuple[str, str],
) -> None:
    # Before: a route that forwards only GET and POST (the completions slice of an API,
    # the provider's credential injected) let a caller DELETE through it.
    async with upstream(honours_override) as primary:
        gateway = Gateway(host_app, config=config(primary.url, methods=["GET", "POST"]))
        try:
            async with client_for(gateway) as client:
                response = await client.post("/v1/files/f-1", headers=[field])
                allowed = await client.post(
                    "/v1/files/f-1", headers=[("X-HTTP-Method-Override", "post")]
                )
        finally:
            await gateway.aclose()
    assert response.status_code == 405
    assert response.json()["error"]["code"] == "method_not_allowed"
    assert response.headers["allow"] == "GET, POST"
    assert field[1] not in response.text  # the caller's value is not echoed
    assert allowed.status_code == 200 and allowed.text == "acted POST"
    assert primary.count == 1  # only the request whose override the route forwards
