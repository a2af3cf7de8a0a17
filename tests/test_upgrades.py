"""Upgrades and downgrades: a store written by another version of the package, opened by
this one (docs/operations.md, "Upgrading")."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import asyncpg
import pytest

from fallback_mw import Gateway
from fallback_mw.store.ledgers.memory import MemoryLedger
from fallback_mw.store.ledgers.schema import LATEST_VERSION
from tests.helpers import client_for, free_port
from tests.test_cli_admin import cli
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
        with sqlite3.connect(store.removeprefix("sqlite:///")) as conn:
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
