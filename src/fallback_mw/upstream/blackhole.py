"""The `blackhole` fault's far end (SPEC §12): one loopback listener per gateway process,
started on first use, that accepts connections, reads whatever arrives and never writes a
byte. An attempt under the fault is sent there instead of to its upstream, by a real
engine of the gateway's kind, so the engine's own first-byte timeout is what ends it —
the path a silently dropped upstream takes, which the in-process `hang` never exercises.

The allowlist (allow_hosts) is not consulted for this one destination (the client kept
here has none; its guard refuses the link-local / metadata addresses alone): the attempt
runner alone builds its URL, from this listener's own address, and sends it with that
client, which is never handed any other URL."""

from __future__ import annotations

import asyncio
import contextlib

from fallback_mw.upstream import make_client
from fallback_mw.upstream.base import UpstreamClient


class Blackhole:
    def __init__(self, engine: str = "aiohttp") -> None:
        self._engine = engine
        self._server: asyncio.Server | None = None
        self._client: UpstreamClient | None = None
        self._lock: asyncio.Lock | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.connections = 0  # accepted so far (tests and the report read it)

    async def _swallow(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(writer)
        try:
            while await reader.read(65536):
                pass  # read and drop, so a request body never blocks on a full window
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    async def open(self) -> tuple[str, UpstreamClient]:
        """The listener's base URL (`http://127.0.0.1:PORT`) and the client that may
        reach it; started on the first call."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._server is None:
                self._server = await asyncio.start_server(self._swallow, "127.0.0.1", 0)
            if self._client is None:
                self._client = make_client(self._engine)  # no allow_hosts: see above
        port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}", self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        if self._server is not None:
            self._server.close()
            for writer in list(self._writers):
                writer.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None
