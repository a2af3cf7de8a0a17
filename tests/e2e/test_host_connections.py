"""An answer sent before the request body has arrived, under each server
(docs/operations.md, 'Under each server'). Under `fallback-mw serve` (uvicorn with the head
guard of cli/server_limits.py, h11 and httptools) the rest of the body is read for what it
is and the kept-alive connection serves its next request; hypercorn's HTTP/2, granian's and
daphne's own ways are held as documented. Real sockets, raw bytes where the framing on the
wire matters. The servers come with the dev extra; outside CI a missing one is skipped."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from aiohttp import web

from fallback_mw import Gateway
from fallback_mw.cli.server_limits import uvicorn_limits
from fallback_mw.config import load_config
from tests.e2e.test_host_servers import require_server, server_process, wait_for, write_app
from tests.helpers import free_port, log_text
from tests.upstreams import host_app, serve_asgi, status_handler, upstream

pytestmark = [pytest.mark.e2e, pytest.mark.anyio]

MAX_BODY = 1024 * 1024


def config(url: str, **gateway: Any) -> dict[str, Any]:
    return {
        "gateway": {"allow_hosts": ["127.0.0.1"], "max_request_body": MAX_BODY, **gateway},
        "upstreams": {"primary": {"url": url}},
        "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"]}],
    }


@asynccontextmanager
async def guarded_gateway(url: str, http: str, **gateway: Any) -> AsyncIterator[str]:
    conf = config(url, **gateway)
    app = Gateway(host_app, config=conf)
    try:
        async with serve_asgi(app, **uvicorn_limits(load_config(conf).gateway, http)) as base:
            yield base
    finally:
        await app.aclose()


async def read_answers(stream: Any, count: int, within: float = 10.0) -> list[tuple[int, Any]]:
    """Read `count` answers with a Content-Length each: [(status, JSON body or bytes)]."""
    data = b""
    answers: list[tuple[int, Any]] = []
    with anyio.fail_after(within):
        while len(answers) < count:
            head_end = data.find(b"\r\n\r\n")
            if head_end >= 0:
                head = data[:head_end].decode("latin-1")
                length = re.search(r"(?im)^content-length: *(\d+)", head)
                assert length, head
                end = head_end + 4 + int(length.group(1))
                if len(data) >= end:
                    body = data[head_end + 4 : end]
                    status = int(head.split(" ", 2)[1])
                    try:
                        answers.append((status, json.loads(body)))
                    except ValueError:
                        answers.append((status, body))
                    data = data[end:]
                    continue
            try:
                data += await stream.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionError):
                break
    return answers


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
@pytest.mark.parametrize("http", ["httptools", "h11"])
async def test_the_rest_of_a_body_answered_early_is_not_read_as_the_next_head(
    http: str, framing: str
) -> None:
    """The gateway answers 413 before reading a body over max_request_body; the caller
    still sends it whole (as clients do), then its next request on the same connection.
    uvicorn reads the rest of that body and drops it; serve's head guard counted it as the
    next request's head and wrote a 431 headers_too_large nobody asked for, which the caller
    read as the answer to its next request. Now the next request gets its own answer."""
    size = 3 * MAX_BODY  # far more than max_header_bytes (64 KiB) left after the answer
    if framing == "chunked":
        piece = b"%x\r\n%s\r\n" % (64 * 1024, b"z" * 64 * 1024)
        body = piece * (size // (64 * 1024)) + b"0\r\n\r\n"
        first = b"POST /v1/a HTTP/1.1\r\nhost: gw\r\ntransfer-encoding: chunked\r\n\r\n" + body
    else:
        first = b"POST /v1/a HTTP/1.1\r\nhost: gw\r\ncontent-length: %d\r\n\r\n" % size
        first += b"z" * size
    second = b"GET /v1/b HTTP/1.1\r\nhost: gw\r\n\r\n"
    async with (
        upstream(status_handler(200, b"second")) as primary,
        guarded_gateway(primary.url, http) as base,
    ):
        host, port = base.removeprefix("http://").split(":")
        stream = await anyio.connect_tcp(host, int(port))
        try:
            await stream.send(first)
            await stream.send(second)
            answers = await read_answers(stream, 2)
        finally:
            await stream.aclose()
    assert [status for status, _ in answers] == [413, 200], answers
    assert answers[0][1]["error"]["code"] == "request_too_large"
    assert answers[1][1] == b"second"
    assert [r.path for r in primary.received] == ["/v1/b"]


@pytest.mark.parametrize("http", ["httptools", "h11"])
async def test_a_body_answered_early_and_left_unfinished_closes_the_connection_quietly(
    http: str,
) -> None:
    """The rest of a body answered early cannot hold the connection: it gets what a head
    gets (header_timeout_ms), then the connection is closed with nothing written after the
    413 (the guard answered it with a 408 of its own, for a request never made)."""
    head = b"POST /v1/a HTTP/1.1\r\nhost: gw\r\ncontent-length: %d\r\n\r\n" % (3 * MAX_BODY)
    async with (
        upstream(status_handler(200, b"never")) as primary,
        guarded_gateway(primary.url, http, header_timeout_ms=500) as base,
    ):
        host, port = base.removeprefix("http://").split(":")
        stream = await anyio.connect_tcp(host, int(port))
        data = b""
        try:
            await stream.send(head + b"z" * 1000)
            with anyio.fail_after(10):
                while b"request_too_large" not in data:
                    data += await stream.receive()
            await stream.send(b"z" * 1000)  # more of the body, after its answer; then nothing
            with anyio.fail_after(4):  # uvicorn alone would keep it open
                while True:
                    try:
                        data += await stream.receive()
                    except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionError):
                        break
        finally:
            await stream.aclose()
    assert data.count(b"HTTP/1.1 ") == 1, data
    assert data.startswith(b"HTTP/1.1 413 "), data
    assert primary.count == 0


@pytest.mark.parametrize(
    "version", ["HTTP/1.1 + connection: close", "HTTP/1.0"], ids=["close", "http1.0"]
)
@pytest.mark.parametrize("http", ["httptools", "h11"])
async def test_a_body_answered_early_on_a_closing_connection_is_read_before_the_close(
    http: str, version: str
) -> None:
    """nginx proxies as HTTP/1.0, or as 1.1 with `Connection: close` (its defaults), and,
    with `proxy_request_buffering off`, sends the body as its caller uploads it, reading
    the answer only once it has all gone. The gateway answered 413 early and closed the
    connection with the body still arriving: the kernel reset it, nginx's write failed and
    its caller got nginx's 502 page instead of the 413 (and nginx counted a failure
    against the gateway). The rest of the body is now read and dropped before the close."""
    size = 3 * MAX_BODY
    line = b"HTTP/1.0" if version == "HTTP/1.0" else b"HTTP/1.1"
    head = b"POST /v1/a %s\r\nhost: gw\r\nconnection: close\r\ncontent-length: %d\r\n\r\n" % (
        line,
        size,
    )
    async with (
        upstream(status_handler(200, b"never")) as primary,
        guarded_gateway(primary.url, http) as base,
    ):
        host, port = base.removeprefix("http://").split(":")
        stream = await anyio.connect_tcp(host, int(port))
        sent = True
        try:
            await stream.send(head)
            for _ in range(size // (64 * 1024)):
                await stream.send(b"z" * 64 * 1024)
                await anyio.sleep(0.001)  # an upload arriving, not one write
        except (anyio.BrokenResourceError, ConnectionError):
            sent = False
        try:
            answers = await read_answers(stream, 1)
        finally:
            await stream.aclose()
    assert sent, "the connection was reset under the upload"
    assert [status for status, _ in answers] == [413], answers
    assert answers[0][1]["error"]["code"] == "request_too_large"
    assert primary.count == 0


# --- the other servers (docs/operations.md, 'Under each server'), each as its own process --


async def slow_events(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    for i in range(10):
        await response.write(b"data: %d\n\n" % i)
        await asyncio.sleep(0.1)
    await response.write(b"data: [DONE]\n\n")
    return response


async def an_early_answer_beside_a_stream(port: int) -> tuple[str, str]:
    """On one HTTP/2 connection: an SSE stream, and meanwhile a 2 MB body sent with a method
    the route does not take (the gateway answers 405 without reading it). Returns what
    became of each."""
    url = f"http://127.0.0.1:{port}/v1/chat"
    async with httpx.AsyncClient(http1=False, http2=True, timeout=20) as client:

        async def stream() -> str:
            received = b""
            try:
                async with client.stream("GET", url) as response:
                    assert response.http_version == "HTTP/2"
                    async for chunk in response.aiter_raw():
                        received += chunk
            except httpx.TransportError:
                return "cut"
            return "complete" if received.endswith(b"data: [DONE]\n\n") else "short"

        async def early() -> str:
            await anyio.sleep(0.3)
            try:
                # A server that resets the stream may leave httpx waiting for flow control.
                response = await client.request(
                    "PROPFIND", url, content=b"a" * 2_000_000, timeout=3
                )
            except httpx.TransportError as exc:
                return type(exc).__name__
            return str(response.status_code)

        first, second = await asyncio.gather(stream(), early())
    return first, second


async def test_under_hypercorn_h2c_an_early_answer_cuts_the_other_streams(
    tmp_path: Path,
) -> None:
    """hypercorn's HTTP/2 drops the whole connection when a request's DATA arrives after
    the answer closed its stream (hypercorn issue #329; a KeyError in its log), so another
    caller's stream on the same connection is cut. docs/operations.md says so: when this
    fails, hypercorn has fixed it and that paragraph must say so."""
    require_server("hypercorn")
    write_app(tmp_path, "gateway")
    port = free_port()
    async with upstream(slow_events) as up:
        with server_process(tmp_path, "hypercorn-h2c", up.url, port) as log:
            await wait_for(port, log)
            stream, early = await an_early_answer_beside_a_stream(port)
    assert stream == "cut", (stream, early)
    assert "KeyError" in log_text(log)


async def test_under_granian_http2_an_early_answer_leaves_the_other_streams_alone(
    tmp_path: Path,
) -> None:
    require_server("granian")
    write_app(tmp_path, "gateway")
    port = free_port()
    async with upstream(slow_events) as up:
        with server_process(tmp_path, "granian", up.url, port, ["--http", "2"]) as log:
            await wait_for(port, log)
            stream, _ = await an_early_answer_beside_a_stream(port)
    assert stream == "complete", log_text(log)


@pytest.mark.parametrize(
    ("name", "host", "options"),
    [("daphne", "gateway", ["-v", "0"]), ("uvicorn", "django-middleware", ["--no-access-log"])],
)
async def test_daphne_and_django_hand_the_gateway_a_body_only_once_it_has_all_arrived(
    tmp_path: Path, name: str, host: str, options: list[str]
) -> None:
    """A declared length over max_request_body is a 413 at once under uvicorn; daphne, and
    Django's ASGI handler in front of its middleware, receive the whole body before they
    call the gateway, so the 413 comes only after the upload."""
    require_server(name)
    write_app(tmp_path, host)
    port = free_port()
    size = 9 * 1024 * 1024  # over the default max_request_body (8 MiB)
    head = b"POST /v1/chat HTTP/1.1\r\nhost: gw\r\ncontent-length: %d\r\n\r\n" % size
    async with upstream(status_handler(200, b"never")) as up:
        with server_process(tmp_path, name, up.url, port, options) as log:
            await wait_for(port, log)
            stream = await anyio.connect_tcp("127.0.0.1", port)
            try:
                await stream.send(head + b"z" * 1000)
                with anyio.move_on_after(1.0):
                    early = await stream.receive()
                    pytest.fail(f"answered before the body arrived: {early!r}")
                await stream.send(b"z" * (size - 1000))
                answers = await read_answers(stream, 1)
            finally:
                await stream.aclose()
    assert [status for status, _ in answers] == [413], log_text(log)
    assert up.count == 0
