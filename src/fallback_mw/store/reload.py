"""The store reloader: keeps a gateway's RouteTable (file routes merged with store routes)
and its faults current.

One task per gateway, started once inside the running event loop: from the ASGI lifespan
startup when the server sends one, else by the first request (`table()` only checks a
flag). It outlives store outages: a failed reload (or wait) backs off, doubling up to
`MAX_BACKOFF` seconds, and retries with a fresh connection; the outage is logged once when
it starts and once when it ends (`store.outage.OutageLog`), never per request, never as a
traceback. `refresh()` runs under a lock, so overlapping refreshes apply (or refuse) one
change once. A reload that would be refused leaves the running routes untouched and is
logged and counted."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Any, TypeVar

from opentelemetry import metrics

from fallback_mw.config import ConfigError, GatewayConfig, RouteConfig
from fallback_mw.extras import package_version
from fallback_mw.routing import RouteTable
from fallback_mw.store.faults import StoreFaults
from fallback_mw.store.ledgers.schema import COMPONENT as LEDGER_COMPONENT
from fallback_mw.store.ledgers.schema import SchemaTooNew
from fallback_mw.store.ledgers.schema import check_version as check_ledger_version
from fallback_mw.store.model import StoreError
from fallback_mw.store.outage import OutageLog
from fallback_mw.store.routes import MergedRoutes, RouteStore, merge_routes, open_store
from fallback_mw.store_url import parse_store_url

T = TypeVar("T")
logger = logging.getLogger("fallback_mw.store")

FIRST_BACKOFF = 0.25  # seconds before the first retry after a failed reload
MAX_BACKOFF = 5.0
EXPIRY_MARGIN_S = 0.01  # past a fault's expiry: the fault reads expired when the reloader wakes


def run_blocking(factory: Callable[[], Awaitable[T]]) -> T:
    """Run a coroutine to completion from synchronous code, even when the calling thread
    already runs an event loop (Gateway.__init__ inside an async app): a private loop in a
    short-lived thread."""
    result: dict[str, Any] = {}

    def target() -> None:
        async def main() -> T:
            return await factory()

        try:
            result["value"] = asyncio.run(main())
        except BaseException as exc:
            result["error"] = exc

    thread = threading.Thread(target=target, name="fallback_mw.store-load")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    value: T = result["value"]
    return value


async def merged_routes(
    store: RouteStore, config: GatewayConfig, environ: Mapping[str, str] | None
) -> MergedRoutes:
    """The table a gateway's reload takes from `store`: its routes merged with the file's
    by the loader's rules (`environ`: the variables a store route names must be set in it).
    ConfigError, naming the route and why, when the gateway would refuse the store and
    keep its running routes. The reloader's decision, and the admin CLI's word on it."""
    return (await merged_table(store, config, environ))[0]


async def merged_table(
    store: RouteStore, config: GatewayConfig, environ: Mapping[str, str] | None
) -> tuple[MergedRoutes, RouteTable]:
    """`merged_routes` and its RouteTable, both built off the event loop: at 2,000 routes
    they take a second of CPU, which every request in flight waited for on each reload."""
    stored = await store.load_routes()

    def build() -> tuple[MergedRoutes, RouteTable]:
        merged = merge_routes(config, stored, environ=environ)
        return merged, merged.table()

    return await asyncio.to_thread(build)


class StoreRuntime:
    def __init__(
        self,
        config: GatewayConfig,
        url: str,
        *,
        environ: Mapping[str, str] | None = None,
        poll_interval: float | None = None,
        store_factory: Callable[[str], RouteStore] = open_store,
        meter_provider: metrics.MeterProvider | None = None,
        series_at_zero: Callable[[metrics.Counter], None] | None = None,
        ledger_schema: bool = False,
    ) -> None:
        self.config = config
        # The store's ledger is the gateway's (no ledger handed in): its schema is checked
        # with the first load (load_initial).
        self._ledger_schema = ledger_schema
        self.url = url
        self.environ = os.environ if environ is None else environ
        kind = parse_store_url(url).kind
        # PostgreSQL is told by NOTIFY; the poll is only its safety net.
        self.poll_interval = poll_interval or (1.0 if kind == "sqlite" else 2.0)
        self._store_factory = store_factory
        self._current = RouteTable(config.routes, config.upstreams)
        self.faults = StoreFaults(
            on_use=self.ensure_started, on_close=self.aclose, engine=config.gateway.engine
        )
        self._serials: tuple[int | None, int | None] = (None, None)
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._lock: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None
        self._outage = OutageLog(logger, "route store")
        # The revert restores (SPEC §12): told of each upstream whose fault went away
        # (cleared in the store, or expired); the gateway resets the breakers its outcomes
        # opened (HealthState.reset_fault).
        self.on_fault_cleared: Callable[[str], Awaitable[None]] | None = None
        self._faulted: frozenset[str] = frozenset()
        # A reload that points an upstream name at another url (`routes set-fallback`):
        # its breaker, kept for the old url, is forgotten (HealthState.forget).
        self.on_upstream_moved: Callable[[str, str], Awaitable[None]] | None = None
        # Told the upstream names of each table loaded: the state kept per upstream in this
        # process forgets the others (MemoryHealth.keep_only, MemoryCapacity.keep_only).
        self.on_upstreams_loaded: Callable[[Collection[str]], None] | None = None
        # Told the routes of each table loaded after the first (Telemetry.routes_loaded).
        self.on_routes_loaded: Callable[[tuple[RouteConfig, ...]], None] | None = None
        self._urls = {name: u.url for name, u in config.upstreams.items()}
        self.last_refusal: str | None = None
        self.reloads = 0
        meter = (meter_provider or metrics.get_meter_provider()).get_meter(
            "fallback_mw", package_version()
        )
        self._refused = meter.create_counter(
            "gateway.store.reload_refused",
            unit="{reload}",
            description="Store changes not applied because the gateway refuses them "
            "(e.g. a route naming an unset credential variable); the running routes stay",
        )
        # At 0 from the start, so the first refusal is an increase (the gateway's telemetry
        # adds it again once a host's SDK installed later collects).
        if series_at_zero is None:
            self._refused.add(0)
        else:
            series_at_zero(self._refused)

    # --- the gateway's view -------------------------------------------------------------

    def table(self) -> RouteTable:
        self.ensure_started()
        return self._current

    def current(self) -> RouteTable:
        """The running table, without starting the reloader (a caller on a throwaway event
        loop, such as Django's middleware under WSGI, must not start one there)."""
        return self._current

    def routes(self) -> tuple[RouteConfig, ...]:
        """The running routes (file and store), without starting the reloader."""
        return self._current.routes

    def upstream_names(self) -> Collection[str]:
        """The upstreams of the running routes (file and store); safe from any thread."""
        return self._current.upstreams.keys()

    def start(self) -> None:
        """A lifespan startup, the first or one after a shutdown closed the reloader."""
        self._closed = False
        self.ensure_started()

    def ensure_started(self) -> None:
        """Start the reloader once (lifespan startup, or the first request). The task never
        ends on its own while the gateway is open; only a new event loop (the old one gone)
        starts another."""
        if self._closed:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        task = self._task
        if task is not None and task.get_loop() is loop:
            return
        self._task = loop.create_task(self._run(), name="fallback_mw.store-reload")

    # --- loading ------------------------------------------------------------------------

    def load_initial(self) -> None:
        """Blocking first load at construction: a store the gateway would refuse stops it
        from starting (ConfigError), like a bad config file."""

        async def load() -> int:
            store = self._store_factory(self.url)
            try:
                await self.refresh(store, initial=True)
                # The ledger opens on a first request: one a newer version migrated would
                # refuse every budgeted request and drop every usage record. Refused here,
                # as a newer route schema is.
                return await store.schema_version(LEDGER_COMPONENT) if self._ledger_schema else 0
            finally:
                await store.aclose()

        try:
            check_ledger_version(run_blocking(load))
        except StoreError as exc:
            raise ConfigError(f"cannot load routes from the store: {exc}") from None
        except SchemaTooNew as exc:
            raise ConfigError(f"cannot use the store's budget ledger: {exc}") from None

    def _refresh_lock(self) -> asyncio.Lock:
        # One lock per event loop (the first load runs in a private one).
        loop = asyncio.get_running_loop()
        if self._lock is None or self._lock[0] is not loop:
            self._lock = (loop, asyncio.Lock())
        return self._lock[1]

    async def refresh(self, store: RouteStore, *, initial: bool = False) -> None:
        """Apply what changed in the store since the last refresh; one at a time."""
        async with self._refresh_lock():
            await self._refresh(store, initial=initial)

    async def _refresh(self, store: RouteStore, *, initial: bool) -> None:
        routes_serial, faults_serial = await store.change_serials()
        if routes_serial != self._serials[0]:
            try:
                merged, table = await merged_table(store, self.config, self.environ)
            except ConfigError as exc:
                if initial:
                    raise
                self.last_refusal = str(exc)
                self._refused.add(1)
                logger.warning("route reload refused, keeping the running routes: %s", exc)
            else:
                self._current = table
                self.last_refusal = None
                if self.on_routes_loaded is not None:
                    self.on_routes_loaded(self._current.routes)
                await self._forget_moved(initial=initial)
                if self.on_upstreams_loaded is not None:
                    self.on_upstreams_loaded(frozenset(self._current.upstreams))
                self.reloads += 1
                if not initial:
                    logger.info("routes reloaded from the store (%d routes)", len(merged.routes))
            self._serials = (routes_serial, self._serials[1])
        if faults_serial != self._serials[1]:
            unreadable: list[str] = []
            faults = await store.load_faults(unreadable)
            self.faults.update(faults, await store.clock())
            if unreadable:
                logger.warning(
                    "fault rows skipped, not faults `faults set` writes (written by hand?): %s",
                    ", ".join(unreadable),
                )
            self._serials = (self._serials[0], faults_serial)
        elif self.faults.any_active():
            # While a fault is set, the store's clock is read at every wake (a poll, or the
            # expiry): the monotonic clock that carries it stops while this host is
            # suspended (a VM paused), and a fault would outlast its end by that pause.
            self.faults.store_clock_read(await store.clock())

    async def _run(self) -> None:
        store: RouteStore | None = None
        backoff = FIRST_BACKOFF
        try:
            while not self._closed:
                try:
                    if store is None:
                        store = self._store_factory(self.url)
                    await self.refresh(store)
                    self._outage.recovered()
                    await self.revert_cleared_faults()
                    await store.wait_for_change(self._next_wait())
                    backoff = FIRST_BACKOFF
                    continue
                except (StoreError, OSError) as exc:
                    # The message is the store's own, with the URL's password redacted.
                    self._outage.failed(str(exc), "keeping the current routes and faults")
                except Exception as exc:  # the reloader must outlive any one bad reload
                    self._outage.failed(type(exc).__name__, "keeping the current routes and faults")
                await self.revert_cleared_faults()  # a fault's expiry needs no store
                # Retry with a fresh connection, backing off while the store stays away.
                if store is not None:
                    await _close_quietly(store)
                    store = None
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF)
        finally:
            if store is not None:
                await _close_quietly(store)

    def _next_wait(self) -> float:
        """The poll interval, or less: until just after the next fault expiry, whose revert
        (SPEC §12: the breakers it opened reset) is due then. An expiry sends no store
        notification, so on PostgreSQL it waited up to the 2 s safety-net poll."""
        left = self.faults.until_next_expiry()
        if left is None:
            return self.poll_interval
        return min(self.poll_interval, left + EXPIRY_MARGIN_S)

    async def _forget_moved(self, *, initial: bool) -> None:
        """Each upstream name whose url differs from the one last loaded under that name
        (also one removed and added again at another url) gets a fresh breaker: the old one
        judged another origin. Added again at the same url, the shared (Redis) breaker is
        kept (docs/health.md)."""
        moved = []
        for name, upstream in self._current.upstreams.items():
            if self._urls.get(name, upstream.url) != upstream.url:
                moved.append((name, upstream.url))
            self._urls[name] = upstream.url
        if initial or self.on_upstream_moved is None:
            return
        for name, url in moved:
            try:
                await self.on_upstream_moved(name, url)
            except Exception as exc:  # one failed reset must not stop the reloader
                logger.warning("breaker reset of %s failed: %s", name, type(exc).__name__)
            else:
                logger.info("upstream %s now has another url: its breaker starts closed", name)

    async def revert_cleared_faults(self) -> None:
        """Compare the upstreams under an active fault with the last check's: for each one
        whose fault went away (`faults clear`, its expiry, a game day's end or abort), tell
        `on_fault_cleared`, so the breakers that fault opened close at once."""
        active = self.faults.active_upstreams()
        cleared, self._faulted = self._faulted - active, active
        if not cleared or self.on_fault_cleared is None:
            return
        for upstream in sorted(cleared):
            try:
                await self.on_fault_cleared(upstream)
            except Exception as exc:  # one failed reset must not stop the reloader
                logger.warning("fault revert on %s failed: %s", upstream, type(exc).__name__)
            else:
                logger.info("fault on upstream %s ended: breakers it opened reset", upstream)

    async def aclose(self) -> None:
        self._closed = True
        task, self._task = self._task, None
        if task is None or task.done():
            return
        task.cancel()
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            return
        if task.get_loop() is running:
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def _close_quietly(store: RouteStore) -> None:
    with contextlib.suppress(Exception):
        await asyncio.shield(store.aclose())
