"""Gateway: the four layers composed around a host ASGI app."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from typing import Any

from fallback_mw.budget import Ledger
from fallback_mw.config import ConfigError, GatewayConfig, load_config
from fallback_mw.faults import FaultSource
from fallback_mw.health import HealthState
from fallback_mw.layers.guard import BudgetGuard
from fallback_mw.layers.injector import CredentialInjector
from fallback_mw.layers.resolver import RouteResolver
from fallback_mw.layers.walker import PlanWalker
from fallback_mw.request.abort import break_response
from fallback_mw.request.context import get_context
from fallback_mw.request.types import ASGIApp, Receive, Scope, Send
from fallback_mw.services import Services, build_services
from fallback_mw.telemetry import Telemetry
from fallback_mw.upstream import UpstreamClient

logger = logging.getLogger("fallback_mw")


class Gateway:
    """`Gateway(app, /, *, config)`: requests matching a route walk its plan; every other
    request goes to `app` untouched. `config` is a GatewayConfig, a path or a dict.

    A configuration that does not load never serves, whichever host runs the gateway and
    however late it builds its middleware (Starlette builds it on the first ASGI call, and
    uvicorn's default lifespan mode swallows an exception raised there): the constructor
    keeps the problem in `config_error` (it does not raise); the lifespan startup then
    fails with it (uvicorn, hypercorn and granian stop, printing it), and under a host that
    runs no lifespan every request is a local 503 `config_error` naming it (a WebSocket
    handshake is refused), with one ERROR log line at the first request."""

    config: GatewayConfig
    services: Services
    resolver: RouteResolver
    config_error: str | None = None
    _config_error_logged = False

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
        try:
            self.config = load_config(config, environ=environ)
            # Building the services merges the store's routes: refused like the file's.
            self.services = build_services(
                self.config,
                client=client,
                health=health,
                faults=faults,
                ledger=ledger,
                telemetry=telemetry,
                environ=environ,
            )
        except ConfigError as exc:
            # Said once: by the server as the lifespan startup failure, else at the first
            # request (a host without lifespan), never per request.
            self.config_error = f"fallback_mw configuration error: {exc}"
            return
        services = self.services
        walker = PlanWalker(app, config=self.config, services=services, environ=environ)
        injector = CredentialInjector(walker, config=self.config, environ=environ)
        guard = BudgetGuard(
            injector, config=self.config, ledger=services.ledger, telemetry=services.telemetry
        )
        self.resolver = RouteResolver(
            guard,
            config=self.config,
            table=services.table,
            telemetry=services.telemetry,
            ledger=services.ledger,
            environ=environ,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.config_error is not None:
            if scope["type"] != "lifespan" and not self._config_error_logged:
                self._config_error_logged = True
                logger.error("%s; every request is answered 503 config_error", self.config_error)
            await _refuse(self.config_error, scope, receive, send)
            return
        if scope["type"] == "lifespan":
            await self.services.lifespan(self.app, scope, receive, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)  # websockets: the host app's, untouched
            return
        await self.resolver(scope, receive, send)
        context = get_context(scope)
        if (
            context is not None
            and context.committed
            and not context.completed
            and not context.client_disconnected
        ):
            # A failure after the commit point: the client must see a broken response,
            # now, under whichever server runs us (request/abort.py).
            await break_response(send, scope)

    async def aclose(self) -> None:
        if self.config_error is None:
            await self.services.aclose()


async def _refuse(problem: str, scope: Scope, receive: Receive, send: Send) -> None:
    """What a gateway whose configuration did not load answers, whatever is asked."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.failed", "message": problem})
                # Then end the lifespan by raising, as Starlette's router does: a server
                # stops on the message alone, but an in-process harness (Starlette's
                # TestClient) waits for the app to end it, and reports what it raised.
                raise ConfigError(problem)
            if message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    elif scope["type"] == "websocket":
        await receive()  # websocket.connect
        await send({"type": "websocket.close", "code": 1011})
    elif scope["type"] == "http":
        body = json.dumps(
            {"error": {"type": "gateway_error", "code": "config_error", "message": problem,
                       "route": None, "attempts": 0, "rule": "config"}},
            separators=(",", ":"),
        ).encode()  # fmt: skip
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"cache-control", b"no-store"),
        ]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})
