"""Method-override headers as an attacker uses them: `X-HTTP-Method-Override: DELETE` on a
POST, which Google's APIs, Rails, Express, Laravel and ASP.NET Core run as a DELETE. The
gateway judges a request by the method the upstream will act on."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp import web

from fallback_mw import Gateway
from tests.helpers import client_for
from tests.upstreams import host_app, status_handler, upstream

pytestmark = pytest.mark.anyio


async def honours_override(request: web.Request) -> web.StreamResponse:
    """An upstream that acts on the override, as the frameworks above do (on any method)."""
    acted = request.method
    for name, value in request.headers.items():
        if name.lower().replace("_", "-") in (
            "x-http-method-override", "x-http-method", "x-method-override"
        ):  # fmt: skip
            acted = value.split(",")[0].strip().upper()
    return web.Response(text=f"acted {acted}")


def config(url: str, **route: Any) -> dict[str, Any]:
    return {
        "gateway": {"allow_hosts": ["127.0.0.1"]},
        "upstreams": {"primary": {"url": url}},
        "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"], **route}],
    }


@pytest.mark.parametrize(
    "field",
    [
        ("X-HTTP-Method-Override", "DELETE"),
        ("x-http-method-override", "delete"),
        ("X_HTTP_Method_Override", "DELETE"),
        ("X-HTTP-Method", "DELETE"),
        ("X-Method-Override", "DELETE"),
        ("X-HTTP-Method-Override", "DELETE, POST"),
    ],
    ids=["canonical", "lowercase", "underscores", "x-http-method", "x-method-override", "list"],
)
async def test_an_override_to_a_method_the_route_does_not_forward_is_405(
    field: tuple[str, str],
) -> None:
    # Before: a route that forwards only GET and POST (the completions slice of an API,
    # the provider's credential injected) let a caller DELETE through it.
    async with upstream(honours_override) as primary:
        gateway = Gateway(host_app, config=config(primary.url, methods=["GET", "POST"]))
        try:
            async with client_for(gateway) as client:
                response = await client.post("/v1/files/f-1", headers=[field])
                allowed = await client.post(
                    "/v1/files/f-1", headers=[("X-HTTP-Method-Override", "post")]
                )
        finally:
            await gateway.aclose()
    assert response.status_code == 405
    assert response.json()["error"]["code"] == "method_not_allowed"
    assert response.headers["allow"] == "GET, POST"
    assert field[1] not in response.text  # the caller's value is not echoed
    assert allowed.status_code == 200 and allowed.text == "acted POST"
    assert primary.count == 1  # only the request whose override the route forwards


@pytest.mark.parametrize("field", ["X-HTTP-Method-Override", "x_http_method"])
async def test_a_get_that_an_override_makes_a_post_is_not_replayed(field: str) -> None:
    # Before: GET is replayable by default, so a GET carrying `X-HTTP-Method-Override: POST`
    # failed over, and the backup ran the POST (a completion, billed, an action taken) that
    # the primary may already have run; a hedge would have sent two at once.
    async with (
        upstream(status_handler(503)) as primary,
        upstream(honours_override) as backup,
    ):
        conf = config(primary.url, retries=1, plan=["primary", "backup"])
        conf["upstreams"]["backup"] = {"url": backup.url}
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                overridden = await client.get("/v1/chat", headers={field: "POST"})
                plain = await client.get("/v1/chat", headers={field: "get"})
        finally:
            await gateway.aclose()
    assert overridden.status_code == 502
    error = overridden.json()["error"]
    assert error["rule"] == "method_override" and error["attempts"] == 1
    assert "replayable_methods" in error["message"]
    assert plain.status_code == 200 and plain.text == "acted GET"  # GET is replayable
    assert primary.count == 2 and backup.count == 1


async def honours_method_parameter(request: web.Request) -> web.StreamResponse:
    """An upstream that acts on a `_method` query parameter, as Symfony (Laravel turns it
    on), Rack and Express's method-override with a query getter do: PHP's reading of the
    name (percent-decoded, `.` as `_`), the last one wins."""
    acted = request.method
    for name, value in request.query.items():
        if name.replace(".", "_") == "_method":
            acted = value.upper()
    return web.Response(text=f"acted {acted}")


@pytest.mark.parametrize(
    "query",
    [
        "_method=DELETE",
        "_method=delete",
        "api-version=2024-10-21&_method=DELETE",
        "%5Fmethod=DELETE",
        "_method=DEL%45TE",
        ".method=DELETE",
        "a=1;_method=DELETE",
        "_m%65thod=DELETE",  # no `ethod` as sent: only its `%` says it may name one
    ],
    ids=[
        "plain",
        "lowercase",
        "after-another",
        "encoded-name",
        "encoded-value",
        "dot",
        "semi",
        "encoded-letter",
    ],
)
async def test_a_method_query_parameter_to_a_method_the_route_does_not_forward_is_405(
    query: str,
) -> None:
    # Before: only the override headers were read, so `POST /v1/files/f-1?_method=DELETE`
    # went through a route forwarding GET and POST, the provider's credential injected, and
    # a Laravel upstream deleted the file.
    async with upstream(honours_method_parameter) as primary:
        gateway = Gateway(host_app, config=config(primary.url, methods=["GET", "POST"]))
        try:
            async with client_for(gateway) as client:
                response = await client.post(f"/v1/files/f-1?{query}")
                allowed = await client.post("/v1/files/f-1?_method=post")
                plain = await client.post("/v1/files/f-1?api-version=2024-10-21&method=x")
        finally:
            await gateway.aclose()
    assert response.status_code == 405, response.text
    assert response.json()["error"]["code"] == "method_not_allowed"
    assert "_method" in response.json()["error"]["message"]
    assert response.headers["allow"] == "GET, POST"
    assert "DEL" not in response.text  # the caller's value is not echoed
    assert allowed.status_code == 200 and allowed.text == "acted POST"
    assert plain.status_code == 200 and plain.text == "acted POST"
    assert primary.received[1].query == "api-version=2024-10-21&method=x"
    assert primary.count == 2


async def test_a_get_that_a_method_query_parameter_makes_a_post_is_not_replayed() -> None:
    # As with the header: a GET the upstream runs as a POST must not fail over.
    async with (
        upstream(status_handler(503)) as primary,
        upstream(honours_method_parameter) as backup,
    ):
        conf = config(primary.url, retries=1, plan=["primary", "backup"])
        conf["upstreams"]["backup"] = {"url": backup.url}
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                overridden = await client.get("/v1/chat?_method=POST")
                plain = await client.get("/v1/chat?_method=get")
        finally:
            await gateway.aclose()
    assert overridden.status_code == 502
    error = overridden.json()["error"]
    assert error["rule"] == "method_override" and error["attempts"] == 1
    assert "_method" in error["message"]
    assert plain.status_code == 200 and plain.text == "acted GET"
    assert primary.count == 2 and backup.count == 1


async def honours_form_method(request: web.Request) -> web.StreamResponse:
    """An upstream that acts on a urlencoded form body's `_method` on a POST, as Rack
    (Rails) and Symfony (Laravel) do."""
    acted = request.method
    if acted == "POST" and request.content_type == "application/x-www-form-urlencoded":
        acted = (await request.post()).get("_method", acted).upper()  # type: ignore[union-attr]
    return web.Response(text=f"acted {acted}")


@pytest.mark.parametrize(
    "content_type", ["application/x-www-form-urlencoded", "Application/X-WWW-Form-Urlencoded"]
)
async def test_a_form_method_field_to_a_method_the_route_does_not_forward_is_405(
    content_type: str,
) -> None:
    # Before: `POST /v1/files/f-1` with the form body `_method=DELETE` went through a route
    # forwarding GET and POST, the provider's credential injected, and a Rails or Laravel
    # upstream deleted the file.
    form = {"content-type": content_type}
    async with upstream(honours_form_method) as primary:
        gateway = Gateway(host_app, config=config(primary.url, methods=["GET", "POST"]))
        try:
            async with client_for(gateway) as client:
                response = await client.post(
                    "/v1/files/f-1", content=b"purpose=x&_method=DELETE", headers=form
                )
                allowed = await client.post("/v1/files/f-1", content=b"_method=post", headers=form)
                json_body = await client.post("/v1/files/f-1", json={"_method": "DELETE"})
        finally:
            await gateway.aclose()
    assert response.status_code == 405, response.text
    assert response.json()["error"]["code"] == "method_not_allowed"
    assert response.headers["allow"] == "GET, POST"
    assert "DELETE" not in response.text  # the caller's value is not echoed
    assert allowed.status_code == 200 and allowed.text == "acted POST"
    assert json_body.status_code == 200 and json_body.text == "acted POST"  # not a form
    assert primary.count == 2


async def test_a_post_that_a_form_method_field_makes_a_delete_is_not_replayed_and_says_why() -> (
    None
):
    # The replay rule reads the form field as it reads the header and the query parameter;
    # its message named only those two, so a caller whose request carried neither was told
    # about something it had not sent.
    form = {"content-type": "application/x-www-form-urlencoded"}
    async with (
        upstream(status_handler(503)) as primary,
        upstream(honours_form_method) as backup,
    ):
        conf = config(
            primary.url, retries=1, plan=["primary", "backup"], replayable_methods=["GET", "POST"]
        )
        conf["upstreams"]["backup"] = {"url": backup.url}
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                overridden = await client.post(
                    "/v1/files/f-1", content=b"_method=DELETE", headers=form
                )
        finally:
            await gateway.aclose()
    assert overridden.status_code == 502
    error = overridden.json()["error"]
    assert error["rule"] == "method_override" and error["attempts"] == 1
    assert "form body's _method field" in error["message"]
    assert backup.count == 0
