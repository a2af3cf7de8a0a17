"""Request framing as an attacker writes it, through a real server to a real keep-alive
upstream: a `Transfer-Encoding` beside a `Content-Length` that says something else."""

from __future__ import annotations

import anyio
import pytest

from fallback_mw import Gateway
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
