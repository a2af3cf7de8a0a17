"""serve's protocol writes an answer's head with its body when the app sends both in one
step (cli/head_with_body.py): one write, where uvicorn alone makes two. A head whose body
comes later still reaches the client before the body is sent. Real sockets, h11 and
httptools; the transport's writes are observed, not replaced."""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import pytest

from fallback_mw.cli.server_limits import uvicorn_limits
from fallback_mw.config import load_config
from fallback_mw.request.types import Receive, Scope, Send
from tests.upstreams import serve_asgi

pytestmark = pytest.mark.anyio

CONF = {"upstreams": {"u": {"url": "http://127.0.0.1:9"}}, "routes": []}
HEAD = {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"8")]}
BODY = {"type": "http.response.body", "body": b"the-body"}


def writes_of_answers(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every socket write of the event loop's transports that carries an answer's head or
    body, as the transport was handed it."""
    from asyncio.selector_events import _SelectorSocketTransport

    seen: list[bytes] = []
    original = _SelectorSocketTransport.write

    def write(self: _SelectorSocketTransport, data: bytes) -> None:
        if b"HTTP/1.1 200" in data or b"the-body" in data:
            seen.append(bytes(data))
        original(self, data)

    monkeypatch.setattr(_SelectorSocketTransport, "write", write)
    return seen


async def ask(
    base: str, request: bytes = b"GET / HTTP/1.1\r\nhost: gw\r\n\r\n"
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    address = urlsplit(base)
    reader, writer = await asyncio.open_connection(address.hostname, address.port)
    writer.write(request)
    return reader, writer


@pytest.mark.parametrize("http", ["h11", "httptools"])
async def test_a_head_and_body_sent_in_one_step_are_one_write(
    http: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send(HEAD)
        await send(BODY)

    seen = writes_of_answers(monkeypatch)
    options = uvicorn_limits(load_config(CONF).gateway, http)
    async with serve_asgi(app, **options) as base:
        reader, writer = await ask(base)
        await reader.readuntil(b"the-body")
        writer.write(b"GET / HTTP/1.1\r\nhost: gw\r\n\r\n")  # again, on the kept-alive connection
        await reader.readuntil(b"the-body")
        writer.close()
        await writer.wait_closed()
    assert len(seen) == 2, seen
    assert all(w.startswith(b"HTTP/1.1 200") and w.endswith(b"\r\n\r\nthe-body") for w in seen)


@pytest.mark.parametrize("http", ["h11", "httptools"])
async def test_a_head_whose_body_comes_later_is_written_first(http: str) -> None:
    body_may_go = asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send(HEAD)
        await body_may_go.wait()  # the client has read the head: only then the body
        await send(BODY)

    options = uvicorn_limits(load_config(CONF).gateway, http)
    async with serve_asgi(app, **options) as base:
        reader, writer = await ask(base)
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        finally:
            body_may_go.set()  # a head held back: the test fails, the server still stops
        assert head.startswith(b"HTTP/1.1 200")
        assert await asyncio.wait_for(reader.readexactly(8), 10) == b"the-body"
        writer.close()
        await writer.wait_closed()
