"""Span bookkeeping: what one request keeps while its spans are open (in `context.trace`,
never on Telemetry), and the `gateway.request` span's attributes (SPEC §9)."""

from __future__ import annotations

from dataclasses import dataclass, field

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.util.types import AttributeValue

from fallback_mw.request.context import AttemptRecord, RequestContext
from fallback_mw.telemetry.redact import label, model_name


@dataclass(slots=True)
class AttemptTrace:
    record: AttemptRecord
    span: trace.Span
    context: otel_context.Context
    # When the attempt finished (ns since the epoch): its span ends at that time once the
    # walk has decided what follows it (Telemetry.attempt_decided), or when the request ends.
    finished_at: int | None = None
    # What the attempt's end adds to its span, set with the walk's decision in one call
    # when the span ends (each `set_attributes` cleans and locks: one per span, not two).
    ended: dict[str, AttributeValue] | None = None


@dataclass(slots=True)
class RequestTrace:
    """One request's telemetry state; lives in `context.trace`, never on Telemetry."""

    span: trace.Span
    parent: otel_context.Context  # incoming context (trace parent, baggage) + our span
    attempts: list[AttemptTrace] = field(default_factory=list)
    undecided: list[AttemptTrace] = field(default_factory=list)  # finished, decision to come


# The `__init__` written out (request/records.py says why).
@dataclass(slots=True, init=False)
class Untraced:
    """A request with nothing to trace (no SDK behind the global tracer, no trace context
    from the caller): no spans, the same metrics. Attempts in flight, for the metrics of
    those a disconnect cancels."""

    attempts: list[AttemptRecord]

    def __init__(
        self,
        attempts: list[AttemptRecord] | None = None,
    ) -> None:
        self.attempts = [] if attempts is None else attempts


def request_trace(context: RequestContext) -> RequestTrace | None:
    """The request's telemetry state, when it is traced (not Untraced, not finished)."""
    request = context.trace
    return request if isinstance(request, RequestTrace) else None


def entry_of(entries: list[AttemptTrace], record: AttemptRecord) -> AttemptTrace | None:
    """The entry of `record` (a loop, not `next()` over a generator: one left unfinished
    is closed by raising GeneratorExit into it, about 2,000 instructions)."""
    for entry in entries:
        if entry.record is record:
            return entry
    return None


def decision_attributes(record: AttemptRecord) -> dict[str, AttributeValue]:
    """What the walk did after this attempt and why (`decide.Decision`'s action and reason:
    constant phrases of the failover rules, never a caller's or an upstream's text)."""
    if record.decision is None:
        return {}
    attributes: dict[str, AttributeValue] = {"gateway.decision": label(record.decision)}
    if record.reason:
        attributes["gateway.decision.reason"] = label(record.reason)
    return attributes


def request_span_attributes(
    context: RequestContext,
    outcome: str,
    candidates: list[str],
    chosen: str | None,
    fault: bool,
) -> dict[str, AttributeValue]:
    attributes: dict[str, AttributeValue] = {
        "gateway.plan.candidates": candidates,
        "gateway.attempts": context.attempt_count,
        "gateway.fallback": context.fallback,
        "gateway.canary": context.canary,
        "gateway.outcome": label(outcome),
    }
    if chosen is not None:
        attributes["gateway.plan.chosen"] = chosen
    if context.rule is not None:
        attributes["gateway.rule"] = label(context.rule)
    if context.pinned is not None:
        attributes["gateway.pinned"] = label(context.pinned)
    if fault:
        attributes["gateway.fault"] = True
    if context.skipped:
        attributes["gateway.skipped"] = len(context.skipped)
    if context.status is not None:
        attributes["http.response.status_code"] = context.status
    model = model_name(context.request_model, context.secrets)
    if model is not None:
        attributes["gen_ai.request.model"] = model
    usage = context.usage
    if usage is not None:
        if usage.input_tokens is not None:
            attributes["gen_ai.usage.input_tokens"] = int(usage.input_tokens)
        if usage.output_tokens is not None:
            attributes["gen_ai.usage.output_tokens"] = int(usage.output_tokens)
        response_model = model_name(usage.model, context.secrets)
        if response_model is not None:
            attributes["gen_ai.response.model"] = response_model
    return attributes
