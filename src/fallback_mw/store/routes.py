"""The route store's contract: what is stored, the refusals (the config loader's own, one
source of truth), and merging store routes with the file's into one RouteTable."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar
from urllib.parse import urlsplit

from pydantic import BaseModel, ValidationError

from fallback_mw.config import (
    ConfigError,
    GatewayConfig,
    RouteConfig,
    UpstreamConfig,
    check_credential_variable,
    check_route,
    check_upstream,
)
from fallback_mw.config import _describe as describe_validation_error
from fallback_mw.routing import RouteTable

FaultKind = Literal["fail", "hang", "pin"]
Model = TypeVar("Model", bound=BaseModel)


class StoreError(RuntimeError):
    """The store cannot be reached or is in a state this package does not understand."""


SCHEMA_COMPONENT = "routes"  # the route stores' row in the shared `fmw_schema` table
SCHEMA_VERSION = 1  # both dialects' migrations lead to this version


def pending_migrations(current: int, steps: Sequence[Sequence[str]]) -> list[str]:
    """The statements taking the route store's schema from version `current` to
    SCHEMA_VERSION (`steps[n - 1]` migrates from n-1 to n); StoreError when the store is
    newer than this package."""
    if current > SCHEMA_VERSION:
        raise StoreError(
            f"the store's {SCHEMA_COMPONENT!r} schema is version {current}; this package "
            f"knows up to {SCHEMA_VERSION} (upgrade fallback_mw)"
        )
    return [s for version in range(current + 1, SCHEMA_VERSION + 1) for s in steps[version - 1]]


class RouteExists(ConfigError):
    pass


def primary_name(route_id: str) -> str:
    """Upstream names the store derives for CLI-created routes (documented in
    docs/operations.md): faults and pins refer to these."""
    return f"{route_id}-primary"


def fallback_name(route_id: str) -> str:
    return f"{route_id}-fallback"


def build_model(model: type[Model], data: Mapping[str, Any], where: str) -> Model:
    try:
        return model.model_validate(dict(data))
    except ValidationError as exc:
        raise ConfigError(f"{where}: {describe_validation_error(exc)}") from None


@dataclass(frozen=True, slots=True)
class StoredRoute:
    """One route as the store keeps it, with the upstreams it owns."""

    route: RouteConfig
    upstreams: dict[str, UpstreamConfig]

    def to_doc(self) -> str:
        return json.dumps(
            {
                "route": self.route.model_dump(mode="json", exclude_defaults=True),
                "upstreams": {
                    name: upstream.model_dump(mode="json", exclude_defaults=True)
                    for name, upstream in self.upstreams.items()
                },
            },
            sort_keys=True,
        )

    @classmethod
    def from_doc(cls, route_id: str, text: str) -> StoredRoute:
        where = f"stored route {route_id!r}"
        try:
            data = json.loads(text)
            route_data = data["route"]
            upstream_data = data["upstreams"]
        except (ValueError, KeyError, TypeError):
            raise ConfigError(f"{where}: unreadable record") from None
        route = build_model(RouteConfig, route_data, where)
        upstreams = {
            str(name): build_model(UpstreamConfig, value, f"{where}, upstream {name!r}")
            for name, value in dict(upstream_data).items()
        }
        return cls(route=route, upstreams=upstreams)


@dataclass(frozen=True, slots=True)
class Fault:
    kind: FaultKind
    target: str  # the upstream name (fail, hang) or the route id (pin)
    expires_at: float  # epoch seconds (wall clock: shared by every process)
    candidate: str | None = None  # pin only

    @property
    def scope(self) -> Literal["upstream", "route"]:
        return "route" if self.kind == "pin" else "upstream"

    def active(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) < self.expires_at


class RouteStore(Protocol):
    """Routes and faults in SQLite or PostgreSQL. Every method migrates on first use."""

    async def load_routes(self) -> list[StoredRoute]: ...

    async def insert_route(self, stored: StoredRoute) -> None:
        """Raises RouteExists when the id is taken."""
        ...

    async def replace_route(self, stored: StoredRoute) -> None: ...

    async def remove_route(self, route_id: str) -> bool: ...

    async def load_faults(self) -> list[Fault]:
        """Active (unexpired) faults."""
        ...

    async def set_fault(self, fault: Fault) -> None: ...

    async def clear_faults(self, *, upstream: str | None = None, route: str | None = None) -> int:
        """Clear faults on one upstream, one route, or (neither given) all."""
        ...

    async def change_serials(self) -> tuple[int, int]:
        """(routes, faults) counters, bumped by triggers on every change: the cheap check."""
        ...

    async def wait_for_change(self, poll_interval: float) -> None:
        """Return on a change notification (PostgreSQL) or after `poll_interval`."""
        ...

    async def aclose(self) -> None: ...


def open_store(url: str) -> RouteStore:
    from fallback_mw.store.url import parse_store_url

    parsed = parse_store_url(url)
    if parsed.kind == "sqlite":
        from fallback_mw.store.sqlite import SqliteStore

        return SqliteStore(parsed.target)
    from fallback_mw.store.postgres import PostgresStore

    return PostgresStore(parsed.target)


# --- the refusals -------------------------------------------------------------------------


def _origin(url: str) -> tuple[str, str, int | None, str]:
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return (parts.scheme, (parts.hostname or "").rstrip("."), port, parts.path.rstrip("/"))


def check_stored_route(stored: StoredRoute, allow_hosts: tuple[str, ...]) -> None:
    """What the store refuses on top of the shared route checks: its own upstreams must pass
    the allowlist, and no fallback may point at the primary's own endpoint."""
    route = stored.route
    for name, upstream in stored.upstreams.items():
        try:
            check_upstream(name, upstream, allow_hosts)
        except ConfigError as exc:
            raise ConfigError(f"route {route.id!r}: {exc}") from None
    primary = stored.upstreams.get(route.plan[0])
    if primary is None:
        return
    for name in route.plan[1:]:
        candidate = stored.upstreams.get(name)
        if candidate is not None and _origin(candidate.url) == _origin(primary.url):
            raise ConfigError(
                f"route {route.id!r}: fallback {name!r} is the primary's own endpoint "
                f"(use a credential pool for several keys of one upstream)"
            )


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
    check_addresses: bool = True,
) -> MergedRoutes:
    """File routes plus store routes, checked as the config loader checks them. Raises
    ConfigError naming the route; with `environ`, store credentials must be set in it."""
    routes = list(config.routes)
    upstreams = dict(config.upstreams)
    ids = {route.id for route in routes}
    allow_hosts = config.gateway.allow_hosts
    for item in stored:
        route = item.route
        if route.id in ids:
            raise ConfigError(
                f"route {route.id!r} is defined both in the config file and in the store"
            )
        ids.add(route.id)
        for name, upstream in item.upstreams.items():
            if name in upstreams:
                raise ConfigError(
                    f"route {route.id!r}: upstream name {name!r} is already defined elsewhere"
                )
            upstreams[name] = upstream
        if check_addresses:
            check_stored_route(item, allow_hosts)
        check_route(route, upstreams)
        if environ is not None:
            for name, upstream in item.upstreams.items():
                for var in upstream.credential_envs:
                    where = f"route {route.id!r}, upstream {name!r}"
                    check_credential_variable(var, environ, where)
        routes.append(route)
    return MergedRoutes(tuple(routes), upstreams)


def scheme_for(auth_header: str) -> str:
    """CLI-created upstreams: `Bearer` for `authorization`, a raw key for any other header."""
    return "Bearer" if auth_header.strip().lower() == "authorization" else ""


def make_upstream(
    url: str, auth_header: str | None, auth_env: str | None, where: str
) -> UpstreamConfig:
    header = (auth_header or "authorization").strip().lower()
    data: dict[str, Any] = {"url": url, "auth_header": header, "auth_scheme": scheme_for(header)}
    if auth_env:
        data["auth_env"] = auth_env
    return build_model(UpstreamConfig, data, where)
