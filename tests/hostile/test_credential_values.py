"""Credential values that cannot be a header value: refused at load naming the variable
(never its value); and an engine given such a header never answers with a bare 500."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from fallback_mw import Gateway
from fallback_mw.config import ConfigError, load_config
from fallback_mw.upstream import Timeouts, UpstreamError, UpstreamRequest, make_client
from tests.helpers import client_for
from tests.test_cli_admin import run_cli
from tests.upstreams import host_app, serve_asgi, status_handler, upstream

SECRET = "sk-live-1f2e3d"


def config(primary: str, backup: str, engine: str = "aiohttp") -> dict[str, Any]:
    return {
        "gateway": {"allow_hosts": ["127.0.0.1"], "engine": engine},
        "upstreams": {
            "primary": {"url": primary, "auth_env": "FMW_T_PRIMARY"},
            "backup": {"url": backup, "auth_env": "FMW_T_BACKUP"},
        },
        "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary", "backup"], "retries": 1}],
    }


@pytest.mark.parametrize(
    "value",
    [SECRET + "\n", SECRET + "\r\n", SECRET[:4] + "\x00" + SECRET[4:], SECRET + "é€", " \t"],
    ids=["trailing-newline", "crlf", "nul", "not-latin-1", "only-whitespace"],
)
def test_a_credential_that_cannot_be_a_header_value_is_refused_at_load(value: str) -> None:
    environ = {"FMW_T_PRIMARY": value, "FMW_T_BACKUP": "fine"}
    with pytest.raises(ConfigError) as caught:
        load_config(config("http://127.0.0.1:1", "http://127.0.0.1:2"), environ=environ)
    message = str(caught.value)
    assert "FMW_T_PRIMARY" in message
    assert SECRET not in message and SECRET[:4] not in message


def test_a_latin_1_credential_still_loads() -> None:
    environ = {"FMW_T_PRIMARY": "key-é", "FMW_T_BACKUP": "x"}
    load_config(config("http://127.0.0.1:1", "http://127.0.0.1:2"), environ=environ)


@pytest.mark.anyio
@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
async def test_a_credential_gone_bad_after_load_fails_over_instead_of_a_500(engine: str) -> None:
    environ = {"FMW_T_PRIMARY": "good", "FMW_T_BACKUP": "fine"}
    async with (
        upstream(status_handler(200, b"primary")) as primary,
        upstream(status_handler(200, b"backup")) as backup,
    ):
        gateway = Gateway(host_app, config=config(primary.url, backup.url, engine), environ=environ)
        environ["FMW_T_PRIMARY"] = "bad\r\nx-injected: 1"  # changed under a running gateway
        try:
            async with serve_asgi(gateway) as base, httpx.AsyncClient(base_url=base) as client:
                response = await client.get("/v1/x")
        finally:
            await gateway.aclose()
    assert response.status_code == 200
    assert response.text == "backup"
    assert primary.count == 0  # nothing (and no injected header) reached the primary


@pytest.mark.anyio
@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
@pytest.mark.parametrize("value", ["a\nb", "a\rb", "a\x00b"])
async def test_the_engines_map_an_invalid_header_value_to_an_upstream_error(
    engine: str, value: str
) -> None:
    client = make_client(engine, allow_hosts=("127.0.0.1",))
    async with upstream(status_handler(200, b"ok")) as target:
        request = UpstreamRequest(
            method="GET",
            url=target.url + "/x",
            headers=[("authorization", value)],
            body=b"",
            timeouts=Timeouts(connect=1, first_byte=2, idle=2),
        )
        try:
            with pytest.raises(UpstreamError):
                response = await client.send(request)
                await response.aclose()
        finally:
            await client.aclose()
    assert target.count == 0


@pytest.mark.anyio
async def test_a_variable_unset_under_a_running_gateway_is_named_as_the_remedy() -> None:
    """The 503 said a 429 had retired the credential and to wait for its reset, when the
    variable had been emptied (by the host app, after load checked it)."""
    environ = {"FMW_T_PRIMARY": SECRET, "FMW_T_BACKUP": SECRET + "-b"}
    async with upstream(status_handler(200)) as primary, upstream(status_handler(200)) as backup:
        gateway = Gateway(host_app, config=config(primary.url, backup.url), environ=environ)
        del environ["FMW_T_PRIMARY"]
        environ["FMW_T_BACKUP"] = ""
        try:
            async with client_for(gateway) as client:
                response = await client.get("/v1/x")
        finally:
            await gateway.aclose()
    assert primary.count == backup.count == 0
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["code"] == "route_exhausted"
    assert (
        "set the auth_env variable of 'primary', 'backup' in the gateway's environment"
        in (error["message"])
    )
    assert "429" not in error["message"] and SECRET not in response.text


# Credentials that are also well-formed variable names, written in auth_env by mistake.
TOKEN_NAMES = [
    "sk_live_51HqLyjWDarjtT1zdp7dcXYZabc",
    "ghp_16C7e42F292c6912E7710c838347Ae178B4a",
    "hf_AbCdEfGhIjKlMnOpQrStUvWxYz01234567",
    "aB3dE5gH7jK9mN1pQ3sT5vW7",
]


@pytest.mark.anyio
@pytest.mark.parametrize("token", TOKEN_NAMES)
async def test_a_credential_written_as_the_variable_name_is_never_printed(token: str) -> None:
    """`auth_env = "sk_live_..."`: "environment variable sk_live_... is not set" went to the
    terminal, the log, and every caller's 503 config_error body."""
    conf = config("http://127.0.0.1:1", "http://127.0.0.1:2")
    conf["upstreams"]["primary"]["auth_env"] = token
    environ = {"FMW_T_BACKUP": "fine"}
    with pytest.raises(ConfigError) as caught:
        load_config(conf, environ=environ)
    message = str(caught.value)
    assert token not in message and token[4:12] not in message
    assert "shaped like a credential" in message and "is not set" in message
    gateway = Gateway(host_app, config=conf, environ=environ)
    try:
        async with client_for(gateway) as client:
            response = await client.get("/v1/x")
    finally:
        await gateway.aclose()
    assert response.status_code == 503 and token[4:12] not in response.text


@pytest.mark.parametrize("token", TOKEN_NAMES[:2])
def test_the_route_store_never_lists_a_credential_written_as_the_variable_name(
    token: str, tmp_path: Path
) -> None:
    store = f"sqlite:///{tmp_path / 'routes.db'}"
    added = (
        *("routes", "add", "--store", store, "--id", "chat", "--prefix", "/v1/"),
        *("--upstream", "http://127.0.0.1:9", "--auth-env", token),
    )
    status, out, err = run_cli(*added)
    assert status == 0, err
    status, out, err = run_cli("routes", "list", "--store", store)
    assert status == 0 and "shaped like a credential" in out
    assert token[4:12] not in out + err


@pytest.mark.parametrize("name", ["OPENAI_API_KEY", "openai_api_key", "AZURE_KEY_2024_EU_WEST_1"])
def test_an_ordinary_variable_name_is_still_named(name: str) -> None:
    conf = config("http://127.0.0.1:1", "http://127.0.0.1:2")
    conf["upstreams"]["primary"]["auth_env"] = name
    with pytest.raises(ConfigError, match=f"environment variable {name} is not set"):
        load_config(conf, environ={"FMW_T_BACKUP": "fine"})


@pytest.mark.parametrize("size", [8193, 120_000, 1 << 20])
def test_a_credential_longer_than_any_server_takes_in_a_header_is_refused_at_load(
    size: int,
) -> None:
    """A variable holding far more than a key (a whole secrets file or certificate chain
    exported into it, 120 KB, or 1 MB set by a host app): `check` said the configuration was
    valid, and every request reached the upstream with a header no server takes (nginx,
    aiohttp, Apache: 8 KiB a field), answered 400, in aiohttp's case with the header's first
    hundred characters (`Bearer sk-...`) in the body relayed to the caller."""
    value = "sk-" + "k" * (size - 3)
    environ = {"FMW_T_PRIMARY": value, "FMW_T_BACKUP": "fine"}
    with pytest.raises(ConfigError) as caught:
        load_config(config("http://127.0.0.1:1", "http://127.0.0.1:2"), environ=environ)
    message = str(caught.value)
    assert "FMW_T_PRIMARY" in message and f"{size} bytes" in message
    assert "sk-kkkk" not in message and len(message) < 400


def test_a_long_credential_a_server_still_takes_loads() -> None:
    """A large bearer token (an Azure AD access token with many claims runs to a few KB)."""
    environ = {"FMW_T_PRIMARY": "eyJ" + "a" * 8000, "FMW_T_BACKUP": "x"}
    load_config(config("http://127.0.0.1:1", "http://127.0.0.1:2"), environ=environ)
