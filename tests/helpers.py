"""Helpers shared by the tests: free ports, `fallback-mw serve` as a real process, and an
httpx client on an in-process gateway."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from fallback_mw import Gateway
from tests.upstreams import free_port, host_app

# scripts/test.sh's second pass: the request path's modules compiled (PYTHONPATH=build/compiled;
# tests/conftest.py refuses the pass when they import interpreted). A test that reads a
# layer's own message for an argument of the wrong type, or patches a compiled module, says
# what each build does.
COMPILED = bool(os.environ.get("FMW_TEST_COMPILED"))

__all__ = [
    "SIGHUP_AT_ITS_DEFAULT",
    "client_for",
    "free_port",
    "gateway_client",
    "http_scope",
    "log_text",
    "own_redis",
    "request_then_disconnect",
    "serve_process",
    "shared_again",
    "wait_listening",
]

# The command run with SIGHUP at its default, as a terminal's shell starts it, whatever this
# process inherited: a test run under `nohup` (or a CI agent that ignores SIGHUP) started
# serve with SIGHUP ignored, which serve keeps ignoring by design, and a test that hangs up
# on it waited for a process that had rightly not stopped. Put in front of a command.
SIGHUP_AT_ITS_DEFAULT = (
    sys.executable,
    "-c",
    "import os, signal, sys; signal.signal(signal.SIGHUP, signal.SIG_DFL); "
    "os.execv(sys.argv[1], sys.argv[1:])",
)


@contextmanager
def serve_process(
    config: Path,
    port: int,
    log: Path,
    *,
    env: dict[str, str] | None = None,
    options: Iterable[str] = (),
    executable: Sequence[str] = (sys.executable, "-m", "fallback_mw"),
    cwd: Path | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    """`python -m fallback_mw serve` (or `executable` serve, e.g. an installed
    `fallback-mw`) on 127.0.0.1:`port` with `options`, its output in `log`, run in `cwd`
    (None: this process's); SIGINT at the end (killed after 10 s). `env` None inherits this
    process's environment."""
    with log.open("wb") as out:
        process = subprocess.Popen(
            [
                *executable,
                *("serve", "--config", str(config)),
                *("--host", "127.0.0.1", "--port", str(port)),
                *options,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
        )
        try:
            yield process
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


@contextmanager
def own_redis(*options: str) -> Iterator[subprocess.Popen[bytes]]:
    """A private redis-server on a free 127.0.0.1 port (no persistence; `options` added),
    for tests that stop, hang or misconfigure it: its port is `process.args[2]`. Killed at
    the end, resumed first if a test left it stopped (SIGSTOP)."""
    from tests.conftest import IN_CI

    if shutil.which("redis-server") is None:
        if IN_CI:
            pytest.fail("redis-server is not installed (CI=true: a missing service fails)")
        pytest.skip("redis-server is not installed")
    port = free_port()
    process = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", *options],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        for _ in range(250):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                break
            except OSError:
                time.sleep(0.02)
        else:
            raise RuntimeError("redis-server did not start")
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGCONT)
            process.kill()
            process.wait()


async def shared_again(health: Any, within: float = 10.0) -> None:
    """Wait until a `RedisHealth` in an outage found Redis again (its background try)."""
    until = time.monotonic() + within
    while not health.available:
        assert time.monotonic() < until, "Redis was not found again"
        await anyio.sleep(0.02)


def documented_rules() -> set[str]:
    """The `rule` words docs/failover.md's rule table explains (its first column)."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "failover.md").read_text()
    table = text.split("| `rule` | the walk ended because |", 1)[1].split("\n\n", 1)[0]
    return {line.split("`")[1] for line in table.splitlines()[2:] if line.startswith("| `")}


@contextmanager
def sqlite_db(path: str | Path, **options: Any) -> Iterator[sqlite3.Connection]:
    """`with sqlite3.connect(path) as db:` (committed at its end, rolled back on an
    error), and closed: a connection's own `with` never closes it, which Python 3.13
    reports as a ResourceWarning (an error in this suite)."""
    db = sqlite3.connect(path, **options)
    try:
        with db:
            yield db
    finally:
        db.close()


def log_text(log: Path) -> str:
    return log.read_text(errors="replace")


async def wait_listening(
    process: subprocess.Popen[bytes], port: int, log: Path, limit: float = 60.0
) -> None:
    """Until the process accepts connections on `port`. Fails at once if it exits; the
    limit is generous (a loaded two-core machine took over 20 s to start serve) and only
    ends a wait for a process that runs but never listens."""
    deadline = time.monotonic() + limit
    while True:
        if process.poll() is not None:
            pytest.fail(f"serve exited early ({process.returncode}): {log_text(log)}")
        try:
            stream = await anyio.connect_tcp("127.0.0.1", port)
        except OSError:
            if time.monotonic() >= deadline:
                pytest.fail(f"serve did not start listening within {limit:.0f} s: {log_text(log)}")
            await anyio.sleep(0.05)
            continue
        await stream.aclose()
        return


def http_scope(
    method: str, path: str, query: bytes = b"", headers: Iterable[tuple[bytes, bytes]] = ()
) -> dict[str, Any]:
    """A raw ASGI HTTP scope as a server on gw:80 would pass it (host header first)."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query,
        "headers": [(b"host", b"gw"), *headers],
        "client": ("127.0.0.1", 1),
        "server": ("gw", 80),
    }


def request_then_disconnect(after: float) -> Callable[[], Awaitable[dict[str, Any]]]:
    """An ASGI `receive` for a client that sends an empty request, then leaves `after`
    seconds later (every later call waits that long and says `http.disconnect`)."""
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await anyio.sleep(after)
        return {"type": "http.disconnect"}

    return receive


def client_for(app: Any) -> httpx.AsyncClient:
    """An httpx client on an in-process ASGI app (note: ASGITransport buffers responses)."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")


@asynccontextmanager
async def gateway_client(conf: dict[str, Any], **kwargs: Any) -> AsyncIterator[httpx.AsyncClient]:
    """A Gateway over the bare host app, built from `conf`, closed at the end."""
    gateway = Gateway(host_app, config=conf, **kwargs)
    try:
        async with client_for(gateway) as client:
            yield client
    finally:
        await gateway.aclose()


def alive(pid: int) -> bool:
    """Whether process `pid` still exists (a zombie counts until it is reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def record_the_store_refuses() -> Any:
    """A usage record whose request_id is None (NOT NULL in every store), for a ledger to
    refuse: a record's fields as the ledgers read them, in an object of their own
    (compiled, a UsageRecord refuses a None request_id itself, before any store sees it)."""
    from dataclasses import fields
    from types import SimpleNamespace

    from fallback_mw.budget import UsageRecord

    good = UsageRecord("refused", "chat", "t")
    values = {f.name: getattr(good, f.name) for f in fields(UsageRecord)}
    return SimpleNamespace(**{**values, "request_id": None}, fault=False)
