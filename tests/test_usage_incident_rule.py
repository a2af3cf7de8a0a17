"""`fallback-mw usage --incidents` names the rule that ended each incident's walk, as the
request log line's `rule=` does: an operator reading the incidents after an outage sees
why a request was answered locally (the ceiling, a POST that is not replayable, the
deadline) without the logs of every gateway process."""

from __future__ import annotations

import json
import logging

import pytest

from tests.helpers import gateway_client
from tests.test_budget_cli import cli
from tests.test_cli_admin import gateway_config
from tests.upstreams import status_handler, upstream


@pytest.mark.anyio
async def test_incidents_name_the_rule_the_log_line_names(
    ledger_store: str, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    async with upstream(status_handler(503)) as primary, upstream(status_handler(503)) as backup:
        conf = gateway_config(
            ledger_store,
            upstreams={"primary": {"url": primary.url}, "backup": {"url": backup.url}},
            routes=[{"id": "chat", "prefix": "/v1/", "plan": ["primary", "backup"], "retries": 1}],
        )
        with caplog.at_level(logging.INFO):
            async with gateway_client(conf) as client:
                assert (await client.get("/v1/models")).status_code == 502  # the ceiling
                assert (await client.post("/v1/chat", content=b"{}")).status_code == 502
    logged = [
        r.getMessage() for r in caplog.records if r.getMessage().startswith("gateway request")
    ]
    rules = [line.split(" rule=")[1].split()[0] for line in logged]
    assert rules == ["ceiling", "not_replayable_method"]

    capsys.readouterr()
    assert await cli("usage", "--store", ledger_store, "--incidents", "--json") == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["rule"] for r in records] == rules

    assert await cli("usage", "--store", ledger_store, "--incidents") == 0
    header, *rows = capsys.readouterr().out.splitlines()
    column = header.index("RULE")
    assert [row[column:].split()[0] for row in rows] == rules


@pytest.mark.anyio
async def test_incidents_list_an_upstream_5xx_served_as_it_is(
    ledger_store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # A primary answering 500 (outside failover_status, relayed as it is) is a server error
    # the client got: the alert rules, gameday's error_rate, the WARNING line and the span
    # count it, but `usage --incidents` listed nothing, so the on-call reviewing an outage
    # found none of it. A 4xx served as it is stays the caller's answer, not an incident.
    async with upstream(status_handler(500)) as primary, upstream(status_handler(404)) as other:
        conf = gateway_config(
            ledger_store,
            upstreams={"primary": {"url": primary.url}, "other": {"url": other.url}},
            routes=[
                {"id": "chat", "prefix": "/v1/", "plan": ["primary"]},
                {"id": "files", "prefix": "/files/", "plan": ["other"]},
            ],
        )
        async with gateway_client(conf) as client:
            assert (await client.get("/v1/models")).status_code == 500
            assert (await client.get("/files/x")).status_code == 404

    capsys.readouterr()
    assert await cli("usage", "--store", ledger_store, "--incidents", "--json") == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["route"], r["incident"], r["outcome"]) for r in records] == [
        ("chat", ["server_error"], "served")
    ]


@pytest.mark.anyio
async def test_the_hosts_own_refusal_of_a_body_is_no_local_error_incident(
    ledger_store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # A host app whose max_body_size (Starlette's, FastAPI's) refuses a caller's upload
    # answers its own 413; the gateway books it `cancelled`, rule host_refused, no upstream
    # contacted. `usage --incidents` listed each as a `local_error` (the gateway answering
    # itself), so a client posting oversized bodies filled the on-call's incident review
    # with gateway errors the gateway never answered. It is the caller's doing, as the
    # gateway's own 413 request_too_large would be: no incident.
    from starlette.applications import Starlette

    from fallback_mw import Gateway
    from tests.helpers import client_for
    from tests.test_host_middleware import lifespan

    async with upstream(status_handler(200)) as primary:
        conf = gateway_config(
            ledger_store,
            upstreams={"primary": {"url": primary.url}},
            routes=[{"id": "chat", "prefix": "/v1/", "plan": ["primary"]}],
        )
        app = Starlette(max_body_size=100)
        app.add_middleware(Gateway, config=conf)
        async with lifespan(app), client_for(app) as client:
            assert (await client.post("/v1/chat", content=b"x" * 500)).status_code == 413
            assert (await client.post("/v1/chat", content=b"x" * 50)).status_code == 200

    capsys.readouterr()
    assert await cli("usage", "--store", ledger_store, "--json") == 0
    booked = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert sorted((r["outcome"], r["rule"]) for r in booked) == [
        ("cancelled", "host_refused"), ("served", None)
    ]  # fmt: skip
    assert await cli("usage", "--store", ledger_store, "--incidents", "--json") == 0
    assert capsys.readouterr().out.splitlines() == []
