"""`fallback-mw check --config FILE` (validate like `nginx -t`) and `demo --port`."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from fallback_mw.security.fields import DEFAULT_STRIP_HEADERS
from tests.helpers import free_port, gateway_client, log_text, serve_process, wait_listening
from tests.test_cli_admin import run_cli as admin
from tests.test_cli_convention import FALLBACK_MW, assert_one_error_line
from tests.upstreams import status_handler, upstream

SECRET = "sk-check-never-printed"

CONFIG = """
[gateway]
allow_hosts = ["127.0.0.1"]
{store}

[upstreams.primary]
url = "http://127.0.0.1:9001"
auth_env = "FMW_CHECK_PRIMARY"
model = "gpt-4o-mini"
first_byte_timeout_ms = 2000  # below the route deadline: a hang fails over

[upstreams.backup]
url = "http://127.0.0.1:9002/api/"
auth_header = "x-api-key"
auth_scheme = ""
auth_env = ["FMW_CHECK_BACKUP_A", "FMW_CHECK_BACKUP_B"]

[[routes]]
id = "chat"
prefix = "/v1/"
tenant = "acme"
plan = ["primary", "backup"]
retries = 1
replayable_methods = ["GET", "POST"]
budget = "acme"

[budgets.acme]
limit = 5.0
"""

ENV = {
    "FMW_CHECK_PRIMARY": SECRET,
    "FMW_CHECK_BACKUP_A": SECRET + "-a",
    "FMW_CHECK_BACKUP_B": SECRET + "-b",
}


def check(
    path: Path, env: dict[str, str] | None = None, *extra: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [FALLBACK_MW, "check", "--config", str(path), *extra],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, **(ENV if env is None else env)},
    )


def test_check_prints_the_resolved_plans_and_never_a_secret(tmp_path: Path) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text(CONFIG.format(store=""), encoding="utf-8")
    result = check(path)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert result.stdout.splitlines() == [
        "route chat (file): prefix /v1/  tenant acme  methods GET HEAD OPTIONS POST PUT "
        "PATCH DELETE (default)",
        "  plan: sequential, retries 1 (attempt ceiling 2), deadline 5000 ms",
        "    1. primary  http://127.0.0.1:9001  authorization: Bearer $FMW_CHECK_PRIMARY"
        "  model gpt-4o-mini",
        "    2. backup   http://127.0.0.1:9002/api  x-api-key: $FMW_CHECK_BACKUP_A, "
        "$FMW_CHECK_BACKUP_B (pool)",
        "  replayable GET POST; failover on 502 503 504, transport errors and timeouts; "
        "401 403 429 move to another credential within backup (pool); on_exhausted error",
        "  budget acme",
        f"configuration {path} is valid: 1 route(s)",
    ]
    assert SECRET not in result.stdout


def test_check_names_only_the_pool_statuses_that_move_to_another_credential(
    tmp_path: Path,
) -> None:
    # 429 listed in failover_status is failover-class: a pool's 429 moves the walk to the
    # next candidate, not to another of the pool's keys (docs/health.md). check said "401
    # 403 429 move to another credential" all the same, so an operator reading it expected
    # the rate-limited backup to be tried again with its second key.
    path = tmp_path / "gateway.toml"
    listed = CONFIG.format(store="").replace(
        "retries = 1\n", "retries = 1\nfailover_status = [429, 502, 503]\n"
    )
    path.write_text(listed, encoding="utf-8")
    result = check(path)
    assert result.returncode == 0, result.stderr
    assert (
        "  replayable GET POST; failover on 429 502 503, transport errors and timeouts; "
        "401 403 move to another credential within backup (pool); on_exhausted error"
    ) in result.stdout.splitlines(), result.stdout
    every = listed.replace("[429, 502, 503]", "[401, 403, 429, 502]")
    path.write_text(every, encoding="utf-8")
    result = check(path)
    assert result.returncode == 0, result.stderr
    assert (
        "  replayable GET POST; failover on 401 403 429 502, transport errors and timeouts; "
        "on_exhausted error"
    ) in result.stdout.splitlines(), result.stdout


@pytest.mark.anyio
async def test_check_warns_that_a_pool_on_a_one_attempt_route_never_moves_to_another_key(
    tmp_path: Path,
) -> None:
    # A key pool for rate limits on a single-upstream route (retries left at 0): check
    # said "401 403 429 move to another credential within openai (pool)", but the move is
    # an attempt and the route makes one, so the first key's 429 reached the caller. check
    # warns and names retries; with retries = 1 the second key answers.
    path = tmp_path / "gateway.toml"
    answers = iter([429, 429, 200])

    async def keyed(request: Any) -> Any:
        return await status_handler(next(answers))(request)

    async with upstream(keyed) as openai:
        body = (
            f'[upstreams.openai]\nurl = "{openai.url}"\nauth_env = ["FMW_CHECK_BACKUP_A", '
            '"FMW_CHECK_BACKUP_B"]\nfirst_byte_timeout_ms = 2000\n'
            '[[routes]]\nid = "chat"\nprefix = "/v1/"\nplan = ["openai"]\n'
        )
        path.write_text(body, encoding="utf-8")
        result = check(path)
        assert result.returncode == 0, result.stderr
        assert "move to another credential" not in result.stdout, result.stdout
        assert (
            "  warning: candidate 'openai' is a credential pool, but the route makes one "
            "attempt (retries = 0): a 401/403/429 from one of its keys is served as-is, never "
            "retried with another; raise retries (each further key is an attempt)"
        ) in result.stdout.splitlines(), result.stdout
        async with gateway_client(str(path), environ=ENV) as client:
            served = await client.get("/v1/models")
        path.write_text(body + "retries = 1\n", encoding="utf-8")
        result = check(path)
        assert "warning" not in result.stdout, result.stdout
        assert "401 403 429 move to another credential within openai (pool)" in result.stdout
        async with gateway_client(str(path), environ=ENV) as client:
            moved = await client.get("/v1/models")
    assert (served.status_code, served.headers["x-gateway-attempts"]) == (429, "1")
    assert (moved.status_code, moved.headers["x-gateway-attempts"]) == (200, "2")


def test_check_warns_about_a_configuration_without_routes(tmp_path: Path) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text("[gateway]\n", encoding="utf-8")
    result = check(path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "  warning: no routes: every request goes to the host app (serve: 404)",
        f"configuration {path} is valid: 0 route(s), 1 warning(s)",
    ]


def test_check_warns_when_the_deadline_would_cut_a_hang_before_its_fallback(
    tmp_path: Path,
) -> None:
    # The defaults: deadline_ms 5000, first_byte_timeout_ms 30000. A hanging primary is cut
    # by the deadline (504) and the backup is never tried; the backup, last, is not named.
    path = tmp_path / "gateway.toml"
    body = (
        '[upstreams.primary]\nurl = "http://127.0.0.1:9001"\n'
        '[upstreams.backup]\nurl = "http://127.0.0.1:9002"\n'
        '[[routes]]\nid = "chat"\nprefix = "/v1/"\nplan = ["primary", "backup"]\nretries = 1\n'
    )
    path.write_text(body, encoding="utf-8")
    result = check(path)
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stdout.splitlines() if "  warning: " in line]
    assert warnings == [
        "  warning: candidate 'primary' has first_byte_timeout_ms 30000, not below the route "
        "deadline (5000 ms): a hang on it ends in 504 deadline_exceeded, never a fallback; "
        "lower its first_byte_timeout_ms"
    ]
    assert result.stdout.rstrip().endswith("1 route(s), 1 warning(s)")
    path.write_text(body.replace('9001"\n', '9001"\nfirst_byte_timeout_ms = 2000\n'), "utf-8")
    result = check(path)
    assert result.returncode == 0 and "warning" not in result.stdout, result.stdout


def test_check_warns_when_the_deadline_would_cut_a_connect_before_its_fallback(
    tmp_path: Path,
) -> None:
    # A platform team's short route deadline (800 ms) in front of an internal host that is
    # down: its SYNs are dropped, the connect waits connect_timeout_ms (3000 by default),
    # the deadline ends the walk in 504 and the backup is never tried. check warned about
    # first_byte_timeout_ms only.
    path = tmp_path / "gateway.toml"
    body = (
        '[upstreams.primary]\nurl = "http://127.0.0.1:9001"\nfirst_byte_timeout_ms = 300\n'
        '[upstreams.backup]\nurl = "http://127.0.0.1:9002"\n'
        '[[routes]]\nid = "svc"\nprefix = "/svc/"\nplan = ["primary", "backup"]\nretries = 1\n'
        "deadline_ms = 800\n"
    )
    path.write_text(body, encoding="utf-8")
    result = check(path)
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stdout.splitlines() if "  warning: " in line]
    assert warnings == [
        "  warning: candidate 'primary' has connect_timeout_ms 3000, not below the route "
        "deadline (800 ms): a connect that is never answered (a host that is down, a "
        "firewall that drops) ends in 504 deadline_exceeded, never a fallback; lower its "
        "connect_timeout_ms"
    ]
    path.write_text(body.replace("first_byte_timeout_ms = 300\n", "first_byte_timeout_ms = 300"
                                 "\nconnect_timeout_ms = 250\n"), "utf-8")  # fmt: skip
    result = check(path)
    assert result.returncode == 0 and "warning" not in result.stdout, result.stdout


def test_check_warns_when_an_upstream_url_repeats_the_route_prefix(tmp_path: Path) -> None:
    # OpenAI's SDKs document https://api.openai.com/v1 as the base URL; as an upstream url
    # behind a /v1/ route every request reached /v1/v1/... (a 404), and check said nothing.
    path = tmp_path / "gateway.toml"
    body = (
        '[upstreams.primary]\nurl = "http://127.0.0.1:9001/v1"\nfirst_byte_timeout_ms = 2000\n'
        '[upstreams.backup]\nurl = "http://127.0.0.1:9002/api/"\n'
        '[[routes]]\nid = "chat"\nprefix = "/v1/"\nplan = ["primary", "backup"]\nretries = 1\n'
    )
    path.write_text(body, encoding="utf-8")
    result = check(path)
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stdout.splitlines() if "  warning: " in line]
    assert warnings == [
        "  warning: candidate 'primary' has url path /v1 and the route prefix is /v1/: the "
        "request path is appended, so requests reach /v1/v1/...; drop /v1 from its url"
    ]
    path.write_text(body.replace("9001/v1", "9001"), encoding="utf-8")
    result = check(path)
    assert result.returncode == 0 and "warning" not in result.stdout, result.stdout


def test_check_warns_about_a_prefix_that_does_not_end_at_a_segment(tmp_path: Path) -> None:
    # A prefix is literal: /v1 routes /v1x/admin and /v1-internal/... too, with the
    # provider's credential, to the upstream. Valid, and said.
    path = tmp_path / "gateway.toml"
    body = (
        '[upstreams.primary]\nurl = "http://127.0.0.1:9001"\n'
        '[[routes]]\nid = "chat"\nprefix = "/v1"\nplan = ["primary"]\n'
    )
    path.write_text(body, encoding="utf-8")
    result = check(path)
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stdout.splitlines() if "  warning: " in line]
    assert warnings == [
        "  warning: the route prefix /v1 is matched as written, so it also takes /v1x/... and "
        "/v1-anything/... to its candidates; end it with '/' (/v1/) to take only the paths "
        "below /v1/"
    ]
    path.write_text(body.replace('"/v1"', '"/v1/"'), encoding="utf-8")
    result = check(path)
    assert result.returncode == 0 and "warning" not in result.stdout, result.stdout


def test_check_warns_about_a_route_no_request_can_reach(tmp_path: Path) -> None:
    # Same prefix and tenant as "chat", which comes first in the route table (the tie-break
    # is the id) and takes every method: "chat2" is valid but dead. A POST-only route
    # beside a GET-only one, or another tenant's route of the same prefix, is not.
    path = tmp_path / "gateway.toml"
    extra = (
        # On the single-key primary: a one-attempt route on the backup's pool is warned of
        # too (its 401/403/429 never move to another key).
        '\n[[routes]]\nid = "chat2"\nprefix = "/v1/"\ntenant = "acme"\nplan = ["primary"]\n'
        '\n[[routes]]\nid = "other"\nprefix = "/v1/"\ntenant = "beta"\nplan = ["primary"]\n'
    )
    path.write_text(CONFIG.format(store="") + extra, encoding="utf-8")
    result = check(path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    warnings = [line for line in lines if line.startswith("  warning:")]
    assert warnings == [
        "  warning: no request can reach this route: 'chat' (same prefix and tenant, first in "
        "the route table) takes every method it accepts; give it another prefix, tenant or "
        "methods, or remove it"
    ]
    assert lines.index(warnings[0]) > lines.index(next(x for x in lines if "route chat2" in x))
    assert lines[-1].endswith("is valid: 3 route(s), 1 warning(s)")
    path.write_text(
        CONFIG.format(store="").replace('replayable_methods = ["GET", "POST"]', 'methods = ["GET"]')
        + extra.replace('plan = ["primary"]', 'plan = ["primary"]\nmethods = ["POST"]', 1),
        encoding="utf-8",
    )
    result = check(path)
    assert result.returncode == 0, result.stderr
    assert "warning" not in result.stdout


def test_an_unreachable_route_names_only_the_routes_that_take_its_methods(tmp_path: Path) -> None:
    # A platform team's read route beside a write route on one prefix, and an older
    # route of that prefix that takes every method: the read route's warning named the
    # POST-only write route as taking its GET too, and the fix read off it (change the
    # write route) changed nothing.
    path = tmp_path / "gateway.toml"
    extra = (
        '\n[[routes]]\nid = "chat1-write"\nprefix = "/v1/"\ntenant = "acme"\n'
        'methods = ["POST"]\nplan = ["primary"]\n'
        '\n[[routes]]\nid = "chat2-read"\nprefix = "/v1/"\ntenant = "acme"\n'
        'methods = ["GET"]\nplan = ["primary"]\n'
    )
    path.write_text(CONFIG.format(store="") + extra, encoding="utf-8")
    result = check(path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    read = lines.index(next(x for x in lines if x.startswith("route chat2-read ")))
    warning = next(x for x in lines[read:] if x.startswith("  warning:"))
    assert warning.startswith("  warning: no request can reach this route: 'chat' (same"), warning
    assert "chat1-write" not in warning, warning


def test_the_replayable_line_names_only_methods_the_route_takes(tmp_path: Path) -> None:
    # A platform team's write route (POST PUT DELETE) read "replayable GET HEAD OPTIONS;
    # failover on 502 503 504 ...": none of its requests can fail over, and check said
    # otherwise. A GET-only route listed HEAD and OPTIONS, which go to the host app.
    path = tmp_path / "gateway.toml"
    extra = (
        '\n[[routes]]\nid = "write"\nprefix = "/svc/"\nmethods = ["POST", "PUT", "DELETE"]\n'
        'plan = ["primary", "backup"]\nretries = 1\n'
        '\n[[routes]]\nid = "read"\nprefix = "/svc/"\nmethods = ["GET"]\n'
        'plan = ["primary", "backup"]\nretries = 1\n'
    )
    path.write_text(CONFIG.format(store="") + extra, encoding="utf-8")
    result = check(path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()

    def replayable(route: str) -> str:
        start = lines.index(next(x for x in lines if x.startswith(f"route {route} ")))
        return next(x for x in lines[start:] if x.startswith("  replayable "))

    assert replayable("write").startswith("  replayable none of its methods (POST PUT DELETE)")
    assert replayable("read").startswith("  replayable GET; failover on"), replayable("read")
    assert replayable("chat").startswith("  replayable GET POST; failover on")


def test_check_refuses_what_serve_refuses(tmp_path: Path) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text(CONFIG.format(store=""), encoding="utf-8")
    unset = {k: v for k, v in ENV.items() if k != "FMW_CHECK_BACKUP_B"}
    env = {k: v for k, v in os.environ.items() if k != "FMW_CHECK_BACKUP_B"}
    result = subprocess.run(
        [FALLBACK_MW, "check", "--config", str(path)],
        capture_output=True, text=True, timeout=60, check=False, env={**env, **unset},
    )  # fmt: skip
    line = assert_one_error_line(result, 2)
    assert "FMW_CHECK_BACKUP_B is not set" in line and SECRET not in line
    assert result.stdout == ""
    path.write_text(
        CONFIG.format(store="").replace("http://127.0.0.1:9002/api/", "HTTP://127.0.0.1:9001/"),
        encoding="utf-8",
    )
    line = assert_one_error_line(check(path), 2)
    assert "fallback 'backup' is the primary's own endpoint" in line


def test_check_merges_the_store_routes_as_a_starting_gateway_would(tmp_path: Path) -> None:
    db = tmp_path / "gw.db"
    path = tmp_path / "gateway.toml"
    path.write_text(CONFIG.format(store=f'store = "sqlite:///{db}"'), encoding="utf-8")
    status, _, err = admin(
        "routes", "add", "--config", str(path), "--id", "extra", "--prefix", "/x/",
        "--upstream", "http://127.0.0.1:9005", "--auth-env", "FMW_CHECK_EXTRA",
    )  # fmt: skip
    assert status == 0, err
    # The store route names a variable this shell lacks: the gateway would not start.
    line = assert_one_error_line(check(path), 2)
    assert "FMW_CHECK_EXTRA is not set" in line
    result = check(path, {**ENV, "FMW_CHECK_EXTRA": SECRET})
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith(f"store sqlite:///{db}: 1 route(s)\n")
    assert "route extra (store): prefix /x/  tenant any" in out
    assert "1. extra-primary  http://127.0.0.1:9005  authorization: Bearer $FMW_CHECK_EXTRA" in out
    assert out.endswith("is valid: 2 route(s)\n") and SECRET not in out


def free_run(length: int) -> int:
    """A port P with P .. P+length-1 free on loopback right now."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + length > 65535:
            continue
        sockets = []
        try:
            for offset in range(length):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind(("127.0.0.1", base + offset))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError("no run of free ports")


def test_demo_port_chooses_the_demos_ports() -> None:
    port = free_run(3)
    result = subprocess.run(
        [sys.executable, "-m", "fallback_mw", "demo", "--port", str(port)],
        capture_output=True, text=True, timeout=90, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"gateway  http://127.0.0.1:{port}  " in out
    assert f"primary  http://127.0.0.1:{port + 1}  " in out
    assert f"backup   http://127.0.0.1:{port + 2}  " in out
    assert out.rstrip().endswith("demo finished")


def test_demo_on_a_taken_port_fails_with_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [FALLBACK_MW, "demo", "--port", str(port)],
            capture_output=True, text=True, timeout=90, check=False,
        )  # fmt: skip
    line = assert_one_error_line(result, 1)
    # P is taken; P+1 or P+2 may be too (another process's ephemeral port): whichever the
    # demo met first is named.
    named = [p for p in (port, port + 1, port + 2) if f"cannot listen on 127.0.0.1:{p} " in line]
    assert named, line
    # The reason once, in the OS's words (not asyncio's "error while attempting to bind on
    # address (...)" inside it, as the upstreams' bind failures said), and the way out.
    assert "(Address already in use); the demo uses --port P, P+1 and P+2" in line, line
    assert "error while attempting" not in line
    # P free and P+1 taken: the primary's bind (asyncio's) is the one that fails.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1] - 1
        result = subprocess.run(
            [FALLBACK_MW, "demo", "--port", str(port)],
            capture_output=True, text=True, timeout=90, check=False,
        )  # fmt: skip
    line = assert_one_error_line(result, 1)
    assert "error while attempting" not in line and "(Address already in use); " in line, line


def test_check_refuses_a_store_serve_could_not_load_with_status_2(tmp_path: Path) -> None:
    # SPEC §11: `check --config FILE` exits 0 or 2, and `serve` refuses this very file with
    # 2 ("cannot load routes from the store"): a store that cannot be opened or reached is
    # a configuration serve would not start with, not a third outcome.
    missing_dir = tmp_path / "no-such-dir" / "gw.db"
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there: the PostgreSQL store is unreachable
    for store in (f"sqlite:///{missing_dir}", f"postgresql://postgres@127.0.0.1:{port}/fxad"):
        path = tmp_path / "gateway.toml"
        path.write_text(CONFIG.format(store=f'store = "{store}"'), encoding="utf-8")
        line = assert_one_error_line(check(path), 2)
        assert "cannot load routes from the store" in line, line


def test_check_warns_when_strip_lists_drop_a_default_credential(tmp_path: Path) -> None:
    # SPEC §12: strip_headers / strip_query_keys name caller credentials removed before
    # any upstream, with defaults (x-auth-token, anthropic-api-key, api_key, key ...). A
    # list given replaces those defaults: an operator adding one header of theirs let a
    # caller's anthropic-api-key through to every upstream, and check said nothing.
    path = tmp_path / "gateway.toml"
    text = CONFIG.format(store="").replace(
        'allow_hosts = ["127.0.0.1"]',
        'allow_hosts = ["127.0.0.1"]\nstrip_headers = ["x-mine"]\nstrip_query_keys = ["sig"]',
    )
    path.write_text(text, encoding="utf-8")
    result = check(path)
    assert result.returncode == 0, result.stderr
    headers = [line for line in result.stdout.splitlines() if "strip_headers" in line]
    assert len(headers) == 1 and "anthropic-api-key" in headers[0], result.stdout
    assert "x-auth-token" in headers[0] and "warning" in headers[0]
    keys = [line for line in result.stdout.splitlines() if "strip_query_keys" in line]
    assert len(keys) == 1 and "api_key" in keys[0], result.stdout
    # The defaults kept (the list extends them): no warning.
    extended = CONFIG.format(store="").replace(
        'allow_hosts = ["127.0.0.1"]',
        'allow_hosts = ["127.0.0.1"]\nstrip_headers = '
        + json.dumps(["x-mine", *DEFAULT_STRIP_HEADERS]),
    )
    path.write_text(extended, encoding="utf-8")
    result = check(path)
    assert result.returncode == 0 and "warning" not in result.stdout, result.stdout


def test_check_warns_when_the_backoff_before_a_repeat_outlasts_the_deadline(
    tmp_path: Path,
) -> None:
    # One candidate, two retries: each repeat first waits backoff_ms. With a backoff not
    # below the deadline the repeat can never run: every walk that needs it waits out the
    # deadline and ends in 504 (the 504 says so; check should say it before a deploy).
    path = tmp_path / "gateway.toml"
    body = (
        '[upstreams.primary]\nurl = "http://127.0.0.1:9001"\nfirst_byte_timeout_ms = 1000\n'
        "connect_timeout_ms = 1000\n"
        '[[routes]]\nid = "chat"\nprefix = "/v1/"\nplan = ["primary"]\nretries = 2\n'
        "deadline_ms = 3000\nbackoff_ms = 3000\n"
    )
    path.write_text(body, encoding="utf-8")
    result = check(path)
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stdout.splitlines() if "  warning: " in line]
    assert warnings == [
        "  warning: a repeat of a candidate first waits backoff_ms 3000, not below the route "
        "deadline (3000 ms): it can never run, and a walk that needs it ends in 504 "
        "deadline_exceeded; lower backoff_ms"
    ]
    path.write_text(body.replace("backoff_ms = 3000", "backoff_ms = 100"), "utf-8")
    result = check(path)
    assert result.returncode == 0 and "warning" not in result.stdout, result.stdout
    # No repeat in the plan (retries below its length): no backoff is ever waited.
    path.write_text(body.replace("retries = 2", "retries = 0"), "utf-8")
    result = check(path)
    assert result.returncode == 0 and "warning" not in result.stdout, result.stdout


def test_check_says_whether_the_shared_redis_state_can_be_used(
    tmp_path: Path, redis_url: str
) -> None:
    # A platform team runs `check` on the gateway host before `serve --workers 4`. With
    # gateway.state naming a Redis the host cannot reach (a wrong port, password or
    # database), serve starts anyway, each worker on its own breakers, credential health
    # and capacity counts: `check` said "valid" and nothing about the state at all.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]  # nothing listens here
    down = f"redis://:state-password@127.0.0.1:{closed}/0"
    path = tmp_path / "gateway.toml"
    path.write_text(CONFIG.format(store=f'state = "{down}"'), encoding="utf-8")
    result = check(path)
    assert result.returncode == 0, result.stderr  # serve would start: valid, warned
    warning = next(line for line in result.stdout.splitlines() if "state redis://" in line)
    assert warning.startswith(f"  warning: state redis://127.0.0.1:{closed}/0 unreachable (")
    assert "own breakers, credential health and capacity counts" in warning
    assert "state-password" not in result.stdout + result.stderr
    assert result.stdout.splitlines()[-1].endswith("1 route(s), 1 warning(s)")

    path.write_text(CONFIG.format(store=f'state = "{redis_url}"'), encoding="utf-8")
    result = check(path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0].startswith("state redis://")
    assert result.stdout.splitlines()[0].endswith(": reachable, shared by every gateway process")
    assert result.stdout.splitlines()[-1].endswith("is valid: 1 route(s)")


DOUBLED = """
[upstreams.primary]
url = "http://127.0.0.1:9001"
auth_env = "FMW_CHECK_PRIMARY"
first_byte_timeout_ms = 2000

[upstreams.backup]
url = "http://127.0.0.1:9002"
auth_header = "x-api-key"
auth_scheme = ""
auth_env = "FMW_CHECK_BACKUP_A"

[[routes]]
id = "chat"
prefix = "/v1/"
plan = ["primary", "backup"]
retries = 1
"""


def test_check_warns_when_a_credential_variable_already_holds_the_auth_scheme(
    tmp_path: Path,
) -> None:
    # An operator pasted the whole header value, `Bearer sk-...`, into the variable: the
    # gateway sent `authorization: Bearer Bearer sk-...` and the provider answered every
    # request 401, which read as a wrong key. check names the upstream and the variable,
    # never the value; the key alone (or a raw-key upstream, auth_scheme "") is quiet.
    path = tmp_path / "gateway.toml"
    path.write_text(DOUBLED, encoding="utf-8")
    expected = (
        "  warning: upstream 'primary': $FMW_CHECK_PRIMARY already starts with its "
        "auth_scheme 'Bearer', so authorization is sent as 'Bearer Bearer ...' and the "
        'provider answers 401; set $FMW_CHECK_PRIMARY to the key alone, or auth_scheme = "" '
        "to send it as written"
    )
    for pasted in (f"Bearer {SECRET}", f"bearer  {SECRET}"):
        env = {"FMW_CHECK_PRIMARY": pasted, "FMW_CHECK_BACKUP_A": f"Bearer {SECRET}-a"}
        result = check(path, env)
        assert result.returncode == 0, result.stderr
        warnings = [line for line in result.stdout.splitlines() if "  warning: " in line]
        assert warnings == [expected], result.stdout
        assert result.stdout.rstrip().endswith("1 route(s), 1 warning(s)")
        assert SECRET not in result.stdout + result.stderr
    for key in (SECRET, f"Bearer{SECRET}"):
        result = check(path, {"FMW_CHECK_PRIMARY": key, "FMW_CHECK_BACKUP_A": SECRET})
        assert result.returncode == 0 and "warning" not in result.stdout, result.stdout


RAW_KEY_HEADER = """
[upstreams.primary]
url = "http://127.0.0.1:9001"
auth_header = "x-api-key"
auth_env = "FMW_CHECK_PRIMARY"
{scheme}
[[routes]]
id = "chat"
prefix = "/v1/"
plan = ["primary"]
"""


def test_check_warns_when_a_header_of_its_own_gets_the_default_bearer_scheme(
    tmp_path: Path,
) -> None:
    # auth_header = "x-api-key" alone (Anthropic's header) sent `x-api-key: Bearer sk-...`
    # (SPEC §3's default scheme), which Anthropic, Azure OpenAI and Gemini answer 401. check
    # says so and names both ways out; a scheme written in the file, either one, is quiet.
    path = tmp_path / "gateway.toml"
    path.write_text(RAW_KEY_HEADER.format(scheme=""), encoding="utf-8")
    result = check(path, {"FMW_CHECK_PRIMARY": SECRET})
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stdout.splitlines() if "  warning: " in line]
    assert warnings == [
        "  warning: upstream 'primary': auth_header = 'x-api-key' with the default "
        "auth_scheme 'Bearer' sends 'x-api-key: Bearer <key>'; the providers that read a key "
        "in a header of their own (Anthropic's x-api-key, Azure OpenAI's api-key, Gemini's "
        'x-goog-api-key) take it raw and answer 401: set auth_scheme = "" to send the key '
        'alone, or auth_scheme = "Bearer" to keep the prefix'
    ], result.stdout
    assert SECRET not in result.stdout + result.stderr
    for written in ('auth_scheme = ""', 'auth_scheme = "Bearer"'):
        path.write_text(RAW_KEY_HEADER.format(scheme=written), encoding="utf-8")
        result = check(path, {"FMW_CHECK_PRIMARY": SECRET})
        assert result.returncode == 0 and "warning" not in result.stdout, result.stdout


def test_serve_warns_when_a_credential_variable_already_holds_the_auth_scheme(
    tmp_path: Path,
) -> None:
    path, log = tmp_path / "gateway.toml", tmp_path / "serve.log"
    path.write_text(DOUBLED, encoding="utf-8")
    env = {**os.environ, "FMW_CHECK_PRIMARY": f"Bearer {SECRET}", "FMW_CHECK_BACKUP_A": SECRET}
    port = free_port()

    async def started() -> None:
        with serve_process(path, port, log, env=env) as process:
            await wait_listening(process, port, log)

    anyio.run(started)
    text = log_text(log)
    assert "warning: upstream 'primary': $FMW_CHECK_PRIMARY already starts with its" in text
    assert SECRET not in text


def test_check_warns_about_a_provider_candidate_without_a_credential(tmp_path: Path) -> None:
    # provider = "openai" and no auth_env: the caller's own key is stripped before any
    # upstream (SPEC §4) and none is injected, so OpenAI answered every request 401, which
    # looked like a wrong key. check says so; with auth_env, or no provider, it is quiet.
    path = tmp_path / "gateway.toml"
    body = (
        '[upstreams.primary]\nurl = "http://127.0.0.1:9001"\nprovider = "openai"\n'
        "first_byte_timeout_ms = 2000\n"
        '[upstreams.backup]\nurl = "http://127.0.0.1:9002"\n'
        '[[routes]]\nid = "chat"\nprefix = "/v1/"\nplan = ["primary", "backup"]\nretries = 1\n'
    )
    path.write_text(body, encoding="utf-8")
    result = check(path)
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stdout.splitlines() if "  warning: " in line]
    assert warnings == [
        "  warning: upstream 'primary' is provider openai but has no auth_env: the caller's "
        "own credential is stripped before any upstream and none is injected, so a provider "
        "that needs a key answers every request 401; set auth_env to the variable holding "
        "its key"
    ]
    keyed = body.replace(
        'provider = "openai"\n', 'provider = "openai"\nauth_env = "FMW_CHECK_PRIMARY"\n'
    )
    for quiet in (keyed, body.replace('provider = "openai"\n', "")):
        path.write_text(quiet, encoding="utf-8")
        result = check(path)
        assert result.returncode == 0 and "warning" not in result.stdout, result.stdout


def test_serve_says_what_check_warns_about_once_before_serving(tmp_path: Path) -> None:
    # An operator starting `serve` saw the credential and proxy warnings only: a file
    # route whose prefix lacks its '/', and a store route whose hung primary can never
    # reach its fallback (the first-byte timeout outlasts the deadline), started in
    # silence; only a `check` run beforehand said so. serve now prints every warning
    # `check` prints for that configuration, on stderr, once each, before serving.
    store = f"sqlite:///{tmp_path / 'gw.db'}"
    path, log = tmp_path / "gateway.toml", tmp_path / "serve.log"
    path.write_text(
        f'[gateway]\nstore = "{store}"\nallow_hosts = ["127.0.0.1"]\n'
        '[upstreams.primary]\nurl = "http://127.0.0.1:9001"\nfirst_byte_timeout_ms = 2000\n'
        '[[routes]]\nid = "chat"\nprefix = "/v1"\nplan = ["primary"]\n',
        encoding="utf-8",
    )
    status, _, err = admin(
        "routes", "add", "--config", str(path), "--id", "items", "--prefix", "/items/",
        "--upstream", "http://127.0.0.1:9002", "--fallback", "http://127.0.0.1:9003",
        "--retries", "1",
    )  # fmt: skip
    assert status == 0, err
    checked = check(path, {})
    assert checked.returncode == 0, checked.stderr
    expected = [
        line.removeprefix("  warning: ")
        for line in checked.stdout.splitlines()
        if line.startswith("  warning: ")
    ]
    assert len(expected) == 2 and checked.stdout.rstrip().endswith("2 warning(s)"), expected

    port = free_port()

    async def started() -> None:
        with serve_process(path, port, log, env=dict(os.environ)) as process:
            await wait_listening(process, port, log)

    anyio.run(started)
    lines = log_text(log).splitlines()
    said = [line for line in lines if line.startswith("fallback-mw: warning: ")]
    serving = next(i for i, line in enumerate(lines) if line.startswith("serving on "))
    assert all(lines.index(line) < serving for line in said), lines
    assert sorted(said) == sorted(
        [
            f"fallback-mw: warning: route 'chat': {expected[0]}",
            f"fallback-mw: warning: route 'items': {expected[1]}",
        ]
    ), said
    assert "/v1x/" in expected[0] and "first_byte_timeout_ms 30000" in expected[1]


def test_check_warns_when_min_calls_is_larger_than_the_breakers_window(tmp_path: Path) -> None:
    # The window keeps the last `window` outcomes, so with min_calls above it the breaker
    # never opens: accepted in silence, it looked like a breaker that did not work.
    path = tmp_path / "gateway.toml"
    body = (
        "[gateway.breaker]\nwindow = 5\nmin_calls = 10\n"
        '[upstreams.primary]\nurl = "http://127.0.0.1:9001"\nfirst_byte_timeout_ms = 2000\n'
        '[upstreams.backup]\nurl = "http://127.0.0.1:9002"\n'
        '[[routes]]\nid = "chat"\nprefix = "/v1/"\nplan = ["primary", "backup"]\nretries = 1\n'
    )
    path.write_text(body, encoding="utf-8")
    result = check(path)
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stdout.splitlines() if "  warning: " in line]
    assert warnings == [
        "  warning: [gateway.breaker] min_calls (10) is larger than window (5): the window "
        "never holds min_calls outcomes, so no breaker ever opens; lower min_calls or raise "
        "window"
    ]
    path.write_text(body.replace("min_calls = 10", "min_calls = 5"), encoding="utf-8")
    result = check(path)
    assert result.returncode == 0 and "warning" not in result.stdout, result.stdout


def test_check_warns_about_a_canary_or_shadow_share_no_request_can_be_in(tmp_path: Path) -> None:
    # canary_percent = 5 on a route that is not canary_eligible (or whose plan has no second
    # candidate), and shadow_percent = 2.5 without a shadow, loaded and did nothing: the
    # operator read a slice under test that never received a request.
    path = tmp_path / "gateway.toml"
    body = (
        '[upstreams.primary]\nurl = "http://127.0.0.1:9001"\nfirst_byte_timeout_ms = 2000\n'
        '[upstreams.backup]\nurl = "http://127.0.0.1:9002"\nfirst_byte_timeout_ms = 2000\n'
        '[[routes]]\nid = "a"\nprefix = "/a/"\nplan = ["primary", "backup"]\nretries = 1\n'
        "canary_percent = 5.0\nshadow_percent = 2.5\n"
        '[[routes]]\nid = "b"\nprefix = "/b/"\nplan = ["primary"]\ncanary_eligible = true\n'
        "canary_percent = 5\n"
    )
    path.write_text(body, encoding="utf-8")
    result = check(path)
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stdout.splitlines() if "  warning: " in line]
    assert warnings == [
        "  warning: canary_percent 5 has no effect: the route is not canary_eligible, so no "
        "session is sent to its second candidate first; set canary_eligible = true, or remove "
        "canary_percent",
        "  warning: shadow_percent 2.5 has no effect: the route names no shadow upstream to "
        "copy requests to; set shadow = NAME, or remove shadow_percent",
        "  warning: canary_percent 5 has no effect: the canary is the plan's second "
        "candidate, and this plan has one; add the candidate to test",
    ]
    fixed = body.replace("shadow_percent = 2.5", 'canary_eligible = true\nshadow = "backup"\n'
                         "shadow_percent = 2.5").replace('plan = ["primary"]\n', 'plan = '
                         '["primary", "backup"]\nretries = 1\n')  # fmt: skip
    path.write_text(fixed, encoding="utf-8")
    result = check(path)
    assert result.returncode == 0 and "warning" not in result.stdout, result.stdout


def test_check_warns_about_a_hedge_the_deadline_never_lets_start(tmp_path: Path) -> None:
    # hedge_after_ms = 6000 on a route whose deadline is 5000 loaded in silence: the
    # operator counted on a hedge that could never start.
    path = tmp_path / "gateway.toml"
    body = (
        '[upstreams.primary]\nurl = "http://127.0.0.1:9001"\nfirst_byte_timeout_ms = 2000\n'
        '[upstreams.backup]\nurl = "http://127.0.0.1:9002"\nfirst_byte_timeout_ms = 2000\n'
        '[[routes]]\nid = "a"\nprefix = "/a/"\nplan = ["primary", "backup"]\nretries = 2\n'
        "hedge_after_ms = 6000\ndeadline_ms = 5000\n"
    )
    path.write_text(body, encoding="utf-8")
    result = check(path)
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stdout.splitlines() if "  warning: " in line]
    assert warnings == [
        "  warning: hedge_after_ms 6000 is not below the route deadline (5000 ms): the hedge "
        "never starts; lower hedge_after_ms (a little above the primary's usual time to "
        "first byte)"
    ]
    path.write_text(body.replace("hedge_after_ms = 6000", "hedge_after_ms = 800"), "utf-8")
    result = check(path)
    assert result.returncode == 0 and "warning" not in result.stdout, result.stdout


def test_check_warns_when_a_credential_would_cross_the_internet_in_cleartext(
    tmp_path: Path,
) -> None:
    """`http://api.openai.com` for `https://`: every request sent the key in clear across
    the internet (the provider's redirect to https came back after it), and `check` and
    `serve` said nothing. An upstream at a private or loopback address, one over https and
    one without a credential are not warned about."""
    path = tmp_path / "gateway.toml"
    body = (
        '[gateway]\nallow_hosts = ["api.example.com", "93.184.216.0/24", "10.0.0.0/8", '
        '"127.0.0.1"]\n'
        '[upstreams.public]\nurl = "http://api.example.com/v1"\nauth_env = "FMW_CHECK_PRIMARY"\n'
        '[upstreams.literal]\nurl = "http://93.184.216.34"\nauth_env = "FMW_CHECK_PRIMARY"\n'
        '[upstreams.tls]\nurl = "https://api.example.com"\nauth_env = "FMW_CHECK_PRIMARY"\n'
        '[upstreams.inside]\nurl = "http://10.1.2.3:8000"\nauth_env = "FMW_CHECK_PRIMARY"\n'
        '[upstreams.local]\nurl = "http://127.0.0.1:9001"\nauth_env = "FMW_CHECK_PRIMARY"\n'
        '[upstreams.keyless]\nurl = "http://93.184.216.35"\n'
    )
    for name in ("public", "literal", "tls", "inside", "local", "keyless"):
        body += f'[[routes]]\nid = "{name}"\nprefix = "/{name}/"\nplan = ["{name}"]\n'
    path.write_text(body, encoding="utf-8")
    result = check(path)
    assert result.returncode == 0, result.stderr
    warned = [line for line in result.stdout.splitlines() if "plain http://" in line]
    assert len(warned) == 2, result.stdout
    assert "upstream 'public'" in warned[0] and "$FMW_CHECK_PRIMARY" in warned[0]
    assert "upstream 'literal'" in warned[1] and "use https://" in warned[1]
    assert SECRET not in result.stdout  # names only, never the value


def test_check_warns_about_a_hedge_or_shadow_no_request_of_the_route_can_use(
    tmp_path: Path,
) -> None:
    # A POST-only chat route with hedge_after_ms and a shadow at 5 % loaded in silence: a
    # hedge and a copy are only ever sent for a replayable request, and POST is not one by
    # default, so the operator watched for copies (and hedges) that never came — no
    # `gateway.shadow.requests` series at all, since a request not copied is not counted.
    path = tmp_path / "gateway.toml"
    body = (
        '[upstreams.primary]\nurl = "http://127.0.0.1:9001"\nfirst_byte_timeout_ms = 2000\n'
        '[upstreams.backup]\nurl = "http://127.0.0.1:9002"\nfirst_byte_timeout_ms = 2000\n'
        '[upstreams.candidate]\nurl = "http://127.0.0.1:9003"\n'
        '[[routes]]\nid = "chat"\nprefix = "/v1/chat/"\nmethods = ["POST"]\n'
        'plan = ["primary", "backup"]\nretries = 2\nhedge_after_ms = 800\n'
        'shadow = "candidate"\nshadow_percent = 5.0\n'
    )
    path.write_text(body, encoding="utf-8")
    result = check(path)
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stdout.splitlines() if "  warning: " in line]
    assert warnings == [
        "  warning: hedge_after_ms 800 has no effect: none of the route's methods (POST) is "
        "replayable, and a hedge is a second attempt; add POST to replayable_methods",
        "  warning: shadow 'candidate' gets no copy: none of the route's methods (POST) is "
        "replayable, and only a replayable request is copied; add POST to "
        "replayable_methods, or set replay_with_idempotency_key = true to copy a POST that "
        "carries an Idempotency-Key",
    ]
    # A keyed POST is copied; it is hedged only with hedge_idempotent_posts.
    keyed = body + "replay_with_idempotency_key = true\n"
    path.write_text(keyed, encoding="utf-8")
    result = check(path)
    warnings = [line for line in result.stdout.splitlines() if "  warning: " in line]
    assert len(warnings) == 1 and "hedge_after_ms 800 has no effect" in warnings[0], warnings
    assert "hedge_idempotent_posts = true" in warnings[0]
    path.write_text(keyed + "hedge_idempotent_posts = true\n", encoding="utf-8")
    result = check(path)
    assert result.returncode == 0 and "warning" not in result.stdout, result.stdout
    replayable = body + 'replayable_methods = ["POST"]\n'
    path.write_text(replayable, encoding="utf-8")
    result = check(path)
    assert result.returncode == 0 and "warning" not in result.stdout, result.stdout
