"""Usage records as more than the gateway writes them: token counts the upstreams report
(the gateway keeps at most `tokens.MAX_TOKENS` of each, whatever was reported), counts and
text an operator or another tool wrote. `usage` and `capacity` still answer, on SQLite and
on the real PostgreSQL."""

from __future__ import annotations

import asyncio
import io
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest

from fallback_mw.budget import UsageRecord
from fallback_mw.cli import main
from fallback_mw.store.ledgers import open_ledger
from fallback_mw.tokens import MAX_TOKENS
from tests.helpers import sqlite_db

pytestmark = pytest.mark.anyio


def _config(tmp_path: Path, store: str) -> Path:
    path = tmp_path / "gateway.toml"
    path.write_text(
        f'[gateway]\nstore = "{store}"\n\n'
        '[upstreams.primary]\nurl = "http://127.0.0.1:9001"\n\n'
        '[upstreams.backup]\nurl = "http://127.0.0.1:9002"\nrpm = 100000\ntpm = 1000000\n\n'
        '[[routes]]\nid = "chat"\nprefix = "/v1/"\nplan = ["primary", "backup"]\nretries = 1\n',
        encoding="utf-8",
    )
    return path


def _capacity(config: Path) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    status = main(["capacity", "--config", str(config), "--json"], stdout=out, stderr=err)
    return status, out.getvalue(), err.getvalue()


def _chat(printed: str) -> dict[str, Any]:
    route: dict[str, Any] = json.loads(printed)["routes"][0]
    assert route["route"] == "chat"
    return route


async def test_a_minute_of_answers_reporting_the_largest_counts_is_a_peak_not_an_error(
    ledger_store: str, tmp_path: Path
) -> None:
    """An upstream that reports absurd usage (`"prompt_tokens": 1e400`, read as the
    largest count the gateway keeps, 10^15 in and out) on 80 answers a second for a minute:
    the minute's tokens pass 2^63. SQLite's SUM refused them, and `capacity` said "SQLite
    ledger ... unavailable (OperationalError: integer overflow)" for a week (its --since),
    of a ledger that was up. Now it names the peak and says the fallback cannot carry it."""
    ledger = open_ledger(ledger_store)
    start = (datetime.now(UTC) - timedelta(hours=1)).replace(second=0, microsecond=0)
    records = [
        UsageRecord(request_id=f"r{i}", route="chat", tenant="t",
                    at=start + timedelta(seconds=i // 80), input_tokens=MAX_TOKENS,
                    output_tokens=MAX_TOKENS)
        for i in range(60 * 80)
    ]  # fmt: skip
    try:
        for first in range(0, len(records), 200):
            await asyncio.gather(*(ledger.record_usage(r) for r in records[first : first + 200]))
    finally:
        await ledger.aclose()
    status, printed, err = await anyio.to_thread.run_sync(
        _capacity, _config(tmp_path, ledger_store)
    )
    assert status == 1, err
    assert "cannot carry the peak" in err and "unavailable" not in err
    chat = _chat(printed)
    assert chat["peak"]["requests"] == 4800
    assert chat["peak"]["tokens"] == 4800 * 2 * MAX_TOKENS  # 9.6 * 10^18 > 2^63
    assert chat["fallbacks"][0]["tokens"]["verdict"] == "cannot_carry"


def test_a_token_count_edited_to_a_number_no_integer_holds_is_no_internal_error(
    tmp_path: Path,
) -> None:
    """SQLite keeps what a hand edit writes in an integer column (`1e999`, a real: infinity;
    `2.5`): one such record made `capacity` "unexpected internal error (OverflowError)".
    `usage` reads such a count as unknown; `capacity` now counts it as `usage` reads it
    (the record's request counts, its unknown tokens do not)."""
    store = f"sqlite:///{tmp_path / 'gateway.db'}"
    config = _config(tmp_path, store)
    at = (datetime.now(UTC) - timedelta(hours=1)).replace(microsecond=0)

    async def seed() -> None:
        ledger = open_ledger(store)
        try:
            for i, tokens in enumerate((10, 20, 30)):
                await ledger.record_usage(
                    UsageRecord(request_id=f"r{i}", route="chat", tenant="t", at=at,
                                input_tokens=tokens, output_tokens=0)
                )  # fmt: skip
        finally:
            await ledger.aclose()

    asyncio.run(seed())
    with sqlite_db(tmp_path / "gateway.db") as db:
        db.execute("UPDATE fmw_usage SET input_tokens = 9e999 WHERE request_id = 'r1'")
        db.execute("UPDATE fmw_usage SET input_tokens = 2.5 WHERE request_id = 'r2'")
    out, err = io.StringIO(), io.StringIO()
    assert main(["usage", "--store", store, "--json"], stdout=out, stderr=err) == 0, err.getvalue()
    assert [json.loads(line)["input_tokens"] for line in out.getvalue().splitlines()] == [
        10, None, None,
    ]  # fmt: skip
    status, printed, err = _capacity(config)
    assert status == 0, err
    chat = _chat(printed)
    assert (chat["peak"]["requests"], chat["peak"]["tokens"]) == (3, 10)


async def test_two_token_counts_edited_near_the_largest_bigint_are_no_ledger_error(
    pg_url: str, tmp_path: Path
) -> None:
    """PostgreSQL: a record whose input and output counts were edited to 9 * 10^18 each
    (each a bigint) made `capacity` "PostgreSQL ledger ... unavailable (bigint out of
    range)": their sum is summed in numeric now."""
    import asyncpg

    ledger = open_ledger(pg_url)
    try:
        await ledger.record_usage(
            UsageRecord(request_id="r", route="chat", tenant="t", input_tokens=1,
                        output_tokens=1, at=datetime.now(UTC) - timedelta(hours=1))
        )  # fmt: skip
    finally:
        await ledger.aclose()
    db = await asyncpg.connect(pg_url)
    try:
        await db.execute("UPDATE fmw_usage SET input_tokens = 9e18, output_tokens = 9e18")
    finally:
        await db.close()
    status, printed, err = await anyio.to_thread.run_sync(_capacity, _config(tmp_path, pg_url))
    assert status == 1 and "unavailable" not in err, err
    assert _chat(printed)["peak"]["tokens"] == 18 * 10**18


def test_a_usage_record_whose_text_is_not_utf8_is_listed_not_a_ledger_error(
    tmp_path: Path,
) -> None:
    """A record written by another tool or by hand with text that is not UTF-8 (a tenant
    in Latin-1, a route as a BLOB): Python's sqlite3 refused the whole query, so `usage`
    (and `--incidents`, `--json`, a game day's watch of its route) ended in "SQLite ledger
    ... unavailable (OperationalError: Could not decode to UTF-8 column 'tenant' with text
    ...)", quoting the row, and `capacity` did the same for a route. Each is read as the
    route store and `budgets show` read such text: its bytes, U+FFFD for what is not UTF-8."""
    store = f"sqlite:///{tmp_path / 'gateway.db'}"
    config = _config(tmp_path, store)
    at = (datetime.now(UTC) - timedelta(hours=1)).replace(microsecond=0)

    async def seed() -> None:
        ledger = open_ledger(store)
        try:
            for i in range(3):
                await ledger.record_usage(
                    UsageRecord(request_id=f"r{i}", route="chat", tenant="acme", at=at,
                                candidates=("primary", "backup"), chosen="primary",
                                outcome="served", status=200, input_tokens=5, output_tokens=5)
                )  # fmt: skip
        finally:
            await ledger.aclose()

    asyncio.run(seed())
    with sqlite_db(tmp_path / "gateway.db") as db:
        db.execute(
            "UPDATE fmw_usage SET tenant = CAST(? AS TEXT), model = ? WHERE request_id = 'r1'",
            (b"caf\xe9", b"\xff\x00blob"),
        )
        db.execute(
            "UPDATE fmw_usage SET route = CAST(? AS TEXT), request_id = CAST(? AS TEXT) "
            "WHERE request_id = 'r2'",
            (b"ch\xfeat", b"\x1b[2J\xfe"),
        )
    out, err = io.StringIO(), io.StringIO()
    assert main(["usage", "--store", store, "--json"], stdout=out, stderr=err) == 0, err.getvalue()
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(r["request_id"], r["route"], r["tenant"]) for r in rows] == [
        ("r0", "chat", "acme"),
        ("r1", "chat", "caf\ufffd"),
        ("\x1b[2J\ufffd", "ch\ufffdat", "acme"),
    ]
    assert rows[1]["model"] == "\ufffd\x00blob"
    out, err = io.StringIO(), io.StringIO()
    assert main(["usage", "--store", store], stdout=out, stderr=err) == 0, err.getvalue()
    assert "caf\ufffd" in out.getvalue() and "\x1b" not in out.getvalue()
    status, printed, err = _capacity(config)
    assert status == 0, err
    assert (_chat(printed)["peak"]["requests"], _chat(printed)["peak"]["tokens"]) == (2, 20)
