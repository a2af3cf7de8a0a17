"""Each public layer served directly by an ASGI server, no Gateway around it (and the
Gateway itself, compiled too). uvicorn and
hypercorn tell an ASGI 3 app from an ASGI 2 one by `iscoroutinefunction(app.__call__)`
(daphne, through asgiref, the same), and a layer taken for ASGI 2 is called with the scope
alone: every request a 500. Compiled (scripts/compile.py), a Python class's coroutine
method is no coroutine function (the plan walker's was not); these tests run whichever
build is in place, and tests/test_compile_hazards.py refuses that shape in the pure one.
Real sockets: uvicorn in process, a local aiohttp upstream on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest
import uvicorn
from asgiref.compatibility import is_double_callable
from hypercorn.utils import is_asgi

from fallback_mw import Gateway
from fallback_mw.config import GatewayConfig, load_config
from fallback_mw.layers.guard import BudgetGuard
from fallback_mw.layers.injector import CredentialInjector
from fallback_mw.layers.resolver import RouteResolver
from fallback_mw.layers.walker import PlanWalker
from fallback_mw.request.types import ASGIApp
from fallback_mw.store.ledgers.memory import MemoryLedger
from tests.upstreams import host_app, serve_asgi, status_handler, upstream

pytestmark = pytest.mark.anyio

Layer = Callable[[ASGIApp, GatewayConfig], Any]

LAYERS: dict[str, Layer] = {
    "Gateway": lambda app, config: Gateway(app, config=config),
    "RouteResolver": lambda app, config: RouteResolver(app, config=config),
    "CredentialInjector": lambda app, config: CredentialInjector(app, config=config),
    "BudgetGuard": lambda app, config: BudgetGuard(app, config=config, ledger=MemoryLedger()),
    "PlanWalker": lambda app, config: PlanWalker(app, config=config),
}


def config_for(url: str) -> GatewayConfig:
    return load_config(
        {
            "upstreams": {"primary": {"url": url}},
            "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"]}],
        }
    )


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_every_asgi_server_takes_each_layer_for_an_asgi_3_app(name: str) -> None:
    layer = LAYERS[name](host_app, config_for("http://127.0.0.1:9"))
    config = uvicorn.Config(layer)
    config.load()
    assert config.interface == "asgi3", name
    assert is_asgi(layer), name  # hypercorn
    assert not is_double_callable(layer), name  # daphne (asgiref)


@pytest.mark.parametrize("name", sorted(LAYERS))
async def test_each_layer_served_directly_by_uvicorn_passes_an_unrouted_request(
    name: str,
) -> None:
    layer = LAYERS[name](host_app, config_for("http://127.0.0.1:9"))
    try:
        async with serve_asgi(layer) as url, httpx.AsyncClient() as client:
            response = await client.get(f"{url}/elsewhere")
    finally:
        if isinstance(layer, PlanWalker):
            await layer.aclose()
    assert (response.status_code, response.text) == (404, "host app"), name


async def test_the_resolver_and_walker_served_directly_by_uvicorn_walk_a_route() -> None:
    async with upstream(status_handler(200, b"from upstream")) as primary:
        config = config_for(primary.url)
        walker = PlanWalker(host_app, config=config)
        try:
            async with (
                serve_asgi(RouteResolver(walker, config=config)) as url,
                httpx.AsyncClient() as client,
            ):
                response = await client.post(f"{url}/v1/chat", content=b"{}")
        finally:
            await walker.aclose()
    assert (response.status_code, response.text) == (200, "from upstream")
    assert response.headers["x-gateway-provider"] == "primary"
    assert primary.count == 1
