"""`fallback-mw gameday`: a fault with written predictions and numeric abort criteria,
watched through the usage records every gateway writes to the store (gameday/).

Exit status: 0 when the exercise ran to its end and every prediction passed; 1 when it
aborted on a criterion, a prediction failed or had no data, or the store failed (the
exercise ends, its fault's clear retried until the store is back or it expires); 2 when it
refuses to start (nothing set); 130 when stopped by SIGINT/SIGTERM/SIGHUP (the fault is
cleared first). The report is printed and written in every case but a refusal."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import difflib
import getpass
import signal
import threading
from pathlib import Path
from typing import Any

from fallback_mw.budget import LedgerUnavailable
from fallback_mw.cli.app import (
    Console,
    Failed,
    Refused,
    default_console,
)
from fallback_mw.cli.game_day.files import html_path, out_path, write_report_files
from fallback_mw.cli.game_day.prometheus import (
    AlertWatcher,
    PrometheusUnavailable,
    PrometheusURLError,
    check_url,
)
from fallback_mw.cli.game_day.report import build_report, report_lines, write_report
from fallback_mw.cli.game_day.run import (
    Exercise,
    GameDayRefused,
    InterruptedBeforeTheFault,
    Timeline,
    observe_exercise,
    read_in_flight,
    run_exercise,
    watch_recovery,
)
from fallback_mw.cli.game_day.spec import (
    AlertPrediction,
    SpecError,
    parse_abort,
    parse_duration,
    parse_prediction,
)
from fallback_mw.cli.show import one_line
from fallback_mw.cli.target import resolve
from fallback_mw.quoting import printable, shortened
from fallback_mw.store.ledgers import open_ledger
from fallback_mw.store.model import StoreError
from fallback_mw.store.routes import open_store


async def _plans(url: str, config_routes: dict[str, tuple[str, ...]]) -> dict[str, Any]:
    store = open_store(url)
    try:
        plans: dict[str, Any] = dict(config_routes)
        for stored in await store.load_routes():
            plans[stored.route.id] = stored.route.plan
        return plans
    finally:
        await store.aclose()


def _login_name() -> str:
    """Without --owner, whoever runs the exercise owns its abort."""
    try:
        return getpass.getuser()
    except (OSError, KeyError):
        return ""


def _exercise(args: argparse.Namespace, console: Console | None = None) -> tuple[Exercise, str]:
    """Everything checked before anything is set (raises Refused)."""
    owner = (args.owner if args.owner is not None else _login_name()).strip()
    if not owner or len(owner) > 200 or not owner.isprintable():
        raise Refused("--owner NAME: the one person who may call the abort (printable, named)")
    if not args.predict:
        raise Refused("no --predict: an exercise without a written prediction cannot fail")
    if not args.abort:
        raise Refused("no --abort: a game day needs at least one numeric abort criterion")
    try:
        predictions = tuple(parse_prediction(p) for p in args.predict)
        aborts = tuple(parse_abort(a) for a in args.abort)
        duration = parse_duration(args.duration, "--duration")
        recovery_wait = parse_duration(args.recovery_wait, "--recovery-wait")
    except SpecError as exc:
        raise Refused(str(exc)) from None
    if args.prometheus is not None:
        try:
            args.prometheus = check_url(args.prometheus)
        except PrometheusURLError as exc:
            raise Refused(str(exc)) from None
    elif any(isinstance(p, AlertPrediction) for p in predictions):
        raise Refused("an alert:NAME<=DURATION prediction needs --prometheus URL")
    target = resolve(args, console or default_console(), creates=True)
    plan = asyncio.run(_plans(target.url, {r.id: r.plan for r in target.config.routes})).get(
        args.route
    )
    if plan is None:
        raise Refused(
            f"unknown route {args.route!r} (a route from a config file needs --config FILE)"
        )
    if args.fault == "pin":
        if args.candidate is None or args.candidate not in plan:
            raise Refused(
                f"--fault pin needs --candidate, one of the candidates of route {args.route!r} "
                f"({', '.join(plan)})"
            )
        if args.candidate == plan[0]:
            # The plan already starts there: the exercise would change nothing, and pass.
            raise Refused(
                f"--fault pin --candidate {args.candidate!r} is already the first candidate of "
                f"route {args.route!r}: pin one of the others ({', '.join(plan[1:]) or 'none'})"
            )
        if any(p.name == "breaker_open_s" for p in predictions):
            raise Refused(
                "breaker_open_s needs a fault that fails the upstream (a pin opens no breaker)"
            )
        faulted = args.route
    else:
        faulted = args.candidate or plan[0]
        if faulted not in plan:
            raise Refused(
                f"--candidate {faulted!r} is not one of the candidates of route {args.route!r} "
                f"({', '.join(plan)})"
            )
    exercise = Exercise(
        route=args.route,
        fault=args.fault,
        target=faulted,
        candidate=args.candidate if args.fault == "pin" else None,
        primary=plan[0],
        duration_s=duration,
        predictions=predictions,
        aborts=aborts,
        poll_s=min(1.0, max(duration / 20, 0.1)),
        grace_s=min(2.0, max(duration / 10, 0.5)),
        owner=owner,
        recovery_wait_s=recovery_wait,
        candidates=tuple(plan),
    )
    return exercise, target.url


async def _run(
    exercise: Exercise, url: str, out: Path, console: Console, prometheus: str | None
) -> dict[str, Any]:
    stop = asyncio.Event()
    give_up = asyncio.Event()  # a second Ctrl-C: stop retrying a clear the store refuses

    def on_signal() -> None:
        (give_up if stop.is_set() else stop).set()

    loop = asyncio.get_running_loop()
    handled: list[signal.Signals] = []
    if threading.current_thread() is threading.main_thread():
        # SIGHUP too: the operator's terminal or SSH session went away. Left to its default
        # it killed the command at once, and the fault injected, unwatched, until its expiry.
        hangup = getattr(signal, "SIGHUP", None)
        for sig in (signal.SIGINT, signal.SIGTERM, *([hangup] if hangup else [])):
            loop.add_signal_handler(sig, on_signal)
            handled.append(sig)
    store = open_store(url)
    ledger = open_ledger(url)
    alerts = (
        AlertWatcher(prometheus, route=exercise.route, upstreams=frozenset(exercise.candidates))
        if prometheus
        else None
    )
    try:

        def started(timeline: Timeline) -> None:
            # Recorded before anything is watched: the predictions as written. A disk that
            # cannot take it ends the exercise here (its fault cleared on the way out).
            try:
                write_report(out, build_report(exercise, timeline, None, status="running"))
            except OSError as exc:
                raise Failed(
                    f"cannot write the report {out}: {exc.strerror or exc}; the exercise "
                    "stopped as it started and its fault was cleared"
                ) from None

        if alerts is not None:
            try:
                await alerts.baseline()
            except PrometheusUnavailable as exc:
                raise GameDayRefused(
                    f"--prometheus {prometheus}: cannot read /api/v1/alerts ({exc}); nothing set"
                ) from None
            # A misspelt alert never fires: found out now, not as NO DATA after the exercise.
            predicted = {p.alert for p in exercise.predictions if isinstance(p, AlertPrediction)}
            rules = await alerts.alert_rules()
            unknown = sorted(predicted - rules) if rules is not None else []
            if unknown:
                close = difflib.get_close_matches(unknown[0], sorted(rules or ()), n=1)
                hint = (
                    f"did you mean {one_line(shortened(close[0]))}?"
                    if close
                    else f"{len(rules or ())} rules"
                )
                raise GameDayRefused(
                    f"--predict alert:{unknown[0]}: Prometheus at {prometheus} has no alerting "
                    f"rule of that name ({hint}); nothing set"
                )
        try:
            # The records the game day watches are read before the fault is set: a ledger it
            # cannot read (unreachable, a schema a newer version migrated) was found out
            # only once every gateway sharing the store had faulted the upstream.
            await ledger.usage(route=exercise.route, limit=1)
        except LedgerUnavailable as exc:
            raise GameDayRefused(
                f"cannot read the usage records it watches: {exc}; nothing set"
            ) from None
        timeline, feed = await run_exercise(
            exercise, store, ledger, stop, console.print, started, alerts=alerts, give_up=give_up
        )
        if timeline.failure is None and not timeline.interrupted:
            await watch_recovery(exercise, feed, timeline, stop, console.print, alerts=alerts)
            timeline.interrupted = stop.is_set()  # Ctrl-C during the recovery watch
        if timeline.failure is None and timeline.interrupted:  # the records in flight, once
            await read_in_flight(exercise, feed, timeline)
        if alerts is not None:
            await alerts.settle()  # the poll still in flight, into the report
        observed = observe_exercise(exercise, feed, timeline)
        status = (
            "failed"  # what was observed until the store failed
            if timeline.failure is not None
            else "aborted"
            if timeline.abort or timeline.cleared_outside is not None
            else "interrupted"
            if timeline.interrupted
            else "completed"
        )
        report = build_report(
            exercise,
            timeline,
            observed,
            status=status,
            alerts=None if alerts is None else alerts.summary(timeline.started),
        )
        # Written before anything is printed: after a hang-up the terminal may be gone.
        page = html_path(out)
        unwritten = write_report_files(out, page, report)
        for line in report_lines(report):
            console.print(line)
        if unwritten is not None:
            # What was observed is printed above; the file (a full disk, a directory gone)
            # is what failed.
            raise Failed(f"cannot write the report {unwritten}; it is printed above")
        console.print(f"wrote {printable(str(out))} and {printable(str(page))}")
        return report
    finally:
        if alerts is not None:
            with contextlib.suppress(Exception):
                await alerts.aclose()
        for sig in handled:
            loop.remove_signal_handler(sig)
        with contextlib.suppress(Exception):
            await store.aclose()
        with contextlib.suppress(Exception):
            await ledger.aclose()


def handle(args: argparse.Namespace, console: Console) -> None:
    exercise, url = _exercise(args, console)
    out = out_path(args, exercise)
    try:
        report = asyncio.run(_run(exercise, url, out, console, args.prometheus))
    except GameDayRefused as exc:
        raise Refused(str(exc)) from None
    except InterruptedBeforeTheFault:
        console.print("interrupted before the fault was set: nothing set")
        raise KeyboardInterrupt from None  # exit status 130
    except (StoreError, LedgerUnavailable) as exc:
        raise Failed(f"game day stopped: {exc} (any fault set expires on its own)") from None
    if report["status"] == "failed":
        left = "" if report["fault"]["cleared_at"] else " (the fault expires on its own)"
        raise Failed(f"game day stopped: {report['failure']}{left}")
    if report["status"] == "interrupted":
        raise KeyboardInterrupt  # the tree's exit status 130, after the fault was cleared
    if report["abort"] is not None:
        if report["abort"]["observed"] is None:  # cleared outside: nothing left to clear
            raise Failed(f"game day ended early: {report['abort']['criterion']}")
        raise Failed(f"game day aborted on {report['abort']['criterion']}; fault cleared")
    missed = [p["prediction"] for p in report["predictions"] if p["result"] != "pass"]
    if missed:
        raise Failed(f"prediction(s) not met: {', '.join(missed)}")
