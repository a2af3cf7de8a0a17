"""The request, attempt and fallback counters are tallied per attribute set on the request
path and added to the SDK's counters when the metrics are collected (telemetry/
instruments.Tally): what a reader collects is what one `add` per request gave, with
several gateways on one meter provider, a gateway dropped before the collection, and a
reader collecting from its own thread while requests run."""

from __future__ import annotations

import asyncio
import gc
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.metrics import Counter, MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from fallback_mw import Gateway
from fallback_mw.health import AlwaysHealthy
from fallback_mw.telemetry import Telemetry
from tests.helpers import client_for
from tests.upstreams import host_app, status_handler, upstream

pytestmark = pytest.mark.anyio

ENV = {"PRIMARY_KEY": "sk-primary-0001", "BACKUP_KEY": "sk-backup-0002"}


def config(primary: str, backup: str) -> dict[str, Any]:
    return {
        "upstreams": {
            "primary": {"url": primary, "auth_env": "PRIMARY_KEY"},
            "backup": {"url": backup, "auth_env": "BACKUP_KEY"},
        },
        "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary", "backup"], "retries": 1}],
    }


@pytest.fixture
def provider() -> Iterator[tuple[MeterProvider, InMemoryMetricReader]]:
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader], shutdown_on_exit=False)
    yield meter_provider, reader
    meter_provider.shutdown()


def totals(reader: InMemoryMetricReader) -> dict[str, dict[tuple[Any, ...], int]]:
    """Each counter's points as {sorted attributes: value}."""
    found: dict[str, dict[tuple[Any, ...], int]] = {}
    data = reader.get_metrics_data()
    assert data is not None
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name in ("gateway.requests", "gateway.attempts", "gateway.fallbacks"):
                    points = found.setdefault(metric.name, {})
                    for point in metric.data.data_points:
                        if point.value:  # not a series exported at 0 from the start
                            points[tuple(sorted(point.attributes.items()))] = point.value
    return found


async def test_counts_reach_the_counters_at_collection_not_one_add_per_request(
    provider: tuple[MeterProvider, InMemoryMetricReader], monkeypatch: pytest.MonkeyPatch
) -> None:
    meter_provider, reader = provider
    adds: list[str] = []
    original = Counter.add

    def counted(self: Counter, amount: float, *args: Any, **kwargs: Any) -> None:
        adds.append(self.name)
        original(self, amount, *args, **kwargs)

    monkeypatch.setattr(Counter, "add", counted)
    telemetry = Telemetry(meter_provider=meter_provider)
    async with upstream(status_handler(503)) as p, upstream(status_handler(200)) as b:
        gateway = Gateway(
            host_app, config=config(p.url, b.url), environ=ENV, telemetry=telemetry,
            health=AlwaysHealthy(),  # every request fails over: no breaker opens
        )  # fmt: skip
        started = len(adds)
        async with client_for(gateway) as client:
            for _ in range(12):
                assert (await client.get("/v1/models")).status_code == 200
        await gateway.aclose()
    # Twelve requests, each failing over: no counter add while they ran...
    assert adds[started:] == []
    found = totals(reader)
    # ... and every one of them counted once the reader collected: one add per attribute set.
    requests = found["gateway.requests"]
    assert list(requests.values()) == [12]
    assert dict(next(iter(requests))) == {
        "gateway.route.id": "chat",
        "gateway.outcome": "served",
        "gateway.fallback": True,
        "gateway.canary": False,
        "gateway.fault": False,
        "gateway.candidate": "backup",
        "http.response.status_code": 200,
    }
    attempts = {
        dict(k)["http.response.status_code"]: v for k, v in found["gateway.attempts"].items()
    }
    assert attempts == {503: 12, 200: 12}
    assert list(found["gateway.fallbacks"].values()) == [12]
    # At collection: one add per attribute set (the series at 0 were added at the start).
    tallied = ("gateway.requests", "gateway.attempts", "gateway.fallbacks")
    assert sorted(a for a in adds[started:] if a in tallied) == [
        "gateway.attempts", "gateway.attempts", "gateway.fallbacks", "gateway.requests",
    ]  # fmt: skip
    # Collected again with nothing new: the same cumulative counts, nothing added twice.
    assert totals(reader) == found


async def test_two_gateways_on_one_provider_count_every_request_one_dropped_included(
    provider: tuple[MeterProvider, InMemoryMetricReader],
) -> None:
    # The SDK keeps the first gateway's callback registration only; the second gateway's
    # counts are added all the same, also after the second gateway is gone.
    meter_provider, reader = provider
    async with upstream(status_handler(200)) as p, upstream(status_handler(200)) as b:
        first = Gateway(
            host_app, config=config(p.url, b.url), environ=ENV,
            telemetry=Telemetry(meter_provider=meter_provider),
        )  # fmt: skip
        second = Gateway(
            host_app, config=config(p.url, b.url), environ=ENV,
            telemetry=Telemetry(meter_provider=meter_provider),
        )  # fmt: skip
        for gateway, count in ((first, 3), (second, 5)):
            async with client_for(gateway) as client:
                for _ in range(count):
                    assert (await client.get("/v1/models")).status_code == 200
            await gateway.aclose()
        del second, gateway
        gc.collect()
        found = totals(reader)
        assert list(found["gateway.requests"].values()) == [8]
        assert list(found["gateway.attempts"].values()) == [8]
        await first.aclose()


async def test_a_reader_collecting_from_its_thread_while_requests_run_loses_no_count(
    provider: tuple[MeterProvider, InMemoryMetricReader],
) -> None:
    meter_provider, reader = provider
    stop = threading.Event()
    collections = 0

    def collect() -> None:
        nonlocal collections
        while not stop.is_set():
            reader.get_metrics_data()
            collections += 1

    collector = threading.Thread(target=collect)
    async with upstream(status_handler(200)) as p, upstream(status_handler(200)) as b:
        gateway = Gateway(
            host_app, config=config(p.url, b.url), environ=ENV,
            telemetry=Telemetry(meter_provider=meter_provider),
        )  # fmt: skip
        collector.start()
        try:
            async with client_for(gateway) as client:

                async def some(n: int) -> None:
                    for _ in range(n):
                        assert (await client.get("/v1/models")).status_code == 200

                await asyncio.gather(*(some(25) for _ in range(8)))
        finally:
            stop.set()
            await asyncio.to_thread(collector.join)
        await gateway.aclose()
    assert collections > 1  # the reader did collect while the requests ran
    found = totals(reader)
    assert list(found["gateway.requests"].values()) == [200]
    assert list(found["gateway.attempts"].values()) == [200]
