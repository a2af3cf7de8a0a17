"""Connection caps: at most `max_connections` requests in flight per upstream, on either
engine (SPEC §12 `max_connections`), and the release a send holds."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Final

from fallback_mw.upstream.base import UpstreamRequest


class ConnectionCaps:
    """At most `max_connections` requests in flight per upstream, on either engine (an
    HTTP/1.1 connection carries one request at a time, so this caps connections too).
    Waiting for a slot is the gateway's own queue: bounded by the walk deadline, never
    the upstream's timeout."""

    def __init__(self) -> None:
        self._slots: dict[tuple[str, int], asyncio.Semaphore] = {}
        self._sweep_at = CAPS_SWEPT_AT

    async def acquire(self, request: UpstreamRequest) -> Release:
        free = uncapped(request)
        if free is not None:
            return free
        key = (request.pool_key or request.url.split("/", 3)[2], request.max_connections)
        slots = self._slots.get(key)
        if slots is None:
            if len(self._slots) >= self._sweep_at:
                self._sweep()
            slots = self._slots[key] = asyncio.Semaphore(request.max_connections)
        await slots.acquire()
        request.slot_taken = True
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                slots.release()

        return release

    def _sweep(self) -> None:
        """Drop the caps nobody holds a slot of or waits for (as good as a new one): each
        upstream name a store reload removed, or whose `max_connections` it changed, left
        one behind for the life of the process."""
        self._slots = {
            key: slots
            for key, slots in self._slots.items()
            if slots._value < key[1] or slots._waiters
        }
        self._sweep_at = max(CAPS_SWEPT_AT, 2 * len(self._slots))


def uncapped(request: UpstreamRequest) -> Release | None:
    """An upstream without a connection cap takes no slot: the release of nothing, and the
    request counted as past the cap, without a coroutine (`ConnectionCaps.acquire`, which
    the engines await only when this is None)."""
    if request.max_connections <= 0:
        request.slot_taken = True
        return _nothing
    return None


CAPS_SWEPT_AT: Final = 256  # caps kept before the idle ones are dropped (then twice those left)

Release = Callable[[], None]


def _nothing() -> None:
    return None
