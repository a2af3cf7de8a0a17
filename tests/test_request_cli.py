"""`fallback-mw request`: the shipped command (a subprocess) against local upstreams on real
sockets. Each case checks the trace, the exit status and that the output holds no
credential, no caller header value and no body unless --show-body."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from fallback_mw.config import BreakerConfig
from fallback_mw.health import create_health
from tests.test_defence_in_depth import saturated_listener
from tests.upstreams import free_port, silent_server, status_handler, upstream

pytestmark = pytest.mark.anyio

ENV = {"PRIMARY_KEY": "sk-primary-7f3a9c", "BACKUP_KEY": "sk-backup-41d0e2"}
CALLER_SECRET = "sk-caller-5b8e77"
UPSTREAM_BODY = b"UPSTREAM-BODY-c0ffee"
REQUEST_BODY = b'{"prompt": "REQUEST-BODY-deadbeef"}'
# Never in any output: credentials, the caller's header value, the query, bodies (unless
# --show-body for the response body).
SECRETS = (*ENV.values(), CALLER_SECRET, "QUERY-SECRET-91", "REQUEST-BODY-deadbeef")


def write_config(
    tmp_path: Path,
    primary: str,
    backup: str,
    *,
    gateway: str = "",
    route: str = "",
    middle: str | None = None,
) -> Path:
    plan = '["primary", "middle", "backup"]' if middle else '["primary", "backup"]'
    extra = f'[upstreams.middle]\nurl = "{middle}"\nauth_env = "BACKUP_KEY"\n' if middle else ""
    text = f"""
[gateway]
{gateway}

[upstreams.primary]
url = "{primary}"
auth_env = "PRIMARY_KEY"

[upstreams.backup]
url = "{backup}"
auth_header = "x-api-key"
auth_scheme = ""
auth_env = "BACKUP_KEY"

{extra}
[[routes]]
id = "chat"
prefix = "/v1/"
plan = {plan}
retries = {3 if middle else 1}
{route}
"""
    path = tmp_path / "gateway.toml"
    path.write_text(text)
    return path


async def request_cli(
    *argv: str, stdin: bytes | None = None, env: dict[str, str] | None = None
) -> tuple[int, str, str]:
    """`python -m fallback_mw request ...` as an operator runs it. Asynchronous, so the
    upstreams in this event loop keep answering."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fallback_mw", "request", *argv,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **ENV, **(env or {})},
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(stdin or b""), timeout=120)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


def no_leak(*outputs: str, body_shown: bool = False) -> None:
    for text in outputs:
        for secret in SECRETS:
            assert secret not in text
        if not body_shown:
            assert UPSTREAM_BODY.decode() not in text
        assert "Traceback" not in text


def attempts(trace: dict[str, Any]) -> list[tuple[Any, ...]]:
    return [
        (s["number"], s["candidate"], s["status"], s["failure_kind"], s["responsible"],
         s["decision"])
        if s["step"] == "attempt"
        else ("skip", s["candidate"], s["reason"])
        for s in trace["steps"]
    ]  # fmt: skip


HEADERS: Sequence[str] = ("--header", f"authorization: Bearer {CALLER_SECRET}",
                          "--header", f"X-Api-Key: {CALLER_SECRET}")  # fmt: skip


async def test_failover_two_attempts_table_and_json(tmp_path: Path) -> None:
    async with (
        upstream(status_handler(503, UPSTREAM_BODY)) as primary,
        upstream(status_handler(200, UPSTREAM_BODY)) as backup,
    ):
        config = str(write_config(tmp_path, primary.url, backup.url))
        target = ("--path", "/v1/chat?key=QUERY-SECRET-91")
        status, table, err = await request_cli("--config", config, *target, *HEADERS)
        assert status == 0, err
        j_status, j_out, j_err = await request_cli("--config", config, *target, *HEADERS, "--json")
        assert j_status == 0, j_err
    no_leak(table, err, j_out, j_err)
    lines = table.splitlines()
    first = next(line for line in lines if line.strip().startswith("1 "))
    second = next(line for line in lines if line.strip().startswith("2 "))
    assert first.split()[:6] == ["1", "primary", "attempt", "503", "status", "upstream"]
    assert "next_candidate: failover-class" in first
    assert second.split()[:5] == ["2", "backup", "attempt", "200", "-"]
    assert "serve:" in second
    assert "served by backup (fallback)  attempts 2  skipped 0  outcome served" in table
    assert json.loads(j_out)["attempt_ceiling"] == 2  # a replayable GET: 1 + retries
    assert "x-gateway-provider: backup" in table and "x-gateway-attempts: 2" in table
    assert "authorization, x-api-key (values not shown)" in table
    assert "/v1/chat " in table  # the path, never its query

    trace = json.loads(j_out)
    assert attempts(trace) == [
        (1, "primary", 503, "status", "upstream", "next_candidate"),
        (2, "backup", 200, None, "upstream", "serve"),
    ]
    assert trace["candidates"] == ["primary", "backup"]
    assert trace["chosen"] == "backup" and trace["fallback"] is True
    assert trace["client"]["status"] == 200 and trace["client"]["error_code"] is None
    assert trace["client"]["headers"]["x-gateway-provider"] == "backup"
    assert trace["client"]["body_bytes"] == len(UPSTREAM_BODY) and "body" not in trace["client"]
    first_left = trace["steps"][0]["deadline_left_ms"]
    assert trace["deadline_ms"] >= first_left >= trace["steps"][1]["deadline_left_ms"]
    # Both runs really went through the plan, and the caller's credential never did.
    assert primary.count == 2 and backup.count == 2
    for received in primary.received:
        assert dict(received.headers)["authorization"] == f"Bearer {ENV['PRIMARY_KEY']}"
        assert CALLER_SECRET not in str(received.headers)


async def test_the_trace_names_the_path_the_upstream_was_sent(tmp_path: Path) -> None:
    # `/v1/projects/group%2Fapp` reaches the upstream as it is (one segment): the trace
    # said `/v1/projects/group/app`, a path nobody sent, to an operator chasing its 404.
    async with upstream(status_handler(200)) as primary, upstream(status_handler(200)) as backup:
        config = str(write_config(tmp_path, primary.url, backup.url))
        target = ("--path", "/v1/projects/group%2Fapp/files?ref=main")
        status, out, err = await request_cli("--config", config, *target)
        j_status, j_out, _ = await request_cli("--config", config, *target, "--json")
    assert (status, j_status) == (0, 0), err
    assert out.splitlines()[0].startswith("request   GET /v1/projects/group%2Fapp/files  ")
    assert json.loads(j_out)["path"] == "/v1/projects/group%2Fapp/files"
    assert [r.path for r in primary.received] == ["/v1/projects/group%2Fapp/files"] * 2


async def test_show_body_prints_the_response_body(tmp_path: Path) -> None:
    async with (
        upstream(status_handler(503)) as primary,
        upstream(status_handler(200, UPSTREAM_BODY + b"\x1b[2J")) as backup,
    ):
        config = str(write_config(tmp_path, primary.url, backup.url))
        status, out, err = await request_cli("--config", config, "--route", "chat", "--show-body")
    assert status == 0, err
    no_leak(out, err, body_shown=True)
    assert UPSTREAM_BODY.decode() in out
    assert "\x1b" not in out  # an upstream's escape sequence never reaches the terminal


async def test_skip_breaker_open_in_shared_redis(tmp_path: Path, redis_url: str) -> None:
    breaker = BreakerConfig(min_calls=1, window=1, cooldown_ms=600_000, max_cooldown_ms=600_000)
    async with (
        upstream(status_handler(200, UPSTREAM_BODY)) as primary,
        upstream(status_handler(200, UPSTREAM_BODY)) as backup,
    ):
        gateway = (
            f'state = "{redis_url}"\n[gateway.breaker]\nmin_calls = 1\nwindow = 1\n'
            "cooldown_ms = 600000\nmax_cooldown_ms = 600000"
        )
        config = str(write_config(tmp_path, primary.url, backup.url, gateway=gateway))
        # Another gateway process saw the primary fail: its breaker is open in Redis.
        health = create_health(redis_url, breaker)
        assert await health.admit("primary")
        await health.record("primary", failure=True)
        await health.aclose()
        status, out, err = await request_cli("--config", config, "--route", "chat", "--json")
        t_status, table, t_err = await request_cli("--config", config, "--route", "chat")
    assert status == 0 and t_status == 0, err + t_err
    no_leak(out, err, table, t_err)
    trace = json.loads(out)
    assert attempts(trace) == [
        ("skip", "primary", "breaker_open"),
        (1, "backup", 200, None, "upstream", "serve"),
    ]
    assert trace["chosen"] == "backup" and trace["skipped"] == 1 and trace["attempts"] == 1
    assert primary.count == 0  # skipped: no packet
    skip_line = next(line for line in table.splitlines() if "skipped" in line.split())
    assert skip_line.split() == ["-", "primary", "skipped", "-", "-", "-", "-", "-", "breaker_open"]


async def test_an_unreachable_redis_state_is_said_in_the_trace(tmp_path: Path) -> None:
    """An operator asking "why is the primary skipped in production?" must not read a trace
    made on a fresh local state as if it were the shared one: it says Redis was not used,
    and why, never with the URL's password (before: nothing; the breakers looked closed)."""
    async with (
        upstream(status_handler(200, UPSTREAM_BODY)) as primary,
        upstream(status_handler(200, UPSTREAM_BODY)) as backup,
    ):
        state = f"redis://:PW-REDIS-7731@127.0.0.1:{free_port()}/0"  # nothing listens
        config = str(write_config(tmp_path, primary.url, backup.url, gateway=f'state = "{state}"'))
        status, out, err = await request_cli("--config", config, "--route", "chat", "--json")
        t_status, table, t_err = await request_cli("--config", config, "--route", "chat")
    assert status == 0 and t_status == 0, err + t_err
    no_leak(out, err, table, t_err)
    assert "PW-REDIS-7731" not in out + err + table + t_err
    trace = json.loads(out)
    assert trace["state"]["kind"] == "local"
    assert trace["state"]["reason"].startswith("ConnectionError")
    line = next(line for line in table.splitlines() if line.startswith("state"))
    assert "unreachable (ConnectionError" in line and "not the shared ones" in line


async def test_refused_post_is_one_attempt_and_a_local_502(tmp_path: Path) -> None:
    body = tmp_path / "body.json"
    body.write_bytes(REQUEST_BODY)
    async with (
        upstream(status_handler(503, UPSTREAM_BODY)) as primary,
        upstream(status_handler(200, UPSTREAM_BODY)) as backup,
    ):
        config = str(write_config(tmp_path, primary.url, backup.url))
        argv = ("--config", config, "--path", "/v1/chat/completions", "--body", str(body))
        status, out, err = await request_cli(*argv, "--json")
        t_status, table, t_err = await request_cli("--config", config, "--path", "/v1/x",
                                                   "--body", "-", stdin=REQUEST_BODY)  # fmt: skip
    assert status == 1 and t_status == 1
    no_leak(out, err, table, t_err)
    trace = json.loads(out)
    assert trace["method"] == "POST" and trace["request_body_bytes"] == len(REQUEST_BODY)
    assert trace["attempt_ceiling"] == 1  # a POST that cannot be repeated: 1, not 1 + retries
    assert "at most 1 attempt" in table
    assert attempts(trace) == [(1, "primary", 503, "status", "upstream", "local_error")]
    assert trace["steps"][0]["reason"] == "failover-class, but the request is not replayable"
    assert trace["client"]["status"] == 502 and trace["client"]["error_code"] == "upstream_failed"
    assert trace["chosen"] is None and trace["ok"] is False
    assert backup.count == 0 and primary.received[0].body == REQUEST_BODY
    assert "502 upstream_failed (local error)" in table
    assert (
        err == "fallback-mw: error: the client would have received 502 upstream_failed, "
        "not a full 2xx\n"
    )


async def test_a_response_over_max_response_body_is_not_traced_as_served(
    tmp_path: Path,
) -> None:
    async with (
        upstream(status_handler(200, UPSTREAM_BODY)) as primary,
        upstream(status_handler(200)) as backup,
    ):
        config = str(write_config(tmp_path, primary.url, backup.url,
                                  gateway="max_response_body = 10"))  # fmt: skip
        status, out, err = await request_cli("--config", config, "--route", "chat", "--json")
    assert status == 1
    no_leak(out, err)
    trace = json.loads(out)
    assert trace["client"]["error_code"] == "response_too_large"
    # The trace agrees with what the client got: the attempt's answer was refused, not served.
    assert attempts(trace) == [(1, "primary", 200, None, "upstream", "local_error")]
    assert "max_response_body" in trace["steps"][0]["reason"]


async def test_a_response_that_fails_after_the_commit_point_says_why_no_failover(
    tmp_path: Path,
) -> None:
    async def resets_mid_stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(status=200)
        await response.prepare(request)
        await response.write(b"partial-")
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.abort()
        return response

    async with upstream(resets_mid_stream) as primary, upstream(status_handler(200)) as backup:
        config = str(write_config(tmp_path, primary.url, backup.url))
        status, out, err = await request_cli("--config", config, "--route", "chat", "--json")
        table_status, table, _ = await request_cli("--config", config, "--route", "chat")
    assert (status, table_status) == (1, 1)
    no_leak(out, err, table)
    trace = json.loads(out)
    assert attempts(trace) == [(1, "primary", 200, "transport", "upstream", "abort")]
    assert "after the commit point" in trace["steps"][0]["reason"]
    assert (trace["outcome"], trace["rule"]) == ("aborted", "response_started")
    assert backup.count == 0
    assert "outcome aborted (rule response_started)" in table


async def test_deadline_504_with_the_attempts_made(tmp_path: Path) -> None:
    async with upstream(status_handler(503)) as primary, silent_server() as (hanging, accepted):
        config = str(write_config(tmp_path, primary.url, hanging, route="deadline_ms = 400"))
        status, out, err = await request_cli("--config", config, "--route", "chat", "--json")
        t_status, table, _ = await request_cli("--config", config, "--route", "chat")
    assert status == 1 and t_status == 1
    no_leak(out, err, table)
    trace = json.loads(out)
    assert attempts(trace) == [
        (1, "primary", 503, "status", "upstream", "next_candidate"),
        # The walk's deadline ended it: the gateway's doing, not the backup's.
        (2, "backup", None, "deadline", "gateway", "local_error"),
    ]
    assert trace["deadline_ms"] == 400
    assert trace["steps"][1]["deadline_left_ms"] <= 0  # it ended when the deadline passed
    assert trace["client"]["status"] == 504
    assert trace["client"]["error_code"] == "deadline_exceeded"
    assert trace["client"]["headers"]["x-gateway-attempts"] == "2"
    assert accepted  # the backup was really attempted
    assert "504 deadline_exceeded (local error)" in table


async def test_a_timed_out_attempt_names_the_timer_that_ran_out(tmp_path: Path) -> None:
    # A primary that takes the request and never answers, a backup that never completes
    # a connect: both were "timeout" in the trace, and which key to look at (the one that
    # timed each) was not said.
    async with silent_server() as (hanging, _):
        with saturated_listener() as unreachable:
            path = write_config(tmp_path, hanging, unreachable)
            text = path.read_text().replace(
                'auth_env = "PRIMARY_KEY"', 'auth_env = "PRIMARY_KEY"\nfirst_byte_timeout_ms = 300'
            )
            path.write_text(
                text.replace('auth_scheme = ""', 'auth_scheme = ""\nconnect_timeout_ms = 300')
            )
            status, out, err = await request_cli("--config", str(path), "--route", "chat", "--json")
            t_status, table, _ = await request_cli("--config", str(path), "--route", "chat")
    assert status == 1 and t_status == 1, err
    no_leak(out, err, table)
    steps = json.loads(out)["steps"]
    assert [(s["candidate"], s["failure_kind"], s["timer"]) for s in steps] == [
        ("primary", "timeout", "first_byte_timeout_ms"),
        ("backup", "timeout", "connect_timeout_ms"),
    ]
    assert "timeout (first_byte_timeout_ms)" in table and "timeout (connect_timeout_ms)" in table


async def test_no_route_matches(tmp_path: Path) -> None:
    config = str(write_config(tmp_path, "http://127.0.0.1:9", "http://127.0.0.1:10"))
    status, out, err = await request_cli("--config", config, "--path", "/elsewhere")
    assert status == 1, err
    assert "no route matches" in out and "client    404" in out


async def test_a_route_not_there_is_not_found_exit_1(tmp_path: Path) -> None:
    # `request --route nope` exited 2, a refused configuration's status, while `--path`
    # to no route exits 1, and so do `routes remove --id nope` and `budgets show --budget
    # nope`: not found is a runtime result, 1, the same for every verb. Nothing is sent.
    config = str(write_config(tmp_path, "http://127.0.0.1:9", "http://127.0.0.1:10"))
    status, out, err = await request_cli("--config", config, "--route", "nope")
    assert (status, out) == (1, "")
    assert err == "fallback-mw: error: no route 'nope' (routes: chat)\n"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (("--path", "v1/x"), "--path must start with '/'"),
        # A long target that starts with '/' was told it "must start with '/'".
        (("--path", "/v1/" + "a" * 8200), "--path is longer than 8192 characters"),
        (("--path", "/v1/x", "--header", "authorization"), "--header #1: expected 'name: value'"),
        (("--path", "/v1/x", "--header", f"x-key: {CALLER_SECRET}\x01"), "--header #1 (x-key)"),
        (("--path", "/v1/x", "--method", "GE T"), "--method must be"),
        (("--path", "/v1/x", "--body", "/nonexistent/body"), "--body /nonexistent/body"),
        ((), "pass --route ID or --path"),
    ],
)
async def test_bad_invocations_exit_2_in_one_line(
    tmp_path: Path, argv: tuple[str, ...], expected: str
) -> None:
    config = str(write_config(tmp_path, "http://127.0.0.1:9", "http://127.0.0.1:10"))
    status, out, err = await request_cli("--config", config, *argv)
    assert status == 2 and out == ""
    assert err.startswith("fallback-mw: error: ") and expected in err
    assert len(err.strip().splitlines()) == 1
    no_leak(err)


async def test_a_store_file_that_is_not_there_is_refused_and_not_created(tmp_path: Path) -> None:
    typo = tmp_path / "gatewya.db"
    status, out, err = await request_cli("--store", f"sqlite:///{typo}", "--path", "/v1/x")
    assert (status, out) == (2, "")
    assert err.startswith(f"fallback-mw: error: --store: no store file at {typo}: nothing is")
    assert len(err.splitlines()) == 1
    assert not typo.exists()


async def test_bad_config_exits_2_naming_the_variable(tmp_path: Path) -> None:
    config = str(write_config(tmp_path, "http://127.0.0.1:9", "http://127.0.0.1:10"))
    env = {**os.environ, "BACKUP_KEY": ""}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fallback_mw", "request", "--config", config, "--route", "chat",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**env, "PRIMARY_KEY": ENV["PRIMARY_KEY"]},
    )  # fmt: skip
    out, err = await process.communicate()
    assert process.returncode == 2 and out == b""
    assert b"BACKUP_KEY" in err and ENV["PRIMARY_KEY"].encode() not in err


async def fallback_mw(*argv: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fallback_mw", *argv,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **ENV},
    )  # fmt: skip
    out, err = await process.communicate()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_store_only_route_and_an_active_fault_show(tmp_path: Path) -> None:
    """`--store URL` alone: the route `routes add` stored, and the `fail` fault `faults set`
    put in the store, are what the one request meets."""
    store = f"sqlite:///{tmp_path / 'gateway.db'}"
    async with (
        upstream(status_handler(200, UPSTREAM_BODY)) as primary,
        upstream(status_handler(200, UPSTREAM_BODY)) as backup,
    ):
        added = await fallback_mw(
            "routes", "add", "--store", store, "--id", "chat", "--prefix", "/api/",
            "--upstream", primary.url, "--auth-env", "PRIMARY_KEY", "--retries", "1",
            "--fallback", backup.url, "--fallback-auth-header", "x-api-key",
            "--fallback-auth-env", "BACKUP_KEY",
        )  # fmt: skip
        assert added[0] == 0, added[2]
        fault = await fallback_mw("faults", "set", "fail", "--store", store,
                                  "--upstream", "chat-primary", "--ttl", "600")  # fmt: skip
        assert fault[0] == 0, fault[2]
        status, out, err = await request_cli("--store", store, "--route", "chat", "--json")
        t_status, table, _ = await request_cli("--store", store, "--route", "chat")
    assert status == 0 and t_status == 0, err
    no_leak(out, err, table)
    trace = json.loads(out)
    assert attempts(trace) == [
        (1, "chat-primary", 503, "fault", "upstream", "next_candidate"),
        (2, "chat-fallback", 200, None, "upstream", "serve"),
    ]
    assert trace["steps"][0]["fault"] == "fail" and trace["path"] == "/api/"
    assert trace["client"]["headers"]["x-gateway-fault"] == "1"
    assert primary.count == 0  # a fail fault: no packet left
    assert "fail fault" in table


async def test_a_refusal_of_the_routes_own_resolver_is_traced_as_that_route(
    tmp_path: Path,
) -> None:
    # A method the route does not forward (405) or a head over max_header_bytes (431) is
    # answered by the route itself (x-gateway-route, a gateway_error with its rule); the
    # trace said "no route matches; the host app answered", sending the operator to the
    # routes when the answer names the setting to change.
    config = str(
        write_config(tmp_path, "http://127.0.0.1:9", "http://127.0.0.1:10",
                     gateway="max_header_bytes = 2048")
    )  # fmt: skip
    status, out, err = await request_cli("--config", config, "--path", "/v1/x",
                                         "--method", "PROPFIND", "--json")  # fmt: skip
    assert status == 1, err
    trace = json.loads(out)
    assert trace["matched"] is True and trace["route"] == "chat", trace
    assert (trace["outcome"], trace["rule"]) == ("method_not_allowed", "methods")
    client = trace["client"]
    assert (client["status"], client["error_code"]) == (405, "method_not_allowed")
    assert "405 method_not_allowed" in err
    assert trace["candidates"] == ["primary", "backup"]  # as the span and the log line
    status, out, err = await request_cli(
        "--config", config, "--path", "/v1/x", "--header", "x-big: " + "a" * 3000
    )
    assert status == 1, err
    assert "no route matches" not in out, out
    assert "route chat" in out and "client    431 headers_too_large (local error)" in out, out


async def test_a_tenant_named_in_the_underscore_spelling_is_not_sent_twice(
    tmp_path: Path,
) -> None:
    # `--route` adds the route's tenant header unless the operator named one; the gateway
    # reads `x_tenant_id` as that field too, so adding `x-tenant-id: acme` beside the
    # operator's `x_tenant_id: other` was the identity header sent twice (a 400 the
    # operator did not ask about). Either spelling now asks the same question.
    async with upstream(status_handler(200, UPSTREAM_BODY)) as up:
        route = 'tenant = "acme"\n[[routes]]\nid = "other"\nprefix = "/v1/"\nplan = ["primary"]\n'
        route += 'tenant = "other"\n'
        config = str(write_config(tmp_path, up.url, "http://127.0.0.1:9", route=route))
        seen = []
        for name in ("x-tenant-id", "x_tenant_id"):
            status, out, _err = await request_cli(
                "--config", config, "--route", "chat", "--header", f"{name}: other", "--json"
            )
            assert "identity_header" not in out, out
            seen.append((status, json.loads(out)["client"]["status"]))
        assert seen == [(0, 200), (0, 200)], seen  # tenant other's route, either way


async def test_a_tenant_that_is_the_callers_credential_is_printed_redacted(
    tmp_path: Path,
) -> None:
    # "Never printed: a credential ... except the tenant (a label, as spans and the log
    # line carry it)": a tenant id that is the caller's own bearer token is `[REDACTED]` in
    # spans, the log line and the usage record, yet `request` printed it as sent.
    async with upstream(status_handler(200, UPSTREAM_BODY)) as primary:
        config = str(write_config(tmp_path, primary.url, primary.url + "/b"))
        tenant = ("--header", f"x-tenant-id: {CALLER_SECRET}")
        for output in ((), ("--json",)):
            status, out, err = await request_cli(
                "--config", config, "--path", "/v1/chat", *HEADERS, *tenant, *output
            )
            assert status == 0, err
            no_leak(out, err)
            assert "[REDACTED]" in out


async def test_a_tenant_or_header_value_in_unicode_is_sent_as_utf8(tmp_path: Path) -> None:
    # `--route` of a route whose tenant is `日本語` ended in 'unexpected internal error
    # (UnicodeEncodeError)'; `--header 'x-tenant-id: 日本語'` was refused as non-latin-1,
    # and `--header 'x-note: café'` went out as latin-1, which the gateway answers with
    # its 400 (header bytes that are not UTF-8), though curl sends UTF-8 and the gateway
    # routes such a tenant. Values are sent in UTF-8, as curl and the SDKs send them.
    async with upstream(status_handler(200, UPSTREAM_BODY)) as up:
        route = 'tenant = "日本語"\n'
        config = str(write_config(tmp_path, up.url, "http://127.0.0.1:9", route=route))
        for argv in (
            ("--route", "chat"),
            ("--path", "/v1/chat", "--header", "x-tenant-id: 日本語", "--header", "x-note: café"),
        ):
            status, out, err = await request_cli("--config", config, *argv, "--json")
            assert status == 0, (out, err)
            trace = json.loads(out)
            assert (trace["route"], trace["client"]["status"]) == ("chat", 200), trace
            no_leak(out, err)
    assert [dict(r.headers)["x-tenant-id"] for r in up.received] == ["日本語", "日本語"]
    assert dict(up.received[1].headers)["x-note"] == "café"  # its UTF-8 bytes


@pytest.mark.parametrize(
    ("text", "encoding", "content_type"),
    [
        ("Grüße, ça va", "latin-1", "text/plain; charset=iso-8859-1"),
        ('{"text": "Grüße 日本"}', "utf-16", "application/json"),
        ('{"text": "Grüße 日本"}', "utf-16-le", "application/json"),
        ("日本語です", "shift_jis", 'text/plain; charset="Shift_JIS"'),
    ],
    ids=["latin1", "utf16-bom", "utf16le-json", "sjis"],
)
async def test_show_body_reads_the_body_in_its_charset(
    tmp_path: Path, text: str, encoding: str, content_type: str
) -> None:
    # --show-body read every body as UTF-8: an answer in ISO-8859-1 showed `ü` as U+FFFD,
    # one in UTF-16 as `?` between its letters. It is read as its client would read it.
    answer = status_handler(200, text.encode(encoding), **{"content-type": content_type})
    async with upstream(answer) as up:
        config = str(write_config(tmp_path, up.url, "http://127.0.0.1:9"))
        status, out, err = await request_cli(
            "--config", config, "--path", "/v1/chat", "--show-body", "--json"
        )
    assert status == 0, err
    assert json.loads(out)["client"]["body"] == text


async def test_a_json_body_is_sent_as_json_unless_a_header_says_otherwise(tmp_path: Path) -> None:
    # `request --route chat --body body.json` sent the chat completion with no Content-Type
    # at all: an upstream that reads bodies by their type (Express's json(), the provider
    # APIs, whose every example sends application/json) saw no JSON and answered 400, which
    # read as the gateway mangling the body. A JSON body now goes as the SDKs send it; a
    # body that is not JSON, or a --header naming its own type, is sent as given.
    body = tmp_path / "body.json"
    body.write_bytes(REQUEST_BODY)
    text = tmp_path / "body.txt"
    text.write_bytes(b"plain words, not JSON")
    async with (
        upstream(status_handler(200, UPSTREAM_BODY)) as primary,
        upstream(status_handler(200, UPSTREAM_BODY)) as backup,
    ):
        config = str(write_config(tmp_path, primary.url, backup.url))
        path = ("--config", config, "--path", "/v1/chat/completions")
        runs = [
            await request_cli(*path, "--body", str(body), "--json"),
            await request_cli(*path, "--body", "-", stdin=REQUEST_BODY),
            await request_cli(*path, "--body", str(text)),
            await request_cli(*path, "--body", str(body), "--header", "Content-Type: text/x-own"),
        ]
    for status, out, err in runs:
        assert status == 0, err
        no_leak(out, err)
    types = [
        [value for name, value in received.headers if name.lower() == "content-type"]
        for received in primary.received
    ]
    assert types == [["application/json"], ["application/json"], [], ["text/x-own"]]
    assert [r.body for r in primary.received][:2] == [REQUEST_BODY, REQUEST_BODY]
    assert json.loads(runs[0][1])["request_headers"] == ["content-type"]
    assert "sent      headers content-type" in runs[1][1]
