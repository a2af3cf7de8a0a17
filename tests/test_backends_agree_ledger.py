"""Differential: one generated sequence of budget operations (holds at and around the limit,
settlements, releases, repeats of either, stored budgets, usage records) run on the memory,
SQLite and PostgreSQL ledgers side by side must give the same answers: which holds are
refused, what `status` reports, the usage records as read back. SPEC §7 names one ledger
behaviour whatever the store; a caller must not see a budget refuse on one and serve on
another."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fallback_mw.budget import Hold, Ledger, SettlesAndRecords, UsageRecord
from fallback_mw.budget.ledger import AttemptOutcome
from fallback_mw.config import BudgetConfig
from fallback_mw.store.ledgers import open_ledger
from fallback_mw.store.ledgers.memory import MemoryLedger
from tests.conftest import PG_HOST, PG_PORT, PG_PREFIX, PG_USER, require_service

SETTINGS = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

# Odd but valid budget ids (config/strict.py budget_id): case, spaces, SQL wildcards,
# quotes, non-ASCII, a trailing space.
BUDGET_IDS = ["acme", "Acme", "a b", "%", "_", "a'b", "予算 2026", "acme "]
NANO = Decimal("0.000000001")


@pytest.fixture
def pg_database() -> Iterator[str]:
    """A fresh PostgreSQL database for the whole test (each example uses ids of its own)."""
    require_service("PostgreSQL", PG_HOST, PG_PORT)
    import asyncpg

    name = f"{PG_PREFIX}{uuid.uuid4().hex[:12]}"

    async def admin(statement: str) -> None:
        conn = await asyncpg.connect(host=PG_HOST, port=PG_PORT, user=PG_USER, database="postgres")
        try:
            await conn.execute(statement)
        finally:
            await conn.close()

    asyncio.run(admin(f'CREATE DATABASE "{name}"'))
    try:
        yield f"postgresql://{PG_USER}@{PG_HOST}:{PG_PORT}/{name}"
    finally:
        asyncio.run(admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


limits = st.sampled_from(
    [Decimal(0), NANO, Decimal("0.01"), Decimal("0.03"), Decimal(1), Decimal("1000000000")]
)
amounts = st.one_of(
    st.sampled_from(
        [
            Decimal(0), NANO, Decimal("0.0000000001"), Decimal("0.01"), Decimal("0.0099999999"),
            Decimal("0.02"), Decimal("0.010000001"), Decimal(1), Decimal("999999999.999999999"),
            Decimal("1000000000"), Decimal("5000000000"), Decimal("Infinity"), Decimal("-1"),
        ]
    ),
    st.decimals(min_value=0, max_value=2, places=11),
)  # fmt: skip
budgets = st.builds(
    BudgetConfig,
    limit=limits,
    window=st.sampled_from(["day", "month", "total"]),
    default_hold=st.sampled_from([Decimal(0), Decimal("0.01")]),
)
# At most MAX_NAME characters: the usage record cuts a tenant so (request/record.py).
tenants = st.sampled_from(["default", "acme", "Acme", "a b", "ü" * 150, "x" * 200, "%", "_"])
operations = st.lists(
    st.one_of(
        st.tuples(st.just("hold"), st.sampled_from(BUDGET_IDS[:4]), amounts),
        st.tuples(st.just("settle"), st.integers(0, 7), amounts),
        st.tuples(st.just("release"), st.integers(0, 7)),
        st.tuples(st.just("end"), st.integers(0, 7), amounts, tenants),
        st.tuples(st.just("status"), st.sampled_from(BUDGET_IDS)),
        st.tuples(st.just("record"), tenants, amounts),
    ),
    max_size=25,
)


def _record(
    prefix: str, n: int, tenant: str, charged: Decimal, budget_id: str | None
) -> UsageRecord:
    return UsageRecord(
        request_id=f"{prefix}r{n}",
        route=f"{prefix}chat",
        tenant=tenant,
        at=datetime(2026, 12, 5, 12, 0, 0, tzinfo=UTC) + timedelta(microseconds=n),
        budget_id=budget_id,
        candidates=("primary", "backup"),
        attempts=(AttemptOutcome("primary", status=503, failure="status"),
                  AttemptOutcome("backup", status=200)),
        chosen="backup",
        outcome="served",
        status=200,
        model="gpt-4o-mini",
        input_tokens=3,
        output_tokens=4,
        cost=charged,
        charged=charged,
    )  # fmt: skip


async def _run(ledger: Ledger, prefix: str, budget: BudgetConfig, ops: list[Any]) -> list[Any]:
    """The answers one ledger gives to `ops` (budget ids namespaced by `prefix`)."""
    holds: list[Hold] = []
    seen: list[Any] = []
    for n, op in enumerate(ops):
        kind = op[0]
        if kind == "hold":
            hold = await ledger.hold(prefix + op[1], budget, op[2])
            if hold is not None:
                holds.append(hold)
            seen.append(None if hold is None else (hold.amount, hold.window_start))
        elif kind in ("settle", "release", "end") and op[1] < len(holds):
            hold = holds[op[1]]
            if kind == "settle":
                await ledger.settle(hold, op[2])
            elif kind == "release":
                await ledger.release(hold)
            else:
                record = _record(prefix, n, op[3], op[2], hold.budget_id)
                if isinstance(ledger, SettlesAndRecords):
                    await ledger.settle_and_record(hold, op[2], record)
                else:
                    await ledger.settle(hold, op[2])
                    await ledger.record_usage(record)
        elif kind == "status":
            status = await ledger.status(prefix + op[1], budget)
            seen.append((status.spent, status.held, status.remaining, status.window_start))
        elif kind == "record":
            await ledger.record_usage(_record(prefix, n, op[1], op[2], None))
    for budget_id in BUDGET_IDS:
        status = await ledger.status(prefix + budget_id, budget)
        seen.append((budget_id, status.spent, status.held, status.remaining))
    for limit in (0, 1, 2):  # the newest `limit` records
        newest = await ledger.usage(limit=limit, route=prefix + "chat")
        seen.append(tuple(r.request_id.removeprefix(prefix) for r in newest))
    records = await ledger.usage(since=datetime(2026, 1, 1, tzinfo=UTC), limit=1000)
    seen.append(
        [
            (r.request_id, r.tenant, r.cost, r.charged, r.at, r.attempts, r.budget_id)
            for r in records
            if r.request_id.startswith(prefix)
        ]
    )
    return seen


async def _all(stores: dict[str, str | None], budget: BudgetConfig, ops: list[Any]) -> None:
    answers: dict[str, list[Any]] = {}
    for name, url in stores.items():
        ledger = MemoryLedger() if url is None else open_ledger(url)
        prefix = uuid.uuid4().hex[:8] + ":"
        try:
            seen = await _run(ledger, prefix, budget, ops)
        finally:
            await ledger.aclose()
        # Namespaced ids read back without the namespace, so the answers compare.
        answers[name] = [_unprefixed(item, prefix) for item in seen]
    first, *others = answers
    for other in others:
        assert answers[other] == answers[first], (other, first)


def _unprefixed(item: Any, prefix: str) -> Any:
    if isinstance(item, list):
        return [
            (
                row[0].removeprefix(prefix),
                *row[1:6],
                None if row[6] is None else row[6].removeprefix(prefix),
            )
            for row in item
        ]
    return item


@SETTINGS
@given(budget=budgets, ops=operations)
def test_memory_sqlite_and_postgresql_ledgers_answer_alike(
    budget: BudgetConfig, ops: list[Any], tmp_path: Path, pg_database: str
) -> None:
    stores: dict[str, str | None] = {
        "memory": None,
        "sqlite": f"sqlite:///{tmp_path / f'{uuid.uuid4().hex}.db'}",
        "postgresql": pg_database,
    }
    asyncio.run(_all(stores, budget, ops))


def test_the_newest_0_records_are_none_on_every_ledger(tmp_path: Path, pg_database: str) -> None:
    """`usage(limit=0)`: no record, as the SQL ledgers' LIMIT 0; the memory ledger's
    `found[-0:]` gave every record it kept."""

    async def newest(url: str | None) -> list[int]:
        ledger = MemoryLedger() if url is None else open_ledger(url)
        prefix = uuid.uuid4().hex[:8] + ":"
        try:
            await ledger.record_usage(_record(prefix, 0, "acme", Decimal(0), None))
            return [len(await ledger.usage(route=prefix + "chat", limit=n)) for n in (0, 1)]
        finally:
            await ledger.aclose()

    for url in (None, f"sqlite:///{tmp_path / 'l.db'}", pg_database):
        assert asyncio.run(newest(url)) == [0, 1], url
