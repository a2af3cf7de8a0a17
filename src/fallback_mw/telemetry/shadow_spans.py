"""The telemetry of a shadow copy (a route's `shadow`): its `gateway.shadow` span, a child
of the request's span that may end after it, the context its own task propagates upstream,
and the copies' metrics. Telemetry (telemetry/core.py) carries these hooks."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Final

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.util.types import AttributeValue

from fallback_mw.python_class import python_class
from fallback_mw.request.context import RequestContext
from fallback_mw.telemetry.instruments import Instruments
from fallback_mw.telemetry.propagation import current_attempt
from fallback_mw.telemetry.redact import label
from fallback_mw.telemetry.spans import request_trace

SHADOW_SPAN: Final = "gateway.shadow"

_internal: Final = logging.getLogger("fallback_mw.telemetry")


@python_class  # Telemetry's base: a Python class under mypyc, as Telemetry
class ShadowSpans:
    """Telemetry's shadow-copy hooks. Every hook but `shadow_scope` is safe to call and
    never raises."""

    _tracer: trace.Tracer
    _m: Instruments

    def shadow_started(self, context: RequestContext, candidate: str) -> trace.Span | None:
        """A `gateway.shadow` span for a copy of this request, a child of its request span
        (it may end after it). None when telemetry cannot make one."""
        try:
            request = request_trace(context)
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
        request = request_trace(context)
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
