"""Running one game day: set the fault in the store (its expiry no later than the end),
watch the route's usage records as every gateway process writes them, clear the fault at
once when an abort criterion holds, when time is up, or when the command is stopped; then
judge each prediction against what was observed."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from fallback_mw.budget import Ledger, UsageRecord
from fallback_mw.cli.game_day.observe import (
    PREDICTION_KEYS,
    ended_at,
    observe,
    started_at,
    windowed,
)
from fallback_mw.cli.game_day.spec import AbortCriterion, Prediction
from fallback_mw.store.model import Fault
from fallback_mw.store.routes import RouteStore

FaultKind = Literal["fail", "hang", "pin"]
MAX_RECORDS = 1_000_000


class GameDayRefused(Exception):
    """The exercise cannot start as asked (exit status 2); nothing was set."""


@dataclass(frozen=True, slots=True)
class Exercise:
    route: str
    fault: FaultKind
    target: str  # the faulted upstream (fail, hang) or the pinned route (pin)
    candidate: str | None  # pin: the candidate the plan starts at
    primary: str  # the route's first candidate: every other one is a "secondary"
    duration_s: float
    predictions: tuple[Prediction, ...]
    aborts: tuple[AbortCriterion, ...]
    poll_s: float = 1.0
    grace_s: float = 2.0  # after the fault is cleared, for records of requests in flight

    @property
    def scope(self) -> str:
        return "route" if self.fault == "pin" else "upstream"

    def describe(self) -> str:
        if self.fault == "pin":
            return f"pin route {self.route!r} to {self.candidate!r}"
        return f"{self.fault} upstream {self.target!r} (route {self.route!r})"


@dataclass
class Abort:
    criterion: AbortCriterion
    observed: float
    at_s: float


@dataclass
class Timeline:
    started: float = 0.0
    expires: float = 0.0
    cleared: float | None = None
    abort: Abort | None = None
    interrupted: bool = False
    cleared_count: int | None = None
    notes: list[str] = field(default_factory=list)


def iso(moment: float | None) -> str | None:
    if moment is None:
        return None
    return datetime.fromtimestamp(moment, UTC).isoformat().replace("+00:00", "Z")


async def _records(ledger: Ledger, route: str, since: float) -> list[UsageRecord]:
    return await ledger.usage(
        since=datetime.fromtimestamp(since, UTC), route=route, limit=MAX_RECORDS
    )


def _abort_holding(
    exercise: Exercise, records: list[UsageRecord], now: float
) -> tuple[AbortCriterion, float] | None:
    for criterion in exercise.aborts:
        recent = [r for r in records if ended_at(r) >= now - criterion.window_s]
        value = windowed(criterion.name, recent, exercise.primary)
        if value is not None and value > criterion.threshold:
            return criterion, value
    return None


async def _clear(store: RouteStore, exercise: Exercise) -> int:
    if exercise.scope == "route":
        return await store.clear_faults(route=exercise.target)
    return await store.clear_faults(upstream=exercise.target)


async def run_exercise(
    exercise: Exercise,
    store: RouteStore,
    ledger: Ledger,
    stop: asyncio.Event,
    emit: Callable[[str], None],
    on_started: Callable[[Timeline], None],
) -> Timeline:
    active = [
        f
        for f in await store.load_faults()
        if f.scope == exercise.scope and f.target == exercise.target
    ]
    if active:
        left = max(active[0].expires_at - time.time(), 0)
        raise GameDayRefused(
            f"a {active[0].kind} fault is already set on {exercise.target!r} "
            f"(expires in {left:.0f} s); clear it first with `fallback-mw faults clear`"
        )
    timeline = Timeline(started=time.time())
    timeline.expires = timeline.started + exercise.duration_s
    fault = Fault(
        kind=exercise.fault,
        target=exercise.target,
        expires_at=timeline.expires,
        candidate=exercise.candidate,
    )
    active_now = await store.set_fault(fault)
    if active_now is not None:  # set by someone else since the check above
        raise GameDayRefused(
            f"a {active_now.kind} fault was set on {exercise.target!r} meanwhile; nothing set"
        )
    try:
        on_started(timeline)
        emit(f"fault set: {exercise.describe()}, expires {iso(timeline.expires)}")
        while not stop.is_set():
            now = time.time()
            if now >= timeline.expires:
                break
            records = [
                r
                for r in await _records(ledger, exercise.route, timeline.started)
                if started_at(r) >= timeline.started
            ]
            holding = _abort_holding(exercise, records, now)
            if holding is not None:
                criterion, value = holding
                timeline.abort = Abort(criterion, value, round(now - timeline.started, 3))
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    stop.wait(), min(exercise.poll_s, max(timeline.expires - now, 0.01))
                )
        timeline.interrupted = stop.is_set() and timeline.abort is None
    finally:
        # Whatever happened above (an abort, Ctrl-C, a store error), the fault goes now;
        # if even this fails, the expiry in the store ends it.
        timeline.cleared_count = await asyncio.shield(_clear(store, exercise))
        timeline.cleared = time.time()
    if timeline.abort is not None:
        abort = timeline.abort
        emit(
            f"ABORT at +{abort.at_s:.1f} s: {abort.criterion.text} holds "
            f"({fmt(abort.observed, abort.criterion.unit)} over the last "
            f"{abort.criterion.window_s:g} s); fault cleared"
        )
    elif timeline.interrupted:
        emit("interrupted: fault cleared")
    else:
        emit("time is up: fault cleared")
    return timeline


async def observe_exercise(
    exercise: Exercise, ledger: Ledger, timeline: Timeline, *, wait: bool = True
) -> dict[str, Any]:
    """The observed numbers for requests that arrived while the fault was set."""
    if wait:
        await asyncio.sleep(exercise.grace_s)
    end = timeline.cleared or time.time()
    records = [
        r
        for r in await _records(ledger, exercise.route, timeline.started)
        if timeline.started <= started_at(r) <= end
    ]
    return observe(
        records,
        t0=timeline.started,
        primary=exercise.primary,
        faulted_upstream=None if exercise.fault == "pin" else exercise.target,
    )


def judge(predictions: tuple[Prediction, ...], observed: dict[str, Any]) -> list[dict[str, Any]]:
    results = []
    for prediction in predictions:
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
