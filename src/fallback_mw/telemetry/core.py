"""The Telemetry class: the hooks the walker calls (see the package docstring)."""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Final

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.util.types import AttributeValue

from fallback_mw.config import ConfigError, RouteConfig
from fallback_mw.extras import package_version
from fallback_mw.injected import require
from fallback_mw.python_class import python_class
from fallback_mw.request.context import AttemptRecord, RequestContext
from fallback_mw.telemetry.breakers import BreakerReports
from fallback_mw.telemetry.ends import TelemetryEnds, end_decided
from fallback_mw.telemetry.genai import genai_attributes
from fallback_mw.telemetry.instruments import Instruments, never_idle
from fallback_mw.telemetry.propagation import (
    PROPAGATORS_REFUSED,
    TracePropagation,
    current_attempt,
    without_secrets,
)
from fallback_mw.telemetry.redact import (
    http_method,
    label,
    quiet_propagators,
    tenant_label,
)
from fallback_mw.telemetry.shadow_spans import ShadowSpans
from fallback_mw.telemetry.spans import (
    AttemptTrace,
    RequestTrace,
    Untraced,
    entry_of,
    request_trace,
)

INSTRUMENTATION_NAME: Final = "fallback_mw"
REQUEST_SPAN: Final = "gateway.request"
ATTEMPT_SPAN: Final = "gateway.attempt"
SKIP_EVENT: Final = "gateway.candidate.skipped"
ABORT_EVENT: Final = "gateway.response.aborted"

_internal: Final = logging.getLogger("fallback_mw.telemetry")


@python_class  # weakly referenced: a Python class under mypyc
class Telemetry(BreakerReports, TracePropagation, ShadowSpans, TelemetryEnds):
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
                incoming = without_secrets(otel_context.get_current(), context.secrets)
                kind = trace.SpanKind.INTERNAL
            else:
                incoming = self._caller_context(headers, context.secrets)
                kind = trace.SpanKind.SERVER
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
                attributes=genai_attributes(attributes, context, None),
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
            request = request_trace(context)
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
            genai_attributes(attributes, context, attempt.candidate)
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
                if attempts and attempts[-1] is attempt:
                    attempts.pop()  # the one in flight (a hedge race holds two)
                else:
                    for index, started in enumerate(attempts):
                        if started is attempt:
                            del attempts[index]
                            break
                self._m.attempt(context, attempt, attempt.failure_kind)
                return
            request = request_trace(context)
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
            request = context.trace  # request_trace, inline: asked after every attempt
            if not isinstance(request, RequestTrace):
                return
            entry = entry_of(request.undecided, attempt)
            if entry is None:
                return
            request.undecided.remove(entry)
            end_decided(entry)
        except Exception:
            _internal.debug("attempt_decided failed", exc_info=False)

    def skipped(
        self, context: RequestContext, candidate: str, reason: str, *, fault: str | None = None
    ) -> None:
        """A skipped candidate; `fault` names the game-day fault whose outcomes opened the
        breaker behind a `breaker_open` skip (the span event carries it)."""
        try:
            request = request_trace(context)
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
            request = request_trace(context)
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


_NOT_OURS: Final = contextlib.nullcontext()


_MISSING: Final = object()


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


__all__ = [
    "ABORT_EVENT",
    "ATTEMPT_SPAN",
    "REQUEST_SPAN",
    "SKIP_EVENT",
    "Telemetry",
]
