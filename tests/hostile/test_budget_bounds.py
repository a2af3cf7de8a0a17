"""Absurd money and token numbers: refused at load with a clear message, or saturated
on the request path so a hold never sticks and the usage record is never lost."""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio
import pytest

from fallback_mw import Gateway
from fallback_mw.budget import cost
from fallback_mw.budget.cost import PriceBook, to_units
from fallback_mw.cli import main
from fallback_mw.config import BudgetConfig, ConfigError, PriceConfig, load_config
from fallback_mw.store.ledgers import open_ledger
from tests.helpers import client_for, http_scope, sqlite_db
from tests.test_budget_guard import gateway_config, json_handler
from tests.upstreams import host_app, upstream

pytestmark = pytest.mark.anyio


def test_budgets_set_with_an_absurd_limit_is_refused_cleanly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = f"sqlite:///{tmp_path / 'ledger.db'}"
    status = main(["budgets", "set", "--budget", "x", "--limit", "10000000000", "--store", store])
    err = capsys.readouterr().err
    assert status == 2
    assert "--limit must be at most" in err
    assert "Traceback" not in err


def test_a_budget_limit_of_1e12_in_the_file_is_refused_naming_the_key() -> None:
    conf = {"budgets": {"x": {"limit": 1e12}}}
    with pytest.raises(ConfigError, match=r"budgets\.x\.limit"):
        load_config(conf)


@pytest.mark.parametrize("value", ["inf", "nan", "-1"])
def test_non_finite_or_negative_limits_are_refused(value: str) -> None:
    with pytest.raises(ConfigError, match=r"budgets\.x\.limit"):
        load_config({"budgets": {"x": {"limit": value}}})


@pytest.mark.parametrize("key", ["limit", "default_hold"])
@pytest.mark.parametrize("value", ["0.1000000001", "1e-12", 1e-10])
def test_an_amount_finer_than_the_ledgers_unit_is_refused_naming_the_key(
    key: str, value: object
) -> None:
    # The ledgers keep nano-units, rounding up: a limit of 0.1000000001 was kept as
    # 0.100000001 and 1e-12 as 0.000000001, more than the operator asked for.
    budget = {"limit": "1", key: value}
    with pytest.raises(ConfigError, match=rf"budgets\.x\.{key}: .*at most 9 decimal places"):
        load_config({"budgets": {"x": budget}})


def test_budgets_set_stores_exactly_what_it_confirms(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # `budgets set --limit 0.1000000001` printed "limit 0.1000000001" and stored
    # 0.100000001; `--limit -0` printed "limit -0.00".
    store = f"sqlite:///{tmp_path / 'ledger.db'}"
    status = main(["budgets", "set", "--budget", "x", "--limit", "0.1000000001", "--store", store])
    captured = capsys.readouterr()
    assert status == 2 and "at most 9 decimal places" in captured.err
    assert "Traceback" not in captured.err
    assert main(["budgets", "show", "--store", store]) == 0
    assert "x " not in capsys.readouterr().out  # nothing stored
    assert main(["budgets", "set", "--budget", "x", "--limit", "-0", "--store", store]) == 0
    assert "limit 0.00 per month" in capsys.readouterr().out
    assert (
        main(["budgets", "set", "--budget", "x", "--limit", "0.123456789", "--store", store]) == 0
    )
    assert "limit 0.123456789 per month" in capsys.readouterr().out
    assert main(["budgets", "show", "--store", store]) == 0
    row = capsys.readouterr().out.splitlines()[1].split()
    assert row[:4] == ["x", "month", row[2], "0.123456789"], row


def test_to_units_saturates_instead_of_overflowing_a_bigint() -> None:
    assert to_units(Decimal(10) ** 40) == cost.MAX_UNITS
    assert cost.MAX_UNITS < 2**63
    assert to_units(Decimal("0.000000001")) == 1


def test_the_hold_takes_the_largest_output_limit_the_body_names() -> None:
    book = PriceBook({"m": PriceConfig(input_per_mtok=Decimal(0), output_per_mtok=Decimal(1))})
    body = b'{"model":"m","max_tokens":1,"max_completion_tokens":1000000}'
    assert book.estimate_hold(body, "m", Decimal("0.01")) == Decimal(1)


@pytest.mark.parametrize("parse", [True, False])
def test_an_output_limit_spelled_with_escapes_is_held(parse: bool) -> None:
    # `"max\u005ftokens"` is max_tokens to every JSON reader, the upstream's too; the
    # hold looked for the plain bytes first and took default_hold (0.01 for 1.00).
    book = PriceBook({"m": PriceConfig(input_per_mtok=Decimal(0), output_per_mtok=Decimal(1))})
    body = b'{"model":"m","max\\u005ftokens":1000000}'
    kwargs = {"parsed": json.loads(body)} if parse else {}
    assert book.estimate_hold(body, "m", Decimal("0.01"), **kwargs) == Decimal(1)


@pytest.mark.parametrize(
    "extra",
    [
        '"max_tokens":-1',  # a stray negative limit hides nothing
        '"max_tokens":true',
        '"max_tokens":"lots"',
        '"max_tokens":1.5',
        '"max_tokens":null',
    ],
)
def test_a_limit_that_limits_nothing_does_not_hide_the_largest(extra: str) -> None:
    book = PriceBook({"m": PriceConfig(input_per_mtok=Decimal(0), output_per_mtok=Decimal(1))})
    body = b'{"model":"m","max_completion_tokens":1000000,%s}' % extra.encode()
    assert book.estimate_hold(body, "m", Decimal("0.01")) == Decimal(1)


@pytest.mark.parametrize("spelling", ["1e6", "1000000.0", '"1000000"', '" 1000000 "'])
def test_a_limit_a_lenient_upstream_reads_as_an_integer_is_held(spelling: str) -> None:
    """`1e6`, `1000000.0` and `"1000000"` are 1,000,000 tokens to an upstream that coerces
    (pydantic's lax mode does): the hold prices them, not the default."""
    book = PriceBook({"m": PriceConfig(input_per_mtok=Decimal(0), output_per_mtok=Decimal(1))})
    body = b'{"model":"m","max_tokens":%s}' % spelling.encode()
    assert book.estimate_hold(body, "m", Decimal("0.01")) == Decimal(1)


def test_only_negative_limits_get_the_default_hold() -> None:
    book = PriceBook({"m": PriceConfig(input_per_mtok=Decimal(0), output_per_mtok=Decimal(1))})
    body = b'{"model":"m","max_tokens":-5}'
    assert book.estimate_hold(body, "m", Decimal("0.01")) == Decimal("0.01")


def test_a_deeply_nested_body_gets_the_default_hold_not_a_recursion_error() -> None:
    book = PriceBook({"m": PriceConfig(input_per_mtok=Decimal(1), output_per_mtok=Decimal(1))})
    body = b'{"model":"m","max_tokens":5,"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert book.estimate_hold(body, "m", Decimal("0.01")) == Decimal("0.01")


async def test_an_upstream_reporting_1e40_tokens_leaves_no_hold_and_a_usage_record(
    ledger_store: str,
) -> None:
    absurd = 10**40
    payload = {"model": "gpt-test", "usage": {"prompt_tokens": absurd, "completion_tokens": absurd}}
    async with upstream(json_handler(payload)) as primary:
        conf = gateway_config({"primary": primary.url}, store=ledger_store, limit="1000")
        gateway = Gateway(host_app, config=conf)
        ledger = gateway.services.ledger
        assert ledger is not None
        try:
            async with client_for(gateway) as client:
                response = await client.post(
                    "/v1/chat", content=b'{"model":"gpt-test","max_tokens":10}'
                )
                assert response.status_code == 200
            status = await ledger.status("acme", BudgetConfig(limit=Decimal(1000)))
            assert status.held == 0  # the hold was settled, not stuck
            assert status.spent > Decimal(1000)  # charged (saturated), not lost
            records = await ledger.usage(route="chat")
            assert len(records) == 1
            assert records[0].input_tokens == cost.MAX_TOKENS
            assert records[0].output_tokens == cost.MAX_TOKENS
        finally:
            await gateway.aclose()
    # A second ledger on the same store reads the row back: it fits the column.
    if not ledger_store.startswith("sqlite"):
        return
    again = open_ledger(ledger_store)
    try:
        assert len(await again.usage(route="chat")) == 1
    finally:
        await again.aclose()


@pytest.mark.parametrize(
    ("sent", "reported"),
    [
        ('"m\\ud800"', None),
        ('"gpt-test"', "gpt-\ud800"),
        ('"m\\u0000"', None),
        ('"gpt-test"', "gpt-\x00"),
    ],
    ids=["caller-model", "upstream-model", "caller-model-nul", "upstream-model-nul"],
)
async def test_a_model_name_no_text_column_holds_leaves_no_hold_and_a_usage_record(
    sent: str, reported: str | None, ledger_store: str
) -> None:
    # `"model": "m\\ud800"` (a lone surrogate) is valid JSON that no UTF-8 column can hold,
    # `"m\\u0000"` (NUL) one PostgreSQL text cannot: the settlement and its usage record
    # failed, so the hold stayed until the stale reaper charged it an hour later, the
    # record was lost, and PostgreSQL logged a ledger outage.
    payload: dict[str, Any] = {"usage": {"prompt_tokens": 1, "completion_tokens": 1}}
    if reported is not None:
        payload["model"] = reported
    async with upstream(json_handler(payload)) as primary:
        conf = gateway_config({"primary": primary.url}, store=ledger_store, limit="1000")
        gateway = Gateway(host_app, config=conf)
        ledger = gateway.services.ledger
        assert ledger is not None
        try:
            async with client_for(gateway) as client:
                body = b'{"model":%s,"max_tokens":10}' % sent.encode()
                response = await client.post("/v1/chat", content=body)
                assert response.status_code == 200
            status = await ledger.status("acme", BudgetConfig(limit=Decimal(1000)))
            assert status.held == 0  # the hold was settled, not stuck
            records = await ledger.usage(route="chat")
            assert len(records) == 1
            assert records[0].input_tokens == 1
        finally:
            await gateway.aclose()


async def test_a_tenant_no_text_column_holds_leaves_no_hold_and_a_usage_record(
    ledger_store: str, caplog: pytest.LogCaptureFixture
) -> None:
    # The tenant is the caller's header: an app driving the gateway in-process (or a host
    # middleware that sets it from a token's claim) can hand it a NUL, which the gateway
    # refuses (400) but PostgreSQL text cannot hold. The settlement and its usage record
    # failed together: the hold stayed until the stale reaper charged it, the record was
    # lost, and every such request logged a ledger outage (and its end) at WARNING.
    async with upstream(json_handler({})) as primary:
        conf = gateway_config({"primary": primary.url}, store=ledger_store, limit="1000")
        gateway = Gateway(host_app, config=conf)
        ledger = gateway.services.ledger
        assert ledger is not None
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        try:
            scope = http_scope("GET", "/v1/chat", headers=[(b"x-tenant-id", b"acme\x00x")])
            await gateway(scope, receive, send)
            assert sent[0]["status"] == 400
            status = await ledger.status("acme", BudgetConfig(limit=Decimal(1000)))
            assert status.held == 0  # released, not stuck
            (record,) = await ledger.usage(route="chat")
            assert record.tenant == "acme\\x00x" and record.outcome == "bad_request"
        finally:
            await gateway.aclose()
    assert not [r for r in caplog.records if "unreachable" in r.getMessage()]


@pytest.mark.anyio
@pytest.mark.parametrize(
    "row", [(-5, "month", 0), ("abc", "month", 0), (5, "week", 0), (5.5, "day", 1)]
)
async def test_a_budget_row_written_by_hand_fails_closed_naming_its_repair(
    tmp_path: Path, row: tuple[object, ...]
) -> None:
    """A stored budget row no `budgets set` writes (a negative or non-numeric limit, a
    window of 'week') raised out of the guard: each request of its routes was an internal
    error with a traceback, and `budgets set`, the repair, failed on the row it would
    rewrite. Now its routes answer 503 budget_unavailable naming the budget and the
    command, and that command rewrites it."""

    store = f"sqlite:///{tmp_path / 'ledger.db'}"
    set_seed = ["budgets", "set", "--store", store, "--budget", "seed", "--limit", "5"]
    assert await anyio.to_thread.run_sync(main, set_seed) == 0
    with sqlite_db(tmp_path / "ledger.db") as conn:
        conn.execute("INSERT INTO fmw_budgets VALUES ('x', ?, ?, ?, 't')", row)
    conf = {
        "gateway": {"store": store},
        "upstreams": {"p": {"url": "http://127.0.0.1:9"}},
        "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["p"], "budget": "x"}],
    }
    gateway = Gateway(host_app, config=conf)
    try:
        async with client_for(gateway) as client:
            response = await client.post("/v1/chat", json={"model": "m"})
    finally:
        await gateway.aclose()
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["code"] == "budget_unavailable"
    assert "budget 'x' is stored in a form this gateway cannot read" in error["message"]
    assert "budgets set --budget x --limit ..." in error["message"]
    repair = ["budgets", "set", "--store", store, "--budget", "x", "--limit", "3"]
    assert await anyio.to_thread.run_sync(main, repair) == 0
    ledger = open_ledger(store)
    try:
        assert (await ledger.stored_budget("x")) == BudgetConfig(limit=Decimal(3))
    finally:
        await ledger.aclose()
