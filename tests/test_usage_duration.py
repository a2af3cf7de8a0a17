"""Usage records carry the request's duration (ledger schema v2): stored and read back by
every ledger, and a v1 store written by an older package migrates in place, its old rows
readable with no duration."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import asyncpg
import pytest

from fallback_mw.budget import UsageRecord
from fallback_mw.store.ledgers import open_ledger
from fallback_mw.store.ledgers.schema import LATEST_VERSION, USAGE_COLUMNS, migrations
from tests.helpers import sqlite_db

pytestmark = pytest.mark.anyio


async def _round_trip(url: str | None) -> None:
    ledger = open_ledger(url)
    try:
        await ledger.record_usage(
            UsageRecord(request_id="r1", route="chat", tenant="t", duration_ms=1234.5)
        )
        await ledger.record_usage(UsageRecord(request_id="r2", route="chat", tenant="t"))
        first, second = await ledger.usage(route="chat")
        assert (first.request_id, first.duration_ms) == ("r1", 1234.5)
        assert (second.request_id, second.duration_ms) == ("r2", None)
    finally:
        await ledger.aclose()


async def test_duration_round_trip_memory() -> None:
    await _round_trip(None)


async def test_duration_round_trip(ledger_store: str) -> None:
    await _round_trip(ledger_store)


def _v1_insert() -> str:
    columns = USAGE_COLUMNS.removesuffix(", duration_ms, rule")
    assert columns != USAGE_COLUMNS
    return f"INSERT INTO fmw_usage ({columns}) VALUES "


async def test_sqlite_v1_store_migrates(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    with sqlite_db(path) as conn:
        conn.execute(
            "CREATE TABLE fmw_schema (component TEXT PRIMARY KEY, version INTEGER NOT NULL)"
        )
        for statement in migrations("sqlite")[1]:
            conn.execute(statement)
        conn.execute("INSERT INTO fmw_schema VALUES ('ledger', 1)")
        conn.execute(
            _v1_insert() + "(?, 'old', 'chat', 't', NULL, '[]', '[]', NULL, 'served', 200, "
            "NULL, NULL, NULL, NULL, NULL)",
            ("2026-11-30T10:00:00.000000Z",),
        )
    ledger = open_ledger(f"sqlite:///{path}")
    try:
        await ledger.record_usage(
            UsageRecord(request_id="new", route="chat", tenant="t", duration_ms=7.0)
        )
        old, new = await ledger.usage(route="chat")
    finally:
        await ledger.aclose()
    assert (old.request_id, old.duration_ms, old.status, old.rule) == ("old", None, 200, None)
    assert (new.request_id, new.duration_ms) == ("new", 7.0)
    with sqlite_db(path) as conn:
        version = conn.execute("SELECT version FROM fmw_schema WHERE component = 'ledger'")
        assert version.fetchone() == (LATEST_VERSION,)


async def test_postgres_v1_store_migrates(pg_url: str) -> None:
    conn = await asyncpg.connect(pg_url)
    try:
        await conn.execute(
            "CREATE TABLE fmw_schema (component TEXT PRIMARY KEY, version INTEGER NOT NULL)"
        )
        for statement in migrations("postgresql")[1]:
            await conn.execute(statement)
        await conn.execute("INSERT INTO fmw_schema VALUES ('ledger', 1)")
        await conn.execute(
            _v1_insert() + "($1, 'old', 'chat', 't', NULL, '[]', '[]', NULL, 'served', 200, "
            "NULL, NULL, NULL, NULL, NULL)",
            datetime(2026, 11, 30, 10, tzinfo=UTC),
        )
        ledger = open_ledger(pg_url)
        try:
            await ledger.record_usage(
                UsageRecord(request_id="new", route="chat", tenant="t", duration_ms=7.0)
            )
            old, new = await ledger.usage(route="chat")
        finally:
            await ledger.aclose()
        assert (old.request_id, old.duration_ms) == ("old", None)
        assert (new.request_id, new.duration_ms) == ("new", 7.0)
        version = await conn.fetchval("SELECT version FROM fmw_schema WHERE component = 'ledger'")
        assert version == LATEST_VERSION == 4
    finally:
        await conn.close()


async def test_the_gateway_records_each_requests_duration() -> None:
    """A routed request's usage record covers at least the upstream's own wait."""
    from fallback_mw.store.ledgers.memory import MemoryLedger
    from tests.helpers import gateway_client
    from tests.upstreams import status_handler, upstream

    ledger = MemoryLedger()
    async with upstream(status_handler(200, b"ok", delay=0.2)) as slow:
        conf = {
            "upstreams": {"slow": {"url": slow.url}},
            "routes": [{"id": "chat", "prefix": "/api/", "plan": ["slow"]}],
        }
        async with gateway_client(conf, ledger=ledger) as client:
            assert (await client.get("/api/x")).status_code == 200
    (record,) = await ledger.usage(route="chat")
    assert record.duration_ms is not None and record.duration_ms >= 200
