"""Spans, metrics and the request log line. Attributes are built from an allowlist:
names, numbers and codes only — never a body, header value, credential or query string."""

from __future__ import annotations

import logging
from typing import Any

from opentelemetry import trace

from fallback_mw.context import AttemptRecord, RequestContext

tracer = trace.get_tracer("fallback_mw")
logger = logging.getLogger("fallback_mw.request")


class Telemetry:
    """The walker's one telemetry seam. Every method is safe to call and never raises."""

    def request_started(self, context: RequestContext) -> None:
        try:
            span = tracer.start_span("gateway.request", kind=trace.SpanKind.INTERNAL)
            span.set_attribute("gateway.route.id", context.route.id)
            span.set_attribute("gateway.tenant", context.tenant)
            context.extras["span"] = span
        except Exception:  # telemetry must never break a request
            logging.getLogger("fallback_mw").debug("telemetry failed", exc_info=False)

    def attempt_started(self, context: RequestContext, attempt: AttemptRecord) -> None:
        return None

    def attempt_finished(self, context: RequestContext, attempt: AttemptRecord) -> None:
        span = context.extras.get("span")
        if span is None:
            return
        try:
            with trace.use_span(span, end_on_exit=False):
                child = tracer.start_span("gateway.attempt", start_time=None)
            attrs: dict[str, Any] = {
                "gateway.candidate": attempt.candidate,
                "gateway.attempt.number": attempt.number,
                "server.address": attempt.server_address,
            }
            if attempt.status is not None:
                attrs["http.response.status_code"] = attempt.status
            if attempt.failure_kind is not None:
                attrs["gateway.failure.kind"] = attempt.failure_kind
            child.set_attributes(attrs)
            child.end()
        except Exception:
            logging.getLogger("fallback_mw").debug("telemetry failed", exc_info=False)

    def skipped(self, context: RequestContext, candidate: str, reason: str) -> None:
        span = context.extras.get("span")
        if span is not None:
            span.add_event(
                "gateway.candidate.skipped",
                {"gateway.candidate": candidate, "gateway.skip.reason": reason},
            )

    def request_finished(self, context: RequestContext) -> None:
        span = context.extras.pop("span", None)
        try:
            if span is not None:
                span.set_attributes(
                    {
                        "gateway.plan.candidates": list(context.candidates),
                        "gateway.plan.chosen": context.chosen or "",
                        "gateway.attempts": context.attempt_count,
                        "gateway.fallback": context.fallback,
                        "gateway.canary": context.canary,
                        "gateway.outcome": context.outcome or "unknown",
                    }
                )
                span.end()
            logger.info(
                "route=%s candidates=%s chosen=%s attempts=%d outcome=%s",
                context.route.id,
                ",".join(context.candidates),
                context.chosen or "-",
                context.attempt_count,
                context.outcome or "unknown",
            )
        except Exception:
            logging.getLogger("fallback_mw").debug("telemetry failed", exc_info=False)

    def inject_headers(self, headers: list[tuple[str, str]]) -> None:
        """Propagate the current trace context upstream (traceparent)."""
        return None
