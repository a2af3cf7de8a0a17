"""SPEC §5: local conditions are not upstream failures. One caller can never open a
breaker for everyone else: a caller's short deadline, a caller hanging up mid-body and a
body over the limit leave the breaker closed; an injected `fail` fault still opens it."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from fallback_mw import Gateway
from fallback_mw.faults import UpstreamFault
from tests.helpers import http_scope
from tests.upstreams import host_app, serve_asgi, status_handler, upstream

pytestmark = pytest.mark.anyio

ENV = {"PRIMARY_KEY": "sk-primary-0001", "BACKUP_KEY": "sk-backup-0002"}


def config(primary: str, backup: str, *, min_calls: int = 2, **route: Any) -> dict[str, Any]:
    return {
        "gateway": {
            "max_request_body": 8192,
            "replay_buffer": 4096,
            "breaker": {"window": 10, "min_calls": min_calls, "cooldown_ms": 60_000},
        },
        "upstreams": {
            "primary": {"url": primary, "auth_env": "PRIMARY_KEY"},
            "backup": {"url": backup, "auth_env": "BACKUP_KEY"},
        },
        "routes": [
            {
                "id": "chat",
                "prefix": "/v1/",
                "plan": ["primary", "backup"],
                "retries": 1,
                "replayable_methods": ["GET", "POST"],
                **route,
            }
        ],
    }


async def ordinary_request_reaches_the_primary(url: str) -> None:
    async with httpx.AsyncClient(base_url=url) as client:
        response = await client.get("/v1/models")
    assert response.status_code == 200
    assert response.headers["x-gateway-provider"] == "primary"
    assert response.headers["x-gateway-attempts"] == "1"


@pytest.mark.parametrize("deadline_ms", ["1", "40"])
async def test_a_short_caller_deadline_never_opens_the_breaker(deadline_ms: str) -> None:
    async with (
        upstream(status_handler(200, delay=0.3)) as p,
        upstream(status_handler(200)) as b,
    ):
        gateway = Gateway(host_app, config=config(p.url, b.url), environ=ENV)
        async with serve_asgi(gateway) as url:
            async with httpx.AsyncClient(base_url=url) as client:
                for _ in range(6):
                    response = await client.get(
                        "/v1/models", headers={"x-gateway-deadline-ms": deadline_ms}
                    )
                    assert response.status_code == 504
                    assert response.json()["error"]["code"] == "deadline_exceeded"
                    if deadline_ms == "40":  # the attempt was in flight when time ran out
                        assert response.headers["x-gateway-attempts"] == "1"
            assert b.count == 0
            # The primary's breaker is still closed: an ordinary caller reaches it.
            await ordinary_request_reaches_the_primary(url)
        await gateway.aclose()


def streamed_body(first: bytes, then: list[dict[str, Any]]) -> Any:
    """An ASGI receive: `first` (more to come), then each of `then` after a short wait."""
    messages: list[dict[str, Any]] = [
        {"type": "http.request", "body": first, "more_body": True},
        *then,
    ]

    async def receive() -> dict[str, Any]:
        if messages:
            message = messages.pop(0)
            if message is not messages and message.get("body") != first:
                await asyncio.sleep(0.05)
            return message
        await asyncio.sleep(3600)
        raise AssertionError("not reached")

    return receive


async def send_raw(gateway: Gateway, receive: Any, *, length: int) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def send(message: Any) -> None:
        sent.append(message)

    scope = http_scope("POST", "/v1/upload", headers=[(b"content-length", str(length).encode())])
    await gateway(scope, receive, send)
    return sent


async def test_callers_that_hang_up_mid_body_never_open_the_breaker() -> None:
    async with upstream(status_handler(200)) as p, upstream(status_handler(200)) as b:
        gateway = Gateway(host_app, config=config(p.url, b.url, min_calls=1), environ=ENV)
        for _ in range(6):
            # 6000 declared (> replay_buffer, streamed to the primary), 5000 sent, then gone.
            receive = streamed_body(b"a" * 5000, [{"type": "http.disconnect"}])
            sent = await send_raw(gateway, receive, length=6000)
            assert not any(m["type"] == "http.response.body" and m.get("body") for m in sent)
        assert b.count == 0
        async with serve_asgi(gateway) as url:
            await ordinary_request_reaches_the_primary(url)
        await gateway.aclose()


async def test_streamed_bodies_over_the_limit_never_open_the_breaker() -> None:
    async with upstream(status_handler(200)) as p, upstream(status_handler(200)) as b:
        gateway = Gateway(host_app, config=config(p.url, b.url, min_calls=1), environ=ENV)
        for _ in range(6):
            # Declared within max_request_body (8192), but the caller sends 15000 bytes.
            more = [
                {"type": "http.request", "body": b"b" * 5000, "more_body": True},
                {"type": "http.request", "body": b"c" * 5000, "more_body": False},
            ]
            sent = await send_raw(gateway, streamed_body(b"a" * 5000, more), length=8000)
            assert sent[0]["type"] == "http.response.start"
            assert sent[0]["status"] == 413
        assert b.count == 0
        async with serve_asgi(gateway) as url:
            await ordinary_request_reaches_the_primary(url)
        await gateway.aclose()


async def test_a_chunked_body_over_the_limit_contacts_no_upstream() -> None:
    received: list[bytes] = []

    async def listener(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received.append(await reader.read(65536))  # any byte at all is a contact
        writer.close()

    server = await asyncio.start_server(listener, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    gateway = Gateway(host_app, config=config(url, f"{url}/backup"), environ=ENV)
    async with (
        serve_asgi(gateway) as gateway_url,
        httpx.AsyncClient(base_url=gateway_url) as client,
    ):

        async def chunks() -> Any:
            for _ in range(20):  # 20 KiB, no Content-Length, max_request_body 8 KiB
                yield b"x" * 1024
                await asyncio.sleep(0.01)

        response = await client.post("/v1/upload", content=chunks())
    await gateway.aclose()
    server.close()
    await server.wait_closed()
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"
    assert received == []


class FailPrimary:
    async def upstream_fault(self, upstream: str) -> UpstreamFault | None:
        return "fail" if upstream == "primary" else None

    async def pinned_candidate(self, route_id: str) -> str | None:
        return None

    async def aclose(self) -> None:
        return None


async def test_an_injected_fail_fault_still_opens_the_breaker() -> None:
    async with upstream(status_handler(200)) as p, upstream(status_handler(200)) as b:
        gateway = Gateway(host_app, config=config(p.url, b.url), environ=ENV, faults=FailPrimary())
        async with serve_asgi(gateway) as url, httpx.AsyncClient(base_url=url) as client:
            attempts = []
            for _ in range(4):
                response = await client.get("/v1/models")
                assert response.status_code == 200
                assert response.headers["x-gateway-provider"] == "backup"
                attempts.append(response.headers["x-gateway-attempts"])
        await gateway.aclose()
    # Two failed `fail` attempts (min_calls = 2) open the primary's breaker: then skipped.
    assert attempts == ["2", "2", "1", "1"]
    assert p.count == 0  # a `fail` fault sends no packet
