"""The route table: longest matching prefix on the normalised path, then method and tenant."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Final
from urllib.parse import quote, unquote

from fallback_mw.config import DEFAULT_METHODS, RouteConfig, UpstreamConfig
from fallback_mw.config.views import AnyRoute, RouteView, UpstreamView
from fallback_mw.security.fields import canonical_name
from fallback_mw.spelling import PATH_SAFE


def effective_deadline_ms(route: AnyRoute, default_ms: int, requested_ms: int | None = None) -> int:
    """SPEC §5: one deadline for the whole walk, the route's `deadline_ms`, else
    `[gateway] deadline_ms`; the caller's `x-gateway-deadline-ms` (`requested_ms`) may
    shorten it, never lengthen it. The resolver, the shadow copy and `check` all ask here."""
    deadline_ms = route.deadline_ms or default_ms
    if requested_ms is not None:
        deadline_ms = min(deadline_ms, requested_ms)
    return deadline_ms


def routed_path(scope: Mapping[str, Any]) -> str | None:
    """The path the gateway routes an HTTP scope on: the raw path as the caller sent it
    (`path`, quoted again, when the server gives no `raw_path`), below a mount's
    `root_path`, normalised (`normalise_path`). None: it cannot be made safe, and no route
    matches it. A middleware in front of the gateway that authorizes by path compares
    this, never `scope["path"]` (docs/security.md): `/public/../v1/chat` is routed to
    `/v1/`."""
    raw_path = raw_routed_path(scope)
    return None if raw_path is None else normalise_path(raw_path)


def raw_routed_path(scope: Mapping[str, Any]) -> str | None:
    """`routed_path` before normalising: the caller's spelling, below the mount point."""
    raw_path = _target_path(scope)
    if raw_path is None:
        return None
    root = scope.get("root_path")
    if root:
        raw_path = below_root(raw_path, root)
    return raw_path


def mount_spelling(scope: Mapping[str, Any]) -> str:
    """The mount point (`root_path`) as the caller's URL spells it, for a `Location` the
    gateway rewrites below it (`walker.stream`): as the request spelled it when its path
    holds it (`/t/acme%20corp` for a Starlette `Mount("/t/{tenant}")`), else quoted."""
    root = str(scope.get("root_path") or "")
    raw_path = _target_path(scope) if root else None
    if raw_path is None:
        return quote(root.rstrip("/"), safe=PATH_SAFE)
    return split_mount(raw_path, root)[0]


def _target_path(scope: Mapping[str, Any]) -> str | None:
    """The request target's path as the caller sent it (None: no route can match it)."""
    raw = scope.get("raw_path")
    if isinstance(raw, bytes):
        # UTF-8, as a percent-encoded path is read: a server that passes the caller's
        # bytes >= 0x80 as they came (granian) gets the path the caller wrote, never its
        # latin-1 reading re-encoded (`/v1/é` went out as `/v1/%C3%83%C2%A9`). Bytes that
        # are not UTF-8 match no route, as `%E9` does.
        try:
            raw_path = raw.decode()
        except UnicodeDecodeError:
            return None
    else:
        # No `raw_path` (optional in ASGI; Mangum passes None): `path` is decoded already.
        # Quoted again, the one decoding that routing does reads it as the caller sent it:
        # decoded twice, a `%252F` in a name was a separator, a `%3F` cut the path, and a
        # segment `%252e%252e` climbed out of its route's prefix into another's.
        raw_path = quote(scope.get("path", "/"), safe=PATH_SAFE)
    raw_path = raw_path.split("?", 1)[0]
    if raw_path[:1] != "/":
        origin = origin_form(raw_path)
        if origin is None:
            return None
        raw_path = origin
    return raw_path


# An absolute-form request target's scheme and authority (RFC 9112 §3.2.2).
_ABSOLUTE_FORM: Final = re.compile(r"https?://[^/?#]*", re.IGNORECASE)


def origin_form(target: str) -> str | None:
    """The path to route a request target on that does not start with `/` (RFC 9112
    §3.2), as uvicorn and granian hand it to the app: an absolute-form target
    (`GET http://host/v1/x`, a client using the gateway as its proxy), which hypercorn and
    daphne pass on as the path, is routed on its path, its authority dropped (the
    upstream's `Host` is the upstream's): routed as a path, it missed the `/v1/` route, and
    a `/` route forwarded `/http:/host/v1/x`. The asterisk form (`OPTIONS *`) asks about
    the server, not a resource: None, no route (a `/` route forwarded `OPTIONS /*`).
    Anything else is normalised as a path (`v1/x` is `/v1/x`)."""
    if target == "*":
        return None
    absolute = _ABSOLUTE_FORM.match(target)
    if absolute is None:
        return target
    return target[absolute.end() :] or "/"


def below_root(raw_path: str, root_path: str) -> str:
    """The path a mounted app routes on: below its `root_path` when the server or the
    framework put the mount point in front of the path (uvicorn `--root-path`, Starlette's
    `Mount`: `path` and `raw_path` hold it, `root_path` names it), as Starlette's own
    routing reads it. A path that does not start with the mount point is left as it is
    (servers that keep `root_path` out of `path`, e.g. daphne)."""
    return split_mount(raw_path, root_path)[1]


def split_mount(raw_path: str, root_path: str) -> tuple[str, str]:
    """(The mount point as `raw_path` spells it, or quoted when it does not hold it; the
    path below it, as `below_root` reads it.) `root_path` is decoded text and `raw_path`
    the caller's spelling: a mount point the caller percent-encodes (`/a b`, `/über`, a
    `Mount("/t/{tenant}")` matching `/t/acme%20corp`) is matched decoded, as Starlette
    matched it (compared as written, it never was, and every request below it went to
    the host app)."""
    root = root_path.rstrip("/")
    if not root:
        return "", raw_path
    spelled = root if raw_path.startswith(root) else _spelled_mount(raw_path, root)
    if spelled is not None:
        rest = raw_path[len(spelled) :]
        if not rest or rest.startswith("/"):
            return quote(spelled, safe=PATH_SAFE + "%"), rest or "/"
    return quote(root, safe=PATH_SAFE), raw_path


def _spelled_mount(raw_path: str, root: str) -> str | None:
    """The start of `raw_path` that is mount point `root` percent-encoded: as many
    segments as it has, decoded. None: no such start."""
    count = root.count("/")
    parts = raw_path.split("/", count + 1)
    if "%" not in raw_path or len(parts) <= count:
        return None
    spelled = "/".join(parts[: count + 1])
    return spelled if unquote(spelled) == root else None


def normalise_path(raw_path: str) -> str | None:
    """Percent-decode once, then resolve dot segments and empty segments, so that neither
    `..`, `%2e%2e` nor an encoded `/` or `\\` can move a request out of a prefix.
    Returns None for paths that cannot be made safe (NUL, climbing above the root)."""
    # Nothing for `_normalise` to change (no escape, backslash or NUL, no empty segment,
    # none beginning with a dot: `.`, `..`, `..;x`, and `/.well-known`, which it keeps;
    # no fragment): the path as sent, without the loop (the path of nearly every request).
    if (
        raw_path[:1] == "/"
        and "%" not in raw_path
        and "#" not in raw_path
        and "//" not in raw_path
        and "/." not in raw_path
        and "\\" not in raw_path
        and "\x00" not in raw_path
    ):
        return raw_path
    return _normalise(raw_path)


def _normalise(raw_path: str) -> str | None:
    # A fragment is never part of a request target (RFC 9112 §3.2): uvicorn and granian
    # drop it, hypercorn and daphne pass it on in the path, where `/v1/x#frag` went out
    # as `/v1/x%23frag`. Cut before decoding: `%23` is a `#` in a segment name.
    raw_path = raw_path.split("#", 1)[0]
    try:
        decoded = unquote(raw_path, errors="strict") if "%" in raw_path else raw_path
    except UnicodeDecodeError:
        return None  # not UTF-8 once decoded: matches no route, the host app decides
    if "\x00" in decoded:
        return None
    decoded = decoded.replace("\\", "/")
    if not decoded.startswith("/"):
        decoded = "/" + decoded
    last = decoded.rsplit("/", 1)[-1].split(";", 1)[0]
    trailing = decoded.endswith("/") or last in (".", "..")
    segments: list[str] = []
    for segment in decoded.split("/"):
        # `..;x=1` is a dot segment with a path parameter: servlet containers (and others)
        # drop the parameter and climb, so it is resolved here as the dot segment it is.
        dot = segment.split(";", 1)[0]
        if segment == "" or dot == ".":
            continue
        if dot == "..":
            if not segments:
                return None
            segments.pop()
            continue
        segments.append(segment)
    path = "/" + "/".join(segments)
    if trailing and path != "/":
        path += "/"
    return path


class RouteTable:
    """Immutable snapshot of the routes; hot reload swaps the whole table.

    Matching costs the same with 2,000 routes as with 2 (every request pays it, those for
    the host app too): routes are indexed by prefix, and a request looks up its path cut
    at each prefix length in use, longest first, instead of comparing every route."""

    def __init__(
        self, routes: Iterable[RouteConfig], upstreams: Mapping[str, UpstreamConfig]
    ) -> None:
        # Longest prefix first; a tenant-specific route beats a tenant-less one of equal prefix.
        self.routes = tuple(sorted(routes, key=lambda r: (-len(r.prefix), r.tenant is None, r.id)))
        # Prefix -> (tenant -> its routes, the tenant-less routes), each in table order: as
        # views, which the request path reads (config/views.py).
        index: dict[str, tuple[dict[str, list[RouteView]], list[RouteView]]] = {}
        for route in map(RouteView, self.routes):
            by_tenant, any_tenant = index.setdefault(route.prefix, ({}, []))
            if route.tenant is None:
                any_tenant.append(route)
            else:
                by_tenant.setdefault(route.tenant, []).append(route)
        self._by_prefix = {
            prefix: ({t: tuple(rs) for t, rs in by_tenant.items()}, tuple(any_tenant))
            for prefix, (by_tenant, any_tenant) in index.items()
        }
        self._lengths = tuple(sorted({len(prefix) for prefix in index}, reverse=True))
        # The routes whose answers vary by the tenant header (a shared cache must key them by
        # it: `Vary`): a tenant's own route, and one that a tenant's route of the same or a
        # longer prefix takes some paths from for that tenant. A shorter prefix never does:
        # the longest prefix is matched first. (Every start of a tenant route's prefix, in
        # one set: comparing each route with every other took seconds at 2,000 routes.)
        below_tenant_routes = {
            route.prefix[:end]
            for route in self.routes
            if route.tenant is not None
            for end in range(1, len(route.prefix) + 1)
        }
        self.tenant_varied = frozenset(
            route.id
            for route in self.routes
            if route.tenant is not None or route.prefix in below_tenant_routes
        )
        # ... and those whose answers vary by the session header: a canary slice sends some
        # sessions to another candidate first (plan.is_canary).
        self.session_varied = frozenset(
            route.id
            for route in self.routes
            if route.canary_eligible and route.canary_percent > 0 and len(route.plan) > 1
        )
        self.upstreams = dict(upstreams)
        # What a routed request's context holds (`RequestContext.upstreams`): made once.
        self.upstream_views = {name: UpstreamView(u) for name, u in self.upstreams.items()}
        # A caller's copy of any upstream's own auth header is a caller credential too.
        # In canonical form (`_` read as `-`), as forwardable_request_headers compares.
        self.auth_headers = frozenset(
            canonical_name(u.auth_header.encode()) for u in self.upstreams.values()
        )

    def _prefixes_of(self, path: str) -> Iterator[str]:
        """The route prefixes that take `path`, longest first: "/v1/" takes "/v1/chat" and
        also exactly "/v1"."""
        by_prefix = self._by_prefix
        if path + "/" in by_prefix:
            yield path + "/"
        size = len(path)
        for length in self._lengths:
            if length <= size and path[:length] in by_prefix:
                yield path[:length]

    def covers(self, path: str) -> bool:
        """Whether a route's prefix takes `path`, whatever the method and tenant (as
        `resolve` matches a prefix)."""
        return next(self._prefixes_of(path), None) is not None

    def match(self, method: str, path: str, tenant: str) -> RouteConfig | None:
        return self.resolve(method, path, tenant)[0]

    def resolve(
        self, method: str, path: str, tenant: str
    ) -> tuple[RouteConfig | None, RouteConfig | None]:
        """(the route that takes the request, None) or, when none does, (None, the route
        that refuses its method): a route without `methods` owns its paths for every
        method, forwarding DEFAULT_METHODS and answering any other with a local 405. A
        method a route's explicit `methods` leaves out goes on (another route, or the
        host app)."""
        route, refused = self.resolve_view(method, path, tenant)
        return (
            None if route is None else route.config,
            None if refused is None else refused.config,
        )

    def resolve_view(
        self, method: str, path: str, tenant: str
    ) -> tuple[RouteView | None, RouteView | None]:
        """`resolve`, answering the routes' views (what the resolver puts in a request's
        context)."""
        # The prefixes in `_prefixes_of`'s order, without its generator: one left
        # unfinished (a route found) is closed by raising GeneratorExit into it, about
        # 2,000 instructions on every routed request.
        by_prefix = self._by_prefix
        entry = by_prefix.get(path + "/")
        route, refused = (None, None) if entry is None else _take(entry, method, tenant, None)
        if route is not None:
            return route, None
        size = len(path)
        for length in self._lengths:
            if length <= size and (entry := by_prefix.get(path[:length])) is not None:
                route, refused = _take(entry, method, tenant, refused)
                if route is not None:
                    return route, None
        return None, refused


def _take(
    entry: tuple[dict[str, tuple[RouteView, ...]], tuple[RouteView, ...]],
    method: str,
    tenant: str,
    refused: RouteView | None,
) -> tuple[RouteView | None, RouteView | None]:
    """`RouteTable.resolve` at one prefix: (the route that takes the request, None), or
    (None, the first route so far that refuses its method)."""
    by_tenant, any_tenant = entry
    for routes in (by_tenant.get(tenant, ()), any_tenant):
        for route in routes:
            if route.methods is None:
                if method in DEFAULT_METHODS:
                    return route, None
                refused = refused or route
                continue
            if method not in route.methods:
                continue
            return route, None
    return None, refused
