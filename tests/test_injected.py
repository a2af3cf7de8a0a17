"""What a host hands `Gateway` or a layer in place of a piece it would build (`client=`,
`health=`, `faults=`, `ledger=`, `capacity=`, `telemetry=`, `services=`, `table=`,
`environ=`) is checked when it is built. A developer who passed the wrong object got no
error at construction and an AttributeError deep in the walk on every request (a 500, or
an `internal_error` log line); `telemetry=` failed with an AttributeError from the
services. Now the constructor raises a TypeError naming the parameter and the interface,
and everything the package ships (and the documented doubles) still passes."""

from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from starlette.applications import Starlette

from fallback_mw import (
    BudgetGuard,
    CredentialInjector,
    Gateway,
    PlanWalker,
    RouteResolver,
    load_config,
)
from fallback_mw.budget import Ledger
from fallback_mw.capacity import CapacityState
from fallback_mw.faults import FaultSource
from fallback_mw.health import AlwaysHealthy, HealthState
from fallback_mw.injected import require
from fallback_mw.upstream import UpstreamClient
from fallback_mw.upstream.httpx_engine import HttpxClient
from tests.helpers import COMPILED, client_for
from tests.upstreams import host_app

pytestmark = pytest.mark.anyio


def config(**gateway: Any) -> dict[str, Any]:
    return {
        "gateway": {"allow_hosts": ["127.0.0.1"], **gateway},
        "upstreams": {"primary": {"url": "http://127.0.0.1:9"}},
        "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"]}],
    }


Build = Callable[..., object]
LAYERS: dict[str, Build] = {
    "Gateway": lambda **kw: Gateway(host_app, config=config(), **kw),
    "BudgetGuard": lambda **kw: BudgetGuard(host_app, config=config(), **kw),
    "RouteResolver": lambda **kw: RouteResolver(host_app, config=config(), **kw),
    "CredentialInjector": lambda **kw: CredentialInjector(host_app, config=config(), **kw),
    "PlanWalker": lambda **kw: PlanWalker(host_app, config=config(), **kw),
}
# (constructor, parameter, what the error names)
INJECTABLES = [
    ("Gateway", "client", "fallback_mw.upstream.UpstreamClient"),
    ("Gateway", "health", "fallback_mw.health.HealthState"),
    ("Gateway", "faults", "fallback_mw.faults.FaultSource"),
    ("Gateway", "ledger", "fallback_mw.budget.Ledger"),
    ("Gateway", "telemetry", "fallback_mw.telemetry.Telemetry"),
    ("Gateway", "environ", "mapping"),
    ("BudgetGuard", "ledger", "fallback_mw.budget.Ledger"),
    ("BudgetGuard", "telemetry", "fallback_mw.telemetry.Telemetry"),
    ("RouteResolver", "table", "function returning the RouteTable"),
    ("RouteResolver", "telemetry", "fallback_mw.telemetry.Telemetry"),
    ("RouteResolver", "ledger", "fallback_mw.budget.Ledger"),
    ("RouteResolver", "environ", "mapping"),
    ("CredentialInjector", "environ", "mapping"),
    ("PlanWalker", "services", "fallback_mw.services.Services"),
    ("PlanWalker", "client", "fallback_mw.upstream.UpstreamClient"),
    ("PlanWalker", "health", "fallback_mw.health.HealthState"),
    ("PlanWalker", "faults", "fallback_mw.faults.FaultSource"),
    ("PlanWalker", "telemetry", "fallback_mw.telemetry.Telemetry"),
    ("PlanWalker", "capacity", "fallback_mw.capacity.CapacityState"),
    ("PlanWalker", "environ", "mapping"),
]


class Unrelated:
    """Has none of any interface's methods (a `table=` is called, so it is not callable)."""


@pytest.mark.parametrize(("layer", "parameter", "interface"), INJECTABLES)
def test_a_wrong_object_is_refused_at_construction_naming_the_parameter_and_interface(
    layer: str, parameter: str, interface: str
) -> None:
    with pytest.raises(TypeError) as raised:
        LAYERS[layer](**{parameter: Unrelated()})
    message = str(raised.value)
    if COMPILED and parameter == "telemetry":
        # Compiled, a parameter typed with a class (`Telemetry | None`) is checked where the
        # call enters `__init__`, before the layer's own check: still refused at construction,
        # in mypyc's words ("...Telemetry or None object expected; got ...Unrelated").
        assert "Telemetry or None object expected" in message, message
    else:
        assert message.startswith(f"{layer}: {parameter}= "), message
        assert interface in message, message
    assert "Unrelated" in message, message


def test_it_is_refused_even_when_the_configuration_does_not_load() -> None:
    # A config error is kept for the lifespan; a wrong object is the host's code.
    with pytest.raises(TypeError, match=r"ledger= must implement fallback_mw\.budget\.Ledger"):
        Gateway(host_app, config="no-such-gateway.toml", ledger=Unrelated())


@pytest.mark.parametrize("layer", list(LAYERS))
@pytest.mark.parametrize("app", ["main:app", None])
def test_an_app_that_is_not_callable_is_refused_at_construction(layer: str, app: Any) -> None:
    """`Gateway("main:app", config=...)` (the import string uvicorn takes) or an app that
    came back None was accepted: routed requests were served, and every other request was
    a 500 "'str' object is not callable" far from the mistake. The constructor says it."""
    build = {
        "Gateway": Gateway,
        "BudgetGuard": BudgetGuard,
        "RouteResolver": RouteResolver,
        "CredentialInjector": CredentialInjector,
        "PlanWalker": PlanWalker,
    }[layer]
    with pytest.raises(TypeError) as raised:
        build(app, config=config())
    message = str(raised.value)
    assert message.startswith(f"{layer}: its first argument is the ASGI app it wraps"), message
    assert f"not {type(app).__name__}" in message, message


@pytest.mark.parametrize("layer", [layer for layer in LAYERS if layer != "BudgetGuard"])
def test_an_environ_value_that_is_not_text_is_refused_naming_the_variable(layer: str) -> None:
    """`environ={"OPENAI_API_KEY": settings.openai_api_key}` with pydantic-settings'
    SecretStr (or bytes) failed deep in the configuration's checks with "'SecretStr'
    object has no attribute 'encode'". The constructor names the variable and the type,
    never the value, and says how to get the text out of a SecretStr."""

    class SecretStr:  # pydantic's shape: the text only through get_secret_value()
        def get_secret_value(self) -> str:
            return "sk-never-shown"

    with pytest.raises(TypeError) as raised:
        LAYERS[layer](environ={"PRIMARY_KEY": SecretStr()})
    message = str(raised.value)
    assert message.startswith(f"{layer}: environ= maps each variable"), message
    assert "'PRIMARY_KEY' holds" in message and "get_secret_value()" in message, message
    with pytest.raises(TypeError, match=r"'PRIMARY_KEY' holds bytes$"):
        LAYERS[layer](environ={"PRIMARY_KEY": b"sk-never-shown"})
    assert "sk-never-shown" not in message
    with pytest.raises(TypeError, match=r"^load_config: environ= .*'PRIMARY_KEY' holds bytes$"):
        load_config(config(), environ={"PRIMARY_KEY": b"sk-never-shown"})


def test_a_double_missing_one_method_is_named() -> None:
    class Faults:
        async def upstream_fault(self, upstream: str) -> None:
            return None

        async def aclose(self) -> None:
            return None

    with pytest.raises(TypeError) as raised:
        Gateway(host_app, config=config(), faults=Faults())
    assert "has no pinned_candidate" in str(raised.value), raised.value


def test_the_class_instead_of_an_instance_says_to_build_one() -> None:
    with pytest.raises(TypeError, match=r"not the class AlwaysHealthy itself: pass AlwaysHealthy"):
        Gateway(host_app, config=config(), health=AlwaysHealthy)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["transport", "client"])
async def test_an_httpx_transport_or_client_as_client_says_how_to_wrap_it(kind: str) -> None:
    # httpx.AsyncClient has a `send` and an `aclose` of its own: named, not taken.
    transport = httpx.MockTransport(lambda request: httpx.Response(200))
    given: Any = transport if kind == "transport" else httpx.AsyncClient(transport=transport)
    try:
        with pytest.raises(TypeError, match=r"HttpxClient\(transport=\.\.\.\)"):
            Gateway(host_app, config=config(), client=given)
    finally:
        await given.aclose()


async def test_the_documented_httpx_double_and_a_partial_health_double_still_serve() -> None:
    class PrimaryOpen(AlwaysHealthy):  # a double subclassing the shipped no-op state
        async def admit(self, upstream: str, **_: Any) -> bool:
            return upstream != "primary"

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=httpx.ByteStream(request.url.host.encode()))

    mock = HttpxClient(allow_hosts=["127.0.0.1"], transport=httpx.MockTransport(answer))
    gateway = Gateway(host_app, config=config(), client=mock)
    try:
        async with client_for(gateway) as client:
            response = await client.get("/v1/models")
            assert response.status_code == 200, response.text
            assert response.text == "127.0.0.1"
    finally:
        await gateway.aclose()
    gateway = Gateway(host_app, config=config(), health=PrimaryOpen())
    try:
        async with client_for(gateway) as client:
            assert (await client.get("/v1/models")).status_code == 503
    finally:
        await gateway.aclose()


def check_shipped(gateway: Gateway) -> None:
    services = gateway.services
    for value, interface, parameter in (
        (services.client, UpstreamClient, "client"),
        (services.health, HealthState, "health"),
        (services.faults, FaultSource, "faults"),
        (services.capacity, CapacityState, "capacity"),
        (services.ledger, Ledger, "ledger"),
    ):
        require(value, interface, parameter=parameter, owner="Gateway")
    # and handed to the layers, as Gateway hands them
    PlanWalker(host_app, config=gateway.config, services=services)
    BudgetGuard(
        host_app, config=gateway.config, ledger=services.ledger, telemetry=services.telemetry
    )
    RouteResolver(host_app, config=gateway.config, table=services.table, ledger=services.ledger)


@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
async def test_what_the_package_builds_in_memory_passes_its_own_check(engine: str) -> None:
    gateway = Gateway(host_app, config=config(engine=engine))
    try:
        check_shipped(gateway)
    finally:
        await gateway.aclose()


async def test_what_the_package_builds_on_sqlite_and_redis_passes_its_own_check(
    tmp_path: Path, redis_url: str
) -> None:
    store = f"sqlite:///{tmp_path / 'gateway.db'}"
    gateway = Gateway(host_app, config=config(store=store, state=redis_url))
    try:
        check_shipped(gateway)
    finally:
        await gateway.aclose()


async def test_what_the_package_builds_on_postgresql_passes_its_own_check(pg_url: str) -> None:
    gateway = Gateway(host_app, config=config(store=pg_url))
    try:
        check_shipped(gateway)
    finally:
        await gateway.aclose()


@pytest.mark.parametrize(
    "response",
    [
        httpx.Response(200, json={"ok": True}),
        httpx.Response(200, content=b"x" * 100_000),
        httpx.Response(204),
    ],
    ids=["json", "content", "empty"],
)
async def test_an_httpx_mock_transports_response_built_with_its_content_is_relayed(
    response: httpx.Response,
) -> None:
    # HttpxClient(transport=httpx.MockTransport(...)), the double httpx documents: a
    # response built with its content (json=, content=) is read as it is made, and the
    # engine's aiter_raw raised StreamConsumed on every request (an internal_error).
    mock = HttpxClient(transport=httpx.MockTransport(lambda request: response))
    gateway = Gateway(host_app, config=config(), client=mock)
    try:
        async with client_for(gateway) as client:
            answer = await client.get("/v1/models")
        assert answer.status_code == response.status_code
        assert answer.content == response.content
    finally:
        await gateway.aclose()


def test_every_interface_a_gateway_takes_is_documented_with_its_methods() -> None:
    # Only Ledger was documented for users (docs/budgets.md: "must implement the
    # fallback_mw.budget.Ledger protocol"); client=, health=, faults=, capacity= were not,
    # so the refusal above named interfaces no page described.
    from fallback_mw.injected import _methods

    page = (Path(__file__).parent.parent / "docs" / "budgets.md").read_text()
    section = page[page.index("## Handing the gateway your own pieces") :]
    for interface in (UpstreamClient, HealthState, FaultSource, Ledger, CapacityState):
        assert f"`{interface.__name__}`" in section, interface
        for method in _methods(interface):
            assert f"`{method}" in section, (interface.__name__, method)
    for _, parameter, named in INJECTABLES:
        assert f"`{parameter}=`" in section, parameter
        if named.startswith("fallback_mw."):
            assert f"`{named}`" in section, named
    # the table's last column: which constructors take each keyword
    for line in section.splitlines():
        keyword = re.match(r"\| `(\w+)=` \|", line)
        if keyword:
            named = set(re.findall(r"`(\w+)`", line.split("|")[-2])) & set(LAYERS)
            takes = {layer for layer, parameter, _ in INJECTABLES if parameter == keyword[1]}
            assert named == takes, (keyword[1], named, takes)
    # and a developer reading the README's testing advice finds it
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    assert "(docs/budgets.md#handing-the-gateway-your-own-pieces)" in readme


def test_telemetrys_providers_are_checked_when_it_is_built() -> None:
    # `Telemetry(meter_provider=object())` failed with an AttributeError from inside its
    # constructor; a wrong tracer provider, at the first request's span.
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider

    from fallback_mw.telemetry import Telemetry

    with pytest.raises(TypeError, match=r"^Telemetry: meter_provider= takes a opentelemetry"):
        Telemetry(meter_provider=object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^Telemetry: tracer_provider= .* not the class itself"):
        Telemetry(tracer_provider=TracerProvider)  # type: ignore[arg-type]
    tracer_provider = TracerProvider(shutdown_on_exit=False)
    meter_provider = MeterProvider(shutdown_on_exit=False)
    Telemetry(tracer_provider=tracer_provider, meter_provider=meter_provider)  # the SDK's pass
    tracer_provider.shutdown()
    meter_provider.shutdown()


def _app_factory() -> Any:  # as Django's get_asgi_application: called, it returns the app
    return host_app


@pytest.mark.parametrize("layer", list(LAYERS))
@pytest.mark.parametrize(
    ("app", "named"),
    [
        (Starlette, "the class Starlette itself: pass Starlette(...)"),
        (FastAPI, "the class FastAPI itself: pass FastAPI(...)"),
        (_app_factory, "_app_factory, which cannot be called as an ASGI app"),
    ],
)
def test_an_app_class_or_factory_is_refused_at_construction(
    layer: str, app: Any, named: str
) -> None:
    """`Gateway(FastAPI, config=...)` or, in a Django asgi.py, `Gateway(get_asgi_application,
    config=...)` (the class or the factory, not what it makes) was accepted: both are
    callable. Routed requests were served, and every other request was a 500 far from the
    mistake ("get_asgi_application() takes 0 positional arguments but 3 were given"). The
    constructor says what to pass."""
    build = {
        "Gateway": Gateway,
        "BudgetGuard": BudgetGuard,
        "RouteResolver": RouteResolver,
        "CredentialInjector": CredentialInjector,
        "PlanWalker": PlanWalker,
    }[layer]
    with pytest.raises(TypeError) as raised:
        build(app, config=config())
    message = str(raised.value)
    assert message.startswith(f"{layer}: its first argument is the ASGI app it wraps"), message
    assert named in message, message


@pytest.mark.parametrize(
    "app",
    [
        host_app,
        Starlette(),
        FastAPI(),
        lambda scope, receive, send: None,
        lambda *args: None,
        functools.partial(lambda extra, scope, receive, send: None, 1),
    ],
)
def test_every_shape_of_asgi_app_is_taken(app: Any) -> None:
    Gateway(app, config=config())


class _StaticCall:  # the instance is the app: its class's __call__ takes no self
    @staticmethod
    async def __call__(scope: Any, receive: Any, send: Any) -> None:
        await host_app(scope, receive, send)


class _ClassCall:  # bound to the class, whichever instance is called
    @classmethod
    async def __call__(cls, scope: Any, receive: Any, send: Any) -> None:
        await host_app(scope, receive, send)


class _PartialCall:  # a callable without __get__ is called as it is, self not passed
    __call__ = functools.partial(host_app)


class _SlotCall:
    """sentry_sdk's SentryAsgiMiddleware's shape: `__call__` is a slot, set per instance to
    a bound method (`_run_asgi3`, or `_run_asgi2` for an ASGI 2 app)."""

    __slots__ = ("__call__", "app")

    def __init__(self, app: Any) -> None:
        self.app = app
        self.__call__ = self._run_asgi3  # type: ignore[method-assign]

    async def _run_asgi3(self, scope: Any, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)


@pytest.mark.parametrize(
    "app",
    [_StaticCall(), _ClassCall(), _PartialCall(), _SlotCall(host_app)],
    ids=["staticmethod", "classmethod", "partial", "slot (Sentry's middleware)"],
)
async def test_an_app_whose_call_takes_no_self_is_taken(app: Any) -> None:
    """An instance whose class's `__call__` is a staticmethod, a classmethod, a callable
    without `__get__` or a slot holding a bound method (Sentry's SentryAsgiMiddleware) is
    an ASGI app as a server calls it (`app(scope, receive, send)`), but inspect.signature
    read the first parameter of the first three as `self` and dropped it, and could not
    read the slot at all: the check refusing factories (f8151e7) refused each at
    construction ("cannot be called as an ASGI app"). Each is taken, and a request no route
    takes reaches it. Reading a partial `__call__`'s `__get__` warned on Python 3.13
    (FutureWarning, an error under -W error): the gateway warns of nothing."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gateway = Gateway(app, config=config())
    with warnings.catch_warnings():
        # Python 3.13 itself warns whenever it calls such an app (the partial becomes a
        # method descriptor in 3.14): the app's own warning, not the gateway's.
        warnings.filterwarnings("ignore", "functools.partial will be", FutureWarning)
        async with client_for(gateway) as client:
            answer = await client.get("/elsewhere")
    assert (answer.status_code, answer.text) == (404, "host app")
    await gateway.aclose()
    for build in (BudgetGuard, RouteResolver, CredentialInjector, PlanWalker):
        build(app, config=config())


def _asgi2_app(scope: Any) -> Any:  # ASGI 2: called with the scope, its answer with the rest
    async def answer(receive: Any, send: Any) -> None:
        await host_app(scope, receive, send)

    return answer


class _Asgi2Consumer:  # ASGI 2 as a class (Channels 2's consumers): made with the scope
    def __init__(self, scope: Any) -> None:
        self.scope = scope

    async def __call__(self, receive: Any, send: Any) -> None:
        await host_app(self.scope, receive, send)


@pytest.mark.parametrize(
    ("app", "told"),
    [
        (_asgi2_app, "_asgi2_app, which cannot be called as an ASGI app"),
        (_Asgi2Consumer, "not the class _Asgi2Consumer, an ASGI 2 app"),
    ],
    ids=["function", "class"],
)
async def test_an_asgi2_app_is_refused_naming_how_to_wrap_it(app: Any, told: str) -> None:
    """An ASGI 2 app (called with the scope alone) was never served: the layers call their
    app as ASGI 3 (a request no route took failed with a TypeError). f8151e7 refused it at
    construction with advice that did not fit ("pass the app itself (_asgi2_app() if
    _asgi2_app makes it)"; for the class "pass _Asgi2Consumer(...)", which needs a scope).
    The refusal names the ASGI 2 shape and asgiref's wrapper, which is taken and serves."""
    from asgiref.compatibility import guarantee_single_callable

    with pytest.raises(TypeError) as raised:
        Gateway(app, config=config())
    message = str(raised.value)
    assert told in message, message
    assert "asgiref.compatibility.guarantee_single_callable(" in message, message
    gateway = Gateway(guarantee_single_callable(app), config=config())
    async with client_for(gateway) as client:
        answer = await client.get("/elsewhere")
    assert (answer.status_code, answer.text) == (404, "host app")
    await gateway.aclose()
