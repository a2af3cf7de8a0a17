"""Local upstream servers on real 127.0.0.1 sockets, recording what they receive."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field

from aiohttp import web

from fallback_mw.cli.ports import free_port
from fallback_mw.request.types import Receive, Scope, Send

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
        text = body or f"status {status}".encode()
        return web.Response(status=status, body=text, headers=headers)

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
                headers=[(k.decode().lower(), v.decode()) for k, v in request.raw_headers],
                body=body,
            )
        )
        return await handler(request)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", record)
    runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    state.url = f"http://127.0.0.1:{port}"
    try:
        yield state
    finally:
        await runner.cleanup()


@asynccontextmanager
async def serve_asgi(app: object, **options: object) -> AsyncIterator[str]:
    """Run an ASGI app on a real 127.0.0.1 socket with uvicorn, in this event loop."""
    import uvicorn

    settings: dict[str, object] = {
        "host": "127.0.0.1",
        "port": 0,
        "log_level": "warning",
        "lifespan": "off",
        "loop": "asyncio",
        "http": "h11",
        **options,
    }
    config = uvicorn.Config(app, **settings)  # type: ignore[arg-type]
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


def serve_asgi_ws(app: object) -> AbstractAsyncContextManager[str]:
    """serve_asgi with uvicorn's websockets implementation switched on."""
    return serve_asgi(app, ws="websockets-sansio")


@asynccontextmanager
async def silent_server() -> AsyncIterator[tuple[str, list[int]]]:
    """Accepts connections and never answers (a hanging upstream). Yields (url, accepted)."""
    accepted: list[int] = []
    writers: list[asyncio.StreamWriter] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        writers.append(writer)

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", accepted
    finally:
        for writer in writers:
            writer.close()
        server.close()
        await server.wait_closed()


def closed_port_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


async def host_app(scope: Scope, receive: Receive, send: Send) -> None:
    """A bare host app: plain 404 with a marker body."""
    assert scope["type"] == "http"
    await send({"type": "http.response.start", "status": 404, "headers": []})
    await send({"type": "http.response.body", "body": b"host app"})
