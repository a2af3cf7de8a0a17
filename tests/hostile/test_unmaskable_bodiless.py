"""An answer with no body cannot carry a key in its body: from an upstream the gateway
injected its credential into, one labelled with a coding the echo mask cannot read (`br`)
is relayed as it came when it is the answer to a HEAD or a 204 / 205 / 304
(`credentials.unmaskable_answer`), never failed over or refused as the upstream's
failure. Hand-made mutants that dropped the HEAD or the 205 from that rule passed every
test: a HEAD sizing a `br` download, or a 205 after a form reset, became a failover."""

from __future__ import annotations

import httpx
import pytest
from aiohttp import web

from fallback_mw import Gateway
from tests.hostile.test_credential_echo import ENGINES, SECRET, hostile_and_backup
from tests.upstreams import host_app, serve_asgi, status_handler, upstream

pytestmark = pytest.mark.anyio


async def bodiless_br(request: web.Request) -> web.StreamResponse:
    status = int(request.query.get("status", "200"))
    return web.Response(status=status, headers={"content-encoding": "br", "etag": '"v1"'})


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    ("method", "status"), [("HEAD", 200), ("GET", 204), ("GET", 205), ("GET", 304)]
)
async def test_a_bodiless_answer_in_a_coding_the_mask_cannot_read_is_relayed(
    engine: str, method: str, status: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ECHO_KEY", SECRET)
    async with upstream(bodiless_br) as hostile, upstream(status_handler(200, b"no")) as backup:
        gateway = Gateway(host_app, config=hostile_and_backup(hostile.url, backup.url, engine))
        try:
            async with serve_asgi(gateway) as base, httpx.AsyncClient(base_url=base) as client:
                response = await client.request(method, f"/a/x?status={status}")
        finally:
            await gateway.aclose()
    assert response.status_code == status
    assert response.headers["x-gateway-provider"] == "hostile"
    assert response.headers["x-gateway-attempts"] == "1"
    assert response.content == b""
    assert (hostile.count, backup.count) == (1, 0)
