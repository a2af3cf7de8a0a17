"""A caller that hangs up mid-upload, on real sockets (uvicorn's h11 and httptools
protocols in front, a local upstream behind), on both engines: the request is the caller's
`client_disconnected`, never an upstream failure (no breaker mark, no 502 logged against
the upstream), whether the body was streaming to the upstream (over `replay_buffer`, with a
length or chunked) or still being buffered."""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import urlsplit

import pytest
from aiohttp import web

from fallback_mw import Gateway
from fallback_mw.health.memory import MemoryHealth
from tests.upstreams import host_app, serve_asgi, upstream

pytestmark = pytest.mark.anyio

CHUNK = 16 * 1024


async def echo_length(request: web.Request) -> web.StreamResponse:
    return web.Response(text=str(len(await request.read())))


async def hang_up_mid_upload(base: str, head: bytes, pieces: list[bytes]) -> None:
    """Send the head and the pieces, a pause after each, then close the socket."""
    address = urlsplit(base)
    _, writer = await asyncio.open_connection(address.hostname, address.port)
    try:
        writer.write(head)
        for piece in pieces:
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.2)
    finally:
        writer.close()
        await writer.wait_closed()


UPLOADS = {
    # over replay_buffer with its length: streams to the upstream as it arrives
    "streamed": (b"content-length: %d\r\n" % (8 * CHUNK), [b"a" * CHUNK, b"a" * CHUNK]),
    # chunked: read whole before any upstream
    "chunked": (
        b"transfer-encoding: chunked\r\n",
        [b"4000\r\n" + b"a" * CHUNK + b"\r\n", b"4000\r\n" + b"a" * CHUNK + b"\r\n"],
    ),
    # within replay_buffer: still being buffered
    "buffered": (b"content-length: 900\r\n", [b"a" * 300]),
}


@pytest.mark.parametrize("http", ["h11", "httptools"])
@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
@pytest.mark.parametrize("upload", list(UPLOADS))
async def test_a_caller_that_hangs_up_mid_upload_is_client_disconnected(
    engine: str, http: str, upload: str, caplog: pytest.LogCaptureFixture
) -> None:
    framing, pieces = UPLOADS[upload]
    async with upstream(echo_length) as primary:
        conf = {
            "gateway": {"allow_hosts": ["127.0.0.1"], "engine": engine, "replay_buffer": 1024},
            "upstreams": {"primary": {"url": primary.url, "first_byte_timeout_ms": 1000}},
            "routes": [{"id": "r", "prefix": "/v1/", "plan": ["primary"]}],
        }
        gateway = Gateway(host_app, config=conf)
        try:
            with caplog.at_level(logging.INFO, logger="fallback_mw.request"):
                async with serve_asgi(gateway, http=http) as base:
                    head = b"POST /v1/upload HTTP/1.1\r\nhost: gw\r\n" + framing + b"\r\n"
                    await hang_up_mid_upload(base, head, pieces)
                    for _ in range(100):  # the gateway logs the request as it ends
                        if any(r.name == "fallback_mw.request" for r in caplog.records):
                            break
                        await asyncio.sleep(0.05)
            health = gateway.services.health
            assert isinstance(health, MemoryHealth)
            marks = list(health.breaker("primary").outcomes)
        finally:
            await gateway.aclose()
    lines = [r.getMessage() for r in caplog.records if r.name == "fallback_mw.request"]
    assert len(lines) == 1, lines
    assert "outcome=client_disconnected" in lines[0], lines[0]
    assert "failures=" not in lines[0], lines[0]  # no attempt failed: none was booked
    assert marks == []
    assert primary.received == []
