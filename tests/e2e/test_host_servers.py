"""Aborts close the connection under every server (SPEC §5, issue 19): the upstream dies
in the middle of an SSE stream, after the commit point, and the client must see a broken
response (never a complete one) within a second, under uvicorn, hypercorn (HTTP/1.1 and
h2c), daphne and granian, each run as its own process, with the Gateway as the ASGI app,
inside FastAPI (`add_middleware`), as the Django middleware and around a Django app
(request/abort.py says what each server needs). The
server's output holds one WARNING request line for the abort and no traceback or error.

The servers come with the dev extra; outside CI a missing one is skipped, under CI=true
it fails."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import anyio
import httpx
import pytest
from aiohttp import web

from tests.helpers import free_port, log_text
from tests.upstreams import status_handler, upstream

pytestmark = [pytest.mark.e2e, pytest.mark.anyio]

GATEWAY_APP = """
import os
from fallback_mw import Gateway

async def host(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            else:
                await send({"type": "lifespan.shutdown.complete"})
                return
    await send({"type": "http.response.start", "status": 404, "headers": []})
    await send({"type": "http.response.body", "body": b"host"})

app = Gateway(host, config={
    "upstreams": {"primary": {"url": os.environ["ABORT_UPSTREAM"]}},
    "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"]}],
})
"""

FASTAPI_APP = """
import os
from fastapi import FastAPI
from fallback_mw import Gateway

app = FastAPI()
app.add_middleware(Gateway, config={
    "upstreams": {"primary": {"url": os.environ["ABORT_UPSTREAM"]}},
    "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"]}],
})
"""

# FastAPI's `@app.middleware("http")` (Starlette's BaseHTTPMiddleware) in front of the
# gateway: it runs the gateway in a task of its own and relays the body through a stream
# that it ends as complete when the gateway returns.
FASTAPI_HTTP_MIDDLEWARE_APP = (
    FASTAPI_APP
    + """

@app.middleware("http")
async def request_id(request, call_next):
    response = await call_next(request)
    response.headers["x-request-id"] = "r1"
    return response
"""
)

DJANGO_SETTINGS = """
import os
SECRET_KEY = "test-only"
DEBUG = False
ALLOWED_HOSTS = ["*"]
ROOT_URLCONF = "urls"
INSTALLED_APPS = []
MIDDLEWARE = ["fallback_mw.django.GatewayMiddleware"]
FALLBACK_MW = {"config": {
    "upstreams": {"primary": {"url": os.environ["ABORT_UPSTREAM"]}},
    "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"]}],
}}
"""
DJANGO_URLS = "urlpatterns = []\n"
DJANGO_WRAPPED = """
import os
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "settings")
from django.core.asgi import get_asgi_application
from fallback_mw import Gateway
app = Gateway(get_asgi_application(), config={
    "upstreams": {"primary": {"url": os.environ["ABORT_UPSTREAM"]}},
    "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"]}],
})
"""
DJANGO_ASGI = """
import os
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "settings")
from django.core.asgi import get_asgi_application
from fallback_mw.django import with_lifespan
app = with_lifespan(get_asgi_application())
"""

SERVERS: dict[str, tuple[str, list[str]]] = {
    # name: (module that must be importable, command after `python -m`)
    "uvicorn": ("uvicorn", ["uvicorn", "app:app", "--port", "{port}"]),
    "hypercorn": ("hypercorn", ["hypercorn", "app:app", "--bind", "127.0.0.1:{port}"]),
    "hypercorn-h2c": ("hypercorn", ["hypercorn", "app:app", "--bind", "127.0.0.1:{port}"]),
    "daphne": ("daphne", ["daphne", "-b", "127.0.0.1", "-p", "{port}", "app:app"]),
    "granian": ("granian", ["granian", "--interface", "asgi", "--host", "127.0.0.1",
                            "--port", "{port}", "--workers", "1", "app:app"]),
}  # fmt: skip


def require_server(module: str) -> None:
    if importlib.util.find_spec(module) is not None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{module} is not installed (it is in the dev extra)")
    pytest.skip(f"{module} is not installed")


class DyingStream:
    """An SSE upstream: two events, then the connection dies when told to."""

    def __init__(self) -> None:
        self.die = asyncio.Event()
        self.died_at = 0.0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: one\n\n")
        await response.write(b"data: two\n\n")
        await self.die.wait()
        self.died_at = time.monotonic()
        assert request.transport is not None
        request.transport.abort()  # mid-stream, no terminating chunk
        return response


@contextmanager
def server_process(
    tmp: Path, name: str, upstream_url: str, port: int, options: Sequence[str] = ()
) -> Iterator[Path]:
    command = [*SERVERS[name][1], *options]
    log = tmp / f"{name}.log"
    env = {**os.environ, "ABORT_UPSTREAM": upstream_url, "PYTHONUNBUFFERED": "1"}
    args = [part.format(port=port) for part in command]
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", *args], cwd=tmp, env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        yield log
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def wait_for(port: int, log: Path) -> None:
    with anyio.fail_after(30, shield=True):
        while True:
            try:
                stream = await anyio.connect_tcp("127.0.0.1", port)
            except OSError:
                await anyio.sleep(0.05)
                continue
            await stream.aclose()
            return


async def stream_until_broken(port: int, dying: DyingStream, *, h2: bool) -> tuple[float, bytes]:
    """GET the stream; after the two events tell the upstream to die. Returns (seconds
    from the upstream's death to the client's error, what the client received)."""
    received = b""
    url = f"http://127.0.0.1:{port}/v1/chat"
    async with (
        httpx.AsyncClient(http1=not h2, http2=h2, timeout=30) as client,
        client.stream("GET", url) as response,
    ):
        assert response.status_code == 200
        assert response.http_version == ("HTTP/2" if h2 else "HTTP/1.1")
        try:
            async for chunk in response.aiter_raw():
                received += chunk
                if received.count(b"\n\n") >= 2:
                    dying.die.set()
        except httpx.TransportError:
            return time.monotonic() - dying.died_at, received
    pytest.fail(f"the response ended as if complete: {received!r}")


def write_app(tmp: Path, host: str) -> None:
    if host == "django-middleware":
        require_server("django")
        (tmp / "settings.py").write_text(DJANGO_SETTINGS)
        (tmp / "urls.py").write_text(DJANGO_URLS)
        (tmp / "app.py").write_text(DJANGO_ASGI)
    elif host == "django-wrapped":
        require_server("django")
        settings = DJANGO_SETTINGS.replace(
            'MIDDLEWARE = ["fallback_mw.django.GatewayMiddleware"]', "MIDDLEWARE = []"
        )
        (tmp / "settings.py").write_text(settings.split("FALLBACK_MW")[0])
        (tmp / "urls.py").write_text(DJANGO_URLS)
        (tmp / "app.py").write_text(DJANGO_WRAPPED)
    elif host == "fastapi":
        require_server("fastapi")
        (tmp / "app.py").write_text(FASTAPI_APP)
    elif host == "fastapi-http-middleware":
        require_server("fastapi")
        (tmp / "app.py").write_text(FASTAPI_HTTP_MIDDLEWARE_APP)
    else:
        (tmp / "app.py").write_text(GATEWAY_APP)


@pytest.mark.parametrize("host", ["gateway", "fastapi", "django-middleware", "django-wrapped"])
@pytest.mark.parametrize("name", list(SERVERS))
async def test_an_upstream_dying_mid_stream_breaks_the_client_response(
    tmp_path: Path, name: str, host: str
) -> None:
    require_server(SERVERS[name][0])
    write_app(tmp_path, host)
    dying = DyingStream()
    port = free_port()
    async with upstream(dying.handle) as up:
        with server_process(tmp_path, name, up.url, port) as log:
            await wait_for(port, log)
            seconds, received = await stream_until_broken(port, dying, h2=name.endswith("h2c"))
            await anyio.sleep(0.5)  # the request line is written when the request ends
    output = log_text(log)
    print(f"{name} / {host}: broken {seconds * 1000:.0f} ms after the upstream died")
    assert received == b"data: one\n\ndata: two\n\n"
    assert seconds < 1.0, (seconds, output)
    assert "Traceback" not in output, output
    assert "ERROR" not in output and "Exception" not in output, output
    aborted = [line for line in output.splitlines() if "outcome=aborted" in line]
    assert len(aborted) == 1, output
    # Started and stopped cleanly: the lifespan answered, the upstream sessions closed.
    assert "lifespan" not in output.lower() and "Unclosed" not in output, output


GRANIAN_BEHIND_MIDDLEWARE = pytest.mark.xfail(
    strict=True,
    reason="granian offers no handle on its connection: behind a middleware that ends the "
    "response itself the client reads it as complete (request/abort.py)",
)


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=GRANIAN_BEHIND_MIDDLEWARE) if n == "granian" else n for n in SERVERS],
)
async def test_a_stream_dying_behind_an_http_middleware_breaks_every_client_response(
    tmp_path: Path, name: str
) -> None:
    """Behind `@app.middleware("http")` the gateway runs in a task of the middleware's,
    not the server's: the server's own connection must still be found, for every request
    (which task the search met first once decided it, so some ended as complete)."""
    require_server(SERVERS[name][0])
    write_app(tmp_path, "fastapi-http-middleware")
    requests = 8
    dying = DyingStream()
    port = free_port()
    async with upstream(dying.handle) as up:
        with server_process(tmp_path, name, up.url, port) as log:
            await wait_for(port, log)
            for _ in range(requests):
                dying.die = asyncio.Event()
                seconds, received = await stream_until_broken(port, dying, h2=name.endswith("h2c"))
                assert received == b"data: one\n\ndata: two\n\n"
                assert seconds < 1.0, (seconds, log_text(log))
            await anyio.sleep(0.5)  # the request line is written when the request ends
    output = log_text(log)
    aborted = [line for line in output.splitlines() if "outcome=aborted" in line]
    assert len(aborted) == requests, output


FASTAPI_LIMITED_APP = FASTAPI_APP.replace(
    "app.add_middleware(Gateway, config={",
    'app.add_middleware(Gateway, config={\n    "gateway": {"max_response_body": 100},',
)


async def growing_stream(request: web.Request) -> web.StreamResponse:
    """An SSE upstream whose events, arriving together, pass max_response_body (100)."""
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    for n in range(20):
        await response.write(b"data: %02d %s\n\n" % (n, b"x" * 30))
        if n == 0:
            await asyncio.sleep(0.2)  # the head and the first event go out alone
    await asyncio.sleep(1)
    return response


@pytest.mark.parametrize("name", ["uvicorn", "hypercorn"])
async def test_a_response_growing_past_the_limit_is_broken_quietly_inside_fastapi(
    tmp_path: Path, name: str
) -> None:
    # The body passing max_response_body is cut without the task suspending first, and
    # the server's own send must still be found behind FastAPI's middleware: else
    # uvicorn logs "ASGI callable returned without completing response" per abort.
    require_server(SERVERS[name][0])
    require_server("fastapi")
    (tmp_path / "app.py").write_text(FASTAPI_LIMITED_APP)
    port = free_port()
    async with upstream(growing_stream) as up:
        with server_process(tmp_path, name, up.url, port) as log:
            await wait_for(port, log)
            received = b""
            async with httpx.AsyncClient(timeout=30) as client:
                with pytest.raises(httpx.TransportError):
                    async with client.stream("GET", f"http://127.0.0.1:{port}/v1/x") as response:
                        assert response.status_code == 200
                        async for chunk in response.aiter_raw():
                            received += chunk
            await anyio.sleep(0.5)  # the request line is written when the request ends
    output = log_text(log)
    assert received.startswith(b"data: 00") and len(received) <= 100, received
    assert "ERROR" not in output and "Traceback" not in output, output
    too_large = [line for line in output.splitlines() if "outcome=response_too_large" in line]
    assert len(too_large) == 1, output


# What docs/telemetry.md tells each server to keep its access log (which prints the query
# string) quiet; a server absent here writes none unless asked.
QUIET_ACCESS_LOG = {"uvicorn": ["--no-access-log"], "daphne": ["-v", "0"]}
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", [n for n in SERVERS if n != "hypercorn-h2c"])
async def test_run_as_documented_no_server_writes_the_query_string(
    tmp_path: Path, name: str
) -> None:
    # daphne writes an access line per request at its default verbosity, query string
    # included ("GET /v1/chat?api_key=..."), and the docs named only uvicorn's.
    require_server(SERVERS[name][0])
    options = QUIET_ACCESS_LOG.get(name, [])
    if options:
        documented = (ROOT / "docs" / "telemetry.md").read_text(encoding="utf-8")
        assert f"`{' '.join(options)}`" in documented, name
    write_app(tmp_path, "gateway")
    port = free_port()
    async with upstream(status_handler(503)) as up:
        with server_process(tmp_path, name, up.url, port, options) as log:
            await wait_for(port, log)
            async with httpx.AsyncClient(timeout=30) as client:
                url = f"http://127.0.0.1:{port}/v1/chat?api_key=query-marker-7"
                assert (await client.get(url)).status_code == 502
            await anyio.sleep(0.5)  # the request line is written when the request ends
    output = log_text(log)
    assert "query-marker-7" not in output, output
    failed = [line for line in output.splitlines() if "outcome=upstream_failed" in line]
    assert len(failed) == 1, output


async def http10_stream_until_closed(port: int, dying: DyingStream) -> tuple[bytes, str]:
    """GET the stream as an HTTP/1.0 client (as nginx proxies by default): an answer with
    no length, ended by the connection's close. After the two events the upstream dies.
    Returns (the body received, how the connection ended: "eof" or "reset")."""
    stream = await anyio.connect_tcp("127.0.0.1", port)
    received = b""
    try:
        await stream.send(b"GET /v1/chat HTTP/1.0\r\nhost: gw\r\n\r\n")
        with anyio.fail_after(10):
            while True:
                try:
                    received += await stream.receive()
                except anyio.EndOfStream:
                    ended = "eof"
                    break
                except (anyio.BrokenResourceError, ConnectionResetError):
                    ended = "reset"
                    break
                if received.count(b"data: ") >= 2:
                    dying.die.set()
    finally:
        await stream.aclose()
    return received, ended


HTTP10_SERVERS = {
    "uvicorn": ("uvicorn", ["--no-access-log"]),
    "uvicorn-h11": ("uvicorn", ["--no-access-log", "--http", "h11"]),
    "hypercorn": ("hypercorn", []),
    "daphne": ("daphne", ["-v", "0"]),
    "granian": ("granian", []),
}
GRANIAN_NO_RESET = pytest.mark.xfail(
    strict=True,
    reason="granian offers no handle on its connection: an HTTP/1.0 answer that breaks ends "
    "with a plain close, as if complete (docs/operations.md)",
)


@pytest.mark.parametrize("host", ["gateway", "django-middleware"])
@pytest.mark.parametrize(
    "server",
    [pytest.param(n, marks=GRANIAN_NO_RESET) if n == "granian" else n for n in HTTP10_SERVERS],
)
async def test_an_http10_answer_that_breaks_ends_in_a_reset_not_as_complete(
    tmp_path: Path, server: str, host: str
) -> None:
    """An HTTP/1.0 caller's answer has no chunked framing: without a length it ends where
    the connection closes, so a plain close after the upstream died read as the whole
    answer (uvicorn's h11, hypercorn, daphne; nginx, which proxies as HTTP/1.0 by default,
    then ended its own client's answer as complete). The connection is reset instead."""
    name, options = HTTP10_SERVERS[server]
    require_server(name)
    write_app(tmp_path, host)
    dying = DyingStream()
    port = free_port()
    async with upstream(dying.handle) as up:
        with server_process(tmp_path, name, up.url, port, options) as log:
            await wait_for(port, log)
            received, ended = await http10_stream_until_closed(port, dying)
            await anyio.sleep(0.5)  # the request line is written when the request ends
    output = log_text(log)
    assert received.startswith(b"HTTP/1."), received
    assert b"data: two\n\n" in received, received
    assert ended == "reset", (received, output)
    assert "Traceback" not in output, output
    assert len([line for line in output.splitlines() if "outcome=aborted" in line]) == 1, output


# HTTP/2 over TLS (what browsers and curl speak to a server with a certificate): daphne
# serves HTTP/2 only so, hypercorn too when given a certificate.
H2_TLS_OPTIONS = {
    "hypercorn": ["--certfile", "cert.pem", "--keyfile", "key.pem"],
    # An endpoint beside daphne's plain one (-b/-p): the test calls the TLS port.
    "daphne": ["-e", "ssl:{tls_port}:privateKey=key.pem:certKey=cert.pem:interface=127.0.0.1"],
}


async def h2_stream_until_ended(
    port: int, dying: DyingStream, context: ssl.SSLContext
) -> tuple[bytes, str]:
    """GET the stream over HTTP/2 with TLS; after the two events the upstream dies.
    Returns (the body received, how stream 1 ended: "end_stream", "reset:<error code>",
    "goaway" or "eof"). A raw h2 client: httpx raises on any RST_STREAM, and so cannot
    tell one with NO_ERROR (RFC 9113 §8.1: sent after a complete response; curl, over
    nghttp2, reads the answer as whole) from an error."""
    import h2.config
    import h2.connection
    import h2.events

    reader, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=context, server_hostname="127.0.0.1"
    )
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    connection.initiate_connection()
    connection.send_headers(
        1,
        [(":method", "GET"), (":path", "/v1/chat"), (":scheme", "https"),
         (":authority", f"127.0.0.1:{port}")],
        end_stream=True,
    )  # fmt: skip
    writer.write(connection.data_to_send())
    received = b""
    try:
        with anyio.fail_after(10):
            while True:
                data = await reader.read(65536)
                if not data:
                    return received, "eof"
                for event in connection.receive_data(data):
                    if isinstance(event, h2.events.DataReceived) and event.stream_id == 1:
                        received += event.data
                        connection.acknowledge_received_data(event.flow_controlled_length, 1)
                        if received.count(b"\n\n") >= 2:
                            dying.die.set()
                    elif isinstance(event, h2.events.StreamEnded) and event.stream_id == 1:
                        return received, "end_stream"
                    elif isinstance(event, h2.events.StreamReset) and event.stream_id == 1:
                        return received, f"reset:{int(event.error_code)}"
                    elif isinstance(event, h2.events.ConnectionTerminated):
                        return received, "goaway"
                writer.write(connection.data_to_send())
    finally:
        writer.close()


@pytest.mark.parametrize("name", list(H2_TLS_OPTIONS))
async def test_an_http2_stream_that_breaks_is_reset_with_an_error_not_ended_as_complete(
    tmp_path: Path, name: str
) -> None:
    """daphne's own stream abort (twisted's) sends RST_STREAM with NO_ERROR, the code
    RFC 9113 §8.1 keeps for a server that has sent its complete response: curl read the
    cut stream as the whole answer (exit status 0). The stream is reset with an error."""
    trustme = pytest.importorskip("trustme")
    require_server(name)
    write_app(tmp_path, "gateway")
    ca = trustme.CA()
    certificate = ca.issue_cert("127.0.0.1")
    certificate.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    certificate.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    context = ssl.create_default_context()
    ca.configure_trust(context)
    context.set_alpn_protocols(["h2"])
    port, tls_port = free_port(), free_port()
    options = [part.format(tls_port=tls_port) for part in H2_TLS_OPTIONS[name]]
    if name == "hypercorn":
        tls_port = port
    dying = DyingStream()
    async with upstream(dying.handle) as up:
        with server_process(tmp_path, name, up.url, port, options) as log:
            await wait_for(tls_port, log)
            received, ended = await h2_stream_until_ended(tls_port, dying, context)
            await anyio.sleep(0.5)  # the request line is written when the request ends
    output = log_text(log)
    assert received == b"data: one\n\ndata: two\n\n", (received, output)
    assert ended.startswith("reset:") and ended != "reset:0", (ended, output)
    assert "Traceback" not in output, output
    assert len([line for line in output.splitlines() if "outcome=aborted" in line]) == 1, output
