"""Recovery from a Redis outage does not flap: the connections pooled before Redis went away
are not used after it is back (each one that failed would start a new "outage", with a new
warning and another retry interval on local breakers)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import pytest

from fallback_mw.config import BreakerConfig
from fallback_mw.health.redis import RedisHealth
from tests.conftest import REDIS_HOST, REDIS_PORT

RETRY_INTERVAL = 0.2


class Proxy:
    """A TCP proxy to the real Redis that can go away and come back: `cut()` stops listening
    (new connections are refused) and kills every live connection, by reset (`abort`, as a
    host or process that died) or by close (a FIN, as a proxy or server shutting down)."""

    def __init__(self, kill: str) -> None:
        self.kill = kill
        self.port = 0
        self.server: asyncio.Server | None = None
        self.transports: set[asyncio.BaseTransport] = set()
        self.handlers: set[asyncio.Task[None]] = set()

    async def open(self) -> None:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        self.port = self.server.sockets[0].getsockname()[1]

    async def cut(self) -> None:
        assert self.server is not None
        self.server.close()
        self.server = None
        for transport in self.transports:
            if self.kill == "abort":
                transport.abort()  # type: ignore[attr-defined]
            else:
                transport.close()
        self.transports.clear()
        await asyncio.sleep(0.05)  # the resets and FINs reach the gateway's sockets

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.handlers.add(task)
        try:
            to_reader, to_writer = await asyncio.open_connection(REDIS_HOST, REDIS_PORT)
        except OSError:
            writer.close()
            return
        self.transports.update((writer.transport, to_writer.transport))
        await asyncio.gather(self._pipe(reader, to_writer), self._pipe(to_reader, writer))
        self.handlers.discard(task)

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()


@contextlib.asynccontextmanager
async def proxy(kill: str) -> AsyncIterator[Proxy]:
    p = Proxy(kill)
    await p.open()
    try:
        yield p
    finally:
        if p.server is not None:
            await p.cut()
        await asyncio.gather(*p.handlers, return_exceptions=True)


async def staggered_calls(health: RedisHealth, count: int) -> list[bool]:
    """`count` admissions made on successive turns of the loop: separate pipelines, in flight
    together, so they take several of the pool's connections."""
    calls = []
    for n in range(count):
        calls.append(asyncio.ensure_future(health.admit(f"u{n}")))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
    return list(await asyncio.gather(*calls))


@pytest.mark.anyio
@pytest.mark.parametrize("kill", ["abort", "close"])
async def test_recovery_after_an_outage_does_not_flap(
    redis_url: str, kill: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="fallback_mw.health")
    parts = urlsplit(redis_url)
    async with proxy(kill) as redis:
        health = RedisHealth(
            f"redis://127.0.0.1:{redis.port}{parts.path}?{parts.query}",
            BreakerConfig(),
            retry_interval=RETRY_INTERVAL,
        )
        try:
            for _ in range(3):  # several connections in the pool, idle
                assert await staggered_calls(health, 6) == [True] * 6
            assert health.local_fallback_calls == 0

            await redis.cut()
            assert await staggered_calls(health, 4) == [True] * 4  # local breakers
            assert not health.available
            await asyncio.sleep(RETRY_INTERVAL + 0.05)
            assert await staggered_calls(health, 3) == [True] * 3  # tried again: still down
            assert not health.available
            during = health.local_fallback_calls
            assert during >= 7

            await redis.open()
            await asyncio.sleep(RETRY_INTERVAL + 0.05)
            for _ in range(5):
                assert await staggered_calls(health, 6) == [True] * 6
                assert health.available
                await asyncio.sleep(0.02)
            assert health.local_fallback_calls == during  # shared again, every call
        finally:
            await health.aclose()
    messages = [r.getMessage() for r in caplog.records if r.name == "fallback_mw.health"]
    assert [m for m in messages if "unreachable" in m] == messages[:1]
    assert [m for m in messages if "reachable again" in m] == messages[1:2]
    assert len(messages) == 2
