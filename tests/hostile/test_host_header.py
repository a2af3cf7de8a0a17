"""A DNS-rebinding web page as the caller: the gateway answers whatever name a request was
sent to (SPEC §4: `Host` is the upstream's), and to the browser a page on the rebound name
is the same origin as the gateway, so no cross-origin rule applies. docs/security.md says
to check `Host` in front of the gateway; this shows the documented way does it before any
upstream is contacted, and that the gateway itself never passes the caller's `Host` on."""

from __future__ import annotations

import pytest
from starlette.middleware.trustedhost import TrustedHostMiddleware

from fallback_mw import Gateway
from tests.helpers import client_for
from tests.upstreams import host_app, status_handler, upstream

pytestmark = pytest.mark.anyio


async def test_a_host_check_in_front_refuses_a_rebound_name_before_any_upstream() -> None:
    async with upstream(status_handler(200, b"{}", **{"content-type": "application/json"})) as up:
        conf = {
            "gateway": {"allow_hosts": ["127.0.0.1"]},
            "upstreams": {"primary": {"url": up.url, "auth_env": "FMW_T_KEY"}},
            "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"]}],
        }
        gateway = Gateway(host_app, config=conf, environ={"FMW_T_KEY": "operator-key"})
        app = TrustedHostMiddleware(gateway, allowed_hosts=["localhost", "127.0.0.1"])
        try:
            async with client_for(app) as client:
                rebound = await client.get("/v1/models", headers={"host": "attacker.example"})
                local = await client.get("/v1/models", headers={"host": "127.0.0.1:8080"})
        finally:
            await gateway.aclose()
    assert rebound.status_code == 400 and rebound.text == "Invalid host header"
    assert local.status_code == 200
    (received,) = up.received  # the refused request reached no upstream
    assert dict(received.headers)["host"] != "127.0.0.1:8080"  # the upstream's own Host


async def test_without_a_host_check_the_gateway_answers_any_name() -> None:
    # What the docs warn about: the gateway alone does not look at Host.
    async with upstream(status_handler(200, b"{}", **{"content-type": "application/json"})) as up:
        conf = {
            "gateway": {"allow_hosts": ["127.0.0.1"]},
            "upstreams": {"primary": {"url": up.url}},
            "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"]}],
        }
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                rebound = await client.get("/v1/models", headers={"host": "attacker.example"})
        finally:
            await gateway.aclose()
    assert rebound.status_code == 200 and up.count == 1
    assert "attacker.example" not in {value for _, value in up.received[0].headers}
