"""Characters a terminal draws as nothing in text the command did not write. A caller's
tenant header is UTF-8 (layers/resolver.py): besides control characters and bidi controls
(shown as `?` since earlier), Unicode has printable characters that are drawn as nothing
(its Default_Ignorable_Code_Point ones: the Hangul fillers, the variation selectors...),
which made one tenant read as another."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import anyio
import pytest

from fallback_mw.cli import main
from fallback_mw.quoting import printable
from tests.helpers import gateway_client
from tests.upstreams import status_handler, upstream

pytestmark = pytest.mark.anyio

# Printable (str.isprintable) and Default_Ignorable_Code_Point (Unicode's
# DerivedCoreProperties.txt): every other such code point is a format character or
# unassigned, which `printable` already shows as `?`.
DRAWN_AS_NOTHING = (
    "\u034f\u115f\u1160\u17b4\u17b5\u180b\u180c\u180d\u180f\u3164"
    "\ufe00\ufe0e\ufe0f\uffa0\U000e0100\U000e01ef"
)


async def test_a_tenant_with_a_character_drawn_as_nothing_is_not_listed_as_another(
    tmp_path: Path,
) -> None:
    """A caller sent `x-tenant: acme` + U+3164 (HANGUL FILLER: two columns of nothing, which
    the table's padding swallowed): `usage` listed its requests as tenant `acme`, the
    customer it is not, and `usage --tenant acme` then found none of them. It reads
    `acme?` now; the JSON keeps the tenant as recorded."""
    store = f"sqlite:///{tmp_path / 'gateway.db'}"
    async with upstream(status_handler(200, b"ok")) as primary:
        config = {
            "gateway": {"store": store, "tenant_header": "x-tenant"},
            "upstreams": {"primary": {"url": primary.url}},
            "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"]}],
        }
        async with gateway_client(config) as client:
            for tenant in (b"acme", "acme\u3164".encode()):
                response = await client.get("/v1/x", headers=[(b"x-tenant", tenant)])
                assert response.status_code == 200
    out, err = io.StringIO(), io.StringIO()
    status = await anyio.to_thread.run_sync(
        lambda: main(["usage", "--store", store], stdout=out, stderr=err)
    )
    assert status == 0, err.getvalue()
    tenants = [line.split()[2] for line in out.getvalue().splitlines()[1:]]
    assert tenants == ["acme", "acme?"], out.getvalue()


@pytest.mark.parametrize("char", DRAWN_AS_NOTHING, ids=lambda c: f"U+{ord(c):04X}")
def test_every_printable_character_drawn_as_nothing_shows_as_a_question_mark(char: str) -> None:
    assert printable(f"a{char}b") == "a?b"


def test_text_drawn_as_something_is_kept() -> None:
    kept = "acme 日本語 cafe\u0301 Ελλάδα \U0001f680 \u2800"  # the braille blank is a glyph
    assert printable(kept) == kept


async def test_the_span_and_the_log_record_name_such_a_tenant_as_the_terminal_does(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The request span's `gateway.tenant` and the log record's `tenant` field (a trace
    view, a JSON log) said `acme` for the tenant `acme` + U+3164 too: `acme?` now, as the
    control and bidi characters there were already."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from fallback_mw.telemetry import Telemetry

    caplog.set_level(logging.INFO, logger="fallback_mw.request")
    spans = InMemorySpanExporter()
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(spans))
    try:
        async with upstream(status_handler(200, b"ok")) as primary:
            config = {
                "upstreams": {"primary": {"url": primary.url}},
                "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"]}],
            }
            telemetry = Telemetry(tracer_provider=provider)
            async with gateway_client(config, telemetry=telemetry) as client:
                tenant = "acme\u3164".encode()
                response = await client.get("/v1/x", headers=[(b"x-tenant-id", tenant)])
                assert response.status_code == 200
    finally:
        provider.shutdown()
    (span,) = [s for s in spans.get_finished_spans() if s.name == "gateway.request"]
    assert (span.attributes or {})["gateway.tenant"] == "acme?"
    (record,) = [r for r in caplog.records if r.name == "fallback_mw.request"]
    assert record.tenant == "acme?"  # type: ignore[attr-defined]
