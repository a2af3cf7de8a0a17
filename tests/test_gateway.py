"""Gateway composition: inside FastAPI/Starlette, and the layers used on their own."""

from __future__ import annotations

import asyncio
import gc
import warnings
import weakref
from pathlib import Path
from typing import Any

import httpx
import pytest

from fallback_mw import (
    ConfigError,
    CredentialInjector,
    Gateway,
    PlanWalker,
    RouteResolver,
    load_config,
)
from fallback_mw.faults import NoFaults
from tests.helpers import client_for, http_scope
from tests.upstreams import host_app, status_handler, upstream

pytestmark = pytest.mark.anyio


async def run_lifespan(app: Any) -> list[str]:
    """Drive an app through lifespan startup and shutdown; returns the sent message types."""
    messages: list[str] = []
    inbox = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]

    async def receive() -> dict[str, Any]:
        return inbox.pop(0)

    async def send(message: Any) -> None:
        messages.append(message["type"])

    await app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, receive, send)
    return messages


ENV = {"PRIMARY_KEY": "sk-primary", "BACKUP_KEY": "sk-backup"}


def config_for(primary: str, backup: str) -> dict[str, Any]:
    return {
        "upstreams": {
            "primary": {"url": primary, "auth_env": "PRIMARY_KEY"},
            "backup": {"url": backup, "auth_env": "BACKUP_KEY"},
        },
        "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary", "backup"], "retries": 1}],
    }


async def test_fastapi_add_middleware(monkeypatch: pytest.MonkeyPatch) -> None:
    from fastapi import FastAPI

    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    async with upstream(status_handler(503)) as p, upstream(status_handler(200, b"b")) as b:
        app = FastAPI()

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok"}

        app.add_middleware(Gateway, config=load_config(config_for(p.url, b.url)))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            routed = await client.get("/v1/models")
            local = await client.get("/health")
        await run_lifespan(app)
    assert (routed.status_code, routed.content) == (200, b"b")
    assert routed.headers["x-gateway-provider"] == "backup"
    assert local.json() == {"status": "ok"}
    assert "x-gateway-route" not in local.headers


async def test_starlette_lifespan_closes_the_gateway(monkeypatch: pytest.MonkeyPatch) -> None:
    from starlette.applications import Starlette
    from starlette.middleware import Middleware

    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    async with upstream(status_handler(200)) as p, upstream(status_handler(200)) as b:
        app = Starlette(middleware=[Middleware(Gateway, config=config_for(p.url, b.url))])
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            assert (await client.get("/v1/x")).status_code == 200
        messages = await run_lifespan(app)
    assert messages == [
        "lifespan.startup.complete",
        "lifespan.shutdown.complete",
    ]


@pytest.mark.parametrize("fails", ["startup", "shutdown", "shutdown-raw"])
async def test_a_host_lifespan_that_fails_still_closes_the_gateway(fails: str) -> None:
    """A host app whose own lifespan failed (Starlette sends `lifespan.shutdown.failed`
    when its shutdown code raises; `startup.failed`, after which the server exits; a raw
    app raising after the server asked it to shut down) left the gateway open: it closed
    only on `shutdown.complete`, so its upstream sessions, the store's listener and the
    PostgreSQL ledger's settlements still in flight and its outage backlog were dropped
    at exit without a word. The gateway closes whenever the host's lifespan ends."""
    import contextlib

    from starlette.applications import Starlette
    from starlette.middleware import Middleware

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> Any:
        if fails == "startup":
            raise RuntimeError("the host's database is down")
        yield
        raise RuntimeError("the host's pool did not close")

    async def raw_host(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "lifespan.startup.complete"})
        await receive()
        raise RuntimeError("the host's pool did not close")

    faults = ClosedFaults()
    options = {"config": config_for("http://127.0.0.1:9", "http://127.0.0.1:10")}
    options.update(environ=ENV, faults=faults)
    if fails == "shutdown-raw":
        app: Any = Gateway(raw_host, **options)
    else:
        app = Starlette(middleware=[Middleware(Gateway, **options)], lifespan=lifespan)
    messages: list[str] = []
    inbox = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]

    async def receive() -> dict[str, Any]:
        return inbox.pop(0)

    async def send(message: Any) -> None:
        messages.append(message["type"])

    with pytest.raises(RuntimeError, match="the host's"):
        await app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, receive, send)
    assert faults.closed == 1, messages


async def test_a_host_returning_from_the_lifespan_unasked_has_it_answered() -> None:
    """The usual bare ASGI app returns at once for any scope but "http" (no lifespan):
    uvicorn then reported "Application startup complete" while the gateway had neither
    started (an unusable Redis `state` said only at the first routed request) nor, at
    shutdown, closed (upstream sessions, the store's listener, the PostgreSQL ledger's
    settlements in flight and its outage backlog dropped). The gateway answers such a
    host's lifespan itself, as it does for one that refuses the scope by raising."""

    async def bare(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return

    faults = ClosedFaults()
    gateway = Gateway(
        bare, config=config_for("http://127.0.0.1:9", "http://127.0.0.1:10"), environ=ENV,
        faults=faults,
    )  # fmt: skip
    assert await run_lifespan(gateway) == [
        "lifespan.startup.complete",
        "lifespan.shutdown.complete",
    ]
    assert faults.closed == 1


async def test_layers_compose_without_budget_guard() -> None:
    async with upstream(status_handler(503)) as p, upstream(status_handler(200, b"b")) as b:
        config = load_config(config_for(p.url, b.url), environ=ENV)
        walker = PlanWalker(host_app, config=config)
        app = RouteResolver(CredentialInjector(walker, config=config, environ=ENV), config=config)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            routed = await client.get("/v1/x", headers={"authorization": "Bearer caller"})
            other = await client.get("/nope")
        await walker.aclose()
    assert routed.content == b"b"
    assert ("authorization", "Bearer sk-backup") in b.received[0].headers
    assert other.content == b"host app"


@pytest.mark.parametrize("form", ["path", "dict"])
async def test_layers_composed_by_hand_take_a_path_or_a_dict_as_gateway_does(
    form: str, tmp_path: Path
) -> None:
    """SPEC §2: `config=` is a GatewayConfig, a path or a dict; the layers used on their own
    took only the model (a path or a dict was an AttributeError at construction)."""
    from fallback_mw import BudgetGuard

    async with upstream(status_handler(503)) as p, upstream(status_handler(200, b"b")) as b:
        source: Any = config_for(p.url, b.url)
        if form == "path":
            toml = tmp_path / "gateway.toml"
            toml.write_text(
                f"""
[upstreams.primary]
url = "{p.url}"
auth_env = "PRIMARY_KEY"
[upstreams.backup]
url = "{b.url}"
auth_env = "BACKUP_KEY"
[[routes]]
id = "chat"
prefix = "/v1/"
plan = ["primary", "backup"]
retries = 1
""",
                encoding="utf-8",
            )
            source = toml
        walker = PlanWalker(host_app, config=source, environ=ENV)
        injector = CredentialInjector(walker, config=source, environ=ENV)
        app = RouteResolver(BudgetGuard(injector, config=source), config=source)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            routed = await client.get("/v1/x", headers={"authorization": "Bearer caller"})
        await walker.aclose()
    assert routed.content == b"b"
    assert routed.headers["x-gateway-provider"] == "backup"
    assert ("authorization", "Bearer sk-backup") in b.received[0].headers


async def test_walker_alone_still_strips_caller_credentials(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    async with upstream(status_handler(200)) as p, upstream(status_handler(200)) as b:
        config = load_config(config_for(p.url, b.url), environ=ENV)
        walker = PlanWalker(host_app, config=config)
        app = RouteResolver(walker, config=config)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            await client.get("/v1/x", headers={"authorization": "Bearer caller", "cookie": "c=1"})
        await walker.aclose()
    values = [v for _, v in p.received[0].headers]
    assert "Bearer caller" not in values and "c=1" not in values
    assert ("authorization", "Bearer sk-primary") in p.received[0].headers


async def test_websocket_and_lifespan_scopes_pass_through() -> None:
    seen: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(scope["type"])

    gateway = Gateway(app, config={"routes": []})
    await gateway({"type": "websocket", "path": "/v1/ws"}, None, None)  # type: ignore[arg-type]
    assert seen == ["websocket"]


def test_a_lifespan_off_asyncio_fails_the_startup_saying_the_gateway_needs_asyncio() -> None:
    """Served on a loop that is not asyncio's (hypercorn's trio worker), the gateway started
    and then every routed request failed with a bare `RuntimeError: no running event loop`
    (README: trio is not supported, but nothing said so at run time). The lifespan startup
    now fails saying the gateway runs on asyncio only. Driven here without any asyncio loop
    running, as a trio server drives it."""
    config = {
        "gateway": {"allow_hosts": ["127.0.0.1"]},
        "upstreams": {"primary": {"url": "http://127.0.0.1:9"}},
        "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"]}],
    }
    gateway = Gateway(host_app, config=config)
    sent: list[dict[str, Any]] = []
    messages = [{"type": "lifespan.shutdown"}, {"type": "lifespan.startup"}]

    async def receive() -> dict[str, Any]:
        return messages.pop()

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    lifespan = gateway({"type": "lifespan", "asgi": {"version": "3.0"}}, receive, send)
    with pytest.raises(RuntimeError, match="runs on asyncio only"):
        lifespan.send(None)  # nothing in it suspends: it ends at the first step
    assert sent[0]["type"] == "lifespan.startup.failed"
    assert "trio is not supported" in sent[0]["message"]


def test_a_routed_request_off_asyncio_says_the_gateway_needs_asyncio() -> None:
    """A gateway the lifespan never reaches (Starlette runs none for a mounted app) served
    by hypercorn's trio worker: each routed request was a bare 500 whose log said only
    "RuntimeError: no running event loop". It says what to change, as the lifespan
    startup does. Driven here without any asyncio loop running, as a trio server would."""
    config = {
        "gateway": {"allow_hosts": ["127.0.0.1"]},
        "upstreams": {"primary": {"url": "http://127.0.0.1:9"}},
        "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"]}],
    }
    gateway = Gateway(host_app, config=config)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        pass

    scope = http_scope("GET", "/v1/chat")
    with pytest.raises(RuntimeError, match="runs on asyncio only") as raised:
        gateway(scope, receive, send).send(None)  # fails before anything suspends
    assert "trio is not supported" in str(raised.value)

    async def failing_host(scope: Any, receive: Any, send: Any) -> None:
        raise RuntimeError("the host app's own error")

    # A request no route takes is the host app's, trio or not: its error is its own.
    gateway = Gateway(failing_host, config=config)
    with pytest.raises(RuntimeError, match="the host app's own error"):
        gateway(http_scope("GET", "/elsewhere"), receive, send).send(None)


@pytest.mark.parametrize("wrong", [None, 8080, b"gateway.toml", ["gateway.toml"]])
def test_a_config_of_the_wrong_type_is_refused_naming_what_is_accepted(wrong: Any) -> None:
    """`Gateway(app, config=settings.get("gateway"))` with the setting missing raised
    Path()'s "expected str, bytes or os.PathLike object, not NoneType": it named neither a
    dict nor a GatewayConfig, and bytes, which was then refused too. The TypeError now names
    the three accepted forms and what was given, for the gateway and load_config alike."""
    for build in (lambda: Gateway(host_app, config=wrong), lambda: load_config(wrong)):
        with pytest.raises(TypeError, match="GatewayConfig, a dict or the path of a TOML file"):
            build()


class ClosedFaults(NoFaults):
    """A handed fault source that says whether it was closed."""

    closed = 0

    async def aclose(self) -> None:
        self.closed += 1


@pytest.mark.parametrize("store", [False, True])
async def test_a_gateway_and_a_walker_are_async_context_managers(
    store: bool, tmp_path: Path
) -> None:
    """`async with Gateway(...) as gateway:` (a developer's test, a host without lifespan)
    raised "'Gateway' object does not support the asynchronous context manager protocol":
    only `aclose` was there. Entering starts it as the lifespan startup does (the store's
    reloader too), leaving closes what it owns, the pieces it was handed included."""
    async with upstream(status_handler(200, b"p")) as p:
        conf = config_for(p.url, p.url + "/b")
        if store:
            conf["gateway"] = {"store": f"sqlite:///{tmp_path / 'gateway.db'}"}
        faults = ClosedFaults()
        gateway = Gateway(host_app, config=conf, environ=ENV, faults=faults)
        async with gateway, client_for(gateway) as client:
            assert (await client.get("/v1/x")).content == b"p"
        assert faults.closed == 1
        walker = PlanWalker(host_app, config=conf, environ=ENV)
        async with walker, client_for(RouteResolver(walker, config=conf)) as client:
            assert (await client.get("/v1/x")).content == b"p"


async def test_async_with_a_configuration_that_did_not_load_raises_it() -> None:
    with pytest.raises(ConfigError, match=r"no-such-gateway\.toml' not found"):
        async with Gateway(host_app, config="no-such-gateway.toml"):
            pass
    with pytest.raises(ConfigError, match=r"no-such-gateway\.toml' not found"):
        async with PlanWalker(host_app, config="no-such-gateway.toml"):
            pass


async def test_a_walker_on_a_gateways_services_leaves_them_open() -> None:
    """A PlanWalker handed `services=` does not close them at its lifespan shutdown (they
    are their builder's), but `walker.aclose()` did: the gateway's client, health state,
    faults and ledger were closed under it."""
    faults = ClosedFaults()
    gateway = Gateway(host_app, config=config_for("http://127.0.0.1:9", "http://127.0.0.1:10"),
                      environ=ENV, faults=faults)  # fmt: skip
    walker = PlanWalker(host_app, config=gateway.config, services=gateway.services)
    await walker.aclose()
    async with walker:
        pass
    assert faults.closed == 0
    await gateway.aclose()
    assert faults.closed == 1


@pytest.mark.anyio
async def test_a_gateway_dropped_unclosed_closes_its_connections_on_its_loop() -> None:
    # An app built per test and served through httpx.ASGITransport runs no lifespan: once
    # it was dropped, its gateway's kept-alive upstream connections went to the garbage
    # collector ("Unclosed connector", an error in a suite run with -W error).
    async with upstream(status_handler(200, b"ok")) as primary:
        gateway = Gateway(
            host_app,
            config={
                "gateway": {"allow_hosts": ["127.0.0.1"]},
                "upstreams": {"primary": {"url": primary.url, "auth_env": "DROPPED_KEY"}},
                "routes": [{"id": "r", "prefix": "/v1/", "plan": ["primary"]}],
            },
            environ={"DROPPED_KEY": "k"},
        )
        transport = httpx.ASGITransport(app=gateway)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            assert (await client.get("/v1/models")).content == b"ok"
        services = weakref.ref(gateway.services)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            del gateway, transport, client
            gc.collect()
            await asyncio.sleep(0.2)  # the close runs on this loop
            gc.collect()
    assert [str(w.message) for w in caught if w.category is ResourceWarning] == []
    assert services() is None  # closed, then let go: not kept alive by the close


@pytest.mark.anyio
async def test_a_walker_used_alone_dropped_unclosed_closes_its_connections_on_its_loop() -> None:
    # The same for a PlanWalker used without a Gateway: it builds its own services too.
    async with upstream(status_handler(200, b"ok")) as primary:
        conf = {
            "gateway": {"allow_hosts": ["127.0.0.1"]},
            "upstreams": {"primary": {"url": primary.url}},
            "routes": [{"id": "r", "prefix": "/v1/", "plan": ["primary"]}],
        }
        walker = PlanWalker(host_app, config=conf)
        app = RouteResolver(walker, config=conf)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            assert (await client.get("/v1/models")).content == b"ok"
        services = weakref.ref(walker.services)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            del walker, app, transport, client
            gc.collect()
            await asyncio.sleep(0.2)  # the close runs on this loop
            gc.collect()
    assert [str(w.message) for w in caught if w.category is ResourceWarning] == []
    assert services() is None


@pytest.mark.anyio
async def test_a_dropped_gateway_leaves_what_it_was_handed_to_its_host() -> None:
    # Closing at collection is for a gateway's own pieces: a client the host handed it
    # (perhaps shared with the next gateway a test builds) is closed when the host says.
    closed: list[str] = []

    class Handed:
        async def send(self, request: Any) -> Any:
            raise AssertionError("no request is sent")

        async def aclose(self) -> None:
            closed.append("client")

    handed = Handed()
    gateway = Gateway(host_app, config={"gateway": {}}, client=handed)  # type: ignore[arg-type]
    del gateway
    gc.collect()
    await asyncio.sleep(0.05)
    assert closed == []
