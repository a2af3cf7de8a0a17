"""Django adapter: `fallback_mw.django.GatewayMiddleware` for the MIDDLEWARE list.

    MIDDLEWARE = ["fallback_mw.django.GatewayMiddleware", ...]   # first, like whitenoise
    FALLBACK_MW = {"config": "gateway.toml"}                      # a path, a dict or a model

The only module that imports Django. The gateway itself stays a pure ASGI app; this
adapter bridges one Django request to it:

* the request's ASGI scope (Django must be served over ASGI) and its body, read in chunks
  from the stream Django already spooled, are handed to the Gateway;
* when no route matches, the Gateway calls its host app, which here only records that
  fact; the request then continues down Django's middleware chain (`get_response`),
  body unread;
* a routed response becomes a StreamingHttpResponse fed chunk by chunk from the Gateway
  (SSE included). A response the Gateway aborts after its head was sent is never ended
  as complete: the adapter breaks the server's connection (request/abort.py, found
  through the ASGI scope Django was handed) and ends Django's send with GatewayAborted,
  which Django takes quietly: no traceback per abort, under any server.

Limits of the bridge: Django's response headers are a case-insensitive mapping, so a
repeated upstream header is joined with ", " (each Set-Cookie line is relayed as written);
a client that leaves (Django cancels the request) reaches the Gateway as `http.disconnect`.
Under WSGI (runserver, wsgi.py, django.test.Client) requests no route takes go on to
Django as usual and a routed one is ImproperlyConfigured: serve Django over ASGI, or put
`Gateway(get_asgi_application(), config=...)` in asgi.py, which needs no adapter at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Container, Mapping
from dataclasses import dataclass, field
from http.cookies import Morsel, SimpleCookie
from typing import Any

from fallback_mw.extras import missing_extra

try:
    from asgiref.sync import iscoroutinefunction, markcoroutinefunction
    from django.conf import settings
    from django.core.exceptions import DisallowedHost, ImproperlyConfigured
    from django.http import HttpRequest, HttpResponseBase, StreamingHttpResponse
    from django.utils.encoding import escape_uri_path
except ImportError:
    raise missing_extra("django", "fallback_mw.django") from None

from fallback_mw.config import GatewayConfig
from fallback_mw.gateway import Gateway
from fallback_mw.request.abort import break_response
from fallback_mw.request.frames import drop_gateway_locals
from fallback_mw.request.types import Message, Receive, Scope, Send
from fallback_mw.routing import routed_path
from fallback_mw.security import canonical_name

_EXCHANGE_KEY = "fallback_mw.django.exchange"
_BODY_CHUNK = 64 * 1024
_GONE_GRACE = 1.0  # seconds the Gateway has to wind a walk down after the client left

GetResponse = Callable[[HttpRequest], Awaitable[HttpResponseBase]]

_live: weakref.WeakSet[GatewayMiddleware] = weakref.WeakSet()


class _End:
    """Queued once the Gateway returns; carries its exception, if any."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error


class GatewayAborted(asyncio.CancelledError):
    """The Gateway ended a started response without completing it (SPEC §5).

    A CancelledError, which Django's ASGI handler takes for a client gone while the
    response is sent: it stops sending, quietly (no traceback per abort), and returns
    without the final body message. Before raising it, the adapter breaks the server's
    connection itself (request/abort.py), as the Gateway does when it is the outermost
    ASGI app: a server left to itself may keep the connection open (daphne) or log an
    error line (uvicorn)."""


@dataclass(eq=False)
class _Exchange:
    """One request's bridge state (never kept on the shared middleware instance)."""

    request: HttpRequest
    queue: asyncio.Queue[Message | _End]
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

    async def send(self, message: Message | _End) -> None:
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
            await _cancel(task)  # cancelled again while waiting: never leave it running


def _identity_as_django_has_it(
    headers: Any, request: HttpRequest, identity: tuple[tuple[bytes, str], ...]
) -> list[tuple[bytes, bytes]] | None:
    """The request's headers with the tenant and session headers as `request.META` now
    holds them, or None when they are as the caller sent them. A middleware above this one
    that authenticates the caller sets (or deletes) `request.META["HTTP_X_TENANT_ID"]`,
    Django's way to change a request header; the Gateway reads the ASGI scope, where the
    caller's own value still stood, and routed (and charged) the request to the tenant the
    caller named. A caller's spelling with an underscore (`x_tenant_id`), which Django
    keeps out of META and so out of that middleware's reach, but the Gateway reads as the
    same header, is dropped too, unless it is the configured name itself (`x_tenant`)."""
    changed: list[tuple[bytes, list[bytes]]] = []  # (name, the values it now goes with)
    for name, key in identity:
        # As Django's ASGIRequest fills META: fields whose name has an underscore dropped
        # (so a configured `x_tenant` is read from `x-tenant` there), repeated fields
        # joined with ",", latin-1.
        dashed = name.replace(b"_", b"-")
        sent: list[bytes] = []
        hidden = False  # a spelling META never showed the middleware above
        for sent_name, value in headers:
            lower = sent_name.lower()
            if lower == dashed:
                sent.append(value)
            # `find`, not `in`: `bytes in bytes` raises and clears a TypeError each time.
            elif lower.find(b"_") >= 0 and lower != name and lower.replace(b"_", b"-") == dashed:
                hidden = True
        now = request.META.get(key)
        if (b",".join(sent).decode("latin-1") if sent else None) != now:
            # Set by a middleware above: its text, UTF-8 as the Gateway reads the header.
            changed.append((name, [now.encode()] if isinstance(now, str) else []))
        elif hidden:
            changed.append((name, sent))  # as the caller sent it, byte for byte
    if not changed:
        return None
    names = {canonical_name(name) for name, _ in changed}  # the caller's, in any spelling
    kept = [(field, value) for field, value in headers if canonical_name(field) not in names]
    kept += [(name, value) for name, values in changed for value in values]
    return kept


def _mounted_scope(request: HttpRequest) -> Scope:
    """The request's ASGI scope, mounted where Django mounts the project: Django resolves
    its urls below its script name, FORCE_SCRIPT_NAME when set (a proxy that serves the
    project below a path without telling the server), else the server's root_path. The
    gateway routes on the path below the same point (routing.below_root)."""
    scope: Scope = request.scope
    script_name = request.META.get("SCRIPT_NAME") or ""
    if script_name and script_name != scope.get("root_path", ""):
        return {**scope, "root_path": script_name}
    return scope


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


async def _to_django(scope: Scope, receive: Receive, send: Send) -> None:
    # The Gateway's host app: no route matched, so Django handles the request itself.
    exchange = scope.get(_EXCHANGE_KEY)
    if isinstance(exchange, _Exchange):
        exchange.passthrough = True


def _config_source() -> Any:
    options = getattr(settings, "FALLBACK_MW", None)
    if isinstance(options, str | os.PathLike):
        # FALLBACK_MW = "gateway.toml": the path itself, not the dict that holds it.
        written = f"{{'config': {str(options)!r}}}"
        raise ImproperlyConfigured(
            f"fallback_mw: FALLBACK_MW is a dict: write FALLBACK_MW = {written}"
        )
    if not isinstance(options, dict):
        raise ImproperlyConfigured(
            'fallback_mw: set FALLBACK_MW = {"config": "gateway.toml"} in your settings'
        )
    unknown = sorted(set(options) - {"config"})
    if unknown:
        # {"confg": "gateway.toml"} said only "set FALLBACK_MW = {"config": ...}".
        hint = " (did you mean 'config'?)" if "config" not in options else ""
        raise ImproperlyConfigured(f"fallback_mw: unknown FALLBACK_MW key(s): {unknown}{hint}")
    if "config" not in options:
        raise ImproperlyConfigured(
            'fallback_mw: set FALLBACK_MW = {"config": "gateway.toml"} in your settings'
        )
    source = options["config"]
    # e.g. {"config": os.environ.get("GATEWAY_CONFIG")} with the variable unset: None.
    if not isinstance(source, str | os.PathLike | Mapping | GatewayConfig):
        raise ImproperlyConfigured(
            'fallback_mw: FALLBACK_MW["config"] must be a path to the gateway TOML, a dict '
            f"or a GatewayConfig, not {type(source).__name__}"
        )
    return source


class GatewayMiddleware:
    """Routes matching requests through the Gateway; every other request goes on to Django."""

    async_capable = True
    sync_capable = False

    def __init__(self, get_response: GetResponse) -> None:
        self.get_response = get_response
        if iscoroutinefunction(get_response):
            markcoroutinefunction(self)
        self.gateway = Gateway(_to_django, config=_config_source())
        if self.gateway.config_error is not None:
            # Django builds its middleware when asgi.py is imported: the server stops there.
            raise ImproperlyConfigured(self.gateway.config_error)
        settings_ = self.gateway.config.gateway
        # (header name, its request.META key) of the identity headers, which a middleware
        # above may set from the authenticated user (docs/security.md).
        self._identity = tuple(
            (name.encode("latin-1"), "HTTP_" + name.upper().replace("-", "_"))
            for name in (settings_.tenant_header, settings_.session_header)
        )
        # Django builds its middleware once per handler, and django.test's AsyncClient
        # builds a handler per client: a middleware dropped with its client drops its
        # Gateway, which closes its upstream connections on the running loop.
        _live.add(self)  # (its Gateway enabled the gateway's loggers: gateway.py)

    async def __call__(self, request: HttpRequest) -> HttpResponseBase:
        if not isinstance(getattr(request, "scope", None), dict):
            # WSGI (runserver, gunicorn on wsgi.py, django.test.Client): Django's own pages
            # still work; only a request a route would take cannot be forwarded from here.
            if not self._routed(request):
                return await self.get_response(request)
            raise ImproperlyConfigured(
                "fallback_mw.django.GatewayMiddleware needs Django served over ASGI (asgi.py) "
                f"to forward {request.path!r}: it is a gateway route's, and this request came "
                "over WSGI (runserver, wsgi.py, django.test.Client; use AsyncClient in tests)"
            )
        # No local of this frame holds the scope: an error raised through it is shown
        # by DEBUG's error page (and any reporter of frame locals) with every local, and
        # the scope's headers carry the caller's credential as sent (Django hides the
        # Authorization header only in META).
        self._check_host(request)
        exchange, task = self._start(request)
        try:
            first = await exchange.queue.get()
        except BaseException:
            await exchange.client_gone(task)
            raise
        if isinstance(first, _End):
            await task
            if first.error is not None:
                # The gateway's frames held the scope too, and bodies and credentials:
                # the error keeps where it happened, not what those frames held.
                drop_gateway_locals(first.error, every_frame=True)
                raise first.error
            if exchange.passthrough:
                return await self.get_response(request)
            raise RuntimeError("fallback_mw: the gateway returned without a response")
        return _streaming_response(first, exchange, task, request.scope)

    def _check_host(self, request: HttpRequest) -> None:
        """ALLOWED_HOSTS, as Django checks it for its own views (CommonMiddleware calls
        get_host): a routed request never reached that check, so a Host Django refuses
        (a DNS-rebinding page's) was forwarded with the provider's credential. Raises
        DisallowedHost, which Django answers 400 and logs on django.security. A request
        no route can take is Django's own, which checks the host where it always did."""
        try:
            request.get_host()
        except DisallowedHost:
            if self._may_route(_mounted_scope(request)):
                raise

    def _start(self, request: HttpRequest) -> tuple[_Exchange, asyncio.Task[None]]:
        """Start the Gateway on this request; its first message arrives on the queue."""
        base_scope = _mounted_scope(request)
        queue: asyncio.Queue[Message | _End] = asyncio.Queue(maxsize=1)
        exchange = _Exchange(request=request, queue=queue)
        scope = {**base_scope, _EXCHANGE_KEY: exchange}
        headers = _identity_as_django_has_it(base_scope.get("headers", ()), request, self._identity)
        if headers is not None:
            scope["headers"] = headers

        async def run() -> None:
            try:
                await self.gateway(scope, exchange.receive, exchange.send)
            except Exception as exc:
                await exchange.send(_End(exc))
            else:
                await exchange.send(_End())

        return exchange, asyncio.create_task(run())

    def _may_route(self, scope: Scope) -> bool:
        """Could a route take this request, whatever its method and tenant? (A route's
        prefix matches the path the resolver routes on.)"""
        path = routed_path(scope)
        if path is None:
            return False  # no route matches it: the resolver hands it to Django
        return self.gateway.resolver.table().covers(path)

    def _routed(self, request: HttpRequest) -> bool:
        """Would a route take this request (one without an ASGI scope)? The resolver's
        decision, on the path below the script name and the tenant header."""
        resolver = self.gateway.resolver
        raw_path = escape_uri_path(request.path_info).encode()
        path = routed_path({"raw_path": raw_path, "path": request.path_info})
        if path is None:
            return False
        tenant = _wsgi_field(request.headers.get(resolver.tenant_header.decode(), "")) or "default"
        # Under WSGI each request runs on an event loop of its own (async_to_sync): the
        # table as it stands, never a store reloader started on a loop about to end.
        store = self.gateway.services.store
        table = store.current() if store is not None else resolver.table()
        route, refused = table.resolve(request.method or "GET", path, tenant)
        return route is not None or refused is not None

    async def aclose(self) -> None:
        await self.gateway.aclose()


async def aclose_gateways() -> None:
    """Close every live GatewayMiddleware's upstream connections (a shutdown hook: Django
    has no ASGI lifespan support; `with_lifespan` calls it at the server's shutdown)."""
    for middleware in list(_live):
        await middleware.aclose()


def start_gateways() -> None:
    """Start every live GatewayMiddleware as a Gateway's lifespan startup does: the route
    store's reloader, and a shared state's first try of Redis, so one it cannot use is
    said at startup rather than at the first routed request."""
    for middleware in list(_live):
        middleware.gateway.services.start()


def with_lifespan(application: Any) -> Any:
    """Django's ASGI application, plus the ASGI lifespan protocol Django lacks:

        application = with_lifespan(get_asgi_application())   # asgi.py

    The server's startup is answered (no "lifespan unsupported" line from uvicorn,
    hypercorn or granian) and starts every GatewayMiddleware as a Gateway's would (an
    unusable Redis state is said then), and at its shutdown every GatewayMiddleware closes
    its upstream connections (no "Unclosed client session" when the process ends)."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await application(scope, receive, send)
            return
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                start_gateways()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await aclose_gateways()
                await send({"type": "lifespan.shutdown.complete"})
                return

    return app


async def _cancel(task: asyncio.Task[None]) -> None:
    if not task.done():
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _no_send(message: Message) -> None:
    """Stands for the server's send when it cannot be found: nothing to break."""


def _streaming_response(
    start: Message, exchange: _Exchange, task: asyncio.Task[None], scope: Scope
) -> StreamingHttpResponse:
    queue = exchange.queue

    async def body() -> AsyncIterator[bytes]:
        complete = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, _End):
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
                # records telemetry before it returns (_End).
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


def _abandoned(exchange: _Exchange, task: asyncio.Task[None]) -> None:
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
        return f"{header} {self.raw}"


def _wsgi_field(value: str) -> str:
    """A header value as WSGI hands it over (latin-1 text, PEP 3333) read as the resolver
    reads the field: its bytes in UTF-8 (a tenant `日本語` was "æ\x97¥æ\x9c¬è\xaa\x9e",
    matching no route), less surrounding SP and HTAB only."""
    # Not UTF-8 (or not latin-1 text at all): kept as it is, matching no route, as the
    # gateway refuses such bytes (400).
    with contextlib.suppress(UnicodeError):
        value = value.encode("latin-1").decode()
    return value.strip(" \t")


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
