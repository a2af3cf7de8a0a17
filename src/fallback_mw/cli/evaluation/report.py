"""Per-arm numbers, the printed table and the JSON artifact."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from fallback_mw.cli.evaluation.arms import PRIMARY, ArmRun
from fallback_mw.cli.stats import percentile


def summarise(run: ArmRun) -> dict[str, Any]:
    outcomes = run.outcomes
    count = len(outcomes)
    successes = sum(1 for o in outcomes if o.status == 200)
    attempts = [o.attempts for o in outcomes if o.attempts is not None]
    latencies = [o.ms for o in outcomes]
    statuses = Counter(str(o.status) for o in outcomes)
    attempt_counts = Counter(str(a) for a in attempts)

    def ms(p: float) -> float | None:
        value = percentile(latencies, p)
        return None if value is None else round(value, 1)

    return {
        "arm": run.arm.number,
        "name": run.arm.name,
        "requests": count,
        "successes": successes,
        "success_rate": round(successes / count, 4) if count else None,
        "attempts_per_request": round(sum(attempts) / len(attempts), 3) if attempts else None,
        "attempts_total": sum(attempts),
        "attempts_histogram": dict(sorted(attempt_counts.items())),
        "upstream_requests": run.upstream_requests,
        "fallbacks": sum(1 for o in outcomes if o.provider is not None and o.provider != PRIMARY),
        "statuses": dict(sorted(statuses.items())),
        "latency_ms": {"p50": ms(50), "p95": ms(95), "p99": ms(99), "max": ms(100)},
        "integrity_checked": sum(1 for o in outcomes if o.integrity_ok is not None),
        "integrity_failures": sum(1 for o in outcomes if o.integrity_ok is False),
        "configuration": run.configuration,
    }


_COLUMNS = (
    ("arm", 3),
    ("scenario", 34),
    ("requests", 8),
    ("ok", 5),
    ("success", 8),
    ("att/req", 7),
    ("fallbacks", 9),
    ("p50 ms", 8),
    ("p95 ms", 8),
    ("p99 ms", 8),
    ("bad/checked", 11),
    ("statuses", 16),
)


def _cell(value: object) -> str:
    if value is None:
        return "-"
    return str(value)


def table(summaries: Sequence[dict[str, Any]]) -> str:
    header = "  ".join(
        name.rjust(width) if i not in (1, len(_COLUMNS) - 1) else name.ljust(width)
        for i, (name, width) in enumerate(_COLUMNS)
    )
    header = header.rstrip()
    lines = [header, "-" * len(header)]
    for s in summaries:
        rate = s["success_rate"]
        cells = [
            s["arm"],
            s["name"],
            s["requests"],
            s["successes"],
            None if rate is None else f"{rate * 100:.1f}%",
            None if s["attempts_per_request"] is None else f"{s['attempts_per_request']:.2f}",
            s["fallbacks"],
            s["latency_ms"]["p50"],
            s["latency_ms"]["p95"],
            s["latency_ms"]["p99"],
            f"{s['integrity_failures']}/{s['integrity_checked']}",
            " ".join(f"{code}x{n}" for code, n in s["statuses"].items()),
        ]
        lines.append(
            "  ".join(
                _cell(c).rjust(w) if i not in (1, len(_COLUMNS) - 1) else _cell(c).ljust(w)
                for i, (c, (_, w)) in enumerate(zip(cells, _COLUMNS, strict=True))
            ).rstrip()
        )
    return "\n".join(lines)


def verdict(summaries: Sequence[dict[str, Any]]) -> tuple[bool, str]:
    """Does the plan help when the primary fails and cost nothing when it does not? The
    four arms compared pairwise; any body that failed its integrity check fails the run."""
    by_arm = {s["arm"]: s for s in summaries}
    if set(by_arm) != {1, 2, 3, 4}:
        return False, "verdict: incomplete (the four arms did not all run)"
    single_fail, plan_fail, single_ok, plan_ok = (by_arm[n] for n in (1, 2, 3, 4))
    reasons: list[str] = []
    helps = plan_fail["successes"] > single_fail["successes"]
    if not helps:
        reasons.append(
            f"the plan served {plan_fail['successes']} with the primary failing, "
            f"the single upstream {single_fail['successes']}"
        )
    free = (
        plan_ok["successes"] == single_ok["successes"]
        and plan_ok["attempts_total"] == single_ok["attempts_total"]
        and plan_ok["fallbacks"] == 0
    )
    if not free:
        reasons.append(
            f"healthy, the plan made {plan_ok['attempts_total']} attempts and "
            f"{plan_ok['fallbacks']} fallbacks for {plan_ok['successes']} successes "
            f"(single upstream: {single_ok['attempts_total']} for {single_ok['successes']})"
        )
    bad = sum(s["integrity_failures"] for s in summaries)
    if bad:
        reasons.append(f"{bad} response bodies failed the integrity check")
    if reasons:
        return False, "verdict: FAIL — " + "; ".join(reasons)
    rate = plan_fail["success_rate"] or 0.0
    single_rate = single_fail["success_rate"] or 0.0
    return True, (
        f"verdict: PASS — with the primary failing the plan served {rate * 100:.1f}% "
        f"(single upstream {single_rate * 100:.1f}%); healthy it cost no attempt and no "
        f"fallback (p50 {_ms(plan_ok)} vs {_ms(single_ok)})"
    )


def _ms(summary: dict[str, Any]) -> str:
    p50 = summary["latency_ms"]["p50"]
    return "-" if p50 is None else f"{p50} ms"
