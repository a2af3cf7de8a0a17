"""RouteResolver: which route? Attaches the per-request context; everything else passes.

With telemetry attached it owns the request span (and the duration metric and the log
line): opened once the route is known, closed when every layer behind it has returned, so
the budget guard's hold and settlement are inside it."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Final

import anyio

from fallback_mw.budget import Ledger
from fallback_mw.config import DEFAULT_METHODS, ConfigError, ConfigSource, as_config
from fallback_mw.credentials import CredentialCache
from fallback_mw.injected import require, require_app, require_callable, require_environ
from fallback_mw.layers.head import as_spelled, identity_headers, requested_deadline_ms
from fallback_mw.layers.limits import InFlight, byte_fields, header_refusal
from fallback_mw.request.body_json import path_model
from fallback_mw.request.config_refusal import ConfigRefusal
from fallback_mw.request.context import SCOPE_KEY, RequestContext
from fallback_mw.request.local_errors import send_error
from fallback_mw.request.record import write_record
from fallback_mw.request.secrets import RequestSecrets, provider_secrets, recordable
from fallback_mw.request.types import ASGIApp, Receive, Scope, Send
from fallback_mw.routing import (
    RouteTable,
    effective_deadline_ms,
    mount_spelling,
    normalise_path,
    raw_routed_path,
)
from fallback_mw.security.fields import (
    CREDENTIAL_HEADERS,
    METHOD_OVERRIDE_FIELDS,
    canonical_name,
    named_methods,
    override_methods,
)
from fallback_mw.security.queries import (
    NO_METHODS,
    canonical_query_key,
    query_override_methods,
    strip_query_keys,
)
from fallback_mw.spelling import caller_spelling
from fallback_mw.telemetry import Telemetry
from fallback_mw.timers import monotonic

# A 503 overloaded's Retry-After: whole seconds, the smallest (slots free as requests end).
_RETRY_SOON: Final = ((b"retry-after", b"1"),)


def _not_forwarded(route_id: str, shown: str | None) -> str:
    """The 405's message for a method a route without `methods` does not forward (`shown`:
    the caller's token, None when it may not be recorded)."""
    forwarded = ", ".join(DEFAULT_METHODS)
    if shown is not None and shown != shown.upper() and shown.upper() in DEFAULT_METHODS:
        # The configuration reads methods in upper case: no setting forwards `get`.
        return (
            f"{shown!r} is not {shown.upper()}: HTTP methods are case-sensitive (RFC 9110 "
            f"§9.1), and route {route_id!r} forwards {forwarded} as written; send "
            f"{shown.upper()}"
        )
    named = shown or "this method"
    # The whole list: `methods = ["PROPFIND"]` alone would forward it and send the route's
    # GETs and POSTs to the host app.
    listed = f" (methods = {json.dumps([*DEFAULT_METHODS, shown])})" if shown else ""
    return (
        f"{named} is not forwarded on route {route_id!r}: a route without methods forwards "
        f"{forwarded}; to forward {named} as well, list it beside them in the route's "
        f"methods{listed}"
    )


# A route table; its credential headers; every credential name; its provider keys; route
# id -> the fields its answers vary by (`RouteResolver._table_facts`).
_TableFacts = tuple[
    RouteTable, frozenset[bytes], frozenset[bytes], tuple[bytes, ...], dict[str, tuple[bytes, ...]]
]


class RouteResolver:
    _refusal: ConfigRefusal | None = None  # a configuration that did not load

    def __init__(
        self,
        app: ASGIApp,
        /,
        *,
        config: ConfigSource,
        table: Callable[[], RouteTable] | None = None,
        telemetry: Telemetry | None = None,
        ledger: Ledger | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        owner = "RouteResolver"
        require_app(app, owner=owner)
        require_callable(
            table, parameter="table", owner=owner, takes="a function returning the RouteTable"
        )
        require(telemetry, Telemetry, parameter="telemetry", owner=owner)
        require(ledger, Ledger, parameter="ledger", owner=owner)
        require_environ(environ, owner=owner)
        self.app = app
        try:
            config = as_config(config, check_env=False)  # it forwards no credential
        except ConfigError as exc:
            self._refusal = ConfigRefusal(exc)
            return
        # The provider keys, only to keep them out of what telemetry records of a request
        # (a caller's tenant or model set to one): request/secrets.py.
        self._credentials = CredentialCache(environ)
        # Where the requests refused here leave their usage record, as the budget guard's
        # settlement does for every other routed request.
        self.ledger = ledger
        static = RouteTable(config.routes, config.upstreams)
        # `table` lets a route store swap the routes at run time without touching us.
        self.table = table or (lambda: static)
        self.tenant_header = config.gateway.tenant_header.encode()
        self.session_header = config.gateway.session_header.encode()
        # Read in one pass per request: the tenant, the session, the caller's deadline.
        self.read_headers = (
            canonical_name(self.tenant_header),
            canonical_name(self.session_header),
            b"x-gateway-deadline-ms",
        )
        # ... and the method-override fields, in the same pass (`identity_headers`).
        self.read_or_override = frozenset(self.read_headers) | METHOD_OVERRIDE_FIELDS
        # SPEC §12 `strip_headers` / `strip_query_keys`: caller credentials beyond §4's list.
        self.strip_headers = frozenset(
            canonical_name(name.encode("latin-1", "replace"))
            for name in config.gateway.strip_headers
        )
        self.strip_query_keys = frozenset(
            canonical_query_key(key.encode("latin-1", "replace"))
            for key in config.gateway.strip_query_keys
        )
        self.default_deadline_ms = config.gateway.deadline_ms
        self.max_header_bytes = config.gateway.max_header_bytes
        self.max_header_count = config.gateway.max_header_count
        self.in_flight = InFlight(config.gateway.max_concurrency)
        self.telemetry = telemetry
        self._table_cache: _TableFacts | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._refusal is not None:
            await self._refusal(scope, receive, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = monotonic()
        headers = scope.get("headers", ())
        max_bytes, max_count = self.max_header_bytes, self.max_header_count
        try:
            refusal = header_refusal(headers, max_bytes=max_bytes, max_count=max_count)
        except TypeError:  # a field as a list, or text: made a tuple of bytes (`byte_fields`)
            headers = byte_fields(headers)
            refusal = header_refusal(headers, max_bytes=max_bytes, max_count=max_count)
        raw_path = raw_routed_path(scope)
        path = None if raw_path is None else normalise_path(raw_path)
        table = self.table()
        (tenant_text, session, deadline_text), twice, override_values = identity_headers(
            headers, self.read_headers, self.read_or_override
        )
        tenant = tenant_text or "default"
        # As sent: method tokens are case-sensitive (RFC 9110 §9.1), `get` is not GET.
        method = scope["method"]
        route, refused = table.resolve_view(method, path, tenant) if path else (None, None)
        if route is None and refused is None:
            await self.app(scope, receive, send)
            return
        route = route or refused
        assert route is not None
        if headers is not scope.get("headers", ()):
            scope["headers"] = headers  # bytes for every layer behind us (a routed request)
        # Read once (nothing below awaits): most requests carry no query, no override
        # and no deadline of their own, and nothing is asked about those.
        query = scope.get("query_string") or b""  # None (an adapter's "no query") too
        # A method-override field naming a method the route does not forward: the upstream
        # would act on that method (a DELETE through a route that forwards GET and POST).
        overrides = (
            override_methods(headers, method)
            if override_values is None
            else named_methods(override_values, method)
            if override_values
            else NO_METHODS  # none sent (the usual request): no call
        )
        # ... or a `_method` query parameter (Laravel, Express, Rack): the same request.
        if query:
            in_query = query_override_methods(query, method)
            if in_query:
                overrides = overrides | in_query
        overridden = [m for m in overrides if m not in route.accepted_methods] if overrides else []
        configured_ms = effective_deadline_ms(route, self.default_deadline_ms, None)
        deadline_ms = configured_ms
        if deadline_text is not None:
            requested = requested_deadline_ms(deadline_text)
            deadline_ms = effective_deadline_ms(route, self.default_deadline_ms, requested)
        assert path is not None and raw_path is not None
        _, auth, credential_names, provider, varied = self._table_facts(table)
        # Positional (a class called with keywords builds a dict of them for every call):
        # the route, the upstreams, tenant, session, method, path, query, deadline, the
        # configured and the caller's deadline, mount, vary, the spelled path, overrides,
        # started, the auth headers, the path's model, secrets.
        context = RequestContext.routed(
            route, table.upstream_views, tenant, session, method, path,
            strip_query_keys(query, self.strip_query_keys) if query else query,
            started + deadline_ms / 1000, configured_ms,
            deadline_ms if deadline_ms < configured_ms else None,
            mount_spelling(scope) if scope.get("root_path") else "",
            as_spelled(scope, vary) if (vary := varied.get(route.id)) else (),
            caller_spelling(raw_path, route.prefix) if "%" in raw_path else None,
            overrides, started, auth, path_model(path),
            RequestSecrets(
                headers,
                query,
                credential_names,  # names
                self.strip_query_keys,  # query_keys
                provider,  # provider
            ),
        )  # fmt: skip
        # Attached before the refusals below too: a 405 / 431 / 503 answered here is this
        # route's answer, and `fallback-mw request` reads the route's records from here.
        scope[SCOPE_KEY] = context
        # The request span, its metrics and its log line around everything behind us
        # (`Telemetry.request`'s scope, called directly: the context is new, so ours).
        telemetry = self.telemetry
        if telemetry is not None:
            telemetry.request_started(context, headers)
        try:
            if refusal is not None:
                # A local refusal before anything else runs: no body read, no upstream
                # contacted, still one span and one log line.
                message, rule = refusal
                await send_error(send, context, "headers_too_large", message, rule=rule)
                await self._record(context)
                return
            if twice is not None:
                # Which one would be the caller's? A proxy in front that adds its own field
                # beside the caller's (Envoy's default append) would let the caller's win.
                name = twice.decode("latin-1")
                await send_error(
                    send, context, "bad_request",
                    f"{name!r} was sent more than once with different values: it names the "
                    "request's identity (tenant_header / session_header), so it must be sent "
                    "once; a proxy in front must replace the caller's field, not add a second",
                    rule="identity_header",
                )  # fmt: skip
                await self._record(context)
                return
            if refused is not None:
                # The caller's token, unless it carries one of the request's credentials.
                shown = recordable(context.secrets, method)
                await send_error(
                    send, context, "method_not_allowed", _not_forwarded(route.id, shown),
                    headers=[(b"allow", ", ".join(DEFAULT_METHODS).encode())],
                )  # fmt: skip
                await self._record(context)
                return
            if overridden:
                # The caller's value is not echoed: it may be anything up to the head limit.
                await send_error(
                    send, context, "method_not_allowed",
                    "a method-override header (X-HTTP-Method-Override and its kin) or a "
                    "_method query parameter asks for "
                    f"a method route {route.id!r} does not forward (it forwards "
                    f"{', '.join(route.accepted_methods)}); to forward it, add that method to "
                    "the route's methods beside those",
                    headers=[(b"allow", ", ".join(route.accepted_methods).encode())],
                )  # fmt: skip
                await self._record(context)
                return
            if not self.in_flight.try_enter():
                limit = self.in_flight.limit
                message = (
                    f"more than {limit} requests in flight (max_concurrency); retry after "
                    "the Retry-After seconds, or raise max_concurrency"
                )
                # Nothing was sent upstream: a retry is safe, and the slots free as the
                # requests in flight end. Without the header SDKs retry at once.
                await send_error(send, context, "overloaded", message, headers=list(_RETRY_SOON))
                await self._record(context)
                return
            try:
                await self.app(scope, receive, send)
            finally:
                self.in_flight.leave()
        finally:
            if telemetry is not None:
                telemetry.request_finished(context)

    def _table_facts(self, table: RouteTable) -> _TableFacts:
        """What the resolver reads of a route table, made once per table (again only
        when a route store swaps it): the credential headers stripped from callers (the
        table's and `strip_headers`), every name a caller's credential may come in (§4's
        and those), every provider key of its upstreams, and route id -> the request
        fields its answers vary by (RouteTable.tenant_varied, .session_varied: `Vary`)."""
        cached = self._table_cache
        if cached is not None and cached[0] is table:
            return cached
        auth = table.auth_headers | self.strip_headers
        upstreams = table.upstreams
        secrets = provider_secrets(self._credentials.credentials(upstreams), upstreams)
        chosen_by = (
            (self.tenant_header.lower(), table.tenant_varied),
            (self.session_header.lower(), table.session_varied),
        )
        varied: dict[str, tuple[bytes, ...]] = {}
        for route in table.routes:
            fields = tuple(field for field, ids in chosen_by if route.id in ids)
            if fields:
                varied[route.id] = fields
        cached = self._table_cache = (table, auth, CREDENTIAL_HEADERS | auth, secrets, varied)
        return cached

    async def _record(self, context: RequestContext) -> None:
        """The usage record of a request refused here: a 503 `overloaded` is an answer a
        customer got, which a game day's error rate and `fallback-mw usage` must see."""
        ledger = self.ledger
        if ledger is None:
            return
        with anyio.CancelScope(shield=True):
            await write_record(ledger, context, None, None)
