"""The game day's report: what was written down, what happened, what was observed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fallback_mw.cli.app import write_atomically
from fallback_mw.cli.game_day.observe import fmt, judge
from fallback_mw.cli.game_day.run import Exercise, Timeline, iso
from fallback_mw.cli.show import one_line
from fallback_mw.quoting import shortened


def events(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The exercise's milestones, seconds from the fault being set, in order: what the
    timeline of the HTML page marks."""
    observed = report.get("observed") or {}
    fault = report["fault"]
    found: list[tuple[str, str, float | None]] = [
        ("fault_set", "fault set", 0.0),
        ("breaker_open", "breaker open", observed.get("breaker_open_s")),
        ("first_fallback", "first fallback", observed.get("first_fallback_s")),
    ]
    alerts = ((report.get("prometheus") or {}).get("alerts")) or {}
    for name, seen in alerts.items():
        if seen.get("firing_s") is not None:  # pending only: not a milestone
            # Quoted by its start: a rule's name has no bound (100,000 characters drew a
            # label as wide on the page); the JSON report keeps the name whole.
            found.append(("alert_firing", f"{shortened(name)} firing", seen["firing_s"]))
    seconds_set = fault.get("seconds_set")
    found.append(("revert", "revert", seconds_set))
    recovery = observed.get("recovery_s")
    found.append(
        (
            "primary_success",
            "first primary success",
            None if recovery is None or seconds_set is None else round(seconds_set + recovery, 3),
        )
    )
    listed = [{"event": key, "label": label, "at_s": at} for key, label, at in found]
    return sorted(listed, key=lambda e: (e["at_s"] is None, e["at_s"] or 0.0))


# What the report names as the abort when the fault left the store before the command
# cleared it: someone ran the one-action revert (`faults clear`), or replaced the fault.
CLEARED_OUTSIDE = "the fault was cleared outside the command"


def _abort(timeline: Timeline) -> dict[str, Any] | None:
    if timeline.cleared_outside is not None:
        return {"criterion": CLEARED_OUTSIDE, "observed": None, "at_s": timeline.cleared_outside}
    abort = timeline.abort
    if abort is None:
        return None
    return {
        "criterion": abort.criterion.text,
        "observed": round(abort.observed, 4),
        "at_s": abort.at_s,
    }


def build_report(
    exercise: Exercise,
    timeline: Timeline,
    observed: dict[str, Any] | None,
    *,
    status: str,
    alerts: dict[str, Any] | None = None,
) -> dict[str, Any]:
    report: dict[str, Any] = {
        "tool": "fallback-mw gameday",
        "status": status,  # running, completed, aborted, interrupted, failed
        "failure": timeline.failure,  # failed: what the store or ledger said
        "route": exercise.route,
        "owner": exercise.owner,  # the one person who may call the abort
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
        "abort": _abort(timeline),
        "predictions": judge(exercise.predictions, observed, alerts)
        if observed is not None
        else [
            {"prediction": p.text, "name": p.name, "unit": p.unit, "predicted": p.value}
            for p in exercise.predictions
        ],
        "observed": observed,
        "prometheus": alerts,
    }
    report["fault"]["recovered_at"] = iso(timeline.recovered)
    report["events"] = events(report) if observed is not None else []
    return report


def fault_subject(fault: dict[str, Any]) -> str:
    """What the fault was set on, as `faults set` says it: a pin's target is the route
    (the report names it already), what it pinned is the candidate."""
    if fault["kind"] == "pin":
        return f"pin to {fault.get('candidate')!r}"
    return f"{fault['kind']} {fault['target']!r}"


def report_lines(report: dict[str, Any]) -> list[str]:
    """The report as printed: the predictions table and the observed numbers."""
    fault = report["fault"]
    what = fault_subject(fault)
    held = (
        f"set {fault['seconds_set']} s of {report['duration_s']:g} s"
        if fault["seconds_set"] is not None
        else f"not cleared (the store failed): it expires {fault.get('expires_at')}"
    )
    lines = [
        f"game day {report['status']}: route {report['route']!r}, {what}, {held}, "
        f"owner {report['owner']}"
    ]
    if report.get("failure"):
        lines.append(f"  stopped: {report['failure']}")
    if report["abort"] is not None:
        abort = report["abort"]
        lines.append(f"  aborted at +{abort['at_s']} s on {abort['criterion']}")
    # As wide as the longest prediction (an alert: prediction is often over 28).
    width = max([28, *(len(p["prediction"]) for p in report["predictions"])])
    lines.append(f"  {'prediction':<{width}} {'predicted':>12} {'observed':>12}  result")
    for p in report["predictions"]:
        unit = p["unit"]
        lines.append(
            f"  {p['prediction']:<{width}} {fmt(p['predicted'], unit):>12} "
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
    lines.append(
        f"  recovery: the primary served again {fmt(o.get('recovery_s'), 's')} after the revert"
    )
    prometheus = report.get("prometheus")
    if prometheus is not None:
        # Alert names are any text a rule in a shared Prometheus gives (an ESC too): one
        # printable line each, never a terminal escape sequence.
        fired = [
            f"{one_line(shortened(name))} firing at +{fmt(seen['firing_s'], 's')}"
            + (f", resolved at +{fmt(seen['resolved_s'], 's')}" if seen["resolved_s"] else "")
            for name, seen in prometheus["alerts"].items()
            if seen["firing_s"] is not None
        ]
        lines.append(
            f"  prometheus: {'; '.join(fired) or 'no alert fired'} "
            f"({prometheus['failed_polls']} of {prometheus['polls']} polls failed)"
        )
    return lines


def write_report(path: Path, report: dict[str, Any]) -> None:
    """Atomically: a reader never sees half a report (as its page, `write_atomically`:
    readable as the umask says, not mkstemp's 0600)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps(report, indent=2) + "\n")
