"""`fallback-mw capacity`: can each fallback carry its primary's peak?

For every route, the busiest minute of the last `--since` (requests and tokens, from the
usage records in the store's ledger) against each fallback's declared `rpm` / `tpm`, with
the ratio a full failover at peak would mean. Exit status (cli/app.py): 0 when every
fallback carries the peak with `--margin`, 1 when one cannot (or, with `--strict`, when a
limit or a peak is unknown) or the store is unreachable, 2 for a bad invocation. Names and
numbers only are printed."""

from __future__ import annotations

import argparse
import json
import math
from datetime import UTC, datetime
from typing import Any

from fallback_mw.budget import Ledger
from fallback_mw.cli.app import EXIT_FAILED, EXIT_OK, Console, Refused
from fallback_mw.cli.budgets import with_ledger
from fallback_mw.cli.capacity_planning import (
    Dimension,
    RouteReport,
    assess,
    needed_limit,
    peaks,
)
from fallback_mw.cli.target import StoreTarget, open_route_store
from fallback_mw.cli.usage import parse_since


def capacity(args: argparse.Namespace, console: Console) -> int:
    margin = _margin(args.margin)
    since = parse_since(args.since)

    async def action(ledger: Ledger, target: StoreTarget) -> list[RouteReport]:
        from fallback_mw.store.routes import merge_routes

        store = open_route_store(target)
        try:
            stored = await store.load_routes()
        finally:
            await store.aclose()
        merged = merge_routes(target.config, stored)
        observed = peaks(await ledger.rolling_peaks(since=since))
        return [
            assess(route, merged.upstreams, observed.get(route.id), margin)
            for route in merged.routes
        ]

    reports = with_ledger(args, console, action)
    if args.json:
        console.print(json.dumps(_as_json(reports, since, margin), indent=2))
    else:
        console.print(render(reports, since, margin))
    failing = [(report.route, f.name, f.verdict) for report in reports for f in report.fallbacks]
    cannot = [f"{route} -> {name}" for route, name, verdict in failing if verdict == "cannot_carry"]
    unknown = [f"{route} -> {name}" for route, name, verdict in failing if verdict == "unknown"]
    if cannot:
        # The exit status says "failed"; stderr says why, in the convention's one line.
        console.error(
            f"capacity: {len(cannot)} fallback(s) cannot carry the peak with margin "
            f"{margin:g}: {', '.join(cannot)}"
        )
        return EXIT_FAILED
    if args.strict and unknown:
        console.error(
            f"capacity: --strict: {len(unknown)} fallback(s) with an unknown limit or peak: "
            f"{', '.join(unknown)}"
        )
        return EXIT_FAILED
    return EXIT_OK


def _margin(text: str) -> float:
    try:
        margin = float(text)
    except ValueError:
        raise Refused(f"--margin {text!r}: expected a number such as 1.2") from None
    if not math.isfinite(margin) or not 0 < margin <= 100:
        raise Refused(f"--margin {text!r}: must be greater than 0 and at most 100")
    return margin


# --- output ---------------------------------------------------------------------------


def _n(value: int | None) -> str:
    return "unknown" if value is None else f"{value:,}"


def _ratio(dimension: Dimension) -> str:
    ratio = dimension.ratio
    return "-" if ratio is None else f"{ratio:.2f}x"


def _second(moment: datetime | None) -> str:
    return "-" if moment is None else moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _times(ratio: float) -> str:
    """The ratio as the table shows it (two decimals), without a trailing zero."""
    text = f"{ratio:.2f}"
    return text[:-1] if text.endswith("0") and not text.endswith(".00") else text


_VERDICT = {"carries": "carries", "cannot_carry": "CANNOT CARRY", "unknown": "unknown"}


def render(reports: list[RouteReport], since: datetime, margin: float) -> str:
    if not reports:
        return "no routes (the store holds none; --config FILE adds the file's routes)"
    header = ("ROUTE", "PRIMARY", "PEAK RPM", "PEAK TPM", "FALLBACK", "RPM", "x RPM", "TPM",
              "x TPM", "VERDICT")  # fmt: skip
    rows: list[tuple[str, ...]] = [header]
    notes: list[str] = []
    for report in reports:
        peak = report.peak
        peak_rpm = _n(peak.requests) if peak else "no traffic"
        peak_tpm = _n(peak.tokens) if peak else "-"
        if not report.fallbacks:
            rows.append((report.route, report.primary, peak_rpm, peak_tpm, "(none)", "", "", "",
                         "", "no fallback"))  # fmt: skip
        for fallback in report.fallbacks:
            requests, tokens = fallback.requests, fallback.tokens
            rows.append((
                report.route, report.primary, peak_rpm, peak_tpm, fallback.name,
                _n(requests.limit), _ratio(requests), _n(tokens.limit), _ratio(tokens),
                _VERDICT[fallback.verdict],
            ))  # fmt: skip
            notes += _notes(report, fallback.name, requests, tokens, margin)
        if peak and peak.tokens is not None and peak.metered_share < 1 and report.fallbacks:
            # A verdict on tokens from partly metered traffic is on a lower bound.
            share = peak.metered_share
            notes.append(
                f"{report.route}: {1 - share:.0%} of the window's requests reported no token "
                f"usage (e.g. streams without usage): the token peak counts only the "
                f"{share:.0%} that did, so the real peak may be higher"
            )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
             for row in rows]  # fmt: skip
    since_text = since.astimezone(UTC).strftime("%Y-%m-%d %H:%MZ")
    lines.insert(0, f"peak minute since {since_text}, margin {margin:g}")
    return "\n".join(lines + (["", *notes] if notes else []))


def _notes(
    report: RouteReport, name: str, requests: Dimension, tokens: Dimension, margin: float
) -> list[str]:
    notes = []
    peak = report.peak
    for label, dimension, key, at in (
        ("request", requests, "rpm", peak.requests_at if peak else None),
        ("token", tokens, "tpm", peak.tokens_at if peak else None),
    ):
        ratio = dimension.ratio
        if dimension.limit is None:
            notes.append(
                f"{report.route}: {name} declares no {key}: whether it can carry the "
                f"{label} peak is unknown"
            )
        elif dimension.peak is None or ratio is None:
            what = "no traffic recorded" if peak is None else f"no {label} usage reported"
            notes.append(f"{report.route}: {what} in the window: {name}'s {key} unchecked")
        elif dimension.verdict(margin) == "cannot_carry":
            notes.append(
                f"{report.route}: a full failover at peak (the minute from {_second(at)}) sends "
                f"{name} {_times(ratio)}x its {label} limit ({dimension.peak:,} per minute against "
                f"{key} = {dimension.limit:,}; with margin {margin:g} it needs "
                f"{key} >= {needed_limit(dimension.peak, margin):,})"
            )
    return notes


def _as_json(reports: list[RouteReport], since: datetime, margin: float) -> dict[str, Any]:
    def dimension(d: Dimension) -> dict[str, Any]:
        return {"peak": d.peak, "limit": d.limit, "ratio": d.ratio, "verdict": d.verdict(margin)}

    return {
        "since": since.astimezone(UTC).isoformat(),
        "margin": margin,
        "routes": [
            {
                "route": r.route,
                "primary": r.primary,
                "peak": None
                if r.peak is None
                else {
                    "requests": r.peak.requests,
                    "requests_at": r.peak.requests_at and r.peak.requests_at.isoformat(),
                    "tokens": r.peak.tokens,
                    "tokens_at": r.peak.tokens_at and r.peak.tokens_at.isoformat(),
                    "metered_share": round(r.peak.metered_share, 4),
                },
                "fallbacks": [
                    {
                        "name": f.name,
                        "requests": dimension(f.requests),
                        "tokens": dimension(f.tokens),
                        "verdict": f.verdict,
                    }
                    for f in r.fallbacks
                ],
            }
            for r in reports
        ],
    }
