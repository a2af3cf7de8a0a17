"""Local upstream servers on real 127.0.0.1 sockets, recording what they receive."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class Received:
    method: str
    path: str
    query: str
    headers: list[tuple[str, str]]
    body: bytes


@dataclass
class Upstream:
    url: str
    received: list[Received] = field(default_factory=list)
    connections_closed: int = 0

    @property
    def count(self) -> int:
        return len(self.received)


def status_handler(status: int, body: bytes = b"", delay: float = 0.0, **headers: str) -> Handler:
    async def handle(request: web.Request) -> web.StreamResponse:
        if delay:
            await asyncio.sleep(delay)
        return web.Response(status=status, body=body or f"status {status}".encode(), headers=headers)

    return handle


@asynccontextmanager
async def upstream(handler: Handler) -> AsyncIterator[Upstream]:
    state = Upstream(url="")

    async def record(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        state.received.append(
            Received(
                method=request.method,
                path=request.raw_path.split("?", 1)[0],
                query=request.query_string,
                headers=[(k.lower(), v) for k, v in request.raw_headers_str()]
                if hasattr(request, "raw_headers_str")
                else [(k.decode().lower(), v.decode()) for k, v in request.raw_headers],
                body=body,
            )
        )
        return await handler(request)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", record)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    state.url = f"http://127.0.0.1:{port}"
    try:
        yield state
    finally:
        await runner.cleanup()
