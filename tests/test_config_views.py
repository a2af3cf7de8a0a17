"""The request path reads its configuration through plain views (config/views.py): the
same values under the same names as the pydantic models, in slots, because every read of
a model attribute goes through pydantic's `__getattr__` hook, which also keeps CPython
3.11 from specialising the read (about sixty a healthy request, some 370 instructions
each). A view must hold exactly its model's values, and the request path must read views,
not models."""

from __future__ import annotations

import asyncio
import collections
import copy
import pickle
from typing import Any

import pytest
from aiohttp import web

from fallback_mw import Gateway
from fallback_mw.config import (
    GatewaySettings,
    RouteConfig,
    UpstreamConfig,
    load_config,
    parse_config,
)
from fallback_mw.config.strict import Strict
from fallback_mw.config.views import RouteView, SettingsView, UpstreamView
from fallback_mw.layers.resolver import RouteResolver
from fallback_mw.layers.walker import PlanWalker
from fallback_mw.routing import RouteTable
from tests.helpers import client_for
from tests.upstreams import host_app, upstream

ENV = {"K1": "sk-one-0123456789", "K2": "sk-two-0123456789"}

CONFIG: dict[str, Any] = {
    "gateway": {
        "tenant_header": "X-Org",
        "deadline_ms": 7000,
        "canary_salt": "salt",
        "replay_buffer": 4096,
        "allow_hosts": ["127.0.0.1", "api.example", "proxy.example"],
    },
    "upstreams": {
        "a": {
            "url": "https://api.example/v1/",
            "auth_env": ["K1", "K2"],
            "model": "m-1",
            "proxy": "http://proxy.example:3128",
            "tpm": 1000,
            "selection": "score",
        },
        "b": {
            "url": "http://127.0.0.1:9",
            "auth_env": "K1",
            "auth_header": "x-api-key",
            "auth_scheme": "",
            "connect_timeout_ms": 50,
        },
    },
    "routes": [
        {
            "id": "r1",
            "prefix": "/v1/",
            "plan": ["a", "b"],
            "retries": 2,
            "strategy": "random",
            "tenant": "acme",
            "methods": ["POST", "GET"],
            "failover_status": [429, 503],
            "deadline_ms": 900,
            "canary_percent": 12.5,
            "canary_eligible": True,
            "shadow": "b",
            "shadow_percent": 3.0,
            "hedge_after_ms": 10,
            "budget": "x",
        },
        {"id": "r2", "prefix": "/v2/", "plan": ["b"]},
    ],
    "budgets": {"x": {"limit": 10}},
}


def _names(view: type[Any]) -> set[str]:
    return set(view.__slots__)


@pytest.mark.parametrize(
    ("view", "model", "derived"),
    [
        (RouteView, RouteConfig, {"attempt_ceiling", "accepted_methods"}),
        (UpstreamView, UpstreamConfig, {"host", "port", "credential_envs", "proxy_host"}),
        (SettingsView, GatewaySettings, set()),
    ],
)
def test_a_view_names_every_field_of_its_model(
    view: type[Any], model: type[Strict], derived: set[str]
) -> None:
    # A field added to the model and not to the view would be missing on the request path
    # (an AttributeError there, and a mypy error only where it is read).
    assert _names(view) == {*model.model_fields, *derived, "config"}
    # Each name it holds is declared with its type (what mypy checks the reads against).
    assert set(view.__annotations__) == _names(view)


def _same(view: Any, model: Any) -> None:
    for name in type(view).__slots__:
        if name == "config":
            assert view.config is model
        else:
            assert getattr(view, name) == getattr(model, name), name


def test_a_view_holds_its_models_values() -> None:
    config = load_config(CONFIG, environ=ENV)
    table = RouteTable(config.routes, config.upstreams)
    for name, model in config.upstreams.items():
        _same(table.upstream_views[name], model)
    assert table.upstream_views["a"].port == 443
    assert table.upstream_views["a"].credential_envs == ("K1", "K2")
    assert table.upstream_views["a"].proxy_host == "proxy.example"
    for route in config.routes:
        found, refused = table.resolve_view("POST", route.prefix + "x", route.tenant or "d")
        assert refused is None and found is not None
        _same(found, route)
    first = table.resolve_view("POST", "/v1/x", "acme")[0]
    assert first is not None and first.attempt_ceiling == 3
    _same(SettingsView(config.gateway), config.gateway)


def test_the_table_answers_models_and_views_of_them() -> None:
    config = load_config(CONFIG, environ=ENV)
    table = RouteTable(config.routes, config.upstreams)
    route = table.match("GET", "/v1/chat", "acme")
    assert route is config.routes[0]  # the public answer is the model, as it was
    assert table.resolve("TRACE", "/v2/x", "acme") == (None, config.routes[1])
    view, refused = table.resolve_view("TRACE", "/v2/x", "acme")
    assert view is None and refused is not None and refused.config is config.routes[1]
    assert table.upstreams == config.upstreams


def test_a_view_is_read_only() -> None:
    config = parse_config(CONFIG)
    view = RouteView(config.routes[1])
    with pytest.raises(AttributeError):
        view.retries = 5  # type: ignore[misc]
    with pytest.raises(AttributeError):
        del view.plan  # type: ignore[misc]
    assert view.retries == 0
    assert "r2" in repr(view)


@pytest.mark.anyio
async def test_a_routed_request_reads_no_route_upstream_or_settings_model() -> None:
    reads: collections.Counter[str] = collections.Counter()
    on = [False]
    original = Strict.__dict__.get("__getattribute__")

    def read(self: Strict, name: str) -> Any:
        if on[0] and not name.startswith("_"):
            reads[f"{type(self).__name__}.{name}"] += 1
        return object.__getattribute__(self, name)

    async def ok(request: web.Request) -> web.StreamResponse:
        return web.json_response({"model": "m-1", "usage": {"prompt_tokens": 1}})

    async with upstream(ok) as up, upstream(ok) as other:
        conf = {
            "upstreams": {
                "p": {"url": up.url, "auth_env": "K1"},
                "q": {"url": other.url, "auth_env": "K2"},
            },
            "routes": [
                {"id": "r", "prefix": "/v1/", "plan": ["p", "q"], "retries": 1,
                 "shadow": "q", "shadow_percent": 100.0},
            ],
        }  # fmt: skip
        gateway = Gateway(host_app, config=conf, environ=ENV)
        Strict.__getattribute__ = read  # type: ignore[method-assign]
        try:
            async with client_for(gateway) as client:
                first = await client.post("/v1/chat", json={"model": "m"})  # caches filled
                on[0] = True
                response = await client.post(
                    "/v1/chat", json={"model": "m"}, headers={"x-session-id": "s"}
                )
                on[0] = False
        finally:
            if original is None:
                del Strict.__getattribute__
            else:  # pragma: no cover - Strict defines none
                Strict.__getattribute__ = original  # type: ignore[method-assign]
            await gateway.aclose()
    assert first.status_code == response.status_code == 200, response.text
    model_reads = {
        name: count
        for name, count in reads.items()
        if name.split(".")[0] in ("RouteConfig", "UpstreamConfig", "GatewaySettings")
    }
    assert model_reads == {}, "the request path read models, not their views (config/views.py)"


@pytest.mark.anyio
async def test_a_layer_of_the_hosts_own_may_copy_the_scope_it_is_handed() -> None:
    """A host's own layer between the RouteResolver and the walker is handed the scope
    with the request's context in it; one that copies the scope (`copy.deepcopy`, as a
    request recorder does) or pickles what it holds got "RouteView is read-only" from the
    views (their `__setattr__` refuses what copy and pickle restore a slot with), where the
    models copied. A view copies and pickles as the view of its model."""
    from fallback_mw import RouteResolver
    from fallback_mw.request.context import SCOPE_KEY

    copied: list[Any] = []

    async def recorder(scope: Any, receive: Any, send: Any) -> None:
        copied.append(copy.deepcopy(scope)[SCOPE_KEY])
        await host_app(scope, receive, send)

    resolver = RouteResolver(recorder, config=CONFIG)
    async with client_for(resolver) as client:
        response = await client.get("/v2/x")
    assert response.status_code == 404, response.text  # the recorder's app answered
    (context,) = copied
    assert context.route.id == "r2" and context.route.config == parse_config(CONFIG).routes[1]
    assert context.upstreams["a"].port == 443
    again = pickle.loads(pickle.dumps(context.route))
    assert type(again) is RouteView and again.plan == ("b",)
    assert again.config == context.route.config


@pytest.mark.anyio
async def test_a_swapped_route_table_times_its_attempts_by_its_own_upstreams() -> None:
    # What an attempt derives from its upstream (timeouts, probe lease, connection slots)
    # is made once per upstream view: a table swapped in (a store reload) with another
    # first_byte_timeout_ms for the same upstream name times the next attempt by it.
    async def slow(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(0.3)
        return web.Response(text="late")

    async with upstream(slow) as up:

        def table(first_byte_ms: int) -> RouteTable:
            loaded = parse_config(
                {
                    "upstreams": {"u": {"url": up.url, "first_byte_timeout_ms": first_byte_ms}},
                    "routes": [{"id": "r", "prefix": "/v1/", "plan": ["u"]}],
                }
            )
            return RouteTable(loaded.routes, loaded.upstreams)

        current = [table(5000)]
        walker = PlanWalker(host_app, config=parse_config({}))
        resolver = RouteResolver(walker, config=parse_config({}), table=lambda: current[0])
        statuses = []
        try:
            async with walker, client_for(resolver) as client:
                for first_byte_ms in (5000, 50, 5000):
                    current[0] = table(first_byte_ms)
                    statuses.append((await client.get("/v1/x")).status_code)
        finally:
            await walker.aclose()
    assert statuses == [200, 502, 200]  # 502: its one attempt timed out (ceiling)
