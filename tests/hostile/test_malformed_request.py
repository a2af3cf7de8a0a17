"""The server's own answer to a request it cannot parse is the gateway's JSON error (400
`bad_request`), under both of uvicorn's HTTP protocols as `fallback-mw serve` runs them
(cli/server_limits.py), and it never echoes the caller's bytes."""

from __future__ import annotations

import asyncio
import json
from urllib.parse import urlsplit

import pytest

from fallback_mw.cli.server_limits import uvicorn_limits
from fallback_mw.config import GatewaySettings
from tests.upstreams import host_app, serve_asgi

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("http", ["h11", "httptools"])
@pytest.mark.parametrize(
    "request_bytes",
    [b"GARBAGE\r\n\r\n", b"GET /x HTTP/1.1\r\nhost: gw\r\nbad header\r\n\r\n",
     b"GET /x HTTP/1.1\r\nhost: gw\r\ncontent-length: zz<script>\r\n\r\n"],
    ids=["not-http", "header-without-colon", "bad-length"],
)  # fmt: skip
async def test_a_malformed_request_gets_the_json_400(http: str, request_bytes: bytes) -> None:
    async with serve_asgi(host_app, **uvicorn_limits(GatewaySettings(), http)) as base:
        address = urlsplit(base)
        reader, writer = await asyncio.open_connection(address.hostname, address.port)
        try:
            writer.write(request_bytes)
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(), 10)
        finally:
            writer.transport.abort()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ")
    assert b"content-type: application/json" in head.lower()
    error = json.loads(body)["error"]
    assert error["code"] == "bad_request" and error["type"] == "gateway_error"
    assert b"script" not in answer
