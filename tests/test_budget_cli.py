"""`fallback-mw budgets show|set` and `fallback-mw usage` against a real SQLite store and the
real PostgreSQL, through the package's own `main`."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import anyio
import pytest

from fallback_mw.budget import AttemptOutcome, UsageRecord, open_ledger
from fallback_mw.budget.cli import parse_since
from fallback_mw.cli import main
from fallback_mw.config import BudgetConfig


async def seed(store: str) -> None:
    ledger = open_ledger(store)
    try:
        budget = BudgetConfig(limit=Decimal("1"), window="day")
        await ledger.set_budget("acme", budget)
        hold = await ledger.hold("acme", budget, Decimal("0.25"))
        assert hold is not None
        await ledger.settle(hold, Decimal("0.125"))
        await ledger.hold("acme", budget, Decimal("0.5"))
        old = datetime.now(UTC) - timedelta(days=3)
        await ledger.record_usage(
            UsageRecord(request_id="r-old", route="chat", tenant="t1", at=old)
        )
        await ledger.record_usage(
            UsageRecord(
                request_id="r-new",
                route="chat",
                tenant="t2",
                budget_id="acme",
                candidates=("primary", "backup"),
                attempts=(
                    AttemptOutcome("primary", status=503, failure="status"),
                    AttemptOutcome("backup", status=200),
                ),
                chosen="backup",
                outcome="served",
                status=200,
                input_tokens=3,
                output_tokens=2,
                cost=Decimal("0.007"),
                charged=Decimal("0.007"),
            )
        )
    finally:
        await ledger.aclose()


async def cli(*argv: str) -> int:
    """`main` in a worker thread: it runs its own event loop, as on a terminal."""
    status: int = await anyio.to_thread.run_sync(main, list(argv))
    return status


@pytest.mark.anyio
async def test_budgets_set_show_and_usage(
    ledger_store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    store = ledger_store
    await seed(store)
    capsys.readouterr()
    assert await cli("budgets", "show", "--store", store) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("acme"))
    assert line.split() == [
        "acme",
        "day",
        datetime.now(UTC).strftime("%Y-%m-%d"),
        "1.00",
        "0.125",
        "0.5",
        "0.375",
    ]

    assert await cli("budgets", "set", "--store", store, "--budget", "acme", "--limit", "2.5") == 0
    assert await cli("budgets", "set", "--store", store, "--budget", "new", "--limit", "3") == 0
    capsys.readouterr()
    assert await cli("budgets", "show", "--store", store, "--budget", "acme") == 0
    out = capsys.readouterr().out
    assert "2.5" in out and "day" in out and "new" not in out

    assert await cli("usage", "--store", store, "--since", "1d") == 0
    out = capsys.readouterr().out
    assert "primary:503,backup:200" in out and "t2" in out and "t1" not in out
    assert await cli("usage", "--store", store, "--tenant", "t1", "--json") == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert json.loads(line)["request_id"] == "r-old"
    assert await cli("usage", "--store", store, "--route", "other") == 0
    assert "chat" not in capsys.readouterr().out


def test_budgets_via_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "gw.db"
    config = tmp_path / "gateway.toml"
    config.write_text(
        f'[gateway]\nstore = "sqlite:///{db}"\n\n[budgets.filed]\nlimit = 10.0\nwindow = "total"\n',
        encoding="utf-8",
    )
    assert main(["budgets", "show", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "filed" in out and "total" in out and "10.00" in out


def test_refusals_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = f"sqlite:///{tmp_path / 'l.db'}"
    assert main(["budgets", "set", "--store", store, "--budget", "x", "--limit", "-1"]) == 2
    assert main(["budgets", "set", "--store", store, "--budget", "x", "--limit", "abc"]) == 2
    assert main(["budgets", "set", "--store", store, "--budget", "x"]) == 2  # new: needs limit
    assert main(["budgets", "show", "--store", store, "--budget", "nope"]) == 2
    assert main(["budgets", "show", "--store", "redis://x"]) == 2
    assert main(["usage", "--store", store, "--since", "yesterday-ish"]) == 2
    err = capsys.readouterr().err
    assert "--limit" in err and "nope" in err


def test_unreachable_store_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    url = "postgresql://postgres:pw-secret@127.0.0.1:1/none"
    assert main(["budgets", "show", "--store", url]) == 1
    err = capsys.readouterr().err
    assert "unavailable" in err and "pw-secret" not in err


def test_parse_since() -> None:
    now = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
    assert parse_since("90s", now) == now - timedelta(seconds=90)
    assert parse_since("2d", now) == now - timedelta(days=2)
    assert parse_since("2026-11-01") == datetime(2026, 11, 1, tzinfo=UTC)
