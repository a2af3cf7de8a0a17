"""Spans encoded to OTLP protobuf in place, for serve's OTLP/HTTP span exporter.

The exporter's encoder (`opentelemetry.exporter.otlp.proto.common`'s `encode_spans`) builds
each message from the messages below it, passed as arguments: a `KeyValue` from its
`AnyValue`, a `Span` from its `KeyValue`s, and so up to the request. The protobuf runtime
(upb) copies a message given that way, by serializing it and parsing the bytes back, so a
span's data was encoded and decoded once per level above it, some 45 µs a span on the
batch thread: a third of the instructions tracing added to a request (docs/performance.md).

`encode_spans` here builds the same request from the top down, each field set where it
lives (`add()` on a repeated field, a sub-message read from its parent), with the same
protobuf classes: the same message, the same bytes, a third of the time.
`use_in_place` hands it to the OTLP/HTTP span exporter module, after checking on a probe
batch (every kind of field the SDK's encoder writes) that both give the same bytes; where
they differ (an SDK whose encoder changed) the SDK's own is kept."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any, Final

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
)
from opentelemetry.proto.trace.v1.trace_pb2 import SpanFlags
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind

# The SDK encoder's own logger, for an attribute it cannot encode (a logged line, the rest
# of the span exported): what a user sees is the same line either way.
_logger: Final = logging.getLogger("opentelemetry.exporter.otlp.proto.common._internal")

_KINDS: Final = {
    SpanKind.INTERNAL: 1,
    SpanKind.SERVER: 2,
    SpanKind.CLIENT: 3,
    SpanKind.PRODUCER: 4,
    SpanKind.CONSUMER: 5,
}
_HAS_IS_REMOTE: Final = int(SpanFlags.SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK)
_IS_REMOTE: Final = int(SpanFlags.SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK)


def _put_value(out: Any, value: object) -> None:
    """`value` into the `AnyValue` `out`, as the SDK's `_encode_value` makes it (its order of
    checks: bool before int, str before Sequence)."""
    kind = type(value)
    if kind is str:
        out.string_value = value
    elif kind is bool:
        out.bool_value = value
    elif kind is int:
        out.int_value = value
    elif value is None:
        out.SetInParent()
    elif isinstance(value, bool):
        out.bool_value = value
    elif isinstance(value, str):
        out.string_value = value
    elif isinstance(value, int):
        out.int_value = value
    elif isinstance(value, float):
        out.double_value = value
    elif isinstance(value, bytes):
        out.bytes_value = value
    elif isinstance(value, Sequence):
        array = out.array_value
        array.SetInParent()
        values = array.values
        for item in value:
            _put_value(values.add(), item)
    elif isinstance(value, Mapping):
        listed = out.kvlist_value
        listed.SetInParent()
        pairs = listed.values
        for key, item in value.items():
            pair = pairs.add()
            pair.key = str(key)
            _put_value(pair.value, item)
    else:
        raise TypeError(f"Invalid type {kind}")


def _put_attributes(out: Any, attributes: Mapping[str, object] | None) -> None:
    """Each attribute as a `KeyValue` added to the repeated field `out`; one that cannot be
    encoded (a value out of int64's range, a type OTLP has no field for) is logged and left
    out, the others kept, as the SDK's `_encode_attributes` does."""
    if not attributes:
        return
    for key, value in attributes.items():
        pair = out.add()
        try:
            pair.key = key
            _put_value(pair.value, value)
        except Exception as error:
            del out[len(out) - 1]
            _logger.error("Failed to encode key %s: %s", key, error)


def _attributes_of(span: ReadableSpan) -> Mapping[str, object] | None:
    """A span's attributes: the SDK span's own dict where it holds one (its `attributes`
    property is a read-only view of it, whose `items()` goes through the view's Python
    mapping methods, a call per key), else the property."""
    held = getattr(span, "_attributes", None)
    plain = getattr(held, "_dict", held)
    if type(plain) is dict:
        return plain
    return span.attributes


def encode_spans(spans: Sequence[ReadableSpan]) -> ExportTraceServiceRequest:
    """The OTLP export request for `spans`: the SDK encoder's message, built in place.
    Grouped as it groups them (by resource, then instrumentation scope, in the order they
    first appear)."""
    groups: dict[Resource, dict[Any, list[ReadableSpan]]] = {}
    last_resource: object = None
    last_scope: object = None
    members: list[ReadableSpan] = []
    for span in spans:
        resource = span.resource
        scope = span.instrumentation_scope or None
        if resource is not last_resource or scope is not last_scope or not groups:
            # A Resource's hash is a JSON dump of its attributes: once per run of spans.
            members = groups.setdefault(resource, {}).setdefault(scope, [])
            last_resource, last_scope = resource, scope
        members.append(span)

    request = ExportTraceServiceRequest()
    for resource, scopes in groups.items():
        resource_spans = request.resource_spans.add()
        resource_spans.resource.SetInParent()
        _put_attributes(resource_spans.resource.attributes, resource.attributes)
        if resource.schema_url:
            resource_spans.schema_url = resource.schema_url
        for scope, in_scope in scopes.items():
            scope_spans = resource_spans.scope_spans.add()
            scope_spans.scope.SetInParent()
            if scope is not None:
                if scope.name:
                    scope_spans.scope.name = scope.name
                if scope.version:
                    scope_spans.scope.version = scope.version
                _put_attributes(scope_spans.scope.attributes, scope.attributes)
                if scope.schema_url:
                    scope_spans.schema_url = scope.schema_url
            out = scope_spans.spans
            for span in in_scope:
                _put_span(out.add(), span)
    return request


def _put_span(out: Any, span: ReadableSpan) -> None:
    """One span's fields, as the SDK's `_encode_span` sets them."""
    context = span.get_span_context()
    if context is None:  # the SDK's encoder fails the batch too ("Failed to encode ...")
        raise ValueError("a span without a span context")
    out.trace_id = context.trace_id.to_bytes(16, "big")
    out.span_id = context.span_id.to_bytes(8, "big")
    state = context.trace_state
    if state is not None:
        out.trace_state = ",".join([f"{key}={value}" for key, value in state.items()])
    parent = span.parent
    if parent:
        out.parent_span_id = parent.span_id.to_bytes(8, "big")
    out.name = span.name
    out.kind = _KINDS[span.kind]
    if span.start_time is not None:
        out.start_time_unix_nano = span.start_time
    if span.end_time is not None:
        out.end_time_unix_nano = span.end_time
    _put_attributes(out.attributes, _attributes_of(span))
    events = span.events
    if events:
        for event in events:
            encoded = out.events.add()
            encoded.name = event.name
            encoded.time_unix_nano = event.timestamp
            _put_attributes(encoded.attributes, event.attributes)
            encoded.dropped_attributes_count = event.dropped_attributes
    links = span.links
    if links:
        for link in links:
            linked = out.links.add()
            linked.trace_id = link.context.trace_id.to_bytes(16, "big")
            linked.span_id = link.context.span_id.to_bytes(8, "big")
            _put_attributes(linked.attributes, link.attributes)
            linked.dropped_attributes_count = link.dropped_attributes
            linked.flags = _HAS_IS_REMOTE | (_IS_REMOTE if link.context.is_remote else 0)
    status = span.status
    if status is not None:
        encoded_status = out.status
        encoded_status.SetInParent()
        encoded_status.code = status.status_code.value
        if status.description is not None:
            encoded_status.message = status.description
    out.dropped_attributes_count = span.dropped_attributes
    out.dropped_events_count = span.dropped_events
    out.dropped_links_count = span.dropped_links
    out.flags = _HAS_IS_REMOTE | (_IS_REMOTE if parent and parent.is_remote else 0)


def probe_spans() -> list[ReadableSpan]:
    """Spans with every kind of field the SDK's encoder writes, made by a private SDK
    tracer and resource (never exported): a server span with attributes of each value
    type, an event, a link and an error status; a client span under a remote parent with
    a trace state; a span of another scope."""
    from opentelemetry import trace
    from opentelemetry.metrics import NoOpMeterProvider
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    kept = InMemorySpanExporter()
    resource = Resource({"service.name": "probe", "count": 3, "on": True})
    # Counted by no meter (the SDK's own span metrics, when a user turns them on, would
    # count the probe in the process's provider), where the SDK takes one.
    quiet: dict[str, Any] = {}
    if "meter_provider" in inspect.signature(TracerProvider).parameters:
        quiet["meter_provider"] = NoOpMeterProvider()
    provider = TracerProvider(resource=resource, shutdown_on_exit=False, **quiet)
    provider.add_span_processor(SimpleSpanProcessor(kept))
    tracer = provider.get_tracer("fallback_mw", "0", attributes={"probe": True})
    remote = trace.SpanContext(
        trace_id=0x0AF7651916CD43DD8448EB211C80319C,
        span_id=0x00F067AA0BA902B7,
        is_remote=True,
        trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED),
        trace_state=trace.TraceState([("vendor", "value")]),
    )
    server = tracer.start_span(
        "probe.server",
        kind=SpanKind.SERVER,
        attributes={"s": "text", "b": True, "i": -7, "f": 0.5, "list": ["a", "b"], "n": [1, 2]},
        links=[trace.Link(remote, {"link": 1})],
    )
    server.add_event("probe.event", {"e": "x", "count": 2})
    server.set_status(trace.Status(trace.StatusCode.ERROR, "probe"))
    client = tracer.start_span(
        "probe.client",
        context=trace.set_span_in_context(trace.NonRecordingSpan(remote)),
        kind=SpanKind.CLIENT,
        attributes={"server.port": 443, "flags": [True, False], "ratios": [0.25]},
        start_time=1_000_000_000,
    )
    client.end(end_time=1_000_000_001)
    server.end()
    other = provider.get_tracer("other").start_span("probe.internal")
    other.end()
    provider.shutdown()
    return list(kept.get_finished_spans())


def use_in_place(module: ModuleType) -> bool:
    """Give the OTLP/HTTP span exporter `module` this encoder, when it agrees with the one
    it has on the probe batch (byte for byte). Whether it is in use."""
    current = getattr(module, "encode_spans", None)
    if current is encode_spans:
        return True
    if current is None:
        return False
    try:
        spans = probe_spans()
        agrees = bool(
            current(spans).SerializePartialToString()
            == encode_spans(spans).SerializePartialToString()
        )
    except Exception:  # an SDK this was not written for: its own encoder, as it was
        agrees = False
    if agrees:
        vars(module)["encode_spans"] = encode_spans
    else:
        _logger.debug("the OTLP span encoder differs from the SDK's here; the SDK's is kept")
    return agrees


__all__ = ["encode_spans", "probe_spans", "use_in_place"]
