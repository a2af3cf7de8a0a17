"""The evaluation's HTML page: the table, the verdict and each arm's latency distribution
(a histogram on a shared logarithmic axis, with its p50 / p95 / p99 marked)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from fallback_mw.cli.html_page import PALETTE, fmt, page, table, text

WIDTH, HEIGHT = 900, 150
LEFT, RIGHT, TOP, BOTTOM = 50, 20, 14, 28
BINS = 40
_TICKS = [m * 10.0**e for e in range(-1, 6) for m in (1, 2, 5)]


def _axis(latencies: Sequence[Sequence[float]]) -> tuple[float, float]:
    values = [v for arm in latencies for v in arm if v > 0]
    if not values:
        return 0.1, 1.0
    low, high = min(values), max(values)
    low = 10 ** (math.floor(math.log10(low) * 4) / 4)  # down to a quarter decade
    low = max(min(low, high / 2), 0.05)
    return low, max(high * 1.05, low * 2)


def _x(value: float, low: float, high: float) -> float:
    span = math.log10(high) - math.log10(low)
    clamped = min(max(value, low), high)
    return LEFT + (math.log10(clamped) - math.log10(low)) / span * (WIDTH - LEFT - RIGHT)


def histogram(arm: dict[str, Any], values: Sequence[float], low: float, high: float) -> str:
    colour = PALETTE[(arm["arm"] - 1) % len(PALETTE)]
    counts = [0] * BINS
    step = (math.log10(high) - math.log10(low)) / BINS
    for value in values:
        index = int((math.log10(min(max(value, low), high)) - math.log10(low)) / step)
        counts[min(max(index, 0), BINS - 1)] += 1
    tallest = max(counts) or 1
    plot_h = HEIGHT - TOP - BOTTOM
    parts = [
        f'<svg class="latency" data-arm="{arm["arm"]}" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" xmlns="http://www.w3.org/2000/svg" role="img">',
        f"<title>arm {arm['arm']}: latency distribution</title>",
        f'<line x1="{LEFT}" y1="{HEIGHT - BOTTOM}" x2="{WIDTH - RIGHT}" '
        f'y2="{HEIGHT - BOTTOM}" stroke="#808b96"/>',
    ]
    for i, count in enumerate(counts):
        if not count:
            continue
        x0 = _x(10 ** (math.log10(low) + i * step), low, high)
        x1 = _x(10 ** (math.log10(low) + (i + 1) * step), low, high)
        h = count / tallest * plot_h
        parts.append(
            f'<rect class="bin" x="{x0:.1f}" y="{HEIGHT - BOTTOM - h:.1f}" '
            f'width="{max(x1 - x0 - 1, 1):.1f}" height="{h:.1f}" fill="{colour}" '
            f'fill-opacity="0.75"><title>{count} requests</title></rect>'
        )
    for tick in _TICKS:
        if low <= tick <= high:
            x = _x(tick, low, high)
            parts.append(
                f'<line x1="{x:.1f}" y1="{HEIGHT - BOTTOM}" x2="{x:.1f}" '
                f'y2="{HEIGHT - BOTTOM + 4}" stroke="#808b96"/>'
                f'<text x="{x:.1f}" y="{HEIGHT - 8}" text-anchor="middle">{fmt(tick)} ms</text>'
            )
    for row, (name, dash) in enumerate((("p50", ""), ("p95", "4 2"), ("p99", "2 2"))):
        value = arm["latency_ms"][name]
        if value is None:
            continue
        x = _x(value, low, high)
        label = f'x="{x - 3:.1f}" text-anchor="end"' if x > WIDTH - 120 else f'x="{x + 3:.1f}"'
        parts.append(
            f'<line class="{name}" x1="{x:.1f}" y1="{TOP}" x2="{x:.1f}" '
            f'y2="{HEIGHT - BOTTOM}" stroke="#1c2833" stroke-dasharray="{dash}"/>'
            f'<text {label} y="{TOP + 8 + 12 * row}">{name} {fmt(value)} ms</text>'
        )
    parts.append(f'<text x="{LEFT}" y="{TOP - 2}">{tallest} max per bin</text>')
    parts.append("</svg>")
    return "".join(parts)


def render(
    artifact: dict[str, Any], latencies: Sequence[Sequence[float]], verdict: tuple[bool, str]
) -> str:
    arms: list[dict[str, Any]] = artifact["arms"]
    low, high = _axis(latencies)
    passed, line = verdict
    rows = [
        (
            a["arm"],
            a["name"],
            a["requests"],
            a["successes"],
            None if a["success_rate"] is None else f"{a['success_rate'] * 100:.1f}%",
            None if a["attempts_per_request"] is None else f"{a['attempts_per_request']:.2f}",
            a["fallbacks"],
            a["latency_ms"]["p50"],
            a["latency_ms"]["p95"],
            a["latency_ms"]["p99"],
            f"{a['integrity_failures']}/{a['integrity_checked']}",
        )
        for a in arms
    ]
    body = [
        "<h1>Route-plan evaluation</h1>",
        f'<p class="muted">primary {text(artifact["primary"])}, breaker '
        f"{text(artifact['breaker'])}, {text(artifact['requests_per_arm'])} requests per arm, "
        f"{text(artifact['concurrency'])} in flight, started {text(artifact['started_at'])}</p>",
        table(
            [
                "arm",
                "scenario",
                "requests",
                "ok",
                "success",
                "att/req",
                "fallbacks",
                "p50 ms",
                "p95 ms",
                "p99 ms",
                "bad/checked",
            ],
            rows,
            cls="arms",
        ),
        f'<p id="verdict" class="{"pass" if passed else "fail"}">{text(line)}</p>',
        "<h2>Latency per arm (client-measured, logarithmic axis)</h2>",
    ]
    for arm, values in zip(arms, latencies, strict=True):
        body.append(f"<h3>arm {text(arm['arm'])}: {text(arm['name'])}</h3>")
        body.append(histogram(arm, values, low, high))
    return page("fallback-mw eval", body)
