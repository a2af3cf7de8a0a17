"""Usage parsing, prices and the three ledgers behind one interface."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import anyio
import asyncpg
import pytest

from fallback_mw.budget import Hold, Ledger, SettlesAndRecords, UsageRecord, window_start
from fallback_mw.budget.cost import PriceBook, format_money, from_units, to_units
from fallback_mw.config import BudgetConfig, PriceConfig
from fallback_mw.request.context import Usage
from fallback_mw.request.usage import UsageMeter
from fallback_mw.store.ledgers import open_ledger
from fallback_mw.store.ledgers.memory import MemoryLedger
from fallback_mw.store.ledgers.schema import LATEST_VERSION
from tests.helpers import record_the_store_refuses, sqlite_db

SSE = b"text/event-stream; charset=utf-8"
JSON = b"application/json"

# --- usage ------------------------------------------------------------------------------


def meter_over(chunks: list[bytes], content_type: bytes, json_cap: int = 1 << 20) -> Usage:
    usage = Usage()
    meter = UsageMeter(usage, json_cap=json_cap)
    for chunk in chunks:
        meter.observe(chunk, content_type)
    meter.finish()
    return usage


def split_every(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


def test_openai_json_usage() -> None:
    body = json.dumps(
        {"model": "gpt-4o-mini", "usage": {"prompt_tokens": 11, "completion_tokens": 7}}
    ).encode()
    usage = meter_over(split_every(body, 5), JSON)
    assert (usage.input_tokens, usage.output_tokens, usage.model) == (11, 7, "gpt-4o-mini")


def test_anthropic_json_usage() -> None:
    body = b'{"model":"claude-x","content":[],"usage":{"input_tokens":4,"output_tokens":9}}'
    usage = meter_over([body], b"application/json")
    assert (usage.input_tokens, usage.output_tokens, usage.model) == (4, 9, "claude-x")


def test_json_over_the_cap_is_searched_near_its_end_only() -> None:
    filler = "x" * 5000
    body = json.dumps(
        {"text": filler, "usage": {"prompt_tokens": 2, "completion_tokens": 3}}
    ).encode()
    meter_usage = Usage()
    meter = UsageMeter(meter_usage, json_cap=1000)
    for chunk in split_every(body, 100):
        meter.observe(chunk, JSON)
    assert sum(len(c) for c in meter._json) <= 1000  # never buffered past the cap
    meter.finish()
    assert (meter_usage.input_tokens, meter_usage.output_tokens) == (2, 3)


def test_openai_sse_usage_in_final_chunk_split_anywhere() -> None:
    events = [
        b'data: {"model":"gpt-4o-mini","choices":[{"delta":{"content":"a"}}],"usage":null}\n\n',
        b'data: {"model":"gpt-4o-mini","choices":[],"usage":'
        b'{"prompt_tokens":20,"completion_tokens":30}}\n\n',
        b"data: [DONE]\n\n",
    ]
    stream = b"".join(events).replace(b"\n", b"\r\n")
    for size in (1, 7, len(stream)):
        usage = meter_over(split_every(stream, size), SSE)
        assert (usage.input_tokens, usage.output_tokens, usage.model) == (20, 30, "gpt-4o-mini")


def test_anthropic_sse_cumulative_output() -> None:
    stream = (
        b"event: message_start\n"
        b'data: {"type":"message_start","message":{"model":"claude-x",'
        b'"usage":{"input_tokens":12,"output_tokens":1}}}\n\n'
        b'event: message_delta\ndata: {"type":"message_delta","usage":{"output_tokens":5}}\n\n'
        b'event: message_delta\ndata: {"type":"message_delta","usage":{"output_tokens":9}}'
    )  # the last event is unterminated: finish() still reads it
    usage = meter_over(split_every(stream, 13), SSE)
    assert (usage.input_tokens, usage.output_tokens, usage.model) == (12, 9, "claude-x")


def test_openai_responses_sse_usage_in_response_completed() -> None:
    """The OpenAI Responses API (`/v1/responses`, a `chat` operation) streams its usage
    inside the final `response.completed` event's `response` object."""
    stream = (
        b"event: response.created\n"
        b'data: {"type":"response.created","response":{"model":"gpt-4o-mini","usage":null}}\n\n'
        b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta"}\n\n'
        b"event: response.completed\n"
        b'data: {"type":"response.completed","response":{"model":"gpt-4o-mini",'
        b'"usage":{"input_tokens":12,"output_tokens":5,"total_tokens":17}}}\n\n'
    )
    for size in (1, 9, len(stream)):
        usage = meter_over(split_every(stream, size), SSE)
        assert (usage.input_tokens, usage.output_tokens, usage.model) == (12, 5, "gpt-4o-mini")


def test_the_bodys_first_bytes_decide_how_it_is_read_split_anywhere() -> None:
    # Leading whitespace and a chunk too short to tell wait for more bytes (or the end).
    answer = b' \r\n {"model":"m","usage":{"prompt_tokens":2,"completion_tokens":3}}'
    stream = b'\n: hi\ndata: {"model":"m","usage":{"prompt_tokens":2,"completion_tokens":3}}\n\n'
    for body, label in ((answer, b"application/octet-stream"), (answer, SSE), (stream, JSON)):
        for size in (1, 3, len(body)):
            usage = meter_over(split_every(body, size), label)
            assert (usage.input_tokens, usage.output_tokens) == (2, 3), (body, label, size)


def test_other_content_and_garbage_report_nothing() -> None:
    # A body that is neither a JSON object nor an event stream, under a label that says
    # neither, is not metered (the SDKs read any label's JSON object or stream).
    assert meter_over([b'<p>"usage":{"prompt_tokens":1}}'], b"text/html") == Usage()
    assert (
        meter_over([b'\x00{"usage":{"prompt_tokens":1}}'], b"application/octet-stream") == Usage()
    )
    assert meter_over([b"plain words, no usage"], b"text/plain") == Usage()
    assert meter_over([b"data: {not json\n\n", b"\xff\xfe\n\n"], SSE) == Usage()
    assert meter_over([b'{"usage": {"prompt_tokens": true}}'], JSON) == Usage()


# --- money and prices -------------------------------------------------------------------


def test_money_is_exact() -> None:
    assert to_units(Decimal("0.1") + Decimal("0.2")) == to_units(Decimal("0.3"))
    assert from_units(to_units(Decimal("0.05"))) == Decimal("0.05")
    assert to_units(Decimal("0.0000000001")) == 1  # rounded up, never down
    assert format_money(Decimal("0.010000000")) == "0.01"
    assert format_money(Decimal("10")) == "10.00"


def test_price_book() -> None:
    prices = PriceBook(
        {
            "gpt-4o": PriceConfig(input_per_mtok=Decimal("2.5"), output_per_mtok=Decimal("10")),
            "gpt-4o-mini": PriceConfig(
                input_per_mtok=Decimal("0.15"), output_per_mtok=Decimal("0.60")
            ),
        }
    )
    assert prices.cost("gpt-4o-mini", 1000, 1000) == Decimal("0.00075")
    assert prices.cost("gpt-4o-mini-2024-07-18", 1000, 1000) == Decimal("0.00075")
    assert prices.cost("gpt-4o-2024", 1_000_000, 0) == Decimal("2.5")
    assert prices.cost("gpt-4omni", 1, 1) is None
    assert prices.cost("gpt-4o", None, None) is None
    default = Decimal("0.01")
    body = json.dumps({"model": "gpt-4o", "max_tokens": 1000, "messages": []}).encode()
    estimate = prices.estimate_hold(body, "gpt-4o", default)
    input_tokens = -(-len(body) // 4)
    assert estimate == (Decimal(input_tokens) * Decimal("2.5") + 1000 * Decimal(10)) / 10**6
    assert prices.estimate_hold(b'{"model":"gpt-4o"}', "gpt-4o", default) == default
    assert prices.estimate_hold(b'{"max_tokens":5}', None, default) == default
    assert prices.estimate_hold(None, "gpt-4o", default) == default


def test_price_book_reads_a_model_name_as_upstreams_do() -> None:
    """A dated name after `@` (Vertex AI's `claude-3-5-sonnet@20240620`) is priced as its
    base name, and a name in another case as the dearest of the names spelled alike but
    for case. Hand-made mutants that read `-` alone as a date's separator, or took the
    cheapest of such names, passed every test: both charged an unpriced default."""
    prices = PriceBook(
        {
            "claude-3-5-sonnet": PriceConfig(
                input_per_mtok=Decimal(3), output_per_mtok=Decimal(15)
            ),
            "Llama3.1:8B": PriceConfig(input_per_mtok=Decimal(0), output_per_mtok=Decimal(1)),
            "llama3.1:8b": PriceConfig(input_per_mtok=Decimal(0), output_per_mtok=Decimal(2)),
        }
    )
    assert prices.cost("claude-3-5-sonnet@20240620", 0, 1_000_000) == Decimal(15)
    assert prices.cost("LLAMA3.1:8b", 0, 1_000_000) == Decimal(2)
    assert prices.cost("Llama3.1:8B", 0, 1_000_000) == Decimal(1)  # its own name: its own


# --- ledgers ----------------------------------------------------------------------------

BUDGET = BudgetConfig(limit=Decimal("0.05"), window="month", default_hold=Decimal("0.01"))


@pytest.fixture(params=["memory", "sqlite", "postgresql"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> str | None:
    if request.param == "memory":
        return None
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ledger.db'}"
    url: str = request.getfixturevalue("pg_url")
    return url


@pytest.mark.anyio
async def test_hold_settle_release_exactly_once(store: str | None) -> None:
    ledger = open_ledger(store)
    try:
        holds: list[Hold] = []
        for _ in range(5):
            hold = await ledger.hold("acme", BUDGET, Decimal("0.01"))
            assert hold is not None
            holds.append(hold)
        assert await ledger.hold("acme", BUDGET, Decimal("0.000000001")) is None
        status = await ledger.status("acme", BUDGET)
        assert (status.spent, status.held, status.remaining) == (0, Decimal("0.05"), 0)

        await ledger.settle(holds[0], Decimal("0.004"))
        await ledger.settle(holds[0], Decimal("0.004"))  # a second settlement changes nothing
        await ledger.release(holds[0])
        await ledger.release(holds[1])
        await ledger.release(holds[1])
        status = await ledger.status("acme", BUDGET)
        assert (status.spent, status.held) == (Decimal("0.004"), Decimal("0.03"))
        # Room for 0.016 now: 0.016 fits, 0.000000001 more does not.
        assert await ledger.hold("acme", BUDGET, Decimal("0.016")) is not None
        assert await ledger.hold("acme", BUDGET, Decimal("0.000000001")) is None
        assert await ledger.hold("acme", BUDGET, Decimal("1")) is None
        # Budgets are independent.
        assert await ledger.hold("other", BUDGET, Decimal("0.05")) is not None
    finally:
        await ledger.aclose()


@pytest.mark.anyio
async def test_windows_are_utc_periods(store: str | None) -> None:
    moment = datetime(2026, 1, 31, 23, 59, tzinfo=UTC)
    assert window_start("day", moment) == "2026-01-31"
    assert window_start("month", moment) == "2026-01"
    assert window_start("total", moment) == "total"
    ledger = open_ledger(store)
    try:
        day = BudgetConfig(limit=Decimal("1"), window="day")
        hold = await ledger.hold("daily", day, Decimal("1"))
        assert hold is not None and hold.window_start == window_start("day")
        await ledger.settle(hold, Decimal("1"))
        status = await ledger.status("daily", day)
        assert status.window_start == window_start("day") and status.spent == 1
        # The same budget id under a total window is a different period: fresh room.
        total = BudgetConfig(limit=Decimal("1"), window="total")
        assert await ledger.hold("daily", total, Decimal("1")) is not None
    finally:
        await ledger.aclose()


@pytest.mark.anyio
async def test_budgets_and_usage_round_trip(store: str | None) -> None:
    ledger = open_ledger(store)
    try:
        assert await ledger.stored_budget("acme") is None
        await ledger.set_budget("acme", BUDGET)
        assert await ledger.stored_budget("acme") == BUDGET
        assert await ledger.stored_budgets() == {"acme": BUDGET}
        record = UsageRecord(
            request_id="r1",
            route="chat",
            tenant="t",
            candidates=("a", "b"),
            chosen="b",
            cost=Decimal("0.000000123"),
            charged=Decimal("0.01"),
            input_tokens=1,
        )
        await ledger.record_usage(record)
        (back,) = await ledger.usage(route="chat", tenant="t")
        assert back.cost == Decimal("0.000000123") and back.charged == Decimal("0.01")
        assert (back.candidates, back.chosen, back.input_tokens) == (("a", "b"), "b", 1)
        assert back.at == record.at
        assert await ledger.usage(route="nope") == []
    finally:
        await ledger.aclose()


@pytest.mark.anyio
async def test_settle_and_record_is_one_step_both_or_neither(ledger_store: str) -> None:
    ledger = open_ledger(ledger_store)
    assert isinstance(ledger, SettlesAndRecords)  # the SQL ledgers have it; the guard uses it
    try:
        held = await ledger.hold("acme", BUDGET, Decimal("0.01"))
        assert held is not None
        await ledger.settle_and_record(held, Decimal("0.004"), UsageRecord("r1", "chat", "t"))
        status = await ledger.status("acme", BUDGET)
        assert (status.spent, status.held) == (Decimal("0.004"), 0)
        # Settled once: a second settlement only records.
        await ledger.settle_and_record(held, Decimal("0.004"), UsageRecord("r2", "chat", "t"))
        await ledger.settle_and_record(None, Decimal(0), UsageRecord("r3", "chat", "t"))
        status = await ledger.status("acme", BUDGET)
        assert (status.spent, status.held) == (Decimal("0.004"), 0)
        assert [r.request_id for r in await ledger.usage()] == ["r1", "r2", "r3"]
        # A record the store refuses (request_id is NOT NULL) takes the settlement with it.
        second = await ledger.hold("acme", BUDGET, Decimal("0.01"))
        assert second is not None
        bad = record_the_store_refuses()
        with pytest.raises(Exception):  # noqa: B017 (each store names it its way)
            await ledger.settle_and_record(second, Decimal("0.002"), bad)
        status = await ledger.status("acme", BUDGET)
        assert (status.spent, status.held) == (Decimal("0.004"), Decimal("0.01"))
        assert len(await ledger.usage()) == 3
    finally:
        await ledger.aclose()


async def concurrent_holds(ledgers: list[Ledger], count: int) -> int:
    granted = 0

    async def one(ledger: Ledger) -> None:
        nonlocal granted
        if await ledger.hold("acme", BUDGET, Decimal("0.01")) is not None:
            granted += 1

    async with anyio.create_task_group() as group:
        for n in range(count):
            group.start_soon(one, ledgers[n % len(ledgers)])
    return granted


@pytest.mark.anyio
async def test_concurrent_holds_through_separate_ledgers_never_pass_the_limit(
    ledger_store: str,
) -> None:
    store = ledger_store
    # Separate ledger objects: separate SQLite connections / PostgreSQL pools, as separate
    # processes would have.
    ledgers = [open_ledger(store) for _ in range(3)]
    try:
        assert await concurrent_holds(ledgers, 30) == 5
        status = await ledgers[0].status("acme", BUDGET)
        assert status.held == Decimal("0.05")
    finally:
        for ledger in ledgers:
            await ledger.aclose()


@pytest.mark.anyio
async def test_schema_version_recorded_and_too_new_refused(tmp_path: Path) -> None:
    path = tmp_path / "l.db"
    ledger = open_ledger(f"sqlite:///{path}")
    await ledger.hold("acme", BUDGET, Decimal("0.01"))
    await ledger.aclose()
    with sqlite_db(path) as conn:
        rows = conn.execute("SELECT component, version FROM fmw_schema").fetchall()
        assert rows == [("ledger", LATEST_VERSION)]
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        assert all(t.startswith(("fmw_", "sqlite_")) for t in tables)
        conn.execute("UPDATE fmw_schema SET version = 999 WHERE component = 'ledger'")
    from fallback_mw.budget import LedgerUnavailable

    ledger = open_ledger(f"sqlite:///{path}")
    with pytest.raises(LedgerUnavailable):
        await ledger.hold("acme", BUDGET, Decimal("0.01"))
    await ledger.aclose()


@pytest.mark.anyio
async def test_postgres_schema_and_shared_table(pg_url: str) -> None:
    conn = await asyncpg.connect(pg_url)
    try:
        # Another component's row in the shared table is left alone.
        await conn.execute(
            "CREATE TABLE fmw_schema (component TEXT PRIMARY KEY, version INTEGER NOT NULL)"
        )
        await conn.execute("INSERT INTO fmw_schema VALUES ('routes', 3)")
        ledgers = [open_ledger(pg_url) for _ in range(3)]
        try:
            # Three pools migrating at once: the advisory lock serialises them.
            async with anyio.create_task_group() as group:
                for ledger in ledgers:
                    group.start_soon(ledger.status, "acme", BUDGET)
        finally:
            for ledger in ledgers:
                await ledger.aclose()
        rows = await conn.fetch("SELECT component, version FROM fmw_schema ORDER BY component")
        assert [tuple(r) for r in rows] == [("ledger", LATEST_VERSION), ("routes", 3)]
    finally:
        await conn.close()


@pytest.mark.anyio
async def test_stale_holds_are_settled_on_open(tmp_path: Path) -> None:
    from fallback_mw.store.ledgers.sqlite import SQLiteLedger

    path = str(tmp_path / "l.db")
    crashed = SQLiteLedger(path)
    assert await crashed.hold("acme", BUDGET, Decimal("0.02")) is not None
    await crashed.aclose()  # the process "died" holding 0.02
    later = SQLiteLedger(path, stale_hold_seconds=0)
    try:
        status = await later.status("acme", BUDGET)
        assert (status.spent, status.held) == (Decimal("0.02"), 0)
    finally:
        await later.aclose()


@pytest.mark.anyio
async def test_a_running_ledger_settles_holds_that_go_stale(ledger_store: str) -> None:
    """`serve --workers 2` on PostgreSQL: a worker SIGKILLed mid-request left its hold, and
    its replacement opened its ledger at once, while that hold was fresh. Settled only when
    a ledger opened, it stayed HELD (the budget's room gone) until a restart an hour on; a
    running ledger now settles it once it is stale, on a hold taken after that."""
    running = open_ledger(ledger_store)
    running.stale_hold_seconds = 0.2  # type: ignore[attr-defined]
    running.reap_interval = 0.2  # type: ignore[attr-defined]
    crashed = open_ledger(ledger_store)
    try:
        assert (await running.status("acme", BUDGET)).held == 0  # opened: nothing stale
        assert await crashed.hold("acme", BUDGET, Decimal("0.02")) is not None
        await crashed.aclose()  # the worker "died" holding 0.02
        await anyio.sleep(0.5)
        hold = await running.hold("acme", BUDGET, Decimal("0.01"))
        assert hold is not None
        status = await running.status("acme", BUDGET)
        assert (status.spent, status.held) == (Decimal("0.02"), Decimal("0.01"))
        await running.release(hold)
    finally:
        await running.aclose()


@pytest.mark.anyio
async def test_a_hold_reaped_while_its_request_ran_settles_what_it_cost_once(
    ledger_store: str,
) -> None:
    """A stream outlived the stale-hold age: the reaper settled its hold at its amount, and
    the request's own settlement then found no hold and changed nothing. It now replaces
    what the reaper charged with what the request cost, once."""
    ledger = open_ledger(ledger_store)
    ledger.stale_hold_seconds = 0.2  # type: ignore[attr-defined]
    ledger.reap_interval = 0  # type: ignore[attr-defined]
    try:
        long = await ledger.hold("acme", BUDGET, Decimal("0.01"))
        assert long is not None
        await anyio.sleep(0.4)  # older than the stale age: the next hold reaps it
        other = await ledger.hold("acme", BUDGET, Decimal("0.02"))
        assert other is not None
        status = await ledger.status("acme", BUDGET)
        assert (status.spent, status.held) == (Decimal("0.01"), Decimal("0.02"))  # reaped
        await ledger.settle(long, Decimal("0.003"))
        await ledger.settle(long, Decimal("0.003"))  # a second settlement changes nothing
        await ledger.release(other)
        status = await ledger.status("acme", BUDGET)
        assert (status.spent, status.held) == (Decimal("0.003"), 0)
    finally:
        await ledger.aclose()


@pytest.mark.anyio
async def test_memory_ledger_usage_is_bounded() -> None:
    ledger = MemoryLedger(usage_kept=3)
    for n in range(5):
        await ledger.record_usage(UsageRecord(request_id=str(n), route="r", tenant="t"))
    assert [r.request_id for r in await ledger.usage()] == ["2", "3", "4"]


@pytest.mark.anyio
async def test_a_gateway_clock_ahead_does_not_settle_live_holds_on_postgres(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Holds are stamped with PostgreSQL's now(); the stale cutoff was the gateway host's
    clock less an hour, so a host two hours ahead (NTP broken on one of several gateway
    machines) settled every other process's live hold at its amount. The cutoff is the
    database's clock now."""
    import datetime as real_datetime

    from fallback_mw.store.ledgers import postgres, postgres_reads

    class Ahead(real_datetime.datetime):
        @classmethod
        def now(cls, tz: real_datetime.tzinfo | None = None) -> Ahead:  # type: ignore[override]
            return super().now(tz) + real_datetime.timedelta(hours=2)  # type: ignore[return-value]

    holder = postgres.PostgresLedger(pg_url)
    try:
        assert await holder.hold("acme", BUDGET, Decimal("0.02")) is not None  # live
        monkeypatch.setattr(postgres_reads, "datetime", Ahead)  # the ledger's datetime
        skewed = postgres.PostgresLedger(pg_url)  # opening reaps stale holds
        try:
            status = await skewed.status("acme", BUDGET)
            assert (status.spent, status.held) == (Decimal(0), Decimal("0.02"))
        finally:
            await skewed.aclose()
    finally:
        await holder.aclose()


@pytest.mark.anyio
async def test_gateways_with_skewed_clocks_share_one_window_on_postgres(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The window a hold falls in was the gateway host's calendar day: with one of several
    gateway machines a day ahead (NTP broken, a VM restored with a wrong clock), its holds
    went to tomorrow's window, so together the gateways held twice the daily limit in one
    day, and `budgets show` on that host showed another day. On PostgreSQL, shared by every
    process, the window is the database's day."""
    import datetime as real_datetime

    from fallback_mw.budget import ledger as budget_ledger

    class Ahead(real_datetime.datetime):
        @classmethod
        def now(cls, tz: real_datetime.tzinfo | None = None) -> Ahead:  # type: ignore[override]
            return super().now(tz) + real_datetime.timedelta(days=1)  # type: ignore[return-value]

    daily = BudgetConfig(limit=Decimal("1"), window="day")
    right = open_ledger(pg_url)
    try:
        assert (await right.hold("acme", daily, Decimal("0.75"))) is not None
        today = window_start("day")
        monkeypatch.setattr(budget_ledger, "datetime", Ahead)
        assert window_start("day") != today  # this host's clock is a day ahead
        skewed = open_ledger(pg_url)
        try:
            assert await skewed.hold("acme", daily, Decimal("0.75")) is None  # no room today
            hold = await skewed.hold("acme", daily, Decimal("0.25"))
            assert hold is not None and hold.window_start == today
            status = await skewed.status("acme", daily)
            assert (status.window_start, status.held) == (today, Decimal(1))
            await skewed.settle(hold, Decimal("0.125"))
        finally:
            await skewed.aclose()
        status = await right.status("acme", daily)
        assert (status.spent, status.held) == (Decimal("0.125"), Decimal("0.75"))
    finally:
        await right.aclose()


@pytest.mark.anyio
async def test_a_windows_spend_saturates_alike_on_every_ledger(store: str | None) -> None:
    """docs/budgets.md: a window's `spent` stops growing at 4,000,000,000 (the SQL ledgers'
    64-bit columns). Five concurrent requests each charged the largest amount took the
    in-memory ledger to 5,000,000,000, the SQL ledgers to 4,000,000,000."""
    ledger = open_ledger(store)
    big = BudgetConfig(limit=Decimal(1_000_000_000), window="total")
    try:
        holds = [await ledger.hold("acme", big, Decimal("0.01")) for _ in range(5)]
        for hold in holds:
            assert hold is not None
            await ledger.settle(hold, Decimal(10) ** 40)
        status = await ledger.status("acme", big)
        assert (status.spent, status.held) == (Decimal(4_000_000_000), 0)
    finally:
        await ledger.aclose()
