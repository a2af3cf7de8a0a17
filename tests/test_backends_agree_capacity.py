"""Differential: one generated sequence of capacity reservations (declared `rpm` / `tpm`,
estimates corrected by the reported usage, attempts taken back, repeats against the repeat
allowance) and `free_in` questions, run on the memory counts and on the Redis ones side by
side, must give the same answers (SPEC §11: an attempt over a declared capacity is skipped
with reason `capacity`, whichever state counts it). The memory counts run on the wall clock
here, the clock Redis's `TIME` reads on this host, and every operation starts early in a
second, so both count it in the same one-second bucket."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fallback_mw.capacity import Ask, Reservation
from fallback_mw.capacity.memory import MemoryCapacity
from fallback_mw.capacity.model import CapacityState
from fallback_mw.capacity.redis import RedisCapacity
from fallback_mw.config import RepeatAllowanceConfig
from fallback_mw.health.redis import RedisHealth

SETTINGS = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

allowances = st.builds(
    RepeatAllowanceConfig,
    percent=st.sampled_from([0.0, 50.0, 100.0]),
    min_per_second=st.sampled_from([0.0, 1.0]),
    window_ms=st.sampled_from([1000, 2000]),
)
asks = st.builds(
    Ask,
    rpm=st.sampled_from([None, 0, 1, 2, 3]),
    tpm=st.sampled_from([None, 0, 10, 25]),
    tokens=st.sampled_from([0, 5, 10, 30]),
    repeat=st.booleans(),
)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("reserve"), st.sampled_from(["a", "b"]), asks),
        st.tuples(st.just("settle"), st.integers(0, 5), st.sampled_from([0, 3, 12, 40])),
        st.tuples(st.just("cancel"), st.integers(0, 5)),
        st.tuples(st.just("release"), st.integers(0, 5)),
        st.tuples(st.just("free_in"), st.sampled_from(["a", "b"]), asks),
        st.tuples(st.just("wait"), st.sampled_from([1, 2])),
    ),
    max_size=25,
).filter(lambda ops: sum(op[1] for op in ops if op[0] == "wait") <= 3)


@dataclass
class Run:
    state: CapacityState
    reservations: list[Reservation] = field(default_factory=list)


async def _early_in_a_second() -> None:
    fraction = time.time() % 1
    if fraction > 0.6:
        await asyncio.sleep(1.02 - fraction)


async def _step(run: Run, op: Any) -> Any:
    kind, state = op[0], run.state
    if kind == "reserve":
        verdict = await state.reserve(op[1], op[2])
        if isinstance(verdict, Reservation):
            run.reservations.append(verdict)
            return "ok"
        return verdict
    if kind == "free_in":
        return await state.free_in(op[1], op[2])
    if op[1] >= len(run.reservations):
        return None
    reservation = run.reservations[op[1]]
    if kind == "settle":
        await state.settle(reservation, op[2])
    elif kind == "cancel":
        await state.cancel(reservation)
    else:
        await state.release_capacity(reservation)
    return None


async def _compare(redis_url: str, allowance: RepeatAllowanceConfig, ops: list[Any]) -> None:
    health = RedisHealth(redis_url + f"x{time.monotonic_ns()}:")
    runs = {
        "memory": Run(MemoryCapacity(allowance, clock=time.time)),
        "redis": Run(RedisCapacity(health, allowance, owned=True)),
    }
    try:
        for n, op in enumerate(ops):
            if op[0] == "wait":
                await asyncio.sleep(op[1])
                continue
            await _early_in_a_second()
            answers = {name: await _step(run, op) for name, run in runs.items()}
            assert answers["memory"] == answers["redis"], (n, op, answers)
    finally:
        await runs["redis"].state.aclose()


@pytest.mark.slow
@SETTINGS
@given(allowance=allowances, ops=operations)
def test_memory_and_redis_capacity_answer_alike(
    allowance: RepeatAllowanceConfig, ops: list[Any], redis_url: str
) -> None:
    asyncio.run(_compare(redis_url, allowance, ops))


async def _repeats_granted_after_a_quiet_spell(state: CapacityState) -> int:
    first = Ask(None, None, 0, False)  # an upstream that declares no capacity
    try:
        await state.reserve("a", first)
        await asyncio.sleep(3.2)  # the first attempt leaves the 2 s window
        await _early_in_a_second()  # the rest in one second
        await state.reserve("a", first)
        granted = 0
        while isinstance(await state.reserve("a", Ask(None, None, 0, True)), Reservation):
            granted += 1
            assert granted < 10
        return granted
    finally:
        await state.aclose()


def test_a_first_attempt_older_than_the_window_grants_no_repeat_on_redis(redis_url: str) -> None:
    """A first attempt at an upstream that declares no capacity is deposited in Redis
    later, with the next reservation: it was deposited as that moment's, so one made
    long before (outside the repeat allowance's window) still granted repeats through Redis
    that the memory counts, and Finagle's budget, refuse."""
    allowance = RepeatAllowanceConfig(percent=100, min_per_second=0, window_ms=2000)

    async def both() -> list[int]:
        memory = MemoryCapacity(allowance, clock=time.time)
        shared = RedisCapacity(RedisHealth(redis_url), allowance, owned=True)
        return [await _repeats_granted_after_a_quiet_spell(s) for s in (memory, shared)]

    assert asyncio.run(both()) == [1, 1]
