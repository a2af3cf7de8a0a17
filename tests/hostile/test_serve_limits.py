"""`fallback-mw serve` protects itself: the server refuses oversized or slow request heads
before buffering them, and names no server software. A real serve process throughout."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.helpers import free_port, log_text, serve_process, wait_listening
from tests.upstreams import Upstream, status_handler, upstream

pytestmark = pytest.mark.anyio


def proc_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


async def send_big_head(port: int, size: int) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        with contextlib.suppress(OSError):
            writer.write(b"GET /v1/x HTTP/1.1\r\nhost: gw\r\nconnection: close\r\nx-big: ")
            chunk = b"a" * (256 * 1024)
            for _ in range(size // len(chunk)):
                writer.write(chunk)
                await writer.drain()
            writer.write(b"\r\n\r\n")
            await writer.drain()
        return await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.transport.abort()


async def exchange(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.transport.abort()


def write_config(tmp_path: Path, url: str, extra: str = "") -> Path:
    config = tmp_path / "gateway.toml"
    config.write_text(
        f'[gateway]\n{extra}\n[upstreams.primary]\nurl = "{url}"\n\n'
        '[[routes]]\nid = "r"\nprefix = "/v1/"\nplan = ["primary"]\n',
        encoding="utf-8",
    )
    return config


async def test_twenty_8mib_heads_add_under_50mb_to_serve_and_reach_no_upstream(
    tmp_path: Path,
) -> None:
    async with upstream(status_handler(200, b"ok")) as primary:
        port = free_port()
        log = tmp_path / "serve.log"
        with serve_process(write_config(tmp_path, primary.url), port, log) as process:
            await wait_listening(process, port, log)
            before = proc_kib(process.pid, "VmRSS")
            answers = await asyncio.gather(
                *(send_big_head(port, 8 * 1024 * 1024) for _ in range(20))
            )
            peak = proc_kib(process.pid, "VmHWM")  # the process's peak RSS so far
        assert process.returncode == 0, log_text(log)
    assert all(a.startswith(b"HTTP/1.1 431") for a in answers), {a[:40] for a in answers}
    assert all(b'"headers_too_large"' in a for a in answers)
    assert primary.count == 0
    assert (peak - before) / 1024 < 50, f"serve grew {(peak - before) / 1024:.1f} MiB"


@contextlib.asynccontextmanager
async def serving_with_half_second_heads(tmp_path: Path) -> AsyncIterator[tuple[Upstream, int]]:
    """A serve process with `header_timeout_ms = 500` in front of an upstream answering 200."""
    async with upstream(status_handler(200, b"ok")) as primary:
        port = free_port()
        log = tmp_path / "serve.log"
        config = write_config(tmp_path, primary.url, "header_timeout_ms = 500")
        with serve_process(config, port, log) as process:
            await wait_listening(process, port, log)
            yield primary, port


async def test_serve_answers_a_slow_head_with_408_and_sends_no_server_header(
    tmp_path: Path,
) -> None:
    async with serving_with_half_second_heads(tmp_path) as (primary, port):
        slow = await exchange(port, b"GET /v1/x HTTP/1.1\r\nhost: gw\r\n")  # no end
        normal = await exchange(
            port, b"GET /v1/x HTTP/1.1\r\nhost: gw\r\nconnection: close\r\n\r\n"
        )
    assert slow.startswith(b"HTTP/1.1 408") and b'"request_timeout"' in slow
    assert b'"rule":"header_timeout_ms"' in slow
    assert normal.startswith(b"HTTP/1.1 200")
    head = normal.split(b"\r\n\r\n", 1)[0].lower()
    assert b"\r\nserver:" not in head
    assert head.count(b"\r\ndate:") == 1
    assert primary.count == 1


async def test_a_later_head_on_a_kept_alive_connection_gets_its_whole_header_timeout(
    tmp_path: Path,
) -> None:
    """The head timer is one per connection, armed at its start: a second head that starts
    0.3 s later still gets its full 0.5 s, not what was left of the first one's."""
    async with serving_with_half_second_heads(tmp_path) as (primary, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"GET /v1/x HTTP/1.1\r\nhost: gw\r\n\r\n")
            first = await asyncio.wait_for(reader.readuntil(b"ok"), 10)
            await asyncio.sleep(0.3)
            loop = asyncio.get_running_loop()
            started = loop.time()
            writer.write(b"GET /v1/x HTTP/1.1\r\nhost: gw\r\n")  # never ends
            second = await asyncio.wait_for(reader.read(), 10)
            waited = loop.time() - started
        finally:
            writer.transport.abort()
    assert first.startswith(b"HTTP/1.1 200"), first[:80]
    assert second.startswith(b"HTTP/1.1 408") and b'"request_timeout"' in second, second[:80]
    assert 0.45 <= waited < 3, f"the second head was refused after {waited:.2f} s"
    assert primary.count == 1
