"""SPEC §3 refusals are one function each (rules.py), and the config loader and the route
store (`routes add`, `routes set-fallback`) give the same answer for every spelling."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fallback_mw import endpoints, rules
from fallback_mw.config import ConfigError, load_config
from tests.test_cli_admin import run_cli

# (primary, fallback): the same endpoint however spelled.
SAME_ENDPOINT = [
    ("http://localhost", "HTTP://LocalHost:80/"),
    ("http://127.0.0.1:9001", "http://127.0.0.1:9001/"),
    ("https://localhost", "https://LOCALHOST:443"),
    ("http://localhost:8080/v1", "http://localhost:8080/v1/"),
    ("http://localhost.", "http://localhost:80"),
    # SPEC §12: loopback and literal spellings of one address are one origin
    ("http://127.0.0.1:18011", "HTTP://LocalHost:18011/"),
    ("http://localhost:9001", "http://127.0.0.1:9001/"),
    # one path however spelled: dot segments, escaped unreserved characters, empty segments
    ("http://127.0.0.1:9001", "http://127.0.0.1:9001/x/.."),
    ("http://127.0.0.1:9001", "http://127.0.0.1:9001/%2e"),
    ("http://127.0.0.1:9001", "http://127.0.0.1:9001/./"),
    ("http://127.0.0.1:9001/api", "http://127.0.0.1:9001/%61pi"),
    ("http://127.0.0.1:9001/api/v1", "http://127.0.0.1:9001/api//v1/"),
    ("http://127.0.0.1:9001/a%2fb", "http://127.0.0.1:9001/a%2Fb"),
    ("http://127.0.0.1:9001/v1", "http://127.0.0.1:9001/v2/../v1"),
]
# Different endpoints that a raw or careless comparison could confuse.
DIFFERENT_ENDPOINT = [
    ("http://localhost", "https://localhost"),  # scheme
    ("http://localhost", "http://localhost:8080"),  # port
    ("https://localhost:80", "http://localhost"),  # 80 is not https' default
    ("http://localhost/v1", "http://localhost/v2"),  # another path on one host
    ("http://127.0.0.1:9001", "http://localhost:9002"),  # one host, two ports
    ("http://localhost/v1", "http://localhost/V1"),  # paths are case-sensitive
    ("http://localhost/a/b", "http://localhost/a%2Fb"),  # an escaped slash is not a slash
    ("http://localhost/a", "http://localhost/a%2E"),  # `a.` is not `a`
]


@pytest.mark.parametrize(("a", "b"), SAME_ENDPOINT)
def test_same_endpoint(a: str, b: str) -> None:
    assert endpoints.same_endpoint(a, b) and endpoints.same_endpoint(b, a)


@pytest.mark.parametrize(("a", "b"), DIFFERENT_ENDPOINT)
def test_different_endpoint(a: str, b: str) -> None:
    assert not endpoints.same_endpoint(a, b)


def file_config(primary: str, fallback: str) -> dict[str, Any]:
    return {
        "upstreams": {"primary": {"url": primary}, "backup": {"url": fallback}},
        "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary", "backup"], "retries": 1}],
    }


def loader_says(primary: str, fallback: str) -> str | None:
    try:
        load_config(file_config(primary, fallback), environ={})
    except ConfigError as exc:
        return str(exc)
    return None


def store_says(tmp_path: Path, primary: str, fallback: str, verb: str) -> str | None:
    store = ["--store", f"sqlite:///{tmp_path / f'{verb}.db'}", "--id", "chat"]
    if verb == "add":
        args = ["routes", "add", *store, "--prefix", "/v1/", "--upstream", primary,
                "--retries", "1", "--fallback", fallback]  # fmt: skip
    else:
        assert run_cli(
            "routes", "add", *store, "--prefix", "/v1/", "--upstream", primary, "--retries", "1"
        )[0] == 0  # fmt: skip
        args = ["routes", "set-fallback", *store, "--upstream", fallback]
    status, _, err = run_cli(*args)
    assert status in (0, 2), err
    if status == 0:
        # Stored; at most a warning `check` would give too (the primary's first-byte timeout).
        assert "fallback-mw: error" not in err, err
        return None
    assert err.startswith("fallback-mw: error: ") and err.count("\n") == 1
    return err


@pytest.mark.parametrize(("primary", "fallback"), SAME_ENDPOINT)
def test_loader_and_store_refuse_the_primarys_endpoint_however_spelled(
    tmp_path: Path, primary: str, fallback: str
) -> None:
    # A dot segment is refused on its own now (the engines would reach two different
    # paths): the refusal names that, before any comparison with the primary.
    dotted = any(s in (".", "..", "%2e") for s in fallback.lower().split("/")[3:])
    expected = "'.' or '..' segment" if dotted else "is the primary's own endpoint"
    loader = loader_says(primary, fallback)
    assert loader is not None and expected in loader
    for verb in ("add", "set-fallback"):
        store = store_says(tmp_path, primary, fallback, verb)
        assert store is not None and expected in store, verb


@pytest.mark.parametrize(("primary", "fallback"), DIFFERENT_ENDPOINT)
def test_loader_and_store_accept_a_different_endpoint(
    tmp_path: Path, primary: str, fallback: str
) -> None:
    assert loader_says(primary, fallback) is None
    for verb in ("add", "set-fallback"):
        assert store_says(tmp_path, primary, fallback, verb) is None, verb


BAD_NAMES = ["NOT-A-NAME", "1KEY", "KEY WITH SPACE", "KEY\nNEXT", "", "K" * 129, "KÉY"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_malformed_variable_names_are_refused_by_loader_and_store(
    tmp_path: Path, name: str
) -> None:
    config = {
        "upstreams": {"primary": {"url": "http://127.0.0.1:9001", "auth_env": name}},
        "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"]}],
    }
    # An empty one (`--auth-env "$NAME"` with NAME unset in the shell) is said as such; the
    # store refuses it as the loader does (it stored a route that sent no credential).
    says = "auth_env is empty" if name == "" else "is not a valid environment variable name"
    with pytest.raises(ConfigError, match=says):
        load_config(config, check_env=False)
    status, _, err = run_cli(
        "routes", "add", "--store", f"sqlite:///{tmp_path / 'n.db'}", "--id", "chat",
        "--prefix", "/v1/", "--upstream", "http://127.0.0.1:9001", "--auth-env", name,
    )  # fmt: skip
    assert status == 2 and says in err
    assert err.count("\n") == 1


def test_a_credential_pasted_as_auth_env_is_never_echoed(tmp_path: Path) -> None:
    # The usual malformed "variable name" is the key itself: the refusal names the upstream
    # and the key, never the value (SPEC §3: a secret is never printed).
    key = "sk-proj-Zx81vQ3LmN0pRt7YwK2b"
    config = {
        "upstreams": {"primary": {"url": "http://127.0.0.1:9001", "auth_env": [key]}},
        "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"]}],
    }
    with pytest.raises(ConfigError) as info:
        load_config(config, check_env=False)
    message = str(info.value)
    assert "upstream 'primary': auth_env" in message and key not in message
    assert "never the credential itself" in message
    status, _, err = run_cli(
        "routes", "add", "--store", f"sqlite:///{tmp_path / 'k.db'}", "--id", "chat",
        "--prefix", "/v1/", "--upstream", "http://127.0.0.1:9001", "--auth-env", key,
    )  # fmt: skip
    assert status == 2 and "auth_env" in err and key not in err
    # A shell-style reference is a name: said how to write it.
    config["upstreams"]["primary"]["auth_env"] = "${PRIMARY_KEY}"
    with pytest.raises(ConfigError, match="write PRIMARY_KEY without the '\\$'"):
        load_config(config, check_env=False)


def test_well_formed_names_pass() -> None:
    for name in ("OPENAI_API_KEY", "_private", "k1", "K" * 128):
        rules.check_variable_name("x", name)


@pytest.mark.parametrize(
    ("plan", "retries", "hedge", "message"),
    [
        (["a", "b"], 0, 0, "could never be reached"),
        (["a", "a"], 1, 0, "repeats the primary"),
        (["a", "b", "b"], 2, 0, "appears twice"),
        (["a", "nowhere"], 1, 0, "unknown upstream 'nowhere'"),
        (["a", "b"], 1, 10, "hedge_after_ms needs retries >= 2"),
    ],
)
def test_plan_rules_are_the_loaders(
    plan: list[str], retries: int, hedge: int, message: str
) -> None:
    config = {
        "upstreams": {"a": {"url": "http://127.0.0.1:1"}, "b": {"url": "http://127.0.0.1:2"}},
        "routes": [
            {"id": "r", "prefix": "/", "plan": plan, "retries": retries, "hedge_after_ms": hedge}
        ],
    }
    with pytest.raises(ConfigError, match=message):
        load_config(config, environ={})
