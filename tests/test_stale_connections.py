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


def answers_nothing(
    seen: list[bytes], *, hard: bool
) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
    """Reads the request on its new connection and ends it without a byte (a crash)."""

    async def behaviour(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader, seen)
        if hard:
            reset(writer)
        else:
            writer.close()

    return behaviour


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("method", ["PUT", "DELETE", "GET"])
@pytest.mark.parametrize("hard", [False, True], ids=["fin", "reset"])
async def test_a_new_connection_that_ends_unanswered_sends_the_request_once(
    engine: str, method: str, hard: bool
) -> None:
    """aiohttp's own retry sent every GET, PUT and DELETE a second time when the connection
    ended without an answer, a new connection too: a PUT or DELETE the route does not list
    as replayable (SPEC §5: never sent twice) reached the upstream twice. A request that
    is not replayable is sent once; a replayable GET keeps aiohttp's one resend (RFC 9112
    §9.3.1, as tests/hostile/test_hostile_upstreams.py has it), the httpx engine none."""
    seen: list[bytes] = []
    async with raw_upstream(answers_nothing(seen, hard=hard)) as (url, accepted):
        response = (await two_requests(config(url, engine), method))[0]
    assert response.status_code == 502, response.text
    assert response.headers["x-gateway-attempts"] == "1"
    sends = 2 if method == "GET" and engine == "aiohttp" else 1
    assert seen == [method.encode()] * 2 * sends  # for each of the two requests made
    assert len(accepted) == 2 * sends


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_replayable_post_on_a_new_connection_that_ends_unanswered_is_sent_once(
    engine: str,
) -> None:
    """A POST the route replays fails over to the next candidate like any failure on a new
    connection: it is not sent to the same upstream a second time inside the attempt."""
    seen: list[bytes] = []
    async with raw_upstream(answers_nothing(seen, hard=True)) as (url, _):
        cfg = config(url, engine, replayable_methods=["GET", "POST"])
        response = (await two_requests(cfg, "POST"))[0]
    assert response.status_code == 502, response.text
    assert seen == [b"POST"] * 2  # once for each of the two requests


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("hard", [False, True], ids=["fin", "reset"])
async def test_a_replayable_request_lost_on_a_stale_connection_goes_again_on_a_new_one(
    engine: str, hard: bool
) -> None:
    """A replayable request (a GET) sent on a pooled connection the upstream closed as it
    went out is sent once more, on a new connection, within the same attempt: the caller
    gets the answer, not a 502 (the httpx engine: a 502 on a plan of one, else a
    failover and a breaker mark for a connection the upstream closed on purpose)."""
    seen: list[bytes] = []
    async with raw_upstream(closes_its_second_request(seen, hard=hard)) as (url, accepted):
        first, second = await two_requests(config(url, engine), "GET")
    assert (first.status_code, first.text) == (200, "ok")
    assert (second.status_code, second.text) == (200, "ok"), second.text
    assert second.headers["x-gateway-attempts"] == "1"
    assert seen == [b"GET"] * 3  # the second request lost once, then answered
    assert len(accepted) == 2


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    "begun",
    [b"H", b"HTTP/1.1 200 OK\r\n", b"HTTP/1.1 200 OK\r\nx-a: "],
    ids=["byte", "line", "head"],
)
async def test_a_request_whose_answer_began_on_a_stale_connection_is_not_sent_again(
    engine: str, begun: bytes
) -> None:
    """The resend is for a connection lost before any answer. On the aiohttp engine a
    replayable GET whose kept-alive connection ended after bytes of an answer (the upstream
    took the request and began to answer, then closed) went to the upstream a second time
    and the caller got the second answer; the httpx engine sent it once. Both send it once."""
    seen: list[bytes] = []

    async def behaviour(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader, seen)
        writer.write(OK)
        await writer.drain()
        await read_request(reader, seen)
        writer.write(begun)
        await writer.drain()
        writer.close()

    async with raw_upstream(behaviour) as (url, accepted):
        first, second = await two_requests(config(url, engine), "GET")
    assert (first.status_code, first.text) == (200, "ok")
    assert second.status_code == 502, second.text
    assert seen == [b"GET"] * 2
    assert len(accepted) == 1


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_put_the_route_lists_as_replayable_goes_again_on_a_new_one(engine: str) -> None:
    seen: list[bytes] = []
    async with raw_upstream(closes_its_second_request(seen)) as (url, _):
        cfg = config(url, engine, replayable_methods=["GET", "PUT"])
        first, second = await two_requests(cfg, "PUT")
    assert (first.status_code, second.status_code) == (200, 200), second.text
    assert seen == [b"PUT"] * 3


@pytest.mark.parametrize("engine", ENGINES)
async def test_connections_the_upstream_closed_are_closed_here_without_more_traffic(
    engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a burst, the upstream closes its idle kept-alive connections (uvicorn's 5 s,
    nginx's keepalive_timeout) and no request follows (a fallback's pool, a quiet night):
    the httpx engine kept each one open on its side for ever (httpcore looks at idle
    connections only when a request comes), a socket in CLOSE-WAIT each, up to 128 a pool.
    aiohttp's connector closes them as they end; the httpx engine now sweeps its pool."""
    from fallback_mw.upstream import Timeouts, UpstreamRequest, httpx_engine
    from fallback_mw.upstream.aiohttp_engine import AiohttpClient
    from fallback_mw.upstream.httpx_engine import HttpxClient

    monkeypatch.setattr(httpx_engine, "IDLE_SWEEP_SECONDS", 0.2)
    burst = 5
    answered = asyncio.Event()
    in_flight = 0
    closed_here = 0
    all_closed = asyncio.Event()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal in_flight, closed_here
        await read_request(reader, [])
        in_flight += 1
        if in_flight == burst:
            answered.set()
        await answered.wait()  # all five at once: five connections
        writer.write(OK)
        await writer.drain()
        await asyncio.sleep(0.3)
        writer.write_eof()  # the upstream's idle timeout: its end of the connection
        if await reader.read() == b"":  # and the gateway's end, once it closes it
            closed_here += 1
            if closed_here == burst:
                all_closed.set()
        writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/"
    client = (AiohttpClient if engine == "aiohttp" else HttpxClient)(allow_hosts=("127.0.0.1",))
    timeouts = Timeouts(connect=5.0, first_byte=5.0, idle=5.0)

    async def fetch() -> bytes:
        response = await client.send(UpstreamRequest("GET", url, [], b"", timeouts))
        try:
            return b"".join([chunk async for chunk in response.iter_chunks()])
        finally:
            await response.aclose()

    try:
        assert await asyncio.gather(*(fetch() for _ in range(burst))) == [b"ok"] * burst
        async with asyncio.timeout(10):
            await all_closed.wait()
    finally:
        await client.aclose()
        server.close()
        await server.wait_closed()
