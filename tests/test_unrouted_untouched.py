"""Every request no route matches goes to the host app untouched (SPEC §1, STYLE.md): the
same scope object with the same contents (the caller's credentials, cookies, x-gateway-*
fields and query kept: they are the host's), and the server's own `receive` and `send`,
not wrappers. Through the Gateway and the resolver alone; the guard, the injector and the
walker used alone see no route on any request and pass each one the same way. Raw ASGI:
what the host app is handed is what is compared."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from fallback_mw import BudgetGuard, CredentialInjector, Gateway, PlanWalker, RouteResolver
from fallback_mw.request.types import ASGIApp, Message, Receive, Scope, Send
from fallback_mw.store.ledgers.memory import MemoryLedger
from tests.helpers import http_scope

pytestmark = pytest.mark.anyio

CONFIG = {
    "upstreams": {"primary": {"url": "http://127.0.0.1:9", "auth_env": "PRIMARY_KEY"}},
    "routes": [
        {"id": "chat", "prefix": "/v1/", "plan": ["primary"]},
        {"id": "acme", "prefix": "/acme/", "plan": ["primary"], "tenant": "acme"},
    ],
}
ENV = {"PRIMARY_KEY": "sk-primary-0001"}
CALLER = [
    (b"authorization", b"Bearer sk-caller-0123456789"),
    (b"cookie", b"session=abc"),
    (b"x-api-key", b"caller-key-0123456789"),
    (b"x-gateway-deadline-ms", b"5"),
    (b"connection", b"x-hop"),
    (b"x-hop", b"1"),
]

Build = Callable[[ASGIApp], Any]
BUILDERS: dict[str, Build] = {
    "Gateway": lambda app: Gateway(app, config=CONFIG, environ=ENV),
    "RouteResolver": lambda app: RouteResolver(app, config=CONFIG, environ=ENV),
    "BudgetGuard": lambda app: BudgetGuard(app, config=CONFIG, ledger=MemoryLedger()),
    "CredentialInjector": lambda app: CredentialInjector(app, config=CONFIG, environ=ENV),
    "PlanWalker": lambda app: PlanWalker(app, config=CONFIG, environ=ENV),
}
UNROUTED = {
    "another path": ("GET", "/health", []),
    "a prefix look-alike": ("POST", "/v1x/chat", []),
    "another case": ("GET", "/V1/chat", []),
    "a dot segment out of the prefix": ("GET", "/v1/../admin", []),
    "another tenant's route": ("GET", "/acme/x", [(b"x-tenant-id", b"other")]),
}
# Without a resolver in front no layer sees a route: a routed path passes too.
ROUTED = {"a routed path": ("POST", "/v1/chat", [(b"x-tenant-id", b"acme")])}


def cases() -> list[tuple[str, str]]:
    found = [(layer, case) for layer in ("Gateway", "RouteResolver") for case in UNROUTED]
    for layer in ("BudgetGuard", "CredentialInjector", "PlanWalker"):
        found += [(layer, case) for case in [*UNROUTED, *ROUTED]]
    return found


@pytest.mark.parametrize(("layer", "case"), cases())
async def test_a_request_no_route_matches_reaches_the_host_app_untouched(
    layer: str, case: str
) -> None:
    handed: dict[str, Any] = {}

    async def host(scope: Scope, receive: Receive, send: Send) -> None:
        handed.update(scope=scope, contents=copy.deepcopy(scope), receive=receive, send=send)
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    method, path, headers = {**UNROUTED, **ROUTED}[case]
    scope = http_scope(method, path, b"api_key=caller-secret&q=1", [*CALLER, *headers])
    if "../" in path:
        scope["path"] = path  # as a server that does not resolve dot segments passes it
    sent_as = copy.deepcopy(scope)
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    app = BUILDERS[layer](host)
    try:
        await app(scope, receive, send)
    finally:
        close = getattr(app, "aclose", None)
        if close is not None:
            await close()
    assert handed, "the host app was not called"
    assert handed["scope"] is scope
    assert handed["contents"] == sent_as
    assert handed["receive"] is receive and handed["send"] is send
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[0]["status"] == 204
