"""Budgets over real sockets: a client that leaves mid-stream (uvicorn in process), and two
gateway processes (`fallback-mw serve`) holding against one PostgreSQL ledger."""

from __future__ import annotations

import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import uvicorn
from aiohttp import web
from anyio.abc import SocketStream

from fallback_mw import Gateway
from fallback_mw.config import BudgetConfig
from fallback_mw.store.ledgers import open_ledger
from tests.helpers import (
    SIGHUP_AT_ITS_DEFAULT,
    free_port,
    log_text,
    serve_process,
    wait_listening,
)
from tests.test_budget_guard import gateway_config, host_app, json_handler
from tests.upstreams import Handler, upstream

pytestmark = [pytest.mark.e2e, pytest.mark.anyio]

BUDGET = BudgetConfig(limit=Decimal("0.05"), window="month")


@asynccontextmanager
async def serving(app: Any) -> AsyncIterator[int]:
    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, log_level="warning", lifespan="off", ws="none"
    )
    server = uvicorn.Server(config)
    async with anyio.create_task_group() as group:
        group.start_soon(server.serve)
        for _ in range(500):
            if server.started:
                break
            await anyio.sleep(0.02)
        assert server.started, "uvicorn did not start"
        port: int = server.servers[0].sockets[0].getsockname()[1]
        try:
            yield port
        finally:
            server.should_exit = True


def slow_sse(first_events: int, then_sleep: float) -> Handler:
    async def handle(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for n in range(first_events):
            await response.write(f'data: {{"n": {n}}}\n\n'.encode())
        try:
            await anyio.sleep(then_sleep)  # the rest never comes in time
            await response.write(b'data: {"usage":{"prompt_tokens":1,"completion_tokens":1}}\n\n')
        except (ConnectionResetError, OSError):
            pass
        return response

    return handle


async def stream_started(port: int) -> SocketStream:
    """A chat POST on a raw connection, read until its 200 and first event have arrived."""
    stream = await anyio.connect_tcp("127.0.0.1", port)
    await stream.send(
        b"POST /v1/chat HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
        b"content-length: 2\r\n\r\n{}"
    )
    head = b""
    with anyio.fail_after(5):
        while b"data:" not in head:
            head += await stream.receive()
    assert head.startswith(b"HTTP/1.1 200")
    return stream


async def test_client_leaving_mid_stream_leaves_no_hold(ledger_store: str) -> None:
    async with upstream(slow_sse(first_events=3, then_sleep=5)) as primary:
        gateway = Gateway(
            host_app, config=gateway_config({"primary": primary.url}, store=ledger_store)
        )
        ledger = gateway.services.ledger
        assert ledger is not None
        try:
            async with serving(gateway) as port:
                stream = await stream_started(port)
                status = await ledger.status("acme", BUDGET)
                assert status.held == Decimal("0.01")  # the stream is in flight, held
                await stream.aclose()  # the client leaves mid-stream

                for _ in range(80):  # 4 s: well before the upstream's 5 s would end it
                    if (await ledger.status("acme", BUDGET)).held == 0:
                        break
                    await anyio.sleep(0.05)
            status = await ledger.status("acme", BUDGET)
            # Served in part, no usage reported: settled at the hold, nothing left held.
            assert (status.spent, status.held) == (Decimal("0.01"), Decimal(0))
            (record,) = await ledger.usage()
            assert record.chosen == "primary"
            assert record.charged == Decimal("0.01")
        finally:
            await gateway.aclose()


async def test_two_gateway_processes_share_one_postgres_ledger(tmp_path: Path, pg_url: str) -> None:
    async with upstream(json_handler({"ok": True}, delay=0.5)) as primary:
        config_path = tmp_path / "gateway.toml"
        config = gateway_config({"primary": primary.url}, store=pg_url)
        config_path.write_text(
            f"""
[gateway]
store = "{pg_url}"
deadline_ms = 10000

[upstreams.primary]
url = "{primary.url}"

[[routes]]
id = "chat"
prefix = "/v1/"
plan = ["primary"]
replayable_methods = ["GET", "POST"]
budget = "acme"

[budgets.acme]
limit = {config["budgets"]["acme"]["limit"]}
window = "month"
default_hold = {config["budgets"]["acme"]["default_hold"]}
""",
            encoding="utf-8",
        )
        ports = [free_port(), free_port()]
        logs = [tmp_path / "a.log", tmp_path / "b.log"]
        with (
            serve_process(config_path, ports[0], logs[0]) as first,
            serve_process(config_path, ports[1], logs[1]) as second,
        ):
            await wait_listening(first, ports[0], logs[0])
            await wait_listening(second, ports[1], logs[1])
            statuses: list[int] = []

            async def one(client: httpx.AsyncClient) -> None:
                statuses.append((await client.post("/v1/chat", content=b"{}")).status_code)

            async with (
                httpx.AsyncClient(base_url=f"http://127.0.0.1:{ports[0]}", timeout=20) as a,
                httpx.AsyncClient(base_url=f"http://127.0.0.1:{ports[1]}", timeout=20) as b,
                anyio.create_task_group() as group,
            ):
                for n in range(20):
                    group.start_soon(one, a if n % 2 else b)
        assert sorted(statuses) == [200] * 5 + [402] * 15
        assert primary.count == 5
    ledger = open_ledger(pg_url)
    try:
        status = await ledger.status("acme", BUDGET)
        assert (status.spent, status.held) == (Decimal("0.05"), Decimal(0))
        assert len(await ledger.usage()) == 20
    finally:
        await ledger.aclose()


def endless_stream_config(tmp_path: Path, store: str, url: str) -> Path:
    """A budgeted route to `url` (a stream that never ends) whose deadline and idle bound
    outlast the test: only a stop of `serve` cuts it."""
    path = tmp_path / "gateway.toml"
    path.write_text(
        f"""
[gateway]
store = "{store}"
deadline_ms = 120000

[upstreams.primary]
url = "{url}"
idle_timeout_ms = 120000

[[routes]]
id = "chat"
prefix = "/v1/"
plan = ["primary"]
budget = "acme"

[budgets.acme]
limit = 0.05
window = "month"
default_hold = 0.01
""",
        encoding="utf-8",
    )
    return path


async def test_a_stop_cuts_an_endless_stream_after_the_graceful_timeout_and_settles_it(
    tmp_path: Path,
) -> None:
    """SIGTERM while a stream that never ends is in flight: `serve` waits
    `--timeout-graceful-shutdown`, then cuts it, settles its hold and exits 0 (without the
    bound it waited for the stream for ever)."""
    store = f"sqlite:///{tmp_path / 'ledger.db'}"
    async with upstream(slow_sse(first_events=2, then_sleep=120)) as primary:
        config_path = endless_stream_config(tmp_path, store, primary.url)
        port, log = free_port(), tmp_path / "serve.log"
        with serve_process(
            config_path, port, log, options=("--timeout-graceful-shutdown", "1")
        ) as process:
            await wait_listening(process, port, log)
            stream = await stream_started(port)
            started = anyio.current_time()
            process.send_signal(signal.SIGTERM)
            while process.poll() is None:
                assert anyio.current_time() - started < 8, log_text(log)
                await anyio.sleep(0.05)
            assert process.returncode == 0, log_text(log)
            assert anyio.current_time() - started >= 0.9  # it did wait for the stream
            await stream.aclose()
            # The cut is recorded as the host's, not as the gateway's internal error, and
            # uvicorn's traceback for it is one line.
            text = log_text(log)
            assert "outcome=cancelled" in text, text
            assert "internal_error" not in text and "Traceback" not in text, text
            assert "outlasted --timeout-graceful-shutdown" in text, text
    ledger = open_ledger(store)
    try:
        status = await ledger.status("acme", BUDGET)
        # Cut short with no usage reported: charged the hold, nothing left held.
        assert (status.spent, status.held) == (Decimal("0.01"), Decimal(0))
        assert [record.outcome for record in await ledger.usage()] == ["cancelled"]
    finally:
        await ledger.aclose()


async def test_a_hangup_stops_serve_as_sigterm_does_and_settles_the_stream_in_flight(
    tmp_path: Path,
) -> None:
    """SIGHUP (the terminal or ssh session that started `serve` closed) while a budgeted
    stream is in flight: uvicorn handles only SIGINT and SIGTERM, so the default action
    killed `serve` at once (exit -1), the stream's hold stayed held for an hour and its
    request line was never written. Now it is a stop like SIGTERM (as it is for
    `serve --workers N`): the stream is cut after the graceful timeout, settled, exit 0."""
    store = f"sqlite:///{tmp_path / 'ledger.db'}"
    async with upstream(slow_sse(first_events=2, then_sleep=120)) as primary:
        config_path = endless_stream_config(tmp_path, store, primary.url)
        port, log = free_port(), tmp_path / "serve.log"
        # SIGHUP at its default in serve, whatever this process inherited: a run under
        # `nohup` ignores it, and so, rightly, does serve then (it failed so under CI).
        with serve_process(
            config_path,
            port,
            log,
            options=("--timeout-graceful-shutdown", "1"),
            executable=(*SIGHUP_AT_ITS_DEFAULT, sys.executable, "-m", "fallback_mw"),
        ) as process:
            await wait_listening(process, port, log)
            stream = await stream_started(port)
            started = anyio.current_time()
            process.send_signal(signal.SIGHUP)
            while process.poll() is None:
                assert anyio.current_time() - started < 8, log_text(log)
                await anyio.sleep(0.05)
            assert process.returncode == 0, log_text(log)
            await stream.aclose()
            text = log_text(log)
            assert "outcome=cancelled" in text, text
            assert "Traceback" not in text, text
            assert "Application shutdown complete" in text, text  # the gateway was closed
    ledger = open_ledger(store)
    try:
        status = await ledger.status("acme", BUDGET)
        assert (status.spent, status.held) == (Decimal("0.01"), Decimal(0))
        assert [record.outcome for record in await ledger.usage()] == ["cancelled"]
    finally:
        await ledger.aclose()


async def test_a_second_ctrl_c_cuts_settles_and_closes_without_a_traceback(
    tmp_path: Path,
) -> None:
    """Ctrl-C twice (uvicorn's force quit) while a budgeted stream is in flight: uvicorn
    stopped waiting and skipped the lifespan shutdown; the event loop's teardown cancelled
    the stream and the lifespan task, which printed "Exception in 'lifespan' protocol" with
    a traceback, the cut was said to have "outlasted --timeout-graceful-shutdown" (it had
    not), and the gateway was never closed. Now the stream is cut at once, settled, its
    line says why, and the lifespan shutdown runs: exit 0, no traceback."""
    store = f"sqlite:///{tmp_path / 'ledger.db'}"
    async with upstream(slow_sse(first_events=2, then_sleep=120)) as primary:
        config_path = endless_stream_config(tmp_path, store, primary.url)
        port, log = free_port(), tmp_path / "serve.log"
        with serve_process(config_path, port, log) as process:  # the default 25 s wait
            await wait_listening(process, port, log)
            stream = await stream_started(port)
            process.send_signal(signal.SIGINT)
            while "Waiting for connections to close" not in log_text(log):
                assert process.poll() is None, log_text(log)
                await anyio.sleep(0.02)
            started = anyio.current_time()
            process.send_signal(signal.SIGINT)  # the second Ctrl-C: stop now
            while process.poll() is None:
                assert anyio.current_time() - started < 8, log_text(log)
                await anyio.sleep(0.05)
            assert process.returncode == 0, log_text(log)
            await stream.aclose()
            text = log_text(log)
            assert "Traceback" not in text and "Exception in 'lifespan'" not in text, text
            assert "cut by a forced stop (a second Ctrl-C)" in text, text
            assert "outlasted --timeout-graceful-shutdown" not in text, text
            assert "outcome=cancelled" in text, text
            assert "Application shutdown complete" in text, text  # the gateway was closed
    ledger = open_ledger(store)
    try:
        status = await ledger.status("acme", BUDGET)
        assert (status.spent, status.held) == (Decimal("0.01"), Decimal(0))
        assert [record.outcome for record in await ledger.usage()] == ["cancelled"]
    finally:
        await ledger.aclose()


async def test_a_second_sigint_to_serve_workers_cuts_settles_and_exits_at_once(
    tmp_path: Path, redis_url: str
) -> None:
    """`serve --workers 2` sent SIGINT twice (Ctrl-C twice under `docker run` without a
    terminal, whose signal proxy reaches the supervisor alone; `kill -INT` twice) while a
    budgeted stream is in flight. The supervisor passed each stop on as a SIGTERM, so the
    second was no forced stop: the workers waited the whole --timeout-graceful-shutdown,
    unlike one `serve`. Now a SIGINT after a stop reaches the workers as a SIGINT: the
    stream is cut at once, settled, and the supervisor exits 0."""
    store = f"sqlite:///{tmp_path / 'ledger.db'}"
    async with upstream(slow_sse(first_events=2, then_sleep=120)) as primary:
        config_path = endless_stream_config(tmp_path, store, primary.url)
        text = config_path.read_text(encoding="utf-8")
        config_path.write_text(
            text.replace("[gateway]\n", f'[gateway]\nstate = "{redis_url}"\n'), encoding="utf-8"
        )
        port, log = free_port(), tmp_path / "serve.log"
        with serve_process(config_path, port, log, options=("--workers", "2")) as process:
            await wait_listening(process, port, log)
            while "all 2 workers serving" not in log_text(log):
                assert process.poll() is None, log_text(log)
                await anyio.sleep(0.05)
            stream = await stream_started(port)
            process.send_signal(signal.SIGINT)
            while "Waiting for connections to close" not in log_text(log):
                assert process.poll() is None, log_text(log)
                await anyio.sleep(0.02)
            started = anyio.current_time()
            process.send_signal(signal.SIGINT)  # the second: stop now (the default 25 s wait)
            while process.poll() is None:
                assert anyio.current_time() - started < 8, log_text(log)
                await anyio.sleep(0.05)
            assert process.returncode == 0, log_text(log)
            await stream.aclose()
            text = log_text(log)
            assert "Traceback" not in text, text
            assert "cut by a forced stop (a second Ctrl-C)" in text, text
            assert "outcome=cancelled" in text, text
    ledger = open_ledger(store)
    try:
        status = await ledger.status("acme", BUDGET)
        assert (status.spent, status.held) == (Decimal("0.01"), Decimal(0))
        assert [record.outcome for record in await ledger.usage()] == ["cancelled"]
    finally:
        await ledger.aclose()
