"""The shared services one Gateway owns: upstream client, health state, faults, ledger,
route table and telemetry. Built once, from the configuration, in Gateway.__init__."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio

from fallback_mw.budget import Ledger
from fallback_mw.capacity import CapacityState, create_capacity
from fallback_mw.config import GatewayConfig
from fallback_mw.faults import FaultSource, NoFaults
from fallback_mw.health import HealthState, create_health
from fallback_mw.request.types import ASGIApp, Message, Receive, Scope, Send
from fallback_mw.routing import RouteTable
from fallback_mw.shadow import ShadowTraffic
from fallback_mw.store.ledgers import open_ledger
from fallback_mw.telemetry import Telemetry
from fallback_mw.upstream import UpstreamClient, make_client

# README "It runs on asyncio".
NOT_ASYNCIO = (
    "fallback_mw runs on asyncio only, and this server's event loop is not asyncio's (trio is "
    "not supported): run the server on asyncio (hypercorn's default worker class, uvicorn)"
)


def on_asyncio() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


if TYPE_CHECKING:
    from opentelemetry.metrics import MeterProvider

    from fallback_mw.store.reload import StoreRuntime


@dataclass
class Services:
    client: UpstreamClient
    health: HealthState
    faults: FaultSource
    telemetry: Telemetry
    ledger: Ledger | None
    table: Callable[[], RouteTable]
    capacity: CapacityState  # capacity and repeat-budget counts
    shadows: ShadowTraffic  # shadow copies in flight
    store: StoreRuntime | None = None  # route/fault reloader when gateway.store is set

    def start(self) -> None:
        """Lifespan startup: the route reloader starts (else the first request starts it)
        and the shared state tries Redis (an unusable one is said now, not at the first
        request)."""
        # anyio (4.x) imports its parts on first use, and an import opens files: done now,
        # not by the first request, which may come when the host is out of descriptors (a
        # burst under `ulimit -n`), where that import failing made the request a bare 500.
        anyio.current_time()  # its asyncio backend (the SQLite ledger's worker thread)
        _ = anyio.CancelScope  # the shields of every layer's cleanup
        # A startup after a shutdown (a host running the lifespan again: Starlette's
        # TestClient, once per `with` block over one app) opens what that shutdown closed
        # for good; the rest opens again on use.
        self.shadows.reopen()
        if self.store is not None:
            self.store.start()
        self.health.start()

    async def lifespan(self, app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
        """Run `app`'s lifespan with these services started at its startup and closed at its
        shutdown: the Gateway's, and the PlanWalker's when used alone with services it built
        (nobody else holds them to close). Not on an asyncio loop (hypercorn's trio worker):
        the startup fails saying so, rather than every routed request failing."""
        if not on_asyncio():
            await receive()  # lifespan.startup
            await send({"type": "lifespan.startup.failed", "message": NOT_ASYNCIO})
            raise RuntimeError(NOT_ASYNCIO) from None
        asked = stopping = closed = False

        async def close() -> None:
            nonlocal closed
            if not closed:
                closed = True
                await self.aclose()

        async def receive_wrapper() -> Message:
            nonlocal asked, stopping
            asked = True
            message = await receive()
            stopping = message["type"] == "lifespan.shutdown"
            return message

        async def send_wrapper(message: Message) -> None:
            kind = message["type"]
            if kind == "lifespan.startup.complete":
                self.start()  # the store's reloader, the shared state's check
            elif kind in _LIFESPAN_ENDS:
                # The host's shutdown done, or failed (its own code raised), or its startup
                # failed (the server exits): the gateway closes all the same, writing what
                # its ledger still holds, before the server is told.
                await close()
            await send(message)

        try:
            await app(scope, receive_wrapper, send_wrapper)
        except Exception as exc:
            if asked:
                if stopping:  # it raised at shutdown without saying so: closed all the same
                    await close()
                raise exc  # the host app's own startup or shutdown failed: the server says so
        else:
            if asked:
                return
        # A host app that speaks no lifespan at all (Django refuses the scope before reading
        # a message; a bare app returns at once for any scope but "http"): answered here
        # alone, so the gateway starts at the server's startup, the server logs no
        # "lifespan unsupported", and the gateway closes at shutdown.
        await self._own_lifespan(receive, send)

    async def _own_lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def aclose(self) -> None:
        await self.shadows.aclose()  # before the client their connections belong to
        if self.store is not None:
            await self.store.aclose()
        await self.client.aclose()
        await self.health.aclose()
        await self.capacity.aclose()
        await self.faults.aclose()
        if self.ledger is not None:
            await self.ledger.aclose()


# What a host app sends when its lifespan is over: the gateway closes then, whichever.
_LIFESPAN_ENDS = frozenset(
    {"lifespan.shutdown.complete", "lifespan.shutdown.failed", "lifespan.startup.failed"}
)


def build_services(
    config: GatewayConfig,
    *,
    client: UpstreamClient | None = None,
    health: HealthState | None = None,
    faults: FaultSource | None = None,
    ledger: Ledger | None = None,
    telemetry: Telemetry | None = None,
    environ: Mapping[str, str] | None = None,
    meter_provider: MeterProvider | None = None,
    capacity: CapacityState | None = None,
) -> Services:
    settings = config.gateway
    static = RouteTable(config.routes, config.upstreams)
    table: Callable[[], RouteTable] = lambda: static  # noqa: E731
    runtime: StoreRuntime | None = None
    telemetry = telemetry or Telemetry()
    if settings.store:
        from fallback_mw.store.reload import StoreRuntime

        # File routes merged with the store's, reloaded in the background; faults too. Its
        # counter goes where the gateway's other instruments go.
        runtime = StoreRuntime(
            config,
            settings.store,
            environ=environ,
            meter_provider=meter_provider or telemetry.meter_provider,
            series_at_zero=telemetry.series_at_zero,
            ledger_schema=ledger is None,
        )
        runtime.load_initial()
        table = runtime.table
    health = health or create_health(
        settings.state,
        settings.breaker,
        on_transition=telemetry.breaker_state,
        on_observed=telemetry.breaker_seen,
        meter_provider=telemetry.meter_provider,
        pools={name: u.credential_envs for name, u in config.upstreams.items()},
        series_at_zero=telemetry.series_at_zero,
    )
    if runtime is not None:  # a fault that ends resets the breakers its outcomes opened
        runtime.on_fault_cleared = health.reset_fault
        runtime.on_upstream_moved = health.forget  # a breaker judged the old url
        # An upstream a reload removes leaves the breaker gauge.
        telemetry.only_upstreams(runtime.upstream_names)
        runtime.on_routes_loaded = telemetry.routes_loaded
    else:  # every upstream of the file is in the breaker gauge from the start
        names = tuple(config.upstreams)
        telemetry.only_upstreams(lambda: names)
    # Each route's fallbacks are counted from 0 (a reload tells of its new routes too).
    telemetry.routes_loaded(runtime.routes() if runtime is not None else static.routes)
    client = client or make_client(
        settings.engine, allow_hosts=settings.allow_hosts, ca_file=settings.ca_file
    )
    faults = faults or (runtime.faults if runtime is not None else NoFaults())
    capacity = capacity or create_capacity(
        settings.state, settings.repeat_budget, health=health,
        meter_provider=telemetry.meter_provider, series_at_zero=telemetry.series_at_zero,
    )  # fmt: skip
    if runtime is not None:
        runtime.on_upstreams_loaded = _keep_only(health, capacity)
    shadows = ShadowTraffic(
        client=client, health=health, capacity=capacity, faults=faults, telemetry=telemetry,
        deadline_ms=settings.deadline_ms, max_response_body=settings.max_response_body,
    )  # fmt: skip
    return Services(
        client=client,
        health=health,
        faults=faults,
        telemetry=telemetry,
        ledger=ledger if ledger is not None else open_ledger(settings.store),
        table=table,
        capacity=capacity,
        store=runtime,
        shadows=shadows,
    )


def _keep_only(*states: object) -> Callable[[Collection[str]], None]:
    """What a store reload tells the state kept per upstream name (breakers, pools,
    capacity windows): the names its table still has, so a removed upstream's is not kept
    for the life of the process. A host's own state without `keep_only` keeps its own."""

    def keep_only(upstreams: Collection[str]) -> None:
        for state in states:
            keep = getattr(state, "keep_only", None)
            if keep is not None:
                keep(upstreams)

    return keep_only


_closing: set[asyncio.Task[None]] = set()


def close_when_dropped(owner: object, services: Services) -> None:
    """When `owner` (a Gateway, a PlanWalker used alone) is collected unclosed while an
    event loop runs (an app built per test and served through httpx.ASGITransport, a
    django.test.AsyncClient's own middleware), close `services` on that loop rather than
    leave their connections to the garbage collector ("Unclosed connector", an error under
    -W error). Only for services the owner built whole: what a host handed it is the
    host's to close. Once per owner, never per request."""
    weakref.finalize(owner, _close_dropped, services).atexit = False


def _close_dropped(services: Services) -> None:
    """Close `services` on the loop running here (the task holds them until then). No
    loop running: nothing can close them now (a loop that ended closed them already,
    loops.CloseAtLoopEnd)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    closing = loop.create_task(services.aclose())
    _closing.add(closing)
    closing.add_done_callback(_closing.discard)
