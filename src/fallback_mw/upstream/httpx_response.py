"""An answer on the httpx engine: its body read as it arrives (what h11 already holds
relayed together), and its connection handed back to the pool, or closed, whatever cut the
read short."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncIterator

from fallback_mw.extras import missing_extra

try:
    import httpx
except ImportError:
    raise missing_extra("httpx", 'engine = "httpx"') from None
from fallback_mw.timers import deadline_after
from fallback_mw.upstream.caps import Release
from fallback_mw.upstream.httpx_errors import map_errors
from fallback_mw.upstream.httpx_framing import (
    h11_state,
    http11_connection,
    read_what_has_arrived,
    with_what_has_arrived,
)


class HttpxResponse:
    def __init__(self, response: httpx.Response, idle_timeout: float, release: Release) -> None:
        self._response = response
        self._idle = idle_timeout
        self._release = release
        # A response dropped without aclose (a cancellation between send and its owner)
        # still gives its slot under the connection cap back.
        weakref.finalize(self, release)
        self.status = response.status_code
        self.headers = [(k.lower(), v) for k, v in response.headers.raw]
        self._finished = False
        # The HTTP/1.1 connection it came on and that connection's request count now: a
        # close that finds it ACTIVE on this same request knows it is still this answer's.
        self._connection = http11_connection(response)
        self._cycle = getattr(self._connection, "_request_count", None)

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        stream = self._response.aiter_raw()
        state = h11_state(self._response)
        while True:
            with map_errors("body"), deadline_after(self._idle):
                try:
                    chunk = await stream.__anext__()
                except StopAsyncIteration:
                    self._finished = True
                    return
            ended = False
            if state is not None:
                chunk, ended = with_what_has_arrived(state, chunk)
            if chunk:
                yield chunk
            if ended:
                # h11 read the body's end here: httpcore is not asked again (it would wait
                # for more), and the close hands the connection back, as after its own end.
                self._finished = True
                return

    async def aclose(self) -> None:
        # Shielded: the connection is released even if the caller is being cancelled.
        self._release()
        await asyncio.shield(self._close())

    async def _close(self) -> None:
        connection = self._connection
        if (
            not self._finished
            and connection is not None
            and getattr(connection, "_request_count", None) == self._cycle
            and not connection.is_closed()
            and not connection.is_idle()
        ):
            self._finished = read_what_has_arrived(self._response)
        await self._response.aclose()
        if self._finished:
            return
        # A body read cut short (a cancellation, the idle timer) is closed by httpcore as
        # the read fails, with its connection. A second cancellation a few loop iterations
        # later (a client disconnect and the idle timer due together under load) cut that
        # close short: httpcore had marked the response closed, so this aclose did nothing,
        # and the connection stayed open and ACTIVE in the pool for ever (a socket in
        # CLOSE-WAIT, a pool slot lost). Cut short, the connection cannot have gone back to
        # the pool (only an answer read to its end does): closing it here is never another
        # request's. Still checked: closed, idle (back in the pool) or on a later request
        # (handed to one queued for it: its request count moved on), it is not this
        # answer's to close.
        if (
            connection is not None
            and not connection.is_closed()
            and not connection.is_idle()
            and getattr(connection, "_request_count", None) == self._cycle
        ):
            await connection.aclose()


class TransportResponse(HttpxResponse):
    """A response from a transport handed to HttpxClient (`httpx.MockTransport` in a host's
    tests): one built with its content (`httpx.Response(200, json=...)`) was read as it was
    made, and httpx refuses to stream it again (StreamConsumed, an internal_error for every
    request): that content is the body."""

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        if not self._response.is_stream_consumed:
            async for chunk in super().iter_chunks():
                yield chunk
        elif self._response.content:
            yield self._response.content
