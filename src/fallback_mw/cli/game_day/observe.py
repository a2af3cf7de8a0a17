"""What a game day observes, computed from the usage records every gateway process writes
to the shared store (pure functions: the records and the clock come in as arguments)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fallback_mw.budget import UsageRecord
from fallback_mw.cli.game_day.spec import AlertPrediction, Prediction
from fallback_mw.cli.stats import percentile

# Outcomes that are the caller's own doing, never a customer-visible error. The shipped
# alert rules (docs/alerts/fallback_mw.rules.yml) exclude exactly these and `served`, and
# count a `served` answer whose status is a 5xx (customer_error). `cancelled` is the host's
# ending of the request, never an upstream's nor the walk's: its own refusal of the body,
# which it answers (a 413 over Starlette's max_body_size, a signature check's 401: rule
# host_refused), or its cancelling the task (a disconnect, serve's graceful-shutdown cut).
CALLER_OUTCOMES = frozenset(
    {
        "client_disconnected",
        "cancelled",
        "budget_exceeded",
        "bad_request",
        "method_not_allowed",
        "request_too_large",
        "headers_too_large",
        "request_timeout",
    }
)


def ended_at(record: UsageRecord) -> float:
    return record.at.timestamp()


def started_at(record: UsageRecord) -> float:
    """When the request arrived (its end less its duration; its end if not measured)."""
    return ended_at(record) - (record.duration_ms or 0.0) / 1000


def customer_error(record: UsageRecord) -> bool:
    """An outcome that is neither `served` nor the caller's doing, or a served answer that
    is a server error: an upstream's 5xx relayed as it is (a status outside
    `failover_status`, the last answer under `on_exhausted = "last_response"`) or the
    fault's own answer. The shipped alert rules count the same."""
    if record.outcome == "served":
        return (record.status is not None and record.status >= 500) or fault_answered(record)
    return record.outcome not in CALLER_OUTCOMES


def fault_answered(record: UsageRecord) -> bool:
    """The caller got the fault's own synthetic answer, relayed as if an upstream gave it:
    `revoke`'s 401 on a route that does not fail over on 401, or `fail`'s 503 with
    `on_exhausted = "last_response"`. Booked `served`, yet every such caller saw an error
    the exercise caused."""
    for attempt in reversed(record.attempts):
        if attempt.skipped is None and attempt.candidate == record.chosen:
            return attempt.fault is not None
    return False


def served_by_fallback(record: UsageRecord) -> bool:
    return (
        record.outcome == "served"
        and record.chosen is not None
        and bool(record.candidates)
        and record.chosen != record.candidates[0]
    )


def secondary_calls(record: UsageRecord, primary: str) -> tuple[int, int]:
    """(calls, 429 answers) made to candidates other than the route's primary."""
    calls = [a for a in record.attempts if a.skipped is None and a.candidate != primary]
    return len(calls), sum(1 for a in calls if a.status == 429)


def _ratio(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def error_rate(records: Sequence[UsageRecord]) -> float | None:
    return _ratio(sum(1 for r in records if customer_error(r)), len(records))


def secondary_429_rate(records: Sequence[UsageRecord], primary: str) -> float | None:
    calls = throttled = 0
    for record in records:
        made, answered_429 = secondary_calls(record, primary)
        calls += made
        throttled += answered_429
    return _ratio(throttled, calls)


def duration_percentile(records: Sequence[UsageRecord], p: float) -> float | None:
    return percentile([r.duration_ms for r in records if r.duration_ms is not None], p)


def windowed(name: str, records: Sequence[UsageRecord], primary: str) -> float | None:
    """An abort criterion's quantity over `records` (those ended inside its window)."""
    if name == "error_rate":
        return error_rate(records)
    if name == "p99_ms":
        return duration_percentile(records, 99)
    if name == "secondary_429":
        return secondary_429_rate(records, primary)
    raise ValueError(name)


def _first(records: Sequence[UsageRecord], t0: float, match: Any) -> float | None:
    times = [started_at(r) - t0 for r in records if match(r)]
    return round(max(min(times), 0.0), 3) if times else None


def observe(
    records: Sequence[UsageRecord], *, t0: float, primary: str, faulted_upstream: str | None
) -> dict[str, Any]:
    """Everything the report states about the exercise: `records` are the route's requests
    that arrived while the fault was set; `t0` is when it was set (epoch seconds)."""
    durations = [r.duration_ms for r in records if r.duration_ms is not None]
    fallbacks = sum(1 for r in records if served_by_fallback(r))
    calls = throttled = 0
    for record in records:
        made, answered_429 = secondary_calls(record, primary)
        calls += made
        throttled += answered_429

    def skipped_open(record: UsageRecord) -> bool:
        return any(
            a.candidate == faulted_upstream and a.skipped == "breaker_open" for a in record.attempts
        )

    def ms(p: float) -> float | None:
        value = percentile(durations, p)
        return None if value is None else round(value, 1)

    rate = error_rate(records)
    secondary = _ratio(throttled, calls)
    return {
        "requests": len(records),
        "errors": sum(1 for r in records if customer_error(r)),
        "error_rate": None if rate is None else round(rate, 4),
        "fallbacks": fallbacks,
        "fallback_share": None if not records else round(fallbacks / len(records), 4),
        "durations_recorded": len(durations),
        "p50_ms": ms(50),
        "p99_ms": ms(99),
        "breaker_open_s": _first(records, t0, skipped_open) if faulted_upstream else None,
        "first_fallback_s": _first(records, t0, served_by_fallback),
        "secondary_calls": calls,
        "secondary_429": throttled,
        "secondary_429_rate": None if secondary is None else round(secondary, 4),
    }


def series(records: Sequence[UsageRecord], *, t0: float, until: float) -> dict[str, Any]:
    """Requests, customer-visible errors, fallbacks, primary successes and p99 per time
    bucket (by when each request ended, seconds from `t0`): the report's charts. About a
    hundred buckets over the watch, at least one second each."""
    span = max(until - t0, 1.0)
    step = max(1.0, round(span / 100))
    count = int(span // step) + 1
    buckets: list[list[UsageRecord]] = [[] for _ in range(count)]
    for record in records:
        index = int((ended_at(record) - t0) // step)
        if 0 <= index < count:
            buckets[index].append(record)
    points = []
    for index, bucket in enumerate(buckets):
        p99 = duration_percentile(bucket, 99)
        rate = error_rate(bucket)
        points.append(
            {
                "t": round(index * step, 3),
                "requests": len(bucket),
                "errors": sum(1 for r in bucket if customer_error(r)),
                "error_rate": None if rate is None else round(rate, 4),
                "fallbacks": sum(1 for r in bucket if served_by_fallback(r)),
                "p99_ms": None if p99 is None else round(p99, 1),
            }
        )
    return {"step_s": step, "points": points}


# The observed key each prediction is judged on.
PREDICTION_KEYS = {
    "recovery_s": "recovery_s",
    "breaker_open_s": "breaker_open_s",
    "first_fallback_s": "first_fallback_s",
    "p50_ms": "p50_ms",
    "p99_ms": "p99_ms",
    "error_rate": "error_rate",
    "secondary_429": "secondary_429_rate",
}


def judge(
    predictions: tuple[Prediction | AlertPrediction, ...],
    observed: dict[str, Any],
    alerts: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    results = []
    for prediction in predictions:
        if isinstance(prediction, AlertPrediction):
            seen = ((alerts or {}).get("alerts") or {}).get(prediction.alert) or {}
            value = seen.get("firing_s")
        else:
            value = observed.get(PREDICTION_KEYS[prediction.name])
        result = "no data" if value is None else "pass" if value <= prediction.value else "fail"
        results.append(
            {
                "prediction": prediction.text,
                "name": prediction.name,
                "unit": prediction.unit,
                "predicted": prediction.value,
                "observed": value,
                "result": result,
            }
        )
    return results


def fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "%":
        return f"{value * 100:.2f}%"
    return f"{value:g} {unit}"
