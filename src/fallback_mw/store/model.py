"""What the route store keeps: stored routes and faults, the store's errors and schema
version. Shared by the backends (sqlite.py, postgres.py) and the facade (routes.py), which
the backends never import."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ValidationError

from fallback_mw.config import ConfigError, RouteConfig, UpstreamConfig, command_option
from fallback_mw.config import _describe as describe_validation_error
from fallback_mw.quoting import shortened
from fallback_mw.rules import check_id
from fallback_mw.store.versions import unwritten_version, written_version

FaultKind = Literal["fail", "hang", "blackhole", "revoke", "pin"]
Model = TypeVar("Model", bound=BaseModel)


class StoreError(RuntimeError):
    """The store cannot be reached or is in a state this package does not understand."""


SCHEMA_COMPONENT = "routes"  # the route stores' row in the shared `fmw_schema` table
SCHEMA_VERSION = 1  # both dialects' migrations lead to this version
# The pg_advisory_xact_lock key every component's PostgreSQL migration (the route store's,
# the ledger's) takes after its own, before creating the shared `fmw_schema` table: two
# components migrating a new database at once each ran CREATE TABLE IF NOT EXISTS under its
# own lock, and PostgreSQL refused one of them (a unique violation in pg_type).
SCHEMA_TABLE_LOCK = 0x666D775F736368  # "fmw_sch"


def stored_version(value: object, component: str = SCHEMA_COMPONENT) -> int:
    """A version the `fmw_schema` table holds; StoreError for one no version writes (text,
    a fraction, a negative number: edited by hand), which read as an internal error."""
    version = written_version(value)
    if version is None:
        raise StoreError(unwritten_version(value, f"the store's {component!r} schema"))
    return version


def pending_migrations(current: int, steps: Sequence[Sequence[str]]) -> list[str]:
    """The statements taking the route store's schema from version `current` to
    SCHEMA_VERSION (`steps[n - 1]` migrates from n-1 to n); StoreError when the store is
    newer than this package."""
    current = stored_version(current)
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
        raise ConfigError(f"{where}: {describe_validation_error(exc, root=model)}") from None


@dataclass(frozen=True, slots=True)
class StoredRoute:
    """One route as the store keeps it, with the upstreams it owns."""

    route: RouteConfig
    upstreams: dict[str, UpstreamConfig]
    # The record as read from the store (None for one built here): an edit is written only
    # while the store still holds exactly this, so a concurrent edit is never overwritten.
    doc: str | None = field(default=None, compare=False, repr=False)

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
    def from_doc(cls, route_id: str, text: str | bytes) -> StoredRoute:
        """`text` as bytes: a record that is not UTF-8 text (a backend's read of it). A key
        written by hand may be megabytes long: quoted by its start, as every name is."""
        where = f"stored route {shortened(route_id)!r}"
        if isinstance(text, bytes):
            raise ConfigError(
                f"{where}: unreadable record (not UTF-8 text){_remove_hint(route_id)}"
            )
        try:
            data = json.loads(text)
            route_data = data["route"]
            upstream_data = data["upstreams"]
        except (ValueError, KeyError, TypeError, RecursionError):
            # RecursionError: arrays nested some thousand deep (json parses recursively);
            # it stopped `routes list` and a gateway's start as an internal error.
            raise ConfigError(f"{where}: unreadable record{_remove_hint(route_id)}") from None
        try:
            route = build_model(RouteConfig, route_data, where)
            upstreams = {
                str(name): build_model(
                    UpstreamConfig, value, f"{where}, upstream {shortened(str(name))!r}"
                )
                for name, value in dict(upstream_data).items()
            }
        except (ValueError, TypeError) as exc:  # ConfigError included: said with the repair
            reason = str(exc) if isinstance(exc, ConfigError) else f"{where}: unreadable record"
            raise ConfigError(f"{reason}{_remove_hint(route_id)}") from None
        if route.id != route_id:
            # Written by hand (the admin verbs key each record by its route's id): the
            # gateways would serve it as route.id, which `routes remove` / `set` cannot
            # find, and two such records would be one id "in the file and in the store".
            raise ConfigError(
                f"{where}: its record holds route {route.id!r}, not "
                f"{shortened(route_id)!r}"
                f"{_remove_hint(route_id)}"
            )
        return cls(route=route, upstreams=upstreams, doc=text)


def _remove_hint(route_id: str) -> str:
    """A record that does not load makes every gateway refuse the store; `routes remove`
    takes it out (it reads no other record, and this one only leniently). The id is shown
    as a command only when it is a valid id (a hand-written one may hold anything)."""
    try:
        check_id("route", route_id)
    except ConfigError:
        route_id = "ID"
    return f" (`fallback-mw routes remove {command_option('--id', route_id)}` takes it out)"


def stored_routes(
    rows: Iterable[tuple[str, str | bytes]], unreadable: list[str] | None = None
) -> list[StoredRoute]:
    """The records a backend read, as (id, doc), in order. A record that does not load is a
    ConfigError naming it, as every gateway refuses it; with `unreadable`, its reason goes
    there instead and the others still load (`routes list` shows the store and what to
    remove). Several that do not load are one ConfigError: the first's reason and how many
    more (a rule tightened by an upgrade refuses every record an older version stored; named
    one at a time, each was found only once the one before was removed)."""
    routes = []
    refused: list[ConfigError] = []
    for route_id, doc in rows:
        try:
            routes.append(StoredRoute.from_doc(route_id, doc))
        except ConfigError as exc:
            if unreadable is None:
                refused.append(exc)
            else:
                unreadable.append(str(exc))
    if len(refused) == 1:
        raise refused[0]
    if refused:
        raise ConfigError(
            f"{refused[0]}; {len(refused) - 1} more stored record"
            f"{'s do' if len(refused) > 2 else ' does'} not load either "
            "(`fallback-mw routes list` names each)"
        )
    return routes


def owned_upstreams(doc: str) -> list[str]:
    """The upstream names a stored record owns, read leniently: a record too broken to
    load owns none (its removal is the repair, and must not fail on it)."""
    try:
        upstreams = json.loads(doc)["upstreams"]
    except (ValueError, KeyError, TypeError, RecursionError):
        return []
    return [str(name) for name in upstreams] if isinstance(upstreams, dict) else []


@dataclass(frozen=True, slots=True)
class Fault:
    kind: FaultKind
    target: str  # the upstream name (fail, hang, blackhole, revoke) or the route id (pin)
    expires_at: float  # epoch seconds (wall clock: shared by every process)
    candidate: str | None = None  # pin only

    @property
    def scope(self) -> Literal["upstream", "route"]:
        return "route" if self.kind == "pin" else "upstream"

    def active(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) < self.expires_at


FAULT_KINDS: tuple[FaultKind, ...] = ("fail", "hang", "blackhole", "revoke", "pin")
LATEST_EXPIRY = 253_402_300_799.0  # 9999-12-31T23:59:59Z, the last moment a date can show
# The longest a fault lasts (`faults set --ttl`; a game day's is 24 hours at most). A row
# expiring further ahead of the store's clock (and a minute for the two readings of it) was
# written by hand, and was applied as written: an upstream failed for years.
MAX_FAULT_TTL = 7 * 24 * 3600
_FAULT_TTL_SLACK = 60.0


def fault_from_row(
    kind: Any, target: Any, expires_at: Any, candidate: Any, scope: Any
) -> Fault | None:
    """A stored fault row, or None when it is not one `faults set` writes (a hand edit: an
    unknown kind, an expiry that is no finite time before year 10000, an id outside the
    safe charset, a pin without a candidate, a scope its kind does not have). Read
    strictly, one such row stopped every gateway's fault reloads (and `faults list`,
    "unexpected internal error"). A `fail` row under scope 'route' was read as a fault on
    the upstream of that name which `faults clear --upstream` could not find."""
    try:
        when = float(expires_at)
    except (TypeError, ValueError):
        return None
    if kind not in FAULT_KINDS or not when <= LATEST_EXPIRY:  # NaN too
        return None
    if scope != ("route" if kind == "pin" else "upstream"):
        return None
    if (candidate is None) != (kind != "pin"):
        return None
    try:
        for value in (target, candidate):
            if value is not None:
                check_id("fault target", value)
    except ConfigError:
        return None
    return Fault(kind, target, when, candidate)


def faults_from_rows(
    rows: Iterable[Sequence[Any]], unreadable: list[str] | None = None, *, now: float
) -> list[Fault]:
    """The rows (kind, target, expires_at, candidate, scope) that are faults, at `now` (the
    store's clock); each other one is skipped (no gateway applies it) and, with
    `unreadable`, described there."""
    faults = []
    latest = now + MAX_FAULT_TTL + _FAULT_TTL_SLACK
    for kind, target, expires_at, candidate, scope in rows:
        fault = fault_from_row(kind, target, expires_at, candidate, scope)
        if fault is not None and fault.expires_at <= latest:
            faults.append(fault)
        elif unreadable is not None:
            label = target if isinstance(target, str) else "?"
            days = MAX_FAULT_TTL // 86400
            why = "" if fault is None else f" (expiring more than {days} days ahead)"
            unreadable.append(f"{str(kind)[:20]!r} on {label[:80]!r}{why}")
    return faults
