"""The Telemetry class: the hooks the walker calls (see the package docstring)."""

from __future__ import annotations

import contextlib
import logging
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.util.types import AttributeValue

from fallback_mw.config import ConfigError, RouteConfig
from fallback_mw.extras import package_version
from fallback_mw.injected import require
from fallback_mw.python_class import python_class
from fallback_mw.request.context import AttemptRecord, RequestContext
from fallback_mw.telemetry.breakers import BreakerReports
from fallback_mw.telemetry.genai import operation_name
from fallback_mw.telemetry.instruments import Instruments, never_idle
from fallback_mw.telemetry.propagation import (
    PROPAGATORS_REFUSED,
    TracePropagation,
    current_attempt,
    extract,
    without_secret_baggage,
    without_secret_trace_state,
)
from fallback_mw.telemetry.redact import (
    EXTRACTING,
    MAX_LABEL,
    http_method,
    label,
    quiet_propagators,
    tenant_label,
)
from fallback_mw.telemetry.request_log import QUIET_OUTCOMES, log_request
from fallback_mw.telemetry.spans import (
    AttemptTrace,
    RequestTrace,
    Untraced,
    decision_attributes,
    entry_of,
    request_span_attributes,
)

INSTRUMENTATION_NAME = "fallback_mw"
REQUEST_SPAN = "gateway.request"
ATTEMPT_SPAN = "gateway.attempt"
SKIP_EVENT = "gateway.candidate.skipped"
ABORT_EVENT = "gateway.response.aborted"
SHADOW_SPAN = "gateway.shadow"

_internal = logging.getLogger("fallback_mw.telemetry")

# Marks a request whose telemetry was finished: a second request_finished records nothing.
_FINISHED = object()


@python_class  # weakly referenced: a Python class under mypyc
class Telemetry(BreakerReports, TracePropagation):
    """The walker's one telemetry seam. Every hook is safe to call and never raises.

    `tracer_provider` / `meter_provider` default to the global ones (the host app's SDK,
    or no-ops). Tests pass their own providers."""

    def __init__(
        self,
        *,
        tracer_provider: trace.TracerProvider | None = None,
        meter_provider: metrics.MeterProvider | None = None,
    ) -> None:
        if PROPAGATORS_REFUSED is not None:
            raise ConfigError(PROPAGATORS_REFUSED)
        # Checked here, not at the first span: a wrong object failed every request with an
        # AttributeError far from the mistake (or, for a meter provider, this constructor).
        require(
            tracer_provider, trace.TracerProvider, parameter="tracer_provider", owner="Telemetry"
        )
        require(
            meter_provider, metrics.MeterProvider, parameter="meter_provider", owner="Telemetry"
        )
        quiet_propagators()
        version = package_version()
        # With the global provider, spans are only recorded once an SDK is installed (serve
        # installs it after building the gateway): until then a request costs no span work.
        self._global_tracer = tracer_provider is None
        self._propagation = None
        tracer_provider = tracer_provider or trace.get_tracer_provider()
        meter_provider = meter_provider or metrics.get_meter_provider()
        self.meter_provider = meter_provider  # shared with the health state it reports on
        self._tracer = tracer_provider.get_tracer(INSTRUMENTATION_NAME, version)
        meter = meter_provider.get_meter(INSTRUMENTATION_NAME, version)
        self._m = Instruments(meter, idle=_unset_global_meter_provider(meter_provider))
        # A gateway dropped with counts its tallies hold gives them to the counters (the
        # next collection reads them), as `add` would have.
        weakref.finalize(self, self._m.flush)
        self._start_breaker_reports(meter)

    # --- hooks the walker calls -------------------------------------------------------

    def request_started(
        self, context: RequestContext, headers: Sequence[tuple[bytes, bytes]] | None = None
    ) -> None:
        """Start the request span. `headers` are the caller's (the W3C trace context is read
        from them); by default the cleaned ones the walker forwards."""
        try:
            if headers is None:
                headers = context.forward_headers
            current = trace.get_current_span().get_span_context()
            if not current.is_valid and self._nothing_to_trace(headers):
                context.trace = Untraced()
                return
            if current.is_valid:
                # An instrumented host app already extracted the caller's context.
                incoming = otel_context.get_current()
                kind = trace.SpanKind.INTERNAL
            else:
                token = EXTRACTING.set(True)
                try:
                    incoming = extract(headers)
                finally:
                    EXTRACTING.reset(token)
                kind = trace.SpanKind.SERVER
            # What the spans carry and the attempts propagate upstream (the host's
            # extraction too): no trace state or baggage entry holding a credential.
            incoming = without_secret_trace_state(incoming, context.secrets)
            incoming = without_secret_baggage(incoming, context.secrets)
            method, original = http_method(
                context.method, context.route.accepted_methods, context.secrets
            )
            attributes: dict[str, AttributeValue] = {
                "gateway.route.id": label(context.route.id),
                "gateway.tenant": tenant_label(context.tenant, context.secrets),
                "http.request.method": method,
            }
            if original is not None:
                attributes["http.request.method_original"] = original
            span = self._tracer.start_span(
                REQUEST_SPAN,
                context=incoming,
                kind=kind,
                attributes=_genai(attributes, context, None),
            )
            context.trace = RequestTrace(
                span=span, parent=trace.set_span_in_context(span, incoming)
            )
        except Exception:  # telemetry must never break a request
            _internal.debug("request_started failed", exc_info=False)

    def attempt_started(self, context: RequestContext, attempt: AttemptRecord) -> None:
        try:
            if isinstance(context.trace, Untraced):
                context.trace.attempts.append(attempt)
                return
            request = self._request_trace(context)
            if request is None:
                return
            attributes: dict[str, AttributeValue] = {
                "gateway.candidate": label(attempt.candidate),
                "gateway.attempt.number": attempt.number,
                "server.address": label(attempt.server_address),
            }
            if attempt.server_port is not None:
                attributes["server.port"] = attempt.server_port
            if attempt.hedge:
                attributes["gateway.attempt.hedge"] = True
            if attempt.credential_index is not None:
                attributes["gateway.credential.index"] = attempt.credential_index
            _genai(attributes, context, attempt.candidate)
            span = self._tracer.start_span(
                ATTEMPT_SPAN,
                context=request.parent,
                kind=trace.SpanKind.CLIENT,
                attributes=attributes,
            )
            entry = AttemptTrace(
                record=attempt,
                span=span,
                context=trace.set_span_in_context(span, request.parent),
            )
            # A task started after this (a hedge) copies the value: each attempt's
            # _attempt sees its own span. Cleared when the attempt ends.
            current_attempt.set(entry)
            request.attempts.append(entry)
        except Exception:
            _internal.debug("attempt_started failed", exc_info=False)

    def attempt_finished(self, context: RequestContext, attempt: AttemptRecord) -> None:
        try:
            untraced = context.trace
            if isinstance(untraced, Untraced):
                attempts = untraced.attempts
                for index, started in enumerate(attempts):
                    if started is attempt:
                        del attempts[index]
                        break
                self._m.attempt(context, attempt, attempt.failure_kind)
                return
            request = self._request_trace(context)
            if request is None:
                return
            entry = entry_of(request.attempts, attempt)
            if entry is None:
                # attempt_started never ran for it: still record a (zero-length) span.
                self.attempt_started(context, attempt)
                entry = entry_of(request.attempts, attempt)
                if entry is None:
                    return
            request.attempts.remove(entry)
            self._end_attempt(context, entry, cancelled=False, request=request)
        except Exception:
            _internal.debug("attempt_finished failed", exc_info=False)

    def attempt_decided(self, context: RequestContext, attempt: AttemptRecord) -> None:
        """The walk decided what follows `attempt` (its record's `decision` and `reason`):
        its span, finished already, gets them and ends at the time it finished."""
        try:
            request = self._request_trace(context)
            if request is None:
                return
            entry = entry_of(request.undecided, attempt)
            if entry is None:
                return
            request.undecided.remove(entry)
            _end_decided(entry)
        except Exception:
            _internal.debug("attempt_decided failed", exc_info=False)

    def skipped(
        self, context: RequestContext, candidate: str, reason: str, *, fault: str | None = None
    ) -> None:
        """A skipped candidate; `fault` names the game-day fault whose outcomes opened the
        breaker behind a `breaker_open` skip (the span event carries it)."""
        try:
            request = self._request_trace(context)
            attributes: dict[str, AttributeValue] = {
                "gateway.candidate": label(candidate),
                "gateway.skip.reason": label(reason),
            }
            if request is not None:
                event = dict(attributes)
                if fault is not None:
                    event["gateway.fault"] = label(fault)
                request.span.add_event(SKIP_EVENT, event)
            self._m.skips.add(
                1,
                {
                    "gateway.route.id": label(context.route.id),
                    **attributes,
                    "gateway.fault": fault is not None,
                },
            )
        except Exception:
            _internal.debug("skipped failed", exc_info=False)

    def response_aborted(self, context: RequestContext, attempt: AttemptRecord) -> None:
        """The response of `attempt` failed after the commit point (the abort path only).
        Its `gateway.attempt` span ended at the head, so the request span carries an event
        naming the attempt, how it failed and the rule that allowed no failover."""
        try:
            request = self._request_trace(context)
            if request is None:
                return
            request.span.add_event(
                ABORT_EVENT,
                {
                    "gateway.candidate": label(attempt.candidate),
                    "gateway.attempt.number": attempt.number,
                    "gateway.failure.kind": label(attempt.failure_kind),
                    "gateway.rule": label(context.rule),
                },
            )
        except Exception:
            _internal.debug("response_aborted failed", exc_info=False)

    def shadow_started(self, context: RequestContext, candidate: str) -> trace.Span | None:
        """A `gateway.shadow` span for a copy of this request, a child of its request span
        (it may end after it). None when telemetry cannot make one."""
        try:
            request = self._request_trace(context)
            attributes: dict[str, AttributeValue] = {
                "gateway.shadow": True,
                "gateway.route.id": label(context.route.id),
                "gateway.candidate": label(candidate),
            }
            upstream = context.upstreams.get(candidate)
            if upstream is not None:  # a CLIENT span names its server, as an attempt's does
                attributes["server.address"] = label(upstream.host)
                attributes["server.port"] = upstream.port
            return self._tracer.start_span(
                SHADOW_SPAN,
                context=request.parent if request is not None else None,
                kind=trace.SpanKind.CLIENT,
                attributes=attributes,
            )
        except Exception:
            _internal.debug("shadow_started failed", exc_info=False)
            return None

    def shadow_parent(self, context: RequestContext) -> otel_context.Context | None:
        """The request's trace context (the caller's, baggage included) for a copy that
        runs after the request's telemetry has finished: `shadow_scope`'s `parent`."""
        request = self._request_trace(context)
        return request.parent if request is not None else None

    @contextlib.contextmanager
    def shadow_scope(
        self, span: trace.Span | None, parent: otel_context.Context | None = None
    ) -> Iterator[None]:
        """Within it (a shadow copy's own task), `span` is this task's current span and no
        attempt is: the copy propagates its `gateway.shadow` span's context upstream, not
        the caller's `traceparent`, with the caller's `baggage` of `parent` (the request's
        context, `shadow_parent`) as an attempt does."""
        if span is None:
            yield
            return
        attempt = current_attempt.set(None)
        token = otel_context.attach(trace.set_span_in_context(span, parent))
        try:
            yield
        finally:
            otel_context.detach(token)
            current_attempt.reset(attempt)

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
                "gateway.route.id": label(route_id),
                "gateway.candidate": label(candidate),
                "gateway.shadow.outcome": label(outcome),
            }
            if status is not None:
                attributes["http.response.status_code"] = status
            if span is not None:
                if failure_kind is not None:
                    span.set_attribute("gateway.failure.kind", label(failure_kind))
                span.set_attributes(attributes)
                if outcome == "failed":  # as a failed attempt's span
                    kind = label(failure_kind or "failed")
                    error = str(status) if kind == "status" and status is not None else kind
                    span.set_attribute("error.type", error)
                    span.set_status(trace.Status(trace.StatusCode.ERROR, kind))
                elif status is not None and status >= 500:  # as an attempt's 5xx answer
                    span.set_attribute("error.type", str(status))
                    span.set_status(trace.Status(trace.StatusCode.ERROR, str(status)))
                span.end()
            self._m.shadows.add(1, attributes)
            if outcome in ("answered", "failed"):
                self._m.shadow_duration.record(max(duration, 0.0), attributes)
        except Exception:
            _internal.debug("shadow_finished failed", exc_info=False)

    def request_finished(self, context: RequestContext) -> None:
        try:
            self._finish(context)
        except Exception:
            _internal.debug("request_finished failed", exc_info=False)

    def request(
        self, context: RequestContext, headers: Sequence[tuple[bytes, bytes]] | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """The request span (and its metrics and log line) around a layer's work, unless a
        layer in front already owns it: the resolver opens it, so it covers the request
        from the route match to the budget settlement; a layer used alone opens its own."""
        if context.trace is not None:
            return _NOT_OURS
        return _RequestScope(self, context, headers)

    def routes_loaded(self, routes: Iterable[RouteConfig]) -> None:
        """The routes this gateway serves now (at start, and after each store reload): each
        route's fallback series, its local error series, its candidates' skip series, and
        the breaker transition series of each upstream they use, are exported at 0 from
        the start, so the first fallback (error, skip, transition) is an increase. Never
        raises."""
        try:
            upstreams: dict[str, None] = {}
            for route in routes:
                self._m.fallbacks_at_zero(route.id, route.plan)
                self._m.errors_at_zero(route.id)
                self._m.skips_at_zero(route.id, route.plan)
                upstreams.update(dict.fromkeys(route.plan))
                if route.shadow is not None:
                    upstreams[route.shadow] = None
            for upstream in upstreams:
                self._m.transitions_at_zero(upstream)
        except Exception:
            _internal.debug("fallback series not started", exc_info=False)

    def series_at_zero(self, counter: metrics.Counter) -> None:
        """A counter of a piece beside the gateway, made on this Telemetry's meter provider
        (the Redis state's `gateway.health.local_fallbacks`, the route store's
        `gateway.store.reload_refused`), exported at 0 from the start as the gateway's own
        are: one made before the host installed its SDK is added again at the first
        collection. Never raises."""
        try:
            self._m.at_zero(counter, {})
        except Exception:
            _internal.debug("zero series not started", exc_info=False)

    # --- internals --------------------------------------------------------------------

    def _request_trace(self, context: RequestContext) -> RequestTrace | None:
        request = context.trace
        return request if isinstance(request, RequestTrace) else None

    def _end_attempt(
        self,
        context: RequestContext,
        entry: AttemptTrace,
        *,
        cancelled: bool,
        request: RequestTrace | None = None,
    ) -> None:
        """Finish the attempt's span and metrics. Its span ends now when the walk's decision
        about it is known (or it was cancelled); else it waits in `request.undecided` for
        attempt_decided (or the request's end), keeping this moment as its end time."""
        record = entry.record
        span = entry.span
        if current_attempt.get() is entry:
            current_attempt.set(None)
        kind = "cancelled" if cancelled and record.failure_kind is None else record.failure_kind
        attributes: dict[str, AttributeValue] = {}
        if record.status is not None:
            attributes["http.response.status_code"] = record.status
        if kind is not None:
            attributes["gateway.failure.kind"] = kind
            attributes["error.type"] = (
                str(record.status) if kind == "status" and record.status is not None else kind
            )
        elif record.status is not None and record.status >= 500:
            # A server error outside failover_status: an answer (no failure kind, no
            # breaker mark), but OpenTelemetry's HTTP client convention makes the span an
            # error, as the request span relaying it is: a trace's error spans lead to the
            # upstream that answered 500, not only to the request.
            attributes["error.type"] = str(record.status)
            span.set_status(trace.Status(trace.StatusCode.ERROR, str(record.status)))
        if record.fault is not None:
            attributes["gateway.fault"] = label(record.fault)
        entry.ended = attributes  # set when the span ends (_end_decided)
        if kind is not None and kind != "cancelled":
            span.set_status(trace.Status(trace.StatusCode.ERROR, kind))
        if request is not None and record.decision is None:
            entry.finished_at = time.time_ns()
            request.undecided.append(entry)
        else:
            _end_decided(entry)
        self._m.attempt(context, record, kind)

    def _finish(self, context: RequestContext) -> None:
        request = context.trace
        if request is _FINISHED:
            return  # finished once already: recorded once
        context.trace = _FINISHED
        duration = max(time.monotonic() - context.started, 0.0)
        outcome = context.outcome or ("served" if context.completed else "internal_error")
        # `label`, its usual case written out (an upstream name already a short printable
        # label is its own): a call per candidate on every request.
        candidates = [
            c if c.isascii() and c.isprintable() and len(c) <= MAX_LABEL else label(c)
            for c in (context.candidates or context.route.plan)
        ]
        chosen = context.chosen
        if chosen is not None and not (
            chosen.isascii() and chosen.isprintable() and len(chosen) <= MAX_LABEL
        ):
            chosen = label(chosen)
        fault = context.fault  # a pin, a faulted attempt, a fault-opened breaker

        trace_id = span_id = None
        if isinstance(request, Untraced):
            for record in list(reversed(request.attempts)):  # cancelled mid-flight
                kind = "cancelled" if record.failure_kind is None else record.failure_kind
                self._m.attempt(context, record, kind)
        if isinstance(request, RequestTrace):
            # An attempt cancelled mid-flight (client gone) never reached attempt_finished.
            for entry in list(reversed(request.attempts)):
                self._end_attempt(context, entry, cancelled=True)
            request.attempts.clear()
            # Finished attempts whose decision never came (the walk was cut short): their
            # own end time, with whatever decision their record holds.
            for entry in request.undecided:
                _end_decided(entry)
            request.undecided.clear()
            span = request.span
            attributes = request_span_attributes(context, outcome, candidates, chosen, fault)
            _genai(attributes, context, chosen)
            if outcome != "served":
                attributes["error.type"] = label(outcome)
                if outcome not in QUIET_OUTCOMES:
                    span.set_status(trace.Status(trace.StatusCode.ERROR, label(outcome)))
            elif context.status is not None and context.status >= 500:
                # An upstream's 5xx served as it is: OpenTelemetry's HTTP server convention
                # (the client got a server error), the status code as error.type.
                attributes["error.type"] = str(context.status)
                span.set_status(trace.Status(trace.StatusCode.ERROR, str(context.status)))
            span.set_attributes(attributes)
            span.end()
            span_context = span.get_span_context()
            if span_context.is_valid:
                trace_id = trace.format_trace_id(span_context.trace_id)
                span_id = trace.format_span_id(span_context.span_id)

        self._m.request(context, outcome, candidates, chosen, fault, duration)
        log_request(context, outcome, candidates, chosen, fault, duration, trace_id, span_id)


class _RequestScope:
    """`Telemetry.request`'s scope for the layer that owns the request span (a class, not
    a generator: it runs once per request)."""

    __slots__ = ("context", "headers", "telemetry")

    def __init__(
        self,
        telemetry: Telemetry,
        context: RequestContext,
        headers: Sequence[tuple[bytes, bytes]] | None,
    ) -> None:
        self.telemetry = telemetry
        self.context = context
        self.headers = headers

    def __enter__(self) -> None:
        self.telemetry.request_started(self.context, self.headers)

    def __exit__(self, *exc_info: object) -> None:
        self.telemetry.request_finished(self.context)


_NOT_OURS = contextlib.nullcontext()


_MISSING = object()


def _unset_global_meter_provider(provider: metrics.MeterProvider) -> Callable[[], bool]:
    """For instruments made from the global meter provider while none is installed (the
    OTel API's proxy): whether that is still so. Until an SDK is installed, a recording
    goes nowhere, so the per-request attribute work is skipped. Any other provider: never
    idle. (The proxy is recognised by its class name: should the API rename it, every
    recording is made, as before.)"""
    if type(provider).__name__ != "_ProxyMeterProvider":
        return never_idle
    internal = getattr(metrics, "_internal", None)
    if internal is None or getattr(internal, "_METER_PROVIDER", _MISSING) is not None:
        return lambda: metrics.get_meter_provider() is provider
    # The API's global, set once and never unset (`set_meter_provider`), read as it is:
    # `get_meter_provider()` looks up an environment variable on every call while unset.
    return lambda: internal._METER_PROVIDER is None


def _end_decided(entry: AttemptTrace) -> None:
    """End an attempt's span with the walk's decision about it, at the time the attempt
    finished (now, when it was not kept waiting for the decision)."""
    attributes = entry.ended or {}
    attributes.update(decision_attributes(entry.record))
    if attributes:
        entry.span.set_attributes(attributes)
    entry.span.end(end_time=entry.finished_at)


def _genai(
    attributes: dict[str, AttributeValue], context: RequestContext, candidate: str | None
) -> dict[str, AttributeValue]:
    """GenAI semantic-convention attributes (telemetry/genai.py): the operation read from
    the path, the provider the candidate declares."""
    operation = operation_name(context.path)
    if operation is not None:
        attributes["gen_ai.operation.name"] = operation
    upstream = context.upstreams.get(candidate) if candidate is not None else None
    if upstream is not None and upstream.provider is not None:
        attributes["gen_ai.provider.name"] = upstream.provider
    return attributes


__all__ = [
    "ABORT_EVENT",
    "ATTEMPT_SPAN",
    "REQUEST_SPAN",
    "SKIP_EVENT",
    "Telemetry",
]
