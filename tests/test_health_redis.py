"""Health shared through the real Redis: two gateways (separate clients, as two processes
would have) agree about breakers and credentials; Redis down means local state."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from typing import Any

import pytest
import redis.asyncio as aioredis
from aiohttp import web
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from fallback_mw import Gateway
from fallback_mw.config import BreakerConfig, ConfigError, load_config
from fallback_mw.health import Admission
from fallback_mw.health.redis import RedisHealth
from fallback_mw.store_url import split_state_url
from fallback_mw.telemetry import Telemetry
from tests.conftest import REDIS_HOST, REDIS_PORT
from tests.helpers import gateway_client, shared_again
from tests.tcp_proxy import tcp_proxy
from tests.upstreams import Upstream, host_app, status_handler, upstream

COOLDOWN_MS = 150
BREAKER = {"window": 4, "min_calls": 3, "failure_rate": 0.5, "cooldown_ms": COOLDOWN_MS,
           "max_cooldown_ms": 1000}  # fmt: skip
POOL_ENV = {"KEY_A": "key-a", "KEY_B": "key-b"}
SHARED_COOLDOWN_MS = 1000


def config(state: str, primary: Upstream, backup: Upstream, **primary_extra: Any) -> dict[str, Any]:
    return {
        "gateway": {"state": state, "breaker": BREAKER},
        "upstreams": {
            "primary": {"url": primary.url, **primary_extra},
            "backup": {"url": backup.url},
        },
        "routes": [
            {
                "id": "r",
                "prefix": "/v1/",
                "plan": ["primary", "backup"],
                "retries": 2,
                "backoff_ms": 0,
            }
        ],
    }


def test_state_url_prefix() -> None:
    assert split_state_url("redis://h:1/2?prefix=a:b:&db=3") == ("redis://h:1/2?db=3", "a:b:")
    assert split_state_url("redis://h:1/0") == ("redis://h:1/0", "fallback_mw:")


@pytest.mark.anyio
async def test_two_gateways_share_a_breaker(redis_url: str) -> None:
    answer = {"status": 503}

    async def primary_handler(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(0.03)
        return web.Response(status=answer["status"], body=b"primary")

    async with (
        upstream(primary_handler) as primary,
        upstream(status_handler(200, b"backup")) as backup,
    ):
        conf = config(redis_url, primary, backup)
        # A cooldown the six requests below fit in on a loaded machine: with 150 ms, under
        # load (20 on two cores) the second gateway's third request came after it, probed
        # the primary and was answered after 2 attempts.
        conf["gateway"]["breaker"] = {**BREAKER, "cooldown_ms": SHARED_COOLDOWN_MS,
                                      "max_cooldown_ms": 4 * SHARED_COOLDOWN_MS}  # fmt: skip
        async with gateway_client(conf) as one, gateway_client(conf) as two:
            for _ in range(3):
                assert (await one.get("/v1/x")).text == "backup"
            assert primary.count == 3
            # The second gateway skips the primary at once: no attempt, no contact.
            for _ in range(3):
                response = await two.get("/v1/x")
                assert response.text == "backup"
                assert response.headers["x-gateway-attempts"] == "1"
            assert primary.count == 3

            # After the cooldown: one probe across both gateways.
            await asyncio.sleep(SHARED_COOLDOWN_MS / 1000 + 0.02)
            responses = await asyncio.gather(
                *(client.get("/v1/x") for client in (one, two) for _ in range(4))
            )
            assert all(r.text == "backup" for r in responses)
            assert primary.count == 4

            prefix = split_state_url(redis_url)[1]
            inspect = aioredis.Redis.from_url(split_state_url(redis_url)[0], decode_responses=True)

            async def redis_ms() -> int:
                # The breaker's own clock: its scripts read Redis's TIME.
                seconds, micros = await inspect.time()
                return int(seconds) * 1000 + int(micros) // 1000

            async def sleep_until(ms: int) -> None:
                await asyncio.sleep(max(ms - await redis_ms(), 0) / 1000)

            try:
                state = await inspect.hgetall(f"{prefix}breaker:primary")
                assert state["st"] == "open"
                assert state["cd"] == str(2 * SHARED_COOLDOWN_MS)  # the failed probe doubled it
                assert await inspect.pttl(f"{prefix}breaker:primary") > 0  # keys expire

                # Past the first cooldown's length, measured from the breaker's reported
                # opening, and (as measured after the request) still inside the doubled
                # one: the primary is still skipped. On a machine too loaded to land in
                # that window the check says nothing rather than fail.
                until = int(state["until"])
                opened = until - int(state["cd"])
                await sleep_until(opened + SHARED_COOLDOWN_MS + 20)
                response = await two.get("/v1/x")
                if await redis_ms() < until:
                    assert response.text == "backup"
                    assert primary.count == 4

                # A success once the reported cooldown is over closes it for both gateways.
                answer["status"] = 200
                state = await inspect.hgetall(f"{prefix}breaker:primary")
                if state["st"] == "open":
                    await sleep_until(int(state["until"]) + 20)
                count = primary.count
                assert (await two.get("/v1/x")).text == "primary"
                assert primary.count == count + 1
                assert (await one.get("/v1/x")).text == "primary"
                assert primary.count == count + 2
            finally:
                await inspect.aclose()


@pytest.mark.anyio
async def test_a_slow_probe_keeps_its_slot_for_its_upstreams_timeouts(redis_url: str) -> None:
    """One probe at a time (SPEC §6) for as long as the probe can take: the lease comes
    from the upstream's timeouts (3 s connect + 2 s first byte + 5 s), not from the state's
    floor (here lowered to 0.1 s)."""
    answer = {"status": 503}
    arrived, go = asyncio.Event(), asyncio.Event()

    async def primary_handler(request: web.Request) -> web.StreamResponse:
        if answer["status"] == 200 and not arrived.is_set():  # the probe, held until `go`
            arrived.set()
            await go.wait()
        return web.Response(status=answer["status"], body=b"primary")

    async with (
        upstream(primary_handler) as primary,
        upstream(status_handler(200, b"backup")) as backup,
    ):
        conf = config(redis_url, primary, backup, first_byte_timeout_ms=2000)
        health = RedisHealth(redis_url, BreakerConfig(**BREAKER), probe_lease=0.1)
        url, prefix = split_state_url(redis_url)
        inspect = aioredis.Redis.from_url(url, decode_responses=True)
        try:
            async with gateway_client(conf, health=health) as client:
                for _ in range(3):
                    assert (await client.get("/v1/x")).text == "backup"
                assert primary.count == 3
                await asyncio.sleep(COOLDOWN_MS / 1000 + 0.02)
                answer["status"] = 200
                probe = asyncio.ensure_future(client.get("/v1/x"))
                key = f"{prefix}breaker:primary"
                try:
                    await asyncio.wait_for(arrived.wait(), 5)
                    assert primary.count == 4

                    await asyncio.sleep(0.3)  # past the floor, the probe still in flight
                    response = await client.get("/v1/x")
                    assert response.text == "backup"
                    assert response.headers["x-gateway-attempts"] == "1"
                    assert primary.count == 4
                    seconds, micros = await inspect.time()
                    now_ms = int(seconds) * 1000 + int(micros) // 1000
                    held_ms = int(await inspect.hget(key, "probe") or 0) - now_ms
                    assert 9_000 < held_ms <= 10_000
                    assert await inspect.pttl(key) > held_ms  # the key outlives the lease
                finally:
                    go.set()  # never leave a handler waiting, nor the probe in flight
                    (result,) = await asyncio.gather(probe, return_exceptions=True)
                assert not isinstance(result, BaseException)
                assert result.text == "primary"
                assert await inspect.hget(key, "st") == "closed"
        finally:
            await inspect.aclose()


@pytest.mark.anyio
async def test_a_probe_lease_longer_than_the_key_ttl_keeps_the_key(redis_url: str) -> None:
    health = RedisHealth(redis_url, BreakerConfig(**BREAKER))
    url, prefix = split_state_url(redis_url)
    inspect = aioredis.Redis.from_url(url, decode_responses=True)
    try:
        for _ in range(3):
            await health.record("u", failure=True)
        assert health.breaker_ttl_ms == 600_000
        await asyncio.sleep(COOLDOWN_MS / 1000 + 0.02)
        assert await health.admit("u", lease=605.0)  # the longest deadline's attempt
        assert not await health.admit("u")
        assert await inspect.pttl(f"{prefix}breaker:u") > 605_000
    finally:
        await health.aclose()
        await inspect.aclose()


@pytest.mark.anyio
async def test_a_fresh_session_id_on_every_request_keeps_redis_bounded(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A caller choosing a new session id per request made one affinity key each in Redis,
    # kept an hour: 1,000 requests a second held millions of keys until maxmemory refused
    # writes, and every process fell back to per-process breakers. Memory keeps the newest
    # AFFINITY_LIMIT sessions; Redis now keeps at most twice that.
    monkeypatch.setattr("fallback_mw.health.redis_pools.AFFINITY_LIMIT", 20)
    health = RedisHealth(redis_url, BreakerConfig(**BREAKER))
    url, prefix = split_state_url(redis_url)
    inspect = aioredis.Redis.from_url(url, decode_responses=True)
    try:
        bound = {}
        for n in range(200):
            session = f"r\x1fm\x1fs{n}"
            bound[n] = await health.pick_credential("u", 3, exclude=frozenset(), session=session)
        remembered = 0
        async for key in inspect.scan_iter(match=f"{prefix}affinity:*"):
            kind = await inspect.type(key)
            remembered += await inspect.hlen(key) if kind == "hash" else 1
        assert remembered <= 40
        for n in range(190, 200):  # the newest sessions still keep their credentials
            again = await health.pick_credential(
                "u", 3, exclude=frozenset(), session=f"r\x1fm\x1fs{n}"
            )
            assert again == bound[n]
    finally:
        await health.aclose()
        await inspect.aclose()


@pytest.mark.anyio
async def test_two_gateways_share_credential_health(redis_url: str) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        key = request.headers.get("authorization", "")
        return web.Response(status=401 if key == "Bearer key-a" else 200, body=key.encode())

    async with upstream(handler) as primary, upstream(status_handler(200)) as backup:
        conf = config(redis_url, primary, backup, auth_env=["KEY_A", "KEY_B"])
        async with (
            gateway_client(conf, environ=POOL_ENV) as one,
            gateway_client(conf, environ=POOL_ENV) as two,
        ):
            for client in (one, two, one, two, two, one):
                response = await client.get("/v1/x")
                assert response.status_code == 200
                assert response.text == "Bearer key-b"
        keys = [dict(r.headers)["authorization"] for r in primary.received]
        assert keys.count("Bearer key-a") == 1


@pytest.mark.anyio
async def test_unreachable_redis_serves_on_local_state_and_warns_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    state = "redis://:hunter2secret@127.0.0.1:1/0?prefix=x:"
    caplog.set_level(logging.WARNING, logger="fallback_mw.health")
    async with upstream(status_handler(503)) as primary, upstream(status_handler(200)) as backup:
        conf = config(state, primary, backup)
        async with gateway_client(conf) as client:
            for _ in range(6):
                response = await client.get("/v1/x")
                assert response.status_code == 200
        assert primary.count == 3  # the local breaker still opened after min_calls
    warnings = [r for r in caplog.records if r.name == "fallback_mw.health"]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert "unreachable" in message
    assert "hunter2secret" not in message


@pytest.mark.anyio
async def test_redis_outage_falls_back_and_recovers(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="fallback_mw.health")
    prefix = split_state_url(redis_url)[1]
    async with tcp_proxy(REDIS_HOST, REDIS_PORT) as redis:
        health = RedisHealth(
            f"redis://127.0.0.1:{redis.port}/0?prefix={prefix}",
            BreakerConfig(**BREAKER),
            retry_interval=0.05,
        )
        try:
            assert await health.admit("u") is True
            await redis.cut("close")
            for _ in range(3):
                await health.record("u", failure=True)
            assert not health.available
            assert await health.admit("u") is False  # the local breaker opened
            await redis.open()
            await shared_again(health)
            assert await health.admit("u") is True  # Redis again: its breaker is closed
            assert health.available
        finally:
            await health.aclose()
    messages = [r.getMessage() for r in caplog.records if r.name == "fallback_mw.health"]
    assert len(messages) == 2
    assert "unreachable" in messages[0]
    assert "reachable again" in messages[1]


@pytest.mark.anyio
async def test_an_attempt_at_the_new_url_counts_after_an_outage_ends(redis_url: str) -> None:
    """A reload moved an upstream to another url during a Redis outage (`forget`, made
    again once Redis is back), and an attempt was admitted after the move, judging the new
    url. Its outcome ending after Redis came back went to no breaker: the catch-up of the
    forget marked the url as moved once more, and the attempt read as one of the old url
    (the memory state counts it). It counts: here, its failure opens the breaker."""
    prefix = split_state_url(redis_url)[1]
    config = BreakerConfig(window=1, min_calls=1, failure_rate=1.0, cooldown_ms=60_000)
    async with tcp_proxy(REDIS_HOST, REDIS_PORT) as redis:
        health = RedisHealth(
            f"redis://127.0.0.1:{redis.port}/0?prefix={prefix}", config, retry_interval=0.05
        )
        try:
            assert await health.admit("u") is True
            await redis.cut("close")
            await health.forget("u", "http://127.0.0.1:9/new")  # kept for Redis's return
            admission = Admission()
            assert await health.admit("u", admission=admission)  # after the move
            await redis.open()
            await shared_again(health)
            for _ in range(250):  # the forget made again on Redis (its background catch-up)
                if not health._forgets:
                    break
                await asyncio.sleep(0.02)
            assert not health._forgets
            await health.record("u", failure=True, admission=admission)
            assert await health.admit("u") is False
        finally:
            await health.aclose()


def breaker_points(reader: InMemoryMetricReader, name: str) -> dict[tuple[str, ...], float]:
    """`gateway.breaker.*` points on one process's reader, keyed by their attribute values."""
    found: dict[tuple[str, ...], float] = {}
    data = reader.get_metrics_data()
    for resource in data.resource_metrics if data is not None else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name == name:
                    for point in metric.data.data_points:
                        key = tuple(str(v) for _, v in sorted((point.attributes or {}).items()))
                        found[key] = point.value  # type: ignore[union-attr]
    return found


@pytest.mark.anyio
async def test_a_shared_breaker_transition_is_counted_once_across_processes(
    redis_url: str,
) -> None:
    # A platform team sums gateway_breaker_transitions_total over every worker of `serve
    # --workers N` ("how often did the primary's breaker open today?"). The breaker opened
    # once, through one gateway; the other one learnt it at its next admission and counted
    # a transition of its own too (one "breaker ... opened" log line, two opens summed, N
    # with N workers). The other gateway's gauge still follows the shared state.
    async with (
        upstream(status_handler(503)) as primary,
        upstream(status_handler(200, b"backup")) as backup,
    ):
        conf = config(redis_url, primary, backup)
        readers = [InMemoryMetricReader(), InMemoryMetricReader()]
        providers = [MeterProvider(metric_readers=[r], shutdown_on_exit=False) for r in readers]
        one_telemetry, two_telemetry = (Telemetry(meter_provider=p) for p in providers)
        try:
            async with (
                gateway_client(conf, telemetry=one_telemetry) as one,
                gateway_client(conf, telemetry=two_telemetry) as two,
            ):
                for _ in range(3):  # min_calls 3: the third failure opens it, through one
                    assert (await one.get("/v1/x")).text == "backup"
                response = await two.get("/v1/x")  # two skips it: it learns it is open
                assert response.headers["x-gateway-attempts"] == "1"
                assert primary.count == 3
            gauges = [breaker_points(r, "gateway.breaker.state") for r in readers]
            assert [g[("primary",)] for g in gauges] == [2, 2]  # both say open
            opened = [
                breaker_points(r, "gateway.breaker.transitions").get(("open", "primary"), 0)
                for r in readers
            ]
            assert sum(opened) == 1, opened  # one transition, counted once
        finally:
            for provider in providers:
                provider.shutdown()


@pytest.mark.anyio
async def test_the_local_fallback_counter_is_exported_at_zero_before_any_outage(
    redis_url: str,
) -> None:
    # FallbackMwSharedStateUnreachable is `increase(gateway_health_local_fallbacks_total[2m])
    # > 0`. The series appeared only with the first outage, already at its count: a scrape
    # saw it once at N, then N again, an increase of 0, so an outage over before the next
    # scrape (a Redis restart, a failover) never fired the alert. From 0, it does.
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    health = RedisHealth(redis_url, BreakerConfig(), meter_provider=provider)
    try:
        assert await health.admit("primary")  # Redis answers: nothing served locally
        points = breaker_points(reader, "gateway.health.local_fallbacks")
        assert points == {(): 0}, points
    finally:
        await health.aclose()
        provider.shutdown()


@pytest.mark.anyio
async def test_a_process_with_no_traffic_learns_that_another_closed_the_breaker(
    redis_url: str,
) -> None:
    # `serve --workers 2`: worker one opened the primary's breaker; worker two's probe
    # closed it. One's gauge said open until one admitted a request for that upstream: on a
    # quiet route FallbackMwBreakerOpen (max over the workers) fired for hours after the
    # recovery. A process whose gauge says a breaker is not closed now reads the shared
    # state every refresh_interval, without a request.
    config = BreakerConfig(window=4, min_calls=3, failure_rate=0.5, cooldown_ms=COOLDOWN_MS)
    seen: dict[str, list[str]] = {"one": [], "two": []}
    one = RedisHealth(
        redis_url, config, refresh_interval=0.1, on_transition=lambda u, s: seen["one"].append(s)
    )
    two = RedisHealth(
        redis_url, config, refresh_interval=0.1, on_transition=lambda u, s: seen["two"].append(s)
    )
    try:
        for _ in range(3):
            assert await one.admit("up")
            await one.record("up", failure=True)
        assert seen["one"] == ["open"]
        await asyncio.sleep(COOLDOWN_MS / 1000 + 0.05)
        assert await two.admit("up")  # the probe, in the other process
        await two.record("up", failure=False)
        assert seen["two"] == ["half_open", "closed"]
        for _ in range(100):  # no call on `one`: its own refresh must find it closed
            if seen["one"][-1] == "closed":
                break
            await asyncio.sleep(0.02)
        # One's refresh may read the shared state while two's probe is in flight (between
        # ADMIT and RECORD): a half_open in between is the truth at that moment.
        assert seen["one"][0] == "open"
        assert seen["one"][-1] == "closed"
        assert set(seen["one"][1:-1]) <= {"half_open"}
    finally:
        await one.aclose()
        await two.aclose()


@pytest.mark.anyio
async def test_the_breaker_refresh_reads_nothing_during_an_outage() -> None:
    # The refresh of a breaker reported open must not count as health calls served
    # locally while Redis is away: gateway.health.local_fallbacks moves with traffic only.
    config = BreakerConfig(window=4, min_calls=3, failure_rate=0.5, cooldown_ms=60_000)
    health = RedisHealth("redis://127.0.0.1:1/0", config, refresh_interval=0.05)  # no Redis
    try:
        for _ in range(3):
            await health.admit("up")
            await health.record("up", failure=True)  # the local breaker opens
        assert not health.available
        calls = health.local_fallback_calls
        await asyncio.sleep(0.3)  # several refresh intervals, no request
        assert health.local_fallback_calls == calls
    finally:
        await health.aclose()


@pytest.mark.anyio
async def test_an_admission_whose_caller_left_during_its_round_trip_frees_the_probe_slot(
    redis_url: str,
) -> None:
    """The caller of an `admit` is cancelled (its client hung up) while the pipeline that
    carries ADMIT is on its way: Redis still runs it, and a half-open breaker gave its one
    probe slot to nobody, so every request skipped the upstream for the probe's lease (30 s
    and more) and none probed it. The slot is given back once the answer arrives."""
    health = RedisHealth(redis_url, BreakerConfig(**BREAKER))
    url, prefix = split_state_url(redis_url)
    inspect = aioredis.Redis.from_url(url, decode_responses=True)
    key = f"{prefix}breaker:primary"
    try:
        for _ in range(3):
            assert await health.admit("primary")
            await health.record("primary", failure=True)
        assert await inspect.hget(key, "st") == "open"
        await asyncio.sleep(COOLDOWN_MS / 1000 + 0.02)

        admitting = asyncio.ensure_future(health.admit("primary", admission=Admission()))
        for _ in range(100):  # until the pipeline with its ADMIT is handed over
            if health._senders:
                break
            await asyncio.sleep(0)
        assert health._senders
        admitting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await admitting
        for _ in range(200):  # the answer arrives; the slot it took goes back
            await asyncio.sleep(0.005)
            if not health._senders and await inspect.hget(key, "probe") == "0":
                break
        assert await inspect.hget(key, "st") == "half_open"  # ADMIT ran
        assert await inspect.hget(key, "probe") == "0", "a probe slot held for nobody"
        probe = Admission()
        assert await health.admit("primary", admission=probe)  # the next caller probes
        await health.record("primary", failure=False, admission=probe)
        assert await inspect.hget(key, "st") == "closed"
    finally:
        await inspect.aclose()
        await health.aclose()


@pytest.mark.anyio
async def test_a_process_that_starts_while_the_shared_breaker_is_open_reports_it_open(
    redis_url: str,
) -> None:
    # `serve --workers 2` with Redis state, watched by Prometheus: a worker replaced (or a
    # whole deploy) while the shared breaker was open reported the primary closed (0)
    # until its first admission of it, so after a restart FallbackMwBreakerOpen (max over
    # the workers) resolved while every request still skipped the primary. At startup a
    # process reads the shared breakers of its upstreams.
    async with (
        upstream(status_handler(503)) as primary,
        upstream(status_handler(200, b"backup")) as backup,
    ):
        conf = config(redis_url, primary, backup)
        conf["gateway"]["breaker"] = {**BREAKER, "cooldown_ms": 60_000, "max_cooldown_ms": 60_000}
        readers = [InMemoryMetricReader(), InMemoryMetricReader()]
        providers = [MeterProvider(metric_readers=[r], shutdown_on_exit=False) for r in readers]
        one_telemetry, two_telemetry = (Telemetry(meter_provider=p) for p in providers)
        try:
            async with gateway_client(conf, telemetry=one_telemetry) as one:
                for _ in range(3):  # min_calls 3: the third failure opens it
                    assert (await one.get("/v1/x")).text == "backup"
            assert breaker_points(readers[0], "gateway.breaker.state")[("primary",)] == 2
            two = Gateway(host_app, config=conf, telemetry=two_telemetry)
            try:
                two.services.start()  # lifespan startup; no request reaches `two`
                for _ in range(100):
                    gauge = breaker_points(readers[1], "gateway.breaker.state")
                    if gauge.get(("primary",)) == 2:
                        break
                    await asyncio.sleep(0.02)
                assert gauge == {("primary",): 2, ("backup",): 0}
                transitions = breaker_points(readers[1], "gateway.breaker.transitions")
                # Another process's transition: not counted here (its series stay at 0).
                assert set(transitions.values()) == {0}, transitions
            finally:
                await two.aclose()
        finally:
            for provider in providers:
                provider.shutdown()


@pytest.mark.anyio
async def test_the_longest_cooldown_the_loader_takes_is_kept_in_redis(redis_url: str) -> None:
    # max_cooldown_ms = 1e20 loaded, and every breaker script then failed in Redis ("value
    # is not an integer or out of range": the key's PEXPIRE): each process logged Redis
    # "unreachable" and kept breakers of its own. Now the loader stops at 31 days, and a
    # breaker opened for that long is shared.
    for key in ("cooldown_ms", "max_cooldown_ms"):
        with pytest.raises(ConfigError, match=f"gateway.breaker.{key}: must be at most"):
            load_config({"gateway": {"breaker": {key: 10**20}}})
    longest = load_config(
        {"gateway": {"breaker": {**BREAKER, "cooldown_ms": 31 * 86_400_000,
                                 "max_cooldown_ms": 31 * 86_400_000}}}
    ).gateway.breaker  # fmt: skip
    health = RedisHealth(redis_url, longest)
    other = RedisHealth(redis_url, longest)
    try:
        for _ in range(3):
            await health.record("u", failure=True)
        assert await health.unusable() is None
        assert not await other.admit("u")  # the open breaker is the shared one
    finally:
        await health.aclose()
        await other.aclose()


@pytest.mark.anyio
async def test_a_field_that_reads_as_no_number_is_read_as_absent_not_as_redis_down(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Fields written by hand (an operator's HSET, another version's format) that read as no
    # number failed the Lua scripts (`attempt to compare number with nil`): each call read
    # as "Redis unreachable", every process served on its own breakers, and the outage
    # warning and the "reachable again" line came back every second for as long as the key
    # lived. Such a field reads as absent now, and the next write replaces it.
    caplog.set_level(logging.WARNING, logger="fallback_mw.health")
    prefix = split_state_url(redis_url)[1]
    envs = ["KEY_A", "KEY_B"]
    pool = hashlib.sha256("\x1f".join(envs).encode()).hexdigest()[:12]
    inspect = aioredis.Redis.from_url(split_state_url(redis_url)[0], decode_responses=True)
    health = RedisHealth(redis_url, BreakerConfig(**BREAKER), pools={"primary": envs})
    answer = {"status": 503}

    async def primary_answers(request: web.Request) -> web.StreamResponse:
        return web.Response(status=answer["status"])

    try:
        now = int((await inspect.time())[0])
        breaker = f"{prefix}breaker:primary"
        await inspect.hset(
            breaker, mapping={"st": "open", "until": "soon", "probe": "x", "cd": "?"}
        )
        await inspect.hset(f"{prefix}credentials:primary:{pool}", mapping={"0": "x", "1": "y"})
        await inspect.set(f"{prefix}rotation:primary:{pool}", "not a counter")
        await inspect.hset(f"{prefix}score:primary:{pool}", mapping={"0": "a b c d", "1": "1 x"})
        await inspect.hset(
            f"{prefix}capacity:primary", mapping={"r:later": "1", f"r:{now}": "zz", f"t:{now}": "?"}
        )
        async with upstream(primary_answers) as primary, upstream(status_handler(200)) as backup:
            conf = config(redis_url, primary, backup, auth_env=envs, selection="score", rpm=100)
            async with gateway_client(conf, environ=POOL_ENV, health=health) as client:
                response = await client.get("/v1/x")
                # The open breaker's unreadable `until` is a cooldown over: one probe, which
                # failed, so it reopened with the base cooldown doubled.
                assert response.status_code == 200
                assert response.headers["x-gateway-provider"] == "backup"
                assert primary.count == 1
                assert await inspect.hget(breaker, "st") == "open", (
                    await inspect.hgetall(breaker),
                    primary.count,
                    health.local_fallback_calls,
                )
                assert await inspect.hget(breaker, "cd") == str(2 * COOLDOWN_MS)
                assert await health.usable_in("primary", 2) is not None
                # The breaker closed, the credentials' marks and the counts garbled again:
                # the primary serves.
                answer["status"] = 200
                await inspect.delete(breaker)
                await inspect.hset(
                    f"{prefix}credentials:primary:{pool}", mapping={"0": "x", "1": "y"}
                )
                await inspect.hset(f"{prefix}capacity:primary", f"r:{now}", "zz")
                assert (await client.get("/v1/x")).headers["x-gateway-provider"] == "primary"
                # A state no breaker has reads as closed, and is written closed.
                await inspect.hset(breaker, "st", "shut")
                assert (await client.get("/v1/x")).headers["x-gateway-provider"] == "primary"
                assert await inspect.hget(breaker, "st") == "closed"
        assert health.available
        assert health.local_fallback_calls == 0
        assert not [r for r in caplog.records if r.name == "fallback_mw.health"]
    finally:
        await health.aclose()
        await inspect.aclose()


@pytest.mark.anyio
async def test_a_key_of_another_kind_is_deleted_not_read_as_redis_down(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # A string where the gateway keeps a hash (a `SET` by hand, another program under the
    # same prefix) failed every script on it with WRONGTYPE: read as "Redis unreachable",
    # every process served on its own breakers, warning "unreachable" and "reachable
    # again" every second, for as long as the key lived (a key set by hand never expires).
    caplog.set_level(logging.WARNING, logger="fallback_mw.health")
    prefix = split_state_url(redis_url)[1]
    envs = ["KEY_A", "KEY_B"]
    pool = hashlib.sha256("\x1f".join(envs).encode()).hexdigest()[:12]
    inspect = aioredis.Redis.from_url(split_state_url(redis_url)[0], decode_responses=True)
    health = RedisHealth(redis_url, BreakerConfig(**BREAKER), pools={"primary": envs})
    breaker, marks = f"{prefix}breaker:primary", f"{prefix}credentials:primary:{pool}"
    try:
        await inspect.set(breaker, "open")
        await inspect.set(marks, "retired")
        async with (
            upstream(status_handler(200)) as primary,
            upstream(status_handler(200)) as backup,
        ):
            conf = config(redis_url, primary, backup, auth_env=envs)
            async with gateway_client(conf, environ=POOL_ENV, health=health) as client:
                for _ in range(4):
                    assert (await client.get("/v1/x")).headers["x-gateway-provider"] == "primary"
                    await asyncio.sleep(0)  # the deletions run in the background
                # The keys are the gateway's again: the breaker's window is kept in Redis,
                # shared, and both credentials served.
                assert await inspect.type(breaker) == "hash"
                assert len(await inspect.hget(breaker, "win") or "") >= 3
                assert {dict(r.headers)["authorization"] for r in primary.received} == {
                    "Bearer key-a",
                    "Bearer key-b",
                }
        assert health.available
        messages = [r.getMessage() for r in caplog.records if r.name == "fallback_mw.health"]
        assert not [m for m in messages if "unreachable" in m or "reachable again" in m]
        assert sorted(m.split(" key ")[1].split(" ")[0] for m in messages) == [breaker, marks]
    finally:
        await health.aclose()
        await inspect.aclose()
