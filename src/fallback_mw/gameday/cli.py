"""The `gameday` verb: `register(subparsers)` adds it to the `fallback-mw` command tree.

Exit status: 0 when the exercise ran to its end and every prediction passed; 1 when it
aborted, a prediction failed (or had no data), or the store failed; 2 when it refuses to
start (nothing set); 130 when stopped by SIGINT/SIGTERM (the fault is cleared first)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fallback_mw.budget import LedgerUnavailable, open_ledger
from fallback_mw.config import ConfigError, load_config
from fallback_mw.gameday.report import build_report, print_report, write_report
from fallback_mw.gameday.run import Exercise, GameDayRefused, observe_exercise, run_exercise
from fallback_mw.gameday.spec import SpecError, parse_abort, parse_duration, parse_prediction
from fallback_mw.store.model import StoreError
from fallback_mw.store.routes import open_store
from fallback_mw.store.url import StoreURLError, parse_store_url


def _error(message: str, status: int) -> int:
    print(f"fallback-mw: error: {message}", file=sys.stderr)
    return status


async def _plan(store_url: str, config_routes: dict[str, tuple[str, ...]], route: str) -> Any:
    store = open_store(store_url)
    try:
        plans = dict(config_routes)
        for stored in await store.load_routes():
            plans[stored.route.id] = stored.route.plan
        return plans.get(route)
    finally:
        await store.aclose()


def _exercise(args: argparse.Namespace) -> tuple[Exercise, str]:
    """Everything checked before anything is set: raises SpecError/GameDayRefused."""
    if not args.predict:
        raise GameDayRefused("no --predict: an exercise without a written prediction cannot fail")
    if not args.abort:
        raise GameDayRefused("no --abort: a game day needs at least one numeric abort criterion")
    predictions = tuple(parse_prediction(p) for p in args.predict)
    aborts = tuple(parse_abort(a) for a in args.abort)
    duration = parse_duration(args.duration, "--duration")
    config_routes: dict[str, tuple[str, ...]] = {}
    store_url = args.store
    if args.config:
        config = load_config(args.config, check_env=False)
        config_routes = {r.id: r.plan for r in config.routes}
        store_url = store_url or config.gateway.store
    if not store_url:
        raise GameDayRefused(
            "no store: pass --store URL or --config FILE whose [gateway] sets store"
        )
    try:
        parse_store_url(store_url)
    except StoreURLError as exc:
        raise GameDayRefused(str(exc)) from None
    plan = asyncio.run(_plan(store_url, config_routes, args.route))
    if plan is None:
        raise GameDayRefused(
            f"unknown route {args.route!r} (a route from a config file needs --config FILE)"
        )
    if args.fault == "pin":
        if args.candidate is None or args.candidate not in plan:
            raise GameDayRefused(
                f"--fault pin needs --candidate, one of route {args.route!r}'s candidates "
                f"({', '.join(plan)})"
            )
        if any(p.name == "breaker_open_s" for p in predictions):
            raise GameDayRefused("breaker_open_s needs a fail or hang fault (a pin opens none)")
        target = args.route
    else:
        target = args.candidate or plan[0]
        if target not in plan:
            raise GameDayRefused(
                f"--candidate {target!r} is not one of route {args.route!r}'s candidates "
                f"({', '.join(plan)})"
            )
    exercise = Exercise(
        route=args.route,
        fault=args.fault,
        target=target,
        candidate=args.candidate if args.fault == "pin" else None,
        primary=plan[0],
        duration_s=duration,
        predictions=predictions,
        aborts=aborts,
        poll_s=min(1.0, max(duration / 20, 0.1)),
        grace_s=min(2.0, max(duration / 10, 0.5)),
    )
    return exercise, store_url


def _default_out(route: str) -> Path:
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in route)[:64]
    return Path("results") / f"gameday-{safe}-{stamp}.json"


async def _main(exercise: Exercise, store_url: str, out: Path) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    handled: list[signal.Signals] = []
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
            handled.append(sig)
    store = open_store(store_url)
    ledger = open_ledger(store_url)
    try:
        report: dict[str, Any] = {}

        def started(timeline: Any) -> None:
            # Recorded before anything is watched: the predictions as written.
            report.update(build_report(exercise, timeline, None, status="running"))
            write_report(out, report)

        def emit(line: str) -> None:
            print(line, flush=True)

        timeline = await run_exercise(exercise, store, ledger, stop, emit, started)
        observed = await asyncio.shield(
            observe_exercise(exercise, ledger, timeline, wait=not timeline.interrupted)
        )
        status = (
            "aborted" if timeline.abort else "interrupted" if timeline.interrupted else "completed"
        )
        report = build_report(exercise, timeline, observed, status=status)
        print_report(report)
        write_report(out, report)
        print(f"wrote {out}")
        if timeline.interrupted:
            return 130
        passed = all(p["result"] == "pass" for p in report["predictions"])
        return 0 if status == "completed" and passed else 1
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)
        with contextlib.suppress(Exception):
            await store.aclose()
        with contextlib.suppress(Exception):
            await ledger.aclose()


def run(args: argparse.Namespace) -> int:
    try:
        exercise, store_url = _exercise(args)
    except (SpecError, GameDayRefused, ConfigError) as exc:
        return _error(str(exc), 2)
    except (StoreError, LedgerUnavailable, OSError) as exc:
        return _error(f"store: {exc}", 1)
    out = Path(args.out) if args.out else _default_out(exercise.route)
    if out.is_dir():
        return _error(f"--out {out} is a directory", 2)
    try:
        # The report is written before the fault is set: a path that cannot take it
        # refuses the exercise instead of failing it half-way.
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return _error(f"--out {out}: {exc.strerror or exc}", 2)
    if not os.access(out.parent, os.W_OK):
        return _error(f"--out {out}: the directory is not writable", 2)
    try:
        return asyncio.run(_main(exercise, store_url, out))
    except GameDayRefused as exc:
        return _error(str(exc), 2)
    except (StoreError, LedgerUnavailable, OSError) as exc:
        return _error(f"game day stopped: {exc} (any fault set expires on its own)", 1)
    except KeyboardInterrupt:
        return 130


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "gameday",
        help="a fault with written predictions and abort criteria, watched and reported",
        description="Set a fault on a route for a while, watch the traffic every gateway "
        "records in the store, abort on a criterion, and report each prediction "
        "against what was observed.",
    )
    parser.add_argument("--store", metavar="URL", help="sqlite:///path.db or postgresql://...")
    parser.add_argument("--config", metavar="FILE", help="gateway TOML (its store, its routes)")
    parser.add_argument("--route", required=True, metavar="ID")
    parser.add_argument("--fault", required=True, choices=["fail", "hang", "pin"])
    parser.add_argument(
        "--candidate",
        metavar="NAME",
        help="fail/hang: the upstream to fault (default: the route's primary); "
        "pin: the candidate the plan starts at",
    )
    parser.add_argument("--duration", required=True, help="e.g. 15m, 90s")
    parser.add_argument(
        "--predict",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="e.g. breaker_open_s=20, p99_ms=3500, error_rate=1%% (repeatable)",
    )
    parser.add_argument(
        "--abort",
        action="append",
        default=[],
        metavar="NAME=VALUE[/WINDOW]",
        help="e.g. error_rate=1%%/60s, p99_ms=6000, secondary_429=5%% (repeatable)",
    )
    parser.add_argument("--out", metavar="FILE", help="the JSON report (default results/...)")
    # The tree calls handler(args, console); this verb prints for itself.
    parser.set_defaults(handler=lambda args, _console: run(args))

