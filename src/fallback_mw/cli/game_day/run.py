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

from fallback_mw.budget import Ledger, LedgerUnavailable, UsageRecord
from fallback_mw.cli.game_day.observe import (
    ended_at,
    fmt,
    observe,
    series,
    started_at,
    windowed,
)
from fallback_mw.cli.game_day.prometheus import AlertWatcher
from fallback_mw.cli.game_day.spec import AbortCriterion, AlertPrediction, Prediction
from fallback_mw.store.model import Fault, StoreError
from fallback_mw.store.routes import RouteStore

FaultKind = Literal["fail", "hang", "blackhole", "revoke", "pin"]
MAX_RECORDS = 1_000_000
# Records from several gateway processes reach the store out of order: each poll re-asks
# for the last few seconds before the newest record seen (duplicates dropped by id).
RECORD_LAG_S = 5.0
# A clear the store refused is retried, backing off from the first to the last wait, until
# it is done or the fault has expired (a store restart must not leave the fault injecting,
# unwatched, for the rest of its --duration).
CLEAR_RETRY_S = (0.5, 5.0)


class GameDayRefused(Exception):
    """The exercise cannot start as asked (exit status 2); nothing was set."""


class InterruptedBeforeTheFault(Exception):
    """Ctrl-C / SIGTERM came before the fault was set (exit status 130); nothing was set."""


@dataclass(frozen=True, slots=True)
class Exercise:
    route: str
    fault: FaultKind
    target: str  # the faulted upstream (fail, hang) or the pinned route (pin)
    candidate: str | None  # pin: the candidate the plan starts at
    primary: str  # the route's first candidate: every other one is a "secondary"
    duration_s: float
    predictions: tuple[Prediction | AlertPrediction, ...]
    aborts: tuple[AbortCriterion, ...]
    poll_s: float = 1.0
    grace_s: float = 2.0  # after the fault is cleared, for records of requests in flight
    owner: str = ""  # the one person who may call the abort
    recovery_wait_s: float = 30.0  # after the revert, for the primary's first success
    candidates: tuple[str, ...] = ()  # the route's plan: whose alerts are the exercise's

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
    recovered: float | None = None  # end of the first request the primary served after
    watched_until: float | None = None  # the last poll (after the recovery wait)
    # The fault left the store before the command cleared it (`faults clear`, the one-action
    # revert, or a `faults set --replace` on its target): seconds from the fault being set
    # to the last poll that still found it, which is when the revert is dated.
    cleared_outside: float | None = None
    failure: str | None = None  # the store or ledger failed mid-exercise: what it said


class RecordFeed:
    """The route's usage records since the fault was set, read incrementally: each poll
    asks the ledger only for records that ended after the newest one seen (less
    RECORD_LAG_S for writers that lag), and keeps those it had not seen."""

    def __init__(self, ledger: Ledger, route: str, since: float) -> None:
        self.ledger = ledger
        self.route = route
        self.since = since
        self.records: list[UsageRecord] = []
        self._seen: set[str] = set()
        self._newest = since
        self.polls = 0
        self.fetched = 0  # records returned by the ledger over all polls (the cost)

    async def poll(self) -> list[UsageRecord]:
        cursor = max(self.since, self._newest - RECORD_LAG_S)
        batch = await self.ledger.usage(
            since=datetime.fromtimestamp(cursor, UTC), route=self.route, limit=MAX_RECORDS
        )
        self.polls += 1
        self.fetched += len(batch)
        fresh = []
        for record in batch:
            key = record.request_id
            if key in self._seen or started_at(record) < self.since:
                continue
            self._seen.add(key)
            fresh.append(record)
            self._newest = max(self._newest, ended_at(record))
        self.records.extend(fresh)
        return fresh

    def ended_since(self, moment: float) -> list[UsageRecord]:
        """Records that ended at or after `moment`, scanning back from the newest only as
        far as the lag allowance requires (records are kept in arrival order, which is
        end order give or take RECORD_LAG_S)."""
        found: list[UsageRecord] = []
        for record in reversed(self.records):
            end = ended_at(record)
            if end < moment - RECORD_LAG_S:
                break
            if end >= moment:
                found.append(record)
        found.reverse()
        return found


def iso(moment: float | None) -> str | None:
    if moment is None:
        return None
    return datetime.fromtimestamp(moment, UTC).isoformat().replace("+00:00", "Z")


def _abort_holding(
    exercise: Exercise, feed: RecordFeed, now: float
) -> tuple[AbortCriterion, float] | None:
    for criterion in exercise.aborts:
        recent = feed.ended_since(now - criterion.window_s)
        value = windowed(criterion.name, recent, exercise.primary)
        if value is not None and value > criterion.threshold:
            return criterion, value
    return None


async def _clear(store: RouteStore, fault: Fault) -> int:
    """The exercise's own fault, no other: once it was cleared outside the command, its
    target may hold another exercise's fault, which is not this one's to end."""
    if fault.scope == "route":
        return await store.clear_faults(route=fault.target, expires_at=fault.expires_at)
    return await store.clear_faults(upstream=fault.target, expires_at=fault.expires_at)


async def _clear_until_done(
    store: RouteStore,
    fault: Fault,
    ends: float,
    emit: Callable[[str], None],
    give_up: asyncio.Event | None,
) -> int | None:
    """Clear the exercise's fault, retrying while the store refuses; None when it could
    not be cleared before its expiry (`ends`, on this host's clock) or `give_up` was set
    (a second Ctrl-C)."""
    wait, longest = CLEAR_RETRY_S
    told = False
    while True:
        try:
            return await _clear(store, fault)
        except StoreError as exc:
            left = ends - time.time()
            if left <= 0 or (give_up is not None and give_up.is_set()):
                return None
            if not told:
                emit(
                    f"cannot clear the fault yet ({exc}); retrying until it is cleared or "
                    f"expires at {iso(fault.expires_at)} (Ctrl-C again to stop retrying)"
                )
                told = True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for((give_up or asyncio.Event()).wait(), min(wait, left))
            wait = min(wait * 2, longest)


async def run_exercise(
    exercise: Exercise,
    store: RouteStore,
    ledger: Ledger,
    stop: asyncio.Event,
    emit: Callable[[str], None],
    on_started: Callable[[Timeline], None],
    *,
    alerts: AlertWatcher | None = None,
    give_up: asyncio.Event | None = None,
) -> tuple[Timeline, RecordFeed]:
    timeline = Timeline(started=time.time())
    timeline.expires = timeline.started + exercise.duration_s
    store_now = await store.clock()  # read after `started`: the stored expiry is not sooner
    fault = Fault(
        kind=exercise.fault,
        target=exercise.target,
        # On the store's clock, which the gateways end it by (this host's may be off).
        expires_at=store_now + exercise.duration_s,
        candidate=exercise.candidate,
    )
    if stop.is_set():  # stopped while getting ready (the Prometheus baseline): set nothing
        raise InterruptedBeforeTheFault
    # Refused atomically by the store while a fault holds the same target.
    active = await store.set_fault(fault)
    if active is not None:
        left = max(active.expires_at - store_now, 0)
        raise GameDayRefused(
            f"a {active.kind} fault is already set on {exercise.target!r} "
            f"(expires in {left:.0f} s); clear it first with `fallback-mw faults clear`"
        )
    feed = RecordFeed(ledger, exercise.route, timeline.started)
    seen_set = timeline.started  # the last moment the fault was seen in the store
    try:
        on_started(timeline)
        emit(f"fault set: {exercise.describe()}, expires {iso(timeline.expires)}")
        while not stop.is_set():
            now = time.time()
            if now >= timeline.expires:
                break
            try:
                await feed.poll()
                still_set = fault in await store.load_faults()
                # Gone before its expiry on the store's clock (the one that ends it, which
                # may run a little ahead of this host's): cleared by hand, or replaced.
                gone_early = not still_set and await store.clock() < fault.expires_at
            except (StoreError, LedgerUnavailable) as exc:
                # The abort criteria can no longer be watched: the fault goes now.
                timeline.failure = str(exc)
                break
            if not still_set:
                if gone_early:  # the exercise's fault period ended then
                    timeline.cleared_outside = round(seen_set - timeline.started, 3)
                break  # else it expired: the exercise's time is up
            seen_set = now
            if alerts is not None:
                alerts.poll_soon()
            holding = _abort_holding(exercise, feed, now)
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
        # Whatever happened above (an abort, Ctrl-C, a store error), the fault goes now,
        # retried while the store refuses; given up only at its expiry (which ends it
        # anyway) or on a second Ctrl-C.
        timeline.cleared_count = await asyncio.shield(
            _clear_until_done(store, fault, timeline.expires, emit, give_up)
        )
        now = time.time()
        if timeline.cleared_outside is not None:
            timeline.cleared = timeline.started + timeline.cleared_outside
        elif timeline.cleared_count is not None:
            timeline.cleared = now
        elif now >= timeline.expires:  # not cleared, but over: it ended at its expiry
            timeline.cleared = timeline.expires
    if timeline.failure is not None:
        done = (
            "the fault is still set"
            if timeline.cleared is None
            else "fault cleared"
            if timeline.cleared_count is not None
            else "the fault expired"
        )
        emit(f"store failed: {timeline.failure}; {done}")
    elif timeline.cleared_outside is not None:
        emit(
            f"the fault was cleared outside the command (faults clear, or replaced) after "
            f"+{timeline.cleared_outside:.1f} s: the exercise ends there"
        )
    elif timeline.abort is not None:
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
    return timeline, feed


def _primary_success_after(
    records: list[UsageRecord], primary: str, cleared: float
) -> float | None:
    ends = [
        ended_at(r)
        for r in records
        if r.outcome == "served" and r.chosen == primary and ended_at(r) >= cleared
    ]
    return min(ends) if ends else None


async def watch_recovery(
    exercise: Exercise,
    feed: RecordFeed,
    timeline: Timeline,
    stop: asyncio.Event,
    emit: Callable[[str], None],
    *,
    alerts: AlertWatcher | None = None,
) -> None:
    """After the revert: until the primary has served a request again and every alert
    that fired has resolved (at most `recovery_wait_s`), and at least `grace_s` for the
    records of requests in flight."""
    cleared = timeline.cleared or time.time()
    while not stop.is_set():
        now = time.time()
        try:
            await feed.poll()
        except (StoreError, LedgerUnavailable) as exc:  # the fault is cleared already
            timeline.failure = f"{exc} (while watching the recovery)"
            break
        if alerts is not None:
            alerts.poll_soon()
        timeline.recovered = _primary_success_after(feed.records, exercise.primary, cleared)
        waited = now - cleared
        settled = alerts is None or alerts.all_resolved()
        if (timeline.recovered is not None and settled and waited >= exercise.grace_s) or (
            waited >= max(exercise.recovery_wait_s, exercise.grace_s)
        ):
            break
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), exercise.poll_s)
    timeline.watched_until = time.time()
    if timeline.recovered is not None:
        emit(f"recovered: the primary served again {timeline.recovered - cleared:.1f} s after")
    elif not stop.is_set() and timeline.failure is None:
        emit(
            f"not recovered: the primary served no request within "
            f"{exercise.recovery_wait_s:g} s of the revert"
        )


async def read_in_flight(exercise: Exercise, feed: RecordFeed, timeline: Timeline) -> None:
    """After Ctrl-C / SIGTERM: no recovery watch, but the moment (`grace_s` after the
    revert) for the records of requests still in flight, and one last read. Without it the
    report left out every request that ended after the last poll (up to a poll interval of
    them, plus those in flight): fewer requests, errors and fallbacks than callers saw."""
    cleared = timeline.cleared or time.time()
    await asyncio.sleep(max(0.0, cleared + exercise.grace_s - time.time()))
    try:
        await feed.poll()
    except (StoreError, LedgerUnavailable) as exc:  # what was read before stands
        timeline.failure = f"{exc} (while reading the requests in flight)"
    timeline.recovered = _primary_success_after(feed.records, exercise.primary, cleared)
    timeline.watched_until = time.time()


def observe_exercise(exercise: Exercise, feed: RecordFeed, timeline: Timeline) -> dict[str, Any]:
    """The observed numbers: the predictions' quantities over requests that arrived while
    the fault was set; the recovery; and the series over the whole watch."""
    end = timeline.cleared or time.time()
    during = [r for r in feed.records if timeline.started <= started_at(r) <= end]
    observed = observe(
        during,
        t0=timeline.started,
        primary=exercise.primary,
        faulted_upstream=None if exercise.fault == "pin" else exercise.target,
    )
    observed["recovery_s"] = (
        None
        if timeline.recovered is None or timeline.cleared is None
        else round(max(timeline.recovered - timeline.cleared, 0.0), 3)
    )
    observed["series"] = series(
        feed.records, t0=timeline.started, until=timeline.watched_until or end
    )
    observed["record_polls"] = feed.polls
    observed["records_fetched"] = feed.fetched
    return observed
