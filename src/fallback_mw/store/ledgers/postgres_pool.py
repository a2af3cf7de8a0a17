"""The PostgreSQL ledger's connections: which driver errors say the database is away, and
asyncpg's pool made to read its own errors when a caller gives up (its connect is
`store.postgres_connect`'s, shared with the route store)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import asyncpg

logger = logging.getLogger("fallback_mw.budget")


# InternalClientError: a pooled connection the server dropped mid-operation ("cannot switch
# to state ...; another operation is in progress"), seen when PostgreSQL stops under load.
FAILURES = (
    OSError,
    asyncio.TimeoutError,
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.exceptions.InternalClientError,
)


# What says the database is away (not that it refused one statement).
UNREACHABLE = (
    OSError,
    asyncio.TimeoutError,
    asyncpg.InterfaceError,
    asyncpg.exceptions.InternalClientError,
    asyncpg.exceptions.PostgresConnectionError,
    asyncpg.exceptions.OperatorInterventionError,
    asyncpg.exceptions.TooManyConnectionsError,
    asyncpg.exceptions.ObjectNotInPrerequisiteStateError,  # "not accepting connections"
)


# A connection refused: by the host (nothing listens), or by the server itself while it
# starts up or shuts down (CannotConnectNowError), has no slot left, or takes no
# connections to this database. Nothing was sent: writing it later cannot write it twice.
CONNECTION_REFUSED = (
    ConnectionRefusedError,
    asyncpg.exceptions.CannotConnectNowError,
    asyncpg.exceptions.TooManyConnectionsError,
    asyncpg.exceptions.ObjectNotInPrerequisiteStateError,
)


class ReleasingPool(asyncpg.Pool):
    """asyncpg's pool, whose release of a connection reads its own error. asyncpg runs the
    release (the connection's reset) in a shielded task: when `_run`'s timeout (or a
    caller's cancellation) ended the wait for it and the reset then failed on a database
    that hangs, nobody read that error and asyncio logged `ERROR Task exception was never
    retrieved` with a driver traceback, once per pooled connection a pause caught. The
    connection is still terminated and the holder given back, as asyncpg does."""

    async def release(
        self,
        connection: asyncpg.pool.PoolConnectionProxy[Any],
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (asyncpg's signature)
    ) -> None:
        release = asyncio.ensure_future(super().release(connection, timeout=timeout))
        release.add_done_callback(_read_release_error)
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            # Released while `_run`'s timeout (or a cancellation) unwinds the call: the reset
            # of a connection whose query did not answer waits out the command timeout
            # again, and the refusal waited with it (10 s for the 5 the docs promise). It
            # goes on here; its holder returns to the pool when it is done.
            return
        await asyncio.shield(release)


def _read_release_error(release: asyncio.Future[None]) -> None:
    if not release.cancelled() and release.exception() is not None:
        logger.debug("a pooled connection's reset failed: it is closed")
