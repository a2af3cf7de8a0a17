"""Differential: one generated sequence of breaker and credential-pool operations run on the
memory state and on the Redis state side by side must give the same answers (SPEC §6: the
Redis state shares the breakers and credential health; it must not judge them otherwise).
Admissions, probes and their outcomes or releases, faults and their resets, an upstream
moved to another url (`forget`), pool picks with and without a session, 401 / 403 / 429 /
failures on pool credentials, and waits past every cooldown. Both run in lock step, each
operation on one and then the other: every cooldown is long against that gap. A stretch
between two waits is compared while it is shorter than half the shortest cooldown (a
loaded machine's slower stretch stops the example there): a cooldown that began in it
cannot end between one state's answer and the other's."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fallback_mw.config import BreakerConfig
from fallback_mw.health import Admission, HealthState
from fallback_mw.health.memory import MemoryHealth
from fallback_mw.health.redis import RedisHealth

SETTINGS = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

COOLDOWN_MS = 1000  # every operation between two waits takes far less
MAX_COOLDOWN_MS = 1500
SHORTEST = 1.0  # seconds: the shortest cooldown drawn (a 429's Retry-After, a quota's)
POOL = 3
UPSTREAMS = ["u", "pool"]

breakers = st.builds(
    BreakerConfig,
    window=st.integers(1, 4),
    min_calls=st.integers(1, 4),
    failure_rate=st.sampled_from([0.25, 0.5, 2 / 3, 1.0]),
    cooldown_ms=st.just(COOLDOWN_MS),
    max_cooldown_ms=st.just(MAX_COOLDOWN_MS),
)
faults = st.sampled_from([None, None, "fail", "hang"])
operations = st.lists(
    st.one_of(
        # An attempt: admitted (or not) and its outcome recorded at once.
        st.tuples(st.just("attempt"), st.sampled_from(UPSTREAMS), st.booleans(), faults),
        st.tuples(st.just("attempt"), st.just("u"), st.booleans(), st.just(None)),
        st.tuples(st.just("admit"), st.sampled_from(UPSTREAMS)),
        st.tuples(st.just("record"), st.integers(0, 5), st.booleans(), faults),
        st.tuples(st.just("release"), st.integers(0, 5)),
        st.tuples(st.just("reset_fault"), st.sampled_from(UPSTREAMS)),
        st.tuples(st.just("forget"), st.sampled_from(UPSTREAMS)),
        st.tuples(
            st.just("pick"),
            st.frozensets(st.integers(0, POOL - 1), max_size=2),
            st.sampled_from([None, "s1", "s2"]),
            st.sampled_from(["round_robin", "score"]),
        ),
        st.tuples(
            st.just("credential"),
            st.integers(0, POOL - 1),
            st.sampled_from([None, 200, 401, 403, 429, 503]),
            st.sampled_from([None, 0.0, 1.0, 100.0]),
            st.sampled_from([None, 1.2]),
            st.sampled_from([None, 0.05, 2.0]),  # latency: the score's
        ),
        st.tuples(st.just("fault_marked"), st.integers(0, POOL - 1), st.sampled_from(["revoke"])),
        st.tuples(st.just("wait")),
    ),
    max_size=30,
).filter(lambda ops: sum(op[0] == "wait" for op in ops) <= 1)


@dataclass
class Run:
    """One state under test, and what its sequence has made so far."""

    health: HealthState
    admissions: list[tuple[str, Admission]] = field(default_factory=list)
    moves: int = 0  # urls the upstreams were moved to (`forget`)


async def _step(run: Run, op: Any) -> Any:
    kind, health = op[0], run.health
    if kind == "admit":
        admission = Admission()
        admitted = await health.admit(op[1], admission=admission)
        if admitted:
            run.admissions.append((op[1], admission))
        return admitted
    if kind == "attempt":
        admission = Admission()
        if not await health.admit(op[1], admission=admission):
            return False
        await health.record(op[1], failure=op[2], fault=op[3], admission=admission)
        return True
    if kind in ("record", "release"):
        if op[1] >= len(run.admissions):
            return None
        upstream, admission = run.admissions[op[1]]
        if kind == "record":
            await health.record(upstream, failure=op[2], fault=op[3], admission=admission)
        else:
            await health.release(upstream, admission)
        return None
    if kind == "reset_fault":
        await health.reset_fault(op[1])
        return None
    if kind == "forget":  # a reload moved the upstream to another url than its last
        run.moves += 1
        await health.forget(op[1], f"http://127.0.0.1:9/{run.moves}")
        return None
    if kind == "pick":
        return await health.pick_credential(
            "pool", POOL, exclude=op[1], session=op[2], selection=op[3]
        )
    if kind == "credential":
        _, index, status, retry_after, quota, latency = op
        await health.credential_result(
            "pool", index, status=status, failure=status == 503, retry_after=retry_after,
            session=None, quota=quota if status == 429 else None, latency=latency,
        )  # fmt: skip
        return None
    if kind == "fault_marked":
        await health.fault_marked("pool", op[1], op[2])
        return None
    raise AssertionError(op)


async def _observe(health: HealthState) -> tuple[list[Any], list[float]]:
    """What each upstream's health says, and the seconds until it is usable again when that
    is neither now nor never (compared within the lock step's gap: the memory state keeps
    a float, Redis whole ms, each read a moment apart)."""
    seen: list[Any] = []
    waits: list[float] = []
    for upstream in UPSTREAMS:
        wait = await health.usable_in(upstream, POOL if upstream == "pool" else 1)
        if wait not in (None, 0.0):
            assert wait is not None
            waits.append(wait)
        seen.append(
            (upstream, wait if wait in (None, 0.0) else "later",
             await health.open_fault(upstream), await health.skip_fault(upstream),
             await health.pool_fault(upstream))
        )  # fmt: skip
    return seen, waits


async def _compare(redis_url: str, config: BreakerConfig, ops: list[Any]) -> None:
    memory = MemoryHealth(config)
    shared = RedisHealth(redis_url + f"x{time.monotonic_ns()}:", config)
    runs = {"memory": Run(memory), "redis": Run(shared)}
    try:
        # Prime the pool so both know it is one (credential_result is ignored before).
        for run in runs.values():
            await run.health.pick_credential(
                "pool", POOL, exclude=frozenset(range(POOL)), session=None
            )
        stretch = time.monotonic()
        for n, op in enumerate(ops):
            if op[0] == "wait":
                await asyncio.sleep(MAX_COOLDOWN_MS / 1000 + 0.15)
                stretch = time.monotonic()
                continue
            if time.monotonic() - stretch > SHORTEST / 2:
                return  # a cooldown begun in this stretch may end between the two answers
            answers = {name: await _step(run, op) for name, run in runs.items()}
            assert answers["memory"] == answers["redis"], (n, op, answers)
            (seen, waits), (shared_seen, shared_waits) = [
                await _observe(run.health) for run in runs.values()
            ]
            assert seen == shared_seen, (n, op, seen, shared_seen)
            for wait, shared_wait in zip(waits, shared_waits, strict=True):
                assert abs(wait - shared_wait) < SHORTEST / 2, (n, op, waits, shared_waits)
    finally:
        await shared.aclose()


@pytest.mark.slow
@SETTINGS
@given(config=breakers, ops=operations)
def test_memory_and_redis_health_answer_alike(
    config: BreakerConfig, ops: list[Any], redis_url: str
) -> None:
    asyncio.run(_compare(redis_url, config, ops))


@pytest.mark.anyio
async def test_an_outcome_of_the_old_url_does_not_open_the_new_urls_breaker_on_redis(
    redis_url: str,
) -> None:
    """An attempt admitted before a reload moved its upstream to another url (`forget`)
    judged the old url: its failure goes to no breaker, on the memory state and on Redis.
    On Redis it was counted against the new url's fresh breaker and opened it."""
    config = BreakerConfig(window=1, min_calls=1, failure_rate=1.0, cooldown_ms=60_000)
    for health in (MemoryHealth(config), RedisHealth(redis_url, config)):
        try:
            admission = Admission()
            assert await health.admit("u", admission=admission)
            await health.forget("u", "http://127.0.0.1:9/new")
            await health.record("u", failure=True, admission=admission)
            assert await health.admit("u"), type(health).__name__
        finally:
            await health.aclose()
