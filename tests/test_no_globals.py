"""No process-global state: two Gateways in one process keep separate breaker gauges, the
Redis health state counts on the meter provider it is given, and a budgeted route with no
ledger fails closed."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from fallback_mw import BudgetGuard, Gateway, PlanWalker, RouteResolver, load_config
from fallback_mw.health.redis import RedisHealth
from fallback_mw.layers.injector import CredentialInjector
from fallback_mw.telemetry import Telemetry
from tests.helpers import client_for
from tests.upstreams import host_app, status_handler, upstream

pytestmark = pytest.mark.anyio

ENV = {"PRIMARY_KEY": "sk-primary-0001", "BACKUP_KEY": "sk-backup-0002"}


def points(reader: InMemoryMetricReader, name: str) -> list[Any]:
    data = reader.get_metrics_data()
    found: list[Any] = []
    for resource in data.resource_metrics if data else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name == name:
                    found.extend(metric.data.data_points)
    return found


def config(primary: str, backup: str, **route: Any) -> dict[str, Any]:
    return {
        "gateway": {"breaker": {"window": 4, "min_calls": 2, "cooldown_ms": 60_000}},
        "upstreams": {
            "primary": {"url": primary, "auth_env": "PRIMARY_KEY"},
            "backup": {"url": backup, "auth_env": "BACKUP_KEY"},
        },
        "routes": [
            {"id": "chat", "prefix": "/v1/", "plan": ["primary", "backup"], "retries": 1, **route}
        ],
    }


async def test_two_gateways_in_one_process_keep_separate_breaker_gauges() -> None:
    readers = [InMemoryMetricReader(), InMemoryMetricReader()]
    telemetries = [
        Telemetry(meter_provider=MeterProvider(metric_readers=[r], shutdown_on_exit=False))
        for r in readers
    ]
    async with upstream(status_handler(503)) as failing, upstream(status_handler(200)) as ok:
        broken = Gateway(
            host_app, config=config(failing.url, ok.url), environ=ENV, telemetry=telemetries[0]
        )
        healthy = Gateway(
            host_app, config=config(ok.url, failing.url), environ=ENV, telemetry=telemetries[1]
        )
        async with client_for(broken) as a, client_for(healthy) as b:
            for _ in range(3):
                assert (await a.get("/v1/models")).status_code == 200
                assert (await b.get("/v1/models")).status_code == 200
        await broken.aclose()
        await healthy.aclose()
    gauge_a = {
        p.attributes["gateway.upstream"]: p.value
        for p in points(readers[0], "gateway.breaker.state")
    }
    gauge_b = {
        p.attributes["gateway.upstream"]: p.value
        for p in points(readers[1], "gateway.breaker.state")
    }
    assert gauge_a == {"primary": 2, "backup": 0}  # open in the gateway whose primary fails
    # The other gateway's breakers never moved: closed, as every upstream is from the start.
    assert gauge_b == {"primary": 0, "backup": 0}
    assert telemetries[0].breaker_states() == {"primary": "open"}
    assert telemetries[1].breaker_states() == {}


async def test_two_gateways_on_one_meter_provider_both_report_their_breakers() -> None:
    # The host's one MeterProvider (the global one, as in any real process): the SDK keeps
    # one `gateway.breaker.state` gauge per meter and drops the callback of a second
    # registration, so the second gateway's open breaker must still reach the gauge.
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    async with upstream(status_handler(503)) as failing, upstream(status_handler(200)) as ok:
        first = Gateway(
            host_app,
            config=config(ok.url, failing.url),
            environ=ENV,
            telemetry=Telemetry(meter_provider=provider),
        )
        second = Gateway(
            host_app,
            config=config(failing.url, ok.url),
            environ=ENV,
            telemetry=Telemetry(meter_provider=provider),
        )
        async with client_for(first) as a, client_for(second) as b:
            for _ in range(3):
                assert (await a.get("/v1/models")).status_code == 200
                assert (await b.get("/v1/models")).status_code == 200
        await first.aclose()
        await second.aclose()
    assert second.services.telemetry.breaker_states() == {"primary": "open"}
    gauge = {
        p.attributes["gateway.upstream"]: p.value for p in points(reader, "gateway.breaker.state")
    }
    assert gauge == {"primary": 2, "backup": 0}  # the worst state of each upstream name


async def test_redis_health_counts_on_the_meter_provider_it_is_given() -> None:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    health = RedisHealth("redis://127.0.0.1:1/0", meter_provider=provider)  # nothing listens
    assert await health.admit("primary") is True  # served on local state
    await health.aclose()
    fallbacks = points(reader, "gateway.health.local_fallbacks")
    assert sum(p.value for p in fallbacks) == 1


async def test_a_budgeted_route_with_no_ledger_fails_closed() -> None:
    async with upstream(status_handler(200)) as p, upstream(status_handler(200)) as b:
        conf = load_config(
            {
                **config(p.url, b.url, budget="acme"),
                "budgets": {"acme": {"limit": 1.0}},
            },
            environ=ENV,
        )
        walker = PlanWalker(host_app, config=conf)
        # The layers composed by hand, with no ledger given to the guard.
        app = RouteResolver(
            BudgetGuard(CredentialInjector(walker, config=conf, environ=ENV), config=conf),
            config=conf,
        )
        async with client_for(app) as client:
            response = await client.get("/v1/models")
        await walker.aclose()
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "budget_unavailable"
    assert p.count == 0 and b.count == 0
