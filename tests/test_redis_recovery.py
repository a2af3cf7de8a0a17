"""Recovery from a Redis outage does not flap: the connections pooled before Redis went away
are not used after it is back (each one that failed would start a new "outage", with a new
warning and another retry interval on local breakers)."""

from __future__ import annotations

import asyncio
import logging
from typing import Literal
from urllib.parse import urlsplit

import pytest
import redis.asyncio as aioredis

from fallback_mw.config import BreakerConfig
from fallback_mw.health.redis import RedisHealth
from tests.conftest import REDIS_HOST, REDIS_PORT
from tests.helpers import own_redis, shared_again
from tests.tcp_proxy import tcp_proxy

RETRY_INTERVAL = 0.2


async def staggered_calls(health: RedisHealth, count: int) -> list[bool]:
    """`count` admissions made on successive turns of the loop: separate pipelines, in flight
    together, so they take several of the pool's connections."""
    calls = []
    for n in range(count):
        calls.append(asyncio.ensure_future(health.admit(f"u{n}")))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
    return list(await asyncio.gather(*calls))


@pytest.mark.anyio
@pytest.mark.parametrize("kill", ["abort", "close"])
async def test_recovery_after_an_outage_does_not_flap(
    redis_url: str, kill: Literal["abort", "close"], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="fallback_mw.health")
    parts = urlsplit(redis_url)
    async with tcp_proxy(REDIS_HOST, REDIS_PORT) as redis:
        health = RedisHealth(
            f"redis://127.0.0.1:{redis.port}{parts.path}?{parts.query}",
            BreakerConfig(),
            retry_interval=RETRY_INTERVAL,
        )
        try:
            for _ in range(3):  # several connections in the pool, idle
                assert await staggered_calls(health, 6) == [True] * 6
            assert health.local_fallback_calls == 0

            await redis.cut(kill)
            assert await staggered_calls(health, 4) == [True] * 4  # local breakers
            assert not health.available
            await asyncio.sleep(RETRY_INTERVAL + 0.05)
            assert await staggered_calls(health, 3) == [True] * 3  # tried again: still down
            assert not health.available
            during = health.local_fallback_calls
            assert during >= 7

            await redis.open()
            await shared_again(health)  # the background try, no call needed
            for _ in range(5):
                assert await staggered_calls(health, 6) == [True] * 6
                assert health.available
                await asyncio.sleep(0.02)
            assert health.local_fallback_calls == during  # shared again, every call
        finally:
            await health.aclose()
    messages = [r.getMessage() for r in caplog.records if r.name == "fallback_mw.health"]
    assert [m for m in messages if "unreachable" in m] == messages[:1]
    assert [m for m in messages if "reachable again" in m] == messages[1:2]
    assert len(messages) == 2


@pytest.mark.anyio
async def test_a_breaker_opened_locally_during_an_outage_is_reported_shared_after_it(
    redis_url: str,
) -> None:
    """During the outage the local breaker opens (and the gauge says so); once Redis is back
    the first admission reports the shared breaker, closed: FallbackMwBreakerOpen resolves
    (before, the gauge stayed at open while every request was admitted)."""
    reported: dict[str, str] = {}
    parts = urlsplit(redis_url)
    async with tcp_proxy(REDIS_HOST, REDIS_PORT) as redis:
        health = RedisHealth(
            f"redis://127.0.0.1:{redis.port}{parts.path}?{parts.query}",
            BreakerConfig(window=4, min_calls=3, cooldown_ms=60_000),
            retry_interval=RETRY_INTERVAL,
            on_transition=reported.__setitem__,
        )
        try:
            assert await health.admit("p")
            await health.record("p", failure=False)
            await redis.cut("abort")
            for _ in range(3):
                await health.admit("p")
                await health.record("p", failure=True)
            assert not health.available
            assert reported == {"p": "open"}  # the local breaker
            assert await health.admit("p") is False

            await redis.open()
            await shared_again(health)
            assert await health.admit("p") is True  # the shared breaker never opened
            assert reported == {"p": "closed"}
        finally:
            await health.aclose()


@pytest.mark.anyio
async def test_a_fault_cleared_while_redis_was_away_closes_the_shared_breaker_once_it_is_back(
    redis_url: str,
) -> None:
    """The platform team's game day: a `fail` fault opened the shared breaker, Redis stopped
    answering, the fault was cleared (its reset reached only the local breakers), and Redis
    came back with the fault's breaker still open in it: every process skipped the healthy
    primary for the rest of the cooldown. The reset is made again once Redis is back."""
    parts = urlsplit(redis_url)
    config = BreakerConfig(window=4, min_calls=3, cooldown_ms=60_000)
    other = RedisHealth(redis_url, config)  # another gateway process, Redis always reachable
    async with tcp_proxy(REDIS_HOST, REDIS_PORT) as redis:
        health = RedisHealth(
            f"redis://127.0.0.1:{redis.port}{parts.path}?{parts.query}",
            config,
            retry_interval=RETRY_INTERVAL,
        )
        try:
            for _ in range(3):
                assert await health.admit("p")
                await health.record("p", failure=True, fault="fail")
            assert await other.admit("p") is False  # the fault's shared breaker is open

            await redis.cut("abort")
            await health.reset_fault("p")  # the fault cleared during the outage
            assert not health.available
            assert await other.admit("p") is False  # the reset never reached Redis

            await redis.open()
            await shared_again(health)
            until = asyncio.get_running_loop().time() + 5
            while not await other.admit("p"):
                assert asyncio.get_running_loop().time() < until, "the breaker stayed open"
                await asyncio.sleep(0.05)
            assert await health.admit("p") is True
        finally:
            await health.aclose()
            await other.aclose()


@pytest.mark.anyio
async def test_an_upstream_moved_while_redis_was_away_starts_closed_once_it_is_back(
    redis_url: str,
) -> None:
    """`routes set-fallback` pointed an upstream name whose shared breaker was open at a new
    url while Redis was unreachable: the gateways forgot only their local breakers, and once
    Redis was back every process skipped the new, healthy url for the old one's cooldown
    (docs/health.md: a moved upstream starts closed). The forget is made once it is back."""
    parts = urlsplit(redis_url)
    config = BreakerConfig(window=4, min_calls=3, cooldown_ms=60_000)
    other = RedisHealth(redis_url, config)
    async with tcp_proxy(REDIS_HOST, REDIS_PORT) as redis:
        health = RedisHealth(
            f"redis://127.0.0.1:{redis.port}{parts.path}?{parts.query}",
            config,
            retry_interval=RETRY_INTERVAL,
        )
        try:
            for _ in range(3):
                assert await health.admit("p")
                await health.record("p", failure=True)
            assert await other.admit("p") is False  # the old url's breaker, open

            await redis.cut("abort")
            await health.forget("p", "http://new.example")  # the store reload, during it
            assert not health.available

            await redis.open()
            await shared_again(health)
            until = asyncio.get_running_loop().time() + 5
            while not await other.admit("p"):
                assert asyncio.get_running_loop().time() < until, "the old url's breaker stayed"
                await asyncio.sleep(0.05)
        finally:
            await health.aclose()
            await other.aclose()


@pytest.mark.anyio
async def test_a_redis_that_answers_ping_but_refuses_writes_is_one_outage_not_a_flap(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # maxmemory reached (or a read-only replica after a failover, an ACL without scripts):
    # Redis answers PING and refuses every health call. The outage's try was a PING, so
    # each one ended it ("reachable again: state is shared", which it was not) and the next
    # call began it again: two warnings a retry interval, for as long as it lasted.
    caplog.set_level(logging.WARNING, logger="fallback_mw.health")
    with own_redis("--maxmemory", "1") as server:
        port = server.args[2]
        health = RedisHealth(
            f"redis://127.0.0.1:{port}/0?prefix=w:", BreakerConfig(), retry_interval=0.02
        )
        admin = aioredis.Redis(host="127.0.0.1", port=int(port))
        try:
            for _ in range(10):  # each call writes; ten of the outage's retry intervals
                await health.record("u", failure=False)  # on local state
                await asyncio.sleep(RETRY_INTERVAL / 5)
            messages = [r.getMessage() for r in caplog.records if r.name == "fallback_mw.health"]
            assert len(messages) == 1 and "OutOfMemoryError" in messages[0], messages
            assert not health.available
            await admin.config_set("maxmemory", 0)  # writes allowed again: shared, once
            await shared_again(health)
            await health.record("u", failure=False)
            assert health.available
            messages = [r.getMessage() for r in caplog.records if r.name == "fallback_mw.health"]
            assert ["reachable again" in m for m in messages] == [False, True]
        finally:
            await health.aclose()
            await admin.aclose()
