"""`fallback-mw budgets show|set`: the ledger's budgets from a terminal (SPEC §7, §10).

Budgets are defined in a config file (`[budgets.ID]`) or in the store (`budgets set`; the
store wins, as in the gateway). The ledger records spend by budget id whichever defined it,
so `show` lists every budget the ledger has spend or holds for: given `--store` alone, a
budget defined only in a file shows its spend and window, with its limit unknown ("-")."""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable
from decimal import Decimal, InvalidOperation
from typing import Any, TypeVar

from fallback_mw.budget import BudgetUnreadable, Ledger, LedgerUnavailable
from fallback_mw.budget.cost import format_money
from fallback_mw.cli.app import Console, Failed, Refused, run
from fallback_mw.cli.show import one_line, print_table
from fallback_mw.cli.target import StoreTarget, open_ledger_of, resolve
from fallback_mw.config import MAX_MONEY, BudgetConfig
from fallback_mw.store.model import build_model
from fallback_mw.store_url import StoreURLError

T = TypeVar("T")
UNKNOWN = "-"


def with_ledger(
    args: argparse.Namespace,
    console: Console,
    action: Callable[[Ledger, StoreTarget], Awaitable[T]],
    *,
    creates: bool = False,
) -> T:
    """Run `action` against the store's ledger; an unreachable ledger is a failure (exit 1)."""
    target = resolve(args, console, creates=creates)

    async def main() -> T:
        ledger = open_ledger_of(target)
        try:
            return await action(ledger, target)
        except StoreURLError:
            raise  # an option the driver refuses: a refusal (exit 2), as for the route store
        except LedgerUnavailable as exc:
            raise Failed(str(exc)) from None
        finally:
            await ledger.aclose()

    return run(main)


async def _show_rows(
    ledger: Ledger, target: StoreTarget, only: str | None
) -> list[tuple[str, ...]]:
    defined: dict[str, BudgetConfig] = dict(target.config.budgets)
    if only is None:
        defined.update(await ledger.stored_budgets())  # the store wins, as in the gateway
    else:
        # Only the row asked for is read: another this version cannot read (a window a
        # newer version wrote) does not hide it.
        try:
            stored = await ledger.stored_budget(only)
        except BudgetUnreadable:
            raise BudgetUnreadable.named(only) from None
        if stored is not None:
            defined[only] = stored
    # Budgets with spend but no definition here: defined in a config file not given.
    undefined = {
        budget_id: kind
        for budget_id, kind in (await ledger.recorded_budgets()).items()
        if budget_id not in defined
    }
    if only is not None:
        if only not in defined and only not in undefined:
            raise Failed(f"no budget {only!r} in the store or the config")  # as routes: 1
        defined = {k: v for k, v in defined.items() if k == only}
        undefined = {k: v for k, v in undefined.items() if k == only}
    rows: list[tuple[str, ...]] = []
    for budget_id in sorted({*defined, *undefined}):
        budget = defined.get(budget_id)
        # A file-only budget's limit is not in the store; its window kind is (from its key).
        probe = budget or BudgetConfig(limit=Decimal(0), window=undefined[budget_id])
        status = await ledger.status(budget_id, probe)
        known = budget is not None
        rows.append(
            (
                one_line(budget_id),  # stored before `budgets set` refused controls
                status.window,
                status.window_start,
                format_money(status.limit) if known else UNKNOWN,
                format_money(status.spent),
                format_money(status.held),
                format_money(status.remaining) if known else UNKNOWN,
            )
        )
    return rows


def budgets_show(args: argparse.Namespace, console: Console) -> None:
    async def action(ledger: Ledger, target: StoreTarget) -> list[tuple[str, ...]]:
        return await _show_rows(ledger, target, args.budget)

    rows = with_ledger(args, console, action)
    print_table(
        console, [("BUDGET", "WINDOW", "PERIOD", "LIMIT", "SPENT", "HELD", "REMAINING"), *rows]
    )
    if any(row[3] == UNKNOWN for row in rows):
        console.print(
            "(-: the budget is defined in a config file; pass --config FILE to see its limit)"
        )


def _money(value: str | None, name: str) -> Decimal | None:
    if value is None:
        return None
    try:
        amount = Decimal(value)
    except InvalidOperation:
        raise Refused(f"--{name} must be a decimal amount") from None
    if not amount.is_finite() or amount < 0:
        raise Refused(f"--{name} must be a finite amount >= 0")
    if amount > MAX_MONEY:
        raise Refused(f"--{name} must be at most {MAX_MONEY} (the ledger's largest amount)")
    return amount


def budgets_set(args: argparse.Namespace, console: Console) -> None:
    limit = _money(args.limit, "limit")
    default_hold = _money(args.default_hold, "default-hold")
    budget_id: str = args.budget
    if not budget_id or len(budget_id) > 200 or not budget_id.isprintable():
        # A control character would reach every terminal that runs `budgets show`.
        raise Refused("--budget must be 1..200 printable characters")

    async def action(ledger: Ledger, target: StoreTarget) -> BudgetConfig:
        try:
            stored = await ledger.stored_budget(budget_id)
        except BudgetUnreadable:
            stored = None  # a row this version cannot read: written anew from what is given
        current = stored or target.config.budgets.get(budget_id)
        if current is None and limit is None:
            raise Refused(f"budget {budget_id!r} does not exist yet: --limit is required")
        fields: dict[str, Any] = current.model_dump() if current is not None else {}
        if limit is not None:
            fields["limit"] = limit
        if args.window is not None:
            fields["window"] = args.window
        if default_hold is not None:
            fields["default_hold"] = default_hold
        budget = build_model(BudgetConfig, fields, f"budget {budget_id!r}")
        if 0 < budget.limit < budget.default_hold:
            # Every request the gateway cannot estimate would be refused with 402 even at
            # zero spend (a limit of 0, which refuses everything anyway, is a choice).
            raise Refused(
                f"budget {budget_id!r}: default hold {format_money(budget.default_hold)} is "
                f"above the limit {format_money(budget.limit)}: every request without an "
                "estimate would be refused (402); lower --default-hold or raise --limit"
            )
        await ledger.set_budget(budget_id, budget)
        return budget

    budget = with_ledger(args, console, action, creates=True)
    console.print(
        f"budget {budget_id}: limit {format_money(budget.limit)} per {budget.window}, "
        f"default hold {format_money(budget.default_hold)}"
    )
