"""Differential: the same usage records and budgets written to a SQLite store and to a
PostgreSQL one must read back alike: `fallback-mw usage` (its table, `--json`,
`--incidents`, `--since` at a second's or a minute's edge, `--tenant`, `--route`),
`fallback-mw budgets show`, and the per-minute counts and rolling-minute peaks `capacity`
plans from. Records fall on second and minute boundaries (and a microsecond either side),
tenants and routes differ only by case or carry spaces and wildcards."""

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

from fallback_mw.budget import AttemptOutcome, UsageRecord
from fallback_mw.cli import main
from fallback_mw.config import BudgetConfig
from fallback_mw.store.ledgers import open_ledger
from tests.conftest import PG_HOST, PG_PORT, PG_PREFIX, PG_USER, require_service

SETTINGS = settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

# Half an hour ago, on a whole minute: every record is inside `--since 1h` and `capacity`'s 7 d.
BASE = (datetime.now(UTC) - timedelta(minutes=30)).replace(second=0, microsecond=0)
OFFSETS = [0, 1e-6, 0.999999, 1, 59, 59.999999, 60, 60.000001, 61, 119.5, 120, 600]

attempt_trails = st.sampled_from(
    [
        (),
        (AttemptOutcome("primary", status=200),),
        (AttemptOutcome("primary", status=503, failure="status"),
         AttemptOutcome("backup", status=200)),
        (AttemptOutcome("primary", skipped="breaker_open", fault="fail"),
         AttemptOutcome("backup", status=200)),
        (AttemptOutcome("primary", failure="timeout"),),
        (AttemptOutcome("primary", status=200, failure="idle_timeout"),),
    ]
)  # fmt: skip
records = st.tuples(
    st.sampled_from(OFFSETS),
    st.sampled_from(["chat", "Chat", "a b", "%"]),
    st.sampled_from(["default", "acme", "Acme", "ü b", "_"]),
    attempt_trails,
    st.sampled_from([(None, None), (0, 0), (3, None), (1000, 24)]),
    st.sampled_from([None, Decimal(0), Decimal("0.000000001"), Decimal("0.0071"), Decimal(3)]),
)
budget_spends = st.lists(
    st.tuples(
        st.sampled_from(["acme", "Acme", "予算 2026"]),
        st.sampled_from(["day", "month", "total"]),
        st.sampled_from([Decimal(0), Decimal("0.1"), Decimal("0.999999999"), Decimal(1)]),
        st.booleans(),
    ),
    max_size=5,
)


def _usage_record(n: int, drawn: tuple[Any, ...]) -> UsageRecord:
    offset, route, tenant, trail, (input_tokens, output_tokens), cost = drawn
    chosen = next((a.candidate for a in reversed(trail) if a.status is not None), None)
    served = chosen is not None and trail[-1].failure is None
    return UsageRecord(
        request_id=f"r{n}",
        route=route,
        tenant=tenant,
        at=BASE + timedelta(seconds=offset),
        budget_id="acme" if cost is not None else None,
        candidates=tuple(dict.fromkeys(a.candidate for a in trail)),
        attempts=trail,
        chosen=chosen,
        outcome=("served" if served else "aborted") if chosen else "upstream_failed",
        status=200 if chosen else 502,
        model="gpt-4o-mini",
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        cost=cost,
        charged=cost,
        rule=None if served else "ceiling",
    )


async def _seed(store: str, drawn: list[tuple[Any, ...]], spends: list[Any]) -> list[Any]:
    """Write the records and budgets; what the ledger API reads back for `capacity`."""
    ledger = open_ledger(store)
    try:
        for n, record in enumerate(drawn):
            await ledger.record_usage(_usage_record(n, record))
        for budget_id, window, amount, settle in spends:
            budget = BudgetConfig(limit=Decimal(1), window=window)
            await ledger.set_budget(budget_id, budget)
            hold = await ledger.hold(budget_id, budget, amount)
            if hold is not None and settle:
                await ledger.settle(hold, amount / 2)
        since = BASE - timedelta(hours=1)
        minutes = sorted(
            await ledger.usage_per_minute(since=since), key=lambda m: (m.route, m.minute)
        )
        peaks = sorted(await ledger.rolling_peaks(since=since), key=lambda p: p.route)
        return [minutes, peaks]
    finally:
        await ledger.aclose()


def _outputs(store: str, capsys: pytest.CaptureFixture[str]) -> list[tuple[int, str, str]]:
    edge = BASE + timedelta(seconds=60)
    commands = [
        ["usage", "--limit", "1000"],
        ["usage", "--json", "--limit", "1000"],
        ["usage", "--incidents"],
        ["usage", "--incidents", "--json"],
        ["usage", "--since", edge.isoformat(), "--json"],
        ["usage", "--since", (edge + timedelta(microseconds=1)).isoformat(), "--json"],
        ["usage", "--since", edge.strftime("%Y-%m-%dT%H:%M"), "--json"],
        ["usage", "--tenant", "Acme", "--json"],
        ["usage", "--tenant", "_", "--json"],
        ["usage", "--route", "%", "--json"],
        ["usage", "--limit", "2", "--json"],
        ["budgets", "show"],
        ["budgets", "show", "--budget", "Acme"],
    ]
    seen = []
    for command in commands:
        capsys.readouterr()
        status = main([*command, "--store", store])
        out, err = capsys.readouterr()
        seen.append((status, out, err.replace(store, "STORE")))
    return seen


async def _pg(database: str, statement: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(host=PG_HOST, port=PG_PORT, user=PG_USER, database=database)
    try:
        await conn.execute(statement)
    finally:
        await conn.close()


@pytest.fixture
def pg_database() -> Iterator[str]:
    """A fresh PostgreSQL database for the test, emptied before each example."""
    require_service("PostgreSQL", PG_HOST, PG_PORT)
    name = f"{PG_PREFIX}{uuid.uuid4().hex[:12]}"
    asyncio.run(_pg("postgres", f'CREATE DATABASE "{name}"'))
    try:
        yield name
    finally:
        asyncio.run(_pg("postgres", f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def _emptied(name: str) -> str:
    """The database's store URL, every ledger table emptied (made on first use)."""
    url = f"postgresql://{PG_USER}@{PG_HOST}:{PG_PORT}/{name}"
    asyncio.run(_seed(url, [], []))  # the ledger's tables, if not there yet
    tables = "fmw_usage, fmw_budgets, fmw_budget_windows, fmw_budget_holds, fmw_budget_reaped"
    asyncio.run(_pg(name, f"TRUNCATE {tables}"))
    return url


@pytest.mark.slow
@SETTINGS
@given(drawn=st.lists(records, max_size=12), spends=budget_spends)
def test_usage_and_budgets_read_back_alike_from_sqlite_and_postgresql(
    drawn: list[tuple[Any, ...]],
    spends: list[Any],
    tmp_path: Path,
    pg_database: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    stores = {
        "sqlite": f"sqlite:///{tmp_path / f'{uuid.uuid4().hex}.db'}",
        "postgresql": _emptied(pg_database),
    }
    read = {name: asyncio.run(_seed(store, drawn, spends)) for name, store in stores.items()}
    assert read["sqlite"] == read["postgresql"]
    shown = {name: _outputs(store, capsys) for name, store in stores.items()}
    for (command, sqlite), postgresql in zip(
        enumerate(shown["sqlite"]), shown["postgresql"], strict=True
    ):
        assert sqlite == postgresql, command
