"""The ASGI scope and message variants a real host can hand the gateway (the HTTP and
lifespan specs, 2.0-2.4): header names in any case ("should be lowercased, but it is not
required"), optional keys missing, a mount's `root_path`. Each is met as the host sends it,
through the Gateway's own ASGI interface."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from fallback_mw import Gateway
from fallback_mw.telemetry.propagation import _tracing_off
from tests.helpers import http_scope
from tests.test_telemetry_leak import call
from tests.upstreams import closed_port_url, host_app, upstream
from tests.upstreams import status_handler as answering

pytestmark = pytest.mark.anyio

CALLER_TOKEN = "sk-caller-Ab4Cd6Ef8Gh"
TRACEPARENT = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.mark.parametrize("spell", [bytes.lower, bytes.title], ids=["lowercase", "Capitalised"])
async def test_a_credential_in_trace_context_never_reaches_the_upstream_in_any_name_case(
    spell: object,
) -> None:
    """ASGI lets a host pass header names as they came ("should be lowercased, but it is
    not required"). Without an OpenTelemetry SDK, a request whose `Traceparent` came
    capitalised was taken for one with no trace context: its `Tracestate` and `Baggage`
    went upstream as sent, the caller's token in them, where the lowercase spelling had
    them cleaned (SPEC §4: a caller's credential never reaches any upstream)."""
    assert callable(spell)
    assert _tracing_off(), "this case is the gateway's without an SDK (no global provider)"
    async with upstream(answering(200)) as primary:
        config = {
            "upstreams": {"primary": {"url": primary.url}},
            "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"]}],
        }
        gateway = Gateway(host_app, config=config)
        try:
            headers = [
                (spell(b"authorization"), f"Bearer {CALLER_TOKEN}".encode()),
                (spell(b"traceparent"), TRACEPARENT),
                (spell(b"tracestate"), f"vendor=v1,mine={CALLER_TOKEN}".encode()),
                (spell(b"baggage"), f"session.id={CALLER_TOKEN},app=web".encode()),
            ]
            status, _ = await call(gateway, http_scope("GET", "/v1/chat", b"", headers), b"")
        finally:
            await gateway.aclose()
    assert status == 200
    (received,) = primary.received
    sent = dict(received.headers)
    assert CALLER_TOKEN not in repr(received.headers)
    assert sent["tracestate"] == "vendor=v1" and sent["baggage"] == "app=web"
    assert sent["traceparent"].startswith("00-4bf92f3577b34da6a3ce929d0e0e4736-")


class ClientDisconnected(OSError):
    """What a server's `send` raises once the client left (HTTP spec 2.4: "a server-specific
    subclass of OSError"), as uvicorn's own did."""


async def events(request: Any) -> Any:
    from aiohttp import web

    await request.read()
    answer = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await answer.prepare(request)
    for number in range(5):
        await answer.write(b"data: %d\n\n" % number)
    return answer


@pytest.mark.parametrize("gone_at", [0, 2], ids=["at_the_head", "mid_body"])
async def test_a_send_raising_oserror_for_a_client_gone_is_a_client_gone(gone_at: int) -> None:
    """Under ASGI HTTP spec 2.4 a server's `send` raises an OSError subclass when the client
    has gone. The gateway booked such a request as `internal_error` (a WARNING line, an
    error in the usage record) and raised the exception on to the server, which logs a
    traceback for every client that leaves mid-stream. It is a client gone (rule
    `client_gone`), never the upstream's, and the gateway returns."""
    async with upstream(events) as primary:
        config = {
            "upstreams": {"primary": {"url": primary.url}},
            "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"]}],
        }
        gateway = Gateway(host_app, config=config)
        sent: list[dict[str, Any]] = []
        requests = [{"type": "http.request", "body": b"", "more_body": False}]

        async def send(message: dict[str, Any]) -> None:
            if len(sent) == gone_at:
                raise ClientDisconnected("the client has gone")
            sent.append(message)

        async def receive() -> dict[str, Any]:
            if requests:
                return requests.pop()
            await anyio.sleep_forever()  # the server says nothing more: its send does
            raise AssertionError  # pragma: no cover

        scope = http_scope("GET", "/v1/chat")
        scope["asgi"] = {"version": "3.0", "spec_version": "2.4"}
        try:
            with anyio.fail_after(10):
                await gateway(scope, receive, send)
            (record,) = await gateway.services.ledger.usage(route="chat")  # type: ignore[union-attr]
            breaker = gateway.services.health.breaker("primary")  # type: ignore[attr-defined]
        finally:
            await gateway.aclose()
    assert (record.outcome, record.rule) == ("client_disconnected", "client_gone")
    assert breaker.state == "closed" and 1 not in breaker.outcomes


async def test_a_local_error_to_a_client_gone_is_a_client_gone() -> None:
    """The same for the gateway's own answers (a 502 after the plan failed, a refusal):
    a spec 2.4 server's `send` raising for a client that left went on to the server as an
    exception (a traceback per such request). The answer is booked as the gateway gave
    it, and the gateway returns."""
    config = {
        "upstreams": {"primary": {"url": closed_port_url()}},
        "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"]}],
    }
    gateway = Gateway(host_app, config=config)
    requests = [{"type": "http.request", "body": b"", "more_body": False}]

    async def send(message: dict[str, Any]) -> None:
        raise ClientDisconnected("the client has gone")

    async def receive() -> dict[str, Any]:
        if requests:
            return requests.pop()
        await anyio.sleep_forever()
        raise AssertionError  # pragma: no cover

    scope = http_scope("GET", "/v1/chat")
    scope["asgi"] = {"version": "3.0", "spec_version": "2.4"}
    try:
        with anyio.fail_after(10):
            await gateway(scope, receive, send)
        (record,) = await gateway.services.ledger.usage(route="chat")  # type: ignore[union-attr]
    finally:
        await gateway.aclose()
    assert (record.outcome, record.rule) == ("upstream_failed", "ceiling")
    assert [attempt.failure for attempt in record.attempts] == ["transport"]


async def echo_target(request: Any) -> Any:
    from aiohttp import web

    return web.Response(text=request.raw_path)


@pytest.mark.parametrize("raw_path", ["absent", None], ids=["no_raw_path", "raw_path_None"])
@pytest.mark.parametrize(
    ("sent", "path", "route"),
    [
        ("/v1/files/a%252Fb", "/v1/files/a%2Fb", "chat"),  # a name holding `%2F`
        ("/v1/what%3F", "/v1/what?", "chat"),  # a `?` in a segment, not the query
        ("/v1/tag%23x", "/v1/tag#x", "chat"),  # a `#` in a segment, not a fragment
        ("/public/%252e%252e/v1/x", "/public/%2e%2e/v1/x", "public"),  # a name, not `..`
        ("/v1/caf%C3%A9", "/v1/café", "chat"),
    ],
)
async def test_without_raw_path_the_decoded_path_is_not_decoded_again(
    raw_path: object, sent: str, path: str, route: str
) -> None:
    """`raw_path` is optional in ASGI (Mangum passes None): `path` is then all there is,
    and it is decoded already. The gateway decoded it a second time: a `%2F` inside a
    name became a separator, a `?` or `#` inside a segment cut the path there, and a
    segment named `%2e%2e` climbed out of its route's prefix into another route's (whose
    upstream and credential then had it). Read once, it is the request the caller sent."""
    async with upstream(echo_target) as primary:
        config = {
            "upstreams": {
                "primary": {"url": primary.url},
                "open": {"url": primary.url + "/open"},  # the same server, told apart
            },
            "routes": [
                {"id": "chat", "prefix": "/v1/", "plan": ["primary"]},
                {"id": "public", "prefix": "/public/", "plan": ["open"]},
            ],
        }
        gateway = Gateway(host_app, config=config)
        scope = http_scope("GET", path)
        del scope["raw_path"]
        if raw_path is None:
            scope["raw_path"] = None
        try:
            status, body = await call(gateway, scope, b"")
        finally:
            await gateway.aclose()
    expected = ("/open" if route == "public" else "") + sent  # the route's upstream
    assert (status, body.decode()) == (200, expected)
    assert [received.path for received in primary.received] == [expected]


async def test_a_scope_without_headers_is_forwarded_with_the_gateways_via() -> None:
    """A host may leave `headers` out of the scope (a request with none, a test client):
    every layer reads it as empty. The walker's loop check (layers/walker/via.py) read it
    as a key and raised KeyError (a 500) for such a request."""
    async with upstream(answering(200)) as primary:
        config = {
            "upstreams": {"primary": {"url": primary.url}},
            "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"]}],
        }
        gateway = Gateway(host_app, config=config)
        scope = http_scope("GET", "/v1/chat")
        del scope["headers"]
        try:
            status, _ = await call(gateway, scope, b"")
        finally:
            await gateway.aclose()
    assert status == 200
    (received,) = primary.received
    assert dict(received.headers)["via"].startswith("1.1 fallback-mw-")
