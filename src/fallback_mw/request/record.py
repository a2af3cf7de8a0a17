"""The usage record a routed request leaves in the ledger when it ends: who was tried, who
answered, the outcome, the cost. Every routed request leaves one — the budget guard's
settlement writes it, and so does the resolver for the requests it refuses itself (405,
431, 503 `overloaded`) — so `fallback-mw usage` and a game day's observation see every
answer a caller got."""

from __future__ import annotations

import logging
from decimal import Decimal
from typing import Final

from fallback_mw.budget import AttemptOutcome, Ledger, LedgerUnavailable, UsageRecord
from fallback_mw.request.context import MAX_NAME, RequestContext, SkipRecord, walk_order
from fallback_mw.request.secrets import recordable, recorded_tenant
from fallback_mw.timers import monotonic

logger: Final = logging.getLogger("fallback_mw.budget")


def usage_record(
    context: RequestContext,
    cost: Decimal | None,
    charged: Decimal | None,
    *,
    priced_as: str | None = None,
) -> UsageRecord:
    """`priced_as`: the model the cost is of when the answer names one without a price
    (the model asked for): the record shows it, as docs/budgets.md says."""
    # Built positionally, then filled in: a class called with keywords makes a dict of
    # them on every call (every routed request leaves a record). AttemptOutcome's fields:
    # candidate, status, failure, skipped, fault.
    attempts = [
        AttemptOutcome(s.candidate, None, None, s.reason, s.fault)
        if isinstance(s, SkipRecord)
        else AttemptOutcome(
            s.candidate,
            s.status,
            # Never finished: cancelled in flight (the client left, the host cancelled),
            # as its span says; not an attempt with no outcome at all.
            s.failure_kind or ("cancelled" if s.duration is None else None),
            None,
            s.fault,
        )
        for s in (
            # One attempt and no skip (the usual request): that is the walk's order.
            context.attempts
            if len(context.attempts) < 2 and not context.skipped
            else walk_order(context)
        )
    ]  # in the walk's order: a skip before the attempt that followed it
    usage = context.usage
    record = UsageRecord(
        context.request_id,
        context.route.id,
        # The caller's header: bounded and stored like the model (a NUL that the header
        # check refuses still reaches this record of its 400).
        # A tenant id that carries a credential of the request is not stored as it is.
        _storable(recorded_tenant(context.tenant, context.secrets)[:MAX_NAME]) or "",
    )
    record.budget_id = context.route.budget
    record.candidates = tuple(context.candidates)
    record.attempts = tuple(attempts)
    record.chosen = context.chosen
    record.outcome = context.outcome
    record.status = context.status
    record.model = _storable(
        recordable(context.secrets, priced_as or usage.model)
        or recordable(context.secrets, model_asked(context))
    )
    record.input_tokens = usage.input_tokens
    record.output_tokens = usage.output_tokens
    record.cost = cost
    record.charged = charged
    # Arrival to settlement (the walk, the response).
    record.duration_ms = round((monotonic() - context.started) * 1000, 3)
    record.rule = context.rule
    return record


def model_asked(context: RequestContext) -> str | None:
    """The model the served upstream was asked for: the chosen candidate's `model` when it
    rewrites the body's, else the caller's. What the answer is priced as when it names no
    priced model of its own (never the caller's name for a model it was not sent to)."""
    chosen = context.chosen
    if chosen is not None:
        upstream = context.upstreams.get(chosen)
        if upstream is not None and upstream.model:
            return upstream.model
    return context.request_model


async def write_record(
    ledger: Ledger,
    context: RequestContext,
    cost: Decimal | None,
    charged: Decimal | None,
    *,
    priced_as: str | None = None,
) -> None:
    """The request's usage record into the ledger. An unavailable ledger loses it (the
    PostgreSQL ledger keeps what an outage refused before sending, and writes it later);
    the outage itself is logged by the ledger, once each way: nothing per request here."""
    try:
        await ledger.record_usage(usage_record(context, cost, charged, priced_as=priced_as))
    except LedgerUnavailable:
        logger.debug("route %s: usage record lost, ledger unavailable", context.route.id)


def _storable(text: str | None) -> str | None:
    """`text` as every ledger's text column can hold it. A tenant is a caller's header value
    (a NUL in it is refused, but recorded). A model name comes from JSON (the
    caller's body, the upstream's answer), where `"\\ud800"` (a lone surrogate, which UTF-8
    cannot encode) and `"\\u0000"` (NUL, which PostgreSQL text refuses) are valid escapes:
    written as escapes, the record and its settlement are stored instead of failing."""
    if text is None or text.isprintable():  # neither a NUL nor a surrogate is printable
        return text
    text = text.replace("\x00", "\\x00")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text
