"""A bounded soak of the gateway on loopback: healthy, failing, hanging and streaming
upstreams, clients that hang up at random, and a Redis restart in the middle (its own
redis-server on a free port, never the machine's shared one). Stops by itself.

    .venv/bin/python scripts/soak.py [--seconds 180] [--clients 24] [--json]

The gateway runs in this process on uvicorn with `serve`'s protections, its breakers in
the soak's Redis and its budget ledger in a SQLite file; the upstreams run in a child
process. After the load stops and a short idle period it checks: no budget hold left, no
asyncio task left beyond the idle baseline (the same task still there at four looks a
second apart), no upstream connection beyond the client's pool, breakers as expected
(failing and hanging upstreams open, healthy ones closed), the Redis state shared again,
and RSS flat after warm-up. Exit 0 when every check holds, 1 otherwise; the report says
which."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import Counter
from decimal import Decimal
from pathlib import Path
from typing import Any

import aiohttp
import redis.asyncio as aioredis
import uvicorn

from fallback_mw import Gateway
from fallback_mw.cli.server_limits import uvicorn_limits
from fallback_mw.config import BudgetConfig
from fallback_mw.health.redis import RedisHealth

UPSTREAMS = textwrap.dedent(
    """
    import asyncio, json, random, sys
    from aiohttp import web

    async def healthy(request):
        await request.read()
        await asyncio.sleep(random.uniform(0, 0.02))
        return web.json_response({"model": "m", "usage": {"prompt_tokens": 10,
                                  "completion_tokens": 20}})

    async def failing(request):
        await request.read()
        return web.Response(status=503, body=b"down")

    async def hanging(request):
        await asyncio.sleep(3600)
        return web.Response(body=b"never")

    async def streaming(request):
        await request.read()
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for n in range(20):
            await response.write(b'data: {"n": %d}\\n\\n' % n)
            await asyncio.sleep(0.01)
        await response.write(b'data: {"model": "m", "usage": {"prompt_tokens": 5, '
                             b'"completion_tokens": 50}}\\n\\n')
        await response.write_eof()
        return response

    async def main():
        runners = []
        ports = []
        for handler in (healthy, failing, hanging, streaming):
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", handler)
            runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            runners.append(runner)
            ports.append(site._server.sockets[0].getsockname()[1])
        print(json.dumps(ports), flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())
    """
)
NAMES = ("healthy", "failing", "hanging", "streaming")
BUDGET = BudgetConfig(limit=Decimal(1_000_000), window="total", default_hold=Decimal("0.01"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def established_to(ports: set[int]) -> int:
    """This process's ESTABLISHED TCP connections whose remote port is one of `ports`."""
    inodes = set()
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    count = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                remote_port = int(fields[2].rsplit(":", 1)[1], 16)
                if fields[3] == "01" and fields[9] in inodes and remote_port in ports:
                    count += 1
    return count


class OwnRedis:
    """A private redis-server on a free port (no persistence), restartable."""

    def __init__(self) -> None:
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        for _ in range(200):
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", self.port), timeout=0.1).close()
                return
            time.sleep(0.02)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)
        self.process = None


def gateway_config(ports: dict[str, int], redis_port: int, store: str) -> dict[str, Any]:
    def url(name: str) -> str:
        return f"http://127.0.0.1:{ports[name]}"

    breaker = {"window": 10, "min_calls": 5, "failure_rate": 0.5, "cooldown_ms": 2000,
               "max_cooldown_ms": 4000}  # fmt: skip
    return {
        "gateway": {"allow_hosts": ["127.0.0.1"], "state": f"redis://127.0.0.1:{redis_port}/0",
                    "store": store, "deadline_ms": 5000, "max_concurrency": 400,
                    "breaker": breaker},
        "upstreams": {
            "healthy": {"url": url("healthy")},
            "failing": {"url": url("failing")},
            "hanging": {"url": url("hanging"), "first_byte_timeout_ms": 300},
            "streaming": {"url": url("streaming"), "idle_timeout_ms": 2000},
        },
        "routes": [
            {"id": "chat", "prefix": "/v1/chat", "plan": ["failing", "healthy"], "retries": 1,
             "replayable_methods": ["GET", "POST"], "budget": "soak"},
            {"id": "hang", "prefix": "/v1/hang", "plan": ["hanging", "healthy"], "retries": 1,
             "deadline_ms": 2000},
            {"id": "stream", "prefix": "/v1/stream", "plan": ["streaming"], "budget": "soak"},
            {"id": "direct", "prefix": "/v1/direct", "plan": ["healthy"], "budget": "soak"},
        ],
        "budgets": {"soak": {"limit": "1000000", "window": "total", "default_hold": "0.01"}},
        "prices": {"m": {"input_per_mtok": "1", "output_per_mtok": "2"}},
    }  # fmt: skip


async def not_found(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 404, "headers": []})
        await send({"type": "http.response.body", "body": b""})


BODY = json.dumps({"model": "m", "max_tokens": 50, "messages": [{"role": "user"}]}).encode()


async def one_request(session: aiohttp.ClientSession, base: str, outcomes: Counter[str]) -> None:
    kind = random.choices(
        ["chat", "hang", "stream", "direct", "hangup-stream", "hangup-hang"],
        weights=[30, 10, 20, 25, 10, 5],
    )[0]
    try:
        if kind.startswith("hangup"):
            await hang_up(base, "/v1/stream" if kind == "hangup-stream" else "/v1/hang")
            outcomes["client hung up"] += 1
            return
        path = {"chat": "/v1/chat/completions", "hang": "/v1/hang/x", "stream": "/v1/stream/x",
                "direct": "/v1/direct/completions"}[kind]  # fmt: skip
        method = "POST" if kind in ("chat", "direct") else "GET"
        data = BODY if method == "POST" else None
        headers = {"content-type": "application/json"}
        async with session.request(method, base + path, data=data, headers=headers) as response:
            await response.read()
            code = response.headers.get("x-gateway-provider", "-")
            outcomes[f"{kind}: {response.status} via {code}"] += 1
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        outcomes[f"{kind}: client error {type(exc).__name__}"] += 1


async def hang_up(base: str, path: str) -> None:
    """A client that sends a request, maybe reads a little, and closes mid-response."""
    host, port = base.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(f"GET {path}/x HTTP/1.1\r\nhost: gw\r\n\r\n".encode())
        await writer.drain()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(reader.read(random.randint(1, 400)), random.uniform(0, 0.3))
    finally:
        writer.transport.abort()


async def client_loop(base: str, stop_at: float, outcomes: Counter[str]) -> None:
    timeout = aiohttp.ClientTimeout(total=15)
    connector = aiohttp.TCPConnector(limit=4)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        while time.monotonic() < stop_at:
            await one_request(session, base, outcomes)


async def lasting_tasks(
    baseline: set[asyncio.Task[Any]], looks: int = 4
) -> list[asyncio.Task[Any]]:
    """Tasks beyond the idle baseline that are still the same task at each of `looks` looks
    a second apart. The gateway's own short background work (the breaker refresh a Redis
    state runs every few seconds while a breaker is open, a pool closed after an outage) is
    a new task each time and gone within a look; a task left behind by a request stays."""
    me = asyncio.current_task()
    lasting = {t for t in asyncio.all_tasks() if not t.done() and t not in baseline and t is not me}
    for _ in range(looks - 1):
        if not lasting:
            break
        await asyncio.sleep(1.0)
        lasting = {t for t in lasting if not t.done()}
    return sorted(lasting, key=id)


async def breaker_states(redis_port: int) -> dict[str, str]:
    client = aioredis.Redis(host="127.0.0.1", port=redis_port, decode_responses=True)
    try:
        states: dict[str, str] = {}
        for name in NAMES:
            state = await client.hget(f"fallback_mw:breaker:{name}", "st")
            states[name] = str(state) if state else "closed"
        return states
    finally:
        await client.aclose()


async def soak(seconds: float, clients: int) -> dict[str, Any]:
    upstreams = subprocess.Popen(  # noqa: ASYNC220 - started once, before the load
        [sys.executable, "-c", UPSTREAMS], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    redis_server = OwnRedis()
    report: dict[str, Any] = {"seconds": seconds, "clients": clients}
    try:
        assert upstreams.stdout is not None
        ports = dict(zip(NAMES, json.loads(upstreams.stdout.readline()), strict=True))
        redis_server.start()
        with tempfile.TemporaryDirectory() as folder:
            store = f"sqlite:///{Path(folder) / 'soak.db'}"
            report.update(await _run(ports, redis_server, store, seconds, clients))
    finally:
        redis_server.stop()
        upstreams.send_signal(signal.SIGTERM)
        upstreams.wait(timeout=10)
    return report


async def _run(
    ports: dict[str, int], redis_server: OwnRedis, store: str, seconds: float, clients: int
) -> dict[str, Any]:
    conf = gateway_config(ports, redis_server.port, store)
    health = RedisHealth(f"redis://127.0.0.1:{redis_server.port}/0", socket_timeout=2.0)
    gateway = Gateway(not_found, config=conf, health=health)
    port = free_port()
    settings = gateway.config.gateway
    server = uvicorn.Server(
        uvicorn.Config(gateway, host="127.0.0.1", port=port, log_level="error", lifespan="off",
                       access_log=False, **uvicorn_limits(settings, "httptools"))
    )  # fmt: skip
    serve_task = asyncio.create_task(server.serve())
    for _ in range(500):
        if server.started:
            break
        await asyncio.sleep(0.02)
    base = f"http://127.0.0.1:{port}"
    outcomes: Counter[str] = Counter()
    # One request first, so the gateway's own long-lived tasks (the store reloader) exist
    # before the idle baseline of tasks is taken.
    async with aiohttp.ClientSession() as session, session.get(base + "/v1/direct/x") as first:
        await first.read()
    await asyncio.sleep(0.5)
    rss_start = rss_mib()
    baseline_tasks = {t for t in asyncio.all_tasks() if not t.done()}

    started = time.monotonic()
    stop_at = started + seconds
    workers = [asyncio.create_task(client_loop(base, stop_at, outcomes)) for _ in range(clients)]
    # Warm-up: the first fifth of the run; RSS after it is the baseline for "flat".
    await asyncio.sleep(seconds * 0.2)
    rss_warm = rss_mib()
    # Redis goes away in the middle of the run and comes back a few seconds later.
    await asyncio.sleep(seconds * 0.2)
    redis_server.stop()
    outage_started = time.monotonic() - started
    await asyncio.sleep(min(5.0, seconds * 0.15))
    redis_server.start()
    outage_ended = time.monotonic() - started
    fallbacks_during_outage = health.local_fallback_calls
    await asyncio.gather(*workers)
    load_seconds = time.monotonic() - started

    # Idle: let in-flight walks, settlements and keep-alive timers finish.
    await asyncio.sleep(3.0)
    ledger = gateway.services.ledger
    assert ledger is not None
    status = await ledger.status("soak", BUDGET)
    leftover = await lasting_tasks(baseline_tasks)
    connections = established_to(set(ports.values()))
    to_hanging = established_to({ports["hanging"]})
    breakers = await breaker_states(redis_server.port)
    # A few requests after Redis came back: the state is shared again.
    probe_fallbacks = health.local_fallback_calls
    async with aiohttp.ClientSession() as session:
        for _ in range(5):
            async with session.get(base + "/v1/direct/x") as response:
                await response.read()
    shared_again = health.available and health.local_fallback_calls == probe_fallbacks
    rss_end = rss_mib()

    server.should_exit = True
    await serve_task
    await gateway.aclose()

    requests = sum(outcomes.values())
    checks = {
        "no budget hold left": status.held == 0,
        "no task left beyond the idle baseline": not leftover,
        "upstream connections within the pool (512)": connections <= 512,
        "no connection left to the hanging upstream": to_hanging == 0,
        "failing upstream's breaker open": breakers["failing"] in ("open", "half_open"),
        "hanging upstream's breaker open": breakers["hanging"] in ("open", "half_open"),
        "healthy upstreams' breakers closed": breakers["healthy"] == "closed"
        and breakers["streaming"] == "closed",
        "Redis outage served on local state": fallbacks_during_outage > 0,
        "state shared again after the restart": shared_again,
        "RSS flat after warm-up (< 40 MiB growth)": rss_end - rss_warm < 40,
    }
    return {
        "load_seconds": round(load_seconds, 1),
        "requests": requests,
        "requests_per_second": round(requests / load_seconds, 1),
        "outcomes": dict(sorted(outcomes.items())),
        "redis_outage_s": [round(outage_started, 1), round(outage_ended, 1)],
        "local_fallback_calls": fallbacks_during_outage,
        "rss_mib": {
            "start": round(rss_start, 1),
            "after_warmup": round(rss_warm, 1),
            "end": round(rss_end, 1),
        },
        "upstream_connections_left": connections,
        "tasks_left": [t.get_coro().__qualname__ for t in leftover],  # type: ignore[union-attr]
        "holds_left": str(status.held),
        "spent": str(status.spent),
        "breakers": breakers,
        "checks": checks,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=180.0)
    parser.add_argument("--clients", type=int, default=24)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args()
    # The per-request log line (failovers are WARNING) would be most of the soak's work.
    logging.getLogger("fallback_mw.request").setLevel(logging.ERROR)
    # SIGTERM stops the soak like Ctrl-C: its Redis and upstream processes are stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    report = asyncio.run(soak(args.seconds, args.clients))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for key, value in report.items():
            if isinstance(value, dict):
                print(f"{key}:")
                for inner, item in value.items():
                    print(f"  {inner}: {item}")
            else:
                print(f"{key}: {value}")
    return 0 if all(report["checks"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
