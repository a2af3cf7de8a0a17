"""One routed Django request's bridge to the Gateway, both ways (fallback_mw/django.py is
the middleware that starts it): the body read from the stream Django spooled, handed over
as `http.request` messages; the Gateway's messages queued and fed to a
StreamingHttpResponse chunk by chunk; a client gone (Django stopped reading, or dropped the
response unsent) told to the Gateway as `http.disconnect`; an aborted response never ended
as complete."""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import AsyncIterator, Container
from dataclasses import dataclass, field
from http.cookies import Morsel, SimpleCookie
from typing import Any

from fallback_mw.extras import missing_extra

try:
    from django.core.exceptions import ImproperlyConfigured, RequestAborted
    from django.http import HttpRequest, StreamingHttpResponse
except ImportError:
    raise missing_extra("django", "fallback_mw.django") from None

from fallback_mw.request.abort import break_response
from fallback_mw.request.types import Message, Scope

_BODY_CHUNK = 64 * 1024
_GONE_GRACE = 1.0  # seconds the Gateway has to wind a walk down after the client left


class End:
    """Queued once the Gateway returns; carries its exception, if any."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error


class GatewayAborted(RequestAborted, asyncio.CancelledError):  # type: ignore[misc]  # untyped
    """The Gateway ended a started response without completing it (SPEC §5).

    A CancelledError, which Django 5's ASGI handler takes for a client gone while the
    response is sent, and a RequestAborted, which Django 6's takes so (its TaskGroup
    wraps a CancelledError subclass in a group, which it raised to the server): it stops
    sending, quietly (no traceback per abort), and returns without the final body
    message. Before raising it, the adapter breaks the server's
    connection itself (request/abort.py), as the Gateway does when it is the outermost
    ASGI app: a server left to itself may keep the connection open (daphne) or log an
    error line (uvicorn)."""


@dataclass(eq=False)
class Exchange:
    """One request's bridge state (never kept on the shared middleware instance)."""

    request: HttpRequest
    queue: asyncio.Queue[Message | End]
    passthrough: bool = False
    body_done: bool = False
    reading: bool = False
    gone: asyncio.Event = field(default_factory=asyncio.Event)

    async def receive(self) -> Message:
        if self.body_done:
            # Nothing more will arrive but the client leaving (Django cancels the request).
            await self.gone.wait()
            return {"type": "http.disconnect"}
        if not self.reading:
            self.reading = True
            _check_unread(self.request)
        chunk = self.request.read(_BODY_CHUNK)
        more = len(chunk) == _BODY_CHUNK  # a short read is the end of the spooled body
        self.body_done = not more
        return {"type": "http.request", "body": chunk, "more_body": more}

    async def send(self, message: Message | End) -> None:
        if not self.gone.is_set():  # nobody reads the queue once the client left
            await self.queue.put(message)

    async def client_gone(self, task: asyncio.Task[None]) -> None:
        """Django cancelled the request (the client left): tell the Gateway as a server
        would, with `http.disconnect`, so its walk stops and records a client gone (not a
        cancelled, unexplained request); cancel what is still running after a moment."""
        self.gone.set()
        while not self.queue.empty():
            self.queue.get_nowait()
        try:
            if not task.done():
                await asyncio.wait({task}, timeout=_GONE_GRACE)
        finally:
            await cancel(task)  # cancelled again while waiting: never leave it running


def _check_unread(request: HttpRequest) -> None:
    """A routed request's body must still be Django's to read: a middleware listed before
    GatewayMiddleware that read the stream itself (request.POST on a multipart upload, a
    request.read()) left nothing, and the upload went upstream empty, as if complete.
    (`request.body` keeps a copy, read here as usual.)"""
    if getattr(request, "_read_started", False) and not hasattr(request, "_body"):
        raise ImproperlyConfigured(
            "fallback_mw: a middleware before fallback_mw.django.GatewayMiddleware read this "
            "routed request's body stream (request.POST on a multipart upload reads it), so "
            "it cannot be forwarded: list GatewayMiddleware before that middleware in "
            "MIDDLEWARE"
        )


async def cancel(task: asyncio.Task[None]) -> None:
    if not task.done():
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _no_send(message: Message) -> None:
    """Stands for the server's send when it cannot be found: nothing to break."""


def streaming_response(
    start: Message, exchange: Exchange, task: asyncio.Task[None], scope: Scope
) -> StreamingHttpResponse:
    queue = exchange.queue

    async def body() -> AsyncIterator[bytes]:
        complete = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, End):
                    if not complete:
                        await break_response(_no_send, scope)
                        raise GatewayAborted("the gateway aborted the response") from item.error
                    return
                if item["type"] != "http.response.body" or complete:
                    continue
                chunk = item.get("body", b"")
                if chunk:
                    yield chunk
                complete = not item.get("more_body", False)
                # After the last chunk keep reading: the Gateway settles budgets and
                # records telemetry before it returns (End).
        finally:
            if not task.done():  # Django stopped reading: the client left mid-response
                await exchange.client_gone(task)

    response = StreamingHttpResponse(body(), status=start["status"])
    del response.headers["Content-Type"]  # only what the Gateway sent
    # The gateway logged this request (its one line, no query string): Django's own
    # `django.request` record of a status >= 400 would be a second, carrying the
    # HttpRequest (its repr shows the query) to handlers such as mail_admins.
    response._has_been_logged = True
    _copy_headers(start.get("headers", ()), response)
    # A middleware listed above this one may answer with a response of its own instead
    # (ConditionalGetMiddleware's 304, a cache's hit): this one is dropped unread, its
    # body never started, and the Gateway waited forever to hand it the next message,
    # holding its upstream connection, its max_concurrency slot and its budget hold.
    weakref.finalize(response, _abandoned, exchange, task)
    return response


_winding_down: set[asyncio.Task[None]] = set()


def _abandoned(exchange: Exchange, task: asyncio.Task[None]) -> None:
    """The routed response was dropped by Django without being sent to its end: tell the
    Gateway the client is gone, as when Django stops reading mid-body."""
    if task.done() or exchange.gone.is_set():
        return

    def wind_down() -> None:
        winding = asyncio.ensure_future(exchange.client_gone(task))
        _winding_down.add(winding)
        winding.add_done_callback(_winding_down.discard)

    with contextlib.suppress(RuntimeError):  # the loop is closed: nothing runs any more
        task.get_loop().call_soon_threadsafe(wind_down)


class _RelayedCookie(Morsel[str]):
    """One upstream `Set-Cookie`, relayed as the upstream wrote it. Django sends only
    `response.cookies` as Set-Cookie, and re-parsing through SimpleCookie drops a cookie
    with an attribute it does not know (`Partitioned`) or a JSON value, and splits one
    with `Priority=High` into two cookies."""

    def __init__(self, raw: str) -> None:
        super().__init__()
        self.raw = raw
        # key / value for readers of response.cookies (Django's test client), unchecked.
        name, _, value = raw.split(";", 1)[0].partition("=")
        self._key, self._value, self._coded_value = name.strip(), value.strip(), value.strip()

    def output(self, attrs: Container[str] | None = None, header: str = "Set-Cookie:") -> str:
        return f"{header} {self.raw}"  # Django 5 writes the header with this

    def OutputString(self, attrs: Container[str] | None = None) -> str:
        return self.raw  # Django 6 with this


def _copy_headers(headers: Any, response: StreamingHttpResponse) -> None:
    for raw_name, raw_value in headers:
        name = raw_name.decode("latin-1")
        value = raw_value.decode("latin-1")
        if name.lower() == "set-cookie" and value.isascii():
            # Keyed by the whole line: two cookies of one name (other paths) both go out.
            dict.__setitem__(response.cookies, value, _RelayedCookie(value))
        elif name.lower() == "set-cookie":
            cookie: SimpleCookie = SimpleCookie()
            cookie.load(value)
            for key, morsel in cookie.items():
                response.cookies[key] = morsel
        elif name in response.headers:
            response.headers[name] = f"{response.headers[name]}, {value}"
        else:
            response.headers[name] = value
