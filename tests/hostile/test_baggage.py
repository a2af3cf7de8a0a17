"""A caller's trace-context headers are never echoed to the process's output: the
OpenTelemetry propagators log an oversized or malformed `baggage` *with its value*."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from tests.helpers import free_port, log_text, serve_process, wait_listening
from tests.upstreams import status_handler, upstream

pytestmark = pytest.mark.anyio

MARKER = "caller-baggage-7c1e"


async def test_a_huge_or_malformed_baggage_header_never_reaches_stderr(tmp_path: Path) -> None:
    async with upstream(status_handler(200, b"ok")) as primary:
        config = tmp_path / "gateway.toml"
        config.write_text(
            f'[upstreams.primary]\nurl = "{primary.url}"\n\n'
            '[[routes]]\nid = "r"\nprefix = "/v1/"\nplan = ["primary"]\n',
            encoding="utf-8",
        )
        env = dict(os.environ, OTEL_TRACES_EXPORTER="console", OTEL_METRICS_EXPORTER="none")
        port = free_port()
        log = tmp_path / "serve.log"
        huge = "k=" + MARKER + "x" * 60_000
        malformed = f"{MARKER} no equals sign, =={MARKER}"
        with serve_process(config, port, log, env=env) as process:
            await wait_listening(process, port, log)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                for value in (huge, malformed):
                    response = await client.get("/v1/x", headers={"baggage": value})
                    assert response.status_code == 200
    output = log_text(log)
    assert '"name": "gateway.request"' in output  # the console exporter did run
    assert MARKER not in output
