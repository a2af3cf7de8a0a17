"""Kept-alive upstream connections the upstream closes, on both engines and real sockets.

The classic race of a pooled connection: the upstream (nginx at `keepalive_timeout`, a
server at its `keepalive_requests`) closes an idle connection just as the gateway sends
the next request on it. The request is answered by nothing: a FIN, or a reset. A new
connection is not a stale one: an upstream that fails there fails the attempt."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from fallback_mw import Gateway
from tests.hostile.test_hostile_upstreams import raw_upstream, reset
from tests.upstreams import host_app, serve_asgi

pytestmark = pytest.mark.anyio

ENGINES = ["aiohttp", "httpx"]
OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


async def read_request(reader: asyncio.StreamReader, seen: list[bytes]) -> None:
    """One request, its head and its Content-Length body; its method goes in `seen`."""
    head = await reader.readuntil(b"\r\n\r\n")
    seen.append(head.split(b" ", 1)[0])
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length" and int(value):
            await reader.readexactly(int(value))


def closes_its_second_request(
    seen: list[bytes], *, hard: bool = False
) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
    """Answers the first request on each connection (kept alive), then closes on the
    next one without a byte: what the gateway sees when the upstream's idle timeout or
    request limit closed the connection as the request went out on it."""

    async def behaviour(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader, seen)
        writer.write(OK)
        await writer.drain()
        await read_request(reader, seen)
        if hard:
            reset(writer)
        else:
            writer.close()

    return behaviour


def config(url: str, engine: str, **route: Any) -> dict[str, Any]:
    return {
        "gateway": {"allow_hosts": ["127.0.0.1"], "engine": engine, "deadline_ms": 20_000},
        "upstreams": {"primary": {"url": url, "first_byte_timeout_ms": 10_000}},
        "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"], "retries": 0, **route}],
    }


async def two_requests(cfg: dict[str, Any], method: str) -> list[httpx.Response]:
    gateway = Gateway(host_app, config=cfg)
    try:
        async with serve_asgi(gateway) as base, httpx.AsyncClient(base_url=base) as client:
            body = b'{"a": 1}' if method in ("POST", "PUT") else None
            return [await client.request(method, "/v1/x", content=body) for _ in range(2)]
    finally:
        await gateway.aclose()


@pytest.mark.parametrize("engine", ENGINES)
async def test_an_upstream_that_closed_without_answering_is_not_named_a_parser_refusal(
    engine: str,
) -> None:
    """The httpx engine read a connection the upstream closed without a byte as an answer
    its parser refused ("the engine's HTTP/1.1 parser refused the upstream's answer"):
    there was no answer. It is a transport failure, said as the aiohttp engine says it."""
    seen: list[bytes] = []
    async with raw_upstream(closes_its_second_request(seen)) as (url, _):
        first, second = await two_requests(config(url, engine), "POST")
    assert first.status_code == 200
    assert second.status_code == 502, second.text
    error = second.json()["error"]
    assert error["code"] == "upstream_failed"
    assert error["message"].startswith("all 1 attempt(s) failed (last failure: transport at")
    assert "parser" not in error["message"]
    assert error["rule"] == "not_replayable_method"
    assert seen == [b"POST", b"POST"]  # never sent again: a POST is not replayable
