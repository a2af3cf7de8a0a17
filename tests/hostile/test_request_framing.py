"""Request framing as an attacker writes it, to a real keep-alive upstream: a
`Transfer-Encoding` beside a `Content-Length` that says something else (through a real
server), a body that is not the length it declared (in-process, as a lenient host hands it
on)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

from fallback_mw import Gateway
from fallback_mw.health.memory import MemoryHealth
from fallback_mw.upstream import Timeouts, UpstreamError, UpstreamRequest, make_client
from tests.upstreams import host_app, serve_asgi, status_handler, upstream

pytestmark = pytest.mark.anyio


async def send_in_pieces(base: str, pieces: list[bytes]) -> bytes:
    """Each piece in its own write, a pause between (the server hands the body to the app
    in more than one message), then everything the gateway answers."""
    host, port = base.removeprefix("http://").split(":")
    stream = await anyio.connect_tcp(host, int(port))
    data = b""
    try:
        for piece in pieces:
            await stream.send(piece)
            await anyio.sleep(0.2)
        with anyio.move_on_after(15):
            while True:
                try:
                    data += await stream.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    break
    finally:
        await stream.aclose()
    return data


@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
@pytest.mark.parametrize("declared", [5000, 2000], ids=["length-over-body", "length-under-body"])
async def test_a_content_length_beside_a_transfer_encoding_is_not_forwarded(
    engine: str, declared: int
) -> None:
    # uvicorn's h11 parser frames such a body by its chunks (RFC 9112 §6.3) and passes both
    # fields on: the gateway sent the caller's length with the longer chunked body, so the
    # upstream waited for bytes that never came (a first-byte timeout booked to the
    # upstream: one caller opening its breaker), got the body cut short (aiohttp), or the
    # request ended in a bare 500 (httpx).
    body = b"x" * 3000
    async with upstream(status_handler(200, b"ok")) as primary:
        conf = {
            "gateway": {"allow_hosts": ["127.0.0.1"], "engine": engine, "replay_buffer": 1024},
            "upstreams": {"primary": {"url": primary.url, "first_byte_timeout_ms": 2000}},
            "routes": [{"id": "r", "prefix": "/v1/", "plan": ["primary"]}],
        }
        gateway = Gateway(host_app, config=conf)
        try:
            async with serve_asgi(gateway, http="h11") as base:
                response = await send_in_pieces(
                    base,
                    [
                        b"POST /v1/x HTTP/1.1\r\nhost: gw\r\nconnection: close\r\n"
                        b"transfer-encoding: chunked\r\ncontent-length: %d\r\n\r\n" % declared,
                        b"5dc\r\n" + body[:1500] + b"\r\n",
                        b"5dc\r\n" + body[1500:] + b"\r\n0\r\n\r\n",
                    ],
                )
        finally:
            await gateway.aclose()
    assert response.startswith(b"HTTP/1.1 200"), response[:400]
    received = primary.received[0]
    assert received.body == body
    assert dict(received.headers)["content-length"] == "3000"


async def drive(gateway: Gateway, declared: int, pieces: list[bytes]) -> tuple[int, bytes]:
    """A POST with `Content-Length: declared` handed to the gateway in-process, as a
    lenient host server would: one `http.request` message per piece, whatever the length
    says. Returns the status and body the gateway answered."""
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/x", "raw_path": b"/v1/x", "query_string": b"",
        "root_path": "", "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 80),
        "headers": [(b"host", b"gw"), (b"content-length", b"%d" % declared)],
    }  # fmt: skip
    messages = [
        {"type": "http.request", "body": piece, "more_body": i < len(pieces) - 1}
        for i, piece in enumerate(pieces)
    ]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await anyio.sleep_forever()
        raise AssertionError  # pragma: no cover

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    with anyio.fail_after(15):
        await gateway(scope, receive, send)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
@pytest.mark.parametrize(
    ("declared", "pieces"),
    [
        (5000, [b"a" * 2000, b"b" * 1000]),  # ends short of its length
        (2000, [b"a" * 2000, b"b" * 1000]),  # its length complete, then more
        (2000, [b"a" * 1500, b"b" * 1000]),  # a chunk that crosses its length
        (2000, [b"a" * 2500, b"b" * 10]),  # over its length before any upstream
    ],
    ids=["short", "more-after-complete", "crossing", "over-in-head"],
)
async def test_a_streamed_body_that_is_not_its_declared_length_is_the_callers_400(
    engine: str, declared: int, pieces: list[bytes]
) -> None:
    # A lenient host (an app driving the gateway in-process, a server that does not hold a
    # body to its Content-Length) hands on a body over replay_buffer that is not the length
    # it declared. The gateway sent that length with the streamed body: the upstream waited
    # for bytes that never came (a first-byte timeout booked to its breaker: one caller
    # marking it for everyone), got the body cut to the declared length and answered it
    # (aiohttp), or the request ended in a bare 500 (httpx: h11's "Too little data").
    async with upstream(status_handler(200, b"ok")) as primary:
        conf = {
            "gateway": {"allow_hosts": ["127.0.0.1"], "engine": engine, "replay_buffer": 1024},
            "upstreams": {"primary": {"url": primary.url, "first_byte_timeout_ms": 1000}},
            "routes": [{"id": "r", "prefix": "/v1/", "plan": ["primary"]}],
        }
        gateway = Gateway(host_app, config=conf)
        try:
            status, answer = await drive(gateway, declared, pieces)
            health = gateway.services.health
            assert isinstance(health, MemoryHealth)
            marks = list(health.breaker("primary").outcomes)
            nothing_answered = list(primary.received)
            # The upstream and its pooled connections are fine for the next caller.
            served = await drive(gateway, 3000, [b"c" * 2000, b"d" * 1000])
        finally:
            await gateway.aclose()
    assert status == 400, answer
    error = json.loads(answer)["error"]
    assert error["code"] == "bad_request"
    assert "Content-Length" in error["message"]
    assert marks == []  # the caller's doing: no mark at all
    assert nothing_answered == []  # no upstream acted on a body cut to its length
    assert served == (200, b"ok")
    assert primary.received[-1].body == b"c" * 2000 + b"d" * 1000


async def _chunks(*pieces: bytes) -> AsyncIterator[bytes]:
    for piece in pieces:
        yield piece


@pytest.mark.parametrize("declared", [5000, 2000], ids=["short", "long"])
async def test_a_body_h11_refuses_to_send_is_a_local_refusal_on_the_httpx_engine(
    declared: int,
) -> None:
    # Defence in depth below the body reader: h11 refuses a body that is not the length
    # its Content-Length declares with its own LocalProtocolError, which httpcore does not
    # map for the body (only for the head) and the engine's error map did not know: a bare
    # 500 instead of the local `not_sent` (SPEC §12: what the client library refuses to
    # send is local, never a breaker mark, never a bare 500).
    client = make_client("httpx", allow_hosts=("127.0.0.1",))
    timeouts = Timeouts(connect=2.0, first_byte=2.0, idle=2.0)
    try:
        async with upstream(status_handler(200, b"ok")) as primary:
            headers = [("content-length", str(declared))]
            request = UpstreamRequest(
                "POST", primary.url + "/x", headers, _chunks(b"a" * 3000), timeouts
            )
            with pytest.raises(UpstreamError) as caught:
                await client.send(request)
            # The connection that refused is not pooled: the next request is answered.
            good = UpstreamRequest("POST", primary.url + "/y", [], b"b" * 10, timeouts)
            response = await client.send(good)
            body = b"".join([chunk async for chunk in response.iter_chunks()])
            await response.aclose()
    finally:
        await client.aclose()
    assert caught.value.kind == "local", caught.value
    assert (response.status, body) == (200, b"ok")
    assert [r.body for r in primary.received] == [b"b" * 10]
