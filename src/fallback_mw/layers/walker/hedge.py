"""Hedging (`hedge_after_ms` on a route; off by default).

When the primary attempt has not produced response headers after `hedge_after_ms`, and
the request could make a further attempt (`decide.further_attempt_possible`), a second
attempt at the same primary races it. It is an attempt like any other: it counts against
the ceiling and is admitted by the breaker. The first response head that is not
failover-class wins (a 503 while the other attempt still runs is finished as the failure
it is, and the race goes on); the loser is cancelled and its response closed, so its
connection is released. Whether the walk's attempt is hedged at all is
`failover.replay.may_hedge`.

`first_head` is the race itself, free of gateway types; `run_hedged` runs it with the
request's attempt lifecycle (reservation, start, run, lose the race) and the cursor (which
credential the hedge uses): it never calls back into the walk.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import anyio

from fallback_mw.failover.attempt import AttemptLifecycle
from fallback_mw.failover.outcome import fails_in_a_race
from fallback_mw.failover.send import AttemptResult
from fallback_mw.layers.walker.cursor import CandidateCursor, Pick
from fallback_mw.request.context import AttemptRecord
from fallback_mw.upstream.base import UpstreamResponse

R = TypeVar("R")


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
    it (`result` is None when it was cancelled before finishing). One that finished without
    a head while another still runs is discarded then, not after the race: its record ends
    when it did (a timeout of 300 ms reads 300 ms) and its upstream's health hears of it."""
    tasks = [asyncio.ensure_future(primary)]
    winner: int | None = None
    last: int | None = None
    discarded: set[int] = set()
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
            if winner is None and pending:
                # Failed while another runs on: finished now (it cannot be the one returned).
                for index in sorted(tasks.index(task) for task in done):
                    discarded.add(index)
                    with anyio.CancelScope(shield=True):
                        await discard(index, tasks[index].result())
        chosen = winner if winner is not None else last
        assert chosen is not None
        result = tasks[chosen].result()
    except BaseException as exc:
        # Not a `finally`: a mypyc-compiled coroutine re-raises a stale exception after a
        # `finally` that awaits (scripts/compile.py).
        await _finish_others(tasks, winner, last, discarded, discard)
        raise exc
    await _finish_others(tasks, winner, last, discarded, discard)
    return chosen, result


async def _finish_others(
    tasks: list[asyncio.Task[R]],
    winner: int | None,
    last: int | None,
    discarded: set[int],
    discard: Callable[[int, R | None], Awaitable[None]],
) -> None:
    """Every attempt of the race but the one returned (and those already discarded):
    cancelled if still running, then discarded, shielded."""
    with anyio.CancelScope(shield=True):
        for index, task in enumerate(tasks):
            if index == winner or (winner is None and index == last) or index in discarded:
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


async def run_hedged(
    attempts: AttemptLifecycle,
    cursor: CandidateCursor,
    pick: Pick,
    record: AttemptRecord,
    *,
    after: float,
    may_start: Callable[[], bool],
    keep: Callable[[str, UpstreamResponse, AttemptRecord], Awaitable[None]],
) -> tuple[AttemptResult, AttemptRecord]:
    """The primary attempt (`pick`, started as `record`), hedged after `after` seconds when
    `may_start()` still holds (`decide.further_attempt_possible`). Returns the winning
    result and its record; the loser is finished by the lifecycle (`lose`), and a loser's
    failover-class answer handed to `keep` (the walk's last upstream answer, for
    `on_exhausted = "last_response"`, as a failed attempt's outside a race)."""
    records = [record]

    async def start_hedge() -> Coroutine[Any, Any, AttemptResult] | None:
        if not may_start():
            return None
        hedge = await cursor.pick_hedge(pick, record.credential_index)
        if hedge is None:
            return None
        hedge_record = attempts.start(
            hedge.name, hedge.upstream, hedge.credential_index, hedge=True
        )
        records.append(hedge_record)
        return attempts.run(hedge.name, hedge.upstream, hedge_record)

    async def discard(index: int, result: AttemptResult | None) -> None:
        answer = await attempts.lose(records[index], result)
        if answer is not None:
            await keep(records[index].candidate, answer, records[index])

    failover_status = attempts.failover_status
    pooled = len(pick.upstream.credential_envs) > 1
    index, result = await first_head(
        attempts.run(pick.name, pick.upstream, record),
        start_hedge,
        after=after,
        # A failover-class answer (a 503), or a pool credential's own 401/403/429, does not
        # win the race: the other attempt, still running, may yet answer well; the failure
        # is finished as one (`lose`).
        is_head=lambda outcome: (
            outcome[1] is not None
            and not fails_in_a_race(outcome[0], failover_status, pooled=pooled)
        ),
        discard=discard,
    )
    return result, records[index]
