"""serve's in-place OTLP span encoder (cli/otlp_spans.py): the SDK encoder's bytes, for any
spans the SDK makes; what it cannot encode left out as the SDK leaves it; handed to the
exporter only where it agrees with the SDK's."""

from __future__ import annotations

import logging
import types
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as sdk_encode
from opentelemetry.exporter.otlp.proto.http import trace_exporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from fallback_mw.cli import otlp_spans
from fallback_mw.cli.otel_setup import configure_opentelemetry

INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
SCALARS = st.one_of(st.text(max_size=8), st.booleans(), INT64, st.floats())
VALUES = st.one_of(
    SCALARS,
    st.lists(st.text(max_size=4), max_size=3),
    st.lists(INT64, max_size=3),
    st.lists(st.booleans(), max_size=3),
    st.lists(st.floats(), max_size=3),
)
ATTRIBUTES = st.dictionaries(st.text(min_size=1, max_size=6), VALUES, max_size=5)
IDS = st.integers(min_value=1, max_value=2**64 - 1)
STATES = st.lists(
    st.tuples(st.sampled_from(["a", "vendor", "k1"]), st.sampled_from(["1", "x", "yz"])),
    max_size=2,
    unique_by=lambda pair: pair[0],
)


@st.composite
def remote_contexts(draw: st.DrawFn) -> trace.SpanContext:
    return trace.SpanContext(
        trace_id=draw(st.integers(min_value=1, max_value=2**128 - 1)),
        span_id=draw(IDS),
        is_remote=draw(st.booleans()),
        trace_flags=trace.TraceFlags(draw(st.sampled_from([0, 1]))),
        trace_state=trace.TraceState(draw(STATES)),
    )


class DrawnIds(IdGenerator):
    """Ids from hypothesis (the SDK's default generator reads `random`)."""

    def __init__(self, draw: st.DrawFn) -> None:
        self.draw = draw

    def generate_span_id(self) -> int:
        return self.draw(IDS)

    def generate_trace_id(self) -> int:
        return self.draw(st.integers(min_value=1, max_value=2**128 - 1))


@st.composite
def span_batches(draw: st.DrawFn) -> list[ReadableSpan]:
    """Spans made by SDK tracers (their attributes cleaned as the SDK cleans them) of one
    or two resources and scopes, interleaved, with events, links, statuses and parents."""
    kept = InMemorySpanExporter()
    tracers = []
    for index in range(draw(st.integers(min_value=1, max_value=2))):
        resource = Resource(draw(ATTRIBUTES), draw(st.sampled_from(["", "https://s/1"])))
        provider = TracerProvider(
            resource=resource, shutdown_on_exit=False, id_generator=DrawnIds(draw)
        )
        provider.add_span_processor(SimpleSpanProcessor(kept))
        for scope in range(draw(st.integers(min_value=1, max_value=2))):
            tracers.append(
                provider.get_tracer(
                    f"scope-{index}-{scope}",
                    draw(st.sampled_from([None, "", "1.2"])),
                    draw(st.sampled_from([None, "https://schema/1"])),
                    attributes=draw(st.none() | ATTRIBUTES),
                )
            )
    for _ in range(draw(st.integers(min_value=1, max_value=5))):
        tracer = draw(st.sampled_from(tracers))
        parent = draw(st.none() | remote_contexts())
        context = (
            None if parent is None else trace.set_span_in_context(trace.NonRecordingSpan(parent))
        )
        links = [
            trace.Link(link, draw(st.none() | ATTRIBUTES))
            for link in draw(st.lists(remote_contexts(), max_size=2))
        ]
        span = tracer.start_span(
            draw(st.text(max_size=10)),
            context=context,
            kind=draw(st.sampled_from(list(trace.SpanKind))),
            attributes=draw(ATTRIBUTES),
            links=links,
        )
        for name in draw(st.lists(st.text(max_size=5), max_size=2)):
            span.add_event(name, draw(ATTRIBUTES))
        status = draw(st.sampled_from(list(trace.StatusCode)))
        if status is trace.StatusCode.ERROR:
            span.set_status(trace.Status(status, draw(st.none() | st.text(max_size=5))))
        elif status is trace.StatusCode.OK:
            span.set_status(trace.Status(status))
        span.end()
    return list(kept.get_finished_spans())


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(span_batches())
def test_spans_the_sdk_makes_are_encoded_to_the_sdk_encoders_bytes(
    spans: list[ReadableSpan],
) -> None:
    ours = otlp_spans.encode_spans(spans)
    assert ours.SerializePartialToString() == sdk_encode(spans).SerializePartialToString()
    assert ours.SerializeToString() == sdk_encode(spans).SerializeToString()


def _readable(attributes: dict[str, Any]) -> ReadableSpan:
    context = trace.SpanContext(trace_id=5, span_id=6, is_remote=False)
    return ReadableSpan(
        name="raw",
        context=context,
        attributes=attributes,
        resource=Resource({"service.name": "t"}),
        instrumentation_scope=InstrumentationScope("raw"),
        start_time=1,
        end_time=2,
    )


def test_values_the_sdk_cannot_encode_are_left_out_as_it_leaves_them(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A span a processor or a host hands over as it is (no SDK cleaning): None, bytes, a
    mapping and a tuple encoded as the SDK encodes them; an int past int64, a list holding
    one, and an object of no OTLP type logged and left out, the rest of the span kept."""
    attributes: dict[str, Any] = {
        "none": None,
        "raw": b"\x00\xff",
        "map": {"a": 1, 2: ["x", None]},
        "tuple": (1.5, True),
        "huge": 2**64,
        "huge-in-list": [1, 2**70],
        "object": object(),
        "kept": "yes",
    }
    spans = [_readable(attributes)]
    with caplog.at_level(logging.ERROR):
        expected = sdk_encode(spans).SerializePartialToString()
        sdk_lines = len(caplog.records)
        caplog.clear()
        ours = otlp_spans.encode_spans(spans)
    assert ours.SerializePartialToString() == expected
    message = ExportTraceServiceRequest.FromString(ours.SerializePartialToString())
    keys = [a.key for a in message.resource_spans[0].scope_spans[0].spans[0].attributes]
    assert keys == ["none", "raw", "map", "tuple", "kept"]
    assert sdk_lines == 3
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "Failed to encode key huge",
        "Failed to encode key huge-in-list",
        "Failed to encode key object",
    ]


def test_an_attribute_encoded_again_is_the_same_and_true_is_never_one() -> None:
    """The `KeyValue`s of str, bool and int attributes are remembered (one bounded table,
    keyed by the value's type too): the second span's bytes are the first's, True and 1
    (equal in Python, one key in a table keyed by value alone) stay a bool and an int, and
    past the table's bound every value is still encoded as the SDK encodes it."""
    first = [_readable({"flag": True, "count": 1, "zero": 0, "off": False, "route": "chat"})]
    second = [_readable({"flag": 1, "count": True, "zero": False, "off": 0, "route": "chat"})]
    for spans in (first, second, first, second):
        ours = otlp_spans.encode_spans(spans).SerializePartialToString()
        assert ours == sdk_encode(spans).SerializePartialToString()
    many = [_readable({"tenant": f"tenant-{n}", "n": n}) for n in range(5000)]
    ours = otlp_spans.encode_spans(many).SerializePartialToString()
    assert ours == sdk_encode(many).SerializePartialToString()


def test_a_span_without_a_context_fails_the_batch_as_the_sdks_encoder_does() -> None:
    span = ReadableSpan(name="no context", context=None)
    with pytest.raises(AttributeError):
        sdk_encode([span])
    with pytest.raises(ValueError, match="without a span context"):
        otlp_spans.encode_spans([span])


def test_the_exporter_module_gets_the_encoder_only_where_it_agrees(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(trace_exporter, "encode_spans", sdk_encode)
    assert otlp_spans.use_in_place(trace_exporter)
    assert trace_exporter.encode_spans is otlp_spans.encode_spans
    assert otlp_spans.use_in_place(trace_exporter)  # a second time: already in use

    def changed(spans: Any) -> ExportTraceServiceRequest:  # an SDK whose encoder changed
        request = sdk_encode(spans)
        request.resource_spans[0].schema_url = "https://changed"
        return request

    other = types.ModuleType("other_exporter")
    other.encode_spans = changed  # type: ignore[attr-defined]
    assert not otlp_spans.use_in_place(other)
    assert other.encode_spans is changed  # type: ignore[attr-defined]

    def broken(spans: Any) -> ExportTraceServiceRequest:
        raise RuntimeError("an encoder of another shape")

    other.encode_spans = broken  # type: ignore[attr-defined]
    assert not otlp_spans.use_in_place(other)
    assert other.encode_spans is broken  # type: ignore[attr-defined]
    assert not otlp_spans.use_in_place(types.ModuleType("no_encoder"))


def test_serve_with_otlp_spans_over_http_uses_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trace_exporter, "encode_spans", sdk_encode)
    environ = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9/",
    }
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    handle = configure_opentelemetry(set_global=False)
    try:
        assert trace_exporter.encode_spans is otlp_spans.encode_spans
    finally:
        handle.shutdown()
