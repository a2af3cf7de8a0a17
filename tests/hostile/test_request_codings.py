"""A caller's request body in a content coding the budget's estimate cannot read (`br`,
`zstd`): an upstream that decodes it (aiohttp's server with its `speedups` extra, Express's
body-parser 2) reads and generates the `max_tokens` inside, while the hold saw "not JSON"
and took `default_hold`."""

from __future__ import annotations

import gzip
import json
import time
import tracemalloc
import zlib
from decimal import Decimal

import pytest

from fallback_mw import Gateway
from tests.helpers import client_for
from tests.test_budget_guard import gateway_config, json_handler, status_of
from tests.upstreams import host_app, upstream

pytestmark = pytest.mark.anyio

# No brotli / zstd codec is installed here; the gateway reads none of these bytes either
# way, and an upstream with the codec reads the JSON inside.
_CODED = zlib.compress(json.dumps({"model": "gpt-test", "max_tokens": 1000}).encode())


@pytest.mark.parametrize("coding", ["br", "zstd", "gzip, br", "BR"])
async def test_a_body_in_a_coding_the_hold_cannot_read_is_refused_on_a_budgeted_route(
    coding: str,
) -> None:
    # 1,000 output tokens at 2000/Mtok is a hold of 2.00 against a limit of 1: a 402 in
    # plain JSON or in gzip. Labelled `br`, the request went through on 0.01 (default_hold),
    # as many times as the caller liked, each generating what the budget never held.
    headers = {"content-type": "application/json", "content-encoding": coding}
    async with upstream(json_handler({"ok": True})) as primary:
        conf = gateway_config({"primary": primary.url}, store=None, limit="1")
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                response = await client.post("/v1/chat", content=_CODED, headers=headers)
                assert response.status_code == 400, response.text
                error = response.json()["error"]
                assert error["code"] == "bad_request"
                assert "gzip" in error["message"]  # says what it can read
            assert await status_of(gateway) == (Decimal(0), Decimal(0))
        finally:
            await gateway.aclose()
    assert primary.count == 0  # no upstream contacted


async def test_a_body_in_such_a_coding_still_reaches_a_route_without_a_budget() -> None:
    # Stacked: the recording upstream (aiohttp, without Brotli) passes it on undecoded.
    headers = {"content-type": "application/json", "content-encoding": "gzip, br"}
    async with upstream(json_handler({"ok": True})) as primary:
        conf = gateway_config({"primary": primary.url}, store=None, budget=None)
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                response = await client.post("/v1/chat", content=_CODED, headers=headers)
                assert response.status_code == 200, response.text
        finally:
            await gateway.aclose()
    assert primary.received[0].body == _CODED


async def test_a_gzip_body_of_many_members_is_estimated_in_linear_time() -> None:
    # A caller's gzip body of 200,000 empty members behind its JSON (4 MB, within a 4 MiB
    # replay_buffer): the estimate copied the rest of the body once per member (zlib's
    # `unused_data`), the event loop blocked for every other request meanwhile (14 s on
    # this 2-core machine; now under a second).
    empty = gzip.compress(b"", mtime=0)
    body = gzip.compress(json.dumps({"model": "gpt-test", "max_tokens": 1000}).encode())
    body += empty * 200_000
    headers = {"content-type": "application/json", "content-encoding": "gzip"}
    async with upstream(json_handler({"ok": True})) as primary:
        conf = gateway_config({"primary": primary.url}, store=None, limit="1")
        conf["gateway"]["replay_buffer"] = 4 * 1024 * 1024
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                started = time.monotonic()
                response = await client.post("/v1/chat", content=body, headers=headers)
                took = time.monotonic() - started
        finally:
            await gateway.aclose()
    assert response.status_code == 402, response.text  # the JSON read: 2.00 held
    assert took < 5, took
    assert primary.count == 0


async def test_a_small_gzip_body_cannot_make_the_estimate_parse_megabytes() -> None:
    # 8 KB of gzip decoding to 8 MiB of `{"a": [{}, {}, ...]}` (2.8 million objects): the
    # estimate decoded up to max_request_body and parsed it all, 210 MB and a quarter of a
    # second of the event loop per request, so a few callers sending 8 KB each could take
    # the process's memory. The estimate now reads a decoded body up to replay_buffer, as
    # it reads a plain one (beyond it: default_hold, as for a plain body that large).
    count = (8 * 1024 * 1024 - 64) // 3
    body = gzip.compress(b'{"a":[' + b"{}," * count + b'{}],"max_tokens":1}', 9)
    assert len(body) < 10_000
    headers = {"content-type": "application/json", "content-encoding": "gzip"}
    async with upstream(json_handler({"ok": True})) as primary:
        conf = gateway_config({"primary": primary.url}, store=None, limit="1")
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                tracemalloc.start()
                try:
                    response = await client.post("/v1/chat", content=body, headers=headers)
                    peak = tracemalloc.get_traced_memory()[1]
                finally:
                    tracemalloc.stop()
        finally:
            await gateway.aclose()
    # Held default_hold and forwarded (the recording upstream, aiohttp, decodes it and
    # refuses it over its own 1 MiB limit).
    assert response.status_code == 413 and "x-gateway-provider" in response.headers
    assert peak < 64 * 1024 * 1024, peak
