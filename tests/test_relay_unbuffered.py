"""A stream is never buffered (STYLE.md). An answer (SPEC §5: streamed chunk by chunk, SSE
included): the first chunk reaches the client before the upstream sends its second, on
both engines, through the whole Gateway (the budget guard and the usage meter on the way);
the upstream waits for the client to have the first chunk before it sends the second. An
upload past `replay_buffer` with its length (SPEC §3: only bodies up to it are buffered):
the upstream has its first part before the caller sends the rest. Each wait is bounded, so
a gateway that buffers fails the test rather than hanging it. A raw ASGI harness, since
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


async def reading_upstream(
    received: list[bytes], has_first: asyncio.Event
) -> tuple[web.AppRunner, str]:
    """An upstream that reads the request body as it arrives (`has_first` once it has
    the first part), then answers 200."""

    async def handle(request: web.Request) -> web.StreamResponse:
        while True:
            chunk = await request.content.readany()
            if not chunk:
                break
            received.append(chunk)
            if sum(map(len, received)) >= len(UPLOAD_FIRST):
                has_first.set()
        return web.Response(text="stored")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


UPLOAD_FIRST = b"a" * 4096  # past replay_buffer: the body streams, it is not held for a replay
UPLOAD_REST = b"b" * 4096


@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
async def test_an_upload_past_replay_buffer_reaches_the_upstream_before_the_caller_sends_the_rest(
    engine: str,
) -> None:
    # With its Content-Length: one without is read up to max_request_body before any
    # upstream is contacted (docs/failover.md), so that an oversized one is a 413 no
    # upstream saw.
    order: list[str] = []
    received: list[bytes] = []
    has_first = asyncio.Event()
    parts = [UPLOAD_FIRST, UPLOAD_REST]

    async def receive() -> Message:
        if not parts:
            await asyncio.Event().wait()  # the client stays
        if len(parts) == 1:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(has_first.wait(), WAIT)
            order.append("upstream had the first" if has_first.is_set() else "upstream had none")
            order.append("caller sends the rest")
        body = parts.pop(0)
        return {"type": "http.request", "body": body, "more_body": bool(parts)}

    statuses: list[int] = []

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    runner, url = await reading_upstream(received, has_first)
    try:
        conf = {
            "gateway": {"engine": engine, "replay_buffer": 1024},
            "upstreams": {"primary": {"url": url}},
            "routes": [{"id": "r", "prefix": "/v1/", "plan": ["primary"]}],
        }
        length = str(len(UPLOAD_FIRST) + len(UPLOAD_REST)).encode()
        gateway = Gateway(host_app, config=conf)
        try:
            scope = http_scope("POST", "/v1/files", headers=[(b"content-length", length)])
            await asyncio.wait_for(gateway(scope, receive, send), 30)
        finally:
            await gateway.aclose()
    finally:
        await runner.cleanup()
    assert statuses == [200]
    assert order == ["upstream had the first", "caller sends the rest"]
    assert b"".join(received) == UPLOAD_FIRST + UPLOAD_REST
