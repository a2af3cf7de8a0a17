"""Upstream URLs as an attacker or a careless platform team writes them: in the config
file, through the Python API and through the route store (`routes add`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import anyio
import pytest

from fallback_mw import BudgetGuard, CredentialInjector, PlanWalker, RouteResolver
from fallback_mw.config import ConfigError, GatewayConfig, load_config
from fallback_mw.store.routes import make_upstream
from tests.helpers import (
    client_for,
    free_port,
    gateway_client,
    log_text,
    serve_process,
    wait_listening,
)
from tests.test_cli_admin import run_cli
from tests.upstreams import host_app, silent_server, status_handler, upstream


def _conf(upstream: dict[str, Any]) -> dict[str, Any]:
    return {
        "gateway": {"allow_hosts": ["127.0.0.1", "proxy.test"]},
        "upstreams": {"u": upstream},
        "routes": [{"id": "r", "prefix": "/v1/", "plan": ["u"]}],
    }


# The caller's path is appended to the upstream URL: `http://h/?` sent `/v1/chat?x=1` as
# the query of `/`, `http://h/#` dropped path and query; aiohttp failed every request to
# `http://:@h` (an empty Basic credential beside the injected one).
EMPTY_PARTS = [
    "http://127.0.0.1:9000/?",
    "http://127.0.0.1:9000?",
    "http://127.0.0.1:9000/#",
    "http://127.0.0.1:9000/v1?#",
    "http://@127.0.0.1:9000",
    "http://:@127.0.0.1:9000",
    "http://u:@127.0.0.1:9000",
]


@pytest.mark.parametrize("url", EMPTY_PARTS)
def test_an_upstream_url_with_an_empty_userinfo_query_or_fragment_is_refused(url: str) -> None:
    with pytest.raises(ConfigError, match=r"upstreams\.u\.url: .*(credentials|query)"):
        load_config(_conf({"url": url}), environ={})
    with pytest.raises(ConfigError, match=r"credentials|query"):
        make_upstream(url, None, None, "route 'r', --upstream")


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:9000/a/../b",
        "http://127.0.0.1:9000/./v1",
        "http://127.0.0.1:9000/v1/%2E%2e",
    ],
)
def test_an_upstream_url_with_dot_segments_is_refused(url: str) -> None:
    """httpx resolved `/a/../b` to `/b` before sending; aiohttp sent `/a/../b/...` as
    written: one configured URL reached two paths depending on the engine."""
    with pytest.raises(ConfigError, match=r"upstreams\.u\.url: .*'\.' or '\.\.' segment"):
        load_config(_conf({"url": url}), environ={})
    load_config(_conf({"url": "http://127.0.0.1:9000/v1.2/..x/.well-known"}), environ={})


@pytest.mark.parametrize(
    "proxy", ["http://proxy.test:3128?", "http://proxy.test:3128/#", "http://:@proxy.test:3128"]
)
def test_a_proxy_url_with_an_empty_userinfo_query_or_fragment_is_refused(proxy: str) -> None:
    with pytest.raises(ConfigError, match=r"upstreams\.u\.proxy"):
        load_config(_conf({"url": "http://127.0.0.1:9000", "proxy": proxy}), environ={})


PROXY_SECRET = "proxy-pw-never-printed"
PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy")


@pytest.mark.anyio
@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
async def test_proxy_variables_in_the_environment_are_not_followed(
    engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only a configured `proxy` (checked against the allowlist and the metadata guard)
    carries upstream traffic; a proxy from the environment would get none of those checks."""
    async with silent_server() as (proxy_url, accepted), upstream(status_handler(200)) as target:
        for variable in PROXY_VARIABLES:
            monkeypatch.setenv(variable, proxy_url.replace("://", f"://u:{PROXY_SECRET}@"))
        conf = _conf({"url": target.url})
        conf["gateway"]["engine"] = engine
        async with gateway_client(conf, environ={}) as client:
            response = await client.get("/v1/x")
    assert response.status_code == 200, response.text
    assert target.count == 1 and accepted == []


CONFIG = """
[gateway]
allow_hosts = ["127.0.0.1"]

[upstreams.direct]
url = "http://127.0.0.1:9"

[upstreams.proxied]
url = "http://127.0.0.1:8"
proxy = "http://127.0.0.1:3128"

[[routes]]
id = "r"
prefix = "/v1/"
plan = ["direct", "proxied"]
retries = 1
"""


def test_check_warns_that_proxy_variables_are_ignored_naming_never_their_value(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text(CONFIG, encoding="utf-8")
    for variable in PROXY_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    status, out, err = run_cli("check", "--config", str(path))
    assert status == 0 and "proxy variables" not in out, out + err
    monkeypatch.setenv("HTTPS_PROXY", f"http://u:{PROXY_SECRET}@10.0.0.1:3128")
    status, out, err = run_cli("check", "--config", str(path))
    assert status == 0, err
    warnings = [line for line in out.splitlines() if "proxy variables" in line]
    assert warnings == [
        "  warning: HTTPS_PROXY set in the environment, but the gateway does not read proxy "
        "variables: upstreams 'direct' are contacted directly; set `proxy` on an upstream "
        "to send it through an egress proxy"
    ]
    assert PROXY_SECRET not in out + err and "10.0.0.1" not in out + err


@pytest.mark.anyio
async def test_serve_warns_that_proxy_variables_are_ignored(tmp_path: Path) -> None:
    path, log = tmp_path / "gateway.toml", tmp_path / "serve.log"
    path.write_text(CONFIG, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k.upper() not in PROXY_VARIABLES}
    env["http_proxy"] = f"http://u:{PROXY_SECRET}@10.0.0.1:3128"
    port = free_port()
    with serve_process(path, port, log, env=env) as process:
        await wait_listening(process, port, log)
    text = log_text(log)
    assert "warning: http_proxy set in the environment, but the gateway does not read" in text
    assert PROXY_SECRET not in text and "10.0.0.1" not in text


LAYERS = {"resolver": RouteResolver, "guard": BudgetGuard, "injector": CredentialInjector}


@pytest.mark.anyio
@pytest.mark.parametrize("layer", ["resolver", "guard", "injector", "walker"])
async def test_a_layer_given_a_model_built_directly_meets_the_load_time_refusals(
    layer: str,
) -> None:
    """`GatewayConfig.model_validate(...)` handed to a layer used alone was taken as it
    was: a metadata upstream, an unreachable fallback, no refusal at all. Refused as
    `Gateway` refuses a configuration (test_layers_own_outcome.py): nothing is served, every
    request is the 503 `config_error` naming the problem, the host's routes included."""
    model = GatewayConfig.model_validate(
        {
            "gateway": {"allow_hosts": ["0.0.0.0/0"]},
            "upstreams": {"u": {"url": "http://169.254.169.254"}},
            "routes": [{"id": "r", "prefix": "/v1/", "plan": ["u"]}],
        }
    )
    app = (
        PlanWalker(host_app, config=model, environ={})
        if layer == "walker"
        else LAYERS[layer](host_app, config=model)
    )
    async with client_for(app) as client:
        for path in ("/v1/chat", "/elsewhere"):
            response = await client.get(path)
            assert response.status_code == 503
            error = response.json()["error"]
            assert error["code"] == "config_error"
            assert "link-local / metadata" in error["message"]


def test_a_model_loaded_without_the_environment_check_is_taken_as_it_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`load_config(..., check_env=False)` is the caller's choice (a variable set later, or
    rotated away): the layers take that model as it is, without a second look-up, and a
    credential missing at run time is a skipped candidate
    (test_defence_in_depth.py::test_a_backup_without_its_credential_is_skipped_never_sent_bare)."""
    model = load_config(_conf({"url": "http://localhost:9", "auth_env": "FMW_T_UNSET"}),
                        check_env=False)  # fmt: skip
    lookups: list[str] = []
    monkeypatch.setattr("socket.getaddrinfo", lambda *a, **k: lookups.append(a[0]) or [])
    RouteResolver(host_app, config=model)
    walker = PlanWalker(host_app, config=model, environ={})
    CredentialInjector(walker, config=model, environ={})
    assert lookups == []  # validated once: each layer takes it as it is
    anyio.run(walker.aclose)


@pytest.mark.parametrize("key", ["url", "proxy"])
def test_an_upstream_or_proxy_url_with_port_0_is_refused(key: str) -> None:
    """Port 0 was accepted at load: every attempt then failed as a transport error and
    marked the upstream's breaker, for a typo `check` could have named."""
    upstream = {"url": "http://127.0.0.1:9001"}
    upstream[key] = "http://127.0.0.1:0"
    config = {"upstreams": {"a": upstream}, "routes": [{"id": "r", "prefix": "/", "plan": ["a"]}]}
    with pytest.raises(ConfigError, match="port 0"):
        load_config(config, environ={})


@pytest.mark.parametrize("key", ["url", "proxy"])
@pytest.mark.parametrize("host", ["[::1%25lo]", "[::1%lo]"])
def test_an_upstream_or_proxy_url_with_an_ipv6_zone_id_is_refused(key: str, host: str) -> None:
    """`http://[::1%25lo]:8000` (RFC 6874) loaded and `check` called it valid; neither
    engine connects through a zone, so every attempt failed as "could not connect" and
    marked the upstream's breaker. The same address without its zone loads."""
    upstream = {"url": "http://127.0.0.1:9001"}
    upstream[key] = f"http://{host}:9001"
    config = {
        "gateway": {"allow_hosts": ["127.0.0.1", "::1"]},
        "upstreams": {"a": upstream},
        "routes": [{"id": "r", "prefix": "/", "plan": ["a"]}],
    }
    with pytest.raises(ConfigError, match=rf"upstreams\.a\.{key}: has an IPv6 zone id"):
        load_config(config, environ={})
    with pytest.raises(ConfigError, match="IPv6 zone id"):
        make_upstream(f"http://{host}:9001", None, None, "route 'r', --upstream")
    upstream[key] = "http://[::1]:9001"
    load_config(config, environ={})


@pytest.mark.parametrize(
    ("path", "says"),
    [
        ("/openai/deployments/{deployment}", "'{' in its path"),
        ('/v1/"x"', """'"' in its path"""),
        ("/a<b>", "'<' in its path"),
        ("/a`b", "'`' in its path"),
        ("/a%zz", "starts no percent-escape"),
        ("/a%2", "starts no percent-escape"),
        ("/50%", "starts no percent-escape"),
    ],
)
def test_an_upstream_url_path_no_request_target_carries_is_refused(
    path: str, says: str, tmp_path: Path
) -> None:
    """httpx percent-encoded `{`, `"`, `<`, `` ` `` before sending and aiohttp sent them as
    written: `/openai/deployments/{deployment}` (a template left in) reached two paths
    depending on the engine, and a stray `%` went out as an invalid request target on both.
    Refused in the file, by the route store's verbs, naming the key and the repair."""
    url = f"http://127.0.0.1:9000{path}"
    with pytest.raises(ConfigError, match=rf"upstreams\.u\.url: has .*{says}") as caught:
        load_config(_conf({"url": url}), environ={})
    assert "%25" in str(caught.value) or "percent-encode" in str(caught.value)
    with pytest.raises(ConfigError, match=says):
        make_upstream(url, None, None, "route 'r', --upstream")
    store = f"sqlite:///{tmp_path / 'routes.db'}"
    status, _out, err = run_cli(
        *("routes", "add", "--store", store, "--id", "r", "--prefix", "/v1/", "--upstream", url)
    )
    assert status == 2 and err.count("\n") == 1 and says in err, err


@pytest.mark.anyio
@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
async def test_an_upstream_url_path_goes_out_as_written_on_both_engines(engine: str) -> None:
    # What an upstream URL's path may hold (RFC 3986: escapes, sub-delims, ':' and '@')
    # reaches the upstream byte for byte, whichever engine sends it.
    path = "/api%2Fv1/a%41b/x;y=1/u:p@h/!$&'()*+,~|^[]"
    async with upstream(status_handler(200)) as up:
        conf = _conf({"url": up.url + path})
        conf["gateway"]["engine"] = engine
        async with gateway_client(conf) as client:
            response = await client.get("/v1/chat")
        assert response.status_code == 200
        assert up.received[0].path == path + "/v1/chat"
