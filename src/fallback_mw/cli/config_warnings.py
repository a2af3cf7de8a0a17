"""What is valid but probably not meant in a configuration that loads: per route (a provider's
transient status not failed over on, timeouts the deadline cuts, a hedge or shadow no
request can use, a slice that sends nothing), per credential (unset, cleartext, shared), and
for the whole (strip defaults dropped, proxy variables ignored, routes no request reaches).
`check` prints them under what they concern; `serve` says them at its start. Names only,
never a value. The credentials' own are cli/credential_warnings.py's."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from fallback_mw.cli.credential_warnings import (
    cleartext_credential_warnings,
    credential_warnings,
)
from fallback_mw.cli.target import (
    missing_sqlite_file,
    no_store_file,
    relative_store_elsewhere,
)
from fallback_mw.config import (
    GatewayConfig,
    GatewaySettings,
    RouteConfig,
    UpstreamConfig,
)
from fallback_mw.failover.outcome import CREDENTIAL_STATUSES
from fallback_mw.routing import RouteTable, effective_deadline_ms
from fallback_mw.security.fields import DEFAULT_STRIP_HEADERS
from fallback_mw.security.queries import DEFAULT_STRIP_QUERY_KEYS
from fallback_mw.store.ledgers.schema import LATEST_VERSION as LATEST_LEDGER_VERSION
from fallback_mw.store.routes import MergedRoutes


def ledger_migration(version: int) -> str | None:
    """The warning for a store whose ledger an older version wrote: this package migrates it
    on first use, one way (docs/operations.md, Upgrading)."""
    if not 0 < version < LATEST_LEDGER_VERSION:
        return None
    return (
        f"the store's ledger schema is version {version}: this package migrates it to "
        f"version {LATEST_LEDGER_VERSION} on its first use (a gateway's first budgeted "
        "request or usage record; budgets, usage, capacity), after which a gateway of an "
        "older version refuses it as it starts, or at its first use of the ledger: upgrade "
        "every process that shares this store to this version"
    )


def replay_kinds(route: RouteConfig) -> tuple[list[str], bool]:
    """The route's methods that may be sent twice (a replayable method the route does not
    take never reaches it), and whether a POST with an Idempotency-Key may be too."""
    taken = route.accepted_methods
    methods = [m for m in route.replayable_methods if m in taken]
    keyed = (
        route.replay_with_idempotency_key
        and "POST" in taken
        and "POST" not in route.replayable_methods
    )
    return methods, keyed


def replayable(route: RouteConfig) -> str:
    """The route's methods that may fail over, the Idempotency-Key opt-in included."""
    methods, keyed = replay_kinds(route)
    if not methods and not keyed:
        return f"none of its methods ({' '.join(route.accepted_methods)})"
    text = " ".join(methods)
    if keyed:
        text += " + " if text else ""
        text += "POST with an Idempotency-Key header (replay_with_idempotency_key)"
    return text


def pooled(route: RouteConfig, upstreams: Mapping[str, UpstreamConfig]) -> list[str]:
    return [name for name in route.plan if len(upstreams[name].credential_envs) > 1]


# Statuses a provider answers when it is briefly unable to serve, which a route whose
# candidate declares that provider should fail over on (docs/llm.md has the table).
PROVIDER_TRANSIENT = {"anthropic": (529, "Anthropic's overloaded_error")}


def route_warnings(
    route: RouteConfig,
    upstreams: Mapping[str, UpstreamConfig],
    default_ms: int,
    *,
    store: bool = False,
) -> list[str]:
    """What is valid but probably not meant: a declared provider's transient status that
    the route does not fail over on; a candidate whose connect or first-byte timeout the
    route deadline cuts, so that a hang on it never reaches the next candidate; a backoff
    before a repeat that the deadline always outlasts; a candidate whose url path the route prefix
    repeats (`/v1` + `/v1/...`); a prefix that does not end at a segment boundary; a
    credential pool on a route of one attempt, which never moves to another key.
    `store`: a route store's route, whose upstreams' timeouts no admin verb sets, so the
    remedy named is the one an operator has."""
    warnings = []
    if not route.prefix.endswith("/"):
        # A prefix is literal (SPEC §4, the longest match): /v1 also takes /v1x/... and
        # /v1-admin/..., with the route's credentials, to its upstreams.
        warnings.append(
            f"the route prefix {route.prefix} is matched as written, so it also takes "
            f"{route.prefix}x/... and {route.prefix}-anything/... to its candidates; end it "
            f"with '/' ({route.prefix}/) to take only the paths below {route.prefix}/"
        )
    deadline = effective_deadline_ms(route, default_ms)
    for name in _followed(route):
        upstream = upstreams[name]
        for key, timeout_ms, what in (
            ("connect_timeout_ms", upstream.connect_timeout_ms,
             "a connect that is never answered (a host that is down, a firewall that drops)"),
            ("first_byte_timeout_ms", upstream.first_byte_timeout_ms, "a hang on it"),
        ):  # fmt: skip
            if timeout_ms < deadline:
                continue
            remedy = (
                f"raise [gateway] deadline_ms above {timeout_ms}, or define the route in the "
                f"config file, where its upstream's {key} can be lowered"
                if store
                else f"lower its {key}"
            )
            warnings.append(
                f"candidate {name!r} has {key} {timeout_ms}, not below the route deadline "
                f"({deadline} ms): {what} ends in 504 deadline_exceeded, never a fallback; "
                f"{remedy}"
            )
    if route.attempt_ceiling > len(route.plan) and route.backoff_ms >= deadline:
        # A later pass repeats a candidate, after backoff_ms: the deadline ends it first.
        warnings.append(
            f"a repeat of a candidate first waits backoff_ms {route.backoff_ms}, not below the "
            f"route deadline ({deadline} ms): it can never run, and a walk that needs it ends "
            "in 504 deadline_exceeded; lower backoff_ms"
        )
    for name in route.plan:
        base = urlsplit(upstreams[name].url).path.rstrip("/")
        if base and (route.prefix == base or route.prefix.startswith(base + "/")):
            # The request path is appended to the url's: an SDK's documented base URL
            # (https://api.openai.com/v1) behind a /v1/ route reaches /v1/v1/..., a 404.
            warnings.append(
                f"candidate {name!r} has url path {base} and the route prefix is "
                f"{route.prefix}: the request path is appended, so requests reach "
                f"{base}{route.prefix}...; drop {base} from its url"
            )
    if route.hedge_after_ms and route.hedge_after_ms >= deadline:
        warnings.append(
            f"hedge_after_ms {route.hedge_after_ms} is not below the route deadline "
            f"({deadline} ms): the hedge never starts; lower hedge_after_ms (a little above "
            "the primary's usual time to first byte)"
        )
    warnings.extend(_slice_warnings(route))
    statuses = sorted(CREDENTIAL_STATUSES.difference(route.failover_status))
    if route.attempt_ceiling < 2 and statuses and not replayable(route).startswith("none "):
        # The move to another key of a pool is an attempt like any other (SPEC §5, §6); a
        # route none of whose requests is replayable never moves, whatever its retries.
        for name in pooled(route, upstreams):
            warnings.append(
                f"candidate {name!r} is a credential pool, but the route makes one attempt "
                f"(retries = {route.retries}): a {'/'.join(map(str, statuses))} from one of "
                f"its keys is served as-is, never retried with another; raise retries (each "
                "further key is an attempt)"
            )
    for name in route.plan:
        provider = upstreams[name].provider
        if provider in PROVIDER_TRANSIENT and len(route.plan) > 1:
            status, meaning = PROVIDER_TRANSIENT[provider]
            if status not in route.failover_status:
                warnings.append(
                    f"candidate {name!r} is provider {provider}, and {status} ({meaning}) is "
                    f"not in failover_status: add {status} to fail over when it is overloaded"
                )
    return warnings


def _slice_warnings(route: RouteConfig) -> list[str]:
    """A canary or shadow share that no request can ever be in, or a hedge none can
    have: configured, and silently empty (SPEC §8: only eligible routes, and only their
    second candidate; a hedge or a copy only of a replayable request)."""
    warnings = []
    if route.canary_percent > 0 and not route.canary_eligible:
        warnings.append(
            f"canary_percent {route.canary_percent:g} has no effect: the route is not "
            "canary_eligible, so no session is sent to its second candidate first; set "
            "canary_eligible = true, or remove canary_percent"
        )
    elif route.canary_percent > 0 and len(route.plan) < 2:
        warnings.append(
            f"canary_percent {route.canary_percent:g} has no effect: the canary is the "
            "plan's second candidate, and this plan has one; add the candidate to test"
        )
    if route.shadow_percent > 0 and route.shadow is None:
        warnings.append(
            f"shadow_percent {route.shadow_percent:g} has no effect: the route names no "
            "shadow upstream to copy requests to; set shadow = NAME, or remove shadow_percent"
        )
    # A hedge and a shadow copy each send the request a second time: only a replayable
    # one (failover.replay.may_hedge, shadow.should_shadow). On a route none of whose requests is,
    # neither is ever sent, and a request not copied is not counted anywhere.
    methods, keyed = replay_kinds(route)
    taken = " ".join(route.accepted_methods)
    if route.hedge_after_ms and not methods and not (keyed and route.hedge_idempotent_posts):
        remedy = (
            "set hedge_idempotent_posts = true to hedge a POST that carries an "
            "Idempotency-Key, or add POST to replayable_methods"
            if keyed
            else f"add {route.accepted_methods[0]} to replayable_methods"
        )
        warnings.append(
            f"hedge_after_ms {route.hedge_after_ms} has no effect: none of the route's "
            f"methods ({taken}) is replayable, and a hedge is a second attempt; {remedy}"
        )
    if route.shadow is not None and route.shadow_percent > 0 and not methods and not keyed:
        remedy = f"add {route.accepted_methods[0]} to replayable_methods"
        if "POST" in route.accepted_methods:
            remedy = (
                "add POST to replayable_methods, or set replay_with_idempotency_key = true "
                "to copy a POST that carries an Idempotency-Key"
            )
        warnings.append(
            f"shadow {route.shadow!r} gets no copy: none of the route's methods ({taken}) "
            f"is replayable, and only a replayable request is copied; {remedy}"
        )
    return warnings


def _followed(route: RouteConfig) -> list[str]:
    """The candidates an attempt at which may be followed by another one."""
    ceiling = route.attempt_ceiling
    if ceiling <= 1:
        return []
    sequential = route.strategy == "sequential" and not route.canary_eligible
    if sequential and ceiling <= len(route.plan):  # the last one within reach ends the walk
        return list(route.plan[: ceiling - 1])
    return list(route.plan)


# The proxy variables client libraries read when they trust the environment. Neither engine
# does (trust_env off): a proxy taken from the environment would get none of the checks a
# configured `proxy` gets (allowlist, metadata guard, no credentials in its URL).
PROXY_VARIABLES = ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY")


def dropped_strip_defaults(settings: GatewaySettings) -> list[str]:
    """Warnings for a `strip_headers` / `strip_query_keys` list that leaves out defaults:
    a list replaces the defaults (docs/configuration.md), so the caller credentials it
    does not name again reach every upstream (SPEC §4, §12)."""
    warnings = []
    for key, given, defaults in (
        ("strip_headers", settings.strip_headers, DEFAULT_STRIP_HEADERS),
        ("strip_query_keys", settings.strip_query_keys, DEFAULT_STRIP_QUERY_KEYS),
    ):
        dropped = [name for name in defaults if name not in given]
        if dropped:
            warnings.append(
                f"[gateway] {key} replaces its defaults: {', '.join(dropped)} from callers "
                "now reach the upstreams; list them too to keep removing them"
            )
    return warnings


def ignored_proxy_variables(
    upstreams: Mapping[str, UpstreamConfig], environ: Mapping[str, str], *, store: bool = False
) -> str | None:
    """A warning when a proxy variable is set (names only, never its value: a proxy URL
    may carry a password) while upstreams without `proxy` will be contacted directly
    (`store`: the route store's too, which the admin CLI creates without one)."""
    found = [
        spelling
        for name in PROXY_VARIABLES
        for spelling in (name, name.lower())
        if environ.get(spelling, "").strip()
    ]
    direct = [repr(name) for name, upstream in upstreams.items() if upstream.proxy is None]
    if store:
        direct.append("the route store's")
    if not found or not direct:
        return None
    return (
        f"{', '.join(found)} set in the environment, but the gateway does not read proxy "
        f"variables: upstreams {', '.join(direct)} are contacted directly; set `proxy` on "
        "an upstream to send it through an egress proxy"
    )


def unreachable_routes(
    routes: Sequence[RouteConfig], upstreams: Mapping[str, UpstreamConfig]
) -> dict[str, str]:
    """Route id -> why no request can ever reach it: routes of the same prefix and tenant
    that come first in the route table (its tie-break is the id) take every method it
    accepts. Valid, but almost always a copy-paste or a store route added over a file one."""
    taken: dict[tuple[str, str | None], list[RouteConfig]] = {}
    found: dict[str, str] = {}
    for route in RouteTable(routes, upstreams).routes:
        before = taken.setdefault((route.prefix, route.tenant), [])
        methods = {method for earlier in before for method in earlier.accepted_methods}
        if before and methods.issuperset(route.accepted_methods):
            # Only those that take some of its methods: a POST-only route beside it takes
            # none of a GET route's requests.
            wanted = set(route.accepted_methods)
            takers = [e for e in before if not wanted.isdisjoint(e.accepted_methods)]
            names = ", ".join(repr(earlier.id) for earlier in takers)
            verb = "takes" if len(takers) == 1 else "take"
            found[route.id] = (
                f"no request can reach this route: {names} (same prefix and tenant, first in "
                f"the route table) {verb} every method it accepts; give it another prefix, "
                "tenant or methods, or remove it"
            )
        before.append(route)
    return found


@dataclass(frozen=True, slots=True)
class Warnings:
    """What `check` warns about a configuration that loads, by where it prints each:
    `store` under its store line, `routes` under each route (by id, in route order),
    `general` after the routes. `serve` says the same at its start (`lines`)."""

    store: list[str]
    routes: dict[str, list[str]]
    general: list[str]

    def count(self) -> int:
        return len(self.store) + sum(map(len, self.routes.values())) + len(self.general)

    def lines(self) -> list[str]:
        """Every warning as one line, a route's named: `serve` prints them so."""
        routes = [f"route {rid!r}: {w}" for rid, found in self.routes.items() for w in found]
        return [*self.store, *routes, *self.general]


def config_warnings(
    config_path: str,
    config: GatewayConfig,
    merged: MergedRoutes,
    from_store: set[str],
    ledger_version: int = 0,
) -> Warnings:
    """Everything valid but probably not meant in the configuration at `config_path`, its
    store's routes (`merged`, from `resolve_routes`) and ledger schema version included.
    Names only, never a value."""
    settings = config.gateway
    store: list[str] = []
    if settings.store is not None:
        migration = ledger_migration(ledger_version)
        if migration is not None:
            store.append(migration)
        elsewhere = relative_store_elsewhere(config_path, settings.store)
        if elsewhere is not None:
            store.append(elsewhere)
        absent = missing_sqlite_file(settings.store)
        if absent is not None:
            store.append(no_store_file(absent))
    unreachable = unreachable_routes(merged.routes, merged.upstreams)
    routes: dict[str, list[str]] = {}
    for route in merged.routes:
        found = route_warnings(
            route, merged.upstreams, settings.deadline_ms, store=route.id in from_store
        )
        if route.id in unreachable:
            found.append(unreachable[route.id])
        routes[route.id] = found
    general = credential_warnings(merged.upstreams, merged.routes, os.environ)
    general += cleartext_credential_warnings(merged.upstreams, merged.routes, settings.allow_hosts)
    general += dropped_strip_defaults(settings)
    breaker = settings.breaker
    if breaker.min_calls > breaker.window:
        # The window keeps the last `window` outcomes: it never holds min_calls of them.
        general.append(
            f"[gateway.breaker] min_calls ({breaker.min_calls}) is larger than window "
            f"({breaker.window}): the window never holds min_calls outcomes, so no breaker "
            "ever opens; lower min_calls or raise window"
        )
    ignored = ignored_proxy_variables(
        merged.upstreams, os.environ, store=settings.store is not None
    )
    if ignored is not None:
        general.append(ignored)
    if not merged.routes:
        general.append("no routes: every request goes to the host app (serve: 404)")
    return Warnings(store=store, routes=routes, general=general)
