"""A caller cannot hide a response's usage from the budget by asking for a compressed
answer: the meter reads gzip / deflate bodies, and the caller's `Accept-Encoding` reaches
an upstream narrowed to the codings the meter reads (a `br` or `zstd` answer would be
settled at the hold, however many tokens it carried)."""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Awaitable, Callable
from decimal import Decimal

import pytest
from aiohttp import web

from fallback_mw import Gateway
from fallback_mw.request.context import Usage
from fallback_mw.request.usage import UsageMeter
from tests.helpers import client_for
from tests.test_budget_guard import gateway_config, status_of
from tests.upstreams import host_app, upstream

pytestmark = pytest.mark.anyio

ENGINES = ["aiohttp", "httpx"]
PAYLOAD = {"model": "gpt-test", "usage": {"prompt_tokens": 10, "completion_tokens": 20_000}}


async def compressing(request: web.Request) -> web.StreamResponse:
    response = web.json_response(PAYLOAD)
    response.enable_compression()  # honours the request's Accept-Encoding, as APIs do
    return response


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("coding", ["gzip", "deflate"])
async def test_a_compressed_answer_is_charged_its_reported_usage(engine: str, coding: str) -> None:
    async with upstream(compressing) as primary:
        conf = gateway_config({"primary": primary.url}, store=None, limit="1000")
        conf["gateway"]["engine"] = engine
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                response = await client.post(
                    "/v1/chat",
                    content=b'{"model":"gpt-test"}',
                    headers={"accept-encoding": coding},
                )
            assert response.status_code == 200
            assert response.headers["content-encoding"] == coding  # relayed as it came
            spent, held = await status_of(gateway)
            # 10 input tokens at 1000/Mtok + 20,000 output tokens at 2000/Mtok.
            assert (spent, held) == (Decimal("40.01"), 0)
        finally:
            await gateway.aclose()


@pytest.mark.parametrize("engine", ENGINES)
async def test_accept_encoding_reaches_the_upstream_narrowed_to_readable_codings(
    engine: str,
) -> None:
    asked = {
        "gzip, deflate, br, zstd": "gzip, deflate",
        "br;q=1.0, gzip;q=0.5": "gzip;q=0.5",
        "br": "identity",
        "*": "identity",
        "identity": "identity",
    }
    async with upstream(compressing) as primary:
        conf = gateway_config({"primary": primary.url}, store=None, limit="1000")
        conf["gateway"]["engine"] = engine
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                for value in asked:
                    response = await client.post(
                        "/v1/chat", content=b"{}", headers={"accept-encoding": value}
                    )
                    assert response.status_code == 200
        finally:
            await gateway.aclose()
    sent = [dict(r.headers).get("accept-encoding") for r in primary.received]
    assert sent == list(asked.values())


def raw_deflate(data: bytes) -> bytes:
    """`deflate` as many servers send it: the RFC 1951 stream without its zlib wrapper."""
    compressor = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return compressor.compress(data) + compressor.flush()


async def raw_deflating(request: web.Request) -> web.StreamResponse:
    return web.Response(
        body=raw_deflate(json.dumps(PAYLOAD).encode()),
        headers={"content-type": "application/json", "content-encoding": "deflate"},
    )


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_raw_deflate_answer_is_charged_its_reported_usage(engine: str) -> None:
    # `deflate` without its zlib wrapper is what httpx (the OpenAI and Anthropic SDKs'
    # client), aiohttp and browsers all read; the meter read only the wrapped form, so a
    # caller asking for `deflate` from such an upstream was settled at the hold.
    async with upstream(raw_deflating) as primary:
        conf = gateway_config({"primary": primary.url}, store=None, limit="1000")
        conf["gateway"]["engine"] = engine
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                response = await client.post(
                    "/v1/chat",
                    content=b'{"model":"gpt-test"}',
                    headers={"accept-encoding": "deflate"},
                )
            assert response.status_code == 200
            assert response.json() == PAYLOAD  # what a client reads
            spent, held = await status_of(gateway)
            assert (spent, held) == (Decimal("40.01"), 0)
        finally:
            await gateway.aclose()


def test_the_meter_reads_gzip_and_deflate_split_anywhere() -> None:
    body = json.dumps(PAYLOAD).encode()
    sse = b"data: " + body + b"\n\ndata: [DONE]\n\n"
    for coding, data, kind in (
        (b"gzip", gzip.compress(body), b"application/json"),
        (b"x-gzip", gzip.compress(sse), b"text/event-stream"),
        (b"deflate", zlib.compress(body), b"application/json"),
        (b"deflate", raw_deflate(body), b"application/json"),
        (b"deflate", raw_deflate(sse), b"text/event-stream"),
        # Codings listed in the order applied: compressed twice, undone last first.
        (b"gzip, gzip", gzip.compress(gzip.compress(body)), b"application/json"),
        (b"deflate, gzip", gzip.compress(raw_deflate(sse)), b"text/event-stream"),
        # A gzip body in two members (RFC 1952 §2.2), the usage in the second.
        (b"gzip", gzip.compress(body[:10]) + gzip.compress(body[10:]), b"application/json"),
    ):
        for size in (1, 7, len(data)):
            usage = Usage()
            meter = UsageMeter(usage)
            for start in range(0, len(data), size):
                meter.observe(data[start : start + size], kind, coding)
            meter.finish()
            assert (usage.input_tokens, usage.output_tokens) == (10, 20_000), (coding, size)


def test_a_decompression_bomb_is_read_only_up_to_a_bound() -> None:
    bomb = gzip.compress(b" " * (64 * 1024 * 1024))  # 64 MiB of spaces in ~64 KiB
    usage = Usage()
    meter = UsageMeter(usage)
    half = len(bomb) // 2
    meter.observe(bomb[:half], b"application/json", b"gzip")
    meter.observe(bomb[half:], b"application/json", b"gzip")  # no more decoding
    meter.finish()
    assert meter.decoded <= UsageMeter.MAX_DECODED + 1
    assert meter.mode == "ignore"
    assert not usage.reported


def test_a_body_compressed_twice_is_read_only_up_to_a_bound() -> None:
    # Each coding undone is bounded: the inner stream of a twice-compressed bomb is itself
    # 64 KiB, what it decodes to 64 MiB.
    bomb = gzip.compress(gzip.compress(b" " * (64 * 1024 * 1024)))
    usage = Usage()
    meter = UsageMeter(usage)
    meter.observe(bomb, b"application/json", b"gzip, gzip")
    meter.finish()
    assert meter.decoded <= UsageMeter.MAX_DECODED + 1
    assert meter.mode == "ignore"
    assert not usage.reported


def names_its_coding_hop_by_hop(listing: str) -> Callable[[web.Request], Awaitable[web.Response]]:
    """A compressed answer whose Connection (or Trailer) field names its Content-Encoding
    (RFC 9110 §7.6.1 forbids naming a field meant for every recipient; a misconfigured
    proxy in front of the upstream does it)."""

    async def handler(request: web.Request) -> web.Response:
        body = gzip.compress(json.dumps(PAYLOAD).encode())
        headers = {"content-encoding": "gzip", "content-type": "application/json"}
        headers[listing] = "content-encoding"
        return web.Response(body=body, headers=headers)

    return handler


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("listing", ["connection", "trailer"])
async def test_a_coding_the_upstream_names_hop_by_hop_still_labels_the_body(
    engine: str, listing: str
) -> None:
    # The relay dropped the Content-Encoding such a field names, and sent the gzip bytes
    # unlabelled: the caller's JSON reader got binary, while the meter (reading the
    # upstream's head) charged the decoded usage. The label goes with the bytes it describes.
    async with upstream(names_its_coding_hop_by_hop(listing)) as primary:
        conf = gateway_config({"primary": primary.url}, store=None, limit="1000")
        conf["gateway"]["engine"] = engine
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                response = await client.post(
                    "/v1/chat", content=b'{"model":"gpt-test"}', headers={"accept-encoding": "gzip"}
                )
            assert response.status_code == 200
            assert response.headers.get("content-encoding") == "gzip"
            assert response.json() == PAYLOAD  # httpx decoded it: the label was there
            spent, held = await status_of(gateway)
            assert (spent, held) == (Decimal("40.01"), 0)
        finally:
            await gateway.aclose()
