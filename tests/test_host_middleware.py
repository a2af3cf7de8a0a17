"""The host app's own middleware in front of the gateway (added after it in Starlette):
what it does to a routed request is the host's doing, never an upstream's failure or the
gateway's internal error."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from starlette.applications import Starlette

from fallback_mw import Gateway
from fallback_mw.request.context import get_context
from fallback_mw.request.types import ASGIApp, Message, Receive, Scope, Send
from fallback_mw.telemetry import Telemetry
from tests.helpers import client_for
from tests.upstreams import status_handler, upstream

pytestmark = pytest.mark.anyio

SECRET = b"webhook-secret"


class SignatureMismatch(Exception):
    pass


class VerifySignature:
    """A team's webhook check: the body's HMAC is computed as the body streams through,
    and a mismatch at its end refuses the request with the middleware's own 401 (raised
    from `receive`, answered here, as Starlette's RequestBodyLimitMiddleware does)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        expected = headers.get(b"x-signature", b"").decode()
        digest = hmac.new(SECRET, digestmod=hashlib.sha256)

        async def checked() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                digest.update(message.get("body", b""))
                if not message.get("more_body") and not hmac.compare_digest(
                    digest.hexdigest(), expected
                ):
                    raise SignatureMismatch
            return message

        try:
            await self.app(scope, checked, send)
        except SignatureMismatch:
            await send({"type": "http.response.start", "status": 401, "headers": []})
            await send({"type": "http.response.body", "body": b"bad signature"})


@asynccontextmanager
async def lifespan(app: ASGIApp) -> AsyncIterator[None]:
    """The app's lifespan, as a server runs it: the gateway inside starts, then closes."""
    inbox_send, inbox = anyio.create_memory_object_stream[Message](2)
    outbox, outbox_receive = anyio.create_memory_object_stream[Message](2)

    async def send(message: Message) -> None:
        await outbox.send(message)

    scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
    async with inbox_send, inbox, outbox, outbox_receive, anyio.create_task_group() as tasks:
        tasks.start_soon(app, scope, inbox.receive, send)
        await inbox_send.send({"type": "lifespan.startup"})
        assert (await outbox_receive.receive())["type"] == "lifespan.startup.complete"
        yield
        await inbox_send.send({"type": "lifespan.shutdown"})
        assert (await outbox_receive.receive())["type"] == "lifespan.shutdown.complete"


def outcomes(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage().split("outcome=")[1].split()[0]
        for r in caplog.records
        if r.name == "fallback_mw.request"
    ]


async def chunks(data: bytes, size: int = 512) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
async def test_an_upload_the_host_refuses_mid_stream_is_its_answer_and_no_upstream_failure(
    engine: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An upload over `replay_buffer` streams to the upstream as it arrives; a middleware in
    front that refused it at its last chunk (a bad webhook signature) raised from `receive`
    inside the attempt. The engine took that for a broken upstream connection: the caller
    got the gateway's 502 `upstream_failed` instead of the middleware's 401, and six such
    uploads opened the primary's breaker, then the backup's, for every caller (SPEC §5:
    one caller can never open a breaker). The host's exception now reaches the host, and
    the attempt books nothing against the upstream."""
    caplog.set_level(logging.INFO, logger="fallback_mw.request")
    async with upstream(status_handler(200, b"primary")) as primary:
        conf = {
            "gateway": {"allow_hosts": ["127.0.0.1"], "replay_buffer": 1024, "engine": engine},
            "upstreams": {"primary": {"url": primary.url}, "backup": {"url": primary.url + "/b"}},
            "routes": [
                {"id": "hooks", "prefix": "/hooks/", "plan": ["primary", "backup"], "retries": 1}
            ],
        }
        app = Starlette()
        app.add_middleware(Gateway, config=conf)
        app.add_middleware(VerifySignature)  # added last: in front of the gateway
        upload = b"x" * 8192
        good = hmac.new(SECRET, upload, hashlib.sha256).hexdigest()
        async with lifespan(app), client_for(app) as client:
            for _ in range(6):
                refused = await client.post(
                    "/hooks/in",
                    content=chunks(upload),
                    headers={"content-length": str(len(upload)), "x-signature": "forged"},
                )
                assert (refused.status_code, refused.text) == (401, "bad signature")
            accepted = await client.post(
                "/hooks/in",
                content=chunks(upload),
                headers={"content-length": str(len(upload)), "x-signature": good},
            )
    assert accepted.status_code == 200, accepted.text
    assert accepted.headers["x-gateway-provider"] == "primary"
    assert "x-gateway-skipped" not in accepted.headers
    assert outcomes(caplog) == ["cancelled"] * 6 + ["served"]
    assert all("rule=host_refused" in r.getMessage() for r in caplog.records[:6])


async def test_a_body_over_the_hosts_max_body_size_is_not_the_gateways_internal_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`Starlette(max_body_size=...)` (FastAPI's too) refuses a larger body from `receive`
    and answers its 413. The client got that 413, but the gateway logged a WARNING
    `outcome=internal_error` for each (counted in the error-rate alert as the gateway's
    own failure). It is the host's refusal: `outcome=cancelled rule=host_refused`, and no
    upstream is contacted."""
    caplog.set_level(logging.INFO, logger="fallback_mw.request")
    async with upstream(status_handler(200, b"primary")) as primary:
        conf: dict[str, Any] = {
            "gateway": {"allow_hosts": ["127.0.0.1"]},
            "upstreams": {"primary": {"url": primary.url}},
            "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"]}],
        }
        app = Starlette(max_body_size=100)
        app.add_middleware(Gateway, config=conf)
        async with lifespan(app), client_for(app) as client:
            declared = await client.post("/v1/chat", content=b"x" * 500)
            chunked = await client.post("/v1/chat", content=chunks(b"x" * 500, 50))
            small = await client.post("/v1/chat", content=b"x" * 50)
    assert [declared.status_code, chunked.status_code, small.status_code] == [413, 413, 200]
    assert [len(r.body) for r in primary.received] == [50]
    assert outcomes(caplog) == ["cancelled", "cancelled", "served"]
    records = [r for r in caplog.records if r.name == "fallback_mw.request"]
    assert all("rule=host_refused" in r.getMessage() for r in records[:2])


async def test_the_hosts_own_413s_do_not_fire_the_customer_error_alerts() -> None:
    """A client uploading bodies over the host's `max_body_size` gets the host's 413: its
    own doing, as the gateway's own 413 `request_too_large` is. The request metric books it
    `cancelled` (rule `host_refused`), and every shipped alert rule counted `cancelled` as
    a customer-visible error: 20 such 413s beside 80 answers read as a 20 % error rate, and
    FallbackMwErrorRateAbort (critical: abort the game day) fired on a healthy route. No
    rule's error selection, nor the game day's, counts it now."""
    from fallback_mw.cli.game_day.observe import CALLER_OUTCOMES
    from tests.test_alert_rules import RULES

    reader = InMemoryMetricReader()
    telemetry = Telemetry(meter_provider=MeterProvider(metric_readers=[reader]))
    async with upstream(status_handler(200, b"primary")) as primary:
        conf: dict[str, Any] = {
            "gateway": {"allow_hosts": ["127.0.0.1"]},
            "upstreams": {"primary": {"url": primary.url}},
            "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"]}],
        }
        app = Starlette(max_body_size=100)
        app.add_middleware(Gateway, config=conf, telemetry=telemetry)
        async with lifespan(app), client_for(app) as client:
            for _ in range(4):
                refused = await client.post("/v1/chat", content=b"x" * 500)
                assert refused.status_code == 413
            assert (await client.post("/v1/chat", content=b"x" * 50)).status_code == 200
    booked: dict[str, int] = {}
    data = reader.get_metrics_data()
    assert data is not None
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name == "gateway.requests":
                    for point in metric.data.data_points:
                        value = int(point.value)  # type: ignore[union-attr]
                        if value:
                            outcome = str((point.attributes or {})["gateway.outcome"])
                            booked[outcome] = booked.get(outcome, 0) + value
    assert booked == {"cancelled": 4, "served": 1}
    selections = re.findall(r'gateway_outcome!~"([^"]+)"', RULES.read_text())
    assert selections
    for selection in selections:
        assert re.fullmatch(selection, "cancelled"), selection  # excluded from the errors
    assert "cancelled" in CALLER_OUTCOMES


_LOGGING_APP = """
import logging.config
import os

from fastapi import FastAPI
from starlette.testclient import TestClient

from fallback_mw import Gateway, load_config

config = load_config({
    "gateway": {"allow_hosts": ["127.0.0.1"]},
    "upstreams": {"primary": {"url": f"http://127.0.0.1:{os.environ['PORT']}"}},
    "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"]}],
})
# The app's own logging, after its imports (Python's default: disable_existing_loggers)
logging.config.dictConfig({
    "version": 1,
    "handlers": {"stderr": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["stderr"], "level": "INFO"},
})
app = FastAPI()
app.add_middleware(Gateway, config=config)
with TestClient(app) as client:
    print(client.get("/v1/models").status_code)
"""


def test_the_gateway_logs_under_an_app_logging_that_disables_existing_loggers(
    tmp_path: Path,
) -> None:
    """A FastAPI `main.py` that imports fallback_mw, then configures its logging with
    `dictConfig` (whose `disable_existing_loggers` is True unless said otherwise) lost
    every line of the gateway: its loggers existed by then and were disabled, so an
    upstream outage logged no WARNING at all. The gateway, built once logging is set up
    (Starlette builds its middleware at the first call), enables its loggers again, as
    the Django middleware did."""
    with socket.socket() as closed:  # a port nothing listens on: the walk fails, logged
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    script = tmp_path / "main.py"
    script.write_text(_LOGGING_APP)
    run = subprocess.run(
        [sys.executable, str(script)],
        env={**os.environ, "PORT": str(port)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.stdout.strip() == "502", run.stderr
    assert "gateway request route=chat outcome=upstream_failed" in run.stderr


class Oops(Exception):
    pass


async def test_an_error_through_the_gateway_carries_no_body_query_or_credential_in_locals() -> None:
    """A host's error reporter records the locals of every frame (Sentry by default, rich's
    and pytest's `show_locals`). The request context the gateway leaves in the ASGI scope,
    which every frame of the host holds, showed its dataclass fields there: the provider
    key injected (`credentials`), the buffered body, the caller's query. And an error
    leaving the gateway (here a test's mock transport raising) carried the attempt's
    `credential` local and the body in the gateway's frames. The context shows its route
    and method only, and the gateway's frames lose their locals (traceback kept)."""
    key = "sk-provider-key-4f9d2c"
    secrets = (key, "the-request-body-7c1e", "page=QUERY-5a2b")

    def handler(request: Any) -> Any:
        raise Oops("the test's mock has no answer for this")

    import httpx

    from fallback_mw.upstream.httpx_engine import HttpxClient

    conf = {
        "gateway": {"allow_hosts": ["127.0.0.1"]},
        "upstreams": {"primary": {"url": "http://127.0.0.1:9", "auth_env": "HOST_MW_KEY"}},
        "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"]}],
    }
    scopes: list[Scope] = []
    errors: list[BaseException] = []

    def recording(app: ASGIApp) -> ASGIApp:
        async def record(scope: Scope, receive: Receive, send: Send) -> None:
            scopes.append(scope)
            try:
                await app(scope, receive, send)
            except Oops as exc:
                errors.append(exc)
                await send({"type": "http.response.start", "status": 500, "headers": []})
                await send({"type": "http.response.body", "body": b"host error page"})

        return record

    client = HttpxClient(transport=httpx.MockTransport(handler))
    gateway = Gateway(Starlette(), config=conf, environ={"HOST_MW_KEY": key}, client=client)
    async with gateway, client_for(recording(gateway)) as http:
        answer = await http.post("/v1/chat?page=QUERY-5a2b", content=b"the-request-body-7c1e")
    assert answer.status_code == 500
    # The scope is the host's: its query_string is the caller's, as without the gateway.
    assert not any(s in repr(scopes[0]) for s in secrets[:2]), repr(scopes[0])
    context = repr(get_context(scopes[0]))
    assert context.startswith("<RequestContext ") and "route='chat' POST>" in context
    [error] = errors
    own = str(Path(Gateway.__module__.replace(".", "/")).parent)
    gateway_frames = 0
    tb = error.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        shown = repr(frame.f_locals)
        assert not any(s in shown for s in secrets[:2]), (frame.f_code.co_name, shown)
        if own in frame.f_code.co_filename:  # the gateway's: nothing of the request's
            gateway_frames += 1
            shown = repr({k: v for k, v in frame.f_locals.items() if k != "scope"})
            assert not any(s in shown for s in secrets), (frame.f_code.co_name, shown)
        tb = tb.tb_next
    assert gateway_frames >= 3  # the traceback itself is kept
