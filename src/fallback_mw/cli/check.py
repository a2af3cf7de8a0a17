"""`fallback-mw check --config FILE`: validate as `serve` would start (like `nginx -t`),
and print the resolved routes, their plans and candidate URLs. Exit 0 valid, 2 refused
(SPEC §11: 0 or 2), a store that cannot be opened or reached included: `serve` refuses to
start on it with 2 too. A Redis `state` is tried once (one PING): unusable is a warning, as
`serve` starts on it, each process on its own breakers. Variable names are printed, never
their values."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

from fallback_mw.budget.ledger import BudgetUnreadable, LedgerUnavailable
from fallback_mw.cli.app import Console, Refused, run
from fallback_mw.cli.config_warnings import config_warnings, pooled, replayable
from fallback_mw.cli.target import (
    missing_sqlite_file,
    relative_sqlite_path,
)
from fallback_mw.config import (
    GatewayConfig,
    RouteConfig,
    UpstreamConfig,
    command_option,
    load_config,
)
from fallback_mw.failover.outcome import CREDENTIAL_STATUSES
from fallback_mw.quoting import printable
from fallback_mw.routing import effective_deadline_ms
from fallback_mw.rules import shown_variable
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
            f"(`fallback-mw budgets set {command_option('--budget', budget_id)} --limit "
            "AMOUNT`) or correct the route's budget"
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


def _pools(route: RouteConfig, upstreams: Mapping[str, UpstreamConfig]) -> str:
    """Within a credential pool 401/403/429 move to another credential (SPEC §6), those
    of them the route does not list in `failover_status`: a listed one is failover-class
    and moves the walk to the next candidate instead (`decide.decide`)."""
    pools = pooled(route, upstreams)
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
        f"  replayable {replayable(route)}; failover on "
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
    # A prefix or tenant holds any character but a control one: as `routes list` shows it.
    return [printable(line) for line in lines]


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
    console.print(
        f"configuration {printable(args.config)} is valid: {len(merged.routes)} route(s){noted}"
    )
