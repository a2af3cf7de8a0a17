"""`fallback-mw gameday` against two real `fallback-mw serve` processes sharing a SQLite
store, with traffic driven by the test: a run whose predictions pass, a run that aborts
on a criterion and leaves no fault behind, and Ctrl-C / a killed command."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from fallback_mw.store.routes import open_store
from tests.helpers import free_port, serve_process, wait_listening
from tests.upstreams import status_handler, upstream

pytestmark = [pytest.mark.e2e, pytest.mark.anyio]

# The shipped entry point, as an operator runs it.
GAMEDAY = [str(Path(sys.executable).with_name("fallback-mw")), "gameday"]


def _config(tmp_path: Path, store: str, primary: str, backup: str, solo: str) -> Path:
    path = tmp_path / "gateway.toml"
    path.write_text(
        f"""
[gateway]
store = "{store}"

[gateway.breaker]
min_calls = 3
cooldown_ms = 500

[upstreams.primary]
url = "{primary}"

[upstreams.backup]
url = "{backup}"

[upstreams.solo]
url = "{solo}"

[[routes]]
id = "chat"
prefix = "/chat/"
plan = ["primary", "backup"]
retries = 1

[[routes]]
id = "solo"
prefix = "/solo/"
plan = ["solo"]
"""
    )
    return path


@dataclass
class Traffic:
    """Requests to both gateways in turn, until stopped; the statuses it saw by route."""

    urls: list[str]
    statuses: dict[str, list[int]] = field(default_factory=dict)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def wait_for(self, ready: Callable[[], bool]) -> None:
        """Until `ready()` holds (at most 30 s)."""
        async with asyncio.timeout(30), self.changed:
            await self.changed.wait_for(ready)

    async def drive(self) -> None:
        async with httpx.AsyncClient(timeout=10) as client:
            n = 0
            while not self.stop.is_set():
                for route in ("chat", "solo"):
                    url = f"{self.urls[n % len(self.urls)]}/{route}/v1/models"
                    with contextlib.suppress(httpx.HTTPError):
                        response = await client.get(url)
                        self.statuses.setdefault(route, []).append(response.status_code)
                    async with self.changed:
                        self.changed.notify_all()
                n += 1
                await asyncio.sleep(0.02)


@dataclass
class Rig:
    config: Path
    store: str
    traffic: Traffic
    tmp_path: Path


@asynccontextmanager
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    store = f"sqlite:///{tmp_path / 'store.db'}"
    async with (
        upstream(status_handler(200, b"primary")) as primary,
        upstream(status_handler(200, b"backup")) as backup,
        upstream(status_handler(200, b"solo")) as solo,
    ):
        config = _config(tmp_path, store, primary.url, backup.url, solo.url)
        ports = [free_port(), free_port()]
        logs = [tmp_path / "gw1.log", tmp_path / "gw2.log"]
        with (
            serve_process(config, ports[0], logs[0]) as first,
            serve_process(config, ports[1], logs[1]) as second,
        ):
            await wait_listening(first, ports[0], logs[0])
            await wait_listening(second, ports[1], logs[1])
            traffic = Traffic([f"http://127.0.0.1:{p}" for p in ports])
            task = asyncio.create_task(traffic.drive())
            try:
                # Both gateways warm (each has served the route twice).
                await traffic.wait_for(lambda: len(traffic.statuses.get("chat", [])) >= 4)
                yield Rig(config, store, traffic, tmp_path)
            finally:
                traffic.stop.set()
                await task


async def gameday(*args: str) -> tuple[int, str, str]:
    if "--owner" not in args:
        args = (*args, "--owner", "Ana")
    process = await asyncio.create_subprocess_exec(
        *GAMEDAY, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def stored_faults(store: str) -> list[Any]:
    route_store = open_store(store)
    try:
        return await route_store.load_faults()
    finally:
        await route_store.aclose()


async def test_a_game_day_whose_predictions_pass(tmp_path: Path) -> None:
    async with rig(tmp_path) as r:
        out = tmp_path / "pass.json"
        status, stdout, stderr = await gameday(
            *("--config", str(r.config), "--route", "chat", "--fault", "fail"),
            *("--duration", "6s", "--out", str(out)),
            *("--predict", "breaker_open_s=5", "--predict", "first_fallback_s=5"),
            *("--predict", "error_rate=1%", "--predict", "p99_ms=3000"),
            *("--abort", "error_rate=20%/2s", "--abort", "p99_ms=6000"),
        )
        assert await stored_faults(r.store) == []
    assert status == 0, stdout + stderr
    report = json.loads(out.read_text())
    assert report["status"] == "completed" and report["abort"] is None
    assert [p["result"] for p in report["predictions"]] == ["pass"] * 4
    observed = report["observed"]
    assert observed["requests"] > 10
    assert observed["errors"] == 0
    assert observed["fallbacks"] > 0  # the backup carried the route while the fault was set
    assert observed["breaker_open_s"] is not None
    assert observed["durations_recorded"] == observed["requests"]
    assert report["fault"]["target"] == "primary"
    assert "PASS" in stdout and "FAIL" not in stdout
    assert stderr == ""


async def test_a_game_day_that_aborts_leaves_no_fault(tmp_path: Path) -> None:
    async with rig(tmp_path) as r:
        out = tmp_path / "abort.json"
        started = time.time()
        status, stdout, stderr = await gameday(
            *("--config", str(r.config), "--route", "solo", "--fault", "fail"),
            *("--duration", "60s", "--out", str(out)),
            *("--predict", "error_rate=1%", "--abort", "error_rate=10%/2s"),
        )
        faults_after = await stored_faults(r.store)
        finished = time.time()
        report = json.loads(out.read_text())
        # The one-action revert worked: the route serves again once the gateways reload.
        seen = len(r.traffic.statuses["solo"])
        await r.traffic.wait_for(lambda: 200 in r.traffic.statuses["solo"][seen:])
    assert status == 1, stdout + stderr
    assert faults_after == []
    assert report["status"] == "aborted"
    assert report["abort"]["criterion"] == "error_rate=10%/2s"
    assert report["abort"]["observed"] > 0.10
    # Cleared long before its expiry: the abort, not the clock, ended it.
    expires = report["fault"]["expires_at"]
    assert expires is not None and finished < started + 60
    assert report["predictions"][0]["result"] == "fail"
    assert "ABORT" in stdout
    assert stderr.splitlines() == [
        "fallback-mw: error: game day aborted on error_rate=10%/2s; fault cleared"
    ]


async def test_ctrl_c_clears_the_fault_and_a_killed_command_leaves_it_to_expire(
    tmp_path: Path,
) -> None:
    async with rig(tmp_path) as r:
        for how, duration in ((signal.SIGINT, "60s"), (signal.SIGKILL, "3s")):
            out = tmp_path / f"{how.name}.json"
            process = await asyncio.create_subprocess_exec(
                *GAMEDAY,
                *("--config", str(r.config), "--route", "chat", "--fault", "fail"),
                *("--duration", duration, "--out", str(out)),
                *("--predict", "error_rate=1%", "--abort", "error_rate=50%/5s"),
                *("--owner", "Ana"),
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            deadline = time.monotonic() + 30
            while not await stored_faults(r.store):
                assert time.monotonic() < deadline, "the fault was never set"
                await asyncio.sleep(0.05)
            (fault,) = await stored_faults(r.store)
            process.send_signal(how)
            stdout, _ = await asyncio.wait_for(process.communicate(), 30)
            if how == signal.SIGINT:
                assert process.returncode == 130, stdout
                assert await stored_faults(r.store) == []
                assert json.loads(out.read_text())["status"] == "interrupted"
                continue
            # Killed: nothing could clear it, but its expiry is in the store, no later
            # than the end the operator asked for (recorded before watching began).
            recorded = json.loads(out.read_text())
            assert recorded["status"] == "running"
            assert recorded["predictions"][0]["prediction"] == "error_rate=1%"
            set_at = _epoch(recorded["fault"]["set_at"])
            assert fault.expires_at <= set_at + 3 + 0.01
            await asyncio.sleep(max(fault.expires_at + 0.5 - time.time(), 0))
            assert await stored_faults(r.store) == []


def _epoch(iso: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()
