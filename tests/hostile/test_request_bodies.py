"""Request bodies as an attacker sends them, through a real server: a JSON body nested
1,000 levels deep, and chunked bodies carrying trailer fields (credentials included)."""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest

from fallback_mw import Gateway
from tests.upstreams import host_app, serve_asgi, status_handler, upstream

pytestmark = pytest.mark.anyio


def config(url: str, **extra: Any) -> dict[str, Any]:
    return {
        "gateway": {"allow_hosts": ["127.0.0.1"]},
        "upstreams": {"primary": {"url": url, "auth_env": "FMW_T_KEY", **extra}},
        "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"], "budget": "b",
                    "replayable_methods": ["GET", "POST"]}],
        "budgets": {"b": {"limit": "10"}},
        "prices": {"m": {"input_per_mtok": "1", "output_per_mtok": "1"}},
    }  # fmt: skip


async def exchange(base: str, request: bytes) -> bytes:
    host, port = base.removeprefix("http://").split(":")
    stream = await anyio.connect_tcp(host, int(port))
    data = b""
    try:
        await stream.send(request)
        while True:
            try:
                data += await stream.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                break
    finally:
        await stream.aclose()
    return data


def post(body: bytes, extra: bytes = b"") -> bytes:
    return (
        b"POST /v1/chat HTTP/1.1\r\nhost: gw\r\nconnection: close\r\n"
        b"content-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s"
        % (len(body), extra, body)
    )


def parser_depth() -> int:
    """The deepest nesting `json.loads` reads here: the interpreter's, not the gateway's
    (CPython 3.11 about 990 levels, Python's stack; 3.12 about 1,500 and 3.13 about 10,000,
    a C recursion limit of their own)."""
    reads, fails = 1, 1_000_000
    while fails - reads > 1:
        depth = (reads + fails) // 2
        try:
            json.loads("[" * depth + "]" * depth)
        except RecursionError:
            fails = depth
        else:
            reads = depth
    return reads


# Deeper than any interpreter's parser reads (1,000 levels did on Python 3.12 and later).
DEEP = b'{"model":"m","max_tokens":5,"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"


@pytest.mark.parametrize("http", ["h11", "httptools"])
@pytest.mark.parametrize(
    "route", ["plain", "model-rewrite", "budgeted"], ids=["plain", "model-rewrite", "budgeted"]
)
async def test_a_json_body_nested_too_deep_to_parse_is_never_a_500(http: str, route: str) -> None:
    async with upstream(status_handler(200, b"ok")) as primary:
        extra = {"model": "other"} if route == "model-rewrite" else {}
        conf = config(primary.url, **extra)
        if route != "budgeted":
            del conf["routes"][0]["budget"]
        gateway = Gateway(host_app, config=conf, environ={"FMW_T_KEY": "k"})
        try:
            async with serve_asgi(gateway, http=http) as base:
                response = await exchange(base, post(DEEP))
        finally:
            await gateway.aclose()
    status = int(response.split(b" ", 2)[1])
    assert status != 500
    if route == "model-rewrite":
        assert status == 400 and b'"bad_request"' in response  # cannot rewrite it
        assert primary.count == 0
    elif route == "budgeted":
        # No hold can be estimated from it, and Node's and Go's readers take it whole:
        # refused rather than run for default_hold.
        assert status == 400 and b"nested deeper" in response
        assert primary.count == 0
    else:
        assert status == 200 and primary.count == 1
        assert primary.received[0].body == DEEP  # forwarded untouched


async def test_a_json_body_nested_just_under_the_parsers_limit_is_never_a_500() -> None:
    """`json.loads` reads a body nested up to ~930 levels (its stack's depth then, on
    Python 3.11), and a candidate's model rewrite wrote it again deeper in the stack:
    RecursionError, a 500 and a traceback. Every depth up to past that limit (the running
    interpreter's) is answered: sent rewritten, or that candidate skipped (the body cannot
    be written again), never a 500."""
    limit = parser_depth()
    async with upstream(status_handler(200, b"ok")) as primary:
        conf = config(primary.url, model="other")
        del conf["routes"][0]["budget"]
        gateway = Gateway(host_app, config=conf, environ={"FMW_T_KEY": "k"})
        statuses: dict[int, list[int]] = {}
        try:
            async with serve_asgi(gateway) as base:
                for depth in range(limit - 150, limit + 10):
                    body = b'{"model":"m","x":' + b"[" * depth + b"]" * depth + b"}"
                    response = await exchange(base, post(body))
                    statuses.setdefault(int(response.split(b" ", 2)[1]), []).append(depth)
        finally:
            await gateway.aclose()
    assert set(statuses) <= {200, 400, 503}, {s: (d[0], d[-1]) for s, d in statuses.items()}
    assert statuses[200] and statuses[400]  # both sides of the limit were reached
    assert primary.count == len(statuses[200])
    assert all(b'"model":"other"' in r.body for r in primary.received)


@pytest.mark.parametrize("http", ["h11", "httptools"])
async def test_trailer_fields_never_reach_the_upstream(http: str) -> None:
    async with upstream(status_handler(200, b"ok")) as primary:
        gateway = Gateway(host_app, config=config(primary.url), environ={"FMW_T_KEY": "k"})
        try:
            async with serve_asgi(gateway, http=http) as base:
                response = await exchange(
                    base,
                    b"POST /v1/chat HTTP/1.1\r\nhost: gw\r\nconnection: close\r\n"
                    b"transfer-encoding: chunked\r\ntrailer: x-api-key, x-after\r\n"
                    b"te: trailers\r\n\r\n"
                    b"2\r\n{}\r\n0\r\nx-api-key: caller-secret\r\nx-after: 1\r\n"
                    b"authorization: Bearer caller-secret\r\n\r\n",
                )
        finally:
            await gateway.aclose()
    assert response.startswith(b"HTTP/1.1 200")
    received = primary.received[0]
    names = [name for name, _ in received.headers]
    assert all("caller-secret" not in value for _, value in received.headers)
    assert "x-after" not in names and "trailer" not in names and "te" not in names
    assert received.body == b"{}"


async def test_serve_drops_undeclared_trailer_fields_before_the_app_sees_them() -> None:
    from fallback_mw.cli.server_limits import uvicorn_limits
    from fallback_mw.config import load_config

    settings = load_config({}).gateway
    async with upstream(status_handler(200, b"ok")) as primary:
        gateway = Gateway(host_app, config=config(primary.url), environ={"FMW_T_KEY": "k"})
        try:
            async with serve_asgi(gateway, **uvicorn_limits(settings, "httptools")) as base:
                response = await exchange(
                    base,
                    b"POST /v1/chat HTTP/1.1\r\nhost: gw\r\nconnection: close\r\n"
                    b"transfer-encoding: chunked\r\n\r\n"
                    b"2\r\n{}\r\n0\r\nx-after: 1\r\n\r\n",
                )
        finally:
            await gateway.aclose()
    assert response.startswith(b"HTTP/1.1 200")
    assert "x-after" not in [name for name, _ in primary.received[0].headers]


async def test_a_body_sent_at_one_byte_a_second_gets_408_within_the_deadline() -> None:
    async with upstream(status_handler(200, b"ok")) as primary:
        conf = config(primary.url)
        conf["routes"][0]["deadline_ms"] = 1000
        gateway = Gateway(host_app, config=conf, environ={"FMW_T_KEY": "k"})
        try:
            async with serve_asgi(gateway) as base:
                host, port = base.removeprefix("http://").split(":")
                stream = await anyio.connect_tcp(host, int(port))
                data = b""
                try:
                    await stream.send(
                        b"POST /v1/chat HTTP/1.1\r\nhost: gw\r\nconnection: close\r\n"
                        b"content-length: 100\r\n\r\n"
                    )
                    with anyio.move_on_after(20):  # the answer comes long before
                        for _ in range(100):
                            await stream.send(b"a")
                            with anyio.move_on_after(1):
                                data += await stream.receive()
                            if data:
                                break
                finally:
                    await stream.aclose()
        finally:
            await gateway.aclose()
    assert data.startswith(b"HTTP/1.1 408"), data[:200]
    assert b'"request_timeout"' in data
    assert primary.count == 0


LONE_SURROGATE = b'{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"\\ud800"}]}'


@pytest.mark.parametrize("http", ["h11", "httptools"])
async def test_a_json_body_with_a_lone_surrogate_escape_is_never_a_500(http: str) -> None:
    # "\ud800" is valid JSON (an escape) that json.loads turns into a lone surrogate; the
    # model rewrite re-encoded the body as UTF-8, which cannot hold one: a bare 500.
    async with upstream(status_handler(200, b"ok")) as primary:
        gateway = Gateway(host_app, config=config(primary.url, model="other"),
                          environ={"FMW_T_KEY": "k"})  # fmt: skip
        try:
            async with serve_asgi(gateway, http=http) as base:
                response = await exchange(base, post(LONE_SURROGATE))
        finally:
            await gateway.aclose()
    status = int(response.split(b" ", 2)[1])
    assert status == 200, response
    sent = json.loads(primary.received[0].body)
    assert sent["model"] == "other"
    assert sent["messages"][0]["content"] == "\ud800"  # the caller's text, as it was


@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
async def test_a_buffered_body_over_1mib_is_sent_without_a_warning(engine: str) -> None:
    """With `replay_buffer` raised above 1 MiB, a 2 MiB body is buffered and sent whole;
    aiohttp warned (ResourceWarning) on such a body, and under warnings as errors (this
    suite, a host's test suite) the request ended in that warning instead of an answer.
    Its failover replays the same bytes."""
    from tests.helpers import client_for

    received: list[tuple[str, bytes]] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        data = b""
        while True:
            message = await receive()
            data += message.get("body", b"")
            if not message.get("more_body"):
                break
        received.append((scope["path"], data))
        status = 503 if scope["path"].startswith("/a/") else 200
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    body = bytes(range(256)) * (8 * 1024)  # 2 MiB
    async with serve_asgi(app) as base:
        conf: dict[str, Any] = {
            "gateway": {"allow_hosts": ["127.0.0.1"], "engine": engine,
                        "replay_buffer": 4 << 20, "max_request_body": 4 << 20},
            "upstreams": {"primary": {"url": base + "/a"}, "backup": {"url": base + "/b"}},
            "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary", "backup"],
                        "retries": 1, "replayable_methods": ["POST"]}],
        }  # fmt: skip
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                response = await client.post("/v1/chat", content=body)
        finally:
            await gateway.aclose()
    assert response.status_code == 200
    assert response.headers["x-gateway-attempts"] == "2"
    assert received == [("/a/v1/chat", body), ("/b/v1/chat", body)]


async def test_a_body_sent_two_bytes_a_message_is_held_in_about_its_size() -> None:
    # A caller's body is kept until it ends (to be replayed, estimated, sent): kept as the
    # list of the messages it came in, a body sent two bytes a read (each read one ASGI
    # message) held some 40 bytes a message, 20 times its size (up to max_request_body).
    import tracemalloc

    from tests.helpers import http_scope

    body = json.dumps({"model": "m", "x": "a" * 300_000}).encode()
    pieces = [body[i : i + 2] for i in range(0, len(body), 2)]
    sent: list[dict[str, Any]] = []
    position = 0

    async def receive() -> dict[str, Any]:
        nonlocal position
        if position == len(pieces):
            await anyio.sleep_forever()
        position += 1
        more = position < len(pieces)
        return {"type": "http.request", "body": pieces[position - 1], "more_body": more}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async with upstream(status_handler(200)) as primary:
        conf = config(primary.url)
        # 150,000 messages under tracemalloc: the default 5 s walk deadline is not this
        # test's subject (it ended 504 on a loaded 2-core machine).
        conf["gateway"]["deadline_ms"] = 120_000
        gateway = Gateway(host_app, config=conf, environ={"FMW_T_KEY": "k" * 20})
        try:
            scope = http_scope("POST", "/v1/chat", headers=[(b"transfer-encoding", b"chunked")])
            tracemalloc.start()
            try:
                await gateway(scope, receive, send)
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
        finally:
            await gateway.aclose()
    assert sent[0]["status"] == 200
    assert primary.received[0].body == body
    assert peak < 8 * len(body), peak
