"""`fallback-mw serve` exporting OTLP to a collector that accepts connections and never
answers (a hung collector, a firewall that swallows the packets): the gateway starts,
serves and stops promptly; what the exporters still held is dropped, said in one line."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
import httpx
import pytest

from fallback_mw.cli.otel_setup import TELEMETRY_FLUSH_SECONDS
from tests.helpers import free_port, log_text, serve_process, wait_listening
from tests.upstreams import status_handler, upstream

pytestmark = pytest.mark.e2e

COLLECTOR_KEY = "collector-key-5e0d81aa"


@contextmanager
def silent_collector() -> Iterator[str]:
    """A listener whose backlog takes every connection and never reads or answers one."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


@pytest.mark.anyio
async def test_serve_stops_promptly_when_the_otlp_collector_never_answers(
    tmp_path: Path,
) -> None:
    """SIGINT left serve flushing for 20 s (the span exporter's 10 s export timeout, then
    the metric exporter's), a second Ctrl-C ignored, nothing said until the SDK's own
    lines: past a supervisor's or Kubernetes' stop grace once requests had taken theirs."""
    port, log = free_port(), tmp_path / "serve.log"
    env = dict(
        os.environ,
        FMW_STOP_KEY="primary-key-0c4f",
        OTEL_EXPORTER_OTLP_HEADERS=f"authorization=Bearer%20{COLLECTOR_KEY}",
    )
    async with upstream(status_handler(200, b"ok")) as primary:
        config = tmp_path / "gateway.toml"
        config.write_text(
            f'[upstreams.primary]\nurl = "{primary.url}"\nauth_env = "FMW_STOP_KEY"\n'
            '[[routes]]\nid = "chat"\nprefix = "/v1/"\nplan = ["primary"]\n',
            encoding="utf-8",
        )
        with silent_collector() as collector:
            env["OTEL_EXPORTER_OTLP_ENDPOINT"] = collector
            with serve_process(config, port, log, env=env) as process:
                await wait_listening(process, port, log)
                async with httpx.AsyncClient(timeout=10) as client:
                    for _ in range(3):
                        response = await client.get(f"http://127.0.0.1:{port}/v1/chat")
                        assert response.status_code == 200
                started = time.monotonic()
                process.send_signal(signal.SIGINT)
                try:
                    status = process.wait(timeout=TELEMETRY_FLUSH_SECONDS + 5)
                except subprocess.TimeoutExpired:
                    pytest.fail(f"serve still flushing after SIGINT: {log_text(log)[-2000:]}")
                took = time.monotonic() - started
    text = log_text(log)
    assert status == 0, text
    assert took < TELEMETRY_FLUSH_SECONDS + 5
    assert text.count("telemetry export did not finish") == 1, text[-2000:]
    assert COLLECTOR_KEY not in text and "Traceback" not in text


@pytest.mark.anyio
async def test_an_otlp_endpoint_query_string_never_reaches_the_log(tmp_path: Path) -> None:
    """A collector key passed in the endpoint's query (`...?api-key=KEY`): every failed
    export's retry line (the SDK's "Transient error ... url: /?api-key=KEY/v1/traces")
    wrote the key to the log, several times a minute while the collector was down."""
    port, log = free_port(), tmp_path / "serve.log"
    with socket.socket() as closed:  # a port nothing listens on: connection refused
        closed.bind(("127.0.0.1", 0))
        refused = closed.getsockname()[1]
    env = dict(
        os.environ,
        FMW_STOP_KEY="primary-key-0c4f",
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{refused}/otlp?api-key={COLLECTOR_KEY}",
        OTEL_BSP_SCHEDULE_DELAY="100",
        OTEL_METRIC_EXPORT_INTERVAL="300",
    )
    async with upstream(status_handler(200, b"ok")) as primary:
        config = tmp_path / "gateway.toml"
        config.write_text(
            f'[upstreams.primary]\nurl = "{primary.url}"\nauth_env = "FMW_STOP_KEY"\n'
            '[[routes]]\nid = "chat"\nprefix = "/v1/"\nplan = ["primary"]\n',
            encoding="utf-8",
        )
        with serve_process(config, port, log, env=env) as process:
            await wait_listening(process, port, log)
            async with httpx.AsyncClient(timeout=10) as client:
                response = await client.get(f"http://127.0.0.1:{port}/v1/chat")
                assert response.status_code == 200
            deadline = time.monotonic() + 20
            # The log is a file another process writes: polled.
            while "Transient error" not in log_text(log):
                if time.monotonic() > deadline:
                    break
                await anyio.sleep(0.1)
            process.send_signal(signal.SIGINT)
            process.wait(timeout=TELEMETRY_FLUSH_SECONDS + 5)
    text = log_text(log)
    assert "Transient error" in text, text[-2000:]  # the line is still there, without the key
    assert "api-key" not in text and COLLECTOR_KEY not in text, text[-2000:]


@pytest.mark.anyio
async def test_a_second_ctrl_c_during_the_telemetry_flush_stops_serve_at_once(
    tmp_path: Path,
) -> None:
    """The first Ctrl-C stops the gateway and gives the exporters up to 3 s to send what
    they hold; a second one, as uvicorn's own second Ctrl-C does, stops at once: it was
    ignored, and serve went on waiting for a collector that never answers."""
    port, log = free_port(), tmp_path / "serve.log"
    env = dict(
        os.environ,
        FMW_STOP_KEY="primary-key-0c4f",
        OTEL_EXPORTER_OTLP_HEADERS=f"authorization=Bearer%20{COLLECTOR_KEY}",
    )
    async with upstream(status_handler(200, b"ok")) as primary:
        config = tmp_path / "gateway.toml"
        config.write_text(
            f'[upstreams.primary]\nurl = "{primary.url}"\nauth_env = "FMW_STOP_KEY"\n'
            '[[routes]]\nid = "chat"\nprefix = "/v1/"\nplan = ["primary"]\n',
            encoding="utf-8",
        )
        with silent_collector() as collector:
            env["OTEL_EXPORTER_OTLP_ENDPOINT"] = collector
            with serve_process(config, port, log, env=env) as process:
                await wait_listening(process, port, log)
                async with httpx.AsyncClient(timeout=10) as client:
                    response = await client.get(f"http://127.0.0.1:{port}/v1/chat")
                    assert response.status_code == 200
                process.send_signal(signal.SIGINT)
                # The line serve writes once the flush has lasted FLUSH_NOTICE_SECONDS. The
                # log is a file another process writes: polled.
                deadline = time.monotonic() + 30
                while "Ctrl-C again" not in log_text(log):
                    assert process.poll() is None, log_text(log)[-2000:]
                    assert time.monotonic() < deadline, log_text(log)[-2000:]
                    await anyio.sleep(0.02)
                started = time.monotonic()
                process.send_signal(signal.SIGINT)
                try:
                    status = process.wait(timeout=TELEMETRY_FLUSH_SECONDS + 10)
                except subprocess.TimeoutExpired:
                    pytest.fail(f"serve went on after a second Ctrl-C: {log_text(log)[-2000:]}")
                took = time.monotonic() - started
    text = log_text(log)
    assert took < TELEMETRY_FLUSH_SECONDS / 2, (took, text[-2000:])
    assert status == 0, text[-2000:]
    assert "telemetry export cut short by a second Ctrl-C" in text, text[-2000:]
    assert "did not finish within" not in text, text[-2000:]
    assert "interrupted" not in text and "shutdown can only be called once" not in text, text
    assert COLLECTOR_KEY not in text and "Traceback" not in text, text[-2000:]
