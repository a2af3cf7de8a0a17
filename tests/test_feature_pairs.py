"""Features in combination (hedging, shadow copies, canary, pinning, credential pools,
budgets, declared capacity, breakers, faults, deadlines, streaming, tracing): what SPEC
says must hold when two are on at once. Real upstream sockets, the in-process Gateway."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from fallback_mw import Gateway
from tests.helpers import client_for
from tests.upstreams import host_app, upstream

pytestmark = pytest.mark.anyio


def usage_answer(prompt: int, completion: int, text: bytes = b"ok") -> web.Response:
    body = {
        "id": "x",
        "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text.decode()}}],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion},
    }
    return web.json_response(body)


async def test_a_hedge_loser_that_answered_503_gives_its_token_estimate_back() -> None:
    """tpm x hedging. The first attempt answers 503 while its hedge still runs; the hedge
    is served. The 503 generated nothing: its estimate leaves the upstream's tpm, as a 503
    outside a race does (test_capacity). Kept, the next caller's request did not fit."""
    calls = 0

    async def handle(request: web.Request) -> web.StreamResponse:
        nonlocal calls
        calls += 1
        if calls == 1:  # the attempt the hedge races: a 503 once the hedge has started
            await asyncio.sleep(0.15)
            return web.Response(status=503, body=b"busy")
        if calls == 2:  # the hedge
            await asyncio.sleep(0.3)
        return usage_answer(5, 5)

    async with upstream(handle) as only:
        conf = {
            "gateway": {"breaker": {"window": 10_000, "min_calls": 10_000}},
            "upstreams": {"only": {"url": only.url, "tpm": 1000}},
            "routes": [
                {"id": "chat", "prefix": "/v1/", "plan": ["only"], "retries": 1,
                 "hedge_after_ms": 50, "replayable_methods": ["POST"]}
            ],
        }  # fmt: skip
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                hedged = await client.post(
                    "/v1/chat", json={"model": "m", "max_tokens": 400, "messages": []}
                )
                big = await client.post(
                    "/v1/chat", json={"model": "m", "max_tokens": 900, "messages": []}
                )
        finally:
            await gateway.aclose()
    assert hedged.status_code == 200, hedged.text
    assert hedged.headers["x-gateway-attempts"] == "2"
    # The hedged request settled at its 10 reported tokens; ~910 more fit in 1000.
    assert big.status_code == 200, (big.status_code, big.headers.get("x-gateway-skipped"))
    assert calls == 3


async def test_a_kept_503_served_as_the_last_response_gives_its_estimate_back_once() -> None:
    """tpm x on_exhausted = "last_response" x the repeat allowance. The 503 the walk moved
    past gave its estimate back; served after all as the last upstream answer (the repeat
    refused), it was settled at 0 a second time: the minute's count went below zero, and
    a declared tpm of 1000 then let two requests of ~910 tokens through."""
    calls = 0

    async def handle(request: web.Request) -> web.StreamResponse:
        nonlocal calls
        calls += 1
        if calls == 1:
            return web.Response(status=503, body=b"busy")
        return web.Response(body=b"ok")  # no usage reported: the estimate stands

    async with upstream(handle) as only:
        conf = {
            "gateway": {
                "breaker": {"window": 10_000, "min_calls": 10_000},
                "repeat_budget": {"percent": 0, "min_per_second": 0},
            },
            "upstreams": {"only": {"url": only.url, "tpm": 1000}},
            "routes": [
                {"id": "chat", "prefix": "/v1/", "plan": ["only"], "retries": 1,
                 "on_exhausted": "last_response", "replayable_methods": ["POST"]}
            ],
        }  # fmt: skip
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                body = {"model": "m", "max_tokens": 900, "messages": []}
                statuses = [
                    (await client.post("/v1/chat", json=body)).status_code for _ in range(3)
                ]
        finally:
            await gateway.aclose()
    # The 503 passed through; one ~910-token request fits in the minute's 1000, not two.
    assert statuses == [503, 200, 503]
    assert calls == 2
