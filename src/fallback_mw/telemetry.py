"""Spans, metrics and the request log line (SPEC §9).

Redaction is by construction: every attribute, event field, metric attribute and log field
is built here, from an allowlist of gateway facts — route id, candidate names, counts,
status codes, failure kinds. Nothing reads a body, a header value (other than the W3C
trace context), a credential or a query string, so nothing can leak one. Exceptions are
never recorded (their messages are not ours to vouch for).

The library uses `opentelemetry-api` only; the host app (or `fallback-mw serve`, see
`otel_setup`) owns the SDK. Without an SDK every call is a cheap no-op.
"""

from __future__ import annotations

import contextvars
import logging
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import metrics, propagate, trace
from opentelemetry.propagators.textmap import Getter, TextMapPropagator
from opentelemetry.util.types import AttributeValue

from fallback_mw.context import AttemptRecord, RequestContext

INSTRUMENTATION_NAME = "fallback_mw"
REQUEST_SPAN = "gateway.request"
ATTEMPT_SPAN = "gateway.attempt"
SKIP_EVENT = "gateway.candidate.skipped"
SHADOW_SPAN = "gateway.shadow"

logger = logging.getLogger("fallback_mw.request")
_internal = logging.getLogger("fallback_mw.telemetry")

_MAX_LABEL = 128
# A model name is echoed from the request body, so only name-shaped values are recorded.
_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}")
_BREAKER_VALUES = {"closed": 0, "half_open": 1, "open": 2}
_DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Outcomes that are the caller's or the upstream's doing, not a gateway failure.
_QUIET_OUTCOMES = frozenset({"served", "client_disconnected"})

# The attempt span in flight in this task, so `inject_headers` (called with the attempt's
# header list only) can propagate its context. Set in attempt_started, cleared after.
_current_attempt: contextvars.ContextVar[_AttemptTrace | None] = contextvars.ContextVar(
    "fallback_mw_current_attempt", default=None
)


def _label(value: object) -> str:
    """A short printable label (route ids, candidate names, tenant)."""
    text = str(value)
    if not text.isprintable():
        text = "".join(ch if ch.isprintable() else "?" for ch in text)
    return text[:_MAX_LABEL]


def _model(value: str | None) -> str | None:
    if value is None or not _MODEL_NAME.fullmatch(value):
        return None
    return value


# A caller's trace-context field longer than this (the W3C baggage limit) is ignored
# whole: OpenTelemetry's propagators log a too-long or malformed field *with its value*,
# which a console exporter setup writes to stderr.
_MAX_PROPAGATION_FIELD = 8192
_EXTRACTING: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "fallback_mw_extracting", default=False
)


class _DropCallerEcho(logging.Filter):
    """Drops the propagators' warnings while they read a caller's headers: those
    warnings quote the caller's field values."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not _EXTRACTING.get()


_DROP_CALLER_ECHO = _DropCallerEcho()
_PROPAGATOR_LOGGERS = ("opentelemetry.baggage.propagation", "opentelemetry.propagate")


def _quiet_propagators() -> None:
    for name in _PROPAGATOR_LOGGERS:
        target = logging.getLogger(name)
        if _DROP_CALLER_ECHO not in target.filters:
            target.addFilter(_DROP_CALLER_ECHO)


class _HeaderGetter(Getter[Sequence[tuple[bytes, bytes]]]):
    """Reads only the propagator's own fields (traceparent, tracestate, baggage), and
    none longer than _MAX_PROPAGATION_FIELD."""

    def get(self, carrier: Sequence[tuple[bytes, bytes]], key: str) -> list[str] | None:
        wanted = key.lower().encode("latin-1")
        values = [
            v.decode("latin-1")
            for k, v in carrier
            if k.lower() == wanted and len(v) <= _MAX_PROPAGATION_FIELD
        ]
        return values or None

    def keys(self, carrier: Sequence[tuple[bytes, bytes]]) -> list[str]:
        return [k.decode("latin-1").lower() for k, _ in carrier]


_GETTER = _HeaderGetter()


@dataclass(slots=True)
class _AttemptTrace:
    record: AttemptRecord
    span: trace.Span
    context: otel_context.Context


@dataclass(slots=True)
class _RequestTrace:
    """One request's telemetry state; lives in `context.trace`, never on Telemetry."""

    span: trace.Span
    parent: otel_context.Context  # incoming context (trace parent, baggage) + our span
    attempts: list[_AttemptTrace] = field(default_factory=list)


@dataclass(slots=True)
class _Untraced:
    """A request with nothing to trace (no SDK behind the global tracer, no trace context
    from the caller): no spans, the same metrics. Attempts in flight, for the metrics of
    those a disconnect cancels."""

    attempts: list[AttemptRecord] = field(default_factory=list)


# Marks a request whose telemetry was finished: a second request_finished records nothing.
_FINISHED = object()


def normalise_breaker_state(state: str) -> str | None:
    normalised = state.strip().lower().replace("-", "_")
    return normalised if normalised in _BREAKER_VALUES else None


class Telemetry:
    """The walker's one telemetry seam. Every hook is safe to call and never raises.

    `tracer_provider` / `meter_provider` default to the global ones (the host app's SDK,
    or no-ops). Tests pass their own providers."""

    def __init__(
        self,
        *,
        tracer_provider: trace.TracerProvider | None = None,
        meter_provider: metrics.MeterProvider | None = None,
    ) -> None:
        _quiet_propagators()
        version = _version()
        # With the global provider, spans are only recorded once an SDK is installed (serve
        # installs it after building the gateway): until then a request costs no span work.
        self._global_tracer = tracer_provider is None
        self._propagation: tuple[TextMapPropagator, frozenset[str], frozenset[bytes]] | None = None
        tracer_provider = tracer_provider or trace.get_tracer_provider()
        meter_provider = meter_provider or metrics.get_meter_provider()
        self.meter_provider = meter_provider  # shared with the health state it reports on
        self._tracer = tracer_provider.get_tracer(INSTRUMENTATION_NAME, version)
        meter = meter_provider.get_meter(INSTRUMENTATION_NAME, version)
        self._requests = meter.create_counter(
            "gateway.requests", unit="{request}", description="Routed requests, by outcome"
        )
        self._attempts = meter.create_counter(
            "gateway.attempts", unit="{attempt}", description="Upstream requests made"
        )
        self._fallbacks = meter.create_counter(
            "gateway.fallbacks",
            unit="{request}",
            description="Requests answered by a candidate other than the first of their order",
        )
        self._skips = meter.create_counter(
            "gateway.skips",
            unit="{candidate}",
            description="Candidates skipped (breaker open, no usable credential)",
        )
        self._duration = meter.create_histogram(
            "gateway.request.duration",
            unit="s",
            description="Routed request duration, first byte in to last byte out",
            explicit_bucket_boundaries_advisory=_DURATION_BUCKETS,
        )
        self._attempt_duration = meter.create_histogram(
            "gateway.attempt.duration",
            unit="s",
            description="Upstream attempt duration, until response headers or failure",
            explicit_bucket_boundaries_advisory=_DURATION_BUCKETS,
        )
        self._transitions = meter.create_counter(
            "gateway.breaker.transitions",
            unit="{transition}",
            description="Breaker state changes, by upstream and new state",
        )
        self._shadows = meter.create_counter(
            "gateway.shadow.requests",
            unit="{request}",
            description="Shadow copies, by outcome (answered, failed, or why none was sent)",
        )
        self._shadow_duration = meter.create_histogram(
            "gateway.shadow.duration",
            unit="s",
            description="Shadow copy duration, request sent to answer read",
            explicit_bucket_boundaries_advisory=_DURATION_BUCKETS,
        )
        # This gateway's breakers (its own health state reports to it): no process globals,
        # so two Gateways in one process keep separate gauges.
        self._breaker_states: dict[str, str] = {}
        meter.create_observable_gauge(
            "gateway.breaker.state",
            callbacks=[self._observe_breakers],
            unit="{state}",
            description="Breaker state per upstream: 0 closed, 1 half-open, 2 open",
        )

    # --- hooks the walker calls -------------------------------------------------------

    def request_started(self, context: RequestContext) -> None:
        try:
            current = trace.get_current_span().get_span_context()
            if not current.is_valid and self._nothing_to_trace(context):
                context.trace = _Untraced()
                return
            if current.is_valid:
                # An instrumented host app already extracted the caller's context.
                incoming = otel_context.get_current()
                kind = trace.SpanKind.INTERNAL
            else:
                token = _EXTRACTING.set(True)
                try:
                    incoming = propagate.extract(context.forward_headers, getter=_GETTER)
                finally:
                    _EXTRACTING.reset(token)
                kind = trace.SpanKind.SERVER
            span = self._tracer.start_span(
                REQUEST_SPAN,
                context=incoming,
                kind=kind,
                attributes={
                    "gateway.route.id": _label(context.route.id),
                    "gateway.tenant": _label(context.tenant),
                    "http.request.method": _label(context.method),
                },
            )
            context.trace = _RequestTrace(
                span=span, parent=trace.set_span_in_context(span, incoming)
            )
        except Exception:  # telemetry must never break a request
            _internal.debug("request_started failed", exc_info=False)

    def attempt_started(self, context: RequestContext, attempt: AttemptRecord) -> None:
        try:
            if isinstance(context.trace, _Untraced):
                context.trace.attempts.append(attempt)
                return
            request = self._request_trace(context)
            if request is None:
                return
            attributes: dict[str, AttributeValue] = {
                "gateway.candidate": _label(attempt.candidate),
                "gateway.attempt.number": attempt.number,
                "server.address": _label(attempt.server_address),
            }
            if attempt.hedge:
                attributes["gateway.attempt.hedge"] = True
            if attempt.credential_index is not None:
                attributes["gateway.credential.index"] = attempt.credential_index
            span = self._tracer.start_span(
                ATTEMPT_SPAN,
                context=request.parent,
                kind=trace.SpanKind.CLIENT,
                attributes=attributes,
            )
            entry = _AttemptTrace(
                record=attempt,
                span=span,
                context=trace.set_span_in_context(span, request.parent),
            )
            # A task started after this (a hedge) copies the value: each attempt's
            # _attempt sees its own span. Cleared when the attempt ends.
            _current_attempt.set(entry)
            request.attempts.append(entry)
        except Exception:
            _internal.debug("attempt_started failed", exc_info=False)

    def attempt_finished(self, context: RequestContext, attempt: AttemptRecord) -> None:
        try:
            untraced = context.trace
            if isinstance(untraced, _Untraced):
                if any(a is attempt for a in untraced.attempts):
                    untraced.attempts.remove(attempt)
                self._attempt_metrics(context, attempt, attempt.failure_kind)
                return
            request = self._request_trace(context)
            if request is None:
                return
            entry = next((a for a in request.attempts if a.record is attempt), None)
            if entry is None:
                # attempt_started never ran for it: still record a (zero-length) span.
                self.attempt_started(context, attempt)
                entry = next((a for a in request.attempts if a.record is attempt), None)
                if entry is None:
                    return
            request.attempts.remove(entry)
            self._end_attempt(context, entry, cancelled=False)
        except Exception:
            _internal.debug("attempt_finished failed", exc_info=False)

    def skipped(self, context: RequestContext, candidate: str, reason: str) -> None:
        try:
            request = self._request_trace(context)
            attributes = {
                "gateway.candidate": _label(candidate),
                "gateway.skip.reason": _label(reason),
            }
            if request is not None:
                request.span.add_event(SKIP_EVENT, attributes)
            self._skips.add(1, {"gateway.route.id": _label(context.route.id), **attributes})
        except Exception:
            _internal.debug("skipped failed", exc_info=False)

    def shadow_started(self, context: RequestContext, candidate: str) -> trace.Span | None:
        """A `gateway.shadow` span for a copy of this request, a child of its request span
        (it may end after it). None when telemetry cannot make one."""
        try:
            request = self._request_trace(context)
            return self._tracer.start_span(
                SHADOW_SPAN,
                context=request.parent if request is not None else None,
                kind=trace.SpanKind.CLIENT,
                attributes={
                    "gateway.shadow": True,
                    "gateway.route.id": _label(context.route.id),
                    "gateway.candidate": _label(candidate),
                },
            )
        except Exception:
            _internal.debug("shadow_started failed", exc_info=False)
            return None

    def shadow_finished(
        self,
        span: trace.Span | None,
        route_id: str,
        candidate: str,
        outcome: str,
        status: int | None,
        duration: float,
        *,
        failure_kind: str | None = None,
    ) -> None:
        try:
            attributes: dict[str, AttributeValue] = {
                "gateway.shadow": True,
                "gateway.route.id": _label(route_id),
                "gateway.candidate": _label(candidate),
                "gateway.shadow.outcome": _label(outcome),
            }
            if status is not None:
                attributes["http.response.status_code"] = status
            if span is not None:
                if failure_kind is not None:
                    span.set_attribute("gateway.failure.kind", _label(failure_kind))
                span.set_attributes(attributes)
                span.end()
            self._shadows.add(1, attributes)
            if outcome in ("answered", "failed"):
                self._shadow_duration.record(max(duration, 0.0), attributes)
        except Exception:
            _internal.debug("shadow_finished failed", exc_info=False)

    def request_finished(self, context: RequestContext) -> None:
        try:
            self._finish(context)
        except Exception:
            _internal.debug("request_finished failed", exc_info=False)

    def inject_headers(self, headers: list[tuple[str, str]]) -> None:
        """Propagate the attempt span's context upstream: the caller's own `traceparent`
        (and `tracestate`, `baggage`) are replaced, never duplicated. Without an SDK the
        caller's context passes through unchanged."""
        try:
            entry = _current_attempt.get()
            ctx = entry.context if entry is not None else None
            propagator, fields, _ = self._propagation_fields()
            carrier: dict[str, str] = {}
            propagator.inject(carrier, context=ctx)
            if not carrier and entry is None:
                return  # no trace context of ours at all: leave the caller's untouched
            headers[:] = [(k, v) for k, v in headers if k.lower() not in fields]
            headers.extend(carrier.items())
        except Exception:
            _internal.debug("inject_headers failed", exc_info=False)

    def breaker_state(self, upstream: str, state: str) -> None:
        """Report an upstream's breaker state (`closed`, `half_open`/`half-open`, `open`);
        the health state calls it on every transition (again with the same state is
        harmless). Exported as the `gateway.breaker.state` gauge (0 closed, 1 half-open,
        2 open); each change counts in `gateway.breaker.transitions`. Never raises."""
        try:
            normalised = normalise_breaker_state(state)
            if normalised is None:
                return
            name = _label(upstream)
            previous = self._breaker_states.get(name)
            self._breaker_states[name] = normalised
            if previous != normalised:
                self._transitions.add(
                    1, {"gateway.upstream": name, "gateway.breaker.state": normalised}
                )
        except Exception:
            _internal.debug("breaker state not recorded", exc_info=False)

    def breaker_states(self) -> Mapping[str, str]:
        """The last reported state of each upstream's breaker (a copy)."""
        return dict(self._breaker_states)

    def _observe_breakers(self, options: metrics.CallbackOptions) -> Iterable[metrics.Observation]:
        return [
            metrics.Observation(_BREAKER_VALUES[state], {"gateway.upstream": upstream})
            for upstream, state in list(self._breaker_states.items())
        ]

    # --- internals --------------------------------------------------------------------

    def _propagation_fields(self) -> tuple[TextMapPropagator, frozenset[str], frozenset[bytes]]:
        """The global propagator and its field names (as str and header bytes), computed
        again only when another propagator is installed."""
        propagator = propagate.get_global_textmap()
        cached = self._propagation
        if cached is None or cached[0] is not propagator:
            names = frozenset(f.lower() for f in propagator.fields)
            cached = (propagator, names, frozenset(n.encode("latin-1") for n in names))
            self._propagation = cached
        return cached

    def _nothing_to_trace(self, context: RequestContext) -> bool:
        """No SDK behind the global tracer and no trace context from the caller: a span
        would record nothing and propagate nothing (the caller's headers pass unchanged
        either way), so the request skips span bookkeeping altogether."""
        if not self._global_tracer or not isinstance(
            trace.get_tracer_provider(), trace.ProxyTracerProvider | trace.NoOpTracerProvider
        ):
            return False
        fields = self._propagation_fields()[2]
        return not any(name in fields for name, _ in context.forward_headers)

    def _request_trace(self, context: RequestContext) -> _RequestTrace | None:
        request = context.trace
        return request if isinstance(request, _RequestTrace) else None

    def _end_attempt(
        self, context: RequestContext, entry: _AttemptTrace, *, cancelled: bool
    ) -> None:
        record = entry.record
        span = entry.span
        if _current_attempt.get() is entry:
            _current_attempt.set(None)
        kind = "cancelled" if cancelled and record.failure_kind is None else record.failure_kind
        attributes: dict[str, AttributeValue] = {}
        if record.status is not None:
            attributes["http.response.status_code"] = record.status
        if kind is not None:
            attributes["gateway.failure.kind"] = kind
            attributes["error.type"] = (
                str(record.status) if kind == "status" and record.status is not None else kind
            )
        if record.fault is not None:
            attributes["gateway.fault"] = _label(record.fault)
        span.set_attributes(attributes)
        if kind is not None and kind != "cancelled":
            span.set_status(trace.Status(trace.StatusCode.ERROR, kind))
        span.end()
        self._attempt_metrics(context, record, kind)

    def _attempt_metrics(
        self, context: RequestContext, record: AttemptRecord, kind: str | None
    ) -> None:
        metric: dict[str, AttributeValue] = {
            "gateway.route.id": _label(context.route.id),
            "gateway.candidate": _label(record.candidate),
            "gateway.failure.kind": kind or "none",
            "gateway.fault": record.fault is not None,
            "gateway.canary": context.canary,
        }
        if record.status is not None:
            metric["http.response.status_code"] = record.status
        self._attempts.add(1, metric)
        duration = record.duration
        if duration is None:
            duration = time.monotonic() - record.started
        self._attempt_duration.record(max(duration, 0.0), metric)

    def _finish(self, context: RequestContext) -> None:
        request = context.trace
        if request is _FINISHED:
            return  # finished once already: recorded once
        context.trace = _FINISHED
        duration = max(time.monotonic() - context.started, 0.0)
        outcome = context.outcome or ("served" if context.completed else "internal_error")
        candidates = [_label(c) for c in (context.candidates or context.route.plan)]
        chosen = _label(context.chosen) if context.chosen is not None else None
        fault = any(a.fault for a in context.attempts) or context.pinned is not None
        route_id = _label(context.route.id)

        trace_id = span_id = None
        if isinstance(request, _Untraced):
            for record in list(reversed(request.attempts)):  # cancelled mid-flight
                kind = "cancelled" if record.failure_kind is None else record.failure_kind
                self._attempt_metrics(context, record, kind)
        if isinstance(request, _RequestTrace):
            # An attempt cancelled mid-flight (client gone) never reached attempt_finished.
            for entry in list(reversed(request.attempts)):
                self._end_attempt(context, entry, cancelled=True)
            request.attempts.clear()
            span = request.span
            attributes: dict[str, AttributeValue] = {
                "gateway.plan.candidates": candidates,
                "gateway.attempts": context.attempt_count,
                "gateway.fallback": context.fallback,
                "gateway.canary": context.canary,
                "gateway.outcome": _label(outcome),
            }
            if chosen is not None:
                attributes["gateway.plan.chosen"] = chosen
            if context.pinned is not None:
                attributes["gateway.pinned"] = _label(context.pinned)
            if fault:
                attributes["gateway.fault"] = True
            if context.skipped:
                attributes["gateway.skipped"] = len(context.skipped)
            if context.status is not None:
                attributes["http.response.status_code"] = context.status
            model = _model(context.request_model)
            if model is not None:
                attributes["gen_ai.request.model"] = model
            usage = context.usage
            if usage is not None:
                if usage.input_tokens is not None:
                    attributes["gen_ai.usage.input_tokens"] = int(usage.input_tokens)
                if usage.output_tokens is not None:
                    attributes["gen_ai.usage.output_tokens"] = int(usage.output_tokens)
                response_model = _model(usage.model)
                if response_model is not None:
                    attributes["gen_ai.response.model"] = response_model
            if outcome != "served":
                attributes["error.type"] = _label(outcome)
                if outcome not in _QUIET_OUTCOMES:
                    span.set_status(trace.Status(trace.StatusCode.ERROR, _label(outcome)))
            span.set_attributes(attributes)
            span.end()
            span_context = span.get_span_context()
            if span_context.is_valid:
                trace_id = trace.format_trace_id(span_context.trace_id)
                span_id = trace.format_span_id(span_context.span_id)

        common: dict[str, AttributeValue] = {
            "gateway.route.id": route_id,
            "gateway.outcome": _label(outcome),
            "gateway.fallback": context.fallback,
            "gateway.canary": context.canary,
            "gateway.fault": fault,
        }
        self._requests.add(1, {**common, "gateway.candidate": chosen or "none"})
        self._duration.record(duration, common)
        if context.fallback and chosen is not None:
            self._fallbacks.add(
                1,
                {
                    "gateway.route.id": route_id,
                    "gateway.candidate": chosen,
                    "gateway.primary": candidates[0] if candidates else "none",
                    "gateway.outcome": _label(outcome),
                    "gateway.canary": context.canary,
                    "gateway.fault": fault,
                },
            )
        self._log(context, outcome, candidates, chosen, fault, duration, trace_id, span_id)

    def _log(
        self,
        context: RequestContext,
        outcome: str,
        candidates: list[str],
        chosen: str | None,
        fault: bool,
        duration: float,
        trace_id: str | None,
        span_id: str | None,
    ) -> None:
        # Failovers (a further attempt, or a fallback served) and local errors are WARNING:
        # Python's default logging shows them under any host. Every other request's line is
        # INFO, off unless the host turns it on (docs/telemetry.md).
        quiet = outcome in _QUIET_OUTCOMES and context.attempt_count <= 1 and not context.fallback
        level = logging.INFO if quiet else logging.WARNING
        if not logger.isEnabledFor(level):
            return
        duration_ms = round(duration * 1000, 1)
        fields: dict[str, Any] = {
            "route": _label(context.route.id),
            "tenant": _label(context.tenant),
            "method": _label(context.method),
            "candidates": candidates,
            "chosen": chosen,
            "attempts": context.attempt_count,
            "attempt_candidates": [_label(a.candidate) for a in context.attempts],
            "skipped": [_label(s.candidate) for s in context.skipped],
            "outcome": _label(outcome),
            "status": context.status,
            "fallback": context.fallback,
            "canary": context.canary,
            "fault": fault,
            "duration_ms": duration_ms,
            "request_id": context.request_id,
            "trace_id": trace_id,
            "span_id": span_id,
        }
        logger.log(
            level,
            "gateway request route=%s outcome=%s status=%s chosen=%s attempts=%d "
            "candidates=%s duration_ms=%.1f",
            fields["route"],
            fields["outcome"],
            context.status if context.status is not None else "-",
            chosen or "-",
            context.attempt_count,
            ",".join(candidates) or "-",
            duration_ms,
            extra=fields,
        )


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("fallback_mw")
    except Exception:
        return "0"


__all__ = [
    "ATTEMPT_SPAN",
    "REQUEST_SPAN",
    "SKIP_EVENT",
    "Telemetry",
]
