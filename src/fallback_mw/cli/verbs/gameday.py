"""`fallback-mw gameday`: its flags and help. Its handler is cli/gameday.py, imported when
the verb runs: the parser (`--help`, a usage error) imports none of what a verb needs."""

from __future__ import annotations

import argparse
from typing import Any

from fallback_mw.cli.app import Console, leaf
from fallback_mw.cli.verbs.shared import store_options
from fallback_mw.faults import UPSTREAM_FAULTS


def handle(args: argparse.Namespace, console: Console) -> None:
    from fallback_mw.cli.gameday import handle as run

    run(args, console)


def register(subparsers: Any) -> None:
    parser = leaf(
        subparsers,
        "gameday",
        handle,
        "a fault with written predictions and abort criteria, watched and reported",
    )
    store_options(parser)
    parser.add_argument("--route", required=True, metavar="ID", help="the route under test")
    parser.add_argument(
        "--fault",
        required=True,
        choices=[*UPSTREAM_FAULTS, "pin"],
        help="the fault to set for --duration (see `fallback-mw faults set --help`)",
    )
    parser.add_argument(
        "--candidate",
        metavar="NAME",
        help="fail/hang/blackhole/revoke: the upstream to fault (default: the route's "
        "primary); pin: the candidate the plan starts at",
    )
    parser.add_argument(
        "--owner",
        metavar="NAME",
        help="the one person who may call the abort (in the report; default: the login "
        "name running the command)",
    )
    parser.add_argument(
        "--prometheus",
        metavar="URL",
        help="a Prometheus whose /api/v1/alerts is polled: alert:NAME<=DURATION predictions "
        "are checked against it, and the alerts that fired are in the report",
    )
    parser.add_argument(
        "--recovery-wait",
        default="30s",
        metavar="DURATION",
        help="after the revert, how long to wait for the primary to serve again (default 30s)",
    )
    parser.add_argument(
        "--duration",
        required=True,
        metavar="DURATION",
        help="how long the fault stays set (its expiry), e.g. 15m, 90s",
    )
    parser.add_argument(
        "--predict",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a prediction written before the fault, judged PASS / FAIL in the report, e.g. "
        "breaker_open_s=20, p99_ms=3500, error_rate=1%%, recovery_s=10, "
        "'alert:FallbackMwBreakerOpen<=90s' (quoted: the shell reads < as a redirect; "
        "repeatable; at least one)",
    )
    parser.add_argument(
        "--abort",
        action="append",
        default=[],
        metavar="NAME=VALUE[/WINDOW]",
        help="a criterion that clears the fault at once when it holds, e.g. "
        "error_rate=1%%/60s, p99_ms=6000, secondary_429=5%% (repeatable; at least one)",
    )
    parser.add_argument(
        "--out",
        metavar="FILE",
        help="the JSON report (default results/...); the HTML page is written beside it",
    )
