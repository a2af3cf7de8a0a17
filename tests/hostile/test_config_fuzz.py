"""Property tests of what an operator types into the configuration: whatever a key holds,
the loader refuses it with a ConfigError naming the key, or what it loaded is usable when
the gateway first needs it (never an internal error after a clean start)."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fallback_mw.config import ConfigError, load_config
from fallback_mw.store.sqlite import SqliteStore
from tests.helpers import sqlite_db

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def base(**gateway: Any) -> dict[str, Any]:
    return {
        "gateway": {"allow_hosts": ["127.0.0.1"], **gateway},
        "upstreams": {"p": {"url": "http://127.0.0.1:9001"}},
        "routes": [{"id": "r", "prefix": "/v1/", "plan": ["p"]}],
    }


# Text an operator (or a TOML escape such as "\u0000") can put in a string, control
# characters and lone surrogates (a dict handed to `Gateway(config=...)`) included.
odd_text = st.text(
    st.one_of(
        st.characters(codec="utf-8"),
        st.sampled_from(["\x00", "\x1b", "\n", "\t", "\x7f", "\ud800", "é", "%", "?", "#"]),
    ),
    max_size=12,
)
# The options redis-py reads from a state URL's query, and those it passes to the
# connection as they are (a name it does not know is refused by name).
REDIS_OPTIONS = [
    "db", "socket_timeout", "socket_connect_timeout", "socket_keepalive", "retry_on_timeout",
    "max_connections", "health_check_interval", "ssl_check_hostname", "ssl_min_version",
    "ssl_cert_reqs", "protocol", "timeout", "encoding", "encoding_errors", "client_name",
    "username", "prefix",
]  # fmt: skip
option_values = st.one_of(
    st.sampled_from(
        [
            "0",
            "1",
            "-1",
            "2",
            "3",
            "5",
            "x",
            "true",
            "nan",
            "inf",
            "bogus",
            "utf-8",
            "utf-16",
            "rot13",
            "latin-1",
        ]
    ),
    odd_text,
)


@SETTINGS
@given(st.sampled_from(REDIS_OPTIONS), option_values, st.sampled_from(["redis", "rediss"]))
def test_a_state_url_is_refused_by_name_or_usable(name: str, value: str, scheme: str) -> None:
    pytest.importorskip("redis")
    import redis.asyncio as aioredis

    from fallback_mw.store_url import split_state_url

    url = f"{scheme}://:PW-SECRET@127.0.0.1:6379/9?{name}={value}"
    try:
        load_config(base(state=url), check_env=False)
    except ConfigError as exc:
        assert "gateway.state" in str(exc) and "PW-SECRET" not in str(exc)
        # Named by option, never quoting a value of the query (it may be `password=`).
        assert len(value) < 8 or value not in str(exc)
        return
    # Loaded: the client the gateway builds on its first request (health/redis.py) is
    # made, and writes the gateway's (ASCII) keys and scripts as they are.
    pool = aioredis.BlockingConnectionPool.from_url(split_state_url(url)[0], decode_responses=True)
    pool.make_connection()  # type: ignore[no-untyped-call]
    assert pool.get_encoder().encode("fallback_mw:breaker") == b"fallback_mw:breaker"


@SETTINGS
@given(odd_text)
def test_a_sqlite_store_path_is_refused_by_name_or_opens(name: str) -> None:
    with tempfile.TemporaryDirectory() as folder:
        url = f"sqlite:///{folder}/{name.replace('/', '_')}x.db"
        try:
            config = load_config(base(store=url), check_env=False)
        except ConfigError as exc:
            assert "gateway.store" in str(exc)
            return
        assert config.gateway.store is not None
        store = SqliteStore(url.removeprefix("sqlite:///"))
        asyncio.run(store.change_serials())


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("store", "sqlite:///gateway\\u0000.db"),
        ("store", "postgresql://u@127.0.0.1:1/d\\u0000b"),
        ("state", "redis://127.0.0.1\\u0000:6379/9"),
        ("state", "redis://127.0.0.1:6379/9?encoding=bogus"),
        ("state", "redis://127.0.0.1:6379/9?encoding=utf-16"),
        ("state", "redis://127.0.0.1:6379/9?protocol=5"),
        ("state", "rediss://127.0.0.1:6379/9?ssl_cert_reqs=bogus"),
    ],
)
@pytest.mark.parametrize("verb", [["check"], ["routes", "list"]])
def test_a_service_url_no_driver_opens_is_one_line_naming_the_key(
    key: str,
    value: str,
    verb: list[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # `store = "sqlite:///gateway\u0000.db"` passed the loader, then `check`, every admin
    # verb and `serve` said "unexpected internal error (ValueError)"; `?encoding=bogus`
    # loaded and every routed request was an internal error; `?protocol=5` and
    # `?ssl_cert_reqs=bogus` were internal errors (RedisError) at load.
    if key == "state":
        pytest.importorskip("redis")
    from tests.cli_runner import run_cli

    config = tmp_path / "gateway.toml"
    config.write_text(
        f'[gateway]\nallow_hosts = ["127.0.0.1"]\n{key} = "{value}"\n'
        '[upstreams.p]\nurl = "http://127.0.0.1:9001"\n'
        '[[routes]]\nid = "r"\nprefix = "/v1/"\nplan = ["p"]\n'
    )
    assert run_cli([*verb, "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"gateway.{key}" in err, err
    assert "internal error" not in err and "\x00" not in err, err


@pytest.mark.anyio
@pytest.mark.parametrize("path", ["gateway\x00.toml", "gateway\ud800.toml"])
async def test_a_config_path_no_file_can_have_is_a_config_error(path: str) -> None:
    # `Gateway(app, config="gateway\x00.toml")` raised ValueError out of the constructor (a
    # traceback under the host's server) where any other unreadable path is the refusal
    # every request is answered with (503 config_error).
    from fallback_mw import Gateway
    from tests.helpers import client_for
    from tests.upstreams import host_app

    with pytest.raises(ConfigError, match="cannot be opened"):
        load_config(path)
    gateway = Gateway(host_app, config=path)
    async with client_for(gateway) as client:
        response = await client.get("/v1/chat")
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "config_error"
    await gateway.aclose()


@pytest.mark.parametrize(
    ("option", "says"),
    [
        ("--auth-env", "auth_env is empty"),
        ("--auth-header", "auth_header"),
        ("--fallback-auth-env", "auth_env is empty"),
        ("--fallback-auth-header", "auth_header"),
    ],
)
def test_routes_add_refuses_an_empty_credential_option_as_the_file_does(
    option: str, says: str, tmp_path: Path
) -> None:
    # `--auth-env "$PRIMARY_KEY_NAME"` with that shell variable unset stored a route that
    # sent no credential (and `--auth-header ""` one that used `authorization`), where the
    # loader refuses `auth_env = ""` / `auth_header = ""`: the store refuses what it does.
    from tests.test_cli_admin import run_cli

    store = f"sqlite:///{tmp_path / 'routes.db'}"
    status, _out, err = run_cli(
        *("routes", "add", "--store", store, "--id", "r", "--prefix", "/v1/"),
        *("--upstream", "http://127.0.0.1:9001", "--fallback", "http://127.0.0.1:9002"),
        *("--retries", "1", option, ""),
    )
    assert status == 2 and err.count("\n") == 1 and says in err, err
    assert run_cli("routes", "list", "--store", store)[1].strip() == "no routes"
    config = base()
    config["upstreams"]["p"][f"auth_{option.split('-')[-1]}"] = ""
    with pytest.raises(ConfigError, match=says):
        load_config(config, check_env=False)


credential_option = st.one_of(
    st.none(),
    odd_text,
    st.sampled_from(["", " ", "KEY", "$KEY", "x-api-key", "Authorization", "host", "1KEY"]),
)


@SETTINGS
@given(credential_option, credential_option)
def test_the_route_store_refuses_what_the_loader_refuses(
    header: str | None, variable: str | None
) -> None:
    from fallback_mw.config import GatewayConfig, RouteConfig
    from fallback_mw.store.model import StoredRoute
    from fallback_mw.store.routes import make_upstream, merge_routes

    upstream: dict[str, Any] = {"url": "http://127.0.0.1:9001"}
    if header is not None:
        upstream["auth_header"] = header
    if variable is not None:
        upstream["auth_env"] = variable
    config = base()
    config["upstreams"]["p"] = upstream
    try:
        load_config(config, check_env=False)
        loads = True
    except ConfigError:
        loads = False
    try:
        stored = StoredRoute(
            route=RouteConfig(id="r", prefix="/v1/", plan=("p",)),
            upstreams={"p": make_upstream(upstream["url"], header, variable, "route 'r'")},
        )
        merge_routes(GatewayConfig(), [stored])
        stores = True
    except ConfigError:
        stores = False
    assert stores == loads


ODD = "x\ud800"
UPSTREAM = {"url": "http://127.0.0.1:9002"}
# Every place of the configuration that takes text: a key of each table, an item of each
# list, a table's own name.
TEXT_PLACES: dict[str, Any] = {
    "gateway.canary_salt": lambda c: c["gateway"].update(canary_salt=ODD),
    "gateway.tenant_header": lambda c: c["gateway"].update(tenant_header=ODD),
    "gateway.allow_hosts": lambda c: c["gateway"].update(allow_hosts=[ODD]),
    "gateway.strip_headers": lambda c: c["gateway"].update(strip_headers=[ODD]),
    "gateway.strip_query_keys": lambda c: c["gateway"].update(strip_query_keys=[ODD]),
    "gateway.store": lambda c: c["gateway"].update(store=f"sqlite:///{ODD}.db"),
    "upstream.url": lambda c: c["upstreams"]["p"].update(url=f"http://127.0.0.1:9001/{ODD}"),
    "upstream.auth_env": lambda c: c["upstreams"]["p"].update(auth_env=ODD),
    "upstream.auth_env pool": lambda c: c["upstreams"]["p"].update(auth_env=["K", ODD]),
    "upstream.auth_scheme": lambda c: c["upstreams"]["p"].update(auth_scheme=ODD),
    "upstream.model": lambda c: c["upstreams"]["p"].update(model=ODD),
    "upstream.ca_file": lambda c: c["upstreams"]["p"].update(ca_file=ODD),
    "route.id": lambda c: c["routes"][0].update(id=ODD),
    "route.prefix": lambda c: c["routes"][0].update(prefix=f"/{ODD}/"),
    "route.tenant": lambda c: c["routes"][0].update(tenant=ODD),
    "route.plan": lambda c: c["routes"][0].update(plan=[ODD]),
    "route.methods": lambda c: c["routes"][0].update(methods=[ODD]),
    "route.budget": lambda c: c["routes"][0].update(budget=ODD),
    "upstreams name": lambda c: c["upstreams"].update({ODD: UPSTREAM}),
    "budgets name": lambda c: c.update(budgets={ODD: {"limit": 1}}),
    "prices name": lambda c: c.update(prices={ODD: {"input_per_mtok": 1, "output_per_mtok": 1}}),
}


@pytest.mark.parametrize("place", list(TEXT_PLACES))
def test_text_that_is_not_utf8_is_refused_at_load_wherever_it_is(place: str) -> None:
    # A lone surrogate (a dict built from os.environ holding bytes that are not UTF-8; a
    # store record's JSON "\ud800") loaded: `canary_salt` then failed every request with a
    # session (UnicodeEncodeError out of the gateway), a stored route's prefix `routes list`.
    config = base()
    TEXT_PLACES[place](config)
    with pytest.raises(ConfigError) as caught:
        load_config(config, check_env=False)
    assert "\ud800" not in str(caught.value)


@pytest.mark.anyio
async def test_a_salt_that_is_not_utf8_never_reaches_a_request() -> None:
    from fallback_mw import Gateway
    from tests.helpers import client_for
    from tests.upstreams import host_app, status_handler, upstream

    async with upstream(status_handler(200)) as up:
        config = base(canary_salt="salt-\udcff")  # os.environ's spelling of a byte 0xff
        config["upstreams"] = {"p": {"url": up.url}, "b": {"url": up.url + "/b"}}
        config["routes"][0].update(plan=["p", "b"], retries=1, canary_eligible=True)
        config["routes"][0]["canary_percent"] = 100.0
        gateway = Gateway(host_app, config=config)
        async with client_for(gateway) as client:
            response = await client.get("/v1/chat", headers={"x-session-id": "s1"})
        await gateway.aclose()
    assert response.status_code == 503, response.text
    assert "gateway.canary_salt" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    "doc",
    [
        "[" * 100_000 + "]" * 100_000,
        '{"route": ' + "[" * 100_000 + "]" * 100_000 + ', "upstreams": {}}',
        '{"route": {"id": "odd", "prefix": "/\\ud800/", "plan": ["odd-primary"]}, '
        '"upstreams": {"odd-primary": {"url": "http://127.0.0.1:9001"}}}',
        '{"route": {"id": "odd", "prefix": "/v1/", "tenant": "\\udcff", "plan": ["odd-primary"]}, '
        '"upstreams": {"odd-primary": {"url": "http://127.0.0.1:9001"}}}',
    ],
    ids=["nested-deep", "route-nested-deep", "surrogate-prefix", "surrogate-tenant"],
)
def test_a_hand_written_record_no_route_can_be_is_said_and_removable(
    doc: str, tmp_path: Path
) -> None:
    # A record nested some thousand deep made `routes list`, `routes remove` (the repair
    # its own message names) and a gateway's start an internal error (RecursionError); one
    # holding a JSON "\ud800" loaded, and `routes list` failed printing it.

    from fallback_mw import Gateway
    from tests.test_cli_admin import run_cli
    from tests.upstreams import host_app

    path = tmp_path / "routes.db"
    store = f"sqlite:///{path}"
    add = ("routes", "add", "--store", store, "--prefix", "/a/", "--id", "ok")
    assert run_cli(*add, "--upstream", "http://127.0.0.1:9002")[0] == 0
    with sqlite_db(path) as conn:
        conn.execute("INSERT INTO fmw_routes VALUES ('odd', ?, 0)", (doc,))
    status, out, err = run_cli("routes", "list", "--store", store)
    assert status == 0 and out.startswith("ok\t") and "stored route 'odd'" in err, err
    assert "routes remove --id odd" in err and err.count("\n") == 1, err
    gateway = Gateway(host_app, config={"gateway": {"store": store}})
    assert gateway.config_error is not None and "stored route 'odd'" in gateway.config_error
    status, out, err = run_cli("routes", "remove", "--store", store, "--id", "odd")
    assert status == 0 and "removed" in out, err
    assert run_cli("routes", "list", "--store", store)[2] == ""


@pytest.mark.parametrize(
    ("entry", "spells"),
    [
        ("::ffff:127.0.0.1", "127.0.0.1"),
        ("[::ffff:127.0.0.1]", "127.0.0.1"),
        ("::ffff:10.0.0.0/104", "10.0.0.0/8"),
        ("64:ff9b::a00:5", "10.0.0.5"),
        ("2002:a00::/24", "10.0.0.0/8"),
        ("::a00:5", "10.0.0.5"),
    ],
)
def test_an_allow_hosts_entry_spelling_ipv4_in_ipv6_is_refused_by_name(
    entry: str, spells: str
) -> None:
    # `allow_hosts = ["::ffff:127.0.0.1"]` loaded and matched nothing (the allowlist judges
    # such an address by the IPv4 one it carries): the upstream `http://[::ffff:127.0.0.1]`
    # was refused as "not in allow_hosts: add it to [gateway] allow_hosts", where it was.
    config = base(allow_hosts=[entry])
    config["upstreams"]["p"]["url"] = "http://[::ffff:127.0.0.1]:9001"
    with pytest.raises(ConfigError) as caught:
        load_config(config, check_env=False)
    message = str(caught.value)
    assert "gateway.allow_hosts" in message and repr(entry) in message, message
    assert f"spells {spells})" in message, message
    config["gateway"]["allow_hosts"] = ["127.0.0.1"]
    load_config(config, check_env=False)


@SETTINGS
@given(
    st.ip_addresses(v=6).map(str) | st.ip_addresses(v=4).map(str),
    st.integers(0, 128),
)
def test_an_allow_hosts_entry_that_loads_is_one_the_allowlist_can_match(
    address: str, length: int
) -> None:
    # Every IP entry the loader keeps matches the addresses it names, as the connect-time
    # check reads them (an address carrying an IPv4 one judged by that IPv4 address).
    import ipaddress

    from fallback_mw.security.addresses import Allowlist, is_always_refused

    bits = 32 if ":" not in address else 128
    entry = f"{address}/{min(length, bits)}"
    network = ipaddress.ip_network(entry, strict=False)
    try:
        load_config(base(allow_hosts=["127.0.0.1", entry]), check_env=False)
    except ConfigError as exc:
        assert "gateway.allow_hosts" in str(exc)
        return
    inside = network.network_address
    if not is_always_refused(inside):
        assert Allowlist([entry]).allows_address(inside), entry


prefix_segments = st.sampled_from(
    ["v1", "a;b", ".", "..", "..;", ".;x", "..;x=1", ".well-known", "..a", "é", "~", ";", "%2e"]
)


@SETTINGS
@given(st.lists(prefix_segments, max_size=5), st.booleans())
def test_a_route_prefix_that_loads_is_a_path_a_request_can_match(
    segments: list[str], trailing: bool
) -> None:
    # `prefix = "/v1/..;/"` loaded and `check` called it valid; requests are routed on the
    # normalised path, where `..;x` is a dot segment (as servlet containers read it), so
    # no request could ever match that route. A prefix that loads is its own normal form.
    from fallback_mw.routing import RouteTable, normalise_path

    prefix = "/" + "/".join(segments) + ("/" if trailing and segments else "")
    config = base()
    config["routes"][0]["prefix"] = prefix
    try:
        loaded = load_config(config, check_env=False)
    except ConfigError as exc:
        assert "prefix" in str(exc)
        return
    assert normalise_path(prefix) == prefix
    table = RouteTable(loaded.routes, loaded.upstreams)
    assert table.match("GET", normalise_path(prefix + "x") or "", "default") is not None


@pytest.mark.parametrize("prefix", ["/v1/..;/", "/v2/.;x/", "/..;jsessionid=1/api/"])
def test_a_prefix_with_a_dot_segment_and_a_parameter_is_refused(prefix: str) -> None:
    config = base()
    config["routes"][0]["prefix"] = prefix
    with pytest.raises(ConfigError, match=r"routes\['r'\]\.prefix: .*dot segments"):
        load_config(config, check_env=False)
