"""The walker's failover rules (SPEC §5), through the real Gateway and real upstream sockets."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from aiohttp import web

from fallback_mw import Gateway
from fallback_mw.health import AlwaysHealthy
from tests.helpers import client_for, http_scope, request_then_disconnect
from tests.upstreams import (
    closed_port_url,
    host_app,
    serve_asgi,
    silent_server,
    status_handler,
    upstream,
)

pytestmark = pytest.mark.anyio

ENV = {"PRIMARY_KEY": "sk-primary-0001", "BACKUP_KEY": "sk-backup-0002"}


def make_config(
    primary: str, backup: str, *, engine: str = "aiohttp", **route: Any
) -> dict[str, Any]:
    return {
        "gateway": {"engine": engine, "max_request_body": 1 << 20, "replay_buffer": 4096},
        "upstreams": {
            "primary": {
                "url": primary,
                "auth_env": "PRIMARY_KEY",
                "first_byte_timeout_ms": 2000,
            },
            "backup": {
                "url": backup,
                "auth_header": "x-api-key",
                "auth_scheme": "",
                "auth_env": "BACKUP_KEY",
                "first_byte_timeout_ms": 2000,
            },
        },
        "routes": [
            {
                "id": "chat",
                "prefix": "/v1/",
                "plan": ["primary", "backup"],
                "retries": 1,
                "backoff_ms": 0,
                **route,
            }
        ],
    }


@pytest.fixture(params=["aiohttp", "httpx"])
def engine(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def consume_then(status: int) -> Any:
    async def handle(request: web.Request) -> web.StreamResponse:
        await request.read()
        return web.Response(status=status, text=f"upstream {status}")

    return handle


# --- the four negative controls ------------------------------------------------------------


async def test_replayable_body_reaches_fallback_byte_identical(engine: str) -> None:
    body = bytes(range(256)) * 8  # 2 KiB, binary, within replay_buffer
    async with upstream(status_handler(503)) as p, upstream(status_handler(200, b"ok")) as b:
        gateway = Gateway(
            host_app,
            config=make_config(p.url, b.url, engine=engine, replayable_methods=["POST"]),
            environ=ENV,
        )
        async with client_for(gateway) as client:
            response = await client.post("/v1/upload", content=body)
        await gateway.aclose()
    assert response.status_code == 200
    assert response.headers["x-gateway-provider"] == "backup"
    assert response.headers["x-gateway-attempts"] == "2"
    assert p.count == 1 and p.received[0].body == body
    assert b.count == 1 and b.received[0].body == body


async def test_post_503_is_not_failed_over(engine: str) -> None:
    async with upstream(status_handler(503)) as p, upstream(status_handler(200)) as b:
        gateway = Gateway(host_app, config=make_config(p.url, b.url, engine=engine), environ=ENV)
        async with client_for(gateway) as client:
            response = await client.post("/v1/chat/completions", content=b'{"x": 1}')
        await gateway.aclose()
    assert b.count == 0
    assert p.count == 1
    # SPEC §5: a walk that ends on a failover-class failure answers 502, never the
    # upstream's body, even when no further attempt was allowed (a POST).
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "upstream_failed"
    assert response.headers["x-gateway-attempts"] == "1"
    assert "x-gateway-provider" not in response.headers


async def test_body_over_replay_buffer_in_one_message_is_not_failed_over() -> None:
    body = b"q" * 10_000  # > replay_buffer (4 KiB), delivered as a single ASGI message
    async with upstream(status_handler(503)) as p, upstream(status_handler(200)) as b:
        gateway = Gateway(
            host_app, config=make_config(p.url, b.url, replayable_methods=["POST"]), environ=ENV
        )
        inbox = [{"type": "http.request", "body": body, "more_body": False}]
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            if inbox:
                return inbox.pop(0)
            await asyncio.sleep(3600)  # the client stays connected
            raise AssertionError

        async def send(message: Any) -> None:
            sent.append(message)

        await gateway(http_scope("POST", "/v1/upload"), receive, send)
        await gateway.aclose()
    assert sent[0]["status"] == 502
    assert b.count == 0
    assert p.count == 1 and p.received[0].body == body


async def test_unknown_length_body_over_replay_buffer_is_not_failed_over(engine: str) -> None:
    chunk = b"z" * 1024

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(8):  # 8 KiB > replay_buffer (4 KiB), no Content-Length
            yield chunk

    async with upstream(status_handler(503)) as p, upstream(status_handler(200)) as b:
        gateway = Gateway(
            host_app,
            config=make_config(p.url, b.url, engine=engine, replayable_methods=["POST"]),
            environ=ENV,
        )
        async with serve_asgi(gateway) as url, httpx.AsyncClient(base_url=url) as client:
            response = await client.post("/v1/upload", content=chunks())
        await gateway.aclose()
    assert b.count == 0
    assert p.count == 1 and p.received[0].body == chunk * 8  # sent whole, once
    assert response.status_code == 502


async def test_failure_after_commit_aborts_and_never_fails_over(engine: str) -> None:
    async def breaks_mid_stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(status=200, headers={"content-type": "text/plain"})
        await response.prepare(request)
        await response.write(b"partial-")
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.abort()  # reset the connection mid-body
        return response

    async with upstream(breaks_mid_stream) as p, upstream(status_handler(200)) as b:
        gateway = Gateway(host_app, config=make_config(p.url, b.url, engine=engine), environ=ENV)
        async with serve_asgi(gateway) as url, httpx.AsyncClient(base_url=url) as client:
            received = b""
            with pytest.raises(httpx.RemoteProtocolError):
                async with client.stream("GET", "/v1/stream") as response:
                    assert response.status_code == 200
                    async for piece in response.aiter_raw():
                        received += piece
        await gateway.aclose()
    assert received == b"partial-"
    assert b.count == 0


class BookedHealth(AlwaysHealthy):
    """Every mark that reaches an upstream's breaker, in order."""

    def __init__(self) -> None:
        self.marks: list[tuple[str, bool]] = []

    async def record(
        self, upstream: str, *, failure: bool, fault: str | None = None, admission: Any = None
    ) -> None:
        self.marks.append((upstream, failure))


def fails_mid_stream(how: str) -> Any:
    async def handle(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(status=200, headers={"content-type": "text/plain"})
        await response.prepare(request)
        await response.write(b"partial-")
        await asyncio.sleep(0.05)
        if how == "reset":
            assert request.transport is not None
            request.transport.abort()
        elif how == "idle":
            await asyncio.sleep(2)  # past the upstream's idle_timeout_ms
        else:
            await response.write(b"x" * 2048)  # past max_response_body
        return response

    return handle


@pytest.mark.parametrize(
    ("how", "kind", "outcome"),
    [
        ("reset", "transport", "aborted"),
        ("idle", "timeout", "aborted"),
        ("over_limit", "response_too_large", "response_too_large"),
    ],
)
async def test_a_failure_after_commit_is_booked_on_its_attempt_with_the_rule(
    how: str, kind: str, outcome: str, engine: str, caplog: pytest.LogCaptureFixture
) -> None:
    # The operator's "why didn't it fail over?": the log line and the usage record say
    # which candidate failed after the commit point, how, and the rule; the breaker keeps
    # the success recorded at the head (SPEC §6: not failover-class), nothing more.
    caplog.set_level(logging.INFO, logger="fallback_mw")
    health = BookedHealth()
    async with upstream(fails_mid_stream(how)) as p, upstream(status_handler(200)) as b:
        conf = make_config(p.url, b.url, engine=engine)
        conf["upstreams"]["primary"]["idle_timeout_ms"] = 300
        conf["gateway"]["max_response_body"] = 1024
        gateway = Gateway(host_app, config=conf, environ=ENV, health=health)
        async with serve_asgi(gateway) as url, httpx.AsyncClient(base_url=url) as client:
            with pytest.raises(httpx.RemoteProtocolError):
                async with client.stream("GET", "/v1/stream") as response:
                    async for _ in response.aiter_raw():
                        pass
        ledger = gateway.services.ledger
        assert ledger is not None
        for _ in range(100):  # the record is written once the walk has returned
            records = await ledger.usage()
            if records:
                break
            await asyncio.sleep(0.02)
        await gateway.aclose()
    assert b.count == 0
    (record,) = records
    assert record.outcome == outcome and record.chosen == "primary"
    assert [a.as_dict() for a in record.attempts] == [
        {"candidate": "primary", "status": 200, "failure": kind}
    ]
    (line,) = [r.getMessage() for r in caplog.records if r.name == "fallback_mw.request"]
    assert f"outcome={outcome} " in line
    assert " rule=response_started" in line and f"failures=primary:{kind}" in line
    assert health.marks == [("primary", False)]


async def test_a_client_gone_mid_stream_books_nothing_to_the_upstream() -> None:
    async def slow_stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(status=200, headers={"content-type": "text/plain"})
        await response.prepare(request)
        for _ in range(40):
            await response.write(b"chunk-")
            await asyncio.sleep(0.05)
        return response

    health = BookedHealth()
    async with upstream(slow_stream) as p, upstream(status_handler(200)) as b:
        gateway = Gateway(host_app, config=make_config(p.url, b.url), environ=ENV, health=health)
        async with (
            serve_asgi(gateway) as url,
            httpx.AsyncClient(base_url=url) as client,
            client.stream("GET", "/v1/stream") as response,
        ):
            async for _ in response.aiter_raw():
                break  # the caller hangs up after the first chunk
        ledger = gateway.services.ledger
        assert ledger is not None
        for _ in range(150):
            records = await ledger.usage()
            if records:
                break
            await asyncio.sleep(0.02)
        await gateway.aclose()
    (record,) = records
    assert record.outcome == "client_disconnected"
    assert [a.as_dict() for a in record.attempts] == [{"candidate": "primary", "status": 200}]
    assert health.marks == [("primary", False)]  # the head's success, never a failure


# --- served as-is ---------------------------------------------------------------------------


@pytest.mark.parametrize("status", [400, 401, 403, 429, 500])
async def test_non_failover_statuses_are_served_as_is(status: int) -> None:
    async with (
        upstream(status_handler(status, b"upstream says no")) as p,
        upstream(status_handler(200)) as b,
    ):
        gateway = Gateway(host_app, config=make_config(p.url, b.url), environ=ENV)
        async with client_for(gateway) as client:
            response = await client.get("/v1/models")
        await gateway.aclose()
    assert response.status_code == status
    assert response.content == b"upstream says no"
    assert b.count == 0
    assert response.headers["x-gateway-provider"] == "primary"


async def test_get_failover_statuses_reach_backup() -> None:
    for status in (502, 503, 504):
        async with upstream(status_handler(status)) as p, upstream(status_handler(200)) as b:
            gateway = Gateway(host_app, config=make_config(p.url, b.url), environ=ENV)
            async with client_for(gateway) as client:
                response = await client.get("/v1/models")
            await gateway.aclose()
        assert (response.status_code, b.count) == (200, 1), status


async def test_exhausted_plan_is_a_local_error_without_upstream_body() -> None:
    async with (
        upstream(status_handler(503, b"SECRET-UPSTREAM-BODY")) as p,
        upstream(status_handler(502, b"SECRET-UPSTREAM-BODY")) as b,
    ):
        gateway = Gateway(host_app, config=make_config(p.url, b.url), environ=ENV)
        async with client_for(gateway) as client:
            response = await client.get("/v1/models")
        await gateway.aclose()
    assert response.status_code == 502
    error = response.json()["error"]
    assert error == {
        "type": "gateway_error",
        "code": "upstream_failed",
        "message": error["message"],
        "route": "chat",
        "attempts": 2,
        "rule": "ceiling",
    }
    assert b"SECRET-UPSTREAM-BODY" not in response.content
    assert response.headers["x-gateway-route"] == "chat"
    assert response.headers["x-gateway-attempts"] == "2"


async def test_on_exhausted_last_response_passes_the_last_answer() -> None:
    async with upstream(status_handler(503)) as p, upstream(status_handler(502, b"last")) as b:
        gateway = Gateway(
            host_app,
            config=make_config(p.url, b.url, on_exhausted="last_response"),
            environ=ENV,
        )
        async with client_for(gateway) as client:
            response = await client.get("/v1/models")
        await gateway.aclose()
    assert (response.status_code, response.content) == (502, b"last")
    assert response.headers["x-gateway-provider"] == "backup"


@pytest.mark.parametrize(
    ("plan", "method", "rule"),
    [
        (["primary"], "GET", "ceiling"),  # the one candidate's answer ends the walk
        (["primary", "backup"], "POST", "not_replayable_method"),  # no replay of a POST
    ],
)
async def test_last_response_serves_the_answer_that_ended_the_walk(
    engine: str, plan: list[str], method: str, rule: str, caplog: pytest.LogCaptureFixture
) -> None:
    """SPEC §5: a walk that ends on a failover-class failure, whatever stopped it (the
    ceiling, a non-replayable method), passes the last upstream answer through with
    `on_exhausted = "last_response"`, also when that answer came from its only attempt."""
    caplog.set_level(logging.INFO, logger="fallback_mw")
    async with (
        upstream(status_handler(503, b"primary says 503")) as p,
        upstream(status_handler(200)) as b,
    ):
        config = make_config(p.url, b.url, engine=engine, on_exhausted="last_response")
        config["routes"][0].update(plan=plan, retries=len(plan) - 1)
        gateway = Gateway(host_app, config=config, environ=ENV)
        async with client_for(gateway) as client:
            response = await client.request(method, "/v1/chat", content=b"{}")
        await gateway.aclose()
    assert (response.status_code, response.content) == (503, b"primary says 503")
    assert response.headers["x-gateway-provider"] == "primary"
    assert response.headers["x-gateway-attempts"] == "1"
    assert (p.count, b.count) == (1, 0)
    assert f"rule={rule}" in caplog.text  # the log line says what ended the walk


async def test_last_response_after_a_timeout_serves_the_answer_that_came(engine: str) -> None:
    """A first-byte timeout (no answer), then a 503: the 503 is the last upstream answer."""
    async with silent_server() as (silent, _), upstream(status_handler(503, b"second")) as b:
        config = make_config(silent, b.url, engine=engine, on_exhausted="last_response")
        config["upstreams"]["primary"]["first_byte_timeout_ms"] = 100
        gateway = Gateway(host_app, config=config, environ=ENV)
        async with client_for(gateway) as client:
            response = await client.get("/v1/models")
        await gateway.aclose()
    assert (response.status_code, response.content) == (503, b"second")
    assert response.headers["x-gateway-provider"] == "backup"


async def test_last_response_without_any_answer_is_the_local_error(engine: str) -> None:
    """Nothing answered (a timeout only): there is no answer to pass through."""
    async with silent_server() as (silent, _):
        config = make_config(silent, silent, engine=engine, on_exhausted="last_response")
        config["routes"][0].update(plan=["primary"], retries=0)
        config["upstreams"]["primary"]["first_byte_timeout_ms"] = 100
        gateway = Gateway(host_app, config=config, environ=ENV)
        async with client_for(gateway) as client:
            response = await client.get("/v1/models")
        await gateway.aclose()
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "upstream_failed"


async def test_retries_restart_from_the_top_with_backoff() -> None:
    async with upstream(status_handler(503)) as p, upstream(status_handler(503)) as b:
        gateway = Gateway(
            host_app, config=make_config(p.url, b.url, retries=3, backoff_ms=60), environ=ENV
        )
        async with client_for(gateway) as client:
            started = time.monotonic()
            response = await client.get("/v1/models")
            elapsed = time.monotonic() - started
        await gateway.aclose()
    assert response.json()["error"]["attempts"] == 4
    assert (p.count, b.count) == (2, 2)
    assert elapsed >= 0.11  # two repeats, each after backoff_ms; none before the first backup


# --- credentials and header hygiene --------------------------------------------------------


async def test_each_candidate_gets_only_its_own_credential(engine: str) -> None:
    async with upstream(status_handler(503)) as p, upstream(status_handler(200)) as b:
        gateway = Gateway(host_app, config=make_config(p.url, b.url, engine=engine), environ=ENV)
        headers = [
            ("authorization", "Bearer caller-token"),
            ("proxy-authorization", "Basic caller"),
            ("x-api-key", "caller-key"),
            ("api-key", "caller-key"),
            ("x-goog-api-key", "caller-key"),
            ("cookie", "session=caller"),
            ("connection", "X-Private-Hop"),  # a name listed in any case
            ("x-private-hop", "hop-value"),
            ("expect", "100-continue"),  # the client's own, for the body it sends
            ("keep-alive", "timeout=5"),
            ("te", "trailers"),
            ("upgrade", "websocket"),
            ("proxy-connection", "keep-alive"),
            ("trailer", "x-checksum"),
            ("x-gateway-provider", "forged"),
            ("x-gateway-deadline-ms", "4000"),
            ("x-multi", "one"),
            ("x-multi", "two"),
        ]
        async with client_for(gateway) as client:
            response = await client.get("/v1/models", headers=headers)
        await gateway.aclose()
    assert response.status_code == 200
    forbidden_values = {
        "caller-token",
        "Basic caller",
        "caller-key",
        "session=caller",
        "hop-value",
        "timeout=5",
        "websocket",
        "forged",
    }
    for received, own, other in (
        (p.received[0], ("authorization", "Bearer sk-primary-0001"), "sk-backup-0002"),
        (b.received[0], ("x-api-key", "sk-backup-0002"), "sk-primary-0001"),
    ):
        names = [name for name, _ in received.headers]
        values = " ".join(value for _, value in received.headers)
        assert own in received.headers
        assert other not in values
        for value in forbidden_values:
            assert value not in values, value
        for name in (
            "cookie", "proxy-authorization", "x-private-hop", "keep-alive", "upgrade", "te",
            "proxy-connection", "trailer", "expect",
        ):  # fmt: skip
            assert name not in names
        assert not [n for n in names if n.startswith("x-gateway-")]
        assert [v for n, v in received.headers if n == "x-multi"] == ["one", "two"]
        assert names.count("authorization") + names.count("x-api-key") == 1


async def test_upstream_cannot_forge_gateway_headers() -> None:
    async def forger(request: web.Request) -> web.StreamResponse:
        return web.Response(text="ok", headers={"x-gateway-provider": "forged"})

    async with upstream(forger) as p, upstream(status_handler(200)) as b:
        gateway = Gateway(host_app, config=make_config(p.url, b.url), environ=ENV)
        async with client_for(gateway) as client:
            response = await client.get("/v1/models")
        await gateway.aclose()
    assert response.headers.get_list("x-gateway-provider") == ["primary"]


# --- deadline, timeouts, transport failures -------------------------------------------------


async def test_deadline_is_shared_by_the_whole_walk() -> None:
    backup_started_at: list[float] = []

    async def slow_backup(request: web.Request) -> web.StreamResponse:
        backup_started_at.append(time.monotonic())
        await asyncio.sleep(5)
        return web.Response(text="too late")

    # Wide margins so a loaded 2-core machine cannot fail it: the primary uses 0.5 s of a
    # 1 s deadline. Shared, the backup gets ~0.5 s (the walk ends at ~1 s); a fresh
    # deadline per attempt would end it at ~1.5 s at the earliest.
    async with upstream(status_handler(503, delay=0.5)) as p, upstream(slow_backup) as b:
        gateway = Gateway(host_app, config=make_config(p.url, b.url, deadline_ms=1000), environ=ENV)
        async with client_for(gateway) as client:
            started = time.monotonic()
            response = await client.get("/v1/models")
            elapsed = time.monotonic() - started
        await asyncio.sleep(0.05)
        await gateway.aclose()
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "deadline_exceeded"
    assert response.json()["error"]["attempts"] == 2
    assert b.count == 1  # the backup was tried, with only the remainder
    # The backup got what was left of the one deadline, not a fresh one (and not its own
    # 2 s first-byte timeout).
    assert 1.0 <= elapsed < 1.45
    backup_had = started + elapsed - backup_started_at[0]
    assert backup_started_at[0] - started >= 0.5
    assert backup_had < 0.75


async def test_caller_may_shorten_but_not_lengthen_the_deadline() -> None:
    async with upstream(status_handler(200, delay=0.3)) as p, upstream(status_handler(200)) as b:
        gateway = Gateway(host_app, config=make_config(p.url, b.url, deadline_ms=1000), environ=ENV)
        async with client_for(gateway) as client:
            short = await client.get("/v1/a", headers={"x-gateway-deadline-ms": "100"})
            long = await client.get("/v1/b", headers={"x-gateway-deadline-ms": "999999"})
        await gateway.aclose()
    assert short.status_code == 504
    assert long.status_code == 200


async def test_connection_refused_fails_over(engine: str) -> None:
    async with upstream(status_handler(200, b"backup")) as b:
        gateway = Gateway(
            host_app, config=make_config(closed_port_url(), b.url, engine=engine), environ=ENV
        )
        async with client_for(gateway) as client:
            response = await client.get("/v1/models")
        await gateway.aclose()
    assert response.status_code == 200 and response.content == b"backup"
    assert response.headers["x-gateway-attempts"] == "2"


async def test_hanging_upstream_fails_over_after_first_byte_timeout(engine: str) -> None:
    async with silent_server() as (hang_url, accepted), upstream(status_handler(200)) as b:
        config = make_config(hang_url, b.url, engine=engine)
        config["upstreams"]["primary"]["first_byte_timeout_ms"] = 200
        gateway = Gateway(host_app, config=config, environ=ENV)
        async with client_for(gateway) as client:
            started = time.monotonic()
            response = await client.get("/v1/models")
            elapsed = time.monotonic() - started
        await gateway.aclose()
    assert accepted  # the connection was accepted: this is a hang, not a refusal
    assert response.status_code == 200
    assert response.headers["x-gateway-provider"] == "backup"
    assert 0.2 <= elapsed < 1.5


async def test_a_slow_head_within_first_byte_is_served_whatever_the_idle_timeout(
    engine: str,
) -> None:
    # The wait for the response head is the first-byte timeout's alone: an idle timeout
    # shorter than it (it times the gaps between body chunks) must not cut the wait short,
    # on either engine.
    async with (
        upstream(status_handler(200, b"slow but fine", delay=0.6)) as p,
        upstream(status_handler(200, b"backup")) as b,
    ):
        config = make_config(p.url, b.url, engine=engine)
        config["upstreams"]["primary"]["idle_timeout_ms"] = 200
        gateway = Gateway(host_app, config=config, environ=ENV)
        async with client_for(gateway) as client:
            response = await client.get("/v1/models")
        await gateway.aclose()
    assert response.status_code == 200 and response.content == b"slow but fine"
    assert response.headers["x-gateway-attempts"] == "1"
    assert b.count == 0


async def test_idle_timeout_after_commit_aborts() -> None:
    async def stalls(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(status=200)
        await response.prepare(request)
        await response.write(b"first")
        await asyncio.sleep(2)
        return response

    async with upstream(stalls) as p, upstream(status_handler(200)) as b:
        config = make_config(p.url, b.url)
        config["upstreams"]["primary"]["idle_timeout_ms"] = 150
        gateway = Gateway(host_app, config=config, environ=ENV)
        async with serve_asgi(gateway) as url, httpx.AsyncClient(base_url=url) as client:
            with pytest.raises(httpx.RemoteProtocolError):
                async with client.stream("GET", "/v1/stream") as response:
                    async for _ in response.aiter_raw():
                        pass
        await gateway.aclose()
    assert b.count == 0


# --- client disconnect ----------------------------------------------------------------------


async def test_cancelled_client_starts_no_fallback() -> None:
    primary_cancelled = asyncio.Event()

    async def slow(request: web.Request) -> web.StreamResponse:
        try:
            await asyncio.sleep(1.0)
        except asyncio.CancelledError:
            primary_cancelled.set()
            raise
        return web.Response(status=503)

    async with upstream(slow) as p, upstream(status_handler(200)) as b:
        config = make_config(p.url, b.url)
        config["upstreams"]["primary"]["first_byte_timeout_ms"] = 400
        gateway = Gateway(host_app, config=config, environ=ENV)
        messages: list[dict[str, Any]] = []
        receive = request_then_disconnect(after=0.1)

        async def send(message: Any) -> None:
            messages.append(message)

        scope = http_scope("GET", "/v1/models")
        started = time.monotonic()
        await gateway(scope, receive, send)
        elapsed = time.monotonic() - started
        await asyncio.wait_for(primary_cancelled.wait(), 1.0)  # the attempt in flight was cut
        await asyncio.sleep(0.6)  # longer than the first-byte timeout: nothing else starts
        await gateway.aclose()
    assert elapsed < 0.35
    assert messages == []
    assert b.count == 0


# --- streaming ------------------------------------------------------------------------------


async def test_sse_reaches_the_client_event_by_event(engine: str) -> None:
    client_saw_first = asyncio.Event()

    async def sse(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(
            status=200, headers={"content-type": "text/event-stream", "cache-control": "no-cache"}
        )
        await response.prepare(request)
        await response.write(b"data: one\n\n")
        # The second event is only written once the client has seen the first: a gateway
        # that buffered would deadlock here and the test would time out.
        await asyncio.wait_for(client_saw_first.wait(), 5)
        await response.write(b"data: two\n\n")
        await response.write_eof()
        return response

    async with upstream(sse) as p, upstream(status_handler(200)) as b:
        gateway = Gateway(host_app, config=make_config(p.url, b.url, engine=engine), environ=ENV)
        async with serve_asgi(gateway) as url, httpx.AsyncClient(base_url=url) as client:
            events: list[str] = []
            async with client.stream("GET", "/v1/events") as response:
                assert response.headers["content-type"] == "text/event-stream"
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        client_saw_first.set()
        await gateway.aclose()
    assert events == ["one", "two"]


# --- paths and routing ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "/v1/../admin",
        "/v1/%2e%2e/admin",
        "/v1/%2E%2E/admin",
        "/v1%2f..%2fadmin",
        "/v1/..%2fadmin",
        "/v1/..%5cadmin",
        "/v1/x/../../admin",
        "/v1/%ff",  # not UTF-8 once decoded: no route, and no 500 either
    ],
)
async def test_dot_segments_and_encoded_separators_cannot_escape_a_prefix(path: str) -> None:
    async with upstream(status_handler(200)) as p, upstream(status_handler(200)) as b:
        gateway = Gateway(host_app, config=make_config(p.url, b.url), environ=ENV)
        async with serve_asgi(gateway) as url:
            import urllib.request

            def fetch() -> tuple[int, bytes]:
                # urllib sends the path exactly as written (no client-side normalisation).
                try:
                    with urllib.request.urlopen(url + path, timeout=5) as response:
                        return response.status, response.read()
                except urllib.error.HTTPError as error:
                    return error.code, error.read()

            status, body = await asyncio.to_thread(fetch)
        await gateway.aclose()
    # Each of these is /admin (or undecodable) once normalised: the /v1/ route must not
    # take it, so the host app answers and no upstream sees anything.
    assert (status, body) == (404, b"host app")
    assert p.count == 0 and b.count == 0


async def test_forwarded_path_is_the_normalised_one() -> None:
    async with upstream(status_handler(200)) as p, upstream(status_handler(200)) as b:
        gateway = Gateway(host_app, config=make_config(p.url, b.url), environ=ENV)
        async with client_for(gateway) as client:
            response = await client.get("/v1/a/./b//c/../d?x=1&y=two")
        await gateway.aclose()
    assert response.status_code == 200
    assert p.received[0].path == "/v1/a/b/d"
    assert p.received[0].query == "x=1&y=two"


@pytest.mark.parametrize(
    ("sent", "forwarded"),
    [
        # A project id or an object key holding a `/` (GitLab's `group%2Fapp`): one segment.
        ("/v1/projects/group%2Fapp/files", "/v1/projects/group%2Fapp/files"),
        ("/v1/files/a%3Bb.txt", "/v1/files/a%3Bb.txt"),  # a `;` in a name, not a parameter
        ("/v1/files/a%2Bb%3Dc%2C%40", "/v1/files/a%2Bb%3Dc%2C%40"),
        ("/v1/files/a%5cb", "/v1/files/a%5Cb"),  # a backslash in a name, not a separator
        ("/v1/x/%7euser/./a//b/", "/v1/x/~user/a/b/"),  # unreserved decoded, dots resolved
        ("/v1/x/%C3%A9t%c3%a9", "/v1/x/%C3%A9t%C3%A9"),
        ("/v1/x/100%", "/v1/x/100%25"),
        # An encoded separator that would climb: decoded and resolved, as before.
        ("/v1/a%2F..%2Fb", "/v1/b"),
        ("/v1/a/..%5C..%5Cv1%2Fb", "/v1/b"),
    ],
)
async def test_the_callers_percent_encoding_of_a_segment_reaches_the_upstream(
    sent: str, forwarded: str
) -> None:
    """A REST service reads `%2F` inside a segment as part of the name (GitLab's
    `/projects/group%2Fapp`, an object key); decoded to `/` it named another resource
    (404), and `%3B` decoded to `;` became a path parameter a servlet container drops."""
    async with upstream(status_handler(200)) as p, upstream(status_handler(200)) as b:
        gateway = Gateway(host_app, config=make_config(p.url, b.url), environ=ENV)
        async with serve_asgi(gateway) as url:
            import urllib.request

            def fetch() -> int:
                # urllib sends the path exactly as written (no client-side normalisation).
                with urllib.request.urlopen(url + sent, timeout=5) as response:
                    return int(response.status)

            status = await asyncio.to_thread(fetch)
        await gateway.aclose()
    assert status == 200
    assert [r.path for r in p.received] == [forwarded]


async def test_unmatched_requests_go_to_the_host_app() -> None:
    async with upstream(status_handler(200)) as p, upstream(status_handler(200)) as b:
        gateway = Gateway(host_app, config=make_config(p.url, b.url, methods=["GET"]), environ=ENV)
        async with client_for(gateway) as client:
            other = await client.get("/health")
            wrong_method = await client.delete("/v1/models")
        await gateway.aclose()
    assert (other.status_code, other.content) == (404, b"host app")
    assert (wrong_method.status_code, wrong_method.content) == (404, b"host app")
    assert "x-gateway-route" not in other.headers
    assert p.count == 0


async def test_tenant_routes_and_longest_prefix() -> None:
    async with upstream(status_handler(200, b"p")) as p, upstream(status_handler(200, b"b")) as b:
        config = make_config(p.url, b.url)
        config["routes"] = [
            {"id": "generic", "prefix": "/v1/", "plan": ["primary"]},
            {"id": "acme", "prefix": "/v1/", "tenant": "acme", "plan": ["backup"]},
            {"id": "deep", "prefix": "/v1/chat/", "plan": ["backup"]},
        ]
        gateway = Gateway(host_app, config=config, environ=ENV)
        async with client_for(gateway) as client:
            generic = await client.get("/v1/models")
            acme = await client.get("/v1/models", headers={"x-tenant-id": "acme"})
            deep = await client.get("/v1/chat/x")
        await gateway.aclose()
    assert generic.headers["x-gateway-route"] == "generic"
    assert acme.headers["x-gateway-route"] == "acme"
    assert deep.headers["x-gateway-route"] == "deep"


async def test_a_tenant_outside_ascii_matches_its_route_as_written() -> None:
    """Header values are UTF-8 on the wire (both engines forward them so): the tenant
    `café` in the file is the one a caller sends, not `cafÃ©` (read as latin-1)."""
    async with upstream(status_handler(200, b"p")) as p, upstream(status_handler(200, b"b")) as b:
        config = make_config(p.url, b.url)
        config["routes"] = [
            {"id": "generic", "prefix": "/v1/", "plan": ["primary"]},
            {"id": "cafe", "prefix": "/v1/", "tenant": "café", "plan": ["backup"]},
        ]
        gateway = Gateway(host_app, config=config, environ=ENV)
        async with client_for(gateway) as client:
            cafe = await client.get("/v1/models", headers=[(b"x-tenant-id", "café".encode())])
            other = await client.get("/v1/models", headers=[(b"x-tenant-id", b"caf\xc3")])
        await gateway.aclose()
    assert (cafe.status_code, cafe.headers["x-gateway-route"]) == (200, "cafe")
    # Not UTF-8: no route of a tenant matches it, and the request is refused before any
    # upstream (SPEC §12: a field value that is not UTF-8 is a 400).
    assert other.status_code == 400
    assert (p.count, b.count) == (0, 1)


async def test_interleaved_requests_never_see_each_others_state() -> None:
    release = asyncio.Event()

    async def by_path(request: web.Request) -> web.StreamResponse:
        if request.path.endswith("/slow"):
            await release.wait()
            return web.Response(status=503)
        release.set()
        return web.Response(text="fast")

    async with upstream(by_path) as p, upstream(status_handler(200, b"backup")) as b:
        config = make_config(p.url, b.url)
        config["routes"].append(
            {"id": "other", "prefix": "/v2/", "plan": ["primary"], "tenant": "t2"}
        )
        gateway = Gateway(host_app, config=config, environ=ENV)
        async with client_for(gateway) as client:
            slow, fast = await asyncio.gather(
                client.get("/v1/slow", headers={"x-tenant-id": "t1"}),
                client.get("/v2/fast", headers={"x-tenant-id": "t2"}),
            )
        await gateway.aclose()
    assert (slow.status_code, slow.content) == (200, b"backup")
    assert slow.headers["x-gateway-route"] == "chat"
    assert slow.headers["x-gateway-attempts"] == "2"
    assert slow.headers["x-gateway-provider"] == "backup"
    assert (fast.status_code, fast.content) == (200, b"fast")
    assert fast.headers["x-gateway-route"] == "other"
    assert fast.headers["x-gateway-attempts"] == "1"
    assert fast.headers["x-gateway-provider"] == "primary"


# --- bodies and limits ----------------------------------------------------------------------


async def test_request_over_max_body_is_413_with_no_upstream() -> None:
    async with upstream(status_handler(200)) as p, upstream(status_handler(200)) as b:
        config = make_config(p.url, b.url)
        config["gateway"]["max_request_body"] = 1000
        gateway = Gateway(host_app, config=config, environ=ENV)
        async with client_for(gateway) as client:
            response = await client.post("/v1/x", content=b"a" * 1001)
        await gateway.aclose()
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"
    assert p.count == 0 and b.count == 0


async def test_response_over_ceiling_is_502_before_commit() -> None:
    async with upstream(status_handler(200, b"x" * 5000)) as p, upstream(status_handler(200)) as b:
        config = make_config(p.url, b.url)
        config["gateway"]["max_response_body"] = 1000
        gateway = Gateway(host_app, config=config, environ=ENV)
        async with client_for(gateway) as client:
            response = await client.get("/v1/big")
        await gateway.aclose()
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "response_too_large"
    assert b"xxxx" not in response.content


async def test_a_large_representation_with_no_body_is_not_too_large(engine: str) -> None:
    # An artifact service's HEAD (its Content-Length is the file's size, no body follows)
    # and a 304 of a large representation were answered 502 response_too_large: only a
    # body that will follow can be over max_response_body.
    async def files(scope: Any, receive: Any, send: Any) -> None:
        status = 304 if scope["path"].endswith("/cached") else 200
        headers = [(b"content-length", b"5000"), (b"etag", b'"v1"')]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": b""})

    async with serve_asgi(files) as url, upstream(status_handler(200)) as b:
        config = make_config(url, b.url, engine=engine)
        config["gateway"]["max_response_body"] = 1000
        gateway = Gateway(host_app, config=config, environ=ENV)
        async with client_for(gateway) as client:
            head = await client.head("/v1/artifact.tar")
            cached = await client.get("/v1/cached", headers={"if-none-match": '"v1"'})
            get = await client.get("/v1/artifact.tar")
        await gateway.aclose()
    assert (head.status_code, head.headers["content-length"], head.content) == (200, "5000", b"")
    assert head.headers["x-gateway-provider"] == "primary"
    assert (cached.status_code, cached.headers["etag"], cached.content) == (304, '"v1"', b"")
    assert get.status_code == 502  # a GET's body would follow: still refused
    assert get.json()["error"]["code"] == "response_too_large"


async def test_model_rewrite_keeps_content_length_consistent(engine: str) -> None:
    async with upstream(status_handler(503)) as p, upstream(status_handler(200)) as b:
        config = make_config(p.url, b.url, engine=engine, replayable_methods=["POST"])
        config["upstreams"]["backup"]["model"] = "backup-model-with-a-longer-name"
        gateway = Gateway(host_app, config=config, environ=ENV)
        payload = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hé"}]}
        async with client_for(gateway) as client:
            response = await client.post("/v1/chat/completions", json=payload)
        await gateway.aclose()
        # Every candidate rewrites the model: a body that is not a JSON object is refused.
        config["upstreams"]["primary"]["model"] = "primary-model"
        gateway = Gateway(host_app, config=config, environ=ENV)
        async with client_for(gateway) as client:
            bad = await client.post("/v1/chat/completions", content=b"[1, 2]")
        await gateway.aclose()
    assert response.status_code == 200
    assert json.loads(p.received[0].body)["model"] == "gpt-4o-mini"
    forwarded = b.received[0]
    assert json.loads(forwarded.body) == {**payload, "model": "backup-model-with-a-longer-name"}
    assert dict(forwarded.headers)["content-length"] == str(len(forwarded.body))
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "bad_request"
    assert p.count == 1  # the bad request contacted no upstream


MULTIPART = (
    b'--x\r\nContent-Disposition: form-data; name="model"\r\n\r\nwhisper-1\r\n'
    b'--x\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\n'
    b"RIFF....WAVE\r\n--x--\r\n"
)


async def test_a_body_only_the_fallbacks_rewrite_cannot_take_still_reaches_the_primary(
    engine: str,
) -> None:
    # docs/llm.md's config: the fallback rewrites "model", the primary does not. An upload
    # (the openai SDK's audio transcriptions and files are multipart) and a chat body over
    # replay_buffer are the primary's to serve; they were refused 400 before any upstream.
    big = json.dumps({"model": "gpt-4o-mini", "messages": [{"content": "x" * 5000}]}).encode()
    form = {"content-type": "multipart/form-data; boundary=x"}
    async with upstream(status_handler(200)) as p, upstream(status_handler(200)) as b:
        config = make_config(p.url, b.url, engine=engine, replayable_methods=["POST"])
        config["upstreams"]["backup"]["model"] = "backup-model"
        gateway = Gateway(host_app, config=config, environ=ENV)
        async with client_for(gateway) as client:
            upload = await client.post("/v1/audio/transcriptions", content=MULTIPART, headers=form)
            large = await client.post("/v1/chat/completions", content=big)
        await gateway.aclose()
    assert (upload.status_code, large.status_code) == (200, 200)
    assert upload.headers["x-gateway-provider"] == "primary"
    assert [r.body for r in p.received] == [MULTIPART, big]
    assert b.count == 0


async def test_a_fallback_that_rewrites_the_model_is_skipped_for_a_body_it_cannot_take(
    engine: str,
) -> None:
    async with upstream(status_handler(503)) as p, upstream(status_handler(200)) as b:
        config = make_config(p.url, b.url, engine=engine, replayable_methods=["POST"])
        config["upstreams"]["backup"]["model"] = "backup-model"
        gateway = Gateway(host_app, config=config, environ=ENV)
        async with client_for(gateway) as client:
            response = await client.post(
                "/v1/audio/transcriptions",
                content=MULTIPART,
                headers={"content-type": "multipart/form-data; boundary=x"},
            )
        await gateway.aclose()
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "upstream_failed"
    assert response.headers["x-gateway-skipped"] == "backup;reason=model_rewrite"
    assert p.count == 2 and b.count == 0  # never sent without the model it needs


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
@pytest.mark.parametrize("method", ["GET", "POST"])
async def test_redirects_are_never_followed(engine: str, status: int, method: str) -> None:
    # Every redirect status, to a metadata address and to an upstream the allowlist admits
    # (the backup, which counts what reaches it): relayed to the caller, never followed.
    async def redirect(request: web.Request) -> web.StreamResponse:
        location = request.query.get("to", "http://169.254.169.254/latest")
        return web.Response(status=status, headers={"location": location})

    async with upstream(redirect) as p, upstream(status_handler(200)) as b:
        conf = make_config(p.url, b.url, engine=engine, replayable_methods=["GET", "POST"])
        gateway = Gateway(host_app, config=conf, environ=ENV)
        async with client_for(gateway) as client:
            metadata = await client.request(method, "/v1/x", content=b"{}")
            allowed = await client.request(
                method, "/v1/x", params={"to": b.url + "/v1/x"}, content=b"{}"
            )
        await gateway.aclose()
    assert (metadata.status_code, allowed.status_code) == (status, status)
    assert metadata.headers["location"] == "http://169.254.169.254/latest"
    assert allowed.headers["location"] == b.url + "/v1/x"
    assert p.count == 2 and b.count == 0


async def located(request: web.Request) -> web.StreamResponse:
    """A REST service naming its own resources by the Host it was sent (the upstream's:
    SPEC §4), as Starlette's and Django's trailing-slash redirects and a 201 do."""
    own = f"http://{request.host}"
    status, location = {
        "/v1/items": (307, f"{own}/v1/items/?page=2"),
        "/v1/items/": (201, f"{own}/v1/items/42#top"),
        "/v1/moved": (301, f"HTTP://{request.host.upper()}/v1/new"),
        "/v1/away": (302, "http://127.0.0.2:1/v1/x"),  # another host: as it came
        "/v1/odd": (302, f"{own}//evil.example/x"),  # would name another host: as it came
        "/v1/user": (302, f"http://u@{request.host}/v1/x"),  # userinfo: as it came
        "/v1/relative": (303, "/v1/done"),
        # A 202's status monitor (Flask's and Celery's async-task pattern, Azure's
        # long-running operations): where the caller polls.
        "/v1/jobs": (202, f"{own}/v1/jobs/7/status"),
        "/v1/ok": (200, f"{own}/v1/ignored"),  # not a redirect, a 201 or a 202: as it came
    }[request.path]
    return web.Response(status=status, headers={"location": location})


@pytest.mark.parametrize(
    ("path", "relayed"),
    [
        ("/v1/items", "/v1/items/?page=2"),
        ("/v1/items/", "/v1/items/42#top"),
        ("/v1/moved", "/v1/new"),
        ("/v1/away", "http://127.0.0.2:1/v1/x"),
        ("/v1/odd", "{own}//evil.example/x"),
        ("/v1/user", "http://u@{host}/v1/x"),
        ("/v1/relative", "/v1/done"),
        ("/v1/jobs", "/v1/jobs/7/status"),
        ("/v1/ok", "{own}/v1/ignored"),
    ],
)
async def test_a_location_naming_the_upstream_is_the_gateways(path: str, relayed: str) -> None:
    """A caller following a Location the upstream built from its own Host went around the
    gateway, to an internal address it may not reach and without the injected key; it is
    rewritten to the gateway's path (nginx's `proxy_redirect default`), never followed."""
    async with upstream(located) as p, upstream(status_handler(200)) as b:
        gateway = Gateway(host_app, config=make_config(p.url, b.url), environ=ENV)
        async with client_for(gateway) as client:
            response = await client.get(path)
        await gateway.aclose()
    host = p.url.removeprefix("http://")
    assert response.headers["location"] == relayed.format(own=p.url, host=host)
    assert p.count == 1 and b.count == 0


async def test_caller_value_for_a_custom_auth_header_never_reaches_an_upstream() -> None:
    async with upstream(status_handler(503)) as p, upstream(status_handler(200)) as b:
        config = make_config(p.url, b.url)
        config["upstreams"]["backup"]["auth_header"] = "x-backup-token"
        gateway = Gateway(host_app, config=config, environ=ENV)
        async with client_for(gateway) as client:
            response = await client.get("/v1/m", headers={"x-backup-token": "caller-forged"})
        await gateway.aclose()
    assert response.status_code == 200
    assert ("x-backup-token", "caller-forged") not in p.received[0].headers
    assert [v for n, v in b.received[0].headers if n == "x-backup-token"] == ["sk-backup-0002"]


async def test_a_pool_credential_is_used_at_most_once_per_request() -> None:
    async with upstream(status_handler(503)) as p, upstream(status_handler(503)) as b:
        config = make_config(p.url, b.url, retries=5)
        config["upstreams"]["primary"]["auth_env"] = ["PRIMARY_KEY", "PRIMARY_KEY_2"]
        environ = {**ENV, "PRIMARY_KEY_2": "sk-primary-0003"}
        gateway = Gateway(host_app, config=config, environ=environ, health=AlwaysHealthy())
        async with client_for(gateway) as client:
            response = await client.get("/v1/models")
        await gateway.aclose()
    assert response.json()["error"]["attempts"] == 6
    keys = [dict(r.headers)["authorization"] for r in p.received]
    assert sorted(keys) == ["Bearer sk-primary-0001", "Bearer sk-primary-0003"]
    assert b.count == 4  # the backup's single key may repeat on later passes
