"""PlanWalker: the fourth layer, the ASGI class. It builds (or is handed) the services,
refuses every request with a configuration that did not load, starts and closes what it
owns, and hands each request's walk to `walk._Walk`. It knows nothing of budgets."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Self

from fallback_mw.capacity import CapacityState
from fallback_mw.config import ConfigError, ConfigSource, as_config
from fallback_mw.config.views import SettingsView
from fallback_mw.credentials import CredentialCache, apply_hygiene
from fallback_mw.faults import FaultSource
from fallback_mw.health import HealthState
from fallback_mw.injected import require, require_app, require_client, require_environ
from fallback_mw.layers.walker.kit import WalkKit
from fallback_mw.layers.walker.via import walker_secret
from fallback_mw.layers.walker.walk import _Walk
from fallback_mw.python_class import python_class
from fallback_mw.request.config_refusal import ConfigRefusal
from fallback_mw.request.context import get_context
from fallback_mw.request.types import ASGIApp, Receive, Scope, Send
from fallback_mw.services import Services, build_services, close_when_dropped
from fallback_mw.shadow import ShadowTraffic
from fallback_mw.telemetry import Telemetry
from fallback_mw.upstream.base import UpstreamClient


async def _serve(self: PlanWalker, scope: Scope, receive: Receive, send: Send) -> None:
    """`PlanWalker.__call__`."""
    if self._refusal is not None:
        await self._refusal(scope, receive, send)
        return
    context = get_context(scope)
    if context is None:
        if scope["type"] == "lifespan" and self._owns_services:
            await self.services.lifespan(self.app, scope, receive, send)
            return
        await self.app(scope, receive, send)
        return
    if context.credentials is None:
        apply_hygiene(
            context, scope.get("headers", ()), self._credentials.credentials(context.upstreams)
        )
    # The resolver owns the request span when it has telemetry; used alone, the walker.
    with self.telemetry.request(context, scope.get("headers", ())):
        await _Walk(self._kit, context, scope, receive, send).run()


@python_class  # weakly referenced: a Python class under mypyc
class PlanWalker:
    _refusal: ConfigRefusal | None = None  # a configuration that did not load

    def __init__(
        self,
        app: ASGIApp,
        /,
        *,
        config: ConfigSource,
        services: Services | None = None,
        environ: Mapping[str, str] | None = None,
        client: UpstreamClient | None = None,
        health: HealthState | None = None,
        faults: FaultSource | None = None,
        telemetry: Telemetry | None = None,
        capacity: CapacityState | None = None,
    ) -> None:
        owner = "PlanWalker"
        require_app(app, owner=owner)
        require(services, Services, parameter="services", owner=owner)
        require_client(client, UpstreamClient, owner=owner)
        require(health, HealthState, parameter="health", owner=owner)
        require(faults, FaultSource, parameter="faults", owner=owner)
        require(telemetry, Telemetry, parameter="telemetry", owner=owner)
        require(capacity, CapacityState, parameter="capacity", owner=owner)
        require_environ(environ, owner=owner)
        self.app = app
        try:
            config = as_config(config, environ=environ)
        except ConfigError as exc:
            self._refusal = ConfigRefusal(exc)
            return
        self.settings = SettingsView(config.gateway)  # read per request: a plain view
        # Built in one place (services.build_services); the walker used alone builds its own,
        # with any of the pieces given here.
        # Services it built are its own to start and close at the lifespan (no Gateway
        # around it does); those it is handed belong to whoever built them.
        self._owns_services = services is None
        self.services = services or build_services(
            config, client=client, health=health, faults=faults, telemetry=telemetry,
            capacity=capacity, environ=environ,
        )  # fmt: skip
        built = (services, client, health, faults, capacity)
        if all(piece is None for piece in built):  # all its own: closed if dropped unclosed
            close_when_dropped(self, self.services)
        self.client: UpstreamClient = self.services.client
        self.health: HealthState = self.services.health
        self.faults: FaultSource = self.services.faults
        self.telemetry: Telemetry = self.services.telemetry
        self.capacity: CapacityState = self.services.capacity
        self.shadows: ShadowTraffic = self.services.shadows
        # Used alone (no injector in front): the same hygiene, from the same function.
        self._credentials = CredentialCache(environ)
        self.via_secret = walker_secret()  # how a request that comes back is known (via.py)
        # What each walk reads of this walker, in one native object (kit.py).
        self._kit = WalkKit(
            self.settings, self.client, self.faults, self.health, self.capacity,
            self.telemetry, self.shadows, self.via_secret,
        )  # fmt: skip

    # A module function, not an `async def` here: compiled (scripts/compile.py), a Python
    # class's coroutine method is no coroutine function to `inspect`, and uvicorn or
    # hypercorn serving the walker directly took it for an ASGI 2 app (every request a 500).
    __call__ = _serve

    async def aclose(self) -> None:
        """Close the services it built (handed ones are their builder's to close)."""
        if self._refusal is None and self._owns_services:
            await self.services.aclose()

    async def __aenter__(self) -> Self:
        """`async with PlanWalker(...) as walker:` starts the services it built as the
        lifespan startup does (a configuration that did not load raises its ConfigError
        here) and closes them at the end."""
        if self._refusal is not None:
            raise ConfigError(self._refusal.problem)
        if self._owns_services:
            self.services.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
