"""`fallback-mw capacity`: its flags and help. Its handler is cli/capacity.py, imported when
the verb runs: the parser (`--help`, a usage error) imports none of what a verb needs."""

from __future__ import annotations

import argparse
from typing import Any

from fallback_mw.cli.app import Console, leaf
from fallback_mw.cli.verbs.shared import store_options


def capacity(args: argparse.Namespace, console: Console) -> int | None:
    from fallback_mw.cli.capacity import capacity as run

    return run(args, console)


def register(subparsers: Any) -> None:
    parser = leaf(
        subparsers,
        "capacity",
        capacity,
        "can each fallback carry its primary's peak? For each route, the busiest minute in "
        "the usage records (requests, tokens) against each fallback's declared rpm / tpm, "
        "with the ratio; exit 1 when one cannot carry it with the margin",
    )
    store_options(parser)
    parser.add_argument("--since", default="7d", help="window of usage records (default 7d)")
    parser.add_argument(
        "--margin", default="1.2", help="headroom a fallback must have (default 1.2)"
    )
    parser.add_argument(
        "--strict", action="store_true", help="exit 1 also when a limit or a peak is unknown"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
