"""Two real gateway processes (`fallback-mw serve` on uvicorn) share one breaker through
the real Redis: one trips it, the other skips the upstream at once."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from tests.helpers import free_port, serve_process, wait_listening
from tests.upstreams import status_handler, upstream

pytestmark = pytest.mark.e2e


@pytest.mark.anyio
async def test_two_processes_share_a_breaker_through_redis(redis_url: str, tmp_path: Path) -> None:
    async with upstream(status_handler(503)) as primary, upstream(status_handler(200)) as backup:
        config = tmp_path / "gateway.toml"
        config.write_text(
            f"""
[gateway]
state = "{redis_url}"

[gateway.breaker]
window = 10
min_calls = 3
failure_rate = 0.5
cooldown_ms = 60000

[upstreams.primary]
url = "{primary.url}"

[upstreams.backup]
url = "{backup.url}"

[[routes]]
id = "chat"
prefix = "/v1/"
plan = ["primary", "backup"]
retries = 1
backoff_ms = 0
"""
        )
        ports = [free_port(), free_port()]
        logs = [tmp_path / "one.log", tmp_path / "two.log"]
        with ExitStack() as stack:
            processes = [
                stack.enter_context(serve_process(config, port, log))
                for port, log in zip(ports, logs, strict=True)
            ]
            for process, port, log in zip(processes, ports, logs, strict=True):
                await wait_listening(process, port, log)
            async with httpx.AsyncClient(timeout=10) as client:
                one, two = (f"http://127.0.0.1:{port}/v1/chat" for port in ports)
                for _ in range(3):
                    response = await client.get(one)
                    assert response.status_code == 200
                    assert response.headers["x-gateway-attempts"] == "2"
                assert primary.count == 3
                for _ in range(3):
                    response = await client.get(two)
                    assert response.status_code == 200
                    assert response.headers["x-gateway-provider"] == "backup"
                    assert response.headers["x-gateway-attempts"] == "1"
                assert primary.count == 3
                assert backup.count == 6
