"""Header flood: 20 concurrent requests, each with one 8 MiB header, against a real
`fallback-mw serve` process. Prints the serve process's RSS before, at its peak during,
and after the flood, what the clients got back, and how many requests reached the
upstream. Only 127.0.0.1 is contacted.

    .venv/bin/python benchmarks/header_flood.py [--clients 20] [--mib 8]

Done-when (issue 10): the flood adds < 50 MB to serve's RSS and reaches no upstream.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from aiohttp import web


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


class PeakSampler(threading.Thread):
    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.peak = 0.0
        self.running = True

    def run(self) -> None:
        while self.running:
            try:
                self.peak = max(self.peak, rss_mib(self.pid))
            except (OSError, RuntimeError):
                return
            time.sleep(0.005)


async def flood_one(port: int, size: int) -> str:
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError as exc:
        return f"connect failed: {type(exc).__name__}"
    head = b"GET /v1/x HTTP/1.1\r\nhost: gw\r\nconnection: close\r\nx-big: "
    try:
        writer.write(head)
        chunk = b"a" * (256 * 1024)
        for _ in range(size // len(chunk)):
            writer.write(chunk)
            await writer.drain()
        writer.write(b"\r\n\r\n")
        await writer.drain()
    except OSError:
        pass  # refused mid-send; read the answer
    try:
        data = await asyncio.wait_for(reader.read(4096), 30)
    except (OSError, TimeoutError) as exc:
        data = f"read failed: {type(exc).__name__}".encode()
    writer.close()
    return data.split(b"\r\n", 1)[0].decode("latin-1") or "closed without an answer"


async def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--mib", type=int, default=8)
    args = parser.parse_args()

    reached = 0

    async def handle(request: web.Request) -> web.StreamResponse:
        nonlocal reached
        reached += 1
        return web.Response(body=b"ok")

    app = web.Application(handler_args={"max_field_size": 64 * 1024 * 1024,
                                        "max_line_size": 64 * 1024 * 1024})  # fmt: skip
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    upstream_port = free_port()
    await web.TCPSite(runner, "127.0.0.1", upstream_port).start()

    port = free_port()
    with tempfile.TemporaryDirectory() as folder:
        config = Path(folder) / "gateway.toml"
        config.write_text(
            f'[upstreams.primary]\nurl = "http://127.0.0.1:{upstream_port}"\n\n'
            '[[routes]]\nid = "r"\nprefix = "/v1/"\nplan = ["primary"]\n',
            encoding="utf-8",
        )
        command = [sys.executable, "-m", "fallback_mw", "serve", "--config", str(config),
                   "--port", str(port)]  # fmt: skip
        serve = subprocess.Popen(  # noqa: ASYNC220 - started once, before the measurement
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            for _ in range(400):
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                    break
                except OSError:
                    await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
            before = rss_mib(serve.pid)
            sampler = PeakSampler(serve.pid)
            sampler.start()
            started = time.monotonic()
            answers = await asyncio.gather(
                *(flood_one(port, args.mib * 1024 * 1024) for _ in range(args.clients))
            )
            elapsed = time.monotonic() - started
            await asyncio.sleep(1.0)
            sampler.running = False
            sampler.join()
            after = rss_mib(serve.pid)
        finally:
            serve.send_signal(signal.SIGINT)
            try:
                serve.wait(timeout=10)
            except subprocess.TimeoutExpired:
                serve.kill()
    await runner.cleanup()

    counts: dict[str, int] = {}
    for answer in answers:
        counts[answer] = counts.get(answer, 0) + 1
    print(f"clients={args.clients} header={args.mib} MiB each ({elapsed:.1f} s)")
    print(f"serve RSS before={before:.1f} MiB  peak={sampler.peak:.1f} MiB  after={after:.1f} MiB")
    print(f"serve RSS added at peak: {sampler.peak - before:.1f} MiB")
    for answer, count in sorted(counts.items()):
        print(f"  {count:3d} x {answer}")
    print(f"requests that reached the upstream: {reached}")
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
