"""The Django adapter, with Django's settings configured here and real local upstreams."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import re
import socket
import subprocess
import sys
import warnings
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import django
import httpx
import pytest
from aiohttp import web
from django.conf import settings

if not settings.configured:
    settings.configure(
        DEBUG=False,
        SECRET_KEY="fallback-mw-tests",
        ALLOWED_HOSTS=["*"],
        ROOT_URLCONF=__name__,
        MIDDLEWARE=[],
        INSTALLED_APPS=[],
        USE_TZ=True,
    )
    django.setup()

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.core.exceptions import ImproperlyConfigured
from django.core.handlers.asgi import ASGIHandler
from django.http import HttpRequest, HttpResponse, HttpResponseBase
from django.test import (
    AsyncClient,
    AsyncRequestFactory,
    Client,
    RequestFactory,
    override_settings,
)
from django.urls import path

from fallback_mw import django as adapter
from fallback_mw.django import GatewayAborted, GatewayMiddleware, aclose_gateways, with_lifespan
from fallback_mw.request.types import Message
from tests.upstreams import Upstream, status_handler, upstream

PRIMARY_KEY = "dj-primary-secret"
BACKUP_KEY = "dj-backup-secret"
CALLER_KEY = "dj-caller-secret"


def local_view(request: HttpRequest) -> HttpResponse:
    return HttpResponse(b"django saw: " + request.body, content_type="text/plain")


urlpatterns = [path("local/", local_view), path("v1/shadowed/", local_view)]


@pytest.fixture(autouse=True)
def credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FMW_DJ_PRIMARY_KEY", PRIMARY_KEY)
    monkeypatch.setenv("FMW_DJ_BACKUP_KEY", BACKUP_KEY)


def gateway_config(primary: Upstream, backup: Upstream) -> dict[str, Any]:
    return {
        "gateway": {"allow_hosts": ["127.0.0.1"], "replay_buffer": 1024 * 1024},
        "upstreams": {
            "primary": {"url": primary.url, "auth_env": "FMW_DJ_PRIMARY_KEY"},
            "backup": {
                "url": backup.url,
                "auth_header": "x-api-key",
                "auth_scheme": "",
                "auth_env": "FMW_DJ_BACKUP_KEY",
            },
        },
        "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary", "backup"], "retries": 1}],
    }


def keyless_config(primary: Upstream, backup: Upstream) -> dict[str, Any]:
    """gateway_config with a primary the gateway sends no key to: its cookies are relayed
    (an upstream holding the gateway's key may not set any, docs/security.md)."""
    config = gateway_config(primary, backup)
    del config["upstreams"]["primary"]["auth_env"]
    return config


@pytest.fixture
def django_site() -> Iterator[Any]:
    """Build a Django ASGI app with GatewayMiddleware first in MIDDLEWARE."""
    overrides: list[Any] = []

    def build(config: dict[str, Any]) -> ASGIHandler:
        override = override_settings(
            MIDDLEWARE=["fallback_mw.django.GatewayMiddleware"], FALLBACK_MW={"config": config}
        )
        override.enable()
        overrides.append(override)
        return ASGIHandler()

    yield build
    for override in overrides:
        override.disable()


@pytest.fixture
async def closing() -> AsyncIterator[None]:
    yield
    await aclose_gateways()


def client_for(app: ASGIHandler) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver")


@pytest.mark.anyio
async def test_routed_get_fails_over_inside_django(django_site: Any, closing: None) -> None:
    async with (
        upstream(status_handler(503)) as primary,
        upstream(status_handler(200, b"from backup")) as backup,
    ):
        app = django_site(gateway_config(primary, backup))
        async with client_for(app) as client:
            response = await client.get(
                "/v1/models", headers={"authorization": f"Bearer {CALLER_KEY}"}
            )
            # A path Django also routes: the gateway route wins.
            shadowed = await client.get("/v1/shadowed/")
    assert response.status_code == 200
    assert response.content == b"from backup"
    assert response.headers["x-gateway-provider"] == "backup"
    assert response.headers["x-gateway-attempts"] == "2"
    assert response.headers["x-gateway-route"] == "chat"
    assert shadowed.headers["x-gateway-route"] == "chat"
    sent_to_backup = dict(backup.received[0].headers)
    assert sent_to_backup["x-api-key"] == BACKUP_KEY
    for received in primary.received + backup.received:
        assert all(CALLER_KEY not in value for _, value in received.headers)
    assert dict(primary.received[0].headers)["authorization"] == f"Bearer {PRIMARY_KEY}"


@pytest.mark.anyio
async def test_a_routed_error_is_logged_once_by_the_gateway_not_by_django(
    django_site: Any, closing: None, caplog: pytest.LogCaptureFixture
) -> None:
    # Django logs every response >= 400 on `django.request` (5xx at ERROR: mailed to the
    # ADMINS by Django's default LOGGING) with the HttpRequest in the record, whose repr
    # carries the query string. A routed answer already has the gateway's own line.
    caplog.set_level(logging.INFO)
    async with (
        upstream(status_handler(503)) as primary,
        upstream(status_handler(503)) as backup,
    ):
        app = django_site(gateway_config(primary, backup))
        async with client_for(app) as client:
            failed = await client.get("/v1/models?api_key=dj-query-secret")
            refused = await client.request("PROPFIND", "/v1/models?api_key=dj-query-secret")
            missing = await client.get("/nowhere/?q=1")  # not routed: Django's as ever
    assert (failed.status_code, refused.status_code, missing.status_code) == (502, 405, 404)
    django_lines = [r for r in caplog.records if r.name == "django.request"]
    assert [r.getMessage() for r in django_lines] == ["Not Found: /nowhere/"]
    gateway_lines = [r for r in caplog.records if r.name == "fallback_mw.request"]
    assert [r.__dict__["outcome"] for r in gateway_lines] == [
        "upstream_failed",
        "method_not_allowed",
    ]


@pytest.mark.anyio
async def test_a_routed_request_meets_allowed_hosts(django_site: Any, closing: None) -> None:
    # Django checks ALLOWED_HOSTS when a view (or CommonMiddleware) reads the host; routed
    # requests never did, so a Host Django refuses (a DNS-rebinding page's, an
    # internal-only name) was forwarded with the provider's credential.
    async with upstream(status_handler(200)) as primary, upstream(status_handler(200)) as backup:
        app = django_site(gateway_config(primary, backup))
        with override_settings(ALLOWED_HOSTS=["gateway.internal"]):
            async with client_for(app) as client:
                refused = await client.get("/v1/models", headers={"host": "evil.example"})
                allowed = await client.get("/v1/models", headers={"host": "gateway.internal"})
    assert refused.status_code == 400
    assert "x-gateway-route" not in refused.headers
    assert allowed.status_code == 200
    assert primary.count == 1 and backup.count == 0


@pytest.mark.anyio
async def test_allowed_hosts_is_not_checked_for_django_s_own_pages(
    django_site: Any, closing: None
) -> None:
    # The check is the routed requests' (above): a page of the project's own under a Host
    # outside ALLOWED_HOSTS (a load balancer's health check by IP, in a project without
    # CommonMiddleware) is Django's to judge, as it was without the gateway.
    async with upstream(status_handler(200)) as primary, upstream(status_handler(200)) as backup:
        app = django_site(gateway_config(primary, backup))
        with override_settings(ALLOWED_HOSTS=["gateway.internal"]):
            async with client_for(app) as client:
                own = await client.post("/local/", content=b"probe", headers={"host": "10.0.0.5"})
                routed = await client.get("/v1/models", headers={"host": "10.0.0.5"})
                climbing = await client.get("/local/../v1/models", headers={"host": "10.0.0.5"})
    assert own.status_code == 200
    assert own.content == b"django saw: probe"
    assert routed.status_code == 400
    assert climbing.status_code == 400
    assert primary.count == 0 and backup.count == 0


@pytest.mark.anyio
async def test_unmatched_requests_reach_django_with_their_body(
    django_site: Any, closing: None
) -> None:
    async with upstream(status_handler(200)) as primary, upstream(status_handler(200)) as backup:
        app = django_site(gateway_config(primary, backup))
        async with client_for(app) as client:
            posted = await client.post("/local/", content=b"payload-kept")
            missing = await client.get("/nowhere/")
    assert posted.status_code == 200
    assert posted.content == b"django saw: payload-kept"
    assert "x-gateway-route" not in posted.headers
    assert missing.status_code == 404
    assert primary.count == 0 and backup.count == 0


@pytest.mark.anyio
async def test_post_is_not_replayed_and_body_is_forwarded_whole(
    django_site: Any, closing: None
) -> None:
    body = bytes(range(256)) * 800  # 200 KiB: several 64 KiB chunks through the bridge
    async with (
        upstream(status_handler(503, b"primary down")) as primary,
        upstream(status_handler(200)) as backup,
    ):
        app = django_site(gateway_config(primary, backup))
        async with client_for(app) as client:
            response = await client.post("/v1/chat/completions", content=body)
    assert response.status_code == 502  # upstream_failed: never the primary's body
    assert b"primary down" not in response.content
    assert primary.count == 1
    assert primary.received[0].body == body
    assert backup.count == 0


class ReadsFormFields:
    """A middleware listed before GatewayMiddleware that looks at a form field (a
    method-override or audit middleware): on a multipart upload request.POST reads the
    body stream itself."""

    async_capable = True
    sync_capable = False

    def __init__(self, get_response: Any) -> None:
        from asgiref.sync import markcoroutinefunction

        self.get_response = get_response
        markcoroutinefunction(self)

    async def __call__(self, request: HttpRequest) -> HttpResponseBase:
        request.POST.get("_method")
        response: HttpResponseBase = await self.get_response(request)
        return response


@pytest.mark.anyio
async def test_a_body_an_earlier_middleware_consumed_is_never_forwarded_empty(
    closing: None, caplog: pytest.LogCaptureFixture
) -> None:
    # A platform team's Django project with a form-reading middleware above the gateway:
    # a routed multipart upload reached the internal service as an empty body with
    # Content-Length: 0 and the caller got the service's 200 (the upload silently lost).
    # The request now fails loudly, naming the middleware order to fix, and nothing
    # reaches any upstream.
    async with upstream(status_handler(200)) as primary, upstream(status_handler(200)) as backup:
        middleware = [f"{__name__}.ReadsFormFields", "fallback_mw.django.GatewayMiddleware"]
        config = gateway_config(primary, backup)
        with override_settings(MIDDLEWARE=middleware, FALLBACK_MW={"config": config}):
            app = ASGIHandler()
            async with client_for(app) as client:
                upload = await client.post(
                    "/v1/files", files={"file": ("a.bin", b"\x00" * 5000)}, data={"k": "v"}
                )
                form = await client.post("/v1/files", data={"_method": "PUT", "k": "v"})
    assert upload.status_code == 500
    assert primary.count == 1 and backup.count == 0  # the url-encoded form only
    assert primary.received[0].body == b"_method=PUT&k=v"
    assert form.status_code == 200
    errors = [str(r.exc_info[1]) for r in caplog.records if r.exc_info and r.exc_info[1]]
    assert any("before fallback_mw.django.GatewayMiddleware" in e for e in errors), errors


@pytest.mark.anyio
async def test_a_debug_error_page_for_a_routed_request_shows_no_caller_credential(
    closing: None,
) -> None:
    # DEBUG = True: Django's error page lists each frame's local variables. It hides the
    # Authorization header in META, but the bridge's and the gateway's frames held the
    # ASGI scope, whose headers showed the caller's key as sent (so did any error reporter
    # that records locals, DEBUG or not).
    async with upstream(status_handler(200)) as primary, upstream(status_handler(200)) as backup:
        middleware = [f"{__name__}.ReadsFormFields", "fallback_mw.django.GatewayMiddleware"]
        config = gateway_config(primary, backup)
        secrets = {"authorization": f"Bearer {CALLER_KEY}", "x-api-key": CALLER_KEY}
        with override_settings(
            DEBUG=True,
            ALLOWED_HOSTS=["testserver"],
            MIDDLEWARE=middleware,
            FALLBACK_MW={"config": config},
        ):
            app = ASGIHandler()
            async with client_for(app) as client:
                upload = await client.post(
                    "/v1/files", files={"file": ("a.bin", b"\x00" * 5000)}, headers=secrets
                )
                rebound = await client.get(
                    "/v1/models", headers={**secrets, "host": "evil.example"}
                )
    assert (upload.status_code, rebound.status_code) == (500, 400)
    assert "ImproperlyConfigured" in upload.text and "DisallowedHost" in rebound.text
    assert "_check_unread" in upload.text  # where it happened is still shown
    assert CALLER_KEY not in upload.text
    assert CALLER_KEY not in rebound.text
    assert primary.count == 0 and backup.count == 0


_LOGGING_PROJECT = """
import asyncio, os, httpx
from fallback_mw.django import with_lifespan  # asgi.py as README writes it: first
from django.conf import settings

settings.configure(
    SECRET_KEY="x", ALLOWED_HOSTS=["testserver"], ROOT_URLCONF=[], INSTALLED_APPS=[],
    MIDDLEWARE=["fallback_mw.django.GatewayMiddleware"],
    FALLBACK_MW={"config": {
        "gateway": {"allow_hosts": ["127.0.0.1"]},
        "upstreams": {"primary": {"url": "http://127.0.0.1:" + os.environ["PORT"]}},
        "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"]}],
    }},
    # A project LOGGING without "disable_existing_loggers": False (dictConfig's default).
    LOGGING={"version": 1, "handlers": {"err": {"class": "logging.StreamHandler"}},
             "root": {"handlers": ["err"], "level": "INFO"}},
)
from django.core.asgi import get_asgi_application
application = with_lifespan(get_asgi_application())

async def main():
    transport = httpx.ASGITransport(app=application)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as c:
        print((await c.get("/v1/models")).status_code)

asyncio.run(main())
"""


def test_the_gateway_logs_under_a_django_logging_that_disables_existing_loggers(
    tmp_path: Path,
) -> None:
    # Django applies settings.LOGGING in django.setup(); dictConfig disables every logger
    # that exists by then unless told not to. asgi.py imports fallback_mw first (README's
    # with_lifespan), so the gateway's loggers existed and every line of theirs (the
    # request lines, the outage warnings) went nowhere; imported later, they showed.
    with socket.socket() as closed:  # a port nothing listens on: the walk fails, logged
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    script = tmp_path / "project.py"
    script.write_text(_LOGGING_PROJECT)
    run = subprocess.run(
        [sys.executable, str(script)],
        env={**os.environ, "PORT": str(port)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.stdout.strip() == "502", run.stderr
    assert "gateway request route=chat outcome=upstream_failed" in run.stderr


@pytest.mark.anyio
async def test_routes_match_below_django_s_force_script_name(
    django_site: Any, closing: None
) -> None:
    # Django behind a proxy that serves it at /api without stripping it:
    # FORCE_SCRIPT_NAME = "/api", and Django resolves its urls below it. The gateway routed
    # on the whole path, so the "/v1/" route took nothing there: /api/v1/models went on to
    # Django (a 404), and /api/v1/shadowed/ to the project's own view.
    async with upstream(status_handler(200)) as primary, upstream(status_handler(200)) as backup:
        app = django_site(gateway_config(primary, backup))
        with override_settings(FORCE_SCRIPT_NAME="/api"):
            async with client_for(app) as client:
                routed = await client.get("/api/v1/models")
                shadowed = await client.get("/api/v1/shadowed/")
                own = await client.post("/api/local/", content=b"mine")
    assert routed.status_code == 200
    assert routed.headers["x-gateway-route"] == "chat"
    assert shadowed.headers["x-gateway-route"] == "chat"
    assert [r.path for r in primary.received] == ["/v1/models", "/v1/shadowed/"]
    assert own.content == b"django saw: mine"


@pytest.mark.anyio
@pytest.mark.parametrize(
    "fields", [[b"50", b"5000"], [b"5000", b"50"]], ids=["short-first", "short-last"]
)
async def test_a_deadline_header_sent_twice_is_ignored_through_django_too(
    django_site: Any, closing: None, fields: list[bytes]
) -> None:
    """SPEC §12 through the Django bridge, as through uvicorn (hostile/test_request_input.py):
    `x-gateway-deadline-ms` in two fields is their joined value, not 1-7 digits, so the
    route deadline applies whichever comes first; one field of 50 ms still shortens it."""
    async with (
        upstream(status_handler(200, b"slow", delay=0.3)) as primary,
        upstream(status_handler(200, b"backup")) as backup,
    ):
        app = django_site(gateway_config(primary, backup))
        async with client_for(app) as client:
            twice = await client.get(
                "/v1/x", headers=[(b"x-gateway-deadline-ms", value) for value in fields]
            )
            once = await client.get("/v1/x", headers=[(b"x-gateway-deadline-ms", b"50")])
    assert (twice.status_code, twice.text) == (200, "slow")
    assert once.status_code == 504
    assert once.json()["error"]["rule"] == "deadline"


@pytest.mark.anyio
async def test_repeated_headers_and_cookies_survive_the_bridge(
    django_site: Any, closing: None
) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.Response(body=b"ok", content_type="text/plain")
        response.headers.add("x-multi", "a")
        response.headers.add("x-multi", "b")
        response.set_cookie("flavour", "oat", path="/v1/")
        return response

    async with upstream(handler) as primary, upstream(status_handler(200)) as backup:
        app = django_site(keyless_config(primary, backup))
        async with client_for(app) as client:
            response = await client.get("/v1/cookie")
    assert response.headers.get_list("x-multi") == ["a, b"]
    assert response.cookies["flavour"] == "oat"
    assert response.headers["content-type"] == "text/plain"  # as sent, no Django default


@pytest.mark.anyio
async def test_set_cookie_lines_are_relayed_as_the_upstream_wrote_them(
    django_site: Any, closing: None
) -> None:
    # Re-parsed through SimpleCookie, `Partitioned` and a JSON value were dropped, and
    # `Priority=High` became a second cookie; two cookies of one name collapsed into one.
    sent = [
        "chips=1; Path=/; Secure; HttpOnly; SameSite=None; Partitioned",
        "pri=1; Path=/; Priority=High",
        'prefs={"a":1}; Path=/',
        "__cf_bm=abc.def-1; path=/; expires=Wed, 21 Oct 2037 07:28:00 GMT; HttpOnly; Secure",
        "sid=a; Path=/v1/",
        "sid=b; Path=/v2/",
    ]

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.Response(body=b"ok", content_type="text/plain")
        for line in sent:
            response.headers.add("set-cookie", line)
        return response

    async with upstream(handler) as primary, upstream(status_handler(200)) as backup:
        app = django_site(keyless_config(primary, backup))
        async with client_for(app) as client:
            response = await client.get("/v1/cookie")
        # Django's own test client reads response.cookies: names and values as sent.
        relayed = (await AsyncClient().get("/v1/cookie")).cookies
    assert response.status_code == 200
    assert sorted(response.headers.get_list("set-cookie")) == sorted(sent)
    assert sorted((m.key, m.value) for m in relayed.values()) == [
        ("__cf_bm", "abc.def-1"), ("chips", "1"), ("prefs", '{"a":1}'), ("pri", "1"),
        ("sid", "a"), ("sid", "b"),
    ]  # fmt: skip


@pytest.mark.anyio
async def test_djangos_async_client_is_routed_with_its_query_string(
    django_site: Any, closing: None
) -> None:
    # Django's AsyncClient puts the query string in the scope as text, not bytes as ASGI
    # says (Django's own handler takes either): a routed request with one was a 500
    # (TypeError in the method-override check), and with none, compiled, too.
    async with upstream(status_handler(200, b"ok")) as primary, upstream(status_handler(200)) as b:
        django_site(keyless_config(primary, b))
        plain = await AsyncClient().get("/v1/cookie")
        queried = await AsyncClient().get("/v1/cookie?page=2&q=x")
    assert (plain.status_code, queried.status_code) == (200, 200), queried.content
    assert [r.query for r in primary.received] == ["", "page=2&q=x"]


def test_a_relayed_set_cookie_line_is_the_same_whichever_way_django_writes_it() -> None:
    """Django 5 writes a response's cookies with `Morsel.output(header="")`, Django 6 (what
    pip installs on Python 3.12 and later) with `Morsel.OutputString()`, which wrote only
    `name=value`: every relayed cookie lost its Path, Secure, HttpOnly, SameSite and
    expiry. Both give the line as the upstream wrote it."""
    from django.http import StreamingHttpResponse

    from fallback_mw.django_exchange import _copy_headers

    line = "chips=1; Path=/; Secure; HttpOnly; SameSite=None; Partitioned"
    response = StreamingHttpResponse(iter(()))
    _copy_headers([(b"set-cookie", line.encode())], response)
    (morsel,) = response.cookies.values()
    assert morsel.output(header="").strip() == line
    assert morsel.OutputString() == line


@pytest.mark.anyio
async def test_an_aborted_response_is_quiet_in_django_6s_handler() -> None:
    """Django 6 (what pip installs on Python 3.12 and later) sends a response inside an
    asyncio.TaskGroup and lets only RequestAborted (a client gone) end it quietly; the
    TaskGroup wraps any other exception, a CancelledError subclass included, in a group
    that Django raised to the server: every stream the gateway aborted printed 'Exception
    in ASGI application' and a traceback under uvicorn, granian and the rest. This is
    Django 6's shape (Django 5 takes it as a CancelledError)."""
    from django.core.exceptions import RequestAborted

    async def client_listener() -> None:
        await asyncio.sleep(30)

    try:
        async with asyncio.TaskGroup() as group:
            group.create_task(client_listener())
            raise GatewayAborted("the gateway aborted the response")
    except* RequestAborted:
        pass
    assert issubclass(GatewayAborted, asyncio.CancelledError)  # Django 5's quiet path


# --- the bridge driven directly, with Django request objects ----------------------------


async def django_view(request: HttpRequest) -> HttpResponseBase:
    return HttpResponse(b"from django")


@pytest.mark.anyio
async def test_streaming_reaches_django_chunk_by_chunk() -> None:
    release = asyncio.Event()

    async def sse(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: one\n\n")
        await release.wait()  # only released once the client saw event one
        await response.write(b"data: two\n\n")
        await response.write_eof()
        return response

    async with upstream(sse) as primary, upstream(status_handler(200)) as backup:
        with override_settings(FALLBACK_MW={"config": gateway_config(primary, backup)}):
            middleware = GatewayMiddleware(django_view)
        try:
            with anyio.fail_after(5):
                response = await middleware(AsyncRequestFactory().get("/v1/stream"))
                assert response.status_code == 200
                assert response["content-type"] == "text/event-stream"
                chunks = aiter(response)  # type: ignore[call-overload]
                assert await anext(chunks) == b"data: one\n\n"
                release.set()
                rest = [chunk async for chunk in chunks]
            assert b"".join(rest) == b"data: two\n\n"
        finally:
            await middleware.aclose()


@pytest.mark.anyio
async def test_aborted_upstream_aborts_the_django_response() -> None:
    async def truncated(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-length": "1000"})
        await response.prepare(request)
        await response.write(b"partial")
        await asyncio.sleep(0.05)
        request.transport.close()  # type: ignore[union-attr]
        return response

    async with upstream(truncated) as primary, upstream(status_handler(200)) as backup:
        with override_settings(FALLBACK_MW={"config": gateway_config(primary, backup)}):
            middleware = GatewayMiddleware(django_view)
        try:
            with anyio.fail_after(5):
                response = await middleware(AsyncRequestFactory().get("/v1/big"))
                assert response.status_code == 200
                received = b""
                with pytest.raises(GatewayAborted):
                    async for chunk in response:  # type: ignore[attr-defined]
                        received += chunk
            assert received == b"partial"
            assert backup.count == 0
        finally:
            await middleware.aclose()


@pytest.mark.anyio
async def test_unmatched_goes_to_get_response() -> None:
    async with upstream(status_handler(200)) as primary, upstream(status_handler(200)) as backup:
        with override_settings(FALLBACK_MW={"config": gateway_config(primary, backup)}):
            middleware = GatewayMiddleware(django_view)
        try:
            response = await middleware(AsyncRequestFactory().get("/other"))
        finally:
            await middleware.aclose()
    assert isinstance(response, HttpResponse)
    assert response.content == b"from django"
    assert primary.count == 0


def test_middleware_is_async_only() -> None:
    with override_settings(FALLBACK_MW={"config": {}}):
        middleware = GatewayMiddleware(django_view)
    assert iscoroutinefunction(middleware)
    assert GatewayMiddleware.async_capable is True
    assert GatewayMiddleware.sync_capable is False


WSGI_CONFIG = {
    "gateway": {"allow_hosts": ["127.0.0.1"]},
    "upstreams": {"primary": {"url": "http://127.0.0.1:9", "auth_env": "FMW_DJ_PRIMARY_KEY"}},
    "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"]}],
}


@pytest.mark.anyio
async def test_wsgi_request_is_refused_clearly() -> None:
    with override_settings(FALLBACK_MW={"config": WSGI_CONFIG}):
        middleware = GatewayMiddleware(django_view)
    with pytest.raises(ImproperlyConfigured, match=r"ASGI.*'/v1/x'.*AsyncClient"):
        await middleware(RequestFactory().get("/v1/x"))
    # A method no route forwards is still the route's (its 405), so refused the same way.
    with pytest.raises(ImproperlyConfigured, match="ASGI"):
        await middleware(RequestFactory().generic("PROPFIND", "/v1/x"))


def test_under_wsgi_the_projects_own_pages_still_reach_django() -> None:
    # runserver, gunicorn on wsgi.py and django.test.Client serve Django over WSGI: every
    # page of the project was a 500 once the middleware was listed, routed or not.
    with override_settings(
        MIDDLEWARE=["fallback_mw.django.GatewayMiddleware"],
        FALLBACK_MW={"config": WSGI_CONFIG},
    ):
        client = Client(raise_request_exception=True)
        own = client.post("/local/", data=b"kept", content_type="text/plain")
        assert own.status_code == 200
        assert own.content == b"django saw: kept"
        with pytest.raises(ImproperlyConfigured, match="'/v1'"):
            client.get("/v1")  # the route's too, as under ASGI
        with pytest.raises(ImproperlyConfigured, match="'/v1/models'"):
            client.get("/v1/models")
        with pytest.raises(ImproperlyConfigured, match="ASGI"):
            client.get("/local/../v1/models")


@pytest.mark.anyio
async def test_under_wsgi_a_route_for_a_unicode_tenant_is_refused_as_the_routes() -> None:
    # A WSGI server hands header values over as latin-1 text (PEP 3333): the tenant
    # `日本語` a caller sent in UTF-8 was compared as "æ\x97¥æ\x9c¬è\xaa\x9e", matched no
    # route, and the request went on to Django's own pages (a 404) instead of the refusal
    # that says the route needs ASGI. It is read as the gateway reads it, in UTF-8.
    route = {"id": "chat", "prefix": "/v1/", "plan": ["primary"], "tenant": "日本語"}
    with override_settings(FALLBACK_MW={"config": {**WSGI_CONFIG, "routes": [route]}}):
        middleware = GatewayMiddleware(django_view)
    as_wsgi = "日本語".encode().decode("latin-1")
    with pytest.raises(ImproperlyConfigured, match="ASGI"):
        await middleware(RequestFactory().get("/v1/x", HTTP_X_TENANT_ID=f" {as_wsgi}\t"))
    other = await middleware(RequestFactory().get("/v1/x", HTTP_X_TENANT_ID="acme"))
    assert other.status_code == 200  # another tenant's request: no route, Django's own


@pytest.mark.anyio
async def test_under_wsgi_a_method_in_another_case_is_decided_as_sent() -> None:
    # The gateway compares a method as sent (e278d4a: `get` is not GET), and under ASGI a
    # `get` on a route that lists GET goes on to Django. Under WSGI the middleware asked
    # the table with Django's `request.method`, which Django upper-cases: the route took
    # it, and the request was ImproperlyConfigured (a 500) instead of Django's own page.
    route = {"id": "chat", "prefix": "/v1/", "plan": ["primary"], "methods": ["GET"]}
    with override_settings(FALLBACK_MW={"config": {**WSGI_CONFIG, "routes": [route]}}):
        middleware = GatewayMiddleware(django_view)
    response = await middleware(RequestFactory().generic("get", "/v1/x"))
    assert response.status_code == 200  # Django's own
    with pytest.raises(ImproperlyConfigured, match="ASGI"):
        await middleware(RequestFactory().generic("GET", "/v1/x"))  # the route's


def test_missing_setting_is_improperly_configured() -> None:
    with override_settings(), pytest.raises(ImproperlyConfigured, match="FALLBACK_MW"):
        GatewayMiddleware(django_view)
    with (
        override_settings(FALLBACK_MW={"config": {}, "typo": 1}),
        pytest.raises(ImproperlyConfigured, match="typo"),
    ):
        GatewayMiddleware(django_view)
    # {"config": os.environ.get("GATEWAY_CONFIG")} with the variable unset, or a typo'd
    # value: named, not a bare TypeError from deep inside the loader.
    for source in (None, 42, ["gateway.toml"]):
        with (
            override_settings(FALLBACK_MW={"config": source}),
            pytest.raises(ImproperlyConfigured, match=r'FALLBACK_MW\["config"\] must be a path'),
        ):
            GatewayMiddleware(django_view)


def test_a_misspelt_or_misshapen_setting_says_what_to_write() -> None:
    # FALLBACK_MW = {"confg": ...} and FALLBACK_MW = "gateway.toml" were both answered with
    # 'set FALLBACK_MW = {"config": "gateway.toml"}', as if the setting were absent.
    with (
        override_settings(FALLBACK_MW={"confg": "gateway.toml"}),
        pytest.raises(ImproperlyConfigured) as typo,
    ):
        GatewayMiddleware(django_view)
    assert str(typo.value) == (
        "fallback_mw: unknown FALLBACK_MW key(s): ['confg'] (did you mean 'config'?)"
    )
    with (
        override_settings(FALLBACK_MW="gateway.toml"),
        pytest.raises(ImproperlyConfigured) as bare,
    ):
        GatewayMiddleware(django_view)
    assert str(bare.value) == (
        "fallback_mw: FALLBACK_MW is a dict: write FALLBACK_MW = {'config': 'gateway.toml'}"
    )


def test_missing_credential_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FMW_DJ_PRIMARY_KEY", PRIMARY_KEY)
    monkeypatch.delenv("FMW_DJ_BACKUP_KEY")
    config = {
        "upstreams": {
            "primary": {"url": "http://127.0.0.1:9", "auth_env": "FMW_DJ_PRIMARY_KEY"},
            "backup": {"url": "http://127.0.0.1:10", "auth_env": "FMW_DJ_BACKUP_KEY"},
        },
        "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary", "backup"], "retries": 1}],
    }
    with (
        override_settings(FALLBACK_MW={"config": config}),
        pytest.raises(ImproperlyConfigured) as exc,
    ):
        GatewayMiddleware(django_view)
    assert "FMW_DJ_BACKUP_KEY" in str(exc.value)
    assert PRIMARY_KEY not in str(exc.value)


@pytest.mark.anyio
async def test_cancelled_request_cancels_the_walk_and_starts_no_fallback() -> None:
    arrived = asyncio.Event()

    async def hang(request: web.Request) -> web.StreamResponse:
        arrived.set()
        await asyncio.sleep(30)
        return web.Response(status=503)

    async with upstream(hang) as primary, upstream(status_handler(200)) as backup:
        config = gateway_config(primary, backup)
        # A walk left running would time the primary out and fail over to the backup.
        config["upstreams"]["primary"]["first_byte_timeout_ms"] = 300
        with override_settings(FALLBACK_MW={"config": config}):
            middleware = GatewayMiddleware(django_view)
        try:
            # What Django does when the client disconnects: cancel the request's task.
            request_task = asyncio.create_task(middleware(AsyncRequestFactory().get("/v1/slow")))
            with anyio.fail_after(5):
                await arrived.wait()
            request_task.cancel()
            with anyio.fail_after(2), pytest.raises(asyncio.CancelledError):
                await request_task
            await asyncio.sleep(0.6)
            assert backup.count == 0
            assert primary.count == 1
        finally:
            await middleware.aclose()


@pytest.mark.anyio
async def test_a_client_gone_is_recorded_as_client_disconnected(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Django cancels the request's task when the client leaves, before the response head
    # or mid-stream. The Gateway must hear a disconnect, as under any server, and record
    # `client_disconnected`, not an unexplained `internal_error` in logs, spans and metrics.
    arrived = asyncio.Event()

    async def slow_stream(request: web.Request) -> web.StreamResponse:
        arrived.set()
        if request.path == "/v1/head":
            await asyncio.sleep(30)
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: one\n\n")
        await asyncio.sleep(30)
        return response

    async def read_all(response: Any, first: asyncio.Event) -> None:
        async for _ in response:
            first.set()

    async with upstream(slow_stream) as primary, upstream(status_handler(200)) as backup:
        with override_settings(FALLBACK_MW={"config": gateway_config(primary, backup)}):
            middleware = GatewayMiddleware(django_view)
        try:
            with caplog.at_level(logging.INFO, logger="fallback_mw.request"):
                response = await middleware(AsyncRequestFactory().get("/v1/stream"))
                first = asyncio.Event()
                reader = asyncio.create_task(read_all(response, first))
                with anyio.fail_after(5):
                    await first.wait()
                reader.cancel()
                with anyio.fail_after(2), pytest.raises(asyncio.CancelledError):
                    await reader
                arrived.clear()
                request_task = asyncio.create_task(
                    middleware(AsyncRequestFactory().get("/v1/head"))
                )
                with anyio.fail_after(5):
                    await arrived.wait()
                request_task.cancel()
                with anyio.fail_after(2), pytest.raises(asyncio.CancelledError):
                    await request_task
            outcomes = [
                r.getMessage().split("outcome=")[1].split()[0]
                for r in caplog.records
                if r.name == "fallback_mw.request"
            ]
            assert outcomes == ["client_disconnected", "client_disconnected"]
            assert backup.count == 0
        finally:
            await middleware.aclose()


@pytest.mark.anyio
async def test_a_routed_response_a_middleware_above_replaces_does_not_hold_the_gateway(
    closing: None, caplog: pytest.LogCaptureFixture
) -> None:
    # ConditionalGetMiddleware above GatewayMiddleware answers the caller's If-None-Match
    # with its own 304 and drops the routed response unread: the Gateway waited forever to
    # hand it the rest (its upstream connection, max_concurrency slot and hold kept).
    caplog.set_level(logging.INFO, logger="fallback_mw.request")
    async with (
        upstream(status_handler(200, b"tagged", ETag='"v1"')) as primary,
        upstream(status_handler(200, b"backup")) as backup,
    ):
        with override_settings(
            MIDDLEWARE=[
                "django.middleware.http.ConditionalGetMiddleware",
                "fallback_mw.django.GatewayMiddleware",
            ],
            FALLBACK_MW={"config": gateway_config(primary, backup)},
        ):
            app = ASGIHandler()
        async with client_for(app) as client:
            response = await client.get("/v1/models", headers={"if-none-match": '"v1"'})
        assert response.status_code == 304
        with anyio.fail_after(5):
            while not any("gateway request" in r.getMessage() for r in caplog.records):  # noqa: ASYNC110
                await asyncio.sleep(0.02)
    pending = [
        task
        for task in asyncio.all_tasks()
        if task.get_coro().__qualname__ == "GatewayMiddleware.__call__.<locals>.run"
    ]
    assert pending == []
    (line,) = [r.getMessage() for r in caplog.records if "gateway request" in r.getMessage()]
    assert "chosen=primary" in line, line


class TenantFromLogin:
    """A project's middleware above GatewayMiddleware: the tenant comes from the login,
    never from the caller (docs/security.md), set the Django way, in request.META."""

    async_capable = True
    sync_capable = False
    key = "HTTP_X_TENANT_ID"

    def __init__(self, get_response: Any) -> None:
        self.get_response = get_response
        markcoroutinefunction(self)

    async def __call__(self, request: HttpRequest) -> HttpResponseBase:
        login = request.headers.get("x-login")
        if login:
            request.META[self.key] = login
        else:
            request.META.pop(self.key, None)
        return await self.get_response(request)  # type: ignore[no-any-return]


@pytest.mark.anyio
async def test_a_tenant_a_middleware_above_sets_in_meta_is_the_one_routed(
    closing: None,
) -> None:
    async with (
        upstream(status_handler(200, b"acme's upstream")) as acme,
        upstream(status_handler(200, b"everyone's upstream")) as shared,
    ):
        config = gateway_config(acme, shared)
        config["routes"] = [
            {"id": "acme", "prefix": "/v1/", "tenant": "acme", "plan": ["primary"]},
            {"id": "shared", "prefix": "/v1/", "plan": ["backup"]},
        ]
        with override_settings(
            MIDDLEWARE=[f"{__name__}.TenantFromLogin", "fallback_mw.django.GatewayMiddleware"],
            FALLBACK_MW={"config": config},
        ):
            app = ASGIHandler()
        async with client_for(app) as client:
            # The caller names tenant acme; its login says otherwise, or there is none.
            claimed = {"x-tenant-id": "acme", "x_tenant_id": "acme"}
            guest = await client.get("/v1/models", headers={**claimed, "x-login": "guest"})
            anonymous = await client.get("/v1/models", headers=claimed)
            member = await client.get("/v1/models", headers={"x-login": "acme"})
    assert guest.headers["x-gateway-route"] == "shared", guest.content
    assert guest.content == b"everyone's upstream"
    assert anonymous.headers["x-gateway-route"] == "shared", anonymous.content
    assert member.headers["x-gateway-route"] == "acme"
    assert member.content == b"acme's upstream"
    assert len(acme.received) == 1
    sent = [dict(received.headers) for received in shared.received]
    assert sent[0]["x-tenant-id"] == "guest"
    assert "x-tenant-id" not in sent[1] and "x_tenant_id" not in sent[1]


@pytest.mark.anyio
async def test_a_tenant_a_middleware_above_deletes_is_not_restored_in_its_underscore_spelling(
    closing: None,
) -> None:
    # Django keeps `x_tenant_id` out of request.META (its rule against underscore spoofing),
    # so a login middleware deleting HTTP_X_TENANT_ID never saw it; the gateway reads it as
    # the tenant header, and the anonymous caller was routed and charged as tenant acme.
    async with (
        upstream(status_handler(200, b"acme's upstream")) as acme,
        upstream(status_handler(200, b"everyone's upstream")) as shared,
    ):
        config = gateway_config(acme, shared)
        config["routes"] = [
            {"id": "acme", "prefix": "/v1/", "tenant": "acme", "plan": ["primary"]},
            {"id": "shared", "prefix": "/v1/", "plan": ["backup"]},
        ]
        with override_settings(
            MIDDLEWARE=[f"{__name__}.TenantFromLogin", "fallback_mw.django.GatewayMiddleware"],
            FALLBACK_MW={"config": config},
        ):
            app = ASGIHandler()
        async with client_for(app) as client:
            anonymous = await client.get("/v1/models", headers={"x_tenant_id": "acme"})
            guest = await client.get(
                "/v1/models", headers={"x_tenant_id": "acme", "x-login": "guest"}
            )
        config["routes"][0]["tenant"] = "josé"
        with override_settings(
            MIDDLEWARE=["fallback_mw.django.GatewayMiddleware"], FALLBACK_MW={"config": config}
        ):
            bare = ASGIHandler()  # kept: `closing` closes its gateway
        async with client_for(bare) as client:
            # No middleware above: the caller's own field, as sent (UTF-8), still names the
            # tenant; only its underscore twin is dropped.
            named = await client.get(
                "/v1/models", headers=[("x-tenant-id", "josé".encode()), ("x_tenant_id", "x")]
            )
    assert anonymous.headers["x-gateway-route"] == "shared", anonymous.content
    assert guest.headers["x-gateway-route"] == "shared", guest.content
    assert named.headers["x-gateway-route"] == "acme", named.content
    assert len(acme.received) == 1
    assert "x_tenant_id" not in dict(acme.received[0].headers)
    sent = [dict(received.headers) for received in shared.received]
    assert "x_tenant_id" not in sent[0] and "x-tenant-id" not in sent[0]
    assert sent[1]["x-tenant-id"] == "guest" and "x_tenant_id" not in sent[1]


def test_a_configuration_that_does_not_load_is_raised_as_configuration_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # docs/configuration.md quotes the ImproperlyConfigured a project meets when its
    # gateway configuration does not load; it quoted "fallback_mw: ...".
    monkeypatch.delenv("FMW_DJ_PRIMARY_KEY")
    with (
        override_settings(FALLBACK_MW={"config": WSGI_CONFIG}),
        pytest.raises(ImproperlyConfigured) as raised,
    ):
        GatewayMiddleware(django_view)
    message = str(raised.value)
    assert "FMW_DJ_PRIMARY_KEY is not set" in message
    page = (Path(__file__).parents[1] / "docs" / "configuration.md").read_text()
    quoted = re.search(r'`ImproperlyConfigured\("([^"]*)\.\.\."\)`', page)
    assert quoted is not None
    assert message.startswith(quoted.group(1))


@pytest.mark.anyio
async def test_with_lifespan_starts_the_gateways_as_a_gateway_lifespan_does(
    closing: None, caplog: pytest.LogCaptureFixture
) -> None:
    # A Gateway's lifespan startup tries its Redis state at once, so an unusable one is
    # said at startup; under with_lifespan it was said only at the first routed request.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]  # nothing listens here once the socket closes
    config = {
        **WSGI_CONFIG,
        "gateway": {"allow_hosts": ["127.0.0.1"], "state": f"redis://127.0.0.1:{closed}/0"},
    }
    with override_settings(
        MIDDLEWARE=["fallback_mw.django.GatewayMiddleware"], FALLBACK_MW={"config": config}
    ):
        app = with_lifespan(ASGIHandler())
    messages = [{"type": "lifespan.startup"}]
    sent: list[Message] = []
    stop = asyncio.Event()

    async def receive() -> Message:
        if messages:
            return messages.pop(0)
        await stop.wait()
        return {"type": "lifespan.shutdown"}

    async def send(message: Message) -> None:
        sent.append(message)

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(app, {"type": "lifespan"}, receive, send)
        with anyio.fail_after(5):
            while not any("unreachable" in r.getMessage() for r in caplog.records):  # noqa: ASYNC110
                await asyncio.sleep(0.02)
        stop.set()
    assert [m["type"] for m in sent] == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
    (line,) = [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]
    assert f"127.0.0.1:{closed}" in line


@pytest.mark.anyio
async def test_an_underscore_tenant_header_django_leaves_out_of_meta_still_routes(
    closing: None,
) -> None:
    # Django keeps no field whose name has an underscore in request.META: the caller's
    # `x_tenant` is not a value a middleware above removed, and still names the tenant.
    async with (
        upstream(status_handler(200, b"acme's upstream")) as acme,
        upstream(status_handler(200, b"everyone's upstream")) as shared,
    ):
        config = gateway_config(acme, shared)
        config["gateway"]["tenant_header"] = "x_tenant"
        config["routes"] = [
            {"id": "acme", "prefix": "/v1/", "tenant": "acme", "plan": ["primary"]},
            {"id": "shared", "prefix": "/v1/", "plan": ["backup"]},
        ]
        with override_settings(
            MIDDLEWARE=["fallback_mw.django.GatewayMiddleware"], FALLBACK_MW={"config": config}
        ):
            app = ASGIHandler()
        async with client_for(app) as client:
            underscore = await client.get("/v1/models", headers={"x_tenant": "acme"})
            dashed = await client.get("/v1/models", headers={"x-tenant": "acme"})
        with override_settings(
            MIDDLEWARE=[
                f"{__name__}.UnderscoreTenantFromLogin",
                "fallback_mw.django.GatewayMiddleware",
            ],
            FALLBACK_MW={"config": config},
        ):
            with_login = ASGIHandler()  # both kept: `closing` closes their gateways
        async with client_for(with_login) as client:
            guest = await client.get("/v1/models", headers={"x_tenant": "acme", "x-login": "guest"})
    assert underscore.headers["x-gateway-route"] == "acme", underscore.content
    assert dashed.headers["x-gateway-route"] == "acme", dashed.content
    # Set by the login above: the caller's underscore field is not a second value.
    assert guest.headers["x-gateway-route"] == "shared", guest.content
    assert dict(shared.received[-1].headers)["x_tenant"] == "guest"


class UnderscoreTenantFromLogin(TenantFromLogin):
    key = "HTTP_X_TENANT"  # tenant_header = "x_tenant", as Django names it in META


def test_under_wsgi_a_route_store_is_not_reopened_per_request(tmp_path: Path) -> None:
    # Each WSGI request runs the middleware on an event loop of its own: asking the route
    # table there started the store reloader on that loop (the store opened and read, then
    # the task cancelled as the loop ended), once per page of the project's own.
    config = {**WSGI_CONFIG, "gateway": {**WSGI_CONFIG["gateway"]}}
    config["gateway"]["store"] = f"sqlite:///{tmp_path / 'gateway.db'}"
    with override_settings(
        MIDDLEWARE=["fallback_mw.django.GatewayMiddleware"], FALLBACK_MW={"config": config}
    ):
        client = Client(raise_request_exception=True)
        for _ in range(3):
            assert client.post("/local/", data=b"x", content_type="text/plain").status_code == 200
        with pytest.raises(ImproperlyConfigured, match="'/v1/models'"):
            client.get("/v1/models")
        (middleware,) = [m for m in adapter._live if m.gateway.services.store is not None]
        runtime = middleware.gateway.services.store
        assert runtime is not None
        assert runtime._task is None


@pytest.mark.anyio
async def test_a_django_test_client_dropped_leaves_no_connection_to_the_collector() -> None:
    # Each django.test.AsyncClient builds Django's middleware, so a GatewayMiddleware of
    # its own: once the client was dropped, its gateway's open upstream connections went
    # to the garbage collector ("Unclosed connector", an error in a suite run with
    # filterwarnings = error), test after test.
    async with upstream(status_handler(200)) as primary, upstream(status_handler(200)) as backup:
        with override_settings(
            MIDDLEWARE=["fallback_mw.django.GatewayMiddleware"],
            FALLBACK_MW={"config": gateway_config(primary, backup)},
        ):
            client = AsyncClient()
            assert (await client.get("/v1/models")).status_code == 200
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            del client
            gc.collect()
            await asyncio.sleep(0.2)  # the gateway closes on this loop
            gc.collect()
    assert [str(w.message) for w in caught if w.category is ResourceWarning] == []
