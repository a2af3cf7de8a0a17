"""`fallback-mw serve` (and each worker of `serve --workers N`) under a soft open-file limit
below its hard one, as systemd starts every service (LimitNOFILE: soft 1024, hard 524288):
idle connections past the soft limit must not shut callers out."""

from __future__ import annotations

import contextlib
import re
import resource
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import pytest

from tests.helpers import free_port, log_text, serve_process, wait_listening
from tests.upstreams import status_handler, upstream

pytestmark = pytest.mark.e2e

SOFT = 256  # the soft limit serve is started under (the hard one stays the host's)
RAISED = re.compile(r"open-file limit raised from 256 to (\d+) \(the hard limit\)")


@contextlib.contextmanager
def own_soft_limit(wanted: int) -> Iterator[None]:
    """This process's soft open-file limit at least `wanted` (for its idle connections)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < wanted + SOFT * 4:
        pytest.skip(f"the hard open-file limit ({hard}) is too low for this test")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.anyio
@pytest.mark.parametrize("workers", [1, 2])
async def test_idle_connections_past_the_soft_open_file_limit_do_not_shut_callers_out(
    redis_url: str, tmp_path: Path, workers: int
) -> None:
    """Under systemd (soft 1024) each serve process had about a thousand descriptors for
    its callers' connections and its upstream ones together: a client holding a few
    hundred idle connections per worker left none, and until the head timeout closed
    them every new caller's connection was closed unanswered (uvloop's way out of EMFILE)
    or waited in the backlog; a request that got in failed over to nothing (503
    `host_limit`). serve now raises its soft limit to the hard one, and says so."""
    idle_count = (SOFT + 150) * workers
    config = tmp_path / "gateway.toml"
    async with upstream(status_handler(200)) as primary:
        config.write_text(
            f'[gateway]\nstate = "{redis_url}"\nheader_timeout_ms = 120000\n'
            f'[upstreams.primary]\nurl = "{primary.url}"\n'
            '[[routes]]\nid = "chat"\nprefix = "/v1/"\nplan = ["primary"]\n'
        )
        port, log = free_port(), tmp_path / "serve.log"
        soft_limited = ("bash", "-c", f'ulimit -Sn {SOFT} && exec "$@"', "bash")
        with (
            own_soft_limit(idle_count + 200),
            serve_process(
                config,
                port,
                log,
                options=("--workers", str(workers)),
                executable=(*soft_limited, sys.executable, "-m", "fallback_mw"),
            ) as process,
        ):
            await wait_listening(process, port, log)
            deadline = time.monotonic() + 60
            while log_text(log).count("Application startup complete") < workers:
                assert process.poll() is None and time.monotonic() < deadline, log_text(log)
                await anyio.sleep(0.05)
            idle: list[socket.socket] = []
            try:
                for _ in range(idle_count):
                    idle.append(socket.create_connection(("127.0.0.1", port), timeout=10))
                await anyio.sleep(1.0)  # the workers accept them (or fail to)
                assert process.poll() is None, log_text(log)
                # New connections each (spread over the workers): every caller answered.
                statuses = []
                for _ in range(4 * workers):
                    async with httpx.AsyncClient(timeout=5) as client:
                        try:
                            response = await client.get(f"http://127.0.0.1:{port}/v1/chat")
                            statuses.append(str(response.status_code))
                        except httpx.TransportError as exc:
                            statuses.append(type(exc).__name__)
                assert statuses == ["200"] * (4 * workers), log_text(log)[-3000:]
            finally:
                for sock in idle:
                    sock.close()
            raised = RAISED.findall(log_text(log))
            assert len(raised) == workers, log_text(log)[-3000:]
            assert all(int(limit) > SOFT for limit in raised)
