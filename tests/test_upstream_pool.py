"""Waiting for a free pooled connection is the gateway's own queue: it never counts as the
upstream's connect timeout (which would fail the request over and feed the upstream's breaker
under a burst, e.g. 1,000 concurrent streams against a 512-connection pool)."""

from __future__ import annotations

import asyncio
import gc

import pytest
from aiohttp import web

from fallback_mw.upstream import Timeouts, UpstreamRequest
from fallback_mw.upstream.aiohttp_engine import AiohttpClient
from fallback_mw.upstream.httpx_engine import HttpxClient
from tests.upstreams import status_handler, upstream

CONNECT = 0.2  # the upstream's connect timeout; the held connection is busy much longer
HOLD = 4 * CONNECT


def one_connection_client(engine: str) -> AiohttpClient | HttpxClient:
    if engine == "aiohttp":
        return AiohttpClient(allow_hosts=("127.0.0.1",), max_connections=1)
    return HttpxClient(allow_hosts=("127.0.0.1",), max_connections=1)


@pytest.mark.anyio
@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
async def test_waiting_for_the_pool_is_not_a_connect_timeout(engine: str) -> None:
    client = one_connection_client(engine)
    timeouts = Timeouts(connect=CONNECT, first_byte=30.0, idle=30.0)

    async def fetch() -> bytes:
        request = UpstreamRequest("GET", server.url + "/slow", [], b"", timeouts)
        response = await client.send(request)
        try:
            return b"".join([chunk async for chunk in response.iter_chunks()])
        finally:
            await response.aclose()

    async with upstream(status_handler(200, b"done", delay=HOLD)) as server:
        try:
            # Two requests, one pooled connection: the second waits ~HOLD for it.
            first, second = await asyncio.gather(fetch(), fetch())
        finally:
            await client.aclose()
    assert (first, second) == (b"done", b"done")
    assert server.count == 2


@pytest.mark.anyio
@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
async def test_a_response_dropped_without_aclose_gives_its_slot_back(engine: str) -> None:
    """A response its owner lost before closing it (a cancellation between `send` and the
    relay) must not hold its upstream's `max_connections` slot for ever: with a cap of one,
    the next request would wait for the walk deadline."""
    client: AiohttpClient | HttpxClient  # the pool is large; the cap is the request's
    if engine == "aiohttp":
        client = AiohttpClient(allow_hosts=("127.0.0.1",))
    else:
        client = HttpxClient(allow_hosts=("127.0.0.1",))
    timeouts = Timeouts(connect=CONNECT, first_byte=30.0, idle=30.0)
    async with upstream(status_handler(200, b"done")) as server:
        request = UpstreamRequest(
            "GET", server.url + "/", [], b"", timeouts, max_connections=1, pool_key="u"
        )
        try:
            response = await client.send(request)
            del response  # never closed
            gc.collect()
            async with asyncio.timeout(5):
                again = await client.send(request)
            await again.aclose()
        finally:
            await client.aclose()
    assert server.count == 2


@pytest.mark.anyio
@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
async def test_an_unread_body_that_has_arrived_gives_its_connection_back(engine: str) -> None:
    """A failover status's short body, never read (the walk moves on), came with its head:
    aiohttp has put the connection back in the pool by the time the walk closes the
    response, httpx reads it from what h11 holds as it closes, and the next attempt reuses
    it. A body still arriving closes it (on httpx a new connection for every request that
    failed over: several times aiohttp's CPU per request)."""
    from aiohttp import web

    peers: list[object] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        peers.append(request.transport.get_extra_info("peername") if request.transport else None)
        if request.path == "/short":
            return web.Response(status=503, body=b"overloaded")
        response = web.StreamResponse(status=503)
        response.content_length = 1_000_000
        await response.prepare(request)
        await response.write(b"x" * 1000)
        await asyncio.sleep(0.5)  # the rest never comes before the client gives up
        return response

    app = web.Application()
    app.router.add_get("/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    base = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    client: AiohttpClient | HttpxClient
    if engine == "aiohttp":
        client = AiohttpClient(allow_hosts=("127.0.0.1",))
    else:
        client = HttpxClient(allow_hosts=("127.0.0.1",))
    timeouts = Timeouts(connect=5.0, first_byte=5.0, idle=5.0)
    try:
        for path in ("/short", "/short", "/short", "/long", "/short"):
            response = await client.send(UpstreamRequest("GET", base + path, [], b"", timeouts))
            assert response.status == 503
            await asyncio.sleep(0.05)  # a short body is in by now; a long one is not
            await response.aclose()
    finally:
        await client.aclose()
        await runner.cleanup()
    assert peers[0] == peers[1] == peers[2] == peers[3]  # one connection, reused
    assert peers[4] != peers[3]  # the half-read body's connection was closed


async def _stalled_stream(closed: asyncio.Event) -> tuple[asyncio.Server, str]:
    """An upstream that sends a head and one event, then nothing; `closed` is set once the
    gateway's side of the connection is closed (its read sees the end)."""

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n7\r\ndata: 1\r\n")  # fmt: skip
        await writer.drain()
        await reader.read()  # until the gateway's side closes
        closed.set()
        writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


@pytest.mark.anyio
@pytest.mark.parametrize("later", [0, 1, 2, 3, 4])
async def test_a_second_cancellation_during_the_close_still_closes_the_connection(
    later: int,
) -> None:
    """A relay waiting on an upstream body can be cancelled twice within a few loop
    iterations (a client disconnect and the upstream's idle timer, both due under load).
    httpcore closes the connection of a cancelled read itself, and a second cancellation
    landing in that close cut it short: the connection stayed open and ACTIVE in the pool
    for ever (a socket in CLOSE-WAIT and a pool slot lost per occurrence). The response's
    aclose must still close it."""
    closed = asyncio.Event()
    server, url = await _stalled_stream(closed)
    client = HttpxClient(allow_hosts=("127.0.0.1",))
    timeouts = Timeouts(connect=1.0, first_byte=5.0, idle=30.0)
    try:
        response = await client.send(UpstreamRequest("GET", url + "/", [], b"", timeouts))

        async def relay() -> None:
            async for _chunk in response.iter_chunks():
                pass

        task = asyncio.create_task(relay())
        await asyncio.sleep(0.2)  # the first event read; waiting on the stall
        task.cancel()
        for _ in range(later):
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await response.aclose()
        async with asyncio.timeout(5):
            await closed.wait()
    finally:
        await client.aclose()
        server.close()
        await server.wait_closed()


@pytest.mark.anyio
@pytest.mark.parametrize("later", [0, 1, 2, 3, 4])
async def test_a_second_cancellation_while_waiting_for_the_head_still_closes_the_connection(
    later: int,
) -> None:
    """The same while the upstream has not answered yet (a client disconnect, the walk
    deadline or a hedge race due with the first-byte timer): the send fails, and the
    connection httpcore was closing must not stay open and ACTIVE in its pool."""
    closed = asyncio.Event()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await reader.read()  # never answers; until the gateway's side closes
        closed.set()
        writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    client = HttpxClient(allow_hosts=("127.0.0.1",))
    timeouts = Timeouts(connect=1.0, first_byte=30.0, idle=30.0)
    try:
        task = asyncio.create_task(
            client.send(UpstreamRequest("GET", url + "/", [], b"", timeouts))
        )
        await asyncio.sleep(0.2)  # the request is sent; waiting for the head
        task.cancel()
        for _ in range(later):
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        async with asyncio.timeout(5):
            await closed.wait()
    finally:
        await client.aclose()
        server.close()
        await server.wait_closed()


@pytest.mark.anyio
async def test_a_request_costs_the_httpx_pool_a_linear_scan(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """httpcore's pool bookkeeping, run as each request enters the pool and as each response
    closes, counted every pooled connection again for each idle one: with the 40 kept-alive
    connections here, a request asked ~3,300 connections whether they were idle (the
    httpx engine's CPU per request grew with the square of its pool). Now a few asks per
    connection."""
    import httpcore

    from fallback_mw.upstream import httpx_backend

    client = HttpxClient(allow_hosts=("127.0.0.1",))
    timeouts = Timeouts(connect=5.0, first_byte=5.0, idle=5.0)
    pooled = 40

    async def fetch(url: str) -> None:
        response = await client.send(UpstreamRequest("GET", url, [], b"", timeouts))
        try:
            assert [chunk async for chunk in response.iter_chunks()] == [b"done"]
        finally:
            await response.aclose()

    async with (
        upstream(status_handler(200, b"done", delay=0.3)) as slow,
        upstream(status_handler(200, b"done")) as fast,
    ):
        try:
            # 40 at once: 40 connections, all idle in the pool afterwards.
            await asyncio.gather(*(fetch(slow.url + "/") for _ in range(pooled)))
            asked = 0
            is_idle = httpcore.AsyncHTTP11Connection.is_idle

            def counted(self: httpcore.AsyncHTTP11Connection) -> bool:
                nonlocal asked
                asked += 1
                return is_idle(self)

            polled = 0
            readable = httpx_backend.is_socket_readable

            def counted_poll(sock: object) -> bool:
                nonlocal polled
                polled += 1
                return readable(sock)  # type: ignore[arg-type]

            monkeypatch.setattr(httpcore.AsyncHTTP11Connection, "is_idle", counted)
            monkeypatch.setattr(httpx_backend, "is_socket_readable", counted_poll)
            await fetch(fast.url + "/")
        finally:
            await client.aclose()
    assert slow.count == pooled
    assert asked <= 10 * pooled
    # The idle connections' sockets are polled together, not one poll each (twice a request).
    assert polled < pooled


@pytest.mark.anyio
@pytest.mark.parametrize("pooled", [1, 3])
async def test_an_idle_connection_the_upstream_closed_is_not_reused(pooled: int) -> None:
    """The httpx engine polls its idle connections together (one poll for the pool, not
    one each): one the upstream closed while it sat in the pool is still dropped, never
    handed to the next request (whose write would go into a closed connection)."""
    closed = asyncio.Event()
    ended: list[asyncio.StreamWriter] = []
    accepted = 0

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal accepted
        accepted += 1
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\ndone")
        await writer.drain()
        if accepted <= pooled:
            await asyncio.sleep(0.2)  # all are back in the pool, idle
            writer.close()  # the upstream ends its kept-alive connection
            await writer.wait_closed()
            ended.append(writer)
            if len(ended) == pooled:
                closed.set()
            return
        await reader.read()
        writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/"
    client = HttpxClient(allow_hosts=("127.0.0.1",))
    timeouts = Timeouts(connect=5.0, first_byte=5.0, idle=5.0)

    async def fetch() -> bytes:
        response = await client.send(UpstreamRequest("GET", url, [], b"", timeouts))
        try:
            return b"".join([chunk async for chunk in response.iter_chunks()])
        finally:
            await response.aclose()

    try:
        assert await asyncio.gather(*(fetch() for _ in range(pooled))) == [b"done"] * pooled
        async with asyncio.timeout(5):
            await closed.wait()
        assert await fetch() == b"done"
    finally:
        await client.aclose()
        server.close()
        await server.wait_closed()
    assert accepted == pooled + 1


@pytest.mark.anyio
@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
async def test_the_caps_of_upstreams_gone_are_not_kept(engine: str) -> None:
    """A route store adding and removing routes for weeks names a new upstream each time
    (`job1234-primary`): each name's connection cap was kept for the life of the process.
    Past 256, the caps nobody holds a slot of are dropped (a new one is the same); a cap
    in use is kept, and still caps its upstream."""
    client: AiohttpClient | HttpxClient
    if engine == "aiohttp":
        client = AiohttpClient(allow_hosts=("127.0.0.1",))
    else:
        client = HttpxClient(allow_hosts=("127.0.0.1",))
    timeouts = Timeouts(connect=1.0, first_byte=30.0, idle=30.0)

    async def fetch(name: str, path: str = "/") -> None:
        request = UpstreamRequest(
            "GET", server.url + path, [], b"", timeouts, max_connections=1, pool_key=name
        )
        response = await client.send(request)
        try:
            async for _ in response.iter_chunks():
                pass
        finally:
            await response.aclose()

    release, arrived = asyncio.Event(), asyncio.Event()

    async def handle(request: web.Request) -> web.StreamResponse:
        if request.path == "/slow":
            arrived.set()
            await release.wait()
        return web.Response(body=b"ok")

    async with upstream(handle) as server:
        held = asyncio.create_task(fetch("busy", "/slow"))
        try:
            await arrived.wait()
            for job in range(600):
                await fetch(f"job{job}-primary")
            caps = client._caps._slots
            assert len(caps) <= 256
            assert ("busy", 1) in caps  # its slot is held: kept
        finally:
            release.set()
            await asyncio.gather(held, return_exceptions=True)
            await client.aclose()
