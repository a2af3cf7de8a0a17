"""`fallback-mw eval`: the route-plan evaluation (evaluation/): the four arms over loopback,
a printed table and the JSON artifact."""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fallback_mw.cli.app import Console, Failed, Refused, writable_out, write_atomically
from fallback_mw.cli.evaluation.arms import arms, run_arms
from fallback_mw.cli.evaluation.gateway import GatewayDidNotStart
from fallback_mw.cli.evaluation.html import render
from fallback_mw.cli.evaluation.report import summarise, table, verdict
from fallback_mw.extras import require
from fallback_mw.quoting import printable

MAX_REQUESTS = 100_000
MAX_CONCURRENCY = 1000


def html_path(out: Path) -> Path:
    """The HTML page beside the JSON artifact: the same name, `.html`."""
    return out.with_name(out.name + ".html") if out.suffix == ".html" else out.with_suffix(".html")


def handle(args: argparse.Namespace, console: Console) -> int:
    require("serve", "the eval command")  # each arm runs `fallback-mw serve`
    if not 1 <= args.requests <= MAX_REQUESTS:
        raise Refused(f"--requests must be between 1 and {MAX_REQUESTS}")
    if not 1 <= args.concurrency <= MAX_CONCURRENCY:
        raise Refused(f"--concurrency must be between 1 and {MAX_CONCURRENCY}")
    out = Path(args.out)
    writable_out(out, args.out)  # before the arms run (minutes with a large --requests)
    started = datetime.now(UTC)
    try:
        with tempfile.TemporaryDirectory(prefix="fallback-mw-eval-") as workdir:
            runs = asyncio.run(
                run_arms(
                    arms(args.primary),
                    args.requests,
                    args.concurrency,
                    Path(workdir),
                    breaker=args.breaker == "on",
                    port=args.port,
                )
            )
    except GatewayDidNotStart as exc:
        raise Failed(str(exc).splitlines()[0]) from None
    summaries = [summarise(r) for r in runs]
    passed, line = verdict(summaries)
    breaker = "on (the gateway's defaults)" if args.breaker == "on" else "held closed"
    artifact: dict[str, Any] = {
        "tool": "fallback-mw eval",
        "started_at": started.isoformat(),
        "primary": args.primary,
        "breaker": breaker,
        "requests_per_arm": args.requests,
        "concurrency": args.concurrency,
        "arms": summaries,
        "verdict": {"passed": passed, "line": line},
    }
    console.print(
        f"route-plan evaluation: primary {args.primary}, {args.requests} requests per arm, "
        f"{args.concurrency} in flight, breaker {breaker}"
    )
    for row in table(summaries).splitlines():
        console.print(row)
    console.print(line)
    page = html_path(out)
    latencies = [[o.ms for o in r.outcomes] for r in runs]
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        # Each whole or not at all: a full disk leaves an earlier run's files as they were.
        write_atomically(out, json.dumps(artifact, indent=2) + "\n")
        write_atomically(page, render(artifact, latencies, (passed, line)))
    except OSError as exc:
        raise Failed(f"cannot write {args.out}: {exc.strerror or exc}") from None
    console.print(f"wrote {printable(str(out))} and {printable(str(page))}")
    return 0 if passed else 1
