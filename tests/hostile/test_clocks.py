"""Time and clocks as a platform team meets them: durations at their limits, and the
windows, cool-downs and expiries that must not follow a wall-clock step (NTP, VM resume)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from fallback_mw.config import ConfigError, load_config
from tests.helpers import gateway_client
from tests.upstreams import status_handler, upstream

pytestmark = pytest.mark.anyio

THIRTY_ONE_DAYS_MS = 31 * 86_400_000


def timed(url: str, engine: str, *, upstream_ms: int, hedge_ms: int = 0) -> dict[str, Any]:
    timeouts = {
        key: upstream_ms
        for key in ("connect_timeout_ms", "first_byte_timeout_ms", "idle_timeout_ms")
    }
    return {
        "gateway": {"allow_hosts": ["127.0.0.1"], "engine": engine},
        "upstreams": {"p": {"url": url, **timeouts}, "b": {"url": url + "/b"}},
        "routes": [
            {"id": "chat", "prefix": "/v1/", "plan": ["p", "b"], "retries": 2,
             "hedge_after_ms": hedge_ms},
        ],
    }  # fmt: skip


@pytest.mark.parametrize(
    ("where", "key"),
    [
        ("upstreams.p", "connect_timeout_ms"),
        ("upstreams.p", "first_byte_timeout_ms"),
        ("upstreams.p", "idle_timeout_ms"),
        ("routes['chat']", "hedge_after_ms"),
    ],
)
async def test_a_timer_too_long_for_a_float_is_refused_at_load_naming_its_key(
    where: str, key: str
) -> None:
    # 1e400 ms loaded (`check` said valid) and every request then ended in a bare 500: the
    # conversion to seconds raised OverflowError on the request path.
    conf = timed("http://127.0.0.1:9", "aiohttp", upstream_ms=1000)
    section = conf["upstreams"]["p"] if where.startswith("upstreams") else conf["routes"][0]
    section[key] = 10**400
    with pytest.raises(ConfigError, match=re.escape(f"{where}.{key}: must be at most 2678400000")):
        load_config(conf)


@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
async def test_the_longest_timers_the_loader_takes_serve_on_both_engines(engine: str) -> None:
    async with upstream(status_handler(200, b"ok")) as up:
        conf = timed(up.url, engine, upstream_ms=THIRTY_ONE_DAYS_MS, hedge_ms=THIRTY_ONE_DAYS_MS)
        async with gateway_client(conf) as client:
            response = await client.get("/v1/x")
    assert response.status_code == 200, response.text
    assert response.text == "ok" and response.headers["x-gateway-provider"] == "p"
