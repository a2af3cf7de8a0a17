"""TLS and egress, the same on both engines (SPEC §12, issue 19): an https:// upstream
with a certificate from a CA made in the test is trusted through `ca_file` (under
[gateway] or per upstream) or `SSL_CERT_FILE`, on aiohttp and on httpx alike; without
them the certificate does not verify, and that is failure kind `tls`, named in the error
message and the request log line, booked to the upstream (the walk fails over). `proxy`
sends an upstream's requests through an egress HTTP proxy (CONNECT for https), with the
allowlist still applied to the upstream and to the proxy."""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from fallback_mw import ConfigError, Gateway, load_config
from fallback_mw.upstream.tls import ssl_context
from tests.helpers import client_for
from tests.upstreams import host_app, status_handler, upstream

if os.environ.get("CI"):  # the dev extra has it: under CI a missing one fails
    import trustme
else:
    trustme = pytest.importorskip("trustme")

pytestmark = [pytest.mark.e2e, pytest.mark.anyio]

ENGINES = ["aiohttp", "httpx"]


@pytest.fixture
def ca() -> Any:
    return trustme.CA()


@pytest.fixture
def ca_pem(ca: Any, tmp_path: Path) -> str:
    path = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(path))
    return str(path)


@asynccontextmanager
async def https_upstream(ca: Any, context: ssl.SSLContext | None = None) -> AsyncIterator[str]:
    """An aiohttp HTTPS server on 127.0.0.1 with a certificate for `localhost` (or the
    server `context` given)."""
    if context is None:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ca.issue_cert("localhost", "127.0.0.1").configure_cert(context)

    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="over tls")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", hello)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"https://localhost:{port}"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def egress_proxy() -> AsyncIterator[tuple[str, list[str]]]:
    """A minimal HTTP proxy: CONNECT tunnels (https) and absolute-form requests (http).
    Yields (its URL, the targets it was asked for)."""
    targets: list[str] = []

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        method, target, _ = head.split(b"\r\n", 1)[0].decode().split(" ", 2)
        if method == "CONNECT":
            host, port = target.rsplit(":", 1)
            first = b""
        else:
            rest = target.split("://", 1)[1]
            authority, _, path = rest.partition("/")
            host, port = authority.rsplit(":", 1)
            first = head.replace(target.encode(), b"/" + path.encode(), 1)
        targets.append(f"{method} {host}:{port}")
        up_reader, up_writer = await asyncio.open_connection(host, int(port))
        if method == "CONNECT":
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            await writer.drain()
        else:
            up_writer.write(first)
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", targets
    finally:
        server.close()


def config(engine: str, primary: str, backup: str | None = None, **options: Any) -> Any:
    gateway = {"engine": engine, **options.pop("gateway", {})}
    upstreams: dict[str, Any] = {"primary": {"url": primary, **options}}
    plan = ["primary"]
    if backup is not None:
        upstreams["backup"] = {"url": backup}
        plan.append("backup")
    return {
        "gateway": gateway,
        "upstreams": upstreams,
        "routes": [{"id": "api", "prefix": "/v1/", "plan": plan, "retries": len(plan) - 1}],
    }


async def get(conf: Any) -> Any:
    gateway = Gateway(host_app, config=conf)
    try:
        async with client_for(gateway) as client:
            return await client.get("/v1/models")
    finally:
        await gateway.aclose()


@pytest.mark.parametrize("engine", ENGINES)
async def test_ca_file_is_trusted_on_both_engines(engine: str, ca: Any, ca_pem: str) -> None:
    async with https_upstream(ca) as url:
        for conf in (
            config(engine, url, gateway={"ca_file": ca_pem}),  # gateway-wide
            config(engine, url, ca_file=ca_pem),  # the upstream's own
        ):
            response = await get(conf)
            assert (response.status_code, response.text) == (200, "over tls")


@pytest.mark.parametrize("engine", ENGINES)
async def test_ca_file_as_a_pathlib_path_is_taken_through_the_python_api(
    engine: str, ca: Any, ca_pem: str
) -> None:
    """`UpstreamConfig(ca_file=Path(...))` / `GatewaySettings(ca_file=Path(...))`, what a
    Python user passes, was refused ("Input should be a valid string"). A path-like is taken
    as its text, in the models, a dict and a GatewayConfig alike, and trusted."""
    from fallback_mw.config import GatewayConfig, GatewaySettings, UpstreamConfig

    pem = Path(ca_pem)
    async with https_upstream(ca) as url:
        for conf in (
            config(engine, url, gateway={"ca_file": pem}),
            config(engine, url, ca_file=pem),
            GatewayConfig(
                gateway=GatewaySettings(engine=engine, ca_file=pem),
                upstreams={"primary": UpstreamConfig(url=url)},
                routes=config(engine, url)["routes"],
            ),
            GatewayConfig(
                gateway=GatewaySettings(engine=engine),
                upstreams={"primary": UpstreamConfig(url=url, ca_file=pem)},
                routes=config(engine, url)["routes"],
            ),
        ):
            response = await get(conf)
            assert (response.status_code, response.text) == (200, "over tls")
    loaded = load_config(config(engine, url, ca_file=pem))
    assert loaded.upstreams["primary"].ca_file == ca_pem  # kept as text: it is stored as JSON


@pytest.mark.parametrize("engine", ENGINES)
async def test_equal_content_lengths_over_tls_fail_over_on_both_engines(
    engine: str, ca: Any, ca_pem: str
) -> None:
    """`Content-Length: 2, 2` from an https:// upstream: refused by aiohttp's parser, and
    by the httpx engine too, which reads the head as written on a TLS stream as on a plain
    one (h11 merged it into `2` and the answer was relayed). Both fail over."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost", "127.0.0.1").configure_cert(context)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2, 2\r\n\r\nok")
            await writer.drain()
            await asyncio.sleep(0.3)
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            pass
        finally:
            writer.transport.abort()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=context)
    port = server.sockets[0].getsockname()[1]
    try:
        async with upstream(status_handler(200, b"backup")) as backup:
            conf = config(engine, f"https://localhost:{port}", backup.url, ca_file=ca_pem)
            response = await get(conf)
    finally:
        server.close()
        await server.wait_closed()
    assert (response.status_code, response.text) == (200, "backup")
    assert response.headers["x-gateway-attempts"] == "2"


@pytest.mark.parametrize("engine", ENGINES)
async def test_ca_file_is_trusted_for_an_https_url_in_any_case(
    engine: str, ca: Any, ca_pem: str
) -> None:
    """`url = "HTTPS://..."` is an https URL (the scheme is case-insensitive, and the
    loader took it): aiohttp chose the upstream's TLS trust by a case-sensitive prefix,
    so it verified against the system's store instead of `ca_file`, and every request
    failed as `tls`, booked to the upstream; httpx served it."""
    async with https_upstream(ca) as url:
        upper = url.replace("https://", "HTTPS://")
        for conf in (
            config(engine, upper, gateway={"ca_file": ca_pem}),
            config(engine, upper, ca_file=ca_pem),
        ):
            response = await get(conf)
            assert (response.status_code, response.text) == (200, "over tls")
    assert load_config(config(engine, upper)).upstreams["primary"].url == url


@pytest.mark.parametrize("engine", ENGINES)
async def test_ssl_cert_file_is_honoured_by_both_engines(
    engine: str, ca: Any, ca_pem: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SSL_CERT_FILE", ca_pem)
    ssl_context.cache_clear()  # the default context is built once per process
    try:
        async with https_upstream(ca) as url:
            response = await get(config(engine, url))
    finally:
        monkeypatch.delenv("SSL_CERT_FILE")
        ssl_context.cache_clear()
    assert (response.status_code, response.text) == (200, "over tls")


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_certificate_that_does_not_verify_is_failure_kind_tls(
    engine: str, ca: Any, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    caplog.set_level(logging.INFO, logger="fallback_mw.request")
    other = tmp_path / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(other))  # a CA that did not sign it
    async with https_upstream(ca) as url, upstream(status_handler(200, b"backup")) as backup:
        alone = await get(config(engine, url, ca_file=str(other)))
        fallback = await get(config(engine, url, backup.url, ca_file=str(other)))
    error = alone.json()["error"]
    assert (alone.status_code, error["code"]) == (502, "upstream_failed")
    assert "last failure: tls" in error["message"] and "ca_file" in error["message"]
    lines = [r.getMessage() for r in caplog.records if r.name == "fallback_mw.request"]
    assert "failures=primary:tls" in lines[0]
    # Booked to the upstream like any transport failure: the walk goes on to the backup.
    assert (fallback.status_code, fallback.text) == (200, "backup")
    assert fallback.headers["x-gateway-attempts"] == "2"
    assert "failures=primary:tls" in lines[1]


@pytest.mark.parametrize("engine", ENGINES)
async def test_an_upstream_behind_an_egress_proxy(engine: str, ca: Any, ca_pem: str) -> None:
    async with (
        https_upstream(ca) as tls_url,
        upstream(status_handler(200, b"plain")) as plain,
        egress_proxy() as (proxy, targets),
    ):
        secure = await get(config(engine, tls_url, ca_file=ca_pem, proxy=proxy))
        cleartext = await get(config(engine, plain.url, proxy=proxy))
    assert (secure.status_code, secure.text) == (200, "over tls")
    assert (cleartext.status_code, cleartext.text) == (200, "plain")
    port = tls_url.rsplit(":", 1)[1]
    assert targets[0] == f"CONNECT localhost:{port}"
    assert targets[1].endswith(plain.url.rsplit(":", 1)[1]) and plain.count == 1


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_proxy_that_never_answers_connect_is_the_upstreams_timeout(
    engine: str, ca: Any, ca_pem: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An egress proxy that accepts the connection and never answers CONNECT: aiohttp had
    no timer on that answer, so every attempt waited out the walk deadline (a 504, no
    breaker mark, no time left for the fallback); the httpx engine's first-byte timer ended
    it. Both now end it at first_byte_timeout_ms, a timeout booked to the upstream, and
    the backup serves. With a streamed body (over replay_buffer) neither engine timed it:
    the deadline ran out with the body still unsent, the caller's 408 (see below)."""
    caplog.set_level(logging.INFO, logger="fallback_mw.request")
    accepted: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)  # reads nothing, answers nothing, keeps it open

    proxy = await asyncio.start_server(silent, "127.0.0.1", 0)
    proxy_url = f"http://127.0.0.1:{proxy.sockets[0].getsockname()[1]}"
    try:
        async with (
            https_upstream(ca) as url,
            upstream(status_handler(200, b"backup")) as backup,
        ):
            conf = config(engine, url, backup.url, ca_file=ca_pem, proxy=proxy_url,
                          first_byte_timeout_ms=300, connect_timeout_ms=300)  # fmt: skip
            conf["gateway"]["deadline_ms"] = 20_000
            started = time.monotonic()
            response = await get(conf)
            took = time.monotonic() - started
    finally:
        for writer in accepted:
            writer.close()
        proxy.close()
    assert accepted, "the proxy was never reached"
    assert (response.status_code, response.text) == (200, "backup")
    assert response.headers["x-gateway-attempts"] == "2"
    lines = [r.getMessage() for r in caplog.records if r.name == "fallback_mw.request"]
    assert lines[-1].endswith(" failures=primary:timeout"), lines
    assert took < 10, took  # the first-byte timeout (0.3 s), not the deadline (20 s)


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_streamed_body_behind_a_proxy_that_never_answers_is_not_the_callers_408(
    engine: str, ca: Any, ca_pem: str
) -> None:
    # The whole body was there; the tunnel never opened, so nothing of it was sent and
    # the walk deadline ended the request as "the request body did not arrive in time",
    # 408 booked to the caller, no mark on the upstream. The first-byte timer now runs
    # while the proxy is asked for the tunnel: the upstream's timeout, a 502.
    accepted: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)

    proxy = await asyncio.start_server(silent, "127.0.0.1", 0)
    proxy_url = f"http://127.0.0.1:{proxy.sockets[0].getsockname()[1]}"
    try:
        conf = config(engine, "https://localhost:9", ca_file=ca_pem, proxy=proxy_url,
                      first_byte_timeout_ms=300, connect_timeout_ms=300)  # fmt: skip
        conf["gateway"].update(deadline_ms=20_000, replay_buffer=1024)
        conf["routes"][0]["replayable_methods"] = ["GET", "POST"]
        gateway = Gateway(host_app, config=conf)
        started = time.monotonic()
        try:
            async with client_for(gateway) as client:
                response = await client.post("/v1/chat", content=b"x" * 4096)
        finally:
            await gateway.aclose()
        took = time.monotonic() - started
    finally:
        for writer in accepted:
            writer.close()
        proxy.close()
    error = response.json()["error"]
    assert (response.status_code, error["code"]) == (502, "upstream_failed"), error
    assert "last failure: timeout at 'primary'" in error["message"], error["message"]
    assert took < 10, took


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_proxy_that_refuses_the_tunnel_is_named_in_the_error(
    engine: str, ca_pem: str
) -> None:
    # A corporate proxy answering CONNECT with 407 or 403: the 502 said "last failure:
    # transport at 'primary'" and nothing more, on both engines; it names the proxy's
    # refusal and its status (never its reason text or headers).
    for status in (407, 403):

        async def refuse(
            reader: asyncio.StreamReader, writer: asyncio.StreamWriter, status: int = status
        ) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 %d Refused sk-secret-reason\r\n" % status
                         + b"content-length: 0\r\n\r\n")  # fmt: skip
            await writer.drain()
            writer.close()

        proxy = await asyncio.start_server(refuse, "127.0.0.1", 0)
        proxy_url = f"http://127.0.0.1:{proxy.sockets[0].getsockname()[1]}"
        try:
            response = await get(
                config(engine, "https://localhost:9", ca_file=ca_pem, proxy=proxy_url)
            )
        finally:
            proxy.close()
        error = response.json()["error"]
        assert (response.status_code, error["code"]) == (502, "upstream_failed")
        assert f"the egress proxy refused the tunnel to it ({status})" in error["message"]
        assert "sk-secret-reason" not in response.text


def test_the_allowlist_still_applies_behind_a_proxy() -> None:
    proxied = {"url": "https://api.example.com", "proxy": "http://127.0.0.1:3128"}
    with pytest.raises(ConfigError, match=r"'api\.example\.com' is not in allow_hosts"):
        load_config({"upstreams": {"p": proxied},
                     "routes": [{"id": "r", "prefix": "/", "plan": ["p"]}]})  # fmt: skip
    outside = {"url": "http://127.0.0.1:9", "proxy": "http://proxy.corp:3128"}
    with pytest.raises(ConfigError, match=r"proxy host 'proxy\.corp' is not in allow_hosts"):
        load_config({"upstreams": {"p": outside},
                     "routes": [{"id": "r", "prefix": "/", "plan": ["p"]}]})  # fmt: skip
    metadata = {"url": "http://127.0.0.1:9", "proxy": "http://169.254.169.254"}
    with pytest.raises(ConfigError, match="proxy"):
        load_config({"gateway": {"allow_hosts": ["0.0.0.0/0"]}, "upstreams": {"p": metadata},
                     "routes": [{"id": "r", "prefix": "/", "plan": ["p"]}]})  # fmt: skip


def test_a_ca_file_that_is_not_a_pem_bundle_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "not.pem"
    bad.write_text("not a certificate\n")
    for path, match in ((str(tmp_path / "absent.pem"), "not found"),
                        (str(bad), "not a readable PEM bundle")):  # fmt: skip
        with pytest.raises(ConfigError, match=match):
            load_config({"gateway": {"ca_file": path}})
