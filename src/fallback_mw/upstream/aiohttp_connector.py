"""The aiohttp engine's connector: every address checked at connect time (the guard), the
name's lookup inside the connect timeout, and the first-byte timer armed once connected
(`ARM_ON_CONNECT`: the attempt that is sending)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from contextvars import ContextVar
from typing import Any

import aiohttp
from aiohttp.abc import ResolveResult

from fallback_mw.upstream.base import FirstByteTimer


# The first-byte timer of the request being sent in this task, and whether its body is
# streamed: for a buffered body the connector arms it once it has a connection, just before
# the request head and its body go out (from then on the time is the upstream's); an egress
# proxy's answer to CONNECT is timed by it whatever the body; and its connect timeout, which
# also holds the lookup of the upstream's name (`GuardedConnector._resolve_host`). A context
# variable rather than an aiohttp trace hook: traces cost a handful of signal sends on every
# request.
class Sending:
    """One send's facts for the connector: its first-byte timer, whether its body is
    streamed, its connect timeout, and whether the connection it got was made for it
    (`fresh`) rather than taken from the pool (resend_on_new_connection)."""

    __slots__ = ("connect", "fresh", "streamed", "timer")

    def __init__(self, timer: FirstByteTimer, streamed: bool, connect: float) -> None:
        self.timer = timer
        self.streamed = streamed
        self.connect = connect
        self.fresh = False


ARM_ON_CONNECT: ContextVar[Sending | None] = ContextVar("fallback_mw_arm_on_connect", default=None)


class GuardedConnector(aiohttp.TCPConnector):
    async def connect(
        self,
        req: aiohttp.ClientRequest,
        traces: list[Any],
        timeout: aiohttp.ClientTimeout,  # noqa: ASYNC109 (aiohttp's signature)
    ) -> Any:
        armed = ARM_ON_CONNECT.get()
        if armed is not None:
            armed.fresh = False
        connection = await super().connect(req, traces, timeout)
        # A pooled connection on which the upstream wrote while it sat idle (a late or
        # repeated answer, another caller's) holds that answer parsed and queued, and
        # aiohttp hands it out as is: the next request on it, another caller's, would be
        # answered with it. Such a connection is closed and another taken; the pool holds
        # at most `limit` of them, so a fresh connection ends the loop.
        for _ in range((self.limit or 1024) + 1):
            protocol = connection.protocol
            if protocol is None or not protocol.should_close:
                break
            connection.close()
            connection = await super().connect(req, traces, timeout)
        if armed is not None and not armed.streamed:
            armed.timer.arm()
        return connection

    async def _create_connection(
        self,
        req: aiohttp.ClientRequest,
        traces: list[Any],
        timeout: aiohttp.ClientTimeout,  # noqa: ASYNC109 (aiohttp's signature)
    ) -> Any:
        armed = ARM_ON_CONNECT.get()
        if armed is not None:
            armed.fresh = True  # made for this send, never a kept-alive one
        return await super()._create_connection(req, traces, timeout)

    async def _resolve_host(
        self, host: str, port: int, traces: Sequence[Any] | None = None
    ) -> list[ResolveResult]:
        # aiohttp's sock_connect starts once an address is known: a resolver that hangs
        # (a DNS server gone) held every attempt to the walk deadline, a 504 that never
        # reached the fallback. The lookup is part of the connect (as for curl and httpx):
        # held to connect_timeout_ms, a `timeout` of the connect. Only this request's wait
        # ends; a lookup other requests share goes on (aiohttp shields it).
        armed = ARM_ON_CONNECT.get()
        if armed is None:
            return await super()._resolve_host(host, port, traces=traces)
        seconds = armed.connect
        try:
            async with asyncio.timeout(seconds):
                return await super()._resolve_host(host, port, traces=traces)
        except TimeoutError:
            raise aiohttp.ConnectionTimeoutError(
                f"no address for the upstream's host within {seconds:g} s"
            ) from None

    async def _create_proxy_connection(
        self,
        req: aiohttp.ClientRequest,
        traces: list[Any],
        timeout: aiohttp.ClientTimeout,  # noqa: ASYNC109 (aiohttp's signature)
    ) -> Any:
        # aiohttp times the TCP connect to the egress proxy and the TLS handshake through
        # it, not the proxy's answer to CONNECT: a proxy that accepted and never answered
        # held every attempt until the walk deadline (a 504, no breaker mark, no time left
        # for a fallback), where the httpx engine's first-byte timer (armed as the CONNECT
        # goes out) ended it. The upstream's first-byte timer runs from here, as there;
        # `connect` re-arms it once the connection is made (a buffered body), or it waits
        # for the body's first chunk (a streamed one: until the tunnel was up, the body
        # went nowhere, and the walk deadline ran out as the caller's 408).
        armed = ARM_ON_CONNECT.get()
        if armed is None:
            return await super()._create_proxy_connection(req, traces, timeout)
        timer, streamed = armed.timer, armed.streamed
        timer.arm()
        try:
            return await super()._create_proxy_connection(req, traces, timeout)
        finally:
            if streamed:
                timer.pause()
