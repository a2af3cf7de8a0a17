"""One TCP proxy for the tests that need a real service (Redis, PostgreSQL) to go away and
come back, or to hang, while the code under test keeps its address."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Literal

__all__ = ["TcpProxy", "tcp_proxy"]


class TcpProxy:
    """Forwards 127.0.0.1:`port` to (host, port) of the real service.

    - `cut(kill)` stops listening (new connections are refused) and kills every live one,
      by reset (`"abort"`: a host or process that died) or by close (`"close"`: a FIN, a
      server shutting down); `open()` listens again on the same port.
    - `pause()` holds every byte and every new connection (a hung server); `resume()`.
    - `mute()` drops every answer (the server does the work, its reply never comes back);
      `mute_once_sent(marker)` does so from the moment a request holding `marker` is sent
      (a `COMMIT` the server commits, whose answer is lost); `unmute()`.
    - `strand()` silences every live connection for good, both ways, without closing it (a
      path that died without a reset: a NAT or firewall that forgot the flow, a database
      moved to another host); new connections are served as before.
    """

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.port = 0
        self.server: asyncio.Server | None = None
        self.running = asyncio.Event()
        self.running.set()
        self.muted = False
        self.mute_marker: bytes | None = None
        self.transports: set[asyncio.BaseTransport] = set()
        self.stranded: set[asyncio.BaseTransport] = set()
        self.writers: set[asyncio.StreamWriter] = set()  # closed at aclose: stranded ones too
        self.tasks: set[asyncio.Task[None]] = set()

    async def open(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = self.server.sockets[0].getsockname()[1]

    async def cut(self, kill: Literal["abort", "close"] = "abort") -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        for transport in self.transports:
            if kill == "abort":
                transport.abort()  # type: ignore[attr-defined]
            else:
                transport.close()
        self.transports.clear()
        await asyncio.sleep(0.05)  # the resets and FINs reach the other end's sockets

    def pause(self) -> None:
        self.running.clear()

    def resume(self) -> None:
        self.running.set()

    def mute(self) -> None:
        self.muted = True

    def mute_once_sent(self, marker: bytes) -> None:
        self.mute_marker = marker

    def strand(self) -> None:
        self.stranded |= self.transports

    def unmute(self) -> None:
        self.muted = False
        self.mute_marker = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Closed at aclose whatever this task is waiting for: a connection accepted while
        # paused, or while the proxy was closing, was left open (a ResourceWarning later).
        self.writers.add(writer)
        await self.running.wait()
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self.writers.add(up_writer)
        if writer.transport.is_closing():  # closed by aclose meanwhile
            up_writer.close()
            return
        self.transports.update((writer.transport, up_writer.transport))
        for copy in (self._copy(reader, up_writer), self._copy(up_reader, writer, answer=True)):
            task = asyncio.ensure_future(copy)
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _copy(
        self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, *, answer: bool = False
    ) -> None:
        with contextlib.suppress(OSError):
            while data := await source.read(65536):
                await self.running.wait()
                if not answer and self.mute_marker is not None and self.mute_marker in data:
                    self.muted, self.mute_marker = True, None
                if (answer and self.muted) or sink.transport in self.stranded:
                    continue
                sink.write(data)
                await sink.drain()
        if sink.transport not in self.stranded:
            sink.close()

    async def aclose(self) -> None:
        self.resume()
        self.stranded.clear()
        await self.cut("close")
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for writer in self.writers:
            writer.close()


@contextlib.asynccontextmanager
async def tcp_proxy(host: str, port: int) -> AsyncIterator[TcpProxy]:
    proxy = TcpProxy(host, port)
    await proxy.open()
    try:
        yield proxy
    finally:
        await proxy.aclose()
