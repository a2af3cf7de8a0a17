"""BudgetGuard: one hold before any upstream is contacted, one settlement after.

The guard reads the request body (the walker's one reader, `walk.body.read_body`, which
keeps it in the request context for the walker), estimates and takes the hold, then calls
the walker. It meters the response by wrapping `send`, the way Starlette's GZipResponder
watches a response: the walker knows nothing of budgets. The settlement runs in a
shielded `finally` once the walk has ended (served, failed, or the client went away):
reported usage priced by `[prices]`, else the hold; nothing served releases the hold. A
budgeted route with no ledger fails closed (503 `budget_unavailable`). A refusal is left
in the request context (`refusal`) for the walker to answer, with nothing attempted, so
refused requests are traced like any other."""

from __future__ import annotations

import logging
from decimal import Decimal

import anyio

from fallback_mw.budget import AttemptOutcome, Hold, Ledger, LedgerUnavailable, UsageRecord
from fallback_mw.budget.cost import PriceBook
from fallback_mw.budget.usage import DEFAULT_JSON_CAP, UsageMeter
from fallback_mw.config import BudgetConfig, GatewayConfig
from fallback_mw.request.body import read_body, request_json
from fallback_mw.request.context import RequestBody, RequestContext, get_context
from fallback_mw.request.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger("fallback_mw.budget")

_REFUSALS = {
    "budget_exceeded": "the budget for this route has no room for this request",
    "budget_unavailable": "the budget ledger cannot be reached; refusing (fail closed)",
}


class BudgetGuard:
    def __init__(
        self,
        app: ASGIApp,
        /,
        *,
        config: GatewayConfig,
        ledger: Ledger | None = None,
        json_cap: int = DEFAULT_JSON_CAP,
    ) -> None:
        self.app = app
        self.settings = config.gateway
        self.budgets = dict(config.budgets)
        self.prices = PriceBook(config.prices)
        self.ledger = ledger
        self.json_cap = json_cap

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        context = get_context(scope)
        if context is None:
            await self.app(scope, receive, send)
            return
        ledger = self.ledger
        budget_id = context.route.budget
        if ledger is None:
            if budget_id is not None:
                context.refusal = ("budget_unavailable", _REFUSALS["budget_unavailable"])
            await self.app(scope, receive, send)
            return
        hold: Hold | None = None
        meter = UsageMeter(context.usage, json_cap=self.json_cap)
        try:
            if budget_id is not None:
                body = await read_body(context, scope, receive, self.settings)
                if body.ok:  # otherwise the walker answers for the body (413, 408, ...)
                    outcome = await self._hold(ledger, context, budget_id, body)
                    if isinstance(outcome, str):
                        # The walker answers it, with nothing attempted (and traced).
                        context.refusal = (outcome, _REFUSALS[outcome])
                    else:
                        hold = outcome
            await self.app(scope, receive, _MeteredSend(send, meter))
        finally:
            # Shielded: a cancelled request (client gone, server stopping) still settles.
            with anyio.CancelScope(shield=True):
                meter.finish()
                await self._settle(ledger, context, meter, hold)

    async def budget_for(self, ledger: Ledger, budget_id: str) -> BudgetConfig | None:
        """A budget set in the store wins over the file's, so operators can change a
        limit without a restart."""
        stored = await ledger.stored_budget(budget_id)
        return stored if stored is not None else self.budgets.get(budget_id)

    async def _hold(
        self, ledger: Ledger, context: RequestContext, budget_id: str, body: RequestBody
    ) -> Hold | str:
        """The hold, or the local error code refusing the request."""
        parsed = request_json(context, body)  # notes the requested model, as the walker does
        try:
            budget = await self.budget_for(ledger, budget_id)
            if budget is None:
                # A route naming a budget nobody defined: fail closed, like an unreachable
                # ledger, rather than let unmetered traffic through.
                logger.warning("route %s names an unknown budget %s", context.route.id, budget_id)
                return "budget_unavailable"
            amount = self.prices.estimate_hold(
                body.buffered, context.request_model, budget.default_hold, parsed=parsed
            )
            hold = await ledger.hold(budget_id, budget, amount)
        except LedgerUnavailable:
            return "budget_unavailable"
        return "budget_exceeded" if hold is None else hold

    def _charge(self, context: RequestContext, meter: UsageMeter, hold: Hold) -> Decimal:
        cost = self._cost(context, meter)
        if cost is None:
            return hold.amount
        if not context.completed:
            # Cut short (client gone, response aborted): the upstream's count is partial
            # but it may bill for the whole generation; never charge less than the hold.
            return max(cost, hold.amount)
        return cost

    def _cost(self, context: RequestContext, meter: UsageMeter) -> Decimal | None:
        if not meter.reported:
            return None
        usage = context.usage
        cost = self.prices.cost(usage.model, usage.input_tokens, usage.output_tokens)
        if cost is None and usage.model != context.request_model:
            cost = self.prices.cost(context.request_model, usage.input_tokens, usage.output_tokens)
        return cost

    async def _settle(
        self, ledger: Ledger, context: RequestContext, meter: UsageMeter, hold: Hold | None
    ) -> None:
        charged: Decimal | None = None
        try:
            if hold is not None:
                if context.chosen is None:
                    await ledger.release(hold)
                    charged = Decimal(0)
                else:
                    charged = self._charge(context, meter, hold)
                    await ledger.settle(hold, charged)
        except LedgerUnavailable:
            # The hold stays in the ledger; it is settled at its amount when it goes stale.
            logger.warning("route %s: settlement failed, ledger unavailable", context.route.id)
        try:
            await ledger.record_usage(_usage_record(context, self._cost(context, meter), charged))
        except LedgerUnavailable:
            logger.warning("route %s: usage record lost, ledger unavailable", context.route.id)


class _MeteredSend:
    """Wraps `send`: the usage meter sees each body chunk the client is sent."""

    def __init__(self, send: Send, meter: UsageMeter) -> None:
        self.send = send
        self.meter = meter
        self.content_type: bytes | None = None

    async def __call__(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            headers = message.get("headers", ())
            self.content_type = next((v for k, v in headers if k == b"content-type"), None)
        await self.send(message)
        if kind == "http.response.body":
            chunk = message.get("body", b"")
            if chunk:
                self.meter.observe(chunk, self.content_type)
            if not message.get("more_body"):
                self.meter.finish()  # usage is known before telemetry reads it


def _usage_record(
    context: RequestContext, cost: Decimal | None, charged: Decimal | None
) -> UsageRecord:
    import time

    attempts = [
        AttemptOutcome(candidate=a.candidate, status=a.status, failure=a.failure_kind)
        for a in context.attempts
    ]
    attempts += [AttemptOutcome(candidate=s.candidate, skipped=s.reason) for s in context.skipped]
    usage = context.usage
    return UsageRecord(
        request_id=context.request_id,
        route=context.route.id,
        tenant=context.tenant,
        budget_id=context.route.budget,
        candidates=tuple(context.candidates),
        attempts=tuple(attempts),
        chosen=context.chosen,
        outcome=context.outcome,
        status=context.status,
        model=usage.model or context.request_model,
        input_tokens=usage.input_tokens,
        output_tokens=usage.output_tokens,
        cost=cost,
        charged=charged,
        # Arrival to settlement (the walk, the response, the ledger's settle call).
        duration_ms=round((time.monotonic() - context.started) * 1000, 3),
    )
