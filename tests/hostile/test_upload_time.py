"""The upload is the caller's time (SPEC §12), on both engines, on real sockets (uvicorn in
front, a local upstream behind). A body over `replay_buffer` streams to the upstream as the
caller sends it: a caller that stalls mid-body gets the local 408 `request_timeout` once its
pause exceeds `header_timeout_ms`, booked to the gateway's side (eight of them leave the
upstream's breaker without a mark), and a slow but steady large upload, far longer than the
upstream's first-byte timeout, succeeds. Only the wait for the response head after the body
is sent is the upstream's first byte."""

from __future__ import annotations

import asyncio
import json
from typing import Any
from urllib.parse import urlsplit

import pytest
from aiohttp import web

from fallback_mw import Gateway
from fallback_mw.health.memory import MemoryHealth
from tests.upstreams import host_app, serve_asgi, upstream

pytestmark = pytest.mark.anyio

ENGINES = ["aiohttp", "httpx"]
CHUNK = 16 * 1024
GAP_MS = 2000  # header_timeout_ms: the caller's idle gap


def config(url: str, engine: str) -> dict[str, Any]:
    return {
        "gateway": {"allow_hosts": ["127.0.0.1"], "engine": engine, "replay_buffer": 1024,
                    "header_timeout_ms": GAP_MS, "deadline_ms": 60_000},
        "upstreams": {"primary": {"url": url, "first_byte_timeout_ms": 500}},
        "routes": [{"id": "up", "prefix": "/v1/", "plan": ["primary"],
                    "replayable_methods": ["GET"]}],
    }  # fmt: skip


async def echo_length(request: web.Request) -> web.StreamResponse:
    return web.Response(text=str(len(await request.read())))


async def upload(base: str, total: int, chunks: int, pause: float) -> tuple[int, bytes]:
    """POST with `Content-Length: total`, sending `chunks` chunks of CHUNK bytes `pause`
    seconds apart, then waiting for the answer (a stall when chunks * CHUNK < total)."""
    address = urlsplit(base)
    reader, writer = await asyncio.open_connection(address.hostname, address.port)
    try:
        writer.write(b"POST /v1/upload HTTP/1.1\r\nhost: gw\r\ncontent-length: %d\r\n"
                     b"content-type: application/octet-stream\r\n\r\n" % total)  # fmt: skip
        for _ in range(chunks):
            writer.write(b"a" * CHUNK)
            await writer.drain()
            await asyncio.sleep(pause)
        async with asyncio.timeout(30):
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            length = next(
                int(line.split(b":", 1)[1])
                for line in head.lower().split(b"\r\n")
                if line.startswith(b"content-length:")
            )
            body = await reader.readexactly(length)
    finally:
        writer.close()
    return status, body


def marks(gateway: Gateway) -> list[int]:
    health = gateway.services.health
    assert isinstance(health, MemoryHealth)
    return list(health.breaker("primary").outcomes)


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_stalled_upload_is_the_callers_408_and_marks_no_breaker(engine: str) -> None:
    async with upstream(echo_length) as primary:
        gateway = Gateway(host_app, config=config(primary.url, engine))
        try:
            async with serve_asgi(gateway) as base:
                # Eight callers send 2 of 8 chunks and stall.
                results = await asyncio.gather(
                    *(upload(base, 8 * CHUNK, chunks=2, pause=0.05) for _ in range(8))
                )
                after = marks(gateway)
                # The upstream is healthy for everyone else: a complete upload goes through.
                served = await upload(base, 4 * CHUNK, chunks=4, pause=0)
        finally:
            await gateway.aclose()
    for status, body in results:
        assert status == 408, body
        error = json.loads(body)["error"]
        assert error["code"] == "request_timeout"
    assert after == []  # no mark at all: neither failure nor success
    assert served == (200, str(4 * CHUNK).encode())


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_slow_steady_upload_succeeds(engine: str) -> None:
    async with upstream(echo_length) as primary:
        gateway = Gateway(host_app, config=config(primary.url, engine))
        try:
            async with serve_asgi(gateway) as base:
                # 12 chunks 0.2 s apart: ~2.4 s of upload against a 0.5 s first-byte timeout.
                status, body = await upload(base, 12 * CHUNK, chunks=12, pause=0.2)
        finally:
            await gateway.aclose()
    assert (status, body) == (200, str(12 * CHUNK).encode())
    received = primary.received[-1]
    assert received.body == b"a" * 12 * CHUNK
    # The declared length goes with the streamed body (an upstream may demand one: 411).
    headers = dict(received.headers)
    assert headers["content-length"] == str(12 * CHUNK)
    assert "transfer-encoding" not in headers
