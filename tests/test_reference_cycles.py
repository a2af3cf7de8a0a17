"""A served request leaves no reference cycle of the gateway's own objects: each cycle is
freed only by the garbage collector, whose traversals cost every request (a lambda over the
walk, held by the walk's own attempt lifecycle, cost 4 % more instructions per request in
benchmarks/instructions.py). Counted with the collector switched off, then asked."""

from __future__ import annotations

import gc
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest

from fallback_mw import Gateway
from tests.helpers import client_for
from tests.test_budget_guard import json_handler
from tests.upstreams import host_app, serve_asgi, upstream

pytestmark = pytest.mark.anyio

REQUESTS = 20
ANSWER = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5}}


@pytest.fixture
def collector_off() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def gateway_garbage() -> Counter[str]:
    """The gateway's objects only a collection frees, counted by type (kept in gc.garbage
    to be named)."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    gc.collect()
    gc.set_debug(0)
    found = Counter(
        f"{type(o).__module__}.{type(o).__qualname__}"
        for o in gc.garbage
        if type(o).__module__.startswith("fallback_mw.")
    )
    gc.garbage.clear()
    return found


@pytest.mark.usefixtures("collector_off")
@pytest.mark.parametrize("tpm", [None, 100_000])
async def test_served_requests_leave_no_cycle_of_the_gateways_objects(tpm: int | None) -> None:
    async with upstream(json_handler(ANSWER)) as primary:
        conf = {
            "gateway": {"allow_hosts": ["127.0.0.1"]},
            "upstreams": {"primary": {"url": primary.url, **({"tpm": tpm} if tpm else {})}},
            "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"]}],
        }
        gateway = Gateway(host_app, config=conf)
        try:
            async with client_for(gateway) as client:
                body = {"model": "m", "max_tokens": 5, "messages": []}
                for _ in range(3):  # the first builds what every request then reuses
                    assert (await client.post("/v1/chat", json=body)).status_code == 200
                gateway_garbage()
                for _ in range(REQUESTS):
                    assert (await client.post("/v1/chat", json=body)).status_code == 200
                left = gateway_garbage()
        finally:
            await gateway.aclose()
    # A cycle per request leaves each of its objects once per request; an object the run
    # before this test left to the collector (the timer wheel of an earlier test's loop)
    # may turn up once, and is not this test's subject.
    assert [name for name, count in left.items() if count >= REQUESTS] == [], left


@pytest.mark.usefixtures("collector_off")
@pytest.mark.parametrize("http", ["httptools", "h11"])
async def test_a_body_read_after_its_head_leaves_no_cycle_under_serves_protocol(
    http: str,
) -> None:
    """`serve`'s guarded protocol wraps the transport of a request whose body was still to
    come when its head was read (every large body): the wrapper held the request cycle,
    which holds the wrapper, so each such request's scope, context and body (the bytes and
    the body parsed as JSON, many times their size) waited for the cyclic collector, which
    serve runs rarely. 60 sequential 1 MiB JSON POSTs grew `serve` to 1.5 GB."""
    from fallback_mw.cli.server_limits import uvicorn_limits
    from fallback_mw.config import load_config

    settings = load_config({}).gateway
    async with upstream(json_handler(ANSWER)) as primary:
        conf = {
            "gateway": {"allow_hosts": ["127.0.0.1"]},
            "upstreams": {"primary": {"url": primary.url}},
            "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary"]}],
        }
        gateway = Gateway(host_app, config=conf)
        body = b'{"model":"m","messages":[' + b",".join([b"{}"] * 200_000) + b"]}"
        try:
            async with (
                serve_asgi(gateway, **uvicorn_limits(settings, http)) as base,
                httpx.AsyncClient(base_url=base) as client,
            ):
                for _ in range(2):
                    assert (await client.post("/v1/chat", content=body)).status_code == 200
                gateway_garbage()
                for _ in range(REQUESTS):
                    assert (await client.post("/v1/chat", content=body)).status_code == 200
                left = gateway_garbage()
        finally:
            await gateway.aclose()
    assert [name for name, count in left.items() if count >= REQUESTS] == [], left
