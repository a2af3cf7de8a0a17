"""`fallback-mw budgets show|set` and `fallback-mw usage` against a real SQLite store and the
real PostgreSQL, through the public `fallback_mw.cli.main`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import unicodedata
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import anyio
import pytest

from fallback_mw.budget import AttemptOutcome, UsageRecord
from fallback_mw.cli import main
from fallback_mw.cli.usage import parse_since
from fallback_mw.config import BudgetConfig
from fallback_mw.store.ledgers import open_ledger
from tests.helpers import sqlite_db

FALLBACK_MW = str(Path(sys.executable).with_name("fallback-mw"))


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
        "0.50",  # at least two decimals, as the limit (a 3.3 printed beside a 2.00 before)
        "0.375",
    ]

    assert await cli("budgets", "set", "--store", store, "--budget", "acme", "--limit", "2.5") == 0
    assert await cli("budgets", "set", "--store", store, "--budget", "new", "--limit", "3") == 0
    capsys.readouterr()
    assert await cli("budgets", "show", "--store", store, "--budget", "acme") == 0
    out = capsys.readouterr().out
    assert "2.50" in out and "day" in out and "new" not in out

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


def show_rows(output: str) -> dict[str, list[str]]:
    rows = [line.split() for line in output.splitlines()[1:] if not line.startswith("(")]
    return {row[0]: row for row in rows if row}


@pytest.mark.anyio
async def test_budgets_show_agrees_whichever_way_the_store_is_named(
    ledger_store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A budget defined in the config file only, with spend and a hold recorded by a gateway,
    # and one defined in the store. `--store` used to print an empty table for the first.
    config = tmp_path / "gateway.toml"
    config.write_text(
        f'[gateway]\nstore = "{ledger_store}"\n\n[budgets.filed]\nlimit = 10.0\nwindow = "day"\n',
        encoding="utf-8",
    )
    ledger = open_ledger(ledger_store)
    try:
        filed = BudgetConfig(limit=Decimal("10"), window="day")
        hold = await ledger.hold("filed", filed, Decimal("0.5"))
        assert hold is not None
        await ledger.settle(hold, Decimal("0.25"))
        assert await ledger.hold("filed", filed, Decimal("0.125")) is not None
        await ledger.set_budget("stored", BudgetConfig(limit=Decimal("3"), window="total"))
    finally:
        await ledger.aclose()
    capsys.readouterr()
    assert await cli("budgets", "show", "--config", str(config)) == 0
    by_config = show_rows(capsys.readouterr().out)
    assert await cli("budgets", "show", "--store", ledger_store) == 0
    output = capsys.readouterr().out
    by_store = show_rows(output)
    today = datetime.now(UTC).strftime("%Y-%m-%d")
    assert by_config["filed"] == ["filed", "day", today, "10.00", "0.25", "0.125", "9.625"]
    assert by_config["stored"] == ["stored", "total", "total", "3.00", "0.00", "0.00", "3.00"]
    # The same rows; only the limit of a budget defined in a file the CLI was not given is
    # unknown to the store (and said so).
    assert by_store["stored"] == by_config["stored"]
    assert by_store["filed"] == ["filed", "day", today, "-", "0.25", "0.125", "-"]
    assert "pass --config FILE" in output
    assert await cli("budgets", "show", "--store", ledger_store, "--budget", "filed") == 0
    assert set(show_rows(capsys.readouterr().out)) == {"filed"}


def test_refusals_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = f"sqlite:///{tmp_path / 'l.db'}"
    assert main(["budgets", "set", "--store", store, "--budget", "x", "--limit", "-1"]) == 2
    assert main(["budgets", "set", "--store", store, "--budget", "x", "--limit", "abc"]) == 2
    assert main(["budgets", "set", "--store", store, "--budget", "x"]) == 2  # new: needs limit
    assert main(["budgets", "show", "--store", "redis://x"]) == 2
    assert main(["usage", "--store", store, "--since", "yesterday-ish"]) == 2
    err = capsys.readouterr().err
    assert "--limit" in err


@pytest.mark.anyio
async def test_budgets_show_of_a_budget_not_there_is_not_found_exit_1(
    ledger_store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # `budgets show --budget nope` exited 2, the status of a refused configuration, where
    # `routes remove --id nope` exits 1 for the same "not found": a script telling a typo
    # from a bad store had to know which verb it ran. Not found is a runtime result, 1.
    await seed(ledger_store)
    assert await cli("budgets", "show", "--store", ledger_store, "--budget", "nope") == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == "fallback-mw: error: no budget 'nope' in the store or the config\n"
    assert await cli("budgets", "show", "--store", ledger_store, "--budget", "acme") == 0
    assert await cli("routes", "remove", "--store", ledger_store, "--id", "nope") == 1
    assert capsys.readouterr().err.endswith("fallback-mw: error: no route 'nope' in the store\n")


def test_a_default_hold_above_the_limit_is_refused_and_nothing_stored(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = f"sqlite:///{tmp_path / 'l.db'}"
    set_ = ["budgets", "set", "--store", store, "--budget", "acme"]
    assert main([*set_, "--limit", "1", "--default-hold", "5"]) == 2
    err = capsys.readouterr().err
    assert "default hold 5" in err and "above the limit 1" in err
    assert main([*set_, "--limit", "10", "--default-hold", "5"]) == 0
    assert main([*set_, "--limit", "2"]) == 2  # the stored hold now stands above it
    assert main([*set_, "--limit", "0"]) == 0  # a limit of 0 refuses everything anyway
    capsys.readouterr()
    assert main(["budgets", "show", "--store", store, "--budget", "acme"]) == 0
    (row,) = capsys.readouterr().out.splitlines()[1:]
    assert row.split()[:4] == ["acme", "month", row.split()[2], "0.00"]


def test_a_budget_id_never_puts_terminal_controls_on_the_operators_screen(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`budgets set --budget $'ev\\x1b[31mil\\nx'` was stored, and `budgets show` then wrote
    the escape sequence and the newline raw, breaking the table on every screen."""
    store = f"sqlite:///{tmp_path / 'l.db'}"
    evil = "ev\x1b[31mil\nx"
    assert main(["budgets", "set", "--store", store, "--budget", evil, "--limit", "1"]) == 2
    assert "printable" in capsys.readouterr().err

    async def plant() -> None:  # stored by an older version, or written by hand
        ledger = open_ledger(store)
        try:
            await ledger.set_budget(evil, BudgetConfig(limit=Decimal(1)))
        finally:
            await ledger.aclose()

    anyio.run(plant)
    assert main(["budgets", "show", "--store", store]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and len(out.splitlines()) == 2
    assert out.splitlines()[1].startswith("ev?[31mil?x ")


def test_usage_tables_keep_a_tab_or_newline_in_a_stored_value_to_its_cell(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A caller's tenant id may hold a tab (HTTP allows it in a field value: every server
    passes it), and `usage` printed it raw, shifting the row's columns; a record written by
    hand with a newline in its tenant forged a second row, and an escape sequence in a
    route or candidate name reached the terminal. Every cell is one printable line now."""
    store = f"sqlite:///{tmp_path / 'l.db'}"

    async def plant() -> None:
        ledger = open_ledger(store)
        try:
            for tenant, route in (("acme\tx", "chat"), ("t\nFAKE ROW", "ch\x1b[2Jat")):
                await ledger.record_usage(
                    UsageRecord(
                        request_id="r",
                        route=route,
                        tenant=tenant,
                        candidates=("primary", "backup"),
                        attempts=(
                            AttemptOutcome("pri\x1b[31mmary", status=503, failure="status"),
                            AttemptOutcome("backup", status=200),
                        ),
                        chosen="back\tup",
                        outcome="served",
                        status=200,
                    )
                )
        finally:
            await ledger.aclose()

    anyio.run(plant)
    for extra in ([], ["--incidents"]):
        assert main(["usage", "--store", store, *extra]) == 0
        out = capsys.readouterr().out
        assert not any(c in out for c in "\t\x1b\r"), out
        header, first, second = out.splitlines()
        assert "acme?x" in first.split() and "t?FAKE" in second.split()
        assert "ch?[2Jat" in second.split() and "pri?[31mmary:503,backup:200" in first.split()
        assert ("back?up" in first.split()) is not bool(extra)  # CHOSEN: the plain table's
        # Each column starts where its header does, on every row.
        column = header.index("TENANT")
        assert first[column:].startswith("acme?x ") and second[column:].startswith("t?FAKE ")


def _terminal_columns(text: str) -> int:
    """The columns a terminal (xterm, VTE, wcwidth) gives `text`: East Asian wide and
    fullwidth characters take two, combining marks none."""
    return sum(
        0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) in ("W", "F") else 1
        for c in text
    )


@pytest.mark.parametrize("encoding", ["utf-8", "ascii"])
def test_usage_and_budget_tables_keep_their_columns_with_wide_or_accented_text(
    tmp_path: Path, encoding: str
) -> None:
    """A tenant or budget id in Japanese (each character two columns wide) or with a
    combining accent (`e` + U+0301, no column of its own) was padded by its length in
    characters: every later column of its row stood off its header. Under an ASCII
    terminal the escapes it is written as (`\\u65e5`) were padded as one character
    each. Every column now starts under its header, as the terminal shows it."""
    store = f"sqlite:///{tmp_path / 'l.db'}"
    tenants = ("日本語テナント", "cafe\u0301", "acme")
    budget = "予算 €"

    async def plant() -> None:
        ledger = open_ledger(store)
        try:
            for tenant in tenants:
                await ledger.record_usage(
                    UsageRecord(
                        request_id="r",
                        route="chat",
                        tenant=tenant,
                        candidates=("primary",),
                        attempts=(AttemptOutcome("primary", status=200),),
                        chosen="primary",
                        outcome="served",
                        status=200,
                    )
                )
            await ledger.set_budget(budget, BudgetConfig(limit=Decimal("5")))
        finally:
            await ledger.aclose()

    anyio.run(plant)
    env = {**os.environ, "PYTHONIOENCODING": encoding}
    for verb, column in (("usage", "ATTEMPTS"), ("budgets", "WINDOW")):
        args = [verb, "show"] if verb == "budgets" else [verb]
        result = subprocess.run(
            [FALLBACK_MW, *args, "--store", store],
            capture_output=True,
            text=True,
            encoding=encoding,
            env=env,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        header, *rows = result.stdout.splitlines()
        assert len(rows) == (len(tenants) if verb == "usage" else 1), result.stdout
        start = header.index(column)
        for row in rows:
            at = (row[i:] for i in range(len(row)) if _terminal_columns(row[:i]) == start)
            shown = next(at, "")  # "": no character starts at the header's column
            assert shown.startswith("primary:200" if verb == "usage" else "month"), result.stdout


def test_usage_reads_past_a_record_it_cannot_read_whole(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One usage row this version did not write (by hand, another tool, a bad restore) —
    trails that are not JSON, an attempt that is not an object, a status that is no number,
    a time that is no time — made `usage` and `usage --incidents` end in "unexpected
    internal error (JSONDecodeError); please report it": no record shown at all, in the
    middle of an incident review. An unreadable column now reads as unknown; a row whose
    time cannot be read is left out."""
    path = tmp_path / "l.db"
    store = f"sqlite:///{path}"

    async def good() -> None:
        ledger = open_ledger(store)
        try:
            await ledger.record_usage(
                UsageRecord(
                    request_id="r-good",
                    route="chat",
                    tenant="t1",
                    candidates=("primary", "backup"),
                    attempts=(
                        AttemptOutcome("primary", status=503, failure="status"),
                        AttemptOutcome("backup", status=200),
                    ),
                    chosen="backup",
                    outcome="served",
                    status=200,
                )
            )
        finally:
            await ledger.aclose()

    anyio.run(good)
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    with sqlite_db(path) as db:
        db.executemany(
            "INSERT INTO fmw_usage (at, request_id, route, tenant, candidates, attempts, "
            "outcome, status, input_tokens, cost_units, duration_ms) "
            "VALUES (?, ?, 'chat', 't2', ?, ?, 'upstream_failed', ?, ?, ?, ?)",
            [
                (now, "r-text", "not json", "[{", 502, 3, 7, 1.5),
                (now, "r-shapes", '{"a": 1}', '["primary", {"candidate": "backup"}]', "x", "y",
                 "z", "w"),
                ("yesterday", "r-when", "[]", "[]", 502, None, None, None),
            ],
        )  # fmt: skip
    assert main(["usage", "--store", store, "--json"]) == 0
    shown = {r["request_id"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert sorted(shown) == ["r-good", "r-shapes", "r-text"]
    assert shown["r-good"]["attempts"][0] == {"candidate": "primary", "status": 503,
                                              "failure": "status"}  # fmt: skip
    assert shown["r-text"]["candidates"] == [] and shown["r-text"]["attempts"] == []
    assert shown["r-text"]["status"] == 502 and shown["r-text"]["input_tokens"] == 3
    assert shown["r-shapes"]["attempts"] == [{"candidate": "backup"}]
    assert shown["r-shapes"]["status"] is None and shown["r-shapes"]["cost"] is None
    for extra in ([], ["--incidents"]):
        assert main(["usage", "--store", store, *extra]) == 0
        out = capsys.readouterr().out
        assert "r-good" in out or "primary:503,backup:200" in out
        assert len(out.splitlines()) == 4  # the header and the three readable records


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


@pytest.mark.anyio
async def test_usage_incidents_limit_shows_the_newest_incidents(
    ledger_store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--incidents --limit N` shows the newest N incidents (docs/budgets.md), not the
    oldest N of the records it searched: during an outage the current ones are wanted."""
    ledger = open_ledger(ledger_store)
    start = datetime.now(UTC) - timedelta(minutes=10)
    try:
        for minute in range(5):
            await ledger.record_usage(
                UsageRecord(
                    request_id=f"r-{minute}",
                    route="chat",
                    tenant="t1",
                    at=start + timedelta(minutes=minute),
                    attempts=(AttemptOutcome("primary", status=503, failure="status"),),
                    outcome="upstream_failed",
                    status=502,
                )
            )
    finally:
        await ledger.aclose()
    capsys.readouterr()
    assert await cli("usage", "--store", ledger_store, "--incidents", "--limit", "2", "--json") == 0
    shown = [json.loads(line)["request_id"] for line in capsys.readouterr().out.splitlines()]
    assert shown == ["r-3", "r-4"]  # the newest two, oldest first like every listing


@pytest.mark.anyio
async def test_budgets_show_of_one_budget_reads_past_another_row_it_cannot_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One stored row this version cannot read (a window another version wrote) made
    `budgets show --budget other` fail on that row too: every budget of the store was read
    to show one. The budget asked for is shown; asked for itself, the row is named."""
    path = tmp_path / "l.db"
    store = f"sqlite:///{path}"
    ledger = open_ledger(store)
    try:
        await ledger.set_budget("acme", BudgetConfig(limit=Decimal(1), window="day"))
        await ledger.set_budget("other", BudgetConfig(limit=Decimal(7), window="day"))
    finally:
        await ledger.aclose()
    with sqlite_db(path) as db:
        db.execute("UPDATE fmw_budgets SET window_kind = 'fortnight' WHERE budget_id = 'acme'")
    capsys.readouterr()
    assert await cli("budgets", "show", "--store", store, "--budget", "other") == 0
    out = capsys.readouterr().out
    assert "other" in out and "7.00" in out and "acme" not in out
    assert await cli("budgets", "show", "--store", store, "--budget", "acme") == 1
    assert "stored budget 'acme'" in capsys.readouterr().err


@pytest.mark.anyio
async def test_usage_since_an_early_year_finds_the_same_records_on_both_ledgers(
    ledger_store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`usage --since 0999-12-31` found every record on PostgreSQL and none on SQLite, whose
    times are text compared as text: the bound was written "999-12-31...", after "2026-...".
    A bound whose zone takes it before year 1 was an "unexpected internal error"."""
    await seed(ledger_store)
    capsys.readouterr()
    for since in ("0999-12-31", "0050-06-01T00:00", "0001-01-01", "2000-01-01T00:00Z"):
        assert await cli("usage", "--store", ledger_store, "--since", since, "--json") == 0
        found = [json.loads(line)["request_id"] for line in capsys.readouterr().out.splitlines()]
        assert found == ["r-old", "r-new"], since
    assert await cli("usage", "--store", ledger_store, "--since", "0001-01-01T00:00+01:00") == 2
    assert "--since" in capsys.readouterr().err
