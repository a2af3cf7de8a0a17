"""Gateway: the four layers composed around a host ASGI app."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from fallback_mw.budget import Ledger
from fallback_mw.config import GatewayConfig, load_config
from fallback_mw.faults import FaultSource
from fallback_mw.health import HealthState
from fallback_mw.layers.guard import BudgetGuard
from fallback_mw.layers.injector import CredentialInjector
from fallback_mw.layers.resolver import RouteResolver
from fallback_mw.layers.walker import PlanWalker
from fallback_mw.request.types import ASGIApp, Message, Receive, Scope, Send
from fallback_mw.services import Services, build_services
from fallback_mw.telemetry import Telemetry
from fallback_mw.upstream import UpstreamClient


class Gateway:
    """`Gateway(app, /, *, config)`: requests matching a route walk its plan; every other
    request goes to `app` untouched. `config` is a GatewayConfig, a path or a dict."""

    def __init__(
        self,
        app: ASGIApp,
        /,
        *,
        config: GatewayConfig | Mapping[str, Any] | str | os.PathLike[str],
        environ: Mapping[str, str] | None = None,
        client: UpstreamClient | None = None,
        health: HealthState | None = None,
        faults: FaultSource | None = None,
        ledger: Ledger | None = None,
        telemetry: Telemetry | None = None,
    ) -> None:
        self.app = app
        self.config = load_config(config, environ=environ)
        self.services: Services = build_services(
            self.config,
            client=client,
            health=health,
            faults=faults,
            ledger=ledger,
            telemetry=telemetry,
            environ=environ,
        )
        services = self.services
        walker = PlanWalker(app, config=self.config, services=services, environ=environ)
        injector = CredentialInjector(walker, config=self.config, environ=environ)
        guard = BudgetGuard(
            injector, config=self.config, ledger=services.ledger, telemetry=services.telemetry
        )
        self.resolver = RouteResolver(
            guard, config=self.config, table=services.table, telemetry=services.telemetry
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(scope, receive, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)  # websockets: the host app's, untouched
            return
        await self.resolver(scope, receive, send)

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_wrapper(message: Message) -> None:
            if message["type"] == "lifespan.shutdown.complete":
                await self.aclose()
            await send(message)

        await self.app(scope, receive, send_wrapper)

    async def aclose(self) -> None:
        await self.services.aclose()
