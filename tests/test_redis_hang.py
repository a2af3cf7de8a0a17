"""A Redis that hangs (its process stopped: connections are accepted, nothing answers) or
that refuses the gateway (a wrong password, a database number it does not have), each on
a real redis-server of the test's own. The health state serves on local memory: a request
waits for a hung Redis once, when the hang begins, and never again while it lasts; the
warning says why in Redis's words, never with the password."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from pathlib import Path

import anyio
import httpx
import pytest
import redis.asyncio as aioredis

from fallback_mw.capacity.model import Ask, Reservation
from fallback_mw.capacity.redis import RedisCapacity
from fallback_mw.config import BreakerConfig, RepeatAllowanceConfig
from fallback_mw.health.redis import RedisHealth
from tests.helpers import (
    free_port,
    log_text,
    own_redis,
    serve_process,
    shared_again,
    wait_listening,
)

pytestmark = pytest.mark.anyio

SOCKET_TIMEOUT = 0.3
RETRY_INTERVAL = 0.2


async def timed_admit(health: RedisHealth, upstream: str = "u") -> float:
    started = time.monotonic()
    assert await health.admit(upstream) is True
    return time.monotonic() - started


async def test_a_hung_redis_delays_requests_once_not_every_retry(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="fallback_mw.health")
    with own_redis() as redis:
        health = RedisHealth(
            f"redis://127.0.0.1:{redis.args[2]}/0",
            socket_timeout=SOCKET_TIMEOUT,
            retry_interval=RETRY_INTERVAL,
        )
        try:
            await timed_admit(health)
            assert health.available
            redis.send_signal(signal.SIGSTOP)
            first = await timed_admit(health)  # the call that meets the hang waits for it
            assert first >= SOCKET_TIMEOUT * 0.9
            assert not health.available
            # Several retry intervals of the hang: every call is served at once, on local
            # state; the tries are the background's (before: each call made after a retry
            # interval waited SOCKET_TIMEOUT again, a third of the time).
            waits = []
            until = time.monotonic() + 6 * RETRY_INTERVAL + 2 * SOCKET_TIMEOUT
            while time.monotonic() < until:
                waits.append(await timed_admit(health))
                await asyncio.sleep(0.01)
            assert len(waits) > 20
            assert max(waits) < SOCKET_TIMEOUT / 2, sorted(waits)[-5:]
            assert not health.available

            redis.send_signal(signal.SIGCONT)
            for _ in range(200):  # a call after the retry interval starts the next try
                await timed_admit(health)
                if health.available:
                    break
                await asyncio.sleep(0.05)
            assert health.available
            fallbacks = health.local_fallback_calls
            assert await timed_admit(health) < SOCKET_TIMEOUT
            assert health.local_fallback_calls == fallbacks  # shared again
        finally:
            await health.aclose()
    messages = [r.getMessage() for r in caplog.records if r.name == "fallback_mw.health"]
    assert len([m for m in messages if "unreachable" in m]) == 1
    assert "Timeout" in messages[0]
    assert len([m for m in messages if "reachable again" in m]) == 1


@pytest.mark.parametrize(
    ("credentials", "database", "reason"),
    [
        (":wrong-PW-9917@", 0, "invalid username-password pair"),
        ("someone:wrong-PW-9917@", 0, "invalid username-password pair"),
        ("", 0, "AuthenticationError"),
        (":right-PW-4471@", 99, "DB index is out of range"),
    ],
)
async def test_a_refusing_redis_is_named_in_the_warning_without_the_password(
    credentials: str, database: int, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="fallback_mw.health")
    with own_redis("--requirepass", "right-PW-4471") as redis:
        health = RedisHealth(
            f"redis://{credentials}127.0.0.1:{redis.args[2]}/{database}",
            retry_interval=RETRY_INTERVAL,
        )
        try:
            assert await health.admit("u") is True  # served on local state
            assert not health.available
        finally:
            await health.aclose()
    (message,) = [r.getMessage() for r in caplog.records if r.name == "fallback_mw.health"]
    assert "unreachable" in message
    assert reason in message
    assert "PW" not in message


@pytest.mark.parametrize("workers", ["1", "2"])
async def test_serve_says_at_startup_that_it_cannot_use_the_redis_state(
    workers: str, tmp_path: Path
) -> None:
    """An operator starting `serve` on a Redis that refuses the password learns it from the
    startup log, before any traffic (each worker once), and the gateway serves."""
    with own_redis("--requirepass", "right-PW-4471") as redis:
        config = tmp_path / "gateway.toml"
        config.write_text(
            f'[gateway]\nstate = "redis://:wrong-PW-9917@127.0.0.1:{redis.args[2]}/0"\n\n'
            '[upstreams.a]\nurl = "http://127.0.0.1:9"\n\n'
            '[[routes]]\nid = "r"\nprefix = "/v1/"\nplan = ["a"]\n'
        )
        port, log = free_port(), tmp_path / "serve.log"
        with serve_process(config, port, log, options=["--workers", workers]) as process:
            await wait_listening(process, port, log)
            until = time.monotonic() + 20
            while log_text(log).count("unreachable") < int(workers):
                assert time.monotonic() < until, log_text(log)
                await anyio.sleep(0.1)
            async with httpx.AsyncClient() as client:  # and it serves
                response = await client.get(f"http://127.0.0.1:{port}/v1/x")
            assert response.headers["x-gateway-route"] == "r"
    text = log_text(log)
    assert text.count("invalid username-password pair") == int(workers), text
    assert "PW" not in text
    assert "Traceback" not in text


async def test_a_probe_admitted_by_a_hung_redis_after_the_caller_gave_up_is_given_back() -> None:
    """The admission that met the hang timed out here but ran in Redis once it resumed: on a
    half-open breaker it took the probe slot for nobody, and the recovered upstream was
    skipped for the whole probe lease (30 s or more) after Redis was back."""
    breaker = BreakerConfig(window=2, min_calls=2, cooldown_ms=200)
    with own_redis() as redis:
        url = f"redis://127.0.0.1:{redis.args[2]}/0"
        health = RedisHealth(
            url, breaker, socket_timeout=SOCKET_TIMEOUT, retry_interval=RETRY_INTERVAL
        )
        inspect = aioredis.Redis.from_url(url, decode_responses=True)
        try:
            for _ in range(2):
                assert await health.admit("p")
                await health.record("p", failure=True)
            assert await health.admit("p") is False  # open
            await asyncio.sleep(0.25)  # its cooldown is over: the next admission probes
            redis.send_signal(signal.SIGSTOP)
            assert await health.admit("p") is True  # timed out here: the local breaker's
            assert not health.available
            await health.release("p")  # the attempt it admitted ended (local state)
            redis.send_signal(signal.SIGCONT)
            await shared_again(health)
            for _ in range(100):  # the ghost's slot given back once Redis is back
                if await inspect.hget("fallback_mw:breaker:p", "probe") == "0":
                    break
                await asyncio.sleep(0.02)
            assert await health.admit("p") is True  # the probe, not the lease's skip
        finally:
            await inspect.aclose()
            await health.aclose()


def test_the_warning_reason_never_holds_the_password_however_spelled() -> None:
    """Planted leak: should an error ever quote the password, as written in the URL or as
    sent (percent-decoded), the warning's reason shows neither."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    health = RedisHealth("redis://:p%40ss-PW-5120@127.0.0.1:6390/0")
    for quoted in ("p%40ss-PW-5120", "p@ss-PW-5120"):
        reason = health._reason(RedisConnectionError(f"refused for {quoted} at 127.0.0.1"))
        assert "PW-5120" not in reason
        assert reason.startswith("ConnectionError: refused for *** at 127.0.0.1")


async def test_a_probe_admission_whose_caller_left_during_a_hang_is_given_back() -> None:
    """The request left (its client went away, the deadline passed) while its admission of
    a half-open breaker waited on a hung Redis. The call timed out for nobody: no outage was
    begun and nothing was noted to give back, and once Redis resumed and ran it, the probe
    slot was held for nobody: the recovered upstream was skipped for the whole probe lease
    (30 s or more)."""
    breaker = BreakerConfig(window=2, min_calls=2, cooldown_ms=200)
    with own_redis() as redis:
        url = f"redis://127.0.0.1:{redis.args[2]}/0"
        health = RedisHealth(
            url, breaker, socket_timeout=SOCKET_TIMEOUT, retry_interval=RETRY_INTERVAL
        )
        inspect = aioredis.Redis.from_url(url, decode_responses=True)
        key = "fallback_mw:breaker:p"
        try:
            for _ in range(2):
                assert await health.admit("p")
                await health.record("p", failure=True)
            assert await health.admit("p") is False  # open
            await asyncio.sleep(0.25)  # its cooldown is over: the next admission probes
            redis.send_signal(signal.SIGSTOP)
            caller = asyncio.ensure_future(health.admit("p"))
            await asyncio.sleep(0.1)  # sent; nothing answers
            caller.cancel()
            with pytest.raises(asyncio.CancelledError):
                await caller
            await asyncio.sleep(SOCKET_TIMEOUT * 2)  # its call timed out, for nobody
            redis.send_signal(signal.SIGCONT)  # Redis runs it: the slot is taken
            until = time.monotonic() + 10
            while not await inspect.hget(key, "owner"):
                assert time.monotonic() < until, "the admission never ran"
                await asyncio.sleep(0.02)
            while await inspect.hget(key, "probe") != "0":
                assert time.monotonic() < until, "the probe slot was not given back"
                await asyncio.sleep(0.02)
            await shared_again(health)
            assert await health.admit("p") is True  # the probe, not the lease's skip
        finally:
            await inspect.aclose()
            await health.aclose()


async def test_a_capacity_count_whose_caller_left_while_redis_hung_is_given_back() -> None:
    """The request left while its capacity count waited on a Redis that hung for less than
    the socket timeout: the script ran and counted the attempt, its answer came to nobody,
    and the count was never taken back: the upstream's `rpm` had one attempt less for a
    minute (with a small `rpm`, every request skipped it with reason `capacity`)."""
    with own_redis() as redis:
        url = f"redis://127.0.0.1:{redis.args[2]}/0"
        health = RedisHealth(url, socket_timeout=3.0, retry_interval=RETRY_INTERVAL)
        capacity = RedisCapacity(health, RepeatAllowanceConfig())
        ask = Ask(rpm=1, tpm=None, tokens=0, repeat=False)
        try:
            warm = await capacity.reserve("u", ask)  # the script is loaded
            assert isinstance(warm, Reservation)
            await capacity.cancel(warm)
            redis.send_signal(signal.SIGSTOP)
            caller = asyncio.ensure_future(capacity.reserve("u", ask))
            await asyncio.sleep(0.2)  # sent; nothing answers
            caller.cancel()
            with pytest.raises(asyncio.CancelledError):
                await caller
            redis.send_signal(signal.SIGCONT)  # it runs and counts; its answer is late
            until = time.monotonic() + 10
            await asyncio.sleep(0.2)
            while await capacity.free_in("u", ask) != 0.0:
                assert time.monotonic() < until, "the count was not given back"
                await asyncio.sleep(0.05)
            assert health.available
            assert isinstance(await capacity.reserve("u", ask), Reservation)
        finally:
            await health.aclose()
