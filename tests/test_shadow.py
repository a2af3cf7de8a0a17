"""Shadow traffic: copies reach the shadow candidate with its own credential, after the
client's answer and never instead of it; non-replayable requests are never copied; copies
respect the shadow upstream's capacity; shutdown cancels the copies in flight."""

from __future__ import annotations

import asyncio
import gc
import time
import tracemalloc
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
from aiohttp import web
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from fallback_mw import ConfigError, Gateway, load_config
from fallback_mw.config import BreakerConfig
from fallback_mw.health.memory import MemoryHealth
from fallback_mw.shadow import in_shadow_slice
from fallback_mw.telemetry import Telemetry
from tests.helpers import client_for, http_scope
from tests.upstreams import host_app, status_handler, upstream

pytestmark = pytest.mark.anyio

ENV = {"PRIMARY_KEY": "sk-primary-0001", "SHADOW_KEY": "sk-shadow-0002"}
CALLER_TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
CALLER = {"authorization": "Bearer sk-caller-9999", "x-session-id": "user-1"}


class Recorded:
    def __init__(self) -> None:
        self.spans = InMemorySpanExporter()
        self.tracer_provider = TracerProvider(shutdown_on_exit=False)
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.spans))
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader], shutdown_on_exit=False)
        self.telemetry = Telemetry(
            tracer_provider=self.tracer_provider, meter_provider=self.meter_provider
        )

    def shadow_outcomes(self) -> dict[str, int]:
        found: dict[str, int] = {}
        data = self.reader.get_metrics_data()
        for resource in data.resource_metrics if data else ():
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    if metric.name == "gateway.shadow.requests":
                        for point in metric.data.data_points:
                            assert point.attributes["gateway.shadow"] is True
                            outcome = str(point.attributes["gateway.shadow.outcome"])
                            found[outcome] = found.get(outcome, 0) + point.value
        return found


@pytest.fixture
def recorded() -> Iterator[Recorded]:
    found = Recorded()
    yield found
    found.tracer_provider.shutdown()
    found.meter_provider.shutdown()


def config(primary: str, shadow: str, **route: Any) -> dict[str, Any]:
    return {
        "upstreams": {
            "primary": {"url": primary, "auth_env": "PRIMARY_KEY"},
            "candidate": {
                "url": shadow,
                "auth_header": "x-api-key",
                "auth_scheme": "",
                "auth_env": "SHADOW_KEY",
            },
        },
        "routes": [
            {
                "id": "chat",
                "prefix": "/v1/",
                "plan": ["primary"],
                "shadow": "candidate",
                "shadow_percent": 100,
                **route,
            }
        ],
    }


async def settled(gateway: Gateway, check: Any, limit: float = 10.0) -> None:
    """Until `check()` holds (shadow copies run in the background)."""
    deadline = time.monotonic() + limit
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def test_a_copy_reaches_the_shadow_with_its_own_credential_and_never_the_client(
    recorded: Recorded,
) -> None:
    async with (
        upstream(status_handler(200, b"primary says")) as primary,
        upstream(status_handler(200, b"shadow says")) as shadow,
    ):
        gateway = Gateway(
            host_app, config=config(primary.url, shadow.url), environ=ENV,
            telemetry=recorded.telemetry,
        )  # fmt: skip
        try:
            async with client_for(gateway) as client:
                response = await client.get(
                    "/v1/chat?q=1", headers={**CALLER, "traceparent": CALLER_TRACEPARENT}
                )
            shadows = gateway.services.shadows
            await settled(gateway, lambda: shadow.count == 1 and not shadows.in_flight)
        finally:
            await gateway.aclose()
    assert response.status_code == 200 and response.text == "primary says"
    assert response.headers["x-gateway-provider"] == "primary"
    assert response.headers["x-gateway-attempts"] == "1"
    (copy,) = shadow.received
    headers = dict(copy.headers)
    assert headers["x-api-key"] == "sk-shadow-0002"  # its own credential
    assert "authorization" not in headers  # neither the caller's nor the primary's
    assert all("sk-primary" not in v and "sk-caller" not in v for v in headers.values())
    assert copy.method == "GET" and copy.path == "/v1/chat" and copy.query == "q=1"
    assert dict(primary.received[0].headers)["authorization"] == "Bearer sk-primary-0001"
    assert recorded.shadow_outcomes() == {"answered": 1}
    spans = {s.name: s for s in recorded.spans.get_finished_spans()}
    shadow_span = spans["gateway.shadow"]
    assert shadow_span.attributes is not None
    assert shadow_span.attributes["gateway.shadow"] is True
    assert shadow_span.attributes["gateway.candidate"] == "candidate"
    # A CLIENT span names the server it called, as a gateway.attempt does (a real trace's
    # copy said which upstream by name only).
    assert shadow_span.attributes["server.address"] == "127.0.0.1"
    assert shadow_span.attributes["server.port"] == int(shadow.url.rsplit(":", 1)[1])
    assert shadow_span.parent is not None
    assert shadow_span.parent.span_id == spans["gateway.request"].context.span_id
    assert spans["gateway.request"].attributes["gateway.attempts"] == 1  # type: ignore[index]
    # The copy carries its own span's context, in the caller's trace: the shadow upstream's
    # server span hangs off gateway.shadow, not off the caller's span.
    (traceparent,) = [v for k, v in copy.headers if k.lower() == "traceparent"]
    trace_id, parent_id = traceparent.split("-")[1:3]
    assert trace_id == CALLER_TRACEPARENT.split("-")[1]
    assert parent_id == format(shadow_span.context.span_id, "016x")


async def test_a_hanging_shadow_does_not_delay_the_client_and_shutdown_cancels_it() -> None:
    reached, cancelled = asyncio.Event(), asyncio.Event()

    async def hang(request: web.Request) -> web.StreamResponse:
        reached.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()  # the gateway closed the connection
            raise
        return web.Response()

    async with (
        upstream(status_handler(200, b"primary says")) as primary,
        upstream(hang) as shadow,
    ):
        gateway = Gateway(host_app, config=config(primary.url, shadow.url), environ=ENV)
        shadows = gateway.services.shadows
        assert shadows is not None
        try:
            async with client_for(gateway) as client:
                first = await client.get("/v1/chat", headers=CALLER)
                await asyncio.wait_for(reached.wait(), 10)
                # The copy hangs; the next client request is answered all the same.
                second = await client.get("/v1/chat", headers=CALLER)
            assert shadows.in_flight == 2
        finally:
            await gateway.aclose()
        await asyncio.wait_for(cancelled.wait(), 10)
    assert [first.text, second.text] == ["primary says"] * 2
    assert shadows.in_flight == 0
    assert primary.count == 2


async def test_a_post_on_a_non_replayable_route_is_never_shadowed(recorded: Recorded) -> None:
    async with (
        upstream(status_handler(200, b"primary says")) as primary,
        upstream(status_handler(200)) as shadow,
    ):
        gateway = Gateway(
            host_app, config=config(primary.url, shadow.url), environ=ENV,
            telemetry=recorded.telemetry,
        )  # fmt: skip
        replayable = Gateway(
            host_app, config=config(primary.url, shadow.url, replayable_methods=["POST"]),
            environ=ENV,
        )  # fmt: skip
        try:
            async with client_for(gateway) as client:
                response = await client.post("/v1/chat", headers=CALLER, json={"n": 1})
            # The copy would have been started before the response returned.
            assert gateway.services.shadows.in_flight == 0
            # The control: the same POST where POST is replayable is copied.
            async with client_for(replayable) as client:
                await client.post("/v1/chat", headers=CALLER, json={"n": 2})
            await settled(replayable, lambda: shadow.count == 1)
        finally:
            await gateway.aclose()
            await replayable.aclose()
    assert response.text == "primary says"
    assert [r.body for r in shadow.received] == [b'{"n":2}']  # only the replayable one
    assert recorded.shadow_outcomes() == {}


async def test_the_slice_is_per_session_and_copies_respect_capacity(
    recorded: Recorded,
) -> None:
    conf = config("http://127.0.0.1:1", "http://127.0.0.1:2", shadow_percent=30)
    route = load_config(conf, environ=ENV).routes[0]
    sessions = [f"user-{i}" for i in range(400)]
    inside = [s for s in sessions if in_shadow_slice(route, s, "fallback_mw")]
    assert 80 <= len(inside) <= 160  # about 30 %, the same sessions every time
    assert inside == [s for s in sessions if in_shadow_slice(route, s, "fallback_mw")]
    assert not in_shadow_slice(route, None, "fallback_mw")  # no session, no copy

    async with (
        upstream(status_handler(200, b"primary says")) as primary,
        upstream(status_handler(200)) as shadow,
    ):
        conf = config(primary.url, shadow.url)
        conf["upstreams"]["candidate"]["rpm"] = 2
        gateway = Gateway(host_app, config=conf, environ=ENV, telemetry=recorded.telemetry)
        try:
            async with client_for(gateway) as client:
                for _ in range(4):
                    response = await client.get("/v1/chat", headers=CALLER)
                    assert response.text == "primary says"
                    await settled(gateway, lambda: not gateway.services.shadows.in_flight)
                await client.get("/v1/chat", headers={"authorization": "Bearer x"})  # no session
        finally:
            await gateway.aclose()
    assert shadow.count == 2
    assert recorded.shadow_outcomes() == {"answered": 2, "capacity": 2}
    assert primary.count == 5


def test_a_shadow_that_is_the_primary_or_unknown_is_refused() -> None:
    conf = config("http://127.0.0.1:1", "http://127.0.0.1:2")
    conf["routes"][0]["shadow"] = "primary"
    with pytest.raises(ConfigError, match="shadow 'primary' is the primary"):
        load_config(conf, environ=ENV)
    conf["routes"][0]["shadow"] = "nobody"
    with pytest.raises(ConfigError, match="unknown shadow upstream 'nobody'"):
        load_config(conf, environ=ENV)
    conf = config("http://127.0.0.1:1", "http://127.0.0.1:2")
    with pytest.raises(ConfigError, match="SHADOW_KEY"):
        load_config(conf, environ={"PRIMARY_KEY": "x"})  # its credential must be set too


async def test_a_copy_is_never_in_the_budget_hold_or_the_usage_record() -> None:
    from decimal import Decimal

    from fallback_mw.config import BudgetConfig
    from fallback_mw.store.ledgers.memory import MemoryLedger

    def answer(tokens: int) -> Any:
        async def handle(request: web.Request) -> web.StreamResponse:
            usage = {"prompt_tokens": tokens, "completion_tokens": tokens}
            return web.json_response({"model": "m", "usage": usage})

        return handle

    async with (
        upstream(answer(10)) as primary,
        upstream(answer(1_000_000)) as shadow,
    ):
        conf = config(primary.url, shadow.url, budget="acme", replayable_methods=["POST"])
        conf["budgets"] = {"acme": {"limit": 100, "window": "total", "default_hold": 1}}
        conf["prices"] = {"m": {"input_per_mtok": 1, "output_per_mtok": 1}}
        ledger = MemoryLedger()
        gateway = Gateway(host_app, config=conf, environ=ENV, ledger=ledger)
        try:
            async with client_for(gateway) as client:
                response = await client.post(
                    "/v1/chat", headers=CALLER, json={"model": "m", "max_tokens": 5}
                )
            await settled(gateway, lambda: shadow.count == 1)
            shadows = gateway.services.shadows
            await settled(gateway, lambda: not shadows.in_flight)
        finally:
            await gateway.aclose()
    assert response.status_code == 200
    status = await ledger.status("acme", BudgetConfig(limit=Decimal(100), window="total"))
    assert status.spent == Decimal("0.00002")  # the primary's 20 tokens, not the copy's 2M
    assert status.held == 0
    (record,) = await ledger.usage()
    assert record.input_tokens == 10 and [a.candidate for a in record.attempts] == ["primary"]


async def test_no_copy_while_the_shadow_breaker_is_open(recorded: Recorded) -> None:
    async with (
        upstream(status_handler(200, b"primary says")) as primary,
        upstream(status_handler(503)) as shadow,
    ):
        conf = config(primary.url, shadow.url)
        conf["gateway"] = {"breaker": {"window": 4, "min_calls": 2, "cooldown_ms": 60_000}}
        gateway = Gateway(host_app, config=conf, environ=ENV, telemetry=recorded.telemetry)
        shadows = gateway.services.shadows
        try:
            async with client_for(gateway) as client:
                for _ in range(4):
                    response = await client.get("/v1/chat", headers=CALLER)
                    assert response.text == "primary says"  # the copy's 503 is not the client's
                    await settled(gateway, lambda: not shadows.in_flight)
        finally:
            await gateway.aclose()
    assert shadow.count == 2  # two 503s opened its breaker; no packet after that
    assert recorded.shadow_outcomes() == {"failed": 2, "breaker_open": 2}
    # A failed copy's span is an error, as a failed attempt's is (its status stayed UNSET).
    copies = [s for s in recorded.spans.get_finished_spans() if s.name == "gateway.shadow"]
    failed = [s for s in copies if (s.attributes or {})["gateway.shadow.outcome"] == "failed"]
    assert len(failed) == 2
    for span in failed:
        assert span.status.status_code is StatusCode.ERROR
        assert (span.attributes or {})["error.type"] == "503"
    assert all(s.status.status_code is StatusCode.UNSET for s in copies if s not in failed)


async def test_a_copy_answered_with_a_5xx_is_an_error_span_as_an_attempt_is(
    recorded: Recorded,
) -> None:
    """A shadow candidate answering 500 (outside failover_status: an answer, outcome
    `answered`) read UNSET in the trace while the same answer on a gateway.attempt span is
    ERROR with error.type "500": the copy is the one place a candidate's server errors
    show before it carries traffic."""
    async with (
        upstream(status_handler(200, b"primary says")) as primary,
        upstream(status_handler(500)) as shadow,
    ):
        gateway = Gateway(
            host_app, config=config(primary.url, shadow.url), environ=ENV,
            telemetry=recorded.telemetry,
        )  # fmt: skip
        shadows = gateway.services.shadows
        try:
            async with client_for(gateway) as client:
                assert (await client.get("/v1/chat", headers=CALLER)).text == "primary says"
            await settled(gateway, lambda: shadow.count == 1 and not shadows.in_flight)
        finally:
            await gateway.aclose()
    assert recorded.shadow_outcomes() == {"answered": 1}
    (copy,) = [s for s in recorded.spans.get_finished_spans() if s.name == "gateway.shadow"]
    assert (copy.attributes or {})["http.response.status_code"] == 500
    assert (copy.attributes or {})["error.type"] == "500"
    assert copy.status.status_code is StatusCode.ERROR


async def test_a_response_aborted_after_the_commit_is_not_copied(recorded: Recorded) -> None:
    """Only served requests are copied: a response cut short after its head went to the
    client (a reset mid-body) was not served, so the shadow gets nothing."""

    async def breaks_mid_stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(status=200, headers={"content-type": "text/plain"})
        await response.prepare(request)
        await response.write(b"partial-")
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.abort()
        return response

    async with upstream(breaks_mid_stream) as primary, upstream(status_handler(200)) as shadow:
        gateway = Gateway(
            host_app, config=config(primary.url, shadow.url), environ=ENV,
            telemetry=recorded.telemetry,
        )  # fmt: skip
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            if not sent:
                return {"type": "http.request", "body": b"", "more_body": False}
            await asyncio.sleep(3600)
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        headers = [(k.encode(), v.encode()) for k, v in CALLER.items()]
        try:
            await gateway(http_scope("GET", "/v1/chat", headers=headers), receive, send)
            await asyncio.sleep(0.2)
            assert gateway.services.shadows.in_flight == 0
        finally:
            await gateway.aclose()
    assert sent[0]["status"] == 200
    assert not any(m.get("more_body") is False for m in sent)  # aborted, never ended
    assert shadow.count == 0
    assert recorded.shadow_outcomes() == {}


async def test_a_copys_reported_tokens_count_against_the_shadows_tpm(
    recorded: Recorded,
) -> None:
    """A copy's usage is what the candidate's `tpm` is charged, as for a real attempt: a
    copy whose answer reports 600 tokens leaves no room for another under tpm = 1000 (the
    request's own estimate is a handful of tokens)."""

    async def answer(request: web.Request) -> web.StreamResponse:
        usage = {"prompt_tokens": 400, "completion_tokens": 200}
        return web.json_response({"model": "m", "usage": usage})

    async with (
        upstream(status_handler(200, b"primary says")) as primary,
        upstream(answer) as shadow,
    ):
        conf = config(primary.url, shadow.url, replayable_methods=["POST"])
        conf["upstreams"]["candidate"]["tpm"] = 1000
        gateway = Gateway(host_app, config=conf, environ=ENV, telemetry=recorded.telemetry)
        shadows = gateway.services.shadows
        try:
            async with client_for(gateway) as client:
                for _ in range(3):
                    response = await client.post("/v1/chat", headers=CALLER, json={"model": "m"})
                    assert response.text == "primary says"
                    await settled(gateway, lambda: not shadows.in_flight)
        finally:
            await gateway.aclose()
    assert shadow.count == 2  # 600, then 1200: the third would exceed tpm
    assert recorded.shadow_outcomes() == {"answered": 2, "capacity": 1}


async def test_a_copy_the_shadow_refuses_gives_its_token_estimate_back(
    recorded: Recorded,
) -> None:
    """A caller asks for an output limit the primary takes and the shadow (here also the
    fallback) refuses with a 400: nothing generated. The copy's estimate stayed against the
    shadow's tpm for a minute, so such callers left it capacity-skipped for real failovers."""
    async with (
        upstream(status_handler(200, b"primary says")) as primary,
        upstream(status_handler(400, b'{"error": {"message": "max_tokens too large"}}')) as shadow,
    ):
        conf = config(primary.url, shadow.url, replayable_methods=["POST"])
        conf["upstreams"]["candidate"]["tpm"] = 1000
        gateway = Gateway(host_app, config=conf, environ=ENV, telemetry=recorded.telemetry)
        shadows = gateway.services.shadows
        body = {"model": "m", "max_tokens": 900}
        try:
            async with client_for(gateway) as client:
                for _ in range(3):
                    response = await client.post("/v1/chat", headers=CALLER, json=body)
                    assert response.text == "primary says"
                    await settled(gateway, lambda: not shadows.in_flight)
        finally:
            await gateway.aclose()
    assert shadow.count == 3  # each ~910 of the 1000, given back: none skipped
    assert recorded.shadow_outcomes() == {"answered": 3}


async def test_copies_hanging_on_a_shadow_that_is_also_a_fallback_never_hold_its_connections() -> (
    None
):
    """The shadow candidate is the backup of another route, `max_connections = 2`. Copies it
    is slow to answer hold connection slots of their own (a quarter, at least one): a real
    failover to the backup is answered at once, not after the copies' deadline."""
    copies = 0

    async def backup(request: web.Request) -> web.StreamResponse:
        nonlocal copies
        if request.path.startswith("/s/"):  # a copy: hangs until its deadline
            copies += 1
            await asyncio.sleep(3600)
        return web.Response(text="backup says")

    async with (
        upstream(status_handler(200)) as primary,
        upstream(status_handler(503)) as failing,
        upstream(backup) as backup_upstream,
    ):
        conf = {
            "gateway": {"allow_hosts": ["127.0.0.1"], "deadline_ms": 30_000},
            "upstreams": {
                "primary": {"url": primary.url},
                "failing": {"url": failing.url},
                "backup": {"url": backup_upstream.url, "max_connections": 2},
            },
            "routes": [
                {"id": "shadowed", "prefix": "/s/", "plan": ["primary"], "retries": 0,
                 "shadow": "backup", "shadow_percent": 100.0},
                {"id": "chat", "prefix": "/v1/", "plan": ["failing", "backup"], "retries": 1},
            ],
        }  # fmt: skip
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                for session in range(4):
                    await client.get("/s/x", headers={"x-session-id": f"user-{session}"})
                await settled(gateway, lambda: copies >= 1)
                await asyncio.sleep(0.1)  # the rest queue behind their own slot
                started = time.monotonic()
                with anyio.fail_after(5):
                    response = await client.get("/v1/chat")
                elapsed = time.monotonic() - started
        finally:
            await gateway.aclose()
    assert response.status_code == 200
    assert response.text == "backup says"
    assert elapsed < 2
    assert copies == 1  # max(1, 2 // 4): one copy at a time on the backup


async def test_the_bodies_copies_hold_in_flight_are_bounded(recorded: Recorded) -> None:
    """A copy keeps the request body alive until its own deadline, and a caller picks a
    session id in the slice: 256 hanging copies of an 8 MiB replay_buffer would hold 2 GiB.
    The copies in flight hold at most 64 MiB of bodies between them; the rest are dropped."""
    reached = asyncio.Event()

    async def hang(request: web.Request) -> web.StreamResponse:
        reached.set()
        await asyncio.sleep(3600)
        return web.Response()

    body = b"x" * (1 << 20)  # the default replay_buffer: buffered, so copied
    async with upstream(status_handler(200, b"primary says")) as primary, upstream(hang) as shadow:
        # Every copy hangs until the 65th request is in: under load (20 on two cores) the
        # 65 requests took longer than the default 5 s deadline, and the first copies had
        # ended at theirs (51 in flight).
        conf = config(primary.url, shadow.url, replayable_methods=["POST"], deadline_ms=120_000)
        gateway = Gateway(host_app, config=conf, environ=ENV, telemetry=recorded.telemetry)
        shadows = gateway.services.shadows
        try:
            async with client_for(gateway) as client:
                for session in range(65):
                    headers = {"x-session-id": f"user-{session}"}
                    response = await client.post("/v1/chat", headers=headers, content=body)
                    assert response.text == "primary says"
                await asyncio.wait_for(reached.wait(), 10)
            assert shadows.in_flight == 64  # 64 x 1 MiB: the 65th would pass 64 MiB
            assert recorded.shadow_outcomes() == {"overloaded": 1}
        finally:
            await gateway.aclose()
    assert shadows.in_flight == 0
    assert shadows.bytes_in_flight == 0


async def test_a_copy_in_flight_holds_its_body_not_the_body_parsed_as_json() -> None:
    """The bound on the bodies copies hold counts bytes; a JSON body parsed holds many times
    its size (`[{},{},...]`: a dict of 64 bytes per 3 bytes sent). Copies hanging on a slow
    shadow kept the parsed body alive as well: 60 sequential 1 MiB POSTs held 1.5 GB, a
    caller needing no concurrency (the copies outlive its requests) to get there. A copy
    keeps the bytes it sends and what it needs to know of them, never the parsed body."""
    arrived = 0

    async def hang(request: web.Request) -> web.StreamResponse:
        nonlocal arrived
        arrived += 1
        await asyncio.sleep(3600)
        return web.Response()

    copies = 6
    body = b'{"model":"m","max_tokens":5,"messages":[' + b",".join([b"{}"] * 70_000) + b"]}"
    sizes = []
    async with upstream(status_handler(200, b"primary says")) as primary, upstream(hang) as shadow:
        # Every copy hangs until the last is counted (under load the 5 s default deadline
        # ended the first ones before: 4 in flight of 7).
        conf = config(primary.url, shadow.url, replayable_methods=["POST"], deadline_ms=120_000)
        conf["upstreams"]["candidate"]["tpm"] = 1_000_000  # the copy's estimate is read too
        gateway = Gateway(host_app, config=conf, environ=ENV)
        shadows = gateway.services.shadows
        try:
            async with client_for(gateway) as client:
                await client.post("/v1/chat", headers={"x-session-id": "warm"}, content=b"{}")
                await settled(gateway, lambda: arrived == 1)
                tracemalloc.start()
                try:
                    gc.collect()
                    before = tracemalloc.get_traced_memory()[0]
                    for session in range(copies):
                        headers = {"x-session-id": f"user-{session}"}
                        response = await client.post("/v1/chat", headers=headers, content=body)
                        assert response.text == "primary says"
                    await settled(gateway, lambda: arrived == 1 + copies)
                    assert shadows.in_flight == 1 + copies
                    gc.collect()
                    sizes.append(tracemalloc.get_traced_memory()[0] - before)
                finally:
                    tracemalloc.stop()
        finally:
            await gateway.aclose()
    # The bodies themselves (~1.2 MB) and their copies' bookkeeping; parsed, ~30 MB.
    assert sizes[0] < 8 * copies * len(body), (sizes[0], copies * len(body))
    assert all(len(r.body) == len(body) for r in shadow.received[1:])


async def test_a_copy_that_is_the_probe_and_cut_by_shutdown_mid_body_frees_its_slot(
    redis_url: str,
) -> None:
    """A copy the half-open breaker admitted as its probe got the shadow's head, then the
    gateway stopped while it read the body: the copy was cancelled past every release, so
    with a shared state every other gateway process skipped the shadow (and its copies)
    for the probe's whole lease. The copy ends its admission however it ends: booked at
    its head, as an attempt is, before its body is read."""
    import redis.asyncio as aioredis

    from fallback_mw.store_url import split_state_url

    answer = {"status": 503}
    reading = asyncio.Event()

    async def shadow_handler(request: web.Request) -> web.StreamResponse:
        if answer["status"] == 503:
            return web.Response(status=503)
        response = web.StreamResponse(status=200)
        await response.prepare(request)
        await response.write(b"{")
        reading.set()
        await asyncio.sleep(3600)  # the rest of the body never comes
        return response

    async with (
        upstream(status_handler(200, b"primary says")) as primary,
        upstream(shadow_handler) as shadow,
    ):
        conf = config(primary.url, shadow.url)
        conf["gateway"] = {
            "state": redis_url,
            "breaker": {"window": 4, "min_calls": 2, "cooldown_ms": 100},
        }
        gateway = Gateway(host_app, config=conf, environ=ENV)
        shadows = gateway.services.shadows
        url, prefix = split_state_url(redis_url)
        inspect = aioredis.Redis.from_url(url, decode_responses=True)
        key = f"{prefix}breaker:candidate"
        try:
            async with client_for(gateway) as client:
                for _ in range(2):
                    assert (await client.get("/v1/chat", headers=CALLER)).text == "primary says"
                    await settled(gateway, lambda: not shadows.in_flight)
                assert await inspect.hget(key, "st") == "open"
                await asyncio.sleep(0.15)
                answer["status"] = 200
                assert (await client.get("/v1/chat", headers=CALLER)).text == "primary says"
                await asyncio.wait_for(reading.wait(), 10)  # the probe copy reads its body
                for _ in range(200):  # its head booked (the shadow's write comes first)
                    if await inspect.hget(key, "st") == "closed":
                        break
                    await asyncio.sleep(0.01)
                assert await inspect.hget(key, "st") == "closed"
        finally:
            await gateway.aclose()  # cancels the copy mid-body
        try:
            assert shadows.in_flight == 0
            assert await inspect.hget(key, "probe") == "0", "a probe slot held for nobody"
        finally:
            await inspect.aclose()
    assert shadow.count == 3


async def test_a_copy_carries_the_callers_baggage_as_the_attempt_does(
    recorded: Recorded,
) -> None:
    # The attempt to the primary carried the caller's `baggage` (re-injected with its own
    # span's context), but the shadow copy's context was its span alone: the shadow
    # upstream got no baggage at all, a different request from the one it shadows.
    baggage = "tenant.tier=gold,user.segment=beta"
    async with (
        upstream(status_handler(200, b"primary says")) as primary,
        upstream(status_handler(200, b"shadow says")) as shadow,
    ):
        gateway = Gateway(
            host_app, config=config(primary.url, shadow.url), environ=ENV,
            telemetry=recorded.telemetry,
        )  # fmt: skip
        try:
            async with client_for(gateway) as client:
                response = await client.get(
                    "/v1/chat",
                    headers={**CALLER, "traceparent": CALLER_TRACEPARENT, "baggage": baggage},
                )
            shadows = gateway.services.shadows
            await settled(gateway, lambda: shadow.count == 1 and not shadows.in_flight)
        finally:
            await gateway.aclose()
    assert response.status_code == 200

    def members(request: Any) -> set[str]:
        (value,) = [v for k, v in request.headers if k.lower() == "baggage"]
        return set(value.split(","))

    assert members(primary.received[0]) == set(baggage.split(","))
    assert members(shadow.received[0]) == set(baggage.split(","))
    (traceparent,) = [v for k, v in shadow.received[0].headers if k.lower() == "traceparent"]
    spans = {s.name: s for s in recorded.spans.get_finished_spans()}
    assert traceparent.split("-")[2] == format(spans["gateway.shadow"].context.span_id, "016x")


class BookedSuccess(MemoryHealth):
    """The memory state, saying when a success has been booked to `watched`'s breaker."""

    def __init__(self, breaker: BreakerConfig, watched: str) -> None:
        super().__init__(breaker)
        self.watched = watched
        self.succeeded = asyncio.Event()

    async def record(self, upstream: str, *, failure: bool, **marks: Any) -> None:
        await super().record(upstream, failure=failure, **marks)
        if upstream == self.watched and not failure:
            self.succeeded.set()


async def test_a_copy_that_is_the_probe_is_judged_by_its_head_not_its_whole_body() -> None:
    """The shadow's breaker half-open, a copy was its probe, and the shadow streamed a long
    answer (an LLM's, a minute): the copy booked its outcome only once the whole body was
    read, so for all that time the breaker stayed half-open, every request the shadow is a
    candidate of skipped it (`breaker_open`), and past the probe's lease a second probe went
    out beside the first. An attempt is judged by its head; so is a copy."""
    answer = {"status": 503}
    finish = asyncio.Event()
    # A cooldown a loaded loop cannot outlast between the second failed copy and the
    # check that the breaker is open: at 100 ms it had (load 20+, 1 in 3 runs), the check
    # was the half-open probe, attempted, and answered 502 where the skip's 503 was meant.
    breaker = {"window": 4, "min_calls": 2, "cooldown_ms": 1000}
    health = BookedSuccess(BreakerConfig(**breaker), "candidate")

    async def shadow_handler(request: web.Request) -> web.StreamResponse:
        if answer["status"] == 503:
            return web.Response(status=503)
        if finish.is_set() or request.path.startswith("/direct/"):
            return web.Response(body=b"shadow says")
        response = web.StreamResponse(status=200)
        await response.prepare(request)
        await response.write(b'data: {"n": 1}\n\n')
        await finish.wait()  # the rest of a long stream
        await response.write(b"data: [DONE]\n\n")
        return response

    async with (
        upstream(status_handler(200, b"primary says")) as primary,
        upstream(shadow_handler) as shadow,
    ):
        conf = config(primary.url, shadow.url)
        conf["gateway"] = {"breaker": breaker}
        conf["routes"].append({"id": "direct", "prefix": "/direct/", "plan": ["candidate"]})
        gateway = Gateway(host_app, config=conf, environ=ENV, health=health)
        shadows = gateway.services.shadows
        try:
            async with client_for(gateway) as client:
                for _ in range(2):
                    assert (await client.get("/v1/chat", headers=CALLER)).text == "primary says"
                    await settled(gateway, lambda: not shadows.in_flight)
                assert (await client.get("/direct/x")).status_code == 503  # open: skipped
                await asyncio.sleep(1.05)  # the cooldown
                answer["status"] = 200
                assert (await client.get("/v1/chat", headers=CALLER)).text == "primary says"
                # The probe copy's head is in (its body still streaming): booked.
                await asyncio.wait_for(health.succeeded.wait(), 5)
                response = await client.get("/direct/x")
                finish.set()
                assert response.headers.get("x-gateway-skipped") is None
                assert response.headers["x-gateway-provider"] == "candidate"
        finally:
            finish.set()
            await gateway.aclose()


async def test_a_copy_whose_model_rewrite_fails_never_reaches_the_caller(
    recorded: Recorded,
) -> None:
    """A copy is only measured: whatever goes wrong taking it must never reach the caller.
    Its model rewrite is written when the copy is taken, on the request's own (deep) stack:
    a body nested just under the depth `json.loads` reads (about 930 levels) was read, and
    writing it again there raised RecursionError through the caller's served request (an
    ASGI error after its answer). Such a copy is a failed one; the caller never sees it."""
    async with (
        upstream(status_handler(200, b"primary says")) as primary,
        upstream(status_handler(200, b"shadow says")) as shadow,
    ):
        conf = config(primary.url, shadow.url, replayable_methods=["POST"])
        conf["upstreams"]["candidate"]["model"] = "shadow-model"
        gateway = Gateway(host_app, config=conf, environ=ENV, telemetry=recorded.telemetry)
        try:
            async with client_for(gateway) as client:
                for depth in range(850, 1000):  # every depth up to what no parser here reads
                    body = b'{"model":"m","x":' + b"[" * depth + b"]" * depth + b"}"
                    headers = {"x-session-id": f"user-{depth}"}
                    response = await client.post("/v1/chat", headers=headers, content=body)
                    assert (response.status_code, response.text) == (200, "primary says")
                await settled(gateway, lambda: gateway.services.shadows.in_flight == 0)
        finally:
            await gateway.aclose()
    assert shadow.received, "no copy was sent at all: the test proves nothing"
    assert all(b'"model":"shadow-model"' in r.body for r in shadow.received)
    outcomes = recorded.shadow_outcomes()
    assert set(outcomes) <= {"answered", "failed", "model_rewrite"}, outcomes  # not JSON: no copy
    assert outcomes["answered"] == len(shadow.received)
