"""`fallback-mw check --config FILE`: validate as `serve` would start (like `nginx -t`),
and print the resolved routes, their plans and candidate URLs. Exit 0 valid, 2 refused
(SPEC §11: 0 or 2), a store that cannot be opened or reached included: `serve` refuses to
start on it with 2 too. A Redis `state` is tried once (one PING): unusable is a warning, as
`serve` starts on it, each process on its own breakers. Variable names are printed, never
their values."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from fallback_mw.budget.ledger import BudgetUnreadable, LedgerUnavailable
from fallback_mw.cli.app import Console, Refused, leaf, run
from fallback_mw.cli.target import (
    missing_sqlite_file,
    no_store_file,
    relative_sqlite_path,
    relative_store_elsewhere,
)
from fallback_mw.config import (
    GatewayConfig,
    GatewaySettings,
    RouteConfig,
    UpstreamConfig,
    load_config,
)
from fallback_mw.failover.decide import CREDENTIAL_STATUSES
from fallback_mw.routing import RouteTable, effective_deadline_ms
from fallback_mw.rules import shown_variable
from fallback_mw.security.addresses import Allowlist, parse_ip
from fallback_mw.security.fields import DEFAULT_STRIP_HEADERS
from fallback_mw.security.queries import DEFAULT_STRIP_QUERY_KEYS
from fallback_mw.store.ledgers import open_ledger
from fallback_mw.store.ledgers.schema import COMPONENT as LEDGER_COMPONENT
from fallback_mw.store.ledgers.schema import LATEST_VERSION as LATEST_LEDGER_VERSION
from fallback_mw.store.ledgers.schema import SchemaTooNew
from fallback_mw.store.ledgers.schema import check_version as check_ledger_version
from fallback_mw.store.model import StoreError
from fallback_mw.store.routes import MergedRoutes, merge_routes, open_store
from fallback_mw.store_url import StoreURLError, is_redis_url, parse_store_url


def resolve_routes(config: GatewayConfig) -> tuple[MergedRoutes, set[str], int]:
    """File routes merged with the store's, refused exactly as a starting gateway would; the
    ids of the store's; the version of the store's ledger schema (0: none yet, no store)."""
    url = config.gateway.store
    if url is None:
        return MergedRoutes(config.routes, dict(config.upstreams)), set(), 0

    async def load() -> tuple[MergedRoutes, int]:
        if missing_sqlite_file(url) is not None:  # like nginx -t, check creates nothing
            return merge_routes(config, [], environ=os.environ), 0
        store = open_store(url)
        try:
            stored = await store.load_routes()
            # The ledger shares the store; it is opened lazily, on a first request. One a
            # newer version migrated (a downgrade, an old process started beside new ones)
            # would refuse every budgeted request and drop every usage record: refused here,
            # as a newer route schema is.
            ledger_version = await store.schema_version(LEDGER_COMPONENT)
        finally:
            await store.aclose()
        try:
            check_ledger_version(ledger_version)
        except SchemaTooNew as exc:
            raise Refused(f"cannot use the store's budget ledger: {exc}") from None
        return merge_routes(config, stored, environ=os.environ), ledger_version

    try:
        merged, ledger_version = run(load)
    except StoreURLError:
        raise  # an option the driver refuses: a refusal already, in its own words
    except StoreError as exc:  # serve's own refusal of the same file (store/reload.py)
        raise Refused(f"cannot load routes from the store: {exc}") from None
    file_ids = {route.id for route in config.routes}
    from_store = {route.id for route in merged.routes if route.id not in file_ids}
    return merged, from_store, ledger_version


def budget_warnings(
    config: GatewayConfig, merged: MergedRoutes, ledger_version: int
) -> dict[str, list[str]]:
    """Per route id: the budget it spends is defined nowhere, or stored in a row this
    version cannot read (another version wrote it): a gateway refuses each of its requests
    503 budget_unavailable. Only a ledger at this package's schema (or none yet) is read:
    reading an older one would migrate it."""
    url = config.gateway.store
    # A file's budget too: a stored row of the same id takes its place (the store wins).
    wanted = {r.budget for r in merged.routes if r.budget}
    if url is None or not wanted or missing_sqlite_file(url) is not None:
        return {}
    if ledger_version not in (0, LATEST_LEDGER_VERSION):
        return {}
    refused = "every request of this route is refused 503 budget_unavailable"
    found: dict[str, str] = {}

    def nowhere(budget_id: str) -> str:
        return (
            f"budget {budget_id!r}, which this route spends, is defined neither in the "
            f"configuration ([budgets.{budget_id}]) nor in the store: {refused}; define it "
            f"(`fallback-mw budgets set --budget {budget_id} --limit AMOUNT`) or correct the "
            "route's budget"
        )

    async def read() -> None:
        ledger = open_ledger(url)
        try:
            for budget_id in sorted(wanted):
                try:
                    stored = await ledger.stored_budget(budget_id)
                    if stored is None and budget_id not in config.budgets:
                        found[budget_id] = nowhere(budget_id)
                except BudgetUnreadable:
                    found[budget_id] = f"{BudgetUnreadable.named(budget_id)}; until then {refused}"
        finally:
            await ledger.aclose()

    if ledger_version == 0:  # no ledger yet: no budget is stored
        found = {b: nowhere(b) for b in wanted if b not in config.budgets}
    else:
        try:
            run(read)
        except LedgerUnavailable:
            return {}  # the store's own line says why
    return {
        route.id: [found[route.budget]]
        for route in merged.routes
        if route.budget is not None and route.budget in found
    }


def ledger_migration(version: int) -> str | None:
    """The warning for a store whose ledger an older version wrote: this package migrates it
    on first use, one way (docs/operations.md, Upgrading)."""
    if not 0 < version < LATEST_LEDGER_VERSION:
        return None
    return (
        f"the store's ledger schema is version {version}: this package migrates it to "
        f"version {LATEST_LEDGER_VERSION} on its first use (a gateway's first budgeted "
        "request or usage record; budgets, usage, capacity), after which a gateway of an "
        "older version that starts refuses it (see Upgrading in docs/operations.md)"
    )


def _credential(upstream: UpstreamConfig) -> str:
    envs = upstream.credential_envs
    if not envs:
        return "no credential"
    scheme = f"{upstream.auth_scheme} " if upstream.auth_scheme else ""
    names = ", ".join(f"${shown_variable(name)}" for name in envs)
    pool = " (pool)" if len(envs) > 1 else ""
    return f"{upstream.auth_header}: {scheme}{names}{pool}"


def _declared(upstream: UpstreamConfig) -> str:
    """Declared capacity, when there is any (docs/capacity.md)."""
    parts = [f"{key} {value}" for key, value in (("rpm", upstream.rpm), ("tpm", upstream.tpm))
             if value is not None]  # fmt: skip
    return f"  ({', '.join(parts)})" if parts else ""


def _replay_kinds(route: RouteConfig) -> tuple[list[str], bool]:
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


def _replayable(route: RouteConfig) -> str:
    """The route's methods that may fail over, the Idempotency-Key opt-in included."""
    methods, keyed = _replay_kinds(route)
    if not methods and not keyed:
        return f"none of its methods ({' '.join(route.accepted_methods)})"
    text = " ".join(methods)
    if keyed:
        text += " + " if text else ""
        text += "POST with an Idempotency-Key header (replay_with_idempotency_key)"
    return text


def _pooled(route: RouteConfig, upstreams: Mapping[str, UpstreamConfig]) -> list[str]:
    return [name for name in route.plan if len(upstreams[name].credential_envs) > 1]


def _pools(route: RouteConfig, upstreams: Mapping[str, UpstreamConfig]) -> str:
    """Within a credential pool 401/403/429 move to another credential (SPEC §6), those
    of them the route does not list in `failover_status`: a listed one is failover-class
    and moves the walk to the next candidate instead (`decide.decide`)."""
    pools = _pooled(route, upstreams)
    statuses = sorted(CREDENTIAL_STATUSES.difference(route.failover_status))
    if not pools or not statuses or route.attempt_ceiling < 2:
        return ""  # one attempt: another key would be a second (route_warnings says so)
    moving = " ".join(map(str, statuses))
    return f"; {moving} move to another credential within {', '.join(pools)} (pool)"


def _route_lines(
    route: RouteConfig, upstreams: Mapping[str, UpstreamConfig], source: str, default_ms: int
) -> list[str]:
    tenant = route.tenant or "any"
    methods = " ".join(route.accepted_methods) + (" (default)" if route.methods is None else "")
    deadline = effective_deadline_ms(route, default_ms)
    lines = [
        f"route {route.id} ({source}): prefix {route.prefix}  tenant {tenant}  methods {methods}",
        f"  plan: {route.strategy}, retries {route.retries} (attempt ceiling "
        f"{route.attempt_ceiling}), deadline {deadline} ms",
    ]
    width = max(len(name) for name in route.plan)
    for number, name in enumerate(route.plan, start=1):
        upstream = upstreams[name]
        model = f"  model {upstream.model}" if upstream.model else ""
        lines.append(
            f"    {number}. {name.ljust(width)}  {upstream.url}  {_credential(upstream)}{model}"
            f"{_declared(upstream)}"
        )
    lines.append(
        f"  replayable {_replayable(route)}; failover on "
        f"{' '.join(map(str, route.failover_status))}, transport errors and timeouts"
        f"{_pools(route, upstreams)}; on_exhausted {route.on_exhausted}"
    )
    extras = []
    if route.budget:
        extras.append(f"budget {route.budget}")
    if route.hedge_after_ms:
        extras.append(f"hedge after {route.hedge_after_ms} ms")
    if route.canary_eligible:
        extras.append(f"canary {route.canary_percent}%")
    if route.shadow is not None:
        shadow = upstreams[route.shadow]
        extras.append(f"shadow {route.shadow} {route.shadow_percent}% {shadow.url}")
    if extras:
        lines.append("  " + "; ".join(extras))
    return lines


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
    if route.attempt_ceiling < 2 and statuses and not _replayable(route).startswith("none "):
        # The move to another key of a pool is an attempt like any other (SPEC §5, §6); a
        # route none of whose requests is replayable never moves, whatever its retries.
        for name in _pooled(route, upstreams):
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
    # one (decide.may_hedge, shadow.should_shadow). On a route none of whose requests is,
    # neither is ever sent, and a request not copied is not counted anywhere.
    methods, keyed = _replay_kinds(route)
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


def reached_upstreams(routes: Sequence[RouteConfig]) -> list[str]:
    """The upstreams some route sends requests to (a plan or a shadow), in route order."""
    names = [name for route in routes for name in (*route.plan, route.shadow) if name]
    return list(dict.fromkeys(names))


def credential_warnings(
    upstreams: Mapping[str, UpstreamConfig],
    routes: Sequence[RouteConfig],
    environ: Mapping[str, str],
) -> list[str]:
    """Credentials that are valid but answered 401 by the provider, on the upstreams some
    route reaches: a variable whose value already starts with the upstream's auth_scheme
    (sent as "Bearer Bearer sk-..."), a header of its own with the default Bearer scheme
    (Anthropic's x-api-key takes the key raw), and a declared provider without auth_env
    (the caller's own key is stripped, SPEC §4, and none is injected). Names only, never a
    value; nothing is rewritten: the credential is sent as configured."""
    warnings = []
    for name in reached_upstreams(routes):
        upstream = upstreams[name]
        scheme = upstream.auth_scheme
        for variable in upstream.credential_envs if scheme else ():
            value = environ.get(variable, "").lstrip()
            head, rest = value[: len(scheme)], value[len(scheme) :]
            if head.lower() == scheme.lower() and rest[:1].isspace() and rest.strip():
                shown = shown_variable(variable)
                warnings.append(
                    f"upstream {name!r}: ${shown} already starts with its auth_scheme "
                    f"{scheme!r}, so {upstream.auth_header} is sent as '{scheme} {scheme} ...' "
                    f"and the provider answers 401; set ${shown} to the key alone, or "
                    f'auth_scheme = "" to send it as written'
                )
        header = upstream.auth_header
        if (
            upstream.credential_envs
            and scheme == "Bearer"
            and header != "authorization"
            and "auth_scheme" not in upstream.model_fields_set
        ):
            # SPEC §3's default scheme is Bearer whatever the header; the providers that
            # take a key in a header of their own read it raw (no rewrite: said here).
            warnings.append(
                f"upstream {name!r}: auth_header = {header!r} with the default auth_scheme "
                f"'Bearer' sends '{header}: Bearer <key>'; the providers that read a key in "
                "a header of their own (Anthropic's x-api-key, Azure OpenAI's api-key, "
                "Gemini's x-goog-api-key) take it raw and answer 401: set "
                'auth_scheme = "" to send the key alone, or auth_scheme = "Bearer" to keep '
                "the prefix"
            )
        if upstream.provider is not None and not upstream.credential_envs:
            warnings.append(
                f"upstream {name!r} is provider {upstream.provider} but has no auth_env: the "
                "caller's own credential is stripped before any upstream and none is "
                "injected, so a provider that needs a key answers every request 401; set "
                "auth_env to the variable holding its key"
            )
    return warnings


def cleartext_credential_warnings(
    upstreams: Mapping[str, UpstreamConfig],
    routes: Sequence[RouteConfig],
    allow_hosts: Sequence[str],
) -> list[str]:
    """An upstream some route reaches that is sent its credential over plain http:// at a
    public address: an IP literal that is global, or a name the allowlist admits by name
    (a listed name admits public addresses only, `security.Allowlist`; `localhost` aside).
    `http://api.openai.com` for `https://` sent the key in clear across the internet
    before the provider's redirect came back. Names only, never a value."""
    allow = Allowlist(allow_hosts)
    warnings = []
    for name in reached_upstreams(routes):
        upstream = upstreams[name]
        if not upstream.credential_envs or not upstream.url.startswith("http://"):
            continue
        host = upstream.host
        literal = parse_ip(host)
        public = (
            literal.is_global
            if literal is not None
            else allow.allows_name(host) and host.rstrip(".").lower() != "localhost"
        )
        if public:
            variables = ", ".join(f"${shown_variable(v)}" for v in upstream.credential_envs)
            warnings.append(
                f"upstream {name!r} is sent its credential ({variables}) over plain http:// "
                f"at {host}, a public address: anyone on the path reads the key; use "
                "https://"
            )
    return warnings


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


def state_line(state: str) -> tuple[str, bool] | None:
    """With `state = "redis://..."`: one PING, and the line saying whether the breakers,
    credential health and capacity counts will be shared (True when it is a warning):
    `serve` starts on an unusable Redis, each process on its own state."""
    if not is_redis_url(state):
        return None
    from fallback_mw.health.redis import RedisHealth

    health = RedisHealth(state)

    async def probe() -> str | None:
        try:
            return await health.unusable()
        finally:
            await health.aclose()

    reason = run(probe)
    if reason is None:
        return f"state {health.label}: reachable, shared by every gateway process", False
    return (
        f"state {health.label} unreachable ({reason}): serve would start, but each process "
        "would keep its own breakers, credential health and capacity counts until Redis "
        "answers",
        True,
    )


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


def check(args: argparse.Namespace, console: Console) -> None:
    config = load_config(args.config)  # every refusal, unset variables included
    merged, from_store, ledger_version = resolve_routes(config)
    settings = config.gateway
    found = config_warnings(args.config, config, merged, from_store, ledger_version)
    for route_id, lines in budget_warnings(config, merged, ledger_version).items():
        found.routes[route_id].extend(lines)
    warnings = found.count()
    state = state_line(settings.state)
    if state is not None:
        line, warned = state
        console.print(f"  warning: {line}" if warned else line)
        warnings += warned
    if settings.store is not None:
        resolved = relative_sqlite_path(settings.store)
        where = f" (relative to the working directory: {resolved})" if resolved else ""
        console.print(f"store {parse_store_url(settings.store)}{where}: {len(from_store)} route(s)")
        for warning in found.store:
            console.print(f"  warning: {warning}")
    for route in merged.routes:
        source = "store" if route.id in from_store else "file"
        for line in _route_lines(route, merged.upstreams, source, settings.deadline_ms):
            console.print(line)
        for warning in found.routes[route.id]:
            console.print(f"  warning: {warning}")
    for warning in found.general:
        console.print(f"  warning: {warning}")
    noted = f", {warnings} warning(s)" if warnings else ""
    console.print(f"configuration {args.config} is valid: {len(merged.routes)} route(s){noted}")


def register(subparsers: Any) -> None:
    parser = leaf(
        subparsers,
        "check",
        check,
        "validate a configuration as serve would and print its routes and plans",
    )
    parser.add_argument("--config", required=True, metavar="FILE", help="gateway TOML file")
