"""asyncpg's connect, run to its end when its caller is cancelled, for both PostgreSQL
backends (the route store and the ledger).

Cancelled between the socket's connect and its TLS probe (`sslmode=prefer`, the default),
asyncpg leaves a future holding `ConnectionError('unexpected connection_lost() call')`
that nobody reads, and asyncio logs "Future exception was never retrieved" in the host's
log: an error for nothing that went wrong. A caller is cancelled there when a client goes,
a read's deadline passes, a stop's graceful timeout ends, or a gateway closes while its
route watcher opens its LISTEN connection. So the connect goes on (its own timeout bounds
it), a connection that arrives for nobody is closed, and the owner's `aclose` waits for
the connects still under way: a loop that ended first would cancel them at that same turn."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import asyncpg

logger = logging.getLogger("fallback_mw.store")


class Connects:
    """One owner's connects (a store's, a ledger's pool's): `connect` is `asyncpg.connect`
    that outlives its cancelled caller; `ended` waits for those still running."""

    def __init__(self) -> None:
        self._left: set[asyncio.Future[asyncpg.Connection[Any]]] = set()

    async def connect(self, *args: Any, **kwargs: Any) -> asyncpg.Connection[Any]:
        connecting = asyncio.ensure_future(asyncpg.connect(*args, **kwargs))
        try:
            return await asyncio.shield(connecting)
        except asyncio.CancelledError:
            self._left.add(connecting)
            connecting.add_done_callback(self._left.discard)
            connecting.add_done_callback(_close_unwanted)
            raise

    async def ended(self) -> None:
        """Wait for the connects left running on this loop (one of another loop, left by
        a TestClient's loop per request, ends or is cancelled with that loop)."""
        loop = asyncio.get_running_loop()
        left = [connecting for connecting in self._left if connecting.get_loop() is loop]
        if left:
            await asyncio.wait(left)


def _close_unwanted(connecting: asyncio.Future[asyncpg.Connection[Any]]) -> None:
    if connecting.cancelled():
        return
    if connecting.exception() is None:
        connecting.result().terminate()
    else:
        logger.debug("a connect whose caller was gone failed")
