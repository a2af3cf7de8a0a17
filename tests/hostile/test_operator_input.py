"""Operator input cannot smuggle (SPEC §12): identity headers that name a stripped header,
ids outside letters, digits and `-_.:`, legacy IPv4 spellings and oversized files are
refused at load (and the ids in the route store, through the admin CLI); the extra
credential headers and query keys (`strip_headers`, `strip_query_keys`) never reach any
upstream, the shadow included."""

from __future__ import annotations

import asyncio
import io
import json
import time
from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI

from fallback_mw import Gateway
from fallback_mw.cli import main
from fallback_mw.config import ConfigError, load_config
from fallback_mw.security.fields import DEFAULT_STRIP_HEADERS
from fallback_mw.security.queries import (
    DEFAULT_STRIP_QUERY_KEYS,
    canonical_query_key,
    strip_query_keys,
)
from fallback_mw.store.model import StoredRoute
from tests.helpers import client_for, sqlite_db
from tests.upstreams import host_app, status_handler, upstream


def base(**gateway: Any) -> dict[str, Any]:
    return {
        "gateway": {"allow_hosts": ["127.0.0.1"], **gateway},
        "upstreams": {"primary": {"url": "http://127.0.0.1:9001", "auth_header": "x-custom-auth"}},
        "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"]}],
    }


def refused(data: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config(data, check_env=False)
    return str(caught.value)


@pytest.mark.parametrize(
    ("key", "name"),
    [
        ("tenant_header", "authorization"),
        ("tenant_header", "Authorization"),
        ("session_header", "x-api-key"),
        ("session_header", "X_Api_Key"),
        ("tenant_header", "cookie"),
        ("tenant_header", "x-custom-auth"),  # an upstream's own auth header
        ("tenant_header", "x-auth-token"),  # a default of strip_headers
        ("session_header", "connection"),
        ("session_header", "content-length"),
        ("tenant_header", "x-gateway-route"),
    ],
)
def test_an_identity_header_that_names_a_stripped_header_is_refused(key: str, name: str) -> None:
    message = refused(base(**{key: name}))
    assert key in message and "strips" in message


def test_a_header_removed_from_strip_headers_may_carry_the_tenant() -> None:
    load_config(base(tenant_header="x-auth-token", strip_headers=[]), check_env=False)


@pytest.mark.parametrize("key", ["tenant_header", "session_header"])
def test_an_identity_header_that_names_a_forwarding_header_says_how_to_keep_it(key: str) -> None:
    # A session by client address (x-real-ip, set by nginx in front) loaded until the
    # forwarding headers joined strip_headers' defaults; then it was refused as "a credential
    # or a connection field", which it is not, with no word of how to keep it.
    message = refused(base(**{key: "x-real-ip"}))
    assert key in message and "forwarding header" in message
    assert "credential" not in message
    assert "list strip_headers without it" in message
    kept = [name for name in DEFAULT_STRIP_HEADERS if name != "x-real-ip"]
    load_config(base(**{key: "x-real-ip"}, strip_headers=kept), check_env=False)


BAD_IDS = ["chat\r\nx-injected: 1", "a\x1b[31mred", "two words", "caf\u00e9", "", "a" * 129]


@pytest.mark.parametrize("bad", BAD_IDS)
def test_route_and_upstream_ids_outside_the_safe_charset_are_refused(bad: str) -> None:
    data = base()
    data["routes"][0]["id"] = bad
    message = refused(data)
    assert "id" in message
    assert not any(c in message for c in "\r\n\x1b")  # shown escaped, never raw
    data = base()
    data["upstreams"] = {bad: data["upstreams"]["primary"]}
    data["routes"][0]["plan"] = [bad]
    message = refused(data)
    assert "upstream id" in message
    assert not any(c in message for c in "\r\n\x1b")


def test_an_id_with_a_letter_outside_ascii_is_refused_saying_ascii() -> None:
    """`café` is made of letters, but an id travels in `x-gateway-route` /
    `x-gateway-provider`, which are ASCII: the refusal said "use letters, digits and -_.:",
    which `café` already does, leaving the operator to guess which character was wrong."""
    data = base()
    data["routes"][0]["id"] = "caf\u00e9"
    message = refused(data)
    assert "ASCII letters" in message and "'\u00e9'" in message


def test_safe_ids_load() -> None:
    data = base()
    data["routes"][0]["id"] = "Chat.v1:eu-west_2"
    load_config(data, check_env=False)


def test_the_route_store_refuses_an_unsafe_id(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'gateway.db'}"
    out, err = io.StringIO(), io.StringIO()
    status = main(
        ["routes", "add", "--store", store, "--id", "chat\x1b[2J", "--prefix", "/a/",
         "--upstream", "http://127.0.0.1:1"],
        stdout=out, stderr=err,
    )  # fmt: skip
    assert status == 2
    assert "is not allowed" in err.getvalue() and "\x1b" not in err.getvalue()
    assert "route id" in err.getvalue()  # the id given, not the upstream name derived from it
    out = io.StringIO()
    assert main(["routes", "list", "--store", store], stdout=out, stderr=io.StringIO()) == 0
    assert out.getvalue() == "no routes\n"


def test_faults_list_never_writes_a_stored_rows_terminal_controls(tmp_path: Path) -> None:
    """`faults set` refuses such names, but a fault row written by hand (or by an older
    version) with an escape sequence, a tab or a newline in its kind, target or candidate
    was printed raw by `faults list` (and `faults clear`'s still-active warning): the
    operator's terminal cleared, a forged line. Now such a row is named escaped, on one line."""
    path = tmp_path / "gateway.db"
    store = f"sqlite:///{path}"
    set_ = ["faults", "set", "fail", "--store", store, "--upstream", "primary", "--ttl", "600"]
    assert main(set_, stdout=io.StringIO(), stderr=io.StringIO()) == 0
    with sqlite_db(path) as db:
        db.execute(
            "UPDATE fmw_faults SET target = ?, kind = ?, candidate = ?",
            ("pri\x1b[2Jmary\nFAKE", "fa\x1b[31mil", "b\tx"),
        )
    # Such a row is no fault `faults set` writes: no gateway applies it, and the list
    # names it (escaped) with the command that removes it, never its raw bytes.
    out, err = io.StringIO(), io.StringIO()
    assert main(["faults", "list", "--store", store], stdout=out, stderr=err) == 0
    assert out.getvalue() == "no faults\n"
    warning = err.getvalue()
    assert "'fa\\x1b[31mil' on 'pri\\x1b[2Jmary\\nFAKE'" in warning
    assert "faults clear --all" in warning
    assert warning.count("\n") == 1 and not any(c in warning for c in "\x1b\t")
    err = io.StringIO()
    clear = ["faults", "clear", "--store", store, "--upstream", "other"]
    assert main(clear, stdout=io.StringIO(), stderr=err) == 0
    assert not any(c in err.getvalue() for c in "\x1b\t")


@pytest.mark.parametrize(
    "bad", ["acme\nERROR fallback_mw.request forged", "a\x1b[2J", "", "b" * 201]
)
def test_a_budget_id_the_cli_refuses_is_refused_in_the_file_and_in_a_store_record(
    bad: str,
) -> None:
    # `budgets set --budget` takes 1..200 printable characters; the file and a stored
    # route took anything, and a line break in a route's budget reached the log line the
    # guard writes for an unknown budget as a forged line of its own.
    data = base(store="sqlite:///gateway.db")
    data["routes"][0]["budget"] = bad
    assert "budget id" in refused(data) and "routes['chat'].budget" in refused(data)
    data = base()
    data["budgets"] = {bad: {"limit": 1}}
    assert "budget id" in refused(data)
    doc = json.dumps(
        {"route": {"id": "evil", "prefix": "/e/", "plan": ["evil-p"], "budget": bad},
         "upstreams": {"evil-p": {"url": "http://127.0.0.1:1"}}}
    )  # fmt: skip
    with pytest.raises(ConfigError) as caught:
        StoredRoute.from_doc("evil", doc)
    message = str(caught.value)
    assert "budget id" in message and "routes remove --id evil" in message
    assert "\n" not in message and "\x1b" not in message


def test_printable_budget_ids_load() -> None:
    data = base()
    data["budgets"] = {"team a/ü": {"limit": 1}}
    data["routes"][0]["budget"] = "team a/ü"
    assert load_config(data, check_env=False).routes[0].budget == "team a/ü"


@pytest.mark.parametrize("expires_at", [1e12, 1e300, float("inf")])
def test_faults_list_reads_a_stored_expiry_past_any_calendar(
    tmp_path: Path, expires_at: float
) -> None:
    """A fault row written by hand (or by another tool) to last "for ever" (an expiry of
    1e12, past the year 9999, or 1e300) made `faults list` and `faults clear`'s still-active
    warning end in "unexpected internal error (ValueError / OverflowError)". Such a row is
    no fault `faults set` writes: no gateway applies it, and the list names it with the
    command that removes it; neither verb fails on it."""
    path = tmp_path / "gateway.db"
    store = f"sqlite:///{path}"
    set_ = ["faults", "set", "fail", "--store", store, "--upstream", "primary", "--ttl", "600"]
    assert main(set_, stdout=io.StringIO(), stderr=io.StringIO()) == 0
    with sqlite_db(path) as db:
        db.execute("UPDATE fmw_faults SET expires_at = ?", (expires_at,))
    out, err = io.StringIO(), io.StringIO()
    assert main(["faults", "list", "--store", store], stdout=out, stderr=err) == 0, err.getvalue()
    assert out.getvalue() == "no faults\n"
    assert "'fail' on 'primary'" in err.getvalue(), err.getvalue()
    assert "faults clear --all" in err.getvalue()
    err = io.StringIO()
    clear = ["faults", "clear", "--store", store, "--upstream", "other"]
    assert main(clear, stdout=io.StringIO(), stderr=err) == 0, err.getvalue()
    assert "internal error" not in err.getvalue()


@pytest.mark.parametrize(
    "host", ["0177.0.0.1", "2130706433", "127.1", "0x7f.0.0.1", "0x7f000001", "017700000001"]
)
def test_legacy_ipv4_spellings_are_refused_at_load(host: str) -> None:
    data = base()
    data["upstreams"]["primary"]["url"] = f"http://{host}:9001"
    message = refused(data)
    assert "legacy form" in message and "upstream 'primary'" in message


def test_an_oversized_configuration_file_is_refused_quickly(tmp_path: Path) -> None:
    big = tmp_path / "big.toml"
    with big.open("wb") as file:
        file.truncate(4 * 1024 * 1024 + 1)  # sparse: nothing written
    started = time.monotonic()
    with pytest.raises(ConfigError) as caught:
        load_config(big)
    assert "4 MiB" in str(caught.value)
    # A device that never ends is not even opened.
    with pytest.raises(ConfigError) as caught:
        load_config("/dev/zero")
    assert time.monotonic() - started < 5
    assert "is not a regular file" in str(caught.value)


CALLER_SECRETS = {
    "x-auth-token": "caller-secret-1",
    "anthropic-api-key": "caller-secret-2",
    "ocp-apim-subscription-key": "caller-secret-3",
    "x-amz-security-token": "caller-secret-4",
    "X_Auth_Token": "caller-secret-5",
    "apikey": "caller-secret-10",  # Kong / Supabase, as `?apikey=` (a default query key)
}


@pytest.mark.parametrize("entry", ["x-secret:", "a\x00b", '"x-secret"', "x/secret"])
def test_a_strip_headers_entry_that_is_no_header_name_is_refused(entry: str) -> None:
    # `strip_headers = ["x-secret:"]` loaded and matched no header: the caller's
    # x-secret reached every upstream while the configuration said it was removed.
    message = refused(base(strip_headers=["x-auth-token", entry]))
    assert "gateway.strip_headers" in message and "is not an HTTP header name" in message
    assert load_config(base(strip_headers=["X-Secret", "x_secret"]), check_env=False)


@pytest.mark.anyio
async def test_extra_credentials_reach_no_upstream_shadow_included() -> None:
    async with (
        upstream(status_handler(200, b"primary")) as primary,
        upstream(status_handler(200, b"shadow")) as shadow,
    ):
        conf = {
            "gateway": {"allow_hosts": ["127.0.0.1"]},
            "upstreams": {"primary": {"url": primary.url}, "copy": {"url": shadow.url}},
            "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"],
                        "shadow": "copy", "shadow_percent": 100}],
        }  # fmt: skip
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                response = await client.get(
                    "/v1/x?keep=1&api_key=caller-secret-6&KEY=caller-secret-7&a%70i_key=s8&z=2"
                    "&private_token=caller-secret-9",
                    headers={**CALLER_SECRETS, "x-session-id": "s1", "x-kept": "yes"},
                )
            for _ in range(500):
                if shadow.count == 1 and not gateway.services.shadows.in_flight:
                    break
                await asyncio.sleep(0.01)
        finally:
            await gateway.aclose()
    assert response.status_code == 200
    for server in (primary, shadow):
        (received,) = server.received
        assert received.query == "keep=1&z=2"
        names = {name for name, _ in received.headers}
        assert "x-kept" in names
        assert not any("caller-secret" in value for _, value in received.headers)
        assert not names & {n.lower().replace("_", "-") for n in CALLER_SECRETS}


@pytest.mark.parametrize(
    ("query", "forwarded"),
    [
        (b"keep=1&api.key=s1&z=2", b"keep=1&z=2"),  # PHP reads api.key as api_key
        (b"keep=1&api+key=s1", b"keep=1"),  # ... and api key
        (b"api_key[]=s1&keep=1", b"keep=1"),  # PHP and Rails read api_key[] as api_key
        (b"KEY[0]=s1&keep=1", b"keep=1"),
        (b"a=1;key=s1;b=2&c=3", b"a=1;b=2&c=3"),  # `;` separates parameters too
        (b"key=s1;api_key=s2", b""),
        (b"keep=a;b&x=%2F&&y", b"keep=a;b&x=%2F&&y"),  # nothing to strip: byte for byte
        (b"monkey=1&keys=2&key_id=3&[key]=4", b"monkey=1&keys=2&key_id=3&[key]=4"),
        # PHP skips leading spaces, reads a name up to a NUL and an unclosed `[` as `_`
        (b"%20api_key=s1&keep=1", b"keep=1"),
        (b"+key=s1&keep=1", b"keep=1"),
        (b"api_key%00x=s1&keep=1", b"keep=1"),
        (b"api[key=s1&keep=1", b"keep=1"),
        (b"access[token=s1;keep=1", b"keep=1"),
    ],
)
def test_credential_query_keys_are_stripped_however_a_server_reads_them(
    query: bytes, forwarded: bytes
) -> None:
    keys = frozenset(canonical_query_key(k.encode()) for k in DEFAULT_STRIP_QUERY_KEYS)
    assert strip_query_keys(query, keys) == forwarded


@pytest.mark.anyio
async def test_a_stripped_headers_query_spelling_reaches_no_upstream() -> None:
    """`Ocp-Apim-Subscription-Key` and `X-Amz-Security-Token` were stripped as headers, but
    Azure API Management reads the same key from `?subscription-key=` and a presigned AWS
    request carries its session token as `?X-Amz-Security-Token=`: those went through."""
    async with upstream(status_handler(200, b"{}", **{"content-type": "application/json"})) as up:
        conf = {
            "gateway": {"allow_hosts": ["127.0.0.1"]},
            "upstreams": {"primary": {"url": up.url}},
            "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"]}],
        }
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as http:
                response = await http.get(
                    "/v1/models?keep=1&subscription-key=caller-secret-1"
                    "&X-Amz-Security-Token=caller-secret-2&Subscription%2DKey=caller-secret-3"
                )
        finally:
            await gateway.aclose()
    assert response.status_code == 200
    (received,) = up.received
    assert received.query == "keep=1"


@pytest.mark.anyio
async def test_a_url_in_a_request_header_loses_the_credential_query_keys_too() -> None:
    """The `?api_key=` stripped from the query went on in a copy of the URL: a proxy in
    front copies the request target into a field (Envoy's `x-envoy-original-path` after a
    prefix rewrite, nginx's `X-Original-URI`), a browser sends its page's URL as `Referer`.
    The other parameters, and fields that are no URL, are forwarded byte for byte."""
    async with upstream(status_handler(200, b"{}", **{"content-type": "application/json"})) as up:
        conf = {
            "gateway": {"allow_hosts": ["127.0.0.1"]},
            "upstreams": {"primary": {"url": up.url}},
            "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"]}],
        }
        gateway = Gateway(host_app, config=conf)
        sent = {
            "x-envoy-original-path": "/llm/v1/models?keep=1&api_key=caller-secret-1;z=2",
            "X-Original-URI": "/llm/v1/models?API%5FKEY=caller-secret-2",
            "Referer": "https://app.example/chat?access_token=caller-secret-3&tab=2#top",
            "x-question": "what?key=kept-as-no-url",
            # A scheme in capitals is a URL to every parser (RFC 3986 §3.1).
            "Origin-Page": "HTTPS://app.example/?Key=caller-secret-5",
        }
        try:
            async with client_for(gateway) as http:
                response = await http.get("/v1/models?keep=1&key=caller-secret-4", headers=sent)
        finally:
            await gateway.aclose()
    assert response.status_code == 200
    (received,) = up.received
    assert received.query == "keep=1"
    got = {name.lower(): value for name, value in received.headers}
    assert got["x-envoy-original-path"] == "/llm/v1/models?keep=1&z=2"
    assert got["x-original-uri"] == "/llm/v1/models"
    assert got["referer"] == "https://app.example/chat?tab=2#top"
    assert got["x-question"] == "what?key=kept-as-no-url"
    assert got["origin-page"] == "HTTPS://app.example/"
    assert not any("caller-secret" in value for _, value in received.headers)


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ("10.0.0.0/33", "not a CIDR network"),
        ("https://api.openai.com", "without scheme"),
        ("api.openai.com:443", "without a port"),
        ("*.openai.com", "no wildcards"),
        ("0177.0.0.1", "legacy spelling"),
        ("not a host!", "not a host name"),
        ("exämple.com", "not a host name"),
    ],
)
def test_a_malformed_allow_hosts_entry_is_refused_by_name(entry: str, says: str) -> None:
    """Kept as a name, such an entry would match nothing, and the error would come later
    naming the upstream ("not in allow_hosts") instead of the entry."""
    message = refused(base(allow_hosts=["127.0.0.1", entry]))
    assert "gateway.allow_hosts" in message and says in message and repr(entry) in message


@pytest.mark.parametrize(
    "entry",
    ["api.openai.com", "LOCALHOST.", "[::1]", "::1/128", "10.0.0.0/8", "0.0.0.0/0", "my_host"],
)
def test_well_formed_allow_hosts_entries_load(entry: str) -> None:
    config = load_config(base(allow_hosts=["127.0.0.1", entry]), check_env=False)
    assert entry in config.gateway.allow_hosts


@pytest.mark.anyio
async def test_a_caller_cannot_choose_whose_account_the_gateways_credential_bills() -> None:
    """The openai SDK sends `OpenAI-Organization` / `OpenAI-Project` when a caller sets
    `organization=` / `project=`: OpenAI bills the request to them when the key belongs to
    several, so with the gateway's key injected the caller chose which of the platform's
    organizations paid. Google's `x-goog-user-project` names the project billed likewise."""
    async with upstream(status_handler(200, b"{}", **{"content-type": "application/json"})) as up:
        conf = {
            "gateway": {"allow_hosts": ["127.0.0.1"]},
            "upstreams": {"primary": {"url": up.url, "auth_env": "FMW_T_KEY"}},
            "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"]}],
        }
        gateway = Gateway(host_app, config=conf, environ={"FMW_T_KEY": "gateway-key-1234"})
        try:
            async with client_for(gateway) as http:
                sdk = AsyncOpenAI(
                    base_url="http://gw/v1", api_key="caller-key", organization="org-victim",
                    project="proj-victim", http_client=http, max_retries=0,
                )  # fmt: skip
                await sdk.models.list(extra_headers={"X-Goog-User-Project": "victim-project"})
        finally:
            await gateway.aclose()
    (received,) = up.received
    names = {name for name, _ in received.headers}
    assert "openai-organization" not in names and "openai-project" not in names
    assert "x-goog-user-project" not in names
    assert not any("victim" in value for _, value in received.headers)
    assert ("authorization", "Bearer gateway-key-1234") in received.headers


# What an authenticating proxy in front of the gateway adds: the end user's own tokens.
PROXY_TOKENS = {
    "X-Forwarded-Access-Token": "ya29.user-token-1",  # oauth2-proxy --pass-access-token
    "X-Auth-Request-Access-Token": "user-token-2",  # oauth2-proxy --set-xauthrequest
    "X-Forwarded-Authorization": "Bearer user-token-3",  # Google API Gateway / ESPv2
    "x-amzn-oidc-accesstoken": "user-token-4",  # AWS ALB authenticate-oidc
    "x-amzn-oidc-data": "user-jwt-5",
    "X-MS-TOKEN-AAD-ACCESS-TOKEN": "user-token-6",  # Azure App Service authentication
    "X-MS-TOKEN-AAD-ID-TOKEN": "user-jwt-7",
    "X-MS-TOKEN-AAD-REFRESH-TOKEN": "user-token-8",
    "Cf-Access-Jwt-Assertion": "user-jwt-9",  # Cloudflare Access
    "CF-Access-Client-Secret": "user-token-10",
    "x-goog-iap-jwt-assertion": "user-jwt-11",  # Google IAP
    "X-Pomerium-Jwt-Assertion": "user-jwt-12",  # Pomerium
    "X-Access-Token": "user-token-13",  # Kong's OIDC plugin
    "X_ID_Token": "user-jwt-14",
}
# A page's anti-CSRF token (Django, Rails / Laravel, Angular / axios), sent beside the
# session cookie the gateway strips: with it, the host app's CSRF check can be passed.
CSRF_TOKENS = {
    "X-CSRFToken": "user-token-15",
    "X-CSRF-Token": "user-token-16",
    "X-XSRF-TOKEN": "user-token-17",
}


@pytest.mark.anyio
async def test_the_users_tokens_an_auth_proxy_in_front_adds_reach_no_upstream() -> None:
    """Behind oauth2-proxy, an ALB or App Service authentication, Cloudflare Access, IAP or
    Pomerium, every request carries the end user's own identity-provider token (a refresh
    token, with Azure) in a header of the proxy's: they reached the LLM provider with the
    gateway's key, the shadow too. The names the proxy gives the user are kept (a tenant
    may be read from one)."""
    async with (
        upstream(status_handler(200, b"{}", **{"content-type": "application/json"})) as up,
        upstream(status_handler(200, b"{}")) as copy,
    ):
        conf = {
            "gateway": {"allow_hosts": ["127.0.0.1"], "tenant_header": "x-amzn-oidc-identity"},
            "upstreams": {"primary": {"url": up.url, "auth_env": "FMW_T_KEY"},
                          "copy": {"url": copy.url}},
            "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"],
                        "shadow": "copy", "shadow_percent": 100}],
        }  # fmt: skip
        gateway = Gateway(host_app, config=conf, environ={"FMW_T_KEY": "gateway-key-1234"})
        try:
            async with client_for(gateway) as http:
                response = await http.get(
                    "/v1/models",
                    headers={**PROXY_TOKENS, "x-amzn-oidc-identity": "user-1",
                             "X-Forwarded-Email": "u@example.com", "x-session-id": "s1"},
                )  # fmt: skip
            for _ in range(500):
                if copy.count == 1 and not gateway.services.shadows.in_flight:
                    break
                await asyncio.sleep(0.01)
        finally:
            await gateway.aclose()
    assert response.status_code == 200
    for server in (up, copy):
        (received,) = server.received
        assert not any("user-token" in v or "user-jwt" in v for _, v in received.headers)
        names = {name.lower() for name, _ in received.headers}
        assert {"x-amzn-oidc-identity", "x-forwarded-email"} <= names
    assert ("authorization", "Bearer gateway-key-1234") in up.received[0].headers


@pytest.mark.anyio
async def test_a_pages_anti_csrf_token_reaches_no_upstream() -> None:
    """A browser page calling the gateway on its own origin sends its CSRF token (axios and
    Angular do by themselves): it reached the LLM provider, which could then pass the host
    app's CSRF check from that user's browser."""
    async with upstream(status_handler(200, b"{}", **{"content-type": "application/json"})) as up:
        conf = {
            "gateway": {"allow_hosts": ["127.0.0.1"]},
            "upstreams": {"primary": {"url": up.url}},
            "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"]}],
        }
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as http:
                response = await http.get("/v1/models", headers={**CSRF_TOKENS, "x-kept": "1"})
        finally:
            await gateway.aclose()
    assert response.status_code == 200
    (received,) = up.received
    assert not any("user-token" in value for _, value in received.headers)
    assert ("x-kept", "1") in received.headers


SPOOFED = {
    "Forwarded": "for=203.0.113.9;proto=https;host=admin.internal",
    "X-Forwarded-For": "203.0.113.9",
    "X-Forwarded-Host": "admin.internal",
    "X-Forwarded-Proto": "https",
    "X-Forwarded-Port": "443",
    "X-Forwarded-Prefix": "/admin",
    "X-Real-IP": "203.0.113.9",
    "X-Client-IP": "203.0.113.9",
    "True-Client-IP": "203.0.113.9",
    "CF-Connecting-IP": "203.0.113.9",
}


@pytest.mark.anyio
@pytest.mark.parametrize("kept", [False, True], ids=["default", "strip_headers-without-them"])
async def test_a_caller_cannot_tell_an_upstream_its_address_host_or_scheme(kept: bool) -> None:
    """An upstream that trusts the gateway as its proxy (nginx `real_ip`, uvicorn
    `--forwarded-allow-ips`) read the caller's own `X-Forwarded-For` / `Forwarded` /
    `X-Real-IP` as the client's address: a caller chose the address the upstream's rate
    limits and allowlists saw. They are in `strip_headers`' defaults now; an operator whose
    upstream wants them lists `strip_headers` without them."""
    async with upstream(status_handler(200, b"{}", **{"content-type": "application/json"})) as up:
        gateway_conf: dict[str, Any] = {"allow_hosts": ["127.0.0.1"]}
        if kept:
            gateway_conf["strip_headers"] = ["x-auth-token"]
        conf = {
            "gateway": gateway_conf,
            "upstreams": {"primary": {"url": up.url}},
            "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"]}],
        }
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as http:
                response = await http.get("/v1/models", headers={**SPOOFED, "X-Request-Id": "r-1"})
        finally:
            await gateway.aclose()
    assert response.status_code == 200
    (received,) = up.received
    names = {name.lower() for name, _ in received.headers}
    assert "x-request-id" in names  # other headers pass as before
    spoofed = {name.lower() for name in SPOOFED}
    assert spoofed <= names if kept else not spoofed & names


@pytest.mark.parametrize(
    ("data", "says"),
    [
        ({"prices": {"gpt\n4o": {}}}, "prices.'gpt\\n4o'.input_per_mtok: required key missing"),
        (
            {"upstreams": {"a\x1b[2J": {"url": 5}}},
            "upstreams.'a\\x1b[2J'.url: must be a string",
        ),
        ({"budgets": {"team.a": {"limit": -1}}}, "budgets.'team.a'.limit: must be at least 0"),
    ],
)
def test_an_error_naming_a_quoted_key_is_one_line_that_says_which_key(
    data: dict[str, Any], says: str
) -> None:
    # `[prices."gpt\n4o"]` (a quoted TOML key) was named raw: the one-line message broke
    # in two, an escape sequence reached the terminal, and a dot in a key read as a path.
    message = refused(data)
    assert says in message
    assert message.isprintable(), message


@pytest.mark.parametrize("model", ["", "gpt\x1b[2J\nFORGED", "gpt-4o\t", "m" * 201])
def test_an_upstream_model_that_is_no_model_name_is_refused_in_the_file_and_the_store(
    model: str,
) -> None:
    # `model = "gpt\u001b[2J\nFORGED"` loaded: `check` printed the escape and the forged
    # line raw, and the name went to usage records and spans; `model = ""` asked every
    # provider for no model.
    data = base()
    data["upstreams"]["primary"]["model"] = model
    message = refused(data)
    assert "upstreams.primary.model: must be a model name" in message and "\x1b" not in message
    doc = json.dumps(
        {"route": {"id": "evil", "prefix": "/e/", "plan": ["evil-p"]},
         "upstreams": {"evil-p": {"url": "http://127.0.0.1:1", "model": model}}}
    )  # fmt: skip
    with pytest.raises(ConfigError, match="must be a model name"):
        StoredRoute.from_doc("evil", doc)
    data["upstreams"]["primary"]["model"] = "anthropic.claude-3-5-sonnet-20240620-v1:0"
    load_config(data, check_env=False)


@pytest.mark.parametrize(
    "text",
    [
        "a = " + "[" * 50_000 + "]" * 50_000 + "\n",
        "[gateway]\nbreaker = " + "{window = " * 5_000 + "1" + "}" * 5_000 + "\n",
    ],
)
def test_a_file_nested_thousands_deep_is_a_config_error(tmp_path: Path, text: str) -> None:
    # tomllib recursed past Python's limit: `check` said "unexpected internal error
    # (RecursionError)" and load_config raised RecursionError, not a ConfigError.
    path = tmp_path / "deep.toml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError, match="nests arrays or inline tables too deeply"):
        load_config(path, check_env=False)
    err = io.StringIO()
    assert main(["check", "--config", str(path)], stdout=io.StringIO(), stderr=err) == 2
    assert "too deeply" in err.getvalue() and "internal error" not in err.getvalue()


def test_a_path_argument_is_echoed_without_its_terminal_controls(tmp_path: Path) -> None:
    """`check --config` of a valid file and `eval --out` echoed the path they were given
    raw on stdout ("configuration ... is valid", "wrote ... and ..."): a path holding an
    escape sequence or a BEL drove the operator's terminal or forged a line. Each
    character a terminal would act on is shown as `?`, as in every error line."""
    odd = tmp_path / "gw\x1b[2J\x07FAKE.toml"
    odd.write_text("", encoding="utf-8")
    out = io.StringIO()
    assert main(["check", "--config", str(odd)], stdout=out, stderr=io.StringIO()) == 0
    said = f"configuration {tmp_path}/gw?[2J?FAKE.toml is valid: 0 route(s)"
    assert said in out.getvalue() and "\x1b" not in out.getvalue(), out.getvalue()
    report = tmp_path / "r\x1b]0;x\x07.json"
    out = io.StringIO()
    main(["eval", "--requests", "20", "--out", str(report)], stdout=out, stderr=io.StringIO())
    assert report.exists()
    last = out.getvalue().splitlines()[-1]
    assert last == f"wrote {tmp_path}/r?]0;x?.json and {tmp_path}/r?]0;x?.html", last
    assert not any(c in out.getvalue() for c in "\x1b\x07")
