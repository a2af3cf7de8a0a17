"""Never leak a pooled connection (STYLE.md): after requests of every outcome kind (served,
streamed, failed over, timed out before the head or mid-stream, reset, over the response
limit before and after the commit point, relayed as-is, a caller gone before the head or
mid-stream, a caller's short deadline, HEAD, 204), on both engines, no upstream connection
is left checked out. Seen as a caller sees it: each upstream has `max_connections = 1`, so
a connection never given back makes the next request to it wait for the pool until its
deadline (a 504); and, at the end, in the engine's own pool (nothing acquired, every
pooled connection idle or closed) and the gateway's connection caps (every slot free).
The raw ASGI interface of the whole Gateway; real aiohttp upstreams on 127.0.0.1."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from aiohttp import web

from fallback_mw import Gateway
from fallback_mw.request.types import Message
from tests.helpers import http_scope
from tests.upstreams import host_app, status_handler, upstream

pytestmark = pytest.mark.anyio

LIMIT = 4096  # max_response_body
EVENT = b'data: {"x": 1}\n\n'


async def primary(request: web.Request) -> web.StreamResponse:
    kind = request.path.rsplit("/", 1)[1]
    if kind == "fail":
        return web.Response(status=503, text="busy")
    if kind == "bad":
        return web.Response(status=400, text="no")
    if kind == "moved":
        return web.Response(status=302, headers={"location": "/v1/ok"})
    if kind == "empty":
        return web.Response(status=204)
    if kind == "slow":
        await asyncio.sleep(10)  # past every timeout and deadline here
    if kind == "large":
        return web.Response(body=b"x" * (LIMIT + 1))  # its Content-Length is over the limit
    if kind in ("stream", "stall", "reset", "grows", "long"):
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        events = {"stream": 3, "long": 200, "grows": 2 * LIMIT // len(EVENT)}.get(kind, 1)
        for _ in range(events):
            await response.write(EVENT)
            await asyncio.sleep(0.01 if kind == "long" else 0)
        if kind == "stall":
            await asyncio.sleep(10)  # past idle_timeout_ms: aborted after the commit point
        elif kind == "reset":
            assert request.transport is not None
            request.transport.abort()
        return response
    return web.json_response({"usage": {"prompt_tokens": 3, "completion_tokens": 4}})


def config(engine: str, primary_url: str, backup_url: str) -> dict[str, Any]:
    return {
        "gateway": {
            "engine": engine,
            "max_response_body": LIMIT,
            "deadline_ms": 5000,
            # The probe's answer comes from the primary whatever failed before it.
            "breaker": {"window": 1000, "min_calls": 1000},
        },
        "upstreams": {
            "primary": {
                "url": primary_url,
                "max_connections": 1,
                # Timeouts a loaded machine's local answer never reaches.
                "first_byte_timeout_ms": 1000,
                "idle_timeout_ms": 1000,
            },
            "backup": {"url": backup_url, "max_connections": 1},
        },
        "routes": [{"id": "r", "prefix": "/v1/", "plan": ["primary", "backup"], "retries": 1}],
    }


async def call(
    gateway: Gateway,
    method: str,
    path: str,
    headers: list[tuple[bytes, bytes]] | None = None,
    *,
    leave: str = "",  # "head": the caller leaves before the head; "body": after a chunk
) -> dict[str, Any]:
    """One request through the gateway's ASGI interface: its status and gateway headers."""
    answer: dict[str, Any] = {"status": 0}
    gone = asyncio.Event()
    asked = False

    async def receive() -> Message:
        nonlocal asked
        if not asked:
            asked = True
            return {"type": "http.request", "body": b"", "more_body": False}
        if leave == "head":
            await asyncio.sleep(0.1)  # while the upstream has not answered (it never does)
            return {"type": "http.disconnect"}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            answer["status"] = message["status"]
            for name, value in message["headers"]:
                if name.startswith(b"x-gateway-"):
                    answer[name.decode()] = value.decode()
        elif leave == "body" and message.get("body"):
            gone.set()
            raise OSError("the client left")  # ASGI HTTP 2.4: the server's word for it

    scope = http_scope(method, path, headers=headers or [])
    await asyncio.wait_for(gateway(scope, receive, send), 15)
    return answer


# (what the caller does) -> the status it sees (0: the caller left before the head)
Kind = Callable[[Gateway], Any]
KINDS: dict[str, tuple[Kind, int]] = {
    "served": (lambda g: call(g, "GET", "/v1/ok"), 200),
    "streamed": (lambda g: call(g, "GET", "/v1/stream"), 200),
    "failed over": (lambda g: call(g, "GET", "/v1/fail"), 200),
    "first-byte timeout": (lambda g: call(g, "GET", "/v1/slow"), 200),
    "as-is": (lambda g: call(g, "GET", "/v1/bad"), 400),
    "redirect": (lambda g: call(g, "GET", "/v1/moved"), 302),
    "no content": (lambda g: call(g, "GET", "/v1/empty"), 204),
    "head": (lambda g: call(g, "HEAD", "/v1/ok"), 200),
    "too large before the commit": (lambda g: call(g, "GET", "/v1/large"), 502),
    "too large mid-stream": (lambda g: call(g, "GET", "/v1/grows"), 200),
    "idle timeout mid-stream": (lambda g: call(g, "GET", "/v1/stall"), 200),
    "reset mid-stream": (lambda g: call(g, "GET", "/v1/reset"), 200),
    "caller gone before the head": (lambda g: call(g, "GET", "/v1/slow", leave="head"), 0),
    "caller gone mid-stream": (lambda g: call(g, "GET", "/v1/long", leave="body"), 200),
    "caller's short deadline": (
        lambda g: call(g, "GET", "/v1/slow", [(b"x-gateway-deadline-ms", b"200")]),
        504,
    ),
}


def checked_out(client: Any) -> list[str]:
    """What the engine's own pools hold checked out (internals: aiohttp's connector, the
    httpcore pools of the httpx engine), and the gateway's connection caps not free."""
    held: list[str] = []
    session = getattr(client, "_session", None)
    if session is not None:
        held += [f"aiohttp acquired {proto!r}" for proto in session.connector._acquired]
    for httpx_client in getattr(client, "_clients", {}).values():
        pool = httpx_client._transport._pool
        held += [f"httpcore request {request!r}" for request in pool._requests]
        held += [
            f"httpcore connection {connection!r}"
            for connection in pool._connections
            if not (connection.is_idle() or connection.is_closed())
        ]
    held += [
        f"cap {key} has {slots._value} of {size} free"
        for key, slots in client._caps._slots.items()
        for _, size in [key]
        if slots._value != size
    ]
    return held


@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
async def test_no_connection_is_left_checked_out_after_any_outcome(engine: str) -> None:
    async with upstream(primary) as p, upstream(status_handler(200, b"backup")) as b:
        gateway = Gateway(host_app, config=config(engine, p.url, b.url))
        try:
            for name, (kind, status) in KINDS.items():
                for _ in range(2):
                    answer = await kind(gateway)
                    assert answer["status"] == status, (name, answer)
                # The primary's one connection is free again: the next request has it.
                probe = await call(gateway, "GET", "/v1/ok")
                assert probe == {
                    "status": 200,
                    "x-gateway-route": "r",
                    "x-gateway-attempts": "1",
                    "x-gateway-provider": "primary",
                }, (name, probe)
            client = gateway.services.client
            held = checked_out(client)
            for _ in range(200):  # a close the walk started may still be under way
                if not held:
                    break
                await asyncio.sleep(0.01)
                held = checked_out(client)
            assert held == []
        finally:
            await gateway.aclose()
