"""Hostile upstreams on real sockets, each classified as SPEC §5 says, on both engines,
with a budget on the route: whatever the upstream does, no hold stays in the ledger.

Before the response head (reset, invalid status line, endless headers): failover-class,
the backup serves. After the commit point (reset, also of a body that ends with its
connection, truncated body, a never-ending or huge stream): the client response is
aborted, never ended as if complete, never restarted. A redirect is an answer (never
followed); a declared length over max_response_body is a local 502 `response_too_large`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from decimal import Decimal
from typing import Any

import httpx
import pytest
from aiohttp import web
from anyio import fail_after as anyio_fail_after

from fallback_mw import Gateway
from fallback_mw.config import BudgetConfig
from tests.helpers import http_scope
from tests.upstreams import host_app, serve_asgi, status_handler, upstream

pytestmark = pytest.mark.anyio

Behaviour = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
MAX_RESPONSE = 256 * 1024


async def read_head(reader: asyncio.StreamReader) -> None:
    await reader.readuntil(b"\r\n\r\n")


def reset(writer: asyncio.StreamWriter) -> None:
    """Close with SO_LINGER 0: the peer sees a TCP reset, not a clean end."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def reset_before_head(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await read_head(reader)
    reset(writer)


async def invalid_status_line(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await read_head(reader)
    writer.write(b"HTTP/1.1 two-hundred OK\r\ncontent-length: 2\r\n\r\nok")
    await writer.drain()
    writer.close()


async def endless_headers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await read_head(reader)
    writer.write(b"HTTP/1.1 200 OK\r\n")
    with contextlib.suppress(OSError):
        for n in range(1_000_000):
            writer.write(b"x-h%d: %s\r\n" % (n, b"a" * 100))
            await writer.drain()
    writer.close()


async def reset_after_head(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await read_head(reader)
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100000\r\n\r\n" + b"a" * 10)
    await writer.drain()
    await asyncio.sleep(0.2)
    reset(writer)


async def truncated_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await read_head(reader)
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n" + b"a" * 10)
    await writer.drain()
    await asyncio.sleep(0.2)
    writer.close()


async def reset_close_delimited(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A body without Content-Length or chunked framing (it ends when the connection
    closes, RFC 9112 §6.3) cut by a reset: not its end."""
    await read_head(reader)
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n"
                 b'data: {"n": 1}\n\n')  # fmt: skip
    await writer.drain()
    await asyncio.sleep(0.2)
    reset(writer)


async def close_delimited(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await read_head(reader)
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n"
                 b'data: {"n": 1}\n\n')  # fmt: skip
    await writer.drain()
    await asyncio.sleep(0.2)
    writer.write(b"data: [DONE]\n\n")
    await writer.drain()
    writer.close()


async def never_ending_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await read_head(reader)
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                 b"transfer-encoding: chunked\r\n\r\n")  # fmt: skip
    event = b'data: {"n": 1}\n\n'
    with contextlib.suppress(OSError):
        while True:
            writer.write(b"%x\r\n%s\r\n" % (len(event) * 64, event * 64))
            await writer.drain()
    writer.close()


async def huge_declared(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await read_head(reader)
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1000000000000\r\n\r\n" + b"a" * 1000)
    with contextlib.suppress(OSError):
        await writer.drain()
        await asyncio.sleep(5)
    writer.close()


async def redirect_to_metadata(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await read_head(reader)
    writer.write(b"HTTP/1.1 302 Found\r\nlocation: http://169.254.169.254/latest/meta-data/\r\n"
                 b"content-length: 0\r\n\r\n")  # fmt: skip
    await writer.drain()
    writer.close()


async def absurd_usage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await read_head(reader)
    body = json.dumps(
        {"model": "m", "usage": {"prompt_tokens": 10**40, "completion_tokens": -(10**40)}}
    ).encode()
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
    await writer.drain()
    writer.close()


@asynccontextmanager
async def raw_upstream(behaviour: Behaviour) -> AsyncIterator[tuple[str, list[int]]]:
    accepted: list[int] = []
    tasks: set[asyncio.Task[None]] = set()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        try:
            with contextlib.suppress(Exception):
                await behaviour(reader, writer)
        finally:
            writer.transport.abort()  # whatever the behaviour left open

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", accepted
    finally:
        server.close()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.wait_closed()


def config(hostile: str, backup: str, engine: str) -> dict[str, Any]:
    return {
        "gateway": {"allow_hosts": ["127.0.0.1"], "engine": engine,
                    "max_response_body": MAX_RESPONSE, "deadline_ms": 20_000},
        "upstreams": {
            "hostile": {"url": hostile, "first_byte_timeout_ms": 3000, "idle_timeout_ms": 3000},
            "backup": {"url": backup},
        },
        "routes": [{"id": "r", "prefix": "/v1/", "plan": ["hostile", "backup"], "retries": 1,
                    "budget": "b"}],
        "budgets": {"b": {"limit": "100", "default_hold": "0.5"}},
        "prices": {"m": {"input_per_mtok": "1", "output_per_mtok": "1"}},
    }  # fmt: skip


async def held(gateway: Gateway) -> Decimal:
    ledger = gateway.services.ledger
    assert ledger is not None
    status = await ledger.status("b", BudgetConfig(limit=Decimal(100)))
    return status.held


async def run(behaviour: Behaviour, engine: str) -> tuple[Any, int, Decimal]:
    """One GET through a real server. Returns (response or the exception the client
    got, how many connections the hostile upstream accepted, the ledger's held amount
    once the request has ended on the gateway's side)."""
    async with (
        raw_upstream(behaviour) as (url, accepted),
        upstream(status_handler(200, b"backup")) as backup,
    ):
        gateway = Gateway(host_app, config=config(url, backup.url, engine))
        try:
            async with serve_asgi(gateway) as base, httpx.AsyncClient(base_url=base) as client:
                result: Any
                try:
                    result = await client.get("/v1/x", timeout=30)
                except httpx.HTTPError as exc:
                    result = exc
                for _ in range(250):  # the gateway's side settles once the walk has ended
                    if await held(gateway) == 0:
                        break
                    await asyncio.sleep(0.02)
                remaining = await held(gateway)
        finally:
            await gateway.aclose()
    return result, len(accepted), remaining


ENGINES = ["aiohttp", "httpx"]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    "behaviour",
    [reset_before_head, invalid_status_line, endless_headers],
    ids=["reset-before-head", "invalid-status-line", "endless-headers"],
)
async def test_failures_before_the_head_fail_over(behaviour: Behaviour, engine: str) -> None:
    result, accepted, remaining = await run(behaviour, engine)
    assert isinstance(result, httpx.Response), result
    assert result.status_code == 200 and result.text == "backup"
    assert result.headers["x-gateway-attempts"] == "2"
    # aiohttp itself resends an idempotent request once when the connection drops before
    # the response head (RFC 9112 §9.3.1); httpx does not. Either way: one gateway attempt.
    assert accepted == (2 if engine == "aiohttp" and behaviour is reset_before_head else 1)
    assert remaining == 0


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    "behaviour",
    [reset_after_head, truncated_body, never_ending_stream, reset_close_delimited],
    ids=["reset-after-head", "truncated-body", "never-ending-stream", "reset-close-delimited"],
)
async def test_failures_after_the_commit_point_abort_the_response(
    behaviour: Behaviour, engine: str
) -> None:
    result, accepted, remaining = await run(behaviour, engine)
    # Never ended as if complete: the client's read fails (no clean end of body).
    assert isinstance(result, httpx.RemoteProtocolError | httpx.ReadError), result
    assert accepted == 1  # never restarted on the backup either
    assert remaining == 0


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_body_ended_by_a_clean_close_is_relayed_whole(engine: str) -> None:
    result, accepted, remaining = await run(close_delimited, engine)
    assert isinstance(result, httpx.Response), result
    assert result.status_code == 200 and result.text.endswith("data: [DONE]\n\n")
    assert accepted == 1 and remaining == 0


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_declared_length_over_the_limit_is_a_local_502(engine: str) -> None:
    result, accepted, remaining = await run(huge_declared, engine)
    assert accepted == 1  # no failover for a local 502
    assert isinstance(result, httpx.Response), result
    assert result.status_code == 502
    assert result.json()["error"]["code"] == "response_too_large"
    assert remaining == 0


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_redirect_to_the_metadata_address_is_passed_back_never_followed(
    engine: str,
) -> None:
    result, accepted, remaining = await run(redirect_to_metadata, engine)
    assert isinstance(result, httpx.Response), result
    assert result.status_code == 302
    assert result.headers["x-gateway-attempts"] == "1"
    assert result.headers["x-gateway-provider"] == "hostile"
    assert accepted == 1
    assert remaining == 0


@pytest.mark.parametrize("engine", ENGINES)
async def test_absurd_usage_numbers_settle_the_hold(engine: str) -> None:
    result, accepted, remaining = await run(absurd_usage, engine)
    assert accepted == 1
    assert isinstance(result, httpx.Response), result
    assert result.status_code == 200
    assert remaining == 0


def answer_with(status: int, *fields: bytes) -> Behaviour:
    async def behaviour(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(b"HTTP/1.1 %d X\r\n%scontent-length: 2\r\n\r\nok"
                     % (status, b"".join(f + b"\r\n" for f in fields)))  # fmt: skip
        await writer.drain()
        writer.close()

    return behaviour


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    ("status", "fields"),
    [
        # U+00B2 (latin-1 0xB2) passes str.isdigit() but float() refuses it.
        (200, (b"retry-after: \xb2",)),
        (429, (b"retry-after: 1\xb2",)),
        (429, (b"ratelimit-remaining: 0", b"ratelimit-reset: \xb2")),
    ],
    ids=["200-retry-after", "429-retry-after", "429-ratelimit-reset"],
)
async def test_a_pool_upstreams_unreadable_retry_after_is_never_a_500(
    status: int, fields: tuple[bytes, ...], engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every answer from a credential pool is read for its Retry-After (and a 429 for its
    # quota reset); a value str.isdigit() accepts and float() does not broke the walk.
    monkeypatch.setenv("POOL_A", "key-a")
    monkeypatch.setenv("POOL_B", "key-b")
    async with raw_upstream(answer_with(status, *fields)) as (url, _):
        conf = {
            "gateway": {"allow_hosts": ["127.0.0.1"], "engine": engine},
            "upstreams": {"pool": {"url": url, "auth_env": ["POOL_A", "POOL_B"]}},
            "routes": [{"id": "r", "prefix": "/v1/", "plan": ["pool"]}],
        }
        gateway = Gateway(host_app, config=conf)
        try:
            async with serve_asgi(gateway) as base, httpx.AsyncClient(base_url=base) as client:
                response = await client.get("/v1/x", timeout=30)
        finally:
            await gateway.aclose()
    assert response.status_code == status, response.text
    assert response.text == "ok"


async def big_body(request: web.Request) -> web.StreamResponse:
    return web.Response(body=b"B" * (8 * 1024 * 1024))


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("http", ["h11", "httptools"])
async def test_a_caller_that_stops_reading_does_not_hold_the_upstreams_connections(
    engine: str, http: str
) -> None:
    # The relay waits for the client to take each chunk. Without a bound on that wait, a
    # caller that requests a large answer and never reads it holds an upstream connection
    # for as long as it likes: `max_connections` such callers (100 by default) made every
    # other request to that upstream wait for the pool until its deadline (504).
    async with upstream(big_body) as primary:
        conf = {
            "gateway": {"allow_hosts": ["127.0.0.1"], "engine": engine, "deadline_ms": 4000},
            "upstreams": {
                "primary": {"url": primary.url, "max_connections": 1, "idle_timeout_ms": 500}
            },
            "routes": [{"id": "r", "prefix": "/v1/", "plan": ["primary"]}],
        }
        gateway = Gateway(host_app, config=conf)
        try:
            async with serve_asgi(gateway, http=http) as base:
                port = int(base.rsplit(":", 1)[1])
                stalled = socket.socket()
                stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                stalled.setblocking(False)
                loop = asyncio.get_running_loop()
                await loop.sock_connect(stalled, ("127.0.0.1", port))
                await loop.sock_sendall(stalled, b"GET /v1/big HTTP/1.1\r\nhost: gw\r\n\r\n")
                try:
                    assert (await loop.sock_recv(stalled, 12)).startswith(b"HTTP/1.1 200")
                    # ...and reads nothing more: the relay blocks on this client.
                    async with httpx.AsyncClient(base_url=base) as client:
                        response = await client.get("/v1/next", timeout=30)
                finally:
                    stalled.close()
        finally:
            await gateway.aclose()
    assert response.status_code == 200, response.text
    assert len(response.content) == 8 * 1024 * 1024


FORGED = b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\nx-forged: 1\r\n\r\nFORGED"


async def keep_alive_with_extra_bytes(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """A kept-alive upstream that writes more than each answer's framing says: a body on
    an answer to HEAD (naive servers do), or bytes past its Content-Length. What is left
    over is a whole forged response, sent with the answer it follows."""
    served = 0
    while True:
        head = await reader.readuntil(b"\r\n\r\n")
        served += 1
        if head.startswith((b"HEAD /v1/head", b"GET /v1/over")):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello" + FORGED)
        else:
            body = b"answer-%d" % served
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("first", ["HEAD /v1/head", "GET /v1/over"])
async def test_bytes_past_an_answers_framing_never_become_the_next_callers_answer(
    engine: str, first: str
) -> None:
    # The httpx engine pooled the connection with the leftover bytes in h11's buffer, so
    # the next request on it (another caller's) was answered with the forged response.
    method, path = first.split(" ")
    async with raw_upstream(keep_alive_with_extra_bytes) as (url, _):
        conf = {
            "gateway": {"allow_hosts": ["127.0.0.1"], "engine": engine},
            "upstreams": {"primary": {"url": url, "max_connections": 1}},
            "routes": [{"id": "r", "prefix": "/v1/", "plan": ["primary"]}],
        }
        gateway = Gateway(host_app, config=conf)
        try:
            async with serve_asgi(gateway) as base, httpx.AsyncClient(base_url=base) as client:
                await client.request(method, path, timeout=30)
                victim = await client.get("/v1/victim", timeout=30)
        finally:
            await gateway.aclose()
    assert "x-forged" not in victim.headers
    assert victim.status_code == 200 and victim.text.startswith("answer-"), victim.text


def repeats_its_answer_late() -> Behaviour:
    """A kept-alive upstream that sends its first answer again a moment later, while the
    connection sits idle in the gateway's pool (a duplicating proxy; a server's late 408
    is the same shape). Answers are numbered across connections."""
    served = 0

    async def behaviour(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal served
        while True:
            await reader.readuntil(b"\r\n\r\n")
            served += 1
            body = b"answer-%d" % served
            answer = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
            writer.write(answer)
            await writer.drain()
            if served == 1:
                await asyncio.sleep(0.05)
                writer.write(answer)
                await writer.drain()

    return behaviour


@pytest.mark.parametrize("engine", ENGINES)
async def test_an_answer_written_on_an_idle_connection_never_answers_the_next_caller(
    engine: str,
) -> None:
    # aiohttp parsed the repeat into the idle connection's queue and handed the connection
    # out again: the next caller's request was answered with the first caller's answer.
    async with raw_upstream(repeats_its_answer_late()) as (url, accepted):
        conf = {
            "gateway": {"allow_hosts": ["127.0.0.1"], "engine": engine},
            "upstreams": {"primary": {"url": url}},
            "routes": [{"id": "r", "prefix": "/v1/", "plan": ["primary"]}],
        }
        gateway = Gateway(host_app, config=conf)
        try:
            async with serve_asgi(gateway) as base, httpx.AsyncClient(base_url=base) as client:
                first = await client.get("/v1/first", timeout=30)
                await asyncio.sleep(0.3)  # the repeat has arrived on the idle connection
                victim = await client.get("/v1/victim", timeout=30)
        finally:
            await gateway.aclose()
    assert first.text == "answer-1"
    assert victim.status_code == 200
    assert victim.text == "answer-2"  # its own, on a new connection: never the repeat
    assert len(accepted) == 2


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    "body",
    [b'{"error":{"code":["insufficient_quota"]}}', b'{"error":{"type":{"a":1}}}'],
    ids=["code-list", "type-object"],
)
async def test_a_pool_upstreams_429_with_an_unhashable_error_code_is_never_a_500(
    body: bytes, engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A pool credential's 429 body is read to tell a spent quota from a rate limit; an
    # error code that is a list or an object (not a string) was looked up in a set.
    monkeypatch.setenv("POOL_A", "key-a")
    monkeypatch.setenv("POOL_B", "key-b")

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(b"HTTP/1.1 429 X\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
        await writer.drain()
        writer.close()

    async with raw_upstream(answer) as (url, _):
        conf = {
            "gateway": {"allow_hosts": ["127.0.0.1"], "engine": engine},
            "upstreams": {"pool": {"url": url, "auth_env": ["POOL_A", "POOL_B"]}},
            "routes": [{"id": "r", "prefix": "/v1/", "plan": ["pool"]}],
        }
        gateway = Gateway(host_app, config=conf)
        try:
            async with serve_asgi(gateway) as base, httpx.AsyncClient(base_url=base) as client:
                response = await client.get("/v1/x", timeout=30)
        finally:
            await gateway.aclose()
    assert response.status_code == 429, response.text
    assert response.content == body  # the upstream's answer, relayed whole


TINY_CHUNKS = 20_000


async def tiny_chunks(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Two answers on one kept-alive connection, each in one-byte chunks written at once."""
    for _ in range(2):
        await read_head(reader)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n" + b"1\r\nx\r\n" * TINY_CHUNKS + b"0\r\n\r\n"
        )
        await writer.drain()
    await asyncio.sleep(30)  # kept open: nothing more comes


async def exchange(gateway: Gateway) -> list[dict[str, Any]]:
    """One GET straight through the ASGI interface: every message the gateway sent."""
    messages: list[dict[str, Any]] = []
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if delivered:  # the request went: the caller stays until the end
            await asyncio.Event().wait()
        delivered = True
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    await gateway(http_scope("GET", "/v1/x"), receive, send)
    return messages


@pytest.mark.parametrize("engine", ENGINES)
async def test_an_answer_in_one_byte_chunks_is_relayed_as_it_arrives_not_chunk_by_chunk(
    engine: str,
) -> None:
    # The httpx engine relayed each chunk of a chunked answer on its own (h11 hands each
    # over as one event): an upstream framing 256 KB in one-byte chunks cost 3 s of CPU,
    # 550 times the same answer in 1 KB chunks. What has arrived is relayed together, as
    # on aiohttp; the body's end read that way still ends the answer at once, and the
    # connection serves the next request.
    async with raw_upstream(tiny_chunks) as (url, accepted):
        conf = config(url, url, engine)
        conf["routes"][0]["plan"] = ["hostile"]
        conf["routes"][0]["retries"] = 0
        gateway = Gateway(host_app, config=conf)
        try:
            for _ in range(2):
                with anyio_fail_after(10):
                    messages = await exchange(gateway)
                bodies = [m for m in messages if m["type"] == "http.response.body"]
                assert messages[0]["status"] == 200
                assert b"".join(m["body"] for m in bodies) == b"x" * TINY_CHUNKS
                assert not bodies[-1].get("more_body")
                assert len(bodies) < TINY_CHUNKS // 20, len(bodies)
        finally:
            await gateway.aclose()
    assert len(accepted) == 1  # the second answer came on the same connection
