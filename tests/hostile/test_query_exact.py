"""The query string reaches the upstream byte for byte (signed URLs), on both engines,
through a real server and a real upstream that echoes the raw request target."""

from __future__ import annotations

import anyio
import pytest
from aiohttp import web

from fallback_mw import Gateway
from tests.upstreams import host_app, serve_asgi, upstream

pytestmark = pytest.mark.anyio

QUERIES = [
    b"sig=a%3Fb%2Fc%7e&x=%20+y",
    b"a=%2f%2F&b=%7E~&c=%25&d=%26%3d",
    b"empty=&=v&&flag",
    b"q=%E2%82%AC&r=%e2%82%ac",
    b"semi=a;b&colon=c:d&at=@&bang=!",
]


async def echo_target(request: web.Request) -> web.StreamResponse:
    return web.Response(body=request.raw_path.encode("latin-1"))


async def raw_get(base: str, target: bytes) -> tuple[int, bytes]:
    host, port = base.removeprefix("http://").split(":")
    stream = await anyio.connect_tcp(host, int(port))
    try:
        await stream.send(b"GET " + target + b" HTTP/1.1\r\nhost: gw\r\nconnection: close\r\n\r\n")
        data = b""
        while True:
            try:
                data += await stream.receive()
            except anyio.EndOfStream:
                break
    finally:
        await stream.aclose()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
@pytest.mark.parametrize("query", QUERIES)
async def test_the_query_string_is_forwarded_byte_exact(engine: str, query: bytes) -> None:
    async with upstream(echo_target) as primary:
        conf = {
            "gateway": {"allow_hosts": ["127.0.0.1"], "engine": engine},
            "upstreams": {"primary": {"url": primary.url}},
            "routes": [{"id": "r", "prefix": "/v1/", "plan": ["primary"]}],
        }
        gateway = Gateway(host_app, config=conf)
        try:
            async with serve_asgi(gateway) as base:
                status, body = await raw_get(base, b"/v1/sign?" + query)
        finally:
            await gateway.aclose()
    assert status == 200
    assert body == b"/v1/sign?" + query
