"""Streaming memory: peak RSS of a gateway process while it streams a large response.

A response is never buffered: streaming 256 MiB through the gateway should raise its peak
RSS by a small, size-independent amount. Prints the peak RSS after a 16 MiB and after a
256 MiB response, side by side in one run. Only 127.0.0.1 is contacted.

    .venv/bin/python benchmarks/bench_streaming.py
"""

from __future__ import annotations

import asyncio
import sys
import textwrap
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).parent))
from bench_throughput import GATEWAY, free_port, rss_kib, start_asgi, wait_port

UPSTREAM = textwrap.dedent(
    """
    import sys
    from aiohttp import web
    CHUNK = b"x" * 65536
    async def handle(request):
        size = int(request.query.get("mib", "1")) * 1024 * 1024
        response = web.StreamResponse(headers={"content-type": "application/octet-stream"})
        await response.prepare(request)
        for _ in range(size // len(CHUNK)):
            await response.write(CHUNK)
        await response.write_eof()
        return response
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)
    """
)


# The default max_response_body (10 MiB) would (rightly) abort these downloads.
GATEWAY_STREAM = GATEWAY.replace(
    '"routes":', '"gateway": {"max_response_body": 1 << 30}, "routes":', 1
)


async def fetch(url: str) -> tuple[int, float]:
    received = 0
    started = time.monotonic()
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        async for chunk in response.content.iter_any():
            received += len(chunk)
    return received, time.monotonic() - started


def main() -> None:
    import os
    import subprocess

    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"fmw-stream-{os.getpid()}"
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "upstream.py").write_text(UPSTREAM)
    port = free_port()
    upstream = subprocess.Popen([sys.executable, str(workdir / "upstream.py"), str(port)])
    gateway = None
    try:
        wait_port(port)
        upstream_url = f"http://127.0.0.1:{port}"
        gateway, gateway_port = start_asgi(GATEWAY_STREAM, upstream_url, workdir, "gw")
        base = f"http://127.0.0.1:{gateway_port}/v1/download"
        asyncio.run(fetch(base + "?mib=1"))
        idle = rss_kib(gateway.pid)
        print(f"gateway peak RSS after warm-up        {idle:8d} KiB")
        for mib in (16, 256):
            received, seconds = asyncio.run(fetch(f"{base}?mib={mib}"))
            assert received == mib * 1024 * 1024, received
            peak = rss_kib(gateway.pid)
            print(
                f"after streaming {mib:4d} MiB ({mib / seconds:6.0f} MiB/s)  "
                f"peak RSS {peak:8d} KiB  (+{peak - idle} KiB)"
            )
    finally:
        for process in (upstream, gateway):
            if process is not None:
                process.terminate()
                process.wait(timeout=5)


if __name__ == "__main__":
    main()
