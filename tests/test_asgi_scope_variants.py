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
