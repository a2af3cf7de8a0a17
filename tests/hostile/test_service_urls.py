"""A malformed state or store URL is refused by name when the configuration is loaded
(`check` and `serve` exit 2), never met as a bare 500 on every request or as an
"unexpected internal error"; the refusal never prints the URL's password."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from fallback_mw.config import ConfigError, load_config
from fallback_mw.store_url import redact_url
from tests.cli_runner import run_cli


def base(**gateway: Any) -> dict[str, Any]:
    return {
        "gateway": {"allow_hosts": ["127.0.0.1"], **gateway},
        "upstreams": {"primary": {"url": "http://127.0.0.1:9001"}},
        "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"]}],
    }


@pytest.mark.parametrize(
    ("key", "url", "says"),
    [
        ("state", "redis://:PW-SECRET@127.0.0.1:notaport/0", "port"),
        ("state", "redis://:PW-SECRET@127.0.0.1:99999/0", "port"),
        ("state", "redis://:PW-SECRET@127.0.0.1:0/0", "port"),
        ("state", "redis://:PW-SECRET@[::1/0", "["),
        ("state", "redis://:PW-SECRET@127.0.0.1:6379/abc", "database number"),
        ("state", "redis://:PW-SECRET@127.0.0.1:6379/0?max_connections=abc", "max_connections"),
        ("state", "redis://:PW-SECRET@127.0.0.1:6379/0?socket_timeout=x", "socket_timeout"),
        ("state", "redis://:PW-SECRET@127.0.0.1:6379/0?no_such_option=1", "no_such_option"),
        ("state", "redis://:PW-SECRET@127.0.0.1:6379/0?socket_timeout=0", "above 0"),
        ("state", "redis://:PW-SECRET@127.0.0.1:6379/0?socket_timeout=-1", "socket_timeout"),
        ("state", "rediss://:PW-SECRET@h:6379/0?socket_connect_timeout=0", "socket_connect"),
        ("store", "postgresql://u:PW-SECRET@[bad/db", "["),
        ("store", "postgresql://u:PW-SECRET@127.0.0.1:99999/db", "port"),
        ("store", "postgresql://u:PW-SECRET@h1:5432,h2:x/db", "port"),
        # A `/` unencoded in the password: the drivers read host `u`, port 2024.
        ("store", "postgresql://u:2024/PW-SECRET@127.0.0.1:5432/db", "%2F"),
        ("state", "redis://u:6379/PW-SECRET@127.0.0.1:6379/0", "%2F"),
        # asyncpg read `PW-SECRET` as the port: "invalid literal for int(): 'PW-SECRET'".
        ("store", "postgresql://u:PW-SECRET#1@127.0.0.1:5432/db", "%23"),
        ("store", "postgresql://u:PW-SECRET?1@127.0.0.1:5432/db", "%3F"),
        ("state", "redis://:PW-SECRET#1@127.0.0.1:6379/0", "%23"),
        # SQLite options are not read: the query would become part of the file's name.
        ("store", "sqlite:///gateway.db?mode=ro", "query"),
        ("store", "sqlite:///gateway.db#PW-SECRET", "query"),
    ],
)
def test_a_malformed_service_url_is_refused_by_name(key: str, url: str, says: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(base(**{key: url}), check_env=False)
    message = str(caught.value)
    assert f"gateway.{key}" in message and says in message
    assert "PW-SECRET" not in message


@pytest.mark.parametrize(
    ("key", "url"),
    [
        ("state", "redis://:pw@127.0.0.1:6379/0?prefix=team-a:&max_connections=5"),
        ("state", "redis://127.0.0.1/"),
        ("state", "rediss://[::1]:6380/2?socket_timeout=0.5"),
        ("state", "unix:///run/redis.sock?db=2"),
        ("store", "postgresql://u:pw@h1:5432,h2:5433/db?sslmode=disable"),
        ("store", "postgresql://u:pw@[::1]:5432/db"),
        ("store", "postgres://localhost/db"),
    ],
)
def test_well_formed_service_urls_load(key: str, url: str) -> None:
    config = load_config(base(**{key: url}), check_env=False)
    assert getattr(config.gateway, key) == url


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (
            "postgresql://u:PW-SECRET@h1:5432,h2:5433/db?sslmode=x",
            "postgresql://u@h1:5432,h2:5433/db",
        ),
        ("redis://:PW-SECRET@127.0.0.1:6379/0?prefix=a", "redis://127.0.0.1:6379/0"),
        ("postgresql://u:p@host/db?password=PW-SECRET#x", "postgresql://u@host/db"),
        # Read as host `u`, port 2024 and a path: printed whole, the password with it.
        ("postgresql://u:2024/PW-SECRET@h:5432/db", "postgresql://u@h:5432/db"),
        ("postgresql://u:PW@SECRET@h/db", "postgresql://u@h/db"),
    ],
)
def test_a_url_in_a_message_has_no_password_and_no_query(url: str, shown: str) -> None:
    assert redact_url(url) == shown


@pytest.mark.parametrize("verb", [["routes", "list"], ["check"]])
def test_a_password_with_a_slash_is_never_printed(
    verb: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`postgresql://gw:2024/PW@127.0.0.1:5432/db` loaded (the host read as `gw`, port
    2024), and `routes list`, `check` and every caller's 503 config_error said "cannot
    reach the store postgresql://gw:2024/PW@...": the password, whole."""
    url = "postgresql://gw:2024/PW-SECRET@127.0.0.1:1/db"
    config = tmp_path / "gateway.toml"
    config.write_text(
        f'[gateway]\nallow_hosts = ["127.0.0.1"]\nstore = "{url}"\n'
        '[upstreams.p]\nurl = "http://127.0.0.1:9001"\n'
        '[[routes]]\nid = "r"\nprefix = "/v1/"\nplan = ["p"]\n'
    )
    where = ["--store", url] if verb[0] == "routes" else ["--config", str(config)]
    assert run_cli([*verb, *where]) == 2
    err = capsys.readouterr().err
    assert "PW-SECRET" not in err and "%2F" in err, err
    assert err.count("\n") == 1, err


def test_check_refuses_a_bad_state_url_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text(
        '[gateway]\nallow_hosts = ["127.0.0.1"]\n'
        'state = "redis://:PW-SECRET@127.0.0.1:6379/0?max_connections=abc"\n'
        '[upstreams.p]\nurl = "http://127.0.0.1:9001"\n'
        '[[routes]]\nid = "r"\nprefix = "/v1/"\nplan = ["p"]\n'
    )
    assert run_cli(["check", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "gateway.state" in err and "max_connections" in err and "PW-SECRET" not in err


@pytest.mark.parametrize(
    ("option", "says"),
    [("sslmode=requir", "sslmode"), ("target_session_attrs=primry", "target_session_attrs")],
)
@pytest.mark.parametrize(
    "verb",
    [
        ["routes", "list"],
        ["faults", "list"],
        ["check"],
        # The ledger's verbs said "PostgreSQL ledger unavailable (ClientConfigurationError)",
        # exit 1: as if the database were down, naming neither the option nor the reason.
        ["budgets", "show"],
        ["budgets", "set", "--budget", "b", "--limit", "1"],
        ["usage"],
        ["capacity"],
    ],
)
def test_a_store_url_option_the_driver_refuses_is_a_clear_error(
    option: str,
    says: str,
    verb: list[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The driver reads these options only when it connects: a typo in sslmode made every
    # admin verb, check and serve say "unexpected internal error (ClientConfigurationError);
    # please report it", naming neither the store nor the option.
    url = f"postgresql://u:PW-SECRET@127.0.0.1:1/db?{option}"
    config = tmp_path / "gateway.toml"
    config.write_text(
        f'[gateway]\nallow_hosts = ["127.0.0.1"]\nstore = "{url}"\n'
        '[upstreams.p]\nurl = "http://127.0.0.1:9001"\n'
        '[[routes]]\nid = "r"\nprefix = "/v1/"\nplan = ["p"]\n'
    )
    assert run_cli([*verb, "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "internal error" not in err and "please report" not in err, err
    assert says in err and "postgresql://u@127.0.0.1:1/db" in err, err
    assert "PW-SECRET" not in err
    # One line, the route store's and the ledger's words alike.
    assert err.startswith("fallback-mw: error: the store postgresql://u@127.0.0.1:1/db cannot be")
    assert err.count("\n") == 1, err


@pytest.mark.parametrize(
    "verb", [["budgets", "show"], ["budgets", "set", "--budget", "b", "--limit", "1"], ["usage"]]
)
def test_a_ledger_verb_says_why_the_postgresql_store_refused_it(
    verb: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    # `routes list` said "cannot reach the store postgresql://postgres@...: the server
    # refused the connection: database "..." does not exist"; the ledger's verbs only
    # "PostgreSQL ledger unavailable (InvalidCatalogNameError)", naming neither the store
    # nor the reason (a typo in the database name, an unknown role, an option the server
    # refuses: UndefinedObjectError).
    from tests.conftest import PG_HOST, PG_PORT, PG_PREFIX, PG_USER, require_service

    require_service("PostgreSQL", PG_HOST, PG_PORT)
    name = f"{PG_PREFIX}absent_{uuid.uuid4().hex[:8]}"
    url = f"postgresql://{PG_USER}:PW-SECRET@{PG_HOST}:{PG_PORT}/{name}"
    assert run_cli([*verb, "--store", url]) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "PW-SECRET" not in err, err
    assert redact_url(url) in err and f'database "{name}" does not exist' in err, err
