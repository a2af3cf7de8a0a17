"""A 304 goes out with no Content-Length (security/answers.py): the gateway frames what it
relays itself, and a 304 carries no body whatever length the upstream's head gives (the
stored 200's, as the upstream coded it: not what the gateway relays of that 200 when it
decodes it). A hand-made mutant that kept the 304's length passed every test. (A 204
with a length is refused by the engines as a malformed head.)"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from fallback_mw import Gateway
from tests.hostile.test_hostile_upstreams import raw_upstream, read_head
from tests.upstreams import host_app, serve_asgi

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
async def test_a_304_goes_out_without_the_upstreams_length(engine: str) -> None:
    status = b"304 Not Modified"

    async def behaviour(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(
            b"HTTP/1.1 " + status + b'\r\nContent-Length: 1234\r\nETag: "v1"\r\n'
            b"Connection: close\r\n\r\n"
        )
        await writer.drain()
        await asyncio.sleep(0.2)

    async with raw_upstream(behaviour) as (url, _):
        conf = {
            "gateway": {"engine": engine, "allow_hosts": ["127.0.0.1"]},
            "upstreams": {"primary": {"url": url}},
            "routes": [{"id": "r", "prefix": "/v1/", "plan": ["primary"]}],
        }
        gateway = Gateway(host_app, config=conf)
        try:
            async with serve_asgi(gateway) as base, httpx.AsyncClient(base_url=base) as client:
                response = await client.get("/v1/x", headers={"if-none-match": '"v1"'})
        finally:
            await gateway.aclose()
    assert response.status_code == int(status[:3])
    assert response.headers["etag"] == '"v1"'
    assert "content-length" not in response.headers
    assert response.content == b""
