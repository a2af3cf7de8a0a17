"""Game-day faults backed by the store: a FaultSource whose snapshot the store reloader
refreshes. Expiry is checked at every lookup, so a fault ends on time even between reloads,
against the store's clock (RouteStore.clock) as this process's monotonic clock carries it on
from the last reload: neither this host's clock being off from the others' nor a step of it
(NTP, a VM resumed) moves when a fault ends."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from fallback_mw.faults import UpstreamFault
from fallback_mw.store.model import Fault
from fallback_mw.upstream.blackhole import Blackhole


class FaultSnapshot:
    def __init__(self, faults: Iterable[Fault] = ()) -> None:
        items = list(faults)
        self.upstreams = {f.target: f for f in items if f.scope == "upstream"}
        self.pins = {f.target: f for f in items if f.scope == "route"}

    def upstream_fault(self, upstream: str, now: float) -> UpstreamFault | None:
        fault = self.upstreams.get(upstream)
        if fault is None or not fault.active(now):
            return None
        return fault.kind if fault.kind != "pin" else None

    def active_upstreams(self, now: float) -> frozenset[str]:
        """Upstreams with an active fault (the reloader compares successive sets: an
        upstream that left the set had its fault cleared or expired)."""
        return frozenset(name for name, f in self.upstreams.items() if f.active(now))

    def next_expiry(self, now: float) -> float | None:
        """When the next active upstream fault expires (epoch seconds), if any: its revert
        (the breakers it opened reset) is due then, not at the reloader's next poll."""
        ends = [f.expires_at for f in self.upstreams.values() if f.active(now)]
        return min(ends) if ends else None

    def pinned_candidate(self, route_id: str, now: float) -> str | None:
        fault = self.pins.get(route_id)
        if fault is None or not fault.active(now):
            return None
        return fault.candidate


async def _nothing() -> None:
    return None


class StoreFaults:
    """FaultSource for the walker. `on_use` lets the owner start its reloader lazily, inside
    the running event loop, on first use; `on_close` stops it."""

    def __init__(
        self,
        *,
        on_use: Callable[[], None] | None = None,
        on_close: Callable[[], object] | None = None,
        clock: Callable[[], float] | None = None,
        engine: str = "aiohttp",
    ) -> None:
        self.snapshot = FaultSnapshot()
        self._blackhole = Blackhole(engine)  # its listener starts on the first blackhole
        self._on_use = on_use or (lambda: None)
        self._on_close = on_close
        self._clock = time.monotonic if clock is None else clock
        # The store's clock minus `_clock`: this host's wall clock until a reload reads it.
        self._offset = time.time() - self._clock()

    def update(self, faults: Iterable[Fault], store_now: float | None = None) -> None:
        """The store's faults, read when its clock said `store_now` (when given)."""
        if store_now is not None:
            self.store_clock_read(store_now)
        self.snapshot = FaultSnapshot(faults)  # swapped whole: readers never see a half

    def store_clock_read(self, store_now: float) -> None:
        """The store's clock said `store_now` just now."""
        self._offset = store_now - self._clock()

    def any_active(self) -> bool:
        now = self._now()
        return any(f.active(now) for f in (*self.snapshot.upstreams.values(),
                                           *self.snapshot.pins.values()))  # fmt: skip

    def _now(self) -> float:
        return self._clock() + self._offset

    async def upstream_fault(self, upstream: str) -> UpstreamFault | None:
        self._on_use()
        return self.snapshot.upstream_fault(upstream, self._now())

    async def pinned_candidate(self, route_id: str) -> str | None:
        self._on_use()
        return self.snapshot.pinned_candidate(route_id, self._now())

    def active_upstreams(self) -> frozenset[str]:
        return self.snapshot.active_upstreams(self._now())

    def until_next_expiry(self) -> float | None:
        """Seconds until the next active upstream fault expires, if any."""
        now = self._now()
        expiry = self.snapshot.next_expiry(now)
        return None if expiry is None else max(expiry - now, 0.0)

    def blackhole(self) -> Blackhole:
        return self._blackhole

    async def aclose(self) -> None:
        await self._blackhole.aclose()
        if self._on_close is not None:
            result = self._on_close()
            if hasattr(result, "__await__"):
                await result
