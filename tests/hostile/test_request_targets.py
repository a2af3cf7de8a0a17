"""Request targets that are not a plain path (RFC 9112 §3.2): the absolute form, the
asterisk form and a fragment. uvicorn and granian hand the app the path of an
absolute-form target and drop a fragment; hypercorn and daphne pass both on in
`path` / `raw_path`. The gateway routes and forwards the same path whichever server it
runs under."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from fallback_mw import Gateway
from fallback_mw.cli.ports import free_port
from tests.hostile.test_hygiene import exchange
from tests.upstreams import host_app, status_handler, upstream


@asynccontextmanager
async def serve_hypercorn(app: Any) -> AsyncIterator[str]:
    """`app` under hypercorn (HTTP/1.1) on a real 127.0.0.1 socket, in this event loop."""
    from hypercorn.asyncio import serve
    from hypercorn.config import Config

    port = free_port()
    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.loglevel = "WARNING"
    stop = asyncio.Event()
    task = asyncio.create_task(serve(app, config, shutdown_trigger=stop.wait))  # type: ignore[arg-type]
    for _ in range(500):
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.01)
            continue
        writer.close()
        break
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop.set()
        await task


def _conf(url: str, prefix: str) -> dict[str, Any]:
    return {
        "upstreams": {"u": {"url": url}},
        "routes": [{"id": "r", "prefix": prefix, "plan": ["u"]}],
    }


@pytest.mark.anyio
@pytest.mark.parametrize("prefix", ["/v1/", "/"])
@pytest.mark.parametrize(
    ("target", "forwarded"),
    [
        ("http://169.254.169.254/v1/chat?x=1", "/v1/chat"),
        ("HTTPS://api.example.com:8443/v1/chat", "/v1/chat"),
        ("/v1/chat#/../../admin", "/v1/chat"),
        ("/v1/chat#frag", "/v1/chat"),
        ("/v1/a%23b", "/v1/a%23b"),  # an encoded `#` is part of the segment's name
    ],
)
async def test_a_target_is_routed_and_forwarded_on_its_path_under_hypercorn(
    prefix: str, target: str, forwarded: str
) -> None:
    """hypercorn passes an absolute-form target and a fragment on in the path: the
    absolute form missed the /v1/ route (the host app answered) and a `/` route forwarded
    `/http:/169.254.169.254/v1/chat`; `/v1/chat#frag` went out as `/v1/chat%23frag`."""
    async with upstream(status_handler(200, b"served")) as up:
        gateway = Gateway(host_app, config=_conf(up.url, prefix))
        try:
            async with serve_hypercorn(gateway) as base:
                request = f"GET {target} HTTP/1.1\r\nhost: gw\r\nconnection: close\r\n\r\n"
                data = await exchange(base, request.encode())
        finally:
            await gateway.aclose()
    assert data.startswith(b"HTTP/1.1 200"), data[:300]
    assert [r.path for r in up.received] == [forwarded]


@pytest.mark.anyio
async def test_options_asterisk_reaches_no_upstream_even_under_a_root_route() -> None:
    """`OPTIONS *` asks about the server, not a resource: the host app answers it. A `/`
    route forwarded it as `OPTIONS /*`, with the provider's credential."""
    async with upstream(status_handler(200, b"served")) as up:
        gateway = Gateway(host_app, config=_conf(up.url, "/"))
        try:
            async with serve_hypercorn(gateway) as base:
                request = b"OPTIONS * HTTP/1.1\r\nhost: gw\r\nconnection: close\r\n\r\n"
                data = await exchange(base, request)
        finally:
            await gateway.aclose()
    assert data.startswith(b"HTTP/1.1 404"), data[:300]
    assert b"host app" in data
    assert up.count == 0
