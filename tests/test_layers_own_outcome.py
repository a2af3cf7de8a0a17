"""Each layer answers for itself (issue 20): the budget guard sends its own 402 / 503 in
front of any app; the response path meters usage, so the resolver and the walker alone
settle `tpm` and report GenAI usage; the request span covers the request from the
resolver to the budget settlement. In-process ASGI; real aiohttp upstreams on 127.0.0.1."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import pytest
from aiohttp import web
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from fallback_mw import Gateway
from fallback_mw.budget import Hold
from fallback_mw.config import BudgetConfig, GatewayConfig, load_config
from fallback_mw.layers.guard import BudgetGuard
from fallback_mw.layers.injector import CredentialInjector
from fallback_mw.layers.resolver import RouteResolver
from fallback_mw.layers.walker import PlanWalker
from fallback_mw.request.types import Receive, Scope, Send
from fallback_mw.store.ledgers.memory import MemoryLedger
from fallback_mw.telemetry import Telemetry
from tests.helpers import client_for
from tests.upstreams import host_app, status_handler, upstream

pytestmark = pytest.mark.anyio


@dataclass
class Spans:
    exporter: InMemorySpanExporter
    telemetry: Telemetry

    def request_span(self) -> ReadableSpan:
        found = [s for s in self.exporter.get_finished_spans() if s.name == "gateway.request"]
        assert len(found) == 1, [s.name for s in self.exporter.get_finished_spans()]
        return found[0]


@pytest.fixture
def spans() -> Iterator[Spans]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield Spans(exporter, Telemetry(tracer_provider=provider))
    provider.shutdown()


class RecordingApp:
    """Any ASGI app: records whether it was reached."""

    def __init__(self) -> None:
        self.reached = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.reached += 1
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"app ran"})


def budget_config(*, limit: str = "1.0", default_hold: str = "0.01") -> dict[str, Any]:
    return {
        "upstreams": {"primary": {"url": "http://127.0.0.1:9"}},
        "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"], "budget": "acme"}],
        "budgets": {"acme": {"limit": limit, "window": "month", "default_hold": default_hold}},
    }


async def test_guard_alone_answers_402_when_the_hold_is_refused(spans: Spans) -> None:
    config = load_config(budget_config(limit="0.001", default_hold="0.01"))
    app = RecordingApp()
    ledger = MemoryLedger()
    guard = BudgetGuard(app, config=config, ledger=ledger)
    stack = RouteResolver(guard, config=config, telemetry=spans.telemetry)
    async with client_for(stack) as client:
        response = await client.post("/v1/chat", content=b"{}")
    assert response.status_code == 402
    error = response.json()["error"]
    assert error["code"] == "budget_exceeded"
    assert error["attempts"] == 0
    assert response.headers["x-gateway-route"] == "chat"
    assert app.reached == 0
    # Traced like the resolver's own refusals: one request span, its outcome named.
    attributes = dict(spans.request_span().attributes or {})
    assert attributes["error.type"] == "budget_exceeded"
    # The refusal left its usage record (the settlement ran; nothing was held).
    (record,) = await ledger.usage()
    assert record.outcome == "budget_exceeded"
    assert record.charged is None


async def test_guard_alone_without_a_ledger_fails_closed(spans: Spans) -> None:
    config = load_config(budget_config())
    app = RecordingApp()
    # The guard traces for itself when the resolver has no telemetry.
    stack = RouteResolver(BudgetGuard(app, config=config, telemetry=spans.telemetry), config=config)
    async with client_for(stack) as client:
        refused = await client.post("/v1/chat", content=b"{}")
        other = await client.get("/elsewhere")
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "budget_unavailable"
    assert app.reached == 1  # only the unrouted request
    assert other.text == "app ran"
    assert dict(spans.request_span().attributes or {})["error.type"] == "budget_unavailable"


async def test_guard_alone_without_a_ledger_says_how_to_give_it_one() -> None:
    # Its refusal said "give it one (Gateway builds it from [gateway] store, else in
    # memory)": neither the keyword nor where a ledger comes from. Doing what it says now
    # serves the request.
    from fallback_mw.store.ledgers import open_ledger

    config = load_config(budget_config())
    app = RecordingApp()
    async with client_for(RouteResolver(BudgetGuard(app, config=config), config=config)) as c:
        message = (await c.post("/v1/chat", content=b"{}")).json()["error"]["message"]
    assert "BudgetGuard(..., ledger=open_ledger(store))" in message, message
    assert "fallback_mw.store.ledgers" in message, message
    ledger = open_ledger(config.gateway.store)
    guard = BudgetGuard(app, config=config, ledger=ledger)
    try:
        async with client_for(RouteResolver(guard, config=config)) as client:
            served = await client.post("/v1/chat", content=b"{}")
    finally:
        await ledger.aclose()
    assert (served.status_code, app.reached) == (200, 1), served.text


async def test_guard_alone_passes_an_unbudgeted_route_without_a_ledger() -> None:
    conf = budget_config()
    conf["routes"][0].pop("budget")
    config = load_config(conf)
    app = RecordingApp()
    stack = RouteResolver(BudgetGuard(app, config=config), config=config)
    async with client_for(stack) as client:
        response = await client.get("/v1/chat")
    assert response.status_code == 200
    assert app.reached == 1


def usage_handler(input_tokens: int, output_tokens: int) -> Any:
    async def handle(request: web.Request) -> web.StreamResponse:
        return web.json_response(
            {
                "model": "gpt-test-2026",
                "usage": {"prompt_tokens": input_tokens, "completion_tokens": output_tokens},
            }
        )

    return handle


def tpm_config(url: str) -> GatewayConfig:
    route = {"id": "chat", "prefix": "/v1/", "plan": ["only"], "replayable_methods": ["POST"]}
    return load_config({"upstreams": {"only": {"url": url, "tpm": 1000}}, "routes": [route]})


async def test_resolver_and_walker_alone_meter_usage_and_settle_tpm(spans: Spans) -> None:
    async with upstream(usage_handler(5, 7)) as only:
        config = tpm_config(only.url)
        walker = PlanWalker(host_app, config=config, telemetry=spans.telemetry)
        stack = RouteResolver(walker, config=config, telemetry=spans.telemetry)
        # Each request is estimated at ~10 input + 600 output tokens: two estimates do not
        # fit in 1000 tpm, so the second is admitted only if the first was settled from
        # the 12 tokens the upstream reported.
        body = {"model": "gpt-test", "max_tokens": 600, "messages": []}
        try:
            async with client_for(stack) as client:
                first = await client.post("/v1/chat", json=body)
                attributes = dict(spans.request_span().attributes or {})
                second = await client.post("/v1/chat", json=body)
        finally:
            await walker.aclose()
    assert first.status_code == 200
    assert second.status_code == 200, second.text
    assert only.count == 2
    assert attributes["gen_ai.usage.input_tokens"] == 5
    assert attributes["gen_ai.usage.output_tokens"] == 7
    assert attributes["gen_ai.response.model"] == "gpt-test-2026"


async def test_without_reported_usage_the_estimate_stays_counted(spans: Spans) -> None:
    """The control for the test above: an upstream that reports nothing leaves the
    estimate in `tpm`, so the second request does not fit."""

    async def silent(request: web.Request) -> web.StreamResponse:
        return web.json_response({"model": "gpt-test-2026"})

    async with upstream(silent) as only:
        config = tpm_config(only.url)
        walker = PlanWalker(host_app, config=config, telemetry=spans.telemetry)
        stack = RouteResolver(walker, config=config, telemetry=spans.telemetry)
        body = {"model": "gpt-test", "max_tokens": 600, "messages": []}
        try:
            async with client_for(stack) as client:
                statuses = [(await client.post("/v1/chat", json=body)).status_code for _ in "ab"]
        finally:
            await walker.aclose()
    assert statuses == [200, 503]


class TimedLedger(MemoryLedger):
    """Records when the hold and the settlement ran (wall clock, as spans are)."""

    def __init__(self) -> None:
        super().__init__()
        self.held_at = 0
        self.settled_at = 0

    async def hold(self, budget_id: str, budget: BudgetConfig, amount: Decimal) -> Hold | None:
        self.held_at = time.time_ns()
        return await super().hold(budget_id, budget, amount)

    async def settle(self, hold: Hold, amount: Decimal) -> None:
        await super().settle(hold, amount)
        self.settled_at = time.time_ns()


async def test_the_request_span_covers_the_hold_and_the_settlement(spans: Spans) -> None:
    async with upstream(usage_handler(3, 4)) as primary:
        conf = budget_config()
        conf["upstreams"]["primary"]["url"] = primary.url
        ledger = TimedLedger()
        gateway = Gateway(host_app, config=conf, ledger=ledger, telemetry=spans.telemetry)
        try:
            async with client_for(gateway) as client:
                response = await client.post("/v1/chat", content=b"{}")
        finally:
            await gateway.aclose()
    assert response.status_code == 200
    span = spans.request_span()
    assert ledger.held_at and ledger.settled_at
    assert span.start_time is not None and span.end_time is not None
    assert span.start_time <= ledger.held_at
    assert span.end_time >= ledger.settled_at


async def test_guard_alone_answers_a_body_it_cannot_hold_for() -> None:
    conf = budget_config()
    conf["gateway"] = {"max_request_body": 1000, "replay_buffer": 500}
    config = load_config(conf)
    app = RecordingApp()
    ledger = MemoryLedger()
    stack = RouteResolver(BudgetGuard(app, config=config, ledger=ledger), config=config)
    async with client_for(stack) as client:
        response = await client.post("/v1/chat", content=b"x" * 2000)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"
    assert app.reached == 0
    (record,) = await ledger.usage()
    assert record.outcome == "request_too_large"


class _ClosingClient:
    """An upstream client that answers 200 and says whether it was closed."""

    def __init__(self) -> None:
        self.closed = 0

    async def send(self, request: Any) -> Any:
        class Answer:
            status = 200
            headers = [(b"content-length", b"2")]

            async def iter_chunks(self) -> Any:
                yield b"ok"

            async def aclose(self) -> None:
                pass

        return Answer()

    async def aclose(self) -> None:
        self.closed += 1


def test_the_walker_alone_closes_its_upstream_client_at_the_lifespan_shutdown() -> None:
    """The composition docs/architecture.md shows (Starlette, `add_middleware(PlanWalker)`
    then `RouteResolver`, no Gateway) left the walker's upstream connections open at
    shutdown: nobody holds the walker Starlette builds, and it ignored the lifespan, so
    aiohttp's `Unclosed client session` showed at exit (a ResourceWarning, an error in a
    `-W error` suite). The walker that built its services starts and closes them at the
    host's lifespan, as the Gateway does; the host's own lifespan still runs."""
    import contextlib
    from collections.abc import AsyncIterator

    from starlette.applications import Starlette
    from starlette.testclient import TestClient

    config = {
        "gateway": {"allow_hosts": ["127.0.0.1"]},
        "upstreams": {"primary": {"url": "http://127.0.0.1:9"}},
        "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"]}],
    }
    events: list[str] = []

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        events.append("host startup")
        yield
        events.append("host shutdown")

    client = _ClosingClient()
    app = Starlette(lifespan=lifespan)
    app.add_middleware(PlanWalker, config=config, client=client)
    app.add_middleware(RouteResolver, config=config)
    with TestClient(app) as http:
        assert http.get("/v1/x").text == "ok"
        assert client.closed == 0
    assert client.closed == 1
    assert events == ["host startup", "host shutdown"]


@pytest.mark.parametrize("layer", [RouteResolver, BudgetGuard, CredentialInjector, PlanWalker])
async def test_a_layer_whose_configuration_does_not_load_fails_the_startup_and_never_serves(
    layer: Any,
) -> None:
    """A layer used alone in Starlette with a config that did not load (`add_middleware(
    RouteResolver, config="gateway.toml")`, an unknown key) raised from Starlette's lazy
    middleware build, inside the first ASGI call: uvicorn's default lifespan mode read that
    as "lifespan unsupported" and started serving — the host's own startup never ran — and
    every request, the host's included, was a bare 500 with a traceback. Each layer now
    does what `Gateway` does: the lifespan startup fails naming the problem, and without a
    lifespan every request is the local 503 `config_error`."""
    from starlette.applications import Starlette

    app = Starlette()
    app.add_middleware(layer, config={"nope": 1})
    sent: list[dict[str, Any]] = []
    startup = [{"type": "lifespan.startup"}]

    async def receive() -> dict[str, Any]:
        return startup.pop()

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    with pytest.raises(Exception, match="unknown key 'nope'"):
        await app({"type": "lifespan", "asgi": {"version": "3.0"}}, receive, send)
    assert sent[0]["type"] == "lifespan.startup.failed"
    assert "unknown key 'nope'" in sent[0]["message"]

    async with client_for(app) as client:
        for path in ("/v1/x", "/"):
            response = await client.get(path)
            assert response.status_code == 503
            assert response.json()["error"]["code"] == "config_error"
            assert "unknown key 'nope'" in response.json()["error"]["message"]


STACKS: dict[str, Any] = {
    "no guard": lambda config, walker, ledger: RouteResolver(walker, config=config),
    "the guard outside the resolver": lambda config, walker, ledger: BudgetGuard(
        RouteResolver(walker, config=config), config=config, ledger=ledger
    ),
}


@pytest.mark.parametrize("stack", [*STACKS, "the guard behind the walker"])
async def test_a_budgeted_route_is_never_walked_without_its_guard(stack: str) -> None:
    """Layers composed by hand in the wrong order (Starlette runs the middleware added last
    first) served a route whose budget no guard held: a BudgetGuard added after the
    RouteResolver ran outside it and saw no route, one added before the PlanWalker ran
    behind it and was never reached, and a stack of a resolver and a walker alone (the
    docs' "gateway without budgets") did the same for a route that names a budget. Each
    served 200 over a limit of 0.001 with no hold. The walker refuses a budgeted route no
    guard held (fail closed: 503 budget_unavailable, no upstream contacted), naming the
    order that holds it."""
    async with upstream(status_handler(200)) as up:
        conf = budget_config(limit="0.001", default_hold="0.01")
        conf["upstreams"]["primary"]["url"] = up.url
        config = load_config(conf)
        ledger = MemoryLedger()
        app = RecordingApp()
        if stack == "the guard behind the walker":
            walker = PlanWalker(BudgetGuard(app, config=config, ledger=ledger), config=config)
            built: Any = RouteResolver(walker, config=config)
        else:
            walker = PlanWalker(app, config=config)
            built = STACKS[stack](config, walker, ledger)
        async with walker, client_for(built) as client:
            refused = await client.post("/v1/chat", content=b"{}")
    assert refused.status_code == 503, refused.text
    error = refused.json()["error"]
    assert error["code"] == "budget_unavailable"
    assert "no BudgetGuard held route 'chat''s budget 'acme'" in error["message"], error
    assert up.count == 0
    assert app.reached == 0
