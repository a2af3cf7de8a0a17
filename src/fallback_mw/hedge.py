"""Hedging (`hedge_after_ms` on a route; off by default).

When the primary attempt has not produced response headers after `hedge_after_ms`, and
the request is replayable, a second attempt at the same primary races it. It is an
attempt like any other: it counts against the ceiling and is admitted by the breaker.
The first response head wins; the loser is cancelled and its response closed, so its
connection is released. Only the walk's first attempt, at the first candidate, is ever
hedged, so a hedge is never combined with a move to a fallback in flight.

`first_head` is the race itself, free of gateway types; `attempt_with_hedge` is the
walker's side of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

import anyio

from fallback_mw.context import AttemptRecord
from fallback_mw.failover import is_failover_class
from fallback_mw.upstream.base import UpstreamError, UpstreamResponse

if TYPE_CHECKING:
    from fallback_mw.config import UpstreamConfig
    from fallback_mw.walker import _Body, _Walk

R = TypeVar("R")
AttemptResult = tuple[UpstreamResponse | None, UpstreamError | None, bool]


async def first_head(
    primary: Coroutine[Any, Any, R],
    start_hedge: Callable[[], Awaitable[Coroutine[Any, Any, R] | None]],
    *,
    after: float,
    is_head: Callable[[R], bool],
    discard: Callable[[int, R | None], Awaitable[None]],
) -> tuple[int, R]:
    """Run `primary`; if it has not finished after `after` seconds, ask `start_hedge` for
    a second attempt and race the two. Returns (0 for the primary / 1 for the hedge, its
    result). Every other attempt is cancelled, and `discard(index, result)` is awaited for
    it (`result` is None when it was cancelled before finishing)."""
    tasks = [asyncio.ensure_future(primary)]
    winner: int | None = None
    last: int | None = None
    try:
        done, _ = await asyncio.wait(tasks, timeout=after)
        if not done:
            hedge = await start_hedge()
            if hedge is not None:
                tasks.append(asyncio.ensure_future(hedge))
        pending = set(tasks)
        while pending and winner is None:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            # The primary first when both finished together: fewer surprises.
            for index in sorted(tasks.index(task) for task in done):
                last = index
                if winner is None and is_head(tasks[index].result()):
                    winner = index
        chosen = winner if winner is not None else last
        assert chosen is not None
        return chosen, tasks[chosen].result()
    finally:
        with anyio.CancelScope(shield=True):
            for index, task in enumerate(tasks):
                if index == winner or (winner is None and index == last):
                    continue
                if not task.done():
                    task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
                result = (
                    task.result() if task.done() and not task.cancelled() and not
                    task.exception() else None
                )  # fmt: skip
                await discard(index, result)


def hedge_applies(walk: _Walk, name: str, body: _Body) -> bool:
    """Only the walk's first attempt, at the first candidate, of a replayable request with
    room for one more attempt."""
    context = walk.context
    route = walk.route
    return (
        route.hedge_after_ms > 0
        and context.attempt_count == 1
        and bool(context.candidates)
        and name == context.candidates[0]
        and body.buffered is not None
        and context.method in route.replayable_methods
        and route.attempt_ceiling >= 2
    )


async def attempt_with_hedge(
    walk: _Walk,
    name: str,
    upstream: UpstreamConfig,
    record: AttemptRecord,
    body: _Body,
    parsed: dict[str, Any] | None,
    credential_index: int | None,
) -> tuple[AttemptResult, AttemptRecord, int | None]:
    """The primary attempt, hedged. Returns the winning result, its record and credential."""
    context = walk.context
    health = walk.walker.health
    records = [record]
    credentials = [credential_index]

    async def start_hedge() -> Coroutine[Any, Any, AttemptResult] | None:
        if (
            context.attempt_count >= walk.route.attempt_ceiling
            or context.remaining <= 0
            or context.client_disconnected
        ):
            return None
        hedge_credential = credential_index
        pool = len(upstream.credential_envs)
        if pool > 1:
            # Each credential at most once per request: the hedge takes another one.
            used = frozenset(walk.used_credentials.get(name, set()))
            hedge_credential = await health.pick_credential(
                name, pool, exclude=used, session=context.session
            )
            if hedge_credential is None:
                return None
        if not await health.admit(name):
            return None  # e.g. the primary attempt is the half-open probe
        hedge_record = walk._start_attempt(name, upstream, hedge_credential, hedge=True)
        records.append(hedge_record)
        credentials.append(hedge_credential)
        return walk._attempt(name, upstream, hedge_record, body, parsed, hedge_credential)

    async def discard(index: int, result: AttemptResult | None) -> None:
        loser = records[index]
        loser.duration = time.monotonic() - loser.started
        if result is None:
            loser.failure_kind = "cancelled"  # lost the race before its head arrived
        else:
            response, error, _ = result
            if response is not None:
                loser.status = response.status
                loser.failure_kind = "cancelled"
                with anyio.CancelScope(shield=True):
                    await response.aclose()
            elif error is not None:
                # A real failure that finished before the winner: the breaker hears it.
                loser.failure_kind = "fault" if loser.fault else error.telemetry_kind
                await health.record(
                    name, failure=is_failover_class(walk.route, status=None, error=error)
                )
        walk.walker.telemetry.attempt_finished(context, loser)

    index, result = await first_head(
        walk._attempt(name, upstream, record, body, parsed, credential_index),
        start_hedge,
        after=walk.route.hedge_after_ms / 1000,
        is_head=lambda outcome: outcome[0] is not None,
        discard=discard,
    )
    return result, records[index], credentials[index]
