"""Where a game day's report goes: the JSON path (`--out`, else one named for the route,
the fault, its target and the start, checked writable before the fault is set) and the
HTML page beside it, each written whole or not at all."""

from __future__ import annotations

import argparse
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fallback_mw.cli.app import writable_out, write_atomically
from fallback_mw.cli.game_day.html import render
from fallback_mw.cli.game_day.report import write_report
from fallback_mw.cli.game_day.run import Exercise


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)[:64]


def out_path(args: argparse.Namespace, exercise: Exercise) -> Path:
    if args.out:
        out = Path(args.out)
    else:
        # Two exercises started in the same second on one route (a script starting a `fail`
        # and a `pin`) differ by fault and target; on one target, the store refuses one.
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        what = f"{exercise.fault}-{_safe(exercise.candidate or exercise.target)}"
        out = Path("results") / f"gameday-{_safe(exercise.route)}-{what}-{stamp}.json"
    writable_out(out, str(out))  # before the fault is set, not half-way through
    return out


def html_path(out: Path) -> Path:
    """The HTML page beside the JSON report."""
    return out.with_name(out.name + ".html") if out.suffix == ".html" else out.with_suffix(".html")


def write_report_files(out: Path, page: Path, report: dict[str, Any]) -> str | None:
    """The JSON report and its HTML page, each whole or not at all; None when both are
    written, else what could not be and why."""
    try:
        write_report(out, report)
    except OSError as exc:
        return f"{out}: {exc.strerror or exc}"
    try:
        write_atomically(page, render(report))
    except OSError as exc:
        return f"page {page}: {exc.strerror or exc} (the JSON report {out} is written)"
    return None
