"""A caller that hangs up while its attempt waits on the upstream, on real sockets: under
serve's protocol (cli/server_limits.py, h11 and httptools) the server tells the walker of
the lost connection itself (request/connection_loss.py), so the attempt is cancelled and
the request is the caller's `client_disconnected` with no watcher task reading `receive`;
under any other server (plain uvicorn here) the watcher task does the same."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any
from urllib.parse import urlsplit

import pytest
from aiohttp import web

from fallback_mw import Gateway
from fallback_mw.cli.server_limits import uvicorn_limits
from fallback_mw.config import load_config
from tests.upstreams import host_app, serve_asgi, upstream

pytestmark = pytest.mark.anyio

BODY = b'{"model":"m","messages":[]}'


async def served_and_hung_up(
    http: str, guarded: bool, caplog: pytest.LogCaptureFixture
) -> tuple[list[str], list[str]]:
    """A request whose upstream never answers, its caller gone once the upstream has it.
    Returns the request log lines and the names of the tasks started meanwhile."""
    arrived, cancelled = asyncio.Event(), asyncio.Event()

    async def hang(request: web.Request) -> web.StreamResponse:
        arrived.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()  # the gateway closed its upstream connection: attempt cancelled
            raise
        raise AssertionError("never answered")

    loop = asyncio.get_running_loop()
    started: list[str] = []

    def factory(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any], **kw: Any) -> Any:
        started.append(getattr(coro, "__qualname__", None) or type(coro).__name__)
        return asyncio.Task(coro, loop=loop, **kw)

    async with upstream(hang) as primary:
        conf = {
            "gateway": {"allow_hosts": ["127.0.0.1"]},
            "upstreams": {"primary": {"url": primary.url, "first_byte_timeout_ms": 60_000}},
            "routes": [{"id": "r", "prefix": "/v1/", "plan": ["primary"]}],
        }
        gateway = Gateway(host_app, config=conf)
        options = uvicorn_limits(load_config(conf).gateway, http) if guarded else {"http": http}
        try:
            with caplog.at_level(logging.INFO, logger="fallback_mw.request"):
                async with serve_asgi(gateway, **options) as base:
                    address = urlsplit(base)
                    loop.set_task_factory(factory)  # before the walk: its watcher starts early
                    try:
                        _, writer = await asyncio.open_connection(address.hostname, address.port)
                        writer.write(
                            b"POST /v1/chat HTTP/1.1\r\nhost: gw\r\n"
                            b"content-type: application/json\r\n"
                            b"content-length: %d\r\n\r\n%s" % (len(BODY), BODY)
                        )
                        await asyncio.wait_for(arrived.wait(), 30)
                        writer.close()
                        await writer.wait_closed()
                        await asyncio.wait_for(cancelled.wait(), 30)
                        for _ in range(600):  # the gateway logs the request as it ends
                            if any(r.name == "fallback_mw.request" for r in caplog.records):
                                break
                            await asyncio.sleep(0.05)
                    finally:
                        loop.set_task_factory(None)
        finally:
            await gateway.aclose()
    lines = [r.getMessage() for r in caplog.records if r.name == "fallback_mw.request"]
    return lines, started


@pytest.mark.parametrize("http", ["h11", "httptools"])
async def test_under_serve_a_hang_up_cancels_the_attempt_without_a_watcher_task(
    http: str, caplog: pytest.LogCaptureFixture
) -> None:
    lines, started = await served_and_hung_up(http, True, caplog)
    assert len(lines) == 1, lines
    assert "outcome=client_disconnected" in lines[0], lines[0]
    assert not [name for name in started if "watch_disconnect" in name], started


@pytest.mark.parametrize("http", ["h11", "httptools"])
async def test_under_another_server_the_watcher_task_notices_the_hang_up(
    http: str, caplog: pytest.LogCaptureFixture
) -> None:
    lines, started = await served_and_hung_up(http, False, caplog)
    assert len(lines) == 1, lines
    assert "outcome=client_disconnected" in lines[0], lines[0]
    assert [name for name in started if "watch_disconnect" in name], started
