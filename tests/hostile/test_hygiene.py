"""Header hygiene, address checks and path parameters, probed as an attacker would:
underscore spellings of stripped headers, IPv6 loopback upstreams, hosts with spaces,
and `;` path parameters on dot segments."""

from __future__ import annotations

import socket
from typing import Any

import anyio
import pytest
from aiohttp import web

from fallback_mw import Gateway
from fallback_mw.config import ConfigError, load_config
from fallback_mw.routing import normalise_path, routed_path
from fallback_mw.security.fields import forwardable_request_headers
from tests.helpers import http_scope
from tests.upstreams import host_app, serve_asgi, status_handler, upstream

CALLER_SECRET = "caller-secret-77"


async def exchange(base: str, request: bytes) -> bytes:
    """Send `request` as written over one connection to `base`; all it answers, to EOF."""
    host, port = base.removeprefix("http://").split(":")
    stream = await anyio.connect_tcp(host, int(port))
    try:
        await stream.send(request)
        data = b""
        while True:
            try:
                data += await stream.receive()
            except anyio.EndOfStream:
                return data
    finally:
        await stream.aclose()


@pytest.mark.parametrize(
    "name",
    [
        b"x_api_key",
        b"X_Api_Key",
        b"proxy_authorization",
        b"x_gateway_route",
        b"x_primary_key",
        b"transfer_encoding",
        b"keep_alive",
        b"content_length",
        b"x-api_key",
    ],
)
def test_underscore_spellings_of_stripped_headers_are_stripped(name: bytes) -> None:
    headers = [(name, b"v"), (b"x-keep", b"1"), (b"x_custom_trace", b"kept")]
    kept = forwardable_request_headers(headers, also_strip=frozenset({b"x-primary-key"}))
    assert kept == [(b"x-keep", b"1"), (b"x_custom_trace", b"kept")]


def test_a_connection_list_naming_an_underscore_spelling_strips_both_spellings() -> None:
    headers = [(b"connection", b"x-hop"), (b"x_hop", b"1"), (b"x-hop", b"2")]
    assert forwardable_request_headers(headers) == []


@pytest.mark.anyio
async def test_an_underscore_credential_never_reaches_the_upstream() -> None:
    async with upstream(status_handler(200, b"ok")) as primary:
        conf = {
            "upstreams": {
                "primary": {
                    "url": primary.url,
                    "auth_header": "x-primary-key",
                    "auth_scheme": "",
                    "auth_env": "FMW_T_KEY",
                }
            },
            "routes": [{"id": "r", "prefix": "/v1/", "plan": ["primary"]}],
        }
        gateway = Gateway(host_app, config=conf, environ={"FMW_T_KEY": "gateway-key"})
        try:
            async with serve_asgi(gateway) as base:
                data = await exchange(
                    base,
                    b"GET /v1/x HTTP/1.1\r\nhost: gw\r\nconnection: close\r\n"
                    b"x_primary_key: " + CALLER_SECRET.encode() + b"\r\n"
                    b"x_api_key: " + CALLER_SECRET.encode() + b"\r\n\r\n",
                )
        finally:
            await gateway.aclose()
    assert data.startswith(b"HTTP/1.1 200")
    received = primary.received[0].headers
    assert all(CALLER_SECRET not in value for _, value in received)
    assert ("x-primary-key", "gateway-key") in received


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.anyio
@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback on this machine")
@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
@pytest.mark.parametrize("entry", ["::1", "[::1]", "::1/128"])
async def test_an_ipv6_loopback_upstream_works_when_listed(engine: str, entry: str) -> None:
    async def ok(request: web.Request) -> web.StreamResponse:
        return web.Response(body=b"v6")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", ok)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "::1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        conf = {
            "gateway": {"allow_hosts": [entry], "engine": engine},
            "upstreams": {"v6": {"url": f"http://[::1]:{port}"}},
            "routes": [{"id": "r", "prefix": "/v1/", "plan": ["v6"]}],
        }
        gateway = Gateway(host_app, config=conf)
        try:
            import httpx

            async with serve_asgi(gateway) as base, httpx.AsyncClient(base_url=base) as client:
                response = await client.get("/v1/x")
        finally:
            await gateway.aclose()
    finally:
        await runner.cleanup()
    assert response.status_code == 200, response.text
    assert response.text == "v6"


@pytest.mark.parametrize(
    "url",
    [
        "http://exa mple.com",
        "http://127.0.0.1 /",
        "http://a\tb",
        "http://exa%20mple.com",
        "http://[::1",
        "http://h:99999",
        "http://h:port",
        "http://exämple.com",
    ],
)
def test_an_upstream_url_with_a_malformed_host_is_refused_at_load(url: str) -> None:
    conf: dict[str, Any] = {
        "gateway": {"allow_hosts": ["0.0.0.0/0", "h"]},
        "upstreams": {"u": {"url": url}},
        "routes": [{"id": "r", "prefix": "/v1/", "plan": ["u"]}],
    }
    with pytest.raises(ConfigError, match=r"upstreams\.u\.url"):
        load_config(conf, environ={})


@pytest.mark.parametrize(
    "raw",
    [
        "/v1/..;/admin",
        "/v1/..;x=1/admin",
        "/v1/.;/../admin",
        "/v1/%2e%2e;/admin",
        "/v1/..%3b/admin",
        "/v1/.%2e;jsessionid=1/admin",
    ],
)
def test_dot_segments_with_path_parameters_cannot_escape_a_prefix(raw: str) -> None:
    path = normalise_path(raw)
    assert path is None or not path.startswith("/v1/")


def test_path_parameters_on_ordinary_segments_are_kept() -> None:
    assert normalise_path("/v1/models;v=2/x") == "/v1/models;v=2/x"


@pytest.mark.anyio
async def test_a_dot_dot_parameter_path_is_not_forwarded_under_the_prefix() -> None:
    async with upstream(status_handler(200, b"upstream")) as primary:
        conf = {
            "upstreams": {"primary": {"url": primary.url}},
            "routes": [{"id": "r", "prefix": "/v1/", "plan": ["primary"]}],
        }
        gateway = Gateway(host_app, config=conf)
        try:
            async with serve_asgi(gateway) as base:
                data = await exchange(
                    base, b"GET /v1/..;/admin HTTP/1.1\r\nhost: gw\r\nconnection: close\r\n\r\n"
                )
        finally:
            await gateway.aclose()
    assert data.startswith(b"HTTP/1.1 404")  # the host app answered: not routed
    assert primary.count == 0


async def acts_on_path_override(request: web.Request) -> web.StreamResponse:
    """An upstream that takes its path from a rewrite field, as Yii 2 (`X-Rewrite-Url`) and
    Zend Framework 1 (`X-Original-URL`, `X-Rewrite-URL`) do."""
    path = request.path
    for name, value in request.headers.items():
        if name.lower().replace("_", "-") in ("x-original-url", "x-rewrite-url"):
            path = value
    return web.Response(text=f"served {path}")


@pytest.mark.anyio
@pytest.mark.parametrize(
    "field", [b"X-Original-URL", b"x-rewrite-url", b"X_Original_Url", b"X-Rewrite_URL"]
)
async def test_a_path_override_field_never_reaches_the_upstream(field: bytes) -> None:
    # Before: `POST /v1/chat` with `X-Original-URL: /admin/users/1/delete` was forwarded as
    # it came, the provider's credential injected: an upstream that reads the field served
    # the path the caller named, outside the route's prefix.
    async with upstream(acts_on_path_override) as primary:
        conf = {
            "upstreams": {"primary": {"url": primary.url}},
            "routes": [{"id": "r", "prefix": "/v1/", "plan": ["primary"]}],
        }
        gateway = Gateway(host_app, config=conf)
        try:
            async with serve_asgi(gateway) as base:
                data = await exchange(
                    base,
                    b"POST /v1/chat HTTP/1.1\r\nhost: gw\r\nconnection: close\r\n"
                    b"%s: /admin/users/1/delete\r\ncontent-length: 2\r\n\r\n{}" % field,
                )
        finally:
            await gateway.aclose()
    assert data.startswith(b"HTTP/1.1 200"), data[:300]
    assert data.endswith(b"served /v1/chat")
    received = primary.received[0]
    assert not [v for _, v in received.headers if "admin" in v]


def public_only(app: Any, *, naive: bool) -> Any:
    """A host's authorization in front of the gateway: only paths below /public/ pass. The
    naive one reads scope["path"]; the documented one the path the gateway routes on."""

    async def middleware(scope: Any, receive: Any, send: Any) -> None:
        path = scope["path"] if naive else routed_path(scope)
        if path is None or not path.startswith("/public/"):
            await send({"type": "http.response.start", "status": 403, "headers": []})
            await send({"type": "http.response.body", "body": b"forbidden"})
            return
        await app(scope, receive, send)

    return middleware


@pytest.mark.anyio
@pytest.mark.parametrize(
    "target", ["/public/../v1/x", "/public/%2e%2e/v1/x", "/public/..;p/v1/x", "/public/%2F../v1/x"]
)
async def test_a_path_check_in_front_that_reads_routed_path_is_not_bypassed(target: str) -> None:
    """docs/security.md: the gateway routes dot segments resolved, the server hands the
    middleware in front the path as written. A check on scope["path"] lets
    `/public/../v1/x` reach the /v1/ route's upstream; one on `routed_path(scope)` does not."""
    async with (
        upstream(status_handler(200, b"public")) as public,
        upstream(status_handler(200, b"private")) as private,
    ):
        conf = {
            "upstreams": {"public": {"url": public.url}, "private": {"url": private.url}},
            "routes": [
                {"id": "pub", "prefix": "/public/", "plan": ["public"]},
                {"id": "priv", "prefix": "/v1/", "plan": ["private"]},
            ],
        }
        heads = []
        for naive in (True, False):
            gateway = Gateway(host_app, config=conf)
            try:
                async with serve_asgi(public_only(gateway, naive=naive)) as base:
                    request = f"GET {target} HTTP/1.1\r\nhost: gw\r\nconnection: close\r\n\r\n"
                    data = await exchange(base, request.encode())
            finally:
                await gateway.aclose()
            heads.append(data.split(b"\r\n", 1)[0])
        reached_private = private.count
    assert heads[0] == b"HTTP/1.1 200 OK"  # the naive check: the private route answered
    assert heads[1] == b"HTTP/1.1 403 Forbidden"  # routed_path: refused
    assert reached_private == 1  # only the naive check's request


@pytest.mark.anyio
async def test_a_routed_response_has_one_date_and_never_the_upstreams_server_header() -> None:
    async with upstream(status_handler(200, b"ok")) as primary:
        conf = {
            "upstreams": {"primary": {"url": primary.url}},
            "routes": [{"id": "r", "prefix": "/v1/", "plan": ["primary"]}],
        }
        gateway = Gateway(host_app, config=conf)
        try:
            async with serve_asgi(gateway) as base:
                import httpx

                async with httpx.AsyncClient(base_url=base) as client:
                    response = await client.get("/v1/x")
        finally:
            await gateway.aclose()
    assert response.status_code == 200
    assert len(response.headers.get_list("date")) == 1
    assert all("aiohttp" not in value for value in response.headers.get_list("server"))
    assert len(response.headers.get_list("server")) <= 1


@pytest.mark.anyio
async def test_a_path_with_raw_utf8_bytes_is_forwarded_as_the_caller_wrote_it() -> None:
    """granian hands the app the caller's bytes >= 0x80 as they came (uvicorn, hypercorn
    and daphne refuse them): `raw_path` b"/v1/\\xc3\\xa9" went to the upstream as
    `/v1/%C3%83%C2%A9`, its latin-1 reading encoded again. Bytes that are not UTF-8 match
    no route (as `%E9` does): the host app answers, no upstream is contacted."""
    async with upstream(status_handler(200, b"ok")) as primary:
        conf = {
            "upstreams": {"primary": {"url": primary.url}},
            "routes": [{"id": "r", "prefix": "/v1/", "plan": ["primary"]}],
        }
        gateway = Gateway(host_app, config=conf)
        statuses = []
        try:
            for raw in ("/v1/é/ü".encode(), "/v1/é%20x".encode(), b"/v1/\xe9"):
                scope = http_scope("GET", raw.decode("utf-8", "replace"))
                scope["raw_path"] = raw
                sent: list[dict[str, Any]] = []

                async def receive() -> dict[str, Any]:
                    return {"type": "http.request", "body": b"", "more_body": False}

                async def send(message: dict[str, Any], sent: list[Any] = sent) -> None:
                    sent.append(message)

                await gateway(scope, receive, send)
                statuses.append(sent[0]["status"])
        finally:
            await gateway.aclose()
    assert statuses == [200, 200, 404]
    assert [r.path for r in primary.received] == ["/v1/%C3%A9/%C3%BC", "/v1/%C3%A9%20x"]


@pytest.mark.anyio
async def test_text_header_fields_from_an_embedding_app_are_read_as_bytes() -> None:
    """ASGI servers send header names and values as bytes; an app or a test client driving
    the gateway in-process may pass text. Such a head was a 500 (a TypeError in the header
    filter when a `Connection` field named another field, and elsewhere on the path);
    it is read as the bytes it spells: the credential and the fields `Connection` names are
    still stripped, the rest forwarded."""
    async with upstream(status_handler(200, b"ok")) as primary:
        conf = {
            "upstreams": {"primary": {"url": primary.url}},
            "routes": [{"id": "r", "prefix": "/v1/", "plan": ["primary"]}],
        }
        gateway = Gateway(host_app, config=conf)
        heads: list[list[tuple[Any, Any]]] = [
            [(b"connection", "x-hop"), (b"x-hop", b"1"), (b"x-keep", "kept")],
            [
                (b"connection", b"x-hop"),
                ("X-Hop", "2"),
                ("authorization", f"Bearer {CALLER_SECRET}"),
            ],
            [("x-tenant-id", "acme"), (b"x-other", "\u00e9t\u00e9")],
        ]
        statuses = []
        try:
            for head in heads:
                scope = http_scope("GET", "/v1/x", headers=head)
                sent: list[dict[str, Any]] = []

                async def receive() -> dict[str, Any]:
                    return {"type": "http.request", "body": b"", "more_body": False}

                async def send(message: dict[str, Any], sent: list[Any] = sent) -> None:
                    sent.append(message)

                await gateway(scope, receive, send)
                statuses.append(sent[0]["status"])
        finally:
            await gateway.aclose()
    assert statuses == [200, 200, 200]
    received = [dict(r.headers) for r in primary.received]
    assert received[0].get("x-keep") == "kept" and "x-hop" not in received[0]
    assert "x-hop" not in received[1] and "authorization" not in received[1]
    assert CALLER_SECRET not in repr(primary.received)
    assert received[2].get("x-other") == "\u00e9t\u00e9"


@pytest.mark.anyio
@pytest.mark.parametrize("over", ["max_header_bytes", "max_header_count"])
async def test_a_text_header_field_after_a_head_over_the_limits_is_still_the_431(over: str) -> None:
    """The head over `max_header_bytes` (or `max_header_count`) before its text field (a
    host middleware appending `("x-added", "1")` to the server's bytes): the limit's walk
    answered before it reached the text field, which the header pass then read as bytes
    (`str.replace(b"_", b"-")`): a TypeError out of the gateway, no answer, where the same
    head with a bytes field is the 431."""
    async with upstream(status_handler(200, b"ok")) as primary:
        conf = {
            "gateway": {"max_header_bytes": 2048, "max_header_count": 8},
            "upstreams": {"primary": {"url": primary.url}},
            "routes": [{"id": "r", "prefix": "/v1/", "plan": ["primary"]}],
        }
        gateway = Gateway(host_app, config=conf)
        sent_heads: list[list[tuple[Any, Any]]] = (
            [[(b"x-big", b"a" * 4096)]]
            if over == "max_header_bytes"
            else [[(f"x-{i}".encode(), b"1") for i in range(12)]]
        )
        answers = []
        try:
            for head in sent_heads:
                for added in (b"1", "1"):  # the bytes control, then the text field
                    scope = http_scope("GET", "/v1/x", headers=[*head, ("x-added", added)])
                    sent: list[dict[str, Any]] = []

                    async def receive() -> dict[str, Any]:
                        return {"type": "http.request", "body": b"", "more_body": False}

                    async def send(message: dict[str, Any], sent: list[Any] = sent) -> None:
                        sent.append(message)

                    await gateway(scope, receive, send)
                    answers.append(sent[0]["status"])
        finally:
            await gateway.aclose()
    assert answers == [431, 431]
    assert primary.received == []
