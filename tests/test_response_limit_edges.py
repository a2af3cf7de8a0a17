"""`max_response_body` at its edge (SPEC §5: a response that *exceeds* it): a body of
exactly the limit is served whole, one byte more is refused, whether its length is
declared (a local 502 before the commit point) or found as it streams (the response,
already started, is aborted: never ended as if complete). Hand-made mutants that moved
either comparison by one byte passed every test. Real sockets on both sides."""

from __future__ import annotations

import httpx
import pytest
from aiohttp import web

from fallback_mw import Gateway
from tests.upstreams import Handler, host_app, serve_asgi, upstream

pytestmark = pytest.mark.anyio

LIMIT = 1024


def answer(size: int, *, declared: bool) -> Handler:
    async def handle(request: web.Request) -> web.StreamResponse:
        if declared:
            return web.Response(body=b"x" * size)
        response = web.StreamResponse()  # chunked: the length is found as it streams
        await response.prepare(request)
        for start in range(0, size, 256):
            await response.write(b"x" * min(256, size - start))
        await response.write_eof()
        return response

    return handle


@pytest.mark.parametrize("declared", [True, False], ids=["declared", "streamed"])
@pytest.mark.parametrize("size", [LIMIT, LIMIT + 1])
async def test_a_body_of_the_limit_is_served_one_byte_more_is_not(
    declared: bool, size: int
) -> None:
    async with upstream(answer(size, declared=declared)) as primary:
        conf = {
            "gateway": {"max_response_body": LIMIT},
            "upstreams": {"primary": {"url": primary.url}},
            "routes": [{"id": "r", "prefix": "/v1/", "plan": ["primary"]}],
        }
        gateway = Gateway(host_app, config=conf)
        try:
            async with serve_asgi(gateway) as url, httpx.AsyncClient(base_url=url) as client:
                if size == LIMIT:
                    response = await client.get("/v1/x")
                    assert (response.status_code, response.content) == (200, b"x" * LIMIT)
                elif declared:
                    response = await client.get("/v1/x")
                    assert response.status_code == 502
                    assert response.json()["error"]["code"] == "response_too_large"
                else:
                    with pytest.raises(httpx.RemoteProtocolError):
                        async with client.stream("GET", "/v1/x") as streamed:
                            assert streamed.status_code == 200  # committed: then aborted
                            async for _ in streamed.aiter_raw():
                                pass
        finally:
            await gateway.aclose()
