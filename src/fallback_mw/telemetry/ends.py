"""How an attempt's and a request's telemetry end: an attempt's span ends with the walk's
decision about it (or waits for it, keeping its own end time), a request's span, metrics
and log line once, whatever cut the walk short (attempts cancelled mid-flight, decisions
that never came). Telemetry (telemetry/core.py) carries these."""

from __future__ import annotations

import time
from typing import Final

from opentelemetry import trace
from opentelemetry.util.types import AttributeValue

from fallback_mw.python_class import python_class
from fallback_mw.request.context import RequestContext
from fallback_mw.telemetry.genai import genai_attributes
from fallback_mw.telemetry.instruments import Instruments
from fallback_mw.telemetry.propagation import current_attempt
from fallback_mw.telemetry.redact import MAX_LABEL, label
from fallback_mw.telemetry.request_log import QUIET_OUTCOMES, log_request
from fallback_mw.telemetry.spans import (
    AttemptTrace,
    RequestTrace,
    Untraced,
    decision_attributes,
    request_span_attributes,
)
from fallback_mw.timers import monotonic

# Marks a request whose telemetry was finished: a second request_finished records nothing.
_FINISHED: Final = object()


@python_class  # Telemetry's base: a Python class under mypyc, as Telemetry
class TelemetryEnds:
    """Telemetry's ends of an attempt and of a request."""

    _m: Instruments

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
        entry.ended = attributes  # set when the span ends (end_decided)
        if kind is not None and kind != "cancelled":
            span.set_status(trace.Status(trace.StatusCode.ERROR, kind))
        if request is not None and record.decision is None:
            entry.finished_at = time.time_ns()
            request.undecided.append(entry)
        else:
            end_decided(entry)
        self._m.attempt(context, record, kind)

    def _finish(self, context: RequestContext) -> None:
        request = context.trace
        if request is _FINISHED:
            return  # finished once already: recorded once
        context.trace = _FINISHED
        duration = max(monotonic() - context.started, 0.0)
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
                end_decided(entry)
            request.undecided.clear()
            span = request.span
            attributes = request_span_attributes(context, outcome, candidates, chosen, fault)
            genai_attributes(attributes, context, chosen)
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


def end_decided(entry: AttemptTrace) -> None:
    """End an attempt's span with the walk's decision about it, at the time the attempt
    finished (now, when it was not kept waiting for the decision)."""
    attributes = entry.ended or {}
    attributes.update(decision_attributes(entry.record))
    if attributes:
        entry.span.set_attributes(attributes)
    entry.span.end(end_time=entry.finished_at)
