"""The counters beside health (limits/): declared capacity over a rolling minute and the
budget for repeats, in memory with a controlled clock and shared through the real Redis."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from fallback_mw.capacity import Ask, Reservation, repeat_allowed
from fallback_mw.capacity.memory import MemoryCapacity
from fallback_mw.capacity.redis import RedisCapacity
from fallback_mw.config import RepeatAllowanceConfig
from fallback_mw.grouping import Group
from fallback_mw.health.redis import RedisHealth
from tests.conftest import REDIS_DB, REDIS_HOST, REDIS_PORT

pytestmark = pytest.mark.anyio

BUDGET = RepeatAllowanceConfig(percent=20, min_per_second=0.5, window_ms=10_000)


def shared(url: str) -> RedisCapacity:
    """A process's Redis counts (on a health state of their own, as `create_capacity`
    makes them when the gateway's health is not a RedisHealth)."""
    return RedisCapacity(RedisHealth(url), BUDGET, owned=True)


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def ask(
    *, rpm: int | None = None, tpm: int | None = None, tokens: int = 0, repeat: bool = False
) -> Ask:
    return Ask(rpm, tpm, tokens, repeat)


async def test_rpm_is_a_rolling_minute() -> None:
    clock = Clock()
    limits = MemoryCapacity(BUDGET, clock=clock)
    verdicts = [await limits.reserve("backup", ask(rpm=5)) for _ in range(7)]
    assert [isinstance(v, Reservation) for v in verdicts] == [True] * 5 + [False] * 2
    assert verdicts[5] == "capacity"
    clock.now += 59  # the five are still inside the minute
    assert await limits.reserve("backup", ask(rpm=5)) == "capacity"
    clock.now += 1  # now they are not
    assert isinstance(await limits.reserve("backup", ask(rpm=5)), Reservation)
    # Another upstream has its own count; an undeclared limit is never refused.
    others = [await limits.reserve("other", ask()) for _ in range(100)]
    assert all(isinstance(v, Reservation) for v in others)


async def test_tpm_counts_the_estimate_then_the_reported_usage() -> None:
    limits = MemoryCapacity(BUDGET, clock=Clock())
    first = await limits.reserve("backup", ask(tpm=1000, tokens=600))
    assert isinstance(first, Reservation)
    assert await limits.reserve("backup", ask(tpm=1000, tokens=600)) == "capacity"
    await limits.settle(first, 100)  # the upstream reported 100 tokens
    assert isinstance(await limits.reserve("backup", ask(tpm=1000, tokens=600)), Reservation)
    # An estimate larger than the whole limit is never admitted (the provider would not).
    assert await MemoryCapacity(BUDGET).reserve("x", ask(tpm=1000, tokens=1001)) == "capacity"


async def test_a_cancelled_admission_gives_its_slot_back() -> None:
    limits = MemoryCapacity(BUDGET, clock=Clock())
    admitted = await limits.reserve("backup", ask(rpm=1))
    assert isinstance(admitted, Reservation)
    assert await limits.reserve("backup", ask(rpm=1)) == "capacity"
    await limits.cancel(admitted)
    assert isinstance(await limits.reserve("spare", ask(rpm=1)), Reservation)


def test_the_budget_arithmetic() -> None:
    # 20 % of 100 first attempts plus 0.5/s over 10 s: 25 repeats.
    assert repeat_allowed(100, 24, BUDGET)
    assert not repeat_allowed(100, 25, BUDGET)
    assert repeat_allowed(0, 4, BUDGET) and not repeat_allowed(0, 5, BUDGET)  # the floor
    off = RepeatAllowanceConfig(percent=0, min_per_second=0)
    assert not repeat_allowed(1000, 0, off)


async def test_repeats_stay_within_the_budget_and_recover_with_the_window() -> None:
    clock = Clock()
    limits = MemoryCapacity(BUDGET, clock=clock)
    for _ in range(50):
        assert isinstance(await limits.reserve("primary", ask()), Reservation)
    granted = 0
    while isinstance(await limits.reserve("primary", ask(repeat=True)), Reservation):
        granted += 1
        assert granted < 1000
    assert granted == 15  # 50 * 20 % + 0.5 * 10
    # Moving to a different upstream is never limited by it.
    assert isinstance(await limits.reserve("backup", ask()), Reservation)
    clock.now += 10  # the window slid past all of it
    assert isinstance(await limits.reserve("primary", ask(repeat=True)), Reservation)


async def test_a_window_of_part_seconds_grants_the_same_repeats_in_memory_and_redis(
    redis_url: str,
) -> None:
    """The windows count whole seconds (memory and the Redis script alike): the floor is
    `min_per_second` over those seconds in both, not over 1.5 s in one and 1 s in the
    other (memory granted half as many again as every process sharing Redis)."""
    odd = RepeatAllowanceConfig(percent=0, min_per_second=2, window_ms=1500)
    memory = MemoryCapacity(odd, clock=Clock())
    redis = RedisCapacity(RedisHealth(redis_url), odd, owned=True)
    try:
        granted = []
        for limits in (memory, redis):
            count = 0
            while isinstance(await limits.reserve("odd", ask(repeat=True)), Reservation):
                count += 1
                assert count < 100
            granted.append(count)
        assert granted == [2, 2]
    finally:
        await redis.aclose()


async def test_two_processes_share_the_count_through_redis(redis_url: str) -> None:
    one, two = shared(redis_url), shared(redis_url)
    try:
        verdicts = await asyncio.gather(
            *(limits.reserve("backup", ask(rpm=5)) for limits in (one, two) for _ in range(6))
        )
        assert sum(isinstance(v, Reservation) for v in verdicts) == 5
        assert verdicts.count("capacity") == 7
        # tokens: one counts, the other sees it; a settlement corrects it for both
        first = await one.reserve("tok", ask(tpm=1000, tokens=700))
        assert isinstance(first, Reservation)
        assert await two.reserve("tok", ask(tpm=1000, tokens=700)) == "capacity"
        await one.settle(first, 200)
        assert isinstance(await two.reserve("tok", ask(tpm=1000, tokens=700)), Reservation)
        # the repeat budget: the floor (5) shared by both
        repeats = await asyncio.gather(
            *(
                limits.reserve("primary", ask(repeat=True))
                for limits in (one, two)
                for _ in range(5)
            )
        )
        assert sum(isinstance(v, Reservation) for v in repeats) == 5
        assert repeats.count("repeat_budget") == 5
    finally:
        await one.aclose()
        await two.aclose()


async def test_redis_keys_expire(redis_url: str) -> None:
    import redis.asyncio as aioredis

    limits = shared(redis_url)
    client = aioredis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=REDIS_DB)  # the URL's own
    try:
        assert isinstance(await limits.reserve("backup", ask(rpm=5)), Reservation)
        keys = [k async for k in client.scan_iter(match=limits.prefix + "*")]
        assert keys
        for key in keys:
            ttl = await client.pttl(key)
            assert 0 < ttl <= 65_000
    finally:
        await limits.aclose()
        await client.aclose()


async def test_redis_unreachable_counts_locally() -> None:
    limits = shared("redis://127.0.0.1:1/0")  # nothing listens there
    try:
        verdicts = [await limits.reserve("backup", ask(rpm=2)) for _ in range(3)]
        assert [isinstance(v, Reservation) for v in verdicts] == [True, True, False]
    finally:
        await limits.aclose()


async def test_redis_unreachable_settles_and_cancels_in_the_local_count() -> None:
    """While Redis is out the process counts alone, and the reported usage corrects that
    count (not a Redis field it was never counted in): an estimate of 5 tokens that turned
    out 900 leaves 100 of tpm = 1000, and a cancelled attempt gives its request back."""
    limits = shared("redis://127.0.0.1:1/0")  # nothing listens there
    try:
        first = await limits.reserve("backup", ask(tpm=1000, tokens=5))
        assert isinstance(first, Reservation)
        await limits.settle(first, 900)
        assert await limits.reserve("backup", ask(tpm=1000, tokens=200)) == "capacity"
        one = await limits.reserve("spare", ask(rpm=1))
        assert isinstance(one, Reservation)
        await limits.cancel(one)
        assert isinstance(await limits.reserve("spare", ask(rpm=1)), Reservation)
    finally:
        await limits.aclose()


async def test_first_attempts_reach_redis_without_a_round_trip_each(redis_url: str) -> None:
    one, two = shared(redis_url), shared(redis_url)
    calls = 0
    run_script = one.redis.run_script

    async def counting(*args: object, **kwargs: object) -> object:
        nonlocal calls
        calls += 1
        return await run_script(*args, **kwargs)  # type: ignore[arg-type]

    one.redis.run_script = counting  # type: ignore[method-assign]
    try:
        for _ in range(50):
            assert isinstance(await one.reserve("primary", ask()), Reservation)
        assert calls <= 1  # counted locally (a flush at most once a second)
        # The first repeat deposits them with its own check, in one step.
        assert isinstance(await one.reserve("primary", ask(repeat=True)), Reservation)
        granted = 1
        while isinstance(await two.reserve("primary", ask(repeat=True)), Reservation):
            granted += 1
            assert granted < 100
        assert granted == 15  # 50 x 20 % + 0.5/s x 10 s, seen by the other process
    finally:
        await one.aclose()
        await two.aclose()


async def test_free_in_is_when_the_oldest_seconds_leave_the_minute() -> None:
    """The Retry-After of a 503 whose candidates were full: when enough of the minute's
    oldest seconds have left it for one more request to fit."""
    clock = Clock()
    limits = MemoryCapacity(BUDGET, clock=clock)
    assert await limits.free_in("backup", ask(rpm=3)) == 0  # nothing counted: room now
    for step in (0, 10, 20):  # one request at t, t+10, t+20
        clock.now += step and 10
        assert isinstance(
            await limits.reserve("backup", ask(rpm=3, tpm=100, tokens=30)), Reservation
        )
    clock.now += 5  # t+25: full; the oldest leaves at t+60
    assert await limits.reserve("backup", ask(rpm=3)) == "capacity"
    assert await limits.free_in("backup", ask(rpm=3)) == 35
    # 70 of 100 tokens wanted: the first two seconds must leave (t+70)
    assert await limits.free_in("backup", ask(tpm=100, tokens=70)) == 45
    assert await limits.free_in("backup", ask(tpm=100, tokens=101)) is None  # never fits
    clock.now += 35
    assert isinstance(await limits.reserve("backup", ask(rpm=3)), Reservation)


async def test_free_in_reads_the_shared_count_through_redis(redis_url: str) -> None:
    one, two = shared(redis_url), shared(redis_url)
    try:
        for _ in range(2):
            assert isinstance(await one.reserve("backup", ask(rpm=2)), Reservation)
        assert await two.reserve("backup", ask(rpm=2)) == "capacity"
        wait = await two.free_in("backup", ask(rpm=2))  # the other process's two requests
        assert wait is not None and 58 <= wait <= 60
        assert await two.free_in("backup", ask(rpm=3)) == 0
        assert await two.free_in("idle", ask(rpm=1)) == 0
        assert await two.free_in("backup", ask(tpm=10, tokens=11)) is None
    finally:
        await one.aclose()
        await two.aclose()


async def test_release_capacity_takes_back_the_count_but_not_the_repeat(redis_url: str) -> None:
    """An attempt a fault answered: its rpm / tpm count is taken back (in memory and in
    the shared Redis count), its place in the repeat allowance is kept."""
    for limits in (MemoryCapacity(BUDGET, clock=Clock()), shared(redis_url)):
        try:
            first = await limits.reserve("backup", ask(rpm=1, tpm=100, tokens=60))
            assert isinstance(first, Reservation)
            assert await limits.reserve("backup", ask(rpm=1)) == "capacity"
            await limits.release_capacity(first)
            again = await limits.reserve("backup", ask(rpm=1, tpm=100, tokens=100))
            assert isinstance(again, Reservation)  # a request slot and all 100 tokens free
            # The floor of the repeat allowance (0.5 x 10 s = 5) is not given back.
            repeats = [await limits.reserve("p", ask(repeat=True)) for _ in range(5)]
            await limits.release_capacity(repeats[0])  # type: ignore[arg-type]
            assert await limits.reserve("p", ask(repeat=True)) == "repeat_budget"
        finally:
            await limits.aclose()


async def test_a_count_whose_caller_left_as_its_answer_came_is_taken_back(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis answered the reservation and, on that same turn of the loop, its caller was
    cancelled (a client gone, the host's stop) before it read the answer: the count stood
    for nobody, the upstream's `rpm` short by one for a minute (a caller cancelled before
    the answer came was already taken back). Either way the count is taken back."""
    limits = shared(redis_url)
    waiter: list[asyncio.Task[object]] = []
    join = Group.join

    def join_then_cancel_on_answer(self: Group[Any], item: Any) -> asyncio.Future[Any]:
        future = join(self, item)
        if waiter and item.name == "capacity_admit":
            caller = waiter[0]  # cancelled ahead of its own wake-up: before it reads
            future.add_done_callback(lambda _: caller.cancel())
        return future

    monkeypatch.setattr(Group, "join", join_then_cancel_on_answer)
    try:
        waiter.append(asyncio.ensure_future(limits.reserve("backup", ask(rpm=1))))
        with pytest.raises(asyncio.CancelledError):
            await waiter[0]
        waiter.clear()
        for _ in range(100):  # the take-back runs in the background
            again = await limits.reserve("backup", ask(rpm=1))
            if isinstance(again, Reservation):
                break
            await asyncio.sleep(0.02)
        assert isinstance(again, Reservation)
    finally:
        await limits.aclose()
