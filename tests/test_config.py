"""Load-time refusals (SPEC §3): a clear error naming the route or key, never a secret."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fallback_mw import ConfigError, Gateway, GatewayConfig, load_config
from tests.upstreams import host_app

ENV = {"PRIMARY_KEY": "sk-very-secret-value", "BACKUP_KEY": "sk-other-secret"}


def base(**route: Any) -> dict[str, Any]:
    return {
        "upstreams": {
            "primary": {"url": "http://127.0.0.1:9001", "auth_env": "PRIMARY_KEY"},
            "backup": {"url": "http://localhost:9002", "auth_env": "BACKUP_KEY"},
        },
        "routes": [
            {"id": "chat", "prefix": "/v1/", "plan": ["primary", "backup"], "retries": 1, **route}
        ],
    }


def refused(data: dict[str, Any], environ: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(data, environ=ENV if environ is None else environ)
    message = str(info.value)
    for secret in ENV.values():
        assert secret not in message
    return message


def test_a_valid_config_loads_from_dict_model_and_toml(tmp_path: Path) -> None:
    config = load_config(base(), environ=ENV)
    assert isinstance(config, GatewayConfig)
    assert config.routes[0].attempt_ceiling == 2
    assert load_config(config, environ=ENV) == config
    path = tmp_path / "gateway.toml"
    path.write_text(
        """
[gateway]
deadline_ms = 3000

[upstreams.primary]
url = "http://127.0.0.1:9001"
auth_env = "PRIMARY_KEY"

[[routes]]
id = "chat"
prefix = "/v1/"
plan = ["primary"]
"""
    )
    loaded = load_config(path, environ=ENV)
    assert loaded.gateway.deadline_ms == 3000
    assert loaded.routes[0].plan == ("primary",)


def test_unreachable_fallback_is_refused() -> None:
    message = refused(base(retries=0))
    assert "route 'chat'" in message and "retries" in message


def test_repeated_candidate_and_primary_as_fallback_are_refused() -> None:
    assert "repeats the primary" in refused(base(plan=["primary", "primary"]))
    data = base(plan=["primary", "backup", "backup"], retries=2)
    assert "appears twice" in refused(data)


def test_unknown_upstream_and_unknown_key_are_refused() -> None:
    assert "unknown upstream 'nope' (defined: backup, primary)" in refused(
        base(plan=["primary", "nope"])
    )
    # A typo is answered with the name meant.
    assert refused(base(plan=["primary", "backpu"])).endswith(
        "unknown upstream 'backpu' (did you mean 'backup'?)"
    )
    data = base(budget="acem")
    data["budgets"] = {"acme": {"limit": 1}}
    assert refused(data).endswith("unknown budget 'acem' (did you mean 'acme'?)")
    data = base()
    data["routes"][0]["retry"] = 3
    assert "unknown key \"routes['chat'].retry\"" in refused(data)
    data = base()
    data["gateway"] = {"deadline": 5}
    assert "unknown key 'gateway.deadline'" in refused(data)


def test_a_newcomers_toml_mistakes_are_named_in_toml_words_with_the_fix(tmp_path: Path) -> None:
    # Each was refused before, but as pydantic spoke: "Input should be a valid tuple",
    # "a valid dictionary or instance of UpstreamConfig", "Value error, ...", and a union
    # reported once per member type ("auth_env.str: ...; auth_env.tuple[str, ...]: ...").
    def toml_refusal(text: str) -> str:
        path = tmp_path / "gateway.toml"
        path.write_text(text, encoding="utf-8")
        with pytest.raises(ConfigError) as info:
            load_config(path, environ=ENV)
        return str(info.value)

    upstream = '[upstreams.primary]\nurl = "http://127.0.0.1:9001"\n'
    route = 'id = "chat"\nprefix = "/v1/"\nplan = ["primary"]\n'
    assert toml_refusal(upstream + "[routes]\n" + route).endswith(
        "routes: must be an array of tables: write each route as [[routes]]"
    )
    assert toml_refusal(
        upstream + '[[routes]]\nid = "c"\nprefix = "/v1/"\nplan = "primary"\n'
    ).endswith("routes['c'].plan: must be an array [...]")
    assert toml_refusal('[upstreams]\nprimary = "http://127.0.0.1:9001"\n').endswith(
        "upstreams.primary: must be a table"
    )
    assert toml_refusal(upstream + "[[routes]]\n" + route + "retires = 1\n").endswith(
        "unknown key \"routes['chat'].retires\" (did you mean 'retries'?)"
    )
    assert toml_refusal('[upstream.primary]\nurl = "http://127.0.0.1:9001"\n').endswith(
        "unknown key 'upstream' (did you mean 'upstreams'?)"
    )
    # A key below the wrong header belongs to that header's table: say whose key it is.
    assert toml_refusal(
        '[[routes]]\nid = "chat"\nprefix = "/v1/"\nplan = ["primary", "backup"]\n'
        '[upstreams.primary]\nurl = "http://127.0.0.1:9001"\n'
        '[upstreams.backup]\nurl = "http://127.0.0.1:9002"\nretries = 1\n'
    ).endswith(
        "unknown key 'upstreams.backup.retries' (retries is a key of [[routes]]: a TOML key "
        "belongs to the last [table] header above it)"
    )
    assert toml_refusal('[gateway]\nallow_host = ["127.0.0.1"]\n').endswith(
        "unknown key 'gateway.allow_host' (did you mean 'allow_hosts'?)"
    )
    assert toml_refusal(upstream + "auth_env = 5\n").endswith(
        "upstreams.primary.auth_env: must be a string or an array [...]"
    )
    assert toml_refusal(upstream + "auth_env = [5]\n").endswith(
        "upstreams.primary.auth_env: must be a string or an array [...]"
    )
    assert toml_refusal(
        upstream + '[[routes]]\nid = "chat"\nprefix = "v1/"\nplan = ["primary"]\n'
    ).endswith("routes['chat'].prefix: must start with '/'")
    assert toml_refusal(upstream + '[[routes]]\nprefix = "/v1/"\nplan = ["primary"]\n').endswith(
        "routes[0].id: required key missing"
    )
    assert toml_refusal(
        upstream + '[[routes]]\nid = "chat"\nprefix = "/v1/"\nplan = []\n'
    ).endswith("routes['chat'].plan: must not be empty")
    assert toml_refusal('[gateway]\ndeadline_ms = "5s"\n').endswith(
        "gateway.deadline_ms: must be an integer"
    )
    assert toml_refusal(upstream + "[[routes]]\n" + route + 'canary_eligible = "maybe"\n').endswith(
        "routes['chat'].canary_eligible: must be true or false"
    )
    assert toml_refusal('[upstreams.primary]\nurl = "http://10.1.2.3:9001"\n').endswith(
        "upstream 'primary': host '10.1.2.3' is not in allow_hosts: add it to [gateway] allow_hosts"
    )


def test_a_value_out_of_range_is_refused_with_its_bound_in_plain_words(tmp_path: Path) -> None:
    # pydantic's words were passed through: "retries: Input should be greater than or equal
    # to 0", beside the loader's own "must be an integer".
    def toml_refusal(text: str) -> str:
        path = tmp_path / "gateway.toml"
        path.write_text(text, encoding="utf-8")
        with pytest.raises(ConfigError) as info:
            load_config(path, environ=ENV)
        return str(info.value)

    assert toml_refusal("[gateway]\ndeadline_ms = 0\n").endswith(
        "gateway.deadline_ms: must be at least 1"
    )
    assert toml_refusal("[gateway]\ndeadline_ms = 30_000_000\n").endswith(
        "gateway.deadline_ms: must be at most 600000"
    )
    assert toml_refusal("[gateway.breaker]\nfailure_rate = 0\n").endswith(
        "gateway.breaker.failure_rate: must be above 0.0"
    )


def test_a_breaker_cap_written_below_its_first_cooldown_is_refused_naming_both_keys(
    tmp_path: Path,
) -> None:
    """`cooldown_ms = 5000`, `max_cooldown_ms = 1000` loaded, and the breaker silently
    opened for 5 s each time (the cap raised to the cooldown): which one the operator meant
    was never asked. Refused at load, naming both keys and values; a cap left unwritten
    still follows a longer cooldown_ms (no doubling), and equal values load."""
    path = tmp_path / "gateway.toml"
    path.write_text("[gateway.breaker]\ncooldown_ms = 5000\nmax_cooldown_ms = 1000\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, environ=ENV)
    assert str(info.value) == (
        "invalid configuration: gateway.breaker: max_cooldown_ms (1000) is below cooldown_ms "
        "(5000): the cap on a breaker's cooldown cannot be shorter than its first cooldown; "
        "raise max_cooldown_ms or lower cooldown_ms"
    )
    with pytest.raises(ConfigError, match="max_cooldown_ms \\(1\\) is below cooldown_ms"):
        load_config({"gateway": {"breaker": {"max_cooldown_ms": 1}}})  # the default 5000
    alone = load_config({"gateway": {"breaker": {"cooldown_ms": 600_000}}}).gateway.breaker
    assert (alone.cooldown_ms, alone.max_cooldown_ms) == (600_000, 300_000)
    equal = {"cooldown_ms": 7000, "max_cooldown_ms": 7000}
    assert load_config({"gateway": {"breaker": equal}}).gateway.breaker.max_cooldown_ms == 7000


@pytest.mark.parametrize(
    ("line", "says"),
    [
        # A 1 ms deadline for every route, from a boolean.
        ("[gateway]\ndeadline_ms = true\n", "gateway.deadline_ms: must be an integer"),
        ('[gateway]\nmax_concurrency = "10"\n', "gateway.max_concurrency: must be an integer"),
        ('[gateway.breaker]\nfailure_rate = "0.5"\n', "breaker.failure_rate: must be a number"),
        ('[[routes]]\nid = "r"\nprefix = "/v1/"\nplan = ["p"]\nretries = "1"\n',
         "routes['r'].retries: must be an integer"),
        ('[[routes]]\nid = "r"\nprefix = "/v1/"\nplan = ["p"]\ncanary_eligible = 1\n',
         "routes['r'].canary_eligible: must be true or false"),
        ('[[routes]]\nid = "r"\nprefix = "/v1/"\nplan = ["p"]\ncanary_eligible = "true"\n',
         "routes['r'].canary_eligible: must be true or false"),
        # A list's numbers too: ["503"] loaded as 503, beside a doc saying "never converted".
        ('[[routes]]\nid = "r"\nprefix = "/v1/"\nplan = ["p"]\nfailover_status = ["503"]\n',
         "routes['r'].failover_status.0: must be an integer"),
        ('[[routes]]\nid = "r"\nprefix = "/v1/"\nplan = ["p"]\nfailover_status = [503, 5e2]\n',
         "routes['r'].failover_status.1: must be an integer"),
    ],
)  # fmt: skip
def test_a_toml_value_of_another_type_is_refused_not_converted(
    line: str, says: str, tmp_path: Path
) -> None:
    # pydantic's lax mode took each as if it had been written right ("1" as 1, true as 1,
    # 1 as true): `deadline_ms = true` loaded as a 1 ms deadline.
    path = tmp_path / "gateway.toml"
    path.write_text('[upstreams.p]\nurl = "http://127.0.0.1:9001"\n' + line, encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(path, environ=ENV)
    assert str(info.value).endswith(says), str(info.value)


def test_numbers_and_booleans_of_the_right_type_still_load() -> None:
    config = load_config(
        {
            "gateway": {"deadline_ms": 1000, "breaker": {"failure_rate": 1}},
            "upstreams": {"p": {"url": "http://127.0.0.1:9001", "rpm": None}},
            "routes": [
                {"id": "r", "prefix": "/v1/", "plan": ["p"], "canary_eligible": True,
                 "canary_percent": 5, "deadline_ms": None}
            ],
        },
        environ=ENV,
    )  # fmt: skip
    assert config.gateway.breaker.failure_rate == 1.0 and config.routes[0].canary_percent == 5.0


def test_a_misspelt_replayable_method_is_refused_with_the_method_it_resembles() -> None:
    # replayable_methods = ["PSOT"] loaded, and the route's POSTs never failed over.
    data = base()
    data["routes"][0]["replayable_methods"] = ["GET", "PSOT"]
    assert refused(data).endswith(
        "routes['chat'].replayable_methods: 'PSOT' is neither an HTTP method nor one this "
        "route's methods list (GET, HEAD, OPTIONS, POST, PUT, PATCH, DELETE): did you mean "
        "'POST'?"
    )
    # A custom method the route forwards, and HTTP's own methods, still load.
    data["routes"][0]["methods"] = ["PROPFIND", "POST"]
    data["routes"][0]["replayable_methods"] = ["propfind", "GET", "HEAD", "OPTIONS", "POST"]
    route = load_config(data, environ=ENV).routes[0]
    assert route.replayable_methods == ("PROPFIND", "GET", "HEAD", "OPTIONS", "POST")


def test_missing_credential_variable_is_named_and_no_value_printed() -> None:
    message = refused(base(), environ={"PRIMARY_KEY": "sk-very-secret-value"})
    assert "BACKUP_KEY" in message and "not set" in message


@pytest.mark.parametrize(
    "url",
    [
        "http://169.254.169.254/latest",
        "http://[fd00:ec2::254]/",
        "http://[::ffff:169.254.169.254]/",
        "http://2852039166/",
        "http://0xa9fea9fe/",
        "http://0251.0376.0251.0376/",
        "http://[fe80::1]/",
    ],
)
def test_link_local_and_metadata_upstreams_are_always_refused(url: str) -> None:
    data = base()
    data["gateway"] = {"allow_hosts": ["0.0.0.0/0", "::/0", "169.254.169.254"]}
    data["upstreams"]["backup"]["url"] = url
    message = refused(data)
    assert "upstream 'backup'" in message and "link-local" in message


def test_upstream_outside_the_allowlist_is_refused() -> None:
    data = base()
    data["upstreams"]["backup"]["url"] = "http://10.1.2.3:80"
    message = refused(data)
    assert "upstream 'backup'" in message and "allow_hosts" in message


def test_cidr_allowlist_admits_its_addresses() -> None:
    data = base()
    data["gateway"] = {"allow_hosts": ["127.0.0.0/8", "localhost"]}
    data["upstreams"]["primary"]["url"] = "http://127.0.0.7:9001"
    assert load_config(data, environ=ENV).upstreams["primary"].host == "127.0.0.7"


def test_bad_values_are_explained() -> None:
    assert "prefix" in refused(base(prefix="v1"))
    assert "deadline_ms" in refused(base(deadline_ms=0))
    data = base()
    data["upstreams"]["primary"]["url"] = "http://user:pw@127.0.0.1:9001"
    message = refused(data)
    assert "credentials" in message and "pw" not in message


@pytest.mark.parametrize(
    "prefix", ["/v1/*", "/v1*", "/v1//", "//v1/", "/v1/?model=x", "/v1#a", "/v1\\"]
)
def test_a_prefix_that_could_never_match_is_refused(prefix: str) -> None:
    # Requests match on the normalised path (no empty segments, no query or fragment, `\\`
    # read as `/`) and a prefix is literal: each of these would be a route that never serves.
    message = refused(base(prefix=prefix))
    assert "routes['chat'].prefix" in message and "a prefix is literal" in message
    assert load_config(base(prefix="/v1/chat"), environ=ENV).routes[0].prefix == "/v1/chat"


@pytest.mark.parametrize("key", ["methods", "replayable_methods"])
@pytest.mark.parametrize("methods", [["GET,HEAD"], ["GET POST"], ["GET", ""], [" GET"]])
def test_a_method_no_request_can_carry_is_refused(key: str, methods: list[str]) -> None:
    # `replayable_methods = ["GET,HEAD"]` loaded and silently ended GET failover (no request
    # method is "GET,HEAD"); `methods = ["GET, POST"]` made a route that served nothing.
    message = refused(base(**{key: methods}))
    assert f"routes['chat'].{key}" in message and "HTTP method" in message
    # A custom method is replayable where the route forwards it (see the misspelt method).
    loaded = load_config(
        base(**{"methods": ["GET", "PROPFIND"], key: ["get", "PROPFIND"]}), environ=ENV
    ).routes[0]
    assert getattr(loaded, key) == ("GET", "PROPFIND")
    # No replayable method is a choice (never replay); a route of no methods serves nothing.
    assert load_config(base(replayable_methods=[]), environ=ENV).routes[0].replayable_methods == ()
    assert "routes['chat'].methods" in refused(base(methods=[]))


@pytest.mark.parametrize("status", [200, 204, 101])
def test_a_success_in_failover_status_is_refused(status: int) -> None:
    # A 2xx there would fail over on every success, booking each one to the breaker.
    message = refused(base(failover_status=[status, 503]))
    assert "routes['chat'].failover_status" in message and f"{status} is not a failure" in message
    assert load_config(base(failover_status=[307, 429, 503]), environ=ENV)


@pytest.mark.parametrize(
    "header",
    ["bad header", "authorization:", "", "x-api-key\r\nx-injected: 1", "host", "content-length",
     "transfer-encoding", "connection", "x-gateway-key"],
)  # fmt: skip
def test_an_auth_header_that_cannot_carry_the_credential_is_refused(header: str) -> None:
    # Before, these loaded: a malformed name failed every attempt at that upstream as a
    # local 502, and a framing field (host, content-length, ...) sent the key in its place.
    data = base()
    data["upstreams"]["backup"]["auth_header"] = header
    message = refused(data)
    assert "upstreams.backup.auth_header" in message
    data["upstreams"]["backup"]["auth_header"] = " X-Backup_Token "
    assert load_config(data, environ=ENV).upstreams["backup"].auth_header == "x-backup_token"


@pytest.mark.parametrize("key", ["tenant_header", "session_header"])
def test_a_tenant_or_session_header_that_no_request_can_carry_is_refused(key: str) -> None:
    # "x tenant" or "x-tenant-id:" loaded and matched no request: tenant routes never
    # served, canary and affinity silently off.
    for header in ("x tenant", "x-tenant-id:", ""):
        data = {**base(), "gateway": {key: header}}
        assert f"gateway.{key}" in refused(data)
    data = {**base(), "gateway": {key: " X-Org "}}
    assert getattr(load_config(data, environ=ENV).gateway, key) == "x-org"


def test_auth_scheme_is_trimmed_and_a_control_character_refused() -> None:
    # "Bearer " sent "Bearer  <key>"; "Bearer\r\n" loaded and failed every attempt as a
    # local 502 (the client library refused the header).
    data = base()
    data["upstreams"]["backup"]["auth_scheme"] = "Bearer "
    assert load_config(data, environ=ENV).upstreams["backup"].auth_scheme == "Bearer"
    data["upstreams"]["backup"]["auth_scheme"] = " "
    assert load_config(data, environ=ENV).upstreams["backup"].auth_scheme == ""
    for scheme in ("Bearer\r\n", "Bearer\x00", "Bearer\x7f", "Bé\u2028"):
        data["upstreams"]["backup"]["auth_scheme"] = scheme
        assert "upstreams.backup.auth_scheme" in refused(data)


def test_a_missing_relative_config_file_says_where_it_was_looked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # FALLBACK_MW = {"config": "gateway.toml"} (or Gateway(app, config="gateway.toml")) under a
    # server started from another directory: "configuration file 'gateway.toml' not found"
    # named no directory, and the file was right there beside settings.py.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as relative:
        load_config("gateway.toml")
    assert str(relative.value) == (
        f"configuration file 'gateway.toml' not found (looked for {tmp_path / 'gateway.toml'})"
    )
    with pytest.raises(ConfigError) as absolute:
        load_config(tmp_path / "absent.toml")
    assert str(absolute.value) == f"configuration file {str(tmp_path / 'absent.toml')!r} not found"


@pytest.mark.parametrize(
    "text",
    [
        '[gateway]\nallow_hosts = ["127.0.0.1"]\n\n[upstreams.primary]\nauth_env = "SECRET_NAME"\n',
        "  [gateway]",  # one line: read as a file name, then recognised
        "gateway.deadline_ms = 3000",
        "[gateway]\n# " + "x" * 5000,  # longer than a file name may be
        "[gateway] " + "x" * 5000,
    ],
)
def test_toml_text_given_as_config_says_what_config_takes_without_echoing_it(
    text: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Gateway(app, config=TOML_TEXT) read the text as a file name: "configuration file
    # '[gateway]\nallow_hosts = ...' not found (looked for /srv/[gateway]\n...)", the whole
    # text twice, and no word of what config= takes.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as raised:
        load_config(text)
    message = str(raised.value)
    assert message == (
        "config= was given TOML text, not the path of a file: config= takes the path of a "
        "TOML file, a mapping (dict) or a GatewayConfig; for TOML text, pass tomllib.loads(text)"
    )
    gateway = Gateway(host_app, config=text)
    assert gateway.config_error is not None and "tomllib.loads(text)" in gateway.config_error
    assert "[gateway]" not in gateway.config_error and "SECRET_NAME" not in gateway.config_error


def test_a_path_read_with_its_line_end_is_not_taken_for_toml_text(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # config=Path("path.txt").read_text() or an environment variable's value: one line and
    # its newline is a file name (missing here), not TOML text.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="not found") as raised:
        load_config("gateway.toml\n")
    assert "TOML text" not in str(raised.value)


def test_a_file_whose_name_looks_like_toml_is_still_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "[prod] gateway.toml").write_text("[gateway]\ndeadline_ms = 3000\n")
    assert load_config("[prod] gateway.toml").gateway.deadline_ms == 3000


def test_missing_file_and_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[gateway\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_a_file_saved_with_a_byte_order_mark_loads(tmp_path: Path) -> None:
    # Windows editors (Notepad, PowerShell 5's Out-File -Encoding utf8) start UTF-8 with a
    # BOM; tomllib refused it as "Invalid statement (at line 1, column 1)".
    path = tmp_path / "gateway.toml"
    path.write_bytes(b"\xef\xbb\xbf[gateway]\ndeadline_ms = 3000\n")
    assert load_config(path).gateway.deadline_ms == 3000


def test_state_and_store_urls_are_checked_at_load() -> None:
    data = base()
    data["gateway"] = {"state": "bogus://x"}
    assert "gateway.state" in refused(data)
    data["gateway"] = {"store": "mysql://x"}
    assert "gateway.store" in refused(data)


def test_an_in_memory_sqlite_store_is_refused_naming_the_key() -> None:
    # `sqlite:///:memory:` (SQLAlchemy's spelling) opened a database per connection: the
    # store created its tables on one and read routes on another, and `serve` stopped with
    # "SQLite store error: no such table: fmw_routes", naming no key; `check` called it a
    # file ":memory:" in the working directory, and `routes add` stored into nothing.
    data = base()
    data["gateway"] = {"store": "sqlite:///:memory:"}
    message = refused(data)
    assert "gateway.store" in message and ":memory:" in message
    assert "omit gateway.store" in message and "sqlite:///gateway.db" in message
    for named in ("sqlite:///./:memory:", "sqlite:///:MEMORY:"):  # files of that name (SQLite)
        data["gateway"] = {"store": named}
        assert load_config(data, environ=ENV).gateway.store == named


def test_fallback_at_the_primarys_own_endpoint_is_refused() -> None:
    data = base()
    data["upstreams"]["backup"]["url"] = "http://127.0.0.1:9001"
    assert "primary's own endpoint" in refused(data)


def test_unknown_budget_without_a_store_is_refused() -> None:
    assert "unknown budget 'nope'" in refused(base(budget="nope"))
    data = base(budget="nope")
    data["gateway"] = {"store": "sqlite:///unused.db"}
    assert load_config(data, environ=ENV).routes[0].budget == "nope"  # the store may have it


def test_every_unset_or_unusable_credential_variable_is_named_at_once() -> None:
    """An operator fixing a deployment learns of every missing variable in one run, not
    one per run; only names are printed, never a value."""
    data = {
        "upstreams": {
            "a": {"url": "http://127.0.0.1:9001", "auth_env": "A_KEY"},
            "b": {"url": "http://127.0.0.1:9002", "auth_env": "B_KEY"},
            "c": {"url": "http://127.0.0.1:9003", "auth_env": "C_KEY"},
        },
        "routes": [{"id": "r", "prefix": "/v1/", "plan": ["a", "b", "c"], "retries": 2}],
    }
    message = refused(data, environ={"B_KEY": "sk-secret\n"})
    assert "A_KEY is not set" in message and "C_KEY is not set" in message
    assert "B_KEY cannot be sent as a header value" in message
    assert "sk-secret" not in message


def test_an_unsendable_credential_is_explained_by_its_own_fault() -> None:
    """Every unsendable credential value was asked 'a trailing newline from a secrets
    file?', a key in Cyrillic letters too: the hint belongs to a line break or surrounding
    whitespace only; the value is never printed."""
    data = {
        "upstreams": {"a": {"url": "http://127.0.0.1:9001", "auth_env": "A_KEY"}},
        "routes": [{"id": "r", "prefix": "/v1/", "plan": ["a"]}],
    }
    wide = refused(data, environ={"A_KEY": "ключ-secret"})
    assert "outside latin-1" in wide and "secrets file" not in wide and "secret" not in wide
    newline = refused(data, environ={"A_KEY": "sk-secret\n"})
    assert "a trailing newline from a secrets file?" in newline and "sk-secret" not in newline


def test_a_credential_variable_set_to_the_empty_string_is_called_empty_not_unset() -> None:
    """`export PRIMARY_API_KEY=` was refused as "is not set", while `env` showed the variable:
    the message now says what is wrong with it."""
    data = {
        "upstreams": {
            "a": {"url": "http://127.0.0.1:9001", "auth_env": "A_KEY"},
            "b": {"url": "http://127.0.0.1:9002", "auth_env": "B_KEY"},
        },
        "routes": [{"id": "r", "prefix": "/v1/", "plan": ["a", "b"], "retries": 1}],
    }
    message = refused(data, environ={"A_KEY": ""})
    assert "upstream 'a': environment variable A_KEY is set but empty" in message
    assert "upstream 'b': environment variable B_KEY is not set" in message
