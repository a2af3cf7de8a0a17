"""The proxy a platform team puts in front of the gateway (nginx, Apache, lighttpd, Envoy)
obeys fields in the answers it gets from the gateway: nginx serves the internal location
an `X-Accel-Redirect` names, Apache's and lighttpd's `X-Sendfile` a file from their disk,
Envoy marks the host failed on `x-envoy-immediate-health-check-fail`. Those are the
gateway's to say, never an upstream's: relayed, an LLM provider (or whatever answers at
its address) read the front proxy's internal locations and files through it."""

from __future__ import annotations

from typing import Any

import pytest

from fallback_mw import Gateway
from tests.helpers import client_for
from tests.upstreams import host_app, status_handler, upstream

pytestmark = pytest.mark.anyio

FRONT_PROXY_FIELDS = {
    "X-Accel-Redirect": "/internal/secrets.txt",
    "X-Accel-Buffering": "yes",
    "X-Accel-Limit-Rate": "1",
    "X-Accel-Expires": "86400",
    "X-Accel-Charset": "utf-7",
    "X-Sendfile": "/etc/shadow",
    "X-Sendfile2": "/etc/shadow 0-",
    "X-LIGHTTPD-send-file": "/etc/shadow",
    "X_Accel_Redirect": "/internal/other.txt",
    "x-envoy-immediate-health-check-fail": "true",
    "x-envoy-degraded": "true",
}


def _conf(url: str, *, key: bool) -> dict[str, Any]:
    upstream_conf: dict[str, Any] = {"url": url}
    if key:
        upstream_conf["auth_env"] = "FRONT_PROXY_TEST_KEY"
    return {
        "gateway": {"allow_hosts": ["127.0.0.1"]},
        "upstreams": {"primary": upstream_conf},
        "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"]}],
    }


@pytest.mark.parametrize("key", [False, True], ids=["no-credential", "injected"])
async def test_an_upstream_cannot_instruct_the_proxy_in_front(
    key: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FRONT_PROXY_TEST_KEY", "sk-front-proxy-test-0123456789")
    handler = status_handler(200, b"{}", **{"x-request-id": "req-1", **FRONT_PROXY_FIELDS})
    async with upstream(handler) as up:
        gateway = Gateway(host_app, config=_conf(up.url, key=key))
        try:
            async with client_for(gateway) as http:
                response = await http.get("/v1/models")
        finally:
            await gateway.aclose()
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "req-1"  # the rest is relayed as before
    relayed = {name.lower().replace("_", "-") for name in response.headers}
    for name in FRONT_PROXY_FIELDS:
        assert name.lower().replace("_", "-") not in relayed, (name, response.headers)
