"""The written part of a game day: predictions and abort criteria, parsed from the command
line. Every quantity is an upper bound: a prediction passes when the observed value is at
most the predicted one; an abort criterion holds when the value over its trailing window
is above its threshold."""

from __future__ import annotations

import re
from dataclasses import dataclass

# name -> (unit, what it measures). Percent quantities are written with `%` (or as a
# fraction) and kept as fractions.
PREDICTIONS = {
    "breaker_open_s": (
        "s",
        "seconds from the fault to the first request that skipped the "
        "faulted upstream because its breaker was open",
    ),
    "first_fallback_s": ("s", "seconds from the fault to the first request a fallback served"),
    "p50_ms": ("ms", "median request duration while the fault was set"),
    "p99_ms": ("ms", "99th percentile request duration while the fault was set"),
    "error_rate": ("%", "share of requests with a customer-visible error"),
    "secondary_429": ("%", "share of calls to candidates after the first answered 429"),
    "recovery_s": (
        "s",
        "seconds from the revert to the end of the first request the primary served again",
    ),
}
ABORTS = {
    "error_rate": "%",
    "p99_ms": "ms",
    "secondary_429": "%",
}
DEFAULT_ABORT_WINDOW_S = 60.0
MAX_DURATION_S = 24 * 3600.0

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)?")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


class SpecError(ValueError):
    """A prediction, abort criterion or duration the command refuses (exit status 2)."""


def parse_duration(text: str, what: str = "duration") -> float:
    """`15m`, `90s`, `1.5h`, `500ms` or plain seconds; positive and at most a day."""
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise SpecError(f"{what} {text!r}: expected a number with ms, s, m or h (e.g. 15m)")
    seconds = float(match.group(1)) * _UNITS[match.group(2)]
    if not 0 < seconds <= MAX_DURATION_S:
        raise SpecError(f"{what} {text!r}: must be more than 0 and at most 24h")
    return seconds


def _value(name: str, text: str, unit: str) -> float:
    raw = text.strip()
    percent = raw.endswith("%")
    if percent:
        raw = raw[:-1]
    if unit != "%" and percent:
        raise SpecError(f"{name}: {text!r} is in {unit}, not a percentage")
    try:
        value = float(raw)
    except ValueError:
        raise SpecError(f"{name}: {text!r} is not a number") from None
    if value < 0 or value != value or value == float("inf"):
        raise SpecError(f"{name}: {text!r} must be a finite number >= 0")
    if unit == "%":
        if percent:
            value /= 100
        if value > 1:
            raise SpecError(f"{name}: {text!r} is over 100 % (write 5% or 0.05)")
    return value


@dataclass(frozen=True, slots=True)
class Prediction:
    name: str
    value: float  # seconds, milliseconds, or a fraction for `%` quantities
    text: str  # as the operator wrote it

    @property
    def unit(self) -> str:
        return PREDICTIONS[self.name][0]


@dataclass(frozen=True, slots=True)
class AbortCriterion:
    name: str
    threshold: float
    window_s: float
    text: str

    @property
    def unit(self) -> str:
        return ABORTS[self.name]


def _split(text: str, kind: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name.strip() or not value.strip():
        raise SpecError(f"{kind} {text!r}: expected NAME=VALUE")
    return name.strip(), value.strip()


@dataclass(frozen=True, slots=True)
class AlertPrediction:
    """`alert:NAME<=DURATION`: the Prometheus alert NAME is firing within DURATION of the
    fault being set (checked against the real alert state, `--prometheus URL`)."""

    alert: str
    within_s: float
    text: str

    @property
    def name(self) -> str:
        return f"alert:{self.alert}"

    @property
    def value(self) -> float:
        return self.within_s

    @property
    def unit(self) -> str:
        return "s"


_ALERT = re.compile(r"alert:([A-Za-z_:][A-Za-z0-9_:]*)\s*<=\s*(\S+)")


def parse_prediction(text: str) -> Prediction | AlertPrediction:
    if text.strip().startswith("alert:"):
        match = _ALERT.fullmatch(text.strip())
        if match is None:
            raise SpecError(
                f"--predict {text!r}: expected alert:NAME<=DURATION (e.g. "
                "alert:FallbackMwBreakerOpen<=90s)"
            )
        within = parse_duration(match.group(2), f"--predict {text!r}")
        return AlertPrediction(match.group(1), within, text)
    name, value = _split(text, "--predict")
    if name not in PREDICTIONS:
        known = ", ".join(PREDICTIONS)
        raise SpecError(f"--predict {text!r}: unknown quantity {name!r} (known: {known})")
    return Prediction(name, _value(name, value, PREDICTIONS[name][0]), text)


def parse_abort(text: str) -> AbortCriterion:
    name, value = _split(text, "--abort")
    if name not in ABORTS:
        known = ", ".join(ABORTS)
        raise SpecError(f"--abort {text!r}: unknown criterion {name!r} (known: {known})")
    threshold, _, window = value.partition("/")
    window_s = parse_duration(window, f"--abort {text!r} window") if window else None
    return AbortCriterion(
        name, _value(name, threshold, ABORTS[name]), window_s or DEFAULT_ABORT_WINDOW_S, text
    )
