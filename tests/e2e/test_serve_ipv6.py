"""`fallback-mw serve` on IPv6 loopback, in front of an upstream on `[::1]`: what it says
about its addresses is a URL or an address a user can copy (`[::1]:PORT`), and the forms a
user copies from URLs (`--host [::1]`) are taken."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import httpx
import pytest
from aiohttp import web

from tests.helpers import free_port, log_text

pytestmark = pytest.mark.e2e

KEY = "ipv6-upstream-key-7d21"
SERVE = (sys.executable, "-m", "fallback_mw", "serve", "--config")


@asynccontextmanager
async def upstream_on_ipv6() -> AsyncIterator[int]:
    """An upstream on [::1] that answers a redirect to its own URL (built from the Host the
    gateway sent, as a trailing-slash redirect is) and says which credential it got."""

    async def answer(request: web.Request) -> web.StreamResponse:
        got = "yes" if request.headers.get("authorization") == f"Bearer {KEY}" else "no"
        return web.Response(
            status=307,
            text=f"key={got} host={request.host}",
            headers={"Location": f"http://{request.host}/v1/items/"},
        )

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "::1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield port
    finally:
        await runner.cleanup()


def _config(tmp_path: Path, upstream_port: int, engine: str) -> Path:
    path = tmp_path / f"gateway-{engine}.toml"
    path.write_text(
        f'[gateway]\nallow_hosts = ["::1"]\nengine = "{engine}"\n'
        f'[upstreams.primary]\nurl = "http://[::1]:{upstream_port}"\n'
        'auth_env = "FMW_E2E_V6_KEY"\n'
        '[[routes]]\nid = "chat"\nprefix = "/v1/"\nplan = ["primary"]\n',
        encoding="utf-8",
    )
    return path


def _environ(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(FMW_E2E_V6_KEY=KEY, OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none")
    env.update(extra)
    return env


def _serve(config: Path, log: Path, env: dict[str, str], *args: str) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "fallback_mw", "serve", "--config", str(config), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def _listening(process: subprocess.Popen[bytes], port: int, log: Path) -> None:
    with anyio.fail_after(60):
        while True:
            if process.poll() is not None:
                pytest.fail(f"serve exited early ({process.returncode}): {log_text(log)}")
            try:
                stream = await anyio.connect_tcp("::1", port)
            except OSError:
                await anyio.sleep(0.05)
                continue
            await stream.aclose()
            return


async def _line(log: Path, text: str) -> str:
    with anyio.fail_after(30):
        while True:
            for line in log_text(log).splitlines():
                if text in line:
                    return line
            await anyio.sleep(0.05)


@pytest.mark.anyio
@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
@pytest.mark.parametrize("host", ["::1", "[::1]"])
async def test_serve_on_ipv6_loopback_in_front_of_an_ipv6_upstream(
    tmp_path: Path, engine: str, host: str
) -> None:
    """`--host [::1]` (the form URLs write) was `cannot listen on [::1]:PORT: Name or
    service not known`, exit 1; the metrics line printed `http://::1:PORT/metrics`, which
    no client takes as a URL."""
    port, metrics_port = free_port(), free_port()
    env = _environ(
        OTEL_METRICS_EXPORTER="prometheus",
        OTEL_EXPORTER_PROMETHEUS_HOST="::1",
        OTEL_EXPORTER_PROMETHEUS_PORT=str(metrics_port),
    )
    log = tmp_path / "serve.log"
    async with upstream_on_ipv6() as upstream_port:
        config = _config(tmp_path, upstream_port, engine)
        process = _serve(config, log, env, "--host", host, "--port", str(port))
        try:
            await _listening(process, port, log)
            assert f"serving on http://[::1]:{port} " in log_text(log)
            metrics_line = await _line(log, "metrics on ")
            assert f"metrics on http://[::1]:{metrics_port}/metrics " in metrics_line
            async with httpx.AsyncClient(timeout=10) as client:
                answer = await client.get(f"http://[::1]:{port}/v1/items")
                metrics_url = metrics_line.split("metrics on ", 1)[1].split()[0]
                metrics = await client.get(metrics_url)
        finally:
            _stop(process)
    assert answer.status_code == 307, answer.text
    assert answer.text == f"key=yes host=[::1]:{upstream_port}"
    # The upstream's own URL, named in its redirect, is the gateway's path.
    assert answer.headers["location"] == "/v1/items/"
    assert metrics.status_code == 200 and "gateway_requests" in metrics.text


@pytest.mark.anyio
async def test_a_busy_ipv6_address_is_named_as_one(tmp_path: Path) -> None:
    """`cannot listen on ::1:PORT` read as a host `::1:PORT` with no port."""
    with socket.socket(socket.AF_INET6) as taken:
        taken.bind(("::1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = _config(tmp_path, 9, "aiohttp")
        done = await asyncio.to_thread(
            subprocess.run,
            [*SERVE, str(config), "--host", "::1", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
            env=_environ(),
        )
    assert done.returncode == 1, done.stderr
    assert done.stderr == (
        f"fallback-mw: error: cannot listen on [::1]:{port}: address already in use\n"
    )


@pytest.mark.anyio
async def test_a_busy_ipv6_metrics_address_is_named_as_one(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET6) as taken:
        taken.bind(("::1", 0))
        taken.listen()
        metrics_port = taken.getsockname()[1]
        env = _environ(
            OTEL_METRICS_EXPORTER="prometheus",
            OTEL_EXPORTER_PROMETHEUS_HOST="::1",
            OTEL_EXPORTER_PROMETHEUS_PORT=str(metrics_port),
        )
        done = await asyncio.to_thread(
            subprocess.run,
            [*SERVE, str(_config(tmp_path, 9, "aiohttp")), "--host", "::1", "--port", "0"],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
    assert done.returncode == 2, done.stderr
    assert f"cannot serve /metrics on [::1]:{metrics_port} (" in done.stderr, done.stderr
