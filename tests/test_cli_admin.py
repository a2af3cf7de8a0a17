"""The admin CLI (`fallback-mw routes|faults`, through the public `fallback_mw.cli.main` and
the shipped entry point) against a real SQLite store, and a Gateway serving what it stored."""

from __future__ import annotations

import asyncio
import io
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from fallback_mw import ConfigError, Gateway, load_config
from fallback_mw.cli import main
from fallback_mw.store.model import StoredRoute
from fallback_mw.store.routes import open_store
from tests.helpers import client_for, sqlite_db
from tests.upstreams import Upstream, host_app, silent_server, status_handler, upstream

# The console script pip installed next to this interpreter: the shipped entry point.
FALLBACK_MW = str(Path(sys.executable).with_name("fallback-mw"))


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    status = main(list(argv), stdout=out, stderr=err)
    return status, out.getvalue(), err.getvalue()


async def cli(*argv: str) -> tuple[int, str, str]:
    # main() runs its own event loop; keep it off the test's.
    return await asyncio.to_thread(run_cli, *argv)


@asynccontextmanager
async def failing_chat_route(store: str) -> AsyncIterator[tuple[list[str], Upstream]]:
    """A failing primary (503) stored as route "chat" (/api/, one retry) by `routes add`,
    and a healthy backup (body "backup") to make its fallback. Yields the `--store ...
    --id chat` arguments that name the route in later commands, and the backup."""
    async with (
        upstream(status_handler(503)) as primary,
        upstream(status_handler(200, b"backup")) as backup,
    ):
        base = ["--store", store, "--id", "chat"]
        status, _, err = await cli(
            "routes", "add", *base, "--prefix", "/api/", "--upstream", primary.url,
            "--retries", "1",
        )  # fmt: skip
        assert status == 0, err
        yield base, backup


def gateway_config(store: str, **extra: Any) -> dict[str, Any]:
    # Breakers never open here: these tests hit a failing primary on purpose, many times.
    settings = {"store": store, "breaker": {"min_calls": 1_000_000}}
    return {"gateway": {**settings, **extra.pop("gateway", {})}, **extra}


@pytest.fixture
def store_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'gateway.db'}"


@pytest.mark.anyio
async def test_route_added_by_the_cli_serves_with_failover(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PRIMARY_KEY", "sk-admin-shell-primary")
    monkeypatch.setenv("BACKUP_KEY", "sk-admin-shell-backup")
    async with (
        upstream(status_handler(503)) as primary,
        upstream(status_handler(200, b"from backup")) as backup,
    ):
        # The shipped entry point, as an operator runs it.
        process = await asyncio.create_subprocess_exec(
                FALLBACK_MW, "routes", "add",
                "--store", store_url, "--id", "chat", "--prefix", "/api/",
                "--upstream", primary.url, "--auth-env", "PRIMARY_KEY", "--retries", "1",
                "--fallback", backup.url, "--fallback-auth-header", "x-api-key",
                "--fallback-auth-env", "BACKUP_KEY",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        _, stderr = await process.communicate()
        assert process.returncode == 0, stderr
        gateway = Gateway(
            host_app,
            config=gateway_config(store_url),
            environ={"PRIMARY_KEY": "p-secret", "BACKUP_KEY": "b-secret"},
        )
        try:
            async with client_for(gateway) as client:
                response = await client.get("/api/models")
        finally:
            await gateway.aclose()
    assert response.status_code == 200
    assert response.text == "from backup"
    assert response.headers["x-gateway-provider"] == "chat-fallback"
    assert response.headers["x-gateway-attempts"] == "2"
    assert primary.count == 1 and backup.count == 1
    primary_headers = dict(primary.received[0].headers)
    backup_headers = dict(backup.received[0].headers)
    assert primary_headers["authorization"] == "Bearer p-secret"
    assert backup_headers["x-api-key"] == "b-secret"  # raw key for a non-authorization header
    assert "authorization" not in backup_headers


@pytest.mark.anyio
async def test_a_post_on_a_store_route_is_told_where_replayable_methods_can_be_set(
    store_url: str, tmp_path: Path
) -> None:
    # A platform team's store route: a POST the primary answers 503 is a 502 whose message
    # said 'add "POST" to its replayable_methods', which no admin verb can do (a store
    # route keeps the defaults). It says to define the route in the config file; done so
    # (removed from the store, the same route in the file with POST replayable), the POST
    # fails over.
    async with failing_chat_route(store_url) as (base, backup):
        assert (await cli("routes", "set-fallback", *base, "--upstream", backup.url))[0] == 0
        gateway = Gateway(host_app, config=gateway_config(store_url))
        try:
            async with client_for(gateway) as client:
                refused = await client.post("/api/chat", content=b"{}")
        finally:
            await gateway.aclose()
        primary = (await open_store(store_url).load_routes())[0].upstreams["chat-primary"].url
        assert (await cli("routes", "remove", *base))[0] == 0
        config = tmp_path / "gateway.toml"
        config.write_text(
            f'[gateway]\nstore = "{store_url}"\n[gateway.breaker]\nmin_calls = 1000000\n'
            f'[upstreams.p]\nurl = "{primary}"\n[upstreams.b]\nurl = "{backup.url}"\n'
            '[[routes]]\nid = "chat"\nprefix = "/api/"\nplan = ["p", "b"]\nretries = 1\n'
            'replayable_methods = ["GET", "POST"]\n',
            encoding="utf-8",
        )
        gateway = Gateway(host_app, config=str(config))
        try:
            async with client_for(gateway) as client:
                followed = await client.post("/api/chat", content=b"{}")
        finally:
            await gateway.aclose()
    error = refused.json()["error"]
    assert (refused.status_code, error["rule"]) == (502, "not_replayable_method")
    assert (
        "(a store route, added with fallback-mw routes add, keeps the default "
        "replayable_methods: define the route in the config file to set them)"
    ) in error["message"], error["message"]
    assert (followed.status_code, followed.text) == (200, "backup")


@pytest.mark.anyio
async def test_a_hang_cut_by_the_deadline_on_a_store_route_is_not_told_to_lower_its_timer(
    store_url: str, tmp_path: Path
) -> None:
    # A store route's upstreams keep the default first_byte_timeout_ms (30000 ms), which
    # no admin verb sets. With [gateway] deadline_ms = 500, a hanging primary is cut by the
    # deadline; the 504 said "lower that below 500 ms ... or raise [gateway] deadline_ms
    # (or set the route's deadline_ms)", neither of which a store route can do but the
    # gateway-wide deadline. It says so; defined in the config file with the timer
    # lowered, as it says, the hang fails over.
    async with silent_server() as (hanging, _), upstream(status_handler(200, b"b")) as backup:
        base = ["--store", store_url, "--id", "chat", "--prefix", "/api/"]
        status, _, err = await cli(
            "routes", "add", *base, "--upstream", hanging, "--retries", "1",
            "--fallback", backup.url,
        )  # fmt: skip
        assert status == 0, err
        gateway = Gateway(host_app, config=gateway_config(store_url, gateway={"deadline_ms": 500}))
        try:
            async with client_for(gateway) as client:
                cut = await client.get("/api/models")
                shortened = await client.get(
                    "/api/models", headers={"x-gateway-deadline-ms": "300"}
                )
        finally:
            await gateway.aclose()
        assert (await cli("routes", "remove", "--store", store_url, "--id", "chat"))[0] == 0
        config = tmp_path / "gateway.toml"
        config.write_text(
            f'[gateway]\nstore = "{store_url}"\ndeadline_ms = 500\n'
            f'[upstreams.p]\nurl = "{hanging}"\nfirst_byte_timeout_ms = 200\n'
            f'[upstreams.b]\nurl = "{backup.url}"\n'
            '[[routes]]\nid = "chat"\nprefix = "/api/"\nplan = ["p", "b"]\nretries = 1\n',
            encoding="utf-8",
        )
        gateway = Gateway(host_app, config=str(config))
        try:
            async with client_for(gateway) as client:
                followed = await client.get("/api/models")
        finally:
            await gateway.aclose()
    error = cut.json()["error"]
    assert (cut.status_code, error["rule"]) == (504, "deadline")
    assert error["message"].endswith(
        "raise [gateway] deadline_ms above 30000 ms; a store route's upstreams keep their "
        "default timers (no admin verb sets them): to lower one below the deadline, define "
        "the route in the config file"
    ), error["message"]
    message = shortened.json()["error"]["message"]
    assert "raise [gateway] deadline_ms above 30000 ms" in message, message
    assert "define the route in the config file" in message and "lower that" not in message
    assert (followed.status_code, followed.text) == (200, "b")


@pytest.mark.anyio
@pytest.mark.parametrize("own", ["route_deadline", "upstream_timer"])
async def test_a_file_route_keeping_the_store_names_is_not_told_it_is_a_store_route(
    tmp_path: Path, own: str
) -> None:
    # The operator moved a store route into the config file, as the 504 above says to,
    # keeping its upstream names (chat-primary, chat-fallback: the names its faults and
    # dashboards know) and setting what the store could not: the route's deadline_ms, or an
    # upstream's timer. Judged by its names alone it was still "a store route": the 504
    # said to raise [gateway] deadline_ms (or the route's) and to define the route in the
    # config file, where it already is. It is told what a file route is told.
    route_deadline = own == "route_deadline"
    async with silent_server() as (hanging, _), upstream(status_handler(200, b"b")) as backup:
        config = tmp_path / "gateway.toml"
        config.write_text(
            f"[gateway]\ndeadline_ms = {30_000 if route_deadline else 500}\n"
            f'[upstreams.chat-primary]\nurl = "{hanging}"\n'
            + ("" if route_deadline else "first_byte_timeout_ms = 40000\n")
            + f'[upstreams.chat-fallback]\nurl = "{backup.url}"\n'
            '[[routes]]\nid = "chat"\nprefix = "/api/"\nretries = 1\n'
            'plan = ["chat-primary", "chat-fallback"]\n'
            + ("deadline_ms = 500\n" if route_deadline else ""),
            encoding="utf-8",
        )
        gateway = Gateway(host_app, config=str(config))
        try:
            async with client_for(gateway) as client:
                cut = await client.get("/api/models")
        finally:
            await gateway.aclose()
    error = cut.json()["error"]
    assert (cut.status_code, error["rule"]) == (504, "deadline")
    assert "store route" not in error["message"], error["message"]
    expected = (
        "lower that below 500 ms so that a hang ends in time for the next attempt, or raise "
        + (
            "the route's deadline_ms above 30000 ms"
            if route_deadline
            else "[gateway] deadline_ms (or set the route's deadline_ms) above 40000 ms"
        )
    )
    assert error["message"].endswith(expected), error["message"]


BAD_FALLBACKS = {
    "no_retries": (
        ["--fallback", "http://127.0.0.1:9002"],
        # The flag to add, not the loader's "set retries >= 1" (--retries defaults to 0).
        "so its --fallback could never be reached: add --retries 1 (or more)",
    ),
    "equal_to_primary": (
        ["--retries", "1", "--fallback", "http://127.0.0.1:9001/"],
        "primary's own endpoint",
    ),
    "allowlist_refuses": (
        ["--retries", "1", "--fallback", "http://10.1.2.3:9002"],
        "not in allow_hosts",
    ),
    "credentials_without_fallback": (
        ["--retries", "1", "--fallback-auth-env", "BACKUP_KEY"],
        "without --fallback",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_FALLBACKS))
def test_bad_fallbacks_are_refused_and_nothing_is_stored(store_url: str, case: str) -> None:
    extra, message = BAD_FALLBACKS[case]
    status, out, err = run_cli(
        "routes", "add", "--store", store_url, "--id", "chat", "--prefix", "/api/",
        "--upstream", "http://127.0.0.1:9001", *extra,
    )  # fmt: skip
    assert status == 2
    assert message in err and "chat" in err
    status, out, _ = run_cli("routes", "list", "--store", store_url)
    assert status == 0
    assert out == "no routes\n"


def test_set_fallback_refusals_leave_the_stored_route_alone(store_url: str) -> None:
    base = ["--store", store_url, "--id", "chat"]
    assert (
        run_cli("routes", "add", *base, "--prefix", "/a/", "--upstream", "http://127.0.0.1:1")[0]
        == 0
    )
    # retries = 0: a fallback could never be reached.
    status, _, err = run_cli("routes", "set-fallback", *base, "--upstream", "http://127.0.0.1:2")
    assert status == 2 and "could never be reached" in err
    status, _, err = run_cli(
        "routes", "set-fallback", *base, "--upstream", "http://169.254.169.254/latest"
    )
    assert status == 2 and "metadata" in err
    # A malformed credential variable name: refused, whatever the shell holds.
    status, _, err = run_cli(
        "routes", "set-fallback", *base, "--upstream", "http://127.0.0.1:2",
        "--auth-env", "NOT-A-NAME",
    )  # fmt: skip
    assert status == 2 and "auth_env is not a valid environment variable name" in err
    assert "NOT-A-NAME" not in err  # a malformed "name" is often the key itself: never echoed
    # A variable not set in this shell: refused only with --check-env (named, no value).
    status, _, err = run_cli(
        "routes", "set-fallback", *base, "--upstream", "http://127.0.0.1:2",
        "--auth-header", "x-custom-key", "--auth-env", "FMW_TEST_UNSET_KEY", "--check-env",
    )  # fmt: skip
    assert status == 2 and "FMW_TEST_UNSET_KEY is not set" in err
    assert err.count("\n") == 1 and err.startswith("fallback-mw: error: ")
    _, out, _ = run_cli("routes", "list", "--store", store_url)
    assert "chat-fallback" not in out and "chat-primary=http://127.0.0.1:1" in out


def test_the_admin_shell_needs_no_secrets(store_url: str) -> None:
    # SPEC §10: without --check-env only the variable's name is checked; it is stored.
    base = ["--store", store_url, "--id", "chat"]
    status, out, err = run_cli(
        "routes", "add", *base, "--prefix", "/a/", "--upstream", "http://127.0.0.1:1",
        "--auth-env", "FMW_TEST_UNSET_KEY", "--retries", "1",
        "--fallback", "http://127.0.0.1:2", "--fallback-auth-env", "FMW_TEST_UNSET_BACKUP",
    )  # fmt: skip
    # Nothing said about the unset variables (a warning about the route's timeouts may be).
    assert status == 0 and "FMW_TEST_UNSET" not in err and "error" not in err, err
    assert out == "route 'chat' added: chat-primary -> chat-fallback\n"
    _, out, _ = run_cli("routes", "list", "--store", store_url)
    assert "(env FMW_TEST_UNSET_KEY)" in out and "(env FMW_TEST_UNSET_BACKUP)" in out


def test_routes_add_with_a_tenant(store_url: str) -> None:
    status, out, err = run_cli(
        "routes", "add", "--store", store_url, "--id", "acme-chat", "--prefix", "/v1/",
        "--tenant", "acme", "--upstream", "http://127.0.0.1:1",
    )  # fmt: skip
    assert status == 0, err
    assert out == "route 'acme-chat' added (tenant acme): acme-chat-primary\n"
    _, out, _ = run_cli("routes", "list", "--store", store_url)
    assert out.startswith("acme-chat\tstore\t/v1/\ttenant=acme\tretries=0\t")


@pytest.mark.parametrize("tenant", ["", " acme", "acme ", "a\nb", "a\tb", "a\x7fb", "a\x9bb"])
def test_a_tenant_no_request_can_carry_is_refused(store_url: str, tenant: str) -> None:
    # The tenant header's value is stripped and an empty one is tenant "default": these
    # routes could never serve, and a line break split the one-line-per-route listing.
    status, out, err = run_cli(
        "routes", "add", "--store", store_url, "--id", "t", "--prefix", "/v1/",
        "--tenant", tenant, "--upstream", "http://127.0.0.1:1",
    )  # fmt: skip
    assert (status, out) == (2, "") and "tenant" in err and len(err.splitlines()) == 1
    assert run_cli("routes", "list", "--store", store_url)[1] == "no routes\n"
    file_route = {"id": "t", "prefix": "/v1/", "plan": ["p"], "tenant": tenant}
    config = {"upstreams": {"p": {"url": "http://127.0.0.1:1"}}, "routes": [file_route]}
    with pytest.raises(ConfigError, match="tenant"):
        load_config(config)


@pytest.mark.parametrize("prefix", ["/f/ x", "/api/ ", "/a\nb/", "/a\tb/", "/a\x7fb", "/a\xa0b"])
def test_a_prefix_with_a_space_or_control_character_is_refused(store_url: str, prefix: str) -> None:
    # `routes add --prefix "/f/ x"` (a quoting slip) was stored and served only paths
    # spelled `/f/%20x...`; a line break split the one-line-per-route listing.
    status, out, err = run_cli(
        "routes", "add", "--store", store_url, "--id", "p", "--prefix", prefix,
        "--upstream", "http://127.0.0.1:1",
    )  # fmt: skip
    assert (status, out) == (2, "") and "prefix" in err and len(err.splitlines()) == 1
    assert "no spaces or control characters" in err
    assert run_cli("routes", "list", "--store", store_url)[1] == "no routes\n"
    file_route = {"id": "p", "prefix": prefix, "plan": ["u"]}
    config = {"upstreams": {"u": {"url": "http://127.0.0.1:1"}}, "routes": [file_route]}
    with pytest.raises(ConfigError, match="no spaces or control characters"):
        load_config(config)


@pytest.mark.anyio
async def test_a_tenant_route_serves_only_its_tenant(store_url: str) -> None:
    async with upstream(status_handler(200, b"acme only")) as target:
        status, _, err = await cli(
            "routes", "add", "--store", store_url, "--id", "acme-chat", "--prefix", "/v1/",
            "--tenant", "acme", "--upstream", target.url,
        )  # fmt: skip
        assert status == 0, err
        gateway = Gateway(host_app, config=gateway_config(store_url), environ={})
        try:
            async with client_for(gateway) as client:
                mine = await client.get("/v1/x", headers={"x-tenant-id": "acme"})
                other = await client.get("/v1/x", headers={"x-tenant-id": "globex"})
                anonymous = await client.get("/v1/x")
        finally:
            await gateway.aclose()
    assert mine.status_code == 200 and mine.text == "acme only"
    assert other.text == "host app" and anonymous.text == "host app"
    assert target.count == 1


def test_config_file_refusals(tmp_path: Path, store_url: str) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text(
        f"""
[gateway]
store = "{store_url}"
allow_hosts = ["127.0.0.1"]

[upstreams.primary]
url = "http://127.0.0.1:9001"
auth_env = "NOT_SET_IN_THE_ADMIN_SHELL"

[[routes]]
id = "chat"
prefix = "/v1/"
plan = ["primary"]
""",
        encoding="utf-8",
    )
    # The config's store is used; an id the file defines is refused; nothing stored.
    status, _, err = run_cli(
        "routes", "add", "--config", str(config), "--id", "chat", "--prefix", "/api/",
        "--upstream", "http://127.0.0.1:9005",
    )  # fmt: skip
    assert status == 2 and "both in the config file and in the store" in err
    status, out, _ = run_cli("routes", "list", "--config", str(config))
    assert status == 0 and "\tstore\t" not in out and out.startswith("chat\tfile")
    # A route the file owns cannot be edited from the store.
    status, _, err = run_cli("routes", "remove", "--config", str(config), "--id", "chat")
    assert status == 2 and "config file" in err
    # No store at all.
    status, _, err = run_cli("routes", "list")
    assert status == 2 and "--store" in err
    # Adding the same id twice is refused.
    add = ["routes", "add", "--store", store_url, "--id", "x", "--prefix", "/x/"]
    assert run_cli(*add, "--upstream", "http://127.0.0.1:9006")[0] == 0
    status, _, err = run_cli(*add, "--upstream", "http://127.0.0.1:9007")
    assert status == 2 and "already exists" in err


@pytest.mark.anyio
async def test_sqlite_hot_reload_and_refused_reload(store_url: str) -> None:
    async with failing_chat_route(store_url) as (base, backup):
        gateway = Gateway(host_app, config=gateway_config(store_url), environ={})
        runtime = gateway.services.store
        assert runtime is not None
        runtime.poll_interval = 0.05
        transport = httpx.ASGITransport(app=gateway)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:

                async def provider() -> str | None:
                    # No fallback: the failing primary alone gives 502 upstream_failed.
                    response = await client.get("/api/x")
                    if response.status_code == 502:
                        assert response.json()["error"]["code"] == "upstream_failed"
                        return "chat-primary"
                    return response.headers.get("x-gateway-provider")

                assert await provider() == "chat-primary"
                assert (await cli("routes", "set-fallback", *base, "--upstream", backup.url))[
                    0
                ] == 0
                assert await wait_for(provider, "chat-fallback")
                assert (await cli("routes", "clear-fallback", *base))[0] == 0
                assert await wait_for(provider, "chat-primary")

                # A store change the gateway would refuse: the running routes stay.
                store = open_store(store_url)
                good = (await store.load_routes())[0]
                bad_route = good.route.model_copy(update={"plan": ("chat-primary", "nowhere")})
                await store.replace_route(StoredRoute(route=bad_route, upstreams=good.upstreams))
                await store.aclose()

                async def refusal() -> bool:
                    return runtime.last_refusal is not None

                assert await wait_for(refusal, True)
                assert runtime.last_refusal is not None
                assert "unknown upstream 'nowhere'" in runtime.last_refusal
                assert await provider() == "chat-primary"

                assert (await cli("routes", "remove", *base))[0] == 0

                async def unrouted() -> tuple[int, str]:
                    response = await client.get("/api/x")
                    return response.status_code, response.text

                # The route is gone within a poll or two (0.05 s): the host app answers.
                assert await wait_for(unrouted, (404, "host app"))
        finally:
            await gateway.aclose()


async def wait_for(probe: Any, expected: Any, within: float = 15.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if await probe() == expected:
            return True
        await asyncio.sleep(0.02)
    return False


def test_faults_verbs(store_url: str) -> None:
    s = ["--store", store_url]
    assert run_cli("faults", "set", "fail", *s, "--upstream", "primary", "--ttl", "600")[0] == 0
    assert run_cli("faults", "set", "hang", *s, "--upstream", "other", "--ttl", "600")[0] == 0
    pin = ["faults", "set", "pin", *s, "--route", "chat", "--candidate", "backup", "--ttl", "60"]
    assert run_cli(*pin)[0] == 0
    status, out, _ = run_cli("faults", "list", *s)
    assert status == 0
    lines = out.splitlines()
    assert len(lines) == 3
    assert any(line.startswith("fail\tupstream=primary") for line in lines)
    assert any(line.startswith("pin\troute=chat\tcandidate=backup") for line in lines)
    # Refusals: no ttl sense, pin without a candidate, fail with a route.
    assert run_cli("faults", "set", "fail", *s, "--upstream", "p", "--ttl", "0")[0] == 2
    assert run_cli("faults", "set", "pin", *s, "--route", "chat", "--ttl", "5")[0] == 2
    assert run_cli("faults", "set", "fail", *s, "--route", "chat", "--ttl", "5")[0] == 2
    assert run_cli("faults", "clear", *s, "--upstream", "primary") == (
        0,
        "1 fault(s) cleared\n",
        "",
    )
    # SPEC §10: a bare `faults clear` is refused (exit 2, one line), clearing nothing.
    status, out, err = run_cli("faults", "clear", *s)
    assert (status, out) == (2, "")
    assert err == (
        "fallback-mw: error: faults clear: "
        "one of the arguments --upstream --route --all is required\n"
    )
    assert len(run_cli("faults", "list", *s)[1].splitlines()) == 2
    assert run_cli("faults", "clear", *s, "--all")[1] == "2 fault(s) cleared\n"
    assert run_cli("faults", "list", *s)[1] == "no faults\n"


def test_faults_set_prints_the_expiry_it_stored(store_url: str) -> None:
    before = time.time()
    status, out, err = run_cli(
        "faults", "set", "hang", "--store", store_url, "--upstream", "p", "--ttl", "600"
    )
    after = time.time()
    assert status == 0, err
    printed = expires_at(out)
    assert before + 600 <= printed + 0.001 and printed <= after + 600
    # The ISO time and the epoch say the same thing, and `faults list` shows that expiry.
    iso = out.split(" until ")[1].split(" ")[0]
    assert abs(datetime.fromisoformat(iso).timestamp() - printed) < 0.001
    listed = run_cli("faults", "list", "--store", store_url)[1]
    assert expires_at(listed) == printed


def expires_at(output: str) -> float:
    """The epoch expiry `faults set` / `faults list` printed."""
    return float(output.split("expires_at=")[1].split(")")[0])


def test_a_store_route_may_use_a_custom_auth_header(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FMW_TEST_CUSTOM_KEY", "sk-custom")
    status, _, err = run_cli(
        "routes", "add", "--store", store_url, "--id", "c", "--prefix", "/c/",
        "--upstream", "http://127.0.0.1:9008", "--auth-header", "x-custom-key",
        "--auth-env", "FMW_TEST_CUSTOM_KEY",
    )  # fmt: skip
    assert (status, err) == (0, "")
    _, out, _ = run_cli("routes", "list", "--store", store_url)
    assert "c-primary=http://127.0.0.1:9008" in out
    assert "sk-custom" not in out


@pytest.mark.anyio
async def test_a_callers_copy_of_a_store_upstreams_auth_header_is_stripped(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FMW_TEST_CUSTOM_KEY", "sk-custom-real")
    async with upstream(status_handler(200)) as target:
        status, _, err = await cli(
            "routes", "add", "--store", store_url, "--id", "c", "--prefix", "/c/",
            "--upstream", target.url, "--auth-header", "x-custom-key",
            "--auth-env", "FMW_TEST_CUSTOM_KEY",
        )  # fmt: skip
        assert status == 0, err
        gateway = Gateway(host_app, config=gateway_config(store_url))
        async with client_for(gateway) as client:
            response = await client.get("/c/x", headers={"x-custom-key": "caller-forged"})
        await gateway.aclose()
    assert response.status_code == 200
    sent = [v for n, v in target.received[0].headers if n == "x-custom-key"]
    assert sent == ["sk-custom-real"]


def test_remove_repairs_a_store_route_whose_id_the_file_defines(
    tmp_path: Path, store_url: str
) -> None:
    # `routes add --store` cannot see the file, so it stores an id the file defines; every
    # gateway then refuses its reloads. The operator's usual `--config` must remove it.
    config = tmp_path / "gateway.toml"
    config.write_text(
        f"""
[gateway]
store = "{store_url}"

[upstreams.primary]
url = "http://127.0.0.1:9001"

[[routes]]
id = "chat"
prefix = "/v1/"
plan = ["primary"]
""",
        encoding="utf-8",
    )
    add = ["routes", "add", "--store", store_url, "--id", "chat", "--prefix", "/api/"]
    assert run_cli(*add, "--upstream", "http://127.0.0.1:9005")[0] == 0
    remove = ["routes", "remove", "--config", str(config), "--id", "chat"]
    assert run_cli(*remove) == (0, "route 'chat' removed\n", "")
    status, out, _ = run_cli("routes", "list", "--config", str(config))
    assert status == 0 and out == "chat\tfile\t/v1/\tretries=0\tprimary=http://127.0.0.1:9001\n"
    # Now only the file defines it: refused as before, nothing to remove.
    status, _, err = run_cli(*remove)
    assert status == 2 and "defined in the config file" in err


def test_routes_list_shows_what_it_can_and_says_what_the_gateways_refuse(
    tmp_path: Path, store_url: str
) -> None:
    # An operator looking at the store during an outage saw either nothing at all (one
    # record that does not load: `routes list` failed, exit 2, listing no route) or a calm
    # list of routes the gateways were not serving (a store route whose id the file
    # defines: every reload refused). Now the list shows every route that loads, and one
    # warning line says what the gateways refuse and how to take it out.
    config = tmp_path / "gateway.toml"
    config.write_text(
        f'[gateway]\nstore = "{store_url}"\n[upstreams.primary]\nurl = "http://127.0.0.1:9001"\n'
        '[[routes]]\nid = "chat"\nprefix = "/v1/"\nplan = ["primary"]\n',
        encoding="utf-8",
    )
    add = ["routes", "add", "--store", store_url, "--prefix", "/api/"]
    assert run_cli(*add, "--id", "items", "--upstream", "http://127.0.0.1:9005")[0] == 0
    assert run_cli(*add, "--id", "broken", "--upstream", "http://127.0.0.1:9006")[0] == 0
    path = store_url.removeprefix("sqlite:///")
    with sqlite_db(path) as conn:
        conn.execute("UPDATE fmw_routes SET doc = '{\"route\": 1}' WHERE id = 'broken'")
    items = "items\tstore\t/api/\tretries=0\titems-primary=http://127.0.0.1:9005\n"
    assert run_cli("routes", "list", "--store", store_url) == (
        0,
        items,
        "fallback-mw: warning: stored route 'broken': unreadable record (`fallback-mw routes "
        "remove --id broken` takes it out); not listed: every gateway refuses the store "
        "while it is there\n",
    )
    assert run_cli("routes", "remove", "--store", store_url, "--id", "broken")[0] == 0
    # Stored with --store alone, which cannot see the file: the gateways refuse it.
    assert run_cli(*add, "--id", "chat", "--upstream", "http://127.0.0.1:9007")[0] == 0
    status, out, err = run_cli("routes", "list", "--config", str(config))
    assert status == 0 and out.count("\n") == 3, out
    assert err == (
        "fallback-mw: warning: the gateways refuse the store as it now is (route 'chat' is "
        "defined both in the config file and in the store) and keep their running routes: "
        "the store routes listed are not what they serve until that route is fixed or "
        "removed\n"
    )
    assert run_cli("routes", "remove", "--config", str(config), "--id", "chat")[0] == 0
    assert run_cli("routes", "list", "--config", str(config))[2] == ""
    # A variable the gateways lack, seen from a shell with their environment (--check-env).
    keyed = ["--upstream", "http://127.0.0.1:9008", "--auth-env", "FXBC_UNSET_KEY"]
    assert run_cli(*add, "--id", "keyed", *keyed)[0] == 0
    assert run_cli("routes", "list", "--store", store_url)[2] == ""
    status, out, err = run_cli("routes", "list", "--store", store_url, "--check-env")
    assert status == 0 and "keyed\tstore" in out
    assert err == (
        "fallback-mw: warning: the gateways refuse the store as it now is (route 'keyed', "
        "upstream 'keyed-primary': environment variable FXBC_UNSET_KEY is not set in this "
        "shell) and keep their running routes: the store routes listed are not what they "
        "serve until that route is fixed or removed\n"
    )


def test_a_fault_is_set_while_a_store_record_does_not_load(store_url: str) -> None:
    # A record that does not load stops the gateways' route reloads, not their faults: they
    # still apply a fault set now. `faults set` read every route's names first and failed
    # on that record (exit 2): a game day's or an emergency's pin could not be set at all.
    add = ["routes", "add", "--store", store_url, "--prefix", "/api/", "--retries", "1"]
    urls = ["--upstream", "http://127.0.0.1:9005", "--fallback", "http://127.0.0.1:9006"]
    assert run_cli(*add, "--id", "chat", *urls)[0] == 0
    assert run_cli(*add, "--id", "broken", *urls)[0] == 0
    with sqlite_db(store_url.removeprefix("sqlite:///")) as conn:
        conn.execute("UPDATE fmw_routes SET doc = 'not json' WHERE id = 'broken'")
    pin = ["faults", "set", "pin", "--store", store_url, "--ttl", "600"]
    status, out, err = run_cli(*pin, "--route", "chat", "--candidate", "chat-fallback")
    assert status == 0 and out.startswith("fault set: pin route 'chat' to 'chat-fallback'"), err
    assert err == ""
    status, out, _ = run_cli("faults", "list", "--store", store_url)
    assert status == 0 and out.startswith("pin\troute=chat\tcandidate=chat-fallback"), out


def test_routes_add_warns_when_a_route_takes_another_ones_traffic(
    tmp_path: Path, store_url: str
) -> None:
    # A store route added at a file route's prefix took all of that route's traffic (the
    # route table's tie-break is the id, and 'api' sorts before 'orders') while `routes add`
    # said only "added"; `check` would have warned. The route is still stored (the loader
    # accepts it too), with a warning naming the route that no request can reach any more.
    config = tmp_path / "gateway.toml"
    config.write_text(
        f"""
[gateway]
store = "{store_url}"

[upstreams.orders-svc]
url = "http://127.0.0.1:9001"

[[routes]]
id = "orders"
prefix = "/orders/"
plan = ["orders-svc"]
""",
        encoding="utf-8",
    )
    add = ["routes", "add", "--config", str(config), "--upstream", "http://127.0.0.1:9002"]
    status, out, err = run_cli(*add, "--id", "api", "--prefix", "/orders/")
    assert (status, out) == (0, "route 'api' added: api-primary\n")
    assert err == (
        "fallback-mw: warning: route 'orders': no request can reach this route: 'api' (same "
        "prefix and tenant, first in the route table) takes every method it accepts; give it "
        "another prefix, tenant or methods, or remove it\n"
    )
    # Added behind the file route, the new one is the unreachable one.
    status, _, err = run_cli(*add, "--id", "zz", "--prefix", "/orders/")
    assert status == 0 and err.startswith("fallback-mw: warning: route 'zz': no request")
    assert run_cli(*add, "--id", "other", "--prefix", "/other/") == (
        0,
        "route 'other' added: other-primary\n",
        "",
    )


def test_routes_add_and_set_fallback_say_what_check_would_warn_about(
    tmp_path: Path, store_url: str
) -> None:
    # A new operator ran SPEC §10's `routes add ... --retries 1 --fallback URL` and was told
    # only "added": the stored route's primary keeps the default first_byte_timeout_ms
    # (30000) behind the default 5000 ms deadline, so a hung primary ends in 504 and never
    # reaches the fallback; and `--prefix /api` (no trailing '/') also took /apix/... Both
    # are valid, so stored, but `check` warns about them: the verb that stored the route
    # says so too, with a remedy an operator of a store route can apply.
    s = ["--store", store_url]
    status, out, err = run_cli(
        "routes", "add", *s, "--id", "chat", "--prefix", "/api", "--upstream",
        "http://127.0.0.1:9001", "--retries", "1", "--fallback", "http://127.0.0.1:9002",
    )  # fmt: skip
    assert (status, out) == (0, "route 'chat' added: chat-primary -> chat-fallback\n")
    lines = err.splitlines()
    assert len(lines) == 2, err
    assert lines[0].startswith("fallback-mw: warning: route 'chat': the route prefix /api is ")
    assert "end it with '/' (/api/)" in lines[0]
    assert lines[1].startswith(
        "fallback-mw: warning: route 'chat': candidate 'chat-primary' has first_byte_timeout_ms "
        "30000, not below the route deadline (5000 ms)"
    )
    # The store route's timeout cannot be set from the CLI: the remedy is the deadline.
    assert "raise [gateway] deadline_ms above 30000" in lines[1], lines[1]
    # check says the same about the stored route.
    config = tmp_path / "gateway.toml"
    config.write_text(f'[gateway]\nstore = "{store_url}"\n', encoding="utf-8")
    status, out, _ = run_cli("check", "--config", str(config))
    assert status == 0 and "raise [gateway] deadline_ms above 30000" in out
    # set-fallback on a route whose deadline leaves the timeout room: no warning.
    config.write_text(f'[gateway]\nstore = "{store_url}"\ndeadline_ms = 60000\n', encoding="utf-8")
    c = ["--config", str(config)]
    assert run_cli("routes", "remove", *c, "--id", "chat")[0] == 0
    add = ["routes", "add", *c, "--id", "chat", "--prefix", "/api/", "--retries", "1"]
    assert run_cli(*add, "--upstream", "http://127.0.0.1:9001") == (
        0, "route 'chat' added: chat-primary\n", ""
    )  # fmt: skip
    assert run_cli(
        "routes", "set-fallback", *c, "--id", "chat", "--upstream", "http://127.0.0.1:9002"
    ) == (0, "route 'chat': fallback set (chat-primary -> chat-fallback), retries 1\n", "")
    # With the default deadline, set-fallback warns as add does.
    status, _, err = run_cli(
        "routes", "set-fallback", *s, "--id", "chat", "--upstream", "http://127.0.0.1:9003"
    )
    assert status == 0 and "candidate 'chat-primary' has first_byte_timeout_ms 30000" in err


def test_removing_a_store_route_clears_the_faults_on_it_and_its_upstreams(
    store_url: str,
) -> None:
    # A platform engineer pinned and failed a store route, removed it, and added it back
    # under the same id: the new route (same derived upstream names) inherited the old
    # route's `fail` fault and answered 502 to every request. A removed route's faults (its
    # pin, its upstreams' faults) go with it; `clear-fallback` likewise takes the faults of
    # the fallback it drops (and a pin to it). Faults on anything else stay.
    s = ["--store", store_url]
    add = ["routes", "add", *s, "--id", "items", "--prefix", "/items/", "--retries", "1"]
    urls = ["--upstream", "http://127.0.0.1:9001", "--fallback", "http://127.0.0.1:9002"]
    assert run_cli(*add, *urls)[0] == 0
    ttl = ["--ttl", "600"]
    for fault in (
        ["pin", "--route", "items", "--candidate", "items-fallback"],
        ["fail", "--upstream", "items-primary"],
        ["hang", "--upstream", "items-fallback"],
        ["fail", "--upstream", "other"],
    ):
        assert run_cli("faults", "set", fault[0], *s, *fault[1:], *ttl)[0] == 0
    assert run_cli("routes", "clear-fallback", *s, "--id", "items") == (
        0,
        "route 'items': fallback cleared (items-primary only); "
        "2 fault(s) on items-fallback cleared\n",
        "",
    )
    assert run_cli("routes", "remove", *s, "--id", "items") == (
        0,
        "route 'items' removed; 1 fault(s) on it cleared\n",
        "",
    )
    status, out, _ = run_cli("faults", "list", *s)
    assert status == 0 and [line.split("\t")[:2] for line in out.splitlines()] == [
        ["fail", "upstream=other"]
    ]
    # Added back, the route starts clean.
    assert run_cli(*add, *urls)[0] == 0
    assert run_cli("faults", "list", *s)[1].count("\n") == 1


@pytest.mark.anyio
async def test_faults_set_with_store_alone_warns_about_a_name_the_store_does_not_know(
    store_url: str,
) -> None:
    # With --store alone the file's upstreams are invisible, so a typo ('primray') cannot be
    # refused; it is stored (a file's upstream may be meant) with a warning naming what the
    # store knows. A name no upstream or route can have is refused, whatever the store.
    async with failing_chat_route(store_url):
        s = ["--store", store_url]
        status, out, err = await cli(
            "faults", "set", "fail", *s, "--upstream", "primray", "--ttl", "60"
        )
        assert status == 0 and out.startswith("fault set: fail upstream 'primray'")
        assert err == (
            "fallback-mw: warning: upstream 'primray' is not in the store (it has: "
            "chat-primary); a config file's names cannot be checked with --store alone: "
            "pass --config FILE to check it\n"
        )
        known = await cli("faults", "set", "fail", *s, "--upstream", "chat-primary", "--ttl", "60")
        assert known[0] == 0 and known[2] == ""
        pin = ["faults", "set", "pin", *s, "--candidate", "chat-primary", "--ttl", "60"]
        status, _, err = await cli(*pin, "--route", "caht")
        assert status == 0 and "warning: route 'caht' is not a store route (it has: chat)" in err
        for odd in (["--upstream", "a\nb"], ["--upstream", "x y"]):
            status, out, err = await cli("faults", "set", "hang", *s, *odd, "--ttl", "60")
            assert (status, out) == (2, "") and "upstream id" in err and "not allowed" in err
        status, _, err = await cli(*pin[:-2], "--route", "c\td", "--ttl", "60")
        assert status == 2 and "route id" in err
        listed = (await cli("faults", "list", *s))[1].splitlines()
        assert len(listed) == 3, listed


def test_a_route_id_too_long_for_its_derived_upstream_names_is_refused_clearly(
    store_url: str,
) -> None:
    # A route id may have 128 characters, but `<id>-fallback` must fit in 128 too: the
    # refusal names the route id's own limit, not an upstream id the operator never typed.
    add = ["routes", "add", "--store", store_url, "--prefix", "/x/"]
    status, out, err = run_cli(*add, "--id", "L" * 128, "--upstream", "http://127.0.0.1:1")
    assert (status, out) == (2, "")
    assert "the id is too long for the upstream names derived from it" in err
    assert "use at most 119 characters" in err and len(err.splitlines()) == 1
    status, out, err = run_cli(*add, "--id", "L" * 119, "--upstream", "http://127.0.0.1:1")
    assert status == 0, err
    fallback = ["--store", store_url, "--id", "L" * 119, "--upstream", "http://127.0.0.1:2"]
    assert run_cli("routes", "set-fallback", *fallback, "--retries", "1")[0] == 0


def test_a_relative_sqlite_store_from_another_directory_is_named_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`store = "sqlite:///gw.db"` resolves against the working directory (deployments rely
    on it): run from elsewhere, an admin verb says which file it uses and which one sits
    beside the config file, and how to name one file for all."""
    config = tmp_path / "gw.toml"
    config.write_text('[gateway]\nstore = "sqlite:///gw.db"\n', encoding="utf-8")
    other = tmp_path / "other"
    other.mkdir()
    monkeypatch.chdir(other)
    add = ["--config", "../gw.toml", "--id", "chat", "--prefix", "/api/"]
    status, out, err = run_cli("routes", "add", *add, "--upstream", "http://127.0.0.1:9001")
    assert status == 0 and "route 'chat' added" in out
    used, beside = (other / "gw.db").resolve(), (tmp_path / "gw.db").resolve()
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("fallback-mw: warning: "), err
    assert f"uses {used}," in lines[0] and f"not {beside} beside the config file" in lines[0]
    assert f'store = "sqlite:///{beside}"' in lines[0]  # sqlite:////abs/path.db
    assert used.exists() and not beside.exists()  # where it resolves is unchanged
    # A failure is still one line: the caveat joins it.
    status, _, err = run_cli("routes", "add", *add, "--upstream", "http://127.0.0.1:9001")
    assert status == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("fallback-mw: error: route 'chat' already exists in the store; note: ")
    assert f"uses {used}," in err
    # Every verb that takes the store from --config says so; --store names it: no warning.
    status, out, err = run_cli("routes", "list", "--config", "../gw.toml")
    assert status == 0 and out.startswith("chat\tstore") and f"uses {used}," in err
    status, _, err = run_cli("budgets", "show", "--config", "../gw.toml")
    assert status == 0 and err.count("fallback-mw: warning: ") == 1
    status, _, err = run_cli(
        "routes", "list", "--config", "../gw.toml", "--store", "sqlite:///gw.db"
    )
    assert status == 0 and err == ""
    # `check` says where the relative store resolves, and that it is not the file beside it.
    status, out, _ = run_cli("check", "--config", "../gw.toml")
    assert status == 0
    assert f"store sqlite:///gw.db (relative to the working directory: {used}): 1 route(s)" in out
    assert "  warning: ../gw.toml: store sqlite:///gw.db is relative" in out
    # From the config file's directory the two are one file: nothing to warn about.
    monkeypatch.chdir(tmp_path)
    here = ["--id", "here", "--prefix", "/here/", "--upstream", "http://127.0.0.1:9002"]
    status, _, err = run_cli("routes", "add", "--config", "gw.toml", *here)
    assert status == 0 and err == ""
    status, _, err = run_cli("routes", "list", "--config", "gw.toml")
    assert status == 0 and err == ""
    status, out, _ = run_cli("check", "--config", "gw.toml")
    assert f"(relative to the working directory: {beside}): 1 route(s)" in out
    assert "is relative to the working directory, not to the config file" not in out


@pytest.mark.parametrize(
    "verb",
    [["usage"], ["capacity"], ["budgets", "show"], ["routes", "list"], ["faults", "list"]],
)
def test_a_read_only_verb_on_a_store_file_that_is_not_there_creates_none_and_says_so(
    tmp_path: Path, verb: list[str]
) -> None:
    """A typo in the store's path (`--store sqlite:////tmp/typo.db`) is not answered with a
    fresh empty database and a calm "no traffic": nothing is created, one warning says
    there is no file, the report is the empty store's (exit status unchanged)."""
    typo = (tmp_path / "typo.db").resolve()
    status, _, err = run_cli(*verb, "--store", f"sqlite:///{typo}")
    assert status == 0
    assert err == (
        f"fallback-mw: warning: no store file at {typo}: nothing is recorded there yet "
        "(check the path; a gateway, `routes add`, `faults set` or `budgets set` creates it)\n"
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "verb",
    [
        ["usage"],
        ["capacity"],
        ["budgets", "show"],
        ["routes", "list"],
        ["faults", "list"],
        ["faults", "set", "fail", "--upstream", "primary", "--ttl", "60"],
    ],
)
def test_a_config_without_a_store_says_how_to_give_the_gateways_one(
    tmp_path: Path, verb: list[str]
) -> None:
    """A new user runs `serve --config gateway.toml` (no store: the README's config has
    none), then `fallback-mw usage --config gateway.toml`. The refusal said only "pass
    --store URL", naming no URL to pass: there is none, since the gateway kept its usage in
    its own memory. It says so, and what to add to the file."""
    config = tmp_path / "gateway.toml"
    config.write_text(
        '[upstreams.primary]\nurl = "http://127.0.0.1:9001"\n\n'
        '[[routes]]\nid = "chat"\nprefix = "/v1/"\nplan = ["primary"]\n',
        encoding="utf-8",
    )
    status, out, err = run_cli(*verb, "--config", str(config))
    assert status == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"fallback-mw: error: {config}: ")
    assert "[gateway] store is not set" in err
    # Where the records are instead, and the line to add to the file.
    assert "in its own memory" in err
    assert 'store = "sqlite:///gateway.db"' in err and "restart" in err
    assert list(tmp_path.iterdir()) == [config]


def test_only_the_verbs_that_store_something_create_a_missing_store_file(tmp_path: Path) -> None:
    typo = (tmp_path / "typo.db").resolve()
    store = ["--store", f"sqlite:///{typo}"]
    # Changing or removing what is not there fails as before, in one line with the reason.
    for verb in (
        ["routes", "remove", "--id", "chat"],
        ["routes", "clear-fallback", "--id", "chat"],
        ["faults", "clear", "--all"],
    ):
        status, _, err = run_cli(*verb, *store)
        assert len(err.splitlines()) == 1 and f"no store file at {typo}" in err, err
        assert status == (0 if verb[0] == "faults" else 1)
    config = tmp_path / "gw.toml"
    config.write_text(f'[gateway]\nstore = "sqlite:///{typo}"\n', encoding="utf-8")
    status, out, _ = run_cli("check", "--config", str(config))
    assert status == 0 and f"  warning: no store file at {typo}" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gw.toml"]
    # A writer creates it; then the readers say nothing more.
    status, _, err = run_cli("budgets", "set", *store, "--budget", "acme", "--limit", "5")
    assert status == 0 and err == "" and typo.exists()
    for verb in (["budgets", "show"], ["routes", "list"], ["faults", "list"], ["usage"]):
        status, _, err = run_cli(*verb, *store)
        assert status == 0 and err == "", (verb, err)
    for writer in (
        ["faults", "set", "fail", "--upstream", "x-primary", "--ttl", "60"],
        ["routes", "add", "--id", "x", "--prefix", "/x/", "--upstream", "http://127.0.0.1:9001"],
    ):
        other = tmp_path / f"{writer[0]}.db"
        status, _, err = run_cli(*writer, "--store", f"sqlite:///{other}")
        assert status == 0 and other.exists() and "no store file" not in err


def test_faults_clear_of_a_typo_during_a_game_day_is_refused_naming_the_known_ids(
    store_url: str,
) -> None:
    """`faults clear --upstream chat-primray` after a game day said "0 fault(s) cleared"
    and exited 0, while the fail fault on chat-primary went on failing requests. A name
    that holds no fault and that nothing knows is refused (exit 2, the CLI's usage errors),
    naming the known ids; nothing is cleared."""
    store = ["--store", store_url]
    status, out, _ = run_cli("faults", "set", "fail", *store, "--upstream", "chat-primary",
                             "--ttl", "600")  # fmt: skip
    assert status == 0
    status, out, err = run_cli("faults", "clear", *store, "--upstream", "chat-primray")
    assert (status, out) == (2, "")
    assert err == (
        "fallback-mw: error: unknown upstream 'chat-primray' (known upstreams: chat-primary; "
        "with --store alone a config file's names are not seen); nothing cleared\n"
    )
    assert run_cli("faults", "list", *store)[1].startswith("fail\tupstream=chat-primary\t")
    status, out, err = run_cli("faults", "clear", *store, "--route", "chat")
    assert status == 2 and "unknown route 'chat' (known routes: none;" in err, err
    status, out, err = run_cli("faults", "clear", *store, "--upstream", "chat-primary")
    assert (status, out, err) == (0, "1 fault(s) cleared\n", "")
    # Nothing active at all: a cleanup may run twice (--store alone cannot see every name).
    status, out, err = run_cli("faults", "clear", *store, "--upstream", "chat-primary")
    assert (status, out, err) == (0, "0 fault(s) cleared\n", "")


def test_faults_clear_of_a_fault_that_just_expired_is_no_typo(store_url: str) -> None:
    """A game day's cleanup with --store alone (`faults clear --upstream primary`, then
    `--upstream backup`) was refused at its first line ('unknown upstream', exit 2, nothing
    cleared) when primary's fault had just expired while backup's was active: the store
    still held primary's row, which the clear removes, and the script stopped there."""
    store = ["--store", store_url]
    status, out, _ = run_cli("faults", "set", "fail", *store, "--upstream", "primary",
                             "--ttl", "1")  # fmt: skip
    assert status == 0
    expires_at = float(out.rsplit("expires_at=", 1)[1].split(")")[0])
    status, _, _ = run_cli("faults", "set", "hang", *store, "--upstream", "backup",
                           "--ttl", "600")  # fmt: skip
    assert status == 0
    while time.time() < expires_at + 0.5:  # the expiry the store printed, passed
        time.sleep(0.1)
    assert "primary" not in run_cli("faults", "list", *store)[1]
    status, out, err = run_cli("faults", "clear", *store, "--upstream", "primary")
    assert (status, out) == (0, "1 fault(s) cleared\n"), err
    status, out, err = run_cli("faults", "clear", *store, "--upstream", "backup")
    assert (status, out, err) == (0, "1 fault(s) cleared\n", "")


def test_faults_clear_with_a_config_refuses_any_unknown_name(tmp_path: Path) -> None:
    """With --config every name is visible: an unknown one is refused even with nothing
    active; a known one without a fault clears nothing and says which faults are active."""
    db = tmp_path / "gw.db"
    config = tmp_path / "gw.toml"
    config.write_text(
        f'[gateway]\nstore = "sqlite:///{db}"\n'
        '[upstreams.primary]\nurl = "http://127.0.0.1:9001"\n'
        '[upstreams.backup]\nurl = "http://127.0.0.1:9002"\n'
        '[[routes]]\nid = "chat"\nprefix = "/v1/"\nplan = ["primary", "backup"]\nretries = 1\n',
        encoding="utf-8",
    )
    conf = ["--config", str(config)]
    assert run_cli("faults", "set", "fail", *conf, "--upstream", "primary", "--ttl", "60")[0] == 0
    assert run_cli("faults", "clear", *conf, "--all")[:2] == (0, "1 fault(s) cleared\n")
    status, out, err = run_cli("faults", "clear", *conf, "--upstream", "primray")
    assert (status, out) == (2, "")
    assert err == (
        "fallback-mw: error: unknown upstream 'primray' (known upstreams: backup, primary); "
        "nothing cleared\n"
    )
    status, out, err = run_cli("faults", "clear", *conf, "--route", "\x1b[2Jchat")
    assert status == 2 and "unknown route '?[2Jchat' (known routes: chat)" in err, err
    assert run_cli("faults", "set", "fail", *conf, "--upstream", "primary", "--ttl", "600")[0] == 0
    status, out, err = run_cli("faults", "clear", *conf, "--upstream", "backup")
    assert (status, out) == (0, "0 fault(s) cleared\n")
    assert err.startswith(
        "fallback-mw: warning: no active fault on upstream 'backup'; still active: "
        "fail upstream 'primary' until "
    ), err
    assert run_cli("faults", "clear", *conf, "--upstream", "primary")[:2] == (
        0,
        "1 fault(s) cleared\n",
    )


@pytest.mark.parametrize("verb", [["budgets", "show"], ["usage"]])
def test_a_ledger_verb_on_a_file_that_is_not_a_store_says_why(
    tmp_path: Path, verb: list[str]
) -> None:
    """`--store sqlite:///gw.toml` (the config file, by mistake): `routes list` said "cannot
    open the SQLite store gw.toml: file is not a database", the ledger's verbs only "SQLite
    ledger unavailable (DatabaseError)"."""
    config = tmp_path / "gw.toml"
    config.write_text('[gateway]\nstore = "sqlite:///gw.db"\n', encoding="utf-8")
    status, _, err = run_cli(*verb, "--store", f"sqlite:///{config}")
    assert status == 1 and len(err.splitlines()) == 1
    assert err == (
        f"fallback-mw: error: SQLite ledger {config} unavailable "
        "(DatabaseError: file is not a database)\n"
    )
    assert config.read_text(encoding="utf-8") == '[gateway]\nstore = "sqlite:///gw.db"\n'


def test_an_allowlist_refusal_under_store_alone_says_to_pass_the_config(
    store_url: str, tmp_path: Path
) -> None:
    """`routes add --store URL` (SPEC §10: the store or the config) to a provider host was
    refused 'add it to [gateway] allow_hosts', though this command had read no config file:
    the default allowlist (loopback) applied, and the way out is --config FILE, the
    gateway's own, whose allow_hosts lists the host."""
    add = [
        "routes",
        "add",
        "--id",
        "oa",
        "--prefix",
        "/oa/",
        "--upstream",
        "https://api.example.com",
    ]
    status, _, err = run_cli(*add, "--store", store_url)
    assert status == 2
    assert "not in allow_hosts" in err and "--config FILE" in err, err
    config = tmp_path / "gw.toml"
    config.write_text(
        f'[gateway]\nstore = "{store_url}"\nallow_hosts = ["api.example.com"]\n', encoding="utf-8"
    )
    status, _, err = run_cli(*add, "--config", str(config))
    assert status == 0, err
    other = ["--id", "ob", "--prefix", "/ob/", "--upstream", "https://other.example.com"]
    status, _, err = run_cli("routes", "add", *other, "--config", str(config))
    assert status == 2 and "not in allow_hosts" in err and "--config FILE" not in err, err


def test_a_record_holding_another_routes_id_is_refused_by_its_own_id(store_url: str) -> None:
    # A record written by hand under row 'a' whose route is 'x' was served as 'x': `routes
    # list` showed x, `routes remove --id x` answered "no route 'x' in the store", and two
    # such records were refused as "route 'x' is defined both in the config file and in
    # the store" with no route x in any file. Now each is refused by the id it is stored
    # under, with the command that takes it out.
    add = ["routes", "add", "--store", store_url, "--id", "seed", "--prefix", "/s/"]
    assert run_cli(*add, "--upstream", "http://127.0.0.1:9005")[0] == 0
    path = store_url.removeprefix("sqlite:///")
    with sqlite_db(path) as conn:
        for row, prefix in (("a", "/e/"), ("b", "/f/")):
            doc = (
                '{"route": {"id": "x", "plan": ["' + row + '-p"], "prefix": "' + prefix + '"},'
                ' "upstreams": {"' + row + '-p": {"url": "http://127.0.0.1:9006"}}}'
            )
            conn.execute("INSERT INTO fmw_routes VALUES (?, ?, 0)", (row, doc))
    status, out, err = run_cli("routes", "list", "--store", store_url)
    assert (
        status == 0 and out == "seed\tstore\t/s/\tretries=0\tseed-primary=http://127.0.0.1:9005\n"
    )
    assert "stored route 'a': its record holds route 'x', not 'a'" in err
    assert "`fallback-mw routes remove --id b` takes it out" in err
    assert "config file" not in err
    assert run_cli("routes", "remove", "--store", store_url, "--id", "a")[0] == 0
    assert run_cli("routes", "remove", "--store", store_url, "--id", "b")[0] == 0
    assert run_cli("routes", "list", "--store", store_url)[2] == ""


@pytest.mark.parametrize(
    ("gateway", "header"),
    [("", "x-tenant-id"), ("", "X-Session-Id"), ('tenant_header = "x-org"\n', "x-org")],
)
def test_an_auth_header_that_is_the_tenant_or_session_header_is_refused_as_in_the_file(
    tmp_path: Path, gateway: str, header: str
) -> None:
    # A file upstream whose auth_header is the tenant (or session) header is refused at
    # load (the caller's copy is stripped as a credential, so its value would be recorded
    # as the tenant); `routes add --auth-header x-tenant-id` stored it, exit 0, and every
    # gateway and `check` took the merged store. The store refuses what the file refuses.
    store = f"sqlite:///{tmp_path / 'gateway.db'}"
    config = tmp_path / "gateway.toml"
    config.write_text(f'[gateway]\n{gateway}store = "{store}"\n', encoding="utf-8")
    file_upstream = tmp_path / "file.toml"
    file_upstream.write_text(
        f'[gateway]\n{gateway}[upstreams.u]\nurl = "http://127.0.0.1:9001"\n'
        f'auth_header = "{header}"\n[[routes]]\nid = "r"\nprefix = "/r/"\nplan = ["u"]\n',
        encoding="utf-8",
    )
    status, _, err = run_cli("check", "--config", str(file_upstream))
    assert status == 2 and "names a header the gateway strips" in err, err
    status, _, err = run_cli(
        "routes", "add", "--config", str(config), "--id", "chat", "--prefix", "/api/",
        "--upstream", "http://127.0.0.1:9001", "--auth-header", header, "--auth-env", "K",
    )  # fmt: skip
    assert status == 2, err
    assert "route 'chat'" in err and "names a header the gateway strips" in err, err
    assert run_cli("routes", "list", "--config", str(config))[1] == "no routes\n"
    status, _, err = run_cli(
        "routes", "add", "--config", str(config), "--id", "chat", "--prefix", "/api/",
        "--upstream", "http://127.0.0.1:9001", "--retries", "1",
    )  # fmt: skip
    assert status == 0, err
    status, _, err = run_cli(
        "routes", "set-fallback", "--config", str(config), "--id", "chat",
        "--upstream", "http://127.0.0.1:9002", "--auth-header", header,
    )  # fmt: skip
    assert status == 2 and "names a header the gateway strips" in err, err
    status, out, _ = run_cli("routes", "list", "--config", str(config))
    assert status == 0 and "chat-fallback" not in out, out
