"""BudgetGuard through a whole Gateway (in-process ASGI) against real ledgers: SQLite in
tmp_path and the real PostgreSQL. Upstreams are real aiohttp servers on 127.0.0.1."""

from __future__ import annotations

import json
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio
import pytest
from aiohttp import web

from fallback_mw import Gateway
from fallback_mw.cli import main
from fallback_mw.config import BudgetConfig, RouteConfig
from fallback_mw.layers.charge import charge
from fallback_mw.request.context import AttemptRecord, RequestContext
from fallback_mw.store.ledgers import open_ledger
from tests.helpers import client_for, sqlite_db
from tests.upstreams import Handler, free_port, host_app, status_handler, upstream

pytestmark = pytest.mark.anyio


def gateway_config(
    plan: dict[str, str],
    *,
    store: str | None,
    limit: str = "0.05",
    default_hold: str = "0.01",
    budget: str | None = "acme",
) -> dict[str, Any]:
    route: dict[str, Any] = {
        "id": "chat",
        "prefix": "/v1/",
        "plan": list(plan),
        "retries": len(plan) - 1,
        "replayable_methods": ["GET", "POST"],
        "deadline_ms": 10_000,
    }
    if budget is not None:
        route["budget"] = budget
    return {
        "gateway": {"store": store, "deadline_ms": 10_000},
        "upstreams": {name: {"url": url} for name, url in plan.items()},
        "routes": [route],
        "budgets": {"acme": {"limit": limit, "window": "month", "default_hold": default_hold}},
        "prices": {"gpt-test": {"input_per_mtok": "1000", "output_per_mtok": "2000"}},
    }


def json_handler(payload: dict[str, Any], delay: float = 0.0) -> Handler:
    async def handle(request: web.Request) -> web.StreamResponse:
        if delay:
            await anyio.sleep(delay)
        return web.json_response(payload)

    return handle


async def status_of(gateway: Gateway, budget_id: str = "acme") -> tuple[Decimal, Decimal]:
    ledger = gateway.services.ledger
    assert ledger is not None
    budget = BudgetConfig(limit=Decimal("0.05"), window="month")
    status = await ledger.status(budget_id, budget)
    return status.spent, status.held


async def test_twenty_concurrent_requests_five_served_fifteen_refused(ledger_store: str) -> None:
    async with upstream(json_handler({"ok": True}, delay=0.3)) as primary:
        gateway = Gateway(
            host_app, config=gateway_config({"primary": primary.url}, store=ledger_store)
        )
        try:
            async with client_for(gateway) as client:
                statuses: list[int] = []

                async def one() -> None:
                    response = await client.post("/v1/chat", content=b"{}")
                    statuses.append(response.status_code)
                    if response.status_code == 402:
                        assert response.json()["error"]["code"] == "budget_exceeded"
                        assert "x-gateway-provider" not in response.headers

                async with anyio.create_task_group() as group:
                    for _ in range(20):
                        group.start_soon(one)
            assert sorted(statuses) == [200] * 5 + [402] * 15
            assert primary.count == 5  # the refused 15 never reached an upstream
            assert await status_of(gateway) == (Decimal("0.05"), Decimal(0))
            ledger = gateway.services.ledger
            assert ledger is not None
            records = await ledger.usage(route="chat")
            assert len(records) == 20
            assert (
                sorted(r.outcome or "" for r in records)
                == ["budget_exceeded"] * 15 + ["served"] * 5
            )
        finally:
            await gateway.aclose()


async def test_failover_spends_one_hold(ledger_store: str) -> None:
    async with (
        upstream(status_handler(503)) as primary,
        upstream(json_handler({"ok": True})) as backup,
    ):
        plan = {"primary": primary.url, "backup": backup.url}
        gateway = Gateway(host_app, config=gateway_config(plan, store=ledger_store))
        try:
            async with client_for(gateway) as client:
                response = await client.post("/v1/chat", content=b"{}")
            assert response.status_code == 200
            assert response.headers["x-gateway-provider"] == "backup"
            assert response.headers["x-gateway-attempts"] == "2"
            assert (primary.count, backup.count) == (1, 1)
            # One hold of 0.01, settled once at the hold (no usage reported): not 0.02.
            assert await status_of(gateway) == (Decimal("0.01"), Decimal(0))
            ledger = gateway.services.ledger
            assert ledger is not None
            (record,) = await ledger.usage()
            assert record.chosen == "backup"
            assert [(a.candidate, a.status) for a in record.attempts] == [
                ("primary", 503),
                ("backup", 200),
            ]
            assert record.charged == Decimal("0.01")
        finally:
            await gateway.aclose()


async def test_nothing_served_releases_the_hold(ledger_store: str) -> None:
    async with upstream(status_handler(503)) as primary:
        gateway = Gateway(
            host_app, config=gateway_config({"primary": primary.url}, store=ledger_store)
        )
        try:
            async with client_for(gateway) as client:
                response = await client.post("/v1/chat", content=b"{}")
            assert response.status_code == 502
            assert await status_of(gateway) == (Decimal(0), Decimal(0))
        finally:
            await gateway.aclose()


OPENAI_JSON = {
    "id": "x",
    "model": "gpt-test-2024-01-01",
    "choices": [{"message": {"role": "assistant", "content": "hi"}}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
}


async def test_settlement_uses_reported_usage_json(ledger_store: str) -> None:
    async with upstream(json_handler(OPENAI_JSON)) as primary:
        gateway = Gateway(
            host_app, config=gateway_config({"primary": primary.url}, store=ledger_store)
        )
        try:
            async with client_for(gateway) as client:
                body = {"model": "gpt-test", "max_tokens": 5, "messages": []}
                response = await client.post("/v1/chat", json=body)
            assert response.status_code == 200
            # 3 * 1000/1e6 + 2 * 2000/1e6 = 0.003 + 0.004
            assert await status_of(gateway) == (Decimal("0.007"), Decimal(0))
            ledger = gateway.services.ledger
            assert ledger is not None
            (record,) = await ledger.usage()
            assert (record.input_tokens, record.output_tokens) == (3, 2)
            assert record.model == "gpt-test-2024-01-01"
            assert record.cost == record.charged == Decimal("0.007")
        finally:
            await gateway.aclose()


def sse_handler(events: list[bytes], delay: float = 0.0) -> Handler:
    async def handle(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for event in events:
            await response.write(event)
            if delay:
                await anyio.sleep(delay)
        await response.write_eof()
        return response

    return handle


ANTHROPIC_SSE = [
    b"event: message_start\n",
    b'data: {"type":"message_start","message":{"model":"gpt-test",'
    b'"usage":{"input_tokens":10,"output_tokens":1}}}\n\n',
    b'event: content_block_delta\ndata: {"type":"content_block_delta","delta":{"text":"hi"}}\n\n',
    b'event: message_delta\ndata: {"type":"message_delta","delta":{},',
    b'"usage":{"output_tokens":7}}\n\n',
    b'event: message_stop\ndata: {"type":"message_stop"}\n\n',
]


async def test_settlement_uses_reported_usage_sse(ledger_store: str) -> None:
    async with upstream(sse_handler(ANTHROPIC_SSE)) as primary:
        gateway = Gateway(
            host_app, config=gateway_config({"primary": primary.url}, store=ledger_store)
        )
        try:
            async with client_for(gateway) as client:
                response = await client.post("/v1/messages", content=b"{}")
            assert response.status_code == 200
            assert b"message_stop" in response.content
            # 10 * 0.001 + 7 * 0.002 = 0.024 (the default hold was 0.01)
            assert await status_of(gateway) == (Decimal("0.024"), Decimal(0))
        finally:
            await gateway.aclose()


async def test_hold_is_estimated_from_model_and_max_tokens(tmp_path: Path) -> None:
    limit = "0.05"
    store = f"sqlite:///{tmp_path / 'l.db'}"
    async with upstream(json_handler({"ok": True})) as primary:
        gateway = Gateway(
            host_app, config=gateway_config({"primary": primary.url}, store=store, limit=limit)
        )
        try:
            async with client_for(gateway) as client:
                # 100 output tokens at 2000/Mtok = 0.2 > 0.05: refused before any upstream.
                big = await client.post(
                    "/v1/chat", json={"model": "gpt-test", "max_tokens": 100, "messages": []}
                )
                small = await client.post(
                    "/v1/chat", json={"model": "gpt-test", "max_tokens": 1, "messages": []}
                )
            assert big.status_code == 402
            assert small.status_code == 200
            assert primary.count == 1
            spent, held = await status_of(gateway)
            # settled at the estimate: ceil(bytes/4) input tokens + 1 output token
            assert Decimal(0) < spent < Decimal("0.05")
            assert held == 0
        finally:
            await gateway.aclose()


def database_bytes(directory: Path) -> bytes:
    """The SQLite file and its WAL, raw."""
    return b"".join(path.read_bytes() for path in sorted(directory.glob("l.db*")))


@pytest.mark.parametrize("backend", ["postgresql", "sqlite"])
async def test_unreachable_ledger_fails_closed(backend: str, tmp_path: Path) -> None:
    # The ledger alone is unreachable (a gateway whose whole store is unreachable is
    # refused at start-up by the route store).
    if backend == "postgresql":
        ledger = open_ledger(f"postgresql://postgres@127.0.0.1:{free_port()}/nothing")
    else:
        ledger = open_ledger(f"sqlite:///{tmp_path / 'missing-dir' / 'ledger.db'}")
    async with upstream(json_handler({"ok": True})) as primary:
        config = gateway_config({"primary": primary.url}, store=None)
        gateway = Gateway(host_app, config=config, ledger=ledger)
        try:
            async with client_for(gateway) as client:
                response = await client.post("/v1/chat", content=b"{}")
            assert response.status_code == 503
            error = response.json()["error"]
            assert error["code"] == "budget_unavailable"
            # The store URL stays out of the message.
            assert not any(p in error["message"] for p in ("nothing", "postgres@", "missing-dir"))
            assert primary.count == 0
        finally:
            await gateway.aclose()


async def test_memory_ledger_without_store_and_unbudgeted_routes_still_recorded() -> None:
    async with upstream(json_handler(OPENAI_JSON)) as primary:
        gateway = Gateway(
            host_app, config=gateway_config({"primary": primary.url}, store=None, budget=None)
        )
        try:
            async with client_for(gateway) as client:
                response = await client.post(
                    "/v1/chat?key=q-secret", content=b'{"model":"gpt-test"}'
                )
            assert response.status_code == 200
            ledger = gateway.services.ledger
            assert ledger is not None
            (record,) = await ledger.usage()
            assert record.budget_id is None and record.charged is None
            assert record.cost == Decimal("0.007")
            assert "q-secret" not in repr(record)
        finally:
            await gateway.aclose()


async def test_budget_set_in_store_wins_and_unknown_budget_fails_closed(ledger_store: str) -> None:
    async with upstream(json_handler({"ok": True})) as primary:
        config = gateway_config({"primary": primary.url}, store=ledger_store, budget="other")
        gateway = Gateway(host_app, config=config)
        try:
            async with client_for(gateway) as client:
                unknown = await client.post("/v1/chat", content=b"{}")
                assert unknown.status_code == 503
                assert unknown.json()["error"]["code"] == "budget_unavailable"
                # An operator creates the budget in the store (as `budgets set` does).
                admin = open_ledger(ledger_store)
                try:
                    await admin.set_budget(
                        "other", BudgetConfig(limit=Decimal("0.02"), window="day")
                    )
                finally:
                    await admin.aclose()
                await anyio.sleep(2.1)  # the stored-budget cache
                codes = [(await client.post("/v1/chat", content=b"{}")).status_code for _ in "abc"]
            assert codes == [200, 200, 402]
            assert primary.count == 2
        finally:
            await gateway.aclose()


async def test_usage_records_hold_no_body_or_credentials(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'l.db'}"
    async with upstream(json_handler(OPENAI_JSON)) as primary:
        gateway = Gateway(host_app, config=gateway_config({"primary": primary.url}, store=store))
        try:
            async with client_for(gateway) as client:
                await client.post(
                    "/v1/chat?sig=q-secret",
                    content=json.dumps({"model": "gpt-test", "prompt": "body-secret"}),
                    headers={"authorization": "Bearer caller-secret", "x-tenant-id": "t1"},
                )
            ledger = gateway.services.ledger
            assert ledger is not None
            (record,) = await ledger.usage(tenant="t1")
            assert record.route == "chat" and record.chosen == "primary"
        finally:
            await gateway.aclose()
    raw = database_bytes(tmp_path)
    assert b"chat" in raw  # the file does hold the usage record, and no secret:
    for secret in (b"q-secret", b"body-secret", b"caller-secret"):
        assert secret not in raw


def settled_context(**fields: Any) -> RequestContext:
    route = RouteConfig(id="chat", prefix="/v1/", plan=("primary", "backup"), retries=1)
    return RequestContext(
        route=route, upstreams={}, tenant="acme", session=None, method="POST",
        path="/v1/chat", query=b"", deadline=time.monotonic() + 5, **fields,
    )  # fmt: skip


HELD = Decimal("0.5")


@pytest.mark.parametrize(
    ("fields", "statuses", "cost", "charged"),
    [
        # Served in full: the reported usage's cost, else the hold.
        ({"chosen": "primary", "completed": True}, [200], Decimal("0.1"), Decimal("0.1")),
        ({"chosen": "primary", "completed": True}, [200], None, HELD),
        # Cut short after the relay began: never less than the hold.
        ({"chosen": "primary", "completed": False}, [200], Decimal("0.1"), HELD),
        # Nothing served and no upstream answered: released.
        ({}, [503, 503], None, Decimal(0)),
        ({"client_disconnected": True}, [], None, Decimal(0)),
        ({"client_disconnected": True}, [503], None, Decimal(0)),
        # An upstream answered 200 but the client left before the relay began: the upstream
        # generated (and bills); its usage was never read: the hold.
        ({"client_disconnected": True}, [503, 200], None, HELD),
        # An upstream's 200 over max_response_body by its Content-Length: generated (and
        # billed), never relayed: the hold, as when found mid-body. A 4xx that big: nothing.
        ({"outcome": "response_too_large"}, [200], None, HELD),
        ({"outcome": "response_too_large"}, [404], None, Decimal(0)),
    ],
)
def test_what_a_settled_request_is_charged(
    fields: dict[str, Any], statuses: list[int], cost: Decimal | None, charged: Decimal
) -> None:
    context = settled_context(**fields)
    context.attempts = [
        AttemptRecord(candidate="primary", number=n, server_address="h", status=status)
        for n, status in enumerate(statuses, 1)
    ]
    assert charge(context, HELD, cost) == charged


async def test_an_answer_naming_no_model_is_priced_as_the_model_the_upstream_was_sent(
    ledger_store: str,
) -> None:
    # A candidate with `model = "gpt-test"` rewrites the caller's model. The answer named
    # no model, so the settlement priced the caller's: a caller naming a cheap priced model
    # was charged 0.00000002 for what the upstream generated (and bills) as gpt-test, 40.01.
    answer = {"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 20000}}
    async with upstream(json_handler(answer)) as primary, upstream(json_handler(answer)) as plain:
        conf = gateway_config({"primary": primary.url}, store=ledger_store, limit="1000")
        conf["upstreams"]["primary"]["model"] = "gpt-test"
        conf["upstreams"]["plain"] = {"url": plain.url}
        conf["routes"].append(
            {"id": "plain", "prefix": "/v2/", "plan": ["plain"], "budget": "acme"}
        )
        conf["prices"]["cheap"] = {"input_per_mtok": "0", "output_per_mtok": "0.000001"}
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                body = {"model": "cheap", "messages": []}
                assert (await client.post("/v1/chat", json=body)).status_code == 200
                assert (await client.post("/v2/chat", json=body)).status_code == 200
            assert json.loads(primary.received[0].body)["model"] == "gpt-test"
            ledger = gateway.services.ledger
            assert ledger is not None
            rewritten, sent_as_named = await ledger.usage()
            assert (rewritten.model, rewritten.charged) == ("gpt-test", Decimal("40.01"))
            # Without a rewrite the caller's model is the one the upstream was sent.
            assert (sent_as_named.model, sent_as_named.charged) == ("cheap", Decimal("0.00000002"))
            assert await status_of(gateway) == (Decimal("40.01000002"), Decimal(0))
        finally:
            await gateway.aclose()


async def test_an_answer_naming_an_unpriced_model_is_recorded_as_the_model_it_was_priced_as(
    ledger_store: str,
) -> None:
    # An upstream answering as a model without a price (an Anthropic-shaped answer naming
    # claude-3-5-haiku to a request for gpt-test) is priced as the model it was asked for;
    # the record showed the answer's name beside that cost, though docs/budgets.md says it
    # shows the model the cost is of. An answer naming a priced model keeps its own name.
    unpriced = {"model": "claude-3-5-haiku", "usage": {"input_tokens": 10, "output_tokens": 20000}}
    priced = {"model": "cheap", "usage": {"prompt_tokens": 10, "completion_tokens": 20000}}
    async with upstream(json_handler(unpriced)) as primary, upstream(json_handler(priced)) as other:
        conf = gateway_config({"primary": primary.url}, store=ledger_store, limit="1000")
        conf["upstreams"]["other"] = {"url": other.url}
        conf["routes"].append(
            {"id": "other", "prefix": "/v2/", "plan": ["other"], "budget": "acme"}
        )
        conf["prices"]["cheap"] = {"input_per_mtok": "0", "output_per_mtok": "0.000001"}
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                body = {"model": "gpt-test", "messages": []}
                assert (await client.post("/v1/chat", json=body)).status_code == 200
                assert (await client.post("/v2/chat", json=body)).status_code == 200
            ledger = gateway.services.ledger
            assert ledger is not None
            as_asked, as_named = await ledger.usage()
            assert (as_asked.model, as_asked.charged) == ("gpt-test", Decimal("40.01"))
            assert (as_named.model, as_named.charged) == ("cheap", Decimal("0.00000002"))
        finally:
            await gateway.aclose()


async def test_the_hold_prices_the_model_a_candidate_rewrites_the_request_to(
    ledger_store: str,
) -> None:
    # Every candidate rewrites the model (`model = "gpt-test"`): callers may name anything.
    # A caller naming an unpriced placeholder got default_hold (0.01) for max_tokens 100 of
    # gpt-test (0.2), over a limit of 0.05: the hold bounded nothing. It is now priced as
    # the model each candidate is sent.
    async with upstream(json_handler({"ok": True})) as primary:
        conf = gateway_config({"primary": primary.url}, store=ledger_store, limit="0.05")
        conf["upstreams"]["primary"]["model"] = "gpt-test"
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                big = {"model": "placeholder", "max_tokens": 100, "messages": []}
                small = {"model": "placeholder", "max_tokens": 1, "messages": []}
                assert (await client.post("/v1/chat", json=big)).status_code == 402
                assert (await client.post("/v1/chat", json=small)).status_code == 200
            assert primary.count == 1
            assert json.loads(primary.received[0].body)["model"] == "gpt-test"
        finally:
            await gateway.aclose()


async def test_a_stored_budget_this_version_cannot_read_fails_closed_not_a_bare_500(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A budget row another version wrote (a window this one does not know, say during a
    rolling upgrade) or a hand edit made every request of its routes a bare 500 with a
    pydantic traceback in the log, `budgets show` an "unexpected internal error", and
    `budgets set` could not write it again. The guard now fails closed (503
    budget_unavailable naming the budget and the fix), `budgets show` names the row, and
    `budgets set --limit` rewrites it."""
    path = tmp_path / "l.db"
    store = f"sqlite:///{path}"
    ledger = open_ledger(store)
    try:
        await ledger.set_budget("acme", BudgetConfig(limit=Decimal(1), window="day"))
    finally:
        await ledger.aclose()
    with sqlite_db(path) as db:
        db.execute("UPDATE fmw_budgets SET window_kind = 'fortnight'")

    async def cli(*argv: str) -> int:
        status: int = await anyio.to_thread.run_sync(main, list(argv))
        return status

    async with upstream(json_handler(OPENAI_JSON)) as primary:
        gateway = Gateway(host_app, config=gateway_config({"primary": primary.url}, store=store))
        try:
            async with client_for(gateway) as client:
                refused = await client.post("/v1/chat", json={"model": "gpt-test"})
                assert refused.status_code == 503, refused.text
                error = refused.json()["error"]
                assert error["code"] == "budget_unavailable" and "'acme'" in error["message"]
                assert "cannot read" in error["message"] and "fortnight" not in error["message"]
                assert primary.count == 0  # fail closed: nothing sent
                capsys.readouterr()
                assert await cli("budgets", "show", "--store", store) == 1
                err = capsys.readouterr().err
                assert "stored budget 'acme'" in err and "internal error" not in err
                assert await cli("budgets", "set", "--store", store, "--budget", "acme",
                                 "--limit", "1") == 0  # fmt: skip
                served = await client.post("/v1/chat", json={"model": "gpt-test"})
                assert served.status_code == 200, served.text
        finally:
            await gateway.aclose()


async def test_money_in_the_config_file_is_read_as_written(
    tmp_path: Path, ledger_store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A TOML float read through a binary float lost digits: `limit = 12345678.123456789`
    was kept as 12345678.12345679, a price of 0.12345678901234567891 per million tokens as
    0.12345678901234568 (10**15 output tokens charged 123456789.012345680, not
    123456789.012345679), and a limit with ten decimals, which is refused, was taken as a
    rounded one."""
    async with upstream(
        json_handler(
            {"model": "gpt-test", "usage": {"prompt_tokens": 0, "completion_tokens": 10**15}}
        )
    ) as primary:
        config = tmp_path / "gateway.toml"
        config.write_text(
            f"""
[gateway]
store = "{ledger_store}"

[upstreams.primary]
url = "{primary.url}"

[[routes]]
id = "chat"
prefix = "/v1/"
plan = ["primary"]
budget = "acme"

[budgets.acme]
limit = 12345678.123456789
window = "month"
default_hold = 0.000000001

[prices."gpt-test"]
input_per_mtok = 0.0
output_per_mtok = 0.12345678901234567891
"""
        )
        gateway = Gateway(host_app, config=str(config))
        try:
            async with client_for(gateway) as client:
                response = await client.post("/v1/chat", content=b'{"model": "gpt-test"}')
                assert response.status_code == 200, response.text
        finally:
            await gateway.aclose()
    capsys.readouterr()
    assert await anyio.to_thread.run_sync(main, ["budgets", "show", "--config", str(config)]) == 0
    (row,) = [line.split() for line in capsys.readouterr().out.splitlines() if line[:4] == "acme"]
    assert row[3:6] == ["12345678.123456789", "123456789.012345679", "0.00"], row
    assert await anyio.to_thread.run_sync(main, ["usage", "--config", str(config), "--json"]) == 0
    (record,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert record["charged"] == "123456789.012345679", record

    text = config.read_text().replace("12345678.123456789", "99999999.9999999999")
    config.write_text(text)
    assert await anyio.to_thread.run_sync(main, ["check", "--config", str(config)]) == 2
    assert "budgets.acme.limit" in capsys.readouterr().err


@pytest.fixture(params=["memory", "sqlite", "postgresql"])
def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> str | None:
    """No store (the in-memory ledger), a SQLite file, a fresh PostgreSQL."""
    if request.param == "memory":
        return None
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ledger.db'}"
    url: str = request.getfixturevalue("pg_url")
    return url


async def test_the_records_charges_add_up_to_the_spend_on_every_ledger(
    any_store: str | None,
) -> None:
    """Costs that fall between two nano-units: each settlement is rounded up to one, and so
    is each usage record's `cost` and `charged` on SQLite and PostgreSQL; the in-memory
    ledger kept the records' amounts as they came (1.3824e-11), so their sum was not the
    spend it reported (5 nano-units over 5 requests)."""
    store = any_store
    usage = {"prompt_tokens": 123, "completion_tokens": 4567}
    async with upstream(json_handler({"model": "tiny", "usage": usage})) as primary:
        config = gateway_config({"primary": primary.url}, store=store)
        config["prices"] = {"tiny": {"input_per_mtok": "0.000000001", "output_per_mtok": "3e-9"}}
        gateway = Gateway(host_app, config=config)
        try:
            async with client_for(gateway) as client:
                for _ in range(5):
                    response = await client.post("/v1/chat", content=b'{"model": "tiny"}')
                    assert response.status_code == 200
            ledger = gateway.services.ledger
            assert ledger is not None
            records = await ledger.usage(route="chat")
            assert [(r.cost, r.charged) for r in records] == [(Decimal("1e-9"),) * 2] * 5
            spent, held = await status_of(gateway)
            assert (
                (spent, held)
                == (sum(r.charged or 0 for r in records), 0)
                == (
                    Decimal("5e-9"),
                    0,
                )
            )
        finally:
            await gateway.aclose()
