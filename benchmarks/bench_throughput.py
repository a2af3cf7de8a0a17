"""Gateway throughput ÷ a bare aiohttp passthrough proxy, measured side by side.

Both proxies run as uvicorn processes (httptools/uvloop when available) in front of the same
local upstream process; the load generator sends the same requests with the same
concurrency to each, alternating rounds, and prints requests/s, the ratio and the proxies'
peak RSS. Only 127.0.0.1 is contacted.

    .venv/bin/python benchmarks/bench_throughput.py [--seconds 3] [--rounds 3] [--concurrency 32]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import aiohttp

UPSTREAM = textwrap.dedent(
    """
    import sys
    from aiohttp import web
    async def handle(request):
        await request.read()
        return web.json_response({"id": "x", "choices": [{"message": {"content": "hi"}}]})
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)
    """
)

BARE_PROXY = textwrap.dedent(
    """
    import sys, aiohttp
    UPSTREAM = sys.argv[1]
    session = None
    async def app(scope, receive, send):
        global session
        if scope["type"] != "http":
            return
        if session is None:
            session = aiohttp.ClientSession(auto_decompress=False)
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        async with session.request(scope["method"], UPSTREAM + scope["path"], data=body or None,
                                   allow_redirects=False) as response:
            await send({"type": "http.response.start", "status": response.status,
                        "headers": [(k.lower(), v) for k, v in response.raw_headers
                                    if k.lower() not in (b"transfer-encoding", b"connection")]})
            async for chunk in response.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
    """
)

GATEWAY = textwrap.dedent(
    """
    import sys, os
    from fallback_mw import Gateway
    async def host(scope, receive, send):
        await send({"type": "http.response.start", "status": 404, "headers": []})
        await send({"type": "http.response.body", "body": b""})
    app = Gateway(host, config={
        "upstreams": {
            "primary": {"url": sys.argv[1], "auth_env": "BENCH_KEY"},
            # The same local server under another name: a fallback may not be the
            # primary's own endpoint.
            "backup": {"url": sys.argv[1].replace("127.0.0.1", "localhost"),
                       "auth_env": "BENCH_KEY"},
        },
        "routes": [{"id": "chat", "prefix": "/v1/", "plan": ["primary", "backup"],
                    "retries": 1, "replayable_methods": ["GET", "POST"]}],
    })
    """
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_port(
    port: int, process: subprocess.Popen[bytes] | None = None, timeout: float = 15.0
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the process for port {port} exited ({process.returncode})")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"port {port} never opened")


def start_asgi(
    module_source: str, arg: str, workdir: Path, name: str
) -> tuple[subprocess.Popen[bytes], int]:
    path = workdir / f"{name}.py"
    path.write_text(module_source)
    port = free_port()
    command = [
        sys.executable,
        "-c",
        "import sys, uvicorn; sys.argv = [sys.argv[0], sys.argv[1]];"
        f"sys.path.insert(0, {str(workdir)!r});"
        f"import {name} as m;"
        "kw = {};\n"
        "try:\n import uvloop, httptools; kw = dict(loop='uvloop', http='httptools')\n"
        "except ImportError: pass\n"
        f"uvicorn.run(m.app, host='127.0.0.1', port={port}, log_level='error',"
        " lifespan='off', **kw)",
        arg,
    ]
    env = {**os.environ, "BENCH_KEY": "bench-secret"}
    process = subprocess.Popen(command, env=env)
    try:
        wait_port(port, process)
    except BaseException:
        process.kill()
        raise
    return process, port


def rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return -1


async def load(url: str, seconds: float, concurrency: int) -> float:
    connector = aiohttp.TCPConnector(limit=concurrency)
    done = 0
    stop = time.monotonic() + seconds
    payload = b'{"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hello"}]}'
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            nonlocal done
            while time.monotonic() < stop:
                async with session.post(url, data=payload) as response:
                    await response.read()
                    if response.status != 200:
                        raise RuntimeError(f"status {response.status}")
                done += 1

        started = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done / (time.monotonic() - started)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"fmw-bench-{os.getpid()}"
    workdir.mkdir(parents=True, exist_ok=True)
    upstream_port = free_port()
    (workdir / "upstream.py").write_text(UPSTREAM)
    processes: list[subprocess.Popen[bytes]] = []
    try:
        upstream = subprocess.Popen(
            [sys.executable, str(workdir / "upstream.py"), str(upstream_port)]
        )
        processes.append(upstream)
        wait_port(upstream_port)
        upstream_url = f"http://127.0.0.1:{upstream_port}"
        bare, bare_port = start_asgi(BARE_PROXY, upstream_url, workdir, "bare_proxy")
        processes.append(bare)
        gateway, gateway_port = start_asgi(GATEWAY, upstream_url, workdir, "gateway_app")
        processes.append(gateway)
        results: dict[str, list[float]] = {"bare": [], "gateway": []}
        asyncio.run(load(f"http://127.0.0.1:{bare_port}/v1/chat", 0.5, args.concurrency))
        asyncio.run(load(f"http://127.0.0.1:{gateway_port}/v1/chat", 0.5, args.concurrency))
        for round_number in range(args.rounds):
            for name, port in (("bare", bare_port), ("gateway", gateway_port)):
                rate = asyncio.run(
                    load(f"http://127.0.0.1:{port}/v1/chat", args.seconds, args.concurrency)
                )
                results[name].append(rate)
                print(f"round {round_number + 1} {name:8s} {rate:9.0f} req/s", flush=True)
        bare_best, gateway_best = max(results["bare"]), max(results["gateway"])
        print(f"bare passthrough  best {bare_best:9.0f} req/s  peak RSS {rss_kib(bare.pid)} KiB")
        print(
            f"fallback_mw       best {gateway_best:9.0f} req/s  peak RSS {rss_kib(gateway.pid)} KiB"
        )
        ratios = [g / b for g, b in zip(results["gateway"], results["bare"], strict=True)]
        print("ratio per round   " + " ".join(f"{r:.2f}" for r in ratios))
        print(f"gateway / bare    {gateway_best / bare_best:.2f} (best of {args.rounds})")
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()


if __name__ == "__main__":
    main()
