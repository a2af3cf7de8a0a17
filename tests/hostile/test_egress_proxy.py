"""An attacker aiming the gateway's egress (and the provider key it injects) through an
upstream's `proxy`: the allowlist and the metadata guard apply to the proxy's own host
wherever the upstream comes from (the config file or the route store), at load and at
connect time, on both engines."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from aiohttp import web

from fallback_mw import Gateway
from fallback_mw.config import RouteConfig, UpstreamConfig
from fallback_mw.store.faults import StoreFaults
from fallback_mw.store.model import Fault, StoredRoute
from fallback_mw.store.routes import open_store
from fallback_mw.upstream import UpstreamError, UpstreamRequest, make_client
from fallback_mw.upstream.base import Timeouts
from tests.helpers import client_for
from tests.test_cli_admin import cli
from tests.upstreams import host_app, status_handler, upstream

pytestmark = pytest.mark.anyio

KEY = "sk-proxy-test-key-0123456789"


@asynccontextmanager
async def listener() -> AsyncIterator[tuple[int, list[bytes]]]:
    """A loopback listener standing in for the place the attacker aims at (a metadata
    service, an internal proxy): records each request head it gets, answers 200."""
    heads: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            heads.append(await reader.readuntil(b"\r\n\r\n"))
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1], heads
    finally:
        server.close()
        await server.wait_closed()


async def _store_route_with_proxy(path: Path, proxy: str) -> str:
    """A store record whose upstream goes through `proxy` (written as a script, another
    version of the package or a database admin would: the CLI has no --proxy)."""
    url = f"sqlite:///{path}"
    store = open_store(url)
    try:
        upstream = UpstreamConfig(url="http://localhost:9", auth_env="FMW_T_KEY", proxy=proxy)
        route = RouteConfig(id="r", prefix="/v1/", plan=["p"])
        await store.insert_route(StoredRoute(route=route, upstreams={"p": upstream}))
    finally:
        await store.aclose()
    return url


@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
async def test_a_store_route_whose_proxy_is_outside_the_allowlist_is_refused(
    engine: str, tmp_path: Path
) -> None:
    """The loader refused a file upstream's proxy outside allow_hosts, but a stored route's
    proxy was never checked: the gateway loaded it and, on aiohttp, sent the request with
    the injected key to it. The store's routes are refused as the file's (503
    config_error naming the route and the proxy, nothing sent)."""
    async with listener() as (port, heads):
        store = await _store_route_with_proxy(tmp_path / "routes.db", f"http://127.0.0.1:{port}")
        conf = {
            "gateway": {
                "allow_hosts": ["localhost"],
                "engine": engine,
                "store": store,
            }
        }
        gateway = Gateway(host_app, config=conf, environ={"FMW_T_KEY": KEY})
        try:
            async with client_for(gateway) as client:
                response = await client.get("/v1/x")
        finally:
            await gateway.aclose()
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["code"] == "config_error"
    message = error["message"]
    assert "route 'r': upstream 'p': proxy host '127.0.0.1' is not in allow_hosts" in message
    assert heads == []


async def test_check_refuses_a_store_route_whose_proxy_is_a_metadata_address(
    tmp_path: Path,
) -> None:
    store = await _store_route_with_proxy(tmp_path / "routes.db", "http://169.254.169.254:80")
    path = tmp_path / "gateway.toml"
    path.write_text(f'[gateway]\nallow_hosts = ["0.0.0.0/0"]\nstore = "{store}"\n', "utf-8")
    status, out, err = await cli("check", "--config", str(path))
    assert status == 2, out + err
    assert err.strip().splitlines() == [
        "fallback-mw: error: route 'r': upstream 'p': proxy host '169.254.169.254' is a "
        "link-local / metadata address"
    ]


@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
@pytest.mark.parametrize("proxy", ["http://127.0.0.1:{port}", "http://[::ffff:127.0.0.1]:{port}"])
async def test_a_literal_proxy_outside_the_allowlist_is_refused_at_connect_time(
    engine: str, proxy: str
) -> None:
    """A proxy written as an IP literal skipped aiohttp's resolver, where its connect-time
    check lives: the request, with the credential, went to it (httpx checked it)."""
    async with listener() as (port, heads):
        client = make_client(engine, allow_hosts=("localhost", "api.example.test"))
        request = UpstreamRequest(
            method="GET",
            url="http://api.example.test/v1/x",
            headers=[("authorization", f"Bearer {KEY}")],
            body=b"",
            timeouts=Timeouts(1.0, 2.0, 2.0),
            proxy=proxy.format(port=port),
        )
        try:
            with pytest.raises(UpstreamError) as caught:
                response = await client.send(request)
                await response.aclose()
        finally:
            await client.aclose()
    assert caught.value.kind == "unsafe_address"
    assert heads == []


@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
async def test_a_blackhole_fault_never_sends_the_credential_to_the_egress_proxy(
    engine: str, tmp_path: Path
) -> None:
    """A game day's `blackhole` on an https upstream behind an egress proxy: the attempt's
    URL became the local listener's plain http one, still sent through the upstream's
    proxy, so the proxy (which otherwise sees only a CONNECT tunnel) got the request in
    clear, the injected key in its `authorization`. The blackhole is the gateway's own
    listener: reached directly, the proxy gets nothing."""
    async with listener() as (port, heads):
        store = f"sqlite:///{tmp_path / 'routes.db'}"
        opened = open_store(store)
        try:
            await opened.set_fault(Fault(kind="blackhole", target="p", expires_at=time.time() + 60))
        finally:
            await opened.aclose()
        conf = {
            "gateway": {"allow_hosts": ["127.0.0.1", "api.example.test"], "engine": engine,
                        "store": store},
            "upstreams": {"p": {"url": "https://api.example.test", "auth_env": "FMW_T_KEY",
                                "proxy": f"http://127.0.0.1:{port}",
                                "first_byte_timeout_ms": 300}},
            "routes": [{"id": "r", "prefix": "/v1/", "plan": ["p"]}],
        }  # fmt: skip
        gateway = Gateway(host_app, config=conf, environ={"FMW_T_KEY": KEY})
        try:
            async with client_for(gateway) as client:
                response = await client.get("/v1/x")
            faults = gateway.services.faults
            assert isinstance(faults, StoreFaults)
            accepted = faults.blackhole().connections
        finally:
            await gateway.aclose()
    assert response.status_code == 502, response.text
    assert "fault at 'p'" in response.json()["error"]["message"]
    assert heads == []  # nothing, and no key, reached the proxy
    assert accepted == 1  # the attempt went to the silent listener itself


@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
@pytest.mark.parametrize("allow_hosts", [("0.0.0.0/0", "::/0"), ()], ids=["wide", "none"])
@pytest.mark.parametrize("target", ["169.254.169.254", "[fd20:ce::254]", "2852039166"])
async def test_a_metadata_literal_behind_a_proxy_is_refused_at_connect_time(
    engine: str, allow_hosts: tuple[str, ...], target: str
) -> None:
    """An upstream URL written as a metadata literal, sent through an egress proxy: the
    aiohttp engine refused it, the httpx engine (which checks only the proxy's address
    when there is one) handed the proxy `GET http://169.254.169.254/...` with the key,
    and the proxy fetched its own host's metadata. Both refuse it now, nothing sent."""
    async with listener() as (port, heads):
        client = make_client(engine, allow_hosts=(*allow_hosts, "127.0.0.1") if allow_hosts else ())
        request = UpstreamRequest(
            method="GET",
            url=f"http://{target}/latest/meta-data/",
            headers=[("authorization", f"Bearer {KEY}")],
            body=b"",
            timeouts=Timeouts(1.0, 2.0, 2.0),
            proxy=f"http://127.0.0.1:{port}",
        )
        try:
            with pytest.raises(UpstreamError) as caught:
                response = await client.send(request)
                await response.aclose()
        finally:
            await client.aclose()
    assert caught.value.kind == "unsafe_address"
    assert heads == []


@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
async def test_a_proxy_asking_for_credentials_is_its_refusal_for_an_http_upstream_too(
    engine: str,
) -> None:
    """An http:// upstream is asked through its `proxy` in absolute form, so a corporate
    proxy demanding authentication answers the request itself: its 407 (`Proxy-
    Authenticate: Basic realm="corp"` and its own page) reached the caller as the
    upstream's answer, which a client behind a proxy of its own reads as a demand for its
    own proxy's credentials; the walk never moved on. As for an https upstream's refused
    tunnel, it is the upstream's transport failure: failover where eligible, else the 502
    naming the proxy, never the proxy's page."""

    async def demand(request: web.Request) -> web.StreamResponse:
        return web.Response(
            status=407,
            body=b"corp proxy page",
            headers={"proxy-authenticate": 'Basic realm="corp"'},
        )

    async with upstream(demand) as proxy, upstream(status_handler(200, b"backup")) as backup:
        conf = {
            "gateway": {"engine": engine},
            "upstreams": {
                "primary": {
                    "url": "http://127.0.0.1:9",
                    "proxy": proxy.url,
                    "auth_env": "FMW_T_KEY",
                },
                "backup": {"url": backup.url},
            },
            "routes": [
                {"id": "r", "prefix": "/v1/", "plan": ["primary", "backup"], "retries": 1},
                {"id": "alone", "prefix": "/v2/", "plan": ["primary"]},
            ],
        }
        gateway = Gateway(host_app, config=conf, environ={"FMW_T_KEY": KEY})
        try:
            async with client_for(gateway) as client:
                moved = await client.get("/v1/x")
                alone = await client.get("/v2/x")
        finally:
            await gateway.aclose()
    assert proxy.count == 2  # the proxy was asked both times
    assert (moved.status_code, moved.content) == (200, b"backup")
    assert moved.headers["x-gateway-attempts"] == "2"
    assert alone.status_code == 502
    error = alone.json()["error"]
    assert error["code"] == "upstream_failed"
    assert "egress proxy" in error["message"] and "407" in error["message"]
    assert "corp" not in alone.text and "proxy-authenticate" not in alone.headers
