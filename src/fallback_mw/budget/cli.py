"""`fallback-mw budgets show|set` and `fallback-mw usage`: the ledger from a terminal.

Every verb finds the store from `--store URL` or `--config FILE` (its `gateway.store`)."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime, timedelta
from decimal import Decimal, InvalidOperation
from typing import Any

import anyio

from fallback_mw.budget import Ledger, LedgerUnavailable, UsageRecord, open_ledger
from fallback_mw.budget.cost import format_money
from fallback_mw.config import MAX_MONEY, BudgetConfig, ConfigError, load_config
from fallback_mw.store.url import StoreURLError

_RELATIVE = re.compile(r"^(\d+)([smhdw])$")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def register(subparsers: Any) -> None:
    budgets = subparsers.add_parser("budgets", help="show or change spend budgets")
    verbs = budgets.add_subparsers(dest="budgets_command", metavar="VERB")
    verbs.required = True

    show = verbs.add_parser("show", help="limit, spent, held and window of each budget")
    _store_arguments(show)
    show.add_argument("--budget", metavar="ID", help="only this budget")
    show.set_defaults(handler=cmd_budgets_show)

    change = verbs.add_parser("set", help="create or change a budget in the store")
    _store_arguments(change)
    change.add_argument("--budget", metavar="ID", required=True)
    change.add_argument("--limit", metavar="AMOUNT", help="currency units, e.g. 10.00")
    change.add_argument("--window", choices=("day", "month", "total"))
    change.add_argument("--default-hold", metavar="AMOUNT", dest="default_hold")
    change.set_defaults(handler=cmd_budgets_set)

    usage = subparsers.add_parser("usage", help="what each routed request cost, who served it")
    _store_arguments(usage)
    usage.add_argument("--since", help="e.g. 1h, 2d, 2026-11-30 or 2026-11-30T12:00 (UTC)")
    usage.add_argument("--route", metavar="ID")
    usage.add_argument("--tenant")
    usage.add_argument("--limit", type=int, default=100, help="newest N records (default 100)")
    usage.add_argument("--json", action="store_true", help="one JSON object per line")
    usage.set_defaults(handler=cmd_usage)


def _store_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--store", metavar="URL", help="sqlite:///path.db or postgresql://...")
    group.add_argument("--config", metavar="FILE", help="gateway TOML file naming the store")


def _fail(message: str, status: int = 2) -> int:
    print(f"fallback-mw: error: {message}", file=sys.stderr)
    return status


def _open(args: argparse.Namespace) -> tuple[Ledger, dict[str, BudgetConfig]]:
    """The ledger and the budgets defined in the config file (if one was given)."""
    configured: dict[str, BudgetConfig] = {}
    store: str | None = args.store
    if args.config is not None:
        config = load_config(args.config, check_env=False)
        configured = dict(config.budgets)
        store = config.gateway.store
        if store is None:
            raise ConfigError(f"{args.config}: gateway.store is not set (budgets need a store)")
    assert store is not None
    try:
        return open_ledger(store), configured
    except StoreURLError as exc:
        raise ConfigError(str(exc)) from None


def _with_ledger(
    args: argparse.Namespace,
    action: Callable[[Ledger, dict[str, BudgetConfig]], Awaitable[int]],
) -> int:
    ledger, configured = _open(args)

    async def run() -> int:
        try:
            return await action(ledger, configured)
        except LedgerUnavailable as exc:
            return _fail(str(exc), status=1)
        finally:
            await ledger.aclose()

    return anyio.run(run)


# --- budgets show ---------------------------------------------------------------------


def cmd_budgets_show(args: argparse.Namespace) -> int:
    async def action(ledger: Ledger, configured: dict[str, BudgetConfig]) -> int:
        budgets = dict(configured)
        budgets.update(await ledger.stored_budgets())  # the store wins, as in the gateway
        if args.budget is not None:
            if args.budget not in budgets:
                return _fail(f"no budget {args.budget!r} in the store or the config")
            budgets = {args.budget: budgets[args.budget]}
        rows = [("BUDGET", "WINDOW", "PERIOD", "LIMIT", "SPENT", "HELD", "REMAINING")]
        for budget_id in sorted(budgets):
            status = await ledger.status(budget_id, budgets[budget_id])
            rows.append(
                (
                    budget_id,
                    status.window,
                    status.window_start,
                    format_money(status.limit),
                    format_money(status.spent),
                    format_money(status.held),
                    format_money(status.remaining),
                )
            )
        _print_table(rows)
        return 0

    return _with_ledger(args, action)


# --- budgets set ----------------------------------------------------------------------


def _money(value: str | None, name: str) -> Decimal | None:
    if value is None:
        return None
    try:
        amount = Decimal(value)
    except InvalidOperation:
        raise ConfigError(f"--{name} must be a decimal amount") from None
    if not amount.is_finite() or amount < 0:
        raise ConfigError(f"--{name} must be a finite amount >= 0")
    if amount > MAX_MONEY:
        raise ConfigError(f"--{name} must be at most {MAX_MONEY} (the ledger's largest amount)")
    return amount


def cmd_budgets_set(args: argparse.Namespace) -> int:
    limit = _money(args.limit, "limit")
    default_hold = _money(args.default_hold, "default-hold")
    budget_id: str = args.budget
    if not budget_id or len(budget_id) > 200:
        raise ConfigError("--budget must be 1..200 characters")

    async def action(ledger: Ledger, configured: dict[str, BudgetConfig]) -> int:
        current = await ledger.stored_budget(budget_id) or configured.get(budget_id)
        if current is None and limit is None:
            return _fail(f"budget {budget_id!r} does not exist yet: --limit is required")
        fields: dict[str, Any] = current.model_dump() if current is not None else {}
        if limit is not None:
            fields["limit"] = limit
        if args.window is not None:
            fields["window"] = args.window
        if default_hold is not None:
            fields["default_hold"] = default_hold
        budget = BudgetConfig(**fields)
        await ledger.set_budget(budget_id, budget)
        print(
            f"budget {budget_id}: limit {format_money(budget.limit)} per {budget.window}, "
            f"default hold {format_money(budget.default_hold)}"
        )
        return 0

    return _with_ledger(args, action)


# --- usage ----------------------------------------------------------------------------


def parse_since(value: str, now: datetime | None = None) -> datetime:
    """`90s`, `30m`, `1h`, `2d`, `1w` ago, or an ISO date / time (UTC when naive)."""
    match = _RELATIVE.match(value.strip())
    if match:
        seconds = int(match.group(1)) * _SECONDS[match.group(2)]
        return (now or datetime.now(UTC)) - timedelta(seconds=seconds)
    try:
        moment = datetime.fromisoformat(value.strip())
    except ValueError:
        raise ConfigError(f"--since {value!r}: use e.g. 1h, 2d or 2026-11-30T12:00") from None
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment


def cmd_usage(args: argparse.Namespace) -> int:
    since = parse_since(args.since) if args.since else None
    if args.limit < 1:
        raise ConfigError("--limit must be >= 1")

    async def action(ledger: Ledger, configured: dict[str, BudgetConfig]) -> int:
        records = await ledger.usage(
            since=since, route=args.route, tenant=args.tenant, limit=args.limit
        )
        if args.json:
            for record in records:
                print(json.dumps(usage_json(record), separators=(",", ":")))
            return 0
        rows = [
            (
                "TIME",
                "ROUTE",
                "TENANT",
                "ATTEMPTS",
                "CHOSEN",
                "OUTCOME",
                "TOKENS",
                "COST",
                "CHARGED",
            )
        ]
        for record in records:
            rows.append(
                (
                    record.at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                    record.route,
                    record.tenant,
                    _attempts_text(record),
                    record.chosen or "-",
                    record.outcome or "-",
                    f"{_n(record.input_tokens)}/{_n(record.output_tokens)}",
                    "-" if record.cost is None else format_money(record.cost),
                    "-" if record.charged is None else format_money(record.charged),
                )
            )
        _print_table(rows)
        return 0

    return _with_ledger(args, action)


def usage_json(record: UsageRecord) -> dict[str, Any]:
    return {
        "at": record.at.astimezone(UTC).isoformat(),
        "request_id": record.request_id,
        "route": record.route,
        "tenant": record.tenant,
        "budget": record.budget_id,
        "candidates": list(record.candidates),
        "attempts": [a.as_dict() for a in record.attempts],
        "chosen": record.chosen,
        "outcome": record.outcome,
        "status": record.status,
        "model": record.model,
        "input_tokens": record.input_tokens,
        "output_tokens": record.output_tokens,
        "cost": None if record.cost is None else format_money(record.cost),
        "charged": None if record.charged is None else format_money(record.charged),
    }


def _attempts_text(record: UsageRecord) -> str:
    parts = []
    for attempt in record.attempts:
        if attempt.skipped:
            parts.append(f"{attempt.candidate}:skipped({attempt.skipped})")
        elif attempt.status is not None:
            parts.append(f"{attempt.candidate}:{attempt.status}")
        else:
            parts.append(f"{attempt.candidate}:{attempt.failure or '?'}")
    return ",".join(parts) or "-"


def _n(value: int | None) -> str:
    return "-" if value is None else str(value)


def _print_table(rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        )
