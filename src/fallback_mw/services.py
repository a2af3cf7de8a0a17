"""The shared services one Gateway owns: upstream client, health state, faults, ledger,
route table and telemetry. Built once, from the configuration, in Gateway.__init__."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from fallback_mw.budget import Ledger
from fallback_mw.config import GatewayConfig
from fallback_mw.faults import FaultSource, NoFaults
from fallback_mw.health import AlwaysHealthy, HealthState
from fallback_mw.routing import RouteTable
from fallback_mw.telemetry import Telemetry
from fallback_mw.upstream import UpstreamClient, make_client


@dataclass
class Services:
    client: UpstreamClient
    health: HealthState
    faults: FaultSource
    telemetry: Telemetry
    ledger: Ledger | None
    table: Callable[[], RouteTable]
    # Started on the first request (or lifespan startup), closed on shutdown.
    background: list[Callable[[], object]] = field(default_factory=list)

    async def aclose(self) -> None:
        await self.client.aclose()
        await self.health.aclose()
        await self.faults.aclose()
        if self.ledger is not None:
            await self.ledger.aclose()


def build_services(
    config: GatewayConfig,
    *,
    client: UpstreamClient | None = None,
    health: HealthState | None = None,
    faults: FaultSource | None = None,
    ledger: Ledger | None = None,
    telemetry: Telemetry | None = None,
) -> Services:
    settings = config.gateway
    static = RouteTable(config.routes, config.upstreams)
    return Services(
        client=client or make_client(settings.engine, allow_hosts=settings.allow_hosts),
        health=health or AlwaysHealthy(),
        faults=faults or NoFaults(),
        telemetry=telemetry or Telemetry(),
        ledger=ledger,
        table=lambda: static,
    )
