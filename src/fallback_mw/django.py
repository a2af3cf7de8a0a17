"""Django adapter: `fallback_mw.django.GatewayMiddleware` for the MIDDLEWARE list.

    MIDDLEWARE = ["fallback_mw.django.GatewayMiddleware", ...]   # first, like whitenoise
    FALLBACK_MW = {"config": "gateway.toml"}                      # a path, a dict or a model

With fallback_mw/django_exchange.py (one request's bridge), the only module that imports
Django. The gateway itself stays a pure ASGI app; this adapter bridges one Django request
to it:

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
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from fallback_mw.extras import missing_extra

try:
    from asgiref.sync import iscoroutinefunction, markcoroutinefunction
    from django.conf import settings
    from django.core.exceptions import DisallowedHost, ImproperlyConfigured
    from django.http import HttpRequest, HttpResponseBase
    from django.utils.encoding import escape_uri_path
except ImportError:
    raise missing_extra("django", "fallback_mw.django") from None

from fallback_mw.config import GatewayConfig
from fallback_mw.django_exchange import End, Exchange, GatewayAborted, streaming_response
from fallback_mw.gateway import Gateway
from fallback_mw.request.frames import drop_gateway_locals
from fallback_mw.request.types import Message, Receive, Scope, Send
from fallback_mw.routing import routed_path
from fallback_mw.security.fields import canonical_name
from fallback_mw.security.values import UNDERSCORE

__all__ = [
    "GatewayAborted",
    "GatewayMiddleware",
    "aclose_gateways",
    "start_gateways",
    "with_lifespan",
]

_EXCHANGE_KEY = "fallback_mw.django.exchange"

GetResponse = Callable[[HttpRequest], Awaitable[HttpResponseBase]]

_live: weakref.WeakSet[GatewayMiddleware] = weakref.WeakSet()


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
            # By its value (security/values.py: `UNDERSCORE`).
            elif UNDERSCORE in lower and lower != name and lower.replace(b"_", b"-") == dashed:
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


async def _to_django(scope: Scope, receive: Receive, send: Send) -> None:
    # The Gateway's host app: no route matched, so Django handles the request itself.
    exchange = scope.get(_EXCHANGE_KEY)
    if isinstance(exchange, Exchange):
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
        if isinstance(first, End):
            await task
            if first.error is not None:
                # The gateway's frames held the scope too, and bodies and credentials:
                # the error keeps where it happened, not what those frames held.
                drop_gateway_locals(first.error, every_frame=True)
                raise first.error
            if exchange.passthrough:
                return await self.get_response(request)
            raise RuntimeError("fallback_mw: the gateway returned without a response")
        return streaming_response(first, exchange, task, request.scope)

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

    def _start(self, request: HttpRequest) -> tuple[Exchange, asyncio.Task[None]]:
        """Start the Gateway on this request; its first message arrives on the queue."""
        base_scope = _mounted_scope(request)
        queue: asyncio.Queue[Message | End] = asyncio.Queue(maxsize=1)
        exchange = Exchange(request=request, queue=queue)
        scope = {**base_scope, _EXCHANGE_KEY: exchange}
        query = scope.get("query_string")
        if isinstance(query, str):
            # Django's AsyncClient writes it as text; ASGI (and the gateway) reads bytes.
            # UTF-8, as Django's own handler decodes bytes.
            scope["query_string"] = query.encode()
        headers = _identity_as_django_has_it(base_scope.get("headers", ()), request, self._identity)
        if headers is not None:
            scope["headers"] = headers

        async def run() -> None:
            try:
                await self.gateway(scope, exchange.receive, exchange.send)
            except Exception as exc:
                await exchange.send(End(exc))
            else:
                await exchange.send(End())

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
        # The method as sent, as the resolver compares it (`get` is not GET): Django's
        # `request.method` is upper-cased.
        method = request.META.get("REQUEST_METHOD") or "GET"
        route, refused = table.resolve(method, path, tenant)
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


def _wsgi_field(value: str) -> str:
    """A header value as WSGI hands it over (latin-1 text, PEP 3333) read as the resolver
    reads the field: its bytes in UTF-8 (a tenant `日本語` was "æ\x97¥æ\x9c¬è\xaa\x9e",
    matching no route), less surrounding SP and HTAB only."""
    # Not UTF-8 (or not latin-1 text at all): kept as it is, matching no route, as the
    # gateway refuses such bytes (400).
    with contextlib.suppress(UnicodeError):
        value = value.encode("latin-1").decode()
    return value.strip(" \t")
