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


def with_route(config: GatewayConfig, **update: object) -> GatewayConfig:
    return config.model_copy(update={"routes": (config.routes[0].model_copy(update=update),)})


def with_settings(config: GatewayConfig, **update: object) -> GatewayConfig:
    return config.model_copy(update={"gateway": config.gateway.model_copy(update=update)})


async def echo_request(request: web.Request) -> web.StreamResponse:
    return web.json_response({"method": request.method, "path": request.raw_path})


async def test_a_copy_is_read_as_the_same_values_written_in_a_file() -> None:
    """pydantic's `model_copy(update=...)` checks nothing it is given: a copy with
    `methods=("post",)` routed no POST (the host app answered it, methods are matched in
    upper case), and one with `url="http://host:port/"` sent every request to `//v1/...`.
    The gateway reads a copy's values as it reads a file's: POST routed, one slash."""
    async with upstream(echo_request) as up:
        config = parse_config({"gateway": {"allow_hosts": ["127.0.0.1"]},
                               "upstreams": {"a": {"url": up.url}},
                               "routes": ROUTES})  # fmt: skip
        copied = with_route(with_upstream(config, url=up.url + "/"), methods=("post",))
        gateway = Gateway(host_app, config=copied, environ={})
        try:
            async with client_for(gateway) as client:
                response = await client.post("/v1/chat", json={})
        finally:
            await gateway.aclose()
    assert response.status_code == 200, response.text
    assert response.headers["x-gateway-route"] == "r"
    assert response.json() == {"method": "POST", "path": "/v1/chat"}


BASE = {"gateway": {"allow_hosts": ["127.0.0.1"]},
        "upstreams": {"a": {"url": "http://127.0.0.1:9"}},
        "routes": ROUTES}  # fmt: skip
COPIES = {
    "a prefix without its slash": (
        lambda c: with_route(c, prefix="v1/"),
        "routes['r'].prefix: must start with '/'",
    ),
    "no plan": (lambda c: with_route(c, plan=()), "routes['r'].plan: must not be empty"),
    "a status as text": (
        lambda c: with_route(c, failover_status=("503",)),
        "routes['r'].failover_status.0: must be an integer",
    ),
    "a deadline of 0 ms": (lambda c: with_settings(c, deadline_ms=0), "gateway.deadline_ms"),
    "an unknown key": (
        lambda c: with_route(c, replayable=True),
        "unknown key \"routes['r'].replayable\"",
    ),
    "an upstream url that is none": (
        lambda c: with_upstream(c, url="ftp://x y"),
        "upstreams.a.url",
    ),
}


@pytest.mark.parametrize("case", list(COPIES))
async def test_a_copy_holding_what_a_file_may_not_is_refused(case: str) -> None:
    """A copy with a value its model refuses loaded all the same (model_copy validates
    nothing): a prefix without its `/` or a status written as text matched nothing, a
    0 ms deadline was taken, an unknown key was kept, and a route of no plan failed
    `Gateway(...)` with a bare IndexError. Each is refused as the same value in a file
    is: the gateway does not serve (503 config_error), naming the key."""
    make, named = COPIES[case]
    copied = make(parse_config(BASE))
    gateway = Gateway(host_app, config=copied, environ={})
    assert gateway.config_error is not None
    assert named in gateway.config_error, gateway.config_error
    async with client_for(gateway) as client:
        response = await client.get("/v1/chat")
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "config_error"


def test_a_configuration_is_hashable_as_it_is_comparable() -> None:
    """A GatewayConfig is frozen, and equal to one loaded from the same values, but
    `hash(config)` raised "unhashable type: 'dict'" (its upstreams, budgets and prices are
    mappings): a platform team's `functools.cache` keyed by configuration, or a set of them,
    failed. Equal configurations hash alike, whatever order their tables were written in."""
    data = {
        "upstreams": {"a": {"url": "http://127.0.0.1:9"}, "b": {"url": "http://127.0.0.1:10"}},
        "routes": [{"id": "r", "prefix": "/v1/", "plan": ["a", "b"], "retries": 1}],
        "budgets": {"x": {"limit": 1}},
        "prices": {"m": {"input_per_mtok": 1, "output_per_mtok": 2}},
    }
    config = parse_config(data)
    reordered = parse_config({**data, "upstreams": dict(reversed(data["upstreams"].items()))})
    assert config == reordered
    assert hash(config) == hash(reordered)
    assert len({config, reordered, with_route(config, retries=0)}) == 2


class TeamConfig(GatewayConfig):
    """A platform team's own configuration type: the gateway's, and fields of its own."""

    team: str = "platform"


async def test_a_configuration_of_a_subclass_is_parsed_again_as_that_class() -> None:
    """A GatewayConfig subclass (a platform team's model adding its own fields) was taken
    as it was until copies were parsed again (a11a147): then every one built directly was
    parsed as GatewayConfig itself, and refused for its own field ("unknown key 'team'"):
    the gateway served nothing (503 config_error). It is parsed again as its own class:
    served, its fields kept, and a copy holding what a file may not is still refused."""
    async with upstream(echo_request) as up:
        config = TeamConfig.model_validate(
            {**BASE, "upstreams": {"a": {"url": up.url}}, "team": "search"}
        )
        gateway = Gateway(host_app, config=config, environ={})
        try:
            assert gateway.config_error is None, gateway.config_error
            assert type(gateway.config) is TeamConfig and gateway.config.team == "search"
            async with client_for(gateway) as client:
                response = await client.post("/v1/chat", json={})
        finally:
            await gateway.aclose()
    assert response.status_code == 200, response.text
    assert response.headers["x-gateway-route"] == "r"
    refused = Gateway(host_app, config=with_route(config, prefix="v1/"), environ={})
    assert refused.config_error is not None
    assert "routes['r'].prefix: must start with '/'" in refused.config_error
