"""Safer defaults (SPEC §12): a route without `methods` forwards GET, HEAD, OPTIONS, POST,
PUT, PATCH and DELETE; any other method on its paths (TRACE, CONNECT, a custom one) is a
local 405 `method_not_allowed`, no upstream contacted. A fallback at a loopback or literal
spelling of the primary's address and port is refused as the primary's own origin."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fallback_mw import ConfigError, Gateway, load_config
from fallback_mw.cli import main
from tests.helpers import gateway_client, http_scope
from tests.test_telemetry_leak import call
from tests.upstreams import host_app, status_handler, upstream


def conf(primary: str, backup: str, **route: Any) -> dict[str, Any]:
    return {
        "upstreams": {"primary": {"url": primary}, "backup": {"url": backup}},
        "routes": [
            {"id": "api", "prefix": "/v1/", "plan": ["primary", "backup"], "retries": 1, **route}
        ],
    }


@pytest.mark.anyio
async def test_methods_omitted_forward_the_seven_and_refuse_the_rest() -> None:
    async with (
        upstream(status_handler(200)) as p,
        upstream(status_handler(200)) as b,
        gateway_client(conf(p.url, b.url)) as client,
    ):
        forwarded = [
            (await client.request(m, "/v1/x")).status_code
            for m in ("GET", "HEAD", "OPTIONS", "POST", "PUT", "PATCH", "DELETE")
        ]
        refused = [await client.request(m, "/v1/x") for m in ("TRACE", "CONNECT", "PURGE")]
        host = await client.request("TRACE", "/elsewhere")
    assert forwarded == [200] * 7
    assert p.count == 7 and b.count == 0
    for response in refused:
        assert response.status_code == 405
        error = response.json()["error"]
        assert (error["code"], error["rule"], error["attempts"]) == (
            "method_not_allowed", "methods", 0,
        )  # fmt: skip
        assert "list" in error["message"] and "methods" in error["message"]
        assert response.headers["allow"] == "GET, HEAD, OPTIONS, POST, PUT, PATCH, DELETE"
        assert response.headers["x-gateway-route"] == "api"
    assert host.status_code == 404  # not a routed path: the host app's, as before


@pytest.mark.anyio
async def test_a_listed_method_is_forwarded() -> None:
    async with (
        upstream(status_handler(200)) as p,
        upstream(status_handler(200)) as b,
        gateway_client(conf(p.url, b.url, methods=["GET", "TRACE"])) as client,
    ):
        trace = await client.request("TRACE", "/v1/x")
        post = await client.post("/v1/x")  # explicit methods: the rest is the host's
    assert trace.status_code == 200 and p.count == 1
    assert post.status_code == 404


@pytest.mark.anyio
async def test_a_method_in_another_case_is_another_method_not_forwarded_as_the_seven() -> None:
    """Method tokens are case-sensitive (RFC 9110 §9.1): `get` is not GET. A server that
    hands the token on as sent (uvicorn's h11, hypercorn) had the gateway forward `get` as
    GET (and fail it over as a replayable GET), where `serve` answers it 405: the upstream
    got a request the caller never sent. On a route without `methods` it is a local 405
    saying the case is the difference; on a route that lists POST, `post` is unlisted and
    goes on to the host app, as any unlisted method does."""
    async with upstream(status_handler(200)) as p, upstream(status_handler(200)) as b:
        config = {
            "upstreams": {"primary": {"url": p.url}, "backup": {"url": b.url}},
            "routes": [
                {"id": "api", "prefix": "/v1/", "plan": ["primary", "backup"], "retries": 1},
                {"id": "posts", "prefix": "/p/", "plan": ["primary"], "methods": ["POST"]},
            ],
        }
        gateway = Gateway(host_app, config=config)
        try:
            answers = {
                (method, path): await call(gateway, http_scope(method, path), b"")
                for method in ("get", "Delete", "post")
                for path in ("/v1/x", "/p/x")
            }
            served = await call(gateway, http_scope("POST", "/p/x"), b"")
        finally:
            await gateway.aclose()
    assert served[0] == 200 and p.count == 1 and b.count == 0  # POST itself is forwarded
    for method in ("get", "Delete", "post"):
        status, body = answers[(method, "/v1/x")]
        assert status == 405, (method, status, body)
        error = json.loads(body)["error"]
        assert (error["code"], error["rule"], error["route"]) == (
            "method_not_allowed", "methods", "api",
        )  # fmt: skip
        assert f"{method!r} is not {method.upper()}" in error["message"]
        assert f"send {method.upper()}" in error["message"]
        assert answers[(method, "/p/x")] == (404, b"host app")


@pytest.mark.parametrize(
    ("primary", "fallback"),
    [
        ("http://127.0.0.1:18011", "HTTP://LocalHost:18011/"),
        ("http://localhost:18011", "http://[::1]:18011"),
        ("http://127.0.0.1:18011", "http://[::ffff:127.0.0.1]:18011/"),
        ("http://10.0.0.5:80", "http://[::ffff:a00:5]/"),
    ],
)
def test_a_loopback_or_literal_spelling_of_the_primary_is_refused(
    primary: str, fallback: str
) -> None:
    data = conf(primary, fallback)
    # An IPv4-mapped upstream is allowed by the IPv4 address it carries (an entry spelled
    # `::ffff:0:0/96` is refused at load: it matches nothing).
    data["gateway"] = {"allow_hosts": ["127.0.0.1", "localhost", "::1", "10.0.0.0/8"]}
    with pytest.raises(ConfigError, match="is the primary's own endpoint"):
        load_config(data)


def test_a_different_path_or_port_is_another_upstream() -> None:
    for fallback in ("http://localhost:18012", "http://localhost:18011/other"):
        load_config(conf("http://127.0.0.1:18011", fallback))


def test_routes_add_refuses_a_loopback_spelling_of_the_primary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = f"sqlite:///{tmp_path / 's.db'}"
    status = main(["routes", "add", "--store", store, "--id", "r", "--prefix", "/r/",
                   "--upstream", "http://127.0.0.1:18011", "--retries", "1",
                   "--fallback", "HTTP://LocalHost:18011/"])  # fmt: skip
    assert status == 2
    assert "is the primary's own endpoint" in capsys.readouterr().err
