"""Limits that protect the process: header bytes and count (431), requests in flight
(503 at once), and the server-side head guard `serve` runs (431 / 408 before any app
code, nothing buffered past the limit). Real sockets throughout."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from typing import Any

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fallback_mw import Gateway
from fallback_mw.config import load_config
from fallback_mw.layers.limits import header_refusal
from tests.upstreams import host_app, serve_asgi, silent_server, status_handler, upstream

pytestmark = pytest.mark.anyio


def config(url: str, **gateway: Any) -> dict[str, Any]:
    return {
        "gateway": {"allow_hosts": ["127.0.0.1"], **gateway},
        "upstreams": {"primary": {"url": url}},
        "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"], "deadline_ms": 20_000}],
    }


async def exchange(base: str, request: bytes, *, pause: float = 0.0) -> bytes:
    """Send raw bytes (optionally in two halves with a pause), read until the server closes."""
    host, port = base.removeprefix("http://").split(":")
    stream = await anyio.connect_tcp(host, int(port))
    data = b""
    try:
        if pause:
            await stream.send(request[: len(request) // 2])
            await anyio.sleep(pause)
            request = request[len(request) // 2 :]
        # Refused mid-send: read what the server said.
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            await stream.send(request)
        while True:
            try:
                data += await stream.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionError):
                break
    finally:
        await stream.aclose()
    return data


async def eventually(condition: Callable[[], bool], within: float = 10.0) -> None:
    for _ in range(int(within / 0.02)):
        if condition():
            return
        await anyio.sleep(0.02)
    raise AssertionError("condition not met in time")


def get(path: str, headers: list[tuple[bytes, bytes]] = ()) -> bytes:  # type: ignore[assignment]
    lines = [b"GET " + path.encode() + b" HTTP/1.1", b"host: gw", b"connection: close"]
    lines += [name + b": " + value for name, value in headers]
    return b"\r\n".join(lines) + b"\r\n\r\n"


def error_code(response: bytes) -> tuple[int, str | None]:
    head, _, body = response.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    try:
        return status, json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return status, None


# --- in the gateway (any server; here uvicorn with httptools, which buffers big heads) ----


@pytest.mark.parametrize(
    "headers",
    [
        [(b"x-big", b"a" * 64 * 1024)],
        [(b"x-big", b"a" * 1024 * 1024)],
        [(b"x-f%d" % i, b"v") for i in range(101)],
    ],
    ids=["64KB", "1MB", "101-fields"],
)
async def test_oversized_request_headers_get_431_and_reach_no_upstream(
    headers: list[tuple[bytes, bytes]],
) -> None:
    async with upstream(status_handler(200, b"ok")) as primary:
        gateway = Gateway(host_app, config=config(primary.url))
        try:
            async with serve_asgi(gateway, http="httptools") as base:
                response = await exchange(base, get("/v1/x", headers))
        finally:
            await gateway.aclose()
    assert error_code(response) == (431, "headers_too_large")
    assert primary.count == 0


async def test_headers_within_the_limits_pass() -> None:
    async with upstream(status_handler(200, b"ok")) as primary:
        gateway = Gateway(host_app, config=config(primary.url))
        try:
            async with serve_asgi(gateway, http="httptools") as base:
                headers = [(b"x-f%d" % i, b"v" * 100) for i in range(90)]
                response = await exchange(base, get("/v1/x", headers))
        finally:
            await gateway.aclose()
    assert response.startswith(b"HTTP/1.1 200")
    assert primary.count == 1


async def test_requests_beyond_max_concurrency_get_a_fast_503_overloaded() -> None:
    async with silent_server() as (url, accepted):
        conf = config(url, max_concurrency=2)
        gateway = Gateway(host_app, config=conf)
        try:
            async with serve_asgi(gateway) as base:
                async with anyio.create_task_group() as group:
                    for _ in range(2):
                        group.start_soon(exchange, base, get("/v1/hang"))
                    await eventually(lambda: len(accepted) == 2)  # both at the upstream
                    third = await exchange(base, get("/v1/third"))
                    assert error_code(third) == (503, "overloaded")
                    group.cancel_scope.cancel()
                # The slots free up when those requests end (their clients left).
                await eventually(lambda: gateway.resolver.in_flight.count == 0)
        finally:
            await gateway.aclose()
    assert len(accepted) == 2  # the third never reached the upstream


async def test_a_503_overloaded_says_when_to_retry() -> None:
    """The openai and anthropic SDKs retry a 503 at once unless told: Retry-After."""
    async with silent_server() as (url, accepted):
        gateway = Gateway(host_app, config=config(url, max_concurrency=1))
        try:
            async with serve_asgi(gateway) as base, anyio.create_task_group() as group:
                group.start_soon(exchange, base, get("/v1/hang"))
                await eventually(lambda: len(accepted) == 1)
                second = await exchange(base, get("/v1/second"))
                group.cancel_scope.cancel()
        finally:
            await gateway.aclose()
    head = second.partition(b"\r\n\r\n")[0].lower()
    assert error_code(second) == (503, "overloaded")
    assert b"\r\nretry-after: 1\r\n" in head + b"\r\n"
    assert b"max_concurrency" in second


# --- in the server, as `serve` runs it -----------------------------------------------


def guarded(gateway: Any, http: str, **settings: Any) -> Any:
    from fallback_mw.cli.server_limits import uvicorn_limits

    loaded = load_config({"gateway": settings})
    return serve_asgi(gateway, **uvicorn_limits(loaded.gateway, http))


@pytest.mark.parametrize("http", ["httptools", "h11"])
async def test_the_server_refuses_an_8mib_head_before_buffering_it(http: str) -> None:
    async with upstream(status_handler(200, b"ok")) as primary:
        gateway = Gateway(host_app, config=config(primary.url))
        try:
            async with guarded(gateway, http) as base:
                response = await exchange(base, get("/v1/x", [(b"x-big", b"a" * 8 * 1024 * 1024)]))
                still_ok = await exchange(base, get("/v1/x"))
        finally:
            await gateway.aclose()
    assert error_code(response) == (431, "headers_too_large")
    assert still_ok.startswith(b"HTTP/1.1 200")
    assert primary.count == 1


def fields_of(total: int) -> list[tuple[bytes, bytes]]:
    """Header fields (besides `get`'s host and connection) that bring the request's fields
    to exactly `total` bytes as max_header_bytes counts them (name + value + 4 each), in
    values the test upstream takes (under its 8 KiB field limit)."""
    left = total - (4 + 2 + 4) - (10 + 5 + 4)  # host: gw, connection: close
    fields = []
    for i in range(100):
        name = b"x-f%02d" % i
        size = min(left - len(name) - 4, 7000)
        if size <= 0:
            break
        fields.append((name, b"v" * size))
        left -= len(name) + 4 + size
    assert left == 0, left
    return fields


@pytest.mark.parametrize("http", ["httptools", "h11"])
async def test_header_fields_exactly_at_max_header_bytes_pass_under_serve(http: str) -> None:
    """The limit counts header fields (docs/configuration.md), as the gateway does in any
    server: fields of exactly max_header_bytes are served under `serve` too (its guard once
    counted the request line and final CRLF as well, and refused them), one byte more is
    the gateway's 431."""
    async with upstream(status_handler(200, b"ok")) as primary:
        gateway = Gateway(host_app, config=config(primary.url))
        try:
            async with guarded(gateway, http) as base:
                at_limit = await exchange(base, get("/v1/x", fields_of(65_536)))
                over = await exchange(base, get("/v1/x", fields_of(65_537)))
        finally:
            await gateway.aclose()
    assert at_limit.startswith(b"HTTP/1.1 200"), at_limit[:200]
    assert error_code(over) == (431, "headers_too_large")
    assert primary.count == 1


@pytest.mark.slow
@pytest.mark.parametrize("http", ["httptools", "h11"])
async def test_a_head_that_arrives_too_slowly_gets_408(http: str) -> None:
    async with upstream(status_handler(200, b"ok")) as primary:
        gateway = Gateway(host_app, config=config(primary.url))
        try:
            async with guarded(gateway, http, header_timeout_ms=300) as base:
                # Half the head, then nothing for longer than the head timeout.
                response = await exchange(base, get("/v1/x"), pause=3.0)
        finally:
            await gateway.aclose()
    assert error_code(response) == (408, "request_timeout")
    assert primary.count == 0


async def test_the_head_guard_leaves_kept_alive_and_streaming_connections_alone() -> None:
    async def slow(request: Any) -> Any:
        from aiohttp import web

        await asyncio.sleep(0.6)  # longer than the head timeout
        return web.Response(body=b"slow")

    async with upstream(slow) as primary:
        gateway = Gateway(host_app, config=config(primary.url))
        try:
            async with guarded(gateway, "httptools", header_timeout_ms=300) as base:
                host, port = base.removeprefix("http://").split(":")
                stream = await anyio.connect_tcp(host, int(port))
                one = b"GET /v1/a HTTP/1.1\r\nhost: gw\r\n\r\n"
                data = b""
                for _ in range(2):
                    await stream.send(one)
                    while data.count(b"slow") < 1:
                        data += await stream.receive()
                    data = data.replace(b"slow", b"", 1)
                await stream.aclose()
        finally:
            await gateway.aclose()
    assert primary.count == 2


async def test_a_limit_refusal_is_logged_like_any_routed_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import logging

    from tests.helpers import client_for

    caplog.set_level(logging.INFO, logger="fallback_mw.request")
    gateway = Gateway(host_app, config=config("http://127.0.0.1:9", max_header_count=5))
    try:
        async with client_for(gateway) as client:
            response = await client.get("/v1/x", headers={f"x-h{i}": "v" for i in range(10)})
    finally:
        await gateway.aclose()
    assert response.status_code == 431
    lines = [r for r in caplog.records if r.name == "fallback_mw.request"]
    assert len(lines) == 1
    assert getattr(lines[0], "outcome", None) == "headers_too_large"


async def test_a_431_names_the_limit_that_refused_it_as_its_rule() -> None:
    """Too many fields is `max_header_count`'s refusal, too many bytes `max_header_bytes`'s:
    the body's `rule` (SPEC §12) names the setting an operator would change."""
    from tests.helpers import client_for

    gateway = Gateway(
        host_app, config=config("http://127.0.0.1:9", max_header_count=8, max_header_bytes=2000)
    )
    try:
        async with client_for(gateway) as client:
            many = await client.get("/v1/x", headers={f"x-h{i}": "v" for i in range(10)})
            big = await client.get("/v1/x", headers={"x-big": "a" * 3000})
    finally:
        await gateway.aclose()
    assert many.status_code == big.status_code == 431
    assert many.json()["error"]["rule"] == "max_header_count"
    assert "max_header_count" in many.json()["error"]["message"]
    assert big.json()["error"]["rule"] == "max_header_bytes"


@given(
    st.lists(st.tuples(st.binary(max_size=40), st.binary(max_size=200)), max_size=12),
    st.integers(min_value=0, max_value=14),
    st.integers(min_value=0, max_value=1200),
)
def test_a_head_within_the_field_count_is_refused_as_the_field_by_field_reading_refuses_it(
    headers: list[tuple[bytes, bytes]], max_count: int, max_bytes: int
) -> None:
    """A list of no more fields than `max_header_count` (what a server hands over) is only
    summed, not counted field by field: the same refusal, with the same rule, as the
    reading of any other iterable of fields (counted one by one, the first limit passed
    naming the rule), whichever limit a head passes first."""
    limits = {"max_bytes": max_bytes, "max_count": max_count}
    assert header_refusal(headers, **limits) == header_refusal(iter(headers), **limits)
