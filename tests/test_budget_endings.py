"""How a budgeted request ended, as the ledger, `fallback-mw usage` and telemetry tell it:
one hold, one settlement and one usage record per request, on SQLite and PostgreSQL."""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

import anyio
import pytest

from fallback_mw import Gateway
from fallback_mw.cli import main
from tests.helpers import client_for, http_scope, request_then_disconnect
from tests.test_budget_guard import gateway_config, json_handler, status_of
from tests.upstreams import host_app, upstream

pytestmark = pytest.mark.anyio


async def test_an_attempt_the_client_left_during_reads_cancelled_in_usage(
    ledger_store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # The client left while the primary had not answered: the attempt was cancelled, the
    # span said so (gateway.failure.kind cancelled), but the usage record kept it with
    # neither a status nor a failure: `usage` showed the trail as 'primary:?'.
    async with upstream(json_handler({"ok": True}, delay=3)) as primary:
        gateway = Gateway(
            host_app, config=gateway_config({"primary": primary.url}, store=ledger_store)
        )
        try:
            sent: list[Any] = []

            async def send(message: Any) -> None:
                sent.append(message)

            scope = http_scope("POST", "/v1/chat")
            with anyio.fail_after(10):
                await gateway(scope, request_then_disconnect(after=0.3), send)
            assert sent == []
            assert await status_of(gateway) == (Decimal(0), Decimal(0))  # released
        finally:
            await gateway.aclose()
    capsys.readouterr()
    assert await anyio.to_thread.run_sync(main, ["usage", "--store", ledger_store, "--json"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    record = json.loads(line)
    assert record["outcome"] == "client_disconnected"
    assert record["attempts"] == [{"candidate": "primary", "failure": "cancelled"}]
    assert Decimal(record["charged"]) == 0
    assert await anyio.to_thread.run_sync(main, ["usage", "--store", ledger_store]) == 0
    table = capsys.readouterr().out
    assert "primary:cancelled" in table and "?" not in table


@pytest.mark.parametrize("limit", ["0", "0.01"])
async def test_a_hold_of_zero_needs_room_left_in_the_budget(ledger_store: str, limit: str) -> None:
    # With default_hold = 0 (charge only what the answer reports) a request the gateway
    # cannot estimate holds 0, and 0 fits `spent + held + 0 <= limit` when spent is the
    # whole limit: an exhausted budget kept serving, each answer charged past the limit,
    # and a budget set to 0 to block a tenant ("a limit of 0 refuses every request")
    # served every request.
    answer = {"model": "gpt-test", "usage": {"prompt_tokens": 5, "completion_tokens": 0}}
    async with upstream(json_handler(answer)) as primary:
        conf = gateway_config(
            {"primary": primary.url}, store=ledger_store, limit=limit, default_hold="0"
        )
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                statuses = [(await client.post("/v1/chat", content=b"{}")).status_code]
                statuses += [(await client.post("/v1/chat", content=b"{}")).status_code]
            # 5 input tokens at 1000/Mtok: 0.005; the second takes spent to the limit.
            expected = [402, 402] if limit == "0" else [200, 200]
            assert statuses == expected
            async with client_for(gateway) as client:
                refused = await client.post("/v1/chat", content=b"{}")
            assert refused.status_code == 402
            assert refused.json()["error"]["code"] == "budget_exceeded"
            spent, held = await status_of(gateway)
            assert (spent, held) == (Decimal(limit), Decimal(0))
            assert primary.count == expected.count(200)
        finally:
            await gateway.aclose()
