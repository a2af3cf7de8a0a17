"""What a host shows without any help from `fallback-mw serve`: a plain `uvicorn app:app`
with Python's default logging prints failovers and local errors (WARNING records on
`fallback_mw.request`) and nothing for a request served by its first attempt; the
documented line turns the per-request log on; a config error is one line of Python's
output (last line of a traceback, or the only line with the documented SystemExit)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from subprocess import Popen

import anyio
import httpx
import pytest

from tests.helpers import free_port, log_text
from tests.upstreams import status_handler, upstream

pytestmark = [pytest.mark.e2e, pytest.mark.anyio]

APP = """
import logging
from fallback_mw import ConfigError, Gateway, load_config

{logging_setup}

async def host(scope, receive, send):
    await send({{"type": "http.response.start", "status": 200, "headers": []}})
    await send({{"type": "http.response.body", "body": b"host"}})

{load}
app = Gateway(host, config=config)
"""

PLAIN_LOAD = "config = load_config('gateway.toml')"
EXIT_LOAD = """try:
    config = load_config('gateway.toml')
except ConfigError as exc:
    raise SystemExit(f"gateway.toml: {exc}") from None"""
PER_REQUEST_ON = (
    "logging.basicConfig()  # only when nothing else configures logging\n"
    "logging.getLogger('fallback_mw.request').setLevel(logging.INFO)"
)


def write_app(tmp: Path, primary: str, backup: str, *, logging_setup: str, load: str) -> None:
    (tmp / "app.py").write_text(APP.format(logging_setup=logging_setup, load=load))
    (tmp / "gateway.toml").write_text(
        f"""
[upstreams.primary]
url = "{primary}"
auth_env = "HOST_LOG_PRIMARY_KEY"
[upstreams.backup]
url = "{backup}"
[[routes]]
id = "failing"
prefix = "/fail/"
plan = ["primary", "backup"]
retries = 1
[[routes]]
id = "down"
prefix = "/down/"
plan = ["primary"]
[[routes]]
id = "healthy"
prefix = "/ok/"
plan = ["backup"]
"""
    )


@contextmanager
def uvicorn_process(tmp: Path, env: dict[str, str], port: int, log: Path) -> Iterator[Popen[bytes]]:
    """`python -m uvicorn app:app` in `tmp`, output in `log`; Ctrl-C at the end."""
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "app:app", "--port", str(port)],
            cwd=tmp,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            yield process
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


async def run_uvicorn(tmp: Path, env: dict[str, str], paths: list[str]) -> tuple[int, str]:
    """Start the app on uvicorn, GET each path, stop it; (exit status, its output)."""
    port = free_port()
    log = tmp / "uvicorn.log"
    with uvicorn_process(tmp, env, port, log) as process:
        with anyio.fail_after(20):
            while process.poll() is None:
                try:
                    stream = await anyio.connect_tcp("127.0.0.1", port)
                except OSError:
                    await anyio.sleep(0.05)
                    continue
                await stream.aclose()
                break
        if process.poll() is None:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                for path in paths:
                    await client.get(path, timeout=10)
    return process.returncode, log_text(log)


def request_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("gateway request ")]


async def test_plain_uvicorn_shows_failovers_and_local_errors_but_not_every_request(
    tmp_path: Path,
) -> None:
    env = {**os.environ, "HOST_LOG_PRIMARY_KEY": "k"}
    async with (
        upstream(status_handler(503)) as primary,
        upstream(status_handler(200, b"backup")) as backup,
    ):
        write_app(tmp_path, primary.url, backup.url, logging_setup="", load=PLAIN_LOAD)
        status, output = await run_uvicorn(
            tmp_path, env, ["/ok/a", "/fail/b", "/host", "/fail/c?key=s3cret", "/down/d"]
        )
    assert status == 0, output
    lines = request_lines(output)
    # Python's last-resort handler prints the message alone, on stderr: two failovers and
    # one local error; nothing for /ok/ (served by its first attempt) or the host's route.
    assert len(lines) == 3, output
    for line in lines[:2]:
        assert line.startswith(
            "gateway request route=failing outcome=served status=200 chosen=backup attempts=2 "
        )
    assert lines[2].startswith("gateway request route=down outcome=upstream_failed status=502 ")
    # (uvicorn's own access log prints query strings; the gateway's lines never do)
    assert "s3cret" not in "\n".join(lines)


async def test_the_documented_line_turns_the_per_request_log_on(tmp_path: Path) -> None:
    env = {**os.environ, "HOST_LOG_PRIMARY_KEY": "k"}
    async with (
        upstream(status_handler(503)) as primary,
        upstream(status_handler(200, b"backup")) as backup,
    ):
        write_app(tmp_path, primary.url, backup.url, logging_setup=PER_REQUEST_ON, load=PLAIN_LOAD)
        status, output = await run_uvicorn(tmp_path, env, ["/ok/a", "/fail/b", "/host"])
    assert status == 0, output
    records = [line for line in output.splitlines() if ":fallback_mw.request:gateway" in line]
    assert [r.split(":", 1)[0] for r in records] == ["INFO", "WARNING"], output
    assert "route=healthy outcome=served status=200 chosen=backup attempts=1" in records[0]
    assert "route=failing outcome=served status=200 chosen=backup attempts=2" in records[1]


@pytest.mark.parametrize(
    ("load", "expected"),
    [
        (
            PLAIN_LOAD,
            "fallback_mw.config.ConfigError: upstream 'primary': "
            "environment variable HOST_LOG_PRIMARY_KEY is not set",
        ),
        (
            EXIT_LOAD,
            "gateway.toml: upstream 'primary': environment variable HOST_LOG_PRIMARY_KEY "
            "is not set",
        ),
    ],
)
async def test_a_config_error_under_uvicorn_is_one_line(
    tmp_path: Path, load: str, expected: str
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "HOST_LOG_PRIMARY_KEY"}
    write_app(tmp_path, "http://127.0.0.1:9", "http://127.0.0.1:10", logging_setup="", load=load)
    status, output = await run_uvicorn(tmp_path, env, [])
    assert status == 1
    lines = output.strip().splitlines()
    assert lines[-1] == expected
    # No chained "During handling of the above exception" traceback.
    assert "During handling" not in output and "direct cause" not in output
    if load == EXIT_LOAD:
        assert lines == [expected]  # SystemExit: Python prints the message alone
