"""The proxy a platform team puts in front of the gateway (nginx, Apache, lighttpd, Envoy)
obeys fields in the answers it gets from the gateway: nginx serves the internal location
an `X-Accel-Redirect` names, Apache's and lighttpd's `X-Sendfile` a file from their disk,
Envoy marks the host failed on `x-envoy-immediate-health-check-fail`. Those are the
gateway's to say, never an upstream's: relayed, an LLM provider (or whatever answers at
its address) read the front proxy's internal locations and files through it. And the
gateway's own `X-Accel-Buffering: no` on an event stream, so nginx's default buffering
does not hold a stream's events back until it ends (docs/operations.md)."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp import web

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


def _streaming(content_type: str, first: bytes, last: bytes) -> Any:
    async def handle(request: web.Request) -> web.StreamResponse:
        answer = web.StreamResponse(
            headers={"content-type": content_type, "x-accel-buffering": "yes"}
        )
        await answer.prepare(request)
        await answer.write(first)
        await answer.write(last)
        await answer.write_eof()
        return answer

    return handle


STREAMS = {
    # OpenAI's, Anthropic's and every SSE API's streams
    "sse": ("text/event-stream; charset=utf-8", b"data: 1\n\n", b"data: [DONE]\n\n"),
    # Ollama's /api/chat and /api/generate stream one JSON object a line
    "ndjson": ("application/x-ndjson", b'{"done": false}\n', b'{"done": true}\n'),
    "jsonl": ("application/jsonl", b'{"n": 1}\n', b'{"n": 2}\n'),
    # Amazon Bedrock's InvokeModelWithResponseStream / ConverseStream
    "bedrock": ("application/vnd.amazon.eventstream", b"\x00\x00", b"\x00\x01"),
}


@pytest.mark.parametrize("kind", list(STREAMS))
async def test_a_stream_tells_nginx_not_to_buffer_it(kind: str) -> None:
    content_type, first, last = STREAMS[kind]
    async with (
        upstream(_streaming(content_type, first, last)) as up,
        upstream(status_handler(200, b"{}", **{"content-type": "application/json"})) as plain,
    ):
        conf = _conf(up.url, key=False)
        conf["upstreams"]["plain"] = {"url": plain.url}
        conf["routes"].append({"id": "plain", "prefix": "/plain/", "plan": ["plain"]})
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as http:
                stream = await http.post("/v1/chat/completions", json={"stream": True})
                other = await http.get("/plain/x")
        finally:
            await gateway.aclose()
    assert stream.status_code == 200
    assert stream.content == first + last
    # The gateway's own, once: the upstream's `yes` is not relayed beside it.
    assert stream.headers.get_list("x-accel-buffering") == ["no"]
    assert other.status_code == 200
    assert "x-accel-buffering" not in other.headers  # other answers nginx may buffer


# What the proxies platform teams put in front add about the caller, beyond the
# `X-Forwarded-*` / `Forwarded` / `X-Real-IP` family: ingress-nginx's scheme fields and its
# copy of the caller's own `X-Forwarded-For`, Traefik's and Apache's proxy host name,
# Envoy's trusted client address, Fastly's, the scheme flags Rack and Rails read, and the
# `Client-IP` Rails' RemoteIp and Rack read as the client's address.
PLATFORM_PROXY_FIELDS = {
    "X-Scheme": "https",
    "X-Forwarded-Scheme": "https",
    "X-Original-Forwarded-For": "203.0.113.9",
    "X-Forwarded-Server": "ingress-7f9c.internal",
    "X-Envoy-External-Address": "203.0.113.9",
    "Fastly-Client-IP": "203.0.113.9",
    "X-Cluster-Client-IP": "203.0.113.9",
    "Client-IP": "203.0.113.9",
    "X-Forwarded-Ssl": "on",
    "Front-End-Https": "on",
}


async def test_what_a_platform_proxy_says_about_the_caller_reaches_no_upstream() -> None:
    """An upstream trusting the gateway as its proxy read these as the caller's address,
    host or scheme (a caller could forge them; the platform's proxy sets them about its
    caller, and the provider got the end user's address): stripped by default, as the
    `X-Forwarded-*` family is."""
    async with upstream(status_handler(200, b"{}")) as up:
        gateway = Gateway(host_app, config=_conf(up.url, key=False))
        try:
            async with client_for(gateway) as http:
                response = await http.get(
                    "/v1/models", headers={**PLATFORM_PROXY_FIELDS, "X-Request-Id": "r-1"}
                )
        finally:
            await gateway.aclose()
    assert response.status_code == 200
    (received,) = up.received
    names = {name.lower() for name, _ in received.headers}
    assert "x-request-id" in names  # the rest goes on as before
    assert not names & {name.lower() for name in PLATFORM_PROXY_FIELDS}, names
