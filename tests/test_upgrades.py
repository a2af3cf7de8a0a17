"""Upgrades and downgrades: a store written by another version of the package, opened by
this one (docs/operations.md, "Upgrading")."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
import pytest

from fallback_mw import Gateway
from fallback_mw.budget.ledger import window_start
from fallback_mw.store.ledgers.memory import MemoryLedger
from fallback_mw.store.ledgers.postgres import PostgresLedger
from fallback_mw.store.ledgers.schema import LATEST_VERSION, encode_sqlite_time, migrations
from fallback_mw.store.postgres import PostgresStore
from tests.helpers import client_for, free_port, sqlite_db
from tests.test_cli_admin import cli, run_cli
from tests.test_cli_convention import assert_one_error_line
from tests.upstreams import host_app

CONFIG = """
[gateway]
allow_hosts = ["127.0.0.1"]
store = "{store}"

[upstreams.primary]
url = "http://127.0.0.1:9001"
auth_env = "FMW_UPGRADE_KEY"

[[routes]]
id = "chat"
prefix = "/v1/"
plan = ["primary"]
"""

ENV = {**os.environ, "FMW_UPGRADE_KEY": "sk-upgrade-never-printed"}


async def set_schema_version(store: str, component: str, version: int) -> None:
    """As a newer package version leaves the shared `fmw_schema` table."""
    if store.startswith("sqlite:///"):
        with sqlite_db(store.removeprefix("sqlite:///")) as conn:
            conn.execute(
                "UPDATE fmw_schema SET version = ? WHERE component = ?", (version, component)
            )
        return
    conn = await asyncpg.connect(store)
    try:
        await conn.execute(
            "UPDATE fmw_schema SET version = $1 WHERE component = $2", version, component
        )
    finally:
        await conn.close()


def fallback_mw(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fallback_mw", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=ENV,
    )


@pytest.mark.anyio
async def test_check_and_serve_refuse_a_ledger_schema_written_by_a_newer_version(
    ledger_store: str, tmp_path: Path
) -> None:
    # A platform team rolled a newer version back (or started an old process beside new
    # ones): the newer one had migrated the ledger. `check` called the file valid and
    # `serve` started, then answered every budgeted request 503 budget_unavailable ("the
    # budget ledger cannot be reached") and dropped every route's usage record, the one
    # log line saying "SQLite ledger unreachable (SchemaTooNew)". As for a route schema
    # written by a newer version, both now refuse (exit 2) with one line naming it.
    status, _, err = await cli(
        "budgets", "set", "--store", ledger_store, "--budget", "b", "--limit", "1"
    )
    assert status == 0, err
    await set_schema_version(ledger_store, "ledger", LATEST_VERSION + 1)
    path = tmp_path / "gateway.toml"
    path.write_text(CONFIG.format(store=ledger_store), encoding="utf-8")
    said = (
        f"the store's ledger schema is version {LATEST_VERSION + 1}; this fallback_mw "
        f"knows up to {LATEST_VERSION} (upgrade the package)"
    )
    line = assert_one_error_line(fallback_mw("check", "--config", str(path)), 2)
    assert said in line, line
    port = free_port()
    serve = fallback_mw("serve", "--config", str(path), "--port", str(port), timeout=30)
    line = assert_one_error_line(serve, 2)
    assert said in line, line
    assert "serving on" not in serve.stdout + serve.stderr


@pytest.mark.anyio
async def test_a_gateway_in_a_host_app_refuses_a_ledger_schema_written_by_a_newer_version(
    ledger_store: str, tmp_path: Path
) -> None:
    # The same downgrade with the Gateway in a host's asgi.py (no `serve`): it started and
    # every request of a budgeted route was a 503 budget_unavailable, every usage record
    # dropped. It is refused as a newer route schema is: the lifespan startup fails naming
    # it, and without a lifespan each routed request is a 503 config_error saying so. A
    # ledger the host hands in is its own: the store's ledger schema is then not its concern.
    status, _, err = await cli(
        "budgets", "set", "--store", ledger_store, "--budget", "b", "--limit", "1"
    )
    assert status == 0, err
    await set_schema_version(ledger_store, "ledger", LATEST_VERSION + 1)
    path = tmp_path / "gateway.toml"
    path.write_text(CONFIG.format(store=ledger_store), encoding="utf-8")
    gateway = Gateway(host_app, config=path, environ=ENV)
    said = f"the store's ledger schema is version {LATEST_VERSION + 1}"
    assert gateway.config_error is not None and said in gateway.config_error
    async with client_for(gateway) as client:
        answer = await client.get("/v1/models")
    assert answer.status_code == 503 and said in answer.json()["error"]["message"]
    own = Gateway(host_app, config=path, environ=ENV, ledger=MemoryLedger())
    try:
        assert own.config_error is None
    finally:
        await own.aclose()


async def write_ledger_v1(store: str) -> None:
    """A ledger as the first schema left it (no duration_ms, no rule, no reaped holds), with
    a budget, its month's spend and one usage record: what an older version wrote."""
    now = datetime.now(UTC)
    steps = migrations("sqlite" if store.startswith("sqlite:") else "postgresql")[1]
    usage = (
        "req-1", "chat", "acme", "b", '["primary"]',
        '[{"candidate": "primary", "status": 200}]', "primary", "served", 200,
        "gpt-4o-mini", 10, 20, 1_500_000, 1_500_000,
    )  # fmt: skip
    schema = "CREATE TABLE fmw_schema (component TEXT PRIMARY KEY, version INTEGER NOT NULL)"
    if store.startswith("sqlite:///"):
        with sqlite_db(store.removeprefix("sqlite:///")) as conn:
            for statement in [schema, *steps]:
                conn.execute(statement)
            conn.execute("INSERT INTO fmw_schema VALUES ('ledger', 1)")
            conn.execute(
                "INSERT INTO fmw_budgets VALUES ('b', 7000000000, 'month', 10000000, ?)",
                (encode_sqlite_time(now),),
            )
            conn.execute(
                "INSERT INTO fmw_budget_windows VALUES ('b', ?, 1500000, 0)",
                (window_start("month", now),),
            )
            conn.execute(
                f"INSERT INTO fmw_usage (at, request_id, route, tenant, budget_id, candidates, "
                f"attempts, chosen, outcome, status, model, input_tokens, output_tokens, "
                f"cost_units, charged_units) VALUES ({', '.join('?' * 15)})",
                (encode_sqlite_time(now), *usage),
            )
        return
    conn = await asyncpg.connect(store)
    try:
        for statement in [schema, *steps]:
            await conn.execute(statement)
        await conn.execute("INSERT INTO fmw_schema VALUES ('ledger', 1)")
        await conn.execute(
            "INSERT INTO fmw_budgets VALUES ('b', 7000000000, 'month', 10000000, now())"
        )
        await conn.execute(
            "INSERT INTO fmw_budget_windows VALUES ('b', $1, 1500000, 0)",
            window_start("month", now),
        )
        await conn.execute(
            "INSERT INTO fmw_usage (at, request_id, route, tenant, budget_id, candidates, "
            "attempts, chosen, outcome, status, model, input_tokens, output_tokens, "
            f"cost_units, charged_units) VALUES ({', '.join(f'${i}' for i in range(1, 16))})",
            now, *usage,
        )  # fmt: skip
    finally:
        await conn.close()


@pytest.mark.anyio
async def test_an_older_ledger_is_named_by_check_and_migrated_with_every_row(
    ledger_store: str, tmp_path: Path
) -> None:
    # A platform team's pre-rollout `check` against the production store said nothing of
    # the ledger the new package was about to migrate, one way: once any command of it
    # used the ledger (a gateway's first request, or `usage` from an operator's laptop),
    # every gateway of the old version that restarted refused it. `check` now says so;
    # the migration keeps every row, the older records reading with no duration or rule.
    await write_ledger_v1(ledger_store)
    path = tmp_path / "gateway.toml"
    path.write_text(CONFIG.format(store=ledger_store), encoding="utf-8")
    result = fallback_mw("check", "--config", str(path))
    assert result.returncode == 0, result.stderr
    assert (
        f"  warning: the store's ledger schema is version 1: this package migrates it to "
        f"version {LATEST_VERSION} on its first use" in result.stdout
    ), result.stdout
    assert result.stdout.endswith("is valid: 1 route(s), 1 warning(s)\n")
    status, out, err = await cli("usage", "--store", ledger_store, "--json")
    assert status == 0, err
    (record,) = [json.loads(line) for line in out.splitlines()]
    assert record["request_id"] == "req-1" and record["charged"] == "0.0015"
    assert record.get("duration_ms") is None and record["rule"] is None
    status, out, err = await cli("budgets", "show", "--store", ledger_store, "--budget", "b")
    assert status == 0, err
    assert out.splitlines()[1].split()[3:5] == ["7.00", "0.0015"], out
    result = fallback_mw("check", "--config", str(path))
    assert result.returncode == 0 and "warning" not in result.stdout, result.stdout


@pytest.mark.anyio
async def test_check_names_a_stored_budget_this_version_cannot_read(
    ledger_store: str, tmp_path: Path
) -> None:
    # An older version stored a budget this one refuses to read (a limit above the ledger's
    # bound, from before it was bounded; a window a newer version added): `check` called
    # the store valid, then every request of the routes spending it was a 503
    # budget_unavailable. So was a route whose budget is defined nowhere. `check` now warns
    # under each such route, naming the budget and the command that fixes it.
    status, _, err = await cli(
        "budgets", "set", "--store", ledger_store, "--budget", "big", "--limit", "5"
    )
    assert status == 0, err
    if ledger_store.startswith("sqlite:///"):
        with sqlite_db(ledger_store.removeprefix("sqlite:///")) as conn:
            conn.execute("UPDATE fmw_budgets SET limit_units = 5000000000000000000")
    else:
        conn = await asyncpg.connect(ledger_store)
        try:
            await conn.execute("UPDATE fmw_budgets SET limit_units = 5000000000000000000")
        finally:
            await conn.close()
    path = tmp_path / "gateway.toml"
    config = CONFIG.format(store=ledger_store) + 'budget = "big"\n'
    path.write_text(config, encoding="utf-8")
    result = fallback_mw("check", "--config", str(path))
    assert result.returncode == 0, result.stderr
    assert (
        "  warning: stored budget 'big' is a row this version cannot read (a window or amount "
        "another version or a hand edit wrote): `fallback-mw budgets set --budget ID --limit "
        "...` stores it again; until then every request of this route is refused 503 "
        "budget_unavailable\n" in result.stdout
    ), result.stdout
    # Defined in the file too: the stored row takes its place (the store wins), unreadable.
    path.write_text(config + "\n[budgets.big]\nlimit = 1.0\n", encoding="utf-8")
    result = fallback_mw("check", "--config", str(path))
    assert "  warning: stored budget 'big' is a row this version cannot read" in result.stdout
    path.write_text(config.replace('"big"', '"nowhere"'), encoding="utf-8")
    result = fallback_mw("check", "--config", str(path))
    assert result.returncode == 0, result.stderr
    assert (
        "  warning: budget 'nowhere', which this route spends, is defined neither in the "
        "configuration ([budgets.nowhere]) nor in the store: every request of this route is "
        "refused 503 budget_unavailable; define it (`fallback-mw budgets set --budget nowhere "
        "--limit AMOUNT`) or correct the route's budget\n" in result.stdout
    ), result.stdout


@pytest.mark.anyio
async def test_the_route_store_and_the_ledger_migrate_a_new_postgres_database_at_once(
    pg_url: str,
) -> None:
    # A provisioning script running `routes add` and `budgets set` side by side (or a
    # gateway starting beside a `budgets set`) on a new database: both components created
    # the shared fmw_schema table at once, each under its own migration lock, and
    # PostgreSQL refused one (duplicate key ... pg_type_typname_nsp_index): a raw asyncpg
    # error out of the route store, 'PostgreSQL ledger unavailable' out of the ledger. Every
    # try below failed before; the components now take one more lock to create it.
    for _ in range(4):
        store, ledger = PostgresStore(pg_url), PostgresLedger(pg_url)
        try:
            routes, budgets = await asyncio.gather(store.load_routes(), ledger.stored_budgets())
        finally:
            await store.aclose()
            await ledger.aclose()
        assert (routes, budgets) == ([], {})
        conn = await asyncpg.connect(pg_url)
        try:  # a new database again
            await conn.execute("DROP SCHEMA public CASCADE; CREATE SCHEMA public")
        finally:
            await conn.close()


def test_check_says_how_many_stored_routes_a_newer_version_refuses(tmp_path: Path) -> None:
    # Rules tightened by an upgrade refuse every stored record an older version accepted
    # (here an upstream url template and a prefix with a dot segment, both stored by the
    # admin CLI of a few days before). `check` named only the first: the operator removed
    # it, ran check again, and met the next one, one at a time. The one line now says how
    # many more there are and where they are all named.
    db = tmp_path / "gw.db"
    store = f"sqlite:///{db}"
    status, _, err = run_cli(
        "routes", "add", "--store", store, "--id", "ok", "--prefix", "/ok/",
        "--upstream", "http://127.0.0.1:9001", "--auth-env", "FMW_UPGRADE_KEY",
    )  # fmt: skip
    assert status == 0, err
    for route_id, prefix, url in (
        ("dots", "/v1/..;/", "http://127.0.0.1:9001"),
        ("tpl", "/t/", "http://127.0.0.1:9001/deployments/{name}"),
        ("zz", "/z/", "http://127.0.0.1:9001/a/../b"),
    ):
        name = f"{route_id}-primary"
        doc = json.dumps({
            "route": {"id": route_id, "plan": [name], "prefix": prefix},
            "upstreams": {name: {"auth_env": "FMW_UPGRADE_KEY", "url": url}},
        })  # fmt: skip
        with sqlite_db(db) as conn:
            conn.execute("INSERT INTO fmw_routes VALUES (?, ?, 0)", (route_id, doc))
    path = tmp_path / "gateway.toml"
    path.write_text(CONFIG.format(store=store), encoding="utf-8")
    line = assert_one_error_line(fallback_mw("check", "--config", str(path)), 2)
    assert "stored route 'dots': prefix: " in line and "routes remove --id dots" in line, line
    assert line.endswith(
        "; 2 more stored records do not load either (`fallback-mw routes list` names each)"
    ), line
