"""A configuration made from another with pydantic's `model_copy(update=...)` (a frozen
`GatewayConfig` handed to `Gateway`, SPEC §2) is the gateway's configuration as it reads:
an upstream's host, port and credential variables are derived once, when the model is
made, and a copy must not keep the original's."""

from __future__ import annotations

import pytest
from aiohttp import web

from fallback_mw import Gateway
from fallback_mw.config import GatewayConfig, parse_config
from tests.helpers import client_for
from tests.upstreams import host_app, upstream

pytestmark = pytest.mark.anyio

ENV = {"OLD_KEY": "old-secret", "NEW_KEY": "new-secret"}
ROUTES = [{"id": "r", "prefix": "/v1/", "plan": ["a"]}]


async def which_key(request: web.Request) -> web.StreamResponse:
    # Named, not echoed: the gateway masks an echoed credential.
    seen = request.headers.get("authorization", "")
    return web.Response(text={f"Bearer {v}": k for k, v in ENV.items()}.get(seen, "none"))


def with_upstream(config: GatewayConfig, **update: object) -> GatewayConfig:
    copied = config.upstreams["a"].model_copy(update=update)
    return config.model_copy(update={"upstreams": {"a": copied}})


async def test_a_copy_with_another_auth_env_sends_that_variables_key() -> None:
    async with upstream(which_key) as up:
        config = parse_config({"upstreams": {"a": {"url": up.url, "auth_env": "OLD_KEY"}},
                               "routes": ROUTES})  # fmt: skip
        copied = with_upstream(config, auth_env="NEW_KEY")
        gateway = Gateway(host_app, config=copied, environ=ENV)
        try:
            async with client_for(gateway) as client:
                response = await client.post("/v1/chat", json={})
        finally:
            await gateway.aclose()
    assert response.status_code == 200, response.text
    # It sent OLD_KEY's value: the pool's variables as the original had derived them.
    assert response.text == "NEW_KEY"


async def test_a_copy_with_another_url_is_checked_against_allow_hosts() -> None:
    config = parse_config({"gateway": {"allow_hosts": ["127.0.0.1"]},
                           "upstreams": {"a": {"url": "http://127.0.0.1:9"}},
                           "routes": ROUTES})  # fmt: skip
    copied = with_upstream(config, url="http://other.invalid:8080")
    gateway = Gateway(host_app, config=copied, environ={})
    try:
        async with client_for(gateway) as client:
            response = await client.post("/v1/chat", json={})
    finally:
        await gateway.aclose()
    # It was taken: the check read the original's host, and the requests went to the copy's.
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "config_error"
    assert "'other.invalid' is not in allow_hosts" in response.text
