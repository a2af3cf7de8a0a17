"""A caller that places a credential where telemetry records a caller's value — its tenant
id, the body's `model`, a `tracestate` entry, an unknown method token — never gets it
recorded (SPEC §9): not its own token, not a provider key it learnt. Spans (their trace
state included), the request log line and its fields, the usage record and the local error
body are scanned; the ordinary values of the same places are still recorded."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from fallback_mw import Gateway
from fallback_mw.telemetry import Telemetry
from tests.helpers import http_scope
from tests.test_telemetry_leak import Everything, call, render_record
from tests.upstreams import Upstream, host_app, upstream

pytestmark = pytest.mark.anyio

PROVIDER_KEY = "sk-prov-7Hq2Lx9Wd41Zr"
BACKUP_KEY = "sk-back-3Mv8Tn5Ys20Kp"
CALLER_TOKEN = "sk-caller-Ab4Cd6Ef8Gh"
QUERY_KEY = "qk-Zz9Yy8Xx7Ww6"
SECRETS = (PROVIDER_KEY, BACKUP_KEY, CALLER_TOKEN, QUERY_KEY)
ENV = {"PRIMARY_KEY": PROVIDER_KEY, "BACKUP_KEY": BACKUP_KEY}
TRACEPARENT = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def carried(text: str) -> list[str]:
    lowered = text.lower()
    return [secret for secret in SECRETS if secret.lower() in lowered]


async def answer_with_usage(request: Any) -> Any:
    from aiohttp import web

    await request.read()
    payload = {"model": "gpt-4o-mini", "usage": {"prompt_tokens": 3, "completion_tokens": 4}}
    return web.json_response(payload)


@dataclass
class Recorded:
    gateway: Gateway
    spans: InMemorySpanExporter
    logs: Everything
    upstream: Upstream

    async def request(
        self,
        method: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes = b"",
        query: bytes = b"",
    ) -> tuple[int, bytes, str]:
        """Status, body, and everything recorded for this one request, as text."""
        self.spans.clear()
        self.logs.records.clear()
        status, out = await call(self.gateway, http_scope(method, "/v1/chat/completions", query,
                                                          headers), body)  # fmt: skip
        spans = self.spans.get_finished_spans()
        assert spans, "the request was not traced"
        text = "\n".join(span.to_json() for span in spans)
        text += "\n".join(render_record(r) for r in self.logs.records)
        records = await self.gateway.services.ledger.usage(route="chat")  # type: ignore[union-attr]
        text += "\n".join(repr(r) for r in records)
        return status, out, text

    def request_span(self) -> Any:
        (span,) = [s for s in self.spans.get_finished_spans() if s.name == "gateway.request"]
        return span


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


@pytest.fixture
async def recorded(everything_logged: Everything) -> AsyncIterator[Recorded]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    async with upstream(answer_with_usage) as answering:
        config = {
            "upstreams": {
                "primary": {"url": answering.url, "auth_env": "PRIMARY_KEY"},
                "backup": {"url": answering.url + "/b", "auth_env": "BACKUP_KEY"},
            },
            "routes": [
                {"id": "chat", "prefix": "/v1/", "plan": ["primary", "backup"], "retries": 1}
            ],
        }
        gateway = Gateway(
            host_app, config=config, environ=ENV, telemetry=Telemetry(tracer_provider=provider)
        )
        try:
            yield Recorded(gateway, exporter, everything_logged, answering)
        finally:
            await gateway.aclose()
            provider.shutdown()


def caller(*extra: tuple[bytes, bytes]) -> list[tuple[bytes, bytes]]:
    return [(b"authorization", f"Bearer {CALLER_TOKEN}".encode()), *extra]


@pytest.mark.parametrize("secret", [PROVIDER_KEY, BACKUP_KEY, CALLER_TOKEN])
async def test_a_credential_sent_as_the_tenant_id_is_recorded_redacted(
    recorded: Recorded, secret: str
) -> None:
    status, _, text = await recorded.request("GET", caller((b"x-tenant-id", secret.encode())))
    assert status == 200
    assert carried(text) == []
    assert recorded.request_span().attributes["gateway.tenant"] == "[REDACTED]"
    (record,) = await recorded.gateway.services.ledger.usage(route="chat")  # type: ignore[union-attr]
    assert record.tenant == "[REDACTED]"


@pytest.mark.parametrize("field", [b"X_Api_Key", b"x-api_key", b"X_AUTH_TOKEN", b"Authorization"])
async def test_a_callers_credential_in_any_spelling_of_its_field_is_known_as_one(
    recorded: Recorded, field: bytes
) -> None:
    """`x_api_key` is `X-Api-Key` to a WSGI-style upstream (both HTTP_X_API_KEY), so the
    gateway strips it; a token sent in it and again as the tenant is the caller's own
    credential, recorded redacted, as under its usual spelling."""
    headers = [(field, CALLER_TOKEN.encode()), (b"x-tenant-id", CALLER_TOKEN.encode())]
    status, _, text = await recorded.request("GET", headers)
    assert status == 200
    assert carried(text) == []
    assert recorded.request_span().attributes["gateway.tenant"] == "[REDACTED]"


async def test_a_credential_inside_a_longer_tenant_id_or_from_the_query_is_redacted(
    recorded: Recorded,
) -> None:
    tenant = f"team-{PROVIDER_KEY}-eu"
    status, _, text = await recorded.request("GET", caller((b"x-tenant-id", tenant.encode())))
    assert status == 200 and carried(text) == []
    # The caller's key in a query parameter the gateway strips (api_key) is a credential too.
    status, _, text = await recorded.request(
        "GET", [(b"x-tenant-id", QUERY_KEY.encode())], query=f"api_key={QUERY_KEY}".encode()
    )
    assert status == 200 and carried(text) == []
    assert recorded.request_span().attributes["gateway.tenant"] == "[REDACTED]"


@pytest.mark.parametrize("secret", [PROVIDER_KEY, CALLER_TOKEN])
async def test_a_credential_sent_as_the_model_is_not_recorded(
    recorded: Recorded, secret: str
) -> None:
    body = json.dumps({"model": secret, "messages": []}).encode()
    headers = caller((b"content-type", b"application/json"), (b"x-tenant-id", b"acme"))
    status, _, text = await recorded.request("POST", headers, body)
    assert status == 200
    assert carried(text) == []
    attributes = recorded.request_span().attributes
    assert "gen_ai.request.model" not in attributes
    assert attributes["gen_ai.response.model"] == "gpt-4o-mini"  # the upstream's own: kept
    (record,) = await recorded.gateway.services.ledger.usage(route="chat")  # type: ignore[union-attr]
    assert record.model == "gpt-4o-mini"


async def test_a_credential_in_tracestate_is_not_inherited_by_any_span(
    recorded: Recorded,
) -> None:
    tracestate = f"vendor=v1,leak={PROVIDER_KEY},mine={CALLER_TOKEN}".encode()
    headers = caller((b"traceparent", TRACEPARENT), (b"tracestate", tracestate))
    status, _, text = await recorded.request("GET", headers)
    assert status == 200
    assert carried(text) == []
    spans = recorded.spans.get_finished_spans()
    assert {s.name for s in spans} == {"gateway.request", "gateway.attempt"}
    for span in spans:
        assert span.context.trace_id == 0x4BF92F3577B34DA6A3CE929D0E0E4736  # still continued
        assert dict(span.context.trace_state) == {"vendor": "v1"}  # the rest still propagates
    (received,) = recorded.upstream.received
    sent = dict(received.headers)
    assert sent["tracestate"] == "vendor=v1"
    assert sent["authorization"] == f"Bearer {PROVIDER_KEY}"  # its own credential, and only
    others = [(name, value) for name, value in received.headers if name != "authorization"]
    assert carried(json.dumps(others)) == []


async def test_a_credential_in_baggage_never_reaches_the_upstream(recorded: Recorded) -> None:
    """A page's instrumentation that sets `session.id` to its session cookie (or a token)
    in W3C baggage: the gateway propagates the caller's baggage upstream, and the stripped
    `cookie` went on to the provider that way. Such entries are dropped, the rest kept."""
    baggage = f"session.id={CALLER_TOKEN},{PROVIDER_KEY}=1,app=web".encode()
    headers = [
        (b"cookie", f"sid={CALLER_TOKEN}".encode()),
        (b"traceparent", TRACEPARENT),
        (b"baggage", baggage),
    ]
    status, _, text = await recorded.request("GET", headers)
    assert status == 200
    assert carried(text) == []
    (received,) = recorded.upstream.received
    assert dict(received.headers)["baggage"] == "app=web"
    assert carried(json.dumps(received.headers)) == [PROVIDER_KEY]  # its own key, injected
    assert dict(received.headers)["authorization"] == f"Bearer {PROVIDER_KEY}"


async def test_a_host_that_extracted_the_context_itself_propagates_no_credential(
    recorded: Recorded,
) -> None:
    """Under an instrumented host (its server span already continues the caller's trace),
    the caller's trace state and baggage reached the upstream as the host extracted them,
    a credential of the request included: only a context the gateway extracted was
    cleaned."""
    from opentelemetry import context as otel_context
    from opentelemetry import propagate, trace

    headers = [
        (b"cookie", f"sid={CALLER_TOKEN}".encode()),
        (b"traceparent", TRACEPARENT),
        (b"tracestate", f"vendor=v1,mine={CALLER_TOKEN}".encode()),
        (b"baggage", f"session.id={CALLER_TOKEN},app=web".encode()),
    ]
    carrier = {name.decode(): value.decode() for name, value in headers}
    extracted = propagate.extract(carrier)
    span = trace.NonRecordingSpan(trace.get_current_span(extracted).get_span_context())
    token = otel_context.attach(trace.set_span_in_context(span, extracted))
    try:
        status, _, _ = await recorded.request("GET", headers)
    finally:
        otel_context.detach(token)
    assert status == 200
    (received,) = recorded.upstream.received
    sent = dict(received.headers)
    assert sent["baggage"] == "app=web" and sent["tracestate"] == "vendor=v1"
    assert sent["traceparent"].startswith("00-4bf92f3577b34da6a3ce929d0e0e4736-")


async def test_an_unknown_method_token_that_is_a_credential_is_not_echoed(
    recorded: Recorded,
) -> None:
    status, body, text = await recorded.request(PROVIDER_KEY.upper(), caller())
    assert status == 405
    assert carried(text + body.decode()) == []
    assert json.loads(body)["error"]["code"] == "method_not_allowed"
    assert recorded.request_span().attributes["http.request.method_original"] == "[REDACTED]"


async def test_a_header_name_that_is_a_credential_is_not_echoed_in_the_400(
    recorded: Recorded,
) -> None:
    # A header the gateway would forward, whose value it refuses (bytes that are not UTF-8):
    # the 400 names the header, unless its name is a credential of the request.
    status, body, text = await recorded.request(
        "GET", caller((PROVIDER_KEY.lower().encode(), b"\xff\xfe"))
    )
    assert status == 400
    assert carried(text + body.decode()) == []
    assert "'a request header' has bytes >= 0x80" in json.loads(body)["error"]["message"]
    status, body, _ = await recorded.request("GET", caller((b"x-trace-note", b"\xff\xfe")))
    assert status == 400 and "'x-trace-note' has bytes" in json.loads(body)["error"]["message"]


async def test_a_model_cut_to_its_kept_length_is_still_known_as_the_key(
    recorded: Recorded,
) -> None:
    # A request keeps 200 characters of its model: a longer key arrives cut, as a piece.
    long_token = "sk-long-" + "Qx7" * 100
    body = json.dumps({"model": long_token}).encode()
    headers = [(b"x-api-key", long_token.encode()), (b"content-type", b"application/json")]
    status, _, text = await recorded.request("POST", headers, body)
    assert status == 200
    assert long_token[:40].lower() not in text.lower()
    assert "gen_ai.request.model" not in recorded.request_span().attributes  # type: ignore[operator]


async def test_a_tenant_that_is_only_a_word_of_the_token_is_recorded(
    recorded: Recorded,
) -> None:
    headers = [
        (b"authorization", b"Bearer acme-production-7f3a9c2e11b4"),
        (b"x-tenant-id", b"acme-production"),
    ]
    status, _, _ = await recorded.request("GET", headers)
    assert status == 200
    assert recorded.request_span().attributes["gateway.tenant"] == "acme-production"  # type: ignore[index]


async def test_ordinary_values_are_still_recorded(recorded: Recorded) -> None:
    # The control: the same places with ordinary values record them as they are.
    body = json.dumps({"model": "gpt-4o-mini-2024-07-18"}).encode()
    headers = caller(
        (b"x-tenant-id", b"acme-production"),
        (b"traceparent", TRACEPARENT),
        (b"tracestate", b"vendor=v1,other=abcdefghijkl"),
        (b"content-type", b"application/json"),
    )
    status, _, _ = await recorded.request("POST", headers, body)
    assert status == 200
    span = recorded.request_span()
    assert span.attributes["gateway.tenant"] == "acme-production"
    assert span.attributes["gen_ai.request.model"] == "gpt-4o-mini-2024-07-18"
    assert dict(span.context.trace_state) == {"vendor": "v1", "other": "abcdefghijkl"}
    status, body_out, _ = await recorded.request("PROPFIND", caller())
    assert status == 405 and b"PROPFIND is not forwarded" in body_out
    assert recorded.request_span().attributes["http.request.method_original"] == "PROPFIND"
    records = await recorded.gateway.services.ledger.usage(route="chat")  # type: ignore[union-attr]
    assert "acme-production" in {r.tenant for r in records}
    assert "gpt-4o-mini" in {r.model for r in records}


async def test_only_the_recorded_part_of_a_long_value_is_searched_for_credentials(
    recorded: Recorded,
) -> None:
    # Each of a request's credentials was searched for in the whole of every recorded
    # value: a cookie of thousands of values beside a 32 KB tenant id cost the square of
    # the head's size (138 KB of head: 270 ms of CPU a request, ~70x an ordinary head of
    # that size). Records hold at most the first MAX_RECORDED (256) characters of such a
    # value: only they, and a credential beginning there, are searched.
    cookies = "; ".join(f"c{i}=value-{i:08d}" for i in range(2500)).encode()
    beyond = "x" * 300 + "-" + CALLER_TOKEN  # begins past what any record holds
    status, _, text = await recorded.request(
        "GET", caller((b"cookie", cookies), (b"x-tenant-id", beyond.encode()))
    )
    assert status == 200 and carried(text) == []
    assert recorded.request_span().attributes["gateway.tenant"] == "x" * 128
    (record,) = await recorded.gateway.services.ledger.usage(route="chat")  # type: ignore[union-attr]
    assert record.tenant == "x" * 200
    # One that begins in the recorded part is found, though the label cuts it (at 128).
    within = "x" * 100 + CALLER_TOKEN + "y" * 300
    status, _, text = await recorded.request(
        "GET", caller((b"cookie", cookies), (b"x-tenant-id", within.encode()))
    )
    assert status == 200 and carried(text) == []
    assert recorded.request_span().attributes["gateway.tenant"] == "[REDACTED]"
    # A name echoed in an error is cut to that part too.
    name = b"x-" + b"n" * 400 + CALLER_TOKEN.lower().encode()
    status, body, text = await recorded.request("GET", caller((name, b"\xff\xfe")))
    assert status == 400 and carried(text + body.decode()) == []
    message = json.loads(body)["error"]["message"]
    assert message.startswith(repr("x-" + "n" * 254) + " has bytes >= 0x80"), message


@given(
    text=st.text(alphabet="abcXYZ-_01 é", max_size=300),
    secrets=st.lists(st.binary(min_size=8, max_size=40).map(bytes.lower), max_size=20),
    cut=st.integers(min_value=0, max_value=40),
    at=st.integers(min_value=0, max_value=300),
)
def test_a_credential_is_found_in_a_recorded_value_however_many_the_request_holds(
    text: str, secrets: list[bytes], cut: int, at: int
) -> None:
    """`_carries` filters by each credential's first bytes only when the request holds many
    (a cookie of thousands); with a few it searches for each. The answer is the search's
    either way: the value holds a credential beginning in its recorded part, or is a long
    enough piece of one."""
    from fallback_mw.request.secrets import MAX_RECORDED, MIN_PIECE, MIN_SECRET, _carries

    if secrets and at <= len(text):  # sometimes a credential (or its start) in the value
        chosen = secrets[at % len(secrets)].decode("latin-1")
        text = text[:at] + chosen[: max(cut, MIN_SECRET)] + text[at:]
    values = tuple(dict.fromkeys(secrets))
    recorded = text[:MAX_RECORDED].encode("utf-8", "replace").lower()
    end = len(recorded)
    longest = max((len(s) for s in values), default=0)
    lowered = text[: MAX_RECORDED + longest].encode("utf-8", "replace").lower()
    expected = any(
        lowered.find(s, 0, end + len(s) - 1) >= 0
        or (end >= MIN_PIECE and len(s) >= end and s.find(recorded) >= 0)
        for s in values
    )
    assert _carries(text, values) is expected
    # The same credentials among many unrelated ones (the filtered search): the same answer.
    others = tuple(bytes([0xFF]) * 8 + bytes([n]) for n in range(20))
    assert _carries(text, values + others) is expected
