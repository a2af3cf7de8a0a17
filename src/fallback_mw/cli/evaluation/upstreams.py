"""The evaluation's scripted upstreams on loopback: one that answers (embedding the request's
nonce and recording a digest of every body it received and sent), one that fails with a
fast 503, and one that accepts connections and never answers."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Literal

from aiohttp import web

Behaviour = Literal["ok", "fail", "hang"]
# A response long enough to cross several socket reads, so truncation or cross-talk shows.
_FILLER_BLOCKS = 32


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def answer_body(name: str, nonce: str) -> bytes:
    """What an answering upstream sends for `nonce`: an OpenAI-shaped completion whose
    content is derived from the nonce, so no two requests share a body."""
    seed = hashlib.sha256(f"{name}:{nonce}".encode()).hexdigest()
    content = " ".join(
        hashlib.sha256(f"{seed}:{i}".encode()).hexdigest() for i in range(_FILLER_BLOCKS)
    )
    payload = {
        "id": nonce,
        "object": "chat.completion",
        "model": "eval",
        "provider": name,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}}],
        "usage": {"prompt_tokens": 8, "completion_tokens": _FILLER_BLOCKS * 16},
    }
    return json.dumps(payload, separators=(",", ":")).encode()


@dataclass
class Exchange:
    """One request as the upstream saw it: digests only, never the bodies themselves."""

    received: str
    sent: str | None = None


@dataclass
class ScriptedUpstream:
    name: str
    behaviour: Behaviour
    url: str = ""
    requests: int = 0
    exchanges: dict[str, Exchange] = field(default_factory=dict)  # by nonce


def _nonce(body: bytes) -> str | None:
    try:
        data = json.loads(body)
        value = data["metadata"]["nonce"]
    except (ValueError, KeyError, TypeError):
        return None
    return value if isinstance(value, str) else None


@asynccontextmanager
async def scripted_upstream(name: str, behaviour: Behaviour) -> AsyncIterator[ScriptedUpstream]:
    state = ScriptedUpstream(name=name, behaviour=behaviour)
    if behaviour == "hang":
        async with _hanging(state):
            yield state
        return

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        state.requests += 1
        nonce = _nonce(body)
        if behaviour == "fail":
            return web.json_response({"error": f"{name} is failing"}, status=503)
        if nonce is None:
            return web.json_response({"error": "no metadata.nonce"}, status=400)
        answer = answer_body(name, nonce)
        state.exchanges[nonce] = Exchange(received=digest(body), sent=digest(answer))
        return web.Response(body=answer, content_type="application/json")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server = site._server
    assert server is not None
    port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
    state.url = f"http://127.0.0.1:{port}"
    try:
        yield state
    finally:
        await runner.cleanup()


@asynccontextmanager
async def _hanging(state: ScriptedUpstream) -> AsyncIterator[None]:
    """Accepts, reads request heads (counting them), never writes a byte."""
    writers: set[asyncio.StreamWriter] = set()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.add(writer)
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                state.requests += 1
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            writers.discard(writer)
            writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    state.url = f"http://127.0.0.1:{port}"
    try:
        yield None
    finally:
        server.close()
        for writer in list(writers):
            writer.close()
        with contextlib.suppress(Exception):
            await server.wait_closed()
