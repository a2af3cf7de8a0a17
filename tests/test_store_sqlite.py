"""The SQLite route store: schema versioning, records, merging, and the reloader's lifecycle."""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import subprocess
from pathlib import Path
from typing import Any

import pytest

from fallback_mw import Gateway
from fallback_mw.config import ConfigError, GatewayConfig, RouteConfig, UpstreamConfig
from fallback_mw.store.model import StoredRoute, StoreError
from fallback_mw.store.routes import merge_routes
from fallback_mw.store.sqlite import SqliteStore
from tests.helpers import client_for, sqlite_db
from tests.test_cli_admin import FALLBACK_MW, cli, gateway_config, host_app, run_cli


def stored(route_id: str, url: str, **route: Any) -> StoredRoute:
    name = f"{route_id}-primary"
    return StoredRoute(
        route=RouteConfig(id=route_id, prefix=f"/{route_id}/", plan=(name,), **route),
        upstreams={name: UpstreamConfig(url=url, auth_env="KEY")},
    )


@pytest.mark.anyio
async def test_schema_version_wal_and_newer_schema_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    store = SqliteStore(str(path))
    await store.insert_route(stored("a", "http://127.0.0.1:1"))
    assert [s.route.id for s in await store.load_routes()] == ["a"]
    with sqlite_db(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        rows = conn.execute("SELECT component, version FROM fmw_schema").fetchall()
        assert ("routes", 1) in rows
        conn.execute("UPDATE fmw_schema SET version = 99 WHERE component = 'routes'")
    with pytest.raises(StoreError, match="version 99"):
        await SqliteStore(str(path)).load_routes()


@pytest.mark.anyio
async def test_a_store_file_that_cannot_be_migrated_is_a_store_error(tmp_path: Path) -> None:
    # A file this package cannot write its schema into (read-only, not a database it made,
    # /dev/null): a StoreError naming the file and SQLite's reason, which the CLI prints as
    # one line (exit 1) and the gateway refuses to start on. The raw sqlite3 error reached
    # the CLI as "unexpected internal error (OperationalError)".
    odd = tmp_path / "odd.db"
    with sqlite_db(odd) as conn:
        conn.execute("CREATE TABLE fmw_schema (x)")
    for path, reason in ((str(odd), "no such column: version"), ("/dev/null", "")):
        with pytest.raises(StoreError, match=f"cannot open the SQLite store {path}: {reason}"):
            await SqliteStore(path).load_routes()
    status, out, err = await cli("routes", "list", "--store", f"sqlite:///{odd}")
    assert (status, out) == (1, "")
    assert (
        err == f"fallback-mw: error: cannot open the SQLite store {odd}: no such column: version\n"
    )


@pytest.mark.anyio
async def test_records_round_trip_and_counters_move_on_every_change(tmp_path: Path) -> None:
    store = SqliteStore(str(tmp_path / "s.db"))
    original = stored("a", "http://127.0.0.1:1", retries=2, canary_eligible=True)
    start = await store.change_serials()
    await store.insert_route(original)
    assert (await store.load_routes()) == [original]
    await store.replace_route(stored("a", "http://127.0.0.1:2"))
    assert await store.remove_route("a") == 0  # removed, no fault with it
    assert await store.remove_route("a") is None
    routes_serial, faults_serial = await store.change_serials()
    assert routes_serial == start[0] + 3 and faults_serial == start[1]
    with sqlite_db(tmp_path / "s.db") as conn:  # a hand edit is noticed too
        conn.execute("INSERT INTO fmw_routes VALUES ('x', '{}', 0)")
    assert (await store.change_serials())[0] == routes_serial + 1
    with pytest.raises(ConfigError, match="stored route 'x': unreadable"):
        await store.load_routes()


def test_merge_refuses_duplicates_and_checks_like_the_loader() -> None:
    config = GatewayConfig.model_validate(
        {
            "upstreams": {"a-primary": {"url": "http://127.0.0.1:9"}},
            "routes": [{"id": "file", "prefix": "/f/", "plan": ["a-primary"]}],
        }
    )
    with pytest.raises(ConfigError, match="upstream name 'a-primary' is already defined"):
        merge_routes(config, [stored("a", "http://127.0.0.1:1")])
    with pytest.raises(ConfigError, match="defined both in the config file and in the store"):
        merge_routes(config, [stored("file", "http://127.0.0.1:1")])
    with pytest.raises(ConfigError, match="not in allow_hosts"):
        merge_routes(config, [stored("b", "http://10.9.9.9:1")])
    with pytest.raises(ConfigError, match="environment variable KEY is not set"):
        merge_routes(config, [stored("b", "http://127.0.0.1:1")], environ={})
    merged = merge_routes(config, [stored("b", "http://127.0.0.1:1")], environ={"KEY": "v"})
    assert [r.id for r in merged.routes] == ["file", "b"]
    assert merged.table().match("GET", "/b/x", "default") is not None


@pytest.mark.anyio
async def test_gateway_refuses_to_start_on_a_bad_store_and_stops_its_reloader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite:///{tmp_path / 'g.db'}"
    monkeypatch.setenv("A_KEY", "set-in-the-admin-shell-only")
    status, _, _ = await cli(
        "routes", "add", "--store", url, "--id", "a", "--prefix", "/a/",
        "--upstream", "http://127.0.0.1:1", "--auth-env", "A_KEY",
    )  # fmt: skip
    assert status == 0
    refused = Gateway(host_app, config=gateway_config(url), environ={})
    assert refused.config_error is not None
    assert "environment variable A_KEY is not set" in refused.config_error

    gateway = Gateway(host_app, config=gateway_config(url), environ={"A_KEY": "k"})
    runtime = gateway.services.store
    assert runtime is not None

    def reloaders() -> list[asyncio.Task[Any]]:
        return [t for t in asyncio.all_tasks() if t.get_name() == "fallback_mw.store-reload"]

    assert reloaders() == []  # nothing runs before the first request
    async with client_for(gateway) as client:
        await client.get("/elsewhere")
    assert len(reloaders()) == 1
    await gateway.aclose()
    assert reloaders() == []


def test_a_stored_upstreams_ca_file_is_checked_as_the_files(tmp_path: Path) -> None:
    """The loader refused a `ca_file` that is missing or not a PEM bundle; a stored route's
    was never checked: `check` passed it, and every request to that https upstream then
    failed as `tls`, booked to its breaker."""
    bad = tmp_path / "not-a-bundle.pem"
    bad.write_text("not a certificate\n", encoding="utf-8")
    for path, says in ((tmp_path / "missing.pem", "not found"), (bad, "not a readable PEM")):
        item = StoredRoute(
            route=RouteConfig(id="a", prefix="/a/", plan=("a-primary",)),
            upstreams={"a-primary": UpstreamConfig(url="https://localhost:1", ca_file=str(path))},
        )
        with pytest.raises(ConfigError) as caught:
            merge_routes(GatewayConfig(), [item])
        message = str(caught.value)
        assert message.startswith("route 'a': upstream 'a-primary': ca_file ") and says in message


def test_a_ca_file_that_is_a_fifo_is_refused_rather_than_read_forever(tmp_path: Path) -> None:
    """OpenSSL reads a `ca_file` to its end: a FIFO (in the file, or in a stored route
    written by hand) held `check` and `routes list` forever, and a starting gateway, and a
    running one's store reloads. Anything but a regular file is refused before it is
    opened."""
    fifo = tmp_path / "bundle.pem"
    os.mkfifo(fifo)
    in_file = tmp_path / "in-file.toml"
    in_file.write_text(f'[gateway]\nca_file = "{fifo}"\n', encoding="utf-8")
    store = tmp_path / "s.db"
    config = tmp_path / "gateway.toml"
    config.write_text(f'[gateway]\nstore = "sqlite:///{store}"\n', encoding="utf-8")
    add = ["routes", "add", "--store", f"sqlite:///{store}", "--id", "a", "--prefix", "/a/"]
    assert run_cli(*add, "--upstream", "https://127.0.0.1:9")[0] == 0
    upstream = {"url": "https://127.0.0.1:9", "ca_file": str(fifo)}
    doc = {"route": {"id": "a", "prefix": "/a/", "plan": ["a-primary"]},
           "upstreams": {"a-primary": upstream}}  # fmt: skip
    with sqlite_db(store) as conn:
        conn.execute("UPDATE fmw_routes SET doc = ? WHERE id = 'a'", (json.dumps(doc),))
    for verb, path in ((("check",), in_file), (("check",), config), (("routes", "list"), config)):
        result = subprocess.run(  # a timeout, not a hang, when it reads the FIFO
            [FALLBACK_MW, *verb, "--config", str(path)],
            capture_output=True, text=True, timeout=20, check=False,
        )  # fmt: skip
        assert "is not a regular file" in result.stderr, result.stderr


def test_an_upstream_name_two_routes_claim_names_both_owners() -> None:
    """A stored record (written by hand) owning `seed-primary`, the upstream of the stored
    route `seed`, was refused as "route 'seed': upstream name 'seed-primary' is already
    defined elsewhere": the sound route named, the record that took its name not. Both are
    named now, and a name the file defines is said to be the file's."""
    config = GatewayConfig.model_validate({"upstreams": {"primary": {"url": "http://127.0.0.1:9"}}})
    evil = StoredRoute(
        route=RouteConfig(id="evil", prefix="/e/", plan=("seed-primary",)),
        upstreams={"seed-primary": UpstreamConfig(url="http://127.0.0.1:3")},
    )
    with pytest.raises(ConfigError) as caught:
        merge_routes(config, [evil, stored("seed", "http://127.0.0.1:1")])
    assert str(caught.value) == (
        "route 'seed': upstream name 'seed-primary' is already defined by stored route "
        "'evil'; one of them must be removed or renamed"
    )
    taker = StoredRoute(
        route=RouteConfig(id="t", prefix="/t/", plan=("primary",)),
        upstreams={"primary": UpstreamConfig(url="http://127.0.0.1:3")},
    )
    with pytest.raises(ConfigError, match="'primary' is already defined by the config file"):
        merge_routes(config, [taker])


@pytest.mark.anyio
async def test_a_gateway_starts_while_another_process_writes_its_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An operator's `sqlite3` session held a write transaction on the store: a gateway
    # (re)started meanwhile waited 5 s and refused to start, "cannot load routes from the
    # store: ... database is locked", to write a schema version that was already current.
    # Under systemd, a restart loop for as long as the session stayed open.
    path = tmp_path / "gw.db"
    store = SqliteStore(str(path))
    await store.insert_route(stored("a", "http://127.0.0.1:1"))
    monkeypatch.setenv("KEY", "sk-store")
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        started = asyncio.get_running_loop().time()
        gateway = Gateway(host_app, config=gateway_config(f"sqlite:///{path}"))
        assert asyncio.get_running_loop().time() - started < 3.0
        try:
            async with client_for(gateway) as client:
                answer = await client.get("/a/x")  # the stored route: its upstream refuses
            assert answer.headers["x-gateway-route"] == "a"
        finally:
            await gateway.aclose()
    finally:
        other.execute("ROLLBACK")
        other.close()
