"""The trace says why the walk went where it did: each `gateway.attempt` span carries the
walk's decision after it (`gateway.decision`, `gateway.decision.reason`: decide's action and
reason) and the request span the rule that ended the walk locally (`gateway.rule`, as the
log line and the error body). The attempt span still ends when the attempt finished (its
response head), not when the decision about it or the relayed body was done."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp import web

from fallback_mw import Gateway
from tests.helpers import client_for, http_scope
from tests.test_telemetry import ENV, Recorded, make_config, recorded
from tests.test_telemetry_leak import call
from tests.upstreams import host_app, status_handler, upstream

pytestmark = pytest.mark.anyio

__all__ = ["recorded"]  # the fixture, shared with tests/test_telemetry.py


def decisions(recorded: Recorded) -> list[tuple[str, Any, Any]]:
    return [
        (
            span.attributes["gateway.candidate"],  # type: ignore[index]
            span.attributes.get("gateway.decision"),  # type: ignore[union-attr]
            span.attributes.get("gateway.decision.reason"),  # type: ignore[union-attr]
        )
        for span in recorded.attempt_spans()
    ]


async def test_each_attempt_span_says_what_the_walk_did_next(recorded: Recorded) -> None:
    async with upstream(status_handler(503)) as p, upstream(status_handler(200)) as b:
        gateway = Gateway(
            host_app, config=make_config(p.url, b.url), environ=ENV, telemetry=recorded.telemetry
        )
        async with client_for(gateway) as client:
            response = await client.get("/v1/chat")
        await gateway.aclose()
    assert response.status_code == 200
    assert decisions(recorded) == [
        ("primary", "next_candidate", "failover-class: the next candidate"),
        ("backup", "serve", "a response outside failover_status is served"),
    ]
    assert "gateway.rule" not in recorded.request_span().attributes  # type: ignore[operator]


@pytest.mark.parametrize(
    ("method", "route", "why"),
    [
        (
            "GET",
            {"retries": 0, "plan": ["primary"]},
            "the attempt ceiling (1 + retries) is reached",
        ),
        ("POST", {}, "the request is not replayable (not_replayable_method)"),
    ],
)
async def test_a_pool_answer_served_with_a_key_left_says_why_no_other_key_was_tried(
    recorded: Recorded, method: str, route: dict[str, Any], why: str
) -> None:
    # A pool's first key answers 429 and the other key is never tried: the attempt span
    # said "a response outside failover_status is served", as if a pool's 429 never moved
    # to another key. It says what stopped the move (the ceiling, a POST).
    async with upstream(status_handler(429)) as p, upstream(status_handler(200)) as b:
        conf = make_config(p.url, b.url, **route)
        conf["upstreams"]["primary"]["auth_env"] = ["PRIMARY_KEY", "BACKUP_KEY"]
        gateway = Gateway(host_app, config=conf, environ=ENV, telemetry=recorded.telemetry)
        async with client_for(gateway) as client:
            response = await client.request(method, "/v1/chat", content=b"{}")
        await gateway.aclose()
    assert (response.status_code, p.count) == (429, 1)
    assert decisions(recorded) == [
        ("primary", "serve", f"429 within a credential pool, served as-is: {why}")
    ]


async def test_a_walk_a_rule_ended_names_the_rule_on_the_request_span(
    recorded: Recorded,
) -> None:
    async with upstream(status_handler(503)) as p, upstream(status_handler(200)) as b:
        gateway = Gateway(
            host_app, config=make_config(p.url, b.url), environ=ENV, telemetry=recorded.telemetry
        )
        async with client_for(gateway) as client:
            response = await client.post("/v1/chat", content=b"{}")
        await gateway.aclose()
    assert response.status_code == 502
    assert response.json()["error"]["rule"] == "not_replayable_method"
    assert decisions(recorded) == [
        ("primary", "local_error", "failover-class, but the request is not replayable")
    ]
    attributes = recorded.request_span().attributes
    assert attributes["gateway.rule"] == "not_replayable_method"  # type: ignore[index]
    assert attributes["gateway.plan.candidates"] == ("primary", "backup")  # type: ignore[index]


async def test_the_served_attempt_span_ends_at_its_head_not_after_the_stream(
    recorded: Recorded,
) -> None:
    async def streaming(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(4):
            await asyncio.sleep(0.1)
            await response.write(b"data: x\n\n")
        await response.write_eof()
        return response

    async with upstream(streaming) as p, upstream(status_handler(200)) as b:
        gateway = Gateway(
            host_app, config=make_config(p.url, b.url), environ=ENV, telemetry=recorded.telemetry
        )
        async with client_for(gateway) as client:
            response = await client.get("/v1/chat")
        await gateway.aclose()
    assert response.status_code == 200 and response.content.count(b"data: x") == 4
    ((candidate, decision, _),) = decisions(recorded)
    assert (candidate, decision) == ("primary", "serve")
    (attempt,) = recorded.attempt_spans()
    request = recorded.request_span()
    assert attempt.end_time is not None and request.end_time is not None
    # The body took at least 0.4 s after the head; the attempt span ended at the head.
    assert request.end_time - attempt.end_time >= 300_000_000


async def test_a_relay_failure_after_the_commit_names_the_abort_on_the_attempt(
    recorded: Recorded,
) -> None:
    async def cut(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: x\n\n")
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.close()
        return response

    async with upstream(cut) as p, upstream(status_handler(200)) as b:
        gateway = Gateway(
            host_app, config=make_config(p.url, b.url), environ=ENV, telemetry=recorded.telemetry
        )
        # A raw ASGI caller: the response is cut short (no final body message).
        status, _ = await call(gateway, http_scope("GET", "/v1/chat"), b"")
        await gateway.aclose()
    assert status == 200
    ((candidate, decision, reason),) = decisions(recorded)
    assert (candidate, decision) == ("primary", "abort")
    assert "commit point" in reason
    assert recorded.request_span().attributes["gateway.rule"] == "response_started"  # type: ignore[index]


async def test_a_deadline_the_caller_shortened_is_the_callers_in_the_trace(
    recorded: Recorded,
) -> None:
    # The error body named the caller's x-gateway-deadline-ms; the attempt span's reason
    # (and so `fallback-mw request`'s "next" column) said "the route deadline passed", and
    # an operator raised a deadline_ms that was never the one that ran out.
    async with upstream(status_handler(200, delay=2.0)) as p, upstream(status_handler(200)) as b:
        conf = make_config(p.url, b.url, deadline_ms=5000)
        gateway = Gateway(host_app, config=conf, environ=ENV, telemetry=recorded.telemetry)
        async with client_for(gateway) as client:
            cut = await client.get("/v1/chat", headers={"x-gateway-deadline-ms": "150"})
        await gateway.aclose()
    assert cut.status_code == 504
    assert "x-gateway-deadline-ms" in cut.json()["error"]["message"]
    [(candidate, action, reason)] = decisions(recorded)
    assert (candidate, action) == ("primary", "local_error")
    assert "x-gateway-deadline-ms" in reason, reason
    assert "route deadline" not in reason, reason


async def test_a_hedged_attempt_that_fails_first_ends_when_it_failed_not_with_the_race(
    recorded: Recorded,
) -> None:
    # The primary's own first-byte timeout (300 ms) ends it while its hedge (started at
    # 150 ms) still waits: its span, its record (`fallback-mw request`'s ms column) and its
    # breaker mark came only when the hedge ended, so the trace read a 300 ms timeout as
    # 450 ms, and an operator tuning first_byte_timeout_ms read the wrong number.
    from tests.upstreams import silent_server

    async with silent_server() as (hang, _), upstream(status_handler(200)) as b:
        conf = make_config(hang, b.url, retries=2, hedge_after_ms=150)
        conf["upstreams"]["primary"]["first_byte_timeout_ms"] = 300
        gateway = Gateway(host_app, config=conf, environ=ENV, telemetry=recorded.telemetry)
        async with client_for(gateway) as client:
            response = await client.get("/v1/chat")
        await gateway.aclose()
    assert (response.status_code, response.headers["x-gateway-attempts"]) == (200, "3")
    first, hedge, served = recorded.attempt_spans()
    assert [s.attributes["gateway.candidate"] for s in (first, hedge, served)] == [  # type: ignore[index]
        "primary", "primary", "backup"
    ]  # fmt: skip
    assert first.end_time is not None and hedge.end_time is not None
    assert first.attributes["gateway.failure.kind"] == "timeout"  # type: ignore[index]
    # Both waited their own 300 ms, the hedge 150 ms later: so it ended about 150 ms later.
    assert hedge.end_time - first.end_time >= 80_000_000, (first.end_time, hedge.end_time)
