"""`fallback-mw usage`: its flags and help. Its handler is cli/usage.py, imported when the
verb runs: the parser (`--help`, a usage error) imports none of what a verb needs."""

from __future__ import annotations

import argparse
from typing import Any

from fallback_mw.cli.app import Console, leaf
from fallback_mw.cli.verbs.shared import INCIDENT_SCAN, store_options


def usage(args: argparse.Namespace, console: Console) -> None:
    from fallback_mw.cli.usage import usage as run

    run(args, console)


def register(subparsers: Any) -> None:
    parser = leaf(subparsers, "usage", usage, "what each routed request cost, who served it")
    store_options(parser)
    parser.add_argument(
        "--since",
        help="only records since then, e.g. 1h, 2d, 2026-11-30 or 2026-11-30T12:00 (UTC); "
        "default: no limit in time",
    )
    parser.add_argument("--route", metavar="ID", help="only this route's requests")
    parser.add_argument("--tenant", help="only this tenant's requests")
    parser.add_argument(
        "--limit",
        type=int,
        default=100,
        metavar="N",
        help="newest N records (default 100); with --incidents, the newest N incidents",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument(
        "--incidents",
        action="store_true",
        help="only requests that failed over, skipped a candidate, ended in a local error or "
        "were served an upstream's 5xx, with their trails "
        f"(searches the newest {INCIDENT_SCAN} records)",
    )
