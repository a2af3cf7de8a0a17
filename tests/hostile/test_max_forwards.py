"""`Max-Forwards` (RFC 9110 §7.6.2): an OPTIONS or TRACE at 0 is answered by the gateway as
its final recipient, never forwarded with the gateway's credential; above 0 it goes on one
lower. Any other method forwards the field as it came."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from tests.helpers import documented_rules, gateway_client
from tests.upstreams import status_handler, upstream

pytestmark = pytest.mark.anyio

ENV = {"PRIMARY_KEY": "sk-primary-max-forwards-0001"}


def conf(url: str, **route: Any) -> dict[str, Any]:
    return {
        "upstreams": {"primary": {"url": url, "auth_env": "PRIMARY_KEY"}},
        "routes": [{"id": "api", "prefix": "/v1/", "plan": ["primary"], **route}],
    }


def forwarded(headers: list[tuple[str, str]]) -> list[str]:
    return [value for name, value in headers if name == "max-forwards"]


async def test_an_options_at_zero_is_answered_by_the_gateway() -> None:
    async with (
        upstream(status_handler(204)) as p,
        gateway_client(conf(p.url), environ=ENV) as client,
    ):
        response = await client.options("/v1/models", headers={"max-forwards": "0"})
    assert response.status_code == 200
    assert response.headers["allow"] == "GET, HEAD, OPTIONS, POST, PUT, PATCH, DELETE"
    assert response.headers["x-gateway-route"] == "api"
    assert response.headers["x-gateway-attempts"] == "0"
    assert response.content == b""
    assert p.count == 0  # never sent on, with the gateway's key or otherwise


async def test_the_max_forwards_rule_is_one_the_rule_table_explains(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The request log line of an OPTIONS answered here at Max-Forwards: 0 says
    rule=max_forwards (why no attempt ran): docs/failover.md's rule table had no row."""
    caplog.set_level(logging.INFO, logger="fallback_mw.request")
    async with (
        upstream(status_handler(204)) as p,
        gateway_client(conf(p.url), environ=ENV) as client,
    ):
        response = await client.options("/v1/models", headers={"max-forwards": "0"})
    assert response.status_code == 200
    lines = [r.getMessage() for r in caplog.records if r.name == "fallback_mw.request"]
    assert len(lines) == 1 and "rule=max_forwards" in lines[0], lines
    assert "max_forwards" in documented_rules()


async def test_an_options_above_zero_goes_on_one_lower() -> None:
    async with (
        upstream(status_handler(204)) as p,
        gateway_client(conf(p.url), environ=ENV) as client,
    ):
        response = await client.options("/v1/models", headers={"max-forwards": "3"})
    assert response.status_code == 204
    assert forwarded(p.received[0].headers) == ["2"]


@pytest.mark.parametrize(
    ("method", "value"), [("GET", "0"), ("POST", "0"), ("OPTIONS", "x"), ("OPTIONS", "-1")]
)
async def test_other_methods_and_unreadable_values_forward_it_as_it_came(
    method: str, value: str
) -> None:
    async with (
        upstream(status_handler(200)) as p,
        gateway_client(conf(p.url), environ=ENV) as client,
    ):
        response = await client.request(method, "/v1/models", headers={"max-forwards": value})
    assert response.status_code == 200
    assert forwarded(p.received[0].headers) == [value]


async def test_a_trace_at_zero_echoes_the_request_without_credentials() -> None:
    async with (
        upstream(status_handler(200)) as p,
        gateway_client(conf(p.url, methods=["GET", "TRACE"]), environ=ENV) as client,
    ):
        response = await client.request(
            "TRACE",
            "/v1/models?page=2",
            headers={"max-forwards": "0", "authorization": "Bearer sk-caller-secret-42",
                     "x-trace-me": "yes"},
        )  # fmt: skip
    assert response.status_code == 200
    assert response.headers["content-type"] == "message/http"
    assert response.content.startswith(b"TRACE /v1/models?page=2 HTTP/1.1\r\n")
    assert b"x-trace-me: yes\r\n" in response.content
    assert b"sk-caller-secret-42" not in response.content
    assert b"sk-primary" not in response.content
    assert p.count == 0


@pytest.mark.parametrize("value", ["00000000000", "0" * 64, "000000000001"])
async def test_leading_zeros_are_the_same_count(value: str) -> None:
    # `Max-Forwards` is 1*DIGIT (RFC 9110 §7.6.2): `00000000000` is 0, and the next hop
    # reads it so. Eleven digits or more were forwarded as they came (no count a chain
    # of proxies reaches), so a caller padding a 0 reached the upstream with the
    # gateway's credential, the upstream answering as the final recipient.
    async with (
        upstream(status_handler(204)) as p,
        gateway_client(conf(p.url), environ=ENV) as client,
    ):
        response = await client.options("/v1/models", headers={"max-forwards": value})
    if value.strip("0"):
        assert response.status_code == 204
        assert forwarded(p.received[0].headers) == ["0"]
    else:
        assert response.status_code == 200
        assert response.headers["x-gateway-attempts"] == "0"
        assert p.count == 0
