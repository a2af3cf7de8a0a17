"""The training run of `scripts/compile.py --pgo`: traffic through `fallback-mw serve` from
the compiled copy being built, while its instrumented C code counts which branches and
calls each request takes. The second build lays its code out by those counts (gcc's
profile-guided optimization): the blocks a request runs together, the rest apart.

    python scripts/pgo_train.py STAGING     # PYTHONPATH=STAGING: the instrumented copy

What it sends is what a gateway spends its time on, each through a real socket: chat
completions answered by the first upstream of the plan, the same failing over from an
upstream answering 503, streamed (SSE) completions with their usage, a route spending from
a SQLite budget, and a GET. The upstreams are aiohttp servers in this process on
127.0.0.1; `serve` is a process of its own, stopped with SIGINT so its counts are written
as it exits (gcc writes them at a normal exit only). Every answer is checked: a training
run whose requests fail would lay the code out for its failures, so it fails instead.
Exit status 0 when every request got its answer and `serve` exited cleanly.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

from aiohttp import ClientSession, web

# Requests per kind, sent `CONCURRENCY` at a time: enough for every branch a request takes
# to be counted many times over (a few seconds instrumented).
COUNTS = {"chat": 2000, "failover": 800, "stream": 200, "budget": 400, "get": 200}
CONCURRENCY = 8
BODY = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Say hello."}]}
CHAT = {
    "id": "chatcmpl-train",
    "object": "chat.completion",
    "model": "gpt-4o-mini",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello."}}],
    "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11},
}


async def _answer(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    if body and json.loads(body).get("stream"):
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for word in ("Hel", "lo."):
            chunk = {"choices": [{"index": 0, "delta": {"content": word}}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {"choices": [], "usage": CHAT["usage"]}
        await response.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        await response.write_eof()
        return response
    return web.json_response(CHAT)


async def _unavailable(request: web.Request) -> web.Response:
    await request.read()
    return web.json_response({"error": {"message": "overloaded"}}, status=503)


async def _upstream(handler: object) -> tuple[web.AppRunner, int]:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)  # type: ignore[arg-type]
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, int(runner.addresses[0][1])


def _config(ok: int, backup: int, failing: int, ledger: Path) -> str:
    upstreams = "".join(
        f'[upstreams.{name}]\nurl = "http://127.0.0.1:{port}"\nauth_env = "TRAIN_KEY"\n'
        for name, port in (("primary", ok), ("backup", backup), ("failing", failing))
    )
    # A breaker that cannot open (min_calls above its window): every failover request
    # tries the failing upstream first.
    return f"""
[gateway]
store = "sqlite:///{ledger}"
[gateway.breaker]
window = 20
min_calls = 21
{upstreams}
[[routes]]
id = "chat"
prefix = "/v1/"
plan = ["primary", "backup"]
retries = 1
replayable_methods = ["GET", "POST"]
[[routes]]
id = "failover"
prefix = "/fo/"
plan = ["failing", "backup"]
retries = 1
replayable_methods = ["GET", "POST"]
[[routes]]
id = "budget"
prefix = "/b/"
plan = ["primary"]
budget = "train"
[budgets.train]
limit = 1000000000
window = "total"
[prices."gpt-4o-mini"]
input_per_mtok = 0.15
output_per_mtok = 0.60
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def _listening(port: int, process: asyncio.subprocess.Process, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.returncode is not None:
            raise RuntimeError(f"serve exited with status {process.returncode} before listening")
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.1)
            continue
        writer.close()
        await writer.wait_closed()
        return
    raise RuntimeError(f"serve did not listen on port {port} within {seconds:.0f} s")


async def _send(session: ClientSession, base: str, kind: str) -> None:
    prefix = {"failover": "/fo", "budget": "/b"}.get(kind, "/v1")  # the route (_config)
    url = f"{base}{prefix}/chat/completions"
    headers = {"authorization": "Bearer caller-key", "x-tenant-id": "train"}
    if kind == "get":
        request = session.get(base + "/v1/models", headers=headers)
    else:
        body = {**BODY, "stream": True} if kind == "stream" else BODY
        request = session.post(url, json=body, headers=headers)
    async with request as response:
        text = await response.read()
        if response.status != 200 or (b"Hel" not in text and kind != "get"):
            raise RuntimeError(f"{kind}: {response.status} {text[:200]!r}")


async def train(staging: Path) -> None:
    ok_runner, ok = await _upstream(_answer)
    backup_runner, backup = await _upstream(_answer)
    failing_runner, failing = await _upstream(_unavailable)
    work = Path(tempfile.mkdtemp(prefix="fmw-pgo-"))
    config = work / "train.toml"
    config.write_text(_config(ok, backup, failing, work / "ledger.db"))
    port = _free_port()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(staging), os.environ.get("PYTHONPATH")])),
        "TRAIN_KEY": "train-upstream-key",
    }
    command = [sys.executable, "-m", "fallback_mw", "serve", "--config", str(config)]
    log = (work / "serve.log").open("wb")
    process = await asyncio.create_subprocess_exec(
        *command, "--host", "127.0.0.1", "--port", str(port), env=env, stdout=log, stderr=log
    )
    try:
        await _listening(port, process, 120)
        base = f"http://127.0.0.1:{port}"
        async with ClientSession() as session:
            gate = asyncio.Semaphore(CONCURRENCY)

            async def one(kind: str) -> None:
                async with gate:
                    await _send(session, base, kind)

            kinds = [kind for kind, count in COUNTS.items() for _ in range(count)]
            kinds = [kinds[(i * 7919) % len(kinds)] for i in range(len(kinds))]  # mixed
            await asyncio.gather(*(one(kind) for kind in kinds))
    except RuntimeError as exc:
        raise RuntimeError(f"{exc}\n{await _stop(process, log, work)}") from None
    finally:
        for runner in (ok_runner, backup_runner, failing_runner):
            await runner.cleanup()
    said = await _stop(process, log, work)
    if process.returncode != 0:
        raise RuntimeError(f"serve exited with status {process.returncode}:\n{said}")


async def _stop(process: asyncio.subprocess.Process, log: IO[bytes], work: Path) -> str:
    """serve stopped as Ctrl-C stops it (its counts written as it exits), and the last of
    what it said; its work directory removed."""
    if process.returncode is None:
        process.send_signal(signal.SIGINT)
        try:
            await asyncio.wait_for(process.wait(), 60)
        except TimeoutError:
            process.kill()
            await process.wait()
    log.close()
    said = (work / "serve.log").read_text(errors="replace")[-2000:]
    shutil.rmtree(work, ignore_errors=True)
    return said


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    started = time.monotonic()
    try:
        asyncio.run(train(Path(sys.argv[1]).resolve()))
    except RuntimeError as exc:
        print(f"pgo_train.py: {exc}", file=sys.stderr)
        return 1
    total = sum(COUNTS.values())
    print(f"pgo_train.py: {total} requests through serve in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
