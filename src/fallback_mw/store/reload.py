"""The store reloader: keeps a gateway's RouteTable (file routes merged with store routes)
and its faults current. Started lazily inside the running event loop; a reload that would be
refused leaves the running routes untouched and is logged."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from opentelemetry import metrics

from fallback_mw.config import ConfigError, GatewayConfig
from fallback_mw.routing import RouteTable
from fallback_mw.store.faults import StoreFaults
from fallback_mw.store.model import StoreError
from fallback_mw.store.routes import RouteStore, merge_routes, open_store
from fallback_mw.store_url import parse_store_url

T = TypeVar("T")
logger = logging.getLogger("fallback_mw.store")


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
    ) -> None:
        self.config = config
        self.url = url
        self.environ = os.environ if environ is None else environ
        kind = parse_store_url(url).kind
        # PostgreSQL is told by NOTIFY; the poll is only its safety net.
        self.poll_interval = poll_interval or (1.0 if kind == "sqlite" else 2.0)
        self._store_factory = store_factory
        self._current = RouteTable(config.routes, config.upstreams)
        self.faults = StoreFaults(on_use=self.ensure_started, on_close=self.aclose)
        self._serials: tuple[int | None, int | None] = (None, None)
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.last_refusal: str | None = None
        self.reloads = 0
        meter = (meter_provider or metrics.get_meter_provider()).get_meter("fallback_mw")
        self._refused = meter.create_counter(
            "gateway.store.reload_refused",
            unit="{reload}",
            description="Store changes not applied because the gateway refuses them "
            "(e.g. a route naming an unset credential variable); the running routes stay",
        )

    # --- the gateway's view -------------------------------------------------------------

    def table(self) -> RouteTable:
        self.ensure_started()
        return self._current

    def ensure_started(self) -> None:
        if self._closed:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        task = self._task
        if task is not None and not task.done() and task.get_loop() is loop:
            return
        self._task = loop.create_task(self._run(), name="fallback_mw.store-reload")

    # --- loading ------------------------------------------------------------------------

    def load_initial(self) -> None:
        """Blocking first load at construction: a store the gateway would refuse stops it
        from starting (ConfigError), like a bad config file."""

        async def load() -> None:
            store = self._store_factory(self.url)
            try:
                await self.refresh(store, initial=True)
            finally:
                await store.aclose()

        try:
            run_blocking(load)
        except StoreError as exc:
            raise ConfigError(f"cannot load routes from the store: {exc}") from None

    async def refresh(self, store: RouteStore, *, initial: bool = False) -> None:
        routes_serial, faults_serial = await store.change_serials()
        if routes_serial != self._serials[0]:
            try:
                stored = await store.load_routes()
                merged = await asyncio.to_thread(
                    merge_routes, self.config, stored, environ=self.environ
                )
            except ConfigError as exc:
                if initial:
                    raise
                self.last_refusal = str(exc)
                self._refused.add(1)
                logger.warning("route reload refused, keeping the running routes: %s", exc)
            else:
                self._current = merged.table()
                self.last_refusal = None
                self.reloads += 1
                if not initial:
                    logger.info("routes reloaded from the store (%d routes)", len(merged.routes))
            self._serials = (routes_serial, self._serials[1])
        if faults_serial != self._serials[1]:
            self.faults.update(await store.load_faults())
            self._serials = (self._serials[0], faults_serial)

    async def _run(self) -> None:
        store = self._store_factory(self.url)
        try:
            while not self._closed:
                try:
                    await self.refresh(store)
                except (StoreError, OSError) as exc:
                    logger.warning("store unreachable, keeping current routes and faults: %s", exc)
                except Exception as exc:  # the reloader must outlive any one bad reload
                    logger.warning("store reload failed: %s", type(exc).__name__)
                await store.wait_for_change(self.poll_interval)
        finally:
            with contextlib.suppress(Exception):
                await asyncio.shield(store.aclose())

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
