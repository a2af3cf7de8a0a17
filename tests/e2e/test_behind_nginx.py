"""`fallback-mw serve` behind a real nginx, as a platform team runs it: nginx's defaults and
the configuration docs/operations.md ("Behind nginx") gives, read from that page and run
as written (only its ports changed). Skipped where no nginx is installed."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import anyio
import httpx
import pytest
from aiohttp import web

from tests.helpers import free_port, log_text, serve_process, wait_listening
from tests.upstreams import status_handler, upstream

pytestmark = [pytest.mark.e2e, pytest.mark.anyio]

ROOT = Path(__file__).resolve().parents[2]
NGINX = shutil.which("nginx") or next(
    (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if Path(p).exists()), None
)

DEFAULTS = """
server {{
    listen 127.0.0.1:{port};
    location / {{
        proxy_pass http://127.0.0.1:{gateway};
        proxy_set_header X-Real-IP $remote_addr;
        proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
        proxy_set_header X-Forwarded-Proto $scheme;
    }}
    location /internal/ {{ internal; alias {secrets}/; }}
}}
"""


def documented() -> str:
    """The nginx block of docs/operations.md's "Behind nginx", as written."""
    page = (ROOT / "docs" / "operations.md").read_text()
    section = page.split("## Behind nginx", 1)[1]
    found = re.search(r"```nginx\n(.*?)```", section, re.S)
    assert found, "docs/operations.md: no nginx block under 'Behind nginx'"
    return found.group(1)


def nginx_http_block(kind: str, port: int, gateway: int, secrets: Path) -> str:
    if kind == "defaults":
        return DEFAULTS.format(port=port, gateway=gateway, secrets=secrets)
    if kind == "nginx's defaults, larger bodies":
        return DEFAULTS.format(port=port, gateway=gateway, secrets=secrets).replace(
            "proxy_pass", "client_max_body_size 8m;\n        proxy_pass"
        )
    if kind == "streamed uploads, no keepalive":
        return DEFAULTS.format(port=port, gateway=gateway, secrets=secrets).replace(
            "proxy_pass",
            "client_max_body_size 8m;\n        proxy_http_version 1.1;\n"
            "        proxy_request_buffering off;\n        proxy_pass",
        )
    text = documented()
    if kind == "streamed uploads":
        text = text.replace(
            "proxy_pass http://fallback_mw;",
            "proxy_pass http://fallback_mw;\n        proxy_request_buffering off;",
        )
    assert "server 127.0.0.1:8000;" in text and "listen 8080;" in text
    return text.replace("server 127.0.0.1:8000;", f"server 127.0.0.1:{gateway};").replace(
        "listen 8080;", f"listen 127.0.0.1:{port};"
    )


@contextmanager
def nginx(tmp_path: Path, kind: str, gateway: int) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    if NGINX is None:
        pytest.skip("nginx is not installed")
    port = free_port()
    secrets = tmp_path / "secrets"
    secrets.mkdir(exist_ok=True)
    (secrets / "s.txt").write_text("internal only\n")
    temp = tmp_path / "nginx-temp"
    temp.mkdir(exist_ok=True)
    conf = tmp_path / "nginx.conf"
    conf.write_text(
        # As root, nginx's workers would run as nobody, who cannot write in tmp_path.
        ("user root;\n" if os.geteuid() == 0 else "")
        + f"daemon off;\nworker_processes 1;\npid {tmp_path}/nginx.pid;\n"
        f"error_log {tmp_path}/nginx-error.log info;\n"
        "events { worker_connections 64; }\nhttp {\n"
        f"  access_log off;\n  client_body_temp_path {temp}/body;\n"
        f"  proxy_temp_path {temp}/proxy;\n  fastcgi_temp_path {temp}/fastcgi;\n"
        f"  uwsgi_temp_path {temp}/uwsgi;\n  scgi_temp_path {temp}/scgi;\n"
        + nginx_http_block(kind, port, gateway, secrets)
        + "}\n"
    )
    process = subprocess.Popen(
        [NGINX, "-p", str(tmp_path), "-e", str(tmp_path / "nginx-error.log"), "-c", str(conf)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    try:
        yield port, process
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@asynccontextmanager
async def behind_nginx(
    tmp_path: Path, kind: str, upstream_url: str, gateway_keys: str = ""
) -> AsyncIterator[str]:
    """`serve` for one route to `upstream_url`, behind nginx configured as `kind`: its URL."""
    config = tmp_path / "gateway.toml"
    config.write_text(
        '[gateway]\nallow_hosts = ["127.0.0.1"]\ndeadline_ms = 20000\n'
        + gateway_keys
        + f'[upstreams.primary]\nurl = "{upstream_url}"\nauth_env = "NGINX_TEST_KEY"\n'
        '[[routes]]\nid = "chat"\nprefix = "/v1/"\nplan = ["primary"]\n'
    )
    gateway = free_port()
    log = tmp_path / "serve.log"
    env = {**os.environ, "NGINX_TEST_KEY": "sk-nginx-test-0123456789"}
    with serve_process(config, gateway, log, env=env) as process:
        await wait_listening(process, gateway, log)
        with nginx(tmp_path, kind, gateway) as (port, proxy):
            await _until_answering(port, proxy, tmp_path)
            yield f"http://127.0.0.1:{port}"


async def _until_answering(port: int, proxy: subprocess.Popen[bytes], tmp_path: Path) -> None:
    with anyio.fail_after(20):
        while True:
            if proxy.poll() is not None:
                pytest.fail(f"nginx exited: {log_text(tmp_path / 'nginx-error.log')}")
            try:
                stream = await anyio.connect_tcp("127.0.0.1", port)
            except OSError:
                await anyio.sleep(0.05)
                continue
            await stream.aclose()
            return


KINDS = ["defaults", "documented"]


@pytest.mark.parametrize("kind", KINDS)
async def test_an_event_stream_arrives_event_by_event_through_nginx(
    tmp_path: Path, kind: str
) -> None:
    """The upstream sends its second event only once the caller has read the first (or
    after 5 s): nginx holding the first back until the stream ends is seen at once."""
    first_read = asyncio.Event()
    released: list[float] = []

    async def events(request: web.Request) -> web.StreamResponse:
        answer = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await answer.prepare(request)
        await answer.write(b'data: {"n": 1}\n\n')
        with anyio.move_on_after(5):
            await first_read.wait()
        released.append(time.monotonic())
        await answer.write(b"data: [DONE]\n\n")
        await answer.write_eof()
        return answer

    async with (
        upstream(events) as up,
        behind_nginx(tmp_path, kind, up.url) as url,
        httpx.AsyncClient(timeout=30) as client,
        client.stream("POST", f"{url}/v1/chat/completions", json={"stream": True}) as answer,
    ):
        lines = answer.aiter_lines()
        first = await anext(lines)
        first_at = time.monotonic()
        first_read.set()
        rest = [line async for line in lines]
    assert answer.status_code == 200
    assert first == 'data: {"n": 1}'
    assert "data: [DONE]" in rest
    (released_at,) = released
    assert first_at < released_at, "nginx held the first event back until the stream ended"
    assert "x-accel-buffering" not in answer.headers  # nginx's to read, not its caller's


@pytest.mark.parametrize("kind", KINDS)
async def test_a_stream_broken_after_the_commit_point_reaches_the_caller_broken(
    tmp_path: Path, kind: str
) -> None:
    async def broken(request: web.Request) -> web.StreamResponse:
        answer = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await answer.prepare(request)
        await answer.write(b'data: {"n": 1}\n\n')
        await asyncio.sleep(0.2)
        assert request.transport is not None
        request.transport.abort()
        return answer

    async with (
        upstream(broken) as up,
        behind_nginx(tmp_path, kind, up.url) as url,
        httpx.AsyncClient(timeout=30) as client,
    ):
        with pytest.raises(httpx.RemoteProtocolError):
            await client.post(f"{url}/v1/chat/completions", json={"stream": True})


async def test_an_upstream_cannot_have_nginx_serve_an_internal_location(tmp_path: Path) -> None:
    async def redirecting(request: web.Request) -> web.StreamResponse:
        return web.Response(
            body=b"{}",
            content_type="application/json",
            headers={"X-Accel-Redirect": "/internal/s.txt"},
        )

    async with (
        upstream(redirecting) as up,
        behind_nginx(tmp_path, "defaults", up.url) as url,
        httpx.AsyncClient(timeout=30) as client,
    ):
        direct = await client.get(f"{url}/internal/s.txt")
        answer = await client.get(f"{url}/v1/models")
    assert direct.status_code == 404  # internal: nginx serves it on an order only
    assert (answer.status_code, answer.text) == (200, "{}")
    assert "internal only" not in answer.text


async def test_the_documented_configuration_passes_what_the_gateway_takes(tmp_path: Path) -> None:
    """A body up to max_request_body (nginx's default stops at 1 MiB) reaches the upstream;
    nothing nginx says about the caller does."""
    received: list[tuple[int, set[str]]] = []

    async def echo(request: web.Request) -> web.StreamResponse:
        body = await request.content.read()  # past aiohttp's own 1 MiB request limit
        received.append((len(body), {name.lower() for name in request.headers}))
        return web.json_response({"length": len(body)})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", echo)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    up_port = free_port()
    await web.TCPSite(runner, "127.0.0.1", up_port).start()
    try:
        async with (
            behind_nginx(tmp_path, "documented", f"http://127.0.0.1:{up_port}") as url,
            httpx.AsyncClient(timeout=30) as client,
        ):
            answer = await client.post(
                f"{url}/v1/chat/completions",
                content=b"x" * (4 * 1024 * 1024),
                headers={"x-request-id": "r-1", "X-Forwarded-For": "203.0.113.9"},
            )
    finally:
        await runner.cleanup()
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"length": 4 * 1024 * 1024}
    ((_, names),) = received
    assert "x-request-id" in names
    assert not names & {"x-forwarded-for", "x-real-ip", "forwarded", "x-forwarded-proto"}


async def test_nginx_sets_forwarding_fields_the_upstream_never_sees(tmp_path: Path) -> None:
    async def ok(request: web.Request) -> web.StreamResponse:
        return web.json_response({})

    async with (
        upstream(ok) as up,
        behind_nginx(tmp_path, "defaults", up.url) as url,
        httpx.AsyncClient(timeout=30) as client,
    ):
        answer = await client.get(f"{url}/v1/models", headers={"X-Forwarded-For": "1.2.3.4"})
    assert answer.status_code == 200
    (received,) = up.received
    names = {name for name, _ in received.headers}
    assert not names & {"x-forwarded-for", "x-real-ip", "forwarded", "x-forwarded-proto"}
    assert dict(received.headers)["host"] == up.url.removeprefix("http://")


@pytest.mark.parametrize(
    "kind",
    ["streamed uploads", "streamed uploads, no keepalive", "nginx's defaults, larger bodies"],
)
async def test_a_body_over_max_request_body_gets_the_gateways_413_through_nginx(
    tmp_path: Path, kind: str
) -> None:
    """nginx sends the body (as it arrives, with `proxy_request_buffering off`) and reads
    the answer once it has all gone: the gateway's early 413 and close reset the connection
    under it, and its caller got nginx's 502 page (cli/server_limits.py), under nginx's
    defaults too (HTTP/1.0) once its `client_max_body_size` lets the body through."""
    async with (
        upstream(status_handler(200, b"never")) as up,
        behind_nginx(tmp_path, kind, up.url, "max_request_body = 1024\n") as url,
        httpx.AsyncClient(timeout=30) as client,
    ):
        answers = [
            # A new connection to nginx each: it closes one whose body it did not read.
            await client.post(
                f"{url}/v1/chat/completions",
                content=b"z" * 5_000_000,
                headers={"connection": "close"},
            )
            for _ in range(8)
        ]
    assert [answer.status_code for answer in answers] == [413] * 8, answers[-1].text
    assert answers[-1].json()["error"]["code"] == "request_too_large"
    assert up.count == 0


async def test_serve_keeps_an_idle_connection_as_long_as_the_proxy_in_front_does(
    tmp_path: Path,
) -> None:
    """An AWS ALB keeps its idle connections to a target 60 s, nginx's `keepalive` 60 s:
    serve closed them after uvicorn's 5 s, and a request sent on one as it closed was the
    proxy's 502 to its caller. `--timeout-keep-alive` keeps them longer: a request after
    6 s idle is answered on the same connection."""

    async def ok(request: web.Request) -> web.StreamResponse:
        return web.json_response({})

    async with upstream(ok) as up:
        config = tmp_path / "gateway.toml"
        config.write_text(
            f'[gateway]\nallow_hosts = ["127.0.0.1"]\n[upstreams.primary]\nurl = "{up.url}"\n'
            '[[routes]]\nid = "chat"\nprefix = "/v1/"\nplan = ["primary"]\n'
        )
        port = free_port()
        log = tmp_path / "serve.log"
        with serve_process(config, port, log, options=("--timeout-keep-alive", "65")) as process:
            await wait_listening(process, port, log)
            stream = await anyio.connect_tcp("127.0.0.1", port)
            request = b"GET /v1/models HTTP/1.1\r\nhost: gw\r\n\r\n"
            answers = b""
            try:
                for pause in (0, 6):
                    await anyio.sleep(pause)
                    await stream.send(request)
                    with anyio.fail_after(10):
                        while answers.count(b"HTTP/1.1 200 ") < (2 if pause else 1):
                            answers += await stream.receive()
            finally:
                await stream.aclose()
    assert answers.count(b"HTTP/1.1 200 ") == 2, log_text(log)
    assert up.count == 2
