"""A HEAD request the upstream refuses for the caller's own input, on a healthy aiohttp
upstream: a repeated singleton field (two `user-agent` lines, RFC 9110 §5.3; aiohttp's
parser refuses it, as it does `content-type`, `etag`, `content-location`, `max-forwards`)
or a field over the upstream's 8190-byte limit. The upstream answers 400 with its error
text as a body, on HEAD too; the engines read a body on a HEAD answer as contradictory
framing (SPEC §12: failover-class), and the upstream's breaker gets a failure mark; HEAD
is replayable by default, so the backup gets the same request and its mark too. Five such
HEADs from one caller opened both breakers: every other caller got 503 route_exhausted
(`x-gateway-skipped: primary;reason=breaker_open, backup;reason=breaker_open`) for the
cooldown. SPEC §5: one caller can never open a breaker for everyone else.

A field sent twice that may be sent once (RFC 9110 §5.3) is now the gateway's own 400, on
every method, before any upstream. A field over an upstream's own size limit is not
covered: the gateway cannot know each upstream's limit (docs/security.md)."""

from __future__ import annotations

from typing import Any

import pytest

from fallback_mw import Gateway
from fallback_mw.health.memory import MemoryHealth
from tests.helpers import client_for
from tests.upstreams import host_app, status_handler, upstream

pytestmark = pytest.mark.anyio

ENGINES = ["aiohttp", "httpx"]
CALLERS_HEADS = {
    "repeated-user-agent": [("user-agent", "a"), ("user-agent", "b")],
    "repeated-content-type": [("content-type", "a"), ("content-type", "b")],
    "repeated-etag-mixed-case": [("ETag", '"a"'), ("etag", '"b"')],
}


def config(primary: str, backup: str, engine: str) -> dict[str, Any]:
    return {
        "gateway": {"allow_hosts": ["127.0.0.1"], "engine": engine},
        "upstreams": {"primary": {"url": primary}, "backup": {"url": backup}},
        "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary", "backup"],
                    "retries": 1}],
    }  # fmt: skip


@pytest.mark.parametrize("headers", CALLERS_HEADS.values(), ids=CALLERS_HEADS.keys())
@pytest.mark.parametrize("engine", ENGINES)
async def test_a_head_the_upstream_refuses_for_the_callers_input_is_no_breaker_mark(
    engine: str, headers: list[tuple[str, str]]
) -> None:
    async with (
        upstream(status_handler(200, b"primary")) as primary,
        upstream(status_handler(200, b"backup")) as backup,
    ):
        gateway = Gateway(host_app, config=config(primary.url, backup.url, engine))
        try:
            async with client_for(gateway) as client:
                for _ in range(5):  # min_calls: five marks would open the breaker
                    answer = await client.request("HEAD", "/v1/x", headers=headers)
                    assert answer.status_code == 400
                    assert "x-gateway-provider" not in answer.headers  # the gateway's own
                health = gateway.services.health
                assert isinstance(health, MemoryHealth)
                assert 1 not in health.breaker("primary").outcomes
                # Another caller's plain request still goes to the primary.
                assert 1 not in health.breaker("backup").outcomes
                after = await client.get("/v1/x")
                assert after.status_code == 200
                assert after.headers["x-gateway-provider"] == "primary"
        finally:
            await gateway.aclose()


async def test_a_field_sent_twice_is_refused_naming_it_before_any_upstream() -> None:
    async with upstream(status_handler(200, b"primary")) as primary:
        conf = config(primary.url, primary.url, "aiohttp")
        conf["routes"][0]["plan"] = ["primary"]
        del conf["upstreams"]["backup"]
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                answer = await client.post(
                    "/v1/x",
                    content=b"{}",
                    headers=[("content-type", "application/json"), ("Content-Type", "text/x")],
                )
                error = answer.json()["error"]
                assert (answer.status_code, error["code"]) == (400, "bad_request")
                assert "'content-type'" in error["message"] and "twice" in error["message"]
                assert "text/x" not in error["message"]  # a value is never shown
                assert primary.count == 0
                # List fields may come twice (RFC 9110 §5.3): forwarded as they were.
                ok = await client.get("/v1/x", headers=[("accept", "a/b"), ("accept", "c/d")])
                assert ok.status_code == 200
        finally:
            await gateway.aclose()
