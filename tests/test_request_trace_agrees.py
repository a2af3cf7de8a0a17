"""One request, three records: the `fallback-mw request --json` trace, the spans (in-memory
OpenTelemetry exporter) and the usage record in the SQLite store's ledger agree on the
order, the attempts, the skips, the chosen candidate and the outcome — they are read from
the same AttemptRecord / SkipRecord, not kept twice.

The command runs in process through its own pieces (the shipped parser, `options_from`,
`gateway_config`, `build_gateway`, `exchange_for`: exactly what its handler does), with one
difference: the gateway is given a Telemetry on an in-memory exporter."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from fallback_mw.cli import build_parser
from fallback_mw.cli.request import build_gateway, exchange_for, gateway_config, options_from
from fallback_mw.config import BreakerConfig
from fallback_mw.health import create_health
from fallback_mw.store.ledgers import open_ledger
from fallback_mw.telemetry import Telemetry
from tests.test_request_cli import ENV, write_config
from tests.upstreams import silent_server, status_handler, upstream

pytestmark = pytest.mark.anyio


async def run_traced(argv: list[str]) -> tuple[dict[str, Any], list[ReadableSpan]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    args = build_parser().parse_args(["request", *argv, "--json"])
    options = options_from(args)
    config = gateway_config(args)
    gateway = build_gateway(config, telemetry=Telemetry(tracer_provider=provider))
    trace = await exchange_for(gateway, options, None)
    return trace, list(exporter.get_finished_spans())


async def three_views(argv: list[str], store: str) -> tuple[Any, Any, Any]:
    trace, spans = await run_traced(argv)
    (request,) = [s for s in spans if s.name == "gateway.request"]
    attempt_spans = sorted(
        (s for s in spans if s.name == "gateway.attempt"),
        key=lambda s: s.attributes["gateway.attempt.number"],  # type: ignore[index]
    )
    ledger = open_ledger(store)
    assert ledger is not None
    try:
        (usage,) = [
            u for u in await ledger.usage(route="chat") if u.request_id == trace["request_id"]
        ]
    finally:
        await ledger.aclose()

    steps = trace["steps"]
    cli = {
        "candidates": trace["candidates"],
        "attempts": [
            (s["candidate"], s["status"], s["failure_kind"])
            for s in steps
            if s["step"] == "attempt"
        ],
        "skips": [(s["candidate"], s["reason"]) for s in steps if s["step"] == "skip"],
        "chosen": trace["chosen"],
        "outcome": trace["outcome"],
    }
    attrs = request.attributes or {}
    span_view = {
        "candidates": list(attrs["gateway.plan.candidates"]),  # type: ignore[arg-type]
        "attempts": [
            (
                (s.attributes or {})["gateway.candidate"],
                (s.attributes or {}).get("http.response.status_code"),
                (s.attributes or {}).get("gateway.failure.kind"),
            )
            for s in attempt_spans
        ],
        "skips": [
            ((e.attributes or {})["gateway.candidate"], (e.attributes or {})["gateway.skip.reason"])
            for e in request.events
            if e.name == "gateway.candidate.skipped"
        ],
        "chosen": attrs.get("gateway.plan.chosen"),
        "outcome": attrs["gateway.outcome"],
    }
    usage_view = {
        "candidates": list(usage.candidates),
        "attempts": [(a.candidate, a.status, a.failure) for a in usage.attempts if not a.skipped],
        "skips": [(a.candidate, a.skipped) for a in usage.attempts if a.skipped],
        "chosen": usage.chosen,
        "outcome": usage.outcome,
    }
    # The step numbers the CLI prints are the spans' attempt numbers.
    numbers = [s["number"] for s in steps if s["step"] == "attempt"]
    assert numbers == [(s.attributes or {})["gateway.attempt.number"] for s in attempt_spans]
    return cli, span_view, usage_view


async def test_failover_with_a_skip_agrees(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    store = f"sqlite:///{tmp_path / 'gateway.db'}"
    breaker = BreakerConfig(min_calls=1, window=1, cooldown_ms=600_000, max_cooldown_ms=600_000)
    gateway = (
        f'store = "{store}"\nstate = "{redis_url}"\n[gateway.breaker]\nmin_calls = 1\n'
        "window = 1\ncooldown_ms = 600000\nmax_cooldown_ms = 600000"
    )
    async with (
        upstream(status_handler(503)) as primary,
        upstream(status_handler(200)) as middle,
        upstream(status_handler(200)) as backup,
    ):
        config = write_config(tmp_path, primary.url, backup.url, gateway=gateway, middle=middle.url)
        health = create_health(redis_url, breaker)  # the middle's breaker is open, shared
        assert await health.admit("middle")
        await health.record("middle", failure=True)
        await health.aclose()
        cli, spans, usage = await three_views(["--config", str(config), "--route", "chat"], store)
    assert cli == spans == usage
    assert cli["attempts"] == [("primary", 503, "status"), ("backup", 200, None)]
    assert cli["skips"] == [("middle", "breaker_open")]
    assert cli["chosen"] == "backup" and middle.count == 0


async def test_deadline_agrees(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    store = f"sqlite:///{tmp_path / 'gateway.db'}"
    async with upstream(status_handler(503)) as primary, silent_server() as (hanging, _):
        config = write_config(
            tmp_path, primary.url, hanging, gateway=f'store = "{store}"', route="deadline_ms = 300"
        )
        cli, spans, usage = await three_views(["--config", str(config), "--route", "chat"], store)
    assert cli == spans == usage
    assert cli["attempts"] == [("primary", 503, "status"), ("backup", None, "deadline")]
    assert cli["outcome"] == "deadline_exceeded" and cli["chosen"] is None
