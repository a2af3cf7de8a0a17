"""A pool credential's 429 is judged by its body (OpenAI's `insufficient_quota`), and the
gateway itself asks upstreams for a compressed answer (every client library sends
`Accept-Encoding: gzip`, which reaches the upstream narrowed to gzip / deflate): a spent
quota said in a compressed body must retire the credential as one said in plain JSON,
on both engines."""

from __future__ import annotations

import gzip
import zlib

import pytest
from aiohttp import web

from fallback_mw.health.memory import MemoryHealth
from tests.test_credential_pool import (
    QUOTA_BODY,
    Clock,
    gateway_client,
    key_a_back_after,
    key_of,
    keys_used,
    two_keys,
)
from tests.upstreams import upstream

pytestmark = pytest.mark.anyio

CODINGS = {
    "gzip": gzip.compress,
    "deflate": zlib.compress,
    "gzip, gzip": lambda body: gzip.compress(gzip.compress(body)),
}


def spent_quota_compressed(coding: str) -> web.RequestHandler:
    async def handle(request: web.Request) -> web.StreamResponse:
        key = key_of(request)
        if key == "key-a":
            body = CODINGS[coding](QUOTA_BODY)
            headers = {"content-encoding": coding, "content-type": "application/json"}
            return web.Response(status=429, body=body, headers=headers)
        return web.Response(text=key)

    return handle


@pytest.mark.parametrize("engine", ["aiohttp", "httpx"])
@pytest.mark.parametrize("coding", list(CODINGS))
async def test_a_spent_quota_in_a_compressed_429_retires_the_credential(
    engine: str, coding: str
) -> None:
    # The peek parsed the coded bytes as JSON, found no verdict, and read the spent quota
    # as a plain rate limit: the credential came back after the default cool-down, to
    # answer 429 again, for as long as the quota stayed spent.
    clock = Clock()
    health = MemoryHealth(clock=clock)
    async with upstream(spent_quota_compressed(coding)) as pool:
        conf = two_keys(pool.url, quota_retire_ms=600_000)
        conf["gateway"]["engine"] = engine
        async with gateway_client(conf, health=health) as client:
            response = await client.get("/v1/x", headers={"accept-encoding": "gzip, deflate"})
            assert (response.status_code, response.text) == (200, "key-b")
            assert keys_used(pool) == ["key-a", "key-b"]
            clock.now += 595  # past any cool-down, within quota_retire_ms
            assert not await key_a_back_after(client, pool)
            clock.now += 10
            assert await key_a_back_after(client, pool)
