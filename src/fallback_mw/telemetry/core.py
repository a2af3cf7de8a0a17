"""The Telemetry class: the hooks the walker calls (see the package docstring)."""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence

from opentelemetry import baggage as otel_baggage
from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.propagators.textmap import TextMapPropagator
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from fallback_mw.config import ConfigError, RouteConfig
from fallback_mw.extras import package_version
from fallback_mw.injected import require
from fallback_mw.request.context import AttemptRecord, RequestContext
from fallback_mw.request.secrets import RequestSecrets
from fallback_mw.telemetry.genai import operation_name
from fallback_mw.telemetry.instruments import Instruments, never_idle
from fallback_mw.telemetry.redact import (
    EXTRACTING,
    GETTER,
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
    request_span_attributes,
)

try:
    from opentelemetry import propagate
except ValueError as refused:
    # OTEL_PROPAGATORS names a propagator that is not installed or is misspelled (`b3`
    # without its package, `bagage`): the API refuses at import. Importing fallback_mw (and
    # every `fallback-mw` command) must not die on it in a traceback; a gateway refuses to
    # start with one line saying so (Telemetry below).
    _PROPAGATORS_REFUSED: str | None = (
        f"OTEL_PROPAGATORS: {refused} Install the package that provides it (b3: "
        "opentelemetry-propagator-b3, jaeger: opentelemetry-propagator-jaeger) or fix the "
        "name; tracecontext,baggage is the default"
    )
else:
    _PROPAGATORS_REFUSED = None

INSTRUMENTATION_NAME = "fallback_mw"
REQUEST_SPAN = "gateway.request"
ATTEMPT_SPAN = "gateway.attempt"
SKIP_EVENT = "gateway.candidate.skipped"
ABORT_EVENT = "gateway.response.aborted"
SHADOW_SPAN = "gateway.shadow"

_internal = logging.getLogger("fallback_mw.telemetry")

_BREAKER_VALUES = {"closed": 0, "half_open": 1, "open": 2}

# The attempt span in flight in this task, so `inject_headers` (called with the attempt's
# header list only) can propagate its context. Set in attempt_started, cleared after.
_current_attempt: contextvars.ContextVar[AttemptTrace | None] = contextvars.ContextVar(
    "fallback_mw_current_attempt", default=None
)


# The global propagator, its field names as str and as header bytes, and whether it is
# made of the W3C propagators only.
_Propagation = tuple[TextMapPropagator, frozenset[str], frozenset[bytes], bool]
_W3C_PROPAGATORS = (TraceContextTextMapPropagator, W3CBaggagePropagator)

# Marks a request whose telemetry was finished: a second request_finished records nothing.
_FINISHED = object()

# Every live Telemetry, for the breaker gauge (Telemetry._observe_breakers).
_LIVE: weakref.WeakSet[Telemetry] = weakref.WeakSet()


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
        if _PROPAGATORS_REFUSED is not None:
            raise ConfigError(_PROPAGATORS_REFUSED)
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
        self._propagation: _Propagation | None = None
        tracer_provider = tracer_provider or trace.get_tracer_provider()
        meter_provider = meter_provider or metrics.get_meter_provider()
        self.meter_provider = meter_provider  # shared with the health state it reports on
        self._tracer = tracer_provider.get_tracer(INSTRUMENTATION_NAME, version)
        meter = meter_provider.get_meter(INSTRUMENTATION_NAME, version)
        self._m = Instruments(meter, idle=_unset_global_meter_provider(meter_provider))
        # A gateway dropped with counts its tallies hold gives them to the counters (the
        # next collection reads them), as `add` would have.
        weakref.finalize(self, self._m.flush)
        # This gateway's breakers (its own health state reports to it), so two Gateways on
        # two meter providers keep separate gauges. On one provider (the host's global one)
        # the SDK keeps the first gateway's gauge and drops a second registration's
        # callback: each gauge callback reports every live gateway on its provider.
        self._breaker_states: dict[str, str] = {}
        _LIVE.add(self)
        # The upstreams each gateway reporting here serves (only_upstreams): its file's,
        # or with a route store those it still serves after the last reload.
        self._serving: list[Callable[[], Collection[str]]] = []
        meter.create_observable_gauge(
            "gateway.breaker.state",
            callbacks=[self._observe_breakers],
            unit="{state}",
            description="Breaker state per upstream: 0 closed, 1 half-open, 2 open",
        )

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
                    incoming = propagate.extract(headers, getter=GETTER)
                finally:
                    EXTRACTING.reset(token)
                kind = trace.SpanKind.SERVER
            # What the spans carry and the attempts propagate upstream (the host's
            # extraction too): no trace state or baggage entry holding a credential.
            incoming = _without_secret_trace_state(incoming, context.secrets)
            incoming = _without_secret_baggage(incoming, context.secrets)
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
            _current_attempt.set(entry)
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
            entry = next((a for a in request.attempts if a.record is attempt), None)
            if entry is None:
                # attempt_started never ran for it: still record a (zero-length) span.
                self.attempt_started(context, attempt)
                entry = next((a for a in request.attempts if a.record is attempt), None)
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
            entry = next((a for a in request.undecided if a.record is attempt), None)
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
        attempt = _current_attempt.set(None)
        token = otel_context.attach(trace.set_span_in_context(span, parent))
        try:
            yield
        finally:
            otel_context.detach(token)
            _current_attempt.reset(attempt)

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

    def inject_headers(self, headers: list[tuple[str, str]]) -> None:
        """Propagate the attempt span's context upstream: the caller's own `traceparent`
        (and `tracestate`, `baggage`) are replaced, never duplicated. Without an SDK the
        caller's context passes through unchanged."""
        try:
            entry = _current_attempt.get()
            propagator, fields, _, quiet = self._propagation_fields()
            if entry is None and quiet and not otel_context.get_current():
                return  # no span, no baggage: W3C propagators would write nothing
            ctx = entry.context if entry is not None else None
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
            name = label(upstream)
            previous = self._breaker_states.get(name)
            self._breaker_states[name] = normalised
            if previous != normalised:
                self._m.transitions.add(
                    1, {"gateway.upstream": name, "gateway.breaker.state": normalised}
                )
        except Exception:
            _internal.debug("breaker state not recorded", exc_info=False)

    def breaker_seen(self, upstream: str, state: str) -> None:
        """A shared breaker's state that another process moved it to (Redis state): the
        gauge follows it, `gateway.breaker.transitions` does not count it, so that summed
        over every process each transition counts once. Never raises."""
        try:
            normalised = normalise_breaker_state(state)
            if normalised is not None:
                self._breaker_states[label(upstream)] = normalised
        except Exception:
            _internal.debug("breaker state not recorded", exc_info=False)

    def breaker_states(self) -> Mapping[str, str]:
        """The last reported state of each upstream's breaker (a copy)."""
        return dict(self._breaker_states)

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

    def only_upstreams(self, serving: Callable[[], Collection[str]]) -> None:
        """Report the breaker gauge for the upstreams `serving()` names (a gateway calls it
        once; two gateways sharing this Telemetry report both sets): each from the start,
        0 (closed) until its breaker moves (SPEC §9: breaker state is a metric, and a
        healthy gateway had no series at all); and only those: when a route store reload
        drops an upstream, its series goes, so an open breaker of a removed upstream does
        not keep FallbackMwBreakerOpen firing until a restart. Its last state is kept: an
        upstream added back reports it again."""
        self._serving.append(serving)

    def _serving_labels(self) -> set[str] | None:
        """The labels of the upstreams `only_upstreams` names; None: report every one."""
        if not self._serving:
            return None
        try:
            return {label(name) for serving in self._serving for name in serving()}
        except Exception:
            _internal.debug("serving upstreams not read", exc_info=False)
            return None

    def _observe_breakers(self, options: metrics.CallbackOptions) -> Iterable[metrics.Observation]:
        """The breakers of every live gateway whose instruments are on this one's meter
        provider (the one registration of the gauge the SDK kept reports them all), after
        adding their tallied counts to the counters; an
        upstream name two of them use reports its worst state. A gateway reports the
        upstreams it serves (`only_upstreams`), a breaker that never moved as closed."""
        provider = _resolved(self.meter_provider)
        values: dict[str, int] = {}
        for telemetry in list(_LIVE):
            if telemetry is not self and _resolved(telemetry.meter_provider) is not provider:
                continue
            # Every collection runs the callbacks before it reads the counters: the counts
            # the tallies hold (instruments.Tally) are added now, and read in this one.
            telemetry._m.flush()
            serving = telemetry._serving_labels()
            for upstream, state in list(telemetry._breaker_states.items()):
                if serving is None or upstream in serving:
                    values[upstream] = max(values.get(upstream, 0), _BREAKER_VALUES[state])
            for upstream in serving or ():
                values.setdefault(upstream, _BREAKER_VALUES["closed"])  # never moved yet
        return [
            metrics.Observation(value, {"gateway.upstream": upstream})
            for upstream, value in values.items()
        ]

    # --- internals --------------------------------------------------------------------

    def _propagation_fields(self) -> _Propagation:
        """The global propagator, its field names (as str and header bytes) and whether
        it is made of the W3C propagators only (which inject nothing from an empty
        context), computed again only when another propagator is installed."""
        propagator = propagate.get_global_textmap()
        cached = self._propagation
        if cached is None or cached[0] is not propagator:
            names = frozenset(f.lower() for f in propagator.fields)
            parts = (
                getattr(propagator, "_propagators", None)
                if type(propagator) is CompositePropagator
                else (propagator,)
            )
            quiet = parts is not None and all(type(p) in _W3C_PROPAGATORS for p in parts)
            cached = (propagator, names, frozenset(n.encode("latin-1") for n in names), quiet)
            self._propagation = cached
        return cached

    def _nothing_to_trace(self, headers: Sequence[tuple[bytes, bytes]]) -> bool:
        """No SDK behind the global tracer and no trace context from the caller: a span
        would record nothing and propagate nothing (the caller's headers pass unchanged
        either way), so the request skips span bookkeeping altogether."""
        if not self._global_tracer or not _tracing_off():
            return False
        fields = self._propagation_fields()[2]
        return not any(name in fields for name, _ in headers)

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
        candidates = [label(c) for c in (context.candidates or context.route.plan)]
        chosen = label(context.chosen) if context.chosen is not None else None
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


def _resolved(provider: metrics.MeterProvider) -> object:
    """The provider whose meters instruments made on `provider` end up on: the installed
    SDK's for the OTel API's global proxy once one is installed, else `provider`."""
    real = getattr(provider, "_real_meter_provider", None)
    return provider if real is None else real


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


_MISSING = object()


def _tracing_off() -> bool:
    """The global tracer provider is the API's proxy (no SDK installed) or a no-op one."""
    provider = getattr(trace, "_TRACER_PROVIDER", _MISSING)
    if provider is None:  # unset: the proxy (checked without `get_tracer_provider()`'s
        return True  # environment lookup per call; the API sets it once, never unsets it)
    if provider is _MISSING:  # an API without the global: ask it
        provider = trace.get_tracer_provider()
    return isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider)


def _end_decided(entry: AttemptTrace) -> None:
    """End an attempt's span with the walk's decision about it, at the time the attempt
    finished (now, when it was not kept waiting for the decision)."""
    attributes = entry.ended or {}
    attributes.update(decision_attributes(entry.record))
    if attributes:
        entry.span.set_attributes(attributes)
    entry.span.end(end_time=entry.finished_at)


def _without_secret_trace_state(
    incoming: otel_context.Context, secrets: RequestSecrets | None
) -> otel_context.Context:
    """The caller's context less any `tracestate` entry that carries a credential of the
    request: every span of the trace inherits the parent's trace state, and exporters write
    it out with each span (OTLP `trace_state`), so a caller could otherwise get its own
    token or a provider key recorded through a header value. The other entries stay and
    propagate upstream as W3C asks."""
    if secrets is None:
        return incoming
    parent = trace.get_current_span(incoming).get_span_context()
    state = parent.trace_state
    if not parent.is_valid or not state:
        return incoming
    kept = [
        (key, value)
        for key, value in state.items()
        if not secrets.carried_by(key) and not secrets.carried_by(value)
    ]
    if len(kept) == len(state):
        return incoming
    cleaned = trace.SpanContext(
        parent.trace_id,
        parent.span_id,
        is_remote=parent.is_remote,
        trace_flags=parent.trace_flags,
        trace_state=trace.TraceState(kept),
    )
    return trace.set_span_in_context(trace.NonRecordingSpan(cleaned), incoming)


def _without_secret_baggage(
    incoming: otel_context.Context, secrets: RequestSecrets | None
) -> otel_context.Context:
    """The caller's context less any baggage entry whose name or value carries a credential
    of the request: the attempts propagate the caller's baggage upstream (W3C `baggage`),
    so a `session.id` a page's instrumentation set to its session cookie, or a token,
    reached the provider beside the stripped `cookie` / `authorization`."""
    if secrets is None:
        return incoming
    entries = otel_baggage.get_all(incoming)
    for name, value in entries.items():
        if secrets.carried_by(name) or secrets.carried_by(str(value)):
            incoming = otel_baggage.remove_baggage(name, incoming)
    return incoming


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
