"""An upstream may answer before the request body is all sent (RFC 9112 §9.5): a 413 for
an upload over its own limit, a 401, then close, reset, or stop reading. That answer is
the upstream's, relayed to the caller on both engines, never a local 502 booked to the
upstream's breaker as a transport failure (the httpx engine sent the whole body before
reading, and the failed write closed the connection with the answer unread)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from fallback_mw import Gateway
from tests.hostile.test_hostile_upstreams import Behaviour, raw_upstream, read_head, reset
from tests.upstreams import host_app, serve_asgi

pytestmark = pytest.mark.anyio

ENGINES = ["aiohttp", "httpx"]
ANSWER = b'{"error": {"message": "request entity too large"}}'
BODY = 16 * 1024 * 1024  # more than loopback's socket buffers hold


def answers_early(then: str) -> Behaviour:
    async def behaviour(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(
            b"HTTP/1.1 413 Payload Too Large\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(ANSWER), ANSWER)
        )
        await writer.drain()
        if then == "close":
            writer.close()
        elif then == "reset":
            await asyncio.sleep(0.05)
            reset(writer)
        else:  # stops reading, keeps the connection a while
            await asyncio.sleep(2)

    return behaviour


async def chunks() -> AsyncIterator[bytes]:
    for _ in range(BODY // 65536):
        yield b"x" * 65536


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("then", ["close", "reset", "stop-reading"])
@pytest.mark.parametrize("framing", ["chunked", "length"])
async def test_an_error_answered_before_the_body_is_sent_is_relayed(
    engine: str, then: str, framing: str
) -> None:
    async with raw_upstream(answers_early(then)) as (url, accepted):
        conf = {
            "gateway": {
                "allow_hosts": ["127.0.0.1"],
                "engine": engine,
                "max_request_body": 2 * BODY,
                "breaker": {"min_calls": 1, "window": 1},
            },
            "upstreams": {"upload": {"url": url}},
            "routes": [{"id": "r", "prefix": "/v1/", "plan": ["upload"]}],
        }
        gateway = Gateway(host_app, config=conf)
        try:
            async with serve_asgi(gateway) as base, httpx.AsyncClient(base_url=base) as client:
                content = chunks() if framing == "chunked" else b"x" * BODY
                response = await client.post("/v1/files", content=content, timeout=30)
                # No transport failure was booked: a breaker opening on one failure
                # would skip the upstream now.
                again = await client.post("/v1/files", content=b"{}", timeout=30)
        finally:
            await gateway.aclose()
    assert response.status_code == 413, response.text
    assert response.content == ANSWER
    assert response.headers["x-gateway-attempts"] == "1"
    assert again.status_code == 413
    assert len(accepted) == 2


@pytest.mark.parametrize("anyio_backend", [("asyncio", {"use_uvloop": True})])
@pytest.mark.parametrize("framing", ["chunked", "length"])
async def test_an_early_answer_is_relayed_on_uvloop_too(framing: str) -> None:
    """`serve` runs on uvloop, whose transports hand out a PseudoSocket, not a socket: the
    httpx engine's check for an early answer found no socket to peek at and sent the whole
    body, so the upstream's 413 became a 502 booked to its breaker, under `serve` alone."""
    async with raw_upstream(answers_early("close")) as (url, accepted):
        conf = {
            "gateway": {
                "allow_hosts": ["127.0.0.1"],
                "engine": "httpx",
                "max_request_body": 2 * BODY,
                "breaker": {"min_calls": 1, "window": 1},
            },
            "upstreams": {"upload": {"url": url}},
            "routes": [{"id": "r", "prefix": "/v1/", "plan": ["upload"]}],
        }
        gateway = Gateway(host_app, config=conf)
        try:
            async with serve_asgi(gateway) as base, httpx.AsyncClient(base_url=base) as client:
                content = chunks() if framing == "chunked" else b"x" * BODY
                response = await client.post("/v1/files", content=content, timeout=30)
                again = await client.post("/v1/files", content=b"{}", timeout=30)
        finally:
            await gateway.aclose()
    assert response.status_code == 413, response.text
    assert response.content == ANSWER
    assert again.status_code == 413
    assert len(accepted) == 2
