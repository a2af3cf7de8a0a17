"""Everything a fault causes is booked as the fault, and the revert restores (SPEC §12).

The breaker remembers whether fault outcomes opened it (memory and Redis); skips past such
a breaker, and the fallbacks they cause, carry `gateway.fault` in metrics, spans, the log
line and the usage records; clearing the fault (in the store: `faults clear`, or expiry)
closes that breaker so the next request reaches the primary. A breaker real failures
opened is left alone, and its skips stay real.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from fallback_mw import Gateway
from fallback_mw.config import BreakerConfig
from fallback_mw.health import HealthState
from fallback_mw.health.breaker import Breaker
from fallback_mw.health.memory import MemoryHealth
from fallback_mw.store.ledgers import open_ledger
from fallback_mw.telemetry import Telemetry
from tests.helpers import client_for
from tests.test_cli_admin import cli
from tests.upstreams import Upstream, host_app, status_handler, upstream

CONFIG = BreakerConfig(
    window=4, min_calls=3, failure_rate=0.5, cooldown_ms=100, max_cooldown_ms=350
)


# --- the breaker machine ------------------------------------------------------------------


def test_fault_outcomes_open_a_breaker_that_remembers_the_fault() -> None:
    breaker = Breaker(CONFIG, probe_lease=10)
    for _ in range(3):
        breaker.record(failure=True, now=0, fault="fail")
    assert breaker.state == "open"
    assert breaker.open_fault() == "fail"
    # A failed half-open probe under the fault doubles the cooldown and stays the fault's.
    assert breaker.admit(0.1) == (True, "half_open")
    assert breaker.open_fault() == "fail"
    assert breaker.record(failure=True, now=0.1, fault="fail") == "reopened"
    assert breaker.cooldown == 0.2
    assert breaker.open_fault() == "fail"
    # The revert: closed, window and cooldown back to their start.
    assert breaker.reset_fault() == "closed"
    assert str(breaker.state) == "closed"
    assert breaker.cooldown == 0.1
    assert list(breaker.outcomes) == []
    assert breaker.open_fault() is None
    assert breaker.admit(0.15) == (True, None)


def test_real_failures_open_a_breaker_the_revert_leaves_alone() -> None:
    breaker = Breaker(CONFIG)
    for _ in range(3):
        breaker.record(failure=True, now=0)
    assert breaker.open_fault() is None
    assert breaker.reset_fault() is None
    assert breaker.state == "open"


def test_a_breaker_is_the_faults_only_when_fault_failures_alone_reach_the_rate() -> None:
    # Window [real, real, fault]: 3/3 failures, but fault failures are 1/3 < 0.5: real.
    mixed = Breaker(CONFIG)
    mixed.record(failure=True, now=0)
    mixed.record(failure=True, now=0)
    assert mixed.record(failure=True, now=0, fault="fail") == "opened"
    assert mixed.open_fault() is None
    # Window [real, fault, fault]: the fault's 2/3 reach the rate on their own.
    faulted = Breaker(CONFIG)
    faulted.record(failure=True, now=0)
    faulted.record(failure=True, now=0, fault="hang")
    assert faulted.record(failure=True, now=0, fault="hang") == "opened"
    assert faulted.open_fault() == "hang"


def test_a_real_probe_failure_makes_a_fault_breaker_real() -> None:
    breaker = Breaker(CONFIG, probe_lease=10)
    for _ in range(3):
        breaker.record(failure=True, now=0, fault="fail")
    assert breaker.admit(0.1)[0]
    assert breaker.record(failure=True, now=0.1) == "reopened"
    assert breaker.open_fault() is None
    assert breaker.reset_fault() is None
    assert breaker.state == "open"


def test_the_revert_drops_fault_outcomes_from_a_closed_window() -> None:
    breaker = Breaker(CONFIG)
    breaker.record(failure=True, now=0, fault="fail")
    breaker.record(failure=True, now=0)
    assert breaker.reset_fault() is None
    assert breaker.state == "closed"
    assert list(breaker.outcomes) == [1]  # the real failure stays
    # One more real failure: 2/2 but under min_calls; a third opens it, as real.
    breaker.record(failure=False, now=0)
    assert breaker.record(failure=True, now=0) == "opened"
    assert breaker.open_fault() is None


# --- the health states (memory and the real Redis) ----------------------------------------


@pytest.fixture(params=["memory", "redis"])
async def health_factory(
    request: pytest.FixtureRequest,
) -> AsyncIterator[Callable[[], HealthState]]:
    made: list[HealthState] = []
    state = "memory://" if request.param == "memory" else request.getfixturevalue("redis_url")

    def make() -> HealthState:
        from fallback_mw.health import create_health

        health = create_health(state, CONFIG)
        if isinstance(health, MemoryHealth) and made:
            return made[0]  # memory: one process, one state
        made.append(health)
        return health

    yield make
    for health in made:
        await health.aclose()


@pytest.mark.anyio
async def test_health_states_remember_who_opened_the_breaker(
    health_factory: Callable[[], HealthState],
) -> None:
    one, two = health_factory(), health_factory()  # two processes sharing a Redis
    for _ in range(3):
        await one.record("faulted", failure=True, fault="fail")
        await one.record("real", failure=True)
    for health in (one, two):
        assert not await health.admit("faulted")
        assert await health.open_fault("faulted") == "fail"
        assert not await health.admit("real")
        assert await health.open_fault("real") is None
        assert await health.open_fault("never-seen") is None
    await two.reset_fault("faulted")
    await two.reset_fault("real")
    for health in (one, two):
        assert await health.admit("faulted")  # closed: no probe lease needed
        assert await health.admit("faulted")
        assert await health.open_fault("faulted") is None
        assert not await health.admit("real")


@pytest.mark.anyio
async def test_a_skip_whose_refusal_raced_the_faults_reset_is_still_the_faults(
    health_factory: Callable[[], HealthState],
) -> None:
    """The platform team's game day: as the fault expired, one request was refused by the
    fault's open breaker, and another process's reset closed that breaker before the skip
    asked who had opened it. The skip was booked as a real one (gateway_fault="false", a
    WARNING line, a real fallback in Prometheus). Until the breaker opens again, the fault
    whose reset closed it is the answer."""
    one, two = health_factory(), health_factory()
    for _ in range(3):
        await one.record("up", failure=True, fault="fail")
    assert not await one.admit("up")  # refused: the skip is the fault's...
    await two.reset_fault("up")  # ...and the fault ends before it asks
    assert await one.skip_fault("up") == "fail"
    for _ in range(3):  # real failures open it again: the fault no longer answers
        assert await one.admit("up")
        await one.record("up", failure=True)
    assert not await one.admit("up")
    assert await one.skip_fault("up") is None
    for health in (one, two):
        assert await health.skip_fault("up") is None


@pytest.mark.anyio
async def test_health_states_revert_forgets_fault_outcomes_of_a_closed_breaker(
    health_factory: Callable[[], HealthState],
) -> None:
    health = health_factory()
    await health.record("up", failure=True, fault="fail")
    await health.record("up", failure=True, fault="fail")
    await health.reset_fault("up")
    # Were the two fault failures still in the window, this real one would open it.
    await health.record("up", failure=True)
    assert await health.admit("up")
    await health.record("up", failure=False)
    await health.record("up", failure=True)
    assert not await health.admit("up")  # 2 real of 3: open, and real
    assert await health.open_fault("up") is None


# --- a gateway under a fault in the store ---------------------------------------------------


def gateway_config(store: str, primary: str, backup: str) -> dict[str, Any]:
    return {
        "gateway": {
            "store": store,
            # A long cooldown: no half-open probe inside the test; only the revert closes it.
            "breaker": {"window": 10, "min_calls": 3, "failure_rate": 0.5, "cooldown_ms": 600_000},
        },
        "upstreams": {"primary": {"url": primary}, "backup": {"url": backup}},
        "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary", "backup"], "retries": 1}],
    }


def counts(reader: InMemoryMetricReader, name: str) -> dict[tuple[tuple[str, Any], ...], int]:
    found: dict[tuple[tuple[str, Any], ...], int] = {}
    data = reader.get_metrics_data()
    assert data is not None
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name != name:
                    continue
                for point in metric.data.data_points:
                    key = tuple(sorted((point.attributes or {}).items()))
                    found[key] = found.get(key, 0) + int(point.value)  # type: ignore[union-attr]
    return found


def by_fault(reader: InMemoryMetricReader, name: str) -> dict[bool, int]:
    result = {True: 0, False: 0}
    for key, value in counts(reader, name).items():
        result[bool(dict(key)["gateway.fault"])] += value
    return result


@pytest.fixture
async def pair() -> AsyncIterator[tuple[Upstream, Upstream]]:
    async with (
        upstream(status_handler(200, b"primary")) as primary,
        upstream(status_handler(200, b"backup")) as backup,
    ):
        yield primary, backup


async def until(condition: Callable[[], Awaitable[bool]], within: float = 15.0) -> None:
    deadline = time.monotonic() + within
    while not await condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


@pytest.mark.anyio
async def test_a_fail_fault_is_booked_as_the_fault_and_its_clear_restores_the_primary(
    tmp_path: Path, pair: tuple[Upstream, Upstream], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="fallback_mw.request")
    primary, backup = pair
    store = f"sqlite:///{tmp_path / 'gw.db'}"
    reader = InMemoryMetricReader()
    telemetry = Telemetry(meter_provider=MeterProvider(metric_readers=[reader]))
    gateway = Gateway(
        host_app, config=gateway_config(store, primary.url, backup.url), environ={},
        telemetry=telemetry,
    )  # fmt: skip
    runtime = gateway.services.store
    assert runtime is not None
    try:
        async with client_for(gateway) as client:
            assert (await client.get("/v1/x")).headers["x-gateway-provider"] == "primary"
            status, _, err = await cli(
                "faults", "set", "fail", "--store", store, "--upstream", "primary", "--ttl", "600"
            )
            assert status == 0, err
            await until(lambda: _true(runtime.faults.active_upstreams() == {"primary"}))
            # Steady traffic under the fault: 3 faulted attempts open the breaker, the
            # rest skip the primary because of it.
            requests = 300
            for _ in range(requests):
                response = await client.get("/v1/x")
                assert response.status_code == 200
                assert response.headers["x-gateway-provider"] == "backup"
                assert response.headers.get("x-gateway-fault") == "1"
            fallbacks = by_fault(reader, "gateway.fallbacks")
            assert fallbacks[True] + fallbacks[False] == requests
            assert fallbacks[True] >= 0.99 * requests, fallbacks
            assert by_fault(reader, "gateway.requests")[True] == requests
            # Attempts: a few faulted at the primary (the window also holds the success
            # before the fault), every backup attempt real; the rest were skips.
            attempts = counts(reader, "gateway.attempts")
            faulted = sum(v for k, v in attempts.items() if dict(k)["gateway.fault"])
            assert 1 <= faulted <= 3
            skips = {k: v for k, v in counts(reader, "gateway.skips").items() if v}
            assert all(dict(k)["gateway.fault"] for k in skips), skips
            assert sum(skips.values()) == requests - faulted
            assert primary.count == 1  # no packet left during the fault

            # The usage records say the same, per request.
            ledger = open_ledger(store)
            assert ledger is not None
            try:
                records = await ledger.usage(route="chat", limit=10_000)
            finally:
                await ledger.aclose()
            during = [r for r in records if r.chosen == "backup"]
            assert len(during) == requests
            assert all(r.fault for r in during)
            # And the request log lines.
            lines = [r for r in caplog.records if r.name == "fallback_mw.request"]
            fallback_lines = [r for r in lines if r.__dict__["chosen"] == "backup"]
            assert len(fallback_lines) == requests
            assert all(r.__dict__["fault"] is True for r in fallback_lines)
            skipped = [a for r in during for a in r.attempts if a.skipped == "breaker_open"]
            assert len(skipped) == requests - faulted
            assert all(a.fault == "fail" for a in skipped)

            # The revert: `faults clear`; once the reloader has seen it, the very next
            # request reaches the primary (its breaker was closed, not left to a cooldown).
            status, _, err = await cli("faults", "clear", "--store", store, "--upstream", "primary")
            assert status == 0, err
            await until(lambda: _true(not runtime.faults.active_upstreams()))
            await until(lambda: _breaker_closed(gateway))
            response = await client.get("/v1/x")
            assert response.headers["x-gateway-provider"] == "primary"
            assert "x-gateway-fault" not in response.headers
            assert primary.count == 2
    finally:
        await gateway.aclose()


@pytest.mark.anyio
async def test_an_expired_fault_restores_the_primary_too(
    tmp_path: Path, pair: tuple[Upstream, Upstream]
) -> None:
    primary, backup = pair
    store = f"sqlite:///{tmp_path / 'gw.db'}"
    gateway = Gateway(host_app, config=gateway_config(store, primary.url, backup.url), environ={})
    runtime = gateway.services.store
    assert runtime is not None
    try:
        async with client_for(gateway) as client:
            # The first request starts the reloader (it runs inside the serving loop).
            assert (await client.get("/v1/x")).headers["x-gateway-provider"] == "primary"
            status, _, err = await cli(
                "faults", "set", "fail", "--store", store, "--upstream", "primary", "--ttl", "5"
            )
            assert status == 0, err
            await until(lambda: _true(runtime.faults.active_upstreams() == {"primary"}))
            for _ in range(5):
                response = await client.get("/v1/x")
                if response.headers.get("x-gateway-fault") != "1":
                    break  # the fault expired already (a loaded machine): nothing to revert
            else:
                assert await gateway.services.health.open_fault("primary") == "fail"
            await until(lambda: _breaker_closed(gateway))
            await until(lambda: _true(not runtime.faults.active_upstreams()))
            response = await client.get("/v1/x")
            assert response.headers["x-gateway-provider"] == "primary"
    finally:
        await gateway.aclose()


@pytest.mark.anyio
async def test_real_failures_stay_real_through_a_fault_and_its_revert(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'gw.db'}"
    answer = {"status": 503}

    from aiohttp import web

    async def primary_handler(request: web.Request) -> web.StreamResponse:
        return web.Response(status=answer["status"], body=b"primary")

    reader = InMemoryMetricReader()
    telemetry = Telemetry(meter_provider=MeterProvider(metric_readers=[reader]))
    async with (
        upstream(primary_handler) as primary,
        upstream(status_handler(200, b"backup")) as backup,
    ):
        gateway = Gateway(
            host_app, config=gateway_config(store, primary.url, backup.url), environ={},
            telemetry=telemetry,
        )  # fmt: skip
        runtime = gateway.services.store
        assert runtime is not None
        try:
            async with client_for(gateway) as client:
                for _ in range(3):  # a real outage opens the breaker
                    assert (await client.get("/v1/x")).headers["x-gateway-provider"] == "backup"
                assert primary.count == 3
                answer["status"] = 200
                status, _, err = await cli(
                    "faults", "set", "fail", "--store", store, "--upstream", "primary",
                    "--ttl", "600",
                )  # fmt: skip
                assert status == 0, err
                await until(lambda: _true(runtime.faults.active_upstreams() == {"primary"}))
                for _ in range(5):
                    response = await client.get("/v1/x")
                    assert response.headers["x-gateway-provider"] == "backup"
                    # The outage's skips, not the fault's.
                    assert "x-gateway-fault" not in response.headers
                fallbacks = by_fault(reader, "gateway.fallbacks")
                assert fallbacks == {True: 0, False: 8}
                status, _, err = await cli(
                    "faults", "clear", "--store", store, "--upstream", "primary"
                )
                assert status == 0, err
                await until(lambda: _true(not runtime.faults.active_upstreams()))
                await asyncio.sleep(0.2)
                # Left alone: the breaker real failures opened is still open.
                response = await client.get("/v1/x")
                assert response.headers["x-gateway-provider"] == "backup"
                assert primary.count == 3
        finally:
            await gateway.aclose()


@asynccontextmanager
async def _gateway(config: dict[str, Any]) -> AsyncIterator[Gateway]:
    gateway = Gateway(host_app, config=config, environ={})
    try:
        yield gateway
    finally:
        await gateway.aclose()


async def _true(value: bool) -> bool:
    return value


async def _breaker_closed(gateway: Gateway) -> bool:
    return await gateway.services.health.open_fault("primary") is None


@pytest.mark.anyio
@pytest.mark.parametrize("state", ["memory", "redis"])
async def test_clearing_a_revoke_fault_gives_the_pool_its_credentials_back(
    tmp_path: Path, pair: tuple[Upstream, Upstream], state: str, request: pytest.FixtureRequest
) -> None:
    primary, backup = pair
    store = f"sqlite:///{tmp_path / 'gw.db'}"
    conf = gateway_config(store, primary.url, backup.url)
    if state == "redis":
        conf["gateway"]["state"] = request.getfixturevalue("redis_url")
    conf["upstreams"]["primary"]["auth_env"] = ["FMW_POOL_A", "FMW_POOL_B"]
    gateway = Gateway(host_app, config=conf, environ={"FMW_POOL_A": "sk-a", "FMW_POOL_B": "sk-b"})
    runtime = gateway.services.store
    assert runtime is not None
    try:
        async with client_for(gateway) as client:
            assert (await client.get("/v1/x")).headers["x-gateway-provider"] == "primary"
            status, _, err = await cli(
                "faults", "set", "revoke", "--store", store, "--upstream", "primary",
                "--ttl", "600",
            )  # fmt: skip
            assert status == 0, err
            await until(lambda: _true(runtime.faults.active_upstreams() == {"primary"}))
            # The first request meets both credentials revoked (each answers 401, as a
            # vendor-disabled key would, and is retired; the last 401 is the answer);
            # then the pool is empty: the primary is skipped, the backup answers.
            first = await client.get("/v1/x")
            assert (first.status_code, first.headers["x-gateway-attempts"]) == (401, "2")
            for _ in range(3):
                response = await client.get("/v1/x")
                assert response.headers["x-gateway-provider"] == "backup"
                # Skipped for want of a credential the fault retired: the fault's traffic.
                assert response.headers.get("x-gateway-fault") == "1"
            assert primary.count == 1  # no packet left under the fault
            status, _, err = await cli("faults", "clear", "--store", store, "--upstream", "primary")
            assert status == 0, err
            await until(lambda: _true(not runtime.faults.active_upstreams()))

            async def restored() -> bool:
                # Asked of the health state itself, not by sending a request.
                health = gateway.services.health
                found = await health.pick_credential(
                    "primary", 2, exclude=frozenset(), session=None
                )
                return found is not None

            await until(restored)
            response = await client.get("/v1/x")
            assert response.headers["x-gateway-provider"] == "primary"
            assert "x-gateway-fault" not in response.headers
            assert primary.count == 2
    finally:
        await gateway.aclose()


@pytest.mark.anyio
async def test_a_pool_a_revoke_fault_emptied_says_the_fault_not_replace_the_keys(
    tmp_path: Path, pair: tuple[Upstream, Upstream]
) -> None:
    """Every credential of a pool-only route retired by a `revoke` fault: the 503 names the
    fault and how to end it, not "put valid keys in ... and restart" (the keys are fine)."""
    primary, backup = pair
    store = f"sqlite:///{tmp_path / 'gw.db'}"
    conf = gateway_config(store, primary.url, backup.url)
    conf["routes"][0]["plan"] = ["primary"]
    conf["upstreams"]["primary"]["auth_env"] = ["FMW_POOL_A", "FMW_POOL_B"]
    gateway = Gateway(host_app, config=conf, environ={"FMW_POOL_A": "sk-a", "FMW_POOL_B": "sk-b"})
    runtime = gateway.services.store
    assert runtime is not None
    try:
        async with client_for(gateway) as client:
            assert (await client.get("/v1/x")).status_code == 200  # starts the reloader
            status, _, err = await cli(
                "faults", "set", "revoke", "--store", store, "--upstream", "primary",
                "--ttl", "600",
            )  # fmt: skip
            assert status == 0, err
            await until(lambda: _true(runtime.faults.active_upstreams() == {"primary"}))
            assert (await client.get("/v1/x")).status_code == 401  # both retired by the fault
            response = await client.get("/v1/x")
    finally:
        await gateway.aclose()
    assert (response.status_code, response.headers.get("x-gateway-fault")) == (503, "1")
    message = response.json()["error"]["message"]
    assert "retired by the revoke fault on it" in message, message
    assert "fallback-mw faults clear --upstream primary" in message
    assert "put valid keys" not in message


@pytest.mark.anyio
async def test_a_breaker_a_fail_fault_opened_says_the_fault_not_wait_for_the_cooldown(
    tmp_path: Path, pair: tuple[Upstream, Upstream]
) -> None:
    """A route of one candidate whose breaker a `fail` fault's outcomes opened: the 503 said
    "an open breaker lets a probe through after its cooldown", but that probe meets the
    fault again (and reopens it) until the fault ends. It names the fault and how to end
    it; done, the very next request is served."""
    primary, backup = pair
    store = f"sqlite:///{tmp_path / 'gw.db'}"
    conf = gateway_config(store, primary.url, backup.url)
    conf["routes"][0].update(plan=["primary"], retries=0)
    gateway = Gateway(host_app, config=conf, environ={})
    runtime = gateway.services.store
    assert runtime is not None
    try:
        async with client_for(gateway) as client:
            assert (await client.get("/v1/x")).status_code == 200  # starts the reloader
            status, _, err = await cli(
                "faults", "set", "fail", "--store", store, "--upstream", "primary", "--ttl", "600"
            )
            assert status == 0, err
            await until(lambda: _true(runtime.faults.active_upstreams() == {"primary"}))
            # The faulted attempts (502) open the breaker; then the primary is skipped.
            for _ in range(5):
                skipped = await client.get("/v1/x")
                if skipped.status_code != 502:
                    break
            status, _, err = await cli("faults", "clear", "--store", store, "--upstream", "primary")
            assert status == 0, err
            await until(lambda: _true(not runtime.faults.active_upstreams()))
            await until(lambda: _breaker_closed(gateway))
            followed = await client.get("/v1/x")
    finally:
        await gateway.aclose()
    assert (skipped.status_code, skipped.headers.get("x-gateway-fault")) == (503, "1")
    assert skipped.headers["x-gateway-skipped"] == "primary;reason=breaker_open"
    message = skipped.json()["error"]["message"]
    assert "opened by the fail fault on it" in message, message
    assert "`fallback-mw faults clear --upstream primary`" in message, message
    assert "after its cooldown" not in message, message
    assert (followed.status_code, followed.headers["x-gateway-provider"]) == (200, "primary")


@pytest.mark.anyio
async def test_a_ceiling_the_faults_reached_names_them_not_raise_the_retries(
    tmp_path: Path,
) -> None:
    """A game day faulting both candidates: the 502 (rule `ceiling`) said "raise the route's
    retries", but each further attempt would meet a fault again. It names the faults and
    how to end them; with one candidate faulted and the other failing for real, both the
    fault and the ordinary advice are said."""
    store = f"sqlite:///{tmp_path / 'gw.db'}"
    async with (
        upstream(status_handler(200, b"primary")) as primary,
        upstream(status_handler(503, b"down")) as backup,
    ):
        conf = gateway_config(store, primary.url, backup.url)
        conf["gateway"]["breaker"]["min_calls"] = 100  # no skips: every attempt runs
        gateway = Gateway(host_app, config=conf, environ={})
        faulted, mixed = await _two_game_day_ceilings(gateway, store)
    error = faulted.json()["error"]
    assert (faulted.status_code, error["rule"], error["attempts"]) == (502, "ceiling", 2)
    message = error["message"]
    assert "raise the route's retries" not in message, message
    said = "the fail faults on 'primary', 'backup' answered every attempt, as they would any"
    assert f"{said} further one" in message, message
    assert "`fallback-mw faults clear --upstream primary`" in message, message
    assert "`fallback-mw faults clear --upstream backup`" in message, message
    error = mixed.json()["error"]
    assert (mixed.status_code, error["rule"]) == (502, "ceiling")
    assert "the fail fault on 'primary' answered 1 of the 2 attempts" in error["message"]
    assert "`fallback-mw faults clear --upstream primary`" in error["message"]
    assert "raise the route's retries" in error["message"], error["message"]


async def _two_game_day_ceilings(gateway: Gateway, store: str) -> tuple[Any, Any]:
    """Both upstreams faulted: one answer; then the backup's fault cleared: another."""
    runtime = gateway.services.store
    assert runtime is not None
    try:
        async with client_for(gateway) as client:
            assert (await client.get("/v1/x")).status_code == 200  # starts the reloader
            for name in ("primary", "backup"):
                status, _, err = await cli(
                    "faults", "set", "fail", "--store", store, "--upstream", name, "--ttl", "600"
                )
                assert status == 0, err
            both = {"primary", "backup"}
            await until(lambda: _true(runtime.faults.active_upstreams() == both))
            faulted = await client.get("/v1/x")
            status, _, err = await cli("faults", "clear", "--store", store, "--upstream", "backup")
            assert status == 0, err
            await until(lambda: _true(runtime.faults.active_upstreams() == {"primary"}))
            mixed = await client.get("/v1/x")
    finally:
        await gateway.aclose()
    return faulted, mixed


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["hang", "blackhole"])
async def test_a_deadline_that_cuts_a_hang_fault_on_the_last_attempt_names_the_fault(
    tmp_path: Path, pair: tuple[Upstream, Upstream], kind: str
) -> None:
    """The route's only attempt hangs under a game-day fault until the deadline: the 504
    said "raise the route's deadline_ms to wait longer for it", but the fault never
    answers. It names the fault and how to end it; cleared, the request is served."""
    primary, backup = pair
    store = f"sqlite:///{tmp_path / 'gw.db'}"
    conf = gateway_config(store, primary.url, backup.url)
    conf["routes"][0].update(plan=["primary"], retries=0, deadline_ms=400)
    gateway = Gateway(host_app, config=conf, environ={})
    runtime = gateway.services.store
    assert runtime is not None
    try:
        async with client_for(gateway) as client:
            assert (await client.get("/v1/x")).status_code == 200  # starts the reloader
            status, _, err = await cli(
                "faults", "set", kind, "--store", store, "--upstream", "primary", "--ttl", "600"
            )
            assert status == 0, err
            await until(lambda: _true(runtime.faults.active_upstreams() == {"primary"}))
            cut = await client.get("/v1/x")
            status, _, err = await cli("faults", "clear", "--store", store, "--upstream", "primary")
            assert status == 0, err
            await until(lambda: _true(not runtime.faults.active_upstreams()))
            await until(lambda: _breaker_closed(gateway))
            followed = await client.get("/v1/x")
    finally:
        await gateway.aclose()
    error = cut.json()["error"]
    assert (cut.status_code, error["rule"], cut.headers.get("x-gateway-fault")) == (
        504, "deadline", "1",
    )  # fmt: skip
    assert f"the {kind} fault on 'primary' never answers" in error["message"], error["message"]
    assert "`fallback-mw faults clear --upstream primary`" in error["message"]
    assert "wait longer" not in error["message"], error["message"]
    assert (followed.status_code, followed.headers["x-gateway-provider"]) == (200, "primary")


@pytest.mark.anyio
async def test_redis_every_process_reports_the_reverted_breaker_closed(redis_url: str) -> None:
    # Two gateway processes share the breaker; each reports the transitions it saw to its
    # own gauge. After the revert both must say closed, or FallbackMwBreakerOpen (max over
    # processes) would keep firing on the one that saw it open last.
    from fallback_mw.health.redis import RedisHealth

    seen: dict[str, dict[str, str]] = {"one": {}, "two": {}}
    one = RedisHealth(redis_url, CONFIG, on_transition=lambda u, s: seen["one"].__setitem__(u, s))
    two = RedisHealth(redis_url, CONFIG, on_transition=lambda u, s: seen["two"].__setitem__(u, s))
    try:
        for _ in range(3):
            await one.record("up", failure=True, fault="fail")
        assert seen["one"] == {"up": "open"}
        await asyncio.sleep(CONFIG.cooldown_ms / 1000 + 0.05)
        assert await two.admit("up")  # the half-open probe, in the other process
        await two.record("up", failure=True, fault="fail")  # the fault reopens it
        assert seen["two"] == {"up": "open"}
        assert await one.open_fault("up") == "fail"
        await one.reset_fault("up")  # the first reloader to see the clear
        await two.reset_fault("up")  # the second: already closed, still reported
        assert seen == {"one": {"up": "closed"}, "two": {"up": "closed"}}
        assert await two.admit("up") and await one.admit("up")
        # A real probe failure makes a fault's breaker real (the Lua path).
        for _ in range(3):
            await one.record("real", failure=True, fault="fail")
        await asyncio.sleep(CONFIG.cooldown_ms / 1000 + 0.05)
        assert await two.admit("real")
        await two.record("real", failure=True)
        assert await one.open_fault("real") is None
        await one.reset_fault("real")
        assert not await one.admit("real")
    finally:
        await one.aclose()
        await two.aclose()


@pytest.mark.anyio
async def test_postgresql_store_the_clear_reaches_the_gateway_and_restores_the_primary(
    pg_url: str, pair: tuple[Upstream, Upstream]
) -> None:
    # PostgreSQL tells the reloader by NOTIFY: the revert follows the clear at once.
    primary, backup = pair
    gateway = Gateway(host_app, config=gateway_config(pg_url, primary.url, backup.url), environ={})
    runtime = gateway.services.store
    assert runtime is not None
    try:
        async with client_for(gateway) as client:
            assert (await client.get("/v1/x")).headers["x-gateway-provider"] == "primary"
            status, _, err = await cli(
                "faults", "set", "fail", "--store", pg_url, "--upstream", "primary", "--ttl", "600"
            )
            assert status == 0, err
            await until(lambda: _true(runtime.faults.active_upstreams() == {"primary"}))
            for _ in range(6):
                response = await client.get("/v1/x")
                assert response.headers["x-gateway-provider"] == "backup"
                assert response.headers.get("x-gateway-fault") == "1"
            assert await gateway.services.health.open_fault("primary") == "fail"
            status, _, err = await cli(
                "faults", "clear", "--store", pg_url, "--upstream", "primary"
            )
            assert status == 0, err
            await until(lambda: _breaker_closed(gateway))
            response = await client.get("/v1/x")
            assert response.headers["x-gateway-provider"] == "primary"
    finally:
        await gateway.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["hang", "blackhole"])
async def test_timeout_faults_are_booked_and_reverted_too(
    tmp_path: Path, pair: tuple[Upstream, Upstream], kind: str
) -> None:
    primary, backup = pair
    store = f"sqlite:///{tmp_path / 'gw.db'}"
    conf = gateway_config(store, primary.url, backup.url)
    conf["upstreams"]["primary"]["first_byte_timeout_ms"] = 300
    gateway = Gateway(host_app, config=conf, environ={})
    runtime = gateway.services.store
    assert runtime is not None
    try:
        async with client_for(gateway) as client:
            assert (await client.get("/v1/x")).headers["x-gateway-provider"] == "primary"
            status, _, err = await cli(
                "faults", "set", kind, "--store", store, "--upstream", "primary", "--ttl", "600"
            )
            assert status == 0, err
            await until(lambda: _true(runtime.faults.active_upstreams() == {"primary"}))
            for _ in range(6):  # a few time out (the breaker opens), the rest skip
                response = await client.get("/v1/x")
                assert response.headers["x-gateway-provider"] == "backup"
                assert response.headers.get("x-gateway-fault") == "1"
            assert await gateway.services.health.open_fault("primary") == kind
            status, _, err = await cli("faults", "clear", "--store", store, "--upstream", "primary")
            assert status == 0, err
            await until(lambda: _breaker_closed(gateway))
            response = await client.get("/v1/x")
            assert response.headers["x-gateway-provider"] == "primary"
    finally:
        await gateway.aclose()


@pytest.mark.anyio
async def test_redis_every_process_reports_the_shared_breaker_as_it_is(redis_url: str) -> None:
    # A transition another process made reaches this process's gauge at its next
    # admission: a real outage's breaker that one process opened and another closed after
    # its probe must not stay "open" on the first (FallbackMwBreakerOpen would never resolve).
    from fallback_mw.health.redis import RedisHealth

    seen: dict[str, list[str]] = {"one": [], "two": []}
    one = RedisHealth(redis_url, CONFIG, on_transition=lambda u, s: seen["one"].append(s))
    two = RedisHealth(redis_url, CONFIG, on_transition=lambda u, s: seen["two"].append(s))
    try:
        assert await one.admit("up") and await two.admit("up")
        assert seen == {"one": [], "two": []}  # closed and never seen otherwise: nothing
        for _ in range(3):
            await one.record("up", failure=True)
        assert not await two.admit("up")
        assert seen == {"one": ["open"], "two": ["open"]}
        await asyncio.sleep(CONFIG.cooldown_ms / 1000 + 0.05)
        assert await two.admit("up")  # two's probe
        await two.record("up", failure=False)
        assert seen["two"] == ["open", "half_open", "closed"]
        assert await one.admit("up")
        assert seen["one"] == ["open", "closed"]
    finally:
        await one.aclose()
        await two.aclose()


def breaker_gauge(reader: InMemoryMetricReader) -> dict[str, int]:
    found: dict[str, int] = {}
    data = reader.get_metrics_data()
    for resource in data.resource_metrics if data is not None else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name == "gateway.breaker.state":
                    for point in metric.data.data_points:
                        upstream_name = str((point.attributes or {})["gateway.upstream"])
                        found[upstream_name] = int(point.value)  # type: ignore[union-attr]
    return found


@pytest.mark.anyio
async def test_a_removed_route_s_open_breaker_leaves_the_gauge(tmp_path: Path) -> None:
    """An operator removes a stored route whose primary's breaker is open (the usual way to
    stop paging about a dead vendor): once the gateway has reloaded, the
    `gateway.breaker.state` gauge no longer reports that upstream, so FallbackMwBreakerOpen
    resolves. It reported it open (2) until the process restarted."""
    store = f"sqlite:///{tmp_path / 'gw.db'}"
    async with (
        upstream(status_handler(503)) as dead,
        upstream(status_handler(200, b"backup")) as backup,
    ):
        base = ["--store", store, "--id", "gone"]
        status, _, err = await cli(
            "routes", "add", *base, "--prefix", "/gone/", "--upstream", dead.url,
            "--fallback", backup.url, "--retries", "1",
        )  # fmt: skip
        assert status == 0, err
        reader = InMemoryMetricReader()
        telemetry = Telemetry(meter_provider=MeterProvider(metric_readers=[reader]))
        conf = gateway_config(store, dead.url, backup.url)  # route chat: never asked
        gateway = Gateway(host_app, config=conf, environ={}, telemetry=telemetry)
        runtime = gateway.services.store
        assert runtime is not None
        try:
            async with client_for(gateway) as client:
                for _ in range(5):
                    assert (await client.get("/gone/x")).status_code == 200
                assert breaker_gauge(reader).get("gone-primary") == 2
                reloads = runtime.reloads
                status, _, err = await cli("routes", "remove", *base)
                assert status == 0, err
                await until(lambda: _true(runtime.reloads > reloads))
                assert (await client.get("/gone/x")).status_code == 404  # the host app's
                gauge = breaker_gauge(reader)
                assert "gone-primary" not in gauge, gauge
        finally:
            await gateway.aclose()


@pytest.mark.anyio
async def test_usage_incidents_mark_the_game_days_failovers_apart_from_a_real_one(
    tmp_path: Path,
) -> None:
    # After a `fail` game day, `usage --incidents` listed its failovers as
    # `failed_over  primary:503,backup:200`: the same line as a real primary 503, so the
    # review of the week's outages counted the exercise. They now say it was the fault.
    async def down_path_fails(request: web.Request) -> web.StreamResponse:
        return web.Response(status=503 if request.path == "/v1/down" else 200)

    store = f"sqlite:///{tmp_path / 'gw.db'}"
    async with (
        upstream(down_path_fails) as primary,
        upstream(status_handler(200)) as backup,
        _gateway(gateway_config(store, primary.url, backup.url)) as gateway,
        client_for(gateway) as client,
    ):
        runtime = gateway.services.store
        assert runtime is not None
        # The first request starts the store reloader (and is no incident).
        assert (await client.get("/v1/x")).headers["x-gateway-provider"] == "primary"
        status, _, err = await cli(
            "faults", "set", "fail", "--store", store, "--upstream", "primary", "--ttl", "600"
        )
        assert status == 0, err
        await until(lambda: _true(runtime.faults.active_upstreams() == {"primary"}))
        for _ in range(4):
            assert (await client.get("/v1/x")).headers["x-gateway-provider"] == "backup"
        status, _, err = await cli("faults", "clear", "--store", store, "--upstream", "primary")
        assert status == 0, err
        await until(lambda: _true(not runtime.faults.active_upstreams()))
        await until(lambda: _breaker_closed(gateway))
        # A real outage now (on this path): the primary answers 503 itself.
        assert (await client.get("/v1/down")).headers["x-gateway-provider"] == "backup"
    status, table, err = await cli("usage", "--store", store, "--incidents")
    assert status == 0, err
    rows = [line.split() for line in table.strip().splitlines()[1:]]
    incidents = [(row[4], row[5]) for row in rows]
    # Two faulted attempts open the breaker (the window holds the first success too).
    assert incidents == [
        *[("failed_over,fault", "primary:503(fault:fail),backup:200")] * 2,
        *[("skipped,fault", "primary:skipped(breaker_open,fault:fail),backup:200")] * 2,
        ("failed_over", "primary:503,backup:200"),  # the real one, unmarked
    ]
    status, out, err = await cli("usage", "--store", store, "--incidents", "--json")
    assert status == 0, err
    kinds = [json.loads(line)["incident"] for line in out.splitlines()]
    assert [k for k in kinds if "fault" not in k] == [["failed_over"]]


@pytest.mark.anyio
async def test_hung_attempts_that_end_after_the_clear_do_not_reopen_the_breaker(
    tmp_path: Path, pair: tuple[Upstream, Upstream]
) -> None:
    # A hang game day aborted (or cleared) while requests hung on the primary: the revert
    # reset the breaker, then those attempts timed out and booked their fault failures into
    # the fresh window, which opened it again, as the fault's, with no fault left to reset
    # it: the primary stayed skipped for a whole cooldown (here 10 minutes) after the clear.
    primary, backup = pair
    store = f"sqlite:///{tmp_path / 'gw.db'}"
    config = gateway_config(store, primary.url, backup.url)
    config["upstreams"]["primary"]["first_byte_timeout_ms"] = 2500
    async with _gateway(config) as gateway, client_for(gateway) as client:
        runtime = gateway.services.store
        assert runtime is not None
        assert (await client.get("/v1/x")).headers["x-gateway-provider"] == "primary"
        status, _, err = await cli(
            "faults", "set", "hang", "--store", store, "--upstream", "primary", "--ttl", "600"
        )
        assert status == 0, err
        await until(lambda: _true(runtime.faults.active_upstreams() == {"primary"}))
        hung = [asyncio.ensure_future(client.get("/v1/x")) for _ in range(4)]
        await asyncio.sleep(0.2)  # all four hang on the primary now
        status, _, err = await cli("faults", "clear", "--store", store, "--upstream", "primary")
        assert status == 0, err
        await until(lambda: _true(not runtime.faults.active_upstreams()))
        assert not any(task.done() for task in hung)  # the revert came while they hung
        for response in await asyncio.gather(*hung):
            assert response.headers["x-gateway-provider"] == "backup"
        assert await _breaker_closed(gateway)
        response = await client.get("/v1/x")
        assert response.headers["x-gateway-provider"] == "primary"
        assert "x-gateway-fault" not in response.headers


@pytest.mark.anyio
async def test_the_request_log_line_says_a_game_days_failover_was_the_fault(
    tmp_path: Path, pair: tuple[Upstream, Upstream], caplog: pytest.LogCaptureFixture
) -> None:
    # serve writes the text line: under a `fail` fault, a request that skipped the
    # primary's open breaker read `... chosen=backup ... skipped=primary;reason=breaker_open`,
    # the same WARNING as a real outage's; only a JSON formatter saw the `fault` field.
    caplog.set_level(logging.INFO, logger="fallback_mw.request")
    primary, backup = pair
    store = f"sqlite:///{tmp_path / 'gw.db'}"
    async with (
        _gateway(gateway_config(store, primary.url, backup.url)) as gateway,
        client_for(gateway) as client,
    ):
        runtime = gateway.services.store
        assert runtime is not None
        assert (await client.get("/v1/x")).headers["x-gateway-provider"] == "primary"
        status, _, err = await cli(
            "faults", "set", "fail", "--store", store, "--upstream", "primary", "--ttl", "600"
        )
        assert status == 0, err
        await until(lambda: _true(runtime.faults.active_upstreams() == {"primary"}))
        for _ in range(4):
            assert (await client.get("/v1/x")).headers["x-gateway-provider"] == "backup"
    lines = [r.getMessage() for r in caplog.records if r.name == "fallback_mw.request"]
    assert not lines[0].endswith("fault=true")  # before the fault
    assert all(line.endswith(" fault=true") for line in lines[1:]), lines
    assert lines[-1].endswith(" skipped=primary;reason=breaker_open fault=true")


@pytest.mark.anyio
async def test_an_expiring_fault_restores_the_primary_at_its_expiry_not_the_next_poll(
    tmp_path: Path, pair: tuple[Upstream, Upstream]
) -> None:
    """A fault's expiry sends no store notification: the breaker its outcomes opened was
    reset only at the reloader's next poll after it (up to the 2 s safety net on
    PostgreSQL, whatever `poll_interval` says), so the primary stayed skipped, and
    FallbackMwBreakerOpen firing, that long after `faults set --ttl` said the fault ended.
    The reloader wakes at the expiry. (A 30 s poll here makes the difference plain.)"""
    from fallback_mw.store.routes import Fault, open_store

    primary, backup = pair
    store = f"sqlite:///{tmp_path / 'gw.db'}"
    route_store = open_store(store)
    try:
        expires_at = time.time() + 2.0
        assert await route_store.set_fault(Fault("fail", "primary", expires_at)) is None
    finally:
        await route_store.aclose()
    gateway = Gateway(host_app, config=gateway_config(store, primary.url, backup.url), environ={})
    runtime = gateway.services.store
    assert runtime is not None
    runtime.poll_interval = 30.0
    try:
        async with client_for(gateway) as client:
            for _ in range(3):  # the fault's outcomes open the breaker
                response = await client.get("/v1/x")
                assert response.headers["x-gateway-provider"] == "backup"
            assert await gateway.services.health.open_fault("primary") == "fail"
            await until(lambda: _breaker_closed(gateway), within=expires_at + 1.0 - time.time())
            response = await client.get("/v1/x")
            assert response.headers["x-gateway-provider"] == "primary"
    finally:
        await gateway.aclose()
