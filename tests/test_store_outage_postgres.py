"""A PostgreSQL outage under traffic (issue 20): `fallback-mw serve` with a PostgreSQL route
store and budget ledger, a PostgreSQL of this test's own (initdb + pg_ctl into a temporary
directory, on a free port) stopped for a few seconds while requests flow, then started
again.

What must hold: routes without a budget serve throughout (from the routes in memory);
budgeted routes fail closed with 503 `budget_unavailable` and serve again once the
database is back; the log says each outage (route store, ledger) once when it starts and
once when it ends — no traceback, no per-request line, no reloader task started and lost
per request."""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import shutil
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import httpx
import pytest
from aiohttp import web

from tests.conftest import IN_CI
from tests.helpers import free_port, log_text, serve_process
from tests.upstreams import upstream

pytestmark = pytest.mark.anyio


def _pg_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(found[-1]).parent if found else None


class OwnPostgres:
    """A throwaway cluster: trust auth, 127.0.0.1 only, fsync off. Run as the `postgres`
    OS user when this process is root (PostgreSQL refuses to run as root)."""

    def __init__(self, bin_dir: Path, root: Path, port: int) -> None:
        self.bin_dir = bin_dir
        self.data = root / "data"
        self.log = root / "postgres.log"
        self.socket_dir = root
        self.port = port
        self.url = f"postgresql://postgres@127.0.0.1:{port}/postgres"

    def _run(self, tool: str, *args: str) -> None:
        command = [str(self.bin_dir / tool), *args]
        if os.geteuid() == 0:
            command = ["runuser", "-u", "postgres", "--", *command]
        subprocess.run(command, check=True, capture_output=True, timeout=60)

    def init(self) -> None:
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "--no-sync")

    def start(self) -> None:
        options = (
            f"-p {self.port} -k {self.socket_dir} -c listen_addresses=127.0.0.1 "
            "-c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        )
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "start")

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")


@pytest.fixture
def own_postgres() -> Iterator[OwnPostgres]:
    bin_dir = _pg_bin()
    if bin_dir is None or (shutil.which("runuser") is None and os.geteuid() == 0):
        message = "initdb is not installed (/usr/lib/postgresql/*/bin): no PostgreSQL of our own"
        if IN_CI:
            pytest.fail(message + " (CI=true: a missing service is a failure)")
        pytest.skip(message)
    root = Path(tempfile.mkdtemp(prefix="fmw-own-pg-"))
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
    server = OwnPostgres(bin_dir, root, free_port())
    try:
        server.init()
        server.start()
        yield server
    finally:
        with contextlib.suppress(subprocess.SubprocessError):
            server.stop()
        shutil.rmtree(root, ignore_errors=True)


async def answer(request: web.Request) -> web.StreamResponse:
    return web.json_response({"ok": True, "usage": {"prompt_tokens": 3, "completion_tokens": 4}})


def write_config(path: Path, store: str, upstream_url: str) -> None:
    path.write_text(
        f"""
[gateway]
store = "{store}"
deadline_ms = 5000

[upstreams.up]
url = "{upstream_url}"

[[routes]]
id = "open"
prefix = "/open/"
plan = ["up"]

[[routes]]
id = "paid"
prefix = "/paid/"
plan = ["up"]
budget = "acme"

[budgets.acme]
limit = 1000
window = "month"
default_hold = 0.001
""",
        encoding="utf-8",
    )


@pytest.mark.slow
async def test_a_postgres_outage_under_traffic_is_two_log_lines_per_dependency(
    own_postgres: OwnPostgres, tmp_path: Path
) -> None:
    results: list[tuple[float, str, int, str]] = []  # (when, route, status, error code)
    async with upstream(answer) as up:
        config = tmp_path / "gateway.toml"
        write_config(config, own_postgres.url, up.url)
        port = free_port()
        log = tmp_path / "serve.log"
        with serve_process(config, port, log) as process:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
                started = time.monotonic()
                while True:
                    try:
                        if (await client.get("/paid/x")).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    assert process.poll() is None, log_text(log)
                    assert time.monotonic() - started < 30, "serve did not start"
                    await asyncio.sleep(0.1)

                stop = asyncio.Event()

                async def traffic() -> None:
                    while not stop.is_set():
                        for route in ("open", "paid"):
                            try:
                                response = await client.get(f"/{route}/x")
                            except httpx.TransportError as exc:  # reported with the log
                                results.append((time.monotonic(), route, 0, repr(exc)))
                                continue
                            code = ""
                            if response.status_code != 200:
                                code = response.json()["error"]["code"]
                            results.append((time.monotonic(), route, response.status_code, code))
                        await asyncio.sleep(0.02)

                task = asyncio.create_task(traffic())
                try:
                    await asyncio.sleep(1.0)
                    await asyncio.to_thread(own_postgres.stop)
                    stopped_at = time.monotonic()
                    await asyncio.sleep(4.0)
                    restarting_at = time.monotonic()
                    await asyncio.to_thread(own_postgres.start)
                    restarted_at = time.monotonic()
                    # Back: budgeted routes serve again, and the reloader says so (its
                    # backoff is at most 5 s).
                    deadline = time.monotonic() + 30
                    while "route store reachable again" not in log_text(log) or not any(
                        when > restarted_at and route == "paid" and status == 200
                        for when, route, status, _ in results[-20:]
                    ):
                        assert time.monotonic() < deadline, log_text(log)
                        assert not task.done(), task
                        await asyncio.sleep(0.1)
                    await asyncio.sleep(0.5)
                finally:
                    stop.set()
                    await task
    text = log_text(log)
    during = [r for r in results if stopped_at + 0.5 < r[0] < restarting_at]
    assert during, "no traffic during the outage"
    # Routes without a budget served throughout; budgeted ones failed closed.
    assert all(status == 200 for _, route, status, _ in results if route == "open"), text
    paid = [(status, code) for _, route, status, code in during if route == "paid"]
    assert paid and all(item == (503, "budget_unavailable") for item in paid), Counter(paid)
    # Each outage: one WARNING when it starts, one when it ends; nothing per request.
    lines = text.splitlines()

    def count(fragment: str) -> int:
        return sum(fragment in line for line in lines)

    assert count("route store unreachable") == 1, text
    assert count("route store reachable again") == 1, text
    assert count("PostgreSQL ledger unreachable") == 1, text
    assert count("PostgreSQL ledger reachable again") == 1, text
    assert "Traceback" not in text, text
    assert "never retrieved" not in text, text
    assert count(" ERROR ") == 0, text
    requests_during = len(during)
    warnings = count(" WARNING fallback_mw.store") + count(" WARNING fallback_mw.budget")
    assert warnings == 4 < requests_during, (warnings, requests_during)
    # Nothing the outage refused before sending is lost: the usage records of the requests
    # served meanwhile (unbudgeted routes keep serving) are written once it ends. Only a
    # call that was on the wire when the database stopped can be lost (one or two).
    served_open = sum(1 for _, route, status, _ in results if route == "open" and status == 200)
    connection = await asyncpg.connect(own_postgres.url)
    try:
        recorded_open = await connection.fetchval(
            "SELECT count(*) FROM fmw_usage WHERE route = 'open'"
        )
    finally:
        await connection.close()
    assert served_open - 3 <= recorded_open <= served_open, (recorded_open, served_open)
    assert "usage records kept through the outage" in text, text
