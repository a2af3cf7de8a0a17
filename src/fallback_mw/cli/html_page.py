"""Self-contained HTML report pages for `eval` and `gameday`: one file, inline CSS and SVG,
no script and no reference to anything outside the page (it opens offline, from a mail
attachment or a CI artifact). Only numbers and names the command itself chose go in:
never a request body, a credential or a query string. Names it did not choose (the alerts a
shared Prometheus fires, a store's error message) go through `text`, as every quoted text."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from html import escape

from fallback_mw.quoting import printable

PALETTE = ("#c0392b", "#2471a3", "#7d3c98", "#1e8449", "#b9770e", "#566573")

_STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px; color: #1c2833; max-width: 1100px; }
h1 { font-size: 20px; margin: 0 0 4px; } h2 { font-size: 16px; margin: 24px 0 8px; }
table { border-collapse: collapse; margin: 8px 0; }
th, td { border-bottom: 1px solid #d5d8dc; padding: 3px 10px; text-align: right; }
th:first-child, td:first-child, td.text, th.text { text-align: left; }
.pass { color: #1e8449; font-weight: 600; } .fail { color: #c0392b; font-weight: 600; }
.muted { color: #808b96; } svg { display: block; margin: 6px 0; }
svg text { font: 11px system-ui, sans-serif; fill: #34495e; }
"""


def page(title: str, body: Iterable[str]) -> str:
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{text(title)}</title><style>{_STYLE}</style></head>\n<body>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )


def text(value: object) -> str:
    """`value` as page text: markup escaped, and every character that is not printable
    `?`, as the printed report shows it. A right-to-left override in an alert's name drew
    the rest of its label reversed (its `+1.2 s` read `s 2.1+`), and an unpaired surrogate
    (valid in JSON) could not be written as UTF-8: the page was not written at all. A
    line break or a tab is a space, as the page would show it anyway."""
    return escape(printable(" ".join(str(value).split())))


def table(header: Sequence[str], rows: Iterable[Sequence[object]], *, cls: str = "") -> str:
    head = "".join(
        f'<th class="text">{text(h)}</th>' if i == 1 else f"<th>{text(h)}</th>"
        for i, h in enumerate(header)
    )
    lines = [f'<table class="{text(cls)}"><thead><tr>{head}</tr></thead><tbody>']
    for row in rows:
        # Nothing observed reads "-" in every column, as the printed tables say it.
        cells = "".join(
            f'<td class="text">{text("-" if c is None else c)}</td>'
            if i == 1
            else f"<td>{text('-' if c is None else c)}</td>"
            for i, c in enumerate(row)
        )
        lines.append(f"<tr>{cells}</tr>")
    lines.append("</tbody></table>")
    return "".join(lines)


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round tick values covering [low, high]."""
    if high <= low:
        return [low]
    raw = (high - low) / max(count, 1)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    first = math.floor(low / step) * step
    ticks: list[float] = []
    value = first
    while value <= high + step * 1e-9:
        if value >= low - step * 1e-9:
            ticks.append(round(value, 10))
        value += step
    return ticks


def fmt(value: float) -> str:
    if value == int(value):
        return str(int(value))
    return f"{value:.3g}"
