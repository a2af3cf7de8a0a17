"""Nothing leaks (SPEC §9): marker strings in every secret-bearing place of a request and
its responses, real credential values, debug logging everywhere — then every exported span,
metric, log record and the process output is scanned for them."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    ConsoleMetricExporter,
    InMemoryMetricReader,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from fallback_mw import Gateway
from fallback_mw.telemetry import Telemetry
from tests.helpers import http_scope
from tests.upstreams import upstream

pytestmark = pytest.mark.anyio

MARKERS = {
    "request body": "mkbody5c1e9a",
    "response body": "mkresp0b77d2",
    "response header": "mkrhdr93f0aa",
    "query string": "mkquery4d2b61",
    "caller authorization": "mkauthe8a410",
    "caller cookie": "mkcookie7731c",
    "caller api key": "mkapikey51d0e",
    "caller header": "mkhdr2f9c03",
    "primary credential": "mkcredp6b2e17",
    "backup credential": "mkcredb90ad44",
}
ENV = {"PRIMARY_KEY": MARKERS["primary credential"], "BACKUP_KEY": MARKERS["backup credential"]}


def found_markers(text: str) -> list[str]:
    return [what for what, marker in MARKERS.items() if marker in text]


class Everything(logging.Handler):
    """Keeps every record, and writes each fully (message, args, extra) to stderr."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        sys.stderr.write(render_record(record) + "\n")


def render_record(record: logging.LogRecord) -> str:
    parts = [record.name, record.getMessage(), repr(record.args)]
    parts += [f"{key}={value!r}" for key, value in record.__dict__.items()]
    if record.exc_info:
        parts.append(logging.Formatter().formatException(record.exc_info))
    return " | ".join(parts)


@pytest.fixture
def everything_logged() -> Iterator[Everything]:
    handler = Everything()
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)


async def call(gateway: Gateway, scope: Any, body: bytes) -> tuple[int, bytes]:
    # A raw ASGI caller: no client library of the test's own logs the URL.
    sent: list[dict[str, Any]] = []
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        raise AssertionError("receive called after the response")  # pragma: no cover

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    # The disconnect watcher may still be waiting on receive when the walk ends; that
    # is cancelled by the walker itself.
    await gateway(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body_out = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, body_out


def upstream_answer(status: int) -> Any:
    async def handle(request: web.Request) -> web.StreamResponse:
        await request.read()
        payload = {
            "id": MARKERS["response body"],
            "usage": {"prompt_tokens": 3, "completion_tokens": 4},
        }
        return web.Response(
            status=status,
            body=json.dumps(payload).encode(),
            content_type="application/json",
            headers={
                "set-cookie": f"upstream={MARKERS['response header']}",
                "x-upstream-debug": MARKERS["response header"],
                "location": f"http://127.0.0.1/x?token={MARKERS['response header']}",
            },
        )

    return handle


@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
async def test_no_secret_reaches_any_span_metric_log_or_output(
    engine: str, everything_logged: Everything, capfd: pytest.CaptureFixture[str]
) -> None:
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider(shutdown_on_exit=False)
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    tracer_provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(out=sys.stdout)))
    reader = InMemoryMetricReader()
    console_metrics = PeriodicExportingMetricReader(
        ConsoleMetricExporter(out=sys.stdout), export_interval_millis=3_600_000
    )
    meter_provider = MeterProvider(metric_readers=[reader, console_metrics], shutdown_on_exit=False)
    telemetry = Telemetry(tracer_provider=tracer_provider, meter_provider=meter_provider)

    body = json.dumps(
        {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": MARKERS["request body"]}]}
    ).encode()
    headers = [
        (b"authorization", f"Bearer {MARKERS['caller authorization']}".encode()),
        (b"cookie", f"session={MARKERS['caller cookie']}".encode()),
        (b"x-api-key", MARKERS["caller api key"].encode()),
        (b"x-custom", MARKERS["caller header"].encode()),
        (b"content-type", b"application/json"),
        (b"x-tenant-id", b"acme"),
        (b"traceparent", b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
    ]
    # Not a credential key (api_key/key are stripped before any upstream, SPEC §12).
    query = f"filter={MARKERS['query string']}&q=1".encode()

    async with upstream(upstream_answer(503)) as p, upstream(upstream_answer(200)) as b:
        config = {
            "gateway": {"engine": engine},
            "upstreams": {
                "primary": {"url": p.url, "auth_env": "PRIMARY_KEY"},
                "backup": {"url": b.url, "auth_header": "x-api-key", "auth_env": "BACKUP_KEY"},
            },
            "routes": [
                {
                    "id": "chat",
                    "prefix": "/v1/",
                    "plan": ["primary", "backup"],
                    "retries": 1,
                    "backoff_ms": 0,
                    "replayable_methods": ["POST"],
                },
                {
                    "id": "exhausted",
                    "prefix": "/x/",
                    "plan": ["primary"],
                    "replayable_methods": ["POST"],
                },
            ],
        }
        gateway = Gateway(lambda *a: None, config=config, environ=ENV, telemetry=telemetry)
        served = await call(gateway, http_scope("POST", "/v1/chat", query, headers), body)
        failed = await call(gateway, http_scope("POST", "/x/chat", query, headers), body)
        await gateway.aclose()

    # The markers really went through the gateway (otherwise the scan proves nothing).
    assert served[0] == 200 and MARKERS["response body"] in served[1].decode()
    assert failed[0] == 502
    assert MARKERS["request body"] in b.received[0].body.decode()
    assert MARKERS["query string"] in b.received[0].query
    assert ("authorization", f"Bearer {MARKERS['primary credential']}") in p.received[0].headers
    assert ("x-api-key", f"Bearer {MARKERS['backup credential']}") in b.received[0].headers

    meter_provider.force_flush()
    tracer_provider.force_flush()
    finished = spans.get_finished_spans()
    assert {s.name for s in finished} == {"gateway.request", "gateway.attempt"}
    assert len(finished) == 5  # 2 requests, 3 attempts
    request_logs = [r for r in everything_logged.records if r.name == "fallback_mw.request"]
    assert len(request_logs) == 2

    leaks: dict[str, list[str]] = {}
    for index, span in enumerate(finished):
        leaks[f"span {index} {span.name}"] = found_markers(span.to_json())
    metrics_data = reader.get_metrics_data()
    assert metrics_data is not None
    leaks["metrics"] = found_markers(metrics_data.to_json())
    for record in everything_logged.records:
        rendered = render_record(record)
        if found_markers(rendered):
            leaks[f"log {record.name}: {record.getMessage()[:80]}"] = found_markers(rendered)
    output = capfd.readouterr()
    assert "gateway.request" in output.out  # the console exporters really wrote
    assert "gateway.requests" in output.out
    assert "fallback_mw.request" in output.err  # and every log record went to stderr
    leaks["stdout"] = found_markers(output.out)
    leaks["stderr"] = found_markers(output.err)
    assert {where: what for where, what in leaks.items() if what} == {}

    tracer_provider.shutdown()
    meter_provider.shutdown()


def test_the_scan_sees_a_marker_in_log_extra(everything_logged: Everything) -> None:
    # Negative control for the scanner: a marker in `extra` alone is found.
    logging.getLogger("fallback_mw.request").warning(
        "clean message", extra={"field": MARKERS["caller cookie"]}
    )
    (record,) = [r for r in everything_logged.records if r.getMessage() == "clean message"]
    assert found_markers(render_record(record)) == ["caller cookie"]
