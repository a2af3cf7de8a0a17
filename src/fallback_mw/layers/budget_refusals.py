"""What the budget guard says when it refuses (SPEC §12: every refusal says what would
change it, never the store's URL): the 402 and 503 messages of `layers.guard`, one place."""

from __future__ import annotations

from decimal import Decimal

from fallback_mw.budget.cost import format_money
from fallback_mw.config import budget_section, command_option
from fallback_mw.request.json_depth import json_depth_limit


# Each refusal says what would change it (SPEC §12), never the store's URL.
def unreadable_budget(budget_id: str) -> str:
    return (
        f"budget {budget_id!r} is stored in a form this gateway cannot read (a window or amount "
        "another version or a hand edit wrote): refusing (fail closed); `fallback-mw budgets "
        f"set {command_option('--budget', budget_id)} --limit ...` stores it again in a form every "
        "version reads"
    )


LEDGER_UNREACHABLE = (
    "the budget ledger ([gateway] store) cannot be reached: refusing (fail closed) until it "
    "answers again; a route without a budget is not metered and keeps serving"
)


def ledger_too_slow(wait: float) -> str:
    return (
        f"the budget ledger ([gateway] store) did not answer within {wait * 1000:.0f} ms (this "
        "request's deadline, or the ledger's own timeout): refusing (fail closed); another "
        "process may hold its write lock; a route without a budget is not metered and keeps "
        "serving"
    )


# "Give it one" said neither how nor where a ledger comes from.
NO_LEDGER = (
    "this route has a budget but the BudgetGuard has no ledger: refusing (fail closed); "
    "give it one, BudgetGuard(..., ledger=open_ledger(store)) with open_ledger from "
    "fallback_mw.store.ledgers (store: the [gateway] store URL, or None for memory; close it "
    "with its aclose()), as Gateway builds its own"
)


def raise_limit(budget_id: str, in_memory: bool) -> str:
    """Where a budget's limit is raised. `budgets set` writes the store the gateways share;
    a ledger in the process's memory (no [gateway] store) no command reaches: the file."""
    if in_memory:
        return (
            f"{budget_section(budget_id)} limit in the configuration, then restart the "
            "gateway (with no [gateway] store its spend is kept in this process's memory, "
            "which no command reaches)"
        )
    return (
        f"`fallback-mw budgets set {command_option('--budget', budget_id)} --limit AMOUNT`, "
        f"or {budget_section(budget_id)} limit"
    )


def exceeded(budget_id: str, in_memory: bool) -> str:
    return (
        f"budget {budget_id!r} has no room for this request in its current window (its limit "
        f"is spent or held): raise its limit ({raise_limit(budget_id, in_memory)}), or wait "
        "for its next window"
    )


def limit_zero(budget_id: str, in_memory: bool) -> str:
    """A request that holds nothing, refused by a limit of 0 (docs/budgets.md: it refuses
    every request; a hold of 0 needs room too, `room_needed`): no lower hold serves it."""
    return (
        f"budget {budget_id!r}'s limit is 0, which refuses every request; to serve this "
        f"route's requests, raise it ({raise_limit(budget_id, in_memory)})"
    )


def over_the_whole_limit(budget_id: str, amount: Decimal, estimated: bool, in_memory: bool) -> str:
    """The hold alone is more than the limit: no window will ever have room for it, so
    waiting changes nothing (what `exceeded` would suggest)."""
    if estimated:
        why = (
            "estimated from its model's price and its output limit (the largest of "
            "max_tokens, max_completion_tokens, max_output_tokens, times n / best_of)"
        )
        change = "ask for fewer output tokens (a lower max_tokens, or n) or raise the limit"
    else:
        why = f"budget {budget_id!r}'s default_hold, for a request it cannot estimate"
        change = "raise the limit, or lower default_hold"
    return (
        f"this request needs a hold of {format_money(amount)} ({why}), more than budget "
        f"{budget_id!r}'s whole limit: no window has room for it; {change} "
        f"({raise_limit(budget_id, in_memory)})"
    )


def unreadable_coding(budget_id: str, coding: str) -> str:
    return (
        f"the request body is sent in {coding}, which the gateway cannot read to estimate "
        f"budget {budget_id!r}'s hold (an upstream that decodes it would run whatever it "
        "asks for): send the body uncompressed, or in gzip or deflate; nothing was sent "
        "upstream"
    )


def unreadable_charset(budget_id: str, charset: str) -> str:
    return (
        f"the request body is declared in {charset} (the Content-Type's charset), which the "
        f"gateway does not decode to estimate budget {budget_id!r}'s hold (an upstream that "
        "decodes it would run what it asks for, which the hold did not read): send the body "
        "in UTF-8; nothing was sent upstream"
    )


def nested_too_deep(budget_id: str) -> str:
    limit = json_depth_limit()  # the running Python's: 3.11 reads ~1,000, 3.13 ~10,000
    levels = "" if limit is None else f" (about {round(limit, -2):,} levels)"
    return (
        f"the request body is JSON nested deeper than the gateway reads{levels} "
        f"to estimate budget {budget_id!r}'s hold (an upstream reading it, Node's or Go's, "
        "would run what it asks for, which the hold did not read): send it nested less "
        "deeply; nothing was sent upstream"
    )


def undefined(budget_id: str) -> str:
    return (
        f"budget {budget_id!r}, which this route spends, is defined neither in the "
        f"configuration ({budget_section(budget_id)}) nor in the store: refusing (fail closed); "
        f"define it (`fallback-mw budgets set {command_option('--budget', budget_id)} --limit "
        f"AMOUNT`) or "
        f"correct the route's budget"
    )
