"""The game day's report: what was written down, what happened, what was observed."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from fallback_mw.cli.game_day.run import Exercise, Timeline, fmt, iso, judge


def build_report(
    exercise: Exercise, timeline: Timeline, observed: dict[str, Any] | None, *, status: str
) -> dict[str, Any]:
    abort = timeline.abort
    return {
        "tool": "fallback-mw gameday",
        "status": status,  # running, completed, aborted, interrupted
        "route": exercise.route,
        "fault": {
            "kind": exercise.fault,
            "target": exercise.target,
            "candidate": exercise.candidate,
            "set_at": iso(timeline.started),
            "expires_at": iso(timeline.expires),
            "cleared_at": iso(timeline.cleared),
            "seconds_set": None
            if timeline.cleared is None
            else round(timeline.cleared - timeline.started, 3),
        },
        "duration_s": exercise.duration_s,
        "primary": exercise.primary,
        "abort_criteria": [
            {"criterion": a.text, "name": a.name, "threshold": a.threshold, "window_s": a.window_s}
            for a in exercise.aborts
        ],
        "abort": None
        if abort is None
        else {
            "criterion": abort.criterion.text,
            "observed": round(abort.observed, 4),
            "at_s": abort.at_s,
        },
        "predictions": judge(exercise.predictions, observed)
        if observed is not None
        else [
            {"prediction": p.text, "name": p.name, "unit": p.unit, "predicted": p.value}
            for p in exercise.predictions
        ],
        "observed": observed,
    }


def report_lines(report: dict[str, Any]) -> list[str]:
    """The report as printed: the predictions table and the observed numbers."""
    fault = report["fault"]
    lines = [
        f"game day {report['status']}: route {report['route']!r}, {fault['kind']} "
        f"{fault['target']!r}, set {fault['seconds_set']} s of {report['duration_s']:g} s"
    ]
    if report["abort"] is not None:
        abort = report["abort"]
        lines.append(f"  aborted at +{abort['at_s']} s on {abort['criterion']}")
    lines.append(f"  {'prediction':<28} {'predicted':>12} {'observed':>12}  result")
    for p in report["predictions"]:
        unit = p["unit"]
        lines.append(
            f"  {p['prediction']:<28} {fmt(p['predicted'], unit):>12} "
            f"{fmt(p['observed'], unit):>12}  {p['result'].upper()}"
        )
    o = report["observed"] or {}
    if not o.get("requests"):
        lines.append(
            f"  no request on route {report['route']!r} was recorded while the fault was set: "
            "is there traffic, and do the gateways use this store?"
        )
    lines.append(
        f"  observed: {o.get('requests')} requests, {o.get('errors')} customer-visible "
        f"errors ({fmt(o.get('error_rate'), '%')}), {o.get('fallbacks')} served by a "
        f"fallback ({fmt(o.get('fallback_share'), '%')}), p50 {fmt(o.get('p50_ms'), 'ms')}, "
        f"p99 {fmt(o.get('p99_ms'), 'ms')}, breaker open after "
        f"{fmt(o.get('breaker_open_s'), 's')}, secondary 429s "
        f"{o.get('secondary_429')}/{o.get('secondary_calls')}"
    )
    return lines


def write_report(path: Path, report: dict[str, Any]) -> None:
    """Atomically: a reader never sees half a report."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".gameday-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as out:
            json.dump(report, out, indent=2)
            out.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
