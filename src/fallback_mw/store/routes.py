"""The route store's facade: opening a store by URL, the refusals (rules.py, shared with
the config loader), and merging store routes with the file's into one RouteTable."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from fallback_mw import rules
from fallback_mw.config import (
    ConfigError,
    GatewayConfig,
    RouteConfig,
    UpstreamConfig,
    check_ca_file,
)
from fallback_mw.routing import RouteTable
from fallback_mw.store.model import Fault, StoredRoute, build_model


class RouteStore(Protocol):
    """Routes and faults in SQLite or PostgreSQL. Every method migrates on first use."""

    async def load_routes(self, *, unreadable: list[str] | None = None) -> list[StoredRoute]:
        """Every stored route, by id. A record that does not load raises ConfigError (a
        gateway refuses the store); with `unreadable`, its reason is added there and the
        others are returned."""
        ...

    async def insert_route(self, stored: StoredRoute) -> None:
        """Raises RouteExists when the id is taken."""
        ...

    async def replace_route(self, stored: StoredRoute, *, expected: str | None = None) -> bool:
        """Write `stored` over its id. With `expected` (the record as read, `StoredRoute.doc`)
        only while the store still holds exactly that record: False, nothing written, when
        another command changed or removed the route meanwhile."""
        ...

    async def replace_route_clearing(
        self, stored: StoredRoute, *, expected: str | None, dropped: Collection[str]
    ) -> int | None:
        """`replace_route(stored, expected=expected)` and, in the same transaction, the
        faults on the upstreams in `dropped` (those the route no longer has, but the config
        file's) and a pin of the route to one of them. None, nothing written, when another
        command changed or removed the route meanwhile; else how many faults went."""
        ...

    async def remove_route(
        self, route_id: str, *, keep_upstreams: Collection[str] = (), keep_pin: bool = False
    ) -> int | None:
        """Remove the route and, in the same transaction, the faults it leaves behind: those
        on the upstreams its record owned (but `keep_upstreams`, the config file's) and its
        pin (unless `keep_pin`: the file defines a route of that id). None, nothing changed,
        when the store holds no such route; else how many faults went with it."""
        ...

    async def clock(self) -> float:
        """The store's clock now, in epoch seconds: fault expiries are written in it and
        read against it. SQLite (one host's file): this host's clock; PostgreSQL: the
        database's, so gateway and operator hosts whose clocks differ (broken NTP) start
        and end a fault together."""
        ...

    async def load_faults(self, unreadable: list[str] | None = None) -> list[Fault]:
        """Active (unexpired by the store's clock) faults; a row that is no fault (written
        by hand) is skipped, and described in `unreadable` when given."""
        ...

    async def set_fault(self, fault: Fault, *, replace: bool = False) -> Fault | None:
        """Store `fault`, atomically refusing while an active fault holds the same target
        (unless `replace`). Returns None when stored, else the active fault that refused it."""
        ...

    async def clear_faults(
        self,
        *,
        upstream: str | None = None,
        route: str | None = None,
        expires_at: float | None = None,
    ) -> int:
        """Clear faults on one upstream, one route, or (neither given) all. With
        `expires_at` (and a target), only the fault set with that expiry: a game day clears
        its own fault, never one set on its target after it (by another exercise, or
        `faults set --replace`)."""
        ...

    async def schema_version(self, component: str) -> int:
        """The version the shared `fmw_schema` table records for `component` (another
        component's, such as the ledger's), 0 when it has none yet."""
        ...

    async def change_serials(self) -> tuple[int, int]:
        """(routes, faults) counters, bumped by triggers on every change: the cheap check."""
        ...

    async def wait_for_change(self, poll_interval: float) -> None:
        """Return on a change notification (PostgreSQL) or after `poll_interval`."""
        ...

    async def aclose(self) -> None: ...


def open_store(url: str) -> RouteStore:
    from fallback_mw.store_url import parse_store_url

    parsed = parse_store_url(url)
    if parsed.kind == "sqlite":
        from fallback_mw.store.sqlite import SqliteStore

        return SqliteStore(parsed.target)
    from fallback_mw.store.postgres import PostgresStore

    return PostgresStore(parsed.target)


@dataclass(frozen=True, slots=True)
class MergedRoutes:
    routes: tuple[RouteConfig, ...]
    upstreams: dict[str, UpstreamConfig]

    def table(self) -> RouteTable:
        return RouteTable(self.routes, self.upstreams)


def merge_routes(
    config: GatewayConfig,
    stored: Iterable[StoredRoute],
    *,
    environ: Mapping[str, str] | None = None,
) -> MergedRoutes:
    """File routes plus store routes, checked by the config loader's own rules (rules.py).
    Raises ConfigError naming the route. Credential variable names are always checked;
    with `environ`, that each variable of a store route is set in it too."""
    routes = list(config.routes)
    upstreams = dict(config.upstreams)
    owners = dict.fromkeys(upstreams, "the config file")
    ids = {route.id for route in routes}
    allow_hosts = config.gateway.allow_hosts
    tenant, session = config.gateway.tenant_header, config.gateway.session_header
    for item in stored:
        route = item.route
        if route.id in ids:
            raise ConfigError(
                f"route {route.id!r} is defined both in the config file and in the store"
            )
        ids.add(route.id)
        for name, upstream in item.upstreams.items():
            if name in upstreams:
                # Both named: "elsewhere" sent an operator to remove the route it named,
                # which was as often the sound one as the record that took its name.
                raise ConfigError(
                    f"route {route.id!r}: upstream name {name!r} is already defined by "
                    f"{owners[name]}; one of them must be removed or renamed"
                )
            upstreams[name] = upstream
            owners[name] = f"stored route {route.id!r}"
        for name, upstream in item.upstreams.items():
            try:
                rules.check_upstream(name, upstream, allow_hosts)
                # The caller's copy of its auth_header is stripped as a credential: the
                # tenant or session header it names would be recorded (as in the file).
                try:
                    rules.check_identity_headers(tenant, session, stripped=(upstream.auth_header,))
                except ConfigError as exc:
                    raise ConfigError(
                        f"upstream {name!r}: auth_header {upstream.auth_header!r}: {exc}"
                    ) from None
                if upstream.ca_file is not None:  # as the loader checks the file's
                    check_ca_file(f"upstream {name!r}", upstream.ca_file)
            except ConfigError as exc:
                raise ConfigError(f"route {route.id!r}: {exc}") from None
            if environ is not None:
                rules.check_variables_set(
                    f"route {route.id!r}, upstream {name!r}", upstream.credential_envs, environ
                )
        rules.check_route(route, upstreams)
        routes.append(route)
    return MergedRoutes(tuple(routes), upstreams)


def scheme_for(auth_header: str) -> str:
    """CLI-created upstreams: `Bearer` for `authorization`, a raw key for any other header."""
    return "Bearer" if auth_header.strip().lower() == "authorization" else ""


def make_upstream(
    url: str, auth_header: str | None, auth_env: str | None, where: str
) -> UpstreamConfig:
    # An option given empty (`--auth-env "$NAME"` with NAME unset in the shell) is checked
    # as the file's `auth_env = ""` is, and refused: it stored a route that sent no
    # credential (or the default header), where the loader refuses the same value.
    header = "authorization" if auth_header is None else auth_header.strip().lower()
    data: dict[str, Any] = {"url": url, "auth_header": header, "auth_scheme": scheme_for(header)}
    if auth_env is not None:
        data["auth_env"] = auth_env
    return build_model(UpstreamConfig, data, where)
