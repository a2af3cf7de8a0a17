"""`fallback-mw serve` as a real process on a real port, in front of real local upstreams."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import httpx
import pytest

from fallback_mw.cli.compiled_core import version_line
from tests.helpers import free_port, log_text, serve_process, wait_listening
from tests.upstreams import status_handler, upstream

pytestmark = pytest.mark.e2e

PRIMARY_KEY = "primary-secret-3f1c"
BACKUP_KEY = "backup-secret-9a7e"
CALLER_KEY = "caller-secret-55d0"


def serve(config: Path, port: int, log: Path) -> AbstractContextManager[subprocess.Popen[bytes]]:
    env = dict(os.environ, FMW_E2E_PRIMARY_KEY=PRIMARY_KEY, FMW_E2E_BACKUP_KEY=BACKUP_KEY)
    # OpenTelemetry from the standard variables: spans printed as they end.
    env.update(OTEL_TRACES_EXPORTER="console", OTEL_METRICS_EXPORTER="none")
    return serve_process(config, port, log, env=env)


def write_config(tmp_path: Path, primary_url: str, backup_url: str) -> Path:
    path = tmp_path / "gateway.toml"
    path.write_text(
        f"""
[gateway]
allow_hosts = ["127.0.0.1"]

[upstreams.primary]
url = "{primary_url}"
auth_env = "FMW_E2E_PRIMARY_KEY"

[upstreams.backup]
url = "{backup_url}"
auth_header = "x-api-key"
auth_scheme = ""
auth_env = "FMW_E2E_BACKUP_KEY"

[[routes]]
id = "direct"
prefix = "/v1/"
plan = ["primary"]

[[routes]]
id = "failover"
prefix = "/failover/"
plan = ["backup", "primary"]
retries = 1
""",
        encoding="utf-8",
    )
    return path


@pytest.mark.anyio
async def test_serve_routes_to_upstream_and_404s_the_rest(tmp_path: Path) -> None:
    async with (
        upstream(status_handler(200, b"hello from primary")) as primary,
        upstream(status_handler(503)) as backup,
    ):
        config = write_config(tmp_path, primary.url, backup.url)
        port = free_port()
        log = tmp_path / "serve.log"
        with serve(config, port, log) as process:
            await wait_listening(process, port, log)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                routed = await client.get(
                    "/v1/models?token=q-secret", headers={"authorization": f"Bearer {CALLER_KEY}"}
                )
                unmatched = await client.get("/elsewhere")
                failover = await client.get("/failover/models")
            assert routed.status_code == 200
            assert routed.content == b"hello from primary"
            assert routed.headers["x-gateway-route"] == "direct"
            assert routed.headers["x-gateway-provider"] == "primary"
            assert routed.headers["x-gateway-attempts"] == "1"

            assert unmatched.status_code == 404
            assert unmatched.text == "Not Found\n"
            assert "x-gateway-route" not in unmatched.headers

            # backup (first in this plan) answers 503 -> primary serves, over real sockets
            assert failover.status_code == 200
            assert failover.headers["x-gateway-provider"] == "primary"
            assert failover.headers["x-gateway-attempts"] == "2"
        assert process.returncode == 0, log_text(log)

    first = primary.received[0]
    assert first.path == "/v1/models"
    assert first.query == "token=q-secret"
    headers = dict(first.headers)
    assert headers["authorization"] == f"Bearer {PRIMARY_KEY}"
    assert all(CALLER_KEY not in value for _, value in first.headers)
    assert backup.count == 1
    assert dict(backup.received[0].headers)["x-api-key"] == BACKUP_KEY
    assert primary.count == 2  # one direct request, one failover attempt

    output = log_text(log)
    # The build that served: pure Python or the compiled core (tests/test_compiled_core.py).
    assert f" INFO fallback_mw starting {version_line()}\n" in output
    assert '"name": "gateway.request"' in output  # the console span exporter ran
    assert '"gateway.route.id": "failover"' in output
    for secret in (PRIMARY_KEY, BACKUP_KEY, CALLER_KEY, "q-secret"):
        assert secret not in output


def _serve_on_a_terminal(config: Path, env: dict[str, str]) -> str:
    """`serve` with its output on a pseudo-terminal, as an operator's shell runs it: what it
    printed until its startup completed (then Ctrl-C)."""
    import pty
    import select
    import signal
    import time

    leader, follower = pty.openpty()
    process = subprocess.Popen(
        [str(Path(sys.executable).with_name("fallback-mw")), "serve", "--config", str(config),
         "--port", "0"],
        stdin=subprocess.DEVNULL, stdout=follower, stderr=follower, env=env,
    )  # fmt: skip
    os.close(follower)
    printed = b""
    try:
        deadline = time.monotonic() + 30
        while b"Application startup complete" not in printed and time.monotonic() < deadline:
            if select.select([leader], [], [], 0.5)[0]:
                try:
                    printed += os.read(leader, 65536)
                except OSError:  # the process ended: the terminal is gone
                    break
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=30)
        os.close(leader)
    assert b"Application startup complete" in printed, printed
    return printed.decode("utf-8", "replace")


def test_serve_on_a_terminal_writes_no_colour_under_no_color(tmp_path: Path) -> None:
    # NO_COLOR (no-color.org) set, `serve` on a terminal still wrote uvicorn's coloured
    # "INFO:" lines, escape sequences and all; it now asks uvicorn for none.
    config = tmp_path / "gateway.toml"
    config.write_text(
        '[upstreams.p]\nurl = "http://127.0.0.1:9"\n[[routes]]\nid = "r"\nprefix = "/r/"\n'
        'plan = ["p"]\n',
        encoding="utf-8",
    )
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    assert "\x1b[" in _serve_on_a_terminal(config, env)  # the control: colour on a terminal
    plain = _serve_on_a_terminal(config, {**env, "NO_COLOR": "1"})
    assert "\x1b[" not in plain, plain
    assert "INFO:     Application startup complete." in plain, plain


async def _exchange(port: int, request: bytes) -> tuple[bytes, bytes, str]:
    """(head, body) of the one answer to `request` on a fresh connection, and how the
    server then ended it: "closed", "reset" or "open" (read until EOF, 10 s at most)."""
    import asyncio

    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    data = b""
    try:
        async with asyncio.timeout(10):
            while chunk := await reader.read(65536):
                data += chunk
        ended = "closed"
    except TimeoutError:
        ended = "open"
    except ConnectionResetError:
        ended = "reset"
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return head, body, ended


@pytest.mark.anyio
async def test_serve_frames_an_unsized_answer_for_an_http_1_0_client_by_closing(
    tmp_path: Path,
) -> None:
    """An HTTP/1.0 client (ab, a 1.0 health check or proxy) reads no chunked framing (RFC
    9112 §6.1), yet an answer without a Content-Length (a streamed download, a body the
    gateway relays decoded) reached it with `transfer-encoding: chunked` and the chunk
    sizes inside its body. It is ended by closing the connection; HTTP/1.1 still chunks."""
    import asyncio

    from aiohttp import web

    parts = [b"first part,", b"second part,", b"last part"]

    async def streamed(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/plain"})
        await response.prepare(request)
        for part in parts:
            await response.write(part)
        await response.write_eof()
        return response

    async def cut(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/plain"})
        await response.prepare(request)
        await response.write(b"partial")
        await asyncio.sleep(0.1)
        assert request.transport is not None
        request.transport.abort()  # the upstream fails after the commit point
        return response

    async with upstream(streamed) as primary, upstream(cut) as backup:
        config = write_config(tmp_path, primary.url, backup.url)
        port = free_port()
        log = tmp_path / "serve.log"
        with serve(config, port, log) as process:
            await wait_listening(process, port, log)
            head, body, ended = await _exchange(port, b"GET /v1/download HTTP/1.0\r\n\r\n")
            head11, body11, _ = await _exchange(
                port, b"GET /v1/download HTTP/1.1\r\nhost: gw\r\nconnection: close\r\n\r\n"
            )
            broken, _, broken_end = await _exchange(port, b"GET /failover/x HTTP/1.0\r\n\r\n")
        assert process.returncode == 0, log_text(log)
    fields = head.lower().split(b"\r\n")
    assert fields[0].startswith(b"http/1.1 200"), head
    assert b"connection: close" in fields
    assert not any(f.startswith((b"transfer-encoding", b"content-length")) for f in fields)
    assert (body, ended) == (b"".join(parts), "closed")
    # HTTP/1.1 still gets chunked framing.
    assert b"transfer-encoding: chunked" in head11.lower().split(b"\r\n")
    assert body11.endswith(b"0\r\n\r\n")
    # A failure after the commit point resets the connection (request/abort.py: a plain close
    # is where a complete HTTP/1.0 answer ends), with the gateway's one WARNING line and
    # nothing from uvicorn.
    assert b"transfer-encoding" not in broken.lower() and broken_end == "reset"
    output = log_text(log)
    assert "outcome=aborted" in output
    assert "ASGI callable" not in output and "Traceback" not in output, output


@contextmanager
def serve_with_stdout_closed(
    config: Path, port: int, log: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """`serve` started as `fallback-mw serve ... >&-`, its stderr in `log`; SIGINT at the end."""
    command = [
        *(sys.executable, "-m", "fallback_mw", "serve", "--config", str(config)),
        *("--host", "127.0.0.1", "--port", str(port)),
    ]
    with log.open("wb") as out:
        process = subprocess.Popen(["bash", "-c", 'exec "$@" >&-', "bash", *command], stderr=out)
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


@pytest.mark.anyio
async def test_serve_started_with_stdout_closed_serves(tmp_path: Path) -> None:
    """A supervisor or init script that starts `serve` with stdout closed (`>&-`): serve
    exited 1 at once, 'stdout is closed ...: nothing can be printed', because its "serving
    on" line could not be printed. A gateway's job is to serve: that line is dropped, the
    log (stderr) is written as always."""
    port, log = free_port(), tmp_path / "serve.log"
    async with upstream(status_handler(200, b"from primary")) as primary:
        config = tmp_path / "gateway.toml"
        config.write_text(
            f'[upstreams.primary]\nurl = "{primary.url}"\n'
            '[[routes]]\nid = "chat"\nprefix = "/v1/"\nplan = ["primary"]\n',
            encoding="utf-8",
        )
        with serve_with_stdout_closed(config, port, log) as process:
            await wait_listening(process, port, log)
            async with httpx.AsyncClient(timeout=10) as client:
                response = await client.get(f"http://127.0.0.1:{port}/v1/chat")
            assert response.status_code == 200 and response.content == b"from primary"
            process.send_signal(signal.SIGINT)
            assert process.wait(timeout=10) == 0, log_text(log)
    assert "stdout is closed" not in log_text(log)
    assert "Application startup complete" in log_text(log)
