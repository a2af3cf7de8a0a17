"""The aiohttp engine's own request path (upstream/aiohttp_request.py) against
`ClientSession.request`, the path it keeps under an aiohttp release it was not read
against: the same bytes on the wire, the same answer read, the same failure kinds, on real
sockets; and what the path is for, a small buffered body sent without a writer task."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fallback_mw.upstream import aiohttp_request
from fallback_mw.upstream.aiohttp_connector import GuardedConnector
from fallback_mw.upstream.aiohttp_engine import AiohttpClient
from fallback_mw.upstream.base import Timeouts, UpstreamError, UpstreamRequest
from tests.hostile.test_hostile_upstreams import raw_upstream

ANSWER = (
    b"HTTP/1.1 201 Created\r\ncontent-type: application/json\r\nx-Mixed-Case: A b\r\n"
    b'set-cookie: a=1\r\nset-cookie: b=2\r\ncontent-length: 12\r\n\r\n{"ok": true}'
)
TIMEOUTS = Timeouts(connect=5.0, first_byte=5.0, idle=5.0)
Behaviour = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_whole_request(reader: asyncio.StreamReader) -> bytes:
    """One request's bytes as they came: its head, then its Content-Length body or its
    chunks up to the last."""
    head = await reader.readuntil(b"\r\n\r\n")
    fields = {
        name.strip().lower(): value.strip()
        for name, _, value in (line.partition(b":") for line in head.split(b"\r\n")[1:])
    }
    if b"content-length" in fields:
        return head + await reader.readexactly(int(fields[b"content-length"]))
    if fields.get(b"transfer-encoding") == b"chunked":
        body = b""
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            body += size_line + await reader.readexactly(size + 2)
            if not size:
                return head + body
    return head


@contextlib.asynccontextmanager
async def socket_upstream(behaviour: Behaviour) -> AsyncIterator[str]:
    async with raw_upstream(behaviour) as (url, _):
        yield url


async def chunks(parts: list[bytes]) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


async def exchange(
    url: str, method: str, headers: list[tuple[str, str]], body: bytes | list[bytes]
) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    client = AiohttpClient(allow_hosts=("127.0.0.1",))
    sent: Any = body if isinstance(body, bytes) else chunks(body)
    try:
        response = await client.send(UpstreamRequest(method, url, headers, sent, TIMEOUTS))
        try:
            read = b"".join([chunk async for chunk in response.iter_chunks()])
        finally:
            await response.aclose()
        return response.status, response.headers, read
    finally:
        await client.aclose()


async def on_both_paths(
    method: str, target: str, headers: list[tuple[str, str]], body: bytes | list[bytes]
) -> list[tuple[list[bytes], Any]]:
    """Each path's requests as the upstream read them, and what the engine read back."""
    seen: list[bytes] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            seen.append(await read_whole_request(reader))
            writer.write(ANSWER if method != "HEAD" else ANSWER[: ANSWER.index(b"\r\n\r\n") + 4])
            await writer.drain()

    results = []
    async with socket_upstream(answer) as url:
        for on in (True, False):
            with engine_path(on):
                answered = await exchange(url + target, method, headers, body)
            results.append((list(seen), answered))
            seen.clear()
    return results


@contextlib.contextmanager
def engine_path(own: bool) -> Iterator[None]:
    """The engine on its own path (`own`) or on ClientSession.request, for the block."""
    before = aiohttp_request.supported()
    aiohttp_request.use(own)
    try:
        yield
    finally:
        aiohttp_request.use(before)


@pytest.fixture(autouse=True)
def _own_path_supported() -> None:
    if not aiohttp.__version__.startswith(aiohttp_request._READ_AGAINST):
        pytest.skip("the installed aiohttp is not the release the engine's path was read against")


names = st.text("abcdefghijklmnopqrstuvwxyz-", min_size=1, max_size=12).map(lambda s: "x-" + s)
values = st.text("abcdefghijklmnopqrstuvwxyzABC0123456789 ;=/.", max_size=40).map(str.strip)
sizes = st.sampled_from([0, 1, 90, 16 * 1024, 16 * 1024 + 1, 70_000])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    method=st.sampled_from(["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]),
    headers=st.lists(st.tuples(names, values), max_size=6),
    size=sizes,
    streamed=st.booleans(),
    query=st.sampled_from(["", "?a=1&b=%2F%3F", "?q=caf%C3%A9"]),
)
def test_both_paths_send_the_same_bytes_and_read_the_same_answer(
    method: str, headers: list[tuple[str, str]], size: int, streamed: bool, query: str
) -> None:
    """A request of any method, head fields, body size (empty, below, at and above the
    size written with the head, past the writer's drain threshold), buffered or streamed,
    reaches the upstream byte for byte as ClientSession.request sends it, and its answer
    (status, head fields in order and spelling, body) is read alike."""
    body = bytes(range(256)) * (size // 256) + b"z" * (size % 256)
    sent: bytes | list[bytes] = [body[:7], body[7:]] if streamed and body else body
    fields = [("content-type", "application/json"), *headers]
    own, public = asyncio.run(on_both_paths(method, "/v1/chat" + query, fields, sent))
    assert own == public
    assert len(own[0]) == 1 and own[0][0].startswith(f"{method} /v1/chat{query} ".encode())
    assert own[1][0] == 201 and (method == "HEAD" or own[1][2] == b'{"ok": true}')


# A field aiohttp's request decides itself: such a request goes through OneWriteRequest,
# not the lean request (upstream/aiohttp_lean.py).
DECIDED = [("Host", "upstream.example:8080"), ("Content-Encoding", "identity")]


@pytest.mark.parametrize("method", ["GET", "POST"])
@pytest.mark.parametrize("query", ["?a=1&b=%2F%3F", "?q=caf%C3%A9&empty="])
@pytest.mark.parametrize("decided", [None, *DECIDED], ids=["lean", "host", "coding"])
def test_the_target_goes_out_byte_for_byte_with_its_query(
    method: str, query: str, decided: tuple[str, str] | None
) -> None:
    """The property above for the request line alone, a few fixed cases, on the lean
    request and on OneWriteRequest (a field aiohttp decides): the negative controls' test
    (scripts/mutants.py `own_path_drops_the_query`, `lean_request_drops_the_query`), which
    a failing property would spend minutes shrinking."""
    body = b'{"model": "m"}' if method == "POST" else b""
    fields = [] if decided is None else [decided]
    own, public = asyncio.run(on_both_paths(method, "/v1/chat" + query, fields, body))
    assert own[0][0].split(b"\r\n", 1)[0] == f"{method} /v1/chat{query} HTTP/1.1".encode()
    assert own == public


@pytest.mark.parametrize("decided", DECIDED, ids=["host", "coding"])
@pytest.mark.parametrize("method", ["GET", "POST", "DELETE"])
def test_a_field_aiohttp_decides_goes_out_as_the_session_sends_it(
    decided: tuple[str, str], method: str
) -> None:
    """A Host (which aiohttp puts first in place of its own) or a Content-Encoding, among
    other fields, reaches the upstream as ClientSession.request sends it."""
    fields = [("x-a", "1"), decided, ("x-b", "2")]
    own, public = asyncio.run(on_both_paths(method, "/v1/chat", fields, b"{}"))
    assert own == public
    assert decided[1].encode() in own[0][0]


async def keep_answering(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """An upstream that answers every request on its connection with ANSWER."""
    while True:
        await read_whole_request(reader)
        writer.write(ANSWER)
        await writer.drain()


async def counted_sends(
    requests: list[UpstreamRequest], *, read: bool = True
) -> tuple[int, int, int]:
    """How many of `requests` went through OneWriteRequest (the rest through the lean
    request), then how many connections the engine's pool holds checked out and kept
    alive after them, each answer read whole (`read`) or closed unread."""
    made: list[int] = []
    original = aiohttp_request.OneWriteRequest.__init__

    def counting(self: Any, *args: Any, **kwargs: Any) -> None:
        made.append(1)
        original(self, *args, **kwargs)

    client = AiohttpClient(allow_hosts=("127.0.0.1",))
    try:
        with engine_path(True), pytest.MonkeyPatch.context() as patch:
            patch.setattr(aiohttp_request.OneWriteRequest, "__init__", counting)
            for request in requests:
                response = await client.send(request)
                if read:
                    assert b"".join([chunk async for chunk in response.iter_chunks()])
                await response.aclose()
        assert client._session is not None
        pool: Any = client._session.connector
        return len(made), len(pool._acquired), sum(map(len, pool._conns.values()))
    finally:
        await client.aclose()


@pytest.mark.anyio
async def test_the_usual_attempt_goes_out_lean_on_one_kept_alive_connection() -> None:
    """What the lean request is for: a small buffered body (or none), no proxy, no field
    aiohttp decides, sent without aiohttp's ClientRequest; its answer read whole gives the
    connection back to the pool, and the next attempt is sent on it."""
    connections: list[int] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        await keep_answering(reader, writer)

    async with socket_upstream(answer) as url:
        usual = [
            UpstreamRequest(method, url + "/v1", [("content-type", "text/plain")], body, TIMEOUTS)
            for method, body in (("POST", b"a" * 100), ("GET", b""), ("DELETE", b""))
        ]
        assert await counted_sends(usual) == (0, 0, 1)
        assert len(connections) == 1
        # Any other: a field aiohttp decides, a body above what goes with the head.
        others = [
            UpstreamRequest("POST", url + "/v1", [DECIDED[0]], b"a", TIMEOUTS),
            UpstreamRequest("POST", url + "/v1", [], b"a" * (16 * 1024 + 1), TIMEOUTS),
        ]
        made, _, _ = await counted_sends(others)
        assert made == 2


@contextlib.contextmanager
def counted_connects() -> Iterator[list[int]]:
    """Calls of the engine connector's `connect` (aiohttp's pool path) while in it."""
    calls: list[int] = []
    original = GuardedConnector.connect

    async def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return await original(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(GuardedConnector, "connect", counting)
        yield calls


@pytest.mark.anyio
async def test_a_kept_alive_connection_is_taken_from_the_pool_without_connect() -> None:
    """The lean request takes the pool's next kept-alive connection itself (aiohttp_lean
    `take`), and gives it back itself (`give_back`): only the first attempt, which finds the
    pool empty, goes through the connector's `connect`; one connection serves all three,
    and the first-byte timer still runs on the reused ones (an upstream that answers
    nothing on a kept-alive connection is a first_byte timeout, not a hang)."""
    connections: list[int] = []

    async def three_then_none(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        for _ in range(3):
            await read_whole_request(reader)
            writer.write(ANSWER)
            await writer.drain()
        await reader.read()  # the fourth request is never answered

    async with socket_upstream(three_then_none) as url:
        request = UpstreamRequest("POST", url + "/v1", [], b"{}", TIMEOUTS)
        with counted_connects() as calls:
            assert await counted_sends([request] * 3) == (0, 0, 1)
        assert (len(calls), len(connections)) == (1, 1)
        client = AiohttpClient(allow_hosts=("127.0.0.1",))
        quick = Timeouts(connect=5.0, first_byte=0.3, idle=5.0)
        try:
            with engine_path(True), counted_connects() as calls:
                for _ in range(3):
                    response = await client.send(UpstreamRequest("GET", url, [], b"", quick))
                    assert [chunk async for chunk in response.iter_chunks()]
                    await response.aclose()
                with pytest.raises(UpstreamError) as raised:
                    await asyncio.wait_for(  # never armed, it would wait for good
                        client.send(UpstreamRequest("POST", url, [], b"{}", quick)), 5
                    )
            assert (raised.value.kind, raised.value.phase) == ("timeout", "first_byte")
            assert len(calls) == 1
        finally:
            await client.aclose()


@pytest.mark.anyio
async def test_a_connection_given_back_wakes_an_attempt_waiting_for_a_slot() -> None:
    """Under a connection limit of one, a second attempt waits for the slot; the first's
    connection given back by the lean request wakes it (aiohttp's own release, which the
    pool's usual step leaves it to while someone waits), and both are answered on the one
    connection."""
    connections: list[int] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        while True:  # each body's end a moment after its head: the connection is held
            await read_whole_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\npa")
            await writer.drain()
            await asyncio.sleep(0.2)
            writer.write(b"rt")
            await writer.drain()

    async with socket_upstream(answer) as url:
        client = AiohttpClient(allow_hosts=("127.0.0.1",), max_connections=1)
        try:
            with engine_path(True):
                # One before: the pool's cleanup timer armed, as on a gateway serving.
                warm = await client.send(UpstreamRequest("GET", url, [], b"", TIMEOUTS))
                assert b"".join([chunk async for chunk in warm.iter_chunks()]) == b"part"
                await warm.aclose()
                first = await client.send(UpstreamRequest("GET", url, [], b"", TIMEOUTS))
                second = asyncio.ensure_future(
                    client.send(UpstreamRequest("GET", url, [], b"", TIMEOUTS))
                )
                await asyncio.sleep(0.05)
                assert not second.done()  # waiting for the slot the first holds
                assert b"".join([chunk async for chunk in first.iter_chunks()]) == b"part"
                await first.aclose()
                response = await asyncio.wait_for(second, 5)
                assert b"".join([chunk async for chunk in response.iter_chunks()]) == b"part"
                await response.aclose()
        finally:
            await client.aclose()
    assert len(connections) == 1


@pytest.mark.anyio
async def test_a_kept_alive_connection_past_its_keepalive_is_not_taken() -> None:
    """A pooled connection idle longer than the connector's keep-alive is not taken: aiohttp's
    connect closes it and makes another, as it would without the lean request."""
    connections: list[int] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        await keep_answering(reader, writer)

    async with socket_upstream(answer) as url:
        client = AiohttpClient(allow_hosts=("127.0.0.1",))
        try:
            with engine_path(True):
                for _ in range(2):
                    response = await client.send(UpstreamRequest("GET", url, [], b"", TIMEOUTS))
                    assert [chunk async for chunk in response.iter_chunks()]
                    await response.aclose()
                    assert client._session is not None
                    connector: Any = client._session.connector
                    connector._keepalive_timeout = 0.0  # every idle connection is past it
                    await asyncio.sleep(0.01)
        finally:
            await client.aclose()
    assert len(connections) == 2


@pytest.mark.anyio
async def test_an_answer_closed_unread_closes_its_connection() -> None:
    """An answer closed before its body ended cannot leave its connection to the next
    attempt (the rest of the body would be read as that attempt's answer): it is closed,
    not pooled."""

    async def slow_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_whole_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npart")
            await writer.drain()

    async with socket_upstream(slow_body) as url:
        request = UpstreamRequest("GET", url + "/v1", [], b"", TIMEOUTS)
        assert await counted_sends([request], read=False) == (0, 0, 0)


@pytest.mark.anyio
@pytest.mark.parametrize(("size", "tasks"), [(90, 0), (16 * 1024, 0), (16 * 1024 + 1, 1)])
async def test_a_small_buffered_body_goes_out_without_a_writer_task(size: int, tasks: int) -> None:
    """What the path is for: aiohttp on Python 3.11 writes every body from a task of its
    own (ClientRequest.write_bytes); the engine writes a small one with the head, and
    leaves a larger one to that task, which still reads an answer that comes before the
    body is all sent."""

    loop = asyncio.get_running_loop()
    made: list[str] = []
    factory = loop.get_task_factory()

    def counting(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> Any:
        made.append(getattr(coro, "__qualname__", ""))
        if factory is not None:
            return factory(loop, coro, **kwargs)
        return asyncio.Task(coro, loop=loop, **kwargs)

    async with socket_upstream(keep_answering) as url:
        client = AiohttpClient(allow_hosts=("127.0.0.1",))
        try:
            with engine_path(True):
                await (await client.send(UpstreamRequest("GET", url, [], b"-", TIMEOUTS))).aclose()
                loop.set_task_factory(counting)
                try:
                    request = UpstreamRequest("POST", url + "/v1", [], b"a" * size, TIMEOUTS)
                    response = await client.send(request)
                finally:
                    loop.set_task_factory(factory)
                await response.aclose()
        finally:
            await client.aclose()
    assert response.status == 201
    assert len([name for name in made if "write_bytes" in name]) == tasks, made


async def close_unanswered(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await read_whole_request(reader)
    writer.close()


async def reset_after_request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await read_whole_request(reader)
    writer.transport.abort()


async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await read_whole_request(reader)
    writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
    await writer.drain()
    await asyncio.sleep(1)


async def half_a_head(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await read_whole_request(reader)
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-le")
    await writer.drain()
    writer.close()


async def answers_before_the_body(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    await reader.readuntil(b"\r\n\r\n")
    writer.write(
        b"HTTP/1.1 413 Content Too Large\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
    )
    await writer.drain()
    await asyncio.sleep(1)


async def outcome(url: str, body: bytes) -> tuple[str, ...]:
    try:
        status, _, _ = await exchange(url + "/v1", "POST", [], body)
    except UpstreamError as error:
        return (error.kind, error.phase, str(error))
    return (str(status),)


@pytest.mark.anyio
@pytest.mark.parametrize(
    "behaviour",
    [close_unanswered, reset_after_request, garbage, half_a_head, answers_before_the_body],
)
@pytest.mark.parametrize("size", [90, 200_000])
async def test_an_upstream_failing_is_read_alike_on_both_paths(
    behaviour: Behaviour, size: int
) -> None:
    """An upstream that ends, resets, answers what is no HTTP, cuts its head short, or
    answers before reading the body: the same failure kind, phase and words on both
    paths (so the walk's decision and the breaker's mark do not depend on the path)."""
    results = []
    async with socket_upstream(behaviour) as url:
        for on in (True, False):
            with engine_path(on):
                results.append(await outcome(url, b"b" * size))
    assert results[0] == results[1]


@pytest.mark.anyio
async def test_a_refused_connection_is_read_alike_on_both_paths() -> None:
    async with socket_upstream(close_unanswered) as url:
        pass  # the port is free again: nothing listens on it
    results = []
    for on in (True, False):
        with engine_path(on):
            results.append(await outcome(url, b"x"))
    assert results[0] == results[1]
    assert results[0][0] == "refused"


def test_the_engine_runs_on_the_path_the_run_names() -> None:
    """scripts/test.sh's pass of the engine's files on ClientSession.request
    (FMW_TEST_AIOHTTP_SESSION_PATH=1, tests/conftest.py) runs them there; every other run
    takes the engine's own path."""
    assert aiohttp_request.supported() is not bool(os.environ.get("FMW_TEST_AIOHTTP_SESSION_PATH"))
