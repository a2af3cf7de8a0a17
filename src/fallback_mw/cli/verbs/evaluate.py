"""`fallback-mw eval`: its flags and help. Its handler is cli/evaluate.py, imported when the
verb runs: the parser (`--help`, a usage error) imports none of what a verb needs."""

from __future__ import annotations

import argparse
from typing import Any

from fallback_mw.cli.app import Console, leaf
from fallback_mw.cli.serve_options import port_number

DEFAULT_OUT = "results/route-plan-eval.json"


def handle(args: argparse.Namespace, console: Console) -> int | None:
    from fallback_mw.cli.evaluate import handle as run

    return run(args, console)


def register(subparsers: Any) -> None:
    parser = leaf(
        subparsers,
        "eval",
        handle,
        "the route-plan evaluation: failing/healthy primary x single upstream/ordered plan, "
        "over loopback through a real `fallback-mw serve`; a table and a JSON artifact",
    )
    parser.add_argument(
        "--requests", type=int, default=300, metavar="N", help="requests per arm (default 300)"
    )
    parser.add_argument(
        "--primary",
        choices=["fail", "hang"],
        default="fail",
        help="how the failing primary fails: a fast 503, or accepting and never answering",
    )
    parser.add_argument(
        "--breaker",
        choices=["off", "on"],
        default="off",
        help="off (default): breakers held closed, so the plan is what is measured; "
        "on: the gateway's default breaker, measuring the breaker path",
    )
    parser.add_argument(
        "--concurrency", type=int, default=10, metavar="N", help="requests in flight (default 10)"
    )
    parser.add_argument(
        "--port",
        type=port_number,
        default=0,
        help="the gateway's port, each arm in turn (default: a free port per arm)",
    )
    parser.add_argument(
        "--out",
        default=DEFAULT_OUT,
        metavar="FILE",
        help=f"where the JSON artifact is written (default {DEFAULT_OUT})",
    )
