"""A server reports `http.disconnect` to `receive` once the response is complete (uvicorn
does: RequestResponseCycle.receive returns it after response_complete). That is not the
client going away mid-walk: the walk's work after its final body chunk (closing the
upstream response, settling declared tokens, a shadow copy) must not be cancelled."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from fallback_mw import Gateway
from fallback_mw.layers.walker.disconnect import WATCH_AFTER
from fallback_mw.request.context import get_context
from fallback_mw.request.types import Message
from fallback_mw.upstream.base import UpstreamRequest
from tests.upstreams import host_app

BODY = b'{"id":"x","usage":{"prompt_tokens":1,"completion_tokens":1}}'


class SlowToClose:
    """An upstream response whose release really suspends (as a pooled connection's
    release may), and that says whether its close ran to the end."""

    def __init__(self) -> None:
        self.status = 200
        self.headers = [(b"content-type", b"application/json")]
        self.closed = False

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        yield BODY
        await asyncio.sleep(0)  # the watcher runs between the chunks and the close

    async def aclose(self) -> None:
        for _ in range(3):
            await asyncio.sleep(0)
        self.closed = True


class Client:
    def __init__(self) -> None:
        self.responses: list[SlowToClose] = []

    async def send(self, request: UpstreamRequest) -> SlowToClose:
        # Longer than the walk takes to start its disconnect watcher (WATCH_AFTER).
        await asyncio.sleep(WATCH_AFTER * 3)
        response = SlowToClose()
        self.responses.append(response)
        return response

    async def aclose(self) -> None:
        return None


def get_scope() -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": "/v1/x",
        "raw_path": b"/v1/x",
        "query_string": b"",
        "headers": [(b"host", b"gateway")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }


def gateway_over(client: Client) -> Gateway:
    config = {
        "upstreams": {"a": {"url": "http://127.0.0.1:9"}},
        "routes": [{"id": "r", "prefix": "/v1/", "plan": ["a"]}],
    }
    return Gateway(host_app, config=config, client=client)


@pytest.mark.anyio
async def test_the_servers_disconnect_after_a_complete_response_cancels_nothing() -> None:
    client = Client()
    gateway = gateway_over(client)
    complete = asyncio.Event()
    received = False
    sent: list[Message] = []

    async def receive() -> Message:
        nonlocal received
        if not received:
            received = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await complete.wait()  # as uvicorn: a disconnect once the response is complete
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            complete.set()

    scope = get_scope()
    try:
        await gateway(scope, receive, send)
    finally:
        await gateway.aclose()
    context = get_context(scope)
    assert context is not None
    assert sent[0]["status"] == 200
    assert b"".join(m.get("body", b"") for m in sent[1:]) == BODY
    assert context.outcome == "served"
    assert not context.client_disconnected
    assert client.responses[0].closed  # its close was not cut short


@pytest.mark.anyio
async def test_a_receive_that_never_blocks_after_the_body_does_not_hold_the_loop() -> None:
    """A driver (a test harness, a non-conforming host) whose `receive` keeps answering
    `http.request` at once after the body's end: the watcher read it in a loop that never
    suspended, so the event loop (every request of the process) was held for good, at
    100 % CPU, whenever the upstream took longer than WATCH_AFTER. It now stops watching."""
    client = Client()  # answers after WATCH_AFTER * 3: the watcher has started by then
    gateway = gateway_over(client)
    calls = 0
    sent: list[Message] = []

    async def receive() -> Message:
        nonlocal calls
        calls += 1
        if calls > 100:  # the old loop: fail instead of hanging the test run
            raise RuntimeError("receive read in a loop")
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    scope = get_scope()
    try:
        await gateway(scope, receive, send)
    finally:
        await gateway.aclose()
    assert calls == 2  # the body, then one read by the watcher
    assert sent[0]["status"] == 200
    assert b"".join(m.get("body", b"") for m in sent[1:]) == BODY
