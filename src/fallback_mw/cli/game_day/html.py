"""The game day's HTML page: what was written down and how it came out, a timeline of the
milestones (fault set, breaker open, first fallback, alert firing, revert, first primary
success) over the fault's period, and the error rate and p99 over time on the same axis."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from fallback_mw.cli.game_day.observe import fmt
from fallback_mw.cli.game_day.report import fault_subject
from fallback_mw.cli.html_page import PALETTE, nice_ticks, page, table, text
from fallback_mw.cli.html_page import fmt as num

WIDTH = 960
LEFT, RIGHT = 60, 30
_EVENT_COLOURS = {
    "fault_set": PALETTE[0],
    "breaker_open": PALETTE[4],
    "first_fallback": PALETTE[1],
    "alert_firing": PALETTE[2],
    "revert": PALETTE[5],
    "primary_success": PALETTE[3],
}


class _Axis:
    def __init__(self, end_s: float) -> None:
        self.end = max(end_s, 1.0)

    def x(self, seconds: float) -> float:
        clamped = min(max(seconds, 0.0), self.end)
        return LEFT + clamped / self.end * (WIDTH - LEFT - RIGHT)

    def ticks(self, top: float, bottom: float) -> str:
        parts = []
        for tick in nice_ticks(0.0, self.end, 8):
            x = self.x(tick)
            parts.append(
                f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{bottom}" stroke="#eaeded"/>'
                f'<text x="{x:.1f}" y="{bottom + 14}" text-anchor="middle">+{num(tick)} s</text>'
            )
        return "".join(parts)


def _fault_period(axis: _Axis, seconds_set: float | None, top: float, bottom: float) -> str:
    end = axis.end if seconds_set is None else seconds_set
    x0, x1 = axis.x(0.0), axis.x(end)
    return (
        f'<rect class="fault-period" x="{x0:.1f}" y="{top}" width="{max(x1 - x0, 1):.1f}" '
        f'height="{bottom - top}" fill="{PALETTE[0]}" fill-opacity="0.08">'
        "<title>the fault was set</title></rect>"
    )


def timeline_svg(report: dict[str, Any], axis: _Axis) -> str:
    marks = [e for e in report.get("events", []) if e["at_s"] is not None]
    height = 70 + 18 * len(marks)
    top, bottom = 10, height - 24
    parts = [
        f'<svg class="timeline" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} '
        f'{height}" xmlns="http://www.w3.org/2000/svg" role="img"><title>timeline</title>',
        axis.ticks(top, bottom),
        _fault_period(axis, report["fault"].get("seconds_set"), top, bottom),
        f'<line x1="{LEFT}" y1="{bottom}" x2="{WIDTH - RIGHT}" y2="{bottom}" stroke="#808b96"/>',
    ]
    for row, event in enumerate(marks):
        x = axis.x(event["at_s"])
        colour = _EVENT_COLOURS.get(event["event"], PALETTE[5])
        y = top + 16 + 18 * row
        anchor = 'text-anchor="end"' if x > WIDTH * 0.7 else ""
        dx = -6 if anchor else 6
        parts.append(
            f'<g class="event" data-event="{text(event["event"])}">'
            f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{bottom}" stroke="{colour}" '
            f'stroke-width="2"/><circle cx="{x:.1f}" cy="{y - 4}" r="4" fill="{colour}"/>'
            f'<text x="{x + dx:.1f}" y="{y}" {anchor}>{text(event["label"])} '
            f"+{num(event['at_s'])} s</text></g>"
        )
    parts.append("</svg>")
    return "".join(parts)


def chart_svg(
    name: str,
    title: str,
    points: Sequence[dict[str, Any]],
    value: Callable[[dict[str, Any]], float | None],
    axis: _Axis,
    step: float,
    seconds_set: float | None,
    label: Callable[[float], str],
    floor: float = 1.0,
) -> str:
    height = 170
    top, bottom = 12, height - 26
    values = [v for v in (value(p) for p in points) if v is not None]
    high = max(values, default=0.0) or floor
    ticks = nice_ticks(0.0, high, 4)
    high = max(high, ticks[-1])

    def y(v: float) -> float:
        return bottom - v / high * (bottom - top)

    parts = [
        f'<svg class="chart {name}" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} '
        f'{height}" xmlns="http://www.w3.org/2000/svg" role="img"><title>{text(title)}</title>',
        axis.ticks(top, bottom),
        _fault_period(axis, seconds_set, top, bottom),
    ]
    for tick in ticks:
        parts.append(
            f'<text x="{LEFT - 6}" y="{y(tick) + 4:.1f}" text-anchor="end">{label(tick)}</text>'
        )
    width = max(axis.x(step) - axis.x(0.0) - 1, 1)
    for point in points:
        v = value(point)
        if v is None:
            continue
        h = max(bottom - y(v), 1 if v > 0 else 0)
        parts.append(
            f'<rect class="point" x="{axis.x(point["t"]):.1f}" y="{bottom - h:.1f}" '
            f'width="{width:.1f}" height="{h:.1f}" fill="{PALETTE[1]}" fill-opacity="0.8">'
            f"<title>+{num(point['t'])} s: {label(v)}</title></rect>"
        )
    parts.append(
        f'<line x1="{LEFT}" y1="{bottom}" x2="{WIDTH - RIGHT}" y2="{bottom}" stroke="#808b96"/>'
    )
    parts.append("</svg>")
    return "".join(parts)


def render(report: dict[str, Any]) -> str:
    fault = report["fault"]
    observed = report.get("observed") or {}
    series = observed.get("series") or {"step_s": 1.0, "points": []}
    points = series["points"]
    step = float(series["step_s"])
    end = max(
        [p["t"] + step for p in points]
        + [e["at_s"] for e in report.get("events", []) if e["at_s"] is not None]
        + [1.0]
    )
    axis = _Axis(end)
    seconds_set = fault.get("seconds_set")
    rows = [
        (
            p["prediction"],
            p["name"],
            fmt(p["predicted"], p["unit"]),
            fmt(p.get("observed"), p["unit"]),
            str(p.get("result", "")).upper(),
        )
        for p in report["predictions"]
    ]
    missed = ", ".join(
        f"{p['prediction']} {str(p.get('result', '')).upper()}"
        for p in report["predictions"]
        if p.get("result") != "pass"
    )
    # Green only for an exercise that ran to its end with every prediction met: an
    # aborted, interrupted or failed one is not a pass, whatever its predictions say.
    passed = not missed and report["status"] == "completed"
    verdict = (
        "every prediction passed"
        if passed
        else f"{report['status']}: {missed or 'every prediction passed'}"
    )
    abort = report.get("abort")
    body = [
        f"<h1>Game day: route {text(report['route'])}, {text(fault_subject(fault))}</h1>",
        f'<p class="muted">owner (may call the abort): <strong id="owner">'
        f"{text(report.get('owner') or '-')}</strong> · status {text(report['status'])} · "
        f"fault set {text(fault['set_at'])}, "
        + (
            f"cleared {text(fault['cleared_at'])} "
            f"({text(fault['seconds_set'])} s of {text(report['duration_s'])} s)</p>"
            if fault["cleared_at"] is not None
            else f"not cleared: it expires {text(fault['expires_at'])}</p>"
        ),
        f'<p id="verdict" class="{"pass" if passed else "fail"}">{text(verdict)}</p>',
    ]
    if report.get("failure"):
        body.append(f'<p class="fail">stopped: {text(report["failure"])}</p>')
    if abort:
        body.append(
            f'<p class="fail">aborted at +{text(abort["at_s"])} s on '
            f"{text(abort['criterion'])}"
            + ("" if abort["observed"] is None else f" (observed {text(abort['observed'])})")
            + "</p>"
        )
    body += [
        table(["prediction", "quantity", "predicted", "observed", "result"], rows, cls="preds"),
        "<h2>Timeline (seconds from the fault being set; shaded: the fault was set)</h2>",
        timeline_svg(report, axis),
        "<h2>Customer-visible error rate</h2>",
        chart_svg(
            "error-rate",
            "error rate over time",
            points,
            lambda p: p["error_rate"],
            axis,
            step,
            seconds_set,
            lambda v: f"{v * 100:.3g}%",
            floor=0.01,  # an all-clear chart reads 0 % of a 1 % scale
        ),
        "<h2>p99 request duration</h2>",
        chart_svg(
            "p99",
            "p99 over time",
            points,
            lambda p: p["p99_ms"],
            axis,
            step,
            seconds_set,
            lambda v: f"{num(round(v, 1))} ms",
        ),
        "<h2>Observed while the fault was set</h2>",
        table(
            ["quantity", "value"],
            [
                (k, observed.get(k))
                for k in (
                    "requests",
                    "errors",
                    "error_rate",
                    "fallbacks",
                    "fallback_share",
                    "p50_ms",
                    "p99_ms",
                    "breaker_open_s",
                    "first_fallback_s",
                    "recovery_s",
                    "secondary_calls",
                    "secondary_429",
                )
            ],
            cls="observed",
        ),
    ]
    return page(f"fallback-mw gameday {report['route']}", body)
