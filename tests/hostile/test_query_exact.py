"""The query string reaches the upstream byte for byte (signed URLs), on both engines,
through a real server and a real upstream that echoes the raw request target."""

from __future__ import annotations

import anyio
import pytest
from aiohttp import web

from fallback_mw import Gateway
from tests.helpers import http_scope
from tests.upstreams import host_app, serve_asgi, upstream

pytestmark = pytest.mark.anyio

QUERIES = [
    b"sig=a%3Fb%2Fc%7e&x=%20+y",
    b"a=%2f%2F&b=%7E~&c=%25&d=%26%3d",
    b"empty=&=v&&flag",
    b"q=%E2%82%AC&r=%e2%82%ac",
    b"semi=a;b&colon=c:d&at=@&bang=!",
    # What WHATWG URLs (and httpx) percent-encode in a query and curl sends as written:
    # the httpx engine sent `%22%3Ca%3E%22`, aiohttp the caller's bytes.
    b'q="<a>"&sig=`{}|^\\',
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


async def _target_sent(gateway: Gateway, query: bytes) -> tuple[int, bytes]:
    """The request target the upstream echoes for a GET with this raw query string, sent
    in process, as granian passes a query's bytes >= 0x80 (uvicorn refuses them)."""
    scope = http_scope("GET", "/v1/sign", query)
    started: list[int] = []
    body = bytearray()

    async def receive() -> dict[str, object]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, object]) -> None:
        if message["type"] == "http.response.start":
            started.append(int(message["status"]))  # type: ignore[call-overload]
        else:
            body.extend(message.get("body", b""))  # type: ignore[arg-type]

    await gateway(scope, receive, send)
    return started[0], bytes(body)


@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
@pytest.mark.parametrize(
    ("query", "sent"),
    [
        (b"q=\xe2\x82\xac&r=%E2%82%AC", b"q=%E2%82%AC&r=%E2%82%AC"),  # raw UTF-8: the euro
        (b"q=caf\xe9", b"q=caf%E9"),  # a raw latin-1 byte: that byte, escaped
    ],
)
async def test_raw_bytes_in_a_query_go_out_as_the_bytes_the_caller_sent(
    engine: str, query: bytes, sent: bytes
) -> None:
    # The httpx engine read each raw byte as a latin-1 character and UTF-8-encoded it
    # again: a raw `€` reached the upstream as `%C3%A2%C2%82%C2%AC` (mojibake), where the
    # aiohttp engine sent `%E2%82%AC`. Both now send each byte as its own %XX.
    async with upstream(echo_target) as primary:
        conf = {
            "gateway": {"allow_hosts": ["127.0.0.1"], "engine": engine},
            "upstreams": {"primary": {"url": primary.url}},
            "routes": [{"id": "r", "prefix": "/v1/", "plan": ["primary"]}],
        }
        gateway = Gateway(host_app, config=conf)
        try:
            status, body = await _target_sent(gateway, query)
        finally:
            await gateway.aclose()
    assert (status, body) == (200, b"/v1/sign?" + sent)
