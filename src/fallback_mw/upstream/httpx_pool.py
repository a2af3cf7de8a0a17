"""The httpx engine's connection pools: httpcore's own, with its bookkeeping made linear.

httpcore runs `_assign_requests_to_connections` as each request enters the pool and as each
response closes; its version counts every connection again for each idle one (quadratic in
the pool, which holds every upstream's connections) and polls each idle connection on its
own. `Pool` and `ProxyPool` make the same decisions in one pass with one `poll`. They read
httpcore's internals (`_connections`, `_requests`, `_expire_at`, `_network_stream`), as the
engine already does; httpx pins httpcore 1.*."""

from __future__ import annotations

import select
import time

import httpcore

from fallback_mw.upstream.httpx_backend import EarlyAnswerStream


def _assign_requests_to_connections(
    pool: httpcore.AsyncConnectionPool,
) -> list[httpcore.AsyncConnectionInterface]:
    """httpcore's own pool bookkeeping (run as each request enters the pool and as each
    response closes), with its decisions unchanged and linear in the pooled connections:
    httpcore's counts every connection again for each idle one (`len([...])` inside the
    loop), quadratic in the pool, which holds every upstream's connections. With 64 kept
    alive (the failover arm: a failing upstream and its backup) that was ~16,000 calls per
    request, most of the httpx engine's CPU."""
    closing: list[httpcore.AsyncConnectionInterface] = []
    connections = pool._connections
    keep_alive = pool._max_keepalive_connections
    idle_expired = _idle_expiry(connections)
    for connection in list(connections):
        expired = idle_expired.get(id(connection))
        if connection.is_closed():
            connections.remove(connection)
        elif (connection.has_expired() if expired is None else expired) or (
            connection.is_idle() and len(connections) > keep_alive
        ):
            connections.remove(connection)
            closing.append(connection)
    for pool_request in pool._requests:
        if not pool_request.is_queued():
            continue
        origin = pool_request.request.url.origin
        chosen = next(
            (c for c in connections if c.can_handle_request(origin) and c.is_available()),
            None,
        )
        if chosen is None:
            if len(connections) >= pool._max_connections:
                idle = next((c for c in connections if c.is_idle()), None)
                if idle is None:
                    continue  # stays queued until a connection frees up
                connections.remove(idle)
                closing.append(idle)
            chosen = pool.create_connection(origin)
            connections.append(chosen)
        pool_request.assign_to_connection(chosen)
    return closing


def _idle_expiry(connections: list[httpcore.AsyncConnectionInterface]) -> dict[int, bool]:
    """httpcore's `has_expired` for each idle HTTP/1.1 connection on the engine's own plain
    streams (by id): its keep-alive over, or its socket readable (on an idle connection,
    only the upstream's close). One poll for all of them, where httpcore polls each idle
    connection on its own, twice a request. Anything else is left to `has_expired`."""
    found: dict[int, bool] = {}
    if _POLL is None:
        return found
    now = time.monotonic()
    by_fd: dict[int, int] = {}
    poller = None
    for connection in connections:
        http11 = getattr(connection, "_connection", None)
        if type(http11) is not httpcore.AsyncHTTP11Connection or not http11.is_idle():
            continue
        stream = http11._network_stream
        fd = stream.polled_fileno() if isinstance(stream, EarlyAnswerStream) else None
        if fd is None:
            continue
        expire_at = http11._expire_at
        if fd < 0 or (expire_at is not None and now > expire_at):
            found[id(connection)] = True
            continue
        if poller is None:
            poller = _POLL()
        poller.register(fd, select.POLLIN)
        by_fd[fd] = id(connection)
        found[id(connection)] = False
    if poller is not None:
        for fd, _ in poller.poll(0):
            found[by_fd[fd]] = True
    return found


_POLL = getattr(select, "poll", None)  # not on Windows: httpcore's own check there


class Pool(httpcore.AsyncConnectionPool):
    def _assign_requests_to_connections(self) -> list[httpcore.AsyncConnectionInterface]:
        return _assign_requests_to_connections(self)


class ProxyPool(httpcore.AsyncHTTPProxy):
    def _assign_requests_to_connections(self) -> list[httpcore.AsyncConnectionInterface]:
        return _assign_requests_to_connections(self)
