"""Spans encoded to OTLP protobuf bytes directly, for serve's OTLP/HTTP span exporter.

The exporter's encoder (`opentelemetry.exporter.otlp.proto.common`'s `encode_spans`) builds
each message from the messages below it, passed as arguments: a `KeyValue` from its
`AnyValue`, a `Span` from its `KeyValue`s, and so up to the request. The protobuf runtime
(upb) copies a message given that way, by serializing it and parsing the bytes back, so a
span's data was encoded and decoded once per level above it, some 45 µs a span on the
batch thread. Built in place instead (each field set where it lives) it still cost some
90k instructions a span: every field set is a call into upb from Python
(docs/performance.md).

`encode_spans` here writes the protobuf wire format itself, each message's fields in
field-number order as upb writes them, proto3's defaults left out as upb leaves them: the
same bytes, handed to the exporter as an object whose `SerializePartialToString` (all the
exporter asks of it) returns them. `use_in_place` hands it to the OTLP/HTTP span exporter
module, after checking on a probe batch (every kind of field the SDK's encoder writes)
that both give the same bytes; where they differ (an SDK whose encoder changed) the SDK's
own is kept."""

from __future__ import annotations

import inspect
import logging
import struct
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any, Final

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

# One byte each: the values below 128 a varint writes as themselves.
_BYTES: Final = tuple(bytes((value,)) for value in range(128))
_INT64_LOW: Final = -(2**63)
_INT64_HIGH: Final = 2**63 - 1
_DOUBLE: Final = struct.Struct("<d")
_FIXED64: Final = struct.Struct("<Q")
_FIXED32: Final = struct.Struct("<I")
# The messages' field tags: (field number << 3) | wire type (0 varint, 1 fixed64,
# 2 length-delimited, 5 fixed32), from opentelemetry-proto's .proto files.
_ANY_STRING: Final = b"\x0a"
_ANY_INT: Final = b"\x18"
_ANY_DOUBLE: Final = b"\x21"
_ANY_ARRAY: Final = b"\x2a"
_ANY_KVLIST: Final = b"\x32"
_ANY_BYTES: Final = b"\x3a"
_FALSE: Final = b"\x10\x00"  # an `AnyValue`'s bool_value (a oneof: written when false too)
_TRUE: Final = b"\x10\x01"


def _varint(value: int) -> bytes:
    if value < 0x80:
        return _BYTES[value]
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _delimited(tag: bytes, payload: bytes) -> bytes:
    return tag + _varint(len(payload)) + payload


def _value(value: object) -> bytes:
    """An `AnyValue`'s bytes, as the SDK's `_encode_value` makes it (bool before int, str
    before Sequence: no type is both); raises as upb does for what it cannot hold."""
    if isinstance(value, str):
        return _delimited(_ANY_STRING, value.encode())
    if isinstance(value, bool):
        return _TRUE if value else _FALSE
    if isinstance(value, int):
        return _ANY_INT + _int64(int(value))
    if value is None:
        return b""  # present, and empty
    if isinstance(value, float):
        return _ANY_DOUBLE + _DOUBLE.pack(value)
    if isinstance(value, bytes):
        return _delimited(_ANY_BYTES, bytes(value))
    if isinstance(value, Sequence):
        items = [_delimited(b"\x0a", _value(item)) for item in value]
        return _delimited(_ANY_ARRAY, b"".join(items))
    if isinstance(value, Mapping):
        pairs = [_delimited(b"\x0a", _pair(str(key), item)) for key, item in value.items()]
        return _delimited(_ANY_KVLIST, b"".join(pairs))
    raise TypeError(f"Invalid type {type(value)}")


def _int64(value: int) -> bytes:
    if not _INT64_LOW <= value <= _INT64_HIGH:
        raise ValueError(f"Value out of range: {value}")
    return _varint(value if value >= 0 else value + 2**64)


def _pair(key: object, value: object) -> bytes:
    """A `KeyValue`'s bytes (its key left out when empty, its value always present)."""
    if not isinstance(key, str):
        raise TypeError("bad argument type for built-in operation")
    name = key.encode()
    encoded = _value(value)
    head = _delimited(b"\x0a", name) if name else b""
    return head + _delimited(b"\x12", encoded)


# The `KeyValue` of an attribute whose value is a str, a bool or an int, remembered: a
# gateway's spans carry a few dozen names with few values each (a route, a candidate, an
# outcome, a status). Keyed by the value's type too (True == 1 in Python, never in the
# bytes); at most _PAIRS_KEPT, the rest encoded every time (a tenant's label, a duration).
_PAIRS_KEPT: Final = 4096
_LONGEST_KEPT: Final = 128  # characters of a key or a str value
_PAIRS: Final[dict[tuple[str, type, object], bytes]] = {}


def _kept_pair(key: str, value: object) -> bytes:
    """`_pair(key, value)`, from the table where it can be (exact types only: a subclass's
    `__str__` or `__index__` is its own)."""
    kind = type(value)
    if (
        (kind is not str and kind is not bool and kind is not int)
        or type(key) is not str
        or len(key) > _LONGEST_KEPT
        or (kind is str and len(value) > _LONGEST_KEPT)  # type: ignore[arg-type]
    ):
        return _pair(key, value)
    entry = (key, kind, value)
    found = _PAIRS.get(entry)
    if found is None:
        found = _pair(key, value)  # raises past int64: nothing kept
        if len(_PAIRS) < _PAIRS_KEPT:
            _PAIRS[entry] = found
    return found


def _attributes(tag: bytes, attributes: Mapping[str, object] | None) -> list[bytes]:
    """Each attribute as a `KeyValue` field `tag`; one that cannot be encoded (a value out
    of int64's range, a type OTLP has no field for) is logged and left out, the others
    kept, as the SDK's `_encode_attributes` does."""
    fields: list[bytes] = []
    if not attributes:
        return fields
    for key, value in attributes.items():
        try:
            pair = _kept_pair(key, value)
        except Exception as error:
            _logger.error("Failed to encode key %s: %s", key, error)
            continue
        fields.append(_delimited(tag, pair))
    return fields


def _attributes_of(span: ReadableSpan) -> Mapping[str, object] | None:
    """A span's attributes: the SDK span's own dict where it holds one (its `attributes`
    property is a read-only view of it, whose `items()` goes through the view's Python
    mapping methods, a call per key), else the property."""
    held = getattr(span, "_attributes", None)
    plain = getattr(held, "_dict", held)
    if type(plain) is dict:
        return plain
    return span.attributes


class EncodedSpans:
    """The export request's bytes, as the exporter asks for them."""

    __slots__ = ("_data",)

    def __init__(self, data: bytes) -> None:
        self._data = data

    def SerializePartialToString(self) -> bytes:
        return self._data

    def SerializeToString(self) -> bytes:
        return self._data


def encode_spans(spans: Sequence[ReadableSpan]) -> EncodedSpans:
    """The OTLP export request for `spans`: the SDK encoder's message's bytes. Grouped as it
    groups them (by resource, then instrumentation scope, in the order they first appear)."""
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

    request: list[bytes] = []
    for resource, scopes in groups.items():
        fields = [_delimited(b"\x0a", b"".join(_attributes(b"\x0a", resource.attributes)))]
        for scope, in_scope in scopes.items():
            described: list[bytes] = []
            schema = b""
            if scope is not None:
                if scope.name:
                    described.append(_delimited(b"\x0a", scope.name.encode()))
                if scope.version:
                    described.append(_delimited(b"\x12", scope.version.encode()))
                described += _attributes(b"\x1a", scope.attributes)
                if scope.schema_url:
                    schema = _delimited(b"\x1a", scope.schema_url.encode())
            parts = [_delimited(b"\x0a", b"".join(described))]
            parts += [_delimited(b"\x12", _span(span)) for span in in_scope]
            parts.append(schema)
            fields.append(_delimited(b"\x12", b"".join(parts)))
        if resource.schema_url:
            fields.append(_delimited(b"\x1a", resource.schema_url.encode()))
        request.append(_delimited(b"\x0a", b"".join(fields)))
    return EncodedSpans(b"".join(request))


def _span(span: ReadableSpan) -> bytes:
    """One span's bytes, the fields the SDK's `_encode_span` sets."""
    context = span.get_span_context()
    if context is None:  # the SDK's encoder fails the batch too ("Failed to encode ...")
        raise ValueError("a span without a span context")
    fields = [
        b"\x0a\x10" + context.trace_id.to_bytes(16, "big"),
        b"\x12\x08" + context.span_id.to_bytes(8, "big"),
    ]
    state = context.trace_state
    if state is not None:
        text = ",".join([f"{key}={value}" for key, value in state.items()])
        if text:
            fields.append(_delimited(b"\x1a", text.encode()))
    parent = span.parent
    if parent:
        fields.append(b"\x22\x08" + parent.span_id.to_bytes(8, "big"))
    name = span.name.encode()
    if name:
        fields.append(_delimited(b"\x2a", name))
    fields.append(b"\x30" + _varint(_KINDS[span.kind]))
    if span.start_time:
        fields.append(b"\x39" + _FIXED64.pack(span.start_time))
    if span.end_time:
        fields.append(b"\x41" + _FIXED64.pack(span.end_time))
    fields += _attributes(b"\x4a", _attributes_of(span))
    if span.dropped_attributes:
        fields.append(b"\x50" + _varint(span.dropped_attributes))
    for event in span.events:
        encoded = [b"\x09" + _FIXED64.pack(event.timestamp)] if event.timestamp else []
        if event.name:
            encoded.append(_delimited(b"\x12", event.name.encode()))
        encoded += _attributes(b"\x1a", event.attributes)
        if event.dropped_attributes:
            encoded.append(b"\x20" + _varint(event.dropped_attributes))
        fields.append(_delimited(b"\x5a", b"".join(encoded)))
    if span.dropped_events:
        fields.append(b"\x60" + _varint(span.dropped_events))
    for link in span.links:
        linked = [
            b"\x0a\x10" + link.context.trace_id.to_bytes(16, "big"),
            b"\x12\x08" + link.context.span_id.to_bytes(8, "big"),
        ]
        linked += _attributes(b"\x22", link.attributes)
        if link.dropped_attributes:
            linked.append(b"\x28" + _varint(link.dropped_attributes))
        flags = _HAS_IS_REMOTE | (_IS_REMOTE if link.context.is_remote else 0)
        linked.append(b"\x35" + _FIXED32.pack(flags))
        fields.append(_delimited(b"\x6a", b"".join(linked)))
    if span.dropped_links:
        fields.append(b"\x70" + _varint(span.dropped_links))
    status = span.status
    if status is not None:
        said = b""
        if status.description:  # None or "": no message field
            said = _delimited(b"\x12", status.description.encode())
        code = status.status_code.value
        fields.append(_delimited(b"\x7a", said + (b"\x18" + _varint(code) if code else b"")))
    flags = _HAS_IS_REMOTE | (_IS_REMOTE if parent and parent.is_remote else 0)
    fields.append(b"\x85\x01" + _FIXED32.pack(flags))
    return b"".join(fields)


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
