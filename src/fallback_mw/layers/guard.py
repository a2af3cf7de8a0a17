"""BudgetGuard: one hold before any upstream is contacted, one settlement after.

The guard reads the request body (the one reader below the layers, `request.body.read_body`,
which keeps it in the request context for the walker), estimates and takes the hold, then
calls the app behind it. It answers its own refusals through the shared local-error writer:
402 `budget_exceeded` when the hold is refused, 503 `budget_unavailable` when the ledger
cannot be reached, a budgeted route has no ledger, or it names no known budget (fail closed,
in front of any app); a body it cannot estimate from (over `max_request_body`, too slow)
gets the walker's own 413 / 408 (`request.refusals`). Nothing behind it runs then. The
response path meters usage (`walker/stream.commit` fills `context.usage`); the settlement
reads it, in a shielded `finally` once the app has returned (served, failed, or the client
went away): reported usage priced by `[prices]`, else the hold; nothing served releases the
hold."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from decimal import Decimal
from typing import Any, Final

import anyio

from fallback_mw.budget import (
    BudgetUnreadable,
    Hold,
    Ledger,
    LedgerUnavailable,
    SettlesAndRecords,
    room_needed,
)
from fallback_mw.budget.cost import PriceBook, to_units
from fallback_mw.config import (
    BudgetConfig,
    ConfigError,
    ConfigSource,
    as_config,
)
from fallback_mw.config.views import SettingsView
from fallback_mw.failover.deadline_messages import deadline_message
from fallback_mw.injected import require, require_app
from fallback_mw.layers.budget_refusals import (
    LEDGER_UNREACHABLE,
    NO_LEDGER,
    exceeded,
    ledger_too_slow,
    limit_zero,
    nested_too_deep,
    over_the_whole_limit,
    undefined,
    unreadable_budget,
    unreadable_charset,
    unreadable_coding,
)
from fallback_mw.layers.charge import charge, priced_usage
from fallback_mw.request.body import read_body
from fallback_mw.request.body_json import (
    NestedTooDeep,
    decoded_request_json,
    estimated_request_json,
    request_json,
    unreadable_request_charset,
    unreadable_request_coding,
)
from fallback_mw.request.config_refusal import ConfigRefusal
from fallback_mw.request.context import (
    MAX_NAME,
    SCOPE_KEY,
    RequestBody,
    RequestContext,
    host_cancelled,
)
from fallback_mw.request.local_errors import send_error
from fallback_mw.request.record import usage_record, write_record
from fallback_mw.request.refusals import body_refusal
from fallback_mw.request.types import ASGIApp, Receive, Scope, Send
from fallback_mw.security.values import AMPERSAND, PLUS
from fallback_mw.store.ledgers.memory import MemoryLedger
from fallback_mw.telemetry import Telemetry
from fallback_mw.tokens import named_values

logger: Final = logging.getLogger("fallback_mw.budget")
_MODEL_KEY: Final = ("model",)


_UNBOUNDED: Final = contextlib.nullcontext()  # reentrant: one for every request
# A budget read shorter than this did not wait for the ledger (a cached budget).
_READ_DID_NOT_WAIT: Final = 0.001
# A deadline that left the ledger less than this (a healthy hold takes a few ms, more
# under load) ran out on the caller's side: 504 deadline_exceeded, not 503.
_LEDGER_GRACE: Final = 0.1

_BEFORE_THE_HOLD: Final = " (before the budget ledger answered the hold; no upstream was contacted)"


class BudgetGuard:
    _refusal: ConfigRefusal | None = None  # a configuration that did not load

    def __init__(
        self,
        app: ASGIApp,
        /,
        *,
        config: ConfigSource,
        ledger: Ledger | None = None,
        telemetry: Telemetry | None = None,
    ) -> None:
        require_app(app, owner="BudgetGuard")
        require(ledger, Ledger, parameter="ledger", owner="BudgetGuard")
        require(telemetry, Telemetry, parameter="telemetry", owner="BudgetGuard")
        self.app = app
        try:
            config = as_config(config, check_env=False)  # it reads no credential
        except ConfigError as exc:
            self._refusal = ConfigRefusal(exc)
            return
        self.settings = SettingsView(config.gateway)  # read per request: a plain view
        self.budgets = dict(config.budgets)
        self.prices = PriceBook(config.prices)
        self.ledger = ledger
        self.telemetry = telemetry
        # A ledger whose calls never suspend (the in-memory one: nothing in them awaits)
        # cannot be cancelled part-way through a settlement: no shield is needed for it.
        self._shield = not getattr(ledger, "never_suspends", False)
        # Its refusals name where a limit is raised: the file when no command reaches it.
        self._in_memory = isinstance(ledger, MemoryLedger)
        # The memory ledger answers at the call: settled and recorded with no coroutine. By
        # exact type: a subclass may override the coroutines (and is asked through them).
        self._ledger_now = ledger if type(ledger) is MemoryLedger else None
        # A ledger that settles and records in one transaction (the SQL ledgers) gets one
        # call per request end instead of two.
        # (Asked of an `object`: mypy finds no type for a `Ledger | None` that is also a
        # SettlesAndRecords, two protocols, and compiled, mypyc then typed this None.)
        found: object = ledger
        self._one_step = found if isinstance(found, SettlesAndRecords) else None
        # How long one of its calls may wait (the SQL ledgers' own timeout), when it says.
        self._ledger_timeout: float | None = getattr(ledger, "call_timeout", None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._refusal is not None:
            await self._refusal(scope, receive, send)
            return
        context = scope.get(SCOPE_KEY)  # `get_context`, written out: one call fewer
        if not isinstance(context, RequestContext):
            await self.app(scope, receive, send)
            return
        # Traced like the resolver's refusals (nothing to do when the resolver owns the
        # span: `Telemetry.request`'s rule, without its scope object per request). One
        # frame, not a helper coroutine: every await of the walk below passes through
        # each frame of the chain (docs/performance.md).
        telemetry = self.telemetry
        owner = telemetry if telemetry is not None and context.trace is None else None
        if owner is not None:
            owner.request_started(context, scope.get("headers", ()))
        try:
            ledger = self.ledger
            budget_id = context.route.budget
            if ledger is None:
                if budget_id is not None:
                    await send_error(send, context, "budget_unavailable", NO_LEDGER)  # closed
                    return
                await self.app(scope, receive, send)
                return
            hold: Hold | None = None
            # The settlement runs however the request ended, but not from a `finally`: a
            # mypyc-compiled coroutine re-raises a stale exception after a `finally` that
            # awaits (scripts/compile.py). The same order: the request, then the settlement.
            try:
                if budget_id is None:
                    context.guarded = True
                    await self.app(scope, receive, send)
                else:
                    body = await read_body(context, scope, receive, self.settings)
                    if not body.ok:  # no hold can be estimated: nothing behind us runs
                        refused = body_refusal(body, self.settings)
                        if refused is not None:
                            await send_error(send, context, *refused)
                        else:
                            context.outcome = "client_disconnected"
                    else:
                        outcome = await self._hold(ledger, context, budget_id, body, scope)
                        if isinstance(outcome, tuple):
                            await send_error(send, context, *outcome)  # nothing behind us runs
                        else:
                            hold = outcome
                            context.guarded = True
                            await self.app(scope, receive, send)
            except BaseException as exc:
                if isinstance(exc, asyncio.CancelledError):
                    host_cancelled(context)  # recorded as cut by the host, settled below
                await self._settled(ledger, context, hold)
                raise exc
            if self._shield:
                await self._settled(ledger, context, hold)
            else:  # nothing to shield (`_settled`): one coroutine frame fewer, or none
                pending = self._settle(ledger, context, hold)
                if pending is not None:
                    await pending
        finally:  # no await here (a compiled coroutine's `finally` must not: above)
            if owner is not None:
                owner.request_finished(context)

    async def _settled(self, ledger: Ledger, context: RequestContext, hold: Hold | None) -> None:
        # Shielded: a cancelled request (client gone, server stopping) still settles;
        # every routed request leaves its usage record.
        pending = self._settle(ledger, context, hold)
        if pending is None:
            return
        if self._shield:
            with anyio.CancelScope(shield=True):
                await pending
        else:
            await pending

    async def budget_for(self, ledger: Ledger, budget_id: str) -> BudgetConfig | None:
        """A budget set in the store wins over the file's, so operators can change a
        limit without a restart."""
        stored = await ledger.stored_budget(budget_id)
        return stored if stored is not None else self.budgets.get(budget_id)

    async def _hold(
        self,
        ledger: Ledger,
        context: RequestContext,
        budget_id: str,
        body: RequestBody,
        scope: Scope,
    ) -> Hold | tuple[str, str]:
        """The hold, or the local error (code, message) refusing the request."""
        parsed = request_json(context, body)  # notes the requested model, as the walker does
        buffered = body.buffered
        # Each byte by its value (`PLUS`: security/values.py says why).
        if buffered and (parsed is None or PLUS in buffered or AMPERSAND in buffered):
            charset = unreadable_request_charset(scope)
            if charset is not None:
                # An upstream decoding it (Express) reads other keys than the hold would.
                return "bad_request", unreadable_charset(budget_id, charset)
        if parsed is None:
            try:
                # A compressed body is estimated as the upstream that decodes it reads it,
                # up to replay_buffer decoded, as a plain body is: 8 KB of gzip decoding to
                # 8 MiB of `[{}, {}, ...]` cost 210 MB and a quarter second of the loop.
                decoded = decoded_request_json(scope, body, self.settings.replay_buffer)
                if decoded is not None:
                    buffered, parsed = decoded
                else:
                    unreadable = unreadable_request_coding(scope, body)
                    if unreadable is not None:
                        # default_hold for a body the upstream may decode and run whole.
                        return "bad_request", unreadable_coding(budget_id, unreadable)
                    # An integer of thousands of digits: JSON to Go's and Node's readers.
                    parsed = estimated_request_json(body)
            except NestedTooDeep:
                # default_hold for a body Node's and Go's readers take whole.
                return "bad_request", nested_too_deep(budget_id)
            if parsed is not None and isinstance(parsed.get("model"), str):
                context.request_model = context.request_model or parsed["model"][:MAX_NAME]
        # The stored budget's read and the hold together wait the request's deadline or
        # one ledger call's timeout at most: each waited the ledger's timeout (5 s) for a
        # locked file, so a 5 s route answered after up to 10 s, 504 if the lock went.
        wait = context.remaining
        timeout = self._ledger_timeout
        if timeout is not None:
            wait = min(wait, timeout)
        # A scope costs a budgeted request about 23 µs (a fifth of the guard's CPU), so it
        # is entered only where it can cut: not for a ledger that never suspends (the
        # in-memory one); nor, with the deadline at least one ledger timeout away, while
        # the budget's read did not wait (cached): the hold's own timeout bounds it then.
        whole = self._shield and (timeout is None or wait < timeout)
        started = time.monotonic()
        try:
            with anyio.fail_after(max(wait, 0.0)) if whole else _UNBOUNDED:
                budget = await self.budget_for(ledger, budget_id)
                if budget is None:
                    # A route naming a budget nobody defined: fail closed, like an
                    # unreachable ledger, rather than let unmetered traffic through.
                    logger.warning(
                        "route %s names an unknown budget %s", context.route.id, budget_id
                    )
                    return "budget_unavailable", undefined(budget_id)
                amount = self._estimate(context, buffered, parsed, budget.default_hold)
                waited = time.monotonic() - started
                if whole or not self._shield or waited < _READ_DID_NOT_WAIT:
                    hold = await ledger.hold(budget_id, budget, amount)
                else:  # the read waited (not cached): the hold has what it left
                    with anyio.fail_after(max(wait - waited, 0.0)):
                        hold = await ledger.hold(budget_id, budget, amount)
        except BudgetUnreadable:
            return "budget_unavailable", unreadable_budget(budget_id)
        except LedgerUnavailable:
            return "budget_unavailable", LEDGER_UNREACHABLE
        except TimeoutError:
            if wait < _LEDGER_GRACE and (timeout is None or wait < timeout):
                # The deadline left a healthy ledger no time (x-gateway-deadline-ms: 3):
                # the deadline's answer, not a ledger failure's.
                return "deadline_exceeded", f"{deadline_message(context)}{_BEFORE_THE_HOLD}"
            return "budget_unavailable", ledger_too_slow(wait)
        if hold is not None:
            return hold
        if to_units(amount) == 0 and to_units(budget.limit) == 0:
            # No hold to lower (`room_needed`): it is the limit of 0 that refuses.
            return "budget_exceeded", limit_zero(budget_id, self._in_memory)
        if room_needed(to_units(amount)) > to_units(budget.limit):
            estimated = amount != budget.default_hold
            refusal = over_the_whole_limit(budget_id, amount, estimated, self._in_memory)
            return "budget_exceeded", refusal
        return "budget_exceeded", exceeded(budget_id, self._in_memory)

    def _estimate(
        self, context: RequestContext, buffered: bytes | None, parsed: Any, default_hold: Decimal
    ) -> Decimal:
        """The most the request can cost on any candidate of its plan: priced as the
        caller's model, and as each `model` a candidate rewrites it to (a caller's
        placeholder or unpriced name would otherwise get default_hold for what the
        upstream is sent as a priced model)."""
        prices = self.prices
        amount = prices.estimate_hold(buffered, context.request_model, default_hold, parsed=parsed)
        models = {u.model for n in context.route.plan if (u := context.upstreams.get(n))}
        if isinstance(parsed, dict):
            # `Model` is the model to an upstream reading keys in any case (Go, ASP.NET).
            named = named_values(parsed, _MODEL_KEY).get("model", ())
            models.update(m[:MAX_NAME] for m in named if isinstance(m, str))
        models.discard(None)
        models.discard(context.request_model)
        for model in models:
            rewritten = prices.estimate_hold(buffered, model, default_hold, parsed=parsed)
            amount = max(amount, rewritten)
        return amount

    def _settle(
        self, ledger: Ledger, context: RequestContext, hold: Hold | None
    ) -> Coroutine[Any, Any, None] | None:
        """The settlement and the usage record: the ledger's calls to await, or None when
        the ledger answered them at the call (the memory ledger: no coroutine)."""
        cost, priced_as = priced_usage(self.prices, context)
        charged = None if hold is None else charge(context, hold.amount, cost)
        now = self._ledger_now
        if now is not None:
            if hold is not None and charged is not None:
                now.settle_now(hold, charged)  # 0: released
            now.record_usage_now(usage_record(context, cost, charged, priced_as=priced_as))
            return None
        return self._settle_in(ledger, context, hold, cost, charged, priced_as)

    async def _settle_in(
        self,
        ledger: Ledger,
        context: RequestContext,
        hold: Hold | None,
        cost: Decimal | None,
        charged: Decimal | None,
        priced_as: str | None,
    ) -> None:
        one_step = self._one_step
        if one_step is not None:
            record = usage_record(context, cost, charged, priced_as=priced_as)
            try:
                await one_step.settle_and_record(hold, charged or Decimal(0), record)
            except LedgerUnavailable:
                # Not kept for later (the PostgreSQL ledger keeps what an outage refused
                # before sending, and a settlement whose answer was lost): the hold stays
                # in the ledger and is settled at its amount when it goes stale. The outage
                # itself is logged by the ledger, once when it starts and once when it
                # ends: nothing per request.
                logger.debug("route %s: settlement and usage record failed", context.route.id)
            return
        try:
            if hold is not None and charged is not None:
                if not charged:
                    await ledger.release(hold)
                else:
                    await ledger.settle(hold, charged)
        except LedgerUnavailable:
            logger.debug("route %s: settlement failed, ledger unavailable", context.route.id)
        await write_record(ledger, context, cost, charged, priced_as=priced_as)
