"""The server's own answer to a request it cannot parse is the gateway's JSON error (400
`bad_request`, or 405 `method_not_allowed` for a method the parser does not know), with
its `rule`, under both of uvicorn's HTTP protocols as `fallback-mw serve` runs them
(cli/server_limits.py), and it never echoes the caller's bytes. A head over
max_header_bytes is refused by the server even when it arrives in one read."""

from __future__ import annotations

import asyncio
import json
from urllib.parse import urlsplit

import pytest

from fallback_mw.cli.server_limits import uvicorn_limits
from fallback_mw.config import GatewaySettings
from fallback_mw.request.types import ASGIApp, Receive, Scope, Send
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
    answer = await exchange(http, request_bytes)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ")
    assert b"content-type: application/json" in head.lower()
    error = json.loads(body)["error"]
    assert error["code"] == "bad_request" and error["type"] == "gateway_error"
    assert error["rule"] == "malformed_request"
    assert b"script" not in answer


async def body_length(scope: Scope, receive: Receive, send: Send) -> None:
    """Reads the whole body and answers its length."""
    size, more = 0, True
    while more:
        message = await receive()
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": str(size).encode()})


async def exchange(http: str, request_bytes: bytes, app: ASGIApp = host_app) -> bytes:
    async with serve_asgi(app, **uvicorn_limits(GatewaySettings(), http)) as base:
        address = urlsplit(base)
        reader, writer = await asyncio.open_connection(address.hostname, address.port)
        try:
            writer.write(request_bytes)
            await writer.drain()
            return await asyncio.wait_for(reader.read(), 10)
        finally:
            writer.transport.abort()


@pytest.mark.parametrize("http", ["h11", "httptools"])
async def test_a_method_no_route_forwards_is_405_with_its_rule(http: str) -> None:
    """SPEC §12: any method outside a route's list is a local 405 `method_not_allowed`. The
    httptools parser cannot read a method outside its own list (uvicorn answers for it);
    h11 passes it to the app, where the host app (no gateway here) answers 404."""
    answer = await exchange(http, b"FOO /v1/x HTTP/1.1\r\nhost: gw\r\nconnection: close\r\n\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    if http == "h11":
        assert head.startswith(b"HTTP/1.1 404 ")  # the app saw it: the route decides
        return
    assert head.startswith(b"HTTP/1.1 405 "), head
    assert b"\r\nallow: GET, HEAD, OPTIONS, POST, PUT, PATCH, DELETE" in head
    error = json.loads(body)["error"]
    assert (error["code"], error["rule"]) == ("method_not_allowed", "methods")
    assert "this method is not forwarded" in error["message"]


async def test_the_servers_405_never_echoes_the_method_token() -> None:
    """A caller's method token can be its own bearer token (or a provider key it learnt):
    the gateway's own 405 names such a token "this method" (docs/telemetry.md, redaction),
    but under `serve` httptools cannot parse an unknown method, so the server's guard
    answers before the gateway runs and it quoted the token. It cannot tell which headers
    hold a credential there: it never echoes the token."""
    token = b"SK-LIVE-0123456789abcdef"
    answer = await exchange(
        "httptools",
        b"%s /v1/x HTTP/1.1\r\nhost: gw\r\nauthorization: Bearer %s\r\n"
        b"connection: close\r\n\r\n" % (token, token),
    )
    assert answer.startswith(b"HTTP/1.1 405 "), answer
    assert token.lower() not in answer.lower()


@pytest.mark.parametrize("http", ["h11", "httptools"])
async def test_a_head_over_the_limit_in_one_read_is_431_before_any_app(http: str) -> None:
    """A 100,000-byte head in one write (one read on the server) with max_header_bytes at
    its 65,536 default: refused by the server, not parsed whole and passed to the app."""
    request = b"GET /elsewhere HTTP/1.1\r\nhost: gw\r\nx-big: " + b"a" * 100_000 + b"\r\n\r\n"
    answer = await exchange(http, request)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 "), head[:60]
    error = json.loads(body)["error"]
    assert (error["code"], error["rule"]) == ("headers_too_large", "max_header_bytes")


@pytest.mark.parametrize("http", ["h11", "httptools"])
async def test_a_head_under_the_limit_with_a_large_body_in_the_same_read_is_served(
    http: str,
) -> None:
    """Only the head counts: a 60,000-byte head and a 200,000-byte body in one write are
    read as a request, never refused as a large head."""
    body = b"b" * 200_000
    request = (
        b"POST /elsewhere HTTP/1.1\r\nhost: gw\r\nconnection: close\r\nx-big: "
        + b"a" * 60_000
        + b"\r\ncontent-length: %d\r\n\r\n" % len(body)
        + body
    )
    answer = await exchange(http, request, body_length)
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:60]
    assert b"\r\n200000\r\n" in answer  # the app read the whole body
