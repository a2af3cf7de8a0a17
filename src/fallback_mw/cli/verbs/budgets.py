"""`fallback-mw budgets ...`: its flags and help. Its handler is cli/budgets.py, imported
when the verb runs: the parser (`--help`, a usage error) imports none of what a verb
needs."""

from __future__ import annotations

import argparse
from typing import Any

from fallback_mw.cli.app import Console, leaf
from fallback_mw.cli.verbs.shared import store_options


def budgets_show(args: argparse.Namespace, console: Console) -> None:
    from fallback_mw.cli.budgets import budgets_show as run

    run(args, console)


def budgets_set(args: argparse.Namespace, console: Console) -> None:
    from fallback_mw.cli.budgets import budgets_set as run

    run(args, console)


def register(subparsers: Any) -> None:
    budgets = subparsers.add_parser(
        "budgets", help="show or change spend budgets", description="show or change spend budgets"
    )
    verbs = budgets.add_subparsers(dest="budgets_verb", metavar="VERB", required=True)

    show = leaf(verbs, "show", budgets_show, "limit, spent, held and window of each budget")
    store_options(show)
    show.add_argument("--budget", metavar="ID", help="only this budget")

    change = leaf(verbs, "set", budgets_set, "create or change a budget in the store")
    store_options(change)
    change.add_argument(
        "--budget", metavar="ID", required=True, help="the budget to create or change"
    )
    change.add_argument("--limit", metavar="AMOUNT", help="currency units, e.g. 10.00")
    change.add_argument(
        "--window",
        choices=("day", "month", "total"),
        help="day / month: spend starts again at 0 each day / month; total: never",
    )
    change.add_argument(
        "--default-hold",
        metavar="AMOUNT",
        dest="default_hold",
        help="held for a request whose price cannot be read from it",
    )
