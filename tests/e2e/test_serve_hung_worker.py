"""`fallback-mw serve --workers N` with one worker hung (its event loop blocked, or the
process stopped): the kernel still hands it its share of new connections, so the
supervisor must notice and replace it."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import anyio
import httpx
import pytest

from tests.helpers import alive, free_port, log_text, serve_process, wait_listening
from tests.upstreams import status_handler, upstream

pytestmark = pytest.mark.e2e

STARTED = re.compile(r"Started server process \[(\d+)\]")


async def started(log: Path, count: int, process: object, limit: float = 60) -> list[int]:
    """The pids of the workers started so far, once there are `count`."""
    deadline = time.monotonic() + limit
    while len(found := STARTED.findall(log_text(log))) < count:
        assert time.monotonic() < deadline, log_text(log)
        await anyio.sleep(0.05)
    return [int(pid) for pid in found]


@pytest.mark.anyio
async def test_a_hung_worker_is_killed_and_replaced(redis_url: str, tmp_path: Path) -> None:
    """A worker whose event loop stops running (SIGSTOP here; a deadlock, a C call that
    never returns) kept its listening socket: every other new connection waited on it
    forever, and the supervisor said nothing (it watched for deaths only). Each worker's
    loop now beats; one silent for `--worker-timeout` seconds is named and SIGKILLed, and
    replaced as any worker that dies."""
    async with upstream(status_handler(200)) as primary:
        config = tmp_path / "gateway.toml"
        config.write_text(
            f'[gateway]\nstate = "{redis_url}"\n'
            f'[upstreams.primary]\nurl = "{primary.url}"\n'
            '[[routes]]\nid = "chat"\nprefix = "/v1/"\nplan = ["primary"]\n'
        )
        port, log = free_port(), tmp_path / "serve.log"
        options = ("--workers", "2", "--worker-timeout", "3")
        with serve_process(config, port, log, options=options) as process:
            await wait_listening(process, port, log)
            first = await started(log, 2, process)
            while "all 2 workers serving" not in log_text(log):
                assert process.poll() is None, log_text(log)
                await anyio.sleep(0.05)
            await anyio.sleep(5.5)  # past the start-up window: replaced at once
            hung = first[0]
            os.kill(hung, signal.SIGSTOP)
            try:
                pids = await started(log, 3, process, limit=20)
            finally:
                if alive(hung):
                    os.kill(hung, signal.SIGCONT)
            text = log_text(log)
            assert (
                f"fallback-mw: worker {hung} has not run its event loop for 3 s (hung); killing it"
            ) in text, text
            assert f"worker {hung} was killed by SIGKILL; starting another" in text, text
            assert not alive(hung)
            replacement = pids[2]
            deadline = time.monotonic() + 30
            while text.count("Application startup complete") < 3:
                assert time.monotonic() < deadline, text
                await anyio.sleep(0.05)
                text = log_text(log)
            # New connections, spread over the two live workers: every one answered.
            for _ in range(10):
                async with httpx.AsyncClient(timeout=5) as client:
                    response = await client.get(f"http://127.0.0.1:{port}/v1/chat")
                assert response.status_code == 200
            assert alive(replacement) and alive(first[1])
            # Serving workers under no load are never taken for hung.
            await anyio.sleep(3)
            assert log_text(log).count("(hung)") == 1, log_text(log)
            process.send_signal(signal.SIGINT)
            assert process.wait(timeout=30) == 0, log_text(log)
