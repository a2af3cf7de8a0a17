"""Features in combination (hedging, shadow copies, canary, pinning, credential pools,
budgets, declared capacity, breakers, faults, deadlines, streaming, tracing): what SPEC
says must hold when two are on at once. Real upstream sockets, the in-process Gateway."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import itertools
import json
import threading
import time
from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import Any

import pytest
from aiohttp import web

from fallback_mw import Gateway
from fallback_mw.config import BudgetConfig
from tests.helpers import client_for
from tests.upstreams import Handler, host_app, status_handler, upstream

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


@contextlib.contextmanager
def threaded_upstream(answer: Callable[[int], tuple[int, bytes]]) -> Iterator[str]:
    """An upstream on a thread of its own (one per request): it can answer while the
    gateway's event loop is held. `answer(n)` gives the n-th request's status and body."""
    calls = itertools.count(1)

    class Handle(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["content-length"]))
            status, body = answer(next(calls))
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handle)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


async def test_a_hedge_loser_that_answered_400_gives_its_token_estimate_back() -> None:
    """tpm x hedging. The attempt the hedge races and the hedge answer together: the
    first (200, 10 tokens reported) is served, the hedge's 400 loses the race. A 400
    generated nothing, as a 503 loser did not: its ~410-token estimate stayed in the
    upstream's tpm for the minute, and the next caller's ~910 tokens did not fit in 1000."""
    hedge_arrived, go = threading.Event(), threading.Event()
    usage = {"prompt_tokens": 5, "completion_tokens": 5}
    ok = json.dumps({"id": "x", "choices": [], "usage": usage}).encode()

    def answer(call: int) -> tuple[int, bytes]:
        if call == 2:  # the hedge: a 400, written while the gateway's loop is held
            hedge_arrived.set()
            go.wait(5)
            return 400, b'{"error": "bad"}'
        if call == 1:  # the attempt the hedge races: a 200 at the same moment
            go.wait(5)
        return 200, ok

    async def hold_the_loop_while_both_answer() -> None:
        assert await asyncio.to_thread(hedge_arrived.wait, 5)
        go.set()
        time.sleep(0.3)  # noqa: ASYNC251 (held on purpose: both heads arrive before it reads)

    with threaded_upstream(answer) as url:
        conf = {
            "gateway": {"breaker": {"window": 10_000, "min_calls": 10_000}},
            "upstreams": {"only": {"url": url, "tpm": 1000}},
            "routes": [
                {"id": "chat", "prefix": "/v1/", "plan": ["only"], "retries": 1,
                 "hedge_after_ms": 50, "replayable_methods": ["POST"]}
            ],
        }  # fmt: skip
        spans = Spans()
        gateway = Gateway(host_app, config=conf, telemetry=spans.telemetry)
        try:
            async with client_for(gateway) as client:
                holder = asyncio.ensure_future(hold_the_loop_while_both_answer())
                hedged = await client.post(
                    "/v1/chat", json={"model": "m", "max_tokens": 400, "messages": []}
                )
                await holder
                big = await client.post(
                    "/v1/chat", json={"model": "m", "max_tokens": 900, "messages": []}
                )
        finally:
            await gateway.aclose()
            spans.provider.shutdown()
    assert hedged.status_code == 200, hedged.text
    assert hedged.headers["x-gateway-attempts"] == "2"
    # The race was the one meant: the hedge answered 400 and lost it.
    attempts = spans.named("gateway.attempt")
    hedges = [a for a in attempts if a.attributes.get("gateway.attempt.hedge")]
    assert [h.attributes["http.response.status_code"] for h in hedges] == [400]
    # The hedged request settled at its 10 reported tokens; ~910 more fit in 1000.
    assert big.status_code == 200, (big.status_code, big.headers.get("x-gateway-skipped"))


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


class Spans:
    """The SDK's in-memory span exporter behind a Telemetry."""

    def __init__(self) -> None:
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
            InMemorySpanExporter,
        )

        from fallback_mw.telemetry import Telemetry

        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider(shutdown_on_exit=False)
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.telemetry = Telemetry(tracer_provider=self.provider)

    def named(self, name: str) -> list[Any]:
        found = [s for s in self.exporter.get_finished_spans() if s.name == name]
        return sorted(found, key=lambda s: s.attributes.get("gateway.attempt.number", 0))


@pytest.fixture
def spans() -> Iterator[Spans]:
    found = Spans()
    yield found
    found.provider.shutdown()


def sse_answer(prompt: int, completion: int, delay: float = 0.0) -> Handler:
    async def handle(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(delay)
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n')
        usage = {"prompt_tokens": prompt, "completion_tokens": completion}
        await response.write(b"data: " + json.dumps({"usage": usage}).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    return handle


async def test_a_hedged_stream_settles_once_at_the_winners_usage(
    ledger_store: str, spans: Spans
) -> None:
    """budget x hedging x SSE x tracing. The first attempt is slow (it would report 1,000
    tokens), its hedge streams at once reporting 10: one hold, one settlement at the
    hedge's 10 tokens, one usage record; the trace names both attempts, the hedge as the
    one that answered, the loser cancelled."""
    calls = 0
    slow, fast = sse_answer(500, 500, delay=1.0), sse_answer(5, 5)

    async def handle(request: web.Request) -> web.StreamResponse:
        nonlocal calls
        calls += 1
        return await (slow if calls == 1 else fast)(request)

    async with upstream(handle) as only:
        conf = {
            "gateway": {"store": ledger_store},
            "upstreams": {"only": {"url": only.url}},
            "routes": [
                {"id": "chat", "prefix": "/v1/", "plan": ["only"], "retries": 1,
                 "hedge_after_ms": 50, "replayable_methods": ["POST"], "budget": "acme"}
            ],
            "budgets": {"acme": {"limit": "1", "window": "month", "default_hold": "0.5"}},
            "prices": {"m": {"input_per_mtok": "1000", "output_per_mtok": "1000"}},
        }  # fmt: skip
        gateway = Gateway(host_app, config=conf, telemetry=spans.telemetry)
        try:
            async with client_for(gateway) as client:
                response = await client.post(
                    "/v1/chat", json={"model": "m", "max_tokens": 10, "stream": True}
                )
            ledger = gateway.services.ledger
            assert ledger is not None
            status = await ledger.status("acme", BudgetConfig(limit=Decimal(1), window="month"))
            records = await ledger.usage()
        finally:
            await gateway.aclose()
    assert response.status_code == 200 and response.text.endswith("data: [DONE]\n\n")
    assert response.headers["x-gateway-attempts"] == "2"
    assert (status.spent, status.held) == (Decimal("0.01"), 0)  # 10 tokens at 1000/Mtok
    (record,) = records
    assert record.charged == Decimal("0.01") and record.output_tokens == 5
    (request_span,) = spans.named("gateway.request")
    attributes = request_span.attributes
    assert attributes["gateway.plan.chosen"] == "only"
    assert attributes["gateway.attempts"] == 2
    assert attributes["gateway.outcome"] == "served"
    assert attributes["gen_ai.usage.output_tokens"] == 5
    first, hedge = spans.named("gateway.attempt")
    assert hedge.attributes["gateway.attempt.hedge"] is True
    assert hedge.attributes["http.response.status_code"] == 200
    assert "gateway.failure.kind" not in hedge.attributes
    assert first.attributes["gateway.failure.kind"] == "cancelled"


class Faulted:
    """A game-day fault on `only`, as the store's source gives it to a running gateway."""

    def __init__(self, fault: Any) -> None:
        self.fault = fault

    async def upstream_fault(self, upstream: str) -> Any:
        return self.fault if upstream == "only" else None

    async def pinned_candidate(self, route_id: str) -> str | None:
        return None

    async def aclose(self) -> None:
        return None


@pytest.mark.parametrize(
    ("fault", "served"), [("revoke", 401), ("fail", 503)], ids=["revoke", "fail"]
)
async def test_an_answer_a_game_day_fault_made_is_never_charged(
    ledger_store: str, fault: str, served: int
) -> None:
    """budget x game-day faults. `revoke` answers 401 (served as it is, outside
    failover_status) and `fail` 503 (passed through with on_exhausted = "last_response"):
    answers the gateway made itself, nothing sent upstream. They were charged the whole
    hold, as an upstream's answer without usage is: a rehearsal spent the tenant's budget
    (a few dozen requests and the route answered 402 after the game day)."""
    async with upstream(status_handler(200, b"ok")) as only:
        conf = {
            "gateway": {"store": ledger_store},
            "upstreams": {"only": {"url": only.url}},
            "routes": [
                {"id": "chat", "prefix": "/v1/", "plan": ["only"], "budget": "acme",
                 "on_exhausted": "last_response", "replayable_methods": ["POST"]}
            ],
            "budgets": {"acme": {"limit": "1", "window": "month", "default_hold": "0.4"}},
        }  # fmt: skip
        gateway = Gateway(host_app, config=conf, faults=Faulted(fault))
        try:
            async with client_for(gateway) as client:
                answers = [await client.post("/v1/chat", json={"x": 1}) for _ in range(3)]
            ledger = gateway.services.ledger
            assert ledger is not None
            status = await ledger.status("acme", BudgetConfig(limit=Decimal(1), window="month"))
            records = await ledger.usage()
        finally:
            await gateway.aclose()
    assert [a.status_code for a in answers] == [served] * 3  # never 402
    assert only.count == 0
    assert (status.spent, status.held) == (0, 0)
    assert [r.charged for r in records] == [0, 0, 0]
