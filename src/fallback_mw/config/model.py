"""The configuration's pydantic models: what each key of SPEC §3 takes, its default and
its bounds, checked as the file is read (docs/configuration.md). Upstreams are
config/upstream.py's, routes config/route.py's, what they all share config/strict.py's."""

from __future__ import annotations

import ipaddress
from decimal import ROUND_DOWN, Decimal
from typing import Literal

from pydantic import (
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from fallback_mw.config.route import RouteConfig
from fallback_mw.config.strict import (
    MAX_COOLDOWN_MS,
    MAX_DEADLINE_MS,
    MAX_MONEY,
    MONEY_DECIMALS,
    NANO,
    Strict,
    as_written,
    budget_id,
    header_name,
    valid_host,
    xn_form,
)
from fallback_mw.config.upstream import UpstreamConfig
from fallback_mw.rules import ConfigError as ConfigError  # re-exported: its public home
from fallback_mw.security.addresses import carried_ipv4_network, is_legacy_ipv4
from fallback_mw.security.fields import DEFAULT_STRIP_HEADERS
from fallback_mw.security.queries import DEFAULT_STRIP_QUERY_KEYS
from fallback_mw.security.values import is_field_name
from fallback_mw.store_url import is_redis_url


class BreakerConfig(Strict):
    window: int = Field(default=20, ge=1, le=10_000)
    min_calls: int = Field(default=5, ge=1)
    failure_rate: float = Field(default=0.5, gt=0.0, le=1.0)
    cooldown_ms: int = Field(default=5000, ge=1, le=MAX_COOLDOWN_MS)
    max_cooldown_ms: int = Field(default=300_000, ge=1, le=MAX_COOLDOWN_MS)

    @model_validator(mode="after")
    def _cap_not_below_the_first_cooldown(self) -> BreakerConfig:
        # A cap written below the first cooldown contradicts it (which wins?): refused. An
        # unwritten cap follows a longer cooldown_ms (no doubling), as it always has.
        if "max_cooldown_ms" in self.model_fields_set and self.max_cooldown_ms < self.cooldown_ms:
            raise ValueError(
                f"max_cooldown_ms ({self.max_cooldown_ms}) is below cooldown_ms "
                f"({self.cooldown_ms}): the cap on a breaker's cooldown cannot be shorter than "
                "its first cooldown; raise max_cooldown_ms or lower cooldown_ms"
            )
        return self


class RepeatAllowanceConfig(Strict):
    """The budget for repeats and hedges, per upstream (docs/failover.md): attempts that go
    back to an upstream already tried in the request, and hedges, are allowed while they
    stay within `percent` of that upstream's first attempts over the last `window_ms`,
    plus `min_per_second` x the window (a floor, so quiet upstreams can still retry). The
    window is kept in whole seconds (`window_ms` rounded down: 1500 is 1 s)."""

    percent: float = Field(default=20.0, ge=0.0, le=1000.0)
    min_per_second: float = Field(default=1.0, ge=0.0, le=1_000_000.0)
    window_ms: int = Field(default=10_000, ge=1000, le=600_000)


class GatewaySettings(Strict):
    tenant_header: str = "x-tenant-id"
    session_header: str = "x-session-id"
    max_request_body: int = Field(default=8 * 1024 * 1024, ge=0)
    replay_buffer: int = Field(default=1024 * 1024, ge=0)
    max_response_body: int = Field(default=10 * 1024 * 1024, ge=0)
    deadline_ms: int = Field(default=5000, ge=1, le=MAX_DEADLINE_MS)
    allow_hosts: tuple[str, ...] = ("127.0.0.1", "localhost")
    state: str = "memory://"
    store: str | None = None
    engine: Literal["aiohttp", "httpx"] = "aiohttp"
    canary_salt: str = "fallback_mw"
    # Limits that protect the process (SPEC §11); see docs/security.md.
    max_header_bytes: int = Field(default=65_536, ge=1024, le=16 * 1024 * 1024)
    max_header_count: int = Field(default=100, ge=1, le=10_000)
    max_concurrency: int = Field(default=0, ge=0, le=1_000_000)
    header_timeout_ms: int = Field(default=10_000, ge=1, le=600_000)
    breaker: BreakerConfig = BreakerConfig()
    repeat_budget: RepeatAllowanceConfig = RepeatAllowanceConfig()
    # A PEM bundle of the CAs trusted for https:// upstreams, instead of the system's
    # store (which SSL_CERT_FILE / SSL_CERT_DIR replace); an upstream's own wins.
    ca_file: str | None = None
    # Caller credentials beyond SPEC §4's list, removed before any upstream (SPEC §12);
    # a list given here replaces the defaults.
    strip_headers: tuple[str, ...] = DEFAULT_STRIP_HEADERS
    strip_query_keys: tuple[str, ...] = DEFAULT_STRIP_QUERY_KEYS

    @field_validator("strip_headers", "strip_query_keys")
    @classmethod
    def _names(cls, value: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        for name in value:
            if not name or not name.isascii() or any(c.isspace() or c in "=&" for c in name):
                raise ValueError(f"{name!r} is not a header name or query key")
            if info.field_name == "strip_headers" and not is_field_name(name):
                # `"x-secret:"` (pasted from a request) matched no header: that credential
                # reached every upstream while the list said it was removed.
                raise ValueError(
                    f"{name!r} is not an HTTP header name (letters, digits and "
                    "!#$%&'*+-.^_`|~, no ':' or control characters), e.g. x-api-key"
                )
        return tuple(name.lower() for name in value)

    @field_validator("allow_hosts")
    @classmethod
    def _allow_hosts(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        """Each entry a host name, an IP address or a CIDR network: a URL, a `host:port`
        or a malformed network would otherwise be kept as a name that matches nothing,
        and the error would surface later, naming the upstream instead of the entry."""
        for entry in value:
            text = entry.strip().lower()
            try:
                network = ipaddress.ip_network(text.strip("[]"), strict=False)
            except ValueError:
                pass
            else:
                carried = carried_ipv4_network(network)
                if carried is None:
                    continue
                # `::ffff:127.0.0.1` loaded and matched nothing, not even the upstream
                # `http://[::ffff:127.0.0.1]`, refused as "not in allow_hosts: add it".
                shown = str(carried.network_address if carried.prefixlen == 32 else carried)
                raise ValueError(
                    f"{entry[:80]!r} spells IPv4 addresses in IPv6 (IPv4-mapped or "
                    "-compatible, NAT64, 6to4), which the allowlist judges by the IPv4 "
                    f"address they carry: write the IPv4 address or network meant (this "
                    f"entry spells {shown})"
                )
            if "://" in text:
                hint = ": list the host alone, without scheme or path"
            elif "/" in text:
                hint = ": not a CIDR network (an address, a slash, a prefix length)"
            elif text.count(":") == 1:
                hint = ": list the host alone, without a port"
            elif "*" in text:
                hint = ": exact host names only, no wildcards"
            elif is_legacy_ipv4(text):
                hint = (
                    ": an IPv4 address in a legacy spelling (octal, hex, integer, short, or"
                    " with a trailing dot); write it as four decimal numbers"
                )
            elif not text.isascii():
                hint = f": {xn_form(text)}"
            elif not valid_host(text.rstrip(".")):
                hint = ": not a host name"
            else:
                continue
            raise ValueError(
                f"{entry[:80]!r} is not a host name, an IP address or a CIDR network{hint}"
            )
        return value

    @field_validator("tenant_header", "session_header")
    @classmethod
    def _lower(cls, value: str) -> str:
        return header_name(value)  # a malformed one would match no request, silently

    @field_validator("state")
    @classmethod
    def _state(cls, value: str) -> str:
        if value not in ("memory://", "memory", "") and not is_redis_url(value):
            raise ValueError('must be "memory://" or "redis://host:port/db"')
        if is_redis_url(value):
            from fallback_mw.store_url import StoreURLError, check_state_url

            try:
                check_state_url(value)
            except StoreURLError as exc:
                raise ValueError(str(exc)) from None
        return value

    @field_validator("store")
    @classmethod
    def _store(cls, value: str | None) -> str | None:
        if value is not None:
            from fallback_mw.store_url import StoreURLError, parse_store_url

            try:
                parse_store_url(value)
            except StoreURLError as exc:
                raise ValueError(str(exc)) from None
        return value


class BudgetConfig(Strict):
    limit: Decimal = Field(ge=0, le=MAX_MONEY)
    window: Literal["day", "month", "total"] = "month"
    default_hold: Decimal = Field(default=Decimal("0.01"), ge=0, le=MAX_MONEY)

    _written = field_validator("limit", "default_hold", mode="before")(as_written)

    @field_validator("limit", "default_hold")
    @classmethod
    def _whole_nano_units(cls, value: Decimal) -> Decimal:
        # The ledgers keep amounts in integer nano-units (budget/cost.py): a limit of
        # 0.1000000001 would be kept as 0.100000001, more than was asked for.
        if value != value.quantize(NANO, rounding=ROUND_DOWN):  # finite, <= MAX_MONEY here
            raise ValueError(f"at most {MONEY_DECIMALS} decimal places (the ledger's unit)")
        return value + 0  # -0 is 0


class PriceConfig(Strict):
    input_per_mtok: Decimal = Field(ge=0, le=MAX_MONEY)
    output_per_mtok: Decimal = Field(ge=0, le=MAX_MONEY)

    _written = field_validator("input_per_mtok", "output_per_mtok", mode="before")(as_written)


class GatewayConfig(Strict):
    gateway: GatewaySettings = GatewaySettings()
    upstreams: dict[str, UpstreamConfig] = {}
    routes: tuple[RouteConfig, ...] = ()
    budgets: dict[str, BudgetConfig] = {}
    prices: dict[str, PriceConfig] = {}

    def __hash__(self) -> int:
        # pydantic's frozen hash hashes each field as it is: the tables here are dicts. As
        # `==` compares them, by their items whatever their order.
        return hash(
            (
                self.gateway,
                self.routes,
                frozenset(self.upstreams.items()),
                frozenset(self.budgets.items()),
                frozenset(self.prices.items()),
            )
        )

    @field_validator("budgets")
    @classmethod
    def _budget_ids(cls, value: dict[str, BudgetConfig]) -> dict[str, BudgetConfig]:
        for name in value:
            budget_id(name)
        return value
