"""The command line: `serve`, `demo`, the import rule. Driven through the shipped entry
points (`python -m fallback_mw`, the `fallback-mw` script) and the public `cli.main`."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import anyio
import httpx
import pytest

from fallback_mw.cli import main
from fallback_mw.cli.serve import not_found_app, server_options
from tests.upstreams import free_port

SECRET = "s3cr3t-value-never-printed"


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fallback_mw", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env if env is not None else dict(os.environ),
        check=False,
    )


def write_config(tmp_path: Path, *, auth_env: str = "FMW_TEST_PRIMARY_KEY") -> Path:
    path = tmp_path / "gateway.toml"
    path.write_text(
        f"""
[upstreams.primary]
url = "http://127.0.0.1:9"
auth_env = "{auth_env}"

[[routes]]
id = "chat"
prefix = "/v1/"
plan = ["primary"]
""",
        encoding="utf-8",
    )
    return path


def test_help_lists_serve_and_demo() -> None:
    result = run_cli("--help")
    assert result.returncode == 0
    assert "serve" in result.stdout
    assert "demo" in result.stdout


def test_no_command_is_a_usage_error_that_lists_the_commands() -> None:
    # A new user typing `fallback-mw` alone was told only that COMMAND is required, with
    # no command named. Now the commands come first, as `--help` lists them (git and
    # argparse name them too), then the one error line; exit 2, a usage error.
    from fallback_mw.cli import VERBS, build_parser

    result = run_cli()
    assert result.returncode == 2
    assert result.stdout == ""
    *usage, last = result.stderr.splitlines()
    assert last == (
        "fallback-mw: error: the following arguments are required: COMMAND "
        "(one of those listed above)"
    )
    assert "\n".join(usage) + "\n" == build_parser().format_help()
    commands = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert len(commands) == len(VERBS)
    for name in commands:
        assert f"\n    {name} " in result.stderr


@pytest.mark.parametrize(
    ("group", "verbs"),
    [
        ("routes", ("add", "set-fallback", "set", "clear-fallback", "list", "remove")),
        ("faults", ("set", "clear", "list")),
        ("budgets", ("show", "set")),
    ],
)
def test_a_command_group_without_its_verb_lists_its_verbs(group: str, verbs: tuple[str]) -> None:
    result = run_cli(group)
    assert result.returncode == 2
    assert result.stderr.startswith(f"usage: fallback-mw {group} [-h] VERB ...\n")
    for verb in verbs:
        assert f"\n    {verb}" in result.stderr, result.stderr
    assert result.stderr.splitlines()[-1] == (
        f"fallback-mw: error: {group}: the following arguments are required: VERB "
        "(one of those listed above)"
    )
    assert "Traceback" not in result.stderr


def test_serve_requires_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve"]) == 2
    assert capsys.readouterr().err == (
        "fallback-mw: error: serve: the following arguments are required: --config\n"
    )


def test_serve_missing_credential_exits_2_before_listening(tmp_path: Path) -> None:
    config = write_config(tmp_path, auth_env="FMW_TEST_MISSING_KEY")
    env = {k: v for k, v in os.environ.items() if k != "FMW_TEST_MISSING_KEY"}
    env["FMW_TEST_OTHER_SECRET"] = SECRET
    # Were the refusal late, uvicorn would start, log its startup lines and keep running
    # until the timeout: the refusal must come first and be the only line on stderr.
    result = run_cli("serve", "--config", str(config), "--port", str(free_port()), env=env)
    assert result.returncode == 2
    assert "FMW_TEST_MISSING_KEY" in result.stderr
    assert "is not set" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Uvicorn running" not in result.stderr + result.stdout
    assert "Started server" not in result.stderr + result.stdout
    assert SECRET not in result.stderr + result.stdout


def test_serve_refusal_never_prints_a_set_secret(tmp_path: Path) -> None:
    # A config refused for another reason (an unknown upstream) while the credential is set.
    path = tmp_path / "gateway.toml"
    path.write_text(
        """
[upstreams.primary]
url = "http://127.0.0.1:9"
auth_env = "FMW_TEST_PRIMARY_KEY"

[[routes]]
id = "chat"
prefix = "/v1/"
plan = ["primary", "nowhere"]
retries = 1
""",
        encoding="utf-8",
    )
    env = dict(os.environ, FMW_TEST_PRIMARY_KEY=SECRET)
    result = run_cli("serve", "--config", str(path), env=env)
    assert result.returncode == 2
    assert "'nowhere'" in result.stderr
    assert SECRET not in result.stderr + result.stdout


def test_serve_refuses_an_unknown_otel_exporter_before_listening(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    env = dict(os.environ, FMW_TEST_PRIMARY_KEY=SECRET, OTEL_TRACES_EXPORTER="carrier-pigeon")
    result = run_cli("serve", "--config", str(config), "--port", str(free_port()), env=env)
    assert result.returncode == 2
    assert "OTEL_TRACES_EXPORTER" in result.stderr
    assert "Uvicorn running" not in result.stderr + result.stdout
    assert SECRET not in result.stderr + result.stdout


def test_serve_missing_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--config", str(tmp_path / "absent.toml")]) == 2
    assert "not found" in capsys.readouterr().err


@pytest.mark.parametrize("host", ["", " "])
def test_serve_refuses_an_empty_host_rather_than_every_interface(
    host: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # `--host "$GATEWAY_HOST"` with the variable unset bound 0.0.0.0 (the socket API's
    # reading of an empty host): the gateway and its credentials on every network.
    absent = str(tmp_path / "absent.toml")  # never read: the argument is refused first
    assert main(["serve", "--config", absent, "--host", host, "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "argument --host: empty (an unset variable?)" in err and "0.0.0.0" in err
    assert "not found" not in err


def test_server_options_prefer_uvloop_and_httptools() -> None:
    pytest.importorskip("uvloop")
    pytest.importorskip("httptools")
    assert server_options() == {"loop": "uvloop", "http": "httptools"}


@pytest.mark.anyio
async def test_host_app_answers_plain_404() -> None:
    transport = httpx.ASGITransport(app=not_found_app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        response = await client.get("/anything?q=1")
    assert response.status_code == 404
    assert response.text == "Not Found\n"
    assert response.headers["content-type"].startswith("text/plain")


@pytest.mark.anyio
async def test_host_app_speaks_lifespan() -> None:
    incoming = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
    sent: list[str] = []

    async def receive() -> dict[str, str]:
        return incoming.pop(0)

    async def send(message: dict[str, str]) -> None:
        sent.append(message["type"])

    await not_found_app({"type": "lifespan"}, receive, send)  # type: ignore[arg-type]
    assert sent == ["lifespan.startup.complete", "lifespan.shutdown.complete"]


def test_demo_shows_failover_and_the_post_rule() -> None:
    result = run_cli("demo", timeout=60)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "GET /v1/models -> 200, x-gateway-provider: backup, x-gateway-attempts: 2" in out
    assert "FAILED OVER to the backup" in out
    assert "POST /v1/chat/completions -> 502, x-gateway-attempts: 1" in out
    assert "primary received 1, backup received 0" in out
    assert "502 upstream_failed (never the primary's body); the backup was never" in out
    assert "5 x GET /metered/models -> 200, 200, 200, 402, 402" in out
    assert "backup received 3" in out
    assert "402 budget_exceeded" in out
    assert "demo-primary-key" not in out and "demo-backup-key" not in out
    assert "UNEXPECTED" not in out
    assert out.rstrip().endswith("demo finished")


def test_demo_leaves_the_environment_alone() -> None:
    # The demo's credentials go to its Gateway directly, never into os.environ.
    code = (
        "import os, contextlib, io\n"
        "from fallback_mw.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    rc = main(['demo'])\n"
        "print(rc, 'DEMO_PRIMARY_KEY' in os.environ, 'DEMO_BACKUP_KEY' in os.environ)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.stdout.split() == ["0", "False", "False"], result.stderr


def test_importing_fallback_mw_imports_no_framework() -> None:
    code = (
        "import sys, fallback_mw, fallback_mw.cli\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('django', 'starlette', 'fastapi'))\n"
        "print(','.join(bad) or 'none')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "none"


@pytest.mark.anyio
async def test_serve_logs_a_request_no_route_takes_and_says_where_the_routes_are(
    tmp_path: Path,
) -> None:
    """A new user points the openai SDK at `http://127.0.0.1:8000` (its base_url without
    the route's `/v1`): every call was a 404 `Not Found` (the SDK: `Error code: 404`) and
    serve's log, which replaces uvicorn's access log, showed nothing at all. Each such
    request now leaves one line saying no route took it and where the routes are, without
    the path or its query (a caller's text, a key in it)."""
    from tests.helpers import log_text, serve_process, wait_listening

    config = write_config(tmp_path)
    port = free_port()
    log = tmp_path / "serve.log"
    env = {**os.environ, "FMW_TEST_PRIMARY_KEY": SECRET}
    with serve_process(config, port, log, env=env) as process:
        await wait_listening(process, port, log)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            missed = await client.post("/chat/completions?api_key=sk-in-the-query", json={})
            routed = await client.get("/v1/models")  # the route's: its own line, as before
        assert missed.status_code == 404 and routed.status_code == 502
        for _ in range(200):  # serve writes its lines in batches (at most 0.1 s late)
            if "route=chat" in log_text(log):
                break
            await anyio.sleep(0.05)
    lines = [line for line in log_text(log).splitlines() if "no route" in line]
    assert len(lines) == 1, log_text(log)
    assert "INFO fallback_mw.request" in lines[0] and "POST" in lines[0] and "404" in lines[0]
    assert "fallback-mw check" in lines[0] and "base_url" in lines[0]
    assert "by prefix, methods and tenant" in lines[0]  # a tenant route misses by tenant
    text = log_text(log)
    assert "chat/completions" not in text and "sk-in-the-query" not in text and SECRET not in text


def test_a_stopped_serve_whose_log_reader_stopped_reading_exits(tmp_path: Path) -> None:
    """serve's request lines are queued (a stalled log reader blocks only the writer
    thread), and the exit waits for them 5 s at most; but uvicorn's own lines ("Shutting
    down", "Application shutdown complete") were written by its StreamHandler in the event
    loop's thread: with a stderr pipe nobody reads (a stalled log shipper), a stopped serve
    blocked in that write and never exited until killed. uvicorn's lines are queued as the
    request lines are: it exits, its last lines unwritten."""
    import http.client
    import signal
    import socket
    import time

    config = write_config(tmp_path)
    port = free_port()
    env = {**os.environ, "FMW_TEST_PRIMARY_KEY": SECRET}
    command = [sys.executable, "-m", "fallback_mw", "serve", "--config", str(config)]
    process = subprocess.Popen(
        [*command, "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.PIPE,  # read by nobody until it ends
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            assert process.poll() is None and time.monotonic() < deadline
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port)):
                break
            time.sleep(0.1)
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        for _ in range(600):  # no-route lines: well past the pipe's 64 KiB
            connection.request("GET", "/nothing")
            connection.getresponse().read()
        connection.close()
        process.send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        while process.poll() is None and time.monotonic() - stopped < 15:
            time.sleep(0.1)
        assert process.poll() == 0, "serve did not exit with its log unread"
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate()
