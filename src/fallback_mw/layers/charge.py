"""What a settled request is charged (SPEC §7), and the cost of the usage it reported:
the budget guard's settlement reads both (`layers.guard`)."""

from __future__ import annotations

from decimal import Decimal

from fallback_mw.budget.cost import PriceBook
from fallback_mw.request.context import RequestContext
from fallback_mw.request.record import model_asked


def priced_usage(prices: PriceBook, context: RequestContext) -> tuple[Decimal | None, str | None]:
    """The reported usage's cost, and the model it was priced as when that is not the
    one the answer names (the usage record shows the model its cost is of)."""
    usage = context.usage
    if not usage.reported:
        return None, None
    cost = prices.cost(usage.model, usage.input_tokens, usage.output_tokens)
    if cost is None:
        # The answer names no priced model: the one the upstream was asked for (a
        # candidate's `model` rewrite, not the caller's name, when it has one).
        asked = model_asked(context)
        if asked != usage.model:
            cost = prices.cost(asked, usage.input_tokens, usage.output_tokens)
            if cost is not None:
                return cost, asked
    return cost, None


def charge(context: RequestContext, held: Decimal, cost: Decimal | None) -> Decimal:
    """What a settled request is charged (SPEC §7): the reported usage's cost, else the
    hold; nothing when nothing was served and no upstream answered."""
    if context.chosen is None:
        unrelayed = context.client_disconnected or context.outcome == "response_too_large"
        if unrelayed and any(
            record.status is not None and 200 <= record.status < 300 for record in context.attempts
        ):
            # An upstream answered (it generated, and bills for it) but the client left
            # before the relay began, or the answer was over max_response_body by its
            # Content-Length (found while relayed, it is charged as cut short): the body,
            # and its usage, were never read.
            return held
        return Decimal(0)  # nothing served: the hold is released
    if context.served_fault is not None:
        # A game-day fault's own answer (`fail`'s 503, `revoke`'s 401): nothing reached the
        # upstream, nothing was generated; a rehearsal must not spend the tenant's budget.
        return Decimal(0)
    if cost is None:
        return held
    if not context.completed and not context.usage.done:
        # Cut short (client gone, response aborted): the upstream's count is partial
        # but it may bill for the whole generation; never charge less than the hold.
        # Not once `data: [DONE]` was relayed (an upstream that went idle or reset after
        # it): the count is whole, and nothing the SDKs read was lost.
        return max(cost, held)
    return cost
