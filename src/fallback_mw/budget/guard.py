"""BudgetGuard: one hold before any upstream is contacted, one settlement after."""

from __future__ import annotations

import anyio

from fallback_mw.budget import Hold, Ledger, LedgerUnavailable
from fallback_mw.config import BudgetConfig, GatewayConfig
from fallback_mw.context import RequestContext, get_context
from fallback_mw.types import ASGIApp, Receive, Scope, Send


class BudgetGuard:
    def __init__(
        self, app: ASGIApp, /, *, config: GatewayConfig, ledger: Ledger | None = None
    ) -> None:
        self.app = app
        self.budgets = dict(config.budgets)
        self.ledger = ledger

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        context = get_context(scope)
        if context is None or context.route.budget is None or self.ledger is None:
            await self.app(scope, receive, send)
            return
        budget = self.budgets.get(context.route.budget)
        if budget is None:
            await self.app(scope, receive, send)
            return
        ledger = self.ledger
        budget_id = context.route.budget

        async def admit(body: bytes | None) -> str | None:
            try:
                hold = await ledger.hold(budget_id, budget, budget.default_hold)
            except LedgerUnavailable:
                return "budget_unavailable"
            if hold is None:
                return "budget_exceeded"
            context.hold = hold
            return None

        context.admission_hooks.append(admit)
        try:
            await self.app(scope, receive, send)
        finally:
            if isinstance(context.hold, Hold):
                with anyio.CancelScope(shield=True):
                    await self._settle(ledger, context, budget)

    async def _settle(self, ledger: Ledger, context: RequestContext, budget: BudgetConfig) -> None:
        hold: Hold = context.hold
        try:
            if context.chosen is None:
                await ledger.release(hold)
            else:
                await ledger.settle(hold, hold.amount)
        except LedgerUnavailable:
            pass
