"""`fallback-mw faults ...`: its flags and help. Its handler is cli/faults.py, imported when
the verb runs: the parser (`--help`, a usage error) imports none of what a verb needs."""

from __future__ import annotations

import argparse
from typing import Any

from fallback_mw.cli.app import Console, leaf
from fallback_mw.cli.verbs.shared import store_options
from fallback_mw.faults import UPSTREAM_FAULTS


def faults_set(args: argparse.Namespace, console: Console) -> None:
    from fallback_mw.cli.faults import faults_set as run

    run(args, console)


def faults_clear(args: argparse.Namespace, console: Console) -> None:
    from fallback_mw.cli.faults import faults_clear as run

    run(args, console)


def faults_list(args: argparse.Namespace, console: Console) -> None:
    from fallback_mw.cli.faults import faults_list as run

    run(args, console)


def register(subparsers: Any) -> None:
    faults = subparsers.add_parser(
        "faults", help="game-day fault injection", description="game-day fault injection"
    )
    verbs = faults.add_subparsers(dest="faults_verb", metavar="VERB", required=True)

    fset = leaf(verbs, "set", faults_set, "set a fault with an expiry; prints the expiry")
    store_options(fset)
    fset.add_argument(
        "kind",
        choices=[*UPSTREAM_FAULTS, "pin"],
        help="fail: a synthetic 503; hang: no answer until the timeout; blackhole: a listener "
        "that never answers; revoke: a 401; pin: the route's plan starts at --candidate",
    )
    fset.add_argument("--upstream", metavar="NAME", help="the upstream to fault (not pin)")
    fset.add_argument("--route", metavar="ID", help="pin: the route whose plan is pinned")
    fset.add_argument("--candidate", metavar="NAME", help="pin: the candidate to start at")
    fset.add_argument(
        "--ttl",
        type=int,
        required=True,
        metavar="SECONDS",
        help="the fault expires by itself after this",
    )
    fset.add_argument(
        "--replace",
        action="store_true",
        help="replace an active fault on the same target (otherwise refused)",
    )

    fclear = leaf(verbs, "clear", faults_clear, "clear faults: one selector, or --all")
    store_options(fclear)
    which = fclear.add_mutually_exclusive_group(required=True)  # SPEC §10: no bare clear
    which.add_argument("--upstream", metavar="NAME", help="the faults on this upstream")
    which.add_argument("--route", metavar="ID", help="the pin on this route")
    which.add_argument("--all", action="store_true", help="every fault in the store")

    store_options(leaf(verbs, "list", faults_list, "list active faults"))
