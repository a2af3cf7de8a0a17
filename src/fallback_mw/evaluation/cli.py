"""The `eval` verb: `register(subparsers)` adds it to the `fallback-mw` command tree."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fallback_mw.evaluation.arms import arms, run_arms
from fallback_mw.evaluation.gateway import GatewayDidNotStart
from fallback_mw.evaluation.report import summarise, table

DEFAULT_OUT = "results/route-plan-eval.json"
MAX_REQUESTS = 100_000


def _error(message: str, status: int) -> int:
    print(f"fallback-mw: error: {message}", file=sys.stderr)
    return status


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.requests <= MAX_REQUESTS:
        return _error(f"--requests must be between 1 and {MAX_REQUESTS}", 2)
    if not 1 <= args.concurrency <= 1000:
        return _error("--concurrency must be between 1 and 1000", 2)
    out = Path(args.out)
    if out.exists() and out.is_dir():
        return _error(f"--out {args.out} is a directory", 2)
    started = datetime.now(UTC)
    try:
        with tempfile.TemporaryDirectory(prefix="fallback-mw-eval-") as workdir:
            runs = asyncio.run(
                run_arms(arms(args.primary), args.requests, args.concurrency, Path(workdir))
            )
    except GatewayDidNotStart as exc:
        return _error(str(exc).splitlines()[0], 1)
    summaries = [summarise(r) for r in runs]
    artifact: dict[str, Any] = {
        "tool": "fallback-mw eval",
        "started_at": started.isoformat(),
        "primary": args.primary,
        "requests_per_arm": args.requests,
        "concurrency": args.concurrency,
        "arms": summaries,
    }
    print(
        f"route-plan evaluation: primary {args.primary}, {args.requests} requests per arm, "
        f"{args.concurrency} in flight"
    )
    print(table(summaries))
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(artifact, indent=2) + "\n")
    except OSError as exc:
        return _error(f"cannot write {args.out}: {exc.strerror or exc}", 1)
    print(f"wrote {out}")
    return 0


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "eval",
        help="the route-plan evaluation: four arms over loopback sockets, table + JSON",
        description="Run the four arms (failing/healthy primary x single upstream/ordered "
        "plan) against scripted loopback upstreams through a real `fallback-mw serve`.",
    )
    parser.add_argument("--requests", type=int, default=300, help="requests per arm (300)")
    parser.add_argument(
        "--primary",
        choices=["fail", "hang"],
        default="fail",
        help="how the failing primary fails: a fast 503, or accepting and never answering",
    )
    parser.add_argument("--concurrency", type=int, default=10, help="requests in flight (10)")
    parser.add_argument("--out", default=DEFAULT_OUT, metavar="FILE", help=f"({DEFAULT_OUT})")
    # The tree calls handler(args, console); this verb prints for itself.
    parser.set_defaults(handler=lambda args, _console: run(args))
