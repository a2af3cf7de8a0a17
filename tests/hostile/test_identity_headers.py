"""The tenant and session headers sent twice. A proxy in front that sets the tenant from
the caller's authenticated identity by *adding* a field (Envoy's default append) leaves the
caller's own field first, and the gateway read the first: the caller chose its tenant, so
its routes, credentials and budget. Two different values are refused; equal ones are one."""

from __future__ import annotations

from typing import Any

import pytest

from fallback_mw import ConfigError, Gateway, load_config
from tests.helpers import client_for
from tests.upstreams import host_app, status_handler, upstream

pytestmark = pytest.mark.anyio


def config(url: str) -> dict[str, Any]:
    return {
        "gateway": {"allow_hosts": ["127.0.0.1"]},
        "upstreams": {"acme": {"url": url}, "other": {"url": url}},
        "routes": [
            {"id": "acme-chat", "prefix": "/v1/", "plan": ["acme"], "tenant": "acme"},
            {"id": "other-chat", "prefix": "/v1/", "plan": ["other"], "tenant": "other"},
        ],
    }


@pytest.mark.parametrize("name", ["x-tenant-id", "x-session-id"])
async def test_an_identity_header_sent_twice_with_different_values_is_refused(name: str) -> None:
    async with upstream(status_handler(200, b"answered")) as up:
        gateway = Gateway(host_app, config=config(up.url))
        try:
            async with client_for(gateway) as client:
                first = "other-caller-chosen" if name == "x-tenant-id" else "s-1"
                headers = [("x-tenant-id", "acme"), (name, first), (name, "acme-from-proxy")]
                if name == "x-tenant-id":
                    headers = [(name, "other"), (name, "acme")]  # the caller's first
                response = await client.get("/v1/chat", headers=headers)
                assert response.status_code == 400, response.text
                error = response.json()["error"]
                assert error["code"] == "bad_request"
                assert error["rule"] == "identity_header"
                assert name in error["message"]
                assert "acme" not in error["message"] and "other" not in error["message"]
                assert up.count == 0  # nothing sent upstream
        finally:
            await gateway.aclose()


@pytest.mark.parametrize("spelling", ["x_tenant_id", "X_Tenant-Id"])
async def test_an_identity_header_in_its_underscore_spelling_is_the_same_field(
    spelling: str,
) -> None:
    # A WSGI-style upstream reads x_tenant_id and x-tenant-id as one field (both
    # HTTP_X_TENANT_ID, and it may keep either): a caller's underscore spelling beside the
    # proxy's field is the field sent twice. Alone, it names the tenant as the dash form.
    async with upstream(status_handler(200, b"answered")) as up:
        gateway = Gateway(host_app, config=config(up.url))
        try:
            async with client_for(gateway) as client:
                headers = [(spelling, "other"), ("x-tenant-id", "acme")]
                response = await client.get("/v1/chat", headers=headers)
                assert response.status_code == 400, response.text
                assert response.json()["error"]["rule"] == "identity_header"
                assert up.count == 0
                response = await client.get("/v1/chat", headers=[(spelling, "other")])
                assert response.status_code == 200, response.text
                assert response.headers["x-gateway-route"] == "other-chat"
        finally:
            await gateway.aclose()


async def test_an_identity_header_sent_twice_with_one_value_is_one() -> None:
    async with upstream(status_handler(200, b"answered")) as up:
        gateway = Gateway(host_app, config=config(up.url))
        try:
            async with client_for(gateway) as client:
                headers = [("x-tenant-id", "acme"), ("X-Tenant-Id", " acme ")]
                response = await client.get("/v1/chat", headers=headers)
                assert response.status_code == 200, response.text
                assert response.headers["x-gateway-route"] == "acme-chat"
        finally:
            await gateway.aclose()


async def test_an_unrouted_request_with_two_tenants_goes_to_the_host_app() -> None:
    async with upstream(status_handler(200, b"answered")) as up:
        gateway = Gateway(host_app, config=config(up.url))
        try:
            async with client_for(gateway) as client:
                headers = [("x-tenant-id", "acme"), ("x-tenant-id", "other")]
                response = await client.get("/elsewhere", headers=headers)
                assert (response.status_code, response.text) == (404, "host app")
        finally:
            await gateway.aclose()


@pytest.mark.parametrize("space", ["\u00a0", "\u2003", "\u3000", "\u0085", "\u200b"])
async def test_a_tenant_with_unicode_space_around_it_is_not_that_tenant(space: str) -> None:
    # Only SP and HTAB surround a field value (RFC 9110 §5.5): the upstream, and a proxy in
    # front that refuses callers naming "acme", read "acme\u00a0" as another tenant, while
    # the gateway trimmed it (str.strip) to "acme": its routes, credentials and budget.
    async with upstream(status_handler(200, b"answered")) as up:
        gateway = Gateway(host_app, config=config(up.url))
        try:
            async with client_for(gateway) as client:
                for value in (f"acme{space}", f"{space}acme"):
                    headers = [("x-tenant-id", value.encode())]
                    response = await client.get("/v1/chat", headers=headers)
                    assert (response.status_code, response.text) == (404, "host app")
                # SP and HTAB are not part of the value: still acme.
                response = await client.get("/v1/chat", headers=[("x-tenant-id", " acme\t")])
                assert response.headers["x-gateway-route"] == "acme-chat"
                # A field sent twice, once with the space, is two different values.
                headers = [("x-tenant-id", b"acme"), ("x-tenant-id", f"acme{space}".encode())]
                response = await client.get("/v1/chat", headers=headers)
                assert response.status_code == 400, response.text
                assert response.json()["error"]["rule"] == "identity_header"
            assert up.count == 1
        finally:
            await gateway.aclose()


@pytest.mark.parametrize("name", ["x-tenant-id", "x-session-id"])
async def test_an_identity_header_joined_by_a_comma_is_the_field_twice(name: str) -> None:
    # A hop that joins repeated fields into one (RFC 9110 §5.3 lets it; Node's http does)
    # turns the caller's field and a proxy's appended one into "caller, proxy": the caller
    # then chose a tenant no route names, so the any-tenant route and its budget.
    async with upstream(status_handler(200, b"answered")) as up:
        gateway = Gateway(host_app, config=config(up.url))
        try:
            async with client_for(gateway) as client:
                headers = {"x-tenant-id": "acme", name: "caller-chosen, acme-from-proxy"}
                if name == "x-tenant-id":
                    headers = {name: "other, acme"}
                response = await client.get("/v1/chat", headers=headers)
                assert response.status_code == 400, response.text
                error = response.json()["error"]
                assert error["rule"] == "identity_header"
                assert "acme" not in error["message"] and "other" not in error["message"]
                assert up.count == 0
                # The same value twice is one; an empty member is nothing (RFC 9110 §5.6.1).
                response = await client.get("/v1/chat", headers={"x-tenant-id": "acme, acme,"})
                assert response.status_code == 200, response.text
                assert response.headers["x-gateway-route"] == "acme-chat"
        finally:
            await gateway.aclose()


def test_a_route_tenant_with_a_comma_is_refused_at_load() -> None:
    # It could never match: a tenant header holding a comma is two values.
    conf = config("http://127.0.0.1:9")
    conf["routes"][0]["tenant"] = "acme,other"
    with pytest.raises(ConfigError, match="no comma"):
        load_config(conf)
