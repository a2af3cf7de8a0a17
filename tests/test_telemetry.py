"""Telemetry (SPEC §9): spans, metrics and the request log line, checked with the SDK's
in-memory exporters against the real Gateway and real upstream sockets."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

import httpx
import pytest
from aiohttp import web
from opentelemetry import trace as trace_api
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode, format_span_id, format_trace_id

from fallback_mw import Gateway
from fallback_mw.config import RouteConfig
from fallback_mw.failover.outcome import Outcome, OutcomeKind
from fallback_mw.faults import UpstreamFault
from fallback_mw.health import AlwaysHealthy
from fallback_mw.request.context import AttemptRecord, RequestContext, Usage
from fallback_mw.store.routes import open_store
from fallback_mw.telemetry import Telemetry
from tests.helpers import COMPILED, client_for, gateway_client, http_scope, request_then_disconnect
from tests.hostile.test_request_framing import drive
from tests.upstreams import closed_port_url, host_app, serve_asgi, status_handler, upstream

pytestmark = pytest.mark.anyio

ENV = {"PRIMARY_KEY": "sk-primary-0001", "BACKUP_KEY": "sk-backup-0002"}
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Recorded:
    spans: InMemorySpanExporter
    reader: InMemoryMetricReader
    telemetry: Telemetry

    def finished(self) -> tuple[ReadableSpan, ...]:
        return self.spans.get_finished_spans()

    def request_span(self) -> ReadableSpan:
        found = [s for s in self.finished() if s.name == "gateway.request"]
        assert len(found) == 1, [s.name for s in self.finished()]
        return found[0]

    def attempt_spans(self) -> list[ReadableSpan]:
        spans = [s for s in self.finished() if s.name == "gateway.attempt"]
        return sorted(spans, key=lambda s: s.attributes["gateway.attempt.number"])  # type: ignore[index]

    def points(self, name: str) -> list[Any]:
        data = self.reader.get_metrics_data()
        found: list[Any] = []
        if data is None:
            return found
        for resource in data.resource_metrics:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    if metric.name == name:
                        found.extend(metric.data.data_points)
        return found

    def counted(self, name: str) -> list[Any]:
        """The points of the series counted up (not those exported at 0 from the start)."""
        return [pt for pt in self.points(name) if pt.value]


@pytest.fixture
def recorded() -> Iterator[Recorded]:
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider(shutdown_on_exit=False)
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    telemetry = Telemetry(tracer_provider=tracer_provider, meter_provider=meter_provider)
    yield Recorded(exporter, reader, telemetry)
    tracer_provider.shutdown()
    meter_provider.shutdown()


def make_config(primary: str, backup: str, **route: Any) -> dict[str, Any]:
    return {
        "gateway": {"max_request_body": 1 << 20, "replay_buffer": 1 << 16},
        "upstreams": {
            "primary": {"url": primary, "auth_env": "PRIMARY_KEY"},
            "backup": {
                "url": backup,
                "auth_header": "x-api-key",
                "auth_scheme": "",
                "auth_env": "BACKUP_KEY",
            },
        },
        "routes": [
            {
                "id": "chat",
                "prefix": "/v1/",
                "plan": ["primary", "backup"],
                "retries": 1,
                "backoff_ms": 0,
                **route,
            }
        ],
    }


def waiting_handler(release: asyncio.Event, status: int = 200) -> Any:
    async def handle(request: web.Request) -> web.StreamResponse:
        await release.wait()
        return web.Response(status=status, text="late")

    return handle


def request_logs(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "fallback_mw.request"]


def header_values(received: Sequence[tuple[str, str]], name: str) -> list[str]:
    return [v for k, v in received if k == name]


async def test_failover_trace_metrics_and_log(
    recorded: Recorded, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="fallback_mw.request")
    async with (
        upstream(status_handler(503)) as p,
        upstream(status_handler(200, b'{"ok": true}')) as b,
    ):
        config = make_config(p.url, b.url, replayable_methods=["POST"])
        gateway = Gateway(host_app, config=config, environ=ENV, telemetry=recorded.telemetry)
        async with client_for(gateway) as client:
            response = await client.post(
                "/v1/chat/completions",
                json={"model": "gpt-4o-mini", "messages": []},
                headers={"traceparent": TRACEPARENT, "x-tenant-id": "acme"},
            )
        await gateway.aclose()
    assert response.status_code == 200
    assert response.headers["x-gateway-provider"] == "backup"

    request = recorded.request_span()
    attrs = dict(request.attributes or {})
    assert attrs["gateway.route.id"] == "chat"
    assert attrs["gateway.tenant"] == "acme"
    assert attrs["gateway.plan.candidates"] == ("primary", "backup")
    assert attrs["gateway.plan.chosen"] == "backup"
    assert attrs["gateway.attempts"] == 2
    assert attrs["gateway.fallback"] is True
    assert attrs["gateway.canary"] is False
    assert attrs["gateway.outcome"] == "served"
    assert attrs["gen_ai.request.model"] == "gpt-4o-mini"
    assert attrs["http.response.status_code"] == 200
    assert "error.type" not in attrs
    assert request.status.status_code is StatusCode.UNSET
    # The caller's trace context is honoured.
    assert format_trace_id(request.context.trace_id) == TRACE_ID
    assert request.parent is not None and format_span_id(request.parent.span_id) == PARENT_ID
    assert request.kind is SpanKind.SERVER

    first, second = recorded.attempt_spans()
    assert first.parent is not None and first.parent.span_id == request.context.span_id
    assert second.parent is not None and second.parent.span_id == request.context.span_id
    assert dict(first.attributes or {}) == {
        "gateway.candidate": "primary",
        "gateway.attempt.number": 1,
        "server.address": "127.0.0.1",
        "server.port": int(p.url.rsplit(":", 1)[1]),
        "gateway.credential.index": 0,
        "http.response.status_code": 503,
        "gateway.failure.kind": "status",
        "error.type": "503",
        "gen_ai.operation.name": "chat",  # GenAI semconv, from the path
        "gateway.decision": "next_candidate",  # what the walk did after it, and why
        "gateway.decision.reason": "failover-class: the next candidate",
    }
    assert first.status.status_code is StatusCode.ERROR
    assert dict(second.attributes or {}) == {
        "gateway.candidate": "backup",
        "gateway.attempt.number": 2,
        "server.address": "127.0.0.1",
        "server.port": int(b.url.rsplit(":", 1)[1]),
        "gateway.credential.index": 0,
        "http.response.status_code": 200,
        "gen_ai.operation.name": "chat",
        "gateway.decision": "serve",
        "gateway.decision.reason": "a response outside failover_status is served",
    }
    assert first.kind is SpanKind.CLIENT
    # Attempts are real intervals inside the request.
    assert request.start_time is not None and request.end_time is not None
    assert first.start_time is not None and second.end_time is not None
    assert request.start_time <= first.start_time < second.end_time <= request.end_time

    # Each upstream got exactly one traceparent: its own attempt's, not the caller's.
    for got, span in ((p, first), (b, second)):
        values = header_values(got.received[0].headers, "traceparent")
        assert values == [f"00-{TRACE_ID}-{format_span_id(span.context.span_id)}-01"], values

    requests = recorded.counted("gateway.requests")
    assert [(dict(pt.attributes), pt.value) for pt in requests] == [
        (
            {
                "gateway.route.id": "chat",
                "gateway.outcome": "served",
                "gateway.fallback": True,
                "gateway.canary": False,
                "gateway.fault": False,
                "gateway.candidate": "backup",
                "http.response.status_code": 200,  # what the client was answered
            },
            1,
        )
    ]
    attempts = {
        (pt.attributes["gateway.candidate"], pt.attributes["gateway.failure.kind"]): pt.value
        for pt in recorded.points("gateway.attempts")
    }
    assert attempts == {("primary", "status"): 1, ("backup", "none"): 1}
    fallbacks = recorded.points("gateway.fallbacks")
    assert len(fallbacks) == 1 and fallbacks[0].value == 1
    assert fallbacks[0].attributes["gateway.candidate"] == "backup"
    assert fallbacks[0].attributes["gateway.primary"] == "primary"
    (duration,) = recorded.points("gateway.request.duration")
    assert duration.count == 1 and 0 < duration.sum < 5

    (log,) = request_logs(caplog)
    assert log.levelno == logging.WARNING  # a failover: shown by default logging
    assert log.getMessage().startswith(
        "gateway request route=chat outcome=served status=200 chosen=backup attempts=2 "
        "candidates=primary,backup duration_ms="
    )
    fields = log.__dict__
    assert fields["route"] == "chat"
    assert fields["candidates"] == ["primary", "backup"]
    assert fields["chosen"] == "backup"
    assert fields["attempts"] == 2
    assert fields["attempt_candidates"] == ["primary", "backup"]
    assert fields["outcome"] == "served"
    assert fields["fallback"] is True
    assert 0 < fields["duration_ms"] < 5000
    assert fields["trace_id"] == TRACE_ID
    json.dumps({k: fields[k] for k in ("route", "candidates", "chosen", "duration_ms")})


async def test_served_as_is_4xx(recorded: Recorded, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="fallback_mw.request")
    async with upstream(status_handler(429)) as p, upstream(status_handler(200)) as b:
        gateway = Gateway(
            host_app, config=make_config(p.url, b.url), environ=ENV, telemetry=recorded.telemetry
        )
        async with client_for(gateway) as client:
            response = await client.get("/v1/models")
        await gateway.aclose()
    assert response.status_code == 429
    assert b.count == 0

    attrs = dict(recorded.request_span().attributes or {})
    assert attrs["gateway.plan.candidates"] == ("primary", "backup")
    assert attrs["gateway.plan.chosen"] == "primary"
    assert attrs["gateway.attempts"] == 1
    assert attrs["gateway.fallback"] is False
    assert attrs["gateway.outcome"] == "served"
    assert attrs["http.response.status_code"] == 429
    assert attrs["gateway.tenant"] == "default"
    assert "error.type" not in attrs
    assert "gen_ai.request.model" not in attrs  # a GET has no model
    (attempt,) = recorded.attempt_spans()
    attempt_attrs = dict(attempt.attributes or {})
    assert attempt_attrs["http.response.status_code"] == 429
    assert "gateway.failure.kind" not in attempt_attrs
    assert attempt.status.status_code is StatusCode.UNSET
    assert [pt.value for pt in recorded.points("gateway.fallbacks")] == [0]  # none counted
    (log,) = request_logs(caplog)
    assert log.__dict__["status"] == 429 and log.__dict__["outcome"] == "served"


async def test_a_served_5xx_is_an_error_on_the_request_span(
    recorded: Recorded, caplog: pytest.LogCaptureFixture
) -> None:
    # An upstream's 500 (not a failover_status) is served as it is: the outcome stays
    # `served`, but the client got a server error, and OpenTelemetry's HTTP server
    # convention makes that span an error (trace backends count errors by span status:
    # an upstream answering 500 to everything read as a healthy service).
    caplog.set_level(logging.INFO, logger="fallback_mw.request")
    async with upstream(status_handler(500)) as p, upstream(status_handler(200)) as b:
        gateway = Gateway(
            host_app, config=make_config(p.url, b.url), environ=ENV, telemetry=recorded.telemetry
        )
        async with client_for(gateway) as client:
            response = await client.get("/v1/models")
        await gateway.aclose()
    assert response.status_code == 500 and b.count == 0
    request = recorded.request_span()
    attrs = dict(request.attributes or {})
    assert attrs["gateway.outcome"] == "served" and attrs["http.response.status_code"] == 500
    assert attrs["error.type"] == "500"
    assert request.status.status_code is StatusCode.ERROR
    assert request.status.description == "500"
    # The upstream answered: no failure kind (no breaker mark, no failover). But its span
    # is an error too, as OpenTelemetry's HTTP client convention has it: a real trace's
    # error spans were the request alone, its attempt to the upstream that sent the 500
    # read as fine.
    (attempt,) = recorded.attempt_spans()
    attempt_attrs = dict(attempt.attributes or {})
    assert "gateway.failure.kind" not in attempt_attrs
    assert attempt_attrs["error.type"] == "500"
    assert attempt.status.status_code is StatusCode.ERROR
    assert attempt.status.description == "500"
    (point,) = recorded.counted("gateway.requests")
    assert point.attributes["gateway.outcome"] == "served"
    # The counter says what the client got too: the shipped rules and dashboards count a
    # served 5xx as a server error (the outcome alone read it as a healthy answer).
    assert point.attributes["http.response.status_code"] == 500
    # The log line says so where default logging shows it: an on-call reading a real
    # `serve` log during an upstream's 500s found only INFO lines (hidden under a host
    # with default logging) saying `outcome=served status=500`.
    (log,) = request_logs(caplog)
    assert log.levelno == logging.WARNING
    assert "outcome=served status=500" in log.getMessage()


async def test_a_failure_after_the_commit_point_is_on_the_trace(
    recorded: Recorded, caplog: pytest.LogCaptureFixture
) -> None:
    # The attempt span ends at the head (a 200, no failure then); the idle timeout that
    # cut the body later is on the request span: which attempt, how, and the rule.
    caplog.set_level(logging.INFO, logger="fallback_mw.request")

    async def stalls_mid_stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(status=200)
        await response.prepare(request)
        await response.write(b"partial-")
        await asyncio.sleep(2)
        return response

    async with upstream(stalls_mid_stream) as p, upstream(status_handler(200)) as b:
        config = make_config(p.url, b.url)
        config["upstreams"]["primary"]["idle_timeout_ms"] = 300
        gateway = Gateway(host_app, config=config, environ=ENV, telemetry=recorded.telemetry)
        async with serve_asgi(gateway) as url, httpx.AsyncClient(base_url=url) as client:
            with pytest.raises(httpx.RemoteProtocolError):
                await client.get("/v1/stream")
        await gateway.aclose()
    assert b.count == 0
    span = recorded.request_span()
    assert dict(span.attributes or {})["gateway.outcome"] == "aborted"
    events = [(e.name, dict(e.attributes or {})) for e in span.events]
    assert events == [
        (
            "gateway.response.aborted",
            {
                "gateway.candidate": "primary",
                "gateway.attempt.number": 1,
                "gateway.failure.kind": "timeout",
                "gateway.rule": "response_started",
            },
        )
    ]
    (attempt,) = recorded.attempt_spans()
    assert dict(attempt.attributes or {})["http.response.status_code"] == 200
    (log,) = request_logs(caplog)
    assert log.__dict__["rule"] == "response_started"


async def test_every_failure_kind_an_attempt_carries_is_in_the_docs(recorded: Recorded) -> None:
    # A dashboard on gateway.failure.kind is built from docs/telemetry.md's attempt table: a
    # caller's body that is not its declared length booked its attempt `bad_request` (and
    # one over max_request_body `request_too_large`), kinds the table did not name.
    async with upstream(status_handler(200, b"ok")) as primary:
        conf = {
            "gateway": {"allow_hosts": ["127.0.0.1"], "replay_buffer": 1024},
            "upstreams": {"primary": {"url": primary.url}},
            "routes": [{"id": "r", "prefix": "/v1/", "plan": ["primary"]}],
        }
        gateway = Gateway(host_app, config=conf, telemetry=recorded.telemetry)
        try:
            status, _ = await drive(gateway, 5000, [b"a" * 2000, b"b" * 1000])  # short
        finally:
            await gateway.aclose()
    assert status == 400
    (point,) = recorded.points("gateway.attempts")
    assert dict(point.attributes)["gateway.failure.kind"] == "bad_request"
    (row,) = [
        line
        for line in (ROOT / "docs" / "telemetry.md").read_text(encoding="utf-8").splitlines()
        if line.startswith("| `gateway.failure.kind` |")
    ]
    documented = set(re.findall(r"`([a-z_]+)` \(", row))
    # Every kind an attempt span can end with (after the commit point the attempt span has
    # ended: those kinds are the gateway.response.aborted event's, documented there).
    never_an_attempt = {"no_candidate", "repeat_budget", "no_other_credential"}
    kinds = {
        Outcome(kind).failure_kind or "status"
        for kind in get_args(OutcomeKind)
        if kind not in never_an_attempt and kind != "response_too_large"
    }
    kinds |= {"fault", "tls", "cancelled"}
    assert kinds - documented == set()


async def test_a_caller_that_stalls_its_upload_is_not_booked_as_the_upstreams_timeout(
    recorded: Recorded, caplog: pytest.LogCaptureFixture
) -> None:
    # A platform team's slow uploader (its body streams to the attempt, then stops): the
    # 408 is the caller's (SPEC §12), yet its attempt carried gateway.failure.kind
    # `timeout`, the upstream's connect / first-byte timeout in docs/telemetry.md, and the
    # log line said `failures=primary:timeout`: dashboards and log searches for a slow
    # upstream counted the caller's stall against the primary.
    caplog.set_level(logging.INFO, logger="fallback_mw.request")
    async with upstream(status_handler(200, b"ok")) as primary:
        conf = {
            "gateway": {"allow_hosts": ["127.0.0.1"], "replay_buffer": 1024},
            "upstreams": {"primary": {"url": primary.url}},
            "routes": [{"id": "r", "prefix": "/v1/", "plan": ["primary"], "deadline_ms": 300}],
        }
        gateway = Gateway(host_app, config=conf, telemetry=recorded.telemetry)
        sent: list[dict[str, Any]] = []
        pieces = [{"type": "http.request", "body": b"a" * 2000, "more_body": True}]

        async def receive() -> dict[str, Any]:
            if pieces:
                return pieces.pop()
            await asyncio.sleep(30)  # the caller stalls
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = http_scope("PUT", "/v1/files", headers=[(b"content-length", b"5000")])
        try:
            await gateway(scope, receive, send)
        finally:
            await gateway.aclose()
    assert sent[0]["status"] == 408
    (point,) = recorded.points("gateway.attempts")
    assert dict(point.attributes)["gateway.failure.kind"] == "request_timeout"
    (attempt,) = recorded.attempt_spans()
    assert dict(attempt.attributes or {})["gateway.failure.kind"] == "request_timeout"
    (log,) = request_logs(caplog)
    assert "primary:timeout" not in log.getMessage(), log.getMessage()


async def test_deadline_exceeded(recorded: Recorded, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="fallback_mw.request")
    release = asyncio.Event()
    async with upstream(waiting_handler(release)) as p, upstream(status_handler(200)) as b:
        config = make_config(p.url, b.url, deadline_ms=150)
        gateway = Gateway(host_app, config=config, environ=ENV, telemetry=recorded.telemetry)
        async with client_for(gateway) as client:
            response = await client.get("/v1/models")
        release.set()
        await gateway.aclose()
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "deadline_exceeded"

    request = recorded.request_span()
    attrs = dict(request.attributes or {})
    assert attrs["gateway.outcome"] == "deadline_exceeded"
    assert attrs["error.type"] == "deadline_exceeded"
    assert attrs["gateway.attempts"] == 1
    assert attrs["gateway.fallback"] is False
    assert "gateway.plan.chosen" not in attrs
    assert attrs["http.response.status_code"] == 504
    assert request.status.status_code is StatusCode.ERROR
    (attempt,) = recorded.attempt_spans()
    attempt_attrs = dict(attempt.attributes or {})
    assert attempt_attrs["gateway.failure.kind"] == "deadline"  # the walk's, not the upstream's
    assert attempt_attrs["error.type"] == "deadline"
    assert "http.response.status_code" not in attempt_attrs
    assert attempt.start_time is not None and attempt.end_time is not None
    assert (attempt.end_time - attempt.start_time) / 1e9 > 0.1  # a real duration
    (point,) = recorded.counted("gateway.requests")
    assert point.attributes["gateway.outcome"] == "deadline_exceeded"
    assert point.attributes["gateway.candidate"] == "none"
    (log,) = request_logs(caplog)
    assert log.levelno == logging.WARNING
    assert log.__dict__["outcome"] == "deadline_exceeded" and log.__dict__["chosen"] is None


async def test_cancelled_client(recorded: Recorded, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="fallback_mw.request")
    release = asyncio.Event()
    async with upstream(waiting_handler(release)) as p, upstream(status_handler(200)) as b:
        gateway = Gateway(
            host_app, config=make_config(p.url, b.url), environ=ENV, telemetry=recorded.telemetry
        )
        messages: list[dict[str, Any]] = []
        receive = request_then_disconnect(after=0.2)

        async def send(message: Any) -> None:
            messages.append(message)

        await gateway(http_scope("GET", "/v1/models"), receive, send)
        release.set()
        await gateway.aclose()
    assert messages == []
    assert b.count == 0

    request = recorded.request_span()
    attrs = dict(request.attributes or {})
    assert attrs["gateway.outcome"] == "client_disconnected"
    assert attrs["error.type"] == "client_disconnected"
    assert attrs["gateway.attempts"] == 1
    assert attrs["gateway.plan.candidates"] == ("primary", "backup")
    assert "gateway.plan.chosen" not in attrs
    assert request.status.status_code is StatusCode.UNSET  # the caller's doing
    (attempt,) = recorded.attempt_spans()
    assert attempt.end_time is not None  # the attempt cut in flight still ends
    assert dict(attempt.attributes or {})["gateway.failure.kind"] == "cancelled"
    assert attempt.parent is not None and attempt.parent.span_id == request.context.span_id
    (point,) = recorded.points("gateway.attempts")
    assert point.attributes["gateway.failure.kind"] == "cancelled"
    (log,) = request_logs(caplog)
    assert log.__dict__["outcome"] == "client_disconnected" and log.levelno == logging.INFO


class PrimaryBreakerOpen(AlwaysHealthy):
    async def admit(self, upstream: str, *, lease: float = 0.0, admission: Any = None) -> bool:
        return upstream != "primary"


async def test_skipped_candidate(recorded: Recorded, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="fallback_mw.request")
    async with upstream(status_handler(200)) as p, upstream(status_handler(200)) as b:
        gateway = Gateway(
            host_app,
            config=make_config(p.url, b.url),
            environ=ENV,
            telemetry=recorded.telemetry,
            health=PrimaryBreakerOpen(),
        )
        async with client_for(gateway) as client:
            response = await client.get("/v1/models")
        await gateway.aclose()
    assert response.status_code == 200 and p.count == 0

    request = recorded.request_span()
    attrs = dict(request.attributes or {})
    assert attrs["gateway.plan.candidates"] == ("primary", "backup")
    assert attrs["gateway.plan.chosen"] == "backup"
    assert attrs["gateway.attempts"] == 1
    assert attrs["gateway.fallback"] is True
    assert attrs["gateway.skipped"] == 1
    assert attrs["gateway.outcome"] == "served"
    events = [(e.name, dict(e.attributes or {})) for e in request.events]
    assert events == [
        (
            "gateway.candidate.skipped",
            {"gateway.candidate": "primary", "gateway.skip.reason": "breaker_open"},
        )
    ]
    (attempt,) = recorded.attempt_spans()
    assert dict(attempt.attributes or {})["gateway.candidate"] == "backup"
    assert dict(attempt.attributes or {})["gateway.attempt.number"] == 1
    (skip,) = recorded.counted("gateway.skips")
    assert dict(skip.attributes) == {
        "gateway.route.id": "chat",
        "gateway.candidate": "primary",
        "gateway.skip.reason": "breaker_open",
        "gateway.fault": False,  # real failures opened that breaker (no fault did)
    }
    (log,) = request_logs(caplog)
    assert log.__dict__["skipped"] == ["primary"]


class FailPrimary:
    async def upstream_fault(self, upstream: str) -> UpstreamFault | None:
        return "fail" if upstream == "primary" else None

    async def pinned_candidate(self, route_id: str) -> str | None:
        return None

    async def aclose(self) -> None:
        return None


async def test_fault_driven_attempts_are_marked_and_counted_apart(recorded: Recorded) -> None:
    async with upstream(status_handler(200)) as p, upstream(status_handler(200)) as b:
        gateway = Gateway(
            host_app,
            config=make_config(p.url, b.url),
            environ=ENV,
            telemetry=recorded.telemetry,
            faults=FailPrimary(),
        )
        async with client_for(gateway) as client:
            assert (await client.get("/v1/models")).status_code == 200
        await gateway.aclose()
    assert p.count == 0
    first, second = recorded.attempt_spans()
    assert dict(first.attributes or {})["gateway.fault"] == "fail"
    assert dict(first.attributes or {})["gateway.failure.kind"] == "fault"
    assert "gateway.fault" not in dict(second.attributes or {})
    assert dict(recorded.request_span().attributes or {})["gateway.fault"] is True
    (point,) = recorded.counted("gateway.requests")
    assert point.attributes["gateway.fault"] is True
    by_candidate = {
        pt.attributes["gateway.candidate"]: pt.attributes["gateway.fault"]
        for pt in recorded.points("gateway.attempts")
    }
    assert by_candidate == {"primary": True, "backup": False}


async def test_attempt_spans_carry_the_upstreams_port_explicit_or_the_schemes_default(
    recorded: Recorded,
) -> None:
    """Read in a real trace: each `gateway.attempt` (a CLIENT span) named its upstream's
    host in `server.address` but not its port, so two upstreams on one host (two ports)
    read as the same server. OpenTelemetry's HTTP client convention wants both:
    `server.port` is the URL's explicit port, or its scheme's default (443 for an https://
    URL written without one)."""
    from fallback_mw.config import UpstreamConfig

    assert UpstreamConfig(url="http://api.example").port == 80
    assert UpstreamConfig(url="https://api.example/v1").port == 443
    assert UpstreamConfig(url="https://api.example:8443").port == 8443
    # Read from the URL when the configuration is loaded and kept as plain instance
    # attributes: each attempt reads them (a pydantic private attribute goes through
    # `__getattr__`, ~2 µs a read: some 40k instructions a request under callgrind).
    assert vars(UpstreamConfig(url="http://api.example:81")).keys() >= {"host", "port"}
    async with upstream(status_handler(200)) as b:
        # The faulted primary's attempt is made (and traced) without a packet sent.
        gateway = Gateway(
            host_app,
            config=make_config("https://localhost/v1", b.url),
            environ=ENV,
            telemetry=recorded.telemetry,
            faults=FailPrimary(),
        )
        async with client_for(gateway) as client:
            assert (await client.get("/v1/models")).status_code == 200
        await gateway.aclose()
    first, second = recorded.attempt_spans()
    assert dict(first.attributes or {})["server.address"] == "localhost"
    assert dict(first.attributes or {})["server.port"] == 443
    assert dict(second.attributes or {})["server.address"] == "127.0.0.1"
    assert dict(second.attributes or {})["server.port"] == int(b.url.rsplit(":", 1)[1])


async def test_interleaved_requests_keep_their_own_spans(recorded: Recorded) -> None:
    async def by_path(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(0.15 if "slow" in request.path else 0.01)
        return web.Response(status=503 if "fail" in request.path else 200)

    async with upstream(by_path) as p, upstream(status_handler(200)) as b:
        gateway = Gateway(
            host_app, config=make_config(p.url, b.url), environ=ENV, telemetry=recorded.telemetry
        )
        async with client_for(gateway) as client:
            slow, failing = await asyncio.gather(
                client.get("/v1/slow", headers={"x-tenant-id": "t-slow"}),
                client.get("/v1/fail", headers={"x-tenant-id": "t-fail"}),
            )
        await gateway.aclose()
    assert slow.headers["x-gateway-provider"] == "primary"
    assert failing.headers["x-gateway-provider"] == "backup"
    spans = {
        s.attributes["gateway.tenant"]: s  # type: ignore[index]
        for s in recorded.finished()
        if s.name == "gateway.request"
    }
    assert spans["t-slow"].attributes["gateway.plan.chosen"] == "primary"  # type: ignore[index]
    assert spans["t-slow"].attributes["gateway.attempts"] == 1  # type: ignore[index]
    assert spans["t-fail"].attributes["gateway.plan.chosen"] == "backup"  # type: ignore[index]
    assert spans["t-fail"].attributes["gateway.attempts"] == 2  # type: ignore[index]
    for tenant, count in (("t-slow", 1), ("t-fail", 2)):
        children = [
            s
            for s in recorded.attempt_spans()
            if s.parent is not None and s.parent.span_id == spans[tenant].context.span_id
        ]
        assert len(children) == count


async def test_a_method_token_the_caller_makes_up_is_recorded_as_other(recorded: Recorded) -> None:
    # A server on h11 (hypercorn, daphne, uvicorn --http h11) hands on any method token;
    # each one the gateway refused (405) became a new value of http.request.method, the
    # attribute span-derived metrics (the collector's spanmetrics, Tempo's generator)
    # group by. OpenTelemetry's HTTP conventions record an unknown method as `_OTHER`.
    config = make_config(closed_port_url(), closed_port_url())
    config["routes"].append(
        {"id": "dav", "prefix": "/dav/", "plan": ["primary"], "methods": ["PROPFIND"]}
    )
    gateway = Gateway(host_app, config=config, environ=ENV, telemetry=recorded.telemetry)
    sent = [("X-MADE-UP-1", "/v1/models"), ("PROPFIND", "/v1/models"), ("PROPFIND", "/dav/")]
    try:
        for method, path in sent:
            sink = _Sink()
            await gateway(http_scope(method, path), request_then_disconnect(5), sink)
            assert sink.status in (405, 502)
    finally:
        await gateway.aclose()
    spans = [s for s in recorded.finished() if s.name == "gateway.request"]
    seen = [
        (
            (s.attributes or {})["http.request.method"],
            (s.attributes or {}).get("http.request.method_original"),
        )
        for s in spans
    ]
    # A method a route of the gateway forwards is known, as the standard ones are.
    assert seen == [("_OTHER", "X-MADE-UP-1"), ("_OTHER", "PROPFIND"), ("PROPFIND", None)]


class _Sink:
    status: int | None = None

    async def __call__(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]


async def test_without_incoming_context_a_new_trace_starts(recorded: Recorded) -> None:
    async with upstream(status_handler(200)) as p, upstream(status_handler(200)) as b:
        gateway = Gateway(
            host_app, config=make_config(p.url, b.url), environ=ENV, telemetry=recorded.telemetry
        )
        async with client_for(gateway) as client:
            await client.get("/v1/models", headers={"traceparent": "not-a-traceparent"})
        await gateway.aclose()
    request = recorded.request_span()
    assert request.parent is None
    (attempt,) = recorded.attempt_spans()
    values = header_values(p.received[0].headers, "traceparent")
    assert values == [
        f"00-{format_trace_id(attempt.context.trace_id)}-"
        f"{format_span_id(attempt.context.span_id)}-{attempt.context.trace_flags:02x}"
    ]


async def test_without_sdk_the_callers_trace_context_passes_through() -> None:
    # Telemetry() with the global (no-op) providers: nothing recorded, context preserved.
    async with upstream(status_handler(200)) as p, upstream(status_handler(200)) as b:
        gateway = Gateway(host_app, config=make_config(p.url, b.url), environ=ENV)
        async with client_for(gateway) as client:
            await client.get(
                "/v1/models", headers={"traceparent": TRACEPARENT, "tracestate": "vendor=x"}
            )
        await gateway.aclose()
    headers = p.received[0].headers
    assert header_values(headers, "traceparent") == [TRACEPARENT]
    assert header_values(headers, "tracestate") == ["vendor=x"]


async def test_without_sdk_or_caller_context_nothing_is_propagated_and_the_line_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The global (no-op) providers and no trace context from the caller: the request skips
    # span work entirely; the upstream sees no trace fields and the log line is still there.
    caplog.set_level(logging.INFO, logger="fallback_mw.request")
    async with upstream(status_handler(200)) as p, upstream(status_handler(200)) as b:
        gateway = Gateway(host_app, config=make_config(p.url, b.url), environ=ENV)
        async with client_for(gateway) as client:
            response = await client.get("/v1/models")
        await gateway.aclose()
    assert response.status_code == 200
    names = {name for name, _ in p.received[0].headers}
    assert not names & {"traceparent", "tracestate", "baggage"}
    (log,) = request_logs(caplog)
    assert log.outcome == "served"  # type: ignore[attr-defined]
    assert log.trace_id is None  # type: ignore[attr-defined]


async def test_without_a_tracer_sdk_attempt_metrics_are_still_recorded() -> None:
    # Metrics SDK only (the global tracer is a no-op): requests skip span work, yet every
    # attempt is counted, a served one and one a disconnect cut in flight.
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    metrics_only = Recorded(
        InMemorySpanExporter(), reader, Telemetry(meter_provider=meter_provider)
    )
    release = asyncio.Event()
    async with upstream(waiting_handler(release)) as p, upstream(status_handler(200)) as b:
        hanging = Gateway(
            host_app,
            config=make_config(p.url, b.url),
            environ=ENV,
            telemetry=metrics_only.telemetry,
        )
        await hanging(http_scope("GET", "/v1/models"), request_then_disconnect(after=0.2), _drop)
        release.set()
        await hanging.aclose()
    async with upstream(status_handler(200)) as p, upstream(status_handler(200)) as b:
        serving = Gateway(
            host_app,
            config=make_config(p.url, b.url),
            environ=ENV,
            telemetry=metrics_only.telemetry,
        )
        async with client_for(serving) as client:
            assert (await client.get("/v1/models")).status_code == 200
        await serving.aclose()
    meter_provider.shutdown()
    kinds = sorted(
        (point.attributes["gateway.failure.kind"], point.value)
        for point in metrics_only.points("gateway.attempts")
    )
    assert kinds == [("cancelled", 1), ("none", 1)]


async def _drop(message: Any) -> None:
    pass


def test_breaker_state_gauge_and_transitions(recorded: Recorded) -> None:
    report = recorded.telemetry.breaker_state
    report("tel-test-a", "open")
    report("tel-test-b", "half-open")
    report("tel-test-b", "half_open")  # no change: not a transition
    report("tel-test-c", "closed")
    report("tel-test-c", "bogus")  # ignored, never raises
    states = {
        pt.attributes["gateway.upstream"]: pt.value
        for pt in recorded.points("gateway.breaker.state")
        if str(pt.attributes["gateway.upstream"]).startswith("tel-test-")
    }
    assert states == {"tel-test-a": 2, "tel-test-b": 1, "tel-test-c": 0}
    transitions = {
        (pt.attributes["gateway.upstream"], pt.attributes["gateway.breaker.state"]): pt.value
        for pt in recorded.points("gateway.breaker.transitions")
    }
    assert transitions == {
        ("tel-test-a", "open"): 1,
        ("tel-test-b", "half_open"): 1,
        ("tel-test-c", "closed"): 1,
    }
    recorded.telemetry.breaker_state("tel-test-a", "closed")
    states = {
        pt.attributes["gateway.upstream"]: pt.value
        for pt in recorded.points("gateway.breaker.state")
    }
    assert states["tel-test-a"] == 0


def hand_made_context(**fields: Any) -> RequestContext:
    route = RouteConfig(id="chat", prefix="/v1/", plan=("primary", "backup"), retries=1)
    return RequestContext(
        route=route,
        upstreams={},
        tenant="acme",
        session=None,
        method="POST",
        path="/v1/chat",
        query=b"",
        deadline=time.monotonic() + 5,
        **fields,
    )


def test_gen_ai_usage_and_model_attributes(recorded: Recorded) -> None:
    telemetry = recorded.telemetry
    context = hand_made_context(candidates=["primary", "backup"], canary=True)
    telemetry.request_started(context)
    record = AttemptRecord(candidate="primary", number=1, server_address="api.example")
    context.attempts.append(record)
    telemetry.attempt_started(context, record)
    record.status = 200
    telemetry.attempt_finished(context, record)
    context.chosen = "primary"
    context.status = 200
    context.outcome = "served"
    context.request_model = "gpt-4o-mini"
    context.usage = Usage(input_tokens=12, output_tokens=34, model="gpt-4o-mini-2024-07-18")
    telemetry.request_finished(context)
    attrs = dict(recorded.request_span().attributes or {})
    assert attrs["gen_ai.request.model"] == "gpt-4o-mini"
    assert attrs["gen_ai.usage.input_tokens"] == 12
    assert attrs["gen_ai.usage.output_tokens"] == 34
    assert attrs["gen_ai.response.model"] == "gpt-4o-mini-2024-07-18"
    assert attrs["gateway.canary"] is True
    (point,) = recorded.counted("gateway.requests")
    assert point.attributes["gateway.canary"] is True


def test_model_that_is_not_a_name_is_not_recorded(recorded: Recorded) -> None:
    context = hand_made_context()
    recorded.telemetry.request_started(context)
    context.request_model = "gpt-4o please ignore sk-live-1234\n"
    context.usage = Usage(input_tokens=None, output_tokens=None)
    context.outcome = "upstream_failed"
    recorded.telemetry.request_finished(context)
    attrs = dict(recorded.request_span().attributes or {})
    assert "gen_ai.request.model" not in attrs
    assert "gen_ai.usage.input_tokens" not in attrs
    # Refused before the walk: the configured plan is still named.
    assert attrs["gateway.plan.candidates"] == ("primary", "backup")


def test_hooks_never_raise(recorded: Recorded) -> None:
    context = hand_made_context()
    broken: Any = object()  # not even a RequestContext
    telemetry = recorded.telemetry
    hooks: list[Callable[[], object]] = [
        lambda: telemetry.request_started(broken),
        lambda: telemetry.attempt_started(broken, broken),
        lambda: telemetry.attempt_finished(broken, broken),
        lambda: telemetry.skipped(broken, "primary", "breaker_open"),
        lambda: telemetry.request_finished(broken),
        lambda: telemetry.inject_headers(broken),
    ]
    for hook in hooks:
        try:
            hook()
        except TypeError as exc:
            # Compiled, a hook's typed parameters are checked as the call enters it: an
            # object that is no RequestContext is refused there, before the hook's own
            # guard (the gateway only ever hands it its own context). Never otherwise.
            assert COMPILED and "object expected" in str(exc), exc
    # Nothing was recorded for the broken context: no span, no request counted.
    assert recorded.finished() == ()
    assert recorded.counted("gateway.requests") == []
    # Hooks out of order on a real context are tolerated too, and a request finished twice
    # is recorded once.
    telemetry.request_started(context)
    record = AttemptRecord(candidate="primary", number=1, server_address="h")
    telemetry.attempt_finished(context, record)
    telemetry.request_finished(context)
    telemetry.request_finished(context)
    assert [s.name for s in recorded.finished()].count("gateway.request") == 1
    assert [s.name for s in recorded.finished()].count("gateway.attempt") == 1
    assert sum(p.value for p in recorded.points("gateway.requests")) == 1
    assert sum(p.count for p in recorded.points("gateway.request.duration")) == 1


async def test_usage_reported_by_the_upstream_reaches_the_request_span(
    recorded: Recorded,
) -> None:
    answer = json.dumps(
        {
            "model": "gpt-4o-mini-2024-07-18",
            "choices": [],
            "usage": {"prompt_tokens": 812, "completion_tokens": 64},
        }
    ).encode()
    async with (
        upstream(status_handler(200, answer, **{"content-type": "application/json"})) as p,
        upstream(status_handler(200)) as b,
    ):
        gateway = Gateway(
            host_app, config=make_config(p.url, b.url), environ=ENV, telemetry=recorded.telemetry
        )
        async with client_for(gateway) as client:
            response = await client.post(
                "/v1/chat/completions", json={"model": "gpt-4o-mini", "messages": []}
            )
        await gateway.aclose()
    assert response.status_code == 200
    attrs = dict(recorded.request_span().attributes or {})
    assert attrs["gen_ai.request.model"] == "gpt-4o-mini"
    assert attrs["gen_ai.usage.input_tokens"] == 812
    assert attrs["gen_ai.usage.output_tokens"] == 64
    assert attrs["gen_ai.response.model"] == "gpt-4o-mini-2024-07-18"


async def test_hedged_attempts_each_propagate_their_own_span(recorded: Recorded) -> None:
    release = asyncio.Event()
    calls = 0

    async def first_slow(request: web.Request) -> web.StreamResponse:
        nonlocal calls
        calls += 1
        if calls == 1:
            await release.wait()
        return web.Response(status=200, text="ok")

    async with upstream(first_slow) as p, upstream(status_handler(200)) as b:
        config = make_config(p.url, b.url, hedge_after_ms=50, retries=2)
        gateway = Gateway(host_app, config=config, environ=ENV, telemetry=recorded.telemetry)
        async with client_for(gateway) as client:
            response = await client.get("/v1/models", headers={"traceparent": TRACEPARENT})
        release.set()
        await gateway.aclose()
    assert response.status_code == 200 and b.count == 0
    first, hedge = recorded.attempt_spans()
    assert dict(first.attributes or {})["gateway.failure.kind"] == "cancelled"
    assert dict(hedge.attributes or {})["gateway.attempt.hedge"] is True
    assert dict(hedge.attributes or {})["http.response.status_code"] == 200
    sent = sorted(header_values(r.headers, "traceparent")[0] for r in p.received)
    assert sent == sorted(
        f"00-{TRACE_ID}-{format_span_id(s.context.span_id)}-01" for s in (first, hedge)
    )
    attrs = dict(recorded.request_span().attributes or {})
    assert attrs["gateway.attempts"] == 2
    assert attrs["gateway.plan.chosen"] == "primary"
    assert attrs["gateway.fallback"] is False
    # The loser's `cancelled` is the gateway's doing, not a client gone: a dashboard of
    # client hang-ups on gateway.failure.kind="cancelled" is told so by the attempt table.
    (row,) = [
        line
        for line in (ROOT / "docs" / "telemetry.md").read_text(encoding="utf-8").splitlines()
        if line.startswith("| `gateway.failure.kind` |")
    ]
    cancelled = row.split("`cancelled` (", 1)[1].split(")", 1)[0]
    assert "hedge" in cancelled


async def test_a_real_breaker_opening_shows_in_the_gauge(recorded: Recorded) -> None:
    async with upstream(status_handler(503)) as p, upstream(status_handler(200)) as b:
        config = make_config(p.url, b.url)
        config["gateway"]["breaker"] = {"window": 2, "min_calls": 2, "failure_rate": 1.0}
        config["upstreams"] = {
            "tel-gauge-primary": config["upstreams"]["primary"],
            "tel-gauge-backup": config["upstreams"]["backup"],
        }
        config["routes"][0]["plan"] = ["tel-gauge-primary", "tel-gauge-backup"]
        gateway = Gateway(host_app, config=config, environ=ENV, telemetry=recorded.telemetry)
        before = [pt.value for pt in recorded.points("gateway.breaker.transitions")]
        assert before == [0] * 6  # two upstreams, three states: there before any request
        async with client_for(gateway) as client:
            for _ in range(3):
                assert (await client.get("/v1/models")).status_code == 200
        await gateway.aclose()
    assert p.count == 2  # the third request skipped the open breaker
    states = {
        pt.attributes["gateway.upstream"]: pt.value
        for pt in recorded.points("gateway.breaker.state")
    }
    assert states["tel-gauge-primary"] == 2
    transitions = {
        (pt.attributes["gateway.upstream"], pt.attributes["gateway.breaker.state"]): pt.value
        for pt in recorded.points("gateway.breaker.transitions")
    }
    assert transitions[("tel-gauge-primary", "open")] == 1
    # Each upstream's transition series was there at 0 before its first transition: a
    # platform team's `increase(gateway_breaker_transitions_total{...="open"}[1d])` read a
    # breaker that opened once a day as never opened (the series appeared at 1).
    assert transitions == {
        ("tel-gauge-primary", "open"): 1,
        ("tel-gauge-primary", "half_open"): 0,
        ("tel-gauge-primary", "closed"): 0,
        ("tel-gauge-backup", "open"): 0,
        ("tel-gauge-backup", "half_open"): 0,
        ("tel-gauge-backup", "closed"): 0,
    }
    skips = recorded.counted("gateway.skips")
    assert [pt.attributes["gateway.skip.reason"] for pt in skips] == ["breaker_open"]


def test_without_an_attempt_span_only_what_the_context_holds_is_propagated() -> None:
    """No SDK, no attempt span: the caller's headers pass unchanged when the OTel context
    is empty; baggage a host app put in the context still goes upstream; a propagator
    other than the W3C ones is always asked."""
    from opentelemetry import baggage, propagate
    from opentelemetry import context as otel_context

    telemetry = Telemetry()
    caller = [("traceparent", "00-caller-01"), ("accept", "*/*")]

    def injected() -> list[tuple[str, str]]:
        headers = list(caller)
        telemetry.inject_headers(headers)
        return headers

    assert injected() == caller
    token = otel_context.attach(baggage.set_baggage("tier", "gold"))
    try:
        assert ("baggage", "tier=gold") in injected()
    finally:
        otel_context.detach(token)

    class Constant(propagate.textmap.TextMapPropagator):  # type: ignore[misc]
        def extract(self, carrier: Any, context: Any = None, getter: Any = None) -> Any:
            return context

        def inject(self, carrier: Any, context: Any = None, setter: Any = None) -> None:
            carrier["x-sampled"] = "0"

        @property
        def fields(self) -> set[str]:
            return {"x-sampled"}

    previous = propagate.get_global_textmap()
    propagate.set_global_textmap(Constant())
    try:
        assert ("x-sampled", "0") in injected()
    finally:
        propagate.set_global_textmap(previous)


GLOBAL_PROVIDER_LATER = """
import time
from opentelemetry import metrics
from opentelemetry import trace as trace_api
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from fallback_mw.config import RouteConfig
from fallback_mw.request.context import AttemptRecord, RequestContext
from fallback_mw.telemetry import Telemetry

def one_request(telemetry):
    route = RouteConfig(id="chat", prefix="/v1/", plan=("primary",))
    context = RequestContext(route=route, upstreams={}, tenant="t", session=None,
                             method="GET", path="/v1/x", query=b"", deadline=time.monotonic() + 5)
    telemetry.request_started(context)
    record = AttemptRecord(candidate="primary", number=1, server_address="h", status=200)
    context.attempts.append(record)
    telemetry.attempt_started(context, record)
    telemetry.attempt_finished(context, record)
    context.chosen, context.status, context.completed = "primary", 200, True
    telemetry.request_finished(context)

telemetry = Telemetry()  # the global provider: none installed yet (serve's order)
one_request(telemetry)  # goes nowhere, raises nothing
reader = InMemoryMetricReader()
metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
one_request(telemetry)
names = {m.name: sum(p.value for p in m.data.data_points if hasattr(p, "value"))
         for rm in reader.get_metrics_data().resource_metrics
         for sm in rm.scope_metrics for m in sm.metrics}
print(names.get("gateway.requests"), names.get("gateway.attempts"))
"""


def test_recordings_start_once_an_sdk_is_installed_after_the_gateway_is_built() -> None:
    """serve builds the gateway, then installs the SDK: recordings made before go nowhere
    (and skip their attribute work), every one after is counted."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", GLOBAL_PROVIDER_LATER], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "1"], done.stdout


GLOBAL_PROVIDER_AFTER_THE_GATEWAY = """
from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from fallback_mw import Gateway

async def app(scope, receive, send):
    pass

config = {
    "gateway": {"allow_hosts": ["127.0.0.1"]},
    "upstreams": {"primary": {"url": "http://127.0.0.1:9"}, "backup": {"url": "http://127.0.0.1:10"}},
    "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary", "backup"], "retries": 1}],
}
gateway = Gateway(app, config=config)  # built first: the host installs its SDK later
reader = InMemoryMetricReader()
metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
for rm in reader.get_metrics_data().resource_metrics:
    for sm in rm.scope_metrics:
        for m in sm.metrics:
            for p in m.data.data_points:
                a = p.attributes
                if m.name == "gateway.fallbacks":
                    print(m.name, a["gateway.candidate"], p.value)
                if m.name == "gateway.breaker.transitions":
                    print(m.name, a["gateway.upstream"] + ":" + a["gateway.breaker.state"], p.value)
"""


def test_the_zero_series_are_exported_when_the_hosts_sdk_comes_after_the_gateway() -> None:
    """A host app that installed its global OTel SDK after building the Gateway (which
    docs/telemetry.md says is fine: "before or after") exported no `gateway.fallbacks` or
    `gateway.breaker.transitions` series at 0: the API's proxy dropped those adds, so the
    first fallback appeared at 1 and Prometheus's `increase` read it as none. They are
    added again at the first collection after the SDK is installed."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", GLOBAL_PROVIDER_AFTER_THE_GATEWAY],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == sorted(
        ["gateway.fallbacks backup 0"]
        + [
            f"gateway.breaker.transitions {u}:{s} 0"
            for u in ("primary", "backup")
            for s in ("closed", "half_open", "open")
        ]
    ), done.stdout


SHARED_PIECES_AFTER_THE_GATEWAY = """
import asyncio, sys
from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from fallback_mw import Gateway

async def app(scope, receive, send):
    pass

config = {
    "gateway": {"allow_hosts": ["127.0.0.1"], "state": sys.argv[1], "store": sys.argv[2]},
    "upstreams": {"primary": {"url": "http://127.0.0.1:9"}},
    "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"]}],
}
gateway = Gateway(app, config=config)  # built first: the host installs its SDK later
reader = InMemoryMetricReader()
metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
for rm in reader.get_metrics_data().resource_metrics:
    for sm in rm.scope_metrics:
        for m in sm.metrics:
            if m.name in ("gateway.health.local_fallbacks", "gateway.store.reload_refused"):
                print(m.name, [p.value for p in m.data.data_points])
asyncio.run(gateway.aclose())
"""


def test_the_shared_state_and_store_zero_series_are_exported_when_the_sdk_comes_after(
    redis_url: str, tmp_path: Path
) -> None:
    """The same gap as the gateway's own counters had, left for the pieces beside it: with
    the host's global SDK installed after the Gateway was built, the Redis state's
    `gateway.health.local_fallbacks` and the route store's `gateway.store.reload_refused`
    were not exported at 0 (the API's proxy dropped the `add(0)`), so the first outage or
    refused reload appeared at its count and `increase(...) > 0`
    (FallbackMwSharedStateUnreachable) read it as nothing. Added again at the first
    collection, as the gateway's own are."""
    import subprocess
    import sys

    store = f"sqlite:///{tmp_path / 'gateway.db'}"
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", SHARED_PIECES_AFTER_THE_GATEWAY, redis_url, store],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == [
        "gateway.health.local_fallbacks [0]",
        "gateway.store.reload_refused [0]",
    ], done.stdout


async def test_every_configured_upstream_s_breaker_is_in_the_gauge_from_the_start(
    recorded: Recorded,
) -> None:
    """SPEC §9 lists breaker state among the metrics: a platform team scraping a healthy
    gateway saw no `gateway_breaker_state` series at all (the gauge reported an upstream
    only once its breaker had moved), so a panel of breaker states was empty and an
    `absent()` rule fired. Each upstream reports 0 (closed) until its breaker moves."""
    async with upstream(status_handler(200)) as p, upstream(status_handler(200)) as b:
        config = make_config(p.url, b.url)
        config["upstreams"] = {
            "tel-start-primary": config["upstreams"]["primary"],
            "tel-start-backup": config["upstreams"]["backup"],
        }
        config["routes"][0]["plan"] = ["tel-start-primary", "tel-start-backup"]
        gateway = Gateway(host_app, config=config, environ=ENV, telemetry=recorded.telemetry)
        try:
            gauge = {
                pt.attributes["gateway.upstream"]: pt.value
                for pt in recorded.points("gateway.breaker.state")
            }
            assert gauge == {"tel-start-primary": 0, "tel-start-backup": 0}
            async with client_for(gateway) as client:
                assert (await client.get("/v1/models")).status_code == 200
            gauge = {
                pt.attributes["gateway.upstream"]: pt.value
                for pt in recorded.points("gateway.breaker.state")
            }
            assert gauge == {"tel-start-primary": 0, "tel-start-backup": 0}
        finally:
            await gateway.aclose()


def fallback_series(recorded: Recorded) -> dict[tuple[object, ...], int]:
    keys = ("gateway.route.id", "gateway.primary", "gateway.candidate", "gateway.outcome")
    return {
        (*(pt.attributes[k] for k in keys), pt.attributes["gateway.canary"],
         pt.attributes["gateway.fault"]): pt.value
        for pt in recorded.points("gateway.fallbacks")
    }  # fmt: skip


async def test_each_routes_fallback_series_is_exported_at_zero_before_the_first_fallback(
    recorded: Recorded, tmp_path: Path
) -> None:
    """The observability team's FallbackMwSilentFallback never fired for a primary that
    failed a few times: the `gateway_fallbacks_total` series appeared at its first scrape
    already at 3, and Prometheus's `increase` and `rate` ignore a series' first sample (a
    real Prometheus scraping `serve --workers 2` read 4 fallbacks of 35). Each route's real
    fallback series (a later candidate of its plan served it, no canary, no fault) is at 0
    from the start, and so is that of a route a store reload adds."""
    from tests.test_cli_admin import cli

    store = f"sqlite:///{tmp_path / 'gateway.db'}"
    async with upstream(status_handler(503)) as p, upstream(status_handler(200)) as b:
        config = make_config(p.url, b.url)
        config["gateway"]["store"] = store
        gateway = Gateway(host_app, config=config, environ=ENV, telemetry=recorded.telemetry)
        try:
            zero = ("chat", "primary", "backup", "served", False, False)
            assert fallback_series(recorded) == {zero: 0}
            async with client_for(gateway) as client:
                assert (await client.get("/v1/models")).headers["x-gateway-provider"] == "backup"
            assert fallback_series(recorded) == {zero: 1}  # the same series, counted up

            status, _, err = await cli(
                "routes", "add", "--store", store, "--id", "added", "--prefix", "/added/",
                "--upstream", p.url, "--fallback", b.url, "--retries", "1",
            )  # fmt: skip
            assert status == 0, err
            runtime = gateway.services.store
            assert runtime is not None
            route_store = open_store(store)
            try:
                await runtime.refresh(route_store)
            finally:
                await route_store.aclose()
            added = next(r for r in runtime.routes() if r.id == "added")
            assert fallback_series(recorded) == {
                zero: 1,
                ("added", added.plan[0], added.plan[1], "served", False, False): 0,
            }
        finally:
            await gateway.aclose()


def series(recorded: Recorded, name: str) -> dict[frozenset[tuple[str, Any]], int]:
    return {frozenset(pt.attributes.items()): pt.value for pt in recorded.points(name)}


async def test_error_and_skip_series_are_exported_at_zero_before_the_first_one(
    recorded: Recorded,
) -> None:
    """The observability team's error-rate alert was a scrape late on a route that started
    failing: its `gateway_requests_total{gateway_outcome="upstream_failed"}` series (and
    `gateway_skips_total{gateway_skip_reason="breaker_open"}`) appeared at its first count,
    and Prometheus's `increase` and `rate` ignore a series' first sample. Every local
    error of each route (no candidate, no fallback, no canary, no fault, the code's own
    status) and every skip reason of each candidate of its plan (no fault) are at 0 from
    the start; the first real one counts up that same series, no new one appears."""
    from fallback_mw.failover.messages import _SKIP_REMEDY
    from fallback_mw.request.context import SKIP_REASONS
    from fallback_mw.request.local_errors import STATUS_FOR_CODE

    assert set(SKIP_REASONS) == set(_SKIP_REMEDY)  # every reason the walk can give
    # docs/telemetry.md says which series are there at 0: these, with these statuses.
    docs = (ROOT / "docs" / "telemetry.md").read_text()
    row = next(x for x in docs.splitlines() if x.startswith("| `gateway.requests` | each local"))
    listed = re.findall(r"`([a-z_]+)`", row.split("with `gateway.candidate")[0])
    statuses = [int(x) for x in re.findall(r"\d{3}", row.split("own status")[1])]
    assert dict(zip(listed, statuses, strict=True)) == {
        k: v for k, v in STATUS_FOR_CODE.items() if k != "config_error"
    }
    row = next(x for x in docs.splitlines() if x.startswith("| `gateway.skips` | each"))
    assert all(f"`{reason}`" in row for reason in SKIP_REASONS)

    async with upstream(status_handler(503)) as p, upstream(status_handler(503)) as b:
        config = make_config(p.url, b.url)
        config["gateway"]["breaker"] = {"min_calls": 1}
        gateway = Gateway(host_app, config=config, environ=ENV, telemetry=recorded.telemetry)
        try:
            local_errors = {
                frozenset({
                    "gateway.route.id": "chat", "gateway.outcome": outcome,
                    "gateway.fallback": False, "gateway.canary": False, "gateway.fault": False,
                    "gateway.candidate": "none", "http.response.status_code": status,
                }.items())
                for outcome, status in STATUS_FOR_CODE.items()
                if outcome != "config_error"  # answered before any route is resolved
            }  # fmt: skip
            skips = {
                frozenset({
                    "gateway.route.id": "chat", "gateway.candidate": candidate,
                    "gateway.skip.reason": reason, "gateway.fault": False,
                }.items())
                for candidate in ("primary", "backup")
                for reason in SKIP_REASONS
            }  # fmt: skip
            before = series(recorded, "gateway.requests")
            assert before == dict.fromkeys(local_errors, 0)
            assert series(recorded, "gateway.skips") == dict.fromkeys(skips, 0)
            async with client_for(gateway) as client:
                # Both answer 503: upstream_failed, and both breakers open (min_calls 1).
                assert (await client.get("/v1/models")).status_code == 502
                # Both skipped, breaker open: route_exhausted.
                assert (await client.get("/v1/models")).status_code == 503
        finally:
            await gateway.aclose()
    after = series(recorded, "gateway.requests")
    assert after.keys() == before.keys()  # the same series, counted up
    counted = {dict(k)["gateway.outcome"]: v for k, v in after.items() if v}
    assert counted == {"upstream_failed": 1, "route_exhausted": 1}
    skipped = series(recorded, "gateway.skips")
    assert skipped.keys() == skips
    assert {
        (dict(k)["gateway.candidate"], dict(k)["gateway.skip.reason"]): v
        for k, v in skipped.items()
        if v
    } == {("primary", "breaker_open"): 1, ("backup", "breaker_open"): 1}


async def test_the_zero_series_of_many_routes_leave_the_sdk_room_for_real_traffic(
    recorded: Recorded,
) -> None:
    """A platform team with one route per tenant (170 of them, or fewer over a store's
    reloads: the SDK keeps a removed route's series) saw every served request counted in
    `gateway_requests_total{otel_metric_overflow="true"}`, no route on it: the 12 local
    error series each route exports at 0 filled the OpenTelemetry SDK's default limit of
    2,000 series per instrument. The series exported at 0 stop at half that limit; a
    request of the last route is counted in its own series."""
    routes = 170
    async with upstream(status_handler(200)) as a:
        config = {
            "upstreams": {"a": {"url": a.url}},
            "routes": [{"id": f"t{i}", "prefix": f"/t{i}/", "plan": ["a"]} for i in range(routes)],
        }
        gateway = Gateway(host_app, config=config, telemetry=recorded.telemetry)
        try:
            async with client_for(gateway) as client:
                assert (await client.get(f"/t{routes - 1}/x")).status_code == 200
        finally:
            await gateway.aclose()
    points = recorded.points("gateway.requests")
    assert not [p for p in points if "otel.metric.overflow" in p.attributes]
    assert len([p for p in points if not p.value]) <= 1000  # half the SDK's 2,000
    served = [dict(p.attributes) for p in points if p.value]
    assert [(s["gateway.route.id"], s["gateway.outcome"]) for s in served] == [
        (f"t{routes - 1}", "served")
    ]


async def test_a_hedged_attempt_that_fails_while_its_twin_runs_carries_no_decision(
    recorded: Recorded,
) -> None:
    """Read in a real trace: a hung primary hedged after 50 ms, both attempts timing out,
    the backup serving. The first attempt's span had no `gateway.decision`, which the docs
    said happens only when the walk is cut short: the walk decides on the race's last
    outcome (the hedge's), and the docs now say so."""
    release = asyncio.Event()
    async with upstream(waiting_handler(release)) as p, upstream(status_handler(200)) as b:
        config = make_config(p.url, b.url, hedge_after_ms=50, retries=2)
        config["upstreams"]["primary"]["first_byte_timeout_ms"] = 200
        gateway = Gateway(host_app, config=config, environ=ENV, telemetry=recorded.telemetry)
        async with client_for(gateway) as client:
            response = await client.get("/v1/models")
        release.set()
        await gateway.aclose()
    assert response.headers["x-gateway-provider"] == "backup"
    first, hedge, served = (dict(s.attributes or {}) for s in recorded.attempt_spans())
    assert first["gateway.failure.kind"] == hedge["gateway.failure.kind"] == "timeout"
    assert "gateway.decision" not in first
    assert hedge["gateway.attempt.hedge"] is True
    assert hedge["gateway.decision"] == "next_candidate"
    assert served["gateway.decision"] == "serve"
    (row,) = [
        line
        for line in (ROOT / "docs" / "telemetry.md").read_text(encoding="utf-8").splitlines()
        if line.startswith("| `gateway.decision` |")
    ]
    assert "hedged attempt that failed without a response head" in row


async def test_a_callers_short_deadline_is_not_booked_as_the_upstreams_timeout(
    recorded: Recorded, caplog: pytest.LogCaptureFixture
) -> None:
    """An observability team's "attempts by failure kind" panel (docs/telemetry.md's own
    query) showed a healthy upstream timing out: any caller that sent
    `x-gateway-deadline-ms: 1` got its attempt booked `gateway.failure.kind="timeout"` on
    that candidate, in the attempt span, `gateway.attempts` and the log line's
    `failures=`, the same word as the upstream's own first-byte timeout. SPEC §5: a
    deadline the caller shortened is not an upstream failure. It is `deadline` now."""
    caplog.set_level(logging.INFO, logger="fallback_mw.request")

    async def slow_but_healthy(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(0.2)
        return web.Response(status=200, text="ok")

    async with upstream(slow_but_healthy) as p, upstream(status_handler(200)) as b:
        gateway = Gateway(
            host_app, config=make_config(p.url, b.url), environ=ENV, telemetry=recorded.telemetry
        )
        async with client_for(gateway) as client:
            response = await client.get("/v1/models", headers={"x-gateway-deadline-ms": "50"})
        await gateway.aclose()
    assert response.status_code == 504
    (attempt,) = recorded.attempt_spans()
    assert dict(attempt.attributes or {})["gateway.failure.kind"] == "deadline"
    (point,) = recorded.points("gateway.attempts")
    assert point.attributes["gateway.candidate"] == "primary"
    assert point.attributes["gateway.failure.kind"] == "deadline"
    (log,) = request_logs(caplog)
    assert "failures=primary:deadline" in log.getMessage()


async def test_the_store_reload_counter_goes_to_the_gateways_own_meter_provider(
    recorded: Recorded, tmp_path: Path
) -> None:
    """A host that passes `telemetry=Telemetry(meter_provider=...)` (docs/telemetry.md: how
    to send the gateway's telemetry to providers other than the global ones) had every
    instrument there but `gateway.store.reload_refused`, which the route store made on the
    global provider: its refused reloads never reached the host's exporter."""
    async with upstream(status_handler(200)) as p:
        config = make_config(p.url, p.url + "/b")
        config["gateway"]["store"] = f"sqlite:///{tmp_path / 'gateway.db'}"
        gateway = Gateway(host_app, config=config, environ=ENV, telemetry=recorded.telemetry)
        try:
            assert [pt.value for pt in recorded.points("gateway.store.reload_refused")] == [0]
        finally:
            await gateway.aclose()


async def test_the_log_line_names_its_trace_when_the_request_was_traced(
    recorded: Recorded, caplog: pytest.LogCaptureFixture
) -> None:
    # An observability team reading `gateway request ... failures=primary:503` could not
    # find its trace: the trace id was on the record's fields (for JSON formatters) only,
    # never in the text serve and the default handlers print. The line ends with it now,
    # when there is one; an untraced request's line has none (nothing to join).
    caplog.set_level(logging.INFO, logger="fallback_mw.request")
    untraced = Telemetry(tracer_provider=trace_api.NoOpTracerProvider())
    async with upstream(status_handler(503)) as p, upstream(status_handler(200)) as b:
        for telemetry in (recorded.telemetry, untraced):
            conf = make_config(p.url, b.url)
            async with gateway_client(conf, environ=ENV, telemetry=telemetry) as client:
                await client.get("/v1/models", headers={"traceparent": TRACEPARENT})
                await client.get("/v1/models")
    spans = [s for s in recorded.finished() if s.name == "gateway.request"]
    own = format_trace_id(spans[1].context.trace_id)
    lines = [log.getMessage() for log in request_logs(caplog)]
    assert len(lines) == 4, lines
    assert lines[0].endswith(" failures=primary:503 trace_id=" + TRACE_ID), lines[0]
    assert lines[1].endswith(f" failures=primary:503 trace_id={own}"), lines[1]
    assert re.fullmatch(r"[0-9a-f]{32}", own) and own != TRACE_ID
    assert "trace_id=" not in lines[3], lines[3]
    assert request_logs(caplog)[3].__dict__["trace_id"] is None


RELOADS_WITHOUT_AN_SDK = """
import asyncio, sys, tracemalloc
from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from fallback_mw import Gateway
from fallback_mw.store.routes import open_store

async def app(scope, receive, send):
    pass

config = {
    "gateway": {"allow_hosts": ["127.0.0.1"], "store": sys.argv[1]},
    "upstreams": {"primary": {"url": "http://127.0.0.1:9"}, "backup": {"url": "http://127.0.0.1:10"}},
    "routes": [{"id": f"r{n}", "prefix": f"/r{n}/", "plan": ["primary", "backup"], "retries": 1}
               for n in range(10)],
}
gateway = Gateway(app, config=config)  # no SDK installed (serve without OTEL_* variables)
runtime = gateway.services.store

async def reload(times):
    store = open_store(sys.argv[1])
    try:
        for _ in range(times):
            runtime._serials = (None, None)  # as if `routes ...` had changed the store
            await runtime.refresh(store)
    finally:
        await store.aclose()

tracemalloc.start()
only = [tracemalloc.Filter(True, "*fallback_mw/telemetry/*")]
asyncio.run(reload(20))
after_20 = tracemalloc.take_snapshot().filter_traces(only)
asyncio.run(reload(400))
after_420 = tracemalloc.take_snapshot().filter_traces(only)
growth = sum(s.size_diff for s in after_420.compare_to(after_20, "filename"))
print("growth", growth)
reader = InMemoryMetricReader()
metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
for rm in reader.get_metrics_data().resource_metrics:
    for sm in rm.scope_metrics:
        for m in sm.metrics:
            if m.name == "gateway.fallbacks":
                print(m.name, sorted((p.attributes["gateway.route.id"], p.value)
                                     for p in m.data.data_points))
asyncio.run(gateway.aclose())
"""


def test_store_reloads_without_an_sdk_keep_each_zero_series_once(tmp_path: Path) -> None:
    """A gateway under `serve` with a store and no OTEL_* variables (no metrics SDK ever
    installed) grew by some 55 KB per store reload for ten routes (RSS from 64 to 71 MiB
    after 120 reloads): each reload queued every route's zero series again, to be added at
    a first collection that never came. Each series is queued once, however many reloads
    name it, and still exported at 0 once an SDK is installed."""
    import subprocess
    import sys

    store = f"sqlite:///{tmp_path / 'gateway.db'}"
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", RELOADS_WITHOUT_AN_SDK, store],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    growth_line, fallbacks = done.stdout.splitlines()
    assert int(growth_line.split()[1]) < 20_000, growth_line  # 400 reloads: some 28 MB before
    assert fallbacks == "gateway.fallbacks " + str(sorted((f"r{n}", 0) for n in range(10)))
