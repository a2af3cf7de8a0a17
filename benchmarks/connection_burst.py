"""Connection burst: N concurrent callers through uvicorn (in this process) to a gateway
whose primary fails every other request with 503 and whose backup listens with a small
backlog. Prints, per engine, the statuses the callers got, the backup breaker's state and
failures, the kernel's listen-queue overflows during the run (`nstat`) and the backup's
peak concurrent requests. `--old` runs the settings from before issue 23 (no per-upstream
cap, 1 s connect timeout) for comparison. Only 127.0.0.1 is contacted.

    .venv/bin/python benchmarks/connection_burst.py [--callers 500] [--backlog 16] [--old]

Done-when (issue 23): no healthy breaker opens.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import logging
import subprocess
import time
from typing import Any

import aiohttp
import uvicorn
from aiohttp import web

from fallback_mw import Gateway
from fallback_mw.health.memory import MemoryHealth


def overflows() -> int | None:
    try:
        out = subprocess.run(
            ["nstat", "-az", "TcpExtListenOverflows"], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return int(out.strip().splitlines()[-1].split()[1])


async def upstream(fail_every_other: bool, backlog: int) -> tuple[str, Any, dict[str, int]]:
    counter = itertools.count()
    state = {"in_flight": 0, "peak": 0}

    async def handle(request: web.Request) -> web.StreamResponse:
        state["in_flight"] += 1
        state["peak"] = max(state["peak"], state["in_flight"])
        try:
            await request.read()
            await asyncio.sleep(0.01)
            if fail_every_other and next(counter) % 2:
                return web.Response(status=503, text="busy")
            return web.Response(text="ok")
        finally:
            state["in_flight"] -= 1

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=backlog)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return f"http://127.0.0.1:{port}", runner, state


async def run(engine: str, callers: int, backlog: int, old: bool) -> None:
    primary_url, primary_runner, _ = await upstream(True, 128)
    backup_url, backup_runner, backup_state = await upstream(False, backlog)
    limits: dict[str, Any] = (
        {"max_connections": 100_000, "connect_timeout_ms": 1000}
        if old
        else {"max_connections": backlog}
    )
    config = {
        "gateway": {"allow_hosts": ["127.0.0.1"], "engine": engine, "deadline_ms": 60_000},
        "upstreams": {"primary": {"url": primary_url, **limits},
                      "backup": {"url": backup_url, **limits}},
        "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary", "backup"],
                    "retries": 1, "failover_status": [503]}],
    }  # fmt: skip
    gateway = Gateway(None, config=config)  # type: ignore[arg-type]
    server = uvicorn.Server(
        uvicorn.Config(
            gateway, host="127.0.0.1", port=0, log_level="error", lifespan="off", backlog=4096
        )
    )
    task = asyncio.create_task(server.serve())
    while not server.started:  # noqa: ASYNC110 - uvicorn offers no event
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    before, started = overflows(), time.monotonic()
    try:
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=callers),
            timeout=aiohttp.ClientTimeout(total=120),
        ) as session:

            async def call(n: int) -> int:
                async with session.get(f"http://127.0.0.1:{port}/v1/chat/{n}") as response:
                    await response.read()
                    return response.status

            statuses = await asyncio.gather(*(call(n) for n in range(callers)))
        elapsed = time.monotonic() - started
        after = overflows()
        health = gateway.services.health
        assert isinstance(health, MemoryHealth)
        breaker = health.breaker("backup")
        print(
            f"{'old' if old else 'new'} {engine}: {callers} callers in {elapsed:.1f} s, "
            f"statuses {dict(collections.Counter(statuses))}, backup breaker {breaker.state} "
            f"(failures in window {list(breaker.outcomes).count(1)}), listen overflows "
            f"{'?' if before is None or after is None else after - before}, backup peak "
            f"{backup_state['peak']} concurrent"
        )
    finally:
        server.should_exit = True
        await task
        await gateway.aclose()
        await primary_runner.cleanup()
        await backup_runner.cleanup()


async def main() -> None:
    logging.getLogger("fallback_mw").setLevel(logging.ERROR)  # no request log lines
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--callers", type=int, default=500)
    parser.add_argument("--backlog", type=int, default=16)
    parser.add_argument("--old", action="store_true", help="no cap, 1 s connect timeout")
    options = parser.parse_args()
    for engine in ("aiohttp", "httpx"):
        await run(engine, options.callers, options.backlog, options.old)


if __name__ == "__main__":
    asyncio.run(main())
