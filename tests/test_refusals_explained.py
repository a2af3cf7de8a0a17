"""Every refusal says which rule ended the walk and what would change it (SPEC §12): the
local error body's `"rule"` and a message naming the configuration key; the request log
line carries the rule; candidates passed over are listed in `x-gateway-skipped` and in
the log line."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from fallback_mw import Gateway
from fallback_mw.store.ledgers import open_ledger
from tests.helpers import client_for, gateway_client
from tests.test_defence_in_depth import saturated_listener
from tests.test_security import fake_dns
from tests.upstreams import closed_port_url, host_app, silent_server, status_handler, upstream

pytestmark = pytest.mark.anyio

__all__ = ["fake_dns"]  # the fixture, shared with tests/test_security.py

ENV = {"PRIMARY_KEY": "sk-primary-0001", "BACKUP_KEY": "sk-backup-0002"}


def config(primary: str, backup: str, gateway: dict[str, Any] | None = None, **route: Any) -> Any:
    return {
        "gateway": {"replay_buffer": 1024, **(gateway or {})},
        "upstreams": {
            "primary": {"url": primary, "auth_env": "PRIMARY_KEY"},
            "backup": {"url": backup, "auth_env": "BACKUP_KEY"},
        },
        "routes": [
            {"id": "chat", "prefix": "/v1/", "plan": ["primary", "backup"], "retries": 1, **route}
        ],
    }


def log_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "fallback_mw.request"]


@pytest.mark.parametrize(
    ("route", "method", "headers", "body", "rule", "says"),
    [
        ({}, "POST", {}, b"{}", "not_replayable_method",
         ['add "POST" to its replayable_methods', "replay_with_idempotency_key"]),
        ({"replayable_methods": ["GET", "DELETE"]}, "PATCH", {}, b"{}", "not_replayable_method",
         ['add "PATCH" to its replayable_methods']),
        ({"replay_with_idempotency_key": True}, "POST", {}, b"{}", "no_idempotency_key",
         ["without an Idempotency-Key header", "send one"]),
        ({"replayable_methods": ["PUT"]}, "PUT", {}, b"x" * 5000, "not_buffered",
         ["replay_buffer"]),
    ],
)  # fmt: skip
async def test_a_refused_failover_names_its_rule_and_the_key_that_would_change_it(
    caplog: pytest.LogCaptureFixture,
    route: dict[str, Any],
    method: str,
    headers: dict[str, str],
    body: bytes,
    rule: str,
    says: list[str],
) -> None:
    caplog.set_level(logging.INFO, logger="fallback_mw.request")
    async with upstream(status_handler(503)) as p, upstream(status_handler(200)) as b:
        conf = config(p.url, b.url, **route)
        async with gateway_client(conf, environ=ENV) as client:
            response = await client.request(method, "/v1/chat", content=body, headers=headers)
    assert (p.count, b.count) == (1, 0)
    assert response.status_code == 502
    error = response.json()["error"]
    assert (error["code"], error["rule"], error["attempts"]) == ("upstream_failed", rule, 1)
    for phrase in says:
        assert phrase in error["message"], error["message"]
    assert f"rule={rule}" in log_lines(caplog)[-1]


async def test_the_ceiling_and_the_deadline_are_named(caplog: pytest.LogCaptureFixture) -> None:
    async with upstream(status_handler(503)) as p, upstream(status_handler(503)) as b:
        conf = config(p.url, b.url)
        async with gateway_client(conf, environ=ENV) as client:
            response = await client.get("/v1/models")
    error = response.json()["error"]
    assert (response.status_code, error["rule"], error["attempts"]) == (502, "ceiling", 2)
    assert "raise the route's retries" in error["message"]

    async with (
        upstream(status_handler(200, delay=2.0)) as p,
        upstream(status_handler(200)) as b,
    ):
        conf = config(p.url, b.url, deadline_ms=100)
        async with gateway_client(conf, environ=ENV) as client:
            response = await client.get("/v1/models")
    error = response.json()["error"]
    assert (response.status_code, error["code"], error["rule"]) == (504, "deadline_exceeded",
                                                                     "deadline")  # fmt: skip
    assert "deadline_ms" in error["message"]


async def test_a_ceiling_reached_past_a_skipped_fallback_names_the_skip_not_more_retries() -> None:
    # A multipart upload (the SDK's files.create) on a route whose backup rewrites the
    # model: the backup is skipped, the walk repeats the primary, and the 502 said "raise
    # the route's retries", which would only send the upload to the primary once more.
    async with upstream(status_handler(503)) as p, upstream(status_handler(200)) as b:
        conf = config(p.url, b.url, replayable_methods=["POST"])
        conf["upstreams"]["backup"]["model"] = "openai/gpt-4o-mini"
        async with gateway_client(conf, environ=ENV) as client:
            response = await client.post("/v1/files", files={"file": ("a.jsonl", b"{}")})
    error = response.json()["error"]
    assert (response.status_code, error["rule"], b.count) == (502, "ceiling", 0)
    assert response.headers["x-gateway-skipped"] == "backup;reason=model_rewrite"
    assert error["message"].endswith(
        "the attempt ceiling (1 + retries) is reached with backup (model_rewrite) skipped: a "
        "candidate that rewrites the model takes only a JSON object body within [gateway] "
        "replay_buffer"
    ), error["message"]


async def test_a_walk_where_no_upstream_accepted_a_connection_says_check_the_urls() -> None:
    # A newcomer's first run: the upstreams are not running (or the urls are wrong). The
    # 502 said "last failure: transport" and "raise the route's retries".
    conf = config(closed_port_url(), closed_port_url())
    async with gateway_client(conf, environ=ENV) as client:
        response = await client.get("/v1/models")
    error = response.json()["error"]
    assert (response.status_code, error["rule"]) == (502, "ceiling")
    assert error["message"] == (
        "all 2 attempt(s) failed (last failure: transport (could not connect) at 'backup'); "
        "no candidate accepted a connection: check each candidate's url (`fallback-mw check` "
        "prints them) and that the upstream is running"
    )
    # One refused, one answering 503: the ceiling's own remedy stands.
    async with upstream(status_handler(503)) as b:
        conf = config(closed_port_url(), b.url)
        async with gateway_client(conf, environ=ENV) as client:
            response = await client.get("/v1/models")
    assert response.json()["error"]["message"].endswith(
        "(last failure: status 503 at 'backup'); the attempt ceiling (1 + retries) is reached; "
        "raise the route's retries"
    )


async def test_upstream_failed_names_the_last_candidate_and_what_it_did() -> None:
    # The local 502 carries no x-gateway-provider: its message is where the operator
    # learns which candidate failed last, and how.
    async with upstream(status_handler(503)) as p, upstream(status_handler(502)) as b:
        conf = config(p.url, b.url)
        async with gateway_client(conf, environ=ENV) as client:
            response = await client.get("/v1/models")
    message = response.json()["error"]["message"]
    assert "all 2 attempt(s) failed (last failure: status 502 at 'backup')" in message, message


async def test_a_ceiling_past_a_candidate_whose_variable_went_unset_says_to_set_it() -> None:
    # The host pops the backup's key from its environment after the gateway loaded (as
    # some apps hide secrets from child processes): the backup is skipped, the primary
    # repeated to the ceiling. The 502 explained how a 429's cool-down or a 401's
    # retirement ends; it names the variable to set, as the 503 with no attempt does, and
    # with the variable set the backup serves.
    async with upstream(status_handler(503)) as p, upstream(status_handler(200)) as b:
        conf = config(p.url, b.url, retries=2)
        answers = []
        for keep in (False, True):
            env = dict(ENV)
            gateway = Gateway(host_app, config=conf, environ=env)
            if not keep:
                del env["BACKUP_KEY"]
            try:
                async with client_for(gateway) as client:
                    answers.append(await client.get("/v1/models"))
            finally:
                await gateway.aclose()
    unset, followed = answers
    error = unset.json()["error"]
    assert (unset.status_code, error["rule"]) == (502, "ceiling")
    assert unset.headers["x-gateway-skipped"] == "backup;reason=no_credential"
    assert error["message"].endswith(
        "the attempt ceiling (1 + retries) is reached with backup (no_credential) skipped: set "
        "the auth_env variable of 'backup' in the gateway's environment"
    ), error["message"]
    assert (followed.status_code, followed.headers["x-gateway-provider"]) == (200, "backup")


async def test_a_hedge_that_lost_the_race_is_not_named_as_the_last_failure() -> None:
    # The primary answers 503 while the hedge sent after hedge_after_ms is still waiting;
    # the hedge then answers 503 too. The 502 said "last failure: cancelled at 'primary'"
    # (the hedge, cancelled by the gateway once the first 503 won the race); the first 503
    # no longer wins (a failover-class head lets the race go on), and the message names
    # a 503, never the gateway's own cancellation.
    hedge_sent = anyio.Event()
    first_answered = anyio.Event()
    arrived = 0

    async def primary(request: Any) -> Any:
        nonlocal arrived
        arrived += 1
        if arrived == 1:
            with anyio.fail_after(10):
                await hedge_sent.wait()
            first_answered.set()
            return await status_handler(503)(request)
        hedge_sent.set()
        with anyio.fail_after(10):
            await first_answered.wait()
        await anyio.sleep(0.1)  # the first 503 reaches the gateway first
        return await status_handler(503)(request)

    async with upstream(primary) as p, upstream(status_handler(200)) as b:
        conf = config(p.url, b.url, plan=["primary"], hedge_after_ms=50, deadline_ms=20_000)
        async with gateway_client(conf, environ=ENV) as client:
            response = await client.get("/v1/models")
    error = response.json()["error"]
    assert (response.status_code, error["rule"], error["attempts"]) == (502, "ceiling", 2)
    assert "(last failure: status 503 at 'primary')" in error["message"], error["message"]
    assert "cancelled" not in error["message"], error["message"]


@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
async def test_upstream_failed_says_which_of_its_timers_ended_the_last_attempt(
    engine: str,
) -> None:
    # A host that drops the connection's SYNs and one that takes the request and never
    # answers are both `timeout`; the 502 said only "last failure: timeout at 'backup'",
    # so the operator could not tell which key (connect_timeout_ms, first_byte_timeout_ms)
    # timed it, nor that the two candidates failed differently.
    async with silent_server() as (silent, _):
        with saturated_listener() as unreachable:
            for primary, backup, said in (
                (unreachable, silent, "no response head within its first_byte_timeout_ms (400"),
                (silent, unreachable, "no connection within its connect_timeout_ms (300"),
            ):
                conf = config(primary, backup, {"engine": engine}, deadline_ms=10_000)
                for name in ("primary", "backup"):
                    conf["upstreams"][name].update(
                        connect_timeout_ms=300, first_byte_timeout_ms=400
                    )
                async with gateway_client(conf, environ=ENV) as client:
                    response = await client.get("/v1/models")
                error = response.json()["error"]
                assert (response.status_code, error["rule"]) == (502, "ceiling")
                assert (
                    f"(last failure: timeout at 'backup': {said} ms)); the attempt ceiling"
                ) in error["message"], error["message"]


async def test_a_deadline_that_cuts_a_hang_names_the_timeout_that_would_let_it_fail_over() -> None:
    # The defaults (deadline_ms 5000, first_byte_timeout_ms 30000) in small: a hanging
    # primary is cut by the deadline before its own timer fires, so the walk never reaches
    # the backup. Raising deadline_ms, but not above the timer, changes nothing; the message
    # must name the timer, and following it must change the outcome.
    async def answered(conf: Any) -> Any:
        async with gateway_client(conf, environ=ENV) as client:
            return await client.get("/v1/models")

    async with (
        upstream(status_handler(200, delay=2.0)) as p,
        upstream(status_handler(200)) as b,
    ):
        first = await answered(config(p.url, b.url, deadline_ms=200))
        raised = await answered(config(p.url, b.url, deadline_ms=400))
        conf = config(p.url, b.url, deadline_ms=400)
        conf["upstreams"]["primary"]["first_byte_timeout_ms"] = 100
        followed = await answered(conf)
    error = first.json()["error"]
    assert (first.status_code, error["code"], error["rule"]) == (504, "deadline_exceeded",
                                                                  "deadline")  # fmt: skip
    assert "'primary'" in error["message"], error["message"]
    assert "first_byte_timeout_ms (30000 ms)" in error["message"], error["message"]
    assert raised.status_code == 504
    assert (followed.status_code, followed.headers["x-gateway-provider"]) == (200, "backup")


async def test_a_deadline_the_caller_shortened_is_named_as_the_callers() -> None:
    # The route allows 1500 ms and the primary's own timer (300 ms) would end a hang in
    # time for the backup; the caller asked for 200 ms. Raising the route's deadline_ms
    # changes nothing, so the message must name the caller's header and its value, and
    # following it (no header, or one above the timer) must change the outcome.
    async with (
        upstream(status_handler(200, delay=2.0)) as p,
        upstream(status_handler(200)) as b,
    ):
        conf = config(p.url, b.url, deadline_ms=1500)
        conf["upstreams"]["primary"]["first_byte_timeout_ms"] = 300
        async with gateway_client(conf, environ=ENV) as client:
            cut = await client.get("/v1/models", headers={"x-gateway-deadline-ms": "200"})
            longer = await client.get("/v1/models", headers={"x-gateway-deadline-ms": "1000"})
            unasked = await client.get("/v1/models")
    error = cut.json()["error"]
    assert (cut.status_code, error["code"], error["rule"]) == (504, "deadline_exceeded",
                                                                "deadline")  # fmt: skip
    message = error["message"]
    assert "200 ms the caller set with x-gateway-deadline-ms" in message, message
    assert "route's is 1500 ms" in message, message
    assert "above 300 ms" in message, message
    assert "raise the route's deadline_ms" not in message, message
    assert "deadline_ms above" not in message, message
    for followed in (longer, unasked):
        assert (followed.status_code, followed.headers["x-gateway-provider"]) == (200, "backup")


async def test_a_route_deadline_is_named_with_its_value_and_key() -> None:
    async with (
        upstream(status_handler(200, delay=2.0)) as p,
        upstream(status_handler(200)) as b,
    ):
        route = config(p.url, b.url, deadline_ms=150)
        gateway = config(p.url, b.url, gateway={"deadline_ms": 150})
        for conf, key in ((route, "the route's deadline_ms"), (gateway, "[gateway] deadline_ms")):
            async with gateway_client(conf, environ=ENV) as client:
                response = await client.get("/v1/models")
            message = response.json()["error"]["message"]
            assert "the route deadline (150 ms) passed" in message, message
            assert key in message, message
            assert "x-gateway-deadline-ms" not in message, message


async def test_skipped_candidates_are_named_in_a_header_and_the_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="fallback_mw.request")
    breaker = {"breaker": {"window": 1, "min_calls": 1, "failure_rate": 1.0,
                           "cooldown_ms": 600_000}}  # fmt: skip
    async with upstream(status_handler(503)) as p, upstream(status_handler(200)) as b:
        conf = config(p.url, b.url, gateway=breaker)
        async with gateway_client(conf, environ=ENV) as client:
            first = await client.get("/v1/models")  # primary 503 opens its breaker
            second = await client.get("/v1/models")
    assert first.headers["x-gateway-provider"] == "backup"
    assert "x-gateway-skipped" not in first.headers
    assert second.status_code == 200 and second.headers["x-gateway-attempts"] == "1"
    assert second.headers["x-gateway-skipped"] == "primary;reason=breaker_open"
    assert p.count == 1
    assert log_lines(caplog)[-1].endswith(" skipped=primary;reason=breaker_open")


async def test_nothing_attempted_lists_what_was_skipped() -> None:
    breaker = {"breaker": {"window": 1, "min_calls": 1, "failure_rate": 1.0,
                           "cooldown_ms": 600_000}}  # fmt: skip
    async with upstream(status_handler(503)) as p, upstream(status_handler(503)) as b:
        conf = config(p.url, b.url, gateway=breaker)
        async with gateway_client(conf, environ=ENV) as client:
            await client.get("/v1/models")  # both answer 503: both breakers open
            response = await client.get("/v1/models")
    error = response.json()["error"]
    assert (response.status_code, error["code"], error["rule"]) == (503, "route_exhausted",
                                                                     "no_candidate")  # fmt: skip
    assert "primary (breaker_open), backup (breaker_open)" in error["message"]
    assert "[gateway.breaker] cooldown_ms" in error["message"]
    assert "the plan of route 'chat' would be tried" in error["message"]
    assert response.headers["x-gateway-skipped"] == (
        "primary;reason=breaker_open, backup;reason=breaker_open"
    )


async def test_a_caller_that_leaves_is_named_in_the_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from fallback_mw import Gateway
    from tests.helpers import http_scope, request_then_disconnect
    from tests.upstreams import host_app

    caplog.set_level(logging.INFO, logger="fallback_mw.request")
    sent: list[Any] = []

    async def send(message: Any) -> None:
        sent.append(message)

    async with upstream(status_handler(200, delay=5.0)) as p, upstream(status_handler(200)) as b:
        gateway = Gateway(host_app, config=config(p.url, b.url), environ=ENV)
        await gateway(http_scope("GET", "/v1/models"), request_then_disconnect(0.2), send)
        await gateway.aclose()
    assert sent == []  # nobody left to answer
    assert log_lines(caplog)[-1].startswith("gateway request route=chat outcome=client_disconn")
    assert "rule=client_gone" in log_lines(caplog)[-1]


@pytest.fixture(params=["memory", "redis"])
def state(request: pytest.FixtureRequest) -> str:
    if request.param == "memory":
        return "memory://"
    url: str = request.getfixturevalue("redis_url")
    return url


async def test_route_exhausted_says_when_to_retry(state: str) -> None:
    # Every candidate skipped: the 503 says when the first one may be tried again (a
    # breaker half-opens, a pool credential returns), so an SDK does not retry blindly.
    breaker = {"breaker": {"window": 1, "min_calls": 1, "failure_rate": 1.0,
                           "cooldown_ms": 20_000}}  # fmt: skip
    pool_env = {**ENV, "KEY_A": "key-a", "KEY_B": "key-b"}
    async with (
        upstream(status_handler(503)) as p,
        upstream(status_handler(429, **{"retry-after": "40"})) as limited,
        upstream(status_handler(401)) as revoked,
    ):
        conf = config(p.url, limited.url, gateway={"state": state, **breaker})
        conf["upstreams"]["backup"]["auth_env"] = ["KEY_A", "KEY_B"]
        conf["routes"][0]["plan"] = ["primary"]
        conf["routes"][0]["retries"] = 0
        conf["routes"].append({"id": "pool", "prefix": "/v2/", "plan": ["backup"], "retries": 1})
        conf["upstreams"]["revoked"] = {"url": revoked.url, "auth_env": ["KEY_A", "KEY_B"]}
        conf["routes"].append({"id": "gone", "prefix": "/v3/", "plan": ["revoked"], "retries": 1})
        async with gateway_client(conf, environ=pool_env) as client:
            assert (await client.get("/v1/x")).status_code == 502  # opens the breaker
            opened = await client.get("/v1/x")
            assert (await client.get("/v2/x")).status_code == 429  # both keys cool down
            cooled = await client.get("/v2/x")
            assert (await client.get("/v3/x")).status_code == 401  # both keys retired
            retired = await client.get("/v3/x")
    for response, most in ((opened, 20), (cooled, 40)):
        assert (response.status_code, response.json()["error"]["code"]) == (503, "route_exhausted")
        # whole seconds, rounded up; a loaded machine may have spent a few of them
        assert most - 5 <= int(response.headers["retry-after"]) <= most, response.headers
    # A retired credential does not come back by itself: no time to give.
    assert retired.status_code == 503
    assert "retry-after" not in retired.headers


async def test_the_budget_guards_refusals_say_what_would_change_them(tmp_path: Path) -> None:
    # 402 and 503 from the guard: the message names the budget and the key or command an
    # operator changes, and tells an undefined budget from a ledger that cannot be reached
    # (an operator chasing a store outage for a typo in `budget` is the failure here).
    async with upstream(status_handler(200)) as p, upstream(status_handler(200)) as b:
        conf = config(p.url, b.url, gateway={"store": f"sqlite:///{tmp_path / 'gw.db'}"})
        conf["budgets"] = {"acme": {"limit": "0", "window": "day"}}
        conf["routes"][0]["budget"] = "acme"
        conf["routes"].append(
            {"id": "typo", "prefix": "/v2/", "plan": ["primary"], "budget": "acmee"}
        )
        async with gateway_client(conf, environ=ENV) as client:
            exceeded = (await client.post("/v1/chat", content=b"{}")).json()["error"]
            undefined = (await client.post("/v2/chat", content=b"{}")).json()["error"]
        conf["gateway"]["store"] = None
        conf["routes"].pop()  # without a store, an undefined budget is refused at load
        ledger = open_ledger(f"sqlite:///{tmp_path / 'missing-dir' / 'ledger.db'}")
        async with gateway_client(conf, environ=ENV, ledger=ledger) as client:
            unreachable = (await client.post("/v1/chat", content=b"{}")).json()["error"]
    assert (p.count, b.count) == (0, 0)
    assert (exceeded["code"], exceeded["rule"]) == ("budget_exceeded", "budget")
    for phrase in ("'acme'", "limit", "fallback-mw budgets set"):
        assert phrase in exceeded["message"], exceeded["message"]
    assert undefined["code"] == "budget_unavailable"
    for phrase in ("'acmee'", "[budgets.acmee]", "fallback-mw budgets set"):
        assert phrase in undefined["message"], undefined["message"]
    assert "cannot be reached" not in undefined["message"]
    assert unreachable["code"] == "budget_unavailable"
    for phrase in ("cannot be reached", "[gateway] store", "budget"):
        assert phrase in unreachable["message"], unreachable["message"]
    assert "missing-dir" not in unreachable["message"]  # never the store's URL


async def test_a_budget_refusal_without_a_store_names_the_file_not_a_command_that_cannot_reach_it(
    tmp_path: Path,
) -> None:
    # A new user's first budget: [budgets.acme] in the file, no [gateway] store. The 402
    # said to raise the limit "with `fallback-mw budgets set --budget acme --limit
    # AMOUNT`", which needs a store (it is refused without one) and could never reach this
    # gateway's ledger, kept in its own memory: the file's limit and a restart is the way.
    async with upstream(status_handler(200)) as p, upstream(status_handler(200)) as b:
        conf = config(p.url, b.url)
        conf["budgets"] = {
            "acme": {"limit": "0.02", "window": "day", "default_hold": "0.01"},
            "zero": {"limit": "0", "window": "day"},
            "small": {"limit": "0.01", "window": "day", "default_hold": "0.01"},
        }
        conf["prices"] = {"gpt-x": {"input_per_mtok": "0", "output_per_mtok": "20"}}
        conf["routes"][0]["budget"] = "acme"
        conf["routes"] += [
            {"id": "z", "prefix": "/v2/", "plan": ["primary"], "budget": "zero"},
            {"id": "s", "prefix": "/v3/", "plan": ["primary"], "budget": "small"},
        ]
        async with gateway_client(conf, environ=ENV) as client:
            for _ in range(2):
                assert (await client.post("/v1/chat", content=b"{}")).status_code == 200
            spent = (await client.post("/v1/chat", content=b"{}")).json()["error"]
            zero = (await client.post("/v2/chat", content=b"{}")).json()["error"]
            big = b'{"model":"gpt-x","max_tokens":100000}'
            alone = (await client.post("/v3/chat", content=big)).json()["error"]
        # The same refusal with a store: the command reaches the gateways' ledger.
        conf["gateway"] = {**conf.get("gateway", {}), "store": f"sqlite:///{tmp_path / 'g.db'}"}
        async with gateway_client(conf, environ=ENV) as client:
            stored = (await client.post("/v2/chat", content=b"{}")).json()["error"]
    for refusal, section in ((spent, "acme"), (zero, "zero"), (alone, "small")):
        assert refusal["code"] == "budget_exceeded", refusal
        message = refusal["message"]
        assert "budgets set" not in message, message
        assert f"[budgets.{section}] limit" in message and "restart" in message, message
        assert "no [gateway] store" in message, message
    assert "fallback-mw budgets set --budget zero --limit AMOUNT" in stored["message"]


async def test_a_hold_larger_than_the_whole_limit_says_so_not_wait_for_the_next_window(
    tmp_path: Path,
) -> None:
    # A caller asking for max_tokens 100,000 of a budget whose whole limit is 1.00 was told
    # the limit "is spent or held" and to "wait for its next window", at zero spend: no
    # window would ever have room. The message now says the request's hold is over the
    # whole limit, how much, and what in the request (or the budget) would change it.
    async with upstream(status_handler(200)) as p, upstream(status_handler(200)) as b:
        conf = config(p.url, b.url, gateway={"store": f"sqlite:///{tmp_path / 'gw.db'}"})
        conf["budgets"] = {
            "acme": {"limit": "1", "window": "day"},
            "zero": {"limit": "0", "window": "day"},
        }
        conf["prices"] = {"gpt-x": {"input_per_mtok": "0", "output_per_mtok": "20"}}
        conf["routes"][0]["budget"] = "acme"
        conf["routes"].append({"id": "z", "prefix": "/v2/", "plan": ["primary"], "budget": "zero"})
        async with gateway_client(conf, environ=ENV) as client:
            big = b'{"model":"gpt-x","max_tokens":100000}'
            alone = (await client.post("/v1/chat", content=big)).json()["error"]
            zero = (await client.post("/v2/chat", content=b"{}")).json()["error"]
            fits = b'{"model":"gpt-x","max_tokens":40000}'  # 0.80: the first fits, not the next
            assert (await client.post("/v1/chat", content=fits)).status_code == 200
            full = (await client.post("/v1/chat", content=fits)).json()["error"]
    assert p.count == 1
    assert alone["code"] == zero["code"] == full["code"] == "budget_exceeded"
    for phrase in ("hold of 2.00", "whole limit", "max_tokens", "'acme'", "budgets set"):
        assert phrase in alone["message"], alone["message"]
    assert "next window" not in alone["message"]
    for phrase in ("hold of 0.01", "default_hold", "whole limit", "'zero'"):
        assert phrase in zero["message"], zero["message"]
    assert "max_tokens" not in zero["message"]
    # A window with no room left for a hold that would fit an empty one: wait, or raise.
    assert "spent or held" in full["message"] and "next window" in full["message"]


async def test_a_body_that_stalls_during_the_attempt_names_the_keys_like_one_before_it() -> None:
    # A body over replay_buffer streams to the attempt; the caller stops sending half-way.
    # The 408 said only "the request body did not arrive in time", where the same refusal
    # before any attempt names the deadline and header_timeout_ms.
    from fallback_mw import Gateway
    from tests.helpers import http_scope
    from tests.upstreams import host_app

    sent: list[Any] = []

    async def send(message: Any) -> None:
        sent.append(message)

    calls = 0

    async def receive() -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            return {"type": "http.request", "body": b"x" * 2000, "more_body": True}
        await anyio.sleep(30)
        return {"type": "http.disconnect"}

    async with upstream(status_handler(200)) as p, upstream(status_handler(200)) as b:
        conf = config(p.url, b.url, deadline_ms=300, replayable_methods=["POST"])
        gateway = Gateway(host_app, config=conf, environ=ENV)
        headers = [(b"content-length", b"4000")]
        await gateway(http_scope("POST", "/v1/files", headers=headers), receive, send)
        await gateway.aclose()
    assert sent[0]["status"] == 408
    error = json.loads(sent[1]["body"])["error"]
    assert (error["code"], error["rule"], error["attempts"]) == ("request_timeout",
                                                                 "body_timeout", 1)  # fmt: skip
    assert "deadline_ms" in error["message"], error["message"]
    assert "header_timeout_ms" in error["message"], error["message"]


async def test_an_address_the_connect_time_guard_refuses_names_allow_hosts(
    fake_dns: dict[str, Any],
) -> None:
    # The primary's name resolved to a public address when the config loaded, and to a
    # loopback one when the request was sent (a DNS change, or a rebinding attempt). The
    # 502 said "last failure: unsafe_address at 'primary'" and nothing an operator could
    # act on; it names allow_hosts, and following it (listing the address) serves.
    async with upstream(status_handler(200)) as p, upstream(status_handler(200)) as b:
        port = p.url.rsplit(":", 1)[1]
        fake_dns["answers"]["rebind.test"] = "93.184.216.34"
        primary = f"http://rebind.test:{port}"
        backup = b.url.replace("127.0.0.1", "localhost")
        conf = config(primary, backup, gateway={"allow_hosts": ["rebind.test", "localhost"]})
        listed = config(primary, backup, gateway={"allow_hosts": ["rebind.test", "localhost",
                                                                  "127.0.0.1"]})  # fmt: skip
        async with gateway_client(conf, environ=ENV) as client:
            fake_dns["answers"]["rebind.test"] = "127.0.0.1"
            refused = await client.get("/v1/models")
        assert p.count == 0  # nothing reached the loopback service
        async with gateway_client(listed, environ=ENV) as client:
            followed = await client.get("/v1/models")
    error = refused.json()["error"]
    assert (refused.status_code, error["code"], error["rule"]) == (502, "upstream_failed",
                                                                    "unsafe_address")  # fmt: skip
    assert "unsafe_address at 'primary'" in error["message"], error["message"]
    assert "allow_hosts" in error["message"], error["message"]
    assert "127.0.0.1" not in error["message"]  # the address is not told to the caller
    assert (followed.status_code, followed.headers["x-gateway-provider"]) == (200, "primary")


async def test_a_deadline_that_runs_out_in_the_backoff_names_backoff_ms() -> None:
    # One candidate, one retry: the primary's 503 is repeated after backoff_ms, which is
    # longer than what the deadline leaves. The 504 said "raise the route's deadline_ms"
    # and nothing of the wait the walk spent it on; it names backoff_ms, and following
    # it (a shorter backoff) lets the repeat run.
    answers = iter([503, 503, 200])

    async def flaky(request: Any) -> Any:
        return await status_handler(next(answers))(request)

    async with upstream(flaky) as p, upstream(status_handler(200)) as b:
        conf = config(p.url, b.url, plan=["primary"], deadline_ms=400, backoff_ms=5000)
        async with gateway_client(conf, environ=ENV) as client:
            started = time.monotonic()
            waited = await client.get("/v1/models")
            # The backoff is cut at the deadline (one budget for the walk), not slept whole.
            assert time.monotonic() - started < 2.5
        conf["routes"][0]["backoff_ms"] = 25
        async with gateway_client(conf, environ=ENV) as client:
            followed = await client.get("/v1/models")
    error = waited.json()["error"]
    assert (waited.status_code, error["rule"], error["attempts"]) == (504, "deadline", 1)
    assert "backoff_ms (5000 ms)" in error["message"], error["message"]
    assert "'primary'" in error["message"], error["message"]
    assert (followed.status_code, followed.headers["x-gateway-attempts"]) == (200, "2")


async def test_a_deadline_that_runs_out_waiting_for_a_connection_names_max_connections() -> None:
    # A batch route holds the primary's only connection (max_connections = 1); a chat
    # request queues behind it until its deadline. The 504 said the primary "was still
    # inside its first_byte_timeout_ms: lower that below 300 ms", a timer that had not
    # started (the wait for a slot is the gateway's own queue): lowering it changes
    # nothing. It names max_connections, and following it serves the request.
    holding = anyio.Event()

    async def handler(request: Any) -> Any:
        if request.path.startswith("/batch/"):
            holding.set()
            await anyio.sleep(1.5)
        return await status_handler(200)(request)

    async with upstream(handler) as p, upstream(status_handler(200)) as b:
        conf = config(p.url, b.url, deadline_ms=300)
        conf["routes"].append({"id": "batch", "prefix": "/batch/", "plan": ["primary"]})
        conf["upstreams"]["primary"].update(max_connections=1, first_byte_timeout_ms=5000)
        answers = []
        for slots in (1, 2):
            conf["upstreams"]["primary"]["max_connections"] = slots
            holding = anyio.Event()
            async with gateway_client(conf, environ=ENV) as client, anyio.create_task_group() as tg:
                tg.start_soon(client.get, "/batch/run")
                with anyio.fail_after(5):
                    await holding.wait()
                answers.append(await client.get("/v1/models"))
    waited, followed = answers
    error = waited.json()["error"]
    assert (waited.status_code, error["rule"], error["attempts"]) == (504, "deadline", 1)
    assert "waiting for a free connection" in error["message"], error["message"]
    assert "raise the max_connections of 'primary'" in error["message"], error["message"]
    assert "first_byte_timeout_ms" not in error["message"], error["message"]
    assert (followed.status_code, followed.headers["x-gateway-provider"]) == (200, "primary")


async def test_the_log_line_says_which_status_made_each_candidate_fail_over(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # "chosen=backup attempts=2" said that the primary failed, not how: a transport error
    # or a timeout was named (`failures=primary:timeout`), a 503 was not, and the local
    # 502 names only the last candidate's status.
    caplog.set_level(logging.INFO, logger="fallback_mw.request")
    async with (
        upstream(status_handler(503)) as p,
        upstream(status_handler(502)) as down,
        upstream(status_handler(200)) as b,
    ):
        async with gateway_client(config(p.url, b.url), environ=ENV) as client:
            served = await client.get("/v1/models")
        async with gateway_client(config(p.url, down.url), environ=ENV) as client:
            failed = await client.get("/v1/models")
        async with gateway_client(config(closed_port_url(), down.url), environ=ENV) as client:
            mixed = await client.get("/v1/models")
    assert (served.status_code, failed.status_code, mixed.status_code) == (200, 502, 502)
    lines = log_lines(caplog)
    assert lines[0].endswith(" failures=primary:503"), lines[0]
    assert lines[1].endswith(" rule=ceiling failures=primary:503,backup:502"), lines[1]
    assert lines[2].endswith(" rule=ceiling failures=primary:transport,backup:502"), lines[2]


async def test_the_405_advice_keeps_the_methods_the_route_forwards_now() -> None:
    # "list PROPFIND in its methods" taken at its word (methods = ["PROPFIND"]) forwards
    # PROPFIND and sends every GET and POST of the route to the host app instead. The
    # message gives the whole list; following it forwards PROPFIND and keeps the rest.
    import re

    async with upstream(status_handler(200)) as p, upstream(status_handler(200)) as b:
        async with gateway_client(config(p.url, b.url), environ=ENV) as client:
            refused = await client.request("PROPFIND", "/v1/files")
        error = refused.json()["error"]
        assert (refused.status_code, error["rule"]) == (405, "methods")
        found = re.search(r"methods = (\[[^\]]*\])", error["message"])
        assert found is not None, error["message"]
        conf = config(p.url, b.url, methods=json.loads(found.group(1)))
        async with gateway_client(conf, environ=ENV) as client:
            forwarded = await client.request("PROPFIND", "/v1/files")
            kept = await client.get("/v1/models")
    assert (forwarded.status_code, forwarded.headers["x-gateway-provider"]) == (200, "primary")
    assert (kept.status_code, kept.headers["x-gateway-provider"]) == (200, "primary")


@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
async def test_an_https_url_for_a_plain_http_upstream_is_not_told_to_set_ca_file(
    engine: str,
) -> None:
    # The url says https:// and the upstream speaks plain HTTP (or the port is another
    # service's): the handshake fails before any certificate is seen. The 502 said "the
    # upstream's TLS certificate did not verify: set ca_file", which changes nothing; it
    # says to check the url's scheme and port, and following it serves.
    async with upstream(status_handler(200)) as p, upstream(status_handler(200)) as b:
        wrong = config(p.url.replace("http://", "https://"), b.url, plan=["primary"],
                       gateway={"engine": engine})  # fmt: skip
        right = config(p.url, b.url, plan=["primary"], gateway={"engine": engine})
        async with gateway_client(wrong, environ=ENV) as client:
            refused = await client.get("/v1/models")
        async with gateway_client(right, environ=ENV) as client:
            followed = await client.get("/v1/models")
    error = refused.json()["error"]
    assert (refused.status_code, error["code"]) == (502, "upstream_failed")
    assert "last failure: tls at 'primary'" in error["message"], error["message"]
    assert "ca_file" not in error["message"], error["message"]
    assert "did not verify" not in error["message"], error["message"]
    assert "scheme" in error["message"], error["message"]
    assert (followed.status_code, followed.headers["x-gateway-provider"]) == (200, "primary")


async def test_a_pool_that_401s_retired_says_what_brings_a_key_back(redis_url: str) -> None:
    # Every key of the pool answered 401 (revoked at the vendor). The 503 listed when a
    # 429's cool-down or a spent quota ends, neither of which applies: a 401 retirement
    # lasts the gateway's life, and 24 h in Redis, restarts included. It says so, and
    # what does bring one back: a working key under a new variable name in auth_env.
    async def vendor(request: Any) -> Any:
        ok = request.headers.get("authorization") == "Bearer key-c"
        return await status_handler(200 if ok else 401)(request)

    env = {**ENV, "KEY_A": "key-a", "KEY_B": "key-b", "KEY_C": "key-c"}
    async with upstream(vendor) as p, upstream(status_handler(200)) as b:
        conf = config(p.url, b.url, gateway={"state": redis_url}, plan=["primary"])
        conf["upstreams"]["primary"]["auth_env"] = ["KEY_A", "KEY_B"]
        async with gateway_client(conf, environ=env) as client:
            assert (await client.get("/v1/models")).status_code == 401  # both retired
            retired = await client.get("/v1/models")
        async with gateway_client(conf, environ=env) as client:  # a restart
            restarted = await client.get("/v1/models")
        conf["upstreams"]["primary"]["auth_env"] = ["KEY_A", "KEY_C"]
        async with gateway_client(conf, environ=env) as client:
            followed = await client.get("/v1/models")
    error = retired.json()["error"]
    assert (retired.status_code, error["code"]) == (503, "route_exhausted")
    assert "401" in error["message"], error["message"]
    assert "new variable name" in error["message"], error["message"]
    assert restarted.status_code == 503
    assert (followed.status_code, followed.headers["x-gateway-provider"]) == (200, "primary")


@pytest.mark.parametrize("plan", [["primary"], ["primary", "backup"]])
async def test_a_pool_whose_every_key_this_request_tried_says_so_not_when_keys_come_back(
    plan: list[str],
) -> None:
    # Each key of the pool answered 503 once; the next pass skipped the pool
    # (no_credential: a pool's key is used at most once per request). The 502 explained
    # how a quota 429's or a 401's retirement ends, neither of which happened; it says
    # every key was tried, and what helps: another key in auth_env (which then answers).
    async def vendor(request: Any) -> Any:
        ok = request.headers.get("authorization") == "Bearer key-c"
        return await status_handler(200 if ok else 503)(request)

    env = {**ENV, "KEY_A": "key-a", "KEY_B": "key-b", "KEY_C": "key-c"}
    async with upstream(vendor) as p, upstream(status_handler(503)) as b:
        conf = config(p.url, b.url, plan=plan, retries=2 * len(plan))
        conf["upstreams"]["primary"]["auth_env"] = ["KEY_A", "KEY_B"]
        async with gateway_client(conf, environ=env) as client:
            tried = await client.get("/v1/models")
        conf["upstreams"]["primary"]["auth_env"] = ["KEY_A", "KEY_B", "KEY_C"]
        async with gateway_client(conf, environ=env) as client:
            followed = await client.get("/v1/models")
    error = tried.json()["error"]
    assert (tried.status_code, error["code"]) == (502, "upstream_failed")
    assert tried.headers["x-gateway-skipped"] == "primary;reason=no_credential"
    assert (
        "each of the 2 keys of 'primary' was tried once in this request (a pool's key at most "
        "once per request): list more keys in its auth_env"
    ) in error["message"], error["message"]
    assert "429" not in error["message"] and "401" not in error["message"], error["message"]
    assert (followed.status_code, followed.headers["x-gateway-provider"]) == (200, "primary")


async def test_the_log_line_says_which_status_moved_a_pool_to_its_next_key(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # "chosen=primary attempts=2" for a request one upstream answered: the first key's 401
    # (the reason the pool moved on and retired it) was on the span, not on the line.
    caplog.set_level(logging.INFO, logger="fallback_mw.request")

    async def vendor(request: Any) -> Any:
        ok = request.headers.get("authorization") == "Bearer key-b"
        return await status_handler(200 if ok else 401)(request)

    env = {**ENV, "KEY_A": "key-a", "KEY_B": "key-b"}
    async with upstream(vendor) as p, upstream(status_handler(200)) as b:
        conf = config(p.url, b.url, plan=["primary"])
        conf["upstreams"]["primary"]["auth_env"] = ["KEY_A", "KEY_B"]
        conf["upstreams"]["primary"]["selection"] = "round_robin"
        async with gateway_client(conf, environ=env) as client:
            responses = [await client.get("/v1/models") for _ in range(2)]
    assert [r.status_code for r in responses] == [200, 200]
    lines = log_lines(caplog)
    moved = [line for line in lines if "attempts=2" in line]
    assert len(moved) == 1, lines
    assert moved[0].endswith(" failures=primary:401"), moved[0]


async def test_a_route_with_no_fallback_says_so_rather_than_raise_retries() -> None:
    # `routes add` without --fallback (or a plan of one): the primary's 503 ended in "the
    # attempt ceiling is reached; raise the route's retries", which only repeats the
    # failing primary. Nothing was there to fail over to: the message says so, and
    # following it (a fallback in the plan, with a retry to reach it) serves.
    async with upstream(status_handler(503)) as p, upstream(status_handler(200)) as b:
        alone = config(p.url, b.url, plan=["primary"], retries=0)
        async with gateway_client(alone, environ=ENV) as client:
            refused = await client.get("/v1/models")
        async with gateway_client(config(p.url, b.url), environ=ENV) as client:
            followed = await client.get("/v1/models")
    error = refused.json()["error"]
    assert (refused.status_code, error["rule"]) == (502, "ceiling")
    assert "no fallback" in error["message"], error["message"]
    assert "set-fallback" in error["message"], error["message"]
    assert (followed.status_code, followed.headers["x-gateway-provider"]) == (200, "backup")


async def test_a_post_on_a_route_without_a_fallback_is_told_both_changes() -> None:
    # "add POST to replayable_methods to let it fail over" on a route of one candidate and
    # no retries: followed, the POST still made its one attempt and got the same 502.
    async with upstream(status_handler(503)) as p, upstream(status_handler(200)) as b:
        alone = config(p.url, b.url, plan=["primary"], retries=0)
        async with gateway_client(alone, environ=ENV) as client:
            refused = await client.post("/v1/chat", content=b"{}")
        both = config(p.url, b.url, replayable_methods=["POST"])
        async with gateway_client(both, environ=ENV) as client:
            followed = await client.post("/v1/chat", content=b"{}")
    error = refused.json()["error"]
    assert (refused.status_code, error["rule"]) == (502, "not_replayable_method")
    assert 'add "POST" to its replayable_methods' in error["message"], error["message"]
    assert "no fallback and no retries" in error["message"], error["message"]
    assert (followed.status_code, followed.headers["x-gateway-provider"]) == (200, "backup")


@pytest.mark.parametrize(
    ("route", "method", "headers", "rule"),
    [
        ({"replay_with_idempotency_key": True}, "POST", {}, "no_idempotency_key"),
        ({}, "PATCH", {}, "not_replayable_method"),
    ],
)  # fmt: skip
async def test_a_method_refusal_for_a_body_over_replay_buffer_names_replay_buffer_too(
    route: dict[str, Any], method: str, headers: dict[str, str], rule: str
) -> None:
    # A platform team's large upload (a POST or PATCH over replay_buffer) ended in "send an
    # Idempotency-Key" / "add PATCH to replayable_methods"; followed, the next upload got
    # the same 502, now as not_buffered. The message names both changes, and following
    # both serves from the backup.
    body = b"x" * 5000  # replay_buffer is 1024 in config()
    async with upstream(status_handler(503)) as p, upstream(status_handler(200)) as b:
        async with gateway_client(config(p.url, b.url, **route), environ=ENV) as client:
            refused = await client.request(method, "/v1/files", content=body, headers=headers)
        both = config(
            p.url, b.url, gateway={"replay_buffer": 8192},
            **{**route, "replayable_methods": ["GET", method]},
        )  # fmt: skip
        async with gateway_client(both, environ=ENV) as client:
            followed = await client.request(method, "/v1/files", content=body)
    error = refused.json()["error"]
    assert (refused.status_code, error["rule"]) == (502, rule)
    assert "replay_buffer" in error["message"], error["message"]
    assert (followed.status_code, followed.headers["x-gateway-provider"]) == (200, "backup")


@pytest.mark.parametrize(
    ("route", "method"),
    [({"plan": ["primary"], "retries": 0}, "GET"), ({}, "POST")],
)  # fmt: skip
async def test_a_deadline_that_cuts_the_only_attempt_does_not_promise_a_next_one(
    route: dict[str, Any], method: str
) -> None:
    # A long-polling internal service behind a route of one candidate (or a POST, which
    # never fails over): the deadline cut its hang and the message said to lower the
    # primary's first_byte_timeout_ms "so that a hang ends in time for the next attempt".
    # There is none: followed, the 504 became a 502. What serves is a deadline above the
    # wait; the message says that, and that the lower timeout would not fail it over.
    async with (
        upstream(status_handler(200, delay=0.5)) as p,
        upstream(status_handler(200)) as b,
    ):
        async with gateway_client(config(p.url, b.url, deadline_ms=200, **route),
                                  environ=ENV) as client:  # fmt: skip
            cut = await client.request(method, "/v1/poll", content=b"{}")
        async with gateway_client(config(p.url, b.url, deadline_ms=2000, **route),
                                  environ=ENV) as client:  # fmt: skip
            followed = await client.request(method, "/v1/poll", content=b"{}")
    error = cut.json()["error"]
    assert (cut.status_code, error["rule"]) == (504, "deadline")
    message = error["message"]
    assert "first_byte_timeout_ms (30000 ms)" in message, message
    assert "in time for the next attempt" not in message, message
    assert "raise the route's deadline_ms" in message, message
    assert (followed.status_code, followed.headers["x-gateway-provider"]) == (200, "primary")


async def test_a_deadline_that_cuts_a_connect_names_connect_timeout_ms() -> None:
    # An internal host that is down drops the SYNs: the primary's connect waits its
    # connect_timeout_ms (3000 by default) and a short route deadline (800 ms) ends the
    # walk before the backup. The 504 said only "raise the route's deadline_ms"; it names
    # the connect timeout now, and following it (a connect_timeout_ms below the deadline)
    # serves from the backup.
    import contextlib
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)  # never accepted: once its queue is full, SYNs are dropped
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(3):
        filler = socket.socket()
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            filler.connect(("127.0.0.1", port))
        fillers.append(filler)
    try:
        async with upstream(status_handler(200)) as b:
            down = f"http://127.0.0.1:{port}"
            conf = config(down, b.url, deadline_ms=800)
            conf["upstreams"]["primary"]["first_byte_timeout_ms"] = 300
            async with gateway_client(conf, environ=ENV) as client:
                cut = await client.get("/v1/models")
            conf["upstreams"]["primary"]["connect_timeout_ms"] = 300
            async with gateway_client(conf, environ=ENV) as client:
                followed = await client.get("/v1/models")
    finally:
        for sock in (*fillers, listener):
            sock.close()
    error = cut.json()["error"]
    assert (cut.status_code, error["rule"]) == (504, "deadline")
    assert "connect_timeout_ms (3000 ms)" in error["message"], error["message"]
    assert (followed.status_code, followed.headers["x-gateway-provider"]) == (200, "backup")


@pytest.mark.parametrize("deadline", ["1", "2", "40"])
async def test_a_caller_deadline_too_short_to_split_is_not_answered_with_a_timeout_to_lower(
    deadline: str,
) -> None:
    # A caller sent x-gateway-deadline-ms: 1 and the 504 said "lower that timeout below
    # 1 ms so that a hang ends in time for the next attempt": no timeout can be that low
    # (1 ms is the least), and one that low would fail every attempt. What helps is the
    # caller's own deadline: a larger one, or none. Lowering a timeout is offered only
    # where the deadline leaves room for it and a next attempt (the route's 200 ms here).
    async with (
        upstream(status_handler(200, delay=2.0)) as p,
        upstream(status_handler(200)) as b,
    ):
        conf = config(p.url, b.url, deadline_ms=1500)
        conf["upstreams"]["primary"]["first_byte_timeout_ms"] = 300
        async with gateway_client(conf, environ=ENV) as client:
            cut = await client.get("/v1/models", headers={"x-gateway-deadline-ms": deadline})
            sensible = await client.get("/v1/models", headers={"x-gateway-deadline-ms": "200"})
            unasked = await client.get("/v1/models")
    error = cut.json()["error"]
    assert (cut.status_code, error["code"], error["rule"]) == (504, "deadline_exceeded",
                                                                "deadline")  # fmt: skip
    message = error["message"]
    assert f"{deadline} ms the caller set with x-gateway-deadline-ms" in message, message
    assert "lower that timeout" not in message, message
    assert "the caller may send a larger x-gateway-deadline-ms" in message, message
    assert "or none" in message, message
    assert "lower that timeout below 200 ms" in sensible.json()["error"]["message"]
    assert (unasked.status_code, unasked.headers["x-gateway-provider"]) == (200, "backup")


async def test_a_route_deadline_too_short_to_split_is_not_answered_with_a_timeout_to_lower() -> (
    None
):
    # The same for the operator's own deadline: a route with deadline_ms = 50 cut by a hang
    # was told to lower the timer "below 50 ms so that a hang ends in time for the next
    # attempt"; what helps is a deadline above the timer.
    async with (
        upstream(status_handler(200, delay=2.0)) as p,
        upstream(status_handler(200)) as b,
    ):
        conf = config(p.url, b.url, deadline_ms=50)
        conf["upstreams"]["primary"]["first_byte_timeout_ms"] = 300
        async with gateway_client(conf, environ=ENV) as client:
            cut = await client.get("/v1/models")
    message = cut.json()["error"]["message"]
    assert "the route deadline (50 ms) passed" in message, message
    assert "lower that" not in message, message
    assert "raise the route's deadline_ms above 300 ms" in message, message
