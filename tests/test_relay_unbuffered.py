"""A streamed answer is never buffered (SPEC §5: streamed chunk by chunk, SSE included):
the first chunk reaches the client before the upstream sends its second, on both engines,
through the whole Gateway (the budget guard and the usage meter on the way). The upstream
waits for the client to have the first chunk before it sends the second (bounded, so a
gateway that buffers fails the test rather than hanging it). A raw ASGI harness, since
httpx's ASGITransport collects the whole body first; real aiohttp upstreams on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from aiohttp import web

from fallback_mw import Gateway
from fallback_mw.request.types import Message
from tests.helpers import http_scope
from tests.upstreams import host_app, upstream

pytestmark = pytest.mark.anyio

FIRST = b'data: {"choices": [{"delta": {"content": "Hel"}}]}\n\n'
SECOND = b'data: {"usage": {"prompt_tokens": 3, "completion_tokens": 4}}\n\ndata: [DONE]\n\n'
WAIT = 5.0  # how long the upstream holds its second chunk for the client to have the first


@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
@pytest.mark.parametrize("content_type", ["text/event-stream", "application/octet-stream"])
async def test_the_first_chunk_reaches_the_client_before_the_upstream_sends_the_second(
    engine: str, content_type: str
) -> None:
    order: list[str] = []
    relayed = asyncio.Event()

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": content_type})
        await response.prepare(request)
        await response.write(FIRST)
        order.append("upstream sent the first")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(relayed.wait(), WAIT)
        order.append("upstream sends the second")
        await response.write(SECOND)
        return response

    received: list[bytes] = []
    statuses: list[int] = []

    async def receive() -> Message:
        if not received and not statuses:
            return {"type": "http.request", "body": b'{"model": "m"}', "more_body": False}
        await asyncio.Event().wait()  # the client stays
        raise AssertionError("unreachable")

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])
        elif message.get("body"):
            if not received:
                order.append("client has the first")
                relayed.set()
            received.append(message["body"])

    async with upstream(stream) as primary:
        conf = {
            "gateway": {"engine": engine},
            "upstreams": {"primary": {"url": primary.url}},
            "routes": [{"id": "r", "prefix": "/v1/", "plan": ["primary"], "budget": "acme"}],
            "budgets": {"acme": {"limit": 10, "window": "total", "default_hold": 0.01}},
        }
        gateway = Gateway(host_app, config=conf)
        try:
            await asyncio.wait_for(gateway(http_scope("POST", "/v1/chat"), receive, send), 30)
        finally:
            await gateway.aclose()
    assert statuses == [200]
    assert order == [
        "upstream sent the first",
        "client has the first",
        "upstream sends the second",
    ]
    assert received[0] == FIRST
    assert b"".join(received) == FIRST + SECOND
