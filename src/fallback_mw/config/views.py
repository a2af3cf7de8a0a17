"""Plain read-only copies of the configuration models, for the request path.

A pydantic model's class defines `__getattr__`, so CPython 3.11 cannot specialise an
attribute read on it: every read goes through the generic lookup and the hook (some 370
instructions), and a healthy request read about sixty. A view holds the same values
under the same names in slots (a specialised read is a few instructions). Views are made
where the request path gets its configuration: the route table (a route and its
upstreams, so again at every store reload, and from a `model_copy` as from any model)
and the layers' gateway settings. The models stay the public configuration; a view keeps
its model as `config`."""

from __future__ import annotations

from typing import Any, Literal

from fallback_mw.config.model import (
    BreakerConfig,
    GatewaySettings,
    RepeatAllowanceConfig,
)
from fallback_mw.config.route import RouteConfig
from fallback_mw.config.upstream import UpstreamConfig


class _View:
    __slots__ = ()

    config: Any  # the model it copies (each view names its type)

    def _copy(self, model: Any, names: tuple[str, ...]) -> None:
        for name in names:
            object.__setattr__(self, name, getattr(model, name))
        object.__setattr__(self, "config", model)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is read-only (its model is frozen)")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is read-only (its model is frozen)")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} of {self.config!r}>"

    def __reduce__(self) -> tuple[Any, ...]:
        # Made again from its model (copy, deepcopy, pickle): their default restores each
        # slot through `__setattr__`, which refuses.
        return (type(self), (self.config,))


# Each view's names: its model's fields, then what the model derives from them.
_ROUTE = (*RouteConfig.model_fields, "attempt_ceiling", "accepted_methods")
_UPSTREAM = (*UpstreamConfig.model_fields, "host", "port", "credential_envs", "proxy_host")
_SETTINGS = tuple(GatewaySettings.model_fields)


class RouteView(_View):
    __slots__ = (*_ROUTE, "config")

    id: str
    prefix: str
    tenant: str | None
    methods: tuple[str, ...] | None
    plan: tuple[str, ...]
    strategy: Literal["sequential", "random"]
    retries: int
    backoff_ms: int
    deadline_ms: int | None
    replayable_methods: tuple[str, ...]
    replay_with_idempotency_key: bool
    failover_status: tuple[int, ...]
    on_exhausted: Literal["error", "last_response"]
    budget: str | None
    hedge_after_ms: int
    hedge_idempotent_posts: bool
    canary_percent: float
    canary_eligible: bool
    shadow: str | None
    shadow_percent: float
    attempt_ceiling: int
    accepted_methods: tuple[str, ...]
    config: RouteConfig

    def __init__(self, config: RouteConfig) -> None:
        self._copy(config, _ROUTE)


class UpstreamView(_View):
    __slots__ = (*_UPSTREAM, "config")

    url: str
    auth_header: str
    auth_scheme: str
    auth_env: str | tuple[str, ...] | None
    model: str | None
    connect_timeout_ms: int
    max_connections: int
    first_byte_timeout_ms: int
    idle_timeout_ms: int
    rpm: int | None
    tpm: int | None
    selection: Literal["round_robin", "score"]
    quota_retire_ms: int
    ca_file: str | None
    proxy: str | None
    provider: str | None
    host: str
    port: int
    credential_envs: tuple[str, ...]
    proxy_host: str | None
    config: UpstreamConfig

    def __init__(self, config: UpstreamConfig) -> None:
        self._copy(config, _UPSTREAM)


class SettingsView(_View):
    __slots__ = (*_SETTINGS, "config")

    tenant_header: str
    session_header: str
    max_request_body: int
    replay_buffer: int
    max_response_body: int
    deadline_ms: int
    allow_hosts: tuple[str, ...]
    state: str
    store: str | None
    engine: Literal["aiohttp", "httpx"]
    canary_salt: str
    max_header_bytes: int
    max_header_count: int
    max_concurrency: int
    header_timeout_ms: int
    breaker: BreakerConfig
    repeat_budget: RepeatAllowanceConfig
    ca_file: str | None
    strip_headers: tuple[str, ...]
    strip_query_keys: tuple[str, ...]
    config: GatewaySettings

    def __init__(self, config: GatewaySettings) -> None:
        self._copy(config, _SETTINGS)


# What a function the request path shares with the rest of the code (the command line,
# start-up) reads: the model or its view, by the same names.
AnyRoute = RouteConfig | RouteView
AnyUpstream = UpstreamConfig | UpstreamView
AnySettings = GatewaySettings | SettingsView
