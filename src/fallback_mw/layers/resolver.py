"""RouteResolver: which route? Attaches the per-request context; everything else passes.

With telemetry attached it owns the request span (and the duration metric and the log
line): opened once the route is known, closed when every layer behind it has returned, so
the budget guard's hold and settlement are inside it."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterable, Mapping

import anyio

from fallback_mw.budget import Ledger
from fallback_mw.config import DEFAULT_METHODS, ConfigError, ConfigSource, as_config
from fallback_mw.credentials import CredentialCache
from fallback_mw.injected import require, require_app, require_callable, require_environ
from fallback_mw.layers.limits import InFlight, byte_fields, header_refusal
from fallback_mw.request.body import path_model
from fallback_mw.request.config_refusal import ConfigRefusal
from fallback_mw.request.context import SCOPE_KEY, RequestContext
from fallback_mw.request.local_errors import send_error
from fallback_mw.request.record import write_record
from fallback_mw.request.secrets import RequestSecrets, provider_secrets, recordable
from fallback_mw.request.types import ASGIApp, Receive, Scope, Send
from fallback_mw.routing import (
    RouteTable,
    caller_spelling,
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
    canonical_query_key,
    query_override_methods,
    strip_query_keys,
)
from fallback_mw.telemetry import Telemetry

# More digits than this is longer than any deadline (600000 ms): it can shorten nothing.
_DEADLINE_DIGITS = 7
# A 503 overloaded's Retry-After: whole seconds, the smallest (slots free as requests end).
_RETRY_SOON = ((b"retry-after", b"1"),)
_OWS = " \t"  # optional whitespace around a field value (RFC 9110 §5.6.3)


def requested_deadline_ms(text: str | None) -> int | None:
    """The caller's `x-gateway-deadline-ms`, strictly: 1..7 ASCII digits, > 0. Anything
    else (other Unicode digits such as `²`, signs, decimals, a 5,000-digit number) is
    ignored: the route deadline applies. The header can only shorten a deadline, so a
    value it cannot read asks for nothing."""
    if text is None:
        return None
    text = text.strip()
    if not 0 < len(text) <= _DEADLINE_DIGITS or not (text.isascii() and text.isdigit()):
        return None
    value = int(text)
    return value if value > 0 else None


def _headers(
    headers: Iterable[tuple[bytes, bytes]], names: tuple[bytes, ...], wanted: frozenset[bytes]
) -> tuple[list[str | None], bytes | None, list[bytes] | None]:
    """The first value of each named header (stripped, None when absent or empty; the
    deadline's None when sent twice), in one pass over the request's headers; the first
    of `names[:2]` (the identity headers) sent twice with different values (in two
    fields, or in one joined by commas), or None; and the values of the method-override
    fields (METHOD_OVERRIDE_FIELDS, for `named_methods`), in order, read in the same pass
    (`wanted`: `names` and those fields), or None when a name could not be looked up so
    (unhashable: a `bytearray`, where ASGI sends bytes): `override_methods` reads them."""
    found: list[str | None] = [None] * len(names)
    seen = [False] * len(names)
    twice: bytes | None = None
    overrides: list[bytes] | None = []
    for key, value in headers:
        # `x_tenant_id` is `x-tenant-id` to a WSGI-style upstream (HTTP_X_TENANT_ID): one
        # field, so a caller's underscore spelling beside a proxy's field is two.
        # (`canonical_name`, written out: a call per header is most of the pass's cost.)
        lower = key.lower().replace(b"_", b"-")
        try:
            hit = lower in wanted
        except TypeError:  # unhashable: compared as before, the overrides read apart
            hit, overrides = lower in names, None
        if not hit:
            continue
        if overrides is not None and lower in METHOD_OVERRIDE_FIELDS:
            overrides.append(value)
        for index, name in enumerate(names):
            if name == lower:
                try:  # UTF-8, as the engines forward it and as the config names it
                    text = value.decode()
                except UnicodeDecodeError:  # refused with a 400 before any upstream
                    text = value.decode("latin-1")
                # Only SP and HTAB surround a field value (RFC 9110 §5.5), as the
                # upstream reads it: "acme\u00a0" is not tenant "acme".
                text = text.strip(_OWS)
                if index < 2 and "," in text:
                    # Two fields of one name may reach us joined by a comma (RFC 9110
                    # §5.3; Node's http does so): "caller, proxy" is the field twice.
                    members = {m.strip(_OWS) for m in text.split(",")} - {""}
                    if len(members) > 1:
                        twice = twice or name
                    text = members.pop() if members else ""
                if not seen[index]:
                    seen[index] = True
                    found[index] = text or None
                elif index >= 2:
                    # The deadline sent twice is one field "50, 5000" (RFC 9110 §5.3),
                    # not 1-7 digits: ignored however the fields reach us (SPEC §12).
                    found[index] = None
                elif twice is None and (text or None) != found[index]:
                    twice = name
    return found, twice, overrides


def _as_spelled(scope: Scope, fields: tuple[bytes, ...]) -> tuple[bytes, ...]:
    """`fields` (the identity headers a route's answers vary by) and each spelling of them
    the request came with that a cache reads as another field: `x_tenant_id` is the tenant
    header to the resolver (`canonical_name`), not to a shared cache, which stored the
    answer it chose under "no tenant header" and served it to every caller sending none.
    Only a route whose answers vary pays for this pass."""
    read_as = {canonical_name(field) for field in fields}
    # Another spelling differs by an `_` (a name of ours without one: only a sent name
    # with one can be another spelling of it).
    # (`find`, not `in`: `bytes in bytes` raises and drops a TypeError on CPython 3.11.)
    any_name = any(field.find(b"_") >= 0 for field in fields)
    spelled: list[bytes] = []
    for key, _ in scope.get("headers", ()):
        if not any_name and key.find(b"_") < 0:
            continue
        lower = key.lower()
        if canonical_name(lower) in read_as and lower not in fields and lower not in spelled:
            spelled.append(lower)
    return (*fields, *spelled) if spelled else fields


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
        self._secrets_cache: tuple[RouteTable, tuple[bytes, ...]] | None = None
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
        # ... and the method-override fields, in the same pass (`_headers`).
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
        self._auth_cache: tuple[RouteTable, frozenset[bytes]] | None = None
        self._vary_cache: tuple[RouteTable, dict[str, tuple[bytes, ...]]] | None = None
        self._names_cache: tuple[RouteTable, frozenset[bytes]] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._refusal is not None:
            await self._refusal(scope, receive, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        headers = scope.get("headers", ())
        max_bytes, max_count = self.max_header_bytes, self.max_header_count
        try:
            refusal = header_refusal(headers, max_bytes=max_bytes, max_count=max_count)
        except TypeError:  # a text name or value: read as the bytes it spells (`byte_fields`)
            headers = byte_fields(headers)
            refusal = header_refusal(headers, max_bytes=max_bytes, max_count=max_count)
        raw_path = raw_routed_path(scope)
        path = None if raw_path is None else normalise_path(raw_path)
        table = self.table()
        (tenant_text, session, deadline_text), twice, override_values = _headers(
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
        query = scope.get("query_string", b"")
        # A method-override field naming a method the route does not forward: the upstream
        # would act on that method (a DELETE through a route that forwards GET and POST).
        overrides = (
            override_methods(headers, method)
            if override_values is None
            else named_methods(override_values, method)
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
            _as_spelled(scope, vary) if (vary := self._vary(table).get(route.id)) else (),
            caller_spelling(raw_path, route.prefix) if "%" in raw_path else None,
            overrides, started, self._auth_headers(table), path_model(path),
            RequestSecrets(
                headers,
                query,
                self._credential_names(table),  # names
                self.strip_query_keys,  # query_keys
                self._provider_secrets(table),  # provider
            ),
        )  # fmt: skip
        # Attached before the refusals below too: a 405 / 431 / 503 answered here is this
        # route's answer, and `fallback-mw request` reads the route's records from here.
        scope[SCOPE_KEY] = context
        with self._traced(context, scope):
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

    def _auth_headers(self, table: RouteTable) -> frozenset[bytes]:
        """The table's credential headers and `strip_headers`: one set per route table,
        made again only when a route store swaps the table."""
        cached = self._auth_cache
        if cached is None or cached[0] is not table:
            cached = self._auth_cache = (table, table.auth_headers | self.strip_headers)
        return cached[1]

    def _vary(self, table: RouteTable) -> dict[str, tuple[bytes, ...]]:
        """Route id -> the request fields its answers vary by (RouteTable.tenant_varied,
        .session_varied), named in `Vary`; once per route table."""
        cached = self._vary_cache
        if cached is None or cached[0] is not table:
            chosen_by = (
                (self.tenant_header.lower(), table.tenant_varied),
                (self.session_header.lower(), table.session_varied),
            )
            varied: dict[str, tuple[bytes, ...]] = {}
            for route in table.routes:
                fields = tuple(field for field, ids in chosen_by if route.id in ids)
                if fields:
                    varied[route.id] = fields
            cached = self._vary_cache = (table, varied)
        return cached[1]

    def _credential_names(self, table: RouteTable) -> frozenset[bytes]:
        """Every header name a caller's credential may come in: §4's and the table's."""
        cached = self._names_cache
        if cached is None or cached[0] is not table:
            cached = self._names_cache = (table, CREDENTIAL_HEADERS | self._auth_headers(table))
        return cached[1]

    def _provider_secrets(self, table: RouteTable) -> tuple[bytes, ...]:
        """Every provider key of the table's upstreams, once per route table."""
        cached = self._secrets_cache
        if cached is None or cached[0] is not table:
            upstreams = table.upstreams
            secrets = provider_secrets(self._credentials.credentials(upstreams), upstreams)
            cached = self._secrets_cache = (table, secrets)
        return cached[1]

    async def _record(self, context: RequestContext) -> None:
        """The usage record of a request refused here: a 503 `overloaded` is an answer a
        customer got, which a game day's error rate and `fallback-mw usage` must see."""
        ledger = self.ledger
        if ledger is None:
            return
        with anyio.CancelScope(shield=True):
            await write_record(ledger, context, None, None)

    def _traced(
        self, context: RequestContext, scope: Scope
    ) -> contextlib.AbstractContextManager[None]:
        if self.telemetry is None:
            return contextlib.nullcontext()
        return self.telemetry.request(context, scope.get("headers", ()))
