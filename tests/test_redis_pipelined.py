"""The Redis health state sends the script calls of one process that are ready together in
one pipeline (health/redis.py `_run`): a burst of requests holds one connection, not one
each; every call keeps its own answer; a script Redis has forgotten is loaded again."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from fallback_mw.config import BreakerConfig
from fallback_mw.health.redis import RedisHealth

BREAKER = BreakerConfig(window=4, min_calls=3, failure_rate=0.5, cooldown_ms=60_000)


@pytest.fixture
async def health(redis_url: str) -> AsyncIterator[RedisHealth]:
    state = RedisHealth(redis_url, BREAKER)
    try:
        yield state
    finally:
        await state.aclose()


def named(redis_url: str) -> tuple[str, str]:
    """The state URL with a client name of the test's own (on every pooled connection)."""
    name = f"fmw-pipe-{uuid.uuid4().hex[:8]}"
    return f"{redis_url}&client_name={name}", name


async def connections_named(name: str) -> int:
    admin = aioredis.Redis(host="127.0.0.1", port=6379)
    try:
        return sum(1 for client in await admin.client_list() if client.get("name") == name)
    finally:
        await admin.aclose()


@pytest.mark.anyio
async def test_a_burst_of_calls_shares_one_round_trip(redis_url: str) -> None:
    url, name = named(redis_url)
    health = RedisHealth(url, BREAKER)
    try:
        admitted = await asyncio.gather(*(health.admit(f"up{n % 4}") for n in range(40)))
        assert admitted == [True] * 40
        assert await connections_named(name) == 1  # one pipeline, one connection
        # Every call its own answer: three failures on one upstream open its breaker
        # (min_calls 3, failure rate 0.5) and nobody else's.
        await asyncio.gather(
            *(health.record("up0", failure=True) for _ in range(3)),
            *(health.record(f"up{n}", failure=False) for n in (1, 2, 3)),
        )
        answers = await asyncio.gather(*(health.admit(f"up{n}") for n in range(4)))
        assert answers == [False, True, True, True]
        assert health.local_fallback_calls == 0  # all of it shared, none local
    finally:
        await health.aclose()


@pytest.mark.anyio
async def test_a_script_redis_forgot_is_loaded_again(health: RedisHealth) -> None:
    assert await health.admit("up")
    admin = aioredis.Redis(host="127.0.0.1", port=6379)
    try:
        await admin.script_flush()  # as a Redis restart would
    finally:
        await admin.aclose()
    await asyncio.gather(*(health.record("up", failure=True) for _ in range(3)))
    assert not await health.admit("up")  # the breaker opened in Redis
    assert health.local_fallback_calls == 0
    assert health.available


@pytest.mark.anyio
async def test_a_cancelled_caller_leaves_the_others_answered(health: RedisHealth) -> None:
    tasks = [asyncio.ensure_future(health.admit(f"up{n}")) for n in range(5)]
    await asyncio.sleep(0)  # every call is waiting for the same pipeline
    tasks[2].cancel()
    done = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5)
    assert isinstance(done[2], asyncio.CancelledError)
    assert [done[n] for n in (0, 1, 3, 4)] == [True] * 4


@pytest.mark.anyio
async def test_closing_sends_the_calls_already_made_first(redis_url: str) -> None:
    health = RedisHealth(redis_url, BREAKER)
    calls = [asyncio.ensure_future(health.admit(f"up{n}")) for n in range(3)]
    await asyncio.sleep(0)  # made, not yet sent
    await health.aclose()
    assert await asyncio.gather(*calls) == [True, True, True]
    assert health.local_fallback_calls == 0
    assert health._client is None  # closed, not made again
