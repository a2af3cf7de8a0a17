"""Gateway: the four layers composed around a host ASGI app."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any, Final, Self

from fallback_mw.budget import Ledger
from fallback_mw.config import ConfigError, GatewayConfig, load_config
from fallback_mw.faults import FaultSource
from fallback_mw.health import HealthState
from fallback_mw.injected import require, require_app, require_client, require_environ
from fallback_mw.layers.guard import BudgetGuard
from fallback_mw.layers.injector import CredentialInjector
from fallback_mw.layers.resolver import RouteResolver
from fallback_mw.layers.walker import PlanWalker
from fallback_mw.python_class import python_class
from fallback_mw.request.abort import break_response
from fallback_mw.request.config_refusal import ConfigRefusal
from fallback_mw.request.context import get_context
from fallback_mw.request.frames import drop_gateway_locals
from fallback_mw.request.types import ASGIApp, Receive, Scope, Send
from fallback_mw.services import (
    NOT_ASYNCIO,
    Services,
    build_services,
    close_when_dropped,
    on_asyncio,
)
from fallback_mw.telemetry import Telemetry
from fallback_mw.upstream import UpstreamClient

logger: Final = logging.getLogger("fallback_mw")


def enable_gateway_loggers() -> None:
    """A `logging.config.dictConfig` without `"disable_existing_loggers": False` (Python's
    default is True) disables every logger that exists by then: the gateway's, once the
    app imported fallback_mw before configuring logging (a FastAPI `main.py` calling
    dictConfig after its imports; Django's settings.LOGGING, applied in django.setup()
    after asgi.py imported fallback_mw). Every line of theirs went nowhere, the outage
    WARNINGs included, where the same app importing fallback_mw later showed them. A
    gateway is built once logging is configured (Starlette builds its middleware at the
    first ASGI call, Django when it loads its settings): its loggers are as if created
    after it."""
    for name, found in list(logging.root.manager.loggerDict.items()):
        if isinstance(found, logging.Logger) and name.partition(".")[0] == "fallback_mw":
            found.disabled = False


async def _serve(self: Gateway, scope: Scope, receive: Receive, send: Send) -> None:
    """`Gateway.__call__`."""
    if self._refusal is not None:
        await self._refusal(scope, receive, send)
        return
    if scope["type"] == "lifespan":
        await self.services.lifespan(self.app, scope, receive, send)
        return
    if scope["type"] != "http":
        await self.app(scope, receive, send)  # websockets: the host app's, untouched
        return
    try:
        await self.resolver(scope, receive, send)
    except Exception as exc:
        drop_gateway_locals(exc)  # the body, the query, the injected credential
        if isinstance(exc, RuntimeError) and get_context(scope) and not on_asyncio():
            # A routed request on hypercorn's trio worker, and no lifespan said so
            # (Starlette runs none for a mounted gateway): "no running event loop"
            # named nothing to fix. The host app's own errors are left as they are.
            raise RuntimeError(NOT_ASYNCIO) from None
        raise
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


@python_class  # weakly referenced (close_when_dropped): a Python class under mypyc
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
    _refusal: ConfigRefusal | None = None

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
        # A wrong object is the host's code, not its configuration: refused here, whatever
        # the configuration (it would fail every request far from the mistake).
        require_app(app, owner="Gateway")
        require_client(client, UpstreamClient, owner="Gateway")
        require(health, HealthState, parameter="health", owner="Gateway")
        require(faults, FaultSource, parameter="faults", owner="Gateway")
        require(ledger, Ledger, parameter="ledger", owner="Gateway")
        require(telemetry, Telemetry, parameter="telemetry", owner="Gateway")
        require_environ(environ, owner="Gateway")
        enable_gateway_loggers()
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
            self._refusal = ConfigRefusal(exc)
            self.config_error = self._refusal.problem
            return
        services = self.services
        # A gateway dropped unclosed while its loop runs (an app built per test and served
        # through httpx.ASGITransport, a django.test.AsyncClient's own middleware) closes
        # its connections on that loop, rather than leaving them to the garbage collector
        # ("Unclosed connector", an error under -W error). Once per gateway, and only one
        # that made all its pieces: what the host handed it is closed when the host says.
        if client is None and health is None and faults is None and ledger is None:
            close_when_dropped(self, services)
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

    # A module function, not an `async def` here: compiled (scripts/compile.py), a Python
    # class's coroutine method is no coroutine function to `inspect`, and an ASGI server
    # would take the gateway for an ASGI 2 app.
    __call__ = _serve

    async def aclose(self) -> None:
        if self.config_error is None:
            await self.services.aclose()

    async def __aenter__(self) -> Self:
        """`async with Gateway(...) as gateway:` (a test, a host without lifespan) starts it
        as the lifespan startup does, a configuration that did not load raising its
        ConfigError here, and closes it at the end (`aclose`)."""
        if self._refusal is not None:
            raise ConfigError(self._refusal.problem)
        self.services.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
