"""A gateway mounted below a path routes on the path below its mount point, as Starlette's
own routing does: under Starlette's `Mount` and uvicorn's `--root-path` (both put the mount
point in `path` and `raw_path` and name it in `root_path`). The upstream gets the path the
route saw. Real sockets for uvicorn; Starlette in process."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from aiohttp import web
from starlette.applications import Starlette
from starlette.routing import Mount

from fallback_mw import Gateway
from fallback_mw.routing import below_root
from tests.helpers import client_for
from tests.upstreams import host_app, serve_asgi, status_handler, upstream

pytestmark = pytest.mark.anyio


def config(url: str) -> dict[str, Any]:
    return {
        "gateway": {"allow_hosts": ["127.0.0.1"]},
        "upstreams": {"primary": {"url": url}},
        "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"]}],
    }


@pytest.mark.parametrize(
    ("raw", "root", "below"),
    [
        ("/gw/v1/x", "/gw", "/v1/x"),
        ("/gw/v1/x", "/gw/", "/v1/x"),
        ("/gw", "/gw", "/"),
        ("/gwx/v1/x", "/gw", "/gwx/v1/x"),  # not below the mount point: as it is
        ("/v1/x", "/api", "/v1/x"),  # a server that keeps root_path out of path
        ("/v1/x", "", "/v1/x"),
        ("/a%20b/v1/x", "/a b", "/v1/x"),  # the mount point as the caller encodes it
        ("/a%20bc/v1/x", "/a b", "/a%20bc/v1/x"),
        ("/a%2Fb/v1/x", "/a/b", "/a%2Fb/v1/x"),  # one segment, not the mount's two
    ],
)
def test_below_root(raw: str, root: str, below: str) -> None:
    assert below_root(raw, root) == below


async def test_under_a_starlette_mount_the_route_matches_below_the_mount_point() -> None:
    async with upstream(status_handler(200, b"up")) as primary:
        gateway = Gateway(host_app, config=config(primary.url))
        app = Starlette(routes=[Mount("/gw", app=gateway)])
        try:
            async with client_for(app) as client:
                routed = await client.get("/gw/v1/chat?x=1")
                other = await client.get("/gw/elsewhere")
        finally:
            await gateway.aclose()
    assert (routed.status_code, routed.text) == (200, "up")
    assert routed.headers["x-gateway-route"] == "chat"
    assert [r.path for r in primary.received] == ["/v1/chat"]
    assert other.status_code == 404 and "x-gateway-route" not in other.headers


@pytest.mark.parametrize("http", ["h11", "httptools"])
async def test_under_uvicorn_root_path_the_route_matches_below_it(http: str) -> None:
    """Behind a proxy that strips `/api`, uvicorn `--root-path /api` puts it back in front
    of `path`: the gateway routes (and forwards) what the proxy passed on."""
    async with upstream(status_handler(200, b"up")) as primary:
        gateway = Gateway(host_app, config=config(primary.url))
        try:
            async with (
                serve_asgi(gateway, root_path="/api", http=http) as base,
                httpx.AsyncClient(base_url=base) as client,
            ):
                routed = await client.get("/v1/chat")
        finally:
            await gateway.aclose()
    assert (routed.status_code, routed.text) == (200, "up")
    assert [r.path for r in primary.received] == ["/v1/chat"]


async def test_a_location_naming_the_upstream_is_below_the_mount_point() -> None:
    # An upstream URL with a path of its own: its resources are below it, the caller's
    # below the mount point.
    async def created(request: web.Request) -> web.StreamResponse:
        if request.method == "GET":  # Django's APPEND_SLASH: the path alone
            return web.Response(status=301, headers={"location": "/api/v1/n/"})
        return web.Response(status=201, headers={"location": f"http://{request.host}/api/v1/n/7"})

    async with upstream(created) as primary:
        conf = config(primary.url + "/api")
        gateway = Gateway(host_app, config=conf)
        app = Starlette(routes=[Mount("/gw", app=gateway)])
        try:
            async with client_for(app) as client:
                response = await client.post("/gw/v1/n")
                slash = await client.get("/gw/v1/n")
        finally:
            await gateway.aclose()
    assert response.status_code == 201
    assert response.headers["location"] == "/gw/v1/n/7"
    assert (slash.status_code, slash.headers["location"]) == (301, "/gw/v1/n/")
    assert [r.path for r in primary.received] == ["/api/v1/n"] * 2


@pytest.mark.parametrize(
    ("tenant", "spelled"),
    [("acme corp", "acme%20corp"), ("über", "%C3%BCber"), ("日本", "%E6%97%A5%E6%9C%AC")],
)
async def test_a_mount_point_the_caller_percent_encodes_is_routed_below(
    tenant: str, spelled: str
) -> None:
    """Starlette's `Mount("/t/{tenant}")` matches the decoded path and names the mount
    point decoded in `root_path` (`/t/acme corp`), while `raw_path` has it as the caller
    sent it (`/t/acme%20corp`): compared as written, the two never matched, and every
    request below such a mount went to the host app (404) instead of its route. A
    `Location` below the mount point goes back as the caller spelled it (the decoded form
    was sent as raw bytes, or failed the response as text no header can hold)."""

    async def created(request: web.Request) -> web.StreamResponse:
        return web.Response(status=201, headers={"location": "/v1/n/7"})

    async with upstream(created) as primary:
        gateway = Gateway(host_app, config=config(primary.url))
        app = Starlette(routes=[Mount("/t/{tenant}", app=gateway)])
        try:
            async with client_for(app) as client:
                routed = await client.post(f"/t/{spelled}/v1/n")
        finally:
            await gateway.aclose()
    assert routed.status_code == 201, routed.text
    assert routed.headers["x-gateway-route"] == "chat"
    assert routed.headers["location"] == f"/t/{spelled}/v1/n/7"
    assert [r.path for r in primary.received] == ["/v1/n"]
