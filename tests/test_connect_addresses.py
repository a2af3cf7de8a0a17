"""An upstream name that resolves to several addresses, some of them silent (a firewall
that drops, an interface with no route back: the SYN is never answered). The aiohttp
engine races the addresses (RFC 8305, a next one 250 ms after the previous began) inside
one connect timeout; the httpx engine tried them one after another, each with the whole
connect timeout: a silent first address cost every new connection connect_timeout_ms, and
N silent addresses held a connect N times connect_timeout_ms, the fallback's share of the
deadline spent."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from typing import Any

import pytest

from fallback_mw.upstream import make_client
from fallback_mw.upstream.base import Timeouts, UpstreamError, UpstreamRequest
from tests.upstreams import free_port, status_handler, upstream

ENGINES = ["aiohttp", "httpx"]


@pytest.fixture
def fake_dns(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    """Names ending in `.test` resolve to the addresses the test gives, in that order (the
    resolver seam both engines share: the event loop's getaddrinfo, run in a thread, calls
    socket.getaddrinfo); every other name as usual."""
    real = socket.getaddrinfo
    answers: dict[str, list[str]] = {}

    def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        name = host.decode() if isinstance(host, bytes) else host
        if isinstance(name, str) and name in answers:
            return [
                (
                    socket.AF_INET6 if ":" in address else socket.AF_INET,
                    socket.SOCK_STREAM,
                    socket.IPPROTO_TCP,
                    "",
                    (address, int(port or 0), 0, 0)
                    if ":" in address
                    else (address, int(port or 0)),
                )
                for address in answers[name]
            ]
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return answers


def _silent(stack: ExitStack, address: str, port: int) -> None:
    """A listener on `address`:`port` whose accept queue is full: the kernel drops each
    further SYN unanswered, as a firewall that drops would. Waits until a probe's connect
    goes unanswered."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    listener = stack.enter_context(socket.socket(family, socket.SOCK_STREAM))
    listener.bind((address, port))
    listener.listen(0)
    for _ in range(50):
        filler = stack.enter_context(socket.socket(family, socket.SOCK_STREAM))
        filler.setblocking(False)
        with suppress(BlockingIOError):
            filler.connect((address, port))
        probe = stack.enter_context(socket.socket(family, socket.SOCK_STREAM))
        probe.settimeout(0.3)
        try:
            probe.connect((address, port))
        except TimeoutError:
            return
    pytest.fail(f"could not make {address}:{port} silent")


@contextmanager
def silent(*addresses: str, port: int) -> Iterator[None]:
    with ExitStack() as stack:
        for address in addresses:
            _silent(stack, address, port)
        yield


def _request(url: str, connect: float) -> UpstreamRequest:
    return UpstreamRequest(
        method="GET", url=url, headers=[], body=b"", timeouts=Timeouts(connect, 5.0, 5.0)
    )


@pytest.mark.anyio
@pytest.mark.parametrize("engine", ENGINES)
async def test_a_silent_first_address_costs_no_connect_timeout(
    engine: str, fake_dns: dict[str, list[str]]
) -> None:
    async with upstream(status_handler(200, b"answered")) as server:
        port = int(server.url.rsplit(":", 1)[1])
        fake_dns["both.test"] = ["::1", "127.0.0.1"]  # ::1 silent, 127.0.0.1 answers
        client = make_client(engine, allow_hosts=("::1", "127.0.0.1"))
        with silent("::1", port=port):
            started = time.monotonic()
            try:
                response = await client.send(_request(f"http://both.test:{port}/x", 3.0))
                body = b"".join([chunk async for chunk in response.iter_chunks()])
                await response.aclose()
            finally:
                await client.aclose()
            took = time.monotonic() - started
    assert response.status == 200 and body == b"answered"
    # aiohttp: the next address 250 ms after the first began; not the 3 s connect timeout.
    assert took < 1.5, f"{engine} took {took:.2f} s to connect past a silent address"


@pytest.mark.anyio
@pytest.mark.parametrize("engine", ENGINES)
async def test_silent_addresses_share_one_connect_timeout(
    engine: str, fake_dns: dict[str, list[str]]
) -> None:
    port = free_port()
    fake_dns["three.test"] = ["::1", "127.0.0.1", "127.0.0.2"]
    client = make_client(engine, allow_hosts=("::1", "127.0.0.0/8"))
    with silent("::1", "127.0.0.1", "127.0.0.2", port=port):
        started = time.monotonic()
        try:
            with pytest.raises(UpstreamError) as caught:
                await client.send(_request(f"http://three.test:{port}/x", 1.0))
        finally:
            await client.aclose()
        took = time.monotonic() - started
    assert caught.value.kind == "timeout" and caught.value.phase == "connect"
    # One connect timeout (1 s) for all three, not one each (3 s).
    assert 0.9 < took < 2.2, f"{engine} took {took:.2f} s for a 1 s connect timeout"


class _Stream:
    """A connection made by one racing attempt; its close may fail (a reset on close)."""

    def __init__(self, name: str, closes: list[str], *, close_fails: bool) -> None:
        self.name, self._closes, self._close_fails = name, closes, close_fails

    async def aclose(self) -> None:
        self._closes.append(self.name)
        if self._close_fails:
            raise OSError("reset while closing")


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_loser_whose_close_fails_leaves_the_winner_kept() -> None:
    """Two addresses connect in the same instant and a third is still connecting: one is
    kept, the other closed, the third cancelled. A loser whose close raised (a reset on
    close) made the race raise that error, leaving the winner's connection open and
    unused, and the caller's connect failing though one address answered."""
    import asyncio

    from fallback_mw.upstream.httpx_backend import first_connected

    closes: list[str] = []
    third_started = asyncio.Event()

    async def connect(address: str) -> Any:
        if address == "c":
            third_started.set()
            await asyncio.sleep(0.05)  # connected after the race was decided
            return _Stream(address, closes, close_fails=True)
        await third_started.wait()
        return _Stream(address, closes, close_fails=True)

    kept = await first_connected(["a", "b", "c"], connect)
    assert kept.name in ("a", "b")
    assert closes == [{"a": "b", "b": "a"}[kept.name]]
